//! [`Metrics`]: the latency histograms and per-endpoint counters, recorded from each
//! attempt's report and each request's summary.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use disagg_core::Orchestrator;
use disagg_core::endpoint::Role;
use disagg_core::outcome::{EngineCall, Listener, Report, Summary};
use disagg_core::request::Api;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use tokio::sync::watch;

use crate::routed::{RouteListener, RouteSummary};

use super::endpoint::{self, Endpoints, Families, Histograms, histogram};

/// How often [`Metrics::follow`] looks again without a change of the set.
const PRUNE_EVERY: Duration = Duration::from_secs(5);

/// The values of `outcome` ([`Summary::outcome`]), in the index order of the handles.
const OUTCOMES: [&str; 4] = ["success", "client_error", "error", "cancelled"];
const APIS: [(Api, &str); N_APIS] = [
    (Api::Chat, "chat"),
    (Api::Completions, "completions"),
    (Api::Generate, "generate"),
    (Api::TokenGenerate, "token_generate"),
    (Api::Messages, "messages"),
    (Api::Responses, "responses"),
    (Api::CohereChat, "cohere_chat"),
];
/// How many APIs have series.
const N_APIS: usize = 7;
const STREAMS: [&str; 2] = ["false", "true"];
/// Buckets of `disagg_encode_items_per_request`.
const ITEM_BUCKETS: [f64; 8] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 256.0];

/// Records the proxy's latency histograms and each endpoint's legs: a
/// [`Listener`] to attach to the orchestrator
/// ([`OrchestratorBuilder::listener`](disagg_core::orchestrator::OrchestratorBuilder::listener)),
/// whose metrics [`register`](Self::register) puts in a [`Registry`] (which
/// [`PdService`](crate::PdService) does with
/// [`PdServiceConfig::metrics`](crate::PdServiceConfig::metrics)).
///
/// | metric | type | from |
/// |---|---|---|
/// | `disagg_request_duration_seconds{api,stream,outcome}` | histogram | arrival to the response's end (its last byte, its break, or the client leaving) |
/// | `disagg_time_to_first_token_seconds{api,stream}` | histogram | arrival to the first byte of the response body sent to the client |
/// | `disagg_queue_wait_seconds` | histogram | time waited for admission, for requests that waited |
/// | `disagg_encode_duration_seconds` | histogram | the encoder stage (E/P/D), for requests that went through one |
/// | `disagg_encode_items_per_request` | histogram | media items encoded, per request that went through the encoder stage |
/// | `disagg_migration_duration_seconds` | histogram | each mid-stream migration whose continuation reached the client: the time the client's stream stood still, from the break to the continuation's first byte |
/// | `disagg_prefill_duration_seconds{endpoint}` | histogram | prefill leg sent until answered |
/// | `disagg_kv_handoff_duration_seconds{connector}` | histogram | the handoff step: from the prefill's answer (sequential) or the plan (concurrent), through any bootstrap or notification wait, until the decode leg is sent |
/// | `disagg_decode_head_seconds{endpoint}` | histogram | decode leg sent until its response head |
/// | `disagg_decode_first_chunk_seconds{endpoint}` | histogram | decode leg sent until its first body chunk |
/// | `disagg_endpoint_requests_total{role,endpoint,outcome}` | counter | legs sent to the endpoint, by how they ended: `answered`, `failed` (the engine's fault), `abandoned` (the client left, a deadline, the other leg failed) |
///
/// Every attempt counts in the leg metrics (a retried request's failed attempt too); the
/// request metrics count each request once. The request-path cost is a few
/// uncontended locks and one hash lookup of each leg's endpoint id (see
/// `docs/performance.md`); label sets are resolved when a series is created, never per
/// request.
///
/// Cheap to clone: clones share the same series.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

