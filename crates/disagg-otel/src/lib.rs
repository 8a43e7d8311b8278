//! OpenTelemetry traces for disagg: one server span per request with a child span for
//! each attempt's prefill leg, KV handoff step and decode leg, exported over OTLP/HTTP
//! (protobuf) by the OpenTelemetry SDK's batch processor.
//!
//! # How it fits
//!
//! The orchestrator (`disagg-core`) draws the trace ids when it traces
//! (`OrchestratorConfig::trace_ratio`): the client's trace (its `traceparent`) or a new
//! one, a span id for the request and, per attempt, one per leg, the ids each leg's
//! `traceparent` names to its engine. It times every step and tells each attempt's
//! [`Report`] and each request's [`Summary`] to its listeners. [`Tracer`] is such a
//! [`Listener`]: it turns them into finished spans with exactly those ids and instants,
//! so the engines' own spans (vLLM's `--otlp-traces-endpoint`) sit under the proxy's
//! leg spans in the client's trace, and hands them to an SDK
//! [`SpanProcessor`]. The spans are made after the fact, not held open while the request
//! runs: nothing is kept per request, and the core needs no tracing dependency. With
//! the `http` feature (on by default) it is a `disagg_http::routed::RouteListener` too:
//! each traced request `disagg-http` serves without the orchestrator (forwarded, fanned
//! out, refused by the key check) gets a server span ([`route_span`]).
//!
//! Why not the `tracing` crate's OpenTelemetry layer: its spans get their ids from the
//! SDK's id generator when they open, while the legs' `traceparent`s must be sent (and
//! so their ids known) by the core before any span machinery runs; and a `tracing`
//! span held across a streamed response would cost a span's bookkeeping per request
//! even when unsampled. Building `SpanData` from the report keeps one source of truth
//! for the ids and costs nothing for requests that are not sampled.
//!
//! With [`Tracer::otlp`], spans are batched by the SDK's [`BatchSpanProcessor`] on a
//! thread of its own (`OTEL_BSP_*` variables tune it: `OTEL_BSP_SCHEDULE_DELAY`,
//! `OTEL_BSP_MAX_QUEUE_SIZE`, ...) and posted to `ENDPOINT/v1/traces` by a small hyper
//! client on a one-thread runtime of its own: the request path only formats the span
//! and queues it (a full queue drops spans, never waits).
//!
//! An embedder with its own SDK pipeline passes any [`SpanProcessor`] to
//! [`Tracer::with_processor`], or takes the spans themselves from [`request_span`] and
//! [`leg_spans`], placed on the wall clock by one [`SpanClock`].
//!
//! # Spans
//!
//! | span | kind | from, to | attributes |
//! |---|---|---|---|
//! | `POST /v1/chat/completions` (the API's path) | server | arrival, the response's end (last byte, break, client gone) | `http.request.method`, `http.route`, `url.path`, `http.response.status_code`, `gen_ai.operation.name`, `gen_ai.request.model`, `disagg.request_id`, `disagg.engine_request_id`, `disagg.handoff`, `disagg.fallback`, `disagg.attempts`, `disagg.outcome`, `disagg.response_bytes`, `error.type`; event `first_byte` |
//! | `prefill` | client | prefill leg sent, its answer (or the attempt's end) | `server.address`, `server.port`, `disagg.endpoint`, `disagg.attempt`, `disagg.leg.verdict` |
//! | `kv_handoff` | internal | the handoff step's start, the decode leg sent | `disagg.connector`, `disagg.attempt` |
//! | `decode` | client | decode leg sent, the stream's last byte or its cancellation | as `prefill`; events `response_head`, `first_chunk` |
//! | `encode` | internal | the first encoder leg sent, the last encoder answer folded in (E/P/D; only a stage that succeeded: a failed one fails the request, whose span tells it) | `disagg.encode.items`; the encoder legs' `traceparent` names it |
//! | `migration` | internal | the decode stream's break, the continuation's first byte to the client (or the response's end, when it never came) | `disagg.migration.reason`, `disagg.migration.from`, `disagg.migration.to`, `disagg.migration.prefill`, `disagg.migration.tokens`, `disagg.migration.index` |
//!
//! The leg spans are children of the request span; a retried request has one set of
//! leg spans per attempt. A mid-stream migration ([`migration_spans`]) is a child of the
//! request span too, and the continuation's legs carry its id in their `traceparent`,
//! so the engine's spans of the continuation sit under it. A failed leg's status is `Error`; the request span's is
//! `Error` for a 5xx or a broken stream (a 4xx is the client's, per the HTTP
//! semantic conventions for server spans).
//!
//! # Examples
//!
//! ```no_run
//! use disagg_core::orchestrator::OrchestratorBuilder;
//! use disagg_core::orchestrator::OrchestratorConfig;
//! use disagg_otel::{OtlpConfig, Tracer};
//!
//! fn traced(builder: OrchestratorBuilder) -> Result<(OrchestratorBuilder, Tracer), disagg_otel::OtelError> {
//!     let tracer = Tracer::otlp(OtlpConfig::new("http://otel-collector:4318"))?
//!         .with_connector("nixl");
//!     let mut config = OrchestratorConfig::default();
//!     // Sample a tenth of the requests that come without a sampled parent.
//!     config.trace_ratio = Some(0.1);
//!     Ok((builder.config(config).listener(tracer.clone()), tracer))
//! }
//! // ... build and serve; at shutdown: `tracer.shutdown()`.
//! ```

