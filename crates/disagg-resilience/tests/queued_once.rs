//! One request, one count in `queued`, through a real orchestrator: a request that
//! waited for a global permit ([`Limits`] as the admission) and is then held by the
//! [`DecodeHold`](disagg_resilience::DecodeHold) routing it is counted once, and is
//! counted waiting once at a time.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use disagg_connectors::vllm::VllmNixl;
use disagg_core::endpoint::EndpointSet;
use disagg_core::error::{RouteError, TransportError};
use disagg_core::policy::{Admission, AdmissionStats};
use disagg_core::request::Api;
use disagg_core::router::{RequestView, Route};
use disagg_core::source::{EndpointSource, StaticSource};
use disagg_core::transport::{ResponseFuture, Transport};
use disagg_core::{Endpoint, Orchestrator, PdRequest, Role, Router};
use disagg_resilience::admission::HOLD_POLL;
use disagg_resilience::{AdmissionConfig, Limits};
use http_body_util::BodyExt;

const KV: &str = r#"{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2,3]],"remote_engine_id":"engine-7","remote_request_id":"chatcmpl-p-0a1b2c3d","remote_host":"10.0.0.5","remote_port":5600,"tp_size":1}"#;

/// A vLLM NIXL prefill on `p:1` answering with a handoff, and a decode answering.
struct Engines;

impl Transport for Engines {
    fn send(&self, req: http::Request<Bytes>) -> ResponseFuture {
        let prefill = req.uri().authority().map(|a| a.as_str()) == Some("p:1");
        let body = if prefill {
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
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            Ok::<_, TransportError>(resp)
        })
    }
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
    let second = tokio::spawn({
        let orchestrator = orchestrator.clone();
        async move {
            let resp = orchestrator.serve(request()).await?;
            let status = resp.status();
            let _ = resp.into_body().collect().await;
            Ok::<_, disagg_core::PdError>(status)
        }
    });
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
