//! Server-sent events rewritten one event at a time, for the connectors that must
//! change what the decode engine streams (SGLang's `/generate` with the prefill's
//! prompt logprobs merged in, LMCache's completions chunks turned back into chat).
//!
//! Streams that need no change never come here: the orchestrator relays them frame by
//! frame. [`MapEvents`] cuts the stream at event boundaries, however the engine's
//! frames split them, hands each complete event to an [`EventMap`], and sends what the
//! map wrote as soon as a frame's events are done, in frames of about 256 KiB at most
//! (a map may write far more than it reads): it holds at most one incomplete event and
//! one frame of the engine's, never the stream.
//!
//! The work is linear in the stream: each byte is scanned for an event's end once, as
//! it arrives. An unfinished event is not scanned again from its start when the next
//! frame comes; the scan resumes where it stopped (at most the line ending a frame cut
//! in two is looked at again). An event is held only up to a ceiling
//! ([`DEFAULT_MAX_EVENT`], 8 MiB, unless [`MapEvents::with_max_event`] says otherwise):
//! one still unfinished past it ends the body with [`EventTooLarge`], which the
//! orchestrator turns into an SSE error event for the client (code
//! `decode_stream_failed`) and a failure of the decode leg.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame};
use http_body_util::BodyExt as _;

use disagg_core::error::BoxError;
use disagg_core::transport::BoxBody;

/// The largest event [`MapEvents`] holds by default: 8 MiB, the size of the largest
/// prefill answer the orchestrator reads by default
/// ([`OrchestratorConfig::max_prefill_answer`](disagg_core::orchestrator::OrchestratorConfig::max_prefill_answer)).
/// A streamed token's event is a few hundred bytes; SGLang's first `/generate` event
/// with every prompt token's logprob about 40 bytes a prompt token, so 8 MiB holds
/// a 200k-token prompt's.
pub const DEFAULT_MAX_EVENT: usize = 8 * 1024 * 1024;

/// About how many bytes of mapped events one frame of [`MapEvents`] carries: once
/// this much is written, the events still held wait for the next poll. A map may write
/// much more than it reads (SGLang's routers prepend the prefill's whole list of prompt
/// logprobs to every streamed event), so a frame of small events from the engine must
/// not become one frame of their whole mapping: it goes out as the client reads.
const MAX_FRAME: usize = 256 * 1024;

/// An engine's server-sent event grew past [`MapEvents`]' ceiling before it ended.
#[derive(Debug, thiserror::Error)]
#[error("a server-sent event of the engine's exceeds {limit} bytes")]
pub struct EventTooLarge {
    /// The ceiling, in bytes.
    pub limit: usize,
}

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
/// body with it; an unterminated last event is mapped when `inner` ends. An event
/// that grows past the ceiling ([`DEFAULT_MAX_EVENT`] unless
/// [`with_max_event`](Self::with_max_event) says otherwise) ends the body with
/// [`EventTooLarge`], after what the frame's complete events were mapped to.
#[derive(Debug)]
pub struct MapEvents<M> {
    inner: BoxBody,
    buf: BytesMut,
    /// Where the next scan of `buf` for an event's end starts: the bytes before it
    /// were scanned and end no event.
    scanned: usize,
    max_event: usize,
    map: M,
    /// The error that ends the body once the frame before it went out.
    failed: Option<EventTooLarge>,
    ended: bool,
}

impl<M: EventMap> MapEvents<M> {
    /// Rewrites `inner`'s events with `map`.
    pub fn new(inner: BoxBody, map: M) -> Self {
        MapEvents {
            inner,
            buf: BytesMut::new(),
            scanned: 0,
            max_event: DEFAULT_MAX_EVENT,
            map,
            failed: None,
            ended: false,
        }
    }

    /// Hold an event of at most `bytes` (its lines and their endings); a longer one
    /// ends the body with [`EventTooLarge`].
    pub fn with_max_event(mut self, bytes: usize) -> Self {
        self.max_event = bytes;
        self
    }

