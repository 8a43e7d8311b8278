//! Kubernetes discovery through kube-rs's real client (kubeconfig, HTTP, watcher,
//! reflector) against the in-test API server of `apiserver.rs`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use disagg_core::endpoint::Facts;
use disagg_core::{EndpointSource, Role, endpoint::EndpointSet};
use disagg_discovery::MergedSource;
use disagg_discovery::kubernetes::{self, ClientConfig, KubernetesConfig, PortRef};
use disagg_pairing::KvProfile;

use crate::apiserver::{FakeApiServer, ListFault, PodDesc, heavy};
use crate::support::{TempDir, eventually, ids, serves, wait_for};

/// Generous: a watch error backs off up to a few seconds before the retry.
const WAIT: Duration = Duration::from_secs(20);

const NS: &str = "llm";

fn pod<'a>(name: &'a str, role: &'a str, ip: &'a str, ready: bool) -> PodDesc<'a> {
    PodDesc {
        namespace: NS,
        name,
        labels: match role {
            "prefill" => &[("app", "vllm"), ("role", "prefill"), ("model", "llama")],
            "encode" => &[("app", "vllm"), ("role", "encode"), ("model", "llama")],
            _ => &[("app", "vllm"), ("role", "decode"), ("model", "llama")],
        },
        annotations: &[],
        ip,
        port: 8000,
        phase: "Running",
        ready,
    }
}

struct Harness {
    server: FakeApiServer,
    _dir: TempDir,
    merged: MergedSource,
}

/// The server with `pods`, and a merged source watching it through a kubeconfig whose
/// context's namespace is `llm`, once it has published its first lists.
async fn start(pods: &[PodDesc<'_>], tune: impl FnOnce(&mut KubernetesConfig)) -> Harness {
    let h = launch(pods, tune).await;
    tokio::time::timeout(WAIT, h.merged.synced())
        .await
        .expect("the first lists");
    h
}

/// As [`start`], without waiting for the first lists.
async fn launch(pods: &[PodDesc<'_>], tune: impl FnOnce(&mut KubernetesConfig)) -> Harness {
    launch_with(pods.iter().map(PodDesc::json).collect(), tune).await
}

/// As [`launch`], with the pods' JSON.
async fn launch_with(
    pods: Vec<serde_json::Value>,
    tune: impl FnOnce(&mut KubernetesConfig),
) -> Harness {
    let server = FakeApiServer::start().await;
    for p in pods {
        server.apply(p);
    }
    let dir = TempDir::new("k8s");
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, server.kubeconfig(NS)).unwrap();
    let mut config = KubernetesConfig::new(
        Some("app=vllm,role=prefill".into()),
        Some("app=vllm,role=decode".into()),
    );
    config.client = ClientConfig::Kubeconfig(kubeconfig);
    tune(&mut config);
    let source = kubernetes::spawn(config).await.unwrap();
    let merged = MergedSource::builder().source(source).build();
    Harness {
        server,
        _dir: dir,
        merged,
    }
}

/// Waits until both selectors' watches are open, so that they see what the test does
/// to them.
async fn watching(h: &Harness) {
    eventually(WAIT, "both watches open", || h.server.open_watches() == 2).await;
}

fn stats(h: &Harness) -> &disagg_discovery::SourceStats {
    h.merged.sources().next().unwrap().1
}

fn find(set: &EndpointSet, role: Role, id: &str) -> Arc<disagg_core::Endpoint> {
    set.by_role(role)
        .iter()
        .find(|e| e.id().as_str() == id)
        .cloned()
        .unwrap_or_else(|| panic!("{id} not in the set"))
}

/// Records the prefill and decode counts of every set published.
fn record(merged: &MergedSource) -> Arc<Mutex<Vec<(usize, usize)>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut rx = merged.watch();
    let out = Arc::clone(&seen);
    tokio::spawn(async move {
        while rx.changed().await.is_ok() {
            let set = rx.borrow_and_update().clone();
            out.lock().unwrap().push((
                set.by_role(Role::Prefill).len(),
                set.by_role(Role::Decode).len(),
            ));
        }
    });
    seen
}

