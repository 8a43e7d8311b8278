//! The subscriber against publishers and replay endpoints that misbehave, played by
//! hand-written ZMTP over loopback TCP (127.0.0.1, ephemeral ports), so that every
//! batch, gap and connection is the test's to count:
//!
//! * a replay endpoint that accepts and never answers, or refuses at once: a stream
//!   of batches with a gap before each is applied promptly, the rank's entries
//!   dropped at each gap, and the endpoint is tried a bounded number of times, not
//!   once per gap (the replay back-off);
//! * an undecodable batch and a message of the wrong shape are counted per reason,
//!   the rank's entries dropped, and the batches after them applied on the same
//!   subscription;
//! * replay answers in each form the engines send (`[empty, seq, payload]`, with a
//!   topic, the `[empty, empty]` end), a catch-up replay that stalls halfway, a
//!   publisher gone past the grace, one that never greets, and skipped blocks.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use disagg_kvevents::subscriber::{Malformed, RankStatus, SocketKind};
use disagg_kvevents::{EngineEndpoint, IndexConfig, KvIndex, Subscriber, SubscriberConfig};
use rmpv::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Generous: reached only when something is broken.
const WAIT: Duration = Duration::from_secs(10);

/// Gaps in the back-off tests' streams. Before the back-off, each cost a replay
/// attempt: `GAPS` × [`REPLAY_TIMEOUT`] (250 s) against a silent endpoint, `GAPS`
/// connections to a refusing one.
const GAPS: u64 = 999;

/// The replay timeout of the back-off tests: short, so that the one replay that is
/// tried costs little, yet a timeout per gap would still take minutes.
const REPLAY_TIMEOUT: Duration = Duration::from_millis(250);

/// A ZMTP 3 greeting (NULL mechanism) and READY for a socket of type `socket_type`.
fn hello(socket_type: &str) -> Vec<u8> {
    let mut out = vec![0u8; 64];
    out[0] = 0xff;
    out[9] = 0x7f;
    out[10] = 3;
    out[12..16].copy_from_slice(b"NULL");
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    out.extend_from_slice(&[0x04, body.len() as u8]);
    out.extend_from_slice(&body);
    out
}

/// One ZMTP data frame.
fn frame(more: bool, body: &[u8], out: &mut Vec<u8>) {
    let more = u8::from(more);
    match u8::try_from(body.len()) {
        Ok(len) => out.extend_from_slice(&[more, len]),
        Err(_) => {
            out.push(more | 0x02);
            out.extend_from_slice(&(body.len() as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(body);
}

/// A KV-event message as vLLM publishes it: `[topic, seq, payload]`, empty topic.
fn message(seq: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    frame(true, b"", &mut out);
    frame(true, &seq.to_be_bytes(), &mut out);
    frame(false, payload, &mut out);
    out
}

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

/// The 16 tokens of block `n` (distinct per `n`).
fn block(n: u64) -> Vec<u32> {
    let first = 1000 + n as u32 * 16;
    (first..first + 16).collect()
}

/// A prompt whose one full block is block `n` (one token more, so that it can hit).
fn prompt(n: u64) -> Vec<u32> {
    let mut p = block(n);
    p.push(7);
    p
}

/// `[ts, [BlockStored of block n, a root block]]`, vLLM's map-tagged encoding.
fn stored(n: u64) -> Vec<u8> {
    let tokens = block(n).into_iter().map(Value::from).collect();
    encode(&Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![Value::Map(vec![
            ("type".into(), "BlockStored".into()),
            (
                "block_hashes".into(),
                Value::Array(vec![Value::from(0xB000_0000 + n)]),
            ),
            ("parent_block_hash".into(), Value::Nil),
            ("token_ids".into(), Value::Array(tokens)),
            ("block_size".into(), 16.into()),
            ("medium".into(), "GPU".into()),
        ])]),
    ]))
}

/// Plays the engine's `PUB`: accepts the subscriber, greets, and reads its greeting,
/// READY and subscription (to every topic).
async fn subscribed(events: &TcpListener) -> TcpStream {
    let (mut s, _) = tokio::time::timeout(WAIT, events.accept())
        .await
        .expect("the subscriber connects in time")
        .unwrap();
    s.write_all(&hello("PUB")).await.unwrap();
    // Greeting (64), READY with `Socket-Type: SUB` (2 + 25), `\x01` (2 + 1).
    let mut head = [0u8; 64 + 2 + 25 + 3];
    s.read_exact(&mut head).await.unwrap();
    assert_eq!(
        &head[head.len() - 3..],
        [0x00, 0x01, 0x01],
        "subscribes to all"
    );
    s
}

async fn listener() -> (TcpListener, String) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", l.local_addr().unwrap());
    (l, endpoint)
}

