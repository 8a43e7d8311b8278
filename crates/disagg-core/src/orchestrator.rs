//! The [`Orchestrator`]: one request's whole way across the prefill and the decode leg.
//!
//! ```text
//! snapshot → Router::select → KvConnector::prepare → KvConnector::resolve
//!   AfterPrefill: prefill (read in full) → KvConnector::complete → decode
//!   Concurrent:   prefill ∥ decode; the decode's head is relayed as soon as it
//!                 arrives, the prefill's answer is read alongside
//! → decode response, body streamed frame by frame in a PdBody
//! ```
//!
//! Failure is fail-fast in both directions. A prefill that fails before the decode's
//! head ends the attempt and drops the decode leg; one that fails after the head was
//! relayed ends the stream (an SSE error event for event streams); a decode that fails
//! drops the prefill leg. A client that leaves drops the response body, and with it
//! whatever leg is still running.
//!
//! The orchestrator owns no per-request state beyond the request's own future and its
//! response body, and spawns no task: dropping either abandons both legs (their
//! transport futures and bodies drop with them), releases the in-flight counts, and
//! reports the outcome to the router and the connector.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Response};

use futures::FutureExt;
use futures::future::{Either, select};
use http::StatusCode;

use crate::connector::{Dispatch, Handoff, KvConnector, KvOutcome, Leg, PrefillAnswer, VllmNixl};
use crate::disaggregate::{Always, Decision, Disaggregate};
use crate::endpoint::{Endpoint, InFlightGuard};
use crate::error::{ConnectorError, PdError, RouteError, Side};
use crate::request::{PdRequest, REQUEST_ID, RequestIds};
use crate::router::{Outcome, RequestView, RoundRobin, Route, Router};
use crate::source::EndpointSource;
use crate::transport::{BoxBody, Transport, read_limited};

/// The response header that says how the KV reached the decode engine:
/// `kv` (handed over), `none` (the prefill returned no handoff; the decode engine
/// computed the prompt itself), `decode-only` (no prefill endpoint was available, and
/// the configuration allows serving without) or `direct` (the
/// [`Disaggregate`] hook chose not to disaggregate this request).
pub const HANDOFF_HEADER: HeaderName = HeaderName::from_static("x-disagg-handoff");

/// The response header naming the leg whose answer is passed through on a failure.
pub const FAILED_LEG_HEADER: HeaderName = HeaderName::from_static("x-disagg-failed-leg");

pub use crate::response::PdBody;
use crate::response::{Feedback, Finish, PendingPrefill};

/// The `server-timing` response header (W3C Server Timing): `prefill`, `handoff` and
/// `decode` (time to the decode's response head), in milliseconds.
pub const SERVER_TIMING: HeaderName = HeaderName::from_static("server-timing");

/// Phase durations of one request, reported in `server-timing`.
#[derive(Debug, Default, Clone, Copy)]
struct Timing {
    prefill: Option<Duration>,
    handoff: Option<Duration>,
    decode_head: Option<Duration>,
}

impl Timing {
    fn header_value(&self) -> Option<HeaderValue> {
        let mut out = Vec::with_capacity(64);
        for (name, d) in [
            ("prefill", self.prefill),
            ("handoff", self.handoff),
            ("decode", self.decode_head),
        ] {
            if let Some(d) = d {
                if !out.is_empty() {
                    out.extend_from_slice(b", ");
                }
                out.extend_from_slice(name.as_bytes());
                out.extend_from_slice(b";dur=");
                write_millis(&mut out, d);
            }
        }
        HeaderValue::from_bytes(&out)
            .ok()
            .filter(|_| !out.is_empty())
    }
}

/// `d` in milliseconds with three decimals (`12.345`), without float formatting, which
/// the profile showed costing more than the rest of the response head.
fn write_millis(out: &mut Vec<u8>, d: Duration) {
    let micros = d.as_micros();
    let mut int = itoa(micros / 1000);
    out.append(&mut int);
    let frac = (micros % 1000) as u16;
    out.extend_from_slice(&[
        b'.',
        b'0' + (frac / 100) as u8,
        b'0' + (frac / 10 % 10) as u8,
        b'0' + (frac % 10) as u8,
    ]);
}

