//! LMCache's KV-ready notifications: a ZMQ PULL listener and the registry of requests
//! waiting for their KV.
//!
//! # Protocol
//!
//! In LMCache's P/D mode every prefill TP rank PUSH-connects to
//! `tcp://pd_proxy_host:pd_proxy_port` and, after the last chunk of a request's KV has been
//! written to the decode (`transfer_spec.is_last_prefill`), sends
//! `msgspec.msgpack.encode(ProxyNotif(req_id=…))`. `ProxyNotif` is a
//! `msgspec.Struct` with `tag=True`, so the wire form is a msgpack **map**
//! `{"type": "ProxyNotif", "req_id": "<str>"}`; LMCache's older `nixl_connector_v3` tags it
//! `"NixlProxyNotif"`. Sources: `LMCache/LMCache lmcache/v1/storage_backend/pd_backend.py`
//! and the proxy
//! `examples/disagg_prefill/xpyd/disagg_proxy_server_first_token_from_prefiller_xpyd.py`. The
//! `req_id` is the one the proxy chose and put in the prefill's
//! `kv_transfer_params.disagg_spec.req_id`; the proxy waits for as many notifications as
//! the decode has TP ranks (`len(receiver_init_port)`).
//!
//! # Registry
//!
//! A request is [registered](Notifications::register) before its prefill is sent; the
//! returned [`Pending`] resolves once the expected number of notifications arrived, and
//! dropping it forgets the request. Only live registrations are stored: a notification for
//! an id nobody registered is counted and dropped, and one beyond the expected count is
//! counted and ignored, so the registry's size is bounded by
//! [`NotifyConfig::max_pending`] whatever the engines send. A registration older than
//! [`NotifyConfig::ttl`] is evicted (its waiter gets [`WaitError::Evicted`]): a defence
//! against an owner that never drops its `Pending`, not a timeout for the handoff (the
//! caller bounds its own wait, e.g. with `tokio::time::timeout`).
//!
//! # The socket
//!
//! The PULL socket is `disagg-zmtp`'s: each prefill rank's connection on a task of
//! its own, every message under [`NotifyConfig::max_message`] (64 KiB) and 16 frames,
//! checked at the frame header before anything is stored; a peer over them, or not
//! speaking ZMTP 3 as a `PUSH`, is disconnected and counted
//! ([`Notifications::socket_stats`]), and the others go on.
//!
//! The registry is one `std::sync::Mutex` over a `HashMap`, held only for map updates and
//! never across an await; waiters are woken through a `tokio::sync::watch` per
//! registration, so nothing polls.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use disagg_zmtp::{Limits, Pull, PullConfig, PullStats, PullStatsHandle};
use serde::Deserialize;
use tokio::sync::watch;
use tokio::time::Instant;

/// The message tags accepted as a KV-ready notification: LMCache's `ProxyNotif` and the
/// older `nixl_connector_v3`'s `NixlProxyNotif`.
const NOTIFY_TYPES: [&str; 2] = ["ProxyNotif", "NixlProxyNotif"];

/// The shortest sweep period: `tokio::time::interval` panics on a zero period, and a
/// sweeper spinning faster than this would only burn CPU.
const MIN_SWEEP_INTERVAL: Duration = Duration::from_millis(1);

/// The longest sweep period: tokio adds the period to the current instant and panics on
/// overflow, so an "effectively never" setting such as `Duration::MAX` is capped here.
const MAX_SWEEP_INTERVAL: Duration = Duration::from_secs(24 * 60 * 60);

// === NotifyConfig ===

