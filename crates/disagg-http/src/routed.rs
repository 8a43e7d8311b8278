//! The requests [`PdService`](crate::PdService) serves without the orchestrator, and who
//! hears how each ended.
//!
//! A request the orchestrator does not serve (forwarded unchanged to one engine, sent
//! to a decode engine directly, fanned out to every engine of its model, refused by the
//! key check in front, or refused by the service itself, [`RouteKind`]) has a
//! [`RouteSummary`], made by the service or the layer that served it and told once,
//! when its response ended, to every
//! [`RouteListener`] of [`PdServiceConfig::route_listeners`](crate::PdServiceConfig::route_listeners)
//! (and of the key layer's, `auth::ApiKeyLayer::tell_refusals`, for refusals): its kind, status, duration and bytes. The orchestrator's own requests
//! have a [`Summary`](disagg_core::outcome::Summary) instead, told to the orchestrator's
//! [`Listener`](disagg_core::outcome::Listener)s.
//!
//! A client that leaves before its response head (while its body is read, broken off
//! with its connection, or before the engine answered) makes the summary `cancelled`
//! with status 499, nginx's "client closed request", as the orchestrator's summaries
//! say; one that leaves later keeps the status that went out.
//!
//! `metrics::Metrics` counts them (`disagg_requests_total{route}`),
//! `access_log::AccessLog` writes a line for each, and
//! `disagg-otel`'s `Tracer` exports a server span for each one traced. Listeners run on
//! the request path (at the end of a body): they must be cheap and must not block.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use disagg_core::endpoint::Endpoint;
use disagg_core::orchestrator::PdBody;
use disagg_core::outcome::{Delivery, TraceIds};
use http::{HeaderValue, Method, Response, StatusCode};
use http_body::Body;

/// How a request the orchestrator did not serve was served: the `route` label of
/// `disagg_requests_total` and the access log's `route` field (the orchestrator's own
/// requests are `orchestrated`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RouteKind {
    /// Forwarded unchanged to one engine (`/tokenize`, `/v1/embeddings`, ...).
    Forward,
    /// Forwarded unchanged to one decode engine, marked `x-disagg-handoff: direct`.
    Direct,
    /// An admin request sent to every engine of its model (`/reset_prefix_cache`, ...).
    FanOut,
    /// Refused by the API-key check (401, or 429 for a key over its limits) before any
    /// route was taken.
    KeyRefused,
    /// Answered with an error by the service itself, no engine asked: a closed admin
    /// route (403 `admin_route_closed`), a path with no route (404 `not_found`), a
    /// method the route does not take (405 `method_not_allowed`), a path with no one
    /// meaning (400 `invalid_path`), a compressed body on any route that reads or
    /// forwards one (415 `unsupported_content_encoding`, decided on the head).
    Refused,
}

impl RouteKind {
    /// Every kind, in the order of the metrics' series.
    #[cfg(feature = "metrics")]
    pub(crate) const ALL: [RouteKind; 5] = [
        RouteKind::Forward,
        RouteKind::Direct,
        RouteKind::FanOut,
        RouteKind::KeyRefused,
        RouteKind::Refused,
    ];

    /// The kind in one word: `forward`, `direct`, `fanout`, `key_refused`, `refused`.
    pub fn as_str(self) -> &'static str {
        match self {
            RouteKind::Forward => "forward",
            RouteKind::Direct => "direct",
            RouteKind::FanOut => "fanout",
            RouteKind::KeyRefused => "key_refused",
            RouteKind::Refused => "refused",
        }
    }

    /// The kind's place in [`ALL`](Self::ALL).
    #[cfg(feature = "metrics")]
    pub(crate) fn index(self) -> usize {
        match self {
            RouteKind::Forward => 0,
            RouteKind::Direct => 1,
            RouteKind::FanOut => 2,
            RouteKind::KeyRefused => 3,
            RouteKind::Refused => 4,
        }
    }
}

/// How a request that the orchestrator did not serve ended: forwarded to one engine,
/// fanned out to all, refused by the key check or by the service ([`RouteKind`]). Made
/// by the service or layer that served it and told to every [`RouteListener`] once,
/// when its response ended.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RouteSummary {
    /// How it was served.
    pub kind: RouteKind,
    /// The request's method.
    pub method: Method,
    /// The request's path (its normal form when the service took it).
    pub path: Arc<str>,
    /// The client's `x-request-id`, when it sent one.
    pub request_id: Option<HeaderValue>,
    /// Who sent it, when the server identified the client (an API key's short hash).
    pub client: Option<Arc<str>>,
    /// The engine it was forwarded to (none for a fan-out or a refusal).
    pub endpoint: Option<Arc<Endpoint>>,
    /// The status the client got (499, nginx's "client closed request", when the
    /// client left before the response head, as the orchestrator's
    /// [`Summary::status`](disagg_core::outcome::Summary::status) says).
    pub status: StatusCode,
    /// When the request arrived.
    pub arrival: Instant,
    /// The same moment on the wall clock.
    pub arrival_wall: SystemTime,
    /// When the response ended (its last byte, its break, or the client leaving).
    pub end: Instant,
    /// From arrival to the response's end.
    pub duration: Duration,
    /// Response body bytes handed to the client.
    pub bytes: u64,
    /// How the response ended.
    pub delivery: Delivery,
    /// The request's outcome in one word, by the rule of the orchestrator's requests
    /// ([`Delivery::outcome`]).
    pub outcome: &'static str,
    /// The ids of its span when requests are traced
    /// ([`Orchestrator::route_trace`](disagg_core::Orchestrator::route_trace)); only
    /// [`TraceIds::request`] names a span of it.
    pub trace: Option<TraceIds>,
}

