//! Bad input and faults: each has a defined outcome in OpenAI's error format, and no
//! upstream request outlives the client's.

#[path = "../support/mod.rs"]
mod support;

use std::time::Duration;

use disagg_core::orchestrator::{MissingKv, PrefillFailure};
use disagg_sim::{Faults, SimConfig};
use support::*;
use tokio::io::AsyncReadExt;

fn faulty(faults: Faults) -> SimConfig {
    SimConfig {
        faults,
        ..Default::default()
    }
}

#[tokio::test]
async fn malformed_json_is_400() {
    let stack = Stack::start().await;
    for body in [
        r#"{"model":"sim-model","prompt":"#,
        "[1,2]",
        "",
        r#"{"model":5}"#,
        r#"{"stream":"maybe"}"#,
    ] {
        let a = post(&stack.url, "/v1/completions", body.to_owned(), &[]).await;
        assert_openai_error(&a, 400, "invalid_request_body");
    }
    assert_eq!(stack.p().stats().requests, 0, "nothing reached an engine");
    assert_eq!(stack.d().stats().requests, 0);
}

#[tokio::test]
async fn body_over_the_limit_is_413() {
    let stack = Stack::builder()
        .service(|s| s.max_body_bytes = 1024)
        .build()
        .await;
    let a = post(
        &stack.url,
        "/v1/completions",
        completion(&"word ".repeat(400), 2, false),
        &[],
    )
    .await;
    assert_openai_error(&a, 413, "request_too_large");
    let ok = post(
        &stack.url,
        "/v1/completions",
        completion("small", 2, false),
        &[],
    )
    .await;
    assert_eq!(ok.status, 200);
}

#[tokio::test]
async fn no_prefill_endpoint_is_503() {
    let stack = Stack::builder().prefill(vec![]).build().await;
    let a = post(
        &stack.url,
        "/v1/completions",
        completion("x", 2, false),
        &[],
    )
    .await;
    assert_openai_error(&a, 503, "no_prefill_endpoint");
    assert_eq!(get(&stack.url, "/health").await.status, 503);
    assert_eq!(stack.d().stats().requests, 0);
}

#[tokio::test]
async fn no_decode_endpoint_is_503() {
    let stack = Stack::builder().decode(vec![]).build().await;
    let a = post(
        &stack.url,
        "/v1/completions",
        completion("x", 2, false),
        &[],
    )
    .await;
    assert_openai_error(&a, 503, "no_decode_endpoint");
    assert_eq!(stack.p().stats().requests, 0);
}

#[tokio::test]
async fn decode_only_fallback_when_configured() {
    let stack = Stack::builder()
        .prefill(vec![])
        .config(|c| c.prefill_failure = PrefillFailure::DecodeOnly)
        .build()
        .await;
    let a = post(
        &stack.url,
        "/v1/completions",
        completion("fallback", 3, false),
        &[],
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.header("x-disagg-handoff"), Some("decode-only"));
    assert_eq!(stack.d().stats().local_prefills, 1);
    assert!(
        !stack.d().requests()[0]
            .body
            .as_object()
            .unwrap()
            .contains_key("kv_transfer_params")
    );
}

#[tokio::test]
async fn prefill_4xx_is_passed_through() {
    let stack = Stack::builder()
        .prefill(vec![faulty(Faults {
            status: Some(400),
            ..Default::default()
        })])
        .build()
        .await;
    let a = post(
        &stack.url,
        "/v1/completions",
        completion("x", 2, false),
        &[],
    )
    .await;
    assert_eq!(a.status, 400);
    assert_eq!(a.header("x-disagg-failed-leg"), Some("prefill"));
    assert_eq!(
        a.json()["error"]["type"],
        "BadRequestError",
        "the engine's own body"
    );
    assert_eq!(
        stack.d().stats().requests,
        0,
        "no decode leg after a failed prefill"
    );
}

