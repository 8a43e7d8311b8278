//! The generation routes vLLM 0.33 takes a KV handoff on besides chat and completions,
//! served by an engine in a vLLM [`KvMode`](crate::KvMode) over the same model, the
//! same KV protocols and the same counters as chat.
//!
//! Each route's body is read by its own request model, then served as the chat or
//! completion request vLLM's handler makes of it; the answer is written in the route's
//! own format. A prefill leg answers with the top-level `kv_transfer_params` of its
//! non-streaming answer; a decode leg pulls the KV its `kv_transfer_params` name, so a
//! wrong handoff fails as on chat.
//!
//! | route | request model | answer |
//! |---|---|---|
//! | `POST /v1/messages` (vLLM `vllm/entrypoints/anthropic/`) | `model`, `messages`, `max_tokens` (required, above 0), `system`, `stop_sequences`, `stream`, `temperature`, `thinking` (`budget_tokens` below `max_tokens` unless `kv_transfer_params.do_remote_decode`), `kv_transfer_params`; served as chat (`image` blocks as `image_url` parts of the URL vLLM builds from their `source`) | `{"id", "type": "message", "role", "model", "content": [{"type": "text", "text"}], "stop_reason", "stop_sequence", "usage", "kv_transfer_params"?}` (no key without a handoff); streamed, `event:`/`data:` pairs `message_start`, `content_block_start`, a `content_block_delta` per token, `content_block_stop`, `message_delta`, `message_stop`, no handoff; errors `{"type": "error", "error": {"type", "message"}}`, `type` by status, but a body the request model refuses gets OpenAI's shape |
//! | `POST /v1/responses` (vLLM `vllm/entrypoints/openai/responses/`) | `input` (required), `instructions`, `max_output_tokens`, `stream`, `kv_transfer_params` (see `surface.rs`); served as the completion of the instructions and input | the Responses object (`surface.rs`), the handoff top-level in a whole answer and in the terminal event's `response` of a stream (new in 0.33); a stream's `response.created` and `response.in_progress` go out with a KV-fetching decode's head, and a failed KV load then cuts the connection off (`kv_load_failure.rs`) |
//! | `POST /cohere/v2/chat` (vLLM `vllm/entrypoints/cohere/`) | `messages` (required), `max_tokens` (nullable), `stop_sequences`, `stream`, `temperature`, `kv_transfer_params`; served as chat | `{"id", "finish_reason" (`MAX_TOKENS`, `COMPLETE`, `STOP_SEQUENCE`), "message": {"role", "content": [{"type": "text", "text"}]}, "usage", "kv_transfer_params"?}`; streamed, bare `data:` events `message-start`, `content-start`, a `content-delta` per token, `content-end`, `message-end`, then `data: [DONE]`, no handoff (a failed KV load: `message-start`, `message-end` with `delta.error` and `finish_reason` `ERROR`, `[DONE]`: `kv_load_failure.rs`); errors `{"message", "id"}`, but a body the request model refuses gets OpenAI's shape |
//! | `POST /inference/v1/generate` (vLLM `vllm/entrypoints/scale_out/token_in_token_out/`) | `token_ids` (required), `sampling_params` (required; `max_tokens` defaults to 16), `stream`, `stream_options`, `kv_transfer_params` | `{"request_id", "choices": [{"index", "logprobs", "finish_reason", "token_ids", "routed_experts"}], "prompt_logprobs", "kv_transfer_params"}`; streamed, one `data:` chunk per token with that token's id (`finish_reason` on the last), then `data: [DONE]`, no handoff |

use std::collections::VecDeque;

use bytes::Bytes;
use serde_json::{Map, Value, json};

use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Response, StatusCode};

use crate::SimConfig;
use crate::api::{ApiError, CompletionRequest};
use crate::body::{Endpoint, EventsBody, SimBody};
use crate::config::Faults;
use crate::generate::Generation;
use crate::stats::RequestGuard;

/// `SamplingParams.max_tokens`' default (`vllm/sampling_params.py`).
const SAMPLING_DEFAULT_MAX_TOKENS: u64 = 16;

