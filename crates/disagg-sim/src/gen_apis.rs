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
}

impl GenApi {
    /// The route's API served at `path`, if any.
    pub(crate) fn of_path(path: &str) -> Option<GenApi> {
        match path {
            "/inference/v1/generate" => Some(GenApi::TokenIn),
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
) -> Result<CompletionRequest, ApiError> {
    let Some(obj) = body.as_object() else {
        return Err(ApiError::bad_request(
            "Input should be a valid dictionary or object to extract fields from",
        ));
    };
    let (endpoint, inner) = match api {
        GenApi::TokenIn => (Endpoint::Completions, token_in_body(obj)?),
    };
    let mut request = CompletionRequest::parse(endpoint, &Value::Object(inner), config)?;
    request.gen_api = Some(api);
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

/// What an answer is written from.
pub(crate) struct Answer<'a> {
    pub(crate) api: GenApi,
    /// The engine's request id (the `X-Request-Id`, or one it drew).
    pub(crate) request_id: &'a str,
    pub(crate) choices: &'a [Generation],
    /// The top-level `kv_transfer_params` of a whole answer (`None`: no key).
    pub(crate) kv_transfer_params: Option<Value>,
}

impl Answer<'_> {
    /// The id the route's handler gives the request.
    fn id(&self) -> String {
        match self.api {
            GenApi::TokenIn => format!("generate-tokens-{}", self.request_id),
        }
    }

    /// The whole (non-streaming) answer.
    pub(crate) fn whole(&self) -> Result<Vec<u8>, serde_json::Error> {
        match self.api {
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
        }
    }

    /// The streamed answer, one event per entry (never a handoff: these routes' streams
    /// carry none).
    pub(crate) fn events(&self) -> Result<VecDeque<Bytes>, serde_json::Error> {
        let mut events = VecDeque::new();
        let id = self.id();
        match self.api {
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
        let body = EventsBody::new(events, delay, faults.stall_after_chunks, guard);
        let mut response = Response::new(SimBody::Events(Box::new(body)));
        response.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream; charset=utf-8"),
        );
        Ok(response)
    }
}

/// One `data:` event.
fn data(value: &Value) -> Result<Bytes, serde_json::Error> {
    let mut out = b"data: ".to_vec();
    serde_json::to_writer(&mut out, value)?;
    out.extend_from_slice(b"\n\n");
    Ok(Bytes::from(out))
}
