//! One request, one count in `queued`, through a real orchestrator: a request that
//! waited for a global permit ([`Limits`] as the admission) and is then held by the
//! [`DecodeHold`](disagg_resilience::DecodeHold) routing it is counted once, and is
//! counted waiting once at a time; so is one whose routing waits, whose attempt fails,
//! and whose retry's routing waits again; and one whose routing waits, then fails,
//! and whose decode-only fallback's routing waits again.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use disagg_connectors::vllm::VllmNixl;
use disagg_core::endpoint::{EndpointSet, InFlightGuard};
use disagg_core::error::{RouteError, TransportError};
use disagg_core::orchestrator::{OrchestratorConfig, PrefillFailure};
use disagg_core::policy::{Admission, AdmissionStats};
use disagg_core::request::Api;
use disagg_core::router::{RequestView, Route};
use disagg_core::source::{EndpointSource, StaticSource};
use disagg_core::transport::{ResponseFuture, Transport};
use disagg_core::{Endpoint, Orchestrator, PdRequest, Role, Router};
use disagg_resilience::admission::HOLD_POLL;
use disagg_resilience::{AdmissionConfig, Backoff, Limits, RetryPolicy};
use http_body_util::BodyExt;

const KV: &str = r#"{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2,3]],"remote_engine_id":"engine-7","remote_request_id":"chatcmpl-p-0a1b2c3d","remote_host":"10.0.0.5","remote_port":5600,"tp_size":1}"#;

/// A vLLM NIXL prefill on `p:1` answering with a handoff, and a decode answering.
struct Engines;

impl Transport for Engines {
    fn send(&self, req: http::Request<Bytes>) -> ResponseFuture {
        answer(&req, false)
    }
}

/// [`Engines`], whose prefill answers its call number `fail` (from 0) with a 503;
/// then `fills`, when given, is reported full by its engine.
struct FailingOnce {
    fail: usize,
    prefills: AtomicUsize,
    fills: Option<Arc<Endpoint>>,
}

impl Transport for FailingOnce {
    fn send(&self, req: http::Request<Bytes>) -> ResponseFuture {
        let prefill = req.uri().authority().map(|a| a.as_str()) == Some("p:1");
        let failed = prefill && self.prefills.fetch_add(1, Ordering::Relaxed) == self.fail;
        if let (true, Some(decode)) = (failed, &self.fills) {
            decode.set_engine_load(Some(1));
        }
        answer(&req, failed)
    }
}

/// The engines' answer to `req`: a 503 when `failed`.
fn answer(req: &http::Request<Bytes>, failed: bool) -> ResponseFuture {
    let prefill = req.uri().authority().map(|a| a.as_str()) == Some("p:1");
    let body = if failed {
        r#"{"error":{"message":"overloaded","type":"server_error"}}"#.to_owned()
    } else if prefill {
        format!(
            r#"{{"id":"chatcmpl-p","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"A"}},"finish_reason":"length"}}],"kv_transfer_params":{KV}}}"#
        )
    } else {
        r#"{"id":"chatcmpl-d","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"AB"},"finish_reason":"stop"}]}"#.to_owned()
    };
    Box::pin(async move {
        let body = http_body_util::Full::new(Bytes::from(body))
            .map_err(|never| match never {})
            .boxed();
        let mut resp = http::Response::new(body);
        if failed {
            *resp.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
        }
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        Ok::<_, TransportError>(resp)
    })
}

/// The first prefill and the first decode.
struct First;

impl Router for First {
    fn select(&self, _: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        let decode = set
            .by_role(Role::Decode)
            .first()
            .ok_or(RouteError::NoDecode)?;
        Ok(Route::new(
            set.by_role(Role::Prefill).first().cloned(),
            Arc::clone(decode),
        ))
    }
}

fn request() -> PdRequest {
    let body = Bytes::from_static(
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4}"#,
    );
    PdRequest::new(Api::Chat, http::HeaderMap::new(), &body).unwrap()
}

/// A request served on a task of its own, its answer read to the end: its status.
fn spawn_request(
    orchestrator: &Orchestrator,
) -> tokio::task::JoinHandle<Result<http::StatusCode, disagg_core::PdError>> {
    let orchestrator = orchestrator.clone();
    tokio::spawn(async move {
        let resp = orchestrator.serve(request()).await?;
        let status = resp.status();
        let _ = resp.into_body().collect().await;
        Ok(status)
    })
}

