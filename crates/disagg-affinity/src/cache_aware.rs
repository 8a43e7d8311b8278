//! [`CacheAware`]: send a request to the engine that most recently saw the longest part
//! of its prompt, unless load says otherwise.
//!
//! # How a pick is made
//!
//! 1. The prompt is hashed into chained blocks ([`PrefixHasher`]). No usable prompt (or
//!    one shorter than a block): least in flight, and nothing is remembered.
//! 2. **Load first.** When the candidates' in-flight counts are imbalanced, both
//!    `max − min > balance_abs` *and* `max > balance_rel × min`, the least loaded
//!    endpoint wins: a queue that long costs more than a cache hit saves.
//! 3. **Then locality.** Each candidate's match is the longest run of the request's
//!    leading blocks it was last sent. If the best match covers at least
//!    `cache_threshold` of the request's blocks, the best-matching candidate wins (ties:
//!    fewer in flight, then candidate order). Otherwise the least loaded wins: the prompt
//!    is mostly new, so it may as well start a new home where there is room.
//! 4. The request's blocks are recorded for the chosen endpoint.
//!
//! Endpoints are known by their id (base URL), so an endpoint that leaves the set simply
//! stops matching, and one that comes back finds its entries if they are still there.
//!
//! # The table
//!
//! A map from block hash to the last [`OWNERS`] endpoints sent that block, in two
//! generations: entries are inserted into the current one; when a request's blocks would
//! not fit in half the capacity, the older generation is dropped and the current one
//! becomes the older. A lookup reads both; recording a block that sits in the older
//! generation moves it to the current one. Every operation is O(1) (the drop is a
//! `clear` of a map of plain data, amortized over the half-capacity of inserts before
//! it), recently used prefixes survive, and at most `capacity` entries exist at any
//! time. This is the "2Q without the queues" of a two-generation cache: cheaper than an
//! LRU list (no links to update on every hit) and close to it when the capacity is
//! several times the working set.
//!
//! A request's blocks always go into one generation together, and a block is recorded
//! whenever any longer prefix through it is, so the entries present are always
//! prefix-closed: the lookup can stop at the first block nobody has.
//!
//! **Memory:** an entry is a 24-byte bucket (an 8-byte hash and two 8-byte endpoint
//! keys) plus hashbrown's 1 control byte. A map is at most 7/8 full and has a
//! power-of-two number of buckets, so the table takes about 29 to at most 58 bytes per
//! entry of capacity: ≤ 3.7 MiB at the default 65,536 entries. The allocation is kept
//! across generations, so it stops changing once the table is warm.

use std::collections::HashMap;
use std::collections::hash_map::{Entry, RandomState};
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::num::NonZeroU64;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use disagg_core::Endpoint;
use disagg_core::router::{Pick, RequestView};

use crate::hrw::finalize;
use crate::policy::LeastInFlight;
use crate::prefix::{PrefixError, PrefixHasher, block_hash};

/// The default table capacity: 65,536 block entries.
///
/// At the default 64-byte blocks that is 4 MiB of prompt text, about a million tokens:
/// the order of what a few engines' KV caches hold, so entries are not kept much longer
/// than the engines keep the prefixes they stand for. Raise it with the number of
/// engines or their KV memory. Costs ≤ 3.7 MiB (see the [module docs](self)).
pub const DEFAULT_CAPACITY: usize = 1 << 16;

/// The default cache threshold: go for locality when at least half of the request's
/// blocks are cached on one candidate. Below that the engine would compute most of the
/// prompt anyway, and spreading by load serves the request better.
pub const DEFAULT_CACHE_THRESHOLD: f64 = 0.5;

/// The default absolute imbalance: more than 8 requests in flight between the busiest
/// and the idlest candidate.
///
/// On a prefill leg a request is in flight for its prefill only, so the count is a queue
/// length: 8 prompts of a few thousand tokens queued ahead is on the order of a second of
/// time to first token, more than any one cache hit saves.
pub const DEFAULT_BALANCE_ABS: usize = 8;

