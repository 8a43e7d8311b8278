//! Embedding: `PdLayer` in front of other services, in gateway and sidecar mode, driven
//! with `tower::ServiceExt::oneshot` and over real loopback sockets against simulated
//! engines; and the embedding examples, run end to end.

#[path = "../support/mod.rs"]
mod support;

// Each example is compiled here as a module so its `run` can be driven against
// simulated engines; its `main` is not called, and its `pub` items are not exported.
#[allow(dead_code, unreachable_pub)]
#[path = "../../examples/custom_connector.rs"]
mod custom_connector;
#[allow(dead_code, unreachable_pub)]
#[path = "../../examples/custom_router.rs"]
mod custom_router;
#[allow(dead_code, unreachable_pub)]
#[path = "../../examples/gateway.rs"]
mod gateway;
#[allow(dead_code, unreachable_pub)]
#[path = "../../examples/sidecar.rs"]
mod sidecar;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use disagg::connectors::vllm::VllmNixl;
use disagg::core::{Endpoint, Orchestrator, Role, source::StaticSource};
use disagg::http::{HttpTransport, PdLayer};
use disagg_sim::{SimConfig, SimEngine};
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use support::*;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tower::{Service, ServiceBuilder, ServiceExt};

// === helpers ===

/// A value put in a request's extensions, to see it arrive.
#[derive(Debug, Clone, PartialEq)]
struct Marker(u32);

/// What the inner service saw of one request.
#[derive(Debug, Clone)]
struct Seen {
    method: Method,
    uri: String,
    headers: HeaderMap,
    marker: Option<Marker>,
    body: Bytes,
}

/// An inner service that records every request and answers `inner <path>` with a
/// header of its own.
#[derive(Clone, Default)]
struct Recorder {
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Recorder {
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

impl<B> Service<Request<B>> for Recorder
where
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: std::fmt::Debug,
{
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let seen = Arc::clone(&self.seen);
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            let path = parts.uri.path().to_owned();
            seen.lock().unwrap().push(Seen {
                method: parts.method,
                uri: parts.uri.to_string(),
                headers: parts.headers,
                marker: parts.extensions.get::<Marker>().cloned(),
                body,
            });
            let mut resp = Response::new(Full::new(Bytes::from(format!("inner {path}"))));
            resp.headers_mut()
                .insert("x-inner", http::HeaderValue::from_static("yes"));
            Ok(resp)
        })
    }
}

async fn nixl_pair() -> (SimEngine, SimEngine) {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let d = SimEngine::start(SimConfig::default()).await.unwrap();
    (p, d)
}

fn gateway_layer(p: &SimEngine, d: &SimEngine) -> PdLayer {
    let source = StaticSource::new([
        Endpoint::new(&p.url(), Role::Prefill).unwrap(),
        Endpoint::new(&d.url(), Role::Decode).unwrap(),
    ]);
    PdLayer::gateway(
        Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new()).build(),
    )
}

fn sidecar_layer(prefill: &[&SimEngine]) -> PdLayer<disagg::http::layer::Sidecar> {
    let pool = prefill
        .iter()
        .map(|e| Endpoint::new(&e.url(), Role::Prefill).unwrap());
    PdLayer::sidecar(StaticSource::new(pool))
}

/// The app a sidecar wraps: a decode engine's completion routes served in process,
/// and a route of its own.
fn engine_app(engine: &SimEngine) -> axum::Router {
    axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(|| async { "engine_metrics 1" }),
        )
        .route_service("/v1/chat/completions", engine.service())
        .route_service("/v1/completions", engine.service())
}

fn request(
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Request<Full<Bytes>> {
    let mut req = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.body(Full::new(Bytes::from(body.to_owned()))).unwrap()
}

async fn read<B>(resp: Response<B>) -> Answer
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let (parts, body) = resp.into_parts();
    let body = tokio::time::timeout(Duration::from_secs(20), body.collect())
        .await
        .expect("body in time")
        .unwrap()
        .to_bytes();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

/// A listener that counts the connections it accepts (and closes them).
async fn counting_listener() -> (String, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let count = Arc::new(AtomicUsize::new(0));
    let c = Arc::clone(&count);
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            c.fetch_add(1, Ordering::SeqCst);
            drop(s);
        }
    });
    (addr, count)
}

/// Serve `svc` with hyper on a loopback port until the returned sender is dropped.
async fn serve<S, B>(svc: S) -> (String, oneshot::Sender<()>)
where
    S: Service<Request<hyper::body::Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(
        disagg::http::server::Builder::new().serve(listener, svc, async {
            let _ = rx.await;
        }),
    );
    (url, tx)
}

