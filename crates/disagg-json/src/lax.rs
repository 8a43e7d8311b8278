//! Pydantic's lax coercion of raw JSON values, as vLLM and SGLang read request fields.
//!
//! Both engines validate OpenAI request bodies with pydantic v2 models in lax mode, so a
//! field typed `bool` takes `"yes"` and `1`, and one typed `int` takes `"5"` and `5.0`.
//! The proxy reads the fields it rewrites the same way: a value the engine would accept
//! is never refused by the proxy, and one the engine would refuse is never made valid by
//! a rewrite. The rules below were checked against pydantic 2.14 (`TypeAdapter(bool)`,
//! `TypeAdapter(int)`, `TypeAdapter(list[int])`, `TypeAdapter(str | list[str])` on JSON
//! input), the version vLLM 0.33 installs.
//!
//! The core reads `stream` with it (`disagg_core::request::PdRequest`); the
//! connectors read the fields they rewrite or check.

/// A value pydantic's lax mode refuses for the type asked (the engine answers 400).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused;

/// A JSON value read as pydantic's lax `bool`: `true`/`false`; the numbers `0` and `1`
/// (also `0.0`, `1.0`); the strings `0 off f false n no 1 on t true y yes` in any case
/// (not trimmed). `Ok(None)` for `null`.
///
/// # Errors
///
/// When pydantic would refuse the value (`2`, `"2"`, `" yes "`, `""`, objects, arrays).
pub fn bool_value(raw: &[u8]) -> Result<Option<bool>, Refused> {
    match raw {
        b"true" => return Ok(Some(true)),
        b"false" => return Ok(Some(false)),
        b"null" => return Ok(None),
        _ => {}
    }
    match raw.first() {
        Some(b'"') => {
            let s: String = serde_json::from_slice(raw).map_err(|_| Refused)?;
            match s.to_ascii_lowercase().as_str() {
                "1" | "on" | "t" | "true" | "y" | "yes" => Ok(Some(true)),
                "0" | "off" | "f" | "false" | "n" | "no" => Ok(Some(false)),
                _ => Err(Refused),
            }
        }
        Some(b'-' | b'0'..=b'9') => {
            let n: f64 = serde_json::from_slice(raw).map_err(|_| Refused)?;
            if n == 1.0 {
                Ok(Some(true))
            } else if n == 0.0 {
                Ok(Some(false))
            } else {
                Err(Refused)
            }
        }
        _ => Err(Refused),
    }
}

/// A JSON value read as pydantic's lax `int`: an integer; a float with no fractional
/// part (`5.0`, `1e3`); a boolean (`1`/`0`); a string holding an integer after trimming
/// whitespace, with an optional sign and `_` between digits (`" 5 "`, `"+5"`, `"5_0"`),
/// or a decimal with a zero fraction (`"5.0"`). `Ok(None)` for `null`. Values beyond
/// `i64` saturate (pydantic keeps Python's unbounded int; every comparison the proxy
/// makes gives the same answer).
///
/// # Errors
///
/// When pydantic would refuse the value (`1.5`, `"abc"`, `"1e3"`, objects, arrays).
pub fn int_value(raw: &[u8]) -> Result<Option<i64>, Refused> {
    match raw {
        b"null" => return Ok(None),
        b"true" => return Ok(Some(1)),
        b"false" => return Ok(Some(0)),
        _ => {}
    }
    match raw.first() {
        Some(b'"') => {
            let s: String = serde_json::from_slice(raw).map_err(|_| Refused)?;
            int_str(s.trim()).map(Some)
        }
        Some(b'-' | b'0'..=b'9') => {
            if let Ok(i) = serde_json::from_slice::<i64>(raw) {
                return Ok(Some(i));
            }
            let f: f64 = serde_json::from_slice(raw).map_err(|_| Refused)?;
            whole(f).map(Some)
        }
        _ => Err(Refused),
    }
}

/// A float with no fractional part, as an `i64` (saturating).
fn whole(f: f64) -> Result<i64, Refused> {
    if !f.is_finite() || f.fract() != 0.0 {
        return Err(Refused);
    }
    // `as` saturates at the bounds, which is what an out-of-range value needs here.
    Ok(f as i64)
}

