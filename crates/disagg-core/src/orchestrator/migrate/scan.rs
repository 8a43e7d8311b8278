//! The byte scans of a tracked decode stream: its events, their payloads and the token
//! id lists in them, read without deserializing the chunks.

use bytes::{Bytes, BytesMut};
use serde_json::value::RawValue;

/// The payload of an event's `data:` line (the whole event is one line in vLLM's
/// streams), trimmed.
pub(super) fn payload(event: &[u8]) -> Option<&[u8]> {
    let rest = event.strip_prefix(b"data:")?;
    Some(rest.trim_ascii())
}

/// The length of the event's trailing whitespace (its `\n\n`).
pub(super) fn trailing(event: &[u8]) -> usize {
    event.len() - event.trim_ascii_end().len()
}

/// The end of the first whole event in `buf` (past its `\n\n`), found by a `memchr`
/// scan for the line ends.
pub(super) fn event_end(buf: &[u8]) -> Option<usize> {
    memchr::memchr_iter(b'\n', buf)
        .find(|&i| buf.get(i + 1) == Some(&b'\n'))
        .map(|i| i + 2)
}

/// The bytes of a cut SSE event, held until its end comes (and, after a leg failed,
/// what followed the failed event).
///
/// Each frame is scanned once: the held bytes have no event end, so a new frame is
/// scanned from the last held byte on (an end may straddle the two). An engine writing
/// one event a byte per frame costs the event's length, not its length squared.
#[derive(Debug, Default)]
pub(super) struct Held {
    buf: BytesMut,
    /// Bytes copied in and scanned, for the tests' bound.
    #[cfg(test)]
    pub(super) work: usize,
}

impl Held {
    /// `data` after the held bytes: all of them, from the first held byte, when an event
    /// ended in them (the caller walks the events and holds what is left), else `None`
    /// (`data` is held too). With nothing held, `data` itself.
    pub(super) fn push(&mut self, data: Bytes) -> Option<Bytes> {
        if self.buf.is_empty() {
            return Some(data);
        }
        let from = self.buf.len() - 1;
        self.buf.extend_from_slice(&data);
        let scanned = &self.buf[from..];
        #[cfg(test)]
        {
            self.work += data.len() + scanned.len();
        }
        event_end(scanned)?;
        Some(self.take().freeze())
    }

    /// Hold `rest`, after what is held.
    pub(super) fn hold(&mut self, rest: &[u8]) {
        #[cfg(test)]
        {
            self.work += rest.len();
        }
        self.buf.extend_from_slice(rest);
    }

    /// Everything held, which is no longer.
    pub(super) fn take(&mut self) -> BytesMut {
        self.buf.split()
    }

