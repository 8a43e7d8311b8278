//! `disagg-proxy serve` at the edge, as the real binary in front of simulated engines:
//! client API keys (flags, key file reloads, `/metrics`' own key), limits per key, what
//! never reaches engines or logs, engine keys, `https://` engines (right CA, wrong CA,
//! system roots, client certificates), HTTPS to clients with a rotated certificate, and
//! the real `openai` Python client over HTTPS. Certificates are made here (rcgen).

#![allow(missing_docs)] // a test binary

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use disagg_http::tls::rustls;
use disagg_sim::{SimConfig, SimEngine, SimTls};
use http_body_util::{BodyExt, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod common;
use common::certs::{Ca, Pair, TempDir};
use common::{Proxy, completion, eventually, get, get_with, post, post_with};

const COMPLETIONS: &str = "/v1/completions";

async fn engine(config: SimConfig) -> SimEngine {
    SimEngine::start(config)
        .await
        .expect("start a simulated engine")
}

/// A prefill and a decode engine with the simulator's defaults.
async fn plain_pair() -> (SimEngine, SimEngine) {
    (
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
    )
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

fn path_arg(p: &std::path::Path) -> String {
    p.display().to_string()
}

// === client keys ===

#[tokio::test]
async fn client_keys_guard_every_route_but_health_before_reading_a_body() {
    let (p, d) = plain_pair().await;
    let dir = TempDir::new();
    let file = dir.write("keys", "# team B\n\n  sk-file-b  \n");
    let proxy = Proxy::start(
        &p,
        &d,
        &["--api-key", "sk-flag-a", "--api-key-file", &path_arg(&file)],
    )
    .await;
    let url = proxy.url();
    let body = completion("guarded", 3, false);

    let none = post(&url, COMPLETIONS, &body).await;
    none.assert_error(401, "invalid_api_key");
    assert_eq!(none.json()["error"]["type"], "invalid_request_error");
    assert_eq!(none.header("www-authenticate"), Some("Bearer"));
    let wrong = post_with(
        &url,
        COMPLETIONS,
        &body,
        &[("authorization", &bearer("sk-flag"))],
    )
    .await;
    wrong.assert_error(401, "invalid_api_key");
    // Another scheme is no bearer key.
    let basic = post_with(
        &url,
        COMPLETIONS,
        &body,
        &[("authorization", "Basic c2stZmxhZy1h")],
    )
    .await;
    basic.assert_error(401, "invalid_api_key");
    assert_eq!((p.stats().requests, d.stats().requests), (0, 0));

    for auth in ["Bearer sk-flag-a", "bearer sk-file-b"] {
        let a = post_with(&url, COMPLETIONS, &body, &[("authorization", auth)]).await;
        assert_eq!(a.status, 200, "{auth}: {}", a.text());
    }
    assert_eq!((p.stats().requests, d.stats().requests), (2, 2));

    // Every route but /health and /metrics needs a key, unknown ones included.
    get(&url, "/v1/models")
        .await
        .assert_error(401, "invalid_api_key");
    let models = get_with(
        &url,
        "/v1/models",
        &[("authorization", &bearer("sk-flag-a"))],
    )
    .await;
    assert_eq!(models.status, 200, "{}", models.text());
    get(&url, "/v2/anything")
        .await
        .assert_error(401, "invalid_api_key");
    assert_eq!(get(&url, "/health").await.status, 200);
    assert_eq!(get(&url, "/metrics").await.status, 200);

    // A refusal comes before the body: a head announcing a megabyte, and no body sent,
    // is answered at once (the body limit's reader would wait 30 s for it).
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let head = format!(
        "POST {COMPLETIONS} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: 1000000\r\n\r\n",
        proxy.addr
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut buf = [0u8; 12];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut buf))
        .await
        .expect("answered without the body")
        .unwrap();
    assert_eq!(&buf, b"HTTP/1.1 401");
    assert_eq!(proxy.metric("disagg_api_keys").await, 2);
}

#[tokio::test]
async fn the_metrics_key_opens_metrics_and_nothing_holds_a_key() {
    const ENGINE_KEY: &str = "sk-secret-engine-0001";
    let keyed = || SimConfig {
        api_key: Some(ENGINE_KEY.to_owned()),
        ..SimConfig::default()
    };
    let (p, d) = (engine(keyed()).await, engine(keyed()).await);
    let dir = TempDir::new();
    let file = dir.write("keys", "sk-secret-file-0003\n");
    let args: Vec<String> = [
        "--prefill",
        &p.url(),
        "--decode",
        &d.url(),
        "--api-key",
        "sk-secret-client-0002",
        "--api-key-file",
        &path_arg(&file),
        "--metrics-api-key",
        "sk-secret-metrics-0004",
        "--engine-api-key",
        ENGINE_KEY,
        "--health-check-interval",
        "0.1",
        "--access-log",
        "json",
    ]
    .map(str::to_owned)
    .to_vec();
    // Debug logging: whatever the proxy says, no key may be in it.
    let proxy = Proxy::start_env(&args, &[("RUST_LOG", "debug")]).await;
    let url = proxy.url();
    let body = completion("secret keeping", 3, false);
    for key in [
        "sk-secret-client-0002",
        "sk-secret-file-0003",
        "sk-secret-wrong-0005",
    ] {
        let _ = post_with(&url, COMPLETIONS, &body, &[("authorization", &bearer(key))]).await;
    }
    let ok = post_with(
        &url,
        COMPLETIONS,
        &completion("stream", 4, true),
        &[("authorization", &bearer("sk-secret-client-0002"))],
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.text());

    get(&url, "/metrics")
        .await
        .assert_error(401, "invalid_api_key");
    let client_key = bearer("sk-secret-client-0002");
    let with_client = get_with(&url, "/metrics", &[("authorization", &client_key)]).await;
    with_client.assert_error(401, "invalid_api_key");
    let metrics = get_with(
        &url,
        "/metrics",
        &[("authorization", &bearer("sk-secret-metrics-0004"))],
    )
    .await;
    assert_eq!(metrics.status, 200);
    let text = metrics.text();
    // The wrong client key (the refusals on /metrics are the metrics key's, not counted
    // with the clients').
    assert!(
        text.contains("disagg_auth_refused_total{reason=\"invalid\"} 1"),
        "{text}"
    );
    // The key file edit below makes a reload log line.
    common::certs::write_atomic(&file, "sk-secret-file-0006\n");
    assert!(
        eventually(Duration::from_secs(10), || proxy
            .log()
            .contains("API key file reloaded"))
        .await,
        "{}",
        proxy.log()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let log = proxy.log();
    for key in [
        "sk-secret-client-0002",
        "sk-secret-file-0003",
        "sk-secret-metrics-0004",
        "sk-secret-wrong-0005",
        "sk-secret-file-0006",
        ENGINE_KEY,
    ] {
        assert!(!log.contains(key), "{key} in the log:\n{log}");
        assert!(!text.contains(key), "{key} in /metrics:\n{text}");
        let id = disagg_http::auth::KeyId::of(key).to_string();
        assert!(!text.contains(&id), "the id of {key} in /metrics:\n{text}");
    }
    assert!(!log.contains("sk-secret"), "{log}");
    // The access log names the client by its key's short hash, never by the key: the
    // two requests the client key made, and the one the file's key made.
    assert!(
        eventually(Duration::from_secs(5), || proxy.stdout().lines().count()
            >= 3)
        .await,
        "{}",
        proxy.stdout()
    );
    let access = proxy.stdout();
    assert!(!access.contains("sk-secret"), "{access}");
    let keys: Vec<String> = access
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            v["key"].as_str().unwrap_or("-").to_owned()
        })
        .collect();
    let client = disagg_http::auth::KeyId::of("sk-secret-client-0002").to_string();
    let from_file = disagg_http::auth::KeyId::of("sk-secret-file-0003").to_string();
    assert_eq!(keys.iter().filter(|k| **k == client).count(), 2, "{access}");
    assert_eq!(
        keys.iter().filter(|k| **k == from_file).count(),
        1,
        "{access}"
    );
    // The engines got their key on every request, health checks included.
    assert_eq!(p.stats().requests_without_key, 0);
    assert_eq!(d.stats().requests_without_key, 0);
}

