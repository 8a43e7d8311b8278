//! A continuation's fresh prefill leg, reported as any prefill leg is: when it ends.
//!
//! A continuation through a fresh prefill that streams is an attempt whose decode leg
//! is told by the original attempt's report (against the decode that finished the
//! answer, when the client's stream ends). Its prefill leg is told here, on its own: a
//! report over the continuation's route whose decode leg is [`LegOutcome::NotSent`] (so
//! that no decode is counted twice), timed by the prefill's steps alone; at once when
//! its answer is in (or it refused its leg, or its answer was the whole answer: then
//! the continuation goes decode-only), else (a concurrent prefill still running as the
//! decode's stream began, which rides in that stream) when it answers or fails, or as
//! abandoned when the stream is dropped first. A plan whose stream begins with a lead
//! of the proxy's own, before its decode leg is sent, waits for its KV gate inside that
//! stream: the prefill's handoff rides in it as a running prefill does, told answered
//! once the gate opened, or failed when it did not ([`Gated`]).

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};

use crate::error::{BoxError, PdError, error_chain};
use crate::outcome::{LegOutcome, Outcome, Report, Timeline, TraceIds, now};
use crate::router::Route;
use crate::transport::BoxBody;

use super::super::body::{PendingPrefill, sse_error_event};
use super::super::leg_outcome;
use super::super::report::{Reporter, prefill_end};
use super::super::respond::LateMarks;

/// A continuation's fresh prefill leg, told once (see the [module docs](self)).
pub(super) struct PrefillLeg {
    reporter: Arc<Reporter>,
    /// `None` once told.
    report: Option<Report>,
}

impl PrefillLeg {
    /// The prefill leg of the continuation numbered `attempt` (the number of the attempt
    /// it continues, plus its migration index) over `route`, whose steps so far are
    /// `tl`'s (its prefill's are kept; the decode's are the original attempt's report's),
    /// traced as `trace` (the request's, with leg span ids of the continuation's own:
    /// its engines' spans sit under the migration's, which their `traceparent` names).
    pub(super) fn new(
        reporter: &Arc<Reporter>,
        route: &Route,
        attempt: u32,
        tl: &Timeline,
        trace: Option<TraceIds>,
    ) -> Self {
        let mut steps = Timeline::starting();
        steps.start = tl.start;
        steps.prefill_sent = tl.prefill_sent;
        steps.prefill_done = tl.prefill_done;
        let mut report = Report::new(
            route.clone(),
            Outcome::Success,
            LegOutcome::Answered,
            LegOutcome::NotSent,
            steps,
        );
        report.attempt = attempt;
        report.trace = trace;
        PrefillLeg {
            reporter: Arc::clone(reporter),
            report: Some(report),
        }
    }

    /// The prefill answered: told now.
    pub(super) fn answered(mut self) {
        self.tell(Outcome::Success, LegOutcome::Answered);
    }

    /// The prefill refused its leg (a 4xx, the request's fault, not its engine's): told
    /// now, as a refused prefill leg is (answered; the attempt a refusal).
    pub(super) fn refused(mut self) {
        self.tell(Outcome::PrefillRefused, LegOutcome::Answered);
    }

    /// The prefill still running as the decode's stream began, `pending`, as it rides in
    /// that stream: the leg is told when it ends, and the [`RidingEnd`] returned says
    /// whether it failed (the stream then ends for the prefill, not for its decode) and
    /// whether its leg was told failed (its engine to blame).
    pub(super) fn riding(mut self, pending: PendingPrefill) -> (PendingPrefill, Arc<RidingEnd>) {
        let end = Arc::new(RidingEnd::default());
        let told = Arc::clone(&end);
        let riding = Box::pin(async move {
            let result = pending.await;
            if let Some(r) = &mut self.report {
                r.timeline.prefill_done = Some(now());
            }
            match &result {
                Ok(()) => self.tell(Outcome::Success, LegOutcome::Answered),
                Err(e) => self.failed(e, &told),
            }
            result
        });
        (riding, end)
    }

    /// The continuation's stream `body`, begun with its plan's lead before its decode
    /// leg was sent, its KV gate waited for inside it (`marks` say when the decode leg
    /// went out): the leg is told answered once the gate opened, or failed as the
    /// gate's error says when it did not (the [`RidingEnd`] returned says so: the
    /// stream ends for the prefill, not for its decode), or abandoned when the stream
    /// is dropped first (its KV computed and left behind).
    pub(super) fn gated(self, body: BoxBody, marks: Arc<LateMarks>) -> (BoxBody, Arc<RidingEnd>) {
        let end = Arc::new(RidingEnd::default());
        let gated = Gated {
            inner: body,
            marks,
            leg: Some(self),
            end: Arc::clone(&end),
            ended: false,
        };
        (BoxBody::new(gated), end)
    }

