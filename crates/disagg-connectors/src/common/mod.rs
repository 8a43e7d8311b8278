//! What the engine protocols share.
//!
//! | file | holds |
//! |---|---|
//! | `room.rs` | [`Rooms`]: handoff ids that never repeat within a process (SGLang's `bootstrap_room`, vLLM Mooncake's `transfer_id`) |
//! | `sse.rs` | [`sse::MapEvents`]: a decode stream rewritten event by event (SGLang's logprob merge, LMCache's chat reshape) |
//! | `mod.rs` | `openai_only`: the refusal of SGLang's native `/generate` by the connectors whose engines do not serve it; `carries`: the refusal of any API outside a connector's list |

use disagg_core::error::ConnectorError;
use disagg_core::request::Api;

mod room;
pub mod sse;

#[cfg(all(test, feature = "sglang"))]
pub(crate) use room::MAX_ROOM;
pub use room::Rooms;

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
