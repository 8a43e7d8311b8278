//! KV connectors: the protocol that carries the prompt's KV cache from prefill to decode.
//!
//! A connector is a plan, not a bag of hooks: [`KvConnector::prepare`] turns a request and
//! its [`Route`] into a [`Handoff`] (both legs' bodies and how to dispatch them). Two
//! optional async steps complete the plan where a protocol needs the engines' word:
//! [`KvConnector::resolve`] before any leg is sent (vLLM Mooncake asks the prefill's
//! bootstrap server for its engine id), and [`KvConnector::complete`] after the prefill
//! answered, for protocols whose handoff comes back in that answer (vLLM NIXL).
//!
//! How the legs are sent is the plan's [`Dispatch`], not the orchestrator's choice: the
//! orchestrator runs every connector through one code path and knows no engine. The
//! engines' protocols live in the `disagg-connectors` crate, one module and one cargo
//! feature per engine family, so a new protocol is one module there (its guide,
//! `docs/connectors.md`, walks through writing one):
//!
//! | connector | dispatch | handoff |
//! |---|---|---|
//! | `disagg_connectors::vllm::VllmNixl` | [`Dispatch::AfterPrefill`] | `kv_transfer_params` from the prefill's answer |
//! | `disagg_connectors::sglang::SglangBootstrap` | [`Dispatch::Concurrent`] | `bootstrap_host/port/room` on both legs |
//! | `disagg_connectors::vllm::VllmMooncake` | [`Dispatch::Concurrent`] | `transfer_id` + the prefill's bootstrap address and engine id |
//! | `disagg_connectors::lmcache::Lmcache` | [`Dispatch::AfterPrefill`] | the first token from the prefill's answer; KV pushed to the decode, ready on a [`KvGate`] |
//!
//! A plan may carry more for protocols whose prefill already produces part of the
//! answer (LMCache's first token), all of it data: a leg's own [`Leg::api`], the first
//! bytes of the client's stream ([`Handoff::lead`]), what the decode leg waits for
//! ([`Handoff::gate`]), and the change of form from the decode's answer to the client's
//! ([`Handoff::reshape`], a [`Reshape`] the adapter provides); [`HandoffFound::Finished`]
//! says the prefill's answer is the whole answer and no decode leg is sent. No part of
//! the trait sees an HTTP response.

use std::sync::Arc;

use async_trait::async_trait;
use http::{HeaderMap, StatusCode};

use crate::endpoint::Endpoint;
use crate::error::ConnectorError;
use crate::outcome::Outcome;
use crate::policy::Decision;
use crate::request::{Api, PdRequest};
use crate::router::Route;
use crate::transport::{BoxBody, Transport};
use disagg_json::InvalidParam;
use disagg_json::JsonBody;

/// How the two legs of a handoff are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Dispatch {
    /// Send the prefill, wait for its answer, fold it into the decode leg with
    /// [`KvConnector::complete`], then send the decode (vLLM NIXL).
    AfterPrefill,
    /// Send both legs at once; the engines meet through a bootstrap server (SGLang,
    /// vLLM Mooncake). The decode's answer is relayed as soon as its head arrives; the
    /// prefill's answer is read alongside, and a prefill that fails ends the request
    /// (the decode leg is dropped) wherever it is.
    Concurrent,
    /// Send both legs at once, as [`Concurrent`](Self::Concurrent), but relay the
    /// decode's answer only once the prefill's has come in whole, and fold the prefill's
    /// answer into the plan with [`KvConnector::complete`] first: the client's answer
    /// holds part of the prefill's (SGLang's native `/generate` with `return_logprob`:
    /// the prompt's logprobs, which only the prefill computed, are merged into the
    /// decode's answer by the plan's [`Reshape`], as SGLang's router does).
    Joined,
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
    /// The API this leg is posted to; `None` (the default) is the client's. LMCache sends
    /// both legs of a chat request to `/v1/completions`.
    pub api: Option<Api>,
}

impl Leg {
    /// A leg to `endpoint` carrying `body`, with no extra header, posted to the client's
    /// API.
    pub fn new(endpoint: Arc<Endpoint>, body: JsonBody) -> Self {
        Leg {
            endpoint,
            body,
            headers: HeaderMap::new(),
            api: None,
        }
    }

