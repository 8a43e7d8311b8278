//! Routing: the [`Router`] trait, the [`Route`] it returns, and [`Pick`], the seam for
//! a policy that picks one leg's endpoint.
//!
//! A router is a synchronous, cheap decision over a snapshot: it reads the request's
//! top level through a [`RequestView`] and the live load carried by each
//! [`Endpoint`], and returns a prefill and a decode endpoint. It does no I/O and never
//! waits.
//!
//! The policies live in `disagg-affinity`: round robin, least in flight, random,
//! weighted random, power of two choices, consistent hashing and prefix-cache-aware
//! picks, combined into a router by its `PerLeg` (one pick per leg). This module keeps
//! the seams they plug into, and the one router the orchestrator needs of its own: a
//! round robin over each role, [`Orchestrator::builder`](crate::Orchestrator::builder)'s
//! default, which is private.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::future::{BoxFuture, Either, Ready, ready};
use http::HeaderMap;
use tokio::time::Instant;

use crate::endpoint::{Endpoint, EndpointSet};
use crate::error::{PdError, RouteError};
use crate::outcome::Outcome;
use crate::policy::Permit;
use crate::request::{Api, PdRequest};
use crate::source::EndpointSource;
use disagg_json::JsonBody;

/// What a router may read of a request.
///
/// Built from a [`PdRequest`] (`RequestView::from(&req)`), or with
/// [`new`](Self::new) (then [`tokens`](Self::tokens) set, when there are some) by
/// routers' tests and applications that route without an orchestrator.
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    /// The API.
    pub api: Api,
    /// The requested model, if named.
    pub model: Option<&'a str>,
    /// The client's headers.
    pub headers: &'a HeaderMap,
    /// The client's body, top level only; values stay raw until a router parses them.
    pub body: &'a JsonBody,
    /// The prompt's token ids, as the engine tokenizes it: present when the
    /// orchestrator was given a [`Tokenizer`](crate::tokens::Tokenizer), the router or the
    /// disaggregation hook asked for tokens ([`Router::wants_tokens`]), and the prompt
    /// could be tokenized. Policies route a request without them as they route one
    /// without cache information.
    pub tokens: Option<&'a [u32]>,
}

impl<'a> RequestView<'a> {
    /// A view of a request for `api` with `headers` and `body`, without token ids.
    pub fn new(
        api: Api,
        model: Option<&'a str>,
        headers: &'a HeaderMap,
        body: &'a JsonBody,
    ) -> Self {
        RequestView {
            api,
            model,
            headers,
            body,
            tokens: None,
        }
    }
}

impl<'a> From<&'a PdRequest> for RequestView<'a> {
    fn from(req: &'a PdRequest) -> Self {
        RequestView {
            api: req.api(),
            model: req.model(),
            headers: req.headers(),
            body: req.body(),
            tokens: req.tokens(),
        }
    }
}

/// Where one request goes.
#[derive(Debug, Clone)]
pub struct Route {
    /// The prefill endpoint; `None` serves the request decode-only (the decode engine
    /// computes the prompt itself), which the orchestrator allows only when configured.
    pub prefill: Option<Arc<Endpoint>>,
    /// The decode endpoint.
    pub decode: Arc<Endpoint>,
    /// The prefill engine's data-parallel rank, when the route names one (by default
    /// the rank of the endpoint, see [`Endpoint::rank`]). Connectors
    /// pass it on as their protocol says (SGLang `data_parallel_rank`, vLLM Mooncake
    /// `X-data-parallel-rank`); `None` lets the engine choose.
    pub prefill_rank: Option<u32>,
    /// The decode engine's data-parallel rank, when the router picked one (SGLang
    /// `data_parallel_rank_decode`).
    pub decode_rank: Option<u32>,
    /// The routing made the request wait in an admission queue that counts the
    /// requests that had to wait (`disagg_resilience`'s `DecodeHold`,
    /// `PerEndpointLimit`); [`new`](Self::new) leaves it `false`. The orchestrator
    /// tells the request's later routings so ([`Ask::queued`](Ask#structfield.queued)):
    /// a retry whose routing waits again is not counted a second time. A routing that
    /// made the request wait and then failed says so in its error instead
    /// ([`PdError::with_queued`]).
    pub queued: bool,
    /// What the router holds for each leg while it runs ([`with_holds`](Self::with_holds)).
    holds: Holds,
}

