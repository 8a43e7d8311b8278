//! `disagg-proxy serve` holds against hostile clients: a body of very many keys is parsed
//! without stalling the event loop it came on, a body that stops half way is cut by
//! `--body-timeout`, a flood of large bodies is held under `--max-buffered-bytes`, its
//! memory given back after it, and bodies declared but not sent hold none of it; on the
//! forwarded routes, a body of very many frames of whitespace is read once and held to
//! the same budget, and a client's `x-request-id` reaches no engine. The real binary
//! runs as a child process (its memory is read from `/proc/PID/status`), against
//! simulated engines (or raw ones written here) in this process, over raw loopback
//! sockets.

#![allow(missing_docs)] // a test binary

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use disagg_sim::{SimConfig, SimEngine};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

mod common;
use common::{Proxy, read_request};

const MIB: u64 = 1024 * 1024;

async fn engines() -> (SimEngine, SimEngine) {
    let p = SimEngine::start(SimConfig::default())
        .await
        .expect("prefill sim");
    let d = SimEngine::start(SimConfig::default())
        .await
        .expect("decode sim");
    (p, d)
}

/// One HTTP/1.1 answer read off a raw socket.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "answer {} is not JSON ({e}): {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }
}

/// Read one answer with a `content-length` or chunked body.
async fn read_answer(sock: &mut (impl AsyncRead + Unpin)) -> std::io::Result<Answer> {
    let mut raw = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    let head_end = loop {
        if let Some(i) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = sock.read(&mut buf).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        raw.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&raw[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let mut body = raw[head_end..].to_vec();
    let length = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .map(|(_, v)| v.parse::<usize>().expect("a content length"));
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"));
    loop {
        let complete = match length {
            Some(n) => body.len() >= n,
            None if chunked => body.ends_with(b"0\r\n\r\n"),
            None => false,
        };
        if complete {
            break;
        }
        let n = sock.read(&mut buf).await?;
        if n == 0 {
            if length.is_none() && !chunked {
                break;
            }
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        body.extend_from_slice(&buf[..n]);
    }
    if chunked {
        body = dechunk(&body);
    }
    Ok(Answer {
        status,
        headers,
        body,
    })
}

fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(i) = raw.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&raw[..i]).trim(), 16)
            .expect("a chunk size");
        if size == 0 {
            break;
        }
        out.extend_from_slice(&raw[i + 2..i + 2 + size]);
        raw = &raw[i + 2 + size + 2..];
    }
    out
}

/// Whether the peer closed the connection (end of stream or reset) within `limit`.
async fn closes_within(sock: &mut (impl AsyncRead + Unpin), limit: Duration) -> bool {
    let mut buf = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, sock.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => continue,
        }
    }
}

fn head(addr: SocketAddr, length: usize) -> String {
    format!(
        "POST /v1/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {length}\r\n\r\n"
    )
}

/// A small completion request, as one write.
fn small_request(addr: SocketAddr) -> Vec<u8> {
    let body = r#"{"model":"sim-model","prompt":"hello there","max_tokens":2}"#;
    let mut req = head(addr, body.len()).into_bytes();
    req.extend_from_slice(body.as_bytes());
    req
}

