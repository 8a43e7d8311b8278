//! [`HttpTransport`]: the core's [`Transport`] over pooled HTTP/1.1 keep-alive
//! connections.
//!
//! A deliberately small pool on hyper's connection-level client
//! (`hyper::client::conn::http1`): idle connections are kept per `host:port` in a short
//! list, a connection goes back to it when its response body has been read to the end,
//! and a response body dropped before its end closes its connection (that is how a
//! client's disconnect reaches the engine). Compared with hyper-util's general-purpose
//! client this skips the hashed pool keys, URI rewriting and connection racing the proxy
//! does not need, which the profile showed at about 12,000 instructions per leg
//! (`docs/performance.md`).
//!
//! `https://` engines (with the `tls` feature and [`HttpTransportConfig::tls`]) are
//! reached over rustls on the same pool: a TLS connection is kept and reused like a
//! plain one (keyed by scheme and authority), so its handshake is paid once per
//! connection, not per request. [`HttpTransportConfig::engine_keys`] sets the engines'
//! `authorization` on every request sent.

use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use disagg_core::error::{BoxError, TransportError};
use disagg_core::transport::{BoxBody, ResponseFuture, SlicedBody, Transport};
use http::header::{HOST, HeaderValue};
use http::uri::{Authority, Scheme, Uri};
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

#[cfg(feature = "auth")]
use crate::auth::EngineKeys;
use crate::tap::{Hooks, Tap};

/// Settings of the [`HttpTransport`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct HttpTransportConfig {
    /// Time to establish a TCP connection.
    pub connect_timeout: Duration,
    /// How long an idle pooled connection is kept. Keep it below the engines' own
    /// keep-alive timeout, so that a connection the engine is about to close is never
    /// picked for a request (vLLM's uvicorn closes idle connections after 5 s).
    pub pool_idle_timeout: Duration,
    /// Idle connections kept per endpoint. Size it for the concurrency: a pool smaller
    /// than the load reconnects on every overflowing request, which costs more than the
    /// rest of the request path together.
    pub pool_max_idle_per_host: usize,
    /// The keys sent to engines as `Authorization: Bearer` (default none): on every
    /// request to an engine that has one, replacing the request's own (`auth` feature).
    #[cfg(feature = "auth")]
    pub engine_keys: EngineKeys,
    /// TLS for `https://` engines (default `None`: an `https://` engine fails to
    /// connect, saying why).
    #[cfg(feature = "tls")]
    pub tls: Option<crate::tls::ClientTls>,
    /// The addresses engines may be reached at (default: link-local and cloud metadata
    /// addresses refused): an engine's hostname is resolved here and the refused
    /// addresses are never connected to.
    pub addresses: disagg_core::endpoint::AddressPolicy,
}

impl Default for HttpTransportConfig {
    fn default() -> Self {
        HttpTransportConfig {
            connect_timeout: Duration::from_secs(5),
            // Under uvicorn's 5 s keep-alive timeout (vLLM's default), with a margin.
            pool_idle_timeout: Duration::from_secs(4),
            pool_max_idle_per_host: 1024,
            #[cfg(feature = "auth")]
            engine_keys: EngineKeys::default(),
            #[cfg(feature = "tls")]
            tls: None,
            addresses: disagg_core::endpoint::AddressPolicy::default(),
        }
    }
}

type Sender = SendRequest<LegBody>;

/// A request body as the pool sends it: a leg's, whole or in pieces (hyper writes them
/// with one vectored write, copying none); or a forwarded request's, streaming as the
/// client sends it ([`Transport::send_streaming`]).
enum LegBody {
    Full(Full<Bytes>),
    Sliced(SlicedBody),
    Stream(BoxBody),
}

impl Body for LegBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            LegBody::Full(b) => Pin::new(b).poll_frame(cx).map_err(|never| match never {}),
            LegBody::Sliced(b) => Pin::new(b).poll_frame(cx).map_err(|never| match never {}),
            LegBody::Stream(b) => Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            LegBody::Full(b) => b.is_end_stream(),
            LegBody::Sliced(b) => b.is_end_stream(),
            LegBody::Stream(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            LegBody::Full(b) => b.size_hint(),
            LegBody::Sliced(b) => b.size_hint(),
            LegBody::Stream(b) => b.size_hint(),
        }
    }
}

