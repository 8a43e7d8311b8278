//! The LMCache P/D connector ([`Lmcache`]).
//!
//! One request, as the engines see it:
//!
//! 1. `POST /tokenize` on the prefill engine (chat: the messages, with the generation
//!    prompt; completions: the prompt), once per attempt; a prompt already given as token
//!    ids is not tokenized again, nor one the orchestrator's tokenizer already turned
//!    into ids ([`PdRequest::tokens`]: a router reading tokens asked for them).
//! 2. The prompt's id is registered with [`Notifications`] (before any leg is sent: a
//!    notification may beat the prefill's HTTP answer).
//! 3. Prefill: `POST /v1/completions` with the token ids, `max_tokens: 1`, `stream: false`
//!    and `kv_transfer_params: {ret_first_tok: true, disagg_spec: {req_id, receiver_host,
//!    receiver_init_port, receiver_alloc_port}}`, the receiver being the chosen decode
//!    endpoint's [`LmcacheReceiver`]. The engine pushes the KV there, each of its TP ranks
//!    notifies, and it answers the first token (`kv_transfer_params.first_tok`).
//! 4. A streaming client gets the first token as its first chunk at once
//!    ([`Handoff::lead`]); the decode leg waits for one notification per decode TP rank
//!    ([`Handoff::gate`], within the handoff budget).
//! 5. Decode: `POST /v1/completions` with the ids plus the first token, `max_tokens - 1`,
//!    streaming as the client asked. When the first token already ended the answer
//!    (`finish_reason: stop`, or `max_tokens: 1`), no decode leg is sent.
//! 6. The decode's answer is turned into the client's (the plan's [`Reshape`]): the first
//!    token is put in front of a non-streaming answer, usage counts the prompt and every
//!    generated token once, and a chat client gets the chat form (chunks and body).
//!
//! The decode stream is parsed event by event only as far as this needs (each `data:`
//! event is one JSON object, re-encoded in the client's form); events are forwarded as
//! they arrive, never collected.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::common::sse::{EventMap, MapEvents};
use crate::vllm::rewrite::check::VllmLimits;
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use disagg_core::body::JsonBody;
use disagg_core::connector::{
    Dispatch, Handoff, KvConnector, KvGate, KvOutcome, Leg, PrefillAnswer, Reshape,
};
use disagg_core::disaggregate::Decision;
use disagg_core::endpoint::Endpoint;
use disagg_core::error::{BoxError, ConnectorError, InvalidParam};
use disagg_core::pairing::{KvProfile, Mismatch, PairError};
use disagg_core::request::{Api, PdRequest};
use disagg_core::router::Route;
use disagg_core::transport::{BoxBody, Transport, read_limited};
use http_body::Frame;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::lmcache::notify::{Notifications, Pending};

/// The largest `/tokenize` answer and non-streaming decode answer read, in bytes.
const MAX_BODY: usize = 64 * 1024 * 1024;

/// Chat-only request fields a completions leg does not carry.
const CHAT_ONLY: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "response_format",
    "logprobs",
    "top_logprobs",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "reasoning_effort",
    "modalities",
    "audio",
];

/// Why a grammar-constrained request is served by a decode engine alone (see
/// [`Lmcache`]'s `check`).
pub(crate) const GRAMMAR: &str = "grammar";

/// Whether `body` asks for a grammar: a `response_format` other than `text`,
/// `structured_outputs`, or one of the older `guided_*` fields.
fn has_grammar(body: &JsonBody) -> bool {
    let present = |k: &str| !body.is_null_or_absent(k);
    let format = body
        .get_as::<Value>("response_format")
        .and_then(Result::ok)
        .is_some_and(|f| !f.is_null() && f.get("type").and_then(Value::as_str) != Some("text"));
    format
        || present("structured_outputs")
        || [
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
        ]
        .iter()
        .any(|k| present(k))
}

/// Where a decode engine receives LMCache's KV pushes (its `pd_peer_host`,
/// `pd_peer_init_port` and `pd_peer_alloc_port`), kept in the decode [`Endpoint::ext`].
/// One init and one alloc port per TP rank; the decode leg waits for one notification
/// per rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LmcacheReceiver {
    host: String,
    init_ports: Vec<u16>,
    alloc_ports: Vec<u16>,
}

/// An [`LmcacheReceiver`] could not be built.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReceiverError {
    /// No port was given.
    #[error("an LMCache receiver needs at least one init and one alloc port")]
    NoPorts,
    /// The two lists differ in length.
    #[error("{init} init ports but {alloc} alloc ports: give one of each per TP rank")]
    Mismatch {
        /// Init ports given.
        init: usize,
        /// Alloc ports given.
        alloc: usize,
    },
    /// The text form did not parse.
    #[error("`{0}` is not HOST:INIT[,INIT...]:ALLOC[,ALLOC...]")]
    Syntax(String),
    /// The endpoint already declares ([`KvProfile::tp_size`]) a tensor-parallel size
    /// other than the receiver's rank count ([`LmcacheReceiver::insert_into`]).
    #[error(
        "the decode declares tensor-parallel size {declared} but its LMCache receiver has {ranks} port(s) of each kind, one per TP rank"
    )]
    TpSize {
        /// The size the endpoint's profile declares.
        declared: u32,
        /// The receiver's ranks (ports of each kind).
        ranks: usize,
    },
}

impl LmcacheReceiver {
    /// A receiver on `host` with one init and one alloc port per TP rank.
    ///
    /// # Errors
    ///
    /// [`ReceiverError`] when the lists are empty or differ in length.
    pub fn new(
        host: impl Into<String>,
        init_ports: Vec<u16>,
        alloc_ports: Vec<u16>,
    ) -> Result<Self, ReceiverError> {
        if init_ports.is_empty() || alloc_ports.is_empty() {
            return Err(ReceiverError::NoPorts);
        }
        if init_ports.len() != alloc_ports.len() {
            return Err(ReceiverError::Mismatch {
                init: init_ports.len(),
                alloc: alloc_ports.len(),
            });
        }
        Ok(LmcacheReceiver {
            host: host.into(),
            init_ports,
            alloc_ports,
        })
    }

    /// Parses `HOST:INIT[,INIT...]:ALLOC[,ALLOC...]` (`10.0.0.7:7300,7301:7400,7401`).
    ///
    /// # Errors
    ///
    /// [`ReceiverError`] when the text is not of that form.
    pub fn parse(s: &str) -> Result<Self, ReceiverError> {
        let syntax = || ReceiverError::Syntax(s.to_owned());
        let mut parts = s.rsplitn(3, ':');
        let (Some(alloc), Some(init), Some(host)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(syntax());
        };
        let ports = |list: &str| {
            list.split(',')
                .map(|p| p.trim().parse::<u16>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|_| syntax())
        };
        if host.is_empty() {
            return Err(syntax());
        }
        Self::new(host, ports(init)?, ports(alloc)?)
    }

    /// The host the prefill pushes to.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The init port of each TP rank.
    pub fn init_ports(&self) -> &[u16] {
        &self.init_ports
    }

    /// The alloc port of each TP rank.
    pub fn alloc_ports(&self) -> &[u16] {
        &self.alloc_ports
    }

