//! The `kv_events` policy wired into the core's seams: [`KvEventsPick`], a per-leg
//! [`Pick`] over a [`KvScorer`], and [`CachedPrefixThreshold`], a
//! [`Disaggregate`] hook that counts only the prompt the best decode engine does not
//! already hold.
//!
//! Both read the request's token ids ([`RequestView::tokens`]) and say so
//! ([`Pick::wants_tokens`], [`Disaggregate::wants_tokens`]), so an orchestrator given a
//! tokenizer tokenizes each request once for them (see `disagg_core::tokens`). A
//! request without ids (no tokenizer, a prompt that is not one sequence, a tokenizer
//! failure) is left to their fallbacks.
//!
//! Engine ids: an endpoint's id is its base URL, with `@RANK` for a data-parallel rank
//! endpoint; the scorer's candidate is the base URL (the engine whose events the
//! [`Subscriber`](crate::Subscriber) files under it), pinned to the rank for a rank
//! endpoint. Name engines by the same URLs in the [`EngineEndpoint`](crate::EngineEndpoint)s.

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use disagg_core::Role;
use disagg_core::endpoint::Endpoint;
use disagg_core::policy::{Decision as Split, Disaggregate};
use disagg_core::router::{Pick, RequestView};
use disagg_core::source::EndpointSource;
use smallvec::SmallVec;

use crate::score::{Candidate, KvScorer};

/// The scorer's candidate for `ep`: its engine (the base URL) and, for a rank endpoint,
/// that rank only; `in_flight` as the endpoint's [`Endpoint::load`] says (its own count,
/// or its engine's when the engines' `/metrics` are read for it).
pub fn candidate(ep: &Endpoint) -> Candidate<'_> {
    let id = ep.id().as_str();
    match ep.rank() {
        Some(rank) => {
            let engine = id.rsplit_once('@').map_or(id, |(base, _)| base);
            Candidate::new(engine, ep.load()).with_dp_rank(rank)
        }
        None => Candidate::new(id, ep.load()),
    }
}

/// The fallback of [`KvEventsPick`] for requests without token ids: the fewest
/// requests in flight, the first in order among equals (deterministic, so replicas
/// with the same counts agree).
#[derive(Debug, Default, Clone, Copy)]
pub struct FewestInFlight;

impl Pick for FewestInFlight {
    fn pick(&self, _req: &RequestView<'_>, candidates: &[Arc<Endpoint>]) -> usize {
        candidates
            .iter()
            .enumerate()
            .min_by_key(|(i, ep)| (ep.load(), *i))
            .map_or(0, |(i, _)| i)
    }
}

/// The `kv_events` policy for one leg: the candidate whose cached prefix, traded
/// against its load, makes the request cheapest ([`KvScorer::choose`]).
///
/// Load is the work queued on each endpoint ([`KvScorer`]'s module docs): the uncached
/// tokens of the requests this pick sent there and still in flight, by the endpoint's
/// own in-flight count ([`Endpoint::in_flight`], held by the orchestrator for the leg),
/// or the engine's own load report when it publishes one and it says more. The chosen
/// engine gets a provisional entry for the prompt's blocks (until its own events
/// arrive), so the next request with the same prefix follows it.
///
/// A pick is recorded when it is made, not when its leg is sent: nothing of it is kept
/// per request, but a route that is picked and then never sent (a request that leaves
/// while waiting for a per-endpoint place, whose wait picks again at each wake-up; a
/// decode hold that refuses the pick; an encoder stage that fails) leaves its
/// provisional entry until [`ScorerConfig::provisional_ttl`](crate::ScorerConfig::provisional_ttl)
/// (5 s) and its pick among the engine's last [`RECENT_PICKS`](crate::score::RECENT_PICKS),
/// counted only while the engine's in-flight count says it is queued. The cost is a
/// routing estimate a few seconds too warm for that prefix, never a request lost.
///
/// For a whole-engine endpoint the scorer also knows which data-parallel rank holds
/// most; the route names no rank then, and the engine picks one.
///
/// Cost: one [`KvScorer::choose`] (microseconds for thousands of tokens; see the
/// crate's bench), plus a candidate per endpoint.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
///
/// use disagg_core::router::{Pick, RequestView};
/// use disagg_core::{request::Api, Endpoint, json::JsonBody, Role};
/// use disagg_kvevents::event::{BlockHash, BlockStored, EventBatch, KvEvent};
/// use disagg_kvevents::{IndexConfig, KvEventsPick, KvIndex, KvScorer, ScorerConfig};
///
/// let index = Arc::new(KvIndex::new(IndexConfig::default()));
/// let prompt: Vec<u32> = (0..33).collect();
/// let stored = BlockStored {
///     block_hashes: vec![BlockHash::Int(1), BlockHash::Int(2)],
///     token_ids: prompt[..32].to_vec(),
///     block_size: 16,
///     ..BlockStored::default()
/// };
/// let batch = EventBatch { ts: 0.0, events: vec![KvEvent::BlockStored(stored)], dp_rank: None };
/// index.apply("http://b:8000", 0, &batch);
///
/// let pick = KvEventsPick::new(Arc::new(KvScorer::new(index, ScorerConfig::default())));
/// let candidates = [
///     Arc::new(Endpoint::new("http://a:8000", Role::Prefill)?),
///     Arc::new(Endpoint::new("http://b:8000", Role::Prefill)?),
/// ];
/// let (headers, body) = (Default::default(), JsonBody::default());
/// let view = RequestView {
///     tokens: Some(&prompt),
///     ..RequestView::new(Api::Completions, None, &headers, &body)
/// };
/// assert_eq!(pick.pick(&view, &candidates), 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct KvEventsPick {
    scorer: Arc<KvScorer>,
    fallback: Box<dyn Pick>,
}

