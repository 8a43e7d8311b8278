//! [`PdLayer`]: P/D disaggregation as a tower layer in front of any HTTP service.
//!
//! The layer takes `POST /v1/chat/completions` and `POST /v1/completions` (the paths
//! can be changed with [`PdLayer::paths`]) through the [`Orchestrator`]; every other
//! request reaches the inner service as it came (body, headers and extensions), so an
//! engine or an app keeps its own `/health`, `/metrics` and `/v1/models` (in sidecar
//! mode less the headers the engines read as where or as what a request runs,
//! `x-data-parallel-rank` and SGLang's `x-override-*`, which no leg takes from a client
//! either).
//!
//! The path is normalised first ([`crate::path::normalize`]): the layer matches the
//! normal path, and the inner service receives it (the query as it came), so
//! `/v1/chat//completions` is orchestrated like `/v1/chat/completions` and never served
//! by the inner service behind P/D's back. A path with no one meaning (an encoded `/`,
//! `%00`, a `..` above the root) is answered 400 `invalid_path` and reaches neither,
//! but for a model card's id with an encoded `/` (`GET /v1/models/org%2Fmodel`, as SDKs
//! escape an id), which reaches the inner service as it came, as
//! `/v1/models/org/model` does. The layer's own refusals (that 400, a refused
//! prefiller header, a compressed body on an orchestrated route: 415
//! `unsupported_content_encoding`, as [`PdService`] answers it) are summarized to its
//! [`PdServiceConfig::route_listeners`](crate::PdServiceConfig::route_listeners) as
//! [`RouteKind::Refused`](crate::routed::RouteKind::Refused).
//!
//! | mode | prefill leg | decode leg | built with |
//! |---|---|---|---|
//! | gateway | a remote endpoint chosen by the router | a remote endpoint chosen by the router | [`PdLayer::gateway`] |
//! | sidecar | a remote prefill endpoint: named by an upstream scheduler in a header, or picked from a pool | the inner service itself, called in process with the handoff fields | [`PdLayer::sidecar`] |
//!
//! Completion requests are handled exactly as [`PdService`] handles them (the client
//! body's limits of size, time and memory from [`crate::body`], OpenAI-format errors,
//! streaming). A P/D failure is an OpenAI error response, never a
//! service error, so the layered service keeps the inner service's error type and fits
//! axum's routers (which need `Error: Into<Infallible>`) and
//! `tower::ServiceBuilder` stacks next to timeouts, concurrency limits and tracing.
//!
//! # Sidecar mode
//!
//! The sidecar's parts (its mode, the prefiller header's check, its router and its
//! in-process transport to the inner service) are in [`sidecar`].
//!
//! # Examples
//!
//! Gateway mode in front of a service that keeps its own `/health`:
//!
//! ```
//! use std::convert::Infallible;
//! use disagg_core::{Endpoint, Orchestrator, Role, source::StaticSource};
//! use disagg_connectors::vllm::VllmNixl;
//! use disagg_http::{HttpTransport, PdLayer};
//! use http_body_util::Full;
//! use tower::ServiceBuilder;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let source = StaticSource::new([
//!     Endpoint::new("http://10.0.0.5:8100", Role::Prefill)?,
//!     Endpoint::new("http://10.0.0.7:8200", Role::Decode)?,
//! ]);
//! let orchestrator = Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new()).build();
//! let app = tower::service_fn(|_req: http::Request<hyper::body::Incoming>| async {
//!     Ok::<_, Infallible>(http::Response::new(Full::new(bytes::Bytes::from("ok"))))
//! });
//! let service = ServiceBuilder::new()
//!     .layer(PdLayer::gateway(orchestrator))
//!     .service(app);
//! # let _ = service;
//! # Ok(())
//! # }
//! ```
//!
//! Sidecar mode in front of a local decode engine, with prefill engines named by the
//! scheduler (or picked round robin when it names none):
//!
//! ```
//! use disagg_core::{Endpoint, Role, source::StaticSource};
//! use disagg_http::PdLayer;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let prefill_pool = StaticSource::new([
//!     Endpoint::new("http://10.0.0.5:8100", Role::Prefill)?,
//!     Endpoint::new("http://10.0.0.6:8100", Role::Prefill)?,
//! ]);
//! let layer = PdLayer::sidecar(prefill_pool);
//! // axum: `Router::new().route(...).layer(layer)`; tower: `ServiceBuilder::new().layer(layer)`.
//! # let _ = layer;
//! # Ok(())
//! # }
//! ```
//!
//! The guide, [`guide`], says which mode fits which deployment, with the way of a
//! request in each drawn.
//!
//! [`HttpTransport`]: crate::HttpTransport

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use disagg_core::error::BoxError;
use disagg_core::{Orchestrator, orchestrator::PdBody, request::Api};
use http::{Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::Either;
use tower::{Layer, Service};

use crate::error::error_response;
use crate::{PdService, PdServiceConfig};

pub mod sidecar;

pub use sidecar::{LOCAL_DECODE_URL, PREFILLER_HEADER, Sidecar};
pub mod guide {
    //! The embedding guide (`docs/embedding.md`).
    #![doc = include_str!("../docs/embedding.md")]
}

/// The gateway mode of [`PdLayer`]: both legs go to remote endpoints through the
/// orchestrator as it was built.
#[derive(Debug, Clone)]
pub struct Gateway {
    orchestrator: Orchestrator,
}

/// The request paths a layer orchestrates, each with its API.
type Paths = Arc<[(Box<str>, Api)]>;

fn default_paths() -> Paths {
    [Api::Chat, Api::Completions]
        .into_iter()
        .map(|api| (Box::from(api.path()), api))
        .collect()
}

/// A tower [`Layer`] that serves chat and completion requests disaggregated and passes
/// every other request to the inner service. See the [module docs](self).
///
/// `M` is the mode: [`Gateway`] or [`Sidecar`].
#[derive(Debug, Clone)]
pub struct PdLayer<M = Gateway> {
    mode: M,
    paths: Paths,
    service: PdServiceConfig,
}

impl<M> PdLayer<M> {
    /// Orchestrate `POST` requests on these paths, each served as its API, instead of
    /// `/v1/chat/completions` and `/v1/completions`. The legs (the local decode
    /// included) still use the standard path of the API.
    ///
    /// # Examples
    ///
    /// ```
    /// # use disagg_core::{request::Api, Endpoint, Role, source::StaticSource};
    /// # use disagg_http::PdLayer;
    /// # let source = StaticSource::new([Endpoint::new("http://10.0.0.5:8100", Role::Prefill).unwrap()]);
    /// let layer = PdLayer::sidecar(source).paths([
    ///     ("/openai/v1/chat/completions", Api::Chat),
    ///     ("/openai/v1/completions", Api::Completions),
    /// ]);
    /// # let _ = layer;
    /// ```
    pub fn paths<P: Into<String>>(mut self, paths: impl IntoIterator<Item = (P, Api)>) -> Self {
        // Requests are matched in their normal form: so are the paths given.
        self.paths = paths
            .into_iter()
            .map(|(p, api)| {
                let p = p.into();
                let p = match crate::path::normalize(&p) {
                    Ok(std::borrow::Cow::Owned(normal)) => normal,
                    _ => p,
                };
                (p.into_boxed_str(), api)
            })
            .collect();
        self
    }

    /// Use `config` (body limits, timeout and budget) for the orchestrated requests.
    pub fn service_config(mut self, config: PdServiceConfig) -> Self {
        self.service = config;
        self
    }
}

impl PdLayer<Gateway> {
    /// Gateway mode: both legs go to remote endpoints chosen by `orchestrator`'s router,
    /// through its transport.
    pub fn gateway(orchestrator: Orchestrator) -> Self {
        PdLayer {
            mode: Gateway { orchestrator },
            paths: default_paths(),
            service: PdServiceConfig::default(),
        }
    }
}

// === impl Layer ===

impl<S> Layer<S> for PdLayer<Gateway> {
    type Service = PdMiddleware<S>;

    fn layer(&self, inner: S) -> PdMiddleware<S> {
        PdMiddleware {
            inner,
            pd: PdService::with_config(self.mode.orchestrator.clone(), self.service.clone()),
            paths: Arc::clone(&self.paths),
            prefiller: None,
        }
    }
}

// === impl PdMiddleware ===

/// The service [`PdLayer`] makes of an inner service `S`: orchestrated requests go
/// through a [`PdService`], all others to `S` as they came.
///
/// `Clone + Send + Sync` when `S` is; its error type is `S`'s (P/D failures are
/// OpenAI-format responses).
#[derive(Clone)]
pub struct PdMiddleware<S> {
    inner: S,
    pd: PdService,
    paths: Paths,
    /// Sidecar mode: the prefiller header and its check.
    prefiller: Option<Arc<sidecar::PrefillerCheck>>,
}

impl<S> fmt::Debug for PdMiddleware<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PdMiddleware")
            .field("pd", &self.pd)
            .field("paths", &self.paths)
            .field("sidecar", &self.prefiller.is_some())
            .finish_non_exhaustive()
    }
}

