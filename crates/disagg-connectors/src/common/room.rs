//! [`Rooms`]: handoff ids (SGLang `bootstrap_room`, vLLM Mooncake `transfer_id`) that
//! never repeat within a process and cannot be predicted from the ones seen, with no
//! per-request state.
//!
//! SGLang's engines key a KV transfer by `bootstrap_room`, a non-negative 63-bit integer
//! (`random.randint(0, 2**63 - 1)` in `python/sglang/srt/disaggregation/mini_lb.py`;
//! `rand::random::<u64>() & (i64::MAX as u64)` in the Rust gateway's `pd_types.rs`). Two
//! requests in flight with the same room collide on the engines. Random draws make that
//! unlikely; a set of the rooms in flight would make it impossible but is per-request
//! state to keep in step with every way a request can end. Instead, a room here is a
//! *keyed bijection* of a counter: the counter goes through a permutation of the 63-bit
//! integers chosen by a secret key drawn once per generator, so distinct counter values
//! give distinct rooms for 2^63 draws. The permutation is a Feistel network: eight
//! rounds over a 31-bit and a 32-bit half (which swap sizes each round, so the network
//! maps 63 bits onto 63 bits with no cycle-walking), each round's function SipHash-1-3
//! under the key (std's [`RandomState`]). Every round is invertible whatever its
//! function, so the whole is a bijection; without the key, the ids seen (every engine
//! sees its requests' rooms) tell nothing of the next ones, as they did when the
//! permutation was a fixed function of the counter plus an offset (inverting it on one
//! room gave the counter, and so every later room).

use std::hash::{BuildHasher, DefaultHasher, Hasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};

/// The largest room: `2^63 - 1` (SGLang's rooms are non-negative `i64`s).
pub(crate) const MAX_ROOM: u64 = (1 << 63) - 1;

/// The Feistel network's rounds: even, so the halves end as they began (31 high bits,
/// 32 low bits).
const ROUNDS: u8 = 8;

/// Draws handoff ids that are unique within this generator and unpredictable without
/// its key, in `0..=2^63 - 1`.
///
/// A connector draws from its own, keyed at random; give it a seeded one for
/// deterministic tests (a seeded generator's ids are as predictable as its seed).
///
/// # Examples
///
/// ```
/// use disagg_connectors::common::Rooms;
/// use disagg_connectors::sglang::SglangBootstrap;
/// use disagg_connectors::vllm::VllmMooncake;
/// // The same seed draws the same rooms, run after run of one build.
/// let sglang = SglangBootstrap::with_rooms(Rooms::from_seed(1));
/// let mooncake = VllmMooncake::new().with_ids(Rooms::from_seed(2));
/// # let _ = (sglang, mooncake);
/// ```
#[derive(Debug)]
pub struct Rooms {
    key: Key,
    counter: AtomicU64,
}

/// What keys the round function.
#[derive(Debug)]
enum Key {
    /// SipHash-1-3 with keys drawn from the operating system's random source (never
    /// printed: `RandomState`'s `Debug` shows no keys).
    Random(RandomState),
    /// SipHash-1-3 with std's fixed keys, over the seed then the round's input: the
    /// same seed, the same rooms (within one build: std may change the hash between
    /// releases).
    Seeded(u64),
}

impl Default for Rooms {
    fn default() -> Self {
        Self::new()
    }
}

impl Rooms {
    /// A generator with a random key.
    pub(crate) fn new() -> Self {
        Rooms {
            key: Key::Random(RandomState::new()),
            counter: AtomicU64::new(0),
        }
    }

    /// A generator with a fixed key, for deterministic tests.
    pub fn from_seed(seed: u64) -> Self {
        Rooms {
            key: Key::Seeded(seed),
            counter: AtomicU64::new(0),
        }
    }

    /// The next room, in `0..=MAX_ROOM`.
    pub(crate) fn next_room(&self) -> u64 {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        self.permute(n)
    }

    /// Round `round`'s function of the half `half`: 64 bits, of which the round keeps
    /// as many as the other half has.
    fn round(&self, round: u8, half: u64) -> u64 {
        let mut h = match &self.key {
            Key::Random(state) => state.build_hasher(),
            Key::Seeded(seed) => {
                let mut h = DefaultHasher::new();
                h.write_u64(*seed);
                h
            }
        };
        h.write_u8(round);
        h.write_u64(half);
        h.finish()
    }

    /// The keyed bijection of `0..=MAX_ROOM` onto itself (the high bits of `x` are
    /// ignored). Each round maps `(l, r)` to `(r, l ^ F(r))`, `F`'s output cut to `l`'s
    /// width: the halves swap, and so do their widths.
    fn permute(&self, x: u64) -> u64 {
        let (mut l, mut r) = ((x & MAX_ROOM) >> 32, x & u64::from(u32::MAX));
        let (mut l_bits, mut r_bits) = (31, 32);
        for round in 0..ROUNDS {
            let f = self.round(round, r) & low_bits(l_bits);
            (l, r) = (r, l ^ f);
            (l_bits, r_bits) = (r_bits, l_bits);
        }
        (l << 32) | r
    }
}

