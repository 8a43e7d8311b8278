//! The prompt's token ids, within the connector's ceiling
//! ([`Lmcache::with_max_prompt_tokens`](super::Lmcache::with_max_prompt_tokens)), and
//! whose fault it is when there are none: the client's (its prompt, the model it
//! named), the proxy's (its blocking pool), or the prefill engine's (its `/tokenize`).
//! Also the prefill's context length, for a prompt whose ids were known, and the
//! `/tokenize` bodies.

use std::sync::Arc;

use bytes::Bytes;
use disagg_core::endpoint::Endpoint;
use disagg_core::error::{ConnectorError, error_chain};
use disagg_core::transport::Transport;
use disagg_json::JsonBody;
use disagg_tokenize::EngineError;
use disagg_tokenize::engine::{IdsError, TokenizeAnswer, read_ids, request_answer};
use disagg_tokenize::prompt::BlockingLimit;

use super::refused;

/// The prompt's token ids, at most `max` of them: the prefill engine's `/tokenize`
/// answer to `tokenize` (the exchange `disagg-tokenize`'s `EngineTokenizer` makes too)
/// when the prompt is to be tokenized, with the answer's `max_model_len` (when it is a
/// positive integer), else the client's own ids (`prompt`, a JSON list), with no
/// context length. Lists are decoded no further than the first id past `max`, the answer read no
/// further than one of `max` ids can take, and large lists decoded on the blocking pool
/// within `blocking`.
///
/// # Errors
///
/// The client's faults are [`ConnectorError::Unsupported`] (400): more than `max` ids,
/// a prompt `/tokenize` refuses as the client's (400 or 422: no prompt, a malformed
/// message), a model it does not serve (404), no prompt at all, ids that are no list
/// of token ids. A job the blocking pool lost is [`ConnectorError::NotReady`] (the
/// proxy's, no engine's); an endpoint whose address makes no `/tokenize` URI is
/// [`ConnectorError::NotConfigured`]; any other failure of `/tokenize` is the prefill
/// engine's, [`ConnectorError::Engine`].
pub(super) async fn prompt_ids(
    transport: &dyn Transport,
    ep: &Arc<Endpoint>,
    tokenize: Option<Bytes>,
    prompt: Option<Bytes>,
    max: usize,
    blocking: &BlockingLimit,
) -> Result<(Arc<[u64]>, Option<u64>), ConnectorError> {
    match (tokenize, prompt) {
        (Some(body), _) => {
            let answer = ask(transport, ep, body, max, blocking)
                .await
                .map_err(|e| tokenize_error(ep, e, Call::Prompt { max }))?;
            // Widened once counted: at most `max` of them.
            let ids = answer.ids.into_iter().map(u64::from).collect();
            Ok((ids, answer.max_model_len))
        }
        (None, Some(raw)) => read_ids::<u64>(raw, max, blocking)
            .await
            .map(|ids| (Arc::from(ids), None))
            .map_err(|e| match e {
                IdsError::TooMany { .. } => too_long(max),
                IdsError::Blocking(e) => lost("reading the prompt's token ids", &e),
                // `Invalid`: the client's prompt is no list of token ids.
                _ => refused("a prompt that is not a list of token ids"),
            }),
        (None, None) => Err(refused("a request without a prompt")),
    }
}

/// The most ids the `/tokenize` asking the context length reads: it tokenizes one
/// character (a special token or two in front of it), whatever the connector's
/// prompt ceiling (one below a handful of ids must not refuse it as a prompt too long).
const PROBE_IDS: usize = 16;

/// The prefill engine's context length (its `/tokenize` answer's `max_model_len`, when a
/// positive integer), for a prompt whose ids were known without a `/tokenize`: asked
/// with the client's `model` (unless `null`) and a prompt of one character, since only
/// the answer's `max_model_len` is read, that answer read within [`PROBE_IDS`] ids.
/// Asked only when the request needs it ([`needs_context`](super::limit::needs_context))
/// and no answer of the engine's for that model told it in the last 10 s
/// ([`ContextLengths`](super::context::ContextLengths), which remembers this answer, and
/// a failure of the engine's for 10 s too).
///
/// # Errors
///
/// A model the engine does not serve (404), or a `model` it refuses in that call (400,
/// 422), is the client's, [`ConnectorError::Unsupported`]; a lost blocking-pool job is
/// [`ConnectorError::NotReady`]; any other failure, an answer of more than
/// [`PROBE_IDS`] ids among them, is the engine's, [`ConnectorError::Engine`], naming
/// the prefill.
pub(super) async fn context_length(
    transport: &dyn Transport,
    ep: &Arc<Endpoint>,
    model: Option<&[u8]>,
    blocking: &BlockingLimit,
) -> Result<Option<u64>, ConnectorError> {
    let answer = ask(transport, ep, context_body(model), PROBE_IDS, blocking)
        .await
        .map_err(|e| tokenize_error(ep, e, Call::ContextLength))?;
    Ok(answer.max_model_len)
}

