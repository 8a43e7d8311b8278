//! The engines' metric names, mapped to one model ([`EngineSnapshot`]).
//!
//! | model | vLLM 0.33 | SGLang 0.5.23 |
//! |---|---|---|
//! | prompt tokens computed here | `vllm:prompt_tokens_by_source_total{source="local_compute"}` | `sglang:realtime_tokens_total{mode="prefill_compute"}` |
//! | prompt tokens from the prefix cache | `vllm:prompt_tokens_by_source_total{source="local_cache_hit"}` | `sglang:realtime_tokens_total{mode="prefill_cache"}` |
//! | prompt tokens whose KV arrived by transfer | `vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}` | none |
//! | KV transfers that failed | `vllm:nixl_num_failed_transfers_total` | `sglang:num_transfer_failed_reqs_total` |
//! | a prefill's KV expired unclaimed | `vllm:nixl_num_kv_expired_reqs_total` | none |
//! | requests waiting | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` |
//! | requests running | `vllm:num_requests_running` | `sglang:num_running_reqs` |
//! | KV cache usage (0 to 1) | `vllm:kv_cache_usage_perc` | `sglang:token_usage` |
//!
//! Sources: vLLM's `vllm/v1/metrics/loggers.py` and
//! `vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py`; SGLang's
//! `sglang/srt/observability/metrics_collector.py`. Every series of a name is summed
//! (an engine writes one per data-parallel engine index or TP rank).

use prom_text_format_parser::Metric;

use super::{EngineFamily, EngineSnapshot};

/// Every name [`snapshot`] reads. Only these metrics' lines reach the parser
/// (`filter.rs`): a name read below but missing here would never be seen.
pub(super) const READ: [&str; 11] = [
    "vllm:prompt_tokens_by_source_total",
    "vllm:nixl_num_failed_transfers_total",
    "vllm:nixl_num_kv_expired_reqs_total",
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "sglang:realtime_tokens_total",
    "sglang:num_transfer_failed_reqs_total",
    "sglang:num_queue_reqs",
    "sglang:num_running_reqs",
    "sglang:token_usage",
];

/// Reads the model out of an engine's parsed metrics.
pub(super) fn snapshot(metrics: &[Metric]) -> EngineSnapshot {
    let mut s = EngineSnapshot::default();
    for m in metrics {
        let name = m.name.as_str();
        let family = if name.starts_with("vllm:") {
            EngineFamily::Vllm
        } else if name.starts_with("sglang:") {
            EngineFamily::Sglang
        } else {
            continue;
        };
        s.family.get_or_insert(family);
        let slot = match name {
            "vllm:nixl_num_failed_transfers_total" | "sglang:num_transfer_failed_reqs_total" => {
                &mut s.kv_transfer_failures
            }
            "vllm:nixl_num_kv_expired_reqs_total" => &mut s.kv_expired,
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => &mut s.requests_waiting,
            "vllm:num_requests_running" | "sglang:num_running_reqs" => &mut s.requests_running,
            "vllm:kv_cache_usage_perc" | "sglang:token_usage" => &mut s.kv_cache_usage,
            "vllm:prompt_tokens_by_source_total" => {
                split(m, "source", &mut s, |source| match source {
                    "local_compute" => Some(0),
                    "local_cache_hit" => Some(1),
                    "external_kv_transfer" => Some(2),
                    _ => None,
                });
                continue;
            }
            "sglang:realtime_tokens_total" => {
                split(m, "mode", &mut s, |mode| match mode {
                    "prefill_compute" => Some(0),
                    "prefill_cache" => Some(1),
                    _ => None,
                });
                continue;
            }
            _ => continue,
        };
        debug_assert!(READ.contains(&name), "{name} is read but not in READ");
        *slot = Some(sum(m, |_| true));
    }
    s
}

/// Adds each series of `m` to the prompt-token source `which` gives for its `label`.
fn split(m: &Metric, label: &str, s: &mut EngineSnapshot, which: impl Fn(&str) -> Option<usize>) {
    debug_assert!(READ.contains(&m.name.as_str()), "{} not in READ", m.name);
    for sample in &m.samples {
        let Some(i) = sample
            .labels
            .iter()
            .find(|l| l.key == label)
            .and_then(|l| which(&l.value))
        else {
            continue;
        };
        let slot = match i {
            0 => &mut s.prompt_tokens.local_compute,
            1 => &mut s.prompt_tokens.local_cache_hit,
            _ => &mut s.prompt_tokens.external_kv_transfer,
        };
        *slot = Some(slot.unwrap_or(0.0) + value(sample));
    }
}

/// The sum of the series of `m` that `keep` keeps.
fn sum(m: &Metric, keep: impl Fn(&prom_text_format_parser::Sample) -> bool) -> f64 {
    m.samples.iter().filter(|s| keep(s)).map(value).sum()
}

/// A sample's value; one that is no number counts as 0.
fn value(sample: &prom_text_format_parser::Sample) -> f64 {
    sample
        .value
        .value
        .as_str()
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite())
        .unwrap_or(0.0)
}
