//! `disagg-proxy serve`'s policy and reliability flags, each shown to change what the real
//! binary does: `--missing-kv`, `--deadline`, `--retries`, `--max-in-flight` (with
//! `--max-queue`), `--kv-release`, `--eject-after`, `--admin-routes` and the active health checks
//! (`--health-check-interval`, `--health-check-timeout`, `--health-check-path`). The
//! proxy runs as a child process in front of simulated engines in this process; where a
//! flag's effect could also come from the defaults, the same scenario runs without the
//! flag as the control.

#![allow(missing_docs)] // a test binary

use std::time::{Duration, Instant};

use disagg_sim::{Faults, KvMode, SimConfig, SimEngine, SimRole};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod common;
use common::{Proxy, completion, eventually, held_dead_url, post};

const COMPLETIONS: &str = "/v1/completions";

async fn engine(config: SimConfig) -> SimEngine {
    SimEngine::start(config)
        .await
        .expect("start a simulated engine")
}

fn faulty(faults: Faults) -> SimConfig {
    SimConfig {
        faults,
        ..SimConfig::default()
    }
}

/// `--prefill URL` for each of `prefills`, `--decode URL`, then `extra`.
fn args(prefills: &[String], decode: &SimEngine, extra: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for p in prefills {
        out.extend(["--prefill".to_owned(), p.clone()]);
    }
    out.extend(["--decode".to_owned(), decode.url()]);
    out.extend(extra.iter().map(|a| (*a).to_owned()));
    out
}

// === --missing-kv ===

/// A prefill engine that answers `"kv_transfer_params": null` to a NIXL prefill leg:
/// a vLLM engine whose KV connector is not NIXL hands nothing back (here the simulator's
/// LMCache prefill, which serves a request without `disagg_spec` like a plain engine).
async fn prefill_without_handoff() -> SimEngine {
    engine(SimConfig {
        kv_mode: KvMode::Lmcache(SimRole::Prefill),
        ..SimConfig::default()
    })
    .await
}

#[tokio::test]
async fn missing_kv_defaults_to_a_local_prefill_on_the_decode() {
    let (p, d) = (
        prefill_without_handoff().await,
        engine(SimConfig::default()).await,
    );
    let proxy = Proxy::start(&p, &d, &[]).await;
    let expected = disagg_sim::generate("no handoff", 5, 0).concat();
    for stream in [false, true] {
        let a = post(
            &proxy.url(),
            COMPLETIONS,
            &completion("no handoff", 5, stream),
        )
        .await;
        assert_eq!(a.status, 200, "{}\n{}", a.text(), proxy.log());
        assert_eq!(a.header("x-disagg-handoff"), Some("none"));
        assert_eq!(a.content(), expected);
    }
    let ps = p.stats();
    assert_eq!((ps.requests, ps.kv_params_returned), (2, 0), "{ps:?}");
    let ds = d.stats();
    assert_eq!(
        (ds.requests, ds.local_prefills, ds.remote_decodes),
        (2, 2, 0),
        "the decode computed both prompts itself: {ds:?}"
    );
    assert!(
        proxy
            .log()
            .contains("prefill returned no KV handoff; decode computes the prompt itself"),
        "{}",
        proxy.log()
    );
}

#[tokio::test]
async fn missing_kv_fail_answers_502() {
    let (p, d) = (
        prefill_without_handoff().await,
        engine(SimConfig::default()).await,
    );
    let proxy = Proxy::start(&p, &d, &["--missing-kv", "fail"]).await;
    for stream in [false, true] {
        let a = post(
            &proxy.url(),
            COMPLETIONS,
            &completion("no handoff", 5, stream),
        )
        .await;
        a.assert_error(502, "prefill_failed");
    }
    assert_eq!(p.stats().requests, 2);
    assert_eq!(d.stats().requests, 0, "no decode leg was sent");
}

// === --deadline ===

#[tokio::test]
async fn deadline_cuts_a_slow_decode() {
    // 12 tokens 100 ms apart: a non-streamed answer takes about 1.1 s.
    let slow = SimConfig {
        inter_token_delay: Duration::from_millis(100),
        ..SimConfig::default()
    };
    let (p, d) = (engine(SimConfig::default()).await, engine(slow).await);
    let body = completion("slow decode", 12, false);

    let proxy = Proxy::start(&p, &d, &["--deadline", "0.4"]).await;
    let start = Instant::now();
    let a = post(&proxy.url(), COMPLETIONS, &body).await;
    let took = start.elapsed();
    a.assert_error(504, "deadline_exceeded");
    assert!(
        took >= Duration::from_millis(390) && took < Duration::from_millis(1000),
        "{took:?}"
    );
    assert!(
        eventually(Duration::from_secs(2), || d.stats().cancelled == 1).await,
        "the decode request was dropped at the deadline: {:?}",
        d.stats()
    );
    assert_eq!(proxy.metric("disagg_deadlines_exceeded_total").await, 1);
    drop(proxy);

    // The control: the same request without a deadline is answered in full.
    let proxy = Proxy::start(&p, &d, &[]).await;
    let a = post(&proxy.url(), COMPLETIONS, &body).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(
        a.content(),
        disagg_sim::generate("slow decode", 12, 0).concat()
    );
}

