//! Orchestrator settings and the response headers it writes.

use std::time::Duration;

use http::header::HeaderName;

/// The response header naming the leg whose answer is passed through on a failure.
pub(crate) const FAILED_LEG_HEADER: HeaderName = HeaderName::from_static("x-disagg-failed-leg");

/// The `server-timing` response header (W3C Server Timing): `prefill`, `handoff` and
/// `decode` (time to the decode's response head), in milliseconds.
pub(crate) const SERVER_TIMING: HeaderName = HeaderName::from_static("server-timing");

/// What to do when the prefill leg cannot be had: no prefill endpoint is available
/// (none configured, none healthy, none serving the model), or the prefill leg failed
/// on the engine's side (unreachable, 5xx, timed out, an unusable answer) and retries,
/// if any, did not help.
///
/// A prefill's 4xx is the client's fault and is passed through under either policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PrefillFailure {
    /// Fail the request: 503 `no_prefill_endpoint`, or the prefill's own error (the
    /// default: a broken prefill pool must not hide behind slower answers).
    #[default]
    Fail,
    /// Send the request to a decode endpoint alone; it computes the prompt itself. The
    /// answer carries `x-disagg-handoff: decode-only` and `x-disagg-fallback` naming
    /// why (the error code, `no_prefill_endpoint` say), a warning is logged and
    /// [`OrchestratorStats::prefill_fallbacks`](super::OrchestratorStats::prefill_fallbacks) counts it. Not possible once the decode's
    /// answer has begun (a concurrent handoff whose prefill fails mid-stream ends the
    /// stream with an error) or once the deadline has passed.
    DecodeOnly,
}

/// The response header naming why a request was served decode-only under
/// [`PrefillFailure::DecodeOnly`]: the code of the prefill's failure.
pub(crate) const FALLBACK_HEADER: HeaderName = HeaderName::from_static("x-disagg-fallback");

/// The request header a client may set to shorten its request's deadline, in
/// milliseconds, when [`OrchestratorConfig::client_deadline`] allows it.
pub(crate) const DEADLINE_HEADER: HeaderName = HeaderName::from_static("x-disagg-deadline-ms");

/// Early release of a prefill's KV blocks when the decode leg that would have taken
/// them is not going to (see [`OrchestratorConfig::kv_release`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KvRelease {
    /// Leave the blocks to the prefill engine's own timeout or lease (vLLM: 30 s
    /// `kv_lease_duration`; older builds 120-480 s). The default.
    #[default]
    Off,
    /// For connectors that send the decode after the prefill
    /// ([`Dispatch::AfterPrefill`](crate::connector::Dispatch::AfterPrefill), vLLM NIXL): when a request ends after its prefill
    /// answered with a handoff but before the first frame of the decode's 2xx answer
    /// (a plan with a gate: before its head) arrived (the
    /// client left, a budget ran out, the decode could not be reached), send the
    /// decode leg anyway as a one-token, non-streaming request and drop it after
    /// `wait`: the decode engine takes (and so frees) the blocks, or, aborted while
    /// queued, tells the prefill to free them. A request cancelled while its prefill
    /// was still running waits up to `grace` for the prefill's answer in the
    /// background (an answer already on the wire would otherwise strand its blocks);
    /// a prefill still running after `grace` is aborted, which frees its blocks.
    ///
    /// Each release is a short background task (counted in
    /// [`OrchestratorStats::kv_releases_in_flight`](super::OrchestratorStats::kv_releases_in_flight)), ended by `grace` + 2 × `wait` at the
    /// latest (the prefill's answer, the connector reading it, the release leg's
    /// head, which for a plan with a [gate](crate::connector::Handoff::gate) waits for
    /// the gate first, as LMCache's KV is pushed); a release that finds nothing to
    /// release, or whose gate does not open, sends nothing. It holds the
    /// request's legs meanwhile, and with them the client's body they are cut from. A decode that
    /// already received the leg may see it twice (the second pull fails harmlessly),
    /// which is why this is opt-in.
    AbortDecode {
        /// How long a cancelled request waits for a running prefill's answer.
        grace: Duration,
        /// How long the release waits for the decode's response head before dropping
        /// it.
        wait: Duration,
    },
}

