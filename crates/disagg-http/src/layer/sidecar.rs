//! The sidecar mode of [`PdLayer`]: the decode leg is the inner service, called in
//! process.
//!
//! The layer wraps the decode engine's own service. The orchestrator sends its legs
//! through a transport that hands every request addressed to the local decode endpoint
//! (by default `http://local-decode.invalid`, a name that never resolves) to a clone of
//! the inner service, converting the body, and everything else to an
//! [`HttpTransport`]: the decode leg costs no network hop.
//!
//! The prefill endpoint is either named by an upstream scheduler in a request header
//! (llm-d's `x-prefiller-host-port: host:port`, [`PREFILLER_HEADER`]) or, without the
//! header, picked from the prefill endpoints of the sidecar's [`EndpointSource`] by a
//! [`Pick`] policy (round robin unless told otherwise; the policies to choose from are
//! `disagg-affinity`'s). A named prefill endpoint is
//! accepted only when it is one of the source's prefill endpoints (the allow-list),
//! unless [`accept_any_prefiller`](PdLayer::accept_any_prefiller) turned the check off;
//! otherwise the request is answered 400 and the named host is never contacted. The
//! header is removed from every request before the inner service sees it, and never
//! sent on a leg.
//!
//! The local decode is called with the standard OpenAI path of its API
//! (`/v1/chat/completions` or `/v1/completions`), an origin-form URI, and the headers
//! the orchestrator builds for a leg (`content-type`, `x-request-id`, the session header
//! and the configured forwarded headers); the inner service must accept requests with
//! an `http_body_util::Full<Bytes>` body (axum's routers and `Route`s accept any body),
//! or the body type chosen with [`local_body`](PdLayer::local_body).
//!

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use bytes::Bytes;
use disagg_affinity::RoundRobin;
use disagg_connectors::vllm::VllmNixl;
use disagg_core::endpoint::EndpointError;
use disagg_core::error::{BoxError, RouteError, TransportError};
use disagg_core::orchestrator::PrefillFailure;
use disagg_core::router::{Pick, RequestView, Route, Router};
use disagg_core::transport::Transport;
use disagg_core::transport::{BoxBody, ResponseFuture as TransportFuture};
use disagg_core::{
    Endpoint, EndpointSource, KvConnector, Orchestrator, Role, endpoint::EndpointSet,
    orchestrator::OrchestratorConfig,
};
use http::header::HeaderName;
use http::uri::Authority;
use http::{HeaderMap, Request, Response, Uri};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tower::{Layer, Service, ServiceExt};

use super::{PdLayer, PdMiddleware, default_paths};
use crate::{HttpTransport, PdService, PdServiceConfig};

/// The request header in which an upstream scheduler names the prefill endpoint of a
/// sidecar, as `host:port` (llm-d's inference scheduler,
/// `llm-d/llm-d-inference-scheduler pkg/common/routing/common.go`).
pub const PREFILLER_HEADER: HeaderName = HeaderName::from_static("x-prefiller-host-port");

/// The default URL of a sidecar's local decode endpoint. `.invalid` is reserved (RFC
/// 2606) and never resolves, so a leg addressed to it can only ever reach the inner
/// service.
pub const LOCAL_DECODE_URL: &str = "http://local-decode.invalid";

/// What a sidecar does with a request that names no prefill endpoint.
#[derive(Clone)]
enum Unnamed {
    /// Pick one of the source's prefill endpoints.
    Pick(Arc<dyn Pick>),
    /// Send it to the local decode alone, which computes the prompt itself.
    DecodeOnly,
}

/// The sidecar mode of [`PdLayer`]: the prefill leg goes to a remote prefill endpoint,
/// the decode leg to the inner service, in process.
///
/// `L` is the request body type the inner service is called with for the decode leg
/// (built from the leg's bytes).
pub struct Sidecar<L = Full<Bytes>> {
    source: Arc<dyn EndpointSource>,
    connector: Arc<dyn KvConnector>,
    remote: Arc<dyn Transport>,
    config: OrchestratorConfig,
    local: Arc<Endpoint>,
    header: HeaderName,
    any_prefiller: bool,
    unnamed: Unnamed,
    _body: PhantomData<fn() -> L>,
}

