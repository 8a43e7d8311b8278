//! A path the service serves no route for is answered by the HTTP layer itself: 404
//! `not_found` in OpenAI's error shape, whether the route table orchestrates the path
//! (no API is served there) or answers it itself (`/v1/models/…` aside, nothing below a
//! proxy route). Over loopback: a `PdService` served by the crate's server.

#![allow(missing_docs)] // a test binary

use disagg_connectors::vllm::VllmNixl;
use disagg_core::{Endpoint, Orchestrator, Role, source::StaticSource};
use disagg_http::server::Builder;
use disagg_http::{HttpTransport, PdService, PdServiceConfig, RouteAction, RouteTable};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_no_route_serves_is_answered_404_not_found() {
    // No engine is asked: the addresses are never dialled.
    let source = StaticSource::new([
        Endpoint::new("http://127.0.0.1:9", Role::Prefill).unwrap(),
        Endpoint::new("http://127.0.0.1:9", Role::Decode).unwrap(),
    ]);
    let orchestrator =
        Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new()).build();
    let mut config = PdServiceConfig::default();
    config.routes = RouteTable::default()
        .set("/v1/other", RouteAction::Orchestrated)
        .set("/v1/answered", RouteAction::Proxy);
    let service = PdService::with_config(orchestrator, config);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Builder::new().serve(listener, service, std::future::pending()));

    for (method, path) in [("POST", "/v1/other"), ("GET", "/v1/answered")] {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             connection: close\r\ncontent-length: 2\r\n\r\n{{}}"
        );
        tcp.write_all(head.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        tcp.read_to_end(&mut got).await.unwrap();
        let text = String::from_utf8_lossy(&got).into_owned();
        assert!(text.starts_with("HTTP/1.1 404"), "{path}: {text}");
        let body = &text[text.find("\r\n\r\n").unwrap() + 4..];
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "not_found", "{path}: {body}");
        assert_eq!(
            v["error"]["type"], "invalid_request_error",
            "{path}: {body}"
        );
        assert_eq!(v["error"]["message"], "no such route", "{path}: {body}");
    }
}
