//! [`HealthSource`]: the set of another source minus its unhealthy endpoints.

use super::*;

// === impl HealthSource ===

/// An [`EndpointSource`] over another that publishes its set minus the endpoints that
/// are ejected or down.
///
/// The published set is rebuilt with [`EndpointSet::retain`] (per-model subsets
/// included, the inner set's served models kept) only when something is left out;
/// otherwise the inner set itself is passed on. When every endpoint of a role is left
/// out, the set has none of that role, and the orchestrator applies its no-prefill
/// policy (or answers 503 for decode); likewise when every decode of a model is left
/// out, a request for it is answered 503, not 404 as for a model never served. See the
/// [module docs](super) for when changes become visible. Its [`Health`] is the
/// source's [`listener`](EndpointSource::listener): an orchestrator built over the
/// source feeds it every attempt's report, with nothing to wire.
#[derive(Debug, Clone)]
pub struct HealthSource {
    pub(super) health: Arc<Health>,
}

impl HealthSource {
    /// Health-filter `inner`'s sets; every endpoint starts healthy.
    pub fn new(inner: impl EndpointSource, config: HealthConfig) -> Self {
        HealthSource {
            health: Arc::new(Health::new(Box::new(inner), config)),
        }
    }

    /// The health states and their feedback entry (also the source's listener).
    pub fn health(&self) -> &Arc<Health> {
        &self.health
    }
}

impl EndpointSource for HealthSource {
    fn watch(&self) -> watch::Receiver<Arc<EndpointSet>> {
        self.health.refresh_if_due();
        self.health.tx.subscribe()
    }

    fn snapshot(&self) -> Arc<EndpointSet> {
        self.health.refresh_if_due();
        self.health.tx.borrow().clone()
    }

    /// The inner source's set, before health filtering: the ejected and down
    /// endpoints included.
    fn unfiltered_snapshot(&self) -> Arc<EndpointSet> {
        self.health.inner.snapshot()
    }

    fn listener(&self) -> Option<Arc<dyn Listener>> {
        Some(Arc::clone(&self.health) as Arc<dyn Listener>)
    }
}

/// Passive health: each leg's verdict counts for its endpoint in its role. An engine
/// that answered (its 4xx included) works; one to blame failed; a leg that was not sent
/// or was abandoned through no fault of its engine counts for nothing.
///
/// A call of an engine outside the legs that failed counts as a failure of that
/// endpoint in its role, like a failed leg: an engine whose `/tokenize` hangs is
/// ejected after `failure_threshold` of them, and the set the tokenizer picks from
/// leaves it out; so is one that refuses the requests `disagg-http` forwards to it or
/// sends it direct. One that answered counts as a success when the engine
/// [`served`](EngineCall::served) a client's request (an encoder's calls, E/P/D, are
/// its legs; generation `disagg-http` sent direct, answered to its end; never a
/// forwarded or fanned-out request, whose answer may be to any path), and for nothing
/// otherwise: an engine answering `/tokenize` may still fail its legs, and a success
/// would reset their count.
impl Listener for Health {
    fn on_engine_call(&self, call: &EngineCall) {
        match call.outcome {
            LegOutcome::Failed => self.record(&call.endpoint, false),
            LegOutcome::Answered if call.served => self.record(&call.endpoint, true),
            _ => {}
        }
    }

    fn on_report(&self, report: &Report) {
        let legs = [
            (report.route.prefill.as_ref(), report.prefill),
            (Some(&report.route.decode), report.decode),
        ];
        for (endpoint, verdict) in legs {
            let Some(endpoint) = endpoint else { continue };
            match verdict {
                LegOutcome::Answered => self.record(endpoint, true),
                LegOutcome::Failed => self.record(endpoint, false),
                _ => {}
            }
        }
    }
}
