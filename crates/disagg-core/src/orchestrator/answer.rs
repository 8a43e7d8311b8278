//! What of an engine's answer reaches the client: never the engine's own KV handoff, an
//! internal redirect, an encoding the client did not accept, or a head that hides what
//! its body is.
//!
//! vLLM 0.33 writes a finished request's `kv_transfer_params` (and `ec_transfer_params`)
//! as a top-level key of every non-streamed answer and of the terminal chunk of a
//! chat or completion stream (the chunk with `finish_reason`), and in the `response` of
//! a Responses stream's terminal event (`vllm/entrypoints/openai/chat_completion/serving.py`,
//! `…/completion/serving.py`, `…/responses/serving.py`). A decode running bidirectional
//! NIXL puts its own there: its engine id, internal host and port, block ids. None of it
//! is the client's business, so a [`PdBody`](crate::orchestrator::PdBody) made
//! [`scrubbed`](crate::orchestrator::PdBody::scrubbed) relays an event stream or a JSON answer with the
//! value of every handoff key (`kv_transfer_params`, `ec_transfer_params`,
//! `bootstrap_host`, `bootstrap_port`, `bootstrap_room`) overwritten in place: `null`,
//! then spaces to the value's length (JSON whitespace), as a decode with no handoff
//! answers.
//!
//! - The answer streams as it came: each frame handed to the client (a burst of the
//!   engine's frames joined into one, see [`PdBody`](crate::orchestrator::PdBody)) is searched for the
//!   keys (`memchr`'s `memmem`) and passed on untouched when none holds a value (the
//!   usual case: no copy; the `"kv_transfer_params":null` vLLM writes on every chunk is
//!   no handoff). Only what a key's value needs is held back: the end of a frame that
//!   may begin a key, and a handoff from its key to the end of its value (at most
//!   [`MAX_HELD_HANDOFF`] bytes; a longer one, or one that is no JSON value, ends the
//!   answer as a broken stream does).
//! - The answer keeps its length, so its `content-length` stays true and the stream's
//!   other bytes, its event boundaries included, are the engine's own.
//! - Other answers (no JSON, no event stream) pass untouched.
//!
//! [`unrelayable`](crate::proto::unrelayable) says which answer heads are not relayed
//! at all: a redirect whose `Location` names the engine's internal address, a
//! `content-encoding` the client did not accept (or one on an answer the proxy must
//! read for the keys above), a `connection` header naming a `content-*` header, and
//! more than one `content-type` or `content-encoding` line (either would hide from the
//! scrubber what the body is).

use std::sync::{Arc, LazyLock};

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap};
use memchr::memmem;

use crate::connector::ReturnedHandoff;

/// The keys an engine writes about its own KV handoff, whose values never reach a
/// client: vLLM's `kv_transfer_params` and `ec_transfer_params`, SGLang's
/// `bootstrap_host`, `bootstrap_port` and `bootstrap_room` (the scrubber's `QUOTED`
/// forms are checked against it).
#[cfg(test)]
pub(crate) const HANDOFF_KEYS: &[&str] = &[
    "kv_transfer_params",
    "ec_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
];

/// The handoff vLLM writes on every chunk of a stream: no handoff.
const NULL_HANDOFF: &[u8] = b"\"kv_transfer_params\":null";

/// The keys as they are written, quoted, each with where [`NEEDLE`] sits in it;
/// `kv_transfer_params` first (the one a [`ReturnedHandoff`] gets).
const QUOTED: [(&[u8], usize); 5] = [
    (b"\"kv_transfer_params\"", 4),
    (b"\"ec_transfer_params\"", 4),
    (b"\"bootstrap_host\"", 6),
    (b"\"bootstrap_port\"", 6),
    (b"\"bootstrap_room\"", 6),
];

/// What a search looks for: every key holds it (`"kv_transfer_params"`,
/// `"bootstrap_host"`), so one pass over a frame finds them all.
const NEEDLE: &[u8] = b"tra";

/// The search for [`NEEDLE`], built once: building it (memchr ranks the needle's bytes
/// and picks a SIMD routine) costs more than searching a chunk with it, and a stream
/// searches each frame it hands over. Read-only once built.
static FINDER: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::FinderBuilder::new().build_forward_with_ranker(JsonRank, NEEDLE));

