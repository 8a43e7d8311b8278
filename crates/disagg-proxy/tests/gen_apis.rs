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

// === /v1/messages (vLLM's Anthropic API) ===

const MESSAGES: &str = "/v1/messages";

fn prompt() -> String {
    (0..40).map(|i| format!("m{i} ")).collect()
}

fn messages(max_tokens: u32, stream: bool) -> String {
    json!({
        "model": "sim-model",
        "system": "be brief",
        "messages": [{"role": "user", "content": prompt()}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
    .to_string()
}

/// The text of a Messages answer, streamed (`content_block_delta` events) or whole.
fn messages_text(a: &common::Answer) -> String {
    if a.header("content-type")
        .is_some_and(|c| c.starts_with("text/event-stream"))
    {
        let text = a.text();
        let mut out = String::new();
        for event in text.split("\n\n").filter(|e| !e.trim().is_empty()) {
            let mut lines = event.lines();
            let name = lines.next().and_then(|l| l.strip_prefix("event: "));
            let data = lines.next().and_then(|l| l.strip_prefix("data: "));
            let (Some(name), Some(data)) = (name, data) else {
                panic!("not an event:/data: pair: {event:?}");
            };
            let v: Value = serde_json::from_str(data).expect("a JSON event");
            assert_eq!(v["type"], name, "{event}");
            if name == "content_block_delta" {
                out.push_str(v["delta"]["text"].as_str().unwrap_or_default());
            }
        }
        out
    } else {
        a.json()["content"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
}

/// `/v1/messages` over P/D, whole and streamed: an engine alone's answer, the stream
/// Anthropic's `event:`/`data:` sequence, the decode's KV pulled from the prefill.
async fn messages_over(pair: (SimEngine, SimEngine, Proxy)) {
    let (p, d, proxy) = pair;
    let alone = engine(KvMode::Nixl).await;
    let expect = post(&alone.url(), MESSAGES, &messages(6, false)).await;
    assert_eq!(expect.status, 200, "{}", expect.text());
    let want = messages_text(&expect);
    assert!(!want.is_empty());
    for stream in [false, true] {
        let a = post(&proxy.url(), MESSAGES, &messages(6, stream)).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(messages_text(&a), want, "stream {stream}");
        if stream {
            let names: Vec<String> = a
                .text()
                .lines()
                .filter_map(|l| l.strip_prefix("event: ").map(str::to_owned))
                .collect();
            assert_eq!(names.first().map(String::as_str), Some("message_start"));
            assert_eq!(names.last().map(String::as_str), Some("message_stop"));
        } else {
            let v = a.json();
            assert_eq!(
                (v["type"].as_str(), v["stop_reason"].as_str()),
                (Some("message"), Some("max_tokens"))
            );
            // Anthropic drops null keys: no handoff reaches the client, not even `null`.
            assert!(
                v.get("kv_transfer_params").is_none_or(Value::is_null),
                "{v}"
            );
        }
    }
    let (ps, ds) = (p.stats(), d.stats());
    assert_eq!(ps.prefill_requests, 2, "{ps:?}");
    assert_eq!((ds.remote_decodes, ds.local_prefills), (2, 0), "{ds:?}");
    assert!(p.requests().iter().all(|r| r.path == MESSAGES));
    assert!(d.requests().iter().all(|r| r.path == MESSAGES));
}

#[tokio::test]
async fn messages_are_disaggregated_over_nixl() {
    messages_over(nixl().await).await;
}

/// The prefill leg of `/v1/messages`, field by field, with a `thinking` budget the
/// decode accepts (below `max_tokens`) but the one-token prefill would refuse without
/// the handoff's `do_remote_decode`.
async fn messages_prefill_leg(pair: (SimEngine, SimEngine, Proxy)) {
    let (p, d, proxy) = pair;
    let body = json!({
        "model": "sim-model",
        "system": "be brief",
        "messages": [{"role": "user", "content": prompt()}],
        "max_tokens": 40,
        "stop_sequences": ["never"],
        "stream": true,
        "temperature": 0.3,
        "thinking": {"type": "enabled", "budget_tokens": 20},
        "kv_transfer_params": {"remote_host": "evil.example"},
    });
    let a = post(&proxy.url(), MESSAGES, &body.to_string()).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let leg = &p.requests()[0].body;
    assert_eq!(leg["max_tokens"], 1);
    assert_eq!(leg["stream"], false);
    assert!(leg.get("stop_sequences").is_none());
    for key in ["model", "system", "messages", "temperature", "thinking"] {
        assert_eq!(leg[key], body[key], "{key}");
    }
    // Nothing of chat's that the Anthropic model would drop.
    for key in ["ignore_eos", "max_completion_tokens", "n"] {
        assert!(leg.get(key).is_none(), "{key}");
    }
    assert_eq!(leg["kv_transfer_params"]["do_remote_decode"], true);
    let decode = &d.requests()[0].body;
    for key in [
        "max_tokens",
        "stop_sequences",
        "stream",
        "messages",
        "thinking",
    ] {
        assert_eq!(decode[key], body[key], "{key}");
    }
    assert_ne!(decode["kv_transfer_params"]["remote_host"], "evil.example");
    assert_eq!(d.stats().remote_decodes, 1);
}

#[tokio::test]
async fn messages_prefill_leg_is_rewritten_field_by_field_over_nixl() {
    messages_prefill_leg(nixl().await).await;
}

/// A body vLLM's request model refuses is answered 400 in OpenAI's shape (as vLLM's
/// validation handler answers it), before any leg; the proxy's own failures on the
/// route are in Anthropic's shape, typed by status.
#[tokio::test]
async fn messages_errors_come_in_vllms_shapes_and_invalid_bodies_reach_no_engine() {
    let (p, d, proxy) = nixl().await;
    for (body, param) in [
        (json!({"model": "sim-model", "messages": []}), "max_tokens"),
        (json!({"messages": [], "max_tokens": 0}), "max_tokens"),
        (json!({"max_tokens": 5}), "messages"),
        (
            json!({"messages": [], "max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 8}}),
            "thinking",
        ),
    ] {
        let a = post(&proxy.url(), MESSAGES, &body.to_string()).await;
        assert_eq!(a.status, 400, "{body}: {}", a.text());
        let v = a.json();
        assert_eq!(v["error"]["param"], param, "{v}");
    }
    assert_eq!((p.stats().requests, d.stats().requests), (0, 0));
    // The decode engine fails: its own error, in Anthropic's shape, reaches the client.
    d.set_faults(disagg_sim::Faults {
        status: Some(500),
        ..disagg_sim::Faults::default()
    });
    let a = post(&proxy.url(), MESSAGES, &messages(4, false)).await;
    assert_eq!(a.status, 500, "{}", a.text());
    let v = a.json();
    assert_eq!(
        (&v["type"], &v["error"]["type"]),
        (&json!("error"), &json!("api_error")),
        "{v}"
    );
    // The decode cannot be reached: the proxy's own error, in Anthropic's shape, typed
    // by its status.
    let (dead, _held) = common::held_dead_url();
    let lonely =
        Proxy::start_args(&["--prefill".to_owned(), p.url(), "--decode".to_owned(), dead]).await;
    let a = post(&lonely.url(), MESSAGES, &messages(4, false)).await;
    let v = a.json();
    let want = match a.status.as_u16() {
        503 => "overloaded_error",
        s if s >= 500 => "api_error",
        s => panic!("status {s}: {v}"),
    };
    assert_eq!(
        (&v["type"], &v["error"]["type"]),
        (&json!("error"), &json!(want)),
        "{v}"
    );
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    // The same on chat: OpenAI's shape.
    let chat = json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let a = post(&lonely.url(), "/v1/chat/completions", &chat.to_string()).await;
    assert!(a.json()["error"]["code"].is_string(), "{}", a.text());
}

/// The `anthropic` Python client drives `/v1/messages` through the proxy, whole and
/// streamed, and gets its 400 error for a body the proxy refuses; and, through a proxy
/// whose decode breaks its stream after three events, the client's own error (the
/// proxy's error event in Anthropic's shape, `event: error`: the client skips an event
/// without a name, so OpenAI's shape would end the stream as a short answer).
#[tokio::test]
async fn the_anthropic_python_client_over_pd() {
    let (p, d, proxy) = nixl().await;
    let broken_p = engine(KvMode::Nixl).await;
    let broken_d = SimEngine::start(SimConfig {
        kv_mode: KvMode::Nixl,
        faults: disagg_sim::Faults {
            drop_after_chunks: Some(3),
            ..Default::default()
        },
        ..SimConfig::default()
    })
    .await
    .expect("start a simulated engine");
    let broken = Proxy::start(&broken_p, &broken_d, &[]).await;
    let alone = engine(KvMode::Nixl).await;
    let body = json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "tell me about disaggregated serving ".repeat(8)}],
        "max_tokens": 6,
    });
    let expect = post(&alone.url(), MESSAGES, &body.to_string()).await;
    let expect = messages_text(&expect);
    let script = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/python/anthropic_messages.py");
    let url = proxy.url();
    let broken_url = broken.url();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(common::python("the `anthropic` package"))
            .arg(script)
            .arg(url)
            .arg(expect)
            .arg(broken_url)
            .output()
    })
    .await
    .unwrap()
    .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "python failed:\n{stdout}\n{stderr}\n{}",
        proxy.log()
    );
    assert!(
        stdout.contains("anthropic messages: 4 checks passed"),
        "{stdout}"
    );
    assert_eq!(p.stats().prefill_requests, 2);
    assert_eq!(d.stats().remote_decodes, 2);
    // The client's key (`x-api-key`, as the SDK sends it) reaches neither leg.
    for leg in p.requests().iter().chain(d.requests().iter()) {
        assert!(leg.header("x-api-key").is_none(), "{:?}", leg.headers);
        assert!(leg.header("authorization").is_none(), "{:?}", leg.headers);
    }
}

