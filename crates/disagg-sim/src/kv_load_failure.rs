//! What vLLM streams for a decode whose KV load fails.
//!
//! With `kv_load_failure_policy="fail"` (vLLM 0.33's default, `vllm/config/kv_transfer.py`)
//! a connector reports the blocks it could not load (`get_block_ids_with_load_errors`:
//! NIXL's `_handle_failed_transfer`, Mooncake's `_handle_failed_recv`) and the scheduler
//! finishes the request with `FINISHED_ERROR`: one output, no token, finish reason
//! `error` (`vllm/v1/engine/__init__.py` `FinishReason.ERROR`). The serving layer turns
//! that into its `GenerationError("Internal server error")`, a 500
//! `InternalServerError` (`vllm/entrypoints/generate/base/serving.py`
//! `_raise_if_error`). Not streamed, that is the answer. Streamed, Starlette's
//! `StreamingResponse` sent the 200 head before the stream generator ran, and:
//!
//! * **Chat** (`vllm/entrypoints/openai/chat_completion/serving.py`
//!   `chat_completion_stream_generator`): the first output writes every choice's role
//!   chunk (the prompt's ids on the first with `return_token_ids`, `usage` on each
//!   with continuous usage), then raises: one error event in the error shape, no token
//!   chunk, no usage chunk, then `data: [DONE]`.
//! * **Completions** (`vllm/entrypoints/openai/completion/serving.py`
//!   `completion_stream_generator`): an output with no text and no token is skipped
//!   ("chunked prefill case") before its finish reason is looked at, so the stream ends
//!   normally with no chunk of the answer: only the usage chunk (prompt tokens, no
//!   completion token) when usage was asked for, then `data: [DONE]`. With `echo`
//!   the echoed prompt is text to send, the check is reached, and the stream is the
//!   error event, then `data: [DONE]`.
//!
//! The error's message is the simulator's (`"KV transfer failed: ..."`, saying why);
//! vLLM's says `"Internal server error"`.

use http::Response;
use http::header::{CONTENT_TYPE, HeaderValue};
use serde_json::Value;

use crate::api::{ApiError, CompletionRequest};
use crate::body::{Endpoint, SimBody, SseBody, SseSpec};
use crate::config::KvMode;
use crate::generate::{Finish, Generation};
use crate::stats::RequestGuard;

/// The identity of a streamed answer, as its chunks and head name it.
#[derive(Debug)]
pub(crate) struct StreamIds<'a> {
    /// `chatcmpl-…` or `cmpl-…`.
    pub(crate) id: String,
    pub(crate) created: u64,
    /// The model the answer names, JSON-encoded.
    pub(crate) model_json: String,
    /// The request's `X-Request-Id`, echoed in the head.
    pub(crate) header_id: Option<&'a str>,
}

/// Whether a request whose KV load failed is answered with a stream
/// ([`stream`]): a streamed chat or completions request to a vLLM engine.
pub(crate) fn streamed(mode: KvMode, request: &CompletionRequest) -> bool {
    mode.is_vllm() && request.stream && request.gen_api.is_none() && request.native.is_none()
}

/// The streamed answer of a vLLM chat or completions request whose KV load failed with
/// `error`: a 200 head, then what the module's documentation says.
pub(crate) fn stream(
    request: &CompletionRequest,
    error: &ApiError,
    ids: StreamIds<'_>,
    guard: RequestGuard,
) -> Response<SimBody> {
    let chat = request.endpoint == Endpoint::Chat;
    // Chat has one prompt: its `n` choices get their role chunks.
    let choices = if chat {
        (0..request.n).map(|_| no_tokens()).collect()
    } else {
        Vec::new()
    };
    let error_event = chat || request.echo;
    let event = error_event.then(|| String::from_utf8_lossy(&error.body()).into_owned());
    let usage = (!error_event && request.include_usage).then_some((request.prompt_tokens, 0));
    let prompt_token_ids = (chat && request.return_token_ids)
        .then(|| Value::from(request.prompts.first().cloned().unwrap_or_default()).to_string());
    let choice_prompt_tokens = if chat && request.continuous_usage {
        let prompt = request.prompts.first().map_or(0, |p| p.len() as u64);
        vec![prompt; request.n as usize]
    } else {
        Vec::new()
    };
    let spec = SseSpec {
        endpoint: request.endpoint,
        id: ids.id,
        created: ids.created,
        model_json: ids.model_json,
        choices,
        usage,
        cached_tokens: None,
        delay: std::time::Duration::ZERO,
        drop_after: None,
        stall_after: None,
        handoff: None,
        prompt_token_ids,
        return_token_ids: request.return_token_ids,
        choice_prompt_ids: Vec::new(),
        choice_prompt_tokens,
        error: event,
    };
    let mut response = Response::new(SimBody::Sse(Box::new(SseBody::new(spec, guard))));
    let headers = response.headers_mut();
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    if let Some(value) = ids.header_id.and_then(|r| HeaderValue::from_str(r).ok()) {
        headers.insert("x-request-id", value);
    }
    response
}

/// A choice that generated nothing.
fn no_tokens() -> Generation {
    Generation {
        steps: Vec::new(),
        ids: Vec::new(),
        finish: Finish::Stop,
        stop_reason: None,
    }
}