/// Settings of a [`Notifications`] registry.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use disagg_connectors::lmcache::NotifyConfig;
///
/// let config = NotifyConfig { ttl: Duration::from_secs(30), ..NotifyConfig::default() };
/// assert_eq!(config.max_pending, 65_536);
/// ```
#[derive(Debug, Clone)]
pub struct NotifyConfig {
    /// Age after which a registration is evicted, whatever its state (default 120 s). A
    /// safety net for registrations whose owner forgot them, not a timeout: an evicted
    /// waiter fails ([`WaitError::Evicted`]). [`Lmcache`](super::Lmcache) registers a
    /// request before its prefill leg is sent and waits once the prefill answered, so
    /// an embedder keeps this above its prefill budget plus its KV-ready wait
    /// (`OrchestratorConfig::prefill_timeout` plus `handoff_timeout`: 310 s with theirs
    /// by default, above this default); `disagg-proxy serve` derives it from them.
    pub ttl: Duration,
    /// How often the sweeper looks for expired registrations (default 1 s; kept between
    /// 1 ms and one day). Expired registrations are also removed by [`Notifications::register`].
    pub sweep_interval: Duration,
    /// Registrations alive at once; [`Notifications::register`] fails with
    /// [`NotifyError::Full`] beyond it (default 65,536).
    pub max_pending: usize,
    /// The largest notification a peer may send, its frames together (default 64 KiB;
    /// a `ProxyNotif` is its request id and about 20 bytes more). A peer that sends a
    /// larger one, or more than 16 frames, is disconnected at the frame header and
    /// counted; the others go on.
    pub max_message: usize,
    /// Prefill ranks connected at once (default 1,024); one more is closed at once
    /// and counted.
    pub max_peers: usize,
    /// Ranks connected at once from one host, an IPv4 address or an IPv6 /64 (default
    /// 256: a node of eight engines of TP 8 has 64, with room to reconnect); one more
    /// from that host takes the place of its peer idle longest, if idle 60 s, else it
    /// is closed and counted (`PullConfig::max_peers_per_host`). One host cannot hold
    /// every place.
    pub max_peers_per_host: usize,
}

/// [`NotifyConfig::max_message`]'s default: 64 KiB.
pub const DEFAULT_MAX_NOTIFICATION: usize = 64 << 10;

impl Default for NotifyConfig {
    fn default() -> Self {
        NotifyConfig {
            ttl: Duration::from_secs(120),
            sweep_interval: Duration::from_secs(1),
            max_pending: 65_536,
            max_message: DEFAULT_MAX_NOTIFICATION,
            max_peers: 1024,
            max_peers_per_host: 256,
        }
    }
}

// === NotifyStats ===

/// Counters of a [`Notifications`] registry since it was created.
///
/// Every message is counted once in `received` and once in exactly one of `matched`,
/// `unknown`, `extra` and `malformed`, so
/// `received == matched + unknown + extra + malformed` once the registry is idle.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NotifyStats {
    /// Notifications received: messages read from the socket plus
    /// [`Notifications::notify`] calls.
    pub received: u64,
    /// Notifications counted towards a live registration.
    pub matched: u64,
    /// Registrations that reached their expected count.
    pub completed: u64,
    /// Notifications for an id with no registration (ignored, never stored).
    pub unknown: u64,
    /// Notifications for a registration already complete (ignored).
    pub extra: u64,
    /// Socket messages that are not a msgpack `ProxyNotif`/`NixlProxyNotif` map (ignored).
    pub malformed: u64,
    /// Registrations removed because they outlived [`NotifyConfig::ttl`].
    pub evicted: u64,
}

#[derive(Debug, Default)]
struct Counters {
    received: AtomicU64,
    matched: AtomicU64,
    completed: AtomicU64,
    unknown: AtomicU64,
    extra: AtomicU64,
    malformed: AtomicU64,
    evicted: AtomicU64,
}

impl Counters {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    fn snapshot(&self) -> NotifyStats {
        NotifyStats {
            received: self.received.load(Ordering::Relaxed),
            matched: self.matched.load(Ordering::Relaxed),
            completed: self.completed.load(Ordering::Relaxed),
            unknown: self.unknown.load(Ordering::Relaxed),
            extra: self.extra.load(Ordering::Relaxed),
            malformed: self.malformed.load(Ordering::Relaxed),
            evicted: self.evicted.load(Ordering::Relaxed),
        }
    }
}

// === errors ===

