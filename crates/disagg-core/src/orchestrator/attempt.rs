//! One attempt: route → plan → legs, ending in an [`Exchange`] for the client, or a
//! [`Failure`] that no byte of an answer preceded.

use http::header::HeaderValue;

use crate::connector::{Dispatch, Leg};
use crate::error::{PdError, Phase, RouteError, Side};
use crate::outcome::Outcome;
use crate::outcome::TraceIds;
use crate::outcome::now;
use crate::outcome::{LegOutcome, Report, Timeline};
use crate::policy::Decision;
use crate::request::{PdRequest, REQUEST_ID};
use crate::router::{Ask, RequestView, Route};

use super::Inner;
use super::clock::{Clock, within};
use super::report::{
    Reporter, as_far_as_it_went, decode_end, leg_outcome, prefill_end, unsent_or_abandoned,
};
use super::respond::{Exchange, Stand};

/// How an attempt ended without an answer for the client.
pub(super) struct Failure {
    pub(super) error: PdError,
    /// How the attempt went, when it had a route (an attempt refused before routing
    /// reports nothing).
    pub(super) report: Option<Box<Report>>,
}

impl Failure {
    /// A failure before any route was chosen.
    pub(super) fn unrouted(error: PdError) -> Self {
        Failure {
            error,
            report: None,
        }
    }

    /// The prefill side failed with `error` over `route` (a refusal, the prefill's 4xx
    /// or the connector's own `Unsupported`, is [`Outcome::PrefillRefused`]:
    /// [`prefill_end`]); the decode leg was `decode`.
    pub(super) fn prefill(route: &Route, error: PdError, decode: LegOutcome) -> Self {
        let verdict = leg_outcome(&error, route.prefill.as_deref().map(|p| p.id()));
        let report = Report::new(
            route.clone(),
            prefill_end(&error, verdict),
            verdict,
            decode,
            Timeline::starting(),
        );
        Failure {
            error,
            report: Some(Box::new(report)),
        }
    }

    /// The attempt's steps were `tl`, and it ended now: its report's timeline, by which
    /// its prefill leg is told as far as it went ([`as_far_as_it_went`]). The report, if
    /// any, for the caller's last touches.
    pub(super) fn timed(&mut self, mut tl: Timeline) -> Option<&mut Report> {
        let report = self.report.as_deref_mut()?;
        tl.end = Some(now());
        report.prefill = as_far_as_it_went(report.prefill, &tl);
        report.timeline = tl;
        Some(report)
    }

    /// The decode leg failed with `error` over `route` (its refusal, a 4xx, is
    /// [`Outcome::DecodeRefused`]: [`decode_end`]), the prefill leg having gone as
    /// `prefill`.
    pub(super) fn decode(route: &Route, error: PdError, prefill: LegOutcome) -> Self {
        let verdict = leg_outcome(&error, Some(route.decode.id()));
        let report = Report::new(
            route.clone(),
            decode_end(verdict),
            prefill,
            verdict,
            Timeline::starting(),
        );
        Failure {
            error,
            report: Some(Box::new(report)),
        }
    }
}

/// An attempt under way. Once routed, dropped before it ended (the client left while it
/// ran: the server dropped the `serve` future), it reports the attempt
/// [`Outcome::Cancelled`] (to the router's and the connector's `observe`, then to every
/// listener), each leg as far as its timeline went: not sent, abandoned while it ran
/// (a prefill also once it answered, while its decode leg was not sent yet: its KV left
/// behind), or answered; and leaves that report for the request's summary.
pub(super) struct Watch<'a> {
    reporter: &'a Reporter,
    trace: Option<&'a TraceIds>,
    /// Which attempt of its request this is.
    number: u32,
    /// A copy of the attempt's route, once routed (holding nothing of the router's).
    route: Option<Route>,
    /// The attempt's steps.
    pub(super) tl: Timeline,
    /// Where the report of a cancelled attempt goes.
    cancelled: &'a mut Option<Box<Report>>,
}

impl<'a> Watch<'a> {
    /// The watch of attempt `number` (0 for the first), traced as `trace`, its report
    /// left in `cancelled` if it is cancelled.
    pub(super) fn new(
        reporter: &'a Reporter,
        trace: Option<&'a TraceIds>,
        number: u32,
        cancelled: &'a mut Option<Box<Report>>,
    ) -> Self {
        Watch {
            reporter,
            trace,
            number,
            route: None,
            tl: Timeline::starting(),
            cancelled,
        }
    }

