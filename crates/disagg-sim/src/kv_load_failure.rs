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
//!   chunk (each with the prompt's ids given `return_token_ids`, `usage` on each with
//!   continuous usage), then raises: one error event in the error shape, no token
//!   chunk, no usage chunk, then `data: [DONE]`.
//! * **Completions** (`vllm/entrypoints/openai/completion/serving.py`
//!   `completion_stream_generator`): an output with no text and no token is skipped
//!   ("chunked prefill case") before its finish reason is looked at, so the stream ends
//!   normally with no chunk of the answer: only the usage chunk (prompt tokens, no
//!   completion token) when usage was asked for, then `data: [DONE]`. With `echo`
//!   the echoed prompt is text to send, the check is reached, and the stream is the
//!   error event, then `data: [DONE]`. Given `"max_tokens": null`, the generator's
//!   `assert request.max_tokens is not None`, which comes before both, fails first:
//!   the stream is that error event ([`crate::null_limit`]), then `data: [DONE]`, no
//!   usage chunk, echo or not.
//! * **Messages** (`/v1/messages`, `vllm/entrypoints/anthropic/serving.py`): the route
//!   streams the chat generator's chunks (`chat_completion_stream_generator_raw`,
//!   with continuous usage) through `message_stream_converter`. The role chunk becomes
//!   `message_start` (the prompt's tokens as its usage); the generator's
//!   `ErrorResponse` then ends the stream with `event: error`,
//!   `{"type":"error","error":{"type","message"}}`, typed after its status
//!   (`translate_error_type` in `anthropic/protocol.py`: 500 is `api_error`). No content
//!   block was opened, and nothing follows: no `message_stop`, no `[DONE]`.
//! * **Cohere** (`/cohere/v2/chat`, `vllm/entrypoints/cohere/serving.py`
//!   `_chat_completion_stream_to_v2`): the route converts the chat generator's chunks
//!   into bare `data:` events (no `event:` field). The role chunk becomes
//!   `message-start`, `{"id":"chatcmpl-…","delta":{"message":{"role":"assistant"}},
//!   "type":"message-start"}` (pydantic's `model_dump_json(exclude_none=True)` of vLLM's
//!   `MessageStartEvent`, `cohere/protocol.py`: the Cohere SDK's `ChatMessageStartEvent`
//!   fields `id` and `delta` first, then the `type` vLLM's subclass adds). The
//!   generator's error event then fails the converter's
//!   `ChatCompletionStreamResponse.model_validate_json`, and its `except` writes
//!   `{"type": "message-end", "delta": {"error": "…", "finish_reason": "ERROR"}}` with
//!   `json.dumps` (its spacing; non-ASCII escaped), then `data: [DONE]`. vLLM's
//!   `delta.error` is pydantic's validation error for the error payload (through
//!   `sanitize_message`); the simulator's is its own message of the failed load, as
//!   below.
//! * **Responses** (`/v1/responses`, `vllm/entrypoints/openai/responses/serving.py`
//!   `responses_stream_generator`): `response.created` and `response.in_progress` (the
//!   response `in_progress`, no output, `sequence_number` 0 and 1) are yielded before
//!   the engine's first output, so they go out with the head, before the load is tried.
//!   The failed output's `_raise_if_error` (in `_process_simple_streaming_events`)
//!   raises the `GenerationError`, whose handler validates the error payload
//!   (`_convert_generation_error_to_streaming_response`) as a
//!   `StreamingResponsesResponse`: that union of event types has no member for
//!   `{"error": {...}}`, so a pydantic `ValidationError` leaves the generator and the
//!   route's `_convert_stream_to_sse_events` (`responses/api_router.py`, which catches
//!   nothing). Starlette's response had started: uvicorn closes the connection. The
//!   client sees the two events, then the connection cut off, the chunked body
//!   unfinished: no error event, no `response.failed`, no `[DONE]`. The simulator cuts
//!   its connection likewise.
//!
//! The same holds whatever connector failed the load: NIXL (pull or push), Mooncake,
//! and LMCache, whose vLLM connector forwards its engine's
//! `get_block_ids_with_load_errors` (KV received on some ranks only is such a load
//! error here). The error's message is the simulator's (`"KV transfer failed: ..."` or
//! LMCache's `"KV cache for this request has not arrived (...)"`, saying why); vLLM's
//! says `"Internal server error"` (and a Responses stream writes none).
//!
//! The head comes first as vLLM's does: a streamed chat, completions, `/v1/messages`,
//! `/cohere/v2/chat` or `/v1/responses` request that a vLLM decode may fetch KV for gets
//! its 200 head once its request was read and checked (a Responses request's two
//! opening events with it), and the KV's wait is its body's ([`head_first`]): the
//! stream of a served answer, or the failure's above, follows when the fetch ends (a
//! peer that never answers: after [`crate::SimConfig::bootstrap_timeout`]). Those are
//! the requests to a NIXL pull decode with `do_remote_prefill` and block ids (one whose
//! handoff a fault loses, then prefilled here, included), to a NIXL push decode whose
//! parameters name its prefill, to a Mooncake decode naming a transfer, those that
//! wait for KV nobody sends (invalid parameters, NIXL or Mooncake), and every request
//! to an LMCache decode (one LMCache finds no KV for, then prefilled here, included). A
//! request refused before vLLM returns its generator (a bad field, an unknown
//! data-parallel rank, a fault's status) is still refused in its head. A client that
//! leaves meanwhile drops the fetch, and the request counts as cancelled (a NIXL decode
//! tells its prefill to free the blocks, as on any abort before the pull ended).
//!
//! Not modelled:
//!
//! * the engine core's death on a NIXL decode's `remote_block_ids` that name no block
//!   (`assert num_external_tokens == 0` in vLLM's scheduler, after the head): the
//!   simulator answers that request's 500 in its head;
//! * likewise the engine core's death on a NIXL push decode whose parameters lack a key
//!   its scheduler indexes (the `KeyError` of `update_state_after_alloc`, after vLLM's
//!   head): the simulator answers its 500 in its head;
//! * an E/P/D push consumer's wait for its encoder outputs (up to
//!   [`crate::SimConfig::ec_push_wait`]): vLLM's engine waits after the head, the
//!   simulator before it (and refuses a failed wait in its head, not in a stream);
//! * the head of any other streamed request (no remote KV, a NIXL push decode whose
//!   parameters are invalid and so prefills here): vLLM sends it at once too, the
//!   simulator only after the request's queueing ([`crate::SimConfig::max_num_seqs`],
//!   [`crate::SimConfig::request_delay`]) and local prefill;
//! * `/inference/v1/generate` (vLLM's token-in route): refused in its head, as before
//!   the engine was asked;
//! * a served Cohere stream's `message-start`: the simulator's has
//!   `"content": []` and its keys sorted; vLLM's is the failure's above, on every
//!   stream;
//! * a Messages stream's `message_start`: vLLM's id is the chat chunk's
//!   (`chatcmpl-…`), the simulator's `msg_…`; vLLM writes it without the defaults
//!   `"type": "message"` and `"role": "assistant"` (`exclude_unset`) and with `type`
//!   first, the simulator with both and its keys sorted, as on a served stream (the
//!   error event that follows is written in vLLM's order, `type` first);
//! * chat's `echo`: vLLM writes, after the role chunks, one chunk per choice echoing
//!   the last message's content when that message's role is the answer's (an
//!   assistant prefix); the simulator writes none, here as on a served stream;
//! * completions' `echo` with `logprobs`: vLLM builds logprobs for the echoed prompt
//!   of the failed output before its finish reason is read (and fails its own way
//!   when the prompt's logprobs are missing); the simulator streams the load's error
//!   event as for `echo` alone.