/// Where pooled connections go: the engine's authority, over TLS or not (an engine
/// served both ways must not get a plain connection for an `https` request).
#[derive(Clone, PartialEq, Eq)]
struct PoolKey {
    tls: bool,
    authority: Authority,
}

struct Idle {
    sender: Sender,
    since: Instant,
}

struct Inner {
    config: HttpTransportConfig,
    idle: Mutex<Pool>,
}

/// Idle connections by endpoint. A list, not a map: a proxy talks to a handful of
/// endpoints, and comparing a few authorities is cheaper than hashing one.
struct Pool {
    by_key: Vec<(PoolKey, Vec<Idle>)>,
    /// When connections past the idle timeout and endpoints without any were last
    /// dropped: at most once per idle timeout, by a request giving a connection back,
    /// so that the connections and entries of endpoints that left the set (discovery
    /// renames pods all day) go instead of piling up.
    swept: Instant,
}

impl Pool {
    /// The idle connections kept for `key`. Keys are compared byte for byte first: every
    /// request to an engine spells its authority the same way (its endpoint's URL), and
    /// `Authority`'s own comparison, which ignores ASCII case, goes byte by byte through
    /// a lowercasing (about 250 instructions for `127.0.0.1:8000`, twice per leg in the
    /// profile). Only a key with no exact twin is looked for again that way.
    fn list_mut(&mut self, key: &PoolKey) -> Option<&mut Vec<Idle>> {
        let at = self
            .by_key
            .iter()
            .position(|(k, _)| k.tls == key.tls && k.authority.as_str() == key.authority.as_str())
            .or_else(|| self.by_key.iter().position(|(k, _)| k == key))?;
        Some(&mut self.by_key[at].1)
    }

    /// Drop the connections idle for `max_age` or closed, and the endpoints left
    /// without any.
    fn sweep(&mut self, now: Instant, max_age: Duration) {
        self.swept = now;
        self.by_key.retain_mut(|(_, list)| {
            list.retain(|c| {
                now.saturating_duration_since(c.since) < max_age && !c.sender.is_closed()
            });
            !list.is_empty()
        });
    }
}

/// HTTP/1.1 to the engines over pooled keep-alive connections with `TCP_NODELAY`.
///
/// Cheap to clone; clones share the pool. Connections run on the Tokio runtime that
/// opened them: give each runtime its own transport (as `server::Builder::serve_threads` users
/// do) so a request and its connections stay on one thread.
#[derive(Clone)]
pub struct HttpTransport {
    inner: Arc<Inner>,
}

impl fmt::Debug for HttpTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpTransport")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Default for HttpTransport {
    fn default() -> Self {
        Self::new(HttpTransportConfig::default())
    }
}

impl HttpTransport {
    /// A transport with `config`. Requests must be sent from within a Tokio runtime.
    pub fn new(config: HttpTransportConfig) -> Self {
        HttpTransport {
            inner: Arc::new(Inner {
                config,
                idle: Mutex::new(Pool {
                    by_key: Vec::new(),
                    swept: Instant::now(),
                }),
            }),
        }
    }

    /// Idle pooled connections to `authority` now, plain and TLS.
    pub fn idle_connections(&self, authority: &Authority) -> usize {
        lock(&self.inner.idle)
            .by_key
            .iter()
            .filter(|(k, _)| k.authority == *authority)
            .map(|(_, v)| v.len())
            .sum()
    }
}

impl Transport for HttpTransport {
    fn send(&self, req: Request<Bytes>) -> ResponseFuture {
        let inner = Arc::clone(&self.inner);
        crate::pin_in_place(move || async move {
            inner.send(req.map(|b| LegBody::Full(Full::new(b)))).await
        })
    }

    fn send_streaming(
        &self,
        req: Request<BoxBody>,
    ) -> Result<ResponseFuture, Box<Request<BoxBody>>> {
        let inner = Arc::clone(&self.inner);
        Ok(crate::pin_in_place(move || async move {
            inner.send(req.map(LegBody::Stream)).await
        }))
    }

