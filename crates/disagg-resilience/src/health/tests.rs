use super::*;
use disagg_core::error::RouteError;
use disagg_core::source::StaticSource;
use std::sync::atomic::AtomicUsize;

fn ep(url: &str, role: Role) -> Endpoint {
    Endpoint::new(url, role).unwrap()
}

fn ids(eps: &[Arc<Endpoint>]) -> Vec<&str> {
    eps.iter().map(|e| e.id().as_str()).collect()
}

/// Two prefill and one decode endpoint; `http://a:1` serves both roles.
fn source(config: HealthConfig) -> (Arc<StaticSource>, HealthSource) {
    let inner = Arc::new(StaticSource::new([
        ep("http://a:1", Role::Prefill),
        ep("http://b:1", Role::Prefill),
        ep("http://a:1", Role::Decode),
    ]));
    let health = HealthSource::new(Arc::clone(&inner), config);
    (inner, health)
}

fn find(source: &HealthSource, url: &str, role: Role) -> Arc<Endpoint> {
    let set = source.health.inner_rx.borrow().clone();
    set.by_role(role)
        .iter()
        .find(|e| e.id().as_str() == url)
        .cloned()
        .unwrap()
}

fn fail(health: &Health, e: &Endpoint, n: u32) {
    for _ in 0..n {
        health.record(e, false);
    }
}

#[tokio::test(start_paused = true)]
async fn failures_below_the_threshold_do_not_eject_and_a_success_resets_the_count() {
    let (_inner, source) = source(HealthConfig::default());
    let h = source.health();
    let a = find(&source, "http://a:1", Role::Prefill);
    fail(h, &a, 4);
    h.record(&a, true);
    fail(h, &a, 4);
    assert_eq!(h.state(&a), Some(EndpointHealth::Healthy));
    assert_eq!(source.snapshot().by_role(Role::Prefill).len(), 2);
    h.record(&a, false);
    assert!(matches!(h.state(&a), Some(EndpointHealth::Ejected { .. })));
}

#[tokio::test(start_paused = true)]
async fn ejection_takes_out_exactly_that_endpoint_on_that_leg() {
    let (_inner, source) = source(HealthConfig::default());
    let h = source.health();
    let mut rx = source.watch();
    let a = find(&source, "http://a:1", Role::Prefill);
    let start = Instant::now();
    fail(h, &a, 5);
    assert_eq!(
        h.state(&a),
        Some(EndpointHealth::Ejected {
            until: start + Duration::from_secs(5)
        })
    );
    assert!(
        rx.has_changed().unwrap(),
        "the ejection is published at once"
    );
    let set = rx.borrow_and_update().clone();
    assert_eq!(ids(set.by_role(Role::Prefill)), ["http://b:1"]);
    assert_eq!(
        ids(set.by_role(Role::Decode)),
        ["http://a:1"],
        "the same URL's decode leg stays"
    );
    let a_decode = find(&source, "http://a:1", Role::Decode);
    assert_eq!(h.state(&a_decode), Some(EndpointHealth::Healthy));
    let states = h.states();
    assert_eq!(states.len(), 3);
    assert_eq!(states[0].0.as_str(), "http://a:1");
    assert_eq!(states[0].1, Role::Prefill);
    assert_eq!(states[0].2.as_str(), "ejected");
    assert_eq!(states[2].2, EndpointHealth::Healthy);
}

#[tokio::test(start_paused = true)]
async fn an_ejected_endpoint_returns_half_open_without_any_record() {
    let (_inner, source) = source(HealthConfig::default());
    let h = source.health();
    let a = find(&source, "http://a:1", Role::Prefill);
    fail(h, &a, 5);
    tokio::time::sleep(Duration::from_millis(4_999)).await;
    assert_eq!(
        source.snapshot().by_role(Role::Prefill).len(),
        1,
        "still out before 5 s"
    );
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(
        ids(source.snapshot().by_role(Role::Prefill)),
        ["http://a:1", "http://b:1"]
    );
    assert_eq!(h.state(&a), Some(EndpointHealth::HalfOpen));
}