/// A generation route other than chat and completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GenApi {
    /// `POST /inference/v1/generate`.
    TokenIn,
    /// `POST /v1/messages`.
    Messages,
    /// `POST /v1/responses`.
    Responses,
    /// `POST /cohere/v2/chat`.
    Cohere,
}

/// Marks an error response whose body the route's request model refused: OpenAI's
/// shape on every route ([`reshape`] leaves it).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RequestModel;

impl GenApi {
    /// Whether SGLang 0.5.23 serves the route too (with its bootstrap fields:
    /// `srt/entrypoints/openai/protocol.py` `PDRoutingFields`).
    pub(crate) fn on_sglang(self) -> bool {
        matches!(self, GenApi::Messages | GenApi::Responses)
    }

    /// The route's API served at `path`, if any.
    pub(crate) fn of_path(path: &str) -> Option<GenApi> {
        match path {
            "/inference/v1/generate" => Some(GenApi::TokenIn),
            "/v1/messages" => Some(GenApi::Messages),
            "/v1/responses" => Some(GenApi::Responses),
            "/cohere/v2/chat" => Some(GenApi::Cohere),
            _ => None,
        }
    }
}

/// Parses `body` with the route's request model into the request vLLM's handler makes
/// of it.
pub(crate) fn parse(
    api: GenApi,
    body: &Value,
    config: &SimConfig,
    loras: &crate::surface::Loras,
) -> Result<CompletionRequest, ApiError> {
    let Some(obj) = body.as_object() else {
        return Err(ApiError::bad_request(
            "Input should be a valid dictionary or object to extract fields from",
        ));
    };
    let mut responses = None;
    let (endpoint, inner) = match api {
        GenApi::TokenIn => (Endpoint::Completions, token_in_body(obj)?),
        GenApi::Messages => (Endpoint::Chat, messages_body(obj)?),
        GenApi::Cohere => (Endpoint::Chat, cohere_body(obj)?),
        GenApi::Responses => {
            let read = crate::surface::responses_request(body, config, loras)?;
            let mut out = Map::new();
            for key in ["model", "kv_transfer_params"] {
                if let Some(v) = obj.get(key) {
                    out.insert(key.to_owned(), v.clone());
                }
            }
            out.insert("prompt".to_owned(), json!(read.prompt));
            out.insert("stream".to_owned(), json!(read.stream));
            if let Some(m) = read.max_output_tokens {
                out.insert("max_tokens".to_owned(), json!(m));
            }
            responses = Some(Box::new(read));
            (Endpoint::Completions, out)
        }
    };
    let mut request = CompletionRequest::parse(endpoint, &Value::Object(inner), config, loras)?;
    request.gen_api = Some(api);
    request.responses = responses;
    Ok(request)
}

/// A token-in body as the completion it is served as: the prompt is `token_ids`, the
/// sampling fields those of `sampling_params`.
fn token_in_body(obj: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    let ids = match obj.get("token_ids") {
        None => return Err(ApiError::bad_request("token_ids: Field required")),
        Some(Value::Array(ids)) if !ids.is_empty() => Value::Array(ids.clone()),
        Some(Value::Array(_)) => {
            return Err(ApiError::bad_request("token_ids: the prompt is empty"));
        }
        Some(_) => {
            return Err(ApiError::bad_request(
                "token_ids: Input should be a valid list",
            ));
        }
    };
    let sampling = match obj.get("sampling_params") {
        None => return Err(ApiError::bad_request("sampling_params: Field required")),
        Some(Value::Object(s)) => s,
        Some(_) => {
            return Err(ApiError::bad_request(
                "sampling_params: Input should be a valid dictionary",
            ));
        }
    };
    let mut out = Map::new();
    for key in ["model", "stream", "stream_options", "kv_transfer_params"] {
        if let Some(v) = obj.get(key) {
            out.insert(key.to_owned(), v.clone());
        }
    }
    out.insert("prompt".to_owned(), ids);
    for (key, value) in sampling {
        out.insert(key.clone(), value.clone());
    }
    if !sampling.contains_key("max_tokens") {
        out.insert("max_tokens".to_owned(), json!(SAMPLING_DEFAULT_MAX_TOKENS));
    }
    Ok(out)
}

