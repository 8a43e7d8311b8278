//! `GET /v1/models` beside a decode engine that takes `GET /v1/models` and never answers
//! it (or sends its head and then trickles its body): the engines that answer are
//! listed, each engine's answer timed on its own; requests that find the list stale at
//! once share one fetch rather than waiting for each other's; a fanned-out admin
//! request is answered while a fetch is in flight, a fetch begun before it is not kept
//! as the list, and the list is dropped even when its client leaves before the
//! engines answered; a fetch whose transport panicked is not answered again. Over
//! loopback: a `PdService` served by the crate's server, a simulated engine and a raw
//! one behind.

#![allow(missing_docs)] // a test binary

mod common;

use common::read_text;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use disagg_connectors::vllm::VllmNixl;
use disagg_core::transport::{ResponseFuture, Transport};
use disagg_core::{Endpoint, Orchestrator, Role, source::StaticSource};
use disagg_http::routed::{RouteKind, RouteListener, RouteSummary};
use disagg_http::server::Builder;
use disagg_http::{HttpTransport, PdService, PdServiceConfig, RouteTable};
use disagg_sim::{SimConfig, SimEngine};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};

/// How long a client waits for an answer before the test fails.
const ANSWER_WITHIN: Duration = Duration::from_secs(20);

/// The proxy's `models_timeout` where an engine never answers and the test waits it out.
const MODELS_TIMEOUT: Duration = Duration::from_secs(1);

/// The proxy's `models_timeout` where a fetch must still be in flight while the test
/// does something else: far longer than [`ANSWER_WITHIN`].
const LONG_MODELS_TIMEOUT: Duration = Duration::from_secs(300);

/// How a raw engine answers `GET /v1/models`.
#[derive(Clone, Copy, Debug)]
enum Models {
    /// With the body the test sends for it, once it does; never, while the test holds
    /// the request's sender (or has dropped it).
    Held,
    /// Its head at once, promising 1 MB, then one byte of it every 100 ms.
    Trickled,
}

/// A request for the list, as a raw engine reports it: the sender of its body (for
/// [`Models::Held`]).
type Asked = oneshot::Sender<String>;

/// A raw engine answering `GET /v1/models` as `models` says, each such request reported
/// on the channel as it comes, and any `POST` (a fanned-out admin request) 200 `{}` at
/// once.
async fn raw_engine(models: Models) -> (String, mpsc::UnboundedReceiver<Asked>) {
    let (url, asked, _posted) = engine(models, false).await;
    (url, asked)
}

