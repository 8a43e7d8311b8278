//! Engine telemetry (issue #33): the proxy reads every engine's `GET /metrics`, mirrors
//! the engines' prompt-token split and stranded-KV counters, and judges each decode's KV
//! receipts, over real sockets against simulated engines that really misbehave (a decode
//! that recomputes every prompt it was handed, transfers that fail, KV that expires on a
//! prefill, `/metrics` bodies that are huge, slow or garbage).

#![allow(missing_docs)] // a test binary

use std::time::{Duration, Instant};

use disagg_sim::{Faults, KvMode, MetricsFault, SimConfig, SimEngine, SimRole};

mod common;
use common::{Proxy, completion, get, post};

const COMPLETIONS: &str = "/v1/completions";

async fn engine(config: SimConfig) -> SimEngine {
    SimEngine::start(config)
        .await
        .expect("start a simulated engine")
}

async fn faulty(faults: Faults) -> SimEngine {
    engine(SimConfig {
        faults,
        ..SimConfig::default()
    })
    .await
}

/// The value of the series `name{labels}` in the proxy's `/metrics`, if present.
async fn series(proxy: &Proxy, name: &str, labels: &str) -> Option<f64> {
    let text = get(&proxy.url(), "/metrics").await.text();
    let prefix = format!("{name}{{{labels}}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok())
}

fn at(url: &str) -> String {
    format!("endpoint=\"{url}\"")
}

/// Send requests (each must answer 200) until `done` holds, within `limit`.
async fn serve_until<F, Fut>(proxy: &Proxy, limit: Duration, mut done: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    let prompt = "the quick brown fox jumps over the lazy dog ".repeat(4);
    while start.elapsed() < limit {
        let a = post(&proxy.url(), COMPLETIONS, &completion(&prompt, 2, false)).await;
        assert_eq!(a.status, 200, "{}", a.text());
        if done().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

const FAST: [&str; 2] = ["--engine-metrics-interval", "0.1"];

#[tokio::test]
async fn a_healthy_pair_has_receipts_near_one() {
    let (p, d) = (
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
    );
    let proxy = Proxy::start(&p, &d, &FAST).await;
    let ratio = "disagg_handoff_receipt_ratio";
    let seen = serve_until(&proxy, Duration::from_secs(10), || async {
        series(&proxy, ratio, &at(&d.url())).await.is_some()
    })
    .await;
    assert!(seen, "no receipt ratio for the decode");
    let r = series(&proxy, ratio, &at(&d.url())).await.unwrap_or(0.0);
    assert!(r > 0.99, "ratio {r}");
    let external = format!("{},source=\"external_kv_transfer\"", at(&d.url()));
    let tokens = series(&proxy, "disagg_engine_prompt_tokens_total", &external).await;
    assert!(tokens.is_some_and(|t| t > 0.0), "{tokens:?}");
    assert_eq!(
        series(&proxy, "disagg_endpoint_kv_suspect", &at(&d.url())).await,
        Some(0.0)
    );
    assert!(d.stats().metrics_requests > 0 && p.stats().metrics_requests > 0);
    // A prefill is judged for nothing: it has no ratio and no flag.
    assert_eq!(series(&proxy, ratio, &at(&p.url())).await, None);
    assert_eq!(
        series(&proxy, "disagg_endpoint_kv_suspect", &at(&p.url())).await,
        None
    );
}

#[tokio::test]
async fn a_decode_that_silently_recomputes_is_flagged() {
    let p = engine(SimConfig::default()).await;
    let d = faulty(Faults {
        lose_handoff: true,
        ..Faults::default()
    })
    .await;
    let proxy = Proxy::start(&p, &d, &[FAST[0], FAST[1], "--receipt-windows", "2"]).await;
    let lowest = std::cell::Cell::new(None::<f64>);
    let flagged = serve_until(&proxy, Duration::from_secs(10), || async {
        if let Some(r) = series(&proxy, "disagg_handoff_receipt_ratio", &at(&d.url())).await {
            lowest.set(Some(r));
        }
        series(&proxy, "disagg_endpoint_kv_suspect", &at(&d.url())).await == Some(1.0)
    })
    .await;
    assert!(flagged, "the decode was not flagged");
    let lowest = lowest.get();
    assert!(lowest.is_some_and(|r| r < 0.01), "ratio {lowest:?}");
    // The answers were 200 all along: only the engine's own counters tell.
    assert_eq!(d.stats().remote_decodes, 0);
    assert!(
        proxy.log().contains("the KV does not arrive") && proxy.log().contains(&p.url()),
        "the warning names the pair:\n{}",
        proxy.log()
    );
}

#[tokio::test]
async fn with_eject_a_suspect_decode_stops_receiving_requests() {
    let p = engine(SimConfig::default()).await;
    let bad = faulty(Faults {
        lose_handoff: true,
        ..Faults::default()
    })
    .await;
    let good = engine(SimConfig::default()).await;
    let args: Vec<String> = [
        "--prefill",
        &p.url(),
        "--decode",
        &bad.url(),
        "--decode",
        &good.url(),
        "--engine-metrics-interval",
        "0.1",
        "--receipt-windows",
        "2",
        "--suspect-action",
        "eject",
        "--ejection-time",
        "30",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let proxy = Proxy::start_args(&args).await;
    let flagged = serve_until(&proxy, Duration::from_secs(10), || async {
        series(&proxy, "disagg_endpoint_kv_suspect", &at(&bad.url())).await == Some(1.0)
    })
    .await;
    assert!(flagged, "the decode was not flagged");
    // The flag shows in the same round that ejects it: allow that round to finish.
    let start = Instant::now();
    while proxy.routes_to("decode", &bad.url()).await {
        assert!(start.elapsed() < Duration::from_secs(2), "still routed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (before_bad, before_good) = (bad.stats().requests, good.stats().requests);
    for _ in 0..10 {
        let a = post(&proxy.url(), COMPLETIONS, &completion("after", 2, false)).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert_eq!(
        bad.stats().requests,
        before_bad,
        "the suspect decode got requests"
    );
    assert_eq!(good.stats().requests, before_good + 10);
}

#[tokio::test]
async fn a_prefills_expired_kv_and_a_decodes_failed_transfers_show() {
    let p = engine(SimConfig {
        kv_lease: Duration::from_millis(100),
        ..SimConfig::default()
    })
    .await;
    let d = faulty(Faults {
        fail_transfers: true,
        ..Faults::default()
    })
    .await;
    let proxy = Proxy::start(&p, &d, &FAST).await;
    let shown = serve_until(&proxy, Duration::from_secs(10), || async {
        let expired = series(&proxy, "disagg_engine_kv_expired_total", &at(&p.url())).await;
        let failed = series(
            &proxy,
            "disagg_engine_kv_transfer_failures_total",
            &at(&d.url()),
        )
        .await;
        expired.is_some_and(|n| n >= 1.0) && failed.is_some_and(|n| n >= 1.0)
    })
    .await;
    assert!(shown, "{}", get(&proxy.url(), "/metrics").await.text());
    let s = p.stats();
    assert!(s.kv_expired_reqs >= 1, "{s:?}");
    assert!(d.stats().failed_transfers >= 1);
}

#[tokio::test]
async fn a_huge_slow_or_garbage_metrics_body_fails_that_scrape_and_nothing_else() {
    let p = engine(SimConfig::default()).await;
    let d = engine(SimConfig::default()).await;
    let proxy = Proxy::start(
        &p,
        &d,
        &[
            FAST[0],
            FAST[1],
            "--engine-metrics-timeout",
            "0.3",
            "--engine-metrics-max-bytes",
            "100000",
        ],
    )
    .await;
    for fault in [
        MetricsFault::Huge(1_000_000),
        MetricsFault::Garbage,
        MetricsFault::Hang,
    ] {
        let errors = || async {
            series(&proxy, "disagg_engine_scrape_errors_total", &at(&d.url()))
                .await
                .unwrap_or(0.0)
        };
        let before = errors().await;
        let p_scrapes = series(&proxy, "disagg_engine_scrapes_total", &at(&p.url()))
            .await
            .unwrap_or(0.0);
        d.set_faults(Faults {
            metrics: Some(fault),
            ..Faults::default()
        });
        let failed = serve_until(&proxy, Duration::from_secs(10), || async {
            errors().await >= before + 2.0
        })
        .await;
        assert!(failed, "{fault:?}: no failed scrape counted");
        // The other engine is still read, without errors.
        let now = series(&proxy, "disagg_engine_scrapes_total", &at(&p.url()))
            .await
            .unwrap_or(0.0);
        assert!(now > p_scrapes, "{fault:?}: the prefill is no longer read");
        assert_eq!(
            series(&proxy, "disagg_engine_scrape_errors_total", &at(&p.url())).await,
            Some(0.0)
        );
        d.set_faults(Faults::default());
    }
    // Every request was answered 200 meanwhile (`serve_until`), and still is.
    let a = post(&proxy.url(), COMPLETIONS, &completion("after", 2, false)).await;
    assert_eq!(a.status, 200);
}

#[tokio::test]
async fn interval_zero_reads_no_engine_metrics() {
    let (p, d) = (
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
    );
    let proxy = Proxy::start(&p, &d, &["--engine-metrics-interval", "0"]).await;
    for _ in 0..3 {
        let a = post(&proxy.url(), COMPLETIONS, &completion("hello", 2, false)).await;
        assert_eq!(a.status, 200);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(p.stats().metrics_requests, 0);
    assert_eq!(d.stats().metrics_requests, 0);
    let text = get(&proxy.url(), "/metrics").await.text();
    assert!(!text.contains("disagg_engine_scrapes_total{"), "{text}");
}

#[tokio::test]
async fn scrapes_carry_the_engine_key_like_the_legs() {
    let keyed = || SimConfig {
        api_key: Some("sk-engine".to_owned()),
        ..SimConfig::default()
    };
    let (p, d) = (engine(keyed()).await, engine(keyed()).await);
    let proxy = Proxy::start(&p, &d, &[FAST[0], FAST[1], "--engine-api-key", "sk-engine"]).await;
    let read = serve_until(&proxy, Duration::from_secs(10), || async {
        p.stats().metrics_requests >= 2 && d.stats().metrics_requests >= 2
    })
    .await;
    assert!(read, "the engines' /metrics were not read");
    assert_eq!(p.stats().requests_without_key, 0);
    assert_eq!(d.stats().requests_without_key, 0);
}

/// SGLang 0.5.23 counts no KV-transfer source: its engines are read (their prompt
/// tokens mirrored), but a decode has no receipt ratio and is never judged.
#[tokio::test]
async fn sglang_engines_are_read_but_have_no_receipts() {
    let sglang = |role| {
        engine(SimConfig {
            kv_mode: KvMode::Sglang(role),
            bootstrap_timeout: Duration::from_secs(5),
            ..SimConfig::default()
        })
    };
    let (p, d) = (
        sglang(SimRole::Prefill).await,
        sglang(SimRole::Decode).await,
    );
    let port = p.bootstrap_addr().expect("a bootstrap server").port();
    let args: Vec<String> = [
        "--connector",
        "sglang",
        "--prefill",
        &p.url(),
        &port.to_string(),
        "--decode",
        &d.url(),
        FAST[0],
        FAST[1],
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let proxy = Proxy::start_args(&args).await;
    let computed = format!("{},source=\"local_compute\"", at(&p.url()));
    let read = serve_until(&proxy, Duration::from_secs(10), || async {
        series(&proxy, "disagg_engine_prompt_tokens_total", &computed)
            .await
            .is_some_and(|n| n > 0.0)
            && d.stats().metrics_requests >= 3
    })
    .await;
    assert!(read, "{}", get(&proxy.url(), "/metrics").await.text());
    assert!(d.stats().remote_decodes > 0, "the KV did move");
    let external = format!("{},source=\"external_kv_transfer\"", at(&d.url()));
    assert_eq!(
        series(&proxy, "disagg_engine_prompt_tokens_total", &external).await,
        None
    );
    assert_eq!(
        series(&proxy, "disagg_handoff_receipt_ratio", &at(&d.url())).await,
        None
    );
    assert_eq!(
        series(&proxy, "disagg_endpoint_kv_suspect", &at(&d.url())).await,
        Some(0.0)
    );
}

/// Decodes `busy` and `idle` behind one prefill; `busy` serves `held` requests sent to
/// it directly (not through the proxy) for seconds. Returns how many of `n` requests
/// sent through a proxy started with `extra` went to `busy`, once that proxy's
/// `/metrics` shows `busy`'s running requests when it reads the engines at all.
async fn sent_to_busy(extra: &[&str], held: usize, n: u64) -> u64 {
    let p = engine(SimConfig::default()).await;
    let busy = engine(SimConfig {
        inter_token_delay: Duration::from_millis(50),
        ..SimConfig::default()
    })
    .await;
    let idle = engine(SimConfig::default()).await;
    let mut args: Vec<String> = [
        "--prefill",
        &p.url(),
        "--decode",
        &busy.url(),
        "--decode",
        &idle.url(),
        "--policy",
        "least_in_flight",
        "--engine-metrics-interval",
        "0.1",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    let proxy = Proxy::start_args(&args).await;
    // Another router's load: requests of 100 tokens (5 s) sent to `busy` itself.
    let load: Vec<_> = (0..held)
        .map(|_| {
            let url = busy.url();
            tokio::spawn(
                async move { post(&url, COMPLETIONS, &completion("held", 100, false)).await },
            )
        })
        .collect();
    let start = Instant::now();
    while busy.stats().active_requests < held as u64 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the load never ran"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The proxy read them (it reads the engines under both load sources).
    let running = "disagg_engine_requests_running";
    while series(&proxy, running, &at(&busy.url())).await < Some(held as f64) {
        assert!(start.elapsed() < Duration::from_secs(5), "not read");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        series(&proxy, "disagg_engine_requests_waiting", &at(&busy.url())).await,
        Some(0.0)
    );
    assert!(
        series(&proxy, "disagg_engine_kv_cache_usage", &at(&idle.url()))
            .await
            .is_some()
    );
    let before = busy.stats().requests;
    for _ in 0..n {
        let a = post(&proxy.url(), COMPLETIONS, &completion("hello", 2, false)).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    let sent = busy.stats().requests - before;
    for l in load {
        l.abort();
    }
    sent
}

#[tokio::test]
async fn with_engine_metrics_the_engines_own_queue_steers_routing() {
    // This proxy sent none of `busy`'s requests: only the engine's count shows them.
    let sent = sent_to_busy(&["--load-source", "engine-metrics"], 4, 8).await;
    assert_eq!(
        sent, 0,
        "requests went to the engine busy with another router's load"
    );
}

#[tokio::test]
async fn with_proxy_load_another_routers_queue_is_unseen() {
    // The same load, weighed by this proxy's own counts: both decodes look idle, and
    // least_in_flight takes them in turn.
    let sent = sent_to_busy(&[], 4, 8).await;
    assert!(sent >= 3, "only {sent} of 8 went to the busy decode");
}

#[tokio::test]
async fn engine_metrics_load_needs_the_engines_metrics() {
    let args: Vec<String> = [
        "serve",
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
        "http://127.0.0.1:2",
        "--load-source",
        "engine-metrics",
        "--engine-metrics-interval",
        "0",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_disagg-proxy"))
        .args(&args)
        .output()
        .expect("run the proxy");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--engine-metrics-interval"), "{err}");
}

/// `n` requests of `tokens` tokens sent straight to `engine` (another router's), running
/// in the background.
fn load_on(engine: &SimEngine, n: usize, tokens: u32) -> Vec<tokio::task::JoinHandle<()>> {
    (0..n)
        .map(|_| {
            let url = engine.url();
            tokio::spawn(async move {
                post(&url, COMPLETIONS, &completion("held", tokens, false)).await;
            })
        })
        .collect()
}

/// The gap between two tokens of the busy decode of [`held_behind_a_busy_decode`].
const BUSY_TOKEN: Duration = Duration::from_millis(50);

/// A proxy over one prefill and one slow decode, holding requests while the decode
/// runs 2 or more by its `/metrics`, for at most `wait` seconds; the decode is busy
/// with 2 requests of `tokens` tokens ([`BUSY_TOKEN`] apart) from another router once
/// it returns, since the instant returned last.
async fn held_behind_a_busy_decode(
    wait: &str,
    tokens: u32,
) -> (
    SimEngine,
    SimEngine,
    Proxy,
    Vec<tokio::task::JoinHandle<()>>,
    Instant,
) {
    let p = engine(SimConfig::default()).await;
    let d = engine(SimConfig {
        inter_token_delay: BUSY_TOKEN,
        ..SimConfig::default()
    })
    .await;
    let proxy = Proxy::start(
        &p,
        &d,
        &[
            "--engine-metrics-interval",
            "0.05",
            "--load-source",
            "engine-metrics",
            "--decode-admission-wait",
            wait,
            "--decode-max-running",
            "2",
        ],
    )
    .await;
    let busy_since = Instant::now();
    let load = load_on(&d, 2, tokens);
    while series(&proxy, "disagg_engine_requests_running", &at(&d.url())).await < Some(2.0) {
        assert!(
            busy_since.elapsed() < Duration::from_secs(5),
            "never read busy"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (p, d, proxy, load, busy_since)
}

#[tokio::test]
async fn a_request_is_held_while_every_decode_is_saturated_then_proceeds() {
    // The decode is busy for about 6 s (120 tokens of 50 ms): past the checks below
    // however long reading it busy took (`held_behind_a_busy_decode` gives up after
    // 5 s), plus their 300 ms.
    const TOKENS: u32 = 120;
    let (p, d, proxy, _load, busy_since) = held_behind_a_busy_decode("10", TOKENS).await;
    let prefills = p.stats().requests;
    let url = proxy.url();
    let held =
        tokio::spawn(async move { post(&url, COMPLETIONS, &completion("after", 2, false)).await });
    // Held: the prefill is not sent while the decode cannot take the request.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(p.stats().requests, prefills, "the prefill ran while held");
    assert!(!held.is_finished());
    let a = held.await.expect("the request task");
    assert_eq!(a.status, 200, "{}", a.text());
    // Not before the decode had room again: one of its requests ended.
    let busy = BUSY_TOKEN * (TOKENS - 1);
    assert!(
        busy_since.elapsed() >= busy,
        "answered {:?} after the decode got busy for {busy:?}",
        busy_since.elapsed()
    );
    assert_eq!(p.stats().requests, prefills + 1);
    assert_eq!(d.stats().active_requests, 0);
    let text = get(&proxy.url(), "/metrics").await.text();
    assert!(text.contains("disagg_queued_total 1\n"), "{text}");
}

#[tokio::test]
async fn a_request_held_too_long_is_refused_without_running_its_prefill() {
    // The decode is busy for 8 s (past the 5 s reading it busy may take); the hold
    // lasts 0.3 s.
    let (p, _d, proxy, load, _) = held_behind_a_busy_decode("0.3", 160).await;
    let prefills = p.stats().requests;
    let sent = Instant::now();
    let a = post(&proxy.url(), COMPLETIONS, &completion("after", 2, false)).await;
    a.assert_error(503, "queue_timeout");
    let text = get(&proxy.url(), "/metrics").await.text();
    assert!(text.contains("disagg_queue_timeouts_total 1\n"), "{text}");
    let waited = sent.elapsed();
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    // No KV was made for a decode that could not take it.
    assert_eq!(p.stats().requests, prefills);
    for l in load {
        l.abort();
    }
}

#[tokio::test]
async fn the_hold_counts_requests_from_their_routing_so_a_burst_never_overfills_the_decode() {
    // A prefill of about 200 ms, a decode that runs 2 requests at once (more wait in
    // its queue while their KV waits on the prefill). The proxy's own count is the
    // load: a request whose prefill runs is not yet in flight on the decode.
    let p = engine(SimConfig {
        prefill_delay_per_token: Duration::from_millis(40),
        ..SimConfig::default()
    })
    .await;
    let d = engine(SimConfig {
        max_num_seqs: Some(2),
        inter_token_delay: Duration::from_millis(30),
        ..SimConfig::default()
    })
    .await;
    let proxy = Proxy::start(
        &p,
        &d,
        &["--decode-admission-wait", "30", "--decode-max-running", "2"],
    )
    .await;
    let sent: Vec<_> = (0..6)
        .map(|i| {
            let url = proxy.url();
            tokio::spawn(async move {
                post(
                    &url,
                    COMPLETIONS,
                    &completion(&format!("burst {i}"), 4, false),
                )
                .await
            })
        })
        .collect();
    let (mut prefilling, mut queued) = (0, 0);
    while sent.iter().any(|s| !s.is_finished()) {
        prefilling = prefilling.max(p.stats().active_requests);
        queued = queued.max(d.stats().waiting_requests);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for s in sent {
        let a = s.await.expect("the request task");
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert!(
        prefilling <= 2,
        "{prefilling} prefills ran for 2 decode places"
    );
    assert_eq!(queued, 0, "a request waited in the decode's queue");
    assert_eq!(p.stats().kv_expired_reqs, 0);
}
