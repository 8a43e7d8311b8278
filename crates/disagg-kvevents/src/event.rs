//! The engines' KV-cache events on the wire, decoded.
//!
//! vLLM (`vllm/distributed/kv_events.py`, 0.33) and SGLang
//! (`python/sglang/srt/disaggregation/kv_events.py`, 0.5.23) publish the same format
//! over a ZMQ `PUB` socket: each message is three frames, `[topic, seq, payload]`,
//! where `seq` is a big-endian `u64` that grows by one per message and `payload` is
//! msgpack of an array-like batch, `[ts, events, data_parallel_rank]` (trailing fields
//! left at their default may be omitted; SGLang calls the third `attn_dp_rank`). A batch
//! encoded as a map (`{"ts": .., "events": [..], "data_parallel_rank": ..}`, a struct
//! without `array_like`) is read too, by its keys; its other keys are skipped.
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

use crate::msgpack::{Int, Reader};

/// Why a payload could not be decoded as an event batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The payload is not msgpack (or is truncated).
    #[error("payload is not valid msgpack: {0}")]
    Msgpack(String),
    /// The payload is msgpack, but neither a `[ts, events, ...]` array nor a map with
    /// a numeric `"ts"` and an `"events"` array.
    #[error("event batch is neither an array of [ts, events, ...] nor a map of ts and events")]
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
    /// A count or the decoded size over [`DecodeLimits`] (`what`: `events`, `items`,
    /// `decoded bytes`), or an event's or a batch's map of more than
    /// [`MAX_EVENT_FIELDS`] entries (`fields`).
    #[error("event batch over the decoding limit on {what}")]
    Limit {
        /// Which limit.
        what: &'static str,
    },
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

/// The largest block size accepted from an engine: 1,048,576 tokens. Engines use 1 to
/// a few thousand (vLLM's hybrid models align attention blocks to their Mamba state,
/// up to a few thousand tokens); a larger one is a broken or hostile publisher, and
/// its products with block counts must not overflow.
pub const MAX_BLOCK_SIZE: usize = 1 << 20;

/// The most entries an event's map (or a batch's, in the map encoding) may have: 256.
/// An event class has about a dozen fields (this crate reads ten of `BlockStored`'s,
/// newer optional ones included), a batch three; a map of thousands is a broken or
/// hostile publisher, refused before its entries are walked.
pub const MAX_EVENT_FIELDS: usize = 256;

/// The default ceiling on one message's bytes that [`DecodeLimits::default`] is
/// derived from: 8 MiB (see [`crate::subscriber::DEFAULT_MAX_MESSAGE`]).
const DEFAULT_MESSAGE: usize = 8 << 20;

/// Ceilings on what decoding one payload may produce, checked before each allocation.
///
/// Every item of a payload takes at least one byte, so its counts are bounded by its
/// size already; these bound the decoded memory, which for some shapes is many times
/// the wire size (a one-byte integer hash decodes into a 32-byte [`BlockHash`]).
///
/// # Examples
///
/// ```
/// use disagg_kvevents::event::DecodeLimits;
///
/// let limits = DecodeLimits::for_message(8 << 20);
/// assert_eq!(limits, DecodeLimits::default());
/// assert_eq!(limits.max_decoded_bytes, 32 << 20);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Events in one batch.
    pub max_events: usize,
    /// Block hashes, or token ids, in one event.
    pub max_items: usize,
    /// The decoded batch's memory, in bytes (its vectors and strings).
    pub max_decoded_bytes: usize,
}

impl DecodeLimits {
    /// The limits for messages of at most `max_message` bytes: 65,536 events, as many
    /// items per event as the message has bytes, four times its bytes decoded (an
    /// engine's real batches decode into one to three times their size: token ids of
    /// 3 to 5 bytes into 4, 9-byte hashes into 32, plus the events themselves).
    pub const fn for_message(max_message: usize) -> DecodeLimits {
        DecodeLimits {
            max_events: 1 << 16,
            max_items: max_message,
            max_decoded_bytes: max_message.saturating_mul(4),
        }
    }
}

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits::for_message(DEFAULT_MESSAGE)
    }
}

/// What is left of [`DecodeLimits::max_decoded_bytes`].
struct Budget(usize);

