//! Prefix hashing: a request's prompt as a chain of fixed-size block hashes.
//!
//! Engines keep the KV cache of recent prompts and reuse it for any later prompt that
//! starts the same way (vLLM's automatic prefix caching in blocks of 16 tokens, SGLang's
//! radix tree per token). A router that knows which engine saw which prefix can send a
//! request where most of its prompt is already computed. [`PrefixHasher`] turns a
//! request's prompt into the data such a router needs: a list of block hashes where hash
//! `i` covers blocks `0..=i`, so two requests share their first `k` hashes exactly when
//! their first `k` blocks are equal (up to 64-bit collisions).
//!
//! # The canonical byte stream
//!
//! The prompt is read only when a policy asks for it, and only the one body field that
//! holds it: `messages` for chat, `prompt` for completions. It becomes a byte stream in
//! which marker bytes that never occur in UTF-8 (`0xFA`–`0xFF`) separate the parts, so
//! the structure cannot be faked by text:
//!
//! | request | stream |
//! |---|---|
//! | chat message | `0xFF`, the role, then each content part |
//! | text content (a string, a part `{"type":"text","text":…}`, or a string in a content list) | `0xFC`, the text |
//! | any other content part (image, audio, file) | `0xFD`, 16 hex digits of a stable hash of the part's raw JSON |
//! | completions `prompt` string | `0xFB`, the text |
//! | completions `prompt` of token ids | `0xFA`, each id as 4 little-endian bytes |
//!
//! Strings are unescaped (`"\u00e9"` and `"é"` are the same text), and so are the keys
//! and the part's `type` (`"\u0074ext"` is `"text"`); a key repeated in a message or a
//! part counts by its last value, as Python's `json` (and so the engine) reads it. A
//! string content and a single text part are the same stream, as chat templates render
//! them alike. Other
//! message fields (`name`, `tool_calls`, ...) are not part of the stream: a false match
//! costs only a cache miss, and routing must stay cheap.
//!
//! A completions batch (`prompt` as a list of strings or of token lists) is hashed by its
//! **first element**: the whole batch goes to one engine, and batches are mostly one
//! template with different fills, so the first prompt speaks for the rest. Text and
//! token-id prompts never match each other: the router has no tokenizer.
//!
//! Parts other than text are hashed whole up to 8 KiB; a larger part (an inline base64
//! image) is hashed by its length, first and last 4 KiB, so its cost stays bounded.
//!
//! # Bounded work
//!
//! The stream stops at `block_size × max_blocks` bytes: text past it is neither copied
//! nor hashed, and no later message is read. (The message that fills the budget is still
//! scanned to its end by the JSON reader, at memory speed.) Only whole blocks are hashed:
//! a prompt shorter than one block gives no block, like an engine that caches only full
//! blocks.
//!
//! # Malformed input
//!
//! A missing field, a value of the wrong shape or a bad escape gives **no blocks**, and
//! the policy falls back; nothing here panics on any input.
//!
//! # Stability
//!
//! The block hash is fixed here (64-bit words, multiply-rotate, then the splitmix64
//! finalizer per block), little-endian on every platform, and seeded by the model name,
//! so the same prompt to another model never matches. Golden values in the tests pin it.
//! It is not a cryptographic hash: a collision makes the router prefer an engine that
//! does not have the prefix, nothing worse.

use std::fmt;
use std::marker::PhantomData;
use std::ops::ControlFlow;

use disagg_core::request::Api;
use disagg_core::router::RequestView;
use serde::Deserialize;
use serde::de::{self, Deserializer as _, SeqAccess, Visitor};
use serde_json::value::RawValue;

use crate::hrw::finalize;

/// The default block size in bytes of the canonical stream: 64.
///
/// English text runs about 4 bytes per token in the BPE vocabularies LLMs use, so 64
/// bytes is about 16 tokens, vLLM's default KV block size: a finer grain would claim
/// matches the engine cannot reuse, a coarser one would miss the end of shared prefixes.
/// Token-id prompts take 4 bytes per id, so a block is exactly 16 ids.
pub const DEFAULT_BLOCK_SIZE: usize = 64;

/// The default number of blocks hashed per request: 256, the first 16 KiB of the
/// stream (about 4,000 tokens).
///
/// That bounds the work per request (16 KiB hashed, at most 256 table lookups and
/// inserts) and the table space one request can take, while covering the system prompts
/// and few-shot preambles that prefix caching pays off on. Prompts that agree on their
/// first 16 KiB count as fully matching.
pub const DEFAULT_MAX_BLOCKS: usize = 256;

/// Why a prefix-hashing setting was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PrefixError {
    /// A block must hold at least one byte.
    #[error("block size must be at least 1 byte")]
    ZeroBlockSize,
    /// At least one block must be hashed, or nothing could ever match.
    #[error("the number of blocks per request must be at least 1")]
    ZeroMaxBlocks,
}

