//! An SGLang decode whose KV transfer fails, answered as SGLang 0.5.23 answers it (not
//! as vLLM does): the decode's scheduler aborts the request with finish reason
//! `{"type": "abort", "message": ..., "status_code": 500, "err_type": null}`
//! (`disaggregation/decode.py`, `prepare_abort` on `KVPoll.Failed`), and each route
//! turns that into its own answer:
//!
//! * not streamed (`/generate`, chat, completions): the tokenizer manager raises an
//!   `HTTPException(500)`, answered as SGLang's `ErrorResponse`,
//!   `{"object":"error","message":...,"type":"500","param":null,"code":500}`;
//! * a streamed `/generate`: its 200 head went out at once, and its stream is one
//!   event per request element whose `meta_info.finish_reason` is that abort (no text,
//!   no token), then `data: [DONE]`;
//! * a streamed chat or completions request: the generator's first output is awaited
//!   before the head ("kick-start"), so the 200 head comes with the failure: one
//!   `data: {"error": {...}}` event (`json.dumps` of the `ErrorResponse`, `type`
//!   `INTERNAL_SERVER_ERROR`), the usage chunk when asked for, then `data: [DONE]`.

mod common;

use std::time::Duration;

use common::*;
use disagg_sim::{KvMode, SimConfig, SimEngine, SimRole};
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";
const GENERATE: &str = "/generate";

const PROMPT: &str = "the quick brown fox jumps over the lazy dog";

