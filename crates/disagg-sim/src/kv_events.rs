//! KV-cache event publishing, as vLLM 0.33's `ZmqEventPublisher`
//! (`vllm/distributed/kv_events.py`) does it.
//!
//! Each data-parallel rank binds a ZMQ `PUB` socket on the configured port plus its
//! rank, and, with a replay port, a `ROUTER` socket on that port plus its rank. Each
//! batch of events is sent as three frames, `[topic, seq (8 bytes, big-endian),
//! payload]`, `seq` counting from 0 per rank, and kept in a buffer of the last
//! [`KvEventsConfig::buffer_steps`] batches. A replay request, `[empty, start seq (8
//! bytes, big-endian)]` from a `DEALER` (the `ROUTER` prefixes the peer's identity), is
//! answered with `[empty, topic, seq, payload]` for every buffered batch from `start`
//! on, then the end marker `[empty, empty, -1 (8 bytes), empty]`; a request of another
//! shape is ignored, as vLLM logs and drops it.
//!
//! With a [`KvEventsConfig::load_port`], each rank also publishes its load as SGLang
//! 0.5.23's `SchedulerLoadPublisher`
//! (`python/sglang/srt/managers/scheduler_components/load_publisher.py`) does: a `PUB`
//! socket on that port plus the rank, messages `[b"load", seq, payload]` with `payload`
//! an array-tagged msgpack `LoadStat` (`["LoadStat", num_running_reqs,
//! num_waiting_reqs, num_tokens, max_total_num_tokens, attn_dp_rank,
//! num_waiting_uncached_tokens, num_total_tokens, max_running_requests,
//! total_prefill_uncached_tokens, total_prefill_busy_us]`), sent at once when the
//! load changes and every second when it does not.

use std::collections::VecDeque;
use std::hash::{BuildHasher, Hasher};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::prefix_cache::{Event, encode_batch};
use crate::stats::{Counters, bump};

/// Where and how an engine publishes its KV-cache events (vLLM's
/// `--kv-events-config`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventsConfig {
    /// The address the sockets bind on (default 127.0.0.1).
    pub host: IpAddr,
    /// Rank 0's `PUB` port (`"endpoint": "tcp://*:PORT"`); rank `r` uses the port plus
    /// `r`. 0 (the default) picks a free base port.
    pub port: u16,
    /// Rank 0's replay `ROUTER` port (`"replay_endpoint"`), `None` for no replay; rank
    /// `r` uses the port plus `r`. `Some(0)` (the default) picks a free base port.
    pub replay_port: Option<u16>,
    /// The topic, the first frame of every message (default empty, vLLM's default).
    pub topic: String,
    /// Batches kept for replay per rank (default 10,000, vLLM's `buffer_steps`).
    pub buffer_steps: usize,
    /// Rank 0's load-report `PUB` port (SGLang's `--load-publish-endpoint`), `None`
    /// (the default, as SGLang's) for no load reports; rank `r` uses the port plus `r`.
    /// `Some(0)` picks a free base port.
    pub load_port: Option<u16>,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 0,
            replay_port: Some(0),
            topic: String::new(),
            buffer_steps: 10_000,
            load_port: None,
        }
    }
}

/// The replay end marker's sequence number: -1 as 8 big-endian bytes.
const END_SEQ: [u8; 8] = [0xff; 8];

/// How many times a free base port is drawn again when a rank's port (base plus rank)
/// is taken.
const BIND_ATTEMPTS: usize = 20;

/// The publishers of an engine's ranks.
#[derive(Debug)]
pub(crate) struct Publishers {
    ranks: Vec<RankHandle>,
    /// Rank 0's `PUB` address.
    pub(crate) addr: SocketAddr,
    /// Rank 0's replay address.
    pub(crate) replay_addr: Option<SocketAddr>,
    /// Each rank's load, watched by its load publisher (empty without a load port).
    loads: Vec<watch::Sender<Load>>,
    /// Rank 0's load-report address.
    pub(crate) load_addr: Option<SocketAddr>,
}

/// One rank's load, as its `LoadStat` reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Load {
    /// Requests computing their prefill.
    pub(crate) running: u64,
    /// Requests waiting for the rank's prefill slot.
    pub(crate) waiting: u64,
    /// The uncached prompt tokens of the waiting requests and of the prefill in
    /// progress (SGLang adds the rest of its chunked prefill), as the prefix cache held
    /// them on each request's arrival.
    pub(crate) waiting_uncached_tokens: u64,
    /// Uncached prompt tokens computed since start.
    pub(crate) prefill_uncached_tokens: u64,
}

