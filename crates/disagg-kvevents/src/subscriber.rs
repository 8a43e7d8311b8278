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
//!   delimiter; the engine answers `[empty, topic, seq, payload]` per buffered batch,
//!   then `[empty, empty, -1 as 8 bytes, empty]`) and applied in order before the new
//!   one. Without a replay endpoint, or when the engine's buffer no longer holds them,
//!   the rank's entries are dropped: stale entries would send requests to an engine
//!   that evicted their prefix, while an empty holder fills again from the next
//!   events (vLLM re-announces the prefix-cache hits of each request).
//! * **A lower one** (or the same one again after a reconnection): the engine
//!   restarted, so its cache is empty: the rank's entries are dropped and the new
//!   sequence is followed.
//! * **The first batch after subscribing**, with a replay endpoint: the engine's
//!   buffered history before it is replayed, so a subscriber started late (or a proxy
//!   restarted) learns what the engines already hold.
//!
//! A batch that cannot be decoded is a lost batch without a replay: the rank's entries
//! are dropped.
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
//! # Membership
//!
//! [`Subscriber::set_endpoints`] replaces the set: new engines get tasks, engines that
//! left have their tasks stopped *and their entries dropped from the index*, engines
//! whose endpoints changed are both.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::task::JoinHandle;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::event::{decode_batch, split_frames};
use crate::index::KvIndex;
use crate::load::{LOAD_TOPIC, decode_load};

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

/// The replay end marker's sequence number: -1 as a signed 64-bit big-endian integer.
const END_SEQ: u64 = u64::MAX;

/// Why an endpoint specification was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointError {
    /// Not `ENGINE=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,load=tcp://HOST:PORT][,dp-size=N]`.
    #[error(
        "kv-events endpoint {0:?} is not ENGINE=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,load=tcp://HOST:PORT][,dp-size=N]"
    )]
    Spec(String),
    /// Not `tcp://HOST:PORT` with a port number.
    #[error("{0:?} is not tcp://HOST:PORT")]
    Tcp(String),
    /// An engine URL without a host.
    #[error("engine URL {0:?} has no host")]
    EngineUrl(String),
    /// Rank ports beyond 65535.
    #[error("port {port} plus {dp_size} ranks goes beyond 65535")]
    PortRange {
        /// Rank 0's port.
        port: u16,
        /// The ranks.
        dp_size: u32,
    },
}

/// Where one engine publishes its KV events.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EngineEndpoint {
    /// The engine's id, as the router names it (its base URL): the index's entries are
    /// kept under it.
    pub engine: String,
    /// Where rank 0 publishes: `tcp://HOST:PORT`.
    pub publisher: String,
    /// Where rank 0 answers replays, if it does: `tcp://HOST:PORT`.
    pub replay: Option<String>,
    /// Where rank 0 publishes its load reports, if it does (SGLang's
    /// `--load-publish-endpoint`): `tcp://HOST:PORT`.
    pub load: Option<String>,
    /// Data-parallel ranks (at least 1): rank `r` on the ports plus `r`.
    pub dp_size: u32,
}

impl EngineEndpoint {
    /// An engine with one rank and no replay endpoint.
    ///
    /// # Errors
    ///
    /// [`EndpointError::Tcp`] unless `publisher` is `tcp://HOST:PORT`.
    pub fn new(
        engine: impl Into<String>,
        publisher: impl Into<String>,
    ) -> Result<Self, EndpointError> {
        let publisher = publisher.into();
        tcp_port(&publisher)?;
        Ok(EngineEndpoint {
            engine: engine.into(),
            publisher,
            replay: None,
            load: None,
            dp_size: 1,
        })
    }

    /// With a replay endpoint.
    ///
    /// # Errors
    ///
    /// [`EndpointError::Tcp`] unless `replay` is `tcp://HOST:PORT`.
    pub fn with_replay(mut self, replay: impl Into<String>) -> Result<Self, EndpointError> {
        let replay = replay.into();
        tcp_port(&replay)?;
        self.replay = Some(replay);
        Ok(self)
    }

