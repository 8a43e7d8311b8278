//! The encoder stage's legs: sent concurrently over the encoder pool, each retried on
//! another encoder when it failed, the whole stage within its budget; the answers folded
//! into the request the P → D handoff then carries.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use bytes::Bytes;
use http::HeaderValue;
use tokio::time::Instant as TokioInstant;

use crate::connector::Leg;
use crate::encode::{EncodeLeg, EncodeStage, item_refused, retryable_status};
use crate::endpoint::Endpoint;
use crate::error::{PdError, Phase, Side, TransportError};
use crate::outcome::{EncodeSummary, EngineCall, LegOutcome, TraceIds};
use crate::request::{Api, PdRequest};
use crate::router::Route;
use crate::transport::read_limited;
use disagg_json::JsonBody;
use disagg_json::{BodyError, InvalidParam};

use super::Inner;
use super::clock::Clock;
use super::legs::upstream_message;

impl Inner {
    /// Run `stage` for `req` (which [`EncodeStage::wants`]) over the encoders `pool`
    /// (not empty): its media items encoded, and the encoders' answers folded into its
    /// body. Every leg is dropped when this future is.
    ///
    /// The encoder legs carry `engine_id` (an id of the proxy's, never the client's
    /// `x-request-id`: see `decode_alone`), each with `-enc<leg>` after it. `prior`, a
    /// stage this request already went through (run again for a decode-only fallback
    /// whose decode the first stage's items never reached), is continued: its span,
    /// start and items.
    // The stage's inputs, each from a different place in `serve`.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn encode(
        &self,
        stage: &EncodeStage,
        pool: &[Arc<Endpoint>],
        req: &mut PdRequest,
        consumer: Option<&mut Route>,
        clock: Clock,
        trace: Option<&TraceIds>,
        engine_id: &HeaderValue,
        prior: Option<&EncodeSummary>,
    ) -> Result<Option<EncodeSummary>, PdError> {
        let planned = match &consumer {
            // A push protocol: the consumer chosen first is named to the encoders.
            Some(route) => {
                let (engine, rank) = match &route.prefill {
                    Some(p) => (p, route.prefill_rank.or(p.rank())),
                    None => (&route.decode, route.decode_rank.or(route.decode.rank())),
                };
                stage.connector.plan_for(req, engine, rank)
            }
            None => stage.connector.plan(req),
        };
        let plan = match planned {
            Ok(Some(plan)) if !plan.legs.is_empty() => plan,
            Ok(_) => return Ok(None),
            Err(e) => return Err(PdError::body(BodyError::Invalid(e))),
        };
        // The rank the connector planned for, the route naming none: the consumer leg
        // is pinned to it, or the engine would place the request on a rank of its own
        // choice, where the items never arrive.
        if let (Some(route), Some(rank)) = (consumer, plan.rank) {
            match route.prefill {
                Some(_) => route.prefill_rank = Some(rank),
                None => route.decode_rank = Some(rank),
            }
        }
        let c = &stage.counters;
        // A stage run again is the same request's.
        if prior.is_none() {
            c.requests.fetch_add(1, Relaxed);
        }
        let plan_items = plan.items();
        c.items.fetch_add(plan_items as u64, Relaxed);
        let started = crate::outcome::now();
        // One span for the stage (a stage run again keeps its first run's); its legs
        // carry it as their parent.
        let span = match prior {
            Some(p) => p.span.or_else(|| trace.map(|_| self.spans.span())),
            None => trace.map(|_| self.spans.span()),
        };
        let traced = trace.zip(span.as_ref());
        // The stage's budget bounds every leg's tries: each try gets its share of what
        // is left (see `encode_leg`), so a hung encoder is given up in time for the
        // next to be tried, and is blamed.
        let (budget, by_deadline) = clock.budget(stage.config.timeout);
        let until = Until {
            end: TokioInstant::now().checked_add(budget),
            by_deadline,
        };
        let legs = plan.legs.iter().enumerate().map(|(i, leg)| {
            let id = leg_id(engine_id, i);
            self.encode_leg(stage, pool, req, id, leg, traced, until)
        });
        let all = futures::future::try_join_all(legs);
        // Every leg ends by `until.end` on its own; this only guards against a leg
        // polled past it (a busy runtime).
        let guard = budget.saturating_add(GRACE);
        let result = match tokio::time::timeout(guard, all).await {
            Ok(Ok(answers)) => stage
                .connector
                .fold(&plan, &answers)
                .map_err(|e| PdError::connector(Side::Encode, e)),
            Ok(Err(e)) => Err(e),
            Err(_) if by_deadline => Err(PdError::deadline(Side::Encode, Phase::Encode)),
            Err(_) => Err(match pool.first() {
                Some(ep) => PdError::timeout(Side::Encode, ep.id().clone(), Phase::Encode),
                None => PdError::deadline(Side::Encode, Phase::Encode),
            }),
        };
        let elapsed = started.elapsed();
        c.micros.fetch_add(elapsed.as_micros() as u64, Relaxed);
        let fields = match result {
            Ok(fields) => fields,
            Err(e) => {
                c.failures.fetch_add(1, Relaxed);
                tracing::warn!(
                    request_id = ?req.request_id(),
                    error = %crate::error::error_chain(&e),
                    "encoder stage failed"
                );
                return Err(e);
            }
        };
        let body = req.body_mut();
        for (key, raw) in plan.fields.into_iter().chain(fields) {
            body.set_raw(key, raw);
        }
        let items = u32::try_from(plan_items).unwrap_or(u32::MAX);
        Ok(Some(match prior {
            Some(p) => EncodeSummary {
                items: p.items.saturating_add(items),
                duration: p.started.elapsed(),
                started: p.started,
                span,
            },
            None => EncodeSummary {
                items,
                duration: elapsed,
                started,
                span,
            },
        }))
    }

    /// One encoder leg: tried on the least loaded encoder, then, when it failed for a
    /// reason another encoder may not have, on the next ones, within the stage's
    /// attempts. Its answer's body, 2xx.
    ///
    /// Each try has its fair share of the stage's time left (`until`), what is left
    /// divided by the tries left: an encoder that does not answer within it (hung, or
    /// too slow) failed, is passed over, and the leg goes to the next encoder; the last
    /// try has all that is left. Cut by the request's own deadline, the encoder is not
    /// blamed.
    // The leg's inputs; `until` is shared by the stage's legs.
    #[allow(clippy::too_many_arguments)]
    async fn encode_leg(
        &self,
        stage: &EncodeStage,
        pool: &[Arc<Endpoint>],
        req: &PdRequest,
        id: Option<HeaderValue>,
        leg: &EncodeLeg,
        traced: Option<(&TraceIds, &[u8; 8])>,
        until: Until,
    ) -> Result<Bytes, PdError> {
        let n = pool.len();
        let tries = stage.config.attempts.clamp(1, n.max(1));
        let first = stage.first(pool);
        let mut last = None;
        for t in 0..tries {
            let i = (first + t) % n.max(1);
            let Some(ep) = pool.get(i) else {
                break;
            };
            if t > 0 {
                stage.counters.retries.fetch_add(1, Relaxed);
            }
            let share = until.share(tries - t);
            if share.is_some_and(|s| s.is_zero()) {
                // Nothing left for this try: the stage ran out (its budget or the
                // request's deadline) with the previous one.
                break;
            }
            stage.counters.legs.fetch_add(1, Relaxed);
            let _guard = ep.track();
            let mut http_leg = Leg::new(Arc::clone(ep), JsonBody::default());
            http_leg.api = Some(Api::Chat);
            if let Some(id) = &id {
                http_leg
                    .headers
                    .insert(crate::request::REQUEST_ID, id.clone());
            }
            if let Some((t, span)) = traced {
                t.inject(span, &mut http_leg.headers);
            }
            let http_req = self.leg_request_with(req, &http_leg, leg.body.clone(), Side::Encode)?;
            let limit = stage.config.max_answer_bytes;
            let exchange = async {
                let resp = self.transport.send(http_req).await?;
                let status = resp.status();
                let body = read_limited(resp.into_body(), limit)
                    .await
                    .map_err(TransportError::Io)?;
                Ok::<_, TransportError>((status, body))
            };
            let answered = match share {
                Some(share) => tokio::time::timeout(share, exchange).await,
                None => Ok(exchange.await),
            };
            let err = match answered {
                Err(_) if until.by_deadline && until.over() => {
                    // The request's deadline ended the try: nobody's fault.
                    self.encoder_call(ep, LegOutcome::Abandoned);
                    return Err(PdError::deadline(Side::Encode, Phase::Encode));
                }
                Err(_) => PdError::timeout(Side::Encode, ep.id().clone(), Phase::Encode),
                Ok(Err(e)) => PdError::transport(Side::Encode, ep.id().clone(), e),
                Ok(Ok((status, body))) if status.is_success() => {
                    stage.observe(ep, true);
                    self.encoder_call(ep, LegOutcome::Answered);
                    return Ok(body);
                }
                // The encoder refused an item (an image it cannot decode, too large, not
                // processable): the client's fault, answered 400 in the engine's words,
                // never retried elsewhere. Another 4xx (429, 408, 404, 401, 403...) is
                // the encoder's own state, as a 5xx is.
                Ok(Ok((status, body))) if item_refused(status) => {
                    self.encoder_call(ep, LegOutcome::Answered);
                    let message = upstream_message(&body).unwrap_or_else(|| {
                        format!("an encoder refused the media items ({status})")
                    });
                    let param = crate::encode::media_field(req.api()).unwrap_or("messages");
                    return Err(PdError::body(BodyError::Invalid(InvalidParam::new(
                        param, message,
                    ))));
                }
                Ok(Ok((status, body))) => {
                    let e = PdError::upstream_status(
                        Side::Encode,
                        ep.id().clone(),
                        status,
                        upstream_message(&body),
                    );
                    if !retryable_status(status) {
                        return Err(e);
                    }
                    e
                }
            };
            stage.observe(ep, false);
            self.encoder_call(ep, LegOutcome::Failed);
            tracing::debug!(
                encoder = %ep.id(),
                error = %crate::error::error_chain(&err),
                "encoder leg failed"
            );
            last = Some(err);
        }
        Err(last.unwrap_or_else(|| match until.by_deadline {
            true => PdError::deadline(Side::Encode, Phase::Encode),
            false => match pool.first() {
                Some(ep) => PdError::timeout(Side::Encode, ep.id().clone(), Phase::Encode),
                None => PdError::from(crate::error::RouteError::NoDecode),
            },
        }))
    }
}

