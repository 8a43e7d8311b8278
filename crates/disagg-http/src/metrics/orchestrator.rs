//! [`OrchestratorCollector`]: the orchestrator's counters and each endpoint's requests in
//! flight, read at each scrape.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use disagg_core::Orchestrator;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// Reads an [`Orchestrator`]'s counters ([`Orchestrator::stats`]) and the live in-flight
/// count of each endpoint of its current set at each scrape: nothing is recorded on the
/// request path for them, and an endpoint gone from the set is gone from the next scrape.
///
/// | metric | type | meaning |
/// |---|---|---|
/// | `disagg_requests_total{route}` | counter | requests served, by how: `orchestrated` (the orchestrator's), `forward`, `direct`, `fanout`, `key_refused`, `refused` ([`RouteKind`](crate::routed::RouteKind); these five counted by [`Metrics`](super::Metrics) as a [`RouteListener`](crate::routed::RouteListener), so only with it) |
/// | `disagg_requests_in_flight` | gauge | requests admitted and not yet ended |
/// | `disagg_queue_waiting` | gauge | requests waiting for admission |
/// | `disagg_queued_total` | counter | requests that had to wait for admission |
/// | `disagg_queue_rejected_total` | counter | refused with 429: queue full |
/// | `disagg_queue_timeouts_total` | counter | 503 after waiting too long |
/// | `disagg_retries_total` | counter | retries made |
/// | `disagg_retries_denied_total` | counter | retries refused by the retry budget |
/// | `disagg_prefill_fallbacks_total` | counter | requests served decode-only because the prefill could not be had |
/// | `disagg_deadlines_exceeded_total` | counter | requests ended by their total deadline |
/// | `disagg_kv_releases_total` | counter | early KV releases sent |
/// | `disagg_kv_releases_in_flight` | gauge | early KV releases running |
/// | `disagg_kv_releases_skipped_total` | counter | early KV releases not run: too many running (4,096) or holding too many bytes (512 MiB) |
/// | `disagg_invalid_params_total` | counter | requests refused 400 before routing: a field the proxy rewrites holds a value the engines refuse |
/// | `disagg_tokenized_total` | counter | requests whose prompt was tokenized for routing |
/// | `disagg_tokenize_failures_total` | counter | requests whose prompt could not be tokenized in time (routed without token ids) |
/// | `disagg_invalid_handoffs_total` | counter | prefill answers whose KV handoff the decode could not use (never sent on; served as `--missing-kv` says) |
/// | `disagg_direct_total{reason}` | counter | requests served by a decode engine alone, by reason |
/// | `disagg_migrations_total{reason}` | counter | mid-stream migrations started, by why the decode stream broke: `reset`, `eof` (ended before `[DONE]`), `error_frame` |
/// | `disagg_migrated_tokens_total` | counter | generated tokens carried over to continuations |
/// | `disagg_endpoint_in_flight{role,endpoint}` | gauge | requests in flight on each endpoint of the set |
pub struct OrchestratorCollector {
    orchestrator: Orchestrator,
    /// The requests the orchestrator did not serve, by [`RouteKind::index`](crate::routed::RouteKind),
    /// when [`Metrics`](super::Metrics) counts them.
    routed: Option<Arc<[AtomicU64; 5]>>,
}

impl OrchestratorCollector {
    /// A collector of `orchestrator`'s metrics.
    pub fn new(orchestrator: Orchestrator) -> Self {
        OrchestratorCollector {
            orchestrator,
            routed: None,
        }
    }

    /// With the counts of the requests the orchestrator did not serve.
    pub(super) fn with_routed(mut self, routed: Arc<[AtomicU64; 5]>) -> Self {
        self.routed = Some(routed);
        self
    }
}

impl fmt::Debug for OrchestratorCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OrchestratorCollector")
            .finish_non_exhaustive()
    }
}

/// One unlabelled counter or gauge.
fn single(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    gauge: bool,
    value: u64,
) -> fmt::Result {
    if gauge {
        let metric = ConstGauge::new(value as i64);
        metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
    } else {
        let metric = ConstCounter::new(value);
        metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
    }
}

