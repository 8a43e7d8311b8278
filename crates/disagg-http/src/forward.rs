//! Pass-through: a request the [`RouteTable`](crate::routes::RouteTable) does not
//! orchestrate goes to one engine unchanged, or to every engine of its model.
//!
//! A forwarded request takes the legs' road: the orchestrator's transport (its pooled
//! connections), the decode head timeout for the engine's head and the decode idle
//! timeout between chunks of its answer, the healthy endpoints of the source,
//! OpenAI-format 502/503/504 answers for an engine that fails, is missing or is slow,
//! and passive health, which hears how the engine did (`watch::Verdict`: an engine
//! that fails forwarded or direct requests is ejected as one failing its legs is; only
//! generation sent direct, answered, counts as the engine working, and a redirect, a
//! client's body that failed or was still coming, a client that left or a deadline
//! blames no engine). A fanned-out request goes to every engine, healthy or not
//! (`Inner::fan_out`).
//! The client's body is held to
//! [`PdServiceConfig::max_body_bytes`](crate::PdServiceConfig::max_body_bytes) and
//! [`PdServiceConfig::body_timeout`](crate::PdServiceConfig::body_timeout) (past them,
//! 413 or 408 and the connection closed, as for an orchestrated body), and what of it the
//! proxy holds to [`PdServiceConfig::body_budget`](crate::PdServiceConfig::body_budget)
//! (past it, 503 `server_busy`). A body that starts as a JSON object (as the engines'
//! Python guesses its encoding) is read whole: it loses the handoff fields no client may
//! send ([`strip_client_handoff`](disagg_core::proto::strip_client_handoff)), and its
//! `model` picks the engine, as on the orchestrated routes (parsed off the event loop
//! when large, as theirs are); so is a direct request's body, which takes a place under
//! the orchestrator's admission once it is in and holds it until the answer ends. Any
//! other body streams to the engine as it arrives; a fanned-out body is always read
//! whole. A direct `multipart/form-data` body (an audio transcription) names its
//! model in its `model` field (`forward::form`). Generation sent direct that names no
//! model goes to the one model served, and is refused 400 `model_required` in a fleet of
//! several, as an orchestrated request is; anything else naming none may go to any
//! engine. The engine's answer goes to the client frame by frame.
//!
//! What goes to the engine is the proxy's to decide, as on the legs: the client's
//! headers lose those that describe one connection, the client's credentials and the
//! engines' routing headers ([`forwardable_header`]: `authorization` only with
//! [`forward_authorization`](disagg_core::orchestrator::OrchestratorConfig::forward_authorization)),
//! the client's `x-request-id` (an engine-side id is the proxy's to give: these routes
//! send one of theirs), `accept-encoding` (the proxy reads the answers it relays) and
//! `content-encoding` / `x-body-compressed` (a compressed body is refused before it gets
//! here, 415 `unsupported_content_encoding`: the proxy could not strip it). What
//! comes back too: the engine's KV handoff is overwritten in its answer
//! ([`PdBody::scrubbed`]), and a redirect to the engine's own address, an encoding the
//! client did not accept, a `connection` header naming a `content-*` header, or more
//! than one `content-type` or `content-encoding` is answered 502 naming the engine
//! ([`unrelayable`], decided on the headers as the engine sent them).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use disagg_core::error::{BoxError, PdError, RouteError, Side, TransportError, error_chain};
use disagg_core::json::JsonBody;
use disagg_core::outcome::LegOutcome;
use disagg_core::policy::Permit;
use disagg_core::proto::{forwardable_header, unrelayable};
use disagg_core::request::Api;
use disagg_core::transport::Transport;
use disagg_core::{Endpoint, Role, endpoint::EndpointSet, orchestrator::PdBody};
use http::header::{self, CONTENT_TYPE, HeaderName, HeaderValue};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError};

use crate::body;
use crate::error::{error_response, pd_error_response};
use crate::routed::RouteEnd;
use crate::routes::RouteAction;
use crate::service::{Inner, collect_limited, json_response};

mod client;
mod form;
mod sniff;
mod watch;
use client::{ClientBody, Started, StreamLimits};
use sniff::json_object_start;
use watch::{EngineBody, Verdict, Watched};

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

/// The most of a body's first bytes that may wait for the engine outside the body
/// budget when the body streams (it is no JSON object): past it, the body is read
/// whole, held to the budget.
const STREAMED_START_MAX: usize = 64 << 10;

