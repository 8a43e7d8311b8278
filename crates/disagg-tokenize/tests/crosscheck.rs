//! `HfTokenizer` against Hugging Face's Python stack (`tokenizers` + `jinja2`, and
//! `transformers` when installed) on the same model directory and prompts:
//! `scripts/tokenize_crosscheck.py` computes the ids there, this test here.
//!
//! Python: `$DISAGG_PYTHON`, else the workspace's `.venv/bin/python` (which
//! `scripts/test.sh` creates with both packages), else `python3`. With no Python at all
//! the test says so and skips; a Python without the packages fails it, with the fix.

mod fixture;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use disagg_core::{json::JsonBody, request::Api};
use disagg_tokenize::{HfTokenizer, Tokenize};
use serde_json::{Value, json};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn python() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("DISAGG_PYTHON").map(PathBuf::from),
        Some(workspace().join(".venv/bin/python")),
        Some(PathBuf::from("python3")),
    ];
    candidates.into_iter().flatten().find(|p| {
        Command::new(p)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// The prompts compared: text with and without special tokens, chat with the
/// generation prompt on and off, a template argument, tools.
fn cases() -> Vec<Value> {
    let chat = json!([
        {"role": "system", "content": "  You are a terse assistant.\n"},
        {"role": "user", "content": "What's the weather in Paris, Tokyo and São Paulo? I'm asking for 3 cities!"},
        {"role": "assistant", "content": "Sunny, 21°C; rain; 30 degrees."},
        {"role": "user", "content": "And tomorrow?\n\n  Thanks."},
    ]);
    let tools = json!([{
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city — «today» or later",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]},
        },
    }]);
    vec![
        json!({"kind": "text", "text": "Hello world", "add_special_tokens": true}),
        json!({"kind": "text", "text": "They'll say it's 12345678 naïve cafés\n\n\n   über   ", "add_special_tokens": true}),
        json!({"kind": "text", "text": "text with <|eot_id|> inside <|start_header_id|>", "add_special_tokens": false}),
        json!({"kind": "text", "text": fixture::text(8 * 1024, 3), "add_special_tokens": true}),
        json!({"kind": "chat", "messages": chat, "add_generation_prompt": true}),
        json!({"kind": "chat", "messages": chat, "add_generation_prompt": false}),
        json!({"kind": "chat", "messages": chat, "add_generation_prompt": true, "kwargs": {"enable_thinking": true}}),
        json!({"kind": "chat", "messages": chat, "add_generation_prompt": true, "tools": tools}),
    ]
}

/// The request body a case stands for.
fn request(case: &Value) -> (Api, String) {
    if case["kind"] == "text" {
        let body =
            json!({"prompt": case["text"], "add_special_tokens": case["add_special_tokens"]});
        return (Api::Completions, body.to_string());
    }
    let mut body = json!({
        "messages": case["messages"],
        "add_generation_prompt": case["add_generation_prompt"],
    });
    if let Some(tools) = case.get("tools") {
        body["tools"] = tools.clone();
    }
    if let Some(kwargs) = case.get("kwargs") {
        body["chat_template_kwargs"] = kwargs.clone();
    }
    (Api::Chat, body.to_string())
}

#[tokio::test]
async fn ids_match_python_tokenizers_and_jinja2() {
    let Some(python) = python() else {
        // Under CI a missing Python fails: a green run must mean the cross-check ran.
        assert!(
            std::env::var_os("CI").is_none_or(|v| v != "true"),
            "CI=true but no Python found ($DISAGG_PYTHON, .venv/bin/python, python3): \
             run scripts/test.sh, which creates .venv"
        );
        println!("skipped: no Python found ($DISAGG_PYTHON, .venv/bin/python, python3)");
        return;
    };
    let probe = Command::new(&python)
        .args(["-c", "import tokenizers, jinja2"])
        .status()
        .unwrap();
    assert!(
        probe.success(),
        "{} lacks the `tokenizers` or `jinja2` package: run scripts/test.sh (it installs them \
         into .venv), or `pip install tokenizers jinja2`, or set DISAGG_PYTHON",
        python.display()
    );

    let dir = fixture::temp_dir("crosscheck");
    fixture::write_model(&dir, &fixture::tokenizer(1200), Some(fixture::TEMPLATE));
    let cases = cases();
    let mut child = Command::new(&python)
        .arg(workspace().join("scripts/tokenize_crosscheck.py"))
        .arg(&*dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    serde_json::to_writer(child.stdin.take().unwrap(), &cases).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the Python side failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let expected: Vec<Vec<u32>> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(expected.len(), cases.len());

    let tokenizer = HfTokenizer::from_dir(&dir).unwrap();
    for (case, want) in cases.iter().zip(expected) {
        let (api, body) = request(case);
        let got = tokenizer
            .tokenize(api, &JsonBody::parse(body.as_bytes()).unwrap())
            .await
            .unwrap();
        assert!(!want.is_empty());
        assert_eq!(&*got, &want[..], "case {case}");
    }
}
