//! [`PdService`]: the tower service that serves a P/D fleet as one engine.
//!
//! What it does with a request is its [`RouteTable`]'s
//! ([`PdServiceConfig::routes`]; the [`routes`](crate::routes) module has the default
//! table):
//!
//! | action | answer |
//! |---|---|
//! | orchestrated (`POST /v1/chat/completions`, `/v1/completions`, `/generate`) | through the [`Orchestrator`] |
//! | proxy: `GET /v1/models`, `GET /v1/models/{id}` | the engines' own model cards, cached (see [`crate::models`]'s rules) |
//! | proxy: `GET /health` | 200 when a request could be routed now, else 503 |
//! | proxy: `GET /metrics` | the [`PdServiceConfig::metrics`] histograms, the orchestrator's counters and each endpoint's in-flight count, then [`PdServiceConfig::extra_metrics`]: OpenMetrics when the scraper accepts it, else the Prometheus text format (see [`metrics`](crate::metrics)) |
//! | forwarded, direct | to one engine, unchanged, both bodies streamed (see [`crate::forward`]) |
//! | refused | 403 `admin_route_closed` |
//! | fanned out | to every engine of the model, each engine's result in the answer |
//!
//! Every decision is made on the path's normal form ([`crate::path::normalize`]), which
//! is also the path an engine receives; a path with none is answered 400
//! `invalid_path`, but for a model card's id with an encoded `/`
//! (`GET /v1/models/org%2Fmodel`), answered as its plain spelling is. A request whose
//! head says its body is compressed (a `content-encoding` but `identity`, or
//! `x-body-compressed`) is answered 415 `unsupported_content_encoding` on every route
//! that reads or forwards a body, before the body is read: the proxy reads every body
//! to strip the KV handoff no client may send an engine, and does not decompress
//! bodies. The service's own refusals (400, 403, 404, 405, 415) are summarized to the
//! [`route_listeners`](PdServiceConfig::route_listeners) as
//! [`RouteKind::Refused`]. Every failure is an OpenAI-format error response, so the
//! service never fails (`Error = Infallible`) and fits `axum`'s routers and hyper's
//! servers as it is.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use disagg_core::Role;
use disagg_core::error::{BoxError, PdError};
use disagg_core::orchestrator::PrefillFailure;
use disagg_core::request::{Api, PdRequest};
use disagg_core::{Orchestrator, orchestrator::PdBody};
use http::header::{CONNECTION, CONTENT_TYPE, HeaderValue};
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Limited};

use crate::body::{self, BodyBudget};
use crate::error::error_response;
#[cfg(feature = "metrics")]
use crate::metrics::{ExtraMetrics, Metrics};
use crate::models::Catalog;
use crate::routed::{RouteEnd, RouteKind, RouteListeners, RouteSummary};
use crate::routes::{RouteAction, RouteTable};

/// The request id header a client may send (`x-request-id`).
const REQUEST_ID: &str = "x-request-id";