/// How often an unchanged load is sent again: 1 s, SGLang's
/// `LOAD_PUBLISH_HEARTBEAT_S`.
const LOAD_HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(1);

/// The topic of load reports (SGLang's `LOAD_TOPIC`).
const LOAD_TOPIC: &[u8] = b"load";

#[derive(Debug)]
struct RankHandle {
    batches: mpsc::UnboundedSender<Vec<Event>>,
    /// Batches still to lose (numbered and buffered, not sent).
    lose: Arc<AtomicU64>,
}

impl Publishers {
    /// Binds every rank's sockets and starts their tasks (pushed to `tasks`; they end
    /// on `stop`).
    pub(crate) async fn start(
        config: &KvEventsConfig,
        dp_size: usize,
        counters: Arc<Counters>,
        stop: watch::Receiver<bool>,
        tasks: &mut Vec<JoinHandle<()>>,
    ) -> std::io::Result<Publishers> {
        let (pubs, addr) = bind_ranks(config.host, config.port, dp_size, PubSocket::new).await?;
        let (routers, replay_addr) = match config.replay_port {
            Some(port) => {
                let (routers, addr) =
                    bind_ranks(config.host, port, dp_size, RouterSocket::new).await?;
                (routers.into_iter().map(Some).collect(), Some(addr))
            }
            None => ((0..dp_size).map(|_| None).collect::<Vec<_>>(), None),
        };
        let topic = Bytes::from(config.topic.clone().into_bytes());
        let mut ranks = Vec::with_capacity(dp_size);
        for (rank, (publisher, router)) in pubs.into_iter().zip(routers).enumerate() {
            let (tx, rx) = mpsc::unbounded_channel();
            let lose = Arc::new(AtomicU64::new(0));
            let task = RankTask {
                rank: u32::try_from(rank).unwrap_or(u32::MAX),
                topic: topic.clone(),
                buffer: VecDeque::new(),
                buffer_steps: config.buffer_steps.max(1),
                next_seq: 0,
                lose: lose.clone(),
                counters: counters.clone(),
            };
            tasks.push(tokio::spawn(task.run(publisher, router, rx, stop.clone())));
            ranks.push(RankHandle { batches: tx, lose });
        }
        let (mut loads, mut load_addr) = (Vec::new(), None);
        if let Some(port) = config.load_port {
            let (sockets, addr) = bind_ranks(config.host, port, dp_size, PubSocket::new).await?;
            load_addr = Some(addr);
            for (rank, socket) in sockets.into_iter().enumerate() {
                let (tx, rx) = watch::channel(Load::default());
                let rank = u32::try_from(rank).unwrap_or(u32::MAX);
                tasks.push(tokio::spawn(publish_load(
                    socket,
                    rank,
                    capacity_tokens(config),
                    rx,
                    stop.clone(),
                )));
                loads.push(tx);
            }
        }
        Ok(Publishers {
            ranks,
            addr,
            replay_addr,
            loads,
            load_addr,
        })
    }

    /// Whether the ranks publish their load.
    pub(crate) fn reports_load(&self) -> bool {
        !self.loads.is_empty()
    }

    /// Updates `rank`'s load; its publisher sends it at once.
    pub(crate) fn load(&self, rank: usize, update: impl FnOnce(&mut Load)) {
        if let Some(tx) = self.loads.get(rank) {
            tx.send_modify(update);
        }
    }

    /// Publishes one batch of `rank`'s events (nothing for an empty batch).
    pub(crate) fn publish(&self, rank: usize, events: Vec<Event>) {
        if events.is_empty() {
            return;
        }
        if let Some(r) = self.ranks.get(rank) {
            // The task ends only with the engine.
            let _ = r.batches.send(events);
        }
    }

    /// Makes `rank`'s next `n` batches get their sequence numbers and a place in the
    /// replay buffer without being sent, as a `PUB` socket drops messages for a
    /// subscriber past its high-water mark.
    pub(crate) fn lose(&self, rank: usize, n: u64) {
        if let Some(r) = self.ranks.get(rank) {
            r.lose.fetch_add(n, Relaxed);
        }
    }
}

