//! Which requests may migrate (decided at admission from the body alone), how their
//! decode leg asks for token ids, and the body of a continuation.

use std::sync::Arc;

use bytes::Bytes;
use disagg_json::{lax, raw};

use crate::connector::Leg;
use crate::request::{Api, PdRequest};
use disagg_json::JsonBody;

use super::MigrationConfig;

/// What admission decided about a request's migration: it is eligible, and how its
/// stream is written.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    /// Chat (else completions, or SGLang's `/generate`).
    pub(super) chat: bool,
    /// SGLang's `/generate`: the prompt's ids, from the request's `input_ids` (its
    /// stream carries none of them).
    pub(super) generate: Option<Vec<u32>>,
    /// The client asked for `return_token_ids` itself: the ids stay in its stream.
    pub(super) client_ids: bool,
    /// The client asked for a usage chunk (`stream_options.include_usage`).
    pub(super) usage: bool,
    /// The most tokens the client's request generates, as the engine reads its body
    /// (see [`plan`]). Always a number: a request without one is not eligible (`None`
    /// is never planned).
    pub(super) max_tokens: Option<u64>,
    /// The client's `min_tokens`.
    pub(super) min_tokens: Option<u64>,
    /// The client's body, whose sampling parameters a continuation carries.
    pub(super) body: JsonBody,
}

/// Sampling and stop parameters a continuation carries over from the client's body,
/// and its prefix-cache salt (`cache_salt`: a tenant's cached blocks are shared only
/// with requests of the same salt): the names vLLM's `CompletionRequest` shares with
/// its `ChatCompletionRequest`.
pub(super) const CARRIED: [&str; 22] = [
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "length_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "seed",
    "user",
    "priority",
    "cache_salt",
];

/// How a text prompt is tokenized (vLLM's `CompletionRequest` fields): carried only by
/// a continuation from the client's own prompt, which the engine tokenizes again as
/// the client asked. A token prompt is not tokenized, and would be cut by
/// `truncate_prompt_tokens` (the generated ids are its end).
const TOKENIZING: [&str; 2] = ["add_special_tokens", "truncate_prompt_tokens"];

/// Fields whose state a token prompt cannot carry (structured output, guided decoding,
/// several sequences, beam search, prompt echo, log probabilities, per-chunk usage): a
/// request with any of them set (not `null`, not `false`) is not migrated.
pub(super) const REFUSED: [&str; 14] = [
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_whitespace_pattern",
    "tools",
    "use_beam_search",
    "echo",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "suffix",
    "prompt_embeds",
];

pub(super) fn set(raw: Option<&[u8]>) -> bool {
    raw.is_some_and(|v| {
        let v = v.trim_ascii();
        !(v == b"null" || v == b"false" || v == b"[]")
    })
}

/// A field read as the engine reads an integer (pydantic's lax `int`: `2.0` and `"2"`
/// are 2): `Ok(None)` when absent or `null`; `Err` for a value the engine refuses.
fn int(raw: Option<&[u8]>) -> Result<Option<i64>, lax::Refused> {
    raw.map_or(Ok(None), |v| lax::int_value(v.trim_ascii()))
}

/// A field read as the engine reads a boolean (pydantic's lax `bool`: `1` and `"yes"`
/// are true); a value the engine refuses reads as not set.
fn flag(raw: Option<&[u8]>) -> bool {
    raw.is_some_and(|v| lax::bool_value(v.trim_ascii()) == Ok(Some(true)))
}