#[tokio::test]
async fn unknown_model_is_the_engines_404() {
    let stack = Stack::start().await;
    let body = serde_json::json!({"model": "no-such-model", "prompt": "x"}).to_string();
    let a = post(&stack.url, "/v1/completions", body, &[]).await;
    assert_eq!(a.status, 404);
    assert!(
        a.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no-such-model")
    );
    assert_eq!(stack.d().stats().requests, 0);
}

#[tokio::test]
async fn prefill_5xx_is_502_with_the_engines_message() {
    let stack = Stack::builder()
        .prefill(vec![faulty(Faults {
            status: Some(500),
            ..Default::default()
        })])
        .build()
        .await;
    let a = post(&stack.url, "/v1/chat/completions", chat("x", 2, true), &[]).await;
    assert_openai_error(&a, 502, "prefill_failed");
    assert!(
        a.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("500"),
        "{}",
        a.text()
    );
    assert_eq!(stack.d().stats().requests, 0);
}

#[tokio::test]
async fn prefill_connection_refused_is_502() {
    let (dead, _held) = held_dead_url();
    let stack = Stack::builder()
        .prefill(vec![])
        .dead_prefill(dead)
        .build()
        .await;
    let a = post(
        &stack.url,
        "/v1/completions",
        completion("x", 2, false),
        &[],
    )
    .await;
    assert_openai_error(&a, 502, "prefill_failed");
    assert!(
        a.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("could not be reached")
    );
    assert_eq!(stack.d().stats().requests, 0);
}

#[tokio::test]
async fn prefill_timeout_is_504_and_the_prefill_request_is_abandoned() {
    let stack = Stack::builder()
        .prefill(vec![faulty(Faults {
            hang: true,
            ..Default::default()
        })])
        .config(|c| c.prefill_timeout = Duration::from_millis(300))
        .build()
        .await;
    let a = post(
        &stack.url,
        "/v1/completions",
        completion("x", 2, false),
        &[],
    )
    .await;
    assert_openai_error(&a, 504, "prefill_timeout");
    let p = stack.p();
    assert!(
        eventually(Duration::from_secs(1), || p.stats().active_requests == 0).await,
        "{:?}",
        p.stats()
    );
    assert_eq!(p.stats().cancelled, 1);
    assert_eq!(stack.d().stats().requests, 0);
}

#[tokio::test]
async fn decode_timeout_is_504() {
    let stack = Stack::builder()
        .decode(vec![faulty(Faults {
            hang: true,
            ..Default::default()
        })])
        .config(|c| c.decode_head_timeout = Duration::from_millis(300))
        .build()
        .await;
    let a = post(
        &stack.url,
        "/v1/completions",
        completion("x", 2, false),
        &[],
    )
    .await;
    assert_openai_error(&a, 504, "decode_timeout");
    let d = stack.d();
    assert!(eventually(Duration::from_secs(1), || d.stats().active_requests == 0).await);
}

#[tokio::test]
async fn wrong_side_channel_host_really_fails_the_decode() {
    // The prefill advertises a host where its side channel does not listen; the decode
    // engine's pull fails and its error reaches the client as the engine wrote it.
    let wrong = SimConfig {
        advertised_host: "127.0.0.2".into(),
        ..Default::default()
    };
    let stack = Stack::builder().prefill(vec![wrong]).build().await;
    let a = post(
        &stack.url,
        "/v1/completions",
        completion("x", 2, false),
        &[],
    )
    .await;
    assert_eq!(a.status, 500, "{}", a.text());
    assert_eq!(a.header("x-disagg-failed-leg"), Some("decode"));
    assert!(
        a.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("KV transfer failed")
    );
    assert_eq!(stack.d().stats().kv_pull_failures, 1);
    assert_eq!(stack.d().stats().remote_decodes, 0);
}

/// A stack whose prefill advertises a host where its side channel does not listen (every
/// decode's KV load fails), its listeners' reports and summaries kept.
async fn unloadable_kv() -> (Stack, Heard) {
    let wrong = SimConfig {
        advertised_host: "127.0.0.2".into(),
        ..Default::default()
    };
    let heard = Heard::default();
    let stack = Stack::builder()
        .prefill(vec![wrong])
        .listener(heard.clone())
        .build()
        .await;
    (stack, heard)
}