    /// The prefill's side failed with `e` after its answer (the stream then ends for
    /// it, as `end` says): its leg told as `e` judges it, a refusal (a 4xx) as one, as
    /// on any attempt.
    fn failed(&mut self, e: &PdError, end: &RidingEnd) {
        let prefill = self
            .report
            .as_ref()
            .and_then(|r| r.route.prefill.as_deref());
        let verdict = leg_outcome(e, prefill.map(|p| p.id()));
        end.failed(verdict);
        self.tell(prefill_end(e, verdict), verdict);
    }

    fn tell(&mut self, outcome: Outcome, prefill: LegOutcome) {
        let Some(mut report) = self.report.take() else {
            return;
        };
        report.outcome = outcome;
        report.prefill = prefill;
        report.timeline.end = Some(now());
        self.reporter.report(&mut report);
    }
}

/// A continuation's stream begun with its plan's lead, whose KV gate is waited for
/// inside it ([`PrefillLeg::gated`]): the stream as it comes, but for the gate's
/// failure, which is its fresh prefill's: its leg is told failed, and the stream ends
/// with an error event carrying the gate's error (as a riding prefill's failure ends
/// its stream), for the migrating body to take as the stream ended for its prefill,
/// not for its decode, and never as the attempt's first prefill's failure.
struct Gated {
    inner: BoxBody,
    marks: Arc<LateMarks>,
    /// `None` once told.
    leg: Option<PrefillLeg>,
    end: Arc<RidingEnd>,
    /// The gate's failure went out: nothing follows.
    ended: bool,
}

impl Body for Gated {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        let Some(leg) = this.leg.as_mut() else {
            return polled;
        };
        if this.marks.decode_sent.get().is_some() {
            // The gate opened (the decode leg went out): the prefill's handoff is done,
            // whatever the decode does next.
            if let Some(leg) = this.leg.take() {
                leg.answered();
            }
            return polled;
        }
        let Poll::Ready(Some(Err(e))) = polled else {
            return polled;
        };
        // Before the decode leg went out, only the gate fails.
        let e = match e.downcast::<PdError>() {
            Ok(e) => e,
            Err(e) => return Poll::Ready(Some(Err(e))),
        };
        leg.failed(&e, &this.end);
        this.leg = None;
        this.ended = true;
        let message = error_chain(&*e);
        tracing::warn!(%message, "a continuation's KV handoff failed after its lead");
        let event = sse_error_event(&message, e.event_type(), e.code());
        Poll::Ready(Some(Ok(Frame::data(event))))
    }
}

/// How a prefill riding in a continuation's stream ended, when it failed: set as it
/// fails, read by the stream's reader (on the one task that polls both).
#[derive(Debug, Default)]
pub(super) struct RidingEnd(AtomicU8);

/// [`RidingEnd`]: the prefill failed, and the stream ended for it.
const FAILED: u8 = 1;
/// [`RidingEnd`]: its leg was told [`LegOutcome::Failed`], its engine to blame.
const BLAMED: u8 = 2;

impl RidingEnd {
    /// The prefill failed, its leg told `verdict`.
    fn failed(&self, verdict: LegOutcome) {
        let blamed = if verdict == LegOutcome::Failed {
            BLAMED
        } else {
            0
        };
        self.0.store(FAILED | blamed, Ordering::Relaxed);
    }

    /// Whether the prefill failed (whoever is to blame): the stream ended for it, not
    /// for its decode.
    pub(super) fn ended_it(&self) -> bool {
        self.0.load(Ordering::Relaxed) & FAILED != 0
    }

    /// Whether the prefill failed through its engine's fault (its leg told failed), not
    /// by refusing its leg (a 4xx) or running into the request's deadline.
    pub(super) fn blamed(&self) -> bool {
        self.0.load(Ordering::Relaxed) & BLAMED != 0
    }
}

impl Drop for PrefillLeg {
    /// Dropped before it was told: the stream the prefill rode in was dropped (the
    /// client left, or the stream moved on) while it ran.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.tell(Outcome::Cancelled, LegOutcome::Abandoned);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use async_trait::async_trait;
    use http::StatusCode;

