//! Pass-through: a request the [`RouteTable`](crate::routes::RouteTable) does not
//! orchestrate goes to one engine unchanged, or to every engine of its model.
//!
//! A forwarded request takes the legs' road: the orchestrator's transport (its pooled
//! connections), the decode head timeout for the engine's head and the decode idle
//! timeout between chunks of its answer, the healthy endpoints of the source, and
//! OpenAI-format 502/503/504 answers for an engine that fails, is missing or is slow.
//! The client's body is held to
//! [`PdServiceConfig::max_body_bytes`](crate::PdServiceConfig::max_body_bytes) and
//! [`PdServiceConfig::body_timeout`](crate::PdServiceConfig::body_timeout) (past them,
//! 413 or 408 and the connection closed, as for an orchestrated body). A body that starts
//! as a JSON object (as the engines' Python guesses its encoding) is read whole: it loses
//! the handoff fields no client may send
//! ([`strip_client_handoff`](disagg_core::proto::strip_client_handoff)), and its `model`
//! picks the engine, as on the orchestrated routes; so is a direct request's body, which
//! takes a place under the orchestrator's admission once it is in and holds it until the
//! answer ends. Any other body streams to the engine as it arrives; a fanned-out body is
//! always read whole. The engine's answer goes to the client frame by frame.
//!
//! What goes to the engine is the proxy's to decide, as on the legs: the client's
//! headers lose those that describe one connection, the client's credentials and the
//! engines' routing headers ([`forwardable_header`]: `authorization` only with
//! [`forward_authorization`](disagg_core::orchestrator::OrchestratorConfig::forward_authorization)),
//! and `accept-encoding` (the proxy reads the answers it relays). What comes back too:
//! the engine's KV handoff is overwritten in its answer ([`PdBody::scrubbed`]), and a
//! redirect to the engine's own address or an encoding the client did not accept is
//! answered 502 naming the engine ([`unrelayable`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::task::Context;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use disagg_core::endpoint::InFlightGuard;
use disagg_core::error::{BoxError, PdError, RouteError, Side, TransportError};
use disagg_core::json::{BodyError, JsonBody};
use disagg_core::outcome::Delivery;
use disagg_core::policy::Permit;
use disagg_core::proto::{forwardable_header, unrelayable};
use disagg_core::transport::{BoxBody, Transport};
use disagg_core::{Endpoint, Role, endpoint::EndpointSet, orchestrator::PdBody};
use http::header::{self, CONTENT_TYPE, HeaderName, HeaderValue};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;

use crate::body;
use crate::error::{error_response, pd_error_response};
use crate::routed::{RouteListeners, RouteSummary};
use crate::service::{Inner, collect_limited, json_response};
use crate::tap::{Hooks, Tap, Unshared};

/// The answer's marker for a generation served by a decode engine alone.
const DIRECT: HeaderValue = HeaderValue::from_static("direct");

/// The most of one engine's answer to a fanned-out admin request that is kept: those
/// answers are a status line or a small object.
const FAN_OUT_ANSWER_LIMIT: usize = 64 * 1024;

/// Headers that describe one connection, not the request (RFC 9110 §7.6.1), plus
/// `host`, which the transport sets for the engine.
fn hop_by_hop(name: &HeaderName) -> bool {
    name == header::CONNECTION
        || name == header::TE
        || name == header::TRAILER
        || name == header::TRANSFER_ENCODING
        || name == header::UPGRADE
        || name == header::PROXY_AUTHORIZATION
        || name == header::PROXY_AUTHENTICATE
        || name == header::HOST
        || name.as_str() == "keep-alive"
        || name.as_str() == "proxy-connection"
}

/// An answer's headers without those that describe one connection.
fn strip(headers: &mut HeaderMap) {
    strip_where(headers, hop_by_hop);
}

/// A client's headers as an engine may see them: without those that describe one
/// connection, without what [`forwardable_header`] keeps from every engine (the client's
/// credentials unless `forward_authorization` says otherwise for `authorization`, the
/// engines' routing and identity headers), and without `accept-encoding`: the proxy
/// reads the answers it relays, so it asks for them unencoded.
fn strip_request(headers: &mut HeaderMap, forward_authorization: bool) {
    strip_where(headers, |n| {
        hop_by_hop(n)
            || *n == header::ACCEPT_ENCODING
            || !forwardable_header(n, forward_authorization)
    });
}

