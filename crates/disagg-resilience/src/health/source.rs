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
        let decode = &report.route.decode;
        if let Some(prefill) = report.route.prefill.as_ref() {
            let verdict = match (report.prefill, report.decode) {
                // Its KV handed and the decode failed as a lost KV load does: whose
                // failure is it? (A first decode whose stream broke so and moved on is
                // told by a report of its own, the prefill's leg not in it.)
                (_, LegOutcome::Failed) if report.kv_load_suspect => self.lost_kv(prefill, decode),
                // The answer moved on to a decode never handed this prefill's KV: its
                // end says nothing of the prefill, whose handoff the first decode's
                // report weighed. (A success here would wipe the failures that rule
                // counts against a prefill whose KV no decode can load.)
                (LegOutcome::Answered, _) if report.moved => None,
                (LegOutcome::Answered, decode) => {
                    // Served by a decode: the KV it handed was loaded (a refusal, a
                    // decode that failed on its own, or a prefill whose answer was the
                    // whole answer or whose decode has not run yet, says nothing of it).
                    if decode == LegOutcome::Answered && report.outcome == Outcome::Success {
                        self.kv_loaded(prefill);
                    }
                    Some(true)
                }
                (LegOutcome::Failed, _) => Some(false),
                _ => None,
            };
            if let Some(ok) = verdict {
                self.record(prefill, ok);
            }
        }
        match report.decode {
            LegOutcome::Answered => self.record(decode, true),
            LegOutcome::Failed => self.record(decode, false),
            _ => {}
        }
    }
}

impl Health {
    /// The prefill `prefill` answered and handed its KV to `decode`, whose leg then
    /// failed as a lost KV load does ([`Report::kv_load_suspect`]: a 5xx head, a 5xx
    /// error event, a stream with no answer; not an unreachable decode, a timeout or a
    /// stream that broke off): the decode is told failed (as any failed leg), and the
    /// prefill's own verdict is returned. Such a failure cannot say whose the KV loss
    /// was (vLLM answers a failed KV load as its own 500, or an error event in its
    /// stream), but the prefill's handoffs across decodes can: when the one before
    /// failed so too, on another decode, with no handoff of this prefill's served
    /// since, the prefill is failed (`Some(false)`): its KV is what no decode could load. The
    /// first such failure, or one on the same decode again, says nothing of the
    /// prefill (`None`): neither its success, which would reset its count, nor its
    /// failure. Without this, a prefill whose KV no decode can load (its side channel
    /// unreachable, a wrong advertised host) stays healthy while the decodes take the
    /// blame in turn.
    fn lost_kv(&self, prefill: &Endpoint, decode: &Endpoint) -> Option<bool> {
        let on = decode_key(decode);
        let before = {
            let registry = read(&self.registry);
            registry
                .get(prefill)?
                .lost_kv_on
                .swap(on, Ordering::Relaxed)
        };
        (before != 0 && before != on).then_some(false)
    }

    /// A handoff of `prefill`'s served: the failures before it say nothing of the next.
    fn kv_loaded(&self, prefill: &Endpoint) {
        if let Some(state) = read(&self.registry).get(prefill) {
            // Read first: a store only after a failure, as for the breaker's count.
            if state.lost_kv_on.load(Ordering::Relaxed) != 0 {
                state.lost_kv_on.store(0, Ordering::Relaxed);
            }
        }
    }
}

/// A decode's key in [`EndpointState::lost_kv_on`]: a hash of its id, never 0.
fn decode_key(decode: &Endpoint) -> u64 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::default().hash_one(decode.id().as_str()) | 1
}
