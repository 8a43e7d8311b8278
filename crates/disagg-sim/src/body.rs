//! Response bodies: whole JSON documents, SSE streams generated frame by
//! frame, and the deliberately broken ones of fault injection.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use thiserror::Error;
use tokio::time::Sleep;

use crate::generate::Generation;
use crate::stats::RequestGuard;

/// The error a body yields to make hyper abort the connection (a fault's, or a stream
/// the engine cuts off as vLLM's server does).
#[derive(Debug, Error)]
#[error("connection dropped mid-body")]
pub(crate) struct FaultAbort;

/// The body of every response of the engine.
#[derive(Debug)]
pub(crate) enum SimBody {
    /// A complete body, sent as one frame. The guard (if any) is completed
    /// when the frame is handed to hyper.
    Full {
        data: Option<Bytes>,
        guard: Option<RequestGuard>,
    },
    /// The first half of `data`, then an abort.
    Truncated {
        data: Option<Bytes>,
        guard: Option<RequestGuard>,
        flushed: bool,
    },
    /// The first half of `data`, then nothing, with the connection left open
    /// until the client leaves (the request then counts as cancelled).
    Stalled {
        data: Option<Bytes>,
        /// Never completed: dropped with the body, it counts the request as
        /// cancelled.
        _guard: RequestGuard,
    },
    /// A server-sent-events stream.
    Sse(Box<SseBody>),
    /// Events rendered up front, sent one per frame (SGLang's `/generate`, the
    /// Responses API).
    Events(Box<EventsBody>),
    /// A body whose head went out before the work that makes it was done (a vLLM
    /// stream's head, sent before its KV load): the work, then the body it made.
    Deferred(Box<Deferred>),
}

/// The work a [`SimBody::Deferred`] waits for.
pub(crate) type Work = Pin<Box<dyn Future<Output = SimBody> + Send>>;

/// A [`SimBody::Deferred`]: the events its stream opens with whatever the work makes
/// (sent at once), and its work until done, then the body the work made. Dropped with
/// the body (the client left), the work is dropped where it stands.
pub(crate) struct Deferred {
    /// Sent first, while the work goes on.
    opening: VecDeque<Bytes>,
    state: DeferredState,
}

enum DeferredState {
    /// Not done yet.
    Working(Work),
    /// Done: the body it made.
    Done(SimBody),
}

impl std::fmt::Debug for Deferred {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut out = f.debug_struct("Deferred");
        out.field("opening", &self.opening.len());
        match &self.state {
            DeferredState::Working(_) => out.field("state", &"Working"),
            DeferredState::Done(body) => out.field("state", body),
        };
        out.finish()
    }
}

impl Deferred {
    /// `opening`, then the body `work` makes.
    pub(crate) fn new(opening: VecDeque<Bytes>, work: Work) -> Self {
        Deferred {
            opening,
            state: DeferredState::Working(work),
        }
    }

    fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, FaultAbort>>> {
        // The work goes on while the opening events are sent.
        if let DeferredState::Working(work) = &mut self.state
            && let Poll::Ready(body) = work.as_mut().poll(cx)
        {
            self.state = DeferredState::Done(body);
        }
        if let Some(event) = self.opening.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(event))));
        }
        match &mut self.state {
            DeferredState::Done(body) => Pin::new(body).poll_frame(cx),
            DeferredState::Working(_) => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.state {
            DeferredState::Done(body) => self.opening.is_empty() && body.is_end_stream(),
            DeferredState::Working(_) => false,
        }
    }
}

impl SimBody {
    pub(crate) fn full(data: impl Into<Bytes>) -> Self {
        SimBody::Full {
            data: Some(data.into()),
            guard: None,
        }
    }

    pub(crate) fn empty() -> Self {
        SimBody::Full {
            data: None,
            guard: None,
        }
    }

