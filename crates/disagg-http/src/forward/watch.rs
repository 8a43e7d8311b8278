//! An engine's answer to a forwarded or direct request on its way to the client
//! ([`EngineBody`]): the engine's places held until it ends, its idle time and the
//! request's deadline watched, and how it ended told to the request's summary and, as
//! the engine's doing, to passive health ([`Verdict`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Context;
use std::time::Duration;

use bytes::Bytes;
use disagg_core::endpoint::InFlightGuard;
use disagg_core::error::BoxError;
use disagg_core::json::{ErrorEvents, FinishReasons};
use disagg_core::outcome::{Delivery, LegOutcome};
use disagg_core::policy::Permit;
use disagg_core::request::Api;
use disagg_core::transport::BoxBody;
use disagg_core::{Endpoint, Orchestrator};
use http_body::{Body, Frame};
use http_body_util::BodyExt;

use crate::routed::RouteEnd;
use crate::tap::{Hooks, Tap};

/// How an engine did on a request sent to it alone, told once to the orchestrator's
/// listeners as an engine call ([`Orchestrator::engine_call`]; passive health hears
/// it): [`LegOutcome::Failed`] when the engine could not be reached, gave no head in
/// time after the client's body was in, answered 5xx or something unusable of its own
/// (not a redirect: the client's path was wrong), broke off or went silent in its
/// answer, or wrote an error event of its own naming a 5xx status in a 2xx event
/// stream; [`LegOutcome::Answered`] when its answer ended (an error event naming a 4xx,
/// or no status, ends it as a 4xx head does), which counts for the engine only when it
/// [`served`](Self::served) generation. Nothing when the client left, its
/// body failed, or the request's deadline passed: no fault of the engine's.
pub(super) struct Verdict {
    pub(super) orchestrator: Orchestrator,
    pub(super) endpoint: Arc<Endpoint>,
    /// The route kind (`forwarded`, `direct`): never the client's path.
    pub(super) call: &'static str,
    /// Whether the request was generation sent direct
    /// ([`EngineCall::served`](disagg_core::outcome::EngineCall::served)): an answer to
    /// anything else (whatever path a client forwarded: `/version`, a 404) says nothing
    /// of how the engine serves generation.
    pub(super) served: bool,
}

impl Verdict {
    pub(super) fn tell(self, outcome: LegOutcome) {
        self.orchestrator
            .engine_call(&self.endpoint, self.call, outcome, self.served);
    }
}

/// An engine's answer on its way to the client: holds the engine's place in the
/// in-flight count (and a direct request's admission permit) until it ends, and ends
/// with an error after `idle` without a frame.
pub(super) type EngineBody = Tap<BoxBody, EngineWatch>;

/// [`EngineBody`]'s own: the engine's place and the request's admission, the idle
/// timer, the request's summary and the engine's verdict until the answer ends.
pub(super) struct EngineWatch {
    _places: (InFlightGuard, Option<Permit>),
    idle: Option<(Duration, Pin<Box<tokio::time::Sleep>>)>,
    /// The request's deadline (generation sent direct): the answer ends there.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    route: Option<RouteEnd>,
    /// Told when the answer ends or breaks; dropped untold when the client leaves or
    /// the deadline passes. `None` when it was told at the head (a 5xx).
    verdict: Option<Verdict>,
    /// The watch for an error event the engine writes in a 2xx event stream.
    errors: Option<ErrorEvents>,
    /// The watch for a choice's finish reason in a 2xx completions event stream.
    finishes: Option<FinishReasons>,
}

/// What an engine's answer is watched for, beside its end.
pub(super) struct Watched {
    /// The answer is a 2xx event stream: an error event the engine writes in it is how
    /// the answer ends.
    pub(super) events: bool,
    /// The API the request's path serves, if any: a completions stream
    /// (`/v1/completions`) must carry a choice's finish reason, or it did not answer; in
    /// an SGLang `/generate` stream, an event whose finish reason is an abort ends the
    /// answer as an error event does ([`ErrorEvents::with_aborts`]).
    pub(super) api: Option<Api>,
}