/// The one request on [`unloadable_kv`]'s stack failed its KV load once and was told
/// as the decode's failure: delivery broken with the error `error`, its one attempt
/// `DecodeFailed`, the prefill answered, the decode leg failed; a lost KV load's
/// suspect ([`Report::kv_load_suspect`](disagg_core::outcome::Report)) when the decode
/// answered as one does.
async fn told_as_the_decodes_failure(stack: &Stack, heard: &Heard, error: &str, suspect: bool) {
    assert_eq!(stack.d().stats().kv_pull_failures, 1);
    let report = the_decodes_failure(heard, error).await;
    // Passive health reads the prefill's handoffs across such decodes.
    assert_eq!(report.kv_load_suspect, suspect, "{report:?}");
}

/// The one request `heard` was told of broke with `error`, its one attempt the decode's
/// failure (`DecodeFailed`, the prefill answered, the decode leg failed): that attempt.
async fn the_decodes_failure(heard: &Heard, error: &str) -> disagg_core::outcome::Report {
    use disagg_core::outcome::{Delivery, LegOutcome, Outcome};
    let summary = heard.first(1).await.remove(0);
    assert_eq!(
        (summary.delivery, summary.error),
        (Delivery::Broken, Some(error))
    );
    let reports = heard.reports();
    let [report] = &reports[..] else {
        panic!("one attempt: {reports:?}")
    };
    assert_eq!(
        (report.outcome, report.prefill, report.decode),
        (
            Outcome::DecodeFailed,
            LegOutcome::Answered,
            LegOutcome::Failed
        )
    );
    report.clone()
}

/// The same wrong host under a streamed chat: the decode has sent its 200 head, so it
/// tells the failed KV load in its stream (vLLM 0.33: role chunk, error event, `[DONE]`).
/// The client gets the engine's stream as it was written, and the request is told as
/// what it was, not as a served answer: its attempt the decode's failure (passive health
/// and the request metrics hear it), its delivery broken, error `decode_error_event`.
#[tokio::test]
async fn a_kv_load_failure_streamed_by_the_decode_is_told_as_its_failure() {
    let (stack, heard) = unloadable_kv().await;
    let a = post(&stack.url, "/v1/chat/completions", chat("x", 4, true), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let events = a.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let error: serde_json::Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("KV transfer failed")),
        "{events:?}"
    );
    told_as_the_decodes_failure(&stack, &heard, "decode_error_event", true).await;
}