/// Settings of the [`PdService`].
///
/// Cloning shares the [`body_budget`](Self::body_budget) and the model list gathered
/// from the engines: build every service of one server (one per event loop) from clones
/// of one config.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PdServiceConfig {
    /// Largest client body accepted, in bytes; a larger one is answered 413
    /// `request_too_large`.
    pub max_body_bytes: usize,
    /// Time for a client's whole body to arrive, from when its head has been read; past
    /// it the request is answered 408 `request_timeout` and its connection closed.
    /// Default 30 s: at the default body limit that asks a client for about 1 MB/s.
    pub body_timeout: Duration,
    /// Bytes that the bodies being received may hold at once, shared by every clone of
    /// this config, taken as their bytes arrive; a body whose next bytes would take them
    /// past the limit is answered 503 `server_busy` (with `retry-after`) there, the rest
    /// of it unread, and its connection closed.
    /// Default [`DEFAULT_BODY_BUDGET`](crate::body::DEFAULT_BODY_BUDGET) (1 GiB).
    pub body_budget: BodyBudget,
    /// Time each decode server has for its whole answer (head and body) to the proxy's
    /// `GET /v1/models`; one whose answer has not ended by then is left out of the list,
    /// and the others' are used. Requests finding the list stale meanwhile wait for
    /// that one fetch, and give it up (502) a second past its deadline; when the
    /// timeout is too large for the clock, neither the fetch nor they have a deadline
    /// (default 5 s).
    pub models_timeout: Duration,
    /// How long the model list gathered from the engines is reused (default 10 s: a
    /// client listing models before each request does not ask every engine each time,
    /// and an engine's new model shows within seconds).
    pub models_ttl: Duration,
    /// What is done with each route: orchestrated, answered, forwarded, refused or
    /// fanned out. Default [`RouteTable::default`]: admin routes refused.
    pub routes: RouteTable,
    /// Who hears how each request the orchestrator does not serve ended (forwarded,
    /// direct, fanned out, refused by the service itself: a [`RouteSummary`]); default
    /// none. The orchestrator's own requests go to its
    /// [`Listener`](disagg_core::outcome::Listener)s; the [`metrics`](Self::metrics), an
    /// access log and a tracer listen to both.
    pub route_listeners: RouteListeners,
    /// The request and leg metrics of `GET /metrics`: the same [`Metrics`] that listens
    /// to the orchestrator ([`OrchestratorBuilder::listener`]); default none, when
    /// `GET /metrics` has the orchestrator's counters and gauges only.
    ///
    /// [`OrchestratorBuilder::listener`]: disagg_core::orchestrator::OrchestratorBuilder::listener
    #[cfg(feature = "metrics")]
    pub metrics: Option<Metrics>,
    /// More metrics for `GET /metrics`, registered after the orchestrator's, in order
    /// (an adapter's own; default none).
    #[cfg(feature = "metrics")]
    pub extra_metrics: Vec<ExtraMetrics>,
    /// The model list gathered from the engines, shared by every clone: one fetch per
    /// [`models_ttl`](Self::models_ttl) for the whole server, and a fanned-out admin
    /// request drops it for every event loop.
    pub(crate) models: Arc<Catalog>,
}

impl Default for PdServiceConfig {
    fn default() -> Self {
        PdServiceConfig {
            // Long multimodal prompts inline their images; 32 MiB fits them with room.
            max_body_bytes: 32 * 1024 * 1024,
            // The time the server gives a request's head, too.
            body_timeout: Duration::from_secs(30),
            body_budget: BodyBudget::default(),
            models_timeout: Duration::from_secs(5),
            models_ttl: Duration::from_secs(10),
            routes: RouteTable::default(),
            route_listeners: RouteListeners::default(),
            #[cfg(feature = "metrics")]
            metrics: None,
            #[cfg(feature = "metrics")]
            extra_metrics: Vec::new(),
            models: Arc::default(),
        }
    }
}

pub(crate) struct Inner {
    pub(crate) orchestrator: Orchestrator,
    pub(crate) config: PdServiceConfig,
    /// What `GET /metrics` encodes, built once.
    #[cfg(feature = "metrics")]
    registry: prometheus_client::registry::Registry,
    /// Whose turn it is among equally loaded engines for a forwarded request.
    pub(crate) turn: AtomicUsize,
    /// The engine-side ids of forwarded, direct and fanned-out requests.
    pub(crate) engine_ids: crate::forward::EngineIds,
}

/// Serves OpenAI chat and completion requests through an [`Orchestrator`].
///
/// `Clone + Send + Sync` (an `Arc` inside); `poll_ready` is always ready.
#[derive(Clone)]
pub struct PdService {
    inner: Arc<Inner>,
}

impl fmt::Debug for PdService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PdService")
            .field("orchestrator", &self.inner.orchestrator)
            .field("config", &self.inner.config)
            .finish()
    }
}

impl PdService {
    /// A service over `orchestrator` with the default settings.
    pub fn new(orchestrator: Orchestrator) -> Self {
        Self::with_config(orchestrator, PdServiceConfig::default())
    }

    /// A service over `orchestrator` with `config`.
    pub fn with_config(orchestrator: Orchestrator, config: PdServiceConfig) -> Self {
        #[cfg(feature = "metrics")]
        let registry = {
            let mut registry = prometheus_client::registry::Registry::default();
            match &config.metrics {
                Some(metrics) => metrics.register(&mut registry, &orchestrator),
                None => crate::metrics::register_orchestrator(&mut registry, &orchestrator),
            }
            registry.register_collector(Box::new(crate::body::BudgetCollector(
                config.body_budget.clone(),
            )));
            for extra in &config.extra_metrics {
                extra.register(&mut registry);
            }
            registry
        };
        PdService {
            inner: Arc::new(Inner {
                orchestrator,
                config,
                #[cfg(feature = "metrics")]
                registry,
                turn: AtomicUsize::new(0),
                engine_ids: crate::forward::EngineIds::default(),
            }),
        }
    }