/// The heap memory one allocation of `bytes` takes: glibc's `malloc` (the proxy's
/// allocator) adds an 8-byte header, rounds up to 16 bytes and hands out no chunk under
/// 32. A one-byte hash copied into its own `Vec` holds 32 bytes, not 1; an empty one
/// allocates nothing. Up to 128 bytes (more than any hash an engine sends) this is
/// also at least what allocators of size classes (jemalloc, mimalloc) hand out.
const fn heap_bytes(bytes: usize) -> usize {
    if bytes == 0 {
        return 0;
    }
    let chunk = bytes.saturating_add(8 + 15) & !15;
    if chunk < 32 { 32 } else { chunk }
}

impl Budget {
    /// Takes `count` values of `size` bytes held inline (in a vector already charged,
    /// or the event itself).
    fn take(&mut self, count: usize, size: usize) -> Result<(), DecodeError> {
        self.take_bytes(count.saturating_mul(size))
    }

    /// Takes one heap allocation of `count` values of `size` bytes (a vector's buffer,
    /// a string's, a byte hash's): what the allocator holds for it, never less.
    fn take_heap(&mut self, count: usize, size: usize) -> Result<(), DecodeError> {
        self.take_bytes(heap_bytes(count.saturating_mul(size)))
    }

    fn take_bytes(&mut self, bytes: usize) -> Result<(), DecodeError> {
        match self.0.checked_sub(bytes) {
            Some(left) => {
                self.0 = left;
                Ok(())
            }
            None => Err(DecodeError::Limit {
                what: "decoded bytes",
            }),
        }
    }
}

/// Decodes a batch payload (an array, or a map), its events in either encoding, within
/// [`DecodeLimits::default`].
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
    decode_batch_with(payload, &DecodeLimits::default())
}

/// [`decode_batch`] within `limits`: the payload is read once, straight into the typed
/// events, every count checked before its allocation.
///
/// # Errors
///
/// As [`decode_batch`], and [`DecodeError::Limit`] beyond `limits`.
pub fn decode_batch_with(payload: &[u8], limits: &DecodeLimits) -> Result<EventBatch, DecodeError> {
    let mut r = Reader::new(payload);
    let mut budget = Budget(limits.max_decoded_bytes);
    if let Some(entries) = r.map()? {
        return batch_map(&mut r, entries, limits, &mut budget);
    }
    let fields = r.array()?.ok_or(DecodeError::Batch)?;
    if fields < 2 {
        return Err(DecodeError::Batch);
    }
    let ts = batch_ts(&mut r)?;
    let events = batch_events(&mut r, limits, &mut budget)?;
    let dp_rank = if fields > 2 {
        r.int()?
            .and_then(Int::as_u64)
            .and_then(|rank| u32::try_from(rank).ok())
    } else {
        None
    };
    Ok(EventBatch {
        ts,
        events,
        dp_rank,
    })
}

/// A batch encoded as a map of `entries`: `"ts"` and `"events"` required, the rank
/// under vLLM's or SGLang's name, other keys skipped; the first of duplicate keys
/// counts.
fn batch_map(
    r: &mut Reader<'_>,
    entries: usize,
    limits: &DecodeLimits,
    budget: &mut Budget,
) -> Result<EventBatch, DecodeError> {
    if entries > MAX_EVENT_FIELDS {
        return Err(DecodeError::Limit { what: "fields" });
    }
    let (mut ts, mut events, mut dp_rank) = (None, None, None);
    for _ in 0..entries {
        match r.str()? {
            Some(b"ts") if ts.is_none() => ts = Some(batch_ts(r)?),
            Some(b"events") if events.is_none() => events = Some(batch_events(r, limits, budget)?),
            Some(b"data_parallel_rank" | b"attn_dp_rank") if dp_rank.is_none() => {
                dp_rank = Some(small_u32(r)?);
            }
            Some(_) => r.skip()?,
            None => {
                r.skip()?;
                r.skip()?;
            }
        }
    }
    Ok(EventBatch {
        ts: ts.ok_or(DecodeError::Batch)?,
        events: events.ok_or(DecodeError::Batch)?,
        dp_rank: dp_rank.flatten(),
    })
}

/// A batch's timestamp: a float, or an integer (no engine sends one, but nothing
/// forbids it).
fn batch_ts(r: &mut Reader<'_>) -> Result<f64, DecodeError> {
    if let Some(f) = r.float()? {
        Ok(f)
    } else if let Some(i) = r.int()? {
        Ok(i.as_f64())
    } else {
        Err(DecodeError::Batch)
    }
}

