//! The prefill engines' context lengths (`max_model_len`), remembered for a short time,
//! so that a request whose prompt ids were known without a `/tokenize` (the client's,
//! or a token-reading router's) does not ask its prefill for the length each time.
//!
//! Every `/tokenize` answer of a prefill tells its length: the prompt's, and the
//! one-character probe ([`context_length`]) a known-ids request asks when it needs the
//! length ([`needs_context`]). Each answer is remembered for [`TTL`] (10 s, as long as
//! the proxy keeps the engines' model lists), keyed by the engine's `/tokenize`
//! address and the `model` the request named, as written: one address may front
//! engines of several models (a load balancer), each with its own `--max-model-len`.
//! The data-parallel ranks of one engine (`URL@RANK`) share its address and its
//! entries. An answer without a length is remembered too (an engine that does not tell
//! it is not asked again for 10 s). A `model` of more than [`MAX_MODEL_KEY`] bytes is
//! not remembered: its requests ask each time.
//!
//! So the probe is asked about once per engine and model every 10 s, and not at all
//! while prompts of text keep reaching that engine's `/tokenize`. Requests that miss
//! together (before the first answer, or once it expired) share one probe: the first
//! sends it and spawns a task that reads its answer, and every request, that one
//! included, waits for the task to tell it (no lock is held across the call: the
//! entry of a probe under way holds the channel its task answers on, and is removed
//! when the task is done). The task does not depend on the requests: one dropped (its
//! client gone) or never polled again leaves it running, and it still remembers what
//! it learned. It tells everyone its outcome, each request taking it as its own: a
//! length, a failure on the engine's side, and also a refusal of the client's (the
//! `model` the prefill does not serve or refuses: 404, 400/422, each request's 400
//! with the engine's words) or the proxy's loss (a job the blocking pool lost),
//! which teach nothing and are not remembered. Not strictly once:
//!
//! - a request the remembered length would refuse asks afresh (below), or joins a
//!   probe under way, so each of a run of requests whose limits the context cannot
//!   hold asks;
//! - a probe that learned nothing (a refusal, a loss) is asked again by the next
//!   request that misses after it ended;
//! - at most [`MAX_ENGINES`] probes are shared at once: a miss beyond them asks alone
//!   (its own probe, within its own time, not spawned).
//!
//! A probe has at most [`CONTEXT_PROBE_TIMEOUT`] (2 s, or
//! [`Lmcache::with_context_probe_timeout`]; zero is read as that default, anything
//! above a minute as a minute, [`MAX_CONTEXT_PROBE_TIMEOUT`]) from when it is sent:
//! past it the probe has failed on the engine's side, and only then is a failure for
//! want of time remembered. A request waits for the probe it joined at
//! most until that probe ends, which is never later than that time from when the
//! request began to wait (the probe began no later), and the task never outlives it.
//! (An engine that took the connection and never answered would otherwise hold the
//! request until the orchestrator's handoff budget, 10 s by default, failed it: 504.)
//!
//! A probe that fails on the engine's side (a status other than the client's 404 or
//! 400/422, a gateway that does not route `/tokenize`, no answer in time: a
//! [`ConnectorError::Engine`]) fails only a request that cannot do without the length:
//! a client without a limit, whose decode's budget is the rest of the context. A
//! request with a limit, which needed it only to check the limit's room, is carried
//! unchecked (the decode refuses a limit its context cannot hold, after the prefill
//! ran), and the failure is remembered for 10 s like an answer: the requests with a
//! limit that follow skip the check without asking, those without one ask again. The
//! requests that waited on a probe take its failure as their own, but the engine is
//! blamed once for it: the first request without a limit to take it fails naming the
//! prefill (502, [`ConnectorError::Engine`], counted against its passive health), the
//! others without a limit fail too (502) with an error that names no engine
//! ([`ConnectorError::NotReady`]), so a run of requests sharing one silent probe is one
//! failure of the prefill, not enough to eject it. A warning is logged when a failure
//! is learned, not for each request it then spares, in the span of the request that
//! started the probe.
//!
//! An engine restarted with another `--max-model-len` behind the same address is read
//! anew within 10 s. Until then the remembered length may be stale:
//!
//! - a longer one than the engine's now lets a limit its context cannot hold pass (and
//!   gives a client without a limit more than the rest of it): the prefill runs and
//!   the decode refuses its leg (400, vLLM's words), as a decode with a shorter context
//!   than the prefill's does. A whole answer is that 400 as the decode wrote it; a
//!   stream has had its first token and ends with an error event carrying those words.
//! - a shorter one refuses nothing: a check it fails is made again on a fresh answer,
//!   and the request refused only on that. A client without a limit is given the rest
//!   of the remembered context, a shorter answer than it could have had.
//!
//! At most [`MAX_ENGINES`] entries (engine and model) are remembered. When a new one
//! comes and the map is full, the expired entries are dropped and, if none was, the one
//! learned longest ago (the next to expire anyway): clearing the map would send every
//! engine's next known-ids request to ask again at once. One is evicted only when more
//! than 1,024 of them answered within 10 s, and it costs that engine one probe more.
//!
//! An answer that tells what its entry already says refreshes the entry's time in
//! place, under the map's read lock: only a new or changed entry takes the write lock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use disagg_core::endpoint::Endpoint;
use disagg_core::error::{ConnectorError, TransportError, error_chain};
use disagg_core::transport::{ResponseFuture, Transport};
use disagg_tokenize::prompt::BlockingLimit;
use http::Uri;
use http::header::{CONTENT_TYPE, HeaderValue};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::Instrument;

