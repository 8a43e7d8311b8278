//! The concurrent P/D protocols (SGLang bootstrap rooms, vLLM Mooncake
//! transfer ids) driven by hand like a router would: both legs sent at once,
//! over real loopback sockets.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use disagg_sim::{Faults, KvMode, SimConfig, SimEngine, SimRole};
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";
/// The bootstrap timeout of most engines here, so that failures are quick.
const WAIT: Duration = Duration::from_millis(300);

const SGLANG_P: KvMode = KvMode::Sglang(SimRole::Prefill);
const SGLANG_D: KvMode = KvMode::Sglang(SimRole::Decode);
const MOONCAKE_P: KvMode = KvMode::Mooncake(SimRole::Prefill);
const MOONCAKE_D: KvMode = KvMode::Mooncake(SimRole::Decode);

// 36 words: 3 blocks of 16 tokens.
const PROMPT: &str = "the quick brown fox jumps over the lazy dog and then some more words follow \
    so that the prompt spans several blocks of sixteen tokens each which is what we want here \
    to test block lists";

async fn engine(kv_mode: KvMode, tweak: impl FnOnce(&mut SimConfig)) -> SimEngine {
    let mut config = SimConfig {
        kv_mode,
        bootstrap_timeout: WAIT,
        ..SimConfig::default()
    };
    tweak(&mut config);
    SimEngine::start(config).await.unwrap()
}

async fn plain() -> SimEngine {
    SimEngine::start(SimConfig::default()).await.unwrap()
}

fn chat(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": "sim-model", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens})
}

