//! A direct route's `multipart/form-data` body (vLLM's audio transcriptions take their
//! model as a form field) picks its engine by its `model` field, as a JSON body's
//! `model` does: in a fleet of several models, the form naming one reaches an engine
//! of that model only. The field is read from the parts' own headers (never from a
//! file's bytes after it that look like them), the last of repeated fields wins (as the
//! engines' form parser takes it), one past the ceiling is refused 400, and a form
//! naming no model or an unknown one is answered as a JSON body would be (generation
//! naming none in a fleet of several models is refused `model_required`, as an
//! orchestrated request is). Over
//! loopback: a `PdService` served by the crate's server, raw engines behind.

#![allow(missing_docs)] // a test binary

mod common;

use common::read_path;
use std::net::SocketAddr;

use disagg_connectors::vllm::VllmNixl;
use disagg_core::{Endpoint, Orchestrator, Role, source::StaticSource};
use disagg_http::server::Builder;
use disagg_http::{HttpTransport, PdService};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

const ROUTE: &str = "/v1/audio/transcriptions";

/// A raw engine answering every request 200 with a JSON body: its URL, and a channel
/// that gets each request's path before it is answered.
async fn raw_engine() -> (String, mpsc::UnboundedReceiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (seen, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                while let Some(path) = read_path(&mut s).await {
                    let _ = seen.send(path);
                    let body = r#"{"text":"hello"}"#;
                    let out = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                         content-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if s.write_all(out.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (url, rx)
}

/// A proxy over a decode engine serving `whisper` and one serving `llama`.
async fn proxy(whisper: &str, llama: &str) -> SocketAddr {
    let source = StaticSource::new([
        Endpoint::new(whisper, Role::Decode)
            .unwrap()
            .with_models(["whisper"]),
        Endpoint::new(llama, Role::Decode)
            .unwrap()
            .with_models(["llama"]),
    ]);
    let orchestrator =
        Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new()).build();
    let service = PdService::new(orchestrator);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Builder::new().serve(listener, service, std::future::pending()));
    addr
}

/// A form with `boundary` of `parts`, each its `content-disposition` and its bytes.
fn form(boundary: &str, parts: &[(&str, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (disposition, data) in parts {
        out.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
        out.extend_from_slice(format!("Content-Disposition: {disposition}\r\n").as_bytes());
        if disposition.contains("filename") {
            out.extend_from_slice(b"Content-Type: audio/wav\r\n");
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(data);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    out
}

/// `POST` [`ROUTE`] with `body` of `content_type`: the status and the answer's body.
async fn post(addr: SocketAddr, content_type: &str, body: &[u8]) -> (u16, Value) {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {ROUTE} HTTP/1.1\r\nhost: x\r\ncontent-type: {content_type}\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    tcp.write_all(&[head.as_bytes(), body].concat())
        .await
        .unwrap();
    let mut got = Vec::new();
    tcp.read_to_end(&mut got).await.unwrap();
    let text = String::from_utf8_lossy(&got).into_owned();
    let status = text
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status: {text}"));
    let body = &text[text.find("\r\n\r\n").unwrap() + 4..];
    let json = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {text}"));
    (status, json)
}

/// Audio bytes holding what looks like a part's head naming `model`, and a line break
/// and dashes that are no delimiter.
fn audio(model: &str) -> Vec<u8> {
    let fake = format!("Content-Disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n");
    [&b"RIFF\0\0\xff\r\n--\r\n"[..], fake.as_bytes()].concat()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forms_model_field_picks_its_engine() {
    let (whisper, mut whisper_asked) = raw_engine().await;
    let (llama, mut llama_asked) = raw_engine().await;
    let addr = proxy(&whisper, &llama).await;
    let boundary = "----formboundary7MA4YWxk";
    let multipart = format!("multipart/form-data; boundary={boundary}");
    // The model, then a file whose bytes look like a later `model` field naming
    // llama: whisper's engine every time (equally idle engines would otherwise take
    // turns; a scan of the file's bytes would pick llama's).
    let llama_audio = audio("llama");
    let body = form(
        boundary,
        &[
            (r#"form-data; name="model""#, b"whisper"),
            (r#"form-data; name="file"; filename="a.wav""#, &llama_audio),
            (r#"form-data; name="language""#, b"en"),
        ],
    );
    for _ in 0..4 {
        let (status, answer) = post(addr, &multipart, &body).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(whisper_asked.try_recv().ok().as_deref(), Some(ROUTE));
        assert!(llama_asked.try_recv().is_err(), "llama's engine was asked");
    }
    // A quoted boundary, an unquoted name, a header name in another case; the last of
    // two `model` fields wins, as the engines' form parser (Starlette's) takes it, and
    // a file after it whose bytes look like a field naming whisper names nothing.
    let whisper_audio = audio("whisper");
    let body = form(
        "b-2",
        &[
            ("form-data; name=model", b"whisper"),
            ("FORM-DATA; NAME=model", b"llama"),
            (
                "form-data; name=\"file\"; filename=\"model\"",
                &whisper_audio,
            ),
        ],
    );
    let body = String::from_utf8_lossy(&body).replace("Content-Disposition", "content-disposition");
    for _ in 0..2 {
        let (status, answer) = post(
            addr,
            r#"multipart/form-data; charset=utf-8; boundary="b-2""#,
            body.as_bytes(),
        )
        .await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(llama_asked.try_recv().ok().as_deref(), Some(ROUTE));
        assert!(
            whisper_asked.try_recv().is_err(),
            "whisper's engine was asked"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_form_naming_an_unknown_model_none_or_too_long_a_one_is_answered_as_json_is() {
    let (whisper, _w) = raw_engine().await;
    let (llama, _l) = raw_engine().await;
    let addr = proxy(&whisper, &llama).await;
    let multipart = "multipart/form-data; boundary=xyz";
    // Unknown: the JSON body's answer.
    let json = post(addr, "application/json", br#"{"model":"gpt"}"#).await;
    assert_ne!(json.0, 200, "{}", json.1);
    let body = form("xyz", &[(r#"form-data; name="model""#, b"gpt")]);
    let (status, answer) = post(addr, multipart, &body).await;
    assert_eq!(
        (status, &answer["error"]["code"]),
        (json.0, &json.1["error"]["code"])
    );
    // None: as a JSON body naming none.
    let json = post(addr, "application/json", br#"{"language":"en"}"#).await;
    let body = form("xyz", &[(r#"form-data; name="language""#, b"en")]);
    let (status, answer) = post(addr, multipart, &body).await;
    assert_eq!(status, json.0, "{answer} {}", json.1);
    // Past the ceiling (512 bytes, as discovery's model names): refused, not routed
    // as if it named none.
    let long = "m".repeat(513);
    let body = form("xyz", &[(r#"form-data; name="model""#, long.as_bytes())]);
    let (status, answer) = post(addr, multipart, &body).await;
    assert_eq!(status, 400, "{answer}");
    assert_eq!(answer["error"]["code"], "invalid_request_body", "{answer}");
    let at_ceiling = "m".repeat(512);
    let body = form(
        "xyz",
        &[(r#"form-data; name="model""#, at_ceiling.as_bytes())],
    );
    let (status, answer) = post(addr, multipart, &body).await;
    assert_eq!(status, json_unknown_status(addr).await, "{answer}");
}

/// The status of a JSON body naming a model no engine serves.
async fn json_unknown_status(addr: SocketAddr) -> u16 {
    post(addr, "application/json", br#"{"model":"unknown"}"#)
        .await
        .0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_generation_naming_no_model_in_a_fleet_of_several_is_refused_as_orchestrated() {
    let (whisper, mut whisper_asked) = raw_engine().await;
    let (llama, mut llama_asked) = raw_engine().await;
    let addr = proxy(&whisper, &llama).await;
    // An orchestrated request naming no model: 400 `model_required`.
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let chat = r#"{"messages":[{"role":"user","content":"hi"}]}"#;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{chat}",
        chat.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    tcp.read_to_end(&mut got).await.unwrap();
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 400"), "{text}");
    assert!(text.contains(r#""code":"model_required""#), "{text}");
    // Generation sent direct naming none, as JSON and as a form: the same answer, and
    // neither engine asked (each would take turns with the other's model otherwise).
    let form_body = form("xyz", &[(r#"form-data; name="language""#, b"en")]);
    let bodies: [(&str, &[u8]); 2] = [
        ("application/json", br#"{"language":"en"}"#),
        ("multipart/form-data; boundary=xyz", &form_body),
    ];
    for (content_type, body) in bodies {
        for _ in 0..2 {
            let (status, answer) = post(addr, content_type, body).await;
            assert_eq!(status, 400, "{content_type}: {answer}");
            assert_eq!(answer["error"]["code"], "model_required", "{answer}");
        }
    }
    assert!(
        whisper_asked.try_recv().is_err(),
        "whisper's engine was asked"
    );
    assert!(llama_asked.try_recv().is_err(), "llama's engine was asked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_generation_naming_no_model_goes_to_the_one_model_served() {
    let (whisper, mut whisper_asked) = raw_engine().await;
    let (other, mut other_asked) = raw_engine().await;
    // One engine serves whisper, the other declares no model (it serves any).
    let source = StaticSource::new([
        Endpoint::new(&whisper, Role::Decode)
            .unwrap()
            .with_models(["whisper"]),
        Endpoint::new(&other, Role::Decode).unwrap(),
    ]);
    let orchestrator =
        Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new()).build();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = PdService::new(orchestrator);
    tokio::spawn(Builder::new().serve(listener, service, std::future::pending()));
    let mut asked = 0;
    for _ in 0..4 {
        let (status, answer) = post(addr, "application/json", br#"{"language":"en"}"#).await;
        assert_eq!(status, 200, "{answer}");
        asked += usize::from(whisper_asked.try_recv().is_ok());
        asked += usize::from(other_asked.try_recv().is_ok());
    }
    // Both serve the one model: they take turns, as for a request naming it.
    assert_eq!(asked, 4);
}
