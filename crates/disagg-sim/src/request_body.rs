//! A request's body as the engine's routes read it: whole within
//! [`SimConfig::body_read_timeout`](crate::SimConfig::body_read_timeout), at most
//! [`MAX_BODY`] bytes, and its JSON built within [`JSON_BUDGET`] bytes of memory.
//!
//! A body over [`MAX_BODY`] is answered 413 in OpenAI's error shape (type
//! `PayloadTooLargeError`), with `connection: close`: at once when its
//! `content-length` says so, else once what arrived passes the ceiling. 413 is the
//! status FastAPI's own body ceiling (`max_body_size`) answers; vLLM sets none by
//! default, so a real engine reads a body of any size.
//!
//! `serde_json::Value` costs far more than the text it is parsed from: 32 bytes per
//! array element (16 per byte of `[0,0,...]`), and a B-tree node of some 630 bytes per
//! object (about 80 per byte of `[{"a":0},...]`). Unbounded, a 64 MiB body took a
//! gigabyte or more. The budget counts what the tree allocates as it is built (array
//! slots reserved before they are taken, string and key bytes, map nodes) and stops the
//! parse once past it, answering 413.

use std::cell::Cell;
use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

use crate::api::ApiError;
use crate::server::BoxError;

/// Largest request body read (a larger one is answered 413). Above the proxy's own
/// 32 MiB ceiling, which a handoff it adds may take a request past.
pub(crate) const MAX_BODY: usize = 64 << 20;

/// Most memory a body's parsed JSON may take (estimated as it is built).
///
/// Text costs about its length (a 32 MiB body of prompt text about 32 MiB), a token id
/// 32 bytes plus the array's spare room (two million ids about 100 MiB): any body the
/// proxy forwards that a served model could take fits. What it refuses is JSON built
/// to cost more than its bytes, each such body holding at most this much at once.
pub(crate) const JSON_BUDGET: usize = 256 << 20;

/// Reads `body` whole: 408 past `limit` (the client may be trickling it or have
/// stopped), 413 past [`MAX_BODY`] (before a byte of it is read when its declared
/// length is), 400 when the body fails.
pub(crate) async fn read<B>(body: B, limit: Duration) -> Result<Bytes, ApiError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    // hyper's hint is exact for a `content-length` body.
    if usize::try_from(body.size_hint().lower()).map_or(true, |n| n > MAX_BODY) {
        return Err(too_large());
    }
    match tokio::time::timeout(limit, Limited::new(body, MAX_BODY).collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.is::<LengthLimitError>() => Err(too_large()),
        Ok(Err(e)) => Err(ApiError::bad_request(format!(
            "cannot read the request body: {e}"
        ))),
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            format!("the request body did not arrive whole within {limit:?}"),
        )),
    }
}

/// The answer to a body over [`MAX_BODY`].
fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!(
            "the request body is larger than {} MiB, the most this engine reads",
            MAX_BODY >> 20
        ),
    )
}

/// Parses `bytes` as JSON within [`JSON_BUDGET`]: 400 if it is not JSON, 413 past
/// the budget.
pub(crate) fn json(bytes: &[u8]) -> Result<Value, ApiError> {
    parse(bytes, JSON_BUDGET).map_err(|e| match e {
        ParseError::Syntax(e) => ApiError::bad_request(format!("JSON decode error: {e}")),
        e @ ParseError::OverBudget { .. } => {
            ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, e.to_string())
        }
    })
}

/// Why a body is no `Value`.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ParseError {
    /// Not JSON (or a number no `Value` holds).
    #[error("{0}")]
    Syntax(serde_json::Error),
    /// Valid or not, building it would take more than `budget` bytes.
    #[error(
        "the request body's JSON would take more than {} MiB of memory to hold",
        budget >> 20
    )]
    OverBudget {
        /// The budget passed.
        budget: usize,
    },
}

/// Parses `bytes` as one JSON value, its tree costing at most `budget` bytes.
pub(crate) fn parse(bytes: &[u8], budget: usize) -> Result<Value, ParseError> {
    let left = Budget {
        left: Cell::new(budget),
        spent: Cell::new(false),
    };
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let parsed = Build(&left)
        .deserialize(&mut de)
        .and_then(|value| de.end().map(|()| value));
    match parsed {
        Ok(value) => Ok(value),
        Err(_) if left.spent.get() => Err(ParseError::OverBudget { budget }),
        Err(e) => Err(ParseError::Syntax(e)),
    }
}

/// An array slot, a map value: what a `Value` takes inline.
const SLOT: usize = size_of::<Value>();
/// A B-tree leaf of eleven keys and values (and its header), what a map allocates for
/// its first entry.
const MAP_NODE: usize = 11 * (size_of::<String>() + SLOT) + 16;
/// A map entry's share of further nodes (a node holds five entries at least).
const MAP_ENTRY: usize = MAP_NODE / 5;
/// An array's first reservation, in slots.
const FIRST_SLOTS: usize = 8;

/// What the tree being built may still take.
struct Budget {
    left: Cell<usize>,
    /// Set once a charge did not fit.
    spent: Cell<bool>,
}

