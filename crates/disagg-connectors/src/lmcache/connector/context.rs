//! The prefill engines' context lengths (`max_model_len`), remembered for a short time,
//! so that a request whose prompt ids were known without a `/tokenize` (the client's,
//! or a token-reading router's) does not ask its prefill for the length each time.
//!
//! Every `/tokenize` answer of a prefill tells its length: the prompt's, and the
//! one-character probe ([`context_length`]) a known-ids request asks when it needs the
//! length ([`needs_context`]). Each answer is remembered for [`TTL`] (10 s, as long as
//! the proxy keeps the engines' model lists), keyed by the engine's `/tokenize`
//! address: vLLM serves one model per engine, and its `/tokenize` answers that engine's
//! `max_model_len` whatever name (a served alias, a LoRA adapter) the request gives, so
//! the model is no part of the key; the data-parallel ranks of one engine (`URL@RANK`)
//! share its address and its entry. An answer without a length is remembered too (an
//! engine that does not tell it is not asked again for 10 s). So known-ids requests
//! ask at most once per engine per 10 s, and not at all while prompts of text keep
//! reaching that engine's `/tokenize`; requests that come together before the first
//! answer each ask (no lock is held across the call).
//!
//! An engine restarted with another `--max-model-len` behind the same address is read
//! anew within 10 s. Until then the remembered length may be stale:
//!
//! - a longer one than the engine's now lets a limit its context cannot hold pass (and
//!   gives a client without a limit more than the rest of it): the prefill runs and
//!   the decode refuses its leg (400, vLLM's words), as a decode with a shorter context
//!   than the prefill's does. A whole answer is that 400 as the decode wrote it; a
//!   stream has had its first token and ends with an error event carrying those words.
//! - a shorter one refuses nothing: a check it fails is made again on a fresh answer,
//!   and the request refused only on that. A client without a limit is given the rest
//!   of the remembered context, a shorter answer than it could have had.
//!
//! At most [`MAX_ENGINES`] engines are remembered. When a new one comes and the map is
//! full, the expired entries are dropped and, if none was, the one learned longest ago
//! (the next to expire anyway): clearing the map would send every engine's next
//! known-ids request to ask again at once. One is evicted only when more than 1,024
//! prefill engines answered within 10 s, and it costs that engine one probe more.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use disagg_core::endpoint::Endpoint;
use disagg_core::error::ConnectorError;
use disagg_core::transport::Transport;
use disagg_tokenize::prompt::BlockingLimit;
use http::Uri;
use tokio::time::Instant;

use super::Plan;
use super::ids::context_length;
use super::limit::{check_limit, check_min_tokens, needs_context};

/// How long a prefill's context length is remembered after its latest `/tokenize`
/// answer: the proxy's cache of the engines' model lists lasts as long.
const TTL: Duration = Duration::from_secs(10);

/// The most prefill engines whose context length is remembered.
const MAX_ENGINES: usize = 1024;

/// Each prefill engine's latest context length, by its `/tokenize` address.
#[derive(Debug, Default)]
pub(super) struct ContextLengths {
    engines: Mutex<HashMap<Uri, Learned>>,
}

/// One engine's context length (`None`: its answer gave none), and when it was told.
#[derive(Debug, Clone, Copy)]
struct Learned {
    length: Option<u64>,
    at: Instant,
}

/// The prefill's `/tokenize`, as `resolve` asks it: through `transport`, on `ep`, naming
/// the client's `model`, large answers read within `blocking`.
pub(super) struct Prefill<'a> {
    pub(super) transport: &'a dyn Transport,
    pub(super) ep: &'a Arc<Endpoint>,
    pub(super) model: Option<&'a [u8]>,
    pub(super) blocking: &'a BlockingLimit,
}

impl ContextLengths {
    /// The context length a request is held to, once its `min_tokens` and limit were
    /// checked against the room it leaves after a prompt of `prompt` ids
    /// ([`check_min_tokens`], [`check_limit`]). `told`: the length the prompt's own
    /// `/tokenize` answered (`Some`, remembered), or `None` when the ids were known.
    /// Then a request that [`needs_context`] takes the length remembered for the
    /// prefill, else asks it ([`context_length`]) and remembers the answer; a check the
    /// remembered length fails is made again on a fresh answer.
    ///
    /// # Errors
    ///
    /// The checks' refusals (400), and the failures of [`context_length`].
    pub(super) async fn checked(
        &self,
        plan: &Plan,
        prompt: usize,
        told: Option<Option<u64>>,
        prefill: Prefill<'_>,
    ) -> Result<Option<u64>, ConnectorError> {
        let check = |length: Option<u64>| -> Result<Option<u64>, ConnectorError> {
            check_min_tokens(plan, prompt, length)?;
            check_limit(plan, prompt, length).map(|()| length)
        };
        let key = prefill.ep.uri("/tokenize").ok();
        if let Some(length) = told {
            self.learn(key, length);
            return check(length);
        }
        if !needs_context(plan) {
            return check(None);
        }
        if let Some(length) = key.as_ref().and_then(|k| self.remembered(k))
            && let Ok(length) = check(length)
        {
            return Ok(length);
        }
        let Prefill {
            transport,
            ep,
            model,
            blocking,
        } = prefill;
        let length = context_length(transport, ep, model, blocking).await?;
        self.learn(key, length);
        check(length)
    }

    /// The length told for `key` less than [`TTL`] ago.
    fn remembered(&self, key: &Uri) -> Option<Option<u64>> {
        let learned = *self.lock().get(key)?;
        (learned.at.elapsed() < TTL).then_some(learned.length)
    }

    /// `length`, as the engine at `key` just told it; at most [`MAX_ENGINES`] kept.
    fn learn(&self, key: Option<Uri>, length: Option<u64>) {
        let Some(key) = key else {
            return;
        };
        let now = Instant::now();
        let mut engines = self.lock();
        if engines.len() >= MAX_ENGINES && !engines.contains_key(&key) {
            engines.retain(|_, learned| now.duration_since(learned.at) < TTL);
            if engines.len() >= MAX_ENGINES {
                let oldest = engines
                    .iter()
                    .min_by_key(|(_, learned)| learned.at)
                    .map(|(key, _)| key.clone());
                if let Some(oldest) = oldest {
                    engines.remove(&oldest);
                }
            }
        }
        engines.insert(key, Learned { length, at: now });
    }

    /// The map, whatever a panic elsewhere left it: each entry is written whole.
    fn lock(&self) -> MutexGuard<'_, HashMap<Uri, Learned>> {
        self.engines.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