/// The same wrong host under a streamed completions request: vLLM 0.33 writes no error
/// event there (its generator skips the failed output before reading its finish), only
/// the usage chunk and `[DONE]`. Relayed as the engine wrote it, and told as the
/// decode's failure all the same: the stream carried no choice's finish reason, error
/// `decode_unfinished`.
#[tokio::test]
async fn a_kv_load_failure_on_a_streamed_completion_is_told_as_the_decodes_failure() {
    let (stack, heard) = unloadable_kv().await;
    let body = serde_json::json!({"model": "sim-model", "prompt": "x", "max_tokens": 4,
                                  "stream": true, "stream_options": {"include_usage": true}});
    let a = post(&stack.url, "/v1/completions", body.to_string(), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let events = a.events();
    assert_eq!(events.len(), 2, "the usage chunk and [DONE]: {events:?}");
    let usage: serde_json::Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(
        (&usage["choices"], &usage["usage"]["completion_tokens"]),
        (&serde_json::json!([]), &serde_json::json!(0)),
        "{events:?}"
    );
    assert_eq!(events[1], "[DONE]");
    told_as_the_decodes_failure(&stack, &heard, "decode_unfinished", true).await;
}

/// The same wrong host under a streamed `/cohere/v2/chat`: vLLM 0.33's Cohere route ends
/// the stream with a `message-end` whose `delta` holds the error (`finish_reason`
/// `ERROR`), then `[DONE]`. Relayed as it came, and told as the decode's failure: the
/// event names no status, but Cohere's route writes it only when the chat stream it
/// converts failed on the engine's side.
#[tokio::test]
async fn a_kv_load_failure_on_a_streamed_cohere_chat_is_told_as_the_decodes_failure() {
    let (stack, heard) = unloadable_kv().await;
    let body = serde_json::json!({"model": "sim-model", "max_tokens": 4, "stream": true,
                                  "messages": [{"role": "user", "content": "x"}]});
    let a = post(&stack.url, "/cohere/v2/chat", body.to_string(), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let events = a.events();
    assert_eq!(events.len(), 3, "{events:?}");
    let end: serde_json::Value = serde_json::from_str(&events[1]).unwrap();
    assert_eq!(
        (&end["type"], &end["delta"]["finish_reason"]),
        (&"message-end".into(), &"ERROR".into()),
        "{events:?}"
    );
    assert!(
        end["delta"]["error"]
            .as_str()
            .is_some_and(|m| m.contains("KV transfer failed")),
        "{events:?}"
    );
    assert_eq!(events[2], "[DONE]");
    told_as_the_decodes_failure(&stack, &heard, "decode_error_event", true).await;
}

/// The same wrong host under a streamed `/v1/responses`: vLLM 0.33 writes
/// `response.created` and `response.in_progress`, then its error payload fails the
/// stream's event validation and the server cuts the connection. The proxy relays the
/// two events and ends the client's stream with its own error event, a broken stream:
/// the decode's failure, and a lost KV load's suspect: cut before its first output item.
#[tokio::test]
async fn a_kv_load_failure_on_a_streamed_response_is_the_decodes_failure() {
    let (stack, heard) = unloadable_kv().await;
    let body = serde_json::json!({"model": "sim-model", "input": "x",
                                  "max_output_tokens": 4, "stream": true});
    let a = post(&stack.url, "/v1/responses", body.to_string(), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    // Each event's `data:` line (the Responses events have an `event:` line first).
    let text = a.text();
    let events: Vec<&str> = text
        .split("\n\n")
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .collect();
    let types: Vec<String> = events
        .iter()
        .map(|e| {
            let v: serde_json::Value = serde_json::from_str(e).unwrap();
            v["type"].as_str().unwrap_or("").to_owned()
        })
        .collect();
    assert_eq!(
        types[..2],
        ["response.created", "response.in_progress"],
        "{events:?}"
    );
    let last: serde_json::Value = serde_json::from_str(events[2]).unwrap();
    assert_eq!(last["error"]["code"], "decode_stream_failed", "{events:?}");
    assert_eq!(events.len(), 3, "no [DONE]: {events:?}");
    // The connection cut off: a broken stream, whatever broke it; before any output,
    // as a lost KV load cuts it.
    told_as_the_decodes_failure(&stack, &heard, "decode_stream_failed", true).await;
}

/// SGLang's `/generate`, streamed, whose decode's KV transfer failed (its prefill never
/// registered the room: the decode's bootstrap wait runs out): SGLang 0.5.23 sends its
/// 200 head at once and no error event, but one answer event whose
/// `meta_info.finish_reason` is `{"type":"abort",...,"status_code":500}`, then `[DONE]`
/// (`prepare_abort` in `disaggregation/decode.py`). The client gets the stream as the
/// engine wrote it, and it ends then (the prefill still running is dropped: no decode
/// takes its KV); the request is told as a failure, not a served answer, but its decode
/// leg is judged neither way: the prefill never answered, and which engine failed the
/// transfer cannot be told.
#[tokio::test]
async fn an_sglang_generate_stream_the_decode_aborted_is_its_failure() {
    use disagg_core::outcome::{Delivery, LegOutcome, Outcome};
    let heard = Heard::default();
    let stack = Stack::builder()
        .protocol(Protocol::Sglang)
        .prefill(vec![faulty(Faults {
            hang: true,
            ..Default::default()
        })])
        .decode(vec![SimConfig {
            bootstrap_timeout: Duration::from_millis(200),
            ..Default::default()
        }])
        .listener(heard.clone())
        .build()
        .await;
    let body = serde_json::json!({"text": "x", "sampling_params": {"max_new_tokens": 4},
                                  "stream": true});
    let a = post(&stack.url, "/generate", body.to_string(), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let events = a.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let aborted: serde_json::Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    let reason = &aborted["meta_info"]["finish_reason"];
    assert_eq!(
        (&reason["type"], &reason["status_code"]),
        (&"abort".into(), &500.into())
    );
    let summary = heard.first(1).await.remove(0);
    assert_eq!(
        (summary.delivery, summary.error),
        (Delivery::Broken, Some("decode_error_event"))
    );
    let report = heard.decode_attempt();
    assert_eq!(
        (report.outcome, report.prefill, report.decode),
        (
            Outcome::DecodeFailed,
            LegOutcome::Abandoned,
            LegOutcome::Abandoned
        ),
        "{report:?}"
    );
    assert!(!report.kv_load_suspect, "{report:?}");
}

/// The other side: a streamed `/v1/responses` whose decode (handed the KV, which it
/// loaded) breaks off after its output began is the decode's failure, not a lost KV
/// load's suspect: it was cut off mid-answer, as a dying engine cuts it.
#[tokio::test]
async fn a_response_stream_cut_mid_answer_is_no_lost_kv_load() {
    let heard = Heard::default();
    let stack = Stack::builder()
        .decode(vec![faulty(Faults {
            // The two opening events, the output item, its content part: then cut.
            drop_after_chunks: Some(4),
            ..Default::default()
        })])
        .listener(heard.clone())
        .build()
        .await;
    let body = serde_json::json!({"model": "sim-model", "input": "x",
                                  "max_output_tokens": 8, "stream": true});
    let a = post(&stack.url, "/v1/responses", body.to_string(), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert!(
        a.text().contains("event: response.output_item.added"),
        "{}",
        a.text()
    );
    assert!(a.text().contains("decode_stream_failed"), "{}", a.text());
    let report = the_decodes_failure(&heard, "decode_stream_failed").await;
    assert!(!report.kv_load_suspect, "{report:?}");
}

#[tokio::test]
async fn decode_failing_mid_stream_ends_with_an_sse_error_event() {
    let stack = Stack::builder()
        .decode(vec![faulty(Faults {
            drop_after_chunks: Some(3),
            ..Default::default()
        })])
        .build()
        .await;
    let a = post(&stack.url, "/v1/chat/completions", chat("x", 10, true), &[]).await;
    assert_eq!(a.status, 200);
    let events = a.events();
    assert!(!events.iter().any(|e| e == "[DONE]"), "{events:?}");
    let last: serde_json::Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "decode_stream_failed", "{events:?}");
    // The three chunks before the break reached the client.
    assert_eq!(events.len(), 4, "{events:?}");
}

/// A decode that breaks its stream after its first events, on each generation API whose
/// clients read errors in their own shape: the proxy's error event ends the client's
/// stream in that shape (Anthropic's `event: error`, which its client raises where it
/// skips an unnamed event; Cohere's `message-end` with its `delta.error`, then
/// `[DONE]`, as vLLM ends a failed Cohere stream; OpenAI's on the Responses API).
#[tokio::test]
async fn a_broken_stream_ends_with_the_error_event_of_its_api() {
    let stack = Stack::builder()
        .decode(vec![faulty(Faults {
            drop_after_chunks: Some(2),
            ..Default::default()
        })])
        .build()
        .await;
    let messages = serde_json::json!({"model": "sim-model", "max_tokens": 8, "stream": true,
                                      "messages": [{"role": "user", "content": "x"}]});
    let a = post(&stack.url, "/v1/messages", messages.to_string(), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let text = a.text();
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    let data = last
        .strip_prefix("event: error\ndata: ")
        .unwrap_or_else(|| panic!("Anthropic's error event last: {text}"));
    let v: serde_json::Value = serde_json::from_str(data).unwrap();
    assert_eq!(
        (&v["type"], &v["error"]["type"]),
        (&"error".into(), &"api_error".into()),
        "{text}"
    );
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("decode stream broke"))
    );

    let cohere = serde_json::json!({"model": "sim-model", "max_tokens": 8, "stream": true,
                                    "messages": [{"role": "user", "content": "x"}]});
    let a = post(&stack.url, "/cohere/v2/chat", cohere.to_string(), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let events = a.events();
    let n = events.len();
    assert_eq!(events[n - 1], "[DONE]", "{events:?}");
    let end: serde_json::Value = serde_json::from_str(&events[n - 2]).unwrap();
    assert_eq!(
        (&end["type"], &end["delta"]["finish_reason"]),
        (&"message-end".into(), &"ERROR".into()),
        "{events:?}"
    );

    let responses = serde_json::json!({"model": "sim-model", "input": "x",
                                       "max_output_tokens": 8, "stream": true});
    let a = post(&stack.url, "/v1/responses", responses.to_string(), &[]).await;
    let text = a.text();
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    let v: serde_json::Value = serde_json::from_str(
        last.strip_prefix("data: ")
            .unwrap_or_else(|| panic!("{text}")),
    )
    .unwrap();
    assert_eq!(v["error"]["code"], "decode_stream_failed", "{text}");
}

#[tokio::test]
async fn decode_failing_mid_body_aborts_a_non_streaming_answer() {
    let stack = Stack::builder()
        .decode(vec![faulty(Faults {
            drop_after_chunks: Some(0),
            ..Default::default()
        })])
        .build()
        .await;
    let req = http::Request::post(format!("{}/v1/completions", stack.url))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(completion(
            "x", 4, false,
        ))))
        .unwrap();
    let outcome: Result<(), Box<dyn std::error::Error + Send + Sync>> =
        tokio::time::timeout(Duration::from_secs(5), async {
            let resp = client().request(req).await?;
            use http_body_util::BodyExt;
            resp.into_body().collect().await?;
            Ok(())
        })
        .await
        .expect("no hang");
    assert!(
        outcome.is_err(),
        "a truncated answer must not look complete"
    );
}

#[tokio::test]
async fn client_disconnect_during_prefill_closes_the_prefill_request() {
    let stack = Stack::builder()
        .prefill(vec![faulty(Faults {
            hang: true,
            ..Default::default()
        })])
        .build()
        .await;
    let s = raw_request(&stack.url, "/v1/completions", &completion("x", 2, false)).await;
    let p = stack.p();
    assert!(eventually(Duration::from_secs(2), || p.stats().active_requests == 1).await);
    drop(s);
    assert!(
        eventually(Duration::from_secs(1), || {
            let st = p.stats();
            st.active_requests == 0 && st.open_connections == 0
        })
        .await,
        "prefill request and connection closed within 1 s: {:?}",
        p.stats()
    );
    assert_eq!(p.stats().cancelled, 1);
    assert_eq!(
        stack.d().stats().requests,
        0,
        "no decode leg for a client that left"
    );
}

#[tokio::test]
async fn client_disconnect_mid_stream_closes_the_decode_request() {
    let slow = SimConfig {
        inter_token_delay: Duration::from_millis(50),
        ..Default::default()
    };
    let stack = Stack::builder().decode(vec![slow]).build().await;
    let mut s = raw_request(&stack.url, "/v1/chat/completions", &chat("x", 200, true)).await;
    let mut buf = vec![0u8; 4096];
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0);
        got.extend_from_slice(&buf[..n]);
    }
    let d = stack.d();
    assert_eq!(d.stats().active_requests, 1);
    drop(s);
    assert!(
        eventually(Duration::from_secs(1), || {
            let st = d.stats();
            st.active_requests == 0 && st.open_connections == 0
        })
        .await,
        "decode request and connection closed within 1 s: {:?}",
        d.stats()
    );
    assert_eq!(d.stats().cancelled, 1);
    // The prefill leg had finished; its KV was pulled, nothing is stranded.
    assert_eq!(stack.p().stats().blocks_held, 0);
}