impl<S> PdMiddleware<S> {
    /// The service that answers orchestrated requests (its orchestrator, in sidecar
    /// mode, is the one built around the inner service).
    pub fn pd_service(&self) -> &PdService {
        &self.pd
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    fn api(&self, method: &Method, path: &str) -> Option<Api> {
        if method != Method::POST {
            return None;
        }
        self.paths
            .iter()
            .find(|(p, _)| &**p == path)
            .map(|(_, api)| *api)
    }
}

impl<S, B, RB> Service<Request<B>> for PdMiddleware<S>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    RB: Body<Data = Bytes>,
    RB::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<RB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        // The instance made ready is the one called (or dropped, which releases whatever
        // it reserved in `poll_ready`); a clone takes its place for the next request.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        // One path for the decision and for the inner service (`crate::path`): an oddly
        // spelled chat route is orchestrated, never served by the inner service alone.
        if let Err(err) = crate::path::normalize_request(&mut req) {
            // A model card's id with an encoded `/` goes where its plain spelling goes
            // (the service inside), as it came; any other such path goes nowhere.
            let card = crate::path::escaped_model_card(req.uri().path(), err)
                .is_some_and(|c| self.api(req.method(), &c.plain).is_none());
            if !card {
                drop(inner);
                let resp = self.pd.refused(&req, crate::service::invalid_path(err));
                return ResponseFuture::pd(std::future::ready(resp));
            }
        }
        let Some(api) = self.api(req.method(), req.uri().path()) else {
            if let Some(check) = &self.prefiller {
                // Sidecar: the inner service is the decode engine, which must not take
                // from a client what only P/D may tell it, on any route.
                req.headers_mut().remove(&check.header);
                sidecar::strip_engine_directives(req.headers_mut());
            }
            return ResponseFuture::inner(inner.call(req));
        };
        drop(inner);
        if let Some(check) = &self.prefiller {
            let set = self.pd.orchestrator().source().snapshot();
            if let Err(e) = check.resolve(req.headers(), &set) {
                tracing::warn!(error = %e, "prefiller header refused");
                let resp = error_response(
                    StatusCode::BAD_REQUEST,
                    &e.to_string(),
                    "invalid_request_error",
                    e.code(),
                );
                let resp = self.pd.refused(&req, resp);
                return ResponseFuture::pd(std::future::ready(resp));
            }
        }
        // In sidecar mode the validated header stays in the orchestrator's copy of the
        // headers, where the sidecar's router reads it; no leg forwards it.
        ResponseFuture::pd(self.pd.completion(api, req))
    }
}

