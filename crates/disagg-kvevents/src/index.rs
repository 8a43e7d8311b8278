//! [`KvIndex`]: which engine (and data-parallel rank) holds which prompt prefixes, from
//! the engines' own KV-cache events.
//!
//! # What is kept
//!
//! A *holder* is one (engine, DP rank): each rank of an engine has its own KV cache and
//! publishes its own events. For each holder the index keeps the blocks its events say
//! it caches, keyed by our chained prefix key ([`crate::key`]) recomputed from each
//! `BlockStored` event's `token_ids`, chained from the key of its parent block. The
//! engine's own block hash is kept only to apply `BlockRemoved` (engine hash → our key).
//!
//! Blocks the index cannot key from tokens alone are skipped, so that a request never
//! matches KV it could not use: blocks of a LoRA adapter or under a cache salt, blocks
//! from the first non-nil `extra_keys` entry on (multimodal input), blocks of a KV cache
//! group other than the first (hybrid models), a block size other than the holder's
//! (set by its first `BlockStored`, and again after [`KvIndex::reset`]: an engine
//! restarted with another block size), and blocks whose parent the index does not know
//! (its events were lost and the entries dropped). They are counted in
//! [`Applied::skipped`].
//!
//! # Lookup
//!
//! A lookup hashes the request's full blocks lazily and walks them in order: at each
//! block it reads the set of holders of that key and keeps those that held every block
//! so far (a bit set intersected a word at a time); it stops at the first block nobody
//! still matching holds. Cost: one hash and one map lookup per matched block, plus a
//! word per 64 holders: a 32k-token prompt (2,048 blocks of 16) costs about 2,048
//! lookups whatever the number of engines, and a prompt nobody holds one (see the
//! crate's bench).
//!
//! # Concurrency
//!
//! Readers (the router, synchronous, on the request path) never wait for a whole batch
//! to be applied nor for each other: the map from key to holders is split into
//! [`SHARDS`] shards, each behind its own `RwLock`, and every lock is held for one key
//! only, by a reader for one lookup and by a writer for one insert or delete. A reader
//! therefore waits at most for one key's update, never for a batch, an engine's removal
//! or another reader. The writers' own state (engine hash → key, per holder) sits behind
//! one mutex per holder, which readers never touch; the list of holders is an immutable
//! snapshot replaced on change (readers clone an `Arc`).
//!
//! Why not one lock: a lookup of a long prompt walks thousands of blocks, and a writer
//! applying a batch meanwhile would stall every request behind it (and readers behind a
//! waiting writer, in a writer-preferring lock). Why not a copy-on-write snapshot
//! (`arc_swap`) of the whole index: engines publish a batch per scheduler step, and
//! copying an index of millions of blocks per batch costs far more than the lookups it
//! would speed up. The sharded map gives up only the atomicity of a batch: a lookup may
//! see half of a batch, which is as good as seeing it a step earlier or later.
//!
//! # Memory
//!
//! Bounded per holder by [`IndexConfig::max_blocks_per_holder`], in two generations (the
//! older one dropped whole when the current one is full, a block stored again moves to
//! the current one): the engine's own evictions normally keep a holder far below the
//! cap; the cap bounds what lost removals or a misbehaving engine could pile up.
//!
//! A block held by one holder costs 64 bytes of entries: 40 in the key → holders map
//! (the 8-byte key and a holder set of up to 4 holders inline) and 24 in the holder's
//! engine hash → key map (two 8-byte hashes and the medium flags), plus a control byte
//! in each map. hashbrown keeps its tables at most 7/8 full and grows them by doubling,
//! so that is about 75 bytes per block with full tables and up to twice that just after
//! a table grew. Each further holder of the same block adds its own 24-byte entry (and
//! control byte) and 4 bytes in the set; beyond 4 holders the set becomes a bit set of
//! one bit per holder slot (64 bytes at 512 holders). At the default cap of 262,144
//! blocks per holder (4 million tokens at 16 per block) a holder costs at most about
//! 20 to 40 MiB, reached only when an engine's cache is that large.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use journal::Journal;

