//! A client that leaves before its answer's head (while its body is read, or while the
//! engine has not answered yet) is summarized once, as `cancelled` with status 499, as
//! the orchestrator summarizes its own requests whose client left: on every route the
//! service builds its own summaries for (forwarded, direct, fanned out). Over loopback:
//! a `PdService` served by the crate's server, engines that take a request and never
//! answer it.

#![allow(missing_docs)] // a test binary

use std::net::SocketAddr;
use std::time::Duration;

use disagg_connectors::vllm::VllmNixl;
use disagg_core::outcome::Delivery;
use disagg_core::{Endpoint, Orchestrator, Role, source::StaticSource};
use disagg_http::routed::{RouteKind, RouteListener, RouteSummary};
use disagg_http::server::Builder;
use disagg_http::{HttpTransport, PdService, PdServiceConfig, RouteAction, RouteTable};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// Every route summary told, in order.
struct Heard(mpsc::UnboundedSender<RouteSummary>);

impl RouteListener for Heard {
    fn on_route(&self, summary: &RouteSummary) {
        let _ = self.0.send(summary.clone());
    }
}

/// An engine that reads each request's head and never answers: each head it read is
/// sent on the channel.
async fn silent_engine() -> (String, mpsc::UnboundedReceiver<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let Ok((mut tcp, _)) = listener.accept().await else {
                return;
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tcp.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = tx.send(());
                // Held open, unanswered, until the proxy closes it.
                while matches!(tcp.read(&mut buf).await, Ok(n) if n > 0) {}
            });
        }
    });
    (url, rx)
}

/// A proxy whose `path` is served as `action`, over one prefill and one decode engine
/// that never answer.
async fn proxy(
    path: &'static str,
    action: RouteAction,
) -> (
    SocketAddr,
    mpsc::UnboundedReceiver<RouteSummary>,
    mpsc::UnboundedReceiver<()>,
) {
    let (prefill, asked) = silent_engine().await;
    let (decode, decode_asked) = silent_engine().await;
    // Both engines' heads on one channel.
    let (tx, all_asked) = mpsc::unbounded_channel();
    for mut rx in [asked, decode_asked] {
        let tx = tx.clone();
        tokio::spawn(async move {
            while rx.recv().await.is_some() {
                let _ = tx.send(());
            }
        });
    }
    let source = StaticSource::new([
        Endpoint::new(&prefill, Role::Prefill).unwrap(),
        Endpoint::new(&decode, Role::Decode).unwrap(),
    ]);
    let orchestrator =
        Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new()).build();
    let (heard, summaries) = mpsc::unbounded_channel();
    let mut config = PdServiceConfig::default();
    config.route_listeners.push(Heard(heard));
    config.routes = RouteTable::default().set(path, action);
    let service = PdService::with_config(orchestrator, config);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Builder::new().serve(listener, service, std::future::pending()));
    (addr, summaries, all_asked)
}

/// The one summary told, within 5 s (a bound on a failure, not a wait for success:
/// it comes as soon as it is told), and no other after it.
async fn one_summary(summaries: &mut mpsc::UnboundedReceiver<RouteSummary>) -> RouteSummary {
    let s = tokio::time::timeout(Duration::from_secs(5), summaries.recv())
        .await
        .expect("no summary was told")
        .expect("the listener is gone");
    assert!(summaries.try_recv().is_err(), "told more than once");
    s
}

fn assert_left(s: &RouteSummary, kind: RouteKind) {
    assert_eq!(s.kind, kind);
    assert_eq!(s.delivery, Delivery::Cancelled, "{s:?}");
    assert_eq!(s.outcome, "cancelled", "{s:?}");
    assert_eq!(s.status.as_u16(), 499, "{s:?}");
    assert_eq!(s.bytes, 0);
}

/// `POST path` with `content_type` and a body of `declared` bytes of which `sent` are
/// sent now.
async fn post(
    addr: SocketAddr,
    path: &str,
    content_type: &str,
    declared: usize,
    sent: &str,
) -> TcpStream {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: {content_type}\r\n\
         x-request-id: client-1\r\ncontent-length: {declared}\r\n\r\n{sent}"
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    tcp
}

const COMPLETION: &str = r#"{"model":"m","prompt":"hello","max_tokens":4}"#;

