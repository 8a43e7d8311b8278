//! The `max_model_len` of a `/tokenize` answer, read alongside its ids
//! ([`request_answer`](super::request_answer)).

use std::fmt;

use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// A `/tokenize` answer as [`request_answer`](super::request_answer) reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TokenizeAnswer {
    /// The token ids.
    pub ids: Vec<u32>,
    /// The engine's context length (`max_model_len`): `None` when the answer has none,
    /// or one that is not a positive integer (`null`, `0`, a string, a float).
    pub max_model_len: Option<u64>,
}

/// A `max_model_len` value: a positive integer, else `None` (the value skipped
/// unbuilt, whatever it is).
pub(super) struct MaxLen(pub(super) Option<u64>);

impl<'de> Deserialize<'de> for MaxLen {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<MaxLen, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MaxLen;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a context length")
            }
            fn visit_u64<E>(self, n: u64) -> Result<MaxLen, E> {
                Ok(MaxLen(Some(n).filter(|n| *n > 0)))
            }
            fn visit_i64<E>(self, n: i64) -> Result<MaxLen, E> {
                Ok(MaxLen(u64::try_from(n).ok().filter(|n| *n > 0)))
            }
            fn visit_f64<E>(self, _: f64) -> Result<MaxLen, E> {
                Ok(MaxLen(None))
            }
            fn visit_bool<E>(self, _: bool) -> Result<MaxLen, E> {
                Ok(MaxLen(None))
            }
            fn visit_str<E>(self, _: &str) -> Result<MaxLen, E> {
                Ok(MaxLen(None))
            }
            fn visit_unit<E>(self) -> Result<MaxLen, E> {
                Ok(MaxLen(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<MaxLen, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(MaxLen(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<MaxLen, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(MaxLen(None))
            }
        }
        d.deserialize_any(V)
    }
}
