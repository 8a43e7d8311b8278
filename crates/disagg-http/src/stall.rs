//! A client that stops reading is cut.
//!
//! Nothing else bounds it: the answer's own timers (the decode idle timeout, the
//! deadline) run when the answer's body is polled, and hyper stops polling it once its
//! write buffer is full, which is where a client that reads nothing (or advertises a
//! zero TCP window for ever) leaves it. Meanwhile the request holds the decode engine's
//! slot and KV blocks, its connection to the engine, its admission place and its key's
//! in-flight slot. [`SendTimeout`] fails a write to the client that has made no progress
//! for its limit: hyper then closes the connection and drops the answer, and with it all
//! of the above. It is nginx's `send_timeout`: the limit is between two writes that
//! move bytes, not on the whole answer, so a slow but live reader is served.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// A connection to a client whose writes fail once one has waited `limit` with no byte
/// taken by the client (no limit: `None`).
pub(crate) struct SendTimeout<T> {
    io: T,
    limit: Option<Duration>,
    /// Armed when a write first found the socket full; disarmed by any write that moves
    /// bytes. Allocated only for a connection that has stalled.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<T> SendTimeout<T> {
    /// `io` with writes limited to `limit` without progress; zero: no limit.
    pub(crate) fn new(io: T, limit: Duration) -> Self {
        SendTimeout {
            io,
            limit: (!limit.is_zero()).then_some(limit),
            stalled: None,
        }
    }

    /// What a write that found the socket full answers: pending while the client has
    /// time left (the timer wakes the connection when it runs out), then an error.
    fn stall<R>(&mut self, cx: &mut Context<'_>, limit: Duration) -> Poll<io::Result<R>> {
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client took no byte of the answer for {limit:?}"),
            ))),
        }
    }

    /// `poll` on the connection, timed while it finds the socket full.
    fn timed<R>(
        &mut self,
        cx: &mut Context<'_>,
        poll: impl FnOnce(Pin<&mut T>, &mut Context<'_>) -> Poll<io::Result<R>>,
    ) -> Poll<io::Result<R>>
    where
        T: Unpin,
    {
        match (poll(Pin::new(&mut self.io), cx), self.limit) {
            (Poll::Pending, None) => Poll::Pending,
            (Poll::Pending, Some(limit)) => self.stall(cx, limit),
            (ready, _) => {
                self.stalled = None;
                ready
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for SendTimeout<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for SendTimeout<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().timed(cx, |io, cx| io.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut()
            .timed(cx, |io, cx| io.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().timed(cx, |io, cx| io.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().timed(cx, |io, cx| io.poll_shutdown(cx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// A write to a peer that reads nothing fails after the limit; one that moves
    /// bytes disarms the timer.
    #[tokio::test(start_paused = true)]
    async fn a_write_that_stays_blocked_fails_after_the_limit() {
        let (near, mut far) = tokio::io::duplex(64);
        let mut io = SendTimeout::new(near, Duration::from_secs(5));
        // Fills the pipe, then waits on it.
        let err = io.write_all(&[0u8; 1024]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        // The peer reads: the next write goes through, and the timer starts again.
        let mut sink = vec![0u8; 64];
        tokio::io::AsyncReadExt::read_exact(&mut far, &mut sink)
            .await
            .unwrap();
        io.write_all(&[1u8; 32]).await.unwrap();
        assert!(io.stalled.is_none());
    }
}
