//! A decode whose KV load fails (vLLM 0.33, `kv_load_failure_policy="fail"`) ends a
//! streamed answer it never began: a chat with its role chunk, an error event and
//! `[DONE]`; a completions request with nothing of the answer before `[DONE]`. With
//! migration on, the stream is continued on another decode; when it cannot be, the
//! client's stream ends with the proxy's error event and the request is a failure.

use disagg_core::outcome::Delivery;

use super::*;

/// A prefill that advertises a host where its side channel does not listen: every
/// decode's KV pull fails.
fn unreachable_kv() -> SimConfig {
    SimConfig {
        advertised_host: "127.0.0.2".into(),
        ..SimConfig::default()
    }
}

/// Every decode fails its KV load, migration allowed once: the chat's first leg ends
/// with the engine's error event, its continuation (through a fresh prefill) fails its
/// KV load too and says nothing before `[DONE]`. The client's stream ends with the
/// proxy's error event, and the request is a failure.
#[tokio::test]
async fn a_migrated_chat_whose_every_decode_fails_its_kv_load_ends_with_an_error_event() {
    let summaries = Heard::default();
    let s = Stack::builder()
        .prefill(vec![unreachable_kv()])
        .decode(vec![SimConfig::default(), SimConfig::default()])
        .config(|c| c.migration.limit = 1)
        .listener(summaries.clone())
        .build()
        .await;
    let body = chat_body(
        "tell me a long story",
        8,
        json!({"stream_options": {"include_usage": true}}),
    );
    let a = post(&s.url, "/v1/chat/completions", body, &[]).await;
    assert_eq!(a.status, 200);
    let evs = events(&a);
    assert_eq!(
        evs.last().unwrap()["error"]["code"],
        "decode_stream_failed",
        "{}",
        a.text()
    );
    assert!(!evs.contains(&json!("[DONE]")), "{}", a.text());
    assert!(
        evs.iter()
            .all(|e| e.get("usage").is_none_or(Value::is_null)),
        "no usage chunk of an answer that never came: {}",
        a.text()
    );
    assert_eq!(a.content(), "");
    // The first leg and the continuation, each on its own decode, failed their pull.
    for d in &s.decode {
        assert_eq!(d.stats().kv_pull_failures, 1);
    }
    let [summary] = &summaries.first(1).await[..] else {
        unreachable!()
    };
    assert_eq!(
        (
            summary.delivery,
            summary.outcome,
            summary.error,
            summary.migrations
        ),
        (Delivery::Broken, "error", Some("decode_stream_failed"), 1)
    );
}

/// A streamed completions request whose first decode fails its KV load (nothing of the
/// answer, or only its usage chunk, then `[DONE]`) is continued, decode-only, on the
/// other decode, from the client's prompt: the client gets the answer an unbroken
/// engine gives, one usage chunk when it asked for one.
#[tokio::test]
async fn a_completions_stream_whose_first_decode_fails_its_kv_load_is_finished_on_another() {
    let summaries = Heard::default();
    let s = Stack::builder()
        .prefill(vec![unreachable_kv()])
        .decode(vec![SimConfig::default(), SimConfig::default()])
        .config(|c| {
            c.migration.limit = 1;
            c.migration.decode_only = true;
        })
        .listener(summaries.clone())
        .build()
        .await;
    for include_usage in [false, true] {
        let extra = if include_usage {
            json!({"stream_options": {"include_usage": true}})
        } else {
            json!({})
        };
        let body = completion_body("once upon a time", 6, extra);
        let a = post(&s.url, "/v1/completions", body.clone(), &[]).await;
        assert_eq!(a.status, 200);
        assert_one_answer(&a, false);
        let want = unbroken("/v1/completions", &body).await;
        assert_eq!(a.content(), want.content(), "usage: {include_usage}");
        let usages = events(&a)
            .iter()
            .filter(|e| e.get("usage").is_some_and(Value::is_object))
            .count();
        assert_eq!(usages, usize::from(include_usage), "{}", a.text());
        if include_usage {
            assert_eq!(usage(&a), usage(&want));
        }
    }
    let pulls: u64 = s.decode.iter().map(|d| d.stats().kv_pull_failures).sum();
    assert_eq!(pulls, 2, "each first leg failed its pull");
    for summary in summaries.first(2).await {
        assert_eq!(
            (summary.delivery, summary.outcome, summary.migrations),
            (Delivery::Complete, "success", 1)
        );
    }
}
