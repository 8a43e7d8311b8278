//! Session key extraction: which bytes of a request name its session.
//!
//! A [`SessionKey`] tries its [`KeySource`]s in order and returns the first non-empty
//! value. Header names match case-insensitively *and* with `-` and `_` treated as the
//! same character, because proxies in front of disagg rewrite them: nginx drops or keeps
//! underscored headers depending on `underscores_in_headers`, and some gateways turn
//! `x-session-id` into `x_session_id` (a failure users of other PD routers report).
//!
//! A header sent more than once (under one spelling or several) names a session only
//! when its non-empty values are all the same; two different values are no key from
//! that header (the next source is tried, then the policy's fallback), since which one
//! the client meant cannot be told. One line `a, b` is taken whole, as the value
//! `a, b`.
//!
//! Body fields are top-level only and decoded lazily: [`JsonBody::get`] hands back the
//! field's raw JSON text and only that one value is looked at. A JSON string yields its
//! contents (unescaped only when it holds an escape); any other JSON value (a number, an
//! object) yields its raw text as the client sent it, so `{"user": 42}` and
//! `{"user": "42"}` give the same key. `null` and empty values count as absent.

use std::borrow::Cow;

use disagg_core::json::JsonBody;
use disagg_core::router::RequestView;
use http::HeaderMap;

/// The header most clients and routers use for session affinity.
pub const SESSION_HEADER: &str = "x-session-id";

/// The OpenAI request field naming the end user; a natural session key when clients set
/// no header.
pub const USER_FIELD: &str = "user";

/// One place a session key may be found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeySource {
    /// A request header, matched ignoring ASCII case and `-`/`_` differences; sent
    /// with different values, it is absent.
    Header(Box<str>),
    /// A top-level field of the JSON body.
    BodyField(Box<str>),
}

impl KeySource {
    /// A header source; `name` matches any spelling up to case and `-`/`_`.
    pub fn header(name: impl Into<Box<str>>) -> Self {
        KeySource::Header(name.into())
    }

    /// A top-level body field source.
    pub fn body_field(name: impl Into<Box<str>>) -> Self {
        KeySource::BodyField(name.into())
    }

    /// This source's value in `req`, if present and non-empty.
    pub fn extract<'a>(&self, req: &RequestView<'a>) -> Option<Cow<'a, [u8]>> {
        match self {
            KeySource::Header(name) => header_value(req.headers, name).map(Cow::Borrowed),
            KeySource::BodyField(name) => body_value(req.body, name),
        }
    }
}

/// An ordered list of [`KeySource`]s; the first one present wins.
///
/// The default is the `x-session-id` header (any spelling), then the body's `user`.
///
/// # Examples
///
/// ```
/// use disagg_affinity::{KeySource, SessionKey};
/// use disagg_core::router::RequestView;
/// use disagg_core::{request::Api, json::JsonBody};
/// use http::HeaderMap;
///
/// let key = SessionKey::new([KeySource::header("x-conversation"), KeySource::body_field("user")]);
/// let headers = HeaderMap::new();
/// let body = JsonBody::parse(br#"{"user":"alice","prompt":"hi"}"#)?;
/// let view = RequestView::new(Api::Completions, None, &headers, &body);
/// assert_eq!(key.extract(&view).as_deref(), Some(&b"alice"[..]));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionKey {
    sources: Vec<KeySource>,
}

impl Default for SessionKey {
    fn default() -> Self {
        SessionKey::new([
            KeySource::header(SESSION_HEADER),
            KeySource::body_field(USER_FIELD),
        ])
    }
}

impl SessionKey {
    /// Sources tried in the given order. An empty list never finds a key.
    pub fn new(sources: impl IntoIterator<Item = KeySource>) -> Self {
        SessionKey {
            sources: sources.into_iter().collect(),
        }
    }

    /// The sources, in priority order.
    pub fn sources(&self) -> &[KeySource] {
        &self.sources
    }

    /// The first non-empty value among the sources, borrowed from the request unless a
    /// JSON string had to be unescaped.
    pub fn extract<'a>(&self, req: &RequestView<'a>) -> Option<Cow<'a, [u8]>> {
        self.sources.iter().find_map(|s| s.extract(req))
    }
}