use std::borrow::Cow;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use disagg_core::endpoint::Endpoint;
use disagg_core::outcome::TraceIds;
use disagg_core::outcome::{Delivery, LegOutcome, Listener, Report, Summary};
use disagg_core::request::Api;
#[cfg(feature = "http")]
use disagg_http::routed::{RouteListener, RouteSummary};
use opentelemetry::trace::{
    Event, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SpanData, SpanEvents, SpanExporter, SpanLinks,
    SpanProcessor,
};

mod client;

pub use client::ExportClient;

/// What [`Tracer::otlp`] could not set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OtelError {
    /// The OTLP exporter refused its configuration (an invalid endpoint URL).
    #[error("OTLP exporter: {0}")]
    Exporter(#[source] opentelemetry_otlp::ExporterBuildError),
    /// The exporter's runtime could not start.
    #[error("OTLP exporter runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The endpoint is not an `http://` URL: [`ExportClient`] speaks plain HTTP only, so
    /// an `https://` collector would fail every export, silently, after start-up.
    #[error("OTLP endpoint {0:?}: only http:// collectors are supported")]
    Scheme(String),
}

/// Where and as whom [`Tracer::otlp`] exports.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OtlpConfig {
    /// The collector's base URL; spans are posted to `{endpoint}/v1/traces`.
    pub endpoint: String,
    /// The resource's `service.name`.
    pub service_name: String,
    /// The most one export may take (the OTLP default, 10 s).
    pub timeout: Duration,
}

/// The OTLP exporter's default timeout (OpenTelemetry's `OTEL_EXPORTER_OTLP_TIMEOUT`
/// default).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// The `service.name` when `OTEL_SERVICE_NAME` is not set.
pub const DEFAULT_SERVICE_NAME: &str = "disagg-proxy";

