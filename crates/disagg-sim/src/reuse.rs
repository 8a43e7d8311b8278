//! vLLM 0.33's prompt-token reuse on a chat request (PR #48145, vocabulary check #59555):
//! facts the simulator follows.
//!
//! * A chat request with `return_token_ids: true` is answered with the prompt's ids as a
//!   top-level `prompt_token_ids` (a stream: on each choice's role chunk).
//! * A chat request whose `kv_transfer_params` carries `prompt_token_ids` takes them as
//!   its prompt and neither templates nor tokenizes the messages; the key is popped from
//!   the dict before the engine sees it (`vllm/renderers/online_renderer.py`,
//!   `_reused_prompt_token_ids`). Unless they are a non-empty list of non-negative
//!   integers below the vocabulary size, the request is refused with 400 and
//!   `param: "kv_transfer_params.prompt_token_ids"`. With `echo` or a message part that
//!   is not text, the ids are ignored (popped, not checked) and the prompt is made as
//!   usual.
//!
//! A NIXL decode pulling KV checks the digest of the prompt the prefill computed against
//! its own prompt, so ids that disagree with the KV fail the pull as they would on vLLM.

use serde_json::{Map, Value};

use crate::api::ApiError;
use crate::generate::VOCAB_SIZE;

/// The key, in `kv_transfer_params`.
const KEY: &str = "prompt_token_ids";

/// The error's `param`.
const PARAM: &str = "kv_transfer_params.prompt_token_ids";

/// The prompt a chat request reuses: `params` (its `kv_transfer_params`) loses
/// `prompt_token_ids`, which are returned when `body` lets them be used.
///
/// # Errors
///
/// 400 with vLLM's `param` when they are not a non-empty list of non-negative integers
/// below [`VOCAB_SIZE`].
pub(crate) fn reused_prompt(
    params: &mut Map<String, Value>,
    body: &Map<String, Value>,
) -> Result<Option<Vec<u32>>, ApiError> {
    let Some(ids) = params.remove(KEY) else {
        return Ok(None);
    };
    if crate::lax::opt_bool(body, "echo")?.unwrap_or(false) || has_media(body.get("messages")) {
        return Ok(None);
    }
    let refused = || {
        let mut e = ApiError::bad_request(format!(
            "{PARAM} must be a non-empty list of non-negative integers below the vocabulary size ({VOCAB_SIZE})"
        ));
        e.param = Some(PARAM);
        e
    };
    let list = ids
        .as_array()
        .filter(|l| !l.is_empty())
        .ok_or_else(refused)?;
    list.iter()
        .map(|id| {
            id.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .filter(|id| *id < VOCAB_SIZE)
                .ok_or_else(refused)
        })
        .collect::<Result<Vec<u32>, _>>()
        .map(Some)
}

/// Whether a message has a content part that is not text.
fn has_media(messages: Option<&Value>) -> bool {
    let Some(Value::Array(messages)) = messages else {
        return false;
    };
    messages.iter().any(|m| match m.get("content") {
        Some(Value::Array(parts)) => parts
            .iter()
            .any(|p| p.get("type").and_then(Value::as_str) != Some("text")),
        _ => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn reuse(ids: Value, body: Value) -> Result<Option<Vec<u32>>, ApiError> {
        let mut params = json!({"do_remote_prefill": true, KEY: ids});
        let params = params.as_object_mut().unwrap();
        let out = reused_prompt(params, body.as_object().unwrap());
        assert!(!params.contains_key(KEY), "popped before the engine");
        out
    }

    #[test]
    fn ids_are_the_prompt_unless_echo_or_media_and_checked_like_vllm() {
        let text = json!({"messages": [{"role": "user", "content": "hi"}]});
        assert_eq!(
            reuse(json!([17, 0, 5]), text.clone()).unwrap(),
            Some(vec![17, 0, 5])
        );
        let echo = json!({"echo": true, "messages": []});
        assert_eq!(reuse(json!([-1]), echo).unwrap(), None);
        let media = json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]});
        assert_eq!(reuse(json!([1]), media).unwrap(), None);
        for bad in [
            json!([]),
            json!([-1]),
            json!([1.5]),
            json!(["1"]),
            json!(null),
            json!([VOCAB_SIZE]),
        ] {
            let e = reuse(bad.clone(), text.clone()).unwrap_err();
            assert_eq!(e.param, Some(PARAM), "{bad}");
            assert_eq!(e.status, http::StatusCode::BAD_REQUEST);
        }
    }
}