impl fmt::Debug for KvEventsPick {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvEventsPick")
            .field("scorer", &self.scorer)
            .finish_non_exhaustive()
    }
}

impl KvEventsPick {
    /// Picks with `scorer`; requests without token ids go to the endpoint with the
    /// fewest in flight ([`FewestInFlight`]).
    pub fn new(scorer: Arc<KvScorer>) -> Self {
        KvEventsPick {
            scorer,
            fallback: Box::new(FewestInFlight),
        }
    }

    /// Requests without token ids are picked by `fallback` instead.
    pub fn with_fallback(mut self, fallback: impl Pick) -> Self {
        self.fallback = Box::new(fallback);
        self
    }

    /// The scorer.
    pub fn scorer(&self) -> &Arc<KvScorer> {
        &self.scorer
    }
}

impl Pick for KvEventsPick {
    fn pick(&self, req: &RequestView<'_>, candidates: &[Arc<Endpoint>]) -> usize {
        let Some(tokens) = req.tokens else {
            return self.fallback.pick(req, candidates);
        };
        let scored: SmallVec<[Candidate<'_>; 8]> =
            candidates.iter().map(|ep| candidate(ep)).collect();
        let in_flight = |i: usize| candidates[i].load();
        match self
            .scorer
            .choose_with(tokens, &scored, in_flight, Instant::now())
        {
            Some(decision) => decision.index,
            None => self.fallback.pick(req, candidates),
        }
    }

    fn wants_tokens(&self) -> bool {
        true
    }
}

/// Conditional disaggregation on what the decode engines hold: disaggregate only when
/// the prompt's part that the best decode engine does not already cache is at least
/// `min_tokens` long.
///
/// A follow-up turn whose earlier turns sit in a decode engine's prefix cache (it
/// received their KV, or computed them) is then served by that decode alone, its
/// answer marked `x-disagg-handoff: direct` (reason `cached_on_decode`); a prompt
/// shorter than `min_tokens` altogether is `short_prompt`, as for
/// `disagg_affinity::PromptThreshold`. The best decode engine is the one among the
/// request's decode candidates (its model's) holding the longest prefix, by the index
/// and provisional entries ([`KvScorer::cached_tokens`]); pair it with
/// [`KvEventsPick`] as the decode policy, which sends the request there unless that
/// engine is much busier than another.
///
/// Requests without token ids are decided by the fallback hook (the proxy gives
/// `PromptThreshold` with the same threshold).
///
/// Cost: a snapshot of the endpoint set, one walk of the prompt's leading blocks for all
/// decode candidates ([`KvScorer::cached_tokens_each`]) and a lookup per candidate.
pub struct CachedPrefixThreshold {
    scorer: Arc<KvScorer>,
    source: Arc<dyn EndpointSource>,
    min_tokens: usize,
    fallback: Arc<dyn Disaggregate>,
}

impl fmt::Debug for CachedPrefixThreshold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachedPrefixThreshold")
            .field("min_tokens", &self.min_tokens)
            .finish_non_exhaustive()
    }
}

