//! One request: decide, admit, attempt (and retry), answer.

use std::sync::Arc;
use std::time::Duration;

use http::Response;
use tokio::time::Instant as TokioInstant;

use super::stats::{InFlight, bump};
use crate::error::{PdError, Phase, Side};
use crate::outcome::now;
use crate::policy::Decision;
use crate::request::PdRequest;
use crate::router::RequestView;
use disagg_json::BodyError;

use super::Inner;
use super::attempt::{Failure, Watch, decode_alone};
use super::body::PdBody;
use super::clock::Clock;
use super::config::PrefillFailure;
use super::respond::RequestMeta;
use crate::outcome::{Delivery, EngineCall, LegOutcome, Report};

impl Inner {
    /// Serve `req` (see [`Orchestrator::serve`](super::Orchestrator::serve)).
    ///
    /// Not an `async fn`: the request goes into its [`Serving`] here, once, rather than
    /// into the future's arguments and then again into the guard inside it (a moved
    /// argument keeps its place in the future).
    pub(super) fn serve(
        self: Arc<Self>,
        req: PdRequest,
    ) -> impl Future<Output = Result<Response<PdBody>, PdError>> + Send + 'static {
        bump(&self.counters.requests);
        let mut serving = Serving {
            inner: self,
            state: State::new(req),
        };
        async move {
            let Serving { inner, state } = &mut serving;
            let result = inner.serve_in(state).await;
            // Told by now: by the failure's summary, or by the answer's body when it
            // ends.
            state.told = true;
            result
        }
    }

    /// The request `s` holds: every way it returns tells its summary (a failure's at
    /// once, an answer's when its body ends); dropped before, its [`Serving`] tells it
    /// cancelled.
    async fn serve_in(&self, s: &mut State) -> Result<Response<PdBody>, PdError> {
        s.meta.trace = self
            .config
            .trace_ratio
            .map(|ratio| self.spans.request(s.req.headers(), ratio));
        let checked = match self.check(&s.req) {
            Ok(d) => d,
            Err(e) => return Err(self.failed(&s.req, e, None, None)),
        };
        // The deadline counts from the request's arrival: a body that took longer to
        // come in leaves no time for tokenizing, queueing or any leg.
        let clock = self.clock(&s.req);
        if clock.expired() {
            return Err(self.out_of_time(&s.req));
        }
        if let Some(tokenizer) = &self.tokenizer
            && s.req.tokens().is_none()
        {
            self.tokenize(&**tokenizer, &mut s.req, clock).await;
        }
        let mut decision = self.decide(&s.req, checked);
        if let Some(retry) = &self.retry {
            retry.deposit();
        }
        let permit = match &self.admission {
            None => None,
            Some(admission) => Some(match admission.try_admit() {
                Some(permit) => permit,
                // Waited in the admission queue: every routing of the request says so
                // (`s.meta.queued`, read into the clock below).
                None => {
                    let since = now();
                    s.queuing = Some(since);
                    let admitted = admission.admit(clock.deadline).await;
                    s.queuing = None;
                    s.meta.queued = Some(now().saturating_duration_since(since));
                    match admitted {
                        Ok(permit) => permit,
                        Err(e) => return Err(self.failed(&s.req, e, None, None)),
                    }
                }
            }),
        };
        // Tokenizing or a wait for admission that ended at the deadline's last instant
        // leaves no time for any leg, and none is sent (a step with no time left would
        // still be polled once, which writes its request).
        if clock.expired() {
            return Err(self.out_of_time(&s.req));
        }
        // Whether the request waited for admission, and was counted as queued then:
        // its routings tell the router ([`Ask::queued`](crate::router::Ask)). A routing
        // that made it wait says so in the clock too, for the routings after it.
        let mut clock = Clock {
            queued: s.meta.queued.is_some(),
            ..clock
        };
        let in_flight = InFlight::new(&self.counters);
        // The first attempt's engine-side id is the request's own when the proxy drew it
        // (fresh and unique already); a client's id gets a new one. The encoder legs
        // carry it too (with `-enc<leg>`): an engine never sees the client's id.
        let first_id = if s.req.has_generated_id() {
            s.req.request_id().clone()
        } else {
            self.ids.next_id()
        };
        // E/P/D: a request with media items has them encoded first (a byte search of
        // its messages decides; nothing at all without an encoder stage), by the
        // encoders of the current snapshot that serve its model (none: no stage).
        // A push protocol names the consumer to the encoders: the request is routed
        // first, and its first attempt takes that route (the items wait there only).
        let mut pinned = None;
        // The body before the stage, kept only when a decode-only fallback may serve the
        // request on a decode the stage's items did not reach: a decode that loads no
        // encoder output (it gets the media), or, with a push protocol, a consuming
        // decode other than the prefill the items were pushed to (the stage runs again,
        // for it).
        let mut unencoded = None;
        if let Some(stage) = &self.encode
            && stage.wants(&s.req)
            && let Some((pool, decodes_consume)) = self.encoders(stage, &s.req)
            && self.direct_consumes(stage, &s.req, decision, decodes_consume)
        {
            if self.config.prefill_failure == PrefillFailure::DecodeOnly
                && matches!(decision, Decision::Disaggregate)
                && (!decodes_consume || stage.connector.consumer_first())
            {
                unencoded = Some(Unencoded {
                    body: s.req.body().clone(),
                    encode_again: decodes_consume,
                });
            }
            if stage.connector.consumer_first() {
                let routed = self
                    .route(&RequestView::from(&s.req), decision, &mut clock)
                    .await;
                match routed {
                    Ok(route) => {
                        // No prefill on the route: the consumer is the decode serving
                        // alone, as the decode-only fallback would serve it (only
                        // when that is configured), on this very route.
                        if route.prefill.is_none()
                            && matches!(decision, Decision::Disaggregate)
                            && self.config.prefill_failure == PrefillFailure::DecodeOnly
                        {
                            decision = Decision::Direct {
                                reason: "decode_only",
                            };
                            // The items go to that decode: no fallback follows.
                            unencoded = None;
                        }
                        pinned = Some(route);
                    }
                    Err(e) => {
                        drop(in_flight);
                        return Err(self.failed(&s.req, e, None, None));
                    }
                }
            }
            match self
                .encode(
                    stage,
                    &pool,
                    &mut s.req,
                    pinned.as_mut(),
                    clock,
                    s.meta.trace.as_ref(),
                    &first_id,
                    None,
                )
                .await
            {
                Ok(e) => s.meta.encode = e,
                Err(e) => {
                    drop(in_flight);
                    return Err(self.failed(&s.req, e, None, None));
                }
            }
        }
        let was_pinned = pinned.is_some();
        let mut retries = 0;
        let result = loop {
            // A retry gets an engine-side id of its own.
            let id = if retries == 0 {
                first_id.clone()
            } else {
                self.ids.next_id()
            };
            if retries > 0
                && let Some(t) = &mut s.meta.trace
            {
                self.spans.next_attempt(t);
            }
            s.meta.attempts = retries + 1;
            s.meta.engine_id = id.clone();
            // Made in the call: a local moved into the attempt would keep its place in
            // this future as well.
            let mut failure = match self
                .attempt(
                    &s.req,
                    id,
                    decision,
                    &mut clock,
                    pinned.take(),
                    Watch::new(
                        &self.reporter,
                        s.meta.trace.as_ref(),
                        retries,
                        &mut s.cancelled,
                    ),
                )
                .await
            {
                Ok(ex) => break Ok(self.respond(&s.req, ex, clock, s.meta.take())),
                Err(f) => f,
            };
            if let Some(report) = &mut failure.report {
                report.attempt = retries;
                self.reporter.report(report);
            }
            // Items pushed to a pinned consumer are nowhere else: no retry elsewhere.
            let wait = if was_pinned {
                None
            } else {
                self.retry_wait(&s.req, &failure.error, retries, clock)
            };
            match wait {
                Some(wait) => {
                    retries += 1;
                    tokio::time::sleep(wait).await;
                }
                None => {
                    break self
                        .after_failure(s, unencoded.take(), failure, clock)
                        .await;
                }
            }
        };
        match result {
            Ok(mut resp) => {
                resp.body_mut().hold(permit, Some(in_flight));
                Ok(resp)
            }
            Err(e) => {
                if e.is_deadline() {
                    bump(&self.counters.deadlines_exceeded);
                }
                Err(e)
            }
        }
    }

    /// `req`'s deadline passed before any leg was sent: 504 `deadline_exceeded`,
    /// counted.
    fn out_of_time(&self, req: &PdRequest) -> PdError {
        bump(&self.counters.deadlines_exceeded);
        self.failed(
            req,
            PdError::deadline(Side::Prefill, Phase::Prefill),
            None,
            None,
        )
    }

    /// `req` failed for good with `e` before any answer went out (its last attempt's
    /// report, if any, already told): its summary is told, and `e` is the answer.
    fn failed(
        &self,
        req: &PdRequest,
        e: PdError,
        last: Option<Box<Report>>,
        meta: Option<RequestMeta>,
    ) -> PdError {
        if self.reporter.listening() {
            let mut s = self.summary(req, e.status(), meta);
            s.error = Some(e.code());
            if let Some(r) = last {
                s.route = Some(r.route);
                s.timeline = Some(r.timeline);
            }
            self.reporter.summarize(&mut s);
        }
        e
    }

    /// The encoders of the current snapshot serving `req`'s model, and whether a decode
    /// of that model serving a request alone loads their output ([`decodes_consume`]),
    /// both read from one snapshot; `None` when there are no encoders (the request then
    /// goes without the encoder stage; a model no decode serves fails at routing as
    /// usual).
    fn encoders(
        &self,
        stage: &crate::encode::EncodeStage,
        req: &PdRequest,
    ) -> Option<(Vec<Arc<crate::endpoint::Endpoint>>, bool)> {
        let snapshot = self.source.snapshot();
        let set = snapshot.for_model(req.model()).ok()?;
        let pool = set.by_role(crate::endpoint::Role::Encode);
        (!pool.is_empty()).then(|| (pool.to_vec(), decodes_consume(stage, set)))
    }

    /// Whether the engine serving `req` under `decision` loads the encoders' output: a
    /// request disaggregated goes to a prefill (or, without a prefill pool, to a decode
    /// alone: E → PD), which does; one served direct goes to a decode alone, which does
    /// only when `decodes_consume` (no prefill pool, or every decode serving its model
    /// declares an EC role that consumes:
    /// [`EncoderConnector::consumes`](crate::encode::EncoderConnector::consumes)).
    /// When it does not, the stage is skipped (counted, logged at debug): the decode
    /// gets the media and encodes them itself.
    fn direct_consumes(
        &self,
        stage: &crate::encode::EncodeStage,
        req: &PdRequest,
        decision: Decision,
        decodes_consume: bool,
    ) -> bool {
        let Decision::Direct { reason } = decision else {
            return true;
        };
        if !decodes_consume {
            bump(&stage.counters.skipped);
            tracing::debug!(
                request_id = ?req.request_id(),
                reason,
                "served on a decode alone that loads no encoder output: no encoder stage, \
                 the decode encodes the media itself"
            );
        }
        decodes_consume
    }

    /// The connector's check, once per request before anything else: it refuses what
    /// the engines would refuse in the fields it rewrites (400, no engine contacted)
    /// and sends direct what it cannot carry.
    fn check(&self, req: &PdRequest) -> Result<Decision, PdError> {
        self.connector.check(req).map_err(|e| {
            bump(&self.counters.invalid_params);
            PdError::body(BodyError::Invalid(e))
        })
    }

    /// Whether to disaggregate `req`, after the connector's `checked` decision: a
    /// request the connector sends direct stays direct; otherwise the
    /// [`Disaggregate`](crate::policy::Disaggregate) hook decides (with the
    /// request's token ids, when it has them).
    fn decide(&self, req: &PdRequest, checked: Decision) -> Decision {
        let decision = match checked {
            Decision::Disaggregate => self.disaggregate.decide(&RequestView::from(req)),
            direct => direct,
        };
        if let Decision::Direct { reason } = decision {
            self.counters.direct(reason);
        }
        decision
    }

    /// The request's token ids from `tokenizer`, within the tokenize budget. A failure
    /// leaves the request without ids: logged, counted, never an error of the request.
    /// An engine the tokenizer asked that failed, or had not answered when the budget
    /// ran out, is told to the listeners as a failed call of that engine.
    async fn tokenize(
        &self,
        tokenizer: &dyn crate::tokens::Tokenizer,
        req: &mut PdRequest,
        clock: Clock,
    ) {
        // Within its own budget and what is left of the deadline.
        let (budget, by_deadline) = clock.budget(self.config.tokenize_timeout);
        let mut asked = crate::tokens::Asked::default();
        let call = tokenizer.token_ids_asking(req.api(), req.body(), &mut asked);
        let result = tokio::time::timeout(budget, call).await;
        if let Some(engine) = &asked.engine {
            // Cut by the request's deadline, the engine is not to blame.
            let cut = result.is_err() && by_deadline;
            let failed = match &result {
                Ok(Ok(_)) => false,
                Ok(Err(_)) | Err(_) => !asked.answered && !cut,
            };
            let outcome = if cut {
                LegOutcome::Abandoned
            } else if failed {
                LegOutcome::Failed
            } else {
                LegOutcome::Answered
            };
            if failed {
                tracing::warn!(
                    request_id = ?req.request_id(),
                    engine = %engine.id(),
                    timed_out = result.is_err(),
                    "the engine asked for token ids failed; counted against it"
                );
            }
            self.reporter.engine_call(&EngineCall {
                endpoint: Arc::clone(engine),
                call: "/tokenize",
                outcome,
                served: false,
            });
        }
        match result {
            Ok(Ok(Some(ids))) => {
                bump(&self.counters.tokenized);
                req.set_tokens(Some(ids));
            }
            // Not one sequence (a batch, images): nothing failed.
            Ok(Ok(None)) => {}
            Ok(Err(e)) => {
                bump(&self.counters.tokenize_failures);
                tracing::debug!(
                    request_id = ?req.request_id(),
                    error = %crate::error::error_chain(&*e),
                    "tokenizing failed: routing without token ids"
                );
            }
            Err(_) => {
                bump(&self.counters.tokenize_failures);
                tracing::debug!(
                    request_id = ?req.request_id(),
                    budget_ms = budget.as_millis() as u64,
                    "tokenizing took too long: routing without token ids"
                );
            }
        }
    }

    /// The request's deadline, counted from its arrival (before its body was read, when
    /// the server said so): the configured one, shortened by the client's header when
    /// allowed.
    fn clock(&self, req: &PdRequest) -> Clock {
        let arrival = tokio::time::Instant::from_std(req.arrival());
        Clock {
            deadline: self.config.deadline_for(req.headers(), arrival),
            queued: false,
        }
    }

    /// The wait before retrying after `e`, or `None` when it must not be retried: no
    /// retry policy, an error no retry can help (or one that reached the engine), no
    /// time left before the deadline, or the policy's budget spent.
    fn retry_wait(
        &self,
        req: &PdRequest,
        e: &PdError,
        done: u32,
        clock: Clock,
    ) -> Option<Duration> {
        let retry = self.retry.as_ref()?;
        // Whatever the policy: only errors another pair could answer differently.
        if !e.is_retryable() {
            return None;
        }
        let wait = retry.backoff(e, done)?;
        if clock
            .deadline
            .is_some_and(|d| TokioInstant::now().checked_add(wait).is_none_or(|t| t >= d))
        {
            return None;
        }
        if !retry.withdraw() {
            bump(&self.counters.retries_denied);
            tracing::warn!(
                request_id = ?req.request_id(),
                error = %crate::error::error_chain(e),
                "retry budget spent: not retrying"
            );
            return None;
        }
        bump(&self.counters.retries);
        tracing::warn!(
            request_id = ?req.request_id(),
            error = %crate::error::error_chain(e),
            retry = done + 1,
            backoff_ms = wait.as_millis() as u64,
            "attempt failed before any answer reached the client; retrying on a new pair"
        );
        Some(wait)
    }

    /// The request failed for good with the attempt's `failure`: serve it decode-only
    /// when the prefill could not be had and the policy says so, else fail.
    ///
    /// `unencoded` is the request's body before its encoder stage, when the stage's
    /// items cannot have reached the decode that serves alone: that decode then gets it.
    /// A decode that loads no encoder output gets the media (no encoder fields) and
    /// encodes them itself, as for a request the stage skipped; a consuming one, with a
    /// push protocol (the items went to the prefill only), has the stage run again with
    /// it as the consumer.
    async fn after_failure(
        &self,
        s: &mut State,
        unencoded: Option<Unencoded>,
        failure: Failure,
        mut clock: Clock,
    ) -> Result<Response<PdBody>, PdError> {
        let Failure { error: e, report } = failure;
        // The prefill side's engine could not be had; not a request refused on it as
        // the client's fault (the connector's `Unsupported`, a 400): no decode serves
        // what the client must change.
        let engine_failed =
            e.side() == crate::error::Side::Prefill && !e.status().is_client_error();
        let prefill_missing = engine_failed || e.is_no_prefill();
        if self.config.prefill_failure != PrefillFailure::DecodeOnly
            || !prefill_missing
            || e.is_deadline()
            || clock.expired()
        {
            return Err(self.failed(&s.req, e, report, Some(s.meta.take())));
        }
        bump(&self.counters.prefill_fallbacks);
        tracing::warn!(
            request_id = ?s.req.request_id(),
            reason = e.code(),
            error = %crate::error::error_chain(&e),
            "prefill unavailable: serving decode-only, as configured"
        );
        let (mut plain, encode_again) = match unencoded {
            Some(u) => {
                let mut r = s.req.clone();
                *r.body_mut() = u.body;
                (Some(r), u.encode_again)
            }
            None => (None, false),
        };
        // Routed like any attempt: the admission's per-endpoint limits apply.
        let decision = Decision::Direct {
            reason: "decode_only",
        };
        let view = RequestView::from(plain.as_ref().unwrap_or(&s.req));
        let routed = self.route(&view, decision, &mut clock).await;
        let mut route = match routed {
            Ok(r) => r,
            Err(e) => return Err(self.failed(&s.req, e, None, Some(s.meta.take()))),
        };
        let id = self.ids.next_id();
        // Pushed to the prefill, the items are not at this decode: it is the consumer of
        // a stage run again (with the encoders of the current snapshot; none left, it
        // gets the media as a request without the stage would).
        if encode_again
            && let (Some(stage), Some(r)) = (&self.encode, plain.as_mut())
            && let Some((pool, _)) = self.encoders(stage, r)
        {
            let encoded = self
                .encode(
                    stage,
                    &pool,
                    r,
                    Some(&mut route),
                    clock,
                    s.meta.trace.as_ref(),
                    &id,
                    s.meta.encode.as_ref(),
                )
                .await;
            match encoded {
                Ok(Some(summary)) => s.meta.encode = Some(summary),
                Ok(None) => {}
                Err(e) => return Err(self.failed(&s.req, e, None, Some(s.meta.take()))),
            }
        }
        let req = plain.as_ref().unwrap_or(&s.req);
        let mut leg = decode_alone(&route, req, id.clone());
        if let Some(t) = &mut s.meta.trace {
            self.spans.next_attempt(t);
            t.inject(&t.decode, &mut leg.headers);
        }
        s.meta.attempts += 1;
        s.meta.engine_id = id;
        let attempt = s.meta.attempts - 1;
        let mut watch = Watch::new(
            &self.reporter,
            s.meta.trace.as_ref(),
            attempt,
            &mut s.cancelled,
        );
        watch.routed(&route);
        let fallback = Some(e.code());
        let result = self
            .alone(req, route, leg, fallback, clock, &mut watch.tl)
            .await;
        let mut tl = watch.ended();
        match result {
            Ok(mut ex) => {
                ex.timeline = tl;
                Ok(self.respond(req, ex, clock, s.meta.take()))
            }
            Err(Failure { error, mut report }) => {
                if let Some(r) = &mut report {
                    tl.end = Some(now());
                    r.timeline = tl;
                    r.attempt = attempt;
                    r.trace = s.meta.trace.clone();
                    self.reporter.report(r);
                }
                Err(self.failed(req, error, report, Some(s.meta.take())))
            }
        }
    }
}

