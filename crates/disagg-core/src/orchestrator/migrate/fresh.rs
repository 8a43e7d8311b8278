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
use std::sync::atomic::{AtomicBool, Ordering};

use crate::outcome::{LegOutcome, Outcome, Report, Timeline, TraceIds, now};
use crate::router::Route;

use super::super::body::PendingPrefill;
use super::super::leg_outcome;
use super::super::report::Reporter;

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
    /// now, as a refused prefill leg is (answered; the attempt failed on it).
    pub(super) fn refused(mut self) {
        self.tell(Outcome::PrefillFailed, LegOutcome::Answered);
    }

    /// The prefill still running as the decode's stream began, `pending`, as it rides in
    /// that stream: the leg is told when it ends, and the flag returned is set when it
    /// failed (the stream then ends for the prefill's fault, not its decode's).
    pub(super) fn riding(mut self, pending: PendingPrefill) -> (PendingPrefill, Arc<AtomicBool>) {
        let failed = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&failed);
        let riding = Box::pin(async move {
            let result = pending.await;
            if let Some(r) = &mut self.report {
                r.timeline.prefill_done = Some(now());
            }
            match &result {
                Ok(()) => self.tell(Outcome::Success, LegOutcome::Answered),
                Err(e) => {
                    // Read by the stream's reader, on the one task that polls both.
                    flag.store(true, Ordering::Relaxed);
                    let prefill = self
                        .report
                        .as_ref()
                        .and_then(|r| r.route.prefill.as_deref());
                    let verdict = leg_outcome(e, prefill.map(|p| p.id()));
                    self.tell(Outcome::PrefillFailed, verdict);
                }
            }
            result
        });
        (riding, failed)
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

impl Drop for PrefillLeg {
    /// Dropped before it was told: the stream the prefill rode in was dropped (the
    /// client left, or the stream moved on) while it ran.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.tell(Outcome::Cancelled, LegOutcome::Abandoned);
        }
    }
}
