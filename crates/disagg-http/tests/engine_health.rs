//! Passive health hears the forwarded and direct routes: an engine that fails them
//! (refuses connections, answers 5xx, breaks or stalls its answer) is ejected after
//! `failure_threshold` failures in a row, as one failing its orchestrated legs is,
//! and one that answers (its 4xx included) ends a run of failures. A client that leaves
//! and the request's own deadline blame no engine. Over loopback: a `PdService` over a
//! `HealthSource`, served by the crate's server, raw engines behind (a closed port for
//! an engine that refuses connections).

#![allow(missing_docs)] // a test binary

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use disagg_connectors::vllm::VllmNixl;
use disagg_core::orchestrator::OrchestratorConfig;
use disagg_core::source::EndpointSource;
use disagg_core::{Endpoint, Orchestrator, Role, source::StaticSource};
use disagg_http::server::Builder;
use disagg_http::{HttpTransport, PdService};
use disagg_resilience::health::{EndpointHealth, HealthConfig, HealthSource};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// A forwarded route (vLLM's embeddings) and a direct one (SageMaker's entry point).
const ROUTES: [&str; 2] = ["/v1/embeddings", "/invocations"];

/// A raw engine's address; what it does with each request is named in the request's
/// body: `do-fail` (500), `do-bad` (400), `do-break` (a 200 whose chunked body breaks
/// off after one chunk), `do-hold` (a 200 whose chunked body stops after one chunk and
/// is held open; the connection's close is sent on the channel), else a 200 with a
/// JSON body. Connections are kept alive, as the engines' servers keep them.
async fn raw_engine() -> (String, mpsc::UnboundedReceiver<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (closed, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let closed = closed.clone();
            tokio::spawn(async move {
                while let Some(request) = read_message(&mut s).await {
                    let whole = |status: &str, body: &str| {
                        format!(
                            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\n\
                             content-length: {}\r\n\r\n{body}",
                            body.len()
                        )
                    };
                    let chunked = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                                   transfer-encoding: chunked\r\n\r\n\
                                   b\r\ndata: one\n\n\r\n";
                    let out = if request.contains("do-fail") {
                        whole("500 Internal Server Error", r#"{"error":"boom"}"#)
                    } else if request.contains("do-bad") {
                        whole("400 Bad Request", r#"{"error":"bad input"}"#)
                    } else if request.contains("do-break") || request.contains("do-hold") {
                        chunked.to_owned()
                    } else {
                        whole("200 OK", r#"{"object":"list","data":[]}"#)
                    };
                    if s.write_all(out.as_bytes()).await.is_err() {
                        return;
                    }
                    if request.contains("do-break") {
                        // Closed without the body's last chunk.
                        return;
                    }
                    if request.contains("do-hold") {
                        let mut buf = [0u8; 1024];
                        while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
                        let _ = closed.send(());
                        return;
                    }
                }
            });
        }
    });
    (url, rx)
}

/// The URL of a port nothing listens on: connections to it are refused.
async fn closed_port() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    url
}