/// A router's places for the legs of one route: the prefill's is given back when the
/// prefill exchange ends, the decode's when the attempt ends (its response body ended
/// or was dropped, or it failed). A clone of a route holds nothing: the places belong
/// to the attempt that routed, not to copies made for reports.
#[derive(Default)]
struct Holds {
    prefill: Option<Permit>,
    decode: Option<Permit>,
}

impl Clone for Holds {
    fn clone(&self) -> Self {
        Holds::default()
    }
}

impl std::fmt::Debug for Holds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holds")
            .field("prefill", &self.prefill.is_some())
            .field("decode", &self.decode.is_some())
            .finish()
    }
}

impl Route {
    /// A route to `prefill` (or decode-only) and `decode`, naming the data-parallel
    /// rank each endpoint stands for ([`Endpoint::rank`]), if any.
    pub fn new(prefill: Option<Arc<Endpoint>>, decode: Arc<Endpoint>) -> Self {
        Route {
            prefill_rank: prefill.as_ref().and_then(|p| p.rank()),
            decode_rank: decode.rank(),
            prefill,
            decode,
            queued: false,
            holds: Holds::default(),
        }
    }

    /// The same route also holding `prefill` for its prefill leg and `decode` for its
    /// decode leg: a router that counts places per endpoint
    /// (`disagg_resilience::PerEndpointLimit`, `DecodeHold`) gets each back when its leg
    /// ends. The prefill's is dropped when the prefill exchange ends (its answer read, or
    /// the exchange dropped), the decode's when the attempt ends (its response body ended
    /// or was dropped, or it failed). Places the route already holds are kept beside the
    /// new ones, so decorators that each hold their own compose. Clones of the route
    /// hold nothing.
    pub fn with_holds(mut self, prefill: Option<Permit>, decode: Option<Permit>) -> Self {
        fn both(held: Option<Permit>, more: Option<Permit>) -> Option<Permit> {
            match (held, more) {
                (Some(held), Some(more)) => Some(Permit::new((held, more))),
                (held, more) => held.or(more),
            }
        }
        self.holds = Holds {
            prefill: both(self.holds.prefill.take(), prefill),
            decode: both(self.holds.decode.take(), decode),
        };
        self
    }

    /// The prefill leg's place, for the prefill exchange to hold.
    pub(crate) fn take_prefill_hold(&mut self) -> Option<Permit> {
        self.holds.prefill.take()
    }

    /// The decode leg's place, for whatever holds the decode's stream (a migrating
    /// body, which gives it back when that stream is abandoned).
    pub(crate) fn take_decode_hold(&mut self) -> Option<Permit> {
        self.holds.decode.take()
    }

    /// The same route with data-parallel ranks named for each leg.
    pub(crate) fn with_ranks(
        mut self,
        prefill_rank: Option<u32>,
        decode_rank: Option<u32>,
    ) -> Self {
        self.prefill_rank = prefill_rank;
        self.decode_rank = decode_rank;
        self
    }
}

