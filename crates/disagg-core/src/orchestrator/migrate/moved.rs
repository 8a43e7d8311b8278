//! What a migration shares with the attempt's report ([`Moved`]).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use disagg_json::ErrorEvent;

use crate::endpoint::Endpoint;
use crate::outcome::{LegOutcome, Migration, Outcome, Report, Timeline};

use super::Ctx;

use super::times::LegTimes;

/// What a migration shares with the attempt's report: where the answer moved to, so
/// that the attempt is reported against the decode that finished it (the dead one was
/// reported failed when the stream moved on), timed by that decode's leg, and how many
/// times; and whether the leg the report names broke, its decode not told failed yet.
///
/// Locked where a stream breaks and a continuation starts, where its first byte goes
/// out and where the stream ends (never per chunk).
#[derive(Debug, Default)]
pub(crate) struct Moved {
    inner: Mutex<MovedState>,
    /// A continuation is being started (its fresh prefill, its decode's head): the
    /// client's stream is silent for the proxy's doing, bounded by the continuation's
    /// own window, not by the decode idle time. Read without the lock while the stream
    /// waits.
    continuing: std::sync::atomic::AtomicBool,
}

#[derive(Debug, Default)]
struct MovedState {
    to: Option<Arc<Endpoint>>,
    /// The steps of the leg on `to`: its handoff (through a fresh prefill), its send,
    /// its head, its first byte to the client.
    leg: LegTimes,
    migrations: u32,
    /// Each continuation tried, for the request's summary.
    log: Vec<Migration>,
    /// The span ids of the handoff step and the decode leg the attempt's report names
    /// once the stream moved on (traced): drawn for it, as the attempt's own are the
    /// first decode's (its `traceparent` named the attempt's decode span, and the report
    /// that tells it failed draws that span).
    spans: Option<LegSpans>,
    /// The leg the attempt's report names (the first leg, or the leg on `to`) broke and
    /// its stream waits on a continuation: its decode is told failed once, when the
    /// stream moves on (the report then names another decode), else by the report.
    broken: Option<Broken>,
    /// The stream on `to` ended for the fresh prefill riding in it (which failed, its
    /// leg reported then, as its failure says), not for its decode: the attempt's
    /// report does not blame the decode.
    exempt: bool,
    /// That stream, ended for its riding prefill, was not continued: the request's
    /// stream broke, though no engine the attempt's report names is to blame.
    prefill_broke: bool,
    /// The stream ended in the decode's error event naming a 4xx or no status: its
    /// refusal, relayed as it came and not continued.
    refused: Option<ErrorEvent>,
}

/// A decode leg that failed: its decode, what is known of its time, and when it ended
/// (its stream broke, or its continuation could not start).
#[derive(Debug)]
pub(super) struct Broken {
    pub(super) decode: Arc<Endpoint>,
    pub(super) times: LegTimes,
    pub(super) at: std::time::Instant,
    /// The leg is the attempt's first (its `traceparent` named the attempt's decode
    /// span): the report that tells it failed draws the attempt's handoff and decode
    /// spans.
    pub(super) first_leg: bool,
    /// The leg is the first, its decode was handed the prefill's KV (the prefill
    /// answered), and its stream broke as a lost KV load ends one: on an error event
    /// naming a 5xx, or at a `[DONE]` before its answer finished
    /// ([`Report::kv_load_suspect`]).
    pub(super) lost_kv: bool,
}

/// Span ids of a handoff step and a decode leg.
#[derive(Debug, Clone, Copy)]
pub(super) struct LegSpans {
    pub(super) handoff: [u8; 8],
    pub(super) decode: [u8; 8],
}

