//! Prefix-cache routing benchmark: a multi-turn chat workload on simulated prefill
//! engines whose prefix caches are smaller than the working set, routed by four
//! policies side by side.
//!
//! - `round_robin`: engines in turn;
//! - `cache_aware`: a stand-in of disagg-affinity's `CacheAware` with its defaults
//!   (what the proxy itself sent where, in a two-generation table of 65,536 block
//!   entries; locality when the best match covers half the prompt's blocks; least in
//!   flight when the in-flight counts differ by more than 8 and 1.5 times, or without
//!   a match), keyed on token blocks instead of text blocks;
//! - `kv_events`: [`KvScorer`] over a [`KvIndex`] fed by a [`Subscriber`] from the
//!   engines' own KV events over ZMQ;
//! - `oracle`: the same cost as `kv_events`, from the engines' true cache contents
//!   read at decision time (no event lag, no provisional guess).
//!
//! Each engine computes one prefill at a time (`serial_prefill`), taking
//! `--delay-us` per uncached token, so the time to first token (here: the prefill
//! leg's answer) is queueing plus the uncached part of the prompt. Each policy runs on
//! fresh engines with the same sessions.
//!
//! Run: `cargo run --release -p disagg-kvevents --example routing_bench -- [--engines 8]
//! [--sessions 256] [--turns 4] [--clients 24] [--systems 8] [--cache-blocks 640]
//! [--delay-us 20]`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use disagg_kvevents::key::BlockKeys;
use disagg_kvevents::{
    Candidate, EngineEndpoint, IndexConfig, KvIndex, KvScorer, ScorerConfig, Subscriber,
    SubscriberConfig,
};
use disagg_sim::{KvEventsConfig, SimConfig, SimEngine};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BLOCK: usize = 16;

#[derive(Debug, Clone, Copy)]
struct Settings {
    engines: usize,
    sessions: usize,
    turns: usize,
    clients: usize,
    systems: usize,
    system_tokens: usize,
    cache_blocks: usize,
    delay_us: u64,
    /// Sessions in conversation at once: a session's next turn waits behind one turn
    /// of every other active session (users reading and typing in between).
    window: usize,
    /// Proxy replicas sharing the engines; requests alternate between them.
    replicas: usize,
    /// [`ScorerConfig::miss_weight`] of `kv_events` and the oracle.
    miss_weight: u64,
}

impl Settings {
    fn from_args() -> Self {
        let mut s = Settings {
            engines: 8,
            sessions: 256,
            turns: 4,
            clients: 24,
            systems: 8,
            system_tokens: 1024,
            cache_blocks: 640,
            delay_us: 20,
            window: 64,
            replicas: 2,
            miss_weight: 1,
        };
        let args: Vec<String> = std::env::args().skip(1).collect();
        for pair in args.chunks(2) {
            let value = pair.get(1).and_then(|v| v.parse::<usize>().ok());
            let Some(v) = value else {
                eprintln!(
                    "usage: routing_bench [--engines N] [--sessions N] [--turns N] [--clients N] [--systems N] [--system-tokens N] [--cache-blocks N] [--delay-us N] [--window N] [--replicas N] [--miss-weight N]"
                );
                std::process::exit(2);
            };
            match pair[0].as_str() {
                "--engines" => s.engines = v,
                "--sessions" => s.sessions = v,
                "--turns" => s.turns = v,
                "--clients" => s.clients = v,
                "--systems" => s.systems = v,
                "--system-tokens" => s.system_tokens = v,
                "--cache-blocks" => s.cache_blocks = v,
                "--delay-us" => s.delay_us = v as u64,
                "--window" => s.window = v,
                "--replicas" => s.replicas = v.max(1),
                "--miss-weight" => s.miss_weight = v as u64,
                other => {
                    eprintln!("unknown flag {other}");
                    std::process::exit(2);
                }
            }
        }
        s
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
    Oracle,
}

impl Policy {
    fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::CacheAware => "cache_aware",
            Policy::KvEvents => "kv_events",
            Policy::Oracle => "oracle",
        }
    }
}

/// The stand-in of disagg-affinity's `CacheAware` (see the file docs).
struct CacheAwareStandIn {
    current: HashMap<u64, [Option<usize>; 2]>,
    older: HashMap<u64, [Option<usize>; 2]>,
    generation: usize,
    tie: usize,
}

