//! `server::Builder::serve`'s drain over loopback: on shutdown the listener closes, an answer
//! in flight streams to its end within the drain timeout, and what is left at the
//! deadline is cut before the function returns, and an idle keep-alive connection is
//! closed at once.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use disagg_http::server::Builder;
use http::{Request, Response};
use http_body_util::StreamBody;
use hyper::body::{Frame, Incoming};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A server whose every answer is `frames` chunks, one per `every`; stopped through the
/// sender.
async fn start(
    frames: u32,
    every: Duration,
    drain_timeout: Duration,
) -> (
    SocketAddr,
    oneshot::Sender<()>,
    JoinHandle<std::io::Result<()>>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = tower::service_fn(move |_req: Request<Incoming>| async move {
        let chunks = futures::stream::unfold(0u32, move |i| async move {
            if i == frames {
                return None;
            }
            if i > 0 {
                tokio::time::sleep(every).await;
            }
            let frame = Frame::data(Bytes::from(format!("frame {i}\n")));
            Some((Ok::<_, Infallible>(frame), i + 1))
        });
        Ok::<_, Infallible>(Response::new(StreamBody::new(chunks)))
    });
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(Builder::new().drain_timeout(drain_timeout).serve(
        listener,
        service,
        async {
            let _ = stopped.await;
        },
    ));
    (addr, stop, server)
}

/// Connect and send a GET.
async fn get(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET / HTTP/1.1\r\nhost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    s
}

/// Read from `s` into `got` until it contains `want` (true) or the connection ends
/// (false), for at most 10 s.
async fn read_until(s: &mut TcpStream, got: &mut Vec<u8>, want: &[u8]) -> bool {
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !got.windows(want.len()).any(|w| w == want) {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
            Ok(_) => return false,
            Err(_) => panic!("nothing more in 10 s: {}", String::from_utf8_lossy(got)),
        }
    }
    true
}

