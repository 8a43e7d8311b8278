//! The limit on how long a name whose lookups fail keeps its last good engines
//! ([`DnsConfig::max_stale`](super::DnsConfig::max_stale)).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{NameState, Refresher};

impl NameState {
    /// When the name's last good engines are to be dropped: `max_stale` after its last
    /// good answer, while its lookups fail (a name that answers at each refresh keeps
    /// its engines, however long its TTL, and so does one answering past the endpoint
    /// ceiling); `None` while it has no engines to drop, or when that time is past any
    /// clock's reach.
    pub(super) fn stale_at(&self, max_stale: Duration) -> Option<Instant> {
        if !self.lookups_failing || self.last.as_ref().is_none_or(Vec::is_empty) {
            return None;
        }
        self.answered_at?.checked_add(max_stale)
    }
}

impl Refresher {
    /// The soonest time a name's last good engines are to be dropped.
    pub(super) fn next_stale(&self) -> Option<Instant> {
        let max_stale = self.config.max_stale;
        self.names
            .iter()
            .filter_map(|n| n.stale_at(max_stale))
            .min()
    }

    /// Drops the last good engines of each name whose lookups have failed past the
    /// limit, logged and counted once: the name has none left until it answers again.
    /// The name is still asked, with the failed lookups' backoff, and pinned as it was.
    pub(super) fn expire(&mut self) {
        let now = Instant::now();
        let max_stale = self.config.max_stale;
        for state in &mut self.names {
            if state.stale_at(max_stale).is_none_or(|at| at > now) {
                continue;
            }
            tracing::warn!(
                name = %state.target.name,
                engines = state.last.as_ref().map_or(0, Vec::len),
                failed_lookups = state.failures,
                max_stale = ?max_stale,
                "DNS lookups have failed for longer than a name's engines are kept after its last good answer; dropping them"
            );
            state.last = Some(Vec::new());
            state.origins = Arc::default();
            self.publisher.record_expired();
        }
    }
}
