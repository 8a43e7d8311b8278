//! The errors of reading a client's body: [`BodyError`], and the [`InvalidParam`] it carries
//! when a field is one the engines would refuse.

/// The client's request body could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BodyError {
    /// The body is not valid JSON.
    #[error("request body is not valid JSON: {0}")]
    InvalidJson(#[source] serde_json::Error),
    /// The body is JSON, but its top level is not an object.
    #[error("request body must be a JSON object")]
    NotAnObject,
    /// A field has a type the request path cannot work with.
    #[error("field `{field}` has the wrong type: expected {expected}")]
    FieldType {
        /// The top-level field.
        field: &'static str,
        /// What was expected, in words.
        expected: &'static str,
    },
    /// The body's top level has more than `limit` fields (duplicates counted): no
    /// request of any engine's API has a tenth of that, and each field costs the proxy
    /// its place in the body's index for the request's life.
    #[error("request body has more than {limit} top-level fields")]
    TooManyFields {
        /// The most fields a body may have ([`MAX_FIELDS`](crate::MAX_FIELDS)).
        limit: usize,
    },
    /// The body is larger than the server takes, `limit` bytes (413
    /// `request_too_large`).
    #[error("request body is larger than the limit of {limit} bytes")]
    TooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The body did not arrive within `after` (408 `request_timeout`): it stopped half
    /// way, or trickled in too slowly.
    #[error("the request body did not arrive within {} ms", after.as_millis())]
    TimedOut {
        /// The time the body had.
        after: std::time::Duration,
    },
    /// A field the engines would refuse (checked by the proxy for the fields it
    /// rewrites, see `disagg_connectors::vllm::rewrite::check::check_request`).
    #[error(transparent)]
    Invalid(#[from] InvalidParam),
}

/// A request parameter an engine would refuse, in the engine's own words (its
/// `Display`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct InvalidParam {
    /// The refused top-level field: OpenAI's `error.param`.
    pub param: &'static str,
    message: String,
}

impl InvalidParam {
    /// `param` is refused, with `message` saying why.
    pub fn new(param: &'static str, message: impl Into<String>) -> Self {
        InvalidParam {
            param,
            message: message.into(),
        }
    }
}

/// OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`: the one
/// builder of the shape, for an HTTP layer's error answers (`disagg-http`) and for the
/// error event that ends a broken stream (`disagg-core`).
pub fn openai_error_body(
    message: &str,
    error_type: &str,
    param: Option<&str>,
    code: &str,
) -> bytes::Bytes {
    let v = serde_json::json!({
        "error": {
            "message": message,
            "type": error_type,
            "param": param,
            "code": code,
        }
    });
    // Serializing a `Value` cannot fail.
    bytes::Bytes::from(serde_json::to_vec(&v).unwrap_or_default())
}
