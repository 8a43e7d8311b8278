//! Walking a client's JSON without building it.
//!
//! A request body may be tens of megabytes. Built as `serde_json::Value`, its lists
//! and objects cost many times their size in memory (16 bytes per `0,` of a list of
//! numbers, over 600 per `{"":0},` of a list of objects), so the fields the prompt
//! reader looks into are read by visitors that keep only what the answer needs.
//!
//! [`Skip`] parses a value as `Value` would (the same numbers out of range, strings
//! with lone surrogates and nesting deeper than serde_json's limit are errors) and
//! keeps nothing: unlike [`serde::de::IgnoredAny`], which serde_json skips over
//! without those checks, it refuses exactly what building a `Value` refuses.

use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

/// Any JSON value, parsed and checked as `serde_json::Value` parses it, and dropped.
pub(crate) struct Skip;

impl<'de> Deserialize<'de> for Skip {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Skip, D::Error> {
        d.deserialize_any(SkipVisitor)
    }
}

struct SkipVisitor;

impl<'de> Visitor<'de> for SkipVisitor {
    type Value = Skip;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_str<E>(self, _: &str) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_unit<E>(self) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Skip, A::Error> {
        skip_seq(seq).map(|()| Skip)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Skip, A::Error> {
        skip_map(map).map(|()| Skip)
    }
}

/// The rest of a list, each element parsed as [`Skip`] parses it.
pub(crate) fn skip_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<Skip>()?.is_some() {}
    Ok(())
}

/// The rest of an object, each key and value parsed as [`Skip`] parses them.
pub(crate) fn skip_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_key::<Skip>()?.is_some() {
        map.next_value::<Skip>()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    /// `Skip` accepts and refuses exactly what building a `Value` does.
    #[test]
    fn skip_refuses_what_value_refuses() {
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        for json in [
            "0".to_owned(),
            "-0".into(),
            "1e400".into(),
            "[1,2e999]".into(),
            r#"{"a":[1,{"b":"\ud800"}]}"#.into(),
            r#""\ud83d\ude00""#.into(),
            r#"{"a":1,"a":2}"#.into(),
            "18446744073709551616".into(),
            deep(128),
            deep(129),
            format!(r#"{{"a":{}}}"#, deep(127)),
            format!(r#"{{"a":{}}}"#, deep(128)),
        ] {
            assert_eq!(
                serde_json::from_str::<Skip>(&json).is_ok(),
                serde_json::from_str::<Value>(&json).is_ok(),
                "{json}"
            );
        }
        assert!(serde_json::from_str::<Skip>(&deep(129)).is_err());
        assert!(serde_json::from_str::<Skip>("1e400").is_err());
    }
}