#[tokio::test]
async fn pods_join_when_ready_and_leave_when_not_ready_deleted_or_unlabelled() {
    let mut p1 = pod("p1", "prefill", "127.0.1.1", true);
    p1.annotations = &[
        ("vllm.ai/bootstrap-port", "8998"),
        ("disagg.io/kv-connector", "NixlConnector"),
        ("disagg.io/kv-role", "kv_producer"),
        ("disagg.io/tp-size", "2"),
    ];
    // Another namespace and another app: both out of scope.
    let mut elsewhere = pod("p9", "prefill", "127.0.9.9", true);
    elsewhere.namespace = "elsewhere";
    let mut other_app = pod("o1", "prefill", "127.0.9.8", true);
    other_app.labels = &[("app", "other"), ("role", "prefill")];
    let h = start(
        &[
            p1,
            pod("d1", "decode", "127.0.2.1", true),
            PodDesc {
                phase: "Pending",
                ..pod("d2", "decode", "127.0.2.2", false)
            },
            elsewhere,
            other_app,
        ],
        |_| {},
    )
    .await;
    let first = h.merged.snapshot();
    assert_eq!(ids(&first, Role::Prefill), ["http://127.0.1.1:8000"]);
    assert_eq!(ids(&first, Role::Decode), ["http://127.0.2.1:8000"]);
    let p1 = find(&first, Role::Prefill, "http://127.0.1.1:8000");
    assert_eq!(p1.facts().get(Facts::BOOTSTRAP_PORT), Some("8998"));
    let profile = p1.ext().get::<KvProfile>().unwrap();
    assert_eq!(
        (profile.connector.as_deref(), profile.tp_size),
        (Some("NixlConnector"), Some(2))
    );
    assert!(serves(&p1, "llama") && !serves(&p1, "qwen"));

    // A request in flight on d1 for the whole test.
    let d1 = find(&first, Role::Decode, "http://127.0.2.1:8000");
    let in_flight = d1.track();

    // d2 starts running, then turns ready.
    h.server.apply(
        PodDesc {
            phase: "Running",
            ..pod("d2", "decode", "127.0.2.2", false)
        }
        .json(),
    );
    h.server
        .apply(pod("d2", "decode", "127.0.2.2", true).json());
    let set = wait_for(&h.merged, WAIT, "d2 ready", |s| {
        s.by_role(Role::Decode).len() == 2
    })
    .await;
    let still = find(&set, Role::Decode, "http://127.0.2.1:8000");
    assert!(Arc::ptr_eq(&still, &d1), "d1 stays the same endpoint");
    assert_eq!(still.in_flight(), 1);

    // d1 turns not ready: out of the set; its request still holds it.
    h.server
        .apply(pod("d1", "decode", "127.0.2.1", false).json());
    let set = wait_for(&h.merged, WAIT, "d1 not ready", |s| {
        ids(s, Role::Decode) == ["http://127.0.2.2:8000"]
    })
    .await;
    assert!(
        set.by_role(Role::Decode)
            .iter()
            .all(|e| !Arc::ptr_eq(e, &d1))
    );
    assert_eq!(d1.in_flight(), 1);
    drop(in_flight);
    assert_eq!(d1.in_flight(), 0);

    // A second prefill joins; the first is deleted.
    h.server
        .apply(pod("p2", "prefill", "127.0.1.2", true).json());
    wait_for(&h.merged, WAIT, "p2 joins", |s| {
        s.by_role(Role::Prefill).len() == 2
    })
    .await;
    h.server.delete(NS, "p1");
    let set = wait_for(&h.merged, WAIT, "p1 deleted", |s| {
        ids(s, Role::Prefill) == ["http://127.0.1.2:8000"]
    })
    .await;

    // d2 loses its role label: it no longer matches the selector (a DELETED event).
    let d2 = find(&set, Role::Decode, "http://127.0.2.2:8000");
    h.server.apply(
        PodDesc {
            labels: &[("app", "vllm"), ("role", "drained")],
            ..pod("d2", "decode", "127.0.2.2", true)
        }
        .json(),
    );
    wait_for(&h.merged, WAIT, "d2 unlabelled", |s| {
        s.by_role(Role::Decode).is_empty()
    })
    .await;
    assert_eq!(d2.in_flight(), 0);

    // What the client asked: one list per selector, watches with bookmarks from the
    // list's version, nothing relisted.
    let requests = h.server.requests();
    let lists: Vec<_> = requests
        .iter()
        .filter(|(w, _)| !w)
        .map(|(_, q)| q)
        .collect();
    assert_eq!(lists.len(), 2, "{requests:?}");
    assert!(
        lists
            .iter()
            .any(|q| q.contains("labelSelector=app%3Dvllm%2Crole%3Dprefill"))
    );
    assert!(
        lists
            .iter()
            .any(|q| q.contains("labelSelector=app%3Dvllm%2Crole%3Ddecode"))
    );
    assert!(
        requests
            .iter()
            .filter(|(w, _)| *w)
            .all(|(_, q)| q.contains("allowWatchBookmarks=true") && q.contains("resourceVersion="))
    );
    let s = stats(&h);
    assert_eq!((s.errors(), s.rejected()), (0, 0));
    assert_eq!((s.added(), s.removed()), (4, 3));
}

#[tokio::test]
async fn watches_that_time_out_or_drop_resume_from_their_version_without_relisting() {
    // The server ends every watch after 1 s (timeoutSeconds=1).
    let h = start(
        &[
            pod("p1", "prefill", "127.0.1.1", true),
            pod("d1", "decode", "127.0.2.1", true),
        ],
        |c| c.watch_timeout = Some(1),
    )
    .await;
    eventually(WAIT, "watches resumed after their timeout", || {
        h.server.watches() >= 6
    })
    .await;
    assert!(
        h.server
            .requests()
            .iter()
            .filter(|(w, _)| *w)
            .all(|(_, q)| q.contains("timeoutSeconds=1"))
    );

    // Changes made while no watch is open are replayed when it resumes.
    watching(&h).await;
    h.server.hold_watches(true);
    h.server.end_watches();
    h.server.delete(NS, "d1");
    h.server
        .apply(pod("d2", "decode", "127.0.2.2", true).json());
    h.server.hold_watches(false);
    wait_for(&h.merged, WAIT, "the missed changes", |s| {
        ids(s, Role::Decode) == ["http://127.0.2.2:8000"]
    })
    .await;
    assert_eq!(h.server.lists(), 2, "resumed, not relisted");
    assert_eq!(stats(&h).errors(), 0);
}

/// A gateway that closes every watch as soon as it is opened does not drive the watcher
/// into a tight loop of watch requests: after the second watch in a row that ended at
/// once, each is counted as an error and waited on with backoff; once watches are
/// served again, changes are published.
#[tokio::test]
async fn watches_closed_at_once_are_reopened_with_backoff() {
    const WINDOW: Duration = Duration::from_secs(6);
    let h = start(
        &[
            pod("p1", "prefill", "127.0.1.1", true),
            pod("d1", "decode", "127.0.2.1", true),
        ],
        |_| {},
    )
    .await;
    watching(&h).await;
    let before = h.server.watches();
    h.server.close_watches_at_once(true);
    // A window of time, measured: what is asserted is how many watches it held.
    tokio::time::sleep(WINDOW).await;
    let watches = h.server.watches() - before;
    // Per selector: the open watch ends (short: it opened moments ago), the next ends
    // at once too, then each waits (0.8 s, 1.6 s, 3.2 s, each up to twice as long with
    // jitter): 2 to 5 in the window. Without backoff, thousands.
    assert!(
        (4..=10).contains(&watches),
        "{watches} watch requests in {WINDOW:?}"
    );
    let errors = stats(&h).errors();
    assert!(
        errors >= 2,
        "the short watches are counted as errors: {errors}"
    );
    assert_eq!(h.server.lists(), 2, "resumed, never relisted");

    // Served again: a change made meanwhile is published.
    h.server
        .apply(pod("d2", "decode", "127.0.2.2", true).json());
    h.server.close_watches_at_once(false);
    wait_for(
        &h.merged,
        Duration::from_secs(40),
        "d2 after the backoff",
        |s| s.by_role(Role::Decode).len() == 2,
    )
    .await;
}

