//! The engine's prefix cache: per data-parallel rank, the KV blocks of the prompts it
//! computed (or received), evicted least recently used first, as vLLM's block pool does
//! (`vllm/v1/core/block_pool.py`), and the KV-cache events it publishes about them.
//!
//! A block is identified, as in vLLM, by a hash chained over its parent's hash and its
//! tokens (here FNV-1a over the model name, the parent hash and the token ids, mixed:
//! the engine's own function, unknown to a router, which must key blocks by their
//! tokens). Only full blocks are cached. A request never hits its whole prompt: like
//! vLLM (`max_cache_hit_length = num_tokens - 1` in `kv_cache_manager.py`), the last
//! token is always computed, so a hit stops one block short of a prompt that ends on a
//! block boundary.
//!
//! Eviction: blocks are ordered by last use. A request touches its blocks from the last
//! to the first, so that the first blocks of a prefix are the most recently used and
//! the tail of a chain goes first, as vLLM frees a finished request's blocks in reverse
//! order. Each batch of changes becomes one event batch: `BlockRemoved` for the evicted
//! blocks, then `BlockStored` for the new ones, in vLLM 0.33's map-tagged encoding.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use crate::generate::{Fnv, mix};
use crate::kv::lock;
use crate::stats::Counters;

/// One KV-cache event, as vLLM 0.33's msgspec structs carry it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Event {
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u64,
    },
    BlockRemoved {
        block_hashes: Vec<u64>,
    },
    AllBlocksCleared,
}

/// The medium of every block of the simulator: device memory.
const GPU: &str = "GPU";

/// Encodes a batch exactly as vLLM 0.33's `msgspec.msgpack.Encoder` encodes its
/// `KVEventBatch` (`array_like=True`): `[ts, events, data_parallel_rank]`, each event a
/// map (`tag=True`, `omit_defaults=True`) with `"type"` first, then the fields in
/// declaration order, those left at their default (`None`) omitted, `group_idx` 0 (the
/// cache group) kept. msgspec writes a struct's map header with the width its declared
/// field count needs, so `BlockStored` (15 fields and the tag) gets a 16-bit header even
/// for its 9 entries, and the others a one-byte one; integers and strings take their
/// shortest form.
pub(crate) fn encode_batch(ts: f64, events: &[Event], dp_rank: u32) -> Vec<u8> {
    let mut w = Msgpack(Vec::with_capacity(64));
    w.array(3);
    w.0.push(0xcb);
    w.0.extend_from_slice(&ts.to_bits().to_be_bytes());
    w.array(events.len());
    for event in events {
        match event {
            Event::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
            } => {
                w.map16(9);
                w.str("type");
                w.str("BlockStored");
                w.str("block_hashes");
                w.uints(block_hashes.iter().copied());
                w.str("parent_block_hash");
                match parent_block_hash {
                    Some(h) => w.uint(*h),
                    None => w.nil(),
                }
                w.str("token_ids");
                w.uints(token_ids.iter().map(|&t| u64::from(t)));
                w.str("block_size");
                w.uint(*block_size);
                w.str("lora_id");
                w.nil();
                w.str("medium");
                w.str(GPU);
                w.str("lora_name");
                w.nil();
                w.str("group_idx");
                w.uint(0);
            }
            Event::BlockRemoved { block_hashes } => {
                w.map(4);
                w.str("type");
                w.str("BlockRemoved");
                w.str("block_hashes");
                w.uints(block_hashes.iter().copied());
                w.str("medium");
                w.str(GPU);
                w.str("group_idx");
                w.uint(0);
            }
            Event::AllBlocksCleared => {
                w.map(1);
                w.str("type");
                w.str("AllBlocksCleared");
            }
        }
    }
    w.uint(u64::from(dp_rank));
    w.0
}

/// A minimal msgpack writer for the shapes above (the simulator's own, independent of
/// the decoders it is tested against).
pub(crate) struct Msgpack(pub(crate) Vec<u8>);

