//! Admission: how many requests run at once, and what happens to the rest.
//!
//! Two limits, both off by default:
//!
//! - a **global** in-flight limit: a request past it waits in a FIFO queue (a fair
//!   semaphore: permits go to waiters in arrival order) until one of the running
//!   requests ends — its response body finished or dropped;
//! - a **per-endpoint** in-flight limit, a [`Router`] decorator
//!   ([`PerEndpointLimit`], made by [`Limits::per_endpoint`]): when the route its
//!   router chose has an endpoint at its limit, the request waits in the same queue
//!   until a leg that held a place ends (a prefill exchange, or an attempt), then
//!   routes again (so it may go elsewhere). The route it gives holds a place per leg
//!   ([`Route::with_holds`]), given back when that leg ends. An endpoint's count is
//!   the larger of its in-flight count and the places handed out on it (a request
//!   counts from its routing, before its legs are sent), and the room is checked and
//!   taken under one lock. These waiters are woken together and race for the freed
//!   room, so their order is close to, but not strictly, FIFO. A place taken and given
//!   back within another request's look (a route that a limit around a limit found no
//!   room for) wakes them too, but frees no room a leg held: a waiter it woke looks
//!   again 10 ms later, not at once, and such places wake a waiter once at most
//!   between two of its looks. A leg that ends during a look (its route dropped by a
//!   permit of the route the look gives back) still counts as a leg's end. A waiting
//!   request holds no place meanwhile: a route it finds no room for is given back,
//!   with the places the routers inside it took for that route, before the request
//!   waits (a place on a decode with room is not kept from others while the request
//!   waits for its prefill's; a held request's turn in a decode hold's line is, see
//!   below). Around a router that holds places of its own (another limit, a hold),
//!   its route keeps theirs beside its own until each leg ends, for a routed request
//!   and for a request placed on one engine ([`Router::place`]) alike.
//!
//! - a **decode hold** ([`DecodeHold`], made by [`Limits::decode_hold`]): while every
//!   decode endpoint of a request's model is saturated (its
//!   [`Endpoint::load`](disagg_core::endpoint::Endpoint::load) at or above a limit
//!   of running requests, the engines' own count when the proxy reads their
//!   `/metrics` for it, and never less than the requests this hold routed there that
//!   have not ended), the request waits in the same queue, for at most its own
//!   wait, before any leg is sent: its prefill is not run for a decode that cannot
//!   take its KV, which would otherwise sit on the prefill until it expires. Held
//!   requests get room oldest first, each model's behind its own model's only: a
//!   model with an idle decode is not held behind another's line. A held request it
//!   lets go keeps its turn while the router it wraps makes it wait (for its
//!   prefill's per-endpoint place, say), so that room still goes in order of
//!   arrival; its place on the decode is taken only once that router gave its route.
//!
//! The queue is bounded: a request that finds it full is refused at once with 429
//! `queue_full` and a `retry-after` header, and one that waits longer than the queue
//! timeout (or past its deadline) gets 503 `queue_timeout`. Both are OpenAI-format
//! errors. No request is dropped silently, and a waiting request that its client
//! abandons leaves the queue at once, giving back everything it took there. A request
//! takes one place in the queue however many of these waits its routing passes
//! through (held, then waiting for a per-endpoint place, or the reverse), whichever of
//! the two decorators wraps the other: it is counted once, and a queue full of others
//! does not refuse it once it waits.
//!
//! Those waits also end together: each ends at the earliest end any of them set (a
//! wait's start plus its timeout — the hold's own wait for a held request, the queue
//! timeout for one waiting for a per-endpoint place — or the request's deadline). A
//! routing thus waits at most its first wait's timeout in all, and one that runs out
//! gets the same 503 `queue_timeout`, its wait counted from that first wait's start.
//!
//! The wait for a global permit comes before the routing and keeps its own timeout
//! (the request's deadline bounds both). A request admitted after that wait is
//! counted in `queued` by it: a wait of its routing afterwards takes a place in the
//! queue again (counted in `waiting`, refused with 429 when the queue is full) but
//! does not count it in `queued` a second time. The routing learns of that wait from
//! its caller, which made it: the orchestrator says so in [`Ask::queued`] on every
//! routing of the request (its retries included) and to
//! [`Router::place_queued`] for a mid-stream migration's continuation. A routing that
//! made the request wait says so in the route it gives ([`Route::queued`]), or, when
//! it then failed (no prefill or no decode once it had room, its wait ran out), in
//! its error ([`PdError::with_queued`]); the orchestrator tells the request's later
//! routings (a retry's, a decode-only fallback's, a continuation's next place) in the
//! same way: a request is counted in `queued` once over its life. A
//! caller that does not (an adapter calling [`Router::place`], an application building
//! its own [`Ask`]) has such a request counted in `queued` again when its routing
//! waits; no wait, refusal or timeout depends on it.

mod hold;

pub use hold::DecodeHold;
use hold::{Kept, Routed};

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::Poll;
use std::time::Duration;

use disagg_core::endpoint::Role;
use disagg_core::endpoint::{Endpoint, EndpointId, EndpointSet};
use disagg_core::error::{Overload, PdError, RouteError};
use disagg_core::outcome::Outcome;
use disagg_core::policy::{Admission, AdmissionStats, Permit};
use disagg_core::router::{Ask, RequestView, Route, Router, Routing};
use futures::future::{BoxFuture, Either, ready};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// Admission settings.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AdmissionConfig {
    /// Requests served at once by the orchestrator, all endpoints together (default
    /// `None`: no limit).
    pub max_in_flight: Option<usize>,
    /// Requests that may wait for admission; one more is refused with 429 (default
    /// 1024).
    pub max_queue: usize,
    /// Longest wait in the queue before 503 `queue_timeout` (default 10 s). A request's
    /// deadline, when shorter, bounds the wait too. A routing's waits (for a
    /// per-endpoint place, in a decode hold) end at the earliest end any of them set:
    /// one request waits one timeout, the first wait's, across them (see the
    /// [module](self) docs).
    pub queue_timeout: Duration,
    /// The `retry-after` a refused client is given (default 1 s).
    pub retry_after: Duration,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            max_in_flight: None,
            max_queue: 1024,
            queue_timeout: Duration::from_secs(10),
            retry_after: Duration::from_secs(1),
        }
    }
}

/// The admission of one orchestrator (and of the orchestrators made from it with
/// `with_transport`, which share it): [`AdmissionConfig`]'s limits and queue behind the
/// [`Admission`] seam.
#[derive(Debug, Clone)]
pub struct Limits {
    state: Arc<State>,
}

#[derive(Debug)]
struct State {
    config: AdmissionConfig,
    global: Option<Arc<Semaphore>>,
    /// Requests waiting, for either limit.
    waiting: AtomicUsize,
    /// Rung when a per-endpoint place is given back at a leg's end, for waiters on a
    /// per-endpoint limit.
    ended: Notify,
    /// The per-endpoint places given back at a leg's end so far (not by a look: see
    /// `returns`), counted before `ended` is rung: a waiter that listens only after
    /// giving back the places of a route it found no room for learns from it whether
    /// a leg ended meanwhile (then it looks again at once).
    ends: AtomicU64,
    /// Rung when a per-endpoint place is given back by a look (see `returns`).
    returned: Notify,
    /// The per-endpoint places given back by a routing under way so far: those of a
    /// route that a limit (or a hold) found no room for, taken and given back within
    /// one look. Counted before `returned` is rung: another request's look may have
    /// found such a place taken. They free no room that a leg held, though: a waiter
    /// woken by them alone, or that saw another request's during its look, looks
    /// again once [`RETURN_POLL`] has passed, not at once; two waiters would
    /// otherwise wake each other without end, each look giving back a place that
    /// woke the other. A waiter listens for them only while no look of its own is
    /// due: woken by them at most once a look, not by each of every other waiter's
    /// looks.
    returns: AtomicU64,
    queue_full: AtomicU64,
    queue_timeouts: AtomicU64,
    queued: AtomicU64,
}

/// A request's place among the running ones, inside its [`Permit`].
struct Place {
    _global: Option<OwnedSemaphorePermit>,
}

/// A leg's place under the per-endpoint limit, inside the [`Permit`] its route holds:
/// when the leg ends, its endpoint's count of places goes down, then requests waiting
/// for room route again (in that order: a woken request finds the room).
struct LegPlace {
    state: Arc<State>,
    places: Arc<Places>,
    endpoint: PlaceKey,
    /// The [`Queued::id`] of the routing of this admission that made it (0 when
    /// made outside any).
    routing: u64,
}

impl Drop for LegPlace {
    fn drop(&mut self) {
        give_back(&mut crate::lock(&self.places.0), &self.endpoint);
        // Dropped while a routing of this admission is polled: taken and given back
        // by it when it made the place (a route that a limit or a hold found no room
        // for), which is no reason for the request to look again; otherwise a leg's
        // end (another request's route, dropped by something the routing dropped).
        let own = QUEUED
            .try_with(|q| {
                q.is_in(&self.state).then(|| {
                    let own = q.id == self.routing;
                    if own {
                        q.given_back.fetch_add(1, Ordering::SeqCst);
                    }
                    own
                })
            })
            .ok()
            .flatten();
        // Outside a routing: given back by a limit that found no room for a route
        // made outside one too (a new request's first look), or a leg's end.
        let returned = own.unwrap_or_else(|| self.routing == 0 && GIVING_BACK.get());
        let (counted, rung) = if returned {
            (&self.state.returns, &self.state.returned)
        } else {
            (&self.state.ends, &self.state.ended)
        };
        counted.fetch_add(1, Ordering::SeqCst);
        rung.notify_waiters();
    }
}

std::thread_local! {
    /// Whether this thread is giving back a route that a [`PerEndpointLimit`] found
    /// no room for ([`give_back_route`]): the places in it, which the routers inside
    /// the limit took for that look, are counted in [`State::returns`], not as ends.
    static GIVING_BACK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Gives back `route`, which a limit found no room for: its places (taken for this
/// look by the routers the limit wraps) count as given back by a look.
fn give_back_route(route: Route) {
    /// Puts back what [`GIVING_BACK`] was, when dropped.
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            GIVING_BACK.set(self.0);
        }
    }
    let _reset = Reset(GIVING_BACK.replace(true));
    drop(route);
}

/// An endpoint in [`Places`]: its role and id (an engine serving both roles is two
/// endpoints, each with its own in-flight count and limit).
type PlaceKey = (Role, EndpointId);

/// The places a [`PerEndpointLimit`] handed out per endpoint and not yet given back,
/// counted from a request's routing to the end of its leg. An endpoint's in-flight
/// count takes a leg only once it is sent (a decode's after the prefill and the
/// handoff): without this, requests routed before their legs run would be invisible to
/// the limit and would all pass it. An endpoint's entry leaves with its last place.
#[derive(Debug, Default)]
struct Places(std::sync::Mutex<HashMap<PlaceKey, usize>>);

/// One more place taken on `endpoint`, in a count of places per endpoint (this limit's
/// [`Places`], the decode hold's [`Counts::places`]).
fn take<K: std::hash::Hash + Eq>(places: &mut HashMap<K, usize>, endpoint: K) {
    *places.entry(endpoint).or_insert(0) += 1;
}

/// One place on `endpoint` given back; its entry leaves with its last place, so the
/// count holds only endpoints with places out.
fn give_back<K: std::hash::Hash + Eq>(places: &mut HashMap<K, usize>, endpoint: &K) {
    if let Some(n) = places.get_mut(endpoint) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            places.remove(endpoint);
        }
    }
}

/// Counts a request waiting for a global permit as waiting while it lives (a
/// routing's waits are counted by its [`Queued`]).
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

tokio::task_local! {
    /// The place in the queue of the request a [`DecodeHold`] or a waiting
    /// [`PerEndpointLimit`] is routing, while its routing runs: the routers it wraps
    /// find it there when they route (a future reads it when first polled), so a
    /// request is counted once however many of this admission's waits it passes
    /// through, in whichever order they wrap each other. A hold that finds it there
    /// keeps its ticket in it when it lets the request go ([`Kept`]): the router
    /// wrapping it may route the request through it again.
    static QUEUED: Arc<Queued>;
}

/// One request's place in an admission's queue across the routers that wrap each
/// other, for one routing: the first of them that makes it wait counts it (and
/// refuses it with 429 when the queue is full); the others find it counted. Given
/// back when the routing ends (the request is routed or refused), or is abandoned.
///
/// It also keeps when the routing's waits must end ([`Bound`]): each wait ends at the
/// earliest end any of them set, so that the request waits at most one timeout in all
/// (the first wait's), however many of these waits it passes through.
///
/// A decode hold (or a per-endpoint limit that waits) passes it to the router it wraps
/// in [`QUEUED`] rather than through the [`Router`] seam: [`Ask`] is the
/// orchestrator's, and a place in this crate's queue means nothing to any other
/// router.
#[derive(Debug)]
struct Queued {
    state: Arc<State>,
    /// A number no other routing's place has had, never 0 ([`routing_id`]): the
    /// per-endpoint places made during this routing carry it ([`LegPlace`]), so that
    /// the routing tells those it gives back from legs that end while it is polled.
    id: u64,
    counted: AtomicBool,
    /// The routing's waits so far, merged; `None` before the first.
    bound: std::sync::Mutex<Option<Bound>>,
    /// The request's tickets in the lines of the holds that let it go, one per hold,
    /// while a router of this admission wrapping them may route it through them again
    /// (a per-endpoint limit with no room, an outer hold); each leaves its line when
    /// its hold takes it back, when another hold holds the request, or when the
    /// routing ends.
    kept: std::sync::Mutex<Vec<Kept>>,
    /// The per-endpoint places of this admission that the routing gave back while it
    /// was polled: those of routes a limit found no room for (see [`State::returns`]).
    given_back: AtomicU64,
}

/// When a wait started and when it must end (its timeout from its start, or the
/// request's deadline, whichever comes first).
#[derive(Debug, Clone, Copy)]
struct Bound {
    since: Instant,
    until: Instant,
}

impl Bound {
    /// A wait from `since`, for `timeout` at most, within `deadline`.
    fn new(since: Instant, timeout: Duration, deadline: Option<Instant>) -> Bound {
        let by_timeout = crate::after(since, timeout);
        Bound {
            since,
            until: deadline.map_or(by_timeout, |d| d.min(by_timeout)),
        }
    }

    /// The two waits of one routing as one: from the first's start to the earliest
    /// end.
    fn and(self, other: Bound) -> Bound {
        Bound {
            since: self.since.min(other.since),
            until: self.until.min(other.until),
        }
    }
}

/// A number for a routing's place in a queue that no other has had in this process,
/// never 0 (a place made outside any routing): each thread takes its numbers from a
/// block of its own, so that a routing costs no atomic operation (one a block).
fn routing_id() -> u64 {
    const BLOCK: u64 = 1 << 20;
    /// The first number of the next block.
    static NEXT_BLOCK: AtomicU64 = AtomicU64::new(1);
    std::thread_local! {
        /// This thread's next number, and the end of its block.
        static NEXT: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
    }
    NEXT.with(|next| {
        let (mut id, mut end) = next.get();
        if id == end {
            // 2^44 blocks: never used up.
            id = NEXT_BLOCK.fetch_add(BLOCK, Ordering::Relaxed);
            end = id.wrapping_add(BLOCK);
        }
        next.set((id.wrapping_add(1), end));
        id
    })
}