#[tokio::test]
async fn an_expired_version_relists_and_the_set_stays_until_the_relist_is_complete() {
    let h = start(
        &[
            pod("p1", "prefill", "127.0.1.1", true),
            pod("d1", "decode", "127.0.2.1", true),
            pod("d2", "decode", "127.0.2.2", true),
        ],
        |_| {},
    )
    .await;
    let seen = record(&h.merged);
    let p1 = find(&h.merged.snapshot(), Role::Prefill, "http://127.0.1.1:8000");

    // While the watches are down, d1 is deleted, d3 added, and the history compacted:
    // the versions they resume from are gone.
    watching(&h).await;
    h.server.hold_watches(true);
    h.server.end_watches();
    h.server.delete(NS, "d1");
    h.server
        .apply(pod("d3", "decode", "127.0.2.3", true).json());
    h.server.compact();
    h.server.hold_watches(false);

    let set = wait_for(&h.merged, WAIT, "the relisted pods", |s| {
        ids(s, Role::Decode) == ["http://127.0.2.2:8000", "http://127.0.2.3:8000"]
    })
    .await;
    // Each selector relists after its 410 (the second after its own backoff).
    eventually(WAIT, "both selectors relisted", || h.server.lists() == 4).await;
    // The relist kept the unchanged prefill as it was, and no set in between lost it.
    assert!(Arc::ptr_eq(&set.by_role(Role::Prefill)[0], &p1));
    assert!(
        seen.lock().unwrap().iter().all(|(p, d)| *p == 1 && *d >= 1),
        "{seen:?}"
    );
    // A 410 is the protocol's expiry signal, not a failure.
    assert_eq!(stats(&h).errors(), 0);
}

#[tokio::test]
async fn a_bookmark_lets_the_watch_resume_past_history_it_did_not_need() {
    let h = start(
        &[
            pod("p1", "prefill", "127.0.1.1", true),
            pod("d1", "decode", "127.0.2.1", true),
        ],
        |_| {},
    )
    .await;
    // Changes to pods neither selector matches: no event reaches the watches, only
    // the version moves on.
    let mut other = pod("o1", "prefill", "127.0.9.1", true);
    other.labels = &[("app", "other")];
    for _ in 0..3 {
        h.server.apply(other.json());
    }
    watching(&h).await;
    let watches = h.server.watches();
    let bookmarked = h.server.resource_version();
    h.server.bookmark();
    eventually(WAIT, "a bookmark on each watch", || {
        h.server.bookmarks_sent() >= 2
    })
    .await;
    // The history up to the bookmark's version is gone: only a client that took the
    // bookmark's version resumes without 410.
    h.server.compact();
    h.server.end_watches();
    eventually(WAIT, "the watches resumed", || {
        h.server.watches() >= watches + 2
    })
    .await;
    h.server
        .apply(pod("d2", "decode", "127.0.2.2", true).json());
    wait_for(&h.merged, WAIT, "d2 through the resumed watch", |s| {
        s.by_role(Role::Decode).len() == 2
    })
    .await;
    assert_eq!(
        h.server.lists(),
        2,
        "no relist: the bookmark's version was used"
    );
    assert!(
        h.server
            .requests()
            .iter()
            .any(|(w, q)| *w && q.contains(&format!("resourceVersion={bookmarked}"))),
        "a watch resumed from the bookmark's version {bookmarked}"
    );
}

#[tokio::test]
async fn failed_requests_back_off_and_keep_the_last_good_pods() {
    let h = start(
        &[
            pod("p1", "prefill", "127.0.1.1", true),
            pod("d1", "decode", "127.0.2.1", true),
        ],
        |_| {},
    )
    .await;
    let before = h.merged.snapshot();
    watching(&h).await;
    h.server.fail_requests(true);
    eventually(WAIT, "failed watches counted", || stats(&h).errors() >= 2).await;
    assert!(
        Arc::ptr_eq(&h.merged.snapshot(), &before),
        "the set was kept"
    );
    // The server recovers, with a change made while it failed.
    h.server
        .apply(pod("d2", "decode", "127.0.2.2", true).json());
    h.server.fail_requests(false);
    let set = wait_for(&h.merged, WAIT, "recovery", |s| {
        s.by_role(Role::Decode).len() == 2
    })
    .await;
    assert!(Arc::ptr_eq(
        &set.by_role(Role::Prefill)[0],
        &before.by_role(Role::Prefill)[0]
    ));
}

