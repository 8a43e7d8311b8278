//! Hostile request bodies over real sockets: each is answered 4xx in OpenAI's error
//! format (`{"error":{"message","type","code"}}`). Those the proxy's own parser rejects
//! never reach an engine; wrongly typed sampling fields, which the proxy passes on, come
//! back as the engine's 4xx.

#[path = "../support/mod.rs"]
mod support;

use support::*;

const DEPTH: usize = 100_000;

/// Bodies the proxy must reject itself, named for the failure messages.
fn rejected_bodies() -> Vec<(&'static str, Vec<u8>)> {
    let open = "[".repeat(DEPTH);
    let close = "]".repeat(DEPTH);
    let b = |s: &str| s.as_bytes().to_vec();
    vec![
        ("empty", b"".to_vec()),
        ("whitespace only", b(" \r\n\t ")),
        (
            "invalid UTF-8 in a value",
            b"{\"model\":\"sim-model\",\"prompt\":\"a\xffb\"}".to_vec(),
        ),
        (
            "overlong UTF-8",
            b"{\"model\":\"sim-model\",\"prompt\":\"\xc0\x80\"}".to_vec(),
        ),
        (
            "UTF-8 surrogate",
            b"{\"model\":\"sim-model\",\"prompt\":\"\xed\xa0\x80\"}".to_vec(),
        ),
        (
            "invalid UTF-8 in a key",
            b"{\"model\":\"sim-model\",\"pr\xffompt\":\"x\"}".to_vec(),
        ),
        (
            "lone surrogate key",
            b(r#"{"model":"sim-model","\ud800":1,"prompt":"x"}"#),
        ),
        (
            "lone surrogate model",
            b(r#"{"model":"\ud800","prompt":"x"}"#),
        ),
        ("100k open brackets", b(&open)),
        ("100k nested arrays", b(&format!("{open}{close}"))),
        (
            "100k open brackets in a value",
            b(&format!(r#"{{"model":"sim-model","prompt":{open}"#)),
        ),
        (
            "100k nested arrays as model",
            b(&format!(r#"{{"model":{open}{close}}}"#)),
        ),
        ("huge number top level", b("1e400")),
        ("big integer top level", b("123456789012345678901234567890")),
        ("string top level", b(r#""{\"model\":\"sim-model\"}""#)),
        ("null top level", b("null")),
        (
            "array top level",
            b(r#"[{"model":"sim-model","prompt":"x"}]"#),
        ),
        (
            "duplicate stream, last wrong",
            b(r#"{"model":"sim-model","prompt":"x","stream":true,"stream":"maybe"}"#),
        ),
        (
            "duplicate model, last wrong",
            b(r#"{"model":"sim-model","model":5,"prompt":"x"}"#),
        ),
        (
            "escaped stream key, wrong type",
            b(r#"{"model":"sim-model","prompt":"x","\u0073tream":"maybe"}"#),
        ),
        (
            "huge number stream",
            b(r#"{"model":"sim-model","prompt":"x","stream":1e400}"#),
        ),
        (
            "array stream",
            b(r#"{"model":"sim-model","prompt":"x","stream":[true]}"#),
        ),
        (
            "object model",
            b(r#"{"model":{"name":"sim-model"},"prompt":"x"}"#),
        ),
        (
            "byte order mark",
            b"\xef\xbb\xbf{\"model\":\"sim-model\",\"prompt\":\"x\"}".to_vec(),
        ),
        (
            "NUL after the object",
            b"{\"model\":\"sim-model\",\"prompt\":\"x\"}\0".to_vec(),
        ),
        ("two objects", b(r#"{"model":"sim-model","prompt":"x"}{}"#)),
        (
            "raw control character in a string",
            b("{\"model\":\"sim-model\",\"prompt\":\"a\u{1}b\"}"),
        ),
        ("bad escape", b(r#"{"model":"sim-model","prompt":"\x41"}"#)),
        (
            "truncated unicode escape",
            b(r#"{"model":"sim-model","prompt":"\u12"}"#),
        ),
        (
            "trailing comma",
            b(r#"{"model":"sim-model","prompt":"x",}"#),
        ),
        ("single quotes", b("{'model':'sim-model'}")),
        (
            "NaN",
            b(r#"{"model":"sim-model","prompt":"x","temperature":NaN}"#),
        ),
    ]
}

#[tokio::test]
async fn bodies_the_parser_rejects_are_400_and_reach_no_engine() {
    let stack = Stack::start().await;
    for path in ["/v1/completions", "/v1/chat/completions"] {
        for (name, body) in rejected_bodies() {
            let a = post(&stack.url, path, body, &[]).await;
            assert!(a.status.is_client_error(), "{name} on {path}: {}", a.status);
            assert_openai_error(&a, 400, "invalid_request_body");
        }
    }
    assert_eq!(
        stack.p().stats().requests,
        0,
        "a rejected body reached the prefill"
    );
    assert_eq!(
        stack.d().stats().requests,
        0,
        "a rejected body reached the decode"
    );
}

/// Fields the proxy rewrites on the prefill leg, with values the engines refuse: the
/// prefill engine never sees the client's value, so the proxy refuses them itself, as
/// vLLM would, before any engine is contacted, naming the field in `param`.
#[tokio::test]
async fn rewritten_fields_the_engine_would_refuse_are_400_before_any_engine() {
    let stack = Stack::start().await;
    let chat = |extra: &str| {
        format!(r#"{{"model":"sim-model","messages":[{{"role":"user","content":"x"}}],{extra}}}"#)
    };
    let cmpl = |extra: &str| format!(r#"{{"model":"sim-model","prompt":"x",{extra}}}"#);
    let cases = [
        (
            "/v1/chat/completions",
            chat(r#""max_tokens":"many""#),
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            chat(r#""max_completion_tokens":-1"#),
            "max_completion_tokens",
        ),
        (
            "/v1/completions",
            cmpl(r#""max_tokens":1e400"#),
            "max_tokens",
        ),
        ("/v1/completions", cmpl(r#""n":"two""#), "n"),
        (
            "/v1/completions",
            cmpl(r#""stream":true,"stream_options":5"#),
            "stream_options",
        ),
    ];
    for (path, body, param) in cases {
        let a = post(&stack.url, path, body.clone(), &[]).await;
        assert_openai_error(&a, 400, "invalid_parameter");
        assert_eq!(a.json()["error"]["param"], param, "{body}");
    }
    assert_eq!(
        stack.p().stats().requests,
        0,
        "a refused body reached the prefill"
    );
    assert_eq!(
        stack.d().stats().requests,
        0,
        "a refused body reached the decode"
    );
}

/// Fields the proxy does not read, wrongly typed: the proxy passes them on (the engine
/// owns their validation) and the engine's 4xx reaches the client, still in OpenAI's
/// format.
#[tokio::test]
async fn wrongly_typed_fields_the_engine_rejects_stay_4xx() {
    let stack = Stack::start().await;
    let cases = [
        ("/v1/completions", r#"{"model":"sim-model","prompt":5}"#),
        (
            "/v1/completions",
            r#"{"model":"sim-model","prompt":{"text":"x"}}"#,
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"sim-model","messages":"hi"}"#,
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"sim-model","messages":[1,2]}"#,
        ),
    ];
    let engine_requests = || stack.p().stats().requests + stack.d().stats().requests;
    for (path, body) in cases {
        let before = engine_requests();
        let a = post(&stack.url, path, body.to_owned(), &[]).await;
        assert!(engine_requests() > before, "{body}: no engine was asked");
        assert!(
            a.status.is_client_error(),
            "{body} on {path}: {} {}",
            a.status,
            a.text()
        );
        let v = a.json();
        let e = &v["error"];
        assert!(
            e["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{body}: {v}"
        );
        assert!(e["type"].is_string(), "{body}: {v}");
        assert!(!e["code"].is_null(), "{body}: {v}");
    }
}