// === /v1/responses (vLLM's Responses API) ===

const RESPONSES: &str = "/v1/responses";

fn responses(max_output_tokens: u32, stream: bool) -> Value {
    json!({
        "model": "sim-model",
        "instructions": "be brief",
        "input": [{"role": "user", "content": prompt()}],
        "max_output_tokens": max_output_tokens,
        "stream": stream,
    })
}

/// The `data:` payloads of an `event:`/`data:` stream, as JSON.
fn sse_data(a: &common::Answer) -> Vec<Value> {
    a.text()
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).expect("a JSON event"))
        .collect()
}

/// The text of a Responses answer, streamed (`response.output_text.delta` events) or
/// whole.
fn responses_text(a: &common::Answer) -> String {
    if a.header("content-type")
        .is_some_and(|c| c.starts_with("text/event-stream"))
    {
        sse_data(a)
            .iter()
            .filter(|v| v["type"] == "response.output_text.delta")
            .map(|v| v["delta"].as_str().unwrap_or_default().to_owned())
            .collect()
    } else {
        a.json()["output"][0]["content"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
}

/// `/v1/responses` over P/D, whole and streamed: an engine alone's answer, the decode's
/// KV pulled from the prefill; a request that keeps state (`store: true`,
/// `previous_response_id`) served by the decode alone.
async fn responses_over(pair: (SimEngine, SimEngine, Proxy)) {
    let (p, d, proxy) = pair;
    let alone = engine(KvMode::Nixl).await;
    let expect = post(&alone.url(), RESPONSES, &responses(6, false).to_string()).await;
    assert_eq!(expect.status, 200, "{}", expect.text());
    let want = responses_text(&expect);
    assert!(!want.is_empty());
    for stream in [false, true] {
        let a = post(&proxy.url(), RESPONSES, &responses(6, stream).to_string()).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
        assert_eq!(responses_text(&a), want, "stream {stream}");
        if stream {
            let events = sse_data(&a);
            let last = events.last().expect("events");
            assert_eq!(last["type"], "response.incomplete", "{last}");
        } else {
            assert!(a.json()["kv_transfer_params"].is_null(), "{}", a.text());
        }
    }
    let (ps, ds) = (p.stats(), d.stats());
    assert_eq!(ps.prefill_requests, 2, "{ps:?}");
    assert_eq!((ds.remote_decodes, ds.local_prefills), (2, 0), "{ds:?}");
    // State lives on one engine: such requests reach the decode alone.
    for (key, value) in [
        ("store", json!(true)),
        ("previous_response_id", json!("resp_1")),
    ] {
        let mut body = responses(4, false);
        body[key] = value;
        let a = post(&proxy.url(), RESPONSES, &body.to_string()).await;
        assert_eq!(
            a.header("x-disagg-handoff"),
            Some("direct"),
            "{key}: {}",
            a.text()
        );
    }
    // The prefill saw none of them.
    assert_eq!(p.stats().requests, 2);
}

#[tokio::test]
async fn responses_are_disaggregated_over_nixl() {
    responses_over(nixl().await).await;
}

/// The prefill leg of `/v1/responses`, field by field; an invalid body refused before
/// any leg in OpenAI's shape.
#[tokio::test]
async fn responses_prefill_leg_is_rewritten_and_invalid_bodies_reach_no_engine() {
    let (p, d, proxy) = nixl().await;
    for (body, param) in [
        (json!({"model": "sim-model"}), "input"),
        (
            json!({"input": "x", "max_output_tokens": 0}),
            "max_output_tokens",
        ),
    ] {
        let a = post(&proxy.url(), RESPONSES, &body.to_string()).await;
        assert_eq!(a.status, 400, "{body}: {}", a.text());
        assert_eq!(a.json()["error"]["param"], param, "{}", a.text());
    }
    assert_eq!((p.stats().requests, d.stats().requests), (0, 0));
    let mut body = responses(30, true);
    body["top_logprobs"] = json!(2);
    body["text"] = json!({"format": {"type": "text"}});
    body["temperature"] = json!(0.4);
    let a = post(&proxy.url(), RESPONSES, &body.to_string()).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let leg = &p.requests()[0].body;
    assert_eq!(
        (&leg["max_output_tokens"], &leg["stream"], &leg["store"]),
        (&json!(1), &json!(false), &json!(false))
    );
    for key in ["top_logprobs", "text"] {
        assert!(leg.get(key).is_none(), "{key}");
    }
    for key in ["model", "instructions", "input", "temperature"] {
        assert_eq!(leg[key], body[key], "{key}");
    }
    assert_eq!(leg["kv_transfer_params"]["do_remote_decode"], true);
    let decode = &d.requests()[0].body;
    for key in [
        "max_output_tokens",
        "stream",
        "top_logprobs",
        "text",
        "input",
    ] {
        assert_eq!(decode[key], body[key], "{key}");
    }
    assert_eq!(d.stats().remote_decodes, 1);
}

/// The `openai` Python client's Responses API through the proxy, whole and streamed.
#[tokio::test]
async fn the_openai_responses_client_over_pd() {
    let (p, d, proxy) = nixl().await;
    let alone = engine(KvMode::Nixl).await;
    let body = json!({
        "model": "sim-model",
        "input": "tell me about disaggregated serving ".repeat(8),
        "max_output_tokens": 6,
    });
    let expect = responses_text(&post(&alone.url(), RESPONSES, &body.to_string()).await);
    let script = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/python/openai_responses.py");
    let url = proxy.url();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(common::python("the `openai` package"))
            .arg(script)
            .arg(url)
            .arg(expect)
            .output()
    })
    .await
    .unwrap()
    .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "python failed:\n{stdout}\n{stderr}\n{}",
        proxy.log()
    );
    assert!(
        stdout.contains("openai responses: 2 checks passed"),
        "{stdout}"
    );
    assert_eq!(p.stats().prefill_requests, 2);
    assert_eq!(d.stats().remote_decodes, 2);
}