#[tokio::test]
async fn a_key_file_edit_is_in_force_and_a_bad_one_keeps_the_keys() {
    let (p, d) = plain_pair().await;
    let dir = TempDir::new();
    let file = dir.write("keys", "sk-one\n");
    let proxy = Proxy::start(
        &p,
        &d,
        &[
            "--api-key-file",
            &path_arg(&file),
            "--reload-interval",
            "0.1",
        ],
    )
    .await;
    let url = proxy.url();
    let status = |key: &'static str| {
        let url = url.clone();
        async move {
            let auth = bearer(key);
            post_with(
                &url,
                COMPLETIONS,
                &completion("reload", 2, false),
                &[("authorization", &auth)],
            )
            .await
            .status
            .as_u16()
        }
    };
    assert_eq!(status("sk-one").await, 200);

    common::certs::write_atomic(&file, "# rotated\nsk-two\n");
    let mut swapped = false;
    for _ in 0..100 {
        if status("sk-two").await == 200 {
            swapped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(swapped, "sk-two never accepted:\n{}", proxy.log());
    assert_eq!(status("sk-one").await, 401);
    assert_eq!(proxy.metric("disagg_api_key_reloads_total").await, 1);

    // An invalid edit (a key with a space) is refused whole: sk-two stays, sk-three
    // never comes.
    common::certs::write_atomic(&file, "sk-three\nnot a key\n");
    let refused = async {
        while proxy.metric("disagg_api_key_file_errors_total").await < 1 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), refused)
        .await
        .expect("the bad edit is counted");
    assert_eq!(status("sk-two").await, 200);
    assert_eq!(status("sk-three").await, 401);
    assert!(proxy.log().contains("key file line 2"), "{}", proxy.log());

    // A deleted file keeps the keys too, counted once.
    std::fs::remove_file(&file).unwrap();
    let gone = async {
        while proxy.metric("disagg_api_key_file_errors_total").await < 2 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), gone)
        .await
        .expect("the missing file is counted");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(proxy.metric("disagg_api_key_file_errors_total").await, 2);
    assert_eq!(status("sk-two").await, 200);
}

