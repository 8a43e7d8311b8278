use super::*;
use disagg_connectors::vllm::VllmMooncake;
use disagg_connectors::vllm::VllmNixl;
use disagg_core::endpoint::{Endpoint, Role};
use disagg_pairing::KvRole;

fn ep(url: &str, role: Role, profile: KvProfile) -> Arc<Endpoint> {
    let mut ext = http::Extensions::new();
    ext.insert(profile);
    Arc::new(Endpoint::with_extensions(url, role, ext).unwrap())
}

fn profile(connector: Option<&str>, role: Option<KvRole>, tp: Option<u32>) -> KvProfile {
    KvProfile {
        connector: connector.map(str::to_owned),
        role,
        tp_size: tp,
    }
}

/// Waits (at most 2 s) for the next set a source's watch sees.
async fn next_set(rx: &mut watch::Receiver<Arc<EndpointSet>>) {
    tokio::time::timeout(std::time::Duration::from_secs(2), rx.changed())
        .await
        .unwrap()
        .unwrap();
}

/// The ids of `set`'s endpoints of `role`, in order.
fn ids(set: &EndpointSet, role: Role) -> Vec<String> {
    set.by_role(role)
        .iter()
        .map(|e| e.id().as_str().to_owned())
        .collect()
}

#[test]
fn every_refused_pair_is_listed_with_both_endpoints() {
    let set = EndpointSet::new([
        ep("http://p1:1", Role::Prefill, profile(None, None, Some(2))),
        ep("http://p2:1", Role::Prefill, profile(None, None, Some(4))),
        ep("http://d1:1", Role::Decode, profile(None, None, Some(4))),
        ep("http://d2:1", Role::Decode, profile(None, None, Some(8))),
    ]);
    let err = check_pairs(&set, &VllmMooncake::new()).unwrap_err();
    let pairs: Vec<(&str, &str)> = err
        .pairs
        .iter()
        .map(|p| (p.prefill.as_str(), p.decode.as_str()))
        .collect();
    assert_eq!(
        pairs,
        [
            ("http://p1:1", "http://d1:1"),
            ("http://p1:1", "http://d2:1"),
            ("http://p2:1", "http://d2:1"),
        ]
    );
    let text = err.to_string();
    assert!(text.contains("3 prefill/decode pair(s) refused"), "{text}");
    assert!(text.contains("from tensor-parallel size 4 to 8"), "{text}");
}

/// A source whose sets the test publishes.
struct Dynamic(watch::Sender<Arc<EndpointSet>>);

impl EndpointSource for Dynamic {
    fn watch(&self) -> watch::Receiver<Arc<EndpointSet>> {
        self.0.subscribe()
    }
}

