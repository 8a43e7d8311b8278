//! The prefill-request rewriter, and the checks that keep it honest.
//!
//! The prefill leg exists only to fill the KV cache of the prompt. Everything that shapes
//! the *prompt* (`messages`, `prompt`, `tools`, `tool_choice`, `chat_template*`, `model`,
//! multimodal parts, ...) is kept exactly as the client sent it; everything that shapes
//! *sampling* is changed so the leg ends after one token, length-capped, and cheaply:
//!
//! | field | prefill leg | why |
//! |---|---|---|
//! | `max_tokens` | `1` | the handoff needs exactly one engine step |
//! | `max_completion_tokens` | `1` on chat, set even if absent | vLLM reads `max_completion_tokens or max_tokens`, so a client value would win over `max_tokens` |
//! | `min_tokens`, `min_completion_tokens` | removed | vLLM rejects `min_tokens > max_tokens` |
//! | `stream` | `false` | the handoff (`kv_transfer_params`) is only in the non-streaming answer |
//! | `stream_options` | removed | vLLM rejects it without `stream` |
//! | `stop`, `stop_token_ids` | removed | a first token matching a stop ends the leg "stopped", and vLLM then keeps no KV for the remote decode |
//! | `ignore_eos` | `true` | the same for an EOS first token (configurable, for engines without it) |
//! | `include_stop_str_in_output` | removed | meaningless without stops; defaults to `false` |
//! | `n`, `best_of` | `1` when present | one KV handoff has one consumer; the decode leg keeps the client's `n` |
//! | `logprobs`, `top_logprobs`, `logprob_token_ids`, `echo`, `prompt_logprobs` | removed | the prefill's token is discarded; these only cost time, and vLLM refuses `logprob_token_ids` or `top_logprobs` without `logprobs` |
//! | `response_format`, `structured_outputs`, `guided_*`, `structural_tag` | removed | a grammar compiled for one discarded token is wasted work |
//!
//! The rule behind the table: a prefill leg never keeps a field whose companion the
//! rewriter removed or changed (vLLM refuses `logprob_token_ids` once `logprobs` is gone,
//! `stream_options` once `stream` is off, `min_tokens` above the new cap).
//!
//! Because the prefill engine never sees the client's values of these fields, it can
//! never refuse them: [`check::check_request`] refuses them as vLLM would, before any
//! leg is sent (see [`check`] for the rules and their sources), and says
//! which requests P/D cannot carry at all (beam search). `docs/protocols.md` holds the
//! whole rule table.
//!
//! Every other field passes through unchanged and in order. Handoff fields
//! (`kv_transfer_params`, ...) are the connector's to add. Sources: vLLM's NIXL toy proxy
//! and `kv_transfer_params` handling, Ray Serve LLM's `prepare_prefill_request`, llm-d's
//! NIXL v2 connector (see `docs/protocols.md`).
//!
//! The other generation routes vLLM 0.33 takes a handoff on have their own limit
//! fields, in their own module each: `token_in.rs` for `/inference/v1/generate`
//! (`sampling_params.max_tokens`), `messages.rs` for Anthropic's `/v1/messages`
//! (`max_tokens`, `stop_sequences`), `responses.rs` for `/v1/responses`
//! (`max_output_tokens`, `store`), `cohere.rs` for `/cohere/v2/chat` (`max_tokens`,
//! `stop_sequences`).

pub mod check;
mod cohere;
mod messages;
mod responses;
mod token_in;

use check::VllmLimits;

use disagg_core::request::Api;
use disagg_json::JsonBody;

/// Whether `key` is removed from the prefill leg: the table of the module docs, as one
/// `match` so that a body's fields are filtered in a single pass.
fn removed(key: &[u8]) -> bool {
    matches!(
        key,
        b"min_tokens"
            | b"min_completion_tokens"
            | b"stream_options"
            | b"stop"
            | b"stop_token_ids"
            | b"include_stop_str_in_output"
            | b"logprobs"
            | b"top_logprobs"
            | b"logprob_token_ids"
            | b"echo"
            | b"prompt_logprobs"
            // Grammars: vLLM 0.33 reads `response_format` and `structured_outputs`;
            // older releases the `guided_*` fields and `structural_tag`.
            | b"response_format"
            | b"structured_outputs"
            | b"guided_json"
            | b"guided_regex"
            | b"guided_choice"
            | b"guided_grammar"
            | b"guided_whitespace_pattern"
            | b"guided_decoding_backend"
            | b"structural_tag"
    )
}