// === passthrough ===

/// Requests that are not P/D reach the inner service as they came: method, target,
/// headers, extensions and body; the inner answer comes back as it was written.
#[tokio::test]
async fn non_pd_requests_reach_the_inner_service_untouched_oneshot() {
    let (p, d) = nixl_pair().await;
    let recorder = Recorder::default();
    for sidecar in [false, true] {
        let cases = [
            (Method::GET, "/metrics?format=prom", ""),
            (
                Method::POST,
                "/v1/embeddings",
                r#"{"input":"x","model":"m"}"#,
            ),
            // A P/D path with another method is not orchestrated.
            (Method::GET, "/v1/chat/completions", ""),
            (Method::PUT, "/v1/completions", "raw \u{0} bytes"),
        ];
        for (method, path, body) in cases {
            let mut req = request(
                method.clone(),
                path,
                &[
                    ("x-custom", "a"),
                    ("x-custom", "b"),
                    ("authorization", "Bearer t"),
                ],
                body,
            );
            req.extensions_mut().insert(Marker(7));
            let sent_headers = req.headers().clone();
            let resp = if sidecar {
                ServiceBuilder::new()
                    .layer(sidecar_layer(&[&p]))
                    .service(recorder.clone())
                    .oneshot(req)
                    .await
            } else {
                ServiceBuilder::new()
                    .layer(gateway_layer(&p, &d))
                    .service(recorder.clone())
                    .oneshot(req)
                    .await
            };
            let a = read(resp.unwrap()).await;
            assert_eq!(a.status, StatusCode::OK);
            assert_eq!(a.header("x-inner"), Some("yes"));
            assert_eq!(
                a.text(),
                format!("inner {}", path.split('?').next().unwrap())
            );
            let seen = recorder.seen().pop().unwrap();
            assert_eq!(seen.method, method);
            assert_eq!(seen.uri, path);
            assert_eq!(seen.headers, sent_headers);
            assert_eq!(seen.marker, Some(Marker(7)));
            assert_eq!(seen.body, body.as_bytes());
        }
    }
    assert_eq!(
        p.stats().requests + d.stats().requests,
        0,
        "no engine was called"
    );
}

/// In sidecar mode the inner service is the decode engine: the headers the engines
/// read as where or as what a request runs never reach it from a client, on the
/// routes the sidecar passes through too (the gateway's inner service is an app's,
/// which gets them as they came).
#[tokio::test]
async fn a_sidecar_passes_no_engine_directive_to_its_engine() {
    let (p, _d) = nixl_pair().await;
    let recorder = Recorder::default();
    let req = request(
        Method::POST,
        "/v1/embeddings",
        &[
            ("x-override-bootstrap-host", "10.6.6.6"),
            ("x_override_bootstrap_room", "7"),
            ("x-data-parallel-rank", "1"),
            ("x-custom", "a"),
            ("authorization", "Bearer t"),
        ],
        r#"{"input":"x","model":"m"}"#,
    );
    let resp = ServiceBuilder::new()
        .layer(sidecar_layer(&[&p]))
        .service(recorder.clone())
        .oneshot(req)
        .await;
    assert_eq!(read(resp.unwrap()).await.status, StatusCode::OK);
    let seen = recorder.seen().pop().unwrap();
    let mut names: Vec<&str> = seen.headers.keys().map(|n| n.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["authorization", "x-custom"], "{:?}", seen.headers);
}

/// The same over hyper and real sockets, next to a P/D request served disaggregated.
#[tokio::test]
async fn non_pd_requests_reach_the_inner_service_untouched_over_sockets() {
    let (p, d) = nixl_pair().await;
    let recorder = Recorder::default();
    let svc = ServiceBuilder::new()
        .layer(gateway_layer(&p, &d))
        .service(recorder.clone());
    let (url, _stop) = serve(svc).await;

    let body = "not json, and that is fine here";
    let a = post(&url, "/admin/reload", body, &[("x-custom", "v")]).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.text(), "inner /admin/reload");
    assert_eq!(a.header("x-inner"), Some("yes"));
    let seen = recorder.seen().pop().unwrap();
    assert_eq!(seen.method, Method::POST);
    assert_eq!(seen.uri, "/admin/reload");
    assert_eq!(seen.body, body.as_bytes());
    assert_eq!(seen.headers.get("x-custom").unwrap(), "v");
    assert_eq!(
        seen.headers.get("content-type").unwrap(),
        "application/json"
    );

    let a = post(
        &url,
        "/v1/chat/completions",
        chat("hello there", 6, true),
        &[],
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
    assert_eq!(d.stats().remote_decodes, 1);
    assert_eq!(
        recorder.seen().len(),
        1,
        "the P/D request did not reach the inner service"
    );
}

