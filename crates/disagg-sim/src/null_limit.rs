//! vLLM's completions route on an explicit `"max_tokens": null`.
//!
//! vLLM's `CompletionRequest.max_tokens` defaults to 16 when the key is absent, but an
//! explicit `null` passes validation as `None`: the engine runs the request (its
//! limit is then the rest of the context), and the handler's bare
//! `assert request.max_tokens is not None` fails on the first output (streamed) or on
//! the finished answer (not streamed). The streaming generator catches the
//! `AssertionError` and sends it as one error event, then `data: [DONE]`, after a 200
//! head; the whole answer fails with a 500. Either way the error is vLLM's shape for
//! an exception it does not map (`InternalServerError`, 500). A chat's `null` is no
//! limit, and is served.

use std::collections::VecDeque;
use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode};
use serde_json::{Map, Value};

use crate::api::ApiError;
use crate::body::{Endpoint, EventsBody, SimBody};
use crate::stats::RequestGuard;

/// The error's message. vLLM's is a bare `assert`, whose message is empty; the
/// simulator names what failed.
const MESSAGE: &str = "max_tokens must not be None";

/// Whether a request body sets `"max_tokens": null` on a route that fails on it: vLLM's
/// `/v1/completions`.
pub(crate) fn fails_on(vllm: bool, endpoint: Endpoint, obj: &Map<String, Value>) -> bool {
    vllm && endpoint == Endpoint::Completions && obj.get("max_tokens").is_some_and(Value::is_null)
}

/// The error vLLM answers.
pub(crate) fn error() -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, MESSAGE)
}

/// The streamed answer: a 200 head (echoing the request's `X-Request-Id`, as every
/// other answer of the simulator does), the error event, then `data: [DONE]`.
pub(crate) fn stream(
    delay: Duration,
    header_id: Option<&str>,
    guard: RequestGuard,
) -> Response<SimBody> {
    let mut event = b"data: ".to_vec();
    event.extend_from_slice(&error().body());
    event.extend_from_slice(b"\n\n");
    let events = VecDeque::from([Bytes::from(event), Bytes::from_static(b"data: [DONE]\n\n")]);
    let body = EventsBody::new(events, delay, None, guard);
    crate::kv_load_failure::sse_response(SimBody::Events(Box::new(body)), header_id)
}