    /// The orchestrator.
    pub fn orchestrator(&self) -> &Orchestrator {
        &self.inner.orchestrator
    }

    /// A layer's own error answer `resp` to `req`, summarized once to this service's
    /// route listeners, as the service's own refusals are.
    pub(crate) fn refused<B>(&self, req: &Request<B>, resp: Response<PdBody>) -> Response<PdBody> {
        self.inner.refused(req, resp)
    }

    /// The metrics `GET /metrics` serves, for an embedder that serves them elsewhere
    /// (encode with [`metrics::encode`](crate::metrics::encode)).
    #[cfg(feature = "metrics")]
    #[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
    pub fn registry(&self) -> &prometheus_client::registry::Registry {
        &self.inner.registry
    }

    /// Serve one chat or completion request of `api`, whatever path it came on: read
    /// the body (within the limits of [`crate::body`]), parse it, orchestrate both legs.
    /// Every failure is an OpenAI-format error response. The one request path of both
    /// the service and [`PdLayer`](crate::PdLayer).
    pub(crate) fn completion<B>(
        &self,
        api: Api,
        req: Request<B>,
    ) -> impl Future<Output = Response<PdBody>> + Send + 'static
    where
        B: Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
    {
        let inner = Arc::clone(&self.inner);
        async move { inner.completion_response(api, req).await }
    }
}

/// The future of `PdService`'s `tower::Service::call`.
pub struct ResponseFuture {
    inner: Pin<Box<dyn Future<Output = Result<Response<PdBody>, Infallible>> + Send>>,
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl Future for ResponseFuture {
    type Output = Result<Response<PdBody>, Infallible>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<B> tower::Service<Request<B>> for PdService
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    type Response = Response<PdBody>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> ResponseFuture {
        let inner = Arc::clone(&self.inner);
        ResponseFuture {
            inner: crate::pin_in_place(move || async move { Ok(inner.handle(req).await) }),
        }
    }
}

impl Inner {
    async fn handle<B>(&self, mut req: Request<B>) -> Response<PdBody>
    where
        B: Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
    {
        let get = req.method() == Method::GET;
        // One path for every decision below and for the engine: see `crate::path`.
        if let Err(err) = crate::path::normalize_request(&mut req) {
            // A model card's id with an encoded `/` is the one such path served: it is
            // answered as the path it stands for would be, never forwarded.
            let card = crate::path::escaped_model_card(req.uri().path(), err).map(|c| {
                (
                    self.config.routes.action(&c.plain),
                    c.id.to_owned(),
                    c.plain,
                )
            });
            return match card {
                Some((RouteAction::Proxy, id, _)) if get => self.models(Some(&id)).await,
                Some((RouteAction::Proxy, ..)) => self.refused(&req, method_not_allowed()),
                Some((RouteAction::Refused, _, plain)) => {
                    let resp = closed(&self.config.routes, &plain);
                    self.refused(&req, resp)
                }
                _ => self.refused(&req, invalid_path(err)),
            };
        }
        let path = req.uri().path();
        let action = self.config.routes.action(path);
        // A compressed body is refused on every route that reads or forwards a body,
        // before it is read (the orchestrated routes refuse it in
        // `completion_response`, the one path of the service and the layer).
        if matches!(
            action,
            RouteAction::Forwarded | RouteAction::Direct | RouteAction::FannedOut
        ) && let Some(resp) = self.refuse_compressed(&req, None)
        {
            return resp;
        }
        // The service's own refusals are summarized (`RouteKind::Refused`); its own
        // answers (`/health`, `/metrics`, the model list and cards) are not.
        match action {
            RouteAction::Orchestrated => match Api::from_path(path) {
                Some(api) if req.method() == Method::POST => {
                    self.completion_response(api, req).await
                }
                Some(_) => self.refused(&req, method_not_allowed()),
                // A path the table orchestrates that no API serves.
                None => self.refused(&req, not_found()),
            },
            RouteAction::Proxy => match path {
                "/v1/models" if get => self.models(None).await,
                "/health" if get => self.health(),
                #[cfg(feature = "metrics")]
                "/metrics" if get => self.metrics(req.headers().get(http::header::ACCEPT)),
                #[cfg(feature = "metrics")]
                "/metrics" => self.refused(&req, method_not_allowed()),
                "/v1/models" | "/health" => self.refused(&req, method_not_allowed()),
                _ => match path.strip_prefix("/v1/models/") {
                    Some(id) if get => {
                        let id = id.to_owned();
                        self.models(Some(&id)).await
                    }
                    Some(_) => self.refused(&req, method_not_allowed()),
                    None => self.refused(&req, not_found()),
                },
            },
            RouteAction::Forwarded => self.forwarded(req, false).await,
            RouteAction::Direct => self.forwarded(req, true).await,
            RouteAction::FannedOut => {
                let mut route = Some(self.route_end(RouteKind::FanOut, &req));
                let resp = self.fan_out(req, &mut route).await;
                // Still here: the client did not leave while its body was read.
                if let Some(route) = route {
                    route.answered(&resp);
                }
                resp
            }
            RouteAction::Refused => self.refused(&req, closed(&self.config.routes, path)),
        }
    }

