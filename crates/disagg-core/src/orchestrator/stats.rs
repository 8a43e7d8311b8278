//! The live counters behind [`OrchestratorStats`](super::OrchestratorStats): atomics
//! bumped on the request path, read by [`Orchestrator::stats`](super::Orchestrator::stats).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The live counters behind [`OrchestratorStats`] that are not admission's.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) requests: AtomicU64,
    pub(crate) in_flight: AtomicU64,
    pub(crate) retries: AtomicU64,
    pub(crate) retries_denied: AtomicU64,
    pub(crate) prefill_fallbacks: AtomicU64,
    pub(crate) deadlines_exceeded: AtomicU64,
    pub(crate) kv_releases: AtomicU64,
    pub(crate) kv_releases_in_flight: AtomicU64,
    /// Early releases not run: the releases' room was spent (`release::MAX_RELEASES`).
    pub(crate) kv_releases_skipped: AtomicU64,
    /// Bytes of legs the running early releases hold: a gauge.
    pub(crate) kv_release_bytes: AtomicU64,
    pub(crate) invalid_params: AtomicU64,
    pub(crate) tokenized: AtomicU64,
    pub(crate) tokenize_failures: AtomicU64,
    pub(crate) invalid_handoffs: AtomicU64,
    /// Mid-stream migrations started, by `migrate::Reason::index`.
    pub(crate) migrations: [AtomicU64; 3],
    /// Generated tokens carried over to continuations.
    pub(crate) migrated_tokens: AtomicU64,
    /// By reason. A short list (a handful of static reasons) behind a lock taken only
    /// for requests served direct, and never across an await.
    direct: std::sync::Mutex<Vec<(&'static str, u64)>>,
}

pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Relaxed);
}

/// Counts one request in the orchestrator's in-flight gauge while it lives (held by the
/// response body until the answer's last byte).
#[derive(Debug)]
pub(crate) struct InFlight(std::sync::Arc<Counters>);

impl InFlight {
    pub(crate) fn new(counters: &std::sync::Arc<Counters>) -> Self {
        counters.in_flight.fetch_add(1, Relaxed);
        InFlight(std::sync::Arc::clone(counters))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Relaxed);
    }
}

impl Counters {
    pub(crate) fn load(counter: &AtomicU64) -> u64 {
        counter.load(Relaxed)
    }

    /// Count one request served direct for `reason`.
    pub(crate) fn direct(&self, reason: &'static str) {
        let mut by_reason = crate::proto::lock(&self.direct);
        match by_reason.iter_mut().find(|(r, _)| *r == reason) {
            Some((_, n)) => *n += 1,
            None => by_reason.push((reason, 1)),
        }
    }

    /// The direct counts by reason.
    pub(crate) fn direct_counts(&self) -> Vec<(&'static str, u64)> {
        crate::proto::lock(&self.direct).clone()
    }
}
