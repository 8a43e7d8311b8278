//! Counters of an engine and the guards that keep them honest.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::{Deserialize, Serialize};

/// A snapshot of an engine's counters, from [`SimEngine::stats`] or
/// `GET /stats`.
///
/// [`SimEngine::stats`]: crate::SimEngine::stats
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Stats {
    /// Completion and chat requests received (counted once their body is in: one
    /// whose body never came whole, [`SimConfig::body_read_timeout`] or a client that
    /// left, is not a request here).
    ///
    /// [`SimConfig::body_read_timeout`]: crate::SimConfig::body_read_timeout
    pub requests: u64,
    /// Requests that came with `kv_transfer_params.do_remote_decode` set
    /// (this engine acted as the prefill); in the other modes, requests a
    /// prefill served for a decode (SGLang, Mooncake, LMCache with a
    /// `disagg_spec`).
    pub prefill_requests: u64,
    /// Prefill answers that carried `kv_transfer_params`.
    pub kv_params_returned: u64,
    /// Decode requests whose KV was pulled over the side channel.
    pub remote_decodes: u64,
    /// Decode requests whose pull failed (answered with 500).
    pub kv_pull_failures: u64,
    /// Decode requests with `kv_transfer_params` that vLLM rejects as
    /// invalid (they are prefilled locally).
    pub invalid_kv_params: u64,
    /// vLLM 0.33 decode: times a partial handoff killed the engine core (a
    /// NIXL pull dict with `do_remote_prefill` and no `remote_block_ids`, an
    /// assertion in the scheduler; a push dict without `remote_engine_id`,
    /// `remote_host`, `remote_port` or `tp_size`, a `KeyError`). From the
    /// first on the engine is dead, as vLLM's is: every completion request
    /// answers 500 and `GET /health` 503.
    #[serde(default)]
    pub engine_core_deaths: u64,
    /// vLLM 0.33 decode: requests parked waiting for KV no transfer was
    /// queued for (a NIXL pull dict with block ids but without
    /// `remote_engine_id`, `remote_request_id`, `remote_host` or
    /// `remote_port`): they hang until the client leaves.
    #[serde(default)]
    pub stuck_kv_waits: u64,
    /// Requests that computed their prompt locally, without remote KV
    /// (plain requests and prefills included).
    pub local_prefills: u64,
    /// Pulls served by this engine's side channel (as a prefill).
    pub side_channel_served: u64,
    /// KV blocks currently held for a remote decode: a vLLM NIXL prefill's
    /// blocks (freed when pulled, released by an aborted decode, or when the
    /// lease expires) and the blocks of the SGLang rooms and Mooncake
    /// transfers counted in [`Stats::kv_transfers_pending`] (freed with
    /// them). See the crate's "KV block lifetime" section.
    pub blocks_held: u64,
    /// Completion requests currently being processed (from when their body is in:
    /// what `/metrics` reports running).
    pub active_requests: u64,
    /// Of those, the ones waiting for their rank's prefill slot
    /// ([`SimConfig::serial_prefill`](crate::SimConfig::serial_prefill)): its
    /// `/metrics`' waiting requests (the others are running).
    pub waiting_requests: u64,
    /// HTTP connections currently open.
    pub open_connections: u64,
    /// HTTP connections accepted since the engine started (requests served in process
    /// through [`SimEngine::service`](crate::SimEngine::service) open none).
    #[serde(default)]
    pub http_connections: u64,
    /// Requests whose client went away before the answer was complete.
    pub cancelled: u64,
    /// Connections accepted by the KV side channel (a decode reuses its connection for
    /// further pulls, as vLLM reuses its NIXL handshake).
    pub side_channel_connections: u64,
    /// Times a side gave up waiting for its peer within
    /// [`SimConfig::bootstrap_timeout`](crate::SimConfig::bootstrap_timeout)
    /// (SGLang and Mooncake modes).
    #[serde(default)]
    pub bootstrap_timeouts: u64,
    /// SGLang rooms and Mooncake transfer ids registered by this prefill and
    /// not yet taken by a decode (freed when taken, when the request ends or
    /// is cancelled, or when the lease expires).
    #[serde(default)]
    pub kv_transfers_pending: u64,
    /// vLLM NIXL prefill: requests whose held blocks were freed early by a
    /// release notice from a decode that was aborted before it pulled them
    /// (see [`SideChannelRelease`](crate::SideChannelRelease)). Notices that
    /// freed nothing (wrong engine id, unknown request id, blocks already
    /// pulled) are not counted.
    #[serde(default)]
    pub kv_released_on_abort: u64,
    /// vLLM NIXL decode: release notices sent to a prefill's side channel
    /// because a request with valid remote-prefill `kv_transfer_params` ended
    /// before its pull completed; counted when sent, whatever the prefill
    /// answers.
    #[serde(default)]
    pub kv_releases_sent: u64,
    /// `POST /tokenize` requests served (in every mode; not counted in
    /// [`Stats::requests`]).
    #[serde(default)]
    pub tokenize_requests: u64,
    /// LMCache prefill: KV pushes to a decode's receiver rank that the
    /// receiver acknowledged (one per rank).
    #[serde(default)]
    pub kv_pushes: u64,
    /// LMCache prefill: KV pushes to a receiver rank that failed (nobody
    /// listening, wrong port, refused by the receiver, timed out).
    #[serde(default)]
    pub kv_push_failures: u64,
    /// LMCache prefill: `ProxyNotif` notifications handed to the ZMQ socket,
    /// duplicates included.
    #[serde(default)]
    pub notifications_sent: u64,
    /// LMCache prefill: notifications dropped by
    /// [`Faults::notify_loss`](crate::Faults::notify_loss).
    #[serde(default)]
    pub notifications_lost: u64,
    /// LMCache prefill: notifications that could not be sent (no proxy
    /// reachable within the send timeout).
    #[serde(default)]
    pub notification_failures: u64,
    /// LMCache decode: KV pushes received and acknowledged (one per rank).
    #[serde(default)]
    pub kv_received: u64,
    /// LMCache decode: requests refused because the KV of their prompt had
    /// not arrived on every rank.
    #[serde(default)]
    pub kv_missing: u64,
    /// LMCache decode: received KV dropped because no request took it
    /// within [`SimConfig::kv_lease`](crate::SimConfig::kv_lease) (one per
    /// rank).
    #[serde(default)]
    pub kv_expired: u64,
    /// vLLM engines: accepted requests with `use_beam_search: true`. vLLM
    /// builds beam-search parameters for them, which carry no
    /// `kv_transfer_params`: such a request is served like a plain one
    /// whatever its parameters say (a prefill holds nothing, a decode
    /// computes its prompt locally).
    #[serde(default)]
    pub beam_search_requests: u64,
    /// vLLM engines: accepted requests that make the engine compile a
    /// grammar (structured output: `response_format` of type `json_object`,
    /// `json_schema` or `structural_tag`, `structured_outputs`, or a
    /// `guided_json`, `guided_regex`, `guided_choice` or `guided_grammar`
    /// field). Not counted by SGLang engines.
    #[serde(default)]
    pub grammars_compiled: u64,
    /// Completion requests placed on each data-parallel rank, indexed by
    /// rank ([`SimConfig::dp_size`](crate::SimConfig::dp_size) entries). An
    /// SGLang engine counts each element of a batch on its own rank.
    #[serde(default)]
    pub requests_per_dp_rank: Vec<u64>,
    /// SGLang prefill: requests refused because the rank they were pinned
    /// to is not the one their `bootstrap_room` implies
    /// (`follow_bootstrap_room conflict`).
    #[serde(default)]
    pub dp_rank_conflicts: u64,
    /// Prefix cache ([`SimConfig::prefix_cache_blocks`](crate::SimConfig::prefix_cache_blocks)):
    /// prompt tokens of local prefills looked up in it.
    #[serde(default)]
    pub prefix_cache_query_tokens: u64,
    /// Prefix cache: prompt tokens of local prefills found in it (not computed); the
    /// hit rate is this over [`Stats::prefix_cache_query_tokens`].
    #[serde(default)]
    pub prefix_cache_hit_tokens: u64,
    /// Prefix cache: blocks held now, all ranks together.
    #[serde(default)]
    pub prefix_cache_blocks: u64,
    /// Prefix cache: blocks evicted to make room.
    #[serde(default)]
    pub prefix_cache_evictions: u64,
    /// KV events ([`SimConfig::kv_events`](crate::SimConfig::kv_events)): batches
    /// published (sequence numbers used), lost ones included.
    #[serde(default)]
    pub kv_event_batches: u64,
    /// KV events: replay requests served.
    #[serde(default)]
    pub kv_event_replays: u64,
    /// With [`SimConfig::api_key`](crate::SimConfig::api_key): requests on any path
    /// that did not carry the key, those the engine served (paths outside `/v1`, as
    /// vLLM) and those it refused alike; `GET /stats` is not counted.
    #[serde(default)]
    pub requests_without_key: u64,
    /// With [`SimConfig::api_key`](crate::SimConfig::api_key): requests answered 401.
    #[serde(default)]
    pub unauthorized: u64,
    /// With [`SimConfig::tls`](crate::SimConfig::tls): TLS handshakes that failed
    /// (a client that does not trust the certificate, no client certificate where one
    /// is required).
    #[serde(default)]
    pub tls_handshake_failures: u64,
    /// SGLang engines: `POST /generate` requests received (also counted in
    /// [`Stats::requests`]).
    #[serde(default)]
    pub generate_requests: u64,
    /// `POST /detokenize` requests served.
    #[serde(default)]
    pub detokenize_requests: u64,
    /// `POST /v1/embeddings` requests served.
    #[serde(default)]
    pub embeddings_requests: u64,
    /// `POST /v1/responses` requests served.
    #[serde(default)]
    pub responses_requests: u64,
    /// vLLM NIXL prefills given a decode's own handoff (bidirectional KV) that pulled
    /// its blocks over the decode's side channel.
    #[serde(default)]
    pub bidi_pulls: u64,
    /// Prompt tokens those prefills pulled rather than computed.
    #[serde(default)]
    pub bidi_tokens_pulled: u64,
    /// Prompt tokens prefills given a decode's handoff computed themselves (what the
    /// pull did not cover, or all of it when it was not made or failed).
    #[serde(default)]
    pub bidi_tokens_computed: u64,
    /// Pulls of a decode's handoff that failed (wrong host, port, engine id, request
    /// id or blocks; expired blocks): the prefill recomputed, as vLLM does.
    #[serde(default)]
    pub bidi_pull_failures: u64,
    /// Decode handoffs not pulled: `remote_num_tokens` absent or under
    /// [`SimConfig::kv_recompute_threshold`](crate::SimConfig::kv_recompute_threshold).
    #[serde(default)]
    pub bidi_below_threshold: u64,
    /// Admin requests received (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`,
    /// `/reset_prefix_cache`), answered or refused.
    #[serde(default)]
    pub admin_requests: u64,
    /// vLLM engines: chat prompts templated and tokenized from their messages (a chat
    /// request whose `kv_transfer_params` carried usable `prompt_token_ids` is not).
    #[serde(default)]
    pub chat_prompts_tokenized: u64,
    /// vLLM engines: chat requests whose prompt was the `prompt_token_ids` of their
    /// `kv_transfer_params` (vLLM 0.33's prompt-token reuse).
    #[serde(default)]
    pub prompt_ids_reused: u64,
    /// Encoder-only engines (E/P/D): media items encoded and written to the shared
    /// store.
    #[serde(default)]
    pub ec_items_encoded: u64,
    /// E/P/D consumers: media items whose encoder output was read from the shared
    /// store.
    #[serde(default)]
    pub ec_items_loaded: u64,
    /// E/P/D consumers: of [`ec_items_loaded`](Self::ec_items_loaded), those read by
    /// each data-parallel rank, indexed by rank (a push consumer takes an item only
    /// from its request's rank's own EC port; the shared store counts on rank 0).
    #[serde(default)]
    pub ec_items_loaded_per_dp_rank: Vec<u64>,
    /// `GET /metrics` requests received (whatever [`Faults::metrics`](crate::Faults::metrics)
    /// made of their answer).
    #[serde(default)]
    pub metrics_requests: u64,
    /// Prompt tokens computed here (vLLM's
    /// `prompt_tokens_by_source{source="local_compute"}`): plain requests, prefills,
    /// and decodes that computed the prompt themselves (no handoff, a lost or failed one).
    #[serde(default)]
    pub prompt_tokens_local: u64,
    /// Prompt tokens found in this engine's prefix cache (`local_cache_hit`).
    #[serde(default)]
    pub prompt_tokens_cached: u64,
    /// Prompt tokens whose KV arrived from a prefill (`external_kv_transfer`).
    #[serde(default)]
    pub prompt_tokens_external: u64,
    /// vLLM NIXL decode: KV transfers that failed (`nixl_num_failed_transfers`), by
    /// [`Faults::fail_transfers`](crate::Faults::fail_transfers); the prompt is then
    /// computed here.
    #[serde(default)]
    pub failed_transfers: u64,
    /// vLLM NIXL prefill: requests whose held KV expired unclaimed
    /// (`nixl_num_kv_expired_reqs`): no decode pulled or released it within
    /// [`SimConfig::kv_lease`](crate::SimConfig::kv_lease).
    #[serde(default)]
    pub kv_expired_reqs: u64,
}