/// Whether `req` may be migrated under `config`, decided from its body alone: a
/// streamed chat or completion with one sequence, a numeric token limit, and nothing a
/// token prompt cannot carry ([`REFUSED`]; a `seed` only with
/// [`MigrationConfig::allow_seed`]). Not eligible without a numeric limit (a chat
/// without `max_completion_tokens` or `max_tokens`, a completions `"max_tokens":
/// null`): the continuation goes to the completions API, which fails a `null` limit
/// (vLLM asserts a number), and the proxy does not know the model's context length to
/// ask for the rest of it in numbers.
pub(crate) fn plan(config: &MigrationConfig, req: &PdRequest) -> Option<Plan> {
    if config.limit == 0 || !req.is_stream() {
        return None;
    }
    let chat = match req.api() {
        Api::Chat => true,
        Api::Completions => false,
        Api::Generate => return super::generate::plan(config, req),
        _ => return None,
    };
    let b = req.body();
    if REFUSED.iter().any(|k| set(b.get(k))) {
        return None;
    }
    // `response_format` other than `{"type": "text"}` asks for structured output.
    // Read member by member, not built (a client's field as a `Value` costs up to
    // ~95 bytes per byte).
    if let Some(f) = b.get("response_format").filter(|f| set(Some(f))) {
        let kind = std::str::from_utf8(f)
            .ok()
            .and_then(|f| raw::member(f, "type"))
            .and_then(|t| serde_json::from_str::<String>(t.get()).ok());
        if kind.as_deref() != Some("text") {
            return None;
        }
    }
    // Read as the engine reads them: `"n": 2.0` is two sequences. A value the engine
    // refuses fails the request before any stream; nothing to plan for.
    let (Ok(n), Ok(best_of)) = (int(b.get("n")), int(b.get("best_of"))) else {
        return None;
    };
    if n.is_some_and(|n| n > 1) || best_of.is_some_and(|n| n > 1) {
        return None;
    }
    if !config.allow_seed && set(b.get("seed")) {
        return None;
    }
    if !chat {
        // One prompt: a string or a list of ids, never a batch.
        let prompt = b.get("prompt")?.trim_ascii();
        if prompt.first() == Some(&b'[')
            && matches!(
                prompt[1..].trim_ascii_start().first(),
                Some(b'[' | b'"' | b'{')
            )
        {
            return None;
        }
    }
    let usage = match b.get("stream_options") {
        Some(opts) if set(Some(opts)) => {
            let opts = std::str::from_utf8(opts).ok()?;
            let keys = ["continuous_usage_stats", "include_usage"];
            let [continuous, include] = match raw::members_named(opts, keys) {
                Ok(found) => found.map(|v| flag(v.map(|v| v.get().as_bytes()))),
                // JSON of another type sets neither.
                Err(_) if !raw::is_object(opts) => [false, false],
                Err(_) => return None,
            };
            if continuous {
                return None;
            }
            include
        }
        _ => false,
    };
    // The limit the engine generates to, which the continuation must carry less what
    // was generated, as vLLM resolves it (`lax::token_limit`: chat's
    // `max_completion_tokens or max_tokens`, completions' `max_tokens`, 16 when
    // absent). Without a number (a chat without a limit, a completions `null`): not
    // eligible (see above).
    let limit = lax::token_limit(b.get("max_completion_tokens"), b.get("max_tokens"), chat);
    let (Ok(limit), Ok(min)) = (limit, int(b.get("min_tokens"))) else {
        return None;
    };
    let lax::TokenLimit::Tokens { n, .. } = limit.limit else {
        return None;
    };
    // A negative limit fails the request at the engine; nothing to plan for.
    let max_tokens = Some(u64::try_from(n).ok()?);
    Some(Plan {
        chat,
        generate: None,
        client_ids: flag(b.get("return_token_ids")),
        usage,
        max_tokens,
        min_tokens: min.and_then(|m| u64::try_from(m).ok()),
        body: b.clone(),
    })
}

/// The decode leg of an eligible request, asking for `return_token_ids` when the client
/// did not; `None` when the leg goes as it is (migration off, not eligible, the client
/// asked, or a leg posted to another API than the client's).
pub(crate) fn ask_ids(config: &MigrationConfig, req: &PdRequest, leg: &Leg) -> Option<Leg> {
    // SGLang's `/generate` streams its ids unasked.
    if config.limit == 0 || leg.api.is_some_and(|a| a != req.api()) || req.api() == Api::Generate {
        return None;
    }
    let plan = plan(config, req)?;
    if plan.client_ids {
        return None;
    }
    let mut body = leg.body.clone();
    body.set_raw("return_token_ids", Bytes::from_static(b"true"));
    let mut asked = Leg::new(Arc::clone(&leg.endpoint), body);
    asked.headers = leg.headers.clone();
    asked.api = leg.api;
    Some(asked)
}

/// The continuation's body: the client's sampling parameters, the token prompt `ids`
/// (the prompt's and the generated ones), the token limits less what was generated,
/// streamed with the new ids. With no `ids`, the prompt is the client's own, as it
/// wrote it and tokenized as it asked ([`TOKENIZING`]): a completions request none of
/// whose answer came (nothing generated, its prompt's ids never told).
pub(super) fn continuation_body(
    plan: &Plan,
    ids: Option<&[u32]>,
    generated: u64,
    left: Option<u64>,
) -> Bytes {
    let mut body = JsonBody::default();
    for key in CARRIED {
        if let Some(v) = plan.body.get_bytes(key) {
            body.set_raw(key, v);
        }
    }
    match (ids, plan.body.get_bytes("prompt")) {
        (Some(ids), _) => body.set("prompt", ids),
        (None, Some(prompt)) => {
            body.set_raw("prompt", prompt);
            for key in TOKENIZING {
                if let Some(v) = plan.body.get_bytes(key) {
                    body.set_raw(key, v);
                }
            }
        }
        // A completions request has a prompt (`plan` read it).
        (None, None) => {}
    }
    // Never `null`, which vLLM's completions API fails on; a plan always has a limit
    // ([`plan`]), so `left` is always a number.
    if let Some(left) = left {
        body.set("max_tokens", &left);
    }
    if let Some(min) = plan.min_tokens {
        body.set("min_tokens", &min.saturating_sub(generated));
    }
    body.set_raw("stream", Bytes::from_static(b"true"));
    body.set_raw("return_token_ids", Bytes::from_static(b"true"));
    if plan.usage {
        body.set_raw(
            "stream_options",
            Bytes::from_static(b"{\"include_usage\":true}"),
        );
    }
    body.to_bytes()
}