/// The body of [`context_length`]'s `/tokenize`: the client's `model` (unless `null`)
/// and a prompt of one character.
pub(super) fn context_body(model: Option<&[u8]>) -> Bytes {
    completion_tokenize(model.filter(|m| *m != b"null"), br#"".""#)
}

/// The prefill's `/tokenize` answer to `body`, of at most `max` ids.
async fn ask(
    transport: &dyn Transport,
    ep: &Arc<Endpoint>,
    body: Bytes,
    max: usize,
    blocking: &BlockingLimit,
) -> Result<TokenizeAnswer, IdsError> {
    let uri = ep
        .uri("/tokenize")
        .map_err(|e| IdsError::Engine(EngineError::Uri(e)))?;
    request_answer(transport, uri, body, max, blocking).await
}

/// Which of the prefill's `/tokenize` calls failed.
#[derive(Debug, Clone, Copy)]
enum Call {
    /// The prompt's, read within `max` ids (the connector's ceiling).
    Prompt { max: usize },
    /// The context length's ([`context_length`]), read within [`PROBE_IDS`].
    ContextLength,
}

/// The request's failure when the prefill's `/tokenize` on `ep` (`call`) gave no
/// answer. The client's: a 404 (vLLM's answer for a model it does not serve; the
/// prefill leg's own 404 would be passed to the client as its error), a refusal (400,
/// 422) of the client's prompt or, asking the context length, of its `model` (the only
/// part of that call that is the client's), and a prompt's answer of more ids than
/// the ceiling (or longer than one of them can be). A job the blocking pool lost is the
/// proxy's; an address that makes no `/tokenize` URI the operator's; anything else
/// the engine's, an answer to the context length's one character of more than
/// [`PROBE_IDS`] ids among them.
fn tokenize_error(ep: &Endpoint, e: IdsError, call: Call) -> ConnectorError {
    let too_many = match &e {
        IdsError::TooMany { .. } => true,
        IdsError::Engine(EngineError::Body(b)) => b.is::<http_body_util::LengthLimitError>(),
        _ => false,
    };
    match (e, call) {
        (_, Call::Prompt { max }) if too_many => too_long(max),
        // vLLM's `_check_model`, before it reads the prompt: the model the client named.
        (IdsError::Engine(EngineError::Status { status, message }), _)
            if status == http::StatusCode::NOT_FOUND =>
        {
            refused(format!(
                "a model its prefill engine does not serve ({status}: {message})"
            ))
        }
        // vLLM answers 400 for a prompt it cannot take (none, a malformed message, an
        // unknown chat template field) and FastAPI 422 for a body off its schema: the
        // engine worked, the request was the client's fault.
        (IdsError::Engine(EngineError::Status { status, message }), call)
            if matches!(status.as_u16(), 400 | 422) =>
        {
            refused(match call {
                Call::Prompt { .. } => {
                    format!("a prompt its prefill engine refused to tokenize ({status}: {message})")
                }
                Call::ContextLength => format!(
                    "a `model` its prefill engine refused when asked its context length ({status}: {message})"
                ),
            })
        }
        (IdsError::Blocking(e), _) => lost("reading the prefill's `/tokenize` answer", &e),
        (IdsError::Engine(EngineError::Uri(_)), _) => ConnectorError::NotConfigured {
            endpoint: ep.id().clone(),
            what: "address that makes a `/tokenize` URI",
        },
        (e, _) => ConnectorError::Engine {
            endpoint: ep.id().clone(),
            what: "/tokenize",
            source: Box::new(e),
        },
    }
}

/// The refusal (400) of a prompt of more than `max` token ids.
fn too_long(max: usize) -> ConnectorError {
    refused(format!("a prompt of more than {max} token ids"))
}

/// The refusal (400) of a prompt of no token ids: the client's `[]`, or text the
/// prefill tokenized to nothing (vLLM refuses an empty prompt itself).
pub(super) fn empty() -> ConnectorError {
    refused("an empty prompt (no token ids)")
}

/// The failure of `what` when the blocking pool lost its job (`e`): the proxy's
/// runtime shutting down, no engine's fault ([`ConnectorError::NotReady`], which blames
/// none).
pub(super) fn lost(what: &str, e: &(dyn std::error::Error + 'static)) -> ConnectorError {
    ConnectorError::NotReady {
        reason: format!(
            "{what}: its job on the proxy's blocking pool was lost (the runtime shutting down): {}",
            error_chain(e)
        ),
    }
}

/// The `/tokenize` body for a client's request (a completions prompt of text: see
/// [`Kind`](super::prompt::Kind)).
pub(super) fn tokenize_request(body: &JsonBody, chat: bool) -> Bytes {
    // The client's values as it wrote them: copied, never built (a `Value` of a
    // message list costs up to ~95 bytes per byte).
    let raw = |key: &str| body.get(key).filter(|v| *v != b"null");
    if !chat {
        return completion_tokenize(raw("model"), body.get("prompt").unwrap_or(b"null"));
    }
    let mut out = Vec::with_capacity(256);
    let mut o = disagg_json::raw::Object::open(&mut out);
    if let Some(m) = raw("model") {
        o.raw("model", m);
    }
    o.raw("messages", raw("messages").unwrap_or(b"[]"));
    o.raw(
        "add_generation_prompt",
        raw("add_generation_prompt").unwrap_or(b"true"),
    );
    for key in [
        "continue_final_message",
        "chat_template",
        "chat_template_kwargs",
    ] {
        if let Some(v) = raw(key) {
            o.raw(key, v);
        }
    }
    o.close();
    Bytes::from(out)
}

/// The `/tokenize` body for a completions `prompt` (and the client's `model`, not
/// `null`), both as written.
pub(super) fn completion_tokenize(model: Option<&[u8]>, prompt: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(prompt.len() + 64);
    let mut o = disagg_json::raw::Object::open(&mut out);
    if let Some(m) = model {
        o.raw("model", m);
    }
    o.raw("prompt", prompt);
    o.close();
    Bytes::from(out)
}