use std::collections::VecDeque;

use bytes::Bytes;
use http::Response;
use http::header::{CONTENT_TYPE, HeaderValue};
use serde_json::Value;

use crate::api::{ApiError, CompletionRequest};
use crate::body::{Endpoint, EventsBody, SimBody, SseBody, SseSpec};
use crate::config::KvMode;
use crate::gen_apis::GenApi;
use crate::generate::{Finish, Generation};
use crate::stats::RequestGuard;

/// The identity of a streamed answer, as its chunks and head name it.
#[derive(Debug)]
pub(crate) struct StreamIds<'a> {
    /// `chatcmpl-…` or `cmpl-…`.
    pub(crate) id: String,
    /// The engine's request id the answer's id is made of (a Messages answer's
    /// `msg_…`).
    pub(crate) request_id: String,
    pub(crate) created: u64,
    /// The model the answer names, JSON-encoded.
    pub(crate) model_json: String,
    /// The request's `X-Request-Id`, echoed in the head.
    pub(crate) header_id: Option<&'a str>,
}

/// Whether a request whose KV load failed is answered with a stream
/// ([`stream`]): a streamed chat, completions, `/v1/messages`, `/cohere/v2/chat` or
/// `/v1/responses` request to a vLLM engine. Such a request's head goes out before its
/// KV is loaded ([`head_first`]).
pub(crate) fn streamed(mode: KvMode, request: &CompletionRequest) -> bool {
    let api = !matches!(request.gen_api, Some(GenApi::TokenIn));
    mode.is_vllm() && request.stream && api && request.native.is_none()
}

/// The answer to a request whose KV load failed with `error`: the stream of [`stream`]
/// where vLLM streams the failure ([`streamed`]), else the error itself (answered
/// before any head).
pub(crate) fn answer(
    mode: KvMode,
    request: &CompletionRequest,
    error: ApiError,
    ids: StreamIds<'_>,
    guard: RequestGuard,
) -> Result<Response<SimBody>, (ApiError, RequestGuard)> {
    if streamed(mode, request) {
        Ok(stream(request, &error, ids, guard))
    } else {
        Err((error, guard))
    }
}

