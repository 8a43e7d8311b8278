//! vLLM's NIXL push mode (`KvMode::NixlPush`) over real loopback sockets:
//! the decode registers under its own request id, the prefill pairs the
//! registration with a finished request of the same base id.

mod common;

use std::time::{Duration, Instant};

use common::*;
use disagg_sim::{
    BootstrapResponse, KvMode, PushRegistration, SideChannelRegister, SimConfig, SimEngine,
    generate,
};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

const COMPLETIONS: &str = "/v1/completions";
/// The bootstrap timeout (how long either side waits for its peer).
const WAIT: Duration = Duration::from_millis(300);
const PROMPT: &str = "one two three four five six seven eight nine ten eleven twelve thirteen \
    fourteen fifteen sixteen seventeen eighteen";
const OTHER: &str = "a different prompt whose blocks cannot be the ones of the first prompt at all \
    no matter how it is cut";

async fn push_engine(engine_id: &str, tweak: impl FnOnce(&mut SimConfig)) -> SimEngine {
    let mut config = SimConfig {
        kv_mode: KvMode::NixlPush,
        engine_id: Some(engine_id.into()),
        bootstrap_timeout: WAIT,
        ..SimConfig::default()
    };
    tweak(&mut config);
    SimEngine::start(config).await.unwrap()
}

async fn pair() -> (SimEngine, SimEngine) {
    (
        push_engine("prefill-0", |_| {}).await,
        push_engine("decode-0", |_| {}).await,
    )
}

fn prefill_body(prompt: &str) -> Value {
    json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}})
}

/// The decode's parameters a proxy can write before the prefill answered:
/// the prefill's coordinates, no blocks.
fn push_params(p: &SimEngine) -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": p.engine_id(),
        "remote_host": "127.0.0.1",
        "remote_port": p.side_channel_addr().port(),
        "tp_size": 1,
    })
}

fn decode_body(prompt: &str, params: Value) -> Value {
    json!({"prompt": prompt, "max_tokens": 5, "kv_transfer_params": params})
}

async fn send(e: &SimEngine, id: Option<&str>, body: &Value) -> Reply {
    let headers: Vec<(&str, &str)> = id.map(|id| ("x-request-id", id)).into_iter().collect();
    post_with(e.addr(), COMPLETIONS, &headers, body).await
}

fn text(reply: &Reply) -> String {
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.json()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[tokio::test]
async fn sequential_push_pairs_by_request_id() {
    let (p, d) = pair().await;
    let pr = send(&p, Some("req-1"), &prefill_body(PROMPT)).await;
    assert_eq!(pr.status, 200, "{}", pr.text());
    let params = pr.json()["kv_transfer_params"].clone();
    // vLLM's push prefill answers like the pull one, plus the tokens computed;
    // its request id is the client's plus vLLM's `-` and 8 hex digits.
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["remote_engine_id"], "prefill-0");
    assert_eq!(params["remote_port"], p.side_channel_addr().port());
    assert_eq!(params["tp_size"], 1);
    assert_eq!(params["remote_num_tokens"], 18);
    // vLLM 0.33's push scheduler writes (`…/nixl/push_scheduler.py` `request_finished`)
    // one block list per KV-cache group, `pp_size` and `transfer_mode: "push"`, and no
    // `dcp_size` or `remote_blocks_expiry_time`.
    assert_eq!(params["remote_block_ids"], json!([[0, 1]]));
    assert_eq!(params["pp_size"], 1);
    assert_eq!(params["transfer_mode"], "push");
    let keys: Vec<&str> = params
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert!(
        !keys.contains(&"dcp_size") && !keys.contains(&"remote_blocks_expiry_time"),
        "{params}"
    );
    assert_eq!(keys.len(), 11, "{params}");
    let remote_id = params["remote_request_id"].as_str().unwrap();
    let suffix = remote_id.strip_prefix("req-1-").unwrap();
    assert!(suffix.len() == 8 && suffix.bytes().all(|b| b.is_ascii_hexdigit()));
    let held = p.stats().blocks_held;
    assert!(held > 0);

    // The decode leg carries the prefill's answer and the same request id.
    let dr = send(&d, Some("req-1"), &decode_body(PROMPT, params)).await;
    assert_eq!(text(&dr), generate(PROMPT, 5, 0).concat());
    let (ps, ds) = (p.stats(), d.stats());
    assert_eq!((ps.blocks_held, ps.side_channel_served), (0, 1));
    assert_eq!(ps.prefill_requests, 1);
    assert_eq!((ds.remote_decodes, ds.local_prefills), (1, 0));
}

