//! `GET /metrics`: an orchestrator's counters in the Prometheus text format (0.0.4).
//!
//! | metric | type | meaning |
//! |---|---|---|
//! | `disagg_requests_total` | counter | requests served |
//! | `disagg_requests_in_flight` | gauge | requests admitted and not yet ended |
//! | `disagg_queue_waiting` | gauge | requests waiting for admission |
//! | `disagg_queued_total` | counter | requests that had to wait for admission |
//! | `disagg_queue_rejected_total` | counter | refused with 429: queue full |
//! | `disagg_queue_timeouts_total` | counter | 503 after waiting too long |
//! | `disagg_retries_total` | counter | retries made |
//! | `disagg_retries_denied_total` | counter | retries refused by the retry budget |
//! | `disagg_prefill_fallbacks_total` | counter | requests served decode-only because the prefill could not be had |
//! | `disagg_deadlines_exceeded_total` | counter | requests ended by their total deadline |
//! | `disagg_kv_releases_total` | counter | early KV releases sent |
//! | `disagg_kv_releases_in_flight` | gauge | early KV releases running |
//! | `disagg_invalid_params_total` | counter | requests refused 400 before routing: a field the proxy rewrites holds a value the engines refuse |
//! | `disagg_direct_total{reason}` | counter | requests served by a decode engine alone, by reason (`beam_search`, `prompt_only`: the connector cannot carry them; `short_prompt`: `--min-prefill-tokens`) |
//! | `disagg_endpoint_in_flight{role,endpoint}` | gauge | requests in flight on each endpoint |
//!
//! Metrics kept outside the orchestrator (an adapter's own counters) are appended after
//! these through [`ExtraMetrics`] in
//! [`PdServiceConfig::extra_metrics`](crate::PdServiceConfig::extra_metrics). The
//! `disagg-proxy` binary adds, with `--connector lmcache`, the LMCache notification
//! listener's (`disagg_lmcache::Notifications::render_metrics`):
//!
//! | metric | type | meaning |
//! |---|---|---|
//! | `disagg_lmcache_notifications_total{outcome}` | counter | KV-ready notifications received, by outcome: `matched`, `unknown` (no such request waiting), `extra` (beyond the expected count), `malformed` |
//! | `disagg_lmcache_registrations_completed_total` | counter | requests whose every expected notification arrived |
//! | `disagg_lmcache_registrations_evicted_total` | counter | registrations removed after their time to live |
//! | `disagg_lmcache_registrations_pending` | gauge | requests waiting for notifications now |

use std::fmt::{self, Write};
use std::sync::Arc;

use disagg_core::Orchestrator;

/// More metric families for `GET /metrics`, rendered after the orchestrator's: the
/// extension point for counters that live outside the orchestrator, so that this crate
/// needs to know nothing of the adapter that keeps them.
///
/// The function appends complete families (`# HELP`, `# TYPE`, samples) in the
/// Prometheus text format (0.0.4) to the buffer it is given; it runs on every scrape,
/// so it should be cheap and must not block. Names must not clash with the
/// orchestrator's (prefix them, e.g. `disagg_lmcache_`).
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use disagg_http::PdServiceConfig;
/// use disagg_http::metrics::ExtraMetrics;
///
/// let hits = Arc::new(AtomicU64::new(0));
/// let counted = Arc::clone(&hits);
/// let mut config = PdServiceConfig::default();
/// config.extra_metrics.push(ExtraMetrics::new(move |out: &mut String| {
///     out.push_str("# HELP my_hits_total Hits.\n# TYPE my_hits_total counter\n");
///     out.push_str(&format!("my_hits_total {}\n", counted.load(Ordering::Relaxed)));
/// }));
/// # let _ = (config, hits);
/// ```
#[derive(Clone)]
pub struct ExtraMetrics(Arc<dyn Fn(&mut String) + Send + Sync>);

impl ExtraMetrics {
    /// Metrics that `render` appends to the text it is given.
    pub fn new(render: impl Fn(&mut String) + Send + Sync + 'static) -> Self {
        ExtraMetrics(Arc::new(render))
    }

    /// Append the metrics to `out`.
    pub fn render(&self, out: &mut String) {
        (self.0)(out)
    }
}

impl fmt::Debug for ExtraMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExtraMetrics").finish_non_exhaustive()
    }
}