/// A replay endpoint that counts the connections it accepts; `greet_and_hang` says
/// what it does with each: `true` greets as a `ROUTER` and then never answers (the connection held
/// open), `false` closes it at once.
fn replay_endpoint(l: TcpListener, greet_and_hang: bool) -> Arc<AtomicU64> {
    let accepted = Arc::new(AtomicU64::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut s, _)) = l.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            if greet_and_hang {
                let _ = s.write_all(&hello("ROUTER")).await;
                held.push(s);
            }
        }
    });
    accepted
}

fn subscriber_config() -> SubscriberConfig {
    SubscriberConfig {
        // The first replay back-off: 1 s, then 2 s, 4 s...
        connect_timeout: Duration::from_secs(1),
        replay_timeout: REPLAY_TIMEOUT,
        ..SubscriberConfig::default()
    }
}

fn status(s: &Subscriber, engine: &str) -> RankStatus {
    s.status().into_iter().find(|r| r.engine == engine).unwrap()
}

async fn eventually(what: &str, s: &Subscriber, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !check() {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {:?}",
            s.status()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Publishes block 0 at seq 0 and waits until it is indexed, then block `i` at seq
/// `2i` for `i` in `1..=GAPS`: a gap of one batch before each. Returns when the last
/// was written.
async fn publish_with_gaps(s: &mut TcpStream, sub: &Subscriber, index: &KvIndex, engine: &str) {
    s.write_all(&message(0, &stored(0))).await.unwrap();
    eventually("block 0", sub, || {
        index.cached_tokens(engine, &prompt(0)) == 16
    })
    .await;
    let mut burst = Vec::new();
    for i in 1..=GAPS {
        burst.extend_from_slice(&message(2 * i, &stored(i)));
    }
    s.write_all(&burst).await.unwrap();
}

/// Checks what every gap of [`publish_with_gaps`] left: each batch applied, each gap
/// either replayed (and failed) or skipped by the back-off, the rank's entries
/// dropped at each, so only the last block is held.
fn check_gaps(s: &RankStatus, index: &KvIndex, engine: &str) {
    assert_eq!(
        (s.batches, s.gaps, s.drops, s.replayed),
        (GAPS + 1, GAPS, GAPS, 0),
        "{s:?}"
    );
    assert_eq!(s.replay_failures + s.replays_skipped, GAPS, "{s:?}");
    // The stale entries went with the first gap; each later block with the next.
    assert_eq!(index.cached_tokens(engine, &prompt(0)), 0);
    assert_eq!(index.cached_tokens(engine, &prompt(GAPS - 1)), 0);
    assert_eq!(index.cached_tokens(engine, &prompt(GAPS)), 16);
    assert!(s.connected, "{s:?}");
}

/// A replay endpoint that accepts, greets as a `ROUTER` and never answers (an engine
/// whose replay thread is stuck): before the back-off, each gap waited the replay
/// timeout, so 999 gaps took 999 × 250 ms (the default 2 s: over half an hour) while
/// the rank's events piled up unread. Now the first replay times out, the next ones
/// are skipped during the back-off (1 s, then 2 s...), and the whole stream is applied
/// in well under the time of twenty timed-out replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_endpoint_that_never_answers_costs_one_timeout_not_one_per_gap() {
    let (events, events_at) = listener().await;
    let (replay, replay_at) = listener().await;
    let attempts = replay_endpoint(replay, true);
    let engine = "http://silent-replay:8000";
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    let sub = Subscriber::new(index.clone(), subscriber_config());
    sub.set_endpoints(vec![
        EngineEndpoint::new(engine, events_at)
            .unwrap()
            .with_replay(replay_at)
            .unwrap(),
    ])
    .await;
    let mut publisher = subscribed(&events).await;

    let start = Instant::now();
    publish_with_gaps(&mut publisher, &sub, &index, engine).await;
    eventually("every batch applied", &sub, || {
        status(&sub, engine).last_seq == Some(2 * GAPS)
    })
    .await;
    let took = start.elapsed();
    let s = status(&sub, engine);
    check_gaps(&s, &index, engine);
    // One replay per back-off period at most: 1 + 1 s + 2 s + 4 s covers 8 s, far
    // more than the stream takes even on a loaded machine.
    let tried = attempts.load(Ordering::SeqCst);
    assert!((1..=4).contains(&tried), "{tried} replay connections");
    assert_eq!(s.replay_failures, tried, "{s:?}");
    assert!(s.replays_skipped >= GAPS - 4, "{s:?}");
    // Generous for a loaded machine (it takes ~0.3 s): twenty timed-out replays. One
    // per gap took 250 s.
    assert!(took < 20 * REPLAY_TIMEOUT, "took {took:?}");
    sub.shutdown().await;
}

/// Replay endpoints that refuse: one accepts and closes at once, the other's port has
/// no listener. Before the back-off every gap connected again (999 connections, or
/// 999 refused attempts); now a failed replay backs the next ones off, so a burst of
/// gaps costs one attempt or a few, and each gap still drops the rank's entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_endpoints_that_refuse_are_tried_a_bounded_number_of_times() {
    let (events_a, events_a_at) = listener().await;
    let (events_b, events_b_at) = listener().await;
    let (closing, closing_at) = listener().await;
    let accepted = replay_endpoint(closing, false);
    // A port bound but not listening: connections to it are refused, and no other
    // listener can take it while the socket lives.
    let dead = tokio::net::TcpSocket::new_v4().unwrap();
    dead.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let dead_at = format!("tcp://{}", dead.local_addr().unwrap());

    let (closes, refuses) = ("http://closing-replay:8000", "http://dead-replay:8000");
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    let sub = Subscriber::new(index.clone(), subscriber_config());
    sub.set_endpoints(vec![
        EngineEndpoint::new(closes, events_a_at)
            .unwrap()
            .with_replay(closing_at)
            .unwrap(),
        EngineEndpoint::new(refuses, events_b_at)
            .unwrap()
            .with_replay(dead_at)
            .unwrap(),
    ])
    .await;
    let mut a = subscribed(&events_a).await;
    let mut b = subscribed(&events_b).await;

    tokio::join!(
        publish_with_gaps(&mut a, &sub, &index, closes),
        publish_with_gaps(&mut b, &sub, &index, refuses),
    );
    eventually("every batch applied", &sub, || {
        [closes, refuses]
            .iter()
            .all(|e| status(&sub, e).last_seq == Some(2 * GAPS))
    })
    .await;
    for engine in [closes, refuses] {
        let s = status(&sub, engine);
        check_gaps(&s, &index, engine);
        assert!((1..=4).contains(&s.replay_failures), "{engine}: {s:?}");
        assert!(s.replays_skipped >= GAPS - 4, "{engine}: {s:?}");
    }
    // Each failed replay is one connection the endpoint saw, not one per gap.
    let accepted = accepted.load(Ordering::SeqCst);
    assert_eq!(accepted, status(&sub, closes).replay_failures);
    sub.shutdown().await;
}

