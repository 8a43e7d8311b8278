//! vLLM's Mooncake EC connector (`ECMooncakeConnector`, push), on the proxy's side.
//!
//! The facts, from vLLM's own code (`vllm/distributed/ec_transfer/ec_connector/mooncake/`,
//! `metadata.py` and `scheduler.py`; `vllm/config/ec_transfer.py` for the address): the
//! consumer (the prefill, or a prefill-decode engine) listens for its producers at
//! `ec_ip:ec_port` (defaults `127.0.0.1` and `14579`), its data-parallel rank `d` at
//! port `ec_port + d·tp_size`. An encoder leg's `ec_transfer_params` names that address,
//! `consumer_zmq: "tcp://HOST:PORT"`, and one `{transfer_id}` per item of the leg in
//! `ec_items` (an item without `mm_hash` is matched by its position); the encoder pushes
//! each item's embeddings there under its transfer id. The consumer's request then
//! carries `ec_transfer_params: {ec_items: [{mm_hash, transfer_id}]}` and waits for those
//! transfers, on the rank the proxy pinned (`X-data-parallel-rank`).
//!
//! The consumer leg is always pinned to the rank the items were pushed to. vLLM 0.33
//! places a request without that header on a rank of its own choice (its DP client's
//! load balancing, `vllm/v1/engine/core_client.py`, `DPLBAsyncMPClient`), and a
//! consumer's rank waits only for what reached its own EC port. So a rank the route
//! names is kept; otherwise this connector chooses one of the consumer's
//! `dp_size` ranks (round robin per consumer engine), names its port to the encoders and
//! returns it in [`EncodePlan::rank`], which the orchestrator pins. With `dp_size` 1
//! (the default, or a size not declared) that is rank 0, pinned explicitly: right for
//! a consumer without data parallelism, and for one with it, whose requests then all
//! run on rank 0 rather than fail.
//!
//! The consumer must therefore be chosen before the encoder legs
//! ([`EncoderConnector::consumer_first`](disagg_core::encode::EncoderConnector::consumer_first)).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::Mutex;

use bytes::Bytes;
use disagg_core::Endpoint;
use disagg_core::encode::EncodePlan;
use disagg_core::error::ConnectorError;
use disagg_json::InvalidParam;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use crate::common::Rooms;

use disagg_json::raw as json;

/// vLLM's default consumer address (`vllm/config/ec_transfer.py`, `ec_ip`).
pub const DEFAULT_EC_HOST: &str = "127.0.0.1";
/// vLLM's default consumer port (`vllm/config/ec_transfer.py`, `ec_port`).
pub const DEFAULT_EC_PORT: u16 = 14579;

/// Most consumer engines whose rank turns are kept.
const MAX_CONSUMERS: usize = 4096;

/// Where each consumer engine listens for its encoders' pushes, and the transfer ids'
/// source. Given to [`VllmEncoder::with_mooncake_push`](super::VllmEncoder::with_mooncake_push).
#[derive(Debug)]
pub struct MooncakeEcPush {
    /// Per consumer engine (its base URL, without a `@RANK`): `ec_ip` and `ec_port`.
    addresses: HashMap<String, (String, u16)>,
    /// vLLM's tensor-parallel size of the consumers (rank `d` listens at
    /// `ec_port + d·tp_size`).
    tp_size: u32,
    /// vLLM's data-parallel size of the consumers: the ranks a request naming none is
    /// spread over.
    dp_size: u32,
    /// Per consumer engine (its base URL): the requests given a rank of it so far.
    turns: Mutex<HashMap<String, u32>>,
    /// Drawn once per connector, so two proxies' transfer ids differ.
    nonce: u64,
    /// Each request's part of its transfer ids: unique per process and, keyed by a
    /// secret, unpredictable from the ids an encoder saw (one that could name another
    /// request's ids could push its own items under them first).
    ids: Rooms,
}

impl Default for MooncakeEcPush {
    fn default() -> Self {
        Self::new()
    }
}

impl MooncakeEcPush {
    /// Every consumer at vLLM's default address, tensor-parallel size 1.
    pub fn new() -> Self {
        MooncakeEcPush {
            addresses: HashMap::new(),
            tp_size: 1,
            dp_size: 1,
            turns: Mutex::new(HashMap::new()),
            nonce: std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish(),
            ids: Rooms::new(),
        }
    }

    /// The consumer engine at `url` (as given with `--prefill` / `--decode`, without
    /// `@RANK`) listens at `host:port` (its `ec_ip`, `ec_port`).
    pub fn with_address(mut self, url: &str, host: &str, port: u16) -> Self {
        self.addresses.insert(
            url.trim_end_matches('/').to_owned(),
            (host.to_owned(), port),
        );
        self
    }

