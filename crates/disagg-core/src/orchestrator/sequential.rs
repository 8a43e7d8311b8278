//! [`Dispatch::AfterPrefill`](crate::connector::Dispatch::AfterPrefill): the prefill
//! leg, its answer folded into the decode leg, then the decode leg.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{HeaderMap, Response, StatusCode};

use crate::connector::{Handoff, HandoffFound};
use crate::endpoint::InFlightGuard;
use crate::error::{ConnectorError, PdError, Phase, Side};
use crate::outcome::now;
use crate::outcome::{LegOutcome, Timeline};
use crate::request::PdRequest;
use crate::router::Route;
use crate::transport::BoxBody;

use super::Inner;
use super::attempt::Failure;
use super::body::empty_body;
use super::clock::{Clock, out_of_time};
use super::config::{KvRelease, MissingKv};
use super::lead::{LeadBody, PendingDecode};
use super::legs::{PrefillResult, error_message, kv_ready, send_decode, sse_head};
use super::release::{KvHold, Release};
use super::respond::{Exchange, LateMarks, Stand};
use super::stats::bump;

impl Inner {
    /// Prefill, fold its answer into the decode leg, then decode.
    pub(super) async fn sequential(
        &self,
        req: &PdRequest,
        mut route: Route,
        mut handoff: Handoff,
        clock: Clock,
        tl: &mut Timeline,
    ) -> Result<Exchange, Failure> {
        tl.prefill_sent = Some(now());
        // Timed here rather than inside: a prefill out of time stays with the hold,
        // whose release may still catch its answer.
        let exchange = self.exchange(req, &handoff.prefill, route.take_prefill_hold());
        let mut hold = KvHold::new(Box::pin(exchange), self.release(req, &handoff));
        let (budget, by_deadline) = clock.budget(self.config.prefill_timeout);
        let result = hold.prefill(budget).await.unwrap_or_else(|| {
            let ep = &handoff.prefill.endpoint;
            Err(out_of_time(by_deadline, Side::Prefill, ep, Phase::Prefill))
        });
        let answer = match result {
            Ok(PrefillResult::Answer(a)) => a,
            Ok(PrefillResult::ClientError {
                status,
                headers,
                body,
                ..
            }) => return Ok(prefill_refused(route, status, headers, body)),
            Err(e) => {
                if e.never_sent()
                    && let Some(to) = &handoff.returned
                {
                    // The prefill never got what the plan took for it.
                    to.unsent();
                }
                return Err(Failure::prefill(&route, e, LegOutcome::NotSent));
            }
        };
        let prefilled = now();
        tl.prefill_done = Some(prefilled);
        tl.handoff_start = Some(prefilled);
        let budget = self.config.handoff_timeout;
        let handed = hold
            .complete(&*self.connector, &mut handoff, &answer, clock, budget)
            .await;
        let mark = match handed {
            Ok(HandoffFound::Handed) => "kv",
            Ok(HandoffFound::Finished) => return Ok(finished(req, route, handoff)),
            Ok(outcome) => match self.missing_handoff(req, &handoff, outcome) {
                Ok(mark) => mark,
                Err(e) => return Err(Failure::prefill(&route, e, LegOutcome::NotSent)),
            },
            Err(e) => return Err(Failure::prefill(&route, e, LegOutcome::NotSent)),
        };
        if req.is_stream() && handoff.lead.is_some() {
            // The client's stream starts now; the gate and the decode's head are waited
            // for inside its body, which takes the hold along.
            return self.lead_stream(req, route, handoff, hold, mark, clock);
        }
        if handoff.gate.is_some()
            && let Err(e) = kv_ready(&handoff, clock, budget).await
        {
            // The hold drops with this attempt and releases the KV when asked to.
            return Err(Failure::prefill(&route, e, LegOutcome::NotSent));
        }
        let guard = handoff.decode.endpoint.track();
        tl.decode_sent = Some(now());
        let head = match self.decode_head(req, &handoff.decode, clock).await {
            Ok(h) => h,
            Err(e) => return Err(Failure::decode(&route, e, LegOutcome::Answered)),
        };
        tl.decode_head = Some(now());
        let head = if head.status().is_success() {
            // The KV is the engine's once its answer's first frame came (a gated plan's,
            // pushed to the decode, which takes it from its own buffer before its first
            // token, at its head: a release leg after that would find none and compute
            // the prompt for a client gone).
            let head = if handoff.gate.is_some() {
                hold.taken();
                head
            } else {
                head.map(|body| hold.until_first_frame(body))
            };
            reshaped(&handoff, head)
        } else {
            // The decode refused its leg and took no KV: `hold` drops below and releases
            // it when asked to.
            head
        };
        let mut ex = decoded(route, head, mark, guard, None);
        ex.returned = handoff.returned.take();
        Ok(ex)
    }

