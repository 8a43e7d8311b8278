//! [`Subscriber`]: one ZMQ `SUB` socket per engine and data-parallel rank, feeding a
//! [`KvIndex`].
//!
//! # Endpoints
//!
//! An engine publishes on the endpoint of its `--kv-events-config` (`"endpoint":
//! "tcp://*:5557"`, bound by the engine) and, when `"replay_endpoint"` is set, answers
//! replay requests on a `ROUTER` socket. Data-parallel rank `r` publishes (and replays)
//! on the port plus `r` (`offset_endpoint_port` in vLLM's and SGLang's
//! `kv_events.py`). An [`EngineEndpoint`] names the engine as the router knows it (its
//! base URL), where rank 0 publishes, its replay endpoint if any, and its number of
//! ranks; [`EngineEndpoint::parse`] reads the `URL=tcp://HOST:PORT` form,
//! [`EngineEndpoint::on_engine_host`] the "engine's host, this port" form.
//!
//! # Sequence numbers
//!
//! Each rank's messages carry a sequence number that grows by one per batch, from 0
//! when the engine starts. The task of a rank remembers the last one applied:
//!
//! * **The next one**: applied.
//! * **A gap** (batches lost: the `PUB` socket drops messages for a slow subscriber,
//!   or the connection broke): with a replay endpoint, the missing batches are asked
//!   for (a `DEALER` sends the first missing seq as 8 big-endian bytes after an empty
//!   delimiter) and applied in order before the new one. The engine answers each
//!   buffered batch as `[empty, seq, payload]` (vLLM's and SGLang's `ROUTER`) or
//!   `[empty, topic, seq, payload]`, and ends with the same form carrying seq -1 (8
//!   bytes of `0xff`) and an empty payload, or with `[empty, empty]` (older vLLM);
//!   anything else is a malformed answer. Without a replay endpoint, when the engine's
//!   buffer no longer holds them, or when the replay fails, the rank's entries are
//!   dropped: stale entries would send requests to an engine that evicted their
//!   prefix, while an empty holder fills again from the next events (vLLM re-announces
//!   the prefix-cache hits of each request).
//! * **A lower one** (or the same one again after a reconnection): the engine
//!   restarted, so its cache is empty: the rank's entries are dropped and the new
//!   sequence is followed.
//! * **A higher one than the next, first after a resubscription**: a gap, or an engine
//!   that restarted and published past the old last before the subscription came
//!   back; the two cannot be told apart, so the rank's entries are dropped and, with a
//!   replay endpoint, the engine's history is replayed as for a first subscription
//!   (stale entries would route requests to a cache that no longer holds them).
//! * **The first batch after subscribing**, with a replay endpoint: the engine's
//!   buffered history before it is replayed, so a subscriber started late (or a proxy
//!   restarted) learns what the engines already hold. The buffer may no longer start
//!   at 0 (what it holds still teaches something), but a replay that fails (silent,
//!   refused, malformed, over its budget) drops the rank's entries, those it applied
//!   included: the batches after them, which may have removed them, never came.
//!
//! A batch that cannot be decoded, or a message that is not `[topic, seq, payload]`,
//! is a lost batch without a replay: the rank's entries are dropped.
//!
//! # Silence and restarts
//!
//! An engine publishes only when its cache changes, so silence alone is not a fault;
//! but a connection that died without a TCP reset (a host gone, a NAT entry expired)
//! also looks silent. After [`SubscriberConfig::silence_timeout`] without a message the
//! socket is closed and a new one subscribes (counted in [`RankStatus::resubscribes`]);
//! a receive error (the engine closed the connection) does the same at once. A
//! restarted engine is then recognized by its sequence numbers.
//!
//! A rank that stays without a working subscription (its publisher gone, refusing, or
//! breaking every subscription before a well-formed message) for
//! [`SubscriberConfig::disconnected_grace`] (30 s) has its entries dropped
//! ([`RankStatus::expiries`]): an engine that disappeared must not steer requests for
//! as long as it stays in the set. Its subscription is still tried; when it comes back
//! the rank starts afresh, its history replayed as on a first subscription.
//!
//! # Load reports
//!
//! An engine that publishes its load (SGLang's `--load-publish-endpoint`, see
//! [`crate::load`]) is given with [`EngineEndpoint::with_load`] (`load=` in the
//! spec): one more `SUB` per rank, topic `load`, whose reports go to the index's
//! [`LoadBoard`](crate::LoadBoard). A report is a gauge: sequence numbers are not
//! followed, a lost one is superseded by the next (the engine re-sends an unchanged
//! load every second), and one that cannot be decoded is counted and skipped. After
//! [`SubscriberConfig::silence_timeout`] without a report the socket is renewed; the
//! scorer stops using reports older than its `load_max_age` on its own.
//!
//! # Ceilings and isolation
//!
//! The sockets are `disagg-zmtp`'s: a message over [`SubscriberConfig::max_message`]
//! (8 MiB; load reports [`SubscriberConfig::max_load_message`], 64 KiB), more than 16
//! frames, or bytes that are not ZMTP disconnect the publisher at the frame header,
//! before anything is stored; a payload is decoded within
//! [`DecodeLimits::for_message`] of the same size; a peer that accepts the connection
//! and does not finish the ZMTP handshake within the connect timeout is disconnected
//! too. Every refusal is counted per socket and reason in [`RankStatus::malformed`]
//! ([`Malformed`]). A publisher at fault is subscribed to
//! again after a pause that starts at the connect timeout and doubles per failure in a
//! row up to [`SubscriberConfig::max_backoff`] (30 s); one that is not there is tried
//! again after 100 ms, doubling up to the connect timeout.
//!
//! A replay reads the answer one message at a time, applying each batch as it comes,
//! stops at the last batch it wants, and fails past
//! [`SubscriberConfig::replay_max_bytes`]. A failed replay (silent, refused, short,
//! malformed) backs the rank's next replays off the same way: gaps met meanwhile drop
//! the rank's entries at once ([`RankStatus::replays_skipped`]) instead of waiting the
//! replay timeout each, and a failing endpoint is not reconnected to per gap.
//!
//! Each rank's tasks run under a supervisor: a panic is caught, counted
//! ([`RankStatus::panics`]), the rank shown disconnected and its entries dropped, and
//! the task started again after the back-off; other ranks are not touched.
//!
//! # Membership
//!
//! [`Subscriber::set_endpoints`] replaces the set: new engines get tasks, engines that
//! left have their tasks stopped *and their entries dropped from the index*, engines
//! whose endpoints changed are both.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use disagg_zmtp::{Dealer, Limits, Sub};
use futures::FutureExt;
use tokio::task::JoinHandle;