/// Hashes a request's prompt into chained block hashes.
///
/// # Examples
///
/// ```
/// use disagg_affinity::PrefixHasher;
/// use disagg_core::router::RequestView;
/// use disagg_core::{request::Api, json::JsonBody};
/// use http::HeaderMap;
///
/// let hasher = PrefixHasher::new().with_block_size(16)?;
/// let system = "You are a careful assistant who answers in French.";
/// let blocks = |user: &str| {
///     let body = serde_json::json!({"messages": [
///         {"role": "system", "content": system},
///         {"role": "user", "content": user},
///     ]});
///     let body = JsonBody::parse(body.to_string().as_bytes()).expect("an object");
///     let headers = HeaderMap::new();
///     let view = RequestView::new(Api::Chat, None, &headers, &body);
///     hasher.block_hashes(&view)
/// };
/// let (a, b) = (blocks("Bonjour ?"), blocks("What is the capital of Peru?"));
/// // The system prompt fills three whole 16-byte blocks: those hashes are shared.
/// assert_eq!(a[..3], b[..3]);
/// assert_ne!(a.last(), b.last());
/// # Ok::<(), disagg_affinity::PrefixError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixHasher {
    block_size: usize,
    max_blocks: usize,
}

impl Default for PrefixHasher {
    fn default() -> Self {
        PrefixHasher {
            block_size: DEFAULT_BLOCK_SIZE,
            max_blocks: DEFAULT_MAX_BLOCKS,
        }
    }
}

// === impl PrefixHasher ===

impl PrefixHasher {
    /// Blocks of [`DEFAULT_BLOCK_SIZE`] bytes, at most [`DEFAULT_MAX_BLOCKS`] per request.
    pub fn new() -> Self {
        Self::default()
    }

    /// The block size in bytes of the canonical stream.
    ///
    /// # Errors
    ///
    /// [`PrefixError::ZeroBlockSize`] for 0.
    pub fn with_block_size(mut self, bytes: usize) -> Result<Self, PrefixError> {
        if bytes == 0 {
            return Err(PrefixError::ZeroBlockSize);
        }
        self.block_size = bytes;
        Ok(self)
    }

    /// The most blocks hashed per request; the rest of a longer prompt is not read.
    ///
    /// # Errors
    ///
    /// [`PrefixError::ZeroMaxBlocks`] for 0.
    pub fn with_max_blocks(mut self, blocks: usize) -> Result<Self, PrefixError> {
        if blocks == 0 {
            return Err(PrefixError::ZeroMaxBlocks);
        }
        self.max_blocks = blocks;
        Ok(self)
    }

    /// The block size in bytes.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The most blocks hashed per request.
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    /// The most bytes of canonical stream read per request.
    fn budget(&self) -> usize {
        self.block_size.saturating_mul(self.max_blocks)
    }

    /// The chained block hashes of `req`'s prompt, at most [`max_blocks`](Self::max_blocks)
    /// of them; empty when the request has no usable prompt or it is shorter than one
    /// block.
    ///
    /// Reads only `messages` (chat), `prompt` (completions) or `text` / `input_ids`
    /// (SGLang's `/generate`) of the body.
    pub fn block_hashes(&self, req: &RequestView<'_>) -> Vec<u64> {
        self.hash_stream(req.model, &self.canonical(req))
    }

    /// The canonical byte stream of `req`'s prompt (see the [module docs](self)), cut at
    /// `block_size × max_blocks` bytes; empty when the request has no usable prompt.
    pub fn canonical(&self, req: &RequestView<'_>) -> Vec<u8> {
        let (field, write): (_, fn(&[u8], &mut Stream) -> Flow) = match req.api {
            Api::Chat => ("messages", write_messages),
            // SGLang's `/generate`: the prompt is `text` (a string or a list of them), or
            // `input_ids` (token ids or lists of them), read as completions' `prompt`.
            Api::Generate if req.body.get("text").is_some() => ("text", write_prompt),
            Api::Generate => ("input_ids", write_prompt),
            _ => ("prompt", write_prompt),
        };
        let Some(raw) = req.body.get(field) else {
            return Vec::new();
        };
        let mut stream = Stream::new(self.budget(), raw.len());
        match write(raw, &mut stream) {
            ControlFlow::Continue(()) | ControlFlow::Break(End::Full) => stream.buf,
            ControlFlow::Break(End::Bad) => Vec::new(),
        }
    }