/// Builds the prefill leg's body from the client's: one token, length-capped, no stream.
///
/// Pure and cheap: no I/O, and the caller's body is never mutated (a new one is returned).
///
/// # Examples
///
/// ```
/// use disagg_json::JsonBody;
/// use disagg_core::request::Api;
/// use disagg_connectors::vllm::rewrite::PrefillRewriter;
///
/// let client = JsonBody::parse(br#"{"model":"m","prompt":"hi","max_tokens":64,"stream":true}"#)?;
/// let prefill = PrefillRewriter::new().rewrite(Api::Completions, &client);
/// assert_eq!(
///     &prefill.to_bytes()[..],
///     br#"{"model":"m","prompt":"hi","max_tokens":1,"stream":false,"ignore_eos":true}"#
/// );
/// # Ok::<(), disagg_json::BodyError>(())
/// ```
#[derive(Debug, Clone)]
pub struct PrefillRewriter {
    ignore_eos: bool,
    limits: VllmLimits,
}

impl Default for PrefillRewriter {
    fn default() -> Self {
        Self::new()
    }
}

impl PrefillRewriter {
    /// The rewriter with every rule of the module table.
    pub fn new() -> Self {
        PrefillRewriter {
            ignore_eos: true,
            limits: VllmLimits::default(),
        }
    }