impl CacheAwareStandIn {
    fn new() -> Self {
        CacheAwareStandIn {
            current: HashMap::new(),
            older: HashMap::new(),
            generation: (1 << 16) / 2,
            tie: 0,
        }
    }

    fn least_in_flight(&mut self, in_flight: &[usize]) -> usize {
        let n = in_flight.len();
        let start = self.tie;
        self.tie += 1;
        let mut best = start % n;
        for k in 1..n {
            let i = (start + k) % n;
            if in_flight[i] < in_flight[best] {
                best = i;
            }
        }
        best
    }

    fn pick(&mut self, prompt: &[u32], in_flight: &[usize]) -> usize {
        let keys = BlockKeys::new(prompt, BLOCK);
        let blocks: Vec<u64> = keys.keys().iter().copied().take(256).collect();
        let (min, max) = in_flight
            .iter()
            .fold((usize::MAX, 0), |(lo, hi), &l| (lo.min(l), hi.max(l)));
        let imbalanced = max.saturating_sub(min) > 8 && max as f64 > 1.5 * min as f64;
        let chosen = if imbalanced || blocks.is_empty() {
            self.least_in_flight(in_flight)
        } else {
            let mut held: Vec<(usize, usize)> = Vec::new();
            for (i, b) in blocks.iter().enumerate() {
                let Some(owners) = self.current.get(b).or_else(|| self.older.get(b)) else {
                    break;
                };
                for owner in owners.iter().flatten() {
                    match held.iter_mut().find(|(o, _)| o == owner) {
                        Some(slot) => slot.1 = i + 1,
                        None => held.push((*owner, i + 1)),
                    }
                }
            }
            let needed = 0.5 * blocks.len() as f64;
            let best = held
                .iter()
                .max_by_key(|(o, len)| (*len, std::cmp::Reverse(in_flight[*o])))
                .copied();
            match best {
                Some((o, len)) if len as f64 >= needed => o,
                _ => self.least_in_flight(in_flight),
            }
        };
        self.record(&blocks, chosen);
        chosen
    }

    fn record(&mut self, blocks: &[u64], owner: usize) {
        let blocks = &blocks[..blocks.len().min(self.generation)];
        if self.current.len() + blocks.len() > self.generation {
            std::mem::swap(&mut self.current, &mut self.older);
            self.current.clear();
        }
        for &b in blocks {
            let moved = self.older.remove(&b).unwrap_or_default();
            let owners = self.current.entry(b).or_insert(moved);
            let at = owners.iter().position(|o| *o == Some(owner)).unwrap_or(1);
            owners[..=at].rotate_right(1);
            owners[0] = Some(owner);
        }
    }
}