    /// With a load-report endpoint (see [`crate::load`]).
    ///
    /// # Errors
    ///
    /// [`EndpointError::Tcp`] unless `load` is `tcp://HOST:PORT`.
    pub fn with_load(mut self, load: impl Into<String>) -> Result<Self, EndpointError> {
        let load = load.into();
        tcp_port(&load)?;
        self.load = Some(load);
        Ok(self)
    }

    /// With `dp_size` data-parallel ranks (at least 1).
    ///
    /// # Errors
    ///
    /// [`EndpointError::PortRange`] when the last rank's port would pass 65535.
    pub fn with_dp_size(mut self, dp_size: u32) -> Result<Self, EndpointError> {
        let dp_size = dp_size.max(1);
        for endpoint in std::iter::once(&self.publisher)
            .chain(&self.replay)
            .chain(&self.load)
        {
            let port = tcp_port(endpoint)?;
            if u32::from(port) + dp_size - 1 > u32::from(u16::MAX) {
                return Err(EndpointError::PortRange { port, dp_size });
            }
        }
        self.dp_size = dp_size;
        Ok(self)
    }

    /// Reads `ENGINE=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,load=tcp://HOST:PORT][,dp-size=N]`
    /// (the proxy's `--kv-events-endpoint`, or a discovery annotation).
    ///
    /// # Errors
    ///
    /// An [`EndpointError`] for anything else.
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_kvevents::EngineEndpoint;
    ///
    /// let e = EngineEndpoint::parse(
    ///     "http://10.0.0.5:8000=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558,dp-size=2",
    /// )?;
    /// assert_eq!(e.engine, "http://10.0.0.5:8000");
    /// assert_eq!(e.publisher_of(1), "tcp://10.0.0.5:5558");
    /// assert_eq!(e.replay_of(1).as_deref(), Some("tcp://10.0.0.5:5559"));
    /// # Ok::<(), disagg_kvevents::subscriber::EndpointError>(())
    /// ```
    pub fn parse(spec: &str) -> Result<Self, EndpointError> {
        let bad = || EndpointError::Spec(spec.to_owned());
        let at = spec.find("=tcp://").ok_or_else(bad)?;
        let engine = &spec[..at];
        if engine.is_empty() {
            return Err(bad());
        }
        let mut parts = spec[at + 1..].split(',');
        let mut endpoint = EngineEndpoint::new(engine, parts.next().ok_or_else(bad)?)?;
        let mut dp_size = 1;
        for part in parts {
            match part.split_once('=') {
                Some(("replay", replay)) => endpoint = endpoint.with_replay(replay)?,
                Some(("load", load)) => endpoint = endpoint.with_load(load)?,
                Some(("dp-size", n)) => dp_size = n.parse().map_err(|_| bad())?,
                _ => return Err(bad()),
            }
        }
        endpoint.with_dp_size(dp_size)
    }

    /// The engine's own host, on `port` (and `replay_port`): the proxy's
    /// `--kv-events-port`, for engines that all publish on the same port.
    ///
    /// # Errors
    ///
    /// [`EndpointError::EngineUrl`] when `engine_url` has no host.
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_kvevents::EngineEndpoint;
    ///
    /// let e = EngineEndpoint::on_engine_host("http://[fd00::7]:8000/", 5557, Some(5558))?;
    /// assert_eq!(e.publisher, "tcp://[fd00::7]:5557");
    /// assert_eq!(e.replay.as_deref(), Some("tcp://[fd00::7]:5558"));
    /// # Ok::<(), disagg_kvevents::subscriber::EndpointError>(())
    /// ```
    pub fn on_engine_host(
        engine_url: &str,
        port: u16,
        replay_port: Option<u16>,
    ) -> Result<Self, EndpointError> {
        let host =
            url_host(engine_url).ok_or_else(|| EndpointError::EngineUrl(engine_url.to_owned()))?;
        let endpoint = EngineEndpoint::new(engine_url, format!("tcp://{host}:{port}"))?;
        match replay_port {
            Some(p) => endpoint.with_replay(format!("tcp://{host}:{p}")),
            None => Ok(endpoint),
        }
    }