// === limits per key ===

#[tokio::test]
async fn a_key_over_its_rate_gets_429_while_another_keeps_its_own() {
    let (p, d) = plain_pair().await;
    let proxy = Proxy::start(
        &p,
        &d,
        &[
            "--api-key",
            "sk-a",
            "--api-key",
            "sk-b",
            "--key-rate",
            "0.5",
            "--key-burst",
            "2",
        ],
    )
    .await;
    let url = proxy.url();
    let send = |key: &str| {
        let (url, auth) = (url.clone(), bearer(key));
        async move {
            post_with(
                &url,
                COMPLETIONS,
                &completion("rate", 2, false),
                &[("authorization", &auth)],
            )
            .await
        }
    };
    for _ in 0..2 {
        assert_eq!(send("sk-a").await.status, 200);
    }
    let throttled = send("sk-a").await;
    throttled.assert_error(429, "rate_limit_exceeded");
    // At 0.5/s the next token is at most 2 s away: whole seconds, rounded up.
    let after: u64 = throttled
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("an integer retry-after");
    assert!((1..=2).contains(&after), "{after}");
    // sk-b has its own bucket, untouched by sk-a's.
    for _ in 0..2 {
        assert_eq!(send("sk-b").await.status, 200);
    }
    let text = get(&url, "/metrics").await.text();
    assert!(
        text.contains("disagg_key_throttled_total{reason=\"rate\"} 1"),
        "{text}"
    );
    // The throttled request reached no engine.
    assert_eq!(d.stats().requests, 4);
}

