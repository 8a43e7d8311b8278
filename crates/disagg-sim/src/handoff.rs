//! NIXL handoff dicts: the `kv_transfer_params` a prefill answers with
//! ([`KvParamsOut`]), and bidirectional NIXL KV ([`SimConfig::decode_handoff`]), both
//! sides, as vLLM 0.33 runs it with `kv_connector_extra_config.bidirectional_kv_xfer`
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

use serde::Serialize;
use serde_json::{Map, Value};

use crate::kv::{self, SidePool};
use crate::stats::{Counters, bump};

/// `kv_transfer_params` a NIXL engine answers with, key for key and in the order vLLM
/// 0.33's schedulers write them (`…/nixl/pull_scheduler.py` and `push_scheduler.py`,
/// `request_finished`).
#[derive(Debug, Serialize)]
pub(crate) struct KvParamsOut<'a> {
    pub(crate) do_remote_prefill: bool,
    pub(crate) do_remote_decode: bool,
    /// One list of block ids per KV-cache group; the simulated model has one group.
    pub(crate) remote_block_ids: [Vec<u64>; 1],
    pub(crate) remote_engine_id: &'a str,
    pub(crate) remote_request_id: String,
    pub(crate) remote_host: &'a str,
    pub(crate) remote_port: u16,
    pub(crate) tp_size: u32,
    /// Pull mode only: the push scheduler does not write it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) dcp_size: Option<u32>,
    pub(crate) pp_size: u32,
    /// The tokens whose KV the blocks hold (vLLM's `num_computed_tokens`).
    pub(crate) remote_num_tokens: u64,
    /// Pull mode only: when a bidirectional decode frees its blocks, on its own clock;
    /// `null` from a prefill, whose blocks live by their lease.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) remote_blocks_expiry_time: Option<Option<f64>>,
    /// `"pull"` or `"push"`: which connector wrote the dict.
    pub(crate) transfer_mode: &'static str,
}

/// Where a NIXL engine's KV can be had: its engine id and side channel, and the blocks
/// it holds (under a request id).
pub(crate) struct HeldKv<'a> {
    pub(crate) engine_id: &'a str,
    pub(crate) host: &'a str,
    pub(crate) port: u16,
    /// The id the blocks are held under, and the blocks.
    pub(crate) held: (String, Vec<u64>),
    /// The tokens whose KV the blocks hold.
    pub(crate) tokens: u64,
}

impl<'a> KvParamsOut<'a> {
    /// A prefill's dict: pull mode's, or the push connector's (`push`).
    pub(crate) fn prefill(kv: HeldKv<'a>, push: bool) -> Self {
        let (remote_request_id, block_ids) = kv.held;
        Self {
            do_remote_prefill: true,
            do_remote_decode: false,
            remote_block_ids: [block_ids],
            remote_engine_id: kv.engine_id,
            remote_request_id,
            remote_host: kv.host,
            remote_port: kv.port,
            tp_size: 1,
            dcp_size: (!push).then_some(1),
            pp_size: 1,
            remote_num_tokens: kv.tokens,
            remote_blocks_expiry_time: (!push).then_some(None),
            transfer_mode: if push { "push" } else { "pull" },
        }
    }

    /// A bidirectional decode's dict (pull mode only), its blocks freed `expiry` seconds
    /// after its engine started.
    pub(crate) fn decode(kv: HeldKv<'a>, expiry: f64) -> Self {
        Self {
            do_remote_prefill: false,
            do_remote_decode: true,
            remote_blocks_expiry_time: Some(Some(expiry)),
            ..Self::prefill(kv, false)
        }
    }
}

/// Where a decode's handoff points: the engine, its side channel and what it holds.
pub(crate) struct Own<'a> {
    /// The engine, side channel, blocks and tokens (prompt and answer) it holds.
    pub(crate) kv: HeldKv<'a>,
    /// Since the engine started.
    pub(crate) uptime: Duration,
    /// How long the blocks are held.
    pub(crate) ttl: Duration,
}

/// The handoff a decode answers with.
pub(crate) fn own(o: Own<'_>) -> KvParamsOut<'_> {
    KvParamsOut::decode(o.kv, (o.uptime + o.ttl).as_secs_f64())
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
