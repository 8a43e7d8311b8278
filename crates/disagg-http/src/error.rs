//! Error responses: the one place errors become HTTP answers. OpenAI's format (the JSON
//! body built by [`openai_error_body`]) on every route but those whose
//! engines answer another shape ([`api_error_response`]): vLLM's Anthropic route
//! `/v1/messages` and its Cohere route `/cohere/v2/chat`.

use bytes::Bytes;
use disagg_core::error::{PdError, error_chain};
use disagg_core::orchestrator::PdBody;
use disagg_core::request::Api;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};

/// An OpenAI-format error body with `param` null.
pub fn openai_error_body(message: &str, error_type: &str, code: &str) -> Bytes {
    openai_body(message, error_type, None, code)
}

/// OpenAI's error body (`disagg_json::openai_error_body`, the shape's one builder).
pub(crate) use disagg_core::json::openai_error_body as openai_body;

/// A response with `status` and an OpenAI-format error body.
pub fn error_response(
    status: StatusCode,
    message: &str,
    error_type: &str,
    code: &str,
) -> Response<PdBody> {
    let mut resp = Response::new(PdBody::from(openai_error_body(message, error_type, code)));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// The response for a [`PdError`]: its status, its whole cause chain as the message,
/// and `retry-after` (whole seconds, at least 1) when the error names one.
pub fn pd_error_response(err: &PdError) -> Response<PdBody> {
    let http = err.http();
    let body = openai_body(&error_chain(err), http.error_type, http.param, http.code);
    let mut resp = Response::new(PdBody::from(body));
    *resp.status_mut() = http.status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(after) = http.retry_after {
        let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
        resp.headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from(secs.max(1)));
    }
    resp
}

/// The response for a [`PdError`] on `api`'s route, in the error shape that route's
/// engine answers with:
///
/// - `/v1/messages`: Anthropic's `{"type": "error", "error": {"type", "message"}}`,
///   `type` by status as vLLM 0.33 writes it (`vllm/entrypoints/anthropic/protocol.py`:
///   400 `invalid_request_error`, 401 `authentication_error`, 403 `permission_error`,
///   404 `not_found_error`, 413 `request_too_large`, 429 `rate_limit_error`, 503
///   `overloaded_error`, any other 5xx `api_error`); but a body its request model
///   refuses (`invalid_parameter`, `invalid_request_body`) gets OpenAI's shape, as vLLM's
///   server-wide validation handler answers it;
/// - `/cohere/v2/chat`: Cohere's `{"message", "id"}` (`id` the client's `x-request-id`
///   when it sent one, else `null`), the request model's refusals in OpenAI's shape as
///   on `/v1/messages` (vLLM's validation handler is the server's, *inferred* for this
///   route);
/// - every other route: OpenAI's ([`pd_error_response`]).
pub fn api_error_response(api: Api, request_id: Option<&str>, err: &PdError) -> Response<PdBody> {
    let request_model = matches!(
        err.http().code,
        "invalid_parameter" | "invalid_request_body"
    );
    let mut resp = pd_error_response(err);
    if request_model {
        return resp;
    }
    if let Some(body) = api_body(api, request_id, err.http().status, &error_chain(err)) {
        *resp.body_mut() = PdBody::from(body);
    }
    resp
}

/// A response with `status` and an error body in the shape `api`'s route answers with,
/// as [`api_error_response`] writes it (Anthropic's on `/v1/messages`, Cohere's on
/// `/cohere/v2/chat`), OpenAI's with `error_type` and `code` on every other route and
/// when `api` is `None` (a route no API serves: forwarded, direct, fanned out).
pub(crate) fn api_error(
    api: Option<Api>,
    request_id: Option<&str>,
    status: StatusCode,
    message: &str,
    error_type: &str,
    code: &str,
) -> Response<PdBody> {
    let mut resp = error_response(status, message, error_type, code);
    if let Some(body) = api.and_then(|api| api_body(api, request_id, status, message)) {
        *resp.body_mut() = PdBody::from(body);
    }
    resp
}

/// The error body of `api`'s route when its engines answer another shape than OpenAI's
/// (see [`api_error_response`]); `None` on the routes that answer OpenAI's.
fn api_body(
    api: Api,
    request_id: Option<&str>,
    status: StatusCode,
    message: &str,
) -> Option<Bytes> {
    let body = match api {
        Api::Messages => serde_json::json!({
            "type": "error",
            "error": {"type": anthropic_type(status), "message": message},
        }),
        Api::CohereChat => serde_json::json!({"message": message, "id": request_id}),
        _ => return None,
    };
    Some(Bytes::from(body.to_string()))
}

/// Anthropic's error `type` for `status`, as vLLM 0.33 maps it.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_errors_are_anthropics_but_for_the_request_model() {
        let busy = PdError::from(disagg_core::error::Overload::ServerBusy {
            retry_after: std::time::Duration::from_secs(2),
        });
        let resp = api_error_response(Api::Messages, None, &busy);
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(resp.headers()[RETRY_AFTER], "2");
        let body = futures::executor::block_on(http_body_util::BodyExt::collect(resp.into_body()))
            .unwrap()
            .to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "overloaded_error");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
        // The same error on chat: OpenAI's.
        let cohere = api_error_response(Api::CohereChat, Some("r-1"), &busy);
        let body =
            futures::executor::block_on(http_body_util::BodyExt::collect(cohere.into_body()))
                .unwrap()
                .to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["id"], "r-1");
        assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()));
        let chat = api_error_response(Api::Chat, None, &busy);
        let body = futures::executor::block_on(http_body_util::BodyExt::collect(chat.into_body()))
            .unwrap()
            .to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "server_busy");
        for (status, ty) in [
            (400, "invalid_request_error"),
            (404, "not_found_error"),
            (413, "request_too_large"),
            (429, "rate_limit_error"),
            (502, "api_error"),
            (504, "api_error"),
        ] {
            assert_eq!(anthropic_type(StatusCode::from_u16(status).unwrap()), ty);
        }
    }

    #[test]
    fn body_shape() {
        let b = openai_error_body("bad \"x\"", "invalid_request_error", "c");
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["error"]["message"], "bad \"x\"");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "c");
        assert!(v["error"]["param"].is_null());
    }
}
