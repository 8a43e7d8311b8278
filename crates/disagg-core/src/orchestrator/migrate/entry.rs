//! Where a decode's answer becomes a [`Migrating`] body: the orchestrator's one call
//! into mid-stream migration, which builds the stream's shared context.

use std::sync::Arc;

use super::*;
use crate::orchestrator::Inner;

impl Inner {
    /// The client's body for the decode's `body` on `route`: a [`Migrating`] body when
    /// `req` may migrate (with what it shares with the attempt's report), which then
    /// holds the decode's in-flight `guard` and the route's place on it (each given
    /// back when the decode's stream ends or is abandoned); else `body` itself, and
    /// `guard` back. `handed_kv`: the decode was handed the KV of a prefill that
    /// answered.
    // The answer's parts, each from a different place in `respond`.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::orchestrator) fn migrating(
        &self,
        req: &PdRequest,
        route: &mut Route,
        meta: &crate::orchestrator::respond::RequestMeta,
        disaggregated: bool,
        handed_kv: bool,
        clock: crate::orchestrator::clock::Clock,
        body: BoxBody,
        guard: InFlightGuard,
        steps: (
            &crate::outcome::Timeline,
            Option<&Arc<crate::orchestrator::respond::LateMarks>>,
        ),
    ) -> (BoxBody, Option<Arc<Moved>>, Option<InFlightGuard>) {
        let Some(plan) = plan(&self.config.migration, req) else {
            return (body, None, Some(guard));
        };
        let moved = Arc::new(Moved::default());
        let ctx = Ctx {
            config: self.config.migration.clone(),
            plan,
            transport: Arc::clone(&self.transport),
            source: Arc::clone(&self.source),
            reporter: Arc::clone(&self.reporter),
            counters: Arc::clone(&self.counters),
            route: route.clone(),
            attempt: meta.attempts.saturating_sub(1),
            engine_id: meta.engine_id.clone(),
            forwarded: crate::orchestrator::legs::client_headers(&self.config, req.headers())
                .map(|(n, v)| (n.clone(), v.clone()))
                .collect(),
            head_timeout: self.config.decode_head_timeout,
            deadline: clock.deadline,
            queued: std::sync::atomic::AtomicBool::new(clock.queued),
            client: req.client(),
            moved: Arc::clone(&moved),
            handed_kv,
            late_kv: steps.1.filter(|_| disaggregated).cloned(),
            trace: meta
                .trace
                .as_ref()
                .map(|t| (t.clone(), Arc::clone(&self.spans))),
            through_prefill: (disaggregated && !self.config.migration.decode_only).then(|| {
                ThroughPrefill {
                    inner: self.me.clone(),
                    clock,
                }
            }),
        };
        let hold = route.take_decode_hold();
        let times = LegTimes::first_leg(steps.0, steps.1);
        let body = Migrating::new(body, ctx, guard, hold, times);
        (http_body_util::BodyExt::boxed(body), Some(moved), None)
    }
}
