//! Compressed request bodies, refused on every route that reads or forwards a body
//! (orchestrated, forwarded, direct, fanned out): 415 `unsupported_content_encoding`,
//! decided on the request's head, before its body is read.
//!
//! The proxy reads every body as the engines do to take out the KV-handoff fields no
//! client may send an engine
//! ([`strip_client_handoff`](disagg_core::proto::strip_client_handoff)); it does not
//! decompress bodies, so a compressed one would pass that unread, and an engine that
//! decompresses it (SGLang's request-decompression middleware, behind
//! `SGLANG_ENABLE_REQUEST_DECOMPRESSION`, takes `content-encoding` and its own
//! `x-body-compressed`) would read the client's `bootstrap_host`. Refused:
//!
//! - a `content-encoding` naming any coding but `identity`, in any spelling: any case,
//!   whitespace around it, in a list (`gzip, identity`), in a repeated header;
//! - an `x-body-compressed` header, whatever its value.
//!
//! Header names are compared with `_` as `-` (`content_encoding`, `x_body_compressed`),
//! as the core's rule for the headers an engine reads as instructions has them: some
//! proxies rewrite one to the other.

use disagg_core::orchestrator::PdBody;
use disagg_core::request::Api;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode};

/// The stable `code` of the refusal.
pub(crate) const CODE: &str = "unsupported_content_encoding";

/// The header SGLang's request-decompression middleware reads besides
/// `content-encoding`.
const BODY_COMPRESSED: &str = "x-body-compressed";

/// The most of a client's header value that the refusal's message repeats.
const SHOWN_MAX: usize = 64;

/// A request whose head says its body is compressed: the header that says so and the
/// coding it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Compressed {
    /// `content-encoding` or `x-body-compressed`, as the docs spell it.
    header: &'static str,
    /// The coding named (at most [`SHOWN_MAX`] bytes of it, as text).
    coding: String,
}

/// Whether `name` is `want` (lowercase, with `-`), `_` taken as `-`.
fn is_named(name: &HeaderName, want: &str) -> bool {
    let (name, want) = (name.as_str().as_bytes(), want.as_bytes());
    name.len() == want.len()
        && name
            .iter()
            .zip(want)
            .all(|(&n, &w)| n == w || (n == b'_' && w == b'-'))
}

/// Whether `name` says how the body is encoded (`content-encoding`,
/// `x-body-compressed`, in either spelling): what no engine gets from a client (a body
/// that reaches one is never encoded, and `identity` says nothing).
pub(crate) fn coding_header(name: &HeaderName) -> bool {
    is_named(name, "content-encoding") || is_named(name, BODY_COMPRESSED)
}

/// What of `value` a message repeats: at most [`SHOWN_MAX`] bytes, as text.
fn shown(value: &[u8]) -> String {
    let cut = &value[..value.len().min(SHOWN_MAX)];
    String::from_utf8_lossy(cut).into_owned()
}

/// Whether `headers` say the body is compressed, and how; `None` for a request without
/// `content-encoding` or with only `identity` (empty list elements skipped), and
/// without `x-body-compressed`.
pub(crate) fn compressed(headers: &HeaderMap) -> Option<Compressed> {
    for (name, value) in headers {
        if is_named(name, BODY_COMPRESSED) {
            return Some(Compressed {
                header: BODY_COMPRESSED,
                coding: shown(value.as_bytes()),
            });
        }
        if !is_named(name, "content-encoding") {
            continue;
        }
        let coding = value
            .as_bytes()
            .split(|&b| b == b',')
            .map(|c| c.trim_ascii())
            .find(|c| !c.is_empty() && !c.eq_ignore_ascii_case(b"identity"));
        if let Some(coding) = coding {
            return Some(Compressed {
                header: "content-encoding",
                coding: shown(coding),
            });
        }
    }
    None
}

impl Compressed {
    /// The refusal's message: the header, what it named, and the remedy.
    fn message(&self) -> String {
        format!(
            "the request body is compressed ({}: {:?}), and this proxy reads every body \
             before an engine does and does not decompress bodies: send the body \
             uncompressed, without {}",
            self.header, self.coding, self.header
        )
    }

