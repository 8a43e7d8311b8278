//! The simple per-leg policies, and [`PerLeg`], the router that combines one policy for
//! the prefill leg with another for the decode leg.
//!
//! | policy | picks | use it when |
//! |---|---|---|
//! | [`RoundRobin`] | the next endpoint in turn | engines and requests are alike |
//! | [`Random`] | a uniformly random endpoint | many proxies share the engines and must not move in lockstep |
//! | [`WeightedRandom`] | a random endpoint, in proportion to its weight | engines of unequal size (more GPUs, a faster model build) |
//! | [`LeastInFlight`] | the endpoint with the fewest requests in flight (ties in turn) | request lengths vary; one proxy sees all the load |
//! | [`PowerOfTwo`] | the less loaded of two distinct random endpoints | several proxies share the engines: load-aware without herding |
//! | [`ConsistentHash`](crate::ConsistentHash) | the session's endpoint by rendezvous hashing, bounded by load | multi-turn sessions that should keep their engine's prefix cache |
//! | [`CacheAware`](crate::CacheAware) | the endpoint holding the longest prefix of the prompt, unless load is out of balance | prefix-caching prefill engines with shared system prompts |
//!
//! Every policy's decision cost is measured by `cargo bench -p disagg-affinity` (criterion,
//! 2-core VM) at 8, 64 and 512 candidates and stated on the policy; see also
//! `docs/routing.md`.
//!
//! In-flight requests are counted until their response body ends (see
//! [`Endpoint::track`]), so long streams weigh as long as they last.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use disagg_core::Role;
use disagg_core::endpoint::{Endpoint, EndpointSet};
use disagg_core::error::RouteError;
use disagg_core::router::{Pick, RequestView, Route, Router};

use crate::hrw::weight_scale;

/// A router from one [`Pick`] per leg.
///
/// # Examples
///
/// ```
/// use disagg_affinity::{LeastInFlight, PerLeg, PowerOfTwo, RoundRobin};
/// // Prefill spread by load over two random choices, decode by least in flight.
/// let router = PerLeg::new(PowerOfTwo::from_seed(7), LeastInFlight::new());
/// // Round robin over each role, each leg in its own turn.
/// let round_robin = PerLeg::both(RoundRobin::new);
/// # let _ = (router, round_robin);
/// ```
pub struct PerLeg {
    prefill: Box<dyn Pick>,
    decode: Box<dyn Pick>,
}

impl std::fmt::Debug for PerLeg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PerLeg").finish_non_exhaustive()
    }
}

impl PerLeg {
    /// `prefill` picks the prefill endpoint, `decode` the decode endpoint.
    pub fn new(prefill: impl Pick, decode: impl Pick) -> Self {
        PerLeg {
            prefill: Box::new(prefill),
            decode: Box::new(decode),
        }
    }

    /// The same policy for both legs, one instance each (`make` is called twice), so
    /// each leg keeps its own state: its own turn, its own table, its own random draws.
    pub fn both<P: Pick>(make: impl Fn() -> P) -> Self {
        PerLeg::new(make(), make())
    }

    fn decode(
        &self,
        req: &RequestView<'_>,
        set: &EndpointSet,
    ) -> Result<Arc<Endpoint>, RouteError> {
        match set.by_role(Role::Decode) {
            [] => Err(RouteError::NoDecode),
            eps => Ok(Arc::clone(
                &eps[self.decode.pick(req, eps).min(eps.len() - 1)],
            )),
        }
    }
}

impl Router for PerLeg {
    fn select(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        let decode = self.decode(req, set)?;
        let prefill = match set.by_role(Role::Prefill) {
            [] => None,
            eps => Some(Arc::clone(
                &eps[self.prefill.pick(req, eps).min(eps.len() - 1)],
            )),
        };
        Ok(Route::new(prefill, decode))
    }

    /// The decode policy alone: the prefill policy is not asked.
    fn select_direct(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        Ok(Route::new(None, self.decode(req, set)?))
    }

    /// Either leg's policy reads token ids.
    fn wants_tokens(&self) -> bool {
        self.prefill.wants_tokens() || self.decode.wants_tokens()
    }
}

