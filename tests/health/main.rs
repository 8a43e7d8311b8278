//! Endpoint health over real loopback sockets: active checks against simulated engines
//! and a server whose `/health` answer a test flips, and passive ejection seen through a
//! proxy routing from a `HealthSource`.

#[path = "../support/mod.rs"]
mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use disagg_affinity::{PerLeg, RoundRobin};
use disagg_connectors::vllm::VllmNixl;
use disagg_core::orchestrator::PrefillFailure;
use disagg_core::transport::Transport;
use disagg_core::{
    Endpoint, EndpointSource, Orchestrator, Role, orchestrator::OrchestratorConfig,
    source::StaticSource,
};
use disagg_http::{HttpTransport, PdService};
use disagg_resilience::{EndpointHealth, HealthConfig, HealthSource};
use disagg_sim::{SimConfig, SimEngine};
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use support::*;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};

/// Short active-check timings, so a test takes a second, not a minute.
fn fast_checks() -> HealthConfig {
    let mut config = HealthConfig::default();
    config.checks.interval = Duration::from_millis(100);
    config.checks.timeout = Duration::from_millis(200);
    config
}

/// Slack for a loaded 2-core machine on top of each expected time.
const SLACK: Duration = Duration::from_millis(1_500);

/// Polls `cond` every 10 ms until it holds; the time it took. Panics after `limit`.
async fn eventually(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    start.elapsed()
}

fn ids(eps: &[Arc<Endpoint>]) -> Vec<String> {
    eps.iter().map(|e| e.id().to_string()).collect()
}

/// Runs the source's active checks over the HTTP transport until the sender drops.
fn spawn_checks(source: &HealthSource) -> watch::Sender<bool> {
    let (stop_tx, stop) = watch::channel(false);
    tokio::spawn(Arc::clone(source.health()).run_checks(HttpTransport::default(), stop));
    stop_tx
}

/// A server whose `GET /health` answers the status in `status` (0: never answers),
/// counting the checks.
struct Flip {
    url: String,
    status: Arc<AtomicU16>,
    hits: Arc<AtomicUsize>,
}

async fn flip_server() -> Flip {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let status = Arc::new(AtomicU16::new(200));
    let hits = Arc::new(AtomicUsize::new(0));
    let (s, h) = (Arc::clone(&status), Arc::clone(&hits));
    tokio::spawn(async move {
        while let Ok((io, _)) = listener.accept().await {
            let (s, h) = (Arc::clone(&s), Arc::clone(&h));
            let svc = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                let (s, h) = (Arc::clone(&s), Arc::clone(&h));
                async move {
                    assert_eq!(req.uri().path(), "/health");
                    h.fetch_add(1, Ordering::SeqCst);
                    let code = s.load(Ordering::SeqCst);
                    if code == 0 {
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                    }
                    let mut resp = http::Response::new(Full::new(Bytes::from_static(b"{}")));
                    *resp.status_mut() = http::StatusCode::from_u16(code).unwrap();
                    Ok::<_, Infallible>(resp)
                }
            });
            tokio::spawn(http1::Builder::new().serve_connection(TokioIo::new(io), svc));
        }
    });
    Flip { url, status, hits }
}

