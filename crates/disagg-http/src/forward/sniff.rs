//! Whether a forwarded body is a JSON object, told from its first bytes as they
//! arrive: the scan resumes where the last frame left it (its encoding, byte-order mark
//! and leading whitespace are state, not bytes read again), so a body of very many
//! small frames costs work in proportion to its length, not to its square.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use disagg_core::error::BoxError;
use futures::channel::oneshot;
use http_body::{Body, Frame, SizeHint};

use super::ClientBody;

/// Whether a body starting with `start` is a JSON object as the engines read bodies
/// (Python's `json.loads` of the bytes, which Starlette's `Request.json()` calls): the
/// encoding guessed as `json.detect_encoding` does (a UTF-8, -16 or -32 byte-order
/// mark, else where the first four bytes hold zeros), whitespace skipped, then `{`.
/// `None` when more bytes are needed to tell (`ended`: `start` is the whole body).
pub(super) fn json_object_start(start: &[u8], ended: bool) -> Option<bool> {
    let mut scan = ObjectStart::default();
    match scan.feed(start) {
        Some(object) => Some(object),
        None => ended.then(|| scan.finish()),
    }
}

/// The encoding of a body starting with `start` (its first four bytes, or the whole body
/// when `ended` and shorter), as `json.detect_encoding` guesses it: (bytes per code unit,
/// big-endian, byte-order mark's length).
fn encoding(start: &[u8], ended: bool) -> (usize, bool, usize) {
    match start {
        [0xFF, 0xFE, 0, 0, ..] => (4, false, 4),
        [0, 0, 0xFE, 0xFF, ..] => (4, true, 4),
        [0xFE, 0xFF, ..] => (2, true, 2),
        [0xFF, 0xFE, ..] => (2, false, 2),
        [0xEF, 0xBB, 0xBF, ..] => (1, false, 3),
        [0, b, ..] if start.len() >= 4 => (if *b != 0 { 2 } else { 4 }, true, 0),
        [_, 0, c, d, ..] => (if *c != 0 || *d != 0 { 2 } else { 4 }, false, 0),
        [0, _] if ended => (2, true, 0),
        [_, 0] if ended => (2, false, 0),
        _ => (1, false, 0),
    }
}

/// [`json_object_start`] fed a body piece by piece: each byte is looked at once.
#[derive(Debug, Default)]
pub(super) struct ObjectStart {
    /// The body's first bytes, until there are four (its encoding is told by them).
    head: [u8; 4],
    head_len: usize,
    /// (bytes per code unit, big-endian), once known.
    encoding: Option<(usize, bool)>,
    /// Bytes of the byte-order mark still to skip.
    skip: usize,
    /// The code unit being read, and how many of its bytes came.
    unit: [u8; 4],
    unit_len: usize,
    /// Told: a JSON object or not.
    verdict: Option<bool>,
}

impl ObjectStart {
    /// Whether the body is a JSON object, after `data`, its next bytes: `None` while
    /// they cannot tell yet.
    pub(super) fn feed(&mut self, mut data: &[u8]) -> Option<bool> {
        if self.verdict.is_some() {
            return self.verdict;
        }
        if self.encoding.is_none() {
            let take = (self.head.len() - self.head_len).min(data.len());
            self.head[self.head_len..self.head_len + take].copy_from_slice(&data[..take]);
            self.head_len += take;
            data = &data[take..];
            if self.head_len < self.head.len() {
                return None;
            }
            self.start(false);
            if self.verdict.is_some() {
                return self.verdict;
            }
        }
        self.units(data);
        self.verdict
    }

    /// Whether the body, now whole, is a JSON object.
    pub(super) fn finish(&mut self) -> bool {
        if self.verdict.is_none() && self.encoding.is_none() {
            // Fewer than four bytes in all: told by what there is.
            self.start(true);
        }
        // A code unit left unfinished is no `{`.
        self.verdict.unwrap_or(false)
    }