/// Why a [`Notifications`] listener could not start, or a registration was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NotifyError {
    /// The bind address is not `host:port` or `tcp://host:port`.
    #[error("invalid notification address {addr:?}: {reason}")]
    InvalidAddress {
        /// The address as given.
        addr: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The TCP listener could not be bound (address in use, unresolvable host, …).
    #[error("cannot bind the notification listener on {addr}")]
    Bind {
        /// The address as given.
        addr: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The ZMQ PULL socket could not take the bound listener.
    #[error("cannot start the notification socket on {addr}")]
    Listen {
        /// The address as given.
        addr: String,
        /// The ZMQ error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// The request id is already registered (its `Pending` is still alive).
    #[error("request id {req_id:?} is already registered")]
    Duplicate {
        /// The request id.
        req_id: String,
    },
    /// [`NotifyConfig::max_pending`] registrations are alive.
    #[error("{max_pending} registrations are already waiting")]
    Full {
        /// The configured limit.
        max_pending: usize,
    },
    /// A registration must expect at least one notification.
    #[error("a registration must expect at least one notification")]
    ZeroExpected,
}

/// Why [`Pending::ready`] ended without the expected notifications.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WaitError {
    /// The registration outlived [`NotifyConfig::ttl`] and was removed.
    #[error("registration evicted after its time to live")]
    Evicted,
    /// The registry shut down: every [`Notifications`] handle was dropped.
    #[error("notification listener closed")]
    Closed,
}

// === registry internals ===

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Waiting,
    Ready,
    Evicted,
}

/// What a registration's waiters see. "Closed" is the channel's sender being dropped
/// without a terminal state: the registry itself is gone.
#[derive(Debug, Clone, Copy)]
struct Status {
    received: usize,
    state: State,
}

#[derive(Debug)]
struct Slot {
    /// Tells this registration apart from an earlier or later one with the same id, so a
    /// stale `Pending` never removes its successor.
    generation: u64,
    expected: usize,
    received: usize,
    /// `None` when `now + ttl` overflows: never expires.
    deadline: Option<Instant>,
    status: watch::Sender<Status>,
}

#[derive(Debug, Default)]
struct Registry {
    slots: HashMap<Arc<str>, Slot>,
    /// The live registrations by generation. Generations and deadlines are both assigned
    /// under the lock with one TTL, so this is also deadline order: the sweep pops expired
    /// entries from the front and stops at the first live one.
    by_age: BTreeMap<u64, Arc<str>>,
    next_generation: u64,
}

impl Registry {
    /// Removes the registrations whose deadline is at or before `now`; returns how many.
    /// Each is counted before its waiter is woken.
    fn remove_expired(&mut self, now: Instant, counters: &Counters) -> u64 {
        let mut evicted = 0;
        while let Some((&generation, id)) = self.by_age.first_key_value() {
            let id = Arc::clone(id);
            let expired = match self.slots.get(&id) {
                // Kept in step with `slots`; a stray index entry is just dropped.
                Some(slot) if slot.generation == generation => {
                    matches!(slot.deadline, Some(deadline) if deadline <= now)
                }
                _ => {
                    self.by_age.pop_first();
                    continue;
                }
            };
            if !expired {
                break;
            }
            self.by_age.pop_first();
            if let Some(slot) = self.slots.remove(&id) {
                Counters::add(&counters.evicted, 1);
                // A completed registration stays completed for its waiter: the KV did
                // arrive; only the entry is reclaimed.
                if slot.received < slot.expected {
                    slot.status.send_replace(Status {
                        received: slot.received,
                        state: State::Evicted,
                    });
                }
                evicted += 1;
            }
        }
        evicted
    }
}

/// Where one notification went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Matched,
    Completed,
    Unknown,
    Extra,
}

struct Inner {
    config: NotifyConfig,
    local_addr: Option<SocketAddr>,
    /// The socket's peer counters (`None` when detached).
    socket: Option<PullStatsHandle>,
    registry: Mutex<Registry>,
    counters: Counters,
    /// Never sent on: dropped with the last handle, which ends the socket task and the
    /// sweeper (their `changed()` fails).
    _shutdown: watch::Sender<()>,
}

