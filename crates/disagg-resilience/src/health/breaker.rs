//! The circuit breaker of one endpoint on its leg: the state the request path reads
//! with atomics, and its transitions.

use super::*;

/// One endpoint's breaker and active-check verdict. The request path reads atomics;
/// transitions take `breaker`.
pub(super) struct EndpointState {
    pub(super) endpoint: Arc<Endpoint>,
    /// [`CLOSED`], [`OPEN`] or [`HALF_OPEN`]; written under `breaker`.
    pub(super) phase: AtomicU8,
    /// Consecutive failures while closed.
    pub(super) failures: AtomicU32,
    /// While open: the end of the ejection, nanoseconds since the epoch.
    pub(super) until: AtomicU64,
    /// The active checks' verdict.
    pub(super) down: AtomicBool,
    /// Ejections in a row (the backoff's exponent); held for every transition.
    pub(super) breaker: Mutex<u32>,
    /// Every ejection since the state was made, for metrics.
    pub(super) ejections: AtomicU64,
    /// A prefill's: the decode (a hash of its id, never 0) whose leg last failed after
    /// this prefill handed it KV, with no handoff of this prefill's loaded since; 0
    /// when none ([`Health::lost_kv`]).
    pub(super) lost_kv_on: AtomicU64,
}

/// Why a breaker opened.
#[derive(Clone, Copy)]
pub(super) enum Cause {
    Failures(u32),
    HalfOpenFailure,
    /// Someone else's verdict ([`Health::eject`]).
    External(&'static str),
}

impl EndpointState {
    pub(super) fn new(endpoint: Arc<Endpoint>) -> Self {
        EndpointState {
            endpoint,
            phase: AtomicU8::new(CLOSED),
            failures: AtomicU32::new(0),
            until: AtomicU64::new(0),
            down: AtomicBool::new(false),
            breaker: Mutex::new(0),
            ejections: AtomicU64::new(0),
            lost_kv_on: AtomicU64::new(0),
        }
    }

    /// Apply one result; whether the breaker changed state.
    pub(super) fn record(&self, ok: bool, health: &Health) -> bool {
        if ok && self.phase.load(Ordering::Acquire) == CLOSED {
            // The common case: one load, and a store only after a failure.
            if self.failures.load(Ordering::Relaxed) != 0 {
                self.failures.store(0, Ordering::Relaxed);
            }
            return false;
        }
        let mut ejections = lock(&self.breaker);
        let now = health.now_ns();
        match self.phase.load(Ordering::Acquire) {
            CLOSED if ok => {
                self.failures.store(0, Ordering::Relaxed);
                false
            }
            CLOSED => {
                let n = self
                    .failures
                    .fetch_add(1, Ordering::Relaxed)
                    .saturating_add(1);
                let threshold = health.config.failure_threshold;
                if threshold == 0 || n < threshold {
                    return false;
                }
                self.open(&mut ejections, now, health, Cause::Failures(n));
                true
            }
            // A result of a request sent before the ejection: it says nothing new.
            OPEN if self.until.load(Ordering::Relaxed) > now => false,
            // Half-open, or open with its time over: this result decides.
            _ if ok => {
                *ejections = 0;
                self.failures.store(0, Ordering::Relaxed);
                self.phase.store(CLOSED, Ordering::Release);
                tracing::info!(
                    endpoint = %self.endpoint.id(),
                    role = ?self.endpoint.role(),
                    reason = "succeeded while half-open",
                    "endpoint healthy again: circuit closed"
                );
                true
            }
            _ => {
                self.open(&mut ejections, now, health, Cause::HalfOpenFailure);
                true
            }
        }
    }

    /// Eject: open the breaker for the next backoff time. Called with `breaker` held.
    pub(super) fn open(&self, ejections: &mut u32, now: u64, health: &Health, cause: Cause) {
        *ejections = ejections.saturating_add(1);
        self.ejections.fetch_add(1, Ordering::Relaxed);
        let time = health.config.ejection_time(*ejections);
        let until = now.saturating_add(nanos(time));
        self.until.store(until, Ordering::Relaxed);
        self.failures.store(0, Ordering::Relaxed);
        self.phase.store(OPEN, Ordering::Release);
        health.recheck_at.fetch_min(until, Ordering::AcqRel);
        let (id, role) = (self.endpoint.id(), self.endpoint.role());
        match cause {
            Cause::Failures(n) => tracing::warn!(
                endpoint = %id,
                role = ?role,
                reason = "consecutive failures",
                failures = n,
                ejected_for = ?time,
                "endpoint ejected"
            ),
            Cause::HalfOpenFailure => tracing::warn!(
                endpoint = %id,
                role = ?role,
                reason = "failed while half-open",
                ejections = *ejections,
                ejected_for = ?time,
                "endpoint ejected again"
            ),
            Cause::External(reason) => tracing::warn!(
                endpoint = %id,
                role = ?role,
                reason,
                ejections = *ejections,
                ejected_for = ?time,
                "endpoint ejected"
            ),
        }
    }

    /// Open the breaker now for `reason`, unless it is open already; whether it opened.
    pub(super) fn eject(&self, health: &Health, reason: &'static str) -> bool {
        let mut ejections = lock(&self.breaker);
        let now = health.now_ns();
        if self.phase.load(Ordering::Acquire) == OPEN && self.until.load(Ordering::Relaxed) > now {
            return false;
        }
        self.open(&mut ejections, now, health, Cause::External(reason));
        true
    }

    /// Whether the endpoint is routed at `now`; an ejection whose time is over turns
    /// half-open here. Lowers `next` to the end of a pending ejection.
    pub(super) fn routed(&self, now: u64, next: &mut u64) -> bool {
        if self.phase.load(Ordering::Acquire) == OPEN {
            let until = self.until.load(Ordering::Relaxed);
            if until > now {
                *next = (*next).min(until);
                return false;
            }
            let _transition = lock(&self.breaker);
            if self.phase.load(Ordering::Acquire) == OPEN {
                self.phase.store(HALF_OPEN, Ordering::Release);
                tracing::info!(
                    endpoint = %self.endpoint.id(),
                    role = ?self.endpoint.role(),
                    reason = "ejection time over",
                    "endpoint back in the routing set, half-open"
                );
            }
        }
        !self.down.load(Ordering::Acquire)
    }

    pub(super) fn view(&self, now: u64, health: &Health) -> EndpointHealth {
        if self.down.load(Ordering::Acquire) {
            return EndpointHealth::Down;
        }
        match self.phase.load(Ordering::Acquire) {
            CLOSED => EndpointHealth::Healthy,
            OPEN => {
                let until = self.until.load(Ordering::Relaxed);
                if until > now {
                    EndpointHealth::Ejected {
                        until: health.instant(until),
                    }
                } else {
                    EndpointHealth::HalfOpen
                }
            }
            _ => EndpointHealth::HalfOpen,
        }
    }

    /// Set the active checks' verdict; whether it changed.
    pub(super) fn set_down(&self, down: bool, reason: &dyn fmt::Display, checks: u32) -> bool {
        if self.down.swap(down, Ordering::AcqRel) == down {
            return false;
        }
        let (id, role) = (self.endpoint.id(), self.endpoint.role());
        if down {
            tracing::warn!(endpoint = %id, role = ?role, %reason, checks, "endpoint down: health check failed");
        } else {
            tracing::info!(endpoint = %id, role = ?role, %reason, checks, "endpoint back up");
        }
        true
    }
}

pub(super) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

pub(super) fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    // Every critical section leaves the registry whole.
    l.read().unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub(super) fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(std::sync::PoisonError::into_inner)
}
