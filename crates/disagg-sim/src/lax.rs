//! Pydantic v2 "lax mode" coercions, as vLLM's and SGLang's request models
//! apply them to a JSON body.
//!
//! Both engines declare their OpenAI request fields with pydantic and let it
//! coerce the JSON values (FastAPI validates the decoded body in Python
//! mode, lax). The simulator follows the rules of pydantic 2.13 lax mode,
//! checked by validating values with pydantic itself:
//!
//! * **bool**: `true`/`false`; the integers `0` and `1`; the floats `0.0`
//!   and `1.0`; the strings (case-insensitive, not trimmed) `"1"`, `"on"`,
//!   `"t"`, `"true"`, `"y"`, `"yes"` (true) and `"0"`, `"off"`, `"f"`,
//!   `"false"`, `"n"`, `"no"` (false). Anything else (`2`, `0.5`, `"maybe"`,
//!   `""`, `" true"`, lists, objects) is refused.
//! * **int**: integers; `true`/`false` (1 and 0); floats without a
//!   fractional part (`2.0`); strings that, once surrounding whitespace is
//!   trimmed, are an optionally signed run of decimal digits (single
//!   underscores allowed between digits, as Python's `int()` allows them),
//!   optionally followed by a `.` and zeros only (`"2"`, `" 2 "`, `"+3"`,
//!   `"1_000"`, `"2.0"`). Refused: `1.5`, `"2.5"`, `"abc"`, `""`, `"1e3"`,
//!   `"2."`, `"0x10"`, lists, objects.
//! * **float**: numbers; `true`/`false`; strings Rust parses as a float
//!   (`"2"`, `"1e3"`, `"inf"`, `"nan"`). Refused: other strings, lists,
//!   objects.
//! * **str**: strings only (a number is not a string in lax mode either).
//! * **list**: JSON arrays only, each item coerced by its own rule.
//!
//! `null` is "not given" for every optional field here, as the engines
//! declare them `Optional[...]`.
//!
//! Pydantic reports every error of a body; the simulator answers the first
//! it finds, in vLLM's error shape, with pydantic's wording after the field
//! name (`max_tokens: Input should be a valid integer, ...`).

use serde_json::{Map, Value};

use crate::api::ApiError;

/// The strings pydantic's lax bool reads as true.
const TRUE_STRINGS: [&str; 6] = ["1", "on", "t", "true", "y", "yes"];
/// The strings pydantic's lax bool reads as false.
const FALSE_STRINGS: [&str; 6] = ["0", "off", "f", "false", "n", "no"];

/// A field's value, `None` when absent or `null`.
pub(crate) fn field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

fn invalid(key: &str, what: &str) -> ApiError {
    ApiError::bad_request(format!("{key}: {what}"))
}

/// A value as a lax bool.
pub(crate) fn to_bool(key: &str, value: &Value) -> Result<bool, ApiError> {
    let refused = || {
        invalid(
            key,
            "Input should be a valid boolean, unable to interpret input",
        )
    };
    match value {
        Value::Bool(b) => Ok(*b),
        Value::Number(n) => match n.as_f64() {
            Some(1.0) => Ok(true),
            Some(0.0) => Ok(false),
            _ => Err(refused()),
        },
        Value::String(s) => {
            let lower = s.to_ascii_lowercase();
            if TRUE_STRINGS.contains(&lower.as_str()) {
                Ok(true)
            } else if FALSE_STRINGS.contains(&lower.as_str()) {
                Ok(false)
            } else {
                Err(refused())
            }
        }
        _ => Err(invalid(key, "Input should be a valid boolean")),
    }
}

/// An optional lax bool field.
pub(crate) fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    field(obj, key).map(|v| to_bool(key, v)).transpose()
}