#[tokio::test]
async fn endpoints_that_cannot_pair_are_left_out_on_change_and_refused_at_start() {
    let good = Arc::new(EndpointSet::new([
        ep("http://p:1", Role::Prefill, KvProfile::default()),
        ep("http://d:1", Role::Decode, KvProfile::default()),
    ]));
    let (tx, _) = watch::channel(Arc::clone(&good));
    let tx2 = tx.clone();
    let src = ValidatedSource::new(Dynamic(tx), Arc::new(VllmNixl::new())).unwrap();
    assert_eq!(src.snapshot().by_role(Role::Decode).len(), 1);

    // A bad decode joins: refused, the good set stays.
    let bad = Arc::new(EndpointSet::new([
        ep("http://p:1", Role::Prefill, KvProfile::default()),
        ep("http://d:1", Role::Decode, KvProfile::default()),
        ep(
            "http://d:2",
            Role::Decode,
            profile(Some("MooncakeConnector"), None, None),
        ),
    ]));
    tx2.send_replace(Arc::clone(&bad));
    let mut waited = 0;
    while src.last_error().is_none() && waited < 200 {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        waited += 1;
    }
    let err = src.last_error().expect("the bad decode is left out");
    assert_eq!(err.pairs[0].decode.as_str(), "http://d:2");
    assert_eq!(src.snapshot().by_role(Role::Decode).len(), 1);

    // With the bad decode still there, a good one joining is admitted: one bad
    // engine does not hold the fleet's other changes back.
    let more = Arc::new(EndpointSet::new([
        ep("http://p:1", Role::Prefill, KvProfile::default()),
        ep("http://d:1", Role::Decode, KvProfile::default()),
        ep(
            "http://d:2",
            Role::Decode,
            profile(Some("MooncakeConnector"), None, None),
        ),
        ep("http://d:4", Role::Decode, KvProfile::default()),
    ]));
    let mut rx = src.watch();
    rx.borrow_and_update();
    tx2.send_replace(more);
    next_set(&mut rx).await;
    let ids = ids(&src.snapshot(), Role::Decode);
    assert_eq!(ids, ["http://d:1", "http://d:4"]);
    assert_eq!(src.last_error().unwrap().pairs.len(), 1);

    // A good set passes again.
    let better = Arc::new(EndpointSet::new([
        ep("http://p:1", Role::Prefill, KvProfile::default()),
        ep("http://d:3", Role::Decode, KvProfile::default()),
    ]));
    tx2.send_replace(better);
    let mut rx = src.watch();
    next_set(&mut rx).await;
    assert_eq!(
        src.snapshot().by_role(Role::Decode)[0].id().as_str(),
        "http://d:3"
    );
    assert!(src.last_error().is_none());

    // At start, an invalid set is an error.
    let (tx, _) = watch::channel(bad);
    assert!(ValidatedSource::new(Dynamic(tx), Arc::new(VllmNixl::new())).is_err());
}

/// Engines' `/version` answers by authority; an authority not listed refuses the
/// connection, one marked hanging accepts and never answers. Counts the probes and
/// notes each one's authority and time.
#[derive(Clone)]
struct VersionServer {
    versions: Arc<Mutex<std::collections::HashMap<String, String>>>,
    hanging: Arc<Mutex<HashSet<String>>>,
    /// Authorities whose next probe is answered after a delay (with the version known
    /// when it was asked).
    slow: Arc<Mutex<std::collections::HashMap<String, std::time::Duration>>>,
    probes: Arc<AtomicU64>,
    asked: Arc<Mutex<Vec<(String, tokio::time::Instant)>>>,
    /// The number of probes so far, to await.
    bell: Arc<watch::Sender<u64>>,
}

impl VersionServer {
    fn with(pairs: &[(&str, &str)]) -> Self {
        let s = VersionServer {
            versions: Arc::default(),
            hanging: Arc::default(),
            slow: Arc::default(),
            probes: Arc::default(),
            asked: Arc::default(),
            bell: Arc::new(watch::channel(0).0),
        };
        for (a, v) in pairs {
            s.answer(a, v);
        }
        s
    }

    /// `authority` answers `version` from now on.
    fn answer(&self, authority: &str, version: &str) {
        lock(&self.hanging).remove(authority);
        lock(&self.versions).insert(authority.to_owned(), version.to_owned());
    }

    /// `authority` accepts and never answers from now on.
    fn hang(&self, authority: &str) {
        lock(&self.hanging).insert(authority.to_owned());
    }

    /// `authority` refuses the connection from now on.
    fn refuse(&self, authority: &str) {
        lock(&self.hanging).remove(authority);
        lock(&self.versions).remove(authority);
    }

    /// `authority`'s next probe is answered `delay` after it is asked.
    fn slow_next(&self, authority: &str, delay: std::time::Duration) {
        lock(&self.slow).insert(authority.to_owned(), delay);
    }

    /// When `authority` was asked, in order.
    fn asked(&self, authority: &str) -> Vec<tokio::time::Instant> {
        lock(&self.asked)
            .iter()
            .filter(|(a, _)| a == authority)
            .map(|(_, t)| *t)
            .collect()
    }