/// The default relative imbalance: the busiest candidate carries more than 1.5 times the
/// idlest. Keeps a fixed gap of 8 from overriding locality when every engine is busy
/// (100 against 108 is not worth losing a cache for).
pub const DEFAULT_BALANCE_REL: f64 = 1.5;

/// How many endpoints an entry remembers per block: a prefix sent elsewhere under load
/// is cached on both engines, and either may serve it next.
pub const OWNERS: usize = 2;

/// Why a [`CacheAware`] setting was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CacheAwareError {
    /// A block size or block count was refused.
    #[error("invalid prefix hashing setting")]
    Prefix(#[from] PrefixError),
    /// The table holds two generations of at least one entry each.
    #[error("capacity {0} is below 2 block entries")]
    Capacity(usize),
    /// The cache threshold is a fraction of the request's blocks.
    #[error("cache threshold {0} is not between 0 and 1")]
    CacheThreshold(f64),
    /// Below 1 the busiest candidate would always count as "more than `rel` times" the
    /// idlest; NaN compares false with everything. `f64::INFINITY` turns the load rule
    /// off.
    #[error("relative balance threshold {0} is not at least 1")]
    BalanceRel(f64),
}

/// Prefix-cache-aware routing for one leg, balanced by load.
///
/// Use it on the **prefill leg** when requests share long prompt prefixes without
/// carrying a session key: agents with a long system prompt and tool list, few-shot
/// templates, retrieval over a shared document set, chat clients that resend the whole
/// conversation. Each prefill then computes only what its engine has not cached. With a
/// session key, [`ConsistentHash`](crate::ConsistentHash) gets most of the benefit
/// statelessly. Each proxy replica learns only from its own traffic, so several replicas
/// find locality less often than one.
///
/// See the [module docs](self) for the decision and the table. Cost: the prompt's
/// blocks hashed (at most `max_blocks`), one lookup per matched block and one insert per
/// block under a briefly held lock, and a hash of each candidate's id when a match is
/// found.
///
/// Measured cost: ~2.7 µs / 4.7 µs / 15 µs per pick at 8 / 64 / 512 endpoints, on a chat
/// body of a 2 KB system prompt and a short user turn that hits the warm table (criterion,
/// this repo's `cargo bench -p disagg-affinity`, 2-core VM). About 2 µs of it is hashing
/// the prompt; the rest grows with the candidates, whose ids are hashed to be matched.
///
/// # Examples
///
/// ```
/// use disagg_affinity::{CacheAware, LeastInFlight, PerLeg};
///
/// let prefill = CacheAware::new()
///     .with_capacity(1 << 18)?
///     .with_cache_threshold(0.3)?
///     .with_balance(16, 2.0)?;
/// let router = PerLeg::new(prefill, LeastInFlight::new());
/// # let _ = router;
/// # Ok::<(), disagg_affinity::CacheAwareError>(())
/// ```
pub struct CacheAware {
    prefix: PrefixHasher,
    capacity: usize,
    cache_threshold: f64,
    balance_abs: usize,
    balance_rel: f64,
    fallback: LeastInFlight,
    table: Mutex<Table>,
}

impl fmt::Debug for CacheAware {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CacheAware")
            .field("prefix", &self.prefix)
            .field("capacity", &self.capacity)
            .field("cache_threshold", &self.cache_threshold)
            .field("balance_abs", &self.balance_abs)
            .field("balance_rel", &self.balance_rel)
            .field("entries", &self.entries())
            .finish_non_exhaustive()
    }
}

impl Default for CacheAware {
    fn default() -> Self {
        CacheAware {
            prefix: PrefixHasher::new(),
            capacity: DEFAULT_CAPACITY,
            cache_threshold: DEFAULT_CACHE_THRESHOLD,
            balance_abs: DEFAULT_BALANCE_ABS,
            balance_rel: DEFAULT_BALANCE_REL,
            fallback: LeastInFlight::new(),
            table: Mutex::new(Table::new(DEFAULT_CAPACITY)),
        }
    }
}

// === impl CacheAware ===

