//! Shared test support: simulated engines and a proxy on real loopback sockets.
#![allow(dead_code, unreachable_pub, missing_docs)] // each test binary uses a part

use std::time::Duration;

use bytes::Bytes;
use disagg_core::orchestrator::OrchestratorConfig;
use std::sync::Arc;

use disagg_core::endpoint::Facts;
use disagg_core::policy::Disaggregate;
use disagg_core::{Endpoint, KvConnector, Orchestrator, Role, source::StaticSource};
use disagg_http::{HttpTransport, PdService, PdServiceConfig};
use disagg_sim::{KvMode, SimConfig, SimEngine, SimRole};
use http::{HeaderMap, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// A proxy over simulated engines, all on 127.0.0.1 with ephemeral ports.
pub struct Stack {
    pub prefill: Vec<SimEngine>,
    pub decode: Vec<SimEngine>,
    pub url: String,
    /// The proxy's endpoint source: its endpoints carry the live in-flight counts, and
    /// a test may change the set.
    pub source: std::sync::Arc<StaticSource>,
    /// The proxy's orchestrator, for its counters.
    pub orchestrator: Orchestrator,
    /// [`Protocol::Lmcache`]: the proxy's notification listener, for its registry.
    pub notifications: Option<disagg_connectors::lmcache::Notifications>,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for Stack {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

/// The P/D protocol a stack's engines and proxy speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// vLLM NIXL (sequential).
    Nixl,
    /// SGLang bootstrap (concurrent).
    Sglang,
    /// vLLM Mooncake (concurrent).
    Mooncake,
    /// vLLM NIXL in push mode (`NixlPushConnector`): the decode registers with the
    /// prefill by the request id, which must be the same on both legs and unique.
    NixlPush,
    /// vLLM with LMCache's P/D mode (sequential: the prefill pushes the KV to the
    /// decode's receiver and notifies the proxy over ZMQ). Decode engines keep their
    /// configured `lmcache_receiver` (one TP rank by default).
    Lmcache,
}

impl Protocol {
    fn modes(self) -> (KvMode, KvMode) {
        match self {
            Protocol::Nixl => (KvMode::Nixl, KvMode::Nixl),
            Protocol::NixlPush => (KvMode::NixlPush, KvMode::NixlPush),
            Protocol::Sglang => (
                KvMode::Sglang(SimRole::Prefill),
                KvMode::Sglang(SimRole::Decode),
            ),
            Protocol::Mooncake => (
                KvMode::Mooncake(SimRole::Prefill),
                KvMode::Mooncake(SimRole::Decode),
            ),
            Protocol::Lmcache => (
                KvMode::Lmcache(SimRole::Prefill),
                KvMode::Lmcache(SimRole::Decode),
            ),
        }
    }

    /// The protocol's connector; LMCache's listens on `notifications`.
    fn connector(
        self,
        notifications: Option<&disagg_connectors::lmcache::Notifications>,
    ) -> Arc<dyn KvConnector> {
        match self {
            Protocol::Nixl | Protocol::NixlPush => {
                Arc::new(disagg_connectors::vllm::VllmNixl::new())
            }
            Protocol::Sglang => Arc::new(disagg_connectors::sglang::SglangBootstrap::new()),
            Protocol::Mooncake => Arc::new(disagg_connectors::vllm::VllmMooncake::new()),
            Protocol::Lmcache => Arc::new(disagg_connectors::lmcache::Lmcache::new(
                notifications
                    .expect("an LMCache stack binds its notification listener")
                    .clone(),
            )),
        }
    }
}

/// Where an LMCache decode engine receives KV, as the proxy's endpoint carries it.
pub fn lmcache_receiver(decode: &SimEngine) -> disagg_connectors::lmcache::LmcacheReceiver {
    disagg_connectors::lmcache::LmcacheReceiver::new(
        "127.0.0.1",
        decode.lmcache_init_ports(),
        decode.lmcache_alloc_ports(),
    )
    .expect("the engine's receiver ports")
}

pub struct StackBuilder {
    protocol: Protocol,
    router: Option<Box<dyn disagg_core::Router>>,
    prefill: Vec<SimConfig>,
    decode: Vec<SimConfig>,
    extra_prefill_urls: Vec<String>,
    config: OrchestratorConfig,
    retry: Option<disagg_resilience::RetryPolicy>,
    admission: Option<disagg_resilience::AdmissionConfig>,
    per_endpoint: Option<usize>,
    service: PdServiceConfig,
    disaggregate: Option<Arc<dyn Disaggregate>>,
    declare_models: bool,
    ranks: (u32, u32),
    connector: Option<Arc<dyn KvConnector>>,
    notifications: Option<disagg_connectors::lmcache::Notifications>,
    listeners: Vec<Arc<dyn disagg_core::outcome::Listener>>,
}

impl Stack {
    /// One prefill and one decode engine with default settings.
    pub async fn start() -> Stack {
        Stack::builder().build().await
    }

    pub fn builder() -> StackBuilder {
        StackBuilder {
            protocol: Protocol::Nixl,
            router: None,
            prefill: vec![SimConfig::default()],
            decode: vec![SimConfig::default()],
            extra_prefill_urls: Vec::new(),
            config: OrchestratorConfig::default(),
            retry: None,
            admission: None,
            per_endpoint: None,
            service: PdServiceConfig::default(),
            disaggregate: None,
            declare_models: false,
            ranks: (1, 1),
            connector: None,
            notifications: None,
            listeners: Vec::new(),
        }
    }

    pub fn p(&self) -> &SimEngine {
        &self.prefill[0]
    }

    pub fn d(&self) -> &SimEngine {
        &self.decode[0]
    }

    /// Requests the proxy counts in flight, over every endpoint.
    pub fn in_flight(&self) -> usize {
        use disagg_core::EndpointSource;
        let set = self.source.snapshot();
        set.by_role(Role::Prefill)
            .iter()
            .chain(set.by_role(Role::Decode))
            .map(|e| e.in_flight())
            .sum()
    }
}

impl StackBuilder {
    /// Engines and proxy speak `protocol`: the engines' `kv_mode` is set by role, the
    /// proxy gets the matching connector, and each prefill endpoint its bootstrap port.
    pub fn protocol(mut self, protocol: Protocol) -> Self {
        self.protocol = protocol;
        self
    }

    pub fn prefill(mut self, configs: Vec<SimConfig>) -> Self {
        self.prefill = configs;
        self
    }

    pub fn decode(mut self, configs: Vec<SimConfig>) -> Self {
        self.decode = configs;
        self
    }

    /// A prefill endpoint URL with no engine behind it (connection refused).
    pub fn dead_prefill(mut self, url: String) -> Self {
        self.extra_prefill_urls.push(url);
        self
    }

    /// The proxy uses `connector` instead of the protocol's default one (the engines
    /// still speak the protocol).
    pub fn connector(mut self, connector: impl KvConnector) -> Self {
        self.connector = Some(Arc::new(connector));
        self
    }

    pub fn router(mut self, router: impl disagg_core::Router) -> Self {
        self.router = Some(Box::new(router));
        self
    }

    pub fn config(mut self, f: impl FnOnce(&mut OrchestratorConfig)) -> Self {
        f(&mut self.config);
        self
    }

    /// Retry failed attempts as `policy` says (`disagg_resilience::Backoff`).
    pub fn retry(mut self, policy: disagg_resilience::RetryPolicy) -> Self {
        self.retry = Some(policy);
        self
    }

    /// Limit admission as `config` says (`disagg_resilience::Limits`).
    pub fn admission(mut self, config: disagg_resilience::AdmissionConfig) -> Self {
        self.admission = Some(config);
        self
    }

    /// At most `limit` requests in flight on one endpoint
    /// (`disagg_resilience::Limits::per_endpoint`, decorating the router), waiting in
    /// the admission's queue.
    pub fn per_endpoint(mut self, limit: usize) -> Self {
        self.per_endpoint = Some(limit);
        self
    }

    pub fn service(mut self, f: impl FnOnce(&mut PdServiceConfig)) -> Self {
        f(&mut self.service);
        self
    }

    /// Another listener of the orchestrator's reports and summaries.
    pub fn listener(mut self, listener: impl disagg_core::outcome::Listener) -> Self {
        self.listeners.push(Arc::new(listener));
        self
    }

    pub fn disaggregate(mut self, hook: impl Disaggregate) -> Self {
        self.disaggregate = Some(Arc::new(hook));
        self
    }

    /// Each endpoint declares its engine's model (`SimConfig::model`), so the proxy
    /// routes by model.
    pub fn declare_models(mut self) -> Self {
        self.declare_models = true;
        self
    }

    /// Every prefill engine is configured as `prefill` data-parallel ranks
    /// (`URL@0`...), every decode engine as `decode` ranks; 1 names no rank.
    pub fn ranks(mut self, prefill: u32, decode: u32) -> Self {
        self.ranks = (prefill, decode);
        self
    }

    pub async fn build(mut self) -> Stack {
        let (p_mode, d_mode) = self.protocol.modes();
        if self.protocol == Protocol::Lmcache {
            let n = disagg_connectors::lmcache::Notifications::bind(
                "127.0.0.1:0",
                disagg_connectors::lmcache::NotifyConfig::default(),
            )
            .await
            .expect("bind the LMCache notification socket");
            self.notifications = Some(n);
        }
        let notify_addr = self
            .notifications
            .as_ref()
            .and_then(|n| n.local_addr())
            .map(|a| a.to_string());
        let mut prefill = Vec::new();
        for c in std::mem::take(&mut self.prefill) {
            let c = SimConfig {
                kv_mode: p_mode,
                lmcache_proxy: notify_addr.clone(),
                ..c
            };
            prefill.push(SimEngine::start(c).await.expect("start prefill sim"));
        }
        let mut decode = Vec::new();
        for c in std::mem::take(&mut self.decode) {
            let c = SimConfig {
                kv_mode: d_mode,
                ..c
            };
            decode.push(SimEngine::start(c).await.expect("start decode sim"));
        }
        self.build_with(prefill, decode).await
    }

    /// The proxy in front of engines already started (the configs given are ignored).
    pub async fn build_with(self, prefill: Vec<SimEngine>, decode: Vec<SimEngine>) -> Stack {
        let declare = self.declare_models;
        let endpoints_of = |e: &SimEngine, role: Role, ranks: u32| -> Vec<Endpoint> {
            let urls: Vec<String> = match ranks {
                0 | 1 => vec![e.url()],
                n => (0..n).map(|r| format!("{}@{r}", e.url())).collect(),
            };
            let bootstrap = e.bootstrap_addr().filter(|_| role == Role::Prefill);
            let receiver = (e.config().kv_mode == KvMode::Lmcache(SimRole::Decode))
                .then(|| lmcache_receiver(e));
            urls.iter()
                .map(|url| {
                    let mut facts = Facts::default();
                    if let Some(b) = bootstrap {
                        facts
                            .insert(Facts::BOOTSTRAP_PORT, b.port().to_string())
                            .unwrap();
                    }
                    if let Some(r) = &receiver {
                        facts.insert(Facts::KV_RECEIVER, r.to_string()).unwrap();
                    }
                    let ep = Endpoint::new(url, role).unwrap().with_facts(facts);
                    if declare {
                        ep.with_models([e.config().model.as_str()])
                    } else {
                        ep
                    }
                })
                .collect()
        };
        let mut endpoints = Vec::new();
        for e in &prefill {
            endpoints.extend(endpoints_of(e, Role::Prefill, self.ranks.0));
        }
        for u in &self.extra_prefill_urls {
            // A dead prefill's bootstrap port is dead too: its own port, where nothing
            // listens.
            let port = u.rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
            let mut facts = Facts::default();
            if let Some(port) = port {
                facts
                    .insert(Facts::BOOTSTRAP_PORT, port.to_string())
                    .unwrap();
            }
            endpoints.push(Endpoint::new(u, Role::Prefill).unwrap().with_facts(facts));
        }
        for e in &decode {
            endpoints.extend(endpoints_of(e, Role::Decode, self.ranks.1));
        }
        let source = std::sync::Arc::new(StaticSource::new(endpoints));
        let mut builder = Orchestrator::builder(
            std::sync::Arc::clone(&source),
            HttpTransport::default(),
            self.connector
                .unwrap_or_else(|| self.protocol.connector(self.notifications.as_ref())),
        )
        .config(self.config);
        if let Some(hook) = self.disaggregate {
            builder = builder.disaggregate(hook);
        }
        for l in self.listeners {
            builder = builder.listener(l);
        }
        if let Some(policy) = self.retry {
            builder = builder.retry(disagg_resilience::Backoff::new(policy));
        }
        let admission = match (self.admission, self.per_endpoint) {
            (None, Some(_)) => Some(disagg_resilience::AdmissionConfig::default()),
            (a, _) => a,
        };
        let limits = admission.map(disagg_resilience::Limits::new);
        if let Some(l) = &limits {
            builder = builder.admission(l.clone());
        }
        let orchestrator = match (self.router, &limits, self.per_endpoint) {
            // A per-endpoint limit decorates the router.
            (router, Some(l), Some(limit)) => {
                // The orchestrator's default, spelled out: round robin per role.
                let router = router.unwrap_or_else(|| {
                    Box::new(disagg_affinity::PerLeg::both(
                        disagg_affinity::RoundRobin::new,
                    ))
                });
                builder
                    .router(l.per_endpoint(BoxedRouter(router), limit))
                    .build()
            }
            (Some(router), _, _) => builder.router(BoxedRouter(router)).build(),
            // The orchestrator's own default: round robin over each role.
            (None, _, _) => builder.build(),
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = oneshot::channel::<()>();
        let svc = PdService::with_config(orchestrator.clone(), self.service);
        tokio::spawn(
            disagg_http::server::Builder::new().serve(listener, svc, async {
                let _ = rx.await;
            }),
        );
        Stack {
            prefill,
            decode,
            url,
            source,
            orchestrator,
            notifications: self.notifications,
            stop: Some(tx),
        }
    }
}

struct BoxedRouter(Box<dyn disagg_core::Router>);

impl disagg_core::Router for BoxedRouter {
    fn select(
        &self,
        req: &disagg_core::router::RequestView<'_>,
        set: &disagg_core::endpoint::EndpointSet,
    ) -> Result<disagg_core::router::Route, disagg_core::error::RouteError> {
        self.0.select(req, set)
    }

    fn select_direct(
        &self,
        req: &disagg_core::router::RequestView<'_>,
        set: &disagg_core::endpoint::EndpointSet,
    ) -> Result<disagg_core::router::Route, disagg_core::error::RouteError> {
        self.0.select_direct(req, set)
    }

    fn observe(&self, route: &disagg_core::router::Route, outcome: disagg_core::outcome::Outcome) {
        self.0.observe(route, outcome)
    }
}

/// `orchestrator` behind a `PdService` on a loopback port: its URL, and the sender that
/// stops it (dropping the sender stops it too).
pub async fn serve_proxy(orchestrator: Orchestrator) -> (String, oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(disagg_http::server::Builder::new().serve(
        listener,
        PdService::new(orchestrator),
        async {
            let _ = rx.await;
        },
    ));
    (url, tx)
}

pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The SSE `data:` payloads, `[DONE]` included as a string.
    pub fn events(&self) -> Vec<String> {
        sse_payloads(&self.body)
    }

    /// The text of a chat or completion answer, streamed or not.
    pub fn content(&self) -> String {
        if self
            .header("content-type")
            .is_some_and(|c| c.starts_with("text/event-stream"))
        {
            let mut out = String::new();
            for e in self.events() {
                if e == "[DONE]" {
                    continue;
                }
                let v: serde_json::Value = serde_json::from_str(&e).unwrap();
                for c in v["choices"].as_array().into_iter().flatten() {
                    if let Some(t) = c["delta"]["content"].as_str() {
                        out.push_str(t);
                    }
                    if let Some(t) = c["text"].as_str() {
                        out.push_str(t);
                    }
                }
            }
            out
        } else {
            let v = self.json();
            let c = &v["choices"][0];
            c["message"]["content"]
                .as_str()
                .or_else(|| c["text"].as_str())
                .unwrap_or_default()
                .to_owned()
        }
    }
}

/// Each event's data, as a server-sent events client reads it: the events are split at
/// blank lines (`\n\n`, `\r\n\r\n`), and an event's `data:` lines (after other fields
/// such as `event:`, one space after the colon dropped) are joined with newlines; an
/// event with no data line (a comment, a lone `event:`) is none.
pub fn sse_payloads(body: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(body).replace("\r\n", "\n");
    text.split("\n\n")
        .filter_map(|ev| {
            let data: Vec<&str> = ev
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            (!data.is_empty()).then(|| data.join("\n"))
        })
        .collect()
}

/// POST `body` to `base + path` and read the whole answer.
pub async fn post(
    base: &str,
    path: &str,
    body: impl Into<Bytes>,
    headers: &[(&str, &str)],
) -> Answer {
    let f = fetch_with(base, path, body, headers).await;
    Answer {
        status: f.status,
        headers: f.headers,
        body: f.body.unwrap_or_else(|e| panic!("body broke: {e}")),
    }
}

pub async fn get(base: &str, path: &str) -> Answer {
    let req = http::Request::get(format!("{base}{path}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = client().request(req).await.expect("request sent");
    let (parts, body) = resp.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

pub fn chat(content: &str, max_tokens: u32, stream: bool) -> String {
    serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
    .to_string()
}

pub fn completion(prompt: &str, max_tokens: u32, stream: bool) -> String {
    serde_json::json!({
        "model": "sim-model",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": stream,
    })
    .to_string()
}

/// Assert an OpenAI-format error with `status` and `code`.
pub fn assert_openai_error(a: &Answer, status: u16, code: &str) {
    assert_eq!(a.status.as_u16(), status, "body: {}", a.text());
    let v = a.json();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert_eq!(e["code"], code, "{v}");
}

/// Wait until `f` holds, polling every 10 ms, up to `limit`.
pub async fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    f()
}

/// Send a raw HTTP/1.1 POST (no client library in between) and return the open socket,
/// for tests that read the wire themselves or hang up mid-answer.
pub async fn raw_request(base: &str, path: &str, body: &str) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let addr = base.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    s
}

impl StackBuilder {
    /// Build the stack with one decode endpoint at `url`, where nothing listens
    /// (connection refused), and no decode engine; the decode configs given are
    /// ignored.
    pub async fn build_with_dead_decode(self, url: String) -> Stack {
        let stack = self.decode(vec![]).build().await;
        stack
            .source
            .insert(Endpoint::new(&url, Role::Decode).expect("dead decode endpoint"));
        stack
    }
}

/// An answer whose body may have broken: the head, and the body or how it broke.
pub struct Fetched {
    pub status: StatusCode,
    pub headers: HeaderMap,
    /// The whole body, or the error that ended it early.
    pub body: Result<Bytes, String>,
}

/// POST `body` to `base + path` and read the answer, keeping a broken body as an error
/// instead of panicking (for tests of answers that break mid-body).
pub async fn fetch(base: &str, path: &str, body: impl Into<Bytes>) -> Fetched {
    fetch_with(base, path, body, &[]).await
}

/// [`fetch`] with extra request headers.
async fn fetch_with(
    base: &str,
    path: &str,
    body: impl Into<Bytes>,
    headers: &[(&str, &str)],
) -> Fetched {
    let mut req =
        http::Request::post(format!("{base}{path}")).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(body.into())).unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(20), client().request(req))
        .await
        .expect("answer head in time")
        .expect("request sent");
    let (parts, body) = resp.into_parts();
    let body = tokio::time::timeout(Duration::from_secs(20), body.collect())
        .await
        .expect("answer body ends in time")
        .map(|c| c.to_bytes())
        .map_err(|e| e.to_string());
    Fetched {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

/// A URL on 127.0.0.1 where nothing listens (connection refused), and the socket that
/// holds its port: bound, never listening, so no other listener of the test process
/// can take the port while the socket lives (a port bound, released and used later
/// may be given meanwhile to a stack started beside the test). Keep the socket to the
/// end of the test, or `listen` on it to bring the port to life.
pub fn held_dead_url() -> (String, tokio::net::TcpSocket) {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind("127.0.0.1:0".parse().expect("address"))
        .expect("bind");
    let url = format!("http://{}", socket.local_addr().expect("bound address"));
    (url, socket)
}

/// What the orchestrator's listeners heard: every request's summary and every
/// attempt's report, kept in the order told.
#[derive(Debug, Clone, Default)]
pub struct Heard {
    summaries: Arc<std::sync::Mutex<Vec<disagg_core::outcome::Summary>>>,
    reports: Arc<std::sync::Mutex<Vec<disagg_core::outcome::Report>>>,
}

impl Heard {
    /// The first `n` summaries, once that many requests ended (within 2 s).
    pub async fn first(&self, n: usize) -> Vec<disagg_core::outcome::Summary> {
        let all = || self.summaries.lock().unwrap().len() >= n;
        assert!(
            eventually(Duration::from_secs(2), all).await,
            "requests not ended"
        );
        self.summaries.lock().unwrap()[..n].to_vec()
    }

    /// The reports told so far.
    pub fn reports(&self) -> Vec<disagg_core::outcome::Report> {
        self.reports.lock().unwrap().clone()
    }

    /// The first report told whose decode leg was sent.
    pub fn decode_attempt(&self) -> disagg_core::outcome::Report {
        let reports = self.reports();
        let sent = reports
            .iter()
            .find(|r| r.decode != disagg_core::outcome::LegOutcome::NotSent);
        sent.cloned()
            .unwrap_or_else(|| panic!("no decode leg sent: {reports:?}"))
    }
}

impl disagg_core::outcome::Listener for Heard {
    fn on_request(&self, summary: &disagg_core::outcome::Summary) {
        self.summaries.lock().unwrap().push(summary.clone());
    }

    fn on_report(&self, report: &disagg_core::outcome::Report) {
        self.reports.lock().unwrap().push(report.clone());
    }
}
