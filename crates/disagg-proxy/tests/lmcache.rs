//! `disagg-proxy serve --connector lmcache`: the real binary binds its notification
//! socket, learns each decode's receiver from `--lmcache-receiver`, and serves chat
//! through simulated LMCache engines (decode TP 2) in this process, a request still
//! waiting for its notifications at SIGTERM included.

#![allow(missing_docs)] // a test binary

use std::process::{Command, Stdio};
use std::time::Duration;

use disagg_sim::{KvMode, LmcacheReceiver, SimConfig, SimEngine, SimRole};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

mod common;
use common::{Proxy, eventually, free_addr, post};

/// POST a chat request over a fresh connection and read the raw answer to its end.
async fn chat(proxy: &Proxy, stream: bool) -> String {
    let body = serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "what does the cli do"}],
        "max_tokens": 6,
        "stream": stream,
    })
    .to_string();
    let mut sock = TcpStream::connect(proxy.addr).await.expect("connect");
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    sock.write_all(head.as_bytes()).await.unwrap();
    sock.write_all(body.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), sock.read_to_end(&mut raw))
        .await
        .expect("answer in time")
        .expect("read");
    String::from_utf8_lossy(&raw).into_owned()
}

#[tokio::test]
async fn serve_with_the_lmcache_connector() {
    let notify = free_addr();
    let decode = SimEngine::start(SimConfig {
        kv_mode: KvMode::Lmcache(SimRole::Decode),
        lmcache_receiver: LmcacheReceiver::ephemeral(2),
        ..SimConfig::default()
    })
    .await
    .expect("decode sim");
    let prefill = SimEngine::start(SimConfig {
        kv_mode: KvMode::Lmcache(SimRole::Prefill),
        lmcache_proxy: Some(notify.to_string()),
        ..SimConfig::default()
    })
    .await
    .expect("prefill sim");
    let join = |p: Vec<u16>| p.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
    let receiver = format!(
        "{}=127.0.0.1:{}:{}",
        decode.url(),
        join(decode.lmcache_init_ports()),
        join(decode.lmcache_alloc_ports())
    );
    let notify = notify.to_string();
    let proxy = Proxy::start(
        &prefill,
        &decode,
        &[
            "--connector",
            "lmcache",
            "--lmcache-notify",
            &notify,
            "--lmcache-receiver",
            &receiver,
        ],
    )
    .await;

    let answer = chat(&proxy, false).await;
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "{answer}\n{}",
        proxy.log()
    );
    assert!(answer.contains("x-disagg-handoff: kv"), "{answer}");
    assert!(
        answer.contains("\"object\":\"chat.completion\""),
        "{answer}"
    );
    let answer = chat(&proxy, true).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("chat.completion.chunk"), "{answer}");
    assert!(answer.contains("data: [DONE]"), "{answer}");
    // Both answers came from KV the prefill pushed and notified: the decode took it
    // twice and computed no prompt itself.
    let d = decode.stats();
    assert_eq!(
        (d.remote_decodes, d.local_prefills, d.kv_missing),
        (2, 0, 0),
        "{d:?}"
    );
    assert_eq!(
        prefill.stats().notifications_sent,
        4,
        "2 requests × 2 ranks"
    );
}

/// Makes [`two_test_processes_never_draw_the_same_port`] a drawing child.
const DRAWING_CHILD: &str = "DISAGG_TEST_DRAWING_CHILD";

/// The ports each child draws: over 10,000 ports, two processes drawing this many
/// each, independently, share one with a probability of 1 - e^-9.
const DRAWS: usize = 300;