/// A Messages body as the chat request vLLM's Anthropic handler makes of it
/// (`anthropic/serving.py`): `system` first, `max_tokens` for both chat limits,
/// `stop_sequences` as `stop`.
fn messages_body(obj: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    let max_tokens = match obj.get("max_tokens") {
        None => return Err(ApiError::bad_request("max_tokens: Field required")),
        Some(m) => match m.as_i64() {
            Some(m) if m > 0 => m,
            Some(_) => {
                return Err(ApiError::bad_request(
                    "max_tokens: Input should be greater than 0",
                ));
            }
            None => {
                return Err(ApiError::bad_request(
                    "max_tokens: Input should be a valid integer",
                ));
            }
        },
    };
    let Some(Value::Array(turns)) = obj.get("messages") else {
        return Err(ApiError::bad_request(
            "messages: Field required (a list of messages)",
        ));
    };
    let remote_decode = obj
        .get("kv_transfer_params")
        .and_then(|p| p.get("do_remote_decode"))
        .is_some_and(|d| crate::api::truthy(Some(d)));
    if let Some(thinking) = obj.get("thinking").filter(|t| !t.is_null())
        && thinking.get("type").and_then(Value::as_str) == Some("enabled")
        && let Some(budget) = thinking.get("budget_tokens").and_then(Value::as_i64)
        && budget >= max_tokens
        && !remote_decode
    {
        return Err(ApiError::bad_request(
            "thinking.budget_tokens must be less than max_tokens",
        ));
    }
    let mut messages = Vec::with_capacity(turns.len() + 1);
    if let Some(system) = obj.get("system").filter(|s| !s.is_null()) {
        messages.push(json!({"role": "system", "content": system}));
    }
    messages.extend(turns.iter().map(chat_turn));
    let mut out = Map::new();
    for key in ["model", "stream", "temperature", "kv_transfer_params"] {
        if let Some(v) = obj.get(key) {
            out.insert(key.to_owned(), v.clone());
        }
    }
    out.insert("messages".to_owned(), Value::Array(messages));
    out.insert("max_tokens".to_owned(), json!(max_tokens));
    if let Some(stop) = obj.get("stop_sequences").filter(|s| !s.is_null()) {
        out.insert("stop".to_owned(), stop.clone());
    }
    Ok(out)
}

/// A Messages turn as chat: its `image` blocks become `image_url` parts of the URL vLLM
/// builds from their source (`anthropic/serving.py`, `_convert_block`).
fn chat_turn(turn: &Value) -> Value {
    let Some(Value::Array(blocks)) = turn.get("content") else {
        return turn.clone();
    };
    let mut turn = turn.clone();
    let content = blocks
        .iter()
        .map(
            |b| match (b.get("type").and_then(Value::as_str), b.get("source")) {
                (Some("image"), Some(source)) => json!({"type": "image_url",
                "image_url": {"url": crate::ec::anthropic_image_url(source)}}),
                _ => b.clone(),
            },
        )
        .collect();
    turn["content"] = Value::Array(content);
    turn
}

/// A Cohere chat body as the chat request vLLM's handler makes of it: `max_tokens`
/// (when not `null`) for both chat limits, `stop_sequences` as `stop`.
fn cohere_body(obj: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    if !matches!(obj.get("messages"), Some(Value::Array(_))) {
        return Err(ApiError::bad_request(
            "messages: Field required (a list of messages)",
        ));
    }
    let mut out = Map::new();
    for key in [
        "model",
        "messages",
        "stream",
        "temperature",
        "kv_transfer_params",
    ] {
        if let Some(v) = obj.get(key) {
            out.insert(key.to_owned(), v.clone());
        }
    }
    if let Some(m) = obj.get("max_tokens").filter(|m| !m.is_null()) {
        out.insert("max_tokens".to_owned(), m.clone());
    }
    if let Some(stop) = obj.get("stop_sequences").filter(|s| !s.is_null()) {
        out.insert("stop".to_owned(), stop.clone());
    }
    Ok(out)
}

/// Anthropic's error `type` for `status` (`vllm/entrypoints/anthropic/protocol.py`).
fn anthropic_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        500..=599 => "api_error",
        _ => "invalid_request_error",
    }
}

