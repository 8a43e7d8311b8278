//! `GET /metrics`: the proxy's metrics on [`prometheus_client`], the Prometheus project's
//! own Rust client, served in the OpenMetrics text format (or Prometheus' 0.0.4 text
//! format to a scraper that does not ask for OpenMetrics).
//!
//! Three kinds of metrics end up in one [`Registry`]:
//!
//! - **per request and per leg**, recorded by [`Metrics`], a
//!   [`Listener`](disagg_core::outcome::Listener) the embedder attaches to the
//!   orchestrator: latency histograms (request duration, time to first token, prefill,
//!   KV handoff, decode head and first chunk) and each endpoint's legs by outcome;
//! - **the orchestrator's counters and gauges**, read from
//!   [`Orchestrator::stats`] and the endpoint set at each scrape
//!   ([`register_orchestrator`]): requests, retries, fallbacks, admission, KV releases,
//!   each endpoint's requests in flight;
//! - **an adapter's own**, registered through [`ExtraMetrics`]: the health of each
//!   endpoint (`disagg-resilience`), LMCache's notifications (`disagg-connectors`' `lmcache`),
//!   discovery (`disagg-discovery`), the access log's dropped lines.
//!
//! `docs/observability.md` lists every metric with its labels and meaning.
//!
//! # Examples
//!
//! What [`PdService`](crate::PdService) does for `GET /metrics`, by hand:
//!
//! ```
//! use disagg_core::{Endpoint, Orchestrator, Role, source::StaticSource};
//! use disagg_connectors::vllm::VllmNixl;
//! use disagg_http::HttpTransport;
//! use disagg_http::metrics::{self, Metrics};
//! use prometheus_client::registry::Registry;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let source = StaticSource::new([
//!     Endpoint::new("http://127.0.0.1:8100", Role::Prefill)?,
//!     Endpoint::new("http://127.0.0.1:8200", Role::Decode)?,
//! ]);
//! let metrics = Metrics::new("vllm-nixl");
//! let orchestrator = Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new())
//!     .listener(metrics.clone())
//!     .build();
//! let mut registry = Registry::default();
//! metrics.register(&mut registry, &orchestrator);
//! let (text, content_type) = metrics::encode(&registry, None);
//! assert!(text.contains("# TYPE disagg_request_duration_seconds histogram"));
//! assert!(text.contains("disagg_requests_total{route=\"orchestrated\"} 0"));
//! assert!(content_type.starts_with("text/plain"));
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::sync::Arc;

use disagg_core::Orchestrator;
use http::HeaderValue;
use prometheus_client::registry::Registry;

mod endpoint;
mod orchestrator;
mod request;

pub use orchestrator::OrchestratorCollector;
pub use request::Metrics;

/// The OpenMetrics text format's content type: what `GET /metrics` answers to a scraper
/// that accepts it (Prometheus asks for it first).
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Prometheus' text format (0.0.4): what `GET /metrics` answers to any other client.
pub const TEXT_CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// The histograms' bucket bounds, in seconds: 0.5 ms to 500 s (over 8 minutes) in
/// 1-2.5-5 steps.
///
/// One set for every latency, so that panels compare: a handoff or a decode head on
/// loopback takes well under a millisecond, a prefill of a long prompt seconds, a long
/// generation minutes. Steps of 1-2.5-5 per decade keep `histogram_quantile`'s linear
/// interpolation within about a factor of 2.5 of the truth across the whole range, with
/// 19 buckets (20 series with `+Inf`) per label set; finer buckets would multiply the
/// series of every per-endpoint histogram.
pub const BUCKETS: [f64; 19] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0,
    50.0, 100.0, 250.0, 500.0,
];

/// More metrics for `GET /metrics`: the extension point for metrics that live outside
/// the orchestrator (an adapter's own), so that this crate needs to know nothing of the
/// adapter that keeps them.
///
/// The function registers metrics or [`Collector`](prometheus_client::collector::Collector)s
/// into the registry it is given; it runs once per registry built (once per
/// [`PdService`](crate::PdService)), not per scrape. A collector reads its values at each
/// scrape, so it should be cheap and must not block. Names must not clash with the
/// orchestrator's (prefix them, e.g. `disagg_lmcache_`).
///
/// # Examples
///
/// ```
/// use disagg_http::PdServiceConfig;
/// use disagg_http::metrics::ExtraMetrics;
/// use prometheus_client::metrics::counter::Counter;
///
/// let hits: Counter = Counter::default();
/// let registered = hits.clone();
/// let mut config = PdServiceConfig::default();
/// config.extra_metrics.push(ExtraMetrics::new(move |registry| {
///     // Exposed as `my_hits_total`.
///     registry.register("my_hits", "Hits.", registered.clone());
/// }));
/// hits.inc();
/// # let _ = config;
/// ```
#[derive(Clone)]
pub struct ExtraMetrics(Arc<dyn Fn(&mut Registry) + Send + Sync>);