/// How often a byte occurs in an engine's JSON, roughly. memchr's search first looks
/// for the needle's two rarest bytes, and its default ranks are general text's, where
/// `"` and `_` are rare: in JSON they are everywhere, and a search keyed on them stops
/// at every key. Ranked frequent here, the search is keyed on the keys' letters.
struct JsonRank;

impl memchr::arch::all::packedpair::HeuristicFrequencyRank for JsonRank {
    fn rank(&self, byte: u8) -> u8 {
        match byte {
            b'"' | b'_' | b':' | b',' | b'{' | b'}' | b'[' | b']' | b' ' | b'\n' => 255,
            b'0'..=b'9' => 250,
            b'e' | b't' | b'a' | b'o' | b'i' | b'n' | b's' | b'r' | b'l' | b'd' | b'c' => 240,
            b'a'..=b'z' => 200,
            _ => 100,
        }
    }
}

/// The most bytes of one handoff (its key and value) held back until its value ends
/// (1 MiB; a vLLM handoff is a few hundred bytes, its block ids a few kilobytes for a
/// long prompt).
pub(crate) const MAX_HELD_HANDOFF: usize = 1024 * 1024;

/// Up to this many held bytes, a frame that adds to a handoff not whole yet scans it
/// again at once (a vLLM handoff fits, so its end goes out with the frame that
/// completes it); past it, a held handoff is scanned again only once its bytes doubled
/// since the last scan, or when the answer ends. Each scan reads the held bytes from the
/// key on, so an engine trickling a long value a byte per frame would otherwise cost a
/// scan of up to [`MAX_HELD_HANDOFF`] bytes per byte: this keeps the work about linear
/// in the value (at most 16 KiB per frame, then a doubling series).
const RESCAN_FREELY: usize = 16 * 1024;

/// An answer holds a handoff the proxy cannot keep from the client.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum AnswerError {
    /// A handoff value longer than [`MAX_HELD_HANDOFF`].
    #[error("the engine's answer holds a KV handoff of more than {limit} bytes")]
    TooLarge {
        /// The limit passed.
        limit: usize,
    },
    /// A handoff key followed by something that is no JSON value.
    #[error("the engine's answer holds a KV handoff key whose value is no JSON")]
    Unreadable,
}

/// Whether an engine's answer with `headers` is read for a handoff: an event stream or
/// JSON (other answers pass untouched).
pub(crate) fn scrubbed_kind(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|ct| scrubbed_type(ct.as_bytes()))
}

/// Whether an answer of content type `ct` is read for a handoff.
pub(crate) fn scrubbed_type(ct: &[u8]) -> bool {
    let starts = |p: &[u8]| ct.len() >= p.len() && ct[..p.len()].eq_ignore_ascii_case(p);
    starts(b"text/event-stream") || starts(b"application/json") || starts(b"application/x-ndjson")
}

// === the scrubber ===

/// What a search of a buffer found next.
#[derive(Debug, PartialEq, Eq)]
enum Hit {
    /// Nothing to overwrite up to here (a `null` value, a look-alike): search on from it.
    Skip(usize),
    /// A handoff value at `start..end`; `true` when its key is `kv_transfer_params`.
    Value(usize, usize, bool),
    /// A key from here on whose value is not whole yet: hold it back.
    Incomplete(usize),
}

/// The state of one answer's scrubbing: the bytes held back, and where the answer's
/// own `kv_transfer_params` goes before it is blanked, when someone keeps it.
#[derive(Debug, Default)]
pub(crate) struct Scrubber {
    held: BytesMut,
    /// How many bytes were held after the last scan: what it could not pass on yet.
    scanned: usize,
    capture: Option<Arc<dyn ReturnedHandoff>>,
    /// Scans run (tests count them).
    #[cfg(test)]
    scans: usize,
}

impl Scrubber {
    /// Give the answer's first `kv_transfer_params` value (not `null`) to `to` before
    /// it is blanked. Nothing more is held for it: the value is read where the
    /// scrubbing finds it whole (or where the answer ends inside it).
    pub(crate) fn capture(&mut self, to: Arc<dyn ReturnedHandoff>) {
        self.capture = Some(to);
    }

