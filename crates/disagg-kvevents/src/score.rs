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
//!    token: `uncached × miss_weight + queued`, where `uncached` is the prompt minus its
//!    cached tokens and `queued` the work ahead of it there (below).
//! 3. The cheapest candidate wins; ties go to the longer cached prefix, then fewer in
//!    flight, then candidate order (so replicas that see the same state agree).
//! 4. The request's blocks are recorded as a **provisional entry** for the winner, for
//!    [`ScorerConfig::provisional_ttl`]: its KV events arrive only once its prefill ran,
//!    and until then the next request with the same prefix (the next turn, a burst
//!    sharing a system prompt) must find it there rather than start it elsewhere.
//!    When the engine's own events remove blocks it holds provisionally, the engine's
//!    word wins: they leave its provisional entries at its next decision.
//!
//! Prefill time is close to proportional to the tokens computed, so the cost is the
//! engine's queue of work plus this request's own share: the time to first token, up to
//! a constant. A long cached prefix wins until the engine holding it is busier, by more
//! than the prefix is worth, than another engine.
//!
//! # Queued work
//!
//! The work ahead of a request on a candidate is the larger of two measures:
//!
//! * **What this scorer sent there.** The scorer remembers the uncached tokens of the
//!   last [`RECENT_PICKS`] requests it sent to each candidate; with the caller's count
//!   of its requests still in flight there ([`Candidate::in_flight`], e.g.
//!   `Endpoint::in_flight`, which a prefill endpoint holds for the prefill leg only),
//!   the queued work is the sum of the newest `in_flight` of them. An engine serves its
//!   queue about in arrival order, so the requests still in flight are the newest ones.
//!   Nothing is held per request: a request that ends lowers the count, and the oldest
//!   entry falls out of the sum. A caller that sees only its own traffic (one proxy
//!   among several) sees only its share.
//! * **What the engine reports.** An engine that publishes its load (SGLang's
//!   `LoadStat`, see [`crate::load`]) says how many uncached prompt tokens wait
//!   for prefill (the rest of the prefill in progress included), whoever sent them:
//!   every replica then prices the same global queue. Reports older than
//!   [`ScorerConfig::load_max_age`] are not used, nor those that show no more requests
//!   than this scorer's caller had in flight there when they were made: they restate
//!   its own requests, which it prices better itself. "When they were made" matters:
//!   an engine reports a request's end about when it answers, so for a moment after
//!   the caller's count dropped the latest report still counts the request, and
//!   compared with the count of that moment it would look like another router's work.
//!   The scorer therefore keeps the changes of each candidate's count for the last few
//!   seconds (at most 256 changes, 6 KiB, per candidate) and compares a report with
//!   the most the caller counted within [`ScorerConfig::load_report_lag`] of its
//!   arrival.
//!
//! # Cost
//!
//! The prompt's blocks hashed once per block size (usually one), one index walk, one
//! walk of the provisional entries under a short lock, and a few map lookups per
//! candidate: microseconds for thousands of tokens (see the crate's bench).
//!
//! # Decisions made at once
//!
//! Everything a decision reads of the scorer's own state (provisional entries, recent
//! picks, the candidates' in-flight counts, read again once the lock is held) and
//! everything it records there happens under one lock; only the index walk, the costly
//! part, runs outside it. Two requests decided at the same moment are then decided one
//! after the other: the second sees the first's provisional entry and pick. Without
//! that, two new sessions on one system prompt could each find it nowhere and start it
//! on two engines, or both take the same idle engine; through one proxy under load such
//! near-simultaneous pairs moved enough sessions off their engines to cost a run a
//! point of hit rate and 10 ms of p90 (docs/routing.md). The lock is held for the
//! provisional walk of the prompt's blocks and a few lookups per candidate.
//!
//! A caller counts a request in flight a moment after the pick (the proxy's
//! orchestrator once the connector prepared the leg): for
//! [`ScorerConfig::load_report_lag`] after a pick, a candidate's count is taken as at
//! least what it became with that pick.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::index::{KvIndex, PrefixMatch};
use crate::key::{BlockKeys, KeyIter, KeyMix};
use crate::load::LoadStat;

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

