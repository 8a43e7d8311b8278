//! Each endpoint's health for `GET /metrics`: [`Health::register_metrics`].

use std::fmt;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use super::{EndpointHealth, Health};
use disagg_core::endpoint::Role;

/// The states `disagg_endpoint_health` has a series for, as
/// [`EndpointHealth::as_str`] names them.
const STATES: [&str; 4] = ["healthy", "ejected", "half_open", "down"];

impl Health {
    /// Registers each endpoint's health into a Prometheus `registry`, read at each scrape
    /// (nothing is recorded on the request path beyond the ejection count):
    ///
    /// | metric | type | meaning |
    /// |---|---|---|
    /// | `disagg_endpoint_health{role,endpoint,state}` | gauge | 1 for the endpoint's state now (`healthy`, `ejected`, `half_open`, `down`), 0 for the others |
    /// | `disagg_endpoint_ejections_total{role,endpoint}` | counter | times the endpoint's breaker opened |
    ///
    /// Every state has a series (0 or 1) so that a dashboard can sum endpoints by state
    /// and an alert can fire on `state="ejected"` without the series appearing and
    /// vanishing. An endpoint the source no longer publishes is gone from the next
    /// scrape.
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_core::{Endpoint, Role, source::StaticSource};
    /// use disagg_resilience::{HealthConfig, HealthSource};
    /// use prometheus_client::registry::Registry;
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let source = HealthSource::new(
    ///     StaticSource::new([Endpoint::new("http://10.0.0.5:8100", Role::Prefill)?]),
    ///     HealthConfig::default(),
    /// );
    /// let mut registry = Registry::default();
    /// source.health().register_metrics(&mut registry);
    /// let mut text = String::new();
    /// prometheus_client::encoding::text::encode(&mut text, &registry)?;
    /// assert!(text.contains(
    ///     "disagg_endpoint_health{role=\"prefill\",endpoint=\"http://10.0.0.5:8100\",state=\"healthy\"} 1\n"
    /// ));
    /// # Ok(())
    /// # }
    /// ```
    pub fn register_metrics(self: &Arc<Self>, registry: &mut Registry) {
        registry.register_collector(Box::new(HealthCollector(Arc::clone(self))));
    }
}

/// [`Health::register_metrics`]' collector.
struct HealthCollector(Arc<Health>);

impl fmt::Debug for HealthCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HealthCollector").finish_non_exhaustive()
    }
}

fn role_name(role: Role) -> &'static str {
    role.as_str()
}

impl Collector for HealthCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> fmt::Result {
        let counts = self.0.counts();
        let mut health = encoder.encode_descriptor(
            "disagg_endpoint_health",
            "Each endpoint's health now: 1 for its state (healthy, ejected, half_open, down), 0 for the others.",
            None,
            MetricType::Gauge,
        )?;
        for (id, role, state, _) in &counts {
            let now = EndpointHealth::as_str(state);
            for s in STATES {
                let labels = [
                    ("role", role_name(*role)),
                    ("endpoint", id.as_str()),
                    ("state", s),
                ];
                ConstGauge::new(i64::from(s == now)).encode(health.encode_family(&labels)?)?;
            }
        }
        // Counters are named without `_total`: the encoders append it.
        let mut ejections = encoder.encode_descriptor(
            "disagg_endpoint_ejections",
            "Times an endpoint's circuit breaker opened (ejections).",
            None,
            MetricType::Counter,
        )?;
        for (id, role, _, n) in &counts {
            let labels = [("role", role_name(*role)), ("endpoint", id.as_str())];
            ConstCounter::new(*n).encode(ejections.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use disagg_core::{Endpoint, Role, source::StaticSource};
    use prometheus_client::registry::Registry;

    use crate::{HealthConfig, HealthSource};

    fn scrape(registry: &Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        text
    }

    #[tokio::test(start_paused = true)]
    async fn an_ejection_shows_as_the_ejected_state_and_counts() {
        let a = || Endpoint::new("http://a:1", Role::Decode).unwrap();
        let source = HealthSource::new(StaticSource::new([a()]), HealthConfig::default());
        let health = source.health();
        let mut registry = Registry::default();
        health.register_metrics(&mut registry);
        let series = |state: &str| {
            format!(
                "disagg_endpoint_health{{role=\"decode\",endpoint=\"http://a:1\",state=\"{state}\"}}"
            )
        };
        let text = scrape(&registry);
        assert!(
            text.contains(&format!("{} 1\n", series("healthy"))),
            "{text}"
        );
        assert!(
            text.contains(&format!("{} 0\n", series("ejected"))),
            "{text}"
        );
        assert!(text.contains(
            "disagg_endpoint_ejections_total{role=\"decode\",endpoint=\"http://a:1\"} 0\n"
        ));
        // The default threshold: five failures in a row eject.
        for _ in 0..5 {
            health.record(&a(), false);
        }
        let text = scrape(&registry);
        assert!(
            text.contains(&format!("{} 0\n", series("healthy"))),
            "{text}"
        );
        assert!(
            text.contains(&format!("{} 1\n", series("ejected"))),
            "{text}"
        );
        assert!(text.contains(
            "disagg_endpoint_ejections_total{role=\"decode\",endpoint=\"http://a:1\"} 1\n"
        ));
    }
}
