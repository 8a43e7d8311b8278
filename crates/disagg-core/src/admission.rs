//! Admission: the seam through which an orchestrator limits how many requests run at
//! once.
//!
//! An orchestrator admits every request when it has no [`Admission`] (the default). An
//! implementation (`disagg-resilience` has one with a global limit, a per-endpoint
//! limit and a bounded FIFO queue) decides whether a request runs now, waits, or is
//! refused; the [`Permit`] it grants is held by the response body until the answer's
//! last byte, so a long stream counts as long as it lasts.

use std::any::Any;
use std::fmt;

use futures::future::BoxFuture;
use tokio::time::Instant;

use crate::error::PdError;
use crate::router::Route;

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
/// `deadline`); then, per attempt, [`has_room`](Self::has_room) on the route chosen,
/// and while that is false [`wait_for_room`](Self::wait_for_room) before routing again.
/// [`exchange_ended`](Self::exchange_ended) tells it that a prefill exchange ended (a
/// per-endpoint limit may have room again). The synchronous methods must be cheap: they
/// run on every request.
pub trait Admission: Send + Sync + 'static {
    /// A permit at once, when one is free without waiting.
    fn try_admit(&self) -> Option<Permit>;

    /// A permit, waiting for it if needed.
    ///
    /// # Errors
    ///
    /// [`PdError`] (429 `queue_full`, 503 `queue_timeout`) when the request is refused.
    fn admit(&self, deadline: Option<Instant>) -> BoxFuture<'static, Result<Permit, PdError>>;

    /// Whether the endpoints of `route` may take one more request. The default: always.
    fn has_room(&self, _route: &Route) -> bool {
        true
    }

    /// Wait until some request ends, as a request that first found no room at `since`.
    /// The default never waits.
    ///
    /// # Errors
    ///
    /// [`PdError`] when the wait is refused or too long.
    fn wait_for_room(
        &self,
        _since: Instant,
        _deadline: Option<Instant>,
    ) -> BoxFuture<'static, Result<(), PdError>> {
        Box::pin(async { Ok(()) })
    }

    /// Whether [`exchange_ended`](Self::exchange_ended) matters (a per-endpoint limit is
    /// set); the orchestrator skips the call otherwise.
    fn tracks_exchanges(&self) -> bool {
        false
    }

    /// A prefill exchange ended (its endpoint may have room again).
    fn exchange_ended(&self) {}

    /// What it counted.
    fn stats(&self) -> AdmissionStats {
        AdmissionStats::default()
    }
}
