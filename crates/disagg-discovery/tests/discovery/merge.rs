//! The merged source: what a change keeps, drops and counts.

use std::sync::Arc;
use std::time::Duration;

use disagg_core::endpoint::Facts;
use disagg_core::{Endpoint, EndpointSource, Role};
use disagg_discovery::{EndpointSpec, MergedSource, SpecSource};

use crate::support::{ids, wait_for};

const WAIT: Duration = Duration::from_secs(10);

fn prefill(url: &str, bootstrap: Option<u16>) -> EndpointSpec {
    let mut spec = EndpointSpec::new(url, Role::Prefill);
    if let Some(port) = bootstrap {
        spec.facts
            .insert(Facts::BOOTSTRAP_PORT, port.to_string())
            .unwrap();
    }
    spec
}

fn decode(url: &str) -> EndpointSpec {
    EndpointSpec::new(url, Role::Decode)
}

#[tokio::test]
async fn an_endpoint_that_stays_keeps_its_arc_and_its_in_flight_count() {
    let (publisher, discovered) = SpecSource::channel("test");
    publisher.publish(vec![
        prefill("http://10.0.0.1:8100", Some(8998)),
        decode("http://10.0.0.2:8200"),
        decode("http://10.0.0.3:8200"),
    ]);
    let merged = MergedSource::builder().source(discovered).build();
    merged.synced().await;
    let first = merged.snapshot();
    assert_eq!(
        ids(&first, Role::Decode),
        ["http://10.0.0.2:8200", "http://10.0.0.3:8200"]
    );

    // Requests in flight on both decodes, taken from the first set.
    let staying = Arc::clone(&first.by_role(Role::Decode)[0]);
    let leaving = Arc::clone(&first.by_role(Role::Decode)[1]);
    let on_staying = staying.track();
    let on_leaving = leaving.track();

    // 10.0.0.3 leaves, 10.0.0.4 joins, the prefill and 10.0.0.2 stay.
    publisher.publish(vec![
        prefill("http://10.0.0.1:8100", Some(8998)),
        decode("http://10.0.0.2:8200"),
        decode("http://10.0.0.4:8200"),
    ]);
    let second = wait_for(&merged, WAIT, "10.0.0.4 joins", |s| {
        ids(s, Role::Decode).contains(&"http://10.0.0.4:8200".to_owned())
    })
    .await;
    assert_eq!(
        ids(&second, Role::Decode),
        ["http://10.0.0.2:8200", "http://10.0.0.4:8200"]
    );
    // The same endpoints, not equal copies: their counters are the ones requests hold.
    assert!(Arc::ptr_eq(
        &first.by_role(Role::Prefill)[0],
        &second.by_role(Role::Prefill)[0]
    ));
    let kept = second
        .by_role(Role::Decode)
        .iter()
        .find(|e| e.id().as_str() == "http://10.0.0.2:8200")
        .unwrap();
    assert!(Arc::ptr_eq(kept, &staying));
    assert_eq!(
        kept.in_flight(),
        1,
        "the new set sees the request in flight"
    );
    // The one that left is out of the set, but the request on it still holds it.
    assert!(
        second
            .by_role(Role::Decode)
            .iter()
            .all(|e| !Arc::ptr_eq(e, &leaving))
    );
    assert_eq!(leaving.in_flight(), 1);
    drop(on_leaving);
    assert_eq!(leaving.in_flight(), 0);
    drop(on_staying);
    assert_eq!(kept.in_flight(), 0);

    let stats = merged.sources().find(|(n, _)| *n == "test").unwrap().1;
    assert_eq!(
        (stats.added(), stats.removed(), stats.replaced()),
        (4, 1, 0)
    );
    assert_eq!(
        (stats.prefill_endpoints(), stats.decode_endpoints()),
        (1, 2)
    );
    assert_eq!(stats.updates(), 2);
}

#[tokio::test]
async fn a_changed_spec_makes_a_new_endpoint_with_the_new_data() {
    let (publisher, discovered) = SpecSource::channel("test");
    publisher.publish(vec![prefill("http://10.0.0.1:8100", Some(8998))]);
    let merged = MergedSource::builder().source(discovered).build();
    merged.synced().await;
    let before = Arc::clone(&merged.snapshot().by_role(Role::Prefill)[0]);

    publisher.publish(vec![prefill("http://10.0.0.1:8100", Some(9000))]);
    let after = wait_for(&merged, WAIT, "the new bootstrap port", |s| {
        s.by_role(Role::Prefill)[0]
            .facts()
            .get(Facts::BOOTSTRAP_PORT)
            == Some("9000")
    })
    .await;
    assert!(!Arc::ptr_eq(&before, &after.by_role(Role::Prefill)[0]));
    assert_eq!(before.facts().get(Facts::BOOTSTRAP_PORT), Some("8998"));
    let stats = merged.sources().next().unwrap().1;
    assert_eq!(
        (stats.added(), stats.removed(), stats.replaced()),
        (1, 0, 1)
    );
}

