//! `disagg-bench routing`: the prefix-cache routing benchmark. A multi-turn chat
//! workload on simulated prefill engines whose prefix caches are smaller than the
//! working set, sent through several proxy replicas, routed by each policy in turn
//! with the very `Pick`s the proxy runs:
//!
//! - `round_robin`: engines in turn;
//! - `cache_aware`: `disagg_affinity::CacheAware` with its defaults (what the proxy
//!   itself sent where), one per replica;
//! - `kv_events`: `disagg_kvevents::KvEventsPick` over a `KvScorer` and a `KvIndex`
//!   fed by a `Subscriber` from the engines' own KV events over ZMQ, one per replica,
//!   with the engines' load reports (as SGLang publishes them);
//! - `kv_events, no load reports`: the same without the engines' load reports (as with
//!   vLLM, which publishes none): each replica prices only the work it sent itself;
//! - `kv_events, engine metrics`: the same, each replica's endpoints given the
//!   engines' own request counts (waiting plus running) from their `/metrics` every
//!   `--engine-metrics-interval`, as the proxy's `--load-source engine-metrics` does;
//! - `oracle`: the same cost as `kv_events`, from the engines' true cache contents and
//!   the global queued work, read at decision time (no event lag, no provisional
//!   guess).
//!
//! Each replica has its own endpoints, so their in-flight counts are its own, as in
//! separate proxy processes. Each engine computes one prefill at a time
//! (`serial_prefill`), taking `--delay-us` per uncached token, so the time to first
//! token (here: the prefill leg's answer) is queueing plus the uncached part of the
//! prompt. Each policy runs on fresh engines with the same sessions.
//!
//! Run: `cargo run --release -p disagg-bench -- routing [--replicas 2] [--engines 8]
//! [--sessions 256] [--turns 4] [--clients 24] [--systems 8] [--cache-blocks 640]
//! [--delay-us 20] [--miss-weight 2]`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use disagg_affinity::CacheAware;
use disagg_core::router::{Pick, RequestView};
use disagg_core::{Endpoint, Role, json::JsonBody, request::Api};
use disagg_kvevents::{
    EngineEndpoint, IndexConfig, KvEventsPick, KvIndex, KvScorer, ScorerConfig, Subscriber,
    SubscriberConfig,
};
use disagg_sim::{KvEventsConfig, SimConfig, SimEngine};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::BoxError;

const BLOCK: usize = 16;

/// How long a prefill leg may take, queueing on its engine included.
const PREFILL_TIMEOUT: Duration = Duration::from_secs(120);

/// How long a read of an engine's `/metrics` may take.
const METRICS_TIMEOUT: Duration = Duration::from_secs(1);

/// The most of an engine's answer read (a prefill's, or its `/metrics`).
const MAX_ANSWER: u64 = 1 << 20;

/// A count flag of at least 1.
fn at_least_one() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
}

/// Seconds, as a finite non-negative [`Duration`].
fn seconds(v: &str) -> Result<Duration, String> {
    let secs: f64 = v.parse().map_err(|e| format!("{e}"))?;
    Duration::try_from_secs_f64(secs).map_err(|e| format!("{e}"))
}

