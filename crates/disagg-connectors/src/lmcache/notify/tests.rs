//! Unit tests of `notify`.

use super::*;

fn wire(kind: &str, req_id: &str) -> Vec<u8> {
    #[derive(serde::Serialize)]
    struct Notif<'a> {
        #[serde(rename = "type")]
        kind: &'a str,
        req_id: &'a str,
    }
    rmp_serde::to_vec_named(&Notif { kind, req_id }).expect("encode")
}

fn config(ttl: Duration, max_pending: usize) -> NotifyConfig {
    NotifyConfig {
        ttl,
        sweep_interval: Duration::from_secs(1),
        max_pending,
        ..NotifyConfig::default()
    }
}

fn assert_consistent(stats: NotifyStats) {
    assert_eq!(
        stats.received,
        stats.matched + stats.unknown + stats.extra + stats.malformed,
        "{stats:?}"
    );
}

#[test]
fn handles_are_send_and_sync() {
    fn check<T: Send + Sync + 'static>() {}
    check::<Pending>();
    check::<Notifications>();
    check::<NotifyError>();
    check::<WaitError>();
}

#[test]
fn decodes_both_tags_and_ignores_other_keys() {
    assert_eq!(decode(&wire("ProxyNotif", "42")).ok(), Some("42"));
    assert_eq!(decode(&wire("NixlProxyNotif", "a-b")).ok(), Some("a-b"));

    // Key order and extra keys do not matter.
    let mut map = std::collections::BTreeMap::new();
    map.insert("req_id", "r1");
    map.insert("type", "ProxyNotif");
    map.insert("extra", "x");
    let bytes = rmp_serde::to_vec_named(&map).expect("encode");
    assert_eq!(decode(&bytes).ok(), Some("r1"));
}

/// A peer's frame nesting an unknown key's value deeper than a notification can is
/// refused at the depth ceiling, on a stack of a tokio worker's size (rmp-serde's own
/// 1,024 levels overflowed 2 MiB in a debug build); a nested value within it is
/// skipped as before.
#[test]
fn a_deeply_nested_unknown_value_is_refused_not_an_overflow() {
    let frame = |depth: usize| {
        // A map of 3: "x" => [[[...nil...]]], then the notification's two keys.
        let mut b = vec![0x83, 0xa1, b'x'];
        b.extend(std::iter::repeat_n(0x91, depth));
        b.push(0xc0);
        b.extend_from_slice(&[0xa4, b't', b'y', b'p', b'e', 0xaa]);
        b.extend_from_slice(b"ProxyNotif");
        b.extend_from_slice(&[0xa6, b'r', b'e', b'q', b'_', b'i', b'd', 0xa1, b'r']);
        b
    };
    let result = std::thread::Builder::new()
        .stack_size(2 * 1024 * 1024)
        .spawn(move || {
            let shallow = decode(&frame(4)).ok().map(str::to_owned);
            let deep = matches!(decode(&frame(100_000)), Err(Malformed::Undecodable(_)));
            (shallow, deep)
        })
        .expect("a thread")
        .join()
        .expect("no overflow");
    assert_eq!(result, (Some("r".to_owned()), true));
}

#[test]
fn rejects_what_is_not_a_notification() {
    assert!(matches!(
        decode(&wire("ProxyAck", "42")),
        Err(Malformed::UnknownType(kind)) if kind == "ProxyAck"
    ));
    assert!(matches!(
        decode(b"\xc1garbage"),
        Err(Malformed::Undecodable(_))
    ));
    assert!(matches!(decode(b""), Err(Malformed::Undecodable(_))));
    // A map without req_id, and one whose req_id is not a string.
    let mut missing = std::collections::BTreeMap::new();
    missing.insert("type", "ProxyNotif");
    let bytes = rmp_serde::to_vec_named(&missing).expect("encode");
    assert!(matches!(decode(&bytes), Err(Malformed::Undecodable(_))));
    #[derive(serde::Serialize)]
    struct NumericId {
        #[serde(rename = "type")]
        kind: &'static str,
        req_id: u64,
    }
    let bytes = rmp_serde::to_vec_named(&NumericId {
        kind: "ProxyNotif",
        req_id: 42,
    })
    .expect("encode");
    assert!(matches!(decode(&bytes), Err(Malformed::Undecodable(_))));
}

