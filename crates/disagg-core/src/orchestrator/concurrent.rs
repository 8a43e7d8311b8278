//! [`Dispatch::Concurrent`](crate::connector::Dispatch::Concurrent): both legs at once.
//!
//! The decode's head is relayed as soon as it arrives; a prefill still running then
//! rides in the response body, and its failure ends the stream. A prefill that fails
//! before the decode's head ends the attempt and drops the decode leg; a decode that
//! fails drops the prefill leg.
//!
//! [`Dispatch::Joined`] plans differ in one point: a decode head that came first waits
//! for the prefill's whole answer, which [`KvConnector::complete`](crate::connector::KvConnector::complete)
//! folds into the plan (the reshape of the decode's answer) before the head goes out.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::FutureExt;
use futures::future::{Either, select};

use crate::connector::{Dispatch, Handoff, PrefillAnswer};
use crate::error::{PdError, Phase, Side};
use crate::outcome::now;
use crate::outcome::{LegOutcome, Timeline};
use crate::request::PdRequest;
use crate::router::Route;

use super::Inner;
use super::attempt::Failure;
use super::body::PendingPrefill;
use super::clock::{Clock, within};
use super::legs::PrefillResult;
use super::respond::{Exchange, LateMarks, Stand};
use super::sequential::{prefill_refused, reshaped};

impl Inner {
    /// Send both legs at once and race them to the decode's head; for
    /// [`Dispatch::Joined`] the decode's head also waits for the prefill's whole answer,
    /// which the connector folds into the plan before the head is relayed.
    pub(super) async fn concurrent(
        &self,
        req: &PdRequest,
        mut route: Route,
        mut handoff: Handoff,
        clock: Clock,
        tl: &mut Timeline,
    ) -> Result<Exchange, Failure> {
        let start = now();
        tl.prefill_sent = Some(start);
        tl.decode_sent = Some(start);
        let joined = handoff.dispatch == Dispatch::Joined;
        // Boxed: the race needs them pinned, and the prefill may move into the body.
        let prefill = super::pin_in_place(|| {
            self.prefill(req, &handoff.prefill, route.take_prefill_hold(), clock)
        });
        let guard = handoff.decode.endpoint.track();
        let decode = super::pin_in_place(|| self.decode_head(req, &handoff.decode, clock));
        let (head, pending, prefilled, answer) = match select(prefill, decode).await {
            // The prefill ended first: a failure ends the attempt (dropping the decode
            // leg); a success leaves the decode to finish.
            Either::Left((p, decode)) => match p {
                Ok(PrefillResult::Answer(a)) => {
                    tl.prefill_done = Some(now());
                    (decode.await, None, LegOutcome::Answered, Some(a))
                }
                Ok(PrefillResult::ClientError {
                    status,
                    headers,
                    body,
                    ..
                }) => return Ok(prefill_refused(route, status, headers, body)),
                Err(e) => return Err(Failure::prefill(&route, e, LegOutcome::Abandoned)),
            },
            // A joined plan's decode answered first: its head waits for the prefill's
            // whole answer (only a decode that answered well needs it).
            Either::Right((d, prefill)) if joined && d.as_ref().is_ok_and(success) => {
                match prefill.await {
                    Ok(PrefillResult::Answer(a)) => {
                        tl.prefill_done = Some(now());
                        (d, None, LegOutcome::Answered, Some(a))
                    }
                    Ok(PrefillResult::ClientError {
                        status,
                        headers,
                        body,
                        ..
                    }) => return Ok(prefill_refused(route, status, headers, body)),
                    Err(e) => return Err(Failure::prefill(&route, e, LegOutcome::Abandoned)),
                }
            }
            // The decode's head came first: relay it now, the prefill rides along.
            Either::Right((d, prefill)) => (d, Some(prefill), LegOutcome::Abandoned, None),
        };
        let head = head.map_err(|e| Failure::decode(&route, e, prefilled))?;
        tl.decode_head = Some(now());
        let success = head.status().is_success();
        if let (true, true, Some(answer)) = (joined, success, &answer) {
            self.fold(&mut handoff, answer, clock)
                .await
                .map_err(|e| Failure::prefill(&route, e, LegOutcome::Abandoned))?;
        }
        let head = if success {
            reshaped(&handoff, head)
        } else {
            head
        };
        // A decode that answered an error needs no KV: the prefill leg is dropped.
        let marks = Arc::new(LateMarks::default());
        let marked = Arc::clone(&marks);
        let pending: Option<PendingPrefill> = pending.filter(|_| success).map(|p| {
            Box::pin(p.map(move |r| {
                let _ = marked.prefill_done.set(now());
                let r = r.and_then(PrefillResult::into_late);
                if r.is_ok() {
                    marked.prefill_answered.store(true, Ordering::Relaxed);
                }
                r
            })) as PendingPrefill
        });
        let stand = Stand::Decoded {
            mark: "kv",
            guard,
            prefill: prefilled,
            late: pending.is_some().then_some(marks),
            pending,
        };
        Ok(Exchange::new(route, head, stand))
    }

    /// A joined plan: fold the prefill's `answer` into it, within the handoff budget.
    async fn fold(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
        clock: Clock,
    ) -> Result<(), PdError> {
        let prefill_ep = Arc::clone(&handoff.prefill.endpoint);
        let complete = async {
            self.connector
                .complete(handoff, answer)
                .await
                .map_err(|e| PdError::connector(Side::Prefill, e))
        };
        let budget = self.config.handoff_timeout;
        within(
            clock,
            budget,
            Side::Prefill,
            &prefill_ep,
            Phase::Handoff,
            complete,
        )
        .await
        .map(drop)
    }
}

/// Whether a decode's head is a success.
fn success(head: &http::Response<crate::transport::BoxBody>) -> bool {
    head.status().is_success()
}
