//! vLLM's Anthropic Messages route, `POST /v1/messages`: its prefill leg and its checks.
//!
//! The body (vLLM 0.33 `vllm/entrypoints/anthropic/protocol.py`
//! `AnthropicMessagesRequest`) has `model`, `messages` and `max_tokens` (required, above
//! 0), `system`, `stop_sequences`, `stream`, `temperature`, `top_k`, `top_p`, `tools`,
//! `tool_choice`, `thinking`, `metadata` and `kv_transfer_params`; unknown keys are
//! dropped, so chat's `ignore_eos`, `min_tokens`, `n` and logprob rows have nothing to
//! act on here. vLLM serves it through its chat handler (`anthropic/serving.py`), which
//! copies `max_tokens` to both chat limits.
//!
//! | field | prefill leg |
//! |---|---|
//! | `max_tokens` | `1` |
//! | `stream` | `false` |
//! | `stop_sequences` | removed (chat's `stop`) |
//! | `thinking` | kept: vLLM skips its `budget_tokens < max_tokens` check only on a leg whose `kv_transfer_params` hold a truthy `do_remote_decode`, which both vLLM connectors' prefill legs do (a KV release leg, whose handoff is the prefill's answer, drops an `enabled` block: [`release_body`](super::release_body)) |
//!
//! Everything else (`messages`, `system`, `tools`, `tool_choice`, `model`, the sampling
//! fields) passes unchanged and in order.

use bytes::Bytes;
use disagg_core::policy::Decision;
use disagg_json::InvalidParam;
use disagg_json::JsonBody;
use disagg_json::lax::int_value;
use disagg_json::raw as json;

/// The prefill leg's body for a client `body` of `/v1/messages` (see the
/// [module docs](self)).
pub(crate) fn rewrite(body: &JsonBody) -> JsonBody {
    let mut out = body.clone();
    out.retain(|key| key != b"stop_sequences");
    out.set_raw("max_tokens", super::ONE.clone());
    out.set_raw("stream", Bytes::from_static(b"false"));
    out
}

/// vLLM's request model checks of a Messages body, for the fields the prefill leg
/// changes or drops: `max_tokens` required and above 0, `messages` required, a list,
/// `stop_sequences` a list of strings, `stream` a boolean, and `thinking`'s budget below
/// `max_tokens` (the decode leg checks it; the prefill leg, with `do_remote_decode`,
/// does not).
pub(crate) fn check(body: &JsonBody) -> Result<Decision, InvalidParam> {
    let max_tokens = match body.get("max_tokens").map(int_value) {
        None => {
            return Err(InvalidParam::new(
                "max_tokens",
                "max_tokens: Field required",
            ));
        }
        Some(Ok(Some(m))) if m > 0 => m,
        Some(Ok(Some(_))) => {
            return Err(InvalidParam::new(
                "max_tokens",
                "max_tokens: Input should be greater than 0",
            ));
        }
        Some(_) => {
            return Err(InvalidParam::new(
                "max_tokens",
                "max_tokens: Input should be a valid integer",
            ));
        }
    };
    match body.get("messages") {
        None => return Err(InvalidParam::new("messages", "messages: Field required")),
        Some(raw) if raw.first() == Some(&b'[') => {}
        Some(_) => {
            return Err(InvalidParam::new(
                "messages",
                "messages: Input should be a valid list",
            ));
        }
    }
    super::check::opt_string_list("stop_sequences", body.get("stop_sequences"))?;
    super::check::opt_bool("stream", body.get("stream"))?;
    if let Some(raw) = body.get("thinking")
        && raw != b"null"
    {
        // Read member by member, nothing built (a non-object has neither member; the
        // engine says what it thinks of it).
        let thinking = std::str::from_utf8(raw).map_err(|_| {
            InvalidParam::new("thinking", "thinking: Input should be a valid dictionary")
        })?;
        let [kind, budget] =
            json::members_named(thinking, ["type", "budget_tokens"]).unwrap_or_default();
        if enabled(kind)
            && let Some(budget) = budget.and_then(|b| serde_json::from_str::<i64>(b.get()).ok())
            && budget >= max_tokens
        {
            return Err(InvalidParam::new(
                "thinking",
                format!(
                    "thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})"
                ),
            ));
        }
    }
    Ok(Decision::Disaggregate)
}

