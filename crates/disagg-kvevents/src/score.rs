//! [`KvScorer`]: the routing decision of the `kv_events` policy, as a plain synchronous
//! library call a `Router` wraps.
//!
//! # How a choice is made
//!
//! For a request's token ids and the candidate engines (with their requests in flight):
//!
//! 1. Each candidate's **cached tokens**: the longest leading run of the prompt's full
//!    blocks it holds, by the [`KvIndex`] (its best DP rank) or by a provisional entry
//!    (below), whichever is longer.
//! 2. Each candidate's **cost**, in tokens of prefill work before this request's first
//!    token: `uncached × miss_weight + pending + in_flight × in_flight_cost_tokens`, where `uncached`
//!    is the prompt minus its cached tokens, `pending` the uncached tokens of the
//!    requests this scorer sent there whose [`PrefillWork`] is still alive, and the last
//!    term the caller's in-flight count at a configured price (for load the scorer did
//!    not route itself).
//! 3. The cheapest candidate wins; ties go to the longer cached prefix, then fewer in
//!    flight, then candidate order (so replicas that see the same state agree).
//! 4. The request's blocks are recorded as a **provisional entry** for the winner, for
//!    [`ScorerConfig::provisional_ttl`]: its KV events arrive only once its prefill ran,
//!    and until then the next request with the same prefix (the next turn, a burst
//!    sharing a system prompt) must find it there rather than start it elsewhere.
//!
//! Prefill time is close to proportional to the tokens computed, so the cost is the
//! engine's queue of work plus this request's own share: the time to first token, up to
//! a constant. A long cached prefix wins until the engine holding it is busier, by more
//! than the prefix is worth, than another engine.
//!
//! # Cost
//!
//! The prompt's blocks hashed once per block size (usually one), one index walk, one
//! walk of the provisional entries under a short lock, and a few map lookups per
//! candidate: microseconds for thousands of tokens (see the crate's bench).

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::index::{KvIndex, PrefixMatch};
use crate::key::{BlockKeys, KeyMix};

/// Maps keyed by engine ids (configured, not chosen by clients) or candidate tags:
/// XXH3, several times cheaper than SipHash on short keys.
type FastMap<K, V> = HashMap<K, V, xxhash_rust::xxh3::Xxh3DefaultBuilder>;

/// How long a provisional entry lasts by default: 5 s, longer than a prefill of tens of
/// thousands of tokens queued behind a few others, after which the engine's own events
/// (or their absence: the blocks were not kept) say what it holds.
pub const DEFAULT_PROVISIONAL_TTL: Duration = Duration::from_secs(5);

/// The most blocks of provisional entries kept by default: 65,536 (about 2 MiB); the
/// oldest entries go first beyond it.
pub const DEFAULT_PROVISIONAL_MAX_BLOCKS: usize = 1 << 16;

/// Settings of a [`KvScorer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScorerConfig {
    /// How long the blocks of a request just routed count as held by its engine.
    pub provisional_ttl: Duration,
    /// The most provisional blocks kept, over all engines.
    pub provisional_max_blocks: usize,
    /// What one request in flight on a candidate (as the caller counts it) costs, in
    /// tokens of prefill work. 0 (the default) when the caller keeps each decision's
    /// [`PrefillWork`] until its prefill ends, which measures the same load in tokens;
    /// the mean uncached prompt length otherwise.
    pub in_flight_cost_tokens: u64,
    /// What one uncached token costs relative to one token of queued work (default
    /// 1: the time to first token alone). Above 1, a miss also pays for what it
    /// evicts elsewhere and for the copy of the prefix it makes: requests stay with the
    /// engine holding their prefix longer before load moves them.
    pub miss_weight: u64,
}

impl Default for ScorerConfig {
    fn default() -> Self {
        ScorerConfig {
            provisional_ttl: DEFAULT_PROVISIONAL_TTL,
            provisional_max_blocks: DEFAULT_PROVISIONAL_MAX_BLOCKS,
            in_flight_cost_tokens: 0,
            miss_weight: 1,
        }
    }
}

