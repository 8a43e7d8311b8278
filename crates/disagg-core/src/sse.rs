//! Server-sent events rewritten one event at a time, for the connectors that must
//! change what the decode engine streams (SGLang's `/generate` with the prefill's
//! prompt logprobs merged in, LMCache's completions chunks turned back into chat).
//!
//! Streams that need no change never come here: the orchestrator relays them frame by
//! frame. [`MapEvents`] cuts the stream at event boundaries, however the engine's
//! frames split them, hands each complete event to an [`EventMap`], and sends what the
//! map wrote as soon as a frame's events are done: it holds at most one incomplete
//! event, never the stream.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame};

use crate::error::BoxError;
use crate::transport::BoxBody;

/// What to send for each event of a stream.
pub trait EventMap: Send + Sync + 'static {
    /// Write what the client gets for `event` (its lines, without the blank line that
    /// ended it) to `out`, the separating blank line included.
    fn event(&self, event: &[u8], out: &mut BytesMut);
}

impl<M: EventMap + ?Sized> EventMap for Arc<M> {
    fn event(&self, event: &[u8], out: &mut BytesMut) {
        (**self).event(event, out);
    }
}

/// A body that rewrites each server-sent event of `inner` with an [`EventMap`].
///
/// Frames other than data (trailers) pass as they are; an error of `inner` ends the
/// body with it; an unterminated last event is mapped when `inner` ends.
#[derive(Debug)]
pub struct MapEvents<M> {
    inner: BoxBody,
    buf: BytesMut,
    map: M,
    ended: bool,
}

impl<M: EventMap> MapEvents<M> {
    /// Rewrites `inner`'s events with `map`.
    pub fn new(inner: BoxBody, map: M) -> Self {
        MapEvents {
            inner,
            buf: BytesMut::new(),
            map,
            ended: false,
        }
    }
}

impl<M: EventMap + Unpin> Body for MapEvents<M> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        loop {
            if this.ended {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(Some(Ok(frame))) => {
                    let data = match frame.into_data() {
                        Ok(d) => d,
                        Err(other) => return Poll::Ready(Some(Ok(other))),
                    };
                    this.buf.extend_from_slice(&data);
                    let mut out = BytesMut::new();
                    while let Some((end, next)) = event_end(&this.buf) {
                        let ev = this.buf.split_to(next);
                        this.map.event(&ev[..end], &mut out);
                    }
                    if !out.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(out.freeze()))));
                    }
                }
                Poll::Ready(None) => {
                    this.ended = true;
                    let rest = this.buf.split();
                    let mut last = &rest[..];
                    while let Some(t) = last
                        .strip_suffix(b"\n")
                        .or_else(|| last.strip_suffix(b"\r"))
                    {
                        last = t;
                    }
                    if last.is_empty() {
                        return Poll::Ready(None);
                    }
                    let mut out = BytesMut::new();
                    this.map.event(last, &mut out);
                    return Poll::Ready(Some(Ok(Frame::data(out.freeze()))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }
}

/// Where the first complete event of `buf` ends, and where what follows it starts.
///
/// An event ends at a blank line, and a line may end with `\r\n`, `\n` or `\r` (the
/// SSE specification, WHATWG HTML "event stream interpretation"), so `\n\n`,
/// `\r\n\r\n`, `\r\r` and their mixes all end one. A `\r` at the very end of `buf`
/// may be the first half of `\r\n`: it waits for the next frame.
pub(crate) fn event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i < buf.len() {
        match line_end(buf, i)? {
            0 => i += 1,
            first => match line_end(buf, i + first)? {
                0 => i += first,
                second => return Some((i, i + first + second)),
            },
        }
    }
    None
}

/// The length of the line terminator at `buf[i]` (0 when there is none), or `None`
/// when a lone `\r` ends `buf` and the next byte decides.
fn line_end(buf: &[u8], i: usize) -> Option<usize> {
    match buf.get(i) {
        Some(b'\n') => Some(1),
        Some(b'\r') => match buf.get(i + 1) {
            Some(b'\n') => Some(2),
            Some(_) => Some(1),
            None => None,
        },
        _ => Some(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    /// Upper-cases each event and marks where it ended.
    struct Upper;

    impl EventMap for Upper {
        fn event(&self, event: &[u8], out: &mut BytesMut) {
            out.extend_from_slice(&event.to_ascii_uppercase());
            out.extend_from_slice(b"|\n\n");
        }
    }

    fn frames(parts: &[&'static str]) -> BoxBody {
        let frames = parts
            .iter()
            .map(|p| Ok::<_, BoxError>(Frame::data(Bytes::from_static(p.as_bytes()))))
            .collect::<Vec<_>>();
        BoxBody::new(http_body_util::StreamBody::new(futures::stream::iter(
            frames,
        )))
    }

    #[test]
    fn every_line_ending_ends_an_event_and_a_trailing_cr_waits() {
        assert_eq!(event_end(b"data: a\n\ndata: b"), Some((7, 9)));
        assert_eq!(event_end(b"data: a\r\n\r\n"), Some((7, 11)));
        assert_eq!(event_end(b"data: a\r\rx"), Some((7, 9)));
        assert_eq!(event_end(b"data: a\n\r\n"), Some((7, 10)));
        assert_eq!(event_end(b"data: a\r\n\r"), None);
        assert_eq!(event_end(b"data: a\ndata: b\n"), None);
    }

    #[tokio::test]
    async fn events_split_across_frames_are_mapped_whole_and_the_last_one_too() {
        let body = MapEvents::new(
            frames(&["data: a", "b\n", "\ndata: c\n\nda", "ta: d\r\n"]),
            Upper,
        );
        let out = body.collect().await.unwrap().to_bytes();
        assert_eq!(&out[..], b"DATA: AB|\n\nDATA: C|\n\nDATA: D|\n\n");
    }
}