use crate::event::{DecodeError, DecodeLimits, decode_batch_with, split_frames};
use crate::index::KvIndex;
use crate::load::{LOAD_TOPIC, decode_load};

mod endpoint;

pub use endpoint::{EndpointError, EngineEndpoint};

/// The default silence after which a rank is resubscribed: 30 s. An idle engine stays
/// silent that long without harm (resubscribing costs one TCP connection), and a dead
/// connection is noticed before the engines' caches have turned over much.
pub const DEFAULT_SILENCE_TIMEOUT: Duration = Duration::from_secs(30);

/// The default time to connect (and to wait between attempts): 2 s.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The default time a replay may take, end marker included: 2 s. The engine serves
/// replays between its publishing steps, so a buffer of thousands of batches comes
/// back within milliseconds on a healthy engine.
pub const DEFAULT_REPLAY_TIMEOUT: Duration = Duration::from_secs(2);

/// The default ceiling on one KV-event message (its frames' bytes together), on the
/// events socket and on replay answers: 8 MiB. An engine step's batch holds the
/// blocks stored and removed in that step: a 128k-token prompt at 16 tokens per block
/// is about 0.7 MB (5-byte token ids, 9-byte hashes), at SGLang's page size 1 about
/// 1.8 MB.
pub const DEFAULT_MAX_MESSAGE: usize = 8 << 20;

/// The default ceiling on one load report: 64 KiB (a `LoadStat` is about 100 bytes).
pub const DEFAULT_MAX_LOAD_MESSAGE: usize = 64 << 10;

/// The default longest pause between attempts to subscribe, or to replay, after
/// failures in a row: 30 s. The first pause is the connect timeout, doubled at each
/// failure up to this.
pub const DEFAULT_MAX_BACKOFF: Duration = Duration::from_secs(30);

/// The default bytes one replay may bring back: 64 MiB (a vLLM replay buffer holds
/// 10,000 batches by default, most of them a few KB).
pub const DEFAULT_REPLAY_MAX_BYTES: usize = 64 << 20;

/// The default time a rank may stay without a live subscription before its entries are
/// dropped: 30 s ([`SubscriberConfig::disconnected_grace`]). Long enough to ride out
/// a publisher's brief absence (a connection reset, a resubscription), short enough
/// that an engine gone for good stops steering requests soon after.
pub const DEFAULT_DISCONNECTED_GRACE: Duration = Duration::from_secs(30);

/// The first pause before connecting again to a publisher that was not there.
const FIRST_RETRY: Duration = Duration::from_millis(100);

/// The replay end marker's sequence number: -1 as a signed 64-bit big-endian integer.
const END_SEQ: u64 = u64::MAX;