/// The request id header (`x-request-id`), which vLLM takes as its own request id.
const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The engine-side ids of the requests these routes send: `fwd-`, then a counter under
/// a keyed hash (std's SipHash, keyed per service) and the counter, so ids are unique
/// and no number of them seen tells another. (The orchestrator's legs draw theirs from
/// a generator of its own, private to the core.)
#[derive(Debug, Default)]
pub(crate) struct EngineIds {
    keys: std::collections::hash_map::RandomState,
    next: std::sync::atomic::AtomicU64,
}

impl EngineIds {
    fn next_id(&self) -> HeaderValue {
        use std::hash::BuildHasher;
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = format!("fwd-{:016x}{n:x}", self.keys.hash_one(n));
        // Hex digits and a dash are always a valid header value.
        HeaderValue::from_str(&id).unwrap_or(HeaderValue::from_static("fwd"))
    }
}

/// A client's headers as an engine may see them: without those that describe one
/// connection, without what [`forwardable_header`] keeps from every engine (the client's
/// credentials unless `forward_authorization` says otherwise for `authorization`, the
/// engines' routing and identity headers), without `accept-encoding` (the proxy reads
/// the answers it relays, so it asks for them unencoded), without `content-encoding` and
/// `x-body-compressed` (a body that gets this far is not encoded: the service refuses
/// any other, `crate::coding`), and without the client's `x-request-id`.
///
/// vLLM takes `X-Request-Id` as the engine-side id of the request, which must be unique
/// among its requests in flight: the orchestrated legs carry an id of the proxy's in its
/// place, and so do these routes ([`EngineIds`]; without the header vLLM would take the
/// body's `request_id`, the client's again). The client's id stays in the proxy's
/// summary of the request (its access log).
fn strip_request(headers: &mut HeaderMap, forward_authorization: bool) {
    strip_where(headers, |n| {
        hop_by_hop(n)
            || *n == header::ACCEPT_ENCODING
            || *n == REQUEST_ID
            || crate::coding::coding_header(n)
            || !forwardable_header(n, forward_authorization)
    });
}

/// Remove the headers `connection` names, then those `drop` picks.
fn strip_where(headers: &mut HeaderMap, drop: impl Fn(&HeaderName) -> bool) {
    let named: Vec<HeaderName> = disagg_core::proto::connection_names(headers).collect();
    for name in named {
        headers.remove(name);
    }
    remove_where(headers, drop);
}