/// Picks the prefill and decode endpoints for one request.
///
/// `select` is called once per request on the request path: it must be synchronous and
/// cheap (no I/O, no blocking, no lock held past its return). Load is read from the
/// endpoints themselves ([`Endpoint::in_flight`]).
///
/// # Errors
///
/// `select` returns [`RouteError::NoDecode`] when there is no decode endpoint to use. When
/// there is no prefill endpoint it should return a [`Route`] with `prefill: None`; the
/// orchestrator then fails the request with 503 or serves it decode-only, as configured.
pub trait Router: Send + Sync + 'static {
    /// Choose the endpoints for `req` from `set`.
    fn select(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError>;

    /// Choose a decode endpoint for `req`, which will be served without a prefill leg
    /// (a [`Disaggregate`](crate::policy::Disaggregate) hook chose not to
    /// disaggregate it). The default calls [`select`](Self::select) and drops the
    /// prefill; override it when picking a prefill endpoint has effects (round-robin
    /// turns, cache-locality records) that an unsent leg should not have.
    ///
    /// # Errors
    ///
    /// As [`select`](Self::select).
    fn select_direct(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        let route = self.select(req, set)?;
        Ok(Route::new(None, route.decode).with_ranks(None, route.decode_rank))
    }

    /// The route for one attempt, waiting when the router must. The orchestrator calls
    /// this, once per attempt; the default selects at once ([`Ask::select`]: `select`,
    /// or `select_direct` for a request served without a prefill leg, over a fresh
    /// snapshot narrowed to the request's model). A decorator that may find no room
    /// (`disagg_resilience::PerEndpointLimit`) waits here, within [`Ask::deadline`](Ask#structfield.deadline), and
    /// routes again; it answers without allocating when it need not wait, unless the
    /// router it wraps routes with a future itself (`disagg_resilience::DecodeHold`
    /// does, always): then it boxes its own routing around that one on every request.
    /// A router whose waits count the requests that had to wait sets [`Route::queued`]
    /// when it made this one wait, and marks its error so ([`PdError::with_queued`])
    /// when it made it wait and then failed. A decorator should route through the
    /// `route` of the router it wraps, not its `select`: a router that waits still
    /// waits when wrapped.
    ///
    /// # Errors
    ///
    /// [`PdError`]: no route (503), or the wait was refused or too long.
    fn route<'a>(&'a self, ask: Ask<'a>) -> Routing<'a> {
        Either::Left(ready(ask.select(self)))
    }

    /// The route of a request an adapter sends to one engine itself rather than
    /// through the orchestrator (generation on a direct route of `disagg-http`: audio,
    /// `/invocations`, whose bodies a router cannot read), and of a mid-stream
    /// migration's continuation (for its decode, and again for its fresh prefill:
    /// `pick` may then choose a prefill endpoint, which the route names in
    /// [`Route::decode`]): no prefill, and as `decode` the engine `pick` chooses over
    /// the endpoints as they stand when it is called. A router that limits the requests per endpoint
    /// (`disagg_resilience::PerEndpointLimit`) waits, within `deadline`, while the
    /// engine picked has no room, picks again after each wait, and gives the route
    /// holding a place ([`Route::with_holds`]) for the adapter to keep until the
    /// answer's last byte; the default picks at once and holds nothing. Decorators
    /// pass it on to the router they wrap.
    ///
    /// # Errors
    ///
    /// `pick`'s, or the wait's (429 `queue_full`, 503 `queue_timeout`).
    fn place<'a>(
        &'a self,
        pick: &'a (dyn Fn() -> Result<Arc<Endpoint>, PdError> + Send + Sync),
        _deadline: Option<Instant>,
    ) -> BoxFuture<'a, Result<Route, PdError>> {
        Box::pin(async move { Ok(Route::new(None, pick()?)) })
    }

    /// [`place`](Self::place) for a request that, when `queued`, already waited in the
    /// admission queue and was counted there (as [`Ask::queued`](Ask#structfield.queued)
    /// says of a routed one): a router whose waits share that queue does not count it
    /// as queued a second time, and says in [`Route::queued`] when it made it wait (in
    /// its error, [`PdError::with_queued`], when it then failed). The orchestrator
    /// calls this for a mid-stream migration's continuation; an adapter that admitted
    /// the request itself may too.
    /// The default calls `place`, and the fact is lost; a router that counts its waits
    /// overrides it (and `place` as `place_queued` with `false`), and decorators pass
    /// it on to the router they wrap. A router must not assume the engine picked is a
    /// decode.
    ///
    /// # Errors
    ///
    /// As [`place`](Self::place).
    fn place_queued<'a>(
        &'a self,
        pick: &'a (dyn Fn() -> Result<Arc<Endpoint>, PdError> + Send + Sync),
        deadline: Option<Instant>,
        _queued: bool,
    ) -> BoxFuture<'a, Result<Route, PdError>> {
        self.place(pick, deadline)
    }

    /// Optional feedback: how an attempt over `route` ended (see [`Outcome`]). A
    /// refusal on the prefill side ([`Outcome::PrefillRefused`]: the prefill's 4xx, or
    /// the connector's own refusal before any leg was sent) or on the decode side
    /// ([`Outcome::DecodeRefused`]: the decode's own 4xx), the request's fault, is
    /// neither a success of the route (no decode answer was delivered) nor a failure of
    /// its engines. The default does nothing.
    fn observe(&self, _route: &Route, _outcome: Outcome) {}

    /// Whether this router reads [`RequestView::tokens`]: the orchestrator tokenizes a
    /// request (with its [`Tokenizer`](crate::tokens::Tokenizer), if it has one) only
    /// when the router or the disaggregation hook says so. Asked once, when the
    /// orchestrator is built. The default: `false`.
    fn wants_tokens(&self) -> bool {
        false
    }
}