#[test]
fn malformed_frames_are_counted_not_stored() {
    let notifications = Notifications::detached(NotifyConfig::default());
    let pending = notifications.register("r", 1).expect("register");
    notifications.inner.on_frame(None);
    notifications.inner.on_frame(Some(&b"\x93\x01\x02"[..]));
    notifications.inner.on_frame(Some(&wire("Other", "r")));
    assert_eq!(pending.received(), 0);
    notifications.inner.on_frame(Some(&wire("ProxyNotif", "r")));
    assert_eq!(pending.received(), 1);
    let stats = notifications.stats();
    assert_eq!(stats.malformed, 3);
    assert_eq!(stats.received, 4);
    assert_eq!(stats.completed, 1);
    assert_consistent(stats);
}

#[test]
fn register_refuses_zero_duplicates_and_overflow() {
    let notifications = Notifications::detached(config(Duration::from_secs(60), 2));
    assert!(matches!(
        notifications.register("a", 0),
        Err(NotifyError::ZeroExpected)
    ));
    let a = notifications.register("a", 1).expect("a");
    assert!(matches!(
        notifications.register("a", 1),
        Err(NotifyError::Duplicate { req_id }) if req_id == "a"
    ));
    let _b = notifications.register("b", 1).expect("b");
    assert!(matches!(
        notifications.register("c", 1),
        Err(NotifyError::Full { max_pending: 2 })
    ));
    assert_eq!(notifications.pending_len(), 2);
    // Dropping a registration frees both its id and its room.
    drop(a);
    assert_eq!(notifications.pending_len(), 1);
    let _a = notifications.register("a", 1).expect("a again");
    assert!(matches!(
        notifications.register("c", 1),
        Err(NotifyError::Full { .. })
    ));
}

#[test]
fn counts_unknown_matched_completed_and_extra() {
    let notifications = Notifications::detached(NotifyConfig::default());
    let pending = notifications.register("r", 3).expect("register");
    assert_eq!(notifications.inner.notify("nobody"), Outcome::Unknown);
    assert_eq!(notifications.inner.notify("r"), Outcome::Matched);
    assert_eq!(notifications.inner.notify("r"), Outcome::Matched);
    assert_eq!(pending.received(), 2);
    assert_eq!(notifications.inner.notify("r"), Outcome::Completed);
    assert_eq!(notifications.inner.notify("r"), Outcome::Extra);
    assert_eq!(pending.received(), 3);
    assert_eq!(pending.expected(), 3);
    assert_eq!(pending.req_id(), "r");
    // Unknown ids are not stored.
    assert_eq!(notifications.pending_len(), 1);
    assert_eq!(
        notifications.stats(),
        NotifyStats {
            received: 5,
            matched: 3,
            completed: 1,
            unknown: 1,
            extra: 1,
            malformed: 0,
            evicted: 0,
        }
    );
}

#[tokio::test(start_paused = true)]
async fn ready_waits_for_the_last_notification() {
    let notifications = Notifications::detached(NotifyConfig::default());
    let pending = notifications.register("r", 2).expect("register");
    notifications.notify("r");
    let early = tokio::time::timeout(Duration::from_millis(50), pending.ready()).await;
    assert!(early.is_err(), "ready after 1 of 2: {early:?}");
    notifications.notify("r");
    // Called again after a timeout, and after the fact: returns at once.
    tokio::time::timeout(Duration::from_millis(1), pending.ready())
        .await
        .expect("ready at once")
        .expect("ready");
    pending.ready().await.expect("ready again");
}

#[tokio::test(start_paused = true)]
async fn ready_wakes_a_waiter_already_waiting() {
    let notifications = Notifications::detached(NotifyConfig::default());
    let pending = notifications.register("r", 1).expect("register");
    let waiter = tokio::spawn(async move { pending.ready().await });
    tokio::task::yield_now().await;
    assert!(!waiter.is_finished());
    notifications.notify("r");
    assert_eq!(waiter.await.expect("join"), Ok(()));
}

#[tokio::test(start_paused = true)]
async fn ttl_evicts_and_wakes_the_waiter() {
    let notifications = Notifications::detached(config(Duration::from_secs(10), 16));
    let pending = notifications.register("r", 2).expect("register");
    notifications.notify("r");
    let started = Instant::now();
    let outcome = pending.ready().await;
    assert_eq!(outcome, Err(WaitError::Evicted));
    let waited = started.elapsed();
    // The sweeper runs every second: evicted between 10 and 11 s.
    assert!(
        waited >= Duration::from_secs(10) && waited <= Duration::from_secs(11),
        "{waited:?}"
    );
    assert_eq!(notifications.pending_len(), 0);
    assert_eq!(notifications.stats().evicted, 1);
    // The id is free again, and late notifications for it are unknown.
    notifications.notify("r");
    assert_eq!(notifications.stats().unknown, 1);
    assert_eq!(pending.ready().await, Err(WaitError::Evicted));
}

