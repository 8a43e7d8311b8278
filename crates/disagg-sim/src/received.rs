//! Every request an engine received, on every route ([`SimEngine::received`]), and the
//! path its server routes by.
//!
//! [`SimEngine::requests`] keeps the completion and admin requests with their bodies;
//! this ring keeps the head of every request but `GET /stats` (the tests' own): health
//! checks, model lists, `/tokenize`, the Responses API, unknown paths, so a test can
//! tell that nothing (or what) reached an engine on any route.
//!
//! [`SimEngine::received`]: crate::SimEngine::received
//! [`SimEngine::requests`]: crate::SimEngine::requests

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::Mutex;

use http::{HeaderMap, Method, Request, Uri};

use crate::kv::lock;

/// The head of a request as the engine received it, on any route.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReceivedRequest {
    /// The method, e.g. `POST`.
    pub method: String,
    /// The path as it came on the wire (not decoded), e.g. `/tokenize`.
    pub path: String,
    /// The query, without its `?`, when there was one.
    pub query: Option<String>,
    /// The headers, in order (values that are not UTF-8 are converted lossily).
    pub headers: Vec<(String, String)>,
}

impl ReceivedRequest {
    /// The value of the first header named `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// The last heads received, cheap to store (reference-counted header values).
#[derive(Debug, Default)]
pub(crate) struct Ring {
    heads: Mutex<VecDeque<(Method, Uri, HeaderMap)>>,
}

impl Ring {
    /// Keep `req`'s head, forgetting the oldest past `capacity` (0 keeps nothing).
    pub(crate) fn record<B>(&self, req: &Request<B>, capacity: usize) {
        // Observation, not traffic: `/stats` and `/metrics` are not recorded.
        if capacity == 0 || matches!(req.uri().path(), "/stats" | "/metrics") {
            return;
        }
        let head = (
            req.method().clone(),
            req.uri().clone(),
            req.headers().clone(),
        );
        let mut ring = lock(&self.heads);
        while ring.len() >= capacity {
            ring.pop_front();
        }
        ring.push_back(head);
    }

    /// The heads kept, oldest first.
    pub(crate) fn list(&self) -> Vec<ReceivedRequest> {
        lock(&self.heads)
            .iter()
            .map(|(method, uri, headers)| ReceivedRequest {
                method: method.as_str().to_owned(),
                path: uri.path().to_owned(),
                query: uri.query().map(str::to_owned),
                headers: headers
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.as_str().to_owned(),
                            String::from_utf8_lossy(v.as_bytes()).into_owned(),
                        )
                    })
                    .collect(),
            })
            .collect()
    }

    pub(crate) fn clear(&self) {
        lock(&self.heads).clear();
    }
}

/// The path the engine's server routes by: uvicorn percent-decodes the raw path
/// (`unquote`, every escape, `%2F` included) before Starlette matches a route, so
/// `/%72eset_prefix_cache` reaches `/reset_prefix_cache`. An escape that is not one
/// stays as it is; bytes that are not UTF-8 become U+FFFD, as `unquote` makes them.
pub(crate) fn routed_path(raw: &str) -> Cow<'_, str> {
    if !raw.contains('%') {
        return Cow::Borrowed(raw);
    }
    let b = raw.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%'
            && let (Some(h), Some(l)) = (
                b.get(i + 1).copied().and_then(hex),
                b.get(i + 2).copied().and_then(hex),
            )
        {
            out.push(u8::try_from(h * 16 + l).unwrap_or(b'?'));
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Cow::Owned(String::from_utf8_lossy(&out).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_routed_decoded_as_uvicorn_does() {
        assert_eq!(routed_path("/%72eset_prefix_cache"), "/reset_prefix_cache");
        assert_eq!(
            routed_path("/reset%5Fprefix%5fcache"),
            "/reset_prefix_cache"
        );
        assert_eq!(routed_path("/a%2Fb"), "/a/b");
        assert_eq!(routed_path("/a%zz"), "/a%zz");
        assert!(matches!(routed_path("/tokenize"), Cow::Borrowed(_)));
    }
}