/// `--lmcache-notify` takes a port the test draws before the proxy starts (the
/// prefill engines are told it first): two test processes running at once
/// (cargo-nextest runs each test in a process of its own, `cargo test` each binary)
/// never draw the same one while the first is alive.
#[test]
fn two_test_processes_never_draw_the_same_port() {
    use std::io::{BufRead, BufReader, Read};
    if std::env::var_os(DRAWING_CHILD).is_some() {
        let ports: Vec<String> = (0..DRAWS).map(|_| free_addr().port().to_string()).collect();
        println!("drawn: {}", ports.join(","));
        // Alive, as a test using its ports is, until the parent closes stdin.
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        return;
    }
    let draw = || {
        let mut child = Command::new(std::env::current_exe().expect("this test binary"))
            .args([
                "--exact",
                "two_test_processes_never_draw_the_same_port",
                "--nocapture",
            ])
            .env(DRAWING_CHILD, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("run this test binary");
        let mut out = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut line = String::new();
        let ports: std::collections::BTreeSet<u16> = loop {
            line.clear();
            let n = out.read_line(&mut line).expect("the child's output");
            assert!(n > 0, "the child ended before drawing");
            if let Some(p) = line.trim_end().strip_prefix("drawn: ") {
                break p.split(',').map(|n| n.parse().expect("a port")).collect();
            }
        };
        assert_eq!(ports.len(), DRAWS, "one process draws a port once");
        (child, out, ports)
    };
    let (mut first, first_out, a) = draw();
    let (mut second, second_out, b) = draw();
    for (child, mut out) in [(&mut first, first_out), (&mut second, second_out)] {
        drop(child.stdin.take());
        let _ = out.read_to_end(&mut Vec::new());
        assert!(child.wait().expect("the child ends").success());
    }
    let both: Vec<&u16> = a.intersection(&b).collect();
    assert!(both.is_empty(), "both processes drew {both:?}");
}

#[test]
fn a_decode_without_a_receiver_is_refused_at_start() {
    let out = Command::new(env!("CARGO_BIN_EXE_disagg-proxy"))
        .args([
            "serve",
            "--connector",
            "lmcache",
            "--lmcache-notify",
            "127.0.0.1:0",
            "--prefill",
            "http://127.0.0.1:1",
            "--decode",
            "http://127.0.0.1:2",
            "--listen",
            "127.0.0.1:0",
        ])
        .stdin(Stdio::null())
        .output()
        .expect("run disagg-proxy");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--lmcache-receiver http://127.0.0.1:2="),
        "{err}"
    );
}

/// Run `serve --connector lmcache` with `args` after the engines, expecting it to stop
/// at start-up; its stderr.
fn refused_at_start(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_disagg-proxy"))
        .args([
            "serve",
            "--connector",
            "lmcache",
            "--lmcache-notify",
            "127.0.0.1:0",
            "--listen",
            "127.0.0.1:0",
        ])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run disagg-proxy");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "started: {err}");
    err
}

/// `--encode` with LMCache is refused at start: its legs are token-id completions, so
/// the encoders' output would reach no engine (a chat with media is refused per
/// request instead, 400).
#[test]
fn encoders_with_lmcache_are_refused_at_start() {
    let err = refused_at_start(&[
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
        "http://127.0.0.1:2",
        "--lmcache-receiver",
        "http://127.0.0.1:2=127.0.0.1:7300:7400",
        "--encode",
        "http://127.0.0.1:3",
    ]);
    assert!(
        err.contains("--encode is not read with --connector lmcache"),
        "{err}"
    );
}

#[test]
fn an_lmcache_pair_of_unequal_tp_is_refused_at_start() {
    // The decode's two receiver ports make it TP 2, though it declares no profile.
    let err = refused_at_start(&[
        "--prefill",
        "http://127.0.0.1:1",
        "--prefill",
        "http://127.0.0.1:3",
        "--prefill",
        "http://127.0.0.1:4",
        "--decode",
        "http://127.0.0.1:2",
        "--lmcache-receiver",
        "http://127.0.0.1:2=127.0.0.1:7300,7301:7400,7401",
        "--kv-profile",
        "http://127.0.0.1:1=LMCacheConnectorV1,kv_producer,1",
        "--kv-profile",
        "http://127.0.0.1:3=,,4",
        "--kv-profile",
        "http://127.0.0.1:4=LMCacheConnectorV1,kv_producer,2",
    ]);
    // Fewer prefill ranks than receiver ports, and more: both pairs named with both
    // sizes; the prefill of TP 2 is not.
    assert!(err.contains("2 prefill/decode pair(s) refused"), "{err}");
    assert!(
        err.contains(
            "prefill endpoint http://127.0.0.1:1 and decode endpoint http://127.0.0.1:2 cannot be paired: connector `lmcache` cannot hand KV from tensor-parallel size 1 to 2"
        ),
        "{err}"
    );
    assert!(
        err.contains(
            "prefill endpoint http://127.0.0.1:3 and decode endpoint http://127.0.0.1:2 cannot be paired: connector `lmcache` cannot hand KV from tensor-parallel size 4 to 2"
        ),
        "{err}"
    );
    assert!(!err.contains("http://127.0.0.1:4 and"), "{err}");
}