    /// The consumers' tensor-parallel size (at least 1).
    pub fn with_tp_size(mut self, tp: u32) -> Self {
        self.tp_size = tp.max(1);
        self
    }

    /// The consumers' data-parallel size (at least 1; default 1): a request whose
    /// route names no rank of its consumer is given one of these ranks, round robin
    /// per consumer engine, and pinned to it.
    pub fn with_dp_size(mut self, dp: u32) -> Self {
        self.dp_size = dp.max(1);
        self
    }

    /// The base URL of `consumer`: its id without `@RANK`.
    fn base(consumer: &Endpoint) -> &str {
        let id = consumer.id().as_str();
        let base = match consumer.rank() {
            Some(_) => id.rsplit_once('@').map_or(id, |(u, _)| u),
            None => id,
        };
        base.trim_end_matches('/')
    }

    /// The rank of `consumer` its next request naming none goes to: its ranks in turn.
    fn next_rank(&self, consumer: &Endpoint) -> u32 {
        if self.dp_size <= 1 {
            return 0;
        }
        let Ok(mut turns) = self.turns.lock() else {
            return 0;
        };
        // Bounded by the consumers ever seen; discovery churning through many
        // engines starts the turns over.
        if turns.len() >= MAX_CONSUMERS {
            turns.clear();
        }
        let base = Self::base(consumer);
        let turn = match turns.get_mut(base) {
            Some(t) => t,
            None => turns.entry(base.to_owned()).or_insert(0),
        };
        let rank = *turn % self.dp_size;
        *turn = turn.wrapping_add(1);
        rank
    }

    /// Where the consumer engine at `url` (its URL without `@RANK`) listens for rank
    /// `rank`'s pushes: its host, and its `ec_port` (given with
    /// [`with_address`](Self::with_address), else vLLM's default) plus
    /// `rank·tp_size`; the port `None` past 65535.
    fn address(&self, url: &str, rank: u32) -> (&str, Option<u16>) {
        let (host, port) = self
            .addresses
            .get(url.trim_end_matches('/'))
            .map_or((DEFAULT_EC_HOST, DEFAULT_EC_PORT), |(h, p)| {
                (h.as_str(), *p)
            });
        let port = u64::from(rank)
            .checked_mul(u64::from(self.tp_size))
            .and_then(|o| o.checked_add(u64::from(port)))
            .and_then(|p| u16::try_from(p).ok());
        (host, port)
    }

    /// The EC port data-parallel rank `rank` of the consumer engine at `url` (its URL
    /// without `@RANK`) listens on: its `ec_port` plus `rank·tp_size`, `None` when that
    /// is past 65535. For a check at start-up: a rank whose port is out of range fails
    /// every request planned for it.
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_connectors::vllm::MooncakeEcPush;
    /// let push = MooncakeEcPush::new()
    ///     .with_tp_size(1000)
    ///     .with_address("http://p:8100", "10.0.0.5", 65000);
    /// assert_eq!(push.port_of("http://p:8100", 0), Some(65000));
    /// assert_eq!(push.port_of("http://p:8100", 1), None);
    /// // An engine without an address: vLLM's default port, 14579.
    /// assert_eq!(push.port_of("http://d:8200", 1), Some(15579));
    /// ```
    pub fn port_of(&self, url: &str, rank: u32) -> Option<u16> {
        self.address(url, rank).1
    }

    /// `consumer`'s push address for `rank`: `tcp://HOST:PORT`.
    fn consumer_zmq(&self, consumer: &Endpoint, rank: u32) -> Result<String, InvalidParam> {
        let (host, port) = self.address(Self::base(consumer), rank);
        let port = port.ok_or_else(|| {
            InvalidParam::new(
                "ec_transfer_params",
                "the consumer's EC port for its data-parallel rank is out of range",
            )
        })?;
        Ok(format!("tcp://{host}:{port}"))
    }

