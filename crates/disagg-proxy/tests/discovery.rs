//! `disagg-proxy serve` with discovery flags: the real binary finds its engines in an
//! endpoints file only (no `--prefill`, no `--decode`), follows edits while serving,
//! keeps its set on an invalid edit, leaves out an engine that cannot pair instead of
//! stopping, and shows the set per source in `/metrics`. (The Kubernetes and DNS
//! sources behind the other flags are tested in `disagg-discovery`, against an API
//! server that speaks the watch protocol and a real dnsmasq.)

#![allow(missing_docs)] // a test binary

use std::time::Duration;

use disagg_sim::{SimConfig, SimEngine};

mod common;
use common::{Proxy, completion, eventually, get, post};

const COMPLETIONS: &str = "/v1/completions";

async fn engine() -> SimEngine {
    SimEngine::start(SimConfig::default())
        .await
        .expect("start a simulated engine")
}

fn file_with(prefill: &SimEngine, decode: &[&SimEngine], extra: &str) -> String {
    let mut s = format!("[[prefill]]\nurl = \"{}\"\n", prefill.url());
    for d in decode {
        s.push_str(&format!("\n[[decode]]\nurl = \"{}\"\n", d.url()));
    }
    s.push_str(extra);
    s
}

/// Write `text` to `path` the way editors and ConfigMaps do: a new file renamed over.
fn replace(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test]
async fn the_proxy_routes_over_an_endpoints_file_and_follows_its_edits() {
    let (p, d1, d2) = (engine().await, engine().await, engine().await);
    let dir = std::env::temp_dir().join(format!("disagg-discovery-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("endpoints.toml");
    replace(&path, &file_with(&p, &[&d1], ""));
    let proxy =
        Proxy::start_args(&["--endpoints-file".to_owned(), path.display().to_string()]).await;

    let a = post(&proxy.url(), COMPLETIONS, &completion("one", 3, false)).await;
    assert_eq!(a.status, 200, "{}\n{}", a.text(), proxy.log());
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
    assert_eq!((p.stats().requests, d1.stats().requests), (1, 1));

    // d2 replaces d1: within the reload interval, requests go to d2 only.
    replace(&path, &file_with(&p, &[&d2], ""));
    let mut served_by_d2 = false;
    for _ in 0..100 {
        let a = post(&proxy.url(), COMPLETIONS, &completion("two", 3, false)).await;
        assert_eq!(a.status, 200, "{}\n{}", a.text(), proxy.log());
        if d2.stats().requests > 0 {
            served_by_d2 = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(served_by_d2, "d2 never got a request: {}", proxy.log());
    let before = d1.stats().requests;
    for _ in 0..4 {
        let a = post(&proxy.url(), COMPLETIONS, &completion("three", 3, false)).await;
        assert_eq!(a.status, 200);
    }
    assert_eq!(d1.stats().requests, before, "d1 left the set");

    // An invalid edit keeps the set in force, and is counted.
    replace(&path, "[[decode]\nurl = ");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let a = post(&proxy.url(), COMPLETIONS, &completion("four", 3, false)).await;
    assert_eq!(a.status, 200, "{}", proxy.log());
    let metrics = get(&proxy.url(), "/metrics").await.text();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("disagg_discovery_endpoints{")
                && l.contains("decode")
                && l.ends_with(" 1")),
        "{metrics}"
    );
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("disagg_discovery_errors_total") && !l.ends_with(" 0")),
        "{metrics}"
    );

    // A decode declaring another KV connector cannot pair with the prefill: it is left
    // out, logged, and the proxy goes on serving with the rest.
    let d3 = engine().await;
    let bad = format!(
        "\n[[decode]]\nurl = \"{}\"\nkv_profile = \"MooncakeConnector,,\"\n",
        d3.url()
    );
    replace(&path, &file_with(&p, &[&d2], &bad));
    let logged = eventually(Duration::from_secs(5), || proxy.log().contains("left out")).await;
    assert!(logged, "{}", proxy.log());
    for _ in 0..6 {
        let a = post(&proxy.url(), COMPLETIONS, &completion("five", 3, false)).await;
        assert_eq!(a.status, 200, "{}", proxy.log());
    }
    assert_eq!(
        d3.stats().requests,
        0,
        "the engine that cannot pair got nothing"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn without_a_decode_engine_or_a_source_that_can_find_one_the_proxy_refuses_to_start() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_disagg-proxy"))
        .args(["serve", "--prefill", "http://127.0.0.1:1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no decode engine"), "{err}");
}
