//! Unit tests of `subscriber`.

use super::replay::{ReplayError, ReplayMessage, replay_message};
use super::*;
use bytes::Bytes;

#[test]
fn endpoint_specs() {
    let e = EngineEndpoint::parse("http://h:8000=tcp://h:5557").unwrap();
    assert_eq!(
        (e.publisher.as_str(), e.replay.as_deref(), e.dp_size),
        ("tcp://h:5557", None, 1)
    );
    assert!(EngineEndpoint::parse("http://h:8000").is_err());
    assert!(EngineEndpoint::parse("=tcp://h:1").is_err());
    assert!(EngineEndpoint::parse("e=tcp://h:x").is_err());
    assert!(EngineEndpoint::parse("e=tcp://h:1,replay=udp://h:2").is_err());
    assert!(EngineEndpoint::parse("e=tcp://h:1,bogus=1").is_err());
    assert_eq!(
        EngineEndpoint::parse("e=tcp://h:65535,dp-size=2"),
        Err(EndpointError::PortRange {
            port: 65535,
            dp_size: 2
        })
    );
    let e = EngineEndpoint::parse("e=tcp://h:7000,dp-size=3").unwrap();
    assert_eq!(e.publisher_of(2), "tcp://h:7002");
    assert_eq!(e.replay_of(2), None);
}

/// `--kv-events-endpoint` reads its addresses by the rule discovery's `kv_events` and
/// the connecting socket share: an engine's bind wildcard, port 0 or an unbracketed
/// IPv6 address is refused at start, not retried for ever.
#[test]
fn endpoint_specs_refuse_addresses_no_socket_reaches() {
    for spec in [
        "e=tcp://*:5557",
        "e=tcp://h:0",
        "e=tcp://h:+5557",
        "e=tcp://::1:5557",
        "e=tcp://h:1,replay=tcp://*:5558",
        "e=tcp://h:1,load=tcp://h:0",
    ] {
        assert!(
            matches!(EngineEndpoint::parse(spec), Err(EndpointError::Tcp(_))),
            "{spec}"
        );
    }
    let e = EngineEndpoint::parse("e=tcp://[fd00::7]:5557,replay=tcp://vllm_decode.:5558").unwrap();
    assert_eq!(e.publisher_of(1), "tcp://[fd00::7]:5558");
    assert_eq!(e.replay_of(1).as_deref(), Some("tcp://vllm_decode.:5559"));
}

#[test]
fn engine_host_form() {
    let e = EngineEndpoint::on_engine_host("http://user@10.1.2.3:8000/v1", 5557, None).unwrap();
    assert_eq!(e.publisher, "tcp://10.1.2.3:5557");
    assert_eq!(e.engine, "http://user@10.1.2.3:8000/v1");
    assert!(EngineEndpoint::on_engine_host("http://:8000", 1, None).is_err());
    let e = EngineEndpoint::on_engine_host("engine-0.svc", 5557, Some(5558)).unwrap();
    assert_eq!(e.replay.as_deref(), Some("tcp://engine-0.svc:5558"));
}

#[test]
fn backoff_doubles_from_the_connect_timeout_up_to_its_cap() {
    let config = SubscriberConfig {
        connect_timeout: Duration::from_millis(100),
        max_backoff: Duration::from_millis(1000),
        ..SubscriberConfig::default()
    };
    let pauses: Vec<u64> = (1..=6)
        .map(|n| config.backoff(n).as_millis() as u64)
        .collect();
    assert_eq!(pauses, [100, 200, 400, 800, 1000, 1000]);
    assert_eq!(config.backoff(u32::MAX), Duration::from_millis(1000));
}

#[tokio::test(start_paused = true)]
async fn a_panicking_task_is_restarted_with_backoff_and_counted() {
    let index = Arc::new(KvIndex::new(crate::IndexConfig::default()));
    let statuses: Statuses = Arc::default();
    lock(&statuses).insert(
        ("e".to_owned(), 0),
        RankStatus {
            engine: "e".into(),
            connected: true,
            ..RankStatus::default()
        },
    );
    let shared = Shared {
        index,
        config: Arc::new(SubscriberConfig {
            connect_timeout: Duration::from_secs(1),
            max_backoff: Duration::from_secs(4),
            ..SubscriberConfig::default()
        }),
        statuses: statuses.clone(),
        engine: "e".into(),
        rank: 0,
    };
    let runs = Arc::new(Mutex::new(Vec::new()));
    let seen = runs.clone();
    let started = tokio::time::Instant::now();
    supervise(shared, SocketKind::Events, move || {
        let seen = seen.clone();
        move || async move {
            let n = {
                let mut runs = lock(&seen);
                runs.push(started.elapsed().as_secs());
                runs.len()
            };
            if n <= 3 {
                panic!("run {n} panics");
            }
        }
    })
    .await;
    // Restarted after 1, 2 and 4 s.
    assert_eq!(*lock(&runs), [0, 1, 3, 7]);
    let status = lock(&statuses)[&("e".to_owned(), 0)].clone();
    assert_eq!(status.panics, 3);
    assert!(!status.connected);
}

#[test]
fn replay_answers_in_every_form_the_engines_send() {
    let b = |bytes: &[u8]| Bytes::copy_from_slice(bytes);
    let seq = 7u64.to_be_bytes();
    let end = END_SEQ.to_be_bytes();
    let batch = ReplayMessage::Batch {
        seq: 7,
        payload: b"p",
    };
    // vLLM's and SGLang's: [empty, seq, payload], ended by [empty, -1, empty].
    let three = [b(b""), b(&seq), b(b"p")];
    assert_eq!(replay_message(&three).unwrap(), batch);
    let three_end = [b(b""), b(&end), b(b"")];
    assert_eq!(replay_message(&three_end).unwrap(), ReplayMessage::End);
    // With the topic: [empty, topic, seq, payload], ended by [empty, topic, -1, empty].
    let four = [b(b""), b(b"kv"), b(&seq), b(b"p")];
    assert_eq!(replay_message(&four).unwrap(), batch);
    let four_end = [b(b""), b(b""), b(&end), b(b"")];
    assert_eq!(replay_message(&four_end).unwrap(), ReplayMessage::End);
    // Older vLLM's end: [empty, empty].
    assert_eq!(
        replay_message(&[b(b""), b(b"")]).unwrap(),
        ReplayMessage::End
    );
    // Anything else.
    for frames in [
        vec![],
        vec![b(b"")],
        vec![b(b""), b(b"x")],
        vec![b(b"id"), b(&seq), b(b"p")],
        vec![b(b"id"), b(b""), b(&seq), b(b"p")],
        vec![b(b""), b(&seq[..7]), b(b"p")],
        vec![b(b""), b(b""), b(b"1234"), b(b"p")],
        vec![b(b""), b(b""), b(b""), b(&seq), b(b"p")],
    ] {
        assert!(
            matches!(replay_message(&frames), Err(ReplayError::Malformed)),
            "{frames:?}"
        );
    }
}
