//! The limit on how long a name whose lookups fail keeps its last good engines, and a
//! family that fails beside one that answers its last good addresses
//! ([`DnsConfig::max_stale`](super::DnsConfig::max_stale)).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::outcome::Remembered;
use super::{NameState, Refresher, url};

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

    /// When the first of its engines kept as a failed family's last good addresses is
    /// to be dropped: `max_stale` after its family last answered with it, whether the
    /// name answers since (the other family), fails, or answers past the ceiling.
    fn kept_stale_at(&self, max_stale: Duration) -> Option<Instant> {
        self.kept
            .values()
            .filter_map(|at| at.checked_add(max_stale))
            .min()
    }

    /// Whether the name still holds any of `stale`, the addresses a lookup left out
    /// for being past the limit: then that lookup drops them (to be counted); else the
    /// limit dropped them already, while the lookup was under way (counted then).
    pub(super) fn holds_any(&self, stale: &[Remembered]) -> bool {
        stale.iter().any(|(origin, ip, at)| {
            self.origins
                .get(origin)
                .is_some_and(|held| held.contains(&(*ip, *at)))
        })
    }

    /// Drops the engines kept as a failed family's last good addresses whose limit has
    /// passed (and the addresses remembered for them); how many.
    fn drop_stale_kept(&mut self, now: Instant, max_stale: Duration) -> usize {
        let past = |at: &Instant| at.checked_add(max_stale).is_some_and(|end| end <= now);
        let gone: HashSet<_> = self
            .kept
            .iter()
            .filter(|(_, at)| past(at))
            .map(|(engine, _)| *engine)
            .collect();
        if gone.is_empty() {
            return 0;
        }
        self.kept.retain(|engine, _| !gone.contains(engine));
        let urls: HashSet<String> = gone.iter().map(|(ip, port)| url(*ip, *port)).collect();
        if let Some(last) = &mut self.last {
            last.retain(|e| !urls.contains(&e.url));
        }
        // Not handed to the next lookup, which would drop (and count) them again.
        let origins = Arc::make_mut(&mut self.origins);
        for ((_, port), held) in origins.iter_mut() {
            held.retain(|(ip, at)| !(past(at) && gone.contains(&(ip.to_canonical(), *port))));
        }
        origins.retain(|_, held| !held.is_empty());
        gone.len()
    }
}

impl Refresher {
    /// The soonest time a name's last good engines, or a failed family's last good
    /// addresses, are to be dropped.
    pub(super) fn next_stale(&self) -> Option<Instant> {
        let max_stale = self.config.max_stale;
        self.names
            .iter()
            .flat_map(|n| [n.stale_at(max_stale), n.kept_stale_at(max_stale)])
            .flatten()
            .min()
    }

    /// Drops the last good engines of each name whose lookups have failed past the
    /// limit, logged and counted once: the name has none left until it answers again.
    /// The name is still asked, with the failed lookups' backoff, and pinned as it was.
    /// Of the other names, drops the engines kept as a failed family's last good
    /// addresses past their limit, logged and counted once for the name.
    pub(super) fn expire(&mut self) {
        let now = Instant::now();
        let max_stale = self.config.max_stale;
        for state in &mut self.names {
            if state.stale_at(max_stale).is_none_or(|at| at > now) {
                let dropped = state.drop_stale_kept(now, max_stale);
                if dropped > 0 {
                    tracing::warn!(
                        name = %state.target.name,
                        engines = dropped,
                        max_stale = ?max_stale,
                        "DNS lookups of one address family have failed for longer than its addresses are kept after their last good answer; dropping them"
                    );
                    self.publisher.record_expired();
                }
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
            state.kept.clear();
            self.publisher.record_expired();
        }
    }
}
