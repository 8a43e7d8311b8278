//! Serving helpers: accept connections and run a service on each, over hyper.
//!
//! Every server here stops the same way once asked: the listening socket closes at once,
//! idle connections close, answers in flight (streams included) run to their end within
//! [`Builder::drain_timeout`], and connections still open at that deadline are cut.
//!
//! With the `tls` feature, [`Builder::tls`] serves HTTPS: each connection's TLS
//! handshake runs in the connection's own task (within [`TLS_HANDSHAKE_TIMEOUT`]), so a
//! slow handshake holds neither the accept loop nor other clients.
//!
//! At most [`Builder::max_connections`] connections are open at once; past it, new ones
//! wait in the listen backlog until one closes. An accept that fails for want of file
//! descriptors (or memory) pauses the loop, 100 ms doubling to 1 s while it goes on, and
//! is logged once per [`ACCEPT_ERROR_LOG_EVERY`], never retried in a busy loop.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use disagg_core::error::BoxError;
use futures::task::AtomicWaker;
use http::{Request, Response};
use http_body::Body;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulConnection;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use crate::stall::SendTimeout;

/// The accept queue asked for by [`bind`]. The default of the standard library and of
/// Tokio (128) overflows when a few hundred clients connect at once, and the dropped
/// connections wait a whole SYN retransmission (about a second) before they get in.
/// The kernel caps it at `net.core.somaxconn`.
pub const LISTEN_BACKLOG: u32 = 4096;

/// The most a connection buffers of what its client sends (hyper's default is about
/// 400 KiB): 32 KiB.
///
/// A request's head must fit in it, and a body passes through it on its way to the
/// body's own buffer, which the memory budget of
/// [`PdServiceConfig::body_budget`](crate::PdServiceConfig::body_budget) covers; this
/// one it does not. hyper grows it up to the limit while a body streams in, so under a
/// flood of large bodies on many connections the default cost about 400 KiB each beyond
/// the budget, and left the allocator's heap fragmented after (measured with 500
/// clients sending 600 KB bodies: about 160 MiB more at the peak, 60 MiB more kept
/// after). The buffer, at the size it grew to, also stays with the connection while
/// the answer streams (hyper reads into it to notice a client that goes away): with
/// 128 KB prompts a held stream cost 155–163 KiB at a limit of 64 KiB and 64–65 KiB at
/// 32 KiB (docs/performance.md). Reads of 32 KiB still take a long prompt in a few
/// reads, and a head of 32 KiB is as much as nginx takes by default (four buffers of
/// 8 KiB).
pub const READ_BUFFER_MAX: usize = 32 * 1024;

/// How long a write to a client may wait with no byte taken before the connection is
/// closed, by default ([`Builder::send_timeout`]): nginx's `send_timeout` default.
pub const DEFAULT_SEND_TIMEOUT: Duration = Duration::from_secs(60);

/// The most client connections a server keeps open at once, by default
/// ([`Builder::max_connections`]): 16,384, far above the requests one proxy's engines
/// serve at a time. A process whose open-file limit is lower (`ulimit -n`) runs out of
/// descriptors first: lower it to fit, or raise the limit.
pub const DEFAULT_MAX_CONNECTIONS: usize = 16_384;

/// The first pause of the accept loop after an accept fails in a way that is not about
/// one connection (out of file descriptors, out of memory): it doubles while the
/// failures go on, up to [`ACCEPT_PAUSE_MAX`].
const ACCEPT_PAUSE_MIN: Duration = Duration::from_millis(100);

/// The longest pause of the accept loop between failed accepts.
const ACCEPT_PAUSE_MAX: Duration = Duration::from_secs(1);

/// How often, at most, each accept loop logs its failed accepts (at `error`, with the
/// number of failures since the last line): 10 s.
pub const ACCEPT_ERROR_LOG_EVERY: Duration = Duration::from_secs(10);

/// How often each of [`Builder::serve_threads`]'s event loops wakes its timer driver while
/// it serves: 1 s (see [`timer_heartbeat`]).
const TIMER_HEARTBEAT: Duration = Duration::from_secs(1);