    /// The decode's TP size: how many notifications make its KV ready.
    pub fn ranks(&self) -> usize {
        self.init_ports.len()
    }

    /// [`ranks`](Self::ranks) as a [`KvProfile::tp_size`]; a list too long for a `u32`
    /// saturates (no engine has that many ranks, so it still matches none).
    fn tp_size(&self) -> u32 {
        u32::try_from(self.ranks()).unwrap_or(u32::MAX)
    }

    /// Put this receiver into a decode endpoint's extensions, declaring with it the
    /// endpoint's tensor-parallel size: the port count ([`ranks`](Self::ranks)) is set as
    /// the [`KvProfile::tp_size`] (a profile already there keeps its other parts), so
    /// that pair validation (`disagg_resilience::pairing`'s `check_pairs` and
    /// `ValidatedSource`, over [`check_pair`](disagg_core::pairing::check_pair)) refuses
    /// a prefill of another declared size (LMCache needs equal sizes, see [`Lmcache`]).
    ///
    /// Insert the profile the engine declares first, if any; a plain
    /// `ext.insert(receiver)` declares nothing, and the pair is then checked only per
    /// request, by [`Lmcache`]'s `prepare`.
    ///
    /// # Errors
    ///
    /// [`ReceiverError::TpSize`] when `ext` already declares another size; `ext` is then
    /// left as it was.
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_core::pairing::KvProfile;
    /// use disagg_connectors::lmcache::{LmcacheReceiver, ReceiverError};
    ///
    /// let mut ext = http::Extensions::new();
    /// LmcacheReceiver::parse("10.0.0.7:7300,7301:7400,7401")?.insert_into(&mut ext)?;
    /// assert_eq!(ext.get::<KvProfile>().and_then(|p| p.tp_size), Some(2));
    ///
    /// let mut ext = http::Extensions::new();
    /// ext.insert(KvProfile { tp_size: Some(4), ..KvProfile::default() });
    /// let err = LmcacheReceiver::parse("10.0.0.7:7300,7301:7400,7401")?.insert_into(&mut ext);
    /// assert_eq!(err, Err(ReceiverError::TpSize { declared: 4, ranks: 2 }));
    /// # Ok::<(), ReceiverError>(())
    /// ```
    pub fn insert_into(self, ext: &mut http::Extensions) -> Result<(), ReceiverError> {
        let tp = self.tp_size();
        let mut profile = ext.get::<KvProfile>().cloned().unwrap_or_default();
        match profile.tp_size {
            Some(declared) if declared != tp => {
                return Err(ReceiverError::TpSize {
                    declared,
                    ranks: self.ranks(),
                });
            }
            _ => profile.tp_size = Some(tp),
        }
        ext.insert(profile);
        ext.insert(self);
        Ok(())
    }
}

/// The LMCache P/D connector (vLLM `LMCacheConnectorV1`, NIXL transfer channel).
///
/// Decode endpoints carry an [`LmcacheReceiver`] in their extensions; the prefill
/// engines' `pd_proxy_host`/`pd_proxy_port` point at the [`Notifications`] socket.
///
/// A prefill and a decode pair only at equal tensor-parallel sizes
/// ([`bridges_tp`](KvConnector::bridges_tp)), the decode's size being its receiver's
/// rank count: [`LmcacheReceiver::insert_into`] declares it, so that pair validation
/// refuses a prefill that declares another size, and `prepare` refuses such a pair per
/// request when the receiver was inserted without declaring it.
///
/// ```no_run
/// use std::sync::Arc;
/// use disagg_core::{Endpoint, Role};
/// use disagg_connectors::lmcache::{Lmcache, LmcacheReceiver, Notifications, NotifyConfig};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let notifications = Notifications::bind("0.0.0.0:7500", NotifyConfig::default()).await?;
/// let connector = Lmcache::new(notifications);
/// let mut ext = http::Extensions::new();
/// LmcacheReceiver::parse("10.0.0.7:7300,7301:7400,7401")?.insert_into(&mut ext)?;
/// let decode = Endpoint::with_extensions("http://10.0.0.7:7200", Role::Decode, ext)?;
/// # let _ = (connector, decode);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Lmcache {
    notifications: Notifications,
    prefix: u64,
    next: AtomicU64,
    limits: VllmLimits,
}

impl Lmcache {
    /// A connector whose requests wait on `notifications`.
    pub fn new(notifications: Notifications) -> Self {
        // A fresh prefix per connector: a notification left over from an earlier
        // process can never complete one of this one's requests.
        let prefix = RandomState::new().build_hasher().finish();
        Lmcache {
            notifications,
            prefix,
            next: AtomicU64::new(0),
            limits: VllmLimits::default(),
        }
    }

    /// Check requests against `limits` (the engines' `--max-logprobs` and
    /// `VLLM_MAX_STOP_STRINGS`) instead of vLLM's defaults.
    pub fn with_limits(mut self, limits: VllmLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The notification registry the connector waits on.
    pub fn notifications(&self) -> &Notifications {
        &self.notifications
    }

    fn next_req_id(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("disagg-{:016x}-{n}", self.prefix)
    }
}

/// What one attempt carries from `prepare` to its reshape.
#[derive(Debug, Clone)]
struct Plan {
    req_id: String,
    chat: bool,
    stream: bool,
    include_usage: bool,
    /// The client's `max_tokens` (or `max_completion_tokens`).
    max_tokens: Option<u64>,
    min_tokens: Option<u64>,
    /// How many decode ranks notify.
    ranks: usize,
    /// The `/tokenize` request, unless the prompt is token ids already.
    tokenize: Option<Bytes>,
    /// The prompt's token ids, once tokenized.
    tokens: Option<Arc<[u64]>>,
    /// The prefill's first token, once it answered with one.
    first: Option<First>,
}

/// The prefill's answer, as far as the client's answer needs it.
#[derive(Debug, Clone)]
struct First {
    id: String,
    created: u64,
    model: String,
    text: String,
    /// `Some` when the first token ended the answer.
    finish: Option<String>,
    /// The prefill's usage (the prompt and one token).
    usage: Option<Value>,
    /// Why the first token stopped the answer (a stop string or token id), as the
    /// prefill said it; null otherwise.
    stop_reason: Value,
}

/// The per-request form of pair validation, for endpoints whose receiver was inserted
/// without declaring its size ([`LmcacheReceiver::insert_into`] declares it, and then
/// `disagg_resilience::pairing::check_pairs` refuses the pair before any
/// request): a declared size that disagrees with the receiver's rank count would make
/// the decode leg wait out the handoff budget, or fail the prefill engine, so the
/// attempt is refused at once. Undeclared sizes are not checked.
fn check_tp(
    prefill: &Endpoint,
    decode: &Endpoint,
    receiver: &LmcacheReceiver,
) -> Result<(), ConnectorError> {
    let declared = |ep: &Endpoint| ep.ext().get::<KvProfile>().and_then(|p| p.tp_size);
    let ranks = receiver.tp_size();
    if let Some(d) = declared(decode).filter(|d| *d != ranks) {
        let err = ReceiverError::TpSize {
            declared: d,
            ranks: receiver.ranks(),
        };
        return Err(ConnectorError::NotReady {
            reason: format!("decode endpoint {}: {err}", decode.id()),
        });
    }
    if let Some(p) = declared(prefill).filter(|p| *p != ranks) {
        let err = PairError {
            prefill: prefill.id().clone(),
            decode: decode.id().clone(),
            mismatch: Mismatch::TpSize {
                connector: "lmcache",
                prefill: p,
                decode: ranks,
            },
        };
        return Err(ConnectorError::NotReady {
            reason: err.to_string(),
        });
    }
    Ok(())
}

/// The KV-ready wait of one attempt: its registration, dropped with the plan.
#[derive(Debug)]
struct Gate(Pending);

#[async_trait]
impl KvGate for Gate {
    async fn ready(&self) -> Result<(), ConnectorError> {
        self.0.ready().await.map_err(|e| ConnectorError::NotReady {
            reason: format!("request {}: {e}", self.0.req_id()),
        })
    }
}

#[async_trait]
impl KvConnector for Lmcache {
    fn name(&self) -> &'static str {
        "lmcache"
    }