impl<T: Router + ?Sized> Router for Arc<T> {
    fn select(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        (**self).select(req, set)
    }

    fn select_direct(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        (**self).select_direct(req, set)
    }

    fn route<'a>(&'a self, ask: Ask<'a>) -> Routing<'a> {
        (**self).route(ask)
    }

    fn place<'a>(
        &'a self,
        pick: &'a (dyn Fn() -> Result<Arc<Endpoint>, PdError> + Send + Sync),
        deadline: Option<Instant>,
    ) -> BoxFuture<'a, Result<Route, PdError>> {
        (**self).place(pick, deadline)
    }

    fn place_queued<'a>(
        &'a self,
        pick: &'a (dyn Fn() -> Result<Arc<Endpoint>, PdError> + Send + Sync),
        deadline: Option<Instant>,
        queued: bool,
    ) -> BoxFuture<'a, Result<Route, PdError>> {
        (**self).place_queued(pick, deadline, queued)
    }

    fn observe(&self, route: &Route, outcome: Outcome) {
        (**self).observe(route, outcome)
    }

    fn wants_tokens(&self) -> bool {
        (**self).wants_tokens()
    }
}

/// What [`Router::route`] returns: a route at once, or a wait for one.
pub type Routing<'a> = Either<Ready<Result<Route, PdError>>, BoxFuture<'a, Result<Route, PdError>>>;

/// One attempt's request for a route ([`Router::route`]): what the router may read of
/// the request, where the endpoints come from, and how long it may wait.
#[derive(Clone, Copy)]
#[non_exhaustive]
pub struct Ask<'a> {
    /// What the router may read of the request.
    pub view: &'a RequestView<'a>,
    /// Where the endpoints come from: a router that waits on the state of the
    /// endpoints rather than on its own choice takes a fresh snapshot of it (every
    /// model's: narrow it with [`EndpointSet::for_model`] and the view's model).
    pub source: &'a dyn EndpointSource,
    /// Whether the request is served by a decode endpoint alone.
    pub direct: bool,
    /// When a wait for room must end: the request's deadline, if it has one.
    pub deadline: Option<Instant>,
    /// Whether the request already waited in the admission queue before this routing
    /// (the orchestrator's [`Admission::admit`](crate::policy::Admission::admit), once
    /// `try_admit` gave nothing, or an earlier routing of it that said so in
    /// [`Route::queued`], or in its error: [`PdError::with_queued`]), and was counted
    /// there: a router whose waits share that queue (`disagg_resilience`'s
    /// `DecodeHold`, `PerEndpointLimit`) does not count it as queued a second time.
    /// The orchestrator sets it on every routing of such a request, its retries
    /// included ([`with_queued`](Self::with_queued)); [`new`](Self::new) leaves it
    /// `false`.
    pub queued: bool,
}

impl std::fmt::Debug for Ask<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ask")
            .field("view", self.view)
            .field("direct", &self.direct)
            .field("deadline", &self.deadline)
            .field("queued", &self.queued)
            .finish_non_exhaustive()
    }
}

