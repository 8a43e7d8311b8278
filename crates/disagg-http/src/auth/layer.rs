//! [`ApiKeyLayer`]: the key check as a tower layer, and the body that holds a key's
//! in-flight place until the answer ends.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::AUTHORIZATION;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};

use disagg_core::Orchestrator;
use disagg_core::outcome::Delivery;

use super::ApiKeys;
use super::limits::InFlightSlot;
use crate::routed::{RouteKind, RouteListeners, RouteSummary};
use crate::tap::{Hooks, Tap};

// === ApiKeyLayer ===

/// Which keys a path needs.
#[derive(Debug)]
struct Policy {
    /// Client keys for every path but the open ones; `None`: no client key needed.
    clients: Option<ApiKeys>,
    /// Keys for `/metrics`; `None`: `/metrics` is as open as `open` says.
    metrics: Option<ApiKeys>,
    /// Paths open to anyone.
    open: Vec<String>,
}

impl Policy {
    /// The keys a request on `path` needs, decided on its normal form
    /// ([`crate::path::normalize`], as the service routes it: `//metrics` is `/metrics`).
    /// A model card's id with an encoded `/` (`/v1/models/org%2Fmodel`) needs what the
    /// plain spelling needs, as the service answers it as that; any other path with no
    /// normal form needs what the most guarded path needs (the service refuses it).
    fn keys_for(&self, path: &str) -> Option<&ApiKeys> {
        let path = match crate::path::normalize(path) {
            Ok(p) => p,
            Err(err) => {
                return match crate::path::escaped_model_card(path, err) {
                    Some(card) => self.keys_for(&card.plain),
                    None => self.clients.as_ref().or(self.metrics.as_ref()),
                };
            }
        };
        let path = &*path;
        if path == "/metrics"
            && let Some(m) = &self.metrics
        {
            return Some(m);
        }
        if self.open.iter().any(|p| p == path) {
            return None;
        }
        self.clients.as_ref()
    }
}

/// A tower layer that checks API keys (and their limits) before the inner service
/// sees a request: see the [module documentation](super).
#[derive(Debug, Clone)]
pub struct ApiKeyLayer {
    policy: Arc<Policy>,
    /// Who hears of each refusal ([`ApiKeyLayer::tell_refusals`]).
    refusals: Option<(Orchestrator, RouteListeners)>,
}

impl ApiKeyLayer {
    /// Every path needs one of `keys`, except `/health` and `/metrics`.
    pub fn new(keys: ApiKeys) -> Self {
        ApiKeyLayer {
            policy: Arc::new(Policy {
                clients: Some(keys),
                metrics: None,
                open: vec!["/health".to_owned(), "/metrics".to_owned()],
            }),
            refusals: None,
        }
    }

    /// Only `/metrics` needs a key, one of `keys`; every other path is open.
    pub fn metrics_only(keys: ApiKeys) -> Self {
        ApiKeyLayer {
            policy: Arc::new(Policy {
                clients: None,
                metrics: Some(keys),
                open: Vec::new(),
            }),
            refusals: None,
        }
    }

    /// `/metrics` needs one of `keys` (a scraper's; the client keys do not open it).
    pub fn metrics_keys(self, keys: ApiKeys) -> Self {
        self.map_policy(|p| p.metrics = Some(keys))
    }

    /// `path` is open to anyone, like `/health` (in its normal form,
    /// [`crate::path::normalize`], as requests are compared).
    pub fn open_path(self, path: impl Into<String>) -> Self {
        let path = path.into();
        let path = match crate::path::normalize(&path) {
            Ok(std::borrow::Cow::Owned(normal)) => normal,
            _ => path,
        };
        self.map_policy(|p| p.open.push(path))
    }

    /// Every request refused here (401, 429) is told to `listeners` as a
    /// [`RouteKind::KeyRefused`] [`RouteSummary`], traced as `orchestrator` traces
    /// ([`Orchestrator::route_trace`]): in `disagg_requests_total{route="key_refused"}`
    /// and the access log when they listen (give the service's
    /// [`PdServiceConfig::route_listeners`](crate::PdServiceConfig::route_listeners)).
    /// Without it, refusals are counted only by the keys' own metrics.
    pub fn tell_refusals(mut self, orchestrator: Orchestrator, listeners: RouteListeners) -> Self {
        self.refusals = Some((orchestrator, listeners));
        self
    }

