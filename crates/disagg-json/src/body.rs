//! [`JsonBody`]: the top level of a JSON object, with every value kept as raw text.
//!
//! The request path never needs more than the top level of a client's body: the rewriter
//! sets a handful of sampling fields, connectors add their handoff fields, and routers read
//! `model`. Prompts of megabytes pass through as the bytes they arrived as: values are
//! slices of the original buffer ([`Bytes`], no copy), keys keep their order, and
//! re-emitting the object writes each value back verbatim.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fmt;

use bytes::Bytes;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::error::BodyError;
use crate::raw::string_end;

mod scan;

/// The top level of a JSON object: ordered keys, raw values.
///
/// Duplicate keys are folded as Python's `json` (and so vLLM and SGLang) reads them: the
/// key keeps its first position and takes its last value. This matters for safety: a
/// field the proxy sets or removes cannot be smuggled past it in a second copy.
///
/// Parsing, folding included, takes time linear in the body's size however many keys it
/// has. [`get`](Self::get), [`set`](Self::set) and [`remove`](Self::remove) search the
/// fields in order: linear in their number, which suits the handful of calls a request
/// makes.
///
/// # Examples
///
/// ```
/// use disagg_json::JsonBody;
///
/// let mut body = JsonBody::parse(br#"{"model":"m","prompt":"hi","stream":true}"#)?;
/// body.set("stream", &false);
/// body.remove("model");
/// assert_eq!(&body.to_bytes()[..], br#"{"prompt":"hi","stream":false}"#);
/// # Ok::<(), disagg_json::BodyError>(())
/// ```
#[derive(Clone, Default, PartialEq, Eq)]
pub struct JsonBody {
    /// `(key, raw value)`. The key is the unescaped key text as UTF-8; like the value it
    /// is a slice of the input when the key has no escapes, so cloning a body never
    /// allocates per field.
    fields: Vec<(Bytes, Bytes)>,
}

impl JsonBody {
    /// Parse the top level of `bytes`, which must be one JSON object.
    ///
    /// Values are validated as JSON but not built: each becomes a slice of the input.
    ///
    /// # Errors
    ///
    /// [`BodyError::InvalidJson`] for malformed JSON, [`BodyError::NotAnObject`] when the
    /// top level is not an object.
    #[inline]
    pub fn parse(bytes: &[u8]) -> Result<Self, BodyError> {
        Self::parse_bytes(&Bytes::copy_from_slice(bytes))
    }

    /// Like [`parse`](Self::parse), with values sharing `bytes`' buffer instead of a copy.
    ///
    /// # Errors
    ///
    /// As [`parse`](Self::parse).
    pub fn parse_bytes(bytes: &Bytes) -> Result<Self, BodyError> {
        // The scan accepts what serde accepts, or gives up; serde then has the last word
        // (and its errors are the ones reported).
        let spans = match scan::object_fields(bytes) {
            Some(spans) => spans,
            None => serde_fields(bytes)?,
        };
        if spans.len() > MAX_FIELDS {
            return Err(BodyError::TooManyFields { limit: MAX_FIELDS });
        }
        if spans.len() > INDEX_FROM_KEYS {
            return Ok(JsonBody {
                fields: fold_indexed(bytes, &spans),
            });
        }
        let mut body = JsonBody {
            fields: Vec::with_capacity(spans.len()),
        };
        for (key, start, end) in spans {
            let key = match key {
                Key::Span(a, b) => bytes.slice(a..b),
                Key::Owned(k) => Bytes::from(k),
            };
            body.insert_slot(key, bytes.slice(start..end));
        }
        Ok(body)
    }