fn itoa(mut n: u128) -> Vec<u8> {
    let mut digits = Vec::with_capacity(8);
    loop {
        digits.push(b'0' + (n % 10) as u8);
        n /= 10;
        if n == 0 {
            break;
        }
    }
    digits.reverse();
    digits
}

/// What to do when no prefill endpoint is available.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum NoPrefill {
    /// Fail with 503 `no_prefill_endpoint` (the default: a broken prefill pool must not
    /// hide behind slower answers).
    #[default]
    Fail,
    /// Send the request to a decode endpoint alone; it computes the prompt itself. The
    /// answer carries `x-disagg-handoff: decode-only`.
    DecodeOnly,
}

/// What to do when the prefill answered 2xx but carried no KV handoff.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingKv {
    /// Send the decode leg without a handoff, so the decode engine computes the prompt
    /// itself (what vLLM's reference proxy does); the answer carries
    /// `x-disagg-handoff: none` and a warning is logged. The default.
    #[default]
    LocalPrefill,
    /// Fail the request with 502.
    Fail,
}

/// Orchestrator settings.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OrchestratorConfig {
    /// Time for the whole prefill exchange: connect, head and full answer.
    pub prefill_timeout: Duration,
    /// Time from sending the decode leg to its response head.
    pub decode_head_timeout: Duration,
    /// Largest prefill answer read, in bytes.
    pub max_prefill_answer: usize,
    /// No prefill endpoint available.
    pub no_prefill: NoPrefill,
    /// Prefill answered without a handoff.
    pub missing_kv: MissingKv,
    /// Forward the client's `authorization` header to both legs.
    pub forward_authorization: bool,
    /// Client headers forwarded to both legs (besides the request id and the session
    /// header, which always are).
    pub forward_headers: Vec<HeaderName>,
    /// Further attempts after a retryable failure ([`PdError::is_retryable`]) that
    /// happened before any byte of an answer reached the client. Each attempt selects a
    /// new route and runs the connector's `prepare` again (a new SGLang room, a new
    /// Mooncake transfer id). Default 0: no retry.
    pub retries: u32,
}

impl Default for OrchestratorConfig {
    fn default() -> Self {
        OrchestratorConfig {
            // A long prompt can take tens of seconds to prefill on a busy engine.
            prefill_timeout: Duration::from_secs(300),
            // The decode engine may queue the request before its head goes out.
            decode_head_timeout: Duration::from_secs(300),
            // Answers to max_tokens=1 requests are small; prompt logprobs are removed.
            max_prefill_answer: 8 * 1024 * 1024,
            no_prefill: NoPrefill::Fail,
            missing_kv: MissingKv::LocalPrefill,
            forward_authorization: false,
            forward_headers: vec![
                HeaderName::from_static("traceparent"),
                HeaderName::from_static("tracestate"),
                HeaderName::from_static("x-correlation-id"),
            ],
            retries: 0,
        }
    }
}

struct Inner {
    ids: RequestIds,
    source: Arc<dyn EndpointSource>,
    router: Arc<dyn Router>,
    connector: Arc<dyn KvConnector>,
    disaggregate: Arc<dyn Disaggregate>,
    transport: Arc<dyn Transport>,
    config: OrchestratorConfig,
}

/// Runs requests across a prefill and a decode endpoint.
///
/// Cheap to clone (an `Arc` inside). See the [module docs](self) for the flow.
#[derive(Clone)]
pub struct Orchestrator {
    inner: Arc<Inner>,
}

impl fmt::Debug for Orchestrator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Orchestrator")
            .field("connector", &self.inner.connector.name())
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

/// Builds an [`Orchestrator`].
pub struct OrchestratorBuilder {
    source: Arc<dyn EndpointSource>,
    transport: Arc<dyn Transport>,
    router: Arc<dyn Router>,
    connector: Arc<dyn KvConnector>,
    disaggregate: Arc<dyn Disaggregate>,
    config: OrchestratorConfig,
}

