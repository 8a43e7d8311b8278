//! [`ConsistentHash`]: sticky per session, bounded by load.
//!
//! With a session key, candidates are ranked by their weighted rendezvous score
//! ([`hrw`](crate::hrw)) and the best one *under the load cap* is picked, following
//! "Consistent Hashing with Bounded Loads" (Mirrokni, Thorup and Zadimoghaddam, SODA
//! 2018): counting this request, no endpoint may carry more than `c` times its fair
//! share of the load, `ceil(c × (in flight + 1) × w / Σw)` requests for an endpoint of
//! weight `w` (the share of the sessions its weight draws; `ceil(c × (in flight + 1) /
//! N)` when all weigh the same, the paper's cap). A session therefore stays on its
//! engine while that engine is not overloaded, spills to its next-ranked engine (the
//! same one every time, for every proxy) when it is, and returns when load falls. With
//! `c ≥ 1` at least one endpoint is always under its cap (the caps add up to more than
//! the load).
//!
//! Without a key the request has nothing to stick to, and a fallback [`Pick`] decides
//! (least in flight by default).

use std::fmt;
use std::sync::Arc;

use disagg_core::Endpoint;
use disagg_core::router::{Pick, RequestView};

use crate::hrw::{KeyHash, Weights, beats, score, weight_scale};
use crate::key::SessionKey;
use crate::policy::LeastInFlight;

/// The default load factor: an endpoint may carry 25% more than the average before a
/// session spills. The bounded-loads paper and HAProxy's `hash-balance-factor`
/// (where 125 is the commonly recommended value) both find this keeps most keys home
/// while capping the hottest endpoint.
pub const DEFAULT_LOAD_FACTOR: f64 = 1.25;

/// Why a load factor was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum LoadFactorError {
    /// Below 1 the cap can be under the average, and then no endpoint may fit; NaN
    /// compares false with everything. `f64::INFINITY` is allowed (no bound).
    #[error("load factor {0} is not at least 1")]
    BelowOne(f64),
}

/// Consistent hashing on a session key with bounded load, as a per-leg [`Pick`].
///
/// Use it for multi-turn chat, where a session's earlier turns sit in one engine's
/// prefix cache: keep the session there unless that engine is overloaded.
///
/// Cost: one key lookup (a scan of the headers, then at most one top-level body field),
/// then the key hashed once and one hash of the endpoint's id and one logarithm per
/// candidate (and, when the weights differ, one division more); no allocation unless a
/// JSON string key holds escapes.
///
/// Measured cost: ~0.6 µs / 4.4 µs / 38 µs per pick at 8 / 64 / 512 endpoints, a session
/// key in a header (criterion, this repo's `cargo bench -p disagg-affinity`, 2-core VM;
/// the 512 figure ranged from 33 to 45 µs between runs on the shared machine).
///
/// # Examples
///
/// ```
/// use disagg_affinity::{ConsistentHash, KeySource, RoundRobin, SessionKey, Weights};
///
/// let policy = ConsistentHash::new()
///     .with_key(SessionKey::new([KeySource::header("x-conversation-id")]))
///     .with_weights(Weights::new().with_weight("http://10.0.0.9:8200", 2.0)?)
///     .with_load_factor(1.5)?
///     .with_fallback(RoundRobin::new());
/// # let _ = policy;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct ConsistentHash {
    key: SessionKey,
    weights: Weights,
    load_factor: f64,
    fallback: Box<dyn Pick>,
}

impl fmt::Debug for ConsistentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsistentHash")
            .field("key", &self.key)
            .field("weights", &self.weights)
            .field("load_factor", &self.load_factor)
            .finish_non_exhaustive()
    }
}

impl Default for ConsistentHash {
    fn default() -> Self {
        ConsistentHash {
            key: SessionKey::default(),
            weights: Weights::new(),
            load_factor: DEFAULT_LOAD_FACTOR,
            fallback: Box::new(LeastInFlight::new()),
        }
    }
}