    /// The 415 `unsupported_content_encoding` for `req` when its head says its body is
    /// compressed ([`crate::coding`]), in `api`'s error shape (none: OpenAI's),
    /// summarized as the service's own refusal; `None` for any other request. Its body
    /// is never read.
    fn refuse_compressed<B: Body>(
        &self,
        req: &Request<B>,
        api: Option<Api>,
    ) -> Option<Response<PdBody>> {
        let coding = crate::coding::compressed(req.headers())?;
        let id = req.headers().get(REQUEST_ID).and_then(|v| v.to_str().ok());
        // A body known to be empty (hyper's for a request without `content-length` nor
        // chunking) leaves nothing unread: the connection is kept.
        let body = crate::forward::may_have_body(req.headers()) && !req.body().is_end_stream();
        Some(self.refused(req, coding.response(api, id, body)))
    }

    /// The service's own error answer `resp` to `req`, no engine asked, summarized once
    /// as [`RouteKind::Refused`] (it ends as it is sent: it is whole in memory).
    pub(crate) fn refused<B>(&self, req: &Request<B>, resp: Response<PdBody>) -> Response<PdBody> {
        self.route_end(RouteKind::Refused, req).answered(&resp);
        resp
    }

    /// A forwarded request (to a decode only when `direct`), told when its answer ends.
    async fn forwarded<B>(&self, req: Request<B>, direct: bool) -> Response<PdBody>
    where
        B: Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
    {
        let kind = if direct {
            RouteKind::Direct
        } else {
            RouteKind::Forward
        };
        let mut route = Some(self.route_end(kind, &req));
        let resp = self.forward(req, direct, &mut route).await;
        // Still here: the answer is the proxy's own (a refusal, no engine), not the
        // engine's stream.
        if let Some(route) = route {
            route.answered(&resp);
        }
        resp
    }

    /// The summary-to-be of `req`, served as `kind`, arriving now.
    fn route_end<B>(&self, kind: RouteKind, req: &Request<B>) -> RouteEnd {
        let arrival = tokio::time::Instant::now().into_std();
        let mut summary = RouteSummary::new(kind, req.method().clone(), req.uri().path(), arrival);
        summary.request_id = req.headers().get(REQUEST_ID).cloned();
        summary.trace = self.orchestrator.route_trace(req.headers());
        #[cfg(feature = "auth")]
        {
            summary.client = req
                .extensions()
                .get::<crate::auth::KeyId>()
                .map(|k| Arc::<str>::from(k.to_string()));
        }
        RouteEnd::new(self.config.route_listeners.clone(), summary)
    }