    /// The encoding told by the head (the whole body when `ended`), then the head's
    /// code units read.
    fn start(&mut self, ended: bool) {
        let head = self.head;
        let head = &head[..self.head_len];
        let (width, big, bom) = encoding(head, ended);
        self.encoding = Some((width, big));
        self.skip = bom;
        self.units(head);
    }

    /// Read `data`'s code units (the encoding is known) until one tells.
    fn units(&mut self, data: &[u8]) {
        let Some((width, big)) = self.encoding else {
            return;
        };
        let skipped = self.skip.min(data.len());
        self.skip -= skipped;
        for &b in &data[skipped..] {
            self.unit[self.unit_len] = b;
            self.unit_len += 1;
            if self.unit_len < width {
                continue;
            }
            self.unit_len = 0;
            let unit = &self.unit[..width];
            let push = |acc: u32, b: &u8| acc << 8 | u32::from(*b);
            let c = if big {
                unit.iter().fold(0, push)
            } else {
                unit.iter().rev().fold(0, push)
            };
            match c {
                0x20 | 0x09 | 0x0A | 0x0D => {}
                0x7B => {
                    self.verdict = Some(true);
                    return;
                }
                _ => {
                    self.verdict = Some(false);
                    return;
                }
            }
        }
    }
}

/// What [`Sniff`] hands back once it stops: the client's body, the rest of it unread,
/// and whether it is a JSON object.
pub(super) type Sniffed = (ClientBody, bool);

/// A client's body read until its first bytes tell whether it is a JSON object, then
/// ended (a body that ends sooner ends there): read by
/// [`body::read`](crate::body::read), whose budget, limits and buffer then hold the
/// bytes it passed on, as for an orchestrated body. When it stops it hands the client's
/// body back on `back`, with what it told.
pub(super) struct Sniff {
    body: Option<ClientBody>,
    scan: ObjectStart,
    back: Option<oneshot::Sender<Sniffed>>,
}

impl Sniff {
    pub(super) fn new(body: ClientBody) -> (Sniff, oneshot::Receiver<Sniffed>) {
        let (tx, rx) = oneshot::channel();
        let sniff = Sniff {
            body: Some(body),
            scan: ObjectStart::default(),
            back: Some(tx),
        };
        (sniff, rx)
    }

    /// Stop: the client's body goes back, with what its first bytes told.
    fn hand_back(&mut self) {
        if let (Some(body), Some(tx)) = (self.body.take(), self.back.take()) {
            let object = self.scan.finish();
            // The receiver is gone only when the forwarding was dropped.
            let _ = tx.send((body, object));
        }
    }
}