    /// The chained hashes of the whole blocks of `stream`, seeded by `model`: hash `i`
    /// covers blocks `0..=i`. At most [`max_blocks`](Self::max_blocks) hashes.
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_affinity::PrefixHasher;
    /// let h = PrefixHasher::new().with_block_size(4)?;
    /// let a = h.hash_stream(None, b"aaaabbbbcccc");
    /// let b = h.hash_stream(None, b"aaaaBBBBcccc");
    /// assert_eq!(a.len(), 3);
    /// assert_eq!(a[0], b[0]);
    /// // A change in block 1 changes hash 1 and every later one.
    /// assert!(a[1] != b[1] && a[2] != b[2]);
    /// // The trailing partial block is not hashed.
    /// assert_eq!(h.hash_stream(None, b"aaaabb").len(), 1);
    /// # Ok::<(), disagg_affinity::PrefixError>(())
    /// ```
    pub fn hash_stream(&self, model: Option<&str>, stream: &[u8]) -> Vec<u64> {
        let mut h = block_hash(MODEL_SEED, model.unwrap_or_default().as_bytes());
        stream
            .chunks_exact(self.block_size)
            .take(self.max_blocks)
            .map(|block| {
                h = block_hash(h, block);
                h
            })
            .collect()
    }
}

/// Seeds the chain with the model name (a domain separator from other uses of
/// [`block_hash`]).
const MODEL_SEED: u64 = 0x6469_7361_6767_7031; // "disaggp1"

const MESSAGE: u8 = 0xFF;
const TEXT: u8 = 0xFC;
const OTHER_PART: u8 = 0xFD;
const PROMPT_TEXT: u8 = 0xFB;
const PROMPT_TOKENS: u8 = 0xFA;

/// Parts larger than this are hashed by length, head and tail.
const PART_HASH_WHOLE: usize = 8 * 1024;
/// The head and tail hashed of a larger part.
const PART_HASH_EDGE: usize = 4 * 1024;

/// The stable 64-bit hash of `bytes`, chained from `prev`.
///
/// Eight bytes at a time (little-endian, the tail zero-padded, the length mixed in first),
/// each word folded in by xor, multiply and rotate, then the splitmix64 finalizer so
/// every input bit reaches every output bit.
pub(crate) fn block_hash(prev: u64, bytes: &[u8]) -> u64 {
    const M: u64 = 0x9e37_79b9_7f4a_7c15;
    // `+ 1`: keeps an empty input off the finalizer's fixed point at 0.
    let mut h = prev ^ (bytes.len() as u64 + 1).wrapping_mul(M);
    let mut words = bytes.chunks_exact(8);
    let mut fold = |word: [u8; 8]| {
        h = (h ^ u64::from_le_bytes(word))
            .wrapping_mul(M)
            .rotate_left(29);
    };
    for w in &mut words {
        let mut word = [0u8; 8];
        word.copy_from_slice(w);
        fold(word);
    }
    let tail = words.remainder();
    if !tail.is_empty() {
        let mut word = [0u8; 8];
        word[..tail.len()].copy_from_slice(tail);
        fold(word);
    }
    finalize(h)
}

/// Why writing the stream stopped early.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// The budget is used up: the stream so far is the answer.
    Full,
    /// The prompt is malformed: no blocks.
    Bad,
}

type Flow = ControlFlow<End>;

/// The canonical stream under construction, never longer than `limit`.
struct Stream {
    buf: Vec<u8>,
    limit: usize,
}

impl Stream {
    fn new(limit: usize, hint: usize) -> Self {
        Stream {
            buf: Vec::with_capacity(limit.min(hint)),
            limit,
        }
    }

    /// Append what fits of `bytes`; `Break(Full)` once the stream is full.
    fn push(&mut self, bytes: &[u8]) -> Flow {
        let room = self.limit - self.buf.len();
        if bytes.len() >= room {
            self.buf.extend_from_slice(&bytes[..room]);
            return ControlFlow::Break(End::Full);
        }
        self.buf.extend_from_slice(bytes);
        ControlFlow::Continue(())
    }
}

/// Calls `f` on each element of the JSON array `raw`, reading no further than the
/// element where `f` breaks. Not an array, or a malformed element: `Break(Bad)`.
fn for_each<'de, T, F>(raw: &'de [u8], mut f: F) -> Flow
where
    T: Deserialize<'de>,
    F: FnMut(T) -> Flow,
{
    struct Each<'a, T, F> {
        f: &'a mut F,
        end: &'a mut Option<End>,
        item: PhantomData<fn() -> T>,
    }

    impl<'de, T: Deserialize<'de>, F: FnMut(T) -> Flow> Visitor<'de> for Each<'_, T, F> {
        type Value = ();

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("an array")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            while let Some(item) = seq.next_element::<T>()? {
                if let ControlFlow::Break(end) = (self.f)(item) {
                    *self.end = Some(end);
                    // An error is the one way to stop the reader early.
                    return Err(de::Error::custom("stopped early"));
                }
            }
            Ok(())
        }
    }

    let mut end = None;
    let mut de = serde_json::Deserializer::from_slice(raw);
    let read = de.deserialize_seq(Each {
        f: &mut f,
        end: &mut end,
        item: PhantomData,
    });
    match end {
        Some(end) => ControlFlow::Break(end),
        None if read.is_ok() && de.end().is_ok() => ControlFlow::Continue(()),
        None => ControlFlow::Break(End::Bad),
    }
}

