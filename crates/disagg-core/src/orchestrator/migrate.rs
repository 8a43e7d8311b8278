//! Mid-stream migration: a decode stream that breaks after its answer began goes on, on
//! another decode engine, from the tokens it had generated.
//!
//! Off by default ([`MigrationConfig::limit`] 0): then nothing here runs and the answer's
//! body is the one it always was. On, an eligible request ([`plan`]: a streamed vLLM
//! chat or completion whose state a token prompt carries) has its decode leg asked for
//! `return_token_ids` (vLLM 0.33 writes the prompt's ids on the first chunk and each
//! chunk's new ids on its choice: `vllm/entrypoints/openai/chat_completion/serving.py`,
//! `vllm/entrypoints/openai/completion/serving.py`), and its body is a [`Migrating`]
//! body around the decode's:
//!
//! * **Track.** Whole SSE events are relayed (a half event is held until its end, so a
//!   break never leaves one half-written); in each, a byte scan finds the `token_ids`
//!   arrays and keeps the ids, and blanks them (`null`) when the client did not ask for
//!   them. Only the first chunk is deserialized, and only for its `id`, `object`,
//!   `created`, `model` and the prompt's ids (kept as the engine's text, the rest
//!   skipped); the events are slices of the frames they came in, and only a cut
//!   event's bytes are held. Past [`MigrationConfig::max_seq_len`] tokens the ids are
//!   dropped and the request is no longer migratable.
//! * **Detect.** The decode's body breaks, ends before `data: [DONE]`, or sends an
//!   error event naming a 5xx (`events.rs`: one naming a 4xx or no status is the
//!   decode's refusal, relayed as it came with the rest of its stream, not continued,
//!   no engine blamed, as a stream relayed without migration tells it); a vLLM stream also when it reaches `[DONE]` before its choice's
//!   finish reason (`unfinished.rs`: a completions decode whose KV load failed says
//!   nothing else; a usage chunk before the finish is not relayed, and a completions
//!   leg none of whose answer came is continued from the client's own prompt); when
//!   not continued, the proxy's error event ends the client's stream in place of a
//!   `[DONE]`, except that an engine's own error event goes out as it wrote it with
//!   the rest of its stream (usually its `[DONE]`), and a stream past an event over
//!   `MAX_EVENT` (1 MiB) is relayed as it comes. After a plan's lead, its decode leg
//!   fails before its body (its
//!   connection, a 5xx, its head's budget). Not when the first leg's KV gate fails,
//!   its decode refuses it (a 4xx), or the deadline passes before its body: the
//!   stream ends with that error.
//! * **Continue.** A continuation on another decode endpoint (never one already tried;
//!   the dead one is reported failed once, which is what passive health hears: when
//!   the stream moves on, in the request's trace when it is traced and as the
//!   attempt's, its leg timed from its send, or the handoff step before it, past its
//!   head and first byte to the break; when no continuation starts, by the attempt's
//!   report, which names it; its in-flight count and the router's place on it are
//!   given back as its stream is abandoned), placed
//!   by the router (`Router::place`: a per-endpoint limit waits for room, and holds a
//!   place while it streams); its waits for room, any fresh prefill, and its head end within one
//!   decode head timeout from the break (a continuation that could not start leaves the
//!   next no new window; a step cut at that end blames no engine, as the request's
//!   deadline does not): `POST /v1/completions` with `prompt` = the prompt's ids and
//!   the generated ids, `max_tokens` (and `min_tokens`) less what was generated, the
//!   client's sampling parameters and stops, `stream`, `return_token_ids`. Up to
//!   [`MigrationConfig::limit`] times. A request whose KV came from a prefill (the
//!   handoff mark `kv`) is continued through a fresh prefill leg as an attempt of its
//!   own (the connector's plan, the prefill, the handoff, the decode:
//!   `Inner::attempt_on`), on the prefill that computed the prompt when it is still in
//!   the set (its prefix cache holds the prompt), else the least busy one, never one
//!   whose leg an earlier continuation reported failed (its engine to blame: its leg
//!   or its handoff, riding in its stream or before its decode started, its engine as
//!   the connector resolved the plan, a step out of the handoff's own budget; not a
//!   refusal of its leg, a 4xx, nor the request's deadline or the continuation's own
//!   end, nor the connector's own work failing for a reason not its engine's, before
//!   or after the leg was sent), placed by the router too
//!   (its wait given half the time left; a place held until the prefill leg ends);
//!   decode-only with [`MigrationConfig::decode_only`], for a request served by a
//!   decode alone (direct, decode-only fallback), when no prefill is left or has room
//!   in that time, or when the prefill side of the continuation fails. A request a
//!   continuation's wait counted as queued is not counted again by the next.
//! * **Splice.** The continuation's chunks are rewritten with the first leg's `id`,
//!   `object`, `created` and `model`, chat-shaped (`delta.content`) for a chat request,
//!   with no second role chunk; a usage chunk counts the original prompt and the
//!   completion tokens of every leg. A chunk is walked, never built as a `Value` (an
//!   engine's event of `MAX_EVENT` bytes would cost up to ninety times its size): what is
//!   carried over is copied as the engine wrote it, only ids and counts are read.
//! * **Report.** Each continuation tried is a [`Migration`] in the request's summary
//!   (from, to, tokens carried, when the stream broke and when the continuation's first
//!   byte went out: the time lost, ended by a continuation's first bytes even when the
//!   frame they came in also breaks it), with a span id drawn when the request is
//!   traced; the continuation's legs carry a `traceparent` naming that span. A fresh
//!   prefill's leg is reported when it ends, as any prefill leg (`fresh.rs`), and a
//!   continuation through it that fails as an attempt, each with the request's trace
//!   and leg span ids of its own (never the migration's span's); one that fails while
//!   riding in the continuation's stream is what the stream broke for, not the decode,
//!   which is not blamed and may be chosen again (after the decodes not tried yet); its
//!   own leg is told as its failure says (failed only when its engine is to blame).
//!   The attempt's report names the decode that finished the answer and times its
//!   decode leg (and the handoff step before it, a fresh prefill's) by that decode's
//!   leg, its start and prefill leg the attempt's, under handoff and decode span ids
//!   drawn for it (the attempt's are the first decode's, whose `traceparent` named
//!   them: the report that tells it failed draws them). A broken leg not continued (an early end, an error
//!   event) is told failed by the attempt's report; the summary says the stream broke,
//!   as it does when the leg ended for its riding prefill (its decode then not blamed).
//!
//! SGLang's `/generate` (`generate.rs`) is tracked by keeping its last event (the
//! stream's `text` and `output_ids` are cumulative), read only when the stream breaks;
//! its continuation is a `/generate` with `input_ids`, spliced after what the client
//! has.
//!
//! A client that leaves drops the body, and with it any continuation: it is never
//! migrated.

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use disagg_json::ErrorEvent;
use http::header::{HeaderName, HeaderValue};
use http_body::{Body, Frame};
use sync_wrapper::SyncWrapper;

