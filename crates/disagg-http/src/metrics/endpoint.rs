//! Each endpoint's series, resolved once per endpoint and found by its id on the request
//! path; dropped once the endpoint has left the set and stayed unused for a while.
//!
//! A leg's metrics are labelled by its endpoint, and label values are strings: looking
//! them up in a `Family` on every request would hash and compare the whole label set
//! under the family's lock. Instead the handles of an endpoint's series (cheap clones
//! of the family's own) are kept in a map by role and id, built the first time the
//! endpoint is seen; the request path does one lookup of the id under a read lock and
//! touches nothing else shared but the series themselves.
//!
//! Cardinality stays bounded by the endpoint set: whenever the orchestrator's set
//! changes ([`Metrics::follow`](super::Metrics::follow)), every five seconds, and at each
//! scrape, the series of an endpoint that is no longer in the set are removed from their
//! families once nothing holds the endpoint any more (no request, no source: it left
//! for good), or once it has not been used for [`DEFAULT_RETENTION`]. An endpoint that
//! health checks or the breaker took out for a while is still held by the health
//! source (it is not in the published set then, and comes back with its counts); one
//! whose last streams are still ending is held by them.

use std::borrow::Cow;
use std::collections::HashMap;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};
use std::time::{Duration, Instant};

use disagg_core::endpoint::{Endpoint, EndpointSet, Role};
use disagg_core::outcome::LegOutcome;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;

use super::BUCKETS;

/// How long an endpoint gone from the set keeps its series after its last use: longer
/// than the longest default ejection (60 s, doubled from 5 s) many times over, so an
/// ejected endpoint keeps its counts; short enough that a fleet that churns (autoscaled
/// engines, rolling restarts) does not accumulate series for hours.
pub(super) const DEFAULT_RETENTION: Duration = Duration::from_secs(10 * 60);

/// A label set: names are fixed, values are the role, the endpoint's id, the outcome.
pub(super) type Labels<const N: usize> = [(&'static str, Cow<'static, str>); N];

/// A histogram family with [`BUCKETS`].
pub(super) type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

pub(super) fn histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

/// The leg outcomes counted per endpoint, in [`Series::legs`]' order.
pub(super) const LEG_OUTCOMES: [&str; 3] = ["answered", "failed", "abandoned"];

/// The families of per-endpoint metrics.
#[derive(Clone)]
pub(super) struct Families {
    /// `disagg_endpoint_requests_total{role,endpoint,outcome}`.
    pub(super) legs: Family<Labels<3>, Counter>,
    /// `disagg_prefill_duration_seconds{endpoint}`.
    pub(super) prefill: Histograms<Labels<1>>,
    /// `disagg_decode_head_seconds{endpoint}`.
    pub(super) decode_head: Histograms<Labels<1>>,
    /// `disagg_decode_first_chunk_seconds{endpoint}`.
    pub(super) decode_first_chunk: Histograms<Labels<1>>,
}

impl Families {
    pub(super) fn new() -> Self {
        Families {
            legs: Family::default(),
            prefill: Family::new_with_constructor(histogram),
            decode_head: Family::new_with_constructor(histogram),
            decode_first_chunk: Family::new_with_constructor(histogram),
        }
    }
}

/// One endpoint's series.
pub(super) struct Series {
    /// Its legs by outcome ([`LEG_OUTCOMES`]).
    legs: [Counter; 3],
    /// Prefill endpoints: the prefill leg's duration. Decode endpoints: the decode leg's
    /// head. Encoders: none (their legs are counted only).
    pub(super) first: Option<Histogram>,
    /// Decode endpoints: the decode leg's first chunk.
    pub(super) second: Option<Histogram>,
    /// Whole seconds since [`Endpoints::epoch`] of its last use.
    last_used: AtomicU64,
    /// The endpoint the series were made for: once no request or source holds it, it
    /// has left for good.
    endpoint: Weak<Endpoint>,
}