use crate::event::{BlockRemoved, BlockStored, EventBatch, KvEvent};
use crate::key::{BlockKeys, KeyIter, KeyMix, ROOT_KEY, block_key};
use crate::load::LoadBoard;

/// Shards of the key → holders map: enough that two cores (or a few dozen) rarely meet
/// on one lock, few enough that their fixed cost (a lock and an empty map each) is
/// nothing.
pub const SHARDS: usize = 64;

/// The default block size for holders that have not published an event yet (vLLM's
/// and SGLang's default page of 16 tokens on GPUs).
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// The default bound on the blocks kept per holder: 262,144 blocks, 4 million tokens at
/// 16 per block, above the KV cache of one engine on one 80 GB GPU for common models.
pub const DEFAULT_MAX_BLOCKS_PER_HOLDER: usize = 1 << 18;

/// Settings of a [`KvIndex`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexConfig {
    /// Tokens per block of an engine that has published no `BlockStored` yet (the
    /// proxy's `--block-size`); afterwards each holder's own events say.
    pub block_size: usize,
    /// The most blocks kept per (engine, DP rank); see the [module docs](self).
    pub max_blocks_per_holder: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            block_size: DEFAULT_BLOCK_SIZE,
            max_blocks_per_holder: DEFAULT_MAX_BLOCKS_PER_HOLDER,
        }
    }
}

/// What applying one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// Blocks added (or stored again).
    pub stored: usize,
    /// Blocks removed.
    pub removed: usize,
    /// `AllBlocksCleared` events.
    pub cleared: usize,
    /// Blocks of `BlockStored` events that were not indexed (see the
    /// [module docs](self)).
    pub skipped: usize,
    /// Events of an unknown type.
    pub unknown: usize,
}

/// How far one holder matches a prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HolderMatch {
    /// The engine, as named to the index.
    pub engine: Arc<str>,
    /// Its data-parallel rank.
    pub dp_rank: u32,
    /// Leading full blocks of the prompt it holds.
    pub blocks: usize,
    /// Its tokens per block.
    pub block_size: usize,
}

impl HolderMatch {
    /// Leading tokens of the prompt it holds.
    pub fn tokens(&self) -> usize {
        self.blocks.saturating_mul(self.block_size)
    }
}

/// The holders that hold a leading part of a prompt (none listed with 0 blocks).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    matches: Vec<HolderMatch>,
}

impl PrefixMatch {
    /// Every holder with at least one leading block, in no particular order.
    pub fn holders(&self) -> &[HolderMatch] {
        &self.matches
    }

    /// The best-matching rank of `engine`, if any rank matches.
    pub fn engine(&self, engine: &str) -> Option<&HolderMatch> {
        self.matches
            .iter()
            .filter(|m| &*m.engine == engine)
            .max_by_key(|m| (m.tokens(), std::cmp::Reverse(m.dp_rank)))
    }

    /// How far rank `dp_rank` of `engine` matches, if it does.
    pub fn rank(&self, engine: &str, dp_rank: u32) -> Option<&HolderMatch> {
        self.matches
            .iter()
            .find(|m| &*m.engine == engine && m.dp_rank == dp_rank)
    }

    /// The holder with the most leading tokens (ties: the engine name, then rank, that
    /// sorts first, so that every replica reports the same).
    pub fn best(&self) -> Option<&HolderMatch> {
        self.matches.iter().max_by(|a, b| {
            a.tokens()
                .cmp(&b.tokens())
                .then_with(|| b.engine.cmp(&a.engine))
                .then_with(|| b.dp_rank.cmp(&a.dp_rank))
        })
    }

    /// Whether no holder holds the first block.
    pub fn is_empty(&self) -> bool {
        self.matches.is_empty()
    }
}

