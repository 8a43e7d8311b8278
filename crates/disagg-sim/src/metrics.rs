//! `GET /metrics`: the engine's counters in the Prometheus text format, named as vLLM
//! 0.33 names them (`vllm/v1/metrics/loggers.py`,
//! `vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py`) or, in the SGLang
//! modes, as SGLang 0.5.23 does (`sglang/srt/observability/metrics_collector.py`).
//!
//! Written as Python's `prometheus_client` writes them: a counter's `# TYPE` line names
//! it with its `_total` suffix, and labels carry the model name (and vLLM's engine
//! index). The prompt-token split is true: a decode that pulled its KV counts the prompt
//! as `external_kv_transfer`, one that computed it (no handoff, a lost or failed one)
//! as `local_compute`.

use std::fmt::Write as _;

use crate::config::{KvMode, SimConfig};
use crate::stats::Stats;

/// The body of `GET /metrics` for an engine configured with `config` whose counters
/// are `stats`, with `padding` bytes of comment lines first
/// ([`MetricsFault::Huge`](crate::MetricsFault::Huge)).
pub(crate) fn render(config: &SimConfig, stats: &Stats, padding: usize) -> String {
    let mut out = String::with_capacity(2048 + padding);
    let line = "# padding\n";
    for _ in 0..padding.div_ceil(line.len()) {
        out.push_str(line);
    }
    let model = escape(&config.model);
    // Requests waiting for their prefill slot are waiting; every other one in progress
    // runs.
    let running = stats.active_requests.saturating_sub(stats.waiting_requests);
    let usage = if config.prefix_cache_blocks == 0 {
        0.0
    } else {
        stats.prefix_cache_blocks as f64 / config.prefix_cache_blocks as f64
    };
    if matches!(config.kv_mode, KvMode::Sglang(_)) {
        let l =
            format!("model_name=\"{model}\",engine_type=\"unified\",tp_rank=\"0\",pp_rank=\"0\"");
        gauge(&mut out, "sglang:num_running_reqs", &l, running as f64);
        gauge(
            &mut out,
            "sglang:num_queue_reqs",
            &l,
            stats.waiting_requests as f64,
        );
        gauge(&mut out, "sglang:token_usage", &l, usage);
        let _ = writeln!(
            out,
            "# HELP sglang:realtime_tokens_total Total number of tokens processed."
        );
        let _ = writeln!(out, "# TYPE sglang:realtime_tokens_total counter");
        for (mode, n) in [
            ("prefill_compute", stats.prompt_tokens_local),
            ("prefill_cache", stats.prompt_tokens_cached),
        ] {
            let _ = writeln!(
                out,
                "sglang:realtime_tokens_total{{{l},mode=\"{mode}\"}} {n}.0"
            );
        }
        counter(
            &mut out,
            "sglang:num_transfer_failed_reqs_total",
            &l,
            stats.failed_transfers,
        );
        return out;
    }
    let l = format!("model_name=\"{model}\",engine=\"0\"");
    gauge(&mut out, "vllm:num_requests_running", &l, running as f64);
    gauge(
        &mut out,
        "vllm:num_requests_waiting",
        &l,
        stats.waiting_requests as f64,
    );
    gauge(&mut out, "vllm:kv_cache_usage_perc", &l, usage);
    let _ = writeln!(
        out,
        "# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source."
    );
    let _ = writeln!(out, "# TYPE vllm:prompt_tokens_by_source_total counter");
    for (source, n) in [
        ("local_compute", stats.prompt_tokens_local),
        ("local_cache_hit", stats.prompt_tokens_cached),
        ("external_kv_transfer", stats.prompt_tokens_external),
    ] {
        let _ = writeln!(
            out,
            "vllm:prompt_tokens_by_source_total{{{l},source=\"{source}\"}} {n}.0"
        );
    }
    if config.kv_mode == KvMode::Nixl {
        counter(
            &mut out,
            "vllm:nixl_num_failed_transfers_total",
            &l,
            stats.failed_transfers,
        );
        counter(
            &mut out,
            "vllm:nixl_num_kv_expired_reqs_total",
            &l,
            stats.kv_expired_reqs,
        );
    }
    out
}

fn gauge(out: &mut String, name: &str, labels: &str, value: f64) {
    let _ = writeln!(out, "# HELP {name} Simulated.");
    let _ = writeln!(out, "# TYPE {name} gauge");
    let _ = writeln!(out, "{name}{{{labels}}} {value:?}");
}

fn counter(out: &mut String, name: &str, labels: &str, value: u64) {
    let _ = writeln!(out, "# HELP {name} Simulated.");
    let _ = writeln!(out, "# TYPE {name} counter");
    let _ = writeln!(out, "{name}{{{labels}}} {value}.0");
}

/// A label value as the text format escapes it.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vllm_split_is_named_as_vllm_names_it() {
        let stats = Stats {
            prompt_tokens_external: 12,
            prompt_tokens_local: 3,
            ..Stats::default()
        };
        let text = render(&SimConfig::default(), &stats, 0);
        assert!(text.contains(
            "vllm:prompt_tokens_by_source_total{model_name=\"sim-model\",engine=\"0\",source=\"external_kv_transfer\"} 12.0\n"
        ));
        assert!(text.contains("source=\"local_compute\"} 3.0\n"));
        assert!(text.contains("vllm:nixl_num_kv_expired_reqs_total{"));
    }
}
