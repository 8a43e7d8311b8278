//! [`PdBody`]: the client's response body.
//!
//! The decode engine's body is forwarded as it arrives, never collected and never
//! re-encoded. One refinement: frames that have *already arrived* are joined into one
//! write. An HTTP/1 client hands a response body over one chunk at a time through a
//! channel from its connection task, so a burst of SSE events that came in one socket
//! read would otherwise leave the proxy as one `write` each (one system call per token).
//! After a frame, `PdBody` lets the upstream connection run again (a few yields, no
//! timer) and takes whatever it delivers; when the yields bring nothing new it hands over
//! what it has. It never waits for the network.
//!
//! A body made [`scrubbed`](PdBody::scrubbed) keeps the engine's own KV handoff from the
//! client ([`answer`](super::answer)): each frame it hands over is searched, once joined,
//! and only a handoff's value is overwritten (or held back until it ends).

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use sync_wrapper::SyncWrapper;

use std::future::Future;

use std::time::{Duration, Instant as StdInstant};

use tokio::time::Instant;

use super::stats::InFlight;
use crate::connector::ReturnedHandoff;
use crate::endpoint::{EndpointId, InFlightGuard};
use crate::error::{BoxError, PdError, Phase, Side};
use crate::outcome::now;
use crate::outcome::{Delivery, LegOutcome, Outcome, Report, Summary};
use crate::policy::Permit;
use crate::transport::BoxBody;

use disagg_json::ErrorEvents;

use super::answer::{Scrubber, scrubbed_kind};
use super::in_band::{EventShape, end_with};
use super::report::{Reporter, decode_end, prefill_end, unsent_or_abandoned};
use super::respond::LateMarks;
use crate::request::Api;

/// The prefill exchange of a concurrent handoff, still running when the decode's head
/// was relayed.
pub(crate) type PendingPrefill = Pin<Box<dyn Future<Output = Result<(), PdError>> + Send>>;

/// Most bytes joined into one frame; a larger burst goes out in several.
const MAX_JOINED: usize = 64 * 1024;

/// Yields in a row without a new frame before the joined bytes are handed over.
///
/// One is not enough on a multi-threaded runtime: the upstream connection task is woken
/// when a frame is taken, but may be queued behind this task or picked up by the other
/// worker; measured with `disagg-bench` (16-token streams arriving in one burst), one
/// yield joined nothing and three joined the whole burst, cutting the proxy's CPU per
/// stream by a third. When nothing more has arrived, three yields cost a few
/// microseconds of latency, never a wait for the network.
const JOIN_YIELDS: u8 = 3;

/// What a response body releases and reports when it ends: the decode endpoint's
/// in-flight count, the admission permit, the request's place in the in-flight gauge,
/// and the attempt's [`Report`], made here once, whatever the way the body ends.
pub(crate) struct Finish {
    pub(crate) guard: Option<InFlightGuard>,
    pub(crate) permit: Option<Permit>,
    pub(crate) in_flight: Option<InFlight>,
    /// The attempt's report, its decode leg's [`LegOutcome`] and its [`Outcome`] still to
    /// be decided by how the stream ends (`None` for a body with no attempt behind it).
    pub(crate) report: Option<(Arc<Reporter>, Report)>,
    /// Steps of the attempt that happen inside the body.
    pub(crate) late: Option<Arc<LateMarks>>,
    /// The request's summary, completed and told when the body ends (`None` when no
    /// one listens).
    pub(crate) summary: Option<Box<Summary>>,
    /// When the decode's first body chunk arrived.
    pub(crate) first_chunk: Option<StdInstant>,
    /// When the first byte went to the client.
    pub(crate) first_byte: Option<StdInstant>,
    /// Body bytes handed to the client.
    pub(crate) bytes: u64,
    /// Where a migrated stream moved to (`None`: migration off for this request).
    pub(crate) moved: Option<Arc<super::migrate::Moved>>,
    /// The watch for an error event the decode writes in its stream (an event stream
    /// relayed as it is: a migrating one reads its own events).
    pub(crate) errors: Option<ErrorEvents>,
    /// The watch for the sign of an answer in a stream relayed as it is (a completions
    /// stream's finish reason, a Responses stream's first output item: vLLM's failed KV
    /// load ends one without).
    pub(crate) answer: Option<super::sign::AnswerSign>,
    /// The decode was handed the prefill's KV: its stream ending in its own failure may
    /// be a lost KV load ([`Report::kv_load_suspect`]).
    pub(crate) kv: bool,
    /// A concurrent prefill still running was dropped at the decode's end
    /// ([`Finish::unjudged`]).
    pub(crate) dropped_prefill: bool,
}

impl Finish {
    /// A finish that only releases `permit` and the in-flight gauge.
    pub(crate) fn holding(permit: Option<Permit>, in_flight: Option<InFlight>) -> Self {
        Finish {
            guard: None,
            permit,
            in_flight,
            report: None,
            late: None,
            summary: None,
            first_chunk: None,
            first_byte: None,
            bytes: 0,
            moved: None,
            errors: None,
            answer: None,
            kv: false,
            dropped_prefill: false,
        }
    }

    /// A data frame, `data`, is going to the client.
    fn sent(&mut self, data: &[u8]) {
        if let Some(w) = self.errors.as_mut() {
            w.watch(data);
        }
        if let Some(w) = self.answer.as_mut() {
            w.watch(data);
        }
        if self.summary.is_none() {
            return;
        }
        if self.first_byte.is_none() {
            self.first_byte = Some(now());
        }
        self.bytes += data.len() as u64;
    }

