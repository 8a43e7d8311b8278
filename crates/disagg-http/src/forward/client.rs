//! A forwarded client's request body on its way to the engine ([`ClientBody`]): held to
//! the size limit and the body timeout as it streams, and where a breach, or the client
//! leaving in the middle of it, is told.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::Context;
use std::time::Duration;

use bytes::{Buf, Bytes};
use disagg_core::error::{BoxError, PdError, error_chain};
use disagg_core::json::BodyError;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;

use crate::body;
use crate::tap::{Hooks, Tap, Unshared};

/// A client's body after its first bytes were read: those bytes, then the rest. Its
/// size hint is the rest's, which ([`ClientBody`]'s) is the whole body's.
pub(super) struct Started {
    pub(super) start: Option<Bytes>,
    pub(super) rest: ClientBody,
}

impl Body for Started {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(start) = self.start.take().filter(|s| !s.is_empty()) {
            return std::task::Poll::Ready(Some(Ok(Frame::data(start))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.start.as_ref().is_none_or(Bytes::is_empty) && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.rest.size_hint()
    }
}

/// The limits of a client body streamed to an engine, and where a breach is told.
pub(super) struct StreamLimits {
    /// The largest body (413 past it).
    pub(super) max_bytes: usize,
    /// Time for the whole body, from when it is first waited for (408 past it).
    pub(super) timeout: Duration,
    /// Set to the client's error when the body breaks a limit or fails in any other
    /// way ([`ClientBodyFailed`]: a malformed chunked upload), or to
    /// [`ClientLeft`](body::ClientLeft) when its client leaves in the middle of it: the
    /// exchange then fails, and the forwarding answers with this instead of the
    /// engine's failure, and blames no engine.
    pub(super) failed: Arc<OnceLock<PdError>>,
    /// Set once the body has ended (the client sent all of it): until then, an engine
    /// that gives no head may be waiting for the rest, and is not to blame.
    pub(super) ended: Arc<AtomicBool>,
}

/// A client's body that failed other than by its client leaving (hyper's error for a
/// malformed chunked body, say): the client's fault, answered 400.
#[derive(Debug, thiserror::Error)]
#[error("the request body could not be read: {0}")]
pub(super) struct ClientBodyFailed(String);

/// A client's request body on its way to the engine: streamed frame by frame (cut past
/// the body limit, and past the body timeout, which runs as
/// [`body::read`](crate::body)'s does: from the first wait, for the whole body), or
/// whole when it was read to find its model.
///
/// `Sync` as the transport's body must be, though the client's body need not be: it
/// is [`Unshared`], reached only through `&mut`.
pub(super) type ClientBody = Tap<Unshared<DynBody>, ClientLimits>;

type DynBody = Pin<Box<dyn Body<Data = Bytes, Error = BoxError> + Send>>;

/// [`ClientBody`]'s own: the bytes it may still send, its limits, its size hint and end
/// (kept on the side: the body is [`Unshared`]).
pub(super) struct ClientLimits {
    hint: SizeHint,
    left: u64,
    /// The bytes the body has sent.
    received: u64,
    ended: bool,
    limits: Option<StreamLimits>,
    /// Armed at the first wait for the client.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl ClientBody {
    pub(super) fn stream<B>(body: B, limits: StreamLimits) -> Self
    where
        B: Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
    {
        let left = limits.max_bytes as u64;
        Self::client(body, left, Some(limits))
    }

    pub(super) fn client<B>(body: B, left: u64, limits: Option<StreamLimits>) -> Self
    where
        B: Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
    {
        let hint = body.size_hint();
        let ended = body.is_end_stream();
        let body = body
            .map_frame(|f| f.map_data(|mut d| d.copy_to_bytes(d.remaining())))
            .map_err(Into::into);
        if ended && let Some(l) = &limits {
            l.ended.store(true, Ordering::Release);
        }
        let limits = ClientLimits {
            hint,
            left,
            received: 0,
            ended,
            limits,
            timer: None,
        };
        Tap::new(Unshared::new(Box::pin(body) as DynBody), limits)
    }

    pub(super) fn whole(bytes: Bytes) -> Self {
        let len = bytes.len() as u64;
        Self::client(http_body_util::Full::new(bytes), len, None)
    }
}

impl ClientLimits {
    /// The body broke a limit: `err` for the forwarding, an error for the transport.
    fn fail(&mut self, err: PdError) -> BoxError {
        let message = err.to_string();
        if let Some(limits) = &self.limits {
            let _ = limits.failed.set(err);
        }
        self.ended = true;
        message.into()
    }
}

impl Hooks<Unshared<DynBody>> for ClientLimits {
    fn frame(&mut self, frame: &Frame<Bytes>, _body: &Unshared<DynBody>) -> Result<(), BoxError> {
        if let Some(data) = frame.data_ref() {
            let len = data.len() as u64;
            if len > self.left {
                let max = self.limits.as_ref().map_or(0, |l| l.max_bytes);
                return Err(self.fail(PdError::body(BodyError::TooLarge { limit: max })));
            }
            self.left -= len;
            self.received += len;
            // A body of a declared length has ended with its last byte: the transport
            // need not poll it again to learn so.
            if self.hint.exact() == Some(self.received)
                && let Some(limits) = &self.limits
            {
                limits.ended.store(true, Ordering::Release);
            }
        }
        Ok(())
    }

    fn end(&mut self) {
        self.ended = true;
        if let Some(limits) = &self.limits {
            limits.ended.store(true, Ordering::Release);
        }
    }

    fn error(&mut self, err: &BoxError) {
        // The client's error goes to the transport, which fails the exchange with an
        // error of its own: what the client did is told on the side, whatever it was
        // (its leaving, or a body that broke another way), so that no engine is blamed.
        if let Some(limits) = &self.limits {
            let failed = if body::client_left(&**err) {
                PdError::body(body::ClientLeft)
            } else {
                PdError::body(ClientBodyFailed(error_chain(&**err)))
            };
            let _ = limits.failed.set(failed);
        }
    }

    fn pending(&mut self, cx: &mut Context<'_>) -> Result<(), BoxError> {
        let Some(timeout) = self.limits.as_ref().map(|l| l.timeout) else {
            return Ok(());
        };
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if timer.as_mut().poll(cx).is_ready() {
            return Err(self.fail(PdError::body(BodyError::TimedOut { after: timeout })));
        }
        Ok(())
    }

    fn is_end_stream(&self, _body: &Unshared<DynBody>) -> bool {
        self.ended
    }

    fn size_hint(&self, _body: &Unshared<DynBody>) -> SizeHint {
        self.hint
    }
}