// === sidecar ===

/// In sidecar mode the decode leg is the inner service, called in process with the
/// prefill's `kv_transfer_params`: the decode engine pulls the KV and answers, and its
/// HTTP listener never sees a connection.
#[tokio::test]
async fn sidecar_decode_leg_is_the_inner_service_with_the_handoff() {
    let (p, d) = nixl_pair().await;
    let prefiller = p.addr().to_string();
    for (path, body, stream) in [
        (
            "/v1/chat/completions",
            chat("the quick brown fox", 8, true),
            true,
        ),
        (
            "/v1/completions",
            completion("jumps over the dog", 5, false),
            false,
        ),
    ] {
        let svc = ServiceBuilder::new()
            .layer(sidecar_layer(&[&p]))
            .service(engine_app(&d));
        let req = request(
            Method::POST,
            path,
            &[
                ("x-prefiller-host-port", &prefiller),
                ("x-request-id", "sc-1"),
            ],
            &body,
        );
        let a = read(svc.oneshot(req).await.unwrap()).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
        assert_eq!(
            a.header("content-type")
                .is_some_and(|c| c.starts_with("text/event-stream")),
            stream
        );
        let direct = post(&d.url(), path, body, &[]).await;
        assert_eq!(a.content(), direct.content(), "same text as a direct run");
    }

    let (ps, ds) = (p.stats(), d.stats());
    assert_eq!(ps.prefill_requests, 2);
    assert_eq!(ps.side_channel_served, 2, "KV left over the side channel");
    assert_eq!(ds.remote_decodes, 2, "the in-process decode pulled the KV");
    // The direct runs above are the only HTTP connections the decode engine accepted.
    assert_eq!(ds.http_connections, 2);
    assert_eq!(ds.requests, 4);
}

/// What the inner service receives as the decode leg: the client's body plus the
/// prefill's handoff, the prefill leg's request id, and no prefiller header.
#[tokio::test]
async fn sidecar_decode_leg_carries_the_prefill_handoff_and_no_prefiller_header() {
    let (p, d) = nixl_pair().await;
    let svc = ServiceBuilder::new()
        .layer(sidecar_layer(&[&p]))
        .service(engine_app(&d));
    let req = request(
        Method::POST,
        "/v1/completions",
        &[
            ("x-prefiller-host-port", &p.addr().to_string()),
            ("x-request-id", "sc-2"),
        ],
        &completion("carry me over", 4, false),
    );
    let a = read(svc.oneshot(req).await.unwrap()).await;
    assert_eq!(a.status, 200, "{}", a.text());

    let prefill_leg = p.requests().pop().unwrap();
    assert_eq!(
        prefill_leg.body["kv_transfer_params"]["do_remote_decode"],
        true
    );
    assert_eq!(prefill_leg.header("x-prefiller-host-port"), None);
    let decode_leg = d.requests().pop().unwrap();
    assert_eq!(decode_leg.path, "/v1/completions");
    // The engines share the proxy's own id for this request, never the client's.
    assert_eq!(
        decode_leg.header("x-request-id"),
        prefill_leg.header("x-request-id")
    );
    assert_ne!(decode_leg.header("x-request-id"), Some("sc-2"));
    assert_eq!(decode_leg.header("x-prefiller-host-port"), None);
    let params = &decode_leg.body["kv_transfer_params"];
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["remote_engine_id"], p.engine_id());
    assert_eq!(params["remote_port"], p.side_channel_addr().port());
    assert_eq!(decode_leg.body["max_tokens"], 4, "the client's own limit");
    assert_eq!(
        d.stats().http_connections,
        0,
        "no network hop to the decode"
    );
}

