//! One spelling per path: [`normalize`], the request path every route decision reads.
//!
//! An engine's server does not route the bytes of the request line: uvicorn
//! percent-decodes the path before Starlette matches a route (`uvicorn/protocols/http`,
//! `unquote` of the raw path), so `/%72eset_prefix_cache` runs vLLM's
//! `/reset_prefix_cache`. A proxy that compares the raw path with its route table
//! refuses one spelling and forwards the other. So the path is decoded and normalised
//! once, before any decision, and that one path is routed, authorised and forwarded
//! (the query is kept as it came):
//!
//! | in the request | normalised |
//! |---|---|
//! | an escape of an unreserved character (`%72`, `%5F`, `%2E`, RFC 3986 §2.3) | the character |
//! | any other escape (`%20`, `%3f`) | kept, its hex digits in upper case (`%3F`) |
//! | repeated slashes (`//a`, `a//b`) | one |
//! | `.` segments | removed |
//! | `..` segments | remove the segment before them (RFC 3986 §5.2.4) |
//!
//! A trailing slash stays (`/v1/models/` is not `/v1/models`). What cannot be given one
//! meaning is refused ([`PathError`], answered 400 `invalid_path`): an encoded `/` or
//! `\` (one server splits segments there, another does not), a raw `\`, `%00` or a NUL,
//! an escape that is not one (`%zz`, `%2`), a `..` that climbs above the root, and a
//! path that does not start with `/`.
//!
//! A path already normal (`/v1/chat/completions`) is recognised in one pass over its
//! bytes and returned borrowed, without an allocation.

use std::borrow::Cow;

use http::Request;
use http::uri::{PathAndQuery, Uri};

/// Why a request path has no one normal form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PathError {
    /// An encoded `/` or `\` (`%2F`, `%5C`), or a raw `\`: servers disagree on whether
    /// it separates segments.
    #[error("the path holds an encoded `/` or `\\`, or a `\\`, which servers read differently")]
    Separator,
    /// `%00` or a NUL byte.
    #[error("the path holds a NUL (`%00`)")]
    Nul,
    /// A `%` not followed by two hex digits.
    #[error("the path holds a `%` that is not followed by two hex digits")]
    InvalidEscape,
    /// A `..` segment with nothing left to remove: the path climbs above the root.
    #[error("the path's `..` segments climb above the root")]
    AboveRoot,
    /// The path does not start with `/` (an asterisk-form target, `*`).
    #[error("the path does not start with `/`")]
    NotAbsolute,
}

/// The normal form of the request path `path` (see the [module docs](self) for the
/// rules): borrowed when `path` is already normal, which costs one pass over its bytes
/// and no allocation.
///
/// The result is idempotent (`normalize` of it is itself), never holds an empty, `.` or
/// `..` segment, and spells every unreserved character as itself.
///
/// # Errors
///
/// [`PathError`] when the path cannot be given one meaning.
///
/// # Examples
///
/// ```
/// use disagg_http::path::{PathError, normalize};
///
/// assert_eq!(normalize("/v1/chat/completions").unwrap(), "/v1/chat/completions");
/// assert_eq!(normalize("/%72eset_prefix_cache").unwrap(), "/reset_prefix_cache");
/// assert_eq!(normalize("//v1/./chat//completions").unwrap(), "/v1/chat/completions");
/// assert_eq!(normalize("/v1/../sleep").unwrap(), "/sleep");
/// assert_eq!(normalize("/v1/models/a%3ab").unwrap(), "/v1/models/a%3Ab");
/// assert_eq!(normalize("/reset%2Fprefix"), Err(PathError::Separator));
/// assert_eq!(normalize("/../etc"), Err(PathError::AboveRoot));
/// ```
pub fn normalize(path: &str) -> Result<Cow<'_, str>, PathError> {
    if is_normal(path.as_bytes()) {
        return Ok(Cow::Borrowed(path));
    }
    normalize_slow(path).map(Cow::Owned)
}