#[tokio::test]
async fn no_in_flight_count_outlives_its_request() {
    // Success, a decode failure mid-stream, a client that leaves mid-stream, and a
    // prefill failure: every path gives its in-flight counts back.
    let stack = Stack::builder()
        .decode(vec![
            SimConfig::default(),
            faulty(Faults {
                drop_after_chunks: Some(2),
                ..Default::default()
            }),
            SimConfig {
                inter_token_delay: Duration::from_millis(50),
                ..Default::default()
            },
        ])
        .build()
        .await;
    // Round-robin: the first request goes to the healthy decode, the second to the
    // breaking one.
    let ok = post(&stack.url, "/v1/chat/completions", chat("a", 4, true), &[]).await;
    assert_eq!(ok.status, 200);
    let broken = post(&stack.url, "/v1/chat/completions", chat("b", 8, true), &[]).await;
    assert!(
        broken.text().contains("decode_stream_failed"),
        "{}",
        broken.text()
    );
    assert_eq!(stack.in_flight(), 0);

    // The third goes to the slow decode; the client leaves after the first event.
    let mut s = raw_request(&stack.url, "/v1/chat/completions", &chat("c", 100, true)).await;
    let mut buf = vec![0u8; 4096];
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0);
        got.extend_from_slice(&buf[..n]);
    }
    assert_eq!(stack.in_flight(), 1, "the open stream is counted");
    drop(s);
    assert!(eventually(Duration::from_secs(1), || stack.in_flight() == 0).await);

    let failing = Stack::builder()
        .prefill(vec![faulty(Faults {
            status: Some(503),
            ..Default::default()
        })])
        .build()
        .await;
    let a = post(
        &failing.url,
        "/v1/completions",
        completion("d", 2, false),
        &[],
    )
    .await;
    assert_openai_error(&a, 502, "prefill_failed");
    assert_eq!(failing.in_flight(), 0);
}