    use super::*;
    use crate::connector::{Handoff, KvConnector};
    use crate::endpoint::{Endpoint, EndpointId, Role};
    use crate::error::{ConnectorError, PdError, Phase, Side, TransportError};
    use crate::outcome::Listener;
    use crate::request::PdRequest;
    use crate::router::DefaultRouter;

    /// A connector never asked for a plan here.
    struct NoPlan;

    #[async_trait]
    impl KvConnector for NoPlan {
        fn name(&self) -> &'static str {
            "no-plan"
        }

        fn prepare(&self, _: &Route, _: &PdRequest) -> Result<Handoff, ConnectorError> {
            Err(ConnectorError::NeedsPrefill {
                connector: "no-plan",
            })
        }
    }

    /// Every report told.
    #[derive(Default)]
    struct Told(Mutex<Vec<Report>>);

    impl Listener for Told {
        fn on_report(&self, report: &Report) {
            self.0.lock().unwrap().push(report.clone());
        }
    }

    /// A fresh prefill riding in a continuation's stream that fails is told failed, and
    /// shut out of the request's later continuations ([`RidingEnd::blamed`]), only when
    /// its engine is to blame (unreachable, 5xx, a handoff error naming it); a
    /// connector's error that is no engine's or another engine's, a refusal (4xx) or
    /// the request's deadline is not its engine's fault. Whatever the cause, the stream
    /// ended for it ([`RidingEnd::ended_it`]: its decode is not blamed); a refusal is
    /// told as the attempt's refusal ([`Outcome::PrefillRefused`]), not a failure.
    #[tokio::test]
    async fn a_riding_prefill_is_blamed_only_for_its_engines_fault() {
        let p = Arc::new(Endpoint::new("http://p:1", Role::Prefill).unwrap());
        let d = Arc::new(Endpoint::new("http://d:1", Role::Decode).unwrap());
        let route = Route::new(Some(Arc::clone(&p)), d);
        let (pid, did) = (p.id().clone(), EndpointId::from("http://d:1"));
        let cases = [
            (
                "a connector's error blaming no engine",
                PdError::connector(
                    Side::Prefill,
                    ConnectorError::NotReady {
                        reason: "notification listener closed".into(),
                    },
                ),
                LegOutcome::Abandoned,
            ),
            (
                "a call on another engine",
                PdError::connector(
                    Side::Prefill,
                    ConnectorError::Engine {
                        endpoint: did,
                        what: "/tokenize",
                        source: "connection refused".into(),
                    },
                ),
                LegOutcome::Abandoned,
            ),
            (
                "a refusal",
                PdError::upstream_status(Side::Prefill, pid.clone(), StatusCode::BAD_REQUEST, None),
                LegOutcome::Answered,
            ),
            (
                "the request's deadline",
                PdError::deadline(Side::Prefill, Phase::Prefill),
                LegOutcome::Abandoned,
            ),
            (
                "a malformed handoff from it",
                PdError::connector(
                    Side::Prefill,
                    ConnectorError::InvalidHandoff {
                        endpoint: pid.clone(),
                        field: "kv_transfer_params",
                    },
                ),
                LegOutcome::Failed,
            ),
            (
                "a transport failure",
                PdError::transport(
                    Side::Prefill,
                    pid,
                    TransportError::Connect("connection refused".into()),
                ),
                LegOutcome::Failed,
            ),
        ];
        for (what, error, verdict) in cases {
            let told = Arc::new(Told::default());
            let listener: Arc<dyn Listener> = told.clone();
            let reporter = Arc::new(Reporter {
                router: Arc::new(DefaultRouter::default()),
                connector: Arc::new(NoPlan),
                listeners: vec![listener],
            });
            let leg = PrefillLeg::new(&reporter, &route, 1, &Timeline::starting(), None);
            let (riding, end) = leg.riding(Box::pin(std::future::ready(Err(error))));
            assert!(!end.ended_it(), "{what}: not before it ended");
            assert!(riding.await.is_err(), "{what}");
            assert!(end.ended_it(), "{what}: the stream ended for it");
            assert_eq!(end.blamed(), verdict == LegOutcome::Failed, "{what}");
            let reports = told.0.lock().unwrap();
            let [r] = &reports[..] else {
                panic!("{what}: told once: {reports:?}")
            };
            // A refusal is told as one, not as a failure.
            let outcome = if verdict == LegOutcome::Answered {
                Outcome::PrefillRefused
            } else {
                Outcome::PrefillFailed
            };
            assert_eq!(
                (r.outcome, r.prefill, r.decode),
                (outcome, verdict, LegOutcome::NotSent),
                "{what}"
            );
        }
    }
}
