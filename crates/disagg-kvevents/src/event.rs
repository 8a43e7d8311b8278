//! The engines' KV-cache events on the wire, decoded.
//!
//! vLLM (`vllm/distributed/kv_events.py`, 0.33) and SGLang
//! (`python/sglang/srt/disaggregation/kv_events.py`, 0.5.23) publish the same format
//! over a ZMQ `PUB` socket: each message is three frames, `[topic, seq, payload]`,
//! where `seq` is a big-endian `u64` that grows by one per message and `payload` is
//! msgpack of an array-like batch, `[ts, events, data_parallel_rank]` (trailing fields
//! left at their default may be omitted; SGLang calls the third `attn_dp_rank`).
//!
//! Events come in two encodings, both decoded here:
//!
//! * **map-tagged** (current vLLM and SGLang, msgspec `tag=True` structs): a map whose
//!   `"type"` names the class, e.g. `{"type": "BlockStored", "block_hashes": [..],
//!   "parent_block_hash": h, "token_ids": [..], "block_size": 16, "lora_id": nil,
//!   "medium": "GPU", "lora_name": nil, "group_idx": 0}`. Fields with defaults may be
//!   absent and newer optional fields (`extra_keys`, `locality`, `session_id`,
//!   `lookahead_token_ids`, ...) may appear: unknown keys are ignored.
//! * **array-tagged** (older releases, `array_like=True`): an array with the class name
//!   first, `["BlockStored", block_hashes, parent, token_ids, block_size, lora_id,
//!   medium, ...]`, `["BlockRemoved", block_hashes, medium, ...]`,
//!   `["AllBlocksCleared"]`. Only the leading positions that every release shares are
//!   read (see [`BlockStored::namespaced`] for the seventh).
//!
//! An event of a type this crate does not know is kept as [`KvEvent::Unknown`], so a
//! newer engine's additions pass without breaking the stream. A known event whose
//! fields have the wrong shape fails the whole batch ([`DecodeError`]): applying part
//! of a batch would leave the index silently wrong, while a failed batch is treated
//! like a lost one (see the subscriber).
//!
//! Block hashes are integers by default (the low 64 bits of the engine's hash; vLLM
//! sends them unsigned, SGLang as signed `i64`, both read as the same `u64`), or raw
//! bytes with vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` ([`BlockHash`]).

use rmpv::Value;

/// Why a payload could not be decoded as an event batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The payload is not msgpack (or is truncated).
    #[error("payload is not valid msgpack: {0}")]
    Msgpack(String),
    /// The payload is msgpack, but not a `[ts, events, ...]` array.
    #[error("event batch is not an array of [ts, events, ...]")]
    Batch,
    /// A known event has a field of the wrong shape.
    #[error("{event} event: field {field} is missing or malformed")]
    Field {
        /// The event's type name.
        event: &'static str,
        /// The field's name.
        field: &'static str,
    },
    /// An event is neither a map with a string `"type"` nor an array led by a string.
    #[error("event is neither a tagged map nor a tagged array")]
    Untagged,
    /// A ZMQ message without its three frames `[topic, seq, payload]`, or a `seq` that
    /// is not 8 bytes.
    #[error(
        "message has {frames} frames or a seq of {seq_len} bytes, not [topic, seq (8 bytes), payload]"
    )]
    Frames {
        /// Frames received.
        frames: usize,
        /// Length of the second frame.
        seq_len: usize,
    },
}

/// One engine block hash, as published.
///
/// Only used to apply removals: the index keys blocks by a hash of their tokens of its
/// own (see [`crate::key`]), which every proxy replica computes alike whatever the
/// engine's hash function.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BlockHash {
    /// An integer hash. vLLM's unsigned 64-bit value and SGLang's signed one read as
    /// the same `u64` (two's complement).
    Int(u64),
    /// A raw hash (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`: the 32 bytes of
    /// its SHA-256 block hash).
    Bytes(Vec<u8>),
}

