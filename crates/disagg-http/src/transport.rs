//! [`HttpTransport`]: the core's [`Transport`] on hyper-util's pooled client.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use disagg_core::error::TransportError;
use disagg_core::transport::{ResponseFuture, Transport};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

/// Settings of the [`HttpTransport`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct HttpTransportConfig {
    /// Time to establish a TCP connection.
    pub connect_timeout: Duration,
    /// How long an idle pooled connection is kept.
    pub pool_idle_timeout: Duration,
    /// Idle connections kept per endpoint. Size it for the concurrency: a pool smaller
    /// than the load reconnects on every overflowing request, which costs more than the
    /// rest of the request path together.
    pub pool_max_idle_per_host: usize,
}

impl Default for HttpTransportConfig {
    fn default() -> Self {
        HttpTransportConfig {
            connect_timeout: Duration::from_secs(5),
            pool_idle_timeout: Duration::from_secs(90),
            pool_max_idle_per_host: 1024,
        }
    }
}

/// HTTP/1.1 to the engines over pooled keep-alive connections with `TCP_NODELAY`.
///
/// Cheap to clone; clones share the pool.
#[derive(Clone)]
pub struct HttpTransport {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl fmt::Debug for HttpTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpTransport").finish_non_exhaustive()
    }
}

impl Default for HttpTransport {
    fn default() -> Self {
        Self::new(HttpTransportConfig::default())
    }
}

impl HttpTransport {
    /// A transport with `config`. Must be called within a Tokio runtime's context only
    /// when requests are sent; building needs none.
    pub fn new(config: HttpTransportConfig) -> Self {
        let mut connector = HttpConnector::new();
        // Without it, Nagle's algorithm holds small writes (an SSE event) for up to
        // 40 ms on loopback while the peer delays its ACK.
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(config.connect_timeout));
        connector.enforce_http(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(config.pool_idle_timeout)
            .pool_max_idle_per_host(config.pool_max_idle_per_host)
            .build(connector);
        HttpTransport { client }
    }
}

impl Transport for HttpTransport {
    fn send(&self, req: http::Request<Bytes>) -> ResponseFuture {
        let fut = self.client.request(req.map(Full::new));
        Box::pin(async move {
            match fut.await {
                Ok(resp) => Ok(resp.map(|b| b.map_err(Into::into).boxed())),
                Err(e) if e.is_connect() => Err(TransportError::Connect(e.into())),
                Err(e) => Err(TransportError::Io(e.into())),
            }
        })
    }
}
