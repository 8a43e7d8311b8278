//! What vLLM streams for a decode whose KV load fails, and what SGLang answers (see
//! [SGLang](#sglang) below).
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
//! # SGLang
//!
//! SGLang 0.5.23's decode scheduler aborts a request whose transfer failed
//! (`disaggregation/decode.py`: `KVPoll.Failed` in the handshake or the transfer
//! queue, `prepare_abort` with `HTTPStatus.INTERNAL_SERVER_ERROR`), and its tokenizer
//! manager reads the finish reason `{"type": "abort", "message", "status_code": 500,
//! "err_type": null}` (`FINISH_ABORT.to_json`, `managers/schedule_batch.py`) in
//! `_handle_abort_finish_reason` (`managers/tokenizer_manager.py`): not streamed it
//! raises an `HTTPException(500)`, streamed it yields the aborted output and stops. So,
//! on a decode ([`crate::KvMode::Sglang`]):
//!
//! * **Not streamed** (`/generate`, chat, completions): a 500 whose body is SGLang's
//!   `ErrorResponse`, `{"object":"error","message":…,"type":"500","param":null,
//!   "code":500}` ([`ApiError::in_sglang_shape`]).
//! * **`/generate` streamed**: `serve_generate_request` (`entrypoints/http_server.py`)
//!   returns its `StreamingResponse` before the engine runs, so the 200 head goes out
//!   at once, before the fetch ([`head_first`]); the stream is then one event per
//!   element (`index` in a batch) with no text, no `output_ids` and that abort as
//!   `meta_info.finish_reason`, then `data: [DONE]`
//!   ([`crate::native::aborted_stream`]).
//! * **Chat and completions streamed** (`entrypoints/openai/serving_chat.py`,
//!   `serving_completions.py`): the handler awaits its generator's first output before
//!   it returns the `StreamingResponse` (a "kick-start"), so the 200 head comes with
//!   the failure; an abort whose `status_code` is an `HTTPStatus` becomes one error
//!   event, `data: {"error": {"object": "error", "message": …, "type":
//!   "INTERNAL_SERVER_ERROR", "param": null, "code": 500}}` (`json.dumps`), with no
//!   role chunk; the loop is left with `break`, so the usage chunk still follows when
//!   asked for (no completion token), then `data: [DONE]`.
//!
//! The simulator's message says why, as above; SGLang's is `Decode transfer failed
//! for request rank=… decode_req.req.rid=… decode_req.req.bootstrap_room=… with
//! exception …` (or `Decode handshake failed …`). SGLang's `/v1/messages` and
//! `/v1/responses` keep the simulator's 500 in the head (not modelled here), as does
//! the refusal of a request whose samples share a room (`n` > 1, refused before the
//! fetch). Not modelled either: SGLang with `SGLANG_USE_PICKLE_IPC=0` (msgpack between
//! its processes; pickle is the default), where the status code reaches the chat and
//! completions generators as a plain `int`, no error event is written and the stream
//! ends with a chunk whose `finish_reason` is `"abort"`.
//!
//! # Not modelled (vLLM)
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
use crate::config::{Faults, KvMode};
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
/// `/v1/responses` request to a vLLM engine, or a streamed chat, completions or
/// `/generate` request to an SGLang one ([`sglang_answers`]).
pub(crate) fn streamed(mode: KvMode, request: &CompletionRequest) -> bool {
    if sglang_answers(mode, request) {
        return request.stream;
    }
    let api = !matches!(request.gen_api, Some(GenApi::TokenIn));
    mode.is_vllm() && request.stream && api && request.native.is_none()
}

/// Whether a [`streamed`] request that may fetch KV gets its 200 head before the fetch
/// ([`head_first`]): every such vLLM request, as vLLM returns its stream generator
/// before the engine ran; of SGLang's, only `/generate`'s, whose `StreamingResponse`
/// is returned at once (`entrypoints/http_server.py` `serve_generate_request`), while
/// the chat and completions handlers await their generator's first output before they
/// return theirs (their "kick-start").
pub(crate) fn head_before_kv(mode: KvMode, request: &CompletionRequest) -> bool {
    streamed(mode, request) && (mode.is_vllm() || request.native.is_some())
}

