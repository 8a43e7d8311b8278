//! Unit tests of the key check, limits, reloads, refusals and engine keys.

use std::time::Duration;

use http::StatusCode;
use http::header::{HeaderValue, RETRY_AFTER, WWW_AUTHENTICATE};
use http::uri::Authority;

use super::keys::bearer;
use super::*;

fn header(v: &str) -> HeaderValue {
    HeaderValue::from_str(v).unwrap()
}

#[test]
fn bearer_tokens_are_read_like_vllm_reads_them() {
    assert_eq!(bearer(&header("Bearer sk-a")), Some(&b"sk-a"[..]));
    assert_eq!(bearer(&header("bearer sk-a")), Some(&b"sk-a"[..]));
    assert_eq!(bearer(&header("BEARER   sk-a  ")), Some(&b"sk-a"[..]));
    for bad in ["Basic c2s=", "Bearer", "Bearer ", "Bearersk-a", "sk-a"] {
        assert_eq!(bearer(&header(bad)), None, "{bad}");
    }
}

#[test]
fn keys_are_checked_and_named_by_their_id() {
    let keys = ApiKeys::new(["sk-a", "sk-b", "sk-a"]).unwrap();
    assert_eq!(keys.len(), 2);
    let ok = keys.check(Some(&header("Bearer sk-b"))).unwrap();
    assert_eq!(ok.id(), KeyId::of("sk-b"));
    assert_eq!(keys.check(None).unwrap_err(), Refusal::Missing);
    assert_eq!(
        keys.check(Some(&header("Bearer sk-c"))).unwrap_err(),
        Refusal::Invalid
    );
    // A prefix of a key is no key.
    assert_eq!(
        keys.check(Some(&header("Bearer sk-"))).unwrap_err(),
        Refusal::Invalid
    );
    let s = keys.stats();
    assert_eq!((s.missing, s.invalid), (1, 2));
}

#[test]
fn an_empty_set_refuses_everyone() {
    let keys = ApiKeys::new(Vec::<String>::new()).unwrap();
    assert!(keys.is_empty());
    assert_eq!(
        keys.check(Some(&header("Bearer anything"))).unwrap_err(),
        Refusal::Invalid
    );
}