// === a prefill that answers 2xx without a KV handoff ===

/// The prefill engines' `eos_period` in the missing-handoff tests.
const EOS_PERIOD: u32 = 3;

/// A prompt whose first generated token is EOS on an engine with [`EOS_PERIOD`].
fn eos_first_prompt() -> String {
    (0..)
        .map(|i| format!("stop at once {i}"))
        .find(|p| disagg_sim::generate(p, 1, EOS_PERIOD).is_empty())
        .expect("some prompt starts with EOS")
}

/// A NIXL stack whose prefill answers `"kv_transfer_params": null` and holds nothing
/// (the simulator's `withhold_kv_params` fault: what an older vLLM answered for a
/// prefill that ended "stopped", before vLLM 0.33's schedulers held a stopped
/// prefill's blocks too). Its prompt is [`eos_first_prompt`] and the proxy's rewriter
/// does not set `ignore_eos` (the setting for engines that refuse the field); the
/// decode engine has no EOS, so its answer is the whole `max_tokens`.
async fn stopped_prefill(missing: MissingKv) -> Stack {
    use disagg_connectors::vllm::rewrite::PrefillRewriter;
    Stack::builder()
        .prefill(vec![SimConfig {
            eos_period: EOS_PERIOD,
            faults: Faults {
                withhold_kv_params: true,
                ..Default::default()
            },
            ..Default::default()
        }])
        .connector(disagg_connectors::vllm::VllmNixl::with_rewriter(
            PrefillRewriter::new().with_ignore_eos(false),
        ))
        .config(|c| c.missing_kv = missing)
        .build()
        .await
}