    /// The same body without its first `n` events, sent already (a
    /// [`SimBody::Deferred`]'s opening): only an [`EventsBody`] of events rendered up
    /// front has any to skip.
    pub(crate) fn skipping_events(self, n: usize) -> Self {
        match self {
            SimBody::Events(events) if n > 0 => SimBody::Events(Box::new(events.skipping(n))),
            body => body,
        }
    }
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = FaultAbort;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, FaultAbort>>> {
        match self.get_mut() {
            SimBody::Full { data, guard } => {
                if let Some(mut g) = guard.take() {
                    g.complete();
                }
                Poll::Ready(data.take().map(|d| Ok(Frame::data(d))))
            }
            SimBody::Truncated {
                data,
                guard,
                flushed,
            } => match data.take() {
                Some(d) => Poll::Ready(Some(Ok(Frame::data(d.slice(..d.len() / 2))))),
                None if !*flushed => {
                    *flushed = true;
                    yield_once(cx)
                }
                None => {
                    if let Some(mut g) = guard.take() {
                        g.complete();
                    }
                    Poll::Ready(Some(Err(FaultAbort)))
                }
            },
            // Never woken: hyper drops the body, and its guard, when the client leaves.
            SimBody::Stalled { data, .. } => match data.take() {
                Some(d) => Poll::Ready(Some(Ok(Frame::data(d.slice(..d.len() / 2))))),
                None => Poll::Pending,
            },
            SimBody::Sse(sse) => sse.poll_event(cx),
            SimBody::Events(events) => events.poll_event(cx),
            SimBody::Deferred(deferred) => deferred.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            SimBody::Full { data, .. } => data.is_none(),
            SimBody::Truncated { .. } | SimBody::Stalled { .. } => false,
            SimBody::Sse(sse) => sse.finished,
            // A stream cut off at its end is not over when its events are.
            SimBody::Events(events) => events.events.is_empty() && !events.abort_at_end,
            SimBody::Deferred(deferred) => deferred.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            SimBody::Full { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            _ => SizeHint::default(),
        }
    }
}

/// Which OpenAI route a stream answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Endpoint {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completions,
}

#[derive(Clone, Copy, Debug)]
enum Phase {
    Role(usize),
    Token { step: usize, choice: usize },
    Usage,
    Error,
    Done,
}

/// A streamed answer, rendered one SSE event per frame as hyper asks for
/// it: no task, no channel, and a timer only when there is a delay.
#[derive(Debug)]
pub(crate) struct SseBody {
    guard: Option<RequestGuard>,
    endpoint: Endpoint,
    /// `data: {"id":..,"object":..,"created":..,"model":..,"choices":[`
    prefix: String,
    choices: Vec<Generation>,
    /// `(prompt_tokens, completion_tokens)` when usage is to be streamed.
    usage: Option<(u64, u64)>,
    /// `usage.prompt_tokens_details.cached_tokens`, with a prefix cache.
    cached_tokens: Option<u64>,
    phase: Option<Phase>,
    delay: Duration,
    sleep: Option<Pin<Box<Sleep>>>,
    delayed_step: usize,
    emitted: usize,
    drop_after: Option<usize>,
    stall_after: Option<usize>,
    /// The decode's own `kv_transfer_params` for the terminal chunks (JSON).
    handoff: Option<String>,
    /// Chat with `return_token_ids`: the prompt's ids (JSON) for each role chunk.
    prompt_token_ids: Option<String>,
    /// `return_token_ids`: each token chunk carries its choice's new ids.
    return_token_ids: bool,
    /// Completions with `return_token_ids`: each choice's prompt ids (JSON), on that
    /// choice's first chunk.
    choice_prompt_ids: Vec<String>,
    /// Continuous usage: each choice's prompt tokens; empty without it.
    choice_prompt_tokens: Vec<u64>,
    /// The error event that ends the answer in place of its tokens and usage (JSON).
    error: Option<String>,
    /// [`SseSpec::usage_after_error`].
    usage_after_error: bool,
    /// Whether hyper had a chance to flush the events before the abort.
    abort_flushed: bool,
    finished: bool,
}