/// `disagg-bench routing`'s flags.
#[derive(Debug, Clone, Copy, Args)]
pub(crate) struct RoutingArgs {
    /// Prefill engines.
    #[arg(long, default_value_t = 8, value_parser = at_least_one())]
    engines: usize,
    /// Chat sessions in all.
    #[arg(long, default_value_t = 256, value_parser = at_least_one())]
    sessions: usize,
    /// Turns per session.
    #[arg(long, default_value_t = 4, value_parser = at_least_one())]
    turns: usize,
    /// Requests in flight.
    #[arg(long, default_value_t = 24, value_parser = at_least_one())]
    clients: usize,
    /// System prompts the sessions share.
    #[arg(long, default_value_t = 8, value_parser = at_least_one())]
    systems: usize,
    /// Tokens per system prompt.
    #[arg(long, default_value_t = 1024)]
    system_tokens: usize,
    /// Prefix-cache blocks (of 16 tokens) per engine.
    #[arg(long, default_value_t = 640)]
    cache_blocks: usize,
    /// Prefill time per uncached token, in microseconds.
    #[arg(long, default_value_t = 20)]
    delay_us: u64,
    /// Sessions in conversation at once: a session's next turn waits behind one turn
    /// of every other active session (users reading and typing in between).
    #[arg(long, default_value_t = 64, value_parser = at_least_one())]
    window: usize,
    /// Proxy replicas sharing the engines; requests alternate between them.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..))]
    replicas: u16,
    /// `ScorerConfig::miss_weight` of `kv_events` and the oracle. Default: the proxy's,
    /// 2 with the engines' load reports (`kv_events`, the oracle) and 1 without.
    #[arg(long)]
    miss_weight: Option<u64>,
    /// Seconds between reads of the engines' `/metrics` for `kv_events, engine
    /// metrics` (the proxy's --engine-metrics-interval; its default of 5 s is longer
    /// than a whole run here).
    #[arg(long, value_name = "SECS", default_value = "0.1", value_parser = seconds)]
    engine_metrics_interval: Duration,
}

type Settings = RoutingArgs;

impl RoutingArgs {
    /// The miss weight `policy` runs with.
    fn miss_weight(&self, policy: Policy) -> u64 {
        self.miss_weight.unwrap_or(match policy {
            Policy::KvEventsOwnCounts | Policy::KvEventsEngineMetrics => {
                disagg_kvevents::score::DEFAULT_MISS_WEIGHT
            }
            _ => disagg_kvevents::score::LOAD_REPORTS_MISS_WEIGHT,
        })
    }
}

/// A deterministic token stream per (kind, id): ids in the simulator's vocabulary.
fn tokens(kind: u32, id: u32, len: usize) -> Vec<u32> {
    let mut x = u64::from(kind) << 32 | u64::from(id);
    (0..len)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            16 + ((x >> 33) % 1_000_000) as u32
        })
        .collect()
}

/// The prompts of one session, turn by turn: a shared system prompt, then user
/// messages (128 to 255 tokens) and the assistant's answers (64 tokens) of the turns
/// before.
fn session_prompts(s: &Settings, session: usize) -> Vec<Vec<u32>> {
    let system = tokens(1, (session % s.systems) as u32, s.system_tokens);
    let mut prompt = system;
    let mut out = Vec::with_capacity(s.turns);
    for turn in 0..s.turns {
        let id = (session * 64 + turn) as u32;
        let user_len = 128 + (id.wrapping_mul(2_654_435_761) >> 25) as usize % 128;
        prompt.extend(tokens(2, id, user_len));
        out.push(prompt.clone());
        prompt.extend(tokens(3, id, 64));
    }
    out
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Policy {
    RoundRobin,
    CacheAware,
    KvEvents,
    KvEventsOwnCounts,
    KvEventsEngineMetrics,
    Oracle,
}

impl Policy {
    fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::CacheAware => "cache_aware",
            Policy::KvEvents => "kv_events",
            Policy::KvEventsOwnCounts => "kv_events, no load reports",
            Policy::KvEventsEngineMetrics => "kv_events, engine metrics",
            Policy::Oracle => "oracle",
        }
    }
}

/// One proxy replica's routing state: its own endpoints (and so in-flight counts),
/// turn, `cache_aware` table, and `kv_events` index and scorer.
struct Replica {
    endpoints: Vec<Arc<Endpoint>>,
    rr: AtomicUsize,
    cache_aware: CacheAware,
    kv_events: Option<KvEventsPick>,
}

/// Per engine, the prompts being computed there, by request id.
type Computing = Vec<Vec<(u64, Vec<u32>)>>;

/// The oracle's view: the engines' true caches, plus the prompts it sent that are
/// still being computed (what a perfect provisional entry would say).
struct Oracle {
    pending: Vec<AtomicUsize>,
    computing: Mutex<Computing>,
    next_id: AtomicUsize,
}

