//! `GET /v1/models` and `GET /v1/models/{id}`, answered as the engines answer them.
//!
//! The cards are the decode engines' own (`GET /v1/models` on each server once, every
//! field kept: vLLM's `root`, `parent`, `max_model_len`, `permission`, and a card per
//! loaded LoRA adapter), merged by `id`, then a card for each model an endpoint
//! declares ([`Endpoint::with_models`](disagg_core::Endpoint::with_models), the
//! proxy's `--served-model`) that no engine listed: the declaring engine's base card
//! under the declared name, so `root` and `max_model_len` stay the engine's. The list is
//! cached for [`PdServiceConfig::models_ttl`](crate::PdServiceConfig::models_ttl) and
//! dropped after a fanned-out admin request (an adapter may have come or gone); an
//! engine whose answer (head and body) has not ended within
//! [`models_timeout`](crate::PdServiceConfig::models_timeout), or that fails, is left
//! out of it, and the others' lists are used.
//!
//! Requests that find the list stale while it is being fetched wait for that fetch
//! rather than starting another (or waiting for one another). The fetch runs as a task
//! of its own, so it goes on when every request waiting for it has left; it ends within
//! the timeout, unless the timeout is too large for the clock (then the fetch has no
//! deadline, and neither have the requests waiting for it). A request gives up on a
//! fetch not ended a second past its deadline (its task's runtime no longer driven), as
//! on one that failed; a fetch whose task panicked or was dropped with its runtime
//! failed, and is not waited for again.
//!
//! Dropping the list never waits for a fetch: a fetch begun before the list was
//! dropped still answers the requests already waiting for it, but its list is not kept,
//! and the next request starts another. While three such forgotten fetches still run
//! (an engine holds them), a request that finds no list joins the newest of them
//! instead, and is answered its list (begun before the drop), which is not kept either:
//! an engine that holds its answer is asked at most three times at once, however often
//! the list is dropped. When no engine answers (and no endpoint declares a model),
//! nothing is kept: the next request asks the engines again.
//!
//! The list is dropped when a fanned-out request's engines have answered, or when its
//! client leaves before they have (an engine may still apply the change after that: a
//! list fetched in between is kept until it is older than the TTL).
//!
//! vLLM itself has no `GET /v1/models/{id}`; the proxy answers it from the list (the
//! card whose `id` is the rest of the path, percent-decoded), and 404
//! `model_not_found` in OpenAI's format for an unknown id, as OpenAI does.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use disagg_core::error::{PdError, RouteError};
use disagg_core::json::raw;
use disagg_core::transport::Transport;
use disagg_core::{Endpoint, Role};
use disagg_core::{endpoint::EndpointSet, orchestrator::PdBody};
use futures::future::{BoxFuture, FutureExt, Shared};
use http::{Request, StatusCode};
use serde_json::value::RawValue;

use crate::error::error_response;
use crate::service::{collect_limited, json_response};

/// A model card as its engine wrote it (never built as a `Value`: a card of
/// `[{},{},...]` cost about 95 bytes per byte), with the two members the merge reads.
#[derive(Debug, Clone)]
struct Card {
    raw: Box<RawValue>,
    id: IdKey,
    /// No `parent` (or a null one): a base model's card, not a LoRA adapter's.
    base: bool,
}

impl Card {
    /// The card `raw`, which must be a JSON object.
    fn read(raw: Box<RawValue>) -> Option<Card> {
        if !raw.get().starts_with('{') {
            return None;
        }
        // The last of a repeated key counts, as a map keeps it; the rest is skipped.
        let [id, parent] = raw::members_named(raw.get(), ["id", "parent"]).ok()?;
        let id = id.map_or(IdKey::Missing, IdKey::of);
        let base = parent.is_none_or(|p| p.get() == "null");
        Some(Card { raw, id, base })
    }