// === impl ConsistentHash ===

impl ConsistentHash {
    /// Key `x-session-id` then `user`, equal weights, load factor 1.25, least in flight
    /// for requests without a key.
    pub fn new() -> Self {
        Self::default()
    }

    /// Where the session key is looked for.
    pub fn with_key(mut self, key: SessionKey) -> Self {
        self.key = key;
        self
    }

    /// Per-endpoint weights, overriding the endpoints' own ([`Weights::weight_of`]:
    /// by id, then by engine URL for a rank endpoint, then [`Endpoint::weight`]).
    pub fn with_weights(mut self, weights: Weights) -> Self {
        self.weights = weights;
        self
    }

    /// The load factor `c`: an endpoint may carry at most `ceil(c × its fair share)`
    /// requests, counting this one, its fair share the load times its weight's share
    /// of the candidates' weights (the average, when they weigh the same).
    /// `f64::INFINITY` disables the bound (pure consistent hashing).
    ///
    /// # Errors
    ///
    /// [`LoadFactorError::BelowOne`] when `c` is below 1 or NaN.
    pub fn with_load_factor(mut self, c: f64) -> Result<Self, LoadFactorError> {
        if c.is_nan() || c < 1.0 {
            return Err(LoadFactorError::BelowOne(c));
        }
        self.load_factor = c;
        Ok(self)
    }

    /// The policy for requests without a session key.
    pub fn with_fallback(mut self, fallback: impl Pick) -> Self {
        self.fallback = Box::new(fallback);
        self
    }

    /// The session key configuration.
    pub fn key(&self) -> &SessionKey {
        &self.key
    }

    /// The load factor `c`.
    pub fn load_factor(&self) -> f64 {
        self.load_factor
    }

    /// The most requests in flight an endpoint may already carry and still take one
    /// more, when all `n` candidates weigh the same: `ceil(c × (total + 1) / n) - 1`,
    /// where `total` is the in-flight sum over them. `usize::MAX` when unbounded. See
    /// [`weighted_cap`](Self::weighted_cap) for candidates of different weights.
    pub fn cap(&self, total_in_flight: usize, candidates: usize) -> usize {
        if self.load_factor.is_infinite() || candidates == 0 {
            return usize::MAX;
        }
        let avg = (total_in_flight as f64 + 1.0) / candidates as f64;
        // At least 1 (c ≥ 1 and total + 1 ≥ 1), so the subtraction cannot wrap.
        let limit = (self.load_factor * avg).ceil().max(1.0);
        if limit >= usize::MAX as f64 {
            usize::MAX
        } else {
            limit as usize - 1
        }
    }

    /// The most requests in flight an endpoint of weight `weight` may already carry and
    /// still take one more, among candidates weighing `total_weight` together:
    /// `ceil(c × (total + 1) × weight / total_weight) - 1`, where `total` is the
    /// in-flight sum over the candidates: `c` times the endpoint's share of the load,
    /// the share of the sessions its weight draws. `usize::MAX` when unbounded; `0`
    /// (room for this one request only) for a weight that is not positive and finite,
    /// or a total that is not.
    ///
    /// The caps of all candidates add up to at least `c × (total + 1)`, more than the
    /// `total` they carry, so (with `c ≥ 1`) one is always under its cap. With equal
    /// weights this is [`cap`](Self::cap).
    pub fn weighted_cap(&self, total_in_flight: usize, weight: f64, total_weight: f64) -> usize {
        if self.load_factor.is_infinite() {
            return usize::MAX;
        }
        let share = weight / total_weight;
        if !(share.is_finite() && share > 0.0) {
            return 0;
        }
        let fair = (total_in_flight as f64 + 1.0) * share;
        // At least 1, so the subtraction cannot wrap.
        let limit = (self.load_factor * fair).ceil().max(1.0);
        if limit >= usize::MAX as f64 {
            usize::MAX
        } else {
            limit as usize - 1
        }
    }