/// A batch's events, within the limits.
fn batch_events(
    r: &mut Reader<'_>,
    limits: &DecodeLimits,
    budget: &mut Budget,
) -> Result<Vec<KvEvent>, DecodeError> {
    let count = r.array()?.ok_or(DecodeError::Batch)?;
    if count > limits.max_events {
        return Err(DecodeError::Limit { what: "events" });
    }
    let mut events = Vec::new();
    for _ in 0..count {
        budget.take(1, std::mem::size_of::<KvEvent>())?;
        events.push(decode_event(r, limits, budget)?);
    }
    Ok(events)
}

/// Where an event's fields are: a map's entries or an array's positions after the tag.
#[derive(Clone, Copy)]
enum Shape {
    /// `entries` key-value pairs from `start`.
    Map { start: usize, entries: usize },
    /// `values` positional values (after the tag) from `start`.
    Array { start: usize, values: usize },
}

fn decode_event(
    r: &mut Reader<'_>,
    limits: &DecodeLimits,
    budget: &mut Budget,
) -> Result<KvEvent, DecodeError> {
    let (tag, shape) = if let Some(entries) = r.map()? {
        if entries > MAX_EVENT_FIELDS {
            return Err(DecodeError::Limit { what: "fields" });
        }
        let start = r.pos();
        // The first "type" key with a string value names the class (msgspec writes it
        // first, but a map has no order).
        let mut tag = None;
        for _ in 0..entries {
            let key = r.str()?;
            if key.is_none() {
                r.skip()?;
            }
            let is_type = key == Some(b"type");
            match r.str()? {
                Some(value) if is_type && tag.is_none() => tag = Some(value),
                Some(_) => {}
                None => r.skip()?,
            }
        }
        (
            tag.ok_or(DecodeError::Untagged)?,
            Shape::Map { start, entries },
        )
    } else if let Some(len) = r.array()? {
        let tag = match len {
            0 => None,
            _ => r.str()?,
        };
        let tag = tag.ok_or(DecodeError::Untagged)?;
        (
            tag,
            Shape::Array {
                start: r.pos(),
                values: len - 1,
            },
        )
    } else {
        return Err(DecodeError::Untagged);
    };
    let event = match tag {
        b"BlockStored" => KvEvent::BlockStored(block_stored(r, shape, limits, budget)?),
        b"BlockRemoved" => KvEvent::BlockRemoved(block_removed(r, shape, limits, budget)?),
        b"AllBlocksCleared" => {
            skip_fields(r, shape)?;
            KvEvent::AllBlocksCleared
        }
        other => {
            skip_fields(r, shape)?;
            budget.take_heap(other.len(), 1)?;
            KvEvent::Unknown(std::str::from_utf8(other).unwrap_or_default().to_owned())
        }
    };
    Ok(event)
}

/// Moves past an event's fields.
fn skip_fields(r: &mut Reader<'_>, shape: Shape) -> Result<(), DecodeError> {
    match shape {
        // The map was walked whole to find its tag.
        Shape::Map { .. } => Ok(()),
        Shape::Array { values, .. } => (0..values).try_for_each(|_| r.skip()),
    }
}

/// Calls `field(name, position, reader)` for each non-nil field of the event (map:
/// its name, one of `known`, and `None`, the first of duplicate names only; array:
/// `""` and its position), which reads or skips its value; leaves the reader after the
/// event. A map's other names are skipped unread.
fn walk_fields<'a>(
    r: &mut Reader<'a>,
    shape: Shape,
    known: &[&str],
    mut field: impl FnMut(&[u8], Option<usize>, &mut Reader<'a>) -> Result<(), DecodeError>,
) -> Result<(), DecodeError> {
    match shape {
        Shape::Map { start, entries } => {
            r.seek(start);
            // The known names already read, one bit each (a map may repeat a key: the
            // first one counts). Only known names are remembered: the work per entry
            // is a look-up in `known`, not in every name before it (quadratic in a
            // peer's map of distinct unknown keys).
            let mut seen = 0u32;
            for _ in 0..entries {
                let Some(name) = r.str()? else {
                    r.skip()?;
                    r.skip()?;
                    continue;
                };
                let Some(k) = known.iter().position(|n| n.as_bytes() == name) else {
                    r.skip()?;
                    continue;
                };
                if seen & (1 << k) != 0 {
                    r.skip()?;
                    continue;
                }
                seen |= 1 << k;
                // A nil counts as absent (and so does any later value of the name).
                if r.nil()? {
                    continue;
                }
                field(name, None, r)?;
            }
            Ok(())
        }
        Shape::Array { start, values } => {
            r.seek(start);
            for position in 0..values {
                if !r.nil()? {
                    field(b"", Some(position), r)?;
                }
            }
            Ok(())
        }
    }
}