/// One proxy replica's routing state: its own counts, table, index and scorer.
struct Replica {
    in_flight: Vec<AtomicUsize>,
    rr: AtomicUsize,
    cache_aware: Mutex<CacheAwareStandIn>,
    scorer: Option<KvScorer>,
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

/// What keeps a routed request's accounting until its answer.
#[allow(dead_code)] // held for their Drop
enum Held {
    None,
    Work(disagg_kvevents::score::PrefillWork),
    Oracle(usize, usize, u64),
}

/// Leading full blocks two prompts share, in tokens.
fn common_blocks(a: &[u32], b: &[u32]) -> usize {
    let same = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    same / BLOCK * BLOCK
}

impl Router {
    fn route(&self, replica: usize, prompt: &[u32]) -> (usize, Held) {
        let r = &self.replicas[replica];
        let loads: Vec<usize> = r
            .in_flight
            .iter()
            .map(|l| l.load(Ordering::Relaxed))
            .collect();
        match self.policy {
            Policy::RoundRobin => (
                r.rr.fetch_add(1, Ordering::Relaxed) % self.urls.len(),
                Held::None,
            ),
            Policy::CacheAware => (
                r.cache_aware
                    .lock()
                    .map(|mut c| c.pick(prompt, &loads))
                    .unwrap_or(0),
                Held::None,
            ),
            Policy::KvEvents => {
                let candidates: Vec<Candidate<'_>> = self
                    .urls
                    .iter()
                    .zip(&loads)
                    .map(|(engine, &in_flight)| Candidate::new(engine, in_flight))
                    .collect();
                match r
                    .scorer
                    .as_ref()
                    .and_then(|s| s.choose(prompt, &candidates))
                {
                    Some(d) => (d.index, Held::Work(d.work)),
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
                    let key = (cost, std::cmp::Reverse(hit), loads[i], i);
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

/// One prefill leg: POST a completion of `prompt` with `max_tokens: 1`; the time to
/// its answer and the answer's `cached_tokens`.
async fn prefill(url_addr: std::net::SocketAddr, prompt: &[u32]) -> (Duration, u64) {
    let body =
        serde_json::json!({"model": "sim-model", "prompt": prompt, "max_tokens": 1}).to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let started = Instant::now();
    let mut conn = tokio::net::TcpStream::connect(url_addr)
        .await
        .expect("engine listens");
    conn.set_nodelay(true).ok();
    conn.write_all(request.as_bytes())
        .await
        .expect("request sent");
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).await.expect("answer read");
    let elapsed = started.elapsed();
    let text = String::from_utf8_lossy(&answer);
    let json = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let v: serde_json::Value = serde_json::from_str(json).expect("JSON answer");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens in the answer");
    (elapsed, cached)
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

async fn run(policy: Policy, s: &Settings) -> Outcome {
    let config = SimConfig {
        prefix_cache_blocks: s.cache_blocks,
        kv_events: Some(KvEventsConfig::default()),
        serial_prefill: true,
        prefill_delay_per_token: Duration::from_micros(s.delay_us),
        record_requests: 0,
        ..SimConfig::default()
    };
    let mut engines = Vec::with_capacity(s.engines);
    for _ in 0..s.engines {
        engines.push(
            SimEngine::start(config.clone())
                .await
                .expect("engine starts"),
        );
    }
    let engines = Arc::new(engines);
    let urls: Vec<String> = engines.iter().map(SimEngine::url).collect();
    let mut subscribers = Vec::new();
    let mut replicas = Vec::new();
    for _ in 0..s.replicas {
        let scorer = if policy == Policy::KvEvents {
            // Each replica subscribes on its own, as separate proxies would.
            let index = Arc::new(KvIndex::new(IndexConfig::default()));
            let sub = Subscriber::new(index.clone(), SubscriberConfig::default());
            let endpoints = engines
                .iter()
                .map(|e| {
                    let ep =
                        EngineEndpoint::new(e.url(), e.kv_events_endpoint().expect("publishes"))
                            .expect("tcp endpoint");
                    match e.kv_events_replay_endpoint() {
                        Some(r) => ep.with_replay(r).expect("tcp endpoint"),
                        None => ep,
                    }
                })
                .collect();
            sub.set_endpoints(endpoints).await;
            subscribers.push(sub);
            Some(KvScorer::new(
                index,
                ScorerConfig {
                    miss_weight: s.miss_weight,
                    ..ScorerConfig::default()
                },
            ))
        } else {
            None
        };
        replicas.push(Replica {
            in_flight: (0..s.engines).map(|_| AtomicUsize::new(0)).collect(),
            rr: AtomicUsize::new(0),
            cache_aware: Mutex::new(CacheAwareStandIn::new()),
            scorer,
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
        miss_weight: s.miss_weight,
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
    let mut clients = Vec::new();
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
        clients.push(tokio::spawn(async move {
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
                let prompt = session_prompts(&s, session).swap_remove(turn);
                let replica = sent.fetch_add(1, Ordering::Relaxed) % s.replicas;
                let (i, held) = router.route(replica, &prompt);
                let in_flight = &router.replicas[replica].in_flight[i];
                in_flight.fetch_add(1, Ordering::Relaxed);
                let (ttft, cached) = prefill(router.engines[i].addr(), &prompt).await;
                in_flight.fetch_sub(1, Ordering::Relaxed);
                router.release(held);
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
        }));
    }
    for c in clients {
        c.await.expect("client task");
    }
    let wall = started.elapsed();
    let mut results = results.lock().map(|r| r.clone()).unwrap_or_default();
    results.sort_by_key(|r| r.0);
    let pct = |p: f64| {
        let i = ((results.len() as f64 * p).ceil() as usize).clamp(1, results.len()) - 1;
        results[i].0
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
    Outcome {
        policy,
        hit_rate: cached as f64 / prompt as f64,
        engine_hit_rate: hit as f64 / query.max(1) as f64,
        p50: pct(0.5),
        p90: pct(0.9),
        p99: pct(0.99),
        wall,
        evictions,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let s = Settings::from_args();
    let mut working_set = 0usize;
    for sys in 0..s.systems {
        let _ = sys;
        working_set += s.system_tokens / BLOCK;
    }
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
        s.miss_weight
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
        Policy::Oracle,
    ] {
        let o = run(policy, &s).await;
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
}
