//! `ApiKeyLayer` as a library user stacks it, served by `server::Builder` over loopback:
//! a refused request never reaches the inner service (nor has its body read), an
//! admitted one carries its key's `KeyId` inward, open paths stay open, and a key's
//! in-flight place is held by the answer's body until that body ends.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use disagg_http::auth::{ApiKeyLayer, ApiKeys, KeyId, KeyLimits};
use http::{Request, Response};
use http_body_util::StreamBody;
use hyper::body::{Frame, Incoming};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// What the inner service saw: each request's path and the `KeyId` in its extensions.
type Seen = Arc<Mutex<Vec<(String, Option<KeyId>)>>>;

/// Serve `layer` around an inner service that records what it sees and answers `/slow`
/// with a body that ends when `release` gets a message, anything else with `ok`.
async fn start(layer: ApiKeyLayer) -> (SocketAddr, Seen, mpsc::UnboundedSender<()>) {
    let seen: Seen = Arc::default();
    let (release, released) = mpsc::unbounded_channel::<()>();
    let released = Arc::new(tokio::sync::Mutex::new(released));
    let record = Arc::clone(&seen);
    let inner = tower::service_fn(move |req: Request<Incoming>| {
        let (record, released) = (Arc::clone(&record), Arc::clone(&released));
        async move {
            let path = req.uri().path().to_owned();
            let id = req.extensions().get::<KeyId>().copied();
            record.lock().unwrap().push((path.clone(), id));
            let slow = path == "/slow";
            // One data frame, then (for /slow) the end waits for a release.
            let frames = futures::stream::unfold(0u8, move |i| {
                let released = Arc::clone(&released);
                async move {
                    match i {
                        0 => Some((Ok::<_, Infallible>(Frame::data(Bytes::from("ok\n"))), 1)),
                        _ if slow && i == 1 => {
                            let _ = released.lock().await.recv().await;
                            None
                        }
                        _ => None,
                    }
                }
            });
            Ok::<_, Infallible>(Response::new(StreamBody::new(frames)))
        }
    });
    let service = tower::Layer::layer(&layer, inner);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(disagg_http::server::Builder::new().serve(
        listener,
        service,
        std::future::pending(),
    ));
    (addr, seen, release)
}

/// Send a request head (and `body`, if any) on a new connection; the connection.
async fn send(addr: SocketAddr, head: &str, body: &[u8]) -> TcpStream {
    let mut sock = TcpStream::connect(addr).await.unwrap();
    sock.write_all(head.as_bytes()).await.unwrap();
    sock.write_all(body).await.unwrap();
    sock
}

/// Read from `sock` until `needle` has arrived; what was read.
async fn read_until(sock: &mut TcpStream, needle: &str) -> String {
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    let read = async {
        while !String::from_utf8_lossy(&raw).contains(needle) {
            let n = sock.read(&mut buf).await.unwrap();
            assert!(
                n > 0,
                "closed before {needle:?}: {}",
                String::from_utf8_lossy(&raw)
            );
            raw.extend_from_slice(&buf[..n]);
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("answer in time");
    String::from_utf8_lossy(&raw).into_owned()
}

fn get(path: &str, key: Option<&str>) -> String {
    let auth = key.map_or(String::new(), |k| format!("authorization: Bearer {k}\r\n"));
    format!("GET {path} HTTP/1.1\r\nhost: x\r\n{auth}\r\n")
}

#[tokio::test]
async fn refused_requests_never_reach_the_inner_service() {
    let keys = ApiKeys::new(["sk-lib-a", "sk-lib-b"]).unwrap();
    let (addr, seen, _release) = start(ApiKeyLayer::new(keys.clone()).open_path("/ready")).await;

    // A body announced but never sent: the 401 comes without it being read.
    let head = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n";
    let mut sock = send(addr, head, b"").await;
    let answer = read_until(&mut sock, "invalid_api_key").await;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(answer.contains("www-authenticate: Bearer"), "{answer}");
    let mut sock = send(addr, &get("/v1/models", Some("sk-lib-c")), b"").await;
    let answer = read_until(&mut sock, "invalid_api_key").await;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(
        seen.lock().unwrap().is_empty(),
        "{:?}",
        seen.lock().unwrap()
    );
    let s = keys.stats();
    assert_eq!((s.missing, s.invalid), (1, 1));

    // Admitted: the inner service gets the key's id; open paths get none.
    for (path, key) in [
        ("/v1/models", Some("sk-lib-b")),
        ("/health", None),
        ("/ready", None),
    ] {
        let mut sock = send(addr, &get(path, key), b"").await;
        let answer = read_until(&mut sock, "ok\n").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{path}: {answer}");
    }
    assert_eq!(
        *seen.lock().unwrap(),
        [
            ("/v1/models".to_owned(), Some(KeyId::of("sk-lib-b"))),
            ("/health".to_owned(), None),
            ("/ready".to_owned(), None),
        ]
    );
}

#[tokio::test]
async fn the_in_flight_place_is_held_until_the_body_ends() {
    let mut limits = KeyLimits::default();
    limits.max_in_flight = Some(1);
    let keys = ApiKeys::with_limits(["sk-lib-a", "sk-lib-b"], limits).unwrap();
    let (addr, seen, release) = start(ApiKeyLayer::new(keys.clone())).await;

    // sk-lib-a's answer has its head and first frame out, its end held back.
    let mut slow = send(addr, &get("/slow", Some("sk-lib-a")), b"").await;
    let head = read_until(&mut slow, "ok\n").await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // While it streams, sk-lib-a has no place left; sk-lib-b has its own.
    let mut again = send(addr, &get("/fast", Some("sk-lib-a")), b"").await;
    let answer = read_until(&mut again, "rate_limit_exceeded").await;
    assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
    assert!(answer.contains("retry-after: 1"), "{answer}");
    let mut other = send(addr, &get("/fast", Some("sk-lib-b")), b"").await;
    assert!(
        read_until(&mut other, "ok\n")
            .await
            .starts_with("HTTP/1.1 200")
    );

    // The body ends: the place frees as the inner body reports its end, before the
    // last chunk is written, so the next request of sk-lib-a is admitted.
    release.send(()).unwrap();
    read_until(&mut slow, "0\r\n\r\n").await;
    let mut next = send(addr, &get("/fast", Some("sk-lib-a")), b"").await;
    let answer = read_until(&mut next, "\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(keys.stats().throttled_in_flight, 1);
    assert_eq!(seen.lock().unwrap().len(), 3);
}
