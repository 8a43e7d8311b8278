//! Time: a request's deadline, each step's budget, and the `server-timing` header.

use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderValue;
use tokio::time::Instant as TokioInstant;

use crate::endpoint::Endpoint;
use crate::error::{PdError, Phase, Side};
use crate::outcome::Timeline;

/// The `server-timing` value for an attempt's phases: `prefill` (its leg, sent to
/// answered), `handoff` (the step until the decode leg was sent) and `decode` (the decode
/// leg, sent to its head); `None` when none happened.
pub(super) fn server_timing(tl: &Timeline) -> Option<HeaderValue> {
    let p = tl.phases();
    server_timing_of([p.prefill, p.handoff, p.decode_head])
}

fn server_timing_of(phases: [Option<Duration>; 3]) -> Option<HeaderValue> {
    let mut out = Vec::with_capacity(64);
    for (name, d) in ["prefill", "handoff", "decode"].into_iter().zip(phases) {
        if let Some(d) = d {
            if !out.is_empty() {
                out.extend_from_slice(b", ");
            }
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b";dur=");
            write_millis(&mut out, d);
        }
    }
    if out.is_empty() {
        return None;
    }
    // The vector becomes the value's bytes: no second buffer, no copy.
    HeaderValue::from_maybe_shared(bytes::Bytes::from(out)).ok()
}

/// `d` in milliseconds with three decimals (`12.345`), without float formatting, which
/// the profile showed costing more than the rest of the response head, and in 64-bit
/// arithmetic on a stack buffer (`as_micros` is a `u128`, whose division is a library
/// call per digit).
fn write_millis(out: &mut Vec<u8>, d: Duration) {
    // u64 microseconds last 584,000 years; a longer phase reads as that.
    let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    // The most digits a u64 has (20), then the point and three decimals.
    let mut buf = [0u8; 24];
    let mut at = buf.len();
    let mut frac = micros % 1000;
    for _ in 0..3 {
        at -= 1;
        buf[at] = b'0' + (frac % 10) as u8;
        frac /= 10;
    }
    at -= 1;
    buf[at] = b'.';
    let mut int = micros / 1000;
    loop {
        at -= 1;
        buf[at] = b'0' + (int % 10) as u8;
        int /= 10;
        if int == 0 {
            break;
        }
    }
    out.extend_from_slice(&buf[at..]);
}

/// When a request must be done by, and whether it already waited in the admission
/// queue.
#[derive(Debug, Clone, Copy)]
pub(super) struct Clock {
    pub(super) deadline: Option<TokioInstant>,
    /// It waited in the admission queue (and was counted there): for admission, or in
    /// a routing that said so ([`Route::queued`](crate::router::Route::queued)). Every
    /// routing after that tells the router so
    /// ([`Ask::queued`](crate::router::Ask#structfield.queued)).
    pub(super) queued: bool,
}

impl Clock {
    /// The time a step with budget `step` may take, and whether the deadline (rather
    /// than the step's own budget) is what limits it.
    pub(super) fn budget(&self, step: Duration) -> (Duration, bool) {
        match self.deadline {
            None => (step, false),
            Some(d) => {
                let left = d.saturating_duration_since(TokioInstant::now());
                if left < step {
                    (left, true)
                } else {
                    (step, false)
                }
            }
        }
    }

    pub(super) fn expired(&self) -> bool {
        self.deadline.is_some_and(|d| TokioInstant::now() >= d)
    }
}

/// Run `step` within `budget` (or what is left of the deadline, if less); out of time,
/// the error names which ran out.
pub(super) async fn within<T>(
    clock: Clock,
    budget: Duration,
    side: Side,
    endpoint: &Arc<Endpoint>,
    phase: Phase,
    step: impl Future<Output = Result<T, PdError>>,
) -> Result<T, PdError> {
    let (budget, by_deadline) = clock.budget(budget);
    // The deadline has passed: the step is not started (a first poll would send its
    // request).
    if by_deadline && budget.is_zero() {
        return Err(out_of_time(true, side, endpoint, phase));
    }
    match tokio::time::timeout(budget, step).await {
        Ok(r) => r,
        Err(_) => Err(out_of_time(by_deadline, side, endpoint, phase)),
    }
}

/// The error for a step that ran out of time: its own budget, or the deadline.
pub(super) fn out_of_time(
    by_deadline: bool,
    side: Side,
    endpoint: &Arc<Endpoint>,
    phase: Phase,
) -> PdError {
    if by_deadline {
        PdError::deadline(side, phase)
    } else {
        PdError::timeout(side, endpoint.id().clone(), phase)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step the deadline left no time for is not started (polled once, a leg would
    /// write its request); with time left the same step runs.
    #[tokio::test(start_paused = true)]
    async fn a_step_the_deadline_left_no_time_for_is_not_started() {
        use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
        let ep = Arc::new(Endpoint::new("http://127.0.0.1:1", crate::Role::Prefill).unwrap());
        let polled = AtomicBool::new(false);
        let step = || async {
            polled.store(true, Relaxed);
            Ok::<_, PdError>(())
        };
        let budget = Duration::from_secs(5);
        let passed = Clock {
            deadline: Some(TokioInstant::now()),
            queued: false,
        };
        let e = within(passed, budget, Side::Prefill, &ep, Phase::Prefill, step())
            .await
            .unwrap_err();
        assert!(e.is_deadline(), "{e}");
        assert!(!polled.load(Relaxed), "the step was started");
        let left = Clock {
            deadline: Some(TokioInstant::now() + Duration::from_secs(1)),
            queued: false,
        };
        within(left, budget, Side::Prefill, &ep, Phase::Prefill, step())
            .await
            .unwrap();
        assert!(polled.load(Relaxed));
    }

    #[test]
    fn server_timing_values() {
        let t = [
            Some(Duration::from_micros(12_345)),
            Some(Duration::from_nanos(900)),
            Some(Duration::from_secs(2) + Duration::from_micros(7)),
        ];
        assert_eq!(
            server_timing_of(t).unwrap(),
            "prefill;dur=12.345, handoff;dur=0.000, decode;dur=2000.007"
        );
        assert_eq!(
            server_timing_of([None, None, t[2]]).unwrap(),
            "decode;dur=2000.007"
        );
        assert!(server_timing_of([None; 3]).is_none());
        let mut out = Vec::new();
        write_millis(&mut out, Duration::MAX);
        assert_eq!(out, b"18446744073709551.615");
        out.clear();
        write_millis(&mut out, Duration::from_micros(1_000_000_001));
        assert_eq!(out, b"1000000.001");
        assert!(server_timing(&Timeline::starting()).is_none());
    }
}
