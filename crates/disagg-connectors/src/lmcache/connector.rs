//! The LMCache P/D connector ([`Lmcache`]).
//!
//! One request, as the engines see it:
//!
//! 1. `POST /tokenize` on the prefill engine (chat: the messages, with the generation
//!    prompt; completions: the prompt), once per attempt; a prompt already given as token
//!    ids is not tokenized again, nor one the orchestrator's tokenizer already turned
//!    into ids ([`PdRequest::tokens`]: a router reading tokens asked for them).
//!    A prompt of more token ids than the connector carries
//!    ([`MAX_PROMPT_TOKENS`] by default) fails the request (400) before any leg is sent:
//!    the ids are decoded no further than the first one past the ceiling, and the
//!    `/tokenize` answer is read no further than an answer of that many ids can take
//!    ([`answer_limit`](disagg_tokenize::engine::answer_limit)). A prompt of no ids, or
//!    one `/tokenize` refuses as the client's (400, 422), fails it the same way, as
//!    does a `/tokenize` 404 (vLLM's answer for a model it does not serve: the model
//!    the client named, whose prefill leg would have had the same 404); no engine is
//!    blamed for any of these (only a failure of `/tokenize` itself names the
//!    prefill, [`ConnectorError::Engine`]). Lists of 256 KiB or
//!    more are decoded on Tokio's blocking pool, not on the event loop; a completions
//!    prompt of that size is told apart there too (a batch, which is refused, the
//!    client's ids, or text), the event loop looking no further than its first
//!    element, and a chat's messages of that size are looked through for media parts
//!    (refused) there.
//! 2. The prompt's id is registered with [`Notifications`] (before any leg is sent: a
//!    notification may beat the prefill's HTTP answer).
//! 3. Prefill: `POST /v1/completions` with the token ids, `max_tokens: 1`, `stream: false`
//!    (`min_tokens: 1` when the client's is 1 or more, `n` and `best_of` 1; `echo` as
//!    the client's: this token is the answer's first) and `kv_transfer_params:
//!    {ret_first_tok: true, disagg_spec: {req_id, receiver_host, receiver_init_port,
//!    receiver_alloc_port}}`, the receiver being the chosen decode
//!    endpoint's [`LmcacheReceiver`]. The engine pushes the KV there, each of its TP ranks
//!    notifies, and it answers the first token (`kv_transfer_params.first_tok`).
//! 4. A streaming client gets the first token as its first chunk at once
//!    ([`Handoff::lead`]); the decode leg waits for one notification per decode TP rank
//!    ([`Handoff::gate`], within the handoff budget).
//! 5. Decode: `POST /v1/completions` with the ids plus the first token, `max_tokens - 1`
//!    (16, vLLM's default, for completions without the key), `min_tokens - 1`, no `echo`
//!    (the prefill's answer put the prompt in front), streaming as the client asked.
//!    The numbers are read as vLLM reads them (`"5"`, `5.0`: `disagg_json::lax`).
//!    A client without a limit (a chat without one, a `null` one) gets the rest of the
//!    context: the `max_model_len` of the prefill's `/tokenize` answer less the
//!    decode's prompt (the ids and the first token). When no `/tokenize` was asked for
//!    the prompt (its ids were the client's, or a token-reading router's), `resolve`
//!    takes that length from the prefill engine's latest `/tokenize` answer for the
//!    request's `model` (a prompt's, or this call's) when under 10 s old, else asks the
//!    prefill's `/tokenize` for it alone (one character, its answer read within 16
//!    ids), for such a client or one with a limit above 1 (whose room it checks): about
//!    once per prefill engine and model every 10 s (requests that miss together share
//!    one probe; one the remembered length would refuse asks afresh: see
//!    `context.rs`), none for a limit of 1 (the prefill's token, no decode leg) or a
//!    `min_tokens` above the limit (refused). A request waits at most
//!    the connector's probe time ([`CONTEXT_PROBE_TIMEOUT`], 2 s, by default) for it. A
//!    probe that fails on the engine's side (no answer in that time among those) fails
//!    a client without a limit (502; the prefill named and counted once per probe, by
//!    the first such request) and leaves a limit unchecked, the failure remembered for
//!    10 s.
//!    Never `null`:
//!    vLLM's completions route asserts a number for every output. Only when the
//!    prefill's answer gives no `max_model_len` is the key left out (vLLM's 16).
//!    A known difference: vLLM
//!    without a client limit generates at most the model's generation-config default
//!    (`max_new_tokens`, when the model sets one) where the decode, given the rest of
//!    the context in numbers, does not apply it. The length is
//!    the prefill's: the decode is assumed to run with a context at least as long
//!    (the same model, normally the same `--max-model-len`); a shorter one refuses
//!    the leg (400) after the client had its first token. A limit above the context
//!    less the prompt (completions' default of 16 among them), then a `min_tokens`
//!    above what the request may generate (its limit, or the context less the prompt),
//!    are refused (400; the limit as vLLM's error, `param` `max_tokens`, its words:
//!    [`ConnectorError::Invalid`]) before the prefill runs, as vLLM refuses them, in
//!    that order, before generating any; a prompt that fills the context alone is
//!    left to the prefill, which refuses it. None is refused on a remembered length
//!    (one that refuses is asked afresh). An engine restarted with another
//!    `--max-model-len` behind the same address is read anew within 10 s; until then a
//!    request its shorter context cannot hold is refused by the decode, as above.
//!    When the first token already ended the answer (`finish_reason: stop`,
//!    `max_tokens: 1`, or no room left in the context), no decode leg is sent.
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