/// What an [`SseBody`] streams.
#[derive(Debug)]
pub(crate) struct SseSpec {
    pub(crate) endpoint: Endpoint,
    pub(crate) id: String,
    pub(crate) created: u64,
    /// The model name, already JSON-encoded (quoted and escaped).
    pub(crate) model_json: String,
    pub(crate) choices: Vec<Generation>,
    pub(crate) usage: Option<(u64, u64)>,
    /// `usage.prompt_tokens_details.cached_tokens`, with a prefix cache.
    pub(crate) cached_tokens: Option<u64>,
    pub(crate) delay: Duration,
    pub(crate) drop_after: Option<usize>,
    /// After this many events, send nothing more (wins over `drop_after`).
    pub(crate) stall_after: Option<usize>,
    /// The decode's own `kv_transfer_params` (JSON) for each choice's terminal chunk
    /// ([`SimConfig::decode_handoff`](crate::SimConfig::decode_handoff)); `None`: `null`.
    pub(crate) handoff: Option<String>,
    /// Chat with `return_token_ids`: the prompt's ids (JSON), on each choice's role
    /// chunk as vLLM writes them; `None`: `null`.
    pub(crate) prompt_token_ids: Option<String>,
    /// `return_token_ids`: each token chunk carries its choice's new ids (vLLM 0.33).
    pub(crate) return_token_ids: bool,
    /// Completions with `return_token_ids`: each choice's prompt ids (JSON), written on
    /// that choice's first chunk as vLLM does; empty otherwise.
    pub(crate) choice_prompt_ids: Vec<String>,
    /// `stream_options.continuous_usage_stats` (with `include_usage`): each choice's
    /// prompt tokens, for the `usage` vLLM writes on every chunk; empty otherwise.
    pub(crate) choice_prompt_tokens: Vec<u64>,
    /// An error (JSON, vLLM's error shape) streamed as one event after the role chunks,
    /// in place of the tokens and the usage chunk, before `data: [DONE]`: how vLLM's
    /// stream generators answer a request that finished with an error
    /// ([`crate::kv_load_failure`]). The choices then have no tokens.
    pub(crate) error: Option<String>,
    /// The usage chunk (when `usage` is set) follows the error event, before
    /// `data: [DONE]`, as SGLang's stream generators write it after an aborted output.
    pub(crate) usage_after_error: bool,
}