#[test]
fn a_decode_whose_profile_disagrees_with_its_receiver_is_refused_at_start() {
    let err = refused_at_start(&[
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
        "http://127.0.0.1:2",
        "--lmcache-receiver",
        "http://127.0.0.1:2=127.0.0.1:7300,7301:7400,7401",
        "--kv-profile",
        "http://127.0.0.1:2=,kv_consumer,4",
    ]);
    assert!(
        err.contains("disagree on http://127.0.0.1:2")
            && err.contains("declares tensor-parallel size 4")
            && err.contains("has 2 port(s)"),
        "{err}"
    );
}

/// GET /metrics over a fresh connection: the body.
async fn scrape(proxy: &Proxy) -> String {
    let mut sock = TcpStream::connect(proxy.addr).await.expect("connect");
    sock.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), sock.read_to_end(&mut raw))
        .await
        .expect("metrics in time")
        .expect("read");
    let raw = String::from_utf8(raw).expect("utf-8");
    assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
    let (_, body) = raw.split_once("\r\n\r\n").expect("a body");
    body.to_owned()
}

/// The value of the sample `series` (name and labels, as written) in `text`.
fn sample(text: &str, series: &str) -> u64 {
    let values: Vec<u64> = text
        .lines()
        .filter_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.parse().expect("an integer sample"))
        .collect();
    assert_eq!(values.len(), 1, "one `{series}` sample in:\n{text}");
    values[0]
}

const MATCHED: &str = r#"disagg_lmcache_notifications_total{outcome="matched"}"#;