    /// A prefill answer without a usable handoff ([`HandoffFound::Missing`], or
    /// [`HandoffFound::Incomplete`], which is also counted and named in the log): the
    /// decode leg goes without one (`"none"`) or the request fails, as
    /// [`MissingKv`] says. The decode leg is left as `prepare` made it either way:
    /// nothing of an incomplete handoff reaches the decode.
    fn missing_handoff(
        &self,
        req: &PdRequest,
        handoff: &Handoff,
        outcome: HandoffFound,
    ) -> Result<&'static str, PdError> {
        let prefill = handoff.prefill.endpoint.id();
        let incomplete = match outcome {
            HandoffFound::Incomplete { problem } => {
                bump(&self.counters.invalid_handoffs);
                tracing::warn!(
                    request_id = ?req.request_id(),
                    %prefill,
                    problem,
                    "prefill returned an incomplete KV handoff; it is not sent to the decode"
                );
                Some(problem)
            }
            _ => None,
        };
        if self.config.missing_kv == MissingKv::LocalPrefill {
            tracing::warn!(
                request_id = ?req.request_id(),
                %prefill,
                "prefill returned no KV handoff; decode computes the prompt itself"
            );
            return Ok("none");
        }
        let endpoint = prefill.clone();
        let e = match incomplete {
            Some(problem) => ConnectorError::IncompleteHandoff {
                endpoint,
                field: "kv_transfer_params",
                problem,
            },
            None => ConnectorError::MissingHandoff {
                endpoint,
                field: "kv handoff",
            },
        };
        Err(PdError::connector(Side::Prefill, e))
    }

    /// What an early release of this request's KV needs, when it is on.
    fn release(&self, req: &PdRequest, handoff: &Handoff) -> Option<Release> {
        match self.config.kv_release {
            KvRelease::Off => None,
            KvRelease::AbortDecode { grace, wait } => Some(Release {
                received: req.received_len(),
                grace,
                wait,
                handoff: handoff.clone(),
                api: req.api(),
                connector: Arc::clone(&self.connector),
                transport: Arc::clone(&self.transport),
                counters: Arc::clone(&self.counters),
            }),
        }
    }

    /// A streaming answer that starts with the plan's lead as soon as the prefill
    /// answered: the body then waits for the gate (within the handoff budget), sends the
    /// decode leg (within the decode-head budget) and forwards the decode's answer,
    /// reshaped as the plan says. A failure from here on can only end the stream, with an
    /// error event carrying its code.
    #[allow(clippy::too_many_arguments)] // private; the attempt's parts, moved in
    fn lead_stream(
        &self,
        req: &PdRequest,
        route: Route,
        mut handoff: Handoff,
        hold: KvHold,
        mark: &'static str,
        clock: Clock,
    ) -> Result<Exchange, Failure> {
        let lead = handoff.lead.take().unwrap_or_default();
        let http_req = self
            .leg_request(req, &handoff.decode)
            .map_err(|e| Failure::decode(&route, e, LegOutcome::Answered))?;
        let guard = handoff.decode.endpoint.track();
        let transport = Arc::clone(&self.transport);
        let (gate_budget, head_budget) =
            (self.config.handoff_timeout, self.config.decode_head_timeout);
        let limit = self.config.max_prefill_answer;
        let marks = Arc::new(LateMarks {
            lead: true,
            ..LateMarks::default()
        });
        let marked = Arc::clone(&marks);
        let pending: PendingDecode = Box::pin(async move {
            kv_ready(&handoff, clock, gate_budget).await?;
            let _ = marked.decode_sent.set(now());
            let decode_ep = &handoff.decode.endpoint;
            let sent = tokio::time::Instant::now();
            let head = send_decode(&*transport, http_req, decode_ep, clock, head_budget).await?;
            let _ = marked.decode_head.set(now());
            if !head.status().is_success() {
                // Its message within what is left of the head's budget (and the
                // deadline): a body that never ends holds neither stream nor count.
                let (left, _) = clock.budget(head_budget.saturating_sub(sent.elapsed()));
                let (parts, body) = head.into_parts();
                return Err(PdError::upstream_status(
                    Side::Decode,
                    decode_ep.id().clone(),
                    parts.status,
                    error_message(body, limit, left).await,
                ));
            }
            // A gated plan's KV was pushed to the decode, which takes it from its own
            // buffer before its first token: taken at the head (a release leg after that
            // would find none and compute the prompt for a client gone).
            hold.taken();
            // The decode's body flows from here: its idle time counts from now.
            marked.decode_flowing.store(true, Ordering::Relaxed);
            Ok(reshaped(&handoff, head).into_body())
        });
        let body = BoxBody::new(LeadBody::deferred(lead, pending));
        Ok(decoded(route, sse_head(body), mark, guard, Some(marks)))
    }
}