use super::ids::{context_body, context_length};
use super::limit::{check_limit, check_min_tokens, needs_context};
use super::{Lmcache, Plan, refused};

/// How long the [`Lmcache`] connector waits by default for a prefill's `/tokenize` to
/// tell its context length ([`Lmcache::with_context_probe_timeout`]): 2 s, the
/// orchestrator's default `tokenize_timeout` (its longest wait for an engine's
/// `/tokenize` before routing without the ids: longer means the engine is stuck), well
/// within its default `handoff_timeout` (10 s), which bounds the plan's resolution.
pub const CONTEXT_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

impl Lmcache {
    /// Give a prefill's `/tokenize` at most `timeout` (default
    /// [`CONTEXT_PROBE_TIMEOUT`], 2 s; zero is read as that default, not as no time;
    /// more than a minute as a minute, so that a probe always ends) to tell its
    /// context length, when a request whose ids were known needs it and
    /// none is remembered. The requests that miss together share one probe, which has
    /// that time from when it is sent, whichever of them are still waiting; each waits
    /// until it ends, never longer than `timeout` from when that request began to
    /// wait. Past it the probe has failed on the engine's side (remembered for 10 s):
    /// a request with a limit is carried with its limit's room unchecked, one without
    /// a limit fails (502; the prefill named, and counted against, by one of the
    /// requests that shared the probe only).
    /// Keep it below the orchestrator's `handoff_timeout` (10 s by default), which
    /// bounds the whole resolution of the plan and fails the request (504) when it
    /// passes first.
    #[must_use]
    pub fn with_context_probe_timeout(mut self, timeout: Duration) -> Self {
        self.contexts.set_timeout(timeout);
        self
    }
}

/// The longest a probe may take, and a request wait for one, whatever
/// [`Lmcache::with_context_probe_timeout`] was given: a minute, six times the
/// orchestrator's default handoff budget (10 s), which fails the request long before.
/// A `/tokenize` of one character that takes longer is stuck, and a probe's task must
/// end (a bound too long to add to the clock would leave it waiting for good).
pub(super) const MAX_CONTEXT_PROBE_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a prefill's context length is remembered after its latest `/tokenize`
/// answer: the proxy's cache of the engines' model lists lasts as long.
const TTL: Duration = Duration::from_secs(10);

/// The most entries (a prefill engine and a model) whose context length is remembered,
/// and the most probes shared at once.
const MAX_ENGINES: usize = 1024;

/// The longest `model` (in bytes, as the request wrote it) whose length is remembered:
/// the key holds it, and a client names it.
const MAX_MODEL_KEY: usize = 1024;

