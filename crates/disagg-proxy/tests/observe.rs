//! `disagg-proxy serve`'s observability, end to end: a real Prometheus server scrapes the
//! proxy and computes a quantile of each P/D histogram; a real OTLP/HTTP receiver (the
//! OpenTelemetry project's Python protobuf bindings) decodes the exported spans and
//! the tree is checked against what the simulated engines received; the access log's
//! lines are checked field by field; every metric the Grafana dashboard queries exists.
//!
//! The Prometheus test needs Debian's `prometheus` binary and the trace test a Python
//! with `opentelemetry-proto` (`$DISAGG_PYTHON`, else the repository's `.venv`):
//! `scripts/test.sh` installs both. Without `prometheus`, the scrape test says loudly
//! that it is skipped, unless DISAGG_REQUIRE_PROMETHEUS=1 (set by scripts/test.sh)
//! makes that a failure.

#![allow(missing_docs)] // a test binary

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use disagg_sim::{SimConfig, SimEngine};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod common;
use common::{Proxy, completion, eventually, free_addr, get, get_with, post, post_with};

const COMPLETIONS: &str = "/v1/completions";
const CHAT: &str = "/v1/chat/completions";

/// A plain prefill and decode.
async fn pair() -> (SimEngine, SimEngine) {
    (
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
    )
}

async fn engine(config: SimConfig) -> SimEngine {
    SimEngine::start(config)
        .await
        .expect("start a simulated engine")
}

fn chat(content: &str, max_tokens: u32, stream: bool) -> String {
    serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
    .to_string()
}

/// A child process killed when the test ends.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

// === the Prometheus scrape ===

fn prometheus_binary() -> Option<PathBuf> {
    for p in ["/usr/bin/prometheus", "/usr/local/bin/prometheus"] {
        if Path::new(p).exists() {
            return Some(PathBuf::from(p));
        }
    }
    // Under CI (`CI=true`) or scripts/test.sh (DISAGG_REQUIRE_PROMETHEUS=1) a missing
    // Prometheus fails the test: a green run must mean the scrape test ran.
    let required = std::env::var_os("DISAGG_REQUIRE_PROMETHEUS").is_some_and(|v| v == "1")
        || std::env::var_os("CI").is_some_and(|v| v == "true");
    if required {
        panic!(
            "prometheus is required (CI=true or DISAGG_REQUIRE_PROMETHEUS=1) but not \
             installed: apt-get install prometheus, or run scripts/test.sh"
        );
    }
    eprintln!(
        "\n\n!!!!!!!! SKIPPED: prometheus is not installed, so the scrape test did not run. \
         Install it (apt-get install prometheus) or run scripts/test.sh, which does. !!!!!!!!\n"
    );
    None
}