impl KvRelease {
    /// [`AbortDecode`](Self::AbortDecode) with a 250 ms grace and a 2 s wait.
    pub fn abort_decode() -> Self {
        KvRelease::AbortDecode {
            grace: Duration::from_millis(250),
            wait: Duration::from_secs(2),
        }
    }
}

/// What to do when the prefill answered 2xx but carried no KV handoff, or one the decode
/// cannot use ([`HandoffFound::Incomplete`](crate::connector::HandoffFound::Incomplete): never
/// sent on, counted in
/// [`OrchestratorStats::invalid_handoffs`](super::OrchestratorStats::invalid_handoffs)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingKv {
    /// Send the decode leg without a handoff, so the decode engine computes the prompt
    /// itself (what vLLM's reference proxy does); the answer carries
    /// `x-disagg-handoff: none` and a warning is logged. The default.
    #[default]
    LocalPrefill,
    /// Fail the request with 502 (`prefill_failed`, the message naming the prefill
    /// endpoint and, for an incomplete handoff, what it lacked).
    Fail,
}

/// Orchestrator settings.
///
/// Time budgets: a request may have a total [`deadline`](Self::deadline), and each step
/// has a budget of its own; a step gets its budget or what is left of the deadline,
/// whichever is less, and the error says which ran out (`prefill_timeout`,
/// `handoff_timeout`, `decode_timeout`, `decode_idle_timeout`, or `deadline_exceeded`,
/// all 504).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OrchestratorConfig {
    /// The whole request, from arrival to the last byte of the answer (default `None`:
    /// no total deadline, only the per-step budgets). A stream still running at the
    /// deadline is ended with an error event.
    pub deadline: Option<Duration>,
    /// Let a client shorten (never extend) its deadline with the request header
    /// `x-disagg-deadline-ms` (default off). With no configured
    /// deadline, the client's value is the deadline.
    pub client_deadline: bool,
    /// Time for the whole prefill exchange: connect, head and full answer.
    pub prefill_timeout: Duration,
    /// Time for each step of the connector's handoff work (a bootstrap lookup, folding
    /// the prefill's answer into the decode leg; default 10 s).
    pub handoff_timeout: Duration,
    /// Time from sending the decode leg to its response head.
    pub decode_head_timeout: Duration,
    /// Longest silence between two chunks of the decode's body once its head arrived
    /// (with both legs at once, once the prefill answered or a chunk came, whichever is
    /// first; a mid-stream migration's continuation being started does not count)
    /// (default 120 s; `None`: no limit). A non-streaming decode is silent until its
    /// answer is complete, so this must exceed the longest generation of those. A
    /// stream the proxy begins before the decode leg is sent (a plan's lead) does not
    /// count its wait for the KV gate and the decode's head, which have budgets of
    /// their own ([`handoff_timeout`](Self::handoff_timeout),
    /// [`decode_head_timeout`](Self::decode_head_timeout)), nor, when that head is an
    /// error, the read of its message (within what is left of the head's budget).
    pub decode_idle_timeout: Option<Duration>,
    /// Largest prefill answer read, in bytes.
    pub max_prefill_answer: usize,
    /// The prefill leg cannot be had: fail, or serve decode-only.
    pub prefill_failure: PrefillFailure,
    /// Prefill answered without a handoff.
    pub missing_kv: MissingKv,
    /// Forward the client's `authorization` header to the engines (default off): to both
    /// legs, and on the requests an adapter forwards to one engine or fans out to all
    /// (`disagg-http`). Only `authorization`, never `x-api-key`; a transport's engine
    /// key replaces it. Off, no client credential reaches an engine
    /// ([`forwardable_header`](crate::proto::forwardable_header)).
    pub forward_authorization: bool,
    /// Client headers forwarded to both legs (besides the session header, which always
    /// is; the engine-side request id is the leg's own). Never the client's
    /// credentials, its `x-request-id` or the engines' routing headers
    /// ([`forwardable_header`](crate::proto::forwardable_header)), even when listed.
    pub forward_headers: Vec<HeaderName>,
    /// Early release of a prefill's KV blocks (default off).
    pub kv_release: KvRelease,
    /// Trace requests: the share of new traces sampled, from 0 to 1 (a client's
    /// `traceparent` decides for its own trace). Each leg then carries a `traceparent`
    /// naming its own span, and reports and summaries carry the spans' ids (see
    /// [`TraceIds`](crate::outcome::TraceIds)). `None` (the default): no trace ids are drawn, and the
    /// client's `traceparent` is forwarded as it came (see `forward_headers`).
    pub trace_ratio: Option<f64>,
    /// Longest wait for a request's token ids (see [`tokens`](crate::tokens); default
    /// 2 s); past it the request is routed without them. A tokenizer in process takes
    /// milliseconds (tens for a 32k-token prompt), an engine's `/tokenize` a round
    /// trip: a longer wait means the tokenizer is stuck, and routing without cache
    /// information beats waiting on it.
    pub tokenize_timeout: Duration,
    /// Mid-stream migration of a decode stream that breaks after the answer began
    /// (default off).
    pub migration: super::MigrationConfig,
}