    fn map_policy(self, f: impl FnOnce(&mut Policy)) -> Self {
        let mut policy = Policy {
            clients: self.policy.clients.clone(),
            metrics: self.policy.metrics.clone(),
            open: self.policy.open.clone(),
        };
        f(&mut policy);
        ApiKeyLayer {
            policy: Arc::new(policy),
            refusals: self.refusals,
        }
    }
}

impl<S> tower::Layer<S> for ApiKeyLayer {
    type Service = ApiKeyService<S>;

    fn layer(&self, inner: S) -> ApiKeyService<S> {
        ApiKeyService {
            inner,
            policy: Arc::clone(&self.policy),
            refusals: self.refusals.clone(),
        }
    }
}

/// The service of [`ApiKeyLayer`].
#[derive(Debug, Clone)]
pub struct ApiKeyService<S> {
    inner: S,
    policy: Arc<Policy>,
    refusals: Option<(Orchestrator, RouteListeners)>,
}

impl<S, B, RB> tower::Service<Request<B>> for ApiKeyService<S>
where
    S: tower::Service<Request<B>, Response = Response<RB>>,
    RB: Body<Data = Bytes>,
{
    type Response = Response<KeyBody<RB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> ResponseFuture<S::Future> {
        let Some(keys) = self.policy.keys_for(req.uri().path()) else {
            return ResponseFuture::called(self.inner.call(req), None);
        };
        match keys.check(req.headers().get(AUTHORIZATION)) {
            Ok(admitted) => {
                req.extensions_mut().insert(admitted.id);
                ResponseFuture::called(self.inner.call(req), admitted.slot)
            }
            Err(refusal) => {
                let response = refusal.to_response();
                if let Some((orchestrator, listeners)) = &self.refusals {
                    let arrival = tokio::time::Instant::now().into_std();
                    let mut summary = RouteSummary::new(
                        RouteKind::KeyRefused,
                        req.method().clone(),
                        req.uri().path(),
                        arrival,
                    );
                    summary.request_id = req.headers().get("x-request-id").cloned();
                    summary.trace = orchestrator.route_trace(req.headers());
                    summary.bytes = response.body().len() as u64;
                    summary.ended(response.status(), Delivery::Complete);
                    listeners.tell(&summary);
                }
                ResponseFuture::refused(response)
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// The future of [`ApiKeyService`]: the inner service's answer with the key's
    /// in-flight place moved into its body, or the refusal.
    pub struct ResponseFuture<F> {
        #[pin]
        state: State<F>,
    }
}

pin_project_lite::pin_project! {
    #[project = StateProj]
    enum State<F> {
        Called {
            #[pin]
            future: F,
            slot: Option<InFlightSlot>,
        },
        Refused {
            response: Option<Response<Bytes>>,
        },
    }
}

impl<F> ResponseFuture<F> {
    fn called(future: F, slot: Option<InFlightSlot>) -> Self {
        ResponseFuture {
            state: State::Called { future, slot },
        }
    }

    fn refused(response: Response<Bytes>) -> Self {
        ResponseFuture {
            state: State::Refused {
                response: Some(response),
            },
        }
    }
}

impl<F> fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<F, RB, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<RB>, E>>,
{
    type Output = Result<Response<KeyBody<RB>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Called { future, slot } => {
                let resp = std::task::ready!(future.poll(cx))?;
                let slot = slot.take();
                Poll::Ready(Ok(resp.map(|body| KeyBody {
                    inner: Inner::Served {
                        body: Tap::new(body, FreesSlot(slot)),
                    },
                })))
            }
            StateProj::Refused { response } => {
                // Polled again after it completed: an empty answer rather than a panic.
                let resp = response.take().unwrap_or_default();
                Poll::Ready(Ok(resp.map(|bytes| KeyBody {
                    inner: Inner::Refused { bytes: Some(bytes) },
                })))
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// The response body of [`ApiKeyService`]: the inner service's body, holding the
    /// key's in-flight place until it ends or is dropped, or a refusal's error body.
    pub struct KeyBody<B> {
        #[pin]
        inner: Inner<B>,
    }
}

pin_project_lite::pin_project! {
    #[project = InnerProj]
    enum Inner<B> {
        Served {
            #[pin]
            body: Tap<B, FreesSlot>,
        },
        Refused {
            bytes: Option<Bytes>,
        },
    }
}

/// A served answer's hooks: the key's in-flight place, freed when the answer is over
/// (not when the connection gets round to dropping the body).
pub(super) struct FreesSlot(Option<InFlightSlot>);

impl<B: Body> Hooks<B> for FreesSlot {
    fn end(&mut self) {
        self.0.take();
    }
}

impl<B> fmt::Debug for KeyBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyBody").finish_non_exhaustive()
    }
}

impl<B> Body for KeyBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().inner.project() {
            InnerProj::Served { body } => body.poll_frame(cx),
            InnerProj::Refused { bytes } => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Served { body } => body.is_end_stream(),
            Inner::Refused { bytes } => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Served { body } => body.size_hint(),
            Inner::Refused { bytes } => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_guarded_in_their_normal_form() {
        let clients = ApiKeys::new(["sk-client"]).unwrap();
        let metrics = ApiKeys::new(["sk-metrics"]).unwrap();
        let layer = ApiKeyLayer::new(clients).metrics_keys(metrics);
        let p = &layer.policy;
        let needs = |path: &str| p.keys_for(path).map(std::ptr::from_ref);
        let (client, scraper) = (needs("/v1/models"), needs("/metrics"));
        assert!(client.is_some() && scraper.is_some() && client != scraper);
        for spelling in ["//metrics", "/%6detrics", "/./metrics", "/v1/../metrics"] {
            assert_eq!(needs(spelling), scraper, "{spelling}");
        }
        for spelling in ["/health", "//health", "/%68ealth", "/v1/../health"] {
            assert_eq!(needs(spelling), None, "{spelling}");
        }
        // No normal form: a client key, whatever it resembles.
        for spelling in ["/health%00", "/../health", "/metrics%2F", "/%zz"] {
            assert_eq!(needs(spelling), client, "{spelling}");
        }
        let opened = ApiKeyLayer::new(ApiKeys::new(["sk-a"]).unwrap()).open_path("//ping/.");
        assert!(opened.policy.keys_for("/ping/").is_none());
    }

    #[test]
    fn an_escaped_model_card_id_is_guarded_as_its_plain_spelling() {
        let clients = ApiKeys::new(["sk-client"]).unwrap();
        let metrics = ApiKeys::new(["sk-metrics"]).unwrap();
        let layers = [
            ApiKeyLayer::metrics_only(metrics.clone()),
            ApiKeyLayer::new(clients.clone()),
            ApiKeyLayer::new(clients).metrics_keys(metrics),
            ApiKeyLayer::new(ApiKeys::new(["sk-a"]).unwrap()).open_path("/v1/models/org/model"),
        ];
        for layer in layers {
            let p = &layer.policy;
            let needs = |path: &str| p.keys_for(path).map(std::ptr::from_ref);
            let plain = needs("/v1/models/org/model");
            for escaped in ["/v1/models/org%2Fmodel", "/v1/models/org%2fmodel"] {
                assert_eq!(needs(escaped), plain, "{escaped}: {layer:?}");
            }
        }
        // Only a model card's id: anything else with no normal form needs the most.
        let layer = ApiKeyLayer::metrics_only(ApiKeys::new(["sk-metrics"]).unwrap());
        for path in [
            "/v1/models/org%2F..%2Fx",
            "/v1/models%2Fx",
            "/v1/models/a%2F%2Fb",
        ] {
            assert!(layer.policy.keys_for(path).is_some(), "{path}");
        }
    }
}