struct Router {
    policy: Policy,
    engines: Arc<Vec<SimEngine>>,
    urls: Vec<String>,
    replicas: Vec<Replica>,
    oracle: Oracle,
    miss_weight: u64,
}

/// What keeps the oracle's accounting of a routed request until its answer.
enum Held {
    None,
    Oracle(usize, usize, u64),
}

/// Leading full blocks two prompts share, in tokens.
fn common_blocks(a: &[u32], b: &[u32]) -> usize {
    let same = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    same / BLOCK * BLOCK
}

impl Router {
    /// The engine for `prompt` (whose completions body is `body`) by `replica`.
    fn route(&self, replica: usize, prompt: &[u32], body: &JsonBody) -> (usize, Held) {
        let r = &self.replicas[replica];
        let headers = http::HeaderMap::new();
        let view = RequestView {
            tokens: Some(prompt),
            ..RequestView::new(Api::Completions, Some("sim-model"), &headers, body)
        };
        match self.policy {
            Policy::RoundRobin => (
                r.rr.fetch_add(1, Ordering::Relaxed) % self.urls.len(),
                Held::None,
            ),
            Policy::CacheAware => (r.cache_aware.pick(&view, &r.endpoints), Held::None),
            Policy::KvEvents | Policy::KvEventsOwnCounts | Policy::KvEventsEngineMetrics => {
                match &r.kv_events {
                    Some(pick) => (pick.pick(&view, &r.endpoints), Held::None),
                    None => (0, Held::None),
                }
            }
            Policy::Oracle => {
                let o = &self.oracle;
                let mut computing = o.computing.lock().expect("oracle lock");
                let mut best = (u64::MAX, std::cmp::Reverse(0usize), usize::MAX, 0usize);
                for (i, e) in self.engines.iter().enumerate() {
                    let truth = e.cached_prefix_tokens(0, prompt);
                    let soon = computing[i]
                        .iter()
                        .map(|(_, p)| common_blocks(p, prompt))
                        .max()
                        .unwrap_or(0);
                    let hit = truth.max(soon).min(prompt.len());
                    let cost = (prompt.len() - hit) as u64 * self.miss_weight
                        + o.pending[i].load(Ordering::Relaxed) as u64;
                    let key = (cost, std::cmp::Reverse(hit), r.endpoints[i].in_flight(), i);
                    if key < best {
                        best = key;
                    }
                }
                let (_, std::cmp::Reverse(hit), _, i) = best;
                let uncached = prompt.len() - hit;
                o.pending[i].fetch_add(uncached, Ordering::Relaxed);
                let id = o.next_id.fetch_add(1, Ordering::Relaxed) as u64;
                computing[i].push((id, prompt.to_vec()));
                (i, Held::Oracle(i, uncached, id))
            }
        }
    }

    fn release(&self, held: Held) {
        if let Held::Oracle(i, tokens, id) = held {
            self.oracle.pending[i].fetch_sub(tokens, Ordering::Relaxed);
            if let Ok(mut c) = self.oracle.computing.lock() {
                c[i].retain(|(x, _)| *x != id);
            }
        }
    }
}

/// Every `period` until `stop`: each engine's `/metrics`, its waiting plus running
/// requests set on every replica's endpoint for it (`Endpoint::set_engine_load`).
async fn read_engine_loads(
    router: Arc<Router>,
    period: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tick.tick() => {}
        }
        for (i, e) in router.engines.iter().enumerate() {
            let Some(n) = engine_requests(e.addr()).await else {
                continue;
            };
            for r in &router.replicas {
                r.endpoints[i].set_engine_load(Some(n));
            }
        }
    }
}

/// An engine's waiting plus running requests by its `/metrics`; `None` when it does not
/// answer within [`METRICS_TIMEOUT`] or its answer is not a figure.
async fn engine_requests(addr: std::net::SocketAddr) -> Option<u64> {
    let request = b"GET /metrics HTTP/1.1\r\nhost: sim\r\nconnection: close\r\n\r\n";
    let answer = tokio::time::timeout(METRICS_TIMEOUT, exchange(addr, request))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&answer);
    let (head, body) = text.split_once("\r\n\r\n")?;
    if status_code(head) != Some(200) {
        return None;
    }
    disagg_resilience::telemetry::parse(body).ok()?.requests()
}

