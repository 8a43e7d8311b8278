//! What a migration shares with the attempt's report ([`Moved`]).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::endpoint::Endpoint;
use crate::outcome::Migration;
use crate::router::Route;

/// What a migration shares with the attempt's report: where the answer moved to, so
/// that the attempt is reported against the decode that finished it (the dead one was
/// reported failed when it broke), and how many times.
#[derive(Debug, Default)]
pub(crate) struct Moved {
    inner: Mutex<MovedState>,
}

#[derive(Debug, Default)]
struct MovedState {
    to: Option<Arc<Endpoint>>,
    migrations: u32,
    carried: u64,
    /// Each continuation tried, for the request's summary.
    log: Vec<Migration>,
}

impl Moved {
    /// Point `route` at the decode that finished the answer; the migrations and the
    /// tokens carried over.
    pub(crate) fn apply(&self, route: &mut Route) -> (u32, u64) {
        let Ok(s) = self.inner.lock() else {
            return (0, 0);
        };
        if let Some(to) = &s.to {
            route.decode = Arc::clone(to);
            route.decode_rank = None;
        }
        (s.migrations, s.carried)
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

    /// The last continuation's first byte went to the client at `at`: the migration,
    /// for the log line.
    pub(super) fn resumed(&self, at: Instant) -> Option<Migration> {
        let mut s = self.inner.lock().ok()?;
        let m = s.log.last_mut()?;
        m.resumed(at);
        Some(m.clone())
    }

    pub(super) fn moved(&self, to: &Arc<Endpoint>, carried: u64) {
        if let Ok(mut s) = self.inner.lock() {
            s.to = Some(Arc::clone(to));
            s.migrations += 1;
            s.carried += carried;
        }
    }
}
