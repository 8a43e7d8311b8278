//! The LMCache notification listener over real loopback ZMQ sockets: PUSH peers as the
//! prefill ranks, the listener's PULL socket as the proxy.

use std::future::Future;
use std::time::Duration;

use disagg_connectors::lmcache::{
    Notifications, NotifyConfig, NotifyError, NotifyStats, WaitError,
};
use tokio::io::AsyncWriteExt;
use tokio::time::{Instant, timeout};
use zeromq::{PushSocket, Socket, SocketSend, ZmqMessage};

/// Longest wait for something that should happen promptly on loopback.
const PATIENCE: Duration = Duration::from_secs(20);

#[derive(serde::Serialize)]
struct Notif<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    req_id: &'a str,
}

/// A msgpack map, as msgspec writes a tagged struct.
fn notif(kind: &str, req_id: &str) -> Vec<u8> {
    rmp_serde::to_vec_named(&Notif { kind, req_id }).expect("encode")
}

async fn listen(config: NotifyConfig) -> (Notifications, String) {
    let notifications = Notifications::bind("127.0.0.1:0", config)
        .await
        .expect("bind");
    let addr = notifications.local_addr().expect("bound address");
    assert_eq!(addr.ip().to_string(), "127.0.0.1");
    assert_ne!(addr.port(), 0);
    (notifications, format!("tcp://{addr}"))
}

async fn peer(endpoint: &str) -> PushSocket {
    let mut push = PushSocket::new();
    timeout(PATIENCE, push.connect(endpoint))
        .await
        .expect("connect in time")
        .expect("connect");
    push
}

async fn send(push: &mut PushSocket, bytes: Vec<u8>) {
    timeout(PATIENCE, push.send(ZmqMessage::from(bytes)))
        .await
        .expect("send in time")
        .expect("send");
}

async fn send_frames(push: &mut PushSocket, frames: Vec<Vec<u8>>) {
    let frames: Vec<bytes::Bytes> = frames.into_iter().map(bytes::Bytes::from).collect();
    let message = ZmqMessage::try_from(frames).expect("non-empty message");
    timeout(PATIENCE, push.send(message))
        .await
        .expect("send in time")
        .expect("send");
}