/// Whether a failed KV transfer is answered as SGLang 0.5.23 answers it (see the
/// module's documentation): a request to an SGLang engine on `/generate`, chat or
/// completions. Its other routes (`/v1/messages`, `/v1/responses`) keep the 500 in
/// their head.
fn sglang_answers(mode: KvMode, request: &CompletionRequest) -> bool {
    !mode.is_vllm() && request.gen_api.is_none()
}

/// The answer to a request whose KV load failed with `error`: the stream of [`stream`]
/// where the engine streams the failure ([`streamed`]), else the error itself (answered
/// before any head; in SGLang's shape where SGLang answers it).
pub(crate) fn answer(
    mode: KvMode,
    request: &CompletionRequest,
    error: ApiError,
    ids: StreamIds<'_>,
    guard: RequestGuard,
) -> Result<Response<SimBody>, (ApiError, RequestGuard)> {
    if streamed(mode, request) {
        Ok(stream(mode, request, &error, ids, guard))
    } else if sglang_answers(mode, request) {
        Err((error.in_sglang_shape(), guard))
    } else {
        Err((error, guard))
    }
}

/// The streamed answer of a [`streamed`] request whose KV load failed with `error`: a
/// 200 head, then what the module's documentation says.
pub(crate) fn stream(
    mode: KvMode,
    request: &CompletionRequest,
    error: &ApiError,
    ids: StreamIds<'_>,
    guard: RequestGuard,
) -> Response<SimBody> {
    if sglang_answers(mode, request) {
        return sglang_stream(request, error, ids, guard);
    }
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
        usage_after_error: false,
    };
    sse_response(
        SimBody::Sse(Box::new(SseBody::new(spec, guard))),
        ids.header_id,
    )
}

/// The streamed answer of an SGLang chat, completions or `/generate` request whose KV
/// transfer failed with `error` (the module's documentation): for `/generate`, each
/// element's abort event then `data: [DONE]` ([`crate::native::aborted_stream`]); for
/// chat and completions, SGLang's error event, the usage chunk when asked for (the
/// first aborted element's prompt, no completion token), then `data: [DONE]`.
fn sglang_stream(
    request: &CompletionRequest,
    error: &ApiError,
    ids: StreamIds<'_>,
    guard: RequestGuard,
) -> Response<SimBody> {
    if let Some(native) = request.native {
        let events = crate::native::aborted_stream(request, native, &ids.request_id, error);
        let events = crate::body::Events::Native(Box::new(events));
        let body = EventsBody::new(events, std::time::Duration::ZERO, None, guard);
        return sse_response(SimBody::Events(Box::new(body)), ids.header_id);
    }
    let prompt_tokens = request.prompts.first().map_or(0, |p| p.len() as u64);
    let spec = SseSpec {
        endpoint: request.endpoint,
        id: ids.id,
        created: ids.created,
        model_json: ids.model_json,
        choices: Vec::new(),
        usage: request.include_usage.then_some((prompt_tokens, 0)),
        cached_tokens: None,
        delay: std::time::Duration::ZERO,
        drop_after: None,
        stall_after: None,
        handoff: None,
        prompt_token_ids: None,
        return_token_ids: false,
        choice_prompt_ids: Vec::new(),
        choice_prompt_tokens: Vec::new(),
        error: Some(sglang_stream_event(error)),
        usage_after_error: true,
    };
    sse_response(
        SimBody::Sse(Box::new(SseBody::new(spec, guard))),
        ids.header_id,
    )
}

