//! `GET /v1/models/org%2Fmodel`, the spelling SDKs send for a model id holding a `/`:
//! the same key policy and the same answer as `/v1/models/org/model` on every layer.
//! The key check asks for what the plain spelling needs (nothing, when only `/metrics`
//! is guarded), the service answers the card, and `PdLayer` hands it to the service
//! inside, as it hands the plain spelling. Over loopback.

#![allow(missing_docs)] // a test binary

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use disagg_connectors::vllm::VllmNixl;
use disagg_core::{Endpoint, Orchestrator, Role, source::StaticSource};
use disagg_http::auth::{ApiKeyLayer, ApiKeys};
use disagg_http::server::Builder;
use disagg_http::{HttpTransport, PdLayer, PdService};
use disagg_sim::{SimConfig, SimEngine};
use http::{Request, Response};
use hyper::body::Incoming;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// `GET path` (with `key`, if any): the status and the answer as text.
async fn get(addr: SocketAddr, path: &str, key: Option<&str>) -> (u16, String) {
    request(addr, "GET", path, key).await
}

/// `method path` (with `key`, if any): the status and the answer as text.
async fn request(addr: SocketAddr, method: &str, path: &str, key: Option<&str>) -> (u16, String) {
    let auth = key.map_or(String::new(), |k| format!("authorization: Bearer {k}\r\n"));
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\n{auth}content-length: 0\r\nconnection: close\r\n\r\n"
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    tcp.read_to_end(&mut got).await.unwrap();
    let text = String::from_utf8_lossy(&got).into_owned();
    let status = text
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status: {text}"));
    (status, text)
}

fn orchestrator(p: &SimEngine, d: &SimEngine) -> Orchestrator {
    let source = StaticSource::new([
        Endpoint::new(&p.url(), Role::Prefill).unwrap(),
        Endpoint::new(&d.url(), Role::Decode).unwrap(),
    ]);
    Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new()).build()
}

async fn serve<S, B>(service: S) -> SocketAddr
where
    S: disagg_http::server::HttpService<B>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<disagg_core::error::BoxError>,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Builder::new().serve(listener, service, std::future::pending()));
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_only_a_scrapers_key_both_spellings_of_a_card_are_open() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let d = SimEngine::start(SimConfig::default()).await.unwrap();
    let layer = ApiKeyLayer::metrics_only(ApiKeys::new(["sk-scraper"]).unwrap());
    let service = tower::Layer::layer(&layer, PdService::new(orchestrator(&p, &d)));
    let addr = serve(service).await;
    let plain = get(addr, "/v1/models/org/model", None).await;
    let escaped = get(addr, "/v1/models/org%2Fmodel", None).await;
    // No such model: the card's own 404, for both, with no key asked.
    assert_eq!(plain.0, 404, "{}", plain.1);
    assert_eq!(escaped.0, plain.0, "{}", escaped.1);
    assert!(escaped.1.contains("model_not_found"), "{}", escaped.1);
    // Another method: the route's 405, for both.
    let plain = request(addr, "POST", "/v1/models/org/model", None).await;
    let escaped = request(addr, "POST", "/v1/models/org%2Fmodel", None).await;
    assert_eq!(plain.0, 405, "{}", plain.1);
    assert_eq!(escaped.0, plain.0, "{}", escaped.1);
    // `/metrics` still needs the scraper's key.
    assert_eq!(get(addr, "/metrics", None).await.0, 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_layer_hands_both_spellings_of_a_card_to_the_service_inside() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let d = SimEngine::start(SimConfig::default()).await.unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = Arc::clone(&seen);
    let inner = tower::service_fn(move |req: Request<Incoming>| {
        record.lock().unwrap().push(req.uri().path().to_owned());
        async {
            Ok::<_, Infallible>(Response::new(http_body_util::Full::new(Bytes::from(
                "card",
            ))))
        }
    });
    let service = tower::Layer::layer(&PdLayer::gateway(orchestrator(&p, &d)), inner);
    let addr = serve(service).await;
    for path in ["/v1/models/org/model", "/v1/models/org%2Fmodel"] {
        let (status, text) = get(addr, path, None).await;
        assert_eq!(status, 200, "{path}: {text}");
        assert!(text.ends_with("card"), "{path}: {text}");
    }
    assert_eq!(
        *seen.lock().unwrap(),
        ["/v1/models/org/model", "/v1/models/org%2Fmodel"]
    );
    // Any other path with no one meaning is still refused before the service inside.
    let (status, text) = get(addr, "/v1/other%2Fpath", None).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("invalid_path"), "{text}");
    assert_eq!(seen.lock().unwrap().len(), 2);
}
