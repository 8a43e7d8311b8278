//! How things ended, in one word: [`Outcome`].
//!
//! | type | how what ended | read by |
//! |---|---|---|
//! | [`Outcome`] | one attempt, in one word | routers' and connectors' `observe`, [`Report::outcome`] |
//! | [`LegOutcome`] | one leg of an attempt (or one call of an engine outside the legs) | passive health, per-endpoint metrics, leg spans |
//! | [`Delivery`] | the client's response: whole, cancelled, broken | [`Summary::outcome`], request metrics, access log |
//!
//! Three types because they are three things: an attempt has two legs, and a request
//! has one response over one or more attempts. The carriers are [`Report`] (one per
//! attempt: its route, its [`Outcome`], each leg's [`LegOutcome`], its timeline) and
//! [`Summary`] (one per request: what the client got, its [`Delivery`]). What a
//! connector's `complete` found in the prefill's answer is not an ending but a step's
//! result: [`HandoffFound`](crate::connector::HandoffFound).
//!
//! Every attempt the orchestrator makes (a request makes one, or more when it is
//! retried) ends exactly once: when it fails before any answer reached the client, when
//! the client's response body ends, breaks or is dropped, or, once routed, when the
//! client leaves before the response head (the `serve` future is dropped: the attempt
//! is [`Outcome::Cancelled`], each leg [`LegOutcome::NotSent`], `Abandoned` or
//! `Answered` as far as it went). At that moment one report is made and handed to the
//! router's and the connector's `observe`, then to every listener: passive health,
//! metrics, tracing. Nothing else reports outcomes, so a listener sees each attempt
//! once and sees them all.
//!
//! Every request the orchestrator parsed or refused ends exactly once too, after its
//! last attempt's report: one [`Summary`] (what the client got, when each byte went,
//! the phases of the attempt that answered) goes to every listener, for request
//! metrics, the request's trace span and an access log. A request refused before any
//! attempt (a malformed body, an invalid parameter, a full queue) has a summary and no
//! report; so has one whose client left before any attempt was routed (while it was
//! tokenized or queued). A client that leaves before the response head makes the
//! summary [`Delivery::Cancelled`] with status 499.
//!
//! A request the orchestrator does not serve (forwarded to one engine, fanned out to
//! all, refused by the key check in front) is the server's business: `disagg-http`
//! records it in its own `RouteSummary`, told to its own route listeners. The core
//! only draws its trace ids ([`Orchestrator::route_trace`](crate::Orchestrator::route_trace)),
//! its one-word outcome follows the same rule ([`Delivery::outcome`]), and how its
//! engine did is told to the listeners as an [`EngineCall`]
//! ([`Orchestrator::engine_call`](crate::Orchestrator::engine_call)), so that passive
//! health hears every route.
//!
//! Listeners run on the request path (at the end of a body, on the task that polls
//! it): they must be cheap, must not block, and must not hold a lock across anything
//! slow.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use http::{HeaderValue, StatusCode};

use crate::endpoint::Endpoint;
use crate::request::Api;
use crate::router::Route;

