//! The summary of a request the orchestrator does not serve (issue #33): a forwarded
//! answer is told once, when it ends, with the bytes the client got; a client that
//! leaves in the middle of a forwarded stream makes it `cancelled`, told when it left.
//! Over loopback: a `PdService` served by the crate's server, a simulated engine behind.

#![allow(missing_docs)] // a test binary

use std::sync::{Arc, Mutex};
use std::time::Duration;

use disagg_connectors::vllm::VllmNixl;
use disagg_core::outcome::Delivery;
use disagg_core::{Endpoint, Orchestrator, Role, source::StaticSource};
use disagg_http::routed::{RouteKind, RouteListener, RouteSummary};
use disagg_http::server::Builder;
use disagg_http::{HttpTransport, PdService, PdServiceConfig, RouteAction, RouteTable};
use disagg_sim::{SimConfig, SimEngine};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Every route summary told.
#[derive(Clone, Default)]
struct Heard(Arc<Mutex<Vec<RouteSummary>>>);

impl RouteListener for Heard {
    fn on_route(&self, summary: &RouteSummary) {
        self.0.lock().unwrap().push(summary.clone());
    }
}

impl Heard {
    fn all(&self) -> Vec<RouteSummary> {
        self.0.lock().unwrap().clone()
    }

    async fn wait_for(&self, n: usize) -> Vec<RouteSummary> {
        for _ in 0..500 {
            if self.all().len() >= n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.all()
    }
}

/// A proxy over `p` and `d` that forwards `/v1/completions` to one engine, unchanged.
async fn forwarding_proxy(p: &SimEngine, d: &SimEngine, heard: &Heard) -> std::net::SocketAddr {
    let source = StaticSource::new([
        Endpoint::new(&p.url(), Role::Prefill).unwrap(),
        Endpoint::new(&d.url(), Role::Decode).unwrap(),
    ]);
    let orchestrator =
        Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new()).build();
    let mut config = PdServiceConfig::default();
    config.route_listeners.push(heard.clone());
    config.routes = RouteTable::default().set("/v1/completions", RouteAction::Forwarded);
    let service = PdService::with_config(orchestrator, config);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Builder::new().serve(listener, service, std::future::pending()));
    addr
}

async fn send(addr: std::net::SocketAddr, body: &str) -> TcpStream {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    tcp
}

fn completion(max_tokens: u32, stream: bool) -> String {
    serde_json::json!({
        "model": "sim-model", "prompt": "hello", "max_tokens": max_tokens, "stream": stream,
    })
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_answer_is_told_once_when_it_ends_with_its_bytes() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let d = SimEngine::start(SimConfig::default()).await.unwrap();
    let heard = Heard::default();
    let addr = forwarding_proxy(&p, &d, &heard).await;
    let mut tcp = send(addr, &completion(4, true)).await;
    let mut got = Vec::new();
    tcp.read_to_end(&mut got).await.unwrap();
    let text = String::from_utf8_lossy(&got).into_owned();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let all = heard.wait_for(1).await;
    let [s] = &all[..] else {
        panic!("one summary: {all:?}")
    };
    assert_eq!(s.kind, RouteKind::Forward);
    assert_eq!(s.path.as_ref(), "/v1/completions");
    assert_eq!(s.status, 200);
    assert_eq!(s.delivery, Delivery::Complete);
    assert_eq!(s.outcome, "success");
    assert_eq!(
        s.endpoint.as_ref().map(|e| e.id().as_str()),
        Some(d.url().as_str())
    );
    // The body the client got: the answer after its head (chunked: at least that).
    let body_len = got.len() - text.find("\r\n\r\n").unwrap() - 4;
    assert!(
        s.bytes > 0 && s.bytes <= body_len as u64,
        "{} of {body_len}",
        s.bytes
    );
    // Told once: nothing more comes.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(heard.all().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_a_forwarded_stream_makes_it_cancelled() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let slow = SimConfig {
        // 200 tokens at 20 ms: a 4 s stream, left after its first event.
        inter_token_delay: Duration::from_millis(20),
        ..SimConfig::default()
    };
    let d = SimEngine::start(slow).await.unwrap();
    let heard = Heard::default();
    let addr = forwarding_proxy(&p, &d, &heard).await;
    let mut tcp = send(addr, &completion(200, true)).await;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = tcp.read(&mut buf).await.unwrap();
        assert!(n > 0, "the stream ended early");
        got.extend_from_slice(&buf[..n]);
    }
    assert!(heard.all().is_empty(), "told before the answer ended");
    let left = std::time::Instant::now();
    drop(tcp);
    let all = heard.wait_for(1).await;
    let [s] = &all[..] else {
        panic!("one summary: {all:?}")
    };
    assert!(left.elapsed() < Duration::from_secs(2), "told late");
    assert_eq!(s.delivery, Delivery::Cancelled);
    assert_eq!(s.outcome, "cancelled");
    assert_eq!(s.status, 200);
    assert!(s.bytes > 0);
    assert!(s.duration < Duration::from_secs(3), "{:?}", s.duration);
}

