//! The encoder stage of E/P/D serving: multimodal requests whose media items are encoded
//! on encoder-only engines before the prefill.
//!
//! A request whose media field holds media parts (chat's `messages`: `image_url`,
//! `input_audio`, `audio_url`, `video_url`; the Responses API's `input`: `input_image`,
//! `input_audio`; the Messages API's `messages`: `image`) goes E → P → D (or E → PD when
//! there is no prefill pool): the encoder legs run first, concurrently over the encoder
//! pool, and their answers are folded into the body the prefill and decode legs carry;
//! then today's P → D handoff runs unchanged. A request without media takes the path it
//! always took: the only added work is a byte search of that field for those part
//! types, and none at all when no encoder stage is configured.
//!
//! As for KV, the engines' protocol is not the core's: an [`EncoderConnector`] (vLLM's is
//! `disagg_connectors::vllm::VllmEncoder`) plans the encoder legs from the client's body
//! and folds their answers; the [`EncodeStage`] (its settings, counters and the
//! encoders' passive health) sends them to the source's encoders (endpoints of role
//! [`Role::Encode`](crate::Role::Encode), taken from the request's snapshot), with a retry on another encoder for a leg that failed (each try
//! within its share of the time left) and one deadline for the whole stage. A client that leaves drops the request's future, and with it
//! every encoder leg still running.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use crate::endpoint::{Endpoint, EndpointId};
use crate::error::ConnectorError;
use crate::request::{Api, PdRequest};
use disagg_json::InvalidParam;

/// One encoder leg's body and how many media items it carries.
#[derive(Debug, Clone)]
pub struct EncodeLeg {
    /// The body posted to the encoder's chat route.
    pub body: Bytes,
    /// Media items in it.
    pub items: usize,
}

/// The encoder legs of one request, and what the prefill and decode legs carry instead
/// of the client's fields.
#[derive(Debug, Clone, Default)]
pub struct EncodePlan {
    /// The encoder legs, each to be sent to one encoder.
    pub legs: Vec<EncodeLeg>,
    /// Top-level fields of the client's body replaced on the legs that follow (vLLM: the
    /// `messages`, each media item given the `uuid` its encoder leg carried).
    pub fields: Vec<(&'static str, Bytes)>,
    /// The consumer's data-parallel rank the legs were planned for, when the connector
    /// chose it ([`EncoderConnector::plan_for`] given no rank): the orchestrator pins
    /// the consumer leg to it (`X-data-parallel-rank`), as it pins a route's own rank.
    /// `None` leaves the route as it is.
    pub rank: Option<u32>,
}

impl EncodePlan {
    /// How many media items the plan encodes.
    pub(crate) fn items(&self) -> usize {
        self.legs.iter().map(|l| l.items).sum()
    }
}

/// One encoder protocol: which items to encode, how, and what the encoders' answers
/// give the prefill.
pub trait EncoderConnector: Send + Sync + 'static {
    /// The protocol's name, for logs.
    fn name(&self) -> &'static str;

    /// The encoder legs for `req`, or `None` when it holds no media item after all (the
    /// byte search that selected it found the part type's name elsewhere). Pure: no I/O.
    ///
    /// # Errors
    ///
    /// [`InvalidParam`] when the media parts are malformed (answered 400, no engine
    /// contacted).
    fn plan(&self, req: &PdRequest) -> Result<Option<EncodePlan>, InvalidParam>;

    /// Whether the encoder legs must name the engine that will consume the items (a
    /// push protocol: vLLM's Mooncake EC connector has the encoders push to the
    /// consumer). When `true`, the orchestrator routes the request before its encoder
    /// legs, plans them with [`plan_for`](Self::plan_for), and sends the consumer leg
    /// to that engine and rank only. Default `false`: the encoders run first and the
    /// request is routed after, as for a shared store.
    fn consumer_first(&self) -> bool {
        false
    }