/// How one attempt ended: the one word routers ([`Router::observe`](crate::Router::observe)),
/// connectors ([`KvConnector::observe`](crate::KvConnector::observe)) and every
/// [`Report`] use. The per-leg detail is the report's [`LegOutcome`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The decode's answer (a 2xx: its 4xx is [`DecodeRefused`](Self::DecodeRefused))
    /// was delivered in full (or the prefill's, when it was the whole answer and no
    /// decode leg was needed).
    Success,
    /// The attempt failed on the prefill side: its leg, or the handoff step after it
    /// (not a refusal: [`PrefillRefused`](Self::PrefillRefused)). The prefill's
    /// [`LegOutcome`] tells whether its engine is to blame.
    PrefillFailed,
    /// The request was refused on the prefill side as the client's fault (or a busy
    /// moment's: 429, 408), not an engine's: the prefill's 4xx, or the connector's own
    /// refusal before any leg was sent (a request it cannot carry,
    /// [`ConnectorError::Unsupported`](crate::error::ConnectorError::Unsupported),
    /// answered 400; its prefill leg [`NotSent`](LegOutcome::NotSent)). No decode
    /// answer was delivered. A prefill's 4xx either passed through to the client
    /// (whole, or broken on its way: its body held a KV handoff the proxy could not
    /// keep from the client), or, both legs sent at once, one that came after the
    /// decode's head and ended its stream (the decode leg dropped). Neither a success
    /// of the route nor a failure of an engine: the prefill's leg is
    /// [`Answered`](LegOutcome::Answered) (or not sent, refused by the connector), the
    /// decode's [`NotSent`](LegOutcome::NotSent) or
    /// [`Abandoned`](LegOutcome::Abandoned). A mid-stream migration's fresh prefill
    /// that refuses its leg is told so too.
    PrefillRefused,
    /// The attempt failed on the decode leg (not a refusal:
    /// [`DecodeRefused`](Self::DecodeRefused)). The decode's [`LegOutcome`] tells whether
    /// its engine is to blame.
    DecodeFailed,
    /// The request was refused on the decode side as the client's fault (or a busy
    /// moment's: 429, 408), not an engine's: the decode's own 4xx (a prompt too long for
    /// it, say; every 4xx of its engine is told so), passed through to the client as the
    /// engine wrote it, or, on a stream the orchestrator began before the decode leg was
    /// sent (a plan's lead), one that ended that stream. No decode answer was
    /// delivered. Neither a success of the route nor a failure of an engine:
    /// the decode's leg is [`Answered`](LegOutcome::Answered) (its engine worked), the
    /// prefill's as far as it went ([`Answered`](LegOutcome::Answered),
    /// [`NotSent`](LegOutcome::NotSent) for a decode served alone, or, both legs sent at
    /// once, [`Abandoned`](LegOutcome::Abandoned): dropped with the answer). A mid-stream
    /// migration's continuation through a fresh prefill whose decode refuses its leg is
    /// told so too.
    DecodeRefused,
    /// The client went away first.
    Cancelled,
}

/// How one leg of an attempt ended (two per attempt; the attempt's end is an
/// [`Outcome`]): what the leg did, as far as its engine's health is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LegOutcome {
    /// The leg was not sent (no prefill endpoint, a direct request, an attempt that
    /// failed before it: for a prefill, a plan the connector could not build or resolve
    /// through no fault of its engine, or the request's deadline passing first).
    NotSent,
    /// The engine answered (its 4xx included: the client's fault, not the engine's) and,
    /// for a decode, its stream ended: the engine worked (passive health counts it a
    /// success, which ends a run of failures). A prefill whose handoff then failed,
    /// through no fault of its engine, or whose client left before the decode leg was
    /// sent, is not answered but [`Abandoned`](Self::Abandoned): its KV was left behind.
    Answered,
    /// The engine is to blame: it could not be reached, answered 5xx, broke its stream,
    /// ran out of its own time budget (for a prefill, the handoff's included: a plan's
    /// resolution or a KV gate that never ended) or answered something unusable (for a
    /// prefill, an answer without a usable KV handoff), or a call the handoff made on
    /// it failed (its bootstrap server, its `/tokenize`). A failure naming a
    /// data-parallel rank of the engine (one a connector picked after routing) is the
    /// engine's.
    Failed,
    /// The leg did not finish, through no fault of its engine: the client left, the
    /// request's total deadline passed, the other leg failed or refused first (both
    /// legs sent at once, this one was dropped), a concurrent prefill still running as
    /// the decode's answer began failed for a reason not its engine's, or, for a
    /// prefill that answered, the handoff then failed for a reason not its engine's
    /// (the connector's configuration, KV it says will not be ready, a call on another
    /// engine, the request's deadline, a migration continuation's own time) or the
    /// client left before the decode leg was sent: its KV was computed and left behind,
    /// never pulled by a decode. A decode whose stream ended in its own error while the
    /// prefill it waited on still ran (that prefill dropped then) is abandoned too:
    /// which engine failed the transfer cannot be told. Passive health counts it neither
    /// way.
    Abandoned,
}