    fn send_sliced(&self, req: Request<SlicedBody>) -> ResponseFuture {
        let inner = Arc::clone(&self.inner);
        crate::pin_in_place(move || async move { inner.send(req.map(LegBody::Sliced)).await })
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The pool's critical sections cannot leave it inconsistent.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Inner {
    async fn send(
        self: Arc<Self>,
        req: Request<LegBody>,
    ) -> Result<Response<BoxBody>, TransportError> {
        let (mut parts, body) = req.into_parts();
        let Some(authority) = parts.uri.authority().cloned() else {
            return Err(TransportError::Connect("request URI has no host".into()));
        };
        let key = PoolKey {
            tls: parts.uri.scheme() == Some(&Scheme::HTTPS),
            authority,
        };
        #[cfg(feature = "auth")]
        if let Some(v) = self.config.engine_keys.for_engine(key.tls, &key.authority) {
            parts.headers.insert(http::header::AUTHORIZATION, v.clone());
        }
        // Origin-form request target, and the Host header it then needs.
        parts.uri = parts
            .uri
            .path_and_query()
            .map_or_else(|| Uri::from_static("/"), |p| Uri::from(p.clone()));
        if !parts.headers.contains_key(HOST)
            && let Ok(v) = HeaderValue::from_str(key.authority.as_str())
        {
            parts.headers.insert(HOST, v);
        }
        let mut req = Request::from_parts(parts, body);

        // Pooled connections first. One the engine has closed since hands the request
        // back unsent, and the next is tried.
        while let Some(mut sender) = self.take(&key) {
            if sender.ready().await.is_err() {
                continue;
            }
            match sender.try_send_request(req).await {
                Ok(resp) => return Ok(self.respond(key, sender, resp)),
                Err(mut e) => match e.take_message() {
                    Some(unsent) => req = unsent,
                    None => return Err(TransportError::Io(e.into_error().into())),
                },
            }
        }
        // Boxed: a new connection's future (the resolver, the TLS handshake) is several
        // KiB, and every leg's future, pooled or not, would otherwise be that large and
        // copied whole into its box (docs/performance.md, "Futures and bodies copied whole").
        let mut sender = Box::pin(self.connect(&key)).await?;
        match sender.send_request(req).await {
            Ok(resp) => Ok(self.respond(key, sender, resp)),
            Err(e) => Err(TransportError::Io(e.into())),
        }
    }

    fn take(&self, key: &PoolKey) -> Option<Sender> {
        let mut idle = lock(&self.idle);
        let list = idle.list_mut(key)?;
        let max_age = self.config.pool_idle_timeout;
        // Most recently used first: it is the least likely to have been closed.
        while let Some(conn) = list.pop() {
            if conn.since.elapsed() < max_age && !conn.sender.is_closed() {
                return Some(conn.sender);
            }
        }
        None
    }

    fn give_back(&self, key: PoolKey, sender: Sender) {
        if sender.is_closed() {
            return;
        }
        let mut idle = lock(&self.idle);
        let now = Instant::now();
        let max_age = self.config.pool_idle_timeout;
        if now.saturating_duration_since(idle.swept) >= max_age {
            idle.sweep(now, max_age);
        }
        let conn = Idle { sender, since: now };
        match idle.list_mut(&key) {
            Some(list) if list.len() < self.config.pool_max_idle_per_host => list.push(conn),
            Some(_) => {}
            None => idle.by_key.push((key, vec![conn])),
        }
    }

    async fn connect(&self, key: &PoolKey) -> Result<Sender, TransportError> {
        let authority = &key.authority;
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let port = authority
            .port_u16()
            .unwrap_or(if key.tls { 443 } else { 80 });
        // The connect timeout covers the TLS handshake too: both must be done before
        // the request can go.
        let deadline = deadline_after(self.config.connect_timeout);
        let connect = crate::connect::connect(host, port, self.config.addresses);
        let stream = match tokio::time::timeout_at(deadline, connect).await {
            Err(_) => return Err(TransportError::Connect("connect timed out".into())),
            Ok(Err(e)) => return Err(TransportError::Connect(e.into())),
            Ok(Ok(s)) => s,
        };
        // Without it, Nagle's algorithm holds small writes (an SSE event) for up to
        // 40 ms on loopback while the peer delays its ACK.
        let _ = stream.set_nodelay(true);
        if key.tls {
            return self.connect_tls(host, authority, stream, deadline).await;
        }
        handshake(TokioIo::new(stream)).await
    }

    #[cfg(feature = "tls")]
    async fn connect_tls(
        &self,
        host: &str,
        authority: &Authority,
        stream: TcpStream,
        deadline: tokio::time::Instant,
    ) -> Result<Sender, TransportError> {
        let Some(tls) = &self.config.tls else {
            return Err(TransportError::Connect(
                format!("{authority}: https engine, but the transport has no TLS configuration")
                    .into(),
            ));
        };
        let stream = match tokio::time::timeout_at(deadline, tls.connect(host, stream)).await {
            Err(_) => return Err(TransportError::Connect("TLS handshake timed out".into())),
            Ok(Err(source)) => {
                return Err(TransportError::Connect(Box::new(TlsHandshake {
                    authority: authority.clone(),
                    source,
                })));
            }
            Ok(Ok(s)) => s,
        };
        handshake(TokioIo::new(stream)).await
    }

    #[cfg(not(feature = "tls"))]
    async fn connect_tls(
        &self,
        _host: &str,
        authority: &Authority,
        _stream: TcpStream,
        _deadline: tokio::time::Instant,
    ) -> Result<Sender, TransportError> {
        Err(TransportError::Connect(
            format!("{authority}: https engines need disagg-http's `tls` feature").into(),
        ))
    }

    fn respond(
        self: Arc<Self>,
        key: PoolKey,
        sender: Sender,
        resp: Response<Incoming>,
    ) -> Response<BoxBody> {
        resp.map(|body| {
            Tap::new(body, Returning(Some((self, key, sender))))
                .map_err(Into::into)
                .boxed()
        })
    }
}

/// `timeout` from now; a timeout too long for the clock to add (`Duration::MAX`, the
/// usual "no limit") ends some thirty years from now instead of panicking.
fn deadline_after(timeout: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(30 * 365 * 86_400)))
        .unwrap_or(now)
}

