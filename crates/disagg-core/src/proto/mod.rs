//! The API of connector and adapter authors: helpers the engines' protocols
//! (`disagg-connectors`) and the HTTP adapter (`disagg-http`) need, and an application
//! that only serves requests never names.
//!
//! A connector reads and rewrites request bodies with `disagg-json` (re-exported as
//! [`json`](crate::json)), sees the handoff fields a client sent ([`client_handoff`]), and may pick a data-parallel rank after routing ([`dp_rank`];
//! a [`Route`](crate::router::Route)'s ranks are its public fields). An adapter that
//! forwards a request to one engine keeps the proxy's rules for headers and answers
//! ([`forwardable_header`], [`connection_names`], [`strip_client_handoff`], [`unrelayable`],
//! [`HANDOFF_HEADER`]).
//!
//! | item | for |
//! |---|---|
//! | [`client_handoff`] | the handoff fields a client sent, which the legs never carry |
//! | [`dp_rank`] | data-parallel ranks chosen after routing |
//! | [`forwardable_header`], [`connection_names`], [`strip_client_handoff`], [`unrelayable`], [`HANDOFF_HEADER`] | forwarding to one engine as the legs do |

use std::sync::Arc;

use http::StatusCode;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use crate::endpoint::Endpoint;
use crate::request::PdRequest;

/// Locks `m`, recovering the data if a panicking thread poisoned it (every critical
/// section in this crate leaves its data consistent). Each crate of the workspace keeps
/// its own: a mutex helper is no part of the connector author's API.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The raw value of a handoff field the client sent in `req` (one
/// [`PdRequest::new`] removes: `kv_transfer_params`, the bootstrap fields, the rank
/// fields), which the legs never carry (the vLLM connectors refuse a
/// `kv_transfer_params` that is not an object, as vLLM would).
pub fn client_handoff<'a>(req: &'a PdRequest, field: &str) -> Option<&'a [u8]> {
    req.client_handoff(field)
}

/// The headers a `connection` header of `headers` names (RFC 9110 §7.6.1: each is for
/// one hop alone, never forwarded), as header names; tokens that are no header name
/// are skipped.
///
/// # Examples
///
/// ```
/// use disagg_core::proto::connection_names;
/// use http::header::{CONNECTION, HeaderMap, HeaderValue};
///
/// let mut h = HeaderMap::new();
/// h.append(CONNECTION, HeaderValue::from_static("keep-alive, Authorization"));
/// h.append(CONNECTION, HeaderValue::from_static("x-hop"));
/// let names: Vec<_> = connection_names(&h).collect();
/// assert_eq!(names, ["keep-alive", "authorization", "x-hop"]);
/// ```
pub fn connection_names(headers: &HeaderMap) -> impl Iterator<Item = HeaderName> + '_ {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
}

/// Remove from a client's JSON body what no engine may get from a client, on any route:
/// the handoff fields [`PdRequest::new`] removes (`kv_transfer_params`, the bootstrap
/// fields, the rank fields) and their spellings below the top level that the engines
/// also read: inside `vllm_xargs` and `sampling_params.extra_args` (vLLM), and inside
/// `parameters` (SGLang's `/vertex_generate`).
/// Whether anything was removed (then the body's bytes changed). An adapter that
/// forwards a body to one engine, or to all of them, applies it as the orchestrator does
/// to every leg.
///
/// # Errors
///
/// [`BodyError::InvalidJson`](disagg_json::BodyError::InvalidJson) when one of those
/// nested objects cannot be walked (a key holding a lone UTF-16 surrogate, which the
/// engines' Python reads and serde does not): its keys cannot be told, so the body must
/// be refused, as [`PdRequest::new`] refuses it, rather than passed with them.
///
/// # Examples
///
/// ```
/// use disagg_core::json::JsonBody;
/// use disagg_core::proto::strip_client_handoff;
///
/// let mut body = JsonBody::parse(br#"{"model":"m","kv_transfer_params":{"remote_host":"evil"}}"#)?;
/// assert!(strip_client_handoff(&mut body)?);
/// assert_eq!(&body.to_bytes()[..], br#"{"model":"m"}"#);
/// let mut odd = JsonBody::parse(br#"{"vllm_xargs":{"\udc00":0,"kv_transfer_params":1}}"#)?;
/// assert!(strip_client_handoff(&mut odd).is_err());
/// # Ok::<(), disagg_core::json::BodyError>(())
/// ```
pub fn strip_client_handoff(
    body: &mut disagg_json::JsonBody,
) -> Result<bool, disagg_json::BodyError> {
    crate::request::remove_handoff(body, |_, _| {})
}

