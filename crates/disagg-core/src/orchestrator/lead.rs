//! The body of an answer that starts before its decode leg is sent: a plan's lead
//! ([`Handoff::lead`](crate::connector::Handoff::lead), the first bytes a connector knows
//! once the prefill answered), then the decode's body once its gate opened and its head
//! came in. The orchestrator drives it for any connector that sets a lead; it knows no
//! protocol (LMCache's first token is one such lead).

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};
use sync_wrapper::SyncWrapper;

use crate::error::{BoxError, PdError};
use crate::transport::BoxBody;

type PollFrame = Poll<Option<Result<Frame<Bytes>, BoxError>>>;

/// What a lead stream waits for before its decode body: the KV's readiness and the
/// decode's response head, ending in the body to forward.
pub(crate) type PendingDecode =
    Pin<Box<dyn Future<Output = Result<BoxBody, PdError>> + Send + 'static>>;

/// The body of an answer that starts before its decode leg is sent
/// ([`Handoff::lead`](crate::connector::Handoff::lead)): the lead bytes, then, once the
/// pending decode resolved, the decode's body. A pending decode that fails ends the body
/// with the [`PdError`], which [`PdBody`](super::PdBody) turns into an error event with its own code.
pub(crate) struct LeadBody {
    lead: Option<Bytes>,
    pending: Option<SyncWrapper<PendingDecode>>,
    inner: Option<BoxBody>,
}

impl LeadBody {
    /// `lead`, then the body `pending` resolves to.
    pub(crate) fn deferred(lead: Bytes, pending: PendingDecode) -> Self {
        LeadBody {
            lead: Some(lead),
            pending: Some(SyncWrapper::new(pending)),
            inner: None,
        }
    }

    /// `lead`, then `inner`.
    pub(crate) fn then(lead: Bytes, inner: BoxBody) -> Self {
        LeadBody {
            lead: Some(lead),
            pending: None,
            inner: Some(inner),
        }
    }
}

impl Body for LeadBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> PollFrame {
        let this = &mut *self;
        if let Some(lead) = this.lead.take() {
            return Poll::Ready(Some(Ok(Frame::data(lead))));
        }
        if let Some(pending) = this.pending.as_mut() {
            match pending.get_mut().as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(result) => {
                    this.pending = None;
                    match result {
                        Ok(inner) => this.inner = Some(inner),
                        Err(e) => return Poll::Ready(Some(Err(Box::new(e)))),
                    }
                }
            }
        }
        match this.inner.as_mut() {
            Some(inner) => Pin::new(inner).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.lead.is_none()
            && self.pending.is_none()
            && self.inner.as_ref().is_none_or(Body::is_end_stream)
    }
}

impl fmt::Debug for LeadBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeadBody")
            .field("lead", &self.lead.as_ref().map(Bytes::len))
            .field("pending", &self.pending.is_some())
            .finish_non_exhaustive()
    }
}