/// `-` and `_` are the same character, ASCII case is ignored.
fn fold(b: u8) -> u8 {
    if b == b'_' {
        b'-'
    } else {
        b.to_ascii_lowercase()
    }
}

/// Whether two header names are the same up to case and `-`/`_`.
pub(crate) fn same_header(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).all(|(x, y)| fold(x) == fold(y))
}

/// The one non-empty value of header `name` under any spelling; `None` when there is
/// none, or when it is sent more than once with different values (which of them names
/// the session is anyone's guess: a map's order is not the client's meaning).
fn header_value<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a [u8]> {
    // A linear scan: a request has few headers, and `HeaderMap::get` cannot match
    // `_` against `-`.
    let mut values = headers
        .iter()
        .filter(|(k, _)| same_header(k.as_str(), name))
        .map(|(_, v)| v.as_bytes())
        .filter(|v| !v.iter().all(u8::is_ascii_whitespace));
    let first = values.next()?;
    values.all(|v| v == first).then_some(first)
}

fn body_value<'a>(body: &'a JsonBody, name: &str) -> Option<Cow<'a, [u8]>> {
    let raw = body.get(name)?.trim_ascii();
    let value: Cow<'a, [u8]> = match raw {
        [] | b"null" => return None,
        [b'"', inner @ .., b'"'] if !inner.contains(&b'\\') => Cow::Borrowed(inner),
        [b'"', ..] => match serde_json::from_slice::<String>(raw) {
            Ok(s) => Cow::Owned(s.into_bytes()),
            // `JsonBody` validated the value, so this is unreachable in practice; the raw
            // text is still a stable key.
            Err(_) => Cow::Borrowed(raw),
        },
        _ => Cow::Borrowed(raw),
    };
    (!value.is_empty()).then_some(value)
}

#[cfg(test)]
mod tests {
    use disagg_core::request::Api;
    use http::HeaderValue;
    use http::header::HeaderName;

    use super::*;