    /// The 415 `unsupported_content_encoding` for this request, in `api`'s own error
    /// shape (OpenAI's for `None`, and for every route but those
    /// [`api_error`](crate::error::api_error) names); `request_id` is the client's
    /// `x-request-id`. It says `accept-encoding: identity` (RFC 9110 §15.5.16: the
    /// codings that would have been taken), and closes the connection when the request
    /// may have a body: the body is left unread.
    pub(crate) fn response(
        &self,
        api: Option<Api>,
        request_id: Option<&str>,
        may_have_body: bool,
    ) -> Response<PdBody> {
        let mut resp = crate::error::api_error(
            api,
            request_id,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            &self.message(),
            "invalid_request_error",
            CODE,
        );
        let headers = resp.headers_mut();
        headers.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        if may_have_body {
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(lines: &[(&str, &[u8])]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (name, value) in lines {
            h.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_bytes(value).unwrap(),
            );
        }
        h
    }

    fn coding(lines: &[(&str, &[u8])]) -> Option<(&'static str, String)> {
        compressed(&headers(lines)).map(|c| (c.header, c.coding))
    }

    #[test]
    fn every_coding_but_identity_is_compressed_in_every_spelling() {
        let ce = "content-encoding";
        for (lines, named) in [
            (&[(ce, &b"gzip"[..])][..], "gzip"),
            (&[(ce, b"GZip")], "GZip"),
            (&[(ce, b" \tzstd\t ")], "zstd"),
            (&[(ce, b"gzip, identity")], "gzip"),
            (&[(ce, b"identity,br")], "br"),
            (&[(ce, b",,identity , deflate,")], "deflate"),
            (&[(ce, b"identity"), (ce, b"zstd")], "zstd"),
            (&[(ce, b"x-gzip")], "x-gzip"),
            (&[("content_encoding", b"gzip")], "gzip"),
            (&[(ce, b"\xffzip")], "\u{fffd}zip"),
        ] {
            assert_eq!(coding(lines), Some((ce, named.to_owned())), "{lines:?}");
        }
        let xb = BODY_COMPRESSED;
        for (lines, named) in [
            (&[(xb, &b"zstd"[..])][..], "zstd"),
            (&[(xb, b"")], ""),
            (&[(xb, b"false")], "false"),
            (&[("x_body_compressed", b"zstd")], "zstd"),
            (&[("x-body_compressed", b"zstd"), (ce, b"identity")], "zstd"),
        ] {
            assert_eq!(coding(lines), Some((xb, named.to_owned())), "{lines:?}");
        }
        // A long value is cut in the message.
        let long = vec![b'a'; 1000];
        let (_, shown) = coding(&[(ce, &long)]).unwrap();
        assert_eq!(shown.len(), SHOWN_MAX);
    }

    #[test]
    fn identity_or_nothing_is_not_compressed() {
        let ce = "content-encoding";
        for lines in [
            &[][..],
            &[(ce, &b"identity"[..])],
            &[(ce, b"Identity , IDENTITY")],
            &[(ce, b"")],
            &[(ce, b" , ")],
            &[(ce, b"identity"), (ce, b"identity")],
            &[("content-type", b"application/gzip")],
            &[("x-body-compressed-not", b"zstd")],
        ] {
            assert_eq!(coding(lines), None, "{lines:?}");
        }
    }

    #[test]
    fn the_coding_headers_are_named_in_both_spellings() {
        for name in [
            "content-encoding",
            "content_encoding",
            "x-body-compressed",
            "x_body_compressed",
        ] {
            assert!(coding_header(&HeaderName::from_static(name)), "{name}");
        }
        for name in ["content-type", "accept-encoding", "content-encodings"] {
            assert!(!coding_header(&HeaderName::from_static(name)), "{name}");
        }
    }

    #[test]
    fn the_refusal_names_the_header_and_the_remedy() {
        let c = compressed(&headers(&[("content-encoding", b"gzip")])).unwrap();
        let resp = c.response(None, None, true);
        assert_eq!(resp.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert_eq!(resp.headers()[header::ACCEPT_ENCODING], "identity");
        assert_eq!(resp.headers()[header::CONNECTION], "close");
        let body = futures::executor::block_on(http_body_util::BodyExt::collect(resp.into_body()))
            .unwrap()
            .to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], CODE);
        assert_eq!(v["error"]["type"], "invalid_request_error");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(r#"content-encoding: "gzip""#), "{message}");
        assert!(message.contains("send the body uncompressed"), "{message}");
        // No body: the connection may carry another request.
        let resp = c.response(Some(Api::Chat), None, false);
        assert!(resp.headers().get(header::CONNECTION).is_none());
    }
}