    /// Name the engine's data-parallel `rank` for this leg in the `X-Data-Parallel-Rank`
    /// header, if the route picked one (`None` leaves the choice to the engine). The
    /// header is a fact of the engine an endpoint stands for, the same for every
    /// protocol that pins a rank; clients never set it.
    pub fn set_rank(&mut self, rank: Option<u32>) {
        if let Some(rank) = rank {
            self.headers.insert(
                crate::endpoint::DATA_PARALLEL_RANK,
                http::HeaderValue::from(rank),
            );
        }
    }
}

/// What a sequential handoff waits for between the prefill's answer and the decode leg:
/// the KV's arrival at the decode engine, when the engines say so out of band (LMCache's
/// ZMQ notifications).
///
/// A gate is part of the plan ([`Handoff::gate`]), so it lives exactly as long as the
/// request's handoff: dropping the plan drops whatever the gate registered.
#[async_trait]
pub trait KvGate: Send + Sync + std::fmt::Debug + 'static {
    /// Resolves when the decode leg may be sent. The orchestrator bounds the wait with
    /// the handoff budget (`handoff_timeout`).
    ///
    /// # Errors
    ///
    /// [`ConnectorError`] when the KV will never be ready; the request fails with 502.
    async fn ready(&self) -> Result<(), ConnectorError>;
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
    /// The connector's own state, carried from [`KvConnector::prepare`] to
    /// [`KvConnector::resolve`] and [`KvConnector::complete`] (a
    /// transfer id, say).
    pub ext: http::Extensions,
    /// The first bytes of a streaming answer, known once the prefill answered (set by
    /// [`KvConnector::complete`]; [`Dispatch::AfterPrefill`] only). When set and the
    /// client asked for a stream, the client's response (200, `text/event-stream`) starts
    /// at once with these bytes, before the decode leg is sent; what fails afterwards
    /// ends the stream with an error event. Ignored for other answers.
    pub lead: Option<bytes::Bytes>,
    /// What the decode leg waits for after the prefill's answer ([`Dispatch::AfterPrefill`]
    /// only), within the handoff budget.
    pub gate: Option<Arc<dyn KvGate>>,
    /// The change of form from the decode's answer to the client's, when the legs speak
    /// another API than the client (set by [`KvConnector::complete`]).
    pub reshape: Option<Arc<dyn Reshape>>,
    /// Where the decode's own handoff goes, when the connector keeps it for a later
    /// request (set by [`KvConnector::prepare`]; vLLM NIXL's bidirectional KV). `None`,
    /// the default, keeps nothing and costs nothing.
    pub returned: Option<Arc<dyn ReturnedHandoff>>,
}

/// The receiver of the KV handoff a decode engine writes into its own successful answer
/// (the value of its `kv_transfer_params`: a decode running vLLM 0.33's bidirectional
/// NIXL names its own blocks there, for the next turn's prefill to pull).
///
/// The orchestrator still keeps the value from the client (it is blanked in place, as
/// every handoff is); when a plan carries a receiver ([`Handoff::returned`]), the
/// value's bytes are given to it as the answer's scrubbing finds them, once per answer,
/// and never held longer than the scrubbing holds them anyway. Only a 2xx answer of the
/// [`Dispatch::AfterPrefill`] path is read for it; the receiver drops with the request.
pub trait ReturnedHandoff: Send + Sync + std::fmt::Debug + 'static {
    /// The decode's handoff value: raw JSON as the engine wrote it, at most the
    /// scrubber's ceiling (1 MiB), maybe cut short when the answer ended inside it. Peer
    /// bytes: validate before keeping. Called on the response body's poll: must be
    /// cheap and must not block.
    fn returned(&self, value: &[u8]);

    /// The plan's prefill leg certainly never reached its engine (no connection could
    /// be made): what `prepare` took for it (a kept handoff, used once) may be kept
    /// for the request's next attempt. Called at most once, before the attempt is
    /// reported; the default does nothing.
    fn unsent(&self) {}
}

/// The change of form from the decode's answer body to the client's, for a plan whose
/// legs speak another API than the client (LMCache serves chat through completions, and
/// its answer starts with the prefill's first token).
///
/// The orchestrator applies it to a 2xx answer's body only (an error answer passes
/// through as the engine wrote it) and drops the answer's `content-length`, which no
/// longer holds. After [`HandoffFound::Finished`] it gets an empty body (no decode leg was
/// sent) and makes the whole answer from the plan.
pub trait Reshape: Send + Sync + std::fmt::Debug + 'static {
    /// The client's body, made from the decode's. It must stream what it can as the
    /// decode's frames arrive (a non-streaming answer may be read whole first).
    fn body(&self, decode: BoxBody) -> BoxBody;
}

