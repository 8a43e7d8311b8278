//! The limits of a generation request checked before anything is generated: the
//! size of a batch the simulator builds, and vLLM's context check.

use serde_json::Value;

use crate::api::ApiError;

/// Most choices (prompts × `n`) one request may ask for: the simulator builds every
/// choice up front, so an unbounded batch would be an unbounded allocation.
pub(crate) const MAX_CHOICES: u64 = 1024;

/// Most tokens one request may ask to generate, all choices together (prompts × `n` ×
/// the completion's token limit).
pub(crate) const MAX_GENERATED_TOKENS: u64 = 1 << 22;

/// How many prompts a `prompt` (or `text`, `input_ids`) value holds, read before they
/// are tokenized: a list of strings or of lists is a batch, anything else one prompt.
pub(crate) fn batch_len(prompt: Option<&Value>) -> usize {
    match prompt {
        Some(Value::Array(items)) if !items.iter().all(Value::is_number) => items.len(),
        _ => 1,
    }
}

/// Refuses a batch too large to build: more than [`MAX_CHOICES`] choices, or more than
/// [`MAX_GENERATED_TOKENS`] tokens to generate. `n` and `max_tokens` are per prompt.
pub(crate) fn check_batch(prompts: usize, n: u32, max_tokens: u32) -> Result<(), ApiError> {
    let prompts = prompts as u64;
    let choices = prompts.saturating_mul(u64::from(n));
    if choices > MAX_CHOICES {
        return Err(ApiError::bad_request(format!(
            "The request asks for {choices} choices ({prompts} prompts, n={n}); at most {MAX_CHOICES} choices are served per request."
        )));
    }
    let tokens = choices.saturating_mul(u64::from(max_tokens));
    if tokens > MAX_GENERATED_TOKENS {
        return Err(ApiError::bad_request(format!(
            "The request asks for up to {tokens} generated tokens ({choices} choices of up to {max_tokens} tokens); at most {MAX_GENERATED_TOKENS} are served per request."
        )));
    }
    Ok(())
}

/// vLLM's context check of a generation request (`OpenAIServing._validate_input`),
/// prompt by prompt in order: a prompt that fills the context, then a `limit` the
/// room left cannot hold. Each refusal names its `param` and ends as
/// `VLLMValidationError` renders itself: `(parameter=.., value=..)`.
pub(crate) fn check_context(
    prompts: &[Vec<u32>],
    limit: Option<u64>,
    max_model_len: u64,
) -> Result<(), ApiError> {
    for prompt in prompts {
        let n = prompt.len() as u64;
        if n >= max_model_len {
            let mut e = ApiError::bad_request(format!(
                "This model's maximum context length is {max_model_len} tokens. However, your request has {n} input tokens. Please reduce the length of the input messages. (parameter=input_tokens, value={n})"
            ));
            e.param = Some("input_tokens");
            return Err(e);
        }
        if let Some(m) = limit
            && n.saturating_add(m) > max_model_len
        {
            let mut e = ApiError::bad_request(format!(
                "'max_tokens' or 'max_completion_tokens' is too large: {m}. This model's maximum context length is {max_model_len} tokens and your request has {n} input tokens ({m} > {max_model_len} - {n}). (parameter=max_tokens, value={m})"
            ));
            e.param = Some("max_tokens");
            return Err(e);
        }
    }
    Ok(())
}
