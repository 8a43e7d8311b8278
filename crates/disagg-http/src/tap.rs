//! The polling prologue the body wrappers of this crate share, written once.
//!
//! A wrapper body polls its inner body, looks at what came (a frame, the end, an error,
//! nothing yet), does its own thing with it (counts bytes, frees a place, returns a
//! connection to its pool, arms a timer) and hands the poll on, or an error in its
//! place. [`Tap`] is that poll; a wrapper is a `Tap` with its own [`Hooks`], and states
//! only what it does at each step. Everything is generic (no allocation, no dynamic
//! call), so the request path pays nothing for the sharing (`docs/performance.md`).

use std::pin::Pin;
use std::task::{Context, Poll};

use http_body::{Body, Frame, SizeHint};

/// What a wrapper does at each step of its inner body `B`. Every method has a default
/// that does nothing (or asks the inner body), so a wrapper writes only its own.
pub(crate) trait Hooks<B: Body> {
    /// A frame came; `body` is the inner body after it (its `is_end_stream` may say
    /// that frame was the last). `Err` hands that error on instead of the frame.
    fn frame(&mut self, _frame: &Frame<B::Data>, _body: &B) -> Result<(), B::Error> {
        Ok(())
    }

    /// The inner body ended.
    fn end(&mut self) {}

    /// The inner body failed with `err` (which is handed on).
    fn error(&mut self, _err: &B::Error) {}

    /// The inner body has nothing yet. `Err` ends the wait with that error (a timer
    /// that ran out); `cx` is for registering such a timer.
    fn pending(&mut self, _cx: &mut Context<'_>) -> Result<(), B::Error> {
        Ok(())
    }

    /// The wrapper's `is_end_stream` (default: the inner body's).
    fn is_end_stream(&self, body: &B) -> bool {
        body.is_end_stream()
    }

    /// The wrapper's `size_hint` (default: the inner body's).
    fn size_hint(&self, body: &B) -> SizeHint {
        body.size_hint()
    }
}

pin_project_lite::pin_project! {
    /// A body `B` whose every poll its hooks `H` see first.
    pub(crate) struct Tap<B, H> {
        #[pin]
        body: B,
        hooks: H,
    }
}

impl<B, H> Tap<B, H> {
    /// `body`, watched by `hooks`.
    pub(crate) fn new(body: B, hooks: H) -> Self {
        Tap { body, hooks }
    }
}

impl<B: Body, H: Hooks<B>> Body for Tap<B, H> {
    type Data = B::Data;
    type Error = B::Error;

    #[inline]
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let mut this = self.project();
        let polled = this.body.as_mut().poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Err(e) = this.hooks.frame(frame, &this.body) {
                    return Poll::Ready(Some(Err(e)));
                }
            }
            Poll::Ready(Some(Err(e))) => this.hooks.error(e),
            Poll::Ready(None) => this.hooks.end(),
            Poll::Pending => {
                if let Err(e) = this.hooks.pending(cx) {
                    return Poll::Ready(Some(Err(e)));
                }
            }
        }
        polled
    }

    #[inline]
    fn is_end_stream(&self) -> bool {
        self.hooks.is_end_stream(&self.body)
    }

    #[inline]
    fn size_hint(&self) -> SizeHint {
        self.hooks.size_hint(&self.body)
    }
}

pin_project_lite::pin_project! {
    /// A `Send` body made `Sync` (as the core's boxed body must be; axum's and a client's
    /// need not be) by reaching it only through `&mut`: its `is_end_stream` and
    /// `size_hint` are never asked (they take `&self`), so its hooks track them on the
    /// side ([`Tracked`] does).
    pub(crate) struct Unshared<B> {
        #[pin]
        body: sync_wrapper::SyncWrapper<B>,
    }
}

impl<B> Unshared<B> {
    pub(crate) fn new(body: B) -> Self {
        Unshared {
            body: sync_wrapper::SyncWrapper::new(body),
        }
    }
}

impl<B: Body> Body for Unshared<B> {
    type Data = B::Data;
    type Error = B::Error;

    #[inline]
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        self.project().body.get_pin_mut().poll_frame(cx)
    }
}

/// The end of stream and size hint of an [`Unshared`] body, kept on the side: the hint
/// shrinks by each data frame's length, and both settle at the end.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tracked {
    hint: SizeHint,
    ended: bool,
}

impl Tracked {
    /// What `body` says of itself now, before it is made [`Unshared`].
    fn of<B: Body>(body: &B) -> Self {
        Tracked {
            hint: body.size_hint(),
            ended: body.is_end_stream(),
        }
    }

    /// `len` bytes of data went by.
    fn data(&mut self, len: u64) {
        let mut h = SizeHint::new();
        h.set_lower(self.hint.lower().saturating_sub(len));
        if let Some(u) = self.hint.upper() {
            h.set_upper(u.saturating_sub(len));
        }
        self.hint = h;
    }

    /// The body ended.
    fn close(&mut self) {
        self.ended = true;
        self.hint = SizeHint::with_exact(0);
    }
}

impl<B: Body> Hooks<Unshared<B>> for Tracked
where
    B::Data: bytes::Buf,
{
    fn frame(&mut self, frame: &Frame<B::Data>, _body: &Unshared<B>) -> Result<(), B::Error> {
        if let Some(data) = frame.data_ref() {
            self.data(bytes::Buf::remaining(data) as u64);
        }
        Ok(())
    }

    fn end(&mut self) {
        self.close();
    }

    fn is_end_stream(&self, _body: &Unshared<B>) -> bool {
        self.ended
    }

    fn size_hint(&self, _body: &Unshared<B>) -> SizeHint {
        self.hint
    }
}

/// `body` made `Sync`, its size hint and end tracked on the side.
pub(crate) fn unshared<B: Body>(body: B) -> Tap<Unshared<B>, Tracked> {
    let tracked = Tracked::of(&body);
    Tap::new(Unshared::new(body), tracked)
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};

    use super::*;

    #[tokio::test]
    async fn sync_body_tracks_size_and_end() {
        let mut b = unshared(Full::new(Bytes::from_static(b"hello")));
        assert_eq!(b.size_hint().exact(), Some(5));
        assert!(!b.is_end_stream());
        let frame = b.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "hello");
        assert_eq!(b.size_hint().exact(), Some(0));
        assert!(b.frame().await.is_none());
        assert!(b.is_end_stream());
    }
}