/// Keeps the current runtime's timer driver waking at least every [`TIMER_HEARTBEAT`],
/// so that arming a longer timer costs no system call.
///
/// Tokio's timer unparks its driver (writes the runtime's eventfd) whenever a timer is
/// armed earlier than the driver's next planned wake-up, including when the arming task
/// runs on the driver's own thread: on a current-thread runtime, which is never parked
/// while one of its tasks runs, that write and the `epoll_wait` it ends early are two
/// wasted system calls. Requests arm such timers (the prefill's timeout, a stream's idle
/// timer, hyper's deadline for the next request's head), each of them seconds long;
/// measured with `strace -c` on the bench's proxy, 0.4-0.6 eventfd writes per request at
/// 16 and 64 clients, and two per request when requests come one at a time with gaps
/// (the driver parks with no timer left, so every first timer is "earlier"). With a
/// tick every second the planned wake-up is never more than a second away, so only
/// timers shorter than that unpark; the tick itself costs one wake-up a second.
async fn timer_heartbeat() {
    let mut tick = tokio::time::interval(TIMER_HEARTBEAT);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
    }
}

/// How long a client may take over its TLS handshake before its connection is closed:
/// a handshake takes two round trips, so this only ends clients that stalled (or
/// connections held open to tie up tasks), like the 30 s the server gives a request's
/// head.
#[cfg(feature = "tls")]
#[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Bind a listener on `addr` for [`Builder::serve`], with `SO_REUSEADDR` (a restarted proxy can
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

/// The server: its options set by methods, then [`serve`](Builder::serve) on a
/// listener in the caller's runtime, or [`serve_threads`](Builder::serve_threads) on
/// threads of its own. Both serve HTTP/1.1 with keep-alive and `TCP_NODELAY` until told
/// to stop, then drain (see [the module docs](self)).
///
/// # Examples
///
/// ```no_run
/// use std::time::Duration;
/// use disagg_http::server;
///
/// # async fn run(service: disagg_http::PdService) -> std::io::Result<()> {
/// let listener = server::bind("127.0.0.1:8000".parse().unwrap())?;
/// server::Builder::new()
///     .drain_timeout(Duration::from_secs(5))
///     .serve(listener, service, std::future::pending())
///     .await
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Builder {
    drain_timeout: Duration,
    send_timeout: Duration,
    threads: usize,
    max_connections: usize,
    #[cfg(feature = "tls")]
    tls: Option<crate::tls::ServerTls>,
}

impl Default for Builder {
    fn default() -> Self {
        Builder {
            drain_timeout: Duration::from_secs(30),
            send_timeout: DEFAULT_SEND_TIMEOUT,
            threads: 1,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            #[cfg(feature = "tls")]
            tls: None,
        }
    }
}

impl Builder {
    /// A server with the defaults: plain HTTP, a 30 s drain, one thread for
    /// [`serve_threads`](Builder::serve_threads).
    pub fn new() -> Self {
        Builder::default()
    }