/// One chat message: only the fields that make the stream.
struct Message<'a> {
    role: Option<&'a RawValue>,
    content: Option<&'a RawValue>,
}

impl<'de> Deserialize<'de> for Message<'de> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let [role, content] = d.deserialize_map(Members(&["role", "content"]))?;
        Ok(Message { role, content })
    }
}

/// One content part, read after the part's raw JSON was taken.
struct Part<'a> {
    kind: Option<&'a RawValue>,
    text: Option<&'a RawValue>,
}

impl<'de> Deserialize<'de> for Part<'de> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let [kind, text] = d.deserialize_map(Members(&["type", "text"]))?;
        Ok(Part { kind, text })
    }
}

/// The raw values of the named members of a JSON object (`None`: absent or `null`),
/// each the last of its repeats, as Python's `json` (and so the engine) keeps it; keys
/// are compared unescaped, the other members skipped unbuilt.
struct Members<const N: usize>(&'static [&'static str; N]);

impl<'de, const N: usize> Visitor<'de> for Members<N> {
    type Value = [Option<&'de RawValue>; N];

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object")
    }

    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found = [None; N];
        while let Some(key) = map.next_key_seed(KeyIn(self.0))? {
            match key {
                Some(i) => found[i] = map.next_value::<Option<&'de RawValue>>()?,
                None => {
                    map.next_value::<de::IgnoredAny>()?;
                }
            }
        }
        Ok(found)
    }
}

/// A member's key, as its index among the names (`None`: another key).
struct KeyIn(&'static [&'static str]);

impl<'de> de::DeserializeSeed<'de> for KeyIn {
    type Value = Option<usize>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Option<usize>, D::Error> {
        d.deserialize_identifier(self)
    }
}

impl Visitor<'_> for KeyIn {
    type Value = Option<usize>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a key")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<Option<usize>, E> {
        Ok(self.0.iter().position(|name| *name == key))
    }
}

/// Whether the raw JSON `raw` is the string `want`, however escaped.
fn is_json_str(raw: &str, want: &str) -> bool {
    match raw.strip_prefix('"').and_then(|r| r.strip_suffix('"')) {
        Some(inner) if !inner.contains('\\') => inner == want,
        Some(_) => serde_json::from_str::<String>(raw).is_ok_and(|s| s == want),
        None => false,
    }
}

fn write_messages(raw: &[u8], s: &mut Stream) -> Flow {
    for_each::<Message<'_>, _>(raw, |m| {
        s.push(&[MESSAGE])?;
        if let Some(role) = m.role {
            push_json_str(s, role.get().as_bytes())?;
        }
        match m.content {
            None => ControlFlow::Continue(()),
            Some(c) => match c.get().as_bytes().first() {
                Some(b'"') => {
                    s.push(&[TEXT])?;
                    push_json_str(s, c.get().as_bytes())
                }
                Some(b'[') => for_each::<&RawValue, _>(c.get().as_bytes(), |p| write_part(p, s)),
                _ => ControlFlow::Break(End::Bad),
            },
        }
    })
}

fn write_part(part: &RawValue, s: &mut Stream) -> Flow {
    // A string in a content list is text, as vLLM reads it.
    if part.get().starts_with('"') {
        s.push(&[TEXT])?;
        return push_json_str(s, part.get().as_bytes());
    }
    if let Ok(Part {
        kind: Some(kind),
        text: Some(text),
    }) = serde_json::from_str::<Part<'_>>(part.get())
        && is_json_str(kind.get(), "text")
        && text.get().starts_with('"')
    {
        s.push(&[TEXT])?;
        return push_json_str(s, text.get().as_bytes());
    }
    let raw = part.get().as_bytes();
    let h = if raw.len() <= PART_HASH_WHOLE {
        block_hash(0, raw)
    } else {
        let head = block_hash(raw.len() as u64, &raw[..PART_HASH_EDGE]);
        block_hash(head, &raw[raw.len() - PART_HASH_EDGE..])
    };
    let mut marker = [OTHER_PART; 17];
    for (i, d) in marker[1..].iter_mut().enumerate() {
        *d = b"0123456789abcdef"[((h >> (60 - 4 * i)) & 0xF) as usize];
    }
    s.push(&marker)
}

