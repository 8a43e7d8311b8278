//! The errors of tokenizing a request ([`TokenizeError`]) and of reaching an engine's
//! `/tokenize` ([`EngineError`]).

use std::borrow::Cow;

use disagg_core::error::{BoxError, TransportError};

/// Why a request's prompt has no token ids.
///
/// Callers that route by cached prefixes treat every variant alike (route without cache
/// information); the variants say whose the fault is, for logs and metrics.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizeError {
    /// The prompt is not one sequence this tokenizer can reproduce: a batch of prompts,
    /// multimodal content, prompt embeddings, a request's own chat template. Nothing is
    /// wrong with the request; it is routed without cache information.
    #[error("not supported: {reason}")]
    NotSupported {
        /// What is not supported.
        reason: Cow<'static, str>,
    },
    /// The request is malformed where its prompt is read, in a way the engine would
    /// refuse too (with 400).
    #[error("invalid `{field}`: {reason}")]
    Invalid {
        /// The request field at fault.
        field: &'static str,
        /// What is wrong with it.
        reason: Cow<'static, str>,
    },
    /// The chat template failed to render, or raised (`raise_exception`): the engine
    /// refuses such a request with the same reason.
    #[error("chat template: {message}")]
    Template {
        /// The template's own reason, or the renderer's.
        message: String,
    },
    /// The tokenizer failed (or its worker thread was lost).
    #[error("tokenizer failed")]
    Tokenizer(#[source] BoxError),
    /// The engine's `/tokenize` failed or answered something unusable.
    #[error("engine tokenization failed")]
    Engine(#[source] EngineError),
}

impl TokenizeError {
    /// Whether the prompt's shape is one this tokenizer does not handle (as opposed to
    /// a failure).
    pub fn is_not_supported(&self) -> bool {
        matches!(self, TokenizeError::NotSupported { .. })
    }

    pub(crate) fn not_supported(reason: impl Into<Cow<'static, str>>) -> Self {
        TokenizeError::NotSupported {
            reason: reason.into(),
        }
    }

    pub(crate) fn invalid(field: &'static str, reason: impl Into<Cow<'static, str>>) -> Self {
        TokenizeError::Invalid {
            field,
            reason: reason.into(),
        }
    }
}

/// Why an engine's `/tokenize` gave no token ids.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The `/tokenize` URI could not be built from the endpoint.
    #[error("invalid /tokenize uri")]
    Uri(#[source] http::Error),
    /// The request did not get an answer.
    #[error("no answer from the engine")]
    Transport(#[source] TransportError),
    /// The engine answered with an error status (its body's start is kept).
    #[error("the engine answered {status}: {message}")]
    Status {
        /// The answer's status.
        status: http::StatusCode,
        /// The first 512 bytes of the answer's body.
        message: String,
    },
    /// The answer's body could not be read (or was larger than the limit).
    #[error("reading the answer failed")]
    Body(#[source] BoxError),
    /// The answer is not a `/tokenize` answer with one list of token ids.
    #[error("the answer is not a /tokenize answer")]
    Decode(#[source] serde_json::Error),
}