async fn decode(bootstrap_timeout: Duration) -> SimEngine {
    SimEngine::start(SimConfig {
        kv_mode: KvMode::Sglang(SimRole::Decode),
        bootstrap_timeout,
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

/// `body` with bootstrap fields naming `port` on loopback and room 7.
fn to_room(mut body: Value, port: u16) -> Value {
    body["bootstrap_host"] = json!("127.0.0.1");
    body["bootstrap_port"] = json!(port);
    body["bootstrap_room"] = json!(7);
    body
}

fn chat(stream: bool) -> Value {
    json!({"model": "sim-model", "messages": [{"role": "user", "content": PROMPT}],
           "max_tokens": 4, "stream": stream})
}

fn completion(stream: bool) -> Value {
    json!({"model": "sim-model", "prompt": PROMPT, "max_tokens": 4, "stream": stream})
}

fn generate(stream: bool) -> Value {
    json!({"text": PROMPT, "sampling_params": {"max_new_tokens": 4}, "stream": stream})
}

/// Asserts SGLang's `ErrorResponse` for a failed transfer (not vLLM's `{"error": ...}`),
/// with the simulator's message saying why: nobody listens at `port`.
fn assert_sglang_error_response(reply: &Reply, port: u16) {
    assert_eq!(reply.status, 500, "{}", reply.text());
    assert_eq!(reply.headers["content-type"], "application/json");
    let body = reply.json();
    let keys: Vec<&str> = body
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(keys.len(), 5, "{body}");
    assert_eq!(body["object"], "error", "{body}");
    assert_eq!(body["type"], "500", "{body}");
    assert_eq!(body["param"], Value::Null, "{body}");
    assert_eq!(body["code"], 500, "{body}");
    assert!(body.get("error").is_none(), "{body}");
    let message = body["message"].as_str().unwrap();
    assert!(message.starts_with("KV transfer failed: "), "{message}");
    assert!(message.contains(&format!("127.0.0.1:{port}")), "{message}");
}

/// The error event of a streamed chat or completions request, as SGLang's
/// `create_streaming_error_response` writes it (`json.dumps`: its spacing).
fn assert_sglang_error_event(text: &str, event: &Value, port: u16) {
    assert!(
        text.starts_with(
            "data: {\"error\": {\"object\": \"error\", \"message\": \"KV transfer failed: "
        ),
        "{text}"
    );
    let error = &event["error"];
    assert_eq!(error["object"], "error", "{event}");
    assert_eq!(error["type"], "INTERNAL_SERVER_ERROR", "{event}");
    assert_eq!(error["param"], Value::Null, "{event}");
    assert_eq!(error["code"], 500, "{event}");
    let message = error["message"].as_str().unwrap();
    assert!(message.contains(&format!("127.0.0.1:{port}")), "{message}");
}

#[tokio::test]
async fn not_streamed_the_failure_is_sglangs_error_response_on_every_route() {
    let d = decode(Duration::from_secs(1)).await;
    let (port, _held) = unused_port();
    for (path, body) in [
        (GENERATE, generate(false)),
        (CHAT, chat(false)),
        (COMPLETIONS, completion(false)),
    ] {
        let reply = post(d.addr(), path, &to_room(body, port)).await;
        assert_sglang_error_response(&reply, port);
    }
    let s = wait_for(&d, |s| s.active_requests == 0).await;
    assert_eq!((s.kv_pull_failures, s.remote_decodes), (3, 0));
}

#[tokio::test]
async fn streamed_chat_and_completions_fail_with_the_error_event_then_usage_then_done() {
    let d = decode(Duration::from_secs(1)).await;
    let (port, _held) = unused_port();
    let prompt_tokens = PROMPT.split_whitespace().count();
    for path in [CHAT, COMPLETIONS] {
        for include_usage in [false, true] {
            let mut body = if path == CHAT {
                chat(true)
            } else {
                completion(true)
            };
            body["stream_options"] = json!({"include_usage": include_usage});
            let reply = post(d.addr(), path, &to_room(body, port)).await;
            assert_event_stream(&reply);
            let text = reply.text();
            let events = reply.events();
            // No role chunk, no token chunk: the error is the stream's first event.
            assert_sglang_error_event(&text, &events[0], port);
            if include_usage {
                // The loop was left with `break`: the usage chunk still follows.
                assert_eq!(events.len(), 3, "{path}: {text}");
                assert_eq!(events[1]["choices"], json!([]), "{path}: {text}");
                assert_eq!(events[1]["usage"]["prompt_tokens"], prompt_tokens);
                assert_eq!(events[1]["usage"]["completion_tokens"], 0);
            } else {
                assert_eq!(events.len(), 2, "{path}: {text}");
            }
            assert_eq!(events.last().unwrap(), "[DONE]", "{path}: {text}");
        }
    }
    let s = wait_for(&d, |s| s.active_requests == 0).await;
    assert_eq!((s.kv_pull_failures, s.remote_decodes), (4, 0));
}

/// The abort event of element `index` of a streamed `/generate` (`None`: not a batch).
fn assert_abort_event(event: &Value, index: Option<u64>, prompt_tokens: usize, says: &str) {
    assert_eq!(event["text"], "", "{event}");
    assert_eq!(event["output_ids"], json!([]), "{event}");
    assert_eq!(event.get("index").and_then(Value::as_u64), index, "{event}");
    let meta = &event["meta_info"];
    assert_eq!(meta["completion_tokens"], 0, "{event}");
    assert_eq!(meta["prompt_tokens"], prompt_tokens, "{event}");
    let finish = &meta["finish_reason"];
    assert_eq!(finish["type"], "abort", "{event}");
    assert_eq!(finish["status_code"], 500, "{event}");
    assert_eq!(finish["err_type"], Value::Null, "{event}");
    assert_eq!(finish.as_object().unwrap().len(), 4, "{event}");
    let message = finish["message"].as_str().unwrap();
    assert!(message.starts_with("KV transfer failed: "), "{message}");
    assert!(message.contains(says), "{message} does not say {says:?}");
}

#[tokio::test]
async fn streamed_generate_fails_with_an_abort_finish_reason_then_done() {
    let d = decode(Duration::from_secs(1)).await;
    let (port, _held) = unused_port();
    let reply = post(d.addr(), GENERATE, &to_room(generate(true), port)).await;
    assert_event_stream(&reply);
    let events = reply.events();
    assert_eq!(events.len(), 2, "{}", reply.text());
    let address = format!("127.0.0.1:{port}");
    assert_abort_event(
        &events[0],
        None,
        PROMPT.split_whitespace().count(),
        &address,
    );
    assert_eq!(events[1], "[DONE]");

    // A batch: every element's abort, each with its index.
    let mut batch = generate(true);
    batch["text"] = json!(["one two", "three four five"]);
    let mut batch = to_room(batch, port);
    batch["bootstrap_host"] = json!(["127.0.0.1", "127.0.0.1"]);
    batch["bootstrap_port"] = json!([port, port]);
    batch["bootstrap_room"] = json!([7, 8]);
    let reply = post(d.addr(), GENERATE, &batch).await;
    assert_event_stream(&reply);
    let events = reply.events();
    assert_eq!(events.len(), 3, "{}", reply.text());
    assert_abort_event(&events[0], Some(0), 2, &address);
    assert_abort_event(&events[1], Some(1), 3, &address);
    assert_eq!(events[2], "[DONE]");
    let s = wait_for(&d, |s| s.active_requests == 0).await;
    assert_eq!((s.kv_pull_failures, s.remote_decodes), (2, 0));
}

/// A streamed `/generate`'s `StreamingResponse` is returned before the engine runs:
/// its head goes out while the decode still waits for the room; a chat stream's head
/// waits for the generator's first output, the failure. Here no prefill ever
/// registers the room, so the wait ends with the bootstrap timeout.
#[tokio::test]
async fn a_streamed_generate_gets_its_head_before_the_wait_ends_a_chat_only_after() {
    let p = SimEngine::start(SimConfig {
        kv_mode: KvMode::Sglang(SimRole::Prefill),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let d = decode(Duration::from_secs(2)).await;
    let port = p.bootstrap_addr().unwrap().port();

    let body = serde_json::to_vec(&to_room(generate(true), port)).unwrap();
    let mut conn = Conn::open(d.addr()).await;
    let head = conn.send("POST", GENERATE, &[], Some(body)).await;
    assert_eq!(head.status(), 200);
    // The head came while the fetch still waits: nothing failed yet.
    let s = d.stats();
    assert_eq!((s.active_requests, s.kv_pull_failures), (1, 0), "{s:?}");
    let reply = read(head).await;
    let events = reply.events();
    assert_eq!(events.len(), 2, "{}", reply.text());
    let room = "no prefill for room 7";
    assert_abort_event(&events[0], None, PROMPT.split_whitespace().count(), room);
    let s = d.stats();
    assert_eq!((s.kv_pull_failures, s.bootstrap_timeouts), (1, 1), "{s:?}");

    // Served, the same early head is followed by the answer, its id echoed.
    let mut served = to_room(generate(true), port);
    served["bootstrap_room"] = json!(8);
    let headers = [("x-request-id", "gen-1")];
    let (pr, dr) = tokio::join!(
        post(p.addr(), GENERATE, &served),
        post_with(d.addr(), GENERATE, &headers, &served)
    );
    assert_eq!((pr.status, dr.status), (200, 200), "{}", dr.text());
    assert_eq!(dr.headers["x-request-id"], "gen-1");
    let events = dr.events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let last = &events[events.len() - 2];
    assert_eq!(
        last["meta_info"]["finish_reason"]["type"], "length",
        "{last}"
    );
    assert_eq!(d.stats().remote_decodes, 1);

    let body = serde_json::to_vec(&to_room(chat(true), port)).unwrap();
    let mut conn = Conn::open(d.addr()).await;
    let head = conn.send("POST", CHAT, &[], Some(body)).await;
    assert_eq!(head.status(), 200);
    // The chat head came with the failure.
    assert_eq!(d.stats().kv_pull_failures, 2);
    let reply = read(head).await;
    let events = reply.events();
    assert_eq!(events.len(), 2, "{}", reply.text());
    assert_eq!(events[0]["error"]["type"], "INTERNAL_SERVER_ERROR");
    assert_eq!(events[1], "[DONE]");
}
