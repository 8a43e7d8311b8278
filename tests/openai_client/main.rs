//! The proxy driven by the real `openai` Python client, streaming and not.
//!
//! Needs a Python with the `openai` package: `$DISAGG_PYTHON`, else `.venv/bin/python`
//! at the repository root (`scripts/test.sh` creates it).

#[path = "../support/mod.rs"]
mod support;

use std::path::PathBuf;
use std::process::Command;

use disagg_sim::{Faults, SimConfig};
use support::*;

fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("DISAGG_PYTHON") {
        return PathBuf::from(p);
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    assert!(
        venv.exists(),
        "no Python with the `openai` package: run `scripts/test.sh` (it creates .venv), or set DISAGG_PYTHON"
    );
    venv
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_client_against_the_proxy() {
    let stack = Stack::start().await;
    let broken = Stack::builder()
        .decode(vec![SimConfig {
            faults: Faults {
                drop_after_chunks: Some(3),
                ..Default::default()
            },
            ..Default::default()
        }])
        .build()
        .await;

    // What a direct, non-disaggregated run gives, from the decode engine itself.
    let chat_body = serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "tell me about disaggregated serving"}],
        "max_tokens": 8,
    });
    let chat = post(
        &stack.d().url(),
        "/v1/chat/completions",
        chat_body.to_string(),
        &[],
    )
    .await
    .content();
    let completion_body = completion("the prefill engine computes", 6, false);
    let completion = post(&stack.d().url(), "/v1/completions", completion_body, &[])
        .await
        .content();
    let expect = serde_json::json!({"chat": chat, "completion": completion}).to_string();
    let remote_before = stack.d().stats().remote_decodes;

    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/openai_client.py");
    let (url, broken_url) = (stack.url.clone(), broken.url.clone());
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python())
            .arg(script)
            .arg(url)
            .arg(broken_url)
            .arg(expect)
            .output()
    })
    .await
    .unwrap()
    .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "python failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("openai client: 7 checks passed"),
        "{stdout}"
    );
    // Four disaggregated generations: each pulled its KV over the side channel.
    assert_eq!(stack.d().stats().remote_decodes - remote_before, 4);
    assert_eq!(stack.p().stats().side_channel_served, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_client_lists_and_retrieves_models_through_the_proxy() {
    let stack = Stack::start().await;
    // A loaded LoRA adapter is a card of its own, with `parent` set.
    let load = serde_json::json!({"lora_name": "sql", "lora_path": "/adapters/sql"});
    let loaded = post(
        &stack.d().url(),
        "/v1/load_lora_adapter",
        load.to_string(),
        &[],
    )
    .await;
    assert_eq!(loaded.status, 200, "{}", loaded.text());
    let own = get(&stack.d().url(), "/v1/models").await.text();

    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/models.py");
    let url = stack.url.clone();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python())
            .arg(script)
            .arg(url)
            .arg(own)
            .output()
    })
    .await
    .unwrap()
    .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "python failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("openai models: 3 checks passed"),
        "{stdout}"
    );
}