impl fmt::Debug for OrchestratorBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OrchestratorBuilder")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl OrchestratorBuilder {
    /// Route with `router` (default: [`RoundRobin`]).
    pub fn router(mut self, router: impl Router) -> Self {
        self.router = Arc::new(router);
        self
    }

    /// Hand KV over with `connector` (default: [`VllmNixl`]).
    pub fn connector(mut self, connector: impl KvConnector) -> Self {
        self.connector = Arc::new(connector);
        self
    }

    /// Decide per request whether to disaggregate with `hook` (default: [`Always`]);
    /// see [`disaggregate`](crate::disaggregate).
    pub fn disaggregate(mut self, hook: impl Disaggregate) -> Self {
        self.disaggregate = Arc::new(hook);
        self
    }

    /// Use `config`.
    pub fn config(mut self, config: OrchestratorConfig) -> Self {
        self.config = config;
        self
    }

    /// The orchestrator, after checking that every prefill/decode pair of the source
    /// can hand KV over with the connector; the source is then followed through a
    /// [`ValidatedSource`](crate::pairing::ValidatedSource), so a later endpoint set with
    /// a bad pair is refused too (see [`pairing`](crate::pairing)).
    ///
    /// # Errors
    ///
    /// [`PairingError`](crate::pairing::PairingError) naming every refused pair.
    pub fn try_build(mut self) -> Result<Orchestrator, crate::pairing::PairingError> {
        let validated =
            crate::pairing::ValidatedSource::new(self.source, Arc::clone(&self.connector))?;
        self.source = Arc::new(validated);
        Ok(self.build())
    }

    /// The orchestrator, without pair validation (see [`try_build`](Self::try_build)).
    pub fn build(self) -> Orchestrator {
        Orchestrator {
            inner: Arc::new(Inner {
                ids: RequestIds::new(),
                source: self.source,
                router: self.router,
                connector: self.connector,
                disaggregate: self.disaggregate,
                transport: self.transport,
                config: self.config,
            }),
        }
    }
}

impl Orchestrator {
    /// A builder over `source` and `transport`, with round-robin routing and the vLLM
    /// NIXL connector until told otherwise.
    pub fn builder(source: impl EndpointSource, transport: impl Transport) -> OrchestratorBuilder {
        OrchestratorBuilder {
            source: Arc::new(source),
            transport: Arc::new(transport),
            router: Arc::new(RoundRobin::new()),
            connector: Arc::new(VllmNixl::new()),
            disaggregate: Arc::new(Always),
            config: OrchestratorConfig::default(),
        }
    }

    /// Parse a client request for `api`, generating its request id (when the client sent
    /// none) from this orchestrator's [`RequestIds`].
    ///
    /// # Errors
    ///
    /// [`BodyError`](crate::error::BodyError) as [`PdRequest::new`].
    pub fn request(
        &self,
        api: crate::request::Api,
        headers: HeaderMap,
        body: &Bytes,
    ) -> Result<PdRequest, crate::error::BodyError> {
        PdRequest::with_ids(api, headers, body, &self.inner.ids)
    }

    /// The endpoint source.
    pub fn source(&self) -> &dyn EndpointSource {
        &*self.inner.source
    }

    /// The transport.
    pub fn transport(&self) -> &dyn Transport {
        &*self.inner.transport
    }

    /// The settings.
    pub fn config(&self) -> &OrchestratorConfig {
        &self.inner.config
    }

    /// Serve `req` disaggregated.
    ///
    /// Resolves to the decode engine's response, whose body streams as the engine writes
    /// it, or to the prefill's answer when that is a client error (4xx, passed through).
    /// The returned future owns everything it needs; dropping it cancels both legs.
    ///
    /// # Errors
    ///
    /// [`PdError`] when no route exists, a leg cannot be reached, times out, or answers
    /// something the handoff cannot go on with. See `PdError::status` for the mapping.
    pub fn serve(
        &self,
        req: PdRequest,
    ) -> impl Future<Output = Result<Response<PdBody>, PdError>> + Send + 'static {
        let inner = Arc::clone(&self.inner);
        async move { inner.serve(req).await }
    }
}

/// What the prefill leg ended with, when it did not fail.
enum PrefillResult {
    Answer(PrefillAnswer),
    /// A 4xx: the client's fault, passed through as the engine wrote it.
    ClientError {
        endpoint: Arc<Endpoint>,
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
    },
}

impl PrefillResult {
    /// The engine's 4xx as the client's response.
    fn client_error_response(
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
        req: &PdRequest,
    ) -> Response<PdBody> {
        let mut resp = Response::new(PdBody::full(body));
        *resp.status_mut() = status;
        *resp.headers_mut() = end_to_end(headers);
        resp.headers_mut()
            .insert(REQUEST_ID, req.request_id().clone());
        resp.headers_mut()
            .insert(FAILED_LEG_HEADER, HeaderValue::from_static("prefill"));
        resp
    }