#[tokio::test]
async fn unusable_pods_are_left_out_and_counted_and_ports_are_found_by_name() {
    let mut bad = pod("p1", "prefill", "127.0.1.1", true);
    bad.annotations = &[("sglang.ai/bootstrap-port", "eighty")];
    let mut d1 = pod("d1", "decode", "127.0.2.1", true);
    d1.annotations = &[
        ("disagg.io/dp-ranks", "0-1"),
        ("disagg.io/models", "meta-llama/Llama-3.1-8B"),
        ("disagg.io/kv-events", "5557"),
    ];
    let h = start(&[bad, d1], |c| {
        c.namespace = Some(NS.into());
        c.port = Some(PortRef::Name("http".into()));
    })
    .await;
    let set = h.merged.snapshot();
    assert!(set.by_role(Role::Prefill).is_empty());
    assert_eq!(
        ids(&set, Role::Decode),
        ["http://127.0.2.1:8000@0", "http://127.0.2.1:8000@1"]
    );
    assert!(
        set.by_role(Role::Decode)
            .iter()
            .all(|e| serves(e, "meta-llama/Llama-3.1-8B"))
    );
    assert_eq!(
        set.by_role(Role::Decode)[0]
            .ext()
            .get::<disagg_discovery::KvEventsEndpoint>()
            .map(|e| e.0.as_str()),
        Some("tcp://127.0.2.1:5557")
    );
    assert_eq!(stats(&h).rejected(), 1);

    // Fixed: it joins.
    let mut fixed = pod("p1", "prefill", "127.0.1.1", true);
    fixed.annotations = &[("sglang.ai/bootstrap-port", "8998")];
    h.server.apply(fixed.json());
    wait_for(&h.merged, WAIT, "the fixed pod", |s| {
        s.by_role(Role::Prefill).len() == 1
    })
    .await;
    assert_eq!(stats(&h).rejected(), 1);
}

/// E/P/D: pods matching the encode selector are encoder endpoints, with their
/// `disagg.io/ec-profile`; they come and go with their readiness like the others.
#[tokio::test]
async fn encoder_pods_join_as_encoders_with_their_ec_profile() {
    let mut e1 = pod("e1", "encode", "127.0.3.1", true);
    e1.annotations = &[("disagg.io/ec-profile", "ECExampleConnector,ec_producer")];
    let mut bad = pod("e2", "encode", "127.0.3.2", true);
    bad.annotations = &[("disagg.io/ec-profile", "example,ec_sometimes")];
    let h = start(
        &[
            pod("p1", "prefill", "127.0.1.1", true),
            pod("d1", "decode", "127.0.2.1", true),
            e1,
            bad,
        ],
        |c| c.encode_selector = Some("app=vllm,role=encode".into()),
    )
    .await;
    let set = h.merged.snapshot();
    assert_eq!(ids(&set, Role::Encode), ["http://127.0.3.1:8000"]);
    assert_eq!(ids(&set, Role::Prefill), ["http://127.0.1.1:8000"]);
    assert_eq!(ids(&set, Role::Decode), ["http://127.0.2.1:8000"]);
    let e = find(&set, Role::Encode, "http://127.0.3.1:8000");
    let profile = e.ext().get::<disagg_pairing::EcProfile>().unwrap();
    assert_eq!(profile.connector.as_deref(), Some("ECExampleConnector"));
    assert!(serves(&e, "llama"));
    // The pod with an unreadable profile is left out and counted.
    assert_eq!(stats(&h).rejected(), 1);
    assert_eq!(stats(&h).encode_endpoints(), 1);
    eventually(WAIT, "three watches open", || h.server.open_watches() == 3).await;
    // A new encoder pod joins; a not-ready one leaves.
    h.server
        .apply(pod("e3", "encode", "127.0.3.3", true).json());
    wait_for(&h.merged, WAIT, "e3 joins", |s| {
        s.by_role(Role::Encode).len() == 2
    })
    .await;
    h.server
        .apply(pod("e1", "encode", "127.0.3.1", false).json());
    let set = wait_for(&h.merged, WAIT, "e1 leaves", |s| {
        s.by_role(Role::Encode).len() == 1
    })
    .await;
    assert_eq!(ids(&set, Role::Encode), ["http://127.0.3.3:8000"]);
}

/// Makes every selector relist with `change` in the new list only: the watches end
/// while new ones wait, `change` is made and the history compacted, so the versions the
/// watches resume from are gone (`410 Gone`) and the change reaches the client only
/// through a relist.
fn relist_with(h: &Harness, change: impl FnOnce(&FakeApiServer)) {
    h.server.hold_watches(true);
    h.server.end_watches();
    change(&h.server);
    h.server.compact();
    h.server.hold_watches(false);
}

/// A list whose response stops halfway on a connection left open (an API server gone
/// without a reset, a load balancer that failed over) fails once the read timeout
/// passes, and is retried: a relist in that window no longer stops every later change
/// from being published.
#[tokio::test]
async fn a_list_that_stalls_halfway_fails_after_the_read_timeout_and_is_retried() {
    let h = start(
        &[
            pod("p1", "prefill", "127.0.1.1", true),
            pod("d1", "decode", "127.0.2.1", true),
        ],
        |c| {
            // The server ends each watch after 1 s, before the read timeout would.
            c.watch_timeout = Some(1);
            c.read_timeout = Some(Duration::from_secs(2));
        },
    )
    .await;
    // The relists' first lists stall; the default request timeout (90 s) is past WAIT:
    // only the read timeout ends them in time.
    h.server.fault_lists(ListFault::Stall, 2);
    relist_with(&h, |s| {
        s.apply(pod("d2", "decode", "127.0.2.2", true).json());
    });
    wait_for(&h.merged, WAIT, "d2 through the retried relist", |s| {
        ids(s, Role::Decode) == ["http://127.0.2.1:8000", "http://127.0.2.2:8000"]
    })
    .await;
    // Two first lists, two failed ones, two retried: each failure is counted before
    // its selector lists again.
    eventually(WAIT, "both selectors listed again", || {
        h.server.lists() >= 6
    })
    .await;
    assert!(stats(&h).errors() >= 2, "the stalled lists are counted");
}

