//! `disagg-proxy serve` held to its configuration's bounds, as the real binary in front
//! of simulated engines over loopback: a prefill and a decode of different engine
//! versions refused at start-up, and one found later left out; weights from an
//! endpoints file and from `--weight URL=W` (every `URL@RANK` of it) splitting the
//! traffic; a rank range past its ceiling refused with the last good set kept; FIFOs at
//! the key file and the endpoints file refused without stopping the reloads or the
//! exit at SIGTERM; 100,000 API keys loaded and one appended while other requests go
//! on; a cloud metadata address refused from the endpoints file; flags refused at start
//! rather than panicking later, failing every request of a rank, or being ignored
//! (seconds past ~31 years, EC ports past 65535, KV-event ports past 65535, flags only
//! a source or policy not asked for reads); `nixl-ports` and `sim` refusing a FIFO, a
//! device or an oversized file instead of reading it. No test sends
//! anything to a link-local or metadata address: those are refused when the file is
//! parsed.

#![allow(missing_docs)] // a test binary

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use disagg_sim::{SimConfig, SimEngine};

mod common;
use common::certs::{TempDir, write_atomic};
use common::{Proxy, completion, eventually, get, post, post_with};

const COMPLETIONS: &str = "/v1/completions";

async fn engine(config: SimConfig) -> SimEngine {
    SimEngine::start(config)
        .await
        .expect("start a simulated engine")
}

async fn versioned(version: &str) -> SimEngine {
    engine(SimConfig {
        version: version.to_owned(),
        ..SimConfig::default()
    })
    .await
}

fn path_arg(p: &Path) -> String {
    p.display().to_string()
}

/// `disagg-proxy serve ARGS`, expected to refuse to start: its stderr. Killed (and the
/// test failed) if it is still running after 20 s. Async, so that the test's engines
/// go on answering meanwhile.
async fn refused_start(args: &[String]) -> String {
    let mut command = vec!["serve".to_owned()];
    command.extend(args.iter().cloned());
    command.extend(["--listen".to_owned(), "127.0.0.1:0".to_owned()]);
    refused_run(&command).await
}

/// `disagg-proxy COMMAND...` (any subcommand), expected to fail: its stderr, as
/// [`refused_start`].
async fn refused_run(command: &[String]) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_disagg-proxy"))
        .args(command)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start disagg-proxy");
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("poll the child") {
            break status;
        }
        if start.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the proxy did not refuse to start: {command:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut err = String::new();
    use std::io::Read;
    child
        .stderr
        .take()
        .expect("piped stderr")
        .read_to_string(&mut err)
        .expect("read stderr");
    assert!(!status.success(), "it started: {command:?}: {err}");
    err
}

/// `refused_start` for each of `cases` (flags after two engines that are never asked
/// anything), its stderr holding the case's message.
async fn each_refused(engines: &[&str], cases: &[(&[&str], &str)]) {
    for (flags, message) in cases {
        let mut args: Vec<String> = engines.iter().map(|a| (*a).to_owned()).collect();
        args.extend(flags.iter().map(|a| (*a).to_owned()));
        let err = refused_start(&args).await;
        assert!(err.contains(message), "{flags:?}: {err}");
    }
}

/// A prefill and a decode at ports nothing listens on: refused flags stop the proxy
/// before any engine is asked anything (or on a refused connection, at once).
const NO_ENGINES: &[&str] = &[
    "--prefill",
    "http://127.0.0.1:1",
    "--decode",
    "http://127.0.0.1:2",
];

