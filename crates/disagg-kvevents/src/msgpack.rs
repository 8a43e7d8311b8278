//! A bounded msgpack reader over one payload: what the event and load decoders walk,
//! reading into typed values directly instead of a tree of dynamic ones.
//!
//! Every length a payload announces (an array's items, a map's entries, a string's or a
//! binary's bytes) is checked against the bytes left before anything is read or
//! allocated: each item takes at least one byte, so a 4-byte header claiming 2^32
//! items in a 24-byte payload is refused at once. Skipping a value (an unknown field,
//! an `extra_keys` entry) walks it iteratively, with a count of the values still to
//! skip, so nesting depth costs neither stack nor memory.

use crate::event::DecodeError;

/// One msgpack integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Int {
    /// Zero or above (whatever its encoding).
    Pos(u64),
    /// Below zero.
    Neg(i64),
}

impl Int {
    /// The value if it is not negative.
    pub(crate) fn as_u64(self) -> Option<u64> {
        match self {
            Int::Pos(v) => Some(v),
            Int::Neg(_) => None,
        }
    }

    /// Its 64 bits, a negative value in two's complement.
    pub(crate) fn bits(self) -> u64 {
        match self {
            Int::Pos(v) => v,
            Int::Neg(v) => v as u64,
        }
    }

    /// As a float (as rmpv's `Integer::as_f64`).
    pub(crate) fn as_f64(self) -> f64 {
        match self {
            Int::Pos(v) => v as f64,
            Int::Neg(v) => v as f64,
        }
    }
}

/// A cursor over a msgpack payload.
#[derive(Debug, Clone)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