/// The live counters behind [`Stats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) requests: AtomicU64,
    pub(crate) prefill_requests: AtomicU64,
    pub(crate) kv_params_returned: AtomicU64,
    pub(crate) remote_decodes: AtomicU64,
    pub(crate) kv_pull_failures: AtomicU64,
    pub(crate) invalid_kv_params: AtomicU64,
    pub(crate) engine_core_deaths: AtomicU64,
    pub(crate) stuck_kv_waits: AtomicU64,
    pub(crate) local_prefills: AtomicU64,
    pub(crate) side_channel_served: AtomicU64,
    pub(crate) blocks_held: AtomicU64,
    pub(crate) active_requests: AtomicU64,
    pub(crate) waiting_requests: AtomicU64,
    pub(crate) open_connections: AtomicU64,
    pub(crate) http_connections: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) side_channel_connections: AtomicU64,
    pub(crate) bootstrap_timeouts: AtomicU64,
    pub(crate) kv_transfers_pending: AtomicU64,
    pub(crate) kv_released_on_abort: AtomicU64,
    pub(crate) kv_releases_sent: AtomicU64,
    pub(crate) tokenize_requests: AtomicU64,
    pub(crate) kv_pushes: AtomicU64,
    pub(crate) kv_push_failures: AtomicU64,
    pub(crate) notifications_sent: AtomicU64,
    pub(crate) notifications_lost: AtomicU64,
    pub(crate) notification_failures: AtomicU64,
    pub(crate) kv_received: AtomicU64,
    pub(crate) kv_missing: AtomicU64,
    pub(crate) kv_expired: AtomicU64,
    pub(crate) beam_search_requests: AtomicU64,
    pub(crate) grammars_compiled: AtomicU64,
    /// One counter per data-parallel rank (none in [`Counters::default`]).
    pub(crate) requests_per_dp_rank: Box<[AtomicU64]>,
    pub(crate) dp_rank_conflicts: AtomicU64,
    pub(crate) prefix_cache_query_tokens: AtomicU64,
    pub(crate) prefix_cache_hit_tokens: AtomicU64,
    pub(crate) prefix_cache_blocks: AtomicU64,
    pub(crate) prefix_cache_evictions: AtomicU64,
    pub(crate) kv_event_batches: AtomicU64,
    pub(crate) kv_event_replays: AtomicU64,
    pub(crate) requests_without_key: AtomicU64,
    pub(crate) unauthorized: AtomicU64,
    pub(crate) tls_handshake_failures: AtomicU64,
    pub(crate) generate_requests: AtomicU64,
    pub(crate) detokenize_requests: AtomicU64,
    pub(crate) embeddings_requests: AtomicU64,
    pub(crate) responses_requests: AtomicU64,
    pub(crate) bidi_pulls: AtomicU64,
    pub(crate) bidi_tokens_pulled: AtomicU64,
    pub(crate) bidi_tokens_computed: AtomicU64,
    pub(crate) bidi_pull_failures: AtomicU64,
    pub(crate) bidi_below_threshold: AtomicU64,
    pub(crate) admin_requests: AtomicU64,
    pub(crate) chat_prompts_tokenized: AtomicU64,
    pub(crate) prompt_ids_reused: AtomicU64,
    pub(crate) ec_items_encoded: AtomicU64,
    pub(crate) ec_items_loaded: AtomicU64,
    /// One counter per data-parallel rank (none in [`Counters::default`]).
    pub(crate) ec_items_loaded_per_dp_rank: Box<[AtomicU64]>,
    pub(crate) metrics_requests: AtomicU64,
    pub(crate) prompt_tokens_local: AtomicU64,
    pub(crate) prompt_tokens_cached: AtomicU64,
    pub(crate) prompt_tokens_external: AtomicU64,
    pub(crate) failed_transfers: AtomicU64,
    pub(crate) kv_expired_reqs: AtomicU64,
}

pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Relaxed);
}

impl Counters {
    /// Counters of an engine with `dp_size` data-parallel ranks.
    pub(crate) fn with_dp_size(dp_size: usize) -> Self {
        Self {
            requests_per_dp_rank: (0..dp_size).map(|_| AtomicU64::new(0)).collect(),
            ec_items_loaded_per_dp_rank: (0..dp_size).map(|_| AtomicU64::new(0)).collect(),
            ..Self::default()
        }
    }

    /// Counts a prefix-cache lookup of `query` prompt tokens that found `hit`.
    pub(crate) fn add_prefix_lookup(&self, query: usize, hit: usize) {
        self.prefix_cache_query_tokens
            .fetch_add(query as u64, Relaxed);
        self.prefix_cache_hit_tokens.fetch_add(hit as u64, Relaxed);
    }

    /// Counts a rank's prefix cache going from `before` to `after` blocks, `evicted`
    /// of them evicted.
    pub(crate) fn prefix_blocks_changed(&self, before: usize, after: usize, evicted: usize) {
        self.prefix_cache_blocks.fetch_add(after as u64, Relaxed);
        self.prefix_cache_blocks.fetch_sub(before as u64, Relaxed);
        self.prefix_cache_evictions
            .fetch_add(evicted as u64, Relaxed);
    }