    /// The legs are vLLM's: the prefill gets other `max_tokens`, `min_tokens`, `stream`
    /// and `stream_options` than the client's, so what vLLM refuses in them is refused
    /// here, before a prefill runs; beam search (whose parameters carry no
    /// `kv_transfer_params`, so no KV would be pushed) is served by a decode alone.
    ///
    /// Grammar-constrained requests (`response_format` other than `text`,
    /// `structured_outputs`, the older `guided_*`) are served direct too: the first token
    /// comes from the prefill and the decode continues from the prompt plus that token,
    /// but vLLM feeds only generated tokens to a request's grammar
    /// (`StructuredOutputManager.accept_tokens` in `vllm/v1/structured_output`), so the
    /// decode's grammar would start over after a token already emitted.
    fn check(&self, req: &PdRequest) -> Result<Decision, InvalidParam> {
        let decision = crate::vllm::rewrite::check::check_request(req, &self.limits)?;
        if decision == Decision::Disaggregate && has_grammar(req.body()) {
            return Ok(Decision::Direct { reason: GRAMMAR });
        }
        Ok(decision)
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        let prefill_ep = route.prefill.as_ref().ok_or(ConnectorError::NeedsPrefill {
            connector: self.name(),
        })?;
        let receiver = route.decode.ext().get::<LmcacheReceiver>().ok_or_else(|| {
            ConnectorError::NotConfigured {
                endpoint: route.decode.id().clone(),
                what: "LMCache receiver (host, init and alloc ports)",
            }
        })?;
        check_tp(prefill_ep, &route.decode, receiver)?;
        let body = req.body();
        let unsupported = |what: &str| ConnectorError::Unsupported {
            connector: self.name(),
            what: what.to_owned(),
        };
        if req.api() == Api::Generate {
            // LMCache's legs are vLLM's OpenAI routes; SGLang's API has no place there.
            return Err(unsupported("SGLang's native /generate API"));
        }
        if int_field(body, "n").is_some_and(|n| n > 1)
            || int_field(body, "best_of").is_some_and(|n| n > 1)
        {
            return Err(unsupported("more than one choice (n, best_of)"));
        }
        let chat = req.api() == Api::Chat;
        if !chat && matches!(body.get("prompt"), Some(p) if is_batch(p)) {
            return Err(unsupported("a batch of prompts"));
        }
        let max_tokens = if chat {
            int_field(body, "max_completion_tokens").or_else(|| int_field(body, "max_tokens"))
        } else {
            int_field(body, "max_tokens")
        };
        let stream_options = body.get_bytes("stream_options");
        let include_usage = body
            .get_as::<Value>("stream_options")
            .and_then(Result::ok)
            .is_some_and(|v| v.get("include_usage") == Some(&Value::Bool(true)));

        // The ids the orchestrator already has (its tokenizer ran for a router that
        // reads them) spare the prefill engine's `/tokenize` round trip.
        let known = req.tokens();
        let tokenize = match known {
            Some(_) => None,
            None => tokenize_request(body, chat)?,
        };

        // The completions form both legs share.
        let mut base = body.clone();
        for field in CHAT_ONLY {
            base.remove(field);
        }
        base.remove("kv_transfer_params");
        base.remove("stream_options");

        let req_id = self.next_req_id();
        let mut prefill = base.clone();
        prefill.set("max_tokens", &1);
        prefill.set("stream", &false);
        prefill.remove("min_tokens");
        let spec = json!({
            "ret_first_tok": true,
            "disagg_spec": {
                "req_id": req_id,
                "receiver_host": receiver.host(),
                "receiver_init_port": receiver.init_ports(),
                "receiver_alloc_port": receiver.alloc_ports(),
            }
        });
        prefill.set("kv_transfer_params", &spec);
        if let Some(ids) = known {
            prefill.set("prompt", ids);
        }

        // The decode leg, streaming as the client asked. As it stands it computes the
        // whole answer from the prompt (what a prefill without a first token leaves);
        // `resolve` adds the token ids, `complete` the first token and the budgets left.
        let mut decode = base;
        if let Some(ids) = known {
            decode.set("prompt", ids);
        }
        if let Some(m) = max_tokens {
            decode.set("max_tokens", &m);
        }
        decode.set("stream", &req.is_stream());
        if req.is_stream()
            && let Some(o) = &stream_options
        {
            decode.set_raw("stream_options", o.clone());
        }

        let mut handoff = Handoff::new(
            Dispatch::AfterPrefill,
            Leg {
                api: Some(Api::Completions),
                ..Leg::new(Arc::clone(prefill_ep), prefill)
            },
            Leg {
                api: Some(Api::Completions),
                ..Leg::new(Arc::clone(&route.decode), decode)
            },
        );
        handoff.ext.insert(Plan {
            req_id,
            chat,
            stream: req.is_stream(),
            include_usage,
            max_tokens,
            min_tokens: int_field(body, "min_tokens"),
            ranks: receiver.ranks(),
            tokenize,
            tokens: None,
            first: None,
        });
        Ok(handoff)
    }

    /// Equal sizes only, whatever the trait's default: each prefill TP rank pushes to
    /// and notifies for the receiver port of its own rank
    /// (`receiver_init_port[tp_rank]` in `PDBackend.batched_submit_put_task`,
    /// LMCache/LMCache `lmcache/v1/storage_backend/pd_backend.py`), and the decode leg
    /// waits for one notification per port. Fewer prefill ranks never complete the
    /// wait; more index past the list and fail in the prefill engine.
    /// The decode leg as a one-token, non-streaming prefill, as vLLM NIXL's: the decode
    /// engine takes the KV LMCache pushed for it and frees it once that token is made.
    fn release_leg(&self, api: Api, decode: &Leg) -> Option<bytes::Bytes> {
        Some(
            crate::vllm::rewrite::PrefillRewriter::new()
                .rewrite(api, &decode.body)
                .to_bytes(),
        )
    }

    fn bridges_tp(&self, prefill_tp: u32, decode_tp: u32) -> bool {
        prefill_tp == decode_tp
    }