    /// Waits (at most 10 minutes, of paused time in the tests that use it) until
    /// `authority` has been asked `n` times, and returns when it was.
    async fn asked_times(&self, authority: &str, n: usize) -> Vec<tokio::time::Instant> {
        let mut rx = self.bell.subscribe();
        let waited = tokio::time::timeout(
            std::time::Duration::from_secs(600),
            rx.wait_for(|_| self.asked(authority).len() >= n),
        )
        .await;
        assert!(
            matches!(waited, Ok(Ok(_))),
            "{authority} asked {} times, not {n}",
            self.asked(authority).len()
        );
        self.asked(authority)
    }
}

impl Transport for VersionServer {
    fn send(&self, req: http::Request<bytes::Bytes>) -> disagg_core::transport::ResponseFuture {
        use http_body_util::BodyExt;
        assert_eq!(req.uri().path(), "/version");
        self.probes.fetch_add(1, Ordering::Relaxed);
        let authority = req.uri().authority().unwrap().to_string();
        lock(&self.asked).push((authority.clone(), tokio::time::Instant::now()));
        self.bell.send_modify(|n| *n += 1);
        if lock(&self.hanging).contains(&authority) {
            return Box::pin(std::future::pending());
        }
        let version = lock(&self.versions).get(&authority).cloned();
        let delay = lock(&self.slow).remove(&authority);
        Box::pin(async move {
            if let Some(d) = delay {
                tokio::time::sleep(d).await;
            }
            let Some(v) = version else {
                return Err(disagg_core::error::TransportError::Connect(
                    "refused".into(),
                ));
            };
            let body =
                http_body_util::Full::new(bytes::Bytes::from(format!(r#"{{"version":"{v}"}}"#)))
                    .map_err(|never| match never {})
                    .boxed();
            Ok(http::Response::new(body))
        })
    }
}

fn plain(url: &str, role: Role) -> Arc<Endpoint> {
    ep(url, role, KvProfile::default())
}

fn probe(server: &VersionServer) -> VersionProbe {
    VersionProbe::new(server.clone(), std::time::Duration::from_secs(1))
}

#[tokio::test]
async fn a_pair_of_different_versions_is_refused_at_start_naming_both() {
    let server = VersionServer::with(&[("p:1", "0.33.0"), ("d:1", "0.32.1")]);
    let set = Arc::new(EndpointSet::new([
        plain("http://p:1", Role::Prefill),
        plain("http://d:1", Role::Decode),
    ]));
    let (tx, _) = watch::channel(Arc::clone(&set));
    let err =
        ValidatedSource::with_versions(Dynamic(tx), Arc::new(VllmNixl::new()), probe(&server))
            .await
            .unwrap_err();
    let text = err.to_string();
    for needle in ["http://p:1", "http://d:1", "0.33.0", "0.32.1"] {
        assert!(text.contains(needle), "{text}");
    }
    // SGLang's connector does not compare versions: the same engines start.
    let (tx, _) = watch::channel(Arc::clone(&set));
    let sglang: Arc<dyn KvConnector> = Arc::new(disagg_connectors::sglang::SglangBootstrap::new());
    assert!(
        ValidatedSource::with_versions(Dynamic(tx), sglang, probe(&server))
            .await
            .is_ok()
    );
    // Nor does the check without a probe (declared facts only).
    let (tx, _) = watch::channel(set);
    assert!(ValidatedSource::new(Dynamic(tx), Arc::new(VllmNixl::new())).is_ok());
}

#[tokio::test]
async fn an_engine_without_a_version_is_paired_unchecked() {
    // d:1 refuses the probe: its version is unknown, the pair is not refused.
    let server = VersionServer::with(&[("p:1", "0.33.0")]);
    let set = Arc::new(EndpointSet::new([
        plain("http://p:1", Role::Prefill),
        plain("http://d:1", Role::Decode),
    ]));
    let (tx, _) = watch::channel(set);
    let src =
        ValidatedSource::with_versions(Dynamic(tx), Arc::new(VllmMooncake::new()), probe(&server))
            .await
            .unwrap();
    assert_eq!(src.snapshot().by_role(Role::Decode).len(), 1);
}

#[tokio::test]
async fn an_engine_of_another_version_joining_is_left_out_and_counted() {
    let server = VersionServer::with(&[
        ("p:1", "0.33.0"),
        ("d:1", "0.33.0"),
        ("d:2", "0.32.1"),
        ("d:3", "0.33.0"),
    ]);
    let first = Arc::new(EndpointSet::new([
        plain("http://p:1@0", Role::Prefill),
        plain("http://p:1@1", Role::Prefill),
        plain("http://d:1", Role::Decode),
    ]));
    let (tx, _) = watch::channel(first);
    let tx2 = tx.clone();
    let src =
        ValidatedSource::with_versions(Dynamic(tx), Arc::new(VllmNixl::new()), probe(&server))
            .await
            .unwrap();
    // One probe per engine: the two ranks of p:1 share theirs.
    assert_eq!(server.probes.load(Ordering::Relaxed), 2);
    let stats = src.stats();
    let mut rx = src.watch();
    rx.borrow_and_update();
    let joined = Arc::new(EndpointSet::new([
        plain("http://p:1@0", Role::Prefill),
        plain("http://p:1@1", Role::Prefill),
        plain("http://d:1", Role::Decode),
        plain("http://d:2", Role::Decode),
        plain("http://d:3", Role::Decode),
    ]));
    tx2.send_replace(Arc::clone(&joined));
    next_set(&mut rx).await;
    let ids = ids(&src.snapshot(), Role::Decode);
    assert_eq!(ids, ["http://d:1", "http://d:3"]);
    let err = src.last_error().unwrap();
    assert!(err.pairs.iter().all(|p| p.decode.as_str() == "http://d:2"));
    assert!(err.to_string().contains("0.32.1"), "{err}");
    assert_eq!(
        (stats.left_out(Role::Decode), stats.refused("version")),
        (1, 1)
    );
    // Published again with it still there: still left out, not counted again.
    tx2.send_replace(Arc::new(EndpointSet::new(
        joined
            .by_role(Role::Prefill)
            .iter()
            .chain(joined.by_role(Role::Decode))
            .cloned(),
    )));
    next_set(&mut rx).await;
    assert_eq!(
        (stats.left_out(Role::Decode), stats.refused("version")),
        (1, 1)
    );
    let mut registry = prometheus_client::registry::Registry::default();
    stats.register_metrics(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains("disagg_pairing_refused_total{mismatch=\"version\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("disagg_pairing_left_out{role=\"decode\"} 1"),
        "{text}"
    );
}

fn ec(url: &str, role: Role, profile: &str) -> Arc<Endpoint> {
    let mut ext = http::Extensions::new();
    ext.insert(profile.parse::<EcProfile>().unwrap());
    Arc::new(Endpoint::with_extensions(url, role, ext).unwrap())
}

#[test]
fn an_encoder_its_consumer_cannot_load_is_refused_naming_both() {
    let set = EndpointSet::new([
        ec(
            "http://e1:1",
            Role::Encode,
            "ECExampleConnector,ec_producer",
        ),
        ec(
            "http://e2:1",
            Role::Encode,
            "ECMooncakeConnector,ec_producer",
        ),
        ec("http://p:1", Role::Prefill, "example,ec_consumer"),
        plain("http://d:1", Role::Decode),
    ]);
    let err = check_pairs(&set, &VllmNixl::new()).unwrap_err();
    assert!(err.pairs.is_empty());
    assert_eq!(err.encoders.len(), 1, "{err}");
    let text = err.to_string();
    assert!(text.contains("encoder endpoint http://e2:1"), "{text}");
    assert!(text.contains("prefill endpoint http://p:1"), "{text}");
    assert!(text.contains("ECMooncakeConnector"), "{text}");
    // E -> PD: the decode is the consumer; a producer-only one cannot load.
    let epd = EndpointSet::new([
        ec("http://e1:1", Role::Encode, "cpu,ec_producer"),
        ec("http://d:1", Role::Decode, "ECCPUConnector,ec_producer"),
    ]);
    let err = check_pairs(&epd, &VllmNixl::new()).unwrap_err();
    assert!(
        matches!(
            err.encoders[0].mismatch,
            disagg_pairing::EcMismatch::ConsumerRole(_)
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("decode endpoint http://d:1"),
        "{err}"
    );
    // Undeclared profiles are not checked.
    let unchecked = EndpointSet::new([
        plain("http://e1:1", Role::Encode),
        ec("http://p:1", Role::Prefill, "example,ec_consumer"),
        plain("http://d:1", Role::Decode),
    ]);
    assert!(check_pairs(&unchecked, &VllmNixl::new()).is_ok());
}

#[tokio::test]
async fn an_encoder_joining_with_the_wrong_ec_connector_is_left_out() {
    let (tx, _) = watch::channel(Arc::new(EndpointSet::new([
        ec("http://p:1", Role::Prefill, "example,ec_consumer"),
        plain("http://d:1", Role::Decode),
    ])));
    let src = ValidatedSource::new(Dynamic(tx.clone()), Arc::new(VllmNixl::new())).unwrap();
    let stats = src.stats();
    let mut rx = src.watch();
    tx.send_replace(Arc::new(EndpointSet::new([
        ec("http://p:1", Role::Prefill, "example,ec_consumer"),
        plain("http://d:1", Role::Decode),
        ec("http://e1:1", Role::Encode, "example,ec_producer"),
        ec("http://e2:1", Role::Encode, "cpu,ec_producer"),
    ])));
    next_set(&mut rx).await;
    assert_eq!(ids(&src.snapshot(), Role::Encode), ["http://e1:1"]);
    assert_eq!(stats.left_out(Role::Encode), 1);
    assert_eq!(stats.refused("connector"), 1);
    let err = src.last_error().unwrap().to_string();
    assert!(
        err.contains("http://e2:1") && err.contains("http://p:1"),
        "{err}"
    );
}

/// An engine known silent that then hung on `GET /version` held every change of the set
/// for the whole probe timeout: it was asked again, and waited for, at each change.
#[tokio::test]
async fn a_change_is_published_without_waiting_for_an_engine_known_silent() {
    // d:1 refuses at start (its version unknown), then accepts and never answers.
    let server = VersionServer::with(&[("p:1", "0.33.0"), ("d:2", "0.33.0")]);
    let set = |decodes: &[&str]| {
        let mut all = vec![plain("http://p:1", Role::Prefill)];
        all.extend(decodes.iter().map(|d| plain(d, Role::Decode)));
        Arc::new(EndpointSet::new(all))
    };
    let (tx, _) = watch::channel(set(&["http://d:1"]));
    let timeout = std::time::Duration::from_secs(30);
    let src = ValidatedSource::with_versions(
        Dynamic(tx.clone()),
        Arc::new(VllmNixl::new()),
        VersionProbe::new(server.clone(), timeout),
    )
    .await
    .unwrap();
    server.hang("d:1");
    let mut rx = src.watch();
    rx.borrow_and_update();

    // A healthy decode joins: published at once, not after d:1's 30 s.
    tx.send_replace(set(&["http://d:1", "http://d:2"]));
    let published = tokio::time::timeout(std::time::Duration::from_secs(3), rx.changed()).await;
    assert!(
        matches!(published, Ok(Ok(()))),
        "the change waited for the silent engine"
    );
    assert_eq!(
        ids(&src.snapshot(), Role::Decode),
        ["http://d:1", "http://d:2"]
    );
    // And a removal.
    tx.send_replace(set(&["http://d:2"]));
    let published = tokio::time::timeout(std::time::Duration::from_secs(3), rx.changed()).await;
    assert!(matches!(published, Ok(Ok(()))), "the removal waited");
    assert_eq!(ids(&src.snapshot(), Role::Decode), ["http://d:2"]);
    assert_eq!(server.asked("d:1").len(), 1, "asked at start only");
}

/// A silent engine is asked again in the background, 10 s after, then at doubling
/// intervals, not at each change; one that leaves and returns is asked at once, its
/// backoff started afresh; a version learned so is compared with engines joining later.
#[tokio::test(start_paused = true)]
async fn a_silent_engine_is_asked_again_backing_off_not_at_each_change() {
    let server = VersionServer::with(&[("p:1", "0.33.0"), ("p:2", "0.33.0"), ("d:2", "0.33.0")]);
    let set = |urls: &[&str]| {
        Arc::new(EndpointSet::new(urls.iter().map(|u| {
            let role = if u.contains("//p") {
                Role::Prefill
            } else {
                Role::Decode
            };
            plain(u, role)
        })))
    };
    let (tx, _) = watch::channel(set(&["http://p:1", "http://d:1"]));
    let src = ValidatedSource::with_versions(
        Dynamic(tx.clone()),
        Arc::new(VllmNixl::new()),
        probe(&server),
    )
    .await
    .unwrap();
    let mut rx = src.watch();
    rx.borrow_and_update();
    // Changes in a row: d:1 is not asked again at each.
    for urls in [
        &["http://p:1", "http://d:1", "http://d:2"][..],
        &["http://p:1", "http://d:1"],
        &["http://p:1", "http://d:1", "http://d:2"],
    ] {
        tx.send_replace(set(urls));
        next_set(&mut rx).await;
    }
    assert_eq!(server.asked("d:1").len(), 1, "asked again at a change");
    // In the background: 10 s after, then 20 s after that.
    let at = server.asked_times("d:1", 3).await;
    let gaps = [at[1] - at[0], at[2] - at[1]];
    assert_eq!(gaps.map(|g| g.as_secs()), [10, 20], "{gaps:?}");

    // It leaves and returns: asked at once, before the set with it is published, and
    // 10 s after that again (what was kept for it left with it).
    tx.send_replace(set(&["http://p:1", "http://d:2"]));
    next_set(&mut rx).await;
    tx.send_replace(set(&["http://p:1", "http://d:1", "http://d:2"]));
    next_set(&mut rx).await;
    assert_eq!(server.asked("d:1").len(), 4);
    server.answer("d:1", "0.32.1");
    let at = server.asked_times("d:1", 5).await;
    assert_eq!((at[4] - at[3]).as_secs(), 10);
    // Its version known, it is not asked again.
    tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
    assert_eq!(server.asked("d:1").len(), 5);
    // A prefill of another version joining is checked against it.
    tx.send_replace(set(&[
        "http://p:1",
        "http://p:2",
        "http://d:1",
        "http://d:2",
    ]));
    next_set(&mut rx).await;
    assert_eq!(ids(&src.snapshot(), Role::Prefill), ["http://p:1"]);
    let err = src.last_error().unwrap().to_string();
    assert!(
        err.contains("http://p:2") && err.contains("0.32.1"),
        "{err}"
    );
}

/// A silent engine asked again in the background that hangs holds no change of the set.
#[tokio::test(start_paused = true)]
async fn a_silent_engine_hanging_when_asked_again_holds_no_change() {
    let server = VersionServer::with(&[("p:1", "0.33.0"), ("d:2", "0.33.0")]);
    let set = |decodes: &[&str]| {
        let mut all = vec![plain("http://p:1", Role::Prefill)];
        all.extend(decodes.iter().map(|d| plain(d, Role::Decode)));
        Arc::new(EndpointSet::new(all))
    };
    let (tx, _) = watch::channel(set(&["http://d:1"]));
    let src = ValidatedSource::with_versions(
        Dynamic(tx.clone()),
        Arc::new(VllmNixl::new()),
        VersionProbe::new(server.clone(), std::time::Duration::from_secs(30)),
    )
    .await
    .unwrap();
    server.hang("d:1");
    let at = server.asked_times("d:1", 2).await;
    let mut rx = src.watch();
    rx.borrow_and_update();
    tx.send_replace(set(&["http://d:1", "http://d:2"]));
    next_set(&mut rx).await;
    // Paused time moves only when every task waits on it: the change waited for nothing.
    assert_eq!(tokio::time::Instant::now(), at[1]);
    assert_eq!(
        ids(&src.snapshot(), Role::Decode),
        ["http://d:1", "http://d:2"]
    );
}

/// A set of the endpoints at `urls`, prefills those whose host starts with `p`, the others
/// decodes.
fn pd(urls: &[&str]) -> Arc<EndpointSet> {
    Arc::new(EndpointSet::new(urls.iter().map(|u| {
        let role = if u.starts_with("http://p") {
            Role::Prefill
        } else {
            Role::Decode
        };
        plain(u, role)
    })))
}

/// A background asking of d:1 still out when d:1 left and came back (a pod restarted at
/// the same address, refusing): the old asking's failure was taken as the new instance's
/// second, putting its next asking off 20 s after that failure instead of 10 s after its
/// first.
#[tokio::test(start_paused = true)]
async fn a_stale_failed_asking_does_not_put_off_an_engine_that_came_back() {
    let server = VersionServer::with(&[("p:1", "0.33.0")]);
    let (tx, _) = watch::channel(pd(&["http://p:1", "http://d:1"]));
    let src = ValidatedSource::with_versions(
        Dynamic(tx.clone()),
        Arc::new(VllmNixl::new()),
        VersionProbe::new(server.clone(), std::time::Duration::from_secs(5)),
    )
    .await
    .unwrap();
    let mut rx = src.watch();
    rx.borrow_and_update();
    // Asked again 10 s after start, it hangs (for the 5 s timeout)...
    server.hang("d:1");
    server.asked_times("d:1", 2).await;
    // ... while it leaves and comes back refusing.
    server.refuse("d:1");
    tx.send_replace(pd(&["http://p:1"]));
    next_set(&mut rx).await;
    tx.send_replace(pd(&["http://p:1", "http://d:1"]));
    next_set(&mut rx).await;
    let at = server.asked_times("d:1", 3).await;
    assert_eq!(at[2], at[1], "asked at once on its return");
    let at = server.asked_times("d:1", 4).await;
    assert_eq!((at[3] - at[2]).as_secs(), 10, "{at:?}");
}

/// A background asking of d:1 still out when d:1 left and came back refusing: the old
/// instance's version, answered late, was given to the new one.
#[tokio::test(start_paused = true)]
async fn a_stale_version_is_not_given_to_an_engine_that_came_back() {
    let server = VersionServer::with(&[("p:1", "0.33.0"), ("p:2", "0.33.0")]);
    let (tx, _) = watch::channel(pd(&["http://p:1", "http://d:1"]));
    let src = ValidatedSource::with_versions(
        Dynamic(tx.clone()),
        Arc::new(VllmNixl::new()),
        VersionProbe::new(server.clone(), std::time::Duration::from_secs(5)),
    )
    .await
    .unwrap();
    let mut rx = src.watch();
    rx.borrow_and_update();
    // Asked again 10 s after start, it answers 0.32.1, 3 s late...
    server.answer("d:1", "0.32.1");
    server.slow_next("d:1", std::time::Duration::from_secs(3));
    let at = server.asked_times("d:1", 2).await;
    // ... while it leaves and comes back refusing.
    server.refuse("d:1");
    tx.send_replace(pd(&["http://p:1"]));
    next_set(&mut rx).await;
    tx.send_replace(pd(&["http://p:1", "http://d:1"]));
    next_set(&mut rx).await;
    assert_eq!(server.asked("d:1").len(), 3);
    // Past the late answer: d:1's version is still unknown, so a prefill joining is not
    // compared with 0.32.1.
    tokio::time::sleep_until(at[1] + std::time::Duration::from_secs(5)).await;
    tx.send_replace(pd(&["http://p:1", "http://p:2", "http://d:1"]));
    next_set(&mut rx).await;
    assert_eq!(
        ids(&src.snapshot(), Role::Prefill),
        ["http://p:1", "http://p:2"],
        "{:?}",
        src.last_error()
    );
    // And it is asked again, 10 s after its return.
    let at = server.asked_times("d:1", 4).await;
    assert_eq!((at[3] - at[2]).as_secs(), 10, "{at:?}");
}

/// The inner source changed while the start-up probe was out: the set put in force was
/// the changed one, its newcomers never asked their version nor checked (and, in force,
/// never refused later).
#[tokio::test(start_paused = true)]
async fn a_change_while_the_start_up_probe_is_out_is_checked() {
    let server = VersionServer::with(&[
        ("p:1", "0.33.0"),
        ("d:1", "0.33.0"),
        ("d:2", "0.32.1"),
        ("d:3", "0.33.0"),
    ]);
    server.slow_next("p:1", std::time::Duration::from_millis(500));
    let (tx, _) = watch::channel(pd(&["http://p:1", "http://d:1"]));
    let build = ValidatedSource::with_versions(
        Dynamic(tx.clone()),
        Arc::new(VllmNixl::new()),
        probe(&server),
    );
    let change = async {
        server.asked_times("p:1", 1).await;
        tx.send_replace(pd(&[
            "http://p:1",
            "http://d:1",
            "http://d:2",
            "http://d:3",
        ]));
    };
    let (src, ()) = tokio::join!(build, change);
    let src = src.unwrap();
    let mut rx = src.watch();
    let changed = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        rx.wait_for(|s| ids(s, Role::Decode).contains(&"http://d:3".to_owned())),
    )
    .await;
    assert!(matches!(changed, Ok(Ok(_))), "the change was not published");
    assert_eq!(
        ids(&src.snapshot(), Role::Decode),
        ["http://d:1", "http://d:3"]
    );
    assert_eq!(server.asked("d:2").len(), 1, "the newcomer was not asked");
    let err = src.last_error().expect("d:2 is left out").to_string();
    assert!(
        err.contains("http://d:2") && err.contains("0.32.1"),
        "{err}"
    );
}

/// A version learned in the background is compared with the endpoints in force: the pairs
/// it conflicts with are named (for the warning), only those with the engine learned.
#[test]
fn a_version_learned_late_names_the_pairs_in_force_it_conflicts_with() {
    let set = pd(&[
        "http://p:1@0",
        "http://p:1@1",
        "http://p:2",
        "http://d:1",
        "http://d:2",
    ]);
    let [p1, _, p2] = set.by_role(Role::Prefill) else {
        panic!("three prefills");
    };
    let [d1, d2] = set.by_role(Role::Decode) else {
        panic!("two decodes");
    };
    let mut versions = Versions::new();
    versions.insert(p1, "0.33.0");
    versions.insert(p2, "0.32.1");
    versions.insert(d1, "0.32.1");
    versions.insert(d2, "0.33.0");
    // d:1 learned: it conflicts with both ranks of p:1; p:2 and d:2 conflict too, but
    // neither is new.
    let learned = [engine_of(d1).unwrap()];
    let found = conflicts(&set, &learned, &VllmNixl::new(), &versions);
    let pairs: Vec<(&str, &str)> = found
        .iter()
        .map(|p| (p.prefill.as_str(), p.decode.as_str()))
        .collect();
    assert_eq!(
        pairs,
        [
            ("http://p:1@0", "http://d:1"),
            ("http://p:1@1", "http://d:1")
        ]
    );
    let text = found[0].to_string();
    assert!(text.contains("0.33.0") && text.contains("0.32.1"), "{text}");
    // Nothing learned, or a connector that does not compare versions: nothing named.
    assert!(conflicts(&set, &[], &VllmNixl::new(), &versions).is_empty());
    let sglang = disagg_connectors::sglang::SglangBootstrap::new();
    assert!(conflicts(&set, &learned, &sglang, &versions).is_empty());
}