impl Inner {
    fn new(
        config: NotifyConfig,
        local_addr: Option<SocketAddr>,
        socket: Option<PullStatsHandle>,
    ) -> (Arc<Inner>, watch::Receiver<()>) {
        let (shutdown, on_shutdown) = watch::channel(());
        let inner = Arc::new(Inner {
            config,
            local_addr,
            socket,
            registry: Mutex::new(Registry::default()),
            counters: Counters::default(),
            _shutdown: shutdown,
        });
        (inner, on_shutdown)
    }

    fn lock(&self) -> MutexGuard<'_, Registry> {
        // No code path panics while holding the lock, and the registry stays consistent
        // between statements anyway: a poisoned lock is still usable.
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn sweep(&self, now: Instant) {
        let evicted = self.lock().remove_expired(now, &self.counters);
        log_evicted(evicted, self.config.ttl);
    }

    fn notify(&self, req_id: &str) -> Outcome {
        Counters::add(&self.counters.received, 1);
        let outcome = {
            let mut registry = self.lock();
            match registry.slots.get_mut(req_id) {
                None => Outcome::Unknown,
                Some(slot) if slot.received >= slot.expected => Outcome::Extra,
                Some(slot) => {
                    slot.received += 1;
                    let done = slot.received == slot.expected;
                    // Counted before the waiter is woken, so a waiter that reads the
                    // stats after `ready()` sees its own notification in them.
                    Counters::add(&self.counters.matched, 1);
                    if done {
                        Counters::add(&self.counters.completed, 1);
                    }
                    slot.status.send_replace(Status {
                        received: slot.received,
                        state: if done { State::Ready } else { State::Waiting },
                    });
                    if done {
                        Outcome::Completed
                    } else {
                        Outcome::Matched
                    }
                }
            }
        };
        match outcome {
            Outcome::Matched | Outcome::Completed => {}
            Outcome::Unknown => {
                Counters::add(&self.counters.unknown, 1);
                tracing::debug!(
                    req_id,
                    "ignored a KV-ready notification for an unregistered request"
                );
            }
            Outcome::Extra => {
                Counters::add(&self.counters.extra, 1);
                tracing::debug!(
                    req_id,
                    "ignored a KV-ready notification beyond the expected count"
                );
            }
        }
        outcome
    }

    /// One socket message: its first frame is the notification.
    fn on_frame(&self, frame: Option<&[u8]>) {
        let decoded = frame.ok_or(Malformed::Empty).and_then(decode);
        match decoded {
            Ok(req_id) => {
                self.notify(req_id);
            }
            Err(reason) => {
                Counters::add(&self.counters.received, 1);
                Counters::add(&self.counters.malformed, 1);
                tracing::debug!(
                    len = frame.map_or(0, <[u8]>::len),
                    %reason,
                    "ignored a malformed LMCache notification"
                );
            }
        }
    }

    fn forget(&self, req_id: &str, generation: u64) {
        let mut registry = self.lock();
        if registry
            .slots
            .get(req_id)
            .is_some_and(|slot| slot.generation == generation)
        {
            registry.slots.remove(req_id);
            registry.by_age.remove(&generation);
        }
    }
}

fn log_evicted(evicted: u64, ttl: Duration) {
    if evicted > 0 {
        tracing::warn!(
            evicted,
            ?ttl,
            "evicted LMCache KV-ready registrations older than their time to live"
        );
    }
}

// === decoding ===

/// The fields of `ProxyNotif`/`NixlProxyNotif` the proxy needs; other keys are ignored.
#[derive(Deserialize)]
struct Wire<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    req_id: &'a str,
}

#[derive(Debug)]
enum Malformed {
    Empty,
    Undecodable(rmp_serde::decode::Error),
    UnknownType(String),
}

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Malformed::Empty => f.write_str("message without frames"),
            Malformed::Undecodable(error) => write!(f, "not a notification map: {error}"),
            Malformed::UnknownType(kind) => write!(f, "unknown message type {kind:?}"),
        }
    }
}

/// How deep a notification's values may nest: LMCache's are a flat map. rmp-serde
/// skips an unknown key's value recursively, to 1,024 levels by default: a peer's 1 KB
/// frame of nested arrays overflowed a 2 MiB worker's stack in a debug build (which
/// aborts the process).
const MAX_NOTIFY_DEPTH: usize = 16;