/// Parses a string the way pydantic's lax int does (see the module docs).
/// Values beyond `i64` saturate: they are refused later by range checks.
fn parse_int_str(s: &str) -> Option<i64> {
    let s = s.trim();
    let (negative, rest) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let (digits, fraction) = match rest.split_once('.') {
        Some((digits, fraction)) => (digits, Some(fraction)),
        None => (rest, None),
    };
    // Only zeros after the point, and at least one: "2.0" yes, "2." no.
    if fraction.is_some_and(|f| f.is_empty() || f.bytes().any(|b| b != b'0')) {
        return None;
    }
    // Groups of digits separated by single underscores.
    if digits.is_empty()
        || digits
            .split('_')
            .any(|group| group.is_empty() || !group.bytes().all(|b| b.is_ascii_digit()))
    {
        return None;
    }
    let mut value: i64 = 0;
    for b in digits.bytes().filter(u8::is_ascii_digit) {
        value = value.saturating_mul(10).saturating_add(i64::from(b - b'0'));
    }
    Some(if negative { -value } else { value })
}

/// A value as a lax int.
pub(crate) fn to_int(key: &str, value: &Value) -> Result<i64, ApiError> {
    match value {
        Value::Bool(b) => Ok(i64::from(*b)),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                return Ok(i);
            }
            if n.as_u64().is_some() {
                return Ok(i64::MAX);
            }
            match n.as_f64() {
                // `as` saturates beyond i64, which only range checks see.
                Some(f) if f.fract() == 0.0 && f.is_finite() => Ok(f as i64),
                _ => Err(invalid(
                    key,
                    "Input should be a valid integer, got a number with a fractional part",
                )),
            }
        }
        Value::String(s) => parse_int_str(s).ok_or_else(|| {
            invalid(
                key,
                "Input should be a valid integer, unable to parse string as an integer",
            )
        }),
        _ => Err(invalid(key, "Input should be a valid integer")),
    }
}

/// An optional lax int field.
pub(crate) fn opt_int(obj: &Map<String, Value>, key: &str) -> Result<Option<i64>, ApiError> {
    field(obj, key).map(|v| to_int(key, v)).transpose()
}

/// An optional lax float field.
pub(crate) fn opt_float(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>, ApiError> {
    field(obj, key)
        .map(|v| match v {
            Value::Bool(b) => Ok(f64::from(u8::from(*b))),
            Value::Number(n) => n
                .as_f64()
                .ok_or_else(|| invalid(key, "Input should be a valid number")),
            Value::String(s) => s.trim().parse::<f64>().map_err(|_| {
                invalid(
                    key,
                    "Input should be a valid number, unable to parse string as a number",
                )
            }),
            _ => Err(invalid(key, "Input should be a valid number")),
        })
        .transpose()
}

/// An optional `list[int]` field.
pub(crate) fn opt_int_list(
    obj: &Map<String, Value>,
    key: &str,
) -> Result<Option<Vec<i64>>, ApiError> {
    match field(obj, key) {
        None => Ok(None),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| to_int(key, item))
            .collect::<Result<_, _>>()
            .map(Some),
        Some(_) => Err(invalid(key, "Input should be a valid list")),
    }
}

