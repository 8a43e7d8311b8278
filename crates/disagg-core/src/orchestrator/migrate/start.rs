//! A continuation's legs: the decode it goes to, through a fresh prefill (an attempt
//! of its own) or decode-only, and its head.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderValue};

use crate::endpoint::{Endpoint, EndpointId, InFlightGuard};
use crate::error::{PdError, Side, TransportError};
use crate::outcome::LegOutcome;
use crate::policy::Permit;
use crate::request::{Api, PdRequest, REQUEST_ID};
use crate::router::Route;
use crate::transport::BoxBody;

use super::super::attempt::{Failure, Watch};
use super::super::body::{Finish, PdBody};
use super::Ctx;

/// What a continuation through a fresh prefill needs: the orchestrator's attempt
/// machinery and the request's deadline.
pub(crate) struct ThroughPrefill {
    pub(crate) inner: std::sync::Weak<super::super::Inner>,
    pub(crate) clock: super::super::clock::Clock,
}

pub(super) type Continuation = Pin<Box<dyn Future<Output = Result<Started, NotStarted>> + Send>>;

/// Why a continuation did not start.
pub(super) struct NotStarted {
    /// The decode it was sent to (never chosen again for this request).
    pub(super) tried: Option<Arc<Endpoint>>,
    /// The engine to report failed, when no report named it yet (a continuation
    /// through a prefill reports its own attempt).
    pub(super) blame: Option<Arc<Endpoint>>,
    /// The prefill it went through.
    pub(super) prefill: Option<Arc<Endpoint>>,
    pub(super) error: PdError,
}

impl NotStarted {
    fn unrouted(error: PdError) -> Self {
        NotStarted {
            tried: None,
            blame: None,
            prefill: None,
            error,
        }
    }
}

/// The leg relayed now: its endpoint, held in flight, and the router's place on it
/// ([`Route::with_holds`]), both given back when its stream ends or is abandoned.
pub(super) struct Current {
    pub(super) endpoint: Arc<Endpoint>,
    /// Dropped before `hold`: a place given back wakes requests waiting for room on
    /// this endpoint, which must find its count already down.
    pub(super) guard: Option<InFlightGuard>,
    pub(super) hold: Option<Permit>,
}

impl Current {
    /// The leg's stream ended or was abandoned: its endpoint no longer counts it.
    pub(super) fn release(&mut self) {
        self.guard = None;
        self.hold = None;
    }
}

/// How a continuation went through a fresh prefill, when it did not start.
enum PrefillFell {
    /// The prefill side failed (reported): the continuation goes decode-only.
    Prefill,
    /// The decode side failed (reported).
    Decode(PdError),
}

pub(super) struct Started {
    pub(super) current: Current,
    pub(super) body: BoxBody,
    /// The prefill of a continuation through a fresh prefill leg.
    pub(super) prefill: Option<Arc<Endpoint>>,
}

