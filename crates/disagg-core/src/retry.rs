//! Retries: the seam through which an orchestrator sends a failed attempt again.
//!
//! An orchestrator retries nothing when it has no [`Retry`] (the default).
//! `disagg-resilience` has a policy with full-jitter exponential backoff and a
//! proxy-wide retry budget. Whatever the policy, the orchestrator retries only an
//! attempt that failed before any byte of an answer reached the client, only within the
//! request's deadline, and each retry selects a new route and runs the connector's
//! `prepare` again (a new SGLang room, a new Mooncake transfer id, a new engine-side
//! request id).

use std::time::Duration;

use crate::error::PdError;

/// Decides whether, and after how long, a failed attempt is tried again.
///
/// All methods run on the request path and must be cheap.
pub trait Retry: Send + Sync + 'static {
    /// A request arrived (a budget may earn retries from the traffic). The default does
    /// nothing.
    fn deposit(&self) {}

    /// The wait before the next attempt after `error`, when `done` retries were made
    /// already; `None` when `error` must not be retried.
    fn backoff(&self, error: &PdError, done: u32) -> Option<Duration>;

    /// Take one retry from the budget, if any; `false` denies the retry. Called only
    /// when the retry fits in the request's deadline. The default always allows.
    fn withdraw(&self) -> bool {
        true
    }
}