/// Whether connecting to `addr` is refused within `limit` (polled every 10 ms).
async fn refused_within(addr: SocketAddr, limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        match TcpStream::connect(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return true,
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    false
}

/// `serve` returned, without an error, within 2 s (`why` says what it waited for).
async fn returns_within_2s(server: JoinHandle<std::io::Result<()>>, why: &str) {
    tokio::time::timeout(Duration::from_secs(2), server)
        .await
        .expect(why)
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_in_flight_streams_to_its_end() {
    // 20 frames, 100 ms apart: 1.9 s of answer, well within the 10 s drain, and long
    // past the listener's closing.
    let (addr, stop, server) = start(20, Duration::from_millis(100), Duration::from_secs(10)).await;
    let mut s = get(addr).await;
    let mut got = Vec::new();
    assert!(read_until(&mut s, &mut got, b"frame 0").await);
    stop.send(()).unwrap();

    // The listener is closed at once (one listener: no race to retry), once the server
    // task has run.
    assert!(
        refused_within(addr, Duration::from_secs(1)).await,
        "the listener still accepts after the stop"
    );
    assert!(!server.is_finished(), "returned before the answer ended");

    // The answer arrives whole, its last chunk included.
    assert!(
        read_until(&mut s, &mut got, b"frame 19\n\r\n0\r\n\r\n").await,
        "cut: {}",
        String::from_utf8_lossy(&got)
    );
    let ended = Instant::now();
    returns_within_2s(server, "serve returns once the answer is out").await;
    assert!(ended.elapsed() < Duration::from_secs(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_cuts_what_is_left() {
    // 100 frames, 100 ms apart: 10 s of answer against a 200 ms drain.
    let (addr, stop, server) =
        start(100, Duration::from_millis(100), Duration::from_millis(200)).await;
    let mut s = get(addr).await;
    let mut got = Vec::new();
    assert!(read_until(&mut s, &mut got, b"frame 0").await);
    let stopped = Instant::now();
    stop.send(()).unwrap();
    returns_within_2s(server, "serve returns at its deadline").await;
    let took = stopped.elapsed();
    assert!(
        took >= Duration::from_millis(200),
        "no drain at all: {took:?}"
    );
    // The runtime runs on: the connection's task must have been cut, not left behind.
    assert!(
        !read_until(&mut s, &mut got, b"\r\n0\r\n\r\n").await,
        "the answer ended cleanly"
    );
    assert!(
        stopped.elapsed() < Duration::from_secs(2),
        "the connection stayed open"
    );
    assert!(!got.windows(8).any(|w| w == b"frame 99"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keep_alive_connection_is_closed_at_once() {
    // One answer, read whole: the connection then waits for a next request, and the
    // drain (10 s) must wake it to close it, not wait for its deadline.
    let (addr, stop, server) = start(1, Duration::from_millis(10), Duration::from_secs(10)).await;
    let mut s = get(addr).await;
    let mut got = Vec::new();
    assert!(read_until(&mut s, &mut got, b"frame 0\n\r\n0\r\n\r\n").await);
    // Idle for a moment, so that nothing but the drain polls its task again.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stopped = Instant::now();
    stop.send(()).unwrap();
    returns_within_2s(server, "serve returns once the idle connection is closed").await;
    assert!(stopped.elapsed() < Duration::from_secs(2));
    // The client sees the close.
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf))
        .await
        .expect("closed")
        .unwrap_or(0);
    assert_eq!(n, 0, "{}", String::from_utf8_lossy(&buf[..n]));
}

/// Serves an endless answer of 64 KiB chunks (as fast as the client takes them) with
/// `send_timeout`; the flag turns true when the answer is dropped.
async fn endless(send_timeout: Duration) -> (SocketAddr, Arc<AtomicBool>, oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let dropped = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&dropped);
    let service = tower::service_fn(move |_req: Request<Incoming>| {
        let flag = Arc::clone(&flag);
        async move {
            /// Sets its flag when the answer holding it is dropped.
            struct OnDrop(Arc<AtomicBool>);
            impl Drop for OnDrop {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::SeqCst);
                }
            }
            let guard = OnDrop(flag);
            let chunks = futures::stream::unfold(guard, |guard| async move {
                let frame = Frame::data(Bytes::from(vec![b'x'; 64 * 1024]));
                Some((Ok::<_, Infallible>(frame), guard))
            });
            Ok::<_, Infallible>(Response::new(StreamBody::new(chunks)))
        }
    });
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(
        Builder::new()
            .send_timeout(send_timeout)
            .serve(listener, service, async {
                let _ = stopped.await;
            }),
    );
    (addr, dropped, stop)
}

/// A client that reads the head of an endless answer and then nothing more.
async fn stop_reading(addr: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut s = socket.connect(addr).await.unwrap();
    s.write_all(format!("GET / HTTP/1.1\r\nhost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut got = Vec::new();
    assert!(read_until(&mut s, &mut got, b"\r\n\r\n").await);
    s
}

/// A client that stops reading a streamed answer is cut once a write has waited the
/// send timeout: its answer (and all a proxy's answer holds) is dropped. Without the
/// limit it is held as long as the client stays.
#[tokio::test]
async fn a_client_that_stops_reading_is_cut_after_the_send_timeout() {
    let (addr, dropped, _stop) = endless(Duration::from_millis(300)).await;
    let _client = stop_reading(addr).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while !dropped.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "the answer was never dropped");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The control: no limit, the same client, the answer still held after 2 s.
    let (addr, dropped, _stop) = endless(Duration::ZERO).await;
    let _client = stop_reading(addr).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !dropped.load(Ordering::SeqCst),
        "held while the client stays"
    );
}

/// Whether `s` gets the start of an answer within `wait`.
async fn answered_within(s: &mut TcpStream, wait: Duration) -> bool {
    let mut buf = [0u8; 64];
    match tokio::time::timeout(wait, s.read(&mut buf)).await {
        Ok(Ok(n)) => n > 0 && buf.starts_with(b"HTTP/1.1 200"),
        Ok(Err(_)) | Err(_) => false,
    }
}

/// With `max_connections(2)`, two idle connections hold both places: a third is not
/// served (it waits in the listen backlog, unaccepted) until one of them closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_limit_wait_for_a_place() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = tower::service_fn(|_req: Request<Incoming>| async {
        Ok::<_, Infallible>(Response::new(http_body_util::Full::new(Bytes::from("ok"))))
    });
    let (_stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(
        Builder::new()
            .max_connections(2)
            .serve(listener, service, async {
                let _ = stopped.await;
            }),
    );
    let first = TcpStream::connect(addr).await.unwrap();
    let _second = TcpStream::connect(addr).await.unwrap();
    // Both accepted (the accept queue is first in, first out) before the third comes.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut third = get(addr).await;
    assert!(
        !answered_within(&mut third, Duration::from_millis(500)).await,
        "a third connection was served past the limit of 2"
    );
    drop(first);
    assert!(
        answered_within(&mut third, Duration::from_secs(5)).await,
        "the third connection was not served once a place was free"
    );
}

/// The one kind of error not in OpenAI's format (docs/reliability.md): a request head
/// hyper refuses before the service sees it, here a head three times the 32 KiB read
/// buffer, gets hyper's own 431 with an empty body, and the service is never called.
#[tokio::test]
async fn a_head_past_the_read_buffer_gets_hypers_own_431_with_no_body() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let called = Arc::new(AtomicBool::new(false));
    let seen = Arc::clone(&called);
    let service = tower::service_fn(move |_req: Request<Incoming>| {
        seen.store(true, Ordering::SeqCst);
        async { Ok::<_, Infallible>(Response::new(http_body_util::Empty::<Bytes>::new())) }
    });
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(Builder::new().serve(listener, service, async {
        let _ = stopped.await;
    }));
    let mut s = TcpStream::connect(addr).await.unwrap();
    // hyper checks its limit when its buffer is full, and one read may take more than
    // 32 KiB: a head well past it is refused however it arrives.
    let big = "a".repeat(3 * disagg_http::server::READ_BUFFER_MAX);
    let head = format!("GET /v1/models HTTP/1.1\r\nhost: {addr}\r\nx-a: {big}\r\n\r\n");
    // hyper may answer and close before it has read the whole head.
    let _ = s.write_all(head.as_bytes()).await;
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got)).await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 431"), "{text}");
    assert!(text.contains("content-length: 0"), "no body: {text}");
    assert!(!called.load(Ordering::SeqCst), "the service never saw it");
    let _ = stop.send(());
    returns_within_2s(server, "the drain").await;
}