/// One HTTP request (head and a `content-length` body) read from `s`, as text; `None`
/// when the connection ends first.
async fn read_message(s: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
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
    while buf.len() < end + length {
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Some(String::from_utf8_lossy(&buf).into_owned())
}

/// A proxy over the decode engines `decodes`, health-filtered with `failure_threshold`,
/// with `config`: its address and its source (whose health the test reads).
async fn proxy(
    decodes: &[&str],
    failure_threshold: u32,
    config: OrchestratorConfig,
) -> (SocketAddr, HealthSource) {
    let endpoints = decodes
        .iter()
        .map(|url| Endpoint::new(url, Role::Decode).unwrap());
    let mut health = HealthConfig::default();
    health.failure_threshold = failure_threshold;
    let source = HealthSource::new(StaticSource::new(endpoints), health);
    let orchestrator =
        Orchestrator::builder(source.clone(), HttpTransport::default(), VllmNixl::new())
            .config(config)
            .build();
    let service = PdService::new(orchestrator);
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

/// `POST path` with a JSON body whose input is `input`; the status and the answer as
/// text.
async fn post(addr: SocketAddr, path: &str, input: &str) -> (u16, String) {
    let body = format!(r#"{{"model":"m","input":"{input}"}}"#);
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    // A broken answer ends with the connection reset: what came before is the answer.
    let _ = tcp.read_to_end(&mut got).await;
    let text = String::from_utf8_lossy(&got).into_owned();
    let status = text
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{path} {input}: no status: {text}"));
    (status, text)
}

fn ejected(state: Option<EndpointHealth>) -> bool {
    matches!(state, Some(EndpointHealth::Ejected { .. }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_refuses_connections_is_ejected_from_forwarded_and_direct_routes() {
    for path in ROUTES {
        let (good, _) = raw_engine().await;
        let refusing = closed_port().await;
        let (addr, source) = proxy(&[&good, &refusing], 3, OrchestratorConfig::default()).await;
        let refusing = endpoint(&source, &refusing);
        let health = source.health();
        // Equally idle engines take turns: every other request meets the closed port,
        // until its third failure in a row ejects it.
        let mut failures = 0;
        for _ in 0..20 {
            let (status, text) = post(addr, path, "hello").await;
            match status {
                200 => {}
                502 => failures += 1,
                _ => panic!("{path}: {text}"),
            }
            if failures == 3 {
                break;
            }
        }
        assert_eq!(
            failures, 3,
            "{path}: the closed port was not asked three times"
        );
        assert!(
            ejected(health.state(&refusing)),
            "{path}: {:?} after three refused connections",
            health.state(&refusing)
        );
        // Ejected, it is asked no more: every request is answered.
        for _ in 0..6 {
            let (status, text) = post(addr, path, "hello").await;
            assert_eq!(status, 200, "{path}: {text}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_counts_against_its_engine_and_an_answered_4xx_ends_the_run() {
    for path in ROUTES {
        let (engine, _) = raw_engine().await;
        let (addr, source) = proxy(&[&engine], 2, OrchestratorConfig::default()).await;
        let ep = endpoint(&source, &engine);
        let health = source.health();
        // A 5xx is relayed as it came, and counted; the client's 4xx is the engine
        // working, so the next 5xx starts a new run.
        for (input, status) in [("do-fail", 500), ("do-bad", 400), ("do-fail", 500)] {
            assert_eq!(post(addr, path, input).await.0, status, "{path} {input}");
        }
        assert_eq!(health.state(&ep), Some(EndpointHealth::Healthy), "{path}");
        // Two 5xx in a row: ejected.
        assert_eq!(post(addr, path, "do-fail").await.0, 500, "{path}");
        assert!(
            ejected(health.state(&ep)),
            "{path}: {:?}",
            health.state(&ep)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_answer_counts_against_its_engine_and_a_client_leaving_does_not() {
    for path in ROUTES {
        let (engine, mut closed) = raw_engine().await;
        let (addr, source) = proxy(&[&engine], 1, OrchestratorConfig::default()).await;
        let ep = endpoint(&source, &engine);
        let health = source.health();
        // The client reads the head and first chunk of a held stream, then leaves.
        let body = r#"{"model":"m","input":"do-hold"}"#;
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        );
        tcp.write_all(head.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        let mut chunk = [0u8; 1024];
        while !String::from_utf8_lossy(&got).contains("data: one") {
            let n = tcp.read(&mut chunk).await.unwrap();
            assert!(n > 0, "{path}: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&chunk[..n]);
        }
        drop(tcp);
        // The proxy dropped the engine's answer (its connection closed) when the client
        // left: nothing was blamed (one failure would have ejected the engine).
        closed.recv().await.unwrap();
        assert_eq!(health.state(&ep), Some(EndpointHealth::Healthy), "{path}");
        // The engine breaking its answer off is its failure.
        let (status, text) = post(addr, path, "do-break").await;
        assert_eq!(status, 200, "{path}: {text}");
        assert!(
            ejected(health.state(&ep)),
            "{path}: {:?}",
            health.state(&ep)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_answer_counts_against_its_engine_and_the_deadline_does_not() {
    for path in ROUTES {
        let (engine, _) = raw_engine().await;
        let mut config = OrchestratorConfig::default();
        config.decode_idle_timeout = Some(Duration::from_millis(300));
        let (addr, source) = proxy(&[&engine], 1, config).await;
        let ep = endpoint(&source, &engine);
        let (status, text) = post(addr, path, "do-hold").await;
        assert_eq!(status, 200, "{path}: {text}");
        let health = source.health();
        assert!(
            ejected(health.state(&ep)),
            "{path}: {:?}",
            health.state(&ep)
        );
    }
    // The request's own deadline (generation sent direct keeps one) cuts the answer
    // first: no engine's fault.
    let (engine, _) = raw_engine().await;
    let mut config = OrchestratorConfig::default();
    config.deadline = Some(Duration::from_millis(300));
    let (addr, source) = proxy(&[&engine], 1, config).await;
    let ep = endpoint(&source, &engine);
    let (status, text) = post(addr, "/invocations", "do-hold").await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(source.health().state(&ep), Some(EndpointHealth::Healthy));
}