impl SseBody {
    pub(crate) fn new(spec: SseSpec, guard: RequestGuard) -> Self {
        let object = match spec.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        };
        let mut prefix = String::with_capacity(96 + spec.id.len() + spec.model_json.len());
        prefix.push_str("data: {\"id\":");
        push_json_str(&mut prefix, &spec.id);
        let _ = write!(
            prefix,
            ",\"object\":\"{object}\",\"created\":{},\"model\":{},\"choices\":[",
            spec.created, spec.model_json
        );
        let mut body = Self {
            guard: Some(guard),
            endpoint: spec.endpoint,
            prefix,
            choices: spec.choices,
            usage: spec.usage,
            cached_tokens: spec.cached_tokens,
            phase: None,
            delay: spec.delay,
            sleep: None,
            delayed_step: 0,
            emitted: 0,
            drop_after: spec.drop_after,
            stall_after: spec.stall_after,
            handoff: spec.handoff,
            prompt_token_ids: spec.prompt_token_ids,
            return_token_ids: spec.return_token_ids,
            choice_prompt_ids: spec.choice_prompt_ids,
            choice_prompt_tokens: spec.choice_prompt_tokens,
            error: spec.error,
            usage_after_error: spec.usage_after_error,
            abort_flushed: false,
            finished: false,
        };
        body.phase = match body.endpoint {
            Endpoint::Chat if !body.choices.is_empty() => Some(Phase::Role(0)),
            _ => body.after_roles(),
        };
        body
    }

    fn first_token_pos(&self, mut step: usize, mut choice: usize) -> Option<Phase> {
        let max = self
            .choices
            .iter()
            .map(|c| c.steps.len())
            .max()
            .unwrap_or(0);
        while step < max {
            if let Some(c) =
                (choice..self.choices.len()).find(|&c| self.choices[c].steps.len() > step)
            {
                return Some(Phase::Token { step, choice: c });
            }
            step += 1;
            choice = 0;
        }
        None
    }

    fn after_roles(&self) -> Option<Phase> {
        self.first_token_pos(0, 0).or_else(|| self.after_tokens())
    }

    fn after_tokens(&self) -> Option<Phase> {
        Some(if self.error.is_some() {
            Phase::Error
        } else if self.usage.is_some() {
            Phase::Usage
        } else {
            Phase::Done
        })
    }

    /// With continuous usage, the `usage` of a chunk of `choice`, written after its
    /// `choices` as vLLM does: the choice's prompt tokens, its `completion` tokens
    /// so far and their sum.
    fn push_chunk_usage(&self, s: &mut String, choice: usize, completion: u64) {
        if let Some(&prompt) = self.choice_prompt_tokens.get(choice) {
            let _ = write!(
                s,
                ",\"usage\":{{\"prompt_tokens\":{prompt},\"total_tokens\":{},\"completion_tokens\":{completion}}}",
                prompt + completion
            );
        }
    }

    /// Renders the event of `phase` and returns it with the next phase.
    fn render(&self, phase: Phase) -> (String, Option<Phase>) {
        let mut s = String::with_capacity(self.prefix.len() + 128);
        match phase {
            Phase::Role(i) => {
                s.push_str(&self.prefix);
                // vLLM sets `prompt_token_ids` and `prompt_text` on each choice's role
                // chunk (null unless asked for) and dumps with `exclude_unset`.
                let ids = self.prompt_token_ids.as_deref().unwrap_or("null");
                let _ = write!(
                    s,
                    "{{\"index\":{i},\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}]"
                );
                self.push_chunk_usage(&mut s, i, 0);
                let _ = write!(s, ",\"prompt_token_ids\":{ids},\"prompt_text\":null}}\n\n");
                let next = if i + 1 < self.choices.len() {
                    Some(Phase::Role(i + 1))
                } else {
                    self.after_roles()
                };
                (s, next)
            }
            Phase::Token { step, choice } => {
                let generation = &self.choices[choice];
                // Vocabulary tokens need no JSON escaping.
                let token = generation.steps[step];
                s.push_str(&self.prefix);
                let _ = match self.endpoint {
                    Endpoint::Chat => write!(
                        s,
                        "{{\"index\":{choice},\"delta\":{{\"content\":\"{token}\"}},\"logprobs\":null,"
                    ),
                    Endpoint::Completions => write!(
                        s,
                        "{{\"index\":{choice},\"text\":\"{token}\",\"logprobs\":null,"
                    ),
                };
                // The fields vLLM 0.33 sets on each choice (`exclude_unset` keeps them,
                // null included): `chat_completion/serving.py` and
                // `completion/serving.py` of `vllm/entrypoints/openai`.
                let last = step + 1 == generation.steps.len();
                if last {
                    let _ = write!(
                        s,
                        "\"finish_reason\":\"{}\",\"stop_reason\":",
                        generation.finish.as_str()
                    );
                    match &generation.stop_reason {
                        Some(stop) => push_json_str(&mut s, stop),
                        None => s.push_str("null"),
                    }
                } else if self.endpoint == Endpoint::Completions {
                    s.push_str("\"finish_reason\":null,\"stop_reason\":null");
                } else {
                    s.push_str("\"finish_reason\":null");
                }
                // `return_token_ids`: the step's id (the EOS id too: vLLM's
                // `output.token_ids`), and on a completion choice's first chunk its
                // prompt's ids.
                let mut ids = String::new();
                match generation.ids.get(step) {
                    Some(id) if self.return_token_ids => {
                        let _ = write!(ids, "[{id}]");
                    }
                    _ => ids.push_str("null"),
                }
                let prompt_ids = match self.choice_prompt_ids.get(choice) {
                    Some(p) if step == 0 => p.as_str(),
                    _ => "null",
                };
                match (self.endpoint, last) {
                    (Endpoint::Chat, false) => {
                        let _ = write!(s, ",\"token_ids\":{ids}");
                    }
                    (Endpoint::Chat, true) => {
                        let _ = write!(s, ",\"token_ids\":{ids},\"weight_versions\":null");
                    }
                    _ => {
                        let _ = write!(
                            s,
                            ",\"prompt_token_ids\":{prompt_ids},\"token_ids\":{ids},\"weight_versions\":null"
                        );
                    }
                }
                s.push_str("}]");
                self.push_chunk_usage(&mut s, choice, step as u64 + 1);
                s.push_str(",\"kv_transfer_params\":");
                match (&self.handoff, last) {
                    (Some(handoff), true) => s.push_str(handoff),
                    _ => s.push_str("null"),
                }
                s.push_str("}\n\n");
                let next = self
                    .first_token_pos(step, choice + 1)
                    .or_else(|| self.after_tokens());
                (s, next)
            }
            Phase::Usage => {
                let (prompt, completion) = self.usage.unwrap_or_default();
                s.push_str(&self.prefix);
                let _ = write!(
                    s,
                    "],\"usage\":{{\"prompt_tokens\":{prompt},\"total_tokens\":{},\"completion_tokens\":{completion}",
                    prompt + completion
                );
                if let Some(cached) = self.cached_tokens {
                    let _ = write!(
                        s,
                        ",\"prompt_tokens_details\":{{\"cached_tokens\":{cached}}}"
                    );
                }
                s.push_str("}}\n\n");
                (s, Some(Phase::Done))
            }
            Phase::Error => {
                s.push_str("data: ");
                s.push_str(self.error.as_deref().unwrap_or("null"));
                s.push_str("\n\n");
                let next = if self.usage_after_error && self.usage.is_some() {
                    Phase::Usage
                } else {
                    Phase::Done
                };
                (s, Some(next))
            }
            Phase::Done => {
                s.push_str("data: [DONE]\n\n");
                (s, None)
            }
        }
    }

    fn poll_event(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, FaultAbort>>> {
        loop {
            let Some(phase) = self.phase else {
                self.finished = true;
                if let Some(mut g) = self.guard.take() {
                    g.complete();
                }
                return Poll::Ready(None);
            };
            if self.stall_after.is_some_and(|n| self.emitted >= n) {
                // Never woken: the stream hangs, the connection stays open, until
                // the client leaves and hyper drops the body (and its guard).
                return Poll::Pending;
            }
            if self.stall_after.is_none() && self.drop_after.is_some_and(|n| self.emitted >= n) {
                if !self.abort_flushed {
                    self.abort_flushed = true;
                    return yield_once(cx);
                }
                self.phase = None;
                self.finished = true;
                if let Some(mut g) = self.guard.take() {
                    g.complete();
                }
                return Poll::Ready(Some(Err(FaultAbort)));
            }
            if let Some(sleep) = self.sleep.as_mut() {
                if sleep.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.sleep = None;
            } else if let Phase::Token { step, .. } = phase
                && step > self.delayed_step
                && !self.delay.is_zero()
            {
                self.delayed_step = step;
                self.sleep = Some(Box::pin(tokio::time::sleep(self.delay)));
                continue;
            }
            let (event, next) = self.render(phase);
            self.phase = next;
            self.emitted += 1;
            if next.is_none() {
                // `[DONE]` is out: the answer is complete once hyper takes it.
                self.finished = true;
                if let Some(mut g) = self.guard.take() {
                    g.complete();
                }
            }
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from(event)))));
        }
    }
}

