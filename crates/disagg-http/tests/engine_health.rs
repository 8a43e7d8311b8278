//! Passive health hears the forwarded and direct routes: an engine that fails them
//! (refuses connections, answers 5xx, breaks or stalls its answer, gives no head once
//! the body is in) is ejected after `failure_threshold` failures in a row, as one
//! failing its orchestrated legs is, and one that answers generation sent direct (its
//! 4xx included) ends a run of failures; an answer to a forwarded request does not. A
//! client that leaves, a client's body that breaks or is still coming (on every route
//! kind: direct and fanned-out routes read it whole before any engine is asked), a
//! redirect (the client's path) and the request's own deadline blame no engine. Over loopback: a
//! `PdService` over a `HealthSource`, served by the crate's server, raw engines behind
//! (a closed port for an engine that refuses connections).

#![allow(missing_docs)] // a test binary

mod common;

use common::{closed_port, read_text};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use disagg_connectors::vllm::VllmNixl;
use disagg_core::orchestrator::OrchestratorConfig;
use disagg_core::outcome::Delivery;
use disagg_core::source::EndpointSource;
use disagg_core::{Endpoint, Orchestrator, Role, source::StaticSource};
use disagg_http::routed::{RouteListener, RouteSummary};
use disagg_http::routes::RouteAction;
use disagg_http::server::Builder;
use disagg_http::{HttpTransport, PdService, PdServiceConfig, RouteTable};
use disagg_resilience::health::{EndpointHealth, HealthConfig, HealthSource};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// A forwarded route (vLLM's embeddings) and a direct one (SageMaker's entry point).
const ROUTES: [&str; 2] = ["/v1/embeddings", "/invocations"];