struct Inner {
    connector: &'static str,
    /// By [`APIS`], [`STREAMS`], [`OUTCOMES`].
    duration: [[[Histogram; 4]; 2]; N_APIS],
    /// By [`APIS`], [`STREAMS`].
    first_token: [[Histogram; 2]; N_APIS],
    queue_wait: Histogram,
    encode: Histogram,
    encode_items: Histogram,
    /// The time lost to each mid-stream migration.
    migration: Histogram,
    handoff: Histogram,
    duration_family: Histograms<[(&'static str, &'static str); 3]>,
    first_token_family: Histograms<[(&'static str, &'static str); 2]>,
    handoff_family: Histograms<[(&'static str, &'static str); 1]>,
    endpoints: Arc<Endpoints>,
    families: Families,
    /// Requests the orchestrator did not serve, by [`RouteKind::index`](crate::routed::RouteKind).
    routed: Arc<[AtomicU64; 5]>,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics")
            .field("connector", &self.inner.connector)
            .finish_non_exhaustive()
    }
}

fn seconds(d: Duration) -> f64 {
    d.as_secs_f64()
}

impl Metrics {
    /// Metrics for an orchestrator whose connector is named `connector`
    /// ([`KvConnector::name`](disagg_core::KvConnector::name): the handoff histogram's
    /// label).
    pub fn new(connector: &'static str) -> Self {
        Self::with_endpoint_retention(connector, endpoint::DEFAULT_RETENTION)
    }

    /// As [`new`](Self::new), keeping the series of an endpoint that left the endpoint set
    /// for `retention` after its last use (default 10 minutes; see `docs/observability.md`).
    pub fn with_endpoint_retention(connector: &'static str, retention: Duration) -> Self {
        let duration_family: Histograms<[(&'static str, &'static str); 3]> =
            Family::new_with_constructor(histogram);
        let first_token_family: Histograms<[(&'static str, &'static str); 2]> =
            Family::new_with_constructor(histogram);
        let handoff_family: Histograms<[(&'static str, &'static str); 1]> =
            Family::new_with_constructor(histogram);
        // Every label set of the request histograms is known: resolved here, once.
        let duration = APIS.map(|(_, api)| {
            STREAMS.map(|stream| {
                OUTCOMES.map(|outcome| {
                    duration_family
                        .get_or_create(&[("api", api), ("stream", stream), ("outcome", outcome)])
                        .clone()
                })
            })
        });
        let first_token = APIS.map(|(_, api)| {
            STREAMS.map(|stream| {
                first_token_family
                    .get_or_create(&[("api", api), ("stream", stream)])
                    .clone()
            })
        });
        let handoff = handoff_family
            .get_or_create(&[("connector", connector)])
            .clone();
        let families = Families::new();
        Metrics {
            inner: Arc::new(Inner {
                connector,
                duration,
                first_token,
                queue_wait: histogram(),
                encode: histogram(),
                encode_items: Histogram::new(ITEM_BUCKETS),
                migration: histogram(),
                handoff,
                duration_family,
                first_token_family,
                handoff_family,
                endpoints: Arc::new(Endpoints::new(families.clone(), retention)),
                families,
                routed: Arc::default(),
            }),
        }
    }