impl EngineBody {
    /// `body`, watched for what `watched` says.
    pub(super) fn watch<B>(
        body: B,
        places: (InFlightGuard, Option<Permit>),
        (idle, deadline): (Option<Duration>, Option<tokio::time::Instant>),
        (route, verdict): (Option<RouteEnd>, Option<Verdict>),
        watched: Watched,
    ) -> Self
    where
        B: Body<Data = Bytes> + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        let told = watched.events && (route.is_some() || verdict.is_some());
        let mut watch = EngineWatch {
            _places: places,
            idle: idle.map(|d| (d, Box::pin(tokio::time::sleep(d)))),
            deadline: deadline.map(|d| Box::pin(tokio::time::sleep_until(d))),
            errors: told.then(|| match watched.api {
                Some(Api::Generate) => ErrorEvents::new().with_aborts(),
                _ => ErrorEvents::new(),
            }),
            finishes: (told && watched.api == Some(Api::Completions)).then(FinishReasons::new),
            route,
            verdict,
        };
        // An empty answer may never be polled: it has ended already.
        if body.is_end_stream() {
            watch.ended(Delivery::Complete);
        }
        Tap::new(body.map_err(Into::into).boxed(), watch)
    }
}

impl EngineWatch {
    /// The engine answered something: the idle time starts again.
    fn answered(&mut self) {
        // An idle time too large for the clock never ends (no panic).
        if let Some((d, sleep)) = &mut self.idle
            && let Some(next) = tokio::time::Instant::now().checked_add(*d)
        {
            sleep.as_mut().reset(next);
        }
    }

    /// The answer ended as `delivery` says, through the engine's doing: the summary
    /// and passive health are told (the engine answered when it is complete, failed
    /// when it broke).
    ///
    /// An answer that ended complete but carried the engine's error event is broken;
    /// the engine failed when the event names a 5xx status. A completions stream that
    /// ended complete with no choice's finish reason (and no error event) did not
    /// answer: broken, the engine's failure (vLLM's failed KV load ends so).
    fn ended(&mut self, delivery: Delivery) {
        let event = match delivery {
            Delivery::Complete => self.errors.as_mut().and_then(ErrorEvents::finish),
            _ => None,
        };
        let unfinished = delivery == Delivery::Complete
            && event.is_none()
            && self.finishes.as_ref().is_some_and(|w| !w.finished());
        let (delivery, outcome) = match (delivery, event) {
            (Delivery::Complete, None) if unfinished => (Delivery::Broken, LegOutcome::Failed),
            (Delivery::Complete, Some(e)) if e.is_server_error() => {
                (Delivery::Broken, LegOutcome::Failed)
            }
            (Delivery::Complete, Some(_)) => (Delivery::Broken, LegOutcome::Answered),
            (Delivery::Complete, None) => (Delivery::Complete, LegOutcome::Answered),
            (delivery, _) => (delivery, LegOutcome::Failed),
        };
        if let Some(r) = self.route.as_mut() {
            r.tell(delivery);
        }
        if let Some(v) = self.verdict.take() {
            v.tell(outcome);
        }
    }

    /// The request's deadline passed: the answer ends broken, no fault of the
    /// engine's.
    fn past_deadline(&mut self) -> Result<(), BoxError> {
        let Some(deadline) = &self.deadline else {
            return Ok(());
        };
        if tokio::time::Instant::now() < deadline.deadline() {
            return Ok(());
        }
        self.verdict = None;
        if let Some(r) = self.route.as_mut() {
            r.tell(Delivery::Broken);
        }
        Err("the request's deadline passed".into())
    }
}

impl Hooks<BoxBody> for EngineWatch {
    fn frame(&mut self, frame: &Frame<Bytes>, body: &BoxBody) -> Result<(), BoxError> {
        // An engine that streams without pause is cut at the deadline too.
        self.past_deadline()?;
        self.answered();
        if let Some(data) = frame.data_ref() {
            if let Some(w) = self.errors.as_mut() {
                w.watch(data);
            }
            if let Some(w) = self.finishes.as_mut() {
                w.watch(data);
            }
            if let Some(r) = self.route.as_mut() {
                r.summary.bytes += data.len() as u64;
            }
        }
        // The server stops polling a body that says it has ended.
        if body.is_end_stream() {
            self.ended(Delivery::Complete);
        }
        Ok(())
    }

    fn end(&mut self) {
        self.answered();
        self.ended(Delivery::Complete);
    }

    fn error(&mut self, _err: &BoxError) {
        self.answered();
        self.ended(Delivery::Broken);
    }

    fn pending(&mut self, cx: &mut Context<'_>) -> Result<(), BoxError> {
        if let Some(deadline) = &mut self.deadline
            && deadline.as_mut().poll(cx).is_ready()
        {
            return self.past_deadline();
        }
        if let Some((d, sleep)) = &mut self.idle
            && sleep.as_mut().poll(cx).is_ready()
        {
            let msg = format!("the engine sent nothing for {} ms", d.as_millis());
            self.ended(Delivery::Broken);
            return Err(msg.into());
        }
        Ok(())
    }
}
