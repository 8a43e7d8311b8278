//! Which engines a fanned-out admin request reaches, and what it does to them: every
//! engine of the fleet, those ejected by passive health included (a LoRA adapter loaded
//! while an engine was ejected must be on it when it returns half-open); each engine's
//! request counts in its in-flight number until its answer is read (a forwarded request
//! meanwhile goes to an idle engine); and only an engine that cannot be reached is
//! blamed for it, not one answering an admin request with an error. Over loopback: a
//! `PdService` over a `HealthSource` with the admin routes open, served by the crate's
//! server, raw engines behind.

#![allow(missing_docs)] // a test binary

mod common;

use common::{closed_port, read_path};
use std::net::SocketAddr;
use std::sync::Arc;

use disagg_connectors::vllm::VllmNixl;
use disagg_core::source::EndpointSource;
use disagg_core::{Endpoint, Orchestrator, Role, source::StaticSource};
use disagg_http::server::Builder;
use disagg_http::{HttpTransport, PdService, PdServiceConfig, RouteTable};
use disagg_resilience::health::{EndpointHealth, HealthConfig, HealthSource};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

/// A raw engine: its URL and the paths of the requests it received, each sent when it
/// came in. It answers `/v1/load_lora_adapter` 200 (once `release` says `true`, when
/// given), `/reset_prefix_cache` 500, `/is_sleeping` 404, anything else 200 with a JSON
/// body; connections are kept alive.
async fn raw_engine(
    release: Option<watch::Receiver<bool>>,
) -> (String, mpsc::UnboundedReceiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (seen, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let seen = seen.clone();
            let mut release = release.clone();
            tokio::spawn(async move {
                while let Some(path) = read_path(&mut s).await {
                    let _ = seen.send(path.clone());
                    let (status, body) = match path.as_str() {
                        "/v1/load_lora_adapter" => {
                            if let Some(r) = release.as_mut() {
                                let _ = r.wait_for(|go| *go).await;
                            }
                            ("200 OK", r#""Success: LoRA adapter loaded""#)
                        }
                        "/reset_prefix_cache" => ("500 Internal Server Error", r#"{"e":1}"#),
                        "/is_sleeping" => ("404 Not Found", r#"{"detail":"Not Found"}"#),
                        _ => ("200 OK", r#"{"object":"list","data":[]}"#),
                    };
                    let out = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\n\
                         content-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if s.write_all(out.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (url, rx)
}

/// A proxy with the admin routes open over the decode engines `decodes`,
/// health-filtered with `failure_threshold`: its address and its source.
async fn proxy(decodes: &[&str], failure_threshold: u32) -> (SocketAddr, HealthSource) {
    let endpoints = decodes
        .iter()
        .map(|url| Endpoint::new(url, Role::Decode).unwrap());
    let mut health = HealthConfig::default();
    health.failure_threshold = failure_threshold;
    let source = HealthSource::new(StaticSource::new(endpoints), health);
    let orchestrator =
        Orchestrator::builder(source.clone(), HttpTransport::default(), VllmNixl::new()).build();
    let mut config = PdServiceConfig::default();
    config.routes = RouteTable::default().admin_routes(true);
    let service = PdService::with_config(orchestrator, config);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Builder::new().serve(listener, service, std::future::pending()));
    (addr, source)
}

/// The endpoint of `source` whose URL is `url` (looked up before any ejection).
fn endpoint(source: &HealthSource, url: &str) -> Arc<Endpoint> {
    let set = source.snapshot();
    let found = set.iter().find(|e| e.id().as_str() == url);
    Arc::clone(found.unwrap_or_else(|| panic!("{url} is not in the set")))
}

/// `POST path` with a JSON `body`: the status and the answer's body parsed.
async fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, Value) {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    tcp.read_to_end(&mut got).await.unwrap();
    let text = String::from_utf8_lossy(&got).into_owned();
    let status = text
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status: {text}"));
    let body = &text[text.find("\r\n\r\n").unwrap() + 4..];
    let json = serde_json::from_str(body).unwrap_or_else(|e| panic!("{path}: {e}: {text}"));
    (status, json)
}

const LORA: &str = r#"{"lora_name":"sql","lora_path":"/adapters/sql"}"#;

/// The endpoints a fan-out answer lists.
fn listed(answer: &Value) -> Vec<&str> {
    let results = answer["results"].as_array().unwrap();
    results
        .iter()
        .map(|r| r["endpoint"].as_str().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_reaches_an_ejected_engine_too() {
    let (up, _) = raw_engine(None).await;
    let (ejected, mut asked) = raw_engine(None).await;
    let (addr, source) = proxy(&[&up, &ejected], 5).await;
    let ep = endpoint(&source, &ejected);
    assert!(source.health().eject(&ep, "a test's verdict"));
    assert_eq!(source.snapshot().by_role(Role::Decode).len(), 1);
    // Loaded on both: the ejected engine has the adapter when it returns.
    let (status, answer) = post(addr, "/v1/load_lora_adapter", LORA).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(listed(&answer), [up.as_str(), ejected.as_str()], "{answer}");
    assert_eq!(asked.recv().await.as_deref(), Some("/v1/load_lora_adapter"));

    // An ejected engine that is gone fails the fan-out, named in its answer: not a
    // 200 saying that every engine has the adapter.
    let (up, _) = raw_engine(None).await;
    let gone = closed_port().await;
    let (addr, source) = proxy(&[&up, &gone], 5).await;
    assert!(
        source
            .health()
            .eject(&endpoint(&source, &gone), "a test's verdict")
    );
    let (status, answer) = post(addr, "/v1/load_lora_adapter", LORA).await;
    assert_eq!(status, 502, "{answer}");
    assert_eq!(answer["error"]["code"], "fan_out_failed", "{answer}");
    assert_eq!(listed(&answer), [up.as_str(), gone.as_str()], "{answer}");
    assert_eq!(answer["results"][1]["status"], Value::Null, "{answer}");
}

/// Until `ep` has nothing in flight (its last answer read and dropped), within 5 s.
async fn settled(ep: &Endpoint) {
    let wait = async {
        while ep.in_flight() != 0 {
            tokio::task::yield_now().await;
        }
    };
    let waited = tokio::time::timeout(std::time::Duration::from_secs(5), wait).await;
    assert!(waited.is_ok(), "{} stayed in flight", ep.id());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fanned_out_request_counts_in_flight_until_its_answer_is_read() {
    let (go, release) = watch::channel(false);
    let (held, mut held_asked) = raw_engine(Some(release)).await;
    let (idle, mut idle_asked) = raw_engine(None).await;
    let (addr, source) = proxy(&[&held, &idle], 5).await;
    let (held_ep, idle_ep) = (endpoint(&source, &held), endpoint(&source, &idle));
    let fan_out = tokio::spawn(async move { post(addr, "/v1/load_lora_adapter", LORA).await });
    // Both engines have the request; one answered, the other holds its answer.
    assert_eq!(
        held_asked.recv().await.as_deref(),
        Some("/v1/load_lora_adapter")
    );
    assert_eq!(
        idle_asked.recv().await.as_deref(),
        Some("/v1/load_lora_adapter")
    );
    // The idle engine's answer is read as soon as it came; the held one's is not in.
    settled(&idle_ep).await;
    assert_eq!(held_ep.in_flight(), 1);
    // Forwarded requests meanwhile go to the idle engine (fewest in flight), not in
    // turns over the two. An engine tells the path before it answers.
    for _ in 0..4 {
        let (status, answer) = post(addr, "/v1/embeddings", r#"{"input":"x"}"#).await;
        assert_eq!(status, 200, "{answer}");
        assert!(held_asked.try_recv().is_err(), "the held engine was picked");
        assert_eq!(
            idle_asked.try_recv().ok().as_deref(),
            Some("/v1/embeddings")
        );
        settled(&idle_ep).await;
    }
    go.send_replace(true);
    let (status, answer) = fan_out.await.unwrap();
    assert_eq!(status, 200, "{answer}");
    assert_eq!(held_ep.in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_an_engine_that_cannot_be_reached_is_blamed_for_a_fan_out() {
    let (answering, _) = raw_engine(None).await;
    let gone = closed_port().await;
    let (addr, source) = proxy(&[&answering, &gone], 1).await;
    let (answering, gone) = (endpoint(&source, &answering), endpoint(&source, &gone));
    let health = source.health();
    // An engine's 5xx or 4xx to an admin request is the request's matter (a route its
    // engine does not serve, an operation it refuses): listed, not counted.
    for path in ["/reset_prefix_cache", "/is_sleeping"] {
        let (status, answer) = post(addr, path, "{}").await;
        assert_eq!(status, 502, "{path}: {answer}");
        assert_eq!(health.state(&answering), Some(EndpointHealth::Healthy));
    }
    // The refused connection was counted: one failure ejects at this threshold.
    assert!(
        matches!(health.state(&gone), Some(EndpointHealth::Ejected { .. })),
        "{:?}",
        health.state(&gone)
    );
}