    async fn resolve(
        &self,
        handoff: &mut Handoff,
        transport: &dyn Transport,
    ) -> Result<(), ConnectorError> {
        let ep = Arc::clone(&handoff.prefill.endpoint);
        let Some(plan) = handoff.ext.get::<Plan>().cloned() else {
            return Err(ConnectorError::NotReady {
                reason: "the plan was not prepared by this connector".into(),
            });
        };
        let tokens: Arc<[u64]> = match (&plan.tokenize, handoff.prefill.body.get("prompt")) {
            (Some(t), _) => tokenize(transport, &ep, t.clone())
                .await
                .map_err(|e| engine_error(&ep, "/tokenize", e))?,
            (None, Some(raw)) => serde_json::from_slice::<Vec<u64>>(raw)
                .map_err(|e| engine_error(&ep, "reading the prompt's token ids", e.into()))?
                .into(),
            (None, None) => return Err(engine_error(&ep, "/tokenize", "no prompt".into())),
        };
        if tokens.is_empty() {
            return Err(engine_error(
                &ep,
                "/tokenize",
                "the prompt tokenized to nothing".into(),
            ));
        }
        handoff.prefill.body.set("prompt", &*tokens);
        handoff.decode.body.set("prompt", &*tokens);
        // Registered before the prefill leg exists: its notifications may come first.
        let pending = self
            .notifications
            .register(&plan.req_id, plan.ranks)
            .map_err(|e| ConnectorError::NotReady {
                reason: e.to_string(),
            })?;
        handoff.gate = Some(Arc::new(Gate(pending)));
        if let Some(p) = handoff.ext.get_mut::<Plan>() {
            p.tokens = Some(tokens);
        }
        Ok(())
    }

    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<KvOutcome, ConnectorError> {
        let endpoint = handoff.prefill.endpoint.id().clone();
        let reply: PrefillReply =
            serde_json::from_slice(&answer.body).map_err(|_| ConnectorError::InvalidHandoff {
                endpoint: endpoint.clone(),
                field: "choices",
            })?;
        let Some(plan) = handoff.ext.get_mut::<Plan>() else {
            return Ok(KvOutcome::Missing);
        };
        let first_tok = reply.kv_transfer_params.as_ref().and_then(|p| p.first_tok);
        let (Some(first_tok), Some(choice), Some(tokens)) =
            (first_tok, reply.choices.first(), plan.tokens.clone())
        else {
            // No first token: the decode computes the whole answer from the prompt.
            handoff.gate = None;
            handoff.reshape = reshaper(plan);
            return Ok(KvOutcome::Missing);
        };
        let finished = choice
            .finish_reason
            .as_deref()
            .is_some_and(|f| f != "length")
            || plan.max_tokens.is_some_and(|m| m <= 1);
        let first = First {
            id: reply.id.unwrap_or_else(|| format!("cmpl-{}", plan.req_id)),
            created: reply.created.unwrap_or(0),
            model: reply.model.unwrap_or_default(),
            text: choice.text.clone().unwrap_or_default(),
            usage: reply.usage,
            stop_reason: choice.stop_reason.clone(),
            finish: finished.then(|| {
                choice
                    .finish_reason
                    .clone()
                    .unwrap_or_else(|| "length".to_owned())
            }),
        };
        plan.first = Some(first);
        handoff.reshape = reshaper(plan);
        if plan.stream {
            handoff.lead = Some(lead(plan));
        }
        if finished {
            handoff.gate = None;
            return Ok(KvOutcome::Finished);
        }
        let decode = &mut handoff.decode.body;
        let mut prompt = Vec::with_capacity(tokens.len() + 1);
        prompt.extend_from_slice(&tokens);
        prompt.push(first_tok);
        decode.set("prompt", &prompt);
        if let Some(m) = plan.max_tokens {
            decode.set("max_tokens", &(m - 1));
        }
        if let Some(m) = plan.min_tokens {
            decode.set("min_tokens", &m.saturating_sub(1));
        }
        Ok(KvOutcome::Handed)
    }
}

/// LMCache's change of form ([`Reshape`]): the decode answered a completions request
/// (the legs speak completions whatever the client asked) that continues after the
/// prefill's first token; the client gets its own API's answer, first token included.
#[derive(Debug)]
struct Reshaper {
    shape: Arc<Shape>,
    stream: bool,
}

impl Reshape for Reshaper {
    fn body(&self, decode: BoxBody) -> BoxBody {
        let shape = Arc::clone(&self.shape);
        if self.stream {
            BoxBody::new(MapEvents::new(decode, shape))
        } else {
            BoxBody::new(http_body_util::StreamBody::new(futures::stream::once(
                whole_answer(decode, shape),
            )))
        }
    }
}

/// The plan's reshape, when the client's answer differs from the decode's: a chat
/// request, or a first token from the prefill.
fn reshaper(plan: &Plan) -> Option<Arc<dyn Reshape>> {
    let shape = Shape::of(plan);
    if !shape.chat && shape.first.is_none() {
        // Nothing to change: the decode answers the client's own request.
        return None;
    }
    Some(Arc::new(Reshaper {
        shape: Arc::new(shape),
        stream: plan.stream,
    }))
}

/// The client's non-streaming answer, from the decode's whole body.
async fn whole_answer(body: BoxBody, shape: Arc<Shape>) -> Result<Frame<Bytes>, BoxError> {
    let bytes = read_limited(body, MAX_BODY).await?;
    shape.whole(&bytes).map(Frame::data)
}