/// A streaming request whose answer head has arrived; its body is held unread.
async fn open_stream(url: &str, key: &str) -> http::Response<hyper::body::Incoming> {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http();
    let req = http::Request::post(format!("{url}{COMPLETIONS}"))
        .header("content-type", "application/json")
        .header("authorization", bearer(key))
        .body(Full::new(Bytes::from(completion("held open", 200, true))))
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), client.request(req))
        .await
        .expect("a head in time")
        .expect("an answer")
}

#[tokio::test]
async fn max_in_flight_per_key_counts_open_streams() {
    let p = engine(SimConfig::default()).await;
    let d = engine(SimConfig {
        // 200 tokens at 50 ms: a stream stays open for 10 s unless dropped.
        inter_token_delay: Duration::from_millis(50),
        ..SimConfig::default()
    })
    .await;
    let proxy = Proxy::start(
        &p,
        &d,
        &[
            "--api-key",
            "sk-a",
            "--api-key",
            "sk-b",
            "--key-max-in-flight",
            "2",
        ],
    )
    .await;
    let url = proxy.url();
    let held = [
        open_stream(&url, "sk-a").await,
        open_stream(&url, "sk-a").await,
    ];
    assert!(held.iter().all(|r| r.status() == 200));
    let body = completion("third", 2, false);
    let third = post_with(
        &url,
        COMPLETIONS,
        &body,
        &[("authorization", &bearer("sk-a"))],
    )
    .await;
    third.assert_error(429, "rate_limit_exceeded");
    assert_eq!(third.header("retry-after"), Some("1"));
    // sk-b is not held back by sk-a's streams.
    let other = post_with(
        &url,
        COMPLETIONS,
        &body,
        &[("authorization", &bearer("sk-b"))],
    )
    .await;
    assert_eq!(other.status, 200, "{}", other.text());

    // Streams that end give their places back.
    drop(held);
    let mut freed = false;
    for _ in 0..100 {
        let a = post_with(
            &url,
            COMPLETIONS,
            &body,
            &[("authorization", &bearer("sk-a"))],
        )
        .await;
        if a.status == 200 {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(freed, "sk-a's places never came back");
}

// === what reaches engines ===

#[tokio::test]
async fn a_clients_authorization_never_reaches_an_engine() {
    let (p, d) = plain_pair().await;
    let client_auth = [("authorization", "Bearer sk-client-secret")];
    let body = completion("whose key", 3, false);
    {
        let proxy = Proxy::start(&p, &d, &[]).await;
        let a = post_with(&proxy.url(), COMPLETIONS, &body, &client_auth).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    {
        let proxy = Proxy::start(&p, &d, &["--engine-api-key", "sk-engine"]).await;
        let a = post_with(&proxy.url(), COMPLETIONS, &body, &client_auth).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    let seen: Vec<Option<String>> = p
        .requests()
        .iter()
        .chain(d.requests().iter())
        .map(|r| r.header("authorization").map(str::to_owned))
        .collect();
    assert_eq!(seen.len(), 4);
    // Without an engine key the legs carry none; with one, the engine's key, both legs.
    assert_eq!(
        (seen[0].as_deref(), seen[1].as_deref()),
        (None, Some("Bearer sk-engine"))
    );
    assert_eq!(
        (seen[2].as_deref(), seen[3].as_deref()),
        (None, Some("Bearer sk-engine"))
    );

    // Client keys and forwarding the client's authorization exclude each other.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_disagg-proxy"))
        .args(["serve", "--prefill", &p.url(), "--decode", &d.url()])
        .args([
            "--api-key",
            "sk-a",
            "--forward-authorization",
            "--listen",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--forward-authorization"), "{stderr}");
    assert!(!stderr.contains("sk-a"), "{stderr}");
}

#[tokio::test]
async fn engine_keys_go_on_both_legs_models_and_health_checks() {
    let keyed = |key: &str| SimConfig {
        api_key: Some(key.to_owned()),
        ..SimConfig::default()
    };
    let body = completion("keyed engines", 3, false);
    // The control: without the engines' key the legs are refused and the health checks
    // go keyless.
    {
        let (p, d) = (engine(keyed("sk-p")).await, engine(keyed("sk-d")).await);
        let proxy = Proxy::start(&p, &d, &["--health-check-interval", "0.1"]).await;
        let a = post(&proxy.url(), COMPLETIONS, &body).await;
        assert_ne!(a.status, 200, "{}", a.text());
        assert_eq!(p.stats().unauthorized, 1);
        assert!(
            eventually(Duration::from_secs(5), || d.stats().requests_without_key
                >= 2)
            .await,
            "no keyless health check seen"
        );
    }
    let (p, d) = (engine(keyed("sk-p")).await, engine(keyed("sk-d")).await);
    let (pk, dk) = (format!("{}=sk-p", p.url()), format!("{}=sk-d", d.url()));
    let proxy = Proxy::start(
        &p,
        &d,
        &[
            "--engine-api-key",
            "sk-unused-default",
            "--engine-api-key",
            &pk,
            "--engine-api-key",
            &dk,
            "--health-check-interval",
            "0.1",
        ],
    )
    .await;
    for stream in [false, true] {
        let a = post(&proxy.url(), COMPLETIONS, &completion("keyed", 3, stream)).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert_eq!((p.stats().requests, d.stats().remote_decodes), (2, 2));
    // GET /v1/models asks the decode engine (no model is declared).
    let models = get(&proxy.url(), "/v1/models").await;
    assert_eq!(models.status, 200, "{}", models.text());
    assert_eq!(models.json()["data"][0]["id"], "sim-model");
    // Health checks ran meanwhile (every 100 ms), each with the engine's key.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(proxy.routes_to("decode", &d.url()).await);
    for e in [&p, &d] {
        let s = e.stats();
        assert_eq!((s.requests_without_key, s.unauthorized), (0, 0), "{s:?}");
    }

    // An engine key must name an engine the proxy has.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_disagg-proxy"))
        .args(["serve", "--prefill", &p.url(), "--decode", &d.url()])
        .args([
            "--engine-api-key",
            "http://127.0.0.1:1=sk-x",
            "--listen",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("no --prefill or --decode engine"),
        "{stderr}"
    );
}

/// LMCache's connector asks an engine's `POST /tokenize` (outside vLLM's guarded `/v1`
/// paths): the engine key goes there too, as on every request to an engine.
#[tokio::test]
async fn engine_keys_go_on_lmcaches_tokenize_requests() {
    use disagg_sim::{KvMode, LmcacheReceiver, SimRole};
    let notify = common::free_addr();
    let decode = engine(SimConfig {
        kv_mode: KvMode::Lmcache(SimRole::Decode),
        lmcache_receiver: LmcacheReceiver::ephemeral(1),
        api_key: Some("sk-lmcache-engines".to_owned()),
        ..SimConfig::default()
    })
    .await;
    let prefill = engine(SimConfig {
        kv_mode: KvMode::Lmcache(SimRole::Prefill),
        lmcache_proxy: Some(notify.to_string()),
        api_key: Some("sk-lmcache-engines".to_owned()),
        ..SimConfig::default()
    })
    .await;
    let receiver = format!(
        "{}=127.0.0.1:{}:{}",
        decode.url(),
        decode.lmcache_init_ports()[0],
        decode.lmcache_alloc_ports()[0]
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
            "--engine-api-key",
            "sk-lmcache-engines",
        ],
    )
    .await;
    let chat = serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "keys on every engine path"}],
        "max_tokens": 4,
    });
    let a = post(&proxy.url(), "/v1/chat/completions", &chat.to_string()).await;
    assert_eq!(a.status, 200, "{}\n{}", a.text(), proxy.log());
    let (p, d) = (prefill.stats(), decode.stats());
    assert!(
        p.tokenize_requests + d.tokenize_requests > 0,
        "no /tokenize was asked: {p:?} {d:?}"
    );
    assert_eq!((p.requests_without_key, d.requests_without_key), (0, 0));
    assert_eq!((p.unauthorized, d.unauthorized), (0, 0));
}

// === TLS to engines ===

fn https_config(ca: &Ca, client_ca: Option<&Ca>) -> SimConfig {
    let pair = ca.server("engine");
    SimConfig {
        tls: Some(SimTls {
            cert_pem: pair.cert,
            key_pem: pair.key,
            client_ca_pem: client_ca.map(|c| c.pem.clone()),
        }),
        ..SimConfig::default()
    }
}

#[tokio::test]
async fn https_engines_are_reached_with_the_right_ca_only() {
    let (ca, other) = (Ca::new("engines CA"), Ca::new("another CA"));
    let (p, d) = (
        engine(https_config(&ca, None)).await,
        engine(https_config(&ca, None)).await,
    );
    assert!(p.url().starts_with("https://"));
    let dir = TempDir::new();
    let ca_file = dir.write("ca.pem", &ca.pem);
    let other_file = dir.write("other.pem", &other.pem);
    {
        let proxy = Proxy::start(&p, &d, &["--engine-ca", &path_arg(&ca_file)]).await;
        // The start-up `GET /version` (versions are paired) had a connection of its own.
        let at_start = d.stats().http_connections;
        for stream in [false, true, false] {
            let a = post(&proxy.url(), COMPLETIONS, &completion("tls", 4, stream)).await;
            assert_eq!(a.status, 200, "{}", a.text());
        }
        // The legs' TLS connections were kept and reused.
        assert!(
            d.stats().http_connections - at_start <= 2,
            "{:?}",
            d.stats()
        );
    }
    {
        let proxy = Proxy::start(&p, &d, &["--engine-ca", &path_arg(&other_file)]).await;
        let a = post(&proxy.url(), COMPLETIONS, &completion("tls", 4, false)).await;
        a.assert_error(502, "prefill_failed");
        let msg = a.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(
            msg.contains("TLS handshake with 127.0.0.1") && msg.contains("UnknownIssuer"),
            "{msg}"
        );
    }
    // Without --engine-ca the system's trust store is used, which SSL_CERT_FILE names.
    let args: Vec<String> = ["--prefill", &p.url(), "--decode", &d.url()]
        .map(str::to_owned)
        .to_vec();
    let ca_path = path_arg(&ca_file);
    let proxy = Proxy::start_env(&args, &[("SSL_CERT_FILE", &ca_path)]).await;
    let a = post(
        &proxy.url(),
        COMPLETIONS,
        &completion("system roots", 4, false),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
}

#[tokio::test]
async fn engines_requiring_client_certificates_get_the_proxys() {
    let (ca, clients) = (Ca::new("engines CA"), Ca::new("proxies CA"));
    let (p, d) = (
        engine(https_config(&ca, Some(&clients))).await,
        engine(https_config(&ca, Some(&clients))).await,
    );
    let dir = TempDir::new();
    let ca_file = path_arg(&dir.write("ca.pem", &ca.pem));
    {
        let proxy = Proxy::start(&p, &d, &["--engine-ca", &ca_file]).await;
        let a = post(&proxy.url(), COMPLETIONS, &completion("mtls", 3, false)).await;
        a.assert_error(502, "prefill_failed");
        assert_eq!(p.stats().requests, 0);
    }
    let (cert, key) = dir.pair("proxy", &clients.client("disagg-proxy"));
    let proxy = Proxy::start(
        &p,
        &d,
        &[
            "--engine-ca",
            &ca_file,
            "--engine-client-cert",
            &path_arg(&cert),
            "--engine-client-key",
            &path_arg(&key),
        ],
    )
    .await;
    for stream in [false, true] {
        let a = post(&proxy.url(), COMPLETIONS, &completion("mtls", 3, stream)).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert_eq!(d.stats().remote_decodes, 2);
}

// === HTTPS to clients ===

/// A TLS connection to `addr` trusting `ca`: the certificate the server showed, and an
/// HTTP/1.1 sender over it.
async fn tls_connect(
    addr: std::net::SocketAddr,
    ca: &Ca,
) -> (
    Vec<u8>,
    hyper::client::conn::http1::SendRequest<Full<Bytes>>,
) {
    let roots = disagg_http::tls::roots_from_pem(ca.pem.as_bytes(), "test CA").unwrap();
    let config = rustls::ClientConfig::builder_with_provider(disagg_http::tls::default_provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let stream = connector.connect(name, tcp).await.expect("a TLS handshake");
    let cert = stream.get_ref().1.peer_certificates().unwrap()[0].to_vec();
    let (sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    (cert, sender)
}

async fn tls_get(
    sender: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    path: &str,
) -> (u16, String) {
    sender.ready().await.unwrap();
    let req = http::Request::get(path)
        .header("host", "localhost")
        .body(Full::default())
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn a_rotated_certificate_is_served_without_a_restart() {
    let (p, d) = plain_pair().await;
    let ca = Ca::new("edge CA");
    let (first, second): (Pair, Pair) = (ca.server("first"), ca.server("second"));
    let dir = TempDir::new();
    let (cert, key) = dir.pair("tls", &first);
    let proxy = Proxy::start(
        &p,
        &d,
        &[
            "--tls-cert",
            &path_arg(&cert),
            "--tls-key",
            &path_arg(&key),
            "--reload-interval",
            "0.1",
        ],
    )
    .await;
    let (shown, mut old) = tls_connect(proxy.addr, &ca).await;
    assert_eq!(shown, first.der);
    assert_eq!(tls_get(&mut old, "/health").await.0, 200);

    dir.pair("tls", &second);
    let mut rotated = false;
    for _ in 0..100 {
        if tls_connect(proxy.addr, &ca).await.0 == second.der {
            rotated = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        rotated,
        "the new certificate was never served:\n{}",
        proxy.log()
    );
    // The connection made before the rotation still works.
    let (status, metrics) = tls_get(&mut old, "/metrics").await;
    assert_eq!(status, 200);
    assert!(
        metrics.contains("disagg_tls_reloads_total{cert=\"server\"} 1"),
        "{metrics}"
    );
    // Plain HTTP is not served on the TLS port.
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
    assert!(
        !buf.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&buf)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_over_https_with_and_without_a_key() {
    let (p, d) = plain_pair().await;
    let ca = Ca::new("edge CA");
    let dir = TempDir::new();
    let (cert, key) = dir.pair("tls", &ca.server("proxy"));
    let ca_file = dir.write("ca.pem", &ca.pem);
    let proxy = Proxy::start(
        &p,
        &d,
        &[
            "--tls-cert",
            &path_arg(&cert),
            "--tls-key",
            &path_arg(&key),
            "--api-key",
            "sk-python",
        ],
    )
    .await;
    // What a direct run gives, from the decode engine itself.
    let chat = serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "tell me about disaggregated serving"}],
        "max_tokens": 8,
    });
    let direct = post(&d.url(), "/v1/chat/completions", &chat.to_string()).await;
    let expect = serde_json::json!({
        "chat": direct.json()["choices"][0]["message"]["content"],
    })
    .to_string();
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/python/openai_https.py");
    let url = format!("https://127.0.0.1:{}", proxy.addr.port());
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(common::python("the `openai` package"))
            .arg(script)
            .arg(url)
            .arg(ca_file)
            .arg("sk-python")
            .arg(expect)
            .output()
    })
    .await
    .unwrap()
    .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "python failed:\n{stdout}\n{stderr}\n{}",
        proxy.log()
    );
    assert!(stdout.contains("openai https: 5 checks passed"), "{stdout}");
    // Two generations went through (the wrong key's reached no engine).
    assert_eq!(d.stats().remote_decodes, 2);
}
