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
    // vLLM names each rank's engine core `{engine_id}_dp{rank}`.
    assert_eq!(p.engine_ids(), ["pf_dp0", "pf_dp1"]);

    // A proxy that does not pin the prefill leg and names rank 0's engine id
    // (what a single-rank view of the prefill gives): the engine's balancer,
    // which does not favour rank 0, put the first request on rank 1.
    let (pb, db) = mooncake_legs(&p, "pf_dp0", "t1");
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
    let (pb, db) = mooncake_legs(&p, "pf_dp0", "t2");
    let (pr, dr) = tokio::join!(post(p.addr(), CHAT, &pb), post(d.addr(), CHAT, &db));
    assert_eq!((pr.status, dr.status), (200, 200), "{}", dr.text());
    assert_eq!(p.stats().requests_per_dp_rank, [1, 1]);

    // Pinned with the header, the id of the pinned rank always works.
    for (rank, id) in [("1", "pf_dp1"), ("1", "pf_dp1"), ("0", "pf_dp0")] {
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

// ------------------------------------------------------------ vLLM NIXL

fn nixl_prefill_body() -> Value {
    let mut body = chat(1);
    body["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false});
    body
}

fn nixl_decode_body(params: &Value) -> Value {
    let mut body = chat(4);
    body["kv_transfer_params"] = params.clone();
    body
}

/// vLLM gives each data-parallel rank's engine core its own engine id,
/// `{engine_id}_dp{rank}` (`vllm/v1/engine/core.py` `run_engine_core`), and its own
/// NIXL side channel on `VLLM_NIXL_SIDE_CHANNEL_PORT + data_parallel_index`
/// (`…/nixl/base_scheduler.py`); a prefill names the rank it ran on, and a pull
/// addressed to another rank fails (its handshake meets another engine id, or the
/// blocks are not there).
#[tokio::test]
async fn nixl_ranks_have_their_own_engine_id_and_side_channel() {
    let p = engine(KvMode::Nixl, 2).await;
    let d = SimEngine::start(SimConfig::default()).await.unwrap();

    // Pinned to rank 1: the handoff names rank 1.
    let pinned = [("X-data-parallel-rank", "1")];
    let pr = post_with(p.addr(), CHAT, &pinned, &nixl_prefill_body()).await;
    assert_eq!(pr.status, 200, "{}", pr.text());
    let params = pr.json()["kv_transfer_params"].clone();
    assert_eq!(params["remote_engine_id"], "pf_dp1", "{params}");
    assert_eq!(p.engine_ids(), ["pf_dp0", "pf_dp1"]);
    let sides = p.side_channel_addrs();
    assert_eq!(sides.len(), 2);
    assert_eq!(sides[0], p.side_channel_addr());
    assert_eq!(sides[1].port(), sides[0].port() + 1);
    assert_eq!(params["remote_port"], sides[1].port());

    // Addressed to rank 0 (its port, its id, or both): refused, the blocks stay held.
    for (id, port, why) in [
        ("pf_dp1", sides[0].port(), "engine id mismatch"),
        ("pf_dp0", sides[1].port(), "engine id mismatch"),
        ("pf_dp0", sides[0].port(), "unknown request id"),
    ] {
        let mut wrong = params.clone();
        wrong["remote_engine_id"] = json!(id);
        wrong["remote_port"] = json!(port);
        let r = post(d.addr(), CHAT, &nixl_decode_body(&wrong)).await;
        assert_transfer_failed(&r, why);
    }
    assert!(p.stats().blocks_held > 0);
    let r = post(d.addr(), CHAT, &nixl_decode_body(&params)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(p.stats().blocks_held, 0);

    // Unpinned, the engine's balancer places the prefills (on one rank, then the
    // other) and each handoff names where it ran: passed on verbatim, it is right.
    let mut ranks = Vec::new();
    for _ in 0..2 {
        let pr = post(p.addr(), CHAT, &nixl_prefill_body()).await;
        let params = pr.json()["kv_transfer_params"].clone();
        let id = params["remote_engine_id"].as_str().unwrap();
        let rank: usize = id.strip_prefix("pf_dp").unwrap().parse().unwrap();
        assert_eq!(params["remote_port"], sides[rank].port(), "{params}");
        ranks.push(rank);
        let r = post(d.addr(), CHAT, &nixl_decode_body(&params)).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    ranks.sort_unstable();
    assert_eq!(ranks, [0, 1]);
    assert_eq!(p.stats().requests_per_dp_rank, [1, 2]);
    assert_eq!(d.stats().remote_decodes, 3);
    // One rank, one unsuffixed id.
    let single = SimEngine::start(SimConfig {
        engine_id: Some("solo".into()),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    assert_eq!(single.engine_ids(), ["solo"]);
    assert_eq!(single.side_channel_addrs(), [single.side_channel_addr()]);
}

/// NIXL push with data-parallel ranks: a decode registers with the rank its
/// parameters name, which pairs it only with KV computed there.
#[tokio::test]
async fn nixl_push_registers_with_the_rank_it_names() {
    let p = engine(KvMode::NixlPush, 2).await;
    let d = engine(KvMode::NixlPush, 1).await;
    let sides = p.side_channel_addrs();
    let push = |rank: usize| {
        let mut body = json!({"prompt": PROMPT, "max_tokens": 4});
        body["kv_transfer_params"] = json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_engine_id": format!("pf_dp{rank}"),
            "remote_host": "127.0.0.1",
            "remote_port": sides[rank].port(),
            "tp_size": 1,
        });
        body
    };
    let prefill = json!({"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}});
    let legs = |rank: &'static str, named: usize, id: &'static str| {
        let (p, d, prefill, decode) = (p.addr(), d.addr(), prefill.clone(), push(named));
        async move {
            let headers = [("X-data-parallel-rank", rank), ("x-request-id", id)];
            let decode_headers = [("x-request-id", id)];
            tokio::join!(
                post_with(p, "/v1/completions", &headers, &prefill),
                post_with(d, "/v1/completions", &decode_headers, &decode)
            )
        }
    };
    // Computed on rank 1, the decode registered with rank 0: never paired.
    let (pr, dr) = legs("1", 0, "r1").await;
    assert_eq!(pr.status, 200, "{}", pr.text());
    assert_transfer_failed(&dr, "no prefill paired");
    // Named right, paired.
    let (pr, dr) = legs("1", 1, "r2").await;
    assert_eq!((pr.status, dr.status), (200, 200), "{}", dr.text());
    assert_eq!(d.stats().remote_decodes, 1);
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
    assert_sglang_transfer_failed(&dr, "room 10 was not registered on dp rank 0");
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
    assert_sglang_transfer_failed(&dr, "room 30 was not registered on dp rank 0");
    // Its prefill waited for a decode that never came to its rank.
    assert_sglang_transfer_failed(&pr, "no decode took room 30");

    // A rank the prefill does not have fails the decode at once.
    let started = Instant::now();
    let mut body = sglang_body(chat(4), &p, 40);
    body["disagg_prefill_dp_rank"] = json!(5);
    let dr = post(d.addr(), CHAT, &body).await;
    assert_sglang_transfer_failed(&dr, "could not fetch bootstrap info for prefill_dp_rank 5");
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