    /// Register these metrics in `registry`, with `orchestrator`'s counters and gauges
    /// ([`register_orchestrator`](super::register_orchestrator)); the series of endpoints
    /// gone from `orchestrator`'s set are dropped at scrapes of this registry (see
    /// [`with_endpoint_retention`](Self::with_endpoint_retention)).
    pub fn register(&self, registry: &mut Registry, orchestrator: &Orchestrator) {
        let i = &self.inner;
        let f = &i.families;
        registry.register_with_unit(
            "disagg_request_duration",
            "Requests from arrival to the response's end (last byte, break or the client leaving).",
            Unit::Seconds,
            i.duration_family.clone(),
        );
        registry.register_with_unit(
            "disagg_time_to_first_token",
            "Requests from arrival to the first byte of the response body sent to the client.",
            Unit::Seconds,
            i.first_token_family.clone(),
        );
        registry.register_with_unit(
            "disagg_encode_duration",
            "The encoder stage of requests that went through one (E/P/D).",
            Unit::Seconds,
            i.encode.clone(),
        );
        registry.register(
            "disagg_encode_items_per_request",
            "Media items encoded per request that went through the encoder stage.",
            i.encode_items.clone(),
        );
        registry.register_with_unit(
            "disagg_migration_duration",
            "Mid-stream migrations whose continuation reached the client, from the break to the continuation's first byte.",
            Unit::Seconds,
            i.migration.clone(),
        );
        registry.register_with_unit(
            "disagg_queue_wait",
            "Time requests waited for admission (those that waited).",
            Unit::Seconds,
            i.queue_wait.clone(),
        );
        registry.register_with_unit(
            "disagg_prefill_duration",
            "Prefill legs from sending to the engine's answer, by prefill endpoint.",
            Unit::Seconds,
            f.prefill.clone(),
        );
        registry.register_with_unit(
            "disagg_kv_handoff_duration",
            "The KV handoff step, from the prefill's answer or the plan until the decode leg is sent, by connector.",
            Unit::Seconds,
            i.handoff_family.clone(),
        );
        registry.register_with_unit(
            "disagg_decode_head",
            "Decode legs from sending to the engine's response head, by decode endpoint.",
            Unit::Seconds,
            f.decode_head.clone(),
        );
        registry.register_with_unit(
            "disagg_decode_first_chunk",
            "Decode legs from sending to the engine's first body chunk, by decode endpoint.",
            Unit::Seconds,
            f.decode_first_chunk.clone(),
        );
        registry.register(
            "disagg_endpoint_requests",
            "Legs sent to an endpoint, by how they ended: answered, failed (the engine's fault), abandoned.",
            f.legs.clone(),
        );
        registry.register_collector(Box::new(
            super::OrchestratorCollector::new(orchestrator.clone())
                .with_routed(Arc::clone(&i.routed)),
        ));
        registry.register_collector(Box::new(Prune {
            endpoints: Arc::clone(&i.endpoints),
            orchestrator: orchestrator.clone(),
        }));
    }