impl CacheAware {
    /// 64-byte blocks, at most 256 per request, 65,536 entries, cache threshold 0.5,
    /// imbalance beyond 8 in flight and 1.5 times.
    pub fn new() -> Self {
        Self::default()
    }

    /// The block size in bytes of the canonical prompt stream (see [`PrefixHasher`]).
    ///
    /// # Errors
    ///
    /// [`CacheAwareError::Prefix`] for 0.
    pub fn with_block_size(mut self, bytes: usize) -> Result<Self, CacheAwareError> {
        self.prefix = self.prefix.with_block_size(bytes)?;
        Ok(self)
    }

    /// The most blocks of a prompt considered; the rest is not read.
    ///
    /// # Errors
    ///
    /// [`CacheAwareError::Prefix`] for 0.
    pub fn with_max_blocks(mut self, blocks: usize) -> Result<Self, CacheAwareError> {
        self.prefix = self.prefix.with_max_blocks(blocks)?;
        Ok(self)
    }

    /// The most block entries remembered, over all endpoints. Starts an empty table.
    ///
    /// # Errors
    ///
    /// [`CacheAwareError::Capacity`] below 2.
    pub fn with_capacity(mut self, entries: usize) -> Result<Self, CacheAwareError> {
        if entries < 2 {
            return Err(CacheAwareError::Capacity(entries));
        }
        self.capacity = entries;
        self.table = Mutex::new(Table::new(entries));
        Ok(self)
    }

    /// The fraction of the request's blocks the best match must cover for locality to
    /// decide. `0.0` follows any match; `1.0` only a full one.
    ///
    /// # Errors
    ///
    /// [`CacheAwareError::CacheThreshold`] outside `0.0..=1.0` or NaN.
    pub fn with_cache_threshold(mut self, fraction: f64) -> Result<Self, CacheAwareError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(CacheAwareError::CacheThreshold(fraction));
        }
        self.cache_threshold = fraction;
        Ok(self)
    }

    /// The imbalance at which load overrides locality: the busiest candidate has more
    /// than `abs` requests in flight over the idlest *and* more than `rel` times as many.
    /// `usize::MAX` or `f64::INFINITY` turns the rule off.
    ///
    /// # Errors
    ///
    /// [`CacheAwareError::BalanceRel`] when `rel` is below 1 or NaN.
    pub fn with_balance(mut self, abs: usize, rel: f64) -> Result<Self, CacheAwareError> {
        if rel.is_nan() || rel < 1.0 {
            return Err(CacheAwareError::BalanceRel(rel));
        }
        self.balance_abs = abs;
        self.balance_rel = rel;
        Ok(self)
    }

    /// The prompt hashing settings.
    pub fn prefix(&self) -> &PrefixHasher {
        &self.prefix
    }

    /// The most block entries remembered.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The block entries remembered now (at most [`capacity`](Self::capacity)).
    pub fn entries(&self) -> usize {
        self.lock().len()
    }

    /// Whether load overrides locality for these in-flight extremes.
    fn imbalanced(&self, min: usize, max: usize) -> bool {
        max.saturating_sub(min) > self.balance_abs && max as f64 > self.balance_rel * min as f64
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        // Nothing panics while the lock is held, and a table half-updated by a panic
        // would still be a valid (if less accurate) table.
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The candidate for a request with these blocks (not empty).
    fn choose(&self, req: &RequestView<'_>, blocks: &[u64], candidates: &[Arc<Endpoint>]) -> usize {
        let (min, max) = candidates
            .iter()
            .map(|e| e.in_flight())
            .fold((usize::MAX, 0), |(lo, hi), l| (lo.min(l), hi.max(l)));
        if self.imbalanced(min, max) {
            return self.fallback.pick(req, candidates);
        }
        let held = self.lock().matches(blocks);
        let needed = self.cache_threshold * blocks.len() as f64;
        // Not even the best holder (in the set or not) matches enough: skip hashing ids.
        if held.iter().all(|&(_, len)| (len as f64) < needed) {
            return self.fallback.pick(req, candidates);
        }
        let mut best: Option<(usize, usize, usize)> = None;
        for (i, ep) in candidates.iter().enumerate() {
            let key = endpoint_key(ep.id().as_str());
            let Some(&(_, len)) = held.iter().find(|(owner, _)| *owner == key) else {
                continue;
            };
            let load = ep.in_flight();
            if best.is_none_or(|(b_len, b_load, _)| len > b_len || (len == b_len && load < b_load))
            {
                best = Some((len, load, i));
            }
        }
        match best {
            Some((len, _, i)) if len as f64 >= needed => i,
            _ => self.fallback.pick(req, candidates),
        }
    }
}

