//! Bidirectional multi-turn KV (vLLM NIXL, `--bidirectional-kv`, issue #32 item 3): the
//! proxy keeps the handoff a decode returns, by conversation, and sends it on the next
//! turn's prefill leg; the simulated prefill really pulls the decode's blocks over the
//! decode's side channel. Proxy and engines over real loopback sockets.

#![allow(missing_docs)] // a test binary

use std::time::Duration;

use disagg_sim::{SimConfig, SimEngine};
use serde_json::{Value, json};

mod common;
use common::{Proxy, post, post_with, read_request};

/// A prefill engine (vLLM NIXL).
async fn prefill() -> SimEngine {
    SimEngine::start(SimConfig::default())
        .await
        .expect("start a prefill")
}

/// A decode engine running bidirectional NIXL, holding its blocks for `ttl`.
async fn decode(ttl: Duration) -> SimEngine {
    SimEngine::start(SimConfig {
        decode_handoff: true,
        decoder_kv_blocks_ttl: ttl,
        ..SimConfig::default()
    })
    .await
    .expect("start a decode")
}

/// A prompt of `words` words: one token each in the simulator, so a turn of 80 is past
/// the prefill's recompute threshold (64 tokens).
fn words(n: usize, tag: &str) -> String {
    (0..n).map(|i| format!("{tag}{i} ")).collect()
}