/// An error answer of `api`'s route in that route's own shape: the OpenAI-shaped
/// `response` rewritten, unless its request model refused the body ([`RequestModel`]).
pub(crate) async fn reshape(api: GenApi, response: Response<SimBody>) -> Response<SimBody> {
    use http_body_util::BodyExt;
    if !matches!(api, GenApi::Messages | GenApi::Cohere)
        || response.status().is_success()
        || response.extensions().get::<RequestModel>().is_some()
    {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let bytes = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let message = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or_default();
    let body = match api {
        GenApi::Cohere => {
            let id = parts
                .headers
                .get("x-request-id")
                .and_then(|v| v.to_str().ok());
            json!({"message": message, "id": id})
        }
        _ => json!({
            "type": "error",
            "error": {"type": anthropic_type(parts.status), "message": message},
        }),
    };
    parts.headers.remove(http::header::CONTENT_LENGTH);
    Response::from_parts(parts, SimBody::full(body.to_string()))
}

/// What an answer is written from.
pub(crate) struct Answer<'a> {
    pub(crate) api: GenApi,
    /// The engine's request id (the `X-Request-Id`, or one it drew).
    pub(crate) request_id: &'a str,
    pub(crate) choices: &'a [Generation],
    /// The served model's name.
    pub(crate) model: &'a str,
    pub(crate) prompt_tokens: u64,
    /// `/v1/responses`: the request as read, and its token limit.
    pub(crate) responses: Option<(&'a crate::surface::ResponsesRequest, u32)>,
    /// The top-level `kv_transfer_params` of a whole answer (`None`: no key).
    pub(crate) kv_transfer_params: Option<Value>,
}

impl Answer<'_> {
    /// The id the route's handler gives the request.
    fn id(&self) -> String {
        match self.api {
            GenApi::TokenIn => format!("generate-tokens-{}", self.request_id),
            GenApi::Messages => messages_id(self.request_id),
            GenApi::Responses => format!("resp_{}", self.request_id),
            GenApi::Cohere => format!("chatcmpl-{}", self.request_id),
        }
    }

    /// The Responses API's answer object, with the handoff.
    fn responses_answer(&self) -> Option<crate::surface::Responses<'_>> {
        let (request, max_tokens) = self.responses?;
        let generation = self.first()?.clone();
        let answer = crate::surface::Responses::of(
            request,
            self.model,
            self.request_id,
            request.created,
            generation,
            max_tokens,
        );
        Some(answer.with_handoff(self.kv_transfer_params.clone().filter(|p| !p.is_null())))
    }

    /// The whole (non-streaming) answer.
    pub(crate) fn whole(&self) -> Result<Vec<u8>, serde_json::Error> {
        match self.api {
            GenApi::Responses => match self.responses_answer() {
                Some(answer) => answer.whole(),
                None => Ok(b"{}".to_vec()),
            },
            GenApi::Cohere => {
                let c = self.first();
                let mut answer = json!({
                    "id": self.id(),
                    "finish_reason": cohere_finish(c),
                    "message": {"role": "assistant", "content": [{"type": "text", "text": c.map(Generation::text).unwrap_or_default()}]},
                    "usage": self.cohere_usage(),
                });
                // Null keys are dropped: no handoff is no key.
                if let Some(params) = self.kv_transfer_params.as_ref().filter(|p| !p.is_null()) {
                    answer["kv_transfer_params"] = params.clone();
                }
                serde_json::to_vec(&answer)
            }
            GenApi::TokenIn => {
                let choices: Vec<Value> = self
                    .choices
                    .iter()
                    .enumerate()
                    .map(|(i, c)| {
                        json!({
                            "index": i,
                            "logprobs": null,
                            "finish_reason": c.finish.as_str(),
                            "token_ids": c.ids,
                            "routed_experts": null,
                        })
                    })
                    .collect();
                serde_json::to_vec(&json!({
                    "request_id": self.id(),
                    "choices": choices,
                    "prompt_logprobs": null,
                    "kv_transfer_params": self.kv_transfer_params,
                }))
            }
            GenApi::Messages => {
                let c = self.first();
                let (stop_reason, stop_sequence) = anthropic_stop(c);
                let mut answer = json!({
                    "id": self.id(),
                    "type": "message",
                    "role": "assistant",
                    "model": self.model,
                    "content": [{"type": "text", "text": c.map(Generation::text).unwrap_or_default()}],
                    "stop_reason": stop_reason,
                    "stop_sequence": stop_sequence,
                    "usage": {"input_tokens": self.prompt_tokens, "output_tokens": self.output_tokens()},
                });
                // Null keys are dropped: no handoff is no key.
                if let Some(params) = self.kv_transfer_params.as_ref().filter(|p| !p.is_null()) {
                    answer["kv_transfer_params"] = params.clone();
                }
                serde_json::to_vec(&answer)
            }
        }
    }

    /// The streamed answer, one event per entry (never a handoff: these routes' streams
    /// carry none).
    pub(crate) fn events(&self) -> Result<VecDeque<Bytes>, serde_json::Error> {
        let mut events = VecDeque::new();
        let id = self.id();
        match self.api {
            GenApi::Responses => {
                if let Some(answer) = self.responses_answer() {
                    events = answer.events()?;
                }
            }
            GenApi::Cohere => {
                let c = self.first();
                let start = json!({"type": "message-start", "id": id,
                                   "delta": {"message": {"role": "assistant", "content": []}}});
                events.push_back(data(&start)?);
                let block = json!({"type": "content-start", "index": 0,
                                   "delta": {"message": {"content": {"type": "text", "text": ""}}}});
                events.push_back(data(&block)?);
                for step in c.map(|c| c.steps.as_slice()).unwrap_or_default() {
                    if step.is_empty() {
                        continue;
                    }
                    let delta = json!({"type": "content-delta", "index": 0,
                                       "delta": {"message": {"content": {"text": step}}}});
                    events.push_back(data(&delta)?);
                }
                events.push_back(data(&json!({"type": "content-end", "index": 0}))?);
                let end = json!({"type": "message-end", "id": id,
                                 "delta": {"finish_reason": cohere_finish(c), "usage": self.cohere_usage()}});
                events.push_back(data(&end)?);
                events.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
            }
            GenApi::TokenIn => {
                for (i, c) in self.choices.iter().enumerate() {
                    let last = c.ids.len().saturating_sub(1);
                    for (step, token) in c.ids.iter().enumerate() {
                        let finish = (step == last).then(|| c.finish.as_str());
                        let chunk = json!({
                            "request_id": id,
                            "choices": [{
                                "index": i,
                                "logprobs": null,
                                "finish_reason": finish,
                                "token_ids": [token],
                                "routed_experts": null,
                            }],
                            "usage": null,
                        });
                        events.push_back(data(&chunk)?);
                    }
                }
                events.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
            }
            GenApi::Messages => {
                let c = self.first();
                let (stop_reason, stop_sequence) = anthropic_stop(c);
                events.push_back(message_start(&id, &json!(self.model), self.prompt_tokens));
                let block = json!({"type": "content_block_start", "index": 0,
                                   "content_block": {"type": "text", "text": ""}});
                events.push_back(event("content_block_start", &block)?);
                for step in c.map(|c| c.steps.as_slice()).unwrap_or_default() {
                    if step.is_empty() {
                        continue;
                    }
                    let delta = json!({"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "text_delta", "text": step}});
                    events.push_back(event("content_block_delta", &delta)?);
                }
                let stop = json!({"type": "content_block_stop", "index": 0});
                events.push_back(event("content_block_stop", &stop)?);
                let delta = json!({"type": "message_delta",
                                   "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                   "usage": {"output_tokens": self.output_tokens()}});
                events.push_back(event("message_delta", &delta)?);
                events.push_back(event("message_stop", &json!({"type": "message_stop"}))?);
            }
        }
        Ok(events)
    }
}

impl Answer<'_> {
    /// The streamed answer as a response, one event per token at the engine's pace.
    pub(crate) fn stream(
        &self,
        delay: std::time::Duration,
        faults: Faults,
        guard: RequestGuard,
    ) -> Result<Response<SimBody>, (ApiError, RequestGuard)> {
        let events = match self.events() {
            Ok(events) => events,
            Err(e) => {
                let e = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
                return Err((e, guard));
            }
        };
        let body = EventsBody::new(events, delay, faults.stall_after_chunks, guard)
            .dropping_after(faults.drop_after_chunks);
        let mut response = Response::new(SimBody::Events(Box::new(body)));
        response.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream; charset=utf-8"),
        );
        Ok(response)
    }
}

impl Answer<'_> {
    /// The one choice of a route that has no `n`.
    fn first(&self) -> Option<&Generation> {
        self.choices.first()
    }

    fn output_tokens(&self) -> usize {
        self.first().map_or(0, |c| c.steps.len())
    }

    fn cohere_usage(&self) -> Value {
        let tokens =
            json!({"input_tokens": self.prompt_tokens, "output_tokens": self.output_tokens()});
        json!({"billed_units": tokens, "tokens": tokens})
    }
}

