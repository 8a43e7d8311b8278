//! A continuation's legs: the decode it goes to, through a fresh prefill (an attempt
//! of its own) or decode-only, and its head.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use tokio::time::Instant;

use crate::endpoint::{Endpoint, EndpointId, InFlightGuard};
use crate::error::{PdError, Phase, RouteError, Side, TransportError};
use crate::outcome::{LegOutcome, Timeline};
use crate::policy::Permit;
use crate::request::{Api, PdRequest, REQUEST_ID};
use crate::router::Route;
use crate::transport::BoxBody;

use super::super::attempt::{Failure, Watch};
use super::super::body::{Finish, PdBody};
use super::super::leg_outcome;
use super::super::respond::{Decoded, NotDecoded};
use super::Ctx;
use super::fresh::{PrefillLeg, RidingEnd};
use super::times::LegTimes;

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
    /// Its fresh prefill, when that failed before the decode started through its
    /// engine's fault, its leg told failed (never chosen again for this request).
    pub(super) failed_prefill: Option<EndpointId>,
    /// What is known of the time of the decode leg `blame` names.
    pub(super) times: LegTimes,
    pub(super) error: PdError,
}

impl NotStarted {
    fn unrouted(error: PdError) -> Self {
        NotStarted {
            tried: None,
            blame: None,
            prefill: None,
            failed_prefill: None,
            times: LegTimes::default(),
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
    /// The concurrent prefill riding in this leg's stream (a continuation's fresh
    /// prefill), and how it ended once it failed (the stream ended for it).
    pub(super) riding: Option<(EndpointId, Arc<RidingEnd>)>,
    /// What is known of the leg's time, for the report that tells its decode failed.
    pub(super) times: LegTimes,
}

impl Current {
    /// The leg's stream ended or was abandoned: its endpoint no longer counts it.
    pub(super) fn release(&mut self) {
        self.guard = None;
        self.hold = None;
    }

    /// The engine to blame for this leg's stream breaking, and what is known of the
    /// leg's time (taken: the leg is done): its decode, unless the prefill riding in
    /// the stream failed first (which ended it, and was blamed).
    pub(super) fn take_blame(&mut self) -> Option<(Arc<Endpoint>, LegTimes)> {
        match self.failed_prefill() {
            Some(_) => None,
            None => Some((Arc::clone(&self.endpoint), std::mem::take(&mut self.times))),
        }
    }

    /// The prefill riding in this leg's stream, when it failed (and ended the stream,
    /// whoever is to blame): the decode may be picked again for the request.
    pub(super) fn failed_prefill(&self) -> Option<&EndpointId> {
        match &self.riding {
            Some((prefill, end)) if end.ended_it() => Some(prefill),
            _ => None,
        }
    }

    /// The prefill riding in this leg's stream, when it failed through its engine's
    /// fault (its leg told failed): not to be picked again for the request. One that
    /// refused its leg (a 4xx) or ran into the request's deadline may be.
    pub(super) fn blamed_prefill(&self) -> Option<&EndpointId> {
        match &self.riding {
            Some((prefill, end)) if end.blamed() => Some(prefill),
            _ => None,
        }
    }
}

/// When a continuation must have started by: one end for its waits for room (its
/// decode's place, its fresh prefill's), a fresh prefill leg and its handoff, and its
/// decode's response head, counted from the break it continues (a continuation that
/// could not start leaves the next one no new window). A step cut at this end ran out
/// of the continuation's time, not of its own budget: its engine is not blamed.
#[derive(Debug, Clone, Copy)]
pub(super) struct End {
    at: Option<Instant>,
    /// The request's deadline is what sets it.
    deadline: bool,
}

impl End {
    /// The end of a continuation of a stream that broke at `broke`: one decode head
    /// timeout on, or the request's deadline when sooner. A head timeout past what the
    /// clock can hold is no limit (as a deadline is).
    pub(super) fn of(ctx: &Ctx, broke: Instant) -> Self {
        let own = broke.checked_add(ctx.head_timeout);
        match (ctx.deadline, own) {
            (Some(d), Some(own)) if own < d => End {
                at: Some(own),
                deadline: false,
            },
            (Some(d), _) => End {
                at: Some(d),
                deadline: true,
            },
            (None, own) => End {
                at: own,
                deadline: false,
            },
        }
    }

    pub(super) fn passed(self) -> bool {
        self.at.is_some_and(|at| Instant::now() >= at)
    }

    /// The end of a wait for a fresh prefill's room begun now: half the time left,
    /// the rest the decode's (to go on decode-only when the prefill finds no room).
    fn share(self) -> Option<Instant> {
        let now = Instant::now();
        self.at
            .map(|at| now + at.saturating_duration_since(now) / 2)
    }

    /// The error of a step of `side` on `endpoint` in `phase` still under way at the
    /// end: the request's deadline passed, or the continuation's time ran out (told as
    /// a timeout of the step, though its engine is not blamed for it).
    fn error(self, side: Side, endpoint: &Endpoint, phase: Phase) -> PdError {
        if self.deadline {
            PdError::deadline(side, phase)
        } else {
            PdError::timeout(side, endpoint.id().clone(), phase)
        }
    }

    /// The end at which the continuation cuts an attempt through a fresh prefill
    /// itself: its own, when the request's deadline (which the attempt's clock holds,
    /// and its steps keep) is not sooner.
    fn own(self) -> Option<Instant> {
        if self.deadline { None } else { self.at }
    }

    /// The time left until the end; `all` when there is none.
    fn left(self, all: Duration) -> Duration {
        self.at
            .map_or(all, |at| at.saturating_duration_since(Instant::now()))
    }
}

/// How a continuation went through a fresh prefill, when it did not start.
enum PrefillFell {
    /// The prefill side failed (reported): the continuation goes decode-only. `failed`:
    /// the prefill was at fault, its leg reported [`LegOutcome::Failed`] (its leg or
    /// its handoff failed for its engine's fault, before the leg was sent or after),
    /// and it is not chosen again for the request. Not when the connector's work on the
    /// plan failed for another reason (often no prefill's fault: a decode it cannot
    /// serve, a request it cannot carry), nor when the prefill refused its leg (a 4xx:
    /// the request's fault, or a busy moment's, not its engine's), nor when the
    /// continuation's time or the request's ran out.
    Prefill { failed: bool },
    /// The decode side failed (reported).
    Decode(PdError),
}

pub(super) struct Started {
    pub(super) current: Current,
    pub(super) body: BoxBody,
    /// The prefill of a continuation through a fresh prefill leg.
    pub(super) prefill: Option<Arc<Endpoint>>,
    /// The fresh prefill that failed before the decode started through its engine's
    /// fault (its leg told failed), which went on decode-only (never chosen again for
    /// this request).
    pub(super) failed_prefill: Option<EndpointId>,
}

/// What a continuation excludes, and when it must have started.
pub(super) struct Bounds {
    /// The decodes tried (never chosen again for the request), those chosen again
    /// after the others, and the fresh prefills whose legs were told failed (never
    /// chosen again).
    pub(super) seen: super::Seen,
    /// The continuation's end, from the break it continues.
    pub(super) end: End,
}

/// `POST /v1/completions` on the least busy decode endpoint not tried yet, for the
/// request's model, placed by the router as the decode of a request sent to one engine
/// ([`Router::place_queued`](crate::router::Router::place_queued), told whether the
/// request was already counted as queued: a router that counts places per endpoint
/// waits for room, and holds one on it); through a fresh prefill, placed the same way
/// (its place held until its leg ends; its wait given half the time left, so that the
/// decode may still go on alone), when the request was disaggregated. One end for it
/// all ([`End`]): the waits for room, a fresh prefill and its handoff, and the
/// decode's head come within one decode head timeout from the break (or the request's
/// deadline).
pub(super) async fn start(
    ctx: Arc<Ctx>,
    body: Bytes,
    bounds: Bounds,
    n: u32,
    span: Option<[u8; 8]>,
) -> Result<Started, NotStarted> {
    let Bounds { seen, end } = bounds;
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
            .filter_map(|e| seen.decode_rank(e.id()).map(|again| (again, e)))
            .min_by_key(|(again, e)| (*again, e.in_flight()))
            .map(|(_, e)| Arc::clone(e))
            .ok_or_else(|| PdError::from(crate::error::RouteError::NoDecode))
    };
    let router = &ctx.reporter.router;
    let placed = router.place_queued(&pick, end.at, ctx.queued()).await;
    let mut placed = ctx.counted(placed).map_err(NotStarted::unrouted)?;
    let hold = placed.take_decode_hold();
    let endpoint = Arc::clone(&placed.decode);
    let held = |mut started: Started| {
        started.current.hold = hold;
        started
    };
    // Through a fresh prefill when the request was disaggregated: the prefill that
    // computed the prompt (its prefix cache holds it) if it is still there, else the
    // least busy one (never one that failed in an earlier continuation), placed
    // by the router as any prefill leg is (picked again after each wait for room).
    // Decode-only when none is, when none has room in half the time left, or when the
    // prefill side fails.
    let inner = ctx.through_prefill.as_ref().and_then(|t| t.inner.upgrade());
    // A fresh prefill that failed: the continuation goes decode-only, and says so.
    let mut failed_prefill = None;
    if let Some(inner) = inner.filter(|_| !end.passed()) {
        let pick_prefill = || -> Result<Arc<Endpoint>, PdError> {
            let all = ctx.source.snapshot();
            let set = all.for_model(model.as_deref()).map_err(PdError::from)?;
            let fit = set.prefill().iter().filter(|e| seen.may_prefill(e.id()));
            ctx.route
                .prefill
                .as_ref()
                .and_then(|p| fit.clone().find(|e| e.id() == p.id()))
                .or_else(|| fit.min_by_key(|e| e.in_flight()))
                .cloned()
                .ok_or_else(|| PdError::from(RouteError::NoPrefill))
        };
        let placed = router
            .place_queued(&pick_prefill, end.share(), ctx.queued())
            .await;
        match ctx.counted(placed) {
            // Its time went on the waits: the prefill is not sent.
            Ok(_) if end.passed() => {}
            Ok(mut room) => {
                let fresh = Fresh {
                    prefill: Arc::clone(&room.decode),
                    place: room.take_decode_hold(),
                };
                let prefill = Arc::clone(&fresh.prefill);
                match through_prefill(&ctx, &inner, &body, fresh, &endpoint, n, span, end).await {
                    Ok(started) => return Ok(held(started)),
                    Err(PrefillFell::Decode(error)) => {
                        return Err(NotStarted {
                            tried: Some(endpoint),
                            blame: None,
                            prefill: Some(prefill),
                            failed_prefill: None,
                            times: LegTimes::default(),
                            error,
                        });
                    }
                    Err(PrefillFell::Prefill { failed }) => {
                        failed_prefill = failed.then(|| prefill.id().clone());
                    }
                }
            }
            Err(e) if e.is_no_prefill() => {}
            Err(e) => tracing::warn!(
                error = %crate::error::error_chain(&e),
                "no prefill for a continuation: continuing decode-only"
            ),
        }
    }
    if end.passed() {
        // Its time went on waits for room and a prefill side that failed: the decode
        // is not sent (nor counted as tried), nor blamed.
        let error = end.error(Side::Decode, &endpoint, Phase::DecodeHead);
        return Err(NotStarted {
            tried: None,
            blame: None,
            prefill: None,
            failed_prefill,
            times: LegTimes::default(),
            error,
        });
    }
    send(&ctx, body, &endpoint, n, span, end)
        .await
        .map(|(body, guard, times)| {
            held(Started {
                current: Current {
                    endpoint: Arc::clone(&endpoint),
                    guard: Some(guard),
                    hold: None,
                    riding: None,
                    times,
                },
                body,
                prefill: None,
                failed_prefill: failed_prefill.clone(),
            })
        })
        .map_err(|Unsent { error, cut, times }| NotStarted {
            tried: Some(Arc::clone(&endpoint)),
            // The request's deadline, or the continuation's own end (its time went on
            // waits), is no engine's fault; nor is a refusal (a 4xx: the request's
            // fault, as on any attempt).
            blame: (!cut && leg_outcome(&error, Some(endpoint.id())) == LegOutcome::Failed)
                .then_some(endpoint),
            prefill: None,
            failed_prefill,
            times,
            error,
        })
}

impl Ctx {
    /// The request's trace for a report of the migration's own (a dead decode's, a
    /// continuation's attempt), with leg span ids drawn for it (as a retry's are): a
    /// span built from it shares no id with the attempt's legs nor a migration's span.
    pub(super) fn own_trace(&self) -> Option<crate::outcome::TraceIds> {
        self.trace.as_ref().map(|(t, spans)| {
            let mut t = t.clone();
            spans.next_attempt(&mut t);
            t
        })
    }