/// A batch that does not decode, and a message that is not `[topic, seq, payload]`:
/// each counted under its reason (`undecodable`, `shape`), each dropping the rank's
/// entries (what it said is unknown) like a lost batch; the subscription carries on,
/// and the batches after them are applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_batch_is_counted_and_the_next_ones_are_applied() {
    let (events, events_at) = listener().await;
    let engine = "http://garbled:8000";
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    let sub = Subscriber::new(index.clone(), subscriber_config());
    sub.set_endpoints(vec![EngineEndpoint::new(engine, events_at).unwrap()])
        .await;
    let mut publisher = subscribed(&events).await;

    publisher.write_all(&message(0, &stored(0))).await.unwrap();
    eventually("block 0", &sub, || {
        index.cached_tokens(engine, &prompt(0)) == 16
    })
    .await;
    // seq 1: a BlockStored whose block_hashes is a string: the batch fails whole.
    let garbled = encode(&Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![Value::Map(vec![
            ("type".into(), "BlockStored".into()),
            ("block_hashes".into(), "not a list".into()),
            ("parent_block_hash".into(), Value::Nil),
            ("token_ids".into(), Value::Array(vec![])),
            ("block_size".into(), 16.into()),
        ])]),
    ]));
    let mut bytes = message(1, &garbled);
    // Then a message whose seq frame is 4 bytes: not [topic, seq (8 bytes), payload].
    frame(true, b"", &mut bytes);
    frame(true, &[0, 0, 0, 2], &mut bytes);
    frame(false, &stored(9), &mut bytes);
    // Then good batches, in sequence after the undecodable one.
    bytes.extend_from_slice(&message(2, &stored(1)));
    bytes.extend_from_slice(&message(3, &stored(2)));
    publisher.write_all(&bytes).await.unwrap();

    eventually("the batches after them", &sub, || {
        status(&sub, engine).last_seq == Some(3)
    })
    .await;
    let s = status(&sub, engine);
    let count = |why| s.malformed.get(&(SocketKind::Events, why)).copied();
    assert_eq!(count(Malformed::Undecodable), Some(1), "{s:?}");
    assert_eq!(count(Malformed::Shape), Some(1), "{s:?}");
    assert_eq!(s.malformed.len(), 2, "{s:?}");
    assert_eq!(
        (s.batches, s.decode_errors, s.drops, s.gaps),
        (3, 2, 2, 0),
        "{s:?}"
    );
    // The entries before the undecodable batch were dropped, the ones after kept;
    // the message of the wrong shape applied nothing.
    assert_eq!(index.cached_tokens(engine, &prompt(0)), 0);
    assert_eq!(index.cached_tokens(engine, &prompt(1)), 16);
    assert_eq!(index.cached_tokens(engine, &prompt(2)), 16);
    assert_eq!(index.cached_tokens(engine, &prompt(9)), 0);
    // On the same subscription: no reconnection, none asked for.
    assert!(s.connected && s.resubscribes == 0, "{s:?}");
    publisher.write_all(&message(4, &stored(3))).await.unwrap();
    eventually("a batch after the check", &sub, || {
        index.cached_tokens(engine, &prompt(3)) == 16
    })
    .await;
    let again = tokio::time::timeout(Duration::from_millis(50), events.accept()).await;
    assert!(again.is_err(), "the subscriber connected again");
    sub.shutdown().await;
}