    /// The card's `id`, when it is a string.
    fn id_str(&self) -> Option<&str> {
        match &self.id {
            IdKey::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// The largest model list read from an engine.
const LIST_LIMIT: usize = 4 * 1024 * 1024;

/// The most cards read from one engine's list: each costs its own bytes and a few
/// dozen more, so a list of millions of `{}` is refused (as no list) rather than
/// held. vLLM lists its model and one card per LoRA adapter.
const MAX_CARDS: usize = 65_536;

/// The most fetches running at once, the one in flight and those forgotten by a drop of
/// the list: when that many forgotten ones run, a request that finds no list joins the
/// newest of them rather than starting another, so an engine that holds its
/// `GET /v1/models` is sent at most this many at once, however often the list is
/// dropped.
const MAX_RUNNING: usize = 3;

/// How long past its deadline a request waits for a fetch before it gives up on it, as
/// on a fetch that failed: the fetch's own work after its deadline (the merge), and its
/// task's turn.
const WAIT_SLACK: Duration = Duration::from_secs(1);

/// The cards of one fetch: `None` when no engine answered and no endpoint declares a
/// model.
type Listed = Option<Arc<Vec<Card>>>;

/// A fetch's answer, awaited by every request that found the list stale meanwhile:
/// `None` as well when its task ended without one (it panicked, or its runtime dropped
/// it).
type Fetch = Shared<BoxFuture<'static, Listed>>;

/// A fetch started, as the requests that wait for it see it.
#[derive(Clone)]
struct Flight {
    /// Its number.
    id: u64,
    fetch: Fetch,
    /// When a request waiting for it gives up on it: its deadline and [`WAIT_SLACK`];
    /// none when the timeout is too large for the clock (then the fetch has no
    /// deadline either).
    until: Option<tokio::time::Instant>,
}

impl Flight {
    /// Still worth waiting for at `now`.
    fn live(&self, now: tokio::time::Instant) -> bool {
        self.until.is_none_or(|until| now < until)
    }
}

/// The cached model list, and the fetches running.
#[derive(Default)]
pub(crate) struct Catalog {
    /// Locked for moments, never across an await; shared (weakly) with each fetch's
    /// task, which keeps its list when it ends.
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for Catalog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Catalog");
        // Not waited for: a `Debug` written while the state is held must not hang.
        if let Ok(state) = self.state.try_lock() {
            d.field("cards", &state.cached.as_ref().map(|(_, c)| c.len()))
                .field("fetching", &state.in_flight.is_some())
                .field("forgotten", &state.forgotten.len());
        }
        d.finish_non_exhaustive()
    }
}

#[derive(Default)]
struct State {
    /// The list, and when its fetch ended.
    cached: Option<(Instant, Arc<Vec<Card>>)>,
    /// The fetch in flight whose list will be kept. A fetch begun before the list was
    /// last dropped is no longer here.
    in_flight: Option<Flight>,
    /// The fetches forgotten by a drop of the list and still running (not yet past
    /// their waiters' deadline), oldest first: with the one in flight, at most
    /// [`MAX_RUNNING`].
    forgotten: Vec<Flight>,
    /// The number of the next fetch.
    next: u64,
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // Nothing panics while holding it; a poisoned lock still holds a whole state.
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

impl State {
    /// The cached list when younger than `ttl`, else the fetch to wait for: the one in
    /// flight, else the newest forgotten one when [`MAX_RUNNING`] still run; `None`
    /// when a fetch is to start. A fetch past its waiters' deadline (its runtime no
    /// longer driven) is forgotten, as a request that gave up on it forgets it.
    fn current(&mut self, ttl: Duration) -> Option<Result<Arc<Vec<Card>>, Flight>> {
        if let Some((at, cards)) = &self.cached
            && at.elapsed() < ttl
        {
            return Some(Ok(Arc::clone(cards)));
        }
        let now = tokio::time::Instant::now();
        if self.in_flight.as_ref().is_some_and(|f| !f.live(now)) {
            self.in_flight = None;
        }
        self.forgotten.retain(|f| f.live(now));
        if let Some(flight) = &self.in_flight {
            return Some(Err(flight.clone()));
        }
        if self.forgotten.len() >= MAX_RUNNING {
            return self.forgotten.last().cloned().map(Err);
        }
        None
    }

    /// Fetch `id` ended or given up on: no longer in flight nor running. Whether it was
    /// the one in flight.
    fn end(&mut self, id: u64) -> bool {
        self.forgotten.retain(|f| f.id != id);
        let in_flight = self.in_flight.as_ref().is_some_and(|f| f.id == id);
        if in_flight {
            self.in_flight = None;
        }
        in_flight
    }
}

/// The end of a fetch's task, however it ends: its list, kept when it is still the
/// fetch in flight ([`Ended::kept`]), or nothing (dropped: the fetch panicked, or its
/// runtime dropped it before it ended). Either way the fetch is no longer in flight: a
/// task that never gives its answer is not waited for again.
struct Ended {
    /// Emptied once the end is told.
    state: Weak<Mutex<State>>,
    id: u64,
}

impl Ended {
    /// The fetch ended with `cards`: kept, when it is still the one in flight.
    fn kept(&mut self, cards: Option<&Arc<Vec<Card>>>) {
        let Some(state) = std::mem::take(&mut self.state).upgrade() else {
            return;
        };
        let mut state = lock(&state);
        if state.end(self.id)
            && let Some(cards) = cards
        {
            state.cached = Some((Instant::now(), Arc::clone(cards)));
        }
    }
}

impl Drop for Ended {
    fn drop(&mut self) {
        self.kept(None);
    }
}

/// Drops the model list when it is dropped: see [`Catalog::invalidate_on_drop`].
pub(crate) struct InvalidateOnDrop<'a>(&'a Catalog);

impl Drop for InvalidateOnDrop<'_> {
    fn drop(&mut self) {
        self.0.invalidate();
    }
}

impl Catalog {
    /// Forget the list: the next request builds it anew. Does not wait: a fetch in
    /// flight still answers the requests waiting for it, but its list is not kept.
    pub(crate) fn invalidate(&self) {
        let mut state = lock(&self.state);
        state.cached = None;
        if let Some(flight) = state.in_flight.take() {
            // None starts while `MAX_RUNNING` forgotten ones run: at most that many.
            state.forgotten.push(flight);
        }
    }