/// The proxy's own refusals (a closed admin route, a path with no route, a method the
/// route does not take, a path with no one meaning) are summarized once each, with
/// their status, as `refused`: the key check in front admits them and tells nothing.
#[cfg(feature = "auth")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxys_own_refusals_are_told_once() {
    use disagg_http::auth::{ApiKeyLayer, ApiKeys};
    // No engine is asked: the addresses are never dialled.
    let source = StaticSource::new([
        Endpoint::new("http://127.0.0.1:9", Role::Prefill).unwrap(),
        Endpoint::new("http://127.0.0.1:9", Role::Decode).unwrap(),
    ]);
    let orchestrator =
        Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new()).build();
    let heard = Heard::default();
    let mut config = PdServiceConfig::default();
    config.route_listeners.push(heard.clone());
    config.routes = RouteTable::default().set("/v1/other", RouteAction::Orchestrated);
    let layer = ApiKeyLayer::new(ApiKeys::new(["sk-ok"]).unwrap())
        .tell_refusals(orchestrator.clone(), config.route_listeners.clone());
    let service = tower::Layer::layer(&layer, PdService::with_config(orchestrator, config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Builder::new().serve(listener, service, std::future::pending()));
    let cases = [
        ("POST", "/%72eset_prefix_cache", 403, "/reset_prefix_cache"),
        ("POST", "/v1/other", 404, "/v1/other"),
        ("GET", "/v1/completions", 405, "/v1/completions"),
        ("POST", "/health", 405, "/health"),
        ("GET", "/a%2Fb", 400, "/a%2Fb"),
    ];
    for (i, (method, path, status, logged)) in cases.into_iter().enumerate() {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-ok\r\n\
             x-request-id: req-{i}\r\ncontent-type: application/json\r\n\
             connection: close\r\ncontent-length: 2\r\n\r\n{{}}"
        );
        tcp.write_all(head.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        tcp.read_to_end(&mut got).await.unwrap();
        let text = String::from_utf8_lossy(&got).into_owned();
        assert!(
            text.starts_with(&format!("HTTP/1.1 {status}")),
            "{path}: {text}"
        );
        let body_len = got.len() - text.find("\r\n\r\n").unwrap() - 4;
        let all = heard.wait_for(i + 1).await;
        assert_eq!(all.len(), i + 1, "{path}: {all:?}");
        let s = &all[i];
        assert_eq!(s.kind, RouteKind::Refused, "{path}");
        assert_eq!(s.kind.as_str(), "refused");
        assert_eq!(s.status, status, "{path}");
        assert_eq!(s.path.as_ref(), logged);
        assert_eq!(s.method.as_str(), method);
        assert_eq!(s.request_id.as_ref().unwrap(), &format!("req-{i}"));
        // `/health` is open: no key is checked there, none named.
        let client = (path != "/health").then_some(KEY_ID_OF_SK_OK);
        assert_eq!(s.client.as_deref(), client, "{path}");
        assert_eq!(s.outcome, "client_error");
        assert_eq!(s.bytes, body_len as u64, "{path}");
        assert!(s.endpoint.is_none());
    }
    // Told once each: nothing more comes.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(heard.all().len(), cases.len());
}

/// `printf %s sk-ok | sha256sum | cut -c1-8`.
#[cfg(feature = "auth")]
const KEY_ID_OF_SK_OK: &str = "8fb94ae1";
