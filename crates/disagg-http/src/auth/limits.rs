//! Limits per key: the in-flight count and the token bucket each configured key carries.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// === KeyLimits ===

/// Limits that every API key gets on its own.
///
/// # Examples
///
/// ```
/// use disagg_http::auth::KeyLimits;
/// let mut limits = KeyLimits::default();
/// limits.rate = Some(0.5);
/// // Burst: at least one request, else one second's worth.
/// assert_eq!(limits.burst(), Some(1.0));
/// limits.rate = Some(20.0);
/// assert_eq!(limits.burst(), Some(20.0));
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct KeyLimits {
    /// Requests a key may have in flight at once (a stream counts until its body ends);
    /// one more is answered 429 at once. `None`: no limit.
    pub max_in_flight: Option<usize>,
    /// Requests per second a key may start, as a token bucket refilled at this rate;
    /// a request finding the bucket empty is answered 429. `None`: no limit.
    pub rate: Option<f64>,
    /// The bucket's size: how many requests a key that was idle may start at once.
    /// Default ([`burst`](Self::burst)): one second's worth of `rate`, at least 1, so a
    /// key at 0.5/s may send one request every two seconds and a key at 20/s may send
    /// 20 at once after a pause, never more than `rate` on average.
    pub burst_size: Option<f64>,
}

impl KeyLimits {
    /// The bucket size in force: [`burst_size`](Self::burst_size), else `max(1, rate)`;
    /// `None` without a rate.
    pub fn burst(&self) -> Option<f64> {
        let rate = self.rate?;
        Some(self.burst_size.unwrap_or(rate.max(1.0)))
    }

    pub(super) fn is_none(&self) -> bool {
        self.max_in_flight.is_none() && self.rate.is_none()
    }
}

// === per-key state ===

/// The token bucket of one key.
#[derive(Debug)]
pub(super) struct Bucket {
    tokens: f64,
    last: Instant,
}

/// What one configured key carries while it is configured.
#[derive(Debug)]
pub(super) struct KeyState {
    pub(super) in_flight: AtomicUsize,
    bucket: Mutex<Bucket>,
}

impl KeyState {
    pub(super) fn new(limits: &KeyLimits) -> Self {
        KeyState {
            in_flight: AtomicUsize::new(0),
            bucket: Mutex::new(Bucket {
                tokens: limits.burst().unwrap_or(0.0),
                last: Instant::now(),
            }),
        }
    }
}

/// Holds one of a key's in-flight places until dropped.
#[derive(Debug)]
pub(super) struct InFlightSlot(pub(super) Arc<KeyState>);

impl Drop for InFlightSlot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Release);
    }
}

/// Take one token from the key's bucket, or say how long until one is there.
pub(super) fn take_token(state: &KeyState, rate: f64, burst: f64) -> Result<(), Duration> {
    let mut b = state
        .bucket
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let now = Instant::now();
    let refill = now.saturating_duration_since(b.last).as_secs_f64() * rate;
    b.tokens = (b.tokens + refill).min(burst);
    b.last = now;
    if b.tokens >= 1.0 {
        b.tokens -= 1.0;
        return Ok(());
    }
    let wait = (1.0 - b.tokens) / rate;
    Err(Duration::try_from_secs_f64(wait).unwrap_or(Duration::from_secs(1)))
}