/// Sizes of a [`KvIndex`], for stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Holders (engine, DP rank) known.
    pub holders: usize,
    /// Blocks kept, summed over holders.
    pub blocks: usize,
    /// Distinct prefix keys.
    pub keys: usize,
}

/// The prefix index; see the [module docs](self). Share it in an `Arc`: the subscriber
/// writes, routers read.
///
/// # Examples
///
/// ```
/// use disagg_kvevents::event::{BlockHash, BlockStored, EventBatch, KvEvent};
/// use disagg_kvevents::{IndexConfig, KvIndex};
///
/// let index = KvIndex::new(IndexConfig::default());
/// let tokens: Vec<u32> = (0..48).collect();
/// let stored = BlockStored {
///     block_hashes: vec![BlockHash::Int(1), BlockHash::Int(2)],
///     token_ids: tokens[..32].to_vec(),
///     block_size: 16,
///     ..BlockStored::default()
/// };
/// let batch = EventBatch { ts: 0.0, events: vec![KvEvent::BlockStored(stored)], dp_rank: None };
/// index.apply("http://10.0.0.1:8000", 0, &batch);
///
/// // The engine holds the first 32 of these 48 tokens.
/// assert_eq!(index.cached_tokens("http://10.0.0.1:8000", &tokens), 32);
/// assert_eq!(index.match_prefix(&tokens).best().map(|m| m.blocks), Some(2));
/// ```
pub struct KvIndex {
    config: IndexConfig,
    shards: Box<[RwLock<HashMap<u64, HolderSet, KeyMix>>]>,
    registry: RwLock<Arc<Registry>>,
    table: Mutex<HolderTable>,
    mix: KeyMix,
    loads: LoadBoard,
    /// The blocks the engines' events removed lately, for the scorers' provisional
    /// entries ([`KvIndex::removals_since`]).
    removals: Journal,
}

impl fmt::Debug for KvIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvIndex")
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// Holders as readers see them: an immutable snapshot, replaced on change.
#[derive(Debug, Clone, Default)]
struct Registry {
    /// By slot; `None` for a free slot.
    slots: Vec<Option<SlotInfo>>,
    /// The distinct block sizes of the holders that have one.
    block_sizes: Vec<usize>,
    /// Each engine's block size (its lowest rank's that has one). Engine ids are
    /// configured, not chosen by clients: XXH3 hashes them several times faster than
    /// SipHash.
    by_engine: HashMap<Arc<str>, usize, xxhash_rust::xxh3::Xxh3DefaultBuilder>,
}

#[derive(Debug, Clone)]
struct SlotInfo {
    engine: Arc<str>,
    rank: u32,
    block_size: Option<usize>,
}

/// The writers' view: (engine, rank) → holder state, and the free slots.
#[derive(Debug, Default)]
struct HolderTable {
    by_name: HashMap<(Arc<str>, u32), Arc<Mutex<HolderState>>>,
    free: Vec<u32>,
    next: u32,
}

/// One holder's blocks, by the engine's hash, in two generations.
#[derive(Debug)]
struct HolderState {
    slot: u32,
    block_size: Option<usize>,
    current: HashMap<u64, Block, KeyMix>,
    older: HashMap<u64, Block, KeyMix>,
    /// The most entries per generation: half the cap.
    generation: usize,
    /// Set when the holder was dropped: a writer still holding its `Arc` must not touch
    /// the shards any more (its slot may be given to another holder).
    removed: bool,
}

#[derive(Debug, Clone, Copy)]
struct Block {
    key: u64,
    /// Which media hold the block ([`medium_bit`]); gone when none does.
    media: u8,
}

