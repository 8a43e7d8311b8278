//! The floor proxy (`disagg-bench floor`), run as the bench runs it: a process of its
//! own that prints its address and serves until its stdin closes.

use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use disagg_sim::{SimConfig, SimEngine};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The names (`comm`) of every thread of `pid`.
fn thread_names(pid: u32) -> Result<Vec<String>, BoxError> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let comm = std::fs::read_to_string(entry?.path().join("comm"))?;
        names.push(comm.trim_end().to_owned());
    }
    names.sort();
    Ok(names)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_threads_are_two_event_loops_and_a_request_is_answered() -> Result<(), BoxError> {
    let engine = |id: &str| SimConfig {
        engine_id: Some(id.to_owned()),
        record_requests: 0,
        ..SimConfig::default()
    };
    let prefill = SimEngine::start(engine("prefill-0")).await?;
    let decode = SimEngine::start(engine("decode-0")).await?;

    let mut child = Command::new(env!("CARGO_BIN_EXE_disagg-bench"))
        .args([
            "floor",
            "--prefill",
            &prefill.url(),
            "--decode",
            &decode.url(),
        ])
        .args(["--threads", "2"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()?;
    let pid = child.id().ok_or("the floor has no pid")?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await??
        .ok_or("the floor exited before printing its address")?;
    let addr: std::net::SocketAddr = line.trim().parse()?;

    // Its address is printed once every event loop listens: each is a thread of its
    // own, and no work-stealing pool runs beside them.
    let names = thread_names(pid)?;
    let loops = names
        .iter()
        .filter(|n| {
            n.strip_prefix("floor-")
                .is_some_and(|i| !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()))
        })
        .count();
    assert_eq!(loops, 2, "threads: {names:?}");
    assert!(
        !names.iter().any(|n| n.starts_with("tokio-")),
        "threads: {names:?}"
    );

    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(connector);
    let body = serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "Why split prefill and decode?"}],
        "max_tokens": 4,
    });
    let req = http::Request::post(format!("http://{addr}/v1/chat/completions"))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))?;
    let resp = tokio::time::timeout(Duration::from_secs(20), client.request(req)).await??;
    let status = resp.status();
    let handoff = resp.headers().get("x-disagg-handoff").cloned();
    let answer = resp.into_body().collect().await?.to_bytes();
    assert_eq!(status, http::StatusCode::OK, "{answer:?}");
    assert_eq!(handoff.as_ref().map(|h| h.as_bytes()), Some(&b"kv"[..]));
    let answer: serde_json::Value = serde_json::from_slice(&answer)?;
    assert_eq!(answer["object"], "chat.completion", "{answer}");
    assert_eq!(decode.stats().remote_decodes, 1);

    // Closing its stdin ends it, cleanly.
    drop(child.stdin.take());
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait()).await??;
    assert!(status.success(), "{status}");
    prefill.shutdown().await;
    decode.shutdown().await;
    Ok(())
}