/// Cohere's `finish_reason` for a generation.
fn cohere_finish(c: Option<&Generation>) -> &'static str {
    match c {
        Some(c) if c.finish == crate::generate::Finish::Length => "MAX_TOKENS",
        Some(Generation {
            stop_reason: Some(_),
            ..
        }) => "STOP_SEQUENCE",
        _ => "COMPLETE",
    }
}

/// Anthropic's `stop_reason` and `stop_sequence` for a generation.
fn anthropic_stop(c: Option<&Generation>) -> (&'static str, Option<String>) {
    match c {
        Some(c) if c.finish == crate::generate::Finish::Length => ("max_tokens", None),
        Some(Generation {
            stop_reason: Some(s),
            ..
        }) => ("stop_sequence", Some(s.clone())),
        _ => ("end_turn", None),
    }
}

/// The id of a Messages answer to the engine's request `request_id`.
fn messages_id(request_id: &str) -> String {
    format!("msg_{request_id}")
}

/// A Messages stream's `message_start` event, as vLLM's converter writes it for the
/// chat generator's first chunk: no content yet, the prompt's tokens as its usage.
fn message_start(id: &str, model: &Value, prompt_tokens: u64) -> Bytes {
    let start = json!({"type": "message_start", "message": {
        "id": id, "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
    }});
    value_event("message_start", &start)
}