    /// Fold one parsed field in by a linear search: for the few keys of a usual body
    /// (see [`INDEX_FROM_KEYS`]).
    fn insert_slot(&mut self, key: Bytes, value: Bytes) {
        match self.fields.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => self.fields.push((key, value)),
        }
    }

    #[inline]
    fn slot(&self, key: &str) -> Option<&Bytes> {
        self.fields
            .iter()
            .find(|(k, _)| k.as_ref() == key.as_bytes())
            .map(|(_, v)| v)
    }

    /// The raw JSON text of `key`'s value.
    #[inline]
    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.slot(key).map(|v| &v[..])
    }

    /// The value of `key` as its own [`Bytes`] (no copy).
    #[inline]
    pub fn get_bytes(&self, key: &str) -> Option<Bytes> {
        self.slot(key).cloned()
    }

    /// Deserialize `key`'s value; `None` when absent.
    ///
    /// # Errors
    ///
    /// When the value does not deserialize as `T`.
    pub fn get_as<'a, T: Deserialize<'a>>(&'a self, key: &str) -> Option<serde_json::Result<T>> {
        self.get(key).map(serde_json::from_slice)
    }

    /// Whether `key` is absent or `null`.
    #[inline]
    pub fn is_null_or_absent(&self, key: &str) -> bool {
        self.get(key).is_none_or(|v| v == b"null")
    }

    /// Set `key` to `value`, in place if present, else appended.
    pub fn set<T: Serialize + ?Sized>(&mut self, key: &str, value: &T) {
        // Serializing plain data (numbers, bools, strings, maps of them) cannot fail;
        // a value whose `Serialize` impl fails is a bug in the caller.
        let raw = serde_json::to_vec(value).unwrap_or_else(|_| b"null".to_vec());
        self.put(
            key,
            || Bytes::copy_from_slice(key.as_bytes()),
            Bytes::from(raw),
        );
    }

    /// Set `key`, a field name known at compile time, to raw JSON text, which the caller
    /// vouches is one valid JSON value; a key that is appended is not copied (no
    /// allocation for it on a per-request path).
    #[inline]
    pub fn set_raw(&mut self, key: &'static str, raw: Bytes) {
        self.put(key, || Bytes::from_static(key.as_bytes()), raw);
    }

    /// Set `key` to `raw` in place, or append it with the key `owned` makes.
    fn put(&mut self, key: &str, owned: impl FnOnce() -> Bytes, raw: Bytes) {
        match self
            .fields
            .iter_mut()
            .find(|(k, _)| k.as_ref() == key.as_bytes())
        {
            Some(slot) => slot.1 = raw,
            None => self.fields.push((owned(), raw)),
        }
    }

    /// Remove `key`, returning its raw value.
    #[inline]
    pub fn remove(&mut self, key: &str) -> Option<Bytes> {
        let i = self
            .fields
            .iter()
            .position(|(k, _)| k.as_ref() == key.as_bytes())?;
        Some(self.fields.remove(i).1)
    }

    /// The fields in order, as `(key, raw JSON value)`, the key as its UTF-8 bytes: one
    /// pass over the object for a reader of many fields, where each [`get`](Self::get)
    /// would be a search (and bytes, so that matching keys validates nothing again).
    #[inline]
    pub fn fields(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.fields.iter().map(|(k, v)| (&k[..], &v[..]))
    }

    /// Keep only the fields whose key (UTF-8 bytes) `keep` accepts, in order: one pass,
    /// where removing many keys one by one would search the object for each.
    pub fn retain(&mut self, mut keep: impl FnMut(&[u8]) -> bool) {
        self.fields.retain(|(k, _)| keep(k));
    }

    /// The keys in order.
    #[inline]
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        // Keys come from `&str`s (parsed or given), so they are valid UTF-8.
        self.fields
            .iter()
            .map(|(k, _)| std::str::from_utf8(k).unwrap_or_default())
    }

    /// The bytes of its keys (unescaped) and values: what the body holds of its input,
    /// and its length as JSON text but for the quotes, colons, commas and braces.
    pub fn size(&self) -> usize {
        self.fields.iter().map(|(k, v)| k.len() + v.len()).sum()
    }

    /// The object as compact JSON text; values are written back byte for byte.
    #[inline]
    pub fn to_bytes(&self) -> Bytes {
        // Each field's quotes, colon and separator, and the braces.
        let len = self.size() + 4 * self.fields.len() + 2;
        let mut out = Vec::with_capacity(len);
        // Each field is written after its separator (`{` before the first): one push,
        // and a plain key's closing quote and colon in one copy. Per body of a dozen
        // fields this is ~500 instructions fewer than a push per delimiter.
        let mut separator = b'{';
        for (k, v) in &self.fields {
            out.push(separator);
            separator = b',';
            if k.iter().all(|&b| PLAIN[usize::from(b)]) {
                out.push(b'"');
                out.extend_from_slice(k);
                out.extend_from_slice(b"\":");
            } else {
                write_json_str(&mut out, k);
                out.push(b':');
            }
            out.extend_from_slice(v);
        }
        if separator == b'{' {
            out.push(b'{');
        }
        out.push(b'}');
        Bytes::from(out)
    }

    /// The object as [`to_bytes`](Self::to_bytes) writes it, in pieces given to `part`
    /// in order: each value of at least `slice_from` bytes is its own piece, a slice of
    /// the buffer it came in (no copy), and the text between them is written into
    /// pieces of its own. A body without such a value is one piece, `to_bytes`'s.
    ///
    /// For a body sent as several buffers (vectored writes), so that a long prompt is
    /// never copied to be sent. Empty pieces are not given.
    pub fn write_parts(&self, slice_from: usize, mut part: impl FnMut(Bytes)) {
        if self.fields.iter().all(|(_, v)| v.len() < slice_from) {
            part(self.to_bytes());
            return;
        }
        let mut out = Vec::new();
        let mut separator = b'{';
        for (k, v) in &self.fields {
            write_key(&mut out, separator, k);
            separator = b',';
            if v.len() >= slice_from {
                part(Bytes::from(std::mem::take(&mut out)));
                part(v.clone());
            } else {
                out.extend_from_slice(v);
            }
        }
        out.push(b'}');
        part(Bytes::from(out));
    }
}

