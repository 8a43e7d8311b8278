//! The orchestrator's small policy seams, each optional: whether a request runs now
//! ([`Admission`]), whether it is worth a prefill leg at all ([`Disaggregate`]), and
//! whether a failed attempt is sent again ([`Retry`]). The implementations are in
//! `disagg-resilience` (admission, retries) and `disagg-affinity` (disaggregation
//! policies); an orchestrator built without them admits everything, disaggregates
//! everything ([`Always`]) and retries nothing.
//!
//! # Admission
//!
//! How many requests run at once. An orchestrator admits every request when it has no [`Admission`] (the default). An
//! implementation (`disagg-resilience` has one with a global limit and a bounded FIFO
//! queue, whose per-endpoint limit is a router decorator sharing that queue) decides
//! whether a request runs now, waits, or is refused; the [`Permit`] it grants is held by
//! the response body until the answer's last byte, so a long stream counts as long as it
//! lasts.
//!
//! # Conditional disaggregation
//!
//! Disaggregation pays a second round trip and a KV transfer to keep long prefills off
//! the decode engines. For a short prompt that trade is a loss: the decode engine
//! computes a few hundred tokens of prompt faster than the prefill leg and the KV pull
//! take. A [`Disaggregate`] hook decides per request, before routing; a request it sends
//! [`Direct`](Decision::Direct) goes to a decode endpoint alone, as the client sent it,
//! and its answer carries `x-disagg-handoff: direct` (the reason is logged at `debug`
//! with the request id).
//!
//! | hook | disaggregates |
//! |---|---|
//! | [`Always`] (the default) | every request |
//! | `disagg_affinity::PromptThreshold` | requests whose estimated prompt is at least `min_tokens` long |
//!
//!
//! # Retries
//!
//! An orchestrator retries nothing when it has no [`Retry`] (the default).
//! `disagg-resilience` has a policy with full-jitter exponential backoff and a
//! proxy-wide retry budget. Whatever the policy, the orchestrator retries only an
//! attempt that failed before any byte of an answer reached the client, only within the
//! request's deadline, and each retry selects a new route and runs the connector's
//! `prepare` again (a new SGLang room, a new Mooncake transfer id, a new engine-side
//! request id).

use std::any::Any;
use std::fmt;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::time::Instant;

use crate::error::PdError;
use crate::router::RequestView;

// === admission ===

/// A request's place among the running ones: dropping it ends the request for
/// admission. Opaque: it carries whatever the [`Admission`] that granted it needs to
/// give the place back.
pub struct Permit(#[allow(dead_code)] Box<dyn Any + Send + Sync>); // held for its drop

impl Permit {
    /// A permit holding `place`, which gives the place back when dropped.
    pub fn new(place: impl Any + Send + Sync) -> Self {
        Permit(Box::new(place))
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Permit")
    }
}

/// What an [`Admission`] counted, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct AdmissionStats {
    /// Requests waiting now (a gauge).
    pub waiting: u64,
    /// Requests that had to wait.
    pub queued: u64,
    /// Requests refused because the queue was full (429).
    pub queue_full: u64,
    /// Requests that waited too long (503).
    pub queue_timeouts: u64,
}

/// Decides when requests run.
///
/// The orchestrator calls, per request: [`try_admit`](Self::try_admit), and when it
/// gives nothing, [`admit`](Self::admit), which may wait (within the request's
/// `deadline`). The synchronous methods must be cheap: they run on every request. A
/// limit per endpoint is no admission but a [`Router`](crate::Router) decorator
/// (`disagg_resilience::PerEndpointLimit`): it needs the route, and holds a place per
/// leg in it ([`Route::with_holds`](crate::router::Route::with_holds)).
pub trait Admission: Send + Sync + 'static {
    /// A permit at once, when one is free without waiting.
    fn try_admit(&self) -> Option<Permit>;

    /// A permit, waiting for it if needed.
    ///
    /// # Errors
    ///
    /// [`PdError`] (429 `queue_full`, 503 `queue_timeout`) when the request is refused.
    fn admit(&self, deadline: Option<Instant>) -> BoxFuture<'static, Result<Permit, PdError>>;

    /// What it counted.
    fn stats(&self) -> AdmissionStats {
        AdmissionStats::default()
    }
}

// === conditional disaggregation ===

/// The decision of a [`Disaggregate`] hook.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Decision {
    /// Prefill on a prefill endpoint, decode on a decode endpoint.
    Disaggregate,
    /// Send the request to a decode endpoint alone; it computes the prompt itself.
    Direct {
        /// Why, for the logs (`"short_prompt"`).
        reason: &'static str,
    },
}

/// Decides per request whether to disaggregate.
///
/// Called once per request attempt, before routing: it must be synchronous and cheap (no
/// I/O, no blocking).
pub trait Disaggregate: Send + Sync + 'static {
    /// The decision for `req`.
    fn decide(&self, req: &RequestView<'_>) -> Decision;

    /// Whether this hook reads [`RequestView::tokens`] (see
    /// [`Router::wants_tokens`](crate::Router::wants_tokens)). The default: `false`.
    fn wants_tokens(&self) -> bool {
        false
    }
}

impl<T: Disaggregate + ?Sized> Disaggregate for std::sync::Arc<T> {
    fn decide(&self, req: &RequestView<'_>) -> Decision {
        (**self).decide(req)
    }

    fn wants_tokens(&self) -> bool {
        (**self).wants_tokens()
    }
}

/// Disaggregate every request.
#[derive(Debug, Clone, Copy, Default)]
pub struct Always;

impl Disaggregate for Always {
    fn decide(&self, _req: &RequestView<'_>) -> Decision {
        Decision::Disaggregate
    }
}

// === retries ===

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