#[tokio::test(start_paused = true)]
async fn half_open_success_closes_and_resets_the_backoff() {
    let (_inner, source) = source(HealthConfig::default());
    let h = source.health();
    let a = find(&source, "http://a:1", Role::Prefill);
    fail(h, &a, 5);
    tokio::time::sleep(Duration::from_secs(5)).await;
    h.record(&a, false); // half-open failure: 10 s
    tokio::time::sleep(Duration::from_secs(10)).await;
    h.record(&a, true);
    assert_eq!(h.state(&a), Some(EndpointHealth::Healthy));
    assert_eq!(source.snapshot().by_role(Role::Prefill).len(), 2);
    // Closed again: one failure is not enough, and the next ejection is the base time.
    h.record(&a, false);
    assert_eq!(h.state(&a), Some(EndpointHealth::Healthy));
    let now = Instant::now();
    fail(h, &a, 4);
    assert_eq!(
        h.state(&a),
        Some(EndpointHealth::Ejected {
            until: now + Duration::from_secs(5)
        })
    );
}

#[tokio::test(start_paused = true)]
async fn half_open_failure_doubles_the_time_up_to_the_maximum() {
    let (_inner, source) = source(HealthConfig::default());
    let h = source.health();
    let a = find(&source, "http://a:1", Role::Prefill);
    fail(h, &a, 5);
    let mut expected = 5;
    for next in [10, 20, 40, 60, 60] {
        tokio::time::sleep(Duration::from_secs(expected)).await;
        assert_eq!(h.state(&a), Some(EndpointHealth::HalfOpen));
        assert_eq!(source.snapshot().by_role(Role::Prefill).len(), 2);
        let now = Instant::now();
        h.record(&a, false);
        assert_eq!(
            h.state(&a),
            Some(EndpointHealth::Ejected {
                until: now + Duration::from_secs(next)
            }),
            "after a {expected} s ejection"
        );
        assert_eq!(source.snapshot().by_role(Role::Prefill).len(), 1);
        expected = next;
    }
}

#[tokio::test(start_paused = true)]
async fn results_of_requests_sent_before_the_ejection_are_ignored() {
    let (_inner, source) = source(HealthConfig::default());
    let h = source.health();
    let a = find(&source, "http://a:1", Role::Prefill);
    fail(h, &a, 5);
    let before = h.state(&a);
    h.record(&a, true);
    fail(h, &a, 3);
    assert_eq!(h.state(&a), before, "neither closed early nor extended");
}

#[tokio::test(start_paused = true)]
async fn every_endpoint_of_a_role_ejected_leaves_none_of_that_role() {
    let (_inner, source) = source(HealthConfig::default());
    let h = source.health();
    for url in ["http://a:1", "http://b:1"] {
        fail(h, &find(&source, url, Role::Prefill), 5);
    }
    let set = source.snapshot();
    assert!(set.by_role(Role::Prefill).is_empty());
    assert_eq!(set.by_role(Role::Decode).len(), 1);
}