/// The next endpoint in turn.
///
/// Measured cost: ~7 ns per pick at 8 / 64 / 512 endpoints (criterion, `cargo bench -p
/// disagg-affinity`, 2-core VM).
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl RoundRobin {
    /// Starting at the first endpoint.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Pick for RoundRobin {
    fn pick(&self, _req: &RequestView<'_>, candidates: &[Arc<Endpoint>]) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % candidates.len()
    }
}

/// The endpoint with the fewest requests in flight; ties are broken in turn, so an idle
/// set is still spread.
///
/// Requests in flight are [`Endpoint::load`]: this router's own count, or the engine's
/// own count when the engines' `/metrics` are read for it (`--load-source
/// engine-metrics`).
///
/// Measured cost: ~25 ns / ~150 ns / ~1.1 µs per pick at 8 / 64 / 512 endpoints (a scan
/// of every candidate; criterion, `cargo bench -p disagg-affinity`, 2-core VM).
#[derive(Debug, Default)]
pub struct LeastInFlight {
    tie: AtomicUsize,
}

impl LeastInFlight {
    /// A least-in-flight policy.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Pick for LeastInFlight {
    fn pick(&self, _req: &RequestView<'_>, candidates: &[Arc<Endpoint>]) -> usize {
        let n = candidates.len();
        let start = self.tie.fetch_add(1, Ordering::Relaxed);
        let mut best = start % n;
        for k in 1..n {
            let i = (start + k) % n;
            if candidates[i].load() < candidates[best].load() {
                best = i;
            }
        }
        best
    }
}

/// splitmix64's gamma (2^64 divided by the golden ratio, odd): the step of its state.
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// A small, lock-free pseudo-random generator (splitmix64 over an atomic counter), so
/// policies can be seeded for deterministic tests.
#[derive(Debug)]
struct Rng {
    state: AtomicU64,
}

impl Rng {
    fn from_seed(seed: u64) -> Self {
        Rng {
            state: AtomicU64::new(seed),
        }
    }

    fn random() -> Self {
        Self::from_seed(uuid::Uuid::new_v4().as_u64_pair().0)
    }

    fn next_u64(&self) -> u64 {
        // splitmix64: the state advances by its gamma, and the output is the finalizer
        // of the advanced state.
        let state = self.state.fetch_add(GAMMA, Ordering::Relaxed);
        crate::hrw::finalize(state.wrapping_add(GAMMA))
    }