    /// Counts `n` media items' encoder output read by a request on `rank`.
    pub(crate) fn ec_loaded(&self, rank: usize, n: usize) {
        self.ec_items_loaded.fetch_add(n as u64, Relaxed);
        if let Some(counter) = self.ec_items_loaded_per_dp_rank.get(rank) {
            counter.fetch_add(n as u64, Relaxed);
        }
    }

    /// Counts a request placed on `rank` (ignored if out of range).
    pub(crate) fn bump_rank(&self, rank: usize) {
        if let Some(counter) = self.requests_per_dp_rank.get(rank) {
            bump(counter);
        }
    }

    pub(crate) fn snapshot(&self) -> Stats {
        Stats {
            requests: self.requests.load(Relaxed),
            prefill_requests: self.prefill_requests.load(Relaxed),
            kv_params_returned: self.kv_params_returned.load(Relaxed),
            remote_decodes: self.remote_decodes.load(Relaxed),
            kv_pull_failures: self.kv_pull_failures.load(Relaxed),
            invalid_kv_params: self.invalid_kv_params.load(Relaxed),
            engine_core_deaths: self.engine_core_deaths.load(Relaxed),
            stuck_kv_waits: self.stuck_kv_waits.load(Relaxed),
            local_prefills: self.local_prefills.load(Relaxed),
            side_channel_served: self.side_channel_served.load(Relaxed),
            blocks_held: self.blocks_held.load(Relaxed),
            active_requests: self.active_requests.load(Relaxed),
            waiting_requests: self.waiting_requests.load(Relaxed),
            open_connections: self.open_connections.load(Relaxed),
            http_connections: self.http_connections.load(Relaxed),
            cancelled: self.cancelled.load(Relaxed),
            side_channel_connections: self.side_channel_connections.load(Relaxed),
            bootstrap_timeouts: self.bootstrap_timeouts.load(Relaxed),
            kv_transfers_pending: self.kv_transfers_pending.load(Relaxed),
            kv_released_on_abort: self.kv_released_on_abort.load(Relaxed),
            kv_releases_sent: self.kv_releases_sent.load(Relaxed),
            tokenize_requests: self.tokenize_requests.load(Relaxed),
            kv_pushes: self.kv_pushes.load(Relaxed),
            kv_push_failures: self.kv_push_failures.load(Relaxed),
            notifications_sent: self.notifications_sent.load(Relaxed),
            notifications_lost: self.notifications_lost.load(Relaxed),
            notification_failures: self.notification_failures.load(Relaxed),
            kv_received: self.kv_received.load(Relaxed),
            kv_missing: self.kv_missing.load(Relaxed),
            kv_expired: self.kv_expired.load(Relaxed),
            beam_search_requests: self.beam_search_requests.load(Relaxed),
            grammars_compiled: self.grammars_compiled.load(Relaxed),
            requests_per_dp_rank: self
                .requests_per_dp_rank
                .iter()
                .map(|c| c.load(Relaxed))
                .collect(),
            dp_rank_conflicts: self.dp_rank_conflicts.load(Relaxed),
            prefix_cache_query_tokens: self.prefix_cache_query_tokens.load(Relaxed),
            prefix_cache_hit_tokens: self.prefix_cache_hit_tokens.load(Relaxed),
            prefix_cache_blocks: self.prefix_cache_blocks.load(Relaxed),
            prefix_cache_evictions: self.prefix_cache_evictions.load(Relaxed),
            kv_event_batches: self.kv_event_batches.load(Relaxed),
            kv_event_replays: self.kv_event_replays.load(Relaxed),
            requests_without_key: self.requests_without_key.load(Relaxed),
            unauthorized: self.unauthorized.load(Relaxed),
            tls_handshake_failures: self.tls_handshake_failures.load(Relaxed),
            generate_requests: self.generate_requests.load(Relaxed),
            detokenize_requests: self.detokenize_requests.load(Relaxed),
            embeddings_requests: self.embeddings_requests.load(Relaxed),
            responses_requests: self.responses_requests.load(Relaxed),
            bidi_pulls: self.bidi_pulls.load(Relaxed),
            bidi_tokens_pulled: self.bidi_tokens_pulled.load(Relaxed),
            bidi_tokens_computed: self.bidi_tokens_computed.load(Relaxed),
            bidi_pull_failures: self.bidi_pull_failures.load(Relaxed),
            bidi_below_threshold: self.bidi_below_threshold.load(Relaxed),
            admin_requests: self.admin_requests.load(Relaxed),
            chat_prompts_tokenized: self.chat_prompts_tokenized.load(Relaxed),
            prompt_ids_reused: self.prompt_ids_reused.load(Relaxed),
            ec_items_encoded: self.ec_items_encoded.load(Relaxed),
            ec_items_loaded: self.ec_items_loaded.load(Relaxed),
            ec_items_loaded_per_dp_rank: self
                .ec_items_loaded_per_dp_rank
                .iter()
                .map(|c| c.load(Relaxed))
                .collect(),
            metrics_requests: self.metrics_requests.load(Relaxed),
            prompt_tokens_local: self.prompt_tokens_local.load(Relaxed),
            prompt_tokens_cached: self.prompt_tokens_cached.load(Relaxed),
            prompt_tokens_external: self.prompt_tokens_external.load(Relaxed),
            failed_transfers: self.failed_transfers.load(Relaxed),
            kv_expired_reqs: self.kv_expired_reqs.load(Relaxed),
        }
    }
}

