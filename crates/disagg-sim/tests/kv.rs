//! Prefill/decode disaggregation done by hand between two engines, over the
//! real side channel.

mod common;

use std::time::Duration;

use common::*;
use disagg_sim::{
    SideChannelRelease, SideChannelRequest, SideChannelResponse, SimConfig, SimEngine, generate,
};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

const CHAT: &str = "/v1/chat/completions";

fn chat(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": "sim-model", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens})
}

fn with_params(mut body: Value, params: Value) -> Value {
    body["kv_transfer_params"] = params;
    body
}

/// Sends the prefill leg and returns its `kv_transfer_params`.
async fn prefill(engine: &SimEngine, prompt: &str) -> Value {
    let body = with_params(
        chat(prompt, 1),
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
               "remote_block_ids": null, "remote_host": null, "remote_port": null}),
    );
    let reply = post(engine.addr(), CHAT, &body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.json()["kv_transfer_params"].clone()
}

// 36 words: 3 blocks of 16 tokens.
const PROMPT: &str = "the quick brown fox jumps over the lazy dog and then some more words follow \
    so that the prompt spans several blocks of sixteen tokens each which is what we want here \
    to test block lists";

#[tokio::test]
async fn prefill_then_decode_matches_direct() {
    let (p, d) = pair().await;
    let params = prefill(&p, PROMPT).await;
    let tokens = PROMPT.split_whitespace().count();
    assert_eq!(tokens, 36);
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    // One list of block ids per KV-cache group (the model has one), as vLLM 0.33 writes.
    assert_eq!(params["remote_block_ids"], json!([[0, 1, 2]]));
    assert_eq!(params["remote_engine_id"], "prefill-0");
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(params["remote_port"], p.side_channel_addr().port());
    assert_eq!(params["tp_size"], 1);
    assert!(params["remote_request_id"].is_string());
    let s = p.stats();
    assert_eq!(
        (
            s.prefill_requests,
            s.kv_params_returned,
            s.blocks_held,
            s.local_prefills
        ),
        (1, 1, 3, 1)
    );

    let decoded = post(d.addr(), CHAT, &with_params(chat(PROMPT, 12), params)).await;
    assert_eq!(decoded.status, 200, "{}", decoded.text());
    let decoded = decoded.json();
    assert_eq!(decoded["kv_transfer_params"], Value::Null);
    let direct = post(p.addr(), CHAT, &chat(PROMPT, 12)).await.json();
    assert_eq!(decoded["choices"], direct["choices"]);
    assert_eq!(decoded["usage"], direct["usage"]);
    assert_eq!(
        decoded["choices"][0]["message"]["content"],
        generate(PROMPT, 12, 0).concat()
    );

    let ds = d.stats();
    assert_eq!(
        (ds.remote_decodes, ds.local_prefills, ds.kv_pull_failures),
        (1, 0, 0)
    );
    let ps = p.stats();
    assert_eq!((ps.side_channel_served, ps.blocks_held), (1, 0));

    // A second prefill gets fresh blocks.
    let again = prefill(&p, "short prompt").await;
    assert_eq!(again["remote_block_ids"], json!([[3]]));
    assert_ne!(again["remote_request_id"], Value::Null);
}