/// Places are shared by every serve thread and taken once a connection is accepted: a
/// thread whose socket is quiet holds no place idle while clients wait on another
/// thread's socket. With one place and two threads, a run of clients one after another
/// (each spread by the kernel to either socket) is each served.
#[test]
fn one_place_over_two_threads_serves_every_client_in_turn() {
    let (stop, shutdown) = tokio::sync::watch::channel(false);
    let (bound_tx, bound_rx) = std::sync::mpsc::channel();
    let server = std::thread::spawn(move || {
        Builder::new().threads(2).max_connections(1).serve_threads(
            "127.0.0.1:0".parse().unwrap(),
            || {
                tower::service_fn(|_req: Request<Incoming>| async {
                    Ok::<_, Infallible>(Response::new(http_body_util::Full::new(Bytes::from("ok"))))
                })
            },
            shutdown,
            move |addr| bound_tx.send(addr).unwrap(),
        )
    });
    let addr = bound_rx.recv().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        for i in 0..16 {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(
                format!("GET / HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n").as_bytes(),
            )
            .await
            .unwrap();
            let mut got = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut got));
            assert!(read.await.is_ok(), "client {i} was not served");
            assert!(got.starts_with(b"HTTP/1.1 200"), "client {i}");
        }
    });
    stop.send(true).unwrap();
    server.join().unwrap().unwrap();
}
