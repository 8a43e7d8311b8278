//! The transport seam: how a leg's request reaches an endpoint.
//!
//! The core speaks only `http` types. A transport takes a complete request (absolute URI,
//! headers, body as [`Bytes`]) and returns the response head with a streaming body. The
//! returned future is `'static` so a leg can be spawned. `disagg-http` provides the pooled
//! hyper-util implementation; tests and other stacks can stand in their own.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use crate::error::{BoxError, TransportError};
use disagg_json::JsonBody;

/// A streaming response body, as the transport and the orchestrator pass it around.
pub type BoxBody = http_body_util::combinators::BoxBody<Bytes, BoxError>;

/// The future a [`Transport`] returns.
pub type ResponseFuture =
    Pin<Box<dyn Future<Output = Result<http::Response<BoxBody>, TransportError>> + Send>>;

/// Sends one leg's request and returns the response as soon as its head arrives.
///
/// Contract:
/// - the request URI is absolute (`http://host:port/path`);
/// - the future resolves when the response head is in; the body streams afterwards;
/// - dropping the future or the body abandons the exchange (a pooled connection in the
///   middle of a response is closed, not reused), which is how cancellation reaches the
///   engine;
/// - `Err` means no usable response head: [`TransportError::Connect`] when the request
///   certainly never reached the endpoint.
pub trait Transport: Send + Sync + 'static {
    /// Send `req`.
    fn send(&self, req: http::Request<Bytes>) -> ResponseFuture;

    /// Send `req` with a body that streams as it arrives (a request an adapter
    /// forwards to an engine without reading it), when this transport can; otherwise
    /// give it back as `Err`, and the caller reads the body whole and uses
    /// [`send`](Self::send). The same contract as `send` otherwise; a body that breaks
    /// midway makes the exchange fail. The default cannot stream.
    ///
    /// # Errors
    ///
    /// The request, unsent, when this transport does not stream request bodies.
    fn send_streaming(
        &self,
        req: http::Request<BoxBody>,
    ) -> Result<ResponseFuture, Box<http::Request<BoxBody>>> {
        Err(Box::new(req))
    }

    /// Send `req`, whose body is in pieces ([`SlicedBody`]: a leg's JSON with its long
    /// values as slices of the client's buffer). The same contract as
    /// [`send`](Self::send), which the default calls with the pieces joined into one
    /// buffer (a copy); a transport that writes vectored should send the pieces as
    /// they are, as `disagg-http`'s does.
    fn send_sliced(&self, req: http::Request<SlicedBody>) -> ResponseFuture {
        self.send(req.map(Bytes::from))
    }
}

impl<T: Transport + ?Sized> Transport for Arc<T> {
    fn send(&self, req: http::Request<Bytes>) -> ResponseFuture {
        (**self).send(req)
    }

    fn send_streaming(
        &self,
        req: http::Request<BoxBody>,
    ) -> Result<ResponseFuture, Box<http::Request<BoxBody>>> {
        (**self).send_streaming(req)
    }

    fn send_sliced(&self, req: http::Request<SlicedBody>) -> ResponseFuture {
        (**self).send_sliced(req)
    }
}

/// Values of a leg's body from this size on are sent as slices of the buffer they came
/// in rather than copied into the leg's own body: 4 KiB.
///
/// A piece costs an entry of the vectored write and a frame of the body (well under a
/// copy of a kilobyte); below this size a copy is the cheaper, and the usual short
/// request stays one buffer.
pub(crate) const SLICE_FROM: usize = 4 * 1024;

/// A request body as the pieces it is made of, sent one after the other: the HTTP body
/// of a leg ([`Transport::send_sliced`]).
///
/// Built from a [`JsonBody`] (`SlicedBody::from(&body)`): a long prompt is a slice
/// of the client's buffer, never copied to be sent. As an [`http_body::Body`] it yields
/// each piece as a data frame, and declares its exact length.
#[derive(Debug, Clone, Default)]
pub struct SlicedBody {
    /// The next piece: a short body's only one, held without allocating a list.
    first: Option<Bytes>,
    /// The pieces after it, none empty.
    rest: VecDeque<Bytes>,
    /// The bytes not sent yet.
    left: usize,
}

