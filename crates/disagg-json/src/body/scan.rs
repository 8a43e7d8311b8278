//! The fast path of [`JsonBody::parse_bytes`](super::JsonBody::parse_bytes): one pass
//! over a JSON object that validates it as `serde_json` does and returns where each
//! top-level key and value is, stepping over long strings 64 bytes at a time.
//!
//! A prompt is almost all one string. `serde_json` reads a string 8 bytes at a time and
//! then checks each value's bytes as UTF-8 in a second pass; this scan classifies 64
//! bytes at once (a loop the compiler turns into vector compares: quote, backslash,
//! control byte, non-ASCII) and checks UTF-8 only for the runs that hold non-ASCII
//! bytes, so the bytes of an ASCII prompt are read once.
//!
//! It accepts no more than `serde_json` does (`from_slice`, the top level read as a map
//! of borrowed keys and [`RawValue`](serde_json::value::RawValue)s, then `end`):
//! the same grammar, whitespace, escapes, control bytes refused in strings, UTF-8
//! everywhere, a top-level key's escapes decoded by `serde_json` itself. Where it is
//! unsure it gives up (`None`), and the caller runs `serde_json`, which then either
//! accepts the body or says precisely what is wrong: the errors are serde's, always.

use super::Key;

/// The most nesting levels the scan follows inside one value; deeper bodies (which
/// `serde_json` accepts: it does not bound the depth of values it skips) are left to
/// `serde_json`.
const MAX_DEPTH: usize = 256;

/// `(key, start, end)` of each top-level field of the JSON object `b`, in order, the
/// offsets into `b`; `None` when `b` is not a well-formed object or the scan is unsure
/// (see the module docs).
pub(super) fn object_fields(b: &[u8]) -> Option<Vec<(Key, usize, usize)>> {
    let mut s = Scan { b, i: 0 };
    s.ws();
    s.eat(b'{')?;
    let mut out = Vec::with_capacity(16);
    s.ws();
    if s.peek() == Some(b'}') {
        s.i += 1;
    } else {
        loop {
            if s.peek()? != b'"' {
                return None;
            }
            let start = s.i;
            let escaped = s.string()?;
            let key = if escaped {
                // serde reads a top-level key as a `str` (lone surrogates refused).
                Key::Owned(serde_json::from_slice::<String>(&b[start..s.i]).ok()?)
            } else {
                Key::Span(start + 1, s.i - 1)
            };
            s.ws();
            s.eat(b':')?;
            s.ws();
            let value = s.i;
            s.value()?;
            if out.len() > super::MAX_FIELDS {
                // Too many to keep: serde reads the rest and the caller refuses it.
                return None;
            }
            out.push((key, value, s.i));
            s.ws();
            match s.next()? {
                b',' => s.ws(),
                b'}' => break,
                _ => return None,
            }
        }
    }
    s.ws();
    (s.i == b.len()).then_some(out)
}

/// A position in the input.
struct Scan<'a> {
    b: &'a [u8],
    i: usize,
}

/// What a block of `N` bytes holds: whether any byte ends a plain run (a quote, a
/// backslash or a control byte), and whether any is non-ASCII. Written without early
/// exits and with the two answers kept as booleans, so that it compiles to vector
/// compares ORed lane by lane, each reduced once at the end (one `pmovmskb` and test
/// each): on x86-64's baseline SSE2 about 50 instructions for 64 bytes, where a
/// 32-byte block took about as many.
#[inline(always)]
fn classify<const N: usize>(block: &[u8; N]) -> (bool, bool) {
    let mut stop = false;
    let mut high = false;
    for &c in block {
        stop |= (c == b'"') | (c == b'\\') | (c < 0x20);
        high |= c >= 0x80;
    }
    (stop, high)
}

/// Whether `c` ends a plain run of a string (the rule `classify` applies to a block).
#[inline(always)]
fn stops_string(c: u8) -> bool {
    c == b'"' || c == b'\\' || c < 0x20
}