/// `s` percent-encoded for a URL query.
fn query_escape(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The single value of the instant PromQL `query` at the Prometheus server `base`, when
/// it has one that is a number (not NaN).
async fn promql(base: &str, query: &str) -> Option<f64> {
    let a = get(
        base,
        &format!("/api/v1/query?query={}", query_escape(query)),
    )
    .await;
    let v = a.json();
    assert_eq!(v["status"], "success", "{query}: {v}");
    let result = v["data"]["result"].as_array()?;
    let [one] = &result[..] else { return None };
    let n: f64 = one["value"][1].as_str()?.parse().ok()?;
    (!n.is_nan()).then_some(n)
}

/// Prometheus with `config` and its storage in `data`, serving on a port drawn by
/// `free_addr`, once it answers `/-/ready`; its address. Drawn again when it exits
/// first: another process took the port between the draw and Prometheus's bind.
async fn start_prometheus(binary: &Path, config: &Path, data: &Path) -> (Killed, SocketAddr) {
    for _ in 0..5 {
        let web = free_addr();
        let mut server = Killed(
            Command::new(binary)
                .arg(format!("--config.file={}", config.display()))
                .arg(format!("--storage.tsdb.path={}", data.display()))
                .arg(format!("--web.listen-address={web}"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start prometheus"),
        );
        let start = Instant::now();
        loop {
            if server.0.try_wait().expect("poll prometheus").is_some() {
                break;
            }
            // Its listener answers 503 until the storage is open.
            if tokio::net::TcpStream::connect(web).await.is_ok()
                && get(&format!("http://{web}"), "/-/ready").await.status == 200
            {
                return (server, web);
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "prometheus not ready on {web} after 60 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    panic!("prometheus exited at start on each of 5 ports")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_proxy_and_computes_a_quantile_of_every_pd_histogram() {
    let Some(prometheus) = prometheus_binary() else {
        return;
    };
    let (p, d) = pair().await;
    let proxy = Proxy::start(&p, &d, &[]).await;
    // Traffic of each kind: both APIs, streamed and not.
    for i in 0..4 {
        let a = post(
            &proxy.url(),
            COMPLETIONS,
            &completion("hello", 4, i % 2 == 0),
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
        let a = post(&proxy.url(), CHAT, &chat("hello", 4, i % 2 == 1)).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }

    let dir = std::env::temp_dir().join(format!("disagg-prometheus-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("prometheus.yml");
    // A short scrape interval keeps the test quick.
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 200ms\n  scrape_timeout: 150ms\nscrape_configs:\n  - job_name: disagg\n    static_configs:\n      - targets: ['{}']\n",
            proxy.addr
        ),
    )
    .unwrap();
    let (_server, web) = start_prometheus(&prometheus, &config, &dir.join("data")).await;
    let base = format!("http://{web}");
    let quantile = |metric: &str, by: &str| {
        format!("histogram_quantile(0.9, sum by (le{by}) ({metric}_bucket))")
    };
    let queries = [
        quantile("disagg_request_duration_seconds", ""),
        quantile("disagg_time_to_first_token_seconds", ""),
        quantile("disagg_prefill_duration_seconds", ", endpoint"),
        quantile("disagg_kv_handoff_duration_seconds", ", connector"),
        quantile("disagg_decode_head_seconds", ", endpoint"),
        quantile("disagg_decode_first_chunk_seconds", ", endpoint"),
    ];
    let start = Instant::now();
    let mut values = Vec::new();
    for q in &queries {
        loop {
            // Prometheus takes a moment to start and to scrape: its listener answers
            // 503 to every query until the storage is open, so wait for `/-/ready`.
            if tokio::net::TcpStream::connect(web).await.is_ok()
                && get(&base, "/-/ready").await.status == 200
                && let Some(v) = promql(&base, q).await
            {
                values.push(v);
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "no value for {q} after 60 s; /metrics:\n{}",
                get(&proxy.url(), "/metrics").await.text()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    // Loopback legs take well under the largest finite bucket (500 s): every quantile
    // is a finite positive number of seconds.
    for (q, v) in queries.iter().zip(&values) {
        assert!(v.is_finite() && *v > 0.0 && *v < 500.0, "{q} = {v}");
    }
    // Prometheus saw the series it was sent: 8 requests in the duration histogram.
    let count = promql(&base, "sum(disagg_request_duration_seconds_count)").await;
    assert_eq!(count, Some(8.0));
    let _ = std::fs::remove_dir_all(&dir);
}

// === the dashboard ===

/// Every metric name a PromQL expression refers to: identifiers starting with
/// `disagg_`.
fn metric_names(expr: &str, out: &mut Vec<String>) {
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("disagg_") {
        let s = i + at;
        let boundary = s == 0 || !(bytes[s - 1].is_ascii_alphanumeric() || bytes[s - 1] == b'_');
        let mut e = s;
        while e < bytes.len() && (bytes[e].is_ascii_alphanumeric() || bytes[e] == b'_') {
            e += 1;
        }
        if boundary {
            out.push(expr[s..e].to_owned());
        }
        i = e;
    }
}

fn exprs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr" | "query", Value::String(s)) => out.push(s.clone()),
                    _ => exprs(v, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| exprs(v, out)),
        _ => {}
    }
}

/// Whether the exposition `text` has a series of the metric `name`.
fn exposes(text: &str, name: &str) -> bool {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .any(|l| l.split(['{', ' ']).next() == Some(name))
}

/// Send requests through `proxy` until its `/metrics` has a series of every name in
/// `names` (or 10 s went by), and return that `/metrics` text.
async fn serve_until_exposed(proxy: &Proxy, names: &[String]) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let a = post(&proxy.url(), COMPLETIONS, &completion("hello", 2, false)).await;
        assert_eq!(a.status, 200);
        let text = get(&proxy.url(), "/metrics").await.text();
        if names.iter().all(|n| exposes(&text, n)) || Instant::now() > deadline {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn every_metric_of_the_grafana_dashboard_is_in_metrics() {
    let path = repo_root().join("deploy/grafana/disagg.json");
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("the dashboard")).unwrap();
    let mut all = Vec::new();
    exprs(&dashboard, &mut all);
    let mut names = Vec::new();
    for e in &all {
        metric_names(e, &mut names);
    }
    names.sort();
    names.dedup();
    assert!(names.len() >= 10, "the dashboard queries {names:?}");

    let (p, d) = pair().await;
    let proxy = Proxy::start(
        &p,
        &d,
        &["--access-log", "json", "--engine-metrics-interval", "0.1"],
    )
    .await;
    // Requests until every series exists: the per-endpoint ones after one leg, the
    // engines' mirrored counters after a read of their /metrics, the decode's receipt
    // ratio after a window in which it was handed KV.
    let text = serve_until_exposed(&proxy, &names).await;
    let exposed: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    for name in &names {
        assert!(
            exposed.iter().any(|e| e == name),
            "the dashboard queries {name}, which /metrics does not have:\n{text}"
        );
    }
}

// === the alerting rules ===

/// Debian's `promtool` (it comes with the `prometheus` package), or `None` after saying
/// loudly that the rule tests are skipped; a failure instead when Prometheus is required.
fn promtool_binary() -> Option<PathBuf> {
    let found = ["/usr/bin/promtool", "/usr/local/bin/promtool"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists());
    if found.is_none() {
        // Same rule as for `prometheus`: required under CI or scripts/test.sh.
        let required = std::env::var_os("DISAGG_REQUIRE_PROMETHEUS").is_some_and(|v| v == "1")
            || std::env::var_os("CI").is_some_and(|v| v == "true");
        assert!(
            !required,
            "promtool is required (CI=true or DISAGG_REQUIRE_PROMETHEUS=1) but not \
             installed: apt-get install prometheus, or run scripts/test.sh"
        );
        eprintln!(
            "\n\n!!!!!!!! SKIPPED: promtool is not installed, so the alerting rules were not \
             tested. Install it (apt-get install prometheus) or run scripts/test.sh. !!!!!!!!\n"
        );
    }
    found
}

/// `promtool <args>` in `deploy/prometheus`, failing the test with its output when it
/// fails.
fn promtool(bin: &Path, args: &[&str]) {
    let out = Command::new(bin)
        .args(args)
        .current_dir(repo_root().join("deploy/prometheus"))
        .output()
        .expect("run promtool");
    assert!(
        out.status.success(),
        "promtool {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_alerting_rules_are_valid_and_pass_their_promtool_tests() {
    let Some(bin) = promtool_binary() else { return };
    promtool(&bin, &["check", "rules", "disagg-rules.yml"]);
    promtool(&bin, &["test", "rules", "disagg-rules.test.yml"]);
}

#[tokio::test]
async fn every_metric_of_the_alerting_rules_is_in_metrics() {
    let rules = std::fs::read_to_string(repo_root().join("deploy/prometheus/disagg-rules.yml"))
        .expect("the rules");
    let mut names = Vec::new();
    for line in rules.lines().filter(|l| !l.trim_start().starts_with('#')) {
        metric_names(line, &mut names);
    }
    names.sort();
    names.dedup();
    assert!(names.len() >= 6, "the rules read {names:?}");
    let (p, d) = pair().await;
    let proxy = Proxy::start(&p, &d, &["--engine-metrics-interval", "0.1"]).await;
    let text = serve_until_exposed(&proxy, &names).await;
    for name in &names {
        assert!(
            exposes(&text, name),
            "the rules read {name}, which /metrics does not have:\n{text}"
        );
    }
}

// === the access log ===

fn field<'a>(line: &'a Value, name: &str) -> &'a Value {
    line.get(name)
        .unwrap_or_else(|| panic!("no {name} in {line}"))
}

fn ms(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("{v} is not a number"))
}

#[tokio::test]
async fn the_access_log_has_one_line_per_request_with_every_field() {
    let (p, d) = pair().await;
    let proxy = Proxy::start(&p, &d, &["--access-log", "json"]).await;
    let req = http::Request::post(format!("{}{CHAT}", proxy.url()))
        .header("content-type", "application/json")
        .header("x-request-id", "client-id-1")
        .body(http_body_util::Full::new(bytes::Bytes::from(chat(
            "hello there",
            3,
            true,
        ))))
        .unwrap();
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    // A request the engines refuse: an unknown model (404 from the decode engine).
    let refused = post(
        &proxy.url(),
        COMPLETIONS,
        &serde_json::json!({"model": "no-such", "prompt": "x", "max_tokens": 2}).to_string(),
    )
    .await;
    assert_eq!(refused.status, 404, "{}", refused.text());

    assert!(
        eventually(Duration::from_secs(5), || proxy.stdout().lines().count()
            >= 2)
        .await,
        "two lines: {}",
        proxy.stdout()
    );
    let out = proxy.stdout();
    let lines: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(lines.len(), 2, "{out}");
    let (ok, bad) = (&lines[0], &lines[1]);

    let engine_request = d.requests().into_iter().next().expect("the decode leg");
    let time = field(ok, "time").as_str().unwrap();
    assert!(
        time.len() == 24 && time.ends_with('Z') && time.as_bytes()[10] == b'T',
        "{time}"
    );
    assert_eq!(field(ok, "request_id"), "client-id-1");
    assert_eq!(
        field(ok, "engine_request_id").as_str(),
        engine_request.header("x-request-id"),
        "the id the engines got"
    );
    assert_eq!(field(ok, "method"), "POST");
    assert_eq!(field(ok, "path"), CHAT);
    assert_eq!(field(ok, "model"), "sim-model");
    assert_eq!(field(ok, "stream"), true);
    assert_eq!(field(ok, "status"), 200);
    assert_eq!(field(ok, "outcome"), "success");
    assert_eq!(field(ok, "handoff"), "kv");
    assert_eq!(field(ok, "fallback"), &Value::Null);
    assert_eq!(field(ok, "prefill").as_str(), Some(p.url().as_str()));
    assert_eq!(field(ok, "decode").as_str(), Some(d.url().as_str()));
    assert_eq!(field(ok, "attempts"), 1);
    assert_eq!(field(ok, "bytes").as_u64(), Some(body.len() as u64));
    assert_eq!(field(ok, "error"), &Value::Null);
    assert_eq!(field(ok, "route"), "orchestrated");
    assert_eq!(field(ok, "queue_ms"), &Value::Null, "no admission queue");
    assert_eq!(field(ok, "trace_id"), &Value::Null, "not traced");
    let total = ms(field(ok, "duration_ms"));
    let phases = [
        "prefill_ms",
        "handoff_ms",
        "decode_head_ms",
        "decode_first_chunk_ms",
    ];
    for f in phases {
        let v = ms(field(ok, f));
        assert!(v >= 0.0 && v <= total, "{f} = {v}, duration {total}");
    }
    assert!(ms(field(ok, "ttft_ms")) <= total);
    assert!(ms(field(ok, "decode_head_ms")) <= ms(field(ok, "decode_first_chunk_ms")));

    // The refused request: the engine's status and the decode only (its prefill failed
    // with the same 404 first, or the decode answered it: either way the route is
    // logged), outcome client_error.
    assert_eq!(field(bad, "status"), 404);
    assert_eq!(field(bad, "outcome"), "client_error");
    assert_eq!(field(bad, "model"), "no-such");
    assert_eq!(field(bad, "path"), COMPLETIONS);
    assert_eq!(field(bad, "stream"), false);
    let keys: Vec<&String> = ok.as_object().unwrap().keys().collect();
    assert_eq!(
        keys,
        bad.as_object().unwrap().keys().collect::<Vec<_>>(),
        "every line has every field"
    );
}

/// The value of the series `disagg_requests_total{route="<route>"}`.
fn requests_of(text: &str, route: &str) -> Option<u64> {
    let prefix = format!("disagg_requests_total{{route=\"{route}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok())
}

#[tokio::test]
async fn forwarded_fanned_out_and_key_refused_requests_are_counted_and_logged() {
    let (p, d) = pair().await;
    let key = "sk-client-secret-0001";
    let proxy = Proxy::start(
        &p,
        &d,
        &["--access-log", "json", "--admin-routes", "--api-key", key],
    )
    .await;
    let auth = format!("Bearer {key}");
    let with_key = [("authorization", auth.as_str()), ("x-request-id", "fwd-1")];
    let tokenized = post_with(
        &proxy.url(),
        "/tokenize",
        r#"{"model":"sim-model","prompt":"a b"}"#,
        &with_key,
    )
    .await;
    assert_eq!(tokenized.status, 200, "{}", tokenized.text());
    let reset = post_with(
        &proxy.url(),
        "/reset_prefix_cache",
        "",
        &[("authorization", auth.as_str())],
    )
    .await;
    assert_eq!(reset.status, 200, "{}", reset.text());
    let body = completion("no key", 2, false);
    let missing = post(&proxy.url(), COMPLETIONS, &body).await;
    assert_eq!(missing.status, 401);
    let wrong = post_with(
        &proxy.url(),
        "/tokenize",
        r#"{"prompt":"a"}"#,
        &[("authorization", "Bearer sk-not-a-key-of-ours")],
    )
    .await;
    assert_eq!(wrong.status, 401);

    // The metrics: each request once, under its route; the orchestrator served none.
    let text = get(&proxy.url(), "/metrics").await.text();
    assert_eq!(requests_of(&text, "forward"), Some(1), "{text}");
    assert_eq!(requests_of(&text, "fanout"), Some(1), "{text}");
    assert_eq!(requests_of(&text, "key_refused"), Some(2), "{text}");
    assert_eq!(requests_of(&text, "orchestrated"), Some(0), "{text}");
    assert_eq!(requests_of(&text, "direct"), Some(0), "{text}");

    // The access log: one line each, with its route.
    assert!(
        eventually(Duration::from_secs(5), || proxy.stdout().lines().count()
            >= 4)
        .await,
        "four lines: {}",
        proxy.stdout()
    );
    let out = proxy.stdout();
    let lines: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(lines.len(), 4, "{out}");
    let of = |route: &str| -> Vec<&Value> {
        lines
            .iter()
            .filter(|l| field(l, "route") == route)
            .collect()
    };
    let [forward] = of("forward")[..] else {
        panic!("one forward line: {out}")
    };
    assert_eq!(field(forward, "method"), "POST");
    assert_eq!(field(forward, "path"), "/tokenize");
    assert_eq!(field(forward, "status"), 200);
    assert_eq!(field(forward, "outcome"), "success");
    assert_eq!(field(forward, "request_id"), "fwd-1");
    assert_eq!(field(forward, "decode").as_str(), Some(d.url().as_str()));
    assert_eq!(
        field(forward, "bytes").as_u64(),
        Some(tokenized.body.len() as u64)
    );
    assert!(field(forward, "key").is_string(), "{forward}");
    assert!(ms(field(forward, "duration_ms")) >= 0.0);
    let [fanout] = of("fanout")[..] else {
        panic!("one fanout line: {out}")
    };
    assert_eq!(field(fanout, "path"), "/reset_prefix_cache");
    assert_eq!(field(fanout, "status"), 200);
    assert_eq!(field(fanout, "outcome"), "success");
    assert_eq!(
        field(fanout, "bytes").as_u64(),
        Some(reset.body.len() as u64)
    );
    let refused = of("key_refused");
    assert_eq!(refused.len(), 2, "{out}");
    for line in refused {
        assert_eq!(field(line, "status"), 401);
        assert_eq!(field(line, "outcome"), "client_error");
        assert_eq!(field(line, "key"), &Value::Null);
    }
    assert!(of("orchestrated").is_empty(), "{out}");
}

#[tokio::test]
async fn a_direct_request_is_counted_and_logged() {
    let (p, d) = pair().await;
    let proxy = Proxy::start(&p, &d, &["--access-log", "json"]).await;
    // A stored response's retrieval goes to a decode engine as it is.
    let before = d.stats().http_connections;
    let a = get_with(
        &proxy.url(),
        "/v1/responses/resp_1",
        &[("x-request-id", "direct-1")],
    )
    .await;
    assert_eq!(a.header("x-disagg-handoff"), Some("direct"), "{}", a.text());
    assert!(
        d.stats().http_connections > before,
        "the decode was not asked"
    );
    let text = get(&proxy.url(), "/metrics").await.text();
    assert_eq!(requests_of(&text, "direct"), Some(1), "{text}");
    assert_eq!(requests_of(&text, "forward"), Some(0), "{text}");
    assert_eq!(requests_of(&text, "orchestrated"), Some(0), "{text}");
    assert!(
        eventually(Duration::from_secs(5), || proxy.stdout().lines().count()
            >= 1)
        .await,
        "no access log line"
    );
    let out = proxy.stdout();
    let lines: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let [line] = &lines[..] else {
        panic!("one line: {out}")
    };
    assert_eq!(field(line, "route"), "direct");
    assert_eq!(field(line, "method"), "GET");
    assert_eq!(field(line, "path"), "/v1/responses/resp_1");
    assert_eq!(field(line, "status"), a.status.as_u16());
    assert_eq!(field(line, "request_id"), "direct-1");
    assert_eq!(field(line, "decode").as_str(), Some(d.url().as_str()));
    assert_eq!(field(line, "bytes").as_u64(), Some(a.body.len() as u64));
}

#[tokio::test]
async fn the_text_access_log_leads_with_time_method_path_and_status() {
    let (p, d) = pair().await;
    let proxy = Proxy::start(&p, &d, &["--access-log", "text"]).await;
    let a = post(&proxy.url(), COMPLETIONS, &completion("hello", 2, false)).await;
    assert_eq!(a.status, 200);
    assert!(
        eventually(Duration::from_secs(5), || proxy.stdout().lines().count()
            == 1)
        .await,
        "{}",
        proxy.stdout()
    );
    let out = proxy.stdout();
    let line = out.lines().next().unwrap();
    let parts: Vec<&str> = line.split(' ').collect();
    assert!(parts[0].ends_with('Z'), "{line}");
    assert_eq!(&parts[1..4], ["POST", COMPLETIONS, "200"], "{line}");
    let pairs: Vec<(&str, &str)> = parts[4..]
        .iter()
        .map(|p| p.split_once('=').unwrap_or_else(|| panic!("{p} in {line}")))
        .collect();
    let get = |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| *v);
    assert_eq!(get("model"), Some("sim-model"));
    assert_eq!(get("outcome"), Some("success"));
    assert_eq!(get("handoff"), Some("kv"));
    assert_eq!(get("decode"), Some(d.url().as_str()));
    assert_eq!(get("error"), Some("-"));
    assert_eq!(get("bytes"), Some(a.body.len().to_string().as_str()));
    assert!(get("prefill_ms").unwrap().parse::<f64>().is_ok(), "{line}");
}

// === traces ===

/// The Python OTLP receiver: its base URL and the spans it printed so far.
struct Receiver {
    _child: Killed,
    url: String,
    spans: Arc<Mutex<Vec<Value>>>,
}

impl Receiver {
    fn start() -> Receiver {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/otlp_receiver.py");
        let mut child = Command::new(common::python("`opentelemetry-proto`"))
            .arg(script)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the OTLP receiver");
        let out = BufReader::new(child.stdout.take().unwrap());
        // Killed with the test, even if it never says its port.
        let child = Killed(child);
        // Its first line, the port, read on the thread that then reads the spans: a
        // receiver that never starts fails the test instead of hanging it.
        let (first_tx, first_rx) = std::sync::mpsc::channel();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let into = Arc::clone(&spans);
        std::thread::spawn(move || {
            let mut lines = out.lines().map_while(Result::ok);
            let _ = first_tx.send(lines.next());
            for line in lines {
                into.lock()
                    .unwrap()
                    .push(serde_json::from_str(&line).unwrap());
            }
        });
        let first = first_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the OTLP receiver says its port within 20 s")
            .expect("the OTLP receiver says its port before it exits");
        let port = first
            .trim()
            .strip_prefix("PORT ")
            .unwrap_or_else(|| panic!("the receiver said {first:?}"));
        Receiver {
            _child: child,
            url: format!("http://127.0.0.1:{port}"),
            spans,
        }
    }

    fn spans(&self) -> Vec<Value> {
        self.spans.lock().unwrap().clone()
    }

    /// The spans of `trace_id` once there are at least `n`.
    async fn trace(&self, trace_id: &str, n: usize) -> Vec<Value> {
        let of = || {
            self.spans()
                .into_iter()
                .filter(|s| s["trace_id"] == trace_id)
                .collect::<Vec<_>>()
        };
        assert!(
            eventually(Duration::from_secs(20), || of().len() >= n).await,
            "{n} spans of {trace_id}; got {:?}",
            self.spans()
        );
        of()
    }
}

fn named<'a>(spans: &'a [Value], name: &str) -> &'a Value {
    let found: Vec<&Value> = spans.iter().filter(|s| s["name"] == name).collect();
    let [one] = &found[..] else {
        panic!("one {name} span, got {found:?}")
    };
    one
}

fn traceparent_of(engine: &SimEngine) -> String {
    let r = engine.requests();
    let last = r.last().expect("a request");
    last.header("traceparent")
        .expect("the leg carried a traceparent")
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traces_continue_the_clients_trace_across_both_legs() {
    let receiver = Receiver::start();
    let (p, d) = pair().await;
    let args: Vec<String> = [
        "--prefill",
        &p.url(),
        "--decode",
        &d.url(),
        "--otlp-endpoint",
        &receiver.url,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let proxy = Proxy::start_env(
        &args,
        // Export at once rather than after the SDK's default 5 s; the service name from
        // the environment, as OpenTelemetry says.
        &[
            ("OTEL_BSP_SCHEDULE_DELAY", "50"),
            ("OTEL_SERVICE_NAME", "disagg-under-test"),
        ],
    )
    .await;

    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let req = http::Request::post(format!("{}{CHAT}", proxy.url()))
        .header("content-type", "application/json")
        .header("traceparent", format!("00-{trace}-{client_span}-01"))
        .header("tracestate", "vendor=opaque")
        .body(http_body_util::Full::new(bytes::Bytes::from(chat(
            "hello", 3, true,
        ))))
        .unwrap();
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let _ = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap();

    let spans = receiver.trace(trace, 4).await;
    assert_eq!(spans.len(), 4, "{spans:?}");
    let request = named(&spans, "POST /v1/chat/completions");
    let (prefill, handoff, decode) = (
        named(&spans, "prefill"),
        named(&spans, "kv_handoff"),
        named(&spans, "decode"),
    );
    // The client's trace continues: the request span's parent is the client's span.
    assert_eq!(request["parent_span_id"], client_span);
    assert_eq!(request["service"], "disagg-under-test");
    assert_eq!(request["kind"], 2, "SPAN_KIND_SERVER");
    let a = &request["attributes"];
    assert_eq!(a["http.request.method"], "POST");
    assert_eq!(a["http.route"], CHAT);
    assert_eq!(a["http.response.status_code"], 200);
    assert_eq!(a["gen_ai.request.model"], "sim-model");
    assert_eq!(a["gen_ai.operation.name"], "chat");
    assert_eq!(a["disagg.handoff"], "kv");
    assert_eq!(a["disagg.outcome"], "success");
    assert!(a["disagg.request_id"].is_string(), "{a}");
    assert!(
        request["events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e == "first_byte")
    );
    // The legs are the request span's children.
    for leg in [prefill, handoff, decode] {
        assert_eq!(leg["parent_span_id"], request["span_id"], "{leg}");
        assert!(leg["start"].as_u64() >= request["start"].as_u64(), "{leg}");
        assert!(leg["end"].as_u64() <= request["end"].as_u64(), "{leg}");
    }
    assert_eq!(prefill["attributes"]["disagg.endpoint"], p.url());
    assert_eq!(decode["attributes"]["disagg.endpoint"], d.url());
    assert_eq!(handoff["attributes"]["disagg.connector"], "nixl");
    assert_eq!(prefill["kind"], 3, "SPAN_KIND_CLIENT");
    // Each engine got a traceparent in the same trace naming its leg's span, and the
    // client's tracestate.
    assert_eq!(
        traceparent_of(&p),
        format!("00-{trace}-{}-01", prefill["span_id"].as_str().unwrap())
    );
    assert_eq!(
        traceparent_of(&d),
        format!("00-{trace}-{}-01", decode["span_id"].as_str().unwrap())
    );
    let last = d.requests().pop().unwrap();
    assert_eq!(last.header("tracestate"), Some("vendor=opaque"));
    // The decode leg's head and first chunk are events of its span.
    let events = decode["events"].as_array().unwrap();
    assert!(events.iter().any(|e| e == "response_head"), "{decode}");
    assert!(events.iter().any(|e| e == "first_chunk"), "{decode}");

    // A request without a traceparent starts a trace of its own (ratio 1.0).
    let a = post(&proxy.url(), COMPLETIONS, &completion("hi", 2, false)).await;
    assert_eq!(a.status, 200);
    let tp = traceparent_of(&d);
    let own = tp.split('-').nth(1).unwrap().to_owned();
    assert_ne!(own, trace);
    let spans = receiver.trace(&own, 4).await;
    let request = named(&spans, "POST /v1/completions");
    assert_eq!(request["parent_span_id"], "", "a root span");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_streams_spans_end_when_the_client_leaves() {
    let receiver = Receiver::start();
    let slow = SimConfig {
        // 500 tokens at 20 ms: a 10 s stream, left after its first chunk.
        inter_token_delay: Duration::from_millis(20),
        ..SimConfig::default()
    };
    let (p, d) = (engine(SimConfig::default()).await, engine(slow).await);
    let args: Vec<String> = [
        "--prefill",
        &p.url(),
        "--decode",
        &d.url(),
        "--otlp-endpoint",
        &receiver.url,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let proxy = Proxy::start_env(&args, &[("OTEL_BSP_SCHEDULE_DELAY", "50")]).await;

    let body = completion("hello", 500, true);
    let mut tcp = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let head = format!(
        "POST {COMPLETIONS} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = tcp.read(&mut buf).await.unwrap();
        assert!(n > 0, "the stream ended early");
        got.extend_from_slice(&buf[..n]);
    }
    let left = std::time::SystemTime::now();
    drop(tcp);

    let trace = traceparent_of(&d).split('-').nth(1).unwrap().to_owned();
    let spans = receiver.trace(&trace, 4).await;
    let request = named(&spans, "POST /v1/completions");
    let decode = named(&spans, "decode");
    assert_eq!(request["attributes"]["disagg.outcome"], "cancelled");
    assert_eq!(decode["attributes"]["disagg.leg.verdict"], "abandoned");
    // Both ended about when the client left (within 3 s on a loaded machine), long
    // before the stream's 10 s.
    let left_ns = left
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    for s in [request, decode] {
        let end = s["end"].as_u64().unwrap();
        assert!(
            end < left_ns + 3_000_000_000,
            "{} ended {} ms after the client left",
            s["name"],
            (end.saturating_sub(left_ns)) / 1_000_000
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_direct_and_key_refused_requests_have_spans() {
    let receiver = Receiver::start();
    let (p, d) = pair().await;
    let key = "sk-client-secret-0002";
    let args: Vec<String> = [
        "--prefill",
        &p.url(),
        "--decode",
        &d.url(),
        "--api-key",
        key,
        "--otlp-endpoint",
        &receiver.url,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let proxy = Proxy::start_env(&args, &[("OTEL_BSP_SCHEDULE_DELAY", "50")]).await;
    let auth = format!("Bearer {key}");
    let client_span = "00f067aa0ba902b7";
    let parent = |trace: &str| format!("00-{trace}-{client_span}-01");
    // Forwarded: /tokenize, in the client's trace.
    let forward_trace = "4bf92f3577b34da6a3ce929d0e0e4701";
    let tp = parent(forward_trace);
    let a = post_with(
        &proxy.url(),
        "/tokenize",
        r#"{"model":"sim-model","prompt":"a b"}"#,
        &[
            ("authorization", auth.as_str()),
            ("traceparent", tp.as_str()),
        ],
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    let spans = receiver.trace(forward_trace, 1).await;
    let [span] = &spans[..] else {
        panic!("one span: {spans:?}")
    };
    assert_eq!(span["name"], "POST /tokenize");
    assert_eq!(span["parent_span_id"], client_span);
    assert_eq!(span["kind"], 2, "SPAN_KIND_SERVER");
    let at = &span["attributes"];
    assert_eq!(at["disagg.route"], "forward");
    assert_eq!(at["http.request.method"], "POST");
    assert_eq!(at["url.path"], "/tokenize");
    assert_eq!(at["http.response.status_code"], 200);
    assert_eq!(at["disagg.endpoint"], d.url());
    assert_eq!(at["disagg.outcome"], "success");
    // Direct: a stored response's retrieval, to a decode.
    let direct_trace = "4bf92f3577b34da6a3ce929d0e0e4702";
    let tp = parent(direct_trace);
    let a = get_with(
        &proxy.url(),
        "/v1/responses/resp_1",
        &[
            ("authorization", auth.as_str()),
            ("traceparent", tp.as_str()),
        ],
    )
    .await;
    let spans = receiver.trace(direct_trace, 1).await;
    let span = named(&spans, "GET /v1/responses/resp_1");
    assert_eq!(span["attributes"]["disagg.route"], "direct");
    assert_eq!(
        span["attributes"]["http.response.status_code"],
        a.status.as_u16()
    );
    assert_eq!(span["attributes"]["disagg.endpoint"], d.url());
    // Refused by the key check: a span too, with no engine.
    let refused_trace = "4bf92f3577b34da6a3ce929d0e0e4703";
    let tp = parent(refused_trace);
    let a = post_with(
        &proxy.url(),
        COMPLETIONS,
        &completion("no key", 2, false),
        &[("traceparent", tp.as_str())],
    )
    .await;
    assert_eq!(a.status, 401);
    let spans = receiver.trace(refused_trace, 1).await;
    let span = named(&spans, "POST /v1/completions");
    let at = &span["attributes"];
    assert_eq!(at["disagg.route"], "key_refused");
    assert_eq!(at["http.response.status_code"], 401);
    assert_eq!(at["disagg.outcome"], "client_error");
    assert!(at.get("disagg.endpoint").is_none_or(Value::is_null), "{at}");
}

/// The model a client named goes into its request's span cut to 256 bytes (on a
/// character boundary): the span is queued for export after the request ended, outside
/// every per-request budget, so a 64 KiB model name must not ride along whole. (A long
/// `x-request-id` never gets this far: the proxy draws its own id for one.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_strings_in_spans_are_cut_to_a_ceiling() {
    let receiver = Receiver::start();
    let (p, d) = pair().await;
    let args: Vec<String> = [
        "--prefill",
        &p.url(),
        "--decode",
        &d.url(),
        "--otlp-endpoint",
        &receiver.url,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let proxy = Proxy::start_env(&args, &[("OTEL_BSP_SCHEDULE_DELAY", "50")]).await;
    let trace = "4bf92f3577b34da6a3ce929d0e0e4799";
    let tp = format!("00-{trace}-00f067aa0ba902b7-01");
    // 255 ASCII bytes, then two-byte characters: the cut falls inside the first of them.
    let model = format!("{}{}", "m".repeat(255), "é".repeat(32 * 1024));
    let a = post_with(
        &proxy.url(),
        COMPLETIONS,
        &serde_json::json!({"model": model, "prompt": "x", "max_tokens": 2}).to_string(),
        &[("traceparent", tp.as_str())],
    )
    .await;
    assert_eq!(a.status, 404, "an unknown model: {}", a.text());
    // The leg's span may be exported before the request's: wait for the request's.
    let has_root = || {
        receiver
            .spans()
            .iter()
            .any(|s| s["trace_id"] == trace && s["name"] == "POST /v1/completions")
    };
    assert!(eventually(Duration::from_secs(20), has_root).await);
    let spans = receiver.trace(trace, 1).await;
    let span = named(&spans, "POST /v1/completions");
    let at = &span["attributes"];
    assert_eq!(at["gen_ai.request.model"], "m".repeat(255), "{at}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_encoder_stage_has_a_span_its_legs_name() {
    // E/P/D: an encoder-only engine writes the image's embeddings to a store the
    // consuming prefill reads from.
    let receiver = Receiver::start();
    let store = common::certs::TempDir::new();
    let ec = |role| disagg_sim::EcConfig {
        role,
        store: store.0.clone(),
    };
    let e = engine(SimConfig {
        ec: Some(ec(disagg_sim::EcRole::Producer)),
        ..SimConfig::default()
    })
    .await;
    let p = engine(SimConfig {
        ec: Some(ec(disagg_sim::EcRole::Consumer)),
        ..SimConfig::default()
    })
    .await;
    let d = engine(SimConfig::default()).await;
    let args: Vec<String> = [
        "--prefill",
        &p.url(),
        "--decode",
        &d.url(),
        "--encode",
        &e.url(),
        "--otlp-endpoint",
        &receiver.url,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let proxy = Proxy::start_env(&args, &[("OTEL_BSP_SCHEDULE_DELAY", "50")]).await;
    let trace = "5cf92f3577b34da6a3ce929d0e0e4737";
    let body = serde_json::json!({
        "model": "sim-model",
        "max_tokens": 3,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is in the picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ]}],
    })
    .to_string();
    let a = post_with(
        &proxy.url(),
        CHAT,
        &body,
        &[("traceparent", &format!("00-{trace}-00f067aa0ba902b7-01"))],
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(e.stats().ec_items_encoded, 1);

    let spans = receiver.trace(trace, 5).await;
    let request = named(&spans, "POST /v1/chat/completions");
    let encode = named(&spans, "encode");
    assert_eq!(encode["parent_span_id"], request["span_id"], "{encode}");
    assert_eq!(encode["attributes"]["disagg.encode.items"], 1, "{encode}");
    assert!(encode["start"].as_u64() >= request["start"].as_u64());
    assert!(encode["end"].as_u64() <= named(&spans, "prefill")["start"].as_u64());
    // The encoder's leg names the stage's span as its parent.
    assert_eq!(
        traceparent_of(&e),
        format!("00-{trace}-{}-01", encode["span_id"].as_str().unwrap())
    );
}