/// The request id of a `ProxyNotif`/`NixlProxyNotif` frame.
fn decode(frame: &[u8]) -> Result<&str, Malformed> {
    let mut de = rmp_serde::Deserializer::from_read_ref(frame);
    de.set_max_depth(MAX_NOTIFY_DEPTH);
    let wire = Wire::deserialize(&mut de).map_err(Malformed::Undecodable)?;
    if NOTIFY_TYPES.contains(&wire.kind) {
        Ok(wire.req_id)
    } else {
        Err(Malformed::UnknownType(wire.kind.to_owned()))
    }
}

// === background tasks ===

async fn receive_loop(mut socket: Pull, registry: Weak<Inner>, mut shutdown: watch::Receiver<()>) {
    loop {
        let message = tokio::select! {
            biased;
            _ = shutdown.changed() => break,
            message = socket.recv() => message,
        };
        let Some(message) = message else {
            break;
        };
        let Some(inner) = registry.upgrade() else {
            break;
        };
        inner.on_frame(message.first().map(|frame| &frame[..]));
    }
}

async fn sweep_loop(registry: Weak<Inner>, period: Duration, mut shutdown: watch::Receiver<()>) {
    let mut ticks = tokio::time::interval(period.clamp(MIN_SWEEP_INTERVAL, MAX_SWEEP_INTERVAL));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = shutdown.changed() => break,
            _ = ticks.tick() => {}
        }
        let Some(inner) = registry.upgrade() else {
            break;
        };
        inner.sweep(Instant::now());
    }
}

/// `host:port` from `host:port`, `tcp://host:port` or ZMQ's `tcp://*:port`.
fn listen_address(addr: &str) -> Result<String, NotifyError> {
    let invalid = |reason| NotifyError::InvalidAddress {
        addr: addr.to_owned(),
        reason,
    };
    let rest = match addr.split_once("://") {
        Some(("tcp", rest)) => rest,
        Some(_) => return Err(invalid("only tcp:// endpoints are supported")),
        None => addr,
    };
    if rest.is_empty() {
        return Err(invalid("no host and port"));
    }
    // ZMQ spells "all interfaces" `*`.
    Ok(match rest.strip_prefix("*:") {
        Some(port) => format!("0.0.0.0:{port}"),
        None => rest.to_owned(),
    })
}

// === Notifications ===

/// The KV-ready notification listener and its registry of waiting requests.
///
/// Cheap to clone (an `Arc` inside). The socket task and the sweeper hold no handle: they
/// end, and the socket is closed, when the last clone is dropped; waiters then get
/// [`WaitError::Closed`].
///
/// # Examples
///
/// ```
/// use disagg_connectors::lmcache::{Notifications, NotifyConfig};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let notifications = Notifications::bind("127.0.0.1:0", NotifyConfig::default()).await?;
/// // The prefill engines' `pd_proxy_host`/`pd_proxy_port`.
/// let addr = notifications.local_addr().ok_or("no address")?;
/// assert_ne!(addr.port(), 0);
///
/// // A decode with two TP ranks: two notifications.
/// let pending = notifications.register("req-7", 2)?;
/// notifications.notify("req-7"); // what the socket task does per `ProxyNotif`
/// assert_eq!(pending.received(), 1);
/// notifications.notify("req-7");
/// pending.ready().await?;
///
/// drop(pending); // the registration is gone
/// assert_eq!(notifications.pending_len(), 0);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Notifications {
    inner: Arc<Inner>,
}

