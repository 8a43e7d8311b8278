//! The subscriber, index and scorer against simulated engines that publish KV events
//! over real ZMQ sockets on 127.0.0.1 (ephemeral ports), as vLLM does.

use std::sync::Arc;
use std::time::{Duration, Instant};

use disagg_kvevents::subscriber::RankStatus;
use disagg_kvevents::{
    Candidate, EngineEndpoint, IndexConfig, KvIndex, KvScorer, ScorerConfig, Subscriber,
    SubscriberConfig,
};
use disagg_sim::{KvEventsConfig, SimConfig, SimEngine};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Generous: only reached when something is broken.
const WAIT: Duration = Duration::from_secs(10);

fn config(cache_blocks: usize, replay: bool) -> SimConfig {
    SimConfig {
        prefix_cache_blocks: cache_blocks,
        kv_events: Some(KvEventsConfig {
            replay_port: replay.then_some(0),
            ..KvEventsConfig::default()
        }),
        record_requests: 0,
        ..SimConfig::default()
    }
}

async fn engine(cache_blocks: usize, replay: bool) -> SimEngine {
    SimEngine::start(config(cache_blocks, replay))
        .await
        .unwrap()
}

fn endpoint(e: &SimEngine) -> EngineEndpoint {
    let ep = EngineEndpoint::new(e.url(), e.kv_events_endpoint().unwrap()).unwrap();
    match e.kv_events_replay_endpoint() {
        Some(r) => ep.with_replay(r).unwrap(),
        None => ep,
    }
}

fn sub_config() -> SubscriberConfig {
    SubscriberConfig {
        silence_timeout: Duration::from_millis(500),
        connect_timeout: Duration::from_millis(200),
        ..SubscriberConfig::default()
    }
}

async fn subscribe(engines: &[&SimEngine]) -> (Arc<KvIndex>, Subscriber) {
    subscribe_with(engines, sub_config()).await
}

/// [`sub_config`] without the resubscription after 500 ms of silence, for tests that
/// count what one subscription saw: lost events publish nothing, and a loaded machine
/// may take longer than that between two published batches.
fn patient_config() -> SubscriberConfig {
    SubscriberConfig {
        silence_timeout: Duration::from_secs(60),
        ..sub_config()
    }
}

async fn subscribe_with(
    engines: &[&SimEngine],
    config: SubscriberConfig,
) -> (Arc<KvIndex>, Subscriber) {
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    let subscriber = Subscriber::new(index.clone(), config);
    subscriber
        .set_endpoints(engines.iter().map(|e| endpoint(e)).collect())
        .await;
    (index, subscriber)
}

/// A prompt of `blocks` full blocks of 16 tokens (plus one token, so that every block
/// can hit), distinct per `seed` (below 1040: ids stay in the vocabulary).
fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..blocks as u32 * 16 + 1)
        .map(|i| 1000 + seed * 1000 + i)
        .collect()
}

/// POSTs a completion of `tokens` (max_tokens 1) to `e`, with `headers`; the JSON answer.
async fn complete(e: &SimEngine, tokens: &[u32], headers: &[(&str, &str)]) -> Value {
    let body = json!({"model": "sim-model", "prompt": tokens, "max_tokens": 1}).to_string();
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\n\
         {extra}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut conn = tokio::net::TcpStream::connect(e.addr()).await.unwrap();
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await.unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{answer}");
    serde_json::from_str(body).unwrap()
}

/// Sends a raw HTTP/1.1 request to `e`; the whole answer.
async fn http(e: &SimEngine, request: &str) -> String {
    let mut conn = tokio::net::TcpStream::connect(e.addr()).await.unwrap();
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await.unwrap();
    answer
}