impl BlockHash {
    /// The hash as one `u64`: the integer itself, or XXH3-64 of the bytes (a 64-bit
    /// digest of a cryptographic hash: collisions within one engine's cache are out of
    /// reach).
    pub fn as_u64(&self) -> u64 {
        match self {
            BlockHash::Int(v) => *v,
            BlockHash::Bytes(b) => xxhash_rust::xxh3::xxh3_64(b),
        }
    }
}

/// Blocks an engine added to its prefix cache.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// The engine's hashes of the blocks, in order.
    pub block_hashes: Vec<BlockHash>,
    /// The engine's hash of the block before the first, `None` when the first block
    /// starts the sequence.
    pub parent_block_hash: Option<BlockHash>,
    /// The tokens of all the blocks, in order (`block_hashes.len() * block_size`).
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: usize,
    /// Where the blocks are (`"GPU"`, `"CPU"`, `"CPU_PINNED"`, `"DISK"`, ...); `None`
    /// means the device.
    pub medium: Option<String>,
    /// The KV cache group (hybrid models have several; `None` or 0 is the first).
    pub group_idx: Option<u32>,
    /// Whether the blocks' engine hash covers more than their tokens, so that the same
    /// tokens under another request would not hit them: a LoRA adapter (`lora_id`,
    /// `lora_name`), a cache salt (SGLang's `cache_salt`), or, in the array encoding, a
    /// value in the seventh position (vLLM's `lora_name`, older SGLang's
    /// `cache_salt`).
    pub namespaced: bool,
    /// The index of the first block whose `extra_keys` entry is not nil (multimodal
    /// input, cache salt, LoRA): that block and the ones after it hash more than their
    /// tokens. `None` when every entry is nil or the field is absent.
    pub first_keyed_block: Option<usize>,
}

/// Blocks an engine evicted from its prefix cache.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockRemoved {
    /// The engine's hashes of the blocks.
    pub block_hashes: Vec<BlockHash>,
    /// Where they were evicted from; `None` means the device.
    pub medium: Option<String>,
    /// The KV cache group (`None` or 0 is the first).
    pub group_idx: Option<u32>,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum KvEvent {
    /// Blocks added to the prefix cache.
    BlockStored(BlockStored),
    /// Blocks evicted.
    BlockRemoved(BlockRemoved),
    /// The whole prefix cache was reset (vLLM's `reset_prefix_cache`, SGLang's
    /// `flush_cache`).
    AllBlocksCleared,
    /// An event type this crate does not know, by its tag.
    Unknown(String),
}

/// One published message's payload: the events of one engine step.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// The engine's wall-clock time of the batch, in seconds since the Unix epoch.
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<KvEvent>,
    /// The data-parallel rank that published the batch, when the engine says.
    pub dp_rank: Option<u32>,
}

/// A message's three frames, split: `[topic, seq, payload]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frames<'a> {
    /// The topic the engine publishes under (`""` by default).
    pub topic: &'a [u8],
    /// The message's sequence number.
    pub seq: u64,
    /// The msgpack batch.
    pub payload: &'a [u8],
}

/// Splits a published (or replayed) message into its frames.
///
/// # Errors
///
/// [`DecodeError::Frames`] unless there are exactly three frames and the second has 8
/// bytes.
pub fn split_frames<'a>(frames: &[&'a [u8]]) -> Result<Frames<'a>, DecodeError> {
    match frames {
        [topic, seq, payload] if seq.len() == 8 => {
            let mut be = [0u8; 8];
            be.copy_from_slice(seq);
            Ok(Frames {
                topic,
                seq: u64::from_be_bytes(be),
                payload,
            })
        }
        _ => Err(DecodeError::Frames {
            frames: frames.len(),
            seq_len: frames.get(1).map_or(0, |s| s.len()),
        }),
    }
}