#[tokio::test]
async fn a_working_engine_stays_and_a_dead_port_goes_down_until_an_engine_starts_there() {
    let engine = SimEngine::start(SimConfig::default()).await.unwrap();
    // Held (bound, not listening) until the engine that revives it listens on it.
    let (dead, held) = held_dead_url();
    let inner = StaticSource::new([
        Endpoint::new(&engine.url(), Role::Prefill).unwrap(),
        Endpoint::new(&dead, Role::Prefill).unwrap(),
        Endpoint::new(&engine.url(), Role::Decode).unwrap(),
    ]);
    let config = fast_checks();
    let source = HealthSource::new(inner, config.clone());
    let _stop = spawn_checks(&source);
    let checks = &config.checks;

    let took = eventually(
        checks.interval * checks.unhealthy_threshold + SLACK,
        "dead port taken out",
        || source.snapshot().by_role(Role::Prefill).len() == 1,
    )
    .await;
    assert!(
        took >= checks.interval,
        "two failed checks, not one: {took:?}"
    );
    assert_eq!(
        ids(source.snapshot().by_role(Role::Prefill)),
        [engine.url()]
    );
    let states = source.health().states();
    assert_eq!(states[1].0.as_str(), dead);
    assert_eq!(states[1].2, EndpointHealth::Down);

    // Several more rounds: the working engine stays in.
    tokio::time::sleep(checks.interval * 5).await;
    let set = source.snapshot();
    assert_eq!(ids(set.by_role(Role::Prefill)), [engine.url()]);
    assert_eq!(ids(set.by_role(Role::Decode)), [engine.url()]);
    assert!(engine.stats().requests == 0, "checks are no completions");

    // An engine starts on the dead port, through the socket that held it: back after
    // one passed check.
    let http = held.listen(1024).unwrap();
    let addr: SocketAddr = dead.trim_start_matches("http://").parse().unwrap();
    assert_eq!(http.local_addr().unwrap(), addr);
    let side = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let _revived = SimEngine::start_on(SimConfig::default(), http, side)
        .await
        .unwrap();
    eventually(
        checks.interval * checks.healthy_threshold + SLACK,
        "revived engine back",
        || source.snapshot().by_role(Role::Prefill).len() == 2,
    )
    .await;
    assert!(
        source
            .health()
            .states()
            .iter()
            .all(|(_, _, h)| *h == EndpointHealth::Healthy)
    );
}

#[tokio::test]
async fn a_failing_health_answer_takes_every_rank_and_role_out_with_one_check_per_round() {
    let flip = flip_server().await;
    // An engine of one endpoint, whose checks count the rounds.
    let other = flip_server().await;
    let inner = StaticSource::new([
        Endpoint::new(&format!("{}@0", flip.url), Role::Prefill).unwrap(),
        Endpoint::new(&format!("{}@1", flip.url), Role::Prefill).unwrap(),
        Endpoint::new(&format!("{}@2", flip.url), Role::Prefill).unwrap(),
        Endpoint::new(&flip.url, Role::Decode).unwrap(),
        Endpoint::new(&other.url, Role::Decode).unwrap(),
    ]);
    let config = fast_checks();
    let source = HealthSource::new(inner, config.clone());
    let checks = &config.checks;
    let _stop = spawn_checks(&source);

    // Once per engine per round, not once per rank and role (4 endpoints here): after
    // 10 rounds, as many checks of it as of the engine of one endpoint (give or take
    // the round in progress), however long the rounds took.
    eventually(checks.interval * 10 + SLACK * 4, "10 rounds", || {
        other.hits.load(Ordering::SeqCst) >= 10
    })
    .await;
    let (hits, rounds) = (
        flip.hits.load(Ordering::SeqCst),
        other.hits.load(Ordering::SeqCst),
    );
    assert!(
        hits + 1 >= rounds && hits <= rounds + 1,
        "{hits} checks of the engine of 4 endpoints in {rounds} rounds"
    );
    assert_eq!(source.snapshot().by_role(Role::Prefill).len(), 3);

    flip.status.store(503, Ordering::SeqCst);
    eventually(
        checks.interval * checks.unhealthy_threshold + SLACK,
        "503 engine taken out",
        || source.snapshot().by_role(Role::Prefill).is_empty(),
    )
    .await;
    let set = source.snapshot();
    assert_eq!(
        ids(set.by_role(Role::Decode)),
        [other.url.as_str()],
        "its decode role is the same engine"
    );
    let down = source
        .health()
        .states()
        .into_iter()
        .filter(|(_, _, h)| *h == EndpointHealth::Down)
        .count();
    assert_eq!(down, 4);

    flip.status.store(200, Ordering::SeqCst);
    eventually(
        checks.interval * checks.healthy_threshold + SLACK,
        "engine back",
        || source.snapshot().by_role(Role::Prefill).len() == 3,
    )
    .await;
    assert_eq!(source.snapshot().by_role(Role::Decode).len(), 2);
}