impl<L> Clone for Sidecar<L> {
    fn clone(&self) -> Self {
        Sidecar {
            source: Arc::clone(&self.source),
            connector: Arc::clone(&self.connector),
            remote: Arc::clone(&self.remote),
            config: self.config.clone(),
            local: Arc::clone(&self.local),
            header: self.header.clone(),
            any_prefiller: self.any_prefiller,
            unnamed: self.unnamed.clone(),
            _body: PhantomData,
        }
    }
}

impl<L> fmt::Debug for Sidecar<L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sidecar")
            .field("connector", &self.connector.name())
            .field("config", &self.config)
            .field("local", &self.local.id())
            .field("header", &self.header)
            .field("any_prefiller", &self.any_prefiller)
            .field(
                "unnamed",
                &match self.unnamed {
                    Unnamed::Pick(_) => "pick",
                    Unnamed::DecodeOnly => "decode-only",
                },
            )
            .finish_non_exhaustive()
    }
}

impl PdLayer<Sidecar> {
    /// Sidecar mode: the prefill endpoints are those of `prefill` (the allow-list of
    /// the prefiller header, and the pool picked from without it); the decode leg is
    /// the inner service. Defaults: the vLLM NIXL connector, round-robin picks, an
    /// [`HttpTransport`] for the prefill leg, [`PREFILLER_HEADER`] checked against the
    /// allow-list, the local decode endpoint at [`LOCAL_DECODE_URL`].
    pub fn sidecar(prefill: impl EndpointSource) -> Self {
        // A constant, not input: the unit tests parse it.
        let local = Arc::new(
            Endpoint::new(LOCAL_DECODE_URL, Role::Decode).expect("LOCAL_DECODE_URL parses"),
        );
        PdLayer {
            mode: Sidecar {
                source: Arc::new(prefill),
                connector: Arc::new(VllmNixl::new()),
                remote: Arc::new(HttpTransport::default()),
                config: OrchestratorConfig::default(),
                local,
                header: PREFILLER_HEADER,
                any_prefiller: false,
                unnamed: Unnamed::Pick(Arc::new(RoundRobin::new())),
                _body: PhantomData,
            },
            paths: default_paths(),
            service: PdServiceConfig::default(),
        }
    }
}

impl<L> PdLayer<Sidecar<L>> {
    /// Hand KV over with `connector` (default: [`VllmNixl`]).
    pub fn connector(mut self, connector: impl KvConnector) -> Self {
        self.mode.connector = Arc::new(connector);
        self
    }

    /// Pick the prefill endpoint of a request that names none with `pick` (default:
    /// round robin; the policies are `disagg-affinity`'s, such as its `LeastInFlight`,
    /// `PowerOfTwo` or `CacheAware`).
    pub fn pick(mut self, pick: impl Pick) -> Self {
        self.mode.unnamed = Unnamed::Pick(Arc::new(pick));
        self
    }

    /// Serve a request that names no prefill endpoint with the local decode alone,
    /// which computes the prompt itself (llm-d's sidecar does this). The answer carries
    /// `x-disagg-handoff: decode-only`.
    pub fn decode_only_without_prefiller(mut self) -> Self {
        self.mode.unnamed = Unnamed::DecodeOnly;
        self
    }

    /// Read the prefill endpoint from `header` instead of [`PREFILLER_HEADER`].
    pub fn prefiller_header(mut self, header: HeaderName) -> Self {
        self.mode.header = header;
        self
    }

    /// Accept any `host:port` in the prefiller header, not only the source's prefill
    /// endpoints. Only for deployments where every client of the sidecar is trusted
    /// (the header then lets a client make the sidecar connect anywhere); such a
    /// prefill endpoint carries no connector data (an SGLang bootstrap port, say).
    pub fn accept_any_prefiller(mut self) -> Self {
        self.mode.any_prefiller = true;
        self
    }