/// Which field `name`/`position` is: the map name, else the array position.
fn is(name: &[u8], position: Option<usize>, wanted: &str, at: Option<usize>) -> bool {
    match position {
        Some(p) => at == Some(p),
        None => name == wanted.as_bytes(),
    }
}

const STORED: &str = "BlockStored";
const REMOVED: &str = "BlockRemoved";

/// The map fields [`block_stored`] reads: every name it tests.
const STORED_FIELDS: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "medium",
    "lora_id",
    "lora_name",
    "cache_salt",
    "extra_keys",
    "group_idx",
];

/// The map fields [`block_removed`] reads: every name it tests.
const REMOVED_FIELDS: &[&str] = &["block_hashes", "medium", "group_idx"];

// `walk_fields` keeps one bit per known name in a `u32`.
const _: () = assert!(STORED_FIELDS.len() <= 32 && REMOVED_FIELDS.len() <= 32);

fn block_stored(
    r: &mut Reader<'_>,
    shape: Shape,
    limits: &DecodeLimits,
    budget: &mut Budget,
) -> Result<BlockStored, DecodeError> {
    let field = |field| DecodeError::Field {
        event: STORED,
        field,
    };
    let mut block_hashes = None;
    let mut parent_block_hash = None;
    let mut token_ids = None;
    let mut block_size = None;
    let mut out = BlockStored::default();
    walk_fields(r, shape, STORED_FIELDS, |name, position, r| {
        if is(name, position, "block_hashes", Some(0)) {
            block_hashes =
                Some(hashes(r, limits, budget).map_err(|e| e.or(field("block_hashes")))?);
        } else if is(name, position, "parent_block_hash", Some(1)) {
            parent_block_hash = Some(hash(r, budget)?.ok_or(field("parent_block_hash"))?);
        } else if is(name, position, "token_ids", Some(2)) {
            token_ids = Some(tokens(r, limits, budget).map_err(|e| e.or(field("token_ids")))?);
        } else if is(name, position, "block_size", Some(3)) {
            block_size = Some(
                r.int()?
                    .and_then(Int::as_u64)
                    .and_then(|b| usize::try_from(b).ok())
                    .filter(|b| (1..=MAX_BLOCK_SIZE).contains(b))
                    .ok_or(field("block_size"))?,
            );
        } else if is(name, position, "medium", Some(5)) {
            out.medium = optional_string(r, budget)?;
        } else if is(name, position, "lora_id", Some(4))
            || is(name, position, "lora_name", Some(6))
            || (position.is_none() && name == b"cache_salt")
        {
            // Present and not nil: the blocks' hash covers more than their tokens.
            out.namespaced = true;
            r.skip()?;
        } else if position.is_none() && name == b"extra_keys" {
            out.first_keyed_block = first_non_nil(r)?;
        } else if position.is_none() && name == b"group_idx" {
            out.group_idx = small_u32(r)?;
        } else {
            r.skip()?;
        }
        Ok(())
    })?;
    out.block_hashes = block_hashes.ok_or(field("block_hashes"))?;
    out.parent_block_hash = parent_block_hash;
    out.token_ids = token_ids.ok_or(field("token_ids"))?;
    out.block_size = block_size.ok_or(field("block_size"))?;
    Ok(out)
}

fn block_removed(
    r: &mut Reader<'_>,
    shape: Shape,
    limits: &DecodeLimits,
    budget: &mut Budget,
) -> Result<BlockRemoved, DecodeError> {
    let missing = DecodeError::Field {
        event: REMOVED,
        field: "block_hashes",
    };
    let mut block_hashes = None;
    let mut out = BlockRemoved::default();
    walk_fields(r, shape, REMOVED_FIELDS, |name, position, r| {
        if is(name, position, "block_hashes", Some(0)) {
            block_hashes = Some(hashes(r, limits, budget).map_err(|e| e.or(missing.clone()))?);
        } else if is(name, position, "medium", Some(1)) {
            out.medium = optional_string(r, budget)?;
        } else if position.is_none() && name == b"group_idx" {
            out.group_idx = small_u32(r)?;
        } else {
            r.skip()?;
        }
        Ok(())
    })?;
    out.block_hashes = block_hashes.ok_or(missing)?;
    Ok(out)
}

/// Why a list field could not be read: the payload itself is broken, a limit was
/// passed, or the field has the wrong shape (then the caller names the field).
enum ListError {
    Decode(DecodeError),
    Shape,
}

