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

/// Pushes one item frame on `s` and reads the consumer's acknowledgement.
async fn push_item(s: &mut TcpStream, id: &str, hash: &str) -> u8 {
    let mut frame = Vec::new();
    field(&mut frame, id.as_bytes());
    field(&mut frame, hash.as_bytes());
    field(&mut frame, b"embeddings");
    s.write_all(&frame).await.unwrap();
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack).await.unwrap();
    ack[0]
}

/// A second push under a transfer id the consumer holds is refused, not a silent
/// replacement of the first item.
#[tokio::test]
async fn a_transfer_id_held_already_is_refused() {
    let store = std::env::temp_dir().join(format!("disagg-ec-dup-{}", std::process::id()));
    std::fs::create_dir_all(&store).unwrap();
    let engine = consumer(&store).await;
    let port = engine.ec_push_port().expect("an EC port");
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    assert_eq!(push_item(&mut s, "t-1", "h-1").await, 1);
    assert_eq!(push_item(&mut s, "t-1", "h-other").await, 0, "a duplicate");
    assert_eq!(push_item(&mut s, "t-2", "h-1").await, 1, "another id");
    std::fs::remove_dir_all(&store).ok();
}

/// Items no request takes expire after the consumer's lease: a consumer filled with
/// stranded items (4096 of them) takes new pushes again once they expired, instead of
/// refusing every later encoder for ever.
#[tokio::test]
async fn stranded_items_expire_and_free_their_place() {
    let store = std::env::temp_dir().join(format!("disagg-ec-lease-{}", std::process::id()));
    std::fs::create_dir_all(&store).unwrap();
    let engine = SimEngine::start(SimConfig {
        ec: Some(EcConfig {
            role: EcRole::Consumer,
            store: store.clone(),
        }),
        ec_push: true,
        kv_lease: std::time::Duration::from_millis(200),
        ..SimConfig::default()
    })
    .await
    .expect("start a push consumer");
    let port = engine.ec_push_port().expect("an EC port");
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    for i in 0..4096 {
        assert_eq!(push_item(&mut s, &format!("stranded-{i}"), "h").await, 1);
    }
    // Within 30 s (the lease is 200 ms), a new item is stored again.
    let mut stored = false;
    for attempt in 0..300 {
        if push_item(&mut s, &format!("late-{attempt}"), "h").await == 1 {
            stored = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(stored, "the stranded items never expired");
    std::fs::remove_dir_all(&store).ok();
}