/// Send `request` to `addr` on a connection of its own and read the answer until the
/// engine closes it, at most [`MAX_ANSWER`] bytes.
async fn exchange(addr: std::net::SocketAddr, request: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut conn = tokio::net::TcpStream::connect(addr).await?;
    conn.set_nodelay(true)?;
    conn.write_all(request).await?;
    let mut answer = Vec::new();
    (&mut conn)
        .take(MAX_ANSWER + 1)
        .read_to_end(&mut answer)
        .await?;
    if answer.len() as u64 > MAX_ANSWER {
        return Err(std::io::Error::other(format!(
            "the answer is larger than {MAX_ANSWER} bytes"
        )));
    }
    Ok(answer)
}

/// The status code of an HTTP/1 answer's head.
fn status_code(head: &str) -> Option<u16> {
    head.strip_prefix("HTTP/1.")?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// A prefill leg's body for `prompt`: a completion with `max_tokens: 1`.
fn completion_body(prompt: &[u32]) -> String {
    serde_json::json!({"model": "sim-model", "prompt": prompt, "max_tokens": 1}).to_string()
}

/// One prefill leg: POST `body`; the time to its answer and the answer's
/// `cached_tokens`.
///
/// # Errors
///
/// When the engine cannot be reached, does not answer within `timeout`, answers other
/// than 200 (its status and message then), or without `cached_tokens`.
async fn prefill(
    addr: std::net::SocketAddr,
    body: &str,
    timeout: Duration,
) -> Result<(Duration, u64), BoxError> {
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let started = Instant::now();
    let answer = tokio::time::timeout(timeout, exchange(addr, request.as_bytes()))
        .await
        .map_err(|_| format!("engine {addr}: no answer within {timeout:?}"))?
        .map_err(|e| format!("engine {addr}: {e}"))?;
    let elapsed = started.elapsed();
    let text = String::from_utf8_lossy(&answer);
    let (head, json) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("engine {addr}: an answer without a body"))?;
    match status_code(head) {
        Some(200) => {}
        Some(status) => {
            let message: String = json.chars().take(500).collect();
            return Err(format!("engine {addr} answered {status}: {message}").into());
        }
        None => return Err(format!("engine {addr}: not an HTTP/1 answer").into()),
    }
    let v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("engine {addr}: {e}"))?;
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .ok_or_else(|| {
            let start: String = json.chars().take(300).collect();
            format!("engine {addr}: no cached_tokens in {start}")
        })?;
    Ok((elapsed, cached))
}

struct Outcome {
    policy: Policy,
    hit_rate: f64,
    engine_hit_rate: f64,
    p50: Duration,
    p90: Duration,
    p99: Duration,
    wall: Duration,
    evictions: u64,
}