// === --retries ===

/// Four requests through a proxy whose prefills are a dead port and a live engine
/// (round robin, so the dead one is picked); the answers' statuses.
async fn four_requests_with_a_dead_prefill(extra: &[&str]) -> (Vec<u16>, SimEngine, Proxy) {
    let (dead, _held) = held_dead_url();
    let (p, d) = (
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
    );
    let proxy = Proxy::start_args(&args(&[dead, p.url()], &d, extra)).await;
    let mut statuses = Vec::new();
    for i in 0..4 {
        let a = post(
            &proxy.url(),
            COMPLETIONS,
            &completion(&format!("retry {i}"), 3, false),
        )
        .await;
        if a.status == 200 {
            assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
        } else {
            a.assert_error(502, "prefill_failed");
        }
        statuses.push(a.status.as_u16());
    }
    (statuses, p, proxy)
}

#[tokio::test]
async fn retries_move_a_refused_prefill_onto_a_live_one() {
    let (statuses, live, proxy) = four_requests_with_a_dead_prefill(&["--retries", "1"]).await;
    assert_eq!(statuses, [200; 4], "{}", proxy.log());
    assert_eq!(live.stats().prefill_requests, 4);
    assert!(proxy.metric("disagg_retries_total").await >= 1);

    // The control: without --retries the dead prefill's turns fail.
    let (statuses, live, proxy) = four_requests_with_a_dead_prefill(&[]).await;
    assert!(statuses.contains(&502), "{statuses:?}");
    assert_eq!(
        live.stats().prefill_requests as usize,
        statuses.iter().filter(|s| **s == 200).count()
    );
    assert_eq!(proxy.metric("disagg_retries_total").await, 0);
}

// === --max-in-flight, --max-queue ===

/// A proxy with `extra` flags over engines whose decode streams a token every 100 ms:
/// a 12-token stream holds its place for about 1.1 s. While it runs, a short request is
/// sent. Returns the short request's status and whether it was answered before the
/// stream ended.
async fn second_request_during_a_stream(extra: &[&str]) -> (u16, bool) {
    let slow = SimConfig {
        inter_token_delay: Duration::from_millis(100),
        ..SimConfig::default()
    };
    let (p, d) = (engine(SimConfig::default()).await, engine(slow).await);
    let proxy = Proxy::start(&p, &d, extra).await;
    let url = proxy.url();
    let stream = tokio::spawn(async move {
        let a = post(&url, COMPLETIONS, &completion("long stream", 12, true)).await;
        (a, Instant::now())
    });
    assert!(
        eventually(Duration::from_secs(5), || d.stats().active_requests == 1).await,
        "the stream reached the decode"
    );
    let short = post(&proxy.url(), COMPLETIONS, &completion("short", 2, false)).await;
    let answered = Instant::now();
    let (long, ended) = stream.await.expect("the stream's task");
    assert_eq!(long.status, 200);
    assert_eq!(long.events().last().map(String::as_str), Some("[DONE]"));
    if short.status != 200 {
        short.assert_error(429, "queue_full");
        assert_eq!(short.header("retry-after"), Some("1"));
    }
    (short.status.as_u16(), answered < ended)
}

#[tokio::test]
async fn max_in_flight_makes_a_second_request_wait_for_the_first() {
    let (status, before_end) = second_request_during_a_stream(&["--max-in-flight", "1"]).await;
    assert_eq!(status, 200);
    assert!(!before_end, "admitted while the only place was taken");
    // The control: without a limit it is served alongside the stream.
    let (status, before_end) = second_request_during_a_stream(&[]).await;
    assert_eq!(status, 200);
    assert!(
        before_end,
        "without a limit the short request did not overtake"
    );
}

#[tokio::test]
async fn max_in_flight_with_no_queue_refuses_a_second_request() {
    let (status, before_end) =
        second_request_during_a_stream(&["--max-in-flight", "1", "--max-queue", "0"]).await;
    assert_eq!(status, 429);
    assert!(before_end, "refused at once");
}

// === --kv-release ===