impl Notifications {
    /// Binds a ZMQ PULL socket on `addr` and starts listening.
    ///
    /// `addr` is `host:port` or `tcp://host:port` (`tcp://*:port` for all interfaces);
    /// port 0 picks a free port, see [`local_addr`](Self::local_addr). Spawns the receive
    /// task and the TTL sweeper on the current tokio runtime; both end when the last
    /// handle is dropped.
    ///
    /// # Errors
    ///
    /// [`NotifyError::InvalidAddress`] for another scheme or an empty address,
    /// [`NotifyError::Bind`] when the address cannot be bound, [`NotifyError::Listen`]
    /// when the ZMQ socket cannot take the listener.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime.
    pub async fn bind(addr: &str, config: NotifyConfig) -> Result<Notifications, NotifyError> {
        let bind_error = |source| NotifyError::Bind {
            addr: addr.to_owned(),
            source,
        };
        let target = listen_address(addr)?;
        // Bound here rather than by the socket so the resolved address (port 0, host names) is
        // known exactly.
        let listener = tokio::net::TcpListener::bind(target.as_str())
            .await
            .map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        let limits = Limits::new(config.max_message);
        let socket = Pull::from_listener(
            listener,
            PullConfig {
                max_peers: config.max_peers,
                max_peers_per_host: config.max_peers_per_host,
                ..PullConfig::new(limits)
            },
        )
        .map_err(|error| NotifyError::Listen {
            addr: addr.to_owned(),
            source: Box::new(error),
        })?;
        let stats = socket.stats_handle();

        let sweep_interval = config.sweep_interval;
        let (inner, shutdown) = Inner::new(config, Some(local_addr), Some(stats));
        tokio::spawn(receive_loop(
            socket,
            Arc::downgrade(&inner),
            shutdown.clone(),
        ));
        tokio::spawn(sweep_loop(Arc::downgrade(&inner), sweep_interval, shutdown));
        tracing::debug!(%local_addr, "LMCache notification listener bound");
        Ok(Notifications { inner })
    }