/// The first chunk(s) of a streaming answer, from the prefill's first token, as vLLM
/// 0.33 streams them (`vllm/entrypoints/openai/chat_completion/serving.py` and
/// `.../completion/serving.py`): for chat, a role-only chunk (`delta` of
/// `{"role": "assistant", "content": ""}`, with the request's `prompt_token_ids` and
/// `prompt_text`, null), then the token's content; for completions the token with its
/// `stop_reason`. Each token chunk has the fields vLLM sets on it, null where vLLM's are
/// (`token_ids`, `kv_transfer_params`, and on the last one `weight_versions`). When
/// the token ended the answer: its finish and `stop_reason`, the usage asked for and
/// `[DONE]`.
fn lead(plan: &Plan) -> Bytes {
    let Some(first) = &plan.first else {
        return Bytes::new();
    };
    let mut out = Vec::with_capacity(512);
    let shape = Shape::of(plan);
    if plan.chat {
        let role = json!({
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": null,
            "finish_reason": null,
        });
        let mut chunk = shape.envelope(vec![role]);
        chunk.insert("prompt_token_ids".into(), Value::Null);
        chunk.insert("prompt_text".into(), Value::Null);
        event(&mut out, &chunk);
    }
    let last = first.finish.is_some();
    let mut choice = Map::new();
    choice.insert("index".into(), json!(0));
    if plan.chat {
        choice.insert("delta".into(), json!({"content": first.text}));
    } else {
        choice.insert("text".into(), json!(first.text));
    }
    choice.insert("logprobs".into(), Value::Null);
    choice.insert("finish_reason".into(), json!(first.finish));
    // vLLM sets `stop_reason` on every completions chunk, on a chat chunk only with
    // its finish.
    if !plan.chat || last {
        choice.insert("stop_reason".into(), first.stop_reason.clone());
    }
    if !plan.chat {
        choice.insert("prompt_token_ids".into(), Value::Null);
    }
    choice.insert("token_ids".into(), Value::Null);
    if !plan.chat || last {
        choice.insert("weight_versions".into(), Value::Null);
    }
    let mut chunk = shape.envelope(vec![Value::Object(choice)]);
    chunk.insert("kv_transfer_params".into(), Value::Null);
    event(&mut out, &chunk);
    if last {
        if plan.include_usage {
            let mut chunk = shape.envelope(Vec::new());
            let own = first.usage.clone();
            chunk.insert(
                "usage".into(),
                own.unwrap_or_else(|| usage(shape.prompt_tokens as u64, 1)),
            );
            event(&mut out, &chunk);
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
    }
    Bytes::from(out)
}

fn event(out: &mut Vec<u8>, chunk: &Map<String, Value>) {
    out.extend_from_slice(b"data: ");
    // A map of JSON values always encodes.
    if serde_json::to_writer(&mut *out, chunk).is_err() {
        out.extend_from_slice(b"{}");
    }
    out.extend_from_slice(b"\n\n");
}

fn usage(prompt: u64, completion: u64) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

/// How the decode's answer becomes the client's.
#[derive(Debug)]
struct Shape {
    chat: bool,
    first: Option<First>,
    prompt_tokens: usize,
}

impl Shape {
    /// The shape of `plan`'s answer.
    fn of(plan: &Plan) -> Self {
        Shape {
            chat: plan.chat,
            first: plan.first.clone(),
            prompt_tokens: plan.tokens.as_ref().map_or(0, |t| t.len()),
        }
    }

    /// A chunk's envelope: id, object, created, model.
    fn envelope(&self, choices: Vec<Value>) -> Map<String, Value> {
        let mut m = Map::new();
        if let Some(f) = &self.first {
            m.insert("id".into(), json!(self.id(&f.id)));
            m.insert(
                "object".into(),
                json!(if self.chat {
                    "chat.completion.chunk"
                } else {
                    "text_completion"
                }),
            );
            m.insert("created".into(), json!(f.created));
            m.insert("model".into(), json!(f.model));
        }
        m.insert("choices".into(), Value::Array(choices));
        m
    }

    fn id(&self, id: &str) -> String {
        match (self.chat, id.strip_prefix("cmpl-")) {
            (true, Some(rest)) => format!("chatcmpl-{rest}"),
            (true, None) if !id.starts_with("chatcmpl-") => format!("chatcmpl-{id}"),
            _ => id.to_owned(),
        }
    }

    /// Usage as the client counts it: the prompt once, every generated token once (the
    /// decode saw the first token as part of its prompt). Other usage fields stay.
    fn fix_usage(&self, obj: &mut Map<String, Value>) {
        let Some(Value::Object(u)) = obj.get_mut("usage") else {
            return;
        };
        if self.first.is_none() {
            return;
        }
        let generated = u
            .get("completion_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0)
            + 1;
        let prompt = self.prompt_tokens as u64;
        u.insert("prompt_tokens".into(), json!(prompt));
        u.insert("completion_tokens".into(), json!(generated));
        u.insert("total_tokens".into(), json!(prompt + generated));
    }

    /// One streamed chunk of the decode, in the client's form.
    fn chunk(&self, mut obj: Map<String, Value>) -> Map<String, Value> {
        if let Some(f) = &self.first {
            obj.insert("id".into(), json!(self.id(&f.id)));
        }
        if self.chat {
            obj.insert("object".into(), json!("chat.completion.chunk"));
            if let Some(Value::Array(choices)) = obj.get_mut("choices") {
                for c in choices.iter_mut() {
                    if let Value::Object(c) = c {
                        let text = c.remove("text").unwrap_or(Value::Null);
                        c.remove("prompt_logprobs");
                        // Fields of a completions choice that a chat choice lacks:
                        // the prompt's ids, and before the finish `stop_reason` and
                        // `weight_versions` (vLLM sets those on a chat chunk only
                        // with its finish).
                        c.remove("prompt_token_ids");
                        if c.get("finish_reason").is_none_or(Value::is_null) {
                            c.remove("stop_reason");
                            c.remove("weight_versions");
                        }
                        c.insert("delta".into(), json!({ "content": text }));
                        c.insert("logprobs".into(), Value::Null);
                    }
                }
            }
        }
        self.fix_usage(&mut obj);
        obj
    }

    /// The client's whole (non-streaming) answer from the decode's, which is empty when
    /// no decode leg was sent.
    fn whole(&self, decode: &[u8]) -> Result<Bytes, BoxError> {
        let (mut obj, from_decode) = if decode.is_empty() {
            let first = self
                .first
                .as_ref()
                .ok_or("no decode answer and no first token")?;
            let mut m = Map::new();
            m.insert(
                "choices".into(),
                json!([{"index": 0, "text": "", "logprobs": null, "finish_reason": first.finish}]),
            );
            // The prefill's own usage: the prompt and its one token.
            let own = first.usage.clone();
            m.insert(
                "usage".into(),
                own.unwrap_or_else(|| usage(self.prompt_tokens as u64, 1)),
            );
            (m, false)
        } else {
            match serde_json::from_slice::<Value>(decode)? {
                Value::Object(m) => (m, true),
                _ => return Err("the decode's answer is not a JSON object".into()),
            }
        };
        if let Some(f) = &self.first {
            obj.insert("id".into(), json!(self.id(&f.id)));
            obj.insert("created".into(), json!(f.created));
            obj.insert("model".into(), json!(f.model));
        }
        if let Some(Value::Array(choices)) = obj.get_mut("choices") {
            for c in choices.iter_mut() {
                let Value::Object(c) = c else { continue };
                let mut text = self
                    .first
                    .as_ref()
                    .map(|f| f.text.clone())
                    .unwrap_or_default();
                if let Some(Value::String(t)) = c.remove("text") {
                    text.push_str(&t);
                }
                if self.chat {
                    c.remove("prompt_logprobs");
                    c.insert(
                        "message".into(),
                        json!({"role": "assistant", "content": text}),
                    );
                    c.insert("logprobs".into(), Value::Null);
                } else {
                    c.insert("text".into(), json!(text));
                }
            }
        }
        obj.insert(
            "object".into(),
            json!(if self.chat {
                "chat.completion"
            } else {
                "text_completion"
            }),
        );
        if from_decode {
            self.fix_usage(&mut obj);
        }
        Ok(Bytes::from(serde_json::to_vec(&obj)?))
    }
}

impl EventMap for Shape {
    /// One SSE event (without its blank-line terminator), in the client's form.
    fn event(&self, ev: &[u8], out: &mut BytesMut) {
        let data = ev
            .strip_prefix(b"data: ")
            .or_else(|| ev.strip_prefix(b"data:"));
        let parsed = data
            .filter(|d| d.first() == Some(&b'{'))
            .and_then(|d| serde_json::from_slice::<Map<String, Value>>(d).ok());
        match parsed {
            Some(obj) if !obj.contains_key("error") => {
                let mut v = Vec::with_capacity(ev.len() + 64);
                event(&mut v, &self.chunk(obj));
                out.extend_from_slice(&v);
            }
            // Error events, `[DONE]`, comments, anything else: as it came.
            _ => {
                out.extend_from_slice(ev);
                out.extend_from_slice(b"\n\n");
            }
        }
    }
}

#[derive(Deserialize)]
struct PrefillReply {
    id: Option<String>,
    created: Option<u64>,
    model: Option<String>,
    #[serde(default)]
    choices: Vec<ChoiceIn>,
    kv_transfer_params: Option<KvParamsIn>,
    usage: Option<Value>,
}

#[derive(Deserialize)]
struct ChoiceIn {
    text: Option<String>,
    finish_reason: Option<String>,
    #[serde(default)]
    stop_reason: Value,
}

#[derive(Deserialize)]
struct KvParamsIn {
    first_tok: Option<u64>,
}

fn int_field(body: &JsonBody, key: &str) -> Option<u64> {
    body.get_as::<Option<u64>>(key)
        .and_then(Result::ok)
        .flatten()
}

fn is_batch(raw: &[u8]) -> bool {
    serde_json::from_slice::<Vec<Value>>(raw)
        .is_ok_and(|v| v.iter().any(|x| x.is_string() || x.is_array()))
}

fn is_token_ids(raw: &[u8]) -> bool {
    raw.first() == Some(&b'[') && serde_json::from_slice::<Vec<u64>>(raw).is_ok()
}

/// The `/tokenize` body for a client's request (`None`: its prompt is token ids).
fn tokenize_request(body: &JsonBody, chat: bool) -> Result<Option<Bytes>, ConnectorError> {
    let mut out = Map::new();
    let raw = |key: &str| {
        body.get_as::<Value>(key)
            .and_then(Result::ok)
            .filter(|v| !v.is_null())
    };
    if let Some(m) = raw("model") {
        out.insert("model".into(), m);
    }
    if chat {
        let messages = raw("messages").unwrap_or(Value::Array(Vec::new()));
        out.insert("messages".into(), messages);
        let generation_prompt = raw("add_generation_prompt").unwrap_or(Value::Bool(true));
        out.insert("add_generation_prompt".into(), generation_prompt);
        for key in [
            "continue_final_message",
            "chat_template",
            "chat_template_kwargs",
        ] {
            if let Some(v) = raw(key) {
                out.insert(key.into(), v);
            }
        }
    } else {
        match body.get("prompt") {
            Some(p) if is_token_ids(p) => return Ok(None),
            _ => {
                out.insert("prompt".into(), raw("prompt").unwrap_or(Value::Null));
            }
        }
    }
    serde_json::to_vec(&out)
        .map(|v| Some(Bytes::from(v)))
        .map_err(|source| ConnectorError::Encode {
            field: "tokenize",
            source,
        })
}

fn engine_error(ep: &Endpoint, what: &'static str, source: BoxError) -> ConnectorError {
    ConnectorError::Engine {
        endpoint: ep.id().clone(),
        what,
        source,
    }
}

/// The prompt's token ids, from the prefill engine's `/tokenize` (the exchange
/// `disagg-tokenize`'s `EngineTokenizer` makes too).
async fn tokenize(
    transport: &dyn Transport,
    ep: &Arc<Endpoint>,
    body: Bytes,
) -> Result<Arc<[u64]>, BoxError> {
    let uri = ep.uri("/tokenize").map_err(boxed)?;
    let ids = disagg_tokenize::engine::request_tokens(transport, uri, body, MAX_BODY)
        .await
        .map_err(boxed)?;
    Ok(ids.into_iter().map(u64::from).collect())
}

fn boxed<E: std::error::Error + Send + Sync + 'static>(e: E) -> BoxError {
    Box::new(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use disagg_core::Role;
    use disagg_core::endpoint::Endpoint;
    use disagg_core::pairing::KvRole;
    use http::HeaderMap;
    use http_body_util::BodyExt;

    fn route(receiver: Option<LmcacheReceiver>) -> Route {
        let p = Arc::new(Endpoint::new("http://p:7100", Role::Prefill).unwrap());
        let mut ext = http::Extensions::new();
        if let Some(r) = receiver {
            ext.insert(r);
        }
        let d = Arc::new(Endpoint::with_extensions("http://d:7200", Role::Decode, ext).unwrap());
        Route::new(Some(p), d)
    }

    fn request(api: Api, body: &str) -> PdRequest {
        PdRequest::new(api, HeaderMap::new(), &Bytes::from(body.to_owned())).unwrap()
    }

    fn connector() -> Lmcache {
        Lmcache::new(Notifications::detached(
            crate::lmcache::NotifyConfig::default(),
        ))
    }

    fn receiver() -> LmcacheReceiver {
        LmcacheReceiver::parse("10.0.0.7:7300,7301:7400,7401").unwrap()
    }

    #[test]
    fn receivers_parse_and_refuse_what_cannot_be_one() {
        let r = receiver();
        assert_eq!(r.host(), "10.0.0.7");
        assert_eq!(r.init_ports(), [7300, 7301]);
        assert_eq!(r.alloc_ports(), [7400, 7401]);
        assert_eq!(r.ranks(), 2);
        assert_eq!(
            LmcacheReceiver::parse("h:1,2:3"),
            Err(ReceiverError::Mismatch { init: 2, alloc: 1 })
        );
        for bad in ["h:1", ":1:2", "h:x:2", "h:1:", "1:2"] {
            assert!(LmcacheReceiver::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            LmcacheReceiver::new("h", vec![], vec![]),
            Err(ReceiverError::NoPorts)
        );
    }

    #[test]
    fn the_prefill_leg_is_a_one_token_completion_carrying_the_receiver() {
        let req = request(
            Api::Chat,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":9,"stream":true,"stream_options":{"include_usage":true},"logprobs":true,"temperature":0.5}"#,
        );
        let h = connector().prepare(&route(Some(receiver())), &req).unwrap();
        assert_eq!(h.dispatch, Dispatch::AfterPrefill);
        assert_eq!(h.prefill.api, Some(Api::Completions));
        assert_eq!(h.decode.api, Some(Api::Completions));
        let p: Value = serde_json::from_slice(&h.prefill.body.to_bytes()).unwrap();
        assert_eq!(p["max_tokens"], 1);
        assert_eq!(p["stream"], false);
        assert_eq!(p["temperature"], 0.5);
        for gone in [
            "messages",
            "max_completion_tokens",
            "stream_options",
            "logprobs",
        ] {
            assert!(p.get(gone).is_none(), "{gone} in {p}");
        }
        let spec = &p["kv_transfer_params"];
        assert_eq!(spec["ret_first_tok"], true);
        assert_eq!(spec["disagg_spec"]["receiver_host"], "10.0.0.7");
        assert_eq!(
            spec["disagg_spec"]["receiver_init_port"],
            json!([7300, 7301])
        );
        assert_eq!(
            spec["disagg_spec"]["receiver_alloc_port"],
            json!([7400, 7401])
        );
        assert!(spec["disagg_spec"]["req_id"].is_string());
        let d: Value = serde_json::from_slice(&h.decode.body.to_bytes()).unwrap();
        assert_eq!(d["max_tokens"], 9);
        assert_eq!(d["stream"], true);
        assert_eq!(d["stream_options"]["include_usage"], true);
        assert!(d.get("kv_transfer_params").is_none());
        // Each attempt gets its own id.
        let again = connector().prepare(&route(Some(receiver())), &req).unwrap();
        let id = |h: &Handoff| {
            let v: Value = serde_json::from_slice(&h.prefill.body.to_bytes()).unwrap();
            v["kv_transfer_params"]["disagg_spec"]["req_id"].clone()
        };
        assert_ne!(id(&h), id(&again));
    }

    #[test]
    fn what_the_protocol_cannot_carry_is_refused() {
        let c = connector();
        let chat = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"n":2}"#;
        assert!(matches!(
            c.prepare(&route(Some(receiver())), &request(Api::Chat, chat)),
            Err(ConnectorError::Unsupported { .. })
        ));
        let batch = r#"{"model":"m","prompt":["a","b"]}"#;
        assert!(matches!(
            c.prepare(&route(Some(receiver())), &request(Api::Completions, batch)),
            Err(ConnectorError::Unsupported { .. })
        ));
        let ok = r#"{"model":"m","prompt":"a"}"#;
        assert!(matches!(
            c.prepare(&route(None), &request(Api::Completions, ok)),
            Err(ConnectorError::NotConfigured { .. })
        ));
    }

    fn shape(chat: bool) -> Shape {
        Shape {
            chat,
            first: Some(First {
                id: "cmpl-7".into(),
                created: 5,
                model: "m".into(),
                text: " one".into(),
                finish: None,
                usage: None,
                stop_reason: Value::Null,
            }),
            prompt_tokens: 3,
        }
    }

    fn events(out: &[u8]) -> Vec<String> {
        String::from_utf8_lossy(out)
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(str::to_owned)
            .collect()
    }

    #[tokio::test]
    async fn a_completion_stream_becomes_a_chat_stream_event_by_event() {
        let decode = concat!(
            "data: {\"id\":\"cmpl-d\",\"object\":\"text_completion\",\"created\":9,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" two\",\"logprobs\":null,\"finish_reason\":null}]}\n\n",
            "data: {\"id\":\"cmpl-d\",\"object\":\"text_completion\",\"created\":9,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"\",\"logprobs\":null,\"finish_reason\":\"length\"}],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":2,\"total_tokens\":6}}\n\n",
            "data: [DONE]\n\n",
        );
        // Frames cut in the middle of events.
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = decode
            .as_bytes()
            .chunks(37)
            .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        let body = BoxBody::new(http_body_util::StreamBody::new(futures::stream::iter(
            frames,
        )));
        let mapped = MapEvents::new(body, Arc::new(shape(true)));
        let out = BodyExt::collect(mapped).await.unwrap().to_bytes();
        let evs = events(&out);
        assert_eq!(evs.len(), 3, "{evs:?}");
        let first: Value = serde_json::from_str(evs[0].strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(first["id"], "chatcmpl-7");
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["choices"][0]["delta"]["content"], " two");
        assert!(first["choices"][0].get("text").is_none());
        let last: Value = serde_json::from_str(evs[1].strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        // The prompt once (3, not the decode's 4), and the prefill's token counted.
        assert_eq!(
            last["usage"],
            json!({"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6})
        );
        assert_eq!(evs[2], "data: [DONE]");
    }

    /// The SSE specification ends an event at a blank line whatever the line ends:
    /// `\r\n\r\n` and `\r\r` too, even cut between its `\r` and `\n`.
    #[tokio::test]
    async fn events_framed_with_cr_and_crlf_are_found_wherever_the_frames_are_cut() {
        let one = "data: {\"id\":\"cmpl-d\",\"object\":\"text_completion\",\"created\":9,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" two\",\"logprobs\":null,\"finish_reason\":null}]}";
        for sep in ["\r\n\r\n", "\r\r", "\n\r\n", "\n\n"] {
            let decode = format!("{one}{sep}{one}{sep}data: [DONE]{sep}");
            for cut in 1..=decode.len() {
                let frames: Vec<Result<Frame<Bytes>, BoxError>> = decode
                    .as_bytes()
                    .chunks(cut)
                    .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
                    .collect();
                let mapped = MapEvents::new(
                    BoxBody::new(http_body_util::StreamBody::new(futures::stream::iter(
                        frames,
                    ))),
                    Arc::new(shape(true)),
                );
                let out = BodyExt::collect(mapped).await.unwrap().to_bytes();
                let evs = events(&out);
                assert_eq!(evs.len(), 3, "{sep:?} cut {cut}: {evs:?}");
                for ev in &evs[..2] {
                    let v: Value =
                        serde_json::from_str(ev.strip_prefix("data: ").unwrap()).unwrap();
                    assert_eq!(v["object"], "chat.completion.chunk", "{sep:?} cut {cut}");
                }
                assert_eq!(evs[2], "data: [DONE]", "{sep:?} cut {cut}");
            }
        }
    }

    #[test]
    fn error_events_and_done_pass_unchanged() {
        let s = shape(true);
        let mut out = BytesMut::new();
        s.event(br#"data: {"error":{"message":"x","code":"c"}}"#, &mut out);
        s.event(b"data: [DONE]", &mut out);
        assert_eq!(
            events(&out),
            [
                r#"data: {"error":{"message":"x","code":"c"}}"#,
                "data: [DONE]"
            ]
        );
    }

    #[test]
    fn a_whole_answer_gets_the_first_token_in_front() {
        let decode = br#"{"id":"cmpl-d","object":"text_completion","created":9,"model":"m","choices":[{"index":0,"text":" two three","logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":4,"completion_tokens":2,"total_tokens":6}}"#;
        let chat: Value = serde_json::from_slice(&shape(true).whole(decode).unwrap()).unwrap();
        assert_eq!(chat["object"], "chat.completion");
        assert_eq!(chat["id"], "chatcmpl-7");
        assert_eq!(chat["choices"][0]["message"]["role"], "assistant");
        assert_eq!(chat["choices"][0]["message"]["content"], " one two three");
        assert_eq!(chat["choices"][0]["finish_reason"], "stop");
        assert_eq!(chat["usage"]["prompt_tokens"], 3);
        assert_eq!(chat["usage"]["completion_tokens"], 3);
        let text: Value = serde_json::from_slice(&shape(false).whole(decode).unwrap()).unwrap();
        assert_eq!(text["object"], "text_completion");
        assert_eq!(text["choices"][0]["text"], " one two three");
        assert!(shape(true).whole(b"[1]").is_err());
    }

    /// An endpoint declaring `profile`, with `receiver` installed as a proxy does it
    /// (`insert_into`, declaring its size).
    fn declared(
        url: &str,
        role: Role,
        profile: Option<KvProfile>,
        receiver: Option<LmcacheReceiver>,
    ) -> Endpoint {
        let mut ext = http::Extensions::new();
        if let Some(p) = profile {
            ext.insert(p);
        }
        if let Some(r) = receiver {
            r.insert_into(&mut ext).unwrap();
        }
        Endpoint::with_extensions(url, role, ext).unwrap()
    }

    fn tp(size: u32) -> Option<KvProfile> {
        Some(KvProfile {
            tp_size: Some(size),
            ..KvProfile::default()
        })
    }

    #[test]
    fn pairs_of_unequal_tp_are_refused_the_decodes_size_being_its_receivers() {
        use disagg_core::endpoint::EndpointSet;
        use disagg_resilience::pairing::check_pairs;
        // The decode declares no profile: its receiver's two ports are its size.
        let set = EndpointSet::new(
            [
                declared("http://p1:7100", Role::Prefill, tp(1), None),
                declared("http://p2:7100", Role::Prefill, tp(2), None),
                declared("http://p4:7100", Role::Prefill, tp(4), None),
                declared("http://p0:7100", Role::Prefill, None, None),
                declared("http://d:7200", Role::Decode, None, Some(receiver())),
            ]
            .map(Arc::new),
        );
        let err = check_pairs(&set, &connector()).unwrap_err();
        let refused: Vec<_> = err
            .pairs
            .iter()
            .map(|p| (p.prefill.as_str(), p.decode.as_str(), p.mismatch.clone()))
            .collect();
        let mismatch = |prefill, decode| Mismatch::TpSize {
            connector: "lmcache",
            prefill,
            decode,
        };
        // Fewer prefill ranks would never complete the wait, more would fail the
        // prefill; equal and undeclared sizes pass.
        assert_eq!(
            refused,
            [
                ("http://p1:7100", "http://d:7200", mismatch(1, 2)),
                ("http://p4:7100", "http://d:7200", mismatch(4, 2)),
            ]
        );
        let text = err.to_string();
        assert!(
            text.contains("prefill endpoint http://p1:7100 and decode endpoint http://d:7200")
                && text.contains("from tensor-parallel size 1 to 2"),
            "{text}"
        );
        // A decode profile that declares other parts keeps them and gains the size.
        let role = KvProfile {
            role: Some(KvRole::Consumer),
            ..KvProfile::default()
        };
        let d = declared("http://d:7200", Role::Decode, Some(role), Some(receiver()));
        let p = d.ext().get::<KvProfile>().unwrap();
        assert_eq!((p.role, p.tp_size), (Some(KvRole::Consumer), Some(2)));
        assert!(connector().bridges_tp(2, 2));
        assert!(!connector().bridges_tp(1, 2) && !connector().bridges_tp(4, 2));
    }

    #[test]
    fn a_decode_declaring_another_size_than_its_receiver_is_refused() {
        let mut ext = http::Extensions::new();
        ext.insert(tp(4).unwrap());
        assert_eq!(
            receiver().insert_into(&mut ext),
            Err(ReceiverError::TpSize {
                declared: 4,
                ranks: 2
            })
        );
        // Left as it was: no receiver, the declared size untouched.
        assert!(ext.get::<LmcacheReceiver>().is_none());
        assert_eq!(ext.get::<KvProfile>(), tp(4).as_ref());
        let mut ext = http::Extensions::new();
        ext.insert(tp(2).unwrap());
        receiver().insert_into(&mut ext).unwrap();
        assert_eq!(ext.get::<LmcacheReceiver>(), Some(&receiver()));
    }

    #[tokio::test]
    async fn a_later_set_with_an_unequal_pair_is_refused_by_validated_source() {
        use disagg_core::{EndpointSource, ManualSource};
        use disagg_resilience::pairing::ValidatedSource;
        let decode = || declared("http://d:7200", Role::Decode, None, Some(receiver()));
        let inner = Arc::new(ManualSource::new([
            declared("http://p2:7100", Role::Prefill, tp(2), None),
            decode(),
        ]));
        let source = ValidatedSource::new(Arc::clone(&inner), Arc::new(connector())).unwrap();
        // Discovery publishes a prefill of TP 1 next to the decode of two ports.
        inner.insert(declared("http://p1:7100", Role::Prefill, tp(1), None));
        let refused = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            loop {
                if let Some(e) = source.last_error() {
                    return e;
                }
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the set is refused");
        assert_eq!(refused.pairs.len(), 1);
        assert_eq!(refused.pairs[0].prefill.as_str(), "http://p1:7100");
        assert_eq!(
            refused.pairs[0].mismatch,
            Mismatch::TpSize {
                connector: "lmcache",
                prefill: 1,
                decode: 2
            }
        );
        // The last valid set stays in force.
        let set = source.snapshot();
        assert_eq!(set.prefill().len(), 1);
        assert_eq!(set.prefill()[0].id().as_str(), "http://p2:7100");
        // And a new decode whose receiver has one port is refused against TP 2.
        inner.replace([
            Arc::new(declared("http://p2:7100", Role::Prefill, tp(2), None)),
            Arc::new(declared(
                "http://d1:7200",
                Role::Decode,
                None,
                Some(LmcacheReceiver::parse("10.0.0.8:7300:7400").unwrap()),
            )),
        ]);
        let refused = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            loop {
                if let Some(e) = source.last_error()
                    && e.pairs[0].decode.as_str() == "http://d1:7200"
                {
                    return e;
                }
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the set is refused");
        assert!(matches!(
            refused.pairs[0].mismatch,
            Mismatch::TpSize {
                prefill: 2,
                decode: 1,
                ..
            }
        ));
        // The refused decode is left out; the old one left the inner set, so no decode
        // is published (requests get 503 until a decode that pairs appears) while the
        // prefill in force stays.
        let set = source.snapshot();
        assert!(set.decode().is_empty());
        assert_eq!(set.prefill()[0].id().as_str(), "http://p2:7100");
    }

    #[test]
    fn prepare_refuses_an_unequal_pair_whose_receiver_declared_nothing() {
        let req = request(
            Api::Completions,
            r#"{"model":"m","prompt":"hi","max_tokens":4}"#,
        );
        // The receiver inserted plainly: pair validation cannot see the decode's size.
        let route = |prefill: Option<KvProfile>, decode: Option<KvProfile>| {
            let mut ext = http::Extensions::new();
            if let Some(p) = prefill {
                ext.insert(p);
            }
            let p = Endpoint::with_extensions("http://p:7100", Role::Prefill, ext).unwrap();
            let mut ext = http::Extensions::new();
            if let Some(d) = decode {
                ext.insert(d);
            }
            ext.insert(receiver());
            let d = Endpoint::with_extensions("http://d:7200", Role::Decode, ext).unwrap();
            Route::new(Some(Arc::new(p)), Arc::new(d))
        };
        let refusal = |prefill, decode| {
            connector()
                .prepare(&route(prefill, decode), &req)
                .unwrap_err()
                .to_string()
        };
        let text = refusal(tp(1), None);
        assert!(
            text.contains("prefill endpoint http://p:7100 and decode endpoint http://d:7200")
                && text.contains("from tensor-parallel size 1 to 2"),
            "{text}"
        );
        let text = refusal(None, tp(4));
        assert!(
            text.contains("decode endpoint http://d:7200")
                && text.contains("tensor-parallel size 4")
                && text.contains("2 port(s)"),
            "{text}"
        );
        assert!(connector().prepare(&route(tp(2), tp(2)), &req).is_ok());
        assert!(connector().prepare(&route(None, None), &req).is_ok());
    }
}