/// A list that trickles (a byte now and then, so no read timeout fires) fails once the
/// request timeout passes, and is retried.
#[tokio::test]
async fn a_list_that_trickles_fails_after_the_request_timeout_and_is_retried() {
    let h = start(
        &[
            pod("p1", "prefill", "127.0.1.1", true),
            pod("d1", "decode", "127.0.2.1", true),
        ],
        |c| c.request_timeout = Duration::from_secs(1),
    )
    .await;
    watching(&h).await;
    h.server.fault_lists(ListFault::Drip, 2);
    relist_with(&h, |s| {
        s.apply(pod("d2", "decode", "127.0.2.2", true).json());
    });
    wait_for(&h.merged, WAIT, "d2 through the retried relist", |s| {
        s.by_role(Role::Decode).len() == 2
    })
    .await;
    // Two first lists, two failed ones, two retried: each failure is counted before
    // its selector lists again.
    eventually(WAIT, "both selectors listed again", || {
        h.server.lists() >= 6
    })
    .await;
    assert!(stats(&h).errors() >= 2, "the trickling lists are counted");
}

/// A list response past the byte ceiling is refused (counted, retried), not taken, and
/// lists ask for pages of 100 pods.
#[tokio::test]
async fn a_list_past_the_byte_ceiling_is_refused_and_retried() {
    const MIB: usize = 1024 * 1024;
    let h = start(
        &[
            pod("p1", "prefill", "127.0.1.1", true),
            pod("d1", "decode", "127.0.2.1", true),
        ],
        |c| c.max_response_bytes = MIB,
    )
    .await;
    watching(&h).await;
    // Valid lists, 2 MiB of JSON whitespace each.
    h.server.fault_lists(ListFault::Pad(2 * MIB), 2);
    relist_with(&h, |s| {
        s.apply(pod("d2", "decode", "127.0.2.2", true).json());
    });
    wait_for(&h.merged, WAIT, "d2 through the retried relist", |s| {
        s.by_role(Role::Decode).len() == 2
    })
    .await;
    // Two first lists, two failed ones, two retried: each failure is counted before
    // its selector lists again.
    eventually(WAIT, "both selectors listed again", || {
        h.server.lists() >= 6
    })
    .await;
    assert!(stats(&h).errors() >= 2, "the oversized lists are counted");
    let requests = h.server.requests();
    assert!(
        requests
            .iter()
            .filter(|(w, _)| !w)
            .all(|(_, q)| q.contains("limit=100")),
        "{requests:?}"
    );
}

/// A pod whose containers carry `env_bytes` of environment (a pod object may be up to
/// etcd's 1.5 MiB; its annotations alone up to 256 KiB).
fn with_env(desc: PodDesc<'_>, env_bytes: usize) -> serde_json::Value {
    let mut json = desc.json();
    let env: Vec<serde_json::Value> = (0..env_bytes.div_ceil(1024))
        .map(|i| serde_json::json!({"name": format!("V{i}"), "value": "x".repeat(1024)}))
        .collect();
    json["spec"]["containers"][0]["env"] = serde_json::Value::Array(env);
    json
}

/// One watch event past the byte ceiling fails the watch (counted; the set is kept)
/// rather than being buffered; a watch carrying more than the ceiling in all, each event
/// under it, is not cut; a relist recovers.
#[tokio::test]
async fn a_watch_event_past_the_byte_ceiling_fails_the_watch_and_a_relist_recovers() {
    const KIB: usize = 1024;
    let h = start(
        &[
            pod("p1", "prefill", "127.0.1.1", true),
            pod("d1", "decode", "127.0.2.1", true),
        ],
        |c| c.max_response_bytes = 256 * KIB,
    )
    .await;
    watching(&h).await;
    // 20 events of 20 KiB on the decode watch: 400 KiB in all.
    for i in 0..20 {
        h.server.apply(with_env(
            pod("d2", "decode", "127.0.2.2", i == 19),
            20 * KIB,
        ));
    }
    wait_for(&h.merged, WAIT, "d2 after twenty events", |s| {
        s.by_role(Role::Decode).len() == 2
    })
    .await;
    assert_eq!(stats(&h).errors(), 0, "no watch was cut");
    let before = h.merged.snapshot();

    // One event of 512 KiB.
    h.server
        .apply(with_env(pod("d3", "decode", "127.0.2.3", true), 512 * KIB));
    eventually(WAIT, "the oversized event fails the watch", || {
        stats(&h).errors() >= 1
    })
    .await;
    assert!(
        Arc::ptr_eq(&h.merged.snapshot(), &before),
        "the set was kept"
    );

    // d3 shrinks and the history is compacted: the relist brings it as it is now.
    relist_with(&h, |s| {
        s.apply(pod("d3", "decode", "127.0.2.3", true).json())
    });
    wait_for(&h.merged, WAIT, "d3 through the relist", |s| {
        s.by_role(Role::Decode).len() == 3
    })
    .await;
}

