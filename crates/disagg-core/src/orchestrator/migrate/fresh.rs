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
//! abandoned when the stream is dropped first.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::outcome::{LegOutcome, Outcome, Report, Timeline, TraceIds, now};
use crate::router::Route;

use super::super::body::PendingPrefill;
use super::super::leg_outcome;
use super::super::report::{Reporter, prefill_end};

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
                Err(e) => {
                    let prefill = self
                        .report
                        .as_ref()
                        .and_then(|r| r.route.prefill.as_deref());
                    let verdict = leg_outcome(e, prefill.map(|p| p.id()));
                    told.failed(verdict);
                    // A refusal (a 4xx) is told as one, as on any attempt.
                    self.tell(prefill_end(e, verdict), verdict);
                }
            }
            result
        });
        (riding, end)
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