impl Handoff {
    /// A plan with both legs and no connector state.
    pub fn new(dispatch: Dispatch, prefill: Leg, decode: Leg) -> Self {
        Handoff {
            dispatch,
            prefill,
            decode,
            ext: http::Extensions::new(),
            lead: None,
            gate: None,
            reshape: None,
            returned: None,
        }
    }
}

/// The prefill's successful answer.
///
/// The body is kept as received; a connector reads what it needs from
/// [`body`](Self::body) with `disagg-json`: [`top_level_field`](disagg_json::top_level_field)
/// (one top-level field, found without parsing the rest),
/// [`top_level_read`](disagg_json::top_level_read) and
/// [`top_level_read_pair`](disagg_json::top_level_read_pair) (one or two fields read by
/// the connector's own validating reader, in one pass) or
/// [`JsonBody::parse_bytes`] (the whole top level).
#[derive(Debug, Clone)]
pub struct PrefillAnswer {
    /// The status (2xx).
    pub status: StatusCode,
    /// The headers.
    pub headers: HeaderMap,
    /// The body, as received.
    pub body: bytes::Bytes,
}

/// What [`KvConnector::complete`] found in the prefill's answer (a step's result, not
/// how anything ended: that is an [`Outcome`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HandoffFound {
    /// The handoff was folded into the decode leg.
    Handed,
    /// The answer carried no handoff (for vLLM: the prefill ended for another reason than
    /// its length, or the engine runs no KV connector). The decode leg is unchanged and
    /// would compute the prompt itself; the orchestrator decides whether that is allowed.
    Missing,
    /// The prefill's answer is the whole answer (LMCache: its one token already ended
    /// the generation): no decode leg is sent, and the client's answer is
    /// the plan's [`Reshape`] of an empty body (after [`Handoff::lead`] for a stream).
    Finished,
    /// The answer carried a handoff the decode engine cannot use (vLLM NIXL: a dict with
    /// `do_remote_prefill` but without block ids, or without the prefill's engine id,
    /// host, port or request id). The decode leg is unchanged, as for
    /// [`Missing`](Self::Missing): a partial dict kills a vLLM 0.33 decode's engine core
    /// or leaves its request waiting for KV that never comes, so it is never sent on.
    /// The orchestrator treats it as a missing handoff, logs `problem` with the prefill
    /// endpoint and counts it
    /// ([`OrchestratorStats::invalid_handoffs`](crate::orchestrator::OrchestratorStats::invalid_handoffs)).
    Incomplete {
        /// What is wrong, in words (`"remote_block_ids is missing or empty"`).
        problem: &'static str,
    },
}