use crate::vllm::rewrite::check::VllmLimits;
use async_trait::async_trait;
use bytes::Bytes;
use disagg_core::connector::{
    Dispatch, Handoff, HandoffFound, KvConnector, KvGate, Leg, PrefillAnswer,
};
use disagg_core::endpoint::{Endpoint, FactError, Facts};
use disagg_core::error::ConnectorError;
use disagg_core::policy::Decision;
use disagg_core::request::{Api, PdRequest};
use disagg_core::router::Route;
use disagg_core::transport::Transport;
use disagg_json::InvalidParam;
use disagg_pairing::{KvProfile, Mismatch, PairError};
use disagg_tokenize::prompt::{BlockingLimit, READ_OFF_LOOP_FROM};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

pub use self::context::CONTEXT_PROBE_TIMEOUT;
use self::ids::{completion_tokenize, tokenize_request};
use self::limit::{int_field, rest_of_context, token_limit};
use self::prompt::{Kind, Unchecked};
use super::notify::{Notifications, Pending};
use super::reshape::{lead, reshaper};

/// The largest non-streaming decode answer read, in bytes.
pub(super) const MAX_BODY: usize = 64 * 1024 * 1024;

/// The most token ids a prompt may have to be carried by the [`Lmcache`] connector
/// by default (2^20, as many as vLLM prompt-token reuse carries,
/// [`DEFAULT_MAX_IDS`](crate::vllm::reuse::DEFAULT_MAX_IDS); above the context of the
/// models LMCache serves). The ids are held for the request's life and written into
/// both legs: without a ceiling, a `/tokenize` answer of 64 MiB could name some 30
/// million of them. See [`Lmcache::with_max_prompt_tokens`].
pub const MAX_PROMPT_TOKENS: usize = crate::vllm::reuse::DEFAULT_MAX_IDS;

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

/// The connector's name ([`Lmcache`]'s `name`), as its errors give it.
const NAME: &str = "lmcache";

/// The refusal (400, [`ConnectorError::Unsupported`]) of a request the connector
/// cannot serve, `what` it is: every client refusal of the connector is made here.
fn refused(what: impl Into<String>) -> ConnectorError {
    ConnectorError::Unsupported {
        connector: NAME,
        what: what.into(),
    }
}

