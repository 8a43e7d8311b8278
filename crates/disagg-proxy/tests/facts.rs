//! Endpoint facts (`disagg_core::endpoint::Facts`) with the real `disagg-proxy serve`
//! binary over loopback: a bootstrap port given on the command line or found in an
//! endpoints file (as `bootstrap_port` or in its `facts` table) reaches the SGLang and
//! vLLM Mooncake connectors, which read it from the endpoint's facts; a malformed or
//! oversized fact stops the proxy at start with an error naming it.

#![allow(missing_docs)] // a test binary

use std::process::{Command, Stdio};
use std::time::Duration;

use disagg_sim::{KvMode, SimConfig, SimEngine, SimRole};

mod common;
use common::{Proxy, completion, post};

const COMPLETIONS: &str = "/v1/completions";

async fn engine(kv_mode: KvMode) -> SimEngine {
    SimEngine::start(SimConfig {
        kv_mode,
        bootstrap_timeout: Duration::from_secs(5),
        ..SimConfig::default()
    })
    .await
    .expect("start a simulated engine")
}

/// A directory of this test's own, for an endpoints file.
fn endpoints_file(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("disagg-facts-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("endpoints.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// `serve ARGS`, expected to stop at start-up: its stderr.
fn refused_at_start(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_disagg-proxy"))
        .arg("serve")
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run disagg-proxy");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "started: {err}");
    err
}

/// One request through a proxy whose engines and bootstrap port come from an endpoints
/// file with `prefill_line` in the prefill's entry: answered with a KV handoff.
async fn served_from_a_file(connector: &str, prefill: SimRole, decode: SimRole, line: &str) {
    let mode = |role| match connector {
        "sglang" => KvMode::Sglang(role),
        _ => KvMode::Mooncake(role),
    };
    let (p, d) = (engine(mode(prefill)).await, engine(mode(decode)).await);
    let port = p.bootstrap_addr().expect("a bootstrap server").port();
    let line = line.replace("PORT", &port.to_string());
    let text = format!(
        "[[prefill]]\nurl = \"{}\"\n{line}\n\n[[decode]]\nurl = \"{}\"\n",
        p.url(),
        d.url()
    );
    let path = endpoints_file(&format!("{connector}-{}", line.len()), &text);
    let proxy = Proxy::start_args(&[
        "--connector".to_owned(),
        connector.to_owned(),
        "--endpoints-file".to_owned(),
        path.display().to_string(),
    ])
    .await;
    let a = post(&proxy.url(), COMPLETIONS, &completion("hi", 3, false)).await;
    assert_eq!(
        a.status,
        200,
        "{connector} {line}: {}\n{}",
        a.text(),
        proxy.log()
    );
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"), "{}", a.text());
    assert_eq!((p.stats().requests, d.stats().requests), (1, 1));
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[tokio::test]
async fn sglang_reads_a_discovered_bootstrap_port_from_the_facts() {
    served_from_a_file(
        "sglang",
        SimRole::Prefill,
        SimRole::Decode,
        "bootstrap_port = PORT",
    )
    .await;
    served_from_a_file(
        "sglang",
        SimRole::Prefill,
        SimRole::Decode,
        "facts = { bootstrap_port = \"PORT\" }",
    )
    .await;
}

#[tokio::test]
async fn mooncake_reads_a_discovered_bootstrap_port_from_the_facts() {
    served_from_a_file(
        "mooncake",
        SimRole::Prefill,
        SimRole::Decode,
        "bootstrap_port = PORT",
    )
    .await;
}

#[test]
fn a_malformed_bootstrap_port_is_refused_at_start_from_the_command_line_and_a_file() {
    let err = refused_at_start(&[
        "--connector",
        "sglang",
        "--prefill",
        "http://127.0.0.1:1",
        "89x",
        "--decode",
        "http://127.0.0.1:2",
    ]);
    assert!(
        err.contains("--prefill http://127.0.0.1:1 89x: the bootstrap port must be a port number"),
        "{err}"
    );
    for (name, line, needle) in [
        ("typed", "bootstrap_port = 70000", "bootstrap_port"),
        (
            "fact",
            "facts = { bootstrap_port = \"89x\" }",
            "fact `bootstrap_port` is not a port number",
        ),
    ] {
        let path = endpoints_file(
            name,
            &format!(
                "[[prefill]]\nurl = \"http://127.0.0.1:1\"\n{line}\n\n[[decode]]\nurl = \"http://127.0.0.1:2\"\n"
            ),
        );
        let err = refused_at_start(&[
            "--connector",
            "sglang",
            "--endpoints-file",
            &path.display().to_string(),
        ]);
        assert!(err.contains(needle), "{line}: {err}");
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }
}

#[test]
fn an_oversized_fact_in_an_endpoints_file_is_refused_at_start() {
    let long = "x".repeat(4097);
    let path = endpoints_file(
        "oversized",
        &format!(
            "[[prefill]]\nurl = \"http://127.0.0.1:1\"\nfacts = {{ note = \"{long}\" }}\n\n[[decode]]\nurl = \"http://127.0.0.1:2\"\n"
        ),
    );
    let err = refused_at_start(&["--endpoints-file", &path.display().to_string()]);
    assert!(err.contains("fact `note`"), "{err}");
    assert!(err.contains("longer than the 4096 allowed"), "{err}");
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}
