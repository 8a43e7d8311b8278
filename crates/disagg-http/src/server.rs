//! Serving helpers: accept connections and run a service on each, over hyper.

use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use disagg_core::error::BoxError;
use http::{Request, Response};
use http_body::Body;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

/// The accept queue asked for by [`bind`]. The default of the standard library and of
/// Tokio (128) overflows when a few hundred clients connect at once, and the dropped
/// connections wait a whole SYN retransmission (about a second) before they get in.
/// The kernel caps it at `net.core.somaxconn`.
pub const LISTEN_BACKLOG: u32 = 4096;

/// Bind a listener on `addr` for [`serve`], with `SO_REUSEADDR` (a restarted proxy can
/// bind at once) and a [`LISTEN_BACKLOG`]-deep accept queue.
///
/// # Errors
///
/// When the socket cannot be created, bound or put into listening state.
pub fn bind(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    listen(addr, false)
}

/// Bind and listen on `addr` with `SO_REUSEADDR`, [`LISTEN_BACKLOG`], and `SO_REUSEPORT`
/// when `shared` (several threads listening on one address).
fn listen(addr: std::net::SocketAddr, shared: bool) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    #[cfg(unix)]
    if shared {
        socket.set_reuseport(true)?;
    }
    #[cfg(not(unix))]
    let _ = shared;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// How long in-flight requests may run on after shutdown is asked before they are cut.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Serve `service` on every connection `listener` accepts, HTTP/1.1 with keep-alive and
/// `TCP_NODELAY`, until `shutdown` resolves; then stop accepting and let in-flight
/// requests finish (at most 30 s).
///
/// # Errors
///
/// Only when accepting fails in a way that is not about one connection.
pub async fn serve<S, B>(
    listener: TcpListener,
    service: S,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()>
where
    S: tower::Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new());
    // Slow or idle clients must not hold a connection's task open forever.
    http.header_read_timeout(Duration::from_secs(30));
    tokio::pin!(shutdown);
    loop {
        let (stream, _peer) = tokio::select! {
            res = listener.accept() => match res {
                Ok(conn) => conn,
                Err(e) if is_per_connection(&e) => continue,
                Err(e) => {
                    // Out of file descriptors and the like: back off, do not spin.
                    tracing::error!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let conn = http.serve_connection(
            TokioIo::new(stream),
            TowerToHyperService::new(service.clone()),
        );
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, graceful.shutdown()).await;
    Ok(())
}

fn is_per_connection(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | ConnectionRefused
    )
}

/// Serve on `threads` OS threads, each a single-threaded Tokio runtime with its own
/// listening socket on `addr` (`SO_REUSEPORT`: the kernel spreads new connections over
/// them) and its own service, built on that thread by `make_service`.
///
/// A request, its upstream legs and their pooled connections then stay on one thread:
/// the request path takes no cross-thread wake-up, which on a loaded 2-core machine
/// costs more than the proxying itself (measured with `disagg-bench`). Share what must be
/// shared (endpoint source, router, connector) through `make_service`; give each thread
/// its own transport so its connection pool is thread-local.
///
/// Blocks until `shutdown` turns `true` and every thread has drained. `on_bound` is
/// called once with the bound address (useful with port 0). On targets without
/// `SO_REUSEPORT` one thread is used. If a later thread fails to start, the threads
/// already started keep serving until `shutdown`.
///
/// # Errors
///
/// When a runtime cannot start or the address cannot be bound.
pub fn serve_threads<M, S, B>(
    addr: std::net::SocketAddr,
    threads: usize,
    make_service: M,
    shutdown: tokio::sync::watch::Receiver<bool>,
    on_bound: impl FnOnce(std::net::SocketAddr),
) -> std::io::Result<()>
where
    M: Fn() -> S + Send + Sync + 'static,
    S: tower::Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let threads = if cfg!(unix) { threads.max(1) } else { 1 };
    let make_service = std::sync::Arc::new(make_service);
    let mut handles = Vec::with_capacity(threads);
    let mut bound = addr;
    for i in 0..threads {
        let (tx, rx) = std::sync::mpsc::channel();
        let make_service = std::sync::Arc::clone(&make_service);
        let mut shutdown = shutdown.clone();
        let handle = std::thread::Builder::new()
            .name(format!("disagg-{i}"))
            .spawn(move || -> std::io::Result<()> {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                rt.block_on(async move {
                    let listener = match listen(bound, true) {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = tx.send(Err(std::io::Error::new(e.kind(), e.to_string())));
                            return Err(e);
                        }
                    };
                    let _ = tx.send(listener.local_addr());
                    let stop = async move {
                        let _ = shutdown.wait_for(|stop| *stop).await;
                    };
                    serve(listener, make_service(), stop).await
                })
            })?;
        handles.push(handle);
        // The first thread picks the port (when 0 was asked); the others share it.
        match rx.recv() {
            Ok(Ok(a)) => bound = a,
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(std::io::Error::other("server thread ended at start")),
        }
    }
    on_bound(bound);
    let mut result = Ok(());
    for h in handles {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => result = Err(e),
            Err(_) => result = Err(std::io::Error::other("server thread panicked")),
        }
    }
    result
}