/// Where a decode engine receives LMCache's KV pushes (its `pd_peer_host`,
/// `pd_peer_init_port` and `pd_peer_alloc_port`), kept in the decode endpoint's
/// [`Facts::KV_RECEIVER`] fact as text ([`insert_into`](Self::insert_into) writes
/// it, [`from_facts`](Self::from_facts) reads it back).
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
    /// The text form is refused as an endpoint fact (too long: too many ports, or a
    /// host with a control character).
    #[error(transparent)]
    Fact(#[from] FactError),
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

    /// The receiver an endpoint declares in its [`Facts::KV_RECEIVER`] fact:
    /// `None` when it declares none.
    ///
    /// # Errors
    ///
    /// [`ReceiverError`] when the fact is not of the form [`parse`](Self::parse) reads.
    pub fn from_facts(facts: &Facts) -> Result<Option<Self>, ReceiverError> {
        facts.get(Facts::KV_RECEIVER).map(Self::parse).transpose()
    }

    /// Put this receiver into a decode endpoint's facts (as its text form, under
    /// [`Facts::KV_RECEIVER`]), declaring with it the endpoint's tensor-parallel
    /// size in `ext`: the port count ([`ranks`](Self::ranks)) is set as the
    /// [`KvProfile::tp_size`] (a profile already there keeps its other parts), so that
    /// pair validation (`disagg_resilience::pairing`'s `check_pairs` and
    /// `ValidatedSource`, over [`check_pair`](disagg_pairing::check_pair)) refuses
    /// a prefill of another declared size (LMCache needs equal sizes, see [`Lmcache`]).
    ///
    /// Insert the profile the engine declares first, if any; a plain fact declares
    /// nothing, and the pair is then checked only per request, by [`Lmcache`]'s
    /// `prepare`.
    ///
    /// # Errors
    ///
    /// [`ReceiverError::TpSize`] when `ext` already declares another size,
    /// [`ReceiverError::Fact`] when the text passes the facts' ceilings; `facts` and
    /// `ext` are then left as they were.
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_core::endpoint::Facts;
    /// use disagg_pairing::KvProfile;
    /// use disagg_connectors::lmcache::{LmcacheReceiver, ReceiverError};
    ///
    /// let (mut facts, mut ext) = (Facts::default(), http::Extensions::new());
    /// LmcacheReceiver::parse("10.0.0.7:7300,7301:7400,7401")?.insert_into(&mut facts, &mut ext)?;
    /// assert_eq!(ext.get::<KvProfile>().and_then(|p| p.tp_size), Some(2));
    /// assert_eq!(facts.get(Facts::KV_RECEIVER), Some("10.0.0.7:7300,7301:7400,7401"));
    ///
    /// let (mut facts, mut ext) = (Facts::default(), http::Extensions::new());
    /// ext.insert(KvProfile { tp_size: Some(4), ..KvProfile::default() });
    /// let err = LmcacheReceiver::parse("10.0.0.7:7300,7301:7400,7401")?
    ///     .insert_into(&mut facts, &mut ext);
    /// assert_eq!(err, Err(ReceiverError::TpSize { declared: 4, ranks: 2 }));
    /// # Ok::<(), ReceiverError>(())
    /// ```
    pub fn insert_into(
        &self,
        facts: &mut Facts,
        ext: &mut http::Extensions,
    ) -> Result<(), ReceiverError> {
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
        facts.insert(Facts::KV_RECEIVER, self.to_string())?;
        ext.insert(profile);
        Ok(())
    }
}

/// The text form [`LmcacheReceiver::parse`] reads: `HOST:INIT[,INIT...]:ALLOC[,ALLOC...]`.
impl std::fmt::Display for LmcacheReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |f: &mut std::fmt::Formatter<'_>, ports: &[u16]| {
            for (i, p) in ports.iter().enumerate() {
                if i > 0 {
                    f.write_str(",")?;
                }
                write!(f, "{p}")?;
            }
            Ok(())
        };
        write!(f, "{}:", self.host)?;
        list(f, &self.init_ports)?;
        f.write_str(":")?;
        list(f, &self.alloc_ports)
    }
}