/// Decodes a batch payload, in either encoding.
///
/// # Errors
///
/// A [`DecodeError`] when the payload is not msgpack, not a batch, or a known event is
/// malformed; unknown event types and unknown fields are not errors.
///
/// # Examples
///
/// ```
/// use disagg_kvevents::event::{KvEvent, decode_batch};
///
/// // [1.5, [{"type": "AllBlocksCleared"}], 0], as msgpack.
/// let payload = b"\x93\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00\x91\x81\xa4type\xb0AllBlocksCleared\x00";
/// let batch = decode_batch(payload)?;
/// assert_eq!(batch.events, vec![KvEvent::AllBlocksCleared]);
/// assert_eq!(batch.dp_rank, Some(0));
/// # Ok::<(), disagg_kvevents::event::DecodeError>(())
/// ```
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut reader = payload;
    let value =
        rmpv::decode::read_value(&mut reader).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    let Value::Array(fields) = value else {
        return Err(DecodeError::Batch);
    };
    let mut fields = fields.into_iter();
    let ts = match fields.next() {
        Some(Value::F64(f)) => f,
        Some(Value::F32(f)) => f64::from(f),
        // A timestamp sent as an integer (no engine does, but nothing forbids it).
        Some(Value::Integer(i)) => i.as_f64().unwrap_or_default(),
        _ => return Err(DecodeError::Batch),
    };
    let Some(Value::Array(raw_events)) = fields.next() else {
        return Err(DecodeError::Batch);
    };
    let dp_rank = fields
        .next()
        .and_then(|v| v.as_u64())
        .and_then(|r| u32::try_from(r).ok());
    let events = raw_events
        .into_iter()
        .map(decode_event)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(EventBatch {
        ts,
        events,
        dp_rank,
    })
}

/// The fields of one event, whichever encoding carried them.
enum Fields {
    Map(Vec<(Value, Value)>),
    /// The positional values after the tag.
    Array(Vec<Value>),
}

impl Fields {
    /// The value of a field: by name in a map, at `position` (after the tag) in an
    /// array. `None` when absent; a nil counts as absent too.
    fn get(&self, name: &str, position: Option<usize>) -> Option<&Value> {
        let v = match self {
            Fields::Map(entries) => entries
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v),
            Fields::Array(values) => position.and_then(|p| values.get(p)),
        };
        v.filter(|v| !v.is_nil())
    }
}

fn decode_event(value: Value) -> Result<KvEvent, DecodeError> {
    let (tag, fields) = match value {
        Value::Map(mut entries) => {
            let at = entries
                .iter()
                .position(|(k, v)| k.as_str() == Some("type") && v.is_str())
                .ok_or(DecodeError::Untagged)?;
            let (_, tag) = entries.swap_remove(at);
            (tag, Fields::Map(entries))
        }
        Value::Array(mut values) if values.first().is_some_and(Value::is_str) => {
            let tag = values.remove(0);
            (tag, Fields::Array(values))
        }
        _ => return Err(DecodeError::Untagged),
    };
    let tag = tag.as_str().unwrap_or_default();
    Ok(match tag {
        "BlockStored" => KvEvent::BlockStored(block_stored(&fields)?),
        "BlockRemoved" => KvEvent::BlockRemoved(block_removed(&fields)?),
        "AllBlocksCleared" => KvEvent::AllBlocksCleared,
        other => KvEvent::Unknown(other.to_owned()),
    })
}

const STORED: &str = "BlockStored";
const REMOVED: &str = "BlockRemoved";

