//! vLLM's token-in, token-out route, `POST /inference/v1/generate`: its prefill leg and
//! its checks.
//!
//! The body (vLLM 0.33 `vllm/entrypoints/scale_out/token_in_token_out/protocol.py`
//! `GenerateRequest`) is `token_ids` (the prompt, required), `sampling_params` (vLLM's
//! `SamplingParams`, required), `stream`, `stream_options`, `model`, `request_id`,
//! `cache_salt`, `priority`, `features` and a top-level `kv_transfer_params`. The
//! answer is `{"request_id", "choices": [{"index", "finish_reason", "token_ids",
//! "logprobs"}], "prompt_logprobs", "kv_transfer_params"}`; a stream carries no handoff.
//!
//! The prefill leg mirrors chat's rewrite ([`super`]), field by field, where the fields
//! live here:
//!
//! | field | prefill leg |
//! |---|---|
//! | `stream` | `false` |
//! | `stream_options` | removed |
//! | `sampling_params.max_tokens` | `1` (set even if absent: `SamplingParams` defaults to 16) |
//! | `sampling_params.min_tokens`, `stop`, `stop_token_ids`, `include_stop_str_in_output`, `logprobs`, `prompt_logprobs`, `logprob_token_ids`, `structured_outputs` | removed (the table of [`super`]) |
//! | `sampling_params.n`, `best_of` | `1` when present |
//! | `sampling_params.ignore_eos` | `true` (unless turned off) |
//!
//! Everything else (`token_ids`, `model`, `cache_salt`, `features`, every other sampling
//! field) passes unchanged and in order.

use bytes::Bytes;
use disagg_core::policy::Decision;
use disagg_core::request::Api;
use disagg_json::InvalidParam;
use disagg_json::JsonBody;

use super::check::VllmLimits;

/// The prefill leg's body for a client `body` of `/inference/v1/generate` (see the
/// [module docs](self)).
pub(crate) fn rewrite(body: &JsonBody, ignore_eos: bool) -> JsonBody {
    let mut out = body.clone();
    out.retain(|key| key != b"stream_options");
    out.set_raw("stream", Bytes::from_static(b"false"));
    // A body that reached the rewriter passed `check`: `sampling_params` is an object.
    let mut params = out
        .get("sampling_params")
        .and_then(|raw| JsonBody::parse(raw).ok())
        .unwrap_or_default();
    params.retain(|key| !super::removed(key));
    params.set_raw("max_tokens", super::ONE.clone());
    for field in ["n", "best_of"] {
        if params.get(field).is_some() {
            params.set_raw(field, super::ONE.clone());
        }
    }
    if ignore_eos {
        params.set_raw("ignore_eos", Bytes::from_static(b"true"));
    }
    out.set_raw("sampling_params", params.to_bytes());
    out
}