/// Lets the spawned requests run until `done` holds of the admission's stats (the
/// runtime is one thread: each yield runs the tasks that are ready).
async fn settle(limits: &Limits, done: impl Fn(AdmissionStats) -> bool) -> AdmissionStats {
    for _ in 0..1000 {
        if done(limits.stats()) {
            break;
        }
        tokio::task::yield_now().await;
    }
    limits.stats()
}

/// The request waited for the running one's permit, was admitted when that one's
/// answer was dropped, then held while the decode's engine reported it full: before,
/// `queued` counted it twice (once per wait).
#[tokio::test(start_paused = true)]
async fn a_request_admitted_after_a_wait_then_held_is_queued_once() {
    let mut config = AdmissionConfig::default();
    config.max_in_flight = Some(1);
    let limits = Limits::new(config);
    let source = StaticSource::new([
        Endpoint::new("http://p:1", Role::Prefill).unwrap(),
        Endpoint::new("http://d:1", Role::Decode).unwrap(),
    ]);
    let decode = Arc::clone(&source.snapshot().by_role(Role::Decode)[0]);
    let router = limits.decode_hold(First, 1, Duration::from_secs(60));
    let orchestrator = Orchestrator::builder(source, Engines, VllmNixl::new())
        .router(router)
        .admission(limits.clone())
        .build();

    // The first request runs: its answer, unread, holds the one permit.
    let running = orchestrator.serve(request()).await.unwrap();
    assert!(running.status().is_success(), "{}", running.status());
    // The second waits for that permit.
    let second = spawn_request(&orchestrator);
    let stats = settle(&limits, |s| s.waiting == 1).await;
    assert_eq!(
        (stats.waiting, stats.queued),
        (1, 1),
        "waits for the permit"
    );
    // The first answer is dropped, and the decode's engine reports it full (other
    // proxies' requests) before the second runs again: admitted, it is held.
    drop(running);
    decode.set_engine_load(Some(1));
    let stats = settle(&limits, |s| s.queued > 1).await;
    assert_eq!(
        (stats.waiting, stats.queued),
        (1, 1),
        "held, it is still the one request that had to wait"
    );
    // The decode frees up: it is served, counted once.
    decode.set_engine_load(Some(0));
    tokio::time::advance(HOLD_POLL).await;
    let status = second.await.unwrap().unwrap();
    assert!(status.is_success(), "{status}");
    let stats = limits.stats();
    assert_eq!(
        (
            stats.waiting,
            stats.queued,
            stats.queue_full,
            stats.queue_timeouts
        ),
        (0, 1, 0, 0)
    );
    assert_eq!(orchestrator.stats().queued, 1);
}

