//! P/D on the generation routes vLLM 0.33 takes a KV handoff on besides chat and
//! completions (issue #32), with the real `disagg-proxy serve` binary in front of
//! simulated vLLM engines over loopback: each route disaggregated with NIXL and
//! Mooncake, streamed and not, the engines' counters proving the KV moved; the prefill
//! leg checked field by field; an invalid body refused before any prefill; each route's
//! own error shape.

#![allow(missing_docs)] // a test binary

use disagg_sim::{KvMode, SimConfig, SimEngine, SimRole};
use serde_json::{Value, json};

mod common;
use common::{Proxy, post};

const TOKEN_IN: &str = "/inference/v1/generate";

async fn engine(kv_mode: KvMode) -> SimEngine {
    SimEngine::start(SimConfig {
        kv_mode,
        ..SimConfig::default()
    })
    .await
    .expect("start a simulated engine")
}

/// A NIXL pair behind a proxy.
async fn nixl() -> (SimEngine, SimEngine, Proxy) {
    let (p, d) = (engine(KvMode::Nixl).await, engine(KvMode::Nixl).await);
    let proxy = Proxy::start(&p, &d, &[]).await;
    (p, d, proxy)
}

/// A Mooncake pair behind a proxy (the prefill's bootstrap port named).
async fn mooncake() -> (SimEngine, SimEngine, Proxy) {
    let p = engine(KvMode::Mooncake(SimRole::Prefill)).await;
    let d = engine(KvMode::Mooncake(SimRole::Decode)).await;
    let port = p.bootstrap_addr().expect("a bootstrap server").port();
    let proxy = Proxy::start_args(&[
        "--prefill".to_owned(),
        p.url(),
        port.to_string(),
        "--decode".to_owned(),
        d.url(),
        "--connector".to_owned(),
        "mooncake".to_owned(),
    ])
    .await;
    (p, d, proxy)
}

/// Forty token ids: several KV blocks.
fn token_ids() -> Vec<u32> {
    (1000..1040).collect()
}

fn token_in(max_tokens: u32, stream: bool) -> String {
    json!({
        "model": "sim-model",
        "token_ids": token_ids(),
        "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "stop_token_ids": [7], "min_tokens": 2},
        "stream": stream,
    })
    .to_string()
}

/// The token ids of a token-in answer, streamed or whole.
fn generated_ids(a: &common::Answer) -> Vec<u64> {
    let ids = |v: &Value| -> Vec<u64> {
        v["choices"][0]["token_ids"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default()
    };
    if a.header("content-type")
        .is_some_and(|c| c.starts_with("text/event-stream"))
    {
        a.events()
            .iter()
            .filter(|e| *e != "[DONE]")
            .flat_map(|e| ids(&serde_json::from_str(e).expect("a JSON event")))
            .collect()
    } else {
        ids(&a.json())
    }
}

/// `/inference/v1/generate` over P/D, whole and streamed: the answer is the one an
/// engine alone gives, the decode took the KV from the prefill (a remote decode, no
/// local prefill), and the prefill answered a handoff per request.
async fn token_in_over(pair: (SimEngine, SimEngine, Proxy)) {
    let (p, d, proxy) = pair;
    let alone = engine(KvMode::Nixl).await;
    for stream in [false, true] {
        let expect = post(&alone.url(), TOKEN_IN, &token_in(6, false)).await;
        assert_eq!(expect.status, 200, "{}", expect.text());
        let a = post(&proxy.url(), TOKEN_IN, &token_in(6, stream)).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(generated_ids(&a), generated_ids(&expect), "stream {stream}");
        assert_eq!(generated_ids(&a).len(), 6);
        if stream {
            assert_eq!(a.events().last().map(String::as_str), Some("[DONE]"));
        } else {
            assert!(
                a.json()["request_id"]
                    .as_str()
                    .is_some_and(|id| id.starts_with("generate-tokens-"))
            );
            // The decode's answer carries no handoff of its own to the client.
            assert!(a.json()["kv_transfer_params"].is_null(), "{}", a.text());
        }
    }
    let (ps, ds) = (p.stats(), d.stats());
    assert_eq!(ps.prefill_requests, 2, "{ps:?}");
    assert_eq!((ds.remote_decodes, ds.local_prefills), (2, 0), "{ds:?}");
    assert!(p.requests().iter().all(|r| r.path == TOKEN_IN));
    assert!(d.requests().iter().all(|r| r.path == TOKEN_IN));
}

#[tokio::test]
async fn token_in_is_disaggregated_over_nixl() {
    token_in_over(nixl().await).await;
}

#[tokio::test]
async fn token_in_is_disaggregated_over_mooncake() {
    token_in_over(mooncake().await).await;
}

/// The prefill leg of `/inference/v1/generate`, field by field: one token, no stream,
/// no stop or minimum, the handoff asked for; the decode leg the client's body plus
/// the prefill's handoff.
#[tokio::test]
async fn token_in_prefill_leg_is_rewritten_field_by_field() {
    let (p, d, proxy) = nixl().await;
    let body = json!({
        "model": "sim-model",
        "token_ids": token_ids(),
        "sampling_params": {"max_tokens": 9, "min_tokens": 3, "stop": ["x"], "stop_token_ids": [7],
                            "include_stop_str_in_output": true, "logprobs": 2, "n": 1,
                            "temperature": 0.5, "seed": 11},
        "stream": true,
        "stream_options": {"include_usage": true},
        "cache_salt": "salt",
        "kv_transfer_params": {"remote_host": "evil.example"},
    });
    let a = post(&proxy.url(), TOKEN_IN, &body.to_string()).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let leg = &p.requests()[0].body;
    assert_eq!(
        leg["sampling_params"],
        json!({"max_tokens": 1, "n": 1, "temperature": 0.5, "seed": 11, "ignore_eos": true})
    );
    assert_eq!(leg["stream"], false);
    assert!(leg.get("stream_options").is_none());
    assert_eq!(leg["token_ids"], body["token_ids"]);
    assert_eq!(leg["cache_salt"], "salt");
    assert_eq!(leg["kv_transfer_params"]["do_remote_decode"], true);
    let decode = &d.requests()[0].body;
    for key in [
        "token_ids",
        "sampling_params",
        "stream",
        "stream_options",
        "cache_salt",
    ] {
        assert_eq!(decode[key], body[key], "{key}");
    }
    assert_eq!(decode["kv_transfer_params"]["do_remote_prefill"], true);
    assert_ne!(decode["kv_transfer_params"]["remote_host"], "evil.example");
}

/// A body vLLM would refuse is answered 400 in OpenAI's format before any leg: the
/// prefill engine sees nothing.
#[tokio::test]
async fn an_invalid_token_in_body_is_refused_before_any_prefill() {
    let (p, d, proxy) = nixl().await;
    for (body, param) in [
        (json!({"sampling_params": {}}), "token_ids"),
        (
            json!({"token_ids": "1 2 3", "sampling_params": {}}),
            "token_ids",
        ),
        (json!({"token_ids": [1, 2]}), "sampling_params"),
        (
            json!({"token_ids": [1, 2], "sampling_params": {"max_tokens": 0}}),
            "max_tokens",
        ),
        (
            json!({"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "min_tokens": 5}}),
            "min_tokens",
        ),
    ] {
        let a = post(&proxy.url(), TOKEN_IN, &body.to_string()).await;
        assert_eq!(a.status, 400, "{body}: {}", a.text());
        let v = a.json();
        assert_eq!(v["error"]["param"], param, "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    }
    assert_eq!(p.stats().requests, 0);
    assert_eq!(d.stats().requests, 0);
}