#[tokio::test(start_paused = true)]
async fn extreme_sweep_intervals_are_clamped() {
    // Zero would panic `tokio::time::interval`, `Duration::MAX` would overflow its next
    // deadline: either way the sweeper would die and the waiter never hear of its
    // eviction. Also a TTL too long to add to an instant: never expires.
    for (sweep_interval, evicted_within) in [
        (Duration::ZERO, Duration::from_secs(11)),
        (Duration::MAX, Duration::from_secs(2 * 24 * 60 * 60)),
    ] {
        let notifications = Notifications::detached(NotifyConfig {
            ttl: Duration::from_secs(10),
            sweep_interval,
            max_pending: 16,
            ..NotifyConfig::default()
        });
        let pending = notifications.register("r", 1).expect("register");
        let outcome = tokio::time::timeout(evicted_within, pending.ready()).await;
        assert_eq!(outcome, Ok(Err(WaitError::Evicted)), "{sweep_interval:?}");
    }
    let notifications = Notifications::detached(NotifyConfig {
        ttl: Duration::MAX,
        sweep_interval: Duration::from_secs(60 * 60),
        max_pending: 16,
        ..NotifyConfig::default()
    });
    let pending = notifications.register("r", 1).expect("register");
    tokio::time::sleep(Duration::from_secs(30 * 24 * 60 * 60)).await;
    assert_eq!(notifications.pending_len(), 1);
    notifications.notify("r");
    assert_eq!(pending.ready().await, Ok(()));
}

#[tokio::test(start_paused = true)]
async fn a_completed_registration_stays_ready_when_evicted() {
    let notifications = Notifications::detached(config(Duration::from_secs(5), 16));
    let pending = notifications.register("r", 1).expect("register");
    notifications.notify("r");
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert_eq!(notifications.pending_len(), 0);
    assert_eq!(notifications.stats().evicted, 1);
    assert_eq!(pending.ready().await, Ok(()));
}

#[tokio::test(start_paused = true)]
async fn a_stale_pending_does_not_remove_its_successor() {
    let notifications = Notifications::detached(config(Duration::from_secs(5), 16));
    let stale = notifications.register("r", 1).expect("first");
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(stale.ready().await, Err(WaitError::Evicted));
    let fresh = notifications.register("r", 1).expect("second");
    drop(stale);
    assert_eq!(notifications.pending_len(), 1);
    notifications.notify("r");
    assert_eq!(fresh.ready().await, Ok(()));
}

#[test]
fn register_evicts_expired_entries_without_a_runtime() {
    // Outside a runtime there is no sweeper: `register` reclaims the room itself.
    let notifications = Notifications::detached(config(Duration::ZERO, 1));
    let first = notifications.register("a", 1).expect("a");
    let second = notifications.register("b", 1).expect("b, a expired");
    assert_eq!(notifications.pending_len(), 1);
    assert_eq!(notifications.stats().evicted, 1);
    assert_eq!(first.status.borrow().state, State::Evicted);
    drop(second);
    assert_eq!(notifications.pending_len(), 0);
}

#[tokio::test]
async fn dropping_the_last_handle_closes_waiters() {
    let notifications = Notifications::detached(NotifyConfig::default());
    let pending = notifications.register("r", 1).expect("register");
    let clone = notifications.clone();
    drop(notifications);
    clone.notify("nobody");
    drop(clone);
    assert_eq!(pending.ready().await, Err(WaitError::Closed));
    // Dropping it after the registry is gone is harmless.
    drop(pending);
}

#[test]
fn listen_address_forms() {
    assert_eq!(
        listen_address("127.0.0.1:7500").expect("plain"),
        "127.0.0.1:7500"
    );
    assert_eq!(
        listen_address("tcp://10.0.0.1:0").expect("tcp"),
        "10.0.0.1:0"
    );
    assert_eq!(
        listen_address("tcp://*:7500").expect("star"),
        "0.0.0.0:7500"
    );
    assert!(matches!(
        listen_address("ipc:///tmp/x"),
        Err(NotifyError::InvalidAddress { .. })
    ));
    assert!(matches!(
        listen_address("tcp://"),
        Err(NotifyError::InvalidAddress { .. })
    ));
}