/// The LMCache P/D connector (vLLM `LMCacheConnectorV1`, NIXL transfer channel).
///
/// Decode endpoints carry an [`LmcacheReceiver`] in their [`Facts::KV_RECEIVER`]
/// fact (parsed per request; a malformed one fails the request naming the endpoint and
/// the key); the prefill
/// engines' `pd_proxy_host`/`pd_proxy_port` point at the [`Notifications`] socket.
///
/// A prefill and a decode pair only at equal tensor-parallel sizes
/// ([`bridges_tp`](KvConnector::bridges_tp)), the decode's size being its receiver's
/// rank count: [`LmcacheReceiver::insert_into`] declares it, so that pair validation
/// refuses a prefill that declares another size, and `prepare` refuses such a pair per
/// request when the receiver was inserted without declaring it.
///
/// A request whose prompt ids were known without a `/tokenize` needs its prefill's
/// context length (`max_model_len`), which the connector remembers for 10 s per
/// prefill engine and model, as the module doc of `lmcache/connector/context.rs` tells.
///
/// ```no_run
/// use std::sync::Arc;
/// use disagg_core::{Endpoint, Role};
/// use disagg_core::endpoint::Facts;
/// use disagg_connectors::lmcache::{Lmcache, LmcacheReceiver, Notifications, NotifyConfig};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let notifications = Notifications::bind("0.0.0.0:7500", NotifyConfig::default()).await?;
/// let connector = Lmcache::new(notifications);
/// let (mut facts, mut ext) = (Facts::default(), http::Extensions::new());
/// LmcacheReceiver::parse("10.0.0.7:7300,7301:7400,7401")?.insert_into(&mut facts, &mut ext)?;
/// let decode = Endpoint::with_extensions("http://10.0.0.7:7200", Role::Decode, ext)?
///     .with_facts(facts);
/// # let _ = (connector, decode);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Lmcache {
    notifications: Notifications,
    prefix: u64,
    next: AtomicU64,
    limits: VllmLimits,
    max_prompt_tokens: usize,
    /// Bounds the decodings of large id lists on the blocking pool.
    blocking: BlockingLimit,
    /// Each prefill engine's context length, remembered for 10 s.
    contexts: context::ContextLengths,
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
            max_prompt_tokens: MAX_PROMPT_TOKENS,
            blocking: BlockingLimit::default(),
            contexts: context::ContextLengths::default(),
        }
    }

    /// Carry prompts of at most `max` token ids (the default is
    /// [`MAX_PROMPT_TOKENS`]): a longer one, whether the client sent the ids or the
    /// prefill's `/tokenize` answered them, fails the request with a 400
    /// ([`ConnectorError::Unsupported`]) naming the ceiling, before either leg is sent.
    /// The ids are decoded no further than the first past `max`, and the prefill's
    /// `/tokenize` answer is read up to
    /// [`answer_limit`](disagg_tokenize::engine::answer_limit)`(max)` bytes (a longer one
    /// fails the request the same way).
    #[must_use]
    pub fn with_max_prompt_tokens(mut self, max: usize) -> Self {
        self.max_prompt_tokens = max;
        self
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

    /// A request id: `disagg-{prefix}-{n}-{secret}`. The connector's prefix and the
    /// counter `n` keep ids unique; `secret`, 16 hex digits drawn afresh for each id,
    /// makes it unguessable. Every prefill engine sees its requests' ids (in
    /// `disagg_spec.req_id`) and anything that reaches the notification socket may send
    /// a `ProxyNotif`: were the ids predictable, a peer that saw one could complete the
    /// next requests' waits before their KV arrived.
    fn next_req_id(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("disagg-{:016x}-{n}-{:016x}", self.prefix, secret())
    }
}

/// 64 bits from the operating system's random source, which no other id reveals. A v4
/// UUID's halves each have a few fixed bits (the version's in the first, the
/// variant's in the second), never at the same place: their XOR is 64 random bits.
fn secret() -> u64 {
    let (high, low) = uuid::Uuid::new_v4().as_u64_pair();
    high ^ low
}

/// What one attempt carries from `prepare` to its reshape.
#[derive(Debug, Clone)]
pub(super) struct Plan {
    pub(super) req_id: String,
    pub(super) chat: bool,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    /// The client's token limit as vLLM reads it ([`token_limit`](limit::token_limit)); `None`: the rest
    /// of the context.
    pub(super) max_tokens: Option<u64>,
    /// The prefill engine's context length, from its `/tokenize` answer (`None`: not
    /// asked, or not given as a positive integer).
    pub(super) max_model_len: Option<u64>,
    pub(super) min_tokens: Option<u64>,
    /// How many decode ranks notify.
    pub(super) ranks: usize,
    /// The `/tokenize` request, unless the prompt is token ids already (or is a
    /// completions prompt still `unchecked`).
    pub(super) tokenize: Option<Bytes>,
    /// The check of a large prompt `prepare` left to `resolve`, off the event loop.
    pub(super) unchecked: Option<Unchecked>,
    /// The prompt's token ids, once tokenized.
    pub(super) tokens: Option<Arc<[u64]>>,
    /// The prefill's first token, once it answered with one.
    pub(super) first: Option<First>,
}

