//! Why a request is refused at the edge, and the answer it gets (401 or 429 in OpenAI's
//! format).

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{Response, StatusCode};

/// Why a request was refused by [`ApiKeys::check`](super::ApiKeys::check).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// No `Authorization: Bearer` key (401).
    #[error("missing API key: send it in the Authorization header as `Authorization: Bearer KEY`")]
    Missing,
    /// A key that is not configured (401). The key is never part of the message.
    #[error("invalid API key")]
    Invalid,
    /// The key's request rate is used up (429).
    #[error("rate limit reached for this API key ({rate} requests per second); try again later")]
    Rate {
        /// The key's rate.
        rate: String,
        /// When one more request would be allowed.
        retry_after: Duration,
    },
    /// The key has its most requests in flight (429).
    #[error("this API key has {max} requests in flight, its limit; try again when one ends")]
    InFlight {
        /// The limit.
        max: usize,
    },
}

impl Refusal {
    /// The answer's status: 401 or 429.
    pub fn status(&self) -> StatusCode {
        match self {
            Refusal::Missing | Refusal::Invalid => StatusCode::UNAUTHORIZED,
            Refusal::Rate { .. } | Refusal::InFlight { .. } => StatusCode::TOO_MANY_REQUESTS,
        }
    }

    /// OpenAI's `error.code`: `invalid_api_key` or `rate_limit_exceeded`.
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::Missing | Refusal::Invalid => "invalid_api_key",
            Refusal::Rate { .. } | Refusal::InFlight { .. } => "rate_limit_exceeded",
        }
    }

    /// OpenAI's `error.type`: `invalid_request_error`, or `requests` for a limit on
    /// requests (as OpenAI's own rate-limit errors say).
    pub fn error_type(&self) -> &'static str {
        match self {
            Refusal::Missing | Refusal::Invalid => "invalid_request_error",
            Refusal::Rate { .. } | Refusal::InFlight { .. } => "requests",
        }
    }

    /// How long a client should wait before trying again (429 only). An in-flight limit
    /// cannot know when a request will end: 1 s.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Refusal::Rate { retry_after, .. } => Some(*retry_after),
            Refusal::InFlight { .. } => Some(Duration::from_secs(1)),
            Refusal::Missing | Refusal::Invalid => None,
        }
    }

    /// The answer: status, OpenAI-format body, `www-authenticate: Bearer` on a 401 and
    /// `retry-after` (whole seconds, rounded up, at least 1) on a 429.
    pub fn to_response(&self) -> Response<Bytes> {
        let body =
            crate::error::openai_body(&self.to_string(), self.error_type(), None, self.code());
        let mut resp = Response::new(body);
        *resp.status_mut() = self.status();
        let h = resp.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if self.status() == StatusCode::UNAUTHORIZED {
            h.insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(after) = self.retry_after() {
            let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            h.insert(RETRY_AFTER, HeaderValue::from(secs.max(1)));
        }
        resp
    }
}