    pub(super) fn len(&self) -> usize {
        self.buf.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub(super) fn clear(&mut self) {
        self.buf.clear();
    }
}

/// Whether `data` (a chunk's payload) holds a `"finish_reason"` key set to a string
/// (vLLM's) or an object (SGLang's), not `null`, however the engine spaced its JSON:
/// the rule of the watch a stream relayed without migration is read with
/// ([`FinishReasons`](disagg_json::FinishReasons)). A key written inside a string is
/// escaped (`\"`) and, where the needle does match across an escaped quote (a text
/// ending in `\"finish_reason`), it is a string's end, followed by no colon.
pub(super) fn has_finish(data: &[u8]) -> bool {
    disagg_json::FinishReasons::set_in(data)
}

/// The key of a chunk's usage.
pub(super) const USAGE_KEY: &[u8] = b"\"usage\"";

/// Whether `data` (a chunk's payload) holds a `"usage"` key set to an object (a usage
/// chunk), not `null`, however the engine spaced its JSON; `key` finds [`USAGE_KEY`].
/// A key inside a text is none, as for [`has_finish`].
pub(super) fn has_usage(key: &memchr::memmem::Finder<'_>, data: &[u8]) -> bool {
    keyed(key, data, b"{")
}

/// Whether the key `key` finds in `data` is followed by optional whitespace, `:`,
/// optional whitespace and a value opening with one of the bytes `opens`.
fn keyed(key: &memchr::memmem::Finder<'_>, data: &[u8], opens: &[u8]) -> bool {
    let mut at = 0;
    while let Some(hit) = key.find(&data[at..]) {
        at += hit + key.needle().len();
        let value = data[at..]
            .trim_ascii_start()
            .strip_prefix(b":")
            .map(<[u8]>::trim_ascii_start);
        if value
            .and_then(<[u8]>::first)
            .is_some_and(|b| opens.contains(b))
        {
            return true;
        }
    }
    false
}

/// Whether the SSE event `event` is `data: [DONE]`.
pub(super) fn is_done(event: &[u8]) -> bool {
    payload(event) == Some(b"[DONE]".as_slice())
}

/// The end of both ids keys, `token_ids":`.
pub(super) const IDS_KEY: &[u8] = b"token_ids\":";

#[derive(Debug, PartialEq, Eq)]
pub(super) enum IdsKey {
    Prompt,
    Generated,
}

/// The next `"token_ids":` or `"prompt_token_ids":` key at or after `at` whose value is
/// an array: the key and the array's range (`[` to `]` inclusive). A key inside a
/// string is escaped (`\"token_ids\"`) and not matched. `key` finds [`IDS_KEY`].
pub(super) fn next_ids(
    key: &memchr::memmem::Finder<'_>,
    data: &[u8],
    mut at: usize,
) -> Option<(IdsKey, usize, usize)> {
    loop {
        let hit = at + key.find(&data[at..])?;
        at = hit + IDS_KEY.len();
        let kind = if hit >= 1 && data[hit - 1] == b'"' && (hit < 2 || data[hit - 2] != b'\\') {
            IdsKey::Generated
        } else if hit >= 8 && &data[hit - 8..hit] == b"\"prompt_" {
            IdsKey::Prompt
        } else {
            continue;
        };
        let mut start = at;
        while data.get(start).is_some_and(u8::is_ascii_whitespace) {
            start += 1;
        }
        if data.get(start) != Some(&b'[') {
            continue;
        }
        let end = start + memchr::memchr(b']', &data[start..])? + 1;
        return Some((kind, start, end));
    }
}

/// The ids of a JSON array of non-negative integers below 2^32 (`None` otherwise).
#[cfg(test)]
pub(super) fn parse_ids(raw: &[u8]) -> Option<Vec<u32>> {
    let mut ids = Vec::new();
    parse_ids_into(raw, &mut ids)?;
    Some(ids)
}

/// The ids of a JSON array of non-negative integers below 2^32, appended to `ids` in
/// one pass over the bytes (digits and commas, whitespace between); `None`, with `ids`
/// as it was, for anything else (a sign, a fraction, an exponent, an id past `u32`, an
/// empty element).
pub(super) fn parse_ids_into(raw: &[u8], ids: &mut Vec<u32>) -> Option<()> {
    let was = ids.len();
    let read = |ids: &mut Vec<u32>| -> Option<()> {
        let inner = raw.strip_prefix(b"[")?.strip_suffix(b"]")?.trim_ascii();
        if inner.is_empty() {
            return Some(());
        }
        for n in inner.split(|&b| b == b',') {
            let n = n.trim_ascii();
            if n.is_empty() {
                return None;
            }
            let mut v: u32 = 0;
            for &b in n {
                if !b.is_ascii_digit() {
                    return None;
                }
                v = v.checked_mul(10)?.checked_add(u32::from(b - b'0'))?;
            }
            ids.push(v);
        }
        Some(())
    };
    let read = read(ids);
    if read.is_none() {
        ids.truncate(was);
    }
    read
}

/// The ids of `raw`, a value of a chunk that was read as one JSON value, appended to
/// `ids` when it is a list of non-negative integers below 2^32 (`true`); `ids` as it was
/// otherwise. In valid JSON this is what an integer read of each element takes: `1.0`,
/// `1e2`, `-0`, `"1"` and `[1]` are not ids, whitespace between them is allowed.
pub(super) fn ids_of(raw: &RawValue, ids: &mut Vec<u32>) -> bool {
    parse_ids_into(raw.get().as_bytes(), ids).is_some()
}