/// One candidate: an engine, or one data-parallel rank of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate<'a> {
    /// The engine's id, as its events are fed to the [`KvIndex`].
    pub engine: &'a str,
    /// `Some(r)`: only rank `r`'s cache counts (a router whose endpoints are ranks);
    /// `None`: the engine's best rank (reported in [`Decision::dp_rank`]).
    pub dp_rank: Option<u32>,
    /// Its requests in flight on this leg, as the caller counts them.
    pub in_flight: usize,
}

impl<'a> Candidate<'a> {
    /// An engine (any rank) with `in_flight` requests in flight.
    pub fn new(engine: &'a str, in_flight: usize) -> Self {
        Candidate {
            engine,
            dp_rank: None,
            in_flight,
        }
    }

    /// Only rank `dp_rank` of the engine.
    pub fn with_dp_rank(mut self, dp_rank: u32) -> Self {
        self.dp_rank = Some(dp_rank);
        self
    }

    /// The candidate as the provisional entries and pending work know it.
    fn tag(&self) -> u64 {
        candidate_tag(self.engine, self.dp_rank)
    }
}

/// The uncached tokens of a routed request, counted as pending work on its engine
/// while this value lives. Keep it until the request's prefill ends (e.g. in the
/// response body, next to the in-flight guard); drop it at once not to count it.
pub struct PrefillWork {
    counter: Option<Arc<AtomicU64>>,
    tokens: u64,
}

impl fmt::Debug for PrefillWork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrefillWork")
            .field("tokens", &self.tokens)
            .finish()
    }
}

impl PrefillWork {
    /// The tokens counted.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }
}

impl Drop for PrefillWork {
    fn drop(&mut self) {
        if let Some(counter) = &self.counter {
            counter.fetch_sub(self.tokens, Ordering::Relaxed);
        }
    }
}

/// A routing decision.
#[derive(Debug)]
pub struct Decision {
    /// The chosen candidate, an index into the candidates given.
    pub index: usize,
    /// The data-parallel rank of the chosen engine that holds the most, when its
    /// events say (a router may pin the request there).
    pub dp_rank: Option<u32>,
    /// Leading tokens of the prompt the chosen engine holds (index or provisional).
    pub cached_tokens: usize,
    /// Tokens it will compute.
    pub uncached_tokens: usize,
    /// The winning cost (see the [module docs](self)).
    pub cost: u64,
    /// The request's uncached tokens as pending work on the chosen engine.
    pub work: PrefillWork,
}

/// Chooses an engine for a prompt from the engines' cached prefixes and loads; see the
/// [module docs](self).
///
/// Synchronous: no I/O, no await; locks held for a walk of the request's blocks at
/// most. Share it in an `Arc`.
pub struct KvScorer {
    index: Arc<KvIndex>,
    config: ScorerConfig,
    provisional: Mutex<Provisional>,
    /// Pending prefill tokens by candidate tag.
    pending: Mutex<FastMap<u64, Arc<AtomicU64>>>,
}

impl fmt::Debug for KvScorer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvScorer")
            .field("config", &self.config)
            .field("provisional_blocks", &lock(&self.provisional).blocks)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics under these locks; a half-updated state is still a valid one.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A candidate as the provisional entries and pending work know it: a hash of its id
/// and rank.
fn candidate_tag(engine: &str, dp_rank: Option<u32>) -> u64 {
    let seed = dp_rank.map_or(0, |r| u64::from(r) + 1);
    xxhash_rust::xxh3::xxh3_64_with_seed(engine.as_bytes(), seed)
}

// === impl KvScorer ===

impl KvScorer {
    /// A scorer reading `index`.
    pub fn new(index: Arc<KvIndex>, config: ScorerConfig) -> Self {
        KvScorer {
            index,
            config,
            provisional: Mutex::default(),
            pending: Mutex::default(),
        }
    }

    /// The index read.
    pub fn index(&self) -> &Arc<KvIndex> {
        &self.index
    }

    /// The settings.
    pub fn config(&self) -> &ScorerConfig {
        &self.config
    }

