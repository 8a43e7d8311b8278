//! Retries of a failed attempt: how many, how far apart, and how many the proxy as a
//! whole may afford.
//!
//! An attempt that failed before any byte of an answer reached the client, in a way
//! [`PdError::is_retryable`](disagg_core::error::PdError::is_retryable) allows, may run again on a
//! new route with a new plan (a new SGLang room, a new Mooncake transfer id), after a
//! jittered exponential backoff, while the request's deadline allows and while the
//! [`RetryBudget`] has a token for it.
//!
//! The budget is what keeps a failing pool from being hit by every request several
//! times over (a retry storm): each request earns `ratio` of a retry, each retry spends
//! one, and a small reserve lets a quiet proxy retry at all. With the default ratio of
//! 0.2, retries can add at most about 20% to the load the engines see, whatever fails.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use disagg_core::error::PdError;
use disagg_core::policy::Retry;

/// How a failed attempt is retried.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Further attempts after the first (default 0: no retry).
    pub max_retries: u32,
    /// Backoff before the first retry; each further retry doubles it (default 20 ms).
    /// The wait is drawn uniformly from zero to that value ("full jitter"), so retries of
    /// many requests that failed together do not arrive together.
    pub backoff_base: Duration,
    /// Largest backoff (default 1 s).
    pub backoff_max: Duration,
    /// Retries allowed per request, on average over time (default 0.2).
    pub budget_ratio: f64,
    /// Retries allowed beyond the ratio, for a proxy with little traffic (default 10).
    pub budget_reserve: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_retries: 0,
            backoff_base: Duration::from_millis(20),
            backoff_max: Duration::from_secs(1),
            budget_ratio: 0.2,
            budget_reserve: 10,
        }
    }
}

impl RetryPolicy {
    /// The policy with `n` retries and the default backoff and budget.
    pub fn retries(n: u32) -> Self {
        RetryPolicy {
            max_retries: n,
            ..Self::default()
        }
    }

    /// The backoff before retry number `retry` (1 for the first), given a uniform
    /// random `u64`.
    pub fn backoff(&self, retry: u32, random: u64) -> Duration {
        let shift = retry.saturating_sub(1).min(20);
        let cap = self
            .backoff_base
            .saturating_mul(1 << shift)
            .min(self.backoff_max);
        let nanos = u64::try_from(cap.as_nanos()).unwrap_or(u64::MAX);
        // Uniform in 0..=cap by multiply-shift.
        Duration::from_nanos(((u128::from(random) * (u128::from(nanos) + 1)) >> 64) as u64)
    }
}

/// Fixed-point scale of the budget's balance: one retry is `SCALE` units.
const SCALE: i64 = 1000;

/// The proxy-wide allowance of retries: a token bucket filled by requests and drained
/// by retries (see the [module docs](self)). Lock-free; shared by every request of an
/// orchestrator.
#[derive(Debug)]
pub struct RetryBudget {
    balance: AtomicI64,
    deposit: i64,
    cap: i64,
}

impl RetryBudget {
    /// A budget earning `ratio` of a retry per request, holding at most `reserve` retries
    /// plus what the last hundred requests earned, and starting full.
    pub fn new(ratio: f64, reserve: u32) -> Self {
        let deposit = (ratio.clamp(0.0, 1000.0) * SCALE as f64) as i64;
        let cap = i64::from(reserve) * SCALE + deposit * 100;
        RetryBudget {
            balance: AtomicI64::new(cap),
            deposit,
            cap,
        }
    }

    /// The budget a policy describes.
    pub fn for_policy(policy: &RetryPolicy) -> Self {
        Self::new(policy.budget_ratio, policy.budget_reserve)
    }

    /// A request arrived: earn its share of a retry.
    pub fn deposit(&self) {
        if self.deposit == 0 {
            return;
        }
        // Racy by at most one deposit per thread past the cap: harmless.
        if self.balance.load(Ordering::Relaxed) < self.cap {
            self.balance.fetch_add(self.deposit, Ordering::Relaxed);
        }
    }