/// A mask of the low `n` bits (`n` below 64).
fn low_bits(n: u32) -> u64 {
    (1u64 << n) - 1
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn rooms_are_distinct_and_in_range() {
        for rooms in [Rooms::from_seed(u64::MAX), Rooms::new()] {
            let mut seen = HashSet::new();
            for _ in 0..100_000 {
                let r = rooms.next_room();
                assert!(r <= MAX_ROOM);
                assert!(seen.insert(r), "room {r} repeated");
            }
        }
    }

    /// The inverse of [`Rooms::permute`]: that it exists (each round undone) is what
    /// makes the rooms a bijection of the counter.
    fn unpermute(rooms: &Rooms, y: u64) -> u64 {
        let (mut l, mut r) = (y >> 32, y & u64::from(u32::MAX));
        let (mut l_bits, mut r_bits) = (31, 32);
        for round in (0..ROUNDS).rev() {
            // Before the round: `(l', r')` with `r' = l`, `l = l' ^ F(r')` cut to the
            // width `l'` had, which `r` has now.
            let before_r = l;
            let before_l = r ^ (rooms.round(round, before_r) & low_bits(r_bits));
            (l, r) = (before_l, before_r);
            (l_bits, r_bits) = (r_bits, l_bits);
        }
        (l << 32) | r
    }

    #[test]
    fn the_permutation_is_a_bijection_of_63_bits() {
        for rooms in [Rooms::from_seed(3), Rooms::new()] {
            let edges = [0, 1, u64::from(u32::MAX), 1 << 32, MAX_ROOM - 1, MAX_ROOM];
            let spread = (0..10_000u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) & MAX_ROOM);
            for x in edges.into_iter().chain(spread) {
                let y = rooms.permute(x);
                assert!(y <= MAX_ROOM, "{x} -> {y}");
                assert_eq!(unpermute(&rooms, y), x);
            }
            // Injective on 2^16 consecutive values around the wrap-around point.
            let mut seen = HashSet::new();
            for i in 0..(1u64 << 16) {
                let x = MAX_ROOM.wrapping_sub(1 << 15).wrapping_add(i) & MAX_ROOM;
                assert!(seen.insert(rooms.permute(x)));
            }
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

    /// The unkeyed permutation rooms used to be (splitmix64's finalizer on 63 bits) of
    /// the counter plus a random offset.
    fn unkeyed(x: u64) -> u64 {
        let mut x = x & MAX_ROOM;
        x ^= x >> 31;
        x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9) & MAX_ROOM;
        x ^= x >> 29;
        x = x.wrapping_mul(0x94d0_49bb_1331_11eb) & MAX_ROOM;
        x ^= x >> 32;
        x
    }

    /// [`unkeyed`]'s inverse, as anyone reading the code could write it.
    fn unkeyed_inverse(y: u64) -> u64 {
        let unshift = |y: u64, k: u32| {
            let (mut x, mut s) = (y, k);
            while s < 63 {
                x ^= y >> s;
                s += k;
            }
            x
        };
        let inverse = |a: u64| {
            let mut inv = a;
            for _ in 0..6 {
                inv = inv.wrapping_mul(2u64.wrapping_sub(a.wrapping_mul(inv)));
            }
            inv
        };
        let mut x = unshift(y, 32);
        x = x.wrapping_mul(inverse(0x94d0_49bb_1331_11eb)) & MAX_ROOM;
        x = unshift(x, 29);
        x = x.wrapping_mul(inverse(0xbf58_476d_1ce4_e5b9)) & MAX_ROOM;
        unshift(x, 31)
    }

    /// One room seen (every engine sees its requests') does not give the next ones:
    /// inverting the unkeyed permutation on it, as predicted the next room when rooms
    /// were that permutation of a counter plus an offset, predicts none of them; and two
    /// generators give unrelated sequences, not one sequence shifted.
    #[test]
    fn a_room_seen_does_not_predict_the_next() {
        for x in [0, 1, 12_345, MAX_ROOM] {
            assert_eq!(unkeyed_inverse(unkeyed(x)), x);
        }
        let rooms = Rooms::new();
        let mut prev = rooms.next_room();
        let mut predicted = 0;
        for _ in 0..10_000 {
            let next = rooms.next_room();
            predicted += usize::from(unkeyed(unkeyed_inverse(prev).wrapping_add(1)) == next);
            prev = next;
        }
        assert_eq!(predicted, 0, "rooms predicted from the one before");

        let draws = |rooms: Rooms| {
            (0..10_000)
                .map(|_| rooms.next_room())
                .collect::<HashSet<_>>()
        };
        let (a, b) = (draws(Rooms::from_seed(1)), draws(Rooms::from_seed(2)));
        assert_eq!(a.intersection(&b).count(), 0, "seeds 1 and 2 share rooms");
        let (a, b) = (draws(Rooms::new()), draws(Rooms::new()));
        assert_eq!(a.intersection(&b).count(), 0, "two random keys share rooms");
    }
}