/// Settings of a [`Subscriber`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriberConfig {
    /// The topic subscribed to (`""`, every topic, by default; the engines'
    /// `"topic"`).
    pub topic: String,
    /// Silence after which a rank is resubscribed.
    pub silence_timeout: Duration,
    /// Time to connect, and the first pause after a failed attempt (doubled at each
    /// failure in a row, up to [`max_backoff`](Self::max_backoff)).
    pub connect_timeout: Duration,
    /// The longest pause between attempts to subscribe or replay after failures in a
    /// row ([`DEFAULT_MAX_BACKOFF`]).
    pub max_backoff: Duration,
    /// Time a replay may take.
    pub replay_timeout: Duration,
    /// Bytes one replay may bring back ([`DEFAULT_REPLAY_MAX_BYTES`]); past them the
    /// replay fails like an incomplete one.
    pub replay_max_bytes: usize,
    /// The largest KV-event message, its frames together ([`DEFAULT_MAX_MESSAGE`]), on
    /// the events socket and in replay answers. A publisher that sends a larger one
    /// is disconnected and counted; decoding is bounded by the same size
    /// ([`DecodeLimits::for_message`]).
    pub max_message: usize,
    /// The largest load report ([`DEFAULT_MAX_LOAD_MESSAGE`]).
    pub max_load_message: usize,
    /// How long a rank that had a subscription may stay without a working one (its
    /// publisher gone, refusing, or breaking every subscription before a well-formed
    /// message) before its entries are dropped ([`DEFAULT_DISCONNECTED_GRACE`]);
    /// counted in [`RankStatus::expiries`]. When it subscribes again it starts afresh,
    /// as on its first subscription.
    pub disconnected_grace: Duration,
}

impl Default for SubscriberConfig {
    fn default() -> Self {
        SubscriberConfig {
            topic: String::new(),
            silence_timeout: DEFAULT_SILENCE_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            max_backoff: DEFAULT_MAX_BACKOFF,
            replay_timeout: DEFAULT_REPLAY_TIMEOUT,
            replay_max_bytes: DEFAULT_REPLAY_MAX_BYTES,
            max_message: DEFAULT_MAX_MESSAGE,
            max_load_message: DEFAULT_MAX_LOAD_MESSAGE,
            disconnected_grace: DEFAULT_DISCONNECTED_GRACE,
        }
    }
}

impl SubscriberConfig {
    /// The pause after `failures` failures in a row (at least 1): the connect timeout
    /// doubled per failure after the first, at most [`max_backoff`](Self::max_backoff).
    pub fn backoff(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(20);
        self.connect_timeout
            .saturating_mul(1 << doublings)
            .min(self.max_backoff.max(self.connect_timeout))
    }

    fn limits(&self, max_message: usize) -> Limits {
        Limits {
            handshake_timeout: self.connect_timeout,
            ..Limits::new(max_message)
        }
    }
}

/// Which of a rank's sockets a message came on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum SocketKind {
    /// The KV-events `SUB`.
    Events,
    /// The replay `DEALER`.
    Replay,
    /// The load-report `SUB`.
    Load,
}

impl SocketKind {
    /// `events`, `replay` or `load`.
    pub fn as_str(self) -> &'static str {
        match self {
            SocketKind::Events => "events",
            SocketKind::Replay => "replay",
            SocketKind::Load => "load",
        }
    }
}

/// Why a message, or the connection it came on, was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Malformed {
    /// A frame, message or frame count over the ceilings: the publisher was
    /// disconnected.
    Oversized,
    /// Not ZMTP 3 as a publisher (or replay `ROUTER`) speaks it: disconnected.
    Protocol,
    /// Not `[topic, seq (8 bytes), payload]`; on the replay socket, none of the answer
    /// forms (`[empty, seq, payload]`, `[empty, topic, seq, payload]`, `[empty,
    /// empty]`).
    Shape,
    /// A payload that does not decode (within [`DecodeLimits`]).
    Undecodable,
    /// A peer that accepted the connection but did not finish the ZMTP handshake
    /// within the connect timeout (`Limits::handshake_timeout`): disconnected.
    Timeout,
}