    /// Take one retry from the budget; `false` when it is spent.
    pub fn withdraw(&self) -> bool {
        self.balance
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                (b >= SCALE).then_some(b - SCALE)
            })
            .is_ok()
    }

    /// Whole retries the budget holds now.
    pub fn available(&self) -> u64 {
        u64::try_from(self.balance.load(Ordering::Relaxed) / SCALE).unwrap_or(0)
    }
}

/// [`RetryPolicy`] and its [`RetryBudget`] behind the [`Retry`] seam: the
/// orchestrator's retries.
///
/// Shared by the orchestrators made with `with_transport` (the budget is proxy-wide).
#[derive(Debug)]
pub struct Backoff {
    policy: RetryPolicy,
    budget: RetryBudget,
    /// The jitter's random source (splitmix64 over a counter: uniform enough for
    /// spreading waits, not for secrets).
    seed: u64,
    draws: AtomicU64,
}

impl Backoff {
    /// Retries as `policy` says, within its budget, jittered from a random seed.
    pub fn new(policy: RetryPolicy) -> Self {
        let seed =
            std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), 0u8);
        Self::with_seed(policy, seed)
    }

    /// The same, jittered from `seed` (deterministic tests).
    pub fn with_seed(policy: RetryPolicy, seed: u64) -> Self {
        Backoff {
            budget: RetryBudget::for_policy(&policy),
            policy,
            seed,
            draws: AtomicU64::new(0),
        }
    }

    /// The policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// The budget.
    pub fn budget(&self) -> &RetryBudget {
        &self.budget
    }

    fn random(&self) -> u64 {
        let n = self.draws.fetch_add(1, Ordering::Relaxed);
        let mut z = self
            .seed
            .wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

impl Retry for Backoff {
    fn deposit(&self) {
        self.budget.deposit();
    }

    fn backoff(&self, error: &PdError, done: u32) -> Option<Duration> {
        if done >= self.policy.max_retries || !error.is_retryable() {
            return None;
        }
        Some(self.policy.backoff(done + 1, self.random()))
    }

    fn withdraw(&self) -> bool {
        self.budget.withdraw()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap_and_is_jittered() {
        let p = RetryPolicy::default();
        assert_eq!(p.backoff(1, u64::MAX), Duration::from_millis(20));
        assert_eq!(p.backoff(2, u64::MAX), Duration::from_millis(40));
        assert_eq!(p.backoff(3, u64::MAX), Duration::from_millis(80));
        assert_eq!(p.backoff(30, u64::MAX), Duration::from_secs(1));
        assert_eq!(p.backoff(1, 0), Duration::ZERO);
        let half = p.backoff(2, u64::MAX / 2);
        assert!(half > Duration::from_millis(19) && half < Duration::from_millis(21));
    }

    #[test]
    fn budget_allows_the_reserve_then_the_ratio() {
        let b = RetryBudget::new(0.2, 3);
        // Full at start: the reserve plus a hundred requests' worth (20).
        assert_eq!(b.available(), 23);
        let mut spent = 0;
        while b.withdraw() {
            spent += 1;
        }
        assert_eq!(spent, 23);
        // Then one retry per five requests.
        for _ in 0..50 {
            b.deposit();
        }
        let mut again = 0;
        while b.withdraw() {
            again += 1;
        }
        assert_eq!(again, 10);
    }

    #[test]
    fn budget_does_not_grow_past_its_cap() {
        let b = RetryBudget::new(0.5, 2);
        for _ in 0..10_000 {
            b.deposit();
        }
        assert_eq!(b.available(), 52);
    }

    #[test]
    fn zero_ratio_leaves_only_the_reserve() {
        let b = RetryBudget::new(0.0, 1);
        b.deposit();
        assert!(b.withdraw());
        assert!(!b.withdraw());
    }
}
