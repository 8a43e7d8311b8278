//! Mid-stream migration (`MigrationConfig`, `--migration-limit`), over real sockets
//! against simulated vLLM engines: a decode stream that breaks after its answer began
//! goes on, on another decode, and the client gets the answer an unbroken engine gives,
//! spliced into one stream.

#[path = "../support/mod.rs"]
mod support;

use disagg_sim::{Faults, SimConfig};
use serde_json::{Value, json};
use support::*;

mod generate;
mod observe;
mod prefill;
mod unfinished;

/// A decode engine that aborts every stream after `chunks` SSE events.
fn dying(chunks: usize) -> SimConfig {
    SimConfig {
        faults: Faults {
            drop_after_chunks: Some(chunks),
            ..Faults::default()
        },
        ..SimConfig::default()
    }
}

/// A stack with these decodes and migration allowed `limit` times.
async fn stack(decode: Vec<SimConfig>, limit: u32) -> Stack {
    Stack::builder()
        .decode(decode)
        .config(|c| c.migration.limit = limit)
        .build()
        .await
}

/// The events' JSON payloads (`[DONE]` kept as the string).
fn events(a: &Answer) -> Vec<Value> {
    a.events()
        .iter()
        .map(|e| serde_json::from_str(e).unwrap_or_else(|_| Value::String(e.clone())))
        .collect()
}

fn chat_body(content: &str, max_tokens: u32, extra: Value) -> String {
    let mut body = json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": true,
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body.to_string()
}