    /// A guard that forgets the list when it is dropped: after a fanned-out admin
    /// request's answers, or when its client leaves before them (the engines may
    /// still apply it).
    pub(crate) fn invalidate_on_drop(&self) -> InvalidateOnDrop<'_> {
        InvalidateOnDrop(self)
    }

    /// The cards, from the cache when younger than `ttl`, else from the fetch in
    /// flight (or the newest forgotten one, at [`MAX_RUNNING`]), else from a new
    /// one; `None` when no engine answered and no endpoint declares a model, when the
    /// fetch ended without an answer, or when it has not ended [`WAIT_SLACK`] past its
    /// deadline.
    async fn cards(
        &self,
        set: Arc<EndpointSet>,
        transport: &dyn Transport,
        ttl: Duration,
        timeout: Duration,
    ) -> Listed {
        let deadline = deadline(timeout);
        let (flight, starts) = {
            let mut state = lock(&self.state);
            match state.current(ttl) {
                Some(Ok(cards)) => return Some(cards),
                Some(Err(flight)) => (flight, None),
                None => {
                    let id = state.next;
                    state.next += 1;
                    let (tx, rx) = futures::channel::oneshot::channel::<Listed>();
                    // A task that ended without its list answered none.
                    let fetch = rx.map(|got| got.ok().flatten()).boxed().shared();
                    let until = deadline.and_then(|d| d.checked_add(WAIT_SLACK));
                    let flight = Flight { id, fetch, until };
                    state.in_flight = Some(flight.clone());
                    (flight, Some(tx))
                }
            }
        };
        if let Some(tx) = starts {
            // Made before the fetch: a `send` that panics drops it too.
            let mut ended = Ended {
                state: Arc::downgrade(&self.state),
                id: flight.id,
            };
            let fetch = fetch(set, transport, deadline);
            // Spawned with the state unlocked: on a runtime shutting down `spawn` drops
            // the task at once, and `ended` locks the state.
            tokio::spawn(async move {
                let cards = fetch.await.map(Arc::new);
                ended.kept(cards.as_ref());
                let _ = tx.send(cards);
            });
        }
        let Some(until) = flight.until else {
            return flight.fetch.await;
        };
        // A fetch on another runtime that is no longer driven never ends.
        match tokio::time::timeout_at(until, flight.fetch).await {
            Ok(cards) => cards,
            Err(_) => {
                lock(&self.state).end(flight.id);
                None
            }
        }
    }
}

/// `timeout` from now; none when too large for the clock, as `tokio::time::timeout`
/// has it.
fn deadline(timeout: Duration) -> Option<tokio::time::Instant> {
    tokio::time::Instant::now().checked_add(timeout)
}

/// Each decode server's list, merged, then the declared models no engine listed. Each
/// server's answer, head and body, has until `deadline` (none: no limit); one late or
/// failed is left out.
fn fetch(
    set: Arc<EndpointSet>,
    transport: &dyn Transport,
    deadline: Option<tokio::time::Instant>,
) -> impl Future<Output = Option<Vec<Card>>> + Send + 'static {
    // One fetch per server (the ranks of an engine share it): one hash per endpoint.
    let servers: Vec<Arc<Endpoint>> = {
        let mut seen: HashSet<&http::uri::Authority> = HashSet::new();
        set.by_role(Role::Decode)
            .iter()
            .filter(|ep| seen.insert(ep.authority()))
            .cloned()
            .collect()
    };
    let fetches: Vec<_> = servers
        .iter()
        .map(|ep| {
            let sent = ep.uri("/v1/models").map(|uri| {
                let mut r = Request::new(Bytes::new());
                *r.uri_mut() = uri;
                transport.send(r)
            });
            let list = async move {
                let resp = sent.ok()?.await.ok()?;
                if !resp.status().is_success() {
                    return None;
                }
                let body = collect_limited(resp.into_body(), LIST_LIMIT).await.ok()?;
                let list: ModelList = serde_json::from_slice(&body).ok()?;
                Some(list.data)
            };
            async move {
                match deadline {
                    Some(at) => tokio::time::timeout_at(at, list).await.ok().flatten(),
                    None => list.await,
                }
            }
        })
        .collect();
    async move {
        let lists = futures::future::join_all(fetches).await;
        merge(&set, &servers, lists)
    }
}

