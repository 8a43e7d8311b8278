//! A decode's own KV handoff in its answers ([`SimConfig::decode_handoff`]), as a vLLM
//! 0.33 decode running bidirectional NIXL (`bidirectional_kv_xfer`) writes it
//! (`vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py`): the dict a
//! prefill answers with, turned round (`do_remote_decode: true`), naming the decode's
//! own engine, host, side-channel port and blocks, for the next turn's prefill to pull.
//!
//! [`SimConfig::decode_handoff`]: crate::SimConfig::decode_handoff

use crate::api::KvParamsOut;

/// The handoff a decode answers request `request_id` with, `tokens` tokens computed
/// (prompt and answer) in blocks of `block_size`.
pub(crate) fn own<'a>(
    engine_id: &'a str,
    host: &'a str,
    port: u16,
    request_id: &str,
    tokens: u64,
    block_size: usize,
) -> KvParamsOut<'a> {
    let blocks = tokens.div_ceil(block_size.max(1) as u64);
    KvParamsOut {
        do_remote_prefill: false,
        do_remote_decode: true,
        remote_block_ids: (0..blocks).collect(),
        remote_engine_id: engine_id,
        remote_request_id: request_id.to_owned(),
        remote_host: host,
        remote_port: port,
        tp_size: 1,
        remote_num_tokens: Some(tokens),
    }
}