fn completion(prompt: Value, max_tokens: u32) -> Value {
    json!({"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens})
}

/// Per choice: the whole text and the finish reason, from a plain or a
/// streamed answer.
fn outputs(reply: &Reply) -> Vec<(String, String)> {
    assert_eq!(reply.status, 200, "{}", reply.text());
    let streamed = reply
        .headers
        .get("content-type")
        .is_some_and(|v| v.to_str().unwrap().starts_with("text/event-stream"));
    let text_of = |c: &Value| {
        c.pointer("/message/content")
            .or_else(|| c.pointer("/delta/content"))
            .or_else(|| c.get("text"))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let mut out: BTreeMap<u64, (String, String)> = BTreeMap::new();
    let events = if streamed {
        let events = reply.events();
        assert_eq!(events.last(), Some(&json!("[DONE]")));
        events
    } else {
        vec![reply.json()]
    };
    for event in events.iter().filter(|e| e.is_object()) {
        for c in event["choices"].as_array().unwrap() {
            let entry = out.entry(c["index"].as_u64().unwrap()).or_default();
            entry.0.push_str(&text_of(c));
            if let Some(f) = c["finish_reason"].as_str() {
                entry.1 = f.to_owned();
            }
        }
    }
    out.into_values().collect()
}

fn assert_kv_failure(reply: &Reply, why: &str) {
    assert_eq!(reply.status, 500, "{}", reply.text());
    let message = reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.starts_with("KV transfer failed") && message.contains(why),
        "{message:?} does not say {why:?}"
    );
}

fn assert_bad_request(reply: &Reply, why: &str) {
    assert_eq!(reply.status, 400, "{}", reply.text());
    let message = reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(message.contains(why), "{message:?} does not say {why:?}");
}

/// Sends both legs at once (chat).
async fn both(p: SocketAddr, p_body: Value, d: SocketAddr, d_body: Value) -> (Reply, Reply) {
    tokio::join!(post(p, CHAT, &p_body), post(d, CHAT, &d_body))
}

// ---------------------------------------------------------------- SGLang

async fn sglang_pair() -> (SimEngine, SimEngine) {
    (
        engine(SGLANG_P, |_| {}).await,
        engine(SGLANG_D, |_| {}).await,
    )
}

/// `body` with the bootstrap fields of the SGLang router: scalars for a
/// single room, lists for a list of rooms.
fn with_rooms(mut body: Value, host: &str, port: u16, rooms: Value) -> Value {
    match &rooms {
        Value::Array(r) => {
            body["bootstrap_host"] = json!(vec![host; r.len()]);
            body["bootstrap_port"] = json!(vec![port; r.len()]);
        }
        _ => {
            body["bootstrap_host"] = json!(host);
            body["bootstrap_port"] = json!(port);
        }
    }
    body["bootstrap_room"] = rooms;
    body
}

fn sglang_body(body: Value, p: &SimEngine, rooms: Value) -> Value {
    with_rooms(body, "127.0.0.1", p.bootstrap_addr().unwrap().port(), rooms)
}

/// Sends `body` to both legs at once; the decode answers exactly like a
/// plain engine, the prefill with the first token of each choice.
async fn sglang_roundtrip(
    p: &SimEngine,
    d: &SimEngine,
    plain: &SimEngine,
    path: &str,
    body: &Value,
) {
    let (pr, dr) = tokio::join!(post(p.addr(), path, body), post(d.addr(), path, body));
    let direct = post(plain.addr(), path, body).await;
    assert_eq!(outputs(&dr), outputs(&direct));
    let mut first = body.clone();
    first["max_tokens"] = json!(1);
    let first = post(plain.addr(), path, &first).await;
    assert_eq!(outputs(&pr), outputs(&first));
    if body["stream"] != json!(true) {
        assert_eq!(dr.json()["usage"], direct.json()["usage"]);
    }
}

#[tokio::test]
async fn sglang_pair_answers_like_a_plain_engine() {
    let (p, d) = sglang_pair().await;
    let plain = plain().await;
    let mut room = 1u64 << 62;
    for stream in [false, true] {
        for (path, body) in [
            (CHAT, chat(PROMPT, 6)),
            (COMPLETIONS, completion(json!(PROMPT), 5)),
        ] {
            let mut body = sglang_body(body, &p, json!(room));
            body["stream"] = json!(stream);
            sglang_roundtrip(&p, &d, &plain, path, &body).await;
            room += 1;
        }
    }
    let (ps, ds) = (p.stats(), d.stats());
    assert_eq!(
        (
            ps.prefill_requests,
            ps.local_prefills,
            ps.side_channel_served,
            ps.kv_transfers_pending
        ),
        (4, 4, 4, 0)
    );
    assert_eq!(
        (ds.remote_decodes, ds.local_prefills, ds.kv_pull_failures),
        (4, 0, 0)
    );
    assert_eq!(ps.bootstrap_timeouts + ds.bootstrap_timeouts, 0);
    assert_eq!(ps.cancelled + ds.cancelled, 0);
}

#[tokio::test]
async fn sglang_batches_take_one_room_per_element() {
    let (p, d) = sglang_pair().await;
    let plain = plain().await;
    for stream in [false, true] {
        let base = if stream { 100 } else { 200 };
        // Samples of a prompt share its room inside SGLang 0.5.23, whatever rooms the
        // request carries: refused on both sides, nothing registered.
        let mut body = chat(PROMPT, 4);
        body["n"] = json!(3);
        body["stream"] = json!(stream);
        let body = sglang_body(body, &p, json!([base, base + 1, base + 2]));
        for e in [&p, &d] {
            assert_kv_failure(
                &post(e.addr(), CHAT, &body).await,
                "Duplicate or cancelled bootstrap room",
            );
        }

        let mut body = completion(json!(["one two three", PROMPT]), 4);
        body["stream"] = json!(stream);
        let body = sglang_body(body, &p, json!([base + 10, base + 11]));
        sglang_roundtrip(&p, &d, &plain, COMPLETIONS, &body).await;
    }
    assert_eq!(p.stats().side_channel_served, 4);
    assert_eq!(p.stats().kv_transfers_pending, 0);
    assert_eq!(d.stats().remote_decodes, 2);

    // A batch of one is a batch: lists of one.
    let body = sglang_body(completion(json!(["just one"]), 3), &p, json!([300]));
    sglang_roundtrip(&p, &d, &plain, COMPLETIONS, &body).await;
    // Token ids are one prompt, not a batch.
    let body = sglang_body(completion(json!([1, 2, 3]), 3), &p, json!(301));
    sglang_roundtrip(&p, &d, &plain, COMPLETIONS, &body).await;
}

#[tokio::test]
async fn sglang_bootstrap_fields_are_validated() {
    let (p, d) = sglang_pair().await;
    let single = chat(PROMPT, 4);
    for e in [&p, &d] {
        let r = post(e.addr(), CHAT, &single).await;
        assert_bad_request(&r, "bootstrap_room is required in disaggregation mode");
    }
    let mut no_host = single.clone();
    no_host["bootstrap_room"] = json!(1);
    assert_bad_request(&post(d.addr(), CHAT, &no_host).await, "bootstrap_host");

    let cases = [
        (
            sglang_body(single.clone(), &p, json!([1])),
            "single request",
        ),
        (sglang_body(single.clone(), &p, json!(u64::MAX)), "2^63"),
        (
            with_rooms(single.clone(), "127.0.0.1", 0, json!(1)),
            "bootstrap_port",
        ),
    ];
    for (body, why) in cases {
        for e in [&p, &d] {
            assert_bad_request(&post(e.addr(), CHAT, &body).await, why);
        }
    }

    let mut batch = chat(PROMPT, 4);
    batch["n"] = json!(2);
    // SGLang repeats a list once per sample and takes what it needs: one room for two
    // samples is the same room twice, which collides.
    let cases = [
        (sglang_body(batch.clone(), &p, json!([1])), "twice"),
        (sglang_body(batch.clone(), &p, json!([5, 5])), "twice"),
    ];
    for (body, why) in cases {
        for e in [&p, &d] {
            assert_bad_request(&post(e.addr(), CHAT, &body).await, why);
        }
    }
    // Two prompts sampled twice are four requests: a room per prompt repeats.
    let mut prompts = completion(json!(["one two", PROMPT]), 3);
    prompts["n"] = json!(2);
    let cases = [
        (sglang_body(prompts.clone(), &p, json!([7, 8])), "twice"),
        (
            sglang_body(completion(json!(["a", "b", "c"]), 3), &p, json!([7, 8])),
            "got 2",
        ),
    ];
    for (body, why) in cases {
        for e in [&p, &d] {
            assert_bad_request(&post(e.addr(), COMPLETIONS, &body).await, why);
        }
    }
    // A single host for a list of rooms is every request's host, as SGLang expands
    // it: the decode asks it for both rooms (which no prefill registered here).
    let mut mixed = sglang_body(completion(json!(["a", "b"]), 3), &p, json!([1, 2]));
    mixed["bootstrap_host"] = json!("127.0.0.1");
    let r = post(d.addr(), COMPLETIONS, &mixed).await;
    assert_eq!(r.status, 500, "{}", r.text());
    assert!(r.text().contains("no prefill for room"), "{}", r.text());
    assert_eq!(p.stats().kv_transfers_pending, 0);
    assert_eq!(p.stats().prefill_requests, 0);
}

#[tokio::test]
async fn sglang_null_port_means_8998() {
    let d = engine(SGLANG_D, |_| {}).await;
    let mut body = chat(PROMPT, 4);
    body["bootstrap_host"] = json!("127.0.0.1");
    body["bootstrap_port"] = Value::Null;
    body["bootstrap_room"] = json!(1);
    // Nothing to take there: refused, or not a bootstrap server, or no such room.
    let r = post(d.addr(), CHAT, &body).await;
    assert_sglang_transfer_failed(&r, "");
    let message = sglang_error_message(&r);
    assert!(
        message.contains("127.0.0.1:8998") || message.contains("no prefill for room 1"),
        "{message}"
    );
}

#[tokio::test]
async fn sglang_wrong_peer_fails_the_transfer() {
    let (p, d) = sglang_pair().await;
    let port = p.bootstrap_addr().unwrap().port();
    let (unused, _held) = unused_port();
    let body = |room: u64, port: u16| with_rooms(chat(PROMPT, 4), "127.0.0.1", port, json!(room));
    let other_prompt = with_rooms(chat("another prompt", 4), "127.0.0.1", port, json!(5));

    let start = Instant::now();
    let (pa, da) = (p.addr(), d.addr());
    let (wrong_host, wrong_port, wrong_room, wrong_kv) = tokio::join!(
        // Nobody listens where the decode looks.
        both(pa, body(1, port), da, body(1, unused)),
        // Something listens, but not a bootstrap server.
        both(pa, body(2, port), da, body(2, pa.port())),
        both(pa, body(3, port), da, body(4, port)),
        both(pa, body(5, port), da, other_prompt),
    );
    assert!(start.elapsed() < Duration::from_millis(1500));
    assert_sglang_transfer_failed(
        &wrong_host.1,
        &format!("cannot reach bootstrap server 127.0.0.1:{unused}"),
    );
    assert_sglang_transfer_failed(&wrong_host.0, "no decode took room 1 within 300ms");
    assert_sglang_transfer_failed(&wrong_port.1, "not an SGLang bootstrap server");
    assert_sglang_transfer_failed(&wrong_port.0, "no decode took room 2");
    assert_sglang_transfer_failed(&wrong_room.1, "no prefill for room 4");
    assert_sglang_transfer_failed(&wrong_room.0, "no decode took room 3");
    assert_sglang_transfer_failed(&wrong_kv.1, "do not match the prompt");
    assert_eq!(wrong_kv.0.status, 200, "{}", wrong_kv.0.text());

    let (ps, ds) = (p.stats(), d.stats());
    assert_eq!(ps.kv_transfers_pending, 0);
    assert!(ps.bootstrap_timeouts >= 3, "{ps:?}");
    assert_eq!(
        (
            ds.kv_pull_failures,
            ds.remote_decodes,
            ds.bootstrap_timeouts
        ),
        (4, 0, 1)
    );
    assert_eq!(ps.active_requests + ds.active_requests, 0);
}

#[tokio::test]
async fn sglang_room_is_taken_once_and_registered_once() {
    let (p, d) = sglang_pair().await;
    let body = sglang_body(chat(PROMPT, 4), &p, json!(42));
    // Two prefills for one room: the second is refused.
    let first = tokio::spawn({
        let body = body.clone();
        let addr = p.addr();
        async move { post(addr, CHAT, &body).await }
    });
    wait_for(&p, |s| s.kv_transfers_pending == 1).await;
    let second = post(p.addr(), CHAT, &body).await;
    assert_eq!(second.status, 409, "{}", second.text());
    assert!(second.text().contains("already registered"));
    // One decode takes it, the next finds nothing.
    assert_eq!(post(d.addr(), CHAT, &body).await.status, 200);
    assert_eq!(first.await.unwrap().status, 200);
    assert_sglang_transfer_failed(&post(d.addr(), CHAT, &body).await, "no prefill for room 42");
    assert_eq!(p.stats().kv_transfers_pending, 0);
}

#[tokio::test]
async fn sglang_prefill_client_leaving_withdraws_its_rooms() {
    let p = engine(SGLANG_P, |c| c.bootstrap_timeout = Duration::from_secs(5)).await;
    let d = engine(SGLANG_D, |_| {}).await;
    let body = completion(json!(["one two", PROMPT]), 4);
    let body = sglang_body(body, &p, json!([7, 8]));
    let stream = raw_post(p.addr(), COMPLETIONS, &[], &body).await;
    wait_for(&p, |s| s.kv_transfers_pending == 2).await;
    drop(stream);
    let s = wait_for(&p, |s| s.active_requests == 0).await;
    assert_eq!((s.cancelled, s.kv_transfers_pending), (1, 0));
    // The rooms are gone.
    assert_sglang_transfer_failed(
        &post(d.addr(), COMPLETIONS, &body).await,
        "no prefill for room",
    );
}

#[tokio::test]
async fn sglang_decode_client_leaving_abandons_the_wait() {
    let p = engine(SGLANG_P, |c| c.bootstrap_timeout = Duration::from_secs(5)).await;
    let d = engine(SGLANG_D, |c| c.bootstrap_timeout = Duration::from_secs(5)).await;
    let body = sglang_body(chat(PROMPT, 4), &p, json!(9));
    let stream = raw_post(d.addr(), CHAT, &[], &body).await;
    wait_for(&d, |s| s.active_requests == 1).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let left = Instant::now();
    drop(stream);
    let s = wait_for(&d, |s| s.active_requests == 0).await;
    assert!(left.elapsed() < Duration::from_millis(500));
    assert_eq!((s.cancelled, s.kv_pull_failures), (1, 0));

    // The abandoned wait takes nothing: the room, registered now, waits for
    // a decode that is still there.
    let prefill = tokio::spawn({
        let body = body.clone();
        let addr = p.addr();
        async move { post(addr, CHAT, &body).await }
    });
    wait_for(&p, |s| s.kv_transfers_pending == 1).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(p.stats().kv_transfers_pending, 1);
    assert_eq!(post(d.addr(), CHAT, &body).await.status, 200);
    assert_eq!(prefill.await.unwrap().status, 200);
    assert_eq!(p.stats().kv_transfers_pending, 0);
}

#[tokio::test]
async fn sglang_decode_aborted_before_taking_leaves_the_room_to_the_prefill_timeout() {
    let p = engine(SGLANG_P, |c| c.bootstrap_timeout = Duration::from_secs(1)).await;
    let d = engine(SGLANG_D, |c| {
        c.bootstrap_timeout = Duration::from_secs(5);
        c.request_delay = Duration::from_millis(300);
    })
    .await;
    let body = sglang_body(chat(PROMPT, 4), &p, json!(11));
    let started = Instant::now();
    let prefill = tokio::spawn({
        let body = body.clone();
        let addr = p.addr();
        async move { post(addr, CHAT, &body).await }
    });
    let s = wait_for(&p, |s| s.kv_transfers_pending == 1).await;
    assert_eq!(s.blocks_held, 3);

    let stream = raw_post(d.addr(), CHAT, &[], &body).await;
    wait_for(&d, |s| s.active_requests == 1).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(stream);
    let ds = wait_for(&d, |s| s.active_requests == 0).await;
    assert_eq!(
        (ds.cancelled, ds.kv_pull_failures, ds.kv_releases_sent),
        (1, 0, 0)
    );
    // Nothing tells the prefill: it keeps the room and its blocks...
    tokio::time::sleep(Duration::from_millis(100)).await;
    let s = p.stats();
    assert_eq!((s.kv_transfers_pending, s.blocks_held), (1, 3));
    // ... until its own request gives up waiting.
    assert_sglang_transfer_failed(&prefill.await.unwrap(), "no decode took room 11");
    assert!(started.elapsed() >= Duration::from_secs(1));
    let s = p.stats();
    assert_eq!(
        (
            s.kv_transfers_pending,
            s.blocks_held,
            s.bootstrap_timeouts,
            s.active_requests
        ),
        (0, 0, 1, 0)
    );
}

// -------------------------------------------------------------- Mooncake

/// The two legs of a Mooncake proxy: the prefill's body (max_tokens 1) and
/// the decode's.
fn mooncake_bodies(
    body: &Value,
    p: &SimEngine,
    engine_id: &str,
    transfer_id: &str,
) -> (Value, Value) {
    let mut prefill = body.clone();
    prefill["max_tokens"] = json!(1);
    prefill["kv_transfer_params"] = json!({
        "do_remote_decode": true, "do_remote_prefill": false, "transfer_id": transfer_id,
    });
    let mut decode = body.clone();
    decode["kv_transfer_params"] = json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_bootstrap_addr": format!("http://{}", p.bootstrap_addr().unwrap()),
        "remote_engine_id": engine_id,
        "transfer_id": transfer_id,
    });
    (prefill, decode)
}