#[tokio::test]
async fn a_prefill_without_handoff_lets_the_decode_compute_the_prompt_by_default() {
    let stack = stopped_prefill(MissingKv::default()).await;
    let prompt = eos_first_prompt();
    let expected = disagg_sim::generate(&prompt, 6, 0).concat();
    for stream in [false, true] {
        let a = post(
            &stack.url,
            "/v1/completions",
            completion(&prompt, 6, stream),
            &[],
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.header("x-disagg-handoff"), Some("none"));
        assert_eq!(a.content(), expected, "the decode's whole answer");
        if stream {
            assert_eq!(a.events().last().map(String::as_str), Some("[DONE]"));
        }
    }
    // The prefill answered both legs without KV and holds nothing.
    let p = stack.p().stats();
    assert_eq!(
        (p.prefill_requests, p.kv_params_returned, p.blocks_held),
        (2, 0, 0),
        "{p:?}"
    );
    // The decode got the client's body without a handoff and computed the prompt itself.
    let d = stack.d().stats();
    assert_eq!(
        (
            d.requests,
            d.local_prefills,
            d.remote_decodes,
            d.invalid_kv_params
        ),
        (2, 2, 0, 0),
        "{d:?}"
    );
    for r in stack.d().requests() {
        assert!(
            !r.body
                .as_object()
                .unwrap()
                .contains_key("kv_transfer_params"),
            "{:?}",
            r.body
        );
    }
    assert!(eventually(Duration::from_secs(1), || stack.in_flight() == 0).await);
}