/// One message from a peer: its data frames (commands, READY included, skipped).
async fn read_message(s: &mut TcpStream) -> Vec<Vec<u8>> {
    let mut frames = Vec::new();
    loop {
        let flags = s.read_u8().await.unwrap();
        let len = if flags & 0x02 != 0 {
            usize::try_from(s.read_u64().await.unwrap()).unwrap()
        } else {
            usize::from(s.read_u8().await.unwrap())
        };
        let mut body = vec![0u8; len];
        s.read_exact(&mut body).await.unwrap();
        if flags & 0x04 != 0 {
            continue;
        }
        frames.push(body);
        if flags & 0x01 == 0 {
            return frames;
        }
    }
}

/// Plays an engine's replay `ROUTER` for one request: accepts the `DEALER`, greets,
/// reads its greeting and its request `[empty, start seq]`. The connection and the
/// start.
async fn replay_request(replay: &TcpListener) -> (TcpStream, u64) {
    let (mut s, _) = tokio::time::timeout(WAIT, replay.accept())
        .await
        .expect("the subscriber asks for a replay in time")
        .unwrap();
    s.write_all(&hello("ROUTER")).await.unwrap();
    let mut greeting = [0u8; 64];
    s.read_exact(&mut greeting).await.unwrap();
    let request = read_message(&mut s).await;
    assert_eq!(request.len(), 2, "{request:?}");
    assert!(request[0].is_empty(), "an empty delimiter first");
    let start = u64::from_be_bytes(request[1].as_slice().try_into().unwrap());
    (s, start)
}

/// A message of `frames`, as a `ROUTER` sends it to a `DEALER` (its identity frame
/// already stripped).
fn multipart(frames: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, f) in frames.iter().enumerate() {
        frame(i + 1 < frames.len(), f, &mut out);
    }
    out
}