/// What [`Moved::apply`] did to the attempt's report.
#[derive(Debug, Default)]
pub(crate) struct Applied {
    /// Continuations that started.
    pub(crate) migrations: u32,
    /// The attempt's own steps, when the report names the decode the answer moved to
    /// (`None`: its timeline is the attempt's).
    pub(crate) own: Option<Timeline>,
    /// The leg the report names broke and no continuation took the stream on: the
    /// report is the one that tells its decode failed.
    pub(crate) broke: bool,
    /// The leg the report names ended for the fresh prefill riding in its stream: its
    /// decode is not to blame.
    pub(crate) exempt: bool,
    /// That leg, ended for its riding prefill, was not continued: the request's stream
    /// broke (the attempt failed), its decode not to blame.
    pub(crate) prefill_broke: bool,
    /// The first leg (the report's own decode, the stream never moved) broke as a lost
    /// KV load ends a vLLM stream ([`Broken::lost_kv`]) and no continuation took it on
    /// ([`Report::kv_load_suspect`]).
    pub(crate) lost_kv: bool,
    /// The stream ended in the error event of the decode the report names, naming a
    /// 4xx or no status ([`ErrorEvent::is_server_error`]): its refusal, relayed, not
    /// continued.
    pub(crate) refused: Option<ErrorEvent>,
}