impl OtlpConfig {
    /// Export to the collector at `endpoint` (its base URL: `http://host:4318`), as
    /// `OTEL_SERVICE_NAME` or [`DEFAULT_SERVICE_NAME`].
    pub fn new(endpoint: impl Into<String>) -> Self {
        OtlpConfig {
            endpoint: endpoint.into(),
            service_name: std::env::var("OTEL_SERVICE_NAME")
                .ok()
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| DEFAULT_SERVICE_NAME.to_owned()),
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// The configuration `endpoint` gives, or else the environment's
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`; `None` when neither is set (no tracing).
    pub fn from_flag_or_env(endpoint: Option<&str>) -> Option<Self> {
        let endpoint = match endpoint {
            Some(e) => e.to_owned(),
            None => std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
                .ok()
                .filter(|e| !e.is_empty())?,
        };
        Some(Self::new(endpoint))
    }

    /// The URL spans are posted to: the base URL with `/v1/traces`, as the OTLP
    /// exporter specification builds it from `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub fn traces_url(&self) -> String {
        format!("{}/v1/traces", self.endpoint.trim_end_matches('/'))
    }
}

/// Turns reports and summaries into spans for a [`SpanProcessor`]: a [`Listener`] (see
/// the [crate docs](crate)).
///
/// Cheap to clone: clones share the processor.
#[derive(Clone)]
pub struct Tracer {
    inner: Arc<Inner>,
}

struct Inner {
    processor: Box<dyn SpanProcessor>,
    scope: InstrumentationScope,
    connector: &'static str,
    /// The one reading of both clocks every span is placed with (see [`SpanClock`]).
    clock: Mutex<SpanClock>,
}

impl Inner {
    /// The clock to place spans with now: the same reading as before, unless the wall
    /// clock was stepped since (then a new one).
    fn clock(&self) -> SpanClock {
        let now = SpanClock::now();
        let mut anchor = self.clock.lock().unwrap_or_else(|e| e.into_inner());
        if anchor.stepped(&now) {
            *anchor = now;
        }
        *anchor
    }
}

impl fmt::Debug for Tracer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tracer")
            .field("connector", &self.inner.connector)
            .finish_non_exhaustive()
    }
}

impl Tracer {
    /// A tracer exporting over OTLP/HTTP (protobuf) to `config.traces_url()`, in
    /// batches from a thread of the SDK's; the connector attribute of handoff spans is
    /// unset (see [`with_connector`](Self::with_connector)).
    ///
    /// # Errors
    ///
    /// An endpoint that is not `http://` or that the exporter refuses, or a runtime that
    /// cannot start.
    pub fn otlp(config: OtlpConfig) -> Result<Tracer, OtelError> {
        use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
        let scheme = config.endpoint.split_once("://").map(|(s, _)| s);
        if !scheme.is_some_and(|s| s.eq_ignore_ascii_case("http")) {
            return Err(OtelError::Scheme(config.endpoint));
        }
        let client = ExportClient::new(config.timeout).map_err(OtelError::Runtime)?;
        let mut exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(client)
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(config.traces_url())
            .with_timeout(config.timeout)
            .build()
            .map_err(OtelError::Exporter)?;
        exporter.set_resource(
            &Resource::builder_empty()
                .with_service_name(config.service_name)
                .build(),
        );
        // `BatchConfigBuilder::default` reads the `OTEL_BSP_*` variables.
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(BatchConfigBuilder::default().build())
            .build();
        Ok(Self::with_processor(processor))
    }

    /// A tracer handing its spans to `processor` (an embedder's own pipeline).
    pub fn with_processor(processor: impl SpanProcessor + 'static) -> Tracer {
        Tracer {
            inner: Arc::new(Inner {
                processor: Box::new(processor),
                scope: scope(),
                connector: "",
                clock: Mutex::new(SpanClock::now()),
            }),
        }
    }

    /// The same tracer, naming `connector` ([`KvConnector::name`]) on handoff spans.
    /// Call before cloning.
    ///
    /// [`KvConnector::name`]: disagg_core::KvConnector::name
    pub fn with_connector(mut self, connector: &'static str) -> Tracer {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.connector = connector;
        }
        self
    }

    /// Export the spans queued so far and stop the processor (at shutdown; spans made
    /// later are dropped).
    pub fn shutdown(&self) {
        let _ = self.inner.processor.force_flush();
        let _ = self.inner.processor.shutdown();
    }
}

impl Listener for Tracer {
    fn on_report(&self, report: &Report) {
        let Some(trace) = report.trace.as_ref().filter(|t| t.sampled) else {
            return;
        };
        let i = &self.inner;
        for span in leg_spans(report, trace, i.connector, &i.scope, &i.clock()) {
            i.processor.on_end(span);
        }
    }

