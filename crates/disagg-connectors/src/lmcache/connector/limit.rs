//! The decode's token budget: the client's limit as vLLM reads it, or the rest of the
//! context.

use disagg_json::JsonBody;
use disagg_json::lax::{self, TokenLimit};

use disagg_core::error::ConnectorError;
use disagg_json::InvalidParam;

use super::{Plan, refused};

/// `key` read as vLLM reads it, pydantic's lax `int` (`"5"`, `5.0`): `None` when absent,
/// `null`, below 0 or no integer (the check refused those where vLLM would).
pub(super) fn int_field(body: &JsonBody, key: &str) -> Option<u64> {
    let n = disagg_json::lax::int_value(body.get(key)?).ok()??;
    u64::try_from(n).ok()
}

/// The client's token limit as vLLM reads it ([`disagg_json::lax::token_limit`], the
/// reading a migration's continuation and the check share): chat's
/// `max_completion_tokens`, else `max_tokens`; completions' `max_tokens`, 16 when the
/// key is absent. `None`: the rest of the context (a chat without a limit, a `null`
/// one; vLLM's completions route would fail a `null`, the connector asks for the rest
/// of the context in numbers), and any value the check refused already (unreadable,
/// below 0).
pub(super) fn token_limit(body: &JsonBody, chat: bool) -> Option<u64> {
    let read = lax::token_limit(
        body.get("max_completion_tokens"),
        body.get("max_tokens"),
        chat,
    );
    match read.ok()?.limit {
        TokenLimit::Tokens { n, .. } => u64::try_from(n).ok(),
        TokenLimit::RestOfContext | TokenLimit::CompletionsNull => None,
    }
}

/// A client without a token limit ([`Plan::max_tokens`] `None`): the tokens of the
/// context left after a prompt of `prompt` tokens, when the context length is known.
pub(super) fn rest_of_context(plan: &Plan, prompt: usize) -> Option<u64> {
    if plan.max_tokens.is_some() {
        return None;
    }
    let prompt = u64::try_from(prompt).unwrap_or(u64::MAX);
    plan.max_model_len.map(|m| m.saturating_sub(prompt))
}

/// Whether the request needs the prefill's context length, which a `/tokenize` of
/// its prompt tells (when the ids were known, remembered for 10 s or asked:
/// [`ContextLengths`](super::context::ContextLengths)): a client without a limit, whose
/// decode gets the rest of the context (and whose `min_tokens` [`check_min_tokens`]
/// holds against it), and one whose limit is above 1, which [`check_limit`] holds
/// against the room the context leaves (a `min_tokens` within a limit the room holds
/// fits it too). The first cannot do without it; the second only goes unchecked
/// without it (a prefill whose `/tokenize` fails). A limit of 1 needs none: the
/// prefill's token meets it and no decode leg is sent, and the prefill refuses a
/// prompt with no room for that token itself. Nor does a `min_tokens` above the limit,
/// which is refused without it.
pub(super) fn needs_context(plan: &Plan) -> bool {
    match plan.max_tokens {
        None => true,
        Some(limit) => limit > 1 && plan.min_tokens.is_none_or(|min| min <= limit),
    }
}

/// The refusal (400) of a client's token limit above the room the context of
/// `max_model_len` tokens (when known) leaves after a prompt of `prompt` ids, as vLLM
/// refuses such a request before generating any (its prompt and limit past the
/// context): [`ConnectorError::Invalid`], `param` `max_tokens` and vLLM's message word
/// for word, as the proxy answers a parameter the engines would refuse. Checked before
/// the prefill runs, and before [`check_min_tokens`] (vLLM checks the limit against the
/// context first): past it, the decode leg (the ids and the prefill's token, the limit
/// less one: as many tokens) would be refused after the client had its first token,
/// the prefill's KV pushed for nothing. A prompt that fills the context is left to the
/// prefill, which refuses it for its length.
pub(super) fn check_limit(
    plan: &Plan,
    prompt: usize,
    max_model_len: Option<u64>,
) -> Result<(), ConnectorError> {
    let (Some(limit), Some(context)) = (plan.max_tokens, max_model_len) else {
        return Ok(());
    };
    let prompt = u64::try_from(prompt).unwrap_or(u64::MAX);
    if prompt < context && limit > context - prompt {
        return Err(ConnectorError::Invalid(InvalidParam::new(
            "max_tokens",
            format!(
                "'max_tokens' or 'max_completion_tokens' is too large: {limit}. This model's maximum context length is {context} tokens and your request has {prompt} input tokens ({limit} > {context} - {prompt}). (parameter=max_tokens, value={limit})"
            ),
        )));
    }
    Ok(())
}

/// The refusal (400) of a `min_tokens` above the tokens the request may generate, as
/// vLLM refuses it before generating any (`SamplingParams`: `min_tokens` at most the
/// resolved `max_tokens`, which is at most the context less the prompt): the client's
/// limit, else the context of `max_model_len` tokens (when known) less a prompt of
/// `prompt` ids. With a limit [`check_limit`] passed, the limit is the lesser. Checked
/// before the prefill runs: past it, the decode leg (`min_tokens - 1` above its
/// `max_tokens`) would be refused after the client had its first token. A prompt that
/// fills the context is left to the prefill, which refuses it for its length.
pub(super) fn check_min_tokens(
    plan: &Plan,
    prompt: usize,
    max_model_len: Option<u64>,
) -> Result<(), ConnectorError> {
    let Some(min) = plan.min_tokens else {
        return Ok(());
    };
    if let Some(limit) = plan.max_tokens.filter(|&m| min > m) {
        return Err(refused(format!(
            "a `min_tokens` of {min} above its token limit ({limit})"
        )));
    }
    let prompt = u64::try_from(prompt).unwrap_or(u64::MAX);
    if let Some(context) = max_model_len.filter(|&m| m > prompt)
        && min > context - prompt
    {
        return Err(refused(format!(
            "a `min_tokens` of {min} above what its context leaves (a context of {context} tokens leaves {} after a prompt of {prompt})",
            context - prompt
        )));
    }
    Ok(())
}