    /// Map the complete events `buf` holds into `out`, until `out` holds
    /// [`MAX_FRAME`] bytes or more. `true` when it stopped for that (complete events
    /// may still be held), `false` when no complete event is left.
    fn map_held(&mut self, out: &mut BytesMut) -> bool {
        while out.len() < MAX_FRAME {
            match scan(&self.buf, self.scanned) {
                Ok((end, next)) => {
                    let ev = self.buf.split_to(next);
                    self.scanned = 0;
                    self.map.event(&ev[..end], out);
                }
                Err(resume) => {
                    self.scanned = resume;
                    return false;
                }
            }
        }
        true
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
            if let Some(e) = this.failed.take() {
                return Poll::Ready(Some(Err(Box::new(e))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            // The events already held first: what they map to goes out in frames of
            // about `MAX_FRAME` bytes, however many of them one frame of the engine's
            // brought.
            let mut out = BytesMut::new();
            let more = this.map_held(&mut out);
            if !more && this.buf.len() > this.max_event {
                // The engine's event is not going to end in reason: drop it and the
                // engine's body, and end after what was mapped.
                this.ended = true;
                this.buf = BytesMut::new();
                this.inner = http_body_util::Empty::new()
                    .map_err(|never| match never {})
                    .boxed();
                this.failed = Some(EventTooLarge {
                    limit: this.max_event,
                });
            }
            if !out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(out.freeze()))));
            }
            if this.ended {
                continue;
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => this.buf.extend_from_slice(&data),
                    Err(other) => return Poll::Ready(Some(Ok(other))),
                },
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
        self.ended && self.failed.is_none()
    }
}

/// Where the first complete event of `buf` ends, and where what follows it starts.
///
/// An event ends at a blank line, and a line may end with `\r\n`, `\n` or `\r` (the
/// SSE specification, WHATWG HTML "event stream interpretation"), so `\n\n`,
/// `\r\n\r\n`, `\r\r` and their mixes all end one. A `\r` at the very end of `buf`
/// may be the first half of `\r\n`: it waits for the next frame.
#[cfg_attr(not(feature = "sglang"), allow(dead_code))] // read by `sglang::generate` only
pub(crate) fn event_end(buf: &[u8]) -> Option<(usize, usize)> {
    scan(buf, 0).ok()
}