/// Send a request through a proxy (with `extra` flags) whose decode engine queues each
/// request for 300 ms and does not free the prefill's blocks when a request is aborted
/// (as older engines do), and hang up once the decode holds it.
async fn leave_while_the_decode_is_queued(extra: &[&str]) -> Leaving {
    let forgetful = SimConfig {
        request_delay: Duration::from_millis(300),
        release_on_abort: false,
        ..SimConfig::default()
    };
    let (p, d) = (engine(SimConfig::default()).await, engine(forgetful).await);
    let proxy = Proxy::start(&p, &d, extra).await;
    let body = completion("bye", 8, false);
    let mut sock = tokio::net::TcpStream::connect(proxy.addr)
        .await
        .expect("connect");
    let head = format!(
        "POST {COMPLETIONS} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(head.as_bytes()).await.expect("send");
    assert!(eventually(Duration::from_secs(5), || d.stats().active_requests == 1).await);
    assert_eq!(
        p.stats().blocks_held,
        1,
        "the prefill holds the prompt's KV"
    );
    drop(sock);
    Leaving {
        prefill: p,
        _decode: d,
        proxy,
    }
}

/// What [`leave_while_the_decode_is_queued`] leaves running.
struct Leaving {
    prefill: SimEngine,
    /// Kept alive: the release's decode leg goes to it.
    _decode: SimEngine,
    proxy: Proxy,
}

#[tokio::test]
async fn kv_release_abort_decode_frees_a_cancelled_requests_blocks() {
    let l = leave_while_the_decode_is_queued(&["--kv-release", "abort-decode"]).await;
    // The lease is 30 s: freed within 2 s (about 300 ms on an idle machine: the
    // decode's queueing, then its pull) is the release's doing.
    assert!(
        eventually(Duration::from_secs(2), || l.prefill.stats().blocks_held
            == 0)
        .await,
        "{:?}\n{}",
        l.prefill.stats(),
        l.proxy.log()
    );
    assert_eq!(l.proxy.metric("disagg_kv_releases_total").await, 1);

    // The control: without the flag the blocks wait for the lease.
    let l = leave_while_the_decode_is_queued(&[]).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(l.prefill.stats().blocks_held, 1, "held until the lease");
    assert_eq!(l.proxy.metric("disagg_kv_releases_total").await, 0);
}

// === --eject-after ===

#[tokio::test]
async fn eject_after_takes_a_failing_prefill_out_after_n_failures() {
    let broken = engine(faulty(Faults {
        status: Some(500),
        ..Faults::default()
    }))
    .await;
    let (p, d) = (
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
    );
    // The default is 5 failures; 2 here, with an ejection far longer than the test.
    let proxy = Proxy::start_args(&args(
        &[broken.url(), p.url()],
        &d,
        &["--eject-after", "2", "--ejection-time", "60"],
    ))
    .await;
    let mut failed = 0;
    for i in 0..10 {
        let a = post(
            &proxy.url(),
            COMPLETIONS,
            &completion(&format!("eject {i}"), 2, false),
        )
        .await;
        if a.status != 200 {
            a.assert_error(502, "prefill_failed");
            failed += 1;
        }
    }
    assert_eq!(
        broken.stats().requests,
        2,
        "ejected after its second failure"
    );
    assert_eq!(failed, 2);
    assert_eq!(p.stats().prefill_requests, 8);
    assert!(!proxy.routes_to("prefill", &broken.url()).await);
    assert!(proxy.routes_to("prefill", &p.url()).await);
}

// === --health-check-* ===

#[tokio::test]
async fn health_checks_take_a_dead_prefill_out_without_traffic() {
    let (dead, _held) = held_dead_url();
    let (p, d) = (
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
    );
    let proxy = Proxy::start_args(&args(
        &[dead.clone(), p.url()],
        &d,
        &["--health-check-interval", "0.1"],
    ))
    .await;
    // Two failed checks, 100 ms apart, take it out; no request has been sent.
    let mut gone = false;
    let start = Instant::now();
    while !gone && start.elapsed() < Duration::from_secs(5) {
        gone = !proxy.routes_to("prefill", &dead).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gone, "the dead prefill is still routed:\n{}", proxy.log());
    assert_eq!(
        proxy
            .metric("disagg_requests_total{route=\"orchestrated\"}")
            .await,
        0
    );
    assert!(proxy.routes_to("prefill", &p.url()).await);
    // So no request meets it.
    for i in 0..4 {
        let a = post(
            &proxy.url(),
            COMPLETIONS,
            &completion(&format!("checked {i}"), 2, false),
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert_eq!(p.stats().prefill_requests, 4);
    assert_eq!(proxy.metric("disagg_retries_total").await, 0);
}

/// Whether, 1 s after a proxy with `extra` flags started in front of `p` and `d`, it
/// still routes to `url` (a prefill endpoint).
async fn routed_after_a_second(
    prefills: &[String],
    d: &SimEngine,
    extra: &[&str],
    url: &str,
) -> bool {
    let proxy = Proxy::start_args(&args(prefills, d, extra)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    proxy.routes_to("prefill", url).await
}

#[tokio::test]
async fn the_health_check_path_is_the_one_asked() {
    let (p, d) = (
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
    );
    let prefills = [p.url()];
    // The engine answers 404 there: every check fails and both engines are taken out.
    let check = [
        "--health-check-interval",
        "0.1",
        "--health-check-path",
        "/no-such-path",
    ];
    let proxy = Proxy::start_args(&args(&prefills, &d, &check)).await;
    assert!(
        eventually_async(Duration::from_secs(5), || async {
            !proxy.routes_to("prefill", &p.url()).await
                && !proxy.routes_to("decode", &d.url()).await
        })
        .await,
        "{}",
        proxy.log()
    );
    let a = post(&proxy.url(), COMPLETIONS, &completion("nowhere", 2, false)).await;
    assert_eq!(a.status, 503, "{}", a.text());
    assert_eq!(p.stats().requests + d.stats().requests, 0);
    drop(proxy);
    // The control: a path the engine serves keeps it in.
    let check = [
        "--health-check-interval",
        "0.1",
        "--health-check-path",
        "/v1/models",
    ];
    assert!(routed_after_a_second(&prefills, &d, &check, &p.url()).await);
}

#[tokio::test]
async fn the_health_check_timeout_bounds_each_check() {
    // An engine whose `/health` answers 200 after 400 ms.
    let slow = SlowHealth::start(Duration::from_millis(400)).await;
    let (p, d) = (
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
    );
    let prefills = [slow.url.clone(), p.url()];
    let fast_checks = [
        "--health-check-interval",
        "0.1",
        "--health-check-timeout",
        "0.15",
    ];
    let proxy = Proxy::start_args(&args(&prefills, &d, &fast_checks)).await;
    assert!(
        eventually_async(Duration::from_secs(5), || async {
            !proxy.routes_to("prefill", &slow.url).await
        })
        .await,
        "checks that outlast their timeout take the engine out:\n{}",
        proxy.log()
    );
    assert!(proxy.routes_to("prefill", &p.url()).await);
    for i in 0..2 {
        let a = post(
            &proxy.url(),
            COMPLETIONS,
            &completion(&format!("fast {i}"), 2, false),
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert_eq!(p.stats().prefill_requests, 2);
    drop(proxy);
    // The control: with the default 1 s timeout the slow answers pass.
    let checks = ["--health-check-interval", "0.1"];
    assert!(routed_after_a_second(&prefills, &d, &checks, &slow.url).await);
    assert_eq!(slow.posts(), 0, "only health checks reached it");
}

/// [`eventually`] for an async condition, polled every 50 ms.
async fn eventually_async<F: std::future::Future<Output = bool>>(
    limit: Duration,
    mut f: impl FnMut() -> F,
) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    f().await
}

/// An HTTP server that answers every request with 200 `{}` after a delay, and counts the
/// POSTs it got.
struct SlowHealth {
    url: String,
    posts: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl SlowHealth {
    async fn start(delay: Duration) -> SlowHealth {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let posts = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = std::sync::Arc::clone(&posts);
        tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                let counted = std::sync::Arc::clone(&counted);
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match sock.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    if head.starts_with(b"POST") {
                        counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    tokio::time::sleep(delay).await;
                    let answer = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}";
                    let _ = sock.write_all(answer.as_bytes()).await;
                });
            }
        });
        SlowHealth { url, posts }
    }

    fn posts(&self) -> usize {
        self.posts.load(std::sync::atomic::Ordering::Relaxed)
    }
}

// === --admin-routes ===

#[tokio::test]
async fn admin_routes_are_closed_until_the_flag_opens_them_on_every_engine() {
    let load = r#"{"lora_name": "sql", "lora_path": "/adapters/sql"}"#;
    // The control: without the flag, no engine sees the request.
    let (p, d) = (
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
    );
    let proxy = Proxy::start(&p, &d, &[]).await;
    post(&proxy.url(), "/v1/load_lora_adapter", load)
        .await
        .assert_error(403, "admin_route_closed");
    assert_eq!((p.stats().admin_requests, d.stats().admin_requests), (0, 0));

    let proxy = Proxy::start(&p, &d, &["--admin-routes"]).await;
    let a = post(&proxy.url(), "/v1/load_lora_adapter", load).await;
    assert_eq!(a.status, 200, "{}\n{}", a.text(), proxy.log());
    assert_eq!(p.lora_adapters(), ["sql"]);
    assert_eq!(d.lora_adapters(), ["sql"]);
}
