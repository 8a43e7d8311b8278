//! The order in which a prefill exchange gives back what it holds, through a real
//! orchestrator: its endpoint's in-flight count first, then the router's hold on the leg
//! ([`Route::with_holds`]). A [`PerEndpointLimit`](disagg_resilience::PerEndpointLimit)
//! wakes the requests waiting for room when a hold is given back; a request woken
//! while the count is still up finds no room and waits for another leg's end.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use disagg_connectors::vllm::VllmNixl;
use disagg_core::endpoint::EndpointSet;
use disagg_core::error::{RouteError, TransportError};
use disagg_core::policy::Permit;
use disagg_core::request::Api;
use disagg_core::router::{RequestView, Route};
use disagg_core::source::StaticSource;
use disagg_core::transport::{ResponseFuture, Transport};
use disagg_core::{Endpoint, Orchestrator, PdRequest, Role, Router};
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

/// A hold that notes its endpoint's in-flight count when it is given back.
struct Probe {
    endpoint: Arc<Endpoint>,
    seen: Arc<Mutex<Vec<usize>>>,
}

impl Drop for Probe {
    fn drop(&mut self) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.push(self.endpoint.in_flight());
    }
}

/// The first prefill and decode, the prefill leg holding a [`Probe`].
struct Probing {
    seen: Arc<Mutex<Vec<usize>>>,
}

impl Router for Probing {
    fn select(&self, _: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        let decode = set
            .by_role(Role::Decode)
            .first()
            .ok_or(RouteError::NoDecode)?;
        let prefill = set.by_role(Role::Prefill).first().cloned();
        let hold = prefill.as_ref().map(|p| {
            Permit::new(Probe {
                endpoint: Arc::clone(p),
                seen: Arc::clone(&self.seen),
            })
        });
        Ok(Route::new(prefill, Arc::clone(decode)).with_holds(hold, None))
    }
}

#[tokio::test]
async fn a_prefill_exchange_lowers_its_in_flight_count_before_giving_its_hold_back() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let source = StaticSource::new([
        Endpoint::new("http://p:1", Role::Prefill).unwrap(),
        Endpoint::new("http://d:1", Role::Decode).unwrap(),
    ]);
    let orchestrator = Orchestrator::builder(source, Engines, VllmNixl::new())
        .router(Probing {
            seen: Arc::clone(&seen),
        })
        .build();
    let body = Bytes::from_static(
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4}"#,
    );
    let req = PdRequest::new(Api::Chat, http::HeaderMap::new(), &body).unwrap();
    let resp = orchestrator.serve(req).await.unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
    resp.into_body().collect().await.unwrap();
    let seen = seen.lock().unwrap_or_else(|e| e.into_inner()).clone();
    assert_eq!(
        seen,
        [0],
        "the prefill's count was down when its hold was given back"
    );
}
