//! What a migration shares with the attempt's report ([`Moved`]).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::endpoint::Endpoint;
use crate::outcome::{Migration, Report, Timeline};

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
    /// The leg the attempt's report names (the first leg, or the leg on `to`) broke and
    /// its stream waits on a continuation: its decode is told failed once, when the
    /// stream moves on (the report then names another decode), else by the report.
    broken: Option<Broken>,
}

/// A decode leg that failed: its decode, what is known of its time, and when it ended
/// (its stream broke, or its continuation could not start).
#[derive(Debug)]
pub(super) struct Broken {
    pub(super) decode: Arc<Endpoint>,
    pub(super) times: LegTimes,
    pub(super) at: std::time::Instant,
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
}

impl Moved {
    /// Point `report` at the decode that finished the answer, its decode leg (and the
    /// handoff step before it) timed by that decode's leg: the first leg's are the
    /// dead decode's report's, the attempt's start and prefill leg stay. The
    /// migrations, the attempt's own steps when it moved (`None`: `report` is
    /// untouched), and whether the leg it names broke (no other report tells it).
    pub(crate) fn apply(&self, report: &mut Report) -> Applied {
        let Ok(mut s) = self.inner.lock() else {
            return Applied::default();
        };
        let broke = s.broken.take().is_some();
        let Some(to) = &s.to else {
            return Applied {
                migrations: s.migrations,
                own: None,
                broke,
            };
        };
        report.route.decode = Arc::clone(to);
        report.route.decode_rank = None;
        let own = report.timeline;
        s.leg.onto(&mut report.timeline);
        Applied {
            migrations: s.migrations,
            own: Some(own),
            broke,
        }
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

    /// The leg the attempt's report names broke (`dead`, its decode to blame) and the
    /// stream waits on a continuation: the report tells it failed unless the stream
    /// moves on ([`moved`](Self::moved)).
    pub(super) fn broke(&self, dead: Broken) {
        if let Ok(mut s) = self.inner.lock() {
            s.broken = Some(dead);
        }
    }

    /// The stream moved on to `to`, its leg's steps so far `times`: the leg it broke
    /// on, to be told failed now (the attempt's report no longer names it).
    pub(super) fn moved(&self, to: &Arc<Endpoint>, times: &LegTimes) -> Option<Broken> {
        let mut s = self.inner.lock().ok()?;
        s.to = Some(Arc::clone(to));
        s.leg = times.clone();
        s.migrations += 1;
        s.broken.take()
    }
}
