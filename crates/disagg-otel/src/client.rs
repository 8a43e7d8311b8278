//! [`ExportClient`]: the OTLP exporter's HTTP client, hyper on a one-thread tokio
//! runtime of its own.
//!
//! The SDK's batch processor exports from its own thread, outside any tokio runtime,
//! by blocking on the exporter's future; hyper needs a runtime to drive its connection.
//! The client owns one (a single worker thread, idle between exports) and runs each
//! request there, so the export never touches the proxy's serving runtimes and works
//! the same in an embedder's process.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use opentelemetry_http::{HttpClient, HttpError, Request, Response};

/// The most of a collector's answer read: OTLP answers are a small protobuf (partial
/// success counts), or an error message.
const MAX_RESPONSE: usize = 64 * 1024;

/// An [`HttpClient`] for the OTLP exporter: plain-HTTP hyper on a runtime of its own.
#[derive(Clone)]
pub struct ExportClient {
    runtime: Arc<tokio::runtime::Runtime>,
    client: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
}

impl fmt::Debug for ExportClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExportClient")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl ExportClient {
    /// A client whose exchanges each take at most `timeout`.
    ///
    /// # Errors
    ///
    /// When its runtime's thread cannot start.
    pub fn new(timeout: Duration) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("disagg-otel")
            .enable_all()
            .build()?;
        let client = Client::builder(TokioExecutor::new()).build_http();
        Ok(ExportClient {
            runtime: Arc::new(runtime),
            client,
            timeout,
        })
    }
}

#[async_trait::async_trait]
impl HttpClient for ExportClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (client, timeout) = (self.client.clone(), self.timeout);
        let exchange = async move {
            let response = client.request(request.map(Full::new)).await?;
            let (head, body) = response.into_parts();
            let body = Limited::new(body, MAX_RESPONSE).collect().await?.to_bytes();
            Ok::<_, HttpError>(Response::from_parts(head, body))
        };
        let task = self
            .runtime
            .spawn(async move { tokio::time::timeout(timeout, exchange).await });
        match task.await? {
            Ok(result) => result,
            Err(_) => Err(format!("no answer from the OTLP collector within {timeout:?}").into()),
        }
    }
}
