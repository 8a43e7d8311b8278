//! `disagg-proxy serve` at the HTTP edge, on every route kind, as the real binary in
//! front of simulated engines that record every request (and, where an engine must
//! misbehave, raw engines written here): one normal path routed, authorised and
//! forwarded; the client's credentials and the engines' routing headers never passed
//! on; an engine's own KV handoff never relayed; every client body under the body
//! timeout; engine redirects and unasked encodings answered 502.

#![allow(missing_docs)] // a test binary

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use disagg_sim::{ReceivedRequest, SimConfig, SimEngine};
use http_body_util::Full;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

mod common;
use common::{Proxy, completion, get, get_with, post, post_with, read_request};

async fn engine(config: SimConfig) -> SimEngine {
    SimEngine::start(config)
        .await
        .expect("start a simulated engine")
}

async fn plain_pair() -> (SimEngine, SimEngine) {
    (
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
    )
}

fn chat(content: &str, max_tokens: u32, stream: bool) -> String {
    serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
    .to_string()
}

/// Everything both engines received, on any route.
fn received(engines: &[&SimEngine]) -> Vec<ReceivedRequest> {
    engines.iter().flat_map(|e| e.received()).collect()
}

/// The proxy in front of `p` and `d`, the engines' record cleared once it listens: with
/// the NIXL connector it reads each engine's `GET /version` at start-up (a pairing
/// fact, sent with no client header), and the tests here look at what clients cause.
async fn start(p: &SimEngine, d: &SimEngine, args: &[&str]) -> Proxy {
    let proxy = Proxy::start(p, d, args).await;
    p.clear_received();
    d.clear_received();
    proxy
}

// === raw HTTP/1.1 to the proxy ===

/// An answer read off a connection to its end.
struct Raw {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Raw {
    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "not JSON ({e}): {} {}",
                self.head,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }

    /// An OpenAI-format error with `status` and `code`.
    fn assert_error(&self, status: u16, code: &str) {
        assert_eq!(
            self.status,
            status,
            "{}{}",
            self.head,
            String::from_utf8_lossy(&self.body)
        );
        let v = self.json();
        assert_eq!(v["error"]["code"], code, "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
        assert!(v["error"]["type"].is_string(), "{v}");
        assert!(v["error"].get("param").is_some(), "{v}");
    }
}

/// Split what a connection carried into head and body (chunks joined).
fn parse_answer(bytes: &[u8]) -> Raw {
    let text_end = bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no head in {:?}", String::from_utf8_lossy(bytes)));
    let head = String::from_utf8_lossy(&bytes[..text_end]).into_owned();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let mut rest = &bytes[text_end + 4..];
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        let mut body = Vec::new();
        while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
            let size = std::str::from_utf8(&rest[..eol])
                .ok()
                .and_then(|s| usize::from_str_radix(s.trim(), 16).ok())
                .unwrap_or(0);
            if size == 0 || rest.len() < eol + 2 + size {
                break;
            }
            body.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
            rest = &rest[(eol + 4 + size).min(rest.len())..];
        }
        body
    } else {
        rest.to_vec()
    };
    Raw { status, head, body }
}

/// Send `request` (whole) on a new connection and read until the proxy closes it.
async fn raw(addr: SocketAddr, request: &str) -> Raw {
    late_body(addr, request, "", Duration::ZERO).await
}