#[tokio::test]
async fn mooncake_pair_answers_like_a_plain_engine() {
    let p = engine(MOONCAKE_P, |_| {}).await;
    let d = engine(MOONCAKE_D, |_| {}).await;
    let plain = plain().await;
    let mut n = 0;
    for stream in [false, true] {
        for (path, body) in [
            (CHAT, chat(PROMPT, 6)),
            (COMPLETIONS, completion(json!(["a b c", PROMPT]), 5)),
        ] {
            let mut body = body;
            body["stream"] = json!(stream);
            let (pb, db) = mooncake_bodies(&body, &p, p.engine_id(), &format!("xfer-{n}"));
            n += 1;
            let (pr, dr) = tokio::join!(post(p.addr(), path, &pb), post(d.addr(), path, &db));
            let direct = post(plain.addr(), path, &body).await;
            assert_eq!(outputs(&dr), outputs(&direct));
            assert_eq!(outputs(&pr).len(), outputs(&direct).len());
            if !stream {
                assert_eq!(pr.json()["kv_transfer_params"], Value::Null);
                assert_eq!(dr.json()["kv_transfer_params"], Value::Null);
                assert_eq!(dr.json()["usage"], direct.json()["usage"]);
            }
        }
    }
    let (ps, ds) = (p.stats(), d.stats());
    assert_eq!(
        (
            ps.prefill_requests,
            ps.side_channel_served,
            ps.kv_transfers_pending,
            ps.kv_params_returned
        ),
        (4, 4, 0, 0)
    );
    assert_eq!(
        (ds.remote_decodes, ds.local_prefills, ds.kv_pull_failures),
        (4, 0, 0)
    );
}

