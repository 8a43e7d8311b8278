//! Chained prefix keys: one `u64` per block of tokens that names the whole prefix up to
//! the end of that block.
//!
//! The key of block `i` is XXH3-64 of the block's token ids, each as 4 little-endian
//! bytes, seeded with the key of block `i - 1` ([`ROOT_KEY`] before the first block).
//! Equal keys at block `i` mean equal first `(i + 1) * block_size` tokens, up to a 64-bit
//! collision.
//!
//! Why our own key and not the engine's block hash: the engine's hash depends on its
//! version and settings (vLLM's SHA-256 or its builtin hash, `PYTHONHASHSEED`, the
//! `--prefix-caching-hash-algo`; SGLang's own), and a router must compute the key of a
//! *request* it has not sent anywhere yet, from its token ids alone. A key recomputed
//! from the `token_ids` each `BlockStored` event carries is the same for every engine
//! and every proxy replica, so replicas agree without sharing state.
//!
//! Why XXH3-64: it is among the fastest well-distributed non-cryptographic hashes on
//! short inputs (a 16-token block is 64 bytes, where XXH3's fixed-size path needs no
//! loop), it takes a 64-bit seed (the chaining costs nothing extra), and its output is
//! specified and stable across platforms and versions (the XXH3 specification), which
//! replicas built at different times need. A cryptographic hash would cost ten times
//! more for a guarantee the router does not need: a collision only misroutes one
//! request to an engine that then computes the prompt itself.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The seed of the first block's key (the ASCII bytes of `"disagKV1"`): a fixed
/// constant, so that every replica and every version computes the same keys.
pub const ROOT_KEY: u64 = 0x6469_7361_674b_5631;

/// The key of one block: its tokens hashed, seeded with the key of the block before.
///
/// # Examples
///
/// ```
/// use disagg_kvevents::key::{ROOT_KEY, block_key};
///
/// let first = block_key(ROOT_KEY, &[1, 2, 3, 4]);
/// let second = block_key(first, &[5, 6, 7, 8]);
/// // The same tokens after another prefix make another key.
/// assert_ne!(second, block_key(block_key(ROOT_KEY, &[9, 2, 3, 4]), &[5, 6, 7, 8]));
/// ```
pub fn block_key(parent: u64, tokens: &[u32]) -> u64 {
    // The bytes are copied on the stack (a buffer of exactly 16 tokens for the common
    // block size, up to 64 otherwise); larger blocks (rare block sizes) go through a
    // heap buffer. The copy costs less than the hash.
    const COMMON: usize = 16;
    const STACK_TOKENS: usize = 64;
    if tokens.len() == COMMON {
        let mut buf = [0u8; COMMON * 4];
        for (chunk, t) in buf.chunks_exact_mut(4).zip(tokens) {
            chunk.copy_from_slice(&t.to_le_bytes());
        }
        xxh3_64_with_seed(&buf, parent)
    } else if tokens.len() <= STACK_TOKENS {
        let mut buf = [0u8; STACK_TOKENS * 4];
        for (chunk, t) in buf.chunks_exact_mut(4).zip(tokens) {
            chunk.copy_from_slice(&t.to_le_bytes());
        }
        xxh3_64_with_seed(&buf[..tokens.len() * 4], parent)
    } else {
        let buf: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64_with_seed(&buf, parent)
    }
}

/// Iterates over the chained keys of the full blocks of `tokens` (a last, partial block
/// has no key: engines cache full blocks only).
///
/// Lazy: a caller that stops early (at the first block nobody holds) hashes no further.
#[derive(Debug, Clone)]
pub struct KeyIter<'a> {
    blocks: std::slice::ChunksExact<'a, u32>,
    parent: u64,
}

impl<'a> KeyIter<'a> {
    /// The keys of `tokens` cut in blocks of `block_size` tokens (at least 1), starting
    /// from [`ROOT_KEY`].
    pub fn new(tokens: &'a [u32], block_size: usize) -> Self {
        Self::after(ROOT_KEY, tokens, block_size)
    }

    /// The keys of `tokens` continuing a prefix whose last block key is `parent`.
    pub fn after(parent: u64, tokens: &'a [u32], block_size: usize) -> Self {
        KeyIter {
            blocks: tokens.chunks_exact(block_size.max(1)),
            parent,
        }
    }
}