impl Series {
    /// Count one leg that ended as `verdict` (a leg not sent is not counted).
    pub(super) fn leg(&self, verdict: LegOutcome) {
        let i = match verdict {
            LegOutcome::Answered => 0,
            LegOutcome::Failed => 1,
            LegOutcome::Abandoned => 2,
            _ => return,
        };
        self.legs[i].inc();
    }
}

/// Every endpoint's [`Series`], by role and id.
pub(super) struct Endpoints {
    epoch: Instant,
    retention: Duration,
    families: Families,
    // foldhash: looked up twice per request, by ids from the operator's sources.
    by_role: [RwLock<HashMap<Arc<str>, Series, foldhash::fast::RandomState>>; 3],
}

/// The roles with series, in [`Endpoints::by_role`]'s order.
const ROLES: [Role; 3] = [Role::Prefill, Role::Decode, Role::Encode];

fn role_index(role: Role) -> usize {
    ROLES.iter().position(|r| *r == role).unwrap_or(2)
}

fn role_name(role: Role) -> &'static str {
    role.as_str()
}

impl Endpoints {
    pub(super) fn new(families: Families, retention: Duration) -> Self {
        Endpoints {
            epoch: Instant::now(),
            retention,
            families,
            by_role: Default::default(),
        }
    }

    fn seconds(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.epoch).as_secs()
    }

    /// Run `f` on `endpoint`'s series, used at `at` (an instant the caller already has:
    /// no clock is read here); creates them the first time.
    pub(super) fn with<R>(
        &self,
        endpoint: &Arc<Endpoint>,
        at: Instant,
        f: impl FnOnce(&Series) -> R,
    ) -> R {
        let now = self.seconds(at);
        let map = &self.by_role[role_index(endpoint.role())];
        if let Some(series) = read(map).get(endpoint.id().as_str()) {
            // A store only when the second changed: the line stays shared otherwise.
            if series.last_used.load(Ordering::Relaxed) < now {
                series.last_used.store(now, Ordering::Relaxed);
            }
            return f(series);
        }
        let mut map = write(map);
        let series = map
            .entry(Arc::from(endpoint.id().as_str()))
            .or_insert_with(|| self.create(endpoint));
        series.last_used.store(now, Ordering::Relaxed);
        f(series)
    }

    fn create(&self, endpoint: &Arc<Endpoint>) -> Series {
        let role = endpoint.role();
        let id: Cow<'static, str> = Cow::Owned(endpoint.id().as_str().to_owned());
        let f = &self.families;
        let legs = LEG_OUTCOMES.map(|outcome| {
            f.legs
                .get_or_create(&leg_labels(role, &id, outcome))
                .clone()
        });
        let label = [("endpoint", id)];
        let (first, second) = match role {
            Role::Prefill => (Some(f.prefill.get_or_create(&label).clone()), None),
            Role::Decode => (
                Some(f.decode_head.get_or_create(&label).clone()),
                Some(f.decode_first_chunk.get_or_create(&label).clone()),
            ),
            _ => (None, None),
        };
        Series {
            legs,
            first,
            second,
            last_used: AtomicU64::new(0),
            endpoint: Arc::downgrade(endpoint),
        }
    }

    /// Remove the series of the endpoints that are not in `set` and that nothing holds
    /// any more or were last used more than the retention before `now`.
    pub(super) fn prune(&self, set: &EndpointSet, now: Instant) {
        let now = self.seconds(now);
        for role in ROLES {
            let members: HashSet<&str> =
                set.by_role(role).iter().map(|e| e.id().as_str()).collect();
            let stale = |id: &str, s: &Series| {
                !members.contains(id)
                    && (s.endpoint.strong_count() == 0
                        || now.saturating_sub(s.last_used.load(Ordering::Relaxed))
                            > self.retention.as_secs())
            };
            let map = &self.by_role[role_index(role)];
            // The common case, nothing stale, under the read lock only.
            if !read(map).iter().any(|(id, s)| stale(id, s)) {
                continue;
            }
            write(map).retain(|id, s| {
                if !stale(id, s) {
                    return true;
                }
                let owned: Cow<'static, str> = Cow::Owned(id.to_string());
                let f = &self.families;
                for outcome in LEG_OUTCOMES {
                    f.legs.remove(&leg_labels(role, &owned, outcome));
                }
                let label = [("endpoint", owned)];
                f.prefill.remove(&label);
                f.decode_head.remove(&label);
                f.decode_first_chunk.remove(&label);
                false
            });
        }
    }

    /// Endpoints with series now, for tests.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.by_role.iter().map(|m| read(m).len()).sum()
    }
}

