//! The [`Orchestrator`]: one request's whole way across the prefill and the decode leg.
//!
//! ```text
//! request ─ check (connector) ─ decide ─ admit ─┐
//!   attempt: route → prepare → resolve → legs ──┤ Exchange ─ respond ─ PdBody ─ Report
//!            (AfterPrefill: prefill, complete, decode; Concurrent: both at once)
//!   a failed attempt: Report, then retry (a new route and plan) or fail / decode-only
//! ```
//!
//! | file | holds |
//! |---|---|
//! | `serve.rs` | the request: the connector's check and the disaggregation hook, admission, the attempts and their retries, the decode-only fallback |
//! | `attempt.rs` | one attempt: route (with the admission's per-endpoint limits), plan, legs; a failed attempt carries its report |
//! | `sequential.rs` | [`Dispatch::AfterPrefill`](crate::connector::Dispatch::AfterPrefill) (vLLM NIXL, LMCache) |
//! | `concurrent.rs` | [`Dispatch::Concurrent`](crate::connector::Dispatch::Concurrent) (SGLang, vLLM Mooncake) |
//! | `release.rs` | the KV a sequential prefill holds, released unless its decode took it |
//! | `legs.rs` | each leg's HTTP request (every header in one place), the prefill exchange, the decode's head |
//! | `respond.rs` | the one place the client's response is built |
//! | `answer.rs` | what of an engine's answer reaches the client: its KV handoff overwritten in place, internal redirects and unasked encodings refused (public: `disagg-http` relays forwarded answers through it too) |
//! | `lead.rs` | the body of an answer that starts with a plan's lead, before its decode leg is sent (a connector capability the orchestrator drives for any protocol) |
//! | `body.rs` | [`PdBody`]: the answer streamed frame by frame; its end makes the attempt's [`Report`](crate::outcome::Report) |
//! | `migrate.rs`, `migrate/` | mid-stream migration ([`MigrationConfig`]): a decode stream that breaks mid-answer tracked, continued on another decode (through a fresh prefill when the request was disaggregated: `start.rs`; SGLang's `/generate`: `generate.rs`) and spliced into the client's stream |
//! | `report.rs` | the one place a report is told: router, connector, listeners |
//! | `stats.rs` | the live counters behind [`OrchestratorStats`] |
//! | `clock.rs`, `config.rs` | deadlines and budgets; settings and header names |
//!
//! Failure is fail-fast in both directions. A prefill that fails before the decode's
//! head ends the attempt and drops the decode leg; one that fails after the head was
//! relayed ends the stream (an SSE error event for event streams); a decode that fails
//! drops the prefill leg. A client that leaves drops the response body, and with it
//! whatever leg is still running.
//!
//! The orchestrator owns no per-request state beyond the request's own future and its
//! response body. It spawns one kind of task only: an early KV release
//! ([`KvRelease::AbortDecode`], off by default), bounded in time. Every attempt is
//! reported exactly once ([`outcome`](crate::outcome)).
//!
//! What is not the request path is optional and injected: admission
//! ([`Admission`]), retries ([`Retry`]),
//! listeners ([`Listener`]), the disaggregation hook; `disagg-resilience` has the
//! implementations (limits and a queue, backoff with a budget, passive and active
//! health).

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response};

use crate::connector::KvConnector;
use crate::error::PdError;
use crate::outcome::Listener;
use crate::policy::Admission;
use crate::policy::Retry;
use crate::policy::{Always, Disaggregate};
use crate::request::{PdRequest, RequestIds};
use crate::router::{DefaultRouter, Router};
use crate::source::EndpointSource;
use crate::tokens::Tokenizer;
use crate::transport::Transport;

pub(crate) mod answer;
mod attempt;
mod body;
mod clock;
mod concurrent;
pub(crate) mod config;
mod encode;
mod in_band;
mod lead;
pub(crate) mod legs;
mod migrate;
mod release;
mod report;
mod respond;
mod sequential;
mod serve;
mod sign;
mod stats;

pub use body::PdBody;
pub use config::{KvRelease, MissingKv, OrchestratorConfig, PrefillFailure};
pub use migrate::MigrationConfig;