impl Malformed {
    /// `oversized`, `protocol`, `shape`, `undecodable` or `timeout`.
    pub fn as_str(self) -> &'static str {
        match self {
            Malformed::Oversized => "oversized",
            Malformed::Protocol => "protocol",
            Malformed::Shape => "shape",
            Malformed::Undecodable => "undecodable",
            Malformed::Timeout => "timeout",
        }
    }

    fn of_decode(e: &DecodeError) -> Malformed {
        match e {
            DecodeError::Frames { .. } => Malformed::Shape,
            _ => Malformed::Undecodable,
        }
    }

    /// The connection-level reason of a ZMTP error, if it is the peer's fault (a peer
    /// that does not answer the TCP connection at all is not: nobody is there).
    fn of_zmtp(e: &disagg_zmtp::Error) -> Option<Malformed> {
        match e.reject() {
            disagg_zmtp::Reject::Oversized => Some(Malformed::Oversized),
            disagg_zmtp::Reject::Protocol => Some(Malformed::Protocol),
            disagg_zmtp::Reject::Timeout => Some(Malformed::Timeout),
            _ => None,
        }
    }
}

/// What one rank's subscription has seen.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankStatus {
    /// The engine.
    pub engine: String,
    /// The rank.
    pub dp_rank: u32,
    /// Whether the `SUB` socket is connected now (and its task alive).
    pub connected: bool,
    /// The last sequence number applied.
    pub last_seq: Option<u64>,
    /// Batches applied (replayed ones included).
    pub batches: u64,
    /// Sequence gaps seen.
    pub gaps: u64,
    /// Batches recovered by replay.
    pub replayed: u64,
    /// Replays that failed or could not cover a gap.
    pub replay_failures: u64,
    /// Gaps not asked for again because replays were backing off after failures.
    pub replays_skipped: u64,
    /// Restarts detected (the sequence went back).
    pub restarts: u64,
    /// Subscriptions renewed after silence or a receive error.
    pub resubscribes: u64,
    /// Messages that could not be decoded.
    pub decode_errors: u64,
    /// Times the rank's entries were dropped (gap without replay, failed replay,
    /// restart, bad message, publisher gone past the grace).
    pub drops: u64,
    /// Times the rank's entries were dropped because it stayed without a subscription
    /// past [`SubscriberConfig::disconnected_grace`] (also counted in
    /// [`drops`](Self::drops)).
    pub expiries: u64,
    /// Blocks of `BlockStored` events applied but not indexed (a LoRA or salted hash,
    /// another KV cache group, another block size than the holder's, an unknown parent:
    /// see [`Applied::skipped`](crate::index::Applied::skipped)).
    pub skipped_blocks: u64,
    /// Whether the load-report `SUB` socket is connected now (`false` without a load
    /// endpoint).
    pub load_connected: bool,
    /// Load reports recorded.
    pub load_reports: u64,
    /// Load reports that could not be decoded.
    pub load_decode_errors: u64,
    /// Messages and connections refused, by socket and reason.
    pub malformed: BTreeMap<(SocketKind, Malformed), u64>,
    /// Times a task of this rank panicked (it is restarted after a pause).
    pub panics: u64,
}

type Statuses = Arc<Mutex<HashMap<(String, u32), RankStatus>>>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Only counters live under these locks.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The KV-event subscriptions of a set of engines; see the [module docs](self).
///
/// Must be used within a Tokio runtime. Dropping it stops its tasks.
///
/// # Examples
///
/// ```no_run
/// use std::sync::Arc;
///
/// use disagg_kvevents::{EngineEndpoint, IndexConfig, KvIndex, Subscriber, SubscriberConfig};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let index = Arc::new(KvIndex::new(IndexConfig::default()));
/// let subscriber = Subscriber::new(index.clone(), SubscriberConfig::default());
/// subscriber
///     .set_endpoints(vec![
///         EngineEndpoint::parse("http://10.0.0.5:8000=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558")?,
///         EngineEndpoint::on_engine_host("http://10.0.0.6:8000", 5557, Some(5558))?,
///     ])
///     .await;
/// // Routers read `index` (or a `KvScorer` over it) from now on.
/// # Ok(())
/// # }
/// ```
pub struct Subscriber {
    index: Arc<KvIndex>,
    config: Arc<SubscriberConfig>,
    engines: tokio::sync::Mutex<HashMap<String, Running>>,
    statuses: Statuses,
}

impl fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscriber")
            .field("config", &self.config)
            .field("ranks", &lock(&self.statuses).len())
            .finish_non_exhaustive()
    }
}

/// One engine's tasks, one per rank.
struct Running {
    endpoint: EngineEndpoint,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// An engine unsubscribed: its statuses and index entries dropped when this drops,
/// after its ranks' tasks were waited for, or when the wait is given up. In that case
/// a rank task that was running on another worker when it was aborted may still apply
/// the batch in hand after the entries went: entries of an engine no longer among the
/// candidates, which no routing reads, and which the index's ceilings bound.
struct Unsubscribed<'a> {
    name: &'a str,
    statuses: &'a Statuses,
    index: &'a KvIndex,
}