/// One KV-transfer protocol.
///
/// The orchestrator calls `check` once per request (pure, before routing), then, per
/// attempt: `prepare` (pure: both legs from the client's request, no I/O, never waits), then `resolve` (async, before any leg is sent; most
/// connectors need nothing here), then sends the legs as the plan's [`Dispatch`] says,
/// calling `complete` between the legs for [`Dispatch::AfterPrefill`]. When the request
/// has ended, `observe` hears how.
///
/// A retry runs `prepare` again, so per-attempt values (an SGLang room, a Mooncake
/// transfer id) must be drawn there, never cached per request.
#[async_trait]
pub trait KvConnector: Send + Sync + 'static {
    /// The connector's name, for logs and errors.
    fn name(&self) -> &'static str;

    /// Whether this connector can carry `req`, decided once per request before routing.
    ///
    /// Pure and cheap: no I/O. A connector that sends the prefill engine other values
    /// than the client's for some fields (vLLM's prefill rewriter) refuses here
    /// what the engines would refuse in those fields, since the prefill engine never
    /// sees them and the decode would only refuse them after the prefill ran; and it
    /// answers [`Decision::Direct`] for requests whose handoff its engines drop (vLLM
    /// beam search), which are then served by a decode engine alone. The default carries
    /// everything.
    ///
    /// # Errors
    ///
    /// [`InvalidParam`] when an engine would refuse the request; answered 400 with no
    /// engine contacted.
    fn check(&self, _req: &PdRequest) -> Result<Decision, InvalidParam> {
        Ok(Decision::Disaggregate)
    }

    /// Build the handoff for `req` over `route`.
    ///
    /// # Errors
    ///
    /// [`ConnectorError`] when the route or request cannot carry this protocol (no prefill
    /// endpoint, an endpoint without the connector's configuration).
    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError>;

    /// Complete the plan with what only the engines can tell, before any leg is sent.
    ///
    /// `transport` reaches the engines (vLLM Mooncake asks the prefill's bootstrap server
    /// `GET /query` for its engine id, and caches the answer). Implementations must cache
    /// what they learn: this runs on every request. The default does nothing.
    ///
    /// # Errors
    ///
    /// [`ConnectorError`] when the engines cannot tell what the plan needs; the request
    /// fails with 502 and no leg is sent.
    async fn resolve(
        &self,
        _handoff: &mut Handoff,
        _transport: &dyn Transport,
    ) -> Result<(), ConnectorError> {
        Ok(())
    }

    /// Fold the prefill's answer into the decode leg.
    ///
    /// # Errors
    ///
    /// [`ConnectorError`] when the answer's handoff is malformed.
    async fn complete(
        &self,
        _handoff: &mut Handoff,
        _answer: &PrefillAnswer,
    ) -> Result<HandoffFound, ConnectorError> {
        Ok(HandoffFound::Handed)
    }

    /// Optional feedback: how an attempt over `route` ended (see [`Outcome`]). A
    /// connector that caches what it learned from the route's engines forgets it when
    /// the attempt failed ([`Outcome::PrefillFailed`], [`Outcome::DecodeFailed`]; which
    /// leg's engine is to blame is the report's [`LegOutcome`](crate::outcome::LegOutcome),
    /// heard by a [`Listener`](crate::outcome::Listener)), not when the request was
    /// refused ([`Outcome::PrefillRefused`]: the prefill's 4xx, or the connector's own
    /// refusal before any leg was sent; [`Outcome::DecodeRefused`]: the decode's own
    /// 4xx; the request's fault, which every bad prompt gets) nor when the client left.
    /// The default does nothing. Called once per attempt; must be cheap and must not
    /// block.
    fn observe(&self, _route: &Route, _outcome: Outcome) {}

    /// The body of the leg that releases the KV a prefill handed over for `decode`, when
    /// the request ended before its decode leg took it
    /// ([`KvRelease::AbortDecode`](crate::orchestrator::KvRelease::AbortDecode),
    /// [`Dispatch::AfterPrefill`] only): the orchestrator posts it to `decode`'s endpoint
    /// as `api`, with the leg's headers, and drops it at its response head. A protocol
    /// whose decode engine frees unclaimed KV by itself, or that has no such leg,
    /// returns `None` (the default), and nothing is sent.
    fn release_leg(&self, _api: Api, _decode: &Leg) -> Option<bytes::Bytes> {
        None
    }

    /// Whether this protocol's engines must run one engine build to pair (used by
    /// `disagg_resilience::pairing::check_versions` when both engines
    /// tell their version): the protocol's handshake compares builds. The default
    /// checks no version.
    fn equal_versions(&self) -> bool {
        false
    }

    /// Whether this protocol can hand KV from a prefill engine of tensor-parallel size
    /// `prefill_tp` to a decode engine of size `decode_tp` (used by
    /// `disagg_pairing::check_pair` when both endpoints declare a size). The default
    /// accepts equal sizes only.
    fn bridges_tp(&self, prefill_tp: u32, decode_tp: u32) -> bool {
        prefill_tp == decode_tp
    }
}

#[async_trait]
impl<T: KvConnector + ?Sized> KvConnector for Arc<T> {
    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn check(&self, req: &PdRequest) -> Result<Decision, InvalidParam> {
        (**self).check(req)
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        (**self).prepare(route, req)
    }

    async fn resolve(
        &self,
        handoff: &mut Handoff,
        transport: &dyn Transport,
    ) -> Result<(), ConnectorError> {
        (**self).resolve(handoff, transport).await
    }

    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<HandoffFound, ConnectorError> {
        (**self).complete(handoff, answer).await
    }

    fn observe(&self, route: &Route, outcome: Outcome) {
        (**self).observe(route, outcome)
    }

    fn release_leg(&self, api: Api, decode: &Leg) -> Option<bytes::Bytes> {
        (**self).release_leg(api, decode)
    }

    fn equal_versions(&self) -> bool {
        (**self).equal_versions()
    }

    fn bridges_tp(&self, prefill_tp: u32, decode_tp: u32) -> bool {
        (**self).bridges_tp(prefill_tp, decode_tp)
    }
}