use crate::endpoint::{Endpoint, InFlightGuard};
use crate::error::BoxError;
use crate::outcome::{Migration, now};
use crate::request::PdRequest;
use crate::router::Route;
use crate::source::EndpointSource;
use crate::transport::{BoxBody, Transport};

mod entry;
mod events;
mod fresh;
mod generate;
mod head;
mod moved;
mod plan;
mod seen;
mod start;
mod times;
mod unfinished;

use head::Head;
use moved::Broken;
pub(crate) use moved::{Applied, Moved};
use splice::{splice_chunk, usage_chunk};
pub(crate) use start::ThroughPrefill;
use start::{Bounds, Continuation, Current, End, NotStarted, Started, failing, not_a_break, start};
use times::LegTimes;
mod scan;
mod splice;

use super::report::Reporter;
use super::stats::{Counters, bump};
use plan::*;
pub(crate) use plan::{Plan, ask_ids, plan};
#[cfg(test)]
use scan::parse_ids;
use scan::{
    Held, IDS_KEY, IdsKey, USAGE_KEY, event_end, has_finish, has_usage, is_done, next_ids,
    parse_ids_into, trailing,
};
use seen::Seen;
use unfinished::Unfinished;

/// Mid-stream migration settings (`--migration-limit`, `--migration-max-seq-len`,
/// `--migration-allow-seed`, `--migration-decode-only`). See [docs/reliability.md] for
/// what is migrated, and which continuations go through a fresh prefill.
///
/// [docs/reliability.md]: https://github.com/disagg-rs/disagg/blob/main/docs/reliability.md
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationConfig {
    /// Continuations per request at most; 0 (the default) turns migration off, at no
    /// cost per request.
    pub limit: u32,
    /// Longest sequence (prompt and generated tokens) a request is tracked for; past
    /// it the ids are dropped and the request is no longer migratable (default 32768:
    /// 128 KiB of ids per request at most).
    pub max_seq_len: usize,
    /// Migrate requests that carry a `seed` (default off: the continuation draws from
    /// another generator state, so the answer differs from an unbroken run's).
    pub allow_seed: bool,
    /// Continue decode-only even when the request was disaggregated (default off: a
    /// request whose KV came from a prefill is continued through a fresh prefill leg,
    /// which the prefill's prefix cache makes cheap, and its handoff). See
    /// docs/reliability.md for the rule.
    pub decode_only: bool,
}