fn completion_body(prompt: &str, max_tokens: u32, extra: Value) -> String {
    let mut body = json!({
        "model": "sim-model",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": true,
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body.to_string()
}

/// What an unbroken engine streams for `body` at `path`.
/// The usage chunk of a streamed answer.
fn usage(a: &Answer) -> Value {
    events(a)
        .into_iter()
        .find_map(|e| e.get("usage").filter(|u| !u.is_null()).cloned())
        .unwrap_or_else(|| panic!("no usage in {}", a.text()))
}

async fn unbroken(path: &str, body: &str) -> Answer {
    let s = Stack::builder().build().await;
    let a = post(&s.url, path, body.to_owned(), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    a
}

/// One answer: every chunk carries the first chunk's `id`, `object`, `created` and
/// `model`, at most one role chunk, no token ids the client did not ask for, and the
/// stream ends with `[DONE]`.
fn assert_one_answer(a: &Answer, chat: bool) {
    let evs = events(a);
    assert_eq!(evs.last(), Some(&json!("[DONE]")), "{}", a.text());
    let chunks: Vec<&Value> = evs.iter().filter(|e| e.is_object()).collect();
    let first = chunks[0];
    for c in &chunks {
        assert!(c.get("error").is_none(), "{}", a.text());
        for key in ["id", "object", "created", "model"] {
            assert_eq!(c[key], first[key], "{key} in {c}");
        }
        assert!(
            c.get("prompt_token_ids").is_none_or(Value::is_null),
            "unasked prompt ids reached the client: {c}"
        );
        for choice in c["choices"].as_array().into_iter().flatten() {
            assert_eq!(choice["index"], 0);
            assert!(
                choice.get("token_ids").is_none_or(Value::is_null),
                "unasked ids reached the client: {c}"
            );
            assert!(choice.get("prompt_token_ids").is_none_or(Value::is_null));
            if chat {
                assert!(
                    choice.get("text").is_none(),
                    "chat chunk shaped as text: {c}"
                );
            }
        }
    }
    let roles = chunks
        .iter()
        .filter(|c| !c["choices"][0]["delta"]["role"].is_null())
        .count();
    assert_eq!(roles, usize::from(chat), "{}", a.text());
}

#[tokio::test]
async fn a_chat_stream_killed_mid_answer_is_finished_on_another_decode() {
    // Role chunk and 5 tokens, then the decode dies; 3 tokens are left.
    let s = stack(vec![dying(6), dying(6)], 1).await;
    let body = chat_body("tell me a long story", 8, json!({}));
    let a = post(&s.url, "/v1/chat/completions", body.clone(), &[]).await;
    assert_eq!(a.status, 200);
    assert_one_answer(&a, true);
    let want = unbroken("/v1/chat/completions", &body).await;
    assert_eq!(a.content(), want.content());
    assert_eq!(a.content().split_whitespace().count(), 8);
    let stats = s.orchestrator.stats();
    assert_eq!(
        stats.migrations.iter().map(|(_, n)| n).sum::<u64>(),
        1,
        "{:?}",
        stats.migrations
    );
    assert_eq!(stats.migrated_tokens, 5);
    // Both decodes served a leg.
    assert_eq!(
        s.decode[0].stats().requests + s.decode[1].stats().requests,
        2
    );
    assert!(eventually(std::time::Duration::from_secs(2), || s.in_flight() == 0).await);
}

#[tokio::test]
async fn a_completion_stream_killed_mid_answer_is_finished_on_another_decode() {
    // 4 tokens, then the decode dies; 6 are left.
    let s = stack(vec![dying(4), SimConfig::default()], 1).await;
    // The first leg must go to the dying decode: make the healthy one busy... instead,
    // send until one was migrated (round robin puts every other request on it).
    let body = completion_body("once upon a time", 10, json!({}));
    let want = unbroken("/v1/completions", &body).await;
    for _ in 0..2 {
        let a = post(&s.url, "/v1/completions", body.clone(), &[]).await;
        assert_eq!(a.status, 200);
        assert_one_answer(&a, false);
        assert_eq!(a.content(), want.content());
    }
    let stats = s.orchestrator.stats();
    assert_eq!(stats.migrations.iter().map(|(_, n)| n).sum::<u64>(), 1);
    assert_eq!(stats.migrated_tokens, 4);
}

#[tokio::test]
async fn usage_counts_the_original_prompt_and_every_leg() {
    let s = stack(vec![dying(6), dying(6)], 1).await;
    let body = chat_body(
        "count my tokens please",
        8,
        json!({"stream_options": {"include_usage": true}}),
    );
    let a = post(&s.url, "/v1/chat/completions", body.clone(), &[]).await;
    assert_one_answer(&a, true);
    let want = unbroken("/v1/chat/completions", &body).await;
    assert_eq!(a.content(), want.content());
    let got = usage(&a);
    let expected = usage(&want);
    for key in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(got[key], expected[key], "{key}: {got} vs {expected}");
    }
    assert_eq!(got["completion_tokens"], 8);
}

#[tokio::test]
async fn killed_twice_completes_with_limit_two() {
    // Each leg streams 4 events: role + 3 tokens, then 4 tokens, then the last one.
    let s = stack(vec![dying(4), dying(4), dying(4)], 2).await;
    let body = chat_body("a story in three acts", 8, json!({}));
    let a = post(&s.url, "/v1/chat/completions", body.clone(), &[]).await;
    assert_one_answer(&a, true);
    let want = unbroken("/v1/chat/completions", &body).await;
    assert_eq!(a.content(), want.content());
    let stats = s.orchestrator.stats();
    assert_eq!(stats.migrations.iter().map(|(_, n)| n).sum::<u64>(), 2);
    // The three decodes served one leg each.
    for d in &s.decode {
        assert_eq!(d.stats().requests, 1);
    }
}

#[tokio::test]
async fn killed_twice_with_limit_one_ends_with_an_error_event() {
    let s = stack(vec![dying(4), dying(4), dying(4)], 1).await;
    let body = chat_body("a story in three acts", 8, json!({}));
    let a = post(&s.url, "/v1/chat/completions", body.clone(), &[]).await;
    assert_eq!(a.status, 200);
    let evs = events(&a);
    let last = evs.last().unwrap();
    assert_eq!(
        last["error"]["code"],
        "decode_stream_failed",
        "{}",
        a.text()
    );
    assert!(!evs.contains(&json!("[DONE]")));
    // What came is the start of the unbroken answer: 3 tokens, then 4 more.
    let want = unbroken("/v1/chat/completions", &body).await;
    let got = a.content();
    assert_eq!(got.split_whitespace().count(), 7, "{got:?}");
    assert!(want.content().starts_with(&got), "{got:?}");
    let served: u64 = s.decode.iter().map(|d| d.stats().requests).sum();
    assert_eq!(served, 2);
}

#[tokio::test]
async fn structured_output_is_not_migrated() {
    let s = stack(vec![dying(4), dying(4)], 2).await;
    let body = chat_body(
        "answer in JSON",
        8,
        json!({"response_format": {"type": "json_object"}}),
    );
    let a = post(&s.url, "/v1/chat/completions", body, &[]).await;
    let evs = events(&a);
    assert_eq!(
        evs.last().unwrap()["error"]["code"],
        "decode_stream_failed",
        "{}",
        a.text()
    );
    let served: u64 = s.decode.iter().map(|d| d.stats().requests).sum();
    assert_eq!(served, 1);
    let stats = s.orchestrator.stats();
    assert_eq!(stats.migrations.iter().map(|(_, n)| n).sum::<u64>(), 0);
}

#[tokio::test]
async fn migration_off_ends_a_broken_stream_as_before() {
    let s = stack(vec![dying(4), dying(4)], 0).await;
    let body = chat_body("tell me a long story", 8, json!({}));
    let a = post(&s.url, "/v1/chat/completions", body, &[]).await;
    assert_eq!(a.status, 200);
    let evs = events(&a);
    assert_eq!(evs.last().unwrap()["error"]["code"], "decode_stream_failed");
    assert_eq!(a.content().split_whitespace().count(), 3);
    let served: u64 = s.decode.iter().map(|d| d.stats().requests).sum();
    assert_eq!(served, 1);
}

#[tokio::test]
async fn a_client_that_asked_for_token_ids_keeps_them() {
    let s = stack(vec![dying(6), dying(6)], 1).await;
    let body = chat_body("ids please", 8, json!({"return_token_ids": true}));
    let a = post(&s.url, "/v1/chat/completions", body.clone(), &[]).await;
    let want = unbroken("/v1/chat/completions", &body).await;
    assert_eq!(a.content(), want.content());
    let ids = |a: &Answer| -> Vec<Value> {
        events(a)
            .iter()
            .flat_map(|e| {
                e["choices"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .flat_map(|c| c["token_ids"].as_array().cloned().unwrap_or_default())
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    assert_eq!(ids(&a), ids(&want));
    assert_eq!(ids(&a).len(), 8);
    assert_eq!(
        events(&a)[0]["prompt_token_ids"],
        events(&want)[0]["prompt_token_ids"]
    );
}

#[tokio::test]
async fn a_client_that_left_is_never_migrated() {
    use tokio::io::AsyncReadExt;
    // Tokens every 60 ms; the decode dies after its 5th event (about 240 ms in). The
    // client reads the head and the first event, then hangs up.
    let slow_dying = SimConfig {
        inter_token_delay: std::time::Duration::from_millis(60),
        ..dying(5)
    };
    let s = stack(vec![slow_dying.clone(), slow_dying], 2).await;
    let body = chat_body("a story nobody reads", 12, json!({}));
    let mut sock = raw_request(&s.url, "/v1/chat/completions", &body).await;
    let mut buf = vec![0u8; 4096];
    let n = sock.read(&mut buf).await.unwrap();
    assert!(n > 0);
    drop(sock);
    // Long past the break of the first leg.
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    let served: u64 = s.decode.iter().map(|d| d.stats().requests).sum();
    assert_eq!(served, 1, "a continuation was sent for a client that left");
    let stats = s.orchestrator.stats();
    assert_eq!(stats.migrations.iter().map(|(_, n)| n).sum::<u64>(), 0);
    assert!(eventually(std::time::Duration::from_secs(2), || s.in_flight() == 0).await);
}

#[tokio::test]
async fn a_stream_cut_after_its_last_token_is_ended_by_the_proxy() {
    // Role chunk and 4 tokens (the last with its finish reason) go out, then the
    // decode dies before its usage chunk and `[DONE]`: nothing is left to generate.
    let s = stack(vec![dying(5), dying(5)], 1).await;
    let body = chat_body(
        "short and sweet",
        4,
        json!({"stream_options": {"include_usage": true}}),
    );
    let a = post(&s.url, "/v1/chat/completions", body.clone(), &[]).await;
    assert_one_answer(&a, true);
    let want = unbroken("/v1/chat/completions", &body).await;
    assert_eq!(a.content(), want.content());
    assert_eq!(usage(&a), usage(&want));
    // No continuation was needed.
    let served: u64 = s.decode.iter().map(|d| d.stats().requests).sum();
    assert_eq!(served, 1);
}