impl Scan<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.next()? == c).then_some(())
    }

    /// Skip JSON whitespace (serde's four bytes, not form feed).
    fn ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\t' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    /// Step over the string at `b[i] == b'"'`; whether it held an escape.
    fn string(&mut self) -> Option<bool> {
        let b = self.b;
        let mut j = self.i + 1;
        // Where the current run of unescaped bytes started, and whether it may hold
        // non-ASCII bytes (checked as UTF-8 when the run ends).
        let mut run = j;
        let mut high = false;
        let mut escaped = false;
        loop {
            // Keys and many values end within a few bytes: the first 8 are stepped one
            // at a time, and a block is classified only past them (a classification
            // costs about as much as 10 bytes stepped; 8 beat 16 and none by 0.1-0.3%
            // of a 256-byte request's instructions).
            let near = b.len().min(j + 8);
            while j < near && !stops_string(b[j]) {
                high |= b[j] >= 0x80;
                j += 1;
            }
            if j == near {
                while let Some(block) = b.get(j..j + 64) {
                    let block: &[u8; 64] = block.try_into().ok()?;
                    let (stop, hi) = classify(block);
                    high |= hi;
                    if stop {
                        break;
                    }
                    j += 64;
                }
                // The stop byte is in the next 64 (or fewer are left): past the first
                // half of them at once when it holds none, so that what is left to step
                // through one byte at a time is under 32, as with blocks of 32.
                if let Some(half) = b.get(j..j + 32) {
                    let half: &[u8; 32] = half.try_into().ok()?;
                    let (stop, hi) = classify(half);
                    if !stop {
                        high |= hi;
                        j += 32;
                    }
                }
            }
            // Up to the stop byte (or the input's last bytes), one at a time, the block
            // not classified again for each.
            let c = loop {
                let c = *b.get(j)?;
                if stops_string(c) {
                    break c;
                }
                high |= c >= 0x80;
                j += 1;
            };
            match c {
                b'"' => {
                    if high {
                        std::str::from_utf8(&b[run..j]).ok()?;
                    }
                    self.i = j + 1;
                    return Some(escaped);
                }
                b'\\' => {
                    if high {
                        std::str::from_utf8(&b[run..j]).ok()?;
                    }
                    escaped = true;
                    j = match *b.get(j + 1)? {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => j + 2,
                        b'u' => {
                            let hex = b.get(j + 2..j + 6)?;
                            if !hex.iter().all(u8::is_ascii_hexdigit) {
                                return None;
                            }
                            j + 6
                        }
                        _ => return None,
                    };
                    run = j;
                    high = false;
                }
                _ => return None,
            }
        }
    }

    /// Step over the number at `b[i]`.
    fn number(&mut self) -> Option<()> {
        let b = self.b;
        let digits = |i: &mut usize| {
            let start = *i;
            while let Some(b'0'..=b'9') = b.get(*i) {
                *i += 1;
            }
            *i > start
        };
        let mut i = self.i;
        if b.get(i) == Some(&b'-') {
            i += 1;
        }
        match b.get(i)? {
            b'0' => {
                i += 1;
                if let Some(b'0'..=b'9') = b.get(i) {
                    return None;
                }
            }
            b'1'..=b'9' => {
                digits(&mut i);
            }
            _ => return None,
        }
        if b.get(i) == Some(&b'.') {
            i += 1;
            if !digits(&mut i) {
                return None;
            }
        }
        if let Some(b'e' | b'E') = b.get(i) {
            i += 1;
            if let Some(b'+' | b'-') = b.get(i) {
                i += 1;
            }
            if !digits(&mut i) {
                return None;
            }
        }
        self.i = i;
        Some(())
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        if self.b.get(self.i..self.i + word.len())? != word {
            return None;
        }
        self.i += word.len();
        Some(())
    }

    /// Step over an object's key and its colon, from the key's quote on.
    fn member_key(&mut self) -> Option<()> {
        if self.peek()? != b'"' {
            return None;
        }
        self.string()?;
        self.ws();
        self.eat(b':')?;
        self.ws();
        Some(())
    }

    /// Step over the value at `b[i]` (no whitespace before it), nested ones included,
    /// without recursion: the open containers are a bit stack (set: object).
    fn value(&mut self) -> Option<()> {
        let mut stack = [0u64; MAX_DEPTH / 64];
        let mut depth = 0usize;
        loop {
            // A value starts here.
            match self.peek()? {
                b'"' => {
                    self.string()?;
                }
                b'{' | b'[' => {
                    let object = self.next()? == b'{';
                    if depth == MAX_DEPTH {
                        return None;
                    }
                    let (word, bit) = (depth / 64, 1u64 << (depth % 64));
                    if object {
                        stack[word] |= bit;
                    } else {
                        stack[word] &= !bit;
                    }
                    depth += 1;
                    self.ws();
                    let close = if object { b'}' } else { b']' };
                    if self.peek()? != close {
                        if object {
                            self.member_key()?;
                        }
                        continue;
                    }
                    self.i += 1;
                    depth -= 1;
                }
                b't' => self.literal(b"true")?,
                b'f' => self.literal(b"false")?,
                b'n' => self.literal(b"null")?,
                b'-' | b'0'..=b'9' => self.number()?,
                _ => return None,
            }
            // A value ended: close containers until one goes on with another value.
            loop {
                if depth == 0 {
                    return Some(());
                }
                let top = depth - 1;
                let object = stack[top / 64] & (1u64 << (top % 64)) != 0;
                self.ws();
                match self.next()? {
                    b',' => {
                        self.ws();
                        if object {
                            self.member_key()?;
                        }
                        break;
                    }
                    b'}' if object => depth -= 1,
                    b']' if !object => depth -= 1,
                    _ => return None,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