impl Queued {
    /// The place of the routing under way in `state`'s queue (when a hold, or a
    /// per-endpoint limit that waits, wrapping this router routes the request), or a
    /// new one; `true` when new (no router of this admission wraps this one): the
    /// routing that made it gives it back when it ends (one wrapped in it, whose
    /// routing ends first, does not).
    fn for_routing(state: &Arc<State>) -> (Arc<Queued>, bool) {
        let under_way = QUEUED
            .try_with(|q| q.is_in(state).then(|| Arc::clone(q)))
            .ok()
            .flatten();
        match under_way {
            Some(q) => (q, false),
            None => {
                let q = Queued {
                    state: Arc::clone(state),
                    id: routing_id(),
                    counted: AtomicBool::new(false),
                    bound: std::sync::Mutex::new(None),
                    kept: std::sync::Mutex::new(Vec::new()),
                    given_back: AtomicU64::new(0),
                };
                (Arc::new(q), true)
            }
        }
    }

    /// Whether this is a place in `state`'s queue.
    fn is_in(&self, state: &State) -> bool {
        std::ptr::eq(Arc::as_ptr(&self.state), state)
    }

    /// The request counted in the queue, if it was not yet (429 when the queue is
    /// full; in `queued` unless it already `queued` for admission), for a wait `wait`:
    /// the bound of the routing's waits, this one's with those before it.
    fn enqueue(&self, wait: Bound, queued: bool) -> Result<Bound, PdError> {
        if !self.counted.load(Ordering::Relaxed) {
            self.state.count(!queued)?;
            self.counted.store(true, Ordering::Relaxed);
        }
        let mut bound = crate::lock(&self.bound);
        let merged = bound.map_or(wait, |b| b.and(wait));
        *bound = Some(merged);
        Ok(merged)
    }

    /// Keeps `kept`, a hold's ticket for the request, beside those of other holds;
    /// unless one of the same hold is kept already (the older place: `kept` then
    /// leaves its line).
    fn keep(&self, kept: Kept) {
        let mut slot = crate::lock(&self.kept);
        if slot.iter().any(|k| k.same_hold(&kept)) {
            drop(slot);
            drop(kept);
            return;
        }
        slot.push(kept);
    }

    /// The ticket kept for the request by the hold whose lines are `routed`'s, if any.
    fn take_kept(&self, routed: &Arc<Routed>) -> Option<Kept> {
        let mut slot = crate::lock(&self.kept);
        let at = slot.iter().position(|k| k.is_of(routed))?;
        Some(slot.swap_remove(at))
    }

    /// The tickets kept for the request leave their lines (outside the lock: each
    /// takes its hold's).
    fn drop_kept(&self) {
        let kept = std::mem::take(&mut *crate::lock(&self.kept));
        drop(kept);
    }

    /// The request no longer counted as waiting (routed, or refused), if it was:
    /// `true` then (the routing made it wait, and it was counted as queued, now or
    /// before it).
    fn leave(&self) -> bool {
        let counted = self.counted.swap(false, Ordering::Relaxed);
        if counted {
            self.state.waiting.fetch_sub(1, Ordering::Relaxed);
        }
        counted
    }

    /// `routed`, the end of the routing that made this place: an error says whether
    /// the routing made the request wait ([`PdError::with_queued`]), as a route does
    /// ([`Route::queued`]): held, or waiting for a per-endpoint place, then no route
    /// (no prefill, no decode) or no room in time. The request is no longer counted as
    /// waiting.
    fn end(&self, routed: Result<Route, PdError>) -> Result<Route, PdError> {
        let waited = self.leave();
        routed.map_err(|e| e.with_queued(waited))
    }
}

impl Drop for Queued {
    // A routing abandoned while it waits.
    fn drop(&mut self) {
        self.leave();
    }
}

impl Limits {
    /// The limits and queue of `config`.
    pub fn new(config: AdmissionConfig) -> Self {
        Limits {
            state: Arc::new(State {
                global: config.max_in_flight.map(|n| Arc::new(Semaphore::new(n))),
                config,
                waiting: AtomicUsize::new(0),
                ended: Notify::new(),
                ends: AtomicU64::new(0),
                returned: Notify::new(),
                returns: AtomicU64::new(0),
                queue_full: AtomicU64::new(0),
                queue_timeouts: AtomicU64::new(0),
                queued: AtomicU64::new(0),
            }),
        }
    }

    /// The settings.
    pub fn config(&self) -> &AdmissionConfig {
        &self.state.config
    }

    /// `router`, with at most `limit` requests in flight on one endpoint (a prefill
    /// endpoint counts its prefill exchanges, a decode endpoint its streams): its routes
    /// go only to endpoints below the limit, waiting in this admission's queue (and
    /// counted in its stats) while the chosen route has none.
    ///
    /// This decorator is the only way to limit an endpoint: the limit is its argument,
    /// not a setting of [`AdmissionConfig`] that a router left undecorated would
    /// silently ignore.
    ///
    /// It routes through `router`'s [`route`](Router::route), so `router` may wait
    /// too: a [`DecodeHold`] inside it still holds, and works as it does around it
    /// (one place in the queue, one timeout for the routing's waits, and a request the
    /// hold lets go keeps its place in the hold's line while this limit has no room
    /// for it). That order costs an allocation per request more ([`PerEndpointLimit`]).
    ///
    /// ```compile_fail
    /// # use disagg_resilience::AdmissionConfig;
    /// let mut config = AdmissionConfig::default();
    /// config.max_in_flight_per_endpoint = Some(1); // no such knob: wrap the router
    /// ```
    pub fn per_endpoint<R: Router>(&self, router: R, limit: usize) -> PerEndpointLimit<R> {
        PerEndpointLimit {
            inner: router,
            state: Arc::clone(&self.state),
            limit,
            places: Arc::default(),
        }
    }

    /// `router`, holding each request while every decode endpoint of its model has a
    /// [load](disagg_core::endpoint::Endpoint::load) of `max_running` or more: it waits
    /// in this admission's queue (429 when full), looking again every
    /// [`HOLD_POLL`], until a decode has room (then `router` routes it), or for `wait`
    /// at most (or past its deadline): then 503 `queue_timeout`.
    ///
    /// `wait` counts from the start of the request's routing and bounds the whole of
    /// it: a held request that `router` then makes wait for a per-endpoint place
    /// waits no later than `wait` from that start; one `router` made wait first is held
    /// no later than the end of that wait (the queue timeout from its start).
    pub fn decode_hold<R: Router>(
        &self,
        router: R,
        max_running: usize,
        wait: Duration,
    ) -> DecodeHold<R> {
        DecodeHold {
            inner: router,
            state: Arc::clone(&self.state),
            max_running,
            wait,
            routed: Arc::default(),
        }
    }
}

/// How often a request held by [`DecodeHold`] looks at the decodes again: the engines'
/// counts change at each read of their `/metrics`, this proxy's at each request's end.
pub const HOLD_POLL: Duration = Duration::from_millis(10);

/// How soon a request waiting for a per-endpoint place looks again after a place
/// that another request's look took and gave back at once (see [`State::returns`]).
const RETURN_POLL: Duration = Duration::from_millis(10);

/// What woke a request waiting for a per-endpoint place.
enum Heard {
    /// A place given back at a leg's end ([`State::ended`]).
    End,
    /// A place given back by a look ([`State::returned`]).
    Return,
}

impl State {
    /// One more request counted as waiting, and in `queued` when `first` (its first
    /// wait); none and 429 when the queue is full.
    fn count(&self, first: bool) -> Result<(), PdError> {
        let before = self.waiting.fetch_add(1, Ordering::Relaxed);
        if before >= self.config.max_queue {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            self.queue_full.fetch_add(1, Ordering::Relaxed);
            return Err(PdError::from(Overload::QueueFull {
                retry_after: self.config.retry_after,
            }));
        }
        if first {
            self.queued.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// A wait in this queue from `since`: for the queue timeout, within `deadline`.
    fn wait(&self, since: Instant, deadline: Option<Instant>) -> Bound {
        Bound::new(since, self.config.queue_timeout, deadline)
    }

    fn timed_out(&self, since: Instant) -> PdError {
        self.queue_timeouts.fetch_add(1, Ordering::Relaxed);
        PdError::from(Overload::QueueTimeout {
            waited: since.elapsed(),
        })
    }

    fn permit(global: Option<OwnedSemaphorePermit>) -> Permit {
        Permit::new(Place { _global: global })
    }
}

impl Admission for Limits {
    fn try_admit(&self) -> Option<Permit> {
        let global = match &self.state.global {
            None => None,
            Some(sem) => Some(Arc::clone(sem).try_acquire_owned().ok()?),
        };
        Some(State::permit(global))
    }

    /// Wait in the queue for the global limit.
    fn admit(&self, deadline: Option<Instant>) -> BoxFuture<'static, Result<Permit, PdError>> {
        let state = Arc::clone(&self.state);
        Box::pin(async move {
            let Some(sem) = &state.global else {
                return Ok(State::permit(None));
            };
            if let Ok(p) = Arc::clone(sem).try_acquire_owned() {
                // A place freed since `try_admit` found none: the orchestrator still
                // tells its routing it was queued (`Ask::queued`), so that routing's
                // waits do not count it; it is counted here, once.
                state.queued.fetch_add(1, Ordering::Relaxed);
                return Ok(State::permit(Some(p)));
            }
            // The request's first wait: counted in `queued`.
            state.count(true)?;
            let _waiting = Waiting(&state.waiting);
            let Bound { since, until } = state.wait(Instant::now(), deadline);
            match tokio::time::timeout_at(until, Arc::clone(sem).acquire_owned()).await {
                // Its routing's waits do not count it again: the orchestrator tells
                // them it waited here (`Ask::queued`).
                Ok(Ok(p)) => Ok(State::permit(Some(p))),
                // Closed never happens: the semaphore is never closed.
                Ok(Err(_)) | Err(_) => Err(state.timed_out(since)),
            }
        })
    }

    fn stats(&self) -> AdmissionStats {
        let s = &self.state;
        let mut stats = AdmissionStats::default();
        stats.waiting = s.waiting.load(Ordering::Relaxed) as u64;
        stats.queued = s.queued.load(Ordering::Relaxed);
        stats.queue_full = s.queue_full.load(Ordering::Relaxed);
        stats.queue_timeouts = s.queue_timeouts.load(Ordering::Relaxed);
        stats
    }
}

/// A [`Router`] whose routes go only to endpoints below its limit of requests in
/// flight, made by [`Limits::per_endpoint`].
///
/// When the route its router chose (through the router's own
/// [`route`](Router::route), which may wait: a [`DecodeHold`] inside this limit holds)
/// has an endpoint at the limit, [`route`](Router::route) waits in the [`Limits`]'
/// queue (429 when full, 503 past the queue timeout or the request's deadline) until
/// a leg that held a place ends, and routes again; the route it then gives says it
/// waited ([`Route::queued`]). With a [`DecodeHold`] of the same queue, around this
/// limit or inside it, that held the request first, the wait also ends when the
/// hold's would have (the first wait's end bounds the routing's). An
/// endpoint's count is the larger of its own in-flight count (a prefill endpoint's
/// prefill exchanges, a decode endpoint's streams) and the places this limit handed
/// out on it that were not given back: a request counts from its routing, before its
/// legs are sent. The room is checked and the places taken under one lock, so requests
/// routed at the same time cannot all take the same free place. Each route it gives
/// holds a place per leg ([`Route::with_holds`]): the prefill's ends with the prefill
/// exchange, the decode's with the attempt.
///
/// The router it wraps may hold places of its own (another limit, a [`DecodeHold`]):
/// the route this limit gives keeps them beside its own ([`Route::with_holds`]), and
/// a route it finds no room for is given back, with them, before the request waits.
/// A request placed on one engine ([`Router::place`]: an adapter's, a mid-stream
/// migration's decode or fresh prefill) is placed by the router it wraps first, then
/// given a place under this limit the same way.
///
/// Cost per request with room: one short lock, a hash lookup per leg, an entry made
/// for an endpoint that had no place (an endpoint's entry leaves with its last place)
/// and its two places; one short lock when each leg ends. A request placed on one
/// engine costs three small allocations more: its placing, boxed here; its place in
/// the queue (unless a router of the same queue wrapping this limit made it); and the
/// placing of the router it wraps, which that router boxes (again at each look, for a
/// request that waits). Around a router whose
/// routing is itself a future (a [`DecodeHold`]), it also boxes its own routing around
/// that one on every request, room or not, and makes the request's place in the queue
/// there (which the hold then shares): one small allocation more per request than the
/// hold alone. The other order, the hold around this limit (as the proxy builds them),
/// costs no more than the hold.
#[derive(Debug)]
pub struct PerEndpointLimit<R> {
    inner: R,
    state: Arc<State>,
    /// Requests in flight on one endpoint.
    limit: usize,
    /// The places handed out per endpoint and not yet given back.
    places: Arc<Places>,
}

impl<R: Router> PerEndpointLimit<R> {
    /// The route `first` gives, if it has room (a routing of the router this limit
    /// wraps that [`route`](Router::route) began: a future, a hold's), else `choose`'s
    /// once it has (a look through the router it wraps: its
    /// [`route`](Router::route), or its [`place_queued`](Router::place_queued) for a
    /// request placed on one engine, which passes no `first`): meanwhile the request
    /// waits in the queue, as one that found no room, until a leg that held a place
    /// ends. Its one place in the queue for its routing is the routing's ([`Queued`]:
    /// that of a hold wrapping this limit, or a new one), where a hold this limit wraps
    /// finds it too, and keeps its ticket in its line between looks ([`Kept`]). Not
    /// counted in `queued` when it already `queued`; the route says when this routing
    /// made it wait ([`Route::queued`]), here or in a hold of `first`, and so does the
    /// error of one that waited, then failed ([`PdError::with_queued`]).
    ///
    /// A look reads the places given back before it: when it finds no room, a leg's
    /// end during it ([`State::ends`]) lets the request look again at once (within its
    /// wait's end); a place that another request's look took and gave back
    /// ([`State::returns`]), during it or during the wait that follows, lets it look
    /// again once [`RETURN_POLL`] has passed (the request then listens for legs' ends
    /// only, so that those places wake it once a look at most); else it waits for a
    /// leg's end. A place the routing did not make ([`Queued::id`]), dropped while it
    /// looks, is a leg's end. `first` began before those counts could be read: when it
    /// finds no room, `choose` looks at once.
    async fn wait_for_room<C, F>(
        &self,
        first: Option<C>,
        choose: F,
        deadline: Option<Instant>,
        queued: bool,
    ) -> Result<Route, PdError>
    where
        C: Future<Output = Result<Route, PdError>>,
        F: Fn() -> C,
    {
        let (place, new) = Queued::for_routing(&self.state);
        let waiting = async {
            // Whether this routing made the request wait (a hold of `first`'s that held
            // it, then this limit): the route it gives says so.
            let mut waited = false;
            if let Some(first) = first {
                let route = first.await?;
                waited = route.queued;
                if let Some(route) = self.with_room(route) {
                    return Ok(route);
                }
            }
            // This limit's own wait, from when it first waits: not from before a look
            // that a hold of `choose` held.
            let mut wait = None;
            loop {
                // The places given back before the look, the request's own among
                // them. A route this limit finds no room for gives back the places
                // that limits inside this one took for it (waking the requests
                // waiting for room): listening before that, the request would wake
                // itself, look again, and so on, without ever waiting.
                let ends = self.state.ends.load(Ordering::SeqCst);
                let returns = self.state.returns.load(Ordering::SeqCst);
                let own = place.given_back.load(Ordering::SeqCst);
                if let Some(mut route) = self.with_room(choose().await?) {
                    route.queued |= waited;
                    return Ok(route);
                }
                // Listening from here; what was given back since the look began, which
                // the counts show, was not heard.
                let looked = Instant::now();
                let ended = self.state.ended.notified();
                let returned = self.state.returned.notified();
                tokio::pin!(ended, returned);
                ended.as_mut().enable();
                returned.as_mut().enable();
                // Counted at its first wait (or already, by a hold of the routing);
                // its waits end at the earliest end any of them set, a hold's that
                // `choose` went through included.
                let wait = *wait.get_or_insert_with(|| self.state.wait(looked, deadline));
                let Bound { since, until } = place.enqueue(wait, queued)?;
                waited = true;
                let leg_ended = || self.state.ends.load(Ordering::SeqCst) != ends;
                if leg_ended() {
                    // A leg ended during the look: look again at once, unless the
                    // wait is over (on a busy limit a leg may end during every look,
                    // and this way does not wait), giving the thread up when the task
                    // has used its budget.
                    if looked >= until {
                        return Err(self.state.timed_out(since));
                    }
                    tokio::task::consume_budget().await;
                    continue;
                }
                // Another request's look gave a place back during this one, which may
                // have found it taken: look again, but not at once (see
                // `State::returns`).
                let others = self
                    .state
                    .returns
                    .load(Ordering::SeqCst)
                    .wrapping_sub(returns)
                    != place.given_back.load(Ordering::SeqCst).wrapping_sub(own);
                let mut again = others.then(|| looked + RETURN_POLL);
                loop {
                    let end = again.map_or(until, |again| again.min(until));
                    // Places given back by looks are heard only while no look is due:
                    // once it is, they could only wake the request for nothing, once
                    // for each of them.
                    let hear_returns = again.is_none();
                    let heard = std::future::poll_fn(|cx| {
                        if ended.as_mut().poll(cx).is_ready() {
                            Poll::Ready(Heard::End)
                        } else if hear_returns && returned.as_mut().poll(cx).is_ready() {
                            Poll::Ready(Heard::Return)
                        } else {
                            Poll::Pending
                        }
                    });
                    let heard = tokio::time::timeout_at(end, heard).await;
                    match heard {
                        Err(_) if end == until => return Err(self.state.timed_out(since)),
                        Err(_) => break,
                        // Rung for an end the counts showed before the look, or after.
                        Ok(Heard::End) => {
                            if leg_ended() {
                                break;
                            }
                            ended.set(self.state.ended.notified());
                            ended.as_mut().enable();
                            if leg_ended() {
                                break;
                            }
                        }
                        // Places another request's look gave back: look again once the
                        // poll has passed, listening meanwhile for a leg's end only.
                        Ok(Heard::Return) => again = Some(Instant::now() + RETURN_POLL),
                    }
                }
            }
        };
        let routed = QUEUED.scope(Arc::clone(&place), waiting).await;
        if new {
            // The tickets kept, if any, leave their lines with the place (dropped
            // here). Otherwise a router wrapping this limit may route the request
            // through it again: they are kept (a hold that holds the request gives
            // up those of the holds inside it), and that router's routing ends it.
            return place.end(routed);
        }
        routed
    }