async fn run(policy: Policy, s: &Settings) -> Result<Outcome, BoxError> {
    let config = SimConfig {
        prefix_cache_blocks: s.cache_blocks,
        kv_events: Some(KvEventsConfig {
            load_port: Some(0),
            ..KvEventsConfig::default()
        }),
        serial_prefill: true,
        prefill_delay_per_token: Duration::from_micros(s.delay_us),
        record_requests: 0,
        ..SimConfig::default()
    };
    let mut engines = Vec::with_capacity(s.engines);
    for _ in 0..s.engines {
        engines.push(SimEngine::start(config.clone()).await?);
    }
    let engines = Arc::new(engines);
    let urls: Vec<String> = engines.iter().map(SimEngine::url).collect();
    let mut subscribers = Vec::new();
    let mut replicas = Vec::new();
    for _ in 0..s.replicas {
        let kv_events = if matches!(
            policy,
            Policy::KvEvents | Policy::KvEventsOwnCounts | Policy::KvEventsEngineMetrics
        ) {
            // Each replica subscribes on its own, as separate proxies would.
            let index = Arc::new(KvIndex::new(IndexConfig::default()));
            let sub = Subscriber::new(index.clone(), SubscriberConfig::default());
            let mut endpoints = Vec::with_capacity(engines.len());
            for e in engines.iter() {
                let events = e
                    .kv_events_endpoint()
                    .ok_or("a simulated engine publishes no KV events")?;
                let mut ep = EngineEndpoint::new(e.url(), events)?;
                if let Some(r) = e.kv_events_replay_endpoint() {
                    ep = ep.with_replay(r)?;
                }
                if let Some(l) = e.load_endpoint().filter(|_| policy == Policy::KvEvents) {
                    ep = ep.with_load(l)?;
                }
                endpoints.push(ep);
            }
            sub.set_endpoints(endpoints).await;
            subscribers.push(sub);
            let scorer = KvScorer::new(
                index,
                ScorerConfig {
                    miss_weight: s.miss_weight(policy),
                    ..ScorerConfig::default()
                },
            );
            Some(KvEventsPick::new(Arc::new(scorer)))
        } else {
            None
        };
        let endpoints = engines
            .iter()
            .map(|e| Endpoint::new(&e.url(), Role::Prefill).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        replicas.push(Replica {
            endpoints,
            rr: AtomicUsize::new(0),
            cache_aware: CacheAware::new(),
            kv_events,
        });
    }
    // Let every SUB socket's subscription reach its engine before traffic (what is
    // lost before that is replayed with the first batch anyway).
    let deadline = Instant::now() + Duration::from_secs(5);
    while subscribers
        .iter()
        .any(|sub| sub.status().iter().any(|r| !r.connected))
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let router = Arc::new(Router {
        policy,
        engines: engines.clone(),
        urls,
        replicas,
        oracle: Oracle {
            pending: (0..s.engines).map(|_| AtomicUsize::new(0)).collect(),
            computing: Mutex::new((0..s.engines).map(|_| Vec::new()).collect()),
            next_id: AtomicUsize::new(0),
        },
        miss_weight: s.miss_weight(policy),
    });
    // The engines' own counts, read as the proxy's telemetry reads them, into every
    // replica's endpoints.
    let (stop_reads, reads) = tokio::sync::watch::channel(false);
    let reader = (policy == Policy::KvEventsEngineMetrics).then(|| {
        let router = router.clone();
        let period = s.engine_metrics_interval.max(Duration::from_millis(1));
        tokio::spawn(read_engine_loads(router, period, reads))
    });
    let sent = Arc::new(AtomicUsize::new(0));
    // The active sessions, in turn: a client takes the next (session, turn), and the
    // session goes back to the end of the line after its turn, until its last; a new
    // session joins when one ends.
    let queue: Arc<Mutex<std::collections::VecDeque<(usize, usize)>>> = Arc::new(Mutex::new(
        (0..s.window.min(s.sessions)).map(|i| (i, 0)).collect(),
    ));
    let joined = Arc::new(AtomicUsize::new(s.window.min(s.sessions)));
    let done = Arc::new(AtomicUsize::new(0));
    let results = Arc::new(Mutex::new(Vec::new()));
    let started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..s.clients {
        let (router, queue, joined, done, results, sent, s) = (
            router.clone(),
            queue.clone(),
            joined.clone(),
            done.clone(),
            results.clone(),
            sent.clone(),
            *s,
        );
        clients.spawn(async move {
            loop {
                let next = queue.lock().ok().and_then(|mut q| q.pop_front());
                let Some((session, turn)) = next else {
                    if done.load(Ordering::Relaxed) >= s.sessions {
                        break;
                    }
                    // Every active session's turn is in flight elsewhere.
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                };
                let Some(prompt) = session_prompts(&s, session).into_iter().nth(turn) else {
                    return Err(format!("session {session} has no turn {turn}").into());
                };
                let body = completion_body(&prompt);
                let replica = sent.fetch_add(1, Ordering::Relaxed) % usize::from(s.replicas);
                let parsed = JsonBody::parse(body.as_bytes())?;
                let (i, held) = router.route(replica, &prompt, &parsed);
                // The replica's in-flight count, as the proxy holds it for a prefill leg.
                let guard = router.replicas[replica].endpoints[i].track();
                let answer = prefill(router.engines[i].addr(), &body, PREFILL_TIMEOUT).await;
                drop(guard);
                router.release(held);
                let (ttft, cached) = answer?;
                if let Ok(mut r) = results.lock() {
                    r.push((ttft, prompt.len() as u64, cached));
                }
                let follow = if turn + 1 < s.turns {
                    Some((session, turn + 1))
                } else {
                    done.fetch_add(1, Ordering::Relaxed);
                    let new = joined.fetch_add(1, Ordering::Relaxed);
                    (new < s.sessions).then_some((new, 0))
                };
                if let (Some(item), Ok(mut q)) = (follow, queue.lock()) {
                    q.push_back(item);
                }
            }
            Ok::<(), BoxError>(())
        });
    }
    // The first failure ends the run (its session's next turn would never come, and the
    // other clients would wait for it for ever).
    let mut failed: Option<BoxError> = None;
    while let Some(client) = clients.join_next().await {
        let err = match client {
            Ok(Ok(())) => continue,
            Ok(Err(e)) => e,
            Err(e) if e.is_cancelled() => continue,
            Err(e) => format!("a client task failed: {e}").into(),
        };
        if failed.is_none() {
            failed = Some(err);
            clients.abort_all();
        }
    }
    let wall = started.elapsed();
    let _ = stop_reads.send(true);
    if let Some(reader) = reader
        && let Err(e) = reader.await
    {
        failed.get_or_insert_with(|| format!("the metrics reader failed: {e}").into());
    }
    let mut results = results.lock().map(|r| r.clone()).unwrap_or_default();
    results.sort_by_key(|r| r.0);
    let pct = |p: f64| {
        let i = ((results.len() as f64 * p).ceil() as usize).clamp(1, results.len().max(1)) - 1;
        results.get(i).map_or(Duration::ZERO, |r| r.0)
    };
    let prompt: u64 = results.iter().map(|r| r.1).sum();
    let cached: u64 = results.iter().map(|r| r.2).sum();
    let (mut query, mut hit, mut evictions) = (0, 0, 0);
    for e in engines.iter() {
        let st = e.stats();
        query += st.prefix_cache_query_tokens;
        hit += st.prefix_cache_hit_tokens;
        evictions += st.prefix_cache_evictions;
    }
    for sub in subscribers {
        sub.shutdown().await;
    }
    drop(router);
    if let Ok(engines) = Arc::try_unwrap(engines) {
        for e in engines {
            e.shutdown().await;
        }
    }
    if let Some(e) = failed {
        return Err(e);
    }
    Ok(Outcome {
        policy,
        hit_rate: cached as f64 / prompt as f64,
        engine_hit_rate: hit as f64 / query.max(1) as f64,
        p50: pct(0.5),
        p90: pct(0.9),
        p99: pct(0.99),
        wall,
        evictions,
    })
}

/// Runs the benchmark and prints its table (Markdown).
pub(crate) fn main(s: RoutingArgs) -> Result<bool, BoxError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(bench(s))?;
    Ok(true)
}