/// `body`'s JSON text, its values of at least 4 KiB as slices.
impl From<&JsonBody> for SlicedBody {
    fn from(body: &JsonBody) -> Self {
        let mut out = SlicedBody::default();
        body.write_parts(SLICE_FROM, |part| out.push(part));
        out
    }
}

impl SlicedBody {
    /// Append `part` (an empty one is skipped).
    pub(crate) fn push(&mut self, part: Bytes) {
        if part.is_empty() {
            return;
        }
        self.left += part.len();
        if self.first.is_none() && self.rest.is_empty() {
            self.first = Some(part);
        } else {
            self.rest.push_back(part);
        }
    }

    /// Whether no byte is left to send.
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.left == 0
    }

    /// The pieces not sent yet, in order.
    pub(crate) fn parts(&self) -> impl Iterator<Item = &Bytes> {
        self.first.iter().chain(&self.rest)
    }
}

/// The bytes not sent yet as one buffer: the piece itself when there is one, else a
/// copy.
impl From<SlicedBody> for Bytes {
    fn from(body: SlicedBody) -> Bytes {
        if body.rest.is_empty() {
            return body.first.unwrap_or_default();
        }
        let mut out = Vec::with_capacity(body.left);
        for part in body.parts() {
            out.extend_from_slice(part);
        }
        Bytes::from(out)
    }
}

impl From<Bytes> for SlicedBody {
    fn from(bytes: Bytes) -> Self {
        let mut out = SlicedBody::default();
        out.push(bytes);
        out
    }
}

impl Body for SlicedBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        let Some(part) = this.first.take().or_else(|| this.rest.pop_front()) else {
            return Poll::Ready(None);
        };
        this.left -= part.len();
        Poll::Ready(Some(Ok(Frame::data(part))))
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.left as u64)
    }
}

/// Read `body` to its end, at most `limit` bytes (a longer body is an error).
///
/// A named future with a `'static` error type: `?` on a collected boxed-error body
/// inside an `async fn` trips the compiler's `Send` inference (higher-ranked `From`),
/// so connectors that read an engine's answer use this rather than collecting it.
pub fn read_limited(
    body: BoxBody,
    limit: usize,
) -> impl Future<Output = Result<Bytes, BoxError>> + Send + 'static {
    use futures::TryFutureExt;
    use http_body_util::BodyExt;
    http_body_util::Limited::new(body, limit)
        .collect()
        .map_ok(|c| c.to_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn a_sliced_body_yields_its_pieces_with_an_exact_length() {
        let prompt = "p".repeat(SLICE_FROM);
        let client = Bytes::from(format!(r#"{{"model":"m","prompt":"{prompt}","n":1}}"#));
        let json = JsonBody::parse_bytes(&client).unwrap();
        let body = SlicedBody::from(&json);
        // Before the prompt, the prompt (a slice of the client's buffer), after it.
        let parts: Vec<&Bytes> = body.parts().collect();
        assert_eq!(parts.len(), 3);
        assert_eq!(parts[1].as_ptr(), client[22..].as_ptr());
        assert_eq!(body.size_hint().exact(), Some(client.len() as u64));
        assert_eq!(Bytes::from(body.clone()), client);
        let mut frames = Vec::new();
        let mut body = body;
        while let Some(frame) = body.frame().await {
            frames.push(frame.unwrap().into_data().unwrap());
            assert_eq!(
                body.size_hint().exact(),
                Some((client.len() - frames.iter().map(Bytes::len).sum::<usize>()) as u64)
            );
        }
        assert!(body.is_end_stream());
        assert_eq!(frames.concat(), client.to_vec());
        // A short body is one piece: to_bytes's, not copied again.
        let short = JsonBody::parse(br#"{"model":"m"}"#).unwrap();
        let one = SlicedBody::from(&short);
        assert_eq!(one.parts().count(), 1);
        assert_eq!(Bytes::from(one), short.to_bytes());
        assert!(SlicedBody::from(Bytes::new()).is_empty());
    }
}