    /// Uniform in `0..n` (`n > 0`), by multiply-shift (Lemire), without modulo bias
    /// worth speaking of for endpoint counts.
    fn below(&self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

/// A uniformly random endpoint.
///
/// Measured cost: ~8-12 ns per pick at 8 / 64 / 512 endpoints (criterion, `cargo bench
/// -p disagg-affinity`, 2-core VM).
#[derive(Debug)]
pub struct Random {
    rng: Rng,
}

impl Default for Random {
    fn default() -> Self {
        Self::new()
    }
}

impl Random {
    /// Seeded from the OS.
    pub fn new() -> Self {
        Random { rng: Rng::random() }
    }

    /// With a fixed seed, for deterministic tests.
    pub fn from_seed(seed: u64) -> Self {
        Random {
            rng: Rng::from_seed(seed),
        }
    }
}

impl Pick for Random {
    fn pick(&self, _req: &RequestView<'_>, candidates: &[Arc<Endpoint>]) -> usize {
        self.rng.below(candidates.len())
    }
}

/// A random endpoint, chosen in proportion to its weight.
///
/// An endpoint's weight is, first found:
///
/// 1. a weight set on this policy with [`with_weight`](Self::with_weight) for its id;
/// 2. one set for its engine's URL, for a data-parallel rank endpoint (`URL@RANK`);
/// 3. the endpoint's own [`Endpoint::weight`]: what discovery found (an endpoints file's
///    `weight`, the `disagg.io/weight` annotation), or what the endpoint was built with
///    (`Endpoint::with_weight`; the proxy's `--weight URL=W`), 1.0 otherwise.
///
/// So weights given to the policy override the endpoints', and an engine weighed by URL
/// is weighed on every rank. Each rank endpoint draws its engine's weight: an engine of
/// N ranks weighs `N × w` in all, in proportion to its N schedulers.
///
/// Measured cost: ~0.4 µs / ~3 µs / ~24 µs per pick at 8 / 64 / 512 endpoints with
/// weights set on the policy (a weight lookup per candidate, twice; criterion, `cargo
/// bench -p disagg-affinity`, 2-core VM); without them it reads each endpoint's field.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use disagg_affinity::WeightedRandom;
/// use disagg_core::{Endpoint, Role};
/// // The engine at :8200 has twice the GPUs of the others; so has the one at :8300,
/// // which says so itself (as a discovered engine's weight does).
/// let policy = WeightedRandom::new().with_weight("http://10.0.0.7:8200", 2.0);
/// let big = Endpoint::new("http://10.0.0.8:8300", Role::Decode)?.with_weight(2.0)?;
/// # let _ = (policy, big);
/// # Ok::<(), disagg_core::endpoint::EndpointError>(())
/// ```
#[derive(Debug)]
pub struct WeightedRandom {
    rng: Rng,
    /// Weights set on the policy, by endpoint id or engine URL.
    weights: std::collections::HashMap<Box<str>, f64>,
}

impl Default for WeightedRandom {
    fn default() -> Self {
        Self::new()
    }
}

impl WeightedRandom {
    /// Every endpoint weighs its own [`Endpoint::weight`]; seeded from the OS.
    pub fn new() -> Self {
        WeightedRandom {
            rng: Rng::random(),
            weights: Default::default(),
        }
    }

    /// With a fixed seed, for deterministic tests.
    pub fn from_seed(seed: u64) -> Self {
        WeightedRandom {
            rng: Rng::from_seed(seed),
            weights: Default::default(),
        }
    }

    /// Set the weight of the endpoint `id`, or of every rank endpoint of the engine at
    /// `id` (its base URL, a trailing `/` ignored); it overrides the endpoints' own
    /// weight. Weights that are not finite and positive are ignored.
    pub fn with_weight(mut self, id: &str, weight: f64) -> Self {
        if weight.is_finite() && weight > 0.0 {
            self.weights.insert(id.trim_end_matches('/').into(), weight);
        }
        self
    }

    fn weight(&self, ep: &Endpoint) -> f64 {
        if self.weights.is_empty() {
            return ep.weight();
        }
        policy_weight(&self.weights, ep).unwrap_or_else(|| ep.weight())
    }
}

/// The weight `weights` (set on a policy) give `ep`: by its id, else by its engine's
/// URL for a rank endpoint.
pub(crate) fn policy_weight(
    weights: &std::collections::HashMap<Box<str>, f64>,
    ep: &Endpoint,
) -> Option<f64> {
    let id = ep.id().as_str();
    weights.get(id).copied().or_else(|| {
        ep.rank()?;
        let (engine, _) = id.rsplit_once('@')?;
        weights.get(engine).copied()
    })
}

impl Pick for WeightedRandom {
    fn pick(&self, _req: &RequestView<'_>, candidates: &[Arc<Endpoint>]) -> usize {
        let (mut total, max) = candidates
            .iter()
            .map(|e| self.weight(e))
            .fold((0.0f64, 0.0f64), |(t, m), w| (t + w, m.max(w)));
        // Each weight is finite, but their sum may not be (two of 1e308): then every
        // pick would go to the last candidate. Scaled by a power of two, they sum to at
        // most 4 per candidate; a finite sum keeps the unscaled arithmetic (the same
        // picks either way, see `weight_scale`).
        let scale = if total.is_finite() {
            1.0
        } else {
            let scale = weight_scale(max);
            total = candidates.iter().map(|e| self.weight(e) * scale).sum();
            scale
        };
        // 53 random bits: uniform in [0, 1).
        let mut x = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
        for (i, ep) in candidates.iter().enumerate() {
            x -= self.weight(ep) * scale;
            if x < 0.0 {
                return i;
            }
        }
        candidates.len() - 1
    }
}

/// Power of two choices: two *distinct* random endpoints, the one with fewer requests in
/// flight wins (the first on a tie). With one candidate it is that one; it never silently
/// degrades to a single random choice when two exist. Requests in flight are
/// [`Endpoint::load`], as for [`LeastInFlight`].
///
/// Measured cost: ~15 ns per pick at 8 / 64 / 512 endpoints (criterion, `cargo bench -p
/// disagg-affinity`, 2-core VM).
#[derive(Debug)]
pub struct PowerOfTwo {
    rng: Rng,
}

impl Default for PowerOfTwo {
    fn default() -> Self {
        Self::new()
    }
}

impl PowerOfTwo {
    /// Seeded from the OS.
    pub fn new() -> Self {
        PowerOfTwo { rng: Rng::random() }
    }

    /// With a fixed seed, for deterministic tests.
    pub fn from_seed(seed: u64) -> Self {
        PowerOfTwo {
            rng: Rng::from_seed(seed),
        }
    }

    /// Two distinct indices below `n` (`n >= 2`).
    fn pair(&self, n: usize) -> (usize, usize) {
        let a = self.rng.below(n);
        // Draw the second from the n - 1 others: distinct by construction.
        let mut b = self.rng.below(n - 1);
        if b >= a {
            b += 1;
        }
        (a, b)
    }
}

impl Pick for PowerOfTwo {
    fn pick(&self, _req: &RequestView<'_>, candidates: &[Arc<Endpoint>]) -> usize {
        if candidates.len() < 2 {
            return 0;
        }
        let (a, b) = self.pair(candidates.len());
        if candidates[b].load() < candidates[a].load() {
            b
        } else {
            a
        }
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderMap;

    use super::*;
    use disagg_core::endpoint::Role;
    use disagg_core::{json::JsonBody, request::Api};

    fn eps(n: usize, role: Role) -> Vec<Arc<Endpoint>> {
        (0..n)
            .map(|i| Arc::new(Endpoint::new(&format!("http://e{i}:1"), role).unwrap()))
            .collect()
    }

    fn with_view<R>(f: impl FnOnce(&RequestView<'_>) -> R) -> R {
        let (h, b) = (HeaderMap::new(), JsonBody::default());
        f(&RequestView::new(Api::Chat, None, &h, &b))
    }

    #[test]
    fn power_of_two_pairs_are_distinct_and_cover_all() {
        let p2c = PowerOfTwo::from_seed(1);
        for n in 2..10 {
            let mut seen = vec![false; n];
            for _ in 0..2_000 {
                let (a, b) = p2c.pair(n);
                assert!(a < n && b < n && a != b, "n={n}: {a},{b}");
                seen[a] = true;
                seen[b] = true;
            }
            assert!(seen.iter().all(|s| *s), "n={n}");
        }
    }

    #[test]
    fn power_of_two_never_picks_the_busiest_of_two() {
        let c = eps(2, Role::Decode);
        let _busy: Vec<_> = (0..3).map(|_| c[1].track()).collect();
        let p2c = PowerOfTwo::from_seed(9);
        with_view(|v| {
            for _ in 0..100 {
                assert_eq!(p2c.pick(v, &c), 0);
            }
        });
    }

    #[test]
    fn power_of_two_avoids_the_most_loaded_of_many() {
        let c = eps(4, Role::Decode);
        let _busy: Vec<_> = (0..5).map(|_| c[2].track()).collect();
        let p2c = PowerOfTwo::from_seed(3);
        with_view(|v| {
            for _ in 0..1_000 {
                assert_ne!(
                    p2c.pick(v, &c),
                    2,
                    "the loaded one loses every pair it is in"
                );
            }
        });
    }

    #[test]
    fn random_is_roughly_uniform_and_seeded() {
        let c = eps(4, Role::Prefill);
        let (a, b) = (Random::from_seed(5), Random::from_seed(5));
        let mut counts = [0usize; 4];
        with_view(|v| {
            for _ in 0..4_000 {
                let i = a.pick(v, &c);
                assert_eq!(i, b.pick(v, &c), "same seed, same choices");
                counts[i] += 1;
            }
        });
        assert!(
            counts.iter().all(|&k| (800..1200).contains(&k)),
            "{counts:?}"
        );
    }

    #[test]
    fn weighted_random_follows_the_weights() {
        let c = eps(3, Role::Decode);
        let w = WeightedRandom::from_seed(42)
            .with_weight(c[1].id().as_str(), 2.0)
            .with_weight(c[2].id().as_str(), 5.0)
            .with_weight("http://unknown:1", f64::NAN);
        let mut counts = [0usize; 3];
        with_view(|v| {
            for _ in 0..100_000 {
                counts[w.pick(v, &c)] += 1;
            }
        });
        // Expected shares 1/8, 2/8, 5/8, within two points.
        for (n, share) in counts.iter().zip([0.125, 0.25, 0.625]) {
            let got = *n as f64 / 100_000.0;
            assert!((got - share).abs() < 0.02, "{counts:?}");
        }
    }

    #[test]
    fn weighted_random_follows_weights_that_sum_past_f64_max() {
        // Each weight is finite (accepted), their sum is not: unscaled, every pick went
        // to the last candidate.
        let c = eps(3, Role::Decode);
        let w = WeightedRandom::from_seed(7)
            .with_weight(c[0].id().as_str(), 1e308)
            .with_weight(c[1].id().as_str(), 1e308)
            .with_weight(c[2].id().as_str(), 5e307);
        let got = shares(&w, &c, 40_000);
        // Expected shares 2/5, 2/5, 1/5, within two points (σ ≈ 0.25 points).
        for (g, share) in got.iter().zip([0.4, 0.4, 0.2]) {
            assert!((g - share).abs() < 0.02, "{got:?}");
        }
        // The same through the endpoints' own weights.
        let own: Vec<_> = [f64::MAX, f64::MAX]
            .iter()
            .enumerate()
            .map(|(i, &wt)| {
                let e = Endpoint::new(&format!("http://e{i}:1"), Role::Decode).unwrap();
                Arc::new(e.with_weight(wt).unwrap())
            })
            .collect();
        let got = shares(&WeightedRandom::from_seed(7), &own, 40_000);
        assert!((got[0] - 0.5).abs() < 0.02, "{got:?}");
    }

    /// The share of `n` picks each candidate got.
    fn shares(w: &WeightedRandom, c: &[Arc<Endpoint>], n: usize) -> Vec<f64> {
        let mut counts = vec![0usize; c.len()];
        with_view(|v| {
            for _ in 0..n {
                counts[w.pick(v, c)] += 1;
            }
        });
        counts.iter().map(|&k| k as f64 / n as f64).collect()
    }

    #[test]
    fn weighted_random_reads_the_endpoints_own_weights() {
        let c: Vec<_> = [1.0, 3.0]
            .iter()
            .enumerate()
            .map(|(i, &w)| {
                let e = Endpoint::new(&format!("http://e{i}:1"), Role::Decode).unwrap();
                Arc::new(e.with_weight(w).unwrap())
            })
            .collect();
        let got = shares(&WeightedRandom::from_seed(7), &c, 40_000);
        assert!((got[1] - 0.75).abs() < 0.02, "{got:?}");
    }

    #[test]
    fn a_weight_set_for_an_engine_url_weighs_each_of_its_ranks_and_overrides_its_own() {
        let rank = |r: u32, own: f64| {
            let e = Endpoint::new(&format!("http://big:1@{r}"), Role::Decode).unwrap();
            Arc::new(e.with_weight(own).unwrap())
        };
        let small = Arc::new(Endpoint::new("http://small:1", Role::Decode).unwrap());
        // The ranks say 1.0 each; the policy says 4 for the engine.
        let c = vec![rank(0, 1.0), rank(1, 1.0), Arc::clone(&small)];
        let w = WeightedRandom::from_seed(3).with_weight("http://big:1/", 4.0);
        let got = shares(&w, &c, 45_000);
        // 4 : 4 : 1.
        for (g, want) in got.iter().zip([4.0 / 9.0, 4.0 / 9.0, 1.0 / 9.0]) {
            assert!((g - want).abs() < 0.02, "{got:?}");
        }
        // An id given exactly wins over the engine URL.
        let w = w.with_weight("http://big:1@1", 1.0);
        let got = shares(&w, &c, 45_000);
        for (g, want) in got.iter().zip([4.0 / 6.0, 1.0 / 6.0, 1.0 / 6.0]) {
            assert!((g - want).abs() < 0.02, "{got:?}");
        }
    }

    #[test]
    fn per_leg_uses_each_policy_for_its_leg() {
        let set =
            EndpointSet::new(eps(2, Role::Prefill).into_iter().chain(
                eps(3, Role::Decode).into_iter().map(|e| {
                    Arc::new(Endpoint::new(&format!("{}0", e.id()), Role::Decode).unwrap())
                }),
            ));
        let _busy = set.by_role(Role::Decode)[0].track();
        let r = PerLeg::new(RoundRobin::new(), LeastInFlight::new());
        with_view(|v| {
            let picks: Vec<_> = (0..4)
                .map(|_| {
                    let route = r.select(v, &set).unwrap();
                    (
                        route.prefill.unwrap().id().clone(),
                        route.decode.id().clone(),
                    )
                })
                .collect();
            assert_eq!(picks[0].0, *set.by_role(Role::Prefill)[0].id());
            assert_eq!(picks[1].0, *set.by_role(Role::Prefill)[1].id());
            assert!(
                picks
                    .iter()
                    .all(|(_, d)| d != set.by_role(Role::Decode)[0].id())
            );
        });
        let empty = EndpointSet::new(eps(1, Role::Prefill));
        with_view(|v| assert!(matches!(r.select(v, &empty), Err(RouteError::NoDecode))));
    }

    /// `p` prefill and `d` decode endpoints, `http://pN:1` and `http://dN:1`.
    fn set(p: usize, d: usize) -> EndpointSet {
        let mut eps = Vec::new();
        for i in 0..p {
            eps.push(Arc::new(
                Endpoint::new(&format!("http://p{i}:1"), Role::Prefill).unwrap(),
            ));
        }
        for i in 0..d {
            eps.push(Arc::new(
                Endpoint::new(&format!("http://d{i}:1"), Role::Decode).unwrap(),
            ));
        }
        EndpointSet::new(eps)
    }

    #[test]
    fn round_robin_cycles_each_role_independently() {
        let s = set(2, 3);
        let rr = PerLeg::both(RoundRobin::new);
        let picks: Vec<(String, String)> = with_view(|v| {
            (0..6)
                .map(|_| {
                    let r = rr.select(v, &s).unwrap();
                    (
                        r.prefill.unwrap().id().to_string(),
                        r.decode.id().to_string(),
                    )
                })
                .collect()
        });
        let p: Vec<_> = picks.iter().map(|x| &x.0[7..9]).collect();
        let d: Vec<_> = picks.iter().map(|x| &x.1[7..9]).collect();
        assert_eq!(p, ["p0", "p1", "p0", "p1", "p0", "p1"]);
        assert_eq!(d, ["d0", "d1", "d2", "d0", "d1", "d2"]);
    }

    #[test]
    fn missing_roles() {
        let rr = PerLeg::both(RoundRobin::new);
        with_view(|v| {
            assert!(matches!(
                rr.select(v, &set(1, 0)),
                Err(RouteError::NoDecode)
            ));
            let r = rr.select(v, &set(0, 1)).unwrap();
            assert!(r.prefill.is_none());
        });
    }

    #[test]
    fn least_in_flight_prefers_idle_endpoints() {
        let s = set(2, 2);
        let _busy_p = s.by_role(Role::Prefill)[0].track();
        let _busy_d1 = s.by_role(Role::Decode)[1].track();
        let _busy_d1b = s.by_role(Role::Decode)[1].track();
        let lif = PerLeg::both(LeastInFlight::new);
        with_view(|v| {
            for _ in 0..4 {
                let r = lif.select(v, &s).unwrap();
                assert_eq!(r.prefill.unwrap().id(), s.by_role(Role::Prefill)[1].id());
                assert_eq!(r.decode.id(), s.by_role(Role::Decode)[0].id());
            }
        });
    }

    #[test]
    fn least_in_flight_spreads_ties() {
        let s = set(1, 3);
        let lif = PerLeg::both(LeastInFlight::new);
        let mut seen = std::collections::HashSet::new();
        with_view(|v| {
            for _ in 0..3 {
                seen.insert(lif.select(v, &s).unwrap().decode.id().clone());
            }
        });
        assert_eq!(seen.len(), 3);
    }
}