    /// `route` holding a place per leg, when both its endpoints are below the limit:
    /// checked and taken under one lock.
    fn with_room(&self, route: Route) -> Option<Route> {
        let key = |ep: &Endpoint| (ep.role(), ep.id().clone());
        let decode = key(&route.decode);
        let prefill = route.prefill.as_deref().map(key);
        let mut places = crate::lock(&self.places.0);
        let count = |ep: &Endpoint, key: &PlaceKey| {
            ep.in_flight().max(places.get(key).copied().unwrap_or(0))
        };
        let room = count(&route.decode, &decode) < self.limit
            && route
                .prefill
                .as_deref()
                .zip(prefill.as_ref())
                .is_none_or(|(p, key)| count(p, key) < self.limit);
        if !room {
            drop(places);
            give_back_route(route);
            return None;
        }
        if let Some(key) = &prefill {
            take(&mut places, key.clone());
        }
        take(&mut places, decode.clone());
        drop(places);
        // Made during this admission's routing under way, if any (none for a request
        // with room when no router of this admission wraps this limit).
        let routing = QUEUED
            .try_with(|q| if q.is_in(&self.state) { q.id } else { 0 })
            .unwrap_or(0);
        let place = |endpoint| {
            Permit::new(LegPlace {
                state: Arc::clone(&self.state),
                places: Arc::clone(&self.places),
                endpoint,
                routing,
            })
        };
        let prefill = prefill.map(place);
        Some(route.with_holds(prefill, Some(place(decode))))
    }
}

impl<R: Router> Router for PerEndpointLimit<R> {
    fn select(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        self.inner.select(req, set)
    }

    fn select_direct(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        self.inner.select_direct(req, set)
    }

    /// The route the router it wraps gives ([`Router::route`]: one that waits, a
    /// [`DecodeHold`], still waits), once it has room.
    fn route<'a>(&'a self, ask: Ask<'a>) -> Routing<'a> {
        let choose = move || self.inner.route(ask);
        let first = match choose() {
            Either::Left(now) => now.into_inner(),
            // Waited for in the request's place in the queue, which it shares.
            routing => {
                let waiting = self.wait_for_room(Some(routing), choose, ask.deadline, ask.queued);
                return Either::Right(Box::pin(waiting));
            }
        };
        let first = match first {
            Ok(route) => route,
            Err(e) => return Either::Left(ready(Err(e))),
        };
        match self.with_room(first) {
            Some(route) => Either::Left(ready(Ok(route))),
            None => {
                let waiting = self.wait_for_room(None, choose, ask.deadline, ask.queued);
                Either::Right(Box::pin(waiting))
            }
        }
    }

