//! The tokens seam: a request's prompt as token ids, computed at most once per request
//! and only when something on its way asks for them.
//!
//! KV-cache-aware routing compares a request's token ids with the blocks the engines
//! report holding, and a connector may need the ids too (LMCache sends the prompt as
//! ids). A [`Tokenizer`] given to the orchestrator
//! ([`OrchestratorBuilder::tokenizer`](crate::orchestrator::OrchestratorBuilder::tokenizer))
//! runs once per request, after the connector's check and before the
//! [`Disaggregate`](crate::policy::Disaggregate) hook, and only when the router
//! or the hook says it reads tokens ([`Router::wants_tokens`](crate::Router::wants_tokens),
//! [`Disaggregate::wants_tokens`](crate::policy::Disaggregate::wants_tokens)). A
//! proxy whose policies read no tokens pays nothing per request, whatever tokenizer it
//! was given.
//!
//! The ids are then on the request ([`PdRequest::tokens`](crate::PdRequest::tokens)) and
//! in every [`RequestView`](crate::router::RequestView::tokens) of it: the hook, the
//! router on each attempt and the connector read the same ids.
//!
//! Tokenizing never fails a request: an error, a prompt that is not one sequence, or a
//! tokenizer slower than
//! [`OrchestratorConfig::tokenize_timeout`](crate::orchestrator::OrchestratorConfig::tokenize_timeout)
//! leaves the request without ids (logged at `debug`, counted in
//! [`OrchestratorStats::tokenize_failures`](crate::orchestrator::OrchestratorStats::tokenize_failures)),
//! and policies route it as they route a request without cache information.
//!
//! The implementations are in `disagg-tokenize` (a Hugging Face tokenizer in process,
//! or the engine's own `/tokenize`); this seam is the core's so that the core does not
//! depend on them.
//!
//! A tokenizer that asks an engine (its `/tokenize`) says which one on an [`Asked`]
//! ([`Tokenizer::token_ids_asking`]), and whether the engine answered. A call that
//! failed through the engine's fault (unreachable, 5xx, an unusable answer) or was
//! still unanswered when the tokenize budget ran out then counts against that engine
//! as a failed leg does: the orchestrator tells its listeners
//! ([`Listener::on_engine_call`](crate::outcome::Listener::on_engine_call)), and passive
//! health (`disagg-resilience`) ejects an engine whose calls keep failing, so requests
//! stop waiting on it. The wait stays bounded by the tokenize budget either way.

use std::sync::Arc;

use async_trait::async_trait;

use crate::endpoint::Endpoint;
use crate::error::BoxError;
use crate::request::Api;
use disagg_json::JsonBody;

/// A prompt's token ids, shared.
pub type TokenIds = Arc<[u32]>;

/// Gives the token ids of a request's prompt, as the engine will see them.
///
/// Contract:
/// - `api` and `body` are the request's API and its parsed top level;
/// - `Ok(Some(ids))`: the ids the engine computes for this request (same tokenizer,
///   chat template, special tokens), or routing by cached prefixes never matches;
/// - `Ok(None)`: the prompt is not one sequence this tokenizer reproduces (a batch,
///   images): not a failure, the request goes on without ids;
/// - `Err`: tokenizing failed; the request goes on without ids, and the failure is
///   logged and counted;
/// - cost: may do I/O (an engine's `/tokenize`) or CPU work in proportion to the
///   prompt; large CPU work belongs off the event loop. The orchestrator bounds the
///   wait with [`OrchestratorConfig::tokenize_timeout`](crate::orchestrator::OrchestratorConfig::tokenize_timeout).
#[async_trait]
pub trait Tokenizer: Send + Sync + 'static {
    /// The token ids of the prompt of `body`, a request for `api`.
    ///
    /// # Errors
    ///
    /// Whatever kept the tokenizer from giving ids, as the trait's contract says.
    async fn token_ids(&self, api: Api, body: &JsonBody) -> Result<Option<TokenIds>, BoxError>;

    /// [`token_ids`](Self::token_ids), filling in `asked`: which engine it asks (before
    /// it sends) and whether that engine answered; the orchestrator calls this one. A
    /// tokenizer that asks no engine leaves `asked` alone: the default does exactly
    /// that.
    ///
    /// # Errors
    ///
    /// As [`token_ids`](Self::token_ids).
    async fn token_ids_asking(
        &self,
        api: Api,
        body: &JsonBody,
        asked: &mut Asked,
    ) -> Result<Option<TokenIds>, BoxError> {
        let _ = asked;
        self.token_ids(api, body).await
    }
}

#[async_trait]
impl<T: Tokenizer + ?Sized> Tokenizer for Arc<T> {
    async fn token_ids(&self, api: Api, body: &JsonBody) -> Result<Option<TokenIds>, BoxError> {
        (**self).token_ids(api, body).await
    }

    async fn token_ids_asking(
        &self,
        api: Api,
        body: &JsonBody,
        asked: &mut Asked,
    ) -> Result<Option<TokenIds>, BoxError> {
        (**self).token_ids_asking(api, body, asked).await
    }
}

/// The engine a tokenizer asked for one request's token ids, and whether it answered
/// ([`Tokenizer::token_ids_asking`]): plain data the tokenizer fills in as it goes.
/// Made by the orchestrator per request (`Asked::default()`: nobody asked yet) and read
/// after the call ended or its budget ran out (the call is dropped then, and what it
/// had filled in stays).
#[derive(Debug, Default, Clone)]
#[non_exhaustive]
pub struct Asked {
    /// The engine the tokenizer is asking, set before it sends (`None`: it asked none).
    pub engine: Option<Arc<Endpoint>>,
    /// Whether the engine answered: with token ids, or with an error the request caused
    /// (a 4xx). It is not to blame then, whatever the tokenizer makes of the answer.
    pub answered: bool,
}