fn block_stored(f: &Fields) -> Result<BlockStored, DecodeError> {
    let field = |field| DecodeError::Field {
        event: STORED,
        field,
    };
    let block_hashes = hashes(f.get("block_hashes", Some(0))).ok_or(field("block_hashes"))?;
    let parent_block_hash = match f.get("parent_block_hash", Some(1)) {
        None => None,
        Some(v) => Some(hash(v).ok_or(field("parent_block_hash"))?),
    };
    let token_ids = f
        .get("token_ids", Some(2))
        .and_then(Value::as_array)
        .ok_or(field("token_ids"))?
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or(field("token_ids"))?;
    let block_size = f
        .get("block_size", Some(3))
        .and_then(Value::as_u64)
        .and_then(|b| usize::try_from(b).ok())
        .filter(|&b| b > 0)
        .ok_or(field("block_size"))?;
    let medium = f
        .get("medium", Some(5))
        .and_then(Value::as_str)
        .map(str::to_owned);
    // Position 4 is `lora_id` in every release; position 6 is vLLM's `lora_name` and
    // older SGLang's `cache_salt`: either namespaces the hash.
    let namespaced = f.get("lora_id", Some(4)).is_some()
        || f.get("lora_name", Some(6)).is_some()
        || f.get("cache_salt", None).is_some();
    let first_keyed_block = f
        .get("extra_keys", None)
        .and_then(Value::as_array)
        .and_then(|keys| keys.iter().position(|k| !k.is_nil()));
    let group_idx = f
        .get("group_idx", None)
        .and_then(Value::as_u64)
        .and_then(|g| u32::try_from(g).ok());
    Ok(BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
        medium,
        group_idx,
        namespaced,
        first_keyed_block,
    })
}

fn block_removed(f: &Fields) -> Result<BlockRemoved, DecodeError> {
    let block_hashes = hashes(f.get("block_hashes", Some(0))).ok_or(DecodeError::Field {
        event: REMOVED,
        field: "block_hashes",
    })?;
    let medium = f
        .get("medium", Some(1))
        .and_then(Value::as_str)
        .map(str::to_owned);
    let group_idx = f
        .get("group_idx", None)
        .and_then(Value::as_u64)
        .and_then(|g| u32::try_from(g).ok());
    Ok(BlockRemoved {
        block_hashes,
        medium,
        group_idx,
    })
}

fn hashes(v: Option<&Value>) -> Option<Vec<BlockHash>> {
    v?.as_array()?.iter().map(hash).collect()
}

fn hash(v: &Value) -> Option<BlockHash> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            // A negative i64 (SGLang) is the same 64 bits read unsigned.
            .or_else(|| i.as_i64().map(|s| s as u64))
            .map(BlockHash::Int),
        Value::Binary(b) => Some(BlockHash::Bytes(b.clone())),
        _ => None,
    }
}

/// `v` as msgpack, for the crate's unit tests.
#[cfg(test)]
pub(crate) fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_need_three_and_an_eight_byte_seq() {
        let seq = 7u64.to_be_bytes();
        let f = split_frames(&[b"t", &seq, b"p"]).unwrap();
        assert_eq!((f.topic, f.seq, f.payload), (&b"t"[..], 7, &b"p"[..]));
        assert!(matches!(
            split_frames(&[b"t", b"1234", b"p"]),
            Err(DecodeError::Frames {
                frames: 3,
                seq_len: 4
            })
        ));
        assert!(split_frames(&[b"t", &seq]).is_err());
    }

    #[test]
    fn malformed_known_event_fails_the_batch() {
        let bad = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![Value::Map(vec![
                ("type".into(), "BlockStored".into()),
                ("block_hashes".into(), Value::Array(vec![1.into()])),
                ("token_ids".into(), Value::Array(vec![(-1).into()])),
                ("block_size".into(), 16.into()),
            ])]),
        ]);
        assert_eq!(
            decode_batch(&encode(&bad)),
            Err(DecodeError::Field {
                event: "BlockStored",
                field: "token_ids"
            })
        );
        assert!(matches!(
            decode_batch(&[0x93, 0xcb, 0x3f]),
            Err(DecodeError::Msgpack(_))
        ));
        assert_eq!(
            decode_batch(&encode(&Value::from(3))),
            Err(DecodeError::Batch)
        );
        let untagged = Value::Array(vec![Value::F64(1.0), Value::Array(vec![Value::from(5)])]);
        assert_eq!(decode_batch(&encode(&untagged)), Err(DecodeError::Untagged));
    }
}
