//! KV connectors: the protocol that carries the prompt's KV cache from prefill to decode.
//!
//! A connector is a plan, not a bag of hooks: [`KvConnector::prepare`] turns a request and
//! its [`Route`] into a [`Handoff`] (both legs' bodies and how to dispatch them), and, for
//! protocols whose handoff comes back in the prefill's answer,
//! [`KvConnector::complete`] folds that answer into the decode leg.

use std::sync::Arc;

use async_trait::async_trait;
use http::{HeaderMap, StatusCode};

use crate::body::JsonBody;
use crate::endpoint::Endpoint;
use crate::error::ConnectorError;
use crate::request::PdRequest;
use crate::router::Route;

pub mod vllm;

pub use vllm::VllmNixl;

/// How the two legs of a handoff are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Dispatch {
    /// Send the prefill, wait for its answer, fold it into the decode leg with
    /// [`KvConnector::complete`], then send the decode (vLLM NIXL).
    AfterPrefill,
    /// Send both legs at once; the engines meet through a bootstrap server (SGLang,
    /// vLLM Mooncake).
    Concurrent,
}

/// One leg of a handoff: where it goes and what it carries.
#[derive(Debug, Clone)]
pub struct Leg {
    /// The endpoint.
    pub endpoint: Arc<Endpoint>,
    /// The body sent.
    pub body: JsonBody,
    /// Extra headers for this leg only (a data-parallel rank, say). The orchestrator adds
    /// the request id, the session header and the forwarded client headers itself.
    pub headers: HeaderMap,
}

impl Leg {
    /// A leg to `endpoint` carrying `body`, with no extra header.
    pub fn new(endpoint: Arc<Endpoint>, body: JsonBody) -> Self {
        Leg {
            endpoint,
            body,
            headers: HeaderMap::new(),
        }
    }
}

/// The plan for one request: both legs and how to send them.
#[derive(Debug, Clone)]
pub struct Handoff {
    /// How to dispatch.
    pub dispatch: Dispatch,
    /// The prefill leg.
    pub prefill: Leg,
    /// The decode leg.
    pub decode: Leg,
}

/// The prefill's successful answer.
///
/// The body is kept as received; a connector reads what it needs with
/// [`field`](Self::field) (one top-level field, found without parsing the rest) or
/// [`json`](Self::json) (the whole top level).
#[derive(Debug)]
pub struct PrefillAnswer {
    /// The status (2xx).
    pub status: StatusCode,
    /// The headers.
    pub headers: HeaderMap,
    /// The body, as received.
    pub body: bytes::Bytes,
}

impl PrefillAnswer {
    /// The raw value of the top-level field `key` of the answer, if present.
    ///
    /// # Errors
    ///
    /// [`BodyError`](crate::error::BodyError) when the answer is not a JSON object.
    pub fn field(&self, key: &str) -> Result<Option<bytes::Bytes>, crate::error::BodyError> {
        crate::body::top_level_field(&self.body, key)
    }

    /// The answer's whole top level.
    ///
    /// # Errors
    ///
    /// [`BodyError`](crate::error::BodyError) when the answer is not a JSON object.
    pub fn json(&self) -> Result<JsonBody, crate::error::BodyError> {
        JsonBody::parse_bytes(&self.body)
    }
}

/// What [`KvConnector::complete`] found in the prefill's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KvOutcome {
    /// The handoff was folded into the decode leg.
    Handed,
    /// The answer carried no handoff (for vLLM: the prefill ended for another reason than
    /// its length, or the engine runs no KV connector). The decode leg is unchanged and
    /// would compute the prompt itself; the orchestrator decides whether that is allowed.
    Missing,
}

/// One KV-transfer protocol.
///
/// `prepare` is pure: it builds both legs from the client's request with no I/O and
/// never waits. `complete` runs only for [`Dispatch::AfterPrefill`], after a 2xx prefill
/// answer; it is async because some protocols wait there for the engines' own signal
/// (LMCache's KV-ready notifications); NIXL's fold is immediate.
#[async_trait]
pub trait KvConnector: Send + Sync + 'static {
    /// The connector's name, for logs and errors.
    fn name(&self) -> &'static str;

    /// Build the handoff for `req` over `route`.
    ///
    /// # Errors
    ///
    /// [`ConnectorError`] when the route or request cannot carry this protocol (no prefill
    /// endpoint, an endpoint without the connector's configuration).
    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError>;

    /// Fold the prefill's answer into the decode leg.
    ///
    /// # Errors
    ///
    /// [`ConnectorError`] when the answer's handoff is malformed.
    async fn complete(
        &self,
        _handoff: &mut Handoff,
        _answer: &PrefillAnswer,
    ) -> Result<KvOutcome, ConnectorError> {
        Ok(KvOutcome::Handed)
    }
}

#[async_trait]
impl<T: KvConnector + ?Sized> KvConnector for Arc<T> {
    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        (**self).prepare(route, req)
    }

    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<KvOutcome, ConnectorError> {
        (**self).complete(handoff, answer).await
    }
}
