//! [`Rooms`]: handoff ids (SGLang `bootstrap_room`, vLLM Mooncake `transfer_id`) that
//! never repeat within a process, with no per-request state.
//!
//! SGLang's engines key a KV transfer by `bootstrap_room`, a non-negative 63-bit integer
//! (`random.randint(0, 2**63 - 1)` in `python/sglang/srt/disaggregation/mini_lb.py`;
//! `rand::random::<u64>() & (i64::MAX as u64)` in the Rust gateway's `pd_types.rs`). Two
//! requests in flight with the same room collide on the engines. Random draws make that
//! unlikely; a set of the rooms in flight would make it impossible but is per-request
//! state to keep in step with every way a request can end. Instead, a room here is a
//! *bijection* of a counter: the counter (offset by a random key drawn once) goes
//! through an invertible mixing function on 63 bits, so distinct counter values give
//! distinct rooms for 2^63 draws, while rooms still look random (and differ between
//! processes, as SGLang's do).

use std::sync::atomic::{AtomicU64, Ordering};

/// The largest room: `2^63 - 1` (SGLang's rooms are non-negative `i64`s).
pub(crate) const MAX_ROOM: u64 = (1 << 63) - 1;

/// Draws handoff ids that are unique within this generator and look random, in
/// `0..=2^63 - 1`.
///
/// A connector draws from its own; give it a seeded one for deterministic tests.
///
/// # Examples
///
/// ```
/// use disagg_connectors::common::Rooms;
/// use disagg_connectors::sglang::SglangBootstrap;
/// use disagg_connectors::vllm::VllmMooncake;
/// // The same seed draws the same rooms, run after run.
/// let sglang = SglangBootstrap::with_rooms(Rooms::from_seed(1));
/// let mooncake = VllmMooncake::new().with_ids(Rooms::from_seed(2));
/// # let _ = (sglang, mooncake);
/// ```
#[derive(Debug)]
pub struct Rooms {
    key: u64,
    counter: AtomicU64,
}

impl Default for Rooms {
    fn default() -> Self {
        Self::new()
    }
}

impl Rooms {
    /// A generator with a random key.
    pub(crate) fn new() -> Self {
        Self::from_seed(uuid::Uuid::new_v4().as_u64_pair().0)
    }

    /// A generator with a fixed key, for deterministic tests.
    pub fn from_seed(seed: u64) -> Self {
        Rooms {
            key: seed & MAX_ROOM,
            counter: AtomicU64::new(0),
        }
    }

    /// The next room, in `0..=MAX_ROOM`.
    pub(crate) fn next_room(&self) -> u64 {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        permute63(n.wrapping_add(self.key))
    }
}

/// A bijection of `0..=MAX_ROOM` onto itself that scatters consecutive inputs.
///
/// Each step is invertible on 63-bit words: `x ^ (x >> k)` for `k >= 1`, and
/// multiplication by an odd constant modulo 2^63. (The constants are splitmix64's.)
fn permute63(x: u64) -> u64 {
    let mut x = x & MAX_ROOM;
    x ^= x >> 31;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9) & MAX_ROOM;
    x ^= x >> 29;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb) & MAX_ROOM;
    x ^= x >> 32;
    x
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn rooms_are_distinct_and_in_range() {
        let rooms = Rooms::from_seed(u64::MAX);
        let mut seen = HashSet::new();
        for _ in 0..200_000 {
            let r = rooms.next_room();
            assert!(r <= MAX_ROOM);
            assert!(seen.insert(r), "room {r} repeated");
        }
    }

    #[test]
    fn the_permutation_is_a_bijection_on_a_small_window() {
        // Injective on 2^16 consecutive values around the wrap-around point.
        let mut seen = HashSet::new();
        for i in 0..(1u64 << 16) {
            let x = MAX_ROOM.wrapping_sub(1 << 15).wrapping_add(i) & MAX_ROOM;
            assert!(seen.insert(permute63(x)));
        }
    }

    #[test]
    fn rooms_look_random() {
        // Consecutive rooms differ in about half of their 63 bits.
        let rooms = Rooms::from_seed(0);
        let mut prev = rooms.next_room();
        let mut total = 0u32;
        for _ in 0..1000 {
            let r = rooms.next_room();
            total += (r ^ prev).count_ones();
            prev = r;
        }
        let mean = f64::from(total) / 1000.0;
        assert!((25.0..38.0).contains(&mean), "mean flipped bits {mean}");
    }
}