impl OrchestratorConfig {
    /// The deadline of a request that arrived at `arrival` (its head came in) with
    /// `headers`: [`deadline`](Self::deadline) from then, shortened by the client's
    /// `x-disagg-deadline-ms` when [`client_deadline`](Self::client_deadline) allows it;
    /// `None` without one, or when it lies past the last instant the clock can represent
    /// (the header is a u64 of milliseconds, `--deadline` any number of seconds: no
    /// deadline rather than the panic of `Instant + Duration`). The orchestrator counts
    /// from [`PdRequest`](crate::PdRequest)'s arrival, so the time its body took to come
    /// in is part of the budget; an adapter serving a request itself (a direct route)
    /// passes the instant its head came in and keeps the same deadline.
    pub fn deadline_for(
        &self,
        headers: &http::HeaderMap,
        arrival: tokio::time::Instant,
    ) -> Option<tokio::time::Instant> {
        let client = self
            .client_deadline
            .then(|| headers.get(DEADLINE_HEADER))
            .flatten()
            .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
            .map(Duration::from_millis);
        let total = match (self.deadline, client) {
            (Some(c), Some(h)) => Some(c.min(h)),
            (c, h) => c.or(h),
        };
        total.and_then(|t| arrival.checked_add(t))
    }
}

impl Default for OrchestratorConfig {
    fn default() -> Self {
        OrchestratorConfig {
            deadline: None,
            client_deadline: false,
            // A long prompt can take tens of seconds to prefill on a busy engine.
            prefill_timeout: Duration::from_secs(300),
            handoff_timeout: Duration::from_secs(10),
            decode_idle_timeout: Some(Duration::from_secs(120)),
            // The decode engine may queue the request before its head goes out.
            decode_head_timeout: Duration::from_secs(300),
            // Answers to max_tokens=1 requests are small; prompt logprobs are removed.
            max_prefill_answer: 8 * 1024 * 1024,
            prefill_failure: PrefillFailure::Fail,
            missing_kv: MissingKv::LocalPrefill,
            forward_authorization: false,
            forward_headers: vec![
                HeaderName::from_static("traceparent"),
                HeaderName::from_static("tracestate"),
                HeaderName::from_static("x-correlation-id"),
            ],
            kv_release: KvRelease::Off,
            trace_ratio: None,
            tokenize_timeout: Duration::from_secs(2),
            migration: super::MigrationConfig::default(),
        }
    }
}