/// One data-parallel rank of `engine`, for a connector that picks the rank itself after
/// routing (vLLM Mooncake asks the engine which ranks it runs): `URL@rank`, with the
/// engine's role, models and connector data, and its own in-flight count, which also
/// counts towards the engine's, so that routers keep seeing the whole engine's load.
pub fn dp_rank(engine: &Arc<Endpoint>, rank: u32) -> Endpoint {
    engine.dp_rank(rank)
}

/// The response header that says how the KV reached the decode engine:
/// `kv` (handed over), `none` (the prefill returned no handoff; the decode engine
/// computed the prompt itself), `decode-only` (no prefill endpoint was available, and
/// the configuration allows serving without), `direct` (the
/// [`Disaggregate`](crate::policy::Disaggregate) hook chose not to disaggregate this request) or `prefill` (the
/// prefill's answer was the whole answer, [`HandoffFound::Finished`](crate::connector::HandoffFound::Finished): no decode leg).
pub const HANDOFF_HEADER: HeaderName = HeaderName::from_static("x-disagg-handoff");

/// Whether a client's request header `name` may reach an engine, on any route (a leg,
/// or a request an adapter forwards to one engine or to all of them), whatever an
/// embedder's list of forwarded headers says.
///
/// Never:
/// - the client's credentials: `authorization` only when `forward_authorization` (the
///   documented [`OrchestratorConfig::forward_authorization`](crate::orchestrator::OrchestratorConfig::forward_authorization)),
///   `x-api-key` never (the engines' key is the transport's to set);
/// - the headers an engine reads as routing or identity, `x-data-parallel-rank` and SGLang's `x-override-*`.
///
/// # Examples
///
/// ```
/// use disagg_core::proto::forwardable_header;
/// use http::header::HeaderName;
///
/// let h = |n: &'static str| HeaderName::from_static(n);
/// assert!(forwardable_header(&h("traceparent"), false));
/// assert!(!forwardable_header(&h("authorization"), false));
/// assert!(forwardable_header(&h("authorization"), true));
/// assert!(!forwardable_header(&h("x-api-key"), true));
/// assert!(!forwardable_header(&h("x-override-bootstrap-host"), true));
/// assert!(!forwardable_header(&h("x-data-parallel-rank"), false));
/// ```
pub fn forwardable_header(name: &HeaderName, forward_authorization: bool) -> bool {
    if *name == header::AUTHORIZATION {
        return forward_authorization;
    }
    name.as_str() != "x-api-key" && !is_engine_directive(name)
}

/// Whether the engines read `name` as an instruction about where or as what a request
/// runs, which only the proxy may give (header names are lowercase; `_` counts as `-`,
/// as some proxies rewrite them):
///
/// - vLLM's `x-data-parallel-rank`, which SGLang reads too (it overrides the body's
///   `routed_dp_rank`): a rank the router did not choose;
/// - SGLang's `x-override-*` family (`srt/entrypoints/request_headers.py`: `-rid`,
///   `-bootstrap-host`, `-bootstrap-port`, `-bootstrap-room`, `-routed-dp-rank`,
///   `-disagg-prefill-dp-rank`, `-priority`, `-conversation-id`, and any later one),
///   read after the body with `SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1`: a client's
///   bootstrap host would aim a leg's KV transfer at a host of its choosing.
fn is_engine_directive(name: &HeaderName) -> bool {
    const OVERRIDE: &[u8] = b"x-override-";
    const RANK: &[u8] = b"x-data-parallel-rank";
    let n = name.as_str().as_bytes();
    let same = |got: &[u8], want: &[u8]| {
        got.iter()
            .zip(want)
            .all(|(g, w)| g == w || (*g == b'_' && *w == b'-'))
    };
    (n.len() >= OVERRIDE.len() && same(&n[..OVERRIDE.len()], OVERRIDE))
        || (n.len() == RANK.len() && same(n, RANK))
}