/// How one attempt ended.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Report {
    /// Where it went.
    pub route: Route,
    /// How it ended, for routers and connectors.
    pub outcome: Outcome,
    /// The prefill leg.
    pub prefill: LegOutcome,
    /// The decode leg.
    pub decode: LegOutcome,
    /// Which attempt of its request this was: 0 for the first, 1 for the first retry...
    /// A mid-stream migration's continuation through a fresh prefill (an attempt of its
    /// own: its prefill leg's report, or its failure's) is numbered after the attempt
    /// whose stream it continues: that attempt's number plus the continuation's index
    /// (1 for the first), past every number the request's attempts took. The report
    /// that tells a broken decode failed carries the number of the attempt it belongs
    /// to.
    pub attempt: u32,
    /// When each of its steps happened.
    pub timeline: Timeline,
    /// How long each phase took, from [`timeline`](Self::timeline) (filled when the
    /// report is told).
    pub phases: Phases,
    /// The trace identities of its spans, when the orchestrator traces.
    pub trace: Option<TraceIds>,
    /// The decode, handed the prefill's KV, failed as a decode whose KV load failed
    /// answers: a 5xx head, or a stream relayed as it ended that carried an error event
    /// naming a 5xx or ended without its answer (a completions stream with no finish
    /// reason). Only then may the KV it was handed be what failed (vLLM answers a load
    /// it could not make as its own 500); `false` for a decode that could not be
    /// reached, timed out or broke off its stream, and for every other outcome. A first
    /// decode whose stream broke so and was continued on another decode (mid-stream
    /// migration) is told so by the report that tells it failed, whose prefill leg is
    /// [`NotSent`](LegOutcome::NotSent) (the attempt's report tells that leg).
    pub kv_load_suspect: bool,
    /// The answer moved, by mid-stream migration, to the decode [`route`](Self::route)
    /// names: that decode was never handed this attempt's prefill KV (a continuation
    /// recomputes the prompt, or loads a fresh prefill's), so the answer's end says
    /// nothing of it. The report that told the first decode failed carried what its KV
    /// did ([`kv_load_suspect`](Self::kv_load_suspect)).
    pub moved: bool,
}

impl Report {
    /// A report for an attempt over `route` that ended with `outcome`, its legs judged
    /// `prefill` and `decode`, its steps timed in `timeline`.
    pub(crate) fn new(
        route: Route,
        outcome: Outcome,
        prefill: LegOutcome,
        decode: LegOutcome,
        timeline: Timeline,
    ) -> Self {
        Report {
            route,
            outcome,
            prefill,
            decode,
            attempt: 0,
            timeline,
            phases: Phases::default(),
            trace: None,
            kv_load_suspect: false,
            moved: false,
        }
    }
}

/// Now, on tokio's clock (the same as the system's monotonic clock, except under
/// tokio's paused test clock, where the orchestrator's timers run too).
pub(crate) fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// When each step of one attempt happened; a step that did not happen is `None`.
///
/// Instants, not durations, so that a trace can place each leg's span exactly;
/// [`Report::phases`] and [`Summary::phases`] have the durations the metrics want.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Timeline {
    /// The attempt began (its route chosen, after any admission wait).
    pub start: Instant,
    /// The prefill leg was sent.
    pub prefill_sent: Option<Instant>,
    /// The prefill engine answered (for a concurrent handoff whose prefill was still
    /// running at the decode's head: when its exchange ended, before the stream did,
    /// whether it answered, refused or failed).
    pub prefill_done: Option<Instant>,
    /// The handoff step began: the prefill's answer (sequential), or the plan's
    /// resolution (concurrent).
    pub handoff_start: Option<Instant>,
    /// The decode leg was sent (after the handoff step: the bootstrap, the
    /// notification wait).
    pub decode_sent: Option<Instant>,
    /// The decode engine's response head arrived.
    pub decode_head: Option<Instant>,
    /// The decode's first body chunk arrived (under a lead the proxy streams itself,
    /// LMCache's first token, the first chunk after the decode's head).
    pub decode_first_chunk: Option<Instant>,
    /// The attempt ended: it failed, or its response body ended or was dropped.
    pub end: Option<Instant>,
}

impl Timeline {
    /// A timeline that starts now.
    pub(crate) fn starting() -> Self {
        Timeline::starting_at(now())
    }

    /// A timeline that starts at `start`, no step taken yet.
    pub(crate) fn starting_at(start: Instant) -> Self {
        Timeline {
            start,
            prefill_sent: None,
            prefill_done: None,
            handoff_start: None,
            decode_sent: None,
            decode_head: None,
            decode_first_chunk: None,
            end: None,
        }
    }