impl Collector for OrchestratorCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> fmt::Result {
        let s = self.orchestrator.stats();
        // Counters are named without `_total`: the encoders append it.
        let mut requests = encoder.encode_descriptor(
            "disagg_requests",
            "Requests served, by route: the orchestrator's, forwarded, fanned out, refused by the key check.",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(s.requests)
            .encode(requests.encode_family(&[("route", "orchestrated")])?)?;
        if let Some(routed) = &self.routed {
            for kind in crate::routed::RouteKind::ALL {
                ConstCounter::new(routed[kind.index()].load(Relaxed))
                    .encode(requests.encode_family(&[("route", kind.as_str())])?)?;
            }
        }
        let rows: [(&str, &str, bool, u64); 17] = [
            (
                "disagg_requests_in_flight",
                "Requests admitted and not yet ended.",
                true,
                s.in_flight,
            ),
            (
                "disagg_queue_waiting",
                "Requests waiting for admission.",
                true,
                s.queued_now,
            ),
            (
                "disagg_queued",
                "Requests that had to wait for admission.",
                false,
                s.queued,
            ),
            (
                "disagg_queue_rejected",
                "Requests refused with 429 because the admission queue was full.",
                false,
                s.rejected_queue_full,
            ),
            (
                "disagg_queue_timeouts",
                "Requests answered 503 after waiting too long for admission.",
                false,
                s.queue_timeouts,
            ),
            ("disagg_retries", "Retries made.", false, s.retries),
            (
                "disagg_retries_denied",
                "Retries not made because the retry budget was spent.",
                false,
                s.retries_denied,
            ),
            (
                "disagg_prefill_fallbacks",
                "Requests served decode-only because their prefill could not be had.",
                false,
                s.prefill_fallbacks,
            ),
            (
                "disagg_deadlines_exceeded",
                "Requests ended by their total deadline.",
                false,
                s.deadlines_exceeded,
            ),
            (
                "disagg_kv_releases",
                "Early KV releases sent.",
                false,
                s.kv_releases,
            ),
            (
                "disagg_kv_releases_in_flight",
                "Early KV releases running.",
                true,
                s.kv_releases_in_flight,
            ),
            (
                "disagg_kv_releases_skipped",
                "Early KV releases not run: too many running, or holding too many bytes.",
                false,
                s.kv_releases_skipped,
            ),
            (
                "disagg_invalid_params",
                "Requests refused before routing: a field the proxy rewrites holds a value the engines refuse.",
                false,
                s.invalid_params,
            ),
            (
                "disagg_tokenized",
                "Requests whose prompt was tokenized for routing.",
                false,
                s.tokenized,
            ),
            (
                "disagg_tokenize_failures",
                "Requests whose prompt could not be tokenized (routed without token ids).",
                false,
                s.tokenize_failures,
            ),
            (
                "disagg_invalid_handoffs",
                "Prefill answers whose KV handoff the decode could not use (never sent on).",
                false,
                s.invalid_handoffs,
            ),
            (
                "disagg_migrated_tokens",
                "Generated tokens carried over to mid-stream continuations.",
                false,
                s.migrated_tokens,
            ),
        ];
        for (name, help, gauge, value) in rows {
            single(&mut encoder, name, help, gauge, value)?;
        }
        let mut direct = encoder.encode_descriptor(
            "disagg_direct",
            "Requests served by a decode engine alone, by reason.",
            None,
            MetricType::Counter,
        )?;
        for (reason, n) in &s.direct {
            let labels = [("reason", *reason)];
            ConstCounter::new(*n).encode(direct.encode_family(&labels)?)?;
        }
        let mut migrations = encoder.encode_descriptor(
            "disagg_migrations",
            "Mid-stream migrations started, by why the decode stream broke.",
            None,
            MetricType::Counter,
        )?;
        for (reason, n) in &s.migrations {
            let labels = [("reason", *reason)];
            ConstCounter::new(*n).encode(migrations.encode_family(&labels)?)?;
        }
        let set = self.orchestrator.source().snapshot();
        let mut in_flight = encoder.encode_descriptor(
            "disagg_endpoint_in_flight",
            "Requests in flight on an endpoint.",
            None,
            MetricType::Gauge,
        )?;
        for ep in set.iter() {
            let labels = [("role", ep.role().as_str()), ("endpoint", ep.id().as_str())];
            ConstGauge::new(ep.in_flight() as i64).encode(in_flight.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
