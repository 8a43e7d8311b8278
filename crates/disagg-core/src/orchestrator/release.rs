//! The KV a sequential prefill holds for its decode leg, and its early release.
//!
//! A [`KvHold`] is made with the prefill exchange and moves through the sequential
//! dispatch, where its own steps say what the prefill holds: [`prefill`](KvHold::prefill)
//! (nothing, once the prefill failed), [`complete`](KvHold::complete) (the decode leg
//! that would take the KV, once the handoff is folded in; nothing when the answer carried
//! none), and [`taken`](KvHold::taken), which consumes the hold once the decode's
//! engine accepted its leg: when the first frame of its 2xx answer came
//! ([`until_first_frame`](KvHold::until_first_frame)), not at its head, which vLLM sends
//! for a stream before it loads the KV (a gated plan's KV, pushed to the decode, at the
//! head: the decode takes it from its own buffer before its first token, and a release
//! leg after that would find none and compute the prompt). A hold dropped any other way (the client left,
//! a budget ran out, the decode refused its leg or its answer broke before its first
//! frame) releases what it holds, when
//! [`KvRelease::AbortDecode`](super::KvRelease::AbortDecode) is on: there is no disarm
//! call to forget.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use sync_wrapper::SyncWrapper;

use std::sync::atomic::Ordering::Relaxed;

use super::stats::{Counters, bump};
use crate::connector::{Handoff, HandoffFound, KvConnector, Leg, PrefillAnswer};
use crate::error::BoxError;
use crate::error::{PdError, Phase, Side};
use crate::request::Api;
use crate::transport::{BoxBody, Transport};

use super::clock::{Clock, within};
use super::legs::{PrefillResult, http_request};

/// At most this many early releases run at once. Each lives up to `grace` + 2 × `wait`
/// after its request ended; past this many (a storm of abandoned requests), a dropped
/// request's KV is left to the engine's own expiry and the release is counted as
/// skipped (`kv_releases_skipped`).
pub(super) const MAX_RELEASES: u64 = 4096;

/// At most this many bytes of legs are held by running early releases. A release holds
/// its request's legs, and with them the client's body they are cut from, after the
/// request ended and its body's share of the server's budget was given back: past
/// this, a release is skipped as past [`MAX_RELEASES`].
pub(super) const MAX_RELEASE_BYTES: u64 = 512 << 20;

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
    /// The size of the client's body the legs are cut from, which the release keeps
    /// alive whatever the legs' own fields add up to.
    pub(super) received: usize,
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

    /// The decode's 2xx answer `body`, holding the KV until its first frame (or its
    /// end): vLLM sends a stream's head before it loads the KV, so a client that
    /// leaves between the head and the first chunk leaves the load unfinished, and the
    /// prefill's blocks are released as when it leaves before the head. Without early
    /// release the hold only tracks: taken now, the body as it is.
    pub(super) fn until_first_frame(self, body: BoxBody) -> BoxBody {
        if self.release.is_none() || matches!(self.stage, Stage::Nothing) {
            self.taken();
            return body;
        }
        BoxBody::new(Holding {
            inner: body,
            hold: Some(SyncWrapper::new(self)),
        })
    }
}

pin_project_lite::pin_project! {
    /// A decode's answer that holds the prefill's KV until its first frame.
    struct Holding {
        #[pin]
        inner: BoxBody,
        hold: Option<SyncWrapper<KvHold>>,
    }
}

impl Body for Holding {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        if matches!(polled, Poll::Ready(Some(Ok(_)) | None))
            && let Some(hold) = this.hold.take()
        {
            hold.into_inner().taken();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
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
        // What the release keeps alive: the client's body (the legs are slices of it,
        // and a connector's additions), and the prefill's answer once it is held.
        let legs = release
            .handoff
            .prefill
            .body
            .size()
            .max(release.handoff.decode.body.size());
        let answer = match &stage {
            Stage::Answered(answer) => answer.body.len() as u64,
            _ => 0,
        };
        let held = (legs.max(release.received) as u64).saturating_add(answer);
        let Some(slot) = Slot::take(&release.counters, held) else {
            return;
        };
        // The one task the orchestrator spawns: bounded by `grace` + 2 × `wait`,
        // counted in `kv_releases_in_flight`, within the releases' room.
        runtime.spawn(release.run(stage, slot));
    }
}

/// One running release's share of the releases' room ([`MAX_RELEASES`],
/// [`MAX_RELEASE_BYTES`]): its place in `kv_releases_in_flight` and the bytes it holds,
/// given back when the release ends.
struct Slot {
    counters: Arc<Counters>,
    bytes: u64,
}

