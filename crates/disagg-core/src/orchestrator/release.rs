//! The KV a sequential prefill holds for its decode leg, and its early release.
//!
//! A [`KvHold`] is made with the prefill exchange and moves through the sequential
//! dispatch, where its own steps say what the prefill holds: [`prefill`](KvHold::prefill)
//! (nothing, once the prefill failed), [`complete`](KvHold::complete) (the decode leg
//! that would take the KV, once the handoff is folded in; nothing when the answer carried
//! none), and [`taken`](KvHold::taken), which consumes the hold once the decode's
//! engine accepted its leg. A hold dropped any other way (the client left, a budget ran
//! out, the decode refused its leg) releases what it holds, when
//! [`KvRelease::AbortDecode`](super::KvRelease::AbortDecode) is on: there is no disarm
//! call to forget.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use super::stats::{Counters, GaugeGuard, bump};
use crate::connector::{Handoff, HandoffFound, KvConnector, Leg, PrefillAnswer};
use crate::error::{PdError, Phase, Side};
use crate::request::Api;
use crate::transport::Transport;

use super::clock::{Clock, within};
use super::legs::{PrefillResult, http_request};

/// The prefill exchange of a sequential handoff.
pub(super) type PrefillFuture =
    Pin<Box<dyn Future<Output = Result<PrefillResult, PdError>> + Send>>;

/// What the prefill holds for the decode leg.
enum Stage {
    /// Nothing (the prefill failed, handed nothing over, or the decode took it).
    Nothing,
    /// The prefill exchange is running.
    Prefilling(PrefillFuture),
    /// The prefill answered; the handoff is being folded into the decode leg.
    Answered(PrefillAnswer),
    /// The decode leg that takes the KV is ready (and maybe sent).
    Handed(Leg),
}

/// The KV a sequential prefill holds, released when dropped unless [`taken`](Self::taken).
pub(super) struct KvHold {
    stage: Stage,
    /// `None` when early release is off: the hold then only tracks.
    release: Option<Release>,
}

/// What a background release needs, made only when the feature is on.
pub(super) struct Release {
    pub(super) grace: Duration,
    pub(super) wait: Duration,
    pub(super) handoff: Handoff,
    pub(super) api: Api,
    pub(super) connector: Arc<dyn KvConnector>,
    pub(super) transport: Arc<dyn Transport>,
    pub(super) counters: Arc<Counters>,
}

impl KvHold {
    /// The hold of a prefill exchange that has just started.
    pub(super) fn new(prefill: PrefillFuture, release: Option<Release>) -> Self {
        KvHold {
            stage: Stage::Prefilling(prefill),
            release,
        }
    }

    /// The prefill's result, or `None` when `budget` ran out first (the exchange then
    /// stays held: a release may still catch its answer). A prefill that ended holds
    /// what its answer says: the caller tells the hold with [`complete`](Self::complete).
    pub(super) async fn prefill(
        &mut self,
        budget: Duration,
    ) -> Option<Result<PrefillResult, PdError>> {
        let Stage::Prefilling(fut) = &mut self.stage else {
            return None;
        };
        let result = tokio::time::timeout(budget, fut).await.ok()?;
        self.stage = match (&result, &self.release) {
            (Ok(PrefillResult::Answer(answer)), Some(_)) => Stage::Answered(answer.clone()),
            _ => Stage::Nothing,
        };
        Some(result)
    }

    /// Fold the prefill's `answer` into the decode leg of `handoff` with `connector`,
    /// within `budget`; the hold then holds the decode leg when the KV was handed over,
    /// and nothing otherwise.
    pub(super) async fn complete(
        &mut self,
        connector: &dyn KvConnector,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
        clock: Clock,
        budget: Duration,
    ) -> Result<HandoffFound, PdError> {
        let prefill_ep = Arc::clone(&handoff.prefill.endpoint);
        let complete = async {
            connector
                .complete(handoff, answer)
                .await
                .map_err(|e| PdError::connector(Side::Prefill, e))
        };
        let handed = within(
            clock,
            budget,
            Side::Prefill,
            &prefill_ep,
            Phase::Handoff,
            complete,
        )
        .await;
        // A handoff that failed, or that handed nothing over, leaves nothing to release.
        self.stage = match (&handed, &self.release) {
            (Ok(HandoffFound::Handed), Some(_)) => Stage::Handed(handoff.decode.clone()),
            _ => Stage::Nothing,
        };
        handed
    }

    /// The decode's engine accepted its leg: the KV is the engine's business now.
    pub(super) fn taken(mut self) {
        self.stage = Stage::Nothing;
    }
}

impl Drop for KvHold {
    fn drop(&mut self) {
        let stage = std::mem::replace(&mut self.stage, Stage::Nothing);
        if matches!(stage, Stage::Nothing) {
            return;
        }
        let (Some(release), Ok(runtime)) =
            (self.release.take(), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        // The one task the orchestrator spawns: bounded by `grace` + `wait`, counted in
        // `kv_releases_in_flight`.
        runtime.spawn(release.run(stage));
    }
}

impl Release {
    /// Release the KV a dropped request's prefill holds (see
    /// [`KvRelease::AbortDecode`](super::KvRelease::AbortDecode)).
    async fn run(mut self, stage: Stage) {
        let counters = Arc::clone(&self.counters);
        let _running = GaugeGuard::new(&counters.kv_releases_in_flight);
        let answer = match stage {
            Stage::Nothing => return,
            Stage::Handed(leg) => return self.send(leg).await,
            Stage::Answered(answer) => answer,
            Stage::Prefilling(fut) => match tokio::time::timeout(self.grace, fut).await {
                Ok(Ok(PrefillResult::Answer(answer))) => answer,
                // Failed, refused by the engine, or still running: it holds nothing,
                // or is aborted (and frees its blocks) as `fut` drops here.
                _ => return,
            },
        };
        let complete = self.connector.complete(&mut self.handoff, &answer);
        if let Ok(Ok(HandoffFound::Handed)) = tokio::time::timeout(self.wait, complete).await {
            let leg = self.handoff.decode.clone();
            self.send(leg).await;
        }
    }

    /// Send the connector's release leg for `leg` ([`KvConnector::release_leg`]), and
    /// drop it at its response head or after `wait`.
    async fn send(self, leg: Leg) {
        // The connector says what takes the KV (vLLM: the leg as a one-token prefill);
        // one that has no such leg releases nothing.
        let Some(body) = self.connector.release_leg(self.api, &leg) else {
            return;
        };
        let Ok(req) = http_request(self.api, &leg, body, std::iter::empty()) else {
            return;
        };
        bump(&self.counters.kv_releases);
        tracing::debug!(
            decode = %leg.endpoint.id(),
            "releasing the KV of a request that ended before its decode"
        );
        let _ = tokio::time::timeout(self.wait, self.transport.send(req)).await;
    }
}