/// `POST /v1/completions` on the least busy decode endpoint not tried yet, for the
/// request's model, placed by the router as the decode of a request sent to one engine
/// ([`Router::place_queued`](crate::router::Router::place_queued), told whether the
/// request waited in the admission queue: a router that counts places per endpoint
/// waits for room, within the continuation's head budget, and holds one on it); its
/// head within the decode head timeout.
pub(super) async fn start(
    ctx: Arc<Ctx>,
    body: Bytes,
    tried: Vec<EndpointId>,
    n: u32,
    span: Option<[u8; 8]>,
) -> Result<Started, NotStarted> {
    let model = ctx
        .plan
        .body
        .get("model")
        .and_then(|m| serde_json::from_slice::<String>(m).ok());
    // Picked again on a fresh snapshot after each wait for room.
    let pick = || -> Result<Arc<Endpoint>, PdError> {
        let all = ctx.source.snapshot();
        let set = all.for_model(model.as_deref()).map_err(PdError::from)?;
        set.decode()
            .iter()
            .filter(|e| !tried.contains(e.id()))
            .min_by_key(|e| e.in_flight())
            .cloned()
            .ok_or_else(|| PdError::from(crate::error::RouteError::NoDecode))
    };
    // A head timeout past what the clock can hold is no limit (as a deadline is).
    let by = tokio::time::Instant::now().checked_add(ctx.head_timeout);
    let until = match (ctx.deadline, by) {
        (Some(d), Some(b)) => Some(d.min(b)),
        (d, b) => d.or(b),
    };
    let mut placed = ctx
        .reporter
        .router
        .place_queued(&pick, until, ctx.queued)
        .await
        .map_err(NotStarted::unrouted)?;
    let hold = placed.take_decode_hold();
    let endpoint = Arc::clone(&placed.decode);
    let held = |mut started: Started| {
        started.current.hold = hold;
        started
    };
    // Through a fresh prefill when the request was disaggregated: the prefill that
    // computed the prompt (its prefix cache holds it) if it is still there, else the
    // least busy one. Decode-only when none is, or when the prefill side fails.
    let inner = ctx.through_prefill.as_ref().and_then(|t| t.inner.upgrade());
    if let Some(inner) = inner {
        let all = ctx.source.snapshot();
        let prefill = all.for_model(model.as_deref()).ok().and_then(|set| {
            ctx.route
                .prefill
                .as_ref()
                .and_then(|p| set.prefill().iter().find(|e| e.id() == p.id()))
                .or_else(|| set.prefill().iter().min_by_key(|e| e.in_flight()))
                .cloned()
        });
        if let Some(prefill) = prefill {
            match through_prefill(&ctx, &inner, &body, &prefill, &endpoint, n, span).await {
                Ok(started) => return Ok(held(started)),
                Err(PrefillFell::Decode(error)) => {
                    return Err(NotStarted {
                        tried: Some(endpoint),
                        blame: None,
                        prefill: Some(prefill),
                        error,
                    });
                }
                Err(PrefillFell::Prefill) => {}
            }
        }
    }
    send(&ctx, body, &endpoint, n, span)
        .await
        .map(|(body, guard)| {
            held(Started {
                current: Current {
                    endpoint: Arc::clone(&endpoint),
                    guard: Some(guard),
                    hold: None,
                },
                body,
                prefill: None,
            })
        })
        .map_err(|error| NotStarted {
            tried: Some(Arc::clone(&endpoint)),
            blame: Some(endpoint),
            prefill: None,
            error,
        })
}

/// The continuation `body` as a disaggregated attempt of its own, on `prefill` and
/// `decode`: the connector's plan, the prefill leg, the handoff and the decode leg, as
/// for any request (`/v1/completions` with the token prompt). The attempt is reported
/// when it fails; its 2xx decode answer is the continuation.
#[allow(clippy::too_many_arguments)] // private; the continuation's parts
async fn through_prefill(
    ctx: &Ctx,
    inner: &super::super::Inner,
    body: &Bytes,
    prefill: &Arc<Endpoint>,
    decode: &Arc<Endpoint>,
    n: u32,
    span: Option<[u8; 8]>,
) -> Result<Started, PrefillFell> {
    let Some(through) = &ctx.through_prefill else {
        return Err(PrefillFell::Prefill);
    };
    let mut headers = http::HeaderMap::new();
    for (name, value) in &ctx.forwarded {
        headers.append(name.clone(), value.clone());
    }
    let Ok(mut req) = PdRequest::new(api(ctx), headers, body) else {
        return Err(PrefillFell::Prefill);
    };
    // The original request's client: a connector keeping state per client (a
    // conversation's KV) scopes the continuation's as the original's.
    req.set_received(crate::outcome::now(), ctx.client.clone());
    let id = format!("{}-m{n}", String::from_utf8_lossy(ctx.engine_id.as_bytes()));
    let id = HeaderValue::from_str(&id).unwrap_or_else(|_| ctx.engine_id.clone());
    // Both legs' engine spans sit under the migration's.
    let trace = match (&ctx.trace, span) {
        (Some((t, _)), Some(span)) => {
            let mut t = t.clone();
            t.prefill = span;
            t.handoff = span;
            t.decode = span;
            Some(t)
        }
        _ => None,
    };
    let route = Route::new(Some(Arc::clone(prefill)), Arc::clone(decode));
    // An attempt of its own: dropped once under way (the client left), it is reported
    // cancelled, its legs as far as they went.
    let mut cancelled = None;
    let mut watch = Watch::new(&ctx.reporter, trace.as_ref(), n, &mut cancelled);
    watch.routed(&route);
    watch.tl.start = crate::outcome::now();
    let attempt = inner.attempt_on(
        &req,
        route.clone(),
        id,
        trace.as_ref(),
        through.clock,
        &mut watch.tl,
    );
    let result = attempt.await;
    let mut tl = watch.ended();
    let mut failure = match result {
        Ok(mut ex) => {
            // The decode's own handoff, kept by the plan (a conversation's KV), is
            // given to it as the continuation's stream is scrubbed.
            let returned = ex.returned.take();
            match ex.into_decoded() {
                Ok((head, guard, pending)) => {
                    let body = if pending.is_some() || returned.is_some() {
                        // A concurrent prefill still running rides along, as in any
                        // answer.
                        let scrub = returned.is_some();
                        http_body_util::BodyExt::boxed(
                            PdBody::stream(
                                head.into_body(),
                                true,
                                Finish::holding(None, None),
                                pending,
                                None,
                            )
                            .scrubbing(scrub)
                            .capturing(returned),
                        )
                    } else {
                        head.into_body()
                    };
                    return Ok(Started {
                        current: Current {
                            endpoint: Arc::clone(decode),
                            guard: Some(guard),
                            hold: None,
                        },
                        body,
                        prefill: Some(Arc::clone(prefill)),
                    });
                }
                // The prefill's own answer (a 4xx, or the whole answer): decode-only.
                Err(Side::Prefill) => return Err(PrefillFell::Prefill),
                // A decode's error status: not a continuation.
                Err(_) => Failure::decode(
                    &route,
                    PdError::upstream_status(
                        Side::Decode,
                        decode.id().clone(),
                        http::StatusCode::BAD_GATEWAY,
                        None,
                    ),
                    LegOutcome::Answered,
                ),
            }
        }
        Err(f) => f,
    };
    if let Some(report) = &mut failure.report {
        tl.end = Some(crate::outcome::now());
        report.timeline = tl;
        report.trace = trace;
        report.attempt = n;
        ctx.reporter.report(report);
    }
    tracing::warn!(
        error = %crate::error::error_chain(&failure.error),
        prefill = %prefill.id(),
        "continuation through a fresh prefill failed"
    );
    match failure.error.side() {
        Side::Decode => Err(PrefillFell::Decode(failure.error)),
        _ => Err(PrefillFell::Prefill),
    }
}