impl Drop for Unsubscribed<'_> {
    fn drop(&mut self) {
        lock(self.statuses).retain(|(engine, _), _| engine != self.name);
        self.index.remove_engine(self.name);
        tracing::debug!(engine = %self.name, "kv events: unsubscribed");
    }
}

// === impl Subscriber ===

impl Subscriber {
    /// A subscriber writing into `index`, with no engine yet.
    pub fn new(index: Arc<KvIndex>, config: SubscriberConfig) -> Self {
        Subscriber {
            index,
            config: Arc::new(config),
            engines: tokio::sync::Mutex::default(),
            statuses: Arc::default(),
        }
    }

    /// The index written.
    pub fn index(&self) -> &Arc<KvIndex> {
        &self.index
    }

    /// Replaces the set of engines subscribed to. Engines that left, or whose
    /// endpoints changed, are unsubscribed and their index entries dropped (once their
    /// tasks stopped, so none writes afterwards); new ones are subscribed.
    pub async fn set_endpoints(&self, endpoints: Vec<EngineEndpoint>) {
        let mut engines = self.engines.lock().await;
        let wanted: HashMap<String, EngineEndpoint> = endpoints
            .into_iter()
            .map(|e| (e.engine.clone(), e))
            .collect();
        let leaving: Vec<String> = engines
            .iter()
            .filter(|(name, running)| wanted.get(*name) != Some(&running.endpoint))
            .map(|(name, _)| name.clone())
            .collect();
        for name in leaving {
            if let Some(mut running) = engines.remove(&name) {
                let tasks = std::mem::take(&mut running.tasks);
                // Every rank is told to stop before any is waited for, and the engine's
                // entries go when the waits end or are given up (a caller that drops
                // this future leaves no rank running and nothing of the engine behind).
                for task in &tasks {
                    task.abort();
                }
                let _gone = Unsubscribed {
                    name: &name,
                    statuses: &self.statuses,
                    index: &self.index,
                };
                for task in tasks {
                    // Cancelled (or already ended): either way it writes no more.
                    let _ = task.await;
                }
            }
        }
        for (name, endpoint) in wanted {
            if engines.contains_key(&name) {
                continue;
            }
            let mut tasks: Vec<JoinHandle<()>> = Vec::new();
            for rank in 0..endpoint.dp_size {
                lock(&self.statuses).insert(
                    (name.clone(), rank),
                    RankStatus {
                        engine: name.clone(),
                        dp_rank: rank,
                        ..RankStatus::default()
                    },
                );
                let shared = Shared {
                    index: self.index.clone(),
                    config: self.config.clone(),
                    statuses: self.statuses.clone(),
                    engine: name.clone(),
                    rank,
                };
                let (publisher, replay) = (endpoint.publisher_of(rank), endpoint.replay_of(rank));
                let events = shared.clone();
                tasks.push(tokio::spawn(supervise(
                    shared.clone(),
                    SocketKind::Events,
                    move || {
                        let task = RankTask {
                            shared: events.clone(),
                            publisher: publisher.clone(),
                            replay: replay.clone(),
                            last_seq: None,
                            replay_failures: 0,
                            replay_after: None,
                            disconnected_since: None,
                        };
                        move || task.run()
                    },
                )));
                if let Some(load) = endpoint.load_of(rank) {
                    let reports = shared.clone();
                    tasks.push(tokio::spawn(supervise(
                        shared,
                        SocketKind::Load,
                        move || {
                            let task = LoadTask {
                                shared: reports.clone(),
                                load: load.clone(),
                            };
                            move || task.run()
                        },
                    )));
                }
            }
            engines.insert(name, Running { endpoint, tasks });
        }
    }

    /// The engines subscribed to.
    pub async fn endpoints(&self) -> Vec<EngineEndpoint> {
        let mut all: Vec<EngineEndpoint> = self
            .engines
            .lock()
            .await
            .values()
            .map(|r| r.endpoint.clone())
            .collect();
        all.sort_by(|a, b| a.engine.cmp(&b.engine));
        all
    }

    /// Every rank's status, sorted by engine and rank.
    pub fn status(&self) -> Vec<RankStatus> {
        let mut all: Vec<RankStatus> = lock(&self.statuses).values().cloned().collect();
        all.sort_by(|a, b| (&a.engine, a.dp_rank).cmp(&(&b.engine, b.dp_rank)));
        all
    }

    /// Stops every task (the index keeps its entries).
    pub async fn shutdown(self) {
        let running: Vec<Running> = self.engines.lock().await.drain().map(|(_, r)| r).collect();
        let tasks: Vec<JoinHandle<()>> = running
            .into_iter()
            .flat_map(|mut r| std::mem::take(&mut r.tasks))
            .collect();
        // All told to stop before any is waited for: dropping this future mid-wait
        // leaves none running.
        for task in &tasks {
            task.abort();
        }
        for task in tasks {
            let _ = task.await;
        }
    }
}