/// The reason a request whose prefix the decode engine holds is served direct.
pub const CACHED_ON_DECODE: &str = "cached_on_decode";

impl CachedPrefixThreshold {
    /// Disaggregate when at least `min_tokens` of the prompt are not cached on the best
    /// decode engine of `source`'s current set; requests without token ids are decided
    /// by `fallback`.
    pub fn new(
        scorer: Arc<KvScorer>,
        source: Arc<dyn EndpointSource>,
        min_tokens: usize,
        fallback: Arc<dyn Disaggregate>,
    ) -> Self {
        CachedPrefixThreshold {
            scorer,
            source,
            min_tokens,
            fallback,
        }
    }

    /// The most leading tokens of `tokens` any decode candidate for `model` holds.
    pub fn best_decode_cached(&self, model: Option<&str>, tokens: &[u32]) -> usize {
        let set = self.source.snapshot();
        let Ok(set) = set.for_model(model) else {
            return 0;
        };
        // One lookup for all of them: the prompt walked once, not once per candidate.
        let decode: Vec<Candidate<'_>> = set
            .by_role(Role::Decode)
            .iter()
            .map(|ep| candidate(ep))
            .collect();
        self.scorer
            .cached_tokens_each(&decode, tokens)
            .into_iter()
            .max()
            .unwrap_or(0)
    }
}

impl Disaggregate for CachedPrefixThreshold {
    fn decide(&self, req: &RequestView<'_>) -> Split {
        let Some(tokens) = req.tokens else {
            return self.fallback.decide(req);
        };
        if tokens.len() < self.min_tokens {
            return Split::Direct {
                reason: "short_prompt",
            };
        }
        let cached = self.best_decode_cached(req.model, tokens);
        if tokens.len() - cached.min(tokens.len()) < self.min_tokens {
            Split::Direct {
                reason: CACHED_ON_DECODE,
            }
        } else {
            Split::Disaggregate
        }
    }