fn write_prompt(raw: &[u8], s: &mut Stream) -> Flow {
    match raw.first() {
        Some(b'"') => {
            s.push(&[PROMPT_TEXT])?;
            push_json_str(s, raw)
        }
        Some(b'[') => {
            let mut first = None;
            // Only the first element is read, whatever the batch holds after it.
            if let ControlFlow::Break(End::Bad) = for_each::<&RawValue, _>(raw, |el| {
                first = Some(el);
                ControlFlow::Break(End::Full)
            }) {
                return ControlFlow::Break(End::Bad);
            }
            let Some(first) = first else {
                return ControlFlow::Break(End::Bad);
            };
            let el = first.get().as_bytes();
            match el.first() {
                Some(b'"') => {
                    s.push(&[PROMPT_TEXT])?;
                    push_json_str(s, el)
                }
                Some(b'[') => write_tokens(el, s),
                Some(b'0'..=b'9') => write_tokens(raw, s),
                _ => ControlFlow::Break(End::Bad),
            }
        }
        _ => ControlFlow::Break(End::Bad),
    }
}

fn write_tokens(raw: &[u8], s: &mut Stream) -> Flow {
    s.push(&[PROMPT_TOKENS])?;
    for_each::<u64, _>(raw, |id| match u32::try_from(id) {
        Ok(id) => s.push(&id.to_le_bytes()),
        Err(_) => ControlFlow::Break(End::Bad),
    })
}

/// Append the text of the JSON string `raw` (quotes included), unescaped, stopping as
/// soon as the stream is full. Not a string, or a bad escape: `Break(Bad)`.
fn push_json_str(s: &mut Stream, raw: &[u8]) -> Flow {
    let [b'"', inner @ .., b'"'] = raw else {
        return ControlFlow::Break(End::Bad);
    };
    let mut rest = inner;
    while !rest.is_empty() {
        let run = find_backslash(rest).unwrap_or(rest.len());
        s.push(&rest[..run])?;
        rest = &rest[run..];
        if rest.is_empty() {
            break;
        }
        let Some((c, used)) = unescape(rest) else {
            return ControlFlow::Break(End::Bad);
        };
        s.push(c.encode_utf8(&mut [0u8; 4]).as_bytes())?;
        rest = &rest[used..];
    }
    ControlFlow::Continue(())
}

/// The index of the first backslash in `b`.
///
/// Eight bytes at a time (the zero-byte test of "Bit Twiddling Hacks" on `word ^ '\\'`):
/// prompts are long runs of plain text, and a byte loop was a third of the hashing cost.
fn find_backslash(b: &[u8]) -> Option<usize> {
    const LO: u64 = 0x0101_0101_0101_0101;
    const HI: u64 = 0x8080_8080_8080_8080;
    let pattern = LO * u64::from(b'\\');
    let mut words = b.chunks_exact(8);
    let mut at = 0;
    for w in &mut words {
        let mut word = [0u8; 8];
        word.copy_from_slice(w);
        let x = u64::from_le_bytes(word) ^ pattern;
        // The lowest flagged byte is exactly the first zero byte of `x`.
        let zero = x.wrapping_sub(LO) & !x & HI;
        if zero != 0 {
            return Some(at + (zero.trailing_zeros() / 8) as usize);
        }
        at += 8;
    }
    let tail = words.remainder();
    tail.iter().position(|&c| c == b'\\').map(|i| at + i)
}

/// The character of the escape at the start of `b` (`b[0] == b'\\'`) and its length.
/// A lone surrogate becomes U+FFFD, as lossy UTF-16 decoding does.
fn unescape(b: &[u8]) -> Option<(char, usize)> {
    let c = match *b.get(1)? {
        b'"' => '"',
        b'\\' => '\\',
        b'/' => '/',
        b'b' => '\u{8}',
        b'f' => '\u{c}',
        b'n' => '\n',
        b'r' => '\r',
        b't' => '\t',
        b'u' => {
            let hi = hex4(b.get(2..6)?)?;
            if (0xD800..0xDC00).contains(&hi)
                && b.get(6..8) == Some(b"\\u")
                && let Some(lo) = b.get(8..12).and_then(hex4)
                && (0xDC00..0xE000).contains(&lo)
            {
                let c = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
                return Some((char::from_u32(c)?, 12));
            }
            return Some((char::from_u32(hi).unwrap_or('\u{FFFD}'), 6));
        }
        _ => return None,
    };
    Some((c, 2))
}

fn hex4(b: &[u8]) -> Option<u32> {
    b.iter().try_fold(0u32, |acc, &d| {
        let v = char::from(d).to_digit(16)?;
        Some(acc << 4 | v)
    })
}

#[cfg(test)]
mod tests {
    use disagg_core::json::JsonBody;
    use http::HeaderMap;
    use proptest::prelude::*;

    use super::*;

