//! The decode hold ([`DecodeHold`]): a router that keeps a request back, in the
//! admission's queue, while every decode endpoint of its model is saturated.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use disagg_core::endpoint::{Endpoint, EndpointId, EndpointSet, Role};
use disagg_core::error::{PdError, RouteError};
use disagg_core::outcome::Outcome;
use disagg_core::policy::Permit;
use disagg_core::router::{Ask, RequestView, Route, Router, Routing};
use futures::future::{BoxFuture, Either};
use tokio::time::Instant;

use super::{Bound, HOLD_POLL, QUEUED, Queued, State, give_back, take};

/// A [`Router`] that holds a request while every decode endpoint of its model is
/// saturated, made by [`Limits::decode_hold`](super::Limits::decode_hold) (see the
/// [module](super) docs).
///
/// A decode's count is the larger of its
/// [`Endpoint::load`](disagg_core::endpoint::Endpoint::load) and the requests this hold
/// routed to it whose attempt has not ended (a request counts from its routing, before
/// its prefill runs; the place is the route's decode hold). Held requests get room in
/// their order of arrival, and a new request waits behind them: behind those of its own
/// model, when endpoints declare models (they wait for other decodes). Inside a
/// [`PerEndpointLimit`](super::PerEndpointLimit), a request it lets go keeps its place in
/// the line while the limit finds no room for its route and routes it again through
/// this hold: it is not held behind requests that came after it. Each hold of the queue
/// that the request passes (one inside another) keeps its own place for it so, until
/// a hold around it holds the request again: then the request gives up its places in
/// the lines of the holds inside that one, so that no two requests wait for each other
/// in two lines.
///
/// A request it holds, then lets go to wait for a per-endpoint place (or that waited
/// for one, then is held), keeps one place in the queue throughout, whether this hold
/// wraps the [`PerEndpointLimit`](super::PerEndpointLimit) or is wrapped by it: it is
/// counted once in `waiting` and `queued`, and never refused with 429 for a wait it is
/// already in. Its waits end at the earliest end any of them set (this hold's `wait`
/// from the routing's start, the queue timeout from the per-endpoint wait's start, or
/// the deadline), with 503 `queue_timeout`: at most one timeout in all. A request that waited before, for its
/// global permit or in an earlier routing ([`Ask::queued`]), is not counted in
/// `queued` again; the route of one it held says so ([`Route::queued`]), and so does
/// the error of one it held that then got no route (the router it wraps found no
/// prefill, say) or timed out ([`PdError::with_queued`]).
///
/// Cost per request: a boxed routing future with its place in the queue (one small
/// allocation), two short locks (the check, then the count), a snapshot of the
/// endpoint set and one `load` per decode endpoint of the model; one more lock when
/// the attempt ends. Inside a per-endpoint limit, the place in the queue is the
/// limit's, which boxes its own routing around this one (see
/// [`PerEndpointLimit`](super::PerEndpointLimit)); a request held there and let go
/// keeps its ticket in the place's list of kept tickets (one small allocation, for
/// the first ticket kept).
#[derive(Debug)]
pub struct DecodeHold<R> {
    pub(super) inner: R,
    pub(super) state: Arc<State>,
    pub(super) max_running: usize,
    pub(super) wait: Duration,
    /// This proxy's requests routed to each decode endpoint whose attempt has not ended.
    pub(super) routed: Arc<Routed>,
}

/// The requests this hold let through, per decode endpoint, counted from the moment
/// they are routed to the end of their attempt. An endpoint's in-flight count takes a
/// request only once its decode leg is sent, after the prefill: without this, every
/// request whose prefill is running would be invisible to the hold, and requests
/// released at the same poll would all find the same free place.
///
/// It also keeps the held requests of each model in their order of arrival (see
/// [`line`]): room goes to the oldest first, and a new request waits behind them.
#[derive(Debug, Default)]
pub(super) struct Routed(pub(super) std::sync::Mutex<Counts>);