#[tokio::test]
async fn concurrent_push_registration_waits_for_the_prefill() {
    let (p, d) = pair().await;
    // The decode registers first (a proxy dispatching both legs at once).
    let decode = {
        let (addr, body) = (d.addr(), decode_body(PROMPT, push_params(&p)));
        tokio::spawn(
            async move { post_with(addr, COMPLETIONS, &[("x-request-id", "r7")], &body).await },
        )
    };
    // It registered: the prefill's side channel has its connection.
    wait_for(&p, |s| s.side_channel_connections == 1).await;
    assert_eq!(
        send(&p, Some("r7"), &prefill_body(PROMPT)).await.status,
        200
    );
    let dr = decode.await.unwrap();
    assert_eq!(text(&dr), generate(PROMPT, 5, 0).concat());
    assert_eq!(p.stats().blocks_held, 0);
}

#[tokio::test]
async fn legs_with_different_ids_never_pair() {
    let (p, d) = pair().await;
    let pr = send(&p, Some("prefill-leg"), &prefill_body(PROMPT)).await;
    let params = pr.json()["kv_transfer_params"].clone();
    let started = Instant::now();
    let dr = send(&d, Some("decode-leg"), &decode_body(PROMPT, params.clone())).await;
    assert_transfer_failed(&dr, "within");
    assert!(started.elapsed() >= WAIT);
    assert_eq!(d.stats().bootstrap_timeouts, 1);
    // No id at all: the engine's own random ids never pair either.
    let dr = send(&d, None, &decode_body(PROMPT, params)).await;
    assert_transfer_failed(&dr, "within");
    // The prefill's KV was never taken: it waits for its lease.
    assert!(p.stats().blocks_held > 0);
    assert_eq!(p.stats().side_channel_served, 0);
}

#[tokio::test]
async fn a_repeated_id_in_flight_pairs_the_wrong_request() {
    let (p, d) = pair().await;
    // Two prefills with the same client id, different prompts, both held.
    for prompt in [PROMPT, OTHER] {
        assert_eq!(
            send(&p, Some("dup"), &prefill_body(prompt)).await.status,
            200
        );
    }
    // The decode of the second prompt pairs with the oldest "dup": the first
    // prompt's KV, which is not its own.
    let dr = send(&d, Some("dup"), &decode_body(OTHER, push_params(&p))).await;
    assert_transfer_failed(&dr, "do not match the prompt");
    // The first prompt's decode now gets the second prompt's KV.
    let dr = send(&d, Some("dup"), &decode_body(PROMPT, push_params(&p))).await;
    assert_transfer_failed(&dr, "do not match the prompt");
    assert_eq!(
        p.stats().blocks_held,
        0,
        "both were taken, by the wrong decodes"
    );

    // With distinct ids, the same two requests pair correctly in any order.
    for (id, prompt) in [("a-1", PROMPT), ("a-2", OTHER)] {
        assert_eq!(send(&p, Some(id), &prefill_body(prompt)).await.status, 200);
    }
    for (id, prompt) in [("a-2", OTHER), ("a-1", PROMPT)] {
        let dr = send(&d, Some(id), &decode_body(prompt, push_params(&p))).await;
        assert_eq!(text(&dr), generate(prompt, 5, 0).concat());
    }
}

#[tokio::test]
async fn wrong_engine_or_params_and_lease() {
    let p = push_engine("prefill-0", |c| c.kv_lease = WAIT).await;
    let d = push_engine("decode-0", |_| {}).await;
    assert_eq!(send(&p, Some("x"), &prefill_body(PROMPT)).await.status, 200);
    // Another engine id is refused at once.
    let mut params = push_params(&p);
    params["remote_engine_id"] = json!("nope");
    let started = Instant::now();
    let dr = send(&d, Some("x"), &decode_body(PROMPT, params)).await;
    assert_transfer_failed(&dr, "engine id mismatch");
    assert!(started.elapsed() < WAIT);
    // A key of the wrong type: vLLM cannot use it, and the prompt is prefilled locally.
    let mut params = push_params(&p);
    params["tp_size"] = json!("one");
    let dr = send(&d, Some("x"), &decode_body(PROMPT, params)).await;
    assert_eq!(text(&dr), generate(PROMPT, 5, 0).concat());
    let ds = d.stats();
    assert_eq!((ds.invalid_kv_params, ds.local_prefills), (1, 1));
    // Nobody took the KV: the lease frees it, and a late decode waits in vain.
    wait_for(&p, |s| s.blocks_held == 0).await;
    let dr = send(&d, Some("x"), &decode_body(PROMPT, push_params(&p))).await;
    assert_transfer_failed(&dr, "within");
}