/// Work undone when a request is cancelled.
type OnCancel = Box<dyn FnOnce() + Send + Sync>;

/// Counts a completion request as active while it lives. Dropped before
/// [`RequestGuard::complete`] was called, it counts the request as
/// cancelled: its client went away (or the engine shut down) first.
pub(crate) struct RequestGuard {
    counters: Arc<Counters>,
    complete: bool,
    on_cancel: Option<OnCancel>,
    /// Values that live as long as the request (its data-parallel rank's
    /// load), dropped with the guard.
    kept: Vec<Box<dyn std::any::Any + Send + Sync>>,
}

impl fmt::Debug for RequestGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestGuard")
            .field("complete", &self.complete)
            .field("on_cancel", &self.on_cancel.is_some())
            .finish_non_exhaustive()
    }
}

impl RequestGuard {
    pub(crate) fn new(counters: Arc<Counters>) -> Self {
        bump(&counters.requests);
        bump(&counters.active_requests);
        Self {
            counters,
            complete: false,
            on_cancel: None,
            kept: Vec::new(),
        }
    }

    /// Keeps `value` until the request ends, whatever way it ends.
    pub(crate) fn keep(&mut self, value: impl Send + Sync + 'static) {
        self.kept.push(Box::new(value));
    }

    /// Runs `undo` if the request is cancelled (dropped before
    /// [`RequestGuard::complete`]), e.g. to free KV held for an answer its
    /// client never got.
    pub(crate) fn on_cancel(&mut self, undo: impl FnOnce() + Send + Sync + 'static) {
        self.on_cancel = Some(Box::new(undo));
    }

