//! The API of connector and adapter authors: helpers the engines' protocols
//! (`disagg-connectors`) and the HTTP adapter (`disagg-http`) need, and an application
//! that only serves requests never names.
//!
//! A connector reads and rewrites request bodies field by field ([`fields`], [`retain`],
//! [`write_json_str`], [`top_level_field`]), reads request fields as the engines'
//! pydantic models do ([`lax`]), sees the handoff fields a client sent
//! ([`client_handoff`]), and may pick a data-parallel rank after routing ([`dp_rank`];
//! a [`Route`](crate::router::Route)'s ranks are its public fields). An adapter that
//! forwards a request to one engine keeps the proxy's rules for headers and answers
//! ([`forwardable_header`], [`unrelayable`], [`HANDOFF_HEADER`]).
//!
//! | item | for |
//! |---|---|
//! | [`lax`] | pydantic's lax reading of JSON values (`bool`, `int`) |
//! | [`fields`], [`retain`] | one pass over a [`JsonBody`]'s fields |
//! | [`write_json_str`], [`top_level_field`] | writing a JSON string; one field of an engine's answer, unparsed |
//! | [`client_handoff`] | the handoff fields a client sent, which the legs never carry |
//! | [`dp_rank`] | data-parallel ranks chosen after routing |
//! | [`forwardable_header`], [`unrelayable`], [`HANDOFF_HEADER`] | forwarding to one engine as the legs do |

use std::sync::Arc;

use bytes::Bytes;

use crate::body::JsonBody;
use crate::endpoint::Endpoint;
use crate::error::BodyError;
use crate::request::PdRequest;

pub mod lax;

pub use crate::orchestrator::answer::unrelayable;
pub use crate::orchestrator::config::HANDOFF_HEADER;
pub use crate::orchestrator::legs::forwardable_header;

/// Locks `m`, recovering the data if a panicking thread poisoned it (every critical
/// section in this crate leaves its data consistent). Each crate of the workspace keeps
/// its own: a mutex helper is no part of the connector author's API.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `body`'s fields in order, as `(key, raw JSON value)`, the key as its UTF-8 bytes: one
/// pass over the object for a reader of many fields, where each
/// [`JsonBody::get`] would be a search (and bytes, so that matching keys validates
/// nothing again).
pub fn fields(body: &JsonBody) -> impl Iterator<Item = (&[u8], &[u8])> {
    body.fields()
}

/// Keep only the fields of `body` whose key (UTF-8 bytes) `keep` accepts, in order: one
/// pass, where removing many keys one by one would search the object for each.
pub fn retain(body: &mut JsonBody, keep: impl FnMut(&[u8]) -> bool) {
    body.retain(keep)
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

/// `s` as a JSON string: copied between quotes when nothing needs escaping.
pub fn write_json_str(out: &mut Vec<u8>, s: &[u8]) {
    crate::body::write_json_str(out, s)
}

/// The raw value of the top-level field `key` of the JSON object `bytes`, found without
/// building the rest.
///
/// The object is walked at its top level only: strings are skipped escape-aware, nested
/// values by bracket depth, and only the value found is validated as JSON. Cheaper than
/// [`JsonBody::parse_bytes`] when one field of a large answer is wanted (the prefill's
/// `kv_transfer_params`); a malformed object is an error, as with a full parse. Keys are
/// compared after unescaping; the last of duplicate keys wins.
///
/// # Errors
///
/// [`BodyError`] when `bytes` is not a JSON object or the value found is not valid JSON.
///
/// # Examples
///
/// ```
/// use bytes::Bytes;
/// use disagg_core::proto::top_level_field;
///
/// let answer = Bytes::from_static(br#"{"choices":[{"text":"}"}],"kv_transfer_params":{"a":1}}"#);
/// let v = top_level_field(&answer, "kv_transfer_params")?.unwrap();
/// assert_eq!(&v[..], br#"{"a":1}"#);
/// # Ok::<(), disagg_core::error::BodyError>(())
/// ```
pub fn top_level_field(bytes: &Bytes, key: &str) -> Result<Option<Bytes>, BodyError> {
    crate::body::top_level_field(bytes, key)
}