/// Whether `p` is already normal: starts with `/`, holds no `%`, `\` or NUL, no empty
/// segment but a trailing one, and no `.` or `..` segment.
fn is_normal(p: &[u8]) -> bool {
    if p.first() != Some(&b'/') {
        return false;
    }
    for (i, &b) in p.iter().enumerate() {
        // One test for the usual byte (a letter, a digit, `-`, `_`).
        if !ODD[usize::from(b)] {
            continue;
        }
        if b != b'/' {
            return false;
        }
        let dot_segment = match p.get(i + 1) {
            Some(b'/') => true,
            Some(b'.') => match p.get(i + 2) {
                None | Some(b'/') => true,
                Some(b'.') => matches!(p.get(i + 3), None | Some(b'/')),
                _ => false,
            },
            _ => false,
        };
        if dot_segment {
            return false;
        }
    }
    true
}

/// The bytes [`is_normal`] looks at: `/` (what follows it), and `%`, `\` and NUL, which a
/// normal path never holds.
const ODD: [bool; 256] = {
    let mut t = [false; 256];
    t[b'/' as usize] = true;
    t[b'%' as usize] = true;
    t[b'\\' as usize] = true;
    t[0] = true;
    t
};

/// RFC 3986 §2.3: `ALPHA / DIGIT / "-" / "." / "_" / "~"`.
fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

const HEX_UPPER: &[u8; 16] = b"0123456789ABCDEF";

fn normalize_slow(path: &str) -> Result<String, PathError> {
    let b = path.as_bytes();
    if b.first() != Some(&b'/') {
        return Err(PathError::NotAbsolute);
    }
    // Escapes first: the segments are those of the decoded path.
    let mut decoded: Vec<u8> = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let (Some(hi), Some(lo)) = (
                    b.get(i + 1).copied().and_then(hex_value),
                    b.get(i + 2).copied().and_then(hex_value),
                ) else {
                    return Err(PathError::InvalidEscape);
                };
                match (hi << 4) | lo {
                    b'/' | b'\\' => return Err(PathError::Separator),
                    0 => return Err(PathError::Nul),
                    c if is_unreserved(c) => decoded.push(c),
                    _ => decoded.extend_from_slice(&[
                        b'%',
                        HEX_UPPER[usize::from(hi)],
                        HEX_UPPER[usize::from(lo)],
                    ]),
                }
                i += 3;
            }
            b'\\' => return Err(PathError::Separator),
            0 => return Err(PathError::Nul),
            c => {
                decoded.push(c);
                i += 1;
            }
        }
    }
    // Then the segments: empty and `.` ones dropped, `..` ones remove their parent.
    let mut segments: Vec<&[u8]> = Vec::new();
    let mut trailing = false;
    for segment in decoded[1..].split(|&c| c == b'/') {
        trailing = true;
        match segment {
            b"" | b"." => {}
            b".." => {
                if segments.pop().is_none() {
                    return Err(PathError::AboveRoot);
                }
            }
            s => {
                segments.push(s);
                trailing = false;
            }
        }
    }
    let mut out = Vec::with_capacity(decoded.len());
    for s in &segments {
        out.push(b'/');
        out.extend_from_slice(s);
    }
    if trailing || segments.is_empty() {
        out.push(b'/');
    }
    // Only ASCII was decoded or removed, so what was UTF-8 still is.
    String::from_utf8(out).map_err(|_| PathError::InvalidEscape)
}

/// A model card asked for with an encoded `/` in its id (`GET /v1/models/org%2Fmodel`,
/// as SDKs escape an id in a path): the one kind of path with no normal form that is
/// served. Every layer gives it what the plain spelling (`/v1/models/org/model`) gets:
/// the key check its keys, [`PdService`](crate::PdService) its route's answer (the card
/// itself, the id one opaque segment, never forwarded), [`PdLayer`](crate::PdLayer)
/// the service inside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EscapedCard<'a> {
    /// The id as sent, still escaped (the model list decodes it).
    pub(crate) id: &'a str,
    /// The path it stands for, in its normal form: its `%2F` escapes made `/`.
    pub(crate) plain: String,
}

