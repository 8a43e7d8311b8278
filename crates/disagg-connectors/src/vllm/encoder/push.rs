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
//! The consumer must therefore be chosen before the encoder legs
//! ([`EncoderConnector::consumer_first`](disagg_core::encode::EncoderConnector::consumer_first)).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use bytes::Bytes;
use disagg_core::Endpoint;
use disagg_core::encode::EncodePlan;
use disagg_core::error::ConnectorError;
use disagg_json::InvalidParam;
use serde_json::{Map, Value, json};

/// vLLM's default consumer address (`vllm/config/ec_transfer.py`, `ec_ip`).
pub const DEFAULT_EC_HOST: &str = "127.0.0.1";
/// vLLM's default consumer port (`vllm/config/ec_transfer.py`, `ec_port`).
pub const DEFAULT_EC_PORT: u16 = 14579;

/// Where each consumer engine listens for its encoders' pushes, and the transfer ids'
/// source. Given to [`VllmEncoder::with_mooncake_push`](super::VllmEncoder::with_mooncake_push).
#[derive(Debug)]
pub struct MooncakeEcPush {
    /// Per consumer engine (its base URL, without a `@RANK`): `ec_ip` and `ec_port`.
    addresses: HashMap<String, (String, u16)>,
    /// vLLM's tensor-parallel size of the consumers (rank `d` listens at
    /// `ec_port + d·tp_size`).
    tp_size: u32,
    /// Drawn once per connector, so two proxies' transfer ids differ.
    nonce: u64,
    /// Requests planned so far: with the nonce, a transfer id unique per request.
    next: AtomicU64,
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
            nonce: std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish(),
            next: AtomicU64::new(0),
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

    /// `consumer`'s push address for `rank`: `tcp://HOST:PORT`.
    fn consumer_zmq(&self, consumer: &Endpoint, rank: Option<u32>) -> Result<String, InvalidParam> {
        let id = consumer.id().as_str();
        let base = match consumer.rank() {
            Some(_) => id.rsplit_once('@').map_or(id, |(u, _)| u),
            None => id,
        };
        let (host, port) = self
            .addresses
            .get(base.trim_end_matches('/'))
            .map_or((DEFAULT_EC_HOST, DEFAULT_EC_PORT), |(h, p)| {
                (h.as_str(), *p)
            });
        let port = u64::from(rank.unwrap_or(0))
            .checked_mul(u64::from(self.tp_size))
            .and_then(|o| o.checked_add(u64::from(port)))
            .and_then(|p| u16::try_from(p).ok())
            .ok_or_else(|| {
                InvalidParam::new(
                    "ec_transfer_params",
                    "the consumer's EC port for its data-parallel rank is out of range",
                )
            })?;
        Ok(format!("tcp://{host}:{port}"))
    }

    /// `plan` with each encoder leg naming the consumer and one fresh transfer id per
    /// item, in the leg's order; the consumer leg's field is filled in by [`fold`].
    pub(super) fn annotate(
        &self,
        mut plan: EncodePlan,
        consumer: &Endpoint,
        rank: Option<u32>,
    ) -> Result<EncodePlan, InvalidParam> {
        let zmq = self.consumer_zmq(consumer, rank)?;
        let request = self.next.fetch_add(1, Relaxed);
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
        let entries: Map<String, Value> = super::merge_answers(std::slice::from_ref(answer))?;
        for (hash, entry) in entries {
            if items.len() >= super::MAX_ENTRIES {
                return Err(ConnectorError::InvalidEncoderAnswer {
                    problem: "`ec_transfer_params` has too many entries",
                    source: None,
                });
            }
            let named = entry.get("transfer_id").and_then(Value::as_str);
            let by_position = entry
                .get("item_indices")
                .and_then(Value::as_array)
                .and_then(|i| i.first())
                .and_then(Value::as_u64)
                .and_then(|i| ids.get(usize::try_from(i).ok()?));
            let Some(transfer_id) = named.or(by_position.map(String::as_str)) else {
                return Err(ConnectorError::InvalidEncoderAnswer {
                    problem: "an `ec_transfer_params` entry names no item of its leg",
                    source: None,
                });
            };
            items.push(json!({"mm_hash": hash, "transfer_id": transfer_id}));
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use disagg_core::Role;

    #[test]
    fn a_rank_listens_at_the_port_plus_rank_times_tp_and_unknown_consumers_at_vllms_default() {
        let push = MooncakeEcPush::new()
            .with_address("http://10.0.0.5:8100/", "10.0.0.5", 20000)
            .with_tp_size(4);
        let rank = Endpoint::new("http://10.0.0.5:8100@3", Role::Decode).unwrap();
        assert_eq!(
            push.consumer_zmq(&rank, rank.rank()).unwrap(),
            "tcp://10.0.0.5:20012"
        );
        let whole = Endpoint::new("http://10.0.0.5:8100", Role::Decode).unwrap();
        assert_eq!(
            push.consumer_zmq(&whole, None).unwrap(),
            "tcp://10.0.0.5:20000"
        );
        let other = Endpoint::new("http://10.0.0.9:8100", Role::Decode).unwrap();
        assert_eq!(
            push.consumer_zmq(&other, Some(1)).unwrap(),
            "tcp://127.0.0.1:14583"
        );
        // A port past 65535 is refused, not wrapped.
        let far = MooncakeEcPush::new().with_tp_size(u32::MAX);
        assert!(far.consumer_zmq(&other, Some(2)).is_err());
    }

    #[test]
    fn the_consumer_leg_names_each_answered_item_by_its_legs_transfer_id() {
        let push = MooncakeEcPush::new();
        let consumer = Endpoint::new("http://10.0.0.5:8100", Role::Decode).unwrap();
        let plan = EncodePlan {
            legs: vec![disagg_core::encode::EncodeLeg {
                body: Bytes::from_static(br#"{"model":"m","messages":[]}"#),
                items: 2,
            }],
            fields: Vec::new(),
        };
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
}