#[tokio::test]
async fn decode_with_remote_kv_skips_prefill_delay_and_streams() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let d = SimEngine::start(SimConfig {
        prefill_delay_per_token: Duration::from_millis(20),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let params = prefill(&p, PROMPT).await;
    let mut body = with_params(chat(PROMPT, 4), params);
    body["stream"] = json!(true);
    let start = std::time::Instant::now();
    let reply = post(d.addr(), CHAT, &body).await;
    assert!(
        start.elapsed() < Duration::from_millis(400),
        "{:?}",
        start.elapsed()
    );
    let streamed: String = reply.events()[1..5]
        .iter()
        .map(|e| {
            e["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(streamed, generate(PROMPT, 4, 0).concat());
    // Locally, 36 tokens × 20 ms of prefill.
    let start = std::time::Instant::now();
    post(d.addr(), CHAT, &chat(PROMPT, 1)).await;
    assert!(
        start.elapsed() >= Duration::from_millis(715),
        "{:?}",
        start.elapsed()
    );
}

async fn assert_pull_fails(d: &SimEngine, body: &Value, why: &str) {
    let reply = post(d.addr(), CHAT, body).await;
    assert_eq!(reply.status, 500, "{why}: {}", reply.text());
    let err = reply.json()["error"].clone();
    assert_eq!(err["type"], "InternalServerError");
    assert_eq!(err["code"], 500);
    let message = err["message"].as_str().unwrap();
    assert!(message.starts_with("KV transfer failed: "), "{message}");
}

#[tokio::test]
async fn wrong_params_fail_the_pull() {
    let (p, d) = pair().await;
    let params = prefill(&p, PROMPT).await;

    // Nobody listening on that port (held, so no engine started meanwhile takes it).
    let (closed_port, _held) = unused_port();
    let mut bad = params.clone();
    bad["remote_port"] = json!(closed_port);
    assert_pull_fails(&d, &with_params(chat(PROMPT, 4), bad), "wrong port").await;

    let mut bad = params.clone();
    bad["remote_engine_id"] = json!("someone-else");
    assert_pull_fails(&d, &with_params(chat(PROMPT, 4), bad), "wrong engine").await;

    let mut bad = params.clone();
    bad["remote_block_ids"] = json!([[0, 1, 7]]);
    assert_pull_fails(&d, &with_params(chat(PROMPT, 4), bad), "wrong blocks").await;

    // The right blocks in a flat list (the shape before vLLM's hybrid KV-cache groups),
    // which vLLM 0.33's decode worker cannot read group by group.
    let mut bad = params.clone();
    bad["remote_block_ids"] = json!([0, 1, 2]);
    assert_pull_fails(&d, &with_params(chat(PROMPT, 4), bad), "flat block list").await;

    // The right blocks as two KV-cache groups: the model has one.
    let mut bad = params.clone();
    bad["remote_block_ids"] = json!([[0, 1], [2]]);
    assert_pull_fails(&d, &with_params(chat(PROMPT, 4), bad), "two groups").await;

    let mut bad = params.clone();
    bad["remote_request_id"] = json!("nope");
    assert_pull_fails(&d, &with_params(chat(PROMPT, 4), bad), "wrong request").await;

    let mut bad = params.clone();
    bad["remote_host"] = json!(42);
    assert_pull_fails(&d, &with_params(chat(PROMPT, 4), bad), "host not a string").await;

    // A streamed decode fails after vLLM's 200 head: its role chunk, then the error as
    // an event (`kv_load_failure.rs` has the whole of it).
    let mut bad = params.clone();
    bad["remote_engine_id"] = json!("someone-else");
    let mut body = with_params(chat(PROMPT, 4), bad);
    body["stream"] = json!(true);
    let reply = post(d.addr(), CHAT, &body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let events = reply.events();
    assert_eq!(events.len(), 3, "{}", reply.text());
    assert_eq!(events[1]["error"]["type"], "InternalServerError");
    let message = events[1]["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("KV transfer failed: "), "{message}");
    assert_eq!(events[2], "[DONE]");

    // None of those reached the blocks: they are still held.
    assert_eq!(p.stats().blocks_held, 3);
    assert_eq!(p.stats().side_channel_served, 0);

    // KV of another prompt: the pull goes through but the KV does not fit.
    let other = format!("{PROMPT} extra");
    assert_pull_fails(
        &d,
        &with_params(chat(&other, 4), params.clone()),
        "other prompt",
    )
    .await;
    assert_eq!(p.stats().blocks_held, 0);

    // Pulled once, gone: a second decode with the same params fails.
    assert_pull_fails(&d, &with_params(chat(PROMPT, 4), params), "already pulled").await;

    let s = d.stats();
    assert_eq!(s.kv_pull_failures, 10);
    assert_eq!(
        (s.remote_decodes, s.local_prefills, s.active_requests),
        (0, 0, 0)
    );
}

#[tokio::test]
async fn kv_of_another_model_or_block_size_fails() {
    let p = SimEngine::start(SimConfig {
        block_size: 8,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let d = SimEngine::start(SimConfig::default()).await.unwrap();
    let params = prefill(&p, PROMPT).await;
    assert_eq!(params["remote_block_ids"][0].as_array().unwrap().len(), 5);
    assert_pull_fails(&d, &with_params(chat(PROMPT, 4), params), "block size").await;
}

/// vLLM 0.33 (`…/nixl/pull_scheduler.py` `update_state_after_alloc`): block ids
/// without one of the four keys park the request waiting for KV nobody sends, until
/// its client leaves; the engine lives on.
#[tokio::test]
async fn params_without_a_key_leave_the_decode_waiting_until_the_client_leaves() {
    let (p, d) = pair().await;
    let params = prefill(&p, PROMPT).await;
    for key in [
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
    ] {
        let mut bad = params.clone();
        bad.as_object_mut().unwrap().remove(key);
        let before = d.stats();
        let stream = raw_post(d.addr(), CHAT, &[], &with_params(chat(PROMPT, 3), bad)).await;
        let s = wait_for(&d, |s| s.stuck_kv_waits == before.stuck_kv_waits + 1).await;
        assert_eq!(s.active_requests, 1, "{key}: still waiting");
        drop(stream);
        let s = wait_for(&d, |s| s.active_requests == 0).await;
        assert_eq!(s.cancelled, before.cancelled + 1, "{key}");
    }
    // Not a decode request at all: plain local prefill; the engine still serves.
    let reply = post(
        d.addr(),
        CHAT,
        &with_params(chat(PROMPT, 3), json!({"do_remote_prefill": false})),
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.json()["choices"][0]["message"]["content"],
        generate(PROMPT, 3, 0).concat()
    );
    let s = d.stats();
    assert_eq!(
        (
            s.stuck_kv_waits,
            s.engine_core_deaths,
            s.local_prefills,
            s.remote_decodes,
            s.kv_pull_failures
        ),
        (4, 0, 1, 0, 0)
    );
    assert_eq!(get(d.addr(), "/health").await.status, 200);
    // The prefill still holds its blocks: nobody pulled them.
    assert_eq!(p.stats().blocks_held, 3);
}

/// vLLM 0.33: `do_remote_prefill` without block ids (missing or empty) fails an
/// assertion inside the decode's scheduler, which kills the engine core: that request
/// and every later one answer 500, and `/health` 503.
#[tokio::test]
async fn params_without_block_ids_kill_the_decode_engine() {
    for edit in ["remove", "empty"] {
        let (p, d) = pair().await;
        let mut bad = prefill(&p, PROMPT).await;
        match edit {
            "remove" => drop(bad.as_object_mut().unwrap().remove("remote_block_ids")),
            _ => bad["remote_block_ids"] = json!([]),
        }
        let reply = post(d.addr(), CHAT, &with_params(chat(PROMPT, 3), bad)).await;
        assert_eq!(reply.status, 500, "{edit}: {}", reply.text());
        assert_eq!(
            error_message(&reply),
            "The server had an error while processing your request."
        );
        // Dead for everyone after it.
        let plain = post(d.addr(), CHAT, &chat(PROMPT, 3)).await;
        assert_eq!(plain.status, 500, "{edit}");
        assert_eq!(get(d.addr(), "/health").await.status, 503, "{edit}");
        let s = d.stats();
        assert_eq!((s.engine_core_deaths, s.local_prefills), (1, 0), "{edit}");
    }
}

/// `Faults::partial_kv_params`: the prefill answers its dict less the part the fault
/// names, and holds its blocks as usual.
#[tokio::test]
async fn partial_params_fault_answers_each_shape() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    for shape in disagg_sim::PartialKv::ALL {
        p.set_faults(disagg_sim::Faults {
            partial_kv_params: Some(shape),
            ..Default::default()
        });
        let params = prefill(&p, PROMPT).await;
        let dict = params.as_object().unwrap();
        match shape {
            disagg_sim::PartialKv::EmptyBlockIds => {
                assert_eq!(dict["remote_block_ids"], json!([]))
            }
            _ => assert!(!dict.contains_key(shape.key()), "{shape:?}: {params}"),
        }
        assert_eq!(dict["do_remote_prefill"], true);
        // Every other key is there.
        assert_eq!(
            dict.len(),
            13 - usize::from(shape != disagg_sim::PartialKv::EmptyBlockIds)
        );
    }
    assert_eq!(p.stats().blocks_held, 3 * 6);
}

/// vLLM 0.33 (`…/nixl/pull_scheduler.py` `request_finished`) keeps the blocks of a
/// prefill that finished stopped (EOS, a stop string) as of one that hit its length,
/// and names them: a decode pulls them.
#[tokio::test]
async fn prefill_stopped_by_eos_holds_its_blocks_and_names_them() {
    let config = || SimConfig {
        eos_period: 4,
        ..SimConfig::default()
    };
    let p = SimEngine::start(config()).await.unwrap();
    let d = SimEngine::start(config()).await.unwrap();
    let prompt = (0..)
        .map(|i| format!("stop here {i}"))
        .find(|p| generate(p, 1, 4).is_empty())
        .unwrap();
    let body = with_params(chat(&prompt, 1), json!({"do_remote_decode": true}));
    let v = post(p.addr(), CHAT, &body).await.json();
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let params = v["kv_transfer_params"].clone();
    assert_eq!(params["remote_block_ids"], json!([[0]]), "{v}");
    let s = p.stats();
    assert_eq!(
        (s.prefill_requests, s.kv_params_returned, s.blocks_held),
        (1, 1, 1)
    );
    let decoded = post(d.addr(), CHAT, &with_params(chat(&prompt, 4), params)).await;
    assert_eq!(decoded.status, 200, "{}", decoded.text());
    assert_eq!(decoded.json()["choices"][0]["finish_reason"], "stop");
    assert_eq!(d.stats().remote_decodes, 1);
    assert_eq!(p.stats().blocks_held, 0);

    // A stop string on the first token does the same.
    let first = generate("plain words", 1, 0)[0].trim().to_owned();
    let mut body = with_params(chat("plain words", 1), json!({"do_remote_decode": true}));
    body["stop"] = json!([first]);
    let plain = SimEngine::start(SimConfig::default()).await.unwrap();
    let v = post(plain.addr(), CHAT, &body).await.json();
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(
        v["kv_transfer_params"]["remote_block_ids"].is_array(),
        "{v}"
    );
    assert_eq!(plain.stats().blocks_held, 1);
}

/// `Faults::withhold_kv_params`: a NIXL prefill answers without a handoff, `null`,
/// and holds nothing; lifted, it names its blocks again.
#[tokio::test]
async fn withheld_params_fault_answers_null_and_holds_nothing() {
    let p = SimEngine::start(SimConfig {
        faults: disagg_sim::Faults {
            withhold_kv_params: true,
            ..Default::default()
        },
        ..SimConfig::default()
    })
    .await
    .unwrap();
    for stream in [false, true] {
        let mut body = with_params(chat(PROMPT, 1), json!({"do_remote_decode": true}));
        body["stream"] = json!(stream);
        let reply = post(p.addr(), CHAT, &body).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        if !stream {
            assert_eq!(reply.json()["kv_transfer_params"], Value::Null);
        }
    }
    let s = p.stats();
    assert_eq!(
        (s.prefill_requests, s.kv_params_returned, s.blocks_held),
        (2, 0, 0)
    );
    p.set_faults(disagg_sim::Faults::default());
    let params = prefill(&p, PROMPT).await;
    assert_eq!(params["remote_block_ids"], json!([[0, 1, 2]]));
}

/// The prefill's `kv_transfer_params`, key for key and in order, as vLLM 0.33's pull
/// scheduler writes them (`…/nixl/pull_scheduler.py` `request_finished`): one list of
/// block ids per KV-cache group, `dcp_size`, `pp_size`, the tokens computed, a null
/// expiry (a prefill's blocks live by their lease) and the transfer mode.
#[tokio::test]
async fn prefill_params_are_the_dict_vllm_writes() {
    let (p, _d) = pair().await;
    let body = with_params(chat(PROMPT, 1), json!({"do_remote_decode": true}));
    let reply = post(p.addr(), CHAT, &body).await;
    let text = reply.text();
    let id = reply.json()["kv_transfer_params"]["remote_request_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let port = p.side_channel_addr().port();
    let dict = format!(
        r#""kv_transfer_params":{{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[0,1,2]],"remote_engine_id":"prefill-0","remote_request_id":"{id}","remote_host":"127.0.0.1","remote_port":{port},"tp_size":1,"dcp_size":1,"pp_size":1,"remote_num_tokens":36,"remote_blocks_expiry_time":null,"transfer_mode":"pull"}}"#
    );
    assert!(text.contains(&dict), "{text}\nlacks\n{dict}");
}

#[tokio::test]
async fn streamed_prefill_carries_no_params_but_holds_blocks() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let mut body = with_params(chat(PROMPT, 1), json!({"do_remote_decode": true}));
    body["stream"] = json!(true);
    let reply = post(p.addr(), CHAT, &body).await;
    // Chunks carry the field as vLLM 0.33 sets it, null: no parameters.
    for event in reply.events().iter().filter(|e| e.is_object()) {
        assert_eq!(
            event.get("kv_transfer_params").unwrap_or(&Value::Null),
            &Value::Null
        );
    }
    let s = p.stats();
    assert_eq!(
        (s.prefill_requests, s.kv_params_returned, s.blocks_held),
        (1, 0, 3)
    );
}

#[tokio::test]
async fn lease_expiry_frees_blocks() {
    let p = SimEngine::start(SimConfig {
        kv_lease: Duration::from_millis(100),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let d = SimEngine::start(SimConfig::default()).await.unwrap();
    let params = prefill(&p, PROMPT).await;
    assert_eq!(p.stats().blocks_held, 3);
    let s = wait_for(&p, |s| s.blocks_held == 0).await;
    assert_eq!(s.side_channel_served, 0);
    assert_pull_fails(&d, &with_params(chat(PROMPT, 4), params), "expired").await;
}

#[tokio::test]
async fn side_channel_protocol_by_hand() {
    let p = SimEngine::start(SimConfig {
        engine_id: Some("e1".into()),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let params = prefill(&p, "a b c").await;
    let side = p.side_channel_addr();
    let exchange = |line: String| async move {
        let mut s = tokio::net::TcpStream::connect(side).await.unwrap();
        s.write_all(line.as_bytes()).await.unwrap();
        let mut answer = String::new();
        BufReader::new(s).read_line(&mut answer).await.unwrap();
        serde_json::from_str::<SideChannelResponse>(&answer).unwrap()
    };
    let bad = exchange("garbage\n".into()).await;
    assert!(!bad.ok && bad.error.is_some());
    let req = SideChannelRequest {
        engine_id: "e1".into(),
        request_id: params["remote_request_id"].as_str().unwrap().into(),
        block_ids: vec![0],
    };
    let good = exchange(format!("{}\n", serde_json::to_string(&req).unwrap())).await;
    assert!(good.ok, "{good:?}");
    assert_eq!(good.blocks.unwrap().len(), 1);
    assert!(good.prompt_digest.is_some());
    assert_eq!(p.stats().side_channel_served, 1);
    let again = exchange(format!("{}\n", serde_json::to_string(&req).unwrap())).await;
    assert!(!again.ok);
}

// ------------------------------------------------- KV release on abort

/// A decode engine that waits `request_delay` before it pulls, so that its
/// client can leave first.
async fn slow_decode() -> SimEngine {
    SimEngine::start(SimConfig {
        engine_id: Some("decode-0".into()),
        request_delay: Duration::from_millis(300),
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

/// Polls the engine's stats every 10 ms, at most for `within`.
async fn within(
    engine: &SimEngine,
    within: Duration,
    pred: impl Fn(&disagg_sim::Stats) -> bool,
) -> disagg_sim::Stats {
    let start = std::time::Instant::now();
    loop {
        let s = engine.stats();
        if pred(&s) {
            return s;
        }
        assert!(start.elapsed() < within, "not within {within:?}: {s:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Sends the decode leg and leaves after 50 ms, while it still waits.
async fn abort_decode(d: &SimEngine, params: Value) {
    let stream = raw_post(d.addr(), CHAT, &[], &with_params(chat(PROMPT, 4), params)).await;
    wait_for(d, |s| s.active_requests == 1).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(stream);
    let s = wait_for(d, |s| s.active_requests == 0).await;
    assert_eq!(
        (s.cancelled, s.remote_decodes, s.kv_pull_failures),
        (1, 0, 0),
        "{s:?}"
    );
}

#[tokio::test]
async fn decode_aborted_before_its_pull_releases_the_prefill_blocks() {
    let (p, _) = pair().await;
    let d = slow_decode().await;
    let params = prefill(&p, PROMPT).await;
    assert_eq!(p.stats().blocks_held, 3);

    abort_decode(&d, params.clone()).await;
    assert_eq!(d.stats().kv_releases_sent, 1);
    // Freed at once (the lease is 30 s), by the notice, not by a pull.
    let s = within(&p, Duration::from_secs(2), |s| s.blocks_held == 0).await;
    assert_eq!((s.kv_released_on_abort, s.side_channel_served), (1, 0));

    // Nothing is left to pull.
    assert_pull_fails(&d, &with_params(chat(PROMPT, 4), params), "released").await;
    assert_eq!(p.stats().kv_released_on_abort, 1);
}

#[tokio::test]
async fn decode_that_pulled_sends_no_release() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let d = SimEngine::start(SimConfig {
        inter_token_delay: Duration::from_millis(20),
        ..SimConfig::default()
    })
    .await
    .unwrap();

    // Completed normally.
    let params = prefill(&p, PROMPT).await;
    let reply = post(d.addr(), CHAT, &with_params(chat(PROMPT, 3), params)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());

    // Cancelled mid-stream, after its pull.
    let params = prefill(&p, PROMPT).await;
    let mut body = with_params(chat(PROMPT, 200), params);
    body["stream"] = json!(true);
    let mut conn = Conn::open(d.addr()).await;
    let resp = conn
        .send("POST", CHAT, &[], Some(serde_json::to_vec(&body).unwrap()))
        .await;
    assert_eq!(resp.status(), 200);
    let mut stream = resp.into_body();
    for _ in 0..3 {
        http_body_util::BodyExt::frame(&mut stream)
            .await
            .unwrap()
            .unwrap();
    }
    drop(stream);
    drop(conn);
    let ds = wait_for(&d, |s| s.active_requests == 0).await;
    assert_eq!(
        (ds.remote_decodes, ds.cancelled, ds.kv_releases_sent),
        (2, 1, 0)
    );
    // Give a stray notice time to arrive: there is none.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let ps = p.stats();
    assert_eq!(
        (
            ps.side_channel_served,
            ps.kv_released_on_abort,
            ps.blocks_held
        ),
        (2, 0, 0)
    );
}

#[tokio::test]
async fn release_naming_another_engine_or_request_frees_nothing() {
    let (p, _) = pair().await;
    let d = slow_decode().await;
    let params = prefill(&p, PROMPT).await;

    // Through a decode whose parameters name another engine id.
    let mut other = params.clone();
    other["remote_engine_id"] = json!("someone-else");
    abort_decode(&d, other).await;
    assert_eq!(d.stats().kv_releases_sent, 1);
    wait_for(&p, |s| s.side_channel_connections == 1).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let s = p.stats();
    assert_eq!((s.blocks_held, s.kv_released_on_abort), (3, 0));

    // By hand.
    let side = p.side_channel_addr();
    let exchange = |release: SideChannelRequest| async move {
        let line = serde_json::to_string(&SideChannelRelease { release }).unwrap();
        let mut s = tokio::net::TcpStream::connect(side).await.unwrap();
        s.write_all(format!("{line}\n").as_bytes()).await.unwrap();
        let mut answer = String::new();
        BufReader::new(s).read_line(&mut answer).await.unwrap();
        serde_json::from_str::<SideChannelResponse>(&answer).unwrap()
    };
    let good = SideChannelRequest {
        engine_id: "prefill-0".into(),
        request_id: params["remote_request_id"].as_str().unwrap().into(),
        block_ids: vec![0, 1, 2],
    };
    let wrong = [
        SideChannelRequest {
            engine_id: "someone-else".into(),
            ..good.clone()
        },
        SideChannelRequest {
            request_id: "nope".into(),
            ..good.clone()
        },
        SideChannelRequest {
            block_ids: vec![0, 1],
            ..good.clone()
        },
    ];
    for release in wrong {
        let answer = exchange(release.clone()).await;
        assert!(
            !answer.ok && answer.error.is_some(),
            "{release:?}: {answer:?}"
        );
        let s = p.stats();
        assert_eq!(
            (s.blocks_held, s.kv_released_on_abort),
            (3, 0),
            "{release:?}"
        );
    }
    let answer = exchange(good.clone()).await;
    assert!(answer.ok && answer.blocks.is_none(), "{answer:?}");
    let s = p.stats();
    assert_eq!((s.blocks_held, s.kv_released_on_abort), (0, 1));
    // Released once: a second notice frees nothing more.
    assert!(!exchange(good).await.ok);
    assert_eq!(p.stats().kv_released_on_abort, 1);
}