/// The streamed answer of a [`streamed`] request whose KV load failed with `error`: a
/// 200 head, then what the module's documentation says.
pub(crate) fn stream(
    request: &CompletionRequest,
    error: &ApiError,
    ids: StreamIds<'_>,
    guard: RequestGuard,
) -> Response<SimBody> {
    match request.gen_api {
        Some(GenApi::Messages) => return messages_stream(request, error, ids, guard),
        Some(GenApi::Cohere) => {
            let events = crate::gen_apis::failed_cohere_events(&ids.request_id, error);
            let body = EventsBody::new(events, std::time::Duration::ZERO, None, guard);
            return sse_response(SimBody::Events(Box::new(body)), ids.header_id);
        }
        Some(GenApi::Responses) => return responses_stream(request, ids, guard),
        None | Some(GenApi::TokenIn) => {}
    }
    let chat = request.endpoint == Endpoint::Chat;
    // Chat has one prompt: its `n` choices get their role chunks.
    let choices = if chat {
        (0..request.n).map(|_| no_tokens()).collect()
    } else {
        Vec::new()
    };
    // The null-limit assertion fails on the output before anything else reads it.
    let null_limit = !chat && request.null_max_tokens;
    let error_event = chat || request.echo || null_limit;
    let event = if null_limit {
        Some(crate::null_limit::error().body())
    } else {
        error_event.then(|| error.body())
    }
    .map(|body| String::from_utf8_lossy(&body).into_owned());
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
    sse_response(
        SimBody::Sse(Box::new(SseBody::new(spec, guard))),
        ids.header_id,
    )
}

/// The streamed answer of a `/v1/messages` request whose KV load failed with `error`
/// ([`crate::gen_apis::failed_messages_events`]).
fn messages_stream(
    request: &CompletionRequest,
    error: &ApiError,
    ids: StreamIds<'_>,
    guard: RequestGuard,
) -> Response<SimBody> {
    let model = serde_json::from_str::<Value>(&ids.model_json).unwrap_or(Value::Null);
    let events = crate::gen_apis::failed_messages_events(
        &ids.request_id,
        &model,
        request.prompt_tokens,
        error,
    );
    let body = EventsBody::new(events, std::time::Duration::ZERO, None, guard);
    sse_response(SimBody::Events(Box::new(body)), ids.header_id)
}

/// The streamed answer of a `/v1/responses` request whose KV load failed: the events
/// vLLM's generator yielded before the engine's first output
/// ([`crate::gen_apis::opening_events`]), then the connection cut off, the body
/// unfinished (what the module's documentation says).
fn responses_stream(
    request: &CompletionRequest,
    ids: StreamIds<'_>,
    guard: RequestGuard,
) -> Response<SimBody> {
    let model = serde_json::from_str::<String>(&ids.model_json).unwrap_or_default();
    let events = crate::gen_apis::opening_events(request, &model, &ids.request_id);
    let body = EventsBody::new(events, std::time::Duration::ZERO, None, guard).aborting_at_end();
    sse_response(SimBody::Events(Box::new(body)), ids.header_id)
}

/// The answer of a [`streamed`] request that may fetch KV (which ones: the module's
/// documentation): the 200 `text/event-stream` head at once, with the events its stream
/// opens with whatever its engine outputs (`opening`:
/// [`crate::gen_apis::opening_events`]), then the body `work` makes (the KV's wait, and
/// the answer or the failure's [`stream`]) less those events. vLLM 0.33 returns such a
/// request's stream generator before the engine tried the load, and Starlette's
/// `StreamingResponse` sends its head then, and each event the generator yields before
/// it awaits the engine. A client leaving meanwhile drops `work` where it stands, as
/// vLLM aborts the request.
pub(crate) fn head_first(
    opening: VecDeque<Bytes>,
    work: impl Future<Output = SimBody> + Send + 'static,
    header_id: Option<&str>,
) -> Response<SimBody> {
    let sent = opening.len();
    let work = async move { work.await.skipping_events(sent) };
    let deferred = crate::body::Deferred::new(opening, Box::pin(work));
    sse_response(SimBody::Deferred(Box::new(deferred)), header_id)
}

/// A 200 `text/event-stream` answer with `body`, echoing the request's `X-Request-Id`.
pub(crate) fn sse_response(body: SimBody, header_id: Option<&str>) -> Response<SimBody> {
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    if let Some(value) = header_id.and_then(|r| HeaderValue::from_str(r).ok()) {
        headers.insert("x-request-id", value);
    }
    response
}

/// A choice that generated nothing.
pub(crate) fn no_tokens() -> Generation {
    Generation {
        steps: Vec::new(),
        ids: Vec::new(),
        finish: Finish::Stop,
        stop_reason: None,
    }
}
