//! The real `disagg-proxy serve` binary as a child process, for the CLI's tests.
#![allow(dead_code, unreachable_pub)] // each test binary uses a part

use std::io::Read;
use std::net::SocketAddr;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use disagg_sim::SimEngine;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

pub mod certs;

/// A `disagg-proxy serve` child process, killed if the test ends before it exits.
pub struct Proxy {
    pub child: Child,
    pub addr: SocketAddr,
    /// Its stderr (the log), gathered by a thread.
    log: Arc<Mutex<Vec<u8>>>,
    /// Its stdout (the access log), gathered by a thread.
    out: Arc<Mutex<Vec<u8>>>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Proxy {
    /// Start the proxy on a free port in front of `prefill` and `decode`, with `extra`
    /// flags (two serving threads unless they say `--threads`), and wait until it
    /// accepts connections.
    pub async fn start(prefill: &SimEngine, decode: &SimEngine, extra: &[&str]) -> Proxy {
        let mut args = vec![
            "--prefill".to_owned(),
            prefill.url(),
            "--decode".to_owned(),
            decode.url(),
        ];
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        Proxy::start_args(&args).await
    }

    /// Start `disagg-proxy serve ARGS` on a free port (`args` name the engines), and
    /// wait until it accepts connections.
    pub async fn start_args(args: &[String]) -> Proxy {
        Proxy::start_env(args, &[]).await
    }

    /// [`start_args`](Self::start_args) with environment variables `env` for the child
    /// (after the default `RUST_LOG=info`, which they may override).
    ///
    /// The proxy binds port 0 itself and the address is read from its "serving" log
    /// line: a port picked here and released before the child binds it could be taken
    /// meanwhile by an engine of a test running beside this one, which would then answer
    /// in the proxy's place.
    pub async fn start_env(args: &[String], env: &[(&str, &str)]) -> Proxy {
        let placeholder: SocketAddr = ([127, 0, 0, 1], 0).into();
        let threads: &[&str] = if args.iter().any(|a| a == "--threads") {
            &[]
        } else {
            &["--threads", "2"]
        };
        let mut child = Command::new(env!("CARGO_BIN_EXE_disagg-proxy"))
            .arg("serve")
            .args(args)
            .args(["--listen", "127.0.0.1:0"])
            .args(threads)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start disagg-proxy");
        let gather = |mut from: Box<dyn Read + Send>| {
            let into = Arc::new(Mutex::new(Vec::new()));
            let to = Arc::clone(&into);
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = from.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    to.lock().unwrap().extend_from_slice(&buf[..n]);
                }
            });
            into
        };
        let log = gather(Box::new(child.stderr.take().expect("piped stderr")));
        let out = gather(Box::new(child.stdout.take().expect("piped stdout")));
        let mut proxy = Proxy {
            child,
            addr: placeholder,
            log,
            out,
        };
        let start = Instant::now();
        loop {
            if let Some(addr) = serving_addr(&proxy.log()) {
                proxy.addr = addr;
                if TcpStream::connect(addr).await.is_ok() {
                    return proxy;
                }
            }
            if let Ok(Some(status)) = proxy.child.try_wait() {
                panic!("the proxy exited at start ({status}): {}", proxy.log());
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "the proxy did not listen in time: {}",
                proxy.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The proxy's base URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The value of the unlabelled metric `name` in the proxy's `GET /metrics`.
    pub async fn metric(&self, name: &str) -> u64 {
        let text = get(&self.url(), "/metrics").await.text();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing in\n{text}"))
    }

    /// Whether the endpoint `url` of `role` is in the set the proxy routes to: `GET
    /// /metrics` lists every routed endpoint's in-flight gauge, and an ejected (or
    /// checked-down) endpoint is left out of that set.
    pub async fn routes_to(&self, role: &str, url: &str) -> bool {
        let text = get(&self.url(), "/metrics").await.text();
        let line = format!("disagg_endpoint_in_flight{{role=\"{role}\",endpoint=\"{url}\"}}");
        text.lines().any(|l| l.starts_with(&line))
    }

    /// The process's resident memory (`VmRSS` of `/proc/PID/status`), in bytes.
    pub fn rss(&self) -> u64 {
        self.status_bytes("VmRSS:")
    }

    /// The process's private data memory (`VmData` of `/proc/PID/status`: its heap and
    /// the allocator's arenas as far as they are usable), in bytes: what it asked the
    /// system for. State kept grows it; the allocator touching more pages of the memory
    /// it already has grows only [`rss`](Self::rss).
    pub fn data_size(&self) -> u64 {
        self.status_bytes("VmData:")
    }

    fn status_bytes(&self, key: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("read the proxy's /proc status");
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("a {key} line"));
        kib * 1024
    }

    /// What it wrote to stdout so far.
    pub fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.out.lock().unwrap()).into_owned()
    }

    pub fn log(&self) -> String {
        String::from_utf8_lossy(&self.log.lock().unwrap()).into_owned()
    }

    pub fn sigterm(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM failed: {status}");
    }

    /// Wait for the process to exit, up to `limit`.
    pub async fn exit_within(&mut self, limit: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("poll the child") {
                return status;
            }
            assert!(
                start.elapsed() < limit,
                "the proxy did not exit within {limit:?}: {}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// A whole answer.
pub struct Answer {
    pub status: http::StatusCode,
    pub headers: http::HeaderMap,
    pub body: bytes::Bytes,
}

impl Answer {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The SSE `data:` payloads, `[DONE]` included.
    pub fn events(&self) -> Vec<String> {
        self.text()
            .split("\n\n")
            .filter_map(|ev| ev.trim().strip_prefix("data: ").map(str::to_owned))
            .collect()
    }

    /// The generated text of a completion answer, streamed or not.
    pub fn content(&self) -> String {
        self.generated("/choices/0/text", "/choices/0/text")
    }

    /// The generated text of a chat completion answer, streamed or not.
    pub fn chat_content(&self) -> String {
        self.generated("/choices/0/message/content", "/choices/0/delta/content")
    }

    /// The text at JSON pointer `whole` of a non-streamed answer, or the texts at
    /// `delta` of a streamed answer's events, joined.
    fn generated(&self, whole: &str, delta: &str) -> String {
        let text = |v: &serde_json::Value, at: &str| {
            v.pointer(at)
                .and_then(serde_json::Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        let streamed = self
            .header("content-type")
            .is_some_and(|c| c.starts_with("text/event-stream"));
        if !streamed {
            return text(&self.json(), whole);
        }
        let mut out = String::new();
        for e in self.events().iter().filter(|e| *e != "[DONE]") {
            let v: serde_json::Value = serde_json::from_str(e).expect("a JSON event");
            out.push_str(&text(&v, delta));
        }
        out
    }

    /// Assert an OpenAI-format error with `status` and `code`.
    pub fn assert_error(&self, status: u16, code: &str) {
        assert_eq!(self.status.as_u16(), status, "body: {}", self.text());
        let v = self.json();
        let e = &v["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(e["type"].is_string(), "{v}");
        assert_eq!(e["code"], code, "{v}");
    }
}

/// Send `req` (a fresh connection each time) and read the whole answer, within 20 s.
async fn send(req: http::Request<http_body_util::Full<bytes::Bytes>>) -> Answer {
    use http_body_util::BodyExt;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http();
    let exchange = async {
        let resp = client.request(req).await.expect("request sent");
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.expect("whole body").to_bytes();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    };
    tokio::time::timeout(Duration::from_secs(20), exchange)
        .await
        .expect("answered within 20 s")
}

/// POST the JSON `body` to `base + path`.
pub async fn post(base: &str, path: &str, body: &str) -> Answer {
    post_with(base, path, body, &[]).await
}

/// POST the JSON `body` to `base + path` with extra `headers`.
pub async fn post_with(base: &str, path: &str, body: &str, headers: &[(&str, &str)]) -> Answer {
    let mut req =
        http::Request::post(format!("{base}{path}")).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_owned(),
        )))
        .expect("a request");
    send(req).await
}

/// GET `base + path` with extra `headers`.
pub async fn get_with(base: &str, path: &str, headers: &[(&str, &str)]) -> Answer {
    let mut req = http::Request::get(format!("{base}{path}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .expect("a request");
    send(req).await
}

/// GET `base + path`.
pub async fn get(base: &str, path: &str) -> Answer {
    let req = http::Request::get(format!("{base}{path}"))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .expect("a request");
    send(req).await
}

/// A completion request for `prompt`.
pub fn completion(prompt: &str, max_tokens: u32, stream: bool) -> String {
    serde_json::json!({
        "model": "sim-model",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": stream,
    })
    .to_string()
}

/// Wait until `f` holds, polling every 10 ms, up to `limit`.
pub async fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    f()
}

/// A URL on 127.0.0.1 where nothing listens (connection refused), and the socket that
/// holds its port: bound, never listening, so no other listener can take the port while
/// the socket lives.
pub fn held_dead_url() -> (String, tokio::net::TcpSocket) {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind("127.0.0.1:0".parse().expect("address"))
        .expect("bind");
    let url = format!("http://{}", socket.local_addr().expect("bound address"));
    (url, socket)
}

/// The address in the proxy's "disagg-proxy serving listen=ADDR" log line, once it is
/// there (the line is logged at `info` once every serving thread listens).
fn serving_addr(log: &str) -> Option<SocketAddr> {
    let line = log.lines().find(|l| l.contains("disagg-proxy serving"))?;
    let rest = &line[line.find("listen=")? + "listen=".len()..];
    rest.split_whitespace().next()?.parse().ok()
}

/// A loopback address nothing listens on right now, for a listener a test starts
/// later (the proxy's): drawn in 10000-19999, where the system never hands out a port
/// to `bind(0)` or `connect` (Linux's ephemeral range starts at 32768) and the
/// simulator draws none (its runs of rank ports are in 20000-31999), so the engines a
/// test starts in between cannot take it.
///
/// Each port drawn is reserved until this process ends, by an exclusive lock on the
/// file `disagg-test-ports/PORT.lock` under the system's temporary directory (the
/// system drops the lock when the process ends, however it ends): a port locked by
/// another process is not drawn. So no two test processes drawing here at once (the
/// binaries of `cargo test`, the one-test processes of cargo-nextest) draw the same
/// port, and one process never draws a port twice. (A program outside the tests may
/// still bind the port first; a caller that can tell, a child that exits at start,
/// draws again.)
pub fn free_addr() -> SocketAddr {
    use std::hash::{BuildHasher, Hasher};
    // The ports this process drew, with the locks that reserve them.
    static DRAWN: Mutex<Vec<(u16, std::fs::File)>> = Mutex::new(Vec::new());
    let dir = std::env::temp_dir().join("disagg-test-ports");
    std::fs::create_dir_all(&dir).expect("create the port locks' directory");
    let mut draw = std::collections::hash_map::RandomState::new().build_hasher();
    for attempt in 0..1000_usize {
        draw.write_usize(attempt);
        let port = 10_000 + u16::try_from(draw.finish() % 10_000).expect("under 10000");
        let mut drawn = DRAWN
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if drawn.iter().any(|(p, _)| *p == port) {
            continue;
        }
        // Never removed: a file unlinked while another process locks it would let a
        // third lock a new file of the same name.
        let Ok(lock) = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(format!("{port}.lock")))
        else {
            continue;
        };
        if lock.try_lock().is_err() {
            // Another test process drew it.
            continue;
        }
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            drawn.push((port, lock));
            return l.local_addr().expect("its address");
        }
    }
    panic!(
        "no free port in 10000-19999 (or no lock under {})",
        dir.display()
    )
}

/// The Python the tests drive (`$DISAGG_PYTHON`, else the repository's `.venv`, which
/// `scripts/test.sh` creates with every package they need); `needs` names what the
/// calling test imports, for the message when there is none.
pub fn python(needs: &str) -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("DISAGG_PYTHON") {
        return p.into();
    }
    let venv = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    assert!(
        venv.exists(),
        "no Python with {needs}: run scripts/test.sh (it creates .venv), or set DISAGG_PYTHON"
    );
    venv
}

/// Read one request off `s`: its head and its body (a `content-length`'s worth, or
/// chunks to the last one, as they came), as text.
pub async fn read_request(s: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let chunked = head.contains("transfer-encoding: chunked");
    loop {
        let body = &buf[end..];
        let done = if chunked {
            body.ends_with(b"0\r\n\r\n")
        } else {
            body.len() >= length
        };
        if done {
            return Some(String::from_utf8_lossy(&buf).into_owned());
        }
        match s.read(&mut chunk).await {
            Ok(n) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => return Some(String::from_utf8_lossy(&buf).into_owned()),
        }
    }
}
