//! A push consumer's EC port is a peer-facing socket: what an encoder (or anything
//! else) writes there is held to ceilings before any allocation, and a bad frame costs
//! its own connection, never the engine.

mod common;

use common::*;
use disagg_sim::{EcConfig, EcRole, SimConfig, SimEngine};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn consumer(store: &std::path::Path) -> SimEngine {
    SimEngine::start(SimConfig {
        ec: Some(EcConfig {
            role: EcRole::Consumer,
            store: store.to_owned(),
        }),
        ec_push: true,
        ..SimConfig::default()
    })
    .await
    .expect("start a push consumer")
}

/// Whether the engine closes a new connection to `addr` (EOF or reset) instead of
/// answering, once `frame` is written on it.
async fn closes(addr: (&str, u16), frame: &[u8]) -> bool {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(frame).await.unwrap();
    let mut b = [0u8; 1];
    matches!(
        tokio::time::timeout(std::time::Duration::from_secs(5), stream.read(&mut b)).await,
        Ok(Ok(0) | Err(_))
    )
}

fn field(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&u32::try_from(bytes.len()).unwrap().to_be_bytes());
    out.extend_from_slice(bytes);
}

#[tokio::test]
async fn oversized_push_frames_close_their_connection_and_the_engine_serves_on() {
    let store = std::env::temp_dir().join(format!("disagg-ec-peers-{}", std::process::id()));
    std::fs::create_dir_all(&store).unwrap();
    let engine = consumer(&store).await;
    let port = engine.ec_push_port().expect("an EC port");
    let addr = ("127.0.0.1", port);

    // A transfer id claiming 4 GiB: refused on its length, before any buffer.
    assert!(
        closes(addr, &u32::MAX.to_be_bytes()).await,
        "a 4 GiB id must close the connection"
    );

    // An id of 257 bytes (the ceiling is 256).
    let mut frame = Vec::new();
    field(&mut frame, &[b'x'; 257]);
    assert!(
        closes(addr, &frame).await,
        "an over-long id must close the connection"
    );

    // Embeddings over 1 MiB.
    let mut frame = Vec::new();
    field(&mut frame, b"t-1");
    field(&mut frame, b"h-1");
    frame.extend_from_slice(&((1u32 << 20) + 1).to_be_bytes());
    assert!(
        closes(addr, &frame).await,
        "over-large embeddings must close the connection"
    );

    // A well-formed frame on a new connection is still stored (answered 1), and the
    // engine still serves HTTP.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut frame = Vec::new();
    field(&mut frame, b"t-2");
    field(&mut frame, b"h-2");
    field(&mut frame, b"embeddings");
    s.write_all(&frame).await.unwrap();
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack).await.unwrap();
    assert_eq!(ack, [1], "a valid frame is stored");
    assert_eq!(get(engine.addr(), "/health").await.status, 200);
    std::fs::remove_dir_all(&store).ok();
}