#[tokio::test(start_paused = true)]
async fn eject_takes_an_endpoint_out_like_failures_and_it_returns_half_open() {
    let (_inner, source) = source(HealthConfig::default());
    let h = source.health();
    let d = find(&source, "http://a:1", Role::Decode);
    assert!(h.eject(&d, "test verdict"));
    assert!(matches!(h.state(&d), Some(EndpointHealth::Ejected { .. })));
    assert!(source.snapshot().by_role(Role::Decode).is_empty());
    assert!(!h.eject(&d, "again"), "already out: not extended");
    assert_eq!(
        source.snapshot().by_role(Role::Prefill).len(),
        2,
        "the same engine's prefill leg stays"
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(h.state(&d), Some(EndpointHealth::HalfOpen));
    h.record(&d, true);
    assert_eq!(h.state(&d), Some(EndpointHealth::Healthy));
    assert!(!h.eject(&ep("http://z:1", Role::Decode), "unknown"));
}

#[tokio::test(start_paused = true)]
async fn a_zero_threshold_turns_passive_ejection_off() {
    let config = HealthConfig {
        failure_threshold: 0,
        ..HealthConfig::default()
    };
    let (_inner, source) = source(config);
    let a = find(&source, "http://a:1", Role::Prefill);
    fail(source.health(), &a, 100);
    assert_eq!(source.health().state(&a), Some(EndpointHealth::Healthy));
}

#[tokio::test(start_paused = true)]
async fn inner_changes_are_followed_and_states_survive_them() {
    let (inner, source) = source(HealthConfig::default());
    let h = source.health();
    let a = find(&source, "http://a:1", Role::Prefill);
    fail(h, &a, 5);
    inner.insert(ep("http://c:1", Role::Decode));
    let set = source.snapshot();
    assert_eq!(
        ids(set.by_role(Role::Prefill)),
        ["http://b:1"],
        "still ejected"
    );
    assert_eq!(ids(set.by_role(Role::Decode)), ["http://a:1", "http://c:1"]);
    assert!(matches!(h.state(&a), Some(EndpointHealth::Ejected { .. })));
    assert!(inner.remove("http://b:1"));
    assert!(source.snapshot().by_role(Role::Prefill).is_empty());
    let b = ep("http://b:1", Role::Prefill);
    assert_eq!(h.state(&b), None, "removed endpoints have no state");
    h.record(&b, false); // ignored
}

#[tokio::test(start_paused = true)]
async fn the_filtered_set_keeps_routing_by_model() {
    let inner = StaticSource::new([
        ep("http://p1:1", Role::Prefill).with_models(["llama"]),
        ep("http://p2:1", Role::Prefill).with_models(["llama"]),
        ep("http://d1:1", Role::Decode).with_models(["llama"]),
        ep("http://d2:1", Role::Decode).with_models(["qwen"]),
    ]);
    let source = HealthSource::new(inner, HealthConfig::default());
    let p1 = find(&source, "http://p1:1", Role::Prefill);
    fail(source.health(), &p1, 5);
    let set = source.snapshot();
    let llama = set.for_model(Some("llama")).unwrap();
    assert_eq!(ids(llama.by_role(Role::Prefill)), ["http://p2:1"]);
    assert_eq!(ids(llama.by_role(Role::Decode)), ["http://d1:1"]);
    assert_eq!(set.served_models().len(), 2);
}

/// A model whose decodes are all ejected is one that cannot be served now (503, none
/// to send it to), not an unknown one (404); a request naming no model still must name
/// one, not go to the one model left; and one of a single-model fleet with every decode
/// ejected is answered 503, not 400.
#[tokio::test(start_paused = true)]
async fn a_model_whose_decodes_are_ejected_is_still_served() {
    let inner = disagg_core::source::StaticSource::new([
        ep("http://d1:1", Role::Decode).with_models(["llama"]),
        ep("http://d2:1", Role::Decode).with_models(["qwen"]),
    ]);
    let source = HealthSource::new(inner, HealthConfig::default());
    let d2 = find(&source, "http://d2:1", Role::Decode);
    fail(source.health(), &d2, 5);
    let set = source.snapshot();
    assert_eq!(ids(set.by_role(Role::Decode)), ["http://d1:1"]);
    assert_eq!(set.served_models().len(), 2);
    assert!(matches!(
        set.for_model(Some("qwen")),
        Err(RouteError::NoDecode)
    ));
    assert!(matches!(
        set.for_model(Some("gpt")),
        Err(RouteError::UnknownModel { .. })
    ));
    assert!(matches!(
        set.for_model(None),
        Err(RouteError::ModelRequired { .. })
    ));
    let llama = set.for_model(Some("llama")).unwrap();
    assert_eq!(ids(llama.by_role(Role::Decode)), ["http://d1:1"]);
    // One model, its only decode ejected.
    let inner = disagg_core::source::StaticSource::new([
        ep("http://d1:1", Role::Decode).with_models(["llama"])
    ]);
    let source = HealthSource::new(inner, HealthConfig::default());
    let d1 = find(&source, "http://d1:1", Role::Decode);
    fail(source.health(), &d1, 5);
    let set = source.snapshot();
    assert!(matches!(set.for_model(None), Err(RouteError::NoDecode)));
    assert!(matches!(
        set.for_model(Some("llama")),
        Err(RouteError::NoDecode)
    ));
}

#[test]
fn a_healthy_set_is_the_inner_set_itself() {
    let inner = disagg_core::source::StaticSource::new([ep("http://d:1", Role::Decode)]);
    let first = inner.snapshot();
    let source = HealthSource::new(inner, HealthConfig::default());
    assert!(Arc::ptr_eq(&source.snapshot(), &first));
}

#[test]
fn concurrent_records_and_snapshots_stay_consistent() {
    let config = HealthConfig {
        failure_threshold: 2,
        base_ejection: Duration::from_micros(50),
        max_ejection: Duration::from_micros(400),
        ..HealthConfig::default()
    };
    let (inner, source) = source(config);
    let endpoints: Vec<_> = {
        let set = source.snapshot();
        set.by_role(Role::Prefill)
            .iter()
            .chain(set.by_role(Role::Decode))
            .cloned()
            .collect()
    };
    std::thread::scope(|scope| {
        for t in 0..4 {
            let (source, endpoints, inner) = (&source, &endpoints, &inner);
            scope.spawn(move || {
                for i in 0..5_000usize {
                    let e = &endpoints[(i + t) % endpoints.len()];
                    source.health().record(e, (i / 3 + t) % 4 == 0);
                    let set = source.snapshot();
                    assert!(
                        set.by_role(Role::Prefill).len() <= 2
                            && set.by_role(Role::Decode).len() <= 6
                    );
                    if t == 0 && i % 1_000 == 0 {
                        inner.insert(ep(&format!("http://n{i}:1"), Role::Decode));
                    }
                }
            });
        }
    });
    std::thread::sleep(Duration::from_millis(1));
    for e in &endpoints {
        source.health().record(e, true);
    }
    let states = source.health().states();
    assert_eq!(states.len(), 3 + 5);
    assert!(
        states.iter().all(|(_, _, h)| *h == EndpointHealth::Healthy),
        "{states:?}"
    );
    let set = source.snapshot();
    assert_eq!(
        (
            set.by_role(Role::Prefill).len(),
            set.by_role(Role::Decode).len()
        ),
        (2, 6)
    );
}

/// A transport answering each authority's checks with the status set for it (none:
/// connection refused), counting the checks.
#[derive(Default)]
struct Checks {
    status: Mutex<HashMap<String, u16>>,
    count: Mutex<HashMap<String, usize>>,
    total: AtomicUsize,
}

impl Checks {
    fn set(&self, authority: &str, status: Option<u16>) {
        let mut map = lock(&self.status);
        match status {
            Some(s) => map.insert(authority.to_owned(), s),
            None => map.remove(authority),
        };
    }

    fn count(&self, authority: &str) -> usize {
        lock(&self.count).get(authority).copied().unwrap_or(0)
    }
}

impl Transport for Checks {
    fn send(&self, req: http::Request<Bytes>) -> disagg_core::transport::ResponseFuture {
        use http_body_util::BodyExt;
        let authority = req.uri().authority().unwrap().to_string();
        assert_eq!(req.uri().path(), "/health");
        *lock(&self.count).entry(authority.clone()).or_default() += 1;
        self.total.fetch_add(1, Ordering::Relaxed);
        let status = lock(&self.status).get(&authority).copied();
        Box::pin(async move {
            match status {
                Some(s) => {
                    let body = http_body_util::Empty::new()
                        .map_err(|never| match never {})
                        .boxed();
                    let mut resp = http::Response::new(body);
                    *resp.status_mut() = http::StatusCode::from_u16(s).unwrap();
                    Ok(resp)
                }
                None => Err(TransportError::Connect("refused".into())),
            }
        })
    }
}

#[tokio::test(start_paused = true)]
async fn checks_take_an_engine_out_after_the_threshold_and_back_after_a_pass() {
    let inner = StaticSource::new([
        ep("http://a:1@0", Role::Prefill),
        ep("http://a:1@1", Role::Prefill),
        ep("http://a:1", Role::Decode),
        ep("http://b:1", Role::Decode),
    ]);
    let source = HealthSource::new(inner, HealthConfig::default());
    let checks = Arc::new(Checks::default());
    checks.set("a:1", Some(200));
    checks.set("b:1", Some(200));
    let (stop_tx, stop) = watch::channel(false);
    let task = tokio::spawn(Arc::clone(source.health()).run_checks(Arc::clone(&checks), stop));
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(
        checks.count("a:1"),
        1,
        "once per authority, not per rank or role"
    );
    checks.set("a:1", Some(503));
    // Checks at 5 s (1st failure) and 10 s (2nd: out).
    tokio::time::sleep(Duration::from_millis(9_998)).await;
    assert_eq!(
        source.snapshot().by_role(Role::Prefill).len(),
        2,
        "one failure is not enough"
    );
    tokio::time::sleep(Duration::from_millis(2)).await;
    tokio::task::yield_now().await;
    let set = source.snapshot();
    assert!(
        set.by_role(Role::Prefill).is_empty(),
        "every rank of the engine is out"
    );
    assert_eq!(
        ids(set.by_role(Role::Decode)),
        ["http://b:1"],
        "and its decode role"
    );
    let a0 = find(&source, "http://a:1@0", Role::Prefill);
    assert_eq!(source.health().state(&a0), Some(EndpointHealth::Down));
    checks.set("a:1", Some(204));
    tokio::time::sleep(Duration::from_secs(5)).await;
    tokio::task::yield_now().await;
    assert_eq!(
        source.snapshot().by_role(Role::Prefill).len(),
        2,
        "one pass brings it back"
    );
    assert_eq!(checks.count("a:1"), 4);
    assert_eq!(checks.count("b:1"), 4);
    stop_tx.send_replace(true);
    task.await.unwrap();
    let total = checks.total.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(checks.total.load(Ordering::Relaxed), total, "stopped");
}

#[tokio::test(start_paused = true)]
async fn a_refused_engine_goes_down_and_stopping_the_checks_lifts_the_verdict() {
    let inner = StaticSource::new([
        ep("http://a:1", Role::Prefill),
        ep("http://b:1", Role::Decode),
    ]);
    let source = HealthSource::new(inner, HealthConfig::default());
    let checks = Arc::new(Checks::default());
    checks.set("b:1", Some(200));
    let (_stop_tx, stop) = watch::channel(false);
    let task = tokio::spawn(Arc::clone(source.health()).run_checks(Arc::clone(&checks), stop));
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(source.snapshot().by_role(Role::Prefill).is_empty());
    task.abort();
    let _ = task.await;
    assert_eq!(source.snapshot().by_role(Role::Prefill).len(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_checker_publishes_returns_and_inner_changes_to_watchers() {
    let inner = Arc::new(StaticSource::new([
        ep("http://a:1", Role::Prefill),
        ep("http://b:1", Role::Decode),
    ]));
    let source = HealthSource::new(Arc::clone(&inner), HealthConfig::default());
    let checks = Arc::new(Checks::default());
    checks.set("a:1", Some(200));
    checks.set("b:1", Some(200));
    let (_stop_tx, stop) = watch::channel(false);
    tokio::spawn(Arc::clone(source.health()).run_checks(Arc::clone(&checks), stop));
    let mut rx = source.watch();
    let a = find(&source, "http://a:1", Role::Prefill);
    fail(source.health(), &a, 5);
    assert!(rx.borrow_and_update().by_role(Role::Prefill).is_empty());
    // Nobody calls snapshot(): the checker wakes at the end of the ejection.
    tokio::time::timeout(Duration::from_millis(5_001), rx.changed())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rx.borrow_and_update().by_role(Role::Prefill).len(), 1);
    inner.insert(ep("http://c:1", Role::Decode));
    tokio::time::timeout(Duration::from_millis(10), rx.changed())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rx.borrow_and_update().by_role(Role::Decode).len(), 2);
}

/// The checker made its targets from the registry before bringing it up to
/// the inner set, and its watch of the inner source took the current set as seen: an
/// engine published before the checks started, with no snapshot taken since, was never
/// checked.
#[tokio::test(start_paused = true)]
async fn an_engine_published_before_the_checks_start_is_checked() {
    let inner = Arc::new(StaticSource::new([ep("http://a:1", Role::Prefill)]));
    let source = HealthSource::new(Arc::clone(&inner), HealthConfig::default());
    // Published before the checker runs; nobody takes a snapshot.
    inner.insert(ep("http://c:1", Role::Decode));
    let checks = Arc::new(Checks::default());
    checks.set("a:1", Some(200));
    // c:1 refuses connections.
    let (_stop_tx, stop) = watch::channel(false);
    tokio::spawn(Arc::clone(source.health()).run_checks(Arc::clone(&checks), stop));
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(checks.count("c:1"), 1, "checked in the first round");
    // The second failure, at 5 s, takes it out.
    tokio::time::sleep(Duration::from_secs(5)).await;
    tokio::task::yield_now().await;
    assert_eq!(checks.count("c:1"), 2);
    let c = find(&source, "http://c:1", Role::Decode);
    assert_eq!(source.health().state(&c), Some(EndpointHealth::Down));
    assert!(source.snapshot().by_role(Role::Decode).is_empty());
}

/// The unfiltered snapshot is the inner source's set: an ejected endpoint stays in it
/// (what must reach every engine, a fanned-out admin request, reads it), as through an
/// `Arc` of the source.
#[tokio::test(start_paused = true)]
async fn the_unfiltered_snapshot_keeps_the_ejected_endpoints() {
    let (inner, source) = source(HealthConfig::default());
    let a = find(&source, "http://a:1", Role::Prefill);
    assert!(source.health().eject(&a, "a test's verdict"));
    assert_eq!(
        ids(source.snapshot().by_role(Role::Prefill)),
        ["http://b:1"]
    );
    let direct = source.unfiltered_snapshot();
    for set in [direct, Arc::new(source).unfiltered_snapshot()] {
        assert!(Arc::ptr_eq(&set, &inner.snapshot()));
        assert_eq!(
            ids(set.by_role(Role::Prefill)),
            ["http://a:1", "http://b:1"]
        );
    }
    // A source that does not filter by health gives its snapshot.
    assert!(Arc::ptr_eq(&inner.unfiltered_snapshot(), &inner.snapshot()));
}