/// Remove the headers `drop` picks.
pub(crate) fn remove_where(headers: &mut HeaderMap, drop: impl Fn(&HeaderName) -> bool) {
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
        // What went wrong with a streamed client body (always the client's fault), and
        // whether it has ended.
        let failed = Arc::new(OnceLock::new());
        let body_ended = Arc::new(AtomicBool::new(false));
        let limits = StreamLimits {
            max_bytes: self.config.max_body_bytes,
            timeout: self.config.body_timeout,
            failed: Arc::clone(&failed),
            ended: Arc::clone(&body_ended),
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
            // A direct form names its model in a field: read as a JSON body's `model`.
            let form = direct
                .then(|| parts.headers.get(CONTENT_TYPE).and_then(form::boundary))
                .flatten();
            // Direct generation is read whole whatever it is: its first bytes need no
            // look. It takes its place among the running requests once its body is in,
            // as an orchestrated request does (a slow upload holds no place).
            let (start, rest, whole) = if direct {
                (Bytes::new(), body, true)
            } else {
                match sniff_start(body, self.limits()).await {
                    // A body that is no JSON object streams, unless its first bytes
                    // were many (a long run of whitespace): those would wait for the
                    // engine outside the budget, so it is read whole, held to it.
                    Ok((start, rest, object)) => {
                        let whole = object || start.len() > STREAMED_START_MAX;
                        (start, rest, whole)
                    }
                    Err(err) => return body_refused(failed.get().unwrap_or(&err), route),
                }
            };
            let started = Started {
                start: Some(start),
                rest,
            };
            body = if whole {
                // Its share of the budget is held until the body is parsed and, when a
                // handoff was removed, copied: as on the orchestrated routes.
                let (bytes, share) = match body::read(started, self.limits()).await {
                    Ok(read) => read,
                    Err(err) => return body_refused(failed.get().unwrap_or(&err), route),
                };
                let engine = engine_body_off_loop(bytes, form, share).await;
                let (bytes, named) = match engine {
                    Ok(b) => b,
                    Err(err) => return pd_error_response(&err),
                };
                model = named;
                generation = direct && !bytes.is_empty();
                body_ended.store(true, Ordering::Release);
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
        // Whether it waited for that place (and was counted queued there): its wait for
        // an engine's place, below, does not count it again.
        let mut queued = false;
        if generation && let Some(admission) = self.orchestrator.admission() {
            permit = match admission.try_admit() {
                Some(p) => Some(p),
                None => {
                    queued = true;
                    match admission.admit(deadline).await {
                        Ok(p) => Some(p),
                        Err(err) => return pd_error_response(&err),
                    }
                }
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
                self.pick(&set, model.as_deref(), direct, true)
                    .map_err(PdError::from)
            };
            match self
                .orchestrator
                .router()
                .place_queued(&pick, deadline, queued)
                .await
            {
                Ok(placed) => {
                    let ep = Arc::clone(&placed.decode);
                    // The route holds the engine's place: kept with the global one.
                    permit = Some(Permit::new((permit, placed)));
                    ep
                }
                Err(err) => return pd_error_response(&err),
            }
        } else {
            match self.pick(&set, model.as_deref(), direct, false) {
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
        // The API the engine's path serves, if any: its stream's error event takes that
        // API's shape, a completions stream must carry a choice's finish reason (one
        // that ends without did not answer), and a `/generate` stream's abort is its error.
        let api = Api::from_path(parts.uri.path());
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
        out.headers_mut()
            .insert(REQUEST_ID, self.engine_ids.next_id());
        let guard = endpoint.track();
        let transport = self.orchestrator.transport();
        let sent = match transport.send_streaming(out) {
            Ok(fut) => fut,
            // A transport that cannot stream a body gets it whole.
            Err(out) => {
                let (parts, body) = out.into_parts();
                match collect_limited(body, self.config.max_body_bytes).await {
                    Ok(bytes) => {
                        body_ended.store(true, Ordering::Release);
                        transport.send(Request::from_parts(parts, bytes))
                    }
                    Err(e) => {
                        let err = PdError::body(e);
                        return body_refused(failed.get().unwrap_or(&err), route);
                    }
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
        // How the engine did, told once to passive health (`Verdict`): not for the
        // client's faults, its leaving or the request's deadline.
        let verdict = Verdict {
            orchestrator: self.orchestrator.clone(),
            endpoint: Arc::clone(&endpoint),
            call: if direct {
                RouteAction::Direct.name()
            } else {
                RouteAction::Forwarded.name()
            },
            served: generation,
        };
        let head = match waited {
            Ok(Ok(head)) => head,
            Ok(Err(err)) => {
                // The client's body failed the exchange (too slow, too large): its error.
                if let Some(client) = failed.get() {
                    return body_refused(client, route);
                }
                verdict.tell(LegOutcome::Failed);
                return pd_error_response(&PdError::transport(side, endpoint.id().clone(), err));
            }
            Err(_) if by_deadline => return pd_error_response(&PdError::deadline_exceeded(side)),
            Err(_) => {
                // An engine may wait for the whole body before it answers: while the
                // client is still sending it (a slow upload, a body timeout longer than
                // the head timeout), the engine is not to blame.
                if body_ended.load(Ordering::Acquire) {
                    verdict.tell(LegOutcome::Failed);
                }
                let err = TransportError::Timeout;
                return pd_error_response(&PdError::transport(side, endpoint.id().clone(), err));
            }
        };
        let (mut parts, body) = head.into_parts();
        // Decided on the engine's headers as it sent them: those its `connection` names
        // are stripped only after.
        if let Some(why) = unrelayable(parts.status, &parts.headers, &client_accepts) {
            // A redirect is the engine working: the client's path was wrong (FastAPI
            // answers `/version/` with a 307 to `/version`). Anything else unusable is
            // the engine's own.
            if !parts.status.is_redirection() {
                verdict.tell(LegOutcome::Failed);
            }
            // The body goes with the head: the engine's connection closes.
            return not_relayed(side, &endpoint, &why);
        }
        // A 5xx is the engine's failure, told at its head (its body is relayed); any
        // other answer is judged at its end.
        let verdict = if parts.status.is_server_error() {
            verdict.tell(LegOutcome::Failed);
            None
        } else {
            Some(verdict)
        };
        let sse = parts
            .headers
            .get(CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        let mut route = route.take();
        if let Some(r) = route.as_mut() {
            r.head(parts.status);
        }
        let body = EngineBody::watch(
            body,
            (guard, permit),
            (config.decode_idle_timeout, deadline),
            (route, verdict),
            Watched {
                events: sse && parts.status.is_success(),
                api,
            },
        );
        let mut body = PdBody::forward(body.boxed(), sse).scrubbed(&parts.headers);
        if let Some(api) = api {
            body = body.answering(api);
        }
        strip(&mut parts.headers);
        if direct {
            parts
                .headers
                .insert(disagg_core::proto::HANDOFF_HEADER, DIRECT);
        }
        Response::from_parts(parts, body)
    }

    /// The engine for a forwarded request naming `model`: among the engines serving it,
    /// the decode ones when there are any (always for `direct`), the one with the
    /// fewest requests in flight; ties take turns. A request naming none may go to any
    /// engine, but `generation` (sent direct) goes to the one model served, and is
    /// refused ([`RouteError::ModelRequired`]) in a fleet of several, as an
    /// orchestrated request is: an engine of another model would generate with it.
    fn pick(
        &self,
        set: &EndpointSet,
        model: Option<&str>,
        direct: bool,
        generation: bool,
    ) -> Result<Arc<Endpoint>, RouteError> {
        let set = match model {
            Some(_) => set.for_model(model)?,
            None if generation => set.for_model(None)?,
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
    ///
    /// Every engine is the source's whole set, before health filtering
    /// ([`unfiltered_snapshot`](disagg_core::EndpointSource::unfiltered_snapshot)): an
    /// engine ejected or down is asked too (a LoRA adapter loaded while it was out must
    /// be on it when it returns), and one that cannot be reached fails the fan-out. Each
    /// engine's request counts in its in-flight number until its answer is read. Only a
    /// connection that could not be made is told to passive health, as the engine's
    /// failure: an admin request's error status or slow answer may be the request's
    /// own (a route the engine does not serve, a weight update that takes its time),
    /// and it reaches every engine at once.
    ///
    /// `route` is told that the client left when its body broke off with its
    /// connection; left in place otherwise.
    pub(crate) async fn fan_out<B>(
        &self,
        req: Request<B>,
        route: &mut Option<RouteEnd>,
    ) -> Response<PdBody>
    where
        B: Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
    {
        let (parts, body) = req.into_parts();
        let (bytes, share) = match body::read(body, self.limits()).await {
            Ok(read) => read,
            Err(err) => return body_refused(&err, route),
        };
        let (bytes, model) = match engine_body_off_loop(bytes, None, share).await {
            Ok(b) => b,
            Err(err) => return pd_error_response(&err),
        };
        let set = self.orchestrator.source().unfiltered_snapshot();
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
        headers.insert(REQUEST_ID, self.engine_ids.next_id());
        let timeout = config.decode_head_timeout;
        let transport = self.orchestrator.transport();
        let orchestrator = &self.orchestrator;
        let sends = targets.iter().map(|ep| {
            let mut out = Request::new(bytes.clone());
            *out.method_mut() = parts.method.clone();
            *out.headers_mut() = headers.clone();
            let uri = ep.uri(path);
            async move {
                // The engine's place, held until its answer is read (or the client
                // leaves and this is dropped).
                let _place = ep.track();
                let uri = uri.map_err(|e| e.to_string())?;
                *out.uri_mut() = uri;
                let answer = one_answer(transport, out, timeout).await;
                if let Err(Unread {
                    unreachable: true, ..
                }) = &answer
                {
                    let call = RouteAction::FannedOut.name();
                    orchestrator.engine_call(ep, call, LegOutcome::Failed, false);
                }
                answer
            }
        });
        // An adapter loaded or unloaded changes the model list: dropped when the engines
        // have answered, or when the client leaves before (they may still apply it).
        let invalidate = self.config.models.invalidate_on_drop();
        let answers = futures::future::join_all(sends).await;
        drop(invalidate);
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

/// Read a forwarded client's `body`, under `limits`, until its first bytes tell whether
/// it is a JSON object: those bytes, the rest of the body unread, and what they told.
///
/// They are read as an orchestrated body is ([`body::read`]): held to the budget as
/// they grow (503 `server_busy` past it, as for an orchestrated body), to the size
/// limit and to the body timeout, and looked at once each, where the last frame
/// left off ([`ObjectStart`](sniff::ObjectStart)): a body of many one-byte frames of
/// whitespace costs its length, not its square. Their share of the budget is given
/// back here: a body read whole takes its own share again at once, and one streamed
/// is sent to the engine as it comes.
async fn sniff_start(
    body: ClientBody,
    limits: body::Limits<'_>,
) -> Result<(Bytes, ClientBody, bool), PdError> {
    let (sniff, mut back) = sniff::Sniff::new(body);
    let (start, _share) = body::read(sniff, limits).await?;
    match back.try_recv() {
        Ok(Some((rest, object))) => Ok((start, rest, object)),
        // `Sniff` hands the body back whenever its read ends without an error.
        _ => Err(PdError::body("the body was already read")),
    }
}

/// [`engine_body`], through [`off_loop`] (as the orchestrated routes parse theirs): a
/// large body (or a hostile one of many keys) would otherwise hold the event loop, and
/// every connection on it, for its parse and copy.
async fn engine_body_off_loop(
    bytes: Bytes,
    form: Option<Vec<u8>>,
    share: body::Share<'_>,
) -> Result<(Bytes, Option<String>), PdError> {
    off_loop(bytes.len(), share, move || engine_body(bytes, form)).await
}

/// `work` on a body of `len` bytes, holding its `share` of the budget until it ends: on
/// Tokio's blocking pool from [`PARSE_OFF_LOOP_FROM`](body::PARSE_OFF_LOOP_FROM) on (see
/// there for the threshold and why the blocking pool), else here.
async fn off_loop<T: Send + 'static>(
    len: usize,
    share: body::Share<'_>,
    work: impl FnOnce() -> Result<T, PdError> + Send + 'static,
) -> Result<T, PdError> {
    if len >= body::PARSE_OFF_LOOP_FROM {
        return body::on_blocking_pool(share, work).await;
    }
    // `share` is dropped once `work` has ended.
    work()
}

/// The answer to a client body that could not be read (too large, too slow, over the
/// budget, broken off): its error, and the connection closed, as the rest of the body is
/// unread. A body that broke off with its client's connection
/// ([`client_left`](body::client_left)) tells `route` that the client left (499): the
/// answer reaches no one.
fn body_refused(err: &PdError, route: &mut Option<RouteEnd>) -> Response<PdBody> {
    if body::client_left(err)
        && let Some(route) = route.take()
    {
        route.left();
    }
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

/// Why one engine's answer to a fanned-out request is not listed whole, and its status
/// when its head came (its body past [`FAN_OUT_ANSWER_LIMIT`], cut off or late): the
/// engine may have done what it was asked, and its line says so.
struct Unread {
    status: Option<StatusCode>,
    why: String,
    /// No connection to the engine could be made.
    unreachable: bool,
}

impl From<String> for Unread {
    /// No answer at all: `why`.
    fn from(why: String) -> Self {
        Unread {
            status: None,
            why,
            unreachable: false,
        }
    }
}

/// One engine's answer to a fanned-out request, within `timeout` from head to end: its
/// status and body, or why it is not listed whole.
async fn one_answer(
    transport: &dyn Transport,
    req: Request<Bytes>,
    timeout: Duration,
) -> Result<(StatusCode, Bytes), Unread> {
    let deadline = tokio::time::Instant::now() + timeout;
    let ms = timeout.as_millis();
    let resp = match tokio::time::timeout_at(deadline, transport.send(req)).await {
        Ok(Ok(resp)) => resp,
        // With its causes: the transport's own words say only that it failed.
        Ok(Err(e)) => {
            let mut unread = Unread::from(error_chain(&e));
            unread.unreachable = matches!(e, TransportError::Connect(_));
            return Err(unread);
        }
        Err(_) => return Err(format!("no answer within {ms} ms").into()),
    };
    let status = resp.status();
    let body = collect_limited(resp.into_body(), FAN_OUT_ANSWER_LIMIT);
    let why = match tokio::time::timeout_at(deadline, body).await {
        Ok(Ok(body)) => return Ok((status, body)),
        // Past the ceiling, by its `content-length` or as it came: `Limited`'s own error.
        Ok(Err(e)) if e.is::<LengthLimitError>() => {
            format!("the answer is longer than {FAN_OUT_ANSWER_LIMIT} bytes")
        }
        Ok(Err(e)) => format!("reading the answer: {}", error_chain(&*e)),
        Err(_) => format!("the answer did not end within {ms} ms"),
    };
    Err(Unread {
        status: Some(status),
        why,
        unreachable: false,
    })
}

/// One engine's line in a fan-out answer.
#[derive(serde::Serialize)]
struct FanOutResult<'a> {
    endpoint: &'a str,
    role: &'static str,
    /// Its status; `null` when it gave none (unreachable, timed out before its head).
    status: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    body: Option<FanOutBody<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// An engine's answer as a fan-out answer lists it: JSON as the engine wrote it
/// (checked, never parsed into a tree: a tree of a 64 KiB answer of tiny items costs
/// many times its size), anything else as a string of its text.
#[derive(serde::Serialize)]
#[serde(untagged)]
enum FanOutBody<'a> {
    Json(&'a serde_json::value::RawValue),
    Text(std::borrow::Cow<'a, str>),
}

impl<'a> FanOutBody<'a> {
    fn of(body: &'a [u8]) -> Self {
        match serde_json::from_slice(body) {
            Ok(raw) => FanOutBody::Json(raw),
            Err(_) => FanOutBody::Text(String::from_utf8_lossy(body)),
        }
    }
}

/// A fan-out answer; with an `error` when not every engine answered 2xx.
#[derive(serde::Serialize)]
struct FanOutAnswer<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<serde_json::Value>,
    object: &'static str,
    path: &'a str,
    results: Vec<FanOutResult<'a>>,
}

fn fan_out_answer(
    path: &str,
    targets: &[&Arc<Endpoint>],
    answers: Vec<Result<(StatusCode, Bytes), Unread>>,
) -> Response<PdBody> {
    let mut results = Vec::with_capacity(answers.len());
    let mut statuses = Vec::with_capacity(answers.len());
    let mut failed = Vec::new();
    for (ep, answer) in targets.iter().zip(&answers) {
        let mut entry = FanOutResult {
            endpoint: ep.id().as_str(),
            role: role(ep),
            status: None,
            body: None,
            error: None,
        };
        match answer {
            Ok((status, body)) => {
                entry.status = Some(status.as_u16());
                entry.body = Some(FanOutBody::of(body));
                if !status.is_success() {
                    failed.push(format!("{} answered {}", ep.id(), status.as_u16()));
                }
                statuses.push(Some(*status));
            }
            Err(e) => {
                failed.push(format!("{}: {}", ep.id(), e.why));
                entry.status = e.status.map(|s| s.as_u16());
                entry.error = Some(e.why.clone());
                // Not listed whole: a failure, whatever its status.
                statuses.push(None);
            }
        }
        results.push(entry);
    }
    let mut answer = FanOutAnswer {
        error: None,
        object: "fan_out",
        path,
        results,
    };
    if failed.is_empty() {
        return json_response(StatusCode::OK, fan_out_bytes(&answer));
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
    answer.error = Some(serde_json::json!({
        "message": message, "type": error_type, "param": null, "code": code
    }));
    json_response(status, fan_out_bytes(&answer))
}

/// `answer` written out (it cannot fail: its parts are strings, numbers and checked
/// JSON).
fn fan_out_bytes(answer: &FanOutAnswer<'_>) -> Bytes {
    serde_json::to_vec(answer).map_or_else(|_| Bytes::new(), Bytes::from)
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
pub(crate) fn may_have_body(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_LENGTH)
        .is_none_or(|v| v.as_bytes() != b"0")
}

/// A client's whole body as an engine may get it, and the `model` it names: a JSON
/// object loses the handoff fields no client may send
/// ([`strip_client_handoff`](disagg_core::proto::strip_client_handoff)), as on every
/// leg; anything else is passed as it came, a form delimited by `form` (a direct
/// request's `multipart/form-data` boundary) naming its model in its `model` field
/// ([`form::model`]).
///
/// # Errors
///
/// 400 for a body that starts as a JSON object ([`json_object_start`]) but does not
/// parse as one in UTF-8 (a byte-order mark, UTF-16 or -32, `NaN`): the engines'
/// Python reads those, the proxy could not strip them, so it refuses them as the
/// orchestrated routes do; the same for one whose nested handoff objects it cannot walk
/// (a key holding a lone surrogate), and for a form whose `model` field is longer than
/// [`form::MODEL_FIELD_MAX`] or not UTF-8.
fn engine_body(bytes: Bytes, form: Option<Vec<u8>>) -> Result<(Bytes, Option<String>), PdError> {
    if !json_object_start(&bytes, true).unwrap_or(false) {
        let model = match form {
            Some(boundary) => form::model(&bytes, &boundary).map_err(PdError::body)?,
            None => None,
        };
        return Ok((bytes, model));
    }
    let mut json = JsonBody::parse_bytes(&bytes).map_err(PdError::body)?;
    let model = match json.get_as::<String>("model") {
        Some(Ok(m)) => Some(m),
        _ => None,
    };
    if disagg_core::proto::strip_client_handoff(&mut json).map_err(PdError::body)? {
        return Ok((json.to_bytes(), model));
    }
    Ok((bytes, model))
}

#[cfg(test)]
mod tests {
    use http_body::Frame;

    use super::*;

    #[test]
    fn the_engines_body_keeps_its_bytes_unless_a_handoff_was_removed() {
        let plain = Bytes::from_static(br#"{"model":"m", "prompt" : "p"}"#);
        let (bytes, model) = engine_body(plain.clone(), None).unwrap();
        assert_eq!(bytes.as_ptr(), plain.as_ptr(), "no copy");
        assert_eq!(model.as_deref(), Some("m"));
        let (bytes, model) = engine_body(
            Bytes::from_static(
                br#"{"model":"m","bootstrap_host":"h","vllm_xargs":{"kv_transfer_params":1}}"#,
            ),
            None,
        )
        .unwrap();
        assert_eq!(&bytes[..], br#"{"model":"m","vllm_xargs":{}}"#);
        assert_eq!(model.as_deref(), Some("m"));
        let form = Bytes::from_static(b"--x\r\n\r\n--x--");
        assert_eq!(
            engine_body(form.clone(), None).unwrap(),
            (form.clone(), None)
        );
        assert!(engine_body(Bytes::from_static(b"{\"a\":NaN}"), None).is_err());
        // A direct form's `model` field; a JSON body's `model` whatever the type says.
        let named = Bytes::from_static(
            b"--x\r\ncontent-disposition: form-data; name=model\r\n\r\nw\r\n--x--",
        );
        let (bytes, model) = engine_body(named.clone(), Some(b"x".to_vec())).unwrap();
        assert_eq!((bytes, model.as_deref()), (named, Some("w")));
        assert_eq!(
            engine_body(form.clone(), Some(b"x".to_vec())).unwrap(),
            (form, None)
        );
        let (_, model) = engine_body(plain, Some(b"x".to_vec())).unwrap();
        assert_eq!(model.as_deref(), Some("m"));
    }

    /// The fan-out answer lists each engine's JSON answer as the engine wrote it (its keys'
    /// order, its numbers' spelling), not parsed into a tree and written again: a tree
    /// of a 64 KiB answer of tiny items costs many times its size.
    #[test]
    fn a_fanned_out_answer_carries_each_engines_json_as_it_came() {
        let p = Arc::new(Endpoint::new("http://127.0.0.1:8100", Role::Prefill).unwrap());
        let d = Arc::new(Endpoint::new("http://127.0.0.1:8200", Role::Decode).unwrap());
        let json = Bytes::from_static(br#"{"z": 1, "a": [1.50, {}]}"#);
        let text = Bytes::from_static(b"Success: \xff loaded");
        let answers = vec![
            Ok((StatusCode::OK, json.clone())),
            Ok((StatusCode::OK, text)),
        ];
        let resp = fan_out_answer("/v1/load_lora_adapter", &[&p, &d], answers);
        assert_eq!(resp.status(), StatusCode::OK);
        let body = futures::executor::block_on(resp.into_body().collect())
            .unwrap()
            .to_bytes();
        let body = std::str::from_utf8(&body).unwrap();
        assert!(
            body.contains(r#""body":{"z": 1, "a": [1.50, {}]}"#),
            "{body}"
        );
        // Not JSON: a string of its text, invalid UTF-8 replaced.
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["results"][1]["body"], "Success: \u{fffd} loaded");
        assert_eq!(v["results"][0]["endpoint"], p.id().as_str());
        assert_eq!(v["results"][1]["role"], "decode");
        assert_eq!(v["results"][0]["status"], 200);
        // A failure keeps the same entries, and the error beside them.
        let answers = vec![
            Ok((StatusCode::OK, json)),
            Err("connection refused".to_string().into()),
        ];
        let resp = fan_out_answer("/v1/load_lora_adapter", &[&p, &d], answers);
        assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
        let body = futures::executor::block_on(resp.into_body().collect())
            .unwrap()
            .to_bytes();
        let body = std::str::from_utf8(&body).unwrap();
        assert!(
            body.contains(r#""body":{"z": 1, "a": [1.50, {}]}"#),
            "{body}"
        );
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["results"][1]["status"], serde_json::Value::Null);
        assert_eq!(v["results"][1]["error"], "connection refused");
        assert_eq!(v["error"]["code"], "fan_out_failed");
        // An engine's answer nested as deep as its 64 KiB allow: checked without
        // recursion (serde_json skips a raw value with a loop) and carried as it came,
        // as a forwarded answer is; the proxy builds no tree of it.
        let deep = format!("{}{}", "[".repeat(32_768), "]".repeat(32_768));
        let answers = vec![
            Ok((StatusCode::OK, Bytes::from(deep.clone()))),
            Ok((StatusCode::OK, Bytes::from_static(br#"{"z": 1}"#))),
        ];
        let resp = fan_out_answer("/v1/load_lora_adapter", &[&p, &d], answers);
        assert_eq!(resp.status(), StatusCode::OK);
        let body = futures::executor::block_on(resp.into_body().collect())
            .unwrap()
            .to_bytes();
        let body = std::str::from_utf8(&body).unwrap();
        assert!(
            body.contains(&format!(r#""body":{deep}}}"#)),
            "the deep answer as it came"
        );
        assert!(body.contains(r#""body":{"z": 1}"#), "{body}");
    }

    #[tokio::test]
    async fn large_bodies_are_parsed_off_the_event_loop() {
        // A current-thread runtime: its one thread is the event loop.
        let here = std::thread::current().id();
        let budget = crate::body::BodyBudget::new(1 << 20);
        let share = || body::Share::new(&budget);
        let on = |len| off_loop(len, share(), || Ok(std::thread::current().id()));
        assert_eq!(on(body::PARSE_OFF_LOOP_FROM - 1).await.unwrap(), here);
        assert_ne!(on(body::PARSE_OFF_LOOP_FROM).await.unwrap(), here);
        // The same result there as here.
        let prompt = "a".repeat(body::PARSE_OFF_LOOP_FROM);
        let large = format!(r#"{{"model":"m","prompt":"{prompt}","bootstrap_host":"h"}}"#);
        let (bytes, model) = engine_body_off_loop(Bytes::from(large), None, share())
            .await
            .unwrap();
        assert_eq!(bytes, format!(r#"{{"model":"m","prompt":"{prompt}"}}"#));
        assert_eq!(model.as_deref(), Some("m"));
        let bad = Bytes::from(format!(r#"{{"p":"{prompt}","x":NaN}}"#));
        let err = engine_body_off_loop(bad, None, share()).await.unwrap_err();
        assert_eq!(err.http().status, StatusCode::BAD_REQUEST);
    }

    /// A streamed client body of `pieces`, each its own frame, to at most `max_bytes`.
    fn client_body(pieces: Vec<Bytes>, max_bytes: usize) -> ClientBody {
        client_body_told(pieces, max_bytes, Arc::new(OnceLock::new()))
    }

    /// [`client_body`], its breach of a limit told in `failed`.
    fn client_body_told(
        pieces: Vec<Bytes>,
        max_bytes: usize,
        failed: Arc<OnceLock<PdError>>,
    ) -> ClientBody {
        let frames = pieces
            .into_iter()
            .map(|b| Ok::<_, BoxError>(Frame::data(b)));
        let body = http_body_util::StreamBody::new(futures::stream::iter(frames));
        let limits = StreamLimits {
            max_bytes,
            timeout: Duration::from_secs(5),
            failed,
            ended: Arc::default(),
        };
        ClientBody::stream(body, limits)
    }

    fn limits(budget: &crate::body::BodyBudget) -> body::Limits<'_> {
        body::Limits {
            max_bytes: 1 << 20,
            timeout: Duration::from_secs(5),
            budget,
        }
    }

    #[tokio::test]
    async fn a_body_of_many_frames_of_whitespace_is_told_and_held_to_the_budget() {
        let space = Bytes::from_static(b" ");
        let mut pieces = vec![space.clone(); 200_000];
        pieces.extend([Bytes::from_static(b"{}"), Bytes::from_static(b"more")]);
        let budget = crate::body::BodyBudget::new(1 << 20);
        let (start, mut rest, object) = sniff_start(client_body(pieces, 1 << 20), limits(&budget))
            .await
            .unwrap();
        assert!(object);
        assert_eq!(start.len(), 200_002);
        assert_eq!(&start[199_999..], b" {}");
        // Read to where it told; the rest is the client's still, and the share is back.
        let rest = rest.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(rest, "more");
        assert_eq!(budget.in_use(), 0);
        // Not an object: read to where it told, too.
        let pieces = vec![space.clone(), Bytes::from_static(b"  x"), space.clone()];
        let (start, _, object) = sniff_start(client_body(pieces, 1 << 20), limits(&budget))
            .await
            .unwrap();
        assert!(!object);
        assert_eq!(start, "   x");
        // Whitespace past what the budget has room for is refused, not held.
        let budget = crate::body::BodyBudget::new(100_000);
        let pieces = vec![space.clone(); 200_000];
        let err = sniff_start(client_body(pieces, 1 << 20), limits(&budget))
            .await
            .err()
            .unwrap();
        assert_eq!(
            (err.http().status, err.http().code),
            (StatusCode::SERVICE_UNAVAILABLE, "server_busy")
        );
        assert_eq!(budget.in_use(), 0);
        // Past the size limit: 413, as for any body (told on the side, as `forward`
        // reads it).
        let failed = Arc::new(OnceLock::new());
        let body = client_body_told(vec![space; 2_000], 1_000, Arc::clone(&failed));
        let err = sniff_start(body, limits(&budget)).await.err().unwrap();
        assert_eq!(err.http().code, "invalid_request_body");
        assert_eq!(failed.get().unwrap().http().code, "request_too_large");
    }
}
