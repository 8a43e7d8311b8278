//! The token ids of a request's prompt, exactly as the engine tokenizes it.
//!
//! KV-cache-aware routing (`disagg-kvevents`: `KvScorer::choose(tokens, ...)`) compares
//! a request's token ids with the blocks each engine reports holding. Those ids must be
//! the engine's own: the same tokenizer, the same chat template, the same special
//! tokens, or no prefix ever matches. This crate gives them behind one seam,
//! [`Tokenize`]:
//!
//! - [`HfTokenizer`] (feature `hf`, default): the model's `tokenizer.json` and chat
//!   template, in process, reproducing vLLM 0.33's chat and completions preprocessing
//!   (see [`prompt`] for the fields and defaults, [`hf`] for what is loaded);
//! - [`EngineTokenizer`]: the engine's own `POST /tokenize` over the proxy's
//!   [`Transport`](disagg_core::transport::Transport): exact by construction, one round trip per
//!   request.
//!
//! Token-id prompts (`"prompt": [1, 2, 3]`) are taken as they are by both. Prompts
//! that are not one sequence (batches, images, embeddings) give
//! [`TokenizeError::NotSupported`]: the caller routes such a request without cache
//! information.
//!
//! # Cost
//!
//! [`HfTokenizer`], measured by `cargo bench -p disagg-tokenize --bench tokenize`
//! (release build, a 2-core x86-64 VM shared with other builds, the tests' byte-level
//! BPE tokenizer of 4,000 entries with Llama 3's pre-tokenizer, English-like text with
//! numbers and some non-ASCII words), on the calling thread:
//!
//! | prompt | completions (text) | chat (template, then text) |
//! |---|---|---|
//! | 2k tokens (7.6 KB) | 1.2 ms | 1.3 ms |
//! | 32k tokens (122 KB) | 25.8 ms | 25.3 ms |
//!
//! About 6 MB/s, a little slower on long texts; the template adds little (a few
//! percent). That is too long to run on an event loop that serves other connections:
//! prompts from [`DEFAULT_OFF_LOOP_FROM`](hf::DEFAULT_OFF_LOOP_FROM) bytes (4 KiB) on
//! are tokenized on Tokio's blocking pool. A router that tokenizes every request pays
//! this per request; [`EngineTokenizer`] pays a round trip instead, and the engine's
//! own tokenization.
//!
//! Reading the prompt out of the body ([`Prompt::read`]) is cheaper (about 400 MB/s for
//! token ids, 100 ms for a 32 MiB list of them); both tokenizers read a body of
//! [`READ_OFF_LOOP_FROM`](prompt::READ_OFF_LOOP_FROM) bytes (256 KiB) or more on the
//! blocking pool as well, [`EngineTokenizer`] checking the messages and writing its
//! request there too. Each tokenizer has at most so many jobs there at once
//! ([`BlockingLimit`](prompt::BlockingLimit), by default as many as the process has
//! cores); a call dropped before its job starts (the client gone, the tokenize timeout)
//! runs nothing.
//!
//! # Examples
//!
//! ```
//! use disagg_core::{request::Api, json::JsonBody};
//! use disagg_tokenize::{Prompt, PromptInput, TokenizeError};
//!
//! // What a tokenizer will do with a request, without tokenizing it.
//! let body = JsonBody::parse(br#"{"model": "m", "prompt": [1, 2, 3]}"#)?;
//! let prompt = Prompt::read(Api::Completions, &body)?;
//! assert!(matches!(prompt.input, PromptInput::Ids(ref ids) if ids == &[1, 2, 3]));
//!
//! let batch = JsonBody::parse(br#"{"prompt": ["a", "b"]}"#)?;
//! let err = Prompt::read(Api::Completions, &batch).unwrap_err();
//! assert!(err.is_not_supported());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

// docs.rs builds with `--cfg docsrs` (package.metadata.docs.rs) on a nightly toolchain,
// where each feature-gated item is marked with the features it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod engine;
pub mod error;
#[cfg(feature = "hf")]
#[cfg_attr(docsrs, doc(cfg(feature = "hf")))]
pub mod hf;
pub mod prompt;
mod walk;

use std::sync::Arc;

use async_trait::async_trait;
use disagg_core::json::JsonBody;
use disagg_core::request::Api;