/// Whether a `thinking` block's `type` is `"enabled"`, the one vLLM checks.
fn enabled(kind: Option<&serde_json::value::RawValue>) -> bool {
    kind.and_then(|t| serde_json::from_str::<String>(t.get()).ok())
        .is_some_and(|t| t == "enabled")
}

/// Removes `body`'s `thinking` when it is an `enabled` block: for a leg whose
/// `kv_transfer_params` hold no truthy `do_remote_decode` and whose `max_tokens` is 1,
/// which vLLM would refuse with it (see [`release_body`](super::release_body)).
pub(super) fn drop_enabled_thinking(body: &mut JsonBody) {
    let on = body
        .get("thinking")
        .and_then(|raw| std::str::from_utf8(raw).ok())
        .and_then(|raw| json::member(raw, "type"))
        .is_some_and(|kind| enabled(Some(kind)));
    if on {
        body.remove("thinking");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vllm::rewrite::PrefillRewriter;
    use disagg_core::request::Api;

    fn rw(body: &str) -> String {
        let b = JsonBody::parse(body.as_bytes()).unwrap();
        let out = PrefillRewriter::new().rewrite(Api::Messages, &b);
        String::from_utf8(out.to_bytes().to_vec()).unwrap()
    }

    fn chk(body: &str) -> Result<Decision, InvalidParam> {
        check(&JsonBody::parse(body.as_bytes()).unwrap())
    }

    #[test]
    fn the_prefill_leg_is_one_token_and_no_stream_field_by_field() {
        assert_eq!(
            rw(
                r#"{"model":"m","system":"s","messages":[{"role":"user","content":"hi"}],"max_tokens":300,"stop_sequences":["x"],"stream":true,"temperature":0.2,"top_k":5,"tools":[{"name":"t","input_schema":{}}],"tool_choice":{"type":"auto"},"thinking":{"type":"enabled","budget_tokens":100},"metadata":{"user_id":"u"}}"#
            ),
            r#"{"model":"m","system":"s","messages":[{"role":"user","content":"hi"}],"max_tokens":1,"stream":false,"temperature":0.2,"top_k":5,"tools":[{"name":"t","input_schema":{}}],"tool_choice":{"type":"auto"},"thinking":{"type":"enabled","budget_tokens":100},"metadata":{"user_id":"u"}}"#
        );
    }

    #[test]
    fn no_chat_only_fields_are_added() {
        assert_eq!(
            rw(r#"{"messages":[],"max_tokens":9}"#),
            r#"{"messages":[],"max_tokens":1,"stream":false}"#
        );
    }

    #[test]
    fn the_request_model_is_checked() {
        for (body, param) in [
            (r#"{"messages":[]}"#, "max_tokens"),
            (r#"{"messages":[],"max_tokens":0}"#, "max_tokens"),
            (r#"{"messages":[],"max_tokens":"many"}"#, "max_tokens"),
            (r#"{"max_tokens":5}"#, "messages"),
            (r#"{"messages":"hi","max_tokens":5}"#, "messages"),
            (
                r#"{"messages":[],"max_tokens":5,"stop_sequences":"x"}"#,
                "stop_sequences",
            ),
            (
                r#"{"messages":[],"max_tokens":5,"stream":"maybe"}"#,
                "stream",
            ),
            (
                r#"{"messages":[],"max_tokens":5,"thinking":{"type":"enabled","budget_tokens":5}}"#,
                "thinking",
            ),
        ] {
            assert_eq!(chk(body).unwrap_err().param, param, "{body}");
        }
        assert!(matches!(
            chk(
                r#"{"messages":[],"max_tokens":50,"thinking":{"type":"enabled","budget_tokens":10},"stop_sequences":["a"]}"#
            ),
            Ok(Decision::Disaggregate)
        ));
    }
}