    /// Whether the request was counted as queued: it waited for admission, or a
    /// continuation's wait for room counted it.
    fn queued(&self) -> bool {
        self.queued.load(Ordering::Relaxed)
    }

    /// `placed`, a continuation's place, its wait noted when it counted the request as
    /// queued (a place that made it wait, or one that waited and then failed: a wait
    /// that ran out, no engine left to pick; as its error says,
    /// [`PdError::with_queued`]), so that no later wait counts it again.
    fn counted(&self, placed: Result<Route, PdError>) -> Result<Route, PdError> {
        let counted = match &placed {
            Ok(route) => route.queued,
            Err(e) => e.queued(),
        };
        if counted {
            self.queued.store(true, Ordering::Relaxed);
        }
        placed
    }
}

/// A continuation's fresh prefill, and the router's place on it.
struct Fresh {
    prefill: Arc<Endpoint>,
    place: Option<Permit>,
}

/// The continuation `body` as a disaggregated attempt of its own, on the `fresh`
/// prefill (holding its place until its leg ends) and `decode`: the connector's plan,
/// the prefill leg, the handoff and the decode leg, as for any request
/// (`/v1/completions` with the token prompt), within the request's deadline and the
/// continuation's `end`. The attempt is reported when it fails; its 2xx decode answer
/// is the continuation, and its prefill leg is reported when it ends ([`PrefillLeg`]).
#[allow(clippy::too_many_arguments)] // private; the continuation's parts
async fn through_prefill(
    ctx: &Ctx,
    inner: &super::super::Inner,
    body: &Bytes,
    fresh: Fresh,
    decode: &Arc<Endpoint>,
    n: u32,
    span: Option<[u8; 8]>,
    end: End,
) -> Result<Started, PrefillFell> {
    let Fresh { prefill, place } = fresh;
    let prefill = &prefill;
    let Some(through) = &ctx.through_prefill else {
        return Err(PrefillFell::Prefill { failed: false });
    };
    let mut headers = http::HeaderMap::new();
    for (name, value) in &ctx.forwarded {
        headers.append(name.clone(), value.clone());
    }
    let Ok(mut req) = PdRequest::new(api(ctx), headers, body) else {
        return Err(PrefillFell::Prefill { failed: false });
    };
    // The original request's client: a connector keeping state per client (a
    // conversation's KV) scopes the continuation's as the original's.
    req.set_received(crate::outcome::now(), ctx.client.clone());
    let id = format!("{}-m{n}", String::from_utf8_lossy(ctx.engine_id.as_bytes()));
    let id = HeaderValue::from_str(&id).unwrap_or_else(|_| ctx.engine_id.clone());
    // Both legs' engine spans sit under the migration's: their `traceparent` names it.
    let legs = match (&ctx.trace, span) {
        (Some((t, _)), Some(span)) => {
            let mut t = t.clone();
            t.prefill = span;
            t.handoff = span;
            t.decode = span;
            Some(t)
        }
        _ => None,
    };
    // Its reports name leg spans of their own, as any attempt's do: a span built from
    // them never takes the migration's id.
    let trace = ctx.own_trace();
    let route = Route::new(Some(Arc::clone(prefill)), Arc::clone(decode));
    // An attempt of its own, numbered after the attempt it continues (`Report::attempt`:
    // past every number the request's attempts took, as no retry follows an answer that
    // began). Dropped once under way (the client left), it is reported cancelled, its
    // legs as far as they went.
    let number = ctx.attempt.saturating_add(n);
    let mut cancelled = None;
    let mut watch = Watch::new(&ctx.reporter, trace.as_ref(), number, &mut cancelled);
    watch.routed(&route);
    watch.tl.start = crate::outcome::now();
    // The attempt's route holds the prefill's place, given back when its prefill leg
    // ends (its clones, the reports', hold nothing).
    let placed = route.clone().with_holds(place, None);
    let attempt = inner.attempt_on(
        &req,
        placed,
        id,
        legs.as_ref(),
        through.clock,
        &mut watch.tl,
    );
    // Cut at the continuation's own end: no engine is to blame.
    let mut was_cut = false;
    let result = match end.own() {
        Some(at) => match tokio::time::timeout_at(at, attempt).await {
            Ok(result) => result,
            // The continuation's time ran out: the step under way is out of it.
            Err(_) => {
                was_cut = true;
                Err(cut(&route, &watch.tl, end))
            }
        },
        None => attempt.await,
    };
    let tl = watch.ended();
    let mut failure = match result {
        Ok(mut ex) => {
            // The decode's own handoff, kept by the plan (a conversation's KV), is
            // given to it as the continuation's stream is scrubbed.
            let returned = ex.returned.take();
            match ex.into_decoded() {
                Ok(Decoded {
                    head,
                    guard,
                    pending,
                    late,
                }) => {
                    // The fresh prefill's leg, told now that its answer is in, or when
                    // it answers if it still runs (riding in the stream), or, its
                    // stream begun with the plan's lead, once its KV gate opened
                    // (its handoff riding in the stream).
                    let leg = PrefillLeg::new(&ctx.reporter, &route, number, &tl, trace.clone());
                    let mut body = head.into_body();
                    let lead = late.filter(|l| l.lead);
                    let (pending, riding) = match (pending, lead) {
                        (Some(pending), _) => {
                            let (pending, failed) = leg.riding(pending);
                            (Some(pending), Some((prefill.id().clone(), failed)))
                        }
                        (None, Some(marks)) => {
                            let (gated, failed) = leg.gated(body, marks);
                            body = gated;
                            (None, Some((prefill.id().clone(), failed)))
                        }
                        (None, None) => {
                            leg.answered();
                            (None, None)
                        }
                    };
                    let body = if pending.is_some() || returned.is_some() {
                        // A concurrent prefill still running rides along, as in any
                        // answer.
                        let scrub = returned.is_some();
                        http_body_util::BodyExt::boxed(
                            PdBody::stream(body, true, Finish::holding(None, None), pending, None)
                                .scrubbing(scrub)
                                .capturing(returned),
                        )
                    } else {
                        body
                    };
                    // Its decode leg's steps (sent inside the body after a lead of the
                    // proxy's own: its stream starts now), after its handoff's.
                    let sent = tl.decode_sent.or_else(|| Some(crate::outcome::now()));
                    let times = LegTimes {
                        handoff: tl.handoff_start,
                        ..LegTimes::sent(sent, tl.decode_head)
                    };
                    return Ok(Started {
                        current: Current {
                            endpoint: Arc::clone(decode),
                            guard: Some(guard),
                            hold: None,
                            riding,
                            times,
                        },
                        body,
                        prefill: Some(Arc::clone(prefill)),
                        failed_prefill: None,
                    });
                }
                // The prefill's own answer (a 4xx, or the whole answer): its leg is
                // told, and the continuation goes decode-only. A refusal is the
                // request's fault (or a busy moment's: 429, 408), not the engine's: the
                // prefill may be chosen again (a prompt every prefill refuses is
                // refused by any of them, within the migration limit).
                Err(NotDecoded::PrefillRefused) => {
                    PrefillLeg::new(&ctx.reporter, &route, number, &tl, trace).refused();
                    return Err(PrefillFell::Prefill { failed: false });
                }
                Err(NotDecoded::PrefillAnswered) => {
                    PrefillLeg::new(&ctx.reporter, &route, number, &tl, trace).answered();
                    return Err(PrefillFell::Prefill { failed: false });
                }
                // A decode's error status: not a continuation (a bad gateway for the
                // client, whatever the status: the continuation's prompt is the
                // proxy's). Its leg is judged by the status it answered, as on any
                // attempt (a 4xx, a prompt past the model's length say, is the
                // request's fault, not its engine's), and its prefill leg as far as
                // it went (one still running, dropped with the answer, abandoned).
                Err(NotDecoded::Decode { status, prefill }) => Failure::decode(
                    &route,
                    PdError::upstream_status(Side::Decode, decode.id().clone(), status, None),
                    prefill,
                ),
            }
        }
        Err(f) => f,
    };
    if let Some(report) = failure.timed(tl) {
        report.trace = trace;
        report.attempt = number;
        ctx.reporter.report(report);
    }
    tracing::warn!(
        error = %crate::error::error_chain(&failure.error),
        prefill = %prefill.id(),
        "continuation through a fresh prefill failed"
    );
    match failure.error.side() {
        Side::Decode => Err(PrefillFell::Decode(failure.error)),
        // The prefill is at fault exactly when its leg's report says it failed (what
        // passive health counts): its leg failed, its answer carried no usable
        // handoff, its bootstrap server or a call on it failed, or a step of the
        // handoff ran out of its own budget, before its leg was sent (the plan's
        // resolution) or after; not for the rest of the connector's work on the plan
        // (a decode it cannot serve, a request it cannot carry, KV that will not be
        // ready for the proxy's reasons, another engine's call), nor when the
        // request's deadline or the continuation's own end cut the attempt.
        _ => {
            let failed = failure
                .report
                .as_ref()
                .is_some_and(|r| r.prefill == LegOutcome::Failed);
            Err(PrefillFell::Prefill {
                failed: failed && !was_cut && !failure.error.is_deadline(),
            })
        }
    }
}

/// The failure of an attempt through a fresh prefill cut off at the continuation's
/// `end` (its own, before the request's deadline): the step under way, as its steps in
/// `tl` say, is out of the continuation's time (the decode's head, or the prefill's
/// answer or the handoff). No engine is blamed: the time went on waits for room as much
/// as on the step. The prefill leg is told as far as it went: not sent, abandoned while
/// it ran, answered when its decode was sent, or abandoned when its handoff was cut
/// after its answer (its KV computed and left behind, as when the request's deadline
/// cuts a handoff); the decode leg abandoned if it was sent.
fn cut(route: &Route, tl: &Timeline, end: End) -> Failure {
    let mut prefill = match (tl.prefill_sent, tl.prefill_done) {
        (_, Some(_)) => LegOutcome::Answered,
        (Some(_), None) => LegOutcome::Abandoned,
        (None, None) => LegOutcome::NotSent,
    };
    let mut failure = if tl.decode_sent.is_some() {
        let e = end.error(Side::Decode, &route.decode, Phase::DecodeHead);
        let mut failure = Failure::decode(route, e, prefill);
        if let Some(report) = &mut failure.report {
            report.decode = LegOutcome::Abandoned;
        }
        failure
    } else {
        let phase = match prefill {
            LegOutcome::Abandoned => Phase::Prefill,
            _ => Phase::Handoff,
        };
        if prefill == LegOutcome::Answered {
            prefill = LegOutcome::Abandoned;
        }
        let ep = route.prefill.as_ref().unwrap_or(&route.decode);
        let e = end.error(Side::Prefill, ep, phase);
        Failure::prefill(route, e, LegOutcome::NotSent)
    };
    if let Some(report) = &mut failure.report {
        report.prefill = prefill;
    }
    failure
}

/// Why a continuation's decode gave no 2xx head: the error, whether it was cut by the
/// continuation's own end (no engine to blame), and when its leg was sent and its head
/// came.
struct Unsent {
    error: PdError,
    cut: bool,
    times: LegTimes,
}

impl From<PdError> for Unsent {
    fn from(error: PdError) -> Self {
        Unsent {
            error,
            cut: false,
            times: LegTimes::default(),
        }
    }
}

/// Send a continuation's `body` to `endpoint`; its 2xx head's body, by the
/// continuation's `end`, and when the leg was sent and its head came.
async fn send(
    ctx: &Ctx,
    body: Bytes,
    endpoint: &Arc<Endpoint>,
    n: u32,
    span: Option<[u8; 8]>,
    end: End,
) -> Result<(BoxBody, InFlightGuard, LegTimes), Unsent> {
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
    let mut times = LegTimes::sent(Some(crate::outcome::now()), None);
    let sent = ctx.transport.send(req);
    let head = match end.at {
        Some(at) => match tokio::time::timeout_at(at, sent).await {
            Ok(head) => head,
            Err(_) => {
                return Err(Unsent {
                    error: end.error(Side::Decode, endpoint, Phase::DecodeHead),
                    cut: true,
                    times,
                });
            }
        },
        None => sent.await,
    };
    let head = match head {
        Ok(head) => head,
        Err(e) => {
            return Err(Unsent {
                error: transport_err(e),
                cut: false,
                times,
            });
        }
    };
    times.head = Some(crate::outcome::now());
    let status = head.status();
    if !status.is_success() {
        // Its message within what is left of the continuation's time: a body that
        // never ends holds the client's stream no longer than a head that never comes.
        let left = end.left(ctx.head_timeout);
        let detail = super::super::legs::error_message(head.into_body(), 64 * 1024, left).await;
        return Err(Unsent {
            error: PdError::upstream_status(Side::Decode, id, status, detail),
            cut: false,
            times,
        });
    }
    Ok((head.into_body(), guard, times))
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

/// Whether `e`, ending a leg's stream before the decode's body (one begun with a plan's
/// lead), is no break of a decode stream: the proxy's own step failed (the KV gate, the
/// prefill's side), the decode refused its leg (its 4xx), or the request's deadline
/// passed. The decode's own failure (its connection, a 5xx, its head's budget) is.
pub(super) fn not_a_break(e: &super::BoxError) -> bool {
    e.downcast_ref::<PdError>().is_some_and(|e| {
        e.side() == Side::Prefill
            || e.is_deadline()
            || e.engine_status().is_some_and(|s| s.is_client_error())
    })
}

/// A body that fails at once with `e`.
pub(super) fn failing(e: super::BoxError) -> BoxBody {
    use http_body_util::BodyExt;
    let mut once = Some(e);
    http_body_util::StreamBody::new(futures::stream::poll_fn(move |_| {
        std::task::Poll::Ready(
            once.take()
                .map(Err::<http_body::Frame<Bytes>, super::BoxError>),
        )
    }))
    .boxed()
}