/// The replay end marker's sequence number: -1 as 8 big-endian bytes.
const END_SEQ: [u8; 8] = [0xff; 8];

/// The subscriber of one engine at `events_at`, with `replay_at` if any.
async fn follow(
    engine: &str,
    events_at: String,
    replay_at: Option<String>,
    config: SubscriberConfig,
) -> (Arc<KvIndex>, Subscriber) {
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    let sub = Subscriber::new(index.clone(), config);
    let mut endpoint = EngineEndpoint::new(engine, events_at).unwrap();
    if let Some(replay_at) = replay_at {
        endpoint = endpoint.with_replay(replay_at).unwrap();
    }
    sub.set_endpoints(vec![endpoint]).await;
    (index, sub)
}

/// vLLM's and SGLang's replay `ROUTER` answers each batch as `[identity, "", seq,
/// payload]`, so the `DEALER` receives three frames, `[empty, seq, payload]`, not
/// four with a topic. Read only in the four-frame form, such an answer was malformed:
/// the replay failed and the gap dropped the rank's entries. Now the gap is filled
/// and nothing is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_replayed_from_answers_without_a_topic_frame() {
    let (events, events_at) = listener().await;
    let (replay, replay_at) = listener().await;
    let engine = "http://vllm-replay:8000";
    let (index, sub) = follow(engine, events_at, Some(replay_at), subscriber_config()).await;
    let mut publisher = subscribed(&events).await;
    publisher.write_all(&message(0, &stored(0))).await.unwrap();
    eventually("block 0", &sub, || {
        index.cached_tokens(engine, &prompt(0)) == 16
    })
    .await;
    // seq 1 lost: seq 2 arrives, and the gap is asked for.
    publisher.write_all(&message(2, &stored(2))).await.unwrap();
    let (mut router, start) = replay_request(&replay).await;
    assert_eq!(start, 1);
    router
        .write_all(&multipart(&[b"", &1u64.to_be_bytes(), &stored(1)]))
        .await
        .unwrap();
    router
        .write_all(&multipart(&[b"", &END_SEQ, b""]))
        .await
        .unwrap();
    eventually("seq 2 applied", &sub, || {
        status(&sub, engine).last_seq == Some(2)
    })
    .await;
    let s = status(&sub, engine);
    for n in 0..=2 {
        assert_eq!(
            index.cached_tokens(engine, &prompt(n)),
            16,
            "block {n}: {s:?}"
        );
    }
    assert_eq!(
        (s.gaps, s.replayed, s.drops, s.replay_failures),
        (1, 1, 0, 0),
        "{s:?}"
    );
    assert!(s.malformed.is_empty(), "{s:?}");
    sub.shutdown().await;
}

/// Older vLLM ended a replay with `[identity, "", ""]`: the `DEALER` receives
/// `[empty, empty]`. It ends the replay (the answer is held open after it, and the
/// replay timeout is long: only the marker lets the live batch through in time), and
/// is not counted as malformed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_two_frame_end_marker_ends_a_replay() {
    let (events, events_at) = listener().await;
    let (replay, replay_at) = listener().await;
    let engine = "http://old-vllm-replay:8000";
    let config = SubscriberConfig {
        replay_timeout: Duration::from_secs(60),
        ..subscriber_config()
    };
    let (index, sub) = follow(engine, events_at, Some(replay_at), config).await;
    let mut publisher = subscribed(&events).await;
    // The first batch seen is seq 3: the history before it is caught up on.
    publisher.write_all(&message(3, &stored(3))).await.unwrap();
    let (mut router, start) = replay_request(&replay).await;
    assert_eq!(start, 0);
    // The engine's buffer holds seq 1 only (0 and 2 are gone), then the end.
    router
        .write_all(&multipart(&[b"", &1u64.to_be_bytes(), &stored(1)]))
        .await
        .unwrap();
    router.write_all(&multipart(&[b"", b""])).await.unwrap();
    eventually("seq 3 applied", &sub, || {
        status(&sub, engine).last_seq == Some(3)
    })
    .await;
    let s = status(&sub, engine);
    assert_eq!(index.cached_tokens(engine, &prompt(1)), 16, "{s:?}");
    assert_eq!(index.cached_tokens(engine, &prompt(3)), 16, "{s:?}");
    assert_eq!((s.replayed, s.drops, s.replay_failures), (1, 0, 0), "{s:?}");
    assert!(s.malformed.is_empty(), "{s:?}");
    drop(router);
    sub.shutdown().await;
}

