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

/// What vLLM's completions API generates when the body has no `max_tokens` key (the
/// default of `CompletionRequest.max_tokens: int | None = 16`). An explicit `null` is
/// not this default: see [`TokenLimit::CompletionsNull`]. Chat has no such default: it
/// generates to the end of the context.
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: i64 = 16;

/// The client's token limit, as [`token_limit`] reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenLimit {
    /// No limit: the engine generates to the end of the context (a chat with neither
    /// key, with `null`s, or with a `max_completion_tokens` of 0 and no `max_tokens`).
    RestOfContext,
    /// At most `n` tokens, read from `key` (`"max_completion_tokens"` or
    /// `"max_tokens"`; `"max_tokens"` for completions' default,
    /// [`COMPLETIONS_DEFAULT_MAX_TOKENS`]). `n` is as the body gives it: vLLM refuses
    /// one below 1 (`max_tokens must be at least 1`), but for a completions 0 with
    /// `echo`, which answers the prompt only; that is the caller's to decide.
    Tokens {
        /// The limit.
        n: i64,
        /// The body key it was read from.
        key: &'static str,
    },
    /// A completions `"max_tokens": null`. vLLM's request model takes it, but its
    /// completions handler asserts a number for every output, so the request fails at
    /// its first token, after the engine ran.
    CompletionsNull,
}

/// [`token_limit`]'s reading of a body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientLimit {
    /// The limit, a chat's keys resolved by Python's `or` (the reading of vLLM's
    /// renderer, and of earlier vLLMs' sampling parameters).
    pub limit: TokenLimit,
    /// A chat's `max_completion_tokens` was 0 (`0`, `"0"`, `0.0`, `false`), which the
    /// `or` passed over. vLLM 0.33's handler does not pass over it (it reads
    /// `max_completion_tokens` unless it is `null`) and refuses the request
    /// (`max_tokens must be at least 1, got 0.`, naming `max_completion_tokens`): a
    /// caller that refuses what vLLM refuses refuses this first.
    pub zero_completion_tokens: bool,
}

/// A token limit pydantic's lax `int` refuses ([`token_limit`]): the engine answers 400
/// naming `key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnreadableLimit {
    /// The first key whose value is refused, `"max_tokens"` before
    /// `"max_completion_tokens"`.
    pub key: &'static str,
}

