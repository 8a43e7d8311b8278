//! Pass-through: a request the [`RouteTable`](crate::routes::RouteTable) does not
//! orchestrate goes to one engine unchanged, or to every engine of its model.
//!
//! A forwarded request takes the legs' road: the orchestrator's transport (its pooled
//! connections), the decode head timeout for the engine's head and the decode idle
//! timeout between chunks of its answer, the healthy endpoints of the source, and
//! OpenAI-format 502/503/504 answers for an engine that fails, is missing or is slow.
//! Both bodies stream: the client's to the engine as it arrives (within
//! [`PdServiceConfig::max_body_bytes`](crate::PdServiceConfig::max_body_bytes) and
//! [`PdServiceConfig::body_timeout`](crate::PdServiceConfig::body_timeout): past them,
//! 413 or 408 and the connection closed, as for an orchestrated body), the engine's to
//! the client frame by frame. Only when the fleet serves several models is the client's
//! body read whole first, to find its `model`; a fanned-out body is always read whole.
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

use bytes::{Buf, Bytes};
use disagg_core::endpoint::InFlightGuard;
use disagg_core::error::{BoxError, PdError, RouteError, Side, TransportError};
use disagg_core::json::BodyError;
use disagg_core::outcome::Delivery;
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
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
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
        let (parts, body) = req.into_parts();
        // What went wrong with a streamed client body, when it was the client's fault.
        let failed = Arc::new(OnceLock::new());
        // The body is read for its `model` only when the model decides the engine.
        let (body, model) = if set.served_models().len() > 1 && may_have_body(&parts.headers) {
            let limits = self.limits();
            match body::read(body, limits).await {
                Ok((bytes, _share)) => {
                    let model = model_of(&bytes);
                    (ClientBody::whole(bytes), model)
                }
                Err(err) => return body_refused(&err),
            }
        } else {
            let limits = StreamLimits {
                max_bytes: self.config.max_body_bytes,
                timeout: self.config.body_timeout,
                failed: Arc::clone(&failed),
            };
            (ClientBody::stream(body, limits), None)
        };
        // The client's `accept-encoding`, which the engine's request goes without.
        let mut client_accepts = HeaderMap::new();
        if let Some(v) = parts.headers.get(header::ACCEPT_ENCODING) {
            client_accepts.insert(header::ACCEPT_ENCODING, v.clone());
        }
        let endpoint = match self.pick(&set, model.as_deref(), direct) {
            Ok(ep) => ep,
            Err(err) => return pd_error_response(&PdError::from(err)),
        };
        if let Some(r) = route.as_mut() {
            r.summary.endpoint = Some(Arc::clone(&endpoint));
        }
        let side = side(&endpoint);
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
        let head = match tokio::time::timeout(config.decode_head_timeout, sent).await {
            Ok(Ok(head)) => head,
            Ok(Err(err)) => {
                // The client's body failed the exchange (too slow, too large): its error.
                if let Some(client) = failed.get() {
                    return body_refused(client);
                }
                return pd_error_response(&PdError::transport(side, endpoint.id().clone(), err));
            }
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
        let body = EngineBody::watch(body, guard, config.decode_idle_timeout, route);
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
        let set = self.orchestrator.source().snapshot();
        let model = model_of(&bytes);
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

/// The top-level `model` string of a JSON body, if it has one.
fn model_of(bytes: &Bytes) -> Option<String> {
    let raw = disagg_core::json::top_level_field(bytes, "model").ok()??;
    serde_json::from_slice::<String>(&raw).ok()
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
/// in-flight count until it ends, and ends with an error after `idle` without a frame.
type EngineBody = Tap<BoxBody, EngineWatch>;

/// [`EngineBody`]'s own: the engine's place, the idle timer, and the request's summary
/// until the answer ends.
struct EngineWatch {
    _guard: InFlightGuard,
    idle: Option<(Duration, Pin<Box<tokio::time::Sleep>>)>,
    route: Option<RouteEnd>,
}

impl EngineBody {
    fn watch<B>(
        body: B,
        guard: InFlightGuard,
        idle: Option<Duration>,
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
            _guard: guard,
            idle: idle.map(|d| (d, Box::pin(tokio::time::sleep(d)))),
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
        if let Some((d, sleep)) = &mut self.idle {
            let next = tokio::time::Instant::now() + *d;
            sleep.as_mut().reset(next);
        }
    }
}

impl Hooks<BoxBody> for EngineWatch {
    fn frame(&mut self, frame: &Frame<Bytes>, body: &BoxBody) -> Result<(), BoxError> {
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