    /// A chunk came from the decode (or from the proxy's own lead before it).
    fn chunk(&mut self) {
        if self.first_chunk.is_some() || self.report.is_none() {
            return;
        }
        // Under a lead of the proxy's own, the decode's chunks are those after its head.
        let decodes = self
            .late
            .as_ref()
            .is_none_or(|l| !l.lead || l.decode_head.get().is_some());
        if decodes {
            self.first_chunk = Some(now());
        }
    }

    /// Whether the answer relayed is the prefill's refusal (a 4xx passed through).
    pub(super) fn refusal(&self) -> bool {
        self.report
            .as_ref()
            .is_some_and(|(_, r)| r.outcome == Outcome::PrefillRefused)
    }

    /// The attempt ended as `outcome`; the legs' outcomes follow from it unless the
    /// report already holds one (a decode that answered 5xx failed when its head came).
    pub(super) fn done(&mut self, outcome: Outcome, failed: Option<&PdError>) {
        self.guard = None;
        self.permit = None;
        self.in_flight = None;
        let Some((reporter, mut report)) = self.report.take() else {
            return;
        };
        let end = now();
        report.timeline.end = Some(end);
        if let Some(late) = &self.late {
            late.apply(&mut report.timeline);
        }
        if report.timeline.decode_first_chunk.is_none() {
            report.timeline.decode_first_chunk = self.first_chunk;
        }
        // A migrated answer ends on the decode that finished it, timed by its leg (the
        // dead one was reported failed, with its leg's times, when the stream moved
        // on); the request's summary keeps the attempt's own steps, as it keeps its
        // route.
        let applied = match &self.moved {
            Some(m) => m.apply(&mut report),
            None => super::migrate::Applied::default(),
        };
        let migrated = match (&self.moved, &self.summary) {
            (Some(m), Some(_)) => m.take_log(),
            _ => Vec::new(),
        };
        if report.prefill == LegOutcome::Abandoned
            && self.late.as_ref().is_some_and(|l| l.answered())
        {
            // A concurrent prefill still running at the decode's head that then answered
            // well: its engine worked, whatever became of the decode afterwards (its
            // stream broke, ran out of time, or the client left). One dropped before it
            // answered (with a decode's error status, a decode that broke first) stays
            // abandoned.
            report.prefill = LegOutcome::Answered;
        }
        // The error event the decode wrote in a stream that ended as its engine ended it
        // (a success as far as the relay goes): the watch's, or the migrating body's
        // (which reads its own events), whose refusal it relayed and did not continue.
        let in_band = match (outcome, report.outcome, report.decode) {
            (Outcome::Success, Outcome::Success, LegOutcome::Answered) => self
                .errors
                .as_mut()
                .and_then(ErrorEvents::finish)
                .or(applied.refused),
            _ => None,
        };
        // A completions stream that ended as its engine ended it, with no error event
        // and no choice's finish reason: it did not answer (vLLM 0.33's completions
        // stream whose KV load failed ends so, with `[DONE]`).
        let unfinished = in_band.is_none()
            && (outcome, report.outcome, report.decode)
                == (Outcome::Success, Outcome::Success, LegOutcome::Answered)
            && self.answer.as_ref().is_some_and(|w| w.unfinished());
        match outcome {
            // The attempt stays as the head told it: a success (the decode leg answered,
            // or not sent: the prefill's answer was the whole answer), the decode's
            // failure (a 5xx), or a refusal passed through whole, the prefill's (no
            // decode answered: its leg not sent, or dropped when both were sent at once)
            // or the decode's own (a 4xx), whatever a router learns from a success.
            //
            // Unless the decode answered 200 and then an error in its stream: the
            // engine's failure when the event names a 5xx (vLLM's failed KV load, an
            // exception in its stream generator), else its refusal (a 4xx, or no status
            // said: its leg answered, as for a 4xx head). Which engine lost the KV is
            // not said: the decode is blamed, as a migrating stream blames it.
            // A completions stream that did not answer is the decode's failure, as
            // the same request not streamed is (vLLM answers it 500).
            Outcome::Success if unfinished => {
                report.decode = LegOutcome::Failed;
                report.outcome = Outcome::DecodeFailed;
                report.kv_load_suspect = self.lost_kv(&report, true);
            }
            Outcome::Success => {
                if let Some(event) = in_band {
                    report.decode = if event.is_server_error() {
                        LegOutcome::Failed
                    } else {
                        LegOutcome::Answered
                    };
                    report.outcome = decode_end(report.decode);
                    // Not a migrating stream's refusal (`applied.refused`): a 5xx here
                    // is the watch's.
                    report.kv_load_suspect = self.lost_kv(&report, event.is_server_error());
                }
            }
            Outcome::PrefillFailed | Outcome::PrefillRefused => {
                let prefill = report.route.prefill.as_deref().map(|p| p.id());
                // A prefill that had answered (a lead stream's gate failed after it)
                // is abandoned when the failure is not its engine's: its KV computed
                // and left behind, no success of its engine's. One that refused its
                // leg after the decode's head (both legs at once) answered: the
                // attempt is its refusal.
                report.prefill =
                    failed.map_or(LegOutcome::Failed, |e| super::leg_outcome(e, prefill));
                report.outcome =
                    failed.map_or(Outcome::PrefillFailed, |e| prefill_end(e, report.prefill));
                report.decode = unsent_or_abandoned(&report.timeline);
            }
            Outcome::DecodeFailed if report.outcome == Outcome::PrefillRefused => {
                // The prefill's refusal, passed through, broke on its way to the client
                // (its body held a handoff the scrubber could not keep from it): the
                // attempt stays the refusal, and no decode is to blame (none was sent,
                // or the one sent at once was dropped before its head).
                report.decode = unsent_or_abandoned(&report.timeline);
            }
            Outcome::DecodeFailed | Outcome::DecodeRefused => {
                // A decode that refused its leg (a 4xx) after a lead of the proxy's own
                // ended the stream with its refusal: its leg answered.
                let decode = Some(report.route.decode.id());
                report.decode =
                    failed.map_or(LegOutcome::Failed, |e| super::leg_outcome(e, decode));
                report.outcome = decode_end(report.decode);
                // A decode sent after a lead of the proxy's own that answered a 5xx, as
                // a 5xx head relayed is; or a stream broken off before its answer began.
                let answered_5xx = failed.is_some_and(|e| {
                    e.side() == Side::Decode
                        && e.engine_status().is_some_and(|s| s.is_server_error())
                });
                let cut =
                    failed.is_none() && self.answer.as_ref().is_some_and(|w| w.cut_unanswered());
                report.kv_load_suspect = self.lost_kv(&report, answered_5xx || cut);
            }
            Outcome::Cancelled => {
                report.outcome = Outcome::Cancelled;
                // A concurrent prefill still running stays abandoned with it; a decode
                // leg a lead stream had not sent yet stays unsent, and the prefill that
                // answered before it is abandoned (its KV computed and left behind, as
                // when the request's deadline cuts the handoff).
                if report.decode != LegOutcome::NotSent {
                    report.decode = unsent_or_abandoned(&report.timeline);
                    if report.decode == LegOutcome::NotSent
                        && report.prefill == LegOutcome::Answered
                    {
                        report.prefill = LegOutcome::Abandoned;
                    }
                }
            }
        }
        if applied.broke {
            // The leg this report names broke and no continuation took the stream on
            // (none started, or the client left while one was awaited): this report is
            // the one that tells its decode failed (an attempt that was a refusal is
            // then the decode's failure: a refusal blames no engine).
            report.decode = LegOutcome::Failed;
            if report.outcome != Outcome::PrefillFailed {
                report.outcome = Outcome::DecodeFailed;
            }
            // Its first leg ended in a 5xx error event, not continued: as a lost KV
            // load ends a chat stream.
            report.kv_load_suspect = self.lost_kv(&report, applied.lost_kv);
        }
        if applied.exempt && !applied.broke && report.decode == LegOutcome::Failed {
            // The stream of the decode this report names ended for the fresh prefill
            // riding in it (which failed, its leg told by its own report: failed only
            // when its engine is to blame, not for a 4xx nor the request's deadline):
            // the decode is not to blame, its leg cut off.
            report.decode = LegOutcome::Abandoned;
        }
        if applied.prefill_broke
            && matches!(report.outcome, Outcome::Success | Outcome::DecodeRefused)
        {
            // Its stream ended for the fresh prefill riding in it (which failed, told
            // by its own report, whoever is to blame) and was not continued: the
            // attempt failed, its decode's leg cut off (a refusal the stream then ended
            // with is a later continuation's decode's, told by that one's report).
            report.outcome = Outcome::DecodeFailed;
            report.decode = LegOutcome::Abandoned;
        }
        // A stream whose decode broke (it ended early, or in an error event) and that
        // was not continued ended as its engine left it: the request's stream broke.
        let broke = applied.broke || applied.prefill_broke;
        let outcome = if broke && outcome == Outcome::Success {
            Outcome::DecodeFailed
        } else if in_band.is_some() || unfinished {
            report.outcome
        } else {
            outcome
        };
        self.unjudged(&mut report);
        reporter.report(&mut report);
        if let Some(mut summary) = self.summary.take() {
            summary.end = end;
            summary.first_byte = self.first_byte;
            summary.bytes = self.bytes;
            match applied.own {
                // The attempt's own steps (its phases follow from them when the
                // summary is told).
                Some(own) => summary.timeline = Some(own),
                // `report` told its phases from this timeline (a summary is made only
                // when someone listens, and then the report's phases are filled).
                None => {
                    summary.phases = Some(report.phases);
                    summary.timeline = Some(report.timeline);
                }
            }
            summary.migrations = applied.migrations;
            summary.migrated = migrated;
            summary.delivery = match outcome {
                Outcome::Success => Delivery::Complete,
                Outcome::Cancelled => Delivery::Cancelled,
                Outcome::PrefillFailed
                | Outcome::PrefillRefused
                | Outcome::DecodeFailed
                | Outcome::DecodeRefused => Delivery::Broken,
            };
            if summary.delivery == Delivery::Broken {
                summary.error = Some(match failed {
                    Some(e) => e.code(),
                    // The prefill's refusal, passed through, broke on its way: its
                    // answer could not be relayed (no decode stream failed).
                    None if report.outcome == Outcome::PrefillRefused => "prefill_failed",
                    // The decode's own error event, relayed as it came.
                    None if in_band.is_some() => "decode_error_event",
                    // The decode's stream ended with no answer, as it came.
                    None if unfinished => "decode_unfinished",
                    None => "decode_stream_failed",
                });
            }
            reporter.summarize(&mut summary);
        }
    }
}