/// `METHOD target` with a JSON `body`, on its own connection.
async fn raw_request(addr: SocketAddr, method: &str, target: &str, body: &str) -> Raw {
    let req = format!(
        "{method} {target} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    raw(addr, &req).await
}

// === 1. one normal path ===

#[tokio::test]
async fn oddly_spelled_admin_routes_are_refused_and_reach_no_engine() {
    let (p, d) = plain_pair().await;
    let proxy = start(&p, &d, &[]).await;
    for target in [
        "/reset_prefix_cache",
        "/%72eset_prefix_cache",
        "/reset%5Fprefix%5Fcache",
        "/reset%5fprefix%5fcache",
        "//reset_prefix_cache",
        "/./reset_prefix_cache",
        "/v1/../reset_prefix_cache",
        "/v1/%2E%2E/reset_prefix_cache",
        "/%73leep",
        "/v1/../v1/load_lora_adapter",
        "/fault_tolerance//apply",
        "/dumper/./start",
    ] {
        let a = raw_request(proxy.addr, "POST", target, "{}").await;
        a.assert_error(403, "admin_route_closed");
    }
    assert_eq!(received(&[&p, &d]), Vec::new());
    // The engines do route the decoded spelling to the closed handler (uvicorn
    // decodes before Starlette matches): it was the proxy that stopped it.
    let direct = raw_request(d.addr(), "POST", "/%72eset_prefix_cache", "").await;
    assert_eq!(direct.status, 200);
    assert_eq!(d.stats().admin_requests, 1);
}

/// The engines serve some closed routes under a second name, and their Prometheus
/// mount answers every path that starts with `/metrics`: each is refused, with or
/// without the scraper's key, and none reaches an engine.
#[tokio::test]
async fn other_names_of_closed_routes_and_the_metrics_mount_are_refused() {
    let (p, d) = plain_pair().await;
    // The scraper's key alone: `/metrics` needs it, every other path is open.
    let proxy = start(&p, &d, &["--metrics-api-key", "scrape"]).await;
    for (method, target) in [
        ("GET", "/get_server_info"),
        ("POST", "/clear_hicache_storage_backend"),
        ("GET", "/remote_instance_transfer_engine_info"),
        ("GET", "/get_remote_instance_transfer_engine_info"),
        ("GET", "/metrics/"),
        ("GET", "/metricsx"),
        ("GET", "/metrics/metrics"),
        ("GET", "/%6detrics/"),
    ] {
        let a = raw_request(proxy.addr, method, target, "").await;
        a.assert_error(403, "admin_route_closed");
    }
    assert_eq!(received(&[&p, &d]), Vec::new());
    // The proxy's own metrics stay behind the key.
    let a = raw_request(proxy.addr, "GET", "/metrics", "").await;
    assert_eq!(a.status, 401, "{}", a.head);
}

#[tokio::test]
async fn ambiguous_paths_are_400_and_reach_no_engine() {
    let (p, d) = plain_pair().await;
    let proxy = start(&p, &d, &["--admin-routes"]).await;
    for target in [
        "/reset%2Fprefix_cache",
        "/reset_prefix_cache%2F",
        "/v1%2Fchat/completions",
        "/v1/chat%2fcompletions",
        "/tokenize%5C",
        "/a%5cb",
        "/tokenize%00",
        "/%00/../tokenize",
        "/tokenize%zz",
        "/tokenize%2",
        "/../x",
        "/../reset_prefix_cache",
        "/v1/../../tokenize",
        "/v1/%2e%2e/%2e%2e/sleep",
    ] {
        for method in ["POST", "GET"] {
            let a = raw_request(proxy.addr, method, target, "{}").await;
            a.assert_error(400, "invalid_path");
        }
    }
    assert_eq!(received(&[&p, &d]), Vec::new());
    assert_eq!((p.stats().requests, d.stats().requests), (0, 0));
}

#[tokio::test]
async fn an_oddly_spelled_chat_route_is_orchestrated() {
    let (p, d) = plain_pair().await;
    let proxy = start(&p, &d, &[]).await;
    let body = chat("spelled oddly", 3, false);
    let spellings = [
        "/v1/chat//completions",
        "/v1/./chat/completions",
        "//v1/chat/completions",
        "/v1/%63hat/completions",
        "/v1/x/../chat/completions",
    ];
    for target in spellings {
        let a = raw_request(proxy.addr, "POST", target, &body).await;
        assert_eq!(
            a.status,
            200,
            "{target}: {}",
            String::from_utf8_lossy(&a.body)
        );
        // Disaggregated, not served by one engine behind P/D's back.
        assert_eq!(a.header("x-disagg-handoff"), Some("kv"), "{target}");
    }
    for e in [&p, &d] {
        let paths: Vec<String> = e.requests().into_iter().map(|r| r.path).collect();
        assert_eq!(paths, vec!["/v1/chat/completions"; spellings.len()]);
    }
    assert_eq!(d.stats().remote_decodes, spellings.len() as u64);
}

#[tokio::test]
async fn forwarded_paths_reach_the_engine_normalised_with_their_query() {
    let (p, d) = plain_pair().await;
    let proxy = start(&p, &d, &[]).await;
    let body = r#"{"model":"sim-model","prompt":"one two"}"#;
    let a = raw_request(proxy.addr, "POST", "//%74okenize/./?x=%2F&y=%zz", body).await;
    // `/tokenize/` is not vLLM's route: the engine's own 404, passed through.
    assert_eq!(a.status, 404, "{}", String::from_utf8_lossy(&a.body));
    let a = raw_request(proxy.addr, "POST", "/v1/../%74okenize?x=%2F&y", body).await;
    assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    assert_eq!(a.json()["count"], 2);
    let heads = d.received();
    let got: Vec<(&str, Option<&str>)> = heads
        .iter()
        .map(|r| (r.path.as_str(), r.query.as_deref()))
        .collect();
    assert_eq!(
        got,
        [
            ("/tokenize/", Some("x=%2F&y=%zz")),
            ("/tokenize", Some("x=%2F&y"))
        ]
    );
    // A model card's id may hold an escaped `/`: the card is the proxy's own answer.
    let card = get(&proxy.url(), "/v1/models/sim%2Dmodel").await;
    assert_eq!(card.status, 200, "{}", card.text());
    assert_eq!(card.json()["id"], "sim-model");
    let unknown = get(&proxy.url(), "/v1/models/org%2Fmodel").await;
    unknown.assert_error(404, "model_not_found");
    assert!(unknown.text().contains("org/model"), "{}", unknown.text());
    // Only the model list was asked for, never a model card path.
    assert!(
        d.received()[2..].iter().all(|r| r.path == "/v1/models"),
        "{:?}",
        d.received()
    );
    assert_eq!(p.received(), Vec::new());
}

// === 2. credentials and routing headers ===

const CLIENT_KEY: &str = "sk-client-secret-0001";

/// The headers an engine reads as routing or identity, and a client's credentials.
fn hostile_headers() -> Vec<(&'static str, &'static str)> {
    vec![
        ("x-override-rid", "client-rid"),
        ("x-override-bootstrap-host", "10.6.6.6"),
        ("x-override-bootstrap-port", "6666"),
        ("x-override-bootstrap-room", "42"),
        ("x-override-routed-dp-rank", "1"),
        ("x-override-disagg-prefill-dp-rank", "1"),
        ("x-override-priority", "-100"),
        ("x-override-conversation-id", "someone-elses"),
        ("x-override-foo", "bar"),
        ("x_override_bootstrap_host", "10.6.6.7"),
        ("X-data-parallel-rank", "1"),
        ("x-api-key", "sk-client-secret-0002"),
    ]
}

/// One request of every route kind, each with the client's `authorization` and
/// `extra` headers: orchestrated (streamed and not), forwarded (`/tokenize`,
/// `/v1/embeddings`), orchestrated `/v1/responses`, direct (a stored `/v1/responses`,
/// which stays on one engine), fanned out (`/reset_prefix_cache`, when
/// the proxy opened the admin routes) and the model list the proxy gathers.
async fn every_route(url: &str, auth: &str, extra: &[(&str, &str)], admin: bool) {
    let mut h: Vec<(&str, &str)> = vec![("authorization", auth)];
    h.extend_from_slice(extra);
    for (path, body) in [
        ("/v1/completions", completion("every route", 3, false)),
        ("/v1/chat/completions", chat("every route", 3, true)),
        (
            "/tokenize",
            r#"{"model":"sim-model","prompt":"a b"}"#.to_owned(),
        ),
        (
            "/v1/embeddings",
            r#"{"model":"sim-model","input":"a b"}"#.to_owned(),
        ),
        (
            "/v1/responses",
            r#"{"model":"sim-model","input":"a b"}"#.to_owned(),
        ),
        (
            "/v1/responses",
            r#"{"model":"sim-model","input":"a b","stream":true}"#.to_owned(),
        ),
        (
            "/v1/responses",
            r#"{"model":"sim-model","input":"a b","store":true}"#.to_owned(),
        ),
    ] {
        let a = post_with(url, path, &body, &h).await;
        assert_eq!(a.status, 200, "{path}: {}", a.text());
    }
    if admin {
        let a = post_with(url, "/reset_prefix_cache", "", &h).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    let models = get_with(url, "/v1/models", &h).await;
    assert_eq!(models.status, 200, "{}", models.text());
}

/// Every route kind reached an engine: the heads `engines` received, by path.
fn assert_every_route_reached(p: &SimEngine, d: &SimEngine, admin: bool) {
    let paths =
        |e: &SimEngine| -> Vec<String> { e.received().into_iter().map(|r| r.path).collect() };
    let (pp, dp) = (paths(p), paths(d));
    for path in ["/v1/completions", "/v1/chat/completions"] {
        assert!(pp.iter().any(|x| x == path), "prefill: {pp:?}");
        assert!(dp.iter().any(|x| x == path), "decode: {dp:?}");
    }
    for path in ["/tokenize", "/v1/embeddings", "/v1/responses", "/v1/models"] {
        assert!(dp.iter().any(|x| x == path), "{path}: {dp:?}");
    }
    if admin {
        assert!(pp.iter().any(|x| x == "/reset_prefix_cache"), "{pp:?}");
        assert!(dp.iter().any(|x| x == "/reset_prefix_cache"), "{dp:?}");
    }
}

#[tokio::test]
async fn the_clients_credentials_reach_no_engine_on_any_route() {
    let keyed = || SimConfig {
        api_key: Some("sk-engine".to_owned()),
        ..SimConfig::default()
    };
    // With client keys and an engine key: the engines get the engine's key, only.
    {
        let (p, d) = (engine(keyed()).await, engine(keyed()).await);
        let proxy = start(
            &p,
            &d,
            &[
                "--api-key",
                CLIENT_KEY,
                "--engine-api-key",
                "sk-engine",
                "--admin-routes",
            ],
        )
        .await;
        let auth = format!("Bearer {CLIENT_KEY}");
        every_route(&proxy.url(), &auth, &hostile_headers(), true).await;
        assert_every_route_reached(&p, &d, true);
        for r in received(&[&p, &d]) {
            assert_eq!(r.header("authorization"), Some("Bearer sk-engine"), "{r:?}");
            assert_eq!(r.header("x-api-key"), None, "{r:?}");
            assert!(
                r.headers.iter().all(|(_, v)| !v.contains("sk-client")),
                "{r:?}"
            );
        }
        assert_eq!(
            (
                p.stats().requests_without_key,
                d.stats().requests_without_key
            ),
            (0, 0)
        );
    }
    // Without an engine key: no `authorization` at all.
    let (p, d) = plain_pair().await;
    let proxy = start(&p, &d, &["--admin-routes"]).await;
    every_route(
        &proxy.url(),
        &format!("Bearer {CLIENT_KEY}"),
        &hostile_headers(),
        true,
    )
    .await;
    assert_every_route_reached(&p, &d, true);
    for r in received(&[&p, &d]) {
        assert_eq!(r.header("authorization"), None, "{r:?}");
        assert_eq!(r.header("x-api-key"), None, "{r:?}");
    }
}

#[tokio::test]
async fn forward_authorization_passes_authorization_alone_on_every_route() {
    let (p, d) = plain_pair().await;
    let proxy = start(&p, &d, &["--forward-authorization", "--admin-routes"]).await;
    let auth = format!("Bearer {CLIENT_KEY}");
    every_route(&proxy.url(), &auth, &hostile_headers(), true).await;
    assert_every_route_reached(&p, &d, true);
    for r in received(&[&p, &d]) {
        // The proxy's own model list request carries nothing of a client's.
        let want = (r.path != "/v1/models").then_some(auth.as_str());
        assert_eq!(r.header("authorization"), want, "{r:?}");
        assert_eq!(r.header("x-api-key"), None, "{r:?}");
    }
}

/// A header the client's `connection` names is for the proxy alone: dropped on the
/// legs as on forwarded and fanned-out requests, even `authorization` under
/// `--forward-authorization`.
#[tokio::test]
async fn headers_the_clients_connection_names_reach_no_engine_on_any_route() {
    let (p, d) = plain_pair().await;
    let proxy = start(&p, &d, &["--forward-authorization", "--admin-routes"]).await;
    let extra = [
        ("connection", "keep-alive, Authorization"),
        ("connection", "x-session-id"),
        ("x-session-id", "s-1"),
    ];
    every_route(&proxy.url(), "Bearer hop-only", &extra, true).await;
    assert_every_route_reached(&p, &d, true);
    for r in received(&[&p, &d]) {
        assert_eq!(r.header("authorization"), None, "{r:?}");
        assert_eq!(r.header("x-session-id"), None, "{r:?}");
    }
}

#[tokio::test]
async fn engine_directives_reach_no_engine_on_any_route() {
    let (p, d) = plain_pair().await;
    let proxy = start(&p, &d, &["--admin-routes"]).await;
    let mut headers = hostile_headers();
    headers.push(("x-request-id", "client-chosen-id"));
    headers.push((
        "traceparent",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    ));
    every_route(&proxy.url(), "Bearer x", &headers, true).await;
    assert_every_route_reached(&p, &d, true);
    let all = received(&[&p, &d]);
    for r in &all {
        for (name, _) in &r.headers {
            let n = name.replace('_', "-");
            assert!(
                !n.starts_with("x-override-") && n != "x-data-parallel-rank",
                "{name} reached {} {}: {r:?}",
                r.method,
                r.path
            );
        }
    }
    // The legs carry the proxy's own request id, the routes it mints none for carry
    // none (the engine draws its own): never the client's. The rest of the client's
    // headers pass.
    for r in &all {
        let leg = r.path.starts_with("/v1/c");
        let id = r.header("x-request-id");
        assert_ne!(id, Some("client-chosen-id"), "{r:?}");
        if leg {
            assert!(id.is_some(), "{r:?}");
        }
        if r.path != "/v1/models" {
            assert!(r.header("traceparent").is_some(), "{r:?}");
        }
    }
}

// === 3. the engine's own handoff ===

fn handoff_decode() -> SimConfig {
    SimConfig {
        decode_handoff: true,
        ..SimConfig::default()
    }
}

/// Whether `text` holds a handoff that is not `null`.
fn holds_handoff(text: &str) -> bool {
    [
        "kv_transfer_params\":{",
        "ec_transfer_params\":{",
        "remote_engine_id",
    ]
    .iter()
    .any(|k| text.contains(k))
}

#[tokio::test]
async fn a_decodes_own_handoff_never_reaches_the_client() {
    let p = engine(SimConfig::default()).await;
    let d = engine(handoff_decode()).await;
    // The control: asked directly, the decode answers with a handoff of its own.
    let direct = post(&d.url(), "/v1/completions", &completion("mine", 3, false)).await;
    assert!(holds_handoff(&direct.text()), "{}", direct.text());
    let direct = post(&d.url(), "/v1/chat/completions", &chat("mine", 3, true)).await;
    assert!(holds_handoff(&direct.text()), "{}", direct.text());
    let responses = r#"{"model":"sim-model","input":"mine","stream":true}"#;
    let direct = post(&d.url(), "/v1/responses", responses).await;
    assert!(holds_handoff(&direct.text()), "{}", direct.text());

    let proxy = start(&p, &d, &[]).await;
    let url = proxy.url();
    for stream in [false, true] {
        for (path, body) in [
            ("/v1/chat/completions", chat("not yours", 4, stream)),
            ("/v1/completions", completion("not yours", 4, stream)),
        ] {
            let a = post(&url, path, &body).await;
            assert_eq!(a.status, 200, "{}", a.text());
            assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
            assert!(!holds_handoff(&a.text()), "{path}: {}", a.text());
            if stream {
                let events = a.events();
                // Every chunk is there, each one JSON; only the terminal one changed.
                assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
                let mut terminal = 0;
                for e in &events[..events.len() - 1] {
                    let v: serde_json::Value = serde_json::from_str(e).expect("a JSON chunk");
                    terminal += usize::from(v["choices"][0]["finish_reason"].is_string());
                    let handoff = v.get("kv_transfer_params");
                    assert!(handoff.is_none_or(serde_json::Value::is_null), "{e}");
                }
                assert_eq!(terminal, 1, "{}", a.text());
            } else {
                let v = a.json();
                assert!(v["kv_transfer_params"].is_null(), "{v}");
                assert!(v["usage"].is_object(), "{v}");
            }
        }
        // The Responses API (orchestrated since issue #32), whole and streamed.
        let body = format!(r#"{{"model":"sim-model","input":"not yours","stream":{stream}}}"#);
        let a = post(&url, "/v1/responses", &body).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
        assert!(!holds_handoff(&a.text()), "{}", a.text());
        assert!(
            a.text().contains("\"status\":\"completed\"")
                || a.text().contains("\"status\":\"incomplete\"")
        );
    }
    assert_eq!(d.stats().remote_decodes, 6);
}

/// A raw engine: answers every request (read to its end) with `answer`, written as
/// separate socket writes, each frame a moment after the other (an empty frame: hang),
/// then closes the connection. It keeps the requests it saw (head and body, as text).
struct RawEngine {
    addr: SocketAddr,
    heads: Arc<Mutex<Vec<String>>>,
}

impl RawEngine {
    async fn start(answer: Vec<Vec<u8>>) -> RawEngine {
        RawEngine::start_with(move |_head| answer.clone()).await
    }

    /// `answer` picks the frames for each request from the request (as text).
    async fn start_with(
        answer: impl Fn(&str) -> Vec<Vec<u8>> + Send + Sync + 'static,
    ) -> RawEngine {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let heads = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&heads);
        let answer = Arc::new(answer);
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let (seen, answer) = (Arc::clone(&seen), Arc::clone(&answer));
                tokio::spawn(async move {
                    let Some(head) = read_request(&mut s).await else {
                        return;
                    };
                    let frames = answer(&head);
                    seen.lock().unwrap().push(head);
                    for (i, f) in frames.iter().enumerate() {
                        if i > 0 {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        if f.is_empty() {
                            // An empty frame: hang, the connection open.
                            std::future::pending::<()>().await;
                        }
                        if s.write_all(f).await.is_err() {
                            return;
                        }
                        let _ = s.flush().await;
                    }
                });
            }
        });
        RawEngine { addr, heads }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }
}