    /// Forgets the work registered with [`RequestGuard::on_cancel`]: from now
    /// on, a cancellation undoes nothing.
    pub(crate) fn disarm(&mut self) {
        self.on_cancel = None;
    }

    /// Marks the answer as fully handed over (or deliberately aborted).
    pub(crate) fn complete(&mut self) {
        self.complete = true;
    }
}

/// Counts a request as waiting (for its prefill slot) until dropped.
pub(crate) struct Waiting<'a>(&'a AtomicU64);

impl<'a> Waiting<'a> {
    pub(crate) fn new(counters: &'a Counters) -> Self {
        bump(&counters.waiting_requests);
        Waiting(&counters.waiting_requests)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.counters.active_requests.fetch_sub(1, Relaxed);
        if !self.complete {
            bump(&self.counters.cancelled);
            if let Some(undo) = self.on_cancel.take() {
                undo();
            }
        }
    }
}

/// Counts an HTTP connection as open while it lives.
#[derive(Debug)]
pub(crate) struct ConnectionGuard(Arc<Counters>);

impl ConnectionGuard {
    pub(crate) fn new(counters: Arc<Counters>) -> Self {
        bump(&counters.open_connections);
        bump(&counters.http_connections);
        Self(counters)
    }
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.0.open_connections.fetch_sub(1, Relaxed);
    }
}
