//! What an orchestrator counted: [`OrchestratorStats`].

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// A snapshot of an orchestrator's counters and gauges, from
/// [`Orchestrator::stats`](crate::Orchestrator::stats).
///
/// Counters only grow; gauges (`in_flight`, `queued_now`, `kv_releases_in_flight`) are
/// the current value. All are per orchestrator: an application running several (one per
/// serving thread, say) adds them up.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct OrchestratorStats {
    /// Requests served (each counted once, whatever its retries).
    pub requests: u64,
    /// Requests admitted and not yet ended (their answer's last byte not yet sent):
    /// a gauge.
    pub in_flight: u64,
    /// Requests waiting for admission now: a gauge.
    pub queued_now: u64,
    /// Requests that had to wait for admission.
    pub queued: u64,
    /// Requests refused because the admission queue was full (429).
    pub rejected_queue_full: u64,
    /// Requests that waited too long for admission (503).
    pub queue_timeouts: u64,
    /// Retries made.
    pub retries: u64,
    /// Retries not made because the retry budget was spent.
    pub retries_denied: u64,
    /// Requests served decode-only because their prefill could not be had
    /// ([`PrefillFailure::DecodeOnly`](crate::orchestrator::PrefillFailure::DecodeOnly)).
    pub prefill_fallbacks: u64,
    /// Requests that ended because their total deadline passed.
    pub deadlines_exceeded: u64,
    /// Early KV releases sent ([`KvRelease`](crate::orchestrator::KvRelease)).
    pub kv_releases: u64,
    /// Early KV releases still running: a gauge.
    pub kv_releases_in_flight: u64,
    /// Requests served by a decode engine alone, by reason (`beam_search` and
    /// `prompt_only`, which the connector cannot carry; `short_prompt` from
    /// `disagg_affinity::PromptThreshold`; a custom hook's own),
    /// in the order the reasons were first seen.
    pub direct: Vec<(&'static str, u64)>,
    /// Requests refused before routing because an engine would refuse a field the
    /// proxy rewrites (400 `invalid_parameter`).
    pub invalid_params: u64,
}

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
    pub(crate) invalid_params: AtomicU64,
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

/// Counts one running task in a gauge while it lives.
pub(crate) struct GaugeGuard<'a>(&'a AtomicU64);

impl<'a> GaugeGuard<'a> {
    pub(crate) fn new(gauge: &'a AtomicU64) -> Self {
        gauge.fetch_add(1, Relaxed);
        GaugeGuard(gauge)
    }
}

impl Drop for GaugeGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

impl Counters {
    pub(crate) fn load(counter: &AtomicU64) -> u64 {
        counter.load(Relaxed)
    }

    /// Count one request served direct for `reason`.
    pub(crate) fn direct(&self, reason: &'static str) {
        let mut by_reason = crate::lock(&self.direct);
        match by_reason.iter_mut().find(|(r, _)| *r == reason) {
            Some((_, n)) => *n += 1,
            None => by_reason.push((reason, 1)),
        }
    }

    /// The direct counts by reason.
    pub(crate) fn direct_counts(&self) -> Vec<(&'static str, u64)> {
        crate::lock(&self.direct).clone()
    }
}