const SSE_HEAD: &[u8] =
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\nconnection: close\r\n\r\n";

/// A chat stream as vLLM 0.33 writes it with a handoff on the terminal chunk, cut into
/// frames in awkward places (inside a key, inside an event's end); and what the client
/// must get: the same bytes, the handoff's value overwritten in place.
fn handoff_stream() -> (Vec<Vec<u8>>, Vec<u8>) {
    let first = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"sim-model\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}],\"prompt_token_ids\":null}\n\n";
    let token = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"sim-model\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" yes\"},\"logprobs\":null,\"finish_reason\":null,\"token_ids\":null}],\"kv_transfer_params\":null}\n\n";
    let last = format!(
        "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"sim-model\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" no\"}},\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null}}],\"kv_transfer_params\":{HANDOFF}}}\n\n"
    );
    let done = "data: [DONE]\n\n";
    let stream = format!("{first}{token}{token}{last}{done}");
    let cut1 = stream.find("kv_trans").unwrap() + 3;
    let cut2 = stream.rfind("kv_trans").unwrap() + 5;
    let cut3 = stream.rfind("}\n\n").unwrap() + 2;
    let b = stream.as_bytes();
    let frames = vec![
        SSE_HEAD.to_vec(),
        b[..cut1].to_vec(),
        b[cut1..cut2].to_vec(),
        b[cut2..cut3].to_vec(),
        b[cut3..].to_vec(),
    ];
    let want = blank(&stream, HANDOFF).into_bytes();
    (frames, want)
}