#[tokio::test]
async fn a_health_check_without_an_answer_in_time_is_a_failure() {
    let flip = flip_server().await;
    flip.status.store(0, Ordering::SeqCst);
    let inner = StaticSource::new([Endpoint::new(&flip.url, Role::Decode).unwrap()]);
    let config = fast_checks();
    let source = HealthSource::new(inner, config.clone());
    let _stop = spawn_checks(&source);
    let checks = &config.checks;
    eventually(
        (checks.interval + checks.timeout) * checks.unhealthy_threshold + SLACK,
        "hanging engine taken out",
        || source.snapshot().by_role(Role::Decode).is_empty(),
    )
    .await;
}

#[tokio::test]
async fn stopping_the_checks_ends_them() {
    let flip = flip_server().await;
    let inner = StaticSource::new([Endpoint::new(&flip.url, Role::Decode).unwrap()]);
    let source = HealthSource::new(inner, fast_checks());
    let (stop_tx, stop) = watch::channel(false);
    let task = tokio::spawn(Arc::clone(source.health()).run_checks(HttpTransport::default(), stop));
    eventually(SLACK, "first check", || {
        flip.hits.load(Ordering::SeqCst) >= 1
    })
    .await;
    stop_tx.send_replace(true);
    tokio::time::timeout(Duration::from_secs(2), task)
        .await
        .expect("checker ended")
        .unwrap();
    let hits = flip.hits.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(flip.hits.load(Ordering::SeqCst), hits);
}

/// `source` without its listener: an orchestrator over it does not feed its health, so a
/// test drives the breaker with `Health::record` alone.
struct Unheard(HealthSource);

impl EndpointSource for Unheard {
    fn watch(&self) -> watch::Receiver<Arc<disagg_core::endpoint::EndpointSet>> {
        self.0.watch()
    }

    fn snapshot(&self) -> Arc<disagg_core::endpoint::EndpointSet> {
        self.0.snapshot()
    }
}

/// A proxy on loopback routing from `source`, whose health only the test feeds.
async fn proxy(source: HealthSource, config: OrchestratorConfig) -> (String, oneshot::Sender<()>) {
    let orchestrator =
        Orchestrator::builder(Unheard(source), HttpTransport::default(), VllmNixl::new())
            .router(PerLeg::both(RoundRobin::new))
            .config(config)
            .build();
    serve_proxy(orchestrator).await
}

fn passive(ejection: Duration) -> HealthConfig {
    let mut config = HealthConfig::default();
    config.base_ejection = ejection;
    config.max_ejection = ejection * 8;
    config
}