impl Slot {
    /// A place for a release holding `bytes`, or `None` (counted in
    /// `kv_releases_skipped`) when the room is spent.
    fn take(counters: &Arc<Counters>, bytes: u64) -> Option<Slot> {
        // Each count is raised only when it stays within its ceiling, so refusals never
        // inflate them (a release is never skipped for another's refused attempt).
        let raise = |counter: &std::sync::atomic::AtomicU64, by: u64, max: u64| {
            counter
                .fetch_update(Relaxed, Relaxed, |n| {
                    n.checked_add(by).filter(|after| *after <= max)
                })
                .is_ok()
        };
        if !raise(&counters.kv_releases_in_flight, 1, MAX_RELEASES) {
            return Self::skipped(counters, "too many early KV releases running");
        }
        if !raise(&counters.kv_release_bytes, bytes, MAX_RELEASE_BYTES) {
            counters.kv_releases_in_flight.fetch_sub(1, Relaxed);
            return Self::skipped(counters, "early KV releases hold too many bytes");
        }
        Some(Slot {
            counters: Arc::clone(counters),
            bytes,
        })
    }

    fn skipped(counters: &Counters, why: &'static str) -> Option<Slot> {
        bump(&counters.kv_releases_skipped);
        tracing::debug!(
            why,
            "early KV release skipped: the engine's own expiry frees it"
        );
        None
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.counters.kv_releases_in_flight.fetch_sub(1, Relaxed);
        self.counters
            .kv_release_bytes
            .fetch_sub(self.bytes, Relaxed);
    }
}

impl Release {
    /// Release the KV a dropped request's prefill holds (see
    /// [`KvRelease::AbortDecode`](super::KvRelease::AbortDecode)).
    async fn run(mut self, stage: Stage, _slot: Slot) {
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
    ///
    /// A plan with a gate (LMCache: the KV is pushed to the decode, and only its
    /// notifications say it arrived) releases once the gate opens, within the same
    /// `wait`: sent before, the decode would compute the whole prompt for a client who
    /// left and leave the pushed KV unused. The gate (a per-request registration, such
    /// as LMCache's notification wait) goes as soon as it has answered.
    async fn send(mut self, leg: Leg) {
        // The connector says what takes the KV (vLLM: the leg as a one-token prefill);
        // one that has no such leg releases nothing.
        let Some(body) = self.connector.release_leg(self.api, &leg) else {
            return;
        };
        let Ok(req) = http_request(self.api, &leg, body, std::iter::empty()) else {
            return;
        };
        let gate = self.handoff.gate.take();
        let (counters, transport) = (self.counters, self.transport);
        let release = async move {
            if let Some(gate) = gate {
                let ready = gate.ready().await;
                drop(gate);
                if ready.is_err() {
                    tracing::debug!(
                        decode = %leg.endpoint.id(),
                        "early KV release not sent: the KV never reached the decode"
                    );
                    return;
                }
            }
            bump(&counters.kv_releases);
            tracing::debug!(
                decode = %leg.endpoint.id(),
                "releasing the KV of a request that ended before its decode"
            );
            let _ = transport.send(req).await;
        };
        let _ = tokio::time::timeout(self.wait, release).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running(c: &Counters) -> (u64, u64, u64) {
        (
            Counters::load(&c.kv_releases_in_flight),
            Counters::load(&c.kv_release_bytes),
            Counters::load(&c.kv_releases_skipped),
        )
    }

    #[test]
    fn releases_past_their_room_are_skipped_and_counted() {
        let c = Arc::new(Counters::default());
        // Bytes: a release that would pass the ceiling is skipped; a smaller one fits.
        let big = Slot::take(&c, MAX_RELEASE_BYTES - 10).expect("room");
        assert!(Slot::take(&c, 11).is_none());
        let small = Slot::take(&c, 10).expect("room for 10 bytes");
        assert_eq!(running(&c), (2, MAX_RELEASE_BYTES, 1));
        drop((big, small));
        assert_eq!(running(&c), (0, 0, 1));
        // Count: the release past `MAX_RELEASES` is skipped, whatever it holds.
        let all: Vec<Slot> = (0..MAX_RELEASES)
            .map(|_| Slot::take(&c, 1).expect("room"))
            .collect();
        assert!(Slot::take(&c, 0).is_none());
        assert_eq!(running(&c), (MAX_RELEASES, MAX_RELEASES, 2));
        // Room comes back as releases end.
        drop(all);
        assert_eq!(running(&c), (0, 0, 2));
        assert!(Slot::take(&c, MAX_RELEASE_BYTES).is_some());
    }
}
