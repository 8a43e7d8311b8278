//! vLLM's Mooncake connector (the concurrent generation): both legs at once, linked by a
//! proxy-chosen `transfer_id`.
//!
//! Protocol (vLLM `vllm/distributed/kv_transfer/kv_connector/v1/mooncake/
//! mooncake_connector.py`; reference proxy `examples/online_serving/
//! disaggregated_serving/mooncake_connector/mooncake_connector_proxy.py`):
//!
//! - every prefill engine runs a bootstrap HTTP server (`VLLM_MOONCAKE_BOOTSTRAP_PORT`,
//!   default 8998) whose `GET /query` answers `{"<dp_rank>": {"engine_id": ..,
//!   "worker_addr": ..}, ..}`;
//! - the prefill gets the [rewritten](crate::vllm::rewrite) body plus `kv_transfer_params =
//!   {"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": ..}`, and the
//!   header `X-data-parallel-rank` when the route names a rank; it answers with no
//!   handoff of its own;
//! - the decode gets the client's body plus `kv_transfer_params = {"do_remote_prefill":
//!   true, "do_remote_decode": false, "remote_bootstrap_addr": "http://<p-host>:<port>",
//!   "remote_engine_id": <the rank's engine id>, "transfer_id": ..}` and fetches the KV
//!   from the prefill by that transfer id, waiting for it if the prefill is still busy.
//!
//! The engine id is learned in [`KvConnector::resolve`] from `GET /query` on the prefill's
//! bootstrap server, cached per prefill endpoint, and forgotten when a request over that
//! prefill fails (a restarted engine draws a new id), so the next request asks again.
//!
//! Data-parallel ranks: a prefill engine with several ranks places a request that names
//! none on a rank of its own choosing (vLLM's DP load balancer, `core_client.py`), while
//! the decode waits on the engine id the proxy named, so an unpinned prefill leg stalls
//! the request for the engine's abort timeout (480 s) whenever the engine picks another
//! rank. The prefill leg is therefore always pinned: to the rank the route names (an
//! endpoint written `URL@RANK`), or else to the least loaded of the ranks `/query` lists
//! (ties in turn), as vLLM's own proxy spreads requests over `(prefill, dp_rank)` pairs.
//! Each rank's load is counted on a rank endpoint (`URL@r`, with the engine's role,
//! models and connector data) that the prefill exchange tracks, and that counts towards
//! the engine's own load too.
//!
//! Routes served by the decode alone: vLLM's Mooncake prefill hands its KV over only
//! when its leg ends length-capped (`request_finished` sends for
//! `FINISHED_LENGTH_CAPPED` and drops the transfer id otherwise), and an EOS first
//! token ends the one-token leg "stopped" before the cap is looked at
//! (`v1/core/sched/utils.py` `check_stop`). Both legs are sent at once and nothing
//! reads the prefill's finish, so the decode, already pulling by that transfer id,
//! would wait out `VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT` (480 s). Only a leg carrying
//! `ignore_eos: true` is sure to end capped; vLLM's Anthropic (`/v1/messages`),
//! Responses and Cohere request models drop that field, and a
//! [`PrefillRewriter::with_ignore_eos`]`(false)` writes it on no route. Those requests
//! are served by a decode engine alone ([`Decision::Direct`], reason `no_ignore_eos`),
//! once vLLM's checks passed them; with the default rewriter chat, completions and
//! `/inference/v1/generate` stay disaggregated.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use crate::common::Rooms;
use crate::common::lock;
use crate::vllm::rewrite::PrefillRewriter;
use disagg_core::connector::{Dispatch, Handoff, KvConnector, Leg};
use disagg_core::endpoint::{Endpoint, EndpointId};
use disagg_core::error::{BoxError, ConnectorError};
use disagg_core::outcome::Outcome;
use disagg_core::policy::Decision;
use disagg_core::request::{Api, PdRequest};
use disagg_core::router::Route;
use disagg_core::transport::{Transport, read_limited};
use disagg_json::InvalidParam;
use disagg_json::write_json_str;
use serde_json::value::RawValue;

/// Why a request is served by a decode engine alone: its prefill leg would carry no
/// `ignore_eos`, so an EOS first token could end it "stopped", and vLLM's Mooncake
/// prefill then keeps no KV for the decode already waiting on it (see the module docs).
pub(crate) const NO_IGNORE_EOS: &str = "no_ignore_eos";

/// The bootstrap port of a prefill endpoint that configures none
/// (`VLLM_MOONCAKE_BOOTSTRAP_PORT`'s default).
pub(crate) const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// Largest `/query` answer read.
const MAX_QUERY_ANSWER: usize = 1 << 20;

/// Cached engine-id maps kept at most; past it the cache starts over (a proxy serves a
/// handful of prefill endpoints, so this only bounds a pathological endpoint churn).
const MAX_CACHED: usize = 4096;

/// Data-parallel ranks kept in all the cached maps at most (each is an endpoint and an
/// engine id, up to about 1 KiB): a map may list [`MAX_RANKS`], so counting maps alone
/// would let the cache hold gigabytes; past it the cache starts over.
const MAX_CACHED_RANKS: usize = 16 * 1024;

/// A prefill engine's data-parallel ranks, as its bootstrap server lists them.
#[derive(Debug)]
struct Ranks {
    /// By rank, ascending.
    ranks: Vec<Rank>,
    /// Where the next tie-break starts.
    turn: AtomicUsize,
}