/// A raw engine as [`raw_engine`]'s, each `POST` reported on the second channel as it
/// comes, and answered at once, or (`hold_posts`) never: held until the proxy closes
/// the connection.
async fn engine(
    models: Models,
    hold_posts: bool,
) -> (
    String,
    mpsc::UnboundedReceiver<Asked>,
    mpsc::UnboundedReceiver<()>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::unbounded_channel();
    let (posted_tx, posted) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let tx = tx.clone();
            let posted_tx = posted_tx.clone();
            tokio::spawn(async move {
                while let Some(head) = read_text(&mut s).await {
                    let answer = if head.starts_with("GET /v1/models ") {
                        let (body_tx, body_rx) = oneshot::channel::<String>();
                        let _ = tx.send(body_tx);
                        match models {
                            Models::Held => {
                                let mut buf = [0u8; 1024];
                                tokio::select! {
                                    body = body_rx => match body {
                                        Ok(body) => whole(200, &body),
                                        // Never, then: held until the proxy closes it.
                                        Err(_) => {
                                            while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
                                            return;
                                        }
                                    },
                                    // The proxy closed the connection.
                                    _ = s.read(&mut buf) => return,
                                }
                            }
                            Models::Trickled => {
                                let head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                                            content-length: 1000000\r\n\r\n{\"data\":[";
                                if s.write_all(head.as_bytes()).await.is_err() {
                                    return;
                                }
                                // Until the proxy closes the connection.
                                while s.write_all(b" ").await.is_ok() {
                                    tokio::time::sleep(Duration::from_millis(100)).await;
                                }
                                return;
                            }
                        }
                    } else if head.starts_with("POST ") {
                        let _ = posted_tx.send(());
                        if hold_posts {
                            let mut buf = [0u8; 1024];
                            while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
                            return;
                        }
                        whole(200, "{}")
                    } else {
                        whole(404, "{}")
                    };
                    if s.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (url, rx, posted)
}

/// An HTTP/1.1 answer of `status` with the JSON `body`.
fn whole(status: u16, body: &str) -> String {
    format!(
        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// A proxy over the prefill `prefill` and the decode endpoints `decode`, its admin
/// routes open, with these model timeout and cache lifetime.
async fn proxy(
    prefill: &str,
    decode: Vec<Endpoint>,
    models_timeout: Duration,
    models_ttl: Duration,
) -> SocketAddr {
    let transport = HttpTransport::default();
    proxy_with(transport, None, prefill, decode, models_timeout, models_ttl).await
}

/// [`proxy`]'s, sending with `transport`, its route summaries told to `heard`.
async fn proxy_with(
    transport: impl Transport,
    heard: Option<Heard>,
    prefill: &str,
    decode: Vec<Endpoint>,
    models_timeout: Duration,
    models_ttl: Duration,
) -> SocketAddr {
    let mut endpoints = vec![Endpoint::new(prefill, Role::Prefill).unwrap()];
    endpoints.extend(decode);
    let orchestrator =
        Orchestrator::builder(StaticSource::new(endpoints), transport, VllmNixl::new()).build();
    let mut config = PdServiceConfig::default();
    if let Some(heard) = heard {
        config.route_listeners.push(heard);
    }
    config.routes = RouteTable::default().admin_routes(true);
    config.models_timeout = models_timeout;
    config.models_ttl = models_ttl;
    let service = PdService::with_config(orchestrator, config);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Builder::new().serve(listener, service, std::future::pending()));
    addr
}

fn decode(url: &str) -> Endpoint {
    Endpoint::new(url, Role::Decode).unwrap()
}

/// The client's answer.
#[derive(Debug)]
struct Got {
    status: u16,
    json: Value,
    text: String,
}

impl Got {
    /// The `id`s of a model list, in order.
    fn ids(&self) -> Vec<&str> {
        self.json["data"]
            .as_array()
            .unwrap_or_else(|| panic!("no list: {}", self.text))
            .iter()
            .map(|c| c["id"].as_str().unwrap())
            .collect()
    }

    /// The card `id` of a model list.
    fn card(&self, id: &str) -> &Value {
        self.json["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["id"] == id)
            .unwrap_or_else(|| panic!("no card {id}: {}", self.text))
    }
}

/// `method path` with `body`; the answer, within [`ANSWER_WITHIN`] (or the test fails).
async fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> Got {
    let exchange = async {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             connection: close\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        tcp.write_all(head.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        tcp.read_to_end(&mut got).await.unwrap();
        got
    };
    let got = tokio::time::timeout(ANSWER_WITHIN, exchange)
        .await
        .unwrap_or_else(|_| panic!("{method} {path}: no answer within {ANSWER_WITHIN:?}"));
    let text = String::from_utf8_lossy(&got).into_owned();
    let status = text
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status: {text}"));
    let at = text.find("\r\n\r\n").unwrap() + 4;
    let json = serde_json::from_str(&text[at..]).unwrap_or_else(|e| panic!("{path}: {e}: {text}"));
    Got { status, json, text }
}

async fn models(addr: SocketAddr) -> Got {
    request(addr, "GET", "/v1/models", "").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_never_answers_is_left_out_and_the_others_are_listed() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let d = SimEngine::start(SimConfig::default()).await.unwrap();
    for how in [Models::Held, Models::Trickled] {
        let (g, _asked) = raw_engine(how).await;
        // No declared model: the list is the engines' own.
        let addr = proxy(
            &p.url(),
            vec![decode(&d.url()), decode(&g)],
            MODELS_TIMEOUT,
            Duration::from_secs(60),
        )
        .await;
        let started = Instant::now();
        let got = models(addr).await;
        let took = started.elapsed();
        assert_eq!(got.status, 200, "{how:?}: {}", got.text);
        assert_eq!(got.ids(), ["sim-model"], "{how:?}");
        assert!(took < MODELS_TIMEOUT * 3, "{how:?}: {took:?}");
        // A declared name: the answering engine's card under it, not a bare one.
        let addr = proxy(
            &p.url(),
            vec![
                decode(&d.url()).with_models(["sim-model", "alias"]),
                decode(&g),
            ],
            MODELS_TIMEOUT,
            Duration::from_secs(60),
        )
        .await;
        let got = models(addr).await;
        assert_eq!(got.status, 200, "{how:?}: {}", got.text);
        assert_eq!(got.ids(), ["sim-model", "alias"], "{how:?}");
        assert_eq!(
            got.card("alias")["root"],
            "sim-model",
            "{how:?}: {}",
            got.text
        );
        assert_eq!(got.card("alias")["max_model_len"], 8192, "{how:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_share_one_fetch_and_none_waits_for_anothers() {
    const CALLERS: usize = 8;
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let d = SimEngine::start(SimConfig::default()).await.unwrap();
    let (g, mut asked) = raw_engine(Models::Held).await;
    let addr = proxy(
        &p.url(),
        vec![decode(&d.url()), decode(&g)],
        MODELS_TIMEOUT,
        Duration::from_secs(60),
    )
    .await;
    let started = Instant::now();
    let callers: Vec<_> = (0..CALLERS)
        .map(|_| {
            tokio::spawn(async move {
                let got = models(addr).await;
                (got, started.elapsed())
            })
        })
        .collect();
    let mut answers = Vec::new();
    for caller in callers {
        answers.push(caller.await.unwrap());
    }
    // About one timeout each, where callers queued behind one another waited k
    // timeouts (the 8th about 8): a bound with room for a loaded machine; the one
    // request the silent engine got (below) is what shows the fetch shared.
    let took: Vec<(u16, Duration)> = answers.iter().map(|(g, t)| (g.status, *t)).collect();
    assert!(
        took.iter().all(|(_, t)| *t < MODELS_TIMEOUT * 4),
        "{took:?}"
    );
    for (got, _) in &answers {
        assert_eq!(got.status, 200, "{}", got.text);
        assert_eq!(got.ids(), ["sim-model"]);
    }
    // One fetch for all of them: the silent engine was asked once.
    let mut held = Vec::new();
    while let Ok(one) = asked.try_recv() {
        held.push(one);
    }
    assert_eq!(held.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fanned_out_request_is_answered_while_a_fetch_is_in_flight() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let (g, mut asked) = raw_engine(Models::Held).await;
    let addr = proxy(
        &p.url(),
        vec![decode(&g)],
        LONG_MODELS_TIMEOUT,
        Duration::from_secs(60),
    )
    .await;
    let listing = tokio::spawn(models(addr));
    // The fetch is in flight: the engine has the request, unanswered.
    let _held = asked.recv().await.unwrap();
    let got = request(addr, "POST", "/reset_prefix_cache", "").await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(got.json["object"], "fan_out", "{}", got.text);
    assert!(!listing.is_finished());
    listing.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_begun_before_a_fanned_out_request_is_not_kept_as_the_list() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let d = SimEngine::start(SimConfig::default()).await.unwrap();
    let (g, mut asked) = raw_engine(Models::Held).await;
    let addr = proxy(
        &p.url(),
        vec![decode(&d.url()), decode(&g)],
        LONG_MODELS_TIMEOUT,
        // Long: only a dropped list is fetched again.
        Duration::from_secs(300),
    )
    .await;
    let listing = tokio::spawn(models(addr));
    let first = asked.recv().await.unwrap();
    // An adapter loaded on every engine while the fetch is in flight.
    let got = request(
        addr,
        "POST",
        "/v1/load_lora_adapter",
        r#"{"lora_name":"sql","lora_path":"/adapters/sql"}"#,
    )
    .await;
    assert_eq!(got.status, 200, "{}", got.text);
    first.send(r#"{"data":[]}"#.to_owned()).unwrap();
    let got = listing.await.unwrap();
    assert_eq!(got.status, 200, "{}", got.text);
    // The next request asks the engines again and lists the adapter.
    let next = tokio::spawn(models(addr));
    let second = tokio::time::timeout(ANSWER_WITHIN, asked.recv())
        .await
        .expect("the list fetched before the adapter was loaded was kept")
        .unwrap();
    second
        .send(r#"{"data":[{"id":"g-model","object":"model"}]}"#.to_owned())
        .unwrap();
    let got = next.await.unwrap();
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(got.ids(), ["sim-model", "sql", "g-model"], "{}", got.text);
    // And that list is kept: a third request is answered without asking again.
    let got = models(addr).await;
    assert_eq!(got.ids(), ["sim-model", "sql", "g-model"], "{}", got.text);
    assert!(asked.try_recv().is_err());
}

/// Every route summary told, in order.
struct Heard(mpsc::UnboundedSender<RouteSummary>);

impl RouteListener for Heard {
    fn on_route(&self, summary: &RouteSummary) {
        let _ = self.0.send(summary.clone());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fanned_out_request_whose_client_left_still_drops_the_list() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    // Takes admin requests and never answers them.
    let (g, mut asked, mut posted) = engine(Models::Held, true).await;
    let (heard, mut summaries) = mpsc::unbounded_channel();
    let addr = proxy_with(
        HttpTransport::default(),
        Some(Heard(heard)),
        &p.url(),
        vec![decode(&g)],
        LONG_MODELS_TIMEOUT,
        // Long: only a dropped list is fetched again.
        Duration::from_secs(300),
    )
    .await;
    // The list, kept.
    let listing = tokio::spawn(models(addr));
    let first = asked.recv().await.unwrap();
    first
        .send(r#"{"data":[{"id":"g-model","object":"model"}]}"#.to_owned())
        .unwrap();
    let got = listing.await.unwrap();
    assert_eq!(got.ids(), ["g-model"], "{}", got.text);
    // An adapter loaded: the engine has the request (it may apply it), and the client
    // leaves before it answered.
    let body = r#"{"lora_name":"sql","lora_path":"/adapters/sql"}"#;
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/load_lora_adapter HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    posted.recv().await.unwrap();
    drop(tcp);
    // Told once the fan-out is dropped (its 499).
    let told = tokio::time::timeout(ANSWER_WITHIN, summaries.recv())
        .await
        .expect("the fan-out whose client left was not told")
        .unwrap();
    assert_eq!((told.kind, told.status.as_u16()), (RouteKind::FanOut, 499));
    // The next request asks the engine again.
    let mut next = tokio::spawn(models(addr));
    let again = tokio::select! {
        again = asked.recv() => again.unwrap(),
        got = &mut next => panic!("answered from the list kept: {}", got.unwrap().text),
    };
    again
        .send(r#"{"data":[{"id":"g-model","object":"model"},{"id":"sql"}]}"#.to_owned())
        .unwrap();
    let got = next.await.unwrap();
    assert_eq!(got.ids(), ["g-model", "sql"], "{}", got.text);
}

/// [`HttpTransport`], but the answer to its first `GET /v1/models` panics (a bug: in
/// an embedder's transport, say).
struct PanicsOnce {
    inner: HttpTransport,
    panicked: AtomicBool,
}

impl Transport for PanicsOnce {
    fn send(&self, req: http::Request<Bytes>) -> ResponseFuture {
        if req.uri().path() == "/v1/models" && !self.panicked.swap(true, Ordering::SeqCst) {
            return Box::pin(async { panic!("a transport's bug, in a models fetch") });
        }
        self.inner.send(req)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_that_panicked_fails_its_request_and_the_next_fetches_again() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let d = SimEngine::start(SimConfig::default()).await.unwrap();
    let transport = PanicsOnce {
        inner: HttpTransport::default(),
        panicked: AtomicBool::new(false),
    };
    let addr = proxy_with(
        transport,
        None,
        &p.url(),
        vec![decode(&d.url())],
        MODELS_TIMEOUT,
        Duration::from_secs(60),
    )
    .await;
    let got = models(addr).await;
    assert_eq!(got.status, 502, "{}", got.text);
    let got = models(addr).await;
    assert_eq!(
        got.status, 200,
        "the failed fetch was answered again: {}",
        got.text
    );
    assert_eq!(got.ids(), ["sim-model"]);
}
