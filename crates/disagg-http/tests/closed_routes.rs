//! A closed route is answered 403 `admin_route_closed` (type `permission_error`) with a
//! message that gives the remedy that works: `--admin-routes` for an admin route, which
//! it opens; none for a path below the engines' metrics mount (`/metrics/`,
//! `/metricsx`), which no flag opens, and whose message points at the proxy's own
//! `GET /metrics`. Over loopback: a `PdService` served by the crate's server.

#![allow(missing_docs)] // a test binary

use std::net::SocketAddr;

use disagg_connectors::vllm::VllmNixl;
use disagg_core::{Endpoint, Orchestrator, Role, source::StaticSource};
use disagg_http::server::Builder;
use disagg_http::{HttpTransport, PdService, PdServiceConfig, RouteAction, RouteTable};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

async fn serve(routes: RouteTable) -> SocketAddr {
    // No engine is asked: the addresses are never dialled.
    let source = StaticSource::new([
        Endpoint::new("http://127.0.0.1:9", Role::Prefill).unwrap(),
        Endpoint::new("http://127.0.0.1:9", Role::Decode).unwrap(),
    ]);
    let orchestrator =
        Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new()).build();
    let mut config = PdServiceConfig::default();
    config.routes = routes;
    let service = PdService::with_config(orchestrator, config);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Builder::new().serve(listener, service, std::future::pending()));
    addr
}

/// `method path` answered 403 `admin_route_closed`: its message.
async fn closed_message(addr: SocketAddr, method: &str, path: &str) -> String {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = format!("{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    tcp.read_to_end(&mut got).await.unwrap();
    let text = String::from_utf8_lossy(&got).into_owned();
    assert!(text.starts_with("HTTP/1.1 403"), "{path}: {text}");
    let body = &text[text.find("\r\n\r\n").unwrap() + 4..];
    let v: Value = serde_json::from_str(body).unwrap();
    assert_eq!(v["error"]["code"], "admin_route_closed", "{path}: {body}");
    assert_eq!(v["error"]["type"], "permission_error", "{path}: {body}");
    v["error"]["message"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_below_the_metrics_mount_says_no_flag_opens_it() {
    for open in [false, true] {
        let addr = serve(RouteTable::default().admin_routes(open)).await;
        for (method, path) in [
            ("GET", "/metrics/"),
            ("GET", "/metricsx"),
            ("GET", "/metrics/metrics"),
            ("POST", "/%6detrics/"),
        ] {
            let m = closed_message(addr, method, path).await;
            assert!(!m.contains("--admin-routes"), "{path} (open: {open}): {m}");
            assert!(m.contains("no flag opens it"), "{path}: {m}");
            // (Pointed at only where the proxy serves its own metrics.)
            assert_eq!(
                m.contains("GET /metrics"),
                cfg!(feature = "metrics"),
                "{path}: {m}"
            );
        }
    }
}

/// A rule of the embedder's under `/metrics` (closing the proxy's own `/metrics`, or a
/// path below it) is the route table's: its message does not point at the path it
/// closes, nor say the engines' mount closed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedders_rule_under_metrics_says_the_route_table_closed_it() {
    let routes = RouteTable::default()
        .set("/metrics", RouteAction::Refused)
        .set("/metrics/custom", RouteAction::Refused);
    let addr = serve(routes).await;
    for path in ["/metrics", "/metrics/custom"] {
        let m = closed_message(addr, "GET", path).await;
        assert!(
            m.contains("closed on this proxy by its route table"),
            "{path}: {m}"
        );
        assert!(!m.contains("GET /metrics"), "{path}: {m}");
        assert!(!m.contains("no flag opens it"), "{path}: {m}");
    }
    // The default rule still says its own.
    let m = closed_message(addr, "GET", "/metricsx").await;
    assert!(m.contains("no flag opens it"), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_route_says_admin_routes_opens_it_and_an_embedders_rule_does_not() {
    let routes = RouteTable::default().set("/tokenize", RouteAction::Refused);
    let addr = serve(routes).await;
    for path in [
        "/reset_prefix_cache",
        "/fault_tolerance/apply",
        "/dumper/start",
    ] {
        let m = closed_message(addr, "POST", path).await;
        assert!(m.contains("--admin-routes"), "{path}: {m}");
        assert!(m.starts_with(path), "{path}: {m}");
    }
    // Closed by the embedder's own rule: `--admin-routes` would not open it either.
    let m = closed_message(addr, "POST", "/tokenize").await;
    assert!(!m.contains("--admin-routes"), "{m}");
    assert!(m.contains("route table"), "{m}");
}