    /// Where rank `rank` publishes.
    pub fn publisher_of(&self, rank: u32) -> String {
        offset_port(&self.publisher, rank)
    }

    /// Where rank `rank` answers replays.
    pub fn replay_of(&self, rank: u32) -> Option<String> {
        self.replay.as_deref().map(|r| offset_port(r, rank))
    }

    /// Where rank `rank` publishes its load reports.
    pub fn load_of(&self, rank: u32) -> Option<String> {
        self.load.as_deref().map(|l| offset_port(l, rank))
    }
}

/// The port of `tcp://HOST:PORT`.
fn tcp_port(endpoint: &str) -> Result<u16, EndpointError> {
    let bad = || EndpointError::Tcp(endpoint.to_owned());
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(bad)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    if host.is_empty() {
        return Err(bad());
    }
    port.parse().map_err(|_| bad())
}

/// `tcp://HOST:PORT` with the port plus `rank` (checked by [`EngineEndpoint::with_dp_size`]).
fn offset_port(endpoint: &str, rank: u32) -> String {
    match (endpoint.rsplit_once(':'), tcp_port(endpoint)) {
        (Some((base, _)), Ok(port)) => format!("{base}:{}", u32::from(port) + rank),
        _ => endpoint.to_owned(),
    }
}

/// The host of `scheme://host[:port][/...]`, brackets kept for IPv6.
fn url_host(url: &str) -> Option<&str> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next()?;
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    let host = if authority.starts_with('[') {
        &authority[..=authority.find(']')?]
    } else {
        authority.split(':').next()?
    };
    (!host.is_empty()).then_some(host)
}

/// Settings of a [`Subscriber`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriberConfig {
    /// The topic subscribed to (`""`, every topic, by default; the engines'
    /// `"topic"`).
    pub topic: String,
    /// Silence after which a rank is resubscribed.
    pub silence_timeout: Duration,
    /// Time to connect, and between attempts.
    pub connect_timeout: Duration,
    /// Time a replay may take.
    pub replay_timeout: Duration,
}