/// The label set of `id`'s legs of `outcome` (built when a series is created or
/// removed, never per request).
fn leg_labels(role: Role, id: &str, outcome: &'static str) -> Labels<3> {
    [
        ("role", Cow::Borrowed(role_name(role))),
        ("endpoint", Cow::Owned(id.to_owned())),
        ("outcome", Cow::Borrowed(outcome)),
    ]
}

/// A poisoned lock only means a panic elsewhere while holding it; the map is still whole.
fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(url: &str, role: Role) -> Arc<Endpoint> {
        Arc::new(Endpoint::new(url, role).unwrap())
    }

    #[test]
    fn an_endpoint_gone_from_the_set_loses_its_series_after_the_retention_only() {
        let families = Families::new();
        let endpoints = Endpoints::new(families.clone(), Duration::from_secs(60));
        let (p, d) = (
            ep("http://p:1", Role::Prefill),
            ep("http://d:1", Role::Decode),
        );
        let t0 = endpoints.epoch;
        endpoints.with(&p, t0, |s| s.leg(LegOutcome::Answered));
        endpoints.with(&d, t0, |s| s.leg(LegOutcome::Failed));
        assert_eq!((endpoints.len(), families.legs.len()), (2, 6));
        let both = EndpointSet::new([Arc::clone(&p), Arc::clone(&d)]);
        let only_d = EndpointSet::new([Arc::clone(&d)]);
        // In the set: kept however old.
        endpoints.prune(&both, t0 + Duration::from_secs(3600));
        assert_eq!(endpoints.len(), 2);
        // Out of the set but used within the retention: kept.
        endpoints.prune(&only_d, t0 + Duration::from_secs(59));
        assert_eq!(endpoints.len(), 2);
        // Out of the set and idle past it: removed, from the families too.
        endpoints.prune(&only_d, t0 + Duration::from_secs(61));
        assert_eq!(endpoints.len(), 1);
        assert_eq!(families.legs.len(), 3);
        assert!(families.prefill.is_empty());
        assert_eq!(families.decode_head.len(), 1);
        // Used again: its series come back (from zero).
        endpoints.with(&p, t0 + Duration::from_secs(62), |s| {
            s.leg(LegOutcome::Answered)
        });
        assert_eq!(families.legs.len(), 6);
    }

    #[test]
    fn an_endpoint_gone_from_the_set_that_nothing_holds_loses_its_series_at_once() {
        let families = Families::new();
        let endpoints = Endpoints::new(families.clone(), Duration::from_secs(600));
        let (p, d) = (
            ep("http://p:1", Role::Prefill),
            ep("http://d:1", Role::Decode),
        );
        let t0 = endpoints.epoch;
        endpoints.with(&p, t0, |s| s.leg(LegOutcome::Answered));
        endpoints.with(&d, t0, |s| s.leg(LegOutcome::Answered));
        let only_d = EndpointSet::new([Arc::clone(&d)]);
        // Still held (a request, the health source): kept within the retention.
        endpoints.prune(&only_d, t0 + Duration::from_secs(1));
        assert_eq!(endpoints.len(), 2);
        // Its last holder gone: removed at the next pass, retention or not.
        drop(p);
        endpoints.prune(&only_d, t0 + Duration::from_secs(1));
        assert_eq!(endpoints.len(), 1);
        assert_eq!(families.legs.len(), 3);
        assert!(families.prefill.is_empty());
        // In the set, held only by it: kept.
        drop(d);
        endpoints.prune(&only_d, t0 + Duration::from_secs(1));
        assert_eq!(endpoints.len(), 1);
    }
}