/// The client's token limit as vLLM resolves it from the raw values of its
/// `max_completion_tokens` and `max_tokens` members (`None`: the key is absent), each
/// read as pydantic's lax `int` ([`int_value`]; `"5"` and `5.0` are 5).
///
/// - Chat (`chat`): `max_completion_tokens or max_tokens` (Python's `or`: a 0 falls
///   through, and [`ClientLimit::zero_completion_tokens`] says so); neither, or only
///   `null`s: [`TokenLimit::RestOfContext`].
/// - Completions: `max_tokens`; [`COMPLETIONS_DEFAULT_MAX_TOKENS`] when the key is
///   absent, [`TokenLimit::CompletionsNull`] when it is `null`.
///   `max_completion_tokens` is not read (vLLM's completions request has no such
///   field, and ignores it).
///
/// # Errors
///
/// [`UnreadableLimit`] when pydantic refuses a value read (`"abc"`, `5.5`, `[]`).
pub fn token_limit(
    max_completion_tokens: Option<&[u8]>,
    max_tokens: Option<&[u8]>,
    chat: bool,
) -> Result<ClientLimit, UnreadableLimit> {
    let read = |raw: Option<&[u8]>, key: &'static str| match raw {
        None => Ok(None),
        Some(raw) => int_value(raw.trim_ascii()).map_err(|Refused| UnreadableLimit { key }),
    };
    let max = read(max_tokens, "max_tokens")?;
    let from_max = |n: i64| TokenLimit::Tokens {
        n,
        key: "max_tokens",
    };
    if !chat {
        let limit = match (max_tokens, max) {
            (None, _) => from_max(COMPLETIONS_DEFAULT_MAX_TOKENS),
            (Some(_), None) => TokenLimit::CompletionsNull,
            (Some(_), Some(n)) => from_max(n),
        };
        return Ok(ClientLimit {
            limit,
            zero_completion_tokens: false,
        });
    }
    let completion = read(max_completion_tokens, "max_completion_tokens")?;
    let limit = match (completion, max) {
        (Some(n), _) if n != 0 => TokenLimit::Tokens {
            n,
            key: "max_completion_tokens",
        },
        (_, Some(n)) => from_max(n),
        (_, None) => TokenLimit::RestOfContext,
    };
    Ok(ClientLimit {
        limit,
        zero_completion_tokens: completion == Some(0),
    })
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

    /// Every spelling of each key, chat and completions: absent, `null`, 0, a string
    /// number, a whole float, a negative, a fraction, a non-number string.
    #[test]
    fn token_limits_as_vllm_resolves_them() {
        use TokenLimit::{CompletionsNull, RestOfContext, Tokens};
        let max = |n| Tokens {
            n,
            key: "max_tokens",
        };
        let completion = |n| Tokens {
            n,
            key: "max_completion_tokens",
        };
        let read = |mct: Option<&str>, mt: Option<&str>, chat: bool| {
            token_limit(mct.map(str::as_bytes), mt.map(str::as_bytes), chat)
        };
        let limit = |mct, mt, chat| read(mct, mt, chat).map(|l| l.limit);
        let unreadable = |key| Err(UnreadableLimit { key });

        // `max_tokens` alone, each spelling, chat then completions.
        for (raw, chat, completions) in [
            (None, Ok(RestOfContext), Ok(max(16))),
            (Some("null"), Ok(RestOfContext), Ok(CompletionsNull)),
            (Some("0"), Ok(max(0)), Ok(max(0))),
            (Some("5"), Ok(max(5)), Ok(max(5))),
            (Some(r#""5""#), Ok(max(5)), Ok(max(5))),
            (Some(r#"" 5 ""#), Ok(max(5)), Ok(max(5))),
            (Some("5.0"), Ok(max(5)), Ok(max(5))),
            (Some(r#""5.0""#), Ok(max(5)), Ok(max(5))),
            (Some("-1"), Ok(max(-1)), Ok(max(-1))),
            (Some("true"), Ok(max(1)), Ok(max(1))),
            (Some(" 7 "), Ok(max(7)), Ok(max(7))),
            (
                Some("5.5"),
                unreadable("max_tokens"),
                unreadable("max_tokens"),
            ),
            (
                Some(r#""abc""#),
                unreadable("max_tokens"),
                unreadable("max_tokens"),
            ),
            (
                Some(r#""""#),
                unreadable("max_tokens"),
                unreadable("max_tokens"),
            ),
            (
                Some("[5]"),
                unreadable("max_tokens"),
                unreadable("max_tokens"),
            ),
        ] {
            assert_eq!(limit(None, raw, true), chat, "chat {raw:?}");
            assert_eq!(limit(None, raw, false), completions, "completions {raw:?}");
        }
        assert_eq!(COMPLETIONS_DEFAULT_MAX_TOKENS, 16);

        // A chat's `max_completion_tokens` comes first, each spelling.
        for (raw, want) in [
            ("5", Ok(completion(5))),
            (r#""5""#, Ok(completion(5))),
            ("5.0", Ok(completion(5))),
            ("-1", Ok(completion(-1))),
            ("null", Ok(max(9))),
            ("5.5", unreadable("max_completion_tokens")),
            (r#""five""#, unreadable("max_completion_tokens")),
        ] {
            assert_eq!(limit(Some(raw), Some("9"), true), want, "{raw}");
        }
        assert_eq!(limit(Some("null"), Some("null"), true), Ok(RestOfContext));
        assert_eq!(limit(Some("null"), None, true), Ok(RestOfContext));
        // An unreadable `max_tokens` is named first, whatever the other key holds.
        assert_eq!(
            limit(Some("5"), Some(r#""x""#), true),
            unreadable("max_tokens")
        );
        assert_eq!(limit(Some("x"), Some("x"), true), unreadable("max_tokens"));

        // A 0 falls through (Python's `or`), and is said to.
        for zero in ["0", r#""0""#, "0.0", "false"] {
            let got = read(Some(zero), Some("30"), true).unwrap();
            assert_eq!(got.limit, max(30), "{zero}");
            assert!(got.zero_completion_tokens, "{zero}");
            let alone = read(Some(zero), None, true).unwrap();
            assert_eq!(alone.limit, RestOfContext, "{zero}");
            assert!(alone.zero_completion_tokens, "{zero}");
        }
        for raw in [None, Some("null"), Some("5"), Some("-1")] {
            let got = read(raw, Some("0"), true).unwrap();
            assert!(!got.zero_completion_tokens, "{raw:?}");
        }

        // Completions read no `max_completion_tokens`, however it is spelled.
        for raw in ["5", "0", r#""x""#] {
            let got = read(Some(raw), None, false).unwrap();
            assert_eq!(got.limit, max(16), "{raw}");
            assert!(!got.zero_completion_tokens, "{raw}");
            assert_eq!(limit(Some(raw), Some("null"), false), Ok(CompletionsNull));
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
