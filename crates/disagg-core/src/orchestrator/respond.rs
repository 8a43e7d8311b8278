//! The one place the client's response is built: from the [`Exchange`] an attempt
//! produced, its engine answer made relayable ([`answer`](super::answer)).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use http::Response;
use http::header::{self, HeaderValue};

use http_body_util::{BodyExt, Full};

use crate::endpoint::InFlightGuard;
use crate::error::{PdError, Side, error_chain};
use crate::outcome::{LegOutcome, Outcome, Report, Summary, Timeline};
use crate::request::{PdRequest, REQUEST_ID};
use crate::router::Route;
use crate::transport::BoxBody;
use disagg_json::openai_error_body;

use super::Inner;
use super::answer::scrubbed_type;
use super::body::{Finish, PdBody, PendingPrefill, StreamTimer};
use super::clock::{Clock, server_timing};
use super::config::{FAILED_LEG_HEADER, FALLBACK_HEADER, SERVER_TIMING};
use super::legs::end_to_end;
use super::report::unsent_or_abandoned;
use crate::proto::HANDOFF_HEADER;
use crate::proto::unrelayable;

/// The answer `head` as it may reach the client (see [`answer`](super::answer)): as it
/// is (its body is [`scrubbed`](PdBody::scrubbed) by the caller), or, for a head that
/// must not be relayed (an internal redirect, an encoding the client did not accept), a
/// 502 naming the engine (the decode's when `decoded`, else the prefill's 4xx passed
/// through).
fn relayable(
    req: &PdRequest,
    route: &Route,
    decoded: bool,
    head: Response<BoxBody>,
) -> (http::response::Parts, BoxBody) {
    let (parts, body) = head.into_parts();
    let Some(why) = unrelayable(parts.status, &parts.headers, req.headers()) else {
        return (parts, body);
    };
    let (side, ep) = match (decoded, &route.prefill) {
        (false, Some(p)) => (Side::Prefill, p),
        _ => (Side::Decode, &route.decode),
    };
    let err = PdError::upstream_body(side, ep.id().clone(), why.into());
    tracing::warn!(error = %error_chain(&err), "engine answer not relayed");
    let json = openai_error_body(&error_chain(&err), err.error_type(), None, err.code());
    // The engine's body is dropped with its head: its connection closes.
    let mut resp = Response::new(Full::new(json).map_err(|never| match never {}).boxed());
    *resp.status_mut() = err.status();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp.into_parts()
}

/// How an exchange stands: who answers the client, and how far each leg went. The
/// response's outcome, headers and report follow from it in [`Inner::respond`], which
/// matches on it and guesses nothing.
pub(super) enum Stand {
    /// The prefill engine refused its leg with a 4xx (the client's fault), passed
    /// through as the engine wrote it: no decode leg was sent, or (both legs at once)
    /// the one sent was dropped.
    PrefillRefused,
    /// The prefill's answer is the whole answer
    /// ([`HandoffFound::Finished`](crate::connector::HandoffFound::Finished)): no decode
    /// leg was sent; `guard` holds the decode endpoint's in-flight count until the body
    /// ends.
    PrefillAnswered {
        /// The decode endpoint's in-flight count.
        guard: InFlightGuard,
    },
    /// A decode leg sent alone: `direct` (not disaggregated), or `decode-only` with the
    /// code of the prefill failure that made it so (`x-disagg-fallback`).
    DecodeAlone {
        /// The decode endpoint's in-flight count, held until the body ends.
        guard: InFlightGuard,
        /// Why the request was served decode-only; `None` when it was direct.
        fallback: Option<&'static str>,
    },
    /// The decode answers after a prefill leg: how the KV reached it is `mark`
    /// (`x-disagg-handoff`: `kv`, `none`).
    Decoded {
        /// How the KV reached the decode.
        mark: &'static str,
        /// The decode endpoint's in-flight count, held until the body ends.
        guard: InFlightGuard,
        /// The prefill leg, as far as it went (`Abandoned` while `pending` runs).
        prefill: LegOutcome,
        /// Steps still to happen inside the body (a lead stream's decode leg, a
        /// concurrent prefill still running).
        late: Option<Arc<LateMarks>>,
        /// A concurrent prefill still running when the decode's head came: it rides in
        /// the body.
        pending: Option<PendingPrefill>,
    },
}