#[tokio::test]
async fn a_dead_prefill_is_ejected_on_real_failures_and_every_request_then_succeeds() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let d = SimEngine::start(SimConfig::default()).await.unwrap();
    let (dead, _held) = held_dead_url();
    let inner = Arc::new(StaticSource::new([
        Endpoint::new(&p.url(), Role::Prefill).unwrap(),
        Endpoint::new(&dead, Role::Prefill).unwrap(),
        Endpoint::new(&d.url(), Role::Decode).unwrap(),
    ]));
    let source = HealthSource::new(Arc::clone(&inner), passive(Duration::from_secs(60)));
    let health = Arc::clone(source.health());
    let (url, _stop) = proxy(source.clone(), OrchestratorConfig::default()).await;

    // Round-robin sends every other request to the dead prefill: they fail.
    let mut failed = 0;
    for i in 0..4 {
        let a = post(
            &url,
            "/v1/completions",
            completion(&format!("r{i}"), 2, false),
            &[],
        )
        .await;
        failed += usize::from(a.status != 200);
    }
    assert_eq!(failed, 2, "the dead prefill is routed before any ejection");

    // What the orchestrator will report: the dead prefill's legs fail to connect.
    let dead_ep = Arc::clone(&inner.snapshot().by_role(Role::Prefill)[1]);
    let transport = HttpTransport::default();
    for _ in 0..5 {
        let mut req = http::Request::new(Bytes::new());
        *req.uri_mut() = dead_ep.uri("/v1/completions").unwrap();
        let ok = transport.send(req).await.is_ok();
        assert!(!ok);
        health.record(&dead_ep, ok);
    }
    assert!(matches!(
        health.state(&dead_ep),
        Some(EndpointHealth::Ejected { .. })
    ));
    for i in 0..6 {
        let a = post(
            &url,
            "/v1/completions",
            completion(&format!("s{i}"), 2, false),
            &[],
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert_eq!(p.stats().requests, 2 + 6);

    // Both prefills ejected: the set has no prefill, and the proxy says so.
    let live = Arc::clone(&inner.snapshot().by_role(Role::Prefill)[0]);
    for _ in 0..5 {
        health.record(&live, false);
    }
    assert!(source.snapshot().by_role(Role::Prefill).is_empty());
    let a = post(&url, "/v1/completions", completion("none", 2, false), &[]).await;
    assert_openai_error(&a, 503, "no_prefill_endpoint");
}

#[tokio::test]
async fn an_engine_ejected_as_prefill_still_decodes_and_returns_after_the_ejection_time() {
    // One engine in both roles; the decode-only fallback shows its decode leg is kept.
    let engine = SimEngine::start(SimConfig::default()).await.unwrap();
    let inner = StaticSource::new([
        Endpoint::new(&engine.url(), Role::Prefill).unwrap(),
        Endpoint::new(&engine.url(), Role::Decode).unwrap(),
    ]);
    let ejection = Duration::from_millis(400);
    let source = HealthSource::new(inner, passive(ejection));
    let health = Arc::clone(source.health());
    let mut config = OrchestratorConfig::default();
    config.prefill_failure = PrefillFailure::DecodeOnly;
    let (url, _stop) = proxy(source.clone(), config).await;
    let prefill = Arc::clone(&source.snapshot().by_role(Role::Prefill)[0]);
    let decode = Arc::clone(&source.snapshot().by_role(Role::Decode)[0]);

    let a = post(&url, "/v1/completions", completion("a", 2, false), &[]).await;
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));

    let ejected_at = Instant::now();
    for _ in 0..5 {
        health.record(&prefill, false);
    }
    assert_eq!(health.state(&decode), Some(EndpointHealth::Healthy));
    let a = post(&url, "/v1/completions", completion("b", 2, false), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    if ejected_at.elapsed() < ejection {
        assert_eq!(a.header("x-disagg-handoff"), Some("decode-only"));
    }

    // Nobody records anything: the prefill leg returns, half-open, after the time.
    eventually(ejection + SLACK, "prefill back", || {
        source.snapshot().by_role(Role::Prefill).len() == 1
    })
    .await;
    assert!(ejected_at.elapsed() >= ejection);
    assert_eq!(health.state(&prefill), Some(EndpointHealth::HalfOpen));
    let a = post(&url, "/v1/completions", completion("c", 2, false), &[]).await;
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));

    // Half-open failure: out again for twice the time, from the failure (taken between
    // the instants around `record`); success later closes.
    let reopened = Instant::now();
    health.record(&prefill, false);
    let recorded = Instant::now();
    match health.state(&prefill) {
        Some(EndpointHealth::Ejected { until }) => {
            let (from, to) = (
                tokio::time::Instant::from_std(reopened),
                tokio::time::Instant::from_std(recorded),
            );
            let ms = Duration::from_millis(1);
            assert!(until + ms >= from + ejection * 2, "{:?}", until - from);
            assert!(until <= to + ejection * 2 + ms, "{:?}", until - from);
        }
        other => panic!("{other:?}"),
    }
    eventually(ejection * 2 + SLACK, "prefill back again", || {
        source.snapshot().by_role(Role::Prefill).len() == 1
    })
    .await;
    assert!(reopened.elapsed() >= ejection * 2);
    health.record(&prefill, true);
    assert_eq!(health.state(&prefill), Some(EndpointHealth::Healthy));
}

