//! Optional resilience for a disagg [`Orchestrator`](disagg_core::Orchestrator): each
//! piece is independent, replaceable, and plugs into a seam of `disagg-core`.
//!
//! | piece | seam | what it does |
//! |---|---|---|
//! | [`health`]: [`HealthSource`] | [`EndpointSource`](disagg_core::EndpointSource) decorator + [`Listener`](disagg_core::outcome::Listener) | a circuit breaker per endpoint and leg fed by every attempt's [`Report`](disagg_core::outcome::Report), active checks, unhealthy endpoints left out of the published set |
//! | [`admission`]: [`Limits`], [`PerEndpointLimit`] | [`Admission`](disagg_core::policy::Admission), [`Router`](disagg_core::Router) | a global in-flight limit and a bounded FIFO queue (429 / 503); the per-endpoint limit, a router decorator waiting in that queue |
//! | [`retry`]: [`Backoff`] | [`Retry`](disagg_core::policy::Retry) | full-jitter exponential backoff within a proxy-wide retry budget |
//! | [`pairing`]: [`ValidatedSource`] | [`EndpointSource`](disagg_core::EndpointSource) decorator | endpoint sets with a prefill/decode pair that cannot hand KV over refused, at start-up and on every change |
//!
//! An orchestrator built without them admits everything, retries nothing, routes over
//! every endpoint and trusts every pair; with them (pair validation is shown in
//! [`pairing`]):
//!
//! ```
//! use disagg_core::endpoint::{Endpoint, Role};
//! use disagg_core::source::StaticSource;
//! use disagg_connectors::vllm::VllmNixl;
//! use disagg_core::transport::Transport;
//! use disagg_core::Orchestrator;
//! use disagg_resilience::{AdmissionConfig, Backoff, HealthConfig, HealthSource, Limits, RetryPolicy};
//!
//! # fn build(transport: impl Transport) -> Result<(), Box<dyn std::error::Error>> {
//! let source = HealthSource::new(
//!     StaticSource::new([
//!         Endpoint::new("http://10.0.0.5:8100", Role::Prefill)?,
//!         Endpoint::new("http://10.0.0.7:8200", Role::Decode)?,
//!     ]),
//!     HealthConfig::default(),
//! );
//! let mut admission = AdmissionConfig::default();
//! admission.max_in_flight = Some(512);
//! let orchestrator = Orchestrator::builder(source, transport, VllmNixl::new()) // the source's health hears every attempt
//!     .admission(Limits::new(admission))
//!     .retry(Backoff::new(RetryPolicy::retries(2)))
//!     .build();
//! # let _ = orchestrator; Ok(()) }
//! ```

pub mod admission;
pub mod health;
pub mod pairing;
pub mod retry;
pub mod telemetry;

pub use admission::{AdmissionConfig, DecodeHold, Limits, PerEndpointLimit};
pub use health::{CheckConfig, EndpointHealth, Health, HealthConfig, HealthSource};
pub use pairing::{PairingError, PairingStats, ValidatedSource, VersionProbe, Versions};
pub use retry::{Backoff, RetryBudget, RetryPolicy};
pub use telemetry::{SuspectAction, Telemetry, TelemetryConfig};

/// Locks `m`, recovering the data if a panicking thread poisoned it (every critical
/// section in this crate leaves its data consistent).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// About 30 years: how far ahead a wait that never ends is put (as tokio does), when a
/// configured [`Duration`](std::time::Duration) (`Duration::MAX` for "forever") goes
/// past what an `Instant` can hold.
const FAR_FUTURE: std::time::Duration = std::time::Duration::from_secs(86_400 * 365 * 30);

/// `start + wait`, or about 30 years after `start` when that sum overflows: a configured
/// duration never panics the code that adds it to a clock.
pub(crate) fn after(
    start: tokio::time::Instant,
    wait: std::time::Duration,
) -> tokio::time::Instant {
    start
        .checked_add(wait)
        .or_else(|| start.checked_add(FAR_FUTURE))
        .unwrap_or(start)
}