fn cached_tokens(answer: &Value) -> u64 {
    answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn status(s: &Subscriber, engine: &SimEngine, rank: u32) -> RankStatus {
    s.status()
        .into_iter()
        .find(|r| r.engine == engine.url() && r.dp_rank == rank)
        .unwrap()
}

/// Sends distinct warm-up prompts until the subscriber has received a batch of `e`
/// (a `PUB` socket drops what it publishes before the subscription reached it).
async fn warm_up(s: &Subscriber, e: &SimEngine, seed: u32) {
    let deadline = Instant::now() + WAIT;
    let mut i = 0;
    while status(s, e, 0).batches == 0 {
        assert!(
            Instant::now() < deadline,
            "no batch of {} received",
            e.url()
        );
        complete(e, &prompt(seed + i, 1), &[]).await;
        i += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn choose(scorer: &KvScorer, tokens: &[u32], engines: &[&SimEngine]) -> usize {
    let urls: Vec<String> = engines.iter().map(|e| e.url()).collect();
    let candidates: Vec<Candidate<'_>> = urls.iter().map(|u| Candidate::new(u, 0)).collect();
    scorer.choose(tokens, &candidates).unwrap().index
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_stored_on_b_route_to_b_and_once_moved_to_a_route_to_a() {
    let a = engine(8, true).await;
    let b = engine(8, true).await;
    let (index, subscriber) = subscribe(&[&a, &b]).await;
    warm_up(&subscriber, &a, 900).await;
    warm_up(&subscriber, &b, 950).await;

    let p = prompt(1, 4);
    complete(&b, &p, &[]).await;
    eventually("b holds p", || index.cached_tokens(&b.url(), &p) == 64).await;
    // A fresh scorer each time: no provisional entry of its own choices.
    let scorer = || KvScorer::new(index.clone(), ScorerConfig::default());
    assert_eq!(choose(&scorer(), &p, &[&a, &b]), 1);
    assert_eq!(index.cached_tokens(&a.url(), &p), 0);
    // The engine agrees: the prompt hits on b.
    assert_eq!(cached_tokens(&complete(&b, &p, &[]).await), 64);

    // b evicts p (its cache holds 8 blocks), a computes it.
    complete(&b, &prompt(2, 4), &[]).await;
    complete(&b, &prompt(3, 4), &[]).await;
    eventually("b evicted p", || index.cached_tokens(&b.url(), &p) == 0).await;
    assert_eq!(b.cached_prefix_tokens(0, &p), 0);
    complete(&a, &p, &[]).await;
    eventually("a holds p", || index.cached_tokens(&a.url(), &p) == 64).await;
    assert_eq!(choose(&scorer(), &p, &[&a, &b]), 0);
    assert!(b.stats().prefix_cache_evictions >= 4);
    assert_eq!(status(&subscriber, &b, 0).drops, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_the_same_engines_agree() {
    let engines = [
        engine(16, true).await,
        engine(16, true).await,
        engine(16, true).await,
    ];
    let refs: Vec<&SimEngine> = engines.iter().collect();
    let (index1, sub1) = subscribe(&refs).await;
    let (index2, sub2) = subscribe(&refs).await;
    for (i, e) in engines.iter().enumerate() {
        warm_up(&sub1, e, 900 + i as u32 * 20).await;
        warm_up(&sub2, e, 960 + i as u32 * 20).await;
    }
    // A shared system prompt everywhere, then conversations on one engine each.
    let system = prompt(10, 2);
    for (i, e) in engines.iter().enumerate() {
        let mut p = system[..32].to_vec();
        p.extend(prompt(20 + i as u32, 1 + i));
        complete(e, &p, &[]).await;
    }
    let probes: Vec<Vec<u32>> = (0..3u32)
        .map(|i| {
            let mut p = system[..32].to_vec();
            p.extend(prompt(20 + i, 1 + i as usize));
            p.extend([7, 7, 7]);
            p
        })
        .collect();
    let settled = |index: &KvIndex| {
        engines.iter().all(|e| {
            e.stats().kv_event_batches > 0
                && probes.iter().all(|p| {
                    index.cached_tokens(&e.url(), p) == e.cached_prefix_tokens(0, p) / 16 * 16
                })
        })
    };
    eventually("replica 1 caught up", || settled(&index1)).await;
    eventually("replica 2 caught up", || settled(&index2)).await;
    let s1 = KvScorer::new(index1.clone(), ScorerConfig::default());
    let s2 = KvScorer::new(index2.clone(), ScorerConfig::default());
    for (i, p) in probes.iter().enumerate() {
        let mut m1: Vec<_> = index1.match_prefix(p).holders().to_vec();
        let mut m2: Vec<_> = index2.match_prefix(p).holders().to_vec();
        m1.sort_by(|a, b| a.engine.cmp(&b.engine));
        m2.sort_by(|a, b| a.engine.cmp(&b.engine));
        assert_eq!(m1, m2);
        assert_eq!(m1.len(), 3, "the system prompt is on every engine");
        // Each probe goes to the engine holding its conversation, on both replicas.
        assert_eq!(choose(&s1, p, &refs), i);
        assert_eq!(choose(&s2, p, &refs), i);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_filled_by_replay() {
    let e = engine(64, true).await;
    let (index, subscriber) = subscribe_with(&[&e], patient_config()).await;
    warm_up(&subscriber, &e, 900).await;
    // Warm-up batches published before the subscription reached the engine are
    // caught up by replay too: count only what the gap below adds.
    let before = status(&subscriber, &e, 0);
    let (p1, p2, p3) = (prompt(1, 2), prompt(2, 2), prompt(3, 2));
    e.lose_kv_events(0, 2);
    complete(&e, &p1, &[]).await;
    complete(&e, &p2, &[]).await;
    // Nothing arrived: the subscriber cannot know yet.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(index.cached_tokens(&e.url(), &p1), 0);
    complete(&e, &p3, &[]).await;
    eventually("all three", || {
        [&p1, &p2, &p3]
            .iter()
            .all(|p| index.cached_tokens(&e.url(), p) == 32)
    })
    .await;
    let s = status(&subscriber, &e, 0);
    assert_eq!(
        (
            s.gaps - before.gaps,
            s.replayed - before.replayed,
            s.drops - before.drops
        ),
        (1, 2, 0)
    );
    assert!(e.stats().kv_event_replays >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_without_replay_drops_the_engines_entries() {
    let e = engine(64, false).await;
    let (index, subscriber) = subscribe_with(&[&e], patient_config()).await;
    warm_up(&subscriber, &e, 900).await;
    let (p1, p2, p3) = (prompt(1, 2), prompt(2, 2), prompt(3, 2));
    complete(&e, &p1, &[]).await;
    eventually("p1", || index.cached_tokens(&e.url(), &p1) == 32).await;
    e.lose_kv_events(0, 1);
    complete(&e, &p2, &[]).await;
    complete(&e, &p3, &[]).await;
    eventually("p3", || index.cached_tokens(&e.url(), &p3) == 32).await;
    // p1 is still on the engine, but after lost events the index cannot vouch for it.
    assert_eq!(e.cached_prefix_tokens(0, &p1), 32);
    assert_eq!(index.cached_tokens(&e.url(), &p1), 0);
    assert_eq!(index.cached_tokens(&e.url(), &p2), 0);
    let s = status(&subscriber, &e, 0);
    assert_eq!((s.gaps, s.drops, s.replayed), (1, 1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_engine_is_followed_and_its_old_entries_dropped() {
    let first = engine(64, false).await;
    let url_port = first.kv_events_endpoint().unwrap();
    let port: u16 = url_port.rsplit(':').next().unwrap().parse().unwrap();
    let (index, subscriber) = subscribe(&[&first]).await;
    let name = first.url();
    warm_up(&subscriber, &first, 900).await;
    let old = prompt(1, 2);
    // The new process numbers its batches from 0, and the restart shows only while they
    // stay at or below the old process's last: publish enough before the restart that a
    // subscription slow to come back (a loaded CI machine) still sees one of those.
    for i in 0..20 {
        complete(&first, &prompt(2 + i, 1), &[]).await;
    }
    complete(&first, &old, &[]).await;
    eventually("old", || index.cached_tokens(&name, &old) == 32).await;
    let before = status(&subscriber, &first, 0);
    first.shutdown().await;

    // A new engine process on the same KV-event port (its HTTP port differs, but the
    // subscription is by the endpoint the router was given).
    let second = SimEngine::start(SimConfig {
        kv_events: Some(KvEventsConfig {
            port,
            replay_port: None,
            ..KvEventsConfig::default()
        }),
        ..config(64, false)
    })
    .await
    .unwrap();
    let deadline = Instant::now() + WAIT;
    let mut i = 0;
    let restarted = |s: &Subscriber| {
        s.status()
            .into_iter()
            .find(|r| r.engine == name)
            .is_some_and(|r| r.restarts == 1)
    };
    while !restarted(&subscriber) {
        assert!(Instant::now() < deadline, "restart not detected");
        complete(&second, &prompt(50 + i, 2), &[]).await;
        i += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let after = subscriber
        .status()
        .into_iter()
        .find(|r| r.engine == name)
        .unwrap();
    // The sequence went back: the new process's numbers are followed.
    assert!(after.last_seq < before.last_seq);
    assert_eq!(index.cached_tokens(&name, &old), 0);
    let fresh = prompt(80, 2);
    complete(&second, &fresh, &[]).await;
    eventually("fresh", || index.cached_tokens(&name, &fresh) == 32).await;
}

/// An engine that restarts and publishes past the old process's last sequence number
/// before the subscription comes back: the first batch seen is past the next one, as
/// after a gap, and a replay of that "gap" from the new process succeeds. Taken for a
/// gap, the old process's entries stayed in the index; after a resubscription such a
/// jump drops them and replays the engine's history instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_engine_seen_past_the_old_last_has_its_old_entries_dropped() {
    let first = engine(64, true).await;
    let port_of = |url: String| -> u16 { url.rsplit(':').next().unwrap().parse().unwrap() };
    let port = port_of(first.kv_events_endpoint().unwrap());
    let replay_port = port_of(first.kv_events_replay_endpoint().unwrap());
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    // A long pause after a failed connection: the new process publishes during it.
    let subscriber = Subscriber::new(
        index.clone(),
        SubscriberConfig {
            connect_timeout: Duration::from_secs(3),
            ..sub_config()
        },
    );
    subscriber.set_endpoints(vec![endpoint(&first)]).await;
    let name = first.url();
    warm_up(&subscriber, &first, 900).await;
    let old = prompt(1, 2);
    complete(&first, &old, &[]).await;
    eventually("old", || index.cached_tokens(&name, &old) == 32).await;
    let before = status(&subscriber, &first, 0);
    first.shutdown().await;

    // On the old process's ports, which its sockets' closing releases a moment after
    // `shutdown` returns (a bind seen failing with "address in use" once in CI).
    let restart_by = Instant::now() + Duration::from_secs(5);
    let second = loop {
        let started = SimEngine::start(SimConfig {
            kv_events: Some(KvEventsConfig {
                port,
                replay_port: Some(replay_port),
                ..KvEventsConfig::default()
            }),
            ..config(64, true)
        })
        .await;
        match started {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < restart_by => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => break other.unwrap(),
        }
    };
    // Published before the subscription is back (dropped by its PUB socket, kept in its
    // replay buffer): the new process's numbers pass the old last.
    let last = before.last_seq.unwrap();
    for i in 0..last + 8 {
        complete(&second, &prompt(100 + i as u32 % 500, 1), &[]).await;
    }
    // New prompts until one reaches the index: the subscription is back.
    let deadline = Instant::now() + WAIT;
    for j in 0.. {
        assert!(
            Instant::now() < deadline,
            "the new process's batches never came"
        );
        let fresh = prompt(600 + j, 2);
        complete(&second, &fresh, &[]).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        if index.cached_tokens(&name, &fresh) == 32 {
            break;
        }
    }
    assert_eq!(
        index.cached_tokens(&name, &old),
        0,
        "the old process's entries stayed"
    );
    let after = subscriber
        .status()
        .into_iter()
        .find(|r| r.engine == name)
        .unwrap();
    // However the subscription saw the new process (a sequence that went back, or the
    // jump this test arranges), its entries went at least once.
    assert!(after.drops > before.drops, "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_engine_is_resubscribed() {
    let e = engine(64, true).await;
    let (index, subscriber) = subscribe(&[&e]).await;
    warm_up(&subscriber, &e, 900).await;
    // Silence past the timeout (500 ms): a new subscription.
    eventually("a resubscription", || {
        status(&subscriber, &e, 0).resubscribes >= 1
    })
    .await;
    eventually("connected again", || status(&subscriber, &e, 0).connected).await;
    // Events flow on the new subscription (what a slow joiner missed is replayed).
    let p = prompt(1, 2);
    complete(&e, &p, &[]).await;
    let deadline = Instant::now() + WAIT;
    let mut i = 0;
    while index.cached_tokens(&e.url(), &p) != 32 {
        assert!(Instant::now() < deadline, "no event after resubscribing");
        complete(&e, &prompt(950 + i, 1), &[]).await;
        i += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(status(&subscriber, &e, 0).drops, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_leaves_has_its_entries_dropped() {
    let a = engine(64, true).await;
    let b = engine(64, true).await;
    let (index, subscriber) = subscribe(&[&a, &b]).await;
    warm_up(&subscriber, &a, 900).await;
    warm_up(&subscriber, &b, 950).await;
    let p = prompt(1, 2);
    complete(&a, &p, &[]).await;
    complete(&b, &p, &[]).await;
    eventually("both", || {
        index.cached_tokens(&a.url(), &p) == 32 && index.cached_tokens(&b.url(), &p) == 32
    })
    .await;
    subscriber.set_endpoints(vec![endpoint(&a)]).await;
    assert_eq!(index.cached_tokens(&b.url(), &p), 0);
    assert_eq!(index.engines(), vec![a.url()]);
    assert_eq!(index.cached_tokens(&a.url(), &p), 32);
    assert_eq!(subscriber.endpoints().await, vec![endpoint(&a)]);
}

/// An engine of two data-parallel ranks, subscribed to, once both ranks' subscriptions
/// have seen a batch: the engine, the index and the subscriber.
async fn two_ranks_subscribed() -> (SimEngine, Arc<KvIndex>, Subscriber) {
    let e = SimEngine::start(SimConfig {
        dp_size: 2,
        ..config(64, true)
    })
    .await
    .unwrap();
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    let subscriber = both_ranks_of(&e, &index, 900).await;
    (e, index, subscriber)
}

/// A subscriber writing into `index`, of both ranks of `e`, once each rank's subscription
/// has seen a batch (warm-up prompts from seed `seed` on).
async fn both_ranks_of(e: &SimEngine, index: &Arc<KvIndex>, seed: u32) -> Subscriber {
    let subscriber = Subscriber::new(index.clone(), sub_config());
    subscriber
        .set_endpoints(vec![endpoint(e).with_dp_size(2).unwrap()])
        .await;
    let deadline = Instant::now() + WAIT;
    let mut i = 0;
    while status(&subscriber, e, 1).batches == 0 || status(&subscriber, e, 0).batches == 0 {
        assert!(Instant::now() < deadline, "no batch from both ranks");
        for rank in ["0", "1"] {
            complete(e, &prompt(seed + i, 1), &[("x-data-parallel-rank", rank)]).await;
            i += 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    subscriber
}

/// A caller that gives up on `set_endpoints` while it waits for a leaving engine's
/// ranks to stop (a timeout, a `select!`) leaves none of them running and nothing of
/// the engine behind: every rank was told to stop before the first wait. On one
/// thread, so that no rank's cancellation can finish before the one poll.
#[tokio::test(flavor = "current_thread")]
async fn an_unsubscribe_given_up_midway_leaves_no_rank_running_nor_entries() {
    use futures::FutureExt as _;
    let (e, index, subscriber) = two_ranks_subscribed().await;
    assert_eq!(index.engines(), vec![e.url()]);
    // Polled once, then dropped: the first rank's stop is still being waited for.
    let given_up = subscriber.set_endpoints(Vec::new()).now_or_never();
    assert!(given_up.is_none(), "the stop was not waited for");
    assert!(subscriber.status().is_empty(), "{:?}", subscriber.status());
    assert!(index.engines().is_empty());
    // No rank left running writes into the index again: a second subscriber, whose
    // subscriptions see both ranks' batches, indexes every prompt that follows (and its
    // own warm-up's), while the first index stays empty.
    let witnessed = Arc::new(KvIndex::new(IndexConfig::default()));
    let _witness = both_ranks_of(&e, &witnessed, 950).await;
    let prompts: Vec<_> = (40..44).map(|seed| prompt(seed, 2)).collect();
    for (p, rank) in prompts.iter().zip(["0", "1", "0", "1"]) {
        complete(&e, p, &[("x-data-parallel-rank", rank)]).await;
    }
    eventually("the witness indexed every prompt", || {
        prompts
            .iter()
            .all(|p| witnessed.match_prefix(p).engine(&e.url()).is_some())
    })
    .await;
    assert!(
        index.engines().is_empty(),
        "a rank still writes: {:?}",
        index.engines()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_parallel_ranks_are_holders_of_their_own() {
    let (e, index, _subscriber) = two_ranks_subscribed().await;
    let p = prompt(1, 3);
    complete(&e, &p, &[("x-data-parallel-rank", "1")]).await;
    eventually("rank 1 holds p", || {
        index
            .match_prefix(&p)
            .engine(&e.url())
            .is_some_and(|m| m.dp_rank == 1 && m.blocks == 3)
    })
    .await;
    let scorer = KvScorer::new(index.clone(), ScorerConfig::default());
    let url = e.url();
    let d = scorer.choose(&p, &[Candidate::new(&url, 0)]).unwrap();
    assert_eq!((d.dp_rank, d.cached_tokens), (Some(1), 48));
    assert_eq!(e.cached_prefix_tokens(0, &p), 0);
    // A router whose endpoints are ranks (`URL@r`) names them.
    let ranks = [
        Candidate::new(&url, 0).with_dp_rank(0),
        Candidate::new(&url, 0).with_dp_rank(1),
    ];
    assert_eq!(scorer.choose(&p, &ranks).map(|d| d.index), Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_reports_its_hits() {
    let e = engine(64, true).await;
    let p = prompt(1, 3);
    assert_eq!(cached_tokens(&complete(&e, &p, &[]).await), 0);
    assert_eq!(cached_tokens(&complete(&e, &p, &[]).await), 48);
    let stats = e.stats();
    assert_eq!(
        (
            stats.prefix_cache_query_tokens,
            stats.prefix_cache_hit_tokens
        ),
        (98, 48)
    );
    assert_eq!(stats.prefix_cache_blocks, 3);
    // `/stats` serves the same counters.
    let served = http(
        &e,
        "GET /stats HTTP/1.1\r\nhost: sim\r\nconnection: close\r\n\r\n",
    )
    .await;
    let served: Value = serde_json::from_str(served.split_once("\r\n\r\n").unwrap().1).unwrap();
    assert_eq!(served["prefix_cache_hit_tokens"], 48);
    // A streamed answer carries them in its usage chunk.
    let body = json!({"model": "sim-model", "prompt": p, "max_tokens": 2, "stream": true,
        "stream_options": {"include_usage": true}})
    .to_string();
    let streamed = http(
        &e,
        &format!(
            "POST /v1/completions HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        ),
    )
    .await;
    assert!(
        streamed.contains(r#""prompt_tokens_details":{"cached_tokens":48}"#),
        "{streamed}"
    );
    // An engine without a cache answers as before: no details.
    let plain = SimEngine::start(SimConfig::default()).await.unwrap();
    let answer = complete(&plain, &p, &[]).await;
    assert!(answer["usage"]["prompt_tokens_details"].is_null());
}

/// An engine publishing its load as SGLang does: the subscriber records the prefill
/// work queued behind the running prefill, the scorer prices it although this router
/// sent none of it, and the report falls back to idle once the queue drained; an
/// engine that leaves the set takes its reports along.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engines_load_reports_price_work_other_routers_sent() {
    let config = SimConfig {
        prefix_cache_blocks: 1024,
        kv_events: Some(KvEventsConfig {
            load_port: Some(0),
            ..KvEventsConfig::default()
        }),
        serial_prefill: true,
        prefill_delay_per_token: Duration::from_millis(5),
        record_requests: 0,
        ..SimConfig::default()
    };
    let busy = SimEngine::start(config.clone()).await.unwrap();
    let idle = SimEngine::start(config).await.unwrap();
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    let subscriber = Subscriber::new(index.clone(), sub_config());
    let with_load = |e: &SimEngine| endpoint(e).with_load(e.load_endpoint().unwrap()).unwrap();
    subscriber
        .set_endpoints(vec![with_load(&busy), with_load(&idle)])
        .await;
    eventually("both engines' first load reports", || {
        [&busy, &idle]
            .iter()
            .all(|e| status(&subscriber, e, 0).load_reports > 0)
    })
    .await;
    // Three prompts of 4 blocks and a token (65 tokens, 325 ms each) sent to `busy` by
    // someone else: one computes, two wait; 195 uncached tokens are queued (SGLang counts
    // the rest of the prefill in progress with the waiting ones).
    let clients: Vec<_> = (0..3)
        .map(|seed| {
            let url = busy.url();
            let tokens = prompt(seed, 4);
            tokio::spawn(async move {
                let body = json!({"model": "sim-model", "prompt": tokens, "max_tokens": 1});
                post_raw(&url, &body).await
            })
        })
        .collect();
    let now = || Instant::now();
    let age = Duration::from_secs(3);
    eventually("two requests waiting on the busy engine", || {
        index
            .loads()
            .get(&busy.url(), 0, now(), age)
            .is_some_and(|s| s.waiting == 2 && s.running == 1 && s.waiting_uncached_tokens == 195)
    })
    .await;
    // A prompt nobody holds: equal misses, so the queue decides, although this
    // scorer sent nothing anywhere.
    let scorer = KvScorer::new(index.clone(), ScorerConfig::default());
    assert_eq!(choose(&scorer, &prompt(9, 2), &[&busy, &idle]), 1);
    assert_eq!(scorer.queued_tokens(&Candidate::new(&busy.url(), 0)), 195);
    for c in clients {
        assert!(c.await.unwrap().contains("200 OK"));
    }
    eventually("the busy engine reports an empty queue", || {
        index
            .loads()
            .get(&busy.url(), 0, now(), age)
            .is_some_and(|s| s.waiting == 0 && s.running == 0 && s.waiting_uncached_tokens == 0)
    })
    .await;
    subscriber.set_endpoints(vec![with_load(&idle)]).await;
    assert!(index.loads().get(&busy.url(), 0, now(), age).is_none());
    subscriber.shutdown().await;
}

/// POSTs `body` to `url`'s `/v1/completions` on a connection of its own; the raw answer.
async fn post_raw(url: &str, body: &Value) -> String {
    let addr = url.trim_start_matches("http://").trim_end_matches('/');
    let body = body.to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).await.unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}