    /// Send the prefill leg (and a connector's own requests, such as Mooncake's
    /// bootstrap query) through `transport` (default: an [`HttpTransport`]).
    pub fn transport(mut self, transport: impl Transport) -> Self {
        self.mode.remote = Arc::new(transport);
        self
    }

    /// Use `config` for the orchestrator (timeouts, forwarded headers, missing-KV
    /// policy). The prefiller header is never forwarded, even if listed.
    pub fn orchestrator_config(mut self, config: OrchestratorConfig) -> Self {
        self.mode.config = config;
        self
    }

    /// Name the local decode endpoint `url` (`http://host[:port]`; default
    /// [`LOCAL_DECODE_URL`]), e.g. the engine's own address, for logs and connectors
    /// that read it. Legs addressed to it reach the inner service, never the network.
    ///
    /// # Errors
    ///
    /// [`EndpointError`] when `url` is not an `http://host[:port]` URL.
    pub fn local_url(mut self, url: &str) -> Result<Self, EndpointError> {
        self.mode.local = Arc::new(Endpoint::new(url, Role::Decode)?);
        Ok(self)
    }

    /// Call the inner service's decode leg with a request body of type `L2` (built
    /// from the leg's bytes) instead of `http_body_util::Full<Bytes>`, for inner
    /// services that take one body type only (e.g. `axum::body::Body`).
    pub fn local_body<L2>(self) -> PdLayer<Sidecar<L2>> {
        let m = self.mode;
        PdLayer {
            mode: Sidecar {
                source: m.source,
                connector: m.connector,
                remote: m.remote,
                config: m.config,
                local: m.local,
                header: m.header,
                any_prefiller: m.any_prefiller,
                unnamed: m.unnamed,
                _body: PhantomData,
            },
            paths: self.paths,
            service: self.service,
        }
    }
}

impl<S, L, RB> Layer<S> for PdLayer<Sidecar<L>>
where
    S: Service<Request<L>, Response = Response<RB>> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
    L: From<Bytes> + Send + 'static,
{
    type Service = PdMiddleware<S>;

    /// Builds the sidecar's orchestrator around a clone of `inner`. Under axum's
    /// `Router::layer` this runs once per route; all of them share the source, the
    /// connector, the pick policy, the transport and the local endpoint's load count.
    fn layer(&self, inner: S) -> PdMiddleware<S> {
        let m = &self.mode;
        let check = Arc::new(PrefillerCheck {
            header: m.header.clone(),
            any: m.any_prefiller,
        });
        let transport = LocalDecode::<S, L> {
            inner: inner.clone(),
            local: m.local.authority().clone(),
            remote: Arc::clone(&m.remote),
            _body: PhantomData,
        };
        let router = SidecarRouter {
            local: Arc::clone(&m.local),
            check: Arc::clone(&check),
            unnamed: m.unnamed.clone(),
        };
        let mut config = m.config.clone();
        config.forward_headers.retain(|h| *h != m.header);
        if matches!(m.unnamed, Unnamed::DecodeOnly) {
            // The router names no prefill for such requests on purpose.
            config.prefill_failure = PrefillFailure::DecodeOnly;
        }
        let orchestrator =
            Orchestrator::builder(Arc::clone(&m.source), transport, Arc::clone(&m.connector))
                .router(router)
                .config(config)
                .build();
        PdMiddleware {
            inner,
            pd: PdService::with_config(orchestrator, self.service.clone()),
            paths: Arc::clone(&self.paths),
            prefiller: Some(check),
        }
    }
}

// === prefiller header ===

/// The prefiller header could not be honoured.
#[derive(Debug, thiserror::Error)]
pub(super) enum PrefillerError {
    /// Not exactly one `host:port`.
    #[error("`{header}` must be one host:port, got {value:?}")]
    Malformed { header: HeaderName, value: String },
    /// A `host:port` that is not an allowed prefill endpoint.
    #[error("`{header}` names {value:?}, which is not an allowed prefill endpoint")]
    NotAllowed { header: HeaderName, value: String },
}