    /// The prefill's outcome once the decode's answer is already on its way to the
    /// client: only success or an error can still be told.
    fn into_late(self) -> Result<(), PdError> {
        match self {
            PrefillResult::Answer(_) => Ok(()),
            PrefillResult::ClientError {
                endpoint,
                status,
                body,
                ..
            } => Err(PdError::upstream_status(
                Side::Prefill,
                endpoint.id().clone(),
                status,
                upstream_message(&body),
            )),
        }
    }
}

impl Inner {
    /// Feedback to the router and the connector.
    fn observe(&self, route: &Route, outcome: Outcome) {
        self.router.observe(route, outcome);
        self.connector.observe(route, outcome);
    }

    /// `e` ends the attempt over `route`: tell the router and the connector how.
    fn failed(&self, route: &Route, outcome: Outcome, e: PdError) -> PdError {
        self.observe(route, outcome);
        e
    }

    async fn serve(self: Arc<Self>, req: PdRequest) -> Result<Response<PdBody>, PdError> {
        let mut retries = self.config.retries;
        loop {
            match self.attempt(&req).await {
                Ok(resp) => return Ok(resp),
                Err(e) if retries > 0 && e.is_retryable() => {
                    retries -= 1;
                    tracing::warn!(
                        request_id = ?req.request_id(),
                        error = %crate::error::error_chain(&e),
                        retries_left = retries,
                        "attempt failed before any answer reached the client; retrying on a new pair"
                    );
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// One attempt: a route, a plan, both legs. Every error here happened before any
    /// byte of an answer reached the client.
    async fn attempt(&self, req: &PdRequest) -> Result<Response<PdBody>, PdError> {
        let view = RequestView::from(req);
        let decision = self.disaggregate.decide(&view);
        let set = self.source.snapshot();
        let route = set
            .for_model(req.model())
            .and_then(|candidates| match decision {
                Decision::Disaggregate => self.router.select(&view, candidates),
                Decision::Direct { .. } => self.router.select_direct(&view, candidates),
            })
            .map_err(PdError::route)?;
        drop(set);

        // A request served on its decode endpoint alone, and the mark its answer gets.
        let alone = match (decision, &route.prefill) {
            (Decision::Direct { reason }, _) => {
                tracing::debug!(
                    request_id = ?req.request_id(),
                    decode = %route.decode.id(),
                    reason,
                    "not disaggregated: served on a decode endpoint alone"
                );
                Some("direct")
            }
            (Decision::Disaggregate, Some(_)) => None,
            (Decision::Disaggregate, None) => match self.config.no_prefill {
                NoPrefill::Fail => return Err(PdError::route(RouteError::NoPrefill)),
                NoPrefill::DecodeOnly => Some("decode-only"),
            },
        };
        if let Some(mark) = alone {
            let leg = Leg::new(route.decode.clone(), req.body().clone());
            return self.decode(req, route, leg, mark, Timing::default()).await;
        }
        let prefill_failed = |e| {
            self.failed(
                &route,
                Outcome::PrefillFailed,
                PdError::connector(Side::Prefill, e),
            )
        };
        let mut handoff = self
            .connector
            .prepare(&route, req)
            .map_err(prefill_failed)?;
        if let Err(e) = self.connector.resolve(&mut handoff, &*self.transport).await {
            return Err(prefill_failed(e));
        }
        self.dispatch(req, route, handoff).await
    }

    /// Send both legs as the plan says. One path for every connector: the prefill
    /// exchange starts first; [`Dispatch::AfterPrefill`] waits for it and folds its
    /// answer into the decode leg, [`Dispatch::Concurrent`] sends the decode at once and
    /// races the two.
    async fn dispatch(
        &self,
        req: &PdRequest,
        route: Route,
        mut handoff: Handoff,
    ) -> Result<Response<PdBody>, PdError> {
        let start = Instant::now();
        let prefill = self.prefill(req, &handoff.prefill);
        let mut timing = Timing::default();

        let (mark, pending) = match handoff.dispatch {
            Dispatch::AfterPrefill => {
                let answer = match self.prefill_answer(&route, req, prefill.await) {
                    Ok(a) => a,
                    Err(end) => return *end,
                };
                let prefilled = Instant::now();
                timing.prefill = Some(prefilled - start);
                let handed = self
                    .connector
                    .complete(&mut handoff, &answer)
                    .await
                    .map_err(|e| PdError::connector(Side::Prefill, e));
                timing.handoff = Some(prefilled.elapsed());
                let mark = match handed {
                    Ok(KvOutcome::Handed) => "kv",
                    Ok(_) if self.config.missing_kv == MissingKv::LocalPrefill => {
                        tracing::warn!(
                            request_id = ?req.request_id(),
                            prefill = %handoff.prefill.endpoint.id(),
                            "prefill returned no KV handoff; decode computes the prompt itself"
                        );
                        "none"
                    }
                    Ok(_) => {
                        let e = PdError::connector(
                            Side::Prefill,
                            ConnectorError::MissingHandoff {
                                endpoint: handoff.prefill.endpoint.id().clone(),
                                field: "kv handoff",
                            },
                        );
                        return Err(self.failed(&route, Outcome::PrefillFailed, e));
                    }
                    Err(e) => return Err(self.failed(&route, Outcome::PrefillFailed, e)),
                };
                (mark, None)
            }
            // Boxed only here: the race needs it pinned, and it may move into the body.
            Dispatch::Concurrent => ("kv", Some(Box::pin(prefill))),
        };

        let guard = handoff.decode.endpoint.track();
        let decode_start = Instant::now();
        let decode = self.decode_head(req, &handoff.decode);
        let (head, pending) = match pending {
            None => (decode.await, None),
            Some(prefill) => match select(prefill, Box::pin(decode)).await {
                // The prefill ended first: a failure ends the attempt (dropping the
                // decode leg); a success leaves the decode to finish.
                Either::Left((p, decode)) => match self.prefill_answer(&route, req, p) {
                    Ok(_) => {
                        timing.prefill = Some(start.elapsed());
                        (decode.await, None)
                    }
                    Err(end) => return *end,
                },
                // The decode's head came first: relay it now, the prefill rides along.
                Either::Right((d, prefill)) => (d, Some(prefill)),
            },
        };
        let head = match head {
            Ok(h) => h,
            Err(e) => return Err(self.failed(&route, Outcome::DecodeFailed, e)),
        };
        timing.decode_head = Some(decode_start.elapsed());
        // A decode that answered an error needs no KV: the prefill leg is dropped.
        let pending = pending.filter(|_| head.status().is_success());
        let pending: Option<PendingPrefill> =
            pending.map(|p| Box::pin(p.map(|r| r.and_then(PrefillResult::into_late))) as _);
        Ok(self.respond(req, route, guard, head, mark, timing, pending))
    }

    /// The prefill's answer, or, when the prefill failed, how the attempt ends: an
    /// engine's 4xx passed through to the client, or the error.
    fn prefill_answer(
        &self,
        route: &Route,
        req: &PdRequest,
        result: Result<PrefillResult, PdError>,
    ) -> Result<PrefillAnswer, Box<Result<Response<PdBody>, PdError>>> {
        let end = match result {
            Ok(PrefillResult::Answer(a)) => return Ok(a),
            Ok(PrefillResult::ClientError {
                status,
                headers,
                body,
                ..
            }) => Ok(PrefillResult::client_error_response(
                status, headers, body, req,
            )),
            Err(e) => Err(e),
        };
        self.observe(route, Outcome::PrefillFailed);
        // Boxed: only failures take this path, and they should not size every answer.
        Err(Box::new(end))
    }

    /// Build the HTTP request for one leg.
    fn leg_request(&self, req: &PdRequest, leg: &Leg) -> Result<http::Request<Bytes>, PdError> {
        let side = match leg.endpoint.role() {
            crate::endpoint::Role::Prefill => Side::Prefill,
            crate::endpoint::Role::Decode => Side::Decode,
        };
        let uri = leg.endpoint.api_uri(req.api()).map_err(|e| {
            PdError::transport(
                side,
                leg.endpoint.id().clone(),
                crate::error::TransportError::Connect(e.into()),
            )
        })?;
        let mut out = http::Request::new(leg.body.to_bytes());
        *out.method_mut() = http::Method::POST;
        *out.uri_mut() = uri;
        let h = out.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.insert(REQUEST_ID, req.request_id().clone());
        for (name, value) in req.headers() {
            if is_session_header(name)
                || self.config.forward_headers.contains(name)
                || (self.config.forward_authorization && name == header::AUTHORIZATION)
            {
                h.append(name.clone(), value.clone());
            }
        }
        for (name, value) in &leg.headers {
            h.insert(name.clone(), value.clone());
        }
        Ok(out)
    }

    /// The prefill exchange: send the leg and read its answer in full, within the
    /// prefill timeout. The future owns what it needs (`'static`), so a concurrent
    /// handoff can keep it running inside the response body; it holds the prefill
    /// endpoint's in-flight count until it ends or is dropped.
    fn prefill(
        &self,
        req: &PdRequest,
        leg: &Leg,
    ) -> impl Future<Output = Result<PrefillResult, PdError>> + Send + 'static {
        let ep = Arc::clone(&leg.endpoint);
        let guard = ep.track();
        let http_req = self.leg_request(req, leg);
        let transport = Arc::clone(&self.transport);
        let timeout = self.config.prefill_timeout;
        let limit = self.config.max_prefill_answer;
        async move {
            let _guard = guard;
            let http_req = http_req?;
            let exchange = async {
                let resp = transport
                    .send(http_req)
                    .await
                    .map_err(|e| PdError::transport(Side::Prefill, ep.id().clone(), e))?;
                let (parts, body) = resp.into_parts();
                let bytes = read_limited(body, limit)
                    .await
                    .map_err(|e| PdError::upstream_body(Side::Prefill, ep.id().clone(), e))?;
                if parts.status.is_success() {
                    return Ok(PrefillResult::Answer(PrefillAnswer {
                        status: parts.status,
                        headers: parts.headers,
                        body: bytes,
                    }));
                }
                if parts.status.is_client_error() {
                    return Ok(PrefillResult::ClientError {
                        endpoint: Arc::clone(&ep),
                        status: parts.status,
                        headers: parts.headers,
                        body: bytes,
                    });
                }
                Err(PdError::upstream_status(
                    Side::Prefill,
                    ep.id().clone(),
                    parts.status,
                    upstream_message(&bytes),
                ))
            };
            match tokio::time::timeout(timeout, exchange).await {
                Ok(r) => r,
                Err(_) => Err(PdError::timeout(
                    Side::Prefill,
                    ep.id().clone(),
                    "prefill answer",
                )),
            }
        }
    }

    /// Send the decode leg and wait for its response head, within the decode timeout.
    async fn decode_head(&self, req: &PdRequest, leg: &Leg) -> Result<Response<BoxBody>, PdError> {
        let ep = &leg.endpoint;
        let http_req = self.leg_request(req, leg)?;
        match tokio::time::timeout(
            self.config.decode_head_timeout,
            self.transport.send(http_req),
        )
        .await
        {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) => Err(PdError::transport(Side::Decode, ep.id().clone(), e)),
            Err(_) => Err(PdError::timeout(
                Side::Decode,
                ep.id().clone(),
                "response head",
            )),
        }
    }

    /// A decode leg alone (decode-only serving).
    async fn decode(
        &self,
        req: &PdRequest,
        route: Route,
        leg: Leg,
        mark: &'static str,
        mut timing: Timing,
    ) -> Result<Response<PdBody>, PdError> {
        let guard = leg.endpoint.track();
        let start = Instant::now();
        match self.decode_head(req, &leg).await {
            Ok(head) => {
                timing.decode_head = Some(start.elapsed());
                Ok(self.respond(req, route, guard, head, mark, timing, None))
            }
            Err(e) => Err(self.failed(&route, Outcome::DecodeFailed, e)),
        }
    }

    /// The client's response: the decode's head and its body, streamed in a [`PdBody`]
    /// that also carries a concurrent handoff's unfinished prefill exchange.
    #[allow(clippy::too_many_arguments)] // private; each argument is one part of the answer
    fn respond(
        self: &Inner,
        req: &PdRequest,
        route: Route,
        guard: InFlightGuard,
        head: Response<BoxBody>,
        mark: &'static str,
        timing: Timing,
        prefill: Option<PendingPrefill>,
    ) -> Response<PdBody> {
        let (parts, body) = head.into_parts();
        let sse = parts
            .headers
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        let mut resp = Response::new(PdBody::stream(
            body,
            sse,
            Finish {
                guard: Some(guard),
                feedback: Some(Feedback {
                    router: Arc::clone(&self.router),
                    connector: Arc::clone(&self.connector),
                    route,
                }),
            },
            prefill,
        ));
        *resp.status_mut() = parts.status;
        *resp.headers_mut() = end_to_end(parts.headers);
        let h = resp.headers_mut();
        h.insert(REQUEST_ID, req.request_id().clone());
        h.insert(HANDOFF_HEADER, HeaderValue::from_static(mark));
        if let Some(v) = timing.header_value() {
            h.append(SERVER_TIMING, v);
        }
        if !parts.status.is_success() {
            h.insert(FAILED_LEG_HEADER, HeaderValue::from_static("decode"));
        }
        resp
    }
}

/// Whether `name` is the session header, whatever `-`/`_` rewriting a proxy did
/// (`x-session-id`, `x_session_id`, ...). Header names are already lowercase.
pub fn is_session_header(name: &HeaderName) -> bool {
    const WANT: &[u8] = b"x-session-id";
    let got = name.as_str().as_bytes();
    got.len() == WANT.len()
        && got
            .iter()
            .zip(WANT)
            .all(|(g, w)| g == w || (*g == b'_' && *w == b'-'))
}

/// Hop-by-hop headers (RFC 9110 §7.6.1), never forwarded.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "upgrade"
            | "te"
            | "trailer"
    )
}