/// A selector matching more pods than it may hold (twice `max_endpoints`) is refused
/// whole, not held, logged and counted as over its ceiling; the source stays up, keeps
/// its last good pods, and takes the list once it is within the ceiling again. A watch
/// that adds pods past it is refused the same way.
#[tokio::test]
async fn a_selector_past_its_pod_ceiling_is_refused_and_the_source_stays_up() {
    // 4 endpoints: 8 pods per selector. 30 decode pods, 3 of them ready.
    let names: Vec<String> = (0..30).map(|i| format!("d{i:02}")).collect();
    let ips: Vec<String> = (0..30).map(|i| format!("127.0.2.{}", i + 1)).collect();
    let mut pods = vec![pod("p1", "prefill", "127.0.1.1", true)];
    pods.extend((0..30).map(|i| pod(&names[i], "decode", &ips[i], i < 3)));
    let h = launch(&pods, |c| c.max_endpoints = 4).await;
    eventually(WAIT, "the decode list refused", || {
        stats(&h).over_limit() >= 1
    })
    .await;
    assert!(stats(&h).errors() >= 1);
    assert_eq!(
        h.merged.snapshot().iter().count(),
        0,
        "nothing published before every selector listed"
    );
    // The pods beyond the first five go: the retried list is taken.
    for name in &names[5..] {
        h.server.delete(NS, name);
    }
    let set = wait_for(&h.merged, WAIT, "the list within the ceiling", |s| {
        s.by_role(Role::Decode).len() == 3
    })
    .await;
    assert_eq!(ids(&set, Role::Prefill), ["http://127.0.1.1:8000"]);

    // Four more pods through the watch: 9 for the decode selector.
    watching(&h).await;
    let over = stats(&h).over_limit();
    for i in 5..9 {
        h.server
            .apply(pod(&names[i], "decode", &ips[i], false).json());
    }
    eventually(WAIT, "the watch refused", || stats(&h).over_limit() > over).await;
    assert!(Arc::ptr_eq(&h.merged.snapshot(), &set), "the set was kept");
    // One goes: the relist is taken (d07 turned ready and d02 not, within 4 endpoints).
    h.server.delete(NS, &names[8]);
    h.server
        .apply(pod(&names[7], "decode", &ips[7], true).json());
    h.server
        .apply(pod(&names[2], "decode", &ips[2], false).json());
    wait_for(&h.merged, WAIT, "the relist within the ceiling", |s| {
        ids(s, Role::Decode)
            == [
                "http://127.0.2.1:8000",
                "http://127.0.2.2:8000",
                "http://127.0.2.8:8000",
            ]
    })
    .await;
}

/// Pods making more endpoints than `max_endpoints`, ranks counted, are not published:
/// the source keeps its last good list and counts the refusal once; a list within the
/// ceiling is published again.
#[tokio::test]
async fn pods_past_the_endpoint_ceiling_are_not_published() {
    let ranked = |name: &'static str, ip: &'static str, ready: bool| PodDesc {
        annotations: &[("disagg.io/dp-ranks", "0-1")],
        ..pod(name, "decode", ip, ready)
    };
    // 5 endpoints: p1, and d1 and d2 of two ranks each.
    let h = start(
        &[
            pod("p1", "prefill", "127.0.1.1", true),
            ranked("d1", "127.0.2.1", true),
            ranked("d2", "127.0.2.2", true),
        ],
        |c| c.max_endpoints = 5,
    )
    .await;
    let before = h.merged.snapshot();
    assert_eq!(before.iter().count(), 5);
    watching(&h).await;
    // d3: 7 endpoints.
    h.server.apply(ranked("d3", "127.0.2.3", true).json());
    eventually(WAIT, "the list refused", || stats(&h).over_limit() == 1).await;
    assert!(
        Arc::ptr_eq(&h.merged.snapshot(), &before),
        "the set was kept"
    );
    // A change that leaves it over the ceiling is not counted again; d2 goes: 5
    // endpoints again, published.
    h.server.apply(ranked("d4", "127.0.2.4", false).json());
    h.server.delete(NS, "d2");
    let set = wait_for(&h.merged, WAIT, "the list within the ceiling", |s| {
        ids(s, Role::Decode)
            == [
                "http://127.0.2.1:8000@0",
                "http://127.0.2.1:8000@1",
                "http://127.0.2.3:8000@0",
                "http://127.0.2.3:8000@1",
            ]
    })
    .await;
    assert_eq!(set.iter().count(), 5);
    assert_eq!(stats(&h).over_limit(), 1);
}

/// A pod whose `disagg.io/dp-ranks` passes the rank ceiling (`--max-dp-ranks`) is
/// left out alone, logged and counted as rejected, before its ranks count toward the
/// endpoint ceiling: the other pods are published, and so are later changes (a pod
/// added, a pod deleted), rather than every later list being refused as over the
/// endpoint ceiling.
#[tokio::test]
async fn a_pod_with_ranks_past_the_rank_ceiling_is_left_out_alone() {
    let mut d8 = pod("d8", "decode", "127.0.2.8", true);
    d8.annotations = &[("disagg.io/dp-ranks", "0-9999")];
    let mut d9 = pod("d9", "decode", "127.0.2.9", true);
    d9.annotations = &[("disagg.io/dp-ranks", "0-4294967295")];
    let h = launch(
        &[
            pod("p1", "prefill", "127.0.1.1", true),
            pod("d1", "decode", "127.0.2.1", true),
            d8,
            d9,
        ],
        |_| {},
    )
    .await;
    let set = wait_for(&h.merged, WAIT, "the pods within the ceilings", |s| {
        ids(s, Role::Prefill) == ["http://127.0.1.1:8000"]
            && ids(s, Role::Decode) == ["http://127.0.2.1:8000"]
    })
    .await;
    assert_eq!(set.iter().count(), 2);
    assert_eq!(stats(&h).rejected(), 2);
    assert_eq!(stats(&h).over_limit(), 0);

    // A scale-up and a deletion are still published.
    watching(&h).await;
    h.server
        .apply(pod("d2", "decode", "127.0.2.2", true).json());
    wait_for(&h.merged, WAIT, "the scale-up", |s| {
        ids(s, Role::Decode) == ["http://127.0.2.1:8000", "http://127.0.2.2:8000"]
    })
    .await;
    h.server.delete(NS, "d1");
    wait_for(&h.merged, WAIT, "the deletion", |s| {
        ids(s, Role::Decode) == ["http://127.0.2.2:8000"]
    })
    .await;
    assert_eq!(stats(&h).rejected(), 2, "each refused pod counted once");
    assert_eq!(stats(&h).over_limit(), 0);
}