    /// How long requests in flight when shutdown is asked (streams included) may run on.
    ///
    /// Shutdown closes the listening socket at once and idle keep-alive connections as
    /// soon as they are idle; a connection still busy when this deadline passes is cut
    /// (its client sees the connection close mid-answer). Zero cuts every connection at
    /// once. Default 30 s: long enough for most streams, short enough for an
    /// orchestrator's stop timeout (Kubernetes waits 30 s before SIGKILL by default).
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        self.drain_timeout = timeout;
        self
    }

    /// How long a write to a client may wait without the client taking a byte before
    /// its connection is closed (default 60 s, [`DEFAULT_SEND_TIMEOUT`]; zero: no
    /// limit). A client that stops reading a streamed answer (or advertises a zero TCP
    /// window for ever) would otherwise hold the engine's slot, the connection to it and
    /// the request's places for as long as it likes: the answer's own timers run only
    /// while the answer is polled, and the connection stops polling it once its write
    /// buffer is full. The limit is between two writes that move bytes, as nginx's
    /// `send_timeout`: a slow reader that keeps reading is served.
    pub fn send_timeout(mut self, timeout: Duration) -> Self {
        self.send_timeout = timeout;
        self
    }

    /// The most client connections open at once, all of
    /// [`serve_threads`](Builder::serve_threads)' threads together (default
    /// [`DEFAULT_MAX_CONNECTIONS`], 16,384; 0 counts as 1).
    ///
    /// A connection holds its place from its acceptance to its close: its TLS handshake
    /// (at most [`TLS_HANDSHAKE_TIMEOUT`]), the wait for its request heads (at most 30 s
    /// each) and its answers. With every place taken, each thread holds the one
    /// connection it accepted last, unserved, until a place frees up (the threads wait
    /// for places in one queue, first come first served), and accepts nothing more: new
    /// connections wait in the listen backlog ([`LISTEN_BACKLOG`], capped by the
    /// kernel's `net.core.somaxconn`); past it the kernel drops their SYNs and the
    /// clients retry. Waiting rather than closing them at once keeps a burst of clients
    /// from being refused, and costs the server at most one file descriptor per thread
    /// beyond the limit.
    ///
    /// Keep it under the process's open-file limit (`ulimit -n`, `RLIMIT_NOFILE`) less
    /// the engine connections (one or two per request in flight, pooled) and the files
    /// the process reads: past that limit accepts fail, and the loop pauses (see [the
    /// module docs](self)) rather than take more.
    pub fn max_connections(mut self, max: usize) -> Self {
        self.max_connections = max;
        self
    }

    /// How many threads [`serve_threads`](Builder::serve_threads) runs, each with its
    /// own event loop, listening socket and service (default 1; 0 counts as 1). On
    /// targets without `SO_REUSEPORT` one thread is used.
    pub fn threads(mut self, threads: usize) -> Self {
        self.threads = threads;
        self
    }

    /// Serve HTTPS with this certificate (`None`, the default: plain HTTP). A
    /// certificate reloaded by [`ServerTls::watch`](crate::tls::ServerTls::watch) is used
    /// by the handshakes that follow; connections already open keep theirs.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn tls(mut self, tls: impl Into<Option<crate::tls::ServerTls>>) -> Self {
        self.tls = tls.into();
        self
    }

    /// Serve `service` on every connection `listener` accepts, until `shutdown`
    /// resolves; then drain and return.
    ///
    /// The drain, once `shutdown` resolves:
    ///
    /// 1. the listener is closed at once: new connections are refused;
    /// 2. every connection is told to finish: an idle keep-alive connection (or one that
    ///    has sent nothing yet) is closed, a busy one closes after its current answer,
    ///    however long that answer streams;
    /// 3. when every connection has closed, or the
    ///    [`drain_timeout`](Builder::drain_timeout) has passed (then the connections
    ///    still open are cut), the function returns.
    ///
    /// The start of the drain (with the number of open connections) and its end
    /// (drained, or how many connections were cut) are logged at `info`. Dropping the
    /// returned future cuts every connection it serves. [`threads`](Builder::threads)
    /// does not apply: this serves in the caller's runtime.
    ///
    /// # Errors
    ///
    /// Only when accepting fails in a way that is not about one connection.
    pub async fn serve<S, B>(
        self,
        listener: TcpListener,
        service: S,
        shutdown: impl Future<Output = ()>,
    ) -> std::io::Result<()>
    where
        S: HttpService<B>,
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let tracker = Arc::new(DrainTracker::default());
        let places = self.places();
        let drained = serve_until(listener, service, shutdown, &self, &tracker, &places).await;
        drained.log();
        Ok(())
    }

    /// Serve on [`threads`](Builder::threads) OS threads, each a single-threaded Tokio
    /// runtime with its own listening socket on `addr` (`SO_REUSEPORT`: the kernel
    /// spreads new connections over them) and its own service, built on that thread by
    /// `make_service`.
    ///
    /// A request, its upstream legs and their pooled connections then stay on one
    /// thread: the request path takes no cross-thread wake-up, which on a loaded 2-core
    /// machine costs more than the proxying itself (measured with `disagg-bench`). Share
    /// what must be shared (endpoint source, router, connector) through `make_service`;
    /// give each thread its own transport so its connection pool is thread-local. Each
    /// runtime also runs a one-second tick that does nothing, so that the timers every
    /// request arms (all longer than a second) never make Tokio wake its own driver
    /// through the eventfd (docs/performance.md, "The event loops' timer heartbeat").
    ///
    /// Blocks until `shutdown` turns `true` and every thread has drained: each closes
    /// its listening socket at once and drains its connections as
    /// [`serve`](Builder::serve) describes, within the
    /// [`drain_timeout`](Builder::drain_timeout); the drain's start and end are logged
    /// once for all threads. Whatever a thread's runtime still runs at the end (cut
    /// connections, upstream connections) is dropped with it. `on_bound` is called once
    /// with the bound address (useful with port 0). If a later thread fails to start,
    /// the threads already started keep serving until `shutdown`.
    ///
    /// # Errors
    ///
    /// When a runtime cannot start or the address cannot be bound.
    pub fn serve_threads<M, S, B>(
        self,
        addr: std::net::SocketAddr,
        make_service: M,
        shutdown: tokio::sync::watch::Receiver<bool>,
        on_bound: impl FnOnce(std::net::SocketAddr),
    ) -> std::io::Result<()>
    where
        M: Fn() -> S + Send + Sync + 'static,
        S: HttpService<B>,
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let threads = if cfg!(unix) { self.threads.max(1) } else { 1 };
        let make_service = Arc::new(make_service);
        let tracker = Arc::new(DrainTracker::default());
        // One limit for every thread's connections.
        let places = self.places();
        let mut handles = Vec::with_capacity(threads);
        let mut bound = addr;
        for i in 0..threads {
            let (tx, rx) = std::sync::mpsc::channel();
            let make_service = Arc::clone(&make_service);
            let tracker = Arc::clone(&tracker);
            let places = Arc::clone(&places);
            let config = self.clone();
            let mut shutdown = shutdown.clone();
            let handle = std::thread::Builder::new()
                .name(format!("disagg-{i}"))
                .spawn(move || -> std::io::Result<Drained> {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()?;
                    rt.block_on(async move {
                        // Dropped with the runtime when the loop has drained.
                        tokio::spawn(timer_heartbeat());
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
                        let served =
                            serve_until(listener, make_service(), stop, &config, &tracker, &places);
                        Ok(served.await)
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
        let mut drained = Drained::default();
        for h in handles {
            match h.join() {
                Ok(Ok(d)) => drained = drained.merge(d),
                Ok(Err(e)) => result = Err(e),
                Err(_) => result = Err(std::io::Error::other("server thread panicked")),
            }
        }
        drained.log();
        result
    }

    /// The places of [`max_connections`](Builder::max_connections) connections.
    fn places(&self) -> Arc<Semaphore> {
        let max = self.max_connections.clamp(1, Semaphore::MAX_PERMITS);
        Arc::new(Semaphore::new(max))
    }
}

/// A tower service a [`Builder`] can serve: HTTP/1.1 requests in, responses with a
/// body of type `B` out, infallible (failures are responses), cloned for each
/// connection, its futures run on any thread. Implemented for every such service.
pub trait HttpService<B>:
    tower::Service<
        Request<Incoming>,
        Response = Response<B>,
        Error = Infallible,
        Future: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<S, B> HttpService<B> for S where
    S: tower::Service<
            Request<Incoming>,
            Response = Response<B>,
            Error = Infallible,
            Future: Send + 'static,
        > + Clone
        + Send
        + 'static
{
}

/// Open connections across the listeners of one server, counted for the drain's log.
#[derive(Debug, Default)]
struct DrainTracker {
    open: AtomicUsize,
    /// Whether the drain's start was logged (once per server, by its first thread).
    announced: AtomicBool,
}

/// Counts one open connection, and holds its place among
/// [`max_connections`](Builder::max_connections), until dropped (with its connection's
/// task).
struct OpenConnection {
    tracker: Arc<DrainTracker>,
    _place: OwnedSemaphorePermit,
}

impl OpenConnection {
    fn new(tracker: &Arc<DrainTracker>, place: OwnedSemaphorePermit) -> Self {
        tracker.open.fetch_add(1, Ordering::Relaxed);
        OpenConnection {
            tracker: Arc::clone(tracker),
            _place: place,
        }
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.tracker.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The failed accepts of one accept loop that are not about one connection (out of
/// file descriptors, `EMFILE`/`ENFILE`; out of memory, `ENOBUFS`/`ENOMEM`): the pause
/// before the next accept, and when they were last logged.
///
/// Such a failure repeats at once (the connection waiting stays in the backlog) until
/// the resource is back: a loop that retried every few milliseconds, logging each time,
/// would spin a core and flood the log while the process is already in trouble.
#[derive(Debug)]
struct AcceptFailures {
    /// The pause after the next failure.
    pause: Duration,
    /// Failures not yet logged.
    unlogged: u64,
    /// When the last line was logged.
    logged: Option<Instant>,
}

impl Default for AcceptFailures {
    fn default() -> Self {
        AcceptFailures {
            pause: ACCEPT_PAUSE_MIN,
            unlogged: 0,
            logged: None,
        }
    }
}

impl AcceptFailures {
    /// An accept failed with `e`: logged when the last line is older than
    /// [`ACCEPT_ERROR_LOG_EVERY`]; the pause to take before accepting again.
    fn failed(&mut self, e: &std::io::Error) -> Duration {
        let now = Instant::now();
        let pause = self.pause;
        self.pause = (self.pause * 2).min(ACCEPT_PAUSE_MAX);
        self.unlogged += 1;
        if self
            .logged
            .is_none_or(|at| now.duration_since(at) >= ACCEPT_ERROR_LOG_EVERY)
        {
            let pause_ms = u64::try_from(pause.as_millis()).unwrap_or(u64::MAX);
            tracing::error!(
                error = %e,
                failures = self.unlogged,
                pause_ms,
                "accept failed (out of file descriptors or memory?): pausing new connections; \
                 raise the open-file limit or lower max connections"
            );
            self.unlogged = 0;
            self.logged = Some(now);
        }
        pause
    }

    /// An accept succeeded: the next failure pauses briefly again (its line still waits
    /// for its turn).
    fn recovered(&mut self) {
        self.pause = ACCEPT_PAUSE_MIN;
    }
}

/// How one listener's drain ended.
#[derive(Debug, Clone, Copy, Default)]
struct Drained {
    /// Connections cut at the deadline.
    cut: usize,
    /// From the shutdown signal to the last connection's end.
    took: Duration,
}

impl Drained {
    /// Several listeners' drains as one: their cuts summed, the longest time.
    fn merge(self, other: Drained) -> Drained {
        Drained {
            cut: self.cut + other.cut,
            took: self.took.max(other.took),
        }
    }

    fn log(self) {
        let took_ms = u64::try_from(self.took.as_millis()).unwrap_or(u64::MAX);
        if self.cut == 0 {
            tracing::info!(took_ms, "drain finished: every connection closed");
        } else {
            tracing::info!(
                cut = self.cut,
                took_ms,
                "drain deadline passed: cut the connections still open"
            );
        }
    }
}

/// The drain's word to one listener's connections: when it starts, each connection is
/// told to close once idle (`graceful_shutdown`), and woken to hear it.
///
/// Each watched connection keeps its task's waker in an `AtomicWaker`, refreshed by a
/// compare-and-swap on every poll. hyper-util's `GracefulShutdown`, used before, polled
/// a `watch` channel's `Notified` on every poll of the connection instead, which takes
/// the channel's lock each time: about 150 instructions per poll, and a streamed answer
/// polls its connection twenty-odd times (docs/performance.md, "The drain's signal").
#[derive(Default)]
struct Drain {
    started: AtomicBool,
    waiting: std::sync::Mutex<Waiting>,
}

#[derive(Default)]
struct Waiting {
    by_id: std::collections::HashMap<u64, Arc<AtomicWaker>>,
    next: u64,
}

impl Drain {
    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        // Inserts and removes only: a panic cannot leave the map inconsistent.
        self.waiting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `conn`, told to close once idle when the drain starts (at once if it has).
    fn watch<C: GracefulConnection>(self: &Arc<Self>, conn: C) -> Watched<C> {
        let waker = Arc::new(AtomicWaker::new());
        let id = {
            let mut waiting = self.lock();
            let id = waiting.next;
            waiting.next += 1;
            waiting.by_id.insert(id, Arc::clone(&waker));
            id
        };
        Watched {
            conn,
            drain: Arc::clone(self),
            id,
            waker,
            told: false,
        }
    }

    /// Tell every watched connection, and every one watched from now on.
    fn start(&self) {
        self.started.store(true, Ordering::Release);
        for waker in self.lock().by_id.values() {
            waker.wake();
        }
    }
}

pin_project_lite::pin_project! {
    /// A connection under a [`Drain`].
    struct Watched<C> {
        #[pin]
        conn: C,
        drain: Arc<Drain>,
        id: u64,
        waker: Arc<AtomicWaker>,
        told: bool,
    }

    impl<C> PinnedDrop for Watched<C> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            this.drain.lock().by_id.remove(this.id);
        }
    }
}

impl<C: GracefulConnection> Future for Watched<C> {
    type Output = C::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let mut this = self.project();
        if !*this.told {
            // Registered before the flag is read: a drain that starts after the read
            // finds this waker (`AtomicWaker`'s own protocol).
            this.waker.register(cx.waker());
            if this.drain.started.load(Ordering::Acquire) {
                *this.told = true;
                this.conn.as_mut().graceful_shutdown();
            }
        }
        this.conn.poll(cx)
    }
}

/// The accept loop and the drain of one listener, each connection holding one of
/// `places`; the caller logs the outcome.
async fn serve_until<S, B>(
    listener: TcpListener,
    service: S,
    shutdown: impl Future<Output = ()>,
    config: &Builder,
    tracker: &Arc<DrainTracker>,
    places: &Arc<Semaphore>,
) -> Drained
where
    S: HttpService<B>,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let drain = Arc::new(Drain::default());
    // Every connection's task, so that the drain can cut those left at its deadline.
    let mut connections = JoinSet::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new());
    // Slow or idle clients must not hold a connection's task open forever.
    http.header_read_timeout(Duration::from_secs(30));
    http.max_buf_size(READ_BUFFER_MAX);
    tokio::pin!(shutdown);
    let mut failures = AcceptFailures::default();
    loop {
        let (stream, _peer) = tokio::select! {
            // A stop asked under a flood of connections is not delayed by them.
            biased;
            () = &mut shutdown => break,
            res = listener.accept() => match res {
                Ok(conn) => {
                    failures.recovered();
                    conn
                }
                Err(e) if is_per_connection(&e) => continue,
                Err(e) => {
                    // Out of file descriptors and the like: pause, do not spin.
                    let pause = failures.failed(&e);
                    tokio::select! {
                        biased;
                        () = &mut shutdown => break,
                        () = tokio::time::sleep(pause) => {}
                    }
                    continue;
                }
            },
            // Reap ended connections so the set holds only live ones.
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        // The connection's place, taken after it is accepted: every thread's loop waits
        // in one queue for the places all threads share (first come, first served), so
        // a thread whose socket is quiet holds no place idle. Meanwhile this thread
        // accepts nothing more: new connections wait in its backlog.
        let held = match Arc::clone(places).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                let mut waiting = std::pin::pin!(Arc::clone(places).acquire_owned());
                let taken = loop {
                    tokio::select! {
                        biased;
                        () = &mut shutdown => break None,
                        taken = &mut waiting => break taken.ok(),
                        Some(_) = connections.join_next(), if !connections.is_empty() => {}
                    }
                };
                match taken {
                    Some(p) => p,
                    // Stopping (the places are never closed): this connection is closed
                    // unserved, as those in the backlog are.
                    None => break,
                }
            }
        };
        let open = OpenConnection::new(tracker, held);
        let _ = stream.set_nodelay(true);
        let stream = SendTimeout::new(stream, config.send_timeout);
        #[cfg(feature = "tls")]
        if let Some(tls) = &config.tls {
            let (acceptor, drain) = (tls.acceptor().clone(), Arc::clone(&drain));
            let (http, service) = (http.clone(), service.clone());
            connections.spawn(async move {
                let _open = open;
                let stream = match tokio::time::timeout(
                    TLS_HANDSHAKE_TIMEOUT,
                    acceptor.accept(stream),
                )
                .await
                {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!("TLS handshake timed out");
                        return;
                    }
                };
                let conn =
                    http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
                // Watched from its acceptance: a drain that started meanwhile closes it
                // as soon as it is idle.
                if let Err(e) = drain.watch(conn).await {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
            });
            continue;
        }
        let conn = http.serve_connection(
            TokioIo::new(stream),
            TowerToHyperService::new(service.clone()),
        );
        let conn = drain.watch(conn);
        connections.spawn(async move {
            let _open = open;
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    let started = Instant::now();
    // Refuse new connections from now on.
    drop(listener);
    if !tracker.announced.swap(true, Ordering::Relaxed) {
        let drain_timeout_ms = u64::try_from(config.drain_timeout.as_millis()).unwrap_or(u64::MAX);
        tracing::info!(
            open_connections = tracker.open.load(Ordering::Relaxed),
            drain_timeout_ms,
            "shutting down: listener closed, draining in-flight requests"
        );
    }
    let all_closed = async {
        // Tells every connection to close once idle, then waits for all of them.
        drain.start();
        while connections.join_next().await.is_some() {}
    };
    let cut = match tokio::time::timeout(config.drain_timeout, all_closed).await {
        Ok(()) => 0,
        Err(_) => {
            while connections.try_join_next().is_some() {}
            let cut = connections.len();
            // Aborts each task: its connection is dropped, so its socket closes.
            connections.shutdown().await;
            cut
        }
    };
    Drained {
        cut,
        took: started.elapsed(),
    }
}

fn is_per_connection(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | ConnectionRefused
    )
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::task::Poll;
    use std::time::Duration;

    /// Write system calls this thread has made (`syscw` of `/proc/thread-self/io`).
    fn writes_of_this_thread() -> Option<u64> {
        let io = std::fs::read_to_string("/proc/thread-self/io").ok()?;
        io.lines()
            .find_map(|l| l.strip_prefix("syscw:")?.trim().parse().ok())
    }

    /// The write system calls this thread makes while arming `timers` timers of 30 s on
    /// a fresh current-thread runtime whose driver has parked once, with or without the
    /// heartbeat; `None` where `/proc/thread-self/io` cannot be read.
    fn writes_arming_timers(heartbeat: bool, timers: usize) -> Option<u64> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok()?;
        rt.block_on(async {
            if heartbeat {
                tokio::spawn(super::timer_heartbeat());
            }
            // The driver parks and plans its next wake-up: the heartbeat's next tick, or
            // none once this sleep has fired.
            tokio::time::sleep(Duration::from_millis(20)).await;
            let before = writes_of_this_thread()?;
            let mut armed = Vec::with_capacity(timers);
            for _ in 0..timers {
                let mut sleep = Box::pin(tokio::time::sleep(Duration::from_secs(30)));
                // A sleep arms its timer when first polled.
                std::future::poll_fn(|cx| {
                    assert!(sleep.as_mut().poll(cx).is_pending());
                    Poll::Ready(())
                })
                .await;
                armed.push(sleep);
            }
            let after = writes_of_this_thread()?;
            Some(after - before)
        })
    }

    #[test]
    fn with_the_heartbeat_arming_a_long_timer_writes_nothing() {
        let Some(without) = writes_arming_timers(false, 8) else {
            return; // no per-thread I/O accounting here: nothing to observe
        };
        // The premise: Tokio wakes its own driver (an eventfd write) for each of them.
        assert!(without >= 1, "tokio no longer unparks: {without} writes");
        assert_eq!(writes_arming_timers(true, 8), Some(0));
    }
}
