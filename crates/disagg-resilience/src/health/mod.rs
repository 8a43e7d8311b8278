//! Endpoint health: a circuit breaker per endpoint and leg fed by real traffic, optional
//! active checks, and [`HealthSource`], an [`EndpointSource`] that leaves the unhealthy
//! endpoints out of the set it publishes.
//!
//! # Passive ejection: the circuit breaker
//!
//! Each endpoint has a breaker per leg: an engine configured for both roles appears as
//! two [`Endpoint`]s, and a failing prefill leg says nothing about the same engine's
//! decode leg. An orchestrator built over a [`HealthSource`] reports each leg's result
//! to its [`Health`] (the source's [`listener`](EndpointSource::listener)); anyone else
//! may call [`Health::record`].
//!
//! ```text
//!                  failure_threshold failures in a row
//!      +--------+ ------------------------------------> +-------------------+
//!      | Closed |                                       | Open (ejected)    |
//!      | routed | <---+                                 | not routed until  |
//!      +--------+     | success                         | now + t           |
//!                     | (t back to base_ejection)       +-------------------+
//!                +----------+                             |            ^
//!                | HalfOpen | <---------------------------+            |
//!                | routed   |   t elapses (nobody has to call record)  |
//!                +----------+ ------------------------------------------+
//!                               failure: t = min(2t, max_ejection)
//! ```
//!
//! - **Closed**: routed; `failure_threshold` consecutive failures open the breaker. A
//!   success resets the count.
//! - **Open**: left out of the published set for `t`, `base_ejection` at the first
//!   ejection. Results of requests sent before the ejection are ignored.
//! - **HalfOpen**: when `t` is over the endpoint is routed again and the next result
//!   decides: a success closes the breaker and resets `t` to `base_ejection`, a failure
//!   opens it again for twice the time, at most `max_ejection`.
//!
//! A decode that fails after a prefill handed it KV is also evidence against the
//! prefill, once that prefill's handoffs failed on two decodes in a row (with no
//! handoff of its loaded between): then its KV is what no decode can load, and the
//! failure counts against it too (the [`Listener`] impl's `lost_kv`).
//!
//! # Active checks
//!
//! When the embedder runs [`Health::run_checks`], every engine is asked `GET /health`
//! (by default) every `interval`: a 2xx within `timeout` is a pass, anything else (another
//! status, a refused connection, a timeout) a failure. `unhealthy_threshold` failures in a
//! row mark the engine **Down** (not routed), `healthy_threshold` passes bring it back.
//! An engine is checked once per authority (`host:port`), not once per data-parallel
//! rank or role, and the verdict applies to every endpoint at that authority. Down is
//! independent of the breaker: an endpoint is routed when it is not Down and its breaker
//! is not Open.
//!
//! # When an ejected endpoint returns
//!
//! The return after the ejection time needs no timer task: the
//! [`snapshot`](EndpointSource::snapshot) of a [`HealthSource`] (called once per request)
//! refreshes the published set lazily. Its fast path is one
//! atomic load (the earliest end of an ejection, `u64::MAX` when none is pending, so the
//! clock is read only while something is ejected) and one pointer comparison against the
//! inner source's current set (a read of the inner channel, no clone); only when one of
//! them says so does it take the refresh lock and rebuild. This keeps routing right for an
//! embedder that spawns nothing. Watchers of [`HealthSource::watch`] see ejections at
//! once (a [`record`](Health::record) that opens a breaker republishes), and see returns
//! and inner changes at the next snapshot, or on time while [`Health::run_checks`] runs
//! (it follows the inner source and wakes at the end of each ejection).
//!
//! # Examples
//!
//! ```
//! use std::sync::Arc;
//! use disagg_core::endpoint::{Endpoint, Role};
//! use disagg_resilience::health::{EndpointHealth, HealthConfig, HealthSource};
//! use disagg_core::source::{EndpointSource, StaticSource};
//!
//! let source = HealthSource::new(
//!     StaticSource::new([
//!         Endpoint::new("http://127.0.0.1:8100", Role::Prefill)?,
//!         Endpoint::new("http://127.0.0.1:8200", Role::Decode)?,
//!     ]),
//!     HealthConfig::default(),
//! );
//! let health = Arc::clone(source.health());
//! let prefill = Arc::clone(&source.snapshot().by_role(Role::Prefill)[0]);
//! for _ in 0..5 {
//!     health.record(&prefill, false); // e.g. the prefill leg answered 500
//! }
//! assert!(matches!(health.state(&prefill), Some(EndpointHealth::Ejected { .. })));
//! assert!(source.snapshot().by_role(Role::Prefill).is_empty());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http::Uri;
use http::uri::{Authority, PathAndQuery};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::lock;
use disagg_core::endpoint::{Endpoint, EndpointId, EndpointSet, Role};
use disagg_core::error::TransportError;
use disagg_core::outcome::{EngineCall, LegOutcome, Listener, Outcome, Report};
use disagg_core::source::EndpointSource;
use disagg_core::transport::{Transport, read_limited};