impl Msgpack {
    pub(crate) fn array(&mut self, n: usize) {
        match u16::try_from(n) {
            Ok(n) if n < 16 => self.0.push(0x90 | n as u8),
            Ok(n) => {
                self.0.push(0xdc);
                self.0.extend_from_slice(&n.to_be_bytes());
            }
            Err(_) => {
                self.0.push(0xdd);
                self.0
                    .extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_be_bytes());
            }
        }
    }

    fn map(&mut self, n: u8) {
        self.0.push(0x80 | (n & 0x0f));
    }

    fn map16(&mut self, n: u16) {
        self.0.push(0xde);
        self.0.extend_from_slice(&n.to_be_bytes());
    }

    pub(crate) fn str(&mut self, s: &str) {
        let len = s.len();
        if len < 32 {
            self.0.push(0xa0 | len as u8);
        } else if let Ok(len) = u8::try_from(len) {
            self.0.push(0xd9);
            self.0.push(len);
        } else {
            self.0.push(0xda);
            self.0
                .extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_be_bytes());
        }
        self.0.extend_from_slice(s.as_bytes());
    }

    pub(crate) fn uint(&mut self, v: u64) {
        if v < 128 {
            self.0.push(v as u8);
        } else if let Ok(v) = u8::try_from(v) {
            self.0.extend_from_slice(&[0xcc, v]);
        } else if let Ok(v) = u16::try_from(v) {
            self.0.push(0xcd);
            self.0.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = u32::try_from(v) {
            self.0.push(0xce);
            self.0.extend_from_slice(&v.to_be_bytes());
        } else {
            self.0.push(0xcf);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn uints(&mut self, values: impl ExactSizeIterator<Item = u64>) {
        self.array(values.len());
        for v in values {
            self.uint(v);
        }
    }

    pub(crate) fn nil(&mut self) {
        self.0.push(0xc0);
    }
}

/// The prefix caches of an engine's ranks.
#[derive(Debug)]
pub(crate) struct PrefixCache {
    ranks: Vec<Mutex<RankCache>>,
    /// Blocks per rank.
    capacity: usize,
    block_size: usize,
    seed: u64,
}

#[derive(Debug, Default)]
struct RankCache {
    /// Block hash → its last use.
    blocks: HashMap<u64, u64>,
    /// Last use → block hash, oldest first.
    lru: BTreeMap<u64, u64>,
    clock: u64,
}

impl RankCache {
    fn touch(&mut self, hash: u64) {
        self.clock += 1;
        if let Some(old) = self.blocks.insert(hash, self.clock) {
            self.lru.remove(&old);
        }
        self.lru.insert(self.clock, hash);
    }
}

impl PrefixCache {
    /// `capacity` blocks per rank, for `dp_size` ranks.
    pub(crate) fn new(model: &str, block_size: usize, capacity: usize, dp_size: usize) -> Self {
        PrefixCache {
            capacity: capacity.max(1),
            ranks: (0..dp_size.max(1))
                .map(|_| Mutex::new(RankCache::default()))
                .collect(),
            block_size: block_size.max(1),
            seed: Fnv::new().token(model).finish(),
        }
    }

    /// The engine's hashes of the full blocks of `tokens`.
    fn hashes(&self, tokens: &[u32]) -> Vec<u64> {
        let mut parent = self.seed;
        tokens
            .chunks_exact(self.block_size)
            .map(|block| {
                let mut h = Fnv::new().u64(parent);
                for &t in block {
                    h = h.u64(u64::from(t));
                }
                parent = mix(h.finish());
                parent
            })
            .collect()
    }

    /// Leading full blocks of `tokens` cached on `rank` (at most all but the last
    /// token's), without touching anything: what the engine would hit now.
    pub(crate) fn peek(&self, rank: usize, tokens: &[u32]) -> usize {
        let Some(cache) = self.ranks.get(rank) else {
            return 0;
        };
        let cache = lock(cache);
        let limit = tokens.len().saturating_sub(1) / self.block_size;
        self.hashes(tokens)
            .iter()
            .take(limit)
            .take_while(|h| cache.blocks.contains_key(h))
            .count()
            * self.block_size
    }

    /// A prefill's lookup: the leading tokens it hits, those blocks touched.
    pub(crate) fn lookup(&self, rank: usize, tokens: &[u32], counters: &Counters) -> usize {
        let Some(cache) = self.ranks.get(rank) else {
            return 0;
        };
        let mut cache = lock(cache);
        let limit = tokens.len().saturating_sub(1) / self.block_size;
        let hashes = self.hashes(tokens);
        let hits = hashes
            .iter()
            .take(limit)
            .take_while(|h| cache.blocks.contains_key(h))
            .count();
        for &h in hashes[..hits].iter().rev() {
            cache.touch(h);
        }
        counters.add_prefix_lookup(tokens.len(), hits * self.block_size);
        hits * self.block_size
    }

    /// Caches the full blocks of `tokens` on `rank` (computed, or received from a
    /// prefill), evicting the least recently used beyond the capacity; returns the
    /// events of the change.
    pub(crate) fn store(&self, rank: usize, tokens: &[u32], counters: &Counters) -> Vec<Event> {
        let capacity = self.capacity;
        let Some(cache) = self.ranks.get(rank) else {
            return Vec::new();
        };
        let mut cache = lock(cache);
        let before = cache.blocks.len();
        // A prompt longer than the cache keeps its first blocks.
        let hashes = self.hashes(tokens);
        let hashes = &hashes[..hashes.len().min(capacity)];
        let known = hashes
            .iter()
            .take_while(|h| cache.blocks.contains_key(h))
            .count();
        let new = &hashes[known..];
        // The chain's blocks, tail first, so its first blocks are the most recent.
        for &h in hashes.iter().rev() {
            cache.touch(h);
        }
        let mut evicted = Vec::new();
        while cache.blocks.len() > capacity {
            let Some((_, oldest)) = cache.lru.pop_first() else {
                break;
            };
            cache.blocks.remove(&oldest);
            evicted.push(oldest);
        }
        counters.prefix_blocks_changed(before, cache.blocks.len(), evicted.len());
        let mut events = Vec::new();
        if !evicted.is_empty() {
            events.push(Event::BlockRemoved {
                block_hashes: evicted,
            });
        }
        if !new.is_empty() {
            let bs = self.block_size;
            events.push(Event::BlockStored {
                block_hashes: new.to_vec(),
                parent_block_hash: known.checked_sub(1).map(|p| hashes[p]),
                token_ids: tokens[known * bs..(known + new.len()) * bs].to_vec(),
                block_size: bs as u64,
            });
        }
        events
    }

    /// Empties every rank's cache (vLLM's `reset_prefix_cache`): one
    /// `AllBlocksCleared` per rank that held anything.
    pub(crate) fn clear(&self, counters: &Counters) -> Vec<(usize, Vec<Event>)> {
        let mut out = Vec::new();
        for (rank, cache) in self.ranks.iter().enumerate() {
            let mut cache = lock(cache);
            counters.prefix_blocks_changed(cache.blocks.len(), 0, 0);
            cache.blocks.clear();
            cache.lru.clear();
            out.push((rank, vec![Event::AllBlocksCleared]));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(capacity: usize) -> (PrefixCache, Counters) {
        (
            PrefixCache::new("m", 4, capacity, 1),
            Counters::with_dp_size(1),
        )
    }

    #[test]
    fn hits_stop_short_of_the_last_token_and_events_chain() {
        let (c, counters) = cache(100);
        let p: Vec<u32> = (0..12).collect();
        assert_eq!(c.lookup(0, &p, &counters), 0);
        let events = c.store(0, &p, &counters);
        let hashes = c.hashes(&p);
        assert_eq!(
            events,
            vec![Event::BlockStored {
                block_hashes: hashes.clone(),
                parent_block_hash: None,
                token_ids: p.clone(),
                block_size: 4,
            }]
        );
        // 12 tokens: the last is computed again, so 2 blocks hit.
        assert_eq!(c.lookup(0, &p, &counters), 8);
        let longer: Vec<u32> = (0..17).collect();
        assert_eq!(c.peek(0, &longer), 12);
        let events = c.store(0, &longer, &counters);
        let KvEventsStored { parent, tokens } = stored(&events);
        assert_eq!(parent, Some(hashes[2]));
        assert_eq!(tokens, (12..16).collect::<Vec<u32>>());
        assert_eq!(counters.snapshot().prefix_cache_hit_tokens, 8);
    }

    struct KvEventsStored {
        parent: Option<u64>,
        tokens: Vec<u32>,
    }

    fn stored(events: &[Event]) -> KvEventsStored {
        for e in events {
            if let Event::BlockStored {
                parent_block_hash,
                token_ids,
                ..
            } = e
            {
                return KvEventsStored {
                    parent: *parent_block_hash,
                    tokens: token_ids.clone(),
                };
            }
        }
        panic!("no BlockStored in {events:?}");
    }

    #[test]
    fn eviction_takes_the_least_recent_chain_tail_first() {
        let (c, counters) = cache(4);
        let a: Vec<u32> = (0..12).collect(); // 3 blocks
        let b: Vec<u32> = (100..108).collect(); // 2 blocks
        c.store(0, &a, &counters);
        let events = c.store(0, &b, &counters);
        let a_hashes = c.hashes(&a);
        // One block over: a's tail goes.
        assert_eq!(
            events[0],
            Event::BlockRemoved {
                block_hashes: vec![a_hashes[2]],
            }
        );
        assert_eq!(c.peek(0, &a), 8);
        assert_eq!(counters.snapshot().prefix_cache_evictions, 1);
        assert_eq!(counters.snapshot().prefix_cache_blocks, 4);
    }

    #[test]
    fn the_encoding_is_vllm_s_own() {
        // The batch of `VLLM_BYTES`, in the order the simulator emits events.
        let events = vec![
            Event::BlockRemoved {
                block_hashes: vec![0xF000_0000_0000_0001],
            },
            Event::BlockStored {
                block_hashes: vec![5, 6],
                parent_block_hash: Some(4),
                token_ids: (1..=8).collect(),
                block_size: 4,
            },
            Event::AllBlocksCleared,
        ];
        let ours = encode_batch(1_700_000_005.5, &events, 3);
        assert_eq!(ours, VLLM_BYTES);
    }

    /// `KVEventBatch(ts=1700000005.5, events=[BlockRemoved(block_hashes=[0xF000000000000001],
    /// medium="GPU", group_idx=0), BlockStored(block_hashes=[5, 6], parent_block_hash=4,
    /// token_ids=[1..=8], block_size=4, lora_id=None, medium="GPU", lora_name=None,
    /// group_idx=0), AllBlocksCleared()], data_parallel_rank=3)`, encoded by vLLM
    /// 0.33.0's classes with `msgspec.msgpack.Encoder`.
    #[rustfmt::skip]
    const VLLM_BYTES: &[u8] = &[
        0x93, 0xcb, 0x41, 0xd9, 0x54, 0xfc, 0x41, 0x60, 0x00, 0x00, 0x93, 0x84, 0xa4, 0x74,
        0x79, 0x70, 0x65, 0xac, 0x42, 0x6c, 0x6f, 0x63, 0x6b, 0x52, 0x65, 0x6d, 0x6f, 0x76,
        0x65, 0x64, 0xac, 0x62, 0x6c, 0x6f, 0x63, 0x6b, 0x5f, 0x68, 0x61, 0x73, 0x68, 0x65,
        0x73, 0x91, 0xcf, 0xf0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0xa6, 0x6d, 0x65,
        0x64, 0x69, 0x75, 0x6d, 0xa3, 0x47, 0x50, 0x55, 0xa9, 0x67, 0x72, 0x6f, 0x75, 0x70,
        0x5f, 0x69, 0x64, 0x78, 0x00, 0xde, 0x00, 0x09, 0xa4, 0x74, 0x79, 0x70, 0x65, 0xab,
        0x42, 0x6c, 0x6f, 0x63, 0x6b, 0x53, 0x74, 0x6f, 0x72, 0x65, 0x64, 0xac, 0x62, 0x6c,
        0x6f, 0x63, 0x6b, 0x5f, 0x68, 0x61, 0x73, 0x68, 0x65, 0x73, 0x92, 0x05, 0x06, 0xb1,
        0x70, 0x61, 0x72, 0x65, 0x6e, 0x74, 0x5f, 0x62, 0x6c, 0x6f, 0x63, 0x6b, 0x5f, 0x68,
        0x61, 0x73, 0x68, 0x04, 0xa9, 0x74, 0x6f, 0x6b, 0x65, 0x6e, 0x5f, 0x69, 0x64, 0x73,
        0x98, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0xaa, 0x62, 0x6c, 0x6f, 0x63,
        0x6b, 0x5f, 0x73, 0x69, 0x7a, 0x65, 0x04, 0xa7, 0x6c, 0x6f, 0x72, 0x61, 0x5f, 0x69,
        0x64, 0xc0, 0xa6, 0x6d, 0x65, 0x64, 0x69, 0x75, 0x6d, 0xa3, 0x47, 0x50, 0x55, 0xa9,
        0x6c, 0x6f, 0x72, 0x61, 0x5f, 0x6e, 0x61, 0x6d, 0x65, 0xc0, 0xa9, 0x67, 0x72, 0x6f,
        0x75, 0x70, 0x5f, 0x69, 0x64, 0x78, 0x00, 0x81, 0xa4, 0x74, 0x79, 0x70, 0x65, 0xb0,
        0x41, 0x6c, 0x6c, 0x42, 0x6c, 0x6f, 0x63, 0x6b, 0x73, 0x43, 0x6c, 0x65, 0x61, 0x72,
        0x65, 0x64, 0x03,
    ];
}