impl Default for MigrationConfig {
    fn default() -> Self {
        MigrationConfig {
            limit: 0,
            max_seq_len: 32_768,
            allow_seed: false,
            decode_only: false,
        }
    }
}

/// Why a decode stream was migrated (the `reason` label of `disagg_migrations_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reason {
    /// The decode's body broke (a reset, an I/O error).
    Reset,
    /// The decode's body ended before `data: [DONE]`.
    Eof,
    /// The decode sent an error event naming a 5xx (its engine's failure).
    ErrorFrame,
}

impl Reason {
    pub(crate) const ALL: [Reason; 3] = [Reason::Reset, Reason::Eof, Reason::ErrorFrame];

    /// The label.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Reason::Reset => "reset",
            Reason::Eof => "eof",
            Reason::ErrorFrame => "error_frame",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// What a [`Migrating`] body needs from the orchestrator to continue a stream.
pub(crate) struct Ctx {
    pub(crate) config: MigrationConfig,
    pub(crate) plan: Plan,
    pub(crate) transport: Arc<dyn Transport>,
    pub(crate) source: Arc<dyn EndpointSource>,
    pub(crate) reporter: Arc<Reporter>,
    pub(crate) counters: Arc<Counters>,
    /// The attempt's route (its decode is the first leg's).
    pub(crate) route: Route,
    /// The attempt's number ([`Report::attempt`]): a dead decode's report carries it; a
    /// continuation through a fresh prefill is numbered past it (by its index).
    pub(crate) attempt: u32,
    /// The engine-side id of the attempt; continuations get `<id>-m<n>`.
    pub(crate) engine_id: HeaderValue,
    /// The client headers the legs carry.
    pub(crate) forwarded: Vec<(HeaderName, HeaderValue)>,
    /// How long a continuation may take to start, from the break it continues: its
    /// waits for room (its decode's place, and its fresh prefill's), a fresh prefill
    /// leg and its handoff, and its decode's response head all end by this much later
    /// (or by the request's deadline, when sooner): one end, not one per wait nor one
    /// per continuation of the same break.
    pub(crate) head_timeout: Duration,
    /// The request's deadline, if it has one.
    pub(crate) deadline: Option<tokio::time::Instant>,
    /// The request was counted as queued: it waited in the admission queue, or a
    /// continuation's wait for room counted it. Each continuation's places say so, and
    /// one that counts it sets it for the next.
    pub(crate) queued: std::sync::atomic::AtomicBool,
    /// Who sent the request, as the server named it: a continuation through a fresh
    /// prefill is the same client's request.
    pub(crate) client: Option<Arc<str>>,
    pub(crate) moved: Arc<Moved>,
    /// The first leg's decode was handed the prefill's KV, which had answered by the
    /// decode's head: its stream breaking as a lost KV load ends one may be that KV's
    /// fault ([`Broken::lost_kv`]).
    pub(crate) handed_kv: bool,
    /// The marks of a concurrent prefill still running at the decode's head, when the
    /// decode was handed its KV: one that answered since handed it too.
    pub(crate) late_kv: Option<Arc<crate::orchestrator::respond::LateMarks>>,
    /// Continuations go through a fresh prefill (the request was disaggregated and the
    /// policy allows it); `None`: decode-only.
    pub(crate) through_prefill: Option<ThroughPrefill>,
    /// The request's trace, when traced: each continuation's legs carry a
    /// `traceparent` naming its migration's span, drawn from `spans`.
    pub(crate) trace: Option<(crate::outcome::TraceIds, Arc<crate::trace::SpanIds>)>,
}

/// The longest SSE event held whole; a longer one ends tracking (the stream is then
/// relayed as it comes, no longer migratable).
const MAX_EVENT: usize = 1 << 20;

/// The client's body of an eligible streamed request while migration is on: the decode
/// stream's whole events, tracked, and continued on another decode when it breaks (see
/// the [module docs](self)).
pub(crate) struct Migrating {
    inner: BoxBody,
    ctx: Arc<Ctx>,
    /// The current leg's endpoint, its in-flight count and the router's place on it,
    /// given back when its stream ends or is abandoned.
    leg: Current,
    pending: Option<SyncWrapper<Continuation>>,
    /// A partial event of the current leg.
    held: Held,
    head: Option<Head>,
    prompt: Option<Vec<u32>>,
    generated: Vec<u32>,
    /// Still migratable: the ids are kept.
    on: bool,
    /// Relaying bytes as they come (an event too long to hold).
    raw: bool,
    finished: bool,
    done: bool,
    ended: bool,
    /// The usage chunk went out.
    usage_seen: bool,
    /// The stream's end, written by the proxy for a leg that broke after its last
    /// token: a usage chunk if one is owed, and `data: [DONE]`.
    tail: Option<Bytes>,
    /// Continuations started.
    migrations: u32,
    /// The decodes tried (the first leg's included), those to pick again after the
    /// others (their stream ended for the prefill riding in it), and the fresh
    /// prefills whose legs were told failed (riding in a continuation's stream, or
    /// before its decode started): not picked again.
    seen: Seen,
    /// When the stream last broke: the continuations of that break (a continuation
    /// that could not start, then the next) all start within one window from it.
    window: Option<tokio::time::Instant>,
    /// Completion tokens of the legs before the current one.
    carried: u64,
    /// The error that broke the last leg, returned when migration is not possible.
    broke: Option<BoxError>,
    /// `/generate`: the last answer event relayed to the client (its payload), whose
    /// text and ids are what was generated so far.
    last: Option<Bytes>,
    /// `/generate`: what the client's stream held when it broke, continued from.
    prefix: Option<generate::Prefix>,
    /// Since when the client's stream stands still: set at a break that starts a
    /// continuation, cleared when a continuation's first byte goes out.
    stalled: Option<Instant>,
    /// The searches of each event, built once.
    scan: Scan,
    /// The error event that broke the current leg, as read ([`ErrorEvent::of_payload`]).
    error_event: Option<ErrorEvent>,
}

/// The needles a tracked event is searched for, each `memmem` finder built once per
/// stream rather than once per search.
struct Scan {
    /// `token_ids":` (the end of both ids keys).
    ids: memchr::memmem::Finder<'static>,
    /// `"usage"` (set to an object: a usage chunk, [`has_usage`]).
    usage: memchr::memmem::Finder<'static>,
}

impl Scan {
    fn new() -> Self {
        Scan {
            ids: memchr::memmem::Finder::new(IDS_KEY),
            usage: memchr::memmem::Finder::new(USAGE_KEY),
        }
    }
}

impl fmt::Debug for Migrating {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Migrating")
            .field("generated", &self.generated.len())
            .field("migrations", &self.migrations)
            .finish_non_exhaustive()
    }
}