impl<'a> Ask<'a> {
    /// An ask for `view` over `source`'s endpoints; `direct` when the request is served
    /// by a decode endpoint alone; a wait must end by `deadline`. The orchestrator makes
    /// one per attempt; routers' tests and applications that route without an
    /// orchestrator make their own.
    pub fn new(
        view: &'a RequestView<'a>,
        source: &'a dyn EndpointSource,
        direct: bool,
        deadline: Option<Instant>,
    ) -> Self {
        Ask {
            view,
            source,
            direct,
            deadline,
            queued: false,
        }
    }

    /// The same ask, saying whether the request already waited in the admission queue
    /// ([`queued`](Self#structfield.queued)).
    #[must_use]
    pub fn with_queued(mut self, queued: bool) -> Self {
        self.queued = queued;
        self
    }

    /// `router`'s choice over a fresh snapshot of the endpoints, narrowed to the
    /// request's model: [`Router::select`], or [`Router::select_direct`] for a request
    /// served without a prefill leg.
    ///
    /// # Errors
    ///
    /// [`PdError`] for a [`RouteError`] (503).
    pub fn select<R: Router + ?Sized>(&self, router: &R) -> Result<Route, PdError> {
        let set = self.source.snapshot();
        set.for_model(self.view.model)
            .and_then(|candidates| match self.direct {
                false => router.select(self.view, candidates),
                true => router.select_direct(self.view, candidates),
            })
            .map_err(PdError::from)
    }
}

/// Picks one endpoint of a leg among candidates: the seam of per-leg policies.
///
/// Synchronous and cheap, like [`Router::select`]: no I/O, no lock held past its return.
/// `candidates` is never empty; the result must be an index into it. The
/// implementations are in `disagg-affinity` (`RoundRobin`, `LeastInFlight`, `Random`,
/// `WeightedRandom`, `PowerOfTwo`, `ConsistentHash`, `CacheAware`), and its `PerLeg`
/// makes a [`Router`] of one pick per leg; `disagg-http`'s sidecar layer takes one for
/// requests that name no prefill endpoint.
pub trait Pick: Send + Sync + 'static {
    /// The index of the chosen candidate.
    fn pick(&self, req: &RequestView<'_>, candidates: &[Arc<Endpoint>]) -> usize;

    /// Whether this policy reads [`RequestView::tokens`] (see
    /// [`Router::wants_tokens`]). The default: `false`.
    fn wants_tokens(&self) -> bool {
        false
    }
}

impl<T: Pick + ?Sized> Pick for Arc<T> {
    fn pick(&self, req: &RequestView<'_>, candidates: &[Arc<Endpoint>]) -> usize {
        (**self).pick(req, candidates)
    }

    fn wants_tokens(&self) -> bool {
        (**self).wants_tokens()
    }
}

impl<T: Pick + ?Sized> Pick for Box<T> {
    fn pick(&self, req: &RequestView<'_>, candidates: &[Arc<Endpoint>]) -> usize {
        (**self).pick(req, candidates)
    }

    fn wants_tokens(&self) -> bool {
        (**self).wants_tokens()
    }
}

/// [`Orchestrator::builder`](crate::Orchestrator::builder)'s default router:
/// independent round robin over the prefill and the decode endpoints, so that an
/// orchestrator works with no routing policy chosen. It is private on purpose; the
/// routing policies an application chooses from are `disagg-affinity`'s (this one is
/// `disagg_affinity::PerLeg::both(disagg_affinity::RoundRobin::new)` there).
#[derive(Debug, Default)]
pub(crate) struct DefaultRouter {
    prefill: AtomicUsize,
    decode: AtomicUsize,
}

impl DefaultRouter {
    /// The next endpoint of `eps` in `turn`'s order; `None` when `eps` is empty.
    fn next(turn: &AtomicUsize, eps: &[Arc<Endpoint>]) -> Option<Arc<Endpoint>> {
        match eps {
            [] => None,
            eps => Some(Arc::clone(
                &eps[turn.fetch_add(1, Ordering::Relaxed) % eps.len()],
            )),
        }
    }