    /// A chat or completion request, whatever its path, answered: the decode's
    /// streaming answer, or any failure as an OpenAI-format error response.
    async fn completion_response<B>(&self, api: Api, req: Request<B>) -> Response<PdBody>
    where
        B: Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
    {
        // Refused on its head, as on the routes of every other kind: the orchestrator
        // never has it.
        if let Some(resp) = self.refuse_compressed(&req, Some(api)) {
            return resp;
        }
        let arrival = tokio::time::Instant::now().into_std();
        let (parts, body) = req.into_parts();
        let limits = body::Limits {
            max_bytes: self.config.max_body_bytes,
            timeout: self.config.body_timeout,
            budget: &self.config.body_budget,
        };
        // An [`ApiKeyLayer`](crate::auth::ApiKeyLayer) in front names the key that
        // admitted the request: logs name the client by it.
        #[cfg(feature = "auth")]
        let client = parts
            .extensions
            .get::<crate::auth::KeyId>()
            .map(|k| Arc::<str>::from(k.to_string()));
        #[cfg(not(feature = "auth"))]
        let client: Option<Arc<str>> = None;
        // Told once whatever happens before the orchestrator has the request, the
        // client's leaving (this future dropped) included.
        let untold = Untold {
            orchestrator: &self.orchestrator,
            api,
            id: parts.headers.get(REQUEST_ID).cloned(),
            arrival,
            client,
            told: false,
        };
        let (bytes, share) = match body::read(body, limits).await {
            Ok(read) => read,
            Err(err) => {
                let mut resp = failed(api, untold.id.as_ref(), &err);
                untold.refused(&err);
                // The rest of the body is unread: the connection cannot carry another
                // request, and a client that stalled or flooded should not keep it.
                resp.headers_mut()
                    .insert(CONNECTION, HeaderValue::from_static("close"));
                return resp;
            }
        };
        // Cohere's error body names the request (the client's id, when it sent one).
        let error_id = (api == Api::CohereChat)
            .then(|| untold.id.clone())
            .flatten();
        // The body's share of the budget covers receiving and parsing: it is given back
        // once the parse has ended (its bytes are in the request then, or gone).
        let parsed = self.parse(api, parts.headers, bytes, share).await;
        let served = match parsed {
            Ok(mut req) => {
                // The orchestrator tells the request's end from here on.
                req.set_received(arrival, untold.taken());
                self.orchestrator.serve(req).await
            }
            Err(err) => {
                untold.refused(&err);
                Err(err)
            }
        };
        served.unwrap_or_else(|err| failed(api, error_id.as_ref(), &err))
    }

    /// Parse a client's body into a request, off the event loop when it is large; the
    /// body's `share` of the budget is given back once the parse has ended (on the
    /// blocking pool it goes with the parse, which outlives a client that left).
    async fn parse(
        &self,
        api: Api,
        headers: HeaderMap,
        bytes: Bytes,
        share: body::Share<'_>,
    ) -> Result<PdRequest, PdError> {
        // A large body (or a hostile one of many keys) would hold the event loop, and
        // every connection on it, for as long as its parse takes; see
        // `PARSE_OFF_LOOP_FROM` for the threshold and why the blocking pool.
        if bytes.len() >= body::PARSE_OFF_LOOP_FROM {
            let orchestrator = self.orchestrator.clone();
            return body::on_blocking_pool(share, move || {
                orchestrator
                    .request(api, headers, &bytes)
                    .map_err(PdError::body)
            })
            .await;
        }
        let parsed = self.orchestrator.request(api, headers, &bytes);
        drop(share);
        parsed.map_err(PdError::body)
    }

    #[cfg(feature = "metrics")]
    fn metrics(&self, accept: Option<&HeaderValue>) -> Response<PdBody> {
        let (text, content_type) = crate::metrics::encode(&self.registry, accept);
        let mut resp = Response::new(PdBody::from(Bytes::from(text)));
        resp.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
        resp
    }

    fn health(&self) -> Response<PdBody> {
        let set = self.orchestrator.source().snapshot();
        let prefill_ok = !set.by_role(Role::Prefill).is_empty()
            || self.orchestrator.config().prefill_failure == PrefillFailure::DecodeOnly;
        if prefill_ok && !set.by_role(Role::Decode).is_empty() {
            json_response(StatusCode::OK, Bytes::from_static(br#"{"status":"ok"}"#))
        } else {
            error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!(
                    "not ready: {} prefill and {} decode endpoints",
                    set.by_role(Role::Prefill).len(),
                    set.by_role(Role::Decode).len()
                ),
                "server_error",
                "not_ready",
            )
        }
    }
}

/// An orchestrated request from its arrival until the orchestrator has it, or its
/// refusal is told: dropped before either (its client left while its body was read or
/// parsed, on the blocking pool too), it tells the orchestrator's listeners that the
/// request ended cancelled, with status 499, as the orchestrator tells one whose client
/// leaves later, before the response head. Told once, either way.
struct Untold<'a> {
    orchestrator: &'a Orchestrator,
    api: Api,
    /// The client's `x-request-id`.
    id: Option<HeaderValue>,
    arrival: std::time::Instant,
    /// Who sent it, when a key layer in front named the client.
    client: Option<Arc<str>>,
    told: bool,
}

impl Untold<'_> {
    /// The request is refused with `err` (its body could not be read or parsed): told
    /// so, or as cancelled when its body broke off with its client's connection
    /// ([`client_left`](body::client_left): no answer reaches that client).
    fn refused(mut self, err: &PdError) {
        self.told = true;
        let (id, client) = (self.id.take(), self.client.take());
        if body::client_left(err) {
            self.orchestrator
                .cancelled(self.api, id, self.arrival, client);
        } else {
            self.orchestrator.refused(self.api, id, self.arrival, err);
        }
    }