impl PrefillerError {
    pub(super) fn code(&self) -> &'static str {
        match self {
            PrefillerError::Malformed { .. } => "invalid_prefiller",
            PrefillerError::NotAllowed { .. } => "prefiller_not_allowed",
        }
    }
}

/// The sidecar's reading of the prefiller header.
#[derive(Debug)]
pub(super) struct PrefillerCheck {
    pub(super) header: HeaderName,
    /// Accept any `host:port`, not only the set's prefill endpoints.
    any: bool,
}

impl PrefillerCheck {
    /// The prefill endpoint `headers` name, if any: one of `set`'s prefill endpoints,
    /// or (when any is accepted) a new endpoint at that address. No I/O.
    pub(super) fn resolve(
        &self,
        headers: &HeaderMap,
        set: &EndpointSet,
    ) -> Result<Option<Arc<Endpoint>>, PrefillerError> {
        let mut values = headers.get_all(&self.header).iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        let malformed = || PrefillerError::Malformed {
            header: self.header.clone(),
            value: String::from_utf8_lossy(value.as_bytes()).into_owned(),
        };
        if values.next().is_some() {
            return Err(malformed());
        }
        let authority = value
            .to_str()
            .ok()
            .map(str::trim)
            .and_then(|v| v.parse::<Authority>().ok())
            .filter(|a| a.port_u16().is_some() && !a.as_str().contains('@'))
            .ok_or_else(malformed)?;
        let port = authority.port_u16();
        let host = authority.host();
        if let Some(ep) = set.by_role(Role::Prefill).iter().find(|ep| {
            let a = ep.authority();
            a.host().eq_ignore_ascii_case(host) && a.port_u16().unwrap_or(80) == port.unwrap_or(80)
        }) {
            return Ok(Some(Arc::clone(ep)));
        }
        if self.any {
            return Endpoint::new(&format!("http://{authority}"), Role::Prefill)
                .map(|ep| Some(Arc::new(ep)))
                .map_err(|_| malformed());
        }
        Err(PrefillerError::NotAllowed {
            header: self.header.clone(),
            value: authority.to_string(),
        })
    }
}

// === impl SidecarRouter ===

/// The sidecar's router: the decode is always the local endpoint; the prefill is the
/// one the header names, else a pick from the set (or none, decode-only).
struct SidecarRouter {
    local: Arc<Endpoint>,
    check: Arc<PrefillerCheck>,
    unnamed: Unnamed,
}

impl Router for SidecarRouter {
    fn select(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        let local = Arc::clone(&self.local);
        match self.check.resolve(req.headers, set) {
            Ok(Some(prefill)) => Ok(Route::new(Some(prefill), local)),
            Ok(None) => match (&self.unnamed, set.by_role(Role::Prefill)) {
                (Unnamed::DecodeOnly, _) | (Unnamed::Pick(_), []) => Ok(Route::new(None, local)),
                (Unnamed::Pick(pick), eps) => {
                    let i = pick.pick(req, eps).min(eps.len() - 1);
                    Ok(Route::new(Some(Arc::clone(&eps[i])), local))
                }
            },
            // The layer refused such a request before it got here; only an endpoint
            // set that changed in between lands here.
            Err(_) => Err(RouteError::NoPrefill),
        }
    }
}

/// Remove from a request the sidecar passes to its engine the headers the engines read
/// as where or as what a request runs (`x-data-parallel-rank`, SGLang's `x-override-*`,
/// either spelling), which the legs never carry from a client either
/// ([`disagg_core::proto::forwardable_header`]). The client's credentials are the
/// engine's business here, as they were before the sidecar stood in front of it.
pub(super) fn strip_engine_directives(headers: &mut HeaderMap) {
    // `forwardable_header` with `authorization` allowed refuses `x-api-key` and the
    // directives; the key stays.
    crate::forward::remove_where(headers, |name| {
        name.as_str() != "x-api-key" && !disagg_core::proto::forwardable_header(name, true)
    });
}

// === impl LocalDecode ===

/// The sidecar's transport: legs addressed to the local decode endpoint go to the
/// inner service in process, all others to the remote transport.
struct LocalDecode<S, L> {
    inner: S,
    local: Authority,
    remote: Arc<dyn Transport>,
    _body: PhantomData<fn() -> L>,
}