/// A list page within the byte ceiling but made of empty objects (`{}`, each of which
/// would decode into a whole pod) is refused by its count of JSON objects (counted,
/// retried), and a normal page still passes.
#[tokio::test]
async fn a_list_of_many_empty_objects_is_refused_and_retried() {
    // Pages of 16 pods: 65,536 JSON objects.
    let h = start(
        &[
            pod("p1", "prefill", "127.0.1.1", true),
            pod("d1", "decode", "127.0.2.1", true),
        ],
        |c| c.page_size = 16,
    )
    .await;
    watching(&h).await;
    // 70,000 `{}`: 210 KB of a 64 MiB ceiling.
    h.server.fault_lists(ListFault::Empties(70_000), 2);
    relist_with(&h, |s| {
        s.apply(pod("d2", "decode", "127.0.2.2", true).json());
    });
    wait_for(&h.merged, WAIT, "d2 through the retried relist", |s| {
        s.by_role(Role::Decode).len() == 2
    })
    .await;
    eventually(WAIT, "both selectors listed again", || {
        h.server.lists() >= 6
    })
    .await;
    assert!(stats(&h).errors() >= 2, "the refused lists are counted");
    assert_eq!(
        ids(&h.merged.snapshot(), Role::Prefill),
        ["http://127.0.1.1:8000"]
    );
}

/// A watch event within the byte ceiling but holding more JSON objects than a page may
/// fails the watch (counted; the set is kept).
#[tokio::test]
async fn a_watch_event_of_too_many_objects_fails_the_watch() {
    let h = start(
        &[
            pod("p1", "prefill", "127.0.1.1", true),
            pod("d1", "decode", "127.0.2.1", true),
        ],
        |c| c.page_size = 16,
    )
    .await;
    watching(&h).await;
    let before = h.merged.snapshot();
    let mut heavy = pod("d2", "decode", "127.0.2.2", true).json();
    heavy["metadata"]["managedFields"] =
        serde_json::Value::Array(vec![serde_json::json!({}); 70_000]);
    h.server.apply(heavy);
    eventually(WAIT, "the event fails the watch", || {
        stats(&h).errors() >= 1
    })
    .await;
    assert!(
        Arc::ptr_eq(&h.merged.snapshot(), &before),
        "the set was kept"
    );
    // d2 as a real pod is: the watch resumes past it (its event refused) only through a
    // relist, which takes it as it is now.
    relist_with(&h, |s| {
        s.apply(pod("d2", "decode", "127.0.2.2", true).json())
    });
    wait_for(&h.merged, WAIT, "d2 through the relist", |s| {
        s.by_role(Role::Decode).len() == 2
    })
    .await;
}

/// A watch event within the byte and object ceilings but holding more JSON values than
/// a page may (a `managedFields` entry's free-form `fieldsV1` of 300,000 zeros, 600 KB:
/// skipped unread, but the count cannot tell them from 300,000 labels) fails the watch
/// (counted; the set is kept); real pods are taken again through the relist.
#[tokio::test]
async fn a_watch_event_of_a_huge_free_form_array_fails_the_watch() {
    // Pages of 16 pods: 262,144 JSON values.
    let h = start(
        &[
            pod("p1", "prefill", "127.0.1.1", true),
            pod("d1", "decode", "127.0.2.1", true),
        ],
        |c| c.page_size = 16,
    )
    .await;
    watching(&h).await;
    let before = h.merged.snapshot();
    let mut flood = pod("d2", "decode", "127.0.2.2", true).json();
    flood["metadata"]["managedFields"] = serde_json::json!([{
        "manager": "m", "operation": "Update", "fieldsType": "FieldsV1",
        "fieldsV1": vec![0; 300_000],
    }]);
    h.server.apply(flood);
    eventually(WAIT, "the event fails the watch", || {
        stats(&h).errors() >= 1
    })
    .await;
    assert!(
        Arc::ptr_eq(&h.merged.snapshot(), &before),
        "the set was kept"
    );
    relist_with(&h, |s| {
        s.apply(pod("d2", "decode", "127.0.2.2", true).json())
    });
    wait_for(&h.merged, WAIT, "d2 through the relist", |s| {
        s.by_role(Role::Decode).len() == 2
    })
    .await;
}

/// A page of 100 pods as heavy as real ones with sidecars get (three containers of 60
/// environment variables each, and the `managedFields` covering them: about 1,700 JSON
/// objects a pod, past the 1,024 a pod of a page was once allowed) is taken whole.
#[tokio::test]
async fn a_page_of_heavy_realistic_pods_is_taken() {
    let names: Vec<String> = (0..100).map(|i| format!("d{i:03}")).collect();
    let ips: Vec<String> = (0..100)
        .map(|i| format!("127.0.{}.{}", 2 + i / 200, 1 + i % 200))
        .collect();
    let mut pods = vec![pod("p1", "prefill", "127.0.1.1", true).json()];
    pods.extend((0..100).map(|i| heavy(pod(&names[i], "decode", &ips[i], true).json(), 3, 60)));
    let h = launch_with(pods, |_| {}).await;
    tokio::time::timeout(WAIT, h.merged.synced())
        .await
        .expect("the first lists");
    assert_eq!(h.merged.snapshot().by_role(Role::Decode).len(), 100);
    assert_eq!(stats(&h).errors(), 0);
    assert_eq!(
        h.server.lists(),
        2,
        "one page for each selector, none retried"
    );
}

/// `desc`'s pod carrying far more than discovery reads: 20,000 empty volumes
/// (`{"name":""}`) and a `managedFields` entry whose free-form `fieldsV1` has 50,000
/// members and a chain 100 deep: about 0.9 MB and 70,000 JSON objects, within the
/// default byte, object and value ceilings (64 MiB; 409,600 objects and 1,638,400 values
/// a page).
fn bulky(desc: PodDesc<'_>) -> serde_json::Value {
    let mut json = desc.json();
    json["spec"]["volumes"] = serde_json::json!(vec![serde_json::json!({"name": ""}); 20_000]);
    let mut deep = serde_json::json!({});
    for _ in 0..100 {
        deep = serde_json::json!({ "f:a": deep });
    }
    let mut fields = serde_json::Map::new();
    for i in 0..50_000 {
        fields.insert(format!("f:k{i}"), serde_json::json!({}));
    }
    fields.insert("f:deep".into(), deep);
    json["metadata"]["managedFields"] = serde_json::json!([{
        "manager": "m", "operation": "Update", "apiVersion": "v1",
        "fieldsType": "FieldsV1", "fieldsV1": fields,
    }]);
    json
}