/// When the encoder stage's time ends, shared by its legs.
#[derive(Debug, Clone, Copy)]
struct Until {
    /// `None`: a budget beyond any instant, no end.
    end: Option<TokioInstant>,
    /// Whether the request's deadline, sooner than the stage's budget, sets `end`.
    by_deadline: bool,
}

impl Until {
    /// A try's share of the time left when `tries_left` tries (this one included) may
    /// still be made: an equal part of it; `None` without an end.
    fn share(self, tries_left: usize) -> Option<std::time::Duration> {
        let end = self.end?;
        let left = end.saturating_duration_since(TokioInstant::now());
        let parts = u32::try_from(tries_left.max(1)).unwrap_or(u32::MAX);
        Some(left / parts)
    }

    /// Whether the end has come.
    fn over(self) -> bool {
        self.end.is_some_and(|end| TokioInstant::now() >= end)
    }
}

/// How long past its budget the stage waits for legs that each end within it.
const GRACE: std::time::Duration = std::time::Duration::from_millis(100);

impl Inner {
    /// Tell the listeners how one encoder leg on `encoder` ended, as a call of that
    /// engine: the source's health counts it (passive health of encoders, as of the
    /// other endpoints), metrics count it per endpoint (`role="encode"`).
    fn encoder_call(&self, encoder: &Arc<Endpoint>, outcome: LegOutcome) {
        self.reporter.engine_call(&EngineCall {
            endpoint: Arc::clone(encoder),
            call: ENCODER_CALL,
            outcome,
            served: true,
        });
    }
}

/// What an encoder leg calls, as [`EngineCall::call`] names it.
const ENCODER_CALL: &str = "/v1/chat/completions";

/// The engine-side id of a request's encoder leg `index`: the id of the request's
/// first attempt (the proxy's own, never the client's) with `-enc<index>` after it (so
/// one request's legs stay apart in the encoders' logs, and go with its P/D legs).
fn leg_id(id: &HeaderValue, index: usize) -> Option<HeaderValue> {
    let mut out = Vec::with_capacity(id.len() + 8);
    out.extend_from_slice(id.as_bytes());
    out.extend_from_slice(b"-enc");
    out.extend_from_slice(index.to_string().as_bytes());
    HeaderValue::from_bytes(&out).ok()
}