#[test]
fn invalid_keys_are_refused_without_showing_them() {
    for bad in ["", "sk a", "sk\u{e9}", "sk\ta"] {
        let err = ApiKeys::new([bad]).unwrap_err().to_string();
        assert!(err.contains("key #1"), "{err}");
        if !bad.is_empty() {
            assert!(!err.contains(bad), "{err}");
        }
    }
    let err = parse_key_file(b"# ok\nsk-ok\nsk secret\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("line 3") && !err.contains("secret"), "{err}");
}

#[test]
fn reloads_keep_fixed_keys_and_the_state_of_kept_keys() {
    let limits = KeyLimits {
        max_in_flight: Some(1),
        ..KeyLimits::default()
    };
    let keys = ApiKeys::with_limits(["sk-fixed"], limits).unwrap();
    keys.reload(["sk-file-1", "sk-file-2"]).unwrap();
    assert_eq!(keys.len(), 3);
    let held = keys.check(Some(&header("Bearer sk-file-1"))).unwrap();
    // The key kept by a reload keeps its in-flight count...
    keys.reload(["sk-file-1"]).unwrap();
    assert!(matches!(
        keys.check(Some(&header("Bearer sk-file-1"))),
        Err(Refusal::InFlight { max: 1 })
    ));
    // ...a removed key is refused, and the fixed key stays.
    assert_eq!(
        keys.check(Some(&header("Bearer sk-file-2"))).unwrap_err(),
        Refusal::Invalid
    );
    assert!(keys.check(Some(&header("Bearer sk-fixed"))).is_ok());
    drop(held);
    assert!(keys.check(Some(&header("Bearer sk-file-1"))).is_ok());
    // An invalid reload changes nothing.
    assert!(keys.reload(["sk bad"]).is_err());
    assert_eq!(keys.len(), 2);
}

#[test]
fn in_flight_places_come_back_when_admissions_drop() {
    let limits = KeyLimits {
        max_in_flight: Some(2),
        ..KeyLimits::default()
    };
    let keys = ApiKeys::with_limits(["sk-a", "sk-b"], limits).unwrap();
    let a = header("Bearer sk-a");
    let (one, two) = (keys.check(Some(&a)).unwrap(), keys.check(Some(&a)).unwrap());
    let refused = keys.check(Some(&a)).unwrap_err();
    assert_eq!(refused, Refusal::InFlight { max: 2 });
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    // Another key is unaffected.
    assert!(keys.check(Some(&header("Bearer sk-b"))).is_ok());
    drop(one);
    assert!(keys.check(Some(&a)).is_ok());
    drop(two);
    assert_eq!(keys.stats().throttled_in_flight, 1);
}

#[test]
fn the_bucket_allows_its_burst_then_names_the_wait() {
    let limits = KeyLimits {
        rate: Some(0.25),
        burst_size: Some(2.0),
        ..KeyLimits::default()
    };
    let keys = ApiKeys::with_limits(["sk-a", "sk-b"], limits).unwrap();
    let a = header("Bearer sk-a");
    assert!(keys.check(Some(&a)).is_ok());
    assert!(keys.check(Some(&a)).is_ok());
    let refused = keys.check(Some(&a)).unwrap_err();
    // At 0.25/s the next token is up to 4 s away.
    let wait = refused.retry_after().unwrap();
    assert!(
        wait > Duration::from_secs(3) && wait <= Duration::from_secs(4),
        "{wait:?}"
    );
    let resp = refused.to_response();
    assert_eq!(resp.headers()[RETRY_AFTER], "4");
    let body: serde_json::Value = serde_json::from_slice(resp.body()).unwrap();
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
    // Another key has its own bucket.
    assert!(keys.check(Some(&header("Bearer sk-b"))).is_ok());
}

#[test]
fn refusals_are_openai_errors() {
    let resp = Refusal::Missing.to_response();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(resp.headers()[WWW_AUTHENTICATE], "Bearer");
    let body: serde_json::Value = serde_json::from_slice(resp.body()).unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(body["error"]["code"], "invalid_api_key");
    assert!(body["error"]["param"].is_null());
}

#[cfg(feature = "metrics")]
#[test]
fn metrics_hold_no_key_material() {
    let keys = ApiKeys::new(["sk-secret-value"]).unwrap();
    let _ = keys.check(Some(&header("Bearer sk-wrong")));
    let mut registry = prometheus_client::registry::Registry::default();
    keys.register_metrics(&mut registry);
    let (out, _) = crate::metrics::encode(&registry, None);
    assert!(out.contains("\ndisagg_api_keys 1\n"), "{out}");
    assert!(
        out.contains("disagg_auth_refused_total{reason=\"invalid\"} 1"),
        "{out}"
    );
    assert!(!out.contains("sk-") && !out.contains(&KeyId::of("sk-secret-value").to_string()));
    assert!(!format!("{keys:?}").contains("sk-"));
}

#[test]
fn engine_keys_go_by_scheme_host_and_port() {
    let keys = EngineKeys::default()
        .with_default("sk-all")
        .unwrap()
        .with_engine("https://d:1@3", "sk-d")
        .unwrap();
    let a: Authority = "d:1".parse().unwrap();
    assert_eq!(keys.for_engine(true, &a).unwrap(), "Bearer sk-d");
    assert_eq!(keys.for_engine(false, &a).unwrap(), "Bearer sk-all");
    assert!(EngineKeys::default().for_engine(true, &a).is_none());
    assert!(EngineKeys::default().with_engine("d:1", "k").is_err());
}

#[test]
fn a_100k_key_set_builds_checks_and_reloads_correctly() {
    let all: Vec<String> = (0..100_000).map(|i| format!("sk-load-{i:06}-x")).collect();
    let limits = KeyLimits {
        max_in_flight: Some(1),
        ..KeyLimits::default()
    };
    let keys = ApiKeys::with_limits(["sk-fixed"], limits).unwrap();
    keys.reload(&all).unwrap();
    assert_eq!(keys.len(), 100_001);
    // Every key is found, named by its own id; near misses are not.
    for k in all.iter().step_by(997).chain([&all[0], &all[99_999]]) {
        let ok = keys.check(Some(&header(&format!("Bearer {k}")))).unwrap();
        assert_eq!(ok.id(), KeyId::of(k));
    }
    for miss in [
        "sk-load-100000-x",
        "sk-load-000001-",
        "sk-load-000001-xx",
        "sk-fixed2",
    ] {
        assert_eq!(
            keys.check(Some(&header(&format!("Bearer {miss}"))))
                .unwrap_err(),
            Refusal::Invalid,
            "{miss}"
        );
    }
    // One key in flight; then one key appended: the new one is in, the kept ones keep
    // their state (the one in flight is still at its limit), the fixed one stays.
    let held = keys
        .check(Some(&header(&format!("Bearer {}", all[42]))))
        .unwrap();
    let mut more = all.clone();
    more.push("sk-appended".into());
    keys.reload(&more).unwrap();
    assert_eq!(keys.len(), 100_002);
    assert!(keys.check(Some(&header("Bearer sk-appended"))).is_ok());
    assert!(matches!(
        keys.check(Some(&header(&format!("Bearer {}", all[42])))),
        Err(Refusal::InFlight { max: 1 })
    ));
    drop(held);
    assert!(keys.check(Some(&header("Bearer sk-fixed"))).is_ok());
    // One id per key (ids are 32 bits: two keys of 100,000 may share one).
    assert_eq!(keys.ids().len(), 100_002);
    // A key given twice counts once.
    keys.reload(["sk-a", "sk-a"]).unwrap();
    assert_eq!(keys.len(), 2);
}

#[test]
fn key_files_past_their_ceilings_are_refused() {
    let many: String = (0..=MAX_KEYS).map(|i| format!("k{i}\n")).collect();
    let err = parse_key_file(many.as_bytes()).unwrap_err();
    assert!(matches!(err, KeyError::TooMany { .. }), "{err}");
    let at_most: String = (0..MAX_KEYS).map(|i| format!("k{i}\n")).collect();
    assert_eq!(parse_key_file(at_most.as_bytes()).unwrap().len(), MAX_KEYS);
    assert!(matches!(
        ApiKeys::new((0..=MAX_KEYS).map(|i| format!("k{i}"))),
        Err(KeyError::TooMany { .. })
    ));
}

#[cfg(unix)]
#[test]
fn a_fifo_key_file_is_refused_not_waited_on() {
    let dir = std::env::temp_dir().join(format!("disagg-keys-fifo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("keys");
    let made = std::process::Command::new("mkfifo")
        .arg(&path)
        .status()
        .unwrap();
    assert!(made.success());
    // Without the file type check this read blocks until a writer opens the FIFO.
    let err = KeyFile::new(&path).read().unwrap_err();
    assert!(matches!(err, KeyError::Read { .. }), "{err}");
    let chain = disagg_core::error::error_chain(&err);
    assert!(chain.contains("FIFO"), "{chain}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A directory of its own for a test's key file.
fn key_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("disagg-keys-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Waits (at most 5 s) until `keys` refuses `key`; whether it did.
async fn refused_within(keys: &ApiKeys, key: &str) -> bool {
    let value = header(&format!("Bearer {key}"));
    for _ in 0..250 {
        if keys.check(Some(&value)).is_err() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

#[tokio::test]
async fn a_key_revoked_between_the_load_and_the_watch_is_revoked() {
    let dir = key_dir("revoked-at-start");
    let path = dir.join("keys");
    std::fs::write(&path, "sk-a\nsk-b\n").unwrap();
    let mut file = KeyFile::new(&path);
    file.poll_interval = Duration::from_millis(20);
    let keys = ApiKeys::new(Vec::<String>::new()).unwrap();
    keys.reload(file.read().unwrap()).unwrap();
    assert!(keys.check(Some(&header("Bearer sk-b"))).is_ok());
    // Revoked while the proxy was still starting (probing engines, discovery): the
    // watch starts after the edit, and the file does not change again.
    std::fs::write(&path, "sk-a\n").unwrap();
    let watch = tokio::spawn(keys.watch(file));
    assert!(refused_within(&keys, "sk-b").await, "sk-b still admitted");
    assert!(keys.check(Some(&header("Bearer sk-a"))).is_ok());
    assert_eq!(keys.stats().reloads, 1);
    watch.abort();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_watch_started_on_the_loaded_file_reloads_nothing() {
    let dir = key_dir("unchanged-at-start");
    let path = dir.join("keys");
    std::fs::write(&path, "sk-a\nsk-b\n").unwrap();
    let mut file = KeyFile::new(&path);
    file.poll_interval = Duration::from_millis(20);
    let keys = ApiKeys::new(Vec::<String>::new()).unwrap();
    keys.reload(file.read().unwrap()).unwrap();
    // The same keys, spelled differently (order, comment, spaces): nothing to apply.
    std::fs::write(&path, "# team\n sk-b \nsk-a\n").unwrap();
    let watch = tokio::spawn(keys.watch(file));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let s = keys.stats();
    assert_eq!((s.keys, s.reloads, s.file_errors), (2, 0, 0));
    // A later edit is applied as ever.
    std::fs::write(&path, "sk-a\n").unwrap();
    assert!(refused_within(&keys, "sk-b").await, "sk-b still admitted");
    assert_eq!(keys.stats().reloads, 1);
    watch.abort();
    std::fs::remove_dir_all(&dir).unwrap();
}