/// A catch-up replay (the first batch after subscribing is past 0) that applies batch
/// 0 and then stalls: the batches after it were never applied, so their removals are
/// unknown. Before, batch 0's entries stayed and the live batch was applied on top
/// (a partial history, silently); now the failed replay drops the rank's entries and
/// counts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_catch_up_replay_leaves_no_partial_history() {
    let (events, events_at) = listener().await;
    let (replay, replay_at) = listener().await;
    let engine = "http://stalling-replay:8000";
    let (index, sub) = follow(engine, events_at, Some(replay_at), subscriber_config()).await;
    let mut publisher = subscribed(&events).await;
    publisher.write_all(&message(2, &stored(2))).await.unwrap();
    let (mut router, start) = replay_request(&replay).await;
    assert_eq!(start, 0);
    // Batch 0 (block 0), then nothing: batch 1 (which might remove it) never comes.
    router
        .write_all(&multipart(&[b"", b"", &0u64.to_be_bytes(), &stored(0)]))
        .await
        .unwrap();
    eventually("seq 2 applied", &sub, || {
        status(&sub, engine).last_seq == Some(2)
    })
    .await;
    let s = status(&sub, engine);
    assert_eq!(index.cached_tokens(engine, &prompt(0)), 0, "{s:?}");
    assert_eq!(index.cached_tokens(engine, &prompt(2)), 16, "{s:?}");
    assert_eq!((s.drops, s.replay_failures), (1, 1), "{s:?}");
    drop(router);
    sub.shutdown().await;
}

/// A catch-up replay that fails before applying anything leaves nothing to drop: it is
/// counted as a failed replay, not as a drop (a drop the caller just made, after a
/// resubscription past a gap, is not counted twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catch_up_replay_that_applied_nothing_counts_no_drop() {
    let (events, events_at) = listener().await;
    let (replay, replay_at) = listener().await;
    let engine = "http://empty-replay:8000";
    let (index, sub) = follow(engine, events_at, Some(replay_at), subscriber_config()).await;
    let mut publisher = subscribed(&events).await;
    publisher.write_all(&message(2, &stored(2))).await.unwrap();
    let (router, start) = replay_request(&replay).await;
    assert_eq!(start, 0);
    // The replay socket goes away without answering.
    drop(router);
    eventually("seq 2 applied", &sub, || {
        status(&sub, engine).last_seq == Some(2)
    })
    .await;
    let s = status(&sub, engine);
    assert_eq!(index.cached_tokens(engine, &prompt(2)), 16, "{s:?}");
    assert_eq!((s.drops, s.replay_failures), (0, 1), "{s:?}");
    sub.shutdown().await;
}

/// A publisher that disappears (its port refuses connections): before, the rank's
/// entries steered requests for as long as the proxy ran. Now they are dropped once the
/// rank has been without a subscription past the grace, and when the publisher comes
/// back the rank starts afresh (its seq 0 is not taken for a restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_gone_past_the_grace_has_its_entries_dropped() {
    let (events, events_at) = listener().await;
    let addr = events.local_addr().unwrap();
    let engine = "http://vanished:8000";
    let config = SubscriberConfig {
        connect_timeout: Duration::from_millis(200),
        disconnected_grace: Duration::from_millis(300),
        ..SubscriberConfig::default()
    };
    let (index, sub) = follow(engine, events_at, None, config).await;
    let mut publisher = subscribed(&events).await;
    publisher.write_all(&message(0, &stored(0))).await.unwrap();
    publisher.write_all(&message(1, &stored(1))).await.unwrap();
    eventually("blocks 0 and 1", &sub, || {
        index.cached_tokens(engine, &prompt(1)) == 16
    })
    .await;
    // Gone: the connection closed and nothing listens on the port any more.
    drop(publisher);
    drop(events);
    eventually("the entries dropped", &sub, || {
        index.cached_tokens(engine, &prompt(0)) == 0 && index.cached_tokens(engine, &prompt(1)) == 0
    })
    .await;
    let s = status(&sub, engine);
    assert_eq!((s.expiries, s.drops), (1, 1), "{s:?}");
    assert!(!s.connected, "{s:?}");

    // Back on the same port, numbering from 0 again: followed as a new subscription.
    let again = tokio::net::TcpSocket::new_v4().unwrap();
    again.set_reuseaddr(true).unwrap();
    again.bind(addr).unwrap();
    let events = again.listen(16).unwrap();
    let mut publisher = subscribed(&events).await;
    publisher.write_all(&message(0, &stored(5))).await.unwrap();
    eventually("block 5", &sub, || {
        index.cached_tokens(engine, &prompt(5)) == 16
    })
    .await;
    let s = status(&sub, engine);
    assert_eq!((s.restarts, s.expiries, s.drops), (0, 1, 1), "{s:?}");
    sub.shutdown().await;
}