/// A prefiller header naming a host that is not one of the sidecar's prefill
/// endpoints is refused with 400 before anything is contacted.
#[tokio::test]
async fn sidecar_refuses_a_prefiller_off_the_allow_list_without_contacting_it() {
    let (p, d) = nixl_pair().await;
    let (stranger, accepted) = counting_listener().await;
    let svc = ServiceBuilder::new()
        .layer(sidecar_layer(&[&p]))
        .service(engine_app(&d));
    let (url, _stop) = serve(svc).await;

    for (value, code) in [
        (stranger.as_str(), "prefiller_not_allowed"),
        ("127.0.0.1", "invalid_prefiller"),
        ("http://127.0.0.1:1/x", "invalid_prefiller"),
    ] {
        let a = post(
            &url,
            "/v1/chat/completions",
            chat("hi", 4, true),
            &[("x-prefiller-host-port", value)],
        )
        .await;
        assert_openai_error(&a, 400, code);
    }
    // Give a stray connection every chance to show up.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        0,
        "the named host was never contacted"
    );
    assert_eq!(p.stats().requests, 0);
    assert_eq!(d.stats().requests, 0);

    // The same stranger is accepted once the check is explicitly off.
    let svc = ServiceBuilder::new()
        .layer(sidecar_layer(&[&p]).accept_any_prefiller())
        .service(engine_app(&d));
    let req = request(
        Method::POST,
        "/v1/completions",
        &[("x-prefiller-host-port", &stranger)],
        &completion("hi", 2, false),
    );
    let a = read(svc.oneshot(req).await.unwrap()).await;
    assert_eq!(a.status, 502, "{}", a.text());
    assert!(
        accepted.load(Ordering::SeqCst) >= 1,
        "turned off, the check lets it through"
    );
}

/// Without the header the sidecar picks a prefill endpoint of its pool (or, told so,
/// serves decode-only); the header is removed from requests passed through.
#[tokio::test]
async fn sidecar_without_header_picks_from_the_pool_and_strips_the_header_elsewhere() {
    let (p, d) = nixl_pair().await;
    let svc = ServiceBuilder::new()
        .layer(sidecar_layer(&[&p]))
        .service(engine_app(&d));
    let req = request(
        Method::POST,
        "/v1/completions",
        &[],
        &completion("pool", 3, false),
    );
    let a = read(svc.clone().oneshot(req).await.unwrap()).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
    assert_eq!(p.stats().prefill_requests, 1);

    let recorder = Recorder::default();
    let svc = ServiceBuilder::new()
        .layer(sidecar_layer(&[&p]))
        .service(recorder.clone());
    let req = request(
        Method::GET,
        "/metrics",
        &[("x-prefiller-host-port", "10.1.1.1:80"), ("x-keep", "1")],
        "",
    );
    let a = read(svc.oneshot(req).await.unwrap()).await;
    assert_eq!(a.status, 200);
    let seen = recorder.seen().pop().unwrap();
    assert!(seen.headers.get("x-prefiller-host-port").is_none());
    assert_eq!(seen.headers.get("x-keep").unwrap(), "1");

    let svc = ServiceBuilder::new()
        .layer(sidecar_layer(&[&p]).decode_only_without_prefiller())
        .service(engine_app(&d));
    let req = request(
        Method::POST,
        "/v1/completions",
        &[],
        &completion("alone", 3, false),
    );
    let a = read(svc.oneshot(req).await.unwrap()).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.header("x-disagg-handoff"), Some("decode-only"));
    assert_eq!(p.stats().prefill_requests, 1, "no new prefill");
    assert_eq!(d.stats().http_connections, 0);
}

