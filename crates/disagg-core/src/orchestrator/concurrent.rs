//! [`Dispatch::Concurrent`](crate::connector::Dispatch::Concurrent): both legs at once.
//!
//! The decode's head is relayed as soon as it arrives; a prefill still running then
//! rides in the response body, and its failure ends the stream. A prefill that fails
//! before the decode's head ends the attempt and drops the decode leg; a decode that
//! fails drops the prefill leg.

use std::sync::Arc;

use futures::FutureExt;
use futures::future::{Either, select};

use crate::connector::Handoff;
use crate::outcome::now;
use crate::outcome::{Timeline, Verdict};
use crate::request::PdRequest;
use crate::router::Route;

use super::Inner;
use super::attempt::Failure;
use super::body::PendingPrefill;
use super::clock::Clock;
use super::legs::PrefillResult;
use super::respond::{Exchange, LateMarks};
use super::sequential::{prefill_refused, reshaped};

impl Inner {
    /// Send both legs at once and race them to the decode's head.
    pub(super) async fn concurrent(
        &self,
        req: &PdRequest,
        route: Route,
        handoff: Handoff,
        clock: Clock,
        tl: &mut Timeline,
    ) -> Result<Exchange, Failure> {
        let start = now();
        tl.prefill_sent = Some(start);
        tl.decode_sent = Some(start);
        // Boxed: the race needs them pinned, and the prefill may move into the body.
        let prefill = Box::pin(self.prefill(req, &handoff.prefill, clock));
        let guard = handoff.decode.endpoint.track();
        let decode = Box::pin(self.decode_head(req, &handoff.decode, clock));
        let (head, pending, prefilled) = match select(prefill, decode).await {
            // The prefill ended first: a failure ends the attempt (dropping the decode
            // leg); a success leaves the decode to finish.
            Either::Left((p, decode)) => match p {
                Ok(PrefillResult::Answer(_)) => {
                    tl.prefill_done = Some(now());
                    (decode.await, None, Verdict::Answered)
                }
                Ok(PrefillResult::ClientError {
                    status,
                    headers,
                    body,
                    ..
                }) => return Ok(prefill_refused(route, status, headers, body)),
                Err(e) => return Err(Failure::prefill(&route, e, Verdict::Abandoned)),
            },
            // The decode's head came first: relay it now, the prefill rides along.
            Either::Right((d, prefill)) => (d, Some(prefill), Verdict::Abandoned),
        };
        let head = head.map_err(|e| Failure::decode(&route, e, prefilled))?;
        tl.decode_head = Some(now());
        let success = head.status().is_success();
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
                r.and_then(PrefillResult::into_late)
            })) as PendingPrefill
        });
        let mut ex = Exchange::new(route, head);
        if pending.is_some() {
            ex.late = Some(marks);
        }
        ex.mark = Some("kv");
        ex.guard = Some(guard);
        ex.prefill = prefilled;
        ex.pending = pending;
        ex.decode_sent = true;
        Ok(ex)
    }
}