#[tokio::test]
async fn a_prefill_without_handoff_is_502_under_missing_kv_fail() {
    let stack = stopped_prefill(MissingKv::Fail).await;
    let prompt = eos_first_prompt();
    for stream in [false, true] {
        let a = post(
            &stack.url,
            "/v1/completions",
            completion(&prompt, 6, stream),
            &[],
        )
        .await;
        assert_openai_error(&a, 502, "prefill_failed");
        assert!(a.text().contains("kv handoff"), "{}", a.text());
    }
    let p = stack.p().stats();
    assert_eq!((p.prefill_requests, p.blocks_held), (2, 0), "{p:?}");
    assert_eq!(stack.d().stats().requests, 0, "no decode leg was sent");
    assert!(eventually(Duration::from_secs(1), || stack.in_flight() == 0).await);
    // The same stack hands KV over as usual when the prefill answers with its handoff.
    stack.p().set_faults(Faults::default());
    let control = (0..)
        .map(|i| format!("go on {i}"))
        .find(|p| !disagg_sim::generate(p, 1, EOS_PERIOD).is_empty())
        .expect("some prompt does not start with EOS");
    let a = post(
        &stack.url,
        "/v1/completions",
        completion(&control, 4, false),
        &[],
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
    assert_eq!(stack.d().stats().remote_decodes, 1);
}

/// The same failed KV load on a streamed `/v1/messages` request: vLLM 0.33's Anthropic
/// route runs the chat stream generator under its converter, which writes
/// `message_start` for the role chunk, then an `event: error` typed after the status
/// (500: `api_error`), and nothing after it. The client gets that stream, and the
/// request is told as the decode's failure, as on chat.
#[tokio::test]
async fn a_kv_load_failure_streamed_by_the_decode_on_messages_is_told_as_its_failure() {
    let (stack, heard) = unloadable_kv().await;
    let body = serde_json::json!({"model": "sim-model", "max_tokens": 4, "stream": true,
                                  "messages": [{"role": "user", "content": "x"}]});
    let a = post(&stack.url, "/v1/messages", body.to_string(), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    // Anthropic's frames: `event: <name>` then `data: <json>`.
    let text = a.text();
    let frames: Vec<(&str, serde_json::Value)> = text
        .split("\n\n")
        .filter(|f| !f.is_empty())
        .map(|f| {
            let (name, data) = f.split_once('\n').unwrap_or_else(|| panic!("{text}"));
            let name = name
                .strip_prefix("event: ")
                .unwrap_or_else(|| panic!("{text}"));
            let data = data
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("{text}"));
            (name, serde_json::from_str(data).unwrap())
        })
        .collect();
    let names: Vec<&str> = frames.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, ["message_start", "error"], "{text}");
    let error = &frames[1].1;
    assert_eq!(
        (&error["type"], &error["error"]["type"]),
        (&"error".into(), &"api_error".into()),
        "{text}"
    );
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("KV transfer failed")),
        "{text}"
    );
    told_as_the_decodes_failure(&stack, &heard, "decode_error_event", true).await;
}