    /// Follow `orchestrator`'s endpoint set until `stop` turns `true` (or its sender
    /// goes): whenever the set changes, and every five seconds for endpoints still
    /// held then (their last requests running, a component that lets go at its next
    /// round), drop the series of the endpoints that left
    /// (see [`register`](Self::register) for the rule), so that their cardinality
    /// follows the set whether or not anything scrapes. Spawn it once, beside the
    /// service; nothing on the request path waits for it.
    pub async fn follow(self, orchestrator: Orchestrator, mut stop: watch::Receiver<bool>) {
        let mut sets = orchestrator.source().watch();
        loop {
            let set = sets.borrow_and_update().clone();
            self.inner.endpoints.prune(&set, Instant::now());
            drop(set);
            tokio::select! {
                changed = sets.changed() => if changed.is_err() { return },
                () = tokio::time::sleep(PRUNE_EVERY) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    }

    #[cfg(test)]
    pub(super) fn endpoints(&self) -> &Endpoints {
        &self.inner.endpoints
    }
}

/// Counts the requests the orchestrator did not serve, by kind
/// (`disagg_requests_total{route}`): attach it to
/// [`PdServiceConfig::route_listeners`](crate::PdServiceConfig::route_listeners) (and
/// the key layer's, `auth::ApiKeyLayer::tell_refusals`).
impl RouteListener for Metrics {
    fn on_route(&self, summary: &RouteSummary) {
        self.inner.routed[summary.kind.index()].fetch_add(1, Relaxed);
    }
}

impl Listener for Metrics {
    fn on_report(&self, report: &Report) {
        let i = &self.inner;
        let tl = &report.timeline;
        let at = tl.end.unwrap_or(tl.start);
        let phases = report.phases;
        if let Some(prefill) = &report.route.prefill {
            i.endpoints.with(prefill, at, |s| {
                s.leg(report.prefill);
                if let (Some(h), Some(d)) = (&s.first, phases.prefill) {
                    h.observe(seconds(d));
                }
            });
        }
        if let Some(d) = phases.handoff {
            i.handoff.observe(seconds(d));
        }
        i.endpoints.with(&report.route.decode, at, |s| {
            s.leg(report.decode);
            if let (Some(h), Some(d)) = (&s.first, phases.decode_head) {
                h.observe(seconds(d));
            }
            if let (Some(h), Some(d)) = (&s.second, phases.decode_first_chunk) {
                h.observe(seconds(d));
            }
        });
    }

    /// An encoder leg (E/P/D) counts in its encoder's
    /// `disagg_endpoint_requests_total{role="encode"}`; other calls (`/tokenize`) are not
    /// legs and are not counted here.
    fn on_engine_call(&self, call: &EngineCall) {
        if call.endpoint.role() == Role::Encode {
            let at = Instant::now();
            self.inner
                .endpoints
                .with(&call.endpoint, at, |s| s.leg(call.outcome));
        }
    }

    fn on_request(&self, summary: &Summary) {
        let i = &self.inner;
        // An API this version does not know (`Api` is non-exhaustive) has no series.
        let Some(api) = APIS.iter().position(|(a, _)| *a == summary.api) else {
            return;
        };
        let stream = usize::from(summary.stream);
        let outcome = match summary.outcome {
            "success" => 0,
            "client_error" => 1,
            "cancelled" => 3,
            _ => 2,
        };
        i.duration[api][stream][outcome].observe(seconds(summary.duration));
        if let Some(d) = summary.time_to_first_byte {
            i.first_token[api][stream].observe(seconds(d));
        }
        if let Some(d) = summary.queued {
            i.queue_wait.observe(seconds(d));
        }
        if let Some(e) = summary.encode {
            i.encode.observe(seconds(e.duration));
            i.encode_items.observe(f64::from(e.items));
        }
        for m in &summary.migrated {
            if let Some(d) = m.time_lost {
                i.migration.observe(seconds(d));
            }
        }
    }
}

/// Drops the series of endpoints gone from the orchestrator's set at each scrape (it
/// encodes nothing itself; what it drops is gone from the next scrape).
struct Prune {
    endpoints: Arc<Endpoints>,
    orchestrator: Orchestrator,
}

impl fmt::Debug for Prune {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Prune").finish_non_exhaustive()
    }
}

impl Collector for Prune {
    fn encode(&self, _encoder: DescriptorEncoder<'_>) -> fmt::Result {
        let set = self.orchestrator.source().snapshot();
        self.endpoints.prune(&set, Instant::now());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HttpTransport;
    use disagg_connectors::vllm::VllmNixl;
    use disagg_core::{Endpoint, Role, source::StaticSource};

    #[test]
    fn every_request_label_set_is_there_before_any_request() {
        let source = StaticSource::new([
            Endpoint::new("http://127.0.0.1:1", Role::Prefill).unwrap(),
            Endpoint::new("http://127.0.0.1:2", Role::Decode).unwrap(),
        ]);
        let metrics = Metrics::new("nixl");
        let orchestrator = Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new())
            .listener(metrics.clone())
            .build();
        let mut registry = Registry::default();
        metrics.register(&mut registry, &orchestrator);
        let (text, _) = super::super::encode(&registry, None);
        for (_, api) in APIS {
            for stream in STREAMS {
                for outcome in OUTCOMES {
                    let series = format!(
                        "disagg_request_duration_seconds_count{{api=\"{api}\",stream=\"{stream}\",outcome=\"{outcome}\"}} 0"
                    );
                    assert!(text.contains(&series), "{series} in {text}");
                }
            }
        }
        assert!(text.contains("disagg_kv_handoff_duration_seconds_count{connector=\"nixl\"} 0"));
        assert_eq!(
            metrics.endpoints().len(),
            0,
            "no endpoint series before a leg"
        );
    }
}