/// [`event_end`], scanning from `from`: 0, or the resume point an earlier scan of a
/// shorter `buf` (the same bytes, fewer of them) returned. `Err(resume)`: no event
/// ends in `buf`; a scan of `buf` with more bytes after it may start at `resume` (the
/// start of a line ending the next bytes may still make a blank line of, or `buf`'s
/// length), and finds what a scan from 0 finds.
fn scan(buf: &[u8], from: usize) -> Result<(usize, usize), usize> {
    let mut i = from;
    while i < buf.len() {
        let Some(first) = line_end(buf, i) else {
            return Err(i);
        };
        if first == 0 {
            i += 1;
            continue;
        }
        if i + first == buf.len() {
            // A line ending at the very end: the next byte may make it a blank line.
            return Err(i);
        }
        match line_end(buf, i + first) {
            None => return Err(i),
            Some(0) => i += first,
            Some(second) => return Ok((i, i + first + second)),
        }
    }
    Err(i)
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

    /// A scan resumed where an earlier one of fewer bytes stopped finds what a scan
    /// from the start finds, wherever the bytes were cut, every line ending included.
    #[test]
    fn a_resumed_scan_finds_what_a_whole_scan_finds() {
        let streams: [&[u8]; 6] = [
            b"data: a\n\ndata: b\n\n",
            b"data: a\r\n\r\ndata: b\r\rx",
            b"data: a\ndata: b\r\n\n",
            b"x\r\ry\n\r\nz",
            b"data: a\r\n\r",
            b"\r\n\r\n",
        ];
        for stream in streams {
            let whole = event_end(stream);
            for cut in 0..=stream.len() {
                let resumed = match scan(&stream[..cut], 0) {
                    Ok(found) => Some(found),
                    Err(resume) => {
                        assert!(resume <= cut);
                        scan(stream, resume).ok()
                    }
                };
                assert_eq!(resumed, whole, "{stream:?} cut at {cut}");
            }
        }
    }

    /// An unfinished event is scanned once: after each frame the next scan starts at
    /// the end of what came (or at a line ending the frame may have cut in two), not at
    /// the event's start, however many frames it takes.
    #[test]
    fn an_unfinished_event_is_not_scanned_again() {
        let (tx, rx) = futures::channel::mpsc::unbounded::<Result<Frame<Bytes>, BoxError>>();
        let mut body = MapEvents::new(BoxBody::new(http_body_util::StreamBody::new(rx)), Upper);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut poll = |body: &mut MapEvents<Upper>, part: &'static [u8]| {
            tx.unbounded_send(Ok(Frame::data(Bytes::from_static(part))))
                .unwrap();
            Pin::new(body).poll_frame(&mut cx)
        };
        assert!(poll(&mut body, b"data: ").is_pending());
        for _ in 0..50 {
            assert!(poll(&mut body, &[b'z'; 1000]).is_pending());
            // Everything held was scanned: the next frame's scan starts after it.
            assert_eq!(body.scanned, body.buf.len());
        }
        // A line ending at the end may become a blank line: its start is kept.
        assert!(poll(&mut body, b"\r").is_pending());
        assert_eq!(body.scanned, body.buf.len() - 1);
        assert!(poll(&mut body, b"\n").is_pending());
        assert_eq!(body.scanned, body.buf.len() - 2);
        let Poll::Ready(Some(Ok(frame))) = poll(&mut body, b"\r\n") else {
            panic!("the event ended");
        };
        let out = frame.into_data().unwrap();
        assert_eq!(out.len(), 6 + 50_000 + 3);
        assert_eq!((body.buf.len(), body.scanned), (0, 0));
    }

    /// A stream fed one byte at a time comes out as fed whole.
    #[tokio::test]
    async fn byte_by_byte_frames_map_as_one_frame() {
        let stream = "data: a\r\n\r\ndata: b\n\ndata: c\r\rdata: d\n\r\n: comment\n\n";
        let whole = MapEvents::new(frames(&[stream]), Upper)
            .collect()
            .await
            .unwrap()
            .to_bytes();
        let bytes: Vec<&'static str> = (0..stream.len()).map(|i| &stream[i..=i]).collect();
        let split = MapEvents::new(frames(&bytes), Upper)
            .collect()
            .await
            .unwrap()
            .to_bytes();
        assert_eq!(split, whole);
        assert_eq!(
            &whole[..],
            b"DATA: A|\n\nDATA: B|\n\nDATA: C|\n\nDATA: D|\n\n: COMMENT|\n\n"
        );
    }

    /// An event that grows past the ceiling ends the body with `EventTooLarge`, after
    /// the events that came before it; nothing more is read from the engine.
    #[tokio::test]
    async fn an_event_past_the_ceiling_ends_the_body() {
        let big: &'static str = Box::leak("y".repeat(64).into_boxed_str());
        let mut body = MapEvents::new(
            frames(&["data: a\n\ndata: ", big, big, "\n\n", "data: never\n\n"]),
            Upper,
        )
        .with_max_event(100);
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(&first[..], b"DATA: A|\n\n");
        let err = body.frame().await.unwrap().unwrap_err();
        let too_large = err.downcast_ref::<EventTooLarge>().expect("EventTooLarge");
        assert_eq!(too_large.limit, 100);
        assert!(body.frame().await.is_none());
        assert!(body.is_end_stream());
        // At the ceiling exactly, the event passes.
        let fits = MapEvents::new(frames(&["data: ", big, "\n\n"]), Upper).with_max_event(72);
        let out = fits.collect().await.unwrap().to_bytes();
        assert_eq!(out.len(), 6 + 64 + 3);
    }

    /// Writes 64 KiB for every event, as a map that prepends a large list would.
    struct Swell;

    impl EventMap for Swell {
        fn event(&self, _event: &[u8], out: &mut BytesMut) {
            out.extend_from_slice(&[b'x'; 64 * 1024]);
            out.extend_from_slice(b"\n\n");
        }
    }

    /// A frame of many small events whose mapping is large goes out in several frames,
    /// none much over `MAX_FRAME`: what the proxy holds for one stream does not grow
    /// with how many events the engine packed into one frame.
    #[tokio::test]
    async fn a_swelling_map_goes_out_in_bounded_frames() {
        let many: &'static str = Box::leak("data: {}\n\n".repeat(1000).into_boxed_str());
        let mut body = MapEvents::new(frames(&[many]), Swell);
        let per_event = 64 * 1024 + 2;
        let (mut total, mut count) = (0, 0);
        while let Some(frame) = body.frame().await {
            let len = frame.unwrap().into_data().unwrap().len();
            // Stopped once 256 KiB were written: at most one event more.
            assert!(len < 256 * 1024 + per_event, "a frame of {len} bytes");
            total += len;
            count += 1;
        }
        assert_eq!(total, 1000 * per_event);
        assert!(count >= 200, "{count} frames");
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