impl RouteSummary {
    /// A request of `kind`, `method` on `path`, that arrived at `arrival`; answered 200
    /// whole now until told otherwise ([`ended`](Self::ended)).
    pub fn new(
        kind: RouteKind,
        method: Method,
        path: impl Into<Arc<str>>,
        arrival: Instant,
    ) -> Self {
        let mut s = RouteSummary {
            kind,
            method,
            path: path.into(),
            request_id: None,
            client: None,
            endpoint: None,
            status: StatusCode::OK,
            arrival,
            arrival_wall: SystemTime::now(),
            end: arrival,
            duration: Duration::ZERO,
            bytes: 0,
            delivery: Delivery::Complete,
            outcome: "success",
            trace: None,
        };
        s.ended(StatusCode::OK, Delivery::Complete);
        s
    }

    /// The response ended now, with `status`, as `delivery` says (its duration and
    /// outcome follow).
    pub fn ended(&mut self, status: StatusCode, delivery: Delivery) {
        let end = tokio::time::Instant::now().into_std();
        let wall = SystemTime::now();
        self.status = status;
        self.delivery = delivery;
        self.outcome = delivery.outcome(status);
        self.end = end;
        self.duration = end.saturating_duration_since(self.arrival);
        self.arrival_wall = wall
            .checked_sub(end.saturating_duration_since(self.arrival))
            .unwrap_or(wall);
    }
}

/// The status of a request whose client left before its response head: none went out;
/// the summary says 499, nginx's "client closed request", as the orchestrator's do.
pub(crate) const CLIENT_CLOSED: StatusCode = match StatusCode::from_u16(499) {
    Ok(status) => status,
    Err(_) => StatusCode::BAD_REQUEST,
};

/// A request the orchestrator does not serve, on its way: its summary is told to the
/// service's [`RouteListeners`] once, when its answer ends, breaks, or is dropped
/// unfinished (the client left: before the answer's head, with status
/// [`CLIENT_CLOSED`]).
pub(crate) struct RouteEnd {
    listeners: RouteListeners,
    pub(crate) summary: RouteSummary,
    told: bool,
    /// The answer's head is known (the engine's, or the proxy's own answer): the
    /// summary's status is the one the client got.
    headed: bool,
}

impl RouteEnd {
    pub(crate) fn new(listeners: RouteListeners, summary: RouteSummary) -> Self {
        RouteEnd {
            listeners,
            summary,
            told: false,
            headed: false,
        }
    }

    /// The answer's head has `status`.
    pub(crate) fn head(&mut self, status: StatusCode) {
        self.summary.status = status;
        self.headed = true;
    }

    /// The answer ended now, as `delivery` says, with the summary's status.
    pub(crate) fn tell(&mut self, delivery: Delivery) {
        if std::mem::replace(&mut self.told, true) {
            return;
        }
        let status = self.summary.status;
        self.summary.ended(status, delivery);
        self.listeners.tell(&self.summary);
    }

    /// The proxy's own answer `resp` (whole in memory: it ends as it is sent) ends the
    /// request.
    pub(crate) fn answered(mut self, resp: &Response<PdBody>) {
        self.head(resp.status());
        self.summary.bytes = resp.body().size_hint().exact().unwrap_or(0);
        self.tell(Delivery::Complete);
    }

    /// The client left before the answer's head (its body broke off with its
    /// connection): told now, cancelled, 499.
    pub(crate) fn left(self) {
        // Unheaded, its drop tells it so.
        drop(self);
    }
}

impl Drop for RouteEnd {
    fn drop(&mut self) {
        // Not told by now: the answer was dropped before its end, or before its head,
        // when no status went out.
        if !self.told && !self.headed {
            self.summary.status = CLIENT_CLOSED;
        }
        self.tell(Delivery::Cancelled);
    }
}

/// Hears how each request the orchestrator did not serve ended ([`RouteSummary`]).
///
/// Called on the request path: must be cheap and must not block.
pub trait RouteListener: Send + Sync + 'static {
    /// `summary` is how a request the orchestrator did not serve ended (forwarded,
    /// fanned out, refused by the key check or by the service).
    fn on_route(&self, summary: &RouteSummary);
}

impl<T: RouteListener + ?Sized> RouteListener for Arc<T> {
    fn on_route(&self, summary: &RouteSummary) {
        (**self).on_route(summary)
    }
}

/// The [`RouteListener`]s of one server, shared by every clone (one per event loop).
#[derive(Clone, Default)]
pub struct RouteListeners(Arc<Vec<Arc<dyn RouteListener>>>);

impl RouteListeners {
    /// `listener` hears every route summary told from now on.
    pub fn push(&mut self, listener: impl RouteListener) {
        Arc::make_mut(&mut self.0).push(Arc::new(listener));
    }

    /// Tell every listener how `summary`'s request ended.
    pub(crate) fn tell(&self, summary: &RouteSummary) {
        for listener in self.0.iter() {
            listener.on_route(summary);
        }
    }
}

impl fmt::Debug for RouteListeners {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RouteListeners")
            .field("len", &self.0.len())
            .finish()
    }
}