/// Each prefill engine's latest context length, by its `/tokenize` address and model,
/// and the probes under way.
#[derive(Debug)]
pub(super) struct ContextLengths {
    /// How long a probe may take, and a request wait for one.
    timeout: Duration,
    /// What was learned and the probes under way, shared with the probes' tasks.
    memory: Arc<Memory>,
}

impl Default for ContextLengths {
    fn default() -> Self {
        ContextLengths {
            timeout: CONTEXT_PROBE_TIMEOUT,
            memory: Arc::new(Memory {
                epoch: Instant::now(),
                engines: RwLock::default(),
                flights: Mutex::default(),
            }),
        }
    }
}

/// The entries learned, and the probes under way.
#[derive(Debug)]
struct Memory {
    /// Where the entries' times count from.
    epoch: Instant,
    engines: RwLock<HashMap<Key, Learned>>,
    /// The probes under way, by entry: where their tasks answer. An entry lives as
    /// long as its task's [`Flight`].
    flights: Mutex<HashMap<Key, Answers>>,
}

/// An entry's key: the prefill's `/tokenize` address and the request's `model`, as
/// written (`None`: no `model`, or `null`; the probe names none then).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    tokenize: Uri,
    model: Option<Box<[u8]>>,
}

/// What an engine told, and when (nanoseconds after [`Memory::epoch`], moved on in
/// place by an answer that tells the same).
#[derive(Debug)]
struct Learned {
    told: Told,
    at: AtomicU64,
}

/// What a prefill's `/tokenize` told of its context length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Told {
    /// It answered: the length, `None` when the answer gave none.
    Length(Option<u64>),
    /// The probe failed on the engine's side: a limit goes unchecked.
    Failed,
}

/// Where the requests waiting on a probe read its answer: `None` until it comes. The
/// channel closes without one only when the probe's task was dropped unfinished (it
/// panicked, or the runtime is shutting down).
type Answers = watch::Receiver<Option<Answer>>;

/// A probe's outcome, as each request that waited on it takes it: the same as the
/// probe's own result, made anew for each.
#[derive(Debug, Clone)]
enum Answer {
    /// The engine's length (`None`: its answer gave none).
    Length(Option<u64>),
    /// The probe failed on the engine's side: why, and whether a request without a
    /// limit already took it as the engine's failure (shared by every waiter's copy).
    Failed {
        why: Arc<str>,
        blamed: Arc<AtomicBool>,
    },
    /// The client's request refused (a `model` the prefill does not serve or
    /// refuses: 404, 400/422): what, with the engine's words.
    Refused(Arc<str>),
    /// No length for a reason of the proxy's or the operator's (a job the blocking
    /// pool lost): why.
    Lost(Arc<str>),
}

impl Answer {
    /// The outcome `asked` of a probe, to be told to the requests waiting on it.
    fn of(asked: &Result<Option<u64>, ConnectorError>) -> Answer {
        match asked {
            Ok(length) => Answer::Length(*length),
            Err(ConnectorError::Engine { source, .. }) => Answer::Failed {
                why: error_chain(&**source).into(),
                blamed: Arc::default(),
            },
            Err(ConnectorError::Unsupported { what, .. }) => Answer::Refused(what.as_str().into()),
            Err(ConnectorError::NotReady { reason }) => Answer::Lost(reason.as_str().into()),
            Err(e) => Answer::Lost(error_chain(e).into()),
        }
    }