#[tokio::test]
async fn lmcache_notification_counters_are_in_metrics() {
    const TP: usize = 2;
    const REQUESTS: u64 = 3;
    let notify = free_addr();
    let decode = SimEngine::start(SimConfig {
        kv_mode: KvMode::Lmcache(SimRole::Decode),
        lmcache_receiver: LmcacheReceiver::ephemeral(TP),
        ..SimConfig::default()
    })
    .await
    .expect("decode sim");
    let prefill = SimEngine::start(SimConfig {
        kv_mode: KvMode::Lmcache(SimRole::Prefill),
        lmcache_proxy: Some(notify.to_string()),
        ..SimConfig::default()
    })
    .await
    .expect("prefill sim");
    let join = |p: Vec<u16>| p.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
    let receiver = format!(
        "{}=127.0.0.1:{}:{}",
        decode.url(),
        join(decode.lmcache_init_ports()),
        join(decode.lmcache_alloc_ports())
    );
    // Both engines declare their TP, equal to the decode's port count: accepted.
    let prefill_profile = format!("{}=LMCacheConnectorV1,kv_producer,{TP}", prefill.url());
    let decode_profile = format!("{}=LMCacheConnectorV1,kv_consumer,{TP}", decode.url());
    let notify = notify.to_string();
    let proxy = Proxy::start(
        &prefill,
        &decode,
        &[
            "--connector",
            "lmcache",
            "--lmcache-notify",
            &notify,
            "--lmcache-receiver",
            &receiver,
            "--kv-profile",
            &prefill_profile,
            "--kv-profile",
            &decode_profile,
        ],
    )
    .await;

    let before = scrape(&proxy).await;
    assert_eq!(sample(&before, MATCHED), 0, "{before}");
    assert!(
        before.contains("# TYPE disagg_lmcache_notifications_total counter\n")
            && before.contains("# TYPE disagg_lmcache_registrations_pending gauge\n"),
        "{before}"
    );
    for i in 0..REQUESTS {
        let answer = chat(&proxy, i % 2 == 1).await;
        assert!(
            answer.starts_with("HTTP/1.1 200") && answer.contains("x-disagg-handoff: kv"),
            "{answer}\n{}",
            proxy.log()
        );
    }
    // Each answer waited for one notification per decode rank before its decode leg.
    let after = scrape(&proxy).await;
    assert_eq!(sample(&after, MATCHED), REQUESTS * TP as u64, "{after}");
    assert_eq!(
        sample(&after, "disagg_lmcache_registrations_completed_total"),
        REQUESTS,
        "{after}"
    );
    for outcome in ["unknown", "extra", "malformed"] {
        let series = format!(r#"disagg_lmcache_notifications_total{{outcome="{outcome}"}}"#);
        assert_eq!(sample(&after, &series), 0, "{after}");
    }
    assert_eq!(
        sample(&after, "disagg_lmcache_registrations_evicted_total"),
        0
    );
    assert_eq!(
        prefill.stats().notifications_sent,
        REQUESTS * TP as u64,
        "the engines sent what the proxy counted"
    );
    // A registration lives as long as its request: none is left once the answers
    // ended (a stream's may be released a moment after its last byte).
    let start = std::time::Instant::now();
    loop {
        let now = scrape(&proxy).await;
        if sample(&now, "disagg_lmcache_registrations_pending") == 0 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "{now}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The orchestrator's own metrics are still there, before the LMCache ones.
    let core = after
        .find("\ndisagg_requests_total{route=\"orchestrated\"} ")
        .expect("core metrics");
    assert!(core < after.find(MATCHED).unwrap(), "{after}");
}

/// A request still waiting for its KV-ready notifications when the proxy is told to
/// stop is served whole within `--drain-timeout`: the notification socket keeps
/// running until the serving threads are done, not only until the stop signal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waiting_for_notifications_at_sigterm_completes() {
    const TOKENS: u32 = 6;
    let notify = free_addr();
    let decode = SimEngine::start(SimConfig {
        kv_mode: KvMode::Lmcache(SimRole::Decode),
        lmcache_receiver: LmcacheReceiver::ephemeral(2),
        ..SimConfig::default()
    })
    .await
    .expect("decode sim");
    // The prefill answers at once and notifies 1.5 s later: the decode leg waits.
    let faults = disagg_sim::Faults {
        notify_delay: Duration::from_millis(1500),
        ..disagg_sim::Faults::default()
    };
    let prefill = SimEngine::start(SimConfig {
        kv_mode: KvMode::Lmcache(SimRole::Prefill),
        lmcache_proxy: Some(notify.to_string()),
        faults,
        ..SimConfig::default()
    })
    .await
    .expect("prefill sim");
    let join = |p: Vec<u16>| p.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
    let receiver = format!(
        "{}=127.0.0.1:{}:{}",
        decode.url(),
        join(decode.lmcache_init_ports()),
        join(decode.lmcache_alloc_ports())
    );
    let notify = notify.to_string();
    let mut proxy = Proxy::start(
        &prefill,
        &decode,
        &[
            "--connector",
            "lmcache",
            "--lmcache-notify",
            &notify,
            "--lmcache-receiver",
            &receiver,
            "--handoff-timeout",
            "5",
            "--drain-timeout",
            "10",
        ],
    )
    .await;
    let body = serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "drain while the KV is on its way"}],
        "max_tokens": TOKENS,
    })
    .to_string();
    let url = proxy.url();
    let request = tokio::spawn(async move { post(&url, "/v1/chat/completions", &body).await });
    // Stop once the prefill answered: the decode leg now waits for the notifications.
    assert!(
        eventually(Duration::from_secs(10), || prefill.stats().prefill_requests
            >= 1)
        .await,
        "the prefill leg never came: {}",
        proxy.log()
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    proxy.sigterm();
    let answer = request.await.expect("the request task");
    assert_eq!(answer.status, 200, "{}\n{}", answer.text(), proxy.log());
    assert_eq!(answer.header("x-disagg-handoff"), Some("kv"));
    let json = answer.json();
    assert_eq!(json["usage"]["completion_tokens"], TOKENS, "{json}");
    assert_eq!(json["choices"][0]["finish_reason"], "length", "{json}");
    // The decode took the pushed KV: the notifications reached the draining proxy.
    let d = decode.stats();
    assert_eq!((d.remote_decodes, d.local_prefills), (1, 0), "{d:?}");
    let status = proxy.exit_within(Duration::from_secs(15)).await;
    assert!(status.success(), "{status}: {}", proxy.log());
}
