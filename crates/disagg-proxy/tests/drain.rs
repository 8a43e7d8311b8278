//! `disagg-proxy serve` stops gracefully on SIGTERM: the listening socket closes at once,
//! idle connections are closed, requests in flight finish within `--drain-timeout`, and
//! the process exits 0. The real binary runs against simulated engines in this process.

#![allow(missing_docs)] // a test binary

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use disagg_sim::{SimConfig, SimEngine};

mod common;
use common::Proxy;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Time between two streamed tokens: a stream of N tokens lasts (N - 1) times this.
const TOKEN_DELAY: Duration = Duration::from_millis(100);

/// Engines whose streams send one token per [`TOKEN_DELAY`].
async fn engines() -> (SimEngine, SimEngine) {
    let config = SimConfig {
        inter_token_delay: TOKEN_DELAY,
        ..SimConfig::default()
    };
    let p = SimEngine::start(config.clone()).await.expect("prefill sim");
    let d = SimEngine::start(config).await.expect("decode sim");
    (p, d)
}

/// One HTTP/1.1 exchange over a raw socket, read as it arrives.
struct Exchange {
    sock: TcpStream,
    raw: Vec<u8>,
    /// The connection ended: cleanly (`Ok`) or not.
    closed: Option<std::io::Result<()>>,
}

impl Exchange {
    async fn post(addr: SocketAddr, path: &str, body: &str) -> Exchange {
        let mut sock = TcpStream::connect(addr)
            .await
            .expect("connect to the proxy");
        let req = format!(
            "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        sock.write_all(req.as_bytes())
            .await
            .expect("send the request");
        Exchange {
            sock,
            raw: Vec::new(),
            closed: None,
        }
    }

    /// Read until `done` holds or the connection ends; false if neither happened by
    /// `limit`.
    async fn read_until(&mut self, limit: Duration, done: impl Fn(&Self) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        let mut buf = [0u8; 8192];
        while !done(self) && self.closed.is_none() {
            match tokio::time::timeout_at(deadline, self.sock.read(&mut buf)).await {
                Err(_) => return false,
                Ok(Ok(0)) => self.closed = Some(Ok(())),
                Ok(Ok(n)) => self.raw.extend_from_slice(&buf[..n]),
                Ok(Err(e)) => self.closed = Some(Err(e)),
            }
        }
        true
    }

    /// The SSE `data:` payloads of the chunked body received so far (complete events
    /// only), and whether the body's last chunk arrived.
    fn events(&self) -> (Vec<String>, bool) {
        let (body, complete) = dechunk(&self.raw);
        let text = String::from_utf8_lossy(&body);
        let mut events: Vec<&str> = text.split("\n\n").collect();
        events.pop(); // after the last "\n\n": empty, or an event still arriving
        let events = events
            .iter()
            .filter_map(|e| e.trim().strip_prefix("data: ").map(str::to_owned))
            .collect();
        (events, complete)
    }

    fn tokens(&self) -> usize {
        self.events()
            .0
            .iter()
            .filter(|e| e.starts_with('{') && e.contains("\"text\""))
            .count()
    }
}

/// The payload of the chunked HTTP/1.1 response in `raw` (its head included) as far as
/// it arrived, and whether its terminating chunk did.
fn dechunk(raw: &[u8]) -> (Vec<u8>, bool) {
    let find = |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).position(|w| w == needle);
    let Some(head_end) = find(raw, b"\r\n\r\n") else {
        return (Vec::new(), false);
    };
    let head = String::from_utf8_lossy(&raw[..head_end]).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("transfer-encoding: chunked"), "{head}");
    let mut i = head_end + 4;
    let mut out = Vec::new();
    loop {
        let Some(line) = find(&raw[i..], b"\r\n") else {
            return (out, false);
        };
        let size = std::str::from_utf8(&raw[i..i + line])
            .ok()
            .and_then(|s| usize::from_str_radix(s.trim(), 16).ok())
            .unwrap_or_else(|| panic!("bad chunk size line at {i}"));
        i += line + 2;
        if size == 0 {
            return (out, true);
        }
        if raw.len() < i + size {
            out.extend_from_slice(&raw[i..]);
            return (out, false);
        }
        out.extend_from_slice(&raw[i..i + size]);
        i += size + 2;
    }
}

fn stream_request(tokens: u32) -> String {
    serde_json::json!({
        "model": "sim-model",
        "prompt": "drain me",
        "max_tokens": tokens,
        "stream": true,
    })
    .to_string()
}

