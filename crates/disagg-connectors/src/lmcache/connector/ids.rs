//! The prompt's token ids, within the connector's ceiling
//! ([`Lmcache::with_max_prompt_tokens`](super::Lmcache::with_max_prompt_tokens)).

use std::sync::Arc;

use bytes::Bytes;
use disagg_core::endpoint::Endpoint;
use disagg_core::error::ConnectorError;
use disagg_core::transport::Transport;
use disagg_tokenize::EngineError;
use disagg_tokenize::engine::{IdsError, read_ids, request_tokens};
use disagg_tokenize::prompt::BlockingLimit;

use super::engine_error;

/// The prompt's token ids, at most `max` of them: the prefill engine's `/tokenize`
/// answer to `tokenize` (the exchange `disagg-tokenize`'s `EngineTokenizer` makes too)
/// when the prompt is to be tokenized, else the client's own ids (`prompt`, a JSON
/// list). Lists are decoded no further than the first id past `max`, the answer read no
/// further than one of `max` ids can take, and large lists decoded on the blocking pool
/// within `blocking`.
///
/// # Errors
///
/// [`ConnectorError::Unsupported`] (400) for more than `max` ids, else
/// [`ConnectorError::Engine`] naming the step that failed.
pub(super) async fn prompt_ids(
    transport: &dyn Transport,
    ep: &Arc<Endpoint>,
    tokenize: Option<Bytes>,
    prompt: Option<Bytes>,
    max: usize,
    blocking: &BlockingLimit,
) -> Result<Arc<[u64]>, ConnectorError> {
    match (tokenize, prompt) {
        (Some(body), _) => {
            let uri = ep
                .uri("/tokenize")
                .map_err(|e| engine_error(ep, "/tokenize", Box::new(e)))?;
            let ids = request_tokens(transport, uri, body, max, blocking)
                .await
                .map_err(|e| ids_error(ep, "/tokenize", e, max))?;
            // Widened once counted: at most `max` of them.
            Ok(ids.into_iter().map(u64::from).collect())
        }
        (None, Some(raw)) => read_ids::<u64>(raw, max, blocking)
            .await
            .map(Arc::from)
            .map_err(|e| ids_error(ep, "reading the prompt's token ids", e, max)),
        (None, None) => Err(engine_error(ep, "/tokenize", "no prompt".into())),
    }
}

/// The request's failure when `what` on `ep` gave no ids: a prompt of more than `max`
/// ids (or a `/tokenize` answer longer than one of `max` ids can be) is the client's
/// (400, [`ConnectorError::Unsupported`]), anything else the engine's.
fn ids_error(ep: &Endpoint, what: &'static str, e: IdsError, max: usize) -> ConnectorError {
    let too_long = match &e {
        IdsError::TooMany { .. } => true,
        IdsError::Engine(EngineError::Body(b)) => b.is::<http_body_util::LengthLimitError>(),
        _ => false,
    };
    if too_long {
        return ConnectorError::Unsupported {
            connector: "lmcache",
            what: format!("a prompt of more than {max} token ids"),
        };
    }
    engine_error(ep, what, Box::new(e))
}