/// A message that is not `[topic, seq, payload]` (here two frames) is a lost batch as
/// much as an undecodable one: the rank's entries are dropped, as docs/reliability.md
/// says. Before, it was counted and skipped, the entries kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_of_the_wrong_shape_drops_the_ranks_entries() {
    let (events, events_at) = listener().await;
    let engine = "http://two-frames:8000";
    let (index, sub) = follow(engine, events_at, None, subscriber_config()).await;
    let mut publisher = subscribed(&events).await;
    publisher.write_all(&message(0, &stored(0))).await.unwrap();
    eventually("block 0", &sub, || {
        index.cached_tokens(engine, &prompt(0)) == 16
    })
    .await;
    let mut bytes = multipart(&[b"", &stored(9)]);
    bytes.extend_from_slice(&message(1, &stored(1)));
    publisher.write_all(&bytes).await.unwrap();
    eventually("seq 1 applied", &sub, || {
        status(&sub, engine).last_seq == Some(1)
    })
    .await;
    let s = status(&sub, engine);
    assert_eq!(index.cached_tokens(engine, &prompt(0)), 0, "{s:?}");
    assert_eq!(index.cached_tokens(engine, &prompt(9)), 0, "{s:?}");
    assert_eq!(index.cached_tokens(engine, &prompt(1)), 16, "{s:?}");
    assert_eq!(
        s.malformed.get(&(SocketKind::Events, Malformed::Shape)),
        Some(&1),
        "{s:?}"
    );
    assert_eq!((s.decode_errors, s.drops), (1, 1), "{s:?}");
    sub.shutdown().await;
}

/// A publisher that accepts the TCP connection and never greets: each attempt ends at
/// the handshake timeout (the connect timeout) and is counted with reason `timeout`,
/// as docs/security.md says. Before, it was taken for "nobody there" and not counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_that_never_greets_is_counted_as_a_timeout() {
    let (mute, mute_at) = listener().await;
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = mute.accept().await {
            held.push(s);
        }
    });
    let engine = "http://mute:8000";
    let config = SubscriberConfig {
        connect_timeout: Duration::from_millis(100),
        ..SubscriberConfig::default()
    };
    let (_index, sub) = follow(engine, mute_at, None, config).await;
    eventually("a timeout counted", &sub, || {
        status(&sub, engine)
            .malformed
            .iter()
            .any(|((socket, why), n)| {
                *socket == SocketKind::Events && why.as_str() == "timeout" && *n >= 1
            })
    })
    .await;
    let s = status(&sub, engine);
    assert!(!s.connected, "{s:?}");
    sub.shutdown().await;
}