/// Where the frames of an [`EventsBody`] come from.
#[derive(Debug)]
pub(crate) enum Events {
    /// Rendered up front (streams whose events are small: one token each).
    Ready(std::collections::VecDeque<Bytes>),
    /// SGLang's `/generate`, rendered event by event as hyper asks for it.
    Native(Box<crate::native::NativeStream>),
}

impl From<std::collections::VecDeque<Bytes>> for Events {
    fn from(events: std::collections::VecDeque<Bytes>) -> Self {
        Events::Ready(events)
    }
}

impl Events {
    fn is_empty(&self) -> bool {
        match self {
            Events::Ready(events) => events.is_empty(),
            Events::Native(stream) => stream.is_end(),
        }
    }

    /// The next frame: `None` at the end, `Err` when it cannot be rendered.
    fn next_frame(&mut self) -> Option<Result<Bytes, serde_json::Error>> {
        match self {
            Events::Ready(events) => events.pop_front().map(Ok),
            Events::Native(stream) => stream.next_frame(),
        }
    }

    /// The bytes held for frames not sent yet (what is rendered ahead of the client).
    #[cfg(test)]
    pub(crate) fn queued_bytes(&self) -> usize {
        match self {
            Events::Ready(events) => events.iter().map(Bytes::len).sum(),
            Events::Native(_) => 0,
        }
    }
}

