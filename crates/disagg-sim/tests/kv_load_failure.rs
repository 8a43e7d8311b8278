//! A streamed vLLM decode whose KV load fails, answered as vLLM 0.33 answers it with
//! `kv_load_failure_policy="fail"`: the request finishes with finish reason `error`
//! (`vllm/v1/engine/__init__.py` `FinishReason.ERROR`), after Starlette's
//! `StreamingResponse` has sent the 200 head. The chat stream generator
//! (`vllm/entrypoints/openai/chat_completion/serving.py`) writes its role chunks, then
//! turns the error into one error event; the completions one
//! (`vllm/entrypoints/openai/completion/serving.py`) skips an output with no text and
//! no tokens before it looks at its finish reason, so without `echo` the stream ends
//! with no chunk of the answer. Either way `data: [DONE]` ends it.

mod common;

use common::*;
use disagg_sim::{KvMode, SimConfig, SimEngine, SimRole};
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

// 36 words: 3 blocks of 16 tokens.
const PROMPT: &str = "the quick brown fox jumps over the lazy dog and then some more words follow \
    so that the prompt spans several blocks of sixteen tokens each which is what we want here \
    to test block lists";

/// The prefill leg's `kv_transfer_params`, naming an engine the decode cannot pull
/// from: its pull fails.
async fn unpullable_params(p: &SimEngine) -> Value {
    let body = json!({"model": "sim-model", "prompt": PROMPT, "max_tokens": 1,
                      "kv_transfer_params": {"do_remote_decode": true}});
    let reply = post(p.addr(), COMPLETIONS, &body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let mut params = reply.json()["kv_transfer_params"].clone();
    params["remote_engine_id"] = json!("someone-else");
    params
}

/// Asserts the error event of a failed KV load: vLLM's shape for its
/// `GenerationError` (500 `InternalServerError`), the simulator saying why.
fn assert_error_event(event: &Value) {
    let error = &event["error"];
    assert_eq!(error["type"], "InternalServerError", "{event}");
    assert_eq!(error["code"], 500, "{event}");
    assert_eq!(error["param"], Value::Null, "{event}");
    let message = error["message"].as_str().unwrap();
    assert!(message.starts_with("KV transfer failed: "), "{message}");
    assert!(message.contains("someone-else"), "{message}");
}

#[tokio::test]
async fn streamed_chat_decode_whose_pull_fails_sends_role_chunks_then_the_error_event() {
    let (p, d) = pair().await;
    let params = unpullable_params(&p).await;
    let body = json!({"model": "sim-model", "messages": [{"role": "user", "content": PROMPT}],
                      "max_tokens": 4, "n": 2, "stream": true, "return_token_ids": true,
                      "stream_options": {"include_usage": true},
                      "kv_transfer_params": params});
    let reply = post(d.addr(), CHAT, &body).await;
    assert_event_stream(&reply);
    let events = reply.events();
    assert_eq!(events.len(), 4, "{}", reply.text());
    // The first output makes the role chunk of every choice, each with the prompt's
    // ids (vLLM builds every one of them with `prompt_token_ids`); its finish reason
    // `error` then raises before any token chunk, and the usage chunk (inside the same
    // `try`) is never written.
    for (i, role) in events[..2].iter().enumerate() {
        assert_eq!(role["object"], "chat.completion.chunk", "{role}");
        let choice = &role["choices"][0];
        assert_eq!(choice["index"], i, "{role}");
        assert_eq!(choice["delta"], json!({"role": "assistant", "content": ""}));
        assert_eq!(choice["finish_reason"], Value::Null);
        assert!(role.get("usage").is_none(), "{role}");
        assert_eq!(
            role["prompt_token_ids"].as_array().map(Vec::len),
            Some(PROMPT.split_whitespace().count()),
            "{role}"
        );
    }
    assert_eq!(events[0]["prompt_token_ids"], events[1]["prompt_token_ids"]);
    assert_error_event(&events[2]);
    assert_eq!(events[3], "[DONE]");

    // With continuous usage, the role chunk carries it: the prompt, no completion token.
    let mut body = body;
    body["n"] = json!(1);
    body["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
    let reply = post(d.addr(), CHAT, &body).await;
    assert_event_stream(&reply);
    let events = reply.events();
    assert_eq!(events.len(), 3, "{}", reply.text());
    let prompt_tokens = PROMPT.split_whitespace().count();
    assert_eq!(
        events[0]["usage"],
        json!({"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
               "completion_tokens": 0})
    );
    assert_error_event(&events[1]);
    assert_eq!(events[2], "[DONE]");

    // Counted as the failed pulls they are, nothing else.
    let s = wait_for(&d, |s| s.active_requests == 0).await;
    assert_eq!(
        (
            s.kv_pull_failures,
            s.remote_decodes,
            s.local_prefills,
            s.cancelled
        ),
        (2, 0, 0, 0)
    );
    // The pull never reached the prefill's blocks.
    assert_eq!(p.stats().blocks_held, 3);
}

#[tokio::test]
async fn streamed_completion_decode_whose_pull_fails_ends_without_a_chunk_of_the_answer() {
    let (p, d) = pair().await;
    let params = unpullable_params(&p).await;
    let prompt_tokens = PROMPT.split_whitespace().count();
    for include_usage in [false, true] {
        let body = json!({"model": "sim-model", "prompt": PROMPT, "max_tokens": 4,
                          "stream": true, "stream_options": {"include_usage": include_usage},
                          "kv_transfer_params": params.clone()});
        let reply = post(d.addr(), COMPLETIONS, &body).await;
        assert_event_stream(&reply);
        let events = reply.events();
        if include_usage {
            // The loop ended normally: its usage chunk, no completion token.
            assert_eq!(events.len(), 2, "{}", reply.text());
            assert_eq!(events[0]["object"], "text_completion");
            assert_eq!(events[0]["choices"], json!([]));
            assert_eq!(
                events[0]["usage"],
                json!({"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                       "completion_tokens": 0})
            );
        } else {
            assert_eq!(events.len(), 1, "{}", reply.text());
        }
        assert_eq!(events.last().unwrap(), "[DONE]");
    }
    // Not streamed, the same failure is vLLM's 500.
    let body = json!({"model": "sim-model", "prompt": PROMPT, "max_tokens": 4,
                      "kv_transfer_params": params});
    let reply = post(d.addr(), COMPLETIONS, &body).await;
    assert_eq!(reply.status, 500, "{}", reply.text());
    assert_error_event(&reply.json());

    let s = wait_for(&d, |s| s.active_requests == 0).await;
    assert_eq!(
        (
            s.kv_pull_failures,
            s.remote_decodes,
            s.local_prefills,
            s.cancelled
        ),
        (3, 0, 0, 0)
    );
}

#[tokio::test]
async fn streamed_completion_with_echo_gets_the_error_event() {
    let (p, d) = pair().await;
    let params = unpullable_params(&p).await;
    // The echoed prompt is text to send: the output reaches the finish-reason check.
    let body = json!({"model": "sim-model", "prompt": PROMPT, "max_tokens": 4, "echo": true,
                      "stream": true, "stream_options": {"include_usage": true},
                      "kv_transfer_params": params});
    let reply = post(d.addr(), COMPLETIONS, &body).await;
    assert_event_stream(&reply);
    let events = reply.events();
    assert_eq!(events.len(), 2, "{}", reply.text());
    assert_error_event(&events[0]);
    assert_eq!(events[1], "[DONE]");
    assert_eq!(d.stats().kv_pull_failures, 1);
}

/// vLLM's completions stream generator asserts `request.max_tokens is not None` on each
/// output before its echo branch and its skip of an empty output: given
/// `"max_tokens": null`, the failed load's output raises that, and the stream is its
/// error event, then `data: [DONE]`, with no usage chunk (the `try` was left), echo or
/// not. Not streamed, `_raise_if_error` comes first: the KV failure's 500.
#[tokio::test]
async fn streamed_completion_with_a_null_max_tokens_gets_the_null_limit_error_event() {
    let (p, d) = pair().await;
    let params = unpullable_params(&p).await;
    for echo in [false, true] {
        let body = json!({"model": "sim-model", "prompt": PROMPT, "max_tokens": null,
                          "echo": echo, "stream": true,
                          "stream_options": {"include_usage": true},
                          "kv_transfer_params": params.clone()});
        let reply = post(d.addr(), COMPLETIONS, &body).await;
        assert_event_stream(&reply);
        let events = reply.events();
        assert_eq!(events.len(), 2, "echo {echo}: {}", reply.text());
        let error = &events[0]["error"];
        assert_eq!(error["type"], "InternalServerError", "{}", events[0]);
        assert_eq!(error["code"], 500, "{}", events[0]);
        assert_eq!(
            error["message"], "max_tokens must not be None",
            "{}",
            events[0]
        );
        assert_eq!(events[1], "[DONE]");
    }
    let body = json!({"model": "sim-model", "prompt": PROMPT, "max_tokens": null,
                      "kv_transfer_params": params});
    let reply = post(d.addr(), COMPLETIONS, &body).await;
    assert_eq!(reply.status, 500, "{}", reply.text());
    assert_error_event(&reply.json());

    let s = wait_for(&d, |s| s.active_requests == 0).await;
    assert_eq!((s.kv_pull_failures, s.remote_decodes), (3, 0));
}

async fn engine(kv_mode: KvMode, engine_id: &str) -> SimEngine {
    SimEngine::start(SimConfig {
        kv_mode,
        engine_id: Some(engine_id.into()),
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

/// A Mooncake decode whose fetch fails (an engine id the prefill's bootstrap server does
/// not serve) streams the failure as NIXL's does.
#[tokio::test]
async fn streamed_mooncake_decode_whose_fetch_fails_sends_the_error_event() {
    let p = engine(KvMode::Mooncake(SimRole::Prefill), "prefill-0").await;
    let d = engine(KvMode::Mooncake(SimRole::Decode), "decode-0").await;
    let messages = json!([{"role": "user", "content": PROMPT}]);
    let prefill = json!({"model": "sim-model", "messages": messages, "max_tokens": 1,
                         "kv_transfer_params": {"do_remote_decode": true,
                                                "do_remote_prefill": false,
                                                "transfer_id": "t"}});
    assert_eq!(post(p.addr(), CHAT, &prefill).await.status, 200);
    let decode = json!({"model": "sim-model", "messages": messages, "max_tokens": 4,
                        "stream": true,
                        "kv_transfer_params": {
                            "do_remote_prefill": true, "do_remote_decode": false,
                            "remote_bootstrap_addr":
                                format!("http://{}", p.bootstrap_addr().unwrap()),
                            "remote_engine_id": "someone-else", "transfer_id": "t"}});
    let reply = post(d.addr(), CHAT, &decode).await;
    assert_event_stream(&reply);
    let events = reply.events();
    assert_eq!(events.len(), 3, "{}", reply.text());
    assert_eq!(
        events[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert_error_event(&events[1]);
    assert_eq!(events[2], "[DONE]");
    let s = wait_for(&d, |s| s.active_requests == 0).await;
    assert_eq!((s.kv_pull_failures, s.remote_decodes), (1, 0));
}

/// A NIXL push decode told another prefill engine id is refused at once; streamed, the
/// refusal is in the stream.
#[tokio::test]
async fn streamed_push_decode_whose_registration_fails_sends_the_error_event() {
    let p = engine(KvMode::NixlPush, "prefill-0").await;
    let d = engine(KvMode::NixlPush, "decode-0").await;
    let headers = [("x-request-id", "req-1")];
    let prefill = json!({"model": "sim-model", "prompt": PROMPT, "max_tokens": 1,
                         "kv_transfer_params": {"do_remote_decode": true}});
    assert_eq!(
        post_with(p.addr(), COMPLETIONS, &headers, &prefill)
            .await
            .status,
        200
    );
    let decode = json!({"model": "sim-model", "prompt": PROMPT, "max_tokens": 4,
                        "echo": true, "stream": true,
                        "kv_transfer_params": {
                            "do_remote_prefill": true, "do_remote_decode": false,
                            "remote_engine_id": "someone-else", "remote_host": "127.0.0.1",
                            "remote_port": p.side_channel_addr().port(), "tp_size": 1}});
    let reply = post_with(d.addr(), COMPLETIONS, &headers, &decode).await;
    assert_event_stream(&reply);
    assert_eq!(reply.headers["x-request-id"], "req-1");
    let events = reply.events();
    assert_eq!(events.len(), 2, "{}", reply.text());
    assert_error_event(&events[0]);
    assert_eq!(events[1], "[DONE]");
    let s = wait_for(&d, |s| s.active_requests == 0).await;
    assert_eq!((s.kv_pull_failures, s.remote_decodes), (1, 0));
}

/// A stream's Anthropic events (`event:`/`data:` pairs): each one's name and data, the
/// data's `type` checked to be the name.
fn anthropic_events(reply: &Reply) -> Vec<(String, Value)> {
    let text = reply.text();
    assert!(text.ends_with("\n\n"), "{text:?}");
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (name, data) = e.split_once('\n').unwrap_or_else(|| panic!("{e:?}"));
            let name = name
                .strip_prefix("event: ")
                .unwrap_or_else(|| panic!("{e:?}"));
            let data = data
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("{e:?}"));
            let data: Value = serde_json::from_str(data).unwrap();
            assert_eq!(data["type"], name, "{e:?}");
            (name.to_owned(), data)
        })
        .collect()
}

/// vLLM's `/v1/messages` runs the chat stream generator under its Anthropic converter
/// (`vllm/entrypoints/anthropic/serving.py` `message_stream_converter`): the role chunk
/// of the failed load's first output becomes `message_start`, and the generator's
/// error (the `ErrorResponse` of `chat_completion_stream_generator_raw`) ends the
/// stream with an `error` event typed after its status (`translate_error_type`: 500 is
/// `api_error`); no content block was open, and no `message_stop` or `[DONE]` follows.
/// Not streamed, the same failure is the route's 500 in Anthropic's shape.
#[tokio::test]
async fn streamed_messages_decode_whose_pull_fails_sends_message_start_then_the_error_event() {
    let (p, d) = pair().await;
    let params = unpullable_params(&p).await;
    let headers = [("x-request-id", "msg-1")];
    let body = json!({"model": "sim-model", "max_tokens": 4, "stream": true,
                      "messages": [{"role": "user", "content": PROMPT}],
                      "kv_transfer_params": params});
    let reply = post_with(d.addr(), "/v1/messages", &headers, &body).await;
    assert_event_stream(&reply);
    assert_eq!(reply.headers["x-request-id"], "msg-1");
    let events = anthropic_events(&reply);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["message_start", "error"], "{}", reply.text());
    let message = &events[0].1["message"];
    assert_eq!(message["role"], "assistant", "{message}");
    assert_eq!(message["model"], "sim-model", "{message}");
    assert_eq!(message["content"], json!([]), "{message}");
    assert_eq!(message["stop_reason"], Value::Null, "{message}");
    assert_eq!(
        message["usage"],
        json!({"input_tokens": PROMPT.split_whitespace().count(), "output_tokens": 0})
    );
    let error = &events[1].1["error"];
    assert_eq!(error["type"], "api_error", "{error}");
    let text = error["message"].as_str().unwrap();
    assert!(text.starts_with("KV transfer failed: "), "{text}");
    assert!(text.contains("someone-else"), "{text}");

    let mut whole = body;
    whole["stream"] = json!(false);
    let reply = post(d.addr(), "/v1/messages", &whole).await;
    assert_eq!(reply.status, 500, "{}", reply.text());
    let answer = reply.json();
    assert_eq!(answer["type"], "error", "{answer}");
    assert_eq!(answer["error"]["type"], "api_error", "{answer}");

    let s = wait_for(&d, |s| s.active_requests == 0).await;
    assert_eq!(
        (s.kv_pull_failures, s.remote_decodes, s.local_prefills),
        (2, 0, 0)
    );
}