#[derive(Debug)]
struct Rank {
    rank: u32,
    engine_id: Arc<str>,
    /// `URL@rank`: the prefill leg's endpoint when the proxy picks the rank, so that the
    /// exchange counts on it.
    endpoint: Arc<Endpoint>,
}

impl Ranks {
    fn new(engine: &Arc<Endpoint>, ids: HashMap<u32, Arc<str>>) -> Self {
        let mut ranks: Vec<Rank> = ids
            .into_iter()
            .map(|(rank, engine_id)| Rank {
                rank,
                engine_id,
                endpoint: Arc::new(disagg_core::proto::dp_rank(engine, rank)),
            })
            .collect();
        ranks.sort_by_key(|r| r.rank);
        Ranks {
            ranks,
            turn: AtomicUsize::new(0),
        }
    }

    fn get(&self, rank: u32) -> Option<&Rank> {
        self.ranks.iter().find(|r| r.rank == rank)
    }

    /// The rank with the fewest requests in flight; ties go round, so an idle engine's
    /// ranks are used in turn rather than rank 0 first.
    fn least_loaded(&self) -> Option<&Rank> {
        let n = self.ranks.len();
        let start = self.turn.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|i| &self.ranks[(start + i) % n])
            .min_by_key(|r| r.endpoint.in_flight())
    }
}

/// The vLLM Mooncake connector: concurrent dispatch, linked by a `transfer_id`.
///
/// Each prefill endpoint's bootstrap port comes from its
/// [`Facts::BOOTSTRAP_PORT`](disagg_core::endpoint::Facts::BOOTSTRAP_PORT) fact (8998,
/// `VLLM_MOONCAKE_BOOTSTRAP_PORT`'s default, when it has none; a value that is not a port
/// number fails the request, naming the endpoint and the key).
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use disagg_connectors::vllm::VllmMooncake;
/// use disagg_core::connector::{Dispatch, KvConnector};
/// use disagg_core::endpoint::{Endpoint, Role};
/// use disagg_core::request::{Api, PdRequest};
/// use disagg_core::router::Route;
///
/// let route = Route::new(
///     Some(Arc::new(Endpoint::new("http://10.0.0.5:8100", Role::Prefill)?)),
///     Arc::new(Endpoint::new("http://10.0.0.7:8200", Role::Decode)?),
/// );
/// let req = PdRequest::new(Api::Completions, Default::default(), &r#"{"prompt":"hi"}"#.into())?;
/// let h = VllmMooncake::new().prepare(&route, &req)?;
/// assert_eq!(h.dispatch, Dispatch::Concurrent);
/// assert_eq!(h.prefill.body.get("max_tokens"), Some(&b"1"[..]));
/// // The decode's handoff needs the engine id: `resolve` asks the prefill for it.
/// assert!(h.decode.body.get("kv_transfer_params").is_none());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct VllmMooncake {
    rewriter: PrefillRewriter,
    /// Whether `rewriter` writes `ignore_eos: true` on the routes that carry it.
    ignores_eos: bool,
    ids: Rooms,
    query_timeout: Duration,
    /// Engine id per data-parallel rank, per prefill endpoint.
    engines: Mutex<HashMap<EndpointId, Arc<Ranks>>>,
}

impl Default for VllmMooncake {
    fn default() -> Self {
        Self::new()
    }
}

/// What `prepare` leaves for `resolve`.
#[derive(Debug, Clone)]
struct Plan {
    transfer_id: String,
    bootstrap_addr: String,
    /// The rank the route named; `None`: the connector picks one in `resolve`.
    rank: Option<u32>,
}

impl VllmMooncake {
    /// The connector with the default [`PrefillRewriter`] and a 5 s bootstrap query
    /// timeout.
    pub fn new() -> Self {
        let rewriter = PrefillRewriter::new();
        VllmMooncake {
            ignores_eos: rewriter.ignores_eos(),
            rewriter,
            ids: Rooms::new(),
            query_timeout: Duration::from_secs(5),
            engines: Mutex::new(HashMap::new()),
        }
    }

    /// The same connector drawing transfer ids from `ids` (seeded in tests).
    pub fn with_ids(mut self, ids: Rooms) -> Self {
        self.ids = ids;
        self
    }

    /// The same connector with a custom rewriter for the prefill leg. A rewriter
    /// without `ignore_eos` ([`PrefillRewriter::with_ignore_eos`]`(false)`) sends every
    /// request to a decode engine alone (reason `no_ignore_eos`, see the module docs).
    pub fn with_rewriter(mut self, rewriter: PrefillRewriter) -> Self {
        self.ignores_eos = rewriter.ignores_eos();
        self.rewriter = rewriter;
        self
    }

    /// Whether the prefill leg of `api` is sure to end length-capped, the one finish
    /// after which vLLM's Mooncake prefill hands its KV over: the routes whose leg
    /// carries `ignore_eos: true`. SGLang's `/generate` counts as carried here:
    /// [`prepare`](KvConnector::prepare) refuses it, as for any vLLM connector.
    fn ends_capped(&self, api: Api) -> bool {
        match api {
            Api::Chat | Api::Completions | Api::TokenGenerate => self.ignores_eos,
            Api::Generate => true,
            // vLLM's Anthropic, Responses and Cohere request models drop `ignore_eos`;
            // a route added later is served direct until its leg is known to carry it.
            _ => false,
        }
    }