#[tokio::test]
async fn mooncake_decode_pulls_kv_held_before_it_came() {
    let p = engine(MOONCAKE_P, |_| {}).await;
    let d = engine(MOONCAKE_D, |_| {}).await;
    let (pb, db) = mooncake_bodies(&chat(PROMPT, 4), &p, p.engine_id(), "early");
    assert_eq!(post(p.addr(), CHAT, &pb).await.status, 200);
    assert_eq!(p.stats().kv_transfers_pending, 1);
    assert_eq!(post(d.addr(), CHAT, &db).await.status, 200);
    assert_eq!(p.stats().kv_transfers_pending, 0);
}

#[tokio::test]
async fn mooncake_query_lists_every_rank() {
    let p = engine(MOONCAKE_P, |c| {
        c.dp_size = 2;
        c.engine_id = Some("pf".into());
    })
    .await;
    assert_eq!(p.engine_ids(), ["pf_dp0", "pf_dp1"]);
    let bootstrap = p.bootstrap_addr().unwrap();
    let worker = format!("127.0.0.1:{}", p.side_channel_addr().port());
    let r = get(bootstrap, "/query").await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.json(),
        json!({
            "0": {"engine_id": "pf_dp0", "worker_addr": {"0": {"0": worker}}},
            "1": {"engine_id": "pf_dp1", "worker_addr": {"0": {"0": worker}}},
        })
    );
    assert_eq!(get(bootstrap, "/other").await.status, 404);

    // Only prefills of the concurrent protocols have a bootstrap server.
    assert!(engine(SGLANG_P, |_| {}).await.bootstrap_addr().is_some());
    for mode in [KvMode::Nixl, SGLANG_D, MOONCAKE_D] {
        let e = engine(mode, |_| {}).await;
        assert_eq!(e.bootstrap_addr(), None, "{mode:?}");
        assert_eq!(e.engine_ids(), [e.engine_id()]);
    }
}