    /// A registry with no socket, fed through [`notify`](Self::notify) (another transport,
    /// tests).
    ///
    /// Called inside a tokio runtime it spawns the TTL sweeper, which ends when the last
    /// handle is dropped; outside one, expired registrations are removed only by
    /// [`register`](Self::register).
    pub fn detached(config: NotifyConfig) -> Notifications {
        let sweep_interval = config.sweep_interval;
        let (inner, shutdown) = Inner::new(config, None, None);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(sweep_loop(Arc::downgrade(&inner), sweep_interval, shutdown));
        }
        Notifications { inner }
    }

    /// The address the socket is bound to (port 0 resolved); `None` when
    /// [`detached`](Self::detached).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.inner.local_addr
    }

    /// Registers `req_id`, expecting `expected` notifications; call it before the prefill
    /// is sent, so no notification can arrive first.
    ///
    /// Expired registrations are removed first. The registration lives until the returned
    /// [`Pending`] is dropped or it outlives [`NotifyConfig::ttl`].
    ///
    /// # Errors
    ///
    /// [`NotifyError::ZeroExpected`] when `expected` is 0, [`NotifyError::Duplicate`]
    /// when `req_id` is registered already, [`NotifyError::Full`] when
    /// [`NotifyConfig::max_pending`] registrations are alive.
    pub fn register(&self, req_id: &str, expected: usize) -> Result<Pending, NotifyError> {
        if expected == 0 {
            return Err(NotifyError::ZeroExpected);
        }
        let now = Instant::now();
        let mut registry = self.inner.lock();
        let evicted = registry.remove_expired(now, &self.inner.counters);
        let registered = if registry.slots.contains_key(req_id) {
            Err(NotifyError::Duplicate {
                req_id: req_id.to_owned(),
            })
        } else if registry.slots.len() >= self.inner.config.max_pending {
            Err(NotifyError::Full {
                max_pending: self.inner.config.max_pending,
            })
        } else {
            let generation = registry.next_generation;
            registry.next_generation += 1;
            let id: Arc<str> = Arc::from(req_id);
            let (status, on_status) = watch::channel(Status {
                received: 0,
                state: State::Waiting,
            });
            registry.slots.insert(
                Arc::clone(&id),
                Slot {
                    generation,
                    expected,
                    received: 0,
                    deadline: now.checked_add(self.inner.config.ttl),
                    status,
                },
            );
            registry.by_age.insert(generation, Arc::clone(&id));
            Ok(Pending {
                req_id: id,
                expected,
                generation,
                status: on_status,
                registry: Arc::downgrade(&self.inner),
            })
        };
        drop(registry);
        log_evicted(evicted, self.inner.config.ttl);
        registered
    }

    /// Counts one notification for `req_id`: what the socket task does for every decoded
    /// message.
    ///
    /// Unknown ids and notifications beyond the expected count are counted in
    /// [`stats`](Self::stats) and otherwise ignored.
    pub fn notify(&self, req_id: &str) {
        self.inner.notify(req_id);
    }

    /// Registrations alive now (an expired one counts until it is swept).
    pub fn pending_len(&self) -> usize {
        self.inner.lock().slots.len()
    }

    /// The notification socket's peer counters (connections, and peers disconnected
    /// for a message over [`NotifyConfig::max_message`], for not speaking ZMTP as a
    /// `PUSH`, for a slow handshake, or refused beyond [`NotifyConfig::max_peers`]);
    /// `None` when [`detached`](Self::detached).
    pub fn socket_stats(&self) -> Option<PullStats> {
        self.inner.socket.as_ref().map(PullStatsHandle::get)
    }

    /// The counters since the registry was created.
    ///
    /// A registration's `matched`, `completed` and `evicted` counts are updated before its
    /// waiter is woken, so a caller that reads the stats after [`Pending::ready`] returned
    /// sees them.
    pub fn stats(&self) -> NotifyStats {
        self.inner.counters.snapshot()
    }

    /// Registers the registry's counters into a Prometheus `registry` (read at each
    /// scrape), for a proxy's `GET /metrics` (`disagg-http`'s `ExtraMetrics` takes this
    /// as it is):
    ///
    /// | metric | type | meaning |
    /// |---|---|---|
    /// | `disagg_lmcache_notifications_total{outcome}` | counter | notifications received, by outcome: `matched` (counted towards a waiting request), `unknown` (no such request waiting), `extra` (beyond the expected count: a duplicate), `malformed` (not a notification) |
    /// | `disagg_lmcache_registrations_completed_total` | counter | requests whose every expected notification arrived |
    /// | `disagg_lmcache_registrations_evicted_total` | counter | registrations removed after outliving [`NotifyConfig::ttl`] |
    /// | `disagg_lmcache_registrations_pending` | gauge | requests waiting for notifications now |
    /// | `disagg_lmcache_notify_peers_rejected_total{reason}` | counter | peers of the socket disconnected or refused: `oversized` (a message over [`NotifyConfig::max_message`] or more than 16 frames), `protocol` (not ZMTP 3 as a `PUSH`), `timeout` (no handshake within 5 s), `too_many_peers` (beyond [`NotifyConfig::max_peers`], none idle past 60 s), `too_many_from_host` (beyond [`NotifyConfig::max_peers_per_host`] from one IP address, none of its idle past 60 s), `idle_evicted` (idle past 60 s, closed to make room for a newcomer); only with a socket |
    ///
    /// The outcomes partition what was received: their sum is [`NotifyStats::received`]
    /// (so no separate total is exported).
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_connectors::lmcache::{Notifications, NotifyConfig};
    /// use prometheus_client::registry::Registry;
    ///
    /// let notifications = Notifications::detached(NotifyConfig::default());
    /// let mut registry = Registry::default();
    /// notifications.register_metrics(&mut registry);
    /// let _pending = notifications.register("req-1", 2)?;
    /// notifications.notify("req-1");
    /// notifications.notify("someone-else");
    /// let mut text = String::new();
    /// prometheus_client::encoding::text::encode(&mut text, &registry)?;
    /// assert!(text.contains("disagg_lmcache_notifications_total{outcome=\"matched\"} 1\n"));
    /// assert!(text.contains("disagg_lmcache_notifications_total{outcome=\"unknown\"} 1\n"));
    /// assert!(text.contains("disagg_lmcache_registrations_pending 1\n"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register_collector(Box::new(NotifyCollector(self.clone())));
    }
}

/// [`Notifications::register_metrics`]' collector: the counters, read at each scrape.
#[derive(Debug)]
struct NotifyCollector(Notifications);

