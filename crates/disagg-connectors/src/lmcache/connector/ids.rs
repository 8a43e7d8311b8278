//! The prompt's token ids, within the connector's ceiling
//! ([`Lmcache::with_max_prompt_tokens`](super::Lmcache::with_max_prompt_tokens)), and
//! whose fault it is when there are none: the client's (its prompt), the proxy's (its
//! blocking pool), or the prefill engine's (its `/tokenize`).

use std::sync::Arc;

use bytes::Bytes;
use disagg_core::endpoint::Endpoint;
use disagg_core::error::{ConnectorError, error_chain};
use disagg_core::transport::Transport;
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
/// message), no prompt at all, ids that are no list of token ids. A job the blocking
/// pool lost is [`ConnectorError::NotReady`] (the proxy's, no engine's); an endpoint
/// whose address makes no `/tokenize` URI is [`ConnectorError::NotConfigured`]; any
/// other failure of `/tokenize` is the prefill engine's, [`ConnectorError::Engine`].
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
            let answer = ask(transport, ep, body, max, blocking).await?;
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

/// The prefill engine's context length (its `/tokenize` answer's `max_model_len`, when a
/// positive integer), for a prompt whose ids were known without a `/tokenize`: asked
/// with the client's `model` (unless `null`) and a prompt of one character, since only
/// the answer's `max_model_len` is read. Asked afresh each time (no state: an engine
/// restarted with another `--max-model-len` behind the same address is read anew),
/// and only for a client without a token limit, whose decode gets the rest of the
/// context.
///
/// # Errors
///
/// As [`prompt_ids`]' `/tokenize`: a failure of the engine's is
/// [`ConnectorError::Engine`], naming the prefill.
pub(super) async fn context_length(
    transport: &dyn Transport,
    ep: &Arc<Endpoint>,
    model: Option<&[u8]>,
    max: usize,
    blocking: &BlockingLimit,
) -> Result<Option<u64>, ConnectorError> {
    let body = super::completion_tokenize(model.filter(|m| *m != b"null"), br#"".""#);
    let answer = ask(transport, ep, body, max, blocking).await?;
    Ok(answer.max_model_len)
}

/// The prefill's `/tokenize` answer to `body`, of at most `max` ids.
async fn ask(
    transport: &dyn Transport,
    ep: &Arc<Endpoint>,
    body: Bytes,
    max: usize,
    blocking: &BlockingLimit,
) -> Result<TokenizeAnswer, ConnectorError> {
    let uri = ep
        .uri("/tokenize")
        .map_err(|_| ConnectorError::NotConfigured {
            endpoint: ep.id().clone(),
            what: "address that makes a `/tokenize` URI",
        })?;
    request_answer(transport, uri, body, max, blocking)
        .await
        .map_err(|e| tokenize_error(ep, e, max))
}

/// The request's failure when the prefill's `/tokenize` on `ep` gave no ids: an answer
/// of more than `max` ids (or longer than one of `max` ids can be) or a refusal of the
/// client's prompt (400, 422) is the client's, a job the blocking pool lost the
/// proxy's, anything else the engine's.
fn tokenize_error(ep: &Endpoint, e: IdsError, max: usize) -> ConnectorError {
    match e {
        IdsError::TooMany { .. } => too_long(max),
        IdsError::Engine(EngineError::Body(b)) if b.is::<http_body_util::LengthLimitError>() => {
            too_long(max)
        }
        // vLLM answers 400 for a prompt it cannot take (none, a malformed message, an
        // unknown chat template field) and FastAPI 422 for a body off its schema: the
        // engine worked, the request was the client's fault.
        IdsError::Engine(EngineError::Status { status, message })
            if matches!(status.as_u16(), 400 | 422) =>
        {
            refused(format!(
                "a prompt its prefill engine refused to tokenize ({status}: {message})"
            ))
        }
        IdsError::Blocking(e) => lost("reading the prefill's `/tokenize` answer", &e),
        e => ConnectorError::Engine {
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