/// Remove the headers `connection` names, then those `drop` picks.
fn strip_where(headers: &mut HeaderMap, drop: impl Fn(&HeaderName) -> bool) {
    let named: Vec<HeaderName> = disagg_core::proto::connection_names(headers).collect();
    for name in named {
        headers.remove(name);
    }
    let gone: Vec<HeaderName> = headers.keys().filter(|n| drop(n)).cloned().collect();
    for name in gone {
        headers.remove(name);
    }
}

impl Inner {
    /// Forward `req` to one engine serving its model: a decode engine when one does
    /// (only a decode one when `direct`), the least loaded.
    ///
    /// `route`, when given, is taken into the engine's answer (which tells it when the
    /// answer ends); left in place when the answer is the proxy's own.
    pub(crate) async fn forward<B>(
        &self,
        req: Request<B>,
        direct: bool,
        route: &mut Option<RouteEnd>,
    ) -> Response<PdBody>
    where
        B: Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
    {
        let set = self.orchestrator.source().snapshot();
        let (mut parts, body) = req.into_parts();
        // Generation sent direct keeps the deadline an orchestrated request has (the
        // configured one, shortened by the client's header when allowed), from its
        // arrival: for its place in the queue, the engine's head and its whole answer.
        let deadline = direct
            .then(|| {
                let config = self.orchestrator.config();
                config.deadline_for(&parts.headers, tokio::time::Instant::now())
            })
            .flatten();
        // What went wrong with a streamed client body, when it was the client's fault.
        let failed = Arc::new(OnceLock::new());
        let limits = StreamLimits {
            max_bytes: self.config.max_body_bytes,
            timeout: self.config.body_timeout,
            failed: Arc::clone(&failed),
        };
        let mut body = ClientBody::stream(body, limits);
        // A JSON object is read whole, for its `model` and to lose the handoff fields no
        // client may send (as on every leg); anything else (a form, an upload, nothing)
        // streams as it comes. Its first bytes tell which.
        let mut model = None;
        // Whether this is generation sent direct: a direct request with a body (one
        // without, retrieving or cancelling a stored response, is not).
        let mut generation = false;
        if may_have_body(&parts.headers) {
            let mut start = BytesMut::new();
            // Direct generation is read whole whatever it is: its first bytes need no
            // look. It takes its place among the running requests once its body is in,
            // as an orchestrated request does (a slow upload holds no place).
            let whole = direct
                || loop {
                    if let Some(object) = json_object_start(&start, false) {
                        break object;
                    }
                    match body.frame().await {
                        None => break json_object_start(&start, true).unwrap_or(false),
                        Some(Ok(frame)) => {
                            if let Ok(data) = frame.into_data() {
                                start.extend_from_slice(&data);
                            }
                        }
                        Some(Err(e)) => {
                            return match failed.get() {
                                Some(client) => body_refused(client),
                                None => body_refused(&PdError::body(e)),
                            };
                        }
                    }
                };
            let started = Started {
                start: Some(start.freeze()),
                rest: body,
            };
            body = if whole {
                let bytes = match body::read(started, self.limits()).await {
                    Ok((bytes, _share)) => bytes,
                    Err(err) => return body_refused(failed.get().unwrap_or(&err)),
                };
                let (bytes, named) = match engine_body(bytes) {
                    Ok(b) => b,
                    Err(err) => return pd_error_response(&err),
                };
                model = named;
                generation = direct && !bytes.is_empty();
                parts
                    .headers
                    .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
                ClientBody::whole(bytes)
            } else {
                ClientBody::client(started, u64::MAX, None)
            };
        }
        // Only generation keeps the deadline (retrieving a stored response, or resuming
        // its stream, is no generation).
        let deadline = deadline.filter(|_| generation);
        // Generation sent direct takes a place among the running requests, as an
        // orchestrated one does (it queues, 429 `queue_full`, 503 `queue_timeout`), and
        // holds it until its answer's last byte.
        let mut permit = None;
        if generation && let Some(admission) = self.orchestrator.admission() {
            permit = match admission.try_admit() {
                Some(p) => Some(p),
                None => match admission.admit(deadline).await {
                    Ok(p) => Some(p),
                    Err(err) => return pd_error_response(&err),
                },
            };
        }
        // The client's `accept-encoding`, which the engine's request goes without.
        let mut client_accepts = HeaderMap::new();
        if let Some(v) = parts.headers.get(header::ACCEPT_ENCODING) {
            client_accepts.insert(header::ACCEPT_ENCODING, v.clone());
        }
        // Generation sent direct takes its engine's place from the router too (a limit
        // per endpoint waits here, as a routed request does, over the endpoints as
        // they stand after each wait); anything else goes to the least loaded at once.
        let endpoint = if generation {
            let source = self.orchestrator.source();
            let pick = || {
                let set = source.snapshot();
                self.pick(&set, model.as_deref(), direct)
                    .map_err(PdError::from)
            };
            match self.orchestrator.router().place(&pick, deadline).await {
                Ok(placed) => {
                    let ep = Arc::clone(&placed.decode);
                    // The route holds the engine's place: kept with the global one.
                    permit = Some(Permit::new((permit, placed)));
                    ep
                }
                Err(err) => return pd_error_response(&err),
            }
        } else {
            match self.pick(&set, model.as_deref(), direct) {
                Ok(ep) => ep,
                Err(err) => return pd_error_response(&PdError::from(err)),
            }
        };
        if let Some(r) = route.as_mut() {
            r.summary.endpoint = Some(Arc::clone(&endpoint));
        }
        let side = side(&endpoint);
        // No time left (the body came in after the deadline, or the wait for a place
        // ended at its last instant): nothing is sent, as on the orchestrated routes.
        if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) {
            return pd_error_response(&PdError::deadline_exceeded(side));
        }
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let uri = match endpoint.uri(path) {
            Ok(uri) => uri,
            Err(e) => {
                let err = TransportError::Connect(e.into());
                return pd_error_response(&PdError::transport(side, endpoint.id().clone(), err));
            }
        };
        let mut out = Request::new(body.boxed());
        *out.method_mut() = parts.method;
        *out.uri_mut() = uri;
        *out.headers_mut() = parts.headers;
        let config = self.orchestrator.config();
        strip_request(out.headers_mut(), config.forward_authorization);
        let guard = endpoint.track();
        let transport = self.orchestrator.transport();
        let sent = match transport.send_streaming(out) {
            Ok(fut) => fut,
            // A transport that cannot stream a body gets it whole.
            Err(out) => {
                let (parts, body) = out.into_parts();
                match collect_limited(body, self.config.max_body_bytes).await {
                    Ok(bytes) => transport.send(Request::from_parts(parts, bytes)),
                    Err(e) => return pd_error_response(&PdError::body(e)),
                }
            }
        };
        // A head timeout too large for the clock is none (as `tokio::time::timeout`
        // takes it), not a panic.
        let head_by = tokio::time::Instant::now().checked_add(config.decode_head_timeout);
        let by_deadline = deadline.is_some_and(|d| head_by.is_none_or(|h| d < h));
        let head_by = match (deadline, head_by) {
            (Some(d), Some(h)) => Some(d.min(h)),
            (d, h) => d.or(h),
        };
        let waited = match head_by {
            Some(at) => tokio::time::timeout_at(at, sent).await,
            None => Ok(sent.await),
        };
        let head = match waited {
            Ok(Ok(head)) => head,
            Ok(Err(err)) => {
                // The client's body failed the exchange (too slow, too large): its error.
                if let Some(client) = failed.get() {
                    return body_refused(client);
                }
                return pd_error_response(&PdError::transport(side, endpoint.id().clone(), err));
            }
            Err(_) if by_deadline => return pd_error_response(&PdError::deadline_exceeded(side)),
            Err(_) => {
                let err = TransportError::Timeout;
                return pd_error_response(&PdError::transport(side, endpoint.id().clone(), err));
            }
        };
        let (mut parts, body) = head.into_parts();
        if let Some(why) = unrelayable(parts.status, &parts.headers, &client_accepts) {
            // The body goes with the head: the engine's connection closes.
            return not_relayed(side, &endpoint, &why);
        }
        strip(&mut parts.headers);
        if direct {
            parts
                .headers
                .insert(disagg_core::proto::HANDOFF_HEADER, DIRECT);
        }
        let sse = parts
            .headers
            .get(CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        let mut route = route.take();
        if let Some(r) = route.as_mut() {
            r.summary.status = parts.status;
        }
        let body = EngineBody::watch(
            body,
            (guard, permit),
            config.decode_idle_timeout,
            deadline,
            route,
        );
        let body = PdBody::forward(body.boxed(), sse).scrubbed(&parts.headers);
        Response::from_parts(parts, body)
    }

