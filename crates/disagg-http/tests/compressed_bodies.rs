//! A compressed request body is refused on every route kind (orchestrated, forwarded,
//! direct, fanned out), whatever the spelling of the header that says so: 415
//! `unsupported_content_encoding`, before the body is read, no engine asked. The proxy
//! strips the KV-handoff fields no client may send an engine from every body it reads;
//! a body it cannot read (gzip, zstd, brotli, deflate, or SGLang's `x-body-compressed`,
//! which its request-decompression middleware decompresses before its routes read the
//! body) it could not strip, and the engine would decompress the client's
//! `bootstrap_host`. Over loopback: a `PdService` served by the crate's server,
//! simulated engines behind.

#![allow(missing_docs)] // a test binary

use std::net::SocketAddr;
use std::time::Duration;

use disagg_connectors::vllm::VllmNixl;
use disagg_core::{Endpoint, Orchestrator, Role, source::StaticSource};
use disagg_http::routed::{RouteKind, RouteListener, RouteSummary};
use disagg_http::server::Builder;
use disagg_http::{HttpTransport, PdService, PdServiceConfig, RouteTable};
use disagg_sim::{SimConfig, SimEngine};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// A body that carries a client's KV handoff, which no engine may get from a client.
const HANDOFF: &str = r#"{"model":"sim-model","prompt":"a b","max_tokens":2,"bootstrap_host":"10.6.6.6","bootstrap_port":8998,"bootstrap_room":7,"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.6.6.6","remote_port":5600}}"#;

/// How long a client waits for its answer: the proxy's body timeout is far longer, so
/// an answer within it was not waiting for a body.
const ANSWER_WITHIN: Duration = Duration::from_secs(10);

/// Every route summary told, as it is told.
#[derive(Clone)]
struct Heard(mpsc::UnboundedSender<RouteSummary>);

impl RouteListener for Heard {
    fn on_route(&self, summary: &RouteSummary) {
        let _ = self.0.send(summary.clone());
    }
}

/// CRC-32 (IEEE), as gzip's trailer has it.
fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// `data` as a gzip member (one stored deflate block): what `gzip -d` reads back.
fn gzip(data: &[u8]) -> Vec<u8> {
    let len = u16::try_from(data.len()).unwrap();
    let mut out = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff];
    out.push(1); // the last block, stored
    out.extend(len.to_le_bytes());
    out.extend((!len).to_le_bytes());
    out.extend(data);
    out.extend(crc32(data).to_le_bytes());
    out.extend(u32::try_from(data.len()).unwrap().to_le_bytes());
    out
}

/// `data` as a zstd frame (one raw block, its size in the header): what `zstd -d` reads
/// back.
fn zstd(data: &[u8]) -> Vec<u8> {
    let len = u8::try_from(data.len()).unwrap();
    let mut out = vec![0x28, 0xb5, 0x2f, 0xfd];
    out.push(0x20); // a single segment, its size in one byte
    out.push(len);
    let block = 1u32 | (u32::from(len) << 3); // the last block, raw
    out.extend(&block.to_le_bytes()[..3]);
    out.extend(data);
    out
}