    /// The answer as a waiting request's own probe on `ep` would have had it: a
    /// refusal is the client's (400) and a loss the proxy's, as they were for the
    /// probe. A failure on the engine's side names the engine
    /// ([`ConnectorError::Engine`]) for a request with a limit (`limited`: it goes on
    /// with the limit unchecked, failing nothing) and for the first request without
    /// one to take it; the others without one fail too (502), their error naming no
    /// engine ([`ConnectorError::NotReady`]): one probe that failed is one failure of
    /// the engine, however many requests waited on it, not enough to eject it.
    fn taken(self, ep: &Endpoint, limited: bool) -> Result<Option<u64>, ConnectorError> {
        match self {
            Answer::Length(length) => Ok(length),
            Answer::Failed { why, blamed } if limited || !blamed.swap(true, Ordering::Relaxed) => {
                Err(ConnectorError::Engine {
                    endpoint: ep.id().clone(),
                    what: "/tokenize",
                    source: Box::new(Shared(why)),
                })
            }
            Answer::Failed { why, .. } => Err(ConnectorError::NotReady {
                reason: format!(
                    "the /tokenize of prefill endpoint {} gave no context length: {why} (the probe shared by the requests that missed together, its failure counted against the engine by another of them)",
                    ep.id()
                ),
            }),
            Answer::Refused(what) => Err(refused(&*what)),
            Answer::Lost(why) => Err(ConnectorError::NotReady {
                reason: why.to_string(),
            }),
        }
    }
}

/// A probe given no answer within the connector's time for it.
#[derive(Debug, thiserror::Error)]
#[error("no answer within {0:?}")]
struct Unanswered(Duration);

/// The failure on the engine's side of the probe a request waited on (every request
/// that missed, the one that sent it among them, waits on the probe's task).
#[derive(Debug, thiserror::Error)]
#[error("{0} (the probe shared by the requests that missed together)")]
struct Shared(Arc<str>);

/// A probe under way, owned by its task: its entry in [`Memory::flights`] removed
/// when it is [`finish`](Self::finish)ed, or dropped unfinished (the task panicked,
/// or the runtime is shutting down: its channel then closes without an answer).
struct Flight {
    memory: Arc<Memory>,
    key: Key,
    answer: watch::Sender<Option<Answer>>,
}

impl Flight {
    /// Tell `answer` to the requests waiting, the entry removed first: one that comes
    /// after finds what was learned remembered, or asks anew.
    fn finish(self, answer: Answer) {
        self.memory.landed(&self.key, &self.answer);
        self.answer.send_replace(Some(answer));
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        self.memory.landed(&self.key, &self.answer);
    }
}

/// The transport of a shared probe's task: the probe's `/tokenize` already sent
/// through the request's own transport (whose futures are `'static`, so that they may
/// be spawned), handed to [`context_length`] as the answer to its one call. Any other
/// call (a second one, or to another URI than the probe's) is the proxy's bug: it
/// fails, and the probe's outcome is then the proxy's ([`own`](Self::own)), neither
/// remembered nor counted against the engine.
struct Sent {
    /// The exchange sent, until its call takes it.
    exchange: Mutex<Option<ResponseFuture>>,
    /// Where it was sent: the entry's `/tokenize`.
    uri: Uri,
    /// Whether a call other than the one sent was made.
    misused: AtomicBool,
}

impl Sent {
    /// The probe of `key` (the request [`context_length`] makes for its `model`, to its
    /// `/tokenize`: a JSON `POST`), sent through `transport`.
    fn new(transport: &dyn Transport, key: &Key) -> Sent {
        let mut req = http::Request::new(context_body(key.model.as_deref()));
        *req.method_mut() = http::Method::POST;
        *req.uri_mut() = key.tokenize.clone();
        req.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        Sent {
            exchange: Mutex::new(Some(transport.send(req))),
            uri: key.tokenize.clone(),
            misused: AtomicBool::new(false),
        }
    }

    /// The probe's outcome `asked`, unless a call other than the one sent was made:
    /// then the proxy's failure ([`ConnectorError::NotReady`]), not the engine's.
    fn own(
        &self,
        asked: Result<Option<u64>, ConnectorError>,
    ) -> Result<Option<u64>, ConnectorError> {
        if self.misused.load(Ordering::Relaxed) {
            return Err(ConnectorError::NotReady {
                reason: "the probe of the prefill's context length made a call other than the one sent (the proxy's fault)".into(),
            });
        }
        asked
    }
}