    /// How long each phase of the attempt took: the one rule of [`Report::phases`],
    /// [`Summary::phases`] and the `server-timing` header.
    pub(crate) fn phases(&self) -> Phases {
        let between =
            |from: Option<Instant>, to: Option<Instant>| Some(to?.saturating_duration_since(from?));
        Phases {
            prefill: between(self.prefill_sent, self.prefill_done),
            handoff: between(self.handoff_start, self.decode_sent),
            decode_head: between(self.decode_sent, self.decode_head),
            decode_first_chunk: between(self.decode_sent, self.decode_first_chunk),
        }
    }
}

/// How long each phase of one attempt took ([`Report::phases`], [`Summary::phases`]); a
/// phase whose start or end did not happen is `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Phases {
    /// The prefill leg: sent until answered.
    pub prefill: Option<Duration>,
    /// The handoff step: from its start until the decode leg was sent.
    pub handoff: Option<Duration>,
    /// The decode leg's head: sent until its response head arrived.
    pub decode_head: Option<Duration>,
    /// The decode leg's first chunk: sent until its first body chunk arrived.
    pub decode_first_chunk: Option<Duration>,
}

/// How the client's response ended (one per request; its attempts' ends are [`Outcome`]s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Delivery {
    /// The whole answer went out (an error answer included: see [`Summary::status`]).
    Complete,
    /// The client went away before the end.
    Cancelled,
    /// The answer broke after its head went out (a decode stream that failed, a time
    /// limit of the stream, a concurrent prefill that failed).
    Broken,
}

impl Delivery {
    /// A request's outcome in one word, for metric labels and logs, from how its
    /// response ended and the `status` the client got: `success` (a 2xx delivered
    /// whole), `client_error` (4xx), `error` (5xx, or a stream that broke) or
    /// `cancelled` (the client left first). The one rule for every request a server
    /// answers: the orchestrator's ([`Summary::outcome`]) and those it does not serve
    /// (`disagg-http`'s `RouteSummary`).
    pub fn outcome(self, status: StatusCode) -> &'static str {
        match self {
            Delivery::Cancelled => "cancelled",
            Delivery::Broken => "error",
            Delivery::Complete if status.is_success() => "success",
            Delivery::Complete if status.is_client_error() => "client_error",
            Delivery::Complete => "error",
        }
    }
}

/// What a request's encoder stage did ([`encode`](crate::encode)), for its
/// [`Summary`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct EncodeSummary {
    /// Media items sent to encoders.
    pub items: u32,
    /// From the first encoder leg sent to the last answer folded in.
    pub duration: Duration,
    /// When the first encoder leg was sent.
    pub started: Instant,
    /// The stage's span, when the request is traced: each encoder leg's `traceparent`
    /// names it, and `disagg-otel` records it as the request span's child `encode`.
    pub span: Option<[u8; 8]>,
}

/// One mid-stream migration of a request's decode stream
/// ([`MigrationConfig`](crate::orchestrator::MigrationConfig)), for its [`Summary`]: where
/// the stream broke, where it went on, and how long the client's stream stood still.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Migration {
    /// Why the stream broke: `reset`, `eof` (ended before `[DONE]`, or reached it before
    /// its finish reason), `error_frame` (the
    /// `reason` label of `disagg_migrations_total`).
    pub reason: &'static str,
    /// The decode whose stream broke.
    pub from: Arc<Endpoint>,
    /// The decode the continuation was sent to (`None`: none could be chosen).
    pub to: Option<Arc<Endpoint>>,
    /// The prefill of a continuation that went through a fresh prefill leg (`None`:
    /// decode-only).
    pub prefill: Option<Arc<Endpoint>>,
    /// Generated tokens carried over to the continuation.
    pub tokens: u64,
    /// When the client's stream stood still: the break, or for a continuation that
    /// follows one that could not start, the break before that one.
    pub broke: Instant,
    /// When the continuation's first byte went to the client (`None`: it never did; the
    /// continuation failed, or the client left first).
    pub resumed: Option<Instant>,
    /// The time the client's stream stood still: from [`broke`](Self::broke) to
    /// [`resumed`](field@Self::resumed) (`None` when it never resumed); set with `resumed`.
    pub time_lost: Option<Duration>,
    /// The migration's span id, when the request is traced: the continuation's legs
    /// carry it as their `traceparent`'s parent.
    pub span: Option<[u8; 8]>,
}

impl Migration {
    /// The continuation's first byte went to the client at `at`.
    pub(crate) fn resumed(&mut self, at: Instant) {
        self.resumed = Some(at);
        self.time_lost = Some(at.saturating_duration_since(self.broke));
    }
}

