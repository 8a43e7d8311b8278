//! Weighted rendezvous (highest random weight) hashing.
//!
//! Every candidate endpoint gets a score from a stable hash of `(key, endpoint id)`;
//! the highest score wins. Because a key's score on one endpoint does not depend on the
//! others, adding an endpoint moves only the keys whose new top score is on it (about
//! `1/(N+1)` of them), and removing one moves only the keys that were on it. There is no
//! ring to build or rebalance, and the candidate order does not matter.
//!
//! Weights use the logarithmic method (Schindelhauer and Schomaker, "Weighted distributed
//! hash tables", 2005; the scheme Ceph's `straw2` uses): with `u` the hash mapped
//! uniformly into `(0, 1)`, the score is `-w / ln(u)`, so an endpoint of weight `w`
//! wins a share `w / Σw` of the keys and changing one weight moves keys only to or from
//! that endpoint.
//!
//! The hash is FNV-1a 64 followed by the splitmix64 finalizer. It is fixed here rather
//! than taken from `std` because `std`'s `DefaultHasher` is seeded per process: two
//! proxy replicas, or one proxy before and after a restart, would send a session to
//! different engines. The golden values in the tests pin it; changing it re-shuffles
//! every session, so it must never change silently.

use std::collections::HashMap;

use disagg_core::endpoint::EndpointId;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
    #[cfg(test)]
    HASHED_BYTES.with(|n| n.set(n.get() + bytes.len() as u64));
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// splitmix64's finalizer: FNV-1a alone mixes its last bytes poorly into the high bits,
/// and endpoint ids often differ only in their last characters (`...:8201`, `...:8202`).
pub(crate) fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The stable 64-bit hash of `(key, endpoint id)`.
///
/// The same on every platform, process and run. The key's length goes in first, so
/// `("ab", "c")` and `("a", "bc")` hash differently.
///
/// # Examples
///
/// ```
/// use disagg_affinity::hrw::hash;
/// assert_eq!(hash(b"session-1", "http://10.0.0.1:8200"), hash(b"session-1", "http://10.0.0.1:8200"));
/// assert_ne!(hash(b"ab", "c"), hash(b"a", "bc"));
/// ```
pub fn hash(key: &[u8], id: &str) -> u64 {
    KeyHash::new(key).with_id(id)
}

/// A key hashed once, to score it on many endpoints: [`hash`] is FNV-1a over the key's
/// length, the key and the id, in that order, and FNV-1a is streaming, so the state
/// after the key serves every id. Scoring a key on `N` endpoints then costs the key's
/// length once plus the ids' lengths, not `N` times the key's length (the key comes
/// from the client: a header or a body field of any size).
///
/// # Examples
///
/// ```
/// use disagg_affinity::hrw::{KeyHash, hash};
/// let k = KeyHash::new(b"session-1");
/// assert_eq!(k.with_id("http://10.0.0.1:8200"), hash(b"session-1", "http://10.0.0.1:8200"));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyHash(u64);

impl KeyHash {
    /// Hashes `key` (its length, then its bytes).
    pub fn new(key: &[u8]) -> Self {
        let h = fnv1a(FNV_OFFSET, &(key.len() as u64).to_le_bytes());
        KeyHash(fnv1a(h, key))
    }

    /// [`hash`]`(key, id)`, hashing only `id`.
    pub fn with_id(self, id: &str) -> u64 {
        finalize(fnv1a(self.0, id.as_bytes()))
    }
}