impl ExtraMetrics {
    /// Metrics that `register` registers into the registry it is given.
    pub fn new(register: impl Fn(&mut Registry) + Send + Sync + 'static) -> Self {
        ExtraMetrics(Arc::new(register))
    }

    /// Register the metrics into `registry`.
    pub fn register(&self, registry: &mut Registry) {
        (self.0)(registry)
    }
}

impl fmt::Debug for ExtraMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExtraMetrics").finish_non_exhaustive()
    }
}

/// Register `orchestrator`'s counters and gauges, read at each scrape (see
/// [`OrchestratorCollector`]); [`Metrics::register`] does this too.
pub fn register_orchestrator(registry: &mut Registry, orchestrator: &Orchestrator) {
    registry.register_collector(Box::new(OrchestratorCollector::new(orchestrator.clone())));
}

/// `registry` encoded for a scraper whose `Accept` header is `accept`: OpenMetrics when it
/// accepts `application/openmetrics-text` (Prometheus does), Prometheus' text format
/// (0.0.4) otherwise; with the content type to answer.
pub fn encode(registry: &Registry, accept: Option<&HeaderValue>) -> (String, &'static str) {
    let openmetrics = accept
        .and_then(|v| v.to_str().ok())
        .is_some_and(accepts_openmetrics);
    let mut out = String::with_capacity(16 * 1024);
    // Encoding into a String fails only if a collector fails; what was written stays.
    if openmetrics {
        let _ = prometheus_client::encoding::text::encode(&mut out, registry);
        (out, OPENMETRICS_CONTENT_TYPE)
    } else {
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, registry);
        (out, TEXT_CONTENT_TYPE)
    }
}

/// Whether an `Accept` value lists `application/openmetrics-text` with a non-zero quality.
fn accepts_openmetrics(accept: &str) -> bool {
    accept.split(',').any(|range| {
        let mut parts = range.split(';').map(str::trim);
        let media = parts.next().unwrap_or_default();
        media.eq_ignore_ascii_case("application/openmetrics-text")
            && !parts.any(|p| {
                p.strip_prefix("q=")
                    .and_then(|q| q.parse::<f64>().ok())
                    .is_some_and(|q| q <= 0.0)
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{HttpTransport, PdService, PdServiceConfig};
    use disagg_connectors::vllm::VllmNixl;
    use disagg_core::{Endpoint, Role, source::StaticSource};
    use http_body_util::BodyExt;
    use prometheus_client::metrics::counter::Counter;
    use tower::ServiceExt;

    #[test]
    fn openmetrics_is_chosen_only_when_accepted() {
        // What Prometheus 2.x sends.
        let prom = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert!(accepts_openmetrics(prom));
        assert!(!accepts_openmetrics("text/plain;version=0.0.4"));
        assert!(!accepts_openmetrics("*/*"));
        assert!(!accepts_openmetrics("application/openmetrics-text; q=0"));
    }

    #[tokio::test]
    async fn extra_metrics_are_registered_once_and_read_on_every_scrape() {
        let source = StaticSource::new([
            Endpoint::new("http://127.0.0.1:1", Role::Prefill).unwrap(),
            Endpoint::new("http://127.0.0.1:2", Role::Decode).unwrap(),
        ]);
        let orchestrator =
            Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new()).build();
        let hits: Counter = Counter::default();
        let registered = hits.clone();
        let registrations = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = Arc::clone(&registrations);
        let mut config = PdServiceConfig::default();
        config
            .extra_metrics
            .push(ExtraMetrics::new(move |registry| {
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                registry.register("test_hits", "Hits.", registered.clone());
            }));
        let service = PdService::with_config(orchestrator, config);
        for (n, accept) in [(1, None), (2, Some(OPENMETRICS_CONTENT_TYPE))] {
            hits.inc();
            let mut req = http::Request::get("/metrics");
            if let Some(a) = accept {
                req = req.header(http::header::ACCEPT, a);
            }
            let req = req
                .body(http_body_util::Empty::<bytes::Bytes>::new())
                .unwrap();
            let resp = service.clone().oneshot(req).await.unwrap();
            assert_eq!(resp.status(), 200);
            let content_type = resp.headers()[http::header::CONTENT_TYPE].clone();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            let text = String::from_utf8(body.to_vec()).unwrap();
            assert!(
                text.contains("\ndisagg_requests_total{route=\"orchestrated\"} 0\n"),
                "{text}"
            );
            assert!(text.contains(&format!("\ntest_hits_total {n}\n")), "{text}");
            match accept {
                None => assert_eq!(content_type, TEXT_CONTENT_TYPE),
                Some(_) => {
                    assert_eq!(content_type, OPENMETRICS_CONTENT_TYPE);
                    assert!(text.ends_with("# EOF\n"), "{text}");
                }
            }
        }
        assert_eq!(
            registrations.load(std::sync::atomic::Ordering::Relaxed),
            1,
            "registered when the service was built, not per scrape"
        );
    }
}
