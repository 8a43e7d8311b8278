//! The decode's token budget: the client's limit as vLLM reads it, or the rest of the
//! context.

use disagg_json::JsonBody;

use super::Plan;

/// vLLM's `max_tokens` of a completions request without the key (an explicit `null`
/// fails the request: its handler asserts a number).
const COMPLETIONS_MAX_TOKENS: u64 = 16;

/// `key` read as vLLM reads it, pydantic's lax `int` (`"5"`, `5.0`): `None` when absent,
/// `null`, below 0 or no integer (the check refused those where vLLM would).
pub(super) fn int_field(body: &JsonBody, key: &str) -> Option<u64> {
    let n = disagg_json::lax::int_value(body.get(key)?).ok()??;
    u64::try_from(n).ok()
}

/// The client's token limit as vLLM reads it, by the rules a migration's continuation
/// reads it with (`disagg_core`'s `migrate/plan.rs`): chat's `max_completion_tokens`
/// (a 0 falling through, which the check refused already), else `max_tokens`;
/// completions' `max_tokens`, 16 when the key is absent. `None`: the rest of the
/// context (a chat without a limit, a `null` one; vLLM's completions route would fail
/// a `null`, the connector asks for the rest of the context in numbers).
pub(super) fn token_limit(body: &JsonBody, chat: bool) -> Option<u64> {
    if chat {
        int_field(body, "max_completion_tokens")
            .filter(|&m| m != 0)
            .or_else(|| int_field(body, "max_tokens"))
    } else if body.get("max_tokens").is_none() {
        Some(COMPLETIONS_MAX_TOKENS)
    } else {
        int_field(body, "max_tokens")
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