/// Send a continuation's `body` to `endpoint`; its 2xx head's body.
async fn send(
    ctx: &Ctx,
    body: Bytes,
    endpoint: &Arc<Endpoint>,
    n: u32,
    span: Option<[u8; 8]>,
) -> Result<(BoxBody, InFlightGuard), PdError> {
    let guard = endpoint.track();
    let id = endpoint.id().clone();
    let transport_err = |e| PdError::transport(Side::Decode, id.clone(), e);
    let uri = endpoint
        .api_uri(api(ctx))
        .map_err(|e| transport_err(TransportError::Connect(e.into())))?;
    let mut req = http::Request::new(body);
    *req.method_mut() = http::Method::POST;
    *req.uri_mut() = uri;
    let h = req.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    for (name, value) in &ctx.forwarded {
        h.append(name.clone(), value.clone());
    }
    let leg_id = format!("{}-m{n}", String::from_utf8_lossy(ctx.engine_id.as_bytes()));
    if let Ok(v) = HeaderValue::from_str(&leg_id) {
        h.insert(REQUEST_ID, v);
    }
    // The engine's own spans sit under the migration's.
    if let (Some((trace, _)), Some(span)) = (&ctx.trace, span) {
        trace.inject(&span, h);
    }
    let sent = tokio::time::Instant::now();
    let head = match tokio::time::timeout(ctx.head_timeout, ctx.transport.send(req)).await {
        Ok(Ok(head)) => head,
        Ok(Err(e)) => return Err(transport_err(e)),
        Err(_) => return Err(transport_err(TransportError::Timeout)),
    };
    let status = head.status();
    if !status.is_success() {
        // Its message within what is left of the head's budget: a body that never ends
        // holds the client's stream no longer than a head that never comes.
        let left = ctx.head_timeout.saturating_sub(sent.elapsed());
        let detail = super::super::legs::error_message(head.into_body(), 64 * 1024, left).await;
        return Err(PdError::upstream_status(Side::Decode, id, status, detail));
    }
    Ok((head.into_body(), guard))
}

/// The API a continuation is posted to: SGLang's `/generate` for a `/generate`
/// request, else vLLM's `/v1/completions` (a token prompt).
fn api(ctx: &Ctx) -> Api {
    if ctx.plan.generate.is_some() {
        Api::Generate
    } else {
        Api::Completions
    }
}