impl Pick for CacheAware {
    fn pick(&self, req: &RequestView<'_>, candidates: &[Arc<Endpoint>]) -> usize {
        if candidates.is_empty() {
            // Outside the contract; 0 is what `PerLeg` clamps to, and nothing is learnt.
            return 0;
        }
        let blocks = self.prefix.block_hashes(req);
        if blocks.is_empty() {
            return self.fallback.pick(req, candidates);
        }
        let i = self.choose(req, &blocks, candidates);
        if let Some(ep) = candidates.get(i) {
            self.lock().record(&blocks, endpoint_key(ep.id().as_str()));
        }
        i
    }
}

/// An endpoint as the table knows it: a stable hash of its id (never 0, the empty slot).
fn endpoint_key(id: &str) -> NonZeroU64 {
    const ENDPOINT_SEED: u64 = 0x6469_7361_6767_6570; // "disaggep"
    NonZeroU64::new(block_hash(ENDPOINT_SEED, id.as_bytes())).unwrap_or(NonZeroU64::MIN)
}

/// The endpoints last sent a block, most recent first.
type Owners = [Option<NonZeroU64>; OWNERS];

/// The two-generation block table (see the module docs).
struct Table {
    current: HashMap<u64, Owners, KeyMix>,
    older: HashMap<u64, Owners, KeyMix>,
    /// The most entries per generation: half the capacity.
    generation: usize,
}

impl Table {
    fn new(capacity: usize) -> Self {
        let mix = KeyMix::new();
        Table {
            current: HashMap::with_hasher(mix.clone()),
            older: HashMap::with_hasher(mix),
            generation: (capacity / 2).max(1),
        }
    }

    fn len(&self) -> usize {
        self.current.len() + self.older.len()
    }

    /// For each endpoint holding some of `blocks`' leading run: how many blocks it holds.
    fn matches(&self, blocks: &[u64]) -> Vec<(NonZeroU64, usize)> {
        let mut held: Vec<(NonZeroU64, usize)> = Vec::new();
        for (i, b) in blocks.iter().enumerate() {
            // Entries are prefix-closed: no later block can be present either.
            let Some(owners) = self.current.get(b).or_else(|| self.older.get(b)) else {
                break;
            };
            for &owner in owners.iter().flatten() {
                match held.iter_mut().find(|(o, _)| *o == owner) {
                    Some(slot) => slot.1 = i + 1,
                    None => held.push((owner, i + 1)),
                }
            }
        }
        held
    }

    /// Remember that `owner` was sent `blocks`.
    fn record(&mut self, blocks: &[u64], owner: NonZeroU64) {
        // A prompt longer than a generation keeps its first blocks (still prefix-closed).
        let blocks = &blocks[..blocks.len().min(self.generation)];
        if self.current.len() + blocks.len() > self.generation {
            // Forget the older generation; keep its allocation for the new current one.
            std::mem::swap(&mut self.current, &mut self.older);
            self.current.clear();
        }
        for &b in blocks {
            let owners = match self.current.entry(b) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(e) => e.insert(self.older.remove(&b).unwrap_or_default()),
            };
            // Move `owner` to the front; the least recent falls off when it is new.
            let at = owners
                .iter()
                .position(|o| *o == Some(owner))
                .unwrap_or(OWNERS - 1);
            owners[..=at].rotate_right(1);
            owners[0] = Some(owner);
        }
    }
}