#[tokio::test]
async fn the_orchestrator_reports_each_leg_so_a_dead_prefill_is_ejected_by_traffic_alone() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let d = SimEngine::start(SimConfig::default()).await.unwrap();
    let (dead, _held) = held_dead_url();
    let inner = Arc::new(StaticSource::new([
        Endpoint::new(&p.url(), Role::Prefill).unwrap(),
        Endpoint::new(&dead, Role::Prefill).unwrap(),
        Endpoint::new(&d.url(), Role::Decode).unwrap(),
    ]));
    let mut config = passive(Duration::from_secs(60));
    config.failure_threshold = 2;
    let source = HealthSource::new(Arc::clone(&inner), config);
    let health = Arc::clone(source.health());
    let orchestrator = Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new())
        .router(PerLeg::both(RoundRobin::new))
        .build();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (_stop, rx) = oneshot::channel::<()>();
    tokio::spawn(disagg_http::server::Builder::new().serve(
        listener,
        PdService::new(orchestrator),
        async {
            let _ = rx.await;
        },
    ));

    // Round-robin alternates; the dead prefill fails twice and is then out of routing.
    let mut failed = 0;
    for i in 0..10 {
        let body = completion(&format!("t{i}"), 2, false);
        let a = post(&url, "/v1/completions", body, &[]).await;
        failed += usize::from(a.status != 200);
    }
    assert_eq!(failed, 2, "ejected after exactly two failures");
    let dead_ep = Arc::clone(&inner.snapshot().by_role(Role::Prefill)[1]);
    assert!(matches!(
        health.state(&dead_ep),
        Some(EndpointHealth::Ejected { .. })
    ));
    // Successes were recorded too: the live engines are healthy in both roles.
    let live = Arc::clone(&inner.snapshot().by_role(Role::Prefill)[0]);
    let decode = Arc::clone(&inner.snapshot().by_role(Role::Decode)[0]);
    assert_eq!(health.state(&live), Some(EndpointHealth::Healthy));
    assert_eq!(health.state(&decode), Some(EndpointHealth::Healthy));
    assert_eq!(p.stats().requests, 8);
}

/// A proxy over `endpoints` (NIXL, round-robin on each leg) whose health ejects an
/// endpoint after three failures in a row, for a minute: its inner source (the set
/// before health), the health, the proxy's URL and its stop.
async fn ejecting_after_three(
    endpoints: Vec<Endpoint>,
) -> (
    Arc<StaticSource>,
    Arc<disagg_resilience::health::Health>,
    String,
    oneshot::Sender<()>,
) {
    ejecting_after_three_with(endpoints, OrchestratorConfig::default()).await
}

/// [`ejecting_after_three`] with the orchestrator's `config`.
async fn ejecting_after_three_with(
    endpoints: Vec<Endpoint>,
    config: OrchestratorConfig,
) -> (
    Arc<StaticSource>,
    Arc<disagg_resilience::health::Health>,
    String,
    oneshot::Sender<()>,
) {
    ejecting_after_three_over(endpoints, config, VllmNixl::new()).await
}

/// [`ejecting_after_three_with`] over `connector`.
async fn ejecting_after_three_over(
    endpoints: Vec<Endpoint>,
    config: OrchestratorConfig,
    connector: impl disagg_core::KvConnector,
) -> (
    Arc<StaticSource>,
    Arc<disagg_resilience::health::Health>,
    String,
    oneshot::Sender<()>,
) {
    let inner = Arc::new(StaticSource::new(endpoints));
    let mut health_config = passive(Duration::from_secs(60));
    health_config.failure_threshold = 3;
    let source = HealthSource::new(Arc::clone(&inner), health_config);
    let health = Arc::clone(source.health());
    let orchestrator = Orchestrator::builder(source, HttpTransport::default(), connector)
        .router(PerLeg::both(RoundRobin::new))
        .config(config)
        .build();
    let (url, stop) = serve_proxy(orchestrator).await;
    (inner, health, url, stop)
}

/// The endpoint of `engine` in `role`, a prefill's with its bootstrap port (SGLang's and
/// Mooncake's side channel) when it serves one, as the stacks of the other tests name it.
fn endpoint_of(engine: &SimEngine, role: Role) -> Endpoint {
    let ep = Endpoint::new(&engine.url(), role).unwrap();
    match engine.bootstrap_addr().filter(|_| role == Role::Prefill) {
        Some(addr) => {
            let mut facts = disagg_core::endpoint::Facts::default();
            facts
                .insert(
                    disagg_core::endpoint::Facts::BOOTSTRAP_PORT,
                    addr.port().to_string(),
                )
                .unwrap();
            ep.with_facts(facts)
        }
        None => ep,
    }
}