/// The bit of a medium in [`Block::media`]. A block offloaded to the CPU and evicted
/// from the GPU (vLLM's offloading connector, SGLang's hierarchical cache) is still
/// held: loading it back is cheaper than computing it.
fn medium_bit(medium: Option<&str>) -> u8 {
    match medium {
        None | Some("GPU") => 1,
        Some("CPU" | "CPU_PINNED") => 2,
        Some("DISK" | "STORAGE") => 4,
        Some(_) => 8,
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // No code panics while holding these locks; a state left half-updated by a panic
    // would still be a valid (if less accurate) index.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(PoisonError::into_inner)
}

// === impl KvIndex ===

impl KvIndex {
    /// An empty index.
    pub fn new(config: IndexConfig) -> Self {
        let mix = KeyMix::new();
        KvIndex {
            config: IndexConfig {
                block_size: config.block_size.max(1),
                max_blocks_per_holder: config.max_blocks_per_holder.max(2),
            },
            shards: (0..SHARDS)
                .map(|_| RwLock::new(HashMap::with_hasher(mix.clone())))
                .collect(),
            registry: RwLock::default(),
            table: Mutex::default(),
            mix,
            loads: LoadBoard::default(),
            removals: Journal::default(),
        }
    }

    /// Calls `f(engine, dp_rank, key)` for each block removed by the engines' events
    /// since `cursor` (0 for a new reader), and moves `cursor` past them. Takes no lock
    /// when nothing was removed since.
    pub(crate) fn removals_since(&self, cursor: &mut u64, f: impl FnMut(&str, u32, u64)) {
        self.removals.since(cursor, f);
    }

    /// The settings.
    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// Applies one batch of `engine`'s data-parallel rank `dp_rank`, in order. The
    /// holder is created on its first batch.
    pub fn apply(&self, engine: &str, dp_rank: u32, batch: &EventBatch) -> Applied {
        let holder = self.holder(engine, dp_rank);
        let mut state = lock(&holder);
        let mut applied = Applied::default();
        if state.removed {
            // Dropped while this batch was on its way: the engine is gone.
            return applied;
        }
        let mut gone = Vec::new();
        for event in &batch.events {
            match event {
                KvEvent::BlockStored(e) => self.store(&mut state, e, &mut applied),
                KvEvent::BlockRemoved(e) => self.remove(&mut state, e, &mut applied, &mut gone),
                KvEvent::AllBlocksCleared => {
                    self.clear_state(&mut state, false);
                    applied.cleared += 1;
                }
                KvEvent::Unknown(_) => applied.unknown += 1,
            }
        }
        drop(state);
        if !gone.is_empty() {
            self.removals.record(engine, dp_rank, &gone);
        }
        applied
    }

    /// Drops every block of one holder (lost events: its state is unknown), keeping the
    /// holder and its block size.
    pub fn clear(&self, engine: &str, dp_rank: u32) {
        self.drop_blocks(engine, dp_rank, false);
    }

    /// [`clear`](Self::clear), and forgets the holder's block size, which its next
    /// `BlockStored` sets again: for an engine that restarted (or may have), which may
    /// use another block size now.
    pub fn reset(&self, engine: &str, dp_rank: u32) {
        self.drop_blocks(engine, dp_rank, true);
    }

    fn drop_blocks(&self, engine: &str, dp_rank: u32, forget_size: bool) {
        let holder = lock(&self.table)
            .by_name
            .get(&(Arc::from(engine), dp_rank))
            .cloned();
        if let Some(holder) = holder {
            let mut state = lock(&holder);
            self.clear_state(&mut state, forget_size);
        }
    }

    /// The engines' load reports, kept next to their blocks (see [`crate::load`]).
    pub fn loads(&self) -> &LoadBoard {
        &self.loads
    }

    /// Forgets an engine, every rank: its blocks, its holders and their block sizes,
    /// and its load reports.
    pub fn remove_engine(&self, engine: &str) {
        self.loads.remove_engine(engine);
        let removed: Vec<Arc<Mutex<HolderState>>> = {
            let mut table = lock(&self.table);
            let keys: Vec<(Arc<str>, u32)> = table
                .by_name
                .keys()
                .filter(|(e, _)| &**e == engine)
                .cloned()
                .collect();
            keys.iter()
                .filter_map(|k| table.by_name.remove(k))
                .collect()
        };
        for holder in removed {
            let slot = {
                let mut state = lock(&holder);
                self.clear_state(&mut state, false);
                state.removed = true;
                state.slot
            };
            self.update_registry(|r| {
                if let Some(s) = r.slots.get_mut(slot as usize) {
                    *s = None;
                }
            });
            // Only now may the slot serve another holder: no key names it any more.
            lock(&self.table).free.push(slot);
        }
    }

    /// The engines known (those that published at least one batch and were not
    /// removed), sorted.
    pub fn engines(&self) -> Vec<String> {
        let registry = self.registry();
        let mut engines: Vec<String> = registry
            .slots
            .iter()
            .flatten()
            .map(|s| s.engine.to_string())
            .collect();
        engines.sort();
        engines.dedup();
        engines
    }

    /// The block size of `engine`'s events (its first rank that published one), or
    /// `None` before any.
    pub fn block_size(&self, engine: &str) -> Option<usize> {
        self.registry().by_engine.get(engine).copied()
    }

    /// [`block_size`](Self::block_size) of several engines at once (one snapshot).
    pub fn block_sizes(&self, engines: &[&str]) -> Vec<Option<usize>> {
        let registry = self.registry();
        engines
            .iter()
            .map(|e| registry.by_engine.get(*e).copied())
            .collect()
    }

    /// Every holder's leading match of `tokens` (each holder's prompt cut at its own
    /// block size).
    pub fn match_prefix(&self, tokens: &[u32]) -> PrefixMatch {
        let registry = self.registry();
        let mut matches = Vec::new();
        for &block_size in &registry.block_sizes {
            let keys = KeyIter::new(tokens, block_size);
            self.walk(&registry, keys, block_size, None, &mut matches);
        }
        PrefixMatch { matches }
    }

    /// Like [`match_prefix`](Self::match_prefix) on keys already computed: the holders
    /// of that block size only.
    pub fn match_keys(&self, keys: &BlockKeys) -> PrefixMatch {
        let registry = self.registry();
        let mut matches = Vec::new();
        let block_size = keys.block_size();
        self.walk(
            &registry,
            keys.keys().iter().copied(),
            block_size,
            None,
            &mut matches,
        );
        PrefixMatch { matches }
    }

    /// How many leading tokens of `tokens` `engine` holds (its best rank): for
    /// conditional disaggregation, the prompt a decode engine would not have to compute.
    pub fn cached_tokens(&self, engine: &str, tokens: &[u32]) -> usize {
        self.cached_tokens_of(engine, None, tokens)
    }

    /// [`cached_tokens`](Self::cached_tokens) of one rank.
    pub fn cached_tokens_on_rank(&self, engine: &str, dp_rank: u32, tokens: &[u32]) -> usize {
        self.cached_tokens_of(engine, Some(dp_rank), tokens)
    }

    fn cached_tokens_of(&self, engine: &str, dp_rank: Option<u32>, tokens: &[u32]) -> usize {
        let registry = self.registry();
        let slots: Vec<u32> = registry
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.as_ref()
                    .filter(|s| &*s.engine == engine && dp_rank.is_none_or(|r| r == s.rank))
                    .and_then(|_| u32::try_from(i).ok())
            })
            .collect();
        let mut sizes: Vec<usize> = slots
            .iter()
            .filter_map(|&s| registry.slots[s as usize].as_ref()?.block_size)
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        let mut matches = Vec::new();
        for block_size in sizes {
            let keys = KeyIter::new(tokens, block_size);
            self.walk(&registry, keys, block_size, Some(&slots), &mut matches);
        }
        matches.iter().map(HolderMatch::tokens).max().unwrap_or(0)
    }

    /// Sizes, for stats (takes each lock briefly).
    pub fn stats(&self) -> IndexStats {
        let holders: Vec<Arc<Mutex<HolderState>>> =
            lock(&self.table).by_name.values().cloned().collect();
        let blocks = holders
            .iter()
            .map(|h| {
                let s = lock(h);
                s.current.len() + s.older.len()
            })
            .sum();
        let keys = self.shards.iter().map(|s| read(s).len()).sum();
        IndexStats {
            holders: holders.len(),
            blocks,
            keys,
        }
    }

    fn registry(&self) -> Arc<Registry> {
        read(&self.registry).clone()
    }

    fn update_registry(&self, f: impl FnOnce(&mut Registry)) {
        let mut guard = write(&self.registry);
        let registry = Arc::make_mut(&mut guard);
        f(registry);
        let mut sizes: Vec<usize> = registry
            .slots
            .iter()
            .flatten()
            .filter_map(|s| s.block_size)
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        registry.block_sizes = sizes;
        let mut by_engine: HashMap<Arc<str>, (u32, usize)> = HashMap::new();
        for s in registry.slots.iter().flatten() {
            if let Some(b) = s.block_size {
                let e = by_engine.entry(s.engine.clone()).or_insert((s.rank, b));
                if s.rank < e.0 {
                    *e = (s.rank, b);
                }
            }
        }
        registry.by_engine = by_engine.into_iter().map(|(k, (_, b))| (k, b)).collect();
    }

    /// The holder of (engine, rank), created (with a slot) on first use.
    fn holder(&self, engine: &str, rank: u32) -> Arc<Mutex<HolderState>> {
        let engine: Arc<str> = Arc::from(engine);
        let mut table = lock(&self.table);
        if let Some(h) = table.by_name.get(&(engine.clone(), rank)) {
            return h.clone();
        }
        let slot = match table.free.pop() {
            Some(slot) => slot,
            None => {
                table.next += 1;
                table.next - 1
            }
        };
        let generation = self.config.max_blocks_per_holder / 2;
        let state = Arc::new(Mutex::new(HolderState {
            slot,
            block_size: None,
            current: HashMap::with_hasher(self.mix.clone()),
            older: HashMap::with_hasher(self.mix.clone()),
            generation: generation.max(1),
            removed: false,
        }));
        table.by_name.insert((engine.clone(), rank), state.clone());
        // Registered while the table is locked, so a concurrent removal of the engine
        // finds both or neither.
        self.update_registry(|r| {
            let at = slot as usize;
            if r.slots.len() <= at {
                r.slots.resize(at + 1, None);
            }
            r.slots[at] = Some(SlotInfo {
                engine,
                rank,
                block_size: None,
            });
        });
        state
    }

    fn shard(&self, key: u64) -> &RwLock<HashMap<u64, HolderSet, KeyMix>> {
        // The top bits: the maps inside use the (seeded) low bits.
        &self.shards[(key >> 58) as usize % SHARDS]
    }

    fn shard_add(&self, key: u64, slot: u32) {
        write(self.shard(key)).entry(key).or_default().insert(slot);
    }

    fn shard_remove(&self, key: u64, slot: u32) {
        let mut shard = write(self.shard(key));
        if shard.get_mut(&key).is_some_and(|set| set.remove(slot)) {
            shard.remove(&key);
        }
    }

    fn store(&self, state: &mut HolderState, e: &BlockStored, applied: &mut Applied) {
        let n = e.block_hashes.len();
        let block_size = e.block_size;
        // Blocks whose engine hash covers more than their tokens, or of another cache
        // group: a request keyed by its tokens alone would not hit them.
        // A size no engine uses (0, or beyond the decoder's ceiling) from a caller
        // that built the event itself: its products could overflow.
        let tokens_needed = n.checked_mul(block_size);
        if e.namespaced
            || e.group_idx.unwrap_or(0) != 0
            || !(1..=crate::event::MAX_BLOCK_SIZE).contains(&block_size)
            || tokens_needed.is_none_or(|need| e.token_ids.len() < need)
        {
            applied.skipped += n;
            return;
        }
        match state.block_size {
            None => {
                state.block_size = Some(block_size);
                let slot = state.slot as usize;
                self.update_registry(|r| {
                    if let Some(Some(s)) = r.slots.get_mut(slot) {
                        s.block_size = Some(block_size);
                    }
                });
            }
            // A block of another size (vLLM's partial blocks of hybrid models) would
            // never match a lookup cut at the holder's block size.
            Some(b) if b != block_size => {
                applied.skipped += n;
                return;
            }
            Some(_) => {}
        }
        let mut parent = match &e.parent_block_hash {
            None => ROOT_KEY,
            Some(h) => match state.get(h.as_u64()) {
                Some(b) => b.key,
                // The parent's entry was dropped (lost events, the cap): the chain
                // cannot be keyed until a request re-announces it from its start.
                None => {
                    applied.skipped += n;
                    return;
                }
            },
        };
        let bit = medium_bit(e.medium.as_deref());
        let keyable = e.first_keyed_block.unwrap_or(n).min(n);
        for (i, hash) in e.block_hashes.iter().take(keyable).enumerate() {
            let tokens = &e.token_ids[i * block_size..(i + 1) * block_size];
            let key = block_key(parent, tokens);
            self.insert(state, hash.as_u64(), key, bit);
            parent = key;
        }
        applied.stored += keyable;
        applied.skipped += n - keyable;
    }

    fn insert(&self, state: &mut HolderState, hash: u64, key: u64, bit: u8) {
        let slot = state.slot;
        if !state.current.contains_key(&hash) {
            match state.older.remove(&hash) {
                // Stored again: it moves to the current generation.
                Some(b) => {
                    self.make_room(state);
                    state.current.insert(hash, b);
                }
                None => {
                    self.make_room(state);
                    state.current.insert(hash, Block { key, media: bit });
                    self.shard_add(key, slot);
                    return;
                }
            }
        }
        let Some(b) = state.current.get_mut(&hash) else {
            return;
        };
        if b.key == key {
            b.media |= bit;
        } else {
            // The engine reused a hash for other tokens (a restart with another hash
            // seed that was not detected): the new content wins.
            let old = b.key;
            *b = Block { key, media: bit };
            self.shard_remove(old, slot);
            self.shard_add(key, slot);
        }
    }

    /// Makes room for one entry in the current generation: when it is full, the older
    /// generation is dropped and the current one becomes the older.
    fn make_room(&self, state: &mut HolderState) {
        if state.current.len() < state.generation {
            return;
        }
        for (_, b) in state.older.drain() {
            self.shard_remove(b.key, state.slot);
        }
        std::mem::swap(&mut state.current, &mut state.older);
    }

    /// Applies a removal; the keys of the blocks gone go to `gone`.
    fn remove(
        &self,
        state: &mut HolderState,
        e: &BlockRemoved,
        applied: &mut Applied,
        gone: &mut Vec<u64>,
    ) {
        if e.group_idx.unwrap_or(0) != 0 {
            return;
        }
        let bit = medium_bit(e.medium.as_deref());
        for hash in &e.block_hashes {
            let hash = hash.as_u64();
            let map = if state.current.contains_key(&hash) {
                &mut state.current
            } else {
                &mut state.older
            };
            let Some(b) = map.get_mut(&hash) else {
                continue;
            };
            b.media &= !bit;
            if b.media == 0 {
                let key = b.key;
                map.remove(&hash);
                self.shard_remove(key, state.slot);
                applied.removed += 1;
                gone.push(key);
            }
        }
    }

    /// Drops every block of a holder, and with `forget_size` its block size.
    fn clear_state(&self, state: &mut HolderState, forget_size: bool) {
        let slot = state.slot;
        for (_, b) in state.current.drain().chain(state.older.drain()) {
            self.shard_remove(b.key, slot);
        }
        if forget_size && state.block_size.take().is_some() && !state.removed {
            self.update_registry(|r| {
                if let Some(Some(s)) = r.slots.get_mut(slot as usize) {
                    s.block_size = None;
                }
            });
        }
    }

    /// Walks `keys` in order; pushes the holders (of this block size, among `only` if
    /// given) that hold at least the first block, with their leading run.
    fn walk(
        &self,
        registry: &Registry,
        keys: impl Iterator<Item = u64>,
        block_size: usize,
        only: Option<&[u32]>,
        out: &mut Vec<HolderMatch>,
    ) {
        let words = registry.slots.len().div_ceil(64);
        let eligible = |slot: u32| {
            registry
                .slots
                .get(slot as usize)
                .and_then(Option::as_ref)
                .is_some_and(|s| s.block_size == Some(block_size))
                && only.is_none_or(|o| o.contains(&slot))
        };
        // The holders that held every block so far, as bits; a holder leaving the set
        // at block `i` matched `i` blocks.
        let mut alive = Bits::zeroed(words);
        let mut next = Bits::zeroed(words);
        let mut walked = 0usize;
        for (i, key) in keys.enumerate() {
            next.0.fill(0);
            {
                let shard = read(self.shard(key));
                let Some(set) = shard.get(&key) else {
                    break;
                };
                match set {
                    HolderSet::Few(list) => {
                        for &slot in list {
                            let keep = if i == 0 {
                                eligible(slot)
                            } else {
                                alive.has(slot)
                            };
                            if keep && (slot as usize) < words * 64 {
                                next.set(slot);
                            }
                        }
                    }
                    HolderSet::Many(bits) => {
                        for (w, word) in next.0.iter_mut().enumerate() {
                            let held = bits.get(w).copied().unwrap_or(0);
                            *word = if i == 0 { held } else { held & alive.0[w] };
                        }
                        if i == 0 {
                            // Only holders of this block size (and among `only`).
                            let ineligible: Vec<u32> =
                                next.slots().filter(|&s| !eligible(s)).collect();
                            for s in ineligible {
                                next.0[s as usize / 64] &= !(1u64 << (s % 64));
                            }
                        }
                    }
                }
            }
            if next.is_empty() {
                break;
            }
            if i > 0 {
                self.push_left(registry, &alive, &next, i, block_size, out);
            }
            std::mem::swap(&mut alive, &mut next);
            walked = i + 1;
        }
        // Those still matching when the walk stopped matched every block walked.
        let none = Bits::zeroed(words);
        self.push_left(registry, &alive, &none, walked, block_size, out);
    }

    /// Pushes the holders in `before` but not in `after`, with `blocks` matched.
    fn push_left(
        &self,
        registry: &Registry,
        before: &Bits,
        after: &Bits,
        blocks: usize,
        block_size: usize,
        out: &mut Vec<HolderMatch>,
    ) {
        for (w, (&b, &a)) in before.0.iter().zip(&after.0).enumerate() {
            let mut left = b & !a;
            while left != 0 {
                let slot = w * 64 + left.trailing_zeros() as usize;
                left &= left - 1;
                if let Some(Some(info)) = registry.slots.get(slot) {
                    out.push(HolderMatch {
                        engine: info.engine.clone(),
                        dp_rank: info.rank,
                        blocks,
                        block_size,
                    });
                }
            }
        }
    }
}

impl HolderState {
    fn get(&self, hash: u64) -> Option<&Block> {
        self.current.get(&hash).or_else(|| self.older.get(&hash))
    }
}

mod journal;
mod sets;
use sets::{Bits, HolderSet};

#[cfg(test)]
mod tests;