impl Transport for Sent {
    fn send(&self, req: http::Request<bytes::Bytes>) -> ResponseFuture {
        let sent = if *req.uri() == self.uri {
            self.exchange
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
        } else {
            None
        };
        if sent.is_none() {
            self.misused.store(true, Ordering::Relaxed);
        }
        debug_assert!(
            sent.is_some(),
            "a shared probe's transport carries the one exchange sent, to {}",
            self.uri
        );
        sent.unwrap_or_else(|| {
            Box::pin(async {
                Err(TransportError::Io(
                    "a shared probe's transport carries the one exchange sent".into(),
                ))
            })
        })
    }
}

/// What a request that needs a fresh length does.
enum Turn {
    /// Wait on the probe under way for its entry (sent by this request, or another).
    Wait(Answers),
    /// Ask for itself alone: its entry is not remembered, or too many probes are under
    /// way.
    Alone,
}

/// The prefill's `/tokenize`, as `resolve` asks it: through `transport`, on `ep`, naming
/// the client's `model`, large answers read within `blocking`.
#[derive(Clone, Copy)]
pub(super) struct Prefill<'a> {
    pub(super) transport: &'a dyn Transport,
    pub(super) ep: &'a Arc<Endpoint>,
    pub(super) model: Option<&'a [u8]>,
    pub(super) blocking: &'a BlockingLimit,
}

impl Prefill<'_> {
    /// The entry this prefill's answers are remembered under, when they are: `None`
    /// for an address that makes no `/tokenize` URI (the call fails on it too) or a
    /// `model` longer than [`MAX_MODEL_KEY`].
    fn key(&self) -> Option<Key> {
        let model = self.model.filter(|m| *m != b"null");
        if model.is_some_and(|m| m.len() > MAX_MODEL_KEY) {
            return None;
        }
        Some(Key {
            tokenize: self.ep.uri("/tokenize").ok()?,
            model: model.map(Box::from),
        })
    }
}