/// Binds one socket per rank on `base + rank`. With `base` 0, rank 0 takes a free
/// port and the others the ports after it; when those are taken (the system hands out
/// free ports in no order, and the next one is often in use), bases are drawn below
/// Linux's default ephemeral range (32768 on), where no connection takes its port.
async fn bind_ranks<S: Socket>(
    host: IpAddr,
    base: u16,
    dp_size: usize,
    new: fn() -> S,
) -> std::io::Result<(Vec<S>, SocketAddr)> {
    let mut last_error = None;
    let mut draw = std::collections::hash_map::RandomState::new().build_hasher();
    for attempt in 0..BIND_ATTEMPTS {
        let start = match (base, attempt) {
            (0, 0) | (1.., _) => base,
            (0, _) => draw_base(&mut draw, attempt),
        };
        match bind_from(host, start, dp_size, new).await {
            Ok(bound) => return Ok(bound),
            Err(e) => last_error = Some(e),
        }
        if base != 0 {
            // A fixed port taken: no other draw to try.
            break;
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!(
            "cannot bind KV-event sockets for {dp_size} ranks from port {base}: {}",
            last_error.unwrap_or_default()
        ),
    ))
}

/// Where drawn base ports come from: below Linux's default ephemeral port range.
const DRAWN_BASES: std::ops::Range<u16> = 20_000..32_000;

/// A base port for a run of ranks' ports, drawn in [`DRAWN_BASES`] (below Linux's
/// default ephemeral range, where no outgoing connection takes a port), a new one for
/// each `attempt`.
pub(crate) fn draw_base(draw: &mut impl Hasher, attempt: usize) -> u16 {
    draw.write_usize(attempt);
    DRAWN_BASES.start + (draw.finish() % u64::from(DRAWN_BASES.end - DRAWN_BASES.start)) as u16
}

/// One attempt of [`bind_ranks`] from port `start` (0: a free one for rank 0).
async fn bind_from<S: Socket>(
    host: IpAddr,
    start: u16,
    dp_size: usize,
    new: fn() -> S,
) -> Result<(Vec<S>, SocketAddr), String> {
    let mut sockets = Vec::with_capacity(dp_size);
    let mut first_port = start;
    for rank in 0..dp_size {
        let port = if rank == 0 {
            start
        } else {
            u16::try_from(usize::from(first_port) + rank)
                .map_err(|_| format!("port {first_port} + {rank} is beyond 65535"))?
        };
        let endpoint = match host {
            IpAddr::V4(ip) => format!("tcp://{ip}:{port}"),
            IpAddr::V6(ip) => format!("tcp://[{ip}]:{port}"),
        };
        let mut socket = new();
        match socket.bind(&endpoint).await {
            Ok(zeromq::Endpoint::Tcp(_, bound)) => {
                if rank == 0 {
                    first_port = bound;
                }
                sockets.push(socket);
            }
            Ok(other) => return Err(format!("bound {other} for {endpoint}")),
            Err(e) => return Err(format!("{endpoint}: {e}")),
        }
    }
    Ok((sockets, SocketAddr::new(host, first_port)))
}

/// One rank's publisher.
struct RankTask {
    rank: u32,
    topic: Bytes,
    buffer: VecDeque<(u64, Bytes)>,
    buffer_steps: usize,
    next_seq: u64,
    lose: Arc<AtomicU64>,
    counters: Arc<Counters>,
}

impl RankTask {
    async fn run(
        mut self,
        mut publisher: PubSocket,
        mut router: Option<RouterSocket>,
        mut batches: mpsc::UnboundedReceiver<Vec<Event>>,
        mut stop: watch::Receiver<bool>,
    ) {
        loop {
            tokio::select! {
                _ = stop.changed() => break,
                batch = batches.recv() => match batch {
                    Some(events) => self.publish(&mut publisher, &events).await,
                    None => break,
                },
                request = recv_replay(&mut router) => match request {
                    Ok(request) => {
                        if let Some(router) = router.as_mut() {
                            self.replay(router, request).await;
                        }
                    }
                    Err(e) => tracing::debug!(rank = self.rank, error = %e, "replay socket failed"),
                },
            }
        }
        // Dropped, a socket leaves its listener to a task that closes it later; closed,
        // it is gone when the engine's shutdown returns, so a restarted engine can bind
        // the same ports at once.
        let _ = publisher.close().await;
        if let Some(router) = router {
            let _ = router.close().await;
        }
    }