#[tokio::test]
async fn mooncake_dp_rank_header_picks_the_engine_id() {
    let p = engine(MOONCAKE_P, |c| {
        c.dp_size = 2;
        c.kv_lease = WAIT;
    })
    .await;
    let d = engine(MOONCAKE_D, |_| {}).await;
    let ids = p.engine_ids();
    let send = |addr, headers: &'static [(&'static str, &'static str)], body: Value| async move {
        request(
            addr,
            "POST",
            CHAT,
            headers,
            Some(serde_json::to_vec(&body).unwrap()),
        )
        .await
    };

    // Held on rank 1, pulled with rank 1's engine id.
    let (pb, db) = mooncake_bodies(&chat(PROMPT, 4), &p, &ids[1], "t1");
    let (pr, dr) = tokio::join!(
        send(p.addr(), &[("X-data-parallel-rank", "1")], pb),
        send(d.addr(), &[], db)
    );
    assert_eq!((pr.status, dr.status), (200, 200), "{}", dr.text());

    // Held on rank 0, pulled with rank 1's engine id.
    let (pb, db) = mooncake_bodies(&chat(PROMPT, 4), &p, &ids[1], "t2");
    let (pr, dr) = tokio::join!(
        send(p.addr(), &[("X-data-parallel-rank", "0")], pb),
        send(d.addr(), &[], db)
    );
    assert_eq!(pr.status, 200);
    assert_kv_failure(&dr, "no prefill held transfer id \"t2\"");

    for rank in ["x", "2"] {
        let (pb, _) = mooncake_bodies(&chat(PROMPT, 4), &p, &ids[0], "t3");
        let headers = [("X-data-parallel-rank", rank)];
        let r = request(
            p.addr(),
            "POST",
            CHAT,
            &headers,
            Some(serde_json::to_vec(&pb).unwrap()),
        )
        .await;
        assert_bad_request(&r, "X-data-parallel-rank");
    }
    wait_for(&p, |s| s.kv_transfers_pending == 0).await;
}