/// `(key, start, end)` of each top-level field of `bytes`, as `serde_json` reads them:
/// the fallback of [`scan::object_fields`], and the reference its tests compare with.
fn serde_fields(bytes: &[u8]) -> Result<Vec<(Key, usize, usize)>, BodyError> {
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        // Tell "not JSON" from "JSON, but not an object".
        return match serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
            Ok(_) => Err(BodyError::NotAnObject),
            Err(e) => Err(BodyError::InvalidJson(e)),
        };
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let spans = de
        .deserialize_map(SpanVisitor { base: bytes })
        .map_err(BodyError::InvalidJson)?;
    de.end().map_err(BodyError::InvalidJson)?;
    Ok(spans)
}

/// Write the delimiters and key of field `k` (after its `separator`) to `out`.
fn write_key(out: &mut Vec<u8>, separator: u8, k: &[u8]) {
    out.push(separator);
    if k.iter().all(|&b| PLAIN[usize::from(b)]) {
        out.push(b'"');
        out.extend_from_slice(k);
        out.extend_from_slice(b"\":");
    } else {
        write_json_str(out, k);
        out.push(b':');
    }
}

/// The most top-level fields (duplicates counted) a body may have: past it,
/// [`JsonBody::parse`] refuses it with [`BodyError::TooManyFields`], having kept at most
/// one more field's span. An engine's request has a few dozen fields; a body of millions
/// of short ones (`"k1":0,...`) cost the proxy about seven bytes per byte for the
/// request's life, and every clone of the body as much again.
pub const MAX_FIELDS: usize = 1024;

/// Past this many top-level fields, [`JsonBody::parse_bytes`] folds duplicate keys through
/// a hash index instead of a linear search per key.
///
/// The linear search costs O(keys²): nothing for the dozen fields of a real request, but a
/// hostile body of 120k distinct keys (1.3 MB) took 13 s of an event loop. Below this
/// count the search (at most ~500 short comparisons, most failing on the first byte) is
/// cheaper than building a hash map, so the common case pays nothing for the index.
const INDEX_FROM_KEYS: usize = 32;