/// The handoff a raw decode answers with.
const HANDOFF: &str = r#"{"do_remote_prefill":false,"do_remote_decode":true,"remote_block_ids":[1,2],"remote_engine_id":"decode-7","remote_request_id":"r","remote_host":"10.0.0.7","remote_port":5601,"tp_size":1}"#;

/// `text` with each `value` overwritten as the proxy does: `null`, then spaces to the
/// value's length.
fn blank(text: &str, value: &str) -> String {
    let with = format!("null{}", " ".repeat(value.len() - 4));
    text.replace(value, &with)
}

fn json_answer(body: &str) -> Vec<Vec<u8>> {
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    // The head, then the body in two frames cut inside the handoff key.
    let cut = body.find("kv_trans").map_or(body.len() / 2, |i| i + 4);
    vec![
        head.into_bytes(),
        body.as_bytes()[..cut].to_vec(),
        body.as_bytes()[cut..].to_vec(),
    ]
}

#[tokio::test]
async fn a_handoff_is_blanked_in_place_and_every_other_byte_is_the_engines() {
    let (stream, want) = handoff_stream();
    let whole = format!(
        r#"{{"id":"cmpl-1","object":"text_completion","choices":[{{"index":0,"text":" kv_transfer_params","finish_reason":"length"}}],"usage":{{"prompt_tokens":3}},"kv_transfer_params":{HANDOFF},"ec_transfer_params":{{"peer_host":"10.0.0.8","peer_port":7}}}}"#
    );
    let clean = blank(
        &blank(&whole, HANDOFF),
        r#"{"peer_host":"10.0.0.8","peer_port":7}"#,
    );
    assert_eq!(clean.len(), whole.len());
    // A stream for a request asking for one (a leg's body) or saying `x-want: sse`.
    let raw_decode = RawEngine::start_with(move |request| {
        if request.contains("\"stream\":true")
            || request.to_ascii_lowercase().contains("x-want: sse")
        {
            stream.clone()
        } else {
            json_answer(&whole)
        }
    })
    .await;
    let p = engine(SimConfig::default()).await;
    let proxy = Proxy::start_args(&[
        "--prefill".to_owned(),
        p.url(),
        "--decode".to_owned(),
        raw_decode.url(),
    ])
    .await;
    let url = proxy.url();
    let sse = [("x-want", "sse")];
    // Orchestrated: the decode leg's answer.
    let a = post_with(&url, "/v1/chat/completions", &chat("raw", 3, true), &sse).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
    assert_eq!(a.text(), String::from_utf8(want.clone()).unwrap());
    let a = post(&url, "/v1/completions", &completion("raw", 3, false)).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.text(), clean);
    // The same length: the engine's `content-length` still holds.
    let length = clean.len().to_string();
    assert_eq!(a.header("content-length"), Some(length.as_str()));
    // Forwarded (a route the proxy does not orchestrate, as vLLM's `/score`) and direct
    // (`/v1/audio/translations`): the same.
    for path in ["/score", "/v1/audio/translations"] {
        let a = post_with(&url, path, "{}", &sse).await;
        assert_eq!(a.status, 200, "{path}: {}", a.text());
        assert_eq!(a.text(), String::from_utf8(want.clone()).unwrap(), "{path}");
        let a = post(&url, path, "{}").await;
        assert_eq!(a.text(), clean, "{path}");
        assert_eq!(a.header("content-length"), Some(length.as_str()), "{path}");
    }
    // Six answers, besides the start-up `GET /version` probe (a pairing fact).
    let heads = raw_decode.heads();
    let relayed = heads
        .iter()
        .filter(|h| !h.starts_with("GET /version"))
        .count();
    assert_eq!(relayed, 6, "{heads:?}");
}

// === a client's handoff, on every route kind and in every spelling ===

/// A body with every spelling of a client's handoff: the top-level fields (one key
/// escaped, one repeated), and vLLM's other spelling inside `vllm_xargs`, whose other
/// arguments must stay.
const CLIENT_HANDOFF: &str = r#"{"model":"sim-model","prompt":"a b","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.6.6.6","remote_port":5600},"\u0062ootstrap_host":"10.6.6.6","bootstrap_room":7,"bootstrap_room":8,"routed_dp_rank":1,"vllm_xargs":{"kv_transfer_params":"x","ec_transfer_params":{"peer_host":"10.6.6.6"},"mine":1}}"#;

/// The bodies `engine` received, not counting the start-up `GET /version` probe.
fn bodies(engine: &RawEngine) -> Vec<String> {
    engine
        .heads()
        .into_iter()
        .filter(|h| !h.starts_with("GET /version"))
        .map(|h| {
            h.split_once("\r\n\r\n")
                .map_or(String::new(), |(_, b)| b.to_owned())
        })
        .collect()
}