impl Migrating {
    /// The body relaying `inner`, the first leg's, under `ctx`; the first leg's decode
    /// is held by `guard` and the router's `hold` on it, its steps timed in `times`.
    fn new(
        inner: BoxBody,
        ctx: Ctx,
        guard: InFlightGuard,
        hold: Option<crate::policy::Permit>,
        times: LegTimes,
    ) -> Self {
        let seen = Seen::first(ctx.route.decode.id());
        let leg = Current {
            endpoint: Arc::clone(&ctx.route.decode),
            guard: Some(guard),
            hold,
            riding: None,
            times,
        };
        let prompt = ctx.plan.generate.clone();
        Migrating {
            inner,
            ctx: Arc::new(ctx),
            leg,
            pending: None,
            held: Held::default(),
            head: None,
            prompt,
            last: None,
            prefix: None,
            generated: Vec::new(),
            on: true,
            raw: false,
            finished: false,
            done: false,
            ended: false,
            usage_seen: false,
            tail: None,
            migrations: 0,
            seen,
            window: None,
            carried: 0,
            broke: None,
            stalled: None,
            scan: Scan::new(),
            error_event: None,
        }
    }

    fn continuing(&self) -> bool {
        self.migrations > 0
    }

    /// Bytes of the current leg go to the client: if they are its first, their time is
    /// the leg's first byte, and if it is a continuation the migration ends here (its
    /// time lost is known; it is logged).
    fn resumed(&mut self) {
        if self.leg.times.first.is_some() {
            return;
        }
        let at = now();
        self.leg.times.first = Some(at);
        if self.stalled.take().is_none() {
            return;
        }
        let Some(m) = self.ctx.moved.resumed(at) else {
            return;
        };
        tracing::info!(
            reason = m.reason,
            from = %m.from.id(),
            to = m.to.as_ref().map(|e| e.id().as_str()),
            prefill = m.prefill.as_ref().map(|e| e.id().as_str()),
            tokens = m.tokens,
            lost_ms = m.time_lost.map_or(0.0, |d| d.as_secs_f64() * 1e3),
            "decode stream continued"
        );
    }