/// The events of a streamed `/v1/messages` request whose chat generator yielded `error`
/// after its role chunk (a failed KV load: [`crate::kv_load_failure`]). vLLM 0.33's
/// `message_stream_converter` (`vllm/entrypoints/anthropic/serving.py`) made
/// `message_start` of the role chunk; the error ends it with an `error` event typed
/// after the error's status (`translate_error_type`), no content block being open, and
/// nothing follows it (no `message_stop`, no `[DONE]`). `request_id` is the engine's
/// request id, `model` the model the answer names (JSON).
pub(crate) fn failed_messages_events(
    request_id: &str,
    model: &Value,
    prompt_tokens: u64,
    error: &ApiError,
) -> VecDeque<Bytes> {
    let id = messages_id(request_id);
    // Written member by member: vLLM's pydantic model puts `type` first, which a
    // `serde_json::Value` (its keys sorted) would not.
    let failure = format!(
        "{{\"type\":\"error\",\"error\":{{\"type\":{},\"message\":{}}}}}",
        Value::from(anthropic_type(error.status)),
        Value::from(error.message.as_str()),
    );
    VecDeque::from([
        message_start(&id, model, prompt_tokens),
        Bytes::from(format!("event: error\ndata: {failure}\n\n")),
    ])
}

/// The events vLLM 0.33 writes of `request`'s stream before the engine's first output,
/// whatever that output is: a streamed `/v1/responses` request's `response.created` and
/// `response.in_progress` (`responses_stream_generator` yields both first), nothing for
/// the other routes, whose first event is made of the first output. `model` is the
/// model the answer names, `request_id` the engine's request id.
pub(crate) fn opening_events(
    request: &CompletionRequest,
    model: &str,
    request_id: &str,
) -> VecDeque<Bytes> {
    let Some(read) = request.responses.as_deref().filter(|r| r.stream) else {
        return VecDeque::new();
    };
    let no_tokens = crate::kv_load_failure::no_tokens();
    let answer = crate::surface::Responses::of(
        read,
        model,
        request_id,
        read.created,
        no_tokens,
        request.max_tokens,
    );
    answer.opening().unwrap_or_else(|e| {
        // Writing a built JSON value does not fail; should it, the stream opens with
        // the answer's own events, after the work.
        tracing::error!(error = %e, "cannot render a Responses stream's opening events");
        VecDeque::new()
    })
}