/// What an attempt produced for the client: an answer's head and body, and how the
/// exchange stands.
pub(super) struct Exchange {
    /// Where the attempt went.
    pub(super) route: Route,
    /// The head and body to answer with: the decode's (reshaped when the plan says so),
    /// a stream the orchestrator leads, or an engine's error passed through.
    head: Response<BoxBody>,
    /// How the exchange stands.
    stand: Stand,
    /// When each step happened (stamped by the attempt when it returns).
    pub(super) timeline: Timeline,
    /// Where the decode's own handoff goes, if the plan keeps it
    /// ([`Handoff::returned`](crate::connector::Handoff::returned)): a 2xx answer's is
    /// given to it as the body is scrubbed.
    pub(super) returned: Option<Arc<dyn crate::connector::ReturnedHandoff>>,
}

impl Exchange {
    /// An exchange over `route` answered by `head`, standing as `stand`.
    pub(super) fn new(route: Route, head: Response<BoxBody>, stand: Stand) -> Self {
        Exchange {
            route,
            head,
            stand,
            timeline: Timeline::starting(),
            returned: None,
        }
    }
}

/// What answered an exchange that is not a decode's 2xx answer after a prefill leg
/// ([`Exchange::into_decoded`]).
pub(super) enum NotDecoded {
    /// The prefill refused its leg (a 4xx, the client's fault): no decode leg was sent.
    PrefillRefused,
    /// The prefill's answer is the whole answer: no decode leg was sent.
    PrefillAnswered,
    /// The decode: an error status, or a decode sent alone.
    Decode {
        /// The status the decode answered.
        status: http::StatusCode,
        /// The prefill leg, as far as it went: a concurrent prefill still running
        /// when the decode answered an error is dropped with the answer (abandoned),
        /// and a decode sent alone had none (not sent).
        prefill: LegOutcome,
    },
}

/// A decode's 2xx answer after a prefill leg ([`Exchange::into_decoded`]).
pub(super) struct Decoded {
    pub(super) head: Response<BoxBody>,
    /// The decode endpoint's in-flight count.
    pub(super) guard: InFlightGuard,
    /// A concurrent prefill still running when the decode's head came.
    pub(super) pending: Option<super::body::PendingPrefill>,
    /// Steps of the attempt inside its body: a stream begun with the plan's lead
    /// ([`LateMarks::lead`]) sends its decode leg there, after its KV gate.
    pub(super) late: Option<Arc<LateMarks>>,
}

impl Exchange {
    /// The decode's 2xx answer after a prefill leg, with the decode's in-flight count, a
    /// concurrent prefill still running and the steps inside the body; for any other
    /// answer (dropped), what gave it.
    pub(super) fn into_decoded(self) -> Result<Decoded, NotDecoded> {
        let status = self.head.status();
        match self.stand {
            Stand::Decoded {
                guard,
                pending,
                late,
                ..
            } if status.is_success() => Ok(Decoded {
                head: self.head,
                guard,
                pending,
                late,
            }),
            Stand::PrefillRefused => Err(NotDecoded::PrefillRefused),
            Stand::PrefillAnswered { .. } => Err(NotDecoded::PrefillAnswered),
            Stand::Decoded { prefill, .. } => Err(NotDecoded::Decode { status, prefill }),
            Stand::DecodeAlone { .. } => Err(NotDecoded::Decode {
                status,
                prefill: LegOutcome::NotSent,
            }),
        }
    }
}

/// Steps of an attempt that happen inside its response body, after the head went out:
/// set by the body's own futures, read once when the attempt is reported.
#[derive(Debug, Default)]
pub(crate) struct LateMarks {
    /// Whether the body leads with a part of the proxy's own (LMCache's first token)
    /// before the decode's: its first chunk is not the decode's.
    pub(crate) lead: bool,
    /// When a concurrent prefill still running at the decode's head ended (answered
    /// well, refused or failed): its leg's end, for the timeline.
    pub(crate) prefill_done: OnceLock<Instant>,
    /// That prefill answered well (a 2xx, read whole; not a refusal nor a failure): its
    /// leg answered, whatever became of the decode afterwards.
    pub(super) prefill_answered: AtomicBool,
    pub(super) decode_sent: OnceLock<Instant>,
    pub(super) decode_head: OnceLock<Instant>,
    /// The decode's body flows to the client: its head was a 2xx (a lead stream's
    /// pending decode resolved into its body). Not at the head: a refusal's message is
    /// read after it, within what is left of the head's budget, and no decode body
    /// follows.
    pub(super) decode_flowing: AtomicBool,
}

impl LateMarks {
    /// Whether a concurrent prefill still running at the decode's head answered well.
    pub(crate) fn answered(&self) -> bool {
        self.prefill_answered.load(Ordering::Relaxed)
    }

    /// Whether the decode's body flows to the client (its head a 2xx): the idle time
    /// of a stream begun before its decode leg was sent counts from then.
    pub(crate) fn flowing(&self) -> bool {
        self.decode_flowing.load(Ordering::Relaxed)
    }