    /// Check against `limits` (the engines' `--max-logprobs` and
    /// `VLLM_MAX_STOP_STRINGS`) instead of vLLM's defaults.
    pub fn with_limits(mut self, limits: VllmLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The limits the connector's checks apply
    /// ([`check_request`](check::check_request)).
    pub fn limits(&self) -> &VllmLimits {
        &self.limits
    }

    /// Whether to set `ignore_eos: true` (default on). Turn it off only for engines that
    /// reject the field; an EOS first token then loses the KV handoff.
    pub fn with_ignore_eos(mut self, on: bool) -> Self {
        self.ignore_eos = on;
        self
    }

    /// Whether the legs carry `ignore_eos: true` on the routes whose request models
    /// take it ([`with_ignore_eos`](Self::with_ignore_eos); on by default). vLLM
    /// Mooncake serves every request by a decode engine alone without it.
    pub fn ignores_eos(&self) -> bool {
        self.ignore_eos
    }

    /// The prefill leg's body for a client `body` of `api`.
    pub fn rewrite(&self, api: Api, body: &JsonBody) -> JsonBody {
        if api == Api::TokenGenerate {
            return token_in::rewrite(body, self.ignore_eos);
        }
        if api == Api::Messages {
            return messages::rewrite(body);
        }
        if api == Api::Responses {
            return responses::rewrite(body);
        }
        if api == Api::CohereChat {
            return cohere::rewrite(body);
        }
        let mut out = body.clone();
        out.retain(|key| !removed(key));
        out.set_raw("max_tokens", ONE.clone());
        if api == Api::Chat {
            out.set_raw("max_completion_tokens", ONE.clone());
        }
        out.set_raw("stream", bytes::Bytes::from_static(b"false"));
        for field in ["n", "best_of"] {
            if out.get(field).is_some() {
                out.set_raw(field, ONE.clone());
            }
        }
        if self.ignore_eos {
            out.set_raw("ignore_eos", bytes::Bytes::from_static(b"true"));
        }
        out
    }
}

static ONE: bytes::Bytes = bytes::Bytes::from_static(b"1");

/// The body of a leg that releases the KV a prefill handed over (a connector's
/// `release_leg`): the decode leg's `body` of `api`, with its handoff, rewritten as a
/// [default](PrefillRewriter::new) prefill leg, so that the decode engine takes the KV
/// and frees it after one token. Its handoff is the prefill's answer, whose
/// `do_remote_decode` is not truthy, so a Messages body also loses an `enabled`
/// `thinking` block: vLLM 0.33 would check its `budget_tokens` against the leg's
/// `max_tokens` of 1 and refuse the leg (PROTOCOLS §9.3; the leg's token is discarded,
/// and the block only sets a sampling budget).
pub(crate) fn release_body(api: Api, body: &JsonBody) -> JsonBody {
    let mut out = PrefillRewriter::new().rewrite(api, body);
    if api == Api::Messages {
        messages::drop_enabled_thinking(&mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rw(api: Api, body: &str) -> String {
        let b = JsonBody::parse(body.as_bytes()).unwrap();
        let out = PrefillRewriter::new().rewrite(api, &b);
        String::from_utf8(out.to_bytes().to_vec()).unwrap()
    }

    #[test]
    fn chat_sets_both_token_limits_even_when_absent() {
        assert_eq!(
            rw(
                Api::Chat,
                r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#
            ),
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1,"max_completion_tokens":1,"stream":false,"ignore_eos":true}"#
        );
    }

    #[test]
    fn chat_overrides_client_limits_in_place() {
        assert_eq!(
            rw(
                Api::Chat,
                r#"{"max_completion_tokens":500,"messages":[],"max_tokens":100}"#
            ),
            r#"{"max_completion_tokens":1,"messages":[],"max_tokens":1,"stream":false,"ignore_eos":true}"#
        );
    }

    #[test]
    fn completions_do_not_gain_max_completion_tokens() {
        assert_eq!(
            rw(Api::Completions, r#"{"prompt":"p","max_tokens":7}"#),
            r#"{"prompt":"p","max_tokens":1,"stream":false,"ignore_eos":true}"#
        );
    }

    #[test]
    fn stream_forced_off_and_options_removed() {
        assert_eq!(
            rw(
                Api::Completions,
                r#"{"prompt":"p","stream":true,"stream_options":{"include_usage":true}}"#
            ),
            r#"{"prompt":"p","stream":false,"max_tokens":1,"ignore_eos":true}"#
        );
    }

    #[test]
    fn stop_conditions_neutralized() {
        assert_eq!(
            rw(
                Api::Completions,
                r#"{"prompt":"p","stop":["\n"],"stop_token_ids":[2],"include_stop_str_in_output":true,"ignore_eos":false,"min_tokens":5,"min_completion_tokens":5}"#
            ),
            r#"{"prompt":"p","ignore_eos":true,"max_tokens":1,"stream":false}"#
        );
    }

    #[test]
    fn fan_out_and_logprobs_reduced() {
        assert_eq!(
            rw(
                Api::Chat,
                r#"{"messages":[],"n":4,"best_of":8,"logprobs":true,"top_logprobs":5,"prompt_logprobs":1}"#
            ),
            r#"{"messages":[],"n":1,"best_of":1,"max_tokens":1,"max_completion_tokens":1,"stream":false,"ignore_eos":true}"#
        );
        assert_eq!(
            rw(
                Api::Completions,
                r#"{"prompt":"p","echo":true,"logprobs":3}"#
            ),
            r#"{"prompt":"p","max_tokens":1,"stream":false,"ignore_eos":true}"#
        );
    }

    #[test]
    fn prompt_shaping_fields_pass_through_untouched() {
        let body = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"x"}]}],"tools":[{"type":"function"}],"tool_choice":"auto","chat_template_kwargs":{"a":1},"add_generation_prompt":true,"temperature":0.7,"unknown_field":{"deep":[1,2,3]},"user":"u"}"#;
        let out = rw(Api::Chat, body);
        let expect = format!(
            "{},{}",
            &body[..body.len() - 1],
            r#""max_tokens":1,"max_completion_tokens":1,"stream":false,"ignore_eos":true}"#
        );
        assert_eq!(out, expect);
    }

    #[test]
    fn caller_body_is_not_mutated() {
        let b = JsonBody::parse(br#"{"prompt":"p","stream":true,"stop":"x"}"#).unwrap();
        let before = b.to_bytes();
        let _ = PrefillRewriter::new().rewrite(Api::Completions, &b);
        assert_eq!(b.to_bytes(), before);
    }

    #[test]
    fn ignore_eos_can_be_turned_off() {
        let b = JsonBody::parse(br#"{"prompt":"p"}"#).unwrap();
        let out = PrefillRewriter::new()
            .with_ignore_eos(false)
            .rewrite(Api::Completions, &b);
        assert_eq!(
            &out.to_bytes()[..],
            br#"{"prompt":"p","max_tokens":1,"stream":false}"#
        );
    }
}
