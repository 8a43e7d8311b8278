//! The transport seam: how a leg's request reaches an endpoint.
//!
//! The core speaks only `http` types. A transport takes a complete request (absolute URI,
//! headers, body as [`Bytes`]) and returns the response head with a streaming body. The
//! returned future is `'static` so a leg can be spawned. `disagg-http` provides the pooled
//! hyper-util implementation; tests and other stacks can stand in their own.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;

use crate::error::{BoxError, TransportError};

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