    /// Put the steps that happened into `tl`.
    pub(crate) fn apply(&self, tl: &mut Timeline) {
        if let Some(t) = self.prefill_done.get() {
            tl.prefill_done = Some(*t);
        }
        if let Some(t) = self.decode_sent.get() {
            tl.decode_sent = Some(*t);
        }
        if let Some(t) = self.decode_head.get() {
            tl.decode_head = Some(*t);
        }
    }
}

/// What the serving of a request knows beyond its attempt, for its summary.
#[derive(Debug)]
pub(super) struct RequestMeta {
    /// Attempts made, the answering one included.
    pub(super) attempts: u32,
    /// Time spent waiting for admission.
    pub(super) queued: Option<Duration>,
    /// The answering attempt's engine-side id.
    pub(super) engine_id: HeaderValue,
    /// The trace identities, when tracing.
    pub(super) trace: Option<crate::outcome::TraceIds>,
    /// The encoder stage, when the request went through one.
    pub(super) encode: Option<crate::outcome::EncodeSummary>,
}

impl RequestMeta {
    /// Nothing known yet: no attempt (and no engine-side id, which is empty).
    pub(super) fn none() -> Self {
        RequestMeta {
            attempts: 0,
            queued: None,
            engine_id: HeaderValue::from_static(""),
            trace: None,
            encode: None,
        }
    }

    /// What is known, leaving [`none`](Self::none) in its place.
    pub(super) fn take(&mut self) -> Self {
        std::mem::replace(self, Self::none())
    }
}

impl Inner {
    /// A summary of `req` answered with `status`, its body not yet sent (the caller, or
    /// the body's end, completes it).
    pub(super) fn summary(
        &self,
        req: &PdRequest,
        status: http::StatusCode,
        meta: Option<RequestMeta>,
    ) -> Box<Summary> {
        // Boxed where it is made: the body keeps it boxed, and a summary is several
        // hundred bytes that would otherwise be copied into the box.
        let mut s = Box::write(
            Box::new_uninit(),
            Summary::new(req.api(), req.arrival(), status),
        );
        s.stream = req.is_stream();
        s.model = req.model_arc();
        s.request_id = Some(req.request_id().clone());
        s.client = req.client();
        if let Some(m) = meta {
            s.attempts = m.attempts;
            s.queued = m.queued;
            s.engine_request_id = Some(m.engine_id);
            s.trace = m.trace;
            s.encode = m.encode;
        }
        s
    }