/// What [`Routed`] keeps.
#[derive(Debug, Default)]
pub(super) struct Counts {
    /// Places per decode endpoint.
    pub(super) places: HashMap<EndpointId, usize>,
    /// The tickets of the requests held, oldest first, per named line; a line leaves
    /// with its last ticket.
    pub(super) held: HashMap<Box<str>, BTreeSet<u64>>,
    /// The tickets of the unnamed line (see [`line`]).
    pub(super) unnamed: BTreeSet<u64>,
    /// The next ticket.
    next: u64,
}

impl Counts {
    /// The tickets held in `line`, if any.
    fn line(&self, line: Option<&str>) -> Option<&BTreeSet<u64>> {
        match line {
            None => Some(&self.unnamed),
            Some(model) => self.held.get(model),
        }
    }

    /// A new ticket, held at the end of `line`.
    fn hold(&mut self, line: Option<&str>) -> u64 {
        let ticket = self.next;
        self.next += 1;
        match line {
            None => self.unnamed.insert(ticket),
            Some(model) => self.held.entry(model.into()).or_default().insert(ticket),
        };
        ticket
    }

    /// `ticket` leaves `line`.
    fn leave(&mut self, line: Option<&str>, ticket: u64) {
        match line {
            None => {
                self.unnamed.remove(&ticket);
            }
            Some(model) => {
                if let Some(tickets) = self.held.get_mut(model) {
                    tickets.remove(&ticket);
                    if tickets.is_empty() {
                        self.held.remove(model);
                    }
                }
            }
        }
    }
}

/// The line a request for `model` waits in over `set` (every model's endpoints): held
/// requests wait only behind those held for the same model, whose decodes they wait
/// for. When no endpoint declares a model, every request goes to the same decodes and
/// waits in one line (`None`); a request naming no model is the one model served's, if
/// there is just one.
fn line<'s>(set: &'s EndpointSet, model: Option<&'s str>) -> Option<&'s str> {
    match set.served_models() {
        [] => None,
        [only] if model.is_none() => Some(only),
        _ => model,
    }
}

/// A held request's ticket in its line, leaving it when the request is routed or
/// gives up.
struct Ticket<'a> {
    routed: &'a Routed,
    line: Option<Box<str>>,
    ticket: u64,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        crate::lock(&self.routed.0).leave(self.line.as_deref(), self.ticket);
    }
}

impl Ticket<'_> {
    /// The same place in the same line, kept in the request's [`Queued`] (`routed` is
    /// this ticket's): it stays in the line.
    fn into_kept(self, routed: Arc<Routed>) -> Kept {
        // Not dropped, so not left: what it holds is taken (its line) or needs no drop.
        let mut this = std::mem::ManuallyDrop::new(self);
        Kept {
            routed,
            ticket: Some((this.line.take(), this.ticket)),
        }
    }
}

/// A held request's ticket in a hold's line, kept in its routing's [`Queued`] from the
/// moment the hold lets it go, when a router of the same admission wraps the hold (a
/// per-endpoint limit, another hold): that router may route the request through the
/// hold again (a limit that finds no room for the route), which then finds its place
/// in its line (it is not held behind requests that came after it). It leaves the line
/// when dropped: when its hold takes it back, when another hold holds the request
/// ([`Queued`]'s `drop_kept`), or when the routing ends.
#[derive(Debug)]
pub(super) struct Kept {
    routed: Arc<Routed>,
    /// Its line and its number there; `None` once the hold took it back.
    ticket: Option<(Option<Box<str>>, u64)>,
}

impl Kept {
    /// Whether it is a ticket in `routed`'s lines (a hold's).
    pub(super) fn is_of(&self, routed: &Arc<Routed>) -> bool {
        Arc::ptr_eq(&self.routed, routed)
    }

    /// Whether `other` is a ticket of the same hold.
    pub(super) fn same_hold(&self, other: &Kept) -> bool {
        self.is_of(&other.routed)
    }

