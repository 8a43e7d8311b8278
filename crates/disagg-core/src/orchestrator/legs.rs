//! The legs: each leg's HTTP request (the headers in one place), the prefill exchange,
//! and the decode's head.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Response, StatusCode};

use crate::connector::{Handoff, Leg, PrefillAnswer};
use crate::endpoint::Endpoint;
use crate::error::{PdError, Phase, Side};
use crate::policy::Permit;
use crate::request::PdRequest;
use crate::transport::{BoxBody, SlicedBody, Transport, read_limited};

use crate::proto::forwardable_header;

use super::Inner;
use super::clock::{Clock, within};

/// What the prefill leg ended with, when it did not fail.
pub(super) enum PrefillResult {
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
    /// The prefill's outcome once the decode's answer is already on its way to the
    /// client: only success or an error can still be told.
    pub(super) fn into_late(self) -> Result<(), PdError> {
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

/// Wait for the plan's [`Handoff::gate`], if any, within `budget` (a handoff step: its
/// failure is the prefill side's).
pub(super) async fn kv_ready(
    handoff: &Handoff,
    clock: Clock,
    budget: Duration,
) -> Result<(), PdError> {
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
pub(super) async fn send_decode(
    transport: &dyn Transport,
    http_req: http::Request<SlicedBody>,
    ep: &Arc<Endpoint>,
    clock: Clock,
    budget: Duration,
) -> Result<Response<BoxBody>, PdError> {
    let send = transport
        .send_sliced(http_req)
        .map(|r| r.map_err(|e| PdError::transport(Side::Decode, ep.id().clone(), e)));
    within(clock, budget, Side::Decode, ep, Phase::DecodeHead, send).await
}

impl Inner {
    /// Build the HTTP request for one leg: its body in pieces, a long prompt as a slice
    /// of the client's buffer ([`SlicedBody`]).
    pub(super) fn leg_request(
        &self,
        req: &PdRequest,
        leg: &Leg,
    ) -> Result<http::Request<SlicedBody>, PdError> {
        let side = match leg.endpoint.role() {
            crate::endpoint::Role::Prefill => Side::Prefill,
            crate::endpoint::Role::Decode => Side::Decode,
            crate::endpoint::Role::Encode => Side::Encode,
        };
        self.leg_request_with(req, leg, SlicedBody::from(&leg.body), side)
    }

    /// Build the HTTP request for one leg carrying `body` (rather than the leg's own), a
    /// leg of `side`.
    pub(super) fn leg_request_with<B>(
        &self,
        req: &PdRequest,
        leg: &Leg,
        body: B,
        side: Side,
    ) -> Result<http::Request<B>, PdError> {
        let forwarded = client_headers(&self.config, req.headers());
        http_request(req.api(), leg, body, forwarded).map_err(|e| {
            PdError::transport(
                side,
                leg.endpoint.id().clone(),
                crate::error::TransportError::Connect(e.into()),
            )
        })
    }

    /// The prefill exchange within the prefill budget (or the deadline).
    pub(super) fn prefill(
        &self,
        req: &PdRequest,
        leg: &Leg,
        hold: Option<Permit>,
        clock: Clock,
    ) -> impl Future<Output = Result<PrefillResult, PdError>> + Send + 'static {
        let ep = Arc::clone(&leg.endpoint);
        let budget = self.config.prefill_timeout;
        let exchange = self.exchange(req, leg, hold);
        async move { within(clock, budget, Side::Prefill, &ep, Phase::Prefill, exchange).await }
    }

    /// The prefill exchange, untimed: send the leg and read its answer in full. The
    /// future owns what it needs (`'static`), so a concurrent handoff can keep it
    /// running inside the response body and an early release in a background task; it
    /// holds the prefill endpoint's in-flight count, and the router's `hold` on the leg
    /// ([`Route::with_holds`](crate::router::Route::with_holds)), until it ends or is dropped.
    pub(super) fn exchange(
        &self,
        req: &PdRequest,
        leg: &Leg,
        hold: Option<Permit>,
    ) -> impl Future<Output = Result<PrefillResult, PdError>> + Send + 'static {
        let ep = Arc::clone(&leg.endpoint);
        // The in-flight count drops before the router's hold (a tuple drops its fields
        // in order, whether the future ran or not): a hold given back wakes requests
        // waiting for room on this endpoint, which must find its count already down.
        let held = (ep.track(), hold);
        let http_req = self.leg_request(req, leg);
        let transport = Arc::clone(&self.transport);
        let limit = self.config.max_prefill_answer;
        async move {
            let _held = held;
            let http_req = http_req?;
            let exchange = async {
                let resp = transport
                    .send_sliced(http_req)
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
    pub(super) async fn decode_head(
        &self,
        req: &PdRequest,
        leg: &Leg,
        clock: Clock,
    ) -> Result<Response<BoxBody>, PdError> {
        // Mid-stream migration tracks the ids the decode generates: asked for here.
        let asked = super::migrate::ask_ids(&self.config.migration, req, leg);
        let http_req = self.leg_request(req, asked.as_ref().unwrap_or(leg))?;
        let budget = self.config.decode_head_timeout;
        send_decode(&*self.transport, http_req, &leg.endpoint, clock, budget).await
    }
}

/// A 200 event-stream head over `body`.
pub(super) fn sse_head(body: BoxBody) -> Response<BoxBody> {
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
pub(super) fn http_request<'a, B>(
    api: crate::request::Api,
    leg: &Leg,
    body: B,
    forwarded: impl Iterator<Item = (&'a HeaderName, &'a HeaderValue)>,
) -> Result<http::Request<B>, http::Error> {
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

/// The client's headers a leg carries: the session header, the configured ones and,
/// with `forward_authorization`, `authorization`; never the client's `x-request-id` (the
/// engine-side id is the leg's own, set after these), nor what
/// [`forwardable_header`](crate::proto::forwardable_header) keeps from engines, whatever `forward_headers` lists,
/// nor a header the client's `connection` names (one meant for the proxy alone, as a
/// forwarded request drops it).
pub(super) fn client_headers<'a>(
    config: &'a super::OrchestratorConfig,
    headers: &'a HeaderMap,
) -> impl Iterator<Item = (&'a HeaderName, &'a HeaderValue)> + 'a {
    let auth = config.forward_authorization;
    // Most requests have no `connection` header: then nothing is looked up per header
    // (a walk of a few standard names costs less than hashing one).
    let hop = headers.keys().any(|n| n == header::CONNECTION);
    headers.iter().filter(move |(name, _)| {
        (is_session_header(name)
            || config.forward_headers.contains(name)
            || (auth && *name == header::AUTHORIZATION))
            && forwardable_header(name, auth)
            && *name != crate::request::REQUEST_ID
            && !(hop && named_by_connection(headers, name))
    })
}

/// Whether a `connection` header of `headers` lists `name` (for this hop alone). Cold:
/// kept out of the per-header filter, which stays small enough to be inlined.
#[cold]
#[inline(never)]
fn named_by_connection(headers: &HeaderMap, name: &HeaderName) -> bool {
    crate::proto::connection_names(headers).any(|n| n == name)
}

/// Whether `name` is the session header, whatever `-`/`_` rewriting a proxy did
/// (`x-session-id`, `x_session_id`, ...). Header names are already lowercase.
pub(crate) fn is_session_header(name: &HeaderName) -> bool {
    const WANT: &[u8] = b"x-session-id";
    let got = name.as_str().as_bytes();
    got.len() == WANT.len()
        && got
            .iter()
            .zip(WANT)
            .all(|(g, w)| g == w || (*g == b'_' && *w == b'-'))
}

/// Hop-by-hop headers (RFC 9110 §7.6.1), never forwarded, and `proxy-authenticate`,
/// an engine's challenge to a proxy (a forwarded answer drops it too).
fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "transfer-encoding"
            | "upgrade"
            | "te"
            | "trailer"
    )
}

/// `headers` without the hop-by-hop ones and those the engine's `connection` names,
/// reusing the map (no copy of the rest).
pub(super) fn end_to_end(mut headers: HeaderMap) -> HeaderMap {
    if headers.keys().any(is_hop_by_hop) {
        let named: Vec<HeaderName> = crate::proto::connection_names(&headers).collect();
        for name in named {
            headers.remove(name);
        }
        for name in [
            header::PROXY_AUTHENTICATE,
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

/// The message of an engine's error answer, for the client's error text: OpenAI's
/// `error.message` or vLLM's older top-level `message`, else the body as text; trimmed,
/// at most [`MAX_MESSAGE`] bytes (cut at a character, then `…`).
///
/// Only what is kept is copied: a JSON message is borrowed from the body when it has no
/// escapes, and a body that is not JSON is decoded from its first bytes alone (an error
/// body may be megabytes).
pub(super) fn upstream_message(bytes: &Bytes) -> Option<String> {
    if bytes.is_empty() {
        return None;
    }
    #[derive(serde::Deserialize)]
    struct Wrapped<'a> {
        #[serde(borrow)]
        error: Inner<'a>,
    }
    #[derive(serde::Deserialize)]
    struct Inner<'a> {
        #[serde(borrow)]
        message: std::borrow::Cow<'a, str>,
    }
    let json = serde_json::from_slice::<Wrapped<'_>>(bytes)
        .map(|w| w.error.message)
        .or_else(|_| serde_json::from_slice::<Inner<'_>>(bytes).map(|i| i.message));
    Some(match json {
        Ok(msg) => cut_message(msg.trim()),
        Err(_) => {
            // The spaces around the text (however many), then as many bytes as may be
            // kept and one character more: what decodes from them starts as the whole
            // body's decoding does (a character cut at their end becomes a replacement
            // past what is kept, and a text that goes on is cut with `…`).
            let text = bytes.trim_ascii();
            let head = &text[..text.len().min(MAX_MESSAGE + 4)];
            let decoded = String::from_utf8_lossy(head);
            if head.len() == text.len() {
                cut_message(decoded.trim())
            } else {
                cut_message(decoded.trim_start())
            }
        }
    })
}

/// The message of an engine's error answer `body` (at most `limit` bytes of it), read
/// within `budget`, what is left of the step that brought its head: none when the body
/// does not end in time (an engine that trickles it holds nothing), breaks, or is
/// longer.
pub(super) async fn error_message(body: BoxBody, limit: usize, budget: Duration) -> Option<String> {
    match tokio::time::timeout(budget, read_limited(body, limit)).await {
        Ok(Ok(bytes)) => upstream_message(&bytes),
        Ok(Err(_)) | Err(_) => None,
    }
}

/// Most bytes of an engine's message kept for the client's error text.
const MAX_MESSAGE: usize = 512;

/// `msg` cut to [`MAX_MESSAGE`] bytes at a character (then `…`), in a string of its own
/// size.
fn cut_message(msg: &str) -> String {
    if msg.len() <= MAX_MESSAGE {
        return msg.to_owned();
    }
    let mut cut = MAX_MESSAGE;
    while !msg.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut out = String::with_capacity(cut + '…'.len_utf8());
    out.push_str(&msg[..cut]);
    out.push('…');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An engine's answer loses its hop-by-hop headers, those its `connection` names,
    /// and `proxy-authenticate`; the rest stays.
    #[test]
    fn an_answer_keeps_its_end_to_end_headers_only() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("close, X-Internal"),
        );
        h.insert("x-internal", HeaderValue::from_static("10.0.0.7"));
        h.insert(
            header::PROXY_AUTHENTICATE,
            HeaderValue::from_static("Basic"),
        );
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let kept = end_to_end(h);
        assert_eq!(kept.keys().collect::<Vec<_>>(), [&header::CONTENT_TYPE]);
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
    fn legs_carry_no_credential_or_directive_whatever_the_configuration_lists() {
        let mut config = super::super::OrchestratorConfig::default();
        let mut h = HeaderMap::new();
        for (name, value) in [
            ("x-session-id", "s"),
            ("traceparent", "t"),
            ("authorization", "Bearer sk-client"),
            ("x-api-key", "sk-client"),
            ("x-request-id", "client-id"),
            ("x-override-bootstrap-host", "10.6.6.6"),
            ("x-data-parallel-rank", "3"),
            ("x-other", "o"),
        ] {
            h.insert(
                HeaderName::from_static(name),
                HeaderValue::from_static(value),
            );
            config.forward_headers.push(HeaderName::from_static(name));
        }
        let names = |config: &super::super::OrchestratorConfig| {
            client_headers(config, &h)
                .map(|(n, _)| n.as_str().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&config), ["x-session-id", "traceparent", "x-other"]);
        config.forward_authorization = true;
        assert_eq!(
            names(&config),
            ["x-session-id", "traceparent", "authorization", "x-other"]
        );
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

    /// The message of a long error body keeps nothing of the rest: its text is at most
    /// 512 bytes (and the ellipsis), in a string no larger, whatever shape the body has.
    #[test]
    fn a_long_error_body_leaves_only_a_short_message() {
        let long = "x".repeat(1 << 20);
        let bodies = [
            long.clone(),
            format!("  \n {long}"),
            serde_json::json!({"error": {"message": long}}).to_string(),
            serde_json::json!({"object": "error", "message": long}).to_string(),
        ];
        for body in bodies {
            let m = upstream_message(&Bytes::from(body)).unwrap();
            assert!(m.starts_with('x') && m.len() <= 515 && m.ends_with('…'));
            assert!(m.capacity() < 1024, "{} bytes kept", m.capacity());
        }
        // Spaces after a short text are trimmed too, however many.
        let trailing = format!("boom{}", " ".repeat(4096));
        assert_eq!(
            upstream_message(&Bytes::from(trailing)).as_deref(),
            Some("boom")
        );
        // Spaces before a short text are still trimmed, however many.
        let spaced = format!("{}boom \n", " ".repeat(4096));
        assert_eq!(
            upstream_message(&Bytes::from(spaced)).as_deref(),
            Some("boom")
        );
        assert_eq!(
            upstream_message(&Bytes::from(" ".repeat(4096))).as_deref(),
            Some("")
        );
        // Escapes in a JSON message are read as JSON reads them.
        let m = upstream_message(&Bytes::from_static(
            br#"{"error":{"message":"a\"b\u00e9"}}"#,
        ));
        assert_eq!(m.as_deref(), Some("a\"bé"));
        // A cut inside a character keeps the whole characters before it.
        let m = upstream_message(&Bytes::from(format!("x{}", "é".repeat(600)))).unwrap();
        assert!(m.len() <= 515 && m.ends_with('…') && m.starts_with("xé"));
    }
}
