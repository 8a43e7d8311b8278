//! SGLang's native `/generate` (`input_ids` in, cumulative `text` and `output_ids`
//! out), migrated: a decode killed mid-answer is continued through a fresh prefill and
//! bootstrap handoff, and the client's stream goes on as an unbroken engine's would.

use serde_json::{Value, json};

use super::*;

/// An SGLang stack with these decodes and migration allowed `limit` times.
async fn sglang(decode: Vec<SimConfig>, limit: u32) -> Stack {
    Stack::builder()
        .protocol(Protocol::Sglang)
        .decode(decode)
        .config(|c| c.migration.limit = limit)
        .build()
        .await
}

fn generate_body(max_new_tokens: u32, extra: Value) -> String {
    let mut body = json!({
        "input_ids": [101, 2023, 2003, 1037, 2146, 2466, 1997, 2616, 102],
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        "stream": true,
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body.to_string()
}

/// What an unbroken SGLang pair streams for `body`.
async fn unbroken_generate(body: &str) -> Answer {
    let s = Stack::builder().protocol(Protocol::Sglang).build().await;
    let a = post(&s.url, "/generate", body.to_owned(), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    a
}

/// The answer events (not `[DONE]`); each one's text and ids extend the one before,
/// all carry the first one's id, and the stream ends with `[DONE]`.
fn answer_events(a: &Answer) -> Vec<Value> {
    let evs = events(a);
    assert_eq!(evs.last(), Some(&json!("[DONE]")), "{}", a.text());
    let answers: Vec<Value> = evs.into_iter().filter(Value::is_object).collect();
    for pair in answers.windows(2) {
        let (before, after) = (&pair[0], &pair[1]);
        assert!(after.get("error").is_none(), "{}", a.text());
        let (t0, t1) = (
            before["text"].as_str().unwrap(),
            after["text"].as_str().unwrap(),
        );
        assert!(t1.starts_with(t0), "{t0:?} then {t1:?}");
        let (i0, i1) = (
            before["output_ids"].as_array().unwrap(),
            after["output_ids"].as_array().unwrap(),
        );
        assert_eq!(&i1[..i0.len()], &i0[..], "ids went back");
        assert_eq!(after["meta_info"]["id"], answers[0]["meta_info"]["id"]);
    }
    answers
}

#[tokio::test]
async fn a_generate_stream_killed_mid_answer_is_finished_on_another_decode() {
    // 4 events (4 tokens), then the decode dies; 3 are left.
    let s = sglang(vec![dying(4), dying(4)], 1).await;
    let body = generate_body(7, json!({}));
    let a = post(&s.url, "/generate", body.clone(), &[]).await;
    assert_eq!(a.status, 200);
    let got = answer_events(&a);
    let want = answer_events(&unbroken_generate(&body).await);
    let (last, expected) = (got.last().unwrap(), want.last().unwrap());
    assert_eq!(last["text"], expected["text"]);
    assert_eq!(last["output_ids"], expected["output_ids"]);
    assert_eq!(last["output_ids"].as_array().unwrap().len(), 7);
    assert_eq!(got.len(), want.len(), "one event per token, none repeated");
    for key in ["prompt_tokens", "completion_tokens", "finish_reason"] {
        assert_eq!(last["meta_info"][key], expected["meta_info"][key], "{key}");
    }
    let stats = s.orchestrator.stats();
    assert_eq!(stats.migrations.iter().map(|(_, n)| n).sum::<u64>(), 1);
    assert_eq!(stats.migrated_tokens, 4);
    // The continuation went through the prefill (SGLang decodes take their KV from a
    // prefill, never from nothing) with the prompt and the 4 generated ids.
    let continued = s.p().requests().last().cloned().unwrap();
    assert_eq!(continued.path, "/generate");
    assert_eq!(continued.body["input_ids"].as_array().unwrap().len(), 9 + 4);
    assert_eq!(continued.body["sampling_params"]["max_new_tokens"], 3);
    assert!(eventually(std::time::Duration::from_secs(2), || s.in_flight() == 0).await);
}

#[tokio::test]
async fn a_generate_stream_killed_twice_completes_with_limit_two() {
    let s = sglang(vec![dying(3), dying(3), dying(3)], 2).await;
    let body = generate_body(8, json!({}));
    let a = post(&s.url, "/generate", body.clone(), &[]).await;
    let got = answer_events(&a);
    let want = answer_events(&unbroken_generate(&body).await);
    assert_eq!(got.last().unwrap()["text"], want.last().unwrap()["text"]);
    assert_eq!(got.len(), want.len());
    let stats = s.orchestrator.stats();
    assert_eq!(stats.migrations.iter().map(|(_, n)| n).sum::<u64>(), 2);
}

#[tokio::test]
async fn a_generate_request_given_as_text_or_with_logprobs_is_not_migrated() {
    for extra in [
        json!({"input_ids": null, "text": "a prompt of words"}),
        json!({"return_logprob": true}),
        json!({"sampling_params": {"max_new_tokens": 10, "regex": "[a-z]+"}}),
    ] {
        let s = sglang(vec![dying(4), dying(4)], 1).await;
        let a = post(&s.url, "/generate", generate_body(10, extra.clone()), &[]).await;
        assert_eq!(a.status, 200, "{extra}: {}", a.text());
        let evs = events(&a);
        assert!(!evs.contains(&json!("[DONE]")), "{extra}: {}", a.text());
        let stats = s.orchestrator.stats();
        assert_eq!(
            stats.migrations.iter().map(|(_, n)| n).sum::<u64>(),
            0,
            "{extra}"
        );
    }
}

/// A `/generate` first leg whose decode aborted it before any token, as SGLang does a
/// decode whose KV transfer failed (no error event: its finish reason
/// `{"type":"abort", ..., "status_code":500}`, then `[DONE]`), is a break naming a 5xx,
/// not a served answer: with nothing of the answer to continue from, it is not
/// continued, the abort goes out as the engine wrote it, the attempt fails, and the
/// stream ends at once, though its prefill still runs (it hangs before it registers the
/// room; the decode gives up after 200 ms): no decode takes its KV. The decode leg is
/// judged neither way: its prefill never answered.
#[tokio::test]
async fn a_generate_stream_its_decode_aborted_is_its_failure_and_ends_at_once() {
    use disagg_core::outcome::{LegOutcome, Outcome};
    use std::time::Duration;
    let heard = Heard::default();
    let s = Stack::builder()
        .protocol(Protocol::Sglang)
        .prefill(vec![SimConfig {
            faults: Faults {
                hang: true,
                ..Faults::default()
            },
            ..SimConfig::default()
        }])
        .decode(vec![
            SimConfig {
                bootstrap_timeout: Duration::from_millis(200),
                ..SimConfig::default()
            },
            SimConfig::default(),
        ])
        .config(|c| c.migration.limit = 1)
        .listener(heard.clone())
        .build()
        .await;
    let a = post(&s.url, "/generate", generate_body(5, json!({})), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let evs = events(&a);
    assert_eq!(evs.last(), Some(&json!("[DONE]")), "{}", a.text());
    assert_eq!(evs[0]["meta_info"]["finish_reason"]["type"], "abort");
    heard.first(1).await;
    let report = heard.decode_attempt();
    assert_eq!(
        (report.outcome, report.decode),
        (Outcome::DecodeFailed, LegOutcome::Abandoned),
        "{report:?}"
    );
    let stats = s.orchestrator.stats();
    assert_eq!(stats.migrations.iter().map(|(_, n)| n).sum::<u64>(), 0);
    assert_eq!(s.d().stats().bootstrap_timeouts, 1);
}