/// The requests per candidate whose uncached tokens the scorer remembers, to price the
/// ones still in flight (see the [module docs](self)): 64, more than an engine's
/// prefill queue holds in practice; requests in flight beyond it count at the mean of
/// the remembered ones.
pub const RECENT_PICKS: usize = 64;

/// How old an engine's load report may be and still count, by default: 3 s. SGLang
/// publishes a changed load at once and an unchanged one every second.
pub const DEFAULT_LOAD_MAX_AGE: Duration = Duration::from_secs(3);

/// How far apart a load report and the caller's in-flight counts are taken to be, by
/// default: 5 ms, a report's way from an engine on the same network with room to spare
/// (see [`ScorerConfig::load_report_lag`]).
pub const DEFAULT_LOAD_REPORT_LAG: Duration = Duration::from_millis(5);

/// The most changes of a candidate's in-flight count a scorer remembers, to tell which
/// requests an engine's report counts were the caller's (see the [module docs](self)).
const COUNT_HISTORY: usize = 256;

/// The default [`ScorerConfig::miss_weight`]: 1, each request's own time to first
/// token. Right when a router sees only its own share of the engines' queues (no load
/// reports, several routers): a higher weight then piles sessions onto the engines
/// that hold them, whose queues it underestimates.
pub const DEFAULT_MISS_WEIGHT: u64 = 1;

/// The [`ScorerConfig::miss_weight`] to use when the engines report their load (see
/// [`crate::load`]): 2. With the whole queue in view, a miss priced at twice its
/// compute keeps sessions on the engines holding them until another engine is
/// clearly less busy, which saves the cache space a copy takes (docs/routing.md has
/// the runs that chose it).
pub const LOAD_REPORTS_MISS_WEIGHT: u64 = 2;

/// Settings of a [`KvScorer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScorerConfig {
    /// How long the blocks of a request just routed count as held by its engine.
    pub provisional_ttl: Duration,
    /// The most provisional blocks kept, over all engines.
    pub provisional_max_blocks: usize,
    /// How old an engine's load report may be and still count
    /// ([`DEFAULT_LOAD_MAX_AGE`]).
    pub load_max_age: Duration,
    /// How far apart in time a load report and the caller's counts are taken to be
    /// ([`DEFAULT_LOAD_REPORT_LAG`]): a report shows work of other routers only when
    /// it counts more requests than the caller had in flight there at any time within
    /// this of the report's arrival. It covers the report's way from the engine and
    /// the moment between a pick and the caller counting the request.
    pub load_report_lag: Duration,
    /// What one uncached token costs relative to one token of queued work (default
    /// [`DEFAULT_MISS_WEIGHT`]). At 1 the cost is the time to first token alone; above
    /// 1, a miss also pays for what it evicts elsewhere and for the copy of the prefix
    /// it makes: requests stay with the engine holding their prefix longer before load
    /// moves them.
    pub miss_weight: u64,
}