impl Drop for Finish {
    fn drop(&mut self) {
        // Dropped before the end of the stream: the client went away.
        self.done(Outcome::Cancelled, None);
    }
}

/// What comes after the joined bytes have been handed over: the stream's last frame, a
/// private detail of the body (how the attempt ended is the [`Outcome`] that
/// [`Finish`] reports).
pub(super) enum Tail {
    Eos,
    Trailers(HeaderMap),
    Error(BoxError),
    /// The prefill leg of a concurrent handoff failed after the decode's head went out,
    /// or a time limit of the stream passed: the decode leg was dropped.
    Abort(PdError),
}

/// The time limits of a decode stream: the longest silence between two chunks once the
/// decode's body flows, and the request's deadline.
///
/// One timer for both, moved only when it fires: a chunk just notes the time it came
/// (no timer reset per chunk), and a timer that fires early is set again to the true
/// limit.
pub(crate) struct StreamTimer {
    sleep: Pin<Box<tokio::time::Sleep>>,
    idle: Option<Duration>,
    deadline: Option<Instant>,
    /// When the last chunk came (or the timer started); `None` while the stream waits
    /// for its decode's body after a lead of the proxy's own: no limit runs then. The
    /// wait for the KV gate, for the decode's head and, when that is an error, for its
    /// message, is the proxy's, each step within a budget of its own and the deadline,
    /// not a silence of the decode's stream.
    last: Option<Instant>,
    /// Held (`last` unset) until the concurrent prefill riding in the stream answered,
    /// or a chunk came, whichever is first.
    prefill: bool,
    /// A mid-stream migration's continuation was being started at the last look.
    continuing: bool,
    endpoint: EndpointId,
}