/// The events of a streamed `/cohere/v2/chat` request whose chat generator yielded
/// `error` after its role chunk (a failed KV load: [`crate::kv_load_failure`]), as
/// vLLM 0.33's `_chat_completion_stream_to_v2` (`vllm/entrypoints/cohere/serving.py`)
/// writes them: the role chunk's `message-start` (the SDK event's
/// `model_dump_json(exclude_none=True)`: its own fields, then the `type` vLLM's subclass
/// declares), then, the error payload having failed its chunk validation, the `except`'s
/// `message-end` written by `json.dumps` (its spacing, non-ASCII escaped) with the error
/// as `delta.error` and `finish_reason` `ERROR`, then `data: [DONE]`. vLLM's
/// `delta.error` is pydantic's validation error for the error payload; the simulator's
/// is the error's own message. `request_id` is the engine's request id.
pub(crate) fn failed_cohere_events(request_id: &str, error: &ApiError) -> VecDeque<Bytes> {
    let id = Value::from(format!("chatcmpl-{request_id}"));
    let start = format!(
        r#"{{"id":{id},"delta":{{"message":{{"role":"assistant"}}}},"type":"message-start"}}"#
    );
    let end = format!(
        r#"{{"type": "message-end", "delta": {{"error": {}, "finish_reason": "ERROR"}}}}"#,
        python_json_str(&error.message)
    );
    VecDeque::from([
        Bytes::from(format!("data: {start}\n\n")),
        Bytes::from(format!("data: {end}\n\n")),
        Bytes::from_static(b"data: [DONE]\n\n"),
    ])
}

/// `s` as Python's `json.dumps` writes a string: JSON's escapes, and every character
/// outside printable ASCII as `\uXXXX` (UTF-16 units, lowercase hex: `ensure_ascii`).
pub(crate) fn python_json_str(s: &str) -> String {
    let json = Value::from(s).to_string();
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if c.is_ascii() && c != '\u{7f}' {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
    out
}

/// One `event:`/`data:` pair of a built JSON value (whose writing cannot fail).
fn value_event(name: &str, value: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {value}\n\n"))
}

/// One `event:`/`data:` pair (Anthropic's stream format).
fn event(name: &str, value: &Value) -> Result<Bytes, serde_json::Error> {
    let mut out = format!("event: {name}\ndata: ").into_bytes();
    serde_json::to_writer(&mut out, value)?;
    out.extend_from_slice(b"\n\n");
    Ok(Bytes::from(out))
}

/// One `data:` event.
fn data(value: &Value) -> Result<Bytes, serde_json::Error> {
    let mut out = b"data: ".to_vec();
    serde_json::to_writer(&mut out, value)?;
    out.extend_from_slice(b"\n\n");
    Ok(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Cohere failure's `message-end` as Python's `json.dumps` writes it (the
    /// expected text is `json.dumps` output, non-ASCII, DEL and control characters
    /// escaped).
    #[test]
    fn a_cohere_message_end_is_written_as_json_dumps_writes_it() {
        let error = ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "KV \u{e9}\u{1f600}\u{7f}\"\\\n\u{1} /",
        );
        let events = failed_cohere_events("r-1", &error);
        assert_eq!(
            events[1],
            r#"data: {"type": "message-end", "delta": {"error": "KV \u00e9\ud83d\ude00\u007f\"\\\n\u0001 /", "finish_reason": "ERROR"}}"#
                .to_owned()
                + "\n\n"
        );
        assert_eq!(
            events[0],
            "data: {\"id\":\"chatcmpl-r-1\",\"delta\":{\"message\":{\"role\":\"assistant\"}},\"type\":\"message-start\"}\n\n"
        );
        assert_eq!(events[2], "data: [DONE]\n\n");
    }
}