/// The lists of `servers` (`None` for one that did not answer), merged by `id` in
/// order, then a card for each model declared in `set` that no engine listed; `None`
/// when no server answered and no model is declared.
fn merge(
    set: &EndpointSet,
    servers: &[Arc<Endpoint>],
    lists: Vec<Option<Vec<Card>>>,
) -> Option<Vec<Card>> {
    let mut answered = false;
    let mut cards: Vec<Card> = Vec::new();
    // The ids of `cards`, for the merge's "already listed": one hash per card, where a
    // scan of the list per card was quadratic in an engine's answer (a 4 MiB list holds
    // ~260k ids).
    let mut ids: HashSet<IdKey> = HashSet::new();
    // Each server's base model card, by its authority.
    let mut base_of: HashMap<&http::uri::Authority, Card> = HashMap::new();
    for (ep, list) in servers.iter().zip(lists) {
        let Some(list) = list else {
            continue;
        };
        answered = true;
        // The engine's base model: the card without a parent (LoRA cards name one).
        if let Some(base) = list.iter().find(|c| c.base) {
            base_of
                .entry(ep.authority())
                .or_insert_with(|| base.clone());
        }
        for card in list {
            if ids.insert(card.id.clone()) {
                cards.push(card);
            }
        }
    }
    // For each declared name, the base card of the first server (in the set's order)
    // with a decode endpoint declaring it: one pass over the declarations, where a scan
    // of every endpoint's names per name cost names × endpoints × names per endpoint.
    let mut base_for: HashMap<&str, &Card> = HashMap::new();
    if !set.served_models().is_empty() {
        for ep in set.by_role(Role::Decode) {
            let (Some(models), Some(base)) = (ep.models(), base_of.get(ep.authority())) else {
                continue;
            };
            for m in models {
                base_for.entry(&**m).or_insert(base);
            }
        }
    }
    for name in set.served_models() {
        if !ids.insert(IdKey::Str(name.to_string())) {
            continue;
        }
        let base = base_for.get(&**name).map(|card| (*card).clone());
        cards.push(declared(name, base));
    }
    (answered || !cards.is_empty()).then_some(cards)
}

/// A card's `id` as the merge compares them: a string (what engines send) by its text,
/// any other value by its JSON text (equal values write equal text, but for a float
/// zero's sign; one longer than 4 KiB as the engine wrote it), a missing one as
/// itself; a string and a number of the same digits differ, as the values do.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum IdKey {
    Missing,
    Str(String),
    Other(String),
}

impl IdKey {
    fn of(id: &RawValue) -> Self {
        let text = id.get();
        if let Ok(s) = serde_json::from_str::<String>(text) {
            return IdKey::Str(s);
        }
        let written = (text.len() <= 4096)
            .then(|| serde_json::from_str::<serde_json::Value>(text).ok())
            .flatten()
            .map(|v| v.to_string());
        IdKey::Other(written.unwrap_or_else(|| text.to_owned()))
    }
}

/// The card for a model an endpoint declares: its engine's base card under the
/// declared name (its other members as the engine wrote them), or, when no engine
/// answered, vLLM's card shape with what is known.
fn declared(name: &str, base: Option<Card>) -> Card {
    let raw = match base {
        Some(base) => renamed(&base.raw, name),
        None => serde_json::json!({
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "vllm",
            "root": name,
            "parent": null,
            "max_model_len": null,
            "permission": [],
        })
        .to_string(),
    };
    Card {
        // A JSON object the proxy wrote (or copied) whole.
        raw: RawValue::from_string(raw).unwrap_or_else(|_| empty_card()),
        id: IdKey::Str(name.to_owned()),
        base: true,
    }
}