impl StreamTimer {
    /// A timer for a stream from `endpoint`, or `None` when it has no limit; `held`
    /// until the decode's body flows when the stream began before it (a lead).
    pub(crate) fn new(
        idle: Option<Duration>,
        deadline: Option<Instant>,
        endpoint: &EndpointId,
        held: bool,
    ) -> Option<Self> {
        if idle.is_none() && deadline.is_none() {
            return None;
        }
        let now = Instant::now();
        let mut t = StreamTimer {
            sleep: Box::pin(tokio::time::sleep_until(now)),
            idle,
            deadline,
            last: (!held).then_some(now),
            prefill: false,
            continuing: false,
            endpoint: endpoint.clone(),
        };
        let at = t.limit();
        t.sleep.as_mut().reset(at);
        Some(t)
    }

    /// The same timer, its idle time held until the concurrent prefill of the stream
    /// answered or a chunk came (the deadline runs all along).
    pub(crate) fn until_prefill(mut self) -> Self {
        if self.last.take().is_some() {
            self.prefill = true;
            let at = self.limit();
            self.sleep.as_mut().reset(at);
        }
        self
    }

    /// Start the idle time now, when it was held for the concurrent prefill.
    fn start(&mut self) {
        if std::mem::take(&mut self.prefill) {
            self.last = Some(Instant::now());
            let at = self.limit();
            self.sleep.as_mut().reset(at);
        }
    }

    /// When the stream must have said something (or ended) by.
    fn limit(&self) -> Instant {
        let idle = self
            .idle
            .zip(self.last)
            .and_then(|(i, last)| last.checked_add(i));
        match (idle, self.deadline) {
            (Some(i), Some(d)) => i.min(d),
            (Some(i), None) => i,
            (None, Some(d)) => d,
            // Held, or (never) built without a limit: far away.
            (None, None) => Instant::now() + Duration::from_secs(86_400 * 365),
        }
    }

    /// Whether a continuation is being started (`on`): its start is the proxy's
    /// silence, and the idle time counts from its end (the first look after it).
    fn continuing(&mut self, on: bool) {
        if on || self.continuing {
            self.chunk();
        }
        self.continuing = on;
    }

    /// A chunk arrived.
    fn chunk(&mut self) {
        self.start();
        if let (Some(_), Some(last)) = (self.idle, self.last.as_mut()) {
            *last = Instant::now();
        }
    }

    /// The error, once a limit has passed; registers the wake-up otherwise. A held
    /// timer starts once `flowing` (asked only while it is held) says the decode's body
    /// flows (its head a 2xx), its silence counted from then (this poll, after the head
    /// and any chunk that followed it); until then no limit runs.
    fn poll_expired(
        &mut self,
        cx: &mut Context<'_>,
        flowing: impl FnOnce() -> bool,
    ) -> Option<PdError> {
        if self.last.is_none() && !self.prefill {
            if !flowing() {
                return None;
            }
            self.last = Some(Instant::now());
            let limit = self.limit();
            self.sleep.as_mut().reset(limit);
        }
        loop {
            if self.sleep.as_mut().poll(cx).is_pending() {
                return None;
            }
            let now = Instant::now();
            if self.deadline.is_some_and(|d| now >= d) {
                return Some(PdError::deadline(Side::Decode, Phase::DecodeIdle));
            }
            let at = self.limit();
            if now >= at {
                return Some(PdError::timeout(
                    Side::Decode,
                    self.endpoint.clone(),
                    Phase::DecodeIdle,
                ));
            }
            self.sleep.as_mut().reset(at);
        }
    }
}

pin_project_lite::pin_project! {
    /// The client's response body: the decode engine's body, forwarded as it arrives.
    ///
    /// Nothing is collected or re-encoded; frames that have already arrived are joined
    /// into one (see the [module docs](self)). The body holds the decode endpoint's
    /// in-flight count until it ends or is dropped. When the decode stream breaks after
    /// its head went out and the response is an event stream, one last event
    /// `data: {"error": {...}}` tells the client (the `openai` clients raise it as an
    /// `APIError`), and the stream ends; other bodies end with the error, which the
    /// server turns into an aborted response.
    ///
    /// For a concurrent handoff the body also carries the prefill exchange when it was
    /// still running as the decode's head went out: it is polled alongside the stream,
    /// a failure ends the stream the same way (and drops the decode leg at once), and
    /// the stream's end waits for it, so no leg outlives the body.
    pub struct PdBody {
        #[pin]
        inner: BoxBody,
        sse: bool,
        // The shape of the error event that ends a broken stream.
        shape: EventShape,
        done: bool,
        joined: BytesMut,
        // Yields in a row that brought no new frame.
        idle_yields: u8,
        end: Option<Tail>,
        // Boxed: a `Response<PdBody>` is moved a dozen times on its way to the client, and
        // the attempt's state is most of its size (docs/performance.md, "Futures and
        // bodies copied whole").
        finish: Option<Box<Finish>>,
        prefill: Option<SyncWrapper<PendingPrefill>>,
        timer: Option<SyncWrapper<StreamTimer>>,
        // The engine's handoff kept from the client, when scrubbed.
        scrub: Option<Scrubber>,
    }
}