/// `headers` without the hop-by-hop ones, reusing the map (no copy of the rest).
fn end_to_end(mut headers: HeaderMap) -> HeaderMap {
    if headers.keys().any(is_hop_by_hop) {
        for name in [
            header::CONNECTION,
            HeaderName::from_static("keep-alive"),
            HeaderName::from_static("proxy-connection"),
            header::TRANSFER_ENCODING,
            header::UPGRADE,
            header::TE,
            header::TRAILER,
        ] {
            headers.remove(name);
        }
    }
    headers
}

/// The message of an engine's error answer, for the client's error text.
fn upstream_message(bytes: &Bytes) -> Option<String> {
    const MAX: usize = 512;
    if bytes.is_empty() {
        return None;
    }
    #[derive(serde::Deserialize)]
    struct Wrapped {
        error: Inner,
    }
    #[derive(serde::Deserialize)]
    struct Inner {
        message: String,
    }
    let msg = serde_json::from_slice::<Wrapped>(bytes)
        .map(|w| w.error.message)
        .or_else(|_| serde_json::from_slice::<Inner>(bytes).map(|i| i.message))
        .unwrap_or_else(|_| String::from_utf8_lossy(bytes).into_owned());
    let mut msg = msg.trim().to_owned();
    if msg.len() > MAX {
        let mut cut = MAX;
        while !msg.is_char_boundary(cut) {
            cut -= 1;
        }
        msg.truncate(cut);
        msg.push('…');
    }
    Some(msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_timing_values() {
        let t = Timing {
            prefill: Some(Duration::from_micros(12_345)),
            handoff: Some(Duration::from_nanos(900)),
            decode_head: Some(Duration::from_secs(2) + Duration::from_micros(7)),
        };
        assert_eq!(
            t.header_value().unwrap(),
            "prefill;dur=12.345, handoff;dur=0.000, decode;dur=2000.007"
        );
        assert!(Timing::default().header_value().is_none());
    }

    #[test]
    fn session_header_matches_rewrites() {
        for n in ["x-session-id", "x_session_id", "x-session_id"] {
            assert!(is_session_header(&HeaderName::from_static(n)), "{n}");
        }
        for n in ["x-session-ids", "session-id", "x-sessionid"] {
            assert!(!is_session_header(&HeaderName::from_static(n)), "{n}");
        }
    }

    #[test]
    fn upstream_messages_are_extracted_and_bounded() {
        let m = upstream_message(&Bytes::from_static(
            br#"{"error":{"message":"boom","type":"InternalServerError","code":500}}"#,
        ));
        assert_eq!(m.as_deref(), Some("boom"));
        let m = upstream_message(&Bytes::from_static(
            br#"{"object":"error","message":"old"}"#,
        ));
        assert_eq!(m.as_deref(), Some("old"));
        let m = upstream_message(&Bytes::from("é".repeat(600))).unwrap();
        assert!(m.len() <= 515 && m.ends_with('…'));
        assert_eq!(upstream_message(&Bytes::new()), None);
    }
}