/// Waits until the listener has taken in and accounted for `received` messages. A message
/// is counted in `received` first and in its outcome counter a moment later, so the wait
/// is on the outcome counters.
async fn received(notifications: &Notifications, received: u64) -> NotifyStats {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let stats = notifications.stats();
        let accounted = stats.matched + stats.unknown + stats.extra + stats.malformed;
        if accounted >= received {
            assert_eq!(accounted, received, "more messages than sent: {stats:?}");
            assert_eq!(stats.received, received, "{stats:?}");
            return stats;
        }
        assert!(
            Instant::now() < deadline,
            "only {accounted} of {received} messages arrived: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn settles<F: Future>(future: F) -> F::Output {
    timeout(PATIENCE, future).await.expect("in time")
}

fn assert_consistent(stats: NotifyStats) {
    assert_eq!(
        stats.received,
        stats.matched + stats.unknown + stats.extra + stats.malformed,
        "{stats:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completes_after_exactly_n_notifications_from_two_peers() {
    let (notifications, endpoint) = listen(NotifyConfig::default()).await;
    let mut rank0 = peer(&endpoint).await;
    let mut rank1 = peer(&endpoint).await;
    let pending = notifications.register("req-1", 4).expect("register");

    send(&mut rank0, notif("ProxyNotif", "req-1")).await;
    send(&mut rank1, notif("ProxyNotif", "req-1")).await;
    send(&mut rank0, notif("ProxyNotif", "req-1")).await;
    received(&notifications, 3).await;
    assert_eq!(pending.received(), 3);
    assert!(
        timeout(Duration::from_millis(100), pending.ready())
            .await
            .is_err(),
        "ready after 3 of 4 notifications"
    );

    send(&mut rank1, notif("ProxyNotif", "req-1")).await;
    assert_eq!(settles(pending.ready()).await, Ok(()));
    assert_eq!(pending.received(), 4);
    let stats = notifications.stats();
    assert_eq!((stats.matched, stats.completed), (4, 1));
    assert_consistent(stats);
}

#[tokio::test]
async fn a_notification_before_the_wait_is_kept() {
    let (notifications, endpoint) = listen(NotifyConfig::default()).await;
    let mut rank0 = peer(&endpoint).await;
    let pending = notifications.register("early", 1).expect("register");
    send(&mut rank0, notif("ProxyNotif", "early")).await;
    received(&notifications, 1).await;
    // Nobody was waiting when it arrived; the wait that starts now returns at once.
    timeout(Duration::from_millis(50), pending.ready())
        .await
        .expect("ready at once")
        .expect("ready");
}

#[tokio::test]
async fn unknown_ids_and_extras_are_counted_and_ignored() {
    let (notifications, endpoint) = listen(NotifyConfig::default()).await;
    let mut rank0 = peer(&endpoint).await;
    let pending = notifications.register("known", 1).expect("register");
    for id in ["ghost-1", "known", "ghost-2", "known", "known"] {
        send(&mut rank0, notif("ProxyNotif", id)).await;
    }
    let stats = received(&notifications, 5).await;
    assert_eq!(
        stats,
        NotifyStats {
            received: 5,
            matched: 1,
            completed: 1,
            unknown: 2,
            extra: 2,
            malformed: 0,
            evicted: 0,
        }
    );
    assert_eq!(pending.received(), 1);
    // The unknown ids left nothing behind.
    assert_eq!(notifications.pending_len(), 1);
    assert_eq!(settles(pending.ready()).await, Ok(()));
}

#[tokio::test]
async fn the_older_nixl_proxy_notif_tag_is_accepted() {
    let (notifications, endpoint) = listen(NotifyConfig::default()).await;
    let mut rank0 = peer(&endpoint).await;
    let pending = notifications.register("v3", 2).expect("register");
    send(&mut rank0, notif("NixlProxyNotif", "v3")).await;
    send(&mut rank0, notif("ProxyNotif", "v3")).await;
    assert_eq!(settles(pending.ready()).await, Ok(()));
    assert_eq!(notifications.stats().malformed, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_are_counted_and_the_listener_keeps_working() {
    let (notifications, endpoint) = listen(NotifyConfig::default()).await;
    let pending = notifications.register("after", 2).expect("register");

    // A TCP client that is not ZMQ at all.
    let addr = notifications.local_addr().expect("address");
    let mut junk = tokio::net::TcpStream::connect(addr).await.expect("connect");
    junk.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n\xff\x00\xff")
        .await
        .expect("write junk");

    let mut rank0 = peer(&endpoint).await;
    send(&mut rank0, b"\xc1 not msgpack".to_vec()).await;
    send(&mut rank0, notif("ProxyAck", "after")).await;
    // Only the first frame counts: a junk first frame is malformed even with a valid
    // second one, and a valid first frame counts whatever follows.
    send_frames(
        &mut rank0,
        vec![b"junk".to_vec(), notif("ProxyNotif", "after")],
    )
    .await;
    send_frames(
        &mut rank0,
        vec![notif("ProxyNotif", "after"), b"junk".to_vec()],
    )
    .await;
    let stats = received(&notifications, 4).await;
    assert_eq!((stats.malformed, stats.matched), (3, 1), "{stats:?}");
    assert_eq!(pending.received(), 1);

    drop(junk);
    let mut rank1 = peer(&endpoint).await;
    send(&mut rank1, notif("ProxyNotif", "after")).await;
    assert_eq!(settles(pending.ready()).await, Ok(()));
    assert_consistent(notifications.stats());
}

#[tokio::test]
async fn dropping_pending_empties_the_map() {
    let (notifications, endpoint) = listen(NotifyConfig::default()).await;
    let mut rank0 = peer(&endpoint).await;
    let done = notifications.register("done", 1).expect("register");
    let waiting = notifications.register("waiting", 2).expect("register");
    send(&mut rank0, notif("ProxyNotif", "done")).await;
    send(&mut rank0, notif("ProxyNotif", "waiting")).await;
    assert_eq!(settles(done.ready()).await, Ok(()));
    received(&notifications, 2).await;
    assert_eq!(notifications.pending_len(), 2);

    drop(done);
    drop(waiting);
    assert_eq!(notifications.pending_len(), 0);
    // Late notifications for them are now unknown, and stored nowhere.
    send(&mut rank0, notif("ProxyNotif", "waiting")).await;
    let stats = received(&notifications, 3).await;
    assert_eq!(stats.unknown, 1);
    assert_eq!(notifications.pending_len(), 0);
}

#[tokio::test]
async fn ttl_eviction_wakes_the_waiter() {
    let ttl = Duration::from_millis(300);
    let config = NotifyConfig {
        ttl,
        sweep_interval: Duration::from_millis(20),
        ..NotifyConfig::default()
    };
    let (notifications, endpoint) = listen(config).await;
    let mut rank0 = peer(&endpoint).await;
    let started = Instant::now();
    let pending = notifications.register("forgotten", 2).expect("register");
    send(&mut rank0, notif("ProxyNotif", "forgotten")).await;

    assert_eq!(settles(pending.ready()).await, Err(WaitError::Evicted));
    assert!(
        started.elapsed() >= ttl,
        "evicted after {:?}",
        started.elapsed()
    );
    assert_eq!(notifications.pending_len(), 0);
    assert_eq!(notifications.stats().evicted, 1);
    // Calling again gives the same answer.
    assert_eq!(pending.ready().await, Err(WaitError::Evicted));
}

#[tokio::test]
async fn live_ids_and_the_pending_limit_are_enforced() {
    let config = NotifyConfig {
        max_pending: 3,
        ..NotifyConfig::default()
    };
    let (notifications, endpoint) = listen(config).await;
    let a = notifications.register("a", 1).expect("a");
    assert!(matches!(
        notifications.register("a", 1),
        Err(NotifyError::Duplicate { req_id }) if req_id == "a"
    ));
    let _b = notifications.register("b", 1).expect("b");
    let _c = notifications.register("c", 1).expect("c");
    assert!(matches!(
        notifications.register("d", 1),
        Err(NotifyError::Full { max_pending: 3 })
    ));
    // A completed registration still holds its room until it is dropped.
    let mut rank0 = peer(&endpoint).await;
    send(&mut rank0, notif("ProxyNotif", "a")).await;
    assert_eq!(settles(a.ready()).await, Ok(()));
    assert!(matches!(
        notifications.register("d", 1),
        Err(NotifyError::Full { .. })
    ));
    drop(a);
    let _d = notifications.register("d", 1).expect("d after a dropped");
    assert_eq!(notifications.pending_len(), 3);
}

#[tokio::test]
async fn dropping_the_last_handle_closes_waiters_and_the_socket() {
    let (notifications, _endpoint) = listen(NotifyConfig::default()).await;
    let addr = notifications.local_addr().expect("address");
    let pending = notifications.register("r", 1).expect("register");
    let clone = notifications.clone();
    drop(notifications);
    assert!(
        timeout(Duration::from_millis(50), pending.ready())
            .await
            .is_err(),
        "a clone still holds the registry"
    );
    drop(clone);
    assert_eq!(settles(pending.ready()).await, Err(WaitError::Closed));

    // The socket task ended and closed the listener: its port can be bound again.
    let deadline = Instant::now() + PATIENCE;
    let rebound = loop {
        match Notifications::bind(&format!("tcp://{addr}"), NotifyConfig::default()).await {
            Ok(rebound) => break rebound,
            Err(NotifyError::Bind { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(error) => panic!("port {addr} never released: {error}"),
        }
    };
    assert_eq!(rebound.local_addr(), Some(addr));
}

/// splitmix64: a seeded, dependency-free generator for the loss pattern.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_registrations_with_random_loss() {
    const REQUESTS: usize = 10_000;
    const PEERS: usize = 4;
    let (notifications, endpoint) = listen(NotifyConfig::default()).await;
    let mut peers = Vec::new();
    for _ in 0..PEERS {
        peers.push(peer(&endpoint).await);
    }

    // Each request expects 1..=4 notifications (decode TP ranks), one per prefill rank,
    // each lost with probability 1/32.
    let mut rng = SplitMix(0x5EED_2026);
    let mut plan = Vec::with_capacity(REQUESTS);
    for i in 0..REQUESTS {
        let expected = 1 + (rng.next() % 4) as usize;
        let delivered: Vec<bool> = (0..expected)
            .map(|_| !rng.next().is_multiple_of(32))
            .collect();
        plan.push((format!("req-{i}"), expected, delivered));
    }
    let lost = plan
        .iter()
        .filter(|(_, _, delivered)| delivered.contains(&false))
        .count();
    assert!(lost > 100 && lost < REQUESTS / 2, "loss pattern: {lost}");

    // Every waiter first waits briefly (most time out: nothing sent yet), then, once
    // everything sent has arrived, waits again: the re-called `ready` must see what
    // arrived in between.
    let (all_arrived, on_all_arrived) = tokio::sync::watch::channel(false);
    let mut waiters = Vec::with_capacity(REQUESTS);
    for (id, expected, _) in &plan {
        let pending = notifications.register(id, *expected).expect("register");
        let mut on_all_arrived = on_all_arrived.clone();
        waiters.push(tokio::spawn(async move {
            let early = timeout(Duration::from_millis(20), pending.ready()).await;
            if early.is_err() {
                on_all_arrived
                    .wait_for(|arrived| *arrived)
                    .await
                    .expect("sender alive");
            }
            let outcome = timeout(Duration::from_millis(300), pending.ready()).await;
            (pending, outcome)
        }));
    }
    assert_eq!(notifications.pending_len(), REQUESTS);

    let mut sent = 0u64;
    for (id, _, delivered) in &plan {
        for (rank, ok) in delivered.iter().enumerate() {
            if *ok {
                send(&mut peers[rank % PEERS], notif("ProxyNotif", id)).await;
                sent += 1;
            }
        }
    }
    let stats = received(&notifications, sent).await;
    all_arrived.send_replace(true);

    let mut pendings = Vec::with_capacity(REQUESTS);
    for ((id, expected, delivered), waiter) in plan.iter().zip(waiters) {
        let (pending, outcome) = settles(waiter).await.expect("waiter");
        let complete = !delivered.contains(&false);
        match outcome {
            Ok(result) => {
                assert!(complete, "{id} ready with a lost notification");
                assert_eq!(result, Ok(()));
            }
            Err(_) => assert!(!complete, "{id} timed out with all notifications"),
        }
        let arrived = delivered.iter().filter(|ok| **ok).count();
        assert_eq!(pending.received(), arrived, "{id}");
        assert_eq!(pending.expected(), *expected);
        pendings.push(pending);
    }

    assert_eq!(stats.matched, sent);
    assert_eq!(stats.completed, (REQUESTS - lost) as u64);
    assert_eq!(
        (stats.unknown, stats.extra, stats.malformed, stats.evicted),
        (0, 0, 0, 0)
    );
    assert_eq!(notifications.pending_len(), REQUESTS);
    drop(pendings);
    assert_eq!(notifications.pending_len(), 0);
}

/// A raw TCP peer that greets as a ZMTP 3 `PUSH` (NULL mechanism, READY).
async fn raw_push(endpoint: &str) -> tokio::net::TcpStream {
    let addr = endpoint.trim_start_matches("tcp://");
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut hello = vec![0u8; 64];
    hello[0] = 0xff;
    hello[9] = 0x7f;
    hello[10] = 3;
    hello[12..16].copy_from_slice(b"NULL");
    hello.extend_from_slice(b"\x04\x1a\x05READY\x0bSocket-Type\x00\x00\x00\x04PUSH");
    s.write_all(&hello).await.expect("greet");
    s
}

/// Reads until the listener closes the connection: whether it did.
async fn closed(s: &mut tokio::net::TcpStream) -> bool {
    use tokio::io::AsyncReadExt;
    let mut sink = [0u8; 256];
    loop {
        match timeout(PATIENCE, s.read(&mut sink)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
            Err(_) => return false,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_bomb_or_an_oversized_notification_disconnects_its_peer_only() {
    let (notifications, endpoint) = listen(NotifyConfig::default()).await;
    let pending = notifications.register("r", 1).expect("register");
    let mut honest = peer(&endpoint).await;

    // A frame header announcing 1 TiB: refused at the header.
    let mut bomber = raw_push(&endpoint).await;
    let mut bomb = vec![0x02];
    bomb.extend_from_slice(&(1u64 << 40).to_be_bytes());
    bomber.write_all(&bomb).await.expect("bomb");
    assert!(closed(&mut bomber).await, "the bomber stays connected");
    // A whole notification over the 64 KiB ceiling.
    let mut big = raw_push(&endpoint).await;
    let body = notif("ProxyNotif", &"x".repeat(100 * 1024));
    let mut frame = vec![0x02];
    frame.extend_from_slice(&(body.len() as u64).to_be_bytes());
    frame.extend_from_slice(&body);
    let _ = big.write_all(&frame).await;
    assert!(
        closed(&mut big).await,
        "the sender of 100 KiB stays connected"
    );

    let deadline = Instant::now() + PATIENCE;
    while notifications.socket_stats().expect("a socket").oversized < 2 {
        assert!(
            Instant::now() < deadline,
            "{:?}",
            notifications.socket_stats()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Nothing of them reached the registry; the honest peer still completes.
    assert_eq!(notifications.stats().received, 0);
    send(&mut honest, notif("ProxyNotif", "r")).await;
    settles(pending.ready()).await.expect("ready");
}