/// `spans` folded as Python's `json` folds duplicate keys (first position, last value),
/// in O(keys) through a hash index.
///
/// The index hashes with the standard library's randomly keyed SipHash, so a client
/// cannot choose keys that collide.
fn fold_indexed(bytes: &Bytes, spans: &[(Key, usize, usize)]) -> Vec<(Bytes, Bytes)> {
    let mut index: HashMap<&[u8], usize> = HashMap::with_capacity(spans.len());
    let mut fields: Vec<(Bytes, Bytes)> = Vec::with_capacity(spans.len());
    for (key, start, end) in spans {
        let text: &[u8] = match key {
            Key::Span(a, b) => &bytes[*a..*b],
            Key::Owned(k) => k.as_bytes(),
        };
        let value = bytes.slice(*start..*end);
        match index.entry(text) {
            Entry::Occupied(slot) => fields[*slot.get()].1 = value,
            Entry::Vacant(slot) => {
                slot.insert(fields.len());
                let key = match key {
                    Key::Span(a, b) => bytes.slice(*a..*b),
                    Key::Owned(k) => Bytes::copy_from_slice(k.as_bytes()),
                };
                fields.push((key, value));
            }
        }
    }
    fields
}

/// The raw value of the top-level field `key` of the JSON object `bytes`, found without
/// building the rest.
///
/// The object is walked at its top level only: strings are skipped escape-aware, nested
/// values by bracket depth, and only the value found is validated as JSON. Cheaper than
/// [`JsonBody::parse_bytes`] when one field of a large answer is wanted (the prefill's
/// `kv_transfer_params`); a malformed object is an error, as with a full parse. Keys are
/// compared after unescaping; the last of duplicate keys wins.
///
/// # Errors
///
/// [`BodyError`] when `bytes` is not a JSON object or the value found is not valid JSON.
///
/// # Examples
///
/// ```
/// use bytes::Bytes;
/// use disagg_json::top_level_field;
///
/// let answer = Bytes::from_static(br#"{"choices":[{"text":"}"}],"kv_transfer_params":{"a":1}}"#);
/// let v = top_level_field(&answer, "kv_transfer_params")?.unwrap();
/// assert_eq!(&v[..], br#"{"a":1}"#);
/// # Ok::<(), disagg_json::BodyError>(())
/// ```
pub fn top_level_field(bytes: &Bytes, key: &str) -> Result<Option<Bytes>, BodyError> {
    let found = top_level_span(bytes, key)?;
    if let Some(value) = &found {
        serde_json::from_slice::<de::IgnoredAny>(value).map_err(BodyError::InvalidJson)?;
    }
    Ok(found)
}

/// Like [`top_level_field`], with the value read by `read` instead of by serde: `read`
/// gets the answer from the value's first byte on and says how many bytes the value
/// takes (and what it found), or `None` when they are not JSON, which makes the answer
/// malformed. The rest of the object's shape is checked as for `top_level_field`. For a
/// caller whose reading validates the value anyway, so that its bytes are read once.
pub fn top_level_read<T>(
    bytes: &Bytes,
    key: &str,
    mut read: impl FnMut(&[u8]) -> Option<(usize, T)>,
) -> Result<Option<(Bytes, T)>, BodyError> {
    let mut last = None;
    let found = scan_field(bytes, key.as_bytes(), |i| {
        let rest = bytes.get(i..)?;
        let (len, found) = read(rest).filter(|(len, _)| (1..=rest.len()).contains(len))?;
        last = Some(found);
        Some(i + len)
    });
    match found {
        Some(found) => Ok(found
            .zip(last)
            .map(|((start, end), read)| (bytes.slice(start..end), read))),
        // Malformed: let the full parser say precisely what is wrong.
        None => match JsonBody::parse_bytes(bytes) {
            Err(e) => Err(e),
            Ok(_) => Err(BodyError::NotAnObject),
        },
    }
}

