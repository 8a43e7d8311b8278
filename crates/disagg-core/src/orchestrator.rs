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
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::time::Instant as TokioInstant;

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Response};

use futures::FutureExt;
use futures::future::{Either, select};
use http::StatusCode;

use crate::admission::{Admission, AdmissionConfig, RoomFreed};
use crate::connector::{Dispatch, Handoff, KvConnector, KvOutcome, Leg, PrefillAnswer, VllmNixl};
use crate::disaggregate::{Always, Decision, Disaggregate};
use crate::endpoint::{Endpoint, InFlightGuard};
use crate::error::{BodyError, ConnectorError, PdError, Phase, RouteError, Side};
use crate::health::Health;
use crate::policy::Rng;
use crate::request::{PdRequest, REQUEST_ID, RequestIds};
use crate::retry::{RetryBudget, RetryPolicy};
use crate::rewrite::PrefillRewriter;
use crate::router::{Outcome, RequestView, RoundRobin, Route, Router};
use crate::source::EndpointSource;
use crate::stats::{Counters, GaugeGuard, OrchestratorStats, bump};
use crate::transport::{BoxBody, Transport, read_limited};

/// The response header that says how the KV reached the decode engine:
/// `kv` (handed over), `none` (the prefill returned no handoff; the decode engine
/// computed the prompt itself), `decode-only` (no prefill endpoint was available, and
/// the configuration allows serving without), `direct` (the
/// [`Disaggregate`] hook chose not to disaggregate this request) or `prefill` (the
/// prefill's answer was the whole answer, [`KvOutcome::Finished`]: no decode leg).
pub const HANDOFF_HEADER: HeaderName = HeaderName::from_static("x-disagg-handoff");

/// The response header naming the leg whose answer is passed through on a failure.
pub const FAILED_LEG_HEADER: HeaderName = HeaderName::from_static("x-disagg-failed-leg");

pub use crate::response::PdBody;
use crate::response::{
    Feedback, Finish, LeadBody, PendingDecode, PendingPrefill, StreamTimer, empty_body,
};

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

/// What to do when the prefill leg cannot be had: no prefill endpoint is available
/// (none configured, none healthy, none serving the model), or the prefill leg failed
/// on the engine's side (unreachable, 5xx, timed out, an unusable answer) and retries,
/// if any, did not help.
///
/// A prefill's 4xx is the client's fault and is passed through under either policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PrefillFailure {
    /// Fail the request: 503 `no_prefill_endpoint`, or the prefill's own error (the
    /// default: a broken prefill pool must not hide behind slower answers).
    #[default]
    Fail,
    /// Send the request to a decode endpoint alone; it computes the prompt itself. The
    /// answer carries `x-disagg-handoff: decode-only` and `x-disagg-fallback` naming
    /// why (the error code, `no_prefill_endpoint` say), a warning is logged and
    /// [`OrchestratorStats::prefill_fallbacks`] counts it. Not possible once the decode's
    /// answer has begun (a concurrent handoff whose prefill fails mid-stream ends the
    /// stream with an error) or once the deadline has passed.
    DecodeOnly,
}

/// The response header naming why a request was served decode-only under
/// [`PrefillFailure::DecodeOnly`]: the code of the prefill's failure.
pub const FALLBACK_HEADER: HeaderName = HeaderName::from_static("x-disagg-fallback");

/// The request header a client may set to shorten its request's deadline, in
/// milliseconds, when [`OrchestratorConfig::client_deadline`] allows it.
pub const DEADLINE_HEADER: HeaderName = HeaderName::from_static("x-disagg-deadline-ms");

/// Early release of a prefill's KV blocks when the decode leg that would have taken
/// them is not going to (see [`OrchestratorConfig::kv_release`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KvRelease {
    /// Leave the blocks to the prefill engine's own timeout or lease (vLLM: 30 s
    /// `kv_lease_duration`; older builds 120-480 s). The default.
    #[default]
    Off,
    /// For connectors that send the decode after the prefill
    /// ([`Dispatch::AfterPrefill`], vLLM NIXL): when a request ends after its prefill
    /// answered with a handoff but before the decode's response head arrived (the
    /// client left, a budget ran out, the decode could not be reached), send the
    /// decode leg anyway as a one-token, non-streaming request and drop it after
    /// `wait`: the decode engine takes (and so frees) the blocks, or, aborted while
    /// queued, tells the prefill to free them. A request cancelled while its prefill
    /// was still running waits up to `grace` for the prefill's answer in the
    /// background (an answer already on the wire would otherwise strand its blocks);
    /// a prefill still running after `grace` is aborted, which frees its blocks.
    ///
    /// Each release is a short background task (counted in
    /// [`OrchestratorStats::kv_releases_in_flight`]), ended by `grace` + `wait` at the
    /// latest; a release that finds nothing to release sends nothing. A decode that
    /// already received the leg may see it twice (the second pull fails harmlessly),
    /// which is why this is opt-in.
    AbortDecode {
        /// How long a cancelled request waits for a running prefill's answer.
        grace: Duration,
        /// How long the release waits for the decode's response head before dropping
        /// it.
        wait: Duration,
    },
}