mod breaker;
mod checks;
mod metrics;
mod source;

use breaker::*;
use checks::*;
pub use source::HealthSource;

/// Health settings: the passive circuit breaker and the active checks.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use disagg_resilience::health::HealthConfig;
///
/// let mut config = HealthConfig::default();
/// config.failure_threshold = 3;
/// config.checks.interval = Duration::from_secs(2);
/// assert_eq!(config.ejection_time(1), Duration::from_secs(5));
/// assert_eq!(config.ejection_time(3), Duration::from_secs(20));
/// assert_eq!(config.ejection_time(10), Duration::from_secs(60));
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct HealthConfig {
    /// Consecutive failures of one endpoint on its leg that eject it. Default 5; 0
    /// turns passive ejection off.
    pub failure_threshold: u32,
    /// How long the first ejection lasts. Default 5 s.
    pub base_ejection: Duration,
    /// The longest ejection: each repeated ejection doubles the time up to this. Default
    /// 60 s.
    pub max_ejection: Duration,
    /// The active checks, used while [`Health::run_checks`] runs.
    pub checks: CheckConfig,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            // One failure is often the request's fault or a blip; five in a row on one
            // leg is the engine's.
            failure_threshold: 5,
            // Long enough for a restarting engine's port to settle, short enough that a
            // blip costs little capacity.
            base_ejection: Duration::from_secs(5),
            // An engine down for good is still retried once a minute.
            max_ejection: Duration::from_secs(60),
            checks: CheckConfig::default(),
        }
    }
}

impl HealthConfig {
    /// How long the `ejections`-th ejection in a row lasts: `base_ejection` doubled
    /// `ejections - 1` times, at most `max_ejection`.
    pub fn ejection_time(&self, ejections: u32) -> Duration {
        let doublings = ejections.saturating_sub(1).min(31);
        self.base_ejection
            .saturating_mul(1u32 << doublings)
            .min(self.max_ejection)
    }
}

/// Active check settings: `GET {path}` on each engine every `interval`.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct CheckConfig {
    /// The path asked. Default `/health` (vLLM and SGLang answer 200 there when ready).
    pub path: PathAndQuery,
    /// Time between two checks of an engine. Default 5 s (at least 1 ms is used).
    pub interval: Duration,
    /// Time for one check's whole answer. Default 1 s.
    pub timeout: Duration,
    /// Failed checks in a row that take an engine out. Default 2 (0 acts as 1).
    pub unhealthy_threshold: u32,
    /// Passed checks in a row that bring it back. Default 1 (0 acts as 1).
    pub healthy_threshold: u32,
}

impl Default for CheckConfig {
    fn default() -> Self {
        CheckConfig {
            path: PathAndQuery::from_static("/health"),
            interval: Duration::from_secs(5),
            // `/health` does no work; an engine that cannot answer it in a second is
            // not going to serve a request well either.
            timeout: Duration::from_secs(1),
            // One lost check (a GC pause, a dropped SYN) is not an outage.
            unhealthy_threshold: 2,
            healthy_threshold: 1,
        }
    }
}

/// An endpoint's health on its leg, as [`Health::state`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EndpointHealth {
    /// Routed; the breaker is closed.
    Healthy,
    /// Not routed until `until`: the breaker is open.
    Ejected {
        /// When the ejection ends and the endpoint is routed again, half-open.
        until: Instant,
    },
    /// Routed again after an ejection; the next result decides.
    HalfOpen,
    /// Not routed: the active checks failed. Takes precedence over the breaker's state.
    Down,
}

impl EndpointHealth {
    /// Whether requests are routed to the endpoint.
    pub fn is_routed(&self) -> bool {
        matches!(self, EndpointHealth::Healthy | EndpointHealth::HalfOpen)
    }