    /// The ticket back in the hold whose lines are `routed` (this ticket's), still in
    /// its line.
    fn into_ticket(mut self, routed: &Routed) -> Option<Ticket<'_>> {
        let (line, ticket) = self.ticket.take()?;
        Some(Ticket {
            routed,
            line,
            ticket,
        })
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        if let Some((line, ticket)) = self.ticket.take() {
            crate::lock(&self.routed.0).leave(line.as_deref(), ticket);
        }
    }
}

/// One request's place in [`Routed`], given back when the attempt ends (the route's
/// decode hold is dropped). An endpoint's entry leaves with its last place.
struct RoutedPlace {
    routed: Arc<Routed>,
    decode: EndpointId,
}

impl Drop for RoutedPlace {
    fn drop(&mut self) {
        give_back(&mut crate::lock(&self.routed.0).places, &self.decode);
    }
}

impl<R: Router> DecodeHold<R> {
    /// Whether the decodes of the request's model have room for it: more free places
    /// than requests held ahead of it in its model's [`line`] (the whole line, for one
    /// not yet held; true when the model has no decode: routing says why). A decode's
    /// count is the larger of its [load](disagg_core::endpoint::Endpoint::load) and the
    /// requests this hold routed to it that have not ended.
    fn has_room(&self, ask: &Ask<'_>, counts: &Counts, ticket: Option<&Ticket<'_>>) -> bool {
        let all = ask.source.snapshot();
        let Ok(set) = all.for_model(ask.view.model) else {
            return true;
        };
        let decodes = set.by_role(Role::Decode);
        if decodes.is_empty() {
            return true;
        }
        let free: usize = decodes
            .iter()
            .map(|d| {
                let ours = counts.places.get(d.id()).copied().unwrap_or(0);
                self.max_running.saturating_sub(d.load().max(ours))
            })
            .sum();
        let ahead = match ticket {
            None => counts
                .line(line(&all, ask.view.model))
                .map_or(0, BTreeSet::len),
            Some(t) => counts
                .line(t.line.as_deref())
                .map_or(0, |held| held.range(..t.ticket).count()),
        };
        free > ahead
    }

    /// `route` with a place counted on its decode, when the decodes of the model still
    /// have room for the request: checked and counted under one lock, so that requests
    /// let through at the same time cannot all take the same free place. `None` when
    /// they filled up since the request was routed.
    fn admit(&self, ask: &Ask<'_>, route: Route, ticket: Option<&Ticket<'_>>) -> Option<Route> {
        let mut counts = crate::lock(&self.routed.0);
        if !self.has_room(ask, &counts, ticket) {
            return None;
        }
        let decode = route.decode.id().clone();
        take(&mut counts.places, decode.clone());
        drop(counts);
        let place = RoutedPlace {
            routed: Arc::clone(&self.routed),
            decode,
        };
        Some(route.with_holds(None, Some(Permit::new(place))))
    }