/// The value of the sample `series` (name and labels, as written) in `/metrics`.
async fn sample(proxy: &Proxy, series: &str) -> Option<u64> {
    let text = get(&proxy.url(), "/metrics").await.text();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Wait until `series` reaches `at_least`, up to `limit`.
async fn sample_reaches(proxy: &Proxy, series: &str, at_least: u64, limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if sample(proxy, series).await.is_some_and(|v| v >= at_least) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// An endpoints file with one prefill and the `decode` entries (each a TOML body).
fn endpoints(prefill: &SimEngine, decode: &[String]) -> String {
    let mut s = format!("[[prefill]]\nurl = \"{}\"\n", prefill.url());
    for d in decode {
        s.push_str(&format!("\n[[decode]]\n{d}\n"));
    }
    s
}

fn decode_entry(e: &SimEngine, extra: &str) -> String {
    format!("url = \"{}\"\n{extra}", e.url())
}

/// Send `n` completions, `at_once` at a time; every one must be answered 200.
async fn send(proxy: &Proxy, n: usize, at_once: usize) {
    let (url, body) = (proxy.url(), completion("split", 1, false));
    let mut left = n;
    while left > 0 {
        let k = left.min(at_once);
        let answers =
            futures::future::join_all((0..k).map(|_| post(&url, COMPLETIONS, &body))).await;
        for a in answers {
            assert_eq!(a.status, 200, "{}\n{}", a.text(), proxy.log());
        }
        left -= k;
    }
}

/// Make a FIFO at `path` (through a rename, as a file would be replaced).
fn fifo_at(path: &Path) {
    let tmp = path.with_extension("fifo-tmp");
    let made = Command::new("mkfifo")
        .arg(&tmp)
        .status()
        .expect("run mkfifo");
    assert!(made.success());
    std::fs::rename(&tmp, path).unwrap();
}

// === engine versions ===

#[tokio::test]
async fn a_prefill_and_decode_of_different_versions_are_refused_at_start_naming_both() {
    let (p, d) = (versioned("0.33.0").await, versioned("0.32.1").await);
    let err = refused_start(&["--prefill".into(), p.url(), "--decode".into(), d.url()]).await;
    for needle in [p.url(), d.url(), "0.33.0".into(), "0.32.1".into()] {
        assert!(err.contains(&needle), "{needle} missing: {err}");
    }
    // The same versions start (and serve).
    let d2 = versioned("0.33.0").await;
    let proxy = Proxy::start(&p, &d2, &[]).await;
    let a = post(&proxy.url(), COMPLETIONS, &completion("same", 2, false)).await;
    assert_eq!(a.status, 200, "{}", proxy.log());
}

#[tokio::test]
async fn a_discovered_engine_of_another_version_is_left_out_and_counted() {
    let (p, d1, d2) = (
        versioned("0.33.0").await,
        versioned("0.33.0").await,
        versioned("0.32.1").await,
    );
    let dir = TempDir::new();
    let file = dir.write("endpoints.toml", &endpoints(&p, &[decode_entry(&d1, "")]));
    let proxy = Proxy::start_args(&["--endpoints-file".into(), path_arg(&file)]).await;
    let a = post(&proxy.url(), COMPLETIONS, &completion("one", 2, false)).await;
    assert_eq!(a.status, 200, "{}", proxy.log());

    // A third engine, of another build, joins the file.
    write_atomic(
        &file,
        &endpoints(&p, &[decode_entry(&d1, ""), decode_entry(&d2, "")]),
    );
    let counted = sample_reaches(
        &proxy,
        "disagg_pairing_refused_total{mismatch=\"version\"}",
        1,
        Duration::from_secs(10),
    )
    .await;
    assert!(counted, "{}", proxy.log());
    assert_eq!(
        sample(&proxy, "disagg_pairing_left_out{role=\"decode\"}").await,
        Some(1)
    );
    let log = proxy.log();
    assert!(
        log.contains("left out") && log.contains("0.32.1") && log.contains(&d2.url()),
        "{log}"
    );
    send(&proxy, 8, 4).await;
    assert_eq!(d2.stats().requests, 0, "the other build got nothing");
    assert_eq!(d1.stats().requests, 9);
}

// === weights ===

#[tokio::test]
async fn a_discovered_weight_changes_the_traffic_split() {
    let (p, light, heavy) = (
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
    );
    let dir = TempDir::new();
    let file = dir.write(
        "endpoints.toml",
        &endpoints(
            &p,
            &[
                decode_entry(&light, "weight = 1.0"),
                decode_entry(&heavy, "weight = 9.0"),
            ],
        ),
    );
    let proxy = Proxy::start_args(&[
        "--endpoints-file".into(),
        path_arg(&file),
        "--decode-policy".into(),
        "weighted_random".into(),
    ])
    .await;
    send(&proxy, 200, 10).await;
    let (l, h) = (light.stats().requests, heavy.stats().requests);
    assert_eq!(l + h, 200);
    // Weights 1 and 9: 180 ± 4.2 expected; equal weights would give 100 ± 7.1. 150 is
    // seven standard deviations from either.
    assert!(h >= 150, "light {l}, heavy {h}");
}

#[tokio::test]
async fn a_weight_flag_for_an_engine_url_weighs_each_of_its_ranks() {
    let p = engine(SimConfig::default()).await;
    let ranked = engine(SimConfig {
        dp_size: 2,
        ..SimConfig::default()
    })
    .await;
    let single = engine(SimConfig::default()).await;
    let proxy = Proxy::start_args(&[
        "--prefill".into(),
        p.url(),
        "--decode".into(),
        format!("{}@0-1", ranked.url()),
        "--decode".into(),
        single.url(),
        "--decode-policy".into(),
        "weighted_random".into(),
        "--weight".into(),
        format!("{}=9", ranked.url()),
    ])
    .await;
    send(&proxy, 300, 10).await;
    let (r, s) = (ranked.stats().requests, single.stats().requests);
    assert_eq!(r + s, 300);
    // Each rank weighs 9: 18 of 19, 284 ± 3.9 expected; with the ranks at weight 1
    // (the flag missing URL@RANK), 2 of 3, 200 ± 8.2. 255 is seven standard
    // deviations from the one and over six from the other.
    assert!(r >= 255, "ranked {r}, single {s}");
    // Both ranks were used.
    let per_rank = ranked.stats().requests_per_dp_rank;
    assert!(per_rank.iter().all(|&n| n > 50), "{per_rank:?}");
}

// === ceilings ===

#[tokio::test]
async fn a_rank_range_past_its_ceiling_is_refused_and_the_last_good_set_kept() {
    let (p, d) = (
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
    );
    let dir = TempDir::new();
    let file = dir.write("endpoints.toml", &endpoints(&p, &[decode_entry(&d, "")]));
    let proxy = Proxy::start_args(&["--endpoints-file".into(), path_arg(&file)]).await;
    let before = get(&proxy.url(), "/metrics").await.body.len();

    write_atomic(
        &file,
        &endpoints(&p, &[decode_entry(&d, "ranks = \"0-4294967295\"")]),
    );
    let refused = sample_reaches(
        &proxy,
        "disagg_discovery_over_limit_total{source=\"file\"}",
        1,
        Duration::from_secs(10),
    )
    .await;
    assert!(refused, "{}", proxy.log());
    // The warning is read from the process's pipe by another thread: it may reach the
    // test a moment after `/metrics` shows the count.
    let logged = eventually(Duration::from_secs(5), || {
        proxy.log().contains("over its ceiling")
    })
    .await;
    assert!(logged, "{}", proxy.log());
    // Alive and quick: the range was counted, never expanded.
    let t = Instant::now();
    let health = get(&proxy.url(), "/health").await;
    assert_eq!(health.status, 200);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    // The last good set serves, and /metrics is as small as before.
    let a = post(&proxy.url(), COMPLETIONS, &completion("kept", 2, false)).await;
    assert_eq!(a.status, 200, "{}", proxy.log());
    assert!(proxy.routes_to("decode", &d.url()).await);
    let after = get(&proxy.url(), "/metrics").await.body.len();
    assert!(after < before + 16 * 1024, "{before} -> {after} bytes");

    // A range within the ceiling is taken.
    write_atomic(
        &file,
        &endpoints(&p, &[decode_entry(&d, "ranks = \"0-1\"")]),
    );
    let ranked = format!("{}@1", d.url());
    let mut in_set = false;
    for _ in 0..100 {
        if proxy.routes_to("decode", &ranked).await {
            in_set = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(in_set, "{}", proxy.log());
}

#[tokio::test]
async fn a_metadata_address_in_the_endpoints_file_is_refused() {
    let (p, d) = (
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
    );
    let dir = TempDir::new();
    // At start: the proxy refuses the file.
    let bad = dir.write(
        "bad.toml",
        &endpoints(&p, &["url = \"http://169.254.169.254\"".to_owned()]),
    );
    let err = refused_start(&["--endpoints-file".into(), path_arg(&bad)]).await;
    assert!(
        err.contains("169.254.169.254") && err.contains("metadata"),
        "{err}"
    );

    // On an edit, as IPv4-mapped IPv6: the edit is refused, the last good set kept.
    let file = dir.write("endpoints.toml", &endpoints(&p, &[decode_entry(&d, "")]));
    let proxy = Proxy::start_args(&["--endpoints-file".into(), path_arg(&file)]).await;
    write_atomic(
        &file,
        &endpoints(
            &p,
            &[
                decode_entry(&d, ""),
                "url = \"http://[::ffff:169.254.169.254]:80\"".to_owned(),
            ],
        ),
    );
    let counted = sample_reaches(
        &proxy,
        "disagg_discovery_errors_total{source=\"file\"}",
        1,
        Duration::from_secs(10),
    )
    .await;
    assert!(counted, "{}", proxy.log());
    assert!(proxy.log().contains("metadata"), "{}", proxy.log());
    assert!(
        !proxy
            .routes_to("decode", "http://[::ffff:169.254.169.254]:80")
            .await
    );
    let a = post(&proxy.url(), COMPLETIONS, &completion("kept", 2, false)).await;
    assert_eq!(a.status, 200, "{}", proxy.log());
    assert_eq!(d.stats().requests, 1);
}

// === files that are not files ===

#[tokio::test]
async fn fifos_at_the_key_file_and_the_endpoints_file_are_refused_at_start() {
    let (p, d) = (
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
    );
    let dir = TempDir::new();
    let keys = dir.path("keys");
    fifo_at(&keys);
    let err = refused_start(&[
        "--prefill".into(),
        p.url(),
        "--decode".into(),
        d.url(),
        "--api-key-file".into(),
        path_arg(&keys),
    ])
    .await;
    assert!(
        err.contains("--api-key-file") && err.contains("FIFO"),
        "{err}"
    );
    let eps = dir.path("endpoints.toml");
    fifo_at(&eps);
    let err = refused_start(&["--endpoints-file".into(), path_arg(&eps)]).await;
    assert!(
        err.contains("endpoints file") && err.contains("FIFO"),
        "{err}"
    );
}

#[tokio::test]
async fn a_key_file_and_an_endpoints_file_turned_fifos_are_errors_reloads_go_on_and_sigterm_exits()
{
    let (p, d) = (
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
    );
    let dir = TempDir::new();
    let keys = dir.write("keys", "sk-a\n");
    let eps = dir.write("endpoints.toml", &endpoints(&p, &[decode_entry(&d, "")]));
    let mut proxy = Proxy::start_args(&[
        "--endpoints-file".into(),
        path_arg(&eps),
        "--api-key-file".into(),
        path_arg(&keys),
        "--reload-interval".into(),
        "0.1".into(),
    ])
    .await;
    let status = |key: &'static str| {
        let url = proxy.url();
        async move {
            let auth = format!("Bearer {key}");
            post_with(
                &url,
                COMPLETIONS,
                &completion("fifo", 1, false),
                &[("authorization", &auth)],
            )
            .await
            .status
            .as_u16()
        }
    };
    assert_eq!(status("sk-a").await, 200);

    // Both files become FIFOs nobody writes to: each read is an error, counted.
    fifo_at(&keys);
    fifo_at(&eps);
    let keys_counted = sample_reaches(
        &proxy,
        "disagg_api_key_file_errors_total",
        1,
        Duration::from_secs(10),
    )
    .await;
    let eps_counted = sample_reaches(
        &proxy,
        "disagg_discovery_errors_total{source=\"file\"}",
        1,
        Duration::from_secs(10),
    )
    .await;
    assert!(keys_counted && eps_counted, "{}", proxy.log());
    assert!(proxy.log().contains("FIFO"), "{}", proxy.log());
    assert_eq!(status("sk-a").await, 200, "the keys in force stay");

    // Reloading goes on: sk-a revoked, sk-b in force.
    write_atomic(&keys, "sk-b\n");
    let mut swapped = false;
    for _ in 0..100 {
        if status("sk-b").await == 200 {
            swapped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(swapped, "{}", proxy.log());
    assert_eq!(status("sk-a").await, 401);

    // With the endpoints file a FIFO again, SIGTERM still ends the process.
    fifo_at(&keys);
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.sigterm();
    let exit = proxy.exit_within(Duration::from_secs(10)).await;
    assert!(exit.success(), "{exit}: {}", proxy.log());
}

// === many keys ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_thousand_keys_load_and_one_appended_is_admitted_while_others_are_served() {
    let (p, d) = (
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
    );
    let dir = TempDir::new();
    let mut text: String = (0..100_000)
        .map(|i| format!("sk-load-{i:06}-0123456789abcdef\n"))
        .collect();
    let keys = dir.write("keys", &text);
    let proxy = Proxy::start(
        &p,
        &d,
        &[
            "--api-key-file",
            &path_arg(&keys),
            "--reload-interval",
            "0.2",
        ],
    )
    .await;
    let base = proxy.url();
    let send_with = move |key: String| {
        let url = base.clone();
        async move {
            let auth = format!("Bearer {key}");
            let t = Instant::now();
            let status = post_with(
                &url,
                COMPLETIONS,
                &completion("keys", 1, false),
                &[("authorization", &auth)],
            )
            .await
            .status
            .as_u16();
            (status, t.elapsed())
        }
    };
    for k in [
        "sk-load-000000-0123456789abcdef",
        "sk-load-099999-0123456789abcdef",
    ] {
        assert_eq!(send_with(k.into()).await.0, 200, "{}", proxy.log());
    }
    assert_eq!(send_with("sk-new".into()).await.0, 401);
    assert_eq!(sample(&proxy, "disagg_api_keys").await, Some(100_000));

    // One key appended; meanwhile another key's requests go on, one after another.
    text.push_str("sk-new\n");
    write_atomic(&keys, &text);
    let appended = Instant::now();
    let other = {
        let send_with = send_with.clone();
        tokio::spawn(async move {
            let mut answers = Vec::new();
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(3) {
                answers.push(send_with("sk-load-050000-0123456789abcdef".into()).await);
            }
            answers
        })
    };
    let mut admitted = false;
    while appended.elapsed() < Duration::from_secs(15) {
        if send_with("sk-new".into()).await.0 == 200 {
            admitted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(admitted, "{}", proxy.log());
    let answers = other.await.unwrap();
    // Every one answered 200, none held by the reload (the rebuild of 100,000 keys
    // held every authenticated request for over 13 s before).
    assert!(answers.len() >= 3, "{answers:?}");
    for (status, took) in &answers {
        assert_eq!(*status, 200);
        assert!(*took < Duration::from_secs(5), "{answers:?}");
    }
    assert_eq!(sample(&proxy, "disagg_api_keys").await, Some(100_001));
}

// === flags refused at start instead of a panic, a failure per request, or silence ===

#[tokio::test]
async fn seconds_flags_too_large_or_not_a_duration_are_refused_at_start() {
    // Past about 31 years a clock reading plus the duration could overflow, which
    // panicked (at the first connection, admission wait or telemetry tick).
    each_refused(
        NO_ENGINES,
        &[
            (
                &["--connect-timeout", "1e19"],
                "--connect-timeout is too large",
            ),
            (&["--queue-timeout", "1e19"], "--queue-timeout is too large"),
            (
                &["--engine-metrics-interval", "1e19"],
                "--engine-metrics-interval is too large",
            ),
            (
                &[
                    "--decode-admission-wait",
                    "1e19",
                    "--decode-max-running",
                    "4",
                ],
                "--decode-admission-wait is too large",
            ),
            (&["--drain-timeout", "1e12"], "--drain-timeout is too large"),
            (
                &["--reload-interval", "1e10"],
                "--reload-interval is too large",
            ),
            (
                &["--prefill-timeout=NaN"],
                "--prefill-timeout must be a non-negative number of seconds",
            ),
            (
                &["--decode-timeout=-1"],
                "--decode-timeout must be a non-negative number of seconds",
            ),
        ],
    )
    .await;
}

#[tokio::test]
async fn ec_flags_that_cannot_work_are_refused_at_start() {
    let epd = [NO_ENGINES, &["--encode", "http://127.0.0.1:3"]].concat();
    let mooncake: &[&str] = &["--ec-connector", "mooncake"];
    each_refused(
        &[epd.as_slice(), mooncake].concat(),
        &[
            // Rank 1 of the prefill would listen at 65000 + 1000: every request planned
            // for it would fail (400, blamed on the client).
            (
                &[
                    "--ec-address",
                    "http://127.0.0.1:1=10.0.0.5:65000",
                    "--ec-dp-size",
                    "2",
                    "--ec-tp-size",
                    "1000",
                ],
                "consumer http://127.0.0.1:1's data-parallel rank 1 would listen for its encoders past port 65535",
            ),
            // An address naming no engine would be used for none.
            (
                &["--ec-address", "http://127.0.0.1:9=10.0.0.5:14579"],
                "--ec-address names http://127.0.0.1:9, which is no --prefill, --decode or --encode engine",
            ),
            (
                &["--ec-address", "http://127.0.0.1:1@0=10.0.0.5:14579"],
                "the engine's URL without @RANK",
            ),
            (&["--ec-tp-size", "0"], "0 is not in 1.."),
            (&["--ec-dp-size", "0"], "0 is not in 1.."),
        ],
    )
    .await;
    // The ranks an engine URL names count too.
    each_refused(
        &[
            "--prefill",
            "http://127.0.0.1:1@0-1",
            "--decode",
            "http://127.0.0.1:2",
            "--encode",
            "http://127.0.0.1:3",
            "--ec-connector",
            "mooncake",
        ],
        &[(
            &["--ec-address", "http://127.0.0.1:1=10.0.0.5:65535"],
            "consumer http://127.0.0.1:1's data-parallel rank 1 would listen",
        )],
    )
    .await;
    // Flags the `example` EC connector never reads, and Mooncake where the proxy calls
    // no encoder.
    each_refused(
        &epd,
        &[
            (
                &["--ec-address", "http://127.0.0.1:1=10.0.0.5:14579"],
                "--ec-address is read only by --ec-connector mooncake",
            ),
            (
                &["--ec-tp-size", "2"],
                "--ec-tp-size is read only by --ec-connector mooncake",
            ),
            (
                &["--ec-dp-size", "2"],
                "--ec-dp-size is read only by --ec-connector mooncake",
            ),
        ],
    )
    .await;
    each_refused(
        NO_ENGINES,
        &[(
            mooncake,
            "--ec-connector mooncake needs encoders the proxy calls",
        )],
    )
    .await;
}

#[tokio::test]
async fn flags_nothing_asked_for_reads_are_refused_at_start() {
    let policy = "is read only by the kv_events policy";
    each_refused(
        NO_ENGINES,
        &[
            (&["--tokenizer", "/nonexistent/tokenizer.json"], policy),
            (&["--tokenize", "engine"], policy),
            (&["--kv-miss-weight", "2"], policy),
            (
                &["--lmcache-notify", "127.0.0.1:7500"],
                "--lmcache-notify is read only by --connector lmcache",
            ),
            (
                &["--dns-server", "10.0.0.1:53"],
                "--dns-server is read only by DNS discovery",
            ),
            (
                &["--k8s-namespace", "llm"],
                "--k8s-namespace is read only by Kubernetes discovery",
            ),
            (
                &["--k8s-port", "http"],
                "--k8s-port is read only by Kubernetes discovery",
            ),
            (&["--threads", "0"], "must be at least 1"),
            (&["--encode-image-batch", "0"], "must be at least 1"),
            // 0 turns the checks off; a negative or NaN interval did so silently.
            (
                &["--health-check-interval=-1"],
                "--health-check-interval must be a non-negative number of seconds",
            ),
            (
                &["--health-check-interval=NaN"],
                "--health-check-interval must be a non-negative number of seconds",
            ),
        ],
    )
    .await;
}

#[tokio::test]
async fn kv_event_ports_past_65535_for_a_fixed_engine_are_refused_at_start() {
    // Two ranks publishing at 65535 and 65536: never subscribed to, only warned of.
    each_refused(
        &[
            "--prefill",
            "http://127.0.0.1:1",
            "--decode",
            "http://127.0.0.1:2@0-1",
            "--decode-policy",
            "kv_events",
            "--tokenize",
            "engine",
        ],
        &[
            (
                &["--kv-events-port", "65535"],
                "the kv_events policy cannot subscribe to http://127.0.0.1:2: port 65535 plus 2 ranks goes beyond 65535",
            ),
            // The explicit endpoint counts the engine's ranks too.
            (
                &[
                    "--kv-events-endpoint",
                    "http://127.0.0.1:2=tcp://127.0.0.1:65535",
                ],
                "the kv_events policy cannot subscribe to http://127.0.0.1:2",
            ),
            // With a discovery source too: the engines the command line gives are
            // checked before any source starts.
            (
                &[
                    "--kv-events-port",
                    "65535",
                    "--endpoints-file",
                    "/nonexistent/endpoints.toml",
                ],
                "the kv_events policy cannot subscribe to http://127.0.0.1:2",
            ),
        ],
    )
    .await;
}

#[tokio::test]
async fn files_that_are_no_small_regular_file_are_refused_not_read() {
    let dir = TempDir::new();
    let fifo = dir.path("plan.toml");
    fifo_at(&fifo);
    // A FIFO would block the read for ever; /dev/zero would be read until memory ran
    // out.
    for plan in [path_arg(&fifo), "/dev/zero".to_owned()] {
        let err = refused_run(&["nixl-ports".to_owned(), plan.clone()]).await;
        assert!(err.contains("not a regular file"), "{plan}: {err}");
    }
    let big = dir.write("big.toml", &"#".repeat(2 << 20));
    let err = refused_run(&["nixl-ports".to_owned(), path_arg(&big)]).await;
    assert!(err.contains("larger than 1048576 bytes"), "{err}");
    let err = refused_run(
        &[
            "sim",
            "--listen",
            "127.0.0.1:0",
            "--side-channel",
            "127.0.0.1:0",
            "--tls-cert",
            "/dev/zero",
            "--tls-key",
            "/dev/zero",
        ]
        .map(str::to_owned),
    )
    .await;
    assert!(
        err.contains("--tls-cert /dev/zero: not a regular file"),
        "{err}"
    );
}