impl fmt::Debug for PdBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PdBody")
            .field("sse", &self.sse)
            .field("done", &self.done)
            .field("joined", &self.joined.len())
            .finish_non_exhaustive()
    }
}

/// A body holding `bytes`, whole.
impl From<Bytes> for PdBody {
    fn from(bytes: Bytes) -> Self {
        PdBody::forward(
            Full::new(bytes).map_err(|never| match never {}).boxed(),
            false,
        )
    }
}

impl PdBody {
    /// An empty body (also `PdBody::default()`).
    pub(crate) fn empty() -> Self {
        Self::from(Bytes::new())
    }

    /// A body forwarding `inner`; `sse` turns on the in-band error event when `inner`
    /// breaks. (The orchestrator's own bodies also carry the decode endpoint's in-flight
    /// guard.)
    pub fn forward(inner: BoxBody, sse: bool) -> Self {
        PdBody {
            inner,
            sse,
            shape: EventShape::OpenAi,
            done: false,
            joined: BytesMut::new(),
            idle_yields: 0,
            end: None,
            finish: None,
            prefill: None,
            timer: None,
            scrub: None,
        }
    }

    /// The same body, keeping the engine's own KV handoff from the client when
    /// `headers` (the engine answer's) say it is an event stream or JSON: the value of
    /// each handoff key (`kv_transfer_params`, `ec_transfer_params`, `bootstrap_host`,
    /// `bootstrap_port`, `bootstrap_room`) is overwritten in place (`null` and spaces:
    /// the answer keeps its length), unbuffered but for a handoff not whole yet: held
    /// until its value ends (one over 16 KiB is looked at again once its held bytes
    /// doubled, or at the answer's end, so what follows it may wait that long). A
    /// handoff that cannot be overwritten (longer than 1 MiB, or no JSON) ends the body
    /// as a broken stream does.
    #[must_use]
    pub fn scrubbed(self, headers: &HeaderMap) -> Self {
        let on = scrubbed_kind(headers);
        self.scrubbing(on)
    }

    /// The same body, answering a client of `api`: a broken event stream ends with the
    /// error event in the shape `api`'s clients read (Anthropic's `event: error` on
    /// `/v1/messages`, Cohere's `message-end` with its `delta.error` on
    /// `/cohere/v2/chat`, OpenAI's otherwise, and by default); on SGLang's `/generate`,
    /// an event whose finish reason is an abort is read as an error event.
    #[must_use]
    pub fn answering(mut self, api: Api) -> Self {
        self.shape = EventShape::of(api);
        // SGLang's `/generate` tells a request its engine aborted in its finish reason.
        if let (Api::Generate, Some(f)) = (api, self.finish.as_mut())
            && f.errors.is_some()
        {
            f.errors = Some(ErrorEvents::new().with_aborts());
        }
        self
    }

    /// The same body, giving the answer's own `kv_transfer_params` to `to` as it is
    /// blanked, when the body is scrubbed (see [`Scrubber::capture`]).
    pub(crate) fn capturing(mut self, to: Option<Arc<dyn ReturnedHandoff>>) -> Self {
        if let (Some(scrub), Some(to)) = (self.scrub.as_mut(), to) {
            scrub.capture(to);
        }
        self
    }

    /// The same body, scrubbed when `on` (the caller read the content type).
    pub(crate) fn scrubbing(mut self, on: bool) -> Self {
        if on {
            self.scrub = Some(Scrubber::default());
        }
        self
    }

    pub(crate) fn stream(
        inner: BoxBody,
        sse: bool,
        finish: Finish,
        prefill: Option<PendingPrefill>,
        timer: Option<StreamTimer>,
    ) -> Self {
        let mut body = Self::forward(inner, sse);
        let mut finish = finish;
        // An event stream relayed as it is: its error event, if the decode writes one,
        // is the attempt's end (a migrating stream reads its events itself).
        if sse
            && finish.moved.is_none()
            && finish
                .report
                .as_ref()
                .is_some_and(|(_, r)| r.outcome == Outcome::Success)
        {
            finish.errors = Some(ErrorEvents::new());
        }
        body.finish = Some(Box::new(finish));
        body.prefill = prefill.map(SyncWrapper::new);
        body.timer = timer.map(SyncWrapper::new);
        body
    }

    /// Keep the request's admission permit and its place in the in-flight gauge until
    /// the body ends.
    pub(crate) fn hold(&mut self, permit: Option<Permit>, in_flight: Option<InFlight>) {
        match &mut self.finish {
            Some(f) => {
                f.permit = permit;
                f.in_flight = in_flight;
            }
            None => self.finish = Some(Box::new(Finish::holding(permit, in_flight))),
        }
    }
}

impl Default for PdBody {
    fn default() -> Self {
        Self::empty()
    }
}

pub(super) type PollFrame = Poll<Option<Result<Frame<Bytes>, BoxError>>>;