impl KvRelease {
    /// [`AbortDecode`](Self::AbortDecode) with a 250 ms grace and a 2 s wait.
    pub fn abort_decode() -> Self {
        KvRelease::AbortDecode {
            grace: Duration::from_millis(250),
            wait: Duration::from_secs(2),
        }
    }
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
///
/// Time budgets: a request may have a total [`deadline`](Self::deadline), and each step
/// has a budget of its own; a step gets its budget or what is left of the deadline,
/// whichever is less, and the error says which ran out (`prefill_timeout`,
/// `handoff_timeout`, `decode_timeout`, `decode_idle_timeout`, or `deadline_exceeded`,
/// all 504).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OrchestratorConfig {
    /// The whole request, from arrival to the last byte of the answer (default `None`:
    /// no total deadline, only the per-step budgets). A stream still running at the
    /// deadline is ended with an error event.
    pub deadline: Option<Duration>,
    /// Let a client shorten (never extend) its deadline with the
    /// [`DEADLINE_HEADER`] (`x-disagg-deadline-ms`; default off). With no configured
    /// deadline, the client's value is the deadline.
    pub client_deadline: bool,
    /// Time for the whole prefill exchange: connect, head and full answer.
    pub prefill_timeout: Duration,
    /// Time for each step of the connector's handoff work (a bootstrap lookup, folding
    /// the prefill's answer into the decode leg; default 10 s).
    pub handoff_timeout: Duration,
    /// Time from sending the decode leg to its response head.
    pub decode_head_timeout: Duration,
    /// Longest silence between two chunks of the decode's body once its head arrived
    /// (default 120 s; `None`: no limit). A non-streaming decode is silent until its
    /// answer is complete, so this must exceed the longest generation of those.
    pub decode_idle_timeout: Option<Duration>,
    /// Largest prefill answer read, in bytes.
    pub max_prefill_answer: usize,
    /// The prefill leg cannot be had: fail, or serve decode-only.
    pub prefill_failure: PrefillFailure,
    /// Prefill answered without a handoff.
    pub missing_kv: MissingKv,
    /// Forward the client's `authorization` header to both legs.
    pub forward_authorization: bool,
    /// Client headers forwarded to both legs (besides the request id and the session
    /// header, which always are).
    pub forward_headers: Vec<HeaderName>,
    /// Retries of an attempt that failed retryably ([`PdError::is_retryable`]) before
    /// any byte of an answer reached the client (default: none). Each attempt selects a
    /// new route and runs the connector's `prepare` again (a new SGLang room, a new
    /// Mooncake transfer id), after a jittered backoff, within the deadline and the
    /// retry budget; see [`retry`](crate::retry).
    pub retry: RetryPolicy,
    /// In-flight limits and the admission queue (default: no limit); see
    /// [`admission`](crate::admission).
    pub admission: AdmissionConfig,
    /// Early release of a prefill's KV blocks (default off).
    pub kv_release: KvRelease,
}

impl Default for OrchestratorConfig {
    fn default() -> Self {
        OrchestratorConfig {
            deadline: None,
            client_deadline: false,
            // A long prompt can take tens of seconds to prefill on a busy engine.
            prefill_timeout: Duration::from_secs(300),
            handoff_timeout: Duration::from_secs(10),
            decode_idle_timeout: Some(Duration::from_secs(120)),
            // The decode engine may queue the request before its head goes out.
            decode_head_timeout: Duration::from_secs(300),
            // Answers to max_tokens=1 requests are small; prompt logprobs are removed.
            max_prefill_answer: 8 * 1024 * 1024,
            prefill_failure: PrefillFailure::Fail,
            missing_kv: MissingKv::LocalPrefill,
            forward_authorization: false,
            forward_headers: vec![
                HeaderName::from_static("traceparent"),
                HeaderName::from_static("tracestate"),
                HeaderName::from_static("x-correlation-id"),
            ],
            retry: RetryPolicy::default(),
            admission: AdmissionConfig::default(),
            kv_release: KvRelease::Off,
        }
    }
}

struct Inner {
    ids: RequestIds,
    health: Option<Arc<Health>>,
    admission: Arc<Admission>,
    budget: Arc<RetryBudget>,
    counters: Arc<Counters>,
    rng: Rng,
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
    health: Option<Arc<Health>>,
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