/// Why an engine's answer with `status` and `headers` cannot be relayed to a client whose
/// request had `client_headers` (their `accept-encoding` is read), if it cannot:
///
/// - a redirect (3xx) with a `Location`: it names the engine's own address, which is
///   not the client's to follow (nor to know);
/// - a `connection` header naming a `content-*` header: those describe the body, not
///   one connection, and a relay that dropped them as hop-by-hop would hand the client
///   a body it cannot read (no `content-encoding`), or hide from the proxy what it must
///   read (no `content-type`);
/// - more than one `content-type` or `content-encoding` header: which one a client
///   heeds is not the proxy's to guess (the proxy reads the first);
/// - a `content-encoding` (other than `identity`) the client's `accept-encoding` does
///   not allow, or any on an event stream or a JSON answer, which the proxy must read
///   to keep the engine's handoff from the client.
///
/// Decide on the answer's headers as the engine sent them, before any is removed. The
/// reason never quotes the `Location`.
pub fn unrelayable(
    status: StatusCode,
    headers: &HeaderMap,
    client_headers: &HeaderMap,
) -> Option<String> {
    if status.is_redirection() && headers.contains_key(header::LOCATION) {
        return Some(format!(
            "a redirect ({}) to an address of its own",
            status.as_u16()
        ));
    }
    if let Some(name) = connection_names(headers).find(|n| n.as_str().starts_with("content-")) {
        return Some(format!(
            "a `connection` header naming `{name}`, which describes the body, not one connection"
        ));
    }
    for name in [header::CONTENT_TYPE, header::CONTENT_ENCODING] {
        if headers.get_all(&name).iter().nth(1).is_some() {
            return Some(format!("more than one `{name}` header"));
        }
    }
    let coding = headers.get(header::CONTENT_ENCODING)?;
    let coding = coding.to_str().unwrap_or("?").trim();
    let codings: Vec<&str> = coding
        .split(',')
        .map(str::trim)
        .filter(|c| !c.is_empty() && !c.eq_ignore_ascii_case("identity"))
        .collect();
    if codings.is_empty() {
        return None;
    }
    if crate::orchestrator::answer::scrubbed_kind(headers) {
        return Some(format!(
            "a `{coding}`-encoded answer, which the proxy must read to relay"
        ));
    }
    let accept_encoding = client_headers.get(header::ACCEPT_ENCODING);
    let accepted = codings.iter().all(|c| accepts(accept_encoding, c));
    (!accepted).then(|| format!("a `{coding}`-encoded answer the client did not accept"))
}