    fn decode(&self, set: &EndpointSet) -> Result<Arc<Endpoint>, RouteError> {
        Self::next(&self.decode, set.decode()).ok_or(RouteError::NoDecode)
    }
}

impl Router for DefaultRouter {
    fn select(&self, _req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        let decode = self.decode(set)?;
        Ok(Route::new(Self::next(&self.prefill, set.prefill()), decode))
    }

    /// The decode's turn alone: a leg that is not sent takes no prefill turn.
    fn select_direct(
        &self,
        _req: &RequestView<'_>,
        set: &EndpointSet,
    ) -> Result<Route, RouteError> {
        Ok(Route::new(None, self.decode(set)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Role;

    #[test]
    fn holds_added_to_a_route_keep_the_ones_it_had_until_their_leg_ends() {
        struct Place(Arc<std::sync::atomic::AtomicUsize>);
        impl Drop for Place {
            fn drop(&mut self) {
                self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let freed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let place = || Some(Permit::new(Place(Arc::clone(&freed))));
        let decode = Arc::new(Endpoint::new("http://d:1", Role::Decode).unwrap());
        // Two decorators, each holding its own places.
        let mut route = Route::new(None, decode)
            .with_holds(place(), place())
            .with_holds(None, place());
        assert_eq!(freed.load(std::sync::atomic::Ordering::Relaxed), 0);
        drop(route.take_prefill_hold());
        assert_eq!(freed.load(std::sync::atomic::Ordering::Relaxed), 1);
        drop(route);
        assert_eq!(freed.load(std::sync::atomic::Ordering::Relaxed), 3);
    }

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

    fn view<'a>(h: &'a HeaderMap, b: &'a JsonBody) -> RequestView<'a> {
        RequestView::new(Api::Chat, None, h, b)
    }

    #[test]
    fn round_robin_cycles_each_role_independently() {
        let s = set(2, 3);
        let (h, b) = (HeaderMap::new(), JsonBody::default());
        let rr = DefaultRouter::default();
        let picks: Vec<(String, String)> = (0..6)
            .map(|_| {
                let r = rr.select(&view(&h, &b), &s).unwrap();
                (
                    r.prefill.unwrap().id().to_string(),
                    r.decode.id().to_string(),
                )
            })
            .collect();
        let p: Vec<_> = picks.iter().map(|x| &x.0[7..9]).collect();
        let d: Vec<_> = picks.iter().map(|x| &x.1[7..9]).collect();
        assert_eq!(p, ["p0", "p1", "p0", "p1", "p0", "p1"]);
        assert_eq!(d, ["d0", "d1", "d2", "d0", "d1", "d2"]);
    }

    #[test]
    fn missing_roles() {
        let (h, b) = (HeaderMap::new(), JsonBody::default());
        assert!(matches!(
            DefaultRouter::default().select(&view(&h, &b), &set(1, 0)),
            Err(RouteError::NoDecode)
        ));
        let r = DefaultRouter::default()
            .select(&view(&h, &b), &set(0, 1))
            .unwrap();
        assert!(r.prefill.is_none());
    }

    #[test]
    fn a_direct_request_takes_no_prefill_turn() {
        let s = set(2, 2);
        let (h, b) = (HeaderMap::new(), JsonBody::default());
        let rr = DefaultRouter::default();
        let first = rr.select(&view(&h, &b), &s).unwrap();
        let direct = rr.select_direct(&view(&h, &b), &s).unwrap();
        assert!(direct.prefill.is_none());
        assert_eq!(direct.decode.id(), s.decode()[1].id());
        let next = rr.select(&view(&h, &b), &s).unwrap();
        assert_eq!(first.prefill.unwrap().id(), s.prefill()[0].id());
        assert_eq!(next.prefill.unwrap().id(), s.prefill()[1].id());
        assert_eq!(next.decode.id(), s.decode()[0].id());
    }
}