    /// How many bytes are held back.
    pub(crate) fn held(&self) -> usize {
        self.held.len()
    }

    /// A frame of the answer: the bytes to pass on now (maybe none).
    pub(crate) fn push(&mut self, data: Bytes) -> Result<Bytes, AnswerError> {
        let buf = if self.held.is_empty() {
            data
        } else {
            self.held.extend_from_slice(&data);
            let len = self.held.len();
            if len > RESCAN_FREELY && len < 2 * self.scanned && len <= MAX_HELD_HANDOFF {
                // A long handoff still coming in: scanned again once it doubled.
                return Ok(Bytes::new());
            }
            self.held.split().freeze()
        };
        let out = self.scan(buf, false);
        self.scanned = self.held.len();
        out
    }

    /// The answer ended: what was held, scrubbed.
    pub(crate) fn finish(&mut self) -> Result<Bytes, AnswerError> {
        if self.held.is_empty() {
            return Ok(Bytes::new());
        }
        let buf = self.held.split().freeze();
        self.scan(buf, true)
    }

    /// `buf`, its handoff values overwritten; what may start a key, or a handoff not
    /// whole yet, is held back unless `end`.
    fn scan(&mut self, buf: Bytes, end: bool) -> Result<Bytes, AnswerError> {
        #[cfg(test)]
        {
            self.scans += 1;
        }
        let mut edited: Option<BytesMut> = None;
        let mut pos = 0;
        let mut cut = buf.len();
        let finder = &*FINDER;
        while let Some(at) = finder.find(&buf[pos..]).map(|i| i + pos) {
            // What vLLM writes on every chunk of a stream, seen at once.
            if buf[at.saturating_sub(4)..].starts_with(NULL_HANDOFF) {
                pos = at - 4 + NULL_HANDOFF.len();
                continue;
            }
            match next_hit(&buf, at, end)? {
                Hit::Skip(next) => pos = next,
                Hit::Value(start, stop, kv) => {
                    if kv && let Some(to) = self.capture.take() {
                        to.returned(&buf[start..stop]);
                    }
                    let copy = edited.get_or_insert_with(|| BytesMut::from(&buf[..]));
                    overwrite(&mut copy[start..stop]);
                    pos = stop;
                }
                Hit::Incomplete(from) => {
                    cut = from;
                    break;
                }
            }
        }
        if end {
            if cut < buf.len() {
                // The answer ended inside a handoff: none of it goes out.
                let copy = edited.get_or_insert_with(|| BytesMut::from(&buf[..]));
                copy[cut..].fill(b' ');
            }
            cut = buf.len();
        } else if cut == buf.len() {
            cut -= key_start_at_end(&buf);
        }
        if buf.len() - cut > MAX_HELD_HANDOFF {
            return Err(AnswerError::TooLarge {
                limit: MAX_HELD_HANDOFF,
            });
        }
        self.held.extend_from_slice(&buf[cut..]);
        Ok(match edited {
            Some(copy) => copy.freeze().slice(..cut),
            None => buf.slice(..cut),
        })
    }
}

/// The value bytes `v` overwritten: `null` and spaces, or for a value shorter than
/// `null` another empty one of its length.
fn overwrite(v: &mut [u8]) {
    let fill: &[u8] = match v.len() {
        0 => b"",
        1 => b"0",
        2 | 3 => b"{}",
        _ => b"null",
    };
    v[..fill.len()].copy_from_slice(fill);
    v[fill.len()..].fill(b' ');
}

/// How many bytes at the end of `b` may be the start of a quoted key (a proper prefix
/// of one), to be held back for the next frame.
fn key_start_at_end(b: &[u8]) -> usize {
    // Most frames end with `\n` or `}`: nothing to look for.
    match b.last() {
        Some(c) if c.is_ascii_alphabetic() || *c == b'_' || *c == b'"' => {}
        _ => return 0,
    }
    let mut longest = 0;
    for (key, _) in QUOTED {
        for len in (longest + 1..key.len()).rev() {
            if b.ends_with(&key[..len]) {
                longest = len;
                break;
            }
        }
    }
    longest
}