/// Two prefills, the second advertising a host where nothing listens (no decode can
/// load its KV), and three decodes, each started with `config` for its role: the
/// prefills, the decodes, and their endpoints (prefills first).
async fn a_bad_prefill_among_good_engines(
    config: impl Fn(disagg_sim::SimRole) -> SimConfig,
) -> (Vec<SimEngine>, Vec<SimEngine>, Vec<Endpoint>) {
    use disagg_sim::SimRole;
    let mut prefills = vec![SimEngine::start(config(SimRole::Prefill)).await.unwrap()];
    let bad = SimConfig {
        advertised_host: "127.0.0.2".into(),
        ..config(SimRole::Prefill)
    };
    prefills.push(SimEngine::start(bad).await.unwrap());
    let mut decodes = Vec::new();
    for _ in 0..3 {
        decodes.push(SimEngine::start(config(SimRole::Decode)).await.unwrap());
    }
    let endpoints = prefills
        .iter()
        .map(|p| endpoint_of(p, Role::Prefill))
        .chain(decodes.iter().map(|d| endpoint_of(d, Role::Decode)))
        .collect();
    (prefills, decodes, endpoints)
}

/// `ejected` is ejected, every other endpoint of `set` healthy.
fn only_ejected(
    health: &disagg_resilience::health::Health,
    set: &disagg_core::endpoint::EndpointSet,
    ejected: &Endpoint,
) {
    assert!(
        matches!(health.state(ejected), Some(EndpointHealth::Ejected { .. })),
        "{}: {:?}",
        ejected.id(),
        health.state(ejected)
    );
    for ep in set.iter().filter(|ep| ep.id() != ejected.id()) {
        assert_eq!(
            health.state(ep),
            Some(EndpointHealth::Healthy),
            "{}",
            ep.id()
        );
    }
}

/// A prefill whose side channel no decode can reach (it advertises a host where nothing
/// listens): every decode it hands KV to fails its load and answers 500, which blames
/// the decode. Round-robin over two prefills and three decodes hands the bad prefill's
/// KV to a different decode each time, and each decode's failures are broken up by its
/// successes with the good prefill, so no decode's breaker ever opens; the bad prefill
/// answered every leg. Its handoffs failing on decode after decode are what tells: from
/// the second, each counts against the prefill, which is ejected after
/// `failure_threshold` of them, and every request then succeeds. No decode is ejected.
#[tokio::test]
async fn a_prefill_whose_kv_no_decode_can_load_is_ejected_not_the_decodes() {
    let (_prefills, decodes, endpoints) =
        a_bad_prefill_among_good_engines(|_| SimConfig::default()).await;
    let (inner, health, url, _stop) = ejecting_after_three(endpoints).await;

    let mut failed = Vec::new();
    for i in 0..16 {
        let a = post(
            &url,
            "/v1/completions",
            completion(&format!("k{i}"), 2, false),
            &[],
        )
        .await;
        if a.status != 200 {
            // The decode's own 500, relayed.
            assert_eq!(a.status, 500, "{}", a.text());
            assert!(a.text().contains("KV transfer failed"), "{}", a.text());
            failed.push(i);
        }
    }
    // The bad prefill's legs (every other request) until its third blame: its first
    // failure says nothing of it, the next three count.
    assert_eq!(
        failed,
        [1, 3, 5, 7],
        "the bad prefill is out after four failed loads"
    );
    let set = inner.snapshot();
    only_ejected(&health, &set, &set.by_role(Role::Prefill)[1]);
    let failures: u64 = decodes.iter().map(|d| d.stats().kv_pull_failures).sum();
    assert_eq!(failures, 4, "each failure was a lost KV load");
}