pub use engine::EngineTokenizer;
pub use error::{EngineError, TokenizeError};
#[cfg(feature = "hf")]
#[cfg_attr(docsrs, doc(cfg(feature = "hf")))]
pub use hf::{ContentFormat, HfTokenizer, LoadError};
pub use prompt::{ChatPrompt, Prompt, PromptInput, Side, Truncation};

/// A prompt's token ids, shared.
pub type Tokens = Arc<[u32]>;

/// Turns a request's prompt into the token ids the engine will see.
///
/// Contract:
/// - `api` and `body` are the request's API and its parsed top level, as the proxy
///   holds them ([`PdRequest::api`](disagg_core::PdRequest::api),
///   [`PdRequest::body`](disagg_core::PdRequest::body));
/// - the ids are those the engine computes for the same request (vLLM 0.33's rules:
///   special tokens, chat template, `truncate_prompt_tokens`);
/// - cost: an implementation may do I/O (the engine's `/tokenize`) or CPU work
///   proportional to the prompt; large CPU work runs off the event loop;
/// - `Err` means no ids for this request: [`TokenizeError::NotSupported`] for prompts
///   that are not one sequence, the others for failures. Either way the request can
///   still be served, routed without cache information.
#[async_trait]
pub trait Tokenize: Send + Sync + 'static {
    /// The token ids of the prompt of `body`, a request for `api`.
    ///
    /// # Errors
    ///
    /// [`TokenizeError`], as the trait's contract says.
    async fn tokenize(&self, api: Api, body: &JsonBody) -> Result<Tokens, TokenizeError>;
}

#[async_trait]
impl<T: Tokenize + ?Sized> Tokenize for Arc<T> {
    async fn tokenize(&self, api: Api, body: &JsonBody) -> Result<Tokens, TokenizeError> {
        (**self).tokenize(api, body).await
    }
}

/// The core's tokens seam ([`disagg_core::tokens`]) over a [`Tokenize`]: a prompt that
/// is not one sequence ([`TokenizeError::NotSupported`]) has no ids (`Ok(None)`, not a
/// failure); every other error is a failure the orchestrator logs and counts.
async fn token_ids<T: Tokenize + ?Sized>(
    tokenizer: &T,
    api: Api,
    body: &JsonBody,
) -> Result<Option<Tokens>, disagg_core::error::BoxError> {
    match tokenizer.tokenize(api, body).await {
        Ok(ids) => Ok(Some(ids)),
        Err(e) if e.is_not_supported() => Ok(None),
        Err(e) => Err(Box::new(e)),
    }
}

/// Any shared [`Tokenize`] (`Arc<dyn Tokenize>`) is the orchestrator's tokenizer
/// (`OrchestratorBuilder::tokenizer`): a prompt that is not one sequence has no ids
/// (`Ok(None)`), every other [`TokenizeError`] is a failure the orchestrator counts.
#[async_trait]
impl disagg_core::tokens::Tokenizer for dyn Tokenize {
    async fn token_ids(
        &self,
        api: Api,
        body: &JsonBody,
    ) -> Result<Option<Tokens>, disagg_core::error::BoxError> {
        token_ids(self, api, body).await
    }
}

/// The engine's `/tokenize` as the orchestrator's tokenizer: the engine it asks is
/// named to the orchestrator, which counts a failed or unanswered call against it.
#[async_trait]
impl disagg_core::tokens::Tokenizer for EngineTokenizer {
    async fn token_ids(
        &self,
        api: Api,
        body: &JsonBody,
    ) -> Result<Option<Tokens>, disagg_core::error::BoxError> {
        token_ids(self, api, body).await
    }

    async fn token_ids_asking(
        &self,
        api: Api,
        body: &JsonBody,
        asked: &mut disagg_core::tokens::Asked,
    ) -> Result<Option<Tokens>, disagg_core::error::BoxError> {
        match self.tokenize_asking(api, body, asked).await {
            Ok(ids) => Ok(Some(ids)),
            Err(e) if e.is_not_supported() => Ok(None),
            Err(e) => Err(Box::new(e)),
        }
    }
}

/// A Hugging Face tokenizer as the orchestrator's tokenizer.
#[cfg(feature = "hf")]
#[async_trait]
impl disagg_core::tokens::Tokenizer for HfTokenizer {
    async fn token_ids(
        &self,
        api: Api,
        body: &JsonBody,
    ) -> Result<Option<Tokens>, disagg_core::error::BoxError> {
        token_ids(self, api, body).await
    }
}
