//! OpenAI-format error responses: the one place errors become HTTP answers (their JSON
//! body is built by `disagg_core::error::openai_error_body`).

use bytes::Bytes;
use disagg_core::error::{PdError, error_chain};
use disagg_core::orchestrator::PdBody;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};

/// An OpenAI-format error body with `param` null (built by
/// [`disagg_core::error::openai_error_body`], the one place it is built).
pub fn openai_error_body(message: &str, error_type: &str, code: &str) -> Bytes {
    disagg_core::error::openai_error_body(message, error_type, None, code)
}

/// A response with `status` and an OpenAI-format error body.
pub fn error_response(
    status: StatusCode,
    message: &str,
    error_type: &str,
    code: &str,
) -> Response<PdBody> {
    let mut resp = Response::new(PdBody::full(openai_error_body(message, error_type, code)));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// The response for a [`PdError`]: its status, its whole cause chain as the message,
/// and `retry-after` (whole seconds, at least 1) when the error names one.
pub fn pd_error_response(err: &PdError) -> Response<PdBody> {
    let body = disagg_core::error::openai_error_body(
        &error_chain(err),
        err.error_type(),
        err.param(),
        err.code(),
    );
    let mut resp = Response::new(PdBody::full(body));
    *resp.status_mut() = err.status();
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(after) = err.retry_after() {
        let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
        resp.headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from(secs.max(1)));
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

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