/// Pods carrying huge fields discovery does not read are discovered with their specs,
/// through the first list and through a watch event: what discovery reads is intact.
#[tokio::test]
async fn pods_with_huge_unread_fields_are_discovered_with_their_specs() {
    let mut d1 = pod("d1", "decode", "127.0.2.1", true);
    d1.annotations = &[
        ("disagg.io/kv-connector", "NixlConnector"),
        ("disagg.io/tp-size", "2"),
        ("disagg.io/weight", "3"),
    ];
    let mut p1 = pod("p1", "prefill", "127.0.1.1", true);
    p1.annotations = &[("vllm.ai/bootstrap-port", "8998")];
    p1.port = 8100;
    let h = launch_with(vec![bulky(p1), bulky(d1)], |_| {}).await;
    tokio::time::timeout(WAIT, h.merged.synced())
        .await
        .expect("the first lists");
    let set = h.merged.snapshot();
    assert_eq!(ids(&set, Role::Prefill), ["http://127.0.1.1:8100"]);
    assert_eq!(ids(&set, Role::Decode), ["http://127.0.2.1:8000"]);
    let p1 = find(&set, Role::Prefill, "http://127.0.1.1:8100");
    assert_eq!(p1.facts().get(Facts::BOOTSTRAP_PORT), Some("8998"));
    assert!(serves(&p1, "llama"));
    let d1 = find(&set, Role::Decode, "http://127.0.2.1:8000");
    let profile = d1.ext().get::<KvProfile>().unwrap();
    assert_eq!(
        (profile.connector.as_deref(), profile.tp_size),
        (Some("NixlConnector"), Some(2))
    );
    assert_eq!(d1.weight(), 3.0);
    assert!(serves(&d1, "llama"));

    // Through the watch: d2 joins, not ready first, then ready.
    watching(&h).await;
    h.server
        .apply(bulky(pod("d2", "decode", "127.0.2.2", false)));
    h.server
        .apply(bulky(pod("d2", "decode", "127.0.2.2", true)));
    wait_for(&h.merged, WAIT, "d2 through the watch", |s| {
        ids(s, Role::Decode) == ["http://127.0.2.1:8000", "http://127.0.2.2:8000"]
    })
    .await;
    let s = stats(&h);
    assert_eq!((s.errors(), s.rejected()), (0, 0));
}

/// The in-test API server pages a list as the API server does ("Retrieving large
/// results sets in chunks", kubernetes.io/docs/reference/using-api/api-concepts/): every
/// page is of the first page's snapshot, carrying its `resourceVersion`, whatever
/// changed since (a pod deleted or changed after the first page is served as it was; one
/// created after it is not); a `continue` token whose version has been compacted is
/// refused with `410 Gone` (reason `Expired`), the client to list again.
#[tokio::test]
async fn the_in_test_api_server_pages_a_list_as_one_snapshot() {
    use disagg_discovery::kubernetes::EnginePod;
    use kube::api::{Api, ListParams};

    let server = FakeApiServer::start().await;
    for (name, ip) in [
        ("d1", "127.0.2.1"),
        ("d2", "127.0.2.2"),
        ("d3", "127.0.2.3"),
    ] {
        server.apply(pod(name, "decode", ip, true).json());
    }
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&server.kubeconfig(NS)).unwrap();
    let options = kube::config::KubeConfigOptions::default();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options)
        .await
        .unwrap();
    let api: Api<EnginePod> = Api::namespaced(kube::Client::try_from(config).unwrap(), NS);
    let lp = ListParams::default().labels("app=vllm").limit(1);
    let names = |list: &kube::core::ObjectList<EnginePod>| -> Vec<String> {
        list.items
            .iter()
            .map(|p| p.metadata.name.clone().unwrap_or_default())
            .collect()
    };

    let first = api.list(&lp).await.unwrap();
    let version = first.metadata.resource_version.clone();
    assert_eq!(names(&first), ["d1"]);
    // After the first page: d2 deleted, d3 changed (not ready), d4 created.
    server.delete(NS, "d2");
    server.apply(pod("d3", "decode", "127.0.2.3", false).json());
    server.apply(pod("d4", "decode", "127.0.2.4", true).json());
    let mut pages = vec![first];
    while let Some(token) = pages.last().and_then(|p| p.metadata.continue_.clone()) {
        assert!(pages.len() < 10, "the pages end");
        pages.push(api.list(&lp.clone().continue_token(&token)).await.unwrap());
    }
    let listed: Vec<String> = pages.iter().flat_map(names).collect();
    assert_eq!(listed, ["d1", "d2", "d3"], "the first page's snapshot");
    assert!(
        pages.iter().all(|p| p.metadata.resource_version == version),
        "every page at the first page's version {version:?}"
    );
    let d3 = &pages[2].items[0];
    let ready = d3
        .status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .any(|c| c.type_ == "Ready" && c.status == "True");
    assert!(ready, "d3 as it was at the first page");

    // A token whose version is compacted away: 410 Gone; a new list is served.
    let first = api.list(&lp).await.unwrap();
    let token = first.metadata.continue_.clone().unwrap();
    server.apply(pod("d5", "decode", "127.0.2.5", true).json());
    server.compact();
    match api.list(&lp.clone().continue_token(&token)).await {
        Err(kube::Error::Api(status)) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"));
        }
        other => panic!("an expired continue token: {other:?}"),
    }
    let again = api.list(&lp).await.unwrap();
    assert_eq!(names(&again), ["d1"]);
    assert_ne!(again.metadata.resource_version, version);
}