    /// The end of a stream whose last token is out: the usage chunk the client asked
    /// for, if it did not come yet (the prompt's tokens and every generated one), and
    /// `data: [DONE]`.
    fn end_of_stream(&self) -> Bytes {
        let mut out = BytesMut::new();
        if let (true, false, Some(head), Some(prompt)) = (
            self.ctx.plan.usage,
            self.usage_seen,
            &self.head,
            &self.prompt,
        ) {
            let (p, c) = (prompt.len() as u64, self.generated.len() as u64);
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(&usage_chunk(head, p, c));
            out.extend_from_slice(b"\n\n");
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        out.freeze()
    }

    /// Stop tracking: the request is no longer migratable.
    fn untrack(&mut self) {
        self.on = false;
        self.generated = Vec::new();
        self.prompt = None;
    }

    fn keep_ids(&mut self, ids: &[u32]) {
        if !self.on {
            return;
        }
        let len = self.prompt.as_ref().map_or(0, Vec::len) + self.generated.len() + ids.len();
        if len > self.ctx.config.max_seq_len {
            self.untrack();
        } else {
            self.generated.extend_from_slice(ids);
        }
    }

    /// The ids of the list `raw` (the bytes of a first-leg chunk), read into the
    /// generated ones in place; a bad list, or one past the bound, ends tracking.
    fn keep_raw_ids(&mut self, raw: &[u8]) {
        if !self.on {
            return;
        }
        if parse_ids_into(raw, &mut self.generated).is_none() {
            self.untrack();
            return;
        }
        let len = self.prompt.as_ref().map_or(0, Vec::len) + self.generated.len();
        if len > self.ctx.config.max_seq_len {
            self.untrack();
        }
    }

    /// The complete events of `data` (after what was held of a cut event), each handled,
    /// into `out`; `Err` when one says the leg failed.
    ///
    /// The events are slices of the frame `data`: only a cut event's bytes are copied,
    /// into [`Held`], where they wait for their end (and what follows a failed event,
    /// which goes out as it came if the leg is not migrated), each frame scanned once.
    fn events(&mut self, data: Bytes, out: &mut BytesMut) -> Result<(), (Reason, Bytes)> {
        let Some(mut src) = self.held.push(data) else {
            if self.held.len() > MAX_EVENT {
                // Nothing of this size is a chunk of tokens: relay as it comes, untracked.
                self.untrack();
                self.raw = true;
                out.extend_from_slice(&self.held.take());
            }
            return Ok(());
        };
        out.reserve(src.len() + 16);
        while let Some(end) = event_end(&src) {
            let event = src.split_to(end);
            let handled = match (self.continuing(), self.ctx.plan.generate.is_some()) {
                (true, false) => self.spliced(&event, out),
                (false, false) => self.first_leg(&event, out),
                (true, true) => self.generate_spliced(&event, out),
                (false, true) => self.generate_first_leg(&event, out),
            };
            if let Err(reason) = handled {
                self.held.hold(&src);
                return Err((reason, event));
            }
        }
        if src.len() > MAX_EVENT {
            self.untrack();
            self.raw = true;
            out.extend_from_slice(&src);
        } else {
            self.held.hold(&src);
        }
        Ok(())
    }

    /// An event of the first leg: tracked, its ids blanked unless the client asked.
    fn first_leg(&mut self, event: &Bytes, out: &mut BytesMut) -> Result<(), Reason> {
        let Some(data) = self.relayed(event, out)? else {
            return Ok(());
        };
        if self.on && self.prompt.is_none() {
            // The first chunk (or a usage chunk before it), read once.
            self.read_first(data);
        }
        if has_finish(data) {
            self.finished = true;
        }
        if self.ctx.plan.usage && has_usage(&self.scan.usage, data) {
            if self.early_usage(true) {
                return Ok(());
            }
            self.usage_seen = true;
        }
        let blank = !self.ctx.plan.client_ids;
        let mut from = 0;
        let mut at = 0;
        let base = event.len() - data.len() - trailing(event);
        while let Some((key, start, end)) = next_ids(&self.scan.ids, data, at) {
            if key == IdsKey::Generated && self.on {
                self.keep_raw_ids(&data[start..end]);
            }
            if blank {
                out.extend_from_slice(&event[from..base + start]);
                out.extend_from_slice(b"null");
                from = base + end;
            }
            at = end;
        }
        out.extend_from_slice(&event[from..]);
        Ok(())
    }

    /// An event of a continuation, rewritten into the client's stream
    /// ([`splice_chunk`]).
    fn spliced(&mut self, event: &Bytes, out: &mut BytesMut) -> Result<(), Reason> {
        let Some(data) = self.continued(event, out)? else {
            return Ok(());
        };
        // Continued from the client's prompt: the answer's first chunk is this leg's.
        let first = self.on && self.prompt.is_none();
        if first {
            self.read_first(data);
        }
        let Some(head) = &self.head else {
            return Err(Reason::ErrorFrame);
        };
        let Some(spliced) = splice_chunk(head, &self.ctx.plan, self.carried, first, data) else {
            return Err(Reason::ErrorFrame);
        };
        self.finished |= spliced.finished;
        self.keep_ids(&spliced.ids);
        if self.early_usage(spliced.usage) {
            return Ok(());
        }
        self.usage_seen |= spliced.usage;
        if let Some(json) = spliced.json {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(&json);
            out.extend_from_slice(b"\n\n");
        }
        Ok(())
    }

    /// The current leg failed for `reason`: start a continuation if the request may
    /// still migrate (`true`), else not. `dead` is the engine to blame, its leg timed
    /// from what is known of it (its send, its head, its first byte) to now, the break.
    /// Reported failed (which passive health hears) once: at once when `always` (a
    /// continuation that could not start: no report of the attempt names it); else,
    /// when a continuation starts, once the stream moves on (the attempt's report then
    /// names another decode), and when the stream ends first, or no continuation
    /// starts, by the attempt's report, which names it. `lost_kv_shape`: the leg broke
    /// as a vLLM stream whose KV load failed ends (an error event naming a 5xx, or a
    /// `[DONE]` before the answer finished).
    fn migrate(
        &mut self,
        reason: Reason,
        dead: Option<(Arc<Endpoint>, LegTimes)>,
        always: bool,
        lost_kv_shape: bool,
    ) -> bool {
        let ctx = Arc::clone(&self.ctx);
        let at = now();
        // A break with no continuation started yet is the first leg's.
        let first_leg = !always && !self.continuing();
        let dead = dead.map(|(decode, times)| Broken {
            decode,
            times,
            at,
            first_leg,
            lost_kv: first_leg && lost_kv_shape && ctx.prefill_handed_kv(),
        });
        let dead = match dead {
            Some(dead) if always => {
                ctx.tell_failed(dead);
                None
            }
            dead => dead,
        };
        if !always {
            // A break: the continuations that follow it start within one window.
            self.window = Some(tokio::time::Instant::now());
            if self.leg.failed_prefill().is_some() {
                // The stream ended for its riding prefill, not for its decode: the
                // decode may be picked again (after the others), the prefill not when
                // its engine was to blame (its leg told failed).
                self.seen.again(self.leg.endpoint.id());
                if let Some(prefill) = self.leg.blamed_prefill() {
                    self.seen.failed_prefill(prefill);
                }
                if dead.is_none() && self.continuing() {
                    // Nor is it blamed by the attempt's report, if that names it last.
                    ctx.moved.exempt();
                }
            }
        }
        if ctx.plan.generate.is_some() {
            self.generate_prefix();
        }
        let migratable = (self.on
            && !self.raw
            && self.prompt.is_some()
            && (self.head.is_some() || self.prefix.is_some()))
            || self.unstarted();
        if migratable && self.finished && reason != Reason::ErrorFrame {
            // Every token is out, only the end is missing: the proxy writes it.
            self.tail = Some(self.end_of_stream());
            self.inner = super::body::empty_body();
            self.leg.release();
            return true;
        }
        // Not continued: a broken leg (one that ended early, or in an error event,
        // even after its last token) is told failed by the attempt's report, which
        // names it; one that ended for its riding prefill fails the request all the same.
        let riding_failed = self.leg.failed_prefill().is_some();
        let stays = |dead: Option<Broken>| {
            ctx.moved.stays(dead, riding_failed);
            false
        };
        if !migratable || self.finished || self.migrations >= ctx.config.limit {
            if self.finished && reason != Reason::ErrorFrame {
                // Every token is out (untracked, or the ids unread): only the end is
                // missing, the answer whole.
                return false;
            }
            return stays(dead);
        }
        let unstarted = self.unstarted();
        let prompt = match self.prompt.as_ref() {
            Some(prompt) => Some(prompt),
            None if unstarted => None,
            None => return stays(dead),
        };
        let generated = self.generated.len() as u64;
        let left = ctx.plan.max_tokens.map(|m| m.saturating_sub(generated));
        if left == Some(0) {
            return stays(dead);
        }
        let broke_at = *self.window.get_or_insert_with(tokio::time::Instant::now);
        let end = End::of(&ctx, broke_at);
        if always && end.passed() {
            // A continuation that could not start used the break's window up: no other
            // gets a new one.
            return false;
        }
        if let Some(dead) = dead {
            // Told when the stream moves on, or by the attempt's report.
            ctx.moved.broke(dead);
        }
        bump(&ctx.counters.migrations[reason.index()]);
        ctx.counters
            .migrated_tokens
            .fetch_add(generated, std::sync::atomic::Ordering::Relaxed);
        tracing::warn!(
            reason = reason.as_str(),
            tokens = generated,
            migration = self.migrations + 1,
            "decode stream broke mid-answer: continuing on another decode"
        );
        let ids = prompt.map(|prompt| {
            let mut ids = Vec::with_capacity(prompt.len() + self.generated.len());
            ids.extend_from_slice(prompt);
            ids.extend_from_slice(&self.generated);
            ids
        });
        let body = match (&ctx.plan.generate, &ids) {
            (Some(_), Some(ids)) => generate::continuation_body(&ctx.plan, ids, generated, left),
            // With no ids, the client's own prompt (nothing of the answer came).
            _ => continuation_body(&ctx.plan, ids.as_deref(), generated, left),
        };
        self.carried = generated;
        self.migrations += 1;
        self.held.clear();
        // The broken leg's stream is abandoned: its decode no longer counts it (nor
        // holds the router's place for it) while the continuation runs.
        self.inner = super::body::empty_body();
        self.leg.release();
        let broke = *self.stalled.get_or_insert(at);
        let span = ctx.trace.as_ref().map(|(_, ids)| ids.span());
        ctx.moved.begin(Migration {
            reason: reason.as_str(),
            from: Arc::clone(&self.leg.endpoint),
            to: None,
            prefill: None,
            tokens: generated,
            broke,
            resumed: None,
            time_lost: None,
            span,
        });
        let n = self.migrations;
        let bounds = Bounds {
            seen: self.seen.clone(),
            end,
        };
        ctx.moved.set_continuing(true);
        self.pending = Some(SyncWrapper::new(Box::pin(start(
            ctx, body, bounds, n, span,
        ))));
        true
    }
}

impl Body for Migrating {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let polled = this.poll_next(cx);
        if let Poll::Ready(None | Some(Err(_))) = polled {
            // The stream ended: its leg's endpoint is free before the attempt is
            // reported.
            this.leg.release();
        }
        polled
    }
}