/// vLLM's checks of a token-in body, for the fields the prefill leg changes: the
/// request model's required `token_ids` (a list of integers) and `sampling_params` (an
/// object), then the sampling fields as vLLM checks them
/// (`SamplingParams._verify_args`, the same rules as a completion's, [`super::check`]).
pub(crate) fn check(body: &JsonBody, limits: &VllmLimits) -> Result<Decision, InvalidParam> {
    match body.get("token_ids") {
        None => {
            return Err(InvalidParam::new("token_ids", "token_ids: Field required"));
        }
        Some(raw) => {
            // Each id checked as it is read, none kept (a `Vec` of a client's list of
            // ids is four bytes per byte).
            let mut ints = true;
            let listed = std::str::from_utf8(raw)
                .ok()
                .filter(|t| t.starts_with('['))
                .map(|t| {
                    disagg_json::raw::elements(t, |v| {
                        ints &= serde_json::from_str::<i64>(v.get()).is_ok();
                    })
                });
            if !matches!(listed, Some(Ok(()))) || !ints {
                return Err(InvalidParam::new(
                    "token_ids",
                    "token_ids: Input should be a valid list of integers",
                ));
            }
        }
    }
    let params = match body.get("sampling_params") {
        None => {
            return Err(InvalidParam::new(
                "sampling_params",
                "sampling_params: Field required",
            ));
        }
        Some(raw) if raw.first() == Some(&b'{') => JsonBody::parse(raw).map_err(|e| match e {
            disagg_json::BodyError::TooManyFields { limit } => InvalidParam::new(
                "sampling_params",
                format!("sampling_params: more than {limit} fields"),
            ),
            _ => InvalidParam::new(
                "sampling_params",
                "sampling_params: Input should be a valid dictionary",
            ),
        })?,
        Some(_) => {
            return Err(InvalidParam::new(
                "sampling_params",
                "sampling_params: Input should be a valid dictionary",
            ));
        }
    };
    super::check::opt_bool("stream", body.get("stream"))?;
    // `SamplingParams` has no beam search: a `use_beam_search` key there means nothing.
    super::check::check(Api::Completions, &params, limits).map(|_| Decision::Disaggregate)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vllm::rewrite::PrefillRewriter;

    fn rw(body: &str) -> String {
        let b = JsonBody::parse(body.as_bytes()).unwrap();
        let out = PrefillRewriter::new().rewrite(Api::TokenGenerate, &b);
        String::from_utf8(out.to_bytes().to_vec()).unwrap()
    }

    fn chk(body: &str) -> Result<Decision, InvalidParam> {
        check(
            &JsonBody::parse(body.as_bytes()).unwrap(),
            &VllmLimits::default(),
        )
    }

    #[test]
    fn the_prefill_leg_is_one_token_and_no_stream_field_by_field() {
        assert_eq!(
            rw(
                r#"{"model":"m","token_ids":[1,2,3],"sampling_params":{"max_tokens":64,"min_tokens":4,"temperature":0.5,"stop":["x"],"stop_token_ids":[9],"include_stop_str_in_output":true,"logprobs":2,"prompt_logprobs":1,"logprob_token_ids":[3],"structured_outputs":{"regex":"a"},"n":3,"best_of":4,"ignore_eos":false,"seed":7},"stream":true,"stream_options":{"include_usage":true},"cache_salt":"s"}"#
            ),
            r#"{"model":"m","token_ids":[1,2,3],"sampling_params":{"max_tokens":1,"temperature":0.5,"n":1,"best_of":1,"ignore_eos":true,"seed":7},"stream":false,"cache_salt":"s"}"#
        );
    }

    #[test]
    fn the_limit_is_set_even_when_absent_and_stream_added() {
        assert_eq!(
            rw(r#"{"token_ids":[1],"sampling_params":{}}"#),
            r#"{"token_ids":[1],"sampling_params":{"max_tokens":1,"ignore_eos":true},"stream":false}"#
        );
    }

    #[test]
    fn ignore_eos_can_be_turned_off() {
        let b =
            JsonBody::parse(br#"{"token_ids":[1],"sampling_params":{"max_tokens":5}}"#).unwrap();
        let out = PrefillRewriter::new()
            .with_ignore_eos(false)
            .rewrite(Api::TokenGenerate, &b);
        assert_eq!(
            &out.to_bytes()[..],
            br#"{"token_ids":[1],"sampling_params":{"max_tokens":1},"stream":false}"#
        );
    }

    #[test]
    fn the_request_model_is_checked() {
        assert_eq!(
            chk(r#"{"sampling_params":{}}"#).unwrap_err().param,
            "token_ids"
        );
        assert_eq!(
            chk(r#"{"token_ids":"1 2","sampling_params":{}}"#)
                .unwrap_err()
                .param,
            "token_ids"
        );
        assert_eq!(
            chk(r#"{"token_ids":[1]}"#).unwrap_err().param,
            "sampling_params"
        );
        assert_eq!(
            chk(r#"{"token_ids":[1],"sampling_params":[1]}"#)
                .unwrap_err()
                .param,
            "sampling_params"
        );
        assert!(matches!(
            chk(r#"{"token_ids":[1,2],"sampling_params":{"max_tokens":8}}"#),
            Ok(Decision::Disaggregate)
        ));
        // Ids that are not integers, and parameters past the body's field ceiling,
        // each said as such.
        assert_eq!(
            chk(r#"{"token_ids":[1,2.5],"sampling_params":{}}"#)
                .unwrap_err()
                .param,
            "token_ids"
        );
        let many: Vec<String> = (0..2000).map(|i| format!(r#""p{i}":0"#)).collect();
        let e = chk(&format!(
            r#"{{"token_ids":[1],"sampling_params":{{{}}}}}"#,
            many.join(",")
        ))
        .unwrap_err();
        assert_eq!(e.to_string(), "sampling_params: more than 1024 fields");
    }

    #[test]
    fn the_sampling_fields_the_leg_changes_are_checked_as_vllm_does() {
        for (body, param) in [
            (r#"{"max_tokens":0}"#, "max_tokens"),
            (r#"{"max_tokens":4,"min_tokens":5}"#, "min_tokens"),
            (r#"{"n":0}"#, "n"),
            (r#"{"stop":5}"#, "stop"),
            (r#"{"logprobs":-3}"#, "logprobs"),
        ] {
            let full = format!(r#"{{"token_ids":[1],"sampling_params":{body}}}"#);
            assert_eq!(chk(&full).unwrap_err().param, param, "{body}");
        }
    }
}