/// vLLM 0.33's push scheduler indexes `remote_engine_id`, `remote_host`,
/// `remote_port` and `tp_size`: a dict without one is a `KeyError` that kills the
/// decode's engine core.
#[tokio::test]
async fn push_params_without_a_key_kill_the_decode_engine() {
    let p = push_engine("prefill-0", |_| {}).await;
    for key in ["remote_engine_id", "remote_host", "remote_port", "tp_size"] {
        let d = push_engine("decode-0", |_| {}).await;
        let mut params = push_params(&p);
        params.as_object_mut().unwrap().remove(key);
        let dr = send(&d, Some("x"), &decode_body(PROMPT, params)).await;
        assert_eq!(dr.status, 500, "{key}: {}", dr.text());
        let after = send(&d, Some("y"), &decode_body(PROMPT, json!(null))).await;
        assert_eq!(after.status, 500, "{key}: the engine is dead");
        assert_eq!(d.stats().engine_core_deaths, 1, "{key}");
    }
}

#[tokio::test]
async fn aborted_decode_releases_the_blocks_it_was_given() {
    let (p, d) = pair().await;
    let pr = send(&p, Some("gone"), &prefill_body(PROMPT)).await;
    let params = pr.json()["kv_transfer_params"].clone();
    assert!(p.stats().blocks_held > 0);
    // Registered under another id, the decode waits; its client leaves.
    let stream = raw_post(
        d.addr(),
        COMPLETIONS,
        &[("x-request-id", "other")],
        &decode_body(PROMPT, params),
    )
    .await;
    wait_for(&p, |s| s.side_channel_connections == 1).await;
    drop(stream);
    // The prefill's blocks named by the parameters are released at once.
    let ps = wait_for(&p, |s| s.blocks_held == 0).await;
    assert_eq!(ps.kv_released_on_abort, 1);
    assert_eq!(d.stats().kv_releases_sent, 1);
}

#[tokio::test]
async fn registration_line_by_hand() {
    let p = push_engine("prefill-0", |_| {}).await;
    assert_eq!(
        send(&p, Some("hand"), &prefill_body(PROMPT)).await.status,
        200
    );
    let mut stream = tokio::net::TcpStream::connect(p.side_channel_addr())
        .await
        .unwrap();
    let line = SideChannelRegister {
        register: PushRegistration {
            engine_id: "prefill-0".into(),
            request_id: "hand-0123abcd".into(),
        },
    };
    let mut out = serde_json::to_vec(&line).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out),
        r#"{"register":{"engine_id":"prefill-0","request_id":"hand-0123abcd"}}"#
    );
    out.push(b'\n');
    stream.write_all(&out).await.unwrap();
    let mut answer = String::new();
    BufReader::new(&mut stream)
        .read_line(&mut answer)
        .await
        .unwrap();
    let answer: BootstrapResponse = serde_json::from_str(&answer).unwrap();
    assert!(answer.ok, "{answer:?}");
    assert!(!answer.blocks.unwrap().is_empty());
    assert_eq!(p.stats().blocks_held, 0);

    // A NIXL pull engine refuses registrations.
    let pull = SimEngine::start(SimConfig::default()).await.unwrap();
    let mut stream = tokio::net::TcpStream::connect(pull.side_channel_addr())
        .await
        .unwrap();
    stream.write_all(&out).await.unwrap();
    let mut answer = String::new();
    BufReader::new(&mut stream)
        .read_line(&mut answer)
        .await
        .unwrap();
    let answer: BootstrapResponse = serde_json::from_str(&answer).unwrap();
    assert_eq!(
        answer.error.as_deref(),
        Some("this engine is not a NIXL push prefill")
    );
}