impl Migrating {
    /// The next frame for the client (the body's whole logic; `poll_frame` gives the
    /// leg back when it ends).
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self;
        loop {
            if let Some(tail) = this.tail.take() {
                this.ended = true;
                return Poll::Ready(Some(Ok(Frame::data(tail))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            if let Some(pending) = this.pending.as_mut() {
                let result = match pending.get_mut().as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(r) => r,
                };
                this.pending = None;
                this.ctx.moved.set_continuing(false);
                match result {
                    Ok(Started {
                        current,
                        body,
                        prefill,
                        failed_prefill,
                    }) => {
                        if let Some(prefill) = &failed_prefill {
                            this.seen.failed_prefill(prefill);
                        }
                        this.seen.tried(current.endpoint.id());
                        let ctx = &this.ctx;
                        ctx.moved.sent_to(Some(&current.endpoint), prefill.as_ref());
                        // The attempt's report now names this decode: the one the
                        // stream broke on is told failed.
                        // Its handoff and decode spans are drawn for it: the
                        // attempt's are the first decode's (its engine's spans sit
                        // under them), told by its own report.
                        let spans = ctx.trace.as_ref().map(|(_, ids)| moved::LegSpans {
                            handoff: ids.span(),
                            decode: ids.span(),
                        });
                        if let Some(dead) =
                            ctx.moved.moved(&current.endpoint, &current.times, spans)
                        {
                            ctx.tell_failed(dead);
                        }
                        this.leg = current;
                        this.inner = body;
                        this.broke = None;
                        continue;
                    }
                    Err(NotStarted {
                        tried,
                        blame,
                        prefill,
                        failed_prefill,
                        times,
                        error: e,
                    }) => {
                        tracing::warn!(error = %crate::error::error_chain(&e), "continuation failed");
                        if let Some(prefill) = &failed_prefill {
                            this.seen.failed_prefill(prefill);
                        }
                        if let Some(ep) = &tried {
                            this.seen.tried(ep.id());
                        }
                        this.ctx.moved.sent_to(tried.as_ref(), prefill.as_ref());
                        // The client hears of the break, not of the continuation's
                        // own failure (unless the leg only ended early).
                        if this.broke.is_none() {
                            this.broke = Some(Box::new(e));
                        }
                        if this.migrate(Reason::Reset, blame.map(|b| (b, times)), true, false) {
                            continue;
                        }
                        this.ended = true;
                        return Poll::Ready(this.broke.take().map(Err));
                    }
                }
            }
            let polled = Pin::new(&mut this.inner).poll_frame(cx);
            let mut blame = true;
            let reason = match polled {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => {
                    let data = match frame.into_data() {
                        Ok(data) => data,
                        Err(frame) => return Poll::Ready(Some(Ok(frame))),
                    };
                    if this.raw {
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                    // One allocation for what goes out, when something does (blanked ids
                    // are about as long as the ids): `events` sizes it.
                    let mut out = BytesMut::new();
                    match this.events(data, &mut out) {
                        Ok(()) if out.is_empty() => continue,
                        Ok(()) => {
                            this.resumed();
                            return Poll::Ready(Some(Ok(Frame::data(out.freeze()))));
                        }
                        Err((reason, event)) => {
                            // The events before the one that broke the leg go to the
                            // client either way: when they are a continuation's first,
                            // its migration ended (and the leg's first byte is known,
                            // for the report of its break).
                            if !out.is_empty() {
                                this.resumed();
                            }
                            if let Some(refusal) = this.refusal() {
                                // The decode refused the request in its stream: another
                                // decode would refuse it too. Not continued, no engine
                                // blamed; the event goes out as the engine wrote it, and
                                // the rest of its stream after it.
                                this.ctx.moved.refused(refusal);
                                this.untrack();
                                this.raw = true;
                                out.extend_from_slice(&event);
                                out.extend_from_slice(&this.held.take());
                                return Poll::Ready(Some(Ok(Frame::data(out.freeze()))));
                            }
                            let dead = this.leg.take_blame();
                            let lost_kv = reason == Reason::ErrorFrame
                                || (is_done(&event) && !this.ctx.plan.chat);
                            if this.migrate(reason, dead, false, lost_kv) {
                                if out.is_empty() {
                                    continue;
                                }
                                return Poll::Ready(Some(Ok(Frame::data(out.freeze()))));
                            }
                            this.untrack();
                            this.raw = true;
                            if is_done(&event) {
                                // The answer never finished: no `[DONE]` (nor what came
                                // after it), the stream ends with the error, after what
                                // went before.
                                this.held.clear();
                                return Poll::Ready(Some(this.fail_after(out, Unfinished::Done)));
                            }
                            // As today: the error event goes out as the engine wrote it.
                            out.extend_from_slice(&event);
                            out.extend_from_slice(&this.held.take());
                            return Poll::Ready(Some(Ok(Frame::data(out.freeze()))));
                        }
                    }
                }
                // A first leg begun with a lead of the proxy's own: its KV gate failed,
                // its decode refused the leg (a 4xx), or the deadline passed before the
                // decode's body. No decode stream broke, and the error carries its own
                // verdict, which the attempt's report tells: it ends the stream, after
                // what is held. The decode's own failure (its connection, a 5xx, its
                // head's budget) is a broken stream, continued; a continuation's gate
                // failure is its fresh prefill's (`fresh::Gated`).
                Poll::Ready(Some(Err(e))) if !this.continuing() && not_a_break(&e) => {
                    this.ended = true;
                    this.raw = true;
                    if this.held.is_empty() {
                        return Poll::Ready(Some(Err(e)));
                    }
                    this.inner = failing(e);
                    this.ended = false;
                    return Poll::Ready(Some(Ok(Frame::data(this.held.take().freeze()))));
                }
                Poll::Ready(Some(Err(e))) => {
                    // A break; a continuation's decode that refused its leg after its
                    // lead (a 4xx), or the request's deadline, blames no engine.
                    blame = !not_a_break(&e);
                    this.broke = Some(e);
                    Reason::Reset
                }
                Poll::Ready(None) if this.done || this.raw => {
                    this.ended = true;
                    // A raw leg ended by its riding prefill (its error event relayed) failed.
                    let riding_failed = this.raw && this.leg.failed_prefill().is_some();
                    this.ctx.moved.raw_ended(riding_failed);
                    if this.held.is_empty() {
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(this.held.take().freeze()))));
                }
                Poll::Ready(None) => Reason::Eof,
            };
            let dead = this.leg.take_blame().filter(|_| blame);
            if this.migrate(reason, dead, false, false) {
                continue;
            }
            // Not migrated: end as today (what is held goes first, then the error or
            // the end); an answer that never finished ends with an error too.
            if reason == Reason::Eof && this.broke.is_none() && !this.finished {
                this.broke = Some(Box::new(Unfinished::Eof));
            }
            this.ended = true;
            this.raw = true;
            if !this.held.is_empty() {
                if let Some(e) = this.broke.take() {
                    this.inner = failing(e);
                    this.ended = false;
                }
                return Poll::Ready(Some(Ok(Frame::data(this.held.take().freeze()))));
            }
            return Poll::Ready(this.broke.take().map(Err));
        }
    }
}

#[cfg(test)]
mod tests;