/// The prefill's answer, as far as the client's answer needs it.
#[derive(Debug, Clone)]
pub(super) struct First {
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) text: String,
    /// `Some` when the first token ended the answer.
    pub(super) finish: Option<String>,
    /// The prefill's usage (the prompt and one token).
    pub(super) usage: Option<Value>,
    /// Why the first token stopped the answer (a stop string or token id), as the
    /// prefill said it; null otherwise.
    pub(super) stop_reason: Value,
}

/// What a decode with a malformed [`Facts::KV_RECEIVER`] lacks, in
/// [`ConnectorError::NotConfigured`].
const BAD_RECEIVER: &str =
    "usable `kv_receiver` fact (HOST:INIT[,INIT...]:ALLOC[,ALLOC...], one of each per TP rank)";

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
                connector: NAME,
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
        NAME
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
    ///
    /// So is a chat whose true `echo` puts its last message in front of the answer
    /// (vLLM does when that message's role is the answer's: the assistant's under
    /// `add_generation_prompt`, true by default), which the completions legs cannot say
    /// (their `echo` would repeat the whole templated prompt). An `echo` that would
    /// put nothing there, or a false one, is dropped from the legs.
    fn check(&self, req: &PdRequest) -> Result<Decision, InvalidParam> {
        let decision = crate::vllm::rewrite::check::check_request(req, &self.limits)?;
        if decision == Decision::Disaggregate {
            return Ok(direct::reason(req).map_or(decision, |reason| Decision::Direct { reason }));
        }
        Ok(decision)
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        let prefill_ep = route.prefill.as_ref().ok_or(ConnectorError::NeedsPrefill {
            connector: self.name(),
        })?;
        let not_configured = |what| ConnectorError::NotConfigured {
            endpoint: route.decode.id().clone(),
            what,
        };
        let receiver = LmcacheReceiver::from_facts(route.decode.facts())
            .map_err(|_| not_configured(BAD_RECEIVER))?
            .ok_or_else(|| not_configured("LMCache receiver (host, init and alloc ports)"))?;
        let receiver = &receiver;
        check_tp(prefill_ep, &route.decode, receiver)?;
        let body = req.body();
        if req.api() == Api::Generate {
            // LMCache's legs are vLLM's OpenAI routes; SGLang's API has no place there.
            return Err(refused("SGLang's native /generate API"));
        }
        // Its legs are built for chat and completions bodies only.
        crate::common::carries(self.name(), req.api(), &[Api::Chat, Api::Completions])?;
        if int_field(body, "n").is_some_and(|n| n > 1)
            || int_field(body, "best_of").is_some_and(|n| n > 1)
        {
            return Err(refused("more than one choice (n, best_of)"));
        }
        let chat = req.api() == Api::Chat;
        // The prompt is checked here when that is cheap (see `prompt`), else by
        // `resolve`, off the event loop: a chat for media parts, a completions prompt
        // for what it is.
        let (mut client_ids, mut unchecked) = (false, None);
        if chat {
            if let Some(messages) = body.get_bytes("messages") {
                if messages.len() >= READ_OFF_LOOP_FROM {
                    unchecked = Some(Unchecked::Messages(messages));
                } else if let Some(kind) = media::media_part(&messages) {
                    return Err(prompt::with_media(kind));
                }
            }
        } else if let Some(p) = body.get("prompt") {
            match prompt::on_the_loop(p) {
                Some(Kind::Batch) => return Err(prompt::batch()),
                Some(kind) => client_ids = kind == Kind::Ids,
                None => {
                    unchecked = body.get_bytes("prompt").map(|prompt| Unchecked::Prompt {
                        prompt,
                        model: body.get_bytes("model").filter(|m| &m[..] != b"null"),
                        known: req.tokens().is_some(),
                    });
                }
            }
        }
        let max_tokens = token_limit(body, chat);
        let min_tokens = int_field(body, "min_tokens");
        let stream_options = body.get_bytes("stream_options");
        let include_usage = body
            .get("stream_options")
            .and_then(|o| std::str::from_utf8(o).ok())
            .and_then(|o| disagg_json::raw::member(o, "include_usage"))
            .is_some_and(|v| v.get() == "true");

        // The ids the orchestrator already has (its tokenizer ran for a router that
        // reads them) spare the prefill engine's `/tokenize` round trip.
        let known = req.tokens();
        let completion_unchecked = matches!(unchecked, Some(Unchecked::Prompt { .. }));
        let tokenize = (known.is_none() && !client_ids && !completion_unchecked)
            .then(|| tokenize_request(body, chat));

        // The completions form both legs share.
        let mut base = body.clone();
        for field in CHAT_ONLY {
            base.remove(field);
        }
        base.remove("kv_transfer_params");
        base.remove("stream_options");
        if chat {
            // One that echoes is served direct (`check`); any other says nothing.
            base.remove("echo");
        }

        let req_id = self.next_req_id();
        let mut prefill = base.clone();
        prefill.set("max_tokens", &1);
        prefill.set("stream", &false);
        // Its token is the client's first: a `min_tokens` holds for it (valid with
        // `max_tokens: 1`), the decode owing the rest (`complete`).
        prefill.remove("min_tokens");
        if min_tokens.is_some_and(|m| m >= 1) {
            prefill.set("min_tokens", &1);
        }
        for field in ["n", "best_of"] {
            if prefill.get(field).is_some() {
                prefill.set(field, &1);
            }
        }
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
        match max_tokens {
            Some(m) => decode.set("max_tokens", &m),
            // The rest of the context, once known (`complete`); never a `null`, which
            // vLLM's completions route fails on.
            None => {
                decode.remove("max_tokens");
            }
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
            max_model_len: None,
            min_tokens,
            ranks: receiver.ranks(),
            tokenize,
            unchecked,
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
        Some(crate::vllm::rewrite::release_body(api, &decode.body).to_bytes())
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
        let Some(mut plan) = handoff.ext.get::<Plan>().cloned() else {
            return Err(ConnectorError::NotReady {
                reason: "the plan was not prepared by this connector".into(),
            });
        };
        let tokenize = match plan.unchecked.take() {
            None => plan.tokenize.take(),
            Some(u) => prompt::check_off_loop(u, plan.tokenize.take(), &self.blocking).await?,
        };
        let max = self.max_prompt_tokens;
        let prompt = handoff.prefill.body.get_bytes("prompt");
        let asked = tokenize.is_some();
        let (tokens, told) =
            ids::prompt_ids(transport, &ep, tokenize, prompt, max, &self.blocking).await?;
        if tokens.is_empty() {
            return Err(ids::empty());
        }
        // The context's length, which no `/tokenize` told when the ids were known
        // (remembered, or asked): a limit the context cannot hold is refused here, not
        // by the decode after the prefill ran.
        let prefill = context::Prefill {
            transport,
            ep: &ep,
            model: handoff.prefill.body.get("model"),
            blocking: &self.blocking,
        };
        let told = asked.then_some(told);
        let max_model_len = (self.contexts)
            .checked(&plan, tokens.len(), told, prefill)
            .await?;
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
            p.max_model_len = max_model_len;
        }
        Ok(())
    }

    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<HandoffFound, ConnectorError> {
        let endpoint = handoff.prefill.endpoint.id().clone();
        let invalid = |field| ConnectorError::InvalidHandoff {
            endpoint: endpoint.clone(),
            field,
        };
        let reply: PrefillReply<'_> =
            serde_json::from_slice(&answer.body).map_err(|_| invalid("choices"))?;
        // Held until the answer ends, and built as `Value`s to be written into it: a
        // ceiling first (a prefill's usage or stop reason is a few dozen bytes).
        let usage = built(reply.usage).ok_or_else(|| invalid("usage"))?;
        let first_choice = reply.choices.0;
        let stop_reason = built(first_choice.as_ref().and_then(|c| c.stop_reason))
            .ok_or_else(|| invalid("choices"))?
            .unwrap_or(Value::Null);
        let Some(plan) = handoff.ext.get_mut::<Plan>() else {
            return Ok(HandoffFound::Missing);
        };
        let first_tok = reply.kv_transfer_params.as_ref().and_then(|p| p.first_tok);
        let (Some(first_tok), Some(choice), Some(tokens)) =
            (first_tok, first_choice, plan.tokens.clone())
        else {
            // No first token: the decode computes the whole answer from the prompt.
            let prompt = plan.tokens.as_ref().map(|t| t.len());
            if let Some(rest) = prompt.and_then(|p| rest_of_context(plan, p)) {
                // None left: vLLM refuses it as too long, as it would the client's.
                handoff.decode.body.set("max_tokens", &rest.max(1));
            }
            handoff.gate = None;
            handoff.reshape = reshaper(plan);
            return Ok(HandoffFound::Missing);
        };
        // The decode's prompt is the ids and the first token.
        let rest = rest_of_context(plan, tokens.len().saturating_add(1));
        let finished = choice
            .finish_reason
            .as_deref()
            .is_some_and(|f| f != "length")
            || plan.max_tokens.is_some_and(|m| m <= 1)
            || rest == Some(0);
        let first = First {
            id: reply.id.unwrap_or_else(|| format!("cmpl-{}", plan.req_id)),
            created: reply.created.unwrap_or(0),
            model: reply.model.unwrap_or_default(),
            text: choice.text.unwrap_or_default(),
            usage,
            stop_reason,
            finish: finished.then(|| choice.finish_reason.unwrap_or_else(|| "length".to_owned())),
        };
        plan.first = Some(first);
        handoff.reshape = reshaper(plan);
        if plan.stream {
            handoff.lead = Some(lead(plan));
        }
        if finished {
            handoff.gate = None;
            return Ok(HandoffFound::Finished);
        }
        let decode = &mut handoff.decode.body;
        let mut prompt = Vec::with_capacity(tokens.len() + 1);
        prompt.extend_from_slice(&tokens);
        prompt.push(first_tok);
        decode.set("prompt", &prompt);
        // A completions `echo` put the prompt in front of the prefill's token already.
        decode.remove("echo");
        if let Some(m) = plan.max_tokens.map(|m| m - 1).or(rest) {
            decode.set("max_tokens", &m);
        }
        if let Some(m) = plan.min_tokens {
            decode.set("min_tokens", &m.saturating_sub(1));
        }
        Ok(HandoffFound::Handed)
    }
}