#[tokio::test]
async fn fixed_endpoints_come_first_and_win_over_discovered_ones() {
    let (publisher, discovered) = SpecSource::channel("test");
    let merged = MergedSource::builder()
        .endpoints([Endpoint::new("http://10.0.0.1:8100", Role::Prefill).unwrap()])
        .source(discovered)
        .build();
    // Not synced until the source published.
    assert!(
        tokio::time::timeout(Duration::from_millis(100), merged.synced())
            .await
            .is_err()
    );
    assert_eq!(
        ids(&merged.snapshot(), Role::Prefill),
        ["http://10.0.0.1:8100"]
    );
    let fixed = Arc::clone(&merged.snapshot().by_role(Role::Prefill)[0]);

    // The discovered copy of the fixed engine (another bootstrap port) loses.
    publisher.publish(vec![
        prefill("http://10.0.0.1:8100", Some(1234)),
        prefill("http://10.0.0.9:8100", None),
    ]);
    merged.synced().await;
    let set = merged.snapshot();
    assert_eq!(
        ids(&set, Role::Prefill),
        ["http://10.0.0.1:8100", "http://10.0.0.9:8100"]
    );
    assert!(Arc::ptr_eq(&set.by_role(Role::Prefill)[0], &fixed));
    assert!(
        set.by_role(Role::Prefill)[0]
            .facts()
            .get(Facts::BOOTSTRAP_PORT)
            .is_none()
    );

    // A last good list dropped for its age (a DNS name past `max_stale`).
    publisher.record_expired();
    let mut registry = prometheus_client::registry::Registry::default();
    merged.register_metrics(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    for line in [
        "disagg_discovery_expired_total{source=\"test\"} 1\n",
        "disagg_discovery_expired_total{source=\"static\"} 0\n",
        "disagg_discovery_endpoints{source=\"static\",role=\"prefill\"} 1\n",
        "disagg_discovery_endpoints{source=\"test\",role=\"prefill\"} 1\n",
        "disagg_discovery_endpoints{source=\"test\",role=\"decode\"} 0\n",
        "disagg_discovery_duplicate_endpoints{source=\"test\"} 1\n",
        "disagg_discovery_endpoint_changes_total{source=\"test\",change=\"added\"} 1\n",
        "disagg_discovery_updates_total{source=\"test\"} 1\n",
        "# TYPE disagg_discovery_endpoint_changes counter\n",
        "# TYPE disagg_discovery_endpoints gauge\n",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
}

#[tokio::test]
async fn an_unusable_spec_is_left_out_and_counted_and_the_rest_published() {
    let (publisher, discovered) = SpecSource::channel("test");
    let merged = MergedSource::builder()
        .source(discovered)
        // The embedder's hook refuses one engine.
        .extend_with(|spec, ext| {
            if spec.url.contains("10.0.0.66") {
                return Err("refused by the embedder".into());
            }
            ext.insert("extended");
            Ok(())
        })
        .build();
    publisher.publish(vec![
        decode("ftp://10.0.0.5:8200"),
        decode("http://10.0.0.6:8200"),
        decode("http://10.0.0.66:8200"),
    ]);
    merged.synced().await;
    let set = merged.snapshot();
    assert_eq!(ids(&set, Role::Decode), ["http://10.0.0.6:8200"]);
    assert_eq!(
        set.by_role(Role::Decode)[0].ext().get::<&str>(),
        Some(&"extended")
    );
    let stats = merged.sources().next().unwrap().1;
    assert_eq!(stats.rejected(), 2);
}

#[tokio::test]
async fn two_sources_merge_in_order_and_dropping_the_merge_ends_them() {
    let (first_pub, first) = SpecSource::channel("first");
    let (second_pub, second) = SpecSource::channel("second");
    let merged = MergedSource::builder().source(first).source(second).build();
    first_pub.publish(vec![decode("http://10.0.0.1:8200")]);
    // One source published: not synced yet, but its endpoints are in the set.
    wait_for(&merged, WAIT, "the first source's decode", |s| {
        s.by_role(Role::Decode).len() == 1
    })
    .await;
    assert!(
        tokio::time::timeout(Duration::from_millis(100), merged.synced())
            .await
            .is_err()
    );
    second_pub.publish(vec![
        decode("http://10.0.0.2:8200"),
        decode("http://10.0.0.1:8200"),
    ]);
    merged.synced().await;
    let set = merged.snapshot();
    assert_eq!(
        ids(&set, Role::Decode),
        ["http://10.0.0.1:8200", "http://10.0.0.2:8200"]
    );
    let stats: Vec<_> = merged
        .sources()
        .map(|(n, s)| (n.to_owned(), s.decode_endpoints(), s.duplicates()))
        .collect();
    assert_eq!(stats, [("first".into(), 1, 0), ("second".into(), 1, 1)]);

    // The first source loses its engine; the second's copy now counts, and it is the
    // same endpoint (same spec), so nothing changed for the requests.
    let one = Arc::clone(&set.by_role(Role::Decode)[0]);
    first_pub.publish(vec![]);
    let second_stats = merged.sources().nth(1).unwrap().1;
    eventually_eq(|| second_stats.decode_endpoints(), 2).await;
    let set = merged.snapshot();
    assert_eq!(
        ids(&set, Role::Decode),
        ["http://10.0.0.1:8200", "http://10.0.0.2:8200"]
    );
    assert!(Arc::ptr_eq(&set.by_role(Role::Decode)[0], &one));
    assert_eq!(second_stats.duplicates(), 0);

    assert!(!first_pub.is_closed());
    drop(merged);
    // The merge task ends (it is aborted, and drops its receivers, on its next turn),
    // so nobody reads the sources any more and their tasks can end.
    crate::support::eventually(WAIT, "the sources closed", || {
        first_pub.is_closed() && second_pub.is_closed()
    })
    .await;
}

async fn eventually_eq(read: impl Fn() -> u64, want: u64) {
    crate::support::eventually(WAIT, "counter", || read() == want).await;
}