impl Moved {
    /// A continuation's start begins (`true`) or ends.
    pub(super) fn set_continuing(&self, on: bool) {
        self.continuing
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a continuation is being started.
    pub(crate) fn continuing(&self) -> bool {
        self.continuing.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Point `report` at the decode that finished the answer, its decode leg (and the
    /// handoff step before it) timed by that decode's leg: the first leg's are the
    /// dead decode's report's, the attempt's start and prefill leg stay. The
    /// migrations, the attempt's own steps when it moved (`None`: `report` is
    /// untouched), and whether the leg it names broke (no other report tells it).
    pub(crate) fn apply(&self, report: &mut Report) -> Applied {
        let mut s = self.lock();
        let broken = s.broken.take();
        let broke = broken.is_some();
        // The first leg broke as a lost KV load ends a stream, and the stream never
        // moved on (no continuation started, or none was tried).
        let lost_kv = broken.is_some_and(|b| b.lost_kv);
        let Some(to) = &s.to else {
            return Applied {
                migrations: s.migrations,
                own: None,
                broke,
                exempt: false,
                prefill_broke: false,
                lost_kv,
                refused: s.refused,
            };
        };
        report.route.decode = Arc::clone(to);
        report.route.decode_rank = None;
        report.moved = true;
        if let (Some(spans), Some(trace)) = (s.spans, report.trace.as_mut()) {
            trace.handoff = spans.handoff;
            trace.decode = spans.decode;
        }
        let own = report.timeline;
        s.leg.onto(&mut report.timeline);
        Applied {
            migrations: s.migrations,
            own: Some(own),
            broke,
            exempt: s.exempt,
            prefill_broke: s.prefill_broke,
            lost_kv: false,
            refused: s.refused,
        }
    }

    /// The answer left the first decode: it moved on to another, was the first decode's
    /// refusal, relayed, or its break, not continued.
    pub(crate) fn left_first_leg(&self) -> bool {
        let s = self.lock();
        s.to.is_some() || s.refused.is_some() || s.broken.is_some()
    }

    /// The migrations tried, for the request's summary (taken once).
    pub(crate) fn take_log(&self) -> Vec<Migration> {
        std::mem::take(&mut self.lock().log)
    }

    /// A continuation is being started for `m`.
    pub(super) fn begin(&self, m: Migration) {
        self.lock().log.push(m);
    }

    /// The last continuation went to `to` (`started`: its head came; else it failed).
    pub(super) fn sent_to(&self, to: Option<&Arc<Endpoint>>, prefill: Option<&Arc<Endpoint>>) {
        if let Some(m) = self.lock().log.last_mut() {
            m.to = to.cloned();
            m.prefill = prefill.cloned();
        }
    }

    /// The last continuation's first byte went to the client at `at` (its leg's first
    /// byte): the migration, for the log line.
    pub(super) fn resumed(&self, at: Instant) -> Option<Migration> {
        let mut s = self.lock();
        s.leg.first = Some(at);
        let m = s.log.last_mut()?;
        m.resumed(at);
        Some(m.clone())
    }

    /// The leg the attempt's report names broke (`dead`, its decode to blame) and the
    /// stream waits on a continuation: the report tells it failed unless the stream
    /// moves on ([`moved`](Self::moved)).
    pub(super) fn broke(&self, dead: Broken) {
        self.lock().broken = Some(dead);
    }

    /// The leg the attempt's report names broke and the stream is not continued: its
    /// decode, `dead`, is told failed by the report; else, when the leg ended for the
    /// fresh prefill riding in its stream (`riding_failed`), the report tells the
    /// request's stream broke, blaming no engine of its own.
    pub(super) fn stays(&self, dead: Option<Broken>, riding_failed: bool) {
        let mut s = self.lock();
        match dead {
            Some(dead) => s.broken = Some(dead),
            None => s.prefill_broke |= riding_failed,
        }
    }

    /// The leg the attempt's report names ended in its decode's refusal, `event` (an
    /// error event naming a 4xx or no status), relayed and not continued: the report
    /// tells the decode's refusal, no engine blamed.
    pub(super) fn refused(&self, event: ErrorEvent) {
        self.lock().refused = Some(event);
    }

    /// The leg the attempt's report names, relayed raw (untracked: an event too long to
    /// hold), ended: when it ended for the fresh prefill riding in its stream
    /// (`riding_failed`), whose error event went out as it came, it is not continued
    /// (a raw leg never is) and the report tells the request's stream broke, its decode
    /// not blamed, as [`stays`](Self::stays) and [`exempt`](Self::exempt) tell it for
    /// a tracked leg (which reads the event).
    pub(super) fn raw_ended(&self, riding_failed: bool) {
        if riding_failed {
            let mut s = self.lock();
            s.exempt = true;
            s.prefill_broke = true;
        }
    }

    /// The leg the attempt's report names ended for the fresh prefill riding in its
    /// stream: its decode is not blamed unless the stream moves on.
    pub(super) fn exempt(&self) {
        self.lock().exempt = true;
    }

    /// The stream moved on to `to`, its leg's steps so far `times`, the attempt's
    /// report to name its handoff and decode spans `spans` (traced): the leg it broke
    /// on, to be told failed now (the attempt's report no longer names it).
    pub(super) fn moved(
        &self,
        to: &Arc<Endpoint>,
        times: &LegTimes,
        spans: Option<LegSpans>,
    ) -> Option<Broken> {
        let mut s = self.lock();
        s.to = Some(Arc::clone(to));
        s.spans = spans;
        s.exempt = false;
        s.prefill_broke = false;
        s.leg = times.clone();
        s.migrations += 1;
        s.broken.take()
    }

    /// The state, even if a holder panicked (what it holds is still the request's: a
    /// report is not lost for it).
    fn lock(&self) -> MutexGuard<'_, MovedState> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Ctx {
    /// The first leg's decode was handed the KV of a prefill that answered: by the
    /// decode's head, or (both legs sent at once) since.
    pub(super) fn prefill_handed_kv(&self) -> bool {
        self.handed_kv || self.late_kv.as_ref().is_some_and(|l| l.answered())
    }

    /// Tell `dead`'s decode failed, its leg timed from what is known of it to its end,
    /// in the request's trace and as the attempt's, as the attempt's report is: the
    /// first leg's under the attempt's handoff and decode spans (its `traceparent`
    /// named the decode's), a continuation's under spans of its own.
    pub(super) fn tell_failed(&self, dead: Broken) {
        let Broken {
            decode,
            times,
            at,
            first_leg,
            lost_kv,
        } = dead;
        let mut route = self.route.clone();
        route.decode = decode;
        route.decode_rank = None;
        let mut report = Report::new(
            route,
            Outcome::DecodeFailed,
            LegOutcome::NotSent,
            LegOutcome::Failed,
            times.timeline(at),
        );
        report.attempt = self.attempt;
        // Its prefill's KV may be what it could not load: passive health weighs it
        // across decodes (the attempt's report, naming another decode, tells the
        // prefill's leg and says the answer moved).
        report.kv_load_suspect = lost_kv;
        report.trace = self.own_trace();
        if let (true, Some(trace), Some((attempt, _))) =
            (first_leg, report.trace.as_mut(), self.trace.as_ref())
        {
            trace.handoff = attempt.handoff;
            trace.decode = attempt.decode;
        }
        self.reporter.report(&mut report);
    }
}