/// `path` as an [`EscapedCard`], when `err` (why `path` has no normal form) is only an
/// encoded `/` in a model card's id: one segment below `/v1/models/`, whose decoded id
/// holds no `\`, no NUL and no empty, `.` or `..` segment (so it cannot stand for
/// another route).
pub(crate) fn escaped_model_card(path: &str, err: PathError) -> Option<EscapedCard<'_>> {
    if err != PathError::Separator {
        return None;
    }
    let id = path.strip_prefix("/v1/models/")?;
    let decoded = crate::models::percent_decode(id);
    let one_id = !id.contains(['/', '\\'])
        && !decoded.contains(['\\', '\0'])
        && !decoded
            .split('/')
            .any(|s| s.is_empty() || s == "." || s == "..");
    if !one_id {
        return None;
    }
    // Only the encoded `/` made plain: every other escape is normalised as anywhere.
    let slashes = id.replace("%2F", "/").replace("%2f", "/");
    let plain = normalize(&format!("/v1/models/{slashes}"))
        .ok()?
        .into_owned();
    Some(EscapedCard { id, plain })
}

/// Put the normal form of `req`'s path in its URI, the query kept as it came; nothing
/// changes (and nothing is allocated) when the path is already normal.
pub(crate) fn normalize_request<B>(req: &mut Request<B>) -> Result<(), PathError> {
    let normal = match normalize(req.uri().path())? {
        Cow::Borrowed(_) => return Ok(()),
        Cow::Owned(p) => p,
    };
    let target = match req.uri().query() {
        Some(q) => format!("{normal}?{q}"),
        None => normal,
    };
    // Made of the original path's characters and decoded unreserved ones: a valid
    // target; were it refused, the path is as unusable as an ambiguous one.
    let pq = PathAndQuery::try_from(target).map_err(|_| PathError::InvalidEscape)?;
    let mut parts = std::mem::take(req.uri_mut()).into_parts();
    parts.path_and_query = Some(pq);
    *req.uri_mut() = Uri::from_parts(parts).map_err(|_| PathError::InvalidEscape)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn plain_paths_are_borrowed() {
        for p in [
            "/",
            "/v1/chat/completions",
            "/v1/models/",
            "/v1/models/org/model",
            "/a.b/..c/.d/c..",
            "/~x-y_z",
        ] {
            assert!(
                matches!(normalize(p), Ok(Cow::Borrowed(q)) if q == p),
                "{p}"
            );
        }
    }

    #[test]
    fn spellings_of_one_route_meet() {
        for p in [
            "/%72eset_prefix_cache",
            "/reset%5Fprefix%5Fcache",
            "/reset%5fprefix%5fcache",
            "//reset_prefix_cache",
            "/./reset_prefix_cache",
            "/v1/../reset_prefix_cache",
            "/v1/%2E%2E/reset_prefix_cache",
            "/v1/%2e./reset_prefix_cache",
            "/x/y/../../reset_prefix_cache",
        ] {
            assert_eq!(normalize(p).unwrap(), "/reset_prefix_cache", "{p}");
        }
        assert_eq!(normalize("/%73leep").unwrap(), "/sleep");
        for p in [
            "/v1/chat//completions",
            "/v1/./chat/completions",
            "/v1//./chat/completions",
            "/v1/chat/x/../completions",
        ] {
            assert_eq!(normalize(p).unwrap(), "/v1/chat/completions", "{p}");
        }
    }

    #[test]
    fn trailing_slashes_and_dot_ends() {
        assert_eq!(normalize("/v1/models//").unwrap(), "/v1/models/");
        assert_eq!(normalize("/v1/models/.").unwrap(), "/v1/models/");
        assert_eq!(normalize("/v1/models/x/..").unwrap(), "/v1/models/");
        assert_eq!(normalize("/a/..").unwrap(), "/");
        assert_eq!(normalize("//").unwrap(), "/");
        assert_eq!(normalize("/.").unwrap(), "/");
    }

    #[test]
    fn other_escapes_stay_in_upper_case() {
        assert_eq!(normalize("/a%20b%3f").unwrap(), "/a%20b%3F");
        assert_eq!(normalize("/x/%c3%a9").unwrap(), "/x/%C3%A9");
        assert_eq!(normalize("/%25").unwrap(), "/%25");
    }

    #[test]
    fn ambiguous_paths_are_refused() {
        for (p, e) in [
            ("/reset%2Fprefix_cache", PathError::Separator),
            ("/v1%2fchat/completions", PathError::Separator),
            ("/a%5Cb", PathError::Separator),
            ("/a\\b", PathError::Separator),
            ("/a%00", PathError::Nul),
            ("/a%zz", PathError::InvalidEscape),
            ("/a%2", PathError::InvalidEscape),
            ("/a%", PathError::InvalidEscape),
            ("/../x", PathError::AboveRoot),
            ("/a/../../x", PathError::AboveRoot),
            ("/%2e%2e/x", PathError::AboveRoot),
            ("*", PathError::NotAbsolute),
            ("", PathError::NotAbsolute),
        ] {
            assert_eq!(normalize(p), Err(e), "{p}");
        }
    }

    #[test]
    fn the_request_keeps_its_query_and_authority() {
        let mut req = Request::get("http://h:1//v1/./models?x=%2F&y")
            .body(())
            .unwrap();
        normalize_request(&mut req).unwrap();
        assert_eq!(req.uri().to_string(), "http://h:1/v1/models?x=%2F&y");
        let mut plain = Request::get("/v1/models?a=b").body(()).unwrap();
        normalize_request(&mut plain).unwrap();
        assert_eq!(plain.uri().to_string(), "/v1/models?a=b");
        let mut bad = Request::get("/a%2Fb?c").body(()).unwrap();
        assert_eq!(normalize_request(&mut bad), Err(PathError::Separator));
    }

    #[test]
    fn an_escaped_slash_in_a_model_card_id_stands_for_the_plain_path() {
        let card = |p: &str| {
            let err = normalize(p).err()?;
            escaped_model_card(p, err).map(|c| (c.id.to_owned(), c.plain))
        };
        assert_eq!(
            card("/v1/models/org%2Fmodel"),
            Some(("org%2Fmodel".into(), "/v1/models/org/model".into()))
        );
        assert_eq!(
            card("/v1/models/org%2fm%6Fdel%3Av1"),
            Some((
                "org%2fm%6Fdel%3Av1".into(),
                "/v1/models/org/model%3Av1".into()
            ))
        );
        for other in [
            "/v1/models/org%2F..%2Fhealth",
            "/v1/models/org%2F%2Fmodel",
            "/v1/models/%2Fmodel",
            "/v1/models/org%5Cmodel",
            "/v1/models/a/org%2Fmodel",
            "/v1/models/org%2Fmodel%00",
            "/v1/models%2Forg",
            "/v2/models/org%2Fmodel",
            "/v1/models/org%2Fmodel%zz",
        ] {
            assert_eq!(card(other), None, "{other}");
        }
    }

    /// Path-ish strings: segments of unreserved characters, dots, escapes (some of
    /// them ambiguous), slashes.
    fn path() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            "[a-zA-Z0-9_~-]{1,6}",
            Just(".".to_owned()),
            Just("..".to_owned()),
            Just(String::new()),
            "%[0-9a-fA-F]{2}",
            Just("%2F".to_owned()),
            Just("%zz".to_owned()),
        ];
        prop::collection::vec(piece, 0..8).prop_map(|v| format!("/{}", v.join("/")))
    }

    /// `s` with every unreserved character outside an escape percent-encoded, its hex
    /// digits in upper or lower case.
    fn encode_unreserved(s: &str, upper: bool) -> String {
        let b = s.as_bytes();
        let mut out = String::new();
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'%' {
                // An escape (or what is left of one) is copied as it is.
                let end = (i + 3).min(b.len());
                out.push_str(&s[i..end]);
                i = end;
                continue;
            }
            if is_unreserved(b[i]) {
                let e = format!("%{:02X}", b[i]);
                out.push_str(&if upper { e } else { e.to_lowercase() });
            } else {
                out.push(char::from(b[i]));
            }
            i += 1;
        }
        out
    }

    proptest! {
        #[test]
        fn normal_forms_are_idempotent_and_clean(p in path()) {
            if let Ok(n) = normalize(&p) {
                prop_assert_eq!(normalize(&n).unwrap(), n.clone());
                prop_assert!(matches!(normalize(&n), Ok(Cow::Borrowed(_))) || n.contains('%'));
                prop_assert!(n.starts_with('/'));
                prop_assert!(!n.contains("//"), "{}", n);
                prop_assert!(!n.split('/').any(|s| s == "." || s == ".."), "{}", n);
            }
        }

        #[test]
        fn encoding_unreserved_characters_changes_nothing(p in path(), upper in any::<bool>()) {
            let encoded = encode_unreserved(&p, upper);
            prop_assert_eq!(normalize(&p), normalize(&encoded), "{} / {}", p, encoded);
        }
    }
}