/// A raw engine's address; what it does with each request is named in the request's
/// body: `do-fail` (500), `do-bad` (400), `do-redirect` (a 307 to another path of its
/// own, as FastAPI answers `/version/` with one to `/version`), `do-break` (a 200 whose
/// chunked body breaks off after one chunk), `do-hold` (a 200 whose chunked body stops
/// after one chunk and is held open; the connection's close is sent on the channel),
/// `do-event-500` and `do-event-400` (a whole 200 event stream: a chunk, an error event
/// of that code, its payload's start cut between two chunks, and `[DONE]`, as vLLM
/// streams a failed KV load), `do-unfinished` and `do-finished` (a whole 200 completions
/// event stream: a chunk, then the usage chunk alone, as vLLM streams a completions
/// request whose KV load failed, or a last chunk with its finish reason; then `[DONE]`),
/// `do-abort-500` and `do-abort-400` (a whole 200 SGLang `/generate` event stream: a
/// chunk, then one whose finish reason is an abort naming that status, its key cut
/// between two chunks, and `[DONE]`, as SGLang streams a decode whose KV transfer
/// failed), else a 200 with a JSON body. Connections are kept alive, as the engines' servers keep them.
async fn raw_engine() -> (String, mpsc::UnboundedReceiver<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (closed, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let closed = closed.clone();
            tokio::spawn(async move {
                while let Some(request) = read_text(&mut s).await {
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
                    } else if request.contains("do-redirect") {
                        "HTTP/1.1 307 Temporary Redirect\r\ncontent-length: 0\r\n\
                         location: http://127.0.0.1/version\r\n\r\n"
                            .to_owned()
                    } else if request.contains("do-break") || request.contains("do-hold") {
                        chunked.to_owned()
                    } else if let Some(code) = ["500", "400"]
                        .into_iter()
                        .find(|c| request.contains(&format!("do-event-{c}")))
                    {
                        let error = format!(
                            "data: {{\"error\": {{\"message\": \"Internal server error\", \"code\": {code}}}}}\n\n"
                        );
                        let (a, b) = error.split_at(10);
                        events(&["data: {\"choices\":[]}\n\n", a, b, "data: [DONE]\n\n"])
                    } else if let Some(code) = ["500", "400"]
                        .into_iter()
                        .find(|c| request.contains(&format!("do-abort-{c}")))
                    {
                        let first = "data: {\"text\":\"a\",\"output_ids\":[7],\"meta_info\":{\"id\":\"r\",\"finish_reason\":null}}\n\n";
                        let last = format!(
                            "data: {{\"text\":\"a\",\"output_ids\":[7],\"meta_info\":{{\"id\":\"r\",\"finish_reason\":{{\"type\":\"abort\",\"message\":\"KV transfer failed\",\"status_code\":{code},\"err_type\":null}},\"prompt_tokens\":3}}}}\n\n"
                        );
                        // The key cut between two chunks.
                        let (a, b) = last.split_at(60);
                        events(&[first, a, b, "data: [DONE]\n\n"])
                    } else if request.contains("do-unfinished") || request.contains("do-finished") {
                        let first = "data: {\"choices\":[{\"index\":0,\"text\":\"a\",\"finish_reason\":null}]}\n\n";
                        let last = if request.contains("do-finished") {
                            "data: {\"choices\":[{\"index\":0,\"text\":\"b\",\"finish_reason\":\"length\"}]}\n\n"
                        } else {
                            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":0}}\n\n"
                        };
                        // The key cut between two chunks.
                        let (a, b) = last.split_at(40);
                        events(&[first, a, b, "data: [DONE]\n\n"])
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

/// A whole 200 event stream of `chunks`, each its own chunk of the body.
fn events(chunks: &[&str]) -> String {
    let mut out = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                   transfer-encoding: chunked\r\n\r\n"
        .to_owned();
    for c in chunks {
        out += &format!("{:x}\r\n{c}\r\n", c.len());
    }
    out + "0\r\n\r\n"
}

/// A proxy over the decode engines `decodes`, health-filtered with `failure_threshold`,
/// with `config` and the admin routes (fanned out) open: its address and its source
/// (whose health the test reads).
async fn proxy(
    decodes: &[&str],
    failure_threshold: u32,
    config: OrchestratorConfig,
) -> (SocketAddr, HealthSource) {
    let table = RouteTable::default().admin_routes(true);
    proxy_told(decodes, failure_threshold, config, table, None).await
}

/// Every route summary told.
#[derive(Clone, Default)]
struct Routes(Arc<std::sync::Mutex<Vec<RouteSummary>>>);

impl RouteListener for Routes {
    fn on_route(&self, summary: &RouteSummary) {
        self.0.lock().unwrap().push(summary.clone());
    }
}

/// [`proxy`] with the route table `table`, its route summaries told to `routes`.
async fn proxy_told(
    decodes: &[&str],
    failure_threshold: u32,
    config: OrchestratorConfig,
    table: RouteTable,
    routes: Option<Routes>,
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
    let mut service_config = PdServiceConfig::default();
    service_config.routes = table;
    if let Some(routes) = routes {
        service_config.route_listeners.push(routes);
    }
    let service = PdService::with_config(orchestrator, service_config);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Builder::new().serve(listener, service, std::future::pending()));
    (addr, source)
}

/// A [`raw_engine`] behind a proxy (one failure ejects it, the admin routes open) that
/// routes `path` by `action`, its route summaries told: the proxy's address, the
/// engine's endpoint, its health and the routes told.
async fn one_engine_routing(
    path: &'static str,
    action: RouteAction,
) -> (SocketAddr, Arc<Endpoint>, HealthSource, Routes) {
    let (engine, _) = raw_engine().await;
    let routes = Routes::default();
    let table = RouteTable::default().admin_routes(true).set(path, action);
    let config = OrchestratorConfig::default();
    let (addr, source) = proxy_told(&[&engine], 1, config, table, Some(routes.clone())).await;
    let ep = endpoint(&source, &engine);
    (addr, ep, source, routes)
}

impl Routes {
    /// Each route told: its path and delivery.
    fn told(&self) -> Vec<(String, Delivery)> {
        let told = self.0.lock().unwrap();
        told.iter()
            .map(|s| (s.path.to_string(), s.delivery))
            .collect()
    }
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
async fn a_5xx_counts_against_its_engine_and_only_generation_sent_direct_ends_the_run() {
    // Generation sent direct is the engine serving a client: its answer, a 4xx
    // included, shows the engine at work, so the next 5xx starts a new run.
    let (engine, _) = raw_engine().await;
    let (addr, source) = proxy(&[&engine], 2, OrchestratorConfig::default()).await;
    let ep = endpoint(&source, &engine);
    let health = source.health();
    for (input, status) in [("do-fail", 500), ("do-bad", 400), ("do-fail", 500)] {
        assert_eq!(post(addr, "/invocations", input).await.0, status, "{input}");
    }
    assert_eq!(health.state(&ep), Some(EndpointHealth::Healthy));
    // Two 5xx in a row: ejected.
    assert_eq!(post(addr, "/invocations", "do-fail").await.0, 500);
    assert!(ejected(health.state(&ep)), "{:?}", health.state(&ep));

    // A forwarded request's answer (a 4xx, or a 200 to an embeddings request) says
    // nothing of how the engine serves generation: it ends no run of failures.
    let (engine, _) = raw_engine().await;
    let (addr, source) = proxy(&[&engine], 2, OrchestratorConfig::default()).await;
    let ep = endpoint(&source, &engine);
    let health = source.health();
    let path = "/v1/embeddings";
    for (input, status) in [("do-fail", 500), ("do-bad", 400), ("hello", 200)] {
        assert_eq!(post(addr, path, input).await.0, status, "{input}");
    }
    assert_eq!(health.state(&ep), Some(EndpointHealth::Healthy));
    // The second 5xx, two answers after the first: ejected.
    assert_eq!(post(addr, path, "do-fail").await.0, 500);
    assert!(ejected(health.state(&ep)), "{:?}", health.state(&ep));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_to_the_engines_own_address_blames_no_engine() {
    for path in ROUTES {
        let (engine, _) = raw_engine().await;
        let (addr, source) = proxy(&[&engine], 2, OrchestratorConfig::default()).await;
        let ep = endpoint(&source, &engine);
        // The engine worked: the client's path was wrong. The redirect is not relayed
        // (502), and counts for nothing, however many come.
        for _ in 0..5 {
            let (status, text) = post(addr, path, "do-redirect").await;
            assert_eq!(status, 502, "{path}: {text}");
        }
        let health = source.health();
        assert_eq!(health.state(&ep), Some(EndpointHealth::Healthy), "{path}");
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

/// A raw engine for uploads: it tells `heads` of each request's head as it comes, reads
/// the body to its end (the last chunk, or its `content-length`), and answers 200 then
/// (nothing for a body naming `do-hang`, nor for one that never ends).
async fn upload_engine() -> (String, mpsc::UnboundedReceiver<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (heads, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let heads = heads.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 16 * 1024];
                let mut head_end = None;
                loop {
                    if head_end.is_none()
                        && let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n")
                    {
                        head_end = Some(i + 4);
                        let _ = heads.send(());
                    }
                    if let Some(end) = head_end {
                        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                        let length: Option<usize> = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse().ok());
                        let whole = match length {
                            Some(n) => buf.len() >= end + n,
                            None => buf.ends_with(b"\r\n0\r\n\r\n"),
                        };
                        if whole {
                            break;
                        }
                    }
                    match s.read(&mut chunk).await {
                        Ok(n) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                        _ => return,
                    }
                }
                if String::from_utf8_lossy(&buf).contains("do-hang") {
                    std::future::pending::<()>().await;
                }
                let body = r#"{"object":"list","data":[]}"#;
                let out = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                     content-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(out.as_bytes()).await;
            });
        }
    });
    (url, rx)
}

/// `POST /v1/embeddings` with a chunked body that is no JSON object (it streams to the
/// engine): its first chunk, then, once the engine has the request's head, `rest`. The
/// answer's status.
async fn upload(addr: SocketAddr, heads: &mut mpsc::UnboundedReceiver<()>, rest: &str) -> u16 {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = "POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: text/plain\r\n\
                transfer-encoding: chunked\r\nconnection: close\r\n\r\n5\r\nhello\r\n";
    tcp.write_all(head.as_bytes()).await.unwrap();
    heads.recv().await.unwrap();
    tcp.write_all(rest.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let _ = tcp.read_to_end(&mut got).await;
    let text = String::from_utf8_lossy(&got).into_owned();
    text.get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status: {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_upload_is_the_clients_fault_not_the_engines() {
    let (engine, mut heads) = upload_engine().await;
    let (addr, source) = proxy(&[&engine], 2, OrchestratorConfig::default()).await;
    let ep = endpoint(&source, &engine);
    // A chunk size line that is no number: hyper fails the body (no client leaving);
    // the client is answered 400, and the engine, asked past the threshold, is not
    // blamed.
    for _ in 0..4 {
        assert_eq!(upload(addr, &mut heads, "zz\r\nhello\r\n").await, 400);
    }
    assert_eq!(source.health().state(&ep), Some(EndpointHealth::Healthy));
    // A well-formed upload is answered.
    assert_eq!(upload(addr, &mut heads, "0\r\n\r\n").await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_timeout_during_the_clients_upload_blames_no_engine() {
    let (engine, mut heads) = upload_engine().await;
    let mut config = OrchestratorConfig::default();
    config.decode_head_timeout = Duration::from_millis(300);
    let (addr, source) = proxy(&[&engine], 1, config).await;
    let ep = endpoint(&source, &engine);
    // The client's body is still coming when the engine's head is due: 504, and the
    // engine (which waits for the body) is not blamed.
    assert_eq!(upload(addr, &mut heads, "").await, 504);
    let health = source.health();
    assert_eq!(health.state(&ep), Some(EndpointHealth::Healthy));
    // Its body whole, an engine that gives no head in time is to blame.
    let status = upload(addr, &mut heads, "7\r\ndo-hang\r\n0\r\n\r\n").await;
    assert_eq!(status, 504);
    assert!(ejected(health.state(&ep)), "{:?}", health.state(&ep));
    // So it is when the body had a declared length (the transport need not poll it
    // past its last byte).
    let (engine, mut heads) = upload_engine().await;
    let mut config = OrchestratorConfig::default();
    config.decode_head_timeout = Duration::from_millis(300);
    let (addr, source) = proxy(&[&engine], 1, config).await;
    let ep = endpoint(&source, &engine);
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = "POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: text/plain\r\n\
                content-length: 7\r\nconnection: close\r\n\r\ndo-hang";
    tcp.write_all(head.as_bytes()).await.unwrap();
    heads.recv().await.unwrap();
    let mut got = Vec::new();
    let _ = tcp.read_to_end(&mut got).await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 504"), "{text}");
    let health = source.health();
    assert!(ejected(health.state(&ep)), "{:?}", health.state(&ep));
}

/// Routes whose body is read whole before any engine is asked: a direct one (SageMaker's
/// entry point) and a fanned-out one (an admin route).
const WHOLE_FIRST: [&str; 2] = ["/invocations", "/v1/load_lora_adapter"];

/// `POST path` with a chunked JSON body: its first chunk, then, after `wait`, `rest`.
/// The answer's status.
async fn upload_to(addr: SocketAddr, path: &str, wait: Duration, rest: &str) -> u16 {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         transfer-encoding: chunked\r\nconnection: close\r\n\r\n1\r\n{{\r\n"
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    tokio::time::sleep(wait).await;
    tcp.write_all(rest.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let _ = tcp.read_to_end(&mut got).await;
    let text = String::from_utf8_lossy(&got).into_owned();
    text.get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{path}: no status: {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_and_fanned_out_routes_blame_no_engine_for_the_clients_upload() {
    for path in WHOLE_FIRST {
        let (engine, mut heads) = upload_engine().await;
        let mut config = OrchestratorConfig::default();
        config.decode_head_timeout = Duration::from_millis(200);
        let (addr, source) = proxy(&[&engine], 1, config).await;
        let ep = endpoint(&source, &engine);
        let health = source.health();
        // A malformed chunk: the client is answered 400, no engine is asked, none is
        // blamed (the threshold is one failure).
        for _ in 0..3 {
            let status = upload_to(addr, path, Duration::ZERO, "zz\r\nx\r\n").await;
            assert_eq!(status, 400, "{path}");
        }
        assert!(heads.try_recv().is_err(), "{path}: an engine was asked");
        assert_eq!(health.state(&ep), Some(EndpointHealth::Healthy), "{path}");
        // A body still coming past the engine's head timeout: no engine is asked before
        // it is whole, no timeout runs against one, and the request is answered.
        let rest = "1\r\n}\r\n0\r\n\r\n";
        let status = upload_to(addr, path, Duration::from_millis(600), rest).await;
        assert_eq!(status, 200, "{path}");
        assert!(heads.try_recv().is_ok(), "{path}: the engine was not asked");
        assert_eq!(health.state(&ep), Some(EndpointHealth::Healthy), "{path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_event_in_a_whole_stream_counts_as_its_code_says() {
    // A 200 event stream that carries the engine's own error event is no served answer:
    // with a 5xx code it is the engine's failure (one ejects it here), with a 4xx code
    // the request's (its answer counts as a 4xx head's does). The stream reaches the
    // client whole either way, and the route's summary says it broke.
    for path in ROUTES {
        let (engine, _) = raw_engine().await;
        let routes = Routes::default();
        let config = OrchestratorConfig::default();
        let table = RouteTable::default().admin_routes(true);
        let (addr, source) = proxy_told(&[&engine], 1, config, table, Some(routes.clone())).await;
        let ep = endpoint(&source, &engine);
        let health = source.health();
        let (status, text) = post(addr, path, "do-event-400").await;
        assert_eq!(status, 200, "{path}: {text}");
        assert!(
            text.contains("\"code\": 400") && text.contains("[DONE]"),
            "{path}: {text}"
        );
        assert_eq!(health.state(&ep), Some(EndpointHealth::Healthy), "{path}");
        let (status, text) = post(addr, path, "do-event-500").await;
        assert_eq!(status, 200, "{path}: {text}");
        assert!(
            text.contains("\"code\": 500") && text.contains("[DONE]"),
            "{path}: {text}"
        );
        assert!(
            ejected(health.state(&ep)),
            "{path}: {:?} after an error event",
            health.state(&ep)
        );
        let told: Vec<(u16, Delivery)> = routes
            .0
            .lock()
            .unwrap()
            .iter()
            .map(|s| (s.status.as_u16(), s.delivery))
            .collect();
        assert_eq!(
            told,
            [(200, Delivery::Broken), (200, Delivery::Broken)],
            "{path}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completions_stream_without_a_finish_reason_fails_its_engine() {
    // A 200 completions event stream that ends with no choice's finish reason (vLLM's
    // completions stream whose KV load failed) did not answer: relayed whole, the route
    // broken, the engine's failure (one ejects it here), sent direct or forwarded. One
    // whose last chunk sets its finish reason is served, and another path's stream is
    // not held to it.
    for action in [RouteAction::Direct, RouteAction::Forwarded] {
        let (addr, ep, source, routes) = one_engine_routing("/v1/completions", action).await;
        let health = source.health();
        let (status, text) = post(addr, "/v1/completions", "do-finished").await;
        assert_eq!(status, 200, "{action:?}: {text}");
        let (status, text) = post(addr, "/v1/embeddings", "do-unfinished").await;
        assert_eq!(status, 200, "{action:?}: {text}");
        assert_eq!(
            health.state(&ep),
            Some(EndpointHealth::Healthy),
            "{action:?}"
        );
        let (status, text) = post(addr, "/v1/completions", "do-unfinished").await;
        assert_eq!(status, 200, "{action:?}: {text}");
        assert!(
            text.contains("\"completion_tokens\":0") && text.contains("[DONE]"),
            "{action:?}: relayed whole: {text}"
        );
        assert!(
            ejected(health.state(&ep)),
            "{action:?}: {:?} after an unfinished stream",
            health.state(&ep)
        );
        assert_eq!(
            routes.told(),
            [
                ("/v1/completions".to_owned(), Delivery::Complete),
                ("/v1/embeddings".to_owned(), Delivery::Complete),
                ("/v1/completions".to_owned(), Delivery::Broken)
            ],
            "{action:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_abort_in_a_generate_stream_counts_as_its_status_says() {
    // SGLang's `/generate` tells a request its engine aborted (a decode whose KV transfer
    // failed) in its last event's finish reason, then ends with `[DONE]`: no served
    // answer. Naming a 5xx it is the engine's failure (one ejects it here), a 4xx the
    // request's; relayed whole, the route broken, sent direct or forwarded, however the
    // path is spelled. Another path's stream is not read so.
    for action in [RouteAction::Direct, RouteAction::Forwarded] {
        let (addr, ep, source, routes) = one_engine_routing("/generate", action).await;
        let health = source.health();
        let (status, text) = post(addr, "/v1/embeddings", "do-abort-500").await;
        assert_eq!(status, 200, "{action:?}: {text}");
        // However the client spells the path.
        for path in ["/generate", "//generate", "/%67enerate", "/x/../generate"] {
            let (status, text) = post(addr, path, "do-abort-400").await;
            assert_eq!(status, 200, "{action:?} {path}: {text}");
        }
        assert_eq!(
            health.state(&ep),
            Some(EndpointHealth::Healthy),
            "{action:?}"
        );
        let (status, text) = post(addr, "/generate", "do-abort-500").await;
        assert_eq!(status, 200, "{action:?}: {text}");
        assert!(
            text.contains("\"status_code\":500") && text.contains("[DONE]"),
            "{action:?}: relayed whole: {text}"
        );
        assert!(
            ejected(health.state(&ep)),
            "{action:?}: {:?} after an aborted stream",
            health.state(&ep)
        );
        assert_eq!(
            routes.told(),
            [
                ("/v1/embeddings".to_owned(), Delivery::Complete),
                ("/generate".to_owned(), Delivery::Broken),
                ("/generate".to_owned(), Delivery::Broken),
                ("/generate".to_owned(), Delivery::Broken),
                ("/generate".to_owned(), Delivery::Broken),
                ("/generate".to_owned(), Delivery::Broken)
            ],
            "{action:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_stream_sent_direct_or_forwarded_ends_in_its_apis_error_event() {
    // The proxy's error event after an engine's stream broke takes the shape the
    // path's API reads: Anthropic's `event: error` on `/v1/messages` (its client skips
    // an unnamed event), OpenAI's on a path no API serves.
    for action in [RouteAction::Direct, RouteAction::Forwarded] {
        let (engine, _) = raw_engine().await;
        let table = RouteTable::default()
            .admin_routes(true)
            .set("/v1/messages", action);
        let config = OrchestratorConfig::default();
        let (addr, _source) = proxy_told(&[&engine], 5, config, table, None).await;
        let (status, text) = post(addr, "/v1/messages", "do-break").await;
        assert_eq!(status, 200, "{action:?}: {text}");
        assert!(
            text.contains(
                "\n\nevent: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\""
            ),
            "{action:?}: {text}"
        );
        let (_, text) = post(addr, "/v1/embeddings", "do-break").await;
        assert!(
            text.contains("\n\ndata: {\"error\":") && !text.contains("event: error"),
            "{action:?}: {text}"
        );
    }
}