#[tokio::test]
async fn mooncake_wrong_peer_fails_the_transfer() {
    let p = engine(MOONCAKE_P, |c| c.kv_lease = WAIT).await;
    let d = engine(MOONCAKE_D, |_| {}).await;
    let (unused, _held) = unused_port();
    let body = chat(PROMPT, 4);
    let (pa, da) = (p.addr(), d.addr());
    let leg = |transfer: &str, edit: &dyn Fn(&mut Value)| {
        let (pb, mut db) = mooncake_bodies(&body, &p, p.engine_id(), transfer);
        edit(&mut db["kv_transfer_params"]);
        async move { tokio::join!(post(pa, CHAT, &pb), post(da, CHAT, &db)) }
    };
    let start = Instant::now();
    let (wrong_host, wrong_port, wrong_transfer, wrong_engine, wrong_kv) = tokio::join!(
        leg("a", &|k| k["remote_bootstrap_addr"] =
            json!(format!("http://127.0.0.1:{unused}"))),
        leg("b", &|k| k["remote_bootstrap_addr"] =
            json!(format!("http://{}", p.addr()))),
        leg("c", &|k| k["transfer_id"] = json!("not-c")),
        leg("d", &|k| k["remote_engine_id"] = json!("nope")),
        async {
            let (pb, _) = mooncake_bodies(&body, &p, p.engine_id(), "e");
            let (_, db) = mooncake_bodies(&chat("another prompt", 4), &p, p.engine_id(), "e");
            tokio::join!(post(p.addr(), CHAT, &pb), post(d.addr(), CHAT, &db))
        },
    );
    assert!(start.elapsed() < Duration::from_millis(1500));
    for (prefill, _) in [
        &wrong_host,
        &wrong_port,
        &wrong_transfer,
        &wrong_engine,
        &wrong_kv,
    ] {
        assert_eq!(prefill.status, 200, "{}", prefill.text());
    }
    assert_kv_failure(
        &wrong_host.1,
        &format!("cannot reach bootstrap server http://127.0.0.1:{unused}"),
    );
    assert_kv_failure(&wrong_port.1, "answered 404 Not Found to GET /query");
    assert_kv_failure(&wrong_transfer.1, "no prefill held transfer id \"not-c\"");
    assert_kv_failure(&wrong_engine.1, "engine id nope is not served by");
    assert_kv_failure(&wrong_kv.1, "do not match the prompt");
    let ds = d.stats();
    assert_eq!(
        (
            ds.kv_pull_failures,
            ds.remote_decodes,
            ds.bootstrap_timeouts
        ),
        (5, 0, 1)
    );
    // What nobody pulled goes with the lease.
    let ps = wait_for(&p, |s| s.kv_transfers_pending == 0).await;
    assert_eq!(ps.side_channel_served, 1);
}