/// How one request ended, told once to every listener after its last attempt.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Summary {
    /// The API the client called.
    pub api: Api,
    /// Whether the client asked for a stream.
    pub stream: bool,
    /// The model the body names.
    pub model: Option<Arc<str>>,
    /// The client's request id (its `x-request-id`, or one drawn for it).
    pub request_id: Option<HeaderValue>,
    /// Who sent it, when the server identified the client (an API key's short hash,
    /// never the key; see
    /// [`PdRequest::set_received`](crate::request::PdRequest::set_received)).
    pub client: Option<Arc<str>>,
    /// The engine-side request id of the attempt that answered.
    pub engine_request_id: Option<HeaderValue>,
    /// The status the client got (499, nginx's "client closed request", when the
    /// client left before the response head).
    pub status: StatusCode,
    /// The error code (OpenAI's `code`) when the request failed or its stream broke.
    pub error: Option<&'static str>,
    /// How the KV reached the decode (`x-disagg-handoff`: `kv`, `direct`, ...).
    pub handoff: Option<&'static str>,
    /// Why the request was served decode-only (`x-disagg-fallback`).
    pub fallback: Option<&'static str>,
    /// Where the attempt that answered went.
    pub route: Option<Route>,
    /// Attempts made (0 when refused before any).
    pub attempts: u32,
    /// When the request arrived.
    pub arrival: Instant,
    /// The same moment on the wall clock (for logs and exported spans).
    pub arrival_wall: SystemTime,
    /// Time spent waiting for admission.
    pub queued: Option<Duration>,
    /// The encoder stage, when the request went through one (E/P/D).
    pub encode: Option<EncodeSummary>,
    /// The steps of the attempt that answered.
    pub timeline: Option<Timeline>,
    /// When the first byte of the response body went to the client.
    pub first_byte: Option<Instant>,
    /// When the response ended (its last byte, its break, or the client leaving).
    pub end: Instant,
    /// From arrival to the response's end.
    pub duration: Duration,
    /// From arrival to the first byte of the response body.
    pub time_to_first_byte: Option<Duration>,
    /// How long each phase of the attempt that answered took (from its
    /// [`timeline`](Self::timeline)).
    pub phases: Option<Phases>,
    /// Response body bytes handed to the client.
    pub bytes: u64,
    /// How the response ended.
    pub delivery: Delivery,
    /// The request's outcome in one word, for metric labels and logs: `success` (a 2xx
    /// delivered whole), `client_error` (4xx), `error` (5xx, or a stream that broke) or
    /// `cancelled` (the client left first) ([`Delivery::outcome`]).
    pub outcome: &'static str,
    /// The trace identities of the request's spans, when the orchestrator traces.
    pub trace: Option<TraceIds>,
    /// Times the answer's decode stream was continued on another decode engine
    /// (mid-stream migration); 0 when it was not.
    pub migrations: u32,
    /// Each continuation of the decode stream that was tried, in order (empty when the
    /// stream was not migrated): the migrations above, and those whose continuation
    /// could not start.
    pub migrated: Vec<Migration>,
}

impl Summary {
    /// A summary of a request for `api` that arrived at `arrival` and is answered
    /// `status` now, with nothing else known yet.
    pub(crate) fn new(api: Api, arrival: Instant, status: StatusCode) -> Self {
        // One read of each clock, when the summary is made rather than on arrival.
        let end = now();
        let wall = SystemTime::now();
        Summary {
            api,
            stream: false,
            model: None,
            request_id: None,
            client: None,
            engine_request_id: None,
            status,
            error: None,
            handoff: None,
            fallback: None,
            route: None,
            attempts: 0,
            arrival,
            arrival_wall: wall
                .checked_sub(end.saturating_duration_since(arrival))
                .unwrap_or(wall),
            queued: None,
            encode: None,
            timeline: None,
            first_byte: None,
            end,
            duration: Duration::ZERO,
            time_to_first_byte: None,
            phases: None,
            bytes: 0,
            delivery: Delivery::Complete,
            outcome: "success",
            trace: None,
            migrations: 0,
            migrated: Vec::new(),
        }
    }

