//! The accept loop out of file descriptors: it backs off and logs the failure once in
//! a while, instead of retrying (and logging at `error`) every few milliseconds, and it
//! serves the waiting client once descriptors are free again.
//!
//! A binary of its own: it exhausts the process's descriptors, which would fail any
//! test running beside it.

#![allow(missing_docs)] // a test binary

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use disagg_http::server::Builder;
use http::{Request, Response};
use hyper::body::Incoming;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Events at `warn` or above logged by the server module.
static LOGGED: AtomicUsize = AtomicUsize::new(0);

/// Counts [`LOGGED`]; nothing else.
struct Counter;

impl tracing::Subscriber for Counter {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let m = event.metadata();
        if m.target().starts_with("disagg_http::server") && *m.level() <= tracing::Level::WARN {
            LOGGED.fetch_add(1, Ordering::SeqCst);
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Lowers this process's soft limit on open files to `max`, when above it (the hard
/// limit stays), with util-linux's `prlimit` (the workspace forbids `unsafe`, which
/// `setrlimit` through libc needs).
fn lower_open_file_limit(max: u64) {
    if open_file_limit().is_some_and(|l| l <= max) {
        return;
    }
    let status = std::process::Command::new("prlimit")
        .arg(format!("--pid={}", std::process::id()))
        .arg(format!("--nofile={max}:"))
        .status()
        .expect("prlimit (util-linux) runs");
    assert!(status.success(), "prlimit lowered the soft limit: {status}");
}

/// This process's soft limit on open files (`/proc/self/limits`), where it can be read.
fn open_file_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

#[tokio::test(flavor = "current_thread")]
async fn out_of_descriptors_the_accept_loop_backs_off_and_recovers() {
    // Opening every descriptor the limit allows: a soft limit above 4,096 is lowered to
    // it first, for this process only (the binary holds this one test).
    lower_open_file_limit(4096);
    let limit = open_file_limit().expect("the open-file limit is readable");
    assert!(limit <= 4096, "the soft limit was lowered: {limit}");
    tracing::subscriber::set_global_default(Counter).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // Connected before the descriptors run out: the kernel completes the handshake and
    // the connection waits in the accept queue.
    let client = std::net::TcpStream::connect(addr).unwrap();
    client.set_nonblocking(true).unwrap();
    let mut client = tokio::net::TcpStream::from_std(client).unwrap();
    let mut hoard = Vec::new();
    while let Ok(f) = std::fs::File::open("/dev/null") {
        hoard.push(f);
        assert!(hoard.len() as u64 <= limit, "no limit on open files");
    }
    let service = tower::service_fn(|_req: Request<Incoming>| async {
        Ok::<_, Infallible>(Response::new(http_body_util::Full::new(Bytes::from("ok"))))
    });
    tokio::spawn(Builder::new().serve(listener, service, std::future::pending()));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let logged = LOGGED.load(Ordering::SeqCst);
    drop(hoard);
    // Once in 1.5 s (the first failure); a retry every 50 ms logged each time before.
    assert!(
        (1..=2).contains(&logged),
        "{logged} warnings in 1.5 s of failed accepts"
    );
    // Descriptors free again: the waiting client is served within the longest pause.
    client
        .write_all(format!("GET / HTTP/1.1\r\nhost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(5), client.read(&mut buf))
        .await
        .expect("served after the descriptors were freed")
        .unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
}