/// Python's `int(s)` on a trimmed string (sign, digits, single `_` between digits), or a
/// decimal with only zeros after the point, as pydantic's lax mode reads strings.
fn int_str(s: &str) -> Result<i64, Refused> {
    let (neg, digits) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let (int_part, frac) = match digits.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (digits, None),
    };
    if let Some(f) = frac
        && (f.is_empty() || !f.bytes().all(|b| b == b'0'))
    {
        return Err(Refused);
    }
    let bytes = int_part.as_bytes();
    if bytes.is_empty()
        || !bytes[0].is_ascii_digit()
        || !bytes[bytes.len() - 1].is_ascii_digit()
        || bytes.windows(2).any(|w| w == b"__")
        || !bytes.iter().all(|b| b.is_ascii_digit() || *b == b'_')
    {
        return Err(Refused);
    }
    let mut value: i64 = 0;
    for b in bytes.iter().filter(|b| b.is_ascii_digit()) {
        value = value.saturating_mul(10).saturating_add(i64::from(b - b'0'));
    }
    Ok(if neg { value.saturating_neg() } else { value })
}

/// Python's truthiness of a raw JSON value, as vLLM's `mode="before"` validators test
/// `data.get(field)` on the body before any coercion: `null`, `false`, `0`, `0.0`, `""`,
/// `[]` and `{}` are false, everything else (the string `"false"` included) is true.
pub fn truthy(raw: Option<&[u8]>) -> bool {
    let Some(raw) = raw else { return false };
    match raw.first() {
        None => false,
        Some(b'n') => false,
        Some(b'f') => false,
        Some(b't') => true,
        Some(b'"') => raw.len() > 2,
        Some(b'[') | Some(b'{') => raw[1..]
            .iter()
            .any(|b| !b.is_ascii_whitespace() && *b != b']' && *b != b'}'),
        Some(_) => serde_json::from_slice::<f64>(raw).is_ok_and(|n| n != 0.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn booleans_as_pydantic_reads_them() {
        for (raw, want) in [
            ("true", Ok(Some(true))),
            ("null", Ok(None)),
            (r#""YES""#, Ok(Some(true))),
            (r#""On""#, Ok(Some(true))),
            (r#""t""#, Ok(Some(true))),
            (r#""no""#, Ok(Some(false))),
            ("1", Ok(Some(true))),
            ("1.0", Ok(Some(true))),
            ("0.0", Ok(Some(false))),
            ("2", Err(Refused)),
            ("1.5", Err(Refused)),
            (r#""2""#, Err(Refused)),
            (r#"" yes ""#, Err(Refused)),
            (r#""""#, Err(Refused)),
            (r#""1.0""#, Err(Refused)),
            ("[]", Err(Refused)),
        ] {
            assert_eq!(bool_value(raw.as_bytes()), want, "{raw}");
        }
    }

    #[test]
    fn integers_as_pydantic_reads_them() {
        for (raw, want) in [
            ("5", Ok(Some(5))),
            ("-1", Ok(Some(-1))),
            ("5.0", Ok(Some(5))),
            ("1e3", Ok(Some(1000))),
            ("true", Ok(Some(1))),
            ("null", Ok(None)),
            (r#""5""#, Ok(Some(5))),
            (r#"" 5 ""#, Ok(Some(5))),
            (r#""5.0""#, Ok(Some(5))),
            (r#""+5""#, Ok(Some(5))),
            (r#""-5""#, Ok(Some(-5))),
            (r#""5_0""#, Ok(Some(50))),
            ("9223372036854775808", Ok(Some(i64::MAX))),
            ("5.5", Err(Refused)),
            (r#""abc""#, Err(Refused)),
            (r#""1e3""#, Err(Refused)),
            (r#""5.5""#, Err(Refused)),
            (r#""5__0""#, Err(Refused)),
            (r#""_5""#, Err(Refused)),
            (r#""""#, Err(Refused)),
            ("[1]", Err(Refused)),
        ] {
            assert_eq!(int_value(raw.as_bytes()), want, "{raw}");
        }
    }

    #[test]
    fn truthiness_as_python_tests_raw_values() {
        for raw in [
            "true",
            "1",
            "-0.5",
            r#""false""#,
            r#""x""#,
            "[0]",
            r#"{"a":1}"#,
        ] {
            assert!(truthy(Some(raw.as_bytes())), "{raw}");
        }
        for raw in [
            "false", "null", "0", "0.0", r#""""#, "[]", "[ ]", "{}", "{ }",
        ] {
            assert!(!truthy(Some(raw.as_bytes())), "{raw}");
        }
        assert!(!truthy(None));
    }
}
