//! How an attempt ended: one [`Report`], told once to every [`Listener`].
//!
//! Every attempt the orchestrator makes (a request makes one, or more when it is
//! retried) ends exactly once: when it fails before any answer reached the client, or
//! when the client's response body ends, breaks or is dropped. At that moment one report
//! is made and handed to the router's and the connector's `observe`, then to every
//! listener: passive health, metrics, tracing, an access log. Nothing else reports
//! outcomes, so a listener sees each attempt once and sees them all.
//!
//! Listeners run on the request path (at the end of a body, on the task that polls
//! it): they must be cheap, must not block, and must not hold a lock across anything
//! slow.

use std::sync::Arc;

use crate::router::{Outcome, Route};

/// What one leg of an attempt did, as far as its engine's health is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// The leg was not sent (no prefill endpoint, a direct request, an attempt that
    /// failed before it).
    NotSent,
    /// The engine answered (its 4xx included: the client's fault, not the engine's) and,
    /// for a decode, its stream ended.
    Answered,
    /// The engine is to blame: it could not be reached, answered 5xx, broke its stream,
    /// ran out of its own time budget or answered something unusable.
    Failed,
    /// The leg did not finish, through no fault of its engine: the client left, the
    /// request's total deadline passed, the other leg failed first.
    Abandoned,
}

/// How one attempt ended.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Report {
    /// Where it went.
    pub route: Route,
    /// How it ended, for routers and connectors.
    pub outcome: Outcome,
    /// The prefill leg.
    pub prefill: Verdict,
    /// The decode leg.
    pub decode: Verdict,
}

impl Report {
    /// A report for an attempt over `route` that ended with `outcome`, its legs judged
    /// `prefill` and `decode`.
    pub(crate) fn new(route: Route, outcome: Outcome, prefill: Verdict, decode: Verdict) -> Self {
        Report {
            route,
            outcome,
            prefill,
            decode,
        }
    }
}

/// Hears how each attempt ended.
///
/// Called once per attempt, on the request path: must be cheap and must not block (see
/// the [module docs](self)). [`EndpointSource::listener`](crate::EndpointSource::listener)
/// lets a source that keeps per-endpoint state (health) hear the reports of the
/// orchestrator that routes over it, without being wired twice.
pub trait Listener: Send + Sync + 'static {
    /// `report` is how an attempt ended.
    fn on_report(&self, report: &Report);
}

impl<T: Listener + ?Sized> Listener for Arc<T> {
    fn on_report(&self, report: &Report) {
        (**self).on_report(report)
    }
}