/// A raw engine answering `{"ok":true}` to everything, as both prefill and decode of
/// a proxy with the admin routes open.
async fn one_raw_engine() -> (RawEngine, Proxy) {
    let engine = RawEngine::start_with(|_| json_answer(r#"{"ok":true}"#)).await;
    let proxy = Proxy::start_args(&[
        "--prefill".to_owned(),
        engine.url(),
        "--decode".to_owned(),
        engine.url(),
        "--admin-routes".to_owned(),
    ])
    .await;
    (engine, proxy)
}

#[tokio::test]
async fn a_clients_handoff_reaches_no_engine_on_any_route() {
    let (engine, proxy) = one_raw_engine().await;
    // Forwarded (`/tokenize`, `/score`), direct (`/invocations`, which vLLM serves as
    // chat or completions; `/v1/audio/translations`), fanned out
    // (`/v1/load_lora_adapter`); with whitespace before the object too.
    let spaced = format!(" \r\n\t{CLIENT_HANDOFF}");
    let sent = [
        ("/tokenize", CLIENT_HANDOFF),
        ("/score", spaced.as_str()),
        ("/invocations", CLIENT_HANDOFF),
        ("/invocations", spaced.as_str()),
        ("/v1/audio/translations", CLIENT_HANDOFF),
        ("/v1/load_lora_adapter", CLIENT_HANDOFF),
    ];
    all_answered(&proxy, &sent, 200).await;
    let seen = bodies(&engine);
    assert_eq!(seen.len(), sent.len(), "{seen:?}");
    for body in seen {
        // Read whole by its `content-length`, which was made to fit.
        let v: serde_json::Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys.len(), 3, "{body}");
        for key in ["model", "prompt", "vllm_xargs"] {
            assert!(keys.contains(&key), "{body}");
        }
        assert_eq!(v["vllm_xargs"], serde_json::json!({"mine": 1}), "{body}");
        assert!(!body.contains("10.6.6.6"), "{body}");
    }
}

/// POST each `(path, body)` to `proxy`: each is answered `status`.
async fn all_answered(proxy: &Proxy, sent: &[(&str, &str)], status: u16) {
    for (path, body) in sent {
        let a = raw_request(proxy.addr, "POST", path, body).await;
        assert_eq!(
            a.status,
            status,
            "{path}: {}",
            String::from_utf8_lossy(&a.body)
        );
    }
}

/// The handoff spelled below the top level, where an engine reads it as the top-level
/// field: vLLM's token-in route in `sampling_params.extra_args`, SGLang's Vertex route in
/// `parameters` (each with a neighbour that must stay).
const NESTED_HANDOFF: &str = r#"{"model":"sim-model","token_ids":[1,2],"sampling_params":{"max_tokens":4,"extra_args":{"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.6.6.6"},"mine":1}},"parameters":{"bootstrap_host":"10.6.6.6","bootstrap_room":7,"temperature":0}}"#;

#[tokio::test]
async fn a_clients_nested_handoff_reaches_no_engine_on_any_route() {
    let (engine, proxy) = one_raw_engine().await;
    // Orchestrated (token-in: the raw engine's prefill answer holds no handoff, so the
    // decode leg goes without one of the proxy's, the leg the client's would have
    // steered), forwarded (SGLang's `/vertex_generate`,
    // `/tokenize`), direct (`/invocations`), fanned out (`/v1/load_lora_adapter`).
    let sent = [
        "/inference/v1/generate",
        "/vertex_generate",
        "/tokenize",
        "/invocations",
        "/v1/load_lora_adapter",
    ]
    .map(|path| (path, NESTED_HANDOFF));
    all_answered(&proxy, &sent, 200).await;
    let seen = bodies(&engine);
    // Both legs of the orchestrated request, one request of each other.
    assert_eq!(seen.len(), sent.len() + 1, "{seen:?}");
    let bare = seen
        .iter()
        .filter(|b| !b.contains("kv_transfer_params"))
        .count();
    assert_eq!(
        bare,
        sent.len(),
        "the decode leg carried no handoff: {seen:?}"
    );
    for body in seen {
        let v: serde_json::Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
        assert!(!body.contains("10.6.6.6"), "{body}");
        assert_eq!(
            v["sampling_params"]["extra_args"],
            serde_json::json!({"mine": 1}),
            "{body}"
        );
        assert_eq!(
            v["parameters"],
            serde_json::json!({"temperature": 0}),
            "{body}"
        );
    }
    // A nested object whose keys the proxy cannot read (a lone surrogate, which the
    // engines' Python reads) is refused on every kind, not passed with its handoff.
    let before = bodies(&engine).len();
    let odd = r#"{"model":"sim-model","prompt":"a","token_ids":[1],"sampling_params":{"max_tokens":1},"vllm_xargs":{"\udc00":0,"kv_transfer_params":{"remote_host":"10.6.6.6"}}}"#;
    let sent = [
        "/v1/completions",
        "/tokenize",
        "/invocations",
        "/v1/load_lora_adapter",
    ]
    .map(|path| (path, odd));
    all_answered(&proxy, &sent, 400).await;
    assert_eq!(bodies(&engine).len(), before, "no engine got one");
}

/// A body of more top-level fields than `disagg_core::json::MAX_FIELDS` is refused 400 on
/// every route kind that reads the body (orchestrated, forwarded, direct, fanned out),
/// and reaches no engine; one at the ceiling passes.
#[tokio::test]
async fn bodies_past_the_field_ceiling_are_refused_on_every_route() {
    let (engine, proxy) = one_raw_engine().await;
    let body = |n: usize| {
        let fields: Vec<String> = (0..n).map(|i| format!("\"x{i}\":0")).collect();
        format!(
            r#"{{"model":"sim-model","prompt":"p",{}}}"#,
            fields.join(",")
        )
    };
    let over = body(disagg_core::json::MAX_FIELDS);
    for path in [
        "/v1/completions",
        "/tokenize",
        "/invocations",
        "/v1/load_lora_adapter",
    ] {
        let a = raw_request(proxy.addr, "POST", path, &over).await;
        a.assert_error(400, "invalid_request_body");
        let message = a.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(
            message.contains("1024 top-level fields"),
            "{path}: {message}"
        );
    }
    assert_eq!(bodies(&engine), Vec::<String>::new());
    let at = body(disagg_core::json::MAX_FIELDS - 2);
    let a = raw_request(proxy.addr, "POST", "/tokenize", &at).await;
    assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    assert_eq!(bodies(&engine).len(), 1);
}

#[tokio::test]
async fn bodies_the_proxy_cannot_read_as_the_engines_do_are_refused_off_the_orchestrated_routes() {
    let (engine, proxy) = one_raw_engine().await;
    // Python's `json.loads` reads a byte-order mark, UTF-16 and `NaN`; the proxy,
    // which could not strip a handoff from them, refuses them as it does on the
    // orchestrated routes.
    let bom = format!("\u{feff}{CLIENT_HANDOFF}");
    let utf16: String = CLIENT_HANDOFF.chars().flat_map(|c| [c, '\0']).collect();
    let nan = r#"{"model":"sim-model","x":NaN,"kv_transfer_params":{"remote_host":"10.6.6.6"}}"#;
    for path in [
        "/tokenize",
        "/invocations",
        "/v1/load_lora_adapter",
        "/v1/chat/completions",
    ] {
        for body in [bom.as_str(), utf16.as_str(), nan] {
            let a = raw_request(proxy.addr, "POST", path, body).await;
            assert_eq!(
                a.status,
                400,
                "{path}: {}",
                String::from_utf8_lossy(&a.body)
            );
            assert!(a.json()["error"]["message"].is_string());
        }
    }
    assert_eq!(bodies(&engine), Vec::<String>::new());
    // What is not a JSON object passes as it came: a form, a list, nothing.
    let form =
        "--x\r\ncontent-disposition: form-data; name=\"kv_transfer_params\"\r\n\r\nv\r\n--x--\r\n";
    let list = r#"[{"kv_transfer_params":1}]"#;
    for body in [form, list, ""] {
        let a = raw_request(proxy.addr, "POST", "/v1/audio/transcriptions", body).await;
        assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    }
    assert_eq!(bodies(&engine), [form, list, ""]);
}

/// Send `request` (a stream the engine holds after its first event, `data: {}`) and
/// read until that event: the connection, held open.
async fn held_stream(addr: SocketAddr, request: &str) -> TcpStream {
    let mut held = TcpStream::connect(addr).await.unwrap();
    held.write_all(request.as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    while !seen.windows(9).any(|w| w == b"data: {}\n") {
        let n = tokio::time::timeout(Duration::from_secs(5), held.read(&mut buf))
            .await
            .expect("the held stream's first event")
            .unwrap();
        assert!(n > 0, "{}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    held
}

/// A raw engine answering `{"ok":true}`, but a request asking "hold me", whose stream
/// hangs after its first event (an empty frame).
async fn holding_engine() -> RawEngine {
    RawEngine::start_with(|request| {
        if request.contains("hold me") {
            vec![SSE_HEAD.to_vec(), b"data: {}\n\n".to_vec(), Vec::new()]
        } else {
            json_answer(r#"{"ok":true}"#)
        }
    })
    .await
}

/// Generation sent direct takes its place under `--max-in-flight`, as an orchestrated
/// request does, and holds it until its answer ends (here: the client leaves).
#[tokio::test]
async fn direct_generation_takes_its_place_under_max_in_flight() {
    let engine = holding_engine().await;
    let proxy = Proxy::start_args(&[
        "--prefill".to_owned(),
        engine.url(),
        "--decode".to_owned(),
        engine.url(),
        "--max-in-flight".to_owned(),
        "1".to_owned(),
        "--max-queue".to_owned(),
        "0".to_owned(),
    ])
    .await;
    let body = r#"{"model":"sim-model","prompt":"hold me","stream":true}"#;
    let head = format!(
        "POST /invocations HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let held = held_stream(proxy.addr, &head).await;
    // The only place is taken: direct and orchestrated requests alike are refused.
    let direct = r#"{"model":"sim-model","prompt":"p"}"#;
    raw_request(proxy.addr, "POST", "/invocations", direct)
        .await
        .assert_error(429, "queue_full");
    raw_request(
        proxy.addr,
        "POST",
        "/v1/completions",
        &completion("p", 2, false),
    )
    .await
    .assert_error(429, "queue_full");
    // Direct requests without a body are no generation: retrieving or cancelling a
    // stored response takes no place (a cancel is what frees one).
    for (method, target) in [
        ("GET", "/v1/responses/resp_1"),
        ("POST", "/v1/responses/resp_1/cancel"),
    ] {
        let a = raw_request(proxy.addr, method, target, "").await;
        assert_eq!(
            a.status,
            200,
            "{method} {target}: {}",
            String::from_utf8_lossy(&a.body)
        );
    }
    // The client leaves: its place comes back.
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let a = raw_request(proxy.addr, "POST", "/invocations", direct).await;
        if a.status == 200 {
            break;
        }
        a.assert_error(429, "queue_full");
        assert!(Instant::now() < deadline, "the place never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The head of `POST target` with a JSON body of `len` bytes and the client's deadline
/// of `ms`, on a connection closed after the answer.
fn deadline_head(target: &str, len: usize, ms: u64) -> String {
    format!(
        "POST {target} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-disagg-deadline-ms: {ms}\r\ncontent-length: {len}\r\nconnection: close\r\n\r\n"
    )
}

/// A streamed completion of `prompt` to `target` with the client's deadline of `ms`.
fn streamed_with_deadline(target: &str, prompt: &str, ms: u64) -> String {
    let body = format!(r#"{{"model":"sim-model","prompt":"{prompt}","stream":true}}"#);
    deadline_head(target, body.len(), ms) + &body
}

/// Send `request`; its answer must be the error `status` `code`, no sooner than
/// `after` (and within 5 s).
async fn refused_after(addr: SocketAddr, request: &str, status: u16, code: &str, after: Duration) {
    let begun = Instant::now();
    raw(addr, request).await.assert_error(status, code);
    let took = begun.elapsed();
    assert!(
        took >= after && took < Duration::from_secs(5),
        "{code}: {took:?}"
    );
}

/// Generation sent direct takes its engine's place under
/// `--max-in-flight-per-endpoint`, as an orchestrated request does, from the same
/// places: with the decode engine's one place held by a direct stream, another direct
/// request and an orchestrated one both wait (here until their deadline: 503
/// `queue_timeout`, nothing sent); when the stream ends, a waiting direct request is
/// served. Without the limit the same request is served alongside the stream.
#[tokio::test]
async fn direct_generation_takes_its_engines_place_under_the_per_endpoint_limit() {
    let engine = holding_engine().await;
    let url = engine.url();
    let start = |limit: bool| {
        let mut args = vec![
            "--prefill",
            &url,
            "--decode",
            &url,
            "--client-deadline",
            "--queue-timeout",
            "30",
        ];
        if limit {
            args.extend(["--max-in-flight-per-endpoint", "1"]);
        }
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        async move { Proxy::start_args(&args).await }
    };
    let ask = |prompt: &str, target: &str, ms: u64| streamed_with_deadline(target, prompt, ms);
    let invocations = || {
        let heads = engine.heads();
        heads
            .iter()
            .filter(|h| h.starts_with("POST /invocations"))
            .count()
    };
    let proxy = start(true).await;
    let held = held_stream(proxy.addr, &ask("hold me", "/invocations", 60_000)).await;
    let sent = invocations();
    for target in ["/invocations", "/v1/completions"] {
        let ask = ask("p", target, 500);
        refused_after(
            proxy.addr,
            &ask,
            503,
            "queue_timeout",
            Duration::from_millis(500),
        )
        .await;
    }
    assert_eq!(invocations(), sent, "a request reached the full engine");
    // A waiting direct request is served once the stream ends.
    let addr = proxy.addr;
    let waiting = tokio::spawn(async move { raw(addr, &ask("p", "/invocations", 20_000)).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "served while the engine was full");
    drop(held);
    let served = waiting.await.unwrap();
    assert_eq!(
        served.status,
        200,
        "{}",
        String::from_utf8_lossy(&served.body)
    );
    // The control: without the limit, served alongside the stream at once.
    let proxy = start(false).await;
    let _held = held_stream(proxy.addr, &ask("hold me", "/invocations", 60_000)).await;
    let begun = Instant::now();
    let alongside = raw(proxy.addr, &ask("p", "/invocations", 5_000)).await;
    assert_eq!(alongside.status, 200);
    assert!(begun.elapsed() < Duration::from_secs(3));
}

/// Generation sent direct that waited for a global place (`--max-in-flight`) and then
/// waits for its engine's place (`--max-in-flight-per-endpoint`) is counted once in
/// `disagg_queued_total`, as an orchestrated request is: the proxy tells the router it
/// was queued already (`Router::place_queued`).
#[tokio::test]
async fn direct_generation_that_waited_for_admission_is_queued_once() {
    let engine = holding_engine().await;
    let url = engine.url();
    let args: Vec<String> = [
        "--prefill",
        &url,
        "--decode",
        &url,
        "--client-deadline",
        "--max-in-flight",
        "2",
        "--max-in-flight-per-endpoint",
        "1",
        "--queue-timeout",
        "30",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    let proxy = Proxy::start_args(&args).await;
    let addr = proxy.addr;
    let ask = |prompt: &str| streamed_with_deadline("/invocations", prompt, 20_000);
    let queued_reaches = |n: u64| {
        let proxy = &proxy;
        async move {
            let deadline = Instant::now() + Duration::from_secs(5);
            while proxy.metric("disagg_queued_total").await != n {
                assert!(
                    Instant::now() < deadline,
                    "disagg_queued_total never reached {n}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    // The first stream takes a global place and the engine's one place.
    let first = held_stream(addr, &ask("hold me")).await;
    // The second takes the other global place and waits for the engine's.
    let mut second = TcpStream::connect(addr).await.unwrap();
    second.write_all(ask("p").as_bytes()).await.unwrap();
    queued_reaches(1).await;
    // The third waits for a global place.
    let third = tokio::spawn({
        let request = ask("p");
        async move { raw(addr, &request).await }
    });
    queued_reaches(2).await;
    // The second's client leaves: the third takes the global place it gave back, and
    // waits for the engine's place, which the first still holds.
    drop(second);
    let deadline = Instant::now() + Duration::from_secs(5);
    while proxy.metric("disagg_queue_waiting").await != 1 {
        assert!(Instant::now() < deadline, "the second never left the queue");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!third.is_finished(), "served while the engine was full");
    assert_eq!(proxy.metric("disagg_queue_waiting").await, 1);
    assert_eq!(
        proxy.metric("disagg_queued_total").await,
        2,
        "the third request was counted again when it waited for the engine's place"
    );
    drop(first);
    let served = third.await.unwrap();
    assert_eq!(
        served.status,
        200,
        "{}",
        String::from_utf8_lossy(&served.body)
    );
    assert_eq!(proxy.metric("disagg_queued_total").await, 2);
}

/// Generation sent direct keeps the request's deadline, as an orchestrated request
/// does: its wait for a place, the engine's response head and its whole answer end
/// there (`--deadline`, shortened by the client's `x-disagg-deadline-ms` with
/// `--client-deadline`).
#[tokio::test]
async fn direct_generation_keeps_the_requests_deadline() {
    let engine = RawEngine::start_with(|request| {
        if request.contains("no head") {
            vec![Vec::new()]
        } else if request.contains("hold me") || request.starts_with("GET /v1/responses/") {
            vec![SSE_HEAD.to_vec(), b"data: {}\n\n".to_vec(), Vec::new()]
        } else {
            json_answer(r#"{"ok":true}"#)
        }
    })
    .await;
    let url = engine.url();
    let proxy = Proxy::start_args(
        &[
            "--prefill",
            &url,
            "--decode",
            &url,
            "--deadline",
            "30",
            "--client-deadline",
            "--max-in-flight",
            "1",
            "--queue-timeout",
            "30",
        ]
        .map(str::to_owned),
    )
    .await;
    let ask = |prompt: &str, ms: u64| streamed_with_deadline("/invocations", prompt, ms);
    let ms = Duration::from_millis;
    // No head by the deadline: 504 `deadline_exceeded`, at the deadline.
    let no_head = ask("no head", 300);
    refused_after(proxy.addr, &no_head, 504, "deadline_exceeded", ms(300)).await;
    // A stream still running at the deadline is cut there.
    let start = Instant::now();
    let cut = raw(proxy.addr, &ask("hold me", 400)).await;
    assert_eq!(cut.status, 200);
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_secs(5),
        "{took:?}"
    );
    // The place is taken by a held stream: the queue's wait ends at the deadline too,
    // not at the 30 s queue timeout.
    let held = held_stream(proxy.addr, &ask("hold me", 20_000)).await;
    refused_after(proxy.addr, &ask("p", 300), 503, "queue_timeout", ms(300)).await;
    // Retrieving a stored response (its stream resumed) is no generation: the
    // deadline does not cut it.
    drop(held);
    let resumed = "GET /v1/responses/resp_1?stream=true HTTP/1.1\r\nhost: x\r\nx-disagg-deadline-ms: 200\r\n\r\n";
    let mut open = held_stream(proxy.addr, resumed).await;
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_millis(800), open.read(&mut buf)).await;
    assert!(read.is_err(), "the resumed stream ended: {read:?}");
    // Without a deadline the same answers come whole.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let a = raw_request(
            proxy.addr,
            "POST",
            "/invocations",
            r#"{"model":"sim-model","prompt":"p"}"#,
        )
        .await;
        if a.status == 200 {
            assert_eq!(a.json()["ok"], true);
            break;
        }
        assert!(Instant::now() < deadline, "the place never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Send `head` then, `after` later, `body`, on a new connection; read until the proxy
/// closes it.
async fn late_body(addr: SocketAddr, head: &str, body: &str, after: Duration) -> Raw {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(head.as_bytes()).await.expect("send the head");
    if !body.is_empty() {
        tokio::time::sleep(after).await;
        s.write_all(body.as_bytes()).await.expect("send the body");
    }
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
        .await
        .expect("answered and closed within 10 s")
        .expect("read");
    parse_answer(&buf)
}

/// The deadline counts from the request's arrival (its head), on orchestrated and
/// direct routes alike: a body that takes longer than the deadline to come in leaves
/// the engines no time (504 `deadline_exceeded`, no leg sent), where the same body
/// sent at once is served.
#[tokio::test]
async fn the_deadline_counts_from_the_head_on_orchestrated_and_direct_routes() {
    let (p, d) = plain_pair().await;
    let sim = start(&p, &d, &["--client-deadline"]).await;
    let raw_engine = RawEngine::start_with(|_| json_answer(r#"{"ok":true}"#)).await;
    let url = raw_engine.url();
    let direct = Proxy::start_args(
        &["--prefill", &url, "--decode", &url, "--client-deadline"].map(str::to_owned),
    )
    .await;
    let direct_body = r#"{"model":"sim-model","prompt":"p"}"#.to_owned();
    let cases = [
        (sim.addr, "/v1/completions", completion("p", 2, false)),
        (sim.addr, "/v1/chat/completions", chat("p", 2, false)),
        (direct.addr, "/invocations", direct_body),
    ];
    for (addr, target, body) in cases {
        let head = |ms: u64| deadline_head(target, body.len(), ms);
        // The requests for `target` the engines received (not the simulated engines'
        // own traffic between them, which may come after the answer).
        let sent = || {
            let legs = received(&[&p, &d]).into_iter().filter(|r| r.path == target);
            legs.count() + bodies(&raw_engine).len()
        };
        let before = sent();
        let at_once = late_body(addr, &head(3000), &body, Duration::ZERO).await;
        assert_eq!(
            at_once.status,
            200,
            "{target}: {}",
            String::from_utf8_lossy(&at_once.body)
        );
        assert!(sent() > before, "{target}: no engine was asked");
        let before = sent();
        late_body(addr, &head(300), &body, Duration::from_millis(600))
            .await
            .assert_error(504, "deadline_exceeded");
        // A leg written in the last instant would be recorded a little later.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            sent(),
            before,
            "{target}: an engine was asked past the deadline"
        );
    }
}

// === 4. every body under the clock ===

/// Send a head announcing 1000 bytes to `target`, then trickle them a byte every 100
/// ms: the answer, and whether the proxy then closed the connection, within 5 s.
async fn trickle(addr: SocketAddr, target: &str) -> (Raw, Duration) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {target} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{{"
    );
    let start = Instant::now();
    s.write_all(head.as_bytes()).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    let writer = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if wr.write_all(b" ").await.is_err() {
                return;
            }
        }
    });
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), rd.read_to_end(&mut buf)).await;
    writer.abort();
    assert!(
        read.is_ok(),
        "{target}: the connection stayed open: {}",
        String::from_utf8_lossy(&buf)
    );
    (parse_answer(&buf), start.elapsed())
}

#[tokio::test]
async fn a_trickled_body_is_cut_by_the_body_timeout_on_every_route() {
    let (p, d) = plain_pair().await;
    let proxy = start(&p, &d, &["--body-timeout", "0.5", "--admin-routes"]).await;
    // Forwarded (two), direct (two), fanned out, orchestrated (two: `/v1/responses`
    // is orchestrated, the paths below it are direct).
    for target in [
        "/tokenize",
        "/v1/embeddings",
        "/invocations",
        "/v1/responses/resp_1/cancel",
        "/v1/load_lora_adapter",
        "/v1/responses",
        "/v1/completions",
    ] {
        let (a, took) = trickle(proxy.addr, target).await;
        a.assert_error(408, "request_timeout");
        assert_eq!(
            a.header("connection"),
            Some("close"),
            "{target}: {}",
            a.head
        );
        assert!(took < Duration::from_secs(3), "{target}: {took:?}");
    }
    // The bodies read whole before anything is sent reached no engine.
    assert_eq!(d.stats().admin_requests + p.stats().admin_requests, 0);
    assert_eq!(p.stats().requests, 0);
    let reached: Vec<String> = received(&[&p, &d]).into_iter().map(|r| r.path).collect();
    assert!(reached.is_empty(), "{reached:?}");
}

#[tokio::test]
async fn a_forwarded_body_past_the_size_limit_is_413() {
    let (p, d) = plain_pair().await;
    let proxy = start(&p, &d, &["--max-body-bytes", "1000"]).await;
    let big = format!(
        r#"{{"model":"sim-model","prompt":"{}"}}"#,
        "a ".repeat(2000)
    );
    // Forwarded, direct (two), orchestrated.
    for target in [
        "/tokenize",
        "/invocations",
        "/v1/responses/resp_1/cancel",
        "/v1/responses",
    ] {
        let a = raw_request(proxy.addr, "POST", target, &big).await;
        a.assert_error(413, "request_too_large");
        assert_eq!(a.header("connection"), Some("close"), "{}", a.head);
    }
    let small = raw_request(proxy.addr, "POST", "/tokenize", r#"{"prompt":"a b"}"#).await;
    assert_eq!(small.status, 200);
}

#[tokio::test]
async fn a_silent_or_stalled_engine_is_cut_on_a_forwarded_route() {
    // Silent: never a head.
    let silent = RawEngine::start(vec![Vec::new()]).await;
    let p = engine(SimConfig::default()).await;
    let proxy = Proxy::start_args(&[
        "--prefill".to_owned(),
        p.url(),
        "--decode".to_owned(),
        silent.url(),
        "--decode-timeout".to_owned(),
        "0.5".to_owned(),
    ])
    .await;
    let start = Instant::now();
    let a = post(&proxy.url(), "/tokenize", r#"{"prompt":"x"}"#).await;
    a.assert_error(504, "decode_timeout");
    assert!(start.elapsed() < Duration::from_secs(3));
    assert!(a.text().contains(&silent.url()), "{}", a.text());
    drop(proxy);

    // Stalled: a head and one event, then nothing.
    let first = b"data: {\"type\":\"response.created\"}\n\n".to_vec();
    let stalled = RawEngine::start(vec![SSE_HEAD.to_vec(), first, Vec::new()]).await;
    let proxy = Proxy::start_args(&[
        "--prefill".to_owned(),
        p.url(),
        "--decode".to_owned(),
        stalled.url(),
        "--decode-idle-timeout".to_owned(),
        "0.5".to_owned(),
    ])
    .await;
    let start = Instant::now();
    let a = post(&proxy.url(), "/v1/audio/translations", r#"{"stream":true}"#).await;
    assert_eq!(a.status, 200);
    let events = a.events();
    assert_eq!(events[0], "{\"type\":\"response.created\"}");
    let last: serde_json::Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "decode_stream_failed", "{last}");
    assert!(start.elapsed() < Duration::from_secs(3));
}

/// Passive health hears the forwarded and direct routes: a decode engine that refuses
/// connections behind them is ejected after five failures in a row (the default
/// threshold), and the fewest-in-flight pick stops sending it every other request (a
/// refused connection fails at once, so its in-flight count stays 0). The simulated
/// engine serves `/v1/embeddings` and has no `/invocations` (its 404 is its answer).
#[tokio::test]
async fn a_decode_refusing_connections_is_ejected_from_forwarded_and_direct_routes() {
    for (target, answered) in [("/v1/embeddings", 200), ("/invocations", 404)] {
        let (p, d) = plain_pair().await;
        let refusing = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}", l.local_addr().unwrap())
        };
        let proxy = Proxy::start_args(&[
            "--prefill".to_owned(),
            p.url(),
            "--decode".to_owned(),
            d.url(),
            "--decode".to_owned(),
            refusing.clone(),
        ])
        .await;
        let body = r#"{"model":"sim-model","input":"x"}"#;
        let mut failures = 0;
        for _ in 0..30 {
            let a = post(&proxy.url(), target, body).await;
            match a.status.as_u16() {
                502 => failures += 1,
                s if s == answered => {}
                _ => panic!("{target}: {}", a.text()),
            }
            if failures == 5 {
                break;
            }
        }
        assert_eq!(failures, 5, "{target}");
        for _ in 0..10 {
            let a = post(&proxy.url(), target, body).await;
            assert_eq!(a.status, answered, "{target}: asked again: {}", a.text());
        }
    }
}

// === 5. answers stay the proxy's ===

#[tokio::test]
async fn encoded_answers_and_redirects_become_502_naming_the_engine() {
    let gzip_json = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\ncontent-length: 4\r\nconnection: close\r\n\r\n\x1f\x8b\x08\x00".to_vec();
    let gzip_audio = b"HTTP/1.1 200 OK\r\ncontent-type: audio/wav\r\ncontent-encoding: gzip\r\ncontent-length: 4\r\nconnection: close\r\n\r\n\x1f\x8b\x08\x00".to_vec();
    let redirect = b"HTTP/1.1 307 Temporary Redirect\r\nlocation: http://10.9.8.7:8200/internal/v1/x\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_vec();
    let raw_engine = RawEngine::start_with(move |head| {
        let h = head.to_ascii_lowercase();
        vec![if h.contains("/audio") {
            gzip_audio.clone()
        } else if h.contains("/redirect") || h.contains("/v1/chat") {
            redirect.clone()
        } else {
            gzip_json.clone()
        }]
    })
    .await;
    let p = engine(SimConfig::default()).await;
    let proxy = Proxy::start_args(&[
        "--prefill".to_owned(),
        p.url(),
        "--decode".to_owned(),
        raw_engine.url(),
    ])
    .await;
    let url = proxy.url();
    // An encoding the client never asked for (and the proxy cannot read).
    for accept in [None, Some("gzip")] {
        let h: Vec<(&str, &str)> = accept.map(|a| ("accept-encoding", a)).into_iter().collect();
        let a = post_with(&url, "/tokenize", "{}", &h).await;
        a.assert_error(502, "decode_failed");
        assert!(a.text().contains(&raw_engine.url()), "{}", a.text());
    }
    // An encoded answer of another kind: relayed only when the client accepts it.
    let a = post(&url, "/v1/audio/speech", "{}").await;
    a.assert_error(502, "decode_failed");
    let a = post_with(
        &url,
        "/v1/audio/speech",
        "{}",
        &[("accept-encoding", "br, gzip")],
    )
    .await;
    assert_eq!(a.status, 200);
    assert_eq!(a.header("content-encoding"), Some("gzip"));
    // The engines were never asked to encode.
    assert!(
        raw_engine
            .heads()
            .iter()
            .all(|h| !h.to_ascii_lowercase().contains("accept-encoding")),
        "{:?}",
        raw_engine.heads()
    );
    // A redirect, forwarded or on the decode leg: its internal address never shows.
    for (path, body) in [
        ("/redirect", "{}".to_owned()),
        ("/v1/chat/completions", chat("redirected", 3, false)),
    ] {
        let a = post(&url, path, &body).await;
        a.assert_error(502, "decode_failed");
        assert!(a.text().contains(&raw_engine.url()), "{}", a.text());
        assert!(a.header("location").is_none());
        assert!(!a.text().contains("10.9.8.7"), "{}", a.text());
    }
}

// === PdLayer over real sockets ===

#[tokio::test]
async fn the_layer_routes_and_passes_on_the_normal_path() {
    use disagg_connectors::vllm::VllmNixl;
    use disagg_core::{Endpoint, Orchestrator, Role, source::StaticSource};
    use disagg_http::{HttpTransport, PdLayer};

    let (p, d) = plain_pair().await;
    let source = StaticSource::new([
        Endpoint::new(&p.url(), Role::Prefill).unwrap(),
        Endpoint::new(&d.url(), Role::Decode).unwrap(),
    ]);
    let layer = PdLayer::gateway(
        Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new()).build(),
    );
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let inner_seen = Arc::clone(&seen);
    let inner = tower::service_fn(move |req: http::Request<hyper::body::Incoming>| {
        let seen = Arc::clone(&inner_seen);
        async move {
            seen.lock().unwrap().push(req.uri().to_string());
            Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from_static(b"inner"))))
        }
    });
    let service = tower::Layer::layer(&layer, inner);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(disagg_http::server::Builder::new().serve(
        listener,
        service,
        std::future::pending(),
    ));

    let a = raw_request(
        addr,
        "POST",
        "/v1/chat//completions",
        &chat("layer", 3, false),
    )
    .await;
    assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
    let a = raw_request(addr, "GET", "/x/../%68ealth/.?a=%2F", "").await;
    assert_eq!(a.body, b"inner");
    raw_request(addr, "GET", "/health%2F", "")
        .await
        .assert_error(400, "invalid_path");
    assert_eq!(*seen.lock().unwrap(), ["/health/?a=%2F"]);
    assert_eq!(d.stats().remote_decodes, 1);
}