/// Hashes the table's keys. They are already well-mixed 64-bit hashes, but a client
/// chooses its prompt and so could choose keys that share their low bits (the bucket
/// index) and fill one probe sequence; mixing with a per-table random seed prevents that
/// at the cost of one finalizer, far cheaper than SipHash.
#[derive(Clone)]
struct KeyMix {
    seed: u64,
}

impl KeyMix {
    fn new() -> Self {
        KeyMix {
            seed: RandomState::new().hash_one(0u64),
        }
    }
}

impl BuildHasher for KeyMix {
    type Hasher = MixHasher;

    fn build_hasher(&self) -> MixHasher {
        MixHasher(self.seed)
    }
}

struct MixHasher(u64);

impl Hasher for MixHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0 = block_hash(self.0, bytes);
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = finalize(self.0 ^ x);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use disagg_core::{Role, json::JsonBody, request::Api};
    use http::HeaderMap;
    use proptest::prelude::*;

    use super::*;

    fn eps(n: usize) -> Vec<Arc<Endpoint>> {
        (0..n)
            .map(|i| {
                Arc::new(
                    Endpoint::new(&format!("http://10.0.1.{i}:8100"), Role::Prefill)
                        .expect("valid url"),
                )
            })
            .collect()
    }

    fn chat(system: &str, user: &str) -> JsonBody {
        let body = serde_json::json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": user},
            ],
        });
        JsonBody::parse(body.to_string().as_bytes()).expect("test body")
    }

    fn pick(p: &CacheAware, body: &JsonBody, c: &[Arc<Endpoint>]) -> usize {
        let h = HeaderMap::new();
        p.pick(&RequestView::new(Api::Chat, Some("m"), &h, body), c)
    }

    fn long_text(seed: &str, bytes: usize) -> String {
        let mut s = String::new();
        let mut i = 0;
        while s.len() < bytes {
            s.push_str(&format!(
                "{seed} rule {i}: answer precisely and cite sources. "
            ));
            i += 1;
        }
        s
    }

    fn load(c: &[Arc<Endpoint>], per: &[usize]) -> Vec<disagg_core::endpoint::InFlightGuard> {
        per.iter()
            .enumerate()
            .flat_map(|(i, &n)| (0..n).map(move |_| i))
            .map(|i| c[i].track())
            .collect()
    }

    #[test]
    fn the_same_prefix_goes_back_while_balanced() {
        let c = eps(8);
        let p = CacheAware::new();
        let body = chat(&long_text("a", 1_000), "hello");
        let home = pick(&p, &body, &c);
        // Below the thresholds (5 − 0 ≤ 8): a few in flight on the home engine do not
        // move it.
        let mut per = [0; 8];
        per[home] = 5;
        per[(home + 1) % 8] = 3;
        let _busy = load(&c, &per);
        for _ in 0..20 {
            assert_eq!(pick(&p, &body, &c), home);
        }
    }

    #[test]
    fn a_shared_system_prompt_routes_together() {
        let c = eps(16);
        let p = CacheAware::new();
        let system = long_text("s", 2_000);
        let home = pick(&p, &chat(&system, "first question"), &c);
        for turn in 0..30 {
            let user = format!("question {turn}: what does rule {turn} mean?");
            assert_eq!(pick(&p, &chat(&system, &user), &c), home, "{turn}");
        }
        // A different system prompt starts elsewhere: least in flight, whose ties go
        // round in turn.
        let other = pick(&p, &chat(&long_text("t", 2_000), "hi"), &c);
        assert_ne!(other, home);
        assert_eq!(pick(&p, &chat(&system, "again"), &c), home);
    }

    #[test]
    fn imbalance_overrides_locality() {
        let c = eps(4);
        let p = CacheAware::new();
        let body = chat(&long_text("a", 1_000), "hello");
        let home = pick(&p, &body, &c);
        // 9 over the idlest (> 8) and more than 1.5 × 0: load decides.
        let _g = load(&c[home..=home], &[9]);
        let moved = pick(&p, &body, &c);
        assert_ne!(moved, home);
        // Both hold the prefix now; back in balance, the less loaded of the two wins.
        let _g2 = load(&c[moved..=moved], &[2]);
        let _g3 = load(
            &c,
            &(0..4)
                .map(|i| if i == home || i == moved { 0 } else { 4 })
                .collect::<Vec<_>>(),
        );
        // in flight: home 9, moved 2, others 4: max − min = 7, balanced.
        assert_eq!(pick(&p, &body, &c), moved);
    }

    #[test]
    fn the_relative_threshold_keeps_locality_under_high_load() {
        let c = eps(2);
        let p = CacheAware::new();
        let body = chat(&long_text("a", 1_000), "hello");
        let home = pick(&p, &body, &c);
        // 120 against 100: 20 apart, but not 1.5 times: stay.
        let mut per = [100; 2];
        per[home] = 120;
        let _g = load(&c, &per);
        assert_eq!(pick(&p, &body, &c), home);
    }

    #[test]
    fn a_small_match_goes_to_the_least_loaded() {
        let c = eps(3);
        let p = CacheAware::new();
        let short_system = long_text("s", 200);
        let home = pick(&p, &chat(&short_system, &long_text("u", 100)), &c);
        let _g = load(&c[home..=home], &[1]);
        // Same 200-byte start, then 2 KB of new text: well under half cached.
        let i = pick(&p, &chat(&short_system, &long_text("v", 2_000)), &c);
        assert_ne!(i, home);
        // A threshold of 0 follows any match.
        let p0 = CacheAware::new().with_cache_threshold(0.0).expect("valid");
        let h0 = pick(&p0, &chat(&short_system, &long_text("u", 100)), &c);
        let _g = load(&c[h0..=h0], &[1]);
        assert_eq!(
            pick(&p0, &chat(&short_system, &long_text("w", 2_000)), &c),
            h0
        );
    }

    #[test]
    fn endpoints_are_known_by_id() {
        let c = eps(4);
        let p = CacheAware::new();
        let body = chat(&long_text("a", 1_000), "hello");
        let home = pick(&p, &body, &c);
        // Reordered: the same engine, at its new index.
        let mut rev = c.clone();
        rev.reverse();
        assert_eq!(pick(&p, &body, &rev), c.len() - 1 - home);
        // Removed: another one takes it, no panic.
        let rest: Vec<_> = c
            .iter()
            .filter(|e| e.id() != c[home].id())
            .cloned()
            .collect();
        let i = pick(&p, &body, &rest);
        assert!(i < rest.len());
        // Back: both the newcomer and the old home hold the prefix; idle, ties go to
        // candidate order among the two.
        let j = pick(&p, &body, &c);
        assert!(j == home || c[j].id() == rest[i].id(), "{j}");
    }

    #[test]
    fn no_prompt_is_least_in_flight_and_not_remembered() {
        let c = eps(3);
        let p = CacheAware::new();
        let _g = load(&c, &[2, 0, 1]);
        for body in [
            r#"{"model":"m"}"#,
            r#"{"messages":[{"role":"user","content":"short"}]}"#,
            r#"{"messages":"not a list"}"#,
        ] {
            let b = JsonBody::parse(body.as_bytes()).expect("test body");
            assert_eq!(pick(&p, &b, &c), 1, "{body}");
        }
        assert_eq!(p.entries(), 0);
    }

    #[test]
    fn no_candidates_do_not_panic() {
        let p = CacheAware::new();
        assert_eq!(pick(&p, &chat(&long_text("a", 1_000), "hello"), &[]), 0);
        assert_eq!(p.entries(), 0);
    }

    #[test]
    fn settings_are_checked() {
        assert!(matches!(
            CacheAware::new().with_capacity(1),
            Err(CacheAwareError::Capacity(1))
        ));
        assert!(CacheAware::new().with_capacity(2).is_ok());
        for bad in [-0.1, 1.1, f64::NAN] {
            assert!(
                CacheAware::new().with_cache_threshold(bad).is_err(),
                "{bad}"
            );
        }
        for bad in [0.5, f64::NAN] {
            assert!(CacheAware::new().with_balance(1, bad).is_err(), "{bad}");
        }
        assert!(
            CacheAware::new()
                .with_balance(usize::MAX, f64::INFINITY)
                .is_ok()
        );
        assert!(matches!(
            CacheAware::new().with_block_size(0),
            Err(CacheAwareError::Prefix(PrefixError::ZeroBlockSize))
        ));
        assert!(matches!(
            CacheAware::new().with_max_blocks(0),
            Err(CacheAwareError::Prefix(PrefixError::ZeroMaxBlocks))
        ));
    }

    #[test]
    fn generations_rotate_and_keep_recent_prefixes() {
        let mut t = Table::new(8);
        let a = NonZeroU64::MIN;
        t.record(&[1, 2, 3], a);
        t.record(&[4, 5], a);
        assert_eq!(t.len(), 5);
        // 2 + 3 > 4: rotate; 1..=3 move forward when recorded again.
        t.record(&[1, 2, 3], a);
        assert_eq!((t.current.len(), t.older.len()), (3, 2));
        // Another rotation forgets 4 and 5, keeps 1..=3.
        t.record(&[6, 7], a);
        assert_eq!(t.matches(&[1, 2, 3]), [(a, 3)]);
        assert!(t.matches(&[4, 5]).is_empty());
        // Longer than a generation: the first 4 blocks only.
        t.record(&[10, 11, 12, 13, 14, 15], a);
        assert_eq!(t.matches(&[10, 11, 12, 13, 14, 15]), [(a, 4)]);
    }

    #[test]
    fn owners_are_most_recent_first() {
        let mut t = Table::new(100);
        let k = |n| NonZeroU64::new(n).expect("non-zero");
        t.record(&[1, 2], k(1));
        t.record(&[1], k(2));
        assert_eq!(t.matches(&[1, 2]), [(k(2), 1), (k(1), 2)]);
        t.record(&[1], k(3));
        // k(1) fell off block 1 but still holds block 2 through it.
        assert_eq!(t.matches(&[1, 2]), [(k(3), 1), (k(2), 1), (k(1), 2)]);
        t.record(&[1], k(2));
        assert_eq!(t.current[&1], [Some(k(2)), Some(k(3))]);
    }

    proptest! {
        /// The table never holds more than its capacity in entries, nor allocates room
        /// for much more, whatever is recorded.
        #[test]
        fn memory_is_bounded(
            capacity in 2usize..200,
            ops in proptest::collection::vec(
                (proptest::collection::vec(0u64..300, 0..60), 1u64..6),
                0..200,
            ),
        ) {
            let mut t = Table::new(capacity);
            for (blocks, owner) in ops {
                let owner = NonZeroU64::new(owner).expect("non-zero");
                t.record(&blocks, owner);
                let _ = t.matches(&blocks);
                prop_assert!(t.len() <= capacity, "{} > {}", t.len(), capacity);
                let room = (2 * t.generation).max(7);
                prop_assert!(t.current.capacity() <= room && t.older.capacity() <= room);
            }
        }

        /// Through the policy: any bodies, any loads, a valid index and a bounded table.
        #[test]
        fn picks_are_valid_and_the_table_bounded(
            capacity in 2usize..64,
            reqs in proptest::collection::vec((0usize..4, 0usize..4, 0usize..8), 1..60),
        ) {
            let c = eps(5);
            let p = CacheAware::new()
                .with_capacity(capacity)
                .and_then(|p| p.with_block_size(16))
                .expect("valid");
            let systems = ["", "alpha ", "beta beta beta beta ", "gamma "];
            let mut guards = Vec::new();
            for (s, u, hold) in reqs {
                let body = chat(&systems[s].repeat(20), &format!("user {u}"));
                let i = pick(&p, &body, &c);
                prop_assert!(i < c.len());
                if hold > 4 {
                    guards.push(c[i].track());
                }
                prop_assert!(p.entries() <= capacity);
            }
        }
    }
}