impl Iterator for KeyIter<'_> {
    type Item = u64;

    fn next(&mut self) -> Option<u64> {
        let block = self.blocks.next()?;
        self.parent = block_key(self.parent, block);
        Some(self.parent)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.blocks.size_hint()
    }
}

impl ExactSizeIterator for KeyIter<'_> {}

/// The keys of a request's full blocks at one block size, computed once and reused
/// (by the scorer for the index and its provisional entries).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockKeys {
    block_size: usize,
    keys: Vec<u64>,
}

impl BlockKeys {
    /// The keys of every full block of `tokens` (`block_size` at least 1).
    pub fn new(tokens: &[u32], block_size: usize) -> Self {
        let block_size = block_size.max(1);
        BlockKeys {
            block_size,
            keys: KeyIter::new(tokens, block_size).collect(),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The keys, block by block.
    pub fn keys(&self) -> &[u64] {
        &self.keys
    }

    /// The number of full blocks.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether the tokens do not fill one block.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// Hashes the maps' keys. They are already well-mixed 64-bit hashes, but a client
/// chooses its prompt and so could choose keys that share their low bits (the bucket
/// index) and lengthen one probe sequence; mixing with a per-index random seed (which
/// does not change the keys themselves, so replicas still agree) prevents that for one
/// multiply-xorshift finalizer.
#[derive(Debug, Clone)]
pub(crate) struct KeyMix {
    seed: u64,
}

impl KeyMix {
    pub(crate) fn new() -> Self {
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

#[derive(Debug)]
pub(crate) struct MixHasher(u64);

impl Hasher for MixHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0 = xxhash_rust::xxh3::xxh3_64_with_seed(bytes, self.0);
    }

    fn write_u64(&mut self, x: u64) {
        // MurmurHash3's 64-bit finalizer.
        let mut z = self.0 ^ x;
        z = (z ^ (z >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
        z = (z ^ (z >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        self.0 = z ^ (z >> 33);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_chain_and_skip_the_partial_block() {
        let tokens: Vec<u32> = (0..40).collect();
        let keys = BlockKeys::new(&tokens, 16);
        assert_eq!(keys.len(), 2);
        let k0 = block_key(ROOT_KEY, &tokens[..16]);
        assert_eq!(keys.keys(), &[k0, block_key(k0, &tokens[16..32])]);
        // Same prefix, same leading keys; a change in block 0 changes every key after.
        let mut other = tokens;
        other[20] = 999;
        assert_eq!(BlockKeys::new(&other, 16).keys()[0], k0);
        assert_ne!(BlockKeys::new(&other, 16).keys()[1], keys.keys()[1]);
        other[0] = 999;
        assert_ne!(BlockKeys::new(&other, 16).keys()[0], k0);
    }

    #[test]
    fn large_blocks_hash_like_small_ones_would() {
        // The heap path and the stack path hash the same bytes.
        let tokens: Vec<u32> = (0..100).collect();
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(
            block_key(ROOT_KEY, &tokens),
            xxh3_64_with_seed(&bytes, ROOT_KEY)
        );
        assert_eq!(
            block_key(ROOT_KEY, &tokens[..64]),
            xxh3_64_with_seed(&bytes[..256], ROOT_KEY)
        );
        assert_eq!(
            block_key(ROOT_KEY, &tokens[..16]),
            xxh3_64_with_seed(&bytes[..64], ROOT_KEY)
        );
        assert_eq!(
            block_key(ROOT_KEY, &tokens[..15]),
            xxh3_64_with_seed(&bytes[..60], ROOT_KEY)
        );
    }

    #[test]
    fn keys_are_stable_across_builds() {
        // Replicas built at different times must agree: pin one value.
        assert_eq!(block_key(ROOT_KEY, &[1, 2, 3, 4]), PINNED);
    }

    /// XXH3-64 of the bytes 01 00 00 00 02 00 00 00 03 00 00 00 04 00 00 00 with seed
    /// `ROOT_KEY`, computed with the reference C implementation (Python `xxhash` 3).
    const PINNED: u64 = 0xc827_ef36_e379_8a41;
}