/// A request being served: the orchestrator, and the request with what its summary
/// needs, kept as the serving goes ([`State`]). Dropped before its answer or its failure
/// took over (the client left before the response head: the server dropped the
/// `serve` future), it tells the request's summary, once, as [`Delivery::Cancelled`]
/// (status 499, nginx's "client closed request"), after the report of an attempt
/// cancelled with it ([`Watch`]).
struct Serving {
    inner: Arc<Inner>,
    state: State,
}

/// A request being served, and what its summary needs.
struct State {
    req: PdRequest,
    /// Attempts made, and the last one's engine-side id (while `attempts` is 0, none).
    meta: RequestMeta,
    /// When the wait for admission began, while it lasts.
    queuing: Option<std::time::Instant>,
    /// The report of the attempt cancelled with the request, for its route and steps.
    cancelled: Option<Box<Report>>,
    /// The answer or the failure told the summary (or its body will).
    told: bool,
}

/// The status of a request whose client left before its response head: none went out;
/// the access log and the request span say 499, as nginx does.
pub(super) const CLIENT_CLOSED: http::StatusCode = match http::StatusCode::from_u16(499) {
    Ok(status) => status,
    Err(_) => http::StatusCode::BAD_REQUEST,
};

impl State {
    fn new(req: PdRequest) -> Self {
        State {
            req,
            meta: RequestMeta::none(),
            queuing: None,
            cancelled: None,
            told: false,
        }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        let (reporter, state) = (&self.inner.reporter, &mut self.state);
        if state.told || !reporter.listening() || std::thread::panicking() {
            return;
        }
        let meta = state.meta.take();
        let mut s = self.inner.summary(&state.req, CLIENT_CLOSED, None);
        s.delivery = Delivery::Cancelled;
        s.attempts = meta.attempts;
        s.engine_request_id = (meta.attempts > 0).then_some(meta.engine_id);
        s.queued = meta.queued.or_else(|| {
            state
                .queuing
                .map(|since| now().saturating_duration_since(since))
        });
        s.trace = meta.trace;
        s.encode = meta.encode;
        if let Some(r) = state.cancelled.take() {
            s.route = Some(r.route);
            s.timeline = Some(r.timeline);
        }
        reporter.summarize(&mut s);
    }
}

/// A request's body before its encoder stage, kept for a decode-only fallback whose
/// decode the stage's items did not reach (see `Inner::after_failure`).
struct Unencoded {
    body: disagg_json::JsonBody,
    /// The decodes load encoder output (a push protocol: the items went to the prefill
    /// alone): the stage runs again with the fallback's decode as its consumer. Else the
    /// decode gets this body, the media, and encodes them itself.
    encode_again: bool,
}

/// Whether the decodes of `set` load the encoders' output when one serves a request
/// alone: when there is no prefill pool (they are the consumers, E → PD) or every one
/// declares an EC role that consumes.
fn decodes_consume(stage: &crate::encode::EncodeStage, set: &crate::endpoint::EndpointSet) -> bool {
    let prefills = set.by_role(crate::endpoint::Role::Prefill);
    let decodes = set.by_role(crate::endpoint::Role::Decode);
    prefills.is_empty()
        || (!decodes.is_empty() && decodes.iter().all(|d| stage.connector.consumes(d)))
}