/// Runs the task `make` builds until it ends, and builds it again after a panic: the
/// panic is counted, the rank shown disconnected (its entries dropped, for the events
/// task: what it applied last is unknown), and the new task starts after the back-off
/// of the panics in a row. A panic in one rank's task touches no other rank.
async fn supervise<F, Fut>(shared: Shared, kind: SocketKind, mut make: impl FnMut() -> F)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = ()> + Send,
{
    let mut panics_in_row = 0;
    loop {
        let task = make()();
        if std::panic::AssertUnwindSafe(task)
            .catch_unwind()
            .await
            .is_ok()
        {
            return;
        }
        panics_in_row += 1;
        tracing::error!(engine = %shared.engine, rank = shared.rank, socket = kind.as_str(), "kv events: the subscription's task panicked; restarting it");
        if kind == SocketKind::Events {
            shared.index.clear(&shared.engine, shared.rank);
        }
        shared.status(|s| {
            s.panics += 1;
            match kind {
                SocketKind::Load => s.load_connected = false,
                _ => s.connected = false,
            }
        });
        tokio::time::sleep(shared.config.backoff(panics_in_row)).await;
    }
}

/// What every task of one rank holds.
#[derive(Clone)]
struct Shared {
    index: Arc<KvIndex>,
    config: Arc<SubscriberConfig>,
    statuses: Statuses,
    engine: String,
    rank: u32,
}

impl Shared {
    /// Applies `f` to the rank's status, if it is still listed.
    fn status(&self, f: impl FnOnce(&mut RankStatus)) {
        if let Some(s) = lock(&self.statuses).get_mut(&(self.engine.clone(), self.rank)) {
            f(s);
        }
    }

    /// Counts one refused message or connection.
    fn malformed(&self, kind: SocketKind, why: Malformed) {
        self.status(|s| *s.malformed.entry((kind, why)).or_default() += 1);
    }

    /// A `SUB` socket connected to `endpoint` and subscribed to `topic`, with the
    /// ceiling `max_message`. After an attempt the peer failed (over a ceiling, not
    /// ZMTP), counted in `failures`, the next waits the back-off of the failures in a
    /// row; after one that found nobody, 100 ms, doubled while nobody answers up to
    /// the connect timeout. `failures` carries the
    /// count across subscriptions: the caller resets it once a subscription delivered
    /// a well-formed message.
    async fn subscribe(
        &self,
        endpoint: &str,
        topic: &[u8],
        kind: SocketKind,
        max_message: usize,
        failures: &mut u32,
    ) -> Sub {
        let limits = self.config.limits(max_message);
        let mut refused: u32 = 0;
        loop {
            if *failures > 0 {
                tokio::time::sleep(self.config.backoff(*failures)).await;
            }
            match Sub::connect(endpoint, topic, limits, self.config.connect_timeout).await {
                Ok(sub) => {
                    tracing::debug!(engine = %self.engine, rank = self.rank, endpoint, "subscribed");
                    return sub;
                }
                Err(e) => {
                    tracing::debug!(engine = %self.engine, rank = self.rank, endpoint, error = %e, "cannot subscribe");
                    match Malformed::of_zmtp(&e) {
                        // The peer's fault: counted, and the pauses grow.
                        Some(why) => {
                            self.malformed(kind, why);
                            *failures = failures.saturating_add(1);
                        }
                        // Nobody there (yet): try again soon, so that a restarted
                        // engine is found again promptly (100 ms, doubling up to the
                        // connect timeout while nobody answers).
                        None => {
                            let pause = FIRST_RETRY
                                .saturating_mul(1 << refused.min(16))
                                .min(self.config.connect_timeout);
                            refused += 1;
                            tokio::time::sleep(pause).await;
                        }
                    }
                }
            }
        }
    }

    /// A receive error on `kind`'s socket: counted when the peer is at fault (then the
    /// next subscription backs off); whether it is.
    fn receive_failed(&self, kind: SocketKind, e: &disagg_zmtp::Error, failures: &mut u32) -> bool {
        if let Some(why) = Malformed::of_zmtp(e) {
            self.malformed(kind, why);
            *failures = failures.saturating_add(1);
            tracing::warn!(engine = %self.engine, rank = self.rank, socket = kind.as_str(), error = %e, "kv events: peer disconnected");
            true
        } else {
            tracing::debug!(engine = %self.engine, rank = self.rank, socket = kind.as_str(), error = %e, "kv events: receive failed, resubscribing");
            false
        }
    }
}