    /// A short name for status pages: `healthy`, `ejected`, `half_open`, `down`.
    pub fn as_str(&self) -> &'static str {
        match self {
            EndpointHealth::Healthy => "healthy",
            EndpointHealth::Ejected { .. } => "ejected",
            EndpointHealth::HalfOpen => "half_open",
            EndpointHealth::Down => "down",
        }
    }
}

/// No ejection pending (`recheck_at`).
const NEVER: u64 = u64::MAX;

/// Breaker phases, kept in an `AtomicU8`.
const CLOSED: u8 = 0;
const OPEN: u8 = 1;
const HALF_OPEN: u8 = 2;

/// The shortest check interval used: `tokio::time::interval` refuses zero.
const MIN_INTERVAL: Duration = Duration::from_millis(1);

/// The most of a check's answer read. `/health` answers are empty or tiny; reading them to
/// the end lets the transport reuse the connection.
const MAX_CHECK_BODY: usize = 16 * 1024;

/// The health of every endpoint of a [`HealthSource`]: the place to report results
/// ([`record`](Self::record)), to read states, and to run active checks.
///
/// Shared through an `Arc` ([`HealthSource::health`]); states live as long as their
/// endpoint is in the inner source's set and survive its other changes.
pub struct Health {
    config: HealthConfig,
    /// Time zero of the nanosecond deadlines kept in atomics.
    epoch: Instant,
    /// The decorated source, kept alive (a source may stop publishing when dropped).
    inner: Box<dyn EndpointSource>,
    inner_rx: watch::Receiver<Arc<EndpointSet>>,
    /// The address of the inner set `registry` was built from: compared with the inner
    /// channel's current set, never dereferenced.
    seen_inner: AtomicPtr<EndpointSet>,
    registry: RwLock<Registry>,
    /// The published (filtered) set.
    tx: watch::Sender<Arc<EndpointSet>>,
    /// The earliest end of an ejection in nanoseconds since `epoch`, or [`NEVER`].
    recheck_at: AtomicU64,
    /// One refresh at a time.
    refreshing: Mutex<()>,
    /// Wakes the checker to recompute its next deadline after an ejection.
    wake: Notify,
}

impl fmt::Debug for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Health")
            .field("config", &self.config)
            .field("endpoints", &read(&self.registry).order.len())
            .finish_non_exhaustive()
    }
}

/// Per-endpoint states of the inner set, found by role and id.
struct Registry {
    /// The inner set these states were made for.
    inner: Arc<EndpointSet>,
    /// By role (prefill, decode, encode), then id. `Box<str>` keys let `record` look up with
    /// the endpoint's `&str` id: no allocation, no reference count touched.
    /// (foldhash: looked up twice per request; ids come from the operator's sources.)
    by_role: [HashMap<Box<str>, Arc<EndpointState>, foldhash::fast::RandomState>; 3],
    /// Every state once, in the inner set's order (prefill first).
    order: Vec<Arc<EndpointState>>,
}

fn role_index(role: Role) -> usize {
    match role {
        Role::Prefill => 0,
        Role::Decode => 1,
        // Encoders (E/P/D), and any role to come.
        _ => 2,
    }
}

impl Registry {
    /// States for `inner`'s endpoints, reusing `old`'s for those still there.
    fn build(inner: Arc<EndpointSet>, old: Option<&Registry>) -> Registry {
        let mut by_role: [HashMap<Box<str>, Arc<EndpointState>, _>; 3] = Default::default();
        let mut order = Vec::new();
        for ep in inner.iter() {
            let map = &mut by_role[role_index(ep.role())];
            if map.contains_key(ep.id().as_str()) {
                continue;
            }
            let state = old
                .and_then(|o| o.get(ep))
                .cloned()
                .unwrap_or_else(|| Arc::new(EndpointState::new(Arc::clone(ep))));
            map.insert(ep.id().as_str().into(), Arc::clone(&state));
            order.push(state);
        }
        Registry {
            inner,
            by_role,
            order,
        }
    }

    fn get(&self, endpoint: &Endpoint) -> Option<&Arc<EndpointState>> {
        self.by_role[role_index(endpoint.role())].get(endpoint.id().as_str())
    }
}

// === impl Health ===