    /// The engine ids cached for `prefill`, by data-parallel rank.
    #[cfg(test)]
    pub(crate) fn cached_engine_ids(&self, prefill: &EndpointId) -> Option<HashMap<u32, String>> {
        let engines = lock(&self.engines);
        engines.get(prefill).map(|m| {
            m.ranks
                .iter()
                .map(|r| (r.rank, r.engine_id.to_string()))
                .collect()
        })
    }

    fn cached(&self, prefill: &EndpointId) -> Option<Arc<Ranks>> {
        lock(&self.engines).get(prefill).cloned()
    }

    /// Ask the bootstrap server at `addr` for its engine ids.
    async fn query(
        &self,
        addr: &str,
        transport: &dyn Transport,
    ) -> Result<HashMap<u32, Arc<str>>, BoxError> {
        let uri: http::Uri = format!("{addr}/query").parse()?;
        let mut req = http::Request::new(Bytes::new());
        *req.uri_mut() = uri;
        let exchange = async {
            // Errors are boxed by hand: `?` on a boxed error inside an async block trips
            // the compiler's `Send` inference (higher-ranked `From`).
            let resp = match transport.send(req).await {
                Ok(r) => r,
                Err(e) => return Err(Box::new(e) as BoxError),
            };
            let (parts, body) = resp.into_parts();
            let bytes = match read_limited(body, MAX_QUERY_ANSWER).await {
                Ok(b) => b,
                Err(e) => return Err(e),
            };
            if !parts.status.is_success() {
                return Err(BoxError::from(format!("answered {}", parts.status)));
            }
            Ok(bytes)
        };
        match tokio::time::timeout(self.query_timeout, exchange).await {
            Ok(Ok(bytes)) => parse_query(&bytes),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(BoxError::from("timed out")),
        }
    }
}

/// The most data-parallel ranks a `/query` answer may list: each becomes an endpoint
/// the proxy keeps (vLLM's data-parallel sizes are a handful to a few hundred).
const MAX_RANKS: usize = 1024;

/// The longest engine id taken from a `/query` answer (vLLM's are UUIDs or the
/// configured `engine_id`, tens of bytes).
const MAX_ENGINE_ID: usize = 256;

/// The engine ids of a `GET /query` answer, by rank. The engine id goes into every
/// decode leg over that rank (`remote_engine_id`, which the decode's connector looks
/// up on the bootstrap server), so it is checked as the handoff it feeds: a non-empty
/// string of at most [`MAX_ENGINE_ID`] bytes, for at most [`MAX_RANKS`] ranks (the
/// answer is read no further than its first member past them: a refused answer is not
/// cached, so every request to that prefill asks again). Each rank is written as the
/// engine writes it (`str(dp_rank)`: digits, no sign, no leading zero) and listed once:
/// `"0"`, `"00"` and `"+0"` would all name rank 0, and which of their engine ids the
/// decode were given would be chance.
fn parse_query(bytes: &[u8]) -> Result<HashMap<u32, Arc<str>>, BoxError> {
    #[derive(serde::Deserialize)]
    struct Rank {
        engine_id: String,
    }
    let text = std::str::from_utf8(bytes)?;
    let Some(members) = members_at_most(text, MAX_RANKS)? else {
        return Err(format!("it lists more than {MAX_RANKS} ranks").into());
    };
    let mut ranks = HashMap::with_capacity(members.len());
    for (key, value) in members {
        let rank = canonical_rank(&key).ok_or_else(|| {
            BoxError::from(format!(
                "rank `{key}` is not a rank number (decimal digits, no sign, no leading zero)"
            ))
        })?;
        let r: Rank = serde_json::from_str(value.get())
            .map_err(|e| BoxError::from(format!("rank {rank}: {e}")))?;
        if r.engine_id.is_empty() || r.engine_id.len() > MAX_ENGINE_ID {
            return Err(format!(
                "rank {rank}'s engine_id is empty or longer than {MAX_ENGINE_ID} bytes"
            )
            .into());
        }
        if ranks.insert(rank, Arc::from(r.engine_id)).is_some() {
            return Err(format!("rank {rank} is listed more than once").into());
        }
    }
    Ok(ranks)
}

/// The members of the JSON object `text` in order, keys decoded, repeats kept (a map
/// would keep one of them), or `None` when it has more than `max`: the reading stops at
/// the `max + 1`th member, and nothing after it is read.
fn members_at_most(
    text: &str,
    max: usize,
) -> Result<Option<Vec<(String, &RawValue)>>, serde_json::Error> {
    use serde::de::{Deserializer as _, Error as _, MapAccess, Visitor};
    struct Members<'a> {
        max: usize,
        over: &'a mut bool,
    }
    impl<'de> Visitor<'de> for Members<'_> {
        type Value = Vec<(String, &'de RawValue)>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut members = Vec::new();
            while let Some(key) = map.next_key::<String>()? {
                if members.len() == self.max {
                    *self.over = true;
                    return Err(A::Error::custom("too many members"));
                }
                members.push((key, map.next_value::<&'de RawValue>()?));
            }
            Ok(members)
        }
    }
    let mut over = false;
    let mut de = serde_json::Deserializer::from_str(text);
    let read = (&mut de).deserialize_map(Members {
        max,
        over: &mut over,
    });
    match read {
        Err(_) if over => Ok(None),
        Err(e) => Err(e),
        Ok(members) => de.end().map(|()| Some(members)),
    }
}

