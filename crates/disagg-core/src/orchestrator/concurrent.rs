//! [`Dispatch::Concurrent`](crate::connector::Dispatch::Concurrent): both legs at once.
//!
//! The decode's head is relayed as soon as it arrives; a prefill still running then
//! rides in the response body, and its failure ends the stream. A prefill that fails
//! before the decode's head ends the attempt and drops the decode leg; a decode that
//! fails drops the prefill leg.

use std::time::Instant;

use futures::FutureExt;
use futures::future::{Either, select};

use crate::connector::Handoff;
use crate::outcome::Verdict;
use crate::request::PdRequest;
use crate::router::Route;

use super::Inner;
use super::attempt::Failure;
use super::body::PendingPrefill;
use super::clock::{Clock, Timing};
use super::legs::PrefillResult;
use super::respond::Exchange;
use super::sequential::{prefill_refused, reshaped};

impl Inner {
    /// Send both legs at once and race them to the decode's head.
    pub(super) async fn concurrent(
        &self,
        req: &PdRequest,
        route: Route,
        handoff: Handoff,
        clock: Clock,
    ) -> Result<Exchange, Failure> {
        let start = Instant::now();
        let mut timing = Timing::default();
        // Boxed: the race needs them pinned, and the prefill may move into the body.
        let prefill = Box::pin(self.prefill(req, &handoff.prefill, clock));
        let guard = handoff.decode.endpoint.track();
        let decode_start = Instant::now();
        let decode = Box::pin(self.decode_head(req, &handoff.decode, clock));
        let (head, pending, prefilled) = match select(prefill, decode).await {
            // The prefill ended first: a failure ends the attempt (dropping the decode
            // leg); a success leaves the decode to finish.
            Either::Left((p, decode)) => match p {
                Ok(PrefillResult::Answer(_)) => {
                    timing.prefill = Some(start.elapsed());
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
        timing.decode_head = Some(decode_start.elapsed());
        let success = head.status().is_success();
        let head = if success {
            reshaped(&handoff, head)
        } else {
            head
        };
        // A decode that answered an error needs no KV: the prefill leg is dropped.
        let pending: Option<PendingPrefill> = pending
            .filter(|_| success)
            .map(|p| Box::pin(p.map(|r| r.and_then(PrefillResult::into_late))) as PendingPrefill);
        let mut ex = Exchange::new(route, head);
        ex.mark = Some("kv");
        ex.timing = timing;
        ex.guard = Some(guard);
        ex.prefill = prefilled;
        ex.pending = pending;
        ex.decode_sent = true;
        Ok(ex)
    }
}