#[cfg(test)]
thread_local! {
    /// Bytes run through FNV-1a on this thread, for tests that count hashing work.
    static HASHED_BYTES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Bytes run through FNV-1a on this thread so far.
#[cfg(test)]
pub(crate) fn hashed_bytes() -> u64 {
    HASHED_BYTES.with(std::cell::Cell::get)
}

/// A power of two that brings `max`, the largest weight among some candidates, into
/// `[1, 2)` (`[2, 4)` for weights of `2^1023` and above): multiply every candidate's
/// weight by it before summing or scoring.
///
/// Each weight is finite, but two near `f64::MAX` sum to infinity, and one above about
/// `1e292` gives an infinite rendezvous score (`-w / ln(u)` multiplies by up to
/// `1.8e16`): every pick would then go to one candidate. Scaled, weights are at most 4
/// and sums and scores stay finite. Multiplying by a power of two is exact (no rounding,
/// unless a weight falls below `2^-1022` of the largest), and so are the sums and
/// quotients of scaled weights, up to the same power: ordinary weights pick exactly as
/// unscaled.
pub(crate) fn weight_scale(max: f64) -> f64 {
    if !(max.is_finite() && max > 0.0) {
        return 1.0;
    }
    // The biased exponent of `max` (0 for a subnormal one), kept where the scale's own
    // exponent, 2046 minus it, is a normal float's.
    let biased = ((max.to_bits() >> 52) & 0x7ff).clamp(1, 2045);
    f64::from_bits((2046 - biased) << 52)
}

/// The weighted rendezvous score of a hash: `-weight / ln(u)`, `u` uniform in `(0, 1)`.
///
/// Larger is better. Positive for a positive weight; `0.0` for weight `0.0` (never wins
/// against a positive weight).
pub fn score(hash: u64, weight: f64) -> f64 {
    // The top 53 bits as a float in (0, 1): the +0.5 keeps u away from 0 (ln(0) = -inf)
    // and from 1 (ln(1) = 0, a division by zero).
    let u = ((hash >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    -weight / u.ln()
}

/// Why a weight was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum WeightError {
    /// Weights must be finite and positive; use removal, not weight 0, to drain an
    /// endpoint.
    #[error("weight {weight} of endpoint {id} is not finite and positive")]
    Invalid {
        /// The endpoint.
        id: EndpointId,
        /// The refused weight.
        weight: f64,
    },
}

/// Per-endpoint weights for rendezvous hashing; endpoints not listed weigh `1.0` by id
/// ([`weight`](Self::weight)), or their own weight when the policy has the endpoint
/// ([`weight_of`](Self::weight_of), what [`ConsistentHash`](crate::ConsistentHash)
/// reads).
///
/// # Examples
///
/// ```
/// use disagg_affinity::Weights;
/// // The bigger engine takes about twice the sessions of each other one.
/// let w = Weights::new().with_weight("http://10.0.0.9:8200", 2.0)?;
/// assert_eq!(w.weight("http://10.0.0.9:8200"), 2.0);
/// assert_eq!(w.weight("http://10.0.0.1:8200"), 1.0);
/// # Ok::<(), disagg_affinity::WeightError>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Weights {
    // Keyed by the id's text: `EndpointId` does not borrow as `str`.
    by_id: HashMap<Box<str>, f64>,
}

impl Weights {
    /// All endpoints weigh `1.0`.
    pub fn new() -> Self {
        Self::default()
    }

    /// `id` weighs `weight`.
    ///
    /// # Errors
    ///
    /// [`WeightError::Invalid`] when `weight` is not finite and positive.
    pub fn with_weight(
        mut self,
        id: impl Into<EndpointId>,
        weight: f64,
    ) -> Result<Self, WeightError> {
        let id = id.into();
        if !(weight.is_finite() && weight > 0.0) {
            return Err(WeightError::Invalid { id, weight });
        }
        self.by_id.insert(id.as_str().into(), weight);
        Ok(self)
    }

    /// The weight of the endpoint `id` (`1.0` unless set).
    pub fn weight(&self, id: &str) -> f64 {
        if self.by_id.is_empty() {
            return 1.0;
        }
        self.by_id.get(id).copied().unwrap_or(1.0)
    }

    /// The weight these weights give `endpoint`: set for its id, else for its engine's
    /// URL (a `URL@RANK` endpoint), else the endpoint's own
    /// [`Endpoint::weight`](disagg_core::Endpoint::weight).
    pub fn weight_of(&self, endpoint: &disagg_core::Endpoint) -> f64 {
        if self.by_id.is_empty() {
            return endpoint.weight();
        }
        crate::policy::policy_weight(&self.by_id, endpoint).unwrap_or_else(|| endpoint.weight())
    }

    /// Whether every endpoint weighs the same.
    pub fn is_uniform(&self) -> bool {
        self.by_id.is_empty()
    }

    /// The score of endpoint `id` for `key`, of its weight unscaled (infinite for weights
    /// above about `1e292`; [`best`] scales the candidates' weights first).
    pub fn score(&self, key: &[u8], id: &str) -> f64 {
        score(hash(key, id), self.weight(id))
    }
}

/// The index of the id with the highest score for `key` among `ids`; `None` when
/// `ids` is empty. Ties (vanishingly rare) go to the smaller id, so the result never
/// depends on the order of `ids`.
///
/// # Examples
///
/// ```
/// use disagg_affinity::hrw::best;
/// use disagg_affinity::Weights;
/// let ids = ["http://a:1", "http://b:1", "http://c:1"];
/// let i = best(b"user-7", &ids, &Weights::new()).unwrap_or(0);
/// let reversed = ["http://c:1", "http://b:1", "http://a:1"];
/// let j = best(b"user-7", &reversed, &Weights::new()).unwrap_or(0);
/// assert_eq!(ids[i], reversed[j]);
/// ```
pub fn best<S: AsRef<str>>(key: &[u8], ids: &[S], weights: &Weights) -> Option<usize> {
    let key = KeyHash::new(key);
    let scale = if weights.is_uniform() {
        1.0
    } else {
        weight_scale(
            ids.iter()
                .map(|id| weights.weight(id.as_ref()))
                .fold(0.0, f64::max),
        )
    };
    let mut top: Option<(f64, &str, usize)> = None;
    for (i, id) in ids.iter().enumerate() {
        let id = id.as_ref();
        let s = score(key.with_id(id), weights.weight(id) * scale);
        if top.is_none_or(|(ts, tid, _)| beats(s, id, ts, tid)) {
            top = Some((s, id, i));
        }
    }
    top.map(|(_, _, i)| i)
}

/// Whether `(score, id)` outranks `(top_score, top_id)`.
pub(crate) fn beats(score: f64, id: &str, top_score: f64, top_id: &str) -> bool {
    score > top_score || (score == top_score && id < top_id)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Pinned hash values: these must never change (see the module docs).
    #[test]
    fn golden_hashes() {
        let got = [
            hash(b"", ""),
            hash(b"session-1", "http://10.0.0.1:8200"),
            hash(b"session-1", "http://10.0.0.2:8200"),
            hash(b"alice", "http://decode-0:8000"),
        ];
        assert_eq!(got, GOLDEN_HASHES, "{got:#x?}");
    }

    // Cross-checked against an independent Python implementation of the same spec
    // (FNV-1a 64 over the key length as 8 little-endian bytes, the key and the id, then
    // the splitmix64 finalizer).
    const GOLDEN_HASHES: [u64; 4] = [
        0x813f_0174_a236_7c13,
        0x52a1_2024_dc2c_8352,
        0x50ff_e41b_5210_db9c,
        0x2f7d_3585_6cc2_a7db,
    ];

    #[test]
    fn golden_picks() {
        let ids: Vec<String> = (0..8).map(|i| format!("http://10.0.0.{i}:8200")).collect();
        let w = Weights::new();
        let got: Vec<usize> = ["session-1", "session-2", "alice", "bob", "", "42"]
            .iter()
            .map(|k| best(k.as_bytes(), &ids, &w).unwrap_or(usize::MAX))
            .collect();
        assert_eq!(got, GOLDEN_PICKS, "{got:?}");
    }

    const GOLDEN_PICKS: [usize; 6] = [3, 6, 0, 5, 7, 1];

    /// The spec, in one pass over the concatenated bytes.
    fn reference(key: &[u8], id: &str) -> u64 {
        let mut bytes = (key.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(key);
        bytes.extend_from_slice(id.as_bytes());
        let mut h = FNV_OFFSET;
        for b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(FNV_PRIME);
        }
        finalize(h)
    }

    #[test]
    fn best_hashes_the_key_once() {
        // A client-chosen key of 1 MiB on 64 endpoints: the key's bytes once, then each
        // id's (before: 64 MiB).
        let key = vec![b'k'; 1 << 20];
        let ids: Vec<String> = (0..64).map(|i| format!("http://10.0.0.{i}:8200")).collect();
        let w = Weights::new().with_weight(&*ids[3], 2.0).expect("valid");
        let before = hashed_bytes();
        let i = best(&key, &ids, &w);
        let hashed = hashed_bytes() - before;
        let ids_len: usize = ids.iter().map(String::len).sum();
        assert!(
            hashed <= (8 + key.len() + ids_len) as u64,
            "{hashed} bytes hashed"
        );
        // And the pick is the one the one-shot hash makes.
        let by_reference = ids
            .iter()
            .enumerate()
            .map(|(j, id)| (score(reference(&key, id), w.weight(id)), j))
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, j)| j);
        assert_eq!(i, by_reference);
    }

    #[test]
    fn weights_near_f64_max_keep_their_shares() {
        // Unscaled, `-w / ln(u)` is infinite for most keys at these weights and the
        // tie goes to the smallest id.
        let ids = ["http://a:1", "http://b:1", "http://c:1"];
        let w = Weights::new()
            .with_weight("http://a:1", f64::MAX / 2.0)
            .and_then(|w| w.with_weight("http://b:1", f64::MAX / 2.0))
            .and_then(|w| w.with_weight("http://c:1", f64::MAX))
            .expect("valid weights");
        let mut counts = [0usize; 3];
        let n = 40_000;
        for k in 0..n {
            counts[best(format!("k{k}").as_bytes(), &ids, &w).unwrap_or(0)] += 1;
        }
        let share = |i: usize| counts[i] as f64 / n as f64;
        assert!((share(0) - 0.25).abs() < 0.02, "{counts:?}");
        assert!((share(1) - 0.25).abs() < 0.02, "{counts:?}");
        assert!((share(2) - 0.5).abs() < 0.02, "{counts:?}");
    }

    #[test]
    fn weights_scaled_by_a_power_of_two_pick_the_same() {
        // Scaling is exact: 1, 2, 3 and the same times 2^1020 (up to 3.4e307, whose
        // scores overflowed for about one key in six) pick the same endpoint for every
        // key.
        let ids = ["http://a:1", "http://b:1", "http://c:1"];
        let weights = |f: f64| {
            Weights::new()
                .with_weight("http://a:1", f)
                .and_then(|w| w.with_weight("http://b:1", 2.0 * f))
                .and_then(|w| w.with_weight("http://c:1", 3.0 * f))
                .expect("valid weights")
        };
        let (small, huge) = (weights(1.0), weights(2f64.powi(1020)));
        for k in 0..5_000 {
            let key = format!("session-{k}");
            assert_eq!(
                best(key.as_bytes(), &ids, &small),
                best(key.as_bytes(), &ids, &huge),
                "{key}"
            );
        }
    }

    #[test]
    fn weight_scale_is_a_power_of_two_into_one_to_four() {
        for max in [
            f64::MIN_POSITIVE / 8.0,
            f64::MIN_POSITIVE,
            1e-300,
            0.3,
            1.0,
            1.5,
            4.0,
            7.0,
            1e292,
            2f64.powi(1023),
            f64::MAX,
        ] {
            let s = weight_scale(max);
            assert_eq!(s.to_bits() & ((1 << 52) - 1), 0, "{max}: {s}");
            let scaled = max * s;
            assert!(scaled < 4.0 && scaled > 0.0, "{max}: {scaled}");
            if max >= f64::MIN_POSITIVE && max < 2f64.powi(1023) {
                assert!((1.0..2.0).contains(&scaled), "{max}: {scaled}");
            }
        }
        assert_eq!(weight_scale(1.0), 1.0);
        assert_eq!(weight_scale(1.9), 1.0);
        assert_eq!(weight_scale(0.0), 1.0);
    }

    #[test]
    fn weights_are_validated() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(
                Weights::new().with_weight("http://a:1", bad).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn weights_follow_shares() {
        let ids = ["http://a:1", "http://b:1", "http://c:1"];
        let w = Weights::new()
            .with_weight("http://c:1", 2.0)
            .expect("valid weight");
        let mut counts = [0usize; 3];
        let n = 40_000;
        for k in 0..n {
            let key = format!("k{k}");
            counts[best(key.as_bytes(), &ids, &w).unwrap_or(0)] += 1;
        }
        // Expected shares 1/4, 1/4, 1/2; 2% absolute tolerance over 40k keys (σ ≈ 0.25%).
        let share = |i: usize| counts[i] as f64 / n as f64;
        assert!((share(0) - 0.25).abs() < 0.02, "{counts:?}");
        assert!((share(1) - 0.25).abs() < 0.02, "{counts:?}");
        assert!((share(2) - 0.5).abs() < 0.02, "{counts:?}");
    }

    #[test]
    fn adding_one_of_n_moves_about_one_in_n_plus_one() {
        let keys: Vec<String> = (0..20_000).map(|k| format!("session-{k}")).collect();
        let w = Weights::new();
        for n in [2usize, 3, 8, 16] {
            let mut ids: Vec<String> = (0..n).map(|i| format!("http://e{i}:8000")).collect();
            let before: Vec<String> = keys
                .iter()
                .map(|k| ids[best(k.as_bytes(), &ids, &w).unwrap_or(0)].clone())
                .collect();
            ids.push(format!("http://e{n}:8000"));
            let moved = keys
                .iter()
                .zip(&before)
                .filter(|(k, b)| ids[best(k.as_bytes(), &ids, &w).unwrap_or(0)] != **b)
                .count();
            let expected = keys.len() as f64 / (n + 1) as f64;
            // Within 15% of the ideal 1/(N+1) share.
            assert!(
                (moved as f64) < expected * 1.15,
                "n={n}: moved {moved}, expected about {expected}"
            );
        }
    }

    fn ids_strategy() -> impl Strategy<Value = Vec<String>> {
        proptest::collection::btree_set("[a-z0-9]{1,8}", 1..12)
            .prop_map(|s| s.into_iter().map(|h| format!("http://{h}:8000")).collect())
    }

    proptest! {
        /// The key hashed once then continued per id is the one-shot hash.
        #[test]
        fn key_hash_continues_the_one_shot_hash(key in any::<Vec<u8>>(), ids in ids_strategy()) {
            let k = KeyHash::new(&key);
            for id in &ids {
                prop_assert_eq!(k.with_id(id), reference(&key, id));
                prop_assert_eq!(hash(&key, id), reference(&key, id));
            }
        }

        /// The same key, ids and weights always pick the same id, in any order.
        #[test]
        fn stable_and_order_independent(key in any::<Vec<u8>>(), ids in ids_strategy()) {
            let w = Weights::new();
            let i = best(&key, &ids, &w);
            prop_assert_eq!(i, best(&key, &ids, &w));
            let mut rev = ids.clone();
            rev.reverse();
            let j = best(&key, &rev, &w);
            prop_assert_eq!(i.map(|i| &ids[i]), j.map(|j| &rev[j]));
        }

        /// Adding an endpoint moves a key only onto the new endpoint.
        #[test]
        fn adding_moves_only_to_the_new_one(
            keys in proptest::collection::vec(any::<Vec<u8>>(), 1..64),
            ids in ids_strategy(),
            extra in "[A-Z]{1,8}",
        ) {
            let w = Weights::new();
            let new_id = format!("http://{extra}:8000");
            let mut more = ids.clone();
            more.push(new_id.clone());
            for key in &keys {
                let before = &ids[best(key, &ids, &w).unwrap_or(0)];
                let after = &more[best(key, &more, &w).unwrap_or(0)];
                prop_assert!(after == before || *after == new_id, "{before} -> {after}");
            }
        }

        /// Removing an endpoint moves only the keys that were on it.
        #[test]
        fn removing_moves_only_its_keys(
            keys in proptest::collection::vec(any::<Vec<u8>>(), 1..64),
            ids in ids_strategy().prop_filter("two or more", |v| v.len() > 1),
            gone in any::<proptest::sample::Index>(),
        ) {
            let w = Weights::new();
            let gone = gone.index(ids.len());
            let mut fewer = ids.clone();
            let removed = fewer.remove(gone);
            for key in &keys {
                let before = &ids[best(key, &ids, &w).unwrap_or(0)];
                let after = &fewer[best(key, &fewer, &w).unwrap_or(0)];
                prop_assert!(after == before || *before == removed, "{before} -> {after}");
            }
        }
    }
}