/// `key` as a rank when it is one written canonically: decimal digits without a sign
/// or a leading zero, within a `u32`.
fn canonical_rank(key: &str) -> Option<u32> {
    let rank: u32 = key.parse().ok()?;
    (rank.to_string() == key).then_some(rank)
}

#[async_trait]
impl KvConnector for VllmMooncake {
    /// Mooncake pairs are held to one vLLM build, as NIXL's are.
    fn equal_versions(&self) -> bool {
        true
    }

    fn name(&self) -> &'static str {
        "vllm-mooncake"
    }

    /// [`check_request`](crate::vllm::rewrite::check::check_request) with the rewriter's
    /// limits: what vLLM refuses in the fields the prefill leg changes, and beam search
    /// served direct; so is a completions request of several prompts (reason `batch`:
    /// the prefill's answer carries one handoff, prompt 0's), and any request whose
    /// prefill leg would carry no `ignore_eos` (reason `no_ignore_eos`: an EOS first
    /// token would leave the decode waiting 480 s, see the module docs).
    fn check(&self, req: &PdRequest) -> Result<Decision, InvalidParam> {
        let decision = crate::vllm::rewrite::check::check_one_handoff(req, self.rewriter.limits())?;
        if decision == Decision::Disaggregate && !self.ends_capped(req.api()) {
            return Ok(Decision::Direct {
                reason: NO_IGNORE_EOS,
            });
        }
        Ok(decision)
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        crate::common::openai_only(self.name(), req.api())?;
        let prefill_ep = route.prefill.clone().ok_or(ConnectorError::NeedsPrefill {
            connector: self.name(),
        })?;
        let port = crate::common::bootstrap_port(&prefill_ep)?.unwrap_or(DEFAULT_BOOTSTRAP_PORT);
        let host = prefill_ep.authority().host();
        let plan = Plan {
            transfer_id: format!("xfer-{:016x}", self.ids.next_room()),
            bootstrap_addr: format!("http://{host}:{port}"),
            rank: route.prefill_rank,
        };
        let mut body = self.rewriter.rewrite(req.api(), req.body());
        // Written directly (the id is `xfer-` and hex digits, nothing to escape): a
        // `serde_json::Value` here cost more than the rest of `prepare`.
        body.set_raw(
            "kv_transfer_params",
            Bytes::from(format!(
                r#"{{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"{}"}}"#,
                plan.transfer_id
            )),
        );
        let mut prefill = Leg::new(prefill_ep, body);
        prefill.set_rank(route.prefill_rank);
        let mut decode = Leg::new(Arc::clone(&route.decode), req.body().clone());
        decode.set_rank(route.decode_rank);
        let mut handoff = Handoff::new(Dispatch::Concurrent, prefill, decode);
        handoff.ext.insert(plan);
        Ok(handoff)
    }

    async fn resolve(
        &self,
        handoff: &mut Handoff,
        transport: &dyn Transport,
    ) -> Result<(), ConnectorError> {
        let Some(plan) = handoff.ext.remove::<Plan>() else {
            // Not a plan of ours: nothing to resolve.
            return Ok(());
        };
        let prefill = handoff.prefill.endpoint.id().clone();
        let bootstrap_error = |source: BoxError| ConnectorError::Bootstrap {
            endpoint: prefill.clone(),
            addr: plan.bootstrap_addr.clone(),
            source,
        };
        let engines = match self.cached(&prefill) {
            Some(e) => e,
            None => {
                // No lock is held across this await: a concurrent first request may ask
                // too, and the later answer simply replaces the earlier.
                let ids = self
                    .query(&plan.bootstrap_addr, transport)
                    .await
                    .map_err(bootstrap_error)?;
                let fresh = Arc::new(Ranks::new(&handoff.prefill.endpoint, ids));
                let mut cache = lock(&self.engines);
                // A miss is a prefill's first request (or one after a failure): the sum
                // is taken rarely.
                let ranks: usize = cache.values().map(|r| r.ranks.len()).sum();
                if cache.len() >= MAX_CACHED || ranks + fresh.ranks.len() > MAX_CACHED_RANKS {
                    cache.clear();
                }
                cache.insert(prefill.clone(), Arc::clone(&fresh));
                fresh
            }
        };
        let rank = match plan.rank {
            Some(r) => engines.get(r).ok_or_else(|| {
                bootstrap_error(format!("it serves no data-parallel rank {r}").into())
            })?,
            None => {
                let rank = engines
                    .least_loaded()
                    .ok_or_else(|| bootstrap_error("it lists no data-parallel rank".into()))?;
                // Pin the leg to the rank whose engine id the decode is given; the
                // exchange then counts on that rank.
                handoff.prefill.endpoint = Arc::clone(&rank.endpoint);
                handoff.prefill.set_rank(Some(rank.rank));
                rank
            }
        };
        let engine_id = &rank.engine_id;
        let mut params = Vec::with_capacity(192);
        params.extend_from_slice(
            br#"{"do_remote_prefill":true,"do_remote_decode":false,"remote_bootstrap_addr":"#,
        );
        write_json_str(&mut params, plan.bootstrap_addr.as_bytes());
        params.extend_from_slice(br#","remote_engine_id":"#);
        write_json_str(&mut params, engine_id.as_bytes());
        params.extend_from_slice(br#","transfer_id":"#);
        write_json_str(&mut params, plan.transfer_id.as_bytes());
        params.push(b'}');
        handoff
            .decode
            .body
            .set_raw("kv_transfer_params", Bytes::from(params));
        Ok(())
    }

    fn observe(&self, route: &Route, outcome: Outcome) {
        if matches!(outcome, Outcome::PrefillFailed | Outcome::DecodeFailed)
            && let Some(p) = &route.prefill
        {
            // The engine may have restarted under a new id: ask again next time.
            lock(&self.engines).remove(p.id());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http::{HeaderMap, Response};
    use http_body_util::{BodyExt, Full};
    use serde_json::{Value, json};

    use super::*;
    /// The header by which the engine lets a request pick its data-parallel rank.
    const DATA_PARALLEL_RANK: &str = "x-data-parallel-rank";
    use disagg_core::endpoint::{Endpoint, Facts, Role};
    use disagg_core::error::TransportError;
    use disagg_core::transport::ResponseFuture;

    /// Answers `GET /query` with a fixed body, counting the queries.
    struct Bootstrap {
        answer: &'static str,
        queries: AtomicUsize,
        seen: Mutex<Vec<String>>,
    }

    impl Transport for Bootstrap {
        fn send(&self, req: http::Request<Bytes>) -> ResponseFuture {
            self.queries.fetch_add(1, Ordering::Relaxed);
            lock(&self.seen).push(req.uri().to_string());
            let body = Full::new(Bytes::from_static(self.answer.as_bytes()))
                .map_err(|never| match never {})
                .boxed();
            Box::pin(async move { Ok::<_, TransportError>(Response::new(body)) })
        }
    }

    fn bootstrap(answer: &'static str) -> Bootstrap {
        Bootstrap {
            answer,
            queries: AtomicUsize::new(0),
            seen: Mutex::new(Vec::new()),
        }
    }

    fn route(port: Option<u16>) -> Route {
        route_with(port.map(|p| p.to_string()).as_deref())
    }

    /// `route(None)` with data-parallel ranks named for each leg.
    fn ranked(prefill_rank: Option<u32>, decode_rank: Option<u32>) -> Route {
        let mut route = route(None);
        route.prefill_rank = prefill_rank;
        route.decode_rank = decode_rank;
        route
    }

    fn route_with(port: Option<&str>) -> Route {
        let mut facts = Facts::default();
        if let Some(p) = port {
            facts.insert(Facts::BOOTSTRAP_PORT, p).unwrap();
        }
        Route::new(
            Some(Arc::new(
                Endpoint::new("http://10.1.2.3:8100", Role::Prefill)
                    .unwrap()
                    .with_facts(facts),
            )),
            Arc::new(Endpoint::new("http://10.1.2.4:8200", Role::Decode).unwrap()),
        )
    }

    fn req(body: &str) -> PdRequest {
        req_of(Api::Chat, body)
    }

    fn req_of(api: Api, body: &str) -> PdRequest {
        PdRequest::new(api, HeaderMap::new(), &Bytes::from(body.to_owned())).unwrap()
    }

    fn json_of(b: &disagg_json::JsonBody) -> Value {
        serde_json::from_slice(&b.to_bytes()).unwrap()
    }

    const QUERY: &str = r#"{"0":{"engine_id":"e0","worker_addr":{"0":{"0":"10.1.2.3:7000"}}},"1":{"engine_id":"e1","worker_addr":{}}}"#;

    #[tokio::test]
    async fn golden_legs() {
        let c = VllmMooncake::new().with_ids(Rooms::from_seed(3));
        let t = bootstrap(QUERY);
        let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":20}"#;
        let mut h = c.prepare(&route(Some(9000)), &req(body)).unwrap();
        c.resolve(&mut h, &t).await.unwrap();
        let xfer = format!("xfer-{:016x}", Rooms::from_seed(3).next_room());
        let p = json_of(&h.prefill.body);
        assert_eq!(
            p["kv_transfer_params"],
            json!({"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": xfer})
        );
        assert_eq!(p["max_tokens"], 1);
        assert_eq!(p["stream"], false);
        assert!(p.get("stream_options").is_none());
        let d = json_of(&h.decode.body);
        assert_eq!(
            d["kv_transfer_params"],
            json!({
                "do_remote_prefill": true,
                "do_remote_decode": false,
                "remote_bootstrap_addr": "http://10.1.2.3:9000",
                "remote_engine_id": "e0",
                "transfer_id": xfer,
            })
        );
        assert_eq!(d["stream"], true);
        assert_eq!(d["max_tokens"], 20);
        // The route named no rank: the leg is pinned to the rank whose engine id the
        // decode is given (the first turn goes to rank 0).
        assert_eq!(h.prefill.headers[DATA_PARALLEL_RANK], "0");
        assert_eq!(h.prefill.endpoint.id().as_str(), "http://10.1.2.3:8100@0");
        assert_eq!(
            lock(&t.seen).as_slice(),
            ["http://10.1.2.3:9000/query".to_owned()]
        );
    }

    #[tokio::test]
    async fn unpinned_legs_are_pinned_to_the_least_loaded_rank_they_name() {
        let c = VllmMooncake::new();
        let t = bootstrap(QUERY);
        let r = route(None);
        let engine = Arc::clone(r.prefill.as_ref().unwrap());
        let mut held = Vec::new();
        let mut ranks = Vec::new();
        for _ in 0..4 {
            let mut h = c.prepare(&r, &req(r#"{"messages":[]}"#)).unwrap();
            c.resolve(&mut h, &t).await.unwrap();
            let rank = h.prefill.headers[DATA_PARALLEL_RANK]
                .to_str()
                .unwrap()
                .to_owned();
            let d = json_of(&h.decode.body);
            // The decode waits on exactly the engine id of the rank the prefill runs on.
            assert_eq!(
                d["kv_transfer_params"]["remote_engine_id"],
                format!("e{rank}")
            );
            assert_eq!(h.prefill.endpoint.rank(), Some(rank.parse().unwrap()));
            // The leg is in flight (as the orchestrator's exchange tracks it).
            held.push(h.prefill.endpoint.track());
            ranks.push(rank);
        }
        // Two ranks, each busy in turn: the load is spread evenly, and counted on the
        // engine as a whole too.
        assert_eq!(ranks, ["0", "1", "0", "1"]);
        assert_eq!(engine.in_flight(), 4);
        // Rank 1 frees up: the next leg goes there whatever the turn.
        held.remove(3);
        held.remove(1);
        held.remove(0);
        let mut h = c.prepare(&r, &req(r#"{"messages":[]}"#)).unwrap();
        c.resolve(&mut h, &t).await.unwrap();
        assert_eq!(h.prefill.headers[DATA_PARALLEL_RANK], "1");
        drop(held);
        assert_eq!(engine.in_flight(), 0);
    }

    #[tokio::test]
    async fn engine_ids_are_cached_and_forgotten_on_failure() {
        let c = VllmMooncake::new();
        let t = bootstrap(QUERY);
        let r = route(None);
        for _ in 0..3 {
            let mut h = c.prepare(&r, &req(r#"{"messages":[]}"#)).unwrap();
            c.resolve(&mut h, &t).await.unwrap();
        }
        assert_eq!(t.queries.load(Ordering::Relaxed), 1);
        assert_eq!(
            lock(&t.seen)[0],
            format!("http://10.1.2.3:{DEFAULT_BOOTSTRAP_PORT}/query")
        );
        // Neither a success, a client gone nor a refusal on either side (the client's
        // fault) says the engine changed: the cache is kept.
        c.observe(&r, Outcome::Success);
        c.observe(&r, Outcome::Cancelled);
        c.observe(&r, Outcome::PrefillRefused);
        c.observe(&r, Outcome::DecodeRefused);
        assert!(
            c.cached_engine_ids(r.prefill.as_ref().unwrap().id())
                .is_some()
        );
        c.observe(&r, Outcome::DecodeFailed);
        assert!(
            c.cached_engine_ids(r.prefill.as_ref().unwrap().id())
                .is_none()
        );
        let mut h = c.prepare(&r, &req(r#"{"messages":[]}"#)).unwrap();
        c.resolve(&mut h, &t).await.unwrap();
        assert_eq!(t.queries.load(Ordering::Relaxed), 2);
        // A prefill's failure forgets it too.
        c.observe(&r, Outcome::PrefillFailed);
        assert!(
            c.cached_engine_ids(r.prefill.as_ref().unwrap().id())
                .is_none()
        );
        let mut h = c.prepare(&r, &req(r#"{"messages":[]}"#)).unwrap();
        c.resolve(&mut h, &t).await.unwrap();
        assert_eq!(t.queries.load(Ordering::Relaxed), 3);
    }

    /// The cache is bounded by the ranks it holds, not only by its maps: sixteen
    /// prefills of 1,024 ranks fill it; the seventeenth starts it over.
    #[tokio::test]
    async fn the_cache_holds_a_bounded_number_of_ranks() {
        let many: &'static str = Box::leak(
            format!(
                "{{{}}}",
                (0..MAX_RANKS)
                    .map(|r| format!(r#""{r}":{{"engine_id":"e{r}"}}"#))
                    .collect::<Vec<_>>()
                    .join(",")
            )
            .into_boxed_str(),
        );
        let c = VllmMooncake::new();
        let t = bootstrap(many);
        let route_to = |i: usize| {
            Route::new(
                Some(Arc::new(
                    Endpoint::new(&format!("http://10.1.3.{i}:8100"), Role::Prefill).unwrap(),
                )),
                Arc::new(Endpoint::new("http://10.1.2.4:8200", Role::Decode).unwrap()),
            )
        };
        let cached = |i: usize| {
            c.cached_engine_ids(route_to(i).prefill.as_ref().unwrap().id())
                .is_some()
        };
        let fits = MAX_CACHED_RANKS / MAX_RANKS;
        for i in 1..=fits + 1 {
            let mut h = c.prepare(&route_to(i), &req(r#"{"messages":[]}"#)).unwrap();
            c.resolve(&mut h, &t).await.unwrap();
            if i == fits {
                assert!((1..=fits).all(cached), "all {fits} maps held");
            }
        }
        assert!(!cached(1), "the cache started over");
        assert!(cached(fits + 1));
    }

    #[tokio::test]
    async fn ranks_pick_the_engine_id_and_the_header() {
        let c = VllmMooncake::new();
        let t = bootstrap(QUERY);
        let mut h = c
            .prepare(&ranked(Some(1), None), &req(r#"{"messages":[]}"#))
            .unwrap();
        c.resolve(&mut h, &t).await.unwrap();
        assert_eq!(h.prefill.headers.get(DATA_PARALLEL_RANK).unwrap(), "1");
        assert_eq!(
            json_of(&h.decode.body)["kv_transfer_params"]["remote_engine_id"],
            "e1"
        );
        let mut h = c
            .prepare(&ranked(Some(7), None), &req(r#"{"messages":[]}"#))
            .unwrap();
        let err = c.resolve(&mut h, &t).await.unwrap_err();
        assert!(matches!(err, ConnectorError::Bootstrap { .. }));
        assert!(
            disagg_core::error::error_chain(&err).contains("no data-parallel rank 7"),
            "{}",
            disagg_core::error::error_chain(&err)
        );
    }

    #[tokio::test]
    async fn unusable_query_answers_are_errors() {
        let too_long: &'static str =
            Box::leak(format!(r#"{{"0":{{"engine_id":"{}"}}}}"#, "e".repeat(257)).into_boxed_str());
        let too_many: &'static str = Box::leak(
            format!(
                "{{{}}}",
                (0..1025)
                    .map(|r| format!(r#""{r}":{{"engine_id":"e{r}"}}"#))
                    .collect::<Vec<_>>()
                    .join(",")
            )
            .into_boxed_str(),
        );
        for answer in [
            "[]",
            "{\"x\":{\"engine_id\":\"e\"}}",
            "not json",
            r#"{"0":{"engine_id":""}}"#,
            r#"{"0":{"engine_id":null}}"#,
            r#"{"0":{}}"#,
            too_long,
            too_many,
        ] {
            let c = VllmMooncake::new();
            let t = bootstrap(answer);
            let mut h = c.prepare(&route(None), &req(r#"{"messages":[]}"#)).unwrap();
            assert!(matches!(
                c.resolve(&mut h, &t).await,
                Err(ConnectorError::Bootstrap { .. })
            ));
        }
    }

    /// Rank keys that name one rank twice (`"0"`, `"00"`, `"+0"`, an escaped `"0"`), or
    /// not as the engine writes it, fail the query: which engine id a decode were given
    /// would otherwise be chance.
    #[tokio::test]
    async fn query_answers_naming_a_rank_twice_or_not_canonically_are_errors() {
        for answer in [
            r#"{"0":{"engine_id":"a"},"00":{"engine_id":"b"}}"#,
            r#"{"0":{"engine_id":"a"},"+0":{"engine_id":"b"}}"#,
            r#"{"0":{"engine_id":"a"},"0":{"engine_id":"b"}}"#,
            r#"{"0":{"engine_id":"a"},"\u0030":{"engine_id":"b"}}"#,
            r#"{"00":{"engine_id":"a"}}"#,
            r#"{"+1":{"engine_id":"a"}}"#,
            r#"{" 1":{"engine_id":"a"}}"#,
            r#"{"4294967296":{"engine_id":"a"}}"#,
        ] {
            assert!(parse_query(answer.as_bytes()).is_err(), "{answer}");
            let c = VllmMooncake::new();
            let t = bootstrap(answer);
            let mut h = c.prepare(&route(None), &req(r#"{"messages":[]}"#)).unwrap();
            let err = c.resolve(&mut h, &t).await.unwrap_err();
            assert!(matches!(err, ConnectorError::Bootstrap { .. }), "{answer}");
            assert!(
                h.decode.body.get("kv_transfer_params").is_none(),
                "{answer}"
            );
        }
        let twice = parse_query(br#"{"0":{"engine_id":"a"},"\u0030":{"engine_id":"b"}}"#)
            .unwrap_err()
            .to_string();
        assert!(twice.contains("rank 0 is listed more than once"), "{twice}");
        // Escaped keys are read decoded; canonical ones pass.
        let ok = parse_query(br#"{"0":{"engine_id":"a"},"1\u0030":{"engine_id":"b"}}"#).unwrap();
        assert_eq!(ok.len(), 2);
        assert_eq!(ok.get(&10).map(|e| &**e), Some("b"));
    }

    /// A `/query` answer listing more than `MAX_RANKS` ranks is refused at the first
    /// member past the ceiling: nothing after it is read (here it is not even JSON),
    /// and an answer of 1 MiB of `"":0` members is refused as too many, not gathered
    /// whole first (some 175,000 of them).
    #[test]
    fn a_query_answer_is_refused_at_its_first_rank_past_the_ceiling() {
        let member = |r: usize| format!(r#""{r}":{{"engine_id":"e{r}"}}"#);
        let listed = (0..=MAX_RANKS).map(member).collect::<Vec<_>>().join(",");
        let cut = format!("{{{listed}, this is not JSON");
        let err = parse_query(cut.as_bytes()).unwrap_err().to_string();
        assert!(
            err.contains(&format!("more than {MAX_RANKS} ranks")),
            "{err}"
        );
        let n = (MAX_QUERY_ANSWER - 2) / 5;
        let empty = format!("{{{}\"\":0}}", "\"\":0,".repeat(n - 1));
        assert!(empty.len() <= MAX_QUERY_ANSWER);
        let err = parse_query(empty.as_bytes()).unwrap_err().to_string();
        assert!(
            err.contains(&format!("more than {MAX_RANKS} ranks")),
            "{err}"
        );
        // At the ceiling, every rank is kept.
        let full = format!(
            "{{{}}}",
            (0..MAX_RANKS).map(member).collect::<Vec<_>>().join(",")
        );
        assert_eq!(parse_query(full.as_bytes()).unwrap().len(), MAX_RANKS);
    }

    /// A valid body of each route vLLM's Mooncake pair can be asked on.
    const VLLM_ROUTES: [(Api, &str); 6] = [
        (Api::Chat, r#"{"model":"m","messages":[],"max_tokens":8}"#),
        (
            Api::Completions,
            r#"{"model":"m","prompt":"p","max_tokens":8}"#,
        ),
        (
            Api::TokenGenerate,
            r#"{"token_ids":[1,2],"sampling_params":{"max_tokens":8}}"#,
        ),
        (
            Api::Messages,
            r#"{"model":"m","messages":[],"max_tokens":8}"#,
        ),
        (Api::Responses, r#"{"model":"m","input":"hi"}"#),
        (Api::CohereChat, r#"{"model":"m","messages":[]}"#),
    ];

    fn decided(c: &VllmMooncake, api: Api, body: &str) -> Result<Decision, InvalidParam> {
        c.check(&req_of(api, body))
    }

    /// vLLM's Mooncake prefill hands its KV over only when the leg ends length-capped;
    /// an EOS first token ends it "stopped" and the decode waits out the engine's abort
    /// timeout. The routes whose prefill leg cannot carry `ignore_eos` (vLLM's
    /// Anthropic, Responses and Cohere request models drop it) go to the decode alone;
    /// chat, completions and token-in, whose legs carry it, stay disaggregated.
    #[test]
    fn routes_whose_prefill_cannot_ignore_eos_are_served_on_the_decode_alone() {
        let c = VllmMooncake::new();
        for (api, body) in VLLM_ROUTES {
            let want = match api {
                Api::Messages | Api::Responses | Api::CohereChat => Decision::Direct {
                    reason: NO_IGNORE_EOS,
                },
                _ => Decision::Disaggregate,
            };
            assert_eq!(decided(&c, api, body), Ok(want), "{api:?}");
        }
        // What vLLM refuses is still refused first, and an earlier reason is kept.
        assert!(decided(&c, Api::Messages, r#"{"messages":[],"max_tokens":0}"#).is_err());
        assert_eq!(
            decided(&c, Api::Responses, r#"{"input":"hi","store":true}"#),
            Ok(Decision::Direct {
                reason: "responses_state"
            })
        );
        // SGLang's `/generate` is still left to `prepare`, which refuses it.
        assert_eq!(
            decided(&c, Api::Generate, r#"{"text":"hi"}"#),
            Ok(Decision::Disaggregate)
        );
        let err = c
            .prepare(&route(None), &req_of(Api::Generate, r#"{"text":"hi"}"#))
            .unwrap_err();
        assert!(matches!(err, ConnectorError::Unsupported { .. }), "{err:?}");
    }

    /// A rewriter built without `ignore_eos` (for engines that refuse it) leaves every
    /// prefill leg free to end "stopped": every vLLM route goes to the decode alone.
    #[test]
    fn without_ignore_eos_every_route_is_served_on_the_decode_alone() {
        let c = VllmMooncake::new().with_rewriter(PrefillRewriter::new().with_ignore_eos(false));
        for (api, body) in VLLM_ROUTES {
            assert_eq!(
                decided(&c, api, body),
                Ok(Decision::Direct {
                    reason: NO_IGNORE_EOS
                }),
                "{api:?}"
            );
        }
        // The default rewriter put back: disaggregated again.
        let c = c.with_rewriter(PrefillRewriter::new());
        assert_eq!(
            decided(&c, Api::Chat, VLLM_ROUTES[0].1),
            Ok(Decision::Disaggregate)
        );
    }

    /// A completions request of several prompts would share one `transfer_id` over
    /// all of them, and the prefill's answer names prompt 0's transfer only: it is
    /// served on one engine. A list of one prompt stays disaggregated.
    #[test]
    fn several_completions_prompts_are_served_on_one_engine() {
        let decided = |prompt: &str| {
            let body = format!(r#"{{"model":"m","prompt":{prompt},"max_tokens":32}}"#);
            let req =
                PdRequest::new(Api::Completions, HeaderMap::new(), &Bytes::from(body)).unwrap();
            VllmMooncake::new().check(&req).unwrap()
        };
        for several in [r#"["A","B"]"#, "[[1,2],[3]]"] {
            assert_eq!(
                decided(several),
                Decision::Direct { reason: "batch" },
                "{several}"
            );
        }
        for one in [r#""A""#, r#"["A"]"#, "[[1,2]]", "[1,2,3]"] {
            assert_eq!(decided(one), Decision::Disaggregate, "{one}");
        }
    }

    #[test]
    fn each_prepare_draws_a_new_transfer_id() {
        let c = VllmMooncake::new();
        let a = c.prepare(&route(None), &req(r#"{"messages":[]}"#)).unwrap();
        let b = c.prepare(&route(None), &req(r#"{"messages":[]}"#)).unwrap();
        assert_ne!(
            json_of(&a.prefill.body)["kv_transfer_params"]["transfer_id"],
            json_of(&b.prefill.body)["kv_transfer_params"]["transfer_id"]
        );
    }

    #[test]
    fn a_malformed_bootstrap_port_fact_fails_the_request_naming_endpoint_and_key() {
        let c = VllmMooncake::new();
        let err = c
            .prepare(&route_with(Some("8998x")), &req(r#"{"messages":[]}"#))
            .unwrap_err();
        assert!(
            matches!(err, ConnectorError::NotConfigured { .. }),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains("http://10.1.2.3:8100"), "{msg}");
        assert!(msg.contains("`bootstrap_port`"), "{msg}");
    }
}
