//! `HttpTransport` against a simulated engine over loopback: keep-alive reuse, early
//! drops closing their connection, idle expiry, connection errors, bodies sent in pieces.

use std::time::Duration;

use bytes::Bytes;
use disagg_core::error::TransportError;
use disagg_core::transport::Transport;
use disagg_http::{HttpTransport, HttpTransportConfig};
use disagg_sim::{SimConfig, SimEngine};
use http::uri::Authority;
use http_body_util::BodyExt;

fn request(engine: &SimEngine, stream: bool, max_tokens: u32) -> http::Request<Bytes> {
    let body = serde_json::json!({
        "model": "sim-model", "prompt": "keep alive", "max_tokens": max_tokens, "stream": stream,
    });
    let mut req = http::Request::new(Bytes::from(body.to_string()));
    *req.method_mut() = http::Method::POST;
    *req.uri_mut() = format!("{}/v1/completions", engine.url()).parse().unwrap();
    req.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    req
}

fn authority(engine: &SimEngine) -> Authority {
    engine.addr().to_string().parse().unwrap()
}

async fn until(mut f: impl FnMut() -> bool) -> bool {
    for _ in 0..100 {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    f()
}

#[tokio::test]
async fn sequential_requests_share_one_connection() {
    let engine = SimEngine::start(SimConfig::default()).await.unwrap();
    let t = HttpTransport::default();
    for stream in [false, true, false] {
        let resp = t.send(request(&engine, stream, 3)).await.unwrap();
        assert_eq!(resp.status(), 200);
        resp.into_body().collect().await.unwrap();
    }
    assert_eq!(t.idle_connections(&authority(&engine)), 1);
    assert!(until(|| engine.stats().open_connections == 1).await);
    assert_eq!(engine.stats().requests, 3);
}

/// `Duration::MAX`, the usual "no limit", as the connect timeout: the deadline it
/// makes cannot be added to the clock, so it must mean "far away", not a panic.
#[tokio::test]
async fn a_connect_timeout_of_duration_max_connects() {
    let engine = SimEngine::start(SimConfig::default()).await.unwrap();
    let mut config = HttpTransportConfig::default();
    config.connect_timeout = Duration::MAX;
    let t = HttpTransport::new(config);
    let resp = t.send(request(&engine, false, 3)).await.unwrap();
    assert_eq!(resp.status(), 200);
}

#[tokio::test]
async fn a_body_dropped_early_closes_its_connection() {
    let slow = SimConfig {
        inter_token_delay: Duration::from_millis(20),
        ..SimConfig::default()
    };
    let engine = SimEngine::start(slow).await.unwrap();
    let t = HttpTransport::default();
    let resp = t.send(request(&engine, true, 100)).await.unwrap();
    let mut body = resp.into_body();
    body.frame().await.unwrap().unwrap();
    drop(body);
    assert!(
        until(|| engine.stats().open_connections == 0).await,
        "{:?}",
        engine.stats()
    );
    assert_eq!(engine.stats().cancelled, 1);
    assert_eq!(t.idle_connections(&authority(&engine)), 0);
}

/// Two requests `pause` apart through a transport whose pool keeps idle connections for
/// `idle_timeout`; the engine's count of the HTTP connections it accepted afterwards.
async fn connections_for_two_requests(idle_timeout: Duration, pause: Duration) -> u64 {
    let engine = SimEngine::start(SimConfig::default()).await.unwrap();
    let mut config = HttpTransportConfig::default();
    config.pool_idle_timeout = idle_timeout;
    let t = HttpTransport::new(config);
    let resp = t.send(request(&engine, false, 2)).await.unwrap();
    resp.into_body().collect().await.unwrap();
    assert_eq!(t.idle_connections(&authority(&engine)), 1);
    assert_eq!(engine.stats().http_connections, 1);
    tokio::time::sleep(pause).await;
    let resp = t.send(request(&engine, false, 2)).await.unwrap();
    resp.into_body().collect().await.unwrap();
    // Whatever the first connection's fate, one connection is left open and pooled.
    assert!(
        until(|| engine.stats().open_connections == 1).await,
        "{:?}",
        engine.stats()
    );
    assert_eq!(t.idle_connections(&authority(&engine)), 1);
    assert_eq!(engine.stats().requests, 2);
    engine.stats().http_connections
}

#[tokio::test]
async fn idle_connections_expire() {
    // Idle past the pool's timeout: the expired connection is dropped, not used, and the
    // second request opens a new one (the engine accepted two).
    let accepted =
        connections_for_two_requests(Duration::from_millis(50), Duration::from_millis(150)).await;
    assert_eq!(accepted, 2, "the expired connection was reused");
    // The control: the same pause within the timeout reuses the first connection, so the
    // count above is the expiry's doing.
    let accepted =
        connections_for_two_requests(Duration::from_secs(30), Duration::from_millis(150)).await;
    assert_eq!(
        accepted, 1,
        "a connection idle within its timeout was not reused"
    );
}

#[tokio::test]
async fn refused_connections_are_connect_errors() {
    // Bound, never listening: refused, and no listener of a test running beside this
    // one can take the port meanwhile.
    let held = tokio::net::TcpSocket::new_v4().unwrap();
    held.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = held.local_addr().unwrap();
    let mut req = http::Request::new(Bytes::from_static(b"{}"));
    *req.uri_mut() = format!("http://{addr}/v1/completions").parse().unwrap();
    let err = HttpTransport::default().send(req).await.unwrap_err();
    assert!(matches!(err, TransportError::Connect(_)), "{err:?}");
}

/// An engine that left (discovery renames pods all day) is never asked again: its idle
/// connection must still go, closed at the engine too, once past the idle timeout, when
/// another engine's request gives its connection back.
#[tokio::test]
async fn idle_connections_to_an_engine_no_longer_used_are_closed_after_the_idle_timeout() {
    let (gone, stays) = (
        SimEngine::start(SimConfig::default()).await.unwrap(),
        SimEngine::start(SimConfig::default()).await.unwrap(),
    );
    let mut config = HttpTransportConfig::default();
    config.pool_idle_timeout = Duration::from_millis(100);
    let t = HttpTransport::new(config);
    for engine in [&gone, &stays] {
        let resp = t.send(request(engine, false, 2)).await.unwrap();
        resp.into_body().collect().await.unwrap();
        assert_eq!(t.idle_connections(&authority(engine)), 1);
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    let resp = t.send(request(&stays, false, 2)).await.unwrap();
    resp.into_body().collect().await.unwrap();
    assert_eq!(t.idle_connections(&authority(&gone)), 0);
    assert!(
        until(|| gone.stats().open_connections == 0).await,
        "{:?}",
        gone.stats()
    );
    assert_eq!(t.idle_connections(&authority(&stays)), 1);
}

#[tokio::test]
async fn a_sliced_body_arrives_whole_and_keeps_its_connection() {
    // A leg's body in pieces, its prompt a slice of a larger buffer (as the client's
    // body is): the engine reads one JSON body, byte for byte, and the connection is
    // kept for the next request.
    let engine = SimEngine::start(SimConfig::default()).await.unwrap();
    let t = HttpTransport::default();
    let prompt = "word ".repeat(5_000);
    let client = Bytes::from(format!(
        r#"{{"model":"sim-model","prompt":"{prompt}","max_tokens":2}}"#
    ));
    let parsed = disagg_core::json::JsonBody::parse_bytes(&client).unwrap();
    let body = disagg_core::transport::SlicedBody::from(&parsed);
    // Its pieces, as the transport sends them: its frames.
    let mut pieces = Vec::new();
    let mut frames = body.clone();
    while let Some(frame) = frames.frame().await {
        pieces.push(frame.unwrap().into_data().unwrap());
    }
    assert!(pieces.len() > 1, "the prompt is a piece of its own");
    assert!(
        pieces
            .iter()
            .any(|p| p.len() > prompt.len() && client.as_ptr() < p.as_ptr())
    );
    assert_eq!(
        http_body::Body::size_hint(&body).exact(),
        Some(client.len() as u64)
    );
    for _ in 0..2 {
        let mut req = http::Request::new(body.clone());
        *req.method_mut() = http::Method::POST;
        *req.uri_mut() = format!("{}/v1/completions", engine.url()).parse().unwrap();
        req.headers_mut()
            .insert("content-type", "application/json".parse().unwrap());
        let resp = t.send_sliced(req).await.unwrap();
        let status = resp.status();
        let answer = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    }
    let seen = engine.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].body["prompt"], prompt.as_str());
    assert_eq!(seen[1].body["max_tokens"], 2);
    assert_eq!(t.idle_connections(&authority(&engine)), 1);
    assert_eq!(engine.stats().requests, 2);
}

/// The pool finds a connection by the engine's authority as `Authority` compares it,
/// ignoring ASCII case, also where its byte-for-byte lookup finds no twin.
#[tokio::test]
async fn authorities_spelled_in_another_case_share_a_pooled_connection() {
    let engine = SimEngine::start(SimConfig::default()).await.unwrap();
    let t = HttpTransport::default();
    let port = engine.addr().port();
    for host in ["localhost", "LocalHost", "LOCALHOST"] {
        let mut req = request(&engine, false, 2);
        *req.uri_mut() = format!("http://{host}:{port}/v1/completions")
            .parse()
            .unwrap();
        let resp = t.send(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        resp.into_body().collect().await.unwrap();
    }
    assert_eq!(engine.stats().requests, 3);
    assert_eq!(engine.stats().http_connections, 1, "{:?}", engine.stats());
    let lower: Authority = format!("localhost:{port}").parse().unwrap();
    assert_eq!(t.idle_connections(&lower), 1);
}