impl Body for PdBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> PollFrame {
        let mut polled = self.as_mut().poll_body(cx);
        if polled.is_ready() && self.scrub.is_some() {
            polled = self.as_mut().scrub(polled).unwrap_or_else(|| {
                // Every byte of the frame held back: come back for the next (a yield,
                // as joining does, so that the body is polled at one place).
                cx.waker().wake_by_ref();
                Poll::Pending
            });
        }
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            // hyper asks `is_end_stream` after each frame and, when it says so (a body
            // of known length now whole), drops the body without polling for its end:
            // the response is complete now, not cancelled at the drop.
            let end = self.is_end_stream();
            let this = self.project();
            if let Some(f) = this.finish.as_mut() {
                f.sent(data);
            }
            if end {
                *this.done = true;
                if let Some(mut f) = this.finish.take() {
                    f.done(Outcome::Success, None);
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.drained() && self.scrub.as_ref().is_none_or(|s| s.held() == 0)
    }

    fn size_hint(&self) -> SizeHint {
        let inner = self.inner.size_hint();
        let held = self.scrub.as_ref().map_or(0, Scrubber::held);
        let joined = (self.joined.len() + held) as u64;
        let mut h = SizeHint::new();
        h.set_lower(inner.lower() + joined);
        // An in-band error event may be added to an event stream: no upper bound there.
        if let (false, Some(upper)) = (self.sse, inner.upper()) {
            h.set_upper(upper + joined);
        }
        h
    }
}

impl PdBody {
    /// Whether nothing more comes from the inner body or the joined bytes (what the
    /// scrubber holds aside).
    fn drained(&self) -> bool {
        self.done
            || (self.joined.is_empty()
                && self.prefill.is_none()
                && matches!(self.end, None | Some(Tail::Eos))
                && self.inner.is_end_stream())
    }

    /// `polled` (from [`poll_body`](Self::poll_body)) with the engine's handoff
    /// overwritten; `None` when every byte of its frame is held back for the next one.
    fn scrub(mut self: Pin<&mut Self>, polled: PollFrame) -> Option<PollFrame> {
        let out = match polled {
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => {
                    // A frame the body ends with (hyper then polls no more) takes what
                    // is held.
                    let ending = self.drained();
                    let Some(scrub) = self.as_mut().project().scrub.as_mut() else {
                        return Some(Poll::Ready(Some(Ok(Frame::data(data)))));
                    };
                    scrub.push(data).and_then(|out| {
                        if !ending {
                            return Ok(out);
                        }
                        let rest = scrub.finish()?;
                        Ok(match (out.is_empty(), rest.is_empty()) {
                            (_, true) => out,
                            (true, false) => rest,
                            (false, false) => {
                                let mut joined = BytesMut::with_capacity(out.len() + rest.len());
                                joined.extend_from_slice(&out);
                                joined.extend_from_slice(&rest);
                                joined.freeze()
                            }
                        })
                    })
                }
                Err(frame) => return Some(Poll::Ready(Some(Ok(frame)))),
            },
            // The end: what is held goes first.
            Poll::Ready(None) => match self.as_mut().project().scrub.as_mut().map(Scrubber::finish)
            {
                Some(Ok(rest)) if !rest.is_empty() => Ok(rest),
                Some(Err(e)) => Err(e),
                _ => return Some(Poll::Ready(None)),
            },
            other => return Some(other),
        };
        match out {
            Ok(out) if out.is_empty() => None,
            Ok(out) => Some(Poll::Ready(Some(Ok(Frame::data(out))))),
            Err(e) => {
                // Nothing more of this answer may go out: drop the decode, end as a
                // broken stream.
                let mut this = self.project();
                *this.scrub = None;
                this.inner.set(empty_body());
                this.joined.clear();
                Some(end_with(
                    Tail::Error(Box::new(e)),
                    (*this.sse).then_some(*this.shape),
                    this.done,
                    this.finish,
                ))
            }
        }
    }

