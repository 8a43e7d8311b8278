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
    /// The NIXL engine id put in `kv_transfer_params.remote_engine_id`.
    /// `None` (the default) draws a random UUID at start.
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
        }
    }
}

/// Faults injected into the completion routes (`/v1/completions` and
/// `/v1/chat/completions`); `/health`, `/v1/models` and `/stats` keep
/// working. When several are set, `status` wins over `hang`, which wins over
/// `drop_after_chunks`.
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
}