/// A chat turn: `messages` so far, the conversation named by `extra`'s fields.
fn chat(messages: &[Value], stream: bool, extra: Value) -> String {
    let mut body = json!({
        "model": "sim-model",
        "messages": messages,
        "max_tokens": 4,
        "stream": stream,
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body.to_string()
}

/// Whether `text` holds a handoff that is not `null`.
fn holds_handoff(text: &str) -> bool {
    text.contains("kv_transfer_params\":{") || text.contains("remote_engine_id")
}

/// The `kv_transfer_params` of the prefill legs `p` received, in order.
fn prefill_params(p: &SimEngine) -> Vec<Value> {
    p.requests()
        .into_iter()
        .filter(|r| r.path.starts_with("/v1/"))
        .map(|r| r.body["kv_transfer_params"].clone())
        .collect()
}

fn with_proxy_flags(extra: &[&'static str]) -> Vec<&'static str> {
    let mut flags = vec!["--bidirectional-kv"];
    flags.extend_from_slice(extra);
    flags
}

#[tokio::test]
async fn turns_two_and_three_of_a_conversation_pull_the_decodes_kv() {
    let p = prefill().await;
    let d = decode(Duration::from_secs(480)).await;
    let proxy = Proxy::start(&p, &d, &with_proxy_flags(&[])).await;
    let url = proxy.url();
    let conv = json!({"conversation_id": "conv-1"});

    let mut messages = vec![json!({"role": "user", "content": words(80, "a")})];
    // Turn 1, whole: no handoff kept yet, so the prefill computes everything.
    let a = post(
        &url,
        "/v1/chat/completions",
        &chat(&messages, false, conv.clone()),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert!(!holds_handoff(&a.text()), "{}", a.text());
    let answer = a.json()["choices"][0]["message"]["content"].clone();
    assert!(d.stats().blocks_held > 0, "{:?}", d.stats());
    assert_eq!(proxy.metric("disagg_bidi_kv_captured_total").await, 1);
    assert_eq!(p.stats().bidi_pulls, 0);

    // Turn 2, streamed: its prefill pulls turn 1's prefix from the decode.
    messages.push(json!({"role": "assistant", "content": answer}));
    messages.push(json!({"role": "user", "content": words(10, "b")}));
    let a = post(
        &url,
        "/v1/chat/completions",
        &chat(&messages, true, conv.clone()),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert!(!holds_handoff(&a.text()), "{}", a.text());
    assert_eq!(a.events().last().map(String::as_str), Some("[DONE]"));
    let s = p.stats();
    assert_eq!((s.bidi_pulls, s.bidi_pull_failures), (1, 0), "{s:?}");
    assert!(s.bidi_tokens_pulled >= 80, "{s:?}");

    // Turn 3, whole again: the handoff of turn 2's (streamed) answer is pulled.
    messages.push(json!({"role": "user", "content": words(10, "c")}));
    let a = post(
        &url,
        "/v1/chat/completions",
        &chat(&messages, false, conv.clone()),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert!(!holds_handoff(&a.text()), "{}", a.text());
    let s = p.stats();
    assert_eq!((s.bidi_pulls, s.bidi_pull_failures), (2, 0), "{s:?}");
    // The decode's side channel served both pulls; the prefill pulled what turn 2's
    // decode computed, more than turn 1's.
    assert_eq!(d.stats().side_channel_served, 2, "{:?}", d.stats());
    assert!(s.bidi_tokens_pulled >= 80 + 90, "{s:?}");

    // The prefill legs: the plain request on turn 1, then the decode's own dict, its
    // host the decode endpoint's.
    let legs = prefill_params(&p);
    assert_eq!(legs.len(), 3, "{legs:?}");
    assert_eq!(legs[0]["remote_engine_id"], Value::Null, "{legs:?}");
    for leg in &legs[1..] {
        assert_eq!(leg["do_remote_decode"], true, "{leg}");
        assert_eq!(leg["do_remote_prefill"], false, "{leg}");
        assert_eq!(leg["remote_port"], d.side_channel_addr().port(), "{leg}");
        assert_eq!(leg["remote_host"], "127.0.0.1", "{leg}");
        assert!(leg["remote_blocks_expiry_time"].is_number(), "{leg}");
    }
    assert_eq!(proxy.metric("disagg_bidi_kv_captured_total").await, 3);
    assert_eq!(proxy.metric("disagg_bidi_kv_reused_turns_total").await, 2);
    assert!(proxy.metric("disagg_bidi_kv_reused_tokens_total").await >= 170);

    // Turns 4 and 5 over the Responses API, streamed then whole: turn 4 pulls turn 3's
    // handoff, turn 5 the one kept from turn 4's stream (its terminal event).
    for stream in [true, false] {
        let body = json!({
            "model": "sim-model",
            "input": words(120, "r"),
            "max_output_tokens": 4,
            "stream": stream,
            "conversation_id": "conv-1",
        });
        let a = post(&url, "/v1/responses", &body.to_string()).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert!(!holds_handoff(&a.text()), "{}", a.text());
    }
    let s = p.stats();
    assert_eq!((s.bidi_pulls, s.bidi_pull_failures), (4, 0), "{s:?}");
    assert_eq!(proxy.metric("disagg_bidi_kv_captured_total").await, 5);

    // Another conversation gets nothing of this one's; a request naming none keeps
    // nothing.
    let other = vec![json!({"role": "user", "content": words(80, "x")})];
    let a = post(
        &url,
        "/v1/chat/completions",
        &chat(&other, false, json!({"conversation_id": "conv-2"})),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    let a = post(
        &url,
        "/v1/chat/completions",
        &chat(&other, false, json!({})),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    let legs = prefill_params(&p);
    assert_eq!(legs.len(), 7, "{legs:?}");
    assert_eq!(legs[5]["remote_engine_id"], Value::Null, "{legs:?}");
    assert_eq!(legs[6]["remote_engine_id"], Value::Null, "{legs:?}");
    assert_eq!(p.stats().bidi_pulls, 4);
    // conv-1's turn 5 and conv-2's turn 1 are kept; the keyless request added none.
    assert_eq!(proxy.metric("disagg_bidi_kv_captured_total").await, 6);
    assert_eq!(proxy.metric("disagg_bidi_kv_entries").await, 2);
}

#[tokio::test]
async fn a_session_header_can_name_the_conversation() {
    let p = prefill().await;
    let d = decode(Duration::from_secs(480)).await;
    let flags = with_proxy_flags(&["--conversation-key", "header:x-session-id"]);
    let proxy = Proxy::start(&p, &d, &flags).await;
    let url = proxy.url();
    let prompt = words(80, "h");
    let body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 4}).to_string();
    for _ in 0..2 {
        let a = post_with(&url, "/v1/completions", &body, &[("x-session-id", "s-1")]).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert!(!holds_handoff(&a.text()), "{}", a.text());
    }
    // A body field is not the key here.
    let keyed =
        json!({"model": "sim-model", "prompt": prompt, "max_tokens": 4, "conversation_id": "s-1"});
    let a = post(&url, "/v1/completions", &keyed.to_string()).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(p.stats().bidi_pulls, 1, "{:?}", p.stats());
    assert_eq!(proxy.metric("disagg_bidi_kv_reused_turns_total").await, 1);
}

#[tokio::test]
async fn an_expired_handoff_is_dropped_not_sent() {
    let p = prefill().await;
    let d = decode(Duration::from_millis(300)).await;
    let proxy = Proxy::start(
        &p,
        &d,
        &with_proxy_flags(&["--decoder-kv-blocks-ttl", "0.3"]),
    )
    .await;
    let url = proxy.url();
    let conv = json!({"conversation_id": "late"});
    let messages = vec![json!({"role": "user", "content": words(80, "e")})];
    let a = post(
        &url,
        "/v1/chat/completions",
        &chat(&messages, false, conv.clone()),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(proxy.metric("disagg_bidi_kv_captured_total").await, 1);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let a = post(
        &url,
        "/v1/chat/completions",
        &chat(&messages, false, conv.clone()),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    // Dropped at its TTL and counted; the prefill got the plain request.
    assert_eq!(proxy.metric("disagg_bidi_kv_expired_total").await, 1);
    assert_eq!(proxy.metric("disagg_bidi_kv_reused_turns_total").await, 0);
    let legs = prefill_params(&p);
    assert_eq!(legs[1]["remote_engine_id"], Value::Null, "{legs:?}");
    let s = p.stats();
    assert_eq!((s.bidi_pulls, s.bidi_pull_failures), (0, 0), "{s:?}");
}

#[tokio::test]
async fn a_stale_handoff_fails_the_pull_and_the_prefill_recomputes() {
    // The proxy keeps the handoff longer than the decode keeps its blocks: the
    // prefill's pull fails, it computes the prompt itself and the turn is answered.
    let p = prefill().await;
    let d = decode(Duration::from_millis(100)).await;
    let proxy = Proxy::start(&p, &d, &with_proxy_flags(&[])).await;
    let url = proxy.url();
    let conv = json!({"conversation_id": "stale"});
    let messages = vec![json!({"role": "user", "content": words(80, "s")})];
    for _ in 0..2 {
        let a = post(
            &url,
            "/v1/chat/completions",
            &chat(&messages, false, conv.clone()),
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let s = p.stats();
    assert_eq!((s.bidi_pulls, s.bidi_pull_failures), (0, 1), "{s:?}");
    assert!(s.bidi_tokens_computed >= 80, "{s:?}");
    assert_eq!(proxy.metric("disagg_bidi_kv_reused_turns_total").await, 1);
}

#[tokio::test]
async fn flag_off_keeps_nothing() {
    let p = prefill().await;
    let d = decode(Duration::from_secs(480)).await;
    let proxy = Proxy::start(&p, &d, &[]).await;
    let url = proxy.url();
    let conv = json!({"conversation_id": "off"});
    let messages = vec![json!({"role": "user", "content": words(80, "o")})];
    for _ in 0..2 {
        let a = post(
            &url,
            "/v1/chat/completions",
            &chat(&messages, false, conv.clone()),
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert!(!holds_handoff(&a.text()), "{}", a.text());
    }
    for leg in prefill_params(&p) {
        assert_eq!(leg["remote_engine_id"], Value::Null, "{leg}");
    }
    assert_eq!(p.stats().bidi_pulls, 0);
    let metrics = common::get(&url, "/metrics").await.text();
    assert!(!metrics.contains("disagg_bidi_kv"), "{metrics}");
}

#[tokio::test]
async fn an_oversized_decode_handoff_is_dropped_and_the_answer_still_arrives() {
    let p = prefill().await;
    let d = decode(Duration::from_secs(480)).await;
    // Every real handoff is larger than 64 bytes.
    let proxy = Proxy::start(
        &p,
        &d,
        &with_proxy_flags(&["--bidi-max-handoff-bytes", "64"]),
    )
    .await;
    let url = proxy.url();
    let conv = json!({"conversation_id": "big"});
    let messages = vec![json!({"role": "user", "content": words(80, "m")})];
    for stream in [false, true] {
        let a = post(
            &url,
            "/v1/chat/completions",
            &chat(&messages, stream, conv.clone()),
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert!(!holds_handoff(&a.text()), "{}", a.text());
    }
    assert_eq!(proxy.metric("disagg_bidi_kv_captured_total").await, 0);
    let metrics = common::get(&url, "/metrics").await.text();
    assert!(
        metrics.contains("disagg_bidi_kv_dropped_total{reason=\"invalid\"} 2"),
        "{metrics}"
    );
    assert_eq!(p.stats().bidi_pulls, 0);
}

/// A decode that answers every request with a whole chat answer whose
/// `kv_transfer_params` is the next of `handoffs` (round and round), then closes.
async fn raw_decode(handoffs: Vec<&'static str>) -> String {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let next = std::sync::Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let (next, handoffs) = (next.clone(), handoffs.clone());
            tokio::spawn(async move {
                // The head, then as many body bytes as it says.
                if read_request(&mut s).await.is_none() {
                    return;
                }
                let handoff = handoffs[next.fetch_add(1, Ordering::Relaxed) % handoffs.len()];
                let body = format!(
                    r#"{{"id":"chatcmpl-1","object":"chat.completion","model":"sim-model","choices":[{{"index":0,"message":{{"role":"assistant","content":"ok"}},"finish_reason":"length"}}],"kv_transfer_params":{handoff}}}"#
                );
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(answer.as_bytes()).await;
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test]
async fn a_malformed_decode_handoff_is_dropped_and_counted_and_the_answer_arrives() {
    let p = prefill().await;
    let d = raw_decode(vec![
        // Not a decode's dict: no engine id, blocks or port.
        r#"{"do_remote_decode":true,"remote_host":"10.0.0.7"}"#,
        // A prefill's dict, turned the wrong way.
        r#"{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"e","remote_request_id":"r","remote_block_ids":[1],"remote_host":"10.0.0.7","remote_port":5600,"remote_num_tokens":99}"#,
        // Not a dict.
        r#""10.0.0.7:5600""#,
    ])
    .await;
    let proxy = Proxy::start_args(&[
        "--prefill".to_owned(),
        p.url(),
        "--decode".to_owned(),
        d,
        "--bidirectional-kv".to_owned(),
    ])
    .await;
    let url = proxy.url();
    let conv = json!({"conversation_id": "bad"});
    let messages = vec![json!({"role": "user", "content": words(80, "b")})];
    for _ in 0..3 {
        let a = post(
            &url,
            "/v1/chat/completions",
            &chat(&messages, false, conv.clone()),
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.json()["choices"][0]["message"]["content"], "ok");
        assert!(!a.text().contains("10.0.0.7"), "{}", a.text());
    }
    assert_eq!(proxy.metric("disagg_bidi_kv_captured_total").await, 0);
    let metrics = common::get(&url, "/metrics").await.text();
    assert!(
        metrics.contains("disagg_bidi_kv_dropped_total{reason=\"invalid\"} 3"),
        "{metrics}"
    );
    // Nothing kept, nothing sent: every prefill leg got the plain request.
    for leg in prefill_params(&p) {
        assert_eq!(leg["remote_engine_id"], Value::Null, "{leg}");
    }
}

#[tokio::test]
async fn with_client_keys_one_client_cannot_take_anothers_conversation() {
    let p = prefill().await;
    let d = decode(Duration::from_secs(480)).await;
    let flags = with_proxy_flags(&["--api-key", "sk-a", "--api-key", "sk-b"]);
    let proxy = Proxy::start(&p, &d, &flags).await;
    let url = proxy.url();
    let conv = json!({"conversation_id": "shared"});
    let messages = vec![json!({"role": "user", "content": words(80, "k")})];
    let turn = |key: &'static str| {
        let (url, body) = (url.clone(), chat(&messages, false, conv.clone()));
        async move {
            let auth = format!("Bearer {key}");
            let a = post_with(
                &url,
                "/v1/chat/completions",
                &body,
                &[("authorization", &auth)],
            )
            .await;
            assert_eq!(a.status, 200, "{}", a.text());
        }
    };
    // A's turn is kept; B names the same conversation and gets nothing of A's.
    turn("sk-a").await;
    turn("sk-b").await;
    assert_eq!(p.stats().bidi_pulls, 0, "{:?}", p.stats());
    // A's next turn still finds its own.
    turn("sk-a").await;
    assert_eq!(p.stats().bidi_pulls, 1, "{:?}", p.stats());
    let legs = prefill_params(&p);
    assert_eq!(legs[1]["remote_engine_id"], Value::Null, "{legs:?}");
    assert!(legs[2]["remote_engine_id"].is_string(), "{legs:?}");
}