    /// The next frame for the client (the body's whole logic; `poll_frame` only counts
    /// what goes out).
    fn poll_body(self: Pin<&mut Self>, cx: &mut Context<'_>) -> PollFrame {
        let mut this = self.project();
        if *this.done {
            return Poll::Ready(None);
        }
        if let Some(prefill) = this.prefill.as_mut()
            && let Poll::Ready(result) = prefill.get_mut().as_mut().poll(cx)
        {
            *this.prefill = None;
            if let Some(t) = this.timer.as_mut() {
                t.get_mut().start();
            }
            if let Err(e) = result {
                // Drop the decode leg now: without the KV it has nothing to say.
                this.inner.set(empty_body());
                *this.end = Some(Tail::Abort(e));
                if !this.joined.is_empty() {
                    return Poll::Ready(Some(Ok(Frame::data(this.joined.split().freeze()))));
                }
            }
        }
        loop {
            if let Some(end) = this.end.take() {
                // The decode is done; the stream ends when the prefill leg has too
                // (it was polled above, so its progress wakes this body), unless its KV
                // has no taker: then it is dropped.
                if matches!(end, Tail::Eos) && this.prefill.is_some() {
                    match this.finish.as_mut().filter(|f| f.kv_untaken()) {
                        Some(f) => f.dropped_prefill = true,
                        None => {
                            *this.end = Some(end);
                            return Poll::Pending;
                        }
                    }
                    *this.prefill = None;
                }
                return end_with(
                    end,
                    (*this.sse).then_some(*this.shape),
                    this.done,
                    this.finish,
                );
            }
            if this.joined.len() >= MAX_JOINED {
                return Poll::Ready(Some(Ok(Frame::data(this.joined.split().freeze()))));
            }
            let next = match this.inner.as_mut().poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        *this.idle_yields = 0;
                        if let Some(t) = this.timer.as_mut() {
                            t.get_mut().chunk();
                        }
                        if let Some(f) = this.finish.as_mut() {
                            f.chunk();
                        }
                        if this.joined.is_empty() && this.inner.is_end_stream() {
                            // The last frame and nothing before it: no copy.
                            *this.end = Some(Tail::Eos);
                            return Poll::Ready(Some(Ok(Frame::data(data))));
                        }
                        this.joined.extend_from_slice(&data);
                        continue;
                    }
                    Err(trailers) => match trailers.into_trailers() {
                        Ok(t) => Tail::Trailers(t),
                        Err(_) => continue,
                    },
                },
                Poll::Ready(None) => Tail::Eos,
                // The orchestrator's own errors (a lead stream's handoff) keep their code.
                Poll::Ready(Some(Err(e))) => match e.downcast::<PdError>() {
                    Ok(e) => Tail::Abort(*e),
                    Err(e) => Tail::Error(e),
                },
                Poll::Pending => {
                    if this.joined.is_empty() {
                        let finish = &*this.finish;
                        // A continuation being started (mid-stream migration) is the
                        // proxy's silence, within the continuation's own window: the
                        // idle time counts from its end.
                        let continuing = finish
                            .as_ref()
                            .and_then(|f| f.moved.as_ref())
                            .is_some_and(|m| m.continuing());
                        if let Some(t) = this.timer.as_mut() {
                            t.get_mut().continuing(continuing);
                        }
                        let flowing = || {
                            let late = finish.as_ref().and_then(|f| f.late.as_ref());
                            late.is_some_and(|l| l.flowing())
                        };
                        let expired = this
                            .timer
                            .as_mut()
                            .and_then(|t| t.get_mut().poll_expired(cx, flowing));
                        let Some(e) = expired else {
                            return Poll::Pending;
                        };
                        // Out of time: drop the decode leg and end with the error.
                        *this.timer = None;
                        this.inner.set(empty_body());
                        Tail::Abort(e)
                    } else {
                        if *this.idle_yields < JOIN_YIELDS {
                            // Let the upstream connection task deliver what it has
                            // already read, then come back: a yield, not a wait for the
                            // network.
                            *this.idle_yields += 1;
                            cx.waker().wake_by_ref();
                            return Poll::Pending;
                        }
                        *this.idle_yields = 0;
                        return Poll::Ready(Some(Ok(Frame::data(this.joined.split().freeze()))));
                    }
                }
            };
            *this.end = Some(next);
            if this.joined.is_empty() {
                // Nothing joined to hand over first: end now (top of the loop).
                continue;
            }
            return Poll::Ready(Some(Ok(Frame::data(this.joined.split().freeze()))));
        }
    }
}

pub(crate) fn empty_body() -> BoxBody {
    http_body_util::Empty::new()
        .map_err(|never| match never {})
        .boxed()
}