impl Default for SubscriberConfig {
    fn default() -> Self {
        SubscriberConfig {
            topic: String::new(),
            silence_timeout: DEFAULT_SILENCE_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            replay_timeout: DEFAULT_REPLAY_TIMEOUT,
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
    /// Whether the `SUB` socket is connected now.
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
    /// Restarts detected (the sequence went back).
    pub restarts: u64,
    /// Subscriptions renewed after silence or a receive error.
    pub resubscribes: u64,
    /// Messages that could not be decoded.
    pub decode_errors: u64,
    /// Times the rank's entries were dropped (gap without replay, restart, bad batch).
    pub drops: u64,
    /// Whether the load-report `SUB` socket is connected now (`false` without a load
    /// endpoint).
    pub load_connected: bool,
    /// Load reports recorded.
    pub load_reports: u64,
    /// Load reports that could not be decoded.
    pub load_decode_errors: u64,
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
                for task in std::mem::take(&mut running.tasks) {
                    task.abort();
                    // Cancelled (or already ended): either way it writes no more.
                    let _ = task.await;
                }
                lock(&self.statuses).retain(|(engine, _), _| *engine != name);
                self.index.remove_engine(&name);
                tracing::debug!(engine = %name, "kv events: unsubscribed");
            }
        }
        for (name, endpoint) in wanted {
            if engines.contains_key(&name) {
                continue;
            }
            let mut tasks: Vec<JoinHandle<()>> = (0..endpoint.dp_size)
                .map(|rank| {
                    let task = RankTask {
                        index: self.index.clone(),
                        config: self.config.clone(),
                        statuses: self.statuses.clone(),
                        engine: name.clone(),
                        rank,
                        publisher: endpoint.publisher_of(rank),
                        replay: endpoint.replay_of(rank),
                        last_seq: None,
                    };
                    lock(&self.statuses).insert(
                        (name.clone(), rank),
                        RankStatus {
                            engine: name.clone(),
                            dp_rank: rank,
                            ..RankStatus::default()
                        },
                    );
                    tokio::spawn(task.run())
                })
                .collect();
            for rank in 0..endpoint.dp_size {
                if let Some(load) = endpoint.load_of(rank) {
                    let task = LoadTask {
                        index: self.index.clone(),
                        config: self.config.clone(),
                        statuses: self.statuses.clone(),
                        engine: name.clone(),
                        rank,
                        load,
                    };
                    tasks.push(tokio::spawn(task.run()));
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
        for mut r in running {
            for task in std::mem::take(&mut r.tasks) {
                task.abort();
                let _ = task.await;
            }
        }
    }
}

/// A `SUB` socket connected to `endpoint` and subscribed to `topic`, for `rank` of
/// `engine`: each attempt has the connect timeout and waits as long after a failure;
/// `attempt` runs before each.
async fn subscribe(
    endpoint: &str,
    topic: &str,
    config: &SubscriberConfig,
    (engine, rank): (&str, u32),
    mut attempt: impl FnMut(),
) -> SubSocket {
    loop {
        attempt();
        let mut socket = SubSocket::new();
        let subscribed =
            match tokio::time::timeout(config.connect_timeout, socket.connect(endpoint)).await {
                Ok(Ok(())) => socket.subscribe(topic).await,
                Ok(Err(e)) => Err(e),
                Err(_) => Err(zeromq::ZmqError::ConnectTimeout(config.connect_timeout)),
            };
        match subscribed {
            Ok(()) => {
                tracing::debug!(engine, rank, endpoint, topic, "subscribed");
                return socket;
            }
            Err(e) => {
                tracing::debug!(engine, rank, endpoint, error = %e, "cannot subscribe");
                tokio::time::sleep(config.connect_timeout).await;
            }
        }
    }
}

/// Applies `f` to the status of `engine`'s rank `rank`, if it is still listed.
fn update_status(statuses: &Statuses, engine: &str, rank: u32, f: impl FnOnce(&mut RankStatus)) {
    if let Some(s) = lock(statuses).get_mut(&(engine.to_owned(), rank)) {
        f(s);
    }
}

/// One rank's load-report subscription (see the [module docs](self)).
struct LoadTask {
    index: Arc<KvIndex>,
    config: Arc<SubscriberConfig>,
    statuses: Statuses,
    engine: String,
    rank: u32,
    load: String,
}

impl LoadTask {
    fn status(&self, f: impl FnOnce(&mut RankStatus)) {
        update_status(&self.statuses, &self.engine, self.rank, f);
    }

    async fn run(self) {
        let topic = String::from_utf8_lossy(LOAD_TOPIC);
        loop {
            let mut socket = subscribe(
                &self.load,
                &topic,
                &self.config,
                (&self.engine, self.rank),
                || {},
            )
            .await;
            self.status(|s| s.load_connected = true);
            // Until silence or an error; the next subscription starts afresh.
            while let Ok(Ok(message)) =
                tokio::time::timeout(self.config.silence_timeout, socket.recv()).await
            {
                let frames: Vec<Bytes> = message.into_vec();
                let views: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
                match split_frames(&views).and_then(|f| decode_load(f.payload)) {
                    Ok(stat) => {
                        self.index
                            .loads()
                            .record(&self.engine, self.rank, stat, Instant::now());
                        self.status(|s| s.load_reports += 1);
                    }
                    Err(e) => {
                        tracing::debug!(engine = %self.engine, rank = self.rank, error = %e, "load reports: undecodable report");
                        self.status(|s| s.load_decode_errors += 1);
                    }
                }
            }
            self.status(|s| s.load_connected = false);
        }
    }
}

/// Why a replay did not cover a gap.
#[derive(Debug, thiserror::Error)]
enum ReplayError {
    #[error("zmq: {0}")]
    Zmq(#[from] zeromq::ZmqError),
    #[error("timed out")]
    Timeout,
    #[error("the engine's buffer starts at {first:?}, after {wanted}")]
    Incomplete { wanted: u64, first: Option<u64> },
    #[error("malformed replay message")]
    Malformed,
}

/// One rank's subscription.
struct RankTask {
    index: Arc<KvIndex>,
    config: Arc<SubscriberConfig>,
    statuses: Statuses,
    engine: String,
    rank: u32,
    publisher: String,
    replay: Option<String>,
    last_seq: Option<u64>,
}

impl RankTask {
    fn status(&self, f: impl FnOnce(&mut RankStatus)) {
        update_status(&self.statuses, &self.engine, self.rank, f);
    }

    async fn run(mut self) {
        let mut first = true;
        loop {
            let socket = subscribe(
                &self.publisher,
                &self.config.topic,
                &self.config,
                (&self.engine, self.rank),
                || {
                    if !first {
                        self.status(|s| s.resubscribes += 1);
                    }
                },
            )
            .await;
            first = false;
            self.status(|s| s.connected = true);
            self.receive(socket).await;
            self.status(|s| s.connected = false);
        }
    }

    /// Receives until silence or an error.
    async fn receive(&mut self, mut socket: SubSocket) {
        // The first batch of this subscription catches up on the engine's history.
        let mut catch_up = true;
        loop {
            let message = match tokio::time::timeout(self.config.silence_timeout, socket.recv())
                .await
            {
                Ok(Ok(message)) => message,
                Ok(Err(e)) => {
                    tracing::debug!(engine = %self.engine, rank = self.rank, error = %e, "kv events: receive failed, resubscribing");
                    return;
                }
                Err(_) => {
                    tracing::debug!(engine = %self.engine, rank = self.rank, "kv events: silent, resubscribing");
                    return;
                }
            };
            let frames: Vec<Bytes> = message.into_vec();
            let views: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
            let Ok(parsed) = split_frames(&views) else {
                self.status(|s| s.decode_errors += 1);
                continue;
            };
            let seq = parsed.seq;
            match self.last_seq {
                Some(last) if seq <= last => {
                    // The sequence went back: a new engine process.
                    tracing::info!(engine = %self.engine, rank = self.rank, seq, last, "kv events: engine restarted, dropping its entries");
                    self.index.clear(&self.engine, self.rank);
                    self.status(|s| {
                        s.restarts += 1;
                        s.drops += 1;
                    });
                }
                Some(last) if seq > last.saturating_add(1) => {
                    self.status(|s| s.gaps += 1);
                    self.recover(last + 1, seq).await;
                }
                // Best effort: a history the buffer no longer starts at 0 for still
                // teaches what it holds.
                None if catch_up && seq > 0 && self.replay.is_some() => {
                    let _ = self.replay_range(0, seq, false).await;
                }
                _ => {}
            }
            catch_up = false;
            self.apply(seq, parsed.payload);
        }
    }

    /// Applies one batch (or drops the rank's entries if it cannot be decoded).
    fn apply(&mut self, seq: u64, payload: &[u8]) {
        match decode_batch(payload) {
            Ok(batch) => {
                if batch.dp_rank.is_some_and(|r| r != self.rank) {
                    tracing::debug!(engine = %self.engine, rank = self.rank, batch_rank = ?batch.dp_rank, "kv events: batch names another rank than its port");
                }
                self.index.apply(&self.engine, self.rank, &batch);
                self.status(|s| s.batches += 1);
            }
            Err(e) => {
                tracing::warn!(engine = %self.engine, rank = self.rank, seq, error = %e, "kv events: undecodable batch, dropping the rank's entries");
                self.index.clear(&self.engine, self.rank);
                self.status(|s| {
                    s.decode_errors += 1;
                    s.drops += 1;
                });
            }
        }
        self.last_seq = Some(seq);
        self.status(|s| s.last_seq = Some(seq));
    }

    /// Fills the gap `[from, until)` by replay, or drops the rank's entries.
    async fn recover(&mut self, from: u64, until: u64) {
        if self.replay.is_some() {
            match self.replay_range(from, until, true).await {
                Ok(()) => return,
                Err(e) => {
                    tracing::info!(engine = %self.engine, rank = self.rank, from, until, error = %e, "kv events: replay failed");
                    self.status(|s| s.replay_failures += 1);
                }
            }
        }
        tracing::info!(engine = %self.engine, rank = self.rank, from, until, "kv events: batches lost, dropping the rank's entries");
        self.index.clear(&self.engine, self.rank);
        self.status(|s| s.drops += 1);
    }

    /// Asks the replay socket for `[from, until)` and applies what it returns, in
    /// order. With `exact`, fails (applying nothing) unless every batch came back.
    async fn replay_range(
        &mut self,
        from: u64,
        until: u64,
        exact: bool,
    ) -> Result<(), ReplayError> {
        let Some(endpoint) = self.replay.clone() else {
            return Ok(());
        };
        let fetched =
            tokio::time::timeout(self.config.replay_timeout, fetch_replay(&endpoint, from))
                .await
                .map_err(|_| ReplayError::Timeout)??;
        let batches: Vec<(u64, Bytes)> = fetched
            .into_iter()
            .filter(|(seq, _)| (from..until).contains(seq))
            .collect();
        let complete = batches.len() as u64 == until - from
            && batches
                .iter()
                .zip(from..)
                .all(|((seq, _), want)| *seq == want);
        if exact && !complete {
            return Err(ReplayError::Incomplete {
                wanted: from,
                first: batches.first().map(|(s, _)| *s),
            });
        }
        // Counted before they are applied, so that whoever sees one of these
        // batches in `batches` also sees it in `replayed`.
        let count = batches.len() as u64;
        self.status(|s| s.replayed += count);
        for (seq, payload) in batches {
            self.apply(seq, &payload);
        }
        Ok(())
    }
}

/// Every buffered batch from `from` on, as `(seq, payload)`, until the end marker.
async fn fetch_replay(endpoint: &str, from: u64) -> Result<Vec<(u64, Bytes)>, ReplayError> {
    let mut dealer = DealerSocket::new();
    dealer.connect(endpoint).await?;
    // A DEALER talking to a ROUTER: an empty delimiter, then the request.
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&from.to_be_bytes()),
    ])
    .map_err(|_| ReplayError::Malformed)?;
    dealer.send(request).await?;
    let mut batches = Vec::new();
    loop {
        let frames = dealer.recv().await?.into_vec();
        // [empty, topic, seq, payload]
        let [_, topic, seq, payload] = frames.as_slice() else {
            return Err(ReplayError::Malformed);
        };
        let views = [&topic[..], &seq[..], &payload[..]];
        let parsed = split_frames(&views).map_err(|_| ReplayError::Malformed)?;
        if parsed.seq == END_SEQ {
            return Ok(batches);
        }
        batches.push((parsed.seq, payload.clone()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_specs() {
        let e = EngineEndpoint::parse("http://h:8000=tcp://h:5557").unwrap();
        assert_eq!(
            (e.publisher.as_str(), e.replay.as_deref(), e.dp_size),
            ("tcp://h:5557", None, 1)
        );
        assert!(EngineEndpoint::parse("http://h:8000").is_err());
        assert!(EngineEndpoint::parse("=tcp://h:1").is_err());
        assert!(EngineEndpoint::parse("e=tcp://h:x").is_err());
        assert!(EngineEndpoint::parse("e=tcp://h:1,replay=udp://h:2").is_err());
        assert!(EngineEndpoint::parse("e=tcp://h:1,bogus=1").is_err());
        assert_eq!(
            EngineEndpoint::parse("e=tcp://h:65535,dp-size=2"),
            Err(EndpointError::PortRange {
                port: 65535,
                dp_size: 2
            })
        );
        let e = EngineEndpoint::parse("e=tcp://h:7000,dp-size=3").unwrap();
        assert_eq!(e.publisher_of(2), "tcp://h:7002");
        assert_eq!(e.replay_of(2), None);
    }

    #[test]
    fn engine_host_form() {
        let e = EngineEndpoint::on_engine_host("http://user@10.1.2.3:8000/v1", 5557, None).unwrap();
        assert_eq!(e.publisher, "tcp://10.1.2.3:5557");
        assert_eq!(e.engine, "http://user@10.1.2.3:8000/v1");
        assert!(EngineEndpoint::on_engine_host("http://:8000", 1, None).is_err());
        let e = EngineEndpoint::on_engine_host("engine-0.svc", 5557, Some(5558)).unwrap();
        assert_eq!(e.replay.as_deref(), Some("tcp://engine-0.svc:5558"));
    }
}