    fn on_request(&self, summary: &Summary) {
        let Some(trace) = summary.trace.as_ref().filter(|t| t.sampled) else {
            return;
        };
        let i = &self.inner;
        let clock = i.clock();
        i.processor
            .on_end(request_span(summary, trace, &i.scope, &clock));
        if let Some(span) = encode_span(summary, trace, &i.scope, &clock) {
            i.processor.on_end(span);
        }
        for span in migration_spans(summary, trace, &i.scope, &clock) {
            i.processor.on_end(span);
        }
    }
}

/// A server span for each traced request `disagg-http` serves without the orchestrator
/// ([`route_span`]): attach the tracer to `PdServiceConfig::route_listeners` too.
#[cfg(feature = "http")]
impl RouteListener for Tracer {
    fn on_route(&self, summary: &RouteSummary) {
        let Some(trace) = summary.trace.as_ref().filter(|t| t.sampled) else {
            return;
        };
        let i = &self.inner;
        i.processor
            .on_end(route_span(summary, trace, &i.scope, &i.clock()));
    }
}

/// The server span of a request the orchestrator did not serve (forwarded, fanned out,
/// refused by the key check), with the ids of `trace`: named `METHOD path`, its route
/// kind in `disagg.route`, the engine it went to in `disagg.endpoint`. No leg spans:
/// the request went through unchanged.
#[cfg(feature = "http")]
pub fn route_span(
    summary: &RouteSummary,
    trace: &TraceIds,
    scope: &InstrumentationScope,
    clock: &SpanClock,
) -> SpanData {
    let s = summary;
    let mut attributes = vec![
        KeyValue::new("http.request.method", clip(s.method.as_str()).to_owned()),
        KeyValue::new("url.path", clip(&s.path).to_owned()),
        KeyValue::new("http.response.status_code", i64::from(s.status.as_u16())),
        KeyValue::new("disagg.route", s.kind.as_str()),
        KeyValue::new("disagg.outcome", s.outcome),
        KeyValue::new(
            "disagg.response_bytes",
            i64::try_from(s.bytes).unwrap_or(i64::MAX),
        ),
    ];
    if let Some(e) = &s.endpoint {
        attributes.push(KeyValue::new("disagg.endpoint", e.id().as_str().to_owned()));
    }
    if let Some(id) = &s.request_id {
        attributes.push(KeyValue::new("disagg.request_id", header(id)));
    }
    let failed = s.delivery == Delivery::Broken || s.status.is_server_error();
    SpanData {
        span_context: context(trace, trace.request),
        parent_span_id: trace.parent.map_or(SpanId::INVALID, SpanId::from_bytes),
        parent_span_is_remote: trace.parent.is_some(),
        span_kind: SpanKind::Server,
        name: Cow::Owned(format!("{} {}", clip(s.method.as_str()), clip(&s.path))),
        start_time: clock.wall(s.arrival),
        end_time: clock.wall(s.end.max(s.arrival)),
        attributes,
        dropped_attributes_count: 0,
        events: SpanEvents::default(),
        links: SpanLinks::default(),
        status: if failed {
            Status::error(s.outcome)
        } else {
            Status::Unset
        },
        instrumentation_scope: scope.clone(),
    }
}

/// This crate's instrumentation scope.
fn scope() -> InstrumentationScope {
    InstrumentationScope::builder("disagg")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build()
}

fn context(trace: &TraceIds, span: [u8; 8]) -> SpanContext {
    let state = trace_state(trace.tracestate.as_ref());
    SpanContext::new(
        TraceId::from_bytes(trace.trace_id),
        SpanId::from_bytes(span),
        if trace.sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        },
        false,
        state,
    )
}

/// The client's `tracestate`, when it is one (and not longer than
/// [`MAX_TRACESTATE_BYTES`]).
fn trace_state(header: Option<&http::HeaderValue>) -> TraceState {
    header
        .filter(|v| v.len() <= MAX_TRACESTATE_BYTES)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<TraceState>().ok())
        .unwrap_or(TraceState::NONE)
}