/// One SSE event carrying an OpenAI-format error ([`EventShape::error_event`]).
pub(super) fn sse_error_event(message: &str, error_type: &str, code: &str) -> Bytes {
    EventShape::OpenAi.error_event(message, error_type, code)
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A body that yields scripted steps: a frame, an error, or `Pending` (waking
    /// itself, as a channel whose sender runs at once would).
    struct Script {
        steps: VecDeque<Step>,
        polls: Arc<AtomicUsize>,
    }

    enum Step {
        Data(&'static str),
        Pending,
        Fail,
    }

    impl Body for Script {
        type Data = Bytes;
        type Error = BoxError;
        fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> PollFrame {
            self.polls.fetch_add(1, Ordering::Relaxed);
            match self.steps.pop_front() {
                None => Poll::Ready(None),
                Some(Step::Data(s)) => Poll::Ready(Some(Ok(Frame::data(Bytes::from(s))))),
                Some(Step::Fail) => Poll::Ready(Some(Err("boom".into()))),
                Some(Step::Pending) => {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
            }
        }
    }

    #[test]
    fn a_response_body_stays_small_enough_to_move() {
        // A `Response<PdBody>` is moved about a dozen times between `respond` and
        // hyper's dispatcher, each move a copy of the whole value: the attempt's state
        // lives behind one box (`Finish`, several hundred bytes) so that these copies stay
        // short (docs/performance.md, "Futures and bodies copied whole"). A field
        // added inline that makes the body much larger fails here (with `Finish`
        // inline, before its error-event watch, it was 760 bytes).
        assert!(
            std::mem::size_of::<PdBody>() <= 320,
            "PdBody is {} bytes",
            std::mem::size_of::<PdBody>()
        );
    }

    fn body(steps: Vec<Step>, sse: bool) -> PdBody {
        let script = Script {
            steps: steps.into(),
            polls: Arc::default(),
        };
        PdBody::forward(script.boxed(), sse)
    }

    /// Poll to the end, recording each frame handed out.
    async fn frames(mut b: PdBody) -> Vec<Result<String, String>> {
        let mut out = Vec::new();
        while let Some(f) = b.frame().await {
            out.push(
                f.map(|f| String::from_utf8(f.into_data().unwrap().to_vec()).unwrap())
                    .map_err(|e| e.to_string()),
            );
        }
        out
    }

    #[tokio::test]
    async fn joins_frames_that_already_arrived() {
        use Step::*;
        // a and b arrive back to back, c after one yield, d after three (the upstream
        // connection had already read them); then three empty yields mean nothing more
        // has arrived, and a+b+c+d go out as one frame.
        let steps = vec![
            Data("a"),
            Data("b"),
            Pending,
            Data("c"),
            Pending,
            Pending,
            Pending,
            Data("d"),
            Pending,
            Pending,
            Pending,
            Pending,
            Data("e"),
        ];
        let got = frames(body(steps, true)).await;
        assert_eq!(got, vec![Ok("abcd".into()), Ok("e".into())]);
    }

    #[tokio::test]
    async fn a_lone_frame_waits_a_bounded_number_of_yields() {
        use Step::*;
        let polls = Arc::new(AtomicUsize::new(0));
        let script = Script {
            steps: vec![Data("a"), Pending, Pending, Pending, Pending, Data("b")].into(),
            polls: Arc::clone(&polls),
        };
        let mut b = PdBody::forward(script.boxed(), true);
        let first = b.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(&first[..], b"a");
        // One poll for the frame, then one per yield: JOIN_YIELDS + 1 empty polls.
        assert_eq!(polls.load(Ordering::Relaxed), 2 + usize::from(JOIN_YIELDS));
        assert_eq!(frames(b).await, vec![Ok("b".into())]);
    }

    #[tokio::test]
    async fn error_after_joined_bytes_sends_the_bytes_then_the_event() {
        use Step::*;
        let got = frames(body(vec![Data("a"), Data("b"), Fail], true)).await;
        assert_eq!(got.len(), 2);
        assert_eq!(got[0], Ok("ab".into()));
        let ev = got[1].as_ref().unwrap();
        let json = ev.trim().strip_prefix("data: ").unwrap();
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        assert_eq!(v["error"]["code"], "decode_stream_failed");
        assert!(v["error"]["message"].as_str().unwrap().contains("boom"));
    }

    #[tokio::test]
    async fn non_sse_errors_end_the_body_with_the_error() {
        use Step::*;
        let got = frames(body(vec![Data("a"), Fail], false)).await;
        assert_eq!(got, vec![Ok("a".into()), Err("boom".into())]);
    }

    #[tokio::test]
    async fn full_bodies_are_exact() {
        let b = PdBody::from(Bytes::from_static(b"hello"));
        assert_eq!(b.size_hint().exact(), Some(5));
        assert_eq!(frames(b).await, vec![Ok("hello".into())]);
        let e = PdBody::empty();
        assert!(e.is_end_stream());
    }

    fn scrubbed(steps: Vec<Step>, content_type: &'static str) -> PdBody {
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static(content_type),
        );
        body(steps, content_type == "text/event-stream").scrubbed(&headers)
    }

    #[tokio::test]
    async fn a_scrubbed_body_overwrites_the_handoff_and_keeps_every_other_byte() {
        use Step::*;
        // The handoff's key cut between two frames that do not arrive together, its
        // value between two that do.
        let steps = vec![
            Data("data: {\"a\":1,\"kv_trans"),
            Pending,
            Pending,
            Pending,
            Pending,
            Data("fer_params\":{\"remote_host\":"),
            Data("\"10.0.0.7\"}}\n\n"),
            Pending,
            Pending,
            Pending,
            Pending,
            Data("data: {\"kv_transfer_params\":null}\n\n"),
        ];
        let got = frames(scrubbed(steps, "text/event-stream")).await;
        let got: Vec<String> = got.into_iter().map(Result::unwrap).collect();
        assert_eq!(
            got,
            [
                "data: {\"a\":1,",
                &format!("\"kv_transfer_params\":null{}}}\n\n", " ".repeat(22)),
                "data: {\"kv_transfer_params\":null}\n\n",
            ]
        );
        // A whole JSON answer keeps its exact length; another kind is not read.
        let json = "{\"kv_transfer_params\":{\"remote_port\":5600}}";
        let b = PdBody::from(Bytes::from(json)).scrubbed(&{
            let mut h = HeaderMap::new();
            h.insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            h
        });
        assert_eq!(b.size_hint().exact(), Some(json.len() as u64));
        let out = frames(b).await;
        assert_eq!(
            out,
            vec![Ok(format!(
                "{{\"kv_transfer_params\":null{}}}",
                " ".repeat(16)
            ))]
        );
        let plain = frames(scrubbed(vec![Data(json)], "text/plain")).await;
        assert_eq!(plain, vec![Ok(json.to_owned())]);
    }

    #[tokio::test]
    async fn a_handoff_that_cannot_be_overwritten_ends_the_stream() {
        use Step::*;
        let got = frames(scrubbed(
            vec![
                Data("data: {\"x\":1}\n\n"),
                Pending,
                Pending,
                Pending,
                Pending,
                Data("data: {\"kv_transfer_params\":oops}\n\n"),
            ],
            "text/event-stream",
        ))
        .await;
        assert_eq!(got[0], Ok("data: {\"x\":1}\n\n".into()));
        let err = error_event(got[1].as_ref().unwrap());
        assert_eq!(err["code"], "decode_stream_failed");
        assert_eq!(got.len(), 2);
    }

    /// The `error` object of an in-band SSE error event.
    fn error_event(frame: &str) -> serde_json::Value {
        let json = frame.trim().strip_prefix("data: ").unwrap();
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        v["error"].clone()
    }

    #[test]
    fn sse_error_event_is_valid_json() {
        let ev = sse_error_event("x \"y\"", "server_error", "c");
        let text = std::str::from_utf8(&ev).unwrap();
        let data = text.trim().strip_prefix("data: ").unwrap();
        let v: serde_json::Value = serde_json::from_str(data).unwrap();
        assert_eq!(v["error"]["message"], "x \"y\"");
    }
}
