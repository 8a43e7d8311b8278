//! Engine telemetry for `GET /metrics`: [`Telemetry::register_metrics`].

use std::fmt;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use super::{EngineSnapshot, Telemetry};
use crate::lock;

impl Telemetry {
    /// Registers the telemetry into a Prometheus `registry`, read at each scrape:
    ///
    /// | metric | type | meaning |
    /// |---|---|---|
    /// | `disagg_engine_scrapes_total{endpoint}` | counter | scrapes of the engine's `/metrics` |
    /// | `disagg_engine_scrape_errors_total{endpoint}` | counter | scrapes that failed (unreachable, non-2xx, too slow, too large, not the text format) |
    /// | `disagg_engine_prompt_tokens_total{endpoint,source}` | counter | the engine's prompt tokens by source (`local_compute`, `local_cache_hit`, `external_kv_transfer`), as it counts them |
    /// | `disagg_engine_kv_expired_total{endpoint}` | counter | the engine's requests whose KV expired unclaimed (a prefill) |
    /// | `disagg_engine_kv_transfer_failures_total{endpoint}` | counter | the engine's failed KV transfers |
    /// | `disagg_engine_requests_waiting{endpoint}` | gauge | the engine's requests waiting to be scheduled, at its latest read |
    /// | `disagg_engine_requests_running{endpoint}` | gauge | the engine's requests running, at its latest read |
    /// | `disagg_engine_kv_cache_usage{endpoint}` | gauge | the engine's KV cache usage, 0 to 1, at its latest read |
    /// | `disagg_handoff_receipt_ratio{endpoint}` | gauge | a decode's share of prompt tokens that arrived by KV transfer over the last window, while the proxy handed it KV; absent when that window had nothing to judge |
    /// | `disagg_endpoint_kv_suspect{endpoint}` | gauge | 1 while a decode is flagged for low receipts, else 0 |
    ///
    /// `endpoint` is the engine's `scheme://host:port`. An engine's series appear with
    /// its first successful scrape (the scrape counters with the first attempt) and go
    /// with the engine; a value the engine does not expose has no series.
    pub fn register_metrics(self: &Arc<Self>, registry: &mut Registry) {
        registry.register_collector(Box::new(TelemetryCollector(Arc::clone(self))));
    }
}

struct TelemetryCollector(Arc<Telemetry>);

impl fmt::Debug for TelemetryCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TelemetryCollector").finish_non_exhaustive()
    }
}

/// What one engine shows, copied out of the lock.
struct Row {
    label: Arc<str>,
    decode: bool,
    scrapes: u64,
    errors: u64,
    snapshot: Option<EngineSnapshot>,
    ratio: Option<f64>,
    suspect: bool,
}

impl Collector for TelemetryCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> fmt::Result {
        let mut rows: Vec<Row> = lock(&self.0.engines)
            .values()
            .map(|e| Row {
                label: Arc::clone(&e.label),
                decode: !e.decodes.is_empty(),
                scrapes: e.scrapes,
                errors: e.scrape_errors,
                snapshot: e.snapshot.clone(),
                ratio: e.ratio,
                suspect: e.suspect,
            })
            .collect();
        rows.sort_by(|a, b| a.label.cmp(&b.label));
        // Counters are named without `_total`: the encoders append it.
        let mut scrapes = encoder.encode_descriptor(
            "disagg_engine_scrapes",
            "Scrapes of each engine's /metrics.",
            None,
            MetricType::Counter,
        )?;
        for r in &rows {
            ConstCounter::new(r.scrapes)
                .encode(scrapes.encode_family(&[("endpoint", &*r.label)])?)?;
        }
        let mut errors = encoder.encode_descriptor(
            "disagg_engine_scrape_errors",
            "Scrapes of each engine's /metrics that failed.",
            None,
            MetricType::Counter,
        )?;
        for r in &rows {
            ConstCounter::new(r.errors)
                .encode(errors.encode_family(&[("endpoint", &*r.label)])?)?;
        }
        let mut tokens = encoder.encode_descriptor(
            "disagg_engine_prompt_tokens",
            "Each engine's prompt tokens by source, as the engine counts them.",
            None,
            MetricType::Counter,
        )?;
        for r in &rows {
            let Some(s) = &r.snapshot else { continue };
            let p = &s.prompt_tokens;
            for (source, v) in [
                ("local_compute", p.local_compute),
                ("local_cache_hit", p.local_cache_hit),
                ("external_kv_transfer", p.external_kv_transfer),
            ] {
                if let Some(v) = v {
                    let labels = [("endpoint", &*r.label), ("source", source)];
                    ConstCounter::new(v).encode(tokens.encode_family(&labels)?)?;
                }
            }
        }
        for (name, help, get) in [
            (
                "disagg_engine_kv_expired",
                "Each engine's requests whose KV expired unclaimed (prefills).",
                (|s: &EngineSnapshot| s.kv_expired) as fn(&EngineSnapshot) -> Option<f64>,
            ),
            (
                "disagg_engine_kv_transfer_failures",
                "Each engine's failed KV transfers.",
                |s: &EngineSnapshot| s.kv_transfer_failures,
            ),
        ] {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for r in &rows {
                if let Some(v) = r.snapshot.as_ref().and_then(get) {
                    ConstCounter::new(v)
                        .encode(family.encode_family(&[("endpoint", &*r.label)])?)?;
                }
            }
        }
        for (name, help, get) in [
            (
                "disagg_engine_requests_waiting",
                "Each engine's requests waiting to be scheduled, at its latest read.",
                (|s: &EngineSnapshot| s.requests_waiting) as fn(&EngineSnapshot) -> Option<f64>,
            ),
            (
                "disagg_engine_requests_running",
                "Each engine's requests running, at its latest read.",
                |s: &EngineSnapshot| s.requests_running,
            ),
            (
                "disagg_engine_kv_cache_usage",
                "Each engine's KV cache usage (0 to 1), at its latest read.",
                |s: &EngineSnapshot| s.kv_cache_usage,
            ),
        ] {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for r in &rows {
                if let Some(v) = r.snapshot.as_ref().and_then(get) {
                    ConstGauge::new(v).encode(family.encode_family(&[("endpoint", &*r.label)])?)?;
                }
            }
        }
        let mut ratio = encoder.encode_descriptor(
            "disagg_handoff_receipt_ratio",
            "A decode's share of prompt tokens that arrived by KV transfer over the last window in which the proxy handed it KV.",
            None,
            MetricType::Gauge,
        )?;
        for r in &rows {
            if let Some(v) = r.ratio {
                ConstGauge::new(v).encode(ratio.encode_family(&[("endpoint", &*r.label)])?)?;
            }
        }
        let mut suspect = encoder.encode_descriptor(
            "disagg_endpoint_kv_suspect",
            "1 while a decode is flagged because the KV handed to it does not arrive.",
            None,
            MetricType::Gauge,
        )?;
        for r in rows.iter().filter(|r| r.decode) {
            ConstGauge::new(i64::from(r.suspect))
                .encode(suspect.encode_family(&[("endpoint", &*r.label)])?)?;
        }
        Ok(())
    }
}