    /// The encoder legs for `req` when its items go to `consumer` (the prefill, or the
    /// decode serving alone, already chosen), at data-parallel rank `rank` when the
    /// route pins one. Called instead of [`plan`](Self::plan) when
    /// [`consumer_first`](Self::consumer_first); the default ignores the consumer.
    /// When `rank` is `None` and the items must reach one rank of the consumer, the
    /// connector chooses it and names it in [`EncodePlan::rank`]; the consumer leg is
    /// then pinned to it. A `rank` given is kept.
    ///
    /// # Errors
    ///
    /// As [`plan`](Self::plan).
    fn plan_for(
        &self,
        req: &PdRequest,
        consumer: &Endpoint,
        rank: Option<u32>,
    ) -> Result<Option<EncodePlan>, InvalidParam> {
        let _ = (consumer, rank);
        self.plan(req)
    }

    /// Whether `decode`, serving a request alone (a direct request, e.g. a Responses
    /// request that keeps state), loads the encoders' output: it declares an EC role
    /// that consumes. The orchestrator runs the stage for such a request only when
    /// there is no prefill pool (E → PD: the decodes are the consumers) or every decode
    /// serving the request's model consumes; otherwise the decode gets the media and
    /// encodes them itself. Default `false`.
    fn consumes(&self, decode: &Endpoint) -> bool {
        let _ = decode;
        false
    }

    /// The top-level fields the encoders' `answers` (their 2xx bodies, one per leg in
    /// `plan`'s order) add to the legs that follow (vLLM: the merged
    /// `ec_transfer_params`). A field named in `plan`'s [`fields`](EncodePlan::fields)
    /// too replaces the plan's (vLLM: `messages` with items rewritten to the embeddings
    /// placeholders the answers allow).
    ///
    /// # Errors
    ///
    /// [`ConnectorError`] when an answer is unusable (the request fails with 502).
    fn fold(
        &self,
        plan: &EncodePlan,
        answers: &[Bytes],
    ) -> Result<Vec<(&'static str, Bytes)>, ConnectorError>;
}

/// Settings of an [`EncodeStage`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EncodeConfig {
    /// The whole stage's budget: every encoder leg, retries included (default 60 s). The
    /// request's own deadline, when sooner, bounds it too. Each try of a leg gets its
    /// fair share of what is left (that divided by the tries it may still make, itself
    /// included): an encoder that has not answered within it failed, and the leg goes
    /// to the next encoder.
    pub timeout: Duration,
    /// How many encoders a leg may be tried on, the first included (default 2; at most
    /// the pool's size).
    pub attempts: usize,
    /// Largest encoder answer read (default 4 MiB): a longer one fails its leg.
    pub max_answer_bytes: usize,
    /// How long an encoder whose leg failed (unreachable, 5xx, a 4xx the items did not
    /// cause, no answer within the try's share of [`timeout`](Self::timeout), an
    /// unreadable answer) is passed over while another is healthy (default 5 s; passive
    /// health). Its next success clears it at once.
    pub eject_for: Duration,
}

impl Default for EncodeConfig {
    fn default() -> Self {
        EncodeConfig {
            timeout: Duration::from_secs(60),
            attempts: 2,
            max_answer_bytes: 4 << 20,
            eject_for: Duration::from_secs(5),
        }
    }
}

/// What an [`EncodeStage`] counted so far.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct EncodeStats {
    /// Requests that went through the encoder stage (their media encoded, or failed).
    pub requests: u64,
    /// Media items sent to encoders.
    pub items: u64,
    /// Encoder legs sent (retries included).
    pub legs: u64,
    /// Encoder legs sent again on another encoder after one failed.
    pub retries: u64,
    /// Requests whose encoder stage failed (the request failed with it).
    pub failures: u64,
    /// Requests with media served on a decode alone that loads no encoder output
    /// (an E → P → D deployment whose decodes declare no consuming EC role): the stage
    /// was skipped and the decode encoded the media itself.
    pub skipped: u64,
    /// Total time spent in the stage, in microseconds (for a mean; the per-request
    /// distribution is the listeners').
    pub micros: u64,
    /// Encoders passed over at the time of the reading (their leg failed within
    /// [`EncodeConfig::eject_for`]): a gauge, not a count.
    pub ejected: u64,
}

#[derive(Debug, Default)]
pub(crate) struct EncodeCounters {
    pub(crate) requests: AtomicU64,
    pub(crate) items: AtomicU64,
    pub(crate) legs: AtomicU64,
    pub(crate) retries: AtomicU64,
    pub(crate) failures: AtomicU64,
    pub(crate) skipped: AtomicU64,
    pub(crate) micros: AtomicU64,
}