/// [`top_level_read`] for two keys in one pass over the object: `read_a` reads the
/// values of `key_a`, `read_b` those of `key_b`, each as `top_level_read`'s `read`.
pub fn top_level_read_pair<T, U>(
    bytes: &Bytes,
    (key_a, mut read_a): (&str, impl FnMut(&[u8]) -> Option<(usize, T)>),
    (key_b, mut read_b): (&str, impl FnMut(&[u8]) -> Option<(usize, U)>),
) -> Result<ReadPair<T, U>, BodyError> {
    let (mut last_a, mut last_b) = (None, None);
    let found = scan_fields(bytes, [key_a.as_bytes(), key_b.as_bytes()], |k, i| {
        let rest = bytes.get(i..)?;
        let len = if k == 0 {
            let (len, found) = read_a(rest)?;
            last_a = Some(found);
            len
        } else {
            let (len, found) = read_b(rest)?;
            last_b = Some(found);
            len
        };
        (1..=rest.len()).contains(&len).then_some(i + len)
    });
    match found {
        Some([a, b]) => Ok((
            a.zip(last_a)
                .map(|((start, end), read)| (bytes.slice(start..end), read)),
            b.zip(last_b)
                .map(|((start, end), read)| (bytes.slice(start..end), read)),
        )),
        // Malformed: let the full parser say precisely what is wrong.
        None => match JsonBody::parse_bytes(bytes) {
            Err(e) => Err(e),
            Ok(_) => Err(BodyError::NotAnObject),
        },
    }
}

/// What [`top_level_read_pair`] found: each key's last value and its reading.
pub type ReadPair<T, U> = (Option<(Bytes, T)>, Option<(Bytes, U)>);

/// The span of the last top-level value of `key`, the object's shape checked (see
/// [`scan_field`]), the value's bytes not read as JSON.
fn top_level_span(bytes: &Bytes, key: &str) -> Result<Option<Bytes>, BodyError> {
    match scan_field(bytes, key.as_bytes(), |i| skip_value(bytes, i)) {
        Some(found) => Ok(found.map(|(start, end)| bytes.slice(start..end))),
        // Malformed: let the full parser say precisely what is wrong.
        None => match JsonBody::parse_bytes(bytes) {
            Err(e) => Err(e),
            Ok(_) => Err(BodyError::NotAnObject),
        },
    }
}

/// `Some(Some(span))` for the last top-level value of `key`, `Some(None)` when the object
/// has no such key, `None` when `b` is not a well-formed object at its top level. Each
/// value of `key` is stepped over by `value` (from its first byte to the index past
/// it), the others by [`skip_value`].
fn scan_field(
    b: &[u8],
    key: &[u8],
    mut value: impl FnMut(usize) -> Option<usize>,
) -> Option<Option<(usize, usize)>> {
    scan_fields(b, [key], |_, i| value(i)).map(|[found]| found)
}

/// [`scan_field`] for `N` keys in one pass: the span of the last top-level value of
/// each key (`None` for a key the object lacks), each value of `keys[k]` stepped over
/// by `value(k, start)`.
fn scan_fields<const N: usize>(
    b: &[u8],
    keys: [&[u8]; N],
    mut value: impl FnMut(usize, usize) -> Option<usize>,
) -> Option<[Option<(usize, usize)>; N]> {
    let ws = |i: &mut usize| {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    let mut i = 0;
    ws(&mut i);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    let mut found = [None; N];
    ws(&mut i);
    if b.get(i) == Some(&b'}') {
        i += 1;
        ws(&mut i);
        return (i == b.len()).then_some(found);
    }
    loop {
        ws(&mut i);
        if b.get(i) != Some(&b'"') {
            return None;
        }
        let key_end = string_end(b, i)?;
        let raw_key = &b[i + 1..key_end - 1];
        // Equal bytes are the key (it has no backslash); a key spelled with escapes is
        // longer than what it reads as, so only a longer one with a backslash is read.
        let matches = keys.iter().position(|key| {
            raw_key == *key
                || (raw_key.len() > key.len()
                    && raw_key.contains(&b'\\')
                    && serde_json::from_slice::<String>(&b[i..key_end])
                        .is_ok_and(|k| k.as_bytes() == *key))
        });
        i = key_end;
        ws(&mut i);
        if b.get(i) != Some(&b':') {
            return None;
        }
        i += 1;
        ws(&mut i);
        let start = i;
        if let Some(k) = matches {
            i = value(k, i)?;
            found[k] = Some((start, i));
        } else {
            i = skip_value(b, i)?;
        }
        ws(&mut i);
        match b.get(i) {
            Some(b',') => i += 1,
            Some(b'}') => {
                i += 1;
                ws(&mut i);
                return (i == b.len()).then_some(found);
            }
            _ => return None,
        }
    }
}

/// The index just past the value starting at `b[i]` (its shape only; the one value
/// returned is validated by the caller). `b` is not validated: both kinds of brackets
/// are counted, where [`raw::validated_value_end`](crate::raw::validated_value_end)
/// counts the value's own kind only.
fn skip_value(b: &[u8], mut i: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => string_end(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            while i < b.len() {
                match b[i] {
                    b'"' => {
                        i = string_end(b, i)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
            None
        }
        _ => {
            let start = i;
            while i < b.len() && !matches!(b[i], b',' | b'}' | b']') && !b[i].is_ascii_whitespace()
            {
                i += 1;
            }
            (i > start).then_some(i)
        }
    }
}

impl fmt::Debug for JsonBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&String::from_utf8_lossy(&self.to_bytes()))
    }
}

