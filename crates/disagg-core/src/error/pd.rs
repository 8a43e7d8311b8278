//! [`PdError`], the opaque edge error, and the [`Side`] a failure belongs to.

use std::fmt;

use http::StatusCode;

use super::{BoxError, ConnectorError, RouteError, TransportError};
use crate::endpoint::EndpointId;
use disagg_json::BodyError;

/// Which party a failure belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Side {
    /// The client sent something unusable.
    Client,
    /// The router had nowhere to send the request.
    Router,
    /// The prefill leg failed.
    Prefill,
    /// The decode leg failed.
    Decode,
    /// An encoder leg failed (the encoder stage of E/P/D, [`encode`](crate::encode)).
    Encode,
}

impl Side {
    /// The side as a lowercase word.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Side::Client => "client",
            Side::Router => "router",
            Side::Prefill => "prefill",
            Side::Decode => "decode",
            Side::Encode => "encode",
        }
    }
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a request was refused for lack of room: `PdError::from(Overload)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Overload {
    /// The admission queue is full (429 `queue_full`).
    QueueFull {
        /// When a client may try again (the `retry-after` header).
        retry_after: std::time::Duration,
    },
    /// The request waited this long in the admission queue without being admitted (503
    /// `queue_timeout`).
    QueueTimeout {
        /// How long it waited.
        waited: std::time::Duration,
    },
    /// The proxy holds as many bytes of request bodies being received as it allows, and
    /// this body would take it past them (503 `server_busy`).
    ServerBusy {
        /// When a client may try again (the `retry-after` header).
        retry_after: std::time::Duration,
    },
}

#[derive(Debug)]
enum Kind {
    Body,
    Route,
    Connector,
    UpstreamStatus {
        endpoint: EndpointId,
        status: StatusCode,
    },
    UpstreamBody {
        endpoint: EndpointId,
    },
    Transport {
        endpoint: EndpointId,
    },
    Timeout {
        endpoint: EndpointId,
        phase: Phase,
    },
    Deadline {
        phase: Phase,
    },
    QueueFull {
        retry_after: std::time::Duration,
    },
    QueueTimeout {
        waited: std::time::Duration,
    },
    ServerBusy {
        retry_after: std::time::Duration,
    },
}

/// The step of a request a time budget covers; each has its own error code
/// ([`HttpFacts::code`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Phase {
    /// The prefill exchange: connect, response head and the whole answer
    /// (`prefill_timeout`).
    Prefill,
    /// The connector's handoff work around the legs: bootstrap lookups, folding the
    /// prefill's answer into the decode leg (`handoff_timeout`).
    Handoff,
    /// From sending the decode leg to its response head, the time to first byte
    /// (`decode_timeout`).
    DecodeHead,
    /// Between two chunks of the decode's body (`decode_idle_timeout`).
    DecodeIdle,
    /// Any other exchange a transport timed out on.
    Response,
    /// The encoder stage: every encoder leg of the request (`encode_timeout`).
    Encode,
}

impl Phase {
    /// The phase in words, as error messages use it.
    fn as_str(self) -> &'static str {
        match self {
            Phase::Prefill => "prefill answer",
            Phase::Handoff => "KV handoff",
            Phase::DecodeHead => "response head",
            Phase::DecodeIdle => "next chunk",
            Phase::Response => "response",
            Phase::Encode => "encoder answers",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What an HTTP layer renders for a [`PdError`] ([`PdError::http`]): the answer's status,
/// the fields of an OpenAI-style error body, and the `retry-after` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct HttpFacts {
    /// The HTTP status a client should see.
    pub status: StatusCode,
    /// A stable, machine-readable code (`snake_case`), used as OpenAI's `error.code`:
    /// `no_decode_endpoint`, `prefill_failed`, `decode_timeout`, `queue_full`, ….
    pub code: &'static str,
    /// OpenAI's `error.type`: `rate_limit_error` for 429, `invalid_request_error` for
    /// other 4xx, `server_error` otherwise.
    pub error_type: &'static str,
    /// The request parameter at fault, OpenAI's `error.param`: set when the proxy
    /// refused a field the engines would refuse ([`InvalidParam`](disagg_json::InvalidParam)).
    pub param: Option<&'static str>,
    /// How long a client should wait before trying again (the `retry-after` header):
    /// set for a full admission queue and for a busy server.
    pub retry_after: Option<std::time::Duration>,
}

/// The error a P/D request ends with, as the HTTP edge sees it.
///
/// Opaque on purpose: match on [`side`](Self::side), the [`http`](Self::http) facts
/// (status, code) and [`is_retryable`](Self::is_retryable), and reach the cause
/// through [`std::error::Error::source`].
pub struct PdError {
    kind: Kind,
    side: Side,
    source: Option<BoxError>,
    /// The routing that gave it counted the request as queued
    /// ([`with_queued`](Self::with_queued)).
    queued: bool,
}

impl PdError {
    fn new(kind: Kind, side: Side, source: Option<BoxError>) -> Self {
        PdError {
            kind,
            side,
            source,
            queued: false,
        }
    }

    /// The same error, saying, when `queued`, that the routing (or the place) that gave
    /// it made the request wait in an admission queue that counts the requests that had
    /// to wait, and counted it there, as [`Route::queued`](crate::router::Route::queued)
    /// says of a route: a routing that waited, then failed (no prefill, no decode, the
    /// wait ran out). The orchestrator tells the request's later routings so (a
    /// decode-only fallback's, a retry's, a mid-stream migration's next place): their
    /// waits do not count it a second time. A mark already set stays.
    #[must_use]
    pub fn with_queued(mut self, queued: bool) -> Self {
        self.queued |= queued;
        self
    }

    /// Whether the routing that gave this error counted the request as queued
    /// ([`with_queued`](Self::with_queued)).
    pub(crate) fn queued(&self) -> bool {
        self.queued
    }

    /// The client's body was not usable ([`BodyError`]), or could not be read (the
    /// client broke off while sending it): `err` says why. 400, or 413
    /// `request_too_large` for [`BodyError::TooLarge`] and 408 `request_timeout` for
    /// [`BodyError::TimedOut`], whose own words are the message.
    pub fn body(err: impl Into<BoxError>) -> Self {
        Self::new(Kind::Body, Side::Client, Some(err.into()))
    }

    /// The connector failed on `side`.
    pub fn connector(side: Side, err: ConnectorError) -> Self {
        Self::new(Kind::Connector, side, Some(err.into()))
    }

    /// An endpoint answered a status the leg cannot go on with; `detail` is the
    /// engine's own message, if it gave one.
    pub(crate) fn upstream_status(
        side: Side,
        endpoint: EndpointId,
        status: StatusCode,
        detail: Option<String>,
    ) -> Self {
        let source = detail.map(|d| BoxError::from(UpstreamMessage(d)));
        Self::new(Kind::UpstreamStatus { endpoint, status }, side, source)
    }

    /// An endpoint answered a body the leg cannot use.
    pub(crate) fn upstream_body(side: Side, endpoint: EndpointId, source: BoxError) -> Self {
        Self::new(Kind::UpstreamBody { endpoint }, side, Some(source))
    }

    /// The transport failed for `endpoint` on `side`'s engine: 502 (`prefill_failed`,
    /// `decode_failed`), or 504 (`prefill_timeout`, `decode_timeout`) for
    /// [`TransportError::Timeout`]. Adapters that forward a request to one engine use it
    /// so that their failures read as the legs' do.
    pub fn transport(side: Side, endpoint: EndpointId, err: TransportError) -> Self {
        match err {
            TransportError::Timeout => Self::timeout(side, endpoint, Phase::Response),
            err => Self::new(Kind::Transport { endpoint }, side, Some(err.into())),
        }
    }

    /// A leg ran out of its own time budget in `phase`.
    pub(crate) fn timeout(side: Side, endpoint: EndpointId, phase: Phase) -> Self {
        Self::new(Kind::Timeout { endpoint, phase }, side, None)
    }

    /// The request's total deadline passed during `phase` (504 `deadline_exceeded`).
    pub(crate) fn deadline(side: Side, phase: Phase) -> Self {
        Self::new(Kind::Deadline { phase }, side, None)
    }

    /// The request's total deadline passed before `side`'s engine sent its response
    /// head (504 `deadline_exceeded`): for an adapter that sends a request to one
    /// engine itself (a direct route) and keeps the orchestrator's deadline
    /// ([`OrchestratorConfig::deadline_for`](crate::orchestrator::OrchestratorConfig::deadline_for)).
    pub fn deadline_exceeded(side: Side) -> Self {
        Self::deadline(side, Phase::DecodeHead)
    }

    /// What an HTTP layer renders for this error: status, OpenAI's `error.code`,
    /// `error.type` and `error.param`, and the `retry-after` header.
    pub fn http(&self) -> HttpFacts {
        HttpFacts {
            status: self.status(),
            code: self.code(),
            error_type: self.error_type(),
            param: self.param(),
            retry_after: self.retry_after(),
        }
    }

    /// How long a client should wait before trying again, for the `retry-after` header:
    /// set for a full admission queue and for a busy server.
    pub(crate) fn retry_after(&self) -> Option<std::time::Duration> {
        match self.kind {
            Kind::QueueFull { retry_after } | Kind::ServerBusy { retry_after } => Some(retry_after),
            _ => None,
        }
    }

    /// Which party the failure belongs to.
    pub fn side(&self) -> Side {
        self.side
    }

    /// The HTTP status a client should see.
    pub(crate) fn status(&self) -> StatusCode {
        match &self.kind {
            Kind::Body => match self.body_error() {
                Some(BodyError::TooLarge { .. }) => StatusCode::PAYLOAD_TOO_LARGE,
                Some(BodyError::TimedOut { .. }) => StatusCode::REQUEST_TIMEOUT,
                _ => StatusCode::BAD_REQUEST,
            },
            Kind::Route => match self.route_error() {
                Some(RouteError::UnknownModel { .. }) => StatusCode::NOT_FOUND,
                Some(RouteError::ModelRequired { .. }) => StatusCode::BAD_REQUEST,
                _ => StatusCode::SERVICE_UNAVAILABLE,
            },
            Kind::Connector if self.is_unsupported() || self.connector_param().is_some() => {
                StatusCode::BAD_REQUEST
            }
            Kind::Connector
            | Kind::UpstreamStatus { .. }
            | Kind::UpstreamBody { .. }
            | Kind::Transport { .. } => StatusCode::BAD_GATEWAY,
            Kind::Timeout { .. } | Kind::Deadline { .. } => StatusCode::GATEWAY_TIMEOUT,
            Kind::QueueFull { .. } => StatusCode::TOO_MANY_REQUESTS,
            Kind::QueueTimeout { .. } | Kind::ServerBusy { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The request parameter at fault, OpenAI's `error.param`: set when the proxy
    /// refused a field the engines would refuse ([`InvalidParam`](disagg_json::InvalidParam)).
    pub(crate) fn param(&self) -> Option<&'static str> {
        if let Some(p) = self.connector_param() {
            return Some(p.param);
        }
        match self.body_error()? {
            BodyError::Invalid(p) => Some(p.param),
            _ => None,
        }
    }

    /// A stable, machine-readable code (`snake_case`), used as OpenAI's `error.code`.
    pub(crate) fn code(&self) -> &'static str {
        match (&self.kind, self.side) {
            (Kind::Body, _) => match self.body_error() {
                Some(BodyError::Invalid(_)) => "invalid_parameter",
                Some(BodyError::TooLarge { .. }) => "request_too_large",
                Some(BodyError::TimedOut { .. }) => "request_timeout",
                _ => "invalid_request_body",
            },
            (Kind::Route, _) => match self.route_error() {
                Some(RouteError::NoPrefill) => "no_prefill_endpoint",
                Some(RouteError::UnknownModel { .. }) => "model_not_found",
                Some(RouteError::ModelRequired { .. }) => "model_required",
                _ => "no_decode_endpoint",
            },
            (Kind::Connector, _) if self.is_unsupported() => "unsupported_by_connector",
            (Kind::Connector, _) if self.connector_param().is_some() => "invalid_parameter",
            (Kind::Deadline { phase }, _) if *phase != Phase::Encode => "deadline_exceeded",
            (Kind::QueueFull { .. }, _) => "queue_full",
            (Kind::QueueTimeout { .. }, _) => "queue_timeout",
            (Kind::ServerBusy { .. }, _) => "server_busy",
            (Kind::Timeout { .. } | Kind::Deadline { .. }, Side::Encode) => "encode_timeout",
            (Kind::Timeout { phase, .. }, side) => match phase {
                Phase::Handoff => "handoff_timeout",
                Phase::DecodeIdle => "decode_idle_timeout",
                _ if side == Side::Prefill => "prefill_timeout",
                _ => "decode_timeout",
            },
            (_, Side::Prefill) => "prefill_failed",
            (_, Side::Encode) => "encode_failed",
            (_, _) => "decode_failed",
        }
    }

    /// OpenAI's `error.type` for the error event that ends a stream with this error: an
    /// engine's own 4xx (a decode refusing its leg after the stream began, or a prefill
    /// riding in the stream) is the request's, `invalid_request_error` (`rate_limit_error` for a 429), though the
    /// proxy's answer to it before a stream began is a 502.
    pub(crate) fn event_type(&self) -> &'static str {
        match self.engine_status().map(|s| s.as_u16()) {
            Some(429) => "rate_limit_error",
            Some(400..=499) => "invalid_request_error",
            _ => self.error_type(),
        }
    }

    /// OpenAI's `error.type` for this error.
    pub(crate) fn error_type(&self) -> &'static str {
        match self.status().as_u16() {
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }

    /// Whether the connector cannot carry this request at all
    /// ([`ConnectorError::Unsupported`]): the client's fault, answered 400.
    fn is_unsupported(&self) -> bool {
        matches!(
            self.connector_error(),
            Some(ConnectorError::Unsupported { .. })
        )
    }

    /// The parameter a connector refused as the engines would
    /// ([`ConnectorError::Invalid`]): the client's fault, answered 400
    /// `invalid_parameter` in the engine's own words.
    fn connector_param(&self) -> Option<&disagg_json::InvalidParam> {
        match self.connector_error()? {
            ConnectorError::Invalid(p) => Some(p),
            _ => None,
        }
    }

    /// The connector's error this is, when it is one ([`PdError::connector`]).
    fn connector_error(&self) -> Option<&ConnectorError> {
        match self.kind {
            Kind::Connector => self.source.as_deref()?.downcast_ref::<ConnectorError>(),
            _ => None,
        }
    }

    /// When this is a connector's error, whether it is the fault of the engine at
    /// `engine` (none: a leg without an engine, which nothing blames), as
    /// [`ConnectorError::blames`] says; `None` for any other error.
    pub(crate) fn connector_blames(&self, engine: Option<&EndpointId>) -> Option<bool> {
        let e = self.connector_error()?;
        Some(engine.is_some_and(|id| e.blames(id)))
    }

    /// Whether the same request could succeed on another prefill/decode pair, and may be
    /// sent again there.
    ///
    /// True for a prefill leg that could not connect or answered 502, 503 or 504, for a
    /// decode leg that could not connect (it certainly never reached the engine), and
    /// for an unreachable bootstrap server. Not for timeouts (a slow engine is rarely
    /// faster the second time, and the deadline has been spent), not for other 5xx (the
    /// engine saw the request and failed on it), never for client errors. A retry is
    /// only ever made before the first byte of an answer reached the client.
    pub fn is_retryable(&self) -> bool {
        match &self.kind {
            Kind::Transport { .. } => self.side == Side::Prefill || self.never_sent(),
            Kind::UpstreamStatus { status, .. } => {
                self.side == Side::Prefill && matches!(status.as_u16(), 502..=504)
            }
            // An unreachable bootstrap server is another prefill's chance.
            Kind::Connector => matches!(
                self.connector_error(),
                Some(ConnectorError::Bootstrap { .. })
            ),
            _ => false,
        }
    }

    /// The status an engine answered with, when this error is that answer.
    pub(crate) fn engine_status(&self) -> Option<StatusCode> {
        match &self.kind {
            Kind::UpstreamStatus { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Whether the leg this error ended certainly never reached its engine: no
    /// connection could be made ([`TransportError::Connect`]).
    pub(crate) fn never_sent(&self) -> bool {
        matches!(self.kind, Kind::Transport { .. })
            && self
                .source
                .as_deref()
                .and_then(|e| e.downcast_ref::<TransportError>())
                .is_some_and(TransportError::is_connect)
    }

    /// Whether the request's total deadline passed (`deadline_exceeded`).
    pub(crate) fn is_deadline(&self) -> bool {
        matches!(self.kind, Kind::Deadline { phase } if phase != Phase::Encode)
    }

    /// Whether no prefill endpoint was available (`no_prefill_endpoint`).
    pub(crate) fn is_no_prefill(&self) -> bool {
        matches!(self.route_error(), Some(RouteError::NoPrefill))
    }

    fn body_error(&self) -> Option<&BodyError> {
        self.source.as_deref()?.downcast_ref::<BodyError>()
    }

    /// Whether the cause's own words are the message (and so not told again as the
    /// source): a client's model the endpoints do not serve, a body too large or too
    /// slow, a parameter a connector refused as the engines would.
    fn told_by_cause(&self) -> bool {
        match self.kind {
            Kind::Route => self.status().is_client_error(),
            Kind::Connector => self.connector_param().is_some(),
            Kind::Body => matches!(
                self.body_error(),
                Some(BodyError::TooLarge { .. } | BodyError::TimedOut { .. })
            ),
            _ => false,
        }
    }

    fn route_error(&self) -> Option<&RouteError> {
        self.source.as_deref()?.downcast_ref::<RouteError>()
    }
}

/// Routing failed (also for a request an adapter forwards to one engine: 503 when no
/// endpoint is available, 404 `model_not_found` for an unknown model).
impl From<RouteError> for PdError {
    fn from(err: RouteError) -> Self {
        Self::new(Kind::Route, Side::Router, Some(err.into()))
    }
}

/// The proxy refused the request for lack of room, as `why` says: a full admission
/// queue (429 `queue_full`), a wait in it that ran out (503 `queue_timeout`), or too
/// many bytes of request bodies being received (503 `server_busy`).
impl From<Overload> for PdError {
    fn from(why: Overload) -> Self {
        let kind = match why {
            Overload::QueueFull { retry_after } => Kind::QueueFull { retry_after },
            Overload::QueueTimeout { waited } => Kind::QueueTimeout { waited },
            Overload::ServerBusy { retry_after } => Kind::ServerBusy { retry_after },
        };
        Self::new(kind, Side::Router, None)
    }
}

impl fmt::Debug for PdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PdError")
            .field("kind", &self.kind)
            .field("side", &self.side)
            .field("source", &self.source)
            .field("queued", &self.queued)
            .finish()
    }
}

impl fmt::Display for PdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Body => match self.body_error() {
                Some(e @ (BodyError::TooLarge { .. } | BodyError::TimedOut { .. })) => {
                    fmt::Display::fmt(e, f)
                }
                _ => f.write_str("invalid request body"),
            },
            // A client's mistake is told in the cause's own words.
            Kind::Route if self.status().is_client_error() => match self.route_error() {
                Some(e) => fmt::Display::fmt(e, f),
                None => f.write_str("no route for the request"),
            },
            Kind::Route => f.write_str("no route for the request"),
            // A parameter the engines would refuse is told in their words alone.
            Kind::Connector => match self.connector_param() {
                Some(p) => fmt::Display::fmt(p, f),
                None => write!(f, "{} handoff failed", self.side),
            },
            Kind::UpstreamStatus { endpoint, status } => {
                write!(f, "{} endpoint {endpoint} answered {status}", self.side)
            }
            Kind::UpstreamBody { endpoint } => {
                write!(
                    f,
                    "{} endpoint {endpoint} sent an unusable answer",
                    self.side
                )
            }
            Kind::Transport { endpoint } => {
                write!(f, "{} endpoint {endpoint} could not be reached", self.side)
            }
            Kind::Timeout { endpoint, phase } => {
                write!(
                    f,
                    "{} endpoint {endpoint} timed out waiting for the {phase}",
                    self.side
                )
            }
            Kind::Deadline { phase } => {
                write!(
                    f,
                    "the request's deadline passed waiting for the {} {phase}",
                    self.side
                )
            }
            Kind::QueueFull { retry_after } => write!(
                f,
                "the proxy is at its in-flight limit and its queue is full; retry after {} s",
                retry_after.as_secs().max(1)
            ),
            Kind::QueueTimeout { waited } => write!(
                f,
                "the request waited {} ms in the admission queue and was not admitted",
                waited.as_millis()
            ),
            Kind::ServerBusy { retry_after } => write!(
                f,
                "the proxy holds as many request bodies as it allows; retry after {} s",
                retry_after.as_secs().max(1)
            ),
        }
    }
}

impl std::error::Error for PdError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        if self.told_by_cause() {
            // Display already told the cause.
            return None;
        }
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// An engine's own error message, kept as the cause of a [`PdError`].
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct UpstreamMessage(String);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::error_chain;

    #[test]
    fn statuses_and_codes() {
        let e = PdError::body(BodyError::NotAnObject);
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert_eq!(e.side(), Side::Client);
        assert_eq!(e.error_type(), "invalid_request_error");
        assert_eq!(
            error_chain(&e),
            "invalid request body: request body must be a JSON object"
        );

        let e = PdError::from(RouteError::NoPrefill);
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.code(), "no_prefill_endpoint");
        assert!(e.is_no_prefill());
        assert!(!e.is_retryable());

        let served: std::sync::Arc<[std::sync::Arc<str>]> = ["llama".into(), "qwen".into()].into();
        let e = PdError::from(RouteError::UnknownModel {
            model: "gpt".into(),
            served: served.clone(),
        });
        assert_eq!(e.status(), StatusCode::NOT_FOUND);
        assert_eq!(e.code(), "model_not_found");
        assert_eq!(e.error_type(), "invalid_request_error");
        assert!(!e.is_retryable());
        assert_eq!(
            error_chain(&e),
            "the model `gpt` does not exist; served models: llama, qwen"
        );
        let e = PdError::from(RouteError::ModelRequired { served });
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert_eq!(e.code(), "model_required");

        let id = EndpointId::from("http://p:1");
        let e = PdError::transport(Side::Prefill, id.clone(), TransportError::Timeout);
        assert_eq!(e.status(), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(e.code(), "prefill_timeout");

        let e = PdError::upstream_status(Side::Decode, id, StatusCode::BAD_REQUEST, None);
        assert!(!e.is_retryable());
        assert_eq!(e.code(), "decode_failed");
    }

    #[test]
    fn each_budget_has_its_own_code() {
        let id = EndpointId::from("http://e:1");
        let cases = [
            (
                PdError::timeout(Side::Prefill, id.clone(), Phase::Prefill),
                "prefill_timeout",
            ),
            (
                PdError::timeout(Side::Prefill, id.clone(), Phase::Handoff),
                "handoff_timeout",
            ),
            (
                PdError::timeout(Side::Decode, id.clone(), Phase::DecodeHead),
                "decode_timeout",
            ),
            (
                PdError::timeout(Side::Decode, id, Phase::DecodeIdle),
                "decode_idle_timeout",
            ),
            (
                PdError::deadline(Side::Decode, Phase::DecodeHead),
                "deadline_exceeded",
            ),
        ];
        for (e, code) in cases {
            assert_eq!(e.code(), code);
            assert_eq!(e.is_deadline(), code == "deadline_exceeded", "{code}");
            assert_eq!(e.status(), StatusCode::GATEWAY_TIMEOUT, "{code}");
            assert!(!e.is_retryable(), "{code}");
        }
        let e = PdError::from(Overload::QueueFull {
            retry_after: std::time::Duration::from_secs(2),
        });
        assert_eq!(
            (e.status(), e.code()),
            (StatusCode::TOO_MANY_REQUESTS, "queue_full")
        );
        assert_eq!(e.retry_after(), Some(std::time::Duration::from_secs(2)));
        assert_eq!(e.error_type(), "rate_limit_error");
        // The HTTP facts carry the same answers together.
        assert_eq!(
            e.http(),
            HttpFacts {
                status: StatusCode::TOO_MANY_REQUESTS,
                code: "queue_full",
                error_type: "rate_limit_error",
                param: None,
                retry_after: Some(std::time::Duration::from_secs(2)),
            }
        );
        let e = PdError::from(Overload::QueueTimeout {
            waited: std::time::Duration::from_millis(1500),
        });
        assert_eq!(
            (e.status(), e.code()),
            (StatusCode::SERVICE_UNAVAILABLE, "queue_timeout")
        );
        assert_eq!(e.retry_after(), None);
    }

    #[test]
    fn a_body_too_large_is_413_in_its_own_words() {
        let e = PdError::body(BodyError::TooLarge { limit: 1024 });
        assert_eq!(
            (e.status(), e.code(), e.error_type(), e.side()),
            (
                StatusCode::PAYLOAD_TOO_LARGE,
                "request_too_large",
                "invalid_request_error",
                Side::Client
            )
        );
        assert_eq!(
            error_chain(&e),
            "request body is larger than the limit of 1024 bytes"
        );
        assert!(!e.is_retryable());
    }

    #[test]
    fn a_parameter_a_connector_refuses_is_answered_as_the_checks_refusals() {
        let words = "'max_tokens' or 'max_completion_tokens' is too large: 7.";
        let invalid = disagg_json::InvalidParam::new("max_tokens", words);
        let e = PdError::connector(Side::Prefill, ConnectorError::Invalid(invalid));
        assert_eq!(
            e.http(),
            HttpFacts {
                status: StatusCode::BAD_REQUEST,
                code: "invalid_parameter",
                error_type: "invalid_request_error",
                param: Some("max_tokens"),
                retry_after: None,
            }
        );
        // The engine's words alone, nothing in front of them.
        assert_eq!(error_chain(&e), words);
        assert!(!e.is_retryable());
        assert_eq!(e.side(), Side::Prefill);
        assert_eq!(
            e.connector_blames(Some(&EndpointId::from("http://p:1"))),
            Some(false)
        );
    }

    #[test]
    fn client_body_limits_have_their_codes() {
        let e = PdError::body(BodyError::TimedOut {
            after: std::time::Duration::from_secs(30),
        });
        assert_eq!(
            (e.status(), e.code(), e.error_type(), e.side()),
            (
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                "invalid_request_error",
                Side::Client
            )
        );
        assert_eq!(e.retry_after(), None);
        assert_eq!(
            error_chain(&e),
            "the request body did not arrive within 30000 ms"
        );
        let e = PdError::from(Overload::ServerBusy {
            retry_after: std::time::Duration::from_secs(1),
        });
        assert_eq!(
            (e.status(), e.code(), e.error_type()),
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_busy",
                "server_error"
            )
        );
        assert_eq!(e.retry_after(), Some(std::time::Duration::from_secs(1)));
        assert!(!e.is_retryable());
    }

    #[test]
    fn only_failures_before_the_engine_worked_are_retried() {
        let id = EndpointId::from("http://e:1");
        let refused = || TransportError::Connect("refused".into());
        let broke = || TransportError::Io("reset".into());
        assert!(PdError::transport(Side::Prefill, id.clone(), refused()).is_retryable());
        assert!(PdError::transport(Side::Prefill, id.clone(), broke()).is_retryable());
        assert!(PdError::transport(Side::Decode, id.clone(), refused()).is_retryable());
        assert!(!PdError::transport(Side::Decode, id.clone(), broke()).is_retryable());
        for (status, retry) in [
            (500, false),
            (502, true),
            (503, true),
            (504, true),
            (429, false),
        ] {
            let s = StatusCode::from_u16(status).unwrap();
            let e = PdError::upstream_status(Side::Prefill, id.clone(), s, None);
            assert_eq!(e.is_retryable(), retry, "prefill {status}");
            let e = PdError::upstream_status(Side::Decode, id.clone(), s, None);
            assert!(!e.is_retryable(), "decode {status}");
        }
    }
}