/// The client leaves once the engine has the request, before it answered.
async fn left_before_the_head(path: &'static str, action: RouteAction, kind: RouteKind) {
    let (addr, mut summaries, mut asked) = proxy(path, action).await;
    let tcp = post(addr, path, "application/json", COMPLETION.len(), COMPLETION).await;
    // A fan-out asks both engines; one asked is enough: no answer comes from either.
    asked.recv().await.unwrap();
    assert!(summaries.try_recv().is_err(), "told before the client left");
    drop(tcp);
    let s = one_summary(&mut summaries).await;
    assert_left(&s, kind);
    assert_eq!(s.request_id.as_ref().unwrap(), "client-1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_request_left_before_the_head_is_499() {
    left_before_the_head(
        "/v1/completions",
        RouteAction::Forwarded,
        RouteKind::Forward,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_request_left_before_the_head_is_499() {
    left_before_the_head("/v1/completions", RouteAction::Direct, RouteKind::Direct).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fanned_out_request_left_before_the_head_is_499() {
    left_before_the_head(
        "/reset_prefix_cache",
        RouteAction::FannedOut,
        RouteKind::FanOut,
    )
    .await;
}

/// The client sends part of its body, then leaves: no engine is asked.
async fn left_while_its_body_is_read(
    path: &'static str,
    action: RouteAction,
    kind: RouteKind,
    content_type: &str,
) {
    let (addr, mut summaries, mut asked) = proxy(path, action).await;
    let tcp = post(addr, path, content_type, 1000, r#"{"model":"m","#).await;
    drop(tcp);
    let s = one_summary(&mut summaries).await;
    assert_left(&s, kind);
    assert!(asked.try_recv().is_err(), "an engine was asked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_request_left_while_its_body_is_read_is_499() {
    let json = "application/json";
    left_while_its_body_is_read(
        "/v1/completions",
        RouteAction::Forwarded,
        RouteKind::Forward,
        json,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_request_left_while_its_body_is_read_is_499() {
    let json = "application/json";
    left_while_its_body_is_read(
        "/v1/completions",
        RouteAction::Direct,
        RouteKind::Direct,
        json,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fanned_out_request_left_while_its_body_is_read_is_499() {
    let json = "application/json";
    let path = "/reset_prefix_cache";
    left_while_its_body_is_read(path, RouteAction::FannedOut, RouteKind::FanOut, json).await;
}

/// A body that is no JSON object streams to the engine as it comes: its client leaving
/// in the middle of it is the client's leaving, not the engine's failure (502).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_body_whose_client_left_is_499_not_the_engines_failure() {
    let path = "/v1/audio/transcriptions";
    let (addr, mut summaries, mut asked) = proxy(path, RouteAction::Forwarded).await;
    let tcp = post(
        addr,
        path,
        "multipart/form-data; boundary=x",
        1000,
        "--x\r\n",
    )
    .await;
    // The engine has the head (the body streams to it): the client leaves mid-body.
    asked.recv().await.unwrap();
    drop(tcp);
    let s = one_summary(&mut summaries).await;
    assert_left(&s, RouteKind::Forward);
}

/// Every orchestrated request's summary told, in order.
struct HeardCore(mpsc::UnboundedSender<disagg_core::outcome::Summary>);

impl disagg_core::outcome::Listener for HeardCore {
    fn on_request(&self, summary: &disagg_core::outcome::Summary) {
        let _ = self.0.send(summary.clone());
    }
}

/// A proxy that orchestrates `/v1/completions` over engines that are never reached,
/// its orchestrator's summaries on the channel, its body budget to watch.
async fn orchestrating_proxy() -> (
    SocketAddr,
    mpsc::UnboundedReceiver<disagg_core::outcome::Summary>,
    disagg_http::body::BodyBudget,
) {
    // No engine is asked: the addresses are never dialled.
    let source = StaticSource::new([
        Endpoint::new("http://127.0.0.1:9", Role::Prefill).unwrap(),
        Endpoint::new("http://127.0.0.1:9", Role::Decode).unwrap(),
    ]);
    let (heard, summaries) = mpsc::unbounded_channel();
    let orchestrator = Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new())
        .listener(HeardCore(heard))
        .build();
    let config = PdServiceConfig::default();
    let budget = config.body_budget.clone();
    let service = PdService::with_config(orchestrator, config);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Builder::new().serve(listener, service, std::future::pending()));
    (addr, summaries, budget)
}

/// The one orchestrated summary told, within 5 s (a bound on a failure), and no other.
async fn one_core_summary(
    summaries: &mut mpsc::UnboundedReceiver<disagg_core::outcome::Summary>,
) -> disagg_core::outcome::Summary {
    let s = tokio::time::timeout(Duration::from_secs(5), summaries.recv())
        .await
        .expect("no summary was told")
        .expect("the listener is gone");
    assert!(summaries.try_recv().is_err(), "told more than once");
    s
}

fn assert_core_left(s: &disagg_core::outcome::Summary) {
    assert_eq!(s.delivery, Delivery::Cancelled, "{s:?}");
    assert_eq!(s.outcome, "cancelled", "{s:?}");
    assert_eq!(s.status.as_u16(), 499, "{s:?}");
    assert_eq!(s.error, None);
    assert_eq!(s.attempts, 0);
    assert_eq!(s.request_id.as_ref().unwrap(), "client-1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orchestrated_request_left_while_its_body_is_read_is_499() {
    let (addr, mut summaries, budget) = orchestrating_proxy().await;
    let tcp = post(
        addr,
        "/v1/completions",
        "application/json",
        1000,
        r#"{"model":"#,
    )
    .await;
    drop(tcp);
    let s = one_core_summary(&mut summaries).await;
    assert_core_left(&s);
    assert_eq!(budget.in_use(), 0);
}

/// A large body is parsed on the blocking pool; its client leaving while the parse
/// waits there for a thread ends the request cancelled (the parse never runs).
#[test]
fn an_orchestrated_request_left_while_its_body_is_parsed_on_the_pool_is_499() {
    // One blocking thread, kept busy until the client has left.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let gate = std::sync::Arc::new(std::sync::Barrier::new(2));
    let busy_gate = std::sync::Arc::clone(&gate);
    let busy = runtime.spawn_blocking(move || {
        busy_gate.wait();
    });
    // Opens the gate when dropped: at the end, or when an assertion fails before it
    // (the runtime waits for its blocking thread as it shuts down).
    let opener = Opener(gate);
    runtime.block_on(async {
        let (addr, mut summaries, budget) = orchestrating_proxy().await;
        let prompt = "a".repeat(disagg_http::body::PARSE_OFF_LOOP_FROM);
        let body = format!(r#"{{"model":"m","prompt":"{prompt}","max_tokens":1}}"#);
        let tcp = post(
            addr,
            "/v1/completions",
            "application/json",
            body.len(),
            &body,
        )
        .await;
        // The whole body is in: its share is held by the parse that waits for a thread.
        while budget.in_use() < body.len() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(summaries.try_recv().is_err(), "told before the client left");
        drop(tcp);
        let s = one_core_summary(&mut summaries).await;
        assert_core_left(&s);
        drop(opener);
        busy.await.unwrap();
        // The cancelled parse's share goes when the pool's thread takes it off the queue.
        tokio::task::spawn_blocking(|| ()).await.unwrap();
        assert_eq!(budget.in_use(), 0);
    });
}

/// Waits at its barrier when dropped.
struct Opener(std::sync::Arc<std::sync::Barrier>);

impl Drop for Opener {
    fn drop(&mut self) {
        self.0.wait();
    }
}

/// Closes `tcp` with a reset (RST) rather than a close (FIN): `SO_LINGER` zero.
fn reset(tcp: TcpStream) {
    tcp.set_zero_linger().unwrap();
    drop(tcp);
}

/// A client that resets its connection in the middle of its body left, as one that
/// closes it does (hyper tells the body's error as the socket's `ConnectionReset`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orchestrated_request_reset_while_its_body_is_read_is_499() {
    let (addr, mut summaries, budget) = orchestrating_proxy().await;
    let tcp = post(
        addr,
        "/v1/completions",
        "application/json",
        1000,
        r#"{"model":"#,
    )
    .await;
    reset(tcp);
    let s = one_core_summary(&mut summaries).await;
    assert_core_left(&s);
    assert_eq!(budget.in_use(), 0);
}

/// A chunked body whose client leaves between two chunks: the body ends where a
/// chunk's size line was due, which is the client leaving too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orchestrated_chunked_request_left_while_its_body_is_read_is_499() {
    let (addr, mut summaries, budget) = orchestrating_proxy().await;
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                x-request-id: client-1\r\ntransfer-encoding: chunked\r\n\r\n9\r\n{\"model\":\r\n";
    tcp.write_all(head.as_bytes()).await.unwrap();
    drop(tcp);
    let s = one_core_summary(&mut summaries).await;
    assert_core_left(&s);
    assert_eq!(budget.in_use(), 0);
}

/// A streamed body's client resetting its connection once the engine has the head: the
/// client left (499), the engine did not fail (502).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_body_whose_client_reset_is_499_not_the_engines_failure() {
    let path = "/v1/audio/transcriptions";
    let (addr, mut summaries, mut asked) = proxy(path, RouteAction::Forwarded).await;
    let tcp = post(
        addr,
        path,
        "multipart/form-data; boundary=x",
        1000,
        "--x\r\n",
    )
    .await;
    asked.recv().await.unwrap();
    reset(tcp);
    let s = one_summary(&mut summaries).await;
    assert_left(&s, RouteKind::Forward);
}
