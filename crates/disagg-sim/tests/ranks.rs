//! Data-parallel ranks over real loopback sockets: where vLLM (Mooncake) and
//! SGLang engines with several ranks place requests, and how a prefill's
//! KV is found, or not, on the rank that computed it.

mod common;

use std::time::{Duration, Instant};

use common::*;
use disagg_sim::{KvMode, SimConfig, SimEngine, SimRole};
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";
/// The bootstrap timeout of the engines here, so that failures are quick.
const WAIT: Duration = Duration::from_millis(300);
const PROMPT: &str = "a prompt long enough to fill more than one block of sixteen tokens with words \
    that keep on coming until the end of the line";

async fn engine(kv_mode: KvMode, dp_size: u32) -> SimEngine {
    SimEngine::start(SimConfig {
        kv_mode,
        dp_size,
        bootstrap_timeout: WAIT,
        kv_lease: WAIT,
        engine_id: Some("pf".into()),
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

fn chat(max_tokens: u32) -> Value {
    json!({"model": "sim-model", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens})
}

// -------------------------------------------------------------- Mooncake

/// The two legs of vLLM's Mooncake proxy for one transfer, the decode told
/// `engine_id`.
fn mooncake_legs(p: &SimEngine, engine_id: &str, transfer_id: &str) -> (Value, Value) {
    let mut prefill = chat(1);
    prefill["kv_transfer_params"] =
        json!({"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": transfer_id});
    let mut decode = chat(4);
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
async fn mooncake_unpinned_prefill_is_placed_by_the_engine_and_strands_the_decode() {
    let p = engine(KvMode::Mooncake(SimRole::Prefill), 2).await;
    let d = engine(KvMode::Mooncake(SimRole::Decode), 1).await;
    assert_eq!(p.engine_ids(), ["pf", "pf-dp1"]);

    // A proxy that does not pin the prefill leg and names rank 0's engine id
    // (what a single-rank view of the prefill gives): the engine's balancer,
    // which does not favour rank 0, put the first request on rank 1.
    let (pb, db) = mooncake_legs(&p, "pf", "t1");
    let started = Instant::now();
    let (pr, dr) = tokio::join!(post(p.addr(), CHAT, &pb), post(d.addr(), CHAT, &db));
    assert_eq!(pr.status, 200, "{}", pr.text());
    assert_transfer_failed(&dr, "transfer id \"t1\"");
    assert!(
        started.elapsed() >= WAIT,
        "the decode waited for its transfer"
    );
    assert_eq!(d.stats().bootstrap_timeouts, 1);
    assert_eq!(p.stats().requests_per_dp_rank, [0, 1]);

    // The next unpinned request takes the other rank: rank 0's id works.
    let (pb, db) = mooncake_legs(&p, "pf", "t2");
    let (pr, dr) = tokio::join!(post(p.addr(), CHAT, &pb), post(d.addr(), CHAT, &db));
    assert_eq!((pr.status, dr.status), (200, 200), "{}", dr.text());
    assert_eq!(p.stats().requests_per_dp_rank, [1, 1]);

    // Pinned with the header, the id of the pinned rank always works.
    for (rank, id) in [("1", "pf-dp1"), ("1", "pf-dp1"), ("0", "pf")] {
        let transfer = format!("pinned-{rank}-{}", p.stats().requests);
        let (pb, db) = mooncake_legs(&p, id, &transfer);
        let headers = [("X-data-parallel-rank", rank)];
        let (pr, dr) = tokio::join!(
            post_with(p.addr(), CHAT, &headers, &pb),
            post(d.addr(), CHAT, &db)
        );
        assert_eq!((pr.status, dr.status), (200, 200), "{}", dr.text());
    }
    assert_eq!(p.stats().requests_per_dp_rank, [2, 3]);
    assert_eq!(d.stats().requests_per_dp_rank, [5]);
    assert_eq!(d.stats().remote_decodes, 4);
    wait_for(&p, |s| s.kv_transfers_pending == 0 && s.blocks_held == 0).await;
}

#[tokio::test]
async fn vllm_balancer_prefers_the_least_loaded_rank() {
    // A slow engine, so that requests overlap: a rank busy with a pinned
    // request is skipped by the balancer, whatever the turn says.
    let e = SimEngine::start(SimConfig {
        dp_size: 3,
        request_delay: Duration::from_millis(300),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let body = chat(2);
    let busy = |rank: &'static str| {
        let body = body.clone();
        let addr = e.addr();
        async move { post_with(addr, CHAT, &[("X-data-parallel-rank", rank)], &body).await }
    };
    let pinned = tokio::spawn(busy("1"));
    let pinned2 = tokio::spawn(busy("2"));
    wait_for(&e, |s| s.active_requests == 2).await;
    // Ranks 1 and 2 are busy: the unpinned request goes to rank 0.
    assert_eq!(post(e.addr(), CHAT, &body).await.status, 200);
    assert_eq!(pinned.await.unwrap().status, 200);
    assert_eq!(pinned2.await.unwrap().status, 200);
    assert_eq!(e.stats().requests_per_dp_rank, [1, 1, 1]);
    // A rank out of range, or not a number, is refused.
    for rank in ["3", "x"] {
        let r = post_with(e.addr(), CHAT, &[("X-data-parallel-rank", rank)], &body).await;
        assert_eq!(r.status, 400, "{}", r.text());
        assert!(error_message(&r).contains("X-data-parallel-rank"));
    }
    assert_eq!(e.stats().requests_per_dp_rank, [1, 1, 1]);
}

// ---------------------------------------------------------------- SGLang

/// `body` with the single-room bootstrap fields of `p`.
fn sglang_body(mut body: Value, p: &SimEngine, room: u64) -> Value {
    body["bootstrap_host"] = json!("127.0.0.1");
    body["bootstrap_port"] = json!(p.bootstrap_addr().unwrap().port());
    body["bootstrap_room"] = json!(room);
    body
}

/// Sends both legs at once, each with its own extra fields and headers.
async fn sglang_legs(
    p: &SimEngine,
    d: &SimEngine,
    room: u64,
    prefill: (&[(&str, &str)], Value),
    decode: (&[(&str, &str)], Value),
) -> (Reply, Reply) {
    let with = |extra: &Value| {
        let mut body = sglang_body(chat(4), p, room);
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let (pb, db) = (with(&prefill.1), with(&decode.1));
    tokio::join!(
        post_with(p.addr(), CHAT, prefill.0, &pb),
        post_with(d.addr(), CHAT, decode.0, &db)
    )
}

/// A prefill and a decode of two ranks each. The decode waits longer than
/// the prefill's bootstrap server, so that a room never registered where it
/// looks is answered by the server, which says on which rank it looked.
async fn sglang_pair() -> (SimEngine, SimEngine) {
    let decode = SimEngine::start(SimConfig {
        kv_mode: KvMode::Sglang(SimRole::Decode),
        dp_size: 2,
        bootstrap_timeout: WAIT * 4,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    (engine(KvMode::Sglang(SimRole::Prefill), 2).await, decode)
}

#[tokio::test]
async fn sglang_unpinned_requests_follow_the_room_and_meet() {
    let (p, d) = sglang_pair().await;
    for room in [10u64, 11, 12] {
        let (pr, dr) = sglang_legs(&p, &d, room, (&[], json!({})), (&[], json!({}))).await;
        assert_eq!((pr.status, dr.status), (200, 200), "{}", dr.text());
    }
    // The prefill follows the room (10, 12 on rank 0; 11 on rank 1), the
    // decode takes its own ranks in turn.
    assert_eq!(p.stats().requests_per_dp_rank, [2, 1]);
    assert_eq!(d.stats().requests_per_dp_rank, [2, 1]);
    assert_eq!(d.stats().remote_decodes, 3);
}

#[tokio::test]
async fn sglang_prefill_pinned_off_its_room_is_a_follow_bootstrap_room_conflict() {
    let (p, d) = sglang_pair().await;
    // Room 10 implies rank 0; today's proxy pins the prefill to rank 1 with
    // the deprecated `data_parallel_rank` (and a `data_parallel_rank_decode`
    // SGLang ignores), both legs getting the same body.
    let same = json!({"data_parallel_rank": 1, "data_parallel_rank_decode": 0});
    let started = Instant::now();
    let (pr, dr) = sglang_legs(&p, &d, 10, (&[], same.clone()), (&[], same)).await;
    assert_transfer_failed(
        &pr,
        "follow_bootstrap_room conflict: dispatched to dp_rank 1 but bootstrap_room 10 implies dp_rank 0",
    );
    // The decode looks for room 10 on rank 0, where it never comes.
    assert_transfer_failed(&dr, "room 10 was not registered on dp rank 0");
    assert!(started.elapsed() >= WAIT);
    let ps = p.stats();
    assert_eq!(ps.dp_rank_conflicts, 1);
    assert_eq!((ps.kv_transfers_pending, ps.blocks_held), (0, 0));
    // The decode ran on the rank `data_parallel_rank` named, not on
    // `data_parallel_rank_decode`'s.
    assert_eq!(d.stats().requests_per_dp_rank, [0, 1]);

    // Pinned by `routed_dp_rank` or the header, the same conflict.
    for (headers, body) in [
        (&[][..], json!({"routed_dp_rank": 1})),
        (
            &[("X-Data-Parallel-Rank", "1")][..],
            json!({"routed_dp_rank": 0}),
        ),
    ] {
        let (pr, _) = sglang_legs(&p, &d, 12, (headers, body), (&[], json!({}))).await;
        assert_transfer_failed(&pr, "follow_bootstrap_room conflict");
    }
    assert_eq!(p.stats().dp_rank_conflicts, 3);
}

#[tokio::test]
async fn sglang_decode_told_the_prefill_rank_meets_it_anywhere() {
    let (p, d) = sglang_pair().await;
    // Room 10 implies rank 0; the router pins the prefill to rank 1 and tells
    // both legs (the prefill's check is then skipped, the decode looks there).
    let (pr, dr) = sglang_legs(
        &p,
        &d,
        10,
        (
            &[],
            json!({"routed_dp_rank": 1, "disagg_prefill_dp_rank": 1}),
        ),
        (
            &[],
            json!({"routed_dp_rank": 0, "disagg_prefill_dp_rank": 1}),
        ),
    )
    .await;
    assert_eq!((pr.status, dr.status), (200, 200), "{}", pr.text());
    assert_eq!(p.stats().requests_per_dp_rank, [0, 1]);
    assert_eq!(d.stats().requests_per_dp_rank, [1, 0]);

    // `x-override-disagg-prefill-dp-rank` overrides the body.
    let (pr, dr) = sglang_legs(
        &p,
        &d,
        20,
        (
            &[("X-Data-Parallel-Rank", "1")],
            json!({"disagg_prefill_dp_rank": 1}),
        ),
        (
            &[("x-override-disagg-prefill-dp-rank", "1")],
            json!({"disagg_prefill_dp_rank": 0}),
        ),
    )
    .await;
    assert_eq!((pr.status, dr.status), (200, 200), "{}", dr.text());

    // The decode told the wrong rank waits for the room there, in vain.
    let (pr, dr) = sglang_legs(
        &p,
        &d,
        30,
        (
            &[],
            json!({"routed_dp_rank": 1, "disagg_prefill_dp_rank": 1}),
        ),
        (&[], json!({"disagg_prefill_dp_rank": 0})),
    )
    .await;
    assert_transfer_failed(&dr, "room 30 was not registered on dp rank 0");
    // Its prefill waited for a decode that never came to its rank.
    assert_transfer_failed(&pr, "no decode took room 30");

    // A rank the prefill does not have fails the decode at once.
    let started = Instant::now();
    let mut body = sglang_body(chat(4), &p, 40);
    body["disagg_prefill_dp_rank"] = json!(5);
    let dr = post(d.addr(), CHAT, &body).await;
    assert_transfer_failed(&dr, "could not fetch bootstrap info for prefill_dp_rank 5");
    assert!(started.elapsed() < WAIT);
    wait_for(&p, |s| {
        s.kv_transfers_pending == 0 && s.active_requests == 0
    })
    .await;
}

#[tokio::test]
async fn sglang_rank_fields_are_validated() {
    let (p, d) = sglang_pair().await;
    for (headers, body, why) in [
        (
            &[("X-Data-Parallel-Rank", "one")][..],
            json!({}),
            "Invalid X-Data-Parallel-Rank header",
        ),
        (&[][..], json!({"routed_dp_rank": 2}), "routed_dp_rank"),
        (
            &[][..],
            json!({"data_parallel_rank": -1}),
            "data_parallel_rank",
        ),
        (&[][..], json!({"routed_dp_rank": "x"}), "routed_dp_rank"),
        (
            &[("x-override-disagg-prefill-dp-rank", "z")][..],
            json!({}),
            "x-override-disagg-prefill-dp-rank",
        ),
    ] {
        for e in [&p, &d] {
            let mut b = sglang_body(chat(2), &p, 7);
            for (k, v) in body.as_object().unwrap() {
                b[k] = v.clone();
            }
            let r = post_with(e.addr(), CHAT, headers, &b).await;
            assert_eq!(r.status, 400, "{}", r.text());
            assert!(error_message(&r).contains(why), "{}", r.text());
        }
    }
    for e in [&p, &d] {
        assert_eq!(e.stats().requests_per_dp_rank, [0, 0]);
    }
}