impl ContextLengths {
    /// Give a probe at most `timeout` (zero: [`CONTEXT_PROBE_TIMEOUT`]; at most
    /// [`MAX_CONTEXT_PROBE_TIMEOUT`]), and a request as long to wait for one.
    pub(super) fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = if timeout.is_zero() {
            CONTEXT_PROBE_TIMEOUT
        } else {
            timeout.min(MAX_CONTEXT_PROBE_TIMEOUT)
        };
    }

    /// The context length a request is held to, once its limit and `min_tokens` were
    /// checked, in that order, against the room it leaves after a prompt of `prompt`
    /// ids ([`check_limit`], [`check_min_tokens`]). `told`: the length the prompt's own
    /// `/tokenize` answered (`Some`, remembered), or `None` when the ids were known.
    /// Then a request that [`needs_context`] takes the length remembered for the
    /// prefill, else a fresh one ([`fresh`](Self::fresh): the probe under way for it,
    /// or one it starts, waited for); a check the remembered length fails is made
    /// again on a fresh answer. A request with a limit whose probe fails on the
    /// engine's side (no answer in time among those), or failed within 10 s, is
    /// checked without the length (the limit's room unchecked).
    ///
    /// # Errors
    ///
    /// The checks' refusals (400), and the failures of [`context_length`] but those
    /// of the engine's side for a request with a limit.
    pub(super) async fn checked(
        &self,
        plan: &Plan,
        prompt: usize,
        told: Option<Option<u64>>,
        prefill: Prefill<'_>,
    ) -> Result<Option<u64>, ConnectorError> {
        let check = |length: Option<u64>| -> Result<Option<u64>, ConnectorError> {
            check_limit(plan, prompt, length)?;
            check_min_tokens(plan, prompt, length).map(|()| length)
        };
        if let Some(length) = told {
            if let Some(key) = prefill.key() {
                self.memory.learn(key, Told::Length(length));
            }
            return check(length);
        }
        if !needs_context(plan) {
            return check(None);
        }
        let limited = plan.max_tokens.is_some();
        let key = prefill.key();
        match key.as_ref().and_then(|k| self.memory.remembered(k)) {
            Some(Told::Length(length)) => {
                if let Ok(length) = check(length) {
                    return Ok(length);
                }
            }
            Some(Told::Failed) if limited => return check(None),
            _ => {}
        }
        match self.fresh(key, prefill, limited).await {
            Ok(length) => check(length),
            Err(ConnectorError::Engine { .. }) if limited => check(None),
            Err(e) => Err(e),
        }
    }

    /// A fresh answer of the prefill's for the entry `key`, within
    /// [`timeout`](Self::timeout) from now: that of the probe under way for the entry,
    /// or of the one this request starts, which runs as a task of its own until this
    /// request's deadline (whoever still waits on it: a request dropped leaves it
    /// running) and which the requests that miss meanwhile wait on too; or else this
    /// request's own, asked alone ([`alone`](Self::alone)). A probe joined began no
    /// later than this request, so it ends within this request's time.
    ///
    /// # Errors
    ///
    /// Those of [`context_length`], made anew from the probe's for each request that
    /// waited on it (a refusal of the client's `model` is each one's 400; no answer
    /// within the probe's time is the engine's, [`ConnectorError::Engine`], for one
    /// request without a limit (`limited`: whether this one has one) and a
    /// [`ConnectorError::NotReady`] for the others, [`Answer::taken`]); a probe whose
    /// task ended without an answer is the proxy's ([`ConnectorError::NotReady`]).
    async fn fresh(
        &self,
        key: Option<Key>,
        prefill: Prefill<'_>,
        limited: bool,
    ) -> Result<Option<u64>, ConnectorError> {
        // No overflow: the timeout is at most a minute (`set_timeout`).
        let deadline = Instant::now() + self.timeout;
        let answers = match key
            .as_ref()
            .map_or(Turn::Alone, |k| self.join(k, prefill, deadline))
        {
            Turn::Wait(answers) => answers,
            Turn::Alone => return self.alone(key, prefill, deadline).await,
        };
        // The probe's task ends by its deadline (that of the request that started it,
        // no later than this one's), answering or closing the channel.
        match answer(answers).await {
            Some(answer) => answer.taken(prefill.ep, limited),
            None => Err(ConnectorError::NotReady {
                reason: "the probe of the prefill's context length ended without an answer (its task ended unfinished)".into(),
            }),
        }
    }

    /// What a request that needs a fresh length for `key` does: wait on the probe
    /// under way, or start one (its entry added, its task spawned, given until
    /// `deadline`: this request's) and wait on it, or ask alone when [`MAX_ENGINES`]
    /// probes are under way.
    fn join(&self, key: &Key, prefill: Prefill<'_>, deadline: Instant) -> Turn {
        let (answer, answers) = {
            let mut flights = self.memory.flights();
            if let Some(answers) = flights.get(key) {
                return Turn::Wait(answers.clone());
            }
            if flights.len() >= MAX_ENGINES {
                return Turn::Alone;
            }
            let (answer, answers) = watch::channel(None);
            flights.insert(key.clone(), answers.clone());
            (answer, answers)
        };
        // Dropped on the way (a transport that panics), it takes its entry along.
        let flight = Flight {
            memory: Arc::clone(&self.memory),
            key: key.clone(),
            answer,
        };
        let sent = Sent::new(prefill.transport, key);
        // In the starter's span: its warning carries that request's fields.
        let task = shared(
            flight,
            sent,
            Arc::clone(prefill.ep),
            prefill.blocking.clone(),
            (deadline, self.timeout),
        );
        tokio::spawn(task.instrument(tracing::Span::current()));
        Turn::Wait(answers)
    }

    /// The prefill's context length ([`context_length`]) asked by this request for
    /// itself, by `deadline`, remembered under `key` when there is one.
    async fn alone(
        &self,
        key: Option<Key>,
        prefill: Prefill<'_>,
        deadline: Instant,
    ) -> Result<Option<u64>, ConnectorError> {
        let Prefill {
            transport,
            ep,
            model,
            blocking,
        } = prefill;
        let asked = within(deadline, context_length(transport, ep, model, blocking))
            .await
            .unwrap_or_else(|| Err(unanswered(ep, self.timeout)));
        self.memory.settle(key, ep, &asked);
        asked
    }

    /// How many probes are under way.
    #[cfg(test)]
    pub(super) fn flights_under_way(&self) -> usize {
        self.memory.flights().len()
    }
}