/// A proxy over `p` and `d`, the admin routes open, its route summaries sent on the
/// channel; with an API-key check in front (key `sk-ok`) when `keys`.
async fn proxy(
    p: &SimEngine,
    d: &SimEngine,
    keys: bool,
) -> (SocketAddr, mpsc::UnboundedReceiver<RouteSummary>) {
    let source = StaticSource::new([
        Endpoint::new(&p.url(), Role::Prefill).unwrap(),
        Endpoint::new(&d.url(), Role::Decode).unwrap(),
    ]);
    let orchestrator =
        Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new()).build();
    let (tx, rx) = mpsc::unbounded_channel();
    let mut config = PdServiceConfig::default();
    config.route_listeners.push(Heard(tx));
    config.routes = RouteTable::default().admin_routes(true);
    // Longer than a client waits here: an answer is never a body timeout.
    config.body_timeout = Duration::from_secs(600);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    #[cfg(feature = "auth")]
    if keys {
        use disagg_http::auth::{ApiKeyLayer, ApiKeys};
        let layer = ApiKeyLayer::new(ApiKeys::new(["sk-ok"]).unwrap())
            .tell_refusals(orchestrator.clone(), config.route_listeners.clone());
        let service = tower::Layer::layer(&layer, PdService::with_config(orchestrator, config));
        tokio::spawn(Builder::new().serve(listener, service, std::future::pending()));
        return (addr, rx);
    }
    assert!(!keys, "keys need the auth feature");
    let service = PdService::with_config(orchestrator, config);
    tokio::spawn(Builder::new().serve(listener, service, std::future::pending()));
    (addr, rx)
}

/// An answer: its status, its head as text, its body.
#[derive(Debug)]
struct Answer {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }

    /// The value of the answer's header `name`, when it has one.
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// POST `path` with the extra header lines `extra` (each ending in `\r\n`), a body of
/// `declared` bytes of which `body` is sent; the answer, read by its `content-length`
/// (the connection may close as soon as it is written), within [`ANSWER_WITHIN`].
async fn post(addr: SocketAddr, path: &str, extra: &str, body: &[u8], declared: usize) -> Answer {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         x-request-id: req-7\r\n{extra}content-length: {declared}\r\n\r\n"
    );
    tcp.write_all(&[head.as_bytes(), body].concat())
        .await
        .unwrap();
    tokio::time::timeout(ANSWER_WITHIN, read_answer(&mut tcp))
        .await
        .unwrap_or_else(|_| panic!("{path} {extra:?}: no answer within {ANSWER_WITHIN:?}"))
}

/// One answer from `tcp`: its head, then its `content-length` of body.
async fn read_answer(tcp: &mut TcpStream) -> Answer {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = tcp.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "closed before a head: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&got[..head_end]).into_owned();
    let mut answer = Answer {
        status: head[9..12].parse().unwrap(),
        head,
        body: Vec::new(),
    };
    let len: usize = answer
        .header("content-length")
        .unwrap_or_else(|| panic!("no content-length: {}", answer.head))
        .parse()
        .unwrap();
    while got.len() < head_end + len {
        let n = tcp.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed in the body");
        got.extend_from_slice(&buf[..n]);
    }
    answer.body = got[head_end..head_end + len].to_vec();
    answer
}

/// The routes of each kind, with the error shape each answers in.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Shape {
    OpenAi,
    Anthropic,
    Cohere,
}

const ROUTES: &[(&str, Shape)] = &[
    // Orchestrated, in each API's own error shape.
    ("/v1/completions", Shape::OpenAi),
    ("/v1/chat/completions", Shape::OpenAi),
    ("/v1/messages", Shape::Anthropic),
    ("/cohere/v2/chat", Shape::Cohere),
    // Forwarded.
    ("/tokenize", Shape::OpenAi),
    // Direct (vLLM serves it as chat or completions).
    ("/invocations", Shape::OpenAi),
    // Fanned out (the admin routes are open).
    ("/v1/load_lora_adapter", Shape::OpenAi),
];