/// An optional `str | list[str]` field (`stop`), as a list.
pub(crate) fn opt_str_or_list(
    obj: &Map<String, Value>,
    key: &str,
) -> Result<Option<Vec<String>>, ApiError> {
    let not_str = || invalid(key, "Input should be a valid string");
    match field(obj, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(vec![s.clone()])),
        Some(Value::Array(items)) => items
            .iter()
            .map(|s| s.as_str().map(str::to_owned).ok_or_else(not_str))
            .collect::<Result<_, _>>()
            .map(Some),
        Some(_) => Err(not_str()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn bool_of(v: Value) -> Option<bool> {
        to_bool("b", &v).ok()
    }

    fn int_of(v: Value) -> Option<i64> {
        to_int("i", &v).ok()
    }

    /// Each row checked against pydantic 2.13 (`BaseModel` with an
    /// `Optional[bool]` field, `model_validate` on the decoded JSON).
    #[test]
    fn lax_bools_like_pydantic() {
        let table = [
            (json!(true), Some(true)),
            (json!(false), Some(false)),
            (json!("yes"), Some(true)),
            (json!("true"), Some(true)),
            (json!("TRUE"), Some(true)),
            (json!("on"), Some(true)),
            (json!("y"), Some(true)),
            (json!("t"), Some(true)),
            (json!("1"), Some(true)),
            (json!(1), Some(true)),
            (json!(1.0), Some(true)),
            (json!("no"), Some(false)),
            (json!("false"), Some(false)),
            (json!("off"), Some(false)),
            (json!("n"), Some(false)),
            (json!("f"), Some(false)),
            (json!("0"), Some(false)),
            (json!(0), Some(false)),
            (json!(0.0), Some(false)),
            (json!("maybe"), None),
            (json!(""), None),
            (json!(" true"), None),
            (json!(2), None),
            (json!(0.5), None),
            (json!([]), None),
            (json!({}), None),
        ];
        for (value, expected) in table {
            assert_eq!(bool_of(value.clone()), expected, "{value}");
        }
    }

    /// Each row checked against pydantic 2.13 (`Optional[int]`).
    #[test]
    fn lax_ints_like_pydantic() {
        let table = [
            (json!(2), Some(2)),
            (json!(-3), Some(-3)),
            (json!(2.0), Some(2)),
            (json!(true), Some(1)),
            (json!(false), Some(0)),
            (json!("2"), Some(2)),
            (json!(" 2 "), Some(2)),
            (json!("\t3\n"), Some(3)),
            (json!("+3"), Some(3)),
            (json!("-3"), Some(-3)),
            (json!("0002"), Some(2)),
            (json!("1_000"), Some(1000)),
            (json!("2.0"), Some(2)),
            (json!("2.00"), Some(2)),
            (json!("-2.0"), Some(-2)),
            (json!(1.5), None),
            (json!("2.5"), None),
            (json!("abc"), None),
            (json!(""), None),
            (json!("1e3"), None),
            (json!("2."), None),
            (json!(".0"), None),
            (json!("0x10"), None),
            (json!("1__000"), None),
            (json!("_1"), None),
            (json!("1_"), None),
            (json!("3 4"), None),
            (json!("- 3"), None),
            (json!("+-3"), None),
            (json!([1]), None),
            (json!({}), None),
        ];
        for (value, expected) in table {
            assert_eq!(int_of(value.clone()), expected, "{value}");
        }
        // Beyond i64: accepted by pydantic, saturated here for range checks.
        assert_eq!(int_of(json!(u64::MAX)), Some(i64::MAX));
        assert_eq!(int_of(json!("99999999999999999999")), Some(i64::MAX));
    }

    #[test]
    fn errors_name_the_field_like_pydantic() {
        let obj = json!({"max_tokens": "abc", "n": 1.5, "stream": "maybe", "stop": 5, "ids": "x"});
        let obj = obj.as_object().unwrap();
        assert_eq!(
            opt_int(obj, "max_tokens").unwrap_err().message,
            "max_tokens: Input should be a valid integer, unable to parse string as an integer"
        );
        assert_eq!(
            opt_int(obj, "n").unwrap_err().message,
            "n: Input should be a valid integer, got a number with a fractional part"
        );
        assert_eq!(
            opt_bool(obj, "stream").unwrap_err().message,
            "stream: Input should be a valid boolean, unable to interpret input"
        );
        assert_eq!(
            opt_str_or_list(obj, "stop").unwrap_err().message,
            "stop: Input should be a valid string"
        );
        assert_eq!(
            opt_int_list(obj, "ids").unwrap_err().message,
            "ids: Input should be a valid list"
        );
        assert_eq!(opt_int(obj, "absent").unwrap(), None);
    }

    #[test]
    fn floats_and_lists() {
        let obj = json!({"t": "2", "u": "x", "v": true, "l": ["1", 2.0, true], "m": ["a"], "s": ["a", 5]});
        let obj = obj.as_object().unwrap();
        assert_eq!(opt_float(obj, "t").unwrap(), Some(2.0));
        assert!(opt_float(obj, "u").is_err());
        assert_eq!(opt_float(obj, "v").unwrap(), Some(1.0));
        assert_eq!(opt_int_list(obj, "l").unwrap(), Some(vec![1, 2, 1]));
        assert!(opt_int_list(obj, "m").is_err());
        assert!(opt_str_or_list(obj, "s").is_err());
    }
}