    async fn publish(&mut self, publisher: &mut PubSocket, events: &[Event]) {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let payload = Bytes::from(encode_batch(ts, events, self.rank));
        let seq = self.next_seq;
        self.next_seq += 1;
        bump(&self.counters.kv_event_batches);
        let lost = self
            .lose
            .fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1))
            .is_ok();
        if !lost {
            let frames = vec![
                self.topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload.clone(),
            ];
            if let Ok(message) = ZmqMessage::try_from(frames)
                && let Err(e) = publisher.send(message).await
            {
                tracing::debug!(error = %e, "KV event batch not sent");
            }
        }
        if self.buffer.len() == self.buffer_steps {
            self.buffer.pop_front();
        }
        self.buffer.push_back((seq, payload));
    }

    async fn replay(&mut self, router: &mut RouterSocket, request: Vec<Bytes>) {
        // [identity, empty, start seq]
        let [identity, _, start] = request.as_slice() else {
            tracing::debug!(frames = request.len(), "invalid replay request");
            return;
        };
        let Ok(start) = <[u8; 8]>::try_from(&start[..]).map(u64::from_be_bytes) else {
            tracing::debug!("invalid replay request");
            return;
        };
        bump(&self.counters.kv_event_replays);
        let replies = self
            .buffer
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .map(|(seq, payload)| {
                vec![
                    identity.clone(),
                    Bytes::new(),
                    self.topic.clone(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload.clone(),
                ]
            })
            .chain(std::iter::once(vec![
                identity.clone(),
                Bytes::new(),
                Bytes::new(),
                Bytes::copy_from_slice(&END_SEQ),
                Bytes::new(),
            ]))
            .collect::<Vec<_>>();
        for frames in replies {
            let Ok(message) = ZmqMessage::try_from(frames) else {
                continue;
            };
            if let Err(e) = router.send(message).await {
                tracing::debug!(error = %e, "replay answer not sent");
                return;
            }
        }
    }
}

/// The KV capacity a load report states: unknown (0) here, as SGLang reports when it
/// does not know; the prefix cache's size is the engine's business.
fn capacity_tokens(_config: &KvEventsConfig) -> u64 {
    0
}

/// One rank's load publisher: sends the load when it changes and every
/// [`LOAD_HEARTBEAT`] when it does not, until `stop`.
async fn publish_load(
    mut socket: PubSocket,
    rank: u32,
    capacity: u64,
    mut load: watch::Receiver<Load>,
    mut stop: watch::Receiver<bool>,
) {
    let mut seq: u64 = 0;
    loop {
        let current = *load.borrow_and_update();
        let mut w = crate::prefix_cache::Msgpack(Vec::with_capacity(32));
        w.array(11);
        w.str("LoadStat");
        w.uint(current.running);
        w.uint(current.waiting);
        w.uint(0); // num_tokens: KV tokens in use, not modelled.
        w.uint(capacity);
        w.uint(u64::from(rank));
        w.uint(current.waiting_uncached_tokens);
        w.uint(0); // num_total_tokens
        w.uint(0); // max_running_requests
        w.uint(current.prefill_uncached_tokens);
        w.uint(0); // total_prefill_busy_us
        let frames = vec![
            Bytes::from_static(LOAD_TOPIC),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::from(w.0),
        ];
        seq += 1;
        if let Ok(message) = ZmqMessage::try_from(frames)
            && let Err(e) = socket.send(message).await
        {
            tracing::debug!(error = %e, "load report not sent");
        }
        tokio::select! {
            _ = stop.changed() => break,
            changed = load.changed() => if changed.is_err() { break },
            () = tokio::time::sleep(LOAD_HEARTBEAT) => {}
        }
    }
    // As the rank's event sockets: the port is free when the engine's shutdown returns.
    let _ = socket.close().await;
}

/// The next replay request, or never without a replay socket.
async fn recv_replay(router: &mut Option<RouterSocket>) -> Result<Vec<Bytes>, zeromq::ZmqError> {
    match router {
        Some(router) => router.recv().await.map(ZmqMessage::into_vec),
        None => std::future::pending().await,
    }
}