/// The HTTP/1.1 handshake over `io`, its connection driven by a task of its own.
async fn handshake<I>(io: I) -> Result<Sender, TransportError>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (sender, conn) = http1::handshake(io)
        .await
        .map_err(|e| TransportError::Connect(e.into()))?;
    // The connection task ends when the connection closes: its sender dropped while
    // idle, the peer gone, or a response body dropped before its end.
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "engine connection ended with an error");
        }
    });
    Ok(sender)
}

/// A TLS handshake with an engine failed (its certificate refused, no common protocol,
/// a client certificate it did not accept).
#[cfg(feature = "tls")]
#[derive(Debug, thiserror::Error)]
#[error("TLS handshake with {authority} failed")]
struct TlsHandshake {
    authority: Authority,
    #[source]
    source: BoxError,
}

/// The hooks of an engine's response body ([`Tap`]) that put its connection back in the
/// pool once the body is read to the end.
struct Returning(Option<(Arc<Inner>, PoolKey, Sender)>);

impl Returning {
    fn release(&mut self) {
        if let Some((pool, key, sender)) = self.0.take() {
            pool.give_back(key, sender);
        }
    }
}

impl Hooks<Incoming> for Returning {
    fn frame(&mut self, _frame: &Frame<Bytes>, body: &Incoming) -> Result<(), hyper::Error> {
        // Callers may stop at the last frame without polling for the end (the body said
        // it was over): release the connection here, not only at the end, or it would
        // be dropped instead of reused.
        if body.is_end_stream() {
            self.release();
        }
        Ok(())
    }

    fn end(&mut self) {
        self.release();
    }

    fn error(&mut self, _err: &hyper::Error) {
        // A broken body leaves the connection unusable: drop it.
        self.0.take();
    }
}