/// One rank's load-report subscription (see the [module docs](self)).
struct LoadTask {
    shared: Shared,
    load: String,
}

impl LoadTask {
    async fn run(self) {
        let shared = &self.shared;
        let mut failures = 0;
        loop {
            let mut socket = shared
                .subscribe(
                    &self.load,
                    LOAD_TOPIC,
                    SocketKind::Load,
                    shared.config.max_load_message,
                    &mut failures,
                )
                .await;
            shared.status(|s| s.load_connected = true);
            // Until silence or an error; the next subscription starts afresh.
            loop {
                let message = match tokio::time::timeout(
                    shared.config.silence_timeout,
                    socket.recv(),
                )
                .await
                {
                    Ok(Ok(message)) => message,
                    Ok(Err(e)) => {
                        shared.receive_failed(SocketKind::Load, &e, &mut failures);
                        break;
                    }
                    Err(_) => break,
                };
                let views: Vec<&[u8]> = message.iter().map(|f| &f[..]).collect();
                match split_frames(&views).and_then(|f| decode_load(f.payload)) {
                    Ok(stat) => {
                        failures = 0;
                        shared.index.loads().record(
                            &shared.engine,
                            shared.rank,
                            stat,
                            Instant::now(),
                        );
                        shared.status(|s| s.load_reports += 1);
                    }
                    Err(e) => {
                        tracing::debug!(engine = %shared.engine, rank = shared.rank, error = %e, "load reports: undecodable report");
                        shared.malformed(SocketKind::Load, Malformed::of_decode(&e));
                        shared.status(|s| s.load_decode_errors += 1);
                    }
                }
            }
            shared.status(|s| s.load_connected = false);
        }
    }
}

/// One rank's subscription.
struct RankTask {
    shared: Shared,
    publisher: String,
    replay: Option<String>,
    last_seq: Option<u64>,
    /// Replays failed in a row, and when the next may be tried.
    replay_failures: u32,
    replay_after: Option<tokio::time::Instant>,
    /// When the rank's last subscription ended (`None` before the first ended). A
    /// subscription the publisher broke (over a ceiling, not ZMTP) before a
    /// well-formed message does not count: the rank has been without a working one
    /// since the one before.
    disconnected_since: Option<tokio::time::Instant>,
}

impl RankTask {
    fn status(&self, f: impl FnOnce(&mut RankStatus)) {
        self.shared.status(f);
    }

    async fn run(mut self) {
        let mut first = true;
        let mut failures = 0;
        loop {
            if !first {
                self.status(|s| s.resubscribes += 1);
            }
            first = false;
            let socket = self.subscribe(&mut failures).await;
            self.status(|s| s.connected = true);
            let worked = self.receive(socket, &mut failures).await;
            self.status(|s| s.connected = false);
            if worked || self.disconnected_since.is_none() {
                self.disconnected_since = Some(tokio::time::Instant::now());
            }
        }
    }

    /// A new subscription. While it is being tried, a rank that holds entries has them
    /// dropped once it has been without a working subscription for
    /// [`SubscriberConfig::disconnected_grace`]; it then starts afresh.
    async fn subscribe(&mut self, failures: &mut u32) -> Sub {
        let topic = self.shared.config.topic.clone();
        let max_message = self.shared.config.max_message;
        loop {
            // Past the grace, once: `expire` forgets the sequence, so the next attempt
            // has no deadline.
            let expiry = self
                .disconnected_since
                .filter(|_| self.last_seq.is_some())
                .map(|since| since + self.shared.config.disconnected_grace);
            let attempt = self.shared.subscribe(
                &self.publisher,
                topic.as_bytes(),
                SocketKind::Events,
                max_message,
                failures,
            );
            let Some(expiry) = expiry else {
                return attempt.await;
            };
            match tokio::time::timeout_at(expiry, attempt).await {
                Ok(socket) => return socket,
                Err(_) => self.expire(),
            }
        }
    }

    /// Drops the entries of a rank left without a subscription past the grace, and
    /// forgets its sequence: its next subscription starts as the first did.
    fn expire(&mut self) {
        tracing::info!(engine = %self.shared.engine, rank = self.shared.rank, grace = ?self.shared.config.disconnected_grace, "kv events: publisher unreachable past the grace, dropping the rank's entries");
        self.shared
            .index
            .reset(&self.shared.engine, self.shared.rank);
        self.last_seq = None;
        self.status(|s| {
            s.expiries += 1;
            s.drops += 1;
            s.last_seq = None;
        });
    }