    /// Routes the request once the decodes of its model have room, holding it in the
    /// queue meanwhile, in its routing's place `queued`. When `keep` (a router of this
    /// admission wraps this hold, and may route the request through it again: a
    /// per-endpoint limit whose route has no room, an outer hold), the ticket of a
    /// request it held is kept in `queued` when it lets it go, beside those of other
    /// holds, and taken back when it is routed again ([`Kept`]). When it holds the
    /// request, the tickets kept for it in other holds' lines leave them.
    async fn route_with_room(
        &self,
        ask: Ask<'_>,
        queued: &Queued,
        keep: bool,
    ) -> Result<Route, PdError> {
        // The hold's own wait, from the routing's start; once it holds the request,
        // its routing's waits end at the earliest end any of them set.
        let own = Bound::new(Instant::now(), self.wait, ask.deadline);
        // Once held: its place in the hold's line (its place in the queue is
        // `queued`'s, counted then or already, when the router it wraps made it wait).
        // Held before in this routing, and let go: that place, where it looks at once.
        let mut held: Option<Ticket<'_>> = if keep {
            queued
                .take_kept(&self.routed)
                .and_then(|kept| kept.into_ticket(&self.routed))
        } else {
            None
        };
        loop {
            let ticket = held.as_ref();
            let room = self.has_room(&ask, &crate::lock(&self.routed.0), ticket);
            if room {
                // The policy chooses the decode (a saturated one too, when it
                // prefers it: the hold only keeps requests back while every decode
                // is full); the place is counted if room is still left.
                let route = self.inner.route(ask).await?;
                if let Some(mut route) = self.admit(&ask, route, ticket) {
                    // Held: counted as queued (now or before), which later routings
                    // of the request are told.
                    route.queued |= held.is_some();
                    if keep && let Some(ticket) = held {
                        queued.keep(ticket.into_kept(Arc::clone(&self.routed)));
                    }
                    return Ok(route);
                }
            }
            // Every time: a wait of the router it wraps, since the last look, may have
            // brought the end nearer.
            let Bound { since, until } = queued.enqueue(own, ask.queued)?;
            if held.is_none() {
                let line = line(&ask.source.snapshot(), ask.view.model).map(Box::from);
                let ticket = crate::lock(&self.routed.0).hold(line.as_deref());
                let ticket = Ticket {
                    routed: &self.routed,
                    line,
                    ticket,
                };
                held = Some(ticket);
            }
            if Instant::now() >= until {
                return Err(self.state.timed_out(since));
            }
            // Held here: the tickets kept for it in other holds' lines leave them.
            // They are those of the holds inside this one (which it reaches after
            // this one; the holds around it have taken theirs back), and of holds
            // beside it that a router routed it through first. Kept, one would stand
            // ahead of a request this hold let through before it, which could then
            // wait behind it in that line while it waits behind that request here.
            queued.drop_kept();
            tokio::time::sleep_until((Instant::now() + HOLD_POLL).min(until)).await;
        }
    }
}

impl<R: Router> Router for DecodeHold<R> {
    fn select(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        self.inner.select(req, set)
    }

    fn select_direct(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        self.inner.select_direct(req, set)
    }

    fn route<'a>(&'a self, ask: Ask<'a>) -> Routing<'a> {
        Either::Right(Box::pin(async move {
            // Its one place in the queue, whether it waits here or in the router it
            // wraps (which finds it in `QUEUED`); looked up when first polled, so that
            // a router of the same queue wrapping this hold (a per-endpoint limit, a
            // hold), polling it in its own place, shares that place; this hold then
            // keeps its ticket there when it lets the request go.
            let (queued, new) = Queued::for_routing(&self.state);
            let routed = QUEUED
                .scope(
                    Arc::clone(&queued),
                    self.route_with_room(ask, &queued, !new),
                )
                .await;
            // Not when the future is dropped: a caller may keep it after it is ready.
            // Only by the routing that made the place: a router wrapping this one of
            // the same queue may still hold the request (its routing ends the place,
            // and marks an error of one that waited).
            if new {
                return queued.end(routed);
            }
            routed
        }))
    }

    // A request sent to one engine by an adapter is not held (it has no prefill to
    // keep back); the router it wraps places it.
    fn place<'a>(
        &'a self,
        pick: &'a (dyn Fn() -> Result<Arc<Endpoint>, PdError> + Send + Sync),
        deadline: Option<Instant>,
    ) -> BoxFuture<'a, Result<Route, PdError>> {
        self.inner.place(pick, deadline)
    }

    fn place_queued<'a>(
        &'a self,
        pick: &'a (dyn Fn() -> Result<Arc<Endpoint>, PdError> + Send + Sync),
        deadline: Option<Instant>,
        queued: bool,
    ) -> BoxFuture<'a, Result<Route, PdError>> {
        self.inner.place_queued(pick, deadline, queued)
    }

    fn observe(&self, route: &Route, outcome: Outcome) {
        self.inner.observe(route, outcome)
    }

    fn wants_tokens(&self) -> bool {
        self.inner.wants_tokens()
    }
}