fn truncated() -> DecodeError {
    DecodeError::Msgpack("truncated or invalid msgpack".into())
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    /// Where the cursor is.
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    /// Moves the cursor to `pos` (one read before).
    pub(crate) fn seek(&mut self, pos: usize) {
        self.pos = pos.min(self.buf.len());
    }

    fn left(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn peek(&self) -> Result<u8, DecodeError> {
        self.buf.get(self.pos).copied().ok_or_else(truncated)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).ok_or_else(truncated)?;
        let bytes = self.buf.get(self.pos..end).ok_or_else(truncated)?;
        self.pos = end;
        Ok(bytes)
    }

    fn be(&mut self, n: usize) -> Result<u64, DecodeError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    /// A length read as `n` big-endian bytes, each of its items taking at least
    /// `min_item` bytes of what is left.
    fn len(&mut self, n: usize, min_item: usize) -> Result<usize, DecodeError> {
        let len = usize::try_from(self.be(n)?).map_err(|_| truncated())?;
        self.check_len(len, min_item)
    }

    fn check_len(&self, len: usize, min_item: usize) -> Result<usize, DecodeError> {
        match len.checked_mul(min_item) {
            Some(bytes) if bytes <= self.left() => Ok(len),
            _ => Err(truncated()),
        }
    }

    /// Consumes a nil; whether there was one.
    pub(crate) fn nil(&mut self) -> Result<bool, DecodeError> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// An array's length, if the next value is an array (consumed: its items follow);
    /// else `None`, nothing consumed.
    pub(crate) fn array(&mut self) -> Result<Option<usize>, DecodeError> {
        let m = self.peek()?;
        let len = match m {
            0x90..=0x9f => {
                self.pos += 1;
                self.check_len(usize::from(m & 0x0f), 1)?
            }
            0xdc => {
                self.pos += 1;
                self.len(2, 1)?
            }
            0xdd => {
                self.pos += 1;
                self.len(4, 1)?
            }
            _ => return Ok(None),
        };
        Ok(Some(len))
    }

    /// A map's entries, as [`array`](Self::array).
    pub(crate) fn map(&mut self) -> Result<Option<usize>, DecodeError> {
        let m = self.peek()?;
        let len = match m {
            0x80..=0x8f => {
                self.pos += 1;
                self.check_len(usize::from(m & 0x0f), 2)?
            }
            0xde => {
                self.pos += 1;
                self.len(2, 2)?
            }
            0xdf => {
                self.pos += 1;
                self.len(4, 2)?
            }
            _ => return Ok(None),
        };
        Ok(Some(len))
    }

    /// A string's bytes (UTF-8 not checked), if the next value is a string; else
    /// `None`, nothing consumed.
    pub(crate) fn str(&mut self) -> Result<Option<&'a [u8]>, DecodeError> {
        let m = self.peek()?;
        let len = match m {
            0xa0..=0xbf => {
                self.pos += 1;
                usize::from(m & 0x1f)
            }
            0xd9 => {
                self.pos += 1;
                self.len(1, 1)?
            }
            0xda => {
                self.pos += 1;
                self.len(2, 1)?
            }
            0xdb => {
                self.pos += 1;
                self.len(4, 1)?
            }
            _ => return Ok(None),
        };
        self.take(len).map(Some)
    }

    /// A binary's bytes, as [`str`](Self::str).
    pub(crate) fn bin(&mut self) -> Result<Option<&'a [u8]>, DecodeError> {
        let len = match self.peek()? {
            0xc4 => {
                self.pos += 1;
                self.len(1, 1)?
            }
            0xc5 => {
                self.pos += 1;
                self.len(2, 1)?
            }
            0xc6 => {
                self.pos += 1;
                self.len(4, 1)?
            }
            _ => return Ok(None),
        };
        self.take(len).map(Some)
    }

    /// An integer, as [`str`](Self::str).
    pub(crate) fn int(&mut self) -> Result<Option<Int>, DecodeError> {
        let m = self.peek()?;
        let int = match m {
            0x00..=0x7f => {
                self.pos += 1;
                Int::Pos(u64::from(m))
            }
            0xe0..=0xff => {
                self.pos += 1;
                Int::Neg(i64::from(m as i8))
            }
            0xcc..=0xcf => {
                self.pos += 1;
                Int::Pos(self.be(1 << (m - 0xcc))?)
            }
            0xd0..=0xd3 => {
                self.pos += 1;
                let n = 1usize << (m - 0xd0);
                let raw = self.be(n)?;
                // Sign-extend from n bytes.
                let shift = 64 - 8 * n as u32;
                let v = ((raw << shift) as i64) >> shift;
                if v < 0 {
                    Int::Neg(v)
                } else {
                    Int::Pos(v as u64)
                }
            }
            _ => return Ok(None),
        };
        Ok(Some(int))
    }

    /// A float (32 or 64 bits), as [`str`](Self::str).
    pub(crate) fn float(&mut self) -> Result<Option<f64>, DecodeError> {
        match self.peek()? {
            0xca => {
                self.pos += 1;
                let bits = self.be(4)? as u32;
                Ok(Some(f64::from(f32::from_bits(bits))))
            }
            0xcb => {
                self.pos += 1;
                Ok(Some(f64::from_bits(self.be(8)?)))
            }
            _ => Ok(None),
        }
    }

    /// Skips one whole value, however nested.
    pub(crate) fn skip(&mut self) -> Result<(), DecodeError> {
        let mut pending: usize = 1;
        while pending > 0 {
            pending -= 1;
            let m = self.peek()?;
            if let Some(n) = self.array()? {
                pending = pending.checked_add(n).ok_or_else(truncated)?;
                continue;
            }
            if let Some(n) = self.map()? {
                pending = pending
                    .checked_add(n.checked_mul(2).ok_or_else(truncated)?)
                    .ok_or_else(truncated)?;
                continue;
            }
            self.pos += 1;
            let payload = match m {
                0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => 0,
                0xa0..=0xbf => usize::from(m & 0x1f),
                0xcc | 0xd0 => 1,
                0xcd | 0xd1 => 2,
                0xce | 0xd2 | 0xca => 4,
                0xcf | 0xd3 | 0xcb => 8,
                0xd9 | 0xc4 => self.len(1, 1)?,
                0xda | 0xc5 => self.len(2, 1)?,
                0xdb | 0xc6 => self.len(4, 1)?,
                // fixext 1, 2, 4, 8, 16: a type byte and the data.
                0xd4 => 2,
                0xd5 => 3,
                0xd6 => 5,
                0xd7 => 9,
                0xd8 => 17,
                // ext 8, 16, 32: the length, a type byte, the data.
                0xc7 => self.len(1, 1)? + 1,
                0xc8 => self.len(2, 1)? + 1,
                0xc9 => self.len(4, 1)? + 1,
                // 0xc1 is never used.
                _ => return Err(truncated()),
            };
            self.take(payload)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rmpv::Value;

    use super::*;

    fn encode(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    #[test]
    fn integers_of_every_width() {
        for v in [
            0i64,
            1,
            127,
            128,
            255,
            256,
            65_535,
            65_536,
            -1,
            -32,
            -33,
            -128,
            -129,
            -40_000,
            i64::MIN,
            i64::MAX,
        ] {
            let bytes = encode(&Value::from(v));
            let got = Reader::new(&bytes).int().unwrap().unwrap();
            assert_eq!(got.bits(), v as u64, "{v}");
            assert_eq!(got.as_u64(), u64::try_from(v).ok(), "{v}");
        }
        let bytes = encode(&Value::from(u64::MAX));
        assert_eq!(Reader::new(&bytes).int().unwrap(), Some(Int::Pos(u64::MAX)));
    }

    #[test]
    fn lengths_beyond_the_payload_are_refused_before_reading() {
        // An array of 2^32 - 1 items in 5 bytes.
        assert!(
            Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff])
                .array()
                .is_err()
        );
        // A map of 65,535 entries in 3 bytes.
        assert!(Reader::new(&[0xde, 0xff, 0xff]).map().is_err());
        assert!(Reader::new(&[0xdb, 0, 0, 1, 0, b'x']).str().is_err());
        assert!(Reader::new(&[0xc6, 0xff, 0, 0, 0]).bin().is_err());
        assert!(Reader::new(&[0xc1]).skip().is_err());
    }

    #[test]
    fn skip_walks_deep_nesting_without_recursion() {
        let mut bytes = vec![0x91; 100_000];
        bytes.push(0xc0);
        bytes.push(0x07);
        let mut r = Reader::new(&bytes);
        r.skip().unwrap();
        assert_eq!(r.int().unwrap(), Some(Int::Pos(7)));
    }

    fn value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Nil),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            any::<f32>().prop_map(Value::from),
            ".{0,40}".prop_map(Value::from),
            proptest::collection::vec(any::<u8>(), 0..40).prop_map(Value::from),
            (any::<i8>(), proptest::collection::vec(any::<u8>(), 0..20))
                .prop_map(|(t, d)| Value::Ext(t, d)),
        ];
        leaf.prop_recursive(4, 64, 8, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
                proptest::collection::vec((inner.clone(), inner), 0..8).prop_map(Value::Map),
            ]
        })
    }

    proptest! {
        #[test]
        fn skip_consumes_exactly_one_value(v in value(), tail in any::<u8>()) {
            let mut bytes = encode(&v);
            let len = bytes.len();
            bytes.push(tail);
            let mut r = Reader::new(&bytes);
            r.skip().unwrap();
            prop_assert_eq!(r.pos(), len);
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Reader::new(&bytes).skip();
        }
    }
}
