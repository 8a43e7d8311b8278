//! Routing: the [`Router`] trait, the [`Route`] it returns, and the simple policies.
//!
//! A router is a synchronous, cheap decision over a snapshot: it reads the request's
//! top level through a [`RequestView`] and the live load carried by each
//! [`Endpoint`], and returns a prefill and a decode endpoint. It does no I/O and never
//! waits.

use std::sync::Arc;

use http::HeaderMap;

use crate::body::JsonBody;
use crate::endpoint::{Endpoint, EndpointSet};
use crate::error::RouteError;
use crate::policy::{LeastInFlightPick, PerLeg, RoundRobinPick};
use crate::request::{Api, PdRequest};

/// What a router may read of a request.
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
}

impl<'a> From<&'a PdRequest> for RequestView<'a> {
    fn from(req: &'a PdRequest) -> Self {
        RequestView {
            api: req.api(),
            model: req.model(),
            headers: req.headers(),
            body: req.body(),
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
        }
    }

    /// The same route with data-parallel ranks named for each leg.
    pub fn with_ranks(mut self, prefill_rank: Option<u32>, decode_rank: Option<u32>) -> Self {
        self.prefill_rank = prefill_rank;
        self.decode_rank = decode_rank;
        self
    }
}

/// How a request ended, as fed back to [`Router::observe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The decode answer was delivered in full.
    Success,
    /// The request failed on the prefill leg.
    PrefillFailed,
    /// The request failed on the decode leg.
    DecodeFailed,
    /// The client went away first.
    Cancelled,
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
    /// (a [`Disaggregate`](crate::disaggregate::Disaggregate) hook chose not to
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

    /// Optional feedback: how a routed request ended. The default does nothing.
    fn observe(&self, _route: &Route, _outcome: Outcome) {}
}

impl<T: Router + ?Sized> Router for Arc<T> {
    fn select(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        (**self).select(req, set)
    }

    fn select_direct(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        (**self).select_direct(req, set)
    }

    fn observe(&self, route: &Route, outcome: Outcome) {
        (**self).observe(route, outcome)
    }
}

/// Independent round-robin over the prefill and the decode endpoints.
///
/// Use it when engines are alike and requests are alike; it needs no load signal.
/// (A [`PerLeg`] of two [`RoundRobinPick`]s.)
#[derive(Debug)]
pub struct RoundRobin {
    legs: PerLeg,
}

impl Default for RoundRobin {
    fn default() -> Self {
        Self::new()
    }
}

impl RoundRobin {
    /// A round-robin router starting at the first endpoint of each role.
    pub fn new() -> Self {
        RoundRobin {
            legs: PerLeg::new(RoundRobinPick::new(), RoundRobinPick::new()),
        }
    }
}

impl Router for RoundRobin {
    fn select(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        self.legs.select(req, set)
    }

    fn select_direct(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        self.legs.select_direct(req, set)
    }
}

/// The endpoint of each role with the fewest requests in flight.
///
/// In-flight requests are counted until their response body ends, so long streams weigh
/// as long as they last. Ties are broken round-robin, so an idle set is still spread.
/// Use it when request lengths vary widely. (A [`PerLeg`] of two [`LeastInFlightPick`]s.)
#[derive(Debug)]
pub struct LeastInFlight {
    legs: PerLeg,
}

impl Default for LeastInFlight {
    fn default() -> Self {
        Self::new()
    }
}

impl LeastInFlight {
    /// A least-in-flight router.
    pub fn new() -> Self {
        LeastInFlight {
            legs: PerLeg::new(LeastInFlightPick::new(), LeastInFlightPick::new()),
        }
    }
}

impl Router for LeastInFlight {
    fn select(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        self.legs.select(req, set)
    }

    fn select_direct(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        self.legs.select_direct(req, set)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Role;

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
        RequestView {
            api: Api::Chat,
            model: None,
            headers: h,
            body: b,
        }
    }

    #[test]
    fn round_robin_cycles_each_role_independently() {
        let s = set(2, 3);
        let (h, b) = (HeaderMap::new(), JsonBody::default());
        let rr = RoundRobin::new();
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
            RoundRobin::new().select(&view(&h, &b), &set(1, 0)),
            Err(RouteError::NoDecode)
        ));
        let r = RoundRobin::new().select(&view(&h, &b), &set(0, 1)).unwrap();
        assert!(r.prefill.is_none());
    }

    #[test]
    fn least_in_flight_prefers_idle_endpoints() {
        let s = set(2, 2);
        let (h, b) = (HeaderMap::new(), JsonBody::default());
        let _busy_p = s.prefill()[0].track();
        let _busy_d1 = s.decode()[1].track();
        let _busy_d1b = s.decode()[1].track();
        let lif = LeastInFlight::new();
        for _ in 0..4 {
            let r = lif.select(&view(&h, &b), &s).unwrap();
            assert_eq!(r.prefill.unwrap().id(), s.prefill()[1].id());
            assert_eq!(r.decode.id(), s.decode()[0].id());
        }
    }

    #[test]
    fn least_in_flight_spreads_ties() {
        let s = set(1, 3);
        let (h, b) = (HeaderMap::new(), JsonBody::default());
        let lif = LeastInFlight::new();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..3 {
            seen.insert(lif.select(&view(&h, &b), &s).unwrap().decode.id().clone());
        }
        assert_eq!(seen.len(), 3);
    }
}