#[tokio::test]
async fn mooncake_params_are_read_as_vllm_reads_them() {
    let p = engine(MOONCAKE_P, |_| {}).await;
    let d = engine(MOONCAKE_D, |_| {}).await;
    let body = chat(PROMPT, 4);
    // Without a handoff, each engine serves the request from its prompt, as vLLM's
    // Mooncake connector lets a request without `kv_transfer_params` through: the
    // prefill holds nothing, the decode computes the prompt.
    for e in [&p, &d] {
        assert_eq!(post(e.addr(), CHAT, &body).await.status, 200);
    }
    assert_eq!(p.stats().kv_transfers_pending, 0);
    assert_eq!(d.stats().local_prefills, 1);
    // A prefill without a (string) transfer id only warns, and holds nothing.
    let (mut pb, mut db) = mooncake_bodies(&body, &p, p.engine_id(), "t");
    pb["kv_transfer_params"]["transfer_id"] = json!(7);
    assert_eq!(post(p.addr(), CHAT, &pb).await.status, 200);
    assert_eq!(p.stats().kv_transfers_pending, 0);
    // A decode asked for remote KV without the three keys: "Got invalid
    // KVTransferParams", and the request waits for KV nobody sends.
    let without_engine = {
        let mut b = db.clone();
        b["kv_transfer_params"]
            .as_object_mut()
            .unwrap()
            .remove("remote_engine_id");
        b
    };
    let stuck = raw_post(d.addr(), CHAT, &[], &without_engine).await;
    wait_for(&d, |s| s.stuck_kv_waits == 1).await;
    drop(stuck);
    let s = wait_for(&d, |s| s.active_requests == 0).await;
    assert_eq!(s.cancelled, 1);
    db["kv_transfer_params"]["remote_bootstrap_addr"] = json!("nonsense");
    assert_bad_request(&post(d.addr(), CHAT, &db).await, "http://HOST:PORT");

    // A transfer id is held once.
    let (pb, _) = mooncake_bodies(&body, &p, p.engine_id(), "same");
    assert_eq!(post(p.addr(), CHAT, &pb).await.status, 200);
    assert_bad_request(&post(p.addr(), CHAT, &pb).await, "already in use");
    assert_eq!(p.stats().kv_transfers_pending, 1);
}

#[tokio::test]
async fn mooncake_prefill_client_leaving_frees_its_kv() {
    let p = engine(MOONCAKE_P, |c| {
        c.inter_token_delay = Duration::from_millis(200)
    })
    .await;
    let mut body = chat(PROMPT, 5);
    body["stream"] = json!(true);
    let (mut pb, _) = mooncake_bodies(&body, &p, p.engine_id(), "gone");
    pb["max_tokens"] = json!(5);
    let stream = raw_post(p.addr(), CHAT, &[], &pb).await;
    wait_for(&p, |s| s.kv_transfers_pending == 1).await;
    drop(stream);
    let s = wait_for(&p, |s| s.active_requests == 0).await;
    assert_eq!((s.cancelled, s.kv_transfers_pending), (1, 0));
}

#[tokio::test]
async fn mooncake_decode_client_leaving_abandons_the_wait() {
    let p = engine(MOONCAKE_P, |c| c.bootstrap_timeout = Duration::from_secs(5)).await;
    let d = engine(MOONCAKE_D, |c| c.bootstrap_timeout = Duration::from_secs(5)).await;
    let (pb, db) = mooncake_bodies(&chat(PROMPT, 4), &p, p.engine_id(), "late");
    let stream = raw_post(d.addr(), CHAT, &[], &db).await;
    wait_for(&p, |s| s.side_channel_connections == 1).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let left = Instant::now();
    drop(stream);
    let s = wait_for(&d, |s| s.active_requests == 0).await;
    assert!(left.elapsed() < Duration::from_millis(500));
    assert_eq!((s.cancelled, s.kv_pull_failures), (1, 0));
    // The abandoned pull takes nothing.
    assert_eq!(post(p.addr(), CHAT, &pb).await.status, 200);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(p.stats().kv_transfers_pending, 1);
    assert_eq!(post(d.addr(), CHAT, &db).await.status, 200);
    assert_eq!(p.stats().kv_transfers_pending, 0);
}

#[tokio::test]
async fn mooncake_decode_aborted_before_pulling_leaves_the_kv_to_the_lease() {
    let p = engine(MOONCAKE_P, |c| c.kv_lease = Duration::from_millis(800)).await;
    let d = engine(MOONCAKE_D, |c| {
        c.bootstrap_timeout = Duration::from_secs(5);
        c.request_delay = Duration::from_millis(300);
    })
    .await;
    let (pb, db) = mooncake_bodies(&chat(PROMPT, 4), &p, p.engine_id(), "abandoned");
    assert_eq!(post(p.addr(), CHAT, &pb).await.status, 200);
    let answered = Instant::now();
    let s = p.stats();
    assert_eq!((s.kv_transfers_pending, s.blocks_held), (1, 3));

    let stream = raw_post(d.addr(), CHAT, &[], &db).await;
    wait_for(&d, |s| s.active_requests == 1).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(stream);
    let ds = wait_for(&d, |s| s.active_requests == 0).await;
    assert_eq!(
        (ds.cancelled, ds.kv_pull_failures, ds.kv_releases_sent),
        (1, 0, 0)
    );
    // Nothing tells the prefill: it keeps the KV...
    tokio::time::sleep(Duration::from_millis(100)).await;
    let s = p.stats();
    assert_eq!((s.kv_transfers_pending, s.blocks_held), (1, 3));
    // ... until the lease runs out.
    let s = wait_for(&p, |s| s.kv_transfers_pending == 0).await;
    assert!(answered.elapsed() >= Duration::from_millis(600));
    assert_eq!((s.blocks_held, s.side_channel_served), (0, 0));
}

