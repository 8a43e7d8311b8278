//! What the engine protocols share.
//!
//! | file | holds |
//! |---|---|
//! | `room.rs` | [`Rooms`]: handoff ids that never repeat within a process and cannot be predicted from the ones seen (SGLang's `bootstrap_room`, vLLM Mooncake's `transfer_id`) |
//! | `sse.rs` | [`sse::MapEvents`]: a decode stream rewritten event by event (SGLang's logprob merge, LMCache's chat reshape) |
//! | `mod.rs` | `openai_only`: the refusal of SGLang's native `/generate` by the connectors whose engines do not serve it; `carries`: the refusal of any API outside a connector's list; `bootstrap_port`: a prefill's bootstrap port read from its facts; `completion_batch`: how many prompts a completions `prompt` lists; `lock`: a mutex locked through poisoning |

use disagg_core::endpoint::{Endpoint, Facts};
use disagg_core::error::ConnectorError;
use disagg_core::request::Api;

mod room;
pub mod sse;

#[cfg(all(test, feature = "sglang"))]
pub(crate) use room::MAX_ROOM;
pub use room::Rooms;

/// Locks `m`, recovering the data if a panicking thread poisoned it (every critical
/// section of the connectors leaves its data consistent).
#[allow(dead_code)] // used by the features that keep state (vLLM Mooncake)
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Refuse SGLang's native `/generate` in a connector whose engines do not serve it (the
/// vLLM connectors): 400 `unsupported_by_connector`, as for anything else the protocol
/// cannot carry.
#[cfg_attr(not(feature = "vllm"), allow(dead_code))]
pub(crate) fn openai_only(connector: &'static str, api: Api) -> Result<(), ConnectorError> {
    match api {
        Api::Generate => Err(ConnectorError::Unsupported {
            connector,
            what: "SGLang's native /generate API (only the SGLang connector carries it)".to_owned(),
        }),
        _ => Ok(()),
    }
}

/// Refuse an API outside `apis`, the ones the connector's legs can carry: 400
/// `unsupported_by_connector`, before any leg is sent (the SGLang and LMCache
/// connectors carry neither vLLM's token-in route nor its Anthropic, Responses or
/// Cohere routes).
#[cfg_attr(not(any(feature = "sglang", feature = "lmcache")), allow(dead_code))]
pub(crate) fn carries(
    connector: &'static str,
    api: Api,
    apis: &[Api],
) -> Result<(), ConnectorError> {
    if apis.contains(&api) {
        return Ok(());
    }
    let list: Vec<&str> = apis.iter().map(|a| a.path()).collect();
    Err(ConnectorError::Unsupported {
        connector,
        what: format!(
            "the route {} (this connector carries {} only)",
            api.path(),
            list.join(", ")
        ),
    })
}

/// What an endpoint with a malformed [`Facts::BOOTSTRAP_PORT`] lacks, in
/// [`ConnectorError::NotConfigured`].
const BAD_BOOTSTRAP_PORT: &str = "usable `bootstrap_port` fact (a port number, 0-65535)";

/// A prefill endpoint's bootstrap port, from its [`Facts::BOOTSTRAP_PORT`] fact (the
/// protocols whose engines meet through a bootstrap server: SGLang, vLLM Mooncake):
/// `None` when it declares none. A map lookup and a `u16` parse per request, no
/// allocation.
///
/// # Errors
///
/// [`ConnectorError::NotConfigured`] naming the endpoint and the key when the value is
/// not a port number (the command line and discovery refuse one before it gets here;
/// an embedder's own facts may not).
#[cfg_attr(not(any(feature = "vllm", feature = "sglang")), allow(dead_code))]
pub(crate) fn bootstrap_port(ep: &Endpoint) -> Result<Option<u16>, ConnectorError> {
    ep.facts()
        .get(Facts::BOOTSTRAP_PORT)
        .map(str::parse::<u16>)
        .transpose()
        .map_err(|_| ConnectorError::NotConfigured {
            endpoint: ep.id().clone(),
            what: BAD_BOOTSTRAP_PORT,
        })
}

/// How many prompts a completions request's `prompt` lists when it is a batch: a list
/// whose first element is a string or a list (vLLM and SGLang read `["a","b"]` and
/// `[[1],[2]]` as one prompt per element; a flat list of token ids is one prompt).
/// `None` for anything else. A list whose first element is a number is told at a
/// glance, never walked (a client's prompt of millions of ids); a batch is walked at
/// its own level only, its prompts left raw.
#[cfg_attr(not(any(feature = "vllm", feature = "sglang")), allow(dead_code))]
pub(crate) fn completion_batch(body: &disagg_json::JsonBody) -> Option<usize> {
    let raw = body.get("prompt")?;
    let first = raw
        .strip_prefix(b"[")?
        .iter()
        .find(|b| !b.is_ascii_whitespace())?;
    if !matches!(first, b'"' | b'[') {
        return None;
    }
    let list = disagg_json::raw::list_head(raw)?;
    matches!(list.first, Some(b'"' | b'[')).then_some(list.len)
}