/// Every spelling of "this body is compressed": the header line(s), the body, and the
/// header the answer names.
fn spellings() -> Vec<(&'static str, Vec<u8>, &'static str)> {
    let (gz, zs) = (gzip(HANDOFF.as_bytes()), zstd(HANDOFF.as_bytes()));
    vec![
        ("Content-Encoding: gzip\r\n", gz.clone(), "content-encoding"),
        ("content-encoding: GZip\r\n", gz.clone(), "content-encoding"),
        (
            "CONTENT-ENCODING: \t zstd \t\r\n",
            zs.clone(),
            "content-encoding",
        ),
        (
            "Content-Encoding: gzip, identity\r\n",
            gz.clone(),
            "content-encoding",
        ),
        (
            "Content-Encoding: identity,ZSTD\r\n",
            zs.clone(),
            "content-encoding",
        ),
        (
            "Content-Encoding: identity\r\nContent-Encoding: zstd\r\n",
            zs.clone(),
            "content-encoding",
        ),
        ("Content-Encoding: br\r\n", zs.clone(), "content-encoding"),
        (
            "Content-Encoding: deflate\r\n",
            gz.clone(),
            "content-encoding",
        ),
        // As a proxy that rewrites `-` to `_` would pass it on.
        ("Content_Encoding: gzip\r\n", gz, "content-encoding"),
        // SGLang's own header, whatever its value, with or without `content-encoding`.
        (
            "X-Body-Compressed: zstd\r\n",
            zs.clone(),
            "x-body-compressed",
        ),
        (
            "x-body-compressed: ZSTD\r\n",
            zs.clone(),
            "x-body-compressed",
        ),
        ("x-body-compressed: 1\r\n", zs.clone(), "x-body-compressed"),
        (
            "X_Body_Compressed: zstd\r\n",
            zs.clone(),
            "x-body-compressed",
        ),
        (
            "x-body-compressed: zstd\r\ncontent-encoding: identity\r\n",
            zs,
            "x-body-compressed",
        ),
    ]
}

/// What reached an engine, in one line each.
fn reached(engines: &[&SimEngine]) -> Vec<String> {
    engines
        .iter()
        .flat_map(|e| e.received())
        .map(|r| format!("{} {}", r.method, r.path))
        .collect()
}

/// `a` is the 415 refusal in `shape`'s error format, naming `header`.
fn assert_refused(a: &Answer, shape: Shape, header: &str, what: &str) {
    assert_eq!(a.status, 415, "{what}: {a:?}");
    assert_eq!(a.header("content-type"), Some("application/json"), "{what}");
    // RFC 9110 §15.5.16: the codings that would have been accepted.
    assert_eq!(a.header("accept-encoding"), Some("identity"), "{what}");
    let v = a.json();
    let message = match shape {
        Shape::OpenAi => {
            assert_eq!(v["error"]["code"], "unsupported_content_encoding", "{what}");
            assert_eq!(v["error"]["type"], "invalid_request_error", "{what}");
            assert!(v["error"]["param"].is_null(), "{what}");
            &v["error"]["message"]
        }
        Shape::Anthropic => {
            assert_eq!(v["type"], "error", "{what}");
            assert_eq!(v["error"]["type"], "invalid_request_error", "{what}");
            &v["error"]["message"]
        }
        Shape::Cohere => {
            assert_eq!(v["id"], "req-7", "{what}");
            &v["message"]
        }
    };
    let message = message.as_str().unwrap_or_default();
    assert!(message.contains(header), "{what}: {message}");
    assert!(message.contains("uncompressed"), "{what}: {message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_body_is_refused_415_on_every_route_kind_and_reaches_no_engine() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let d = SimEngine::start(SimConfig::default()).await.unwrap();
    let (addr, mut heard) = proxy(&p, &d, false).await;
    for &(path, shape) in ROUTES {
        for (extra, body, header) in spellings() {
            let what = format!("{path} {extra:?}");
            let a = post(addr, path, extra, &body, body.len()).await;
            assert_refused(&a, shape, header, &what);
            // Summarized once, as the proxy's own refusal (the summary is told before
            // the answer is sent).
            let s = heard.try_recv().unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(s.kind, RouteKind::Refused, "{what}");
            assert_eq!(s.status, 415, "{what}");
            assert_eq!(s.path.as_ref(), path, "{what}");
            assert_eq!(s.outcome, "client_error", "{what}");
            assert_eq!(s.request_id.as_ref().unwrap(), "req-7", "{what}");
            assert_eq!(s.bytes, a.body.len() as u64, "{what}");
            assert!(s.endpoint.is_none(), "{what}");
            assert!(heard.try_recv().is_err(), "{what}: told twice");
        }
    }
    assert_eq!(reached(&[&p, &d]), Vec::<String>::new());
}

/// The refusal comes on the request's head: a client still sending a large body gets it
/// at once (not after its body, not after the body timeout), and the connection closes
/// (the rest of the body is unread).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_body_is_refused_before_it_is_read() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let d = SimEngine::start(SimConfig::default()).await.unwrap();
    let (addr, _heard) = proxy(&p, &d, false).await;
    let start = gzip(HANDOFF.as_bytes());
    for &(path, shape) in ROUTES {
        // 16 MiB declared (under the body limit), a few hundred bytes sent.
        let extra = "content-encoding: gzip\r\n";
        let a = post(addr, path, extra, &start, 16 << 20).await;
        assert_refused(&a, shape, "content-encoding", path);
        assert_eq!(a.header("connection"), Some("close"), "{path}");
    }
    assert_eq!(reached(&[&p, &d]), Vec::<String>::new());
}

