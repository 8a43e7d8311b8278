//! Conditional disaggregation: whether a request is worth a prefill leg at all.
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
//! This module holds the seam and the default; the policies are in `disagg-affinity`.

use crate::router::RequestView;

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