impl<S, L, RB> Transport for LocalDecode<S, L>
where
    S: Service<Request<L>, Response = Response<RB>> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
    L: From<Bytes> + Send + 'static,
{
    fn send(&self, req: Request<Bytes>) -> TransportFuture {
        if req.uri().authority() != Some(&self.local) {
            return self.remote.send(req);
        }
        let (mut parts, body) = req.into_parts();
        // A server hands its service origin-form targets (`/v1/completions`).
        let mut uri = http::uri::Parts::default();
        uri.path_and_query = parts.uri.path_and_query().cloned();
        if let Ok(u) = Uri::from_parts(uri) {
            parts.uri = u;
        }
        let req = Request::from_parts(parts, L::from(body));
        let svc = self.inner.clone();
        Box::pin(async move {
            match svc.oneshot(req).await {
                Ok(resp) => {
                    Ok(resp.map(|b| BoxBody::new(crate::tap::unshared(b).map_err(Into::into))))
                }
                Err(e) => Err(TransportError::Io(e.into())),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(urls: &[&str]) -> EndpointSet {
        EndpointSet::new(
            urls.iter()
                .map(|u| Arc::new(Endpoint::new(u, Role::Prefill).unwrap())),
        )
    }

    fn headers(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(PREFILLER_HEADER, v.parse().unwrap());
        }
        h
    }

    fn check(any: bool) -> PrefillerCheck {
        PrefillerCheck {
            header: PREFILLER_HEADER,
            any,
        }
    }

    #[test]
    fn prefiller_on_the_allow_list_resolves_to_its_endpoint() {
        let s = set(&["http://10.0.0.5:8100", "http://P.example:8100"]);
        let ep = check(false)
            .resolve(&headers(&["10.0.0.5:8100"]), &s)
            .unwrap()
            .unwrap();
        assert!(Arc::ptr_eq(&ep, &s.by_role(Role::Prefill)[0]));
        let ep = check(false)
            .resolve(&headers(&["p.example:8100"]), &s)
            .unwrap()
            .unwrap();
        assert!(Arc::ptr_eq(&ep, &s.by_role(Role::Prefill)[1]));
        assert!(
            check(false)
                .resolve(&HeaderMap::new(), &s)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn prefiller_off_the_list_or_malformed_is_refused() {
        let s = set(&["http://10.0.0.5:8100"]);
        for (values, code) in [
            (&["10.0.0.5:8101"][..], "prefiller_not_allowed"),
            (&["10.0.0.6:8100"][..], "prefiller_not_allowed"),
            (&["10.0.0.5"][..], "invalid_prefiller"),
            (&["10.0.0.5:8100,10.0.0.6:8100"][..], "invalid_prefiller"),
            (&["user@10.0.0.5:8100"][..], "invalid_prefiller"),
            (&["10.0.0.5:8100", "10.0.0.5:8100"][..], "invalid_prefiller"),
            (&["http://10.0.0.5:8100"][..], "invalid_prefiller"),
            (&[""][..], "invalid_prefiller"),
        ] {
            let e = check(false).resolve(&headers(values), &s).unwrap_err();
            assert_eq!(e.code(), code, "{values:?}: {e}");
        }
    }

    #[test]
    fn any_prefiller_builds_an_endpoint_when_the_check_is_off() {
        let s = set(&["http://10.0.0.5:8100"]);
        let ep = check(true)
            .resolve(&headers(&["10.9.9.9:7000"]), &s)
            .unwrap()
            .unwrap();
        assert_eq!(ep.id().as_str(), "http://10.9.9.9:7000");
        assert_eq!(ep.role(), Role::Prefill);
        assert!(check(true).resolve(&headers(&["nope"]), &s).is_err());
    }

    #[test]
    fn the_local_decode_url_parses() {
        let ep = Endpoint::new(LOCAL_DECODE_URL, Role::Decode).unwrap();
        assert_eq!(ep.authority().as_str(), "local-decode.invalid");
    }
}