// === impl ResponseFuture ===

pin_project_lite::pin_project! {
    /// The future of [`PdMiddleware`]'s `call`.
    pub struct ResponseFuture<F> {
        #[pin]
        kind: Kind<F>,
    }
}

pin_project_lite::pin_project! {
    #[project = KindProj]
    enum Kind<F> {
        Inner { #[pin] fut: F },
        Pd { fut: Pin<Box<dyn Future<Output = Response<PdBody>> + Send>> },
    }
}

impl<F> ResponseFuture<F> {
    fn inner(fut: F) -> Self {
        ResponseFuture {
            kind: Kind::Inner { fut },
        }
    }

    fn pd(fut: impl Future<Output = Response<PdBody>> + Send + 'static) -> Self {
        ResponseFuture {
            kind: Kind::Pd { fut: Box::pin(fut) },
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
    type Output = Result<Response<ResponseBody<RB>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Inner { fut } => fut.poll(cx).map_ok(|resp| resp.map(Either::Left)),
            KindProj::Pd { fut } => fut
                .as_mut()
                .poll(cx)
                .map(|resp| Ok(resp.map(Either::Right))),
        }
    }
}

// === ResponseBody ===

/// The response body of [`PdMiddleware`]: the inner service's body, frame for frame
/// (`Left`), or the P/D answer's [`PdBody`] (`Right`). Its error is boxed, as
/// [`PdBody`]'s is.
pub type ResponseBody<B> = Either<B, PdBody>;