/// The bytes a JSON string holds as they are: not a control byte, a quote or a
/// backslash.
static PLAIN: [bool; 256] = {
    let mut plain = [true; 256];
    let mut c = 0;
    while c < 0x20 {
        plain[c] = false;
        c += 1;
    }
    plain[b'"' as usize] = false;
    plain[b'\\' as usize] = false;
    plain
};

/// `s` as a JSON string: copied between quotes when nothing needs escaping.
pub fn write_json_str(out: &mut Vec<u8>, s: &[u8]) {
    if s.iter().all(|&b| PLAIN[usize::from(b)]) {
        out.push(b'"');
        out.extend_from_slice(s);
        out.push(b'"');
    } else {
        let escaped = serde_json::to_string(&*String::from_utf8_lossy(s)).unwrap_or_default();
        out.extend_from_slice(escaped.as_bytes());
    }
}

/// A key as the deserializer hands it over: borrowed from the input when it has no
/// escapes. (serde's own `Cow<str>` always allocates: it deserializes as `String`.)
enum KeyText<'de> {
    Borrowed(&'de str),
    Owned(String),
}

impl<'de> Deserialize<'de> for KeyText<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = KeyText<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object key")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(KeyText::Borrowed(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(KeyText::Owned(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(KeyText::Owned(v))
            }
        }
        d.deserialize_str(V)
    }
}

/// Where a parsed key's text is: a span of the input (no escapes), or unescaped text.
enum Key {
    Span(usize, usize),
    Owned(String),
}

/// Collects `(key, start, end)` for each top-level value, as offsets into `base`.
struct SpanVisitor<'b> {
    base: &'b [u8],
}

impl SpanVisitor<'_> {
    /// The offset of `part` inside the input. Borrowed keys and `RawValue`s from a slice
    /// deserializer point into that slice; anything else is a bug, reported as an error.
    fn offset(&self, part: &[u8]) -> Result<usize, &'static str> {
        (part.as_ptr() as usize)
            .checked_sub(self.base.as_ptr() as usize)
            .filter(|s| s + part.len() <= self.base.len())
            .ok_or("parsed text outside of the input")
    }
}

impl<'de> Visitor<'de> for SpanVisitor<'_> {
    type Value = Vec<(Key, usize, usize)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::with_capacity(map.size_hint().unwrap_or(16).min(MAX_FIELDS + 1));
        while let Some(key) = map.next_key::<KeyText<'de>>()? {
            if out.len() > MAX_FIELDS {
                // Refused by the caller: the rest is read for its validity, not kept.
                map.next_value::<de::IgnoredAny>()?;
                continue;
            }
            let key = match key {
                // A borrowed key has no escapes and points into the input.
                KeyText::Borrowed(k) => {
                    let start = self.offset(k.as_bytes()).map_err(de::Error::custom)?;
                    Key::Span(start, start + k.len())
                }
                KeyText::Owned(k) => Key::Owned(k),
            };
            let raw: &'de RawValue = map.next_value()?;
            let text = raw.get().as_bytes();
            let start = self.offset(text).map_err(de::Error::custom)?;
            out.push((key, start, start + text.len()));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