    fn wants_tokens(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use disagg_core::policy::Always;
    use disagg_core::{Role, json::JsonBody, request::Api, source::StaticSource};
    use http::HeaderMap;

    use super::*;
    use crate::event::{BlockHash, BlockStored, EventBatch, KvEvent};
    use crate::index::{IndexConfig, KvIndex};
    use crate::score::ScorerConfig;

    fn store(index: &KvIndex, engine: &str, rank: u32, tokens: &[u32]) {
        let blocks = tokens.len() / 16;
        let stored = BlockStored {
            block_hashes: (0..blocks as u64)
                .map(|b| BlockHash::Int(b + 100 * u64::from(rank)))
                .collect(),
            token_ids: tokens[..blocks * 16].to_vec(),
            block_size: 16,
            ..BlockStored::default()
        };
        let batch = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored(stored)],
            dp_rank: Some(rank),
        };
        index.apply(engine, rank, &batch);
    }

    fn eps(urls: &[&str], role: Role) -> Vec<Arc<Endpoint>> {
        urls.iter()
            .map(|u| Arc::new(Endpoint::new(u, role).unwrap()))
            .collect()
    }

    fn scorer(index: Arc<KvIndex>) -> Arc<KvScorer> {
        Arc::new(KvScorer::new(index, ScorerConfig::default()))
    }

    #[test]
    fn rank_endpoints_score_as_their_engines_rank() {
        let index = Arc::new(KvIndex::new(IndexConfig::default()));
        let prompt: Vec<u32> = (0..65).collect();
        store(&index, "http://e:1", 1, &prompt);
        let pick = KvEventsPick::new(scorer(index));
        let candidates = eps(&["http://e:1@0", "http://e:1@1"], Role::Prefill);
        let (h, b) = (HeaderMap::new(), JsonBody::default());
        let view = RequestView {
            tokens: Some(&prompt),
            ..RequestView::new(Api::Completions, None, &h, &b)
        };
        assert_eq!(pick.pick(&view, &candidates), 1);
        assert_eq!(candidate(&candidates[1]).engine, "http://e:1");
        assert_eq!(candidate(&candidates[1]).dp_rank, Some(1));
    }

    #[test]
    fn without_tokens_the_least_loaded_endpoint_is_picked() {
        let index = Arc::new(KvIndex::new(IndexConfig::default()));
        let prompt: Vec<u32> = (0..65).collect();
        store(&index, "http://a:1", 0, &prompt);
        let pick = KvEventsPick::new(scorer(index));
        let candidates = eps(&["http://a:1", "http://b:1"], Role::Prefill);
        let _busy = candidates[0].track();
        let (h, b) = (HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Completions, None, &h, &b);
        assert_eq!(pick.pick(&view, &candidates), 1);
        assert!(pick.wants_tokens());
    }

    #[test]
    fn only_the_uncached_part_on_the_best_decode_counts() {
        let index = Arc::new(KvIndex::new(IndexConfig::default()));
        let prompt: Vec<u32> = (0..200).collect();
        // d2 holds the first 160 tokens: 40 are left, below 64.
        store(&index, "http://d2:1", 0, &prompt[..160]);
        store(&index, "http://d1:1", 0, &prompt[..32]);
        let source = StaticSource::new(
            eps(&["http://p:1"], Role::Prefill)
                .into_iter()
                .chain(eps(&["http://d1:1", "http://d2:1"], Role::Decode))
                .map(|e| Endpoint::new(e.id().as_str(), e.role()).unwrap()),
        );
        let hook =
            CachedPrefixThreshold::new(scorer(index), Arc::new(source), 64, Arc::new(Always));
        let (h, b) = (HeaderMap::new(), JsonBody::default());
        let view = |t: Option<&'static [u32]>| RequestView {
            tokens: t,
            ..RequestView::new(Api::Completions, None, &h, &b)
        };
        let prompt: &'static [u32] = Vec::leak(prompt);
        assert_eq!(
            hook.decide(&view(Some(prompt))),
            Split::Direct {
                reason: CACHED_ON_DECODE
            }
        );
        assert_eq!(hook.best_decode_cached(None, prompt), 160);
        // 40 more uncached tokens than the threshold allows: disaggregated.
        let longer: &'static [u32] = Vec::leak((0..224).collect());
        assert_eq!(hook.decide(&view(Some(longer))), Split::Disaggregate);
        let short: &'static [u32] = Vec::leak((1000..1010).collect());
        assert_eq!(
            hook.decide(&view(Some(short))),
            Split::Direct {
                reason: "short_prompt"
            }
        );
        // No tokens: the fallback (here: always disaggregate).
        assert_eq!(hook.decide(&view(None)), Split::Disaggregate);
    }

    #[test]
    fn the_decode_candidates_are_looked_up_in_one_walk_of_the_prompt() {
        // A long prompt (4,096 blocks) and 64 decode engines, two holding its first
        // blocks: `decide` keys the prompt as far as one holds it, once, and walks the
        // index once (it keyed all 4,096 blocks and walked the index per engine).
        let index = Arc::new(KvIndex::new(IndexConfig::default()));
        let prompt: &'static [u32] = Vec::leak((0..65_536).collect());
        store(&index, "http://d7:1", 0, &prompt[..640]);
        let scorer = scorer(index);
        let urls: Vec<String> = (0..64).map(|i| format!("http://d{i}:1")).collect();
        let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
        let decode = eps(&urls, Role::Decode);
        scorer.choose(&prompt[..1_600], &[candidate(&decode[9])]);
        let source =
            StaticSource::new(urls.iter().map(|u| Endpoint::new(u, Role::Decode).unwrap()));
        let hook =
            CachedPrefixThreshold::new(Arc::clone(&scorer), Arc::new(source), 64, Arc::new(Always));
        let (h, b) = (HeaderMap::new(), JsonBody::default());
        let view = RequestView {
            tokens: Some(prompt),
            ..RequestView::new(Api::Completions, None, &h, &b)
        };
        let (keys, walks) = crate::score::work::counts();
        assert_eq!(hook.decide(&view), Split::Disaggregate);
        let (now_keys, now_walks) = crate::score::work::counts();
        assert!(now_keys - keys <= 101, "{} block keys", now_keys - keys);
        assert_eq!(now_walks - walks, 1);
        // The same as asking for each engine alone.
        let each = decode
            .iter()
            .map(|ep| scorer.cached_tokens(&candidate(ep), prompt))
            .max();
        assert_eq!(hook.best_decode_cached(None, prompt), 1_600);
        assert_eq!(each, Some(1_600));
    }
}