/// A stream of events, one event per frame, with the engine's inter-token delay before
/// each event after the first. No task, no channel.
#[derive(Debug)]
pub(crate) struct EventsBody {
    events: Events,
    delay: Duration,
    sleep: Option<Pin<Box<Sleep>>>,
    emitted: usize,
    /// After this many events, send nothing more ([`crate::Faults::stall_after_chunks`]).
    stall_after: Option<usize>,
    /// After this many events, abort the connection ([`crate::Faults::drop_after_chunks`]).
    drop_after: Option<usize>,
    /// After the last event, abort the connection: the stream is cut off, not ended.
    abort_at_end: bool,
    /// The events before the abort were handed to hyper to flush.
    flushed: bool,
    guard: Option<RequestGuard>,
}

impl EventsBody {
    pub(crate) fn new(
        events: impl Into<Events>,
        delay: Duration,
        stall_after: Option<usize>,
        guard: RequestGuard,
    ) -> Self {
        EventsBody {
            events: events.into(),
            delay,
            sleep: None,
            emitted: 0,
            stall_after,
            drop_after: None,
            abort_at_end: false,
            flushed: false,
            guard: Some(guard),
        }
    }

    /// The same body, cutting the connection off after its last event, as a server
    /// whose stream raised after its head does (uvicorn closes the connection): the
    /// client sees the body unfinished.
    pub(crate) fn aborting_at_end(mut self) -> Self {
        self.abort_at_end = true;
        self
    }

    /// The same body without its first `n` events (sent already); the stall and drop
    /// faults count the events skipped as sent.
    fn skipping(mut self, n: usize) -> Self {
        if let Events::Ready(events) = &mut self.events {
            let n = n.min(events.len());
            events.drain(..n);
            self.stall_after = self.stall_after.map(|s| s.saturating_sub(n));
            self.drop_after = self.drop_after.map(|d| d.saturating_sub(n));
        }
        self
    }

    /// The bytes held for frames not sent yet.
    #[cfg(test)]
    pub(crate) fn queued_bytes(&self) -> usize {
        self.events.queued_bytes()
    }

    /// The same body, aborting the connection after `n` events, when set.
    pub(crate) fn dropping_after(mut self, n: Option<usize>) -> Self {
        self.drop_after = n;
        self
    }

    fn poll_event(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, FaultAbort>>> {
        if self.events.is_empty() {
            if let Some(mut g) = self.guard.take() {
                g.complete();
            }
            if self.abort_at_end {
                if !self.flushed {
                    self.flushed = true;
                    return yield_once(cx);
                }
                return Poll::Ready(Some(Err(FaultAbort)));
            }
            return Poll::Ready(None);
        }
        if self.stall_after.is_some_and(|n| self.emitted >= n) {
            // Never woken: hyper drops the body, and its guard, when the client leaves.
            return Poll::Pending;
        }
        if self.drop_after.is_some_and(|n| self.emitted >= n) {
            if !self.flushed {
                self.flushed = true;
                return yield_once(cx);
            }
            return Poll::Ready(Some(Err(FaultAbort)));
        }
        if self.emitted > 0 && !self.delay.is_zero() {
            let sleep = self
                .sleep
                .get_or_insert_with(|| Box::pin(tokio::time::sleep(self.delay)));
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.sleep = None;
        }
        let event = match self.events.next_frame() {
            None => return Poll::Ready(None),
            Some(Ok(event)) => event,
            Some(Err(e)) => {
                // Serializing a JSON value into memory does not fail; should it, the
                // stream ends without its end, as an engine's would.
                tracing::error!(error = %e, "cannot render a stream event");
                self.events = Events::Ready(std::collections::VecDeque::new());
                if let Some(mut g) = self.guard.take() {
                    g.complete();
                }
                return Poll::Ready(Some(Err(FaultAbort)));
            }
        };
        self.emitted += 1;
        if self.events.is_empty()
            && let Some(mut g) = self.guard.take()
        {
            g.complete();
        }
        Poll::Ready(Some(Ok(Frame::data(event))))
    }
}

/// Returns `Pending` once so that hyper flushes what it has buffered before
/// the body aborts the connection.
fn yield_once<T>(cx: &mut Context<'_>) -> Poll<T> {
    cx.waker().wake_by_ref();
    Poll::Pending
}

/// Appends `s` as a JSON string literal.
pub(crate) fn push_json_str(out: &mut String, s: &str) {
    match serde_json::to_string(s) {
        Ok(quoted) => out.push_str(&quoted),
        // Serializing a str cannot fail; keep the output valid JSON anyway.
        Err(_) => out.push_str("\"\""),
    }
}