fn operation(api: Api) -> &'static str {
    match api {
        // The GenAI semantic conventions' names: chat, and a prompt completed as text
        // (completions, SGLang's `/generate`, and what a later API adds).
        Api::Chat => "chat",
        _ => "text_completion",
    }
}

/// The most bytes of an attribute value (or span name part) taken from what a client
/// sent: its `model`, path or `x-request-id`. The request is over when its span is
/// queued, so an unbounded value would sit in the batch queue (2,048 spans) outside
/// every per-request budget; a longer value is cut on a character boundary. Model ids,
/// paths and request ids people use are far shorter.
pub const MAX_CLIENT_ATTRIBUTE_BYTES: usize = 256;

/// The most bytes of a `tracestate` header carried into the spans: the W3C Trace Context
/// asks vendors to propagate at least 512 characters and allows dropping a longer
/// one; a longer one is dropped here.
const MAX_TRACESTATE_BYTES: usize = 512;

/// `s` cut to [`MAX_CLIENT_ATTRIBUTE_BYTES`] on a character boundary.
fn clip(s: &str) -> &str {
    if s.len() <= MAX_CLIENT_ATTRIBUTE_BYTES {
        return s;
    }
    let mut end = MAX_CLIENT_ATTRIBUTE_BYTES;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn header(v: &http::HeaderValue) -> String {
    let b = v.as_bytes();
    String::from_utf8_lossy(&b[..b.len().min(MAX_CLIENT_ATTRIBUTE_BYTES)]).into_owned()
}

/// The server span of the request `summary` tells of, with the ids of `trace`, placed on
/// the wall clock by `clock` (the one its [`leg_spans`] are placed by).
pub fn request_span(
    summary: &Summary,
    trace: &TraceIds,
    scope: &InstrumentationScope,
    clock: &SpanClock,
) -> SpanData {
    let s = summary;
    let start = clock.wall(s.arrival);
    let path = s.api.path();
    let mut attributes = vec![
        KeyValue::new("http.request.method", "POST"),
        KeyValue::new("http.route", path),
        KeyValue::new("url.path", path),
        KeyValue::new("http.response.status_code", i64::from(s.status.as_u16())),
        KeyValue::new("gen_ai.operation.name", operation(s.api)),
        KeyValue::new("disagg.attempts", i64::from(s.attempts)),
        KeyValue::new("disagg.outcome", s.outcome),
        KeyValue::new(
            "disagg.response_bytes",
            i64::try_from(s.bytes).unwrap_or(i64::MAX),
        ),
        KeyValue::new("disagg.stream", s.stream),
    ];
    if let Some(model) = &s.model {
        attributes.push(KeyValue::new(
            "gen_ai.request.model",
            clip(model).to_owned(),
        ));
    }
    if let Some(id) = &s.request_id {
        attributes.push(KeyValue::new("disagg.request_id", header(id)));
    }
    if let Some(id) = &s.engine_request_id {
        attributes.push(KeyValue::new("disagg.engine_request_id", header(id)));
    }
    if let Some(h) = s.handoff {
        attributes.push(KeyValue::new("disagg.handoff", h));
    }
    if let Some(f) = s.fallback {
        attributes.push(KeyValue::new("disagg.fallback", f));
    }
    if let Some(e) = s.error {
        attributes.push(KeyValue::new("error.type", e));
    }
    let mut events = SpanEvents::default();
    if let Some(first) = s.time_to_first_byte {
        events
            .events
            .push(Event::new("first_byte", start + first, Vec::new(), 0));
    }
    let failed = s.delivery == Delivery::Broken || s.status.is_server_error();
    SpanData {
        span_context: context(trace, trace.request),
        parent_span_id: trace.parent.map_or(SpanId::INVALID, SpanId::from_bytes),
        parent_span_is_remote: trace.parent.is_some(),
        span_kind: SpanKind::Server,
        name: match s.api {
            Api::Chat => Cow::Borrowed("POST /v1/chat/completions"),
            Api::Completions => Cow::Borrowed("POST /v1/completions"),
            Api::Generate => Cow::Borrowed("POST /generate"),
            other => Cow::Owned(format!("POST {}", other.path())),
        },
        start_time: start,
        end_time: clock.wall(s.end.max(s.arrival)),
        attributes,
        dropped_attributes_count: 0,
        events,
        links: SpanLinks::default(),
        status: if failed {
            Status::error(s.error.unwrap_or("error"))
        } else {
            Status::Unset
        },
        instrumentation_scope: scope.clone(),
    }
}

/// Places [`Instant`]s on the wall clock from one reading of both clocks.
///
/// The spans of a request must be placed by the same reading: two readings differ by
/// the time between reading the monotonic and the wall clock (nanoseconds to
/// microseconds under load), which puts a decode span that ends with its response
/// past its parent's end. One reading kept for many requests stays right because NTP
/// slews Linux's monotonic clock with the wall clock; only a step of the wall clock
/// moves them apart, and [`Tracer`] takes a new reading when it sees one.
#[derive(Debug, Clone, Copy)]
pub struct SpanClock {
    mono: Instant,
    wall: SystemTime,
}

impl SpanClock {
    /// A step of the wall clock against the monotonic one larger than this makes a new
    /// reading: far above the jitter between two readings (microseconds), far below
    /// what a stepped clock moves (ntpd steps only past 128 ms).
    const STEP: Duration = Duration::from_millis(1);

    /// Both clocks read now.
    pub fn now() -> Self {
        SpanClock {
            mono: Instant::now(),
            wall: SystemTime::now(),
        }
    }

    /// Whether the wall clock moved against the monotonic one between this reading and
    /// `later` by more than [`STEP`](Self::STEP).
    fn stepped(&self, later: &SpanClock) -> bool {
        let expected = self.wall(later.mono);
        let skew = match later.wall.duration_since(expected) {
            Ok(d) => d,
            Err(e) => e.duration(),
        };
        skew > Self::STEP
    }

    /// `t` on the wall clock.
    pub fn wall(&self, t: Instant) -> SystemTime {
        match self.mono.checked_duration_since(t) {
            Some(ago) => self.wall - ago,
            None => self.wall + t.saturating_duration_since(self.mono),
        }
    }
}

fn verdict(v: LegOutcome) -> &'static str {
    match v {
        LegOutcome::NotSent => "not_sent",
        LegOutcome::Answered => "answered",
        LegOutcome::Failed => "failed",
        LegOutcome::Abandoned => "abandoned",
        _ => "other",
    }
}