    /// The attempt goes over `route`: from now on, a drop reports it.
    pub(super) fn routed(&mut self, route: &Route) {
        self.route = Some(route.clone());
    }

    /// The attempt ended (its outcome is the caller's to tell): its steps.
    pub(super) fn ended(mut self) -> Timeline {
        self.route = None;
        self.tl
    }
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        let Some(route) = self.route.take() else {
            return;
        };
        if std::thread::panicking() {
            return;
        }
        let tl = &mut self.tl;
        tl.end = Some(now());
        // A prefill that answered before its decode leg was sent (the handoff under
        // way) left its KV computed and never pulled: abandoned, as when the request's
        // deadline cuts the handoff, not answered (no success of its engine's).
        let prefill = match (tl.prefill_sent, tl.prefill_done, tl.decode_sent) {
            (None, _, _) => LegOutcome::NotSent,
            (Some(_), Some(_), Some(_)) => LegOutcome::Answered,
            (Some(_), _, _) => LegOutcome::Abandoned,
        };
        let decode = unsent_or_abandoned(tl);
        let mut report = Report::new(route, Outcome::Cancelled, prefill, decode, *tl);
        report.attempt = self.number;
        report.trace = self.trace.cloned();
        self.reporter.report(&mut report);
        *self.cancelled = Some(Box::new(report));
    }
}

impl Inner {
    /// One attempt for `req`, its legs carrying the engine-side request `id` and, when
    /// tracing, the trace context of their spans; its steps timed, and reported
    /// cancelled by `watch` if it is dropped once routed. A routing that made the
    /// request wait says so in `clock`, for the routings after it.
    pub(super) async fn attempt(
        &self,
        req: &PdRequest,
        id: HeaderValue,
        decision: Decision,
        clock: &mut Clock,
        pinned: Option<Route>,
        mut watch: Watch<'_>,
    ) -> Result<Exchange, Failure> {
        let trace = watch.trace;
        let result = self
            .attempt_timed(req, id, trace, decision, clock, pinned, &mut watch)
            .await;
        let tl = watch.ended();
        match result {
            Ok(mut ex) => {
                ex.timeline = tl;
                Ok(ex)
            }
            Err(mut f) => {
                if let Some(r) = f.timed(tl) {
                    r.trace = trace.cloned();
                }
                Err(f)
            }
        }
    }

    // The attempt's inputs, each from a different place in `serve`: a struct would only
    // move the list.
    #[allow(clippy::too_many_arguments)]
    async fn attempt_timed(
        &self,
        req: &PdRequest,
        id: HeaderValue,
        trace: Option<&TraceIds>,
        decision: Decision,
        clock: &mut Clock,
        pinned: Option<Route>,
        watch: &mut Watch<'_>,
    ) -> Result<Exchange, Failure> {
        let route = match pinned {
            // Routed before the encoder stage (a push protocol's consumer).
            Some(route) => route,
            None => {
                let view = RequestView::from(req);
                self.route(&view, decision, clock)
                    .await
                    .map_err(Failure::unrouted)?
            }
        };
        let clock = *clock;
        watch.routed(&route);
        let tl = &mut watch.tl;
        tl.start = now();
        if let Decision::Direct { reason } = decision {
            tracing::debug!(
                request_id = ?req.request_id(),
                decode = %route.decode.id(),
                reason,
                "not disaggregated: served on a decode endpoint alone"
            );
            let mut leg = decode_alone(&route, req, id);
            if let Some(t) = trace {
                t.inject(&t.decode, &mut leg.headers);
            }
            return self.alone(req, route, leg, None, clock, tl).await;
        }
        self.attempt_on(req, route, id, trace, clock, tl).await
    }