    /// Receives until silence or an error; whether the subscription worked: not broken
    /// by the publisher's fault before a well-formed message.
    async fn receive(&mut self, mut socket: Sub, failures: &mut u32) -> bool {
        let mut delivered = false;
        // The first batch of this subscription catches up on the engine's history.
        let mut catch_up = true;
        let silence = self.shared.config.silence_timeout;
        loop {
            let message = match tokio::time::timeout(silence, socket.recv()).await {
                Ok(Ok(message)) => message,
                Ok(Err(e)) => {
                    let fault = self.shared.receive_failed(SocketKind::Events, &e, failures);
                    return delivered || !fault;
                }
                Err(_) => {
                    tracing::debug!(engine = %self.shared.engine, rank = self.shared.rank, "kv events: silent, resubscribing");
                    return true;
                }
            };
            let views: Vec<&[u8]> = message.iter().map(|f| &f[..]).collect();
            let parsed = match split_frames(&views) {
                Ok(parsed) => parsed,
                Err(e) => {
                    // A lost batch, whatever it was: what it said is unknown.
                    tracing::warn!(engine = %self.shared.engine, rank = self.shared.rank, error = %e, "kv events: message of the wrong shape, dropping the rank's entries");
                    self.lost(SocketKind::Events, &e);
                    continue;
                }
            };
            *failures = 0;
            delivered = true;
            let seq = parsed.seq;
            match self.last_seq {
                Some(last) if seq <= last => {
                    // The sequence went back: a new engine process.
                    tracing::info!(engine = %self.shared.engine, rank = self.shared.rank, seq, last, "kv events: engine restarted, dropping its entries");
                    self.shared
                        .index
                        .reset(&self.shared.engine, self.shared.rank);
                    self.status(|s| {
                        s.restarts += 1;
                        s.drops += 1;
                    });
                }
                // The first batch after a resubscription, past the next one: a gap cannot
                // be told from a restarted engine that published beyond the old last
                // before the subscription came back (a replay of the gap would then bring
                // the new process's batches on top of the old one's entries). Its entries
                // are dropped and its history replayed, as for a first subscription.
                Some(last) if catch_up && seq > last.saturating_add(1) => {
                    tracing::info!(engine = %self.shared.engine, rank = self.shared.rank, seq, last, "kv events: resubscribed past a gap, the engine may have restarted; dropping its entries");
                    self.shared
                        .index
                        .reset(&self.shared.engine, self.shared.rank);
                    self.status(|s| {
                        s.gaps += 1;
                        s.drops += 1;
                    });
                    if self.replay.is_some() && self.replay_allowed() {
                        self.catch_up(seq).await;
                    }
                }
                Some(last) if seq > last.saturating_add(1) => {
                    self.status(|s| s.gaps += 1);
                    self.recover(last + 1, seq).await;
                }
                // Best effort: a history the buffer no longer starts at 0 for still
                // teaches what it holds.
                None if catch_up && seq > 0 && self.replay.is_some() && self.replay_allowed() => {
                    self.catch_up(seq).await;
                }
                _ => {}
            }
            catch_up = false;
            self.apply(seq, parsed.payload, SocketKind::Events);
        }
    }

    /// Applies one batch (or drops the rank's entries if it cannot be decoded).
    fn apply(&mut self, seq: u64, payload: &[u8], kind: SocketKind) {
        let limits = DecodeLimits::for_message(self.shared.config.max_message);
        let (engine, rank) = (&self.shared.engine, self.shared.rank);
        match decode_batch_with(payload, &limits) {
            Ok(batch) => {
                if batch.dp_rank.is_some_and(|r| r != rank) {
                    tracing::debug!(engine = %engine, rank, batch_rank = ?batch.dp_rank, "kv events: batch names another rank than its port");
                }
                let applied = self.shared.index.apply(engine, rank, &batch);
                let skipped = u64::try_from(applied.skipped).unwrap_or(u64::MAX);
                self.status(|s| {
                    s.batches += 1;
                    s.skipped_blocks = s.skipped_blocks.saturating_add(skipped);
                });
            }
            Err(e) => {
                tracing::warn!(engine = %engine, rank, seq, error = %e, "kv events: undecodable batch, dropping the rank's entries");
                self.lost(kind, &e);
            }
        }
        self.last_seq = Some(seq);
        self.status(|s| s.last_seq = Some(seq));
    }

    /// A message whose content is unknown (its frames or its batch did not decode): a
    /// lost batch, so the rank's entries are dropped, and the fault counted.
    fn lost(&self, kind: SocketKind, e: &DecodeError) {
        self.shared
            .index
            .clear(&self.shared.engine, self.shared.rank);
        self.shared.malformed(kind, Malformed::of_decode(e));
        self.status(|s| {
            s.decode_errors += 1;
            s.drops += 1;
        });
    }
}

mod replay;

#[cfg(test)]
mod tests;