    /// The engine for a forwarded request naming `model`: among the engines serving it
    /// (all of them for a request naming none), the decode ones when there are any
    /// (always for `direct`), the one with the fewest requests in flight; ties take
    /// turns.
    fn pick(
        &self,
        set: &EndpointSet,
        model: Option<&str>,
        direct: bool,
    ) -> Result<Arc<Endpoint>, RouteError> {
        let set = match model {
            Some(_) => set.for_model(model)?,
            None => set,
        };
        let pool = match (set.by_role(Role::Decode), direct) {
            ([], true) => return Err(RouteError::NoDecode),
            ([], false) => set.by_role(Role::Prefill),
            (decode, _) => decode,
        };
        let least = pool.iter().map(|e| e.in_flight()).min();
        let Some(least) = least else {
            return Err(RouteError::NoDecode);
        };
        let idle: Vec<&Arc<Endpoint>> = pool.iter().filter(|e| e.in_flight() == least).collect();
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::clone(idle[turn % idle.len()]))
    }

    /// Send an admin request to every engine of its model (every engine when it names
    /// none; one request per server, however many DP ranks it was listed with) and
    /// answer with each engine's result: 200 when all succeeded; the engines' status
    /// when they all refused alike; else 502 `fan_out_failed`.
    pub(crate) async fn fan_out<B>(&self, req: Request<B>) -> Response<PdBody>
    where
        B: Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
    {
        let (parts, body) = req.into_parts();
        let bytes = match body::read(body, self.limits()).await {
            Ok((bytes, _share)) => bytes,
            Err(err) => return body_refused(&err),
        };
        let (bytes, model) = match engine_body(bytes) {
            Ok(b) => b,
            Err(err) => return pd_error_response(&err),
        };
        let set = self.orchestrator.source().snapshot();
        let set = match model.as_deref() {
            Some(m) => match set.for_model(Some(m)) {
                Ok(s) => s.clone(),
                Err(err) => return pd_error_response(&PdError::from(err)),
            },
            None => set.as_ref().clone(),
        };
        let mut targets: Vec<&Arc<Endpoint>> = Vec::new();
        for ep in set
            .by_role(Role::Prefill)
            .iter()
            .chain(set.by_role(Role::Decode))
        {
            if !targets.iter().any(|t| t.authority() == ep.authority()) {
                targets.push(ep);
            }
        }
        if targets.is_empty() {
            return pd_error_response(&PdError::from(RouteError::NoDecode));
        }
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let mut headers = parts.headers.clone();
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
        let config = self.orchestrator.config();
        strip_request(&mut headers, config.forward_authorization);
        let timeout = config.decode_head_timeout;
        let transport = self.orchestrator.transport();
        let sends = targets.iter().map(|ep| {
            let mut out = Request::new(bytes.clone());
            *out.method_mut() = parts.method.clone();
            *out.headers_mut() = headers.clone();
            let uri = ep.uri(path);
            async move {
                let uri = uri.map_err(|e| e.to_string())?;
                *out.uri_mut() = uri;
                one_answer(transport, out, timeout).await
            }
        });
        let answers = futures::future::join_all(sends).await;
        // An adapter loaded or unloaded changes the model list.
        self.config.models.invalidate().await;
        fan_out_answer(parts.uri.path(), &targets, answers)
    }

    fn limits(&self) -> body::Limits<'_> {
        body::Limits {
            max_bytes: self.config.max_body_bytes,
            timeout: self.config.body_timeout,
            budget: &self.config.body_budget,
        }
    }
}

