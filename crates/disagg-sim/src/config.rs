//! Engine configuration and fault injection knobs.

use std::time::Duration;

/// Configuration of a [`SimEngine`](crate::SimEngine).
///
/// Every field has a sensible default (see [`SimConfig::default`]), so the
/// usual way to build one is struct-update syntax:
///
/// ```
/// use std::time::Duration;
/// use disagg_sim::SimConfig;
///
/// let config = SimConfig {
///     inter_token_delay: Duration::from_millis(5),
///     ..SimConfig::default()
/// };
/// assert_eq!(config.model, "sim-model");
/// ```
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Served model name (`"sim-model"` by default). Requests naming another
    /// model are answered with 404, like vLLM.
    pub model: String,
    /// The NIXL engine id put in `kv_transfer_params.remote_engine_id`
    /// (Mooncake: the engine id of data-parallel rank 0). `None` (the
    /// default) draws a random UUID at start.
    pub engine_id: Option<String>,
    /// The `remote_host` advertised in `kv_transfer_params` (default
    /// `"127.0.0.1"`). A decode engine connects to this host and the side
    /// channel port to pull the KV blocks.
    pub advertised_host: String,
    /// Time to prefill one prompt token locally (default zero).
    pub prefill_delay_per_token: Duration,
    /// Time between two generated tokens (default zero).
    pub inter_token_delay: Duration,
    /// Number of tokens generated when the request names no maximum
    /// (default 16).
    pub default_max_tokens: u32,
    /// An end-of-sequence token is drawn at a position with probability
    /// `1/eos_period`, deterministically from the prompt; `0` (the default)
    /// means never.
    pub eos_period: u32,
    /// How long a prefill keeps KV blocks nobody pulled (default 30 s, like
    /// vLLM's `kv_lease_duration`).
    pub kv_lease: Duration,
    /// Prompt tokens per KV block (default 16).
    pub block_size: usize,
    /// Context length of the model (default 8192): prompt plus requested
    /// completion tokens beyond it are rejected with 400.
    pub max_model_len: u32,
    /// How many of the last completion requests [`SimEngine::requests`]
    /// keeps (default 256; 0 records nothing, which the benchmarks use).
    ///
    /// [`SimEngine::requests`]: crate::SimEngine::requests
    pub record_requests: usize,
    /// Faults injected into the completion routes.
    pub faults: Faults,
    /// Which P/D KV protocol the engine speaks (default [`KvMode::Nixl`]).
    pub kv_mode: KvMode,
    /// How long a side waits for its peer (default 300 s, like SGLang's
    /// `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT` and `..._WAITING_TIMEOUT`):
    /// a decode for the prefill's room or transfer id, a bootstrap server or
    /// side channel for the room or transfer id a decode asks for, an SGLang
    /// prefill for a decode to take its KV. Unused in [`KvMode::Nixl`].
    pub bootstrap_timeout: Duration,
    /// Fixed time before the engine starts working on any completion request
    /// (scheduling, queueing), before the prefill, in every mode (default
    /// zero).
    pub request_delay: Duration,
    /// Data-parallel ranks (default 1). In [`KvMode::Mooncake`] each rank
    /// has its own engine id (see
    /// [`SimEngine::engine_ids`](crate::SimEngine::engine_ids)), picked by
    /// the `X-data-parallel-rank` request header. Values below 1 count as 1.
    pub dp_size: u32,
    /// vLLM NIXL decode: whether a decode aborted before its KV pull tells the
    /// prefill to free the blocks (default `true`, as vLLM's decode does since
    /// it handles aborted remote-prefill requests). `false` models an engine
    /// that leaves them to the prefill's lease, which is what a proxy's early
    /// release ([`KvRelease`] in disagg-core) is for.
    ///
    /// [`KvRelease`]: https://docs.rs/disagg-core/latest/disagg_core/orchestrator/enum.KvRelease.html
    pub release_on_abort: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            model: "sim-model".to_owned(),
            engine_id: None,
            advertised_host: "127.0.0.1".to_owned(),
            prefill_delay_per_token: Duration::ZERO,
            inter_token_delay: Duration::ZERO,
            default_max_tokens: 16,
            eos_period: 0,
            kv_lease: Duration::from_secs(30),
            block_size: 16,
            max_model_len: 8192,
            record_requests: 256,
            faults: Faults::default(),
            kv_mode: KvMode::Nixl,
            bootstrap_timeout: Duration::from_secs(300),
            request_delay: Duration::ZERO,
            dp_size: 1,
            release_on_abort: true,
        }
    }
}