/// An object with no member: the card of a name whose base card could not be copied
/// (never: it was read as an object).
fn empty_card() -> Box<RawValue> {
    RawValue::from_string("{}".to_owned()).unwrap_or_else(|_| unreachable!("`{{}}` is JSON"))
}

/// The JSON object `card` with its `id` (every copy of it) replaced by `name`.
fn renamed(card: &RawValue, name: &str) -> String {
    let mut out = Vec::with_capacity(card.get().len() + name.len() + 8);
    let mut o = raw::Object::open(&mut out);
    // A card was read as an object: its members always visit.
    let _ = o.copy(card.get(), |key, _, _| {
        if key == "id" {
            raw::Edit::Drop
        } else {
            raw::Edit::Keep
        }
    });
    o.value("id", &name);
    o.close();
    String::from_utf8(out).unwrap_or_default()
}

/// An engine's `{"data": [cards]}`: at most [`MAX_CARDS`] objects, read unbuilt.
struct ModelList {
    data: Vec<Card>,
}

impl<'de> serde::Deserialize<'de> for ModelList {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        struct Raw {
            data: Cards,
        }
        Raw::deserialize(d).map(|r| ModelList { data: r.data.0 })
    }
}

struct Cards(Vec<Card>);

impl<'de> serde::Deserialize<'de> for Cards {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Each;
        impl<'de> serde::de::Visitor<'de> for Each {
            type Value = Cards;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of model cards")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Cards, A::Error> {
                use serde::de::Error;
                let mut out = Vec::new();
                while let Some(raw) = seq.next_element::<Box<RawValue>>()? {
                    if out.len() == MAX_CARDS {
                        return Err(A::Error::custom("too many model cards"));
                    }
                    out.push(Card::read(raw).ok_or_else(|| A::Error::custom("not a card"))?);
                }
                Ok(Cards(out))
            }
        }
        d.deserialize_seq(Each)
    }
}