impl Body for Sniff {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.scan.verdict.is_some() {
            this.hand_back();
        }
        let Some(body) = this.body.as_mut() else {
            return Poll::Ready(None);
        };
        match ready!(Pin::new(body).poll_frame(cx)) {
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    this.scan.feed(data);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Some(Err(e)) => Poll::Ready(Some(Err(e))),
            None => {
                this.hand_back();
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_none()
    }

    /// The body's least length only (a body larger than the limit is refused before it
    /// is read): the first bytes are all that is read here, so a declared length is not
    /// taken from the budget (the whole read takes it, when the body is read whole).
    fn size_hint(&self) -> SizeHint {
        let mut hint = SizeHint::new();
        if let Some(body) = &self.body {
            hint.set_lower(body.size_hint().lower());
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `s` in UTF-16 or -32, either byte order, with or without a byte-order mark.
    fn encode(s: &str, width: usize, big: bool, bom: bool) -> Vec<u8> {
        let mut out = Vec::new();
        let mut put = |c: u32| {
            let bytes = c.to_be_bytes();
            let unit = &bytes[4 - width..];
            if big {
                out.extend_from_slice(unit);
            } else {
                out.extend(unit.iter().rev());
            }
        };
        if bom {
            put(0xFEFF);
        }
        for c in s.chars() {
            put(u32::from(c));
        }
        out
    }

    /// What `body` fed in pieces of `size` bytes tells, whole.
    fn in_pieces(body: &[u8], size: usize) -> bool {
        let mut scan = ObjectStart::default();
        for piece in body.chunks(size) {
            if let Some(object) = scan.feed(piece) {
                return object;
            }
        }
        scan.finish()
    }

    #[test]
    fn a_json_object_is_told_in_every_encoding_pythons_json_reads() {
        for text in ["{\"a\":1}", " \r\n\t{}"] {
            assert_eq!(
                json_object_start(text.as_bytes(), true),
                Some(true),
                "{text:?}"
            );
            let bom = [&[0xEF, 0xBB, 0xBF][..], text.as_bytes()].concat();
            assert_eq!(json_object_start(&bom, true), Some(true), "{text:?}");
            for width in [2, 4] {
                for big in [true, false] {
                    for with_bom in [true, false] {
                        let b = encode(text, width, big, with_bom);
                        assert_eq!(
                            json_object_start(&b, true),
                            Some(true),
                            "{text:?} {width} {big} {with_bom}"
                        );
                    }
                }
            }
        }
        for text in ["[{}]", "--x\r\n", "", "   ", "\"{\""] {
            assert_eq!(
                json_object_start(text.as_bytes(), true),
                Some(false),
                "{text:?}"
            );
            let b = encode(text, 2, false, true);
            assert_eq!(json_object_start(&b, true), Some(false), "{text:?}");
        }
        // A two-byte body is UTF-16 when it holds a zero, as Python guesses.
        assert_eq!(json_object_start(b"{\0", true), Some(true));
        assert_eq!(json_object_start(b"\0{", true), Some(true));
    }

    #[test]
    fn a_start_too_short_to_tell_waits_for_more() {
        assert_eq!(json_object_start(b"", false), None);
        assert_eq!(json_object_start(b"{\0", false), None);
        assert_eq!(json_object_start(b"\xFF\xFE", false), None);
        assert_eq!(json_object_start(b"    ", false), None);
        assert_eq!(json_object_start(b"    {", false), Some(true));
        assert_eq!(json_object_start(b"  x", true), Some(false));
    }

    #[test]
    fn a_body_in_pieces_is_told_as_it_is_whole() {
        let mut bodies: Vec<Vec<u8>> = Vec::new();
        for text in [
            "{\"a\":1}",
            " \r\n\t{}",
            "[{}]",
            "--x\r\n",
            "",
            "   ",
            "\"{\"",
            "  x",
            "{",
            "{\0",
            "\0{",
            " ",
        ] {
            bodies.push(text.as_bytes().to_vec());
            bodies.push([&[0xEF, 0xBB, 0xBF][..], text.as_bytes()].concat());
            for width in [2, 4] {
                for big in [true, false] {
                    for bom in [true, false] {
                        bodies.push(encode(text, width, big, bom));
                    }
                }
            }
        }
        // Half a code unit at the end.
        bodies.push(encode("  ", 2, false, true)[..5].to_vec());
        bodies.push(encode(" {", 4, true, false)[..7].to_vec());
        for body in &bodies {
            let whole = json_object_start(body, true);
            for size in 1..=9 {
                assert_eq!(Some(in_pieces(body, size)), whole, "{body:?} by {size}");
            }
        }
    }

    #[test]
    fn a_long_run_of_whitespace_fed_a_byte_at_a_time_is_read_once() {
        let mut scan = ObjectStart::default();
        for _ in 0..1_000_000 {
            assert_eq!(scan.feed(b" "), None);
        }
        assert_eq!(scan.feed(b"\t\r\n{"), Some(true));
        // Told: later bytes change nothing.
        assert_eq!(scan.feed(b"x"), Some(true));
        assert!(scan.finish());
    }
}