    /// `plan` with each encoder leg naming the consumer's `rank` (when `None`, one
    /// chosen here and set on the plan's [`rank`](EncodePlan::rank)) and one fresh
    /// transfer id per item, in the leg's order; the consumer leg's field is filled in
    /// by [`fold`].
    pub(super) fn annotate(
        &self,
        mut plan: EncodePlan,
        consumer: &Endpoint,
        rank: Option<u32>,
    ) -> Result<EncodePlan, InvalidParam> {
        let rank = match rank {
            Some(r) => r,
            None => {
                let r = self.next_rank(consumer);
                plan.rank = Some(r);
                r
            }
        };
        let zmq = self.consumer_zmq(consumer, rank)?;
        let request = self.ids.next_room();
        for (l, leg) in plan.legs.iter_mut().enumerate() {
            let items: Vec<Value> = (0..leg.items)
                .map(|i| json!({"transfer_id": format!("{:016x}{request:016x}-{l}-{i}", self.nonce)}))
                .collect();
            let params = json!({"consumer_zmq": zmq, "ec_items": items});
            let Some((b'}', head)) = leg.body.split_last() else {
                continue;
            };
            let mut body = Vec::with_capacity(leg.body.len() + 64 + 48 * leg.items);
            body.extend_from_slice(head);
            body.extend_from_slice(b",\"ec_transfer_params\":");
            body.extend_from_slice(params.to_string().as_bytes());
            body.push(b'}');
            leg.body = Bytes::from(body);
        }
        Ok(plan)
    }
}