impl crate::service::Inner {
    /// `GET /v1/models` (`id` `None`) or `GET /v1/models/{id}`.
    pub(crate) async fn models(&self, id: Option<&str>) -> http::Response<PdBody> {
        let set = self.orchestrator.source().snapshot();
        let cards = self
            .config
            .models
            .cards(
                set,
                self.orchestrator.transport(),
                self.config.models_ttl,
                self.config.models_timeout,
            )
            .await;
        let Some(cards) = cards else {
            return error_response(
                StatusCode::BAD_GATEWAY,
                "no decode endpoint answered GET /v1/models",
                "server_error",
                "decode_failed",
            );
        };
        let Some(id) = id else {
            let len: usize = cards.iter().map(|c| c.raw.get().len() + 1).sum();
            let mut body = String::with_capacity(len + 32);
            body.push_str(r#"{"object":"list","data":["#);
            for (i, card) in cards.iter().enumerate() {
                if i > 0 {
                    body.push(',');
                }
                body.push_str(card.raw.get());
            }
            body.push_str("]}");
            return json_response(StatusCode::OK, Bytes::from(body));
        };
        let id = percent_decode(id);
        match cards.iter().find(|c| c.id_str() == Some(&id)) {
            Some(card) => json_response(
                StatusCode::OK,
                Bytes::copy_from_slice(card.raw.get().as_bytes()),
            ),
            None => {
                let served = cards
                    .iter()
                    .filter_map(Card::id_str)
                    .map(Arc::from)
                    .collect();
                let err = RouteError::UnknownModel { model: id, served };
                crate::error::pd_error_response(&PdError::from(err))
            }
        }
    }
}

/// `s` with its `%XX` escapes decoded (model ids hold `/` and `:`, which clients may
/// escape); an escape that is not one, or bytes that are not UTF-8, stay as they are.
pub(crate) fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%'
            && let (Some(h), Some(l)) = (
                b.get(i + 1).copied().and_then(hex),
                b.get(i + 2).copied().and_then(hex),
            )
        {
            // Two hex digits make at most 255.
            out.push(u8::try_from(h * 16 + l).unwrap_or(b'?'));
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap_or_else(|_| s.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The card `json`, read as an engine's.
    fn read(json: &str) -> Card {
        Card::read(RawValue::from_string(json.to_owned()).unwrap()).unwrap()
    }

    /// `card` built, to look at.
    fn built(card: &Card) -> serde_json::Value {
        serde_json::from_str(card.raw.get()).unwrap()
    }

    /// Cards are kept as their engine wrote them; a list of more than `MAX_CARDS`, or
    /// with an element that is no card, is no list.
    #[test]
    fn cards_are_kept_as_written_and_lists_have_a_ceiling() {
        let list: ModelList = serde_json::from_str(
            r#"{"data":[{"id":"m","parent":"x","parent":null,"w":[0, 1e400]}],"object":"list"}"#,
        )
        .unwrap();
        let card = &list.data[0];
        assert_eq!(
            card.raw.get(),
            r#"{"id":"m","parent":"x","parent":null,"w":[0, 1e400]}"#
        );
        assert_eq!((card.id_str(), card.base), (Some("m"), true));
        let renamed = declared("alias", Some(card.clone()));
        assert_eq!(
            renamed.raw.get(),
            r#"{"parent":"x","parent":null,"w":[0, 1e400],"id":"alias"}"#
        );
        let many = format!(r#"{{"data":[{}]}}"#, vec!["{}"; MAX_CARDS + 1].join(","));
        assert!(serde_json::from_str::<ModelList>(&many).is_err());
        let at = format!(r#"{{"data":[{}]}}"#, vec!["{}"; MAX_CARDS].join(","));
        assert_eq!(
            serde_json::from_str::<ModelList>(&at).unwrap().data.len(),
            MAX_CARDS
        );
        assert!(serde_json::from_str::<ModelList>(r#"{"data":[{},1]}"#).is_err());
    }

    #[test]
    fn escapes_decode_and_broken_ones_stay() {
        assert_eq!(percent_decode("org%2Fmodel%3Av1"), "org/model:v1");
        assert_eq!(percent_decode("a%2"), "a%2");
        assert_eq!(percent_decode("a%zz"), "a%zz");
        assert_eq!(percent_decode("plain/id"), "plain/id");
    }

    /// Decode servers answering `GET /v1/models` with the list of their authority.
    struct Lists(std::collections::HashMap<String, String>);

    impl disagg_core::transport::Transport for Lists {
        fn send(&self, req: Request<Bytes>) -> disagg_core::transport::ResponseFuture {
            use http_body_util::BodyExt;
            let authority = req.uri().authority().map(ToString::to_string);
            let body = authority
                .and_then(|a| self.0.get(&a).cloned())
                .unwrap_or_default();
            Box::pin(async move {
                let body = http_body_util::Full::new(Bytes::from(body))
                    .map_err(|never| match never {})
                    .boxed();
                Ok(http::Response::new(body))
            })
        }
    }

    /// `{"data": [..]}` of a card per id, owned by `owner`.
    fn list(ids: impl Iterator<Item = usize>, owner: &str) -> String {
        let cards: Vec<serde_json::Value> = ids
            .map(|i| serde_json::json!({"id": format!("m{i}"), "object": "model", "owned_by": owner}))
            .collect();
        serde_json::json!({ "data": cards }).to_string()
    }

    #[tokio::test]
    async fn long_lists_merge_by_id_in_order_first_listing_wins() {
        // Two servers of 50,000 ids each, 25,000 of them shared; a declared name no
        // engine lists, and one it does.
        let lists = Lists(
            [
                ("a:1".to_owned(), list(0..50_000, "a")),
                ("b:1".to_owned(), list(25_000..75_000, "b")),
            ]
            .into(),
        );
        let ep = |url: &str| disagg_core::Endpoint::new(url, Role::Decode).map(Arc::new);
        let set = EndpointSet::new([
            ep("http://a:1").unwrap(),
            Arc::new(
                disagg_core::Endpoint::new("http://b:1", Role::Decode)
                    .unwrap()
                    .with_models(["alias", "m3"]),
            ),
        ]);
        let cards = fetch(Arc::new(set), &lists, deadline(Duration::from_secs(60)))
            .await
            .unwrap();
        assert_eq!(cards.len(), 75_001);
        // a's cards in its order, then b's it did not list, then the declared one.
        for (i, card) in cards[..75_000].iter().enumerate() {
            let card = built(card);
            assert_eq!(card["id"], format!("m{i}"));
            assert_eq!(card["owned_by"], if i < 50_000 { "a" } else { "b" }, "{i}");
        }
        assert_eq!(built(&cards[75_000])["id"], "alias");
        // b declares it: b's base card (its first), renamed.
        assert_eq!(built(&cards[75_000])["owned_by"], "b");
    }

    #[tokio::test]
    async fn a_declared_name_takes_the_first_declaring_server_with_a_base_card() {
        let card = |owner: &str| {
            serde_json::json!({"data": [
                {"id": format!("lora-{owner}"), "parent": "base", "owned_by": owner},
                {"id": format!("base-{owner}"), "parent": null, "owned_by": owner},
            ]})
            .to_string()
        };
        // b does not answer (no list), so it has no base card to lend.
        let lists = Lists([("a:1".to_owned(), card("a")), ("c:1".to_owned(), card("c"))].into());
        let ep = |url: &str, models: &[&str]| {
            Arc::new(
                disagg_core::Endpoint::new(url, Role::Decode)
                    .unwrap()
                    .with_models(models.iter().copied()),
            )
        };
        let set = EndpointSet::new([
            ep("http://b:1", &["x"]),
            ep("http://c:1@0", &["x", "y"]),
            ep("http://c:1@1", &["x", "y"]),
            ep("http://a:1", &["y", "z"]),
        ]);
        let cards = fetch(Arc::new(set), &lists, deadline(Duration::from_secs(60)))
            .await
            .unwrap();
        let owner = |id: &str| {
            cards
                .iter()
                .map(built)
                .find(|c| c["id"] == id)
                .map(|c| c["owned_by"].clone())
        };
        assert_eq!(owner("x"), Some("c".into()));
        assert_eq!(owner("y"), Some("c".into()));
        assert_eq!(owner("z"), Some("a".into()));
        // c's two ranks are one server: its cards once.
        assert_eq!(
            cards
                .iter()
                .filter(|c| c.id_str() == Some("base-c"))
                .count(),
            1
        );
        assert_eq!(cards.len(), 4 + 3);
    }

    #[test]
    fn ids_of_other_types_are_their_own_and_a_missing_one_is_one() {
        let card = |json: &str| -> Card { read(json) };
        let keys = [
            r#"{"id":"5"}"#,
            r#"{"id":5}"#,
            r#"{"id":null}"#,
            r#"{}"#,
            r#"{"id":{"a":1,"b":2}}"#,
        ]
        .map(|j| card(j).id);
        let distinct: HashSet<&IdKey> = keys.iter().collect();
        assert_eq!(distinct.len(), keys.len());
        assert!(card(r#"{"x":1}"#).id == keys[3]);
        assert!(card(r#"{"id":{"b":2,"a":1}}"#).id == keys[4]);
    }

    #[test]
    fn a_declared_name_keeps_its_engines_fields() {
        let base = read(
            r#"{"id":"m","object":"model","root":"/models/m","parent":null,"max_model_len":4096}"#,
        );
        let card = built(&declared("alias", Some(base)));
        assert_eq!(card["id"], "alias");
        assert_eq!(card["root"], "/models/m");
        assert_eq!(card["max_model_len"], 4096);
        let bare = built(&declared("alias", None));
        assert_eq!(bare["root"], "alias");
        assert!(bare["parent"].is_null());
    }

    /// One decode server whose `GET /v1/models` does as `act` says for the `n`th
    /// request (from 0), each counted as it is sent.
    struct Scripted {
        sent: std::sync::atomic::AtomicUsize,
        act: Box<dyn Fn(usize) -> Act + Send + Sync>,
    }

    enum Act {
        /// Answers `{"data":[{"id":"m"}]}`.
        Answer,
        /// Answers so once it has taken a permit of the semaphore.
        Gated(Arc<tokio::sync::Semaphore>),
        /// Panics in `send` itself.
        PanicInSend,
    }

    impl Scripted {
        fn new(act: impl Fn(usize) -> Act + Send + Sync + 'static) -> Self {
            Scripted {
                sent: std::sync::atomic::AtomicUsize::new(0),
                act: Box::new(act),
            }
        }

        fn sent(&self) -> usize {
            self.sent.load(std::sync::atomic::Ordering::SeqCst)
        }
    }

    impl disagg_core::transport::Transport for Scripted {
        fn send(&self, _: Request<Bytes>) -> disagg_core::transport::ResponseFuture {
            use http_body_util::BodyExt;
            let n = self.sent.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let gate = match (self.act)(n) {
                Act::Answer => None,
                Act::Gated(gate) => Some(gate),
                Act::PanicInSend => panic!("a transport's bug, in send"),
            };
            Box::pin(async move {
                if let Some(gate) = gate {
                    gate.acquire().await.unwrap().forget();
                }
                let body = http_body_util::Full::new(Bytes::from(r#"{"data":[{"id":"m"}]}"#))
                    .map_err(|never| match never {})
                    .boxed();
                Ok(http::Response::new(body))
            })
        }
    }

    /// One decode server.
    fn one_server() -> Arc<EndpointSet> {
        let ep = disagg_core::Endpoint::new("http://e:1", Role::Decode).unwrap();
        Arc::new(EndpointSet::new([Arc::new(ep)]))
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    const TTL: Duration = Duration::from_secs(300);

    /// A fetch started on a runtime that is then dropped (a `serve_threads` thread
    /// that drained) is cancelled with it: the next request, on another runtime,
    /// fetches again rather than being answered its end.
    #[test]
    fn a_fetch_cancelled_with_its_runtime_is_not_answered_again() {
        let catalog = Catalog::default();
        let engine = Scripted::new(|_| Act::Answer);
        let timeout = Duration::from_secs(60);
        runtime().block_on(async {
            let first = catalog.cards(one_server(), &engine, TTL, timeout);
            assert!(first.now_or_never().is_none());
        });
        let cards = runtime().block_on(catalog.cards(one_server(), &engine, TTL, timeout));
        assert_eq!(
            cards.map(|c| c.len()),
            Some(1),
            "the cancelled fetch was answered"
        );
        assert_eq!(engine.sent(), 2);
    }

    /// A transport that panics in `send` fails that request, and leaves no fetch in
    /// flight behind it.
    #[test]
    fn a_send_that_panicked_leaves_no_fetch_in_flight() {
        let catalog = Catalog::default();
        let engine = Scripted::new(|n| {
            if n == 0 {
                Act::PanicInSend
            } else {
                Act::Answer
            }
        });
        let timeout = Duration::from_secs(60);
        let rt = runtime();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            rt.block_on(catalog.cards(one_server(), &engine, TTL, timeout))
        }));
        assert!(panicked.is_err());
        let cards = rt.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(10),
                catalog.cards(one_server(), &engine, TTL, timeout),
            )
            .await
            .expect("the next request waited on the fetch that panicked")
        });
        assert_eq!(cards.map(|c| c.len()), Some(1));
    }

    /// A fetch on a runtime that is no longer driven (but not dropped) never ends: a
    /// request on another runtime that waits for it gives up a little after its
    /// deadline, as a failed fetch, and the next one fetches again.
    #[test]
    fn a_waiter_gives_up_on_a_fetch_that_is_never_driven() {
        let catalog = Catalog::default();
        let engine = Scripted::new(|_| Act::Answer);
        let timeout = Duration::from_millis(200);
        let stopped = runtime();
        stopped.block_on(async {
            let first = catalog.cards(one_server(), &engine, TTL, timeout);
            assert!(first.now_or_never().is_none());
        });
        // `stopped` is not driven from here on: its fetch task never runs.
        runtime().block_on(async {
            let waited = tokio::time::timeout(
                Duration::from_secs(20),
                catalog.cards(one_server(), &engine, TTL, timeout),
            )
            .await
            .expect("the waiter hung with a fetch never driven");
            assert!(waited.is_none());
            let cards = catalog.cards(one_server(), &engine, TTL, timeout).await;
            assert_eq!(cards.map(|c| c.len()), Some(1));
        });
        assert_eq!(engine.sent(), 2);
        drop(stopped);
    }

    /// Each drop of the list forgets the fetch in flight, which still runs against an
    /// engine that holds it: the fetches running at once are bounded, whatever the
    /// rate of drops and requests. A request past the bound is answered the newest
    /// fetch's list; once that one has ended, the next request fetches again.
    #[tokio::test]
    async fn fetches_forgotten_by_drops_are_bounded() {
        let catalog = Catalog::default();
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let held = Arc::clone(&gate);
        let engine = Scripted::new(move |_| Act::Gated(Arc::clone(&held)));
        let timeout = Duration::from_secs(300);
        for _ in 0..8 {
            let asking = catalog.cards(one_server(), &engine, TTL, timeout);
            assert!(asking.now_or_never().is_none());
            catalog.invalidate();
        }
        assert_eq!(engine.sent(), MAX_RUNNING);
        let mut joined = std::pin::pin!(catalog.cards(one_server(), &engine, TTL, timeout));
        assert!((&mut joined).now_or_never().is_none());
        assert_eq!(engine.sent(), MAX_RUNNING);
        // The engine answers them all.
        gate.add_permits(MAX_RUNNING);
        assert_eq!(joined.await.map(|c| c.len()), Some(1));
        assert_eq!(engine.sent(), MAX_RUNNING);
        gate.add_permits(1);
        let cards = catalog.cards(one_server(), &engine, TTL, timeout).await;
        assert_eq!(cards.map(|c| c.len()), Some(1));
        assert_eq!(engine.sent(), MAX_RUNNING + 1);
        // That one's list is kept.
        let cards = catalog.cards(one_server(), &engine, TTL, timeout).await;
        assert_eq!(cards.map(|c| c.len()), Some(1));
        assert_eq!(engine.sent(), MAX_RUNNING + 1);
    }
}