/// The layer composes with other tower layers (timeout, concurrency limit) and keeps
/// the stack's error type.
#[tokio::test]
async fn layer_composes_with_timeout_and_concurrency_limit() {
    let (p, d) = nixl_pair().await;
    let svc = ServiceBuilder::new()
        .timeout(Duration::from_secs(20))
        .concurrency_limit(4)
        .layer(gateway_layer(&p, &d))
        .service(Recorder::default());
    let req = request(
        Method::POST,
        "/v1/chat/completions",
        &[],
        &chat("stack", 4, false),
    );
    let a = read(svc.clone().oneshot(req).await.unwrap()).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
    let a = read(
        svc.oneshot(request(Method::GET, "/health", &[], ""))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(a.text(), "inner /health");
}

// === the examples ===

#[tokio::test]
async fn gateway_example_serves_disaggregated_and_keeps_its_routes() {
    let (p, d) = nixl_pair().await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = oneshot::channel::<()>();
    let server = tokio::spawn({
        let (pu, du) = (p.url(), d.url());
        async move {
            gateway::run(listener, &pu, &du, async {
                let _ = rx.await;
            })
            .await
            .map_err(|e| e.to_string())
        }
    });

    let a = get(&url, "/health").await;
    assert_eq!((a.status.as_u16(), a.text().as_str()), (200, "ok"));
    let a = get(&url, "/nope").await;
    assert_eq!(a.status, 404);
    let body = chat("gateway example", 6, true);
    let a = post(&url, "/v1/chat/completions", body.clone(), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
    assert_eq!(d.stats().remote_decodes, 1);
    assert_eq!(p.stats().side_channel_served, 1);
    let direct = post(&d.url(), "/v1/chat/completions", body, &[]).await;
    assert_eq!(a.content(), direct.content());

    drop(tx);
    let ended = tokio::time::timeout(Duration::from_secs(5), server).await;
    assert!(matches!(ended, Ok(Ok(Ok(())))), "{ended:?}");
}

#[tokio::test]
async fn sidecar_example_decodes_in_process() {
    let (p, d) = nixl_pair().await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = oneshot::channel::<()>();
    let prefill = [p.url()];
    // The example's server borrows the engine, so it runs beside the client in this task.
    let server = sidecar::run(listener, &d, &prefill, async {
        let _ = rx.await;
    });
    let client = async {
        let a = get(&url, "/health").await;
        assert_eq!((a.status.as_u16(), a.text().as_str()), (200, "ok"));
        let a = get(&url, "/v1/models").await;
        assert_eq!(
            a.json()["data"][0]["id"],
            "sim-model",
            "the engine's own route"
        );

        let prefiller = p.addr().to_string();
        let body = chat("sidecar example", 7, true);
        let a = post(
            &url,
            "/v1/chat/completions",
            body.clone(),
            &[("x-prefiller-host-port", &prefiller)],
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
        let ds = d.stats();
        assert_eq!(ds.remote_decodes, 1, "the decode pulled the prefill's KV");
        assert_eq!(
            ds.http_connections, 0,
            "the decode leg made no network call"
        );
        assert_eq!(p.stats().side_channel_served, 1);

        let (stranger, accepted) = counting_listener().await;
        let refused = post(
            &url,
            "/v1/chat/completions",
            body.clone(),
            &[("x-prefiller-host-port", &stranger)],
        )
        .await;
        assert_openai_error(&refused, 400, "prefiller_not_allowed");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 0);

        let direct = post(&d.url(), "/v1/chat/completions", body, &[]).await;
        assert_eq!(a.content(), direct.content(), "same text as a direct run");
        drop(tx);
    };
    let (served, ()) = tokio::time::timeout(Duration::from_secs(30), async {
        tokio::join!(server, client)
    })
    .await
    .expect("example ran and shut down in time");
    assert!(served.is_ok(), "{:?}", served.err().map(|e| e.to_string()));
}

#[tokio::test]
async fn custom_router_example_routes_by_model() {
    let mut engines = Vec::new();
    let mut specs = Vec::new();
    for model in ["model-a", "model-b"] {
        for role in ["prefill", "decode"] {
            let e = SimEngine::start(SimConfig {
                model: model.to_owned(),
                ..SimConfig::default()
            })
            .await
            .unwrap();
            specs.push(format!("{role},{},{model}", e.url()));
            engines.push(e);
        }
    }
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = custom_router::run(listener, &specs, async {
            let _ = rx.await;
        })
        .await;
    });

    for _ in 0..3 {
        let body = serde_json::json!({"model": "model-b", "prompt": "route me", "max_tokens": 3});
        let a = post(&url, "/v1/completions", body.to_string(), &[]).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
        assert_eq!(a.json()["model"], "model-b");
    }
    let requests: Vec<u64> = engines.iter().map(|e| e.stats().requests).collect();
    assert_eq!(requests, [0, 0, 3, 3], "only model-b's engines were used");
    assert_eq!(engines[3].stats().remote_decodes, 3);
    drop(tx);
}

#[tokio::test]
async fn custom_connector_example_pins_the_side_channel_host() {
    // The prefill advertises a side-channel host nobody can resolve; the connector
    // sends the decode to the prefill URL's host instead.
    let p = SimEngine::start(SimConfig {
        advertised_host: "side-channel.invalid".to_owned(),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let d = SimEngine::start(SimConfig::default()).await.unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = oneshot::channel::<()>();
    let (pu, du) = (p.url(), d.url());
    tokio::spawn(async move {
        let _ = custom_connector::run(listener, &pu, &du, async {
            let _ = rx.await;
        })
        .await;
    });

    let a = post(
        &url,
        "/v1/chat/completions",
        chat("pin the host", 5, false),
        &[],
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
    let leg = d.requests().pop().unwrap();
    assert_eq!(leg.body["kv_transfer_params"]["remote_host"], "127.0.0.1");
    assert_eq!(d.stats().remote_decodes, 1);
    assert_eq!(p.stats().side_channel_served, 1);
    drop(tx);
}