// ------------------------------------------------------------ Both modes

#[tokio::test]
async fn faults_answer_at_once_in_every_mode() {
    for mode in [SGLANG_P, SGLANG_D, MOONCAKE_P, MOONCAKE_D] {
        let e = engine(mode, |c| {
            c.bootstrap_timeout = Duration::from_secs(5);
            c.faults = Faults {
                status: Some(503),
                ..Faults::default()
            };
        })
        .await;
        let start = Instant::now();
        // Even a request without any bootstrap field: the fault wins.
        let r = post(e.addr(), CHAT, &chat(PROMPT, 4)).await;
        assert_eq!(r.status, 503, "{mode:?}");
        assert!(start.elapsed() < Duration::from_millis(200));
        let s = e.stats();
        assert_eq!((s.kv_transfers_pending, s.prefill_requests), (0, 0));
    }
}

#[tokio::test]
async fn bootstrap_never_met_is_a_counted_timeout() {
    // SGLang: the prefill's bootstrap server is up, its request never comes.
    let (p, d) = sglang_pair().await;
    let start = Instant::now();
    let reply = post(d.addr(), CHAT, &sglang_body(chat(PROMPT, 4), &p, json!(77))).await;
    assert_sglang_transfer_failed(&reply, "no prefill for room 77");
    assert!(start.elapsed() >= WAIT);
    let ds = d.stats();
    assert_eq!(
        (
            ds.bootstrap_timeouts,
            ds.kv_pull_failures,
            ds.remote_decodes
        ),
        (1, 1, 0)
    );

    // Mooncake: likewise for a transfer id.
    let p = engine(MOONCAKE_P, |_| {}).await;
    let d = engine(MOONCAKE_D, |_| {}).await;
    let (_, db) = mooncake_bodies(&chat(PROMPT, 4), &p, p.engine_id(), "never");
    let start = Instant::now();
    let reply = post(d.addr(), CHAT, &db).await;
    assert_kv_failure(&reply, "transfer id \"never\"");
    assert!(start.elapsed() >= WAIT);
    let ds = d.stats();
    assert_eq!(
        (
            ds.bootstrap_timeouts,
            ds.kv_pull_failures,
            ds.remote_decodes
        ),
        (1, 1, 0)
    );
}

/// Prefill 500 ms, decode scheduling 450 ms: the legs overlap, so the
/// decode answers after about 500 ms, not 950 (the median of 5 pairs, so that one
/// pair slowed by a loaded machine does not decide; the bound leaves 250 ms for the
/// load and 200 ms below legs one after the other).
#[tokio::test]
async fn concurrent_legs_overlap() {
    const PAIRS: u64 = 5;
    let prompt = "a b c d e f g h i j"; // 10 tokens, 500 ms of prefill
    let slow_prefill = |c: &mut SimConfig| {
        c.prefill_delay_per_token = Duration::from_millis(50);
        c.bootstrap_timeout = Duration::from_secs(5);
    };
    let scheduled_decode = |c: &mut SimConfig| {
        c.request_delay = Duration::from_millis(450);
        c.bootstrap_timeout = Duration::from_secs(5);
    };
    let timed = |addr, body: Value| async move {
        let start = Instant::now();
        let r = post(addr, CHAT, &body).await;
        (r, start.elapsed())
    };
    // At least the prefill's 500 ms; well below the 950 ms of legs one after the other.
    let overlapped = |mut took: Vec<Duration>| {
        took.sort();
        let median = took[took.len() / 2];
        assert!(
            median >= Duration::from_millis(495) && median < Duration::from_millis(750),
            "median {median:?} of {took:?}"
        );
    };

    let p = engine(SGLANG_P, slow_prefill).await;
    let d = engine(SGLANG_D, scheduled_decode).await;
    let mut took = Vec::new();
    for room in 0..PAIRS {
        let body = sglang_body(chat(prompt, 2), &p, json!(room + 1));
        let ((pr, _), (dr, t)) = tokio::join!(timed(p.addr(), body.clone()), timed(d.addr(), body));
        assert_eq!((pr.status, dr.status), (200, 200));
        took.push(t);
    }
    overlapped(took);

    let p = engine(MOONCAKE_P, slow_prefill).await;
    let d = engine(MOONCAKE_D, scheduled_decode).await;
    let mut took = Vec::new();
    for n in 0..PAIRS {
        let (pb, db) = mooncake_bodies(&chat(prompt, 2), &p, p.engine_id(), &format!("t{n}"));
        let ((pr, _), (dr, t)) = tokio::join!(timed(p.addr(), pb), timed(d.addr(), db));
        assert_eq!((pr.status, dr.status), (200, 200));
        took.push(t);
    }
    overlapped(took);
}
