//! What a migration shares with the attempt's report ([`Moved`]).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::endpoint::Endpoint;
use crate::outcome::{Migration, Report, Timeline};

use super::times::LegTimes;

/// What a migration shares with the attempt's report: where the answer moved to, so
/// that the attempt is reported against the decode that finished it (the dead one was
/// reported failed when it broke), timed by that decode's leg, and how many times.
///
/// Locked where a continuation starts, where its first byte goes out and where the
/// stream ends (never per chunk).
#[derive(Debug, Default)]
pub(crate) struct Moved {
    inner: Mutex<MovedState>,
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
}

impl Moved {
    /// Point `report` at the decode that finished the answer, its decode leg (and the
    /// handoff step before it) timed by that decode's leg: the first leg's are the
    /// dead decode's report's, the attempt's start and prefill leg stay. The
    /// migrations, and the attempt's own steps when it moved (`None`: `report` is
    /// untouched).
    pub(crate) fn apply(&self, report: &mut Report) -> (u32, Option<Timeline>) {
        let Ok(s) = self.inner.lock() else {
            return (0, None);
        };
        let Some(to) = &s.to else {
            return (s.migrations, None);
        };
        report.route.decode = Arc::clone(to);
        report.route.decode_rank = None;
        let own = report.timeline;
        s.leg.onto(&mut report.timeline);
        (s.migrations, Some(own))
    }

    /// The migrations tried, for the request's summary (taken once).
    pub(crate) fn take_log(&self) -> Vec<Migration> {
        self.inner
            .lock()
            .map(|mut s| std::mem::take(&mut s.log))
            .unwrap_or_default()
    }

    /// A continuation is being started for `m`.
    pub(super) fn begin(&self, m: Migration) {
        if let Ok(mut s) = self.inner.lock() {
            s.log.push(m);
        }
    }

    /// The last continuation went to `to` (`started`: its head came; else it failed).
    pub(super) fn sent_to(&self, to: Option<&Arc<Endpoint>>, prefill: Option<&Arc<Endpoint>>) {
        if let Ok(mut s) = self.inner.lock()
            && let Some(m) = s.log.last_mut()
        {
            m.to = to.cloned();
            m.prefill = prefill.cloned();
        }
    }

    /// The last continuation's first byte went to the client at `at` (its leg's first
    /// byte): the migration, for the log line.
    pub(super) fn resumed(&self, at: Instant) -> Option<Migration> {
        let mut s = self.inner.lock().ok()?;
        s.leg.first = Some(at);
        let m = s.log.last_mut()?;
        m.resumed(at);
        Some(m.clone())
    }

    /// The stream moved on to `to`, its leg's steps so far `times`.
    pub(super) fn moved(&self, to: &Arc<Endpoint>, times: &LegTimes) {
        if let Ok(mut s) = self.inner.lock() {
            s.to = Some(Arc::clone(to));
            s.leg = times.clone();
            s.migrations += 1;
        }
    }
}