// === /cohere/v2/chat (vLLM's Cohere API) ===

const COHERE: &str = "/cohere/v2/chat";

fn cohere(max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": "sim-model",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt()}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

/// The text of a Cohere answer, streamed (`content-delta` events) or whole.
fn cohere_text(a: &common::Answer) -> String {
    if a.header("content-type")
        .is_some_and(|c| c.starts_with("text/event-stream"))
    {
        let events = a.events();
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str::<Value>(e).expect("a JSON event"))
            .filter(|v| v["type"] == "content-delta")
            .map(|v| {
                v["delta"]["message"]["content"]["text"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned()
            })
            .collect()
    } else {
        a.json()["message"]["content"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
}

/// `/cohere/v2/chat` over P/D, whole and streamed: an engine alone's answer, the
/// decode's KV pulled from the prefill.
async fn cohere_over(pair: (SimEngine, SimEngine, Proxy)) {
    let (p, d, proxy) = pair;
    let alone = engine(KvMode::Nixl).await;
    let expect = post(&alone.url(), COHERE, &cohere(6, false).to_string()).await;
    assert_eq!(expect.status, 200, "{}", expect.text());
    let want = cohere_text(&expect);
    assert!(!want.is_empty());
    for stream in [false, true] {
        let a = post(&proxy.url(), COHERE, &cohere(6, stream).to_string()).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
        assert_eq!(cohere_text(&a), want, "stream {stream}");
        if !stream {
            let v = a.json();
            assert_eq!(v["finish_reason"], "MAX_TOKENS", "{v}");
            assert!(
                v.get("kv_transfer_params").is_none_or(Value::is_null),
                "{v}"
            );
        }
    }
    let (ps, ds) = (p.stats(), d.stats());
    assert_eq!(ps.prefill_requests, 2, "{ps:?}");
    assert_eq!((ds.remote_decodes, ds.local_prefills), (2, 0), "{ds:?}");
}

#[tokio::test]
async fn cohere_chat_is_disaggregated_over_nixl() {
    cohere_over(nixl().await).await;
}

/// The prefill leg of `/cohere/v2/chat`, field by field; an invalid body refused before
/// any leg; the route's errors in Cohere's `{"message", "id"}` shape.
#[tokio::test]
async fn cohere_prefill_leg_is_rewritten_and_errors_come_in_cohere_shape() {
    let (p, d, proxy) = nixl().await;
    for (body, param) in [
        (json!({"model": "sim-model", "max_tokens": 3}), "messages"),
        (json!({"messages": [], "max_tokens": 0}), "max_tokens"),
    ] {
        let a = post(&proxy.url(), COHERE, &body.to_string()).await;
        assert_eq!(a.status, 400, "{body}: {}", a.text());
        assert_eq!(a.json()["error"]["param"], param, "{}", a.text());
    }
    assert_eq!((p.stats().requests, d.stats().requests), (0, 0));
    let mut body = cohere(30, true);
    body["stop_sequences"] = json!(["never"]);
    body["response_format"] = json!({"type": "json_object"});
    body["temperature"] = json!(0.4);
    let a = post(&proxy.url(), COHERE, &body.to_string()).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let leg = &p.requests()[0].body;
    assert_eq!(
        (&leg["max_tokens"], &leg["stream"]),
        (&json!(1), &json!(false))
    );
    for key in ["stop_sequences", "response_format"] {
        assert!(leg.get(key).is_none(), "{key}");
    }
    for key in ["model", "messages", "temperature"] {
        assert_eq!(leg[key], body[key], "{key}");
    }
    assert_eq!(leg["kv_transfer_params"]["do_remote_decode"], true);
    let decode = &d.requests()[0].body;
    for key in [
        "max_tokens",
        "stream",
        "stop_sequences",
        "response_format",
        "messages",
    ] {
        assert_eq!(decode[key], body[key], "{key}");
    }
    // The proxy's own failure: Cohere's shape, naming the client's request id.
    let (dead, _held) = common::held_dead_url();
    let lonely =
        Proxy::start_args(&["--prefill".to_owned(), p.url(), "--decode".to_owned(), dead]).await;
    let a = common::post_with(
        &lonely.url(),
        COHERE,
        &cohere(4, false).to_string(),
        &[("x-request-id", "cohere-req-1")],
    )
    .await;
    assert!(a.status.is_server_error(), "{}", a.text());
    let v = a.json();
    assert_eq!(v["id"], "cohere-req-1", "{v}");
    assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(v.get("error").is_none(), "{v}");
    // The engine's own error on the route: Cohere's shape too.
    d.set_faults(disagg_sim::Faults {
        status: Some(500),
        ..disagg_sim::Faults::default()
    });
    let a = post(&d.url(), COHERE, &cohere(4, false).to_string()).await;
    assert_eq!(a.status, 500);
    assert!(
        a.json()["message"].is_string() && a.json().get("error").is_none(),
        "{}",
        a.text()
    );
}

// === SGLang 0.5.23: /v1/messages and /v1/responses take its bootstrap fields ===

/// `/v1/messages` and `/v1/responses` over SGLang P/D (both legs at once, the same
/// bootstrap room): an engine alone's answer, the decode's KV taken from the prefill's
/// room; a stored Responses request on the decode alone; the vLLM-only routes refused.
#[tokio::test]
async fn sglang_serves_messages_and_responses_over_pd() {
    let sglang = |role| {
        SimEngine::start(SimConfig {
            kv_mode: KvMode::Sglang(role),
            bootstrap_timeout: std::time::Duration::from_secs(5),
            ..SimConfig::default()
        })
    };
    let p = sglang(SimRole::Prefill).await.expect("start");
    let d = sglang(SimRole::Decode).await.expect("start");
    // The same model without P/D (an SGLang decode takes no request without a room).
    let alone = engine(KvMode::Nixl).await;
    let port = p.bootstrap_addr().expect("a bootstrap server").port();
    let proxy = Proxy::start_args(&[
        "--prefill".to_owned(),
        p.url(),
        port.to_string(),
        "--decode".to_owned(),
        d.url(),
        "--connector".to_owned(),
        "sglang".to_owned(),
    ])
    .await;
    let expect = post(&alone.url(), MESSAGES, &messages(6, false)).await;
    let want = messages_text(&expect);
    let expect = post(&alone.url(), RESPONSES, &responses(6, false).to_string()).await;
    let want_responses = responses_text(&expect);
    for stream in [false, true] {
        let a = post(&proxy.url(), MESSAGES, &messages(6, stream)).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(messages_text(&a), want, "stream {stream}");
        let a = post(&proxy.url(), RESPONSES, &responses(6, stream).to_string()).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(responses_text(&a), want_responses, "stream {stream}");
    }
    let leg = &p.requests()[0].body;
    assert!(leg["bootstrap_room"].is_u64(), "{leg}");
    assert_eq!(
        d.requests()[0].body["bootstrap_room"],
        leg["bootstrap_room"]
    );
    assert_eq!(d.stats().remote_decodes, 4, "{:?}", d.stats());
    let mut stored = responses(4, false);
    stored["previous_response_id"] = json!("resp_1");
    let a = post(&proxy.url(), RESPONSES, &stored.to_string()).await;
    assert_eq!(a.header("x-disagg-handoff"), Some("direct"), "{}", a.text());
    for path in [TOKEN_IN, COHERE] {
        let a = post(&proxy.url(), path, &token_in(3, false)).await;
        assert_eq!(a.status, 400, "{path}: {}", a.text());
    }
    assert_eq!(p.stats().requests, 4);
}

/// Over vLLM Mooncake, the Anthropic, Responses and Cohere routes go to a decode
/// engine alone (`no_ignore_eos`): their request models drop `ignore_eos`, so an EOS
/// first token would end the prefill "stopped", vLLM's Mooncake prefill would keep no
/// KV, and the decode, sent at once, would wait for it for minutes. The decode serves
/// them from the prompt, as an engine alone does.
#[tokio::test]
async fn messages_responses_and_cohere_go_to_the_decode_alone_over_mooncake() {
    let (p, d, proxy) = mooncake().await;
    let bodies = [
        (MESSAGES, messages(6, false)),
        (RESPONSES, responses(6, false).to_string()),
        (COHERE, cohere(6, false).to_string()),
    ];
    for (path, body) in &bodies {
        let a = post(&proxy.url(), path, body).await;
        assert_eq!(a.status, 200, "{path}: {}", a.text());
        assert_eq!(a.header("x-disagg-handoff"), Some("direct"), "{path}");
    }
    assert_eq!(p.stats().requests, 0, "the prefill was asked");
    let ds = d.stats();
    assert_eq!((ds.remote_decodes, ds.local_prefills), (0, 3), "{ds:?}");
    // Chat stays disaggregated.
    let chat = json!({"model": "sim-model", "messages": [{"role": "user", "content": prompt()}], "max_tokens": 4});
    let a = post(&proxy.url(), "/v1/chat/completions", &chat.to_string()).await;
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"), "{}", a.text());
}