#[derive(Deserialize)]
struct PrefillReply<'a> {
    id: Option<String>,
    created: Option<u64>,
    model: Option<String>,
    #[serde(default, borrow)]
    choices: FirstChoice<'a>,
    kv_transfer_params: Option<KvParamsIn>,
    #[serde(borrow)]
    usage: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct ChoiceIn<'a> {
    text: Option<String>,
    finish_reason: Option<String>,
    #[serde(default, borrow)]
    stop_reason: Option<&'a RawValue>,
}

/// The largest prefill `usage` or `stop_reason` built and held for the client's
/// answer: each is a few dozen bytes from an engine.
const MAX_HELD_FIELD: usize = 64 * 1024;

/// `raw` built as a [`Value`], `None` past [`MAX_HELD_FIELD`]; `Some(None)` without
/// it (a JSON `null` is a value).
fn built(raw: Option<&RawValue>) -> Option<Option<Value>> {
    let Some(raw) = raw else {
        return Some(None);
    };
    if raw.get().len() > MAX_HELD_FIELD {
        return None;
    }
    serde_json::from_str(raw.get()).ok().map(Some)
}

/// The first of a prefill's choices (it answers one), the others read unbuilt: a
/// prefill's list of millions of `{}` is no million choices in memory.
#[derive(Default)]
struct FirstChoice<'a>(Option<ChoiceIn<'a>>);

impl<'de: 'a, 'a> Deserialize<'de> for FirstChoice<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct First<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for First<'a> {
            type Value = FirstChoice<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of choices")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let first = seq.next_element::<ChoiceIn<'a>>()?;
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(FirstChoice(first))
            }
        }
        d.deserialize_seq(First(std::marker::PhantomData))
    }
}

#[derive(Deserialize)]
struct KvParamsIn {
    first_tok: Option<u64>,
}

mod context;
mod direct;
mod ids;
mod limit;
mod media;
mod prompt;

#[cfg(test)]
mod tests;
