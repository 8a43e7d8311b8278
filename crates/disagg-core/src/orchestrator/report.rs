//! The one place a [`Report`] is told (to the router's and the connector's `observe`,
//! then to every [`Listener`]), and a [`Summary`].

use std::fmt;
use std::sync::Arc;

use crate::connector::KvConnector;
use crate::endpoint::EndpointId;
use crate::error::PdError;
use crate::outcome::{EngineCall, LegOutcome, Listener, Outcome, Report, Summary, Timeline};
use crate::router::Router;

/// Who hears how each attempt ended.
pub(crate) struct Reporter {
    pub(crate) router: Arc<dyn Router>,
    pub(crate) connector: Arc<dyn KvConnector>,
    pub(crate) listeners: Vec<Arc<dyn Listener>>,
}

impl fmt::Debug for Reporter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reporter")
            .field("listeners", &self.listeners.len())
            .finish_non_exhaustive()
    }
}

impl Reporter {
    /// Tell everyone how an attempt ended (its phases filled for the listeners).
    pub(crate) fn report(&self, report: &mut Report) {
        if self.listening() {
            report.phases = report.timeline.phases();
        }
        self.router.observe(&report.route, report.outcome);
        self.connector.observe(&report.route, report.outcome);
        for l in &self.listeners {
            l.on_report(report);
        }
    }

    /// Whether anyone hears summaries: without listeners none is made.
    pub(crate) fn listening(&self) -> bool {
        !self.listeners.is_empty()
    }

    /// Tell every listener how a request ended.
    pub(crate) fn summarize(&self, summary: &mut Summary) {
        summary.finish();
        for l in &self.listeners {
            l.on_request(summary);
        }
    }

    /// Tell every listener how a call of an engine outside the legs ended.
    pub(crate) fn engine_call(&self, call: &EngineCall) {
        for l in &self.listeners {
            l.on_engine_call(call);
        }
    }
}

/// How the leg that failed with `e` ended, its engine being `engine` (none: a prefill
/// leg of a route without one): an engine that answered 4xx worked (the request was the
/// client's fault); a connector's error blames the engine only when it is that engine's
/// fault ([`ConnectorError::blames`](crate::error::ConnectorError::blames): an answer of
/// its without a usable handoff, its bootstrap server, a call on it), not when it is the
/// configuration's, the proxy's, the client's or another engine's; otherwise its engine
/// is to blame when the error is a server error that is not the request's own deadline
/// (it could not be reached, failed, timed out on its own budget, or answered something
/// unusable); the deadline, or a client's error, blames no engine.
pub(crate) fn leg_outcome(e: &PdError, engine: Option<&EndpointId>) -> LegOutcome {
    if e.engine_status().is_some_and(|s| s.is_client_error()) {
        LegOutcome::Answered
    } else if e.status().is_server_error()
        && !e.is_deadline()
        && e.connector_blames(engine) != Some(false)
    {
        LegOutcome::Failed
    } else {
        LegOutcome::Abandoned
    }
}

/// How an attempt that ended on its prefill side with `error` ended, its prefill leg
/// judged `verdict` by [`leg_outcome`]: [`Outcome::PrefillRefused`] when the request was
/// refused as the client's fault: the prefill answered (a 4xx: no engine's fault), or
/// the error is the client's own (a 4xx of the proxy's: the connector's refusal,
/// `Unsupported`, before any leg was sent; not a full queue); else
/// [`Outcome::PrefillFailed`]. The one rule for a refusal passed through, one that ends
/// a stream whose decode began (both legs at once), a failed attempt's, and a
/// continuation's fresh prefill's.
pub(super) fn prefill_end(error: &PdError, verdict: LegOutcome) -> Outcome {
    // A full queue (429) is overload, not a refusal: it alone of the 4xx says when to
    // come back.
    let clients = error.status().is_client_error() && error.retry_after().is_none();
    if verdict == LegOutcome::Answered || clients {
        Outcome::PrefillRefused
    } else {
        Outcome::PrefillFailed
    }
}

/// How an attempt that ended on its decode side ended, its decode leg judged `verdict`
/// by [`leg_outcome`]: [`Outcome::DecodeRefused`] when the decode answered a 4xx (the
/// client's fault: its leg answered), else [`Outcome::DecodeFailed`]. The one rule for a
/// refusal that ends a stream begun before the decode leg was sent (a plan's lead), a
/// failed attempt's (a migration's continuation through a fresh prefill), and a stream
/// that broke; a decode head relayed as it came is judged by its status alike
/// (`respond`).
pub(super) fn decode_end(verdict: LegOutcome) -> Outcome {
    if verdict == LegOutcome::Answered {
        Outcome::DecodeRefused
    } else {
        Outcome::DecodeFailed
    }
}

/// The prefill leg of an attempt that failed, judged `verdict` by [`leg_outcome`], told
/// as far as it went by the attempt's steps `tl` when its engine is not blamed: a leg
/// never sent (the plan failed before it, in the connector's build or resolution, or
/// the request's deadline passed first) is [`LegOutcome::NotSent`]. One that was sent
/// stays [`LegOutcome::Abandoned`], its engine's answer in or not: a handoff that failed
/// after the prefill's answer, for a reason not its engine's (the KV gate, `complete`),
/// left its KV computed and never pulled, which is no success of the engine's either
/// (passive health counts an answered leg as one). A failed leg stays failed.
pub(crate) fn as_far_as_it_went(verdict: LegOutcome, tl: &Timeline) -> LegOutcome {
    match (verdict, tl.prefill_sent) {
        (LegOutcome::Abandoned, None) => LegOutcome::NotSent,
        (verdict, _) => verdict,
    }
}

/// A decode leg that did not finish, as far as it went by the attempt's steps `tl`:
/// [`LegOutcome::NotSent`] when it was never sent (a lead stream whose gate failed, or
/// whose client left, before it; a prefill refusing alone), else
/// [`LegOutcome::Abandoned`].
pub(super) fn unsent_or_abandoned(tl: &Timeline) -> LegOutcome {
    match tl.decode_sent {
        None => LegOutcome::NotSent,
        Some(_) => LegOutcome::Abandoned,
    }
}