    /// The route the router it wraps places for the engine `pick` chooses
    /// ([`Router::place_queued`]: a limit inside this one holds a place too, and may
    /// wait), holding a place under this limit as well: while this limit has no room
    /// for it, the request gives that route back, waits in the queue as a routed one
    /// does, and is placed again.
    fn place<'a>(
        &'a self,
        pick: &'a (dyn Fn() -> Result<Arc<Endpoint>, PdError> + Send + Sync),
        deadline: Option<Instant>,
    ) -> BoxFuture<'a, Result<Route, PdError>> {
        self.place_queued(pick, deadline, false)
    }

    /// As [`place`](Router::place); a request that already `queued` for admission is
    /// not counted in `queued` again when it waits.
    fn place_queued<'a>(
        &'a self,
        pick: &'a (dyn Fn() -> Result<Arc<Endpoint>, PdError> + Send + Sync),
        deadline: Option<Instant>,
        queued: bool,
    ) -> BoxFuture<'a, Result<Route, PdError>> {
        // Waited for in the request's place in the queue, which a limit inside this
        // one shares; its first look too, once the counts it reads before are read.
        let choose = move || self.inner.place_queued(pick, deadline, queued);
        Box::pin(self.wait_for_room(None, choose, deadline, queued))
    }

    fn observe(&self, route: &Route, outcome: Outcome) {
        self.inner.observe(route, outcome)
    }

    fn wants_tokens(&self) -> bool {
        self.inner.wants_tokens()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use disagg_core::Role;

    fn limited(n: usize, queue: usize, timeout_ms: u64) -> Arc<Limits> {
        Arc::new(Limits::new(AdmissionConfig {
            max_in_flight: Some(n),
            max_queue: queue,
            queue_timeout: Duration::from_millis(timeout_ms),
            ..AdmissionConfig::default()
        }))
    }

    /// Requests waiting in the queue.
    fn waiting(a: &Limits) -> u64 {
        a.stats().waiting
    }

    /// Requests holding a place under the global limit.
    fn running(a: &Limits) -> usize {
        let sem = a.state.global.as_ref().unwrap();
        a.state.config.max_in_flight.unwrap() - sem.available_permits()
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_is_refused_with_retry_after() {
        let a = limited(1, 1, 1000);
        let first = a.admit(None).await.unwrap();
        let a2 = Arc::clone(&a);
        let queued = tokio::spawn(async move { a2.admit(None).await.map(drop) });
        tokio::task::yield_now().await;
        assert_eq!(waiting(&a), 1);
        let e = a.admit(None).await.unwrap_err();
        assert_eq!(e.http().code, "queue_full");
        assert_eq!(e.http().retry_after, Some(Duration::from_secs(1)));
        drop(first);
        queued.await.unwrap().unwrap();
        assert_eq!((waiting(&a), running(&a)), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_long_wait_is_a_queue_timeout() {
        let a = limited(1, 8, 500);
        let _first = a.admit(None).await.unwrap();
        let start = Instant::now();
        let e = a.admit(None).await.unwrap_err();
        assert_eq!(e.http().code, "queue_timeout");
        assert_eq!(start.elapsed(), Duration::from_millis(500));
        // A nearer deadline ends the wait sooner.
        let e = a
            .admit(Some(Instant::now() + Duration::from_millis(100)))
            .await
            .unwrap_err();
        assert_eq!(e.http().code, "queue_timeout");
        assert_eq!(waiting(&a), 0);
        assert_eq!(a.stats().queue_timeouts, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_are_admitted_in_arrival_order() {
        let a = limited(1, 8, 10_000);
        let first = a.admit(None).await.unwrap();
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..4 {
            let (a, order) = (Arc::clone(&a), Arc::clone(&order));
            tasks.push(tokio::spawn(async move {
                let p = a.admit(None).await.unwrap();
                order.lock().unwrap().push(i);
                tokio::time::sleep(Duration::from_millis(10)).await;
                drop(p);
            }));
            // Each arrives after the previous one is queued.
            tokio::task::yield_now().await;
        }
        drop(first);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3]);
    }

    #[tokio::test(start_paused = true)]
    async fn an_abandoned_waiter_leaves_the_queue() {
        let a = limited(1, 8, 10_000);
        let _first = a.admit(None).await.unwrap();
        let wait = a.admit(None);
        let r = tokio::time::timeout(Duration::from_millis(10), wait).await;
        assert!(r.is_err());
        assert_eq!((waiting(&a), running(&a)), (0, 1));
    }

    /// The first prefill and the first decode endpoint of the set.
    struct First;

    impl Router for First {
        fn select(&self, _: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
            let decode = set
                .by_role(Role::Decode)
                .first()
                .ok_or(RouteError::NoDecode)?;
            Ok(Route::new(
                set.by_role(Role::Prefill).first().cloned(),
                Arc::clone(decode),
            ))
        }
    }

    #[tokio::test]
    async fn a_full_route_waits_until_a_leg_that_held_a_place_ends() {
        use disagg_core::endpoint::{Endpoint, Role};
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use disagg_core::source::{EndpointSource, StaticSource};
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let router = limits.per_endpoint(First, 1);
        let source = StaticSource::new([
            Endpoint::new("http://127.0.0.1:1", Role::Prefill).unwrap(),
            Endpoint::new("http://127.0.0.1:2", Role::Decode).unwrap(),
        ]);
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        // A route with room is given at once, holding a place per leg.
        let first = router.route(ask).now_or_never().unwrap().unwrap();
        // Its decode leg runs: the decode endpoint is at its limit.
        let stream = first.decode.track();
        let mut second = Box::pin(router.route(ask));
        assert!((&mut second).now_or_never().is_none(), "no room: it waits");
        assert_eq!((waiting(&limits), limits.stats().queued), (1, 1));
        // The leg ends: its count goes, and its place is given back.
        drop(stream);
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(5), second)
            .await
            .expect("woken when the leg ended")
            .unwrap();
        assert_eq!(
            second.decode.id(),
            source.snapshot().by_role(Role::Decode)[0].id()
        );
        assert_eq!(waiting(&limits), 0);
    }

    #[tokio::test]
    async fn below_its_limit_the_router_routes_as_it_would() {
        use disagg_core::endpoint::{Endpoint, Role};
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use disagg_core::source::StaticSource;
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let router = limits.per_endpoint(First, 3);
        let source =
            StaticSource::new([Endpoint::new("http://127.0.0.1:2", Role::Decode).unwrap()]);
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let route = router
            .route(Ask::new(&view, &source, true, None))
            .now_or_never()
            .unwrap()
            .unwrap();
        let _busy = [route.decode.track(), route.decode.track()];
        assert!(
            router
                .route(Ask::new(&view, &source, true, None))
                .now_or_never()
                .is_some(),
            "never waits"
        );
    }

    /// A request an adapter sends to one engine itself takes its place from the same
    /// limit, through the decode hold that wraps it: with room at once; at the limit it
    /// waits until a place is given back, then picks again.
    #[tokio::test]
    async fn a_direct_place_waits_for_room_through_the_decorators() {
        use disagg_core::endpoint::{Endpoint, Role};
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let router = limits.decode_hold(
            Arc::new(limits.per_endpoint(First, 1)),
            100,
            Duration::from_secs(5),
        );
        let decode = Arc::new(Endpoint::new("http://127.0.0.1:2", Role::Decode).unwrap());
        let pick = {
            let decode = Arc::clone(&decode);
            move || Ok(Arc::clone(&decode))
        };
        let first = router.place(&pick, None).now_or_never().unwrap().unwrap();
        assert!(first.prefill.is_none());
        let running = first.decode.track();
        let mut second = Box::pin(router.place(&pick, None));
        assert!((&mut second).now_or_never().is_none(), "no room: it waits");
        assert_eq!(waiting(&limits), 1);
        drop(running);
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(5), second)
            .await
            .expect("woken when the place was given back")
            .unwrap();
        assert_eq!(waiting(&limits), 0);
        assert_eq!(second.decode.id(), decode.id());
        // Past the deadline: 503 `queue_timeout`.
        let _running = decode.track();
        let by = Instant::now() + Duration::from_millis(50);
        let e = router.place(&pick, Some(by)).await.unwrap_err();
        assert_eq!(e.http().code, "queue_timeout");
    }

    /// The prefill endpoint with the fewest legs in flight, and the first decode.
    struct LeastLoaded;

    impl Router for LeastLoaded {
        fn select(&self, _: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
            let decode = set
                .by_role(Role::Decode)
                .first()
                .ok_or(RouteError::NoDecode)?;
            let prefill = set
                .by_role(Role::Prefill)
                .iter()
                .min_by_key(|p| p.in_flight())
                .cloned();
            Ok(Route::new(prefill, Arc::clone(decode)))
        }
    }

    fn endpoint(url: &str, role: Role) -> Endpoint {
        Endpoint::new(url, role).unwrap()
    }

    /// A decode's in-flight count rises only when its leg is sent, after the
    /// prefill; the places handed out count from the routing on.
    #[tokio::test]
    async fn a_place_handed_out_counts_before_its_leg_is_sent() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use disagg_core::source::StaticSource;
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let router = limits.per_endpoint(LeastLoaded, 1);
        let source = StaticSource::new([
            endpoint("http://p1:1", Role::Prefill),
            endpoint("http://p2:1", Role::Prefill),
            endpoint("http://d:1", Role::Decode),
        ]);
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        let r1 = router.route(ask).now_or_never().unwrap().unwrap();
        // R1's prefill runs on P1; its decode leg is not sent yet.
        let prefill = r1.prefill.as_ref().unwrap().track();
        assert_eq!(r1.decode.in_flight(), 0);
        // R2 would go to P2 and the same decode, whose one place is R1's.
        let mut r2 = Box::pin(router.route(ask));
        assert!(
            (&mut r2).now_or_never().is_none(),
            "the decode is full: R2 waits"
        );
        assert_eq!(waiting(&limits), 1);
        // R1's legs end: R2 is let through.
        drop(prefill);
        drop(r1);
        let r2 = (&mut r2)
            .now_or_never()
            .expect("woken when R1's places were given back")
            .unwrap();
        assert_eq!(r2.decode.id().as_str(), "http://d:1");
        assert_eq!(waiting(&limits), 0);
        // Every place given back, no entry is left behind.
        drop(r2);
        assert!(crate::lock(&router.places.0).is_empty());
    }

    /// The room was looked at, then the wait made: a leg that ended between the
    /// two woke no one, and the request waited for another leg's end (or timed out).
    #[tokio::test]
    async fn a_leg_that_ends_before_the_wait_is_polled_still_lets_it_through() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use disagg_core::source::StaticSource;
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let router = limits.per_endpoint(First, 1);
        let source = StaticSource::new([
            endpoint("http://p:1", Role::Prefill),
            endpoint("http://d:1", Role::Decode),
        ]);
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        let first = router.route(ask).now_or_never().unwrap().unwrap();
        let stream = first.decode.track();
        // It finds no room, and is not polled before the leg ends.
        let second = router.route(ask);
        drop(stream);
        drop(first);
        let second = second
            .now_or_never()
            .expect("the room freed before the wait is found")
            .unwrap();
        assert_eq!(second.decode.id().as_str(), "http://d:1");
        assert_eq!(waiting(&limits), 0);
    }

    /// Each wake-up that found no room queued the request again, counting it
    /// in `queued` once per wake-up (and, with a full queue, refusing it with 429).
    #[tokio::test]
    async fn a_waiter_woken_without_room_is_queued_once() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use disagg_core::source::StaticSource;
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let router = limits.per_endpoint(First, 1);
        let source = StaticSource::new([
            endpoint("http://p:1", Role::Prefill),
            endpoint("http://d:1", Role::Decode),
        ]);
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        let first = router.route(ask).now_or_never().unwrap().unwrap();
        let mut second = Box::pin(router.route(ask));
        assert!((&mut second).now_or_never().is_none());
        assert_eq!((waiting(&limits), limits.stats().queued), (1, 1));
        // Places on another engine come and go: the waiter is woken three times and
        // finds no room each time.
        let other = Arc::new(endpoint("http://e:1", Role::Decode));
        let pick = {
            let other = Arc::clone(&other);
            move || Ok(Arc::clone(&other))
        };
        for _ in 0..3 {
            drop(router.place(&pick, None).now_or_never().unwrap().unwrap());
            assert!((&mut second).now_or_never().is_none(), "still no room");
        }
        assert_eq!((waiting(&limits), limits.stats().queued), (1, 1));
        drop(first);
        assert!((&mut second).now_or_never().is_some());
        assert_eq!((waiting(&limits), limits.stats().queued), (0, 1));
    }

    /// The hold counted the held requests of every model ahead of a request,
    /// against the free places of its own model's decodes.
    #[tokio::test(start_paused = true)]
    async fn a_model_with_room_is_not_held_behind_another_models_line() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use disagg_core::source::StaticSource;
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let router = limits.decode_hold(First, 1, Duration::from_secs(60));
        let source = StaticSource::new([
            endpoint("http://p:1", Role::Prefill),
            endpoint("http://da:1", Role::Decode).with_models(["a"]),
            endpoint("http://db:1", Role::Decode).with_models(["b"]),
        ]);
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let a = RequestView::new(Api::Chat, Some("a"), &headers, &body);
        let b = RequestView::new(Api::Chat, Some("b"), &headers, &body);
        let ask_a = Ask::new(&a, &source, false, None);
        let ask_b = Ask::new(&b, &source, false, None);

        // Model a's one decode is full, and 20 of its requests are held.
        let running = router.route(ask_a).now_or_never().unwrap().unwrap();
        let mut held: Vec<_> = (0..20).map(|_| Box::pin(router.route(ask_a))).collect();
        for h in &mut held {
            assert!(h.now_or_never().is_none(), "model a is saturated");
        }
        assert_eq!(waiting(&limits), 20);
        // Model b's decode is idle: its request is routed at once.
        let routed = router
            .route(ask_b)
            .now_or_never()
            .expect("not held behind model a's line")
            .unwrap();
        assert_eq!(routed.decode.id().as_str(), "http://db:1");
        // A second b request waits for b's decode, not for a's line.
        let mut second = Box::pin(router.route(ask_b));
        assert!((&mut second).now_or_never().is_none());
        drop(routed);
        // It looks again at its next poll of the decodes.
        tokio::time::advance(HOLD_POLL).await;
        assert!((&mut second).now_or_never().is_some());
        // The lines leave with their last ticket.
        drop(held);
        drop(running);
        let counts = crate::lock(&router.routed.0);
        assert!(counts.held.is_empty() && counts.unnamed.is_empty());
    }

    /// Without models declared every request waits for the same decodes: one line,
    /// whatever the model each names.
    #[tokio::test(start_paused = true)]
    async fn without_declared_models_every_request_waits_in_one_line() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use disagg_core::source::StaticSource;
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let router = limits.decode_hold(First, 1, Duration::from_secs(60));
        let source = StaticSource::new([
            endpoint("http://p:1", Role::Prefill),
            endpoint("http://d:1", Role::Decode),
        ]);
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let a = RequestView::new(Api::Chat, Some("a"), &headers, &body);
        let b = RequestView::new(Api::Chat, Some("b"), &headers, &body);
        let (ask_a, ask_b) = (
            Ask::new(&a, &source, false, None),
            Ask::new(&b, &source, false, None),
        );
        let running = router.route(ask_a).now_or_never().unwrap().unwrap();
        let mut older = Box::pin(router.route(ask_a));
        assert!((&mut older).now_or_never().is_none());
        drop(running);
        // The place freed is the older request's: a newcomer naming another model
        // waits behind it.
        assert!(router.route(ask_b).now_or_never().is_none());
        tokio::time::advance(HOLD_POLL).await;
        let _older = (&mut older).now_or_never().expect("oldest first").unwrap();
    }

    /// The decode hold over the per-endpoint limit, both in `limits`' queue (as the
    /// proxy builds them), over a prefill and two decodes; the first decode and the
    /// second, in the set's order.
    fn held_over_per_endpoint(
        limits: &Limits,
    ) -> (
        DecodeHold<PerEndpointLimit<First>>,
        disagg_core::source::StaticSource,
        [Arc<Endpoint>; 2],
    ) {
        held_over_per_endpoint_for(limits, Duration::from_secs(60))
    }

    /// [`held_over_per_endpoint`], the hold waiting `wait` at most.
    fn held_over_per_endpoint_for(
        limits: &Limits,
        wait: Duration,
    ) -> (
        DecodeHold<PerEndpointLimit<First>>,
        disagg_core::source::StaticSource,
        [Arc<Endpoint>; 2],
    ) {
        use disagg_core::source::{EndpointSource, StaticSource};

        let router = limits.decode_hold(limits.per_endpoint(First, 1), 1, wait);
        let source = StaticSource::new([
            endpoint("http://p:1", Role::Prefill),
            endpoint("http://d1:1", Role::Decode),
            endpoint("http://d2:1", Role::Decode),
        ]);
        let set = source.snapshot();
        let decodes = set.by_role(Role::Decode);
        let decodes = [Arc::clone(&decodes[0]), Arc::clone(&decodes[1])];
        (router, source, decodes)
    }

    /// A held request let go by the hold, that then waited for a per-endpoint place,
    /// was queued a second time: `queued_now` showed 2 for it, and with a queue of
    /// one it was refused with 429 `queue_full` though it had already waited.
    #[tokio::test(start_paused = true)]
    async fn a_held_request_waiting_for_a_per_endpoint_place_is_queued_once() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig {
            max_queue: 1,
            ..AdmissionConfig::default()
        });
        let (router, source, [d1, d2]) = held_over_per_endpoint(&limits);
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        // The second decode runs another request; the first is this hold's.
        let other = d2.track();
        let first = router.route(ask).now_or_never().unwrap().unwrap();
        assert_eq!(first.decode.id(), d1.id());
        let mut second = Box::pin(router.route(ask));
        assert!(
            (&mut second).now_or_never().is_none(),
            "every decode is full"
        );
        assert_eq!((waiting(&limits), limits.stats().queued), (1, 1));
        // The second decode frees up: the hold lets it go, and it waits for the
        // prefill's place, still in its one place in the queue.
        drop(other);
        tokio::time::advance(HOLD_POLL).await;
        let r = (&mut second).now_or_never();
        assert!(
            r.is_none(),
            "waits for the prefill's place: {:?}",
            r.map(|r| r.map(drop).map_err(|e| e.http().code))
        );
        let stats = limits.stats();
        assert_eq!((stats.waiting, stats.queued, stats.queue_full), (1, 1, 0));
        // The first request's legs end: it is routed.
        drop(first);
        let second = (&mut second)
            .now_or_never()
            .expect("woken when the prefill's place was given back")
            .unwrap();
        assert!(second.prefill.is_some());
        let stats = limits.stats();
        assert_eq!((stats.waiting, stats.queued, stats.queue_full), (0, 1, 0));
    }

    /// A request that waited for a per-endpoint place, then found every decode full
    /// (the engines' counts rose meanwhile) and was held, was queued a second time.
    #[tokio::test(start_paused = true)]
    async fn a_request_held_after_its_per_endpoint_wait_is_queued_once() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let (router, source, [d1, d2]) = held_over_per_endpoint(&limits);
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        let first = router.route(ask).now_or_never().unwrap().unwrap();
        // The second decode has room: the hold lets it go, and it waits for the
        // prefill's place.
        let mut second = Box::pin(router.route(ask));
        assert!((&mut second).now_or_never().is_none());
        assert_eq!((waiting(&limits), limits.stats().queued), (1, 1));
        // Both decodes fill up with other routers' requests, as their engines say;
        // the prefill's place is given back.
        d1.set_engine_load(Some(1));
        d2.set_engine_load(Some(1));
        drop(first);
        assert!((&mut second).now_or_never().is_none(), "held now");
        assert_eq!((waiting(&limits), limits.stats().queued), (1, 1));
        // A decode frees up: it is routed, counted once.
        d2.set_engine_load(Some(0));
        tokio::time::advance(HOLD_POLL).await;
        let second = (&mut second).now_or_never().expect("room").unwrap();
        assert_eq!(second.decode.id(), d1.id(), "its router's choice");
        assert_eq!((waiting(&limits), limits.stats().queued), (0, 1));
    }

    /// A request its client abandons leaves the queue once, wherever it waits: held,
    /// or for a per-endpoint place after the hold let it go.
    #[tokio::test(start_paused = true)]
    async fn an_abandoned_request_leaves_the_queue_from_the_hold_or_the_per_endpoint_wait() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let (router, source, [_, d2]) = held_over_per_endpoint(&limits);
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        let other = d2.track();
        let first = router.route(ask).now_or_never().unwrap().unwrap();
        // Held, then abandoned.
        let mut held = Box::pin(router.route(ask));
        assert!((&mut held).now_or_never().is_none());
        assert_eq!(waiting(&limits), 1);
        drop(held);
        assert_eq!(waiting(&limits), 0);
        // Held, let go into the per-endpoint wait, then abandoned.
        let mut second = Box::pin(router.route(ask));
        assert!((&mut second).now_or_never().is_none());
        drop(other);
        tokio::time::advance(HOLD_POLL).await;
        assert!((&mut second).now_or_never().is_none());
        assert_eq!(waiting(&limits), 1);
        drop(second);
        assert_eq!(waiting(&limits), 0);
        // Its ticket left the hold's line, and the first's places are intact.
        assert!(crate::lock(&router.routed.0).unnamed.is_empty());
        drop(first);
        assert!(crate::lock(&router.inner.places.0).is_empty());
    }

    /// A request that waited `ms` milliseconds in the queue and was not admitted.
    fn timed_out_after(e: &PdError, ms: u64) -> bool {
        e.http().code == "queue_timeout" && e.to_string().contains(&format!("waited {ms} ms"))
    }

    /// A held request let go by the hold after most of the hold's wait, then waiting
    /// for a per-endpoint place, waited the queue timeout again: 19 s in all for a
    /// hold and a queue of 10 s each.
    #[tokio::test(start_paused = true)]
    async fn a_per_endpoint_wait_after_the_hold_ends_within_the_holds_wait() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig {
            queue_timeout: Duration::from_secs(10),
            ..AdmissionConfig::default()
        });
        let (router, source, [d1, d2]) =
            held_over_per_endpoint_for(&limits, Duration::from_secs(10));
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        let other = d2.track();
        let first = router.route(ask).now_or_never().unwrap().unwrap();
        assert_eq!(first.decode.id(), d1.id());
        let start = Instant::now();
        let mut second = Box::pin(router.route(ask));
        assert!((&mut second).now_or_never().is_none(), "held");
        // 9 s later the second decode frees up: the hold lets it go, and it waits
        // for the prefill's place, which the first request holds.
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!((&mut second).now_or_never().is_none(), "still held");
        drop(other);
        tokio::time::advance(HOLD_POLL).await;
        assert!((&mut second).now_or_never().is_none(), "waits for a place");
        // The hold's 10 s are up: its wait ends there, with the hold's error.
        tokio::time::advance(start + Duration::from_secs(10) - Instant::now()).await;
        let e = (&mut second)
            .now_or_never()
            .expect("the routing's waits end with the first one's")
            .unwrap_err();
        assert!(timed_out_after(&e, 10_000), "{e}");
        let stats = limits.stats();
        assert_eq!(
            (stats.waiting, stats.queued, stats.queue_timeouts),
            (0, 1, 1)
        );
        drop(first);
        assert!(crate::lock(&router.inner.places.0).is_empty());
    }

    /// The per-endpoint limit wrapped around the decode hold (the proxy builds them the
    /// other way round) routed through the hold's `select`, which holds nothing: a
    /// request went at once to a decode its engine reported full.
    #[tokio::test(start_paused = true)]
    async fn a_decode_hold_wrapped_in_a_per_endpoint_limit_holds() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use disagg_core::source::{EndpointSource, StaticSource};
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let hold = limits.decode_hold(First, 1, Duration::from_secs(60));
        let router = limits.per_endpoint(hold, 8);
        let source = StaticSource::new([
            endpoint("http://p:1", Role::Prefill),
            endpoint("http://d:1", Role::Decode),
        ]);
        let decode = Arc::clone(&source.snapshot().by_role(Role::Decode)[0]);
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        decode.set_engine_load(Some(1));
        let mut held = Box::pin(router.route(ask));
        assert!(
            (&mut held).now_or_never().is_none(),
            "every decode is full: held"
        );
        assert_eq!((waiting(&limits), limits.stats().queued), (1, 1));
        decode.set_engine_load(Some(0));
        tokio::time::advance(HOLD_POLL).await;
        let route = (&mut held).now_or_never().expect("room").unwrap();
        assert!(route.queued, "the routing says it waited");
        assert_eq!((waiting(&limits), limits.stats().queued), (0, 1));
        // Each holds its places until the legs end.
        assert_eq!(crate::lock(&router.inner.routed.0).places.len(), 1);
        assert_eq!(crate::lock(&router.places.0).len(), 2);
        drop(route);
        assert!(crate::lock(&router.inner.routed.0).places.is_empty());
        assert!(crate::lock(&router.places.0).is_empty());
    }

    /// The hold inside the per-endpoint limit, in reverse of the proxy's order: a held
    /// request that the hold lets go to wait for a per-endpoint place keeps its one
    /// place in the queue (counted once, not refused by a queue of one), and its waits
    /// end together, at the hold's end.
    #[tokio::test(start_paused = true)]
    async fn a_hold_inside_a_per_endpoint_limit_shares_its_place_in_the_queue() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use disagg_core::source::{EndpointSource, StaticSource};
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig {
            max_queue: 1,
            queue_timeout: Duration::from_secs(10),
            ..AdmissionConfig::default()
        });
        let hold = limits.decode_hold(First, 1, Duration::from_secs(10));
        let router = limits.per_endpoint(hold, 1);
        let source = StaticSource::new([
            endpoint("http://p:1", Role::Prefill),
            endpoint("http://d1:1", Role::Decode),
            endpoint("http://d2:1", Role::Decode),
        ]);
        let d2 = Arc::clone(&source.snapshot().by_role(Role::Decode)[1]);
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        let other = d2.track();
        let first = router.route(ask).now_or_never().unwrap().unwrap();
        let start = Instant::now();
        let mut second = Box::pin(router.route(ask));
        assert!((&mut second).now_or_never().is_none());
        assert_eq!(crate::lock(&router.inner.routed.0).unnamed.len(), 1, "held");
        assert_eq!((waiting(&limits), limits.stats().queued), (1, 1));
        // 9 s later the second decode frees up: the hold lets it go, and it waits for
        // the prefill's place, which the first request holds.
        tokio::time::advance(Duration::from_secs(9)).await;
        drop(other);
        tokio::time::advance(HOLD_POLL).await;
        assert!((&mut second).now_or_never().is_none(), "waits for a place");
        // Still first in the hold's line: a request held after it waits behind it.
        assert_eq!(crate::lock(&router.inner.routed.0).unnamed.len(), 1);
        let stats = limits.stats();
        assert_eq!((stats.waiting, stats.queued, stats.queue_full), (1, 1, 0));
        // The hold's 10 s are up: its wait ends there.
        tokio::time::advance(start + Duration::from_secs(10) - Instant::now()).await;
        let e = (&mut second)
            .now_or_never()
            .expect("the routing's waits end with the first one's")
            .unwrap_err();
        assert!(timed_out_after(&e, 10_000), "{e}");
        let stats = limits.stats();
        assert_eq!(
            (
                stats.waiting,
                stats.queued,
                stats.queue_full,
                stats.queue_timeouts
            ),
            (0, 1, 0, 1)
        );
        assert!(crate::lock(&router.inner.routed.0).unnamed.is_empty());
        drop(first);
        assert!(crate::lock(&router.places.0).is_empty());
        assert!(crate::lock(&router.inner.routed.0).places.is_empty());
    }

    /// A step of a test, run by a [`Hook`].
    type Step = Box<dyn FnOnce() + Send>;

    /// `inner`, running a step of a test just before one of its routings (the step
    /// armed with [`on_call`](Self::on_call)), then routing as `inner` does.
    struct Hook<R> {
        inner: R,
        calls: AtomicUsize,
        step: std::sync::Mutex<Option<(usize, Step)>>,
    }

    impl<R> Hook<R> {
        fn new(inner: R) -> Self {
            Hook {
                inner,
                calls: AtomicUsize::new(0),
                step: std::sync::Mutex::new(None),
            }
        }

        /// `step` runs just before the `n`th routing from now (from 1).
        fn on_call(&self, n: usize, step: impl FnOnce() + Send + 'static) {
            let at = self.calls.load(Ordering::Relaxed) + n;
            *crate::lock(&self.step) = Some((at, Box::new(step)));
        }
    }

    impl<R: Router> Router for Hook<R> {
        fn select(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
            self.inner.select(req, set)
        }

        fn route<'a>(&'a self, ask: Ask<'a>) -> Routing<'a> {
            let call = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
            let step = {
                let mut step = crate::lock(&self.step);
                match step.take() {
                    Some((at, step)) if at == call => Some(step),
                    other => {
                        *step = other;
                        None
                    }
                }
            };
            if let Some(step) = step {
                step();
            }
            self.inner.route(ask)
        }
    }

    /// The per-endpoint limit (of 1) around a decode hold (of 1 running request per
    /// decode, waiting `hold` at most), through a [`Hook`], over a prefill and two
    /// decodes: the router, its source, the prefill and the decodes.
    #[allow(clippy::type_complexity)]
    fn limit_over_hook_over_hold(
        limits: &Limits,
        hold: Duration,
    ) -> (
        PerEndpointLimit<Hook<DecodeHold<First>>>,
        disagg_core::source::StaticSource,
        Arc<Endpoint>,
        [Arc<Endpoint>; 2],
    ) {
        use disagg_core::source::{EndpointSource, StaticSource};

        let router = limits.per_endpoint(Hook::new(limits.decode_hold(First, 1, hold)), 1);
        let source = StaticSource::new([
            endpoint("http://p:1", Role::Prefill),
            endpoint("http://d1:1", Role::Decode),
            endpoint("http://d2:1", Role::Decode),
        ]);
        let set = source.snapshot();
        let prefill = Arc::clone(&set.by_role(Role::Prefill)[0]);
        let decodes = set.by_role(Role::Decode);
        let decodes = [Arc::clone(&decodes[0]), Arc::clone(&decodes[1])];
        (router, source, prefill, decodes)
    }

    /// A limit around a hold: a request the hold held (and counted), let go by it,
    /// refused by the limit, then routed when it looked again (the prefill's place
    /// given back in between), was given a route saying it had not waited: a retry
    /// of it that waited would be counted in `queued` again.
    #[tokio::test(start_paused = true)]
    async fn a_request_held_inside_a_per_endpoint_limit_is_routed_as_queued() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let (router, source, _, [d1, d2]) =
            limit_over_hook_over_hold(&limits, Duration::from_secs(60));
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        // The first request holds the prefill's place and the first decode; the
        // second decode's engine is full: X is held, and counted.
        let first = router.route(ask).now_or_never().unwrap().unwrap();
        assert_eq!(first.decode.id(), d1.id());
        d2.set_engine_load(Some(1));
        let mut x = Box::pin(router.route(ask));
        assert!((&mut x).now_or_never().is_none(), "held");
        assert_eq!((waiting(&limits), limits.stats().queued), (1, 1));
        // The second decode frees up: the hold lets X go, the limit finds the
        // prefill's place taken, and the first request's legs end just before X
        // looks again.
        router.inner.on_call(1, move || drop(first));
        d2.set_engine_load(Some(0));
        tokio::time::advance(HOLD_POLL).await;
        let route = (&mut x).now_or_never().expect("room").unwrap();
        assert!(route.queued, "it was held, and counted");
        assert_eq!((waiting(&limits), limits.stats().queued), (0, 1));
    }

    /// A limit around a hold: the limit's own wait counted from before the look that
    /// the hold held again, so a request held 30 s in that look then found the
    /// prefill's place taken was refused with 503 at once ("waited 30000 ms") instead
    /// of waiting its queue timeout for the place.
    #[tokio::test(start_paused = true)]
    async fn a_limit_around_a_hold_counts_its_wait_from_when_it_waits() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig {
            queue_timeout: Duration::from_secs(10),
            ..AdmissionConfig::default()
        });
        let (router, source, _, [d1, d2]) =
            limit_over_hook_over_hold(&limits, Duration::from_secs(60));
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        let first = router.route(ask).now_or_never().unwrap().unwrap();
        assert_eq!(first.decode.id(), d1.id());
        d2.set_engine_load(Some(1));
        let mut x = Box::pin(router.route(ask));
        assert!((&mut x).now_or_never().is_none(), "held");
        // The second decode frees up: the hold lets X go, and the limit finds the
        // prefill's place taken; the decode fills up again before X looks again.
        let fills = Arc::clone(&d2);
        router
            .inner
            .on_call(1, move || fills.set_engine_load(Some(1)));
        d2.set_engine_load(Some(0));
        tokio::time::advance(HOLD_POLL).await;
        assert!((&mut x).now_or_never().is_none(), "held again");
        // 30 s later the decode frees up: the hold lets X go, and the limit makes it
        // wait for the prefill's place, from now.
        tokio::time::advance(Duration::from_secs(30)).await;
        assert!((&mut x).now_or_never().is_none(), "still held");
        d2.set_engine_load(Some(0));
        tokio::time::advance(HOLD_POLL).await;
        let r = (&mut x).now_or_never();
        assert!(
            r.is_none(),
            "waits for the prefill's place: {:?}",
            r.map(|r| r.map(drop).map_err(|e| e.to_string()))
        );
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!(
            (&mut x).now_or_never().is_none(),
            "within its queue timeout"
        );
        assert_eq!(limits.stats().queue_timeouts, 0);
        // The first request's legs end: X is routed, counted once.
        drop(first);
        let route = (&mut x).now_or_never().expect("a place").unwrap();
        assert!(route.queued);
        assert_eq!((waiting(&limits), limits.stats().queued), (0, 1));
    }

    /// A limit around a hold: a held request let go by the hold and refused by the
    /// limit lost its place in the hold's line, and was held again behind a request
    /// that came after it, which then got the room before it.
    #[tokio::test(start_paused = true)]
    async fn a_request_let_go_inside_a_per_endpoint_limit_keeps_its_place_in_the_holds_line() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let (router, source, prefill, [d1, d2]) =
            limit_over_hook_over_hold(&limits, Duration::from_secs(60));
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        // The first request holds the prefill's place and the first decode; the
        // second decode's engine is full: X, then Y, are held.
        let first = router.route(ask).now_or_never().unwrap().unwrap();
        assert_eq!(first.decode.id(), d1.id());
        d2.set_engine_load(Some(1));
        let mut x = Box::pin(router.route(ask));
        assert!((&mut x).now_or_never().is_none(), "X held");
        let mut y = Box::pin(router.route(ask));
        assert!((&mut y).now_or_never().is_none(), "Y held");
        assert_eq!(crate::lock(&router.inner.inner.routed.0).unnamed.len(), 2);
        // The second decode frees up: room for one, X's (the oldest). The hold lets
        // X go; the limit finds the prefill's place taken.
        d2.set_engine_load(Some(0));
        tokio::time::advance(HOLD_POLL).await;
        assert!((&mut y).now_or_never().is_none(), "Y waits behind X");
        assert!((&mut x).now_or_never().is_none(), "X waits for the prefill");
        // The first request's legs end (the first decode's engine still runs one):
        // X, not Y, gets the room.
        drop(first);
        d1.set_engine_load(Some(1));
        tokio::time::advance(HOLD_POLL).await;
        let r = (&mut y).now_or_never();
        assert!(
            r.is_none(),
            "Y came after X: {:?}",
            r.map(|r| r.map(|r| r.decode.id().clone()).map_err(|e| e.to_string()))
        );
        let x = (&mut x).now_or_never().expect("X first").unwrap();
        assert_eq!(x.prefill.as_ref().map(|p| p.id()), Some(prefill.id()));
        assert_eq!((waiting(&limits), limits.stats().queued), (1, 2));
        drop((x, y));
        assert_eq!(waiting(&limits), 0);
        assert!(crate::lock(&router.inner.inner.routed.0).unnamed.is_empty());
    }

    /// A request that found no place in `try_admit` but one freed before `admit` ran is
    /// counted in `queued` by `admit` (its routing, told it was queued, does not count
    /// it): it was counted nowhere.
    #[tokio::test]
    async fn a_place_freed_between_try_admit_and_admit_is_counted_queued_once() {
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig {
            max_in_flight: Some(1),
            ..AdmissionConfig::default()
        });
        let running = limits.try_admit().expect("the only place");
        assert!(limits.try_admit().is_none(), "full");
        drop(running);
        let permit = limits
            .admit(None)
            .now_or_never()
            .expect("a place is free")
            .expect("admitted");
        let stats = limits.stats();
        assert_eq!((stats.waiting, stats.queued), (0, 1));
        drop(permit);
    }

    /// A request that waited for a per-endpoint place most of the queue timeout, then
    /// found every decode full and was held, waited the hold's own wait again.
    #[tokio::test(start_paused = true)]
    async fn a_hold_after_a_per_endpoint_wait_ends_within_the_queue_timeout() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig {
            queue_timeout: Duration::from_secs(10),
            ..AdmissionConfig::default()
        });
        let (router, source, [d1, d2]) =
            held_over_per_endpoint_for(&limits, Duration::from_secs(60));
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        let first = router.route(ask).now_or_never().unwrap().unwrap();
        let start = Instant::now();
        // The second decode has room: the hold lets it go, and it waits for the
        // prefill's place.
        let mut second = Box::pin(router.route(ask));
        assert!((&mut second).now_or_never().is_none());
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!((&mut second).now_or_never().is_none(), "still waits");
        // Both decodes fill up, as their engines say; the prefill's place is given
        // back: it is held.
        d1.set_engine_load(Some(1));
        d2.set_engine_load(Some(1));
        drop(first);
        assert!((&mut second).now_or_never().is_none(), "held now");
        // The queue timeout from its first wait is up.
        tokio::time::advance(start + Duration::from_secs(10) - Instant::now()).await;
        let e = (&mut second)
            .now_or_never()
            .expect("the routing's waits end with the first one's")
            .unwrap_err();
        assert!(timed_out_after(&e, 10_000), "{e}");
        let stats = limits.stats();
        assert_eq!(
            (stats.waiting, stats.queued, stats.queue_timeouts),
            (0, 1, 1)
        );
        assert!(crate::lock(&router.routed.0).unnamed.is_empty());
    }

    /// Lets the spawned tasks run until `done` holds of `limits`' stats (the test
    /// runtime is one thread: each yield runs the tasks that are ready).
    async fn settle(limits: &Limits, done: impl Fn(AdmissionStats) -> bool) -> AdmissionStats {
        for _ in 0..1000 {
            if done(limits.stats()) {
                break;
            }
            tokio::task::yield_now().await;
        }
        limits.stats()
    }

    /// A request that waited for a global permit, then for a per-endpoint place (a
    /// routed one, or an adapter's direct place), was counted in `queued` twice. Its
    /// caller says it waited ([`Ask::queued`], [`Router::place_queued`]), as the
    /// orchestrator does.
    #[tokio::test(start_paused = true)]
    async fn a_request_admitted_after_a_wait_then_waiting_for_a_place_is_queued_once() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use disagg_core::source::StaticSource;
        use futures::FutureExt;

        let limits = Arc::new(Limits::new(AdmissionConfig {
            max_in_flight: Some(1),
            ..AdmissionConfig::default()
        }));
        let router = Arc::new(limits.per_endpoint(First, 1));
        let source = Arc::new(StaticSource::new([
            endpoint("http://p:1", Role::Prefill),
            endpoint("http://d:1", Role::Decode),
        ]));
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let mut running = limits.try_admit().unwrap();
        let mut route = router
            .route(Ask::new(&view, &*source, false, None))
            .now_or_never()
            .unwrap()
            .unwrap();
        let decode = Arc::clone(&route.decode);
        let spawn = |direct: bool| {
            let (limits, router, source) = (
                Arc::clone(&limits),
                Arc::clone(&router),
                Arc::clone(&source),
            );
            let decode = Arc::clone(&decode);
            tokio::spawn(async move {
                let permit = limits.admit(None).await?;
                let route = if direct {
                    let pick = move || Ok(Arc::clone(&decode));
                    router.place_queued(&pick, None, true).await?
                } else {
                    let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
                    let view = RequestView::new(Api::Chat, None, &headers, &body);
                    let ask = Ask::new(&view, &*source, false, None).with_queued(true);
                    router.route(ask).await?
                };
                Ok::<_, PdError>((permit, route))
            })
        };
        let mut queued = 0;
        for direct in [false, true] {
            let task = spawn(direct);
            let stats = settle(&limits, |s| s.waiting == 1).await;
            queued += 1;
            assert_eq!(
                (stats.waiting, stats.queued),
                (1, queued),
                "waits for a permit"
            );
            // The permit is given back; the routed request's places are not.
            drop(running);
            let stats = settle(&limits, |s| s.queued > queued).await;
            assert_eq!(
                (stats.waiting, stats.queued),
                (1, queued),
                "waiting for a place, it is still one request that had to wait"
            );
            drop(route);
            let (permit, next) = task.await.unwrap().unwrap();
            assert_eq!(limits.stats().waiting, 0);
            (running, route) = (permit, next);
        }
        assert_eq!(limits.stats().queued, 2);
        drop((running, route));
    }

    /// A request held by an inner decode hold of the same queue, let go by it, then
    /// held by the outer one, was counted again: the inner hold gave its place in
    /// the queue back when its own routing ended, though the outer routing went on.
    #[tokio::test(start_paused = true)]
    async fn nested_holds_of_one_queue_count_a_request_once() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use disagg_core::source::{EndpointSource, StaticSource};
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let inner = Arc::new(limits.decode_hold(First, 1, Duration::from_secs(60)));
        let outer = limits.decode_hold(Arc::clone(&inner), 1, Duration::from_secs(60));
        let source = StaticSource::new([
            endpoint("http://p:1", Role::Prefill),
            endpoint("http://d:1", Role::Decode),
        ]);
        let decode = Arc::clone(&source.snapshot().by_role(Role::Decode)[0]);
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        // A request routed by the inner hold alone fills the decode for it.
        let r0 = inner.route(ask).now_or_never().unwrap().unwrap();
        // X passes the outer hold, and is held by the inner one.
        let mut x = Box::pin(outer.route(ask));
        assert!((&mut x).now_or_never().is_none());
        assert_eq!((waiting(&limits), limits.stats().queued), (1, 1));
        // The decode's engine says it is full: Z is held by the outer hold.
        decode.set_engine_load(Some(1));
        let mut z = Box::pin(outer.route(ask));
        assert!((&mut z).now_or_never().is_none());
        assert_eq!((waiting(&limits), limits.stats().queued), (2, 2));
        // The decode frees up. Z, oldest in the outer line, passes it, and waits
        // behind X in the inner line; X passes the inner hold, and finds Z ahead of
        // it in the outer line: held again.
        decode.set_engine_load(Some(0));
        drop(r0);
        tokio::time::advance(HOLD_POLL).await;
        assert!((&mut z).now_or_never().is_none());
        assert!((&mut x).now_or_never().is_none());
        let stats = limits.stats();
        assert_eq!((stats.waiting, stats.queued), (2, 2), "each counted once");
        drop((x, z));
        assert_eq!(waiting(&limits), 0);
    }

    /// A hold around a limit around a hold, all of one queue: the inner hold's ticket
    /// kept for a request while the limit routes it must leave the inner line once the
    /// limit gives its route and the outer hold holds the request. Kept while the
    /// outer hold held that request behind another held in the inner line behind it,
    /// each would wait for the other.
    #[tokio::test(start_paused = true)]
    async fn a_ticket_kept_inside_a_limit_leaves_the_line_when_the_limit_routes() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use disagg_core::source::{EndpointSource, StaticSource};
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let inner = Arc::new(limits.decode_hold(First, 1, Duration::from_secs(60)));
        let limit = limits.per_endpoint(Arc::clone(&inner), 8);
        let outer = limits.decode_hold(limit, 1, Duration::from_secs(60));
        let source = StaticSource::new([
            endpoint("http://p:1", Role::Prefill),
            endpoint("http://d:1", Role::Decode),
        ]);
        let decode = Arc::clone(&source.snapshot().by_role(Role::Decode)[0]);
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        // A request routed by the inner hold alone fills the decode for it: X passes
        // the outer hold, and is held by the inner one. The decode's engine says it
        // is full: Z is held by the outer hold.
        let r0 = inner.route(ask).now_or_never().unwrap().unwrap();
        let mut x = Box::pin(outer.route(ask));
        assert!((&mut x).now_or_never().is_none());
        decode.set_engine_load(Some(1));
        let mut z = Box::pin(outer.route(ask));
        assert!((&mut z).now_or_never().is_none());
        assert_eq!((waiting(&limits), limits.stats().queued), (2, 2));
        // The decode frees up: the inner hold lets X go, the limit routes it, and the
        // outer hold holds it behind Z. X's ticket left the inner line.
        decode.set_engine_load(Some(0));
        drop(r0);
        tokio::time::advance(HOLD_POLL).await;
        assert!((&mut x).now_or_never().is_none(), "held behind Z");
        assert!(crate::lock(&inner.routed.0).unnamed.is_empty());
        // Z, first in the outer line, passes all three.
        let z = (&mut z).now_or_never().expect("Z first").unwrap();
        assert!(z.queued);
        assert_eq!((waiting(&limits), limits.stats().queued), (1, 2));
        drop((x, z));
        assert_eq!(waiting(&limits), 0);
    }

    /// `Duration::MAX`, a common "forever", overflowed the clock and panicked.
    #[tokio::test(start_paused = true)]
    async fn a_wait_of_duration_max_waits_instead_of_panicking() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use disagg_core::source::StaticSource;
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig {
            max_in_flight: Some(1),
            queue_timeout: Duration::MAX,
            ..AdmissionConfig::default()
        });
        let source = StaticSource::new([
            endpoint("http://p:1", Role::Prefill),
            endpoint("http://d:1", Role::Decode),
        ]);
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        // The decode hold's wait.
        let hold = limits.decode_hold(First, 1, Duration::MAX);
        let route = hold.route(ask).now_or_never().unwrap().unwrap();
        let mut held = Box::pin(hold.route(ask));
        assert!((&mut held).now_or_never().is_none(), "held");
        drop(route);
        // The global queue's timeout.
        let _first = limits.try_admit().unwrap();
        let mut queued = limits.admit(None);
        assert!((&mut queued).now_or_never().is_none(), "queued");
        // The per-endpoint limit's, through the same queue.
        let per = limits.per_endpoint(First, 1);
        let _route = per.route(ask).now_or_never().unwrap().unwrap();
        let mut waiting_route = Box::pin(per.route(ask));
        assert!((&mut waiting_route).now_or_never().is_none(), "waits");
        // Forever is long: an hour later they all still wait.
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!((&mut queued).now_or_never().is_none());
        assert!((&mut waiting_route).now_or_never().is_none());
    }

    /// A per-endpoint limit (of 1) around two decode holds of one queue, one inside
    /// the other (each of 1 running request per decode), over a prefill and two
    /// decodes, the policy choosing the first: the router, the inner hold (also
    /// reachable alone), its source, the prefill and the decodes.
    #[allow(clippy::type_complexity)]
    fn limit_over_two_holds(
        limits: &Limits,
    ) -> (
        PerEndpointLimit<DecodeHold<Arc<DecodeHold<First>>>>,
        Arc<DecodeHold<First>>,
        disagg_core::source::StaticSource,
        Arc<Endpoint>,
        [Arc<Endpoint>; 2],
    ) {
        use disagg_core::source::{EndpointSource, StaticSource};

        let wait = Duration::from_secs(60);
        let inner = Arc::new(limits.decode_hold(First, 1, wait));
        let router = limits.per_endpoint(limits.decode_hold(Arc::clone(&inner), 1, wait), 1);
        let source = StaticSource::new([
            endpoint("http://p:1", Role::Prefill),
            endpoint("http://d1:1", Role::Decode),
            endpoint("http://d2:1", Role::Decode),
        ]);
        let set = source.snapshot();
        let prefill = Arc::clone(&set.by_role(Role::Prefill)[0]);
        let decodes = set.by_role(Role::Decode);
        let decodes = [Arc::clone(&decodes[0]), Arc::clone(&decodes[1])];
        (router, inner, source, prefill, decodes)
    }

    /// The tickets in the unnamed line of the hold whose lines are `routed`.
    fn line_len(routed: &Routed) -> usize {
        crate::lock(&routed.0).unnamed.len()
    }

    /// Runs [`limit_over_two_holds`] to where X, held by both holds in turn, was let
    /// go by both and waits for the prefill's per-endpoint place (taken by
    /// `blocker`), and Y, which came after X, passed the outer hold. Returns the
    /// router, the inner hold, X, Y, the blocker and the request routed by the inner
    /// hold alone that fills its first decode.
    async fn x_kept_by_two_holds_waits_in_the_limit<'a>(
        limits: &Limits,
        router: &'a PerEndpointLimit<DecodeHold<Arc<DecodeHold<First>>>>,
        inner: &'a DecodeHold<First>,
        ask: Ask<'a>,
        prefill: &Arc<Endpoint>,
        [d1, d2]: &[Arc<Endpoint>; 2],
    ) -> (Routing<'a>, Routing<'a>, Route, Route) {
        use futures::FutureExt;

        // A request routed by the inner hold alone fills the first decode for it (not
        // for the outer hold); a place on the prefill taken under the limit.
        let r0 = inner.route(ask).now_or_never().unwrap().unwrap();
        let pick = || -> Result<Arc<Endpoint>, PdError> { Ok(Arc::clone(prefill)) };
        let blocker = router.place(&pick, None).now_or_never().unwrap().unwrap();
        // Every decode's engine is full: X, then Y, are held by the outer hold.
        d1.set_engine_load(Some(1));
        d2.set_engine_load(Some(1));
        let mut x = router.route(ask);
        assert!((&mut x).now_or_never().is_none(), "X held");
        let mut y = router.route(ask);
        assert!((&mut y).now_or_never().is_none(), "Y held");
        assert_eq!((waiting(limits), limits.stats().queued), (2, 2));
        // The first decode's engine frees up: room for one in the outer hold, X's
        // (the oldest); the inner hold counts its own request there: X is held by it.
        d1.set_engine_load(Some(0));
        tokio::time::advance(HOLD_POLL).await;
        assert!(
            (&mut x).now_or_never().is_none(),
            "X held by the inner hold"
        );
        assert!((&mut y).now_or_never().is_none(), "Y behind X");
        assert_eq!(line_len(&router.inner.routed), 2);
        assert_eq!(line_len(&inner.routed), 1);
        // The second decode frees up: both holds let X go; the limit finds the
        // prefill's place taken. Y passes the outer hold.
        d2.set_engine_load(Some(0));
        tokio::time::advance(HOLD_POLL).await;
        assert!((&mut x).now_or_never().is_none(), "X waits for the prefill");
        assert!((&mut y).now_or_never().is_none(), "Y waits too");
        assert_eq!((waiting(limits), limits.stats().queued), (2, 2));
        (x, y, blocker, r0)
    }

    /// Two holds of one queue, one inside the other, inside a limit: only the outer
    /// hold kept the ticket of a request it let go while the limit found no room; the
    /// inner one's left its line, and the request was held again there behind one
    /// that came after it, which then got the room before it.
    #[tokio::test(start_paused = true)]
    async fn a_request_let_go_by_two_holds_inside_a_limit_keeps_its_place_in_each_line() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let (router, inner, source, prefill, decodes) = limit_over_two_holds(&limits);
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        let (mut x, mut y, blocker, r0) = x_kept_by_two_holds_waits_in_the_limit(
            &limits, &router, &inner, ask, &prefill, &decodes,
        )
        .await;
        // X keeps its place in both lines: Y waits behind it in the inner one.
        assert_eq!(line_len(&router.inner.routed), 2, "X's ticket and Y's");
        assert_eq!(line_len(&inner.routed), 2, "X's ticket and Y's");
        // The prefill's place is given back: X, not Y, gets it.
        drop(blocker);
        let r = (&mut y).now_or_never();
        assert!(
            r.is_none(),
            "Y came after X: {:?}",
            r.map(|r| r.map(|r| r.decode.id().clone()).map_err(|e| e.to_string()))
        );
        let x = (&mut x).now_or_never().expect("X first").unwrap();
        assert_eq!(x.prefill.as_ref().map(|p| p.id()), Some(prefill.id()));
        assert!(x.queued);
        assert_eq!((waiting(&limits), limits.stats().queued), (1, 2));
        drop((x, y, r0));
        assert_eq!(waiting(&limits), 0);
        assert_eq!(line_len(&router.inner.routed), 0);
        assert_eq!(line_len(&inner.routed), 0);
    }

    /// A request waiting in a limit with tickets kept in two holds' lines, that its
    /// client abandons, leaves both lines and the queue.
    #[tokio::test(start_paused = true)]
    async fn a_request_abandoned_in_a_limit_leaves_every_holds_line() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;

        let limits = Limits::new(AdmissionConfig::default());
        let (router, inner, source, prefill, decodes) = limit_over_two_holds(&limits);
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        let (x, y, blocker, r0) = x_kept_by_two_holds_waits_in_the_limit(
            &limits, &router, &inner, ask, &prefill, &decodes,
        )
        .await;
        drop(x);
        assert_eq!(waiting(&limits), 1, "Y only");
        assert_eq!(line_len(&router.inner.routed), 1, "Y's ticket");
        assert_eq!(line_len(&inner.routed), 1, "Y's ticket");
        drop(y);
        assert_eq!(waiting(&limits), 0);
        assert_eq!(line_len(&router.inner.routed), 0);
        assert_eq!(line_len(&inner.routed), 0);
        drop((blocker, r0));
        assert!(crate::lock(&router.places.0).is_empty());
        assert!(crate::lock(&inner.routed.0).places.is_empty());
    }

    /// Two holds of one queue inside a limit: a request whose inner hold's ticket is
    /// kept while the limit has no room, then held by the outer hold when the limit
    /// routes it again, gives that ticket up. Kept, it would stand ahead of a request
    /// that the outer hold let through before it, which would wait for it in the
    /// inner line while it waits for that request in the outer one.
    #[tokio::test(start_paused = true)]
    async fn an_inner_holds_ticket_leaves_its_line_when_an_outer_hold_holds_the_request() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let (router, inner, source, prefill, [d1, d2]) = limit_over_two_holds(&limits);
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        let _r0 = inner.route(ask).now_or_never().unwrap().unwrap();
        let pick = || -> Result<Arc<Endpoint>, PdError> { Ok(Arc::clone(&prefill)) };
        let blocker = router.place(&pick, None).now_or_never().unwrap().unwrap();
        // The second decode's engine is full: the outer hold lets X through, the inner
        // one (which counts its own request on the first decode) holds it.
        d2.set_engine_load(Some(1));
        let mut x = router.route(ask);
        assert!(
            (&mut x).now_or_never().is_none(),
            "X held by the inner hold"
        );
        assert_eq!(line_len(&inner.routed), 1);
        // It frees up: the inner hold lets X go, and the limit finds no room.
        d2.set_engine_load(Some(0));
        tokio::time::advance(HOLD_POLL).await;
        assert!((&mut x).now_or_never().is_none(), "X waits for the prefill");
        // Every decode's engine is full: Z is held by the outer hold.
        d1.set_engine_load(Some(1));
        d2.set_engine_load(Some(1));
        let mut z = router.route(ask);
        assert!((&mut z).now_or_never().is_none(), "Z held");
        // Room for one in either hold; the prefill's place is given back: X looks
        // again, and is held by the outer hold behind Z.
        d2.set_engine_load(Some(0));
        drop(blocker);
        assert!((&mut x).now_or_never().is_none(), "X held behind Z");
        assert_eq!(line_len(&router.inner.routed), 2);
        assert_eq!(line_len(&inner.routed), 0, "X's inner ticket left");
        // Z passes both holds (not held behind X in the inner line) and the limit.
        tokio::time::advance(HOLD_POLL).await;
        let z = (&mut z)
            .now_or_never()
            .expect("Z is not held behind X")
            .unwrap();
        assert!(z.queued);
        assert!((&mut x).now_or_never().is_none(), "X waits for the prefill");
        drop((x, z));
        assert_eq!(waiting(&limits), 0);
        assert_eq!(line_len(&router.inner.routed), 0);
        assert_eq!(line_len(&inner.routed), 0);
    }

    /// Runs `test` on a runtime of its own, on a thread of its own, and fails when it
    /// has not returned within 10 s: a routing that spins never gives its thread back
    /// to the runtime, so no timeout inside the test could end it.
    fn returns_in_time<F>(test: impl FnOnce() -> F + Send + 'static)
    where
        F: Future<Output = ()>,
    {
        returns_in_time_on(
            || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
            },
            test,
        )
    }

    /// [`returns_in_time`] on the runtime `runtime` builds.
    fn returns_in_time_on<F>(
        runtime: fn() -> std::io::Result<tokio::runtime::Runtime>,
        test: impl FnOnce() -> F + Send + 'static,
    ) where
        F: Future<Output = ()>,
    {
        let (done, finished) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let rt = runtime().unwrap();
            rt.block_on(test());
            let _ = done.send(());
        });
        match finished.recv_timeout(Duration::from_secs(10)) {
            // Done, or panicked (the panic is the test's failure).
            Ok(()) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                if let Err(panic) = thread.join() {
                    std::panic::resume_unwind(panic);
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                panic!("the routing never returned: it spins")
            }
        }
    }

    /// The places a limit holds on `endpoint`.
    fn places_on(limit: &Places, endpoint: &Endpoint) -> Option<usize> {
        crate::lock(&limit.0)
            .get(&(endpoint.role(), endpoint.id().clone()))
            .copied()
    }

    /// A limit around a limit of the same queue, the outer one full: the request's
    /// route from the inner limit held a place there, which the outer limit gave back
    /// (waking the requests waiting for room) after it began to listen for ends; it
    /// woke itself, routed again, and so on without ever waiting: the routing spun on
    /// its thread.
    #[test]
    fn a_limit_around_a_limit_waits_for_its_own_room_without_spinning() {
        returns_in_time(|| async {
            use disagg_core::json::JsonBody;
            use disagg_core::request::Api;
            use disagg_core::source::{EndpointSource, StaticSource};
            use futures::FutureExt;

            let limits = Limits::new(AdmissionConfig::default());
            let inner = Arc::new(limits.per_endpoint(First, 8));
            let router = limits.per_endpoint(Arc::clone(&inner), 1);
            let source = StaticSource::new([
                endpoint("http://p:1", Role::Prefill),
                endpoint("http://d:1", Role::Decode),
            ]);
            let decode = Arc::clone(&source.snapshot().by_role(Role::Decode)[0]);
            let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
            let view = RequestView::new(Api::Chat, None, &headers, &body);
            let ask = Ask::new(&view, &source, false, None);

            let first = router.route(ask).now_or_never().unwrap().unwrap();
            let mut second = Box::pin(router.route(ask));
            assert!(
                (&mut second).now_or_never().is_none(),
                "the outer limit is full: it waits"
            );
            assert_eq!((waiting(&limits), limits.stats().queued), (1, 1));
            // While it waits, it holds no place in the inner limit.
            assert_eq!(places_on(&inner.places, &decode), Some(1), "the first's");
            drop(first);
            let second = (&mut second)
                .now_or_never()
                .expect("woken when the first's places were given back")
                .unwrap();
            assert!(second.queued);
            assert_eq!(places_on(&router.places, &decode), Some(1));
            assert_eq!(places_on(&inner.places, &decode), Some(1));
            drop(second);
            assert!(crate::lock(&router.places.0).is_empty());
            assert!(crate::lock(&inner.places.0).is_empty());
        });
    }

    /// A route stashed by a test, for a [`DropsStashed`] to drop.
    type Stash = Arc<std::sync::Mutex<Option<Route>>>;

    /// Given back with its route: drops the route stashed, if any, on this thread or
    /// on another.
    struct DropsStashed {
        stash: Stash,
        same_thread: bool,
    }

    impl Drop for DropsStashed {
        fn drop(&mut self) {
            let other = self.stash.lock().unwrap_or_else(|e| e.into_inner()).take();
            match other {
                Some(other) if self.same_thread => drop(other),
                Some(other) => std::thread::scope(|s| {
                    s.spawn(move || drop(other));
                }),
                None => {}
            }
        }
    }

    /// [`First`]'s routes, each holding a [`DropsStashed`].
    struct Stashing {
        stash: Stash,
        same_thread: bool,
    }

    impl Router for Stashing {
        fn select(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
            let hook = Permit::new(DropsStashed {
                stash: Arc::clone(&self.stash),
                same_thread: self.same_thread,
            });
            Ok(First.select(req, set)?.with_holds(None, Some(hook)))
        }
    }

    /// A limit listens for ends only once it gave back the route it found no room
    /// for (else it woke itself): a place that another request gave back during that
    /// look (here from another thread, while the route's places are given back) was
    /// missed, and the request waited for a later end, or timed out.
    #[tokio::test]
    async fn a_place_given_back_while_a_limit_looks_lets_it_look_again() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use disagg_core::source::StaticSource;
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let stash = Stash::default();
        let router = limits.per_endpoint(
            Stashing {
                stash: Arc::clone(&stash),
                same_thread: false,
            },
            1,
        );
        // No prefill: `select` routes to the decode alone (`select_direct` would drop
        // the hook with `select`'s route, before the limit looks).
        let source = StaticSource::new([endpoint("http://d:1", Role::Decode)]);
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        let first = router.route(ask).now_or_never().unwrap().unwrap();
        let mut second = Box::pin(router.route(ask));
        assert!((&mut second).now_or_never().is_none(), "the decode is full");
        // The first's route is given back during the second's next look, as that
        // look's route (with no room) is; a place on another engine wakes it.
        *stash.lock().unwrap() = Some(first);
        let other = Arc::new(endpoint("http://e:1", Role::Decode));
        let pick = move || Ok(Arc::clone(&other));
        drop(router.place(&pick, None).now_or_never().unwrap().unwrap());
        let second = (&mut second)
            .now_or_never()
            .expect("the place given back during the look is seen")
            .unwrap();
        assert!(second.queued);
        assert_eq!(waiting(&limits), 0);
    }

    /// As above, the first request's route dropped on the waiting request's own
    /// thread, by a permit of the route its look gives back: that leg's end was
    /// counted as a place the look had taken and given back itself, and the request
    /// waited for another leg's end, or timed out. Whether the first's place was
    /// made outside any routing's place in the queue (`route` with room) or in one
    /// gone since (`place`, which makes one), it is a leg's end.
    #[tokio::test]
    async fn a_leg_that_ends_on_the_limits_thread_while_it_gives_back_a_route_lets_it_look_again() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use disagg_core::source::StaticSource;
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let stash = Stash::default();
        let router = limits.per_endpoint(
            Stashing {
                stash: Arc::clone(&stash),
                same_thread: true,
            },
            1,
        );
        let source = StaticSource::new([endpoint("http://d:1", Role::Decode)]);
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);
        let decode = Arc::new(endpoint("http://d:1", Role::Decode));
        let on_decode = move || Ok(Arc::clone(&decode));
        let other = Arc::new(endpoint("http://e:1", Role::Decode));
        let on_other = move || Ok(Arc::clone(&other));

        for placed in [false, true] {
            let first = if placed {
                router.place(&on_decode, None).now_or_never()
            } else {
                router.route(ask).now_or_never()
            };
            let first = first.unwrap().unwrap();
            let mut second = Box::pin(router.route(ask));
            assert!((&mut second).now_or_never().is_none(), "the decode is full");
            *stash.lock().unwrap() = Some(first);
            // A place on another engine wakes it; its look drops the first's route.
            drop(
                router
                    .place(&on_other, None)
                    .now_or_never()
                    .unwrap()
                    .unwrap(),
            );
            let second = (&mut second).now_or_never().unwrap_or_else(|| {
                panic!("the leg that ended during the look is seen (placed: {placed})")
            });
            let second = second.unwrap();
            assert!(second.queued);
            assert_eq!(waiting(&limits), 0);
            drop(second);
            assert!(crate::lock(&router.places.0).is_empty());
        }
    }

    /// A limit's place for a request sent to one engine (an adapter's, a
    /// continuation's decode or fresh prefill) never asked the router it wraps: a
    /// limit inside it (here through a hold, which passes places on) held no place for
    /// the request, and let others through past its limit.
    #[test]
    fn a_place_through_two_limits_holds_a_place_in_each_until_it_ends() {
        returns_in_time(|| async {
            use futures::FutureExt;

            let limits = Limits::new(AdmissionConfig::default());
            let inner = Arc::new(limits.per_endpoint(First, 1));
            let hold = limits.decode_hold(Arc::clone(&inner), 100, Duration::from_secs(5));
            let router = limits.per_endpoint(hold, 8);
            let decode = Arc::new(endpoint("http://d:1", Role::Decode));
            let pick = {
                let decode = Arc::clone(&decode);
                move || Ok(Arc::clone(&decode))
            };

            let first = router.place(&pick, None).now_or_never().unwrap().unwrap();
            assert_eq!(
                (
                    places_on(&router.places, &decode),
                    places_on(&inner.places, &decode)
                ),
                (Some(1), Some(1)),
                "a place in each limit"
            );
            // The inner limit is full: the next waits, holding no place meanwhile.
            let mut second = Box::pin(router.place(&pick, None));
            assert!(
                (&mut second).now_or_never().is_none(),
                "the inner limit has no room: it waits"
            );
            assert_eq!((waiting(&limits), limits.stats().queued), (1, 1));
            assert_eq!(places_on(&router.places, &decode), Some(1), "the first's");
            drop(first);
            let second = (&mut second)
                .now_or_never()
                .expect("woken when the first's places were given back")
                .unwrap();
            assert!(second.queued, "the place says it waited");
            assert_eq!(waiting(&limits), 0);
            assert_eq!(places_on(&inner.places, &decode), Some(1));
            drop(second);
            assert!(crate::lock(&router.places.0).is_empty());
            assert!(crate::lock(&inner.places.0).is_empty());

            // The other way round: the outer limit full, the inner one with room. The
            // waiter gives its inner place back while it waits, and waits.
            let limits = Limits::new(AdmissionConfig::default());
            let inner = Arc::new(limits.per_endpoint(First, 8));
            let router = limits.per_endpoint(Arc::clone(&inner), 1);
            let first = router.place(&pick, None).now_or_never().unwrap().unwrap();
            let mut second = Box::pin(router.place(&pick, None));
            assert!((&mut second).now_or_never().is_none(), "the outer is full");
            assert_eq!(places_on(&inner.places, &decode), Some(1), "the first's");
            drop(first);
            let second = (&mut second).now_or_never().expect("room").unwrap();
            assert_eq!(places_on(&inner.places, &decode), Some(1));
            assert_eq!(places_on(&router.places, &decode), Some(1));
            drop(second);
            assert!(crate::lock(&inner.places.0).is_empty());
        });
    }

    /// Every layer of a router made of holds and limits keeps its own place for a
    /// route until the route ends: a layer's place added beside the ones the router
    /// it wraps gave ([`Route::with_holds`]), never in their stead.
    #[tokio::test(start_paused = true)]
    async fn each_of_two_holds_and_two_limits_keeps_its_place_until_the_route_ends() {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;
        use disagg_core::source::{EndpointSource, StaticSource};
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let wait = Duration::from_secs(5);
        let inner_hold = Arc::new(limits.decode_hold(First, 1, wait));
        let inner_limit = Arc::new(limits.per_endpoint(Arc::clone(&inner_hold), 1));
        let outer_hold = Arc::new(limits.decode_hold(Arc::clone(&inner_limit), 1, wait));
        let router = limits.per_endpoint(Arc::clone(&outer_hold), 1);
        let source = StaticSource::new([
            endpoint("http://p:1", Role::Prefill),
            endpoint("http://d:1", Role::Decode),
        ]);
        let set = source.snapshot();
        let (prefill, decode) = (
            &set.by_role(Role::Prefill)[0],
            &set.by_role(Role::Decode)[0],
        );
        let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
        let view = RequestView::new(Api::Chat, None, &headers, &body);
        let ask = Ask::new(&view, &source, false, None);

        let route = router.route(ask).await.unwrap();
        let held = || {
            [&router.places, &inner_limit.places]
                .map(|limit| (places_on(limit, prefill), places_on(limit, decode)))
        };
        let hold_places = || {
            [&outer_hold.routed, &inner_hold.routed]
                .map(|hold| crate::lock(&hold.0).places.get(decode.id()).copied())
        };
        assert_eq!(held(), [(Some(1), Some(1)); 2]);
        assert_eq!(hold_places(), [Some(1); 2]);
        // Every layer is full: another request waits.
        let mut next = Box::pin(router.route(ask));
        assert!((&mut next).now_or_never().is_none());
        drop(route);
        assert_eq!(held(), [(None, None); 2]);
        assert_eq!(hold_places(), [None; 2]);
        tokio::time::advance(HOLD_POLL).await;
        let next = (&mut next).now_or_never().expect("room").unwrap();
        assert_eq!(hold_places(), [Some(1); 2]);
        drop(next);
    }

    /// A request whose route has room on its decode but not on its prefill waits
    /// holding no place on the decode, in either order of a hold and a limit: each
    /// route's places are taken together (the limit's under one lock, the hold's once
    /// the router it wraps gave its route), and a route a layer finds no room for is
    /// given back before the layer waits. A request for that decode alone is not
    /// held behind it.
    #[test]
    fn a_request_waiting_for_its_prefills_place_holds_no_place_on_its_decode() {
        returns_in_time(|| async {
            use disagg_core::json::JsonBody;
            use disagg_core::request::Api;
            use disagg_core::source::{EndpointSource, StaticSource};
            use futures::FutureExt;

            let limits = Limits::new(AdmissionConfig::default());
            let wait = Duration::from_secs(5);
            let held_limit = Arc::new(limits.per_endpoint(First, 1));
            let hold_around = limits.decode_hold(Arc::clone(&held_limit), 1, wait);
            let inner_hold = Arc::new(limits.decode_hold(First, 1, wait));
            let limit_around = limits.per_endpoint(Arc::clone(&inner_hold), 1);
            let source = StaticSource::new([
                endpoint("http://p:1", Role::Prefill),
                endpoint("http://d:1", Role::Decode),
            ]);
            let set = source.snapshot();
            let (prefill, decode) = (
                &set.by_role(Role::Prefill)[0],
                &set.by_role(Role::Decode)[0],
            );
            let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
            let view = RequestView::new(Api::Chat, None, &headers, &body);
            let ask = Ask::new(&view, &source, false, None);
            let direct = Ask::new(&view, &source, true, None);
            let pick = || -> Result<Arc<Endpoint>, PdError> { Ok(Arc::clone(prefill)) };

            // The hold around the limit (the proxy's order).
            let blocker = hold_around
                .place(&pick, None)
                .now_or_never()
                .unwrap()
                .unwrap();
            let mut x = Box::pin(hold_around.route(ask));
            assert!((&mut x).now_or_never().is_none(), "X waits for the prefill");
            assert_eq!(places_on(&held_limit.places, decode), None);
            let d = hold_around.route(direct).now_or_never();
            let d = d
                .expect("a request for the decode alone is not held")
                .unwrap();
            drop((d, blocker));
            let x = (&mut x).now_or_never().expect("room").unwrap();
            drop(x);

            // The limit around the hold.
            let blocker = limit_around
                .place(&pick, None)
                .now_or_never()
                .unwrap()
                .unwrap();
            let mut x = Box::pin(limit_around.route(ask));
            assert!((&mut x).now_or_never().is_none(), "X waits for the prefill");
            assert_eq!(places_on(&limit_around.places, decode), None);
            assert!(crate::lock(&inner_hold.routed.0).places.is_empty());
            let d = limit_around.route(direct).now_or_never();
            let d = d
                .expect("a request for the decode alone is not held")
                .unwrap();
            drop((d, blocker));
            let x = (&mut x).now_or_never().expect("room").unwrap();
            drop(x);
            assert_eq!(waiting(&limits), 0);
        });
    }

    /// A limit of 1 around a limit of 8 of the same queue, over a prefill and a decode,
    /// the inner one routing through a [`Hook`] (which counts its routings): the outer
    /// limit, the inner one and the source.
    #[allow(clippy::type_complexity)]
    fn limit_around_counted_limit(
        limits: &Limits,
    ) -> (
        Arc<PerEndpointLimit<Arc<PerEndpointLimit<Hook<First>>>>>,
        Arc<PerEndpointLimit<Hook<First>>>,
        Arc<disagg_core::source::StaticSource>,
    ) {
        let inner = Arc::new(limits.per_endpoint(Hook::new(First), 8));
        let router = Arc::new(limits.per_endpoint(Arc::clone(&inner), 1));
        let source = Arc::new(disagg_core::source::StaticSource::new([
            endpoint("http://p:1", Role::Prefill),
            endpoint("http://d:1", Role::Decode),
        ]));
        (router, inner, source)
    }

    /// A task routing a request through `router` over `source`, which gives its route
    /// back at once.
    fn route_and_drop(
        router: &Arc<PerEndpointLimit<Arc<PerEndpointLimit<Hook<First>>>>>,
        source: &Arc<disagg_core::source::StaticSource>,
    ) -> tokio::task::JoinHandle<Result<(), PdError>> {
        route_and_drop_counted(router, source, Arc::default())
    }

    /// [`route_and_drop`], counting in `polls` each time the task is polled.
    fn route_and_drop_counted(
        router: &Arc<PerEndpointLimit<Arc<PerEndpointLimit<Hook<First>>>>>,
        source: &Arc<disagg_core::source::StaticSource>,
        polls: Arc<AtomicUsize>,
    ) -> tokio::task::JoinHandle<Result<(), PdError>> {
        use disagg_core::json::JsonBody;
        use disagg_core::request::Api;

        let (router, source) = (Arc::clone(router), Arc::clone(source));
        let mut routing = Box::pin(async move {
            let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
            let view = RequestView::new(Api::Chat, None, &headers, &body);
            let ask = Ask::new(&view, &*source, false, None);
            router.route(ask).await.map(drop)
        });
        tokio::spawn(std::future::poll_fn(move |cx| {
            polls.fetch_add(1, Ordering::Relaxed);
            routing.as_mut().poll(cx)
        }))
    }

    /// Two requests wait behind a limit around a limit of the same queue, the outer
    /// one full (a long stream holds its place). Each look of one took a place in the
    /// inner limit and gave it back, which woke the other; its look woke the first,
    /// and so on: they routed without end, thousands of times, and held the runtime's
    /// thread until the stream ended. A place given back by a look, which frees no
    /// room a leg held, lets a waiter look again once a poll has passed, not at once.
    #[test]
    fn waiters_behind_a_limit_around_a_limit_do_not_wake_each_other_without_end() {
        returns_in_time_on(
            || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .start_paused(true)
                    .build()
            },
            || async {
                use disagg_core::json::JsonBody;
                use disagg_core::request::Api;
                use futures::FutureExt;

                let limits = Limits::new(AdmissionConfig::default());
                let (router, inner, source) = limit_around_counted_limit(&limits);
                let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
                let view = RequestView::new(Api::Chat, None, &headers, &body);
                let ask = Ask::new(&view, &*source, false, None);
                let stream = router.route(ask).now_or_never().unwrap().unwrap();
                let (a, b) = (
                    route_and_drop(&router, &source),
                    route_and_drop(&router, &source),
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
                assert_eq!(waiting(&limits), 2);
                // The stream's routing, two each to start (one in `route`, one in the
                // wait), then one for each waiter every poll at most.
                let picks = inner.inner.calls.load(Ordering::Relaxed);
                let most = 5 + 2 * (50 / RETURN_POLL.as_millis() as usize + 1);
                assert!(picks <= most, "{picks} routings in 50 ms");
                // The stream ends: one gets its room, then the other.
                drop(stream);
                a.await.unwrap().unwrap();
                b.await.unwrap().unwrap();
                assert_eq!(waiting(&limits), 0);
                assert!(crate::lock(&inner.places.0).is_empty());
            },
        );
    }

    /// Many requests wait behind a limit around a limit of the same queue, the outer
    /// one full. Each look of one gave back the places the inner limit took for it,
    /// and each place given back woke every other waiter (which then only noted that
    /// it would look again after the poll): W waiters each looking once a poll woke
    /// each other up to W² times a poll (here 5,166 polls in 100 ms; 981 now).
    /// A waiter now hears places that looks gave back only while no look of its own is
    /// due: it is polled when its look is due, and at most once more before the next
    /// (the first such place after its look, which sets that look).
    #[test]
    fn waiters_behind_a_limit_around_a_limit_are_woken_by_returned_places_once_a_look() {
        returns_in_time_on(
            || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .start_paused(true)
                    .build()
            },
            || async {
                use disagg_core::json::JsonBody;
                use disagg_core::request::Api;
                use futures::FutureExt;

                const WAITERS: usize = 50;
                const FOR: Duration = Duration::from_millis(100);
                let limits = Limits::new(AdmissionConfig::default());
                let (router, inner, source) = limit_around_counted_limit(&limits);
                let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
                let view = RequestView::new(Api::Chat, None, &headers, &body);
                let ask = Ask::new(&view, &*source, false, None);
                let stream = router.route(ask).now_or_never().unwrap().unwrap();
                let polls = Arc::new(AtomicUsize::new(0));
                let start = Instant::now();
                let mut waiters = Vec::new();
                for i in 0..WAITERS {
                    waiters.push(route_and_drop_counted(&router, &source, Arc::clone(&polls)));
                    // Arriving across a poll period (the timer counts whole
                    // milliseconds: 10 groups of 5), they look at different times, as
                    // requests do; looking all at once, each look would find the
                    // others already woken, by their own timers.
                    if i % 5 == 4 {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
                tokio::time::sleep_until(start + FOR).await;
                assert_eq!(waiting(&limits), WAITERS as u64);
                // Each waiter: its first poll and one return heard before its first
                // look is due, then two polls a poll period (its look, the first
                // return after it), over at most one period more than fit in the
                // time (a look due at its end): 2 + 2 * 11 = 24 polls, c = 2.4 for
                // `polls <= c * waiters * periods`; 3 leaves room for a stray wake.
                let periods = (FOR.as_millis() / RETURN_POLL.as_millis()) as usize;
                let most = 3 * WAITERS * periods;
                let polled = polls.load(Ordering::Relaxed);
                assert!(
                    polled <= most,
                    "{polled} polls of {WAITERS} waiters in {FOR:?}"
                );
                // Their looks, as before: one a poll period each at most.
                let picks = inner.inner.calls.load(Ordering::Relaxed);
                let looks = 1 + 2 * WAITERS + WAITERS * (periods + 1);
                assert!(picks <= looks, "{picks} routings in {FOR:?}");
                // The stream ends: each gets its room in turn.
                drop(stream);
                for waiter in waiters {
                    waiter.await.unwrap().unwrap();
                }
                assert_eq!(waiting(&limits), 0);
                assert!(crate::lock(&inner.places.0).is_empty());
                assert!(crate::lock(&router.places.0).is_empty());
            },
        );
    }

    /// As above, on a runtime of two threads: each waiter also routed again at once
    /// when the other gave a place back during its look, without waiting and without
    /// looking at its timeout, so the two routed some 80 times a millisecond until
    /// their queue timeout. A waiter looks again at once only when a leg ended during
    /// its look, and not past its timeout.
    #[test]
    fn waiters_behind_a_limit_around_a_limit_time_out_on_two_threads() {
        returns_in_time_on(
            || {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
            },
            || async {
                use disagg_core::json::JsonBody;
                use disagg_core::request::Api;
                use futures::FutureExt;

                let limits = Limits::new(AdmissionConfig {
                    queue_timeout: Duration::from_millis(200),
                    ..AdmissionConfig::default()
                });
                let (router, inner, source) = limit_around_counted_limit(&limits);
                let (headers, body) = (http::HeaderMap::new(), JsonBody::default());
                let view = RequestView::new(Api::Chat, None, &headers, &body);
                let ask = Ask::new(&view, &*source, false, None);
                let _stream = router.route(ask).now_or_never().unwrap().unwrap();
                let start = std::time::Instant::now();
                let (a, b) = (
                    route_and_drop(&router, &source),
                    route_and_drop(&router, &source),
                );
                for waiter in [a, b] {
                    let e = waiter.await.unwrap().unwrap_err();
                    assert_eq!(e.http().code, "queue_timeout");
                }
                let elapsed = start.elapsed();
                assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");
                assert_eq!(waiting(&limits), 0);
                // The stream's routing, two each to start (one in `route`, one in the
                // wait), then one for each waiter every poll at most.
                let picks = inner.inner.calls.load(Ordering::Relaxed);
                let polls = elapsed.as_millis() / RETURN_POLL.as_millis() + 1;
                let most = 5 + 2 * usize::try_from(polls).unwrap();
                assert!(picks <= most, "{picks} routings in {elapsed:?}");
            },
        );
    }

    /// A request placed on one engine without room picked it, found no room, and
    /// picked it again at once (placing it in the router it wraps again) before it
    /// waited: the counts read before its first look tell it whether to look again.
    #[tokio::test]
    async fn a_place_without_room_picks_once_before_it_waits() {
        use futures::FutureExt;

        let limits = Limits::new(AdmissionConfig::default());
        let router = limits.per_endpoint(First, 1);
        let decode = Arc::new(endpoint("http://d:1", Role::Decode));
        let picks = Arc::new(AtomicUsize::new(0));
        let pick = {
            let (decode, picks) = (Arc::clone(&decode), Arc::clone(&picks));
            move || {
                picks.fetch_add(1, Ordering::Relaxed);
                Ok(Arc::clone(&decode))
            }
        };
        let first = router.place(&pick, None).now_or_never().unwrap().unwrap();
        assert_eq!(picks.swap(0, Ordering::Relaxed), 1);
        let mut second = Box::pin(router.place(&pick, None));
        assert!((&mut second).now_or_never().is_none(), "no room: it waits");
        assert_eq!(
            picks.swap(0, Ordering::Relaxed),
            1,
            "one look, then the wait"
        );
        drop(first);
        let second = (&mut second).now_or_never().expect("room").unwrap();
        assert!(second.queued);
        assert_eq!(picks.load(Ordering::Relaxed), 1);
    }
}