/// The rule above with mid-stream migration on (decode-only continuations): a streamed
/// chat whose decode cannot load the bad prefill's KV gets vLLM's 200 head and then an
/// error event naming a 500, and the stream is continued on another decode, which
/// recomputes the prompt: every client gets its whole answer. The first decode is told
/// failed, with its KV suspect, by a report of its own; the attempt's report names the
/// decode the answer moved to, which was never handed the prefill's KV, and says
/// nothing of the prefill (its success used to wipe the count against it, so the bad
/// prefill was never ejected and the decodes took every blame).
#[tokio::test]
async fn with_migration_a_prefill_whose_kv_no_decode_can_load_is_still_ejected() {
    let (_prefills, decodes, endpoints) =
        a_bad_prefill_among_good_engines(|_| SimConfig::default()).await;
    let mut config = OrchestratorConfig::default();
    config.migration.limit = 1;
    config.migration.decode_only = true;
    let (inner, health, url, _stop) = ejecting_after_three_with(endpoints, config).await;

    for i in 0..16 {
        let a = post(
            &url,
            "/v1/chat/completions",
            chat(&format!("m{i}"), 4, true),
            &[],
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
        let events = a.events();
        assert_eq!(
            events.last().map(String::as_str),
            Some("[DONE]"),
            "{events:?}"
        );
        assert!(
            !a.text().contains("\"error\""),
            "the lost load was continued, not relayed: {}",
            a.text()
        );
    }
    let set = inner.snapshot();
    only_ejected(&health, &set, &set.by_role(Role::Prefill)[1]);
    // Its first failure says nothing of it, the next three count: four lost loads.
    let failures: u64 = decodes.iter().map(|d| d.stats().kv_pull_failures).sum();
    assert_eq!(failures, 4, "each continued stream was a lost KV load");
}

/// SGLang, both legs at once, behind a prefill that hangs before it registers the room:
/// each decode gives up waiting (200 ms) and aborts its streamed `/generate` (SGLang's
/// `finish_reason` `{"type":"abort",...,"status_code":500}`, then `[DONE]`), and the
/// stream ends then, the prefill still running dropped. Which engine failed the
/// transfer cannot be told from a prefill that never answered: no decode is ejected for
/// it (each took the blame in turn, and all were ejected behind one bad prefill).
#[tokio::test]
async fn decodes_aborting_for_a_prefill_that_never_answered_are_not_ejected() {
    let p = SimEngine::start(SimConfig {
        kv_mode: disagg_sim::KvMode::Sglang(disagg_sim::SimRole::Prefill),
        faults: disagg_sim::Faults {
            hang: true,
            ..Default::default()
        },
        ..Default::default()
    })
    .await
    .unwrap();
    let decode = || SimConfig {
        kv_mode: disagg_sim::KvMode::Sglang(disagg_sim::SimRole::Decode),
        bootstrap_timeout: Duration::from_millis(200),
        ..Default::default()
    };
    let decodes = [
        SimEngine::start(decode()).await.unwrap(),
        SimEngine::start(decode()).await.unwrap(),
    ];
    let mut endpoints = vec![endpoint_of(&p, Role::Prefill)];
    endpoints.extend(decodes.iter().map(|d| endpoint_of(d, Role::Decode)));
    let (inner, health, url, _stop) = ejecting_after_three_over(
        endpoints,
        OrchestratorConfig::default(),
        disagg_connectors::sglang::SglangBootstrap::new(),
    )
    .await;
    for i in 0..6 {
        let body = serde_json::json!({"text": format!("a{i}"), "stream": true,
                                      "sampling_params": {"max_new_tokens": 4}});
        let a = post(&url, "/generate", body.to_string(), &[]).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert!(a.text().contains("\"abort\""), "{}", a.text());
    }
    let aborted: u64 = decodes.iter().map(|d| d.stats().bootstrap_timeouts).sum();
    assert_eq!(aborted, 6);
    for d in inner.snapshot().by_role(Role::Decode) {
        assert_eq!(health.state(d), Some(EndpointHealth::Healthy), "{}", d.id());
    }
}

/// The migration case over vLLM Mooncake (both legs at once): the decode's head may
/// come before its prefill answered, so whether the decode was handed the KV of a
/// prefill that answered is read when the first decode's stream breaks, not at its
/// head (read there, the prefill's answer was missed whenever it came second, and the
/// bad prefill escaped the rule in some runs).
#[tokio::test]
async fn with_migration_and_both_legs_at_once_a_prefill_whose_kv_no_decode_can_load_is_ejected() {
    let (_prefills, _decodes, endpoints) = a_bad_prefill_among_good_engines(|role| SimConfig {
        kv_mode: disagg_sim::KvMode::Mooncake(role),
        ..Default::default()
    })
    .await;
    let mut config = OrchestratorConfig::default();
    config.migration.limit = 1;
    config.migration.decode_only = true;
    let (inner, health, url, _stop) = ejecting_after_three_over(
        endpoints,
        config,
        disagg_connectors::vllm::VllmMooncake::new(),
    )
    .await;
    for i in 0..16 {
        let a = post(
            &url,
            "/v1/chat/completions",
            chat(&format!("c{i}"), 4, true),
            &[],
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(
            a.events().last().map(String::as_str),
            Some("[DONE]"),
            "{}",
            a.text()
        );
    }
    let set = inner.snapshot();
    only_ejected(&health, &set, &set.by_role(Role::Prefill)[1]);
}

/// The other side of the rule above: two decodes that fail every request (answering
/// 500, as a lost KV load does) while a third works, behind one healthy prefill.
/// Round-robin hands the prefill's KV to the two failing decodes one after the other,
/// so one of each pair of their failures counts against the prefill too, but the
/// working decode's next success with that prefill wipes it: the failing decodes are
/// ejected, the prefill stays.
#[tokio::test]
async fn decodes_that_fail_on_their_own_are_ejected_not_their_prefill() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let failing = || SimConfig {
        faults: disagg_sim::Faults {
            status: Some(500),
            ..Default::default()
        },
        ..Default::default()
    };
    let decodes = [
        SimEngine::start(SimConfig::default()).await.unwrap(),
        SimEngine::start(failing()).await.unwrap(),
        SimEngine::start(failing()).await.unwrap(),
    ];
    let mut endpoints = vec![Endpoint::new(&p.url(), Role::Prefill).unwrap()];
    endpoints.extend(
        decodes
            .iter()
            .map(|d| Endpoint::new(&d.url(), Role::Decode).unwrap()),
    );
    let (inner, health, url, _stop) = ejecting_after_three(endpoints).await;

    let mut failed = 0;
    for i in 0..12 {
        let a = post(
            &url,
            "/v1/completions",
            completion(&format!("d{i}"), 2, false),
            &[],
        )
        .await;
        failed += usize::from(a.status != 200);
    }
    assert_eq!(
        failed, 6,
        "each failing decode fails three times, then is out"
    );
    let set = inner.snapshot();
    let prefill = &set.by_role(Role::Prefill)[0];
    assert_eq!(health.state(prefill), Some(EndpointHealth::Healthy));
    let states: Vec<bool> = set
        .by_role(Role::Decode)
        .iter()
        .map(|d| matches!(health.state(d), Some(EndpointHealth::Ejected { .. })))
        .collect();
    assert_eq!(states, [false, true, true]);
}

/// Decodes that cannot be reached (their port refuses connections) failed on their own,
/// whatever the KV handed to them: one prefill and two such decodes, no working decode
/// in between, and only the decodes are ejected. The prefill's legs answered; it stays,
/// and once the decodes are out the proxy says no decode is left.
#[tokio::test]
async fn unreachable_decodes_are_ejected_never_their_prefill() {
    let p = SimEngine::start(SimConfig::default()).await.unwrap();
    let (a, _held_a) = held_dead_url();
    let (b, _held_b) = held_dead_url();
    let (inner, health, url, _stop) = ejecting_after_three(vec![
        Endpoint::new(&p.url(), Role::Prefill).unwrap(),
        Endpoint::new(&a, Role::Decode).unwrap(),
        Endpoint::new(&b, Role::Decode).unwrap(),
    ])
    .await;

    for i in 0..6 {
        let a = post(
            &url,
            "/v1/completions",
            completion(&format!("u{i}"), 2, false),
            &[],
        )
        .await;
        assert_eq!(a.status, 502, "{}", a.text());
    }
    let set = inner.snapshot();
    assert_eq!(
        health.state(&set.by_role(Role::Prefill)[0]),
        Some(EndpointHealth::Healthy)
    );
    for d in set.by_role(Role::Decode) {
        assert!(
            matches!(health.state(d), Some(EndpointHealth::Ejected { .. })),
            "{}: {:?}",
            d.id(),
            health.state(d)
        );
    }
    let a = post(&url, "/v1/completions", completion("none", 2, false), &[]).await;
    assert_openai_error(&a, 503, "no_decode_endpoint");
}