    fn with_body<R>(api: Api, body: &[u8], f: impl FnOnce(&RequestView<'_>) -> R) -> R {
        let b = JsonBody::parse(body).expect("test body");
        let h = HeaderMap::new();
        f(&RequestView::new(api, None, &h, &b))
    }

    fn canonical(api: Api, body: &str) -> Vec<u8> {
        with_body(api, body.as_bytes(), |v| PrefixHasher::new().canonical(v))
    }

    fn chat(messages: serde_json::Value) -> Vec<u8> {
        canonical(
            Api::Chat,
            &serde_json::json!({ "messages": messages }).to_string(),
        )
    }

    /// Pinned: changing the hash or the stream re-routes every cached prefix.
    #[test]
    fn golden_hashes() {
        let h = PrefixHasher::new().with_block_size(8).expect("valid");
        let got = h.hash_stream(Some("m"), b"0123456789abcdefXYZ");
        let got2 = [block_hash(0, b""), block_hash(0, b"a"), block_hash(1, b"a")];
        assert_eq!(got, GOLDEN_CHAIN, "{got:#x?}");
        assert_eq!(got2, GOLDEN_BLOCK, "{got2:#x?}");
    }

    // Cross-checked against an independent Python implementation of the same spec
    // (the length + 1 times the golden-ratio constant xored into the seed; per 8-byte
    // little-endian word, zero-padded: xor, multiply, rotate left 29; splitmix64
    // finalizer; the chain seeded by the model name hashed from `MODEL_SEED`).
    const GOLDEN_CHAIN: [u64; 2] = [0xe38a_e17f_37d8_cb35, 0x1e62_0e69_360d_b88b];
    const GOLDEN_BLOCK: [u64; 3] = [
        0xe220_a839_7b1d_cdaf,
        0xe859_f30d_90e1_1ee5,
        0x3892_b611_c183_d37c,
    ];

    #[test]
    fn chat_stream_layout() {
        let s = chat(serde_json::json!([
            {"role": "system", "content": "Be \"brief\"\u{e9}"},
            {"role": "user", "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "http://x/1.png"}},
            ]},
            {"role": "assistant", "content": null, "tool_calls": []},
        ]));
        let mut want = b"\xffsystem\xfcBe \"brief\"\xc3\xa9\xffuser\xfclook\xfd".to_vec();
        assert_eq!(&s[..want.len()], &want[..]);
        let hex = &s[want.len()..want.len() + 16];
        assert!(hex.iter().all(u8::is_ascii_hexdigit), "{hex:?}");
        want.extend_from_slice(hex);
        want.extend_from_slice(b"\xffassistant");
        assert_eq!(s, want);
    }

