//! The API of connector and adapter authors: helpers the engines' protocols
//! (`disagg-connectors`) and the HTTP adapter (`disagg-http`) need, and an application
//! that only serves requests never names.
//!
//! A connector reads and rewrites request bodies with `disagg-json` (re-exported as
//! [`json`](crate::json)), sees the handoff fields a client sent ([`client_handoff`]), and may pick a data-parallel rank after routing ([`dp_rank`];
//! a [`Route`](crate::router::Route)'s ranks are its public fields). An adapter that
//! forwards a request to one engine keeps the proxy's rules for headers and answers
//! ([`forwardable_header`], [`unrelayable`], [`HANDOFF_HEADER`]).
//!
//! | item | for |
//! |---|---|
//! | [`client_handoff`] | the handoff fields a client sent, which the legs never carry |
//! | [`dp_rank`] | data-parallel ranks chosen after routing |
//! | [`forwardable_header`], [`unrelayable`], [`HANDOFF_HEADER`] | forwarding to one engine as the legs do |

use std::sync::Arc;

use crate::endpoint::Endpoint;
use crate::request::PdRequest;

pub use crate::orchestrator::answer::unrelayable;
pub use crate::orchestrator::config::HANDOFF_HEADER;
pub use crate::orchestrator::legs::forwardable_header;

/// Locks `m`, recovering the data if a panicking thread poisoned it (every critical
/// section in this crate leaves its data consistent). Each crate of the workspace keeps
/// its own: a mutex helper is no part of the connector author's API.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The raw value of a handoff field the client sent in `req` (one
/// [`PdRequest::new`] removes: `kv_transfer_params`, the bootstrap fields, the rank
/// fields), which the legs never carry (the vLLM connectors refuse a
/// `kv_transfer_params` that is not an object, as vLLM would).
pub fn client_handoff<'a>(req: &'a PdRequest, field: &str) -> Option<&'a [u8]> {
    req.client_handoff(field)
}

/// One data-parallel rank of `engine`, for a connector that picks the rank itself after
/// routing (vLLM Mooncake asks the engine which ranks it runs): `URL@rank`, with the
/// engine's role, models and connector data, and its own in-flight count, which also
/// counts towards the engine's, so that routers keep seeing the whole engine's load.
pub fn dp_rank(engine: &Arc<Endpoint>, rank: u32) -> Endpoint {
    engine.dp_rank(rank)
}