async fn bench(s: RoutingArgs) -> Result<(), BoxError> {
    let mut working_set = s.systems * (s.system_tokens / BLOCK);
    for session in 0..s.sessions {
        let prompts = session_prompts(&s, session);
        if let Some(last) = prompts.last() {
            working_set += (last.len() - s.system_tokens) / BLOCK;
        }
    }
    println!(
        "{} engines x {} cache blocks of {BLOCK} tokens ({} blocks in all); {} sessions x {} turns over {} system prompts of {} tokens, {} active at once, {} requests in flight through {} proxy replicas; working set {working_set} blocks; {} us per uncached token, one prefill at a time per engine; miss weight {}",
        s.engines,
        s.cache_blocks,
        s.engines * s.cache_blocks,
        s.sessions,
        s.turns,
        s.systems,
        s.system_tokens,
        s.window,
        s.clients,
        s.replicas,
        s.delay_us,
        s.miss_weight.map_or_else(
            || "2 with load reports, 1 without".to_owned(),
            |w| w.to_string()
        )
    );
    println!();
    println!(
        "| policy | prefix hit rate | engines' hit rate | TTFT p50 | TTFT p90 | TTFT p99 | evicted blocks | wall time |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let ms = |d: Duration| format!("{:.1} ms", d.as_secs_f64() * 1000.0);
    for policy in [
        Policy::RoundRobin,
        Policy::CacheAware,
        Policy::KvEvents,
        Policy::KvEventsOwnCounts,
        Policy::KvEventsEngineMetrics,
        Policy::Oracle,
    ] {
        let o = run(policy, &s).await?;
        println!(
            "| `{}` | {:.1} % | {:.1} % | {} | {} | {} | {} | {:.2} s |",
            o.policy.name(),
            o.hit_rate * 100.0,
            o.engine_hit_rate * 100.0,
            ms(o.p50),
            ms(o.p90),
            ms(o.p99),
            o.evictions,
            o.wall.as_secs_f64()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: RoutingArgs,
    }

    fn parse(args: &[&str]) -> Result<RoutingArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("routing").chain(args.iter().copied())).map(|c| c.args)
    }

    #[test]
    fn counts_of_zero_and_endless_intervals_are_refused() {
        assert!(parse(&[]).is_ok());
        for flag in [
            "--engines",
            "--sessions",
            "--turns",
            "--clients",
            "--systems",
            "--window",
        ] {
            assert!(parse(&[flag, "0"]).is_err(), "{flag} 0");
            assert!(parse(&[flag, "1"]).is_ok(), "{flag} 1");
        }
        for bad in ["inf", "NaN", "-1", "1e300"] {
            assert!(
                parse(&["--engine-metrics-interval", bad]).is_err(),
                "--engine-metrics-interval {bad}"
            );
        }
        assert!(parse(&["--engine-metrics-interval", "0.5"]).is_ok());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_prompt_past_the_engines_context_is_the_engines_error() -> Result<(), BoxError> {
        // One session of 40 turns: its prompt outgrows the simulator's 8,192 tokens.
        let s = parse(&[
            "--engines",
            "1",
            "--sessions",
            "1",
            "--turns",
            "40",
            "--clients",
            "1",
            "--systems",
            "1",
            "--window",
            "1",
            "--delay-us",
            "0",
            "--replicas",
            "1",
        ])?;
        let err = run(Policy::RoundRobin, &s)
            .await
            .err()
            .map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("400") && e.contains("maximum context length")),
            "{err:?}"
        );
        Ok(())
    }

    /// A listener that accepts and never answers.
    async fn silent_engine() -> Result<std::net::SocketAddr, BoxError> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((conn, _)) = listener.accept().await {
                held.push(conn);
            }
        });
        Ok(addr)
    }

    #[tokio::test]
    async fn a_silent_engine_fails_the_prefill_within_its_timeout() -> Result<(), BoxError> {
        let addr = silent_engine().await?;
        let answer = tokio::time::timeout(
            Duration::from_secs(10),
            prefill(addr, "{}", Duration::from_millis(200)),
        )
        .await;
        let err = match answer {
            Ok(Err(e)) => e.to_string(),
            Ok(Ok(a)) => panic!("a silent engine answered {a:?}"),
            Err(_) => panic!("the prefill waited past 10 s"),
        };
        assert!(err.contains("no answer within"), "{err}");
        Ok(())
    }

    #[tokio::test]
    async fn a_silent_metrics_endpoint_gives_no_figure() -> Result<(), BoxError> {
        let addr = silent_engine().await?;
        let read = tokio::time::timeout(Duration::from_secs(10), engine_requests(addr)).await;
        assert_eq!(read.ok(), Some(None), "the read waited past 10 s");
        Ok(())
    }
}
