//! Clients that send a request slowly or never finish it, and bodies whose JSON would
//! take far more memory than their bytes: the engine bounds both (time limits on the
//! head and the body, a memory budget on the parsed JSON) and never counts a request
//! as running before its body is in.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use disagg_sim::{KvMode, SimConfig, SimEngine, SimRole};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

/// Far longer than the short limits the tests configure: reaching it means the engine
/// neither answered nor closed.
const NEVER: Duration = Duration::from_secs(10);

const SHORT: Duration = Duration::from_millis(300);

async fn engine_with(config: SimConfig) -> SimEngine {
    SimEngine::start(config).await.unwrap()
}

/// Everything the server sends until it closes the connection.
async fn until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    match timeout(NEVER, stream.read_to_end(&mut out)).await {
        Ok(Ok(_)) => out,
        // A reset after the answer is a close too.
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => out,
        Ok(Err(e)) => panic!("read failed: {e}"),
        Err(_) => panic!(
            "the connection stayed open {NEVER:?}; got so far: {:?}",
            String::from_utf8_lossy(&out)
        ),
    }
}

/// Waits until the engine routed a request to `path` (its head is in).
async fn head_routed(e: &SimEngine, path: &str) {
    for _ in 0..500 {
        if e.received().iter().any(|r| r.path == path) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no request to {path} reached the engine");
}

/// `vllm:num_requests_running` as `/metrics` reports it (what the proxy reads as load).
async fn running_in_metrics(addr: SocketAddr) -> f64 {
    let text = get(addr, "/metrics").await.text();
    let line = text
        .lines()
        .find(|l| l.starts_with("vllm:num_requests_running{"))
        .unwrap_or_else(|| panic!("no num_requests_running in {text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// Splits a raw HTTP/1.1 answer into its status, head (lowercase) and body.
fn split_answer(raw: &[u8]) -> (u16, String, Vec<u8>) {
    let text = String::from_utf8_lossy(raw);
    let end = text
        .find("\r\n\r\n")
        .unwrap_or_else(|| panic!("no complete head in {text:?}"));
    let head = text[..end].to_ascii_lowercase();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    (status, head, raw[end + 4..].to_vec())
}

/// A head announcing 100 bytes of body, and one byte of it.
fn stalled_post(path: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{{"
    )
}

/// A completion whose body never comes whole is answered 408 (vLLM's error shape,
/// `connection: close`) once the body's time is up, and is never counted as running:
/// neither in the stats nor in `vllm:num_requests_running` while it waits.
#[tokio::test]
async fn stalled_completion_body_is_answered_408_and_never_runs() {
    let e = engine_with(SimConfig {
        body_read_timeout: SHORT,
        ..SimConfig::default()
    })
    .await;
    let mut stream = TcpStream::connect(e.addr()).await.unwrap();
    stream
        .write_all(stalled_post("/v1/completions").as_bytes())
        .await
        .unwrap();
    head_routed(&e, "/v1/completions").await;
    let s = e.stats();
    assert_eq!(
        (s.active_requests, s.requests),
        (0, 0),
        "a request waiting for its body counts as running: {s:?}"
    );
    assert_eq!(running_in_metrics(e.addr()).await, 0.0);

    let (status, head, body) = split_answer(&until_closed(&mut stream).await);
    assert_eq!(status, 408, "{head}");
    assert!(head.contains("\r\nconnection: close"), "{head}");
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], 408, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("body"),
        "{v}"
    );
    let s = wait_for(&e, |s| s.open_connections == 0).await;
    assert_eq!((s.active_requests, s.requests, s.cancelled), (0, 0, 0));
}

/// Every route that reads a body answers a stalled one 408 and closes.
#[tokio::test]
async fn every_body_route_answers_a_stalled_body_408() {
    let e = engine_with(SimConfig {
        body_read_timeout: SHORT,
        ..SimConfig::default()
    })
    .await;
    for path in [
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/tokenize",
        "/detokenize",
        "/v1/embeddings",
        "/v1/load_lora_adapter",
    ] {
        let mut stream = TcpStream::connect(e.addr()).await.unwrap();
        stream
            .write_all(stalled_post(path).as_bytes())
            .await
            .unwrap();
        let (status, head, _) = split_answer(&until_closed(&mut stream).await);
        assert_eq!(status, 408, "{path}: {head}");
        assert!(head.contains("\r\nconnection: close"), "{path}: {head}");
    }
    let s = wait_for(&e, |s| s.open_connections == 0).await;
    assert_eq!((s.active_requests, s.cancelled), (0, 0));
}

/// A head sent in part and never finished is closed by the header timeout (vLLM's
/// uvicorn would hold it for ever), and never reaches a route.
#[tokio::test]
async fn stalled_head_is_closed_by_the_header_timeout() {
    let e = engine_with(SimConfig {
        header_read_timeout: SHORT,
        ..SimConfig::default()
    })
    .await;
    let mut stream = TcpStream::connect(e.addr()).await.unwrap();
    stream
        .write_all(b"POST /v1/completions HTTP/1.1\r\nhost: sim\r\ncontent-le")
        .await
        .unwrap();
    let got = until_closed(&mut stream).await;
    // hyper closes without an answer (a 408 would be as good).
    assert!(
        got.is_empty() || got.starts_with(b"HTTP/1.1 408"),
        "{:?}",
        String::from_utf8_lossy(&got)
    );
    assert!(e.received().is_empty(), "{:?}", e.received());
    let s = wait_for(&e, |s| s.open_connections == 0).await;
    assert_eq!((s.active_requests, s.requests), (0, 0));
}

/// The head's limit runs from the end of the previous answer too: a kept-alive
/// connection left idle that long is closed (as uvicorn closes one after its
/// `timeout_keep_alive`).
#[tokio::test]
async fn idle_kept_alive_connection_is_closed_after_the_header_timeout() {
    let e = engine_with(SimConfig {
        header_read_timeout: SHORT,
        ..SimConfig::default()
    })
    .await;
    let mut stream = TcpStream::connect(e.addr()).await.unwrap();
    stream
        .write_all(b"GET /health HTTP/1.1\r\nhost: sim\r\n\r\n")
        .await
        .unwrap();
    let got = until_closed(&mut stream).await;
    let (status, head, _) = split_answer(&got);
    assert_eq!(status, 200, "{head}");
    assert!(!head.contains("connection: close"), "{head}");
    wait_for(&e, |s| s.open_connections == 0).await;
}

/// A Mooncake prefill's bootstrap server closes a head that never ends too.
#[tokio::test]
async fn stalled_bootstrap_head_is_closed_by_the_header_timeout() {
    let e = engine_with(SimConfig {
        kv_mode: KvMode::Mooncake(SimRole::Prefill),
        header_read_timeout: SHORT,
        ..SimConfig::default()
    })
    .await;
    let mut stream = TcpStream::connect(e.bootstrap_addr().unwrap())
        .await
        .unwrap();
    stream
        .write_all(b"GET /query HTTP/1.1\r\nhost: sim\r\n")
        .await
        .unwrap();
    let got = until_closed(&mut stream).await;
    assert!(
        got.is_empty() || got.starts_with(b"HTTP/1.1 408"),
        "{:?}",
        String::from_utf8_lossy(&got)
    );
}

/// A body of many small objects (about 80 bytes of `serde_json::Value` per byte of
/// `[{"a":0},...]`: some 330 MB from this 4 MB body, gigabytes from a 64 MiB one) is
/// refused 413 once its parse passes the engine's budget, instead of being built.
#[tokio::test]
async fn json_past_the_memory_budget_is_refused_413() {
    let e = engine_with(SimConfig::default()).await;
    let pad = vec![r#"{"a":0}"#; 500_000].join(",");
    let body = format!(r#"{{"prompt":"hi","max_tokens":1,"pad":[{pad}]}}"#);
    let reply = request(
        e.addr(),
        "POST",
        "/v1/completions",
        &[],
        Some(body.into_bytes()),
    )
    .await;
    assert_eq!(reply.status, 413, "{}", reply.text());
    let message = error_message(&reply);
    assert!(message.contains("memory"), "{message}");
    let s = e.stats();
    assert_eq!((s.active_requests, s.local_prefills), (0, 0));
}

/// What the budget must still take: a 32 MiB body (the proxy's ceiling) of text, and
/// two million token ids, each served.
#[tokio::test]
async fn large_bodies_of_text_and_ids_are_still_served() {
    let e = engine_with(SimConfig::default()).await;
    let text = "a".repeat(32 << 20);
    let ids = vec!["151643"; 2_000_000].join(",");
    for body in [
        format!(r#"{{"prompt":"hi","max_tokens":1,"pad":"{text}"}}"#),
        format!(r#"{{"prompt":"hi","max_tokens":1,"pad":[{ids}]}}"#),
    ] {
        let len = body.len();
        let reply = request(
            e.addr(),
            "POST",
            "/v1/completions",
            &[],
            Some(body.into_bytes()),
        )
        .await;
        assert_eq!(reply.status, 200, "{len} B: {}", reply.text());
    }
}

/// The engine's ceiling on a request body (`request_body::MAX_BODY`).
const MAX_BODY: usize = 64 << 20;

/// Asserts an answer is a 413 in OpenAI's error shape that closes the connection.
fn assert_refused_413(raw: &[u8]) {
    let (status, head, body) = split_answer(raw);
    assert_eq!(status, 413, "{head}");
    assert!(head.contains("\r\nconnection: close"), "{head}");
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], 413, "{v}");
    assert_eq!(v["error"]["type"], "PayloadTooLargeError", "{v}");
    assert!(v["error"]["param"].is_null(), "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("64 MiB"), "{message}");
}

/// A body declared (`content-length`) over the ceiling is refused 413 from its head,
/// without waiting for bytes that would only be thrown away, and never runs.
#[tokio::test]
async fn a_body_declared_over_the_ceiling_is_refused_413_at_once() {
    // The body never comes: were it waited for, the answer would be this 408.
    let e = engine_with(SimConfig {
        body_read_timeout: NEVER * 3,
        ..SimConfig::default()
    })
    .await;
    for path in ["/v1/completions", "/v1/chat/completions", "/tokenize"] {
        let mut stream = TcpStream::connect(e.addr()).await.unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{{",
            MAX_BODY + 1
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        assert_refused_413(&until_closed(&mut stream).await);
    }
    let s = wait_for(&e, |s| s.open_connections == 0).await;
    assert_eq!((s.active_requests, s.requests), (0, 0), "{s:?}");
}

/// A chunked body (no length declared) is refused 413 once what arrived passes the
/// ceiling, in OpenAI's error shape, and the connection closes.
#[tokio::test]
async fn a_chunked_body_past_the_ceiling_is_refused_413() {
    let e = engine_with(SimConfig::default()).await;
    let stream = TcpStream::connect(e.addr()).await.unwrap();
    let (mut rd, mut wr) = stream.into_split();
    let writer = tokio::spawn(async move {
        let head = "POST /v1/completions HTTP/1.1\r\nhost: sim\r\n\
            content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n";
        wr.write_all(head.as_bytes()).await?;
        let chunk = vec![b' '; 1 << 20];
        let framed = [format!("{:x}\r\n", chunk.len()).as_bytes(), &chunk, b"\r\n"].concat();
        // One MiB past the ceiling, then the last chunk; the engine may close first.
        for _ in 0..(MAX_BODY >> 20) + 1 {
            wr.write_all(&framed).await?;
        }
        wr.write_all(b"0\r\n\r\n").await
    });
    let mut raw = Vec::new();
    match timeout(NEVER, rd.read_to_end(&mut raw)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Ok(Err(e)) => panic!("read failed: {e}"),
        Err(_) => panic!("no answer within {NEVER:?}"),
    }
    assert_refused_413(&raw);
    // The writer ends either way (done, or cut off by the close).
    let _ = writer.await.unwrap();
    let s = wait_for(&e, |s| s.open_connections == 0).await;
    assert_eq!((s.active_requests, s.requests), (0, 0), "{s:?}");
}

/// A body of exactly the ceiling is still read and served.
#[tokio::test]
async fn a_body_at_the_ceiling_is_served() {
    let e = engine_with(SimConfig::default()).await;
    let frame = r#"{"prompt":"hi","max_tokens":1,"pad":""}"#;
    let text = "a".repeat(MAX_BODY - frame.len());
    let body = format!(r#"{{"prompt":"hi","max_tokens":1,"pad":"{text}"}}"#);
    assert_eq!(body.len(), MAX_BODY);
    let reply = request(
        e.addr(),
        "POST",
        "/v1/completions",
        &[],
        Some(body.into_bytes()),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}