    /// The disaggregated part of an attempt, over `route` (a prefill and a decode):
    /// plan, resolve, then both legs as the plan dispatches them. A mid-stream
    /// migration's continuation through a fresh prefill runs it too, over a route of
    /// its own choosing.
    pub(super) async fn attempt_on(
        &self,
        req: &PdRequest,
        route: Route,
        id: HeaderValue,
        trace: Option<&TraceIds>,
        clock: Clock,
        tl: &mut Timeline,
    ) -> Result<Exchange, Failure> {
        if route.prefill.is_none() {
            return Err(Failure::unrouted(PdError::from(RouteError::NoPrefill)));
        }
        let mut handoff = self.connector.prepare(&route, req).map_err(|e| {
            Failure::prefill(
                &route,
                PdError::connector(Side::Prefill, e),
                LegOutcome::NotSent,
            )
        })?;
        // One engine-side id per attempt, the same on both legs (see `decode_alone`).
        handoff.prefill.headers.insert(REQUEST_ID, id.clone());
        handoff.decode.headers.insert(REQUEST_ID, id);
        if let Some(t) = trace {
            t.inject(&t.prefill, &mut handoff.prefill.headers);
            t.inject(&t.decode, &mut handoff.decode.headers);
        }
        let prefill_ep = std::sync::Arc::clone(&handoff.prefill.endpoint);
        let resolve = async {
            self.connector
                .resolve(&mut handoff, &*self.transport)
                .await
                .map_err(|e| PdError::connector(Side::Prefill, e))
        };
        let budget = self.config.handoff_timeout;
        let resolving = now();
        within(
            clock,
            budget,
            Side::Prefill,
            &prefill_ep,
            Phase::Handoff,
            resolve,
        )
        .await
        .map_err(|e| Failure::prefill(&route, e, LegOutcome::NotSent))?;
        match handoff.dispatch {
            Dispatch::AfterPrefill => self.sequential(req, route, handoff, clock, tl).await,
            Dispatch::Concurrent | Dispatch::Joined => {
                // Both legs go at once: the handoff step is the plan's resolution.
                tl.handoff_start = Some(resolving);
                self.concurrent(req, route, handoff, clock, tl).await
            }
        }
    }

    /// The route for `req`: the router's, which may wait for room (a per-endpoint
    /// limit) within the request's deadline; told whether the request already waited
    /// in the admission queue ([`Ask::queued`](Ask#structfield.queued)), and telling
    /// `clock` when it made it wait ([`Route::queued`], or, for a routing that waited
    /// and then failed, its error: [`PdError::with_queued`]): the request is counted
    /// as queued once over all its routings.
    pub(super) async fn route(
        &self,
        view: &RequestView<'_>,
        decision: Decision,
        clock: &mut Clock,
    ) -> Result<Route, PdError> {
        let direct = matches!(decision, Decision::Direct { .. });
        let ask = Ask::new(view, &*self.source, direct, clock.deadline).with_queued(clock.queued);
        let routed = self.router.route(ask).await;
        clock.queued |= match &routed {
            Ok(route) => route.queued,
            // A routing that waited, then failed: the decode-only fallback's routing
            // (or a retry's) is not to count the request again.
            Err(e) => e.queued(),
        };
        routed
    }

    /// A decode leg alone (direct, or decode-only because of the prefill failure coded
    /// `fallback`): its head is the answer.
    pub(super) async fn alone(
        &self,
        req: &PdRequest,
        route: Route,
        leg: Leg,
        fallback: Option<&'static str>,
        clock: Clock,
        tl: &mut Timeline,
    ) -> Result<Exchange, Failure> {
        let guard = leg.endpoint.track();
        tl.decode_sent = Some(now());
        match self.decode_head(req, &leg, clock).await {
            Ok(head) => {
                tl.decode_head = Some(now());
                Ok(Exchange::new(
                    route,
                    head,
                    Stand::DecodeAlone { guard, fallback },
                ))
            }
            Err(e) => Err(Failure::decode(&route, e, LegOutcome::NotSent)),
        }
    }
}

/// The decode leg of a request served without a prefill leg (direct, decode-only): the
/// client's body, the attempt's engine-side `id` and, when the route names the decode's
/// data-parallel rank, `X-Data-Parallel-Rank`, which vLLM and SGLang both read.
///
/// The engines get an id of the proxy's for every attempt, never the client's
/// `x-request-id`: vLLM's push-mode NIXL pairs the two legs by it, so it must be the
/// same on both legs and unique among requests in flight, which a client's id (a retry,
/// a buggy client) is not. The client's id stays in the answer and the logs.
pub(super) fn decode_alone(route: &Route, req: &PdRequest, id: HeaderValue) -> Leg {
    let mut leg = Leg::new(route.decode.clone(), req.body().clone());
    leg.headers.insert(REQUEST_ID, id);
    leg.set_rank(route.decode_rank);
    leg
}