    /// The values that follow from the others, filled once, when the summary is told.
    pub(crate) fn finish(&mut self) {
        self.duration = self.end.saturating_duration_since(self.arrival);
        self.time_to_first_byte = self
            .first_byte
            .map(|b| b.saturating_duration_since(self.arrival));
        // Known already when the attempt's report was told from the same timeline.
        if self.phases.is_none() {
            self.phases = self.timeline.as_ref().map(Timeline::phases);
        }
        self.outcome = self.delivery.outcome(self.status);
    }
}

/// Hears how each attempt and each request ended.
///
/// Called on the request path: must be cheap and must not block (see the
/// [module docs](self)). Both methods do nothing unless implemented, so a listener
/// implements what it needs. [`EndpointSource::listener`](crate::EndpointSource::listener)
/// lets a source that keeps per-endpoint state (health) hear the reports of the
/// orchestrator that routes over it, without being wired twice.
pub trait Listener: Send + Sync + 'static {
    /// `report` is how an attempt ended.
    fn on_report(&self, report: &Report) {
        let _ = report;
    }

    /// `summary` is how a request ended (after its last attempt's report).
    fn on_request(&self, summary: &Summary) {
        let _ = summary;
    }

    /// `call` is how a call of an engine outside the legs ended: one the orchestrator
    /// made (its `/tokenize`, for the [`tokens`](crate::tokens) seam; an encoder leg),
    /// or a request an adapter sent to one engine itself and told
    /// ([`Orchestrator::engine_call`](crate::Orchestrator::engine_call)): the engine
    /// answered, or failed through its own fault (unreachable, 5xx, an unusable answer,
    /// no answer within the budget, an answer that broke off or went silent).
    fn on_engine_call(&self, call: &EngineCall) {
        let _ = call;
    }
}

impl<T: Listener + ?Sized> Listener for Arc<T> {
    fn on_report(&self, report: &Report) {
        (**self).on_report(report)
    }

    fn on_request(&self, summary: &Summary) {
        (**self).on_request(summary)
    }

    fn on_engine_call(&self, call: &EngineCall) {
        (**self).on_engine_call(call)
    }
}

/// How one call of an engine outside a request's legs ended
/// ([`Listener::on_engine_call`]).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EngineCall {
    /// The engine, as the set the call picked it from has it (its role included).
    pub endpoint: Arc<crate::endpoint::Endpoint>,
    /// The call: a fixed name, never a client's path (`/tokenize`, an encoder's
    /// `/v1/chat/completions`, `disagg-http`'s route kinds `forwarded`, `direct`,
    /// `fanned out`).
    pub call: &'static str,
    /// [`LegOutcome::Answered`] or [`LegOutcome::Failed`].
    pub outcome: LegOutcome,
    /// Whether the call was work the engine is there for, done for a client (an
    /// encoder leg; generation an adapter sent it direct): its answer shows the engine
    /// at work, as an answered leg does. `false` for a call made for the proxy's own
    /// ends (`/tokenize`) and for a request an adapter forwarded or fanned out to
    /// whatever path its client named (`/version`, `/tokenize`, an admin request, a
    /// 404): an engine answering those may still fail every leg, and a success would
    /// end their run of failures (and, on a half-open engine, close its breaker).
    pub served: bool,
}

/// The W3C trace identities of one request's spans (or of one attempt's, in its report),
/// drawn when the orchestrator traces
/// ([`OrchestratorConfig::trace_ratio`](crate::orchestrator::OrchestratorConfig::trace_ratio)):
/// a span id for the proxy's server span and, per attempt, for the prefill leg, the
/// handoff step and the decode leg; each leg's `traceparent` names its own span. An
/// exporter (`disagg-otel`) builds the spans from these ids and the report's instants.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TraceIds {
    /// The trace: the client's, or drawn for the request.
    pub trace_id: [u8; 16],
    /// The client's span that the request continues, when it sent a `traceparent`.
    pub parent: Option<[u8; 8]>,
    /// The proxy's server span for the request.
    pub request: [u8; 8],
    /// The attempt's prefill leg span (the `traceparent` the prefill engine got).
    pub prefill: [u8; 8],
    /// The attempt's handoff step span.
    pub handoff: [u8; 8],
    /// The attempt's decode leg span (the `traceparent` the decode engine got).
    pub decode: [u8; 8],
    /// Whether the trace is sampled (recorded and exported).
    pub sampled: bool,
    /// The client's `tracestate`, passed on to the legs unchanged.
    pub tracestate: Option<HeaderValue>,
}