/// An uncompressed body says so as it likes (`identity`, in a list, repeated): it is
/// served on the forwarded, direct and fanned-out routes, and no engine gets a
/// `content-encoding` (nor `x-body-compressed`, which is never let through).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_is_served_and_no_coding_header_reaches_an_engine() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let d = SimEngine::start(SimConfig::default()).await.unwrap();
    let (addr, mut heard) = proxy(&p, &d, false).await;
    let spellings = [
        "content-encoding: identity\r\n",
        "Content-Encoding: Identity , identity\r\n",
        "content-encoding: identity\r\ncontent-encoding: IDENTITY\r\n",
    ];
    let kinds = [
        ("/tokenize", RouteKind::Forward),
        ("/invocations", RouteKind::Direct),
        ("/v1/load_lora_adapter", RouteKind::FanOut),
    ];
    for (path, kind) in kinds {
        for extra in spellings {
            let what = format!("{path} {extra:?}");
            let a = post(addr, path, extra, HANDOFF.as_bytes(), HANDOFF.len()).await;
            // Served (whatever the simulated engine makes of it): not refused.
            assert_ne!(a.status, 415, "{what}: {a:?}");
            let s = heard.try_recv().unwrap();
            assert_eq!(s.kind, kind, "{what}");
        }
        let got: Vec<_> = [&p, &d]
            .iter()
            .flat_map(|e| e.received())
            .filter(|r| r.path == path)
            .collect();
        // Each spelling reached an engine (the fan-out reaches both).
        let per = if kind == RouteKind::FanOut { 2 } else { 1 };
        assert_eq!(got.len(), spellings.len() * per, "{path}: {got:?}");
        for r in got {
            assert_eq!(r.header("content-encoding"), None, "{r:?}");
            assert_eq!(r.header("x-body-compressed"), None, "{r:?}");
        }
    }
}

/// A request without a body (neither `content-length` nor chunking: HTTP/1.1 says it
/// has none) leaves nothing unread: its 415 keeps the connection, which serves the next
/// request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_without_a_body_keeps_its_connection() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let d = SimEngine::start(SimConfig::default()).await.unwrap();
    let (addr, _heard) = proxy(&p, &d, false).await;
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    for _ in 0..2 {
        let head = "POST /tokenize HTTP/1.1\r\nhost: x\r\ncontent-encoding: gzip\r\n\r\n";
        tcp.write_all(head.as_bytes()).await.unwrap();
        let a = tokio::time::timeout(ANSWER_WITHIN, read_answer(&mut tcp))
            .await
            .unwrap();
        assert_eq!(a.status, 415, "{a:?}");
        assert_eq!(a.header("connection"), None, "{a:?}");
    }
    assert_eq!(reached(&[&p, &d]), Vec::<String>::new());
}