/// The task of the probe `flight` shares: the prefill's context length
/// ([`context_length`], `sent` already) by `deadline` (`timeout` after it was sent),
/// remembered (a length, or a failure of the engine's side, no answer in that time
/// among them) and told to every request waiting, the client's refusals and the
/// proxy's losses too. It ends by `deadline`, whoever still waits, and its entry with
/// it.
async fn shared(
    flight: Flight,
    sent: Sent,
    ep: Arc<Endpoint>,
    blocking: BlockingLimit,
    (deadline, timeout): (Instant, Duration),
) {
    let model = flight.key.model.as_deref();
    let asked = within(deadline, context_length(&sent, &ep, model, &blocking))
        .await
        .unwrap_or_else(|| Err(unanswered(&ep, timeout)));
    let asked = sent.own(asked);
    flight.memory.settle(Some(flight.key.clone()), &ep, &asked);
    flight.finish(Answer::of(&asked));
}

/// The failure of a probe on `ep` given no answer within `timeout`: the engine's.
fn unanswered(ep: &Endpoint, timeout: Duration) -> ConnectorError {
    ConnectorError::Engine {
        endpoint: ep.id().clone(),
        what: "/tokenize",
        source: Box::new(Unanswered(timeout)),
    }
}

impl Memory {
    /// What a probe on `ep` learned (`asked`: a length, or a failure of the engine's
    /// side), remembered under `key` when there is one; the client's refusals and the
    /// proxy's losses teach nothing. A warning is logged when a failure is learned.
    fn settle(&self, key: Option<Key>, ep: &Endpoint, asked: &Result<Option<u64>, ConnectorError>) {
        let told = match asked {
            Ok(length) => Told::Length(*length),
            Err(ConnectorError::Engine { .. }) => Told::Failed,
            Err(_) => return,
        };
        let learned = key.is_some_and(|key| self.learn(key, told));
        if let Err(e) = asked {
            if learned {
                tracing::warn!(
                    endpoint = %ep.id(),
                    error = %error_chain(e),
                    "the prefill's /tokenize gave no context length: for 10 s its requests with a token limit go without the limit's room checked, those without one fail"
                );
            } else {
                tracing::debug!(
                    endpoint = %ep.id(),
                    error = %error_chain(e),
                    "the prefill's /tokenize gave no context length again"
                );
            }
        }
    }

    /// The entry of the probe of `key` answering on `answer` removed, if still there
    /// (not one of a later probe's).
    fn landed(&self, key: &Key, answer: &watch::Sender<Option<Answer>>) {
        let mut flights = self.flights();
        if flights
            .get(key)
            .is_some_and(|answers| answers.same_channel(&answer.subscribe()))
        {
            flights.remove(key);
        }
    }

    /// What the entry `key` was told less than [`TTL`] ago.
    fn remembered(&self, key: &Key) -> Option<Told> {
        let engines = self.read();
        let learned = engines.get(key)?;
        let age = self
            .now()
            .saturating_sub(learned.at.load(Ordering::Relaxed));
        (age < nanos(TTL)).then_some(learned.told)
    }

    /// `told`, as the engine and model of `key` just told it; at most [`MAX_ENGINES`]
    /// entries kept. True when the entry says something new: it had none, another
    /// answer, or one older than [`TTL`]. An answer the entry already holds moves its
    /// time on in place, under the read lock.
    fn learn(&self, key: Key, told: Told) -> bool {
        let now = self.now();
        if let Some(learned) = self.read().get(&key).filter(|l| l.told == told) {
            let at = learned.at.fetch_max(now, Ordering::Relaxed);
            return now.saturating_sub(at) >= nanos(TTL);
        }
        let mut engines = self.write();
        if engines.len() >= MAX_ENGINES && !engines.contains_key(&key) {
            let ttl = nanos(TTL);
            engines.retain(|_, l| now.saturating_sub(l.at.load(Ordering::Relaxed)) < ttl);
            if engines.len() >= MAX_ENGINES {
                let oldest = engines
                    .iter()
                    .min_by_key(|(_, l)| l.at.load(Ordering::Relaxed))
                    .map(|(key, _)| key.clone());
                if let Some(oldest) = oldest {
                    engines.remove(&oldest);
                }
            }
        }
        let learned = Learned {
            told,
            at: AtomicU64::new(now),
        };
        engines.insert(key, learned);
        true
    }