    fn view<R>(headers: &[(&str, &str)], body: &str, f: impl FnOnce(&RequestView<'_>) -> R) -> R {
        let mut h = HeaderMap::new();
        for (k, v) in headers {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).expect("test header name"),
                HeaderValue::from_str(v).expect("test header value"),
            );
        }
        let b = JsonBody::parse(body.as_bytes()).expect("test body");
        f(&RequestView::new(Api::Chat, None, &h, &b))
    }

    fn key_of(headers: &[(&str, &str)], body: &str) -> Option<Vec<u8>> {
        view(headers, body, |v| {
            SessionKey::default().extract(v).map(Cow::into_owned)
        })
    }

    #[test]
    fn every_header_spelling_is_found() {
        for name in [
            "x-session-id",
            "X-Session-Id",
            "X-SESSION-ID",
            "x_session_id",
            "X_Session_Id",
            "X-Session_Id",
            "x_session-id",
        ] {
            assert_eq!(
                key_of(&[(name, "s1")], "{}").as_deref(),
                Some(&b"s1"[..]),
                "{name}"
            );
        }
    }

    #[test]
    fn other_names_do_not_match() {
        for name in ["x-session", "x-sessionid", "session-id", "x-session-id2"] {
            assert_eq!(key_of(&[(name, "s1")], "{}"), None, "{name}");
        }
    }

    #[test]
    fn header_wins_over_body() {
        assert_eq!(
            key_of(&[("x-session-id", "h")], r#"{"user":"b"}"#).as_deref(),
            Some(&b"h"[..])
        );
    }

    #[test]
    fn body_user_is_the_fallback() {
        assert_eq!(
            key_of(&[], r#"{"user":"alice"}"#).as_deref(),
            Some(&b"alice"[..])
        );
        // An empty header does not hide the body field.
        assert_eq!(
            key_of(&[("x-session-id", "")], r#"{"user":"alice"}"#).as_deref(),
            Some(&b"alice"[..])
        );
    }

    #[test]
    fn body_values_strings_unescape_others_stay_raw() {
        assert_eq!(
            key_of(&[], r#"{"user":"a\"b\u00e9"}"#).as_deref(),
            Some("a\"bé".as_bytes())
        );
        assert_eq!(key_of(&[], r#"{"user":42}"#).as_deref(), Some(&b"42"[..]));
        assert_eq!(
            key_of(&[], r#"{"user":{"id":1}}"#).as_deref(),
            Some(&br#"{"id":1}"#[..])
        );
        assert_eq!(key_of(&[], r#"{"user":null}"#), None);
        assert_eq!(key_of(&[], r#"{"user":""}"#), None);
    }

    #[test]
    fn no_key_is_none() {
        assert_eq!(key_of(&[("x-other", "1")], r#"{"model":"m"}"#), None);
        view(&[("x-session-id", "s")], r#"{"user":"u"}"#, |v| {
            assert_eq!(SessionKey::new([]).extract(v), None);
        });
    }

    #[test]
    fn priority_order_is_configurable() {
        let key = SessionKey::new([
            KeySource::body_field("conversation_id"),
            KeySource::header("X-Tenant"),
            KeySource::header(SESSION_HEADER),
        ]);
        let pick =
            |h: &[(&str, &str)], b: &str| view(h, b, |v| key.extract(v).map(Cow::into_owned));
        let both = [("x-session-id", "sess"), ("x_tenant", "ten")];
        assert_eq!(
            pick(&both, r#"{"conversation_id":"c"}"#).as_deref(),
            Some(&b"c"[..])
        );
        assert_eq!(pick(&both, "{}").as_deref(), Some(&b"ten"[..]));
        assert_eq!(
            pick(&[("x-session-id", "sess")], "{}").as_deref(),
            Some(&b"sess"[..])
        );
        assert_eq!(pick(&[], r#"{"user":"u"}"#), None);
    }

    /// A session header sent twice with different values names no session: the first
    /// in the map's order is no better a key than the last, and one line `a, b` is its
    /// own key. The header is then absent (the next source is tried, then the policy's
    /// fallback); repeats of one value, and empty lines, still name it.
    #[test]
    fn a_header_repeated_with_different_values_is_no_key() {
        assert_eq!(
            key_of(&[("x-session-id", "a"), ("x-session-id", "b")], "{}"),
            None
        );
        assert_eq!(
            key_of(&[("x-session-id", "a"), ("X_Session_Id", "b")], "{}"),
            None
        );
        assert_eq!(
            key_of(
                &[("x-session-id", "a"), ("x-session-id", "b")],
                r#"{"user":"u"}"#
            )
            .as_deref(),
            Some(&b"u"[..])
        );
        assert_eq!(
            key_of(
                &[
                    ("x-session-id", "a"),
                    ("x-session-id", ""),
                    ("x_session_id", "a")
                ],
                "{}"
            )
            .as_deref(),
            Some(&b"a"[..])
        );
        assert_eq!(
            key_of(&[("x-session-id", "a, b")], "{}").as_deref(),
            Some(&b"a, b"[..])
        );
    }

    #[test]
    fn header_folding() {
        assert!(same_header("x-session-id", "X_SESSION_ID"));
        assert!(!same_header("x-session-id", "x-session-i"));
        assert!(!same_header("x-session-id", "x.session.id"));
    }
}

#[cfg(test)]
mod props {
    use disagg_core::request::Api;
    use http::HeaderValue;
    use http::header::HeaderName;
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Any mix of case and `-`/`_` on `x-session-id` finds the key.
        #[test]
        fn any_spelling_finds_the_key(
            upper in proptest::collection::vec(any::<bool>(), SESSION_HEADER.len()),
            underscore in proptest::collection::vec(any::<bool>(), 2),
            value in "[a-zA-Z0-9._-]{1,32}",
        ) {
            let mut seps = underscore.iter();
            let name: String = SESSION_HEADER
                .chars()
                .zip(&upper)
                .map(|(c, &up)| match c {
                    '-' if *seps.next().unwrap_or(&false) => '_',
                    c if up => c.to_ascii_uppercase(),
                    c => c,
                })
                .collect();
            // `HeaderName` lowercases on parse; the key must still be found, and the
            // matcher itself must accept the mixed-case spelling.
            prop_assert!(same_header(&name, SESSION_HEADER));
            let mut h = HeaderMap::new();
            h.insert(
                HeaderName::from_bytes(name.as_bytes()).expect("valid name"),
                HeaderValue::from_str(&value).expect("valid value"),
            );
            let b = JsonBody::default();
            let v = RequestView::new(Api::Chat, None, &h, &b);
            let found = SessionKey::default().extract(&v).map(Cow::into_owned);
            prop_assert_eq!(found, Some(value.into_bytes()));
        }
    }
}