impl Default for ScorerConfig {
    fn default() -> Self {
        ScorerConfig {
            provisional_ttl: DEFAULT_PROVISIONAL_TTL,
            provisional_max_blocks: DEFAULT_PROVISIONAL_MAX_BLOCKS,
            load_max_age: DEFAULT_LOAD_MAX_AGE,
            load_report_lag: DEFAULT_LOAD_REPORT_LAG,
            miss_weight: DEFAULT_MISS_WEIGHT,
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
    /// Its requests in flight on this leg, as the caller counts them (see the
    /// [module docs](self) on queued work).
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

    /// The candidate as the provisional entries and the recent picks know it.
    fn tag(&self) -> u64 {
        candidate_tag(self.engine, self.dp_rank)
    }
}

/// A routing decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
}

/// Chooses an engine for a prompt from the engines' cached prefixes and loads; see the
/// [module docs](self).
///
/// Synchronous: no I/O, no await; locks held for a walk of the request's blocks at
/// most. Share it in an `Arc`.
pub struct KvScorer {
    index: Arc<KvIndex>,
    config: ScorerConfig,
    /// Provisional entries and what the scorer sent where: one lock, held for a
    /// decision's reads and records (see [`KvScorer::choose_at`]).
    state: Mutex<State>,
}

/// A candidate's cached tokens, and the data-parallel rank holding them when the index
/// says.
type Held = (usize, Option<u32>);

/// What a [`KvScorer`] keeps of its own decisions.
#[derive(Debug, Default)]
struct State {
    provisional: Provisional,
    /// What the scorer sent to each candidate (by tag) and the caller's in-flight
    /// counts there.
    sent: FastMap<u64, Sent>,
    /// The index's removals read so far ([`KvIndex::removals_since`]).
    removals_seen: u64,
}

impl fmt::Debug for KvScorer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvScorer")
            .field("config", &self.config)
            .field("provisional_blocks", &lock(&self.state).provisional.blocks)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics under these locks; a half-updated state is still a valid one.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A candidate as the provisional entries and the recent picks know it: a hash of its
/// id and rank.
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
            state: Mutex::default(),
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
    /// (provisional entry, recent pick). `None` when there is no candidate.
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
        self.choose_with(tokens, candidates, |i| candidates[i].in_flight, now)
    }

    /// [`choose_at`](Self::choose_at), with each candidate's in-flight count read again
    /// by `in_flight(i)` once the scorer's lock is held: a request another decision
    /// just sent is then both among the picks and in the count, never in one only.
    pub(crate) fn choose_with(
        &self,
        tokens: &[u32],
        candidates: &[Candidate<'_>],
        in_flight: impl Fn(usize) -> usize,
        now: Instant,
    ) -> Option<Decision> {
        if candidates.is_empty() {
            return None;
        }
        // Each candidate's block size (its provisional entry is keyed at it), and the
        // distinct ones to key the prompt at.
        let engine_sizes = self.block_sizes(candidates);
        let mut sizes: SmallVec<[usize; 2]> = SmallVec::new();
        for &b in &engine_sizes {
            if !sizes.contains(&b) {
                sizes.push(b);
            }
        }
        let tags: Vec<u64> = candidates.iter().map(Candidate::tag).collect();
        // Per block size: the prompt's keys, and each candidate's cached tokens and the
        // rank holding them by the index. No lock of the scorer's is held for the walk.
        let mut by_size: SmallVec<[(BlockKeys, Vec<Held>); 1]> =
            SmallVec::with_capacity(sizes.len());
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
            let from_index = candidates
                .iter()
                .map(|c| {
                    let found = match c.dp_rank {
                        Some(r) => by_rank.get(&(c.engine, r)).map(|&t| (t, r)),
                        None => by_engine.get(c.engine).copied(),
                    };
                    found.map_or((0, None), |(t, rank)| (t, Some(rank)))
                })
                .collect();
            by_size.push((keys, from_index));
        }
        // What the decision reads of the scorer's own state (provisional entries, picks,
        // counts) and what it records there happen under one lock: two decisions made
        // at once would otherwise each miss the other's request (both send a burst's
        // first requests to the same idle engine, or both start a prefix elsewhere).
        let mut state = lock(&self.state);
        self.drop_removed(&mut state);
        let settle = self.config.load_report_lag;
        let candidates: SmallVec<[Candidate<'_>; 8]> = candidates
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let read = in_flight(i);
                let counted = state
                    .sent
                    .get(&tags[i])
                    .map_or(read, |s| s.counted(read, now, settle));
                Candidate {
                    in_flight: counted,
                    ..*c
                }
            })
            .collect();
        let mut cached: Vec<Held> = vec![(0, None); candidates.len()];
        for (keys, from_index) in &by_size {
            let provisional = state.provisional.matches(keys.keys().iter().copied(), now);
            for (i, entry) in cached.iter_mut().enumerate() {
                let (t, rank) = from_index[i];
                if rank.is_some() && (t > entry.0 || (t == entry.0 && entry.1.is_none())) {
                    *entry = (t, rank);
                }
                if let Some(&blocks) = provisional.get(&tags[i]) {
                    entry.0 = entry.0.max(blocks * keys.block_size());
                }
            }
        }
        let keep = self.config.load_max_age + self.config.load_report_lag;
        let queued: SmallVec<[u64; 8]> = candidates
            .iter()
            .zip(&tags)
            .zip(&cached)
            .map(|((c, t), &(_, holder))| {
                let s = state.sent.entry(*t).or_default();
                s.observe(now, c.in_flight, keep);
                let ours = queued_by_us(&s.picks, c.in_flight);
                ours.max(self.others_queued(s, c, holder, now))
            })
            .collect();
        let len = tokens.len();
        let mut best: Option<(u64, usize, usize, usize)> = None; // (cost, cached, in_flight, i)
        for (i, c) in candidates.iter().enumerate() {
            let hit = cached[i].0.min(len);
            // `queued` may be an engine's own figure (`others_queued`): saturating, a
            // huge one makes its engine the dearest, where a wrap would make it the
            // cheapest.
            let cost = ((len - hit) as u64)
                .saturating_mul(self.config.miss_weight)
                .saturating_add(queued[i]);
            let better = best.is_none_or(|(b_cost, b_hit, b_load, _)| {
                (cost, std::cmp::Reverse(hit), c.in_flight)
                    < (b_cost, std::cmp::Reverse(b_hit), b_load)
            });
            if better {
                best = Some((cost, hit, c.in_flight, i));
            }
        }
        let (cost, hit, _, index) = best?;
        let chosen = candidates[index];
        let dp_rank = chosen.dp_rank.or(cached[index].1);
        // Provisional entry, at the chosen engine's block size.
        if let Some((keys, _)) = by_size
            .iter()
            .find(|(k, _)| k.block_size() == engine_sizes[index])
        {
            state.provisional.record(
                tags[index],
                keys.keys(),
                now + self.config.provisional_ttl,
                now,
                self.config.provisional_max_blocks,
            );
        }
        let uncached = len - hit;
        let s = state.sent.entry(tags[index]).or_default();
        if s.picks.len() == RECENT_PICKS {
            s.picks.pop_front();
        }
        s.picks
            .push_back(u32::try_from(uncached).unwrap_or(u32::MAX));
        // The caller counts the request in flight there from now on (or from a moment
        // later: until it does, the next decisions count it themselves).
        s.observe(now, chosen.in_flight + 1, keep);
        s.last_pick = Some((now, chosen.in_flight + 1));
        drop(state);
        Some(Decision {
            index,
            dp_rank,
            cached_tokens: hit,
            uncached_tokens: uncached,
            cost,
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
        #[cfg(test)]
        work::index_walk();
        let from_index = match candidate.dp_rank {
            Some(r) => self
                .index
                .cached_tokens_on_rank(candidate.engine, r, tokens),
            None => self.index.cached_tokens(candidate.engine, tokens),
        };
        let mut cached = [from_index];
        self.add_provisional(std::slice::from_ref(candidate), tokens, now, &mut cached);
        cached[0]
    }

    /// [`cached_tokens`](Self::cached_tokens) of each of `candidates`, in their order:
    /// for conditional disaggregation, what each decode engine holds. Records nothing.
    ///
    /// Cost: the index walked once for all of them, and the prompt's provisional
    /// entries once per block size, each stopping at the first block nobody holds
    /// (the prompt's blocks are hashed only that far), then a lookup per candidate; not
    /// a walk of the prompt per candidate.
    pub fn cached_tokens_each(&self, candidates: &[Candidate<'_>], tokens: &[u32]) -> Vec<usize> {
        self.cached_tokens_each_at(candidates, tokens, Instant::now())
    }

    /// [`cached_tokens_each`](Self::cached_tokens_each) at a given time.
    pub fn cached_tokens_each_at(
        &self,
        candidates: &[Candidate<'_>],
        tokens: &[u32],
        now: Instant,
    ) -> Vec<usize> {
        if candidates.is_empty() {
            return Vec::new();
        }
        // Every holder's match, each at its own block size: what the index says of
        // each candidate alone (`KvIndex::cached_tokens`: the best of the engine's
        // ranks, or the one rank), from one walk.
        #[cfg(test)]
        work::index_walk();
        let matched = self.index.match_prefix(tokens);
        let n = matched.holders().len();
        let mut by_rank: FastMap<(&str, u32), usize> =
            FastMap::with_capacity_and_hasher(n, Default::default());
        let mut by_engine: FastMap<&str, usize> =
            FastMap::with_capacity_and_hasher(n, Default::default());
        for m in matched.holders() {
            by_rank.insert((&*m.engine, m.dp_rank), m.tokens());
            let best = by_engine.entry(&*m.engine).or_insert(0);
            *best = (*best).max(m.tokens());
        }
        let mut cached: Vec<usize> = candidates
            .iter()
            .map(|c| {
                match c.dp_rank {
                    Some(r) => by_rank.get(&(c.engine, r)),
                    None => by_engine.get(c.engine),
                }
                .copied()
                .unwrap_or(0)
            })
            .collect();
        self.add_provisional(candidates, tokens, now, &mut cached);
        cached
    }

    /// Raises each of `cached` (the candidates' cached tokens by the index) to what
    /// their provisional entries hold, and caps it at the prompt. The prompt is keyed
    /// once per block size among the candidates, lazily: the walk stops at the first
    /// block no candidate holds provisionally.
    fn add_provisional(
        &self,
        candidates: &[Candidate<'_>],
        tokens: &[u32],
        now: Instant,
        cached: &mut [usize],
    ) {
        let engine_sizes = self.block_sizes(candidates);
        let mut sizes: SmallVec<[usize; 2]> = SmallVec::new();
        for &b in &engine_sizes {
            if !sizes.contains(&b) {
                sizes.push(b);
            }
        }
        let tags: SmallVec<[u64; 8]> = candidates.iter().map(Candidate::tag).collect();
        let mut state = lock(&self.state);
        self.drop_removed(&mut state);
        for &block_size in &sizes {
            let keys = KeyIter::new(tokens, block_size);
            #[cfg(test)]
            let keys = keys.inspect(|_| work::key());
            let provisional = state.provisional.matches(keys, now);
            for (i, entry) in cached.iter_mut().enumerate() {
                if engine_sizes[i] != block_size {
                    continue;
                }
                if let Some(&blocks) = provisional.get(&tags[i]) {
                    *entry = (*entry).max(blocks * block_size);
                }
            }
        }
        drop(state);
        for entry in cached.iter_mut() {
            *entry = (*entry).min(tokens.len());
        }
    }

    /// The prefill work, in tokens, the scorer counts queued on a candidate: the larger
    /// of what it sent there and is still in flight, and what the engine reports (see
    /// the [module docs](self)).
    pub fn queued_tokens(&self, candidate: &Candidate<'_>) -> u64 {
        let state = lock(&self.state);
        let empty = Sent::default();
        let s = state.sent.get(&candidate.tag()).unwrap_or(&empty);
        let ours = queued_by_us(&s.picks, candidate.in_flight);
        ours.max(self.others_queued(s, candidate, None, Instant::now()))
    }

    /// Forgets what the scorer sent to a candidate (call when it leaves the set; its
    /// index entries and load reports go with the subscriber, its provisional entries
    /// expire).
    pub fn forget(&self, candidate: &Candidate<'_>) {
        lock(&self.state).sent.remove(&candidate.tag());
    }

    /// Forgets what the scorer sent to every candidate but `keep`: call with the
    /// endpoint set's candidates whenever it changes, so that what the scorer keeps
    /// follows the set (engines that come and go under new addresses leave nothing
    /// behind). One pass under the lock; nothing on the request path.
    pub fn retain<'a>(&self, keep: impl IntoIterator<Item = Candidate<'a>>) {
        let keep: std::collections::HashSet<u64> = keep.into_iter().map(|c| c.tag()).collect();
        lock(&self.state).sent.retain(|tag, _| keep.contains(tag));
    }

    /// How many candidates the scorer keeps a history of (what it sent there).
    pub fn known(&self) -> usize {
        lock(&self.state).sent.len()
    }

    /// The uncached tokens waiting on a candidate by its engine's latest fresh load
    /// report: its rank's, or for a whole-engine candidate the rank that holds the
    /// prompt (`holder`) if it reports, else the least loaded rank (the engine's
    /// balancer sends new work there). `None` without a fresh report.
    fn reported(
        &self,
        c: &Candidate<'_>,
        holder: Option<u32>,
        now: Instant,
    ) -> Option<(LoadStat, Instant)> {
        let max_age = self.config.load_max_age;
        match c.dp_rank.or(holder) {
            Some(rank) => self
                .index
                .loads()
                .get_received(c.engine, rank, now, max_age),
            None => self
                .index
                .loads()
                .least_loaded_received(c.engine, now, max_age),
        }
    }

    /// The queued work a candidate's engine reports, when the report holds requests of
    /// other routers: more requests waiting or running there than the caller can have
    /// had in flight when it was made (the most it counted within
    /// [`ScorerConfig::load_report_lag`] of the report's arrival). Otherwise 0: the
    /// report only restates the caller's own requests, which the scorer prices better
    /// itself. The engine counts a waiting request's uncached tokens as its cache was
    /// on arrival, before the request ahead computed the prefix they share; and a
    /// report made just before one of the caller's requests ended still counts it
    /// until the next report comes, while the caller's count has already dropped.
    fn others_queued(
        &self,
        sent: &Sent,
        c: &Candidate<'_>,
        holder: Option<u32>,
        now: Instant,
    ) -> u64 {
        let Some((report, received)) = self.reported(c, holder, now) else {
            return 0;
        };
        let lag = self.config.load_report_lag;
        let made = received.checked_sub(lag).unwrap_or(received);
        let ours = sent.in_flight_between(made, received + lag, c.in_flight);
        // The engine's figures are peer input (any u64 off the wire): saturating, a
        // huge report counts as others' work rather than panicking or wrapping to none.
        if report.waiting.saturating_add(report.running) > ours as u64 {
            report.waiting_uncached_tokens
        } else {
            0
        }
    }

    /// Drops the provisional entries of blocks their engine's events removed since the
    /// last call: the engine's word wins over the scorer's guess. A removal on rank `r`
    /// drops the block for the engine's whole-engine candidate and for its rank `r`.
    fn drop_removed(&self, state: &mut State) {
        let State {
            provisional,
            removals_seen,
            ..
        } = state;
        self.index
            .removals_since(removals_seen, |engine, rank, key| {
                provisional.drop_key(candidate_tag(engine, None), key);
                provisional.drop_key(candidate_tag(engine, Some(rank)), key);
            });
    }

    /// Each candidate's block size, from one snapshot of the index: its events', or the
    /// configured one for a candidate without events.
    fn block_sizes(&self, candidates: &[Candidate<'_>]) -> SmallVec<[usize; 8]> {
        let fallback = self.index.config().block_size;
        let engines: Vec<&str> = candidates.iter().map(|c| c.engine).collect();
        self.index
            .block_sizes(&engines)
            .into_iter()
            .map(|b| b.unwrap_or(fallback))
            .collect()
    }
}

/// The work a caller's `in_flight` requests on a candidate amount to: the newest
/// `in_flight` of the uncached tokens recently sent there, and the mean of those for
/// any beyond the window.
fn queued_by_us(window: &VecDeque<u32>, in_flight: usize) -> u64 {
    if window.is_empty() {
        return 0;
    }
    let newest = in_flight.min(window.len());
    let sum: u64 = window
        .iter()
        .rev()
        .take(newest)
        .map(|&t| u64::from(t))
        .sum();
    let beyond = (in_flight - newest) as u64;
    if beyond == 0 {
        return sum;
    }
    let mean = window.iter().map(|&t| u64::from(t)).sum::<u64>() / window.len() as u64;
    sum + beyond * mean
}

/// What a scorer knows of its own traffic to one candidate.
#[derive(Debug, Default)]
struct Sent {
    /// The uncached tokens of the last [`RECENT_PICKS`] requests sent there, newest
    /// last.
    picks: VecDeque<u32>,
    /// The caller's in-flight count there each time the scorer saw it change (at each
    /// choice, and after each pick of the candidate), with when; newest last. At most
    /// [`COUNT_HISTORY`], and only what a report still used can need.
    counts: VecDeque<(Instant, usize)>,
    /// The scorer's last pick of the candidate: when, and the caller's count with it.
    last_pick: Option<(Instant, usize)>,
}

impl Sent {
    /// The caller's in-flight count there, `read` now: at least the count with the
    /// last pick while that is under `settle` old, as the caller may not have counted
    /// that request yet.
    fn counted(&self, read: usize, now: Instant, settle: Duration) -> usize {
        match self.last_pick {
            Some((at, n)) if now.saturating_duration_since(at) <= settle => read.max(n),
            _ => read,
        }
    }

    /// Records the caller's in-flight count at `now`, keeping what reports up to
    /// `keep` old need: the count when each was made.
    fn observe(&mut self, now: Instant, in_flight: usize, keep: Duration) {
        if self.counts.back().is_some_and(|&(_, n)| n == in_flight) {
            return;
        }
        let cutoff = now.checked_sub(keep);
        // The newest change at or before the cutoff says the count then: the ones
        // before it are not needed.
        while self.counts.len() >= COUNT_HISTORY
            || cutoff.is_some_and(|c| self.counts.get(1).is_some_and(|&(at, _)| at <= c))
        {
            self.counts.pop_front();
        }
        self.counts.push_back((now, in_flight));
    }

    /// The most requests the caller counted in flight there from `from` to `to`: the
    /// count seen last at or before `from`, and every one seen after it until `to`
    /// (counts rise only by the scorer's own picks, each seen). `current` when nothing
    /// was seen by `to`.
    fn in_flight_between(&self, from: Instant, to: Instant, current: usize) -> usize {
        let mut most = None;
        for &(at, n) in self.counts.iter().rev() {
            if at > to {
                continue;
            }
            most = Some(most.map_or(n, |m: usize| m.max(n)));
            if at <= from {
                break;
            }
        }
        most.unwrap_or(current)
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
    /// Leading blocks of `keys` each engine holds provisionally at `now`. Reads `keys`
    /// only as far as some engine holds them (a lazy [`KeyIter`] hashes no further).
    fn matches(&self, keys: impl IntoIterator<Item = u64>, now: Instant) -> FastMap<u64, usize> {
        let mut depth: FastMap<u64, usize> = FastMap::default();
        for (i, key) in keys.into_iter().enumerate() {
            let Some(holders) = self.by_key.get(&key) else {
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

    /// Drops `key` for `engine` (its entry keeps counting the key towards the bound
    /// until it expires).
    fn drop_key(&mut self, engine: u64, key: u64) {
        if let Some(holders) = self.by_key.get_mut(&key) {
            holders.retain(|(e, _)| *e != engine);
            if holders.is_empty() {
                self.by_key.remove(&key);
            }
        }
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

/// Work counters of this thread, for tests that count work rather than time it.
#[cfg(test)]
pub(crate) mod work {
    use std::cell::Cell;

    thread_local! {
        static KEYS: Cell<u64> = const { Cell::new(0) };
        static INDEX_WALKS: Cell<u64> = const { Cell::new(0) };
    }

    /// One block key computed by the scorer's lookups of cached tokens.
    pub(crate) fn key() {
        KEYS.with(|n| n.set(n.get() + 1));
    }

    /// One walk of the index for a prompt by those lookups.
    pub(crate) fn index_walk() {
        INDEX_WALKS.with(|n| n.set(n.get() + 1));
    }

    /// (block keys computed, index walks) on this thread so far.
    pub(crate) fn counts() -> (u64, u64) {
        (KEYS.with(Cell::get), INDEX_WALKS.with(Cell::get))
    }
}

#[cfg(test)]
mod tests;