/// The key check comes first, as for the proxy's other refusals: a client without a
/// key gets 401 for a compressed body, one with a key gets 415.
#[cfg(feature = "auth")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_check_comes_before_the_compressed_body_refusal() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let d = SimEngine::start(SimConfig::default()).await.unwrap();
    let (addr, mut heard) = proxy(&p, &d, true).await;
    let body = zstd(HANDOFF.as_bytes());
    for &(path, shape) in ROUTES {
        let extra = "x-body-compressed: zstd\r\n";
        let a = post(addr, path, extra, &body, body.len()).await;
        assert_eq!(a.status, 401, "{path}: {a:?}");
        assert_eq!(heard.try_recv().unwrap().kind, RouteKind::KeyRefused);
        let extra = "x-body-compressed: zstd\r\nauthorization: Bearer sk-ok\r\n";
        let a = post(addr, path, extra, &body, body.len()).await;
        assert_refused(&a, shape, "x-body-compressed", path);
        let s = heard.try_recv().unwrap();
        assert_eq!((s.kind, s.status.as_u16()), (RouteKind::Refused, 415));
        assert!(s.client.is_some(), "{path}: the key is named");
    }
    assert_eq!(reached(&[&p, &d]), Vec::<String>::new());
}

/// The bodies above are what the engines would decompress: a real gzip member and a
/// real zstd frame (checked against the tools when they are installed).
#[test]
fn the_bodies_are_real_gzip_and_zstd() {
    let gz = gzip(b"hello");
    assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    assert_eq!(&gz[..3], [0x1f, 0x8b, 8]);
    assert_eq!(&zstd(b"hello")[..4], [0x28, 0xb5, 0x2f, 0xfd]);
    for (tool, bytes) in [("gzip", gz), ("zstd", zstd(b"hello"))] {
        let child = std::process::Command::new(tool)
            .args(["-d", "-c"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn();
        let Ok(mut child) = child else {
            continue; // not installed
        };
        use std::io::Write;
        child.stdin.take().unwrap().write_all(&bytes).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{tool}");
        assert_eq!(out.stdout, b"hello", "{tool}");
    }
}

/// `PdLayer` refuses a compressed body on the routes it orchestrates as the service
/// does (its one request path), summarized to its route listeners as a refusal; the
/// inner service is not called.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_refuses_a_compressed_body_on_its_orchestrated_routes() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let d = SimEngine::start(SimConfig::default()).await.unwrap();
    let source = StaticSource::new([
        Endpoint::new(&p.url(), Role::Prefill).unwrap(),
        Endpoint::new(&d.url(), Role::Decode).unwrap(),
    ]);
    let orchestrator =
        Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new()).build();
    let (tx, mut heard) = mpsc::unbounded_channel();
    let mut config = PdServiceConfig::default();
    config.route_listeners.push(Heard(tx));
    let layer = disagg_http::PdLayer::gateway(orchestrator).service_config(config);
    let called = Arc::new(AtomicUsize::new(0));
    let inner = {
        let called = Arc::clone(&called);
        tower::service_fn(move |_req: http::Request<hyper::body::Incoming>| {
            called.fetch_add(1, Ordering::Relaxed);
            async {
                let body = http_body_util::Full::new(bytes::Bytes::from_static(b"inner"));
                Ok::<_, std::convert::Infallible>(http::Response::new(body))
            }
        })
    };
    let service = tower::Layer::layer(&layer, inner);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Builder::new().serve(listener, service, std::future::pending()));
    let body = gzip(HANDOFF.as_bytes());
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let a = post(addr, path, "Content-Encoding: gzip\r\n", &body, body.len()).await;
        assert_refused(&a, Shape::OpenAi, "content-encoding", path);
        let s = heard.try_recv().unwrap();
        assert_eq!((s.kind, s.status.as_u16()), (RouteKind::Refused, 415));
    }
    assert_eq!(called.load(Ordering::Relaxed), 0);
    assert_eq!(reached(&[&p, &d]), Vec::<String>::new());
}