/// The encoder stage: its protocol, settings, counters and the encoders' passive
/// health. Given to the orchestrator with
/// [`OrchestratorBuilder::encoder`](crate::orchestrator::OrchestratorBuilder::encoder).
///
/// The encoders themselves are endpoints of role [`Role::Encode`](crate::Role::Encode)
/// in the orchestrator's [`EndpointSource`](crate::source::EndpointSource): each request
/// takes its pool from the snapshot it is served with (those serving its model, when
/// endpoints declare models), so discovery adds and removes encoders at run time and a
/// source that checks health leaves an unhealthy encoder out. A snapshot without
/// encoders serves every request without the stage.
pub struct EncodeStage {
    pub(crate) connector: Arc<dyn EncoderConnector>,
    pub(crate) config: EncodeConfig,
    next: AtomicUsize,
    /// Per encoder passed over: until when (microseconds since `epoch`). Touched only
    /// once a leg failed: `down_count` says whether there is anything to look up.
    down_until: Mutex<HashMap<EndpointId, u64>>,
    down_count: AtomicUsize,
    epoch: std::time::Instant,
    pub(crate) counters: EncodeCounters,
    /// The byte pre-check's needles: chat's two, then the Responses API's two, then the
    /// Messages API's one (see [`media_field`]).
    finders: [memchr::memmem::Finder<'static>; 5],
}

impl std::fmt::Debug for EncodeStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncodeStage")
            .field("connector", &self.connector.name())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl EncodeStage {
    /// A stage sending media items, with `connector`'s protocol, to the encoders of the
    /// orchestrator's source (its endpoints of role
    /// [`Role::Encode`](crate::Role::Encode)).
    pub fn new(connector: impl EncoderConnector, config: EncodeConfig) -> Self {
        EncodeStage {
            connector: Arc::new(connector),
            down_until: Mutex::new(HashMap::new()),
            down_count: AtomicUsize::new(0),
            epoch: std::time::Instant::now(),
            config,
            next: AtomicUsize::new(0),
            counters: EncodeCounters::default(),
            finders: [
                // Chat: `image_url`, `audio_url` and `video_url` all end so;
                // `input_audio` is the other part type.
                memchr::memmem::Finder::new(b"_url\""),
                memchr::memmem::Finder::new(b"\"input_audio\""),
                // Responses: its `input_image` and `input_audio` parts.
                memchr::memmem::Finder::new(b"\"input_image\""),
                memchr::memmem::Finder::new(b"\"input_audio\""),
                // Messages: Anthropic's `image` blocks.
                memchr::memmem::Finder::new(b"\"image\""),
            ],
        }
    }

    /// What the stage counted so far.
    pub fn stats(&self) -> EncodeStats {
        let c = &self.counters;
        EncodeStats {
            requests: c.requests.load(Relaxed),
            items: c.items.load(Relaxed),
            legs: c.legs.load(Relaxed),
            retries: c.retries.load(Relaxed),
            failures: c.failures.load(Relaxed),
            skipped: c.skipped.load(Relaxed),
            micros: c.micros.load(Relaxed),
            ejected: self.ejected(),
        }
    }

    /// Whether `req` may hold media parts: a chat, Responses or Messages request whose
    /// media-carrying field ([`media_field`]) contains one of its media part types'
    /// names. A byte search, no parse: a text-only request pays only it (the pool is
    /// looked up only for a request this selects).
    pub(crate) fn wants(&self, req: &PdRequest) -> bool {
        let finders = match req.api() {
            Api::Chat => &self.finders[0..2],
            Api::Responses => &self.finders[2..4],
            Api::Messages => &self.finders[4..5],
            _ => return false,
        };
        let Some(field) = media_field(req.api()).and_then(|f| req.body().get(f)) else {
            return false;
        };
        finders.iter().any(|f| f.find(field).is_some())
    }

    /// The encoder of `pool` a leg tries first: a healthy one before one passed over,
    /// then the least loaded ([`Endpoint::load`]: this proxy's legs in flight there, or
    /// the encoder's own count of its requests when its `/metrics` are read), ties
    /// broken round robin.
    pub(crate) fn first(&self, pool: &[Arc<Endpoint>]) -> usize {
        let n = pool.len();
        let start = self.next.fetch_add(1, Relaxed) % n.max(1);
        let now = self.now_micros();
        let down = self.down_snapshot();
        (0..n)
            .map(|k| (start + k) % n)
            .min_by_key(|&i| {
                let is_down = down
                    .as_ref()
                    .is_some_and(|d| d.get(pool[i].id()).is_some_and(|&u| u > now));
                (is_down, pool[i].load())
            })
            .unwrap_or(0)
    }

    /// The encoders passed over, copied out of the lock, or `None` when none is (the
    /// usual case: no lock taken).
    fn down_snapshot(&self) -> Option<HashMap<EndpointId, u64>> {
        if self.down_count.load(Relaxed) == 0 {
            return None;
        }
        self.down_until.lock().ok().map(|d| d.clone())
    }

    fn now_micros(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Tell how a leg on `encoder` ended: a failure passes it over for
    /// [`EncodeConfig::eject_for`], a success clears that.
    pub(crate) fn observe(&self, encoder: &Endpoint, ok: bool) {
        if ok && self.down_count.load(Relaxed) == 0 {
            return;
        }
        let Ok(mut down) = self.down_until.lock() else {
            return;
        };
        let now = self.now_micros();
        // Forget the encoders whose time is over (and those that left the set stay
        // bounded by the encoders ever seen failing within `eject_for`).
        down.retain(|_, until| *until > now);
        if ok {
            down.remove(encoder.id());
        } else {
            let until = now.saturating_add(
                u64::try_from(self.config.eject_for.as_micros()).unwrap_or(u64::MAX),
            );
            down.insert(encoder.id().clone(), until);
        }
        self.down_count.store(down.len(), Relaxed);
    }

    /// The encoders passed over now (their leg failed within
    /// [`EncodeConfig::eject_for`]).
    fn ejected(&self) -> u64 {
        let now = self.now_micros();
        let down = self
            .down_snapshot()
            .map_or(0, |d| d.values().filter(|&&u| u > now).count());
        u64::try_from(down).unwrap_or(u64::MAX)
    }
}

/// The top-level field of `api`'s body that holds its media parts, for the APIs the
/// encoder stage serves: chat's and Messages' `messages`, the Responses API's `input`.
/// Also the `param` a refused item is answered with.
pub(crate) fn media_field(api: Api) -> Option<&'static str> {
    match api {
        Api::Chat | Api::Messages => Some("messages"),
        Api::Responses => Some("input"),
        _ => None,
    }
}

/// Whether an encoder's answer `status` says it refused the media items themselves: 400
/// (an image it cannot decode), 413 (too large), 414 (a data URL too long for its
/// request line), 415 (a media type it does not take), 422 (not processable). The client's
/// fault, which would fail on any encoder: answered 400, never retried, the encoder not
/// blamed.
pub(crate) fn item_refused(status: http::StatusCode) -> bool {
    matches!(status.as_u16(), 400 | 413 | 414 | 415 | 422)
}

/// Whether an answer's status says another encoder may do better: a server's failure,
/// or a 4xx about the encoder's own state rather than the items (429 overloaded, 408,
/// 404 a model it does not serve, 401 and 403 credentials it wants...): only
/// [`item_refused`] is the item's fault and would fail anywhere.
pub(crate) fn retryable_status(status: http::StatusCode) -> bool {
    status.is_server_error() || (status.is_client_error() && !item_refused(status))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    #[test]
    fn only_what_the_items_cause_is_their_fault() {
        for s in [400, 413, 414, 415, 422] {
            let s = StatusCode::from_u16(s).unwrap();
            assert!(item_refused(s) && !retryable_status(s), "{s}");
        }
        // The encoder's own state: another encoder may do better.
        for s in [401, 403, 404, 408, 429, 500, 502, 503, 504] {
            let s = StatusCode::from_u16(s).unwrap();
            assert!(!item_refused(s) && retryable_status(s), "{s}");
        }
        assert!(!retryable_status(StatusCode::OK));
    }
}