impl prometheus_client::collector::Collector for NotifyCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::MetricType;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        let s = self.0.stats();
        // Counters are named without `_total`: the encoders append it.
        let mut notifications = encoder.encode_descriptor(
            "disagg_lmcache_notifications",
            "LMCache KV-ready notifications received, by outcome.",
            None,
            MetricType::Counter,
        )?;
        for (outcome, n) in [
            ("matched", s.matched),
            ("unknown", s.unknown),
            ("extra", s.extra),
            ("malformed", s.malformed),
        ] {
            ConstCounter::new(n).encode(notifications.encode_family(&[("outcome", outcome)])?)?;
        }
        for (name, help, n) in [
            (
                "disagg_lmcache_registrations_completed",
                "Requests whose every expected LMCache notification arrived.",
                s.completed,
            ),
            (
                "disagg_lmcache_registrations_evicted",
                "LMCache registrations removed after outliving their time to live.",
                s.evicted,
            ),
        ] {
            let metric = ConstCounter::new(n);
            metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)?;
        }
        if let Some(peers) = self.0.socket_stats() {
            let mut rejected = encoder.encode_descriptor(
                "disagg_lmcache_notify_peers_rejected",
                "Peers of the LMCache notification socket disconnected or refused, by reason.",
                None,
                MetricType::Counter,
            )?;
            for (reason, n) in [
                ("oversized", peers.oversized),
                ("protocol", peers.protocol),
                ("timeout", peers.timeout),
                ("too_many_peers", peers.refused),
                ("too_many_from_host", peers.refused_per_host),
                ("idle_evicted", peers.evicted),
            ] {
                ConstCounter::new(n).encode(rejected.encode_family(&[("reason", reason)])?)?;
            }
        }
        let pending = ConstGauge::new(i64::try_from(self.0.pending_len()).unwrap_or(i64::MAX));
        pending.encode(encoder.encode_descriptor(
            "disagg_lmcache_registrations_pending",
            "Requests waiting for LMCache KV-ready notifications.",
            None,
            pending.metric_type(),
        )?)
    }
}

impl fmt::Debug for Notifications {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Notifications")
            .field("local_addr", &self.inner.local_addr)
            .field("config", &self.inner.config)
            .field("pending", &self.pending_len())
            .finish()
    }
}

// === Pending ===

/// One registration: resolves when its notifications arrived; dropping it removes the
/// entry, whatever its state.
///
/// `Send + Sync`, not `Clone`. It does not keep the registry alive: once every
/// [`Notifications`] handle is gone, [`ready`](Self::ready) returns
/// [`WaitError::Closed`].
pub struct Pending {
    req_id: Arc<str>,
    expected: usize,
    generation: u64,
    status: watch::Receiver<Status>,
    registry: Weak<Inner>,
}

impl Pending {
    /// The registered request id.
    pub fn req_id(&self) -> &str {
        &self.req_id
    }

    /// Notifications counted so far (at most [`expected`](Self::expected)).
    pub fn received(&self) -> usize {
        self.status.borrow().received
    }

    /// Notifications this registration waits for.
    pub fn expected(&self) -> usize {
        self.expected
    }

    /// Waits until [`expected`](Self::expected) notifications arrived; returns at once if
    /// they already have.
    ///
    /// Woken by the registry, no polling. Cancel-safe: dropping the future (e.g. on a
    /// `tokio::time::timeout`) loses nothing, and it may be called again.
    ///
    /// # Errors
    ///
    /// [`WaitError::Evicted`] when the registration outlived [`NotifyConfig::ttl`] before
    /// completing, [`WaitError::Closed`] when the registry shut down first.
    pub async fn ready(&self) -> Result<(), WaitError> {
        let mut status = self.status.clone();
        let state = status
            .wait_for(|status| status.state != State::Waiting)
            .await
            .map(|status| status.state);
        match state {
            Ok(State::Ready) => Ok(()),
            Ok(State::Evicted) => Err(WaitError::Evicted),
            Ok(State::Waiting) | Err(_) => Err(WaitError::Closed),
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(inner) = self.registry.upgrade() {
            inner.forget(&self.req_id, self.generation);
        }
    }
}

impl fmt::Debug for Pending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pending")
            .field("req_id", &self.req_id)
            .field("received", &self.received())
            .field("expected", &self.expected)
            .finish()
    }
}

#[cfg(test)]
mod tests;