pub(crate) use report::leg_outcome;
use stats::Counters;

struct Inner {
    /// This orchestrator, for what runs inside a response body and needs its attempt
    /// machinery (a mid-stream migration's continuation through a fresh prefill): weak,
    /// so that a body never keeps an orchestrator alive.
    me: std::sync::Weak<Inner>,
    ids: RequestIds,
    spans: Arc<crate::trace::SpanIds>,
    source: Arc<dyn EndpointSource>,
    router: Arc<dyn Router>,
    connector: Arc<dyn KvConnector>,
    disaggregate: Arc<dyn Disaggregate>,
    /// The tokens seam, set only when a tokenizer was given *and* the router or the
    /// hook reads tokens (decided once, at build): `None` costs nothing per request.
    tokenizer: Option<Arc<dyn Tokenizer>>,
    transport: Arc<dyn Transport>,
    admission: Option<Arc<dyn Admission>>,
    retry: Option<Arc<dyn Retry>>,
    /// The encoder stage (E/P/D), when configured: `None` costs nothing per request.
    encode: Option<Arc<crate::encode::EncodeStage>>,
    reporter: Arc<report::Reporter>,
    counters: Arc<Counters>,
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

/// A snapshot of an orchestrator's counters and gauges, from
/// [`Orchestrator::stats`].
///
/// Counters only grow; gauges (`in_flight`, `queued_now`, `kv_releases_in_flight`) are
/// the current value. All are per orchestrator: an application running several (one per
/// serving thread, say) adds them up.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct OrchestratorStats {
    /// Requests served (each counted once, whatever its retries).
    pub requests: u64,
    /// Requests admitted and not yet ended (their answer's last byte not yet sent):
    /// a gauge.
    pub in_flight: u64,
    /// Requests waiting for admission now: a gauge.
    pub queued_now: u64,
    /// Requests that had to wait for admission.
    pub queued: u64,
    /// Requests refused because the admission queue was full (429).
    pub rejected_queue_full: u64,
    /// Requests that waited too long for admission (503).
    pub queue_timeouts: u64,
    /// Retries made.
    pub retries: u64,
    /// Retries not made because the retry budget was spent.
    pub retries_denied: u64,
    /// Requests served decode-only because their prefill could not be had
    /// ([`PrefillFailure::DecodeOnly`]).
    pub prefill_fallbacks: u64,
    /// Requests that ended because their total deadline passed.
    pub deadlines_exceeded: u64,
    /// Early KV releases sent ([`KvRelease`]).
    pub kv_releases: u64,
    /// Early KV releases still running: a gauge.
    pub kv_releases_in_flight: u64,
    /// Early KV releases not run because too many were running (4,096) or held too
    /// many bytes of legs (512 MiB): those requests' KV is left to the engine's own
    /// expiry.
    pub kv_releases_skipped: u64,
    /// Requests served by a decode engine alone, by reason (`beam_search`,
    /// `prompt_only`, `batch`, `echo` and the like, which the connector cannot carry;
    /// `short_prompt` from
    /// `disagg_affinity::PromptThreshold`; a custom hook's own),
    /// in the order the reasons were first seen.
    pub direct: Vec<(&'static str, u64)>,
    /// Requests refused before routing because an engine would refuse a field the
    /// proxy rewrites (400 `invalid_parameter`).
    pub invalid_params: u64,
    /// Requests whose prompt the [`Tokenizer`] turned into token ids (see
    /// [`tokens`](crate::tokens)).
    pub tokenized: u64,
    /// Requests the [`Tokenizer`] failed on (an error, or slower than
    /// [`OrchestratorConfig::tokenize_timeout`]): routed without token ids.
    pub tokenize_failures: u64,
    /// Prefill answers whose KV handoff the decode engine could not use
    /// ([`HandoffFound::Incomplete`](crate::connector::HandoffFound::Incomplete): a vLLM NIXL
    /// dict without block ids, engine id, host, port or request id). Never sent on;
    /// each was then served as [`MissingKv`] says.
    pub invalid_handoffs: u64,
    /// Mid-stream migrations started ([`MigrationConfig`]), by why the decode stream
    /// broke: `reset`, `eof` (ended before `[DONE]`, or reached it before its finish
    /// reason), `error_frame`.
    pub migrations: Vec<(&'static str, u64)>,
    /// Generated tokens carried over to continuations.
    pub migrated_tokens: u64,
}

/// Builds an [`Orchestrator`].
pub struct OrchestratorBuilder {
    source: Arc<dyn EndpointSource>,
    transport: Arc<dyn Transport>,
    router: Arc<dyn Router>,
    connector: Arc<dyn KvConnector>,
    disaggregate: Arc<dyn Disaggregate>,
    tokenizer: Option<Arc<dyn Tokenizer>>,
    admission: Option<Arc<dyn Admission>>,
    retry: Option<Arc<dyn Retry>>,
    encode: Option<Arc<crate::encode::EncodeStage>>,
    listeners: Vec<Arc<dyn Listener>>,
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
    /// Route with `router` (default: round robin over each role, a private router; the
    /// routing policies to choose from are `disagg-affinity`'s, such as its `PerLeg`).
    pub fn router(mut self, router: impl Router) -> Self {
        self.router = Arc::new(router);
        self
    }

    /// Decide per request whether to disaggregate with `hook` (default: [`Always`]);
    /// see [`policy`](crate::policy).
    pub fn disaggregate(mut self, hook: impl Disaggregate) -> Self {
        self.disaggregate = Arc::new(hook);
        self
    }

    /// Turn prompts into token ids with `tokenizer`, once per request, for a router or
    /// disaggregation hook that reads them (default: none); see [`tokens`](crate::tokens).
    /// When neither reads tokens ([`Router::wants_tokens`],
    /// [`Disaggregate::wants_tokens`]) the tokenizer is never called.
    pub fn tokenizer(mut self, tokenizer: impl Tokenizer) -> Self {
        self.tokenizer = Some(Arc::new(tokenizer));
        self
    }

    /// Limit how many requests run at once with `admission` (default: none, every
    /// request runs at once).
    pub fn admission(mut self, admission: impl Admission) -> Self {
        self.admission = Some(Arc::new(admission));
        self
    }

    /// Retry failed attempts as `retry` says (default: no retries).
    pub fn retry(mut self, retry: impl Retry) -> Self {
        self.retry = Some(Arc::new(retry));
        self
    }

    /// Encode the media items of multimodal requests with `stage` before their P → D
    /// handoff (E/P/D; default: none, every request goes P → D). See
    /// [`encode`](crate::encode).
    pub fn encoder(mut self, stage: Arc<crate::encode::EncodeStage>) -> Self {
        self.encode = Some(stage);
        self
    }

    /// Tell `listener` how each attempt ended. The source's own listener
    /// ([`EndpointSource::listener`]: passive health) is added by the builder.
    pub fn listener(mut self, listener: impl Listener) -> Self {
        self.listeners.push(Arc::new(listener));
        self
    }

    /// Use `config`.
    pub fn config(mut self, config: OrchestratorConfig) -> Self {
        self.config = config;
        self
    }

    /// The orchestrator.
    ///
    /// The builder trusts the source's prefill/decode pairs; to refuse pairs that
    /// cannot hand KV over (`disagg-pairing`'s `check_pair`), build over
    /// `disagg_resilience::pairing::ValidatedSource`, which checks the current set and
    /// every later one.
    pub fn build(self) -> Orchestrator {
        let mut listeners = self.listeners;
        listeners.extend(self.source.listener());
        let reporter = Arc::new(report::Reporter {
            router: Arc::clone(&self.router),
            connector: Arc::clone(&self.connector),
            listeners,
        });
        // Tokenize only for a reader of tokens: a proxy given a tokenizer whose
        // policies read none does no work per request for it.
        let wanted = self.router.wants_tokens() || self.disaggregate.wants_tokens();
        let tokenizer = self.tokenizer.filter(|_| wanted);
        Orchestrator {
            inner: Arc::new_cyclic(|me| Inner {
                me: me.clone(),
                ids: RequestIds::new(),
                spans: Arc::new(crate::trace::SpanIds::new()),
                source: self.source,
                router: self.router,
                connector: self.connector,
                disaggregate: self.disaggregate,
                tokenizer,
                transport: self.transport,
                admission: self.admission,
                retry: self.retry,
                encode: self.encode,
                reporter,
                counters: Arc::default(),
                config: self.config,
            }),
        }
    }
}

impl Orchestrator {
    /// A builder over `source` and `transport`, handing KV over with `connector` (the
    /// engines' protocols are `disagg-connectors`'; the core has no default, since no
    /// protocol is right for every deployment), with round-robin routing until told
    /// otherwise, and no admission limit, retry or listener.
    pub fn builder(
        source: impl EndpointSource,
        transport: impl Transport,
        connector: impl KvConnector,
    ) -> OrchestratorBuilder {
        OrchestratorBuilder {
            source: Arc::new(source),
            transport: Arc::new(transport),
            router: Arc::new(DefaultRouter::default()),
            connector: Arc::new(connector),
            disaggregate: Arc::new(Always),
            tokenizer: None,
            admission: None,
            retry: None,
            encode: None,
            listeners: Vec::new(),
            config: OrchestratorConfig::default(),
        }
    }

    /// Parse a client request for `api`, generating its request id (when the client sent
    /// none) from this orchestrator's own generator (128 random bits drawn once, then a
    /// counter: no randomness per request).
    ///
    /// # Errors
    ///
    /// [`BodyError`](disagg_json::BodyError) as [`PdRequest::new`].
    pub fn request(
        &self,
        api: crate::request::Api,
        headers: HeaderMap,
        body: &Bytes,
    ) -> Result<PdRequest, disagg_json::BodyError> {
        PdRequest::with_ids(api, headers, body, &self.inner.ids)
    }

    /// Tell the listeners of a request for `api` that the server refused before it could
    /// be parsed into a [`PdRequest`] (its body too large or too slow, not JSON): the
    /// summary of a request no attempt was made for. `arrival` is when its head came
    /// in; `request_id` is the client's `x-request-id`, if it sent one.
    pub fn refused(
        &self,
        api: crate::request::Api,
        request_id: Option<HeaderValue>,
        arrival: std::time::Instant,
        error: &PdError,
    ) {
        let reporter = &self.inner.reporter;
        if !reporter.listening() {
            return;
        }
        let mut summary = crate::outcome::Summary::new(api, arrival, error.status());
        summary.request_id = request_id;
        summary.error = Some(error.code());
        reporter.summarize(&mut summary);
    }

    /// Tell the listeners of a request for `api` whose client left before the server
    /// could parse it into a [`PdRequest`] (while its body was read or parsed): the
    /// summary of a request no attempt was made for,
    /// [`Delivery::Cancelled`](crate::outcome::Delivery::Cancelled) with status 499, as
    /// [`serve`](Self::serve) tells one whose client left before the response head.
    /// `arrival` is when its head came in; `request_id` is the client's `x-request-id`,
    /// if it sent one; `client` names who sent it, when the server identified the
    /// client (see [`PdRequest::set_received`]).
    pub fn cancelled(
        &self,
        api: crate::request::Api,
        request_id: Option<HeaderValue>,
        arrival: std::time::Instant,
        client: Option<Arc<str>>,
    ) {
        let reporter = &self.inner.reporter;
        if !reporter.listening() {
            return;
        }
        let mut summary = crate::outcome::Summary::new(api, arrival, serve::CLIENT_CLOSED);
        summary.request_id = request_id;
        summary.client = client;
        summary.delivery = crate::outcome::Delivery::Cancelled;
        reporter.summarize(&mut summary);
    }

    /// The trace ids of a request this orchestrator does not serve (one a server
    /// forwards, fans out or refuses itself, as `disagg-http`'s `RouteSummary` records),
    /// when requests are traced (`trace_ratio`): continuing the trace of `headers`'
    /// `traceparent`, sampled by the ratio otherwise, as the orchestrator's own requests
    /// are. `None` when they are not traced. The core keeps this one piece of those
    /// requests: the ids are drawn by the same private generator and ratio as its own
    /// requests' ids, so that one trace setting covers every request of a server.
    pub fn route_trace(&self, headers: &http::HeaderMap) -> Option<crate::outcome::TraceIds> {
        let i = &self.inner;
        i.config
            .trace_ratio
            .map(|ratio| i.spans.request(headers, ratio))
    }

    /// Tell the listeners how a request this orchestrator does not serve went on the
    /// engine it was sent to (`disagg-http`'s forwarded, direct and fanned-out
    /// requests), as an [`EngineCall`](crate::outcome::EngineCall): `endpoint` as picked
    /// from [`source`](Self::source), `call` a fixed name for the kind of request (never
    /// the client's path: a listener may label by it),
    /// [`LegOutcome::Answered`](crate::outcome::LegOutcome::Answered) (the engine
    /// answered, a 4xx included, and its answer ended) or
    /// [`Failed`](crate::outcome::LegOutcome::Failed) (through the engine's own fault),
    /// and [`served`](crate::outcome::EngineCall::served): whether the request was work
    /// of the kind the engine is there for (generation sent to it direct), whose answer
    /// shows it at work as an answered leg does; not a request forwarded to whatever
    /// path a client named (`/version`, `/tokenize`, a 404), whose answer says nothing
    /// of how it serves generation. Passive health counts a failure as a failed leg, and
    /// an answer as a success only when it was served; the adapter tells nothing for a
    /// request whose client left, whose client's body failed, or whose deadline passed.
    /// The core's own calls (`/tokenize`, encoder legs) are told by the orchestrator
    /// itself.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use disagg_connectors::vllm::VllmNixl;
    /// use disagg_core::endpoint::{Endpoint, Role};
    /// use disagg_core::error::TransportError;
    /// use disagg_core::outcome::{EngineCall, LegOutcome, Listener};
    /// use disagg_core::source::{EndpointSource, StaticSource};
    /// use disagg_core::transport::{ResponseFuture, Transport};
    /// use disagg_core::Orchestrator;
    ///
    /// struct Unused;
    /// impl Transport for Unused {
    ///     fn send(&self, _: http::Request<bytes::Bytes>) -> ResponseFuture {
    ///         Box::pin(async { Err(TransportError::Timeout) })
    ///     }
    /// }
    /// #[derive(Default)]
    /// struct Heard(Mutex<Vec<(&'static str, LegOutcome, bool)>>);
    /// impl Listener for Heard {
    ///     fn on_engine_call(&self, c: &EngineCall) {
    ///         self.0.lock().unwrap().push((c.call, c.outcome, c.served));
    ///     }
    /// }
    ///
    /// let source = Arc::new(StaticSource::new([
    ///     Endpoint::new("http://127.0.0.1:8200", Role::Decode)?,
    /// ]));
    /// let heard = Arc::new(Heard::default());
    /// let orchestrator = Orchestrator::builder(Arc::clone(&source), Unused, VllmNixl::new())
    ///     .listener(Arc::clone(&heard))
    ///     .build();
    /// let decode = Arc::clone(&source.snapshot().by_role(Role::Decode)[0]);
    /// // A request forwarded to `decode` could not reach it; generation sent to it
    /// // direct was answered.
    /// orchestrator.engine_call(&decode, "forwarded", LegOutcome::Failed, false);
    /// orchestrator.engine_call(&decode, "direct", LegOutcome::Answered, true);
    /// assert_eq!(
    ///     *heard.0.lock().unwrap(),
    ///     [("forwarded", LegOutcome::Failed, false), ("direct", LegOutcome::Answered, true)]
    /// );
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn engine_call(
        &self,
        endpoint: &Arc<crate::Endpoint>,
        call: &'static str,
        outcome: crate::outcome::LegOutcome,
        served: bool,
    ) {
        self.inner
            .reporter
            .engine_call(&crate::outcome::EngineCall {
                endpoint: Arc::clone(endpoint),
                call,
                outcome,
                served,
            });
    }

    /// An orchestrator that sends its legs through `transport` and shares everything
    /// else with this one: endpoints, router, connector, settings, listeners, and the
    /// state that must be global to be right (admission, retries, counters).
    ///
    /// A server with one event loop per core builds one orchestrator, then one of these
    /// per loop, each with a transport (and connection pool) of its own.
    pub fn with_transport(&self, transport: impl Transport) -> Orchestrator {
        let i = &self.inner;
        Orchestrator {
            inner: Arc::new_cyclic(|me| Inner {
                me: me.clone(),
                ids: RequestIds::new(),
                spans: Arc::new(crate::trace::SpanIds::new()),
                source: Arc::clone(&i.source),
                router: Arc::clone(&i.router),
                connector: Arc::clone(&i.connector),
                disaggregate: Arc::clone(&i.disaggregate),
                tokenizer: i.tokenizer.clone(),
                transport: Arc::new(transport),
                admission: i.admission.clone(),
                retry: i.retry.clone(),
                encode: i.encode.clone(),
                reporter: Arc::clone(&i.reporter),
                counters: Arc::clone(&i.counters),
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

    /// The router: an adapter that sends generation to one engine itself (a direct
    /// route) takes its engine's place from it ([`Router::place`]), so a limit per
    /// endpoint holds on those routes too.
    pub fn router(&self) -> &dyn Router {
        &*self.inner.router
    }

    /// The limit on requests running at once, when there is one: an adapter that sends
    /// generation to one engine itself (a direct route) takes its places from it too.
    pub fn admission(&self) -> Option<&dyn Admission> {
        self.inner.admission.as_deref()
    }

    /// What this orchestrator counted so far: requests, retries, fallbacks, admission,
    /// early KV releases.
    pub fn stats(&self) -> OrchestratorStats {
        let i = &self.inner;
        let c = &i.counters;
        let a = i.admission.as_ref().map(|a| a.stats()).unwrap_or_default();
        let load = Counters::load;
        OrchestratorStats {
            requests: load(&c.requests),
            in_flight: load(&c.in_flight),
            queued_now: a.waiting,
            queued: a.queued,
            rejected_queue_full: a.queue_full,
            queue_timeouts: a.queue_timeouts,
            retries: load(&c.retries),
            retries_denied: load(&c.retries_denied),
            prefill_fallbacks: load(&c.prefill_fallbacks),
            deadlines_exceeded: load(&c.deadlines_exceeded),
            kv_releases: load(&c.kv_releases),
            kv_releases_in_flight: load(&c.kv_releases_in_flight),
            kv_releases_skipped: load(&c.kv_releases_skipped),
            direct: c.direct_counts(),
            invalid_params: load(&c.invalid_params),
            tokenized: load(&c.tokenized),
            tokenize_failures: load(&c.tokenize_failures),
            invalid_handoffs: load(&c.invalid_handoffs),
            migrations: migrate::Reason::ALL
                .iter()
                .map(|r| (r.as_str(), load(&c.migrations[r.index()])))
                .collect(),
            migrated_tokens: load(&c.migrated_tokens),
        }
    }

    /// Serve `req` disaggregated.
    ///
    /// Resolves to the decode engine's response, whose body streams as the engine writes
    /// it, or to the prefill's answer when that is a client error (4xx, passed through).
    /// The returned future owns everything it needs; dropping it cancels both legs, and
    /// before the response head tells the listeners the request's end as
    /// [`Delivery::Cancelled`](crate::outcome::Delivery::Cancelled) (and its attempt's as
    /// [`Outcome::Cancelled`](crate::outcome::Outcome::Cancelled), once routed).
    ///
    /// # Errors
    ///
    /// [`PdError`] when no route exists, a leg cannot be reached, times out, or answers
    /// something the handoff cannot go on with. See `PdError::http` for the mapping.
    pub fn serve(
        &self,
        req: PdRequest,
    ) -> impl Future<Output = Result<Response<PdBody>, PdError>> + Send + 'static {
        Arc::clone(&self.inner).serve(req)
    }
}

/// `make()`'s future, boxed and pinned, written straight into its allocation.
///
/// `Box::pin(fut)` builds the future on the stack and copies all of it into the box: an
/// `async` block is as large as its largest state, several KiB on the request path, even
/// when it has not started. Allocating first and then writing `make()`'s result lets the
/// compiler build it in place (docs/performance.md, "Futures and bodies copied whole").
fn pin_in_place<F: std::future::Future>(make: impl FnOnce() -> F) -> std::pin::Pin<Box<F>> {
    Box::into_pin(Box::write(Box::new_uninit(), make()))
}