/// `error` as SGLang 0.5.23 answers an `HTTPException` its tokenizer manager raised for
/// a request its scheduler aborted with a status ([`ApiError::in_sglang_shape`]): its
/// `ErrorResponse` at the top level, `{"object":"error","message":..,"type":"500",
/// "param":null,"code":500}`, the `type` being the status code as a string
/// (`entrypoints/openai/serving_base.py` `handle_request` on the OpenAI routes,
/// `entrypoints/http_server.py`'s `HTTPException` handler on `/generate`).
pub(crate) fn sglang_error_body(error: &ApiError) -> Vec<u8> {
    #[derive(serde::Serialize)]
    struct ErrorResponse<'a> {
        object: &'static str,
        message: &'a str,
        #[serde(rename = "type")]
        kind: String,
        param: Option<&'a str>,
        code: u16,
    }
    let body = ErrorResponse {
        object: "error",
        message: &error.message,
        kind: error.status.as_u16().to_string(),
        param: error.param,
        code: error.status.as_u16(),
    };
    serde_json::to_vec(&body).unwrap_or_default()
}

/// The error event SGLang 0.5.23's chat and completions stream generators write for an
/// output its scheduler aborted with `error`'s status (`create_streaming_error_response`
/// in `entrypoints/openai/serving_base.py`): `{"error": ...}` around its
/// `ErrorResponse`, whose `type` is the status's `HTTPStatus` name
/// (`INTERNAL_SERVER_ERROR`), written by Python's `json.dumps` (its spacing;
/// non-ASCII escaped).
fn sglang_stream_event(error: &ApiError) -> String {
    let name: String = error
        .status
        .canonical_reason()
        .unwrap_or("UNKNOWN")
        .chars()
        .map(|c| match c {
            ' ' | '-' => '_',
            c => c.to_ascii_uppercase(),
        })
        .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    format!(
        r#"{{"error": {{"object": "error", "message": {}, "type": "{name}", "param": null, "code": {}}}}}"#,
        crate::gen_apis::python_json_str(&error.message),
        error.status.as_u16()
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
///
/// `faults` that stop the stream within its opening events
/// ([`Faults::drop_after_chunks`], [`Faults::stall_after_chunks`]) stop the opening
/// there: what is left of it is the body's `work` makes, which applies them, so that the
/// stream puts as many events on the wire before its cut or stall as one whose head
/// waits for its work does.
pub(crate) fn head_first(
    opening: VecDeque<Bytes>,
    faults: &Faults,
    work: impl Future<Output = SimBody> + Send + 'static,
    header_id: Option<&str>,
) -> Response<SimBody> {
    let mut opening = opening;
    let stop = [faults.drop_after_chunks, faults.stall_after_chunks];
    if let Some(n) = stop.into_iter().flatten().min() {
        opening.truncate(n);
    }
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

#[cfg(test)]
mod tests {
    use http::StatusCode;

    use super::*;

    /// The expected texts are Python's: `json.dumps` of SGLang's streamed
    /// `ErrorResponse`, typed by the status's `HTTPStatus` name.
    #[test]
    fn sglang_error_event_is_written_as_json_dumps_writes_it() {
        let message = "KV \"é\" ☃ 𝄞";
        let cases = [
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "INTERNAL_SERVER_ERROR",
                500,
            ),
            (StatusCode::SERVICE_UNAVAILABLE, "SERVICE_UNAVAILABLE", 503),
        ];
        for (status, name, code) in cases {
            let event = sglang_stream_event(&ApiError::new(status, message));
            assert_eq!(
                event,
                format!(
                    r#"{{"error": {{"object": "error", "message": "KV \"\u00e9\" \u2603 \ud834\udd1e", "type": "{name}", "param": null, "code": {code}}}}}"#
                )
            );
        }
        let body = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "é").in_sglang_shape();
        assert_eq!(
            String::from_utf8(body.body()).unwrap(),
            r#"{"object":"error","message":"é","type":"500","param":null,"code":500}"#
        );
    }
}