    /// The candidate for session `key`: the highest-scoring one whose in-flight count is
    /// at most its cap: [`weighted_cap`](Self::weighted_cap) of its weight, or, when all
    /// candidates weigh the same, [`cap`](Self::cap). `candidates` must not be empty
    /// (then `0`).
    pub fn pick_key(&self, key: &[u8], candidates: &[Arc<Endpoint>]) -> usize {
        let (total, max_weight, min_weight) =
            candidates
                .iter()
                .fold((0usize, 0.0f64, f64::INFINITY), |(n, hi, lo), e| {
                    let w = self.weights.weight_of(e);
                    (n.saturating_add(e.in_flight()), hi.max(w), lo.min(w))
                });
        // Weights near `f64::MAX` would score infinity, and sum to it (see
        // `weight_scale`): scaled, they sum and divide exactly as unscaled ones.
        let scale = weight_scale(max_weight);
        // Equal weights: one cap for all, as the paper's. Else each endpoint's share.
        let caps = if max_weight == min_weight {
            Caps::Equal(self.cap(total, candidates.len()))
        } else {
            Caps::Weighted(
                candidates
                    .iter()
                    .map(|e| self.weights.weight_of(e) * scale)
                    .sum(),
            )
        };
        // The key is hashed once; each candidate adds only its id (see `KeyHash`).
        let key = KeyHash::new(key);
        // The best under its cap, and the best overall should in-flight counts move
        // under us between the sum and this scan and leave none under theirs.
        let mut best: Option<(f64, &str, usize)> = None;
        let mut any: Option<(f64, &str, usize)> = None;
        for (i, e) in candidates.iter().enumerate() {
            let id = e.id().as_str();
            let weight = self.weights.weight_of(e) * scale;
            let s = score(key.with_id(id), weight);
            if any.is_none_or(|(ts, tid, _)| beats(s, id, ts, tid)) {
                any = Some((s, id, i));
            }
            let cap = match caps {
                Caps::Equal(cap) => cap,
                Caps::Weighted(total_weight) => self.weighted_cap(total, weight, total_weight),
            };
            if e.in_flight() <= cap && best.is_none_or(|(ts, tid, _)| beats(s, id, ts, tid)) {
                best = Some((s, id, i));
            }
        }
        best.or(any).map_or(0, |(_, _, i)| i)
    }
}

/// The load caps of one pick.
#[derive(Clone, Copy)]
enum Caps {
    /// Every candidate weighs the same: this cap for all.
    Equal(usize),
    /// Each candidate's cap is its weight's share of this total (scaled weights).
    Weighted(f64),
}

impl Pick for ConsistentHash {
    fn pick(&self, req: &RequestView<'_>, candidates: &[Arc<Endpoint>]) -> usize {
        match self.key.extract(req) {
            Some(key) => self.pick_key(&key, candidates),
            None => self.fallback.pick(req, candidates),
        }
    }
}

#[cfg(test)]
mod tests {
    use disagg_core::{Role, json::JsonBody, request::Api};
    use http::HeaderMap;
    use proptest::prelude::*;

    use super::*;
    use crate::hrw::best;

    fn eps(n: usize) -> Vec<Arc<Endpoint>> {
        (0..n)
            .map(|i| {
                Arc::new(
                    Endpoint::new(&format!("http://10.0.0.{i}:8200"), Role::Decode)
                        .expect("valid url"),
                )
            })
            .collect()
    }

    fn ids(c: &[Arc<Endpoint>]) -> Vec<String> {
        c.iter().map(|e| e.id().as_str().to_owned()).collect()
    }

    fn pick_with(
        p: &ConsistentHash,
        headers: &HeaderMap,
        body: &str,
        c: &[Arc<Endpoint>],
    ) -> usize {
        let b = JsonBody::parse(body.as_bytes()).expect("test body");
        p.pick(&RequestView::new(Api::Chat, None, headers, &b), c)
    }