/// Which prefill/decode KV protocol an engine speaks.
///
/// See the [crate documentation](crate) for each protocol on the wire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum KvMode {
    /// vLLM's NIXL connector, pull mode: the prefill answers with
    /// `kv_transfer_params` naming its KV blocks and the decode, sent
    /// afterwards, pulls them over the side channel. One engine plays both
    /// roles, as the request's `kv_transfer_params` say.
    #[default]
    Nixl,
    /// SGLang started with `--disaggregation-mode prefill|decode`: the router
    /// sends the same request, with `bootstrap_host`, `bootstrap_port` and
    /// `bootstrap_room`, to both engines at once; the decode fetches the KV of
    /// each room from the prefill's bootstrap server.
    Sglang(SimRole),
    /// vLLM's (newer, concurrent) MooncakeConnector with `kv_role`
    /// `kv_producer` ([`SimRole::Prefill`]) or `kv_consumer`
    /// ([`SimRole::Decode`]): the proxy sends both legs at once, correlated by
    /// a proxy-chosen `transfer_id`; the decode looks the prefill's engine id
    /// up on its bootstrap server and pulls the KV over the side channel.
    Mooncake(SimRole),
}

impl KvMode {
    /// Whether this engine runs a bootstrap server
    /// ([`SimEngine::bootstrap_addr`](crate::SimEngine::bootstrap_addr)):
    /// SGLang and Mooncake prefills do.
    pub fn has_bootstrap_server(self) -> bool {
        matches!(
            self,
            KvMode::Sglang(SimRole::Prefill) | KvMode::Mooncake(SimRole::Prefill)
        )
    }
}

/// The role of an engine in a protocol where engines are started as either
/// prefill or decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimRole {
    /// Computes prompts' KV and hands it to decodes.
    Prefill,
    /// Takes KV from a prefill and generates.
    Decode,
}

/// Faults injected into the completion routes (`/v1/completions` and
/// `/v1/chat/completions`); `/health`, `/v1/models` and `/stats` keep
/// working. They can be changed at run time with
/// [`SimEngine::set_faults`](crate::SimEngine::set_faults): a request sees
/// the faults of the moment it arrived.
///
/// Precedence, when several are set: `status` wins over everything (the
/// request is answered at once, before any KV work); then `hang` (nothing is
/// answered); then `stall_after_chunks` wins over `drop_after_chunks` (the
/// connection is never dropped after a stall). `malformed_kv_params` only
/// changes the body of a vLLM NIXL prefill's answer and combines with the
/// two body faults.
///
/// What a proxy's fault matrix can inject with them, per connector:
///
/// | fault | how |
/// |---|---|
/// | connection refused | a port nobody listens on (no engine needed) |
/// | 500, 503, any status | `status` |
/// | hang before the response head | `hang` |
/// | hang mid-stream (or mid-body) | `stall_after_chunks` |
/// | connection dropped mid-stream (or mid-body) | `drop_after_chunks` |
/// | slow prefill, beyond a budget | [`SimConfig::prefill_delay_per_token`], [`SimConfig::request_delay`] |
/// | malformed `kv_transfer_params` (vLLM NIXL) | `malformed_kv_params` |
/// | bootstrap never met (SGLang, Mooncake) | a decode whose prefill never gets the request: it answers 500 after [`SimConfig::bootstrap_timeout`], counted in [`Stats::bootstrap_timeouts`](crate::Stats::bootstrap_timeouts) |
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Answer every completion request with this HTTP status and a vLLM
    /// error body.
    pub status: Option<u16>,
    /// Accept completion requests and never answer, until the client leaves
    /// (counted in [`Stats::cancelled`](crate::Stats::cancelled)).
    pub hang: bool,
    /// Streaming: after this many SSE events, abort the connection (no
    /// `[DONE]`, no clean end of the chunked body). Non-streaming: abort the
    /// connection before the body is complete.
    pub drop_after_chunks: Option<usize>,
    /// Streaming: after this many SSE events (`Some(0)`: right after the
    /// response head), send nothing more but keep the connection open until
    /// the client leaves. Non-streaming: send the head (with the full
    /// `content-length`) and half the body, then hang likewise. The request
    /// counts as cancelled ([`Stats::cancelled`](crate::Stats::cancelled))
    /// when the client leaves.
    pub stall_after_chunks: Option<usize>,
    /// vLLM NIXL prefills (requests with `kv_transfer_params.do_remote_decode`)
    /// answer 200 with `"kv_transfer_params": "malformed by fault injection"`,
    /// a JSON string where an object is expected, and hold no KV blocks: a
    /// proxy cannot hand anything to a decode, and nothing is stranded if it
    /// gives up. A streamed prefill holds no blocks either. No effect on
    /// other requests and in the other [`KvMode`]s, whose prefills answer no
    /// parameters.
    pub malformed_kv_params: bool,
}