impl Health {
    fn new(inner: Box<dyn EndpointSource>, config: HealthConfig) -> Health {
        let inner_rx = inner.watch();
        let first = inner_rx.borrow().clone();
        let (tx, _) = watch::channel(Arc::clone(&first));
        Health {
            config,
            epoch: Instant::now(),
            seen_inner: AtomicPtr::new(Arc::as_ptr(&first).cast_mut()),
            registry: RwLock::new(Registry::build(first, None)),
            inner,
            inner_rx,
            tx,
            recheck_at: AtomicU64::new(NEVER),
            refreshing: Mutex::new(()),
            wake: Notify::new(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &HealthConfig {
        &self.config
    }

    /// Report one leg's result on `endpoint` (its role is the leg): `ok` for an answer
    /// the leg could use (2xx, or a 4xx the client caused), `false` for a transport
    /// error, a timeout, a 5xx, an unusable answer or a stream broken mid-way.
    ///
    /// Cheap on the request path: a success on a closed breaker is a hash lookup of the
    /// id under a read lock and one atomic load, with no allocation (about 40 ns at 8 to
    /// 512 endpoints, `cargo bench -p disagg-core --bench hot_path -- health`). A result
    /// that ejects the endpoint republishes the set before returning. Endpoints the source does not
    /// publish (any more) are ignored.
    pub fn record(&self, endpoint: &Endpoint, ok: bool) {
        let changed = {
            let registry = read(&self.registry);
            match registry.get(endpoint) {
                Some(state) => state.record(ok, self),
                None => false,
            }
        };
        if changed {
            self.refresh();
            self.wake.notify_waiters();
        }
    }

    /// Eject `endpoint` on its leg as its breaker would after failures, for `reason`
    /// (logged): it leaves the published set for the next backoff time, then returns
    /// half-open and the next result decides, like any ejection. For verdicts the
    /// breaker cannot reach from leg results, such as a decode whose engine reports that
    /// the KV it was handed never arrived (`telemetry`). Whether it was ejected now (not
    /// when already ejected, or not published).
    pub fn eject(&self, endpoint: &Endpoint, reason: &'static str) -> bool {
        let changed = {
            let registry = read(&self.registry);
            match registry.get(endpoint) {
                Some(state) => state.eject(self, reason),
                None => false,
            }
        };
        if changed {
            self.refresh();
            self.wake.notify_waiters();
        }
        changed
    }

    /// The health of `endpoint` on its leg; `None` when the source does not publish it.
    pub fn state(&self, endpoint: &Endpoint) -> Option<EndpointHealth> {
        self.refresh_if_due();
        let now = self.now_ns();
        read(&self.registry)
            .get(endpoint)
            .map(|s| s.view(now, self))
    }

    /// The health of every endpoint of the inner source, in its order (prefill first),
    /// for a status page.
    pub fn states(&self) -> Vec<(EndpointId, Role, EndpointHealth)> {
        self.counts()
            .into_iter()
            .map(|(id, role, health, _)| (id, role, health))
            .collect()
    }

    /// Every endpoint's state and ejection count, in the inner source's order.
    fn counts(&self) -> Vec<(EndpointId, Role, EndpointHealth, u64)> {
        self.refresh_if_due();
        let now = self.now_ns();
        read(&self.registry)
            .order
            .iter()
            .map(|s| {
                (
                    s.endpoint.id().clone(),
                    s.endpoint.role(),
                    s.view(now, self),
                    s.ejections.load(Ordering::Relaxed),
                )
            })
            .collect()
    }

    fn now_ns(&self) -> u64 {
        nanos(Instant::now().saturating_duration_since(self.epoch))
    }

    fn instant(&self, ns: u64) -> Instant {
        self.epoch + Duration::from_nanos(ns)
    }

    /// Refresh if an ejection ended or the inner set changed: one atomic load and one
    /// pointer comparison when neither happened.
    fn refresh_if_due(&self) {
        if !self.due() {
            return;
        }
        let serial = lock(&self.refreshing);
        // Requests that found it due at once wait here; the first refreshes, the others
        // find it done.
        if self.due() {
            self.refresh_locked(serial);
        }
    }

    fn due(&self) -> bool {
        let at = self.recheck_at.load(Ordering::Acquire);
        (at != NEVER && self.now_ns() >= at) || self.inner_moved()
    }

    fn inner_moved(&self) -> bool {
        let current = Arc::as_ptr(&*self.inner_rx.borrow());
        !std::ptr::eq(current, self.seen_inner.load(Ordering::Acquire))
    }

    /// Follow the inner set, turn finished ejections half-open, and publish the routed
    /// endpoints if they changed.
    fn refresh(&self) {
        self.refresh_locked(lock(&self.refreshing));
    }

    fn refresh_locked(&self, _serial: std::sync::MutexGuard<'_, ()>) {
        // Claimed first: an ejection recorded from here on lowers it again.
        self.recheck_at.store(NEVER, Ordering::SeqCst);
        let inner = self.inner_rx.borrow().clone();
        let moved = !Arc::ptr_eq(&read(&self.registry).inner, &inner);
        if moved {
            let mut registry = write(&self.registry);
            let rebuilt = Registry::build(Arc::clone(&inner), Some(&*registry));
            *registry = rebuilt;
            self.seen_inner
                .store(Arc::as_ptr(&inner).cast_mut(), Ordering::Release);
        }
        let now = self.now_ns();
        let mut next = NEVER;
        let mut all = true;
        let routed = {
            let registry = read(&self.registry);
            // Retained, not rebuilt: the models the inner set serves stay served, so a
            // model whose decodes are all ejected answers 503 (none to send it to),
            // not 404 as if unknown, and a request naming no model is not sent to the
            // one model left.
            inner.retain(|ep| {
                let keep = registry
                    .get(ep)
                    .is_none_or(|state| state.routed(now, &mut next));
                all &= keep;
                keep
            })
        };
        // Nothing left out: publish the inner set itself, model index and all.
        let set = if all { inner } else { Arc::new(routed) };
        self.tx.send_if_modified(|current| {
            if same_members(current, &set) {
                false
            } else {
                *current = set;
                true
            }
        });
        self.recheck_at.fetch_min(next, Ordering::SeqCst);
    }

    /// Run the active checks until `stop` turns true (or its sender is dropped), or the
    /// returned future is dropped: a future for the embedder to spawn; the library
    /// spawns nothing.
    ///
    /// Every [`CheckConfig::interval`] each engine of the inner source is asked
    /// `GET {path}` once per authority, all concurrently; the verdict applies to all its
    /// endpoints (every data-parallel rank, either role). The future also follows the
    /// inner source's changes and wakes at the end of each ejection, so that watchers of
    /// [`HealthSource::watch`] see returns on time. When it ends, endpoints it marked down
    /// are marked up again: without checks there is no verdict to keep them out.
    pub async fn run_checks(
        self: Arc<Self>,
        transport: impl Transport,
        mut stop: watch::Receiver<bool>,
    ) {
        // Subscribed first, then the registry brought up to the inner set, then the
        // targets made from it: an engine the inner source published before now (and
        // that no snapshot has taken in yet) is checked from the first round, and one
        // published from now on wakes the loop below.
        let mut inner_rx = self.inner.watch();
        self.refresh();
        let mut checker = Checker {
            health: Arc::clone(&self),
            targets: Vec::new(),
        };
        if checker.retarget() {
            self.refresh();
        }
        let config = &self.config.checks;
        let mut following = true;
        let mut tick = tokio::time::interval(config.interval.max(MIN_INTERVAL));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let stopped = async move {
            // A dropped sender can never say stop: take it as stop, as `server` does.
            let _ = stop.wait_for(|stop| *stop).await;
        };
        tokio::pin!(stopped);
        loop {
            let woken = self.wake.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let at = self.recheck_at.load(Ordering::Acquire);
            tokio::select! {
                biased;
                () = &mut stopped => return,
                changed = inner_rx.changed(), if following => {
                    // A closed inner channel keeps its last set: stop following.
                    following = changed.is_ok();
                    self.refresh();
                    if checker.retarget() {
                        self.refresh();
                    }
                }
                _ = tick.tick() => {
                    tokio::select! {
                        biased;
                        () = &mut stopped => return,
                        changed = checker.round(&transport) => if changed {
                            self.refresh();
                        },
                    }
                }
                () = tokio::time::sleep_until(self.instant(at)), if at != NEVER => self.refresh(),
                () = &mut woken => {}
            }
        }
    }
}

/// Whether `a` and `b` hold the same endpoints (the same `Arc`s) in the same order.
fn same_members(a: &EndpointSet, b: &EndpointSet) -> bool {
    let same = |x: &[Arc<Endpoint>], y: &[Arc<Endpoint>]| {
        x.len() == y.len() && x.iter().zip(y).all(|(x, y)| Arc::ptr_eq(x, y))
    };
    [Role::Prefill, Role::Decode, Role::Encode]
        .into_iter()
        .all(|r| same(a.by_role(r), b.by_role(r)))
}

#[cfg(test)]
mod tests;