fn leg_attributes(endpoint: &Endpoint, attempt: u32, v: LegOutcome) -> Vec<KeyValue> {
    let authority = endpoint.authority();
    let mut a = vec![
        KeyValue::new("disagg.endpoint", endpoint.id().as_str().to_owned()),
        KeyValue::new("disagg.attempt", i64::from(attempt)),
        KeyValue::new("disagg.leg.verdict", verdict(v)),
    ];
    a.push(KeyValue::new("server.address", endpoint.host().to_owned()));
    if let Some(port) = authority.port_u16() {
        a.push(KeyValue::new("server.port", i64::from(port)));
    }
    a
}

fn leg_status(v: LegOutcome) -> Status {
    match v {
        LegOutcome::Failed => Status::error("the engine failed"),
        _ => Status::Unset,
    }
}

/// The leg spans of the attempt `report` tells of (prefill, handoff, decode: those
/// that happened), children of the request span of `trace`; handoff spans name
/// `connector`. Placed on the wall clock by `clock`, the one the request span is
/// placed by.
pub fn leg_spans(
    report: &Report,
    trace: &TraceIds,
    connector: &'static str,
    scope: &InstrumentationScope,
    clock: &SpanClock,
) -> Vec<SpanData> {
    let tl = &report.timeline;
    let end = tl.end.unwrap_or_else(Instant::now);
    let parent = SpanId::from_bytes(trace.request);
    let span = |id: [u8; 8],
                name: &'static str,
                kind: SpanKind,
                from: Instant,
                to: Instant,
                attributes: Vec<KeyValue>,
                events: SpanEvents,
                status: Status| SpanData {
        span_context: context(trace, id),
        parent_span_id: parent,
        parent_span_is_remote: false,
        span_kind: kind,
        name: Cow::Borrowed(name),
        start_time: clock.wall(from),
        end_time: clock.wall(to.max(from)),
        attributes,
        dropped_attributes_count: 0,
        events,
        links: SpanLinks::default(),
        status,
        instrumentation_scope: scope.clone(),
    };
    let mut spans = Vec::with_capacity(3);
    if let (Some(prefill), Some(sent)) = (&report.route.prefill, tl.prefill_sent) {
        spans.push(span(
            trace.prefill,
            "prefill",
            SpanKind::Client,
            sent,
            tl.prefill_done.unwrap_or(end),
            leg_attributes(prefill, report.attempt, report.prefill),
            SpanEvents::default(),
            leg_status(report.prefill),
        ));
    }
    if let Some(start) = tl.handoff_start {
        let mut attributes = vec![KeyValue::new("disagg.attempt", i64::from(report.attempt))];
        if !connector.is_empty() {
            attributes.push(KeyValue::new("disagg.connector", connector));
        }
        spans.push(span(
            trace.handoff,
            "kv_handoff",
            SpanKind::Internal,
            start,
            tl.decode_sent.unwrap_or(end),
            attributes,
            SpanEvents::default(),
            Status::Unset,
        ));
    }
    if let Some(sent) = tl.decode_sent {
        let mut events = SpanEvents::default();
        for (name, at) in [
            ("response_head", tl.decode_head),
            ("first_chunk", tl.decode_first_chunk),
        ] {
            if let Some(at) = at {
                events
                    .events
                    .push(Event::new(name, clock.wall(at), Vec::new(), 0));
            }
        }
        spans.push(span(
            trace.decode,
            "decode",
            SpanKind::Client,
            sent,
            end,
            leg_attributes(&report.route.decode, report.attempt, report.decode),
            events,
            leg_status(report.decode),
        ));
    }
    spans
}

