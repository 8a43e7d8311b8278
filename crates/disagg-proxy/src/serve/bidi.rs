//! Bidirectional multi-turn KV (vLLM NIXL, `--bidirectional-kv`): its flags, its store
//! and its metrics (docs/protocols.md, docs/observability.md).

use std::sync::Arc;

use clap::Args;
use disagg_connectors::vllm::bidi::{BidiConfig, BidiStore, ConversationKey};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::BoxError;

use super::flags::{ConnectorArg, secs};

/// Flags of bidirectional multi-turn KV.
#[derive(Debug, Clone, Args)]
pub struct BidiArgs {
    /// vLLM NIXL with `kv_connector_extra_config.bidirectional_kv_xfer` on the engines:
    /// keep the KV handoff a decode returns in its answer (still blanked for the client)
    /// by conversation, and send it on the prefill leg of the conversation's next turn,
    /// whose prefill then pulls the decode's prefix instead of computing it. Chat,
    /// completions and Responses only (the other routes' answers carry no handoff).
    /// Off by default.
    #[arg(long)]
    pub(crate) bidirectional_kv: bool,
    /// Where a request names its conversation: `field:NAME` (a top-level string of the
    /// body, as vLLM's example proxy reads `conversation_id`; `field:user`) or
    /// `header:NAME` (a session header). At most 256 bytes; a request naming none keeps
    /// nothing and reuses nothing.
    #[arg(
        long,
        value_name = "header:NAME|field:NAME",
        default_value = "field:conversation_id"
    )]
    pub(crate) conversation_key: ConversationKey,
    /// Seconds a kept handoff is used for: the engines' `decoder_kv_blocks_ttl`, after
    /// which the decode has freed the blocks (the proxy's own clock; the handoff's
    /// `remote_blocks_expiry_time` is the decode's).
    #[arg(long, value_name = "SECS", default_value_t = 480.0)]
    pub(crate) decoder_kv_blocks_ttl: f64,
    /// Conversations whose handoff is kept at most (the oldest go first).
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    pub(crate) bidi_max_conversations: usize,
    /// Bytes of kept handoffs at most (the oldest go first).
    #[arg(long, value_name = "BYTES", default_value_t = 64 * 1024 * 1024)]
    pub(crate) bidi_max_bytes: usize,
    /// The largest decode handoff kept, in bytes (a larger one is dropped and counted).
    #[arg(long, value_name = "BYTES", default_value_t = 64 * 1024)]
    pub(crate) bidi_max_handoff_bytes: usize,
}

impl BidiArgs {
    /// The store, when `--bidirectional-kv` is on (vLLM NIXL only).
    pub(crate) fn store(
        &self,
        connector: ConnectorArg,
    ) -> Result<Option<Arc<BidiStore>>, BoxError> {
        if !self.bidirectional_kv {
            return Ok(None);
        }
        if connector != ConnectorArg::Nixl {
            return Err(
                "--bidirectional-kv needs --connector nixl (vLLM NIXL's bidirectional_kv_xfer)"
                    .into(),
            );
        }
        let mut config = BidiConfig::default();
        config.key = self.conversation_key.clone();
        config.ttl = secs(self.decoder_kv_blocks_ttl, "decoder-kv-blocks-ttl")?;
        config.max_entries = self.bidi_max_conversations;
        config.max_bytes = self.bidi_max_bytes;
        config.max_handoff_bytes = self.bidi_max_handoff_bytes;
        Ok(Some(BidiStore::new(config)))
    }
}

/// Register the store's metrics on `registry`, read at each scrape.
pub(crate) fn register_metrics(store: Arc<BidiStore>, registry: &mut Registry) {
    registry.register_collector(Box::new(BidiCollector(store)));
}

/// The store's counters, at each scrape:
///
/// | metric | type | meaning |
/// |---|---|---|
/// | `disagg_bidi_kv_captured_total` | counter | decode handoffs kept |
/// | `disagg_bidi_kv_reused_turns_total` | counter | turns whose prefill leg was sent the decode's handoff |
/// | `disagg_bidi_kv_reused_tokens_total` | counter | tokens those handoffs named (`remote_num_tokens`) |
/// | `disagg_bidi_kv_expired_total` | counter | handoffs dropped unused at their TTL |
/// | `disagg_bidi_kv_dropped_total{reason}` | counter | handoffs dropped: `invalid`, `capacity` |
/// | `disagg_bidi_kv_entries` | gauge | conversations kept |
/// | `disagg_bidi_kv_bytes` | gauge | bytes kept |
#[derive(Debug)]
struct BidiCollector(Arc<BidiStore>);

impl Collector for BidiCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        let s = self.0.stats();
        crate::observe::encode_counters(
            &mut encoder,
            &[
                (
                    "disagg_bidi_kv_captured",
                    "Decode KV handoffs kept for the next turn.",
                    s.captured,
                ),
                (
                    "disagg_bidi_kv_reused_turns",
                    "Turns whose prefill leg was sent the decode's KV handoff.",
                    s.reused,
                ),
                (
                    "disagg_bidi_kv_reused_tokens",
                    "Tokens named by the decode handoffs sent on (remote_num_tokens).",
                    s.reused_tokens,
                ),
                (
                    "disagg_bidi_kv_expired",
                    "Decode KV handoffs dropped unused at their TTL.",
                    s.expired,
                ),
            ],
        )?;
        let mut dropped = encoder.encode_descriptor(
            "disagg_bidi_kv_dropped",
            "Decode KV handoffs dropped: invalid, or to keep the store's bounds.",
            None,
            MetricType::Counter,
        )?;
        for (reason, v) in [("invalid", s.invalid), ("capacity", s.evicted)] {
            ConstCounter::new(v).encode(dropped.encode_family(&[("reason", reason)])?)?;
        }
        for (name, help, v) in [
            (
                "disagg_bidi_kv_entries",
                "Conversations whose decode KV handoff is kept.",
                s.entries,
            ),
            (
                "disagg_bidi_kv_bytes",
                "Bytes of decode KV handoffs kept.",
                s.bytes,
            ),
        ] {
            let e = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX)).encode(e)?;
        }
        Ok(())
    }
}