    /// The orchestrator has the request now, and tells its end: who sent it.
    fn taken(mut self) -> Option<Arc<str>> {
        self.told = true;
        self.client.take()
    }
}

impl Drop for Untold<'_> {
    fn drop(&mut self) {
        if self.told || std::thread::panicking() {
            return;
        }
        let (id, client) = (self.id.take(), self.client.take());
        self.orchestrator
            .cancelled(self.api, id, self.arrival, client);
    }
}

/// A failed request's answer, in `api`'s own error shape, logged.
fn failed(api: Api, id: Option<&HeaderValue>, err: &PdError) -> Response<PdBody> {
    tracing::warn!(error = %disagg_core::error::error_chain(err), "request failed");
    let id = id.and_then(|v| v.to_str().ok());
    crate::error::api_error_response(api, id, err)
}

/// Collect at most `limit` bytes of an engine's answer `body`.
///
/// A named `'static` future rather than an `async fn`: awaiting `Limited`'s collect
/// directly inside an async block trips the compiler's `Send` inference (a
/// higher-ranked `From` bound on the boxed error).
pub(crate) fn collect_limited<B>(
    body: B,
    limit: usize,
) -> impl Future<Output = Result<Bytes, BoxError>> + Send + 'static
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    use futures::TryFutureExt;
    Limited::new(body, limit).collect().map_ok(|c| c.to_bytes())
}

pub(crate) fn json_response(status: StatusCode, body: Bytes) -> Response<PdBody> {
    let mut resp = Response::new(PdBody::from(body));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// The answer to a path with no one meaning (400 `invalid_path`).
pub(crate) fn invalid_path(err: crate::path::PathError) -> Response<PdBody> {
    error_response(
        StatusCode::BAD_REQUEST,
        &format!("invalid request path: {err}"),
        "invalid_request_error",
        "invalid_path",
    )
}

/// The answer to a request on a route `routes` closes (403 `admin_route_closed`), its
/// message saying why by the rule that closes it: an admin route (which
/// `--admin-routes` opens), a path below the engines' metrics mount (which nothing
/// opens: the proxy's own metrics are its `GET /metrics`), or a rule of the embedder's.
fn closed(routes: &RouteTable, path: &str) -> Response<PdBody> {
    let rule = routes.rule(path).map(|r| &*r.path);
    let message = if rule.is_some_and(|r| crate::routes::ADMIN_ROUTES.contains(&r)) {
        format!(
            "{path} changes the engines' state and is closed on this proxy; \
             its operator can open the admin routes (disagg-proxy serve --admin-routes)"
        )
    } else if rule == Some("/metrics*") {
        // The default rule (an embedder's own rule under `/metrics`, or one closing
        // `/metrics` itself, is the route table's).
        let own = if cfg!(feature = "metrics") {
            "; the proxy's metrics are at GET /metrics"
        } else {
            ""
        };
        format!(
            "{path} is closed on this proxy and no flag opens it: the engines answer \
             every path that starts with /metrics with their own metrics, which are not \
             the proxy's to serve{own}"
        )
    } else {
        format!("{path} is closed on this proxy by its route table")
    };
    error_response(
        StatusCode::FORBIDDEN,
        &message,
        "permission_error",
        "admin_route_closed",
    )
}

/// A path the service serves no route for (404 `not_found`): the HTTP layer's own
/// answer, never the orchestrator's.
fn not_found() -> Response<PdBody> {
    error_response(
        StatusCode::NOT_FOUND,
        "no such route",
        "invalid_request_error",
        "not_found",
    )
}

fn method_not_allowed() -> Response<PdBody> {
    error_response(
        StatusCode::METHOD_NOT_ALLOWED,
        "method not allowed on this route",
        "invalid_request_error",
        "method_not_allowed",
    )
}
