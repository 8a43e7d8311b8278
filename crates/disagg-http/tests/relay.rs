//! Engine answers whose headers cannot be relayed as they are: a `Connection` header
//! naming a `content-*` header (stripping it would change what the body is, or what the
//! proxy decided from it), and more than one `content-encoding` or `content-type`
//! header. Each is answered 502 in OpenAI's format on every route the engine's answer
//! goes through (forwarded, direct, orchestrated), never relayed with the engine's KV
//! handoff in it or with its encoding lost. Over loopback: a `PdService` served by the
//! crate's server, a raw engine behind.

#![allow(missing_docs)] // a test binary

use std::net::SocketAddr;

use disagg_connectors::vllm::VllmNixl;
use disagg_core::{Endpoint, Orchestrator, Role, source::StaticSource};
use disagg_http::server::Builder;
use disagg_http::{HttpTransport, PdService};
use disagg_sim::{SimConfig, SimEngine};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

mod common;
use common::read_message;

/// An internal address in the engine's handoff, which no client may see.
const INTERNAL: &str = "10.0.0.7";

/// A JSON answer holding the engine's handoff.
fn handoff_json() -> String {
    format!(
        r#"{{"id":"cmpl-1","object":"text_completion","choices":[{{"index":0,"text":" ok","finish_reason":"length"}}],"kv_transfer_params":{{"remote_host":"{INTERNAL}","remote_port":5601}}}}"#
    )
}

/// The answer (head lines after the status line, body) for a request whose body names
/// `variant`.
fn answer(request: &str) -> (String, String) {
    let json = handoff_json();
    let variant = [
        "plain",
        "hides-type",
        "hides-encoding",
        "two-encodings",
        "two-types",
    ]
    .into_iter()
    .find(|v| request.contains(&format!("variant-{v}")))
    .unwrap_or("plain");
    let head = match variant {
        // The control: relayed, its handoff blanked.
        "plain" => "content-type: application/json\r\n",
        // The body's type, named as one hop's: stripped, the answer would go unread.
        "hides-type" => "content-type: application/json\r\nconnection: content-type\r\n",
        // The encoding the client accepted, stripped after it was approved.
        "hides-encoding" => {
            "content-type: audio/wav\r\ncontent-encoding: gzip\r\nconnection: content-encoding\r\n"
        }
        // `identity` first, `gzip` second: a check of the first approves it.
        "two-encodings" => {
            "content-type: application/json\r\ncontent-encoding: identity\r\ncontent-encoding: gzip\r\n"
        }
        // Not JSON by the first, JSON by the second.
        _ => "content-type: text/plain\r\ncontent-type: application/json\r\n",
    };
    (head.to_owned(), json)
}

/// A raw engine: reads each request whole and answers it as [`answer`] says, on a
/// kept-alive connection (as the engines' servers do: one that closed after each answer
/// without saying so would race the proxy's pool, which may send the next request on
/// it before it sees the close).
async fn raw_engine() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                while let Some(request) = read_message(&mut s).await {
                    let (head, body) = answer(&String::from_utf8_lossy(&request));
                    let out = format!(
                        "HTTP/1.1 200 OK\r\n{head}content-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if s.write_all(out.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// A proxy with a simulated prefill and the raw engine as its decode.
async fn proxy(p: &SimEngine, decode: SocketAddr) -> SocketAddr {
    let source = StaticSource::new([
        Endpoint::new(&p.url(), Role::Prefill).unwrap(),
        Endpoint::new(&format!("http://{decode}"), Role::Decode).unwrap(),
    ]);
    let orchestrator =
        Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new()).build();
    let service = PdService::new(orchestrator);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Builder::new().serve(listener, service, std::future::pending()));
    addr
}

/// `POST path` with a body naming `variant`, accepting gzip; the status and the
/// answer as text.
async fn post(addr: SocketAddr, path: &str, variant: &str) -> (u16, String) {
    let body = serde_json::json!({
        "model": "sim-model", "prompt": format!("variant-{variant}"), "max_tokens": 2,
    })
    .to_string();
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         accept-encoding: gzip\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    tcp.read_to_end(&mut got).await.unwrap();
    let text = String::from_utf8_lossy(&got).into_owned();
    let status = text
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status: {text}"));
    (status, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_whose_headers_hide_what_they_are_are_not_relayed_on_any_route() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let addr = proxy(&p, raw_engine().await).await;
    // Forwarded (vLLM's `/score`), direct (`/v1/audio/translations`), orchestrated.
    for path in ["/score", "/v1/audio/translations", "/v1/completions"] {
        let (status, text) = post(addr, path, "plain").await;
        assert_eq!(status, 200, "{path}: {text}");
        assert!(!text.contains(INTERNAL), "{path}: {text}");
        assert!(
            text.contains("\"kv_transfer_params\":null"),
            "{path}: {text}"
        );
        for variant in ["hides-type", "hides-encoding", "two-encodings", "two-types"] {
            let (status, text) = post(addr, path, variant).await;
            assert_eq!(status, 502, "{path} {variant}: {text}");
            assert!(!text.contains(INTERNAL), "{path} {variant}: {text}");
            let body = &text[text.find("\r\n\r\n").unwrap() + 4..];
            let v: serde_json::Value = serde_json::from_str(body)
                .unwrap_or_else(|e| panic!("{path} {variant}: {e}: {body}"));
            assert_eq!(
                v["error"]["type"], "server_error",
                "{path} {variant}: {body}"
            );
            assert_eq!(
                v["error"]["code"], "decode_failed",
                "{path} {variant}: {body}"
            );
            assert!(
                v["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("unusable")
                        || m.contains("not relayed")
                        || m.contains("header")),
                "{path} {variant}: {body}"
            );
        }
    }
}
