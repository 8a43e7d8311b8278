//! Admission: the seam through which an orchestrator limits how many requests run at
//! once.
//!
//! An orchestrator admits every request when it has no [`Admission`] (the default). An
//! implementation (`disagg-resilience` has one with a global limit and a bounded FIFO
//! queue, whose per-endpoint limit is a router decorator sharing that queue) decides
//! whether a request runs now, waits, or is refused; the [`Permit`] it grants is held by the response body until the answer's
//! last byte, so a long stream counts as long as it lasts.

use std::any::Any;
use std::fmt;

use futures::future::BoxFuture;
use tokio::time::Instant;

use crate::error::PdError;

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