    /// The client's response for `ex`: its head with the end-to-end headers, the
    /// request's id, how the KV reached the decode, the phase timings and the failing
    /// leg, and a [`PdBody`] that streams the answer and, when it ends, reports the
    /// attempt once.
    pub(super) fn respond(
        self: &Inner,
        req: &PdRequest,
        ex: Exchange,
        clock: Clock,
        meta: RequestMeta,
    ) -> Response<PdBody> {
        let Exchange {
            route,
            head,
            stand,
            timeline,
            returned,
        } = ex;
        // One match: the leg that answered, the outcome, the marks and what the body
        // holds. The decode's own 5xx is its failure, whatever its body, and its own 4xx
        // its refusal; a prefill's 4xx passed through ends the attempt as the prefill's
        // refusal.
        let decoded = !matches!(stand, Stand::PrefillRefused);
        let (parts, body) = relayable(req, &route, decoded, head);
        let status = parts.status;
        let (outcome, prefill, decode, mark, fallback, guard, late, pending) = match stand {
            // The prefill's refusal: no decode answered, no engine to blame. A decode
            // leg sent at once with the prefill's was dropped: abandoned.
            Stand::PrefillRefused => (
                Outcome::PrefillRefused,
                LegOutcome::Answered,
                unsent_or_abandoned(&timeline),
                None,
                None,
                None,
                None,
                None,
            ),
            Stand::PrefillAnswered { guard } => (
                Outcome::Success,
                LegOutcome::Answered,
                LegOutcome::NotSent,
                Some("prefill"),
                None,
                Some(guard),
                None,
                None,
            ),
            Stand::DecodeAlone { guard, fallback } => {
                let (outcome, decode) = head_end(status);
                let mark = if fallback.is_some() {
                    "decode-only"
                } else {
                    "direct"
                };
                let prefill = LegOutcome::NotSent;
                (
                    outcome,
                    prefill,
                    decode,
                    Some(mark),
                    fallback,
                    Some(guard),
                    None,
                    None,
                )
            }
            Stand::Decoded {
                mark,
                guard,
                prefill,
                late,
                pending,
            } => {
                let (outcome, decode) = head_end(status);
                (
                    outcome,
                    prefill,
                    decode,
                    Some(mark),
                    None,
                    Some(guard),
                    late,
                    pending,
                )
            }
        };
        let content_type = parts.headers.get(header::CONTENT_TYPE);
        let sse = content_type.is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        let scrub = sse || content_type.is_some_and(|v| scrubbed_type(v.as_bytes()));
        // Mid-stream migration: an eligible stream's body tracks its tokens (off: the
        // body is the decode's, as it always was).
        // Under a lead of the proxy's own, the stream's limits wait for the decode's
        // body: the KV gate, the head and an error head's message have budgets of their
        // own.
        let timer = guard.as_ref().and_then(|g| {
            let timer = StreamTimer::new(
                self.config.decode_idle_timeout,
                clock.deadline,
                g.endpoint().id(),
                late.as_ref().is_some_and(|l| l.lead),
            )?;
            // While a concurrent prefill still runs, the decode's silence is its wait for
            // the KV (vLLM sends its head before it loads it): the prefill's own budget
            // bounds that, and the idle time counts once it answered or a chunk came.
            Some(if pending.is_some() {
                timer.until_prefill()
            } else {
                timer
            })
        });
        // A migrating body holds the decode (its in-flight count, the router's place),
        // which it gives back when the decode's stream ends or is abandoned.
        let mut route = route;
        let (body, moved, guard) = match guard {
            Some(guard) if sse && status.is_success() => {
                // Continued through a fresh prefill only when this answer's KV came
                // from one.
                let disaggregated = mark == Some("kv");
                // The first leg's steps, for the report of its decode if it breaks.
                let steps = (&timeline, late.as_ref());
                self.migrating(
                    req,
                    &mut route,
                    &meta,
                    disaggregated,
                    disaggregated && prefill == LegOutcome::Answered,
                    clock,
                    body,
                    guard,
                    steps,
                )
            }
            guard => (body, None, guard),
        };
        // The decode was handed the prefill's KV: its 5xx head may be a lost KV load.
        let kv = mark == Some("kv");
        let mut report = Report::new(route, outcome, prefill, decode, timeline);
        report.kv_load_suspect =
            kv && prefill == LegOutcome::Answered && decode == LegOutcome::Failed;
        report.attempt = meta.attempts.saturating_sub(1);
        report.trace = meta.trace.clone();
        let summary = self.reporter.listening().then(|| {
            let mut s = self.summary(req, status, Some(meta));
            s.handoff = mark;
            s.fallback = fallback;
            s.route = Some(report.route.clone());
            s
        });
        let finish = Finish {
            guard,
            permit: None,
            in_flight: None,
            report: Some((Arc::clone(&self.reporter), report)),
            late,
            summary,
            first_chunk: None,
            first_byte: None,
            bytes: 0,
            // A completions stream relayed as it is must carry a choice's finish
            // reason, a Responses stream its output (a migrating one reads its own).
            answer: (sse && status.is_success() && moved.is_none() && outcome == Outcome::Success)
                .then(|| super::sign::AnswerSign::of(req.api()))
                .flatten(),
            moved,
            errors: None,
            kv,
            dropped_prefill: false,
        };
        let returned = returned.filter(|_| status.is_success());
        let body = PdBody::stream(body, sse, finish, pending, timer)
            .answering(req.api())
            .scrubbing(scrub)
            .capturing(returned);
        let mut resp = Response::new(body);
        *resp.status_mut() = status;
        *resp.headers_mut() = end_to_end(parts.headers);
        let h = resp.headers_mut();
        h.insert(REQUEST_ID, req.request_id().clone());
        match mark {
            Some(mark) => {
                h.insert(HANDOFF_HEADER, HeaderValue::from_static(mark));
                if let Some(v) = server_timing(&timeline) {
                    h.append(SERVER_TIMING, v);
                }
                if !status.is_success() {
                    h.insert(FAILED_LEG_HEADER, HeaderValue::from_static("decode"));
                }
            }
            None => {
                h.insert(FAILED_LEG_HEADER, HeaderValue::from_static("prefill"));
            }
        }
        if let Some(reason) = fallback {
            h.insert(FALLBACK_HEADER, HeaderValue::from_static(reason));
        }
        resp
    }
}

/// How an attempt whose decode leg answered `status` ended, and its decode leg: the
/// decode's own 5xx is its failure, whatever its body; its own 4xx (the client's fault)
/// its refusal, its leg answered, as [`decode_end`](super::report::decode_end) tells a
/// refusal that ends a stream.
fn head_end(status: http::StatusCode) -> (Outcome, LegOutcome) {
    if status.is_server_error() {
        (Outcome::DecodeFailed, LegOutcome::Failed)
    } else if status.is_client_error() {
        (Outcome::DecodeRefused, LegOutcome::Answered)
    } else {
        (Outcome::Success, LegOutcome::Answered)
    }
}