/// The metrics of `orchestrator` as Prometheus text.
pub fn render(orchestrator: &Orchestrator) -> String {
    let s = orchestrator.stats();
    let mut out = String::with_capacity(2048);
    let rows: [(&str, &str, &str, u64); 12] = [
        ("requests_total", "counter", "Requests served.", s.requests),
        (
            "requests_in_flight",
            "gauge",
            "Requests admitted and not yet ended.",
            s.in_flight,
        ),
        (
            "queue_waiting",
            "gauge",
            "Requests waiting for admission.",
            s.queued_now,
        ),
        (
            "queued_total",
            "counter",
            "Requests that had to wait for admission.",
            s.queued,
        ),
        (
            "queue_rejected_total",
            "counter",
            "Requests refused with 429 because the admission queue was full.",
            s.rejected_queue_full,
        ),
        (
            "queue_timeouts_total",
            "counter",
            "Requests answered 503 after waiting too long for admission.",
            s.queue_timeouts,
        ),
        ("retries_total", "counter", "Retries made.", s.retries),
        (
            "retries_denied_total",
            "counter",
            "Retries not made because the retry budget was spent.",
            s.retries_denied,
        ),
        (
            "prefill_fallbacks_total",
            "counter",
            "Requests served decode-only because their prefill could not be had.",
            s.prefill_fallbacks,
        ),
        (
            "deadlines_exceeded_total",
            "counter",
            "Requests ended by their total deadline.",
            s.deadlines_exceeded,
        ),
        (
            "kv_releases_total",
            "counter",
            "Early KV releases sent.",
            s.kv_releases,
        ),
        (
            "kv_releases_in_flight",
            "gauge",
            "Early KV releases running.",
            s.kv_releases_in_flight,
        ),
    ];
    for (name, kind, help, value) in rows {
        let _ = writeln!(out, "# HELP disagg_{name} {help}");
        let _ = writeln!(out, "# TYPE disagg_{name} {kind}");
        let _ = writeln!(out, "disagg_{name} {value}");
    }
    let _ = writeln!(
        out,
        "# HELP disagg_invalid_params_total Requests refused before routing: a field the proxy rewrites holds a value the engines refuse.\n# TYPE disagg_invalid_params_total counter\ndisagg_invalid_params_total {}",
        s.invalid_params
    );
    let _ = writeln!(
        out,
        "# HELP disagg_direct_total Requests served by a decode engine alone, by reason.\n# TYPE disagg_direct_total counter"
    );
    for (reason, n) in &s.direct {
        let _ = writeln!(
            out,
            "disagg_direct_total{{reason=\"{}\"}} {n}",
            escape(reason)
        );
    }
    let set = orchestrator.source().snapshot();
    let _ = writeln!(
        out,
        "# HELP disagg_endpoint_in_flight Requests in flight on an endpoint."
    );
    let _ = writeln!(out, "# TYPE disagg_endpoint_in_flight gauge");
    for (role, eps) in [("prefill", set.prefill()), ("decode", set.decode())] {
        for ep in eps {
            let _ = writeln!(
                out,
                "disagg_endpoint_in_flight{{role=\"{role}\",endpoint=\"{}\"}} {}",
                escape(ep.id().as_str()),
                ep.in_flight()
            );
        }
    }
    out
}

/// A label value with `\`, `"` and newlines escaped.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{HttpTransport, PdService, PdServiceConfig};
    use disagg_core::{Endpoint, Role, StaticSource};
    use http_body_util::BodyExt;
    use std::sync::atomic::{AtomicU64, Ordering};
    use tower::ServiceExt;

    #[tokio::test]
    async fn extra_metrics_follow_the_orchestrators_on_every_scrape() {
        let source = StaticSource::new([
            Endpoint::new("http://127.0.0.1:1", Role::Prefill).unwrap(),
            Endpoint::new("http://127.0.0.1:2", Role::Decode).unwrap(),
        ]);
        let orchestrator = Orchestrator::builder(source, HttpTransport::default()).build();
        let scrapes = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&scrapes);
        let mut config = PdServiceConfig::default();
        config.extra_metrics.push(ExtraMetrics::new(move |out| {
            let n = counted.fetch_add(1, Ordering::Relaxed) + 1;
            let _ = writeln!(out, "# TYPE test_scrapes_total counter");
            let _ = writeln!(out, "test_scrapes_total {n}");
        }));
        let service = PdService::with_config(orchestrator, config);
        for n in 1..=2 {
            let req = http::Request::get("/metrics")
                .body(http_body_util::Empty::<bytes::Bytes>::new())
                .unwrap();
            let resp = service.clone().oneshot(req).await.unwrap();
            assert_eq!(resp.status(), 200);
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            let text = String::from_utf8(body.to_vec()).unwrap();
            let core = text.find("disagg_requests_total 0\n").expect(&text);
            let extra = text
                .find(&format!("\ntest_scrapes_total {n}\n"))
                .expect(&text);
            assert!(core < extra, "{text}");
        }
        assert_eq!(scrapes.load(Ordering::Relaxed), 2);
    }
}