    /// The time now, in nanoseconds after [`epoch`](Self::epoch).
    fn now(&self) -> u64 {
        nanos(Instant::now().saturating_duration_since(self.epoch))
    }

    /// The map to read, whatever a panic elsewhere left it: each entry is written whole.
    fn read(&self) -> RwLockReadGuard<'_, HashMap<Key, Learned>> {
        self.engines.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The map to write, whatever a panic elsewhere left it.
    fn write(&self) -> RwLockWriteGuard<'_, HashMap<Key, Learned>> {
        self.engines.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// The probes under way, whatever a panic elsewhere left them: each entry is
    /// written whole.
    fn flights(&self) -> MutexGuard<'_, HashMap<Key, Answers>> {
        self.flights.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// `step`'s output, unless `deadline` passes first.
async fn within<T>(deadline: Instant, step: impl Future<Output = T>) -> Option<T> {
    tokio::time::timeout_at(deadline, step).await.ok()
}

/// The answer told on `answers`, once it is; `None` when the channel closed without one.
async fn answer(mut answers: Answers) -> Option<Answer> {
    let told = answers.wait_for(Option::is_some).await.ok()?;
    told.clone()
}

/// `d` in nanoseconds (`u64::MAX` past some 584 years).
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A transport whose exchanges never end.
    struct Silent;

    impl Transport for Silent {
        fn send(&self, _req: http::Request<bytes::Bytes>) -> ResponseFuture {
            Box::pin(std::future::pending())
        }
    }

    fn key() -> Key {
        Key {
            tokenize: Uri::from_static("http://p:7100/tokenize"),
            model: None,
        }
    }

    fn call(uri: &str) -> http::Request<bytes::Bytes> {
        let mut req = http::Request::new(bytes::Bytes::new());
        *req.uri_mut() = Uri::try_from(uri).unwrap_or_default();
        req
    }

    /// A failure of the engine's, as [`context_length`] makes it.
    fn engines() -> Result<Option<u64>, ConnectorError> {
        Err(unanswered(
            &Endpoint::new("http://p:7100", disagg_core::endpoint::Role::Prefill).unwrap(),
            CONTEXT_PROBE_TIMEOUT,
        ))
    }

    /// The one exchange sent, taken by its call: the probe's outcome is its own.
    #[test]
    fn the_exchange_sent_is_the_probes_outcome() {
        let sent = Sent::new(&Silent, &key());
        drop(sent.send(call("http://p:7100/tokenize")));
        assert!(matches!(
            sent.own(engines()),
            Err(ConnectorError::Engine { .. })
        ));
        assert!(matches!(sent.own(Ok(Some(8))), Ok(Some(8))));
    }

    /// A second call, or one to another URI, is the proxy's bug (a debug build
    /// panics): the probe's outcome is then the proxy's (`NotReady`, which blames no
    /// engine and is not remembered), not the engine's failure.
    #[test]
    fn a_call_other_than_the_one_sent_is_the_proxys() {
        for calls in [
            &["http://p:7100/tokenize", "http://p:7100/tokenize"][..],
            &["http://q:7100/tokenize"],
        ] {
            let sent = Sent::new(&Silent, &key());
            let (last, first) = calls.split_last().unwrap();
            for uri in first {
                drop(sent.send(call(uri)));
            }
            let other = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                drop(sent.send(call(last)));
            }));
            assert_eq!(other.is_err(), cfg!(debug_assertions), "{calls:?}");
            let err = sent.own(engines()).err();
            assert!(
                matches!(err, Some(ConnectorError::NotReady { .. })),
                "{calls:?}: {err:?}"
            );
        }
    }
}
