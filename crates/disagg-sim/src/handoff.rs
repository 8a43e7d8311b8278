//! Bidirectional NIXL KV ([`SimConfig::decode_handoff`]), both sides, as vLLM 0.33 runs
//! it with `kv_connector_extra_config.bidirectional_kv_xfer`
//! (`vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py`):
//!
//! - a **decode** holds its request's blocks for [`SimConfig::decoder_kv_blocks_ttl`]
//!   and answers with a handoff of its own: the dict a prefill answers with, turned
//!   round (`do_remote_prefill: false, do_remote_decode: true`), naming its engine,
//!   host, side-channel port, blocks and request id, the tokens it computed
//!   (`remote_num_tokens`) and `remote_blocks_expiry_time` (its own monotonic clock
//!   plus the TTL: seconds since the engine started);
//! - a **prefill** given such a dict as its `kv_transfer_params` (the next turn of the
//!   conversation) pulls those blocks over the decode's side channel, as a NIXL decode
//!   pulls a prefill's, when `remote_num_tokens` is at least
//!   [`SimConfig::kv_recompute_threshold`]; the pulled tokens (at most the prompt's)
//!   are not computed. A pull that fails (nobody at that host and port, another
//!   engine id, unknown request id or blocks, blocks past their TTL) is counted and
//!   the prefill computes the prompt itself, as vLLM recomputes.
//!
//! [`SimConfig::decode_handoff`]: crate::SimConfig::decode_handoff
//! [`SimConfig::decoder_kv_blocks_ttl`]: crate::SimConfig::decoder_kv_blocks_ttl
//! [`SimConfig::kv_recompute_threshold`]: crate::SimConfig::kv_recompute_threshold

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use serde_json::{Map, Value};

use crate::api::KvParamsOut;
use crate::kv::{self, SidePool};
use crate::stats::{Counters, bump};

/// Where a decode's handoff points: the engine, its side channel and what it holds.
pub(crate) struct Own<'a> {
    pub(crate) engine_id: &'a str,
    pub(crate) host: &'a str,
    pub(crate) port: u16,
    /// The id its blocks are held under, and the blocks.
    pub(crate) held: (String, Vec<u64>),
    /// Tokens computed: prompt and answer.
    pub(crate) tokens: u64,
    /// Since the engine started.
    pub(crate) uptime: Duration,
    /// How long the blocks are held.
    pub(crate) ttl: Duration,
}

/// The handoff a decode answers with.
pub(crate) fn own(o: Own<'_>) -> KvParamsOut<'_> {
    let (remote_request_id, remote_block_ids) = o.held;
    KvParamsOut {
        do_remote_prefill: false,
        do_remote_decode: true,
        remote_block_ids,
        remote_engine_id: o.engine_id,
        remote_request_id,
        remote_host: o.host,
        remote_port: o.port,
        tp_size: 1,
        remote_num_tokens: Some(o.tokens),
        remote_blocks_expiry_time: Some((o.uptime + o.ttl).as_secs_f64()),
    }
}

/// Whether a prefill leg's `kv_transfer_params` is a decode's own handoff (it names
/// the engine to pull from), not the plain `do_remote_decode` request.
pub(crate) fn is_decode_handoff(params: &Map<String, Value>) -> bool {
    params
        .get("remote_engine_id")
        .and_then(Value::as_str)
        .is_some_and(|s| !s.is_empty())
}

/// A prefill given a decode's handoff `params` for a prompt of `prompt_tokens`: the
/// tokens it pulled from the decode (0 when it computes them all).
pub(crate) async fn pull_prefix(
    pool: &SidePool,
    counters: &Counters,
    threshold: u64,
    params: &Map<String, Value>,
    prompt_tokens: u64,
    request_id: &str,
) -> u64 {
    let tokens = params.get("remote_num_tokens").and_then(Value::as_u64);
    let Some(tokens) = tokens.filter(|t| *t >= threshold.max(1)) else {
        bump(&counters.bidi_below_threshold);
        return 0;
    };
    let pulled = match kv::PullTarget::parse(params) {
        Ok(target) => kv::pull(pool, &target).await,
        Err(e) => Err(e),
    };
    match pulled {
        Ok(_) => {
            let n = tokens.min(prompt_tokens);
            bump(&counters.bidi_pulls);
            counters.bidi_tokens_pulled.fetch_add(n, Relaxed);
            n
        }
        Err(e) => {
            bump(&counters.bidi_pull_failures);
            tracing::debug!(error = %e, request_id, "pull of a decode's KV failed: recomputing");
            0
        }
    }
}