/// What the [`NEEDLE`] at `at` in `buf` is (or why it is none); `end`: no more bytes
/// will follow `buf`.
fn next_hit(buf: &[u8], at: usize, end: bool) -> Result<Hit, AnswerError> {
    // The key the needle is part of: its start and end, if it is one.
    let mut key = None;
    for (i, (quoted, offset)) in QUOTED.into_iter().enumerate() {
        let Some(start) = at.checked_sub(offset) else {
            continue;
        };
        let tail = &buf[start..];
        if tail.starts_with(quoted) {
            key = Some((start, start + quoted.len(), i == 0));
            break;
        }
        if !end && quoted.starts_with(tail) {
            return Ok(Hit::Incomplete(start));
        }
    }
    let Some((key_start, key_end, kv)) = key else {
        return Ok(Hit::Skip(at + 1));
    };
    let more = |at: usize| {
        if end {
            Hit::Skip(at)
        } else {
            Hit::Incomplete(key_start)
        }
    };
    let colon = skip_ws(buf, key_end);
    match buf.get(colon) {
        None => return Ok(more(buf.len())),
        Some(b':') => {}
        // A string that only looks like a key (`["kv_transfer_params"]`).
        Some(_) => return Ok(Hit::Skip(key_end)),
    }
    let v = skip_ws(buf, colon + 1);
    let value = &buf[v..];
    if value.starts_with(b"null") {
        return Ok(Hit::Skip(v + 4));
    }
    if value.len() < 4 && b"null".starts_with(value) {
        return Ok(more(buf.len()));
    }
    let mut values =
        serde_json::Deserializer::from_slice(value).into_iter::<serde::de::IgnoredAny>();
    match values.next() {
        // A value that ends with the buffer may go on (a number) unless nothing follows.
        Some(Ok(_)) if v + values.byte_offset() == buf.len() && !end => {
            Ok(Hit::Incomplete(key_start))
        }
        Some(Ok(_)) => Ok(Hit::Value(v, v + values.byte_offset(), kv)),
        Some(Err(e)) if e.is_eof() => Ok(if end {
            Hit::Value(v, buf.len(), kv)
        } else {
            Hit::Incomplete(key_start)
        }),
        None => Ok(more(buf.len())),
        Some(Err(_)) => Err(AnswerError::Unreadable),
    }
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while b.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run `frames` through a scrubber: the bytes passed on after each, then at the end.
    fn run(frames: &[&[u8]]) -> Result<Vec<Vec<u8>>, AnswerError> {
        let mut s = Scrubber::default();
        let mut out = Vec::new();
        for f in frames {
            out.push(s.push(Bytes::copy_from_slice(f))?.to_vec());
        }
        out.push(s.finish()?.to_vec());
        Ok(out)
    }

    fn joined(frames: &[&[u8]]) -> String {
        String::from_utf8(run(frames).unwrap().concat()).unwrap()
    }

    /// `text` with the value after each of `keys` overwritten as the scrubber does.
    fn blanked(text: &str, values: &[&str]) -> String {
        let mut out = text.to_owned();
        for v in values {
            let mut b = v.as_bytes().to_vec();
            overwrite(&mut b);
            out = out.replacen(v, std::str::from_utf8(&b).unwrap(), 1);
        }
        out
    }

    const CHUNK: &str = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":null}],\"kv_transfer_params\":null}\n\n";
    const HANDOFF: &str = r#"{"do_remote_decode":true,"remote_host":"10.0.0.7","remote_port":5600,"remote_block_ids":[1,2]}"#;

    fn last_chunk() -> String {
        format!(
            "data: {{\"id\":\"c\",\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":\"length\"}}],\"kv_transfer_params\":{HANDOFF}}}\n\n"
        )
    }

    #[test]
    fn every_key_holds_the_needle_where_it_is_said_to() {
        for (key, offset) in QUOTED {
            assert_eq!(memmem::find(key, NEEDLE), Some(offset));
            let name = std::str::from_utf8(&key[1..key.len() - 1]).unwrap();
            assert!(HANDOFF_KEYS.contains(&name), "{name}");
        }
        assert_eq!(QUOTED.len(), HANDOFF_KEYS.len());
    }

    #[test]
    fn frames_without_a_handoff_pass_as_they_came() {
        let mut s = Scrubber::default();
        let chunk = Bytes::from_static(CHUNK.as_bytes());
        let out = s.push(chunk.clone()).unwrap();
        // The same buffer: no copy, nothing held.
        assert_eq!(out.as_ptr(), chunk.as_ptr());
        assert_eq!(out.len(), chunk.len());
        assert!(s.held.is_empty());
    }

    #[test]
    fn a_handoff_value_is_overwritten_in_place_wherever_the_frames_cut() {
        let stream = format!("{CHUNK}{}data: [DONE]\n\n", last_chunk());
        let want = blanked(&stream, &[HANDOFF]);
        assert_eq!(want.len(), stream.len());
        assert!(!want.contains("10.0.0.7"));
        assert!(want.contains("\"kv_transfer_params\":null    "));
        let b = stream.as_bytes();
        for cut in 0..b.len() {
            assert_eq!(joined(&[&b[..cut], &b[cut..]]), want, "cut at {cut}");
        }
        // Three pieces, the key itself cut.
        let k = stream.rfind("_tra").unwrap();
        assert_eq!(joined(&[&b[..k], &b[k..k + 3], &b[k + 3..]]), want);
    }

    /// A long handoff trickled a few bytes per frame is scanned about linearly (every
    /// frame while it is short, then each time it doubled), and comes out as scrubbed
    /// as when it came whole; what follows it waits at most for the stream's end.
    #[test]
    fn a_long_handoff_trickled_in_is_not_scanned_again_per_frame() {
        let ids: Vec<String> = (0..40_000).map(|i| i.to_string()).collect();
        let value = format!(
            r#"{{"remote_host":"10.0.0.7","remote_block_ids":[{}]}}"#,
            ids.join(",")
        );
        assert!(value.len() > 200_000);
        let stream = format!(
            "{CHUNK}data: {{\"choices\":[],\"kv_transfer_params\":{value}}}\n\ndata: [DONE]\n\n"
        );
        let want = blanked(&stream, &[&value]);
        let b = stream.as_bytes();
        let mut s = Scrubber::default();
        let mut out = Vec::new();
        let frames = b.chunks(64);
        let count = frames.len();
        for f in frames {
            out.extend_from_slice(&s.push(Bytes::copy_from_slice(f)).unwrap());
        }
        out.extend_from_slice(&s.finish().unwrap());
        assert_eq!(String::from_utf8(out).unwrap(), want);
        // 16 KiB / 64 frames scanned one by one, then a doubling series: not one per frame.
        assert!(count > 3_000, "{count} frames");
        assert!(
            s.scans < 16 * 1024 / 64 + 40,
            "{} scans of {count} frames",
            s.scans
        );
        // A short one cut anywhere still goes out with the frame that completes it.
        let short = format!("{CHUNK}{}", last_chunk());
        let cut = short.rfind("remote_port").unwrap();
        let mut s = Scrubber::default();
        let first = s
            .push(Bytes::copy_from_slice(&short.as_bytes()[..cut]))
            .unwrap();
        let second = s
            .push(Bytes::copy_from_slice(&short.as_bytes()[cut..]))
            .unwrap();
        assert_eq!(
            String::from_utf8([first, second].concat()).unwrap(),
            blanked(&short, &[HANDOFF])
        );
    }

    #[test]
    fn every_handoff_key_and_value_kind_is_caught() {
        let body = r#"{"id":"x","response":{"ec_transfer_params":{"e":1},"status":"completed"},"bootstrap_host": "10.0.0.5","bootstrap_port":8998,"bootstrap_room":12345678901,"kv_transfer_params":[1]}"#;
        let want = blanked(
            body,
            &[r#"{"e":1}"#, r#""10.0.0.5""#, "8998", "12345678901", "[1]"],
        );
        for cut in 0..body.len() {
            let b = body.as_bytes();
            assert_eq!(joined(&[&b[..cut], &b[cut..]]), want, "cut at {cut}");
        }
        // Values shorter than `null` become an empty value of their length.
        assert_eq!(
            joined(&[br#"{"bootstrap_port":80}"#]),
            r#"{"bootstrap_port":{}}"#
        );
        assert_eq!(
            joined(&[br#"{"bootstrap_room":7}"#]),
            r#"{"bootstrap_room":0}"#
        );
    }

    #[test]
    fn null_handoffs_and_look_alikes_pass_untouched() {
        for b in [
            r#"{"kv_transfer_params":null,"ec_transfer_params" : null}"#,
            r#"["kv_transfer_params","bootstrap_host"]"#,
            r#"{"prompt":"\"kv_transfer_params\": {\"x\":1}"}"#,
            r#"{"my_transfer_params":{"a":1},"bootstrap_pair_key":"k","bootstrap_hostname":"h"}"#,
            "no JSON at all _transfer_params\" x",
        ] {
            assert_eq!(joined(&[b.as_bytes()]), b);
        }
    }

    #[test]
    fn what_cannot_be_scrubbed_fails_the_answer() {
        // A value still open past the limit (a whole one that long is overwritten).
        let big = format!(
            r#"{{"kv_transfer_params":"{}"#,
            "x".repeat(MAX_HELD_HANDOFF)
        );
        let b = big.as_bytes();
        let half = MAX_HELD_HANDOFF / 2;
        assert!(matches!(
            run(&[&b[..half], &b[half..]]),
            Err(AnswerError::TooLarge { .. })
        ));
        let whole = format!("{big}\"}}");
        let out = joined(&[&whole.as_bytes()[..half], &whole.as_bytes()[half..]]);
        assert!(out.starts_with(r#"{"kv_transfer_params":null  "#) && !out.contains('x'));
        assert!(matches!(
            run(&[br#"{"kv_transfer_params":nope}"#]),
            Err(AnswerError::Unreadable)
        ));
        // An answer that ends inside a handoff: none of it goes out.
        let cut = br#"{"a":1,"kv_transfer_params":{"remote_host":"10.0.0.7""#;
        let out = joined(&[cut]);
        assert_eq!(out.len(), cut.len());
        assert!(!out.contains("10.0.0.7"), "{out}");
    }

    /// What a [`ReturnedHandoff`] was given.
    #[derive(Debug, Default)]
    struct Kept(std::sync::Mutex<Vec<Vec<u8>>>);

    impl ReturnedHandoff for Kept {
        fn returned(&self, value: &[u8]) {
            self.0.lock().unwrap().push(value.to_vec());
        }
    }

    #[test]
    fn the_decodes_own_handoff_is_given_once_wherever_the_frames_cut() {
        let stream = format!(
            "{CHUNK}data: {{\"ec_transfer_params\":{{\"e\":1}}}}\n\n{}data: [DONE]\n\n",
            last_chunk()
        );
        let b = stream.as_bytes();
        for cut in 0..b.len() {
            let kept = Arc::new(Kept::default());
            let mut s = Scrubber::default();
            s.capture(kept.clone());
            let mut out = s.push(Bytes::copy_from_slice(&b[..cut])).unwrap().to_vec();
            out.extend_from_slice(&s.push(Bytes::copy_from_slice(&b[cut..])).unwrap());
            out.extend_from_slice(&s.finish().unwrap());
            // The client's answer is as without a receiver; the receiver got the
            // `kv_transfer_params` value (not `null`, not `ec_transfer_params`), once.
            assert_eq!(
                String::from_utf8(out).unwrap(),
                joined(&[b]),
                "cut at {cut}"
            );
            let got = kept.0.lock().unwrap();
            assert_eq!(*got, vec![HANDOFF.as_bytes().to_vec()], "cut at {cut}");
        }
        // An answer with two handoffs: only the first is given.
        let kept = Arc::new(Kept::default());
        let mut s = Scrubber::default();
        s.capture(kept.clone());
        let two = format!("{}{}", last_chunk(), last_chunk().replace("[1,2]", "[3]"));
        s.push(Bytes::from(two)).unwrap();
        s.finish().unwrap();
        assert_eq!(*kept.0.lock().unwrap(), vec![HANDOFF.as_bytes().to_vec()]);
    }
}