impl From<DecodeError> for ListError {
    fn from(e: DecodeError) -> Self {
        ListError::Decode(e)
    }
}

impl ListError {
    fn or(self, field: DecodeError) -> DecodeError {
        match self {
            ListError::Decode(e) => e,
            ListError::Shape => field,
        }
    }
}

/// The length of a list field, within the limits, its elements' memory taken.
fn list_len(
    r: &mut Reader<'_>,
    limits: &DecodeLimits,
    budget: &mut Budget,
    size: usize,
) -> Result<usize, ListError> {
    let Some(n) = r.array()? else {
        return Err(ListError::Shape);
    };
    if n > limits.max_items {
        return Err(DecodeError::Limit { what: "items" }.into());
    }
    budget.take_heap(n, size)?;
    Ok(n)
}

fn hashes(
    r: &mut Reader<'_>,
    limits: &DecodeLimits,
    budget: &mut Budget,
) -> Result<Vec<BlockHash>, ListError> {
    let n = list_len(r, limits, budget, std::mem::size_of::<BlockHash>())?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(hash(r, budget)?.ok_or(ListError::Shape)?);
    }
    Ok(out)
}

fn tokens(
    r: &mut Reader<'_>,
    limits: &DecodeLimits,
    budget: &mut Budget,
) -> Result<Vec<u32>, ListError> {
    let n = list_len(r, limits, budget, std::mem::size_of::<u32>())?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let token = r
            .int()?
            .and_then(Int::as_u64)
            .and_then(|t| u32::try_from(t).ok())
            .ok_or(ListError::Shape)?;
        out.push(token);
    }
    Ok(out)
}

/// An integer or binary hash; `None` (the value left unread) for anything else.
fn hash(r: &mut Reader<'_>, budget: &mut Budget) -> Result<Option<BlockHash>, DecodeError> {
    if let Some(i) = r.int()? {
        // A negative i64 (SGLang) is the same 64 bits read unsigned.
        return Ok(Some(BlockHash::Int(i.bits())));
    }
    match r.bin()? {
        Some(b) => {
            // Its own allocation: a one-byte hash holds an allocator chunk (32 bytes),
            // besides the `BlockHash` its list already took.
            budget.take_heap(b.len(), 1)?;
            Ok(Some(BlockHash::Bytes(b.to_vec())))
        }
        None => Ok(None),
    }
}

/// A string field: its value if it is a UTF-8 string, else `None` (skipped).
fn optional_string(r: &mut Reader<'_>, budget: &mut Budget) -> Result<Option<String>, DecodeError> {
    match r.str()? {
        Some(s) => {
            budget.take_heap(s.len(), 1)?;
            Ok(std::str::from_utf8(s).ok().map(str::to_owned))
        }
        None => {
            r.skip()?;
            Ok(None)
        }
    }
}

/// A non-negative integer that fits a `u32`, else `None` (skipped).
fn small_u32(r: &mut Reader<'_>) -> Result<Option<u32>, DecodeError> {
    match r.int()? {
        Some(i) => Ok(i.as_u64().and_then(|v| u32::try_from(v).ok())),
        None => {
            r.skip()?;
            Ok(None)
        }
    }
}

/// The position of the first non-nil item of an array, else `None` (skipped).
fn first_non_nil(r: &mut Reader<'_>) -> Result<Option<usize>, DecodeError> {
    let Some(n) = r.array()? else {
        r.skip()?;
        return Ok(None);
    };
    let mut first = None;
    for i in 0..n {
        if !r.nil()? {
            first.get_or_insert(i);
            r.skip()?;
        }
    }
    Ok(first)
}

/// `v` as msgpack, for the crate's unit tests.
#[cfg(test)]
pub(crate) fn encode(v: &rmpv::Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

/// The decoder this crate had before [`decode_batch_with`]: rmpv values first, then
/// the typed events. Kept for the tests, which check that both read every payload
/// alike.
#[cfg(test)]
pub(crate) mod reference {
    use rmpv::Value;

    use super::{BlockHash, BlockRemoved, BlockStored, DecodeError, EventBatch, KvEvent};

    pub(crate) fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
        let mut reader = payload;
        let value = rmpv::decode::read_value(&mut reader)
            .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
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
                // `remove`, not `swap_remove`: a map that repeats a key counts its
                // first value (as `walk_fields` does), which moving the last entry
                // into the tag's place would change (a proptest found it).
                let (_, tag) = entries.remove(at);
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
}

#[cfg(test)]
mod tests;
