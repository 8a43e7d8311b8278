//! `disagg-proxy serve --connector lmcache`: the real binary binds its notification
//! socket, learns each decode's receiver from `--lmcache-receiver`, and serves chat
//! through simulated LMCache engines (decode TP 2) in this process.

#![allow(missing_docs)] // a test binary

use std::process::{Command, Stdio};
use std::time::Duration;

use disagg_sim::{KvMode, LmcacheReceiver, SimConfig, SimEngine, SimRole};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

mod common;
use common::{Proxy, free_addr};

/// POST a chat request over a fresh connection and read the raw answer to its end.
async fn chat(proxy: &Proxy, stream: bool) -> String {
    let body = serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "what does the cli do"}],
        "max_tokens": 6,
        "stream": stream,
    })
    .to_string();
    let mut sock = TcpStream::connect(proxy.addr).await.expect("connect");
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    sock.write_all(head.as_bytes()).await.unwrap();
    sock.write_all(body.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), sock.read_to_end(&mut raw))
        .await
        .expect("answer in time")
        .expect("read");
    String::from_utf8_lossy(&raw).into_owned()
}

#[tokio::test]
async fn serve_with_the_lmcache_connector() {
    let notify = free_addr();
    let decode = SimEngine::start(SimConfig {
        kv_mode: KvMode::Lmcache(SimRole::Decode),
        lmcache_receiver: LmcacheReceiver::ephemeral(2),
        ..SimConfig::default()
    })
    .await
    .expect("decode sim");
    let prefill = SimEngine::start(SimConfig {
        kv_mode: KvMode::Lmcache(SimRole::Prefill),
        lmcache_proxy: Some(notify.to_string()),
        ..SimConfig::default()
    })
    .await
    .expect("prefill sim");
    let join = |p: Vec<u16>| p.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
    let receiver = format!(
        "{}=127.0.0.1:{}:{}",
        decode.url(),
        join(decode.lmcache_init_ports()),
        join(decode.lmcache_alloc_ports())
    );
    let notify = notify.to_string();
    let proxy = Proxy::start(
        &prefill,
        &decode,
        &[
            "--connector",
            "lmcache",
            "--lmcache-notify",
            &notify,
            "--lmcache-receiver",
            &receiver,
        ],
    )
    .await;

    let answer = chat(&proxy, false).await;
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "{answer}\n{}",
        proxy.log()
    );
    assert!(answer.contains("x-disagg-handoff: kv"), "{answer}");
    assert!(
        answer.contains("\"object\":\"chat.completion\""),
        "{answer}"
    );
    let answer = chat(&proxy, true).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("chat.completion.chunk"), "{answer}");
    assert!(answer.contains("data: [DONE]"), "{answer}");
    // Both answers came from KV the prefill pushed and notified: the decode took it
    // twice and computed no prompt itself.
    let d = decode.stats();
    assert_eq!(
        (d.remote_decodes, d.local_prefills, d.kv_missing),
        (2, 0, 0),
        "{d:?}"
    );
    assert_eq!(
        prefill.stats().notifications_sent,
        4,
        "2 requests × 2 ranks"
    );
}

#[test]
fn a_decode_without_a_receiver_is_refused_at_start() {
    let out = Command::new(env!("CARGO_BIN_EXE_disagg-proxy"))
        .args([
            "serve",
            "--connector",
            "lmcache",
            "--lmcache-notify",
            "127.0.0.1:0",
            "--prefill",
            "http://127.0.0.1:1",
            "--decode",
            "http://127.0.0.1:2",
            "--listen",
            "127.0.0.1:0",
        ])
        .stdin(Stdio::null())
        .output()
        .expect("run disagg-proxy");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--lmcache-receiver http://127.0.0.1:2="),
        "{err}"
    );
}