/// A request whose routing waits (for the decode's per-endpoint place, or held by the
/// decode hold: `router`), whose attempt then fails (its prefill answers 503), and whose
/// retry's routing waits again (another request took the decode during its backoff):
/// before, `queued` counted it once per routing that waited.
async fn a_retry_that_waits_again_is_queued_once(limits: Limits, router: impl Router) {
    let source = StaticSource::new([
        Endpoint::new("http://p:1", Role::Prefill).unwrap(),
        Endpoint::new("http://d:1", Role::Decode).unwrap(),
    ]);
    let engines = FailingOnce {
        fail: 1,
        prefills: AtomicUsize::new(0),
        fills: None,
    };
    // Seed 2 draws a backoff of 17 ms (of the base 20 ms): the retry waits for it.
    let orchestrator = Orchestrator::builder(source, engines, VllmNixl::new())
        .router(router)
        .admission(limits.clone())
        .retry(Backoff::with_seed(RetryPolicy::retries(1), 2))
        .build();

    // The first request runs: its answer, unread, holds the decode.
    let running = orchestrator.serve(request()).await.unwrap();
    assert!(running.status().is_success(), "{}", running.status());
    // The second waits for it in its routing: counted once.
    let second = spawn_request(&orchestrator);
    let stats = settle(&limits, |s| s.waiting == 1).await;
    assert_eq!(
        (stats.waiting, stats.queued),
        (1, 1),
        "waits in its routing"
    );
    // The decode frees up: it is routed, its prefill answers 503, and it backs off.
    drop(running);
    tokio::time::advance(HOLD_POLL).await;
    for _ in 0..1000 {
        if orchestrator.stats().retries == 1 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(orchestrator.stats().retries, 1, "retrying");
    // Meanwhile a third request takes the decode, and keeps it.
    let third = orchestrator.serve(request()).await.unwrap();
    assert!(third.status().is_success(), "{}", third.status());
    // The retry's routing waits again: it is still the one request that had to wait.
    tokio::time::advance(Duration::from_secs(1)).await;
    let stats = settle(&limits, |s| s.waiting == 1).await;
    assert_eq!(
        (stats.waiting, stats.queued),
        (1, 1),
        "its retry waits, counted once"
    );
    drop(third);
    tokio::time::advance(HOLD_POLL).await;
    let status = second.await.unwrap().unwrap();
    assert!(status.is_success(), "{status}");
    let stats = limits.stats();
    assert_eq!(
        (
            stats.waiting,
            stats.queued,
            stats.queue_full,
            stats.queue_timeouts
        ),
        (0, 1, 0, 0)
    );
    assert_eq!(orchestrator.stats().queued, 1);
}

#[tokio::test(start_paused = true)]
async fn a_retry_that_waits_again_for_a_per_endpoint_place_is_queued_once() {
    let limits = Limits::new(AdmissionConfig::default());
    let router = limits.per_endpoint(First, 1);
    a_retry_that_waits_again_is_queued_once(limits, router).await;
}

#[tokio::test(start_paused = true)]
async fn a_retry_held_again_by_the_decode_hold_is_queued_once() {
    let limits = Limits::new(AdmissionConfig::default());
    let router = limits.decode_hold(First, 1, Duration::from_secs(60));
    a_retry_that_waits_again_is_queued_once(limits, router).await;
}

/// A request held by the decode hold, whose prefill then answers 503 (and the decode's
/// engine reports it full), served decode-only as configured: the fallback's routing is
/// held again. Before, `queued` counted it a second time.
#[tokio::test(start_paused = true)]
async fn a_decode_only_fallback_held_again_is_queued_once() {
    let limits = Limits::new(AdmissionConfig::default());
    let source = StaticSource::new([
        Endpoint::new("http://p:1", Role::Prefill).unwrap(),
        Endpoint::new("http://d:1", Role::Decode).unwrap(),
    ]);
    let decode = Arc::clone(&source.snapshot().by_role(Role::Decode)[0]);
    let engines = FailingOnce {
        fail: 1,
        prefills: AtomicUsize::new(0),
        fills: Some(Arc::clone(&decode)),
    };
    let mut config = OrchestratorConfig::default();
    config.prefill_failure = PrefillFailure::DecodeOnly;
    let orchestrator = Orchestrator::builder(source, engines, VllmNixl::new())
        .router(limits.decode_hold(First, 1, Duration::from_secs(60)))
        .admission(limits.clone())
        .config(config)
        .build();

    // The first request runs: its answer, unread, holds the decode.
    let running = orchestrator.serve(request()).await.unwrap();
    assert!(running.status().is_success(), "{}", running.status());
    // The second is held: counted once.
    let second = spawn_request(&orchestrator);
    let stats = settle(&limits, |s| s.waiting == 1).await;
    assert_eq!((stats.waiting, stats.queued), (1, 1), "held");
    // The decode frees up: it is routed, its prefill answers 503 and the decode's
    // engine reports it full: the decode-only fallback is held.
    drop(running);
    tokio::time::advance(HOLD_POLL).await;
    for _ in 0..1000 {
        if orchestrator.stats().prefill_fallbacks == 1 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(orchestrator.stats().prefill_fallbacks, 1, "falling back");
    let stats = settle(&limits, |s| s.queued > 1).await;
    assert_eq!(
        (stats.waiting, stats.queued),
        (1, 1),
        "the fallback is held, counted once"
    );
    decode.set_engine_load(Some(0));
    tokio::time::advance(HOLD_POLL).await;
    let status = second.await.unwrap().unwrap();
    assert!(status.is_success(), "{status}");
    let stats = limits.stats();
    assert_eq!(
        (
            stats.waiting,
            stats.queued,
            stats.queue_full,
            stats.queue_timeouts
        ),
        (0, 1, 0, 0)
    );
}

/// [`First`], except its routing number `fail` (from 0): it finds no prefill, and
/// meanwhile another request starts on the decode `fills` (held in `taken` until the
/// test gives it back).
struct NoPrefillOnce {
    fail: usize,
    calls: AtomicUsize,
    fills: Arc<Endpoint>,
    taken: std::sync::Mutex<Option<InFlightGuard>>,
}

impl Router for NoPrefillOnce {
    fn select(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        if self.calls.fetch_add(1, Ordering::Relaxed) == self.fail {
            *self.taken.lock().unwrap() = Some(self.fills.track());
            return Err(RouteError::NoPrefill);
        }
        First.select(req, set)
    }
}

/// A request whose routing waits (for the decode's per-endpoint place, or held by the
/// decode hold: `wrap` around the inner router), whose routing then fails (no prefill
/// left) while another request takes the decode, served decode-only as configured:
/// the fallback's routing waits again. Before, the failed routing's error did not say
/// that it had made the request wait, and `queued` counted it a second time.
///
/// `fail`: the inner router's call that finds no prefill, the first after the wait
/// (the running request's routing is call 0; a per-endpoint limit looks twice before
/// it waits).
async fn a_fallback_after_a_routing_that_waited_then_failed_is_queued_once<W: Router>(
    limits: Limits,
    fail: usize,
    wrap: impl FnOnce(Arc<NoPrefillOnce>) -> W,
) {
    let source = StaticSource::new([
        Endpoint::new("http://p:1", Role::Prefill).unwrap(),
        Endpoint::new("http://d:1", Role::Decode).unwrap(),
    ]);
    let prefill = Arc::clone(&source.snapshot().by_role(Role::Prefill)[0]);
    let decode = Arc::clone(&source.snapshot().by_role(Role::Decode)[0]);
    let inner = Arc::new(NoPrefillOnce {
        fail,
        calls: AtomicUsize::new(0),
        fills: Arc::clone(&decode),
        taken: std::sync::Mutex::new(None),
    });
    let router = Arc::new(wrap(Arc::clone(&inner)));
    let mut config = OrchestratorConfig::default();
    config.prefill_failure = PrefillFailure::DecodeOnly;
    let orchestrator = Orchestrator::builder(source, Engines, VllmNixl::new())
        .router(Arc::clone(&router))
        .admission(limits.clone())
        .config(config)
        .build();

    // The first request runs: its answer, unread, holds the decode.
    let running = orchestrator.serve(request()).await.unwrap();
    assert!(running.status().is_success(), "{}", running.status());
    // The second waits in its routing: counted once.
    let second = spawn_request(&orchestrator);
    let stats = settle(&limits, |s| s.waiting == 1).await;
    assert_eq!(
        (stats.waiting, stats.queued),
        (1, 1),
        "waits in its routing"
    );
    assert!(
        inner.taken.lock().unwrap().is_none(),
        "its routing has not failed yet"
    );
    // The decode frees up: the routing finds no prefill, and another request takes the
    // decode meanwhile. The decode-only fallback's routing waits for it.
    drop(running);
    tokio::time::advance(HOLD_POLL).await;
    for _ in 0..1000 {
        if orchestrator.stats().prefill_fallbacks == 1 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(orchestrator.stats().prefill_fallbacks, 1, "falling back");
    let stats = settle(&limits, |s| s.waiting == 1 && s.queued > 1).await;
    assert_eq!(
        (stats.waiting, stats.queued),
        (1, 1),
        "the fallback waits, counted once"
    );
    // The other request ends (a leg's place given back wakes a per-endpoint wait; the
    // hold looks again after its poll): the fallback is served decode-only.
    drop(inner.taken.lock().unwrap().take());
    let pick = || -> Result<Arc<Endpoint>, disagg_core::PdError> { Ok(Arc::clone(&prefill)) };
    drop(router.place(&pick, None).await.unwrap());
    tokio::time::advance(HOLD_POLL).await;
    let status = second.await.unwrap().unwrap();
    assert!(status.is_success(), "{status}");
    let stats = limits.stats();
    assert_eq!(
        (
            stats.waiting,
            stats.queued,
            stats.queue_full,
            stats.queue_timeouts
        ),
        (0, 1, 0, 0)
    );
    assert_eq!(orchestrator.stats().queued, 1);
}

#[tokio::test(start_paused = true)]
async fn a_fallback_after_a_held_routing_that_failed_is_queued_once() {
    let limits = Limits::new(AdmissionConfig::default());
    let hold = limits.clone();
    a_fallback_after_a_routing_that_waited_then_failed_is_queued_once(limits, 1, move |inner| {
        hold.decode_hold(inner, 1, Duration::from_secs(60))
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_fallback_after_a_per_endpoint_wait_that_failed_is_queued_once() {
    let limits = Limits::new(AdmissionConfig::default());
    let limit = limits.clone();
    a_fallback_after_a_routing_that_waited_then_failed_is_queued_once(limits, 3, move |inner| {
        limit.per_endpoint(inner, 1)
    })
    .await;
}