/// A completion body with `n` distinct top-level keys besides its own fields, then
/// `last`: 120k of them make 1.3 MB, which the proxy once took 13 s of an event loop to
/// parse.
fn many_keys_body(n: usize, last: &str) -> Vec<u8> {
    let mut s = String::from(r#"{"model":"sim-model","prompt":"hello","max_tokens":2"#);
    for i in 0..n {
        s.push_str(&format!(",\"k{i}\":{i}"));
    }
    s.push_str(last);
    s.push('}');
    s.into_bytes()
}

/// Send `body` on a new connection; its answer, and the time it took.
async fn post_timed(addr: SocketAddr, body: &[u8]) -> (Answer, Duration) {
    let mut sock = TcpStream::connect(addr).await.expect("connect");
    let started = Instant::now();
    sock.write_all(head(addr, body.len()).as_bytes())
        .await
        .expect("send the head");
    sock.write_all(body).await.expect("send the body");
    let answer = tokio::time::timeout(Duration::from_secs(10), read_answer(&mut sock))
        .await
        .expect("an answer within 10 s")
        .expect("an answer");
    (answer, started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_body_of_many_keys_is_answered_promptly_while_its_loop_serves_others() {
    let (p, d) = engines().await;
    // One event loop: the big body and the small requests share it.
    let proxy = Proxy::start(&p, &d, &["--threads", "1"]).await;
    let addr = proxy.addr;

    // A client doing small requests one after the other on one keep-alive connection,
    // noting when each answer is complete.
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let ticker = tokio::spawn(async move {
        let mut sock = TcpStream::connect(addr).await.expect("connect");
        let req = small_request(addr);
        let mut done = vec![Instant::now()];
        while !*stop.borrow() {
            sock.write_all(&req).await.expect("send a small request");
            let answer = read_answer(&mut sock).await.expect("a small answer");
            assert_eq!(answer.status, 200, "{answer:?}");
            done.push(Instant::now());
        }
        done
    });
    tokio::time::sleep(Duration::from_millis(300)).await;

    let started = Instant::now();
    // 120k keys: past the body's field ceiling (`disagg_json::MAX_FIELDS`), refused
    // 400 once the whole body is read as JSON (the rest of it skipped, not kept): the
    // proxy's own answer, which no engine's time is part of.
    let body = many_keys_body(120_000, r#","model":5"#);
    assert!(body.len() > 1_300_000, "{}", body.len());
    let (refused, took) = post_timed(addr, &body).await;
    assert_eq!(refused.status, 400, "{refused:?}");
    let err = &refused.json()["error"];
    assert_eq!(err["code"], "invalid_request_body");
    assert!(
        err["message"]
            .as_str()
            .unwrap_or_default()
            .contains("1024 top-level fields"),
        "{err}"
    );
    // At the ceiling, `model` again as a number: duplicate keys take their last value,
    // so the proxy folds the whole body and refuses the number.
    let (refused, _) = post_timed(addr, &many_keys_body(1_000, r#","model":5"#)).await;
    assert_eq!(refused.status, 400, "{refused:?}");
    assert!(
        refused.json()["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("model"),
        "{refused:?}"
    );
    // The same body, valid: served, every key passed on to the engines (their parse of
    // it runs in this test process, so only the proxy's promptness above is timed).
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop_tx.send(true).expect("stop the ticker");
    let done = ticker.await.expect("the ticker");

    // Bounds against the quadratic fold this test guards (13 s of one event loop), not
    // a performance goal: loose enough for a debug build on a loaded 2-core machine,
    // under half of what the fold took.
    assert!(
        took < Duration::from_secs(6),
        "the 120k-key body was answered after {took:?}"
    );
    // Gaps between the small answers from when the big body was sent to the end.
    assert_the_loop_kept_serving(&done, started);

    // A body at the ceiling, valid: served, every key passed on to the engines.
    let (served, _) = post_timed(addr, &many_keys_body(1_000, "")).await;
    assert_eq!(served.status, 200, "{served:?}");
    assert!(
        d.requests().iter().any(|r| r.body["k999"] == 999),
        "the decode engine got every key"
    );
}

#[tokio::test]
async fn a_stalled_body_is_cut_by_the_body_timeout() {
    let (p, d) = engines().await;
    let proxy = Proxy::start(&p, &d, &["--body-timeout", "1"]).await;
    let mut sock = TcpStream::connect(proxy.addr).await.expect("connect");
    // Half a body, then nothing.
    sock.write_all(head(proxy.addr, 1000).as_bytes())
        .await
        .expect("send the head");
    sock.write_all(&[b' '; 500]).await.expect("send half");
    let started = Instant::now();
    let answer = tokio::time::timeout(Duration::from_secs(10), read_answer(&mut sock))
        .await
        .expect("an answer within 10 s")
        .expect("an answer");
    let took = started.elapsed();
    assert_eq!(answer.status, 408, "{answer:?}");
    let err = &answer.json()["error"];
    assert_eq!(err["code"], "request_timeout");
    assert_eq!(err["type"], "invalid_request_error");
    assert!(err["param"].is_null());
    assert!(err["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert_eq!(answer.header("connection"), Some("close"));
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "cut after {took:?}, for a 1 s timeout"
    );
    assert!(
        closes_within(&mut sock, Duration::from_secs(2)).await,
        "the connection stayed open after the 408"
    );
    assert!(d.requests().is_empty(), "nothing reached the engines");
}

#[tokio::test]
async fn a_body_sent_in_pieces_within_the_timeout_is_served() {
    let (p, d) = engines().await;
    let proxy = Proxy::start(&p, &d, &["--body-timeout", "2"]).await;
    let mut sock = TcpStream::connect(proxy.addr).await.expect("connect");
    let body = br#"{"model":"sim-model","prompt":"in three pieces","max_tokens":2}"#;
    sock.write_all(head(proxy.addr, body.len()).as_bytes())
        .await
        .expect("send the head");
    for piece in body.chunks(body.len() / 3 + 1) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        sock.write_all(piece).await.expect("send a piece");
    }
    let answer = tokio::time::timeout(Duration::from_secs(10), read_answer(&mut sock))
        .await
        .expect("an answer within 10 s")
        .expect("an answer");
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(d.requests().len(), 1);
    assert_eq!(d.requests()[0].body["prompt"], "in three pieces");
}

/// A body takes its share of `--max-buffered-bytes` as its bytes arrive, not at its
/// declared length: with the defaults (1 GiB, bodies up to 32 MiB), 32 clients that each
/// declare the largest body and send none of it hold no room, and a small request beside
/// them is served (it was 503 `server_busy` for as long as the body timeout held them).
#[tokio::test]
async fn clients_that_declare_large_bodies_and_send_nothing_hold_no_room() {
    let (p, d) = engines().await;
    let proxy = Proxy::start(&p, &d, &[]).await;
    let addr = proxy.addr;
    let mut silent = Vec::new();
    for _ in 0..32 {
        let mut sock = TcpStream::connect(addr).await.expect("connect");
        let head =
            head(addr, 32 * MIB as usize).replace("\r\n\r\n", "\r\nexpect: 100-continue\r\n\r\n");
        sock.write_all(head.as_bytes())
            .await
            .expect("send the head");
        // The proxy asks for the body once it has started reading it.
        let mut got = Vec::new();
        let mut buf = [0u8; 256];
        while !got.ends_with(b"\r\n\r\n") {
            let n = tokio::time::timeout(Duration::from_secs(10), sock.read(&mut buf))
                .await
                .expect("a 100 Continue within 10 s")
                .expect("read");
            assert!(n > 0, "closed before asking for the body");
            got.extend_from_slice(&buf[..n]);
        }
        assert!(
            got.starts_with(b"HTTP/1.1 100"),
            "{}",
            String::from_utf8_lossy(&got)
        );
        silent.push(sock);
    }
    let body = br#"{"model":"sim-model","prompt":"beside them","max_tokens":2}"#;
    let (answer, _) = post_timed(addr, body).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(d.requests().len(), 1);
    drop(silent);
}

/// The budget of the flood test: the proxy may hold this many bytes of bodies at once.
const CAP: u64 = 256 * MIB;

/// The proxy's gauge of the client body bytes it holds now.
const BUFFERED: &str = "disagg_request_body_buffered_bytes";

/// What one flood did to the proxy.
struct Flood {
    /// Clients whose body the proxy took (and held until the flood ended).
    held: usize,
    /// The proxy's highest RSS while it held them.
    during: u64,
    /// Its RSS once the flood's connections were gone (back near idle, or after 10 s).
    after: u64,
}

/// Flood the proxy with `clients` that each declare `declared` bytes of body, send
/// `sent` of them and stall until the flood ends. Checks that every client over the cap
/// is answered 503 `server_busy` while the others still stall (as its bytes would pass
/// it), and that the others are held: the proxy's gauge of buffered body bytes reads
/// theirs, all of them, before its memory is read.
///
/// The proxy serves on one thread (`--threads 1`): the budget is taken and given back
/// by one thread, so exactly as many bodies as fit are held. With two, a body cut on one
/// thread still holds its bytes for the instant before its read is dropped, and a body
/// whose next bytes come on the other in that instant is cut too (one fewer held; the
/// budget's rule, bytes held now, is kept either way).
async fn flood(proxy: &Proxy, clients: usize, declared: usize, sent: usize, idle: u64) -> Flood {
    let addr = proxy.addr;
    // Each admitted body takes from the budget the bytes it has sent: the clients whose
    // next bytes would pass it are cut, and give theirs back, until those left fit.
    let admitted = (CAP / sent as u64) as usize;
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let (answered_tx, mut answered) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (mut stop_w, mut stop_r) = (stop.clone(), stop.clone());
        let answered_tx = answered_tx.clone();
        tasks.push(tokio::spawn(async move {
            let mut sock = TcpStream::connect(addr).await.expect("connect");
            sock.write_all(head(addr, declared).as_bytes())
                .await
                .expect("send the head");
            let (mut rd, mut wr) = sock.into_split();
            // Most of the body, then a stall until the flood ends; the socket stays open.
            let writer = tokio::spawn(async move {
                let chunk = vec![b' '; 256 * 1024];
                let mut done = 0;
                while done < sent {
                    let n = chunk.len().min(sent - done);
                    if wr.write_all(&chunk[..n]).await.is_err() {
                        return wr;
                    }
                    done += n;
                }
                let _ = stop_w.wait_for(|s| *s).await;
                wr
            });
            let answer = tokio::select! {
                a = read_answer(&mut rd) => a.ok(),
                _ = stop_r.wait_for(|s| *s) => None,
            };
            let _ = answered_tx.send(());
            let wr = writer.await.expect("the writer");
            drop((rd, wr));
            answer
        }));
    }
    drop(answered_tx);

    // Every client over the cap is answered; the admitted ones send all they will.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut got = 0;
    while got < clients - admitted {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, answered.recv()).await {
            Ok(Some(())) => got += 1,
            _ => panic!("only {got} clients were answered: {}", proxy.log()),
        }
    }
    // The proxy holds every admitted body, all its bytes, when its gauge says so (the
    // bytes are in its buffers then, not in the sockets' queues).
    let all_held = (admitted * sent) as u64;
    loop {
        let buffered = proxy.metric(BUFFERED).await;
        if buffered == all_held {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the proxy buffers {buffered} bytes of bodies, not the {admitted} × {sent} that fit"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let during = proxy.rss();
    stop_tx.send(true).expect("end the flood");
    let mut held = 0;
    for task in tasks {
        match task.await.expect("a client") {
            None => held += 1,
            Some(answer) => {
                assert_eq!(answer.status, 503, "{answer:?}");
                let err = &answer.json()["error"];
                assert_eq!(err["code"], "server_busy", "{answer:?}");
                assert_eq!(err["type"], "server_error");
                assert_eq!(answer.header("retry-after"), Some("1"));
                // Before the flood ended (the stalled bodies are let go only once
                // every refused client was answered), and not by the body timeout
                // (`--body-timeout 600`, and the code says so).
                assert_eq!(answer.header("connection"), Some("close"));
            }
        }
    }
    assert_eq!(held, admitted, "clients held (the others were refused)");
    // Every share given back once the connections are gone, and back near idle.
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let buffered = proxy.metric(BUFFERED).await;
        if buffered == 0 {
            break;
        }
        assert!(
            Instant::now() < until,
            "{buffered} bytes of bodies still counted after the flood"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let back = idle + 32 * MIB;
    let until = Instant::now() + Duration::from_secs(10);
    let mut after = proxy.rss();
    while after > back && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(100)).await;
        after = proxy.rss();
    }
    Flood {
        held,
        during,
        after,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn floods_of_stalled_bodies_are_held_under_the_cap_and_their_memory_given_back() {
    let (p, d) = engines().await;
    let cap = CAP.to_string();
    let proxy = Proxy::start(
        &p,
        &d,
        &[
            "--max-buffered-bytes",
            &cap,
            "--threads",
            "1",
            "--body-timeout",
            "600",
        ],
    )
    .await;
    let addr = proxy.addr;
    // Idle, after a few requests have warmed its serving thread up.
    for _ in 0..8 {
        let mut sock = TcpStream::connect(addr).await.expect("connect");
        sock.write_all(&small_request(addr)).await.expect("send");
        assert_eq!(read_answer(&mut sock).await.expect("answer").status, 200);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let idle = proxy.rss();

    // 64 clients of 31 MB (8 held), then 64 of 12 MB (23 held): the second flood's
    // bodies are of a size the allocator would by then have kept on its heap.
    for (declared, sent) in [(31_000_000, 30_000_000), (12_000_000, 11_500_000)] {
        let f = flood(&proxy, 64, declared, sent, idle).await;
        let held = (f.held * sent) as u64;
        let margin = 64 * MIB;
        eprintln!(
            "{declared} B bodies: RSS idle {} MiB, during the flood {} MiB ({} bodies, {} MiB held), after it {} MiB",
            idle / MIB,
            f.during / MIB,
            f.held,
            held / MIB,
            f.after / MIB
        );
        // During the flood: the bodies held, and no more than the cap plus a margin
        // for the connections' own buffers.
        assert!(
            f.during >= idle + held * 3 / 4,
            "RSS {} during the flood does not show the {held} bytes held (idle {idle})",
            f.during
        );
        assert!(
            f.during <= idle + CAP + margin,
            "RSS {} during the flood is past idle {idle} + the cap {CAP} + {margin}",
            f.during
        );
        assert!(
            f.after <= idle + 32 * MIB,
            "RSS {} after the flood stays above idle {idle} + 32 MiB",
            f.after
        );
    }
    // And the proxy serves again.
    let mut sock = TcpStream::connect(addr).await.expect("connect");
    sock.write_all(&small_request(addr)).await.expect("send");
    assert_eq!(read_answer(&mut sock).await.expect("answer").status, 200);
}

// === the forwarded routes ===

/// A raw engine: answers every request (read to its end) `{"ok":true}` and closes the
/// connection, and keeps each request it saw (head and body, as text).
struct RawEngine {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<String>>>,
}

impl RawEngine {
    async fn start() -> RawEngine {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("its address");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let kept = Arc::clone(&seen);
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let kept = Arc::clone(&kept);
                tokio::spawn(async move {
                    let Some(request) = read_request(&mut s).await else {
                        return;
                    };
                    kept.lock().expect("the record").push(request);
                    let body = r#"{"ok":true}"#;
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = s.write_all(answer.as_bytes()).await;
                    let _ = s.shutdown().await;
                });
            }
        });
        RawEngine { addr, seen }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The requests a client caused (not the proxy's own `GET`s: start-up probes).
    fn requests(&self) -> Vec<String> {
        let seen = self.seen.lock().expect("the record").clone();
        seen.into_iter()
            .filter(|r| !r.starts_with("GET "))
            .collect()
    }

    /// The proxy in front of this engine (as prefill and decode), with `extra` flags.
    async fn proxy(&self, extra: &[&str]) -> Proxy {
        let mut args = vec![
            "--prefill".to_owned(),
            self.url(),
            "--decode".to_owned(),
            self.url(),
        ];
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        Proxy::start_args(&args).await
    }
}

/// The head of a chunked `POST target`.
fn chunked_head(addr: SocketAddr, target: &str) -> String {
    format!(
        "POST {target} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    )
}

/// `data` as one HTTP/1.1 chunk.
fn chunk(data: &[u8]) -> Vec<u8> {
    let mut out = format!("{:x}\r\n", data.len()).into_bytes();
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
    out
}

/// A forwarded body of 200,000 one-byte chunks of whitespace (hyper hands each on as a
/// frame of its own), then `{}`: the proxy looks at each byte once to tell that it is a
/// JSON object, where it once read everything from the first byte again after each
/// frame (20 billion looks, on the event loop). It reaches the engine whole, and the
/// loop serves other connections meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forwarded_body_of_many_frames_of_whitespace_is_read_once_while_its_loop_serves_others() {
    let engine = RawEngine::start().await;
    // One event loop: the big body and the small requests share it.
    let proxy = engine.proxy(&["--threads", "1"]).await;
    let addr = proxy.addr;

    // A client asking the proxy's own `GET /health` one after the other on one
    // keep-alive connection, noting when each answer is complete.
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let ticker = tokio::spawn(async move {
        let mut sock = TcpStream::connect(addr).await.expect("connect");
        let req = format!("GET /health HTTP/1.1\r\nhost: {addr}\r\n\r\n");
        let mut done = vec![Instant::now()];
        while !*stop.borrow() {
            sock.write_all(req.as_bytes())
                .await
                .expect("ask for health");
            let answer = read_answer(&mut sock).await.expect("a health answer");
            assert_eq!(answer.status, 200, "{answer:?}");
            done.push(Instant::now());
        }
        done
    });
    tokio::time::sleep(Duration::from_millis(300)).await;

    const FRAMES: usize = 200_000;
    let mut request = chunked_head(addr, "/tokenize").into_bytes();
    for i in 0..FRAMES {
        request.extend_from_slice(&chunk(&[b" \t\r\n"[i % 4]]));
    }
    request.extend_from_slice(&chunk(b"{}"));
    request.extend_from_slice(b"0\r\n\r\n");
    let started = Instant::now();
    let mut sock = TcpStream::connect(addr).await.expect("connect");
    sock.write_all(&request).await.expect("send the body");
    let answer = tokio::time::timeout(Duration::from_secs(10), read_answer(&mut sock))
        .await
        .expect("an answer within 10 s")
        .expect("an answer");
    let took = started.elapsed();
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.json()["ok"], true);
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop_tx.send(true).expect("stop the ticker");
    let done = ticker.await.expect("the ticker");

    // The engine got the body whole, as one: `{}` after the whitespace.
    let got = engine.requests();
    assert_eq!(got.len(), 1, "{} requests", got.len());
    let (head, body) = got[0].split_once("\r\n\r\n").expect("a head");
    assert!(head.starts_with("POST /tokenize "), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains(&format!("content-length: {}", FRAMES + 2)),
        "{head}"
    );
    assert_eq!(body.len(), FRAMES + 2);
    let value: serde_json::Value = serde_json::from_str(body).expect("JSON");
    assert_eq!(value, serde_json::json!({}));

    // Bounds against the quadratic rescan this test guards (minutes of one event
    // loop), not a performance goal: loose enough for a debug build on a loaded
    // 2-core machine (the answer has 10 s).
    assert!(took < Duration::from_secs(8), "answered after {took:?}");
    assert_the_loop_kept_serving(&done, started);
}

/// What a forwarded body holds while its first bytes are read is taken from
/// `--max-buffered-bytes`, as an orchestrated body's bytes are: with the budget spent,
/// a body of whitespace is refused at once (503 `server_busy`, the connection closed),
/// not held; with room again, the same kind of body is served.
#[tokio::test]
async fn forwarded_whitespace_is_held_to_the_body_budget() {
    let engine = RawEngine::start().await;
    let mib = "1048576";
    let proxy = engine
        .proxy(&["--max-body-bytes", mib, "--max-buffered-bytes", mib])
        .await;
    let addr = proxy.addr;
    // An orchestrated body that sends all of the budget but a byte holds that, and
    // stalls.
    let mut occupant = TcpStream::connect(addr).await.expect("connect");
    occupant
        .write_all(head(addr, 1024 * 1024).as_bytes())
        .await
        .expect("send the head");
    let mut held = vec![b' '; 1024 * 1024 - 1];
    held[0] = b'{';
    occupant.write_all(&held).await.expect("send the bytes");
    // Taken once a small forwarded body is refused for it.
    let probe = |target: &'static str| async move {
        let mut sock = TcpStream::connect(addr).await.expect("connect");
        let request = format!(
            "POST {target} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}"
        );
        sock.write_all(request.as_bytes()).await.expect("send");
        read_answer(&mut sock).await.expect("an answer")
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while probe("/tokenize").await.status != 503 {
        assert!(Instant::now() < deadline, "the budget was never taken");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // (A probe sent before the occupant's head was read reached the engine.)
    let probes = engine.requests().len();

    // Whitespace, which tells nothing yet: refused at its first chunk, not held.
    let mut sock = TcpStream::connect(addr).await.expect("connect");
    let mut request = chunked_head(addr, "/tokenize").into_bytes();
    request.extend_from_slice(&chunk(&[b' '; 64 * 1024]));
    sock.write_all(&request).await.expect("send whitespace");
    let answer = tokio::time::timeout(Duration::from_secs(3), read_answer(&mut sock))
        .await
        .expect("whitespace past the budget was held, not refused")
        .expect("an answer");
    assert_eq!(answer.status, 503, "{answer:?}");
    assert_eq!(answer.json()["error"]["code"], "server_busy", "{answer:?}");
    assert_eq!(answer.header("retry-after"), Some("1"));
    assert_eq!(answer.header("connection"), Some("close"));
    assert!(
        closes_within(&mut sock, Duration::from_secs(2)).await,
        "the connection stayed open after the 503"
    );

    // The occupant leaves: 800 KiB of whitespace then `{}` fits, and is served.
    drop(occupant);
    let mut body = chunked_head(addr, "/tokenize").into_bytes();
    for _ in 0..100 {
        body.extend_from_slice(&chunk(&[b' '; 8 * 1024]));
    }
    body.extend_from_slice(&chunk(b"{}"));
    body.extend_from_slice(b"0\r\n\r\n");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut sock = TcpStream::connect(addr).await.expect("connect");
        sock.write_all(&body).await.expect("send");
        let answer = read_answer(&mut sock).await.expect("an answer");
        if answer.status == 200 {
            break;
        }
        assert_eq!(answer.status, 503, "{answer:?}");
        assert!(Instant::now() < deadline, "the budget never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let got = engine.requests();
    assert_eq!(got.len(), probes + 1, "{} requests", got.len());
    assert!(got[probes].ends_with(&format!("{}{{}}", " ".repeat(800 * 1024))));
}

/// A body that is no JSON object streams to the engine, but not after a long run of
/// whitespace: those first bytes would wait for the engine outside the body budget, so
/// such a body is read whole under it (and reaches the engine with its length).
#[tokio::test]
async fn a_long_start_of_a_streamed_body_is_read_whole_under_the_budget() {
    let engine = RawEngine::start().await;
    let proxy = engine.proxy(&[]).await;
    let addr = proxy.addr;
    let send = |body: Vec<u8>| async move {
        let mut sock = TcpStream::connect(addr).await.expect("connect");
        let mut request = chunked_head(addr, "/tokenize").into_bytes();
        for piece in body.chunks(64 * 1024) {
            request.extend_from_slice(&chunk(piece));
        }
        request.extend_from_slice(b"0\r\n\r\n");
        sock.write_all(&request).await.expect("send");
        read_answer(&mut sock).await.expect("an answer")
    };
    // 100 KiB of whitespace, then bytes that are no JSON: read whole.
    let mut long = vec![b' '; 100 * 1024];
    long.extend_from_slice(&[b'x'; 1024]);
    assert_eq!(send(long).await.status, 200);
    // A short start: streamed, as it always was.
    let mut short = vec![b' '; 1024];
    short.extend_from_slice(&[b'x'; 100 * 1024]);
    assert_eq!(send(short).await.status, 200);
    let got = engine.requests();
    assert_eq!(got.len(), 2);
    let head = |r: &str| {
        r.split("\r\n\r\n")
            .next()
            .unwrap_or("")
            .to_ascii_lowercase()
    };
    assert!(
        head(&got[0]).contains("content-length: 103424"),
        "{}",
        head(&got[0])
    );
    assert!(
        head(&got[1]).contains("transfer-encoding: chunked"),
        "{}",
        head(&got[1])
    );
}

/// A client's `x-request-id` reaches no engine on the forwarded (a JSON body read whole,
/// and one streamed), direct and fanned-out routes: vLLM takes it as its own request id,
/// which must be unique among its requests in flight, so the engine-side id is never
/// the client's to choose (on the orchestrated legs it is the proxy's own).
#[tokio::test]
async fn a_clients_request_id_reaches_no_engine_on_the_forwarded_routes() {
    let engine = RawEngine::start().await;
    let proxy = engine.proxy(&["--admin-routes"]).await;
    let addr = proxy.addr;
    let form = "--x\r\ncontent-disposition: form-data; name=\"a\"\r\n\r\nv\r\n--x--\r\n";
    let json = r#"{"model":"sim-model","prompt":"a b"}"#;
    let sent = [
        ("/tokenize", json),
        ("/v1/audio/transcriptions", form),
        ("/invocations", json),
        ("/reset_prefix_cache", ""),
    ];
    for (target, body) in sent {
        let mut sock = TcpStream::connect(addr).await.expect("connect");
        let request = format!(
            "POST {target} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\nX-Request-Id: client-chosen-id\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        sock.write_all(request.as_bytes()).await.expect("send");
        let answer = read_answer(&mut sock).await.expect("an answer");
        assert_eq!(answer.status, 200, "{target}: {answer:?}");
    }
    let got = engine.requests();
    assert_eq!(got.len(), sent.len(), "{got:?}");
    for (request, (target, _)) in got.iter().zip(sent) {
        assert!(request.starts_with(&format!("POST {target} ")), "{request}");
        let lower = request.to_ascii_lowercase();
        // The proxy's own id, as on the legs (without one vLLM takes the body's
        // `request_id`, the client's again).
        assert!(lower.contains("x-request-id: fwd-"), "{request}");
        assert!(!lower.contains("client-chosen-id"), "{request}");
    }
}

/// The small answers `done` (when each came) went on while the big body was read,
/// from `started`: at least three, and none waited more than 3 s for the one before
/// (a loaded debug build may pause a while; the loop the tests guard against stalled
/// 13 s and minutes).
fn assert_the_loop_kept_serving(done: &[Instant], started: Instant) {
    let gaps: Vec<Duration> = done
        .windows(2)
        .filter(|w| w[1] > started)
        .map(|w| w[1] - w[0])
        .collect();
    assert!(gaps.len() >= 3, "few small answers meanwhile: {gaps:?}");
    let worst = gaps.iter().max().copied().unwrap_or_default();
    assert!(
        worst <= Duration::from_secs(3),
        "the other connection waited {worst:?} for an answer"
    );
}