/// Whether an `accept-encoding` of `value` allows `coding` (RFC 9110 §12.5.3): named, or
/// `*`, with a non-zero weight; no header allows none (the proxy relays an engine's
/// encoding only when the client asked for it).
fn accepts(value: Option<&HeaderValue>, coding: &str) -> bool {
    let Some(value) = value.and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let norm = |s: &str| {
        let s = s.trim().to_ascii_lowercase();
        s.strip_prefix("x-").map(str::to_owned).unwrap_or(s)
    };
    let coding = norm(coding);
    let mut star = false;
    for item in value.split(',') {
        let mut parts = item.split(';');
        let name = norm(parts.next().unwrap_or_default());
        let weight = parts
            .filter_map(|p| {
                let p = p.trim();
                p.strip_prefix("q=").or_else(|| p.strip_prefix("Q="))
            })
            .find_map(|q| q.trim().parse::<f32>().ok())
            .unwrap_or(1.0);
        if name == coding {
            return weight > 0.0;
        }
        if name == "*" {
            star = weight > 0.0;
        }
    }
    star
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_directives_are_recognised_in_any_spelling() {
        for n in [
            "x-override-rid",
            "x-override-bootstrap-host",
            "x-override-bootstrap-port",
            "x-override-bootstrap-room",
            "x-override-routed-dp-rank",
            "x-override-disagg-prefill-dp-rank",
            "x-override-priority",
            "x-override-conversation-id",
            "x-override-foo",
            "x_override_bootstrap_host",
            "x-data-parallel-rank",
            "x_data_parallel_rank",
        ] {
            let name = HeaderName::from_static(n);
            assert!(is_engine_directive(&name), "{n}");
            assert!(!forwardable_header(&name, true), "{n}");
        }
        for n in [
            "x-override",
            "x-overrides-rid",
            "x-data-parallel-ranks",
            "x-session-id",
        ] {
            assert!(!is_engine_directive(&HeaderName::from_static(n)), "{n}");
        }
    }

    /// Client headers saying `accept-encoding: value`, if any.
    fn client(value: Option<&HeaderValue>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(v) = value {
            h.insert(header::ACCEPT_ENCODING, v.clone());
        }
        h
    }

    #[test]
    fn heads_that_are_not_relayed() {
        let unrelayable = |s, h: &HeaderMap, a: Option<&HeaderValue>| unrelayable(s, h, &client(a));
        let mut h = HeaderMap::new();
        h.insert(
            header::LOCATION,
            HeaderValue::from_static("http://10.0.0.7/x"),
        );
        let why = unrelayable(StatusCode::TEMPORARY_REDIRECT, &h, None).unwrap();
        assert!(!why.contains("10.0.0.7"), "{why}");
        assert!(unrelayable(StatusCode::CREATED, &h, None).is_none());

        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("audio/wav"));
        let gzip = HeaderValue::from_static("br, GZIP;q=0.5");
        assert!(unrelayable(StatusCode::OK, &h, Some(&gzip)).is_none());
        for refused in ["br", "gzip;q=0", "*;q=0", "identity"] {
            let v = HeaderValue::from_static(refused);
            assert!(
                unrelayable(StatusCode::OK, &h, Some(&v)).is_some(),
                "{refused}"
            );
        }
        let star = HeaderValue::from_static("*");
        assert!(unrelayable(StatusCode::OK, &h, Some(&star)).is_none());
        assert!(unrelayable(StatusCode::OK, &h, None).is_some());
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        assert!(unrelayable(StatusCode::OK, &h, Some(&gzip)).is_some());
        h.insert(
            header::CONTENT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        assert!(unrelayable(StatusCode::OK, &h, None).is_none());
    }

    #[test]
    fn heads_that_hide_what_their_body_is_are_not_relayed() {
        let unrelayable = |h: &HeaderMap| unrelayable(StatusCode::OK, h, &client(None));
        let json = HeaderValue::from_static("application/json");
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, json.clone());
        h.insert(header::CONNECTION, HeaderValue::from_static("keep-alive"));
        assert!(unrelayable(&h).is_none());
        for named in ["content-type", "close, Content-Encoding", "content-length"] {
            h.insert(header::CONNECTION, HeaderValue::from_static(named));
            let why = unrelayable(&h).unwrap_or_default();
            assert!(
                why.contains("`connection` header naming `content-"),
                "{named}: {why}"
            );
        }
        let mut h = HeaderMap::new();
        h.append(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        h.append(header::CONTENT_TYPE, json.clone());
        assert!(unrelayable(&h).is_some_and(|w| w.contains("more than one `content-type`")));
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, json);
        h.append(
            header::CONTENT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        h.append(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        assert!(unrelayable(&h).is_some_and(|w| w.contains("more than one `content-encoding`")));
    }
}
