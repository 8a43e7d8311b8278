//! vLLM's Cohere route, `POST /cohere/v2/chat`: its prefill leg and its checks.
//!
//! The body (vLLM 0.33 `vllm/entrypoints/cohere/`, served through vLLM's chat handler)
//! has `model`, `messages` (required), `max_tokens` (nullable, at least 0; copied to
//! both chat limits), `stream`, `stop_sequences`, `temperature`, `p`, `k`, `seed`,
//! `response_format`, `tools` and `kv_transfer_params`. Its stream carries no handoff.
//!
//! | field | prefill leg |
//! |---|---|
//! | `max_tokens` | `1`, set even if absent (`null` is the server's default) |
//! | `stream` | `false` |
//! | `stop_sequences` | removed (chat's `stop`) |
//! | `response_format` | removed (a grammar for one discarded token, as on chat) |
//!
//! Everything else (`messages`, `tools`, `model`, the sampling fields) passes unchanged
//! and in order.

use bytes::Bytes;
use disagg_core::policy::Decision;
use disagg_json::InvalidParam;
use disagg_json::JsonBody;
use disagg_json::lax::int_value;

/// The prefill leg's body for a client `body` of `/cohere/v2/chat` (see the
/// [module docs](self)).
pub(crate) fn rewrite(body: &JsonBody) -> JsonBody {
    let mut out = body.clone();
    out.retain(|key| !matches!(key, b"stop_sequences" | b"response_format"));
    out.set_raw("max_tokens", super::ONE.clone());
    out.set_raw("stream", Bytes::from_static(b"false"));
    out
}

/// vLLM's checks of a Cohere chat body, for the fields the prefill leg changes:
/// `messages` required, a list; `max_tokens` `null` or an integer vLLM's chat handler
/// takes (at least 1: its request model allows 0, its sampling refuses it);
/// `stop_sequences` a list of strings; `stream` a boolean.
pub(crate) fn check(body: &JsonBody) -> Result<Decision, InvalidParam> {
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
    if let Some(raw) = body.get("max_tokens") {
        match int_value(raw) {
            Ok(None) => {}
            Ok(Some(m)) if m >= 1 => {}
            Ok(Some(m)) => {
                return Err(InvalidParam::new(
                    "max_tokens",
                    format!("max_tokens must be at least 1, got {m}."),
                ));
            }
            Err(_) => {
                return Err(InvalidParam::new(
                    "max_tokens",
                    "max_tokens: Input should be a valid integer",
                ));
            }
        }
    }
    super::check::opt_string_list("stop_sequences", body.get("stop_sequences"))?;
    super::check::opt_bool("stream", body.get("stream"))?;
    Ok(Decision::Disaggregate)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vllm::rewrite::PrefillRewriter;
    use disagg_core::request::Api;

    fn rw(body: &str) -> String {
        let b = JsonBody::parse(body.as_bytes()).unwrap();
        let out = PrefillRewriter::new().rewrite(Api::CohereChat, &b);
        String::from_utf8(out.to_bytes().to_vec()).unwrap()
    }

    fn chk(body: &str) -> Result<Decision, InvalidParam> {
        check(&JsonBody::parse(body.as_bytes()).unwrap())
    }

    #[test]
    fn the_prefill_leg_is_one_token_and_no_stream_field_by_field() {
        assert_eq!(
            rw(
                r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":300,"stream":true,"stop_sequences":["x"],"response_format":{"type":"json_object"},"temperature":0.2,"p":0.9,"k":5,"seed":3}"#
            ),
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1,"stream":false,"temperature":0.2,"p":0.9,"k":5,"seed":3}"#
        );
        assert_eq!(
            rw(r#"{"messages":[],"max_tokens":null}"#),
            r#"{"messages":[],"max_tokens":1,"stream":false}"#
        );
    }

    #[test]
    fn the_request_model_is_checked() {
        for (body, param) in [
            (r#"{"max_tokens":5}"#, "messages"),
            (r#"{"messages":"hi"}"#, "messages"),
            (r#"{"messages":[],"max_tokens":0}"#, "max_tokens"),
            (r#"{"messages":[],"max_tokens":"x"}"#, "max_tokens"),
            (r#"{"messages":[],"stop_sequences":"x"}"#, "stop_sequences"),
            (r#"{"messages":[],"stream":"maybe"}"#, "stream"),
        ] {
            assert_eq!(chk(body).unwrap_err().param, param, "{body}");
        }
        assert!(matches!(
            chk(r#"{"messages":[],"max_tokens":null,"stream":true}"#),
            Ok(Decision::Disaggregate)
        ));
    }
}