    #[test]
    fn a_session_sticks_to_its_hrw_endpoint() {
        let c = eps(5);
        let p = ConsistentHash::default();
        let mut h = HeaderMap::new();
        h.insert("x-session-id", "abc".parse().expect("value"));
        let home = best(b"abc", &ids(&c), &Weights::new()).expect("non-empty");
        for _ in 0..50 {
            assert_eq!(pick_with(&p, &h, "{}", &c), home);
        }
        // The body's `user` is the key when no header is sent.
        let home = best(b"alice", &ids(&c), &Weights::new()).expect("non-empty");
        assert_eq!(
            pick_with(&p, &HeaderMap::new(), r#"{"user":"alice"}"#, &c),
            home
        );
    }

    #[test]
    fn no_key_uses_the_fallback() {
        let c = eps(3);
        let _busy: Vec<_> = [0, 0, 2].iter().map(|&i| c[i].track()).collect();
        // Default fallback: least in flight.
        let p = ConsistentHash::default();
        for _ in 0..10 {
            assert_eq!(pick_with(&p, &HeaderMap::new(), r#"{"model":"m"}"#, &c), 1);
        }
        // A configured fallback.
        struct Last;
        impl Pick for Last {
            fn pick(&self, _: &RequestView<'_>, c: &[Arc<Endpoint>]) -> usize {
                c.len() - 1
            }
        }
        let p = ConsistentHash::new().with_fallback(Last);
        assert_eq!(pick_with(&p, &HeaderMap::new(), "{}", &c), 2);
    }

    #[test]
    fn a_hot_session_spills_and_returns() {
        let c = eps(3);
        let p = ConsistentHash::default();
        let home = p.pick_key(b"hot", &c);
        let mut guards = Vec::new();
        let mut picks = Vec::new();
        for _ in 0..30 {
            let i = p.pick_key(b"hot", &c);
            picks.push(i);
            guards.push(c[i].track());
        }
        assert!(picks.iter().any(|&i| i != home), "spilled: {picks:?}");
        let loads: Vec<usize> = c.iter().map(|e| e.in_flight()).collect();
        // The 30th pick saw 29 in flight: ceil(1.25 × 30 / 3) = 13 counting itself.
        assert!(loads.iter().all(|&l| l <= 13), "{loads:?}");
        guards.clear();
        assert_eq!(p.pick_key(b"hot", &c), home, "back home once idle");
    }

    /// Of 10,000 sessions over two endpoints weighted `weights`, those the second gets.
    fn second_share(weights: [f64; 2]) -> usize {
        let c: Vec<_> = (0..2)
            .map(|i| {
                let e = Endpoint::new(&format!("http://10.0.0.{i}:8200"), Role::Decode)
                    .expect("valid url");
                Arc::new(e.with_weight(weights[i]).expect("valid weight"))
            })
            .collect();
        let p = ConsistentHash::default();
        (0..10_000u32)
            .filter(|k| p.pick_key(&k.to_le_bytes(), &c) == 1)
            .count()
    }

    #[test]
    fn an_endpoints_own_weight_draws_its_share_of_sessions() {
        let heavy = second_share([1.0, 4.0]);
        // A share of 4/5 of the sessions.
        assert!((7_600..8_400).contains(&heavy), "{heavy}");
    }

    #[test]
    fn a_long_session_key_is_hashed_once() {
        // A 1 MiB `user` on 64 endpoints: the key's bytes once, then each id's (before:
        // 64 MiB per leg, seconds on the event loop at 30 MiB).
        let c = eps(64);
        let user = "u".repeat(1 << 20);
        let body = format!(r#"{{"user":"{user}"}}"#);
        let p = ConsistentHash::default();
        let before = crate::hrw::hashed_bytes();
        let i = pick_with(&p, &HeaderMap::new(), &body, &c);
        let hashed = crate::hrw::hashed_bytes() - before;
        let ids_len: usize = c.iter().map(|e| e.id().as_str().len()).sum();
        assert!(
            hashed <= (8 + user.len() + ids_len) as u64,
            "{hashed} bytes hashed"
        );
        let home = best(user.as_bytes(), &ids(&c), &Weights::new()).expect("non-empty");
        assert_eq!(i, home);
    }

    #[test]
    fn endpoint_weights_near_f64_max_keep_their_shares() {
        // Unscaled, both scores are infinite for most keys and the tie goes to the
        // smaller id.
        let heavy = second_share([f64::MAX / 4.0, f64::MAX]);
        // A share of 4/5 of the sessions.
        assert!((7_600..8_400).contains(&heavy), "{heavy}");
    }

    #[test]
    fn caps() {
        let p = ConsistentHash::default();
        assert_eq!(p.cap(0, 3), 0); // ceil(1.25/3) = 1 → may hold 0
        assert_eq!(p.cap(8, 3), 3); // ceil(1.25 × 3) = 4
        assert_eq!(p.cap(0, 1), 1); // ceil(1.25) = 2
        let unbounded = ConsistentHash::new()
            .with_load_factor(f64::INFINITY)
            .expect("valid");
        assert_eq!(unbounded.cap(100, 2), usize::MAX);
        assert!(ConsistentHash::new().with_load_factor(0.9).is_err());
        assert!(ConsistentHash::new().with_load_factor(f64::NAN).is_err());
    }

    #[test]
    fn golden_picks() {
        let c = eps(6);
        let p = ConsistentHash::default();
        let got: Vec<usize> = ["session-1", "session-2", "alice", "bob"]
            .iter()
            .map(|k| p.pick_key(k.as_bytes(), &c))
            .collect();
        // Idle endpoints: the pure HRW choice, pinned like `hrw`'s golden values.
        assert_eq!(got, [3, 3, 0, 5], "{got:?}");
    }

    /// Endpoints `A` (weight 1) and `B` (weight 4), the default policy, and a key whose
    /// rendezvous home is `home` (0 for `A`, 1 for `B`).
    fn weighted_pair(home: usize) -> (Vec<Arc<Endpoint>>, ConsistentHash, Vec<u8>) {
        let c: Vec<_> = [1.0, 4.0]
            .iter()
            .enumerate()
            .map(|(i, &w)| {
                let e = Endpoint::new(&format!("http://10.0.0.{i}:8200"), Role::Decode)
                    .expect("valid url");
                Arc::new(e.with_weight(w).expect("valid weight"))
            })
            .collect();
        let weights = Weights::new()
            .with_weight(c[0].id().as_str(), 1.0)
            .and_then(|w| w.with_weight(c[1].id().as_str(), 4.0))
            .expect("valid weights");
        let key = (0u32..)
            .map(|k| format!("session-{k}").into_bytes())
            .find(|k| best(k, &ids(&c), &weights) == Some(home))
            .expect("a key homed there");
        (c, ConsistentHash::default(), key)
    }

    /// A weight-4 endpoint takes 4/5 of the sessions, so its fair share of 81 requests
    /// in flight (80 and this one) is 64.8, its cap 1.25 times that: 81 counting this
    /// one. At 70 it is under its cap and keeps its session; an equal cap (50, half of
    /// 1.25 × 81) spilled it to the weight-1 endpoint. That one's share is 16.2, its
    /// cap 21 counting this one: at 21 already its session spills, at 20 it stays (an
    /// equal cap kept it up to 50).
    #[test]
    fn each_endpoint_is_capped_by_its_weights_share() {
        let load = |c: &[Arc<Endpoint>], a: usize, b: usize| -> Vec<_> {
            (0..a)
                .map(|_| c[0].track())
                .chain((0..b).map(|_| c[1].track()))
                .collect()
        };
        let (c, p, key) = weighted_pair(1);
        let guards = load(&c, 10, 70);
        assert_eq!(p.pick_key(&key, &c), 1);
        drop(guards);
        let (c, p, key) = weighted_pair(0);
        let guards = load(&c, 21, 60);
        assert_eq!(p.pick_key(&key, &c), 1);
        drop(guards);
        let guards = load(&c, 20, 60);
        assert_eq!(p.pick_key(&key, &c), 0);
        drop(guards);
        // Idle, each key is at home.
        assert_eq!(p.pick_key(&key, &c), 0);
    }

    proptest! {
        /// With weights, each endpoint's cap is its weight's share: one is always under
        /// its own, the pick is under its own, and it is the key's rendezvous home
        /// whenever that one is under its own.
        #[test]
        fn weighted_bounded_load_respects_each_cap(
            loads_weights in proptest::collection::vec((0usize..40, 1u32..8), 1..8),
            key in any::<Vec<u8>>(),
            c in prop_oneof![Just(1.0), Just(1.25), 1.0f64..3.0],
        ) {
            let cands: Vec<_> = loads_weights
                .iter()
                .enumerate()
                .map(|(i, &(_, w))| {
                    let e = Endpoint::new(&format!("http://10.0.0.{i}:8200"), Role::Decode)
                        .expect("valid url");
                    Arc::new(e.with_weight(f64::from(w)).expect("valid weight"))
                })
                .collect();
            let _guards: Vec<_> = loads_weights
                .iter()
                .enumerate()
                .flat_map(|(i, &(l, _))| (0..l).map(move |_| i))
                .map(|i| cands[i].track())
                .collect();
            let p = ConsistentHash::new().with_load_factor(c).expect("c >= 1");
            let total: usize = loads_weights.iter().map(|&(l, _)| l).sum();
            let total_weight: f64 = loads_weights.iter().map(|&(_, w)| f64::from(w)).sum();
            let caps: Vec<usize> = loads_weights
                .iter()
                .map(|&(_, w)| p.weighted_cap(total, f64::from(w), total_weight))
                .collect();
            let fits = |i: usize| loads_weights[i].0 <= caps[i];
            prop_assert!((0..cands.len()).any(fits), "someone fits: {:?} {:?}", loads_weights, caps);
            let i = p.pick_key(&key, &cands);
            prop_assert!(fits(i), "picked {} over its cap: {:?} {:?}", i, loads_weights, caps);
            let mut weights = Weights::new();
            for (e, &(_, w)) in cands.iter().zip(&loads_weights) {
                weights = weights.with_weight(e.id().as_str(), f64::from(w)).expect("valid");
            }
            let home = best(&key, &ids(&cands), &weights).expect("non-empty");
            if fits(home) {
                prop_assert_eq!(i, home);
            }
        }
    }

    proptest! {
        /// Bounded load never picks an endpoint over the cap while another is under it,
        /// and never leaves the key's HRW choice when that one is under the cap.
        #[test]
        fn bounded_load_respects_the_cap(
            loads in proptest::collection::vec(0usize..20, 1..8),
            key in any::<Vec<u8>>(),
            c in prop_oneof![Just(1.0), Just(1.25), 1.0f64..3.0],
        ) {
            let cands = eps(loads.len());
            let _guards: Vec<_> = loads
                .iter()
                .enumerate()
                .flat_map(|(i, &l)| (0..l).map(move |_| i))
                .map(|i| cands[i].track())
                .collect();
            let p = ConsistentHash::new().with_load_factor(c).expect("c >= 1");
            let cap = p.cap(loads.iter().sum(), loads.len());
            prop_assert!(loads.iter().any(|&l| l <= cap), "someone fits");
            let i = p.pick_key(&key, &cands);
            prop_assert!(loads[i] <= cap, "picked {} with {} > cap {}", i, loads[i], cap);
            let home = best(&key, &ids(&cands), &Weights::new()).expect("non-empty");
            if loads[home] <= cap {
                prop_assert_eq!(i, home);
            }
            // Stable across calls.
            prop_assert_eq!(i, p.pick_key(&key, &cands));
        }
    }
}