/// The transfer ids a leg's body names, in its items' order.
fn transfer_ids(leg: &Bytes) -> Vec<String> {
    let Ok(Some(raw)) = disagg_json::top_level_field(leg, "ec_transfer_params") else {
        return Vec::new();
    };
    let Ok(v) = serde_json::from_slice::<Value>(&raw) else {
        return Vec::new();
    };
    v.get("ec_items")
        .and_then(Value::as_array)
        .map(|items| {
            items
                .iter()
                .filter_map(|i| i.get("transfer_id")?.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The consumer leg's `ec_transfer_params`: `{ec_items: [{mm_hash, transfer_id}]}`, an
/// entry per item an encoder answered for (its transfer id the one the answer names, else
/// the one its leg gave the item at the answer's first `item_indices` position). `None`
/// when no encoder answered for any item (the consumer then encodes them itself).
pub(super) fn fold(plan: &EncodePlan, answers: &[Bytes]) -> Result<Option<Bytes>, ConnectorError> {
    let mut items = Vec::new();
    for (leg, answer) in plan.legs.iter().zip(answers) {
        let ids = transfer_ids(&leg.body);
        // Each entry read where it lies in the answer: only its transfer id is kept.
        super::answer_entries(answer, |hash, entry| {
            if items.len() >= super::MAX_ENTRIES {
                return Err(super::too_many());
            }
            let entry = entry.get();
            let [named, indices] =
                json::members_named(entry, ["transfer_id", "item_indices"]).unwrap_or_default();
            let named = named.and_then(|t| serde_json::from_str::<String>(t.get()).ok());
            let by_position = indices
                .and_then(first_element)
                .and_then(json::u64_of)
                .and_then(|i| ids.get(usize::try_from(i).ok()?));
            let Some(transfer_id) = named.or_else(|| by_position.cloned()) else {
                return Err(ConnectorError::InvalidEncoderAnswer {
                    problem: "an `ec_transfer_params` entry names no item of its leg",
                    source: None,
                });
            };
            items.push(json!({"mm_hash": hash, "transfer_id": transfer_id}));
            Ok(())
        })?;
    }
    if items.is_empty() {
        return Ok(None);
    }
    let raw = serde_json::to_vec(&json!({ "ec_items": items })).map_err(|source| {
        ConnectorError::Encode {
            field: "ec_transfer_params",
            source,
        }
    })?;
    Ok(Some(Bytes::from(raw)))
}

/// The first element of the JSON list `raw`, unbuilt; `None` when `raw` is not a list
/// or is empty.
fn first_element(raw: &RawValue) -> Option<&RawValue> {
    let mut first = None;
    // `f` stops the walk's calls at the first; the rest are skipped over, unbuilt.
    match super::each_element(raw.get(), |value| {
        first = Some(value);
        Err(())
    }) {
        Err(()) => first,
        Ok(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use disagg_core::Role;
    use serde_json::Map;

    /// A plan of one encoder leg holding `items` items.
    fn one_leg(items: usize) -> EncodePlan {
        EncodePlan {
            legs: vec![disagg_core::encode::EncodeLeg {
                body: Bytes::from_static(br#"{"model":"m","messages":[]}"#),
                items,
            }],
            fields: Vec::new(),
            rank: None,
        }
    }

    #[test]
    fn a_rank_listens_at_the_port_plus_rank_times_tp_and_unknown_consumers_at_vllms_default() {
        let push = MooncakeEcPush::new()
            .with_address("http://10.0.0.5:8100/", "10.0.0.5", 20000)
            .with_tp_size(4);
        let rank = Endpoint::new("http://10.0.0.5:8100@3", Role::Decode).unwrap();
        assert_eq!(
            push.consumer_zmq(&rank, rank.rank().unwrap_or(0)).unwrap(),
            "tcp://10.0.0.5:20012"
        );
        let whole = Endpoint::new("http://10.0.0.5:8100", Role::Decode).unwrap();
        assert_eq!(
            push.consumer_zmq(&whole, 0).unwrap(),
            "tcp://10.0.0.5:20000"
        );
        let other = Endpoint::new("http://10.0.0.9:8100", Role::Decode).unwrap();
        assert_eq!(
            push.consumer_zmq(&other, 1).unwrap(),
            "tcp://127.0.0.1:14583"
        );
        // A port past 65535 is refused, not wrapped.
        let far = MooncakeEcPush::new().with_tp_size(u32::MAX);
        assert!(far.consumer_zmq(&other, 2).is_err());
    }

    fn zmq_of(plan: &EncodePlan) -> String {
        let raw = disagg_json::top_level_field(&plan.legs[0].body, "ec_transfer_params")
            .unwrap()
            .unwrap();
        let v: Value = serde_json::from_slice(&raw).unwrap();
        v["consumer_zmq"].as_str().unwrap().to_owned()
    }

    #[test]
    fn a_consumer_without_a_rank_is_given_its_ranks_in_turn_and_a_named_rank_is_kept() {
        let push = MooncakeEcPush::new()
            .with_address("http://a:8100", "10.0.0.1", 20000)
            .with_address("http://b:8100", "10.0.0.2", 20000)
            .with_tp_size(2)
            .with_dp_size(3);
        let a = Endpoint::new("http://a:8100", Role::Prefill).unwrap();
        let b = Endpoint::new("http://b:8100", Role::Prefill).unwrap();
        let plan = one_leg(1);
        // Turns are per consumer: b's first request is its rank 0 whatever a had.
        let mut got = Vec::new();
        for c in [&a, &a, &b, &a, &a, &b] {
            let p = push.annotate(plan.clone(), c, None).unwrap();
            got.push((p.rank, zmq_of(&p)));
        }
        assert_eq!(
            got,
            [
                (Some(0), "tcp://10.0.0.1:20000".to_owned()),
                (Some(1), "tcp://10.0.0.1:20002".to_owned()),
                (Some(0), "tcp://10.0.0.2:20000".to_owned()),
                (Some(2), "tcp://10.0.0.1:20004".to_owned()),
                (Some(0), "tcp://10.0.0.1:20000".to_owned()),
                (Some(1), "tcp://10.0.0.2:20002".to_owned()),
            ]
        );
        // A rank the route names is the one pushed to, and the plan pins nothing more.
        let named = push.annotate(plan.clone(), &a, Some(2)).unwrap();
        assert_eq!(
            (named.rank, zmq_of(&named)),
            (None, "tcp://10.0.0.1:20004".to_owned())
        );
        // Size 1 (the default): rank 0, pinned explicitly.
        let single = MooncakeEcPush::new().annotate(plan, &a, None).unwrap();
        assert_eq!(single.rank, Some(0));
        assert_eq!(zmq_of(&single), "tcp://127.0.0.1:14579");
    }

    /// An encoder sees the transfer ids of its legs; the next request's must not follow
    /// from them (a counter did: the encoder could push items under them first).
    #[test]
    fn a_requests_transfer_ids_do_not_tell_the_next_ones() {
        let push = MooncakeEcPush::new();
        let consumer = Endpoint::new("http://10.0.0.5:8100", Role::Decode).unwrap();
        let part = |plan: &EncodePlan| {
            let id = transfer_ids(&plan.legs[0].body).remove(0);
            u64::from_str_radix(&id[16..32], 16).unwrap()
        };
        let parts: Vec<u64> = (0..64)
            .map(|_| part(&push.annotate(one_leg(1), &consumer, None).unwrap()))
            .collect();
        let steps = parts
            .windows(2)
            .filter(|w| w[1].wrapping_sub(w[0]) == 1)
            .count();
        assert_eq!(steps, 0, "{parts:x?}");
        let distinct: std::collections::HashSet<_> = parts.iter().collect();
        assert_eq!(distinct.len(), parts.len());
    }

    #[test]
    fn the_consumer_leg_names_each_answered_item_by_its_legs_transfer_id() {
        let push = MooncakeEcPush::new();
        let consumer = Endpoint::new("http://10.0.0.5:8100", Role::Decode).unwrap();
        let plan = one_leg(2);
        let first = push.annotate(plan.clone(), &consumer, None).unwrap();
        let second = push.annotate(plan, &consumer, None).unwrap();
        let ids = transfer_ids(&first.legs[0].body);
        assert_eq!(ids.len(), 2);
        assert_ne!(ids[0], ids[1]);
        // Another request, other ids.
        assert!(
            transfer_ids(&second.legs[0].body)
                .iter()
                .all(|i| !ids.contains(i))
        );
        // The answer names the second item by position, the first by its own id.
        let answer = Bytes::from(
            json!({"ec_transfer_params": {
                "h1": {"modality": "image", "item_indices": [1], "metadata": {}},
                "h0": {"modality": "image", "item_indices": [0], "transfer_id": "own"},
            }})
            .to_string(),
        );
        let raw = fold(&first, &[answer]).unwrap().unwrap();
        let v: Value = serde_json::from_slice(&raw).unwrap();
        let items = v["ec_items"].as_array().unwrap();
        assert!(
            items.contains(&json!({"mm_hash": "h1", "transfer_id": ids[1]})),
            "{v}"
        );
        assert!(
            items.contains(&json!({"mm_hash": "h0", "transfer_id": "own"})),
            "{v}"
        );
    }

    #[test]
    fn hostile_encoder_answers_are_refused_with_their_problem() {
        let push = MooncakeEcPush::new();
        let consumer = Endpoint::new("http://10.0.0.5:8100", Role::Decode).unwrap();
        let plan = push.annotate(one_leg(2), &consumer, None).unwrap();
        let answer =
            |params: Value| Bytes::from(json!({ "ec_transfer_params": params }).to_string());
        // An entry naming a position the leg does not have, a position that is not an
        // index, or none at all (and no transfer id of its own): refused.
        for entry in [
            json!({"modality": "image", "item_indices": [2]}),
            json!({"modality": "image", "item_indices": [u64::MAX]}),
            json!({"modality": "image", "item_indices": [-1]}),
            json!({"modality": "image", "item_indices": ["0"]}),
            json!({"modality": "image", "item_indices": []}),
            json!({"modality": "image"}),
        ] {
            let got = fold(&plan, &[answer(json!({ "h": entry }))]);
            assert!(
                matches!(got, Err(ConnectorError::InvalidEncoderAnswer { .. })),
                "{entry}: {got:?}"
            );
        }
        // More entries than the ceiling: refused rather than collected.
        let many: Map<String, Value> = (0..=super::super::MAX_ENTRIES)
            .map(|i| (format!("h{i}"), json!({"transfer_id": "t"})))
            .collect();
        let got = fold(&plan, &[answer(Value::Object(many))]);
        assert!(
            matches!(got, Err(ConnectorError::InvalidEncoderAnswer { .. })),
            "{got:?}"
        );
    }

    #[test]
    fn entries_are_read_where_they_lie_in_the_answer() {
        let push = MooncakeEcPush::new();
        let consumer = Endpoint::new("http://10.0.0.5:8100", Role::Decode).unwrap();
        let plan = push.annotate(one_leg(2), &consumer, None).unwrap();
        let ids = transfer_ids(&plan.legs[0].body);
        // Numbers no `Value` holds are no matter; the position is the first index; an
        // escaped transfer id is read unescaped; a repeated identifier's last entry counts.
        let answer = Bytes::from_static(
            br#"{"ec_transfer_params":{
                "a":{"item_indices":[1, 1e400],"metadata":{"x":1e400}},
                "b":{"transfer_id":"t\u0031","item_indices":[0]},
                "c":{"transfer_id":"old"},"c":{"transfer_id":7,"item_indices":[0]}}}"#,
        );
        let raw = fold(&plan, &[answer]).unwrap().unwrap();
        let v: Value = serde_json::from_slice(&raw).unwrap();
        assert_eq!(
            v,
            json!({"ec_items": [
                {"mm_hash": "a", "transfer_id": ids[1]},
                {"mm_hash": "b", "transfer_id": "t1"},
                {"mm_hash": "c", "transfer_id": ids[0]},
            ]})
        );
        // Only `null` or absent parameters are no entries.
        let none = Bytes::from_static(br#"{"ec_transfer_params":null}"#);
        assert_eq!(fold(&plan, &[none]).unwrap(), None);
        assert_eq!(
            first_element(serde_json::from_str("[ 3 , 4]").unwrap()).map(RawValue::get),
            Some("3")
        );
        assert!(first_element(serde_json::from_str("[]").unwrap()).is_none());
        assert!(first_element(serde_json::from_str("{}").unwrap()).is_none());
    }
}