/// Whether a connection to `addr` is refused; a connection that gets in (the race with
/// the listener's close) is dropped and tried again, for at most `limit`.
async fn refused_within(addr: SocketAddr, limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        match TcpStream::connect(addr).await {
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => return true,
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_streams_finish_and_refuses_new_connections() {
    let (p, d) = engines().await;
    let mut proxy = Proxy::start(&p, &d, &[]).await;
    let addr = proxy.addr;

    // An idle keep-alive connection: one answered request, then nothing.
    let mut idle = TcpStream::connect(addr).await.unwrap();
    idle.write_all(format!("GET /health HTTP/1.1\r\nhost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(5), idle.read(&mut buf))
        .await
        .expect("health answered in time")
        .unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);

    // 16 tokens: about 1.5 s of stream. Signal once the first token is out.
    let tokens = 16;
    let mut stream = Exchange::post(addr, "/v1/completions", &stream_request(tokens)).await;
    assert!(
        stream
            .read_until(Duration::from_secs(10), |s| s.tokens() >= 1)
            .await,
        "no first token: {}",
        proxy.log()
    );
    let signalled = Instant::now();
    proxy.sigterm();

    // The idle connection is closed at once.
    let idle_read = tokio::time::timeout(Duration::from_secs(1), idle.read(&mut buf)).await;
    assert!(
        matches!(idle_read, Ok(Ok(0)) | Ok(Err(_))),
        "the idle keep-alive connection stayed open: {idle_read:?}"
    );
    // New connections are refused while the stream still runs.
    assert!(
        refused_within(addr, Duration::from_secs(1)).await,
        "the proxy still accepts connections after SIGTERM"
    );
    // The stream had 1.5 s to run after its first token: it was still running.
    let refused_after = signalled.elapsed();
    assert!(
        refused_after < Duration::from_millis(1200),
        "the checks took {refused_after:?}: the stream may have ended before them"
    );

    // The stream goes on to its end.
    assert!(
        stream
            .read_until(Duration::from_secs(10), |s| s.events().1)
            .await,
        "the stream did not end in time"
    );
    let (events, complete) = stream.events();
    assert!(complete, "the stream was cut: {events:?}\n{}", proxy.log());
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    assert_eq!(stream.tokens(), tokens as usize, "{events:?}");
    assert!(
        events[events.len() - 2].contains("\"finish_reason\":\"length\""),
        "{events:?}"
    );

    // Then the process exits 0, soon.
    let status = proxy.exit_within(Duration::from_secs(2)).await;
    assert_eq!(status.code(), Some(0), "{}", proxy.log());
    let log = proxy.log();
    assert!(log.contains("draining in-flight requests"), "{log}");
    assert!(
        log.contains("drain finished: every connection closed"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_deadline_cuts_streams_and_exits() {
    let (p, d) = engines().await;
    let mut proxy = Proxy::start(&p, &d, &["--drain-timeout", "0.3"]).await;

    // 31 tokens: about 3 s of stream.
    let tokens = 31;
    let mut stream = Exchange::post(proxy.addr, "/v1/completions", &stream_request(tokens)).await;
    assert!(
        stream
            .read_until(Duration::from_secs(10), |s| s.tokens() >= 1)
            .await,
        "no first token: {}",
        proxy.log()
    );
    let signalled = Instant::now();
    proxy.sigterm();

    // Deadline 0.3 s; the margin (2.2 s) covers the `kill` command, the teardown and a
    // loaded machine, and stays under the 2.9 s the stream still had to run.
    let status = proxy.exit_within(Duration::from_millis(2500)).await;
    let exited = signalled.elapsed();
    assert_eq!(status.code(), Some(0), "{}", proxy.log());
    assert!(
        exited >= Duration::from_millis(300),
        "exited before the deadline ({exited:?}): the stream was not given its drain time"
    );

    // The stream was cut: closed without its last chunk and without `[DONE]`.
    assert!(
        stream.read_until(Duration::from_secs(2), |_| false).await,
        "the stream's connection stayed open after the proxy exited"
    );
    let (events, complete) = stream.events();
    assert!(!complete, "the stream ended cleanly: {events:?}");
    assert!(!events.iter().any(|e| e == "[DONE]"), "{events:?}");
    assert!(stream.tokens() < tokens as usize, "{events:?}");
    let log = proxy.log();
    assert!(
        log.contains("drain deadline passed: cut the connections still open"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_exits_at_once() {
    let (p, d) = engines().await;
    let mut proxy = Proxy::start(&p, &d, &[]).await;
    let mut stream = Exchange::post(proxy.addr, "/v1/completions", &stream_request(31)).await;
    assert!(
        stream
            .read_until(Duration::from_secs(10), |s| s.tokens() >= 1)
            .await,
        "no first token: {}",
        proxy.log()
    );
    proxy.sigterm();
    // The first signal's drain (30 s by default) has started once the listener is gone.
    assert!(refused_within(proxy.addr, Duration::from_secs(1)).await);
    proxy.sigterm();
    let status = proxy.exit_within(Duration::from_secs(1)).await;
    assert_eq!(status.code(), Some(1), "{}", proxy.log());
    let log = proxy.log();
    assert!(
        log.contains("second stop signal: exiting without draining"),
        "{log}"
    );
}