/// The span of the encoder stage of the request `summary` tells of
/// ([`Summary::encode`], when it has a span id), a child of its request span: from the
/// first encoder leg sent to the last answer folded in, with the media items it sent.
/// Placed on the wall clock by `clock`, the one the request span is placed by.
pub fn encode_span(
    summary: &Summary,
    trace: &TraceIds,
    scope: &InstrumentationScope,
    clock: &SpanClock,
) -> Option<SpanData> {
    let e = summary.encode?;
    let id = e.span?;
    Some(SpanData {
        span_context: context(trace, id),
        parent_span_id: SpanId::from_bytes(trace.request),
        parent_span_is_remote: false,
        span_kind: SpanKind::Internal,
        name: Cow::Borrowed("encode"),
        start_time: clock.wall(e.started),
        end_time: clock.wall(e.started + e.duration),
        attributes: vec![KeyValue::new("disagg.encode.items", i64::from(e.items))],
        dropped_attributes_count: 0,
        events: SpanEvents::default(),
        links: SpanLinks::default(),
        status: Status::Unset,
        instrumentation_scope: scope.clone(),
    })
}

/// The spans of the mid-stream migrations of the request `summary` tells of
/// ([`Summary::migrated`]: those with a span id), children of its request span: each
/// from the break to the continuation's first byte sent to the client, or to the
/// response's end when none came (then its status is `Error`). Placed on the wall clock
/// by `clock`, the one the request span is placed by.
pub fn migration_spans(
    summary: &Summary,
    trace: &TraceIds,
    scope: &InstrumentationScope,
    clock: &SpanClock,
) -> Vec<SpanData> {
    let parent = SpanId::from_bytes(trace.request);
    let mut spans = Vec::new();
    for (n, m) in summary.migrated.iter().enumerate() {
        let Some(id) = m.span else {
            continue;
        };
        let mut attributes = vec![
            KeyValue::new("disagg.migration.reason", m.reason),
            KeyValue::new("disagg.migration.from", m.from.id().as_str().to_owned()),
            KeyValue::new(
                "disagg.migration.tokens",
                i64::try_from(m.tokens).unwrap_or(i64::MAX),
            ),
            KeyValue::new(
                "disagg.migration.index",
                i64::try_from(n + 1).unwrap_or(i64::MAX),
            ),
        ];
        if let Some(to) = &m.to {
            attributes.push(KeyValue::new(
                "disagg.migration.to",
                to.id().as_str().to_owned(),
            ));
        }
        if let Some(p) = &m.prefill {
            attributes.push(KeyValue::new(
                "disagg.migration.prefill",
                p.id().as_str().to_owned(),
            ));
        }
        let end = m.resumed.unwrap_or(summary.end).max(m.broke);
        spans.push(SpanData {
            span_context: context(trace, id),
            parent_span_id: parent,
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name: Cow::Borrowed("migration"),
            start_time: clock.wall(m.broke),
            end_time: clock.wall(end),
            attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: if m.resumed.is_some() {
                Status::Unset
            } else {
                Status::error("the continuation did not reach the client")
            },
            instrumentation_scope: scope.clone(),
        });
    }
    spans
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clip_cuts_on_a_character_boundary_at_the_ceiling() {
        let short = "m".repeat(MAX_CLIENT_ATTRIBUTE_BYTES);
        assert_eq!(clip(&short), short, "at the ceiling: whole");
        let long = format!(
            "{}{}",
            "m".repeat(MAX_CLIENT_ATTRIBUTE_BYTES - 1),
            "é".repeat(4)
        );
        assert_eq!(clip(&long), "m".repeat(MAX_CLIENT_ATTRIBUTE_BYTES - 1));
        let v = http::HeaderValue::from_str(&"i".repeat(4000)).unwrap();
        assert_eq!(header(&v).len(), MAX_CLIENT_ATTRIBUTE_BYTES);
    }

    #[test]
    fn a_tracestate_longer_than_512_bytes_is_dropped() {
        let short = http::HeaderValue::from_static("vendor=opaque");
        assert_eq!(trace_state(Some(&short)).header(), "vendor=opaque");
        // Three members of 200 characters: each valid, 610 bytes in all.
        let list = format!(
            "a={},b={},c={}",
            "x".repeat(200),
            "y".repeat(200),
            "z".repeat(200)
        );
        assert!(list.len() > MAX_TRACESTATE_BYTES);
        let long = http::HeaderValue::from_str(&list).unwrap();
        assert_eq!(trace_state(Some(&long)).header(), "");
    }

    #[test]
    fn an_https_collector_is_refused_at_setup() {
        for endpoint in ["https://collector:4318", "collector:4318", "grpc://c:4317"] {
            let e = Tracer::otlp(OtlpConfig::new(endpoint)).expect_err(endpoint);
            assert!(matches!(e, OtelError::Scheme(_)), "{endpoint}: {e}");
        }
        assert!(Tracer::otlp(OtlpConfig::new("HTTP://127.0.0.1:4318")).is_ok());
    }

    #[test]
    fn a_span_clock_keeps_its_reading_unless_the_wall_clock_was_stepped() {
        let first = SpanClock::now();
        let later = SpanClock::now();
        assert!(!first.stepped(&later), "two readings in a row: no step");
        for moved in [Duration::from_secs(1), Duration::from_millis(2)] {
            let ahead = SpanClock {
                mono: later.mono,
                wall: later.wall + moved,
            };
            let behind = SpanClock {
                mono: later.mono,
                wall: later.wall - moved,
            };
            assert!(first.stepped(&ahead) && first.stepped(&behind), "{moved:?}");
        }
    }
}