/// Blocks the index skips (here, a block size other than the rank's) are counted in
/// the rank's status; before, `Applied::skipped` was thrown away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skipped_blocks_are_counted() {
    let (events, events_at) = listener().await;
    let engine = "http://two-sizes:8000";
    let (index, sub) = follow(engine, events_at, None, subscriber_config()).await;
    let mut publisher = subscribed(&events).await;
    // Block 0 at 16 tokens per block, then two blocks of 8 tokens: skipped.
    let halves = encode(&Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![Value::Map(vec![
            ("type".into(), "BlockStored".into()),
            (
                "block_hashes".into(),
                Value::Array(vec![7.into(), 8.into()]),
            ),
            ("parent_block_hash".into(), Value::Nil),
            (
                "token_ids".into(),
                Value::Array(block(3).into_iter().map(Value::from).collect()),
            ),
            ("block_size".into(), 8.into()),
        ])]),
    ]));
    let mut bytes = message(0, &stored(0));
    bytes.extend_from_slice(&message(1, &halves));
    publisher.write_all(&bytes).await.unwrap();
    eventually("seq 1 applied", &sub, || {
        status(&sub, engine).last_seq == Some(1)
    })
    .await;
    let s = status(&sub, engine);
    assert_eq!((s.batches, s.skipped_blocks), (2, 2), "{s:?}");
    assert_eq!(index.cached_tokens(engine, &prompt(0)), 16);
    sub.shutdown().await;
}

/// A publisher that is back only in name: it accepts and greets, then sends a frame
/// over the ceiling each time. No subscription lives past its first message, so the
/// rank has been without one since the last good one, and its entries go after the
/// grace as if the port refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_failing_every_subscription_has_its_entries_dropped() {
    let (events, events_at) = listener().await;
    let engine = "http://bombing:8000";
    // Pauses between attempts that never reach the grace: only the time since the
    // last good subscription can expire the entries.
    let config = SubscriberConfig {
        connect_timeout: Duration::from_millis(100),
        max_backoff: Duration::from_millis(100),
        disconnected_grace: Duration::from_millis(500),
        ..SubscriberConfig::default()
    };
    let (index, sub) = follow(engine, events_at, None, config).await;
    let mut publisher = subscribed(&events).await;
    publisher.write_all(&message(0, &stored(0))).await.unwrap();
    eventually("block 0", &sub, || {
        index.cached_tokens(engine, &prompt(0)) == 16
    })
    .await;
    drop(publisher);
    tokio::spawn(async move {
        loop {
            let mut s = subscribed(&events).await;
            // A long frame announcing 1 TiB.
            let mut bomb = vec![0x02];
            bomb.extend_from_slice(&(1u64 << 40).to_be_bytes());
            let _ = s.write_all(&bomb).await;
        }
    });
    eventually("the entries dropped", &sub, || {
        index.cached_tokens(engine, &prompt(0)) == 0
    })
    .await;
    let s = status(&sub, engine);
    assert_eq!((s.expiries, s.drops), (1, 1), "{s:?}");
    assert!(
        s.malformed.get(&(SocketKind::Events, Malformed::Oversized)) >= Some(&1),
        "{s:?}"
    );
    sub.shutdown().await;
}

/// The grace counts the time without a subscription, not the time without a message:
/// an idle engine whose subscription stayed up past the grace and was then closed
/// (no message on it) is subscribed to again at once and keeps its entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_subscription_closed_after_the_grace_keeps_the_entries() {
    let (events, events_at) = listener().await;
    let engine = "http://idle:8000";
    let grace = Duration::from_millis(300);
    let config = SubscriberConfig {
        connect_timeout: Duration::from_millis(100),
        disconnected_grace: grace,
        ..SubscriberConfig::default()
    };
    let (index, sub) = follow(engine, events_at, None, config).await;
    let mut publisher = subscribed(&events).await;
    publisher.write_all(&message(0, &stored(0))).await.unwrap();
    eventually("block 0", &sub, || {
        index.cached_tokens(engine, &prompt(0)) == 16
    })
    .await;
    drop(publisher);
    // Subscribed again; idle twice the grace, then closed.
    let idle = subscribed(&events).await;
    tokio::time::sleep(2 * grace).await;
    drop(idle);
    let mut publisher = subscribed(&events).await;
    publisher.write_all(&message(1, &stored(1))).await.unwrap();
    eventually("block 1", &sub, || {
        index.cached_tokens(engine, &prompt(1)) == 16
    })
    .await;
    let s = status(&sub, engine);
    assert_eq!(index.cached_tokens(engine, &prompt(0)), 16, "{s:?}");
    assert_eq!((s.expiries, s.drops, s.resubscribes), (0, 0, 2), "{s:?}");
    sub.shutdown().await;
}