/// The prefill's own 4xx, the client's fault, passed through as the engine wrote it.
pub(super) fn prefill_refused(
    route: Route,
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
) -> Exchange {
    let mut head = Response::new(BoxBody::new(
        http_body_util::Full::new(body).map_err(|never| match never {}),
    ));
    *head.status_mut() = status;
    *head.headers_mut() = headers;
    Exchange::new(route, head, Stand::PrefillRefused)
}

/// The decode's answer after the prefill's, the KV having reached it as `mark`.
fn decoded(
    route: Route,
    head: Response<BoxBody>,
    mark: &'static str,
    guard: InFlightGuard,
    late: Option<Arc<LateMarks>>,
) -> Exchange {
    let stand = Stand::Decoded {
        mark,
        guard,
        prefill: LegOutcome::Answered,
        late,
        pending: None,
    };
    Exchange::new(route, head, stand)
}

/// The answer when the prefill's is the whole answer ([`HandoffFound::Finished`]): no
/// decode leg; the plan's reshape makes the client's answer from an empty body.
fn finished(req: &PdRequest, route: Route, mut handoff: Handoff) -> Exchange {
    let guard = handoff.decode.endpoint.track();
    let lead = handoff.lead.take().filter(|_| req.is_stream());
    let content_type = if req.is_stream() {
        "text/event-stream"
    } else {
        "application/json"
    };
    let body = match &handoff.reshape {
        Some(r) => r.body(empty_body()),
        None => empty_body(),
    };
    let mut shaped = Response::new(body);
    shaped
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    let head = match lead {
        Some(lead) => sse_head(BoxBody::new(LeadBody::then(lead, shaped.into_body()))),
        None => shaped,
    };
    Exchange::new(route, head, Stand::PrefillAnswered { guard })
}

/// A 2xx decode answer in the form the plan asks for: its body reshaped, its content
/// length dropped (it no longer holds).
pub(super) fn reshaped(handoff: &Handoff, head: Response<BoxBody>) -> Response<BoxBody> {
    let Some(reshape) = &handoff.reshape else {
        return head;
    };
    let (mut parts, body) = head.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, reshape.body(body))
}

use http_body_util::BodyExt as _;