    #[test]
    fn string_content_equals_one_text_part() {
        assert_eq!(
            chat(serde_json::json!([{"role": "user", "content": "hi"}])),
            chat(
                serde_json::json!([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
            ),
        );
        // Escapes are decoded: the same text however it was spelled.
        assert_eq!(
            canonical(
                Api::Chat,
                r#"{"messages":[{"role":"user","content":"\u00e9\/"}]}"#
            ),
            canonical(
                Api::Chat,
                r#"{"messages":[{"role":"user","content":"é/"}]}"#
            ),
        );
    }

    /// A repeated key counts by its last value, as Python's `json` (and so the engine)
    /// reads it: the stream is that of the message or part without the earlier ones
    /// (a derived reader refused the repeat, and the prompt gave no blocks).
    #[test]
    fn a_repeated_key_counts_by_its_last_value() {
        let plain = canonical(
            Api::Chat,
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"b"}]}]}"#,
        );
        assert_eq!(plain, b"\xffuser\xfcb");
        for repeated in [
            r#"{"messages":[{"role":"system","content":"a","role":"user","content":"b"}]}"#,
            r#"{"messages":[{"content":"a","role":"user","content":[{"type":"text","text":"b"}]}]}"#,
            r#"{"messages":[{"role":"user","content":[{"type":"image","text":"a","type":"text","text":"b"}]}]}"#,
            r#"{"messages":[{"role":"user","\u0063ontent":"b"}]}"#,
        ] {
            assert_eq!(canonical(Api::Chat, repeated), plain, "{repeated}");
        }
        // A last `null` content is no content.
        assert_eq!(
            canonical(
                Api::Chat,
                r#"{"messages":[{"role":"user","content":"a","content":null}]}"#
            ),
            b"\xffuser"
        );
    }

    /// A part's `type` is read unescaped (`"\u0074ext"` is `"text"`), and a bare string
    /// in a content list is text, as vLLM reads it: both give the text's stream, not a
    /// hash of the part.
    #[test]
    fn text_parts_are_text_however_spelled() {
        let plain = chat(serde_json::json!([{"role": "user", "content": "hi"}]));
        for spelled in [
            r#"{"messages":[{"role":"user","content":[{"type":"\u0074ext","text":"hi"}]}]}"#,
            r#"{"messages":[{"role":"user","content":[{"\u0074ype":"text","text":"hi"}]}]}"#,
            r#"{"messages":[{"role":"user","content":["hi"]}]}"#,
            r#"{"messages":[{"role":"user","content":["h\u0069"]}]}"#,
        ] {
            assert_eq!(canonical(Api::Chat, spelled), plain, "{spelled}");
        }
        assert_eq!(
            canonical(
                Api::Chat,
                r#"{"messages":[{"role":"user","content":["a",{"type":"text","text":"b"}]}]}"#
            ),
            b"\xffuser\xfca\xfcb"
        );
    }

    #[test]
    fn different_images_differ() {
        let img = |url: &str| {
            chat(serde_json::json!([{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
            ]}]))
        };
        assert_ne!(img("data:a"), img("data:b"));
        assert_eq!(img("data:a"), img("data:a"));
        // Large inline images: hashed by length, head and tail.
        let big = |c: char| format!("data:image/png;base64,{}{c}", "A".repeat(20_000));
        assert_ne!(img(&big('x')), img(&big('y')));
    }

    #[test]
    fn completions_prompts() {
        assert_eq!(
            canonical(Api::Completions, r#"{"prompt":"ab\n"}"#),
            b"\xfbab\n"
        );
        assert_eq!(
            canonical(Api::Completions, r#"{"prompt":[1, 258]}"#),
            b"\xfa\x01\x00\x00\x00\x02\x01\x00\x00"
        );
        // Batches: the first element.
        assert_eq!(
            canonical(Api::Completions, r#"{"prompt":["ab", "cd"]}"#),
            b"\xfbab"
        );
        assert_eq!(
            canonical(Api::Completions, r#"{"prompt":[[7], [8, 9]]}"#),
            b"\xfa\x07\x00\x00\x00"
        );
        for bad in [
            r#"{"prompt":[]}"#,
            r#"{"prompt":[-1]}"#,
            r#"{"prompt":[1.5]}"#,
            r#"{"prompt":[4294967296]}"#,
            r#"{"prompt":[1, "a"]}"#,
            r#"{"prompt":null}"#,
            r#"{"prompt":{"a":1}}"#,
            r#"{"prompt":[null]}"#,
            r#"{"prompt":"a\x"}"#,
        ] {
            // `JsonBody` refuses the bad escape outright; the rest parse.
            if let Ok(b) = JsonBody::parse(bad.as_bytes()) {
                let h = HeaderMap::new();
                let v = RequestView::new(Api::Completions, None, &h, &b);
                assert!(PrefixHasher::new().canonical(&v).is_empty(), "{bad}");
            }
        }
    }

    #[test]
    fn the_api_picks_the_field() {
        let body = r#"{"prompt":"p","messages":[{"role":"user","content":"m"}]}"#;
        assert_eq!(canonical(Api::Completions, body), b"\xfbp");
        assert_eq!(canonical(Api::Chat, body), b"\xffuser\xfcm");
    }

    #[test]
    fn lazy_without_the_field() {
        // Nothing to read: no blocks, and the other fields are never looked at.
        let huge = format!(r#"{{"model":"m","input":"{}"}}"#, "x".repeat(1 << 20));
        assert!(canonical(Api::Chat, &huge).is_empty());
        assert!(canonical(Api::Completions, &huge).is_empty());
        with_body(Api::Chat, huge.as_bytes(), |v| {
            assert!(PrefixHasher::new().block_hashes(v).is_empty());
        });
    }

    #[test]
    fn malformed_messages_give_nothing() {
        for bad in [
            r#"{"messages":{}}"#,
            r#"{"messages":"hi"}"#,
            r#"{"messages":[1]}"#,
            r#"{"messages":[{"role":1,"content":"a"}]}"#,
            r#"{"messages":[{"role":"user","content":5}]}"#,
        ] {
            assert!(canonical(Api::Chat, bad).is_empty(), "{bad}");
        }
    }

    #[test]
    fn the_budget_stops_reading() {
        let h = PrefixHasher::new()
            .with_block_size(4)
            .and_then(|h| h.with_max_blocks(3))
            .expect("valid");
        // The second message is malformed, but the budget is full before it.
        let body = br#"{"messages":[{"role":"user","content":"0123456789abcdef"},{"role":7}]}"#;
        with_body(Api::Chat, body, |v| {
            assert_eq!(h.canonical(v), b"\xffuser\xfc012345");
            assert_eq!(h.block_hashes(v).len(), 3);
        });
        let long = format!(r#"{{"prompt":"{}"}}"#, "y".repeat(10_000));
        with_body(Api::Completions, long.as_bytes(), |v| {
            assert_eq!(h.canonical(v).len(), 12);
        });
    }

    #[test]
    fn the_model_seeds_the_chain() {
        let h = PrefixHasher::new().with_block_size(2).expect("valid");
        assert_ne!(
            h.hash_stream(Some("a"), b"xxxx"),
            h.hash_stream(Some("b"), b"xxxx")
        );
        assert_eq!(
            h.hash_stream(None, b"xxxx"),
            h.hash_stream(Some(""), b"xxxx")
        );
    }

    #[test]
    fn settings_are_checked() {
        assert_eq!(
            PrefixHasher::new().with_block_size(0),
            Err(PrefixError::ZeroBlockSize)
        );
        assert_eq!(
            PrefixHasher::new().with_max_blocks(0),
            Err(PrefixError::ZeroMaxBlocks)
        );
    }

    proptest! {
        /// Equal prefixes give equal leading hashes; a change in block k changes the
        /// hashes of blocks k.. and no earlier one.
        #[test]
        fn a_change_moves_only_later_hashes(
            stream in proptest::collection::vec(any::<u8>(), 0..400),
            at in any::<proptest::sample::Index>(),
            flip in 1u8..=255,
            size in 1usize..40,
        ) {
            let h = PrefixHasher::new()
                .with_block_size(size)
                .and_then(|h| h.with_max_blocks(1_000))
                .expect("valid");
            let a = h.hash_stream(None, &stream);
            prop_assert_eq!(a.len(), stream.len() / size);
            if stream.is_empty() {
                return Ok(());
            }
            let i = at.index(stream.len());
            let mut changed = stream.clone();
            changed[i] ^= flip;
            let b = h.hash_stream(None, &changed);
            let k = i / size;
            for j in 0..a.len() {
                if j < k {
                    prop_assert_eq!(a[j], b[j]);
                } else {
                    prop_assert_ne!(a[j], b[j]);
                }
            }
            // A longer stream with the same start keeps the leading hashes.
            let mut longer = stream;
            longer.extend_from_slice(b"more text");
            prop_assert_eq!(&h.hash_stream(None, &longer)[..a.len()], &a[..]);
        }

        /// Unescaping agrees with serde_json on every string.
        #[test]
        fn unescape_matches_serde(text in any::<String>()) {
            let raw = serde_json::to_string(&text).expect("a string serializes");
            let mut s = Stream::new(usize::MAX, 0);
            prop_assert_eq!(push_json_str(&mut s, raw.as_bytes()), ControlFlow::Continue(()));
            prop_assert_eq!(s.buf, text.into_bytes());
        }

        /// The word-at-a-time search finds the first backslash, like a byte loop.
        #[test]
        fn find_backslash_is_exact(b in proptest::collection::vec(
            prop_oneof![Just(b'\\'), Just(0xDCu8), Just(0x5Du8), any::<u8>()], 0..40,
        )) {
            prop_assert_eq!(find_backslash(&b), b.iter().position(|&c| c == b'\\'));
        }

        /// Arbitrary bytes under either field never panic.
        #[test]
        fn arbitrary_values_never_panic(raw in proptest::collection::vec(any::<u8>(), 0..200)) {
            let h = PrefixHasher::new().with_block_size(3).expect("valid");
            let mut s = Stream::new(64, 0);
            let _ = write_messages(&raw, &mut s);
            let mut s = Stream::new(64, 0);
            let _ = write_prompt(&raw, &mut s);
            let mut s = Stream::new(64, 0);
            let _ = push_json_str(&mut s, &raw);
            let _ = h.hash_stream(None, &raw);
        }

        /// Arbitrary JSON trees as `messages` or `prompt` never panic, and the stream
        /// never exceeds its budget.
        #[test]
        fn arbitrary_json_never_panics(v in json(), max_blocks in 1usize..6) {
            let h = PrefixHasher::new()
                .with_block_size(5)
                .and_then(|h| h.with_max_blocks(max_blocks))
                .expect("valid");
            let body = serde_json::json!({"messages": v, "prompt": v}).to_string();
            for api in [Api::Chat, Api::Completions] {
                with_body(api, body.as_bytes(), |view| {
                    prop_assert!(h.canonical(view).len() <= 5 * max_blocks);
                    prop_assert!(h.block_hashes(view).len() <= max_blocks);
                    Ok(())
                })?;
            }
        }
    }

    /// JSON values shaped like prompts and messages, and not.
    fn json() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::Value;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            (0u32..100_000).prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            ".{0,12}".prop_map(Value::from),
            prop_oneof![Just("role"), Just("user"), Just("text"), Just("type")]
                .prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::vec(
                    (
                        prop_oneof![
                            Just("role".to_owned()),
                            Just("content".to_owned()),
                            Just("type".to_owned()),
                            Just("text".to_owned()),
                            "[a-z]{1,3}",
                        ],
                        inner
                    ),
                    0..4
                )
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }
}