    /// Report each leg's result to `health` (passive health checking): an engine's
    /// failure on a leg counts against that endpoint in that role only, a client's
    /// error or a cancelled request counts for nothing. Use the [`Health`] of the
    /// [`HealthSource`](crate::health::HealthSource) the orchestrator routes over.
    pub fn health(mut self, health: Arc<Health>) -> Self {
        self.health = Some(health);
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
                health: self.health,
                admission: Arc::new(Admission::new(self.config.admission.clone())),
                budget: Arc::new(RetryBudget::for_policy(&self.config.retry)),
                counters: Arc::default(),
                rng: Rng::random(),
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
            health: None,
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
    /// [`BodyError`] as [`PdRequest::new`].
    pub fn request(
        &self,
        api: crate::request::Api,
        headers: HeaderMap,
        body: &Bytes,
    ) -> Result<PdRequest, crate::error::BodyError> {
        PdRequest::with_ids(api, headers, body, &self.inner.ids)
    }

    /// An orchestrator that sends its legs through `transport` and shares everything
    /// else with this one: endpoints, router, connector, settings, and the state that
    /// must be global to be right (admission limits and queue, retry budget, counters).
    ///
    /// A server with one event loop per core builds one orchestrator, then one of these
    /// per loop, each with a transport (and connection pool) of its own.
    pub fn with_transport(&self, transport: impl Transport) -> Orchestrator {
        let i = &self.inner;
        Orchestrator {
            inner: Arc::new(Inner {
                ids: RequestIds::new(),
                health: i.health.clone(),
                admission: Arc::clone(&i.admission),
                budget: Arc::clone(&i.budget),
                counters: Arc::clone(&i.counters),
                rng: Rng::random(),
                source: Arc::clone(&i.source),
                router: Arc::clone(&i.router),
                connector: Arc::clone(&i.connector),
                disaggregate: Arc::clone(&i.disaggregate),
                transport: Arc::new(transport),
                config: i.config.clone(),
            }),
        }
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

    /// What this orchestrator counted so far: requests, retries, fallbacks, admission,
    /// early KV releases.
    pub fn stats(&self) -> OrchestratorStats {
        let i = &self.inner;
        let c = &i.counters;
        let a = &i.admission.counters;
        let load = Counters::load;
        OrchestratorStats {
            requests: load(&c.requests),
            in_flight: i.admission.running() as u64,
            queued_now: i.admission.waiting() as u64,
            queued: load(&a.queued),
            rejected_queue_full: load(&a.queue_full),
            queue_timeouts: load(&a.queue_timeouts),
            retries: load(&c.retries),
            retries_denied: load(&c.retries_denied),
            prefill_fallbacks: load(&c.prefill_fallbacks),
            deadlines_exceeded: load(&c.deadlines_exceeded),
            kv_releases: load(&c.kv_releases),
            kv_releases_in_flight: load(&c.kv_releases_in_flight),
            direct: c.direct_counts(),
            invalid_params: load(&c.invalid_params),
        }
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

/// When a request must be done by.
#[derive(Debug, Clone, Copy)]
struct Clock {
    deadline: Option<TokioInstant>,
}

impl Clock {
    /// The time a step with budget `step` may take, and whether the deadline (rather
    /// than the step's own budget) is what limits it.
    fn budget(&self, step: Duration) -> (Duration, bool) {
        match self.deadline {
            None => (step, false),
            Some(d) => {
                let left = d.saturating_duration_since(TokioInstant::now());
                if left < step {
                    (left, true)
                } else {
                    (step, false)
                }
            }
        }
    }

    fn expired(&self) -> bool {
        self.deadline.is_some_and(|d| TokioInstant::now() >= d)
    }
}

/// Run `step` within `budget` (or what is left of the deadline, if less); out of time,
/// the error names which ran out.
async fn within<T>(
    clock: Clock,
    budget: Duration,
    side: Side,
    endpoint: &Arc<Endpoint>,
    phase: Phase,
    step: impl Future<Output = Result<T, PdError>>,
) -> Result<T, PdError> {
    let (budget, by_deadline) = clock.budget(budget);
    match tokio::time::timeout(budget, step).await {
        Ok(r) => r,
        Err(_) => Err(out_of_time(by_deadline, side, endpoint, phase)),
    }
}

/// Wait for the plan's [`Handoff::gate`], if any, within `budget` (a handoff step: its
/// failure is the prefill side's).
async fn kv_ready(handoff: &Handoff, clock: Clock, budget: Duration) -> Result<(), PdError> {
    let Some(gate) = &handoff.gate else {
        return Ok(());
    };
    let ready = gate
        .ready()
        .map(|r| r.map_err(|e| PdError::connector(Side::Prefill, e)));
    let ep = &handoff.prefill.endpoint;
    within(clock, budget, Side::Prefill, ep, Phase::Handoff, ready).await
}

/// Send a decode leg's request and wait for its response head within `budget`.
async fn send_decode(
    transport: &dyn Transport,
    http_req: http::Request<Bytes>,
    ep: &Arc<Endpoint>,
    clock: Clock,
    budget: Duration,
) -> Result<Response<BoxBody>, PdError> {
    let send = transport
        .send(http_req)
        .map(|r| r.map_err(|e| PdError::transport(Side::Decode, ep.id().clone(), e)));
    within(clock, budget, Side::Decode, ep, Phase::DecodeHead, send).await
}

/// The error for a step that ran out of time: its own budget, or the deadline.
fn out_of_time(by_deadline: bool, side: Side, endpoint: &Arc<Endpoint>, phase: Phase) -> PdError {
    if by_deadline {
        PdError::deadline(side, phase)
    } else {
        PdError::timeout(side, endpoint.id().clone(), phase)
    }
}

type PrefillFuture = Pin<Box<dyn Future<Output = Result<PrefillResult, PdError>> + Send>>;

/// Where a sequential handoff is, for an early KV release ([`KvRelease`]) should the
/// request end before its decode's head arrives.
enum Stage {
    /// Nothing to release (the feature is off, the prefill failed or handed nothing,
    /// or the decode's head arrived).
    Idle,
    /// The prefill exchange is running.
    Prefilling(PrefillFuture),
    /// The prefill answered; the handoff is being completed.
    Answered(PrefillAnswer),
    /// The decode leg is ready (and maybe sent).
    Handed(Leg),
}

/// The prefill exchange of a sequential handoff, and what an early release needs should
/// the request be dropped before the decode's head: on drop, a release still armed
/// goes on in a background task (see [`KvRelease::AbortDecode`]).
struct Sequential {
    stage: Stage,
    release: Option<Release>,
}

/// What a background release needs, cloned only when the feature is on.
struct Release {
    grace: Duration,
    wait: Duration,
    handoff: Handoff,
    api: crate::request::Api,
    connector: Arc<dyn KvConnector>,
    transport: Arc<dyn Transport>,
    counters: Arc<Counters>,
}

impl Sequential {
    /// The prefill's result, or `None` when `budget` ran out first. While it runs, and
    /// after a timeout, a dropped request releases what the prefill answers.
    async fn prefill(&mut self, budget: Duration) -> Option<Result<PrefillResult, PdError>> {
        let Stage::Prefilling(fut) = &mut self.stage else {
            return None;
        };
        let result = tokio::time::timeout(budget, fut).await.ok()?;
        self.stage = Stage::Idle;
        Some(result)
    }

    fn answered(&mut self, answer: &PrefillAnswer) {
        if self.release.is_some() {
            self.stage = Stage::Answered(answer.clone());
        }
    }

    fn handed(&mut self, leg: &Leg) {
        if self.release.is_some() {
            self.stage = Stage::Handed(leg.clone());
        }
    }

    fn disarm(&mut self) {
        self.stage = Stage::Idle;
    }
}

impl Drop for Sequential {
    fn drop(&mut self) {
        let stage = std::mem::replace(&mut self.stage, Stage::Idle);
        if matches!(stage, Stage::Idle) {
            return;
        }
        let (Some(release), Ok(runtime)) =
            (self.release.take(), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        runtime.spawn(release.run(stage));
    }
}

impl Release {
    /// Release the KV a dropped request's prefill holds (see [`KvRelease::AbortDecode`]).
    async fn run(mut self, stage: Stage) {
        let counters = Arc::clone(&self.counters);
        let _running = GaugeGuard::new(&counters.kv_releases_in_flight);
        let answer = match stage {
            Stage::Idle => return,
            Stage::Handed(leg) => return self.send(leg).await,
            Stage::Answered(answer) => answer,
            Stage::Prefilling(fut) => match tokio::time::timeout(self.grace, fut).await {
                Ok(Ok(PrefillResult::Answer(answer))) => answer,
                // Failed, refused by the engine, or still running: it holds nothing,
                // or is aborted (and frees its blocks) as `fut` drops here.
                _ => return,
            },
        };
        let complete = self.connector.complete(&mut self.handoff, &answer);
        if let Ok(Ok(KvOutcome::Handed)) = tokio::time::timeout(self.wait, complete).await {
            let leg = self.handoff.decode.clone();
            self.send(leg).await;
        }
    }

    /// Send `leg` as a one-token, non-streaming request, and drop it at its response
    /// head or after `wait`.
    async fn send(self, leg: Leg) {
        let body = PrefillRewriter::new()
            .rewrite(self.api, &leg.body)
            .to_bytes();
        let Ok(req) = http_request(self.api, &leg, body, std::iter::empty()) else {
            return;
        };
        bump(&self.counters.kv_releases);
        tracing::debug!(
            decode = %leg.endpoint.id(),
            "releasing the KV of a request that ended before its decode"
        );
        let _ = tokio::time::timeout(self.wait, self.transport.send(req)).await;
    }
}

impl Inner {
    /// The decode leg of a request served without a prefill leg (direct, decode-only):
    /// the client's body, the attempt's engine-side `id` and, when the route names the
    /// decode's data-parallel rank, `X-Data-Parallel-Rank`, which vLLM and SGLang both
    /// read.
    ///
    /// The engines get an id of the proxy's for every attempt, never the client's
    /// `x-request-id`: vLLM's push-mode NIXL pairs the two legs by it, so it must be the
    /// same on both legs and unique among requests in flight, which a client's id (a
    /// retry, a buggy client) is not. The client's id stays in the answer and the logs.
    fn decode_alone(&self, route: &Route, req: &PdRequest, id: HeaderValue) -> Leg {
        let mut leg = Leg::new(route.decode.clone(), req.body().clone());
        leg.headers.insert(REQUEST_ID, id);
        if let Some(rank) = route.decode_rank {
            leg.headers.insert(
                crate::connector::mooncake::DATA_PARALLEL_RANK,
                HeaderValue::from(rank),
            );
        }
        leg
    }

    /// Feedback to the router and the connector.
    fn observe(&self, route: &Route, outcome: Outcome) {
        self.router.observe(route, outcome);
        self.connector.observe(route, outcome);
    }

    /// `e` ends the attempt over `route`: tell the router and the connector how, and
    /// the health tracker which leg's engine failed (when it was the engine's fault).
    fn failed(&self, route: &Route, outcome: Outcome, e: PdError) -> PdError {
        self.observe(route, outcome);
        self.record_failure(route, &e);
        e
    }

    /// Passive health: `e` counts against the endpoint of its leg when the engine is
    /// to blame (it could not be reached, failed, timed out on its own budget, or
    /// answered something unusable), not for the client's errors or the request's
    /// own deadline.
    fn record_failure(&self, route: &Route, e: &PdError) {
        let Some(health) = &self.health else { return };
        if !e.status().is_server_error() || e.is_deadline() {
            return;
        }
        match e.side() {
            Side::Prefill => {
                if let Some(p) = &route.prefill {
                    health.record(p, false);
                }
            }
            Side::Decode => health.record(&route.decode, false),
            _ => {}
        }
    }

    /// The request's deadline: the configured one, shortened by the client's header when
    /// allowed.
    fn clock(&self, req: &PdRequest) -> Clock {
        let configured = self.config.deadline;
        let client = self
            .config
            .client_deadline
            .then(|| req.headers().get(DEADLINE_HEADER))
            .flatten()
            .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
            .map(Duration::from_millis);
        let total = match (configured, client) {
            (Some(c), Some(h)) => Some(c.min(h)),
            (c, h) => c.or(h),
        };
        Clock {
            deadline: total.map(|t| TokioInstant::now() + t),
        }
    }

    async fn serve(self: Arc<Self>, req: PdRequest) -> Result<Response<PdBody>, PdError> {
        bump(&self.counters.requests);
        let decision = self.decide(&req)?;
        self.budget.deposit();
        let clock = self.clock(&req);
        let permit = self.admission.admit(clock.deadline).await?;
        let mut retries = 0;
        let result = loop {
            // The first attempt's engine-side id is the request's own when the proxy drew
            // it (fresh and unique already); a client's id, or a retry, gets a new one.
            let id = if retries == 0 && req.has_generated_id() {
                req.request_id().clone()
            } else {
                self.ids.next_id()
            };
            let e = match self.attempt(&req, id, decision, clock).await {
                Ok(resp) => break Ok(resp),
                Err(e) => e,
            };
            match self.retry_wait(&req, &e, retries, clock) {
                Some(wait) => {
                    retries += 1;
                    tokio::time::sleep(wait).await;
                }
                None => break self.after_failure(&req, e, clock).await,
            }
        };
        match result {
            Ok(mut resp) => {
                resp.body_mut().hold(permit);
                Ok(resp)
            }
            Err(e) => {
                if e.is_deadline() {
                    bump(&self.counters.deadlines_exceeded);
                }
                Err(e)
            }
        }
    }

    /// Whether to disaggregate `req`, decided once per request before anything else:
    /// the connector refuses what the engines would refuse in the fields it rewrites
    /// (400, no engine contacted) and sends direct what it cannot carry; otherwise the
    /// [`Disaggregate`] hook decides.
    fn decide(&self, req: &PdRequest) -> Result<Decision, PdError> {
        let decision = match self.connector.check(req) {
            Ok(Decision::Disaggregate) => self.disaggregate.decide(&RequestView::from(req)),
            Ok(direct) => direct,
            Err(e) => {
                bump(&self.counters.invalid_params);
                return Err(PdError::body(BodyError::Invalid(e)));
            }
        };
        if let Decision::Direct { reason } = decision {
            self.counters.direct(reason);
        }
        Ok(decision)
    }

    /// The wait before retrying after `e`, or `None` when it must not be retried: not
    /// retryable, retries used up, no time left before the deadline, or the budget
    /// spent.
    fn retry_wait(
        &self,
        req: &PdRequest,
        e: &PdError,
        done: u32,
        clock: Clock,
    ) -> Option<Duration> {
        let policy = &self.config.retry;
        if done >= policy.max_retries || !e.is_retryable() {
            return None;
        }
        let wait = policy.backoff(done + 1, self.rng.next_u64());
        if clock
            .deadline
            .is_some_and(|d| TokioInstant::now() + wait >= d)
        {
            return None;
        }
        if !self.budget.withdraw() {
            bump(&self.counters.retries_denied);
            tracing::warn!(
                request_id = ?req.request_id(),
                error = %crate::error::error_chain(e),
                "retry budget spent: not retrying"
            );
            return None;
        }
        bump(&self.counters.retries);
        tracing::warn!(
            request_id = ?req.request_id(),
            error = %crate::error::error_chain(e),
            retry = done + 1,
            backoff_ms = wait.as_millis() as u64,
            "attempt failed before any answer reached the client; retrying on a new pair"
        );
        Some(wait)
    }

    /// The request failed for good with `e`: serve it decode-only when the prefill could
    /// not be had and the policy says so, else fail.
    async fn after_failure(
        &self,
        req: &PdRequest,
        e: PdError,
        clock: Clock,
    ) -> Result<Response<PdBody>, PdError> {
        let prefill_missing = e.side() == Side::Prefill || e.is_no_prefill();
        if self.config.prefill_failure != PrefillFailure::DecodeOnly
            || !prefill_missing
            || e.is_deadline()
            || clock.expired()
        {
            return Err(e);
        }
        bump(&self.counters.prefill_fallbacks);
        tracing::warn!(
            request_id = ?req.request_id(),
            reason = e.code(),
            error = %crate::error::error_chain(&e),
            "prefill unavailable: serving decode-only, as configured"
        );
        let view = RequestView::from(req);
        let set = self.source.snapshot();
        let route = set
            .for_model(req.model())
            .and_then(|candidates| self.router.select_direct(&view, candidates))
            .map_err(PdError::route)?;
        drop(set);
        let leg = self.decode_alone(&route, req, self.ids.next_id());
        let mut resp = self
            .decode(req, route, leg, "decode-only", Timing::default(), clock)
            .await?;
        resp.headers_mut()
            .insert(FALLBACK_HEADER, HeaderValue::from_static(e.code()));
        Ok(resp)
    }

    /// The route for `req`, waiting in the admission queue while an endpoint it chose is
    /// at its in-flight limit.
    async fn route(
        &self,
        req: &PdRequest,
        view: &RequestView<'_>,
        decision: Decision,
        clock: Clock,
    ) -> Result<Route, PdError> {
        let mut since = None;
        loop {
            let set = self.source.snapshot();
            let route = set
                .for_model(req.model())
                .and_then(|candidates| match decision {
                    Decision::Disaggregate => self.router.select(view, candidates),
                    Decision::Direct { .. } => self.router.select_direct(view, candidates),
                })
                .map_err(PdError::route)?;
            drop(set);
            if self.admission.has_room(&route) {
                return Ok(route);
            }
            let since = *since.get_or_insert_with(TokioInstant::now);
            self.admission.wait_for_room(since, clock.deadline).await?;
        }
    }

    /// One attempt: a route, a plan, both legs. Every error here happened before any
    /// byte of an answer reached the client.
    async fn attempt(
        &self,
        req: &PdRequest,
        id: HeaderValue,
        decision: Decision,
        clock: Clock,
    ) -> Result<Response<PdBody>, PdError> {
        let view = RequestView::from(req);
        let route = self.route(req, &view, decision, clock).await?;

        match (decision, &route.prefill) {
            (Decision::Direct { reason }, _) => {
                tracing::debug!(
                    request_id = ?req.request_id(),
                    decode = %route.decode.id(),
                    reason,
                    "not disaggregated: served on a decode endpoint alone"
                );
                let leg = self.decode_alone(&route, req, id);
                return self
                    .decode(req, route, leg, "direct", Timing::default(), clock)
                    .await;
            }
            (Decision::Disaggregate, Some(_)) => {}
            (Decision::Disaggregate, None) => return Err(PdError::route(RouteError::NoPrefill)),
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
        // One engine-side id per attempt, the same on both legs (see `decode_alone`).
        handoff.prefill.headers.insert(REQUEST_ID, id.clone());
        handoff.decode.headers.insert(REQUEST_ID, id);
        let prefill_ep = Arc::clone(&handoff.prefill.endpoint);
        let resolve = self.connector.resolve(&mut handoff, &*self.transport);
        let resolve = resolve.map(|r| r.map_err(|e| PdError::connector(Side::Prefill, e)));
        let budget = self.config.handoff_timeout;
        if let Err(e) = within(
            clock,
            budget,
            Side::Prefill,
            &prefill_ep,
            Phase::Handoff,
            resolve,
        )
        .await
        {
            return Err(self.failed(&route, Outcome::PrefillFailed, e));
        }
        self.dispatch(req, route, handoff, clock).await
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
        clock: Clock,
    ) -> Result<Response<PdBody>, PdError> {
        let start = Instant::now();
        let mut timing = Timing::default();

        let (mark, pending, mut sequential) = match handoff.dispatch {
            Dispatch::AfterPrefill => {
                // Timed here rather than inside: a prefill out of time stays with the
                // early release, which may still catch its answer.
                let exchange = self.exchange(req, &handoff.prefill);
                let mut seq = self.sequential(req, &handoff, Box::pin(exchange));
                let (budget, by_deadline) = clock.budget(self.config.prefill_timeout);
                let result = seq.prefill(budget).await.unwrap_or_else(|| {
                    let ep = &handoff.prefill.endpoint;
                    Err(out_of_time(by_deadline, Side::Prefill, ep, Phase::Prefill))
                });
                let answer = match self.prefill_answer(&route, req, result) {
                    Ok(a) => a,
                    Err(end) => return *end,
                };
                seq.answered(&answer);
                let prefilled = Instant::now();
                timing.prefill = Some(prefilled - start);
                let prefill_ep = Arc::clone(&handoff.prefill.endpoint);
                let complete = self.connector.complete(&mut handoff, &answer);
                let complete =
                    complete.map(|r| r.map_err(|e| PdError::connector(Side::Prefill, e)));
                let budget = self.config.handoff_timeout;
                let handed = within(
                    clock,
                    budget,
                    Side::Prefill,
                    &prefill_ep,
                    Phase::Handoff,
                    complete,
                )
                .await;
                timing.handoff = Some(prefilled.elapsed());
                let mark = match handed {
                    Ok(KvOutcome::Handed) => {
                        seq.handed(&handoff.decode);
                        "kv"
                    }
                    Ok(KvOutcome::Finished) => {
                        seq.disarm();
                        return Ok(self.finished(req, route, handoff, timing, clock));
                    }
                    Ok(_) if self.config.missing_kv == MissingKv::LocalPrefill => {
                        seq.disarm();
                        tracing::warn!(
                            request_id = ?req.request_id(),
                            prefill = %handoff.prefill.endpoint.id(),
                            "prefill returned no KV handoff; decode computes the prompt itself"
                        );
                        "none"
                    }
                    Ok(_) => {
                        seq.disarm();
                        let e = PdError::connector(
                            Side::Prefill,
                            ConnectorError::MissingHandoff {
                                endpoint: handoff.prefill.endpoint.id().clone(),
                                field: "kv handoff",
                            },
                        );
                        return Err(self.failed(&route, Outcome::PrefillFailed, e));
                    }
                    Err(e) => {
                        seq.disarm();
                        return Err(self.failed(&route, Outcome::PrefillFailed, e));
                    }
                };
                if req.is_stream() && handoff.lead.is_some() {
                    // The client's stream starts now; the gate and the decode's head
                    // are waited for inside its body.
                    seq.disarm();
                    return self.lead_stream(req, route, handoff, mark, timing, clock);
                }
                if handoff.gate.is_some() {
                    let budget = self.config.handoff_timeout;
                    if let Err(e) = kv_ready(&handoff, clock, budget).await {
                        // `seq` stays armed: dropping it releases the KV when asked to.
                        return Err(self.failed(&route, Outcome::PrefillFailed, e));
                    }
                    timing.handoff = Some(prefilled.elapsed());
                }
                (mark, None, Some(seq))
            }
            // Boxed only here: the race needs it pinned, and it may move into the body.
            Dispatch::Concurrent => {
                let prefill = self.prefill(req, &handoff.prefill, clock);
                ("kv", Some(Box::pin(prefill)), None)
            }
        };

        let guard = handoff.decode.endpoint.track();
        let decode_start = Instant::now();
        let decode = self.decode_head(req, &handoff.decode, clock);
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
            Ok(h) if h.status().is_success() => self.connector.reply(&handoff, h),
            Ok(h) => h,
            Err(e) => return Err(self.failed(&route, Outcome::DecodeFailed, e)),
        };
        // The decode engine took the leg: its KV is the engine's business now. One that
        // refused it took nothing, so `seq` stays armed and, dropped at the end of this
        // attempt, releases the prefill's KV when asked to.
        if head.status().is_success()
            && let Some(seq) = sequential.as_mut()
        {
            seq.disarm();
        }
        timing.decode_head = Some(decode_start.elapsed());
        // A decode that answered an error needs no KV: the prefill leg is dropped.
        let pending = pending.filter(|_| head.status().is_success());
        let pending: Option<PendingPrefill> =
            pending.map(|p| Box::pin(p.map(|r| r.and_then(PrefillResult::into_late))) as _);
        Ok(self.respond(req, route, guard, head, mark, timing, pending, clock))
    }

    /// A streaming answer that starts with the plan's lead as soon as the prefill
    /// answered: the body then waits for the gate (within the handoff budget), sends the
    /// decode leg (within the decode-head budget) and forwards what
    /// [`KvConnector::reply`] makes of its answer. A failure from here on can only end the
    /// stream, with an error event carrying its code.
    fn lead_stream(
        &self,
        req: &PdRequest,
        route: Route,
        mut handoff: Handoff,
        mark: &'static str,
        timing: Timing,
        clock: Clock,
    ) -> Result<Response<PdBody>, PdError> {
        let lead = handoff.lead.take().unwrap_or_default();
        let http_req = match self.leg_request(req, &handoff.decode) {
            Ok(r) => r,
            Err(e) => return Err(self.failed(&route, Outcome::DecodeFailed, e)),
        };
        let guard = handoff.decode.endpoint.track();
        let transport = Arc::clone(&self.transport);
        let connector = Arc::clone(&self.connector);
        let (gate_budget, head_budget) =
            (self.config.handoff_timeout, self.config.decode_head_timeout);
        let limit = self.config.max_prefill_answer;
        let pending: PendingDecode = Box::pin(async move {
            kv_ready(&handoff, clock, gate_budget).await?;
            let decode_ep = &handoff.decode.endpoint;
            let head = send_decode(&*transport, http_req, decode_ep, clock, head_budget).await?;
            if !head.status().is_success() {
                let (parts, body) = head.into_parts();
                let bytes = read_limited(body, limit).await.unwrap_or_default();
                return Err(PdError::upstream_status(
                    Side::Decode,
                    decode_ep.id().clone(),
                    parts.status,
                    upstream_message(&bytes),
                ));
            }
            Ok(connector.reply(&handoff, head).into_body())
        });
        let body = BoxBody::new(LeadBody::deferred(lead, pending));
        Ok(self.respond(req, route, guard, sse_head(body), mark, timing, None, clock))
    }

    /// The answer when the prefill's is the whole answer ([`KvOutcome::Finished`]): no
    /// decode leg; the connector makes the client's answer from an empty 200.
    fn finished(
        &self,
        req: &PdRequest,
        route: Route,
        mut handoff: Handoff,
        timing: Timing,
        clock: Clock,
    ) -> Response<PdBody> {
        let guard = handoff.decode.endpoint.track();
        let lead = handoff.lead.take().filter(|_| req.is_stream());
        let mut empty = Response::new(empty_body());
        let content_type = if req.is_stream() {
            "text/event-stream"
        } else {
            "application/json"
        };
        empty
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        let shaped = self.connector.reply(&handoff, empty);
        let head = match lead {
            Some(lead) => sse_head(BoxBody::new(LeadBody::then(lead, shaped.into_body()))),
            None => shaped,
        };
        self.respond(req, route, guard, head, "prefill", timing, None, clock)
    }

    /// The prefill exchange of a sequential handoff, with what an early KV release
    /// needs when it is on.
    fn sequential(&self, req: &PdRequest, handoff: &Handoff, prefill: PrefillFuture) -> Sequential {
        let release = match self.config.kv_release {
            KvRelease::Off => None,
            KvRelease::AbortDecode { grace, wait } => Some(Release {
                grace,
                wait,
                handoff: handoff.clone(),
                api: req.api(),
                connector: Arc::clone(&self.connector),
                transport: Arc::clone(&self.transport),
                counters: Arc::clone(&self.counters),
            }),
        };
        Sequential {
            stage: Stage::Prefilling(prefill),
            release,
        }
    }

    /// The prefill's answer, or, when the prefill failed, how the attempt ends: an
    /// engine's 4xx passed through to the client, or the error.
    fn prefill_answer(
        &self,
        route: &Route,
        req: &PdRequest,
        result: Result<PrefillResult, PdError>,
    ) -> Result<PrefillAnswer, Box<Result<Response<PdBody>, PdError>>> {
        if let (Some(health), Some(p), Ok(_)) = (&self.health, &route.prefill, &result) {
            // An answer, even the client's 4xx: the engine works.
            health.record(p, true);
        }
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
            Err(e) => {
                self.record_failure(route, &e);
                Err(e)
            }
        };
        self.observe(route, Outcome::PrefillFailed);
        // Boxed: only failures take this path, and they should not size every answer.
        Err(Box::new(end))
    }

    /// Build the HTTP request for one leg.
    fn leg_request(&self, req: &PdRequest, leg: &Leg) -> Result<http::Request<Bytes>, PdError> {
        let forwarded = req.headers().iter().filter(|(name, _)| {
            (is_session_header(name)
                || self.config.forward_headers.contains(name)
                || (self.config.forward_authorization && *name == header::AUTHORIZATION))
                && !is_rank_header(name)
        });
        http_request(req.api(), leg, leg.body.to_bytes(), forwarded).map_err(|e| {
            let side = match leg.endpoint.role() {
                crate::endpoint::Role::Prefill => Side::Prefill,
                crate::endpoint::Role::Decode => Side::Decode,
            };
            PdError::transport(
                side,
                leg.endpoint.id().clone(),
                crate::error::TransportError::Connect(e.into()),
            )
        })
    }

    /// The prefill exchange within the prefill budget (or the deadline).
    fn prefill(
        &self,
        req: &PdRequest,
        leg: &Leg,
        clock: Clock,
    ) -> impl Future<Output = Result<PrefillResult, PdError>> + Send + 'static {
        let ep = Arc::clone(&leg.endpoint);
        let budget = self.config.prefill_timeout;
        let exchange = self.exchange(req, leg);
        async move { within(clock, budget, Side::Prefill, &ep, Phase::Prefill, exchange).await }
    }

    /// The prefill exchange, untimed: send the leg and read its answer in full. The
    /// future owns what it needs (`'static`), so a concurrent handoff can keep it
    /// running inside the response body and an early release in a background task; it
    /// holds the prefill endpoint's in-flight count until it ends or is dropped.
    fn exchange(
        &self,
        req: &PdRequest,
        leg: &Leg,
    ) -> impl Future<Output = Result<PrefillResult, PdError>> + Send + 'static {
        let ep = Arc::clone(&leg.endpoint);
        let guard = ep.track();
        let http_req = self.leg_request(req, leg);
        let transport = Arc::clone(&self.transport);
        let limit = self.config.max_prefill_answer;
        // Requests waiting for room on this endpoint hear when the exchange ends.
        let admission = self
            .admission
            .per_endpoint()
            .then(|| Arc::clone(&self.admission));
        async move {
            let _guard = guard;
            let _room = admission.map(RoomFreed);
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
            exchange.await
        }
    }

    /// Send the decode leg and wait for its response head, within the decode timeout.
    async fn decode_head(
        &self,
        req: &PdRequest,
        leg: &Leg,
        clock: Clock,
    ) -> Result<Response<BoxBody>, PdError> {
        let http_req = self.leg_request(req, leg)?;
        let budget = self.config.decode_head_timeout;
        send_decode(&*self.transport, http_req, &leg.endpoint, clock, budget).await
    }

    /// A decode leg alone (decode-only serving).
    async fn decode(
        &self,
        req: &PdRequest,
        route: Route,
        leg: Leg,
        mark: &'static str,
        mut timing: Timing,
        clock: Clock,
    ) -> Result<Response<PdBody>, PdError> {
        let guard = leg.endpoint.track();
        let start = Instant::now();
        match self.decode_head(req, &leg, clock).await {
            Ok(head) => {
                timing.decode_head = Some(start.elapsed());
                Ok(self.respond(req, route, guard, head, mark, timing, None, clock))
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
        clock: Clock,
    ) -> Response<PdBody> {
        let (parts, body) = head.into_parts();
        let sse = parts
            .headers
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        let timer = StreamTimer::new(
            self.config.decode_idle_timeout,
            clock.deadline,
            guard.endpoint().id(),
        );
        let mut resp = Response::new(PdBody::stream(
            body,
            sse,
            Finish {
                guard: Some(guard),
                feedback: Some(Feedback {
                    router: Arc::clone(&self.router),
                    connector: Arc::clone(&self.connector),
                    // A decode that answered 5xx failed now; one that streams is told
                    // when its body ends.
                    health: match &self.health {
                        Some(h) if parts.status.is_server_error() => {
                            h.record(&route.decode, false);
                            None
                        }
                        h => h.clone(),
                    },
                    route,
                }),
                permit: None,
            },
            prefill,
            timer,
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

/// A 200 event-stream head over `body`.
fn sse_head(body: BoxBody) -> Response<BoxBody> {
    let mut head = Response::new(body);
    let h = head.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    head
}

/// The HTTP request of a leg: `body` posted to the endpoint's `api` URI with the JSON
/// content type, the `forwarded` client headers, then the leg's own headers, the
/// engine-side request id among them (which win over a forwarded one of the same name).
fn http_request<'a>(
    api: crate::request::Api,
    leg: &Leg,
    body: Bytes,
    forwarded: impl Iterator<Item = (&'a HeaderName, &'a HeaderValue)>,
) -> Result<http::Request<Bytes>, http::Error> {
    let uri = leg.endpoint.api_uri(leg.api.unwrap_or(api))?;
    let mut out = http::Request::new(body);
    *out.method_mut() = http::Method::POST;
    *out.uri_mut() = uri;
    let h = out.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    for (name, value) in forwarded {
        h.append(name.clone(), value.clone());
    }
    for (name, value) in &leg.headers {
        h.insert(name.clone(), value.clone());
    }
    Ok(out)
}

/// Whether `name` pins a request to an engine's data-parallel rank (vLLM's
/// `X-data-parallel-rank`, SGLang's `x-override-disagg-prefill-dp-rank`): only the proxy
/// names ranks, never a forwarded client header.
fn is_rank_header(name: &HeaderName) -> bool {
    name == crate::connector::mooncake::DATA_PARALLEL_RANK
        || name.as_str() == "x-override-disagg-prefill-dp-rank"
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