impl Budget {
    fn charge<E: de::Error>(&self, bytes: usize) -> Result<(), E> {
        match self.left.get().checked_sub(bytes) {
            Some(left) => {
                self.left.set(left);
                Ok(())
            }
            None => {
                self.spent.set(true);
                Err(E::custom("over the JSON memory budget"))
            }
        }
    }
}

/// Builds a `Value` as `serde_json`'s own `Deserialize` does, charging the budget
/// before each allocation (a string's after, as it is at most the body's length).
#[derive(Clone, Copy)]
struct Build<'a>(&'a Budget);

impl<'de> DeserializeSeed<'de> for Build<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Build<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        self.0.charge(v.len())?;
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        self.0.charge(v.capacity())?;
        Ok(Value::String(v))
    }

    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        self.deserialize(deserializer)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(self)? {
            if items.len() == items.capacity() {
                // Grown by half, paid for before the allocation.
                let more = (items.capacity() / 2).max(FIRST_SLOTS);
                self.0.charge(more.saturating_mul(SLOT))?;
                items.reserve_exact(more);
            }
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut members = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let node = if members.is_empty() { MAP_NODE } else { 0 };
            self.0.charge(key.capacity() + MAP_ENTRY + node)?;
            let value = map.next_value_seed(self)?;
            members.insert(key, value);
        }
        Ok(Value::Object(members))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same `Value` as `serde_json` builds, for every kind of value.
    #[test]
    fn builds_what_serde_json_builds() {
        let text = r#"{"a":[1,-2,3.5,1e300,true,false,null,"s\u00e9\n",{"b":{}},[]],
            "a":"dup, last wins","c":18446744073709551615,"d":-9223372036854775808}"#;
        let ours = parse(text.as_bytes(), JSON_BUDGET).unwrap();
        let theirs: Value = serde_json::from_str(text).unwrap();
        assert_eq!(ours, theirs);
        for bad in ["", "{", "[1,]", "1e400", "{} x", r#"{"a" 1}"#] {
            let ours = parse(bad.as_bytes(), JSON_BUDGET).unwrap_err();
            let theirs = serde_json::from_str::<Value>(bad).unwrap_err();
            assert!(matches!(ours, ParseError::Syntax(_)), "{bad}: {ours}");
            assert_eq!(ours.to_string(), theirs.to_string(), "{bad}");
        }
    }

    /// The audit's body, `{"prompt":"x","pad":[0,0,...]}`: refused once its array's
    /// slots pass the budget, whatever follows.
    #[test]
    fn an_array_of_zeros_is_refused_at_the_budget() {
        let zeros = vec!["0"; 100_000].join(",");
        let body = format!(r#"{{"prompt":"x","pad":[{zeros}]}}"#);
        // 100,000 slots take 3.2 MB at least.
        assert!(matches!(
            parse(body.as_bytes(), 3_000_000),
            Err(ParseError::OverBudget { budget: 3_000_000 })
        ));
        // Within a budget of twice that (the array grows by half), it parses.
        let v = parse(body.as_bytes(), 2 * 3_200_000).unwrap();
        assert_eq!(v["pad"].as_array().map(Vec::len), Some(100_000));
        // Invalid JSON past the budget is refused for the budget (the parse stops there).
        let cut = &body.as_bytes()[..body.len() - 1];
        assert!(matches!(
            parse(cut, 1_000_000),
            Err(ParseError::OverBudget { .. })
        ));
        assert!(matches!(
            parse(cut, JSON_BUDGET),
            Err(ParseError::Syntax(_))
        ));
    }

    /// Objects are charged a B-tree node each: `[{"a":0},...]` costs its maps, not its
    /// bytes.
    #[test]
    fn small_objects_are_charged_their_nodes() {
        let objects = vec![r#"{"a":0}"#; 1000].join(",");
        let body = format!("[{objects}]");
        // 8 bytes each in the text, at least a node of 632 bytes each in the tree.
        assert!(matches!(
            parse(body.as_bytes(), 1000 * MAP_NODE),
            Err(ParseError::OverBudget { .. })
        ));
        assert!(parse(body.as_bytes(), 2000 * MAP_NODE).is_ok());
    }

    /// Text costs about its length: a 32 MiB string fits in a budget of 33 MiB.
    #[test]
    fn text_costs_its_length() {
        let body = format!(r#"{{"prompt":"{}"}}"#, "a".repeat(32 << 20));
        let v = parse(body.as_bytes(), 33 << 20).unwrap();
        assert_eq!(v["prompt"].as_str().map(str::len), Some(32 << 20));
    }

    /// The JSON errors as the routes answer them: 400 in vLLM's shape, and the
    /// budget's message.
    #[test]
    fn errors_as_answered() {
        let e = json(b"{").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(
            e.message.starts_with("JSON decode error: "),
            "{}",
            e.message
        );
        let over = ParseError::OverBudget {
            budget: JSON_BUDGET,
        };
        assert_eq!(
            over.to_string(),
            "the request body's JSON would take more than 256 MiB of memory to hold"
        );
    }
}