/// The answer to a client body that could not be read (too large, too slow, over the
/// budget): its error, and the connection closed, as the rest of the body is unread.
fn body_refused(err: &PdError) -> Response<PdBody> {
    let mut resp = pd_error_response(err);
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

/// The 502 for an engine answer that is not relayed ([`unrelayable`]), naming the engine.
fn not_relayed(side: Side, endpoint: &Endpoint, why: &str) -> Response<PdBody> {
    let message = format!(
        "{side} endpoint {} sent an unusable answer: {why}",
        endpoint.id()
    );
    tracing::warn!(%message, "engine answer not relayed");
    let code = match side {
        Side::Prefill => "prefill_failed",
        _ => "decode_failed",
    };
    error_response(StatusCode::BAD_GATEWAY, &message, "server_error", code)
}

/// One engine's answer to a fanned-out request: its status and body, or why none came.
async fn one_answer(
    transport: &dyn Transport,
    req: Request<Bytes>,
    timeout: Duration,
) -> Result<(StatusCode, Bytes), String> {
    let exchange = async {
        let resp = transport.send(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        let body = collect_limited(resp.into_body(), FAN_OUT_ANSWER_LIMIT)
            .await
            .map_err(|e| format!("reading the answer: {e}"))?;
        Ok((status, body))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {} ms", timeout.as_millis())))
}

fn fan_out_answer(
    path: &str,
    targets: &[&Arc<Endpoint>],
    answers: Vec<Result<(StatusCode, Bytes), String>>,
) -> Response<PdBody> {
    let mut results = Vec::with_capacity(answers.len());
    let mut statuses = Vec::with_capacity(answers.len());
    let mut failed = Vec::new();
    for (ep, answer) in targets.iter().zip(answers) {
        let mut entry = serde_json::Map::new();
        entry.insert("endpoint".into(), ep.id().as_str().into());
        entry.insert("role".into(), role(ep).into());
        match answer {
            Ok((status, body)) => {
                let body = serde_json::from_slice(&body).unwrap_or_else(|_| {
                    serde_json::Value::String(String::from_utf8_lossy(&body).into_owned())
                });
                entry.insert("status".into(), status.as_u16().into());
                entry.insert("body".into(), body);
                if !status.is_success() {
                    failed.push(format!("{} answered {}", ep.id(), status.as_u16()));
                }
                statuses.push(Some(status));
            }
            Err(e) => {
                failed.push(format!("{}: {e}", ep.id()));
                entry.insert("status".into(), serde_json::Value::Null);
                entry.insert("error".into(), e.into());
                statuses.push(None);
            }
        }
        results.push(serde_json::Value::Object(entry));
    }
    if failed.is_empty() {
        let body = serde_json::json!({"object": "fan_out", "path": path, "results": results});
        return json_response(StatusCode::OK, Bytes::from(body.to_string()));
    }
    // Every engine refused alike (an adapter already loaded everywhere, a bad path):
    // the client's request was wrong, and the engines' status says so.
    let same = match statuses.first() {
        Some(Some(first)) if statuses.iter().all(|s| *s == Some(*first)) => Some(*first),
        _ => None,
    };
    let (status, error_type, code) = match same {
        Some(s) if s.is_client_error() => (s, "invalid_request_error", "fan_out_refused"),
        _ => (StatusCode::BAD_GATEWAY, "server_error", "fan_out_failed"),
    };
    let message = format!(
        "{} of {} engines failed {path}: {}",
        failed.len(),
        targets.len(),
        failed.join("; ")
    );
    let body = serde_json::json!({
        "error": {"message": message, "type": error_type, "param": null, "code": code},
        "object": "fan_out",
        "path": path,
        "results": results,
    });
    json_response(status, Bytes::from(body.to_string()))
}

fn role(ep: &Endpoint) -> &'static str {
    ep.role().as_str()
}

fn side(ep: &Endpoint) -> Side {
    match ep.role() {
        Role::Prefill => Side::Prefill,
        Role::Decode => Side::Decode,
        _ => Side::Encode,
    }
}

/// Whether a request with `headers` may carry a body (one saying `content-length: 0`
/// does not; one without the header may be chunked).
fn may_have_body(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_LENGTH)
        .is_none_or(|v| v.as_bytes() != b"0")
}

/// A client's whole body as an engine may get it, and the `model` it names: a JSON
/// object loses the handoff fields no client may send
/// ([`strip_client_handoff`](disagg_core::proto::strip_client_handoff)), as on every
/// leg; anything else is passed as it came.
///
/// # Errors
///
/// 400 for a body that starts as a JSON object ([`json_object_start`]) but does not
/// parse as one in UTF-8 (a byte-order mark, UTF-16 or -32, `NaN`): the engines'
/// Python reads those, the proxy could not strip them, so it refuses them as the
/// orchestrated routes do.
fn engine_body(bytes: Bytes) -> Result<(Bytes, Option<String>), PdError> {
    if !json_object_start(&bytes, true).unwrap_or(false) {
        return Ok((bytes, None));
    }
    let mut json = JsonBody::parse_bytes(&bytes).map_err(PdError::body)?;
    let model = match json.get_as::<String>("model") {
        Some(Ok(m)) => Some(m),
        _ => None,
    };
    if disagg_core::proto::strip_client_handoff(&mut json) {
        return Ok((json.to_bytes(), model));
    }
    Ok((bytes, model))
}

/// Whether a body starting with `start` is a JSON object as the engines read bodies
/// (Python's `json.loads` of the bytes, which Starlette's `Request.json()` calls): the
/// encoding guessed as `json.detect_encoding` does (a UTF-8, -16 or -32 byte-order
/// mark, else where the first four bytes hold zeros), whitespace skipped, then `{`.
/// `None` when more bytes are needed to tell (`ended`: `start` is the whole body).
fn json_object_start(start: &[u8], ended: bool) -> Option<bool> {
    if start.len() < 4 && !ended {
        return None;
    }
    // (bytes per code unit, big-endian, byte-order mark's length)
    let enc: (usize, bool, usize) = match start {
        [0xFF, 0xFE, 0, 0, ..] => (4, false, 4),
        [0, 0, 0xFE, 0xFF, ..] => (4, true, 4),
        [0xFE, 0xFF, ..] => (2, true, 2),
        [0xFF, 0xFE, ..] => (2, false, 2),
        [0xEF, 0xBB, 0xBF, ..] => (1, false, 3),
        [0, b, ..] if start.len() >= 4 => (if *b != 0 { 2 } else { 4 }, true, 0),
        [_, 0, c, d, ..] => (if *c != 0 || *d != 0 { 2 } else { 4 }, false, 0),
        [0, _] if ended => (2, true, 0),
        [_, 0] if ended => (2, false, 0),
        _ => (1, false, 0),
    };
    let (width, big, bom) = enc;
    for unit in start[bom..].chunks(width) {
        if unit.len() < width {
            break;
        }
        let push = |acc: u32, b: &u8| acc << 8 | u32::from(*b);
        let c = if big {
            unit.iter().fold(0, push)
        } else {
            unit.iter().rev().fold(0, push)
        };
        match c {
            0x20 | 0x09 | 0x0A | 0x0D => continue,
            0x7B => return Some(true),
            _ => return Some(false),
        }
    }
    ended.then_some(false)
}

/// A client's body after its first bytes were read: those bytes, then the rest. Its
/// size hint is the rest's, which ([`ClientBody`]'s) is the whole body's.
struct Started {
    start: Option<Bytes>,
    rest: ClientBody,
}

impl Body for Started {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(start) = self.start.take().filter(|s| !s.is_empty()) {
            return std::task::Poll::Ready(Some(Ok(Frame::data(start))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.start.as_ref().is_none_or(Bytes::is_empty) && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.rest.size_hint()
    }
}

/// The limits of a client body streamed to an engine, and where a breach is told.
struct StreamLimits {
    /// The largest body (413 past it).
    max_bytes: usize,
    /// Time for the whole body, from when it is first waited for (408 past it).
    timeout: Duration,
    /// Set to the client's error when the body breaks a limit: the exchange then fails,
    /// and the forwarding answers with this instead of the engine's failure.
    failed: Arc<OnceLock<PdError>>,
}

/// A client's request body on its way to the engine: streamed frame by frame (cut past
/// the body limit, and past the body timeout, which runs as
/// [`body::read`](crate::body)'s does: from the first wait, for the whole body), or
/// whole when it was read to find its model.
///
/// `Sync` as the transport's body must be, though the client's body need not be: it
/// is [`Unshared`], reached only through `&mut`.
type ClientBody = Tap<Unshared<DynBody>, ClientLimits>;

type DynBody = Pin<Box<dyn Body<Data = Bytes, Error = BoxError> + Send>>;

/// [`ClientBody`]'s own: the bytes it may still send, its limits, its size hint and end
/// (kept on the side: the body is [`Unshared`]).
struct ClientLimits {
    hint: SizeHint,
    left: u64,
    ended: bool,
    limits: Option<StreamLimits>,
    /// Armed at the first wait for the client.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl ClientBody {
    fn stream<B>(body: B, limits: StreamLimits) -> Self
    where
        B: Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
    {
        let left = limits.max_bytes as u64;
        Self::client(body, left, Some(limits))
    }

    fn client<B>(body: B, left: u64, limits: Option<StreamLimits>) -> Self
    where
        B: Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
    {
        let hint = body.size_hint();
        let ended = body.is_end_stream();
        let body = body
            .map_frame(|f| f.map_data(|mut d| d.copy_to_bytes(d.remaining())))
            .map_err(Into::into);
        let limits = ClientLimits {
            hint,
            left,
            ended,
            limits,
            timer: None,
        };
        Tap::new(Unshared::new(Box::pin(body) as DynBody), limits)
    }

    fn whole(bytes: Bytes) -> Self {
        let len = bytes.len() as u64;
        Self::client(http_body_util::Full::new(bytes), len, None)
    }
}

impl ClientLimits {
    /// The body broke a limit: `err` for the forwarding, an error for the transport.
    fn fail(&mut self, err: PdError) -> BoxError {
        let message = err.to_string();
        if let Some(limits) = &self.limits {
            let _ = limits.failed.set(err);
        }
        self.ended = true;
        message.into()
    }
}

impl Hooks<Unshared<DynBody>> for ClientLimits {
    fn frame(&mut self, frame: &Frame<Bytes>, _body: &Unshared<DynBody>) -> Result<(), BoxError> {
        if let Some(data) = frame.data_ref() {
            let len = data.len() as u64;
            if len > self.left {
                let max = self.limits.as_ref().map_or(0, |l| l.max_bytes);
                return Err(self.fail(PdError::body(BodyError::TooLarge { limit: max })));
            }
            self.left -= len;
        }
        Ok(())
    }

    fn end(&mut self) {
        self.ended = true;
    }

    fn pending(&mut self, cx: &mut Context<'_>) -> Result<(), BoxError> {
        let Some(timeout) = self.limits.as_ref().map(|l| l.timeout) else {
            return Ok(());
        };
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if timer.as_mut().poll(cx).is_ready() {
            return Err(self.fail(PdError::body(BodyError::TimedOut { after: timeout })));
        }
        Ok(())
    }

    fn is_end_stream(&self, _body: &Unshared<DynBody>) -> bool {
        self.ended
    }

    fn size_hint(&self, _body: &Unshared<DynBody>) -> SizeHint {
        self.hint
    }
}

/// An engine's answer on its way to the client: holds the engine's place in the
/// in-flight count (and a direct request's admission permit) until it ends, and ends
/// with an error after `idle` without a frame.
type EngineBody = Tap<BoxBody, EngineWatch>;

/// [`EngineBody`]'s own: the engine's place and the request's admission, the idle
/// timer, and the request's summary until the answer ends.
struct EngineWatch {
    _places: (InFlightGuard, Option<Permit>),
    idle: Option<(Duration, Pin<Box<tokio::time::Sleep>>)>,
    /// The request's deadline (generation sent direct): the answer ends there.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    route: Option<RouteEnd>,
}

impl EngineBody {
    fn watch<B>(
        body: B,
        places: (InFlightGuard, Option<Permit>),
        idle: Option<Duration>,
        deadline: Option<tokio::time::Instant>,
        mut route: Option<RouteEnd>,
    ) -> Self
    where
        B: Body<Data = Bytes> + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        // An empty answer may never be polled: it has ended already.
        if body.is_end_stream()
            && let Some(r) = route.as_mut()
        {
            r.tell(Delivery::Complete);
        }
        let watch = EngineWatch {
            _places: places,
            idle: idle.map(|d| (d, Box::pin(tokio::time::sleep(d)))),
            deadline: deadline.map(|d| Box::pin(tokio::time::sleep_until(d))),
            route,
        };
        Tap::new(body.map_err(Into::into).boxed(), watch)
    }
}

/// A request the orchestrator does not serve, on its way: its summary is told to the
/// service's [`RouteListeners`] once, when its answer ends, breaks, or is dropped
/// unfinished (the client left).
pub(crate) struct RouteEnd {
    listeners: RouteListeners,
    pub(crate) summary: RouteSummary,
    told: bool,
}

impl RouteEnd {
    pub(crate) fn new(listeners: RouteListeners, summary: RouteSummary) -> Self {
        RouteEnd {
            listeners,
            summary,
            told: false,
        }
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
        self.summary.status = resp.status();
        self.summary.bytes = resp.body().size_hint().exact().unwrap_or(0);
        self.tell(Delivery::Complete);
    }
}

impl Drop for RouteEnd {
    fn drop(&mut self) {
        // Not told by now: the answer was dropped before its end.
        self.tell(Delivery::Cancelled);
    }
}

impl EngineWatch {
    /// The engine answered something: the idle time starts again.
    fn answered(&mut self) {
        // An idle time too large for the clock never ends (no panic).
        if let Some((d, sleep)) = &mut self.idle
            && let Some(next) = tokio::time::Instant::now().checked_add(*d)
        {
            sleep.as_mut().reset(next);
        }
    }

    /// The request's deadline passed: the answer ends broken.
    fn past_deadline(&mut self) -> Result<(), BoxError> {
        let Some(deadline) = &self.deadline else {
            return Ok(());
        };
        if tokio::time::Instant::now() < deadline.deadline() {
            return Ok(());
        }
        if let Some(r) = self.route.as_mut() {
            r.tell(Delivery::Broken);
        }
        Err("the request's deadline passed".into())
    }
}

impl Hooks<BoxBody> for EngineWatch {
    fn frame(&mut self, frame: &Frame<Bytes>, body: &BoxBody) -> Result<(), BoxError> {
        // An engine that streams without pause is cut at the deadline too.
        self.past_deadline()?;
        self.answered();
        if let Some(r) = self.route.as_mut() {
            r.summary.bytes += frame.data_ref().map_or(0, |d| d.len() as u64);
            // The server stops polling a body that says it has ended.
            if body.is_end_stream() {
                r.tell(Delivery::Complete);
            }
        }
        Ok(())
    }

    fn end(&mut self) {
        self.answered();
        if let Some(r) = self.route.as_mut() {
            r.tell(Delivery::Complete);
        }
    }

    fn error(&mut self) {
        self.answered();
        if let Some(r) = self.route.as_mut() {
            r.tell(Delivery::Broken);
        }
    }

    fn pending(&mut self, cx: &mut Context<'_>) -> Result<(), BoxError> {
        if let Some(deadline) = &mut self.deadline
            && deadline.as_mut().poll(cx).is_ready()
        {
            return self.past_deadline();
        }
        if let Some((d, sleep)) = &mut self.idle
            && sleep.as_mut().poll(cx).is_ready()
        {
            if let Some(r) = self.route.as_mut() {
                r.tell(Delivery::Broken);
            }
            let msg = format!("the engine sent nothing for {} ms", d.as_millis());
            return Err(msg.into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `s` in UTF-16 or -32, either byte order, with or without a byte-order mark.
    fn encode(s: &str, width: usize, big: bool, bom: bool) -> Vec<u8> {
        let mut out = Vec::new();
        let mut put = |c: u32| {
            let bytes = c.to_be_bytes();
            let unit = &bytes[4 - width..];
            if big {
                out.extend_from_slice(unit);
            } else {
                out.extend(unit.iter().rev());
            }
        };
        if bom {
            put(0xFEFF);
        }
        for c in s.chars() {
            put(u32::from(c));
        }
        out
    }

    #[test]
    fn a_json_object_is_told_in_every_encoding_pythons_json_reads() {
        for text in ["{\"a\":1}", " \r\n\t{}"] {
            assert_eq!(
                json_object_start(text.as_bytes(), true),
                Some(true),
                "{text:?}"
            );
            let bom = [&[0xEF, 0xBB, 0xBF][..], text.as_bytes()].concat();
            assert_eq!(json_object_start(&bom, true), Some(true), "{text:?}");
            for width in [2, 4] {
                for big in [true, false] {
                    for with_bom in [true, false] {
                        let b = encode(text, width, big, with_bom);
                        assert_eq!(
                            json_object_start(&b, true),
                            Some(true),
                            "{text:?} {width} {big} {with_bom}"
                        );
                    }
                }
            }
        }
        for text in ["[{}]", "--x\r\n", "", "   ", "\"{\""] {
            assert_eq!(
                json_object_start(text.as_bytes(), true),
                Some(false),
                "{text:?}"
            );
            let b = encode(text, 2, false, true);
            assert_eq!(json_object_start(&b, true), Some(false), "{text:?}");
        }
        // A two-byte body is UTF-16 when it holds a zero, as Python guesses.
        assert_eq!(json_object_start(b"{\0", true), Some(true));
        assert_eq!(json_object_start(b"\0{", true), Some(true));
    }

    #[test]
    fn a_start_too_short_to_tell_waits_for_more() {
        assert_eq!(json_object_start(b"", false), None);
        assert_eq!(json_object_start(b"{\0", false), None);
        assert_eq!(json_object_start(b"\xFF\xFE", false), None);
        assert_eq!(json_object_start(b"    ", false), None);
        assert_eq!(json_object_start(b"    {", false), Some(true));
        assert_eq!(json_object_start(b"  x", true), Some(false));
    }

    #[test]
    fn the_engines_body_keeps_its_bytes_unless_a_handoff_was_removed() {
        let plain = Bytes::from_static(br#"{"model":"m", "prompt" : "p"}"#);
        let (bytes, model) = engine_body(plain.clone()).unwrap();
        assert_eq!(bytes.as_ptr(), plain.as_ptr(), "no copy");
        assert_eq!(model.as_deref(), Some("m"));
        let (bytes, model) = engine_body(Bytes::from_static(
            br#"{"model":"m","bootstrap_host":"h","vllm_xargs":{"kv_transfer_params":1}}"#,
        ))
        .unwrap();
        assert_eq!(&bytes[..], br#"{"model":"m","vllm_xargs":{}}"#);
        assert_eq!(model.as_deref(), Some("m"));
        let form = Bytes::from_static(b"--x\r\n\r\n--x--");
        assert_eq!(engine_body(form.clone()).unwrap(), (form, None));
        assert!(engine_body(Bytes::from_static(b"{\"a\":NaN}")).is_err());
    }
}
