//! vLLM's Responses route, `POST /v1/responses`: its prefill leg, its checks, and the
//! requests it serves on one engine.
//!
//! The body (vLLM 0.33 `vllm/entrypoints/openai/responses/protocol.py`
//! `ResponsesRequest`) has `input` (required), `instructions`, `model`,
//! `max_output_tokens`, `stream`, `store`, `previous_response_id`, `background`,
//! `text`, `top_logprobs`, `tools`, `reasoning`, `request_id` and `kv_transfer_params`.
//! The handoff comes back top-level in the whole answer (and, new in 0.33, inside the
//! terminal event's `response` of a stream).
//!
//! | field | prefill leg |
//! |---|---|
//! | `max_output_tokens` | `1`, set even if absent |
//! | `stream` | `false` |
//! | `stream_options` | removed |
//! | `store` | `false`: the one-token prefill is no response anyone asks for again |
//! | `top_logprobs` | removed (chat's logprob rows) |
//! | `text` | removed (its `format` is chat's `response_format`: a grammar for one discarded token) |
//!
//! Everything else (`input`, `instructions`, `tools`, `reasoning`, `model`, the
//! sampling fields) passes unchanged and in order.
//!
//! A response vLLM keeps for later (`store: true` stated, `background: true`) or one
//! that continues a kept one (`previous_response_id`) lives in one server's memory
//! (`VLLM_ENABLE_RESPONSES_API_STORE`): such a request is served by a decode engine
//! alone ([`Decision::Direct`], reason `responses_state`), so that the response is
//! made, and found, on one engine.

use bytes::Bytes;
use disagg_core::policy::Decision;
use disagg_json::InvalidParam;
use disagg_json::JsonBody;
use disagg_json::lax::{bool_value, int_value};

/// Why a Responses request is served by one engine: it keeps or continues state.
pub(crate) const RESPONSES_STATE: &str = "responses_state";

/// The prefill leg's body for a client `body` of `/v1/responses` (see the
/// [module docs](self)).
pub(crate) fn rewrite(body: &JsonBody) -> JsonBody {
    let mut out = body.clone();
    out.retain(|key| !matches!(key, b"stream_options" | b"top_logprobs" | b"text"));
    out.set_raw("max_output_tokens", super::ONE.clone());
    out.set_raw("stream", Bytes::from_static(b"false"));
    out.set_raw("store", Bytes::from_static(b"false"));
    out
}

/// vLLM's request model checks of a Responses body, for the fields the prefill leg
/// changes (`input` required, `max_output_tokens` at least 1, `stream`, `store`,
/// `background` booleans), and the state that keeps a request on one engine.
pub(crate) fn check(body: &JsonBody) -> Result<Decision, InvalidParam> {
    if body.is_null_or_absent("input") {
        return Err(InvalidParam::new("input", "input: Field required"));
    }
    if let Some(raw) = body.get("max_output_tokens") {
        match int_value(raw) {
            Ok(None) => {}
            Ok(Some(m)) if m >= 1 => {}
            Ok(Some(m)) => {
                return Err(InvalidParam::new(
                    "max_output_tokens",
                    format!("max_output_tokens must be at least 1, got {m}."),
                ));
            }
            Err(_) => {
                return Err(InvalidParam::new(
                    "max_output_tokens",
                    "max_output_tokens: Input should be a valid integer",
                ));
            }
        }
    }
    let mut keeps_state = !body.is_null_or_absent("previous_response_id");
    for field in ["stream", "store", "background"] {
        match body.get(field).map(bool_value) {
            None | Some(Ok(None | Some(false))) => {}
            Some(Ok(Some(true))) => keeps_state |= field != "stream",
            Some(Err(_)) => {
                return Err(InvalidParam::new(
                    field,
                    format!("{field}: Input should be a valid boolean"),
                ));
            }
        }
    }
    if keeps_state {
        return Ok(Decision::Direct {
            reason: RESPONSES_STATE,
        });
    }
    Ok(Decision::Disaggregate)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vllm::rewrite::PrefillRewriter;
    use disagg_core::request::Api;

    fn rw(body: &str) -> String {
        let b = JsonBody::parse(body.as_bytes()).unwrap();
        let out = PrefillRewriter::new().rewrite(Api::Responses, &b);
        String::from_utf8(out.to_bytes().to_vec()).unwrap()
    }

    fn chk(body: &str) -> Result<Decision, InvalidParam> {
        check(&JsonBody::parse(body.as_bytes()).unwrap())
    }

    #[test]
    fn the_prefill_leg_is_one_token_unstored_and_no_stream_field_by_field() {
        assert_eq!(
            rw(
                r#"{"model":"m","instructions":"i","input":[{"role":"user","content":"hi"}],"max_output_tokens":300,"stream":true,"top_logprobs":3,"text":{"format":{"type":"json_object"}},"temperature":0.2,"tools":[],"reasoning":{"effort":"low"}}"#
            ),
            r#"{"model":"m","instructions":"i","input":[{"role":"user","content":"hi"}],"max_output_tokens":1,"stream":false,"temperature":0.2,"tools":[],"reasoning":{"effort":"low"},"store":false}"#
        );
        assert_eq!(
            rw(r#"{"input":"x"}"#),
            r#"{"input":"x","max_output_tokens":1,"stream":false,"store":false}"#
        );
    }

    #[test]
    fn the_request_model_is_checked_and_state_stays_on_one_engine() {
        for (body, param) in [
            (r#"{"model":"m"}"#, "input"),
            (
                r#"{"input":"x","max_output_tokens":0}"#,
                "max_output_tokens",
            ),
            (
                r#"{"input":"x","max_output_tokens":"lots"}"#,
                "max_output_tokens",
            ),
            (r#"{"input":"x","stream":"maybe"}"#, "stream"),
            (r#"{"input":"x","store":"maybe"}"#, "store"),
        ] {
            assert_eq!(chk(body).unwrap_err().param, param, "{body}");
        }
        for body in [
            r#"{"input":"x","store":true}"#,
            r#"{"input":"x","previous_response_id":"resp_1"}"#,
            r#"{"input":"x","background":true}"#,
        ] {
            assert!(
                matches!(
                    chk(body),
                    Ok(Decision::Direct {
                        reason: RESPONSES_STATE
                    })
                ),
                "{body}"
            );
        }
        for body in [
            r#"{"input":"x"}"#,
            r#"{"input":"x","store":false,"stream":true,"previous_response_id":null}"#,
        ] {
            assert!(matches!(chk(body), Ok(Decision::Disaggregate)), "{body}");
        }
    }
}