    /// Chooses among `candidates` for a prompt of `tokens`, and records the choice
    /// (provisional entry, pending work). `None` when there is no candidate.
    pub fn choose(&self, tokens: &[u32], candidates: &[Candidate<'_>]) -> Option<Decision> {
        self.choose_at(tokens, candidates, Instant::now())
    }

    /// [`choose`](Self::choose) at a given time (for tests and simulations).
    pub fn choose_at(
        &self,
        tokens: &[u32],
        candidates: &[Candidate<'_>],
        now: Instant,
    ) -> Option<Decision> {
        if candidates.is_empty() {
            return None;
        }
        let sizes = self.block_sizes(candidates);
        let tags: Vec<u64> = candidates.iter().map(Candidate::tag).collect();
        // Per candidate: cached tokens and the rank holding them; per block size, the
        // keys, the index's matches and the provisional ones.
        let mut cached: Vec<(usize, Option<u32>)> = vec![(0, None); candidates.len()];
        let mut keys_by_size: Vec<BlockKeys> = Vec::with_capacity(sizes.len());
        for &block_size in &sizes {
            let keys = BlockKeys::new(tokens, block_size);
            let matched: PrefixMatch = self.index.match_keys(&keys);
            // Each holder's match by (engine, rank) and each engine's best, looked up
            // once per candidate (a scan per candidate would be quadratic).
            let n = matched.holders().len();
            let mut by_rank: FastMap<(&str, u32), usize> =
                FastMap::with_capacity_and_hasher(n, Default::default());
            let mut by_engine: FastMap<&str, (usize, u32)> =
                FastMap::with_capacity_and_hasher(n, Default::default());
            for m in matched.holders() {
                by_rank.insert((&*m.engine, m.dp_rank), m.tokens());
                let best = by_engine
                    .entry(&*m.engine)
                    .or_insert((m.tokens(), m.dp_rank));
                if (m.tokens(), std::cmp::Reverse(m.dp_rank)) > (best.0, std::cmp::Reverse(best.1))
                {
                    *best = (m.tokens(), m.dp_rank);
                }
            }
            let provisional = lock(&self.provisional).matches(&keys, now);
            for (i, c) in candidates.iter().enumerate() {
                let from_index = match c.dp_rank {
                    Some(r) => by_rank.get(&(c.engine, r)).map(|&t| (t, r)),
                    None => by_engine.get(c.engine).copied(),
                };
                let entry = &mut cached[i];
                if let Some((t, rank)) = from_index
                    && (t > entry.0 || (t == entry.0 && entry.1.is_none()))
                {
                    *entry = (t, Some(rank));
                }
                if let Some(&blocks) = provisional.get(&tags[i]) {
                    entry.0 = entry.0.max(blocks * block_size);
                }
            }
            keys_by_size.push(keys);
        }
        let pending: Vec<u64> = {
            let map = lock(&self.pending);
            tags.iter()
                .map(|t| map.get(t).map_or(0, |p| p.load(Ordering::Relaxed)))
                .collect()
        };
        let len = tokens.len();
        let mut best: Option<(u64, usize, usize, usize)> = None; // (cost, cached, in_flight, i)
        for (i, c) in candidates.iter().enumerate() {
            let hit = cached[i].0.min(len);
            let in_flight = c.in_flight as u64;
            let cost = ((len - hit) as u64).saturating_mul(self.config.miss_weight)
                + pending[i]
                + in_flight.saturating_mul(self.config.in_flight_cost_tokens);
            let better = best.is_none_or(|(b_cost, b_hit, b_load, _)| {
                (cost, std::cmp::Reverse(hit), c.in_flight)
                    < (b_cost, std::cmp::Reverse(b_hit), b_load)
            });
            if better {
                best = Some((cost, hit, c.in_flight, i));
            }
        }
        let (cost, hit, _, index) = best?;
        let chosen = &candidates[index];
        let dp_rank = chosen.dp_rank.or(cached[index].1);
        // Provisional entry, at the chosen engine's block size.
        let block_size = self
            .index
            .block_size(chosen.engine)
            .unwrap_or(self.index.config().block_size);
        if let Some(keys) = keys_by_size.iter().find(|k| k.block_size() == block_size) {
            lock(&self.provisional).record(
                tags[index],
                keys.keys(),
                now + self.config.provisional_ttl,
                now,
                self.config.provisional_max_blocks,
            );
        }
        let uncached = len - hit;
        let work = self.pending_work(tags[index], uncached as u64);
        Some(Decision {
            index,
            dp_rank,
            cached_tokens: hit,
            uncached_tokens: uncached,
            cost,
            work,
        })
    }

    /// How many leading tokens of `tokens` a candidate holds (its `in_flight` is not
    /// read), by its events or a provisional entry: for conditional disaggregation, the
    /// prompt a decode engine would not compute. Records nothing.
    pub fn cached_tokens(&self, candidate: &Candidate<'_>, tokens: &[u32]) -> usize {
        self.cached_tokens_at(candidate, tokens, Instant::now())
    }

    /// [`cached_tokens`](Self::cached_tokens) at a given time.
    pub fn cached_tokens_at(
        &self,
        candidate: &Candidate<'_>,
        tokens: &[u32],
        now: Instant,
    ) -> usize {
        let from_index = match candidate.dp_rank {
            Some(r) => self
                .index
                .cached_tokens_on_rank(candidate.engine, r, tokens),
            None => self.index.cached_tokens(candidate.engine, tokens),
        };
        let block_size = self
            .index
            .block_size(candidate.engine)
            .unwrap_or(self.index.config().block_size);
        let keys = BlockKeys::new(tokens, block_size);
        let provisional = lock(&self.provisional)
            .matches(&keys, now)
            .get(&candidate.tag())
            .map_or(0, |&b| b * block_size);
        from_index.max(provisional).min(tokens.len())
    }

    /// The pending prefill tokens counted for a candidate (see [`PrefillWork`]).
    pub fn pending_tokens(&self, candidate: &Candidate<'_>) -> u64 {
        lock(&self.pending)
            .get(&candidate.tag())
            .map_or(0, |p| p.load(Ordering::Relaxed))
    }

    /// Forgets a candidate's pending-work counter once no [`PrefillWork`] holds it
    /// (call when it leaves the set; its index entries go with the subscriber, its
    /// provisional entries expire).
    pub fn forget(&self, candidate: &Candidate<'_>) {
        let tag = candidate.tag();
        let mut map = lock(&self.pending);
        if map.get(&tag).is_some_and(|p| Arc::strong_count(p) == 1) {
            map.remove(&tag);
        }
    }

    fn pending_work(&self, tag: u64, tokens: u64) -> PrefillWork {
        let counter = lock(&self.pending).entry(tag).or_default().clone();
        counter.fetch_add(tokens, Ordering::Relaxed);
        PrefillWork {
            counter: Some(counter),
            tokens,
        }
    }

    /// The block sizes to key the prompt at: those of the candidates' events, and the
    /// configured one for candidates without events.
    fn block_sizes(&self, candidates: &[Candidate<'_>]) -> SmallVec<[usize; 2]> {
        let mut sizes: SmallVec<[usize; 2]> = SmallVec::new();
        let fallback = self.index.config().block_size;
        let engines: Vec<&str> = candidates.iter().map(|c| c.engine).collect();
        for b in self.index.block_sizes(&engines) {
            let b = b.unwrap_or(fallback);
            if !sizes.contains(&b) {
                sizes.push(b);
            }
        }
        sizes
    }
}

/// Provisional entries: keys recently routed to an engine, until they expire.
#[derive(Debug)]
struct Provisional {
    /// Key → (engine tag, expiry), the latest expiry per engine. Keys derive from
    /// clients' prompts: the map's hasher is seeded (see [`KeyMix`]).
    by_key: HashMap<u64, SmallVec<[(u64, Instant); 2]>, KeyMix>,
    /// Entries in the order recorded (so in the order they expire).
    order: VecDeque<Entry>,
    blocks: usize,
}

#[derive(Debug)]
struct Entry {
    expires: Instant,
    engine: u64,
    keys: Vec<u64>,
}

impl Default for Provisional {
    fn default() -> Self {
        Provisional {
            by_key: HashMap::with_hasher(KeyMix::new()),
            order: VecDeque::new(),
            blocks: 0,
        }
    }
}

impl Provisional {
    /// Leading blocks of `keys` each engine holds provisionally at `now`.
    fn matches(&self, keys: &BlockKeys, now: Instant) -> FastMap<u64, usize> {
        let mut depth: FastMap<u64, usize> = FastMap::default();
        for (i, key) in keys.keys().iter().enumerate() {
            let Some(holders) = self.by_key.get(key) else {
                break;
            };
            let mut advanced = false;
            for &(engine, expires) in holders {
                if expires <= now {
                    continue;
                }
                let d = depth.entry(engine).or_insert(0);
                if *d == i {
                    *d = i + 1;
                    advanced = true;
                }
            }
            if !advanced {
                break;
            }
        }
        depth.retain(|_, d| *d > 0);
        depth
    }

    fn record(&mut self, engine: u64, keys: &[u64], expires: Instant, now: Instant, max: usize) {
        // Expired entries first, then the oldest beyond the bound.
        while let Some(front) = self.order.front() {
            let over = self.blocks + keys.len() > max;
            if front.expires > now && !over {
                break;
            }
            if let Some(entry) = self.order.pop_front() {
                self.forget(&entry);
            }
        }
        let keys: Vec<u64> = keys.iter().copied().take(max).collect();
        for &key in &keys {
            let holders = self.by_key.entry(key).or_default();
            match holders.iter_mut().find(|(e, _)| *e == engine) {
                Some(slot) => slot.1 = slot.1.max(expires),
                None => holders.push((engine, expires)),
            }
        }
        self.blocks += keys.len();
        self.order.push_back(Entry {
            expires,
            engine,
            keys,
        });
    }

    /// Removes an entry's keys, unless a later entry of the same engine refreshed them.
    fn forget(&mut self, entry: &Entry) {
        self.blocks -= entry.keys.len();
        for key in &entry.keys {
            if let Some(holders) = self.by_key.get_mut(key) {
                holders.retain(|(e, exp)| !(*e == entry.engine && *exp <= entry.expires));
                if holders.is_empty() {
                    self.by_key.remove(key);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{BlockHash, BlockStored, EventBatch, KvEvent};
    use crate::index::IndexConfig;

    fn index_with(engine: &str, tokens: &[u32]) -> Arc<KvIndex> {
        let index = Arc::new(KvIndex::new(IndexConfig::default()));
        store(&index, engine, tokens);
        index
    }

    fn store(index: &KvIndex, engine: &str, tokens: &[u32]) {
        let blocks = tokens.len() / 16;
        let stored = BlockStored {
            block_hashes: (0..blocks as u64)
                .map(|b| BlockHash::Int(candidate_tag(engine, None) ^ b))
                .collect(),
            token_ids: tokens[..blocks * 16].to_vec(),
            block_size: 16,
            ..BlockStored::default()
        };
        let batch = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored(stored)],
            dp_rank: None,
        };
        index.apply(engine, 0, &batch);
    }

    fn cands<'a>(loads: &[(&'a str, usize)]) -> Vec<Candidate<'a>> {
        loads
            .iter()
            .map(|&(engine, in_flight)| Candidate::new(engine, in_flight))
            .collect()
    }

    #[test]
    fn longest_cached_prefix_wins_when_loads_are_equal() {
        let prompt: Vec<u32> = (0..256).collect();
        let index = index_with("b", &prompt[..160]);
        let scorer = KvScorer::new(index, ScorerConfig::default());
        let d = scorer
            .choose(&prompt, &cands(&[("a", 0), ("b", 0), ("c", 0)]))
            .unwrap();
        assert_eq!((d.index, d.cached_tokens, d.uncached_tokens), (1, 160, 96));
        assert_eq!(d.dp_rank, Some(0));
        assert_eq!(d.work.tokens(), 96);
        assert_eq!(scorer.pending_tokens(&Candidate::new("b", 0)), 96);
        drop(d);
        assert_eq!(scorer.pending_tokens(&Candidate::new("b", 0)), 0);
    }

    #[test]
    fn load_outweighs_a_prefix_worth_less_than_the_queue() {
        let prompt: Vec<u32> = (0..256).collect();
        let index = index_with("b", &prompt[..160]);
        let scorer = KvScorer::new(
            index,
            ScorerConfig {
                in_flight_cost_tokens: 100,
                ..ScorerConfig::default()
            },
        );
        // b: 96 uncached + 2 × 100 = 296 > a: 256 + 0.
        let d = scorer
            .choose(&prompt, &cands(&[("a", 0), ("b", 2)]))
            .unwrap();
        assert_eq!(d.index, 0);
        // b: 96 + 100 = 196 < 256.
        let d = scorer
            .choose(&prompt, &cands(&[("a", 0), ("b", 1)]))
            .unwrap();
        assert_eq!(d.index, 1);
    }

    #[test]
    fn pending_work_spreads_a_burst_and_provisional_entries_follow_it() {
        let index = Arc::new(KvIndex::new(IndexConfig::default()));
        let scorer = KvScorer::new(index, ScorerConfig::default());
        let now = Instant::now();
        let prompt: Vec<u32> = (0..64).collect();
        let c = cands(&[("a", 0), ("b", 0)]);
        let first = scorer.choose_at(&prompt, &c, now).unwrap();
        assert_eq!((first.index, first.cached_tokens), (0, 0));
        // Same prompt again while the first is pending: a holds it provisionally
        // (cost 0 + 64 pending) against b (64 + 0): the tie goes to the cached prefix.
        let second = scorer.choose_at(&prompt, &c, now).unwrap();
        assert_eq!((second.index, second.cached_tokens), (0, 64));
        assert_eq!(
            scorer.cached_tokens_at(&Candidate::new("a", 0), &prompt, now),
            64
        );
        // Once the entry expired, nothing is cached anywhere.
        let later = now + DEFAULT_PROVISIONAL_TTL + Duration::from_millis(1);
        assert_eq!(
            scorer.cached_tokens_at(&Candidate::new("a", 0), &prompt, later),
            0
        );
        drop((first, second));
        assert_eq!(scorer.pending_tokens(&Candidate::new("a", 0)), 0);
    }

    #[test]
    fn provisional_entries_are_bounded() {
        let index = Arc::new(KvIndex::new(IndexConfig::default()));
        let scorer = KvScorer::new(
            index,
            ScorerConfig {
                provisional_max_blocks: 8,
                ..ScorerConfig::default()
            },
        );
        let now = Instant::now();
        for i in 0..20u32 {
            let prompt: Vec<u32> = (i * 1000..i * 1000 + 64).collect();
            drop(scorer.choose_at(&prompt, &cands(&[("a", 0)]), now));
            assert!(lock(&scorer.provisional).blocks <= 8);
        }
        let last: Vec<u32> = (19_000..19_064).collect();
        assert_eq!(
            scorer.cached_tokens_at(&Candidate::new("a", 0), &last, now),
            64
        );
        let first: Vec<u32> = (0..64).collect();
        assert_eq!(
            scorer.cached_tokens_at(&Candidate::new("a", 0), &first, now),
            0
        );
    }

    #[test]
    fn rank_candidates_count_their_own_rank_only() {
        let index = Arc::new(KvIndex::new(IndexConfig::default()));
        let prompt: Vec<u32> = (0..64).collect();
        let stored = BlockStored {
            block_hashes: (0..4).map(BlockHash::Int).collect(),
            token_ids: prompt.clone(),
            block_size: 16,
            ..BlockStored::default()
        };
        let batch = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored(stored)],
            dp_rank: Some(1),
        };
        index.apply("e", 1, &batch);
        let scorer = KvScorer::new(index, ScorerConfig::default());
        let ranks = [
            Candidate::new("e", 0).with_dp_rank(0),
            Candidate::new("e", 0).with_dp_rank(1),
        ];
        let d = scorer.choose(&prompt, &ranks).unwrap();
        assert_eq!((d.index, d.dp_rank, d.cached_tokens), (1, Some(1), 64));
        assert_eq!(scorer.cached_tokens(&ranks[0], &prompt), 0);
        // The whole engine: its best rank.
        let d = scorer.choose(&prompt, &[Candidate::new("e", 0)]).unwrap();
        assert_eq!((d.dp_rank, d.cached_tokens), (Some(1), 64));
    }

    #[test]
    fn no_candidate_no_decision() {
        let scorer = KvScorer::new(
            Arc::new(KvIndex::new(IndexConfig::default())),
            ScorerConfig::default(),
        );
        assert!(scorer.choose(&[1, 2, 3], &[]).is_none());
    }
}
