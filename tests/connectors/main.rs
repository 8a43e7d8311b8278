//! The concurrent connectors end to end: SGLang bootstrap and vLLM Mooncake, through the
//! proxy over loopback sockets, against simulated engines that really meet by host,
//! port and room (SGLang) or bootstrap address, engine id and transfer id (Mooncake).

#[path = "../support/mod.rs"]
mod support;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use bytes::Bytes;
use disagg_core::Role;
use disagg_resilience::RetryPolicy;
use disagg_sim::{Faults, SimConfig, SimEngine};
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};
use support::*;
use tokio::io::AsyncReadExt;

const CONCURRENT: [Protocol; 2] = [Protocol::Sglang, Protocol::Mooncake];

/// Engines give up on a missing peer quickly in tests, so a broken handoff fails fast
/// instead of hanging for SGLang's 300 s.
fn engine() -> SimConfig {
    SimConfig {
        bootstrap_timeout: Duration::from_secs(5),
        ..SimConfig::default()
    }
}

fn faulty(faults: Faults) -> SimConfig {
    SimConfig { faults, ..engine() }
}

fn slow(delay: Duration) -> SimConfig {
    SimConfig {
        request_delay: delay,
        ..engine()
    }
}

async fn stack(protocol: Protocol, p: SimConfig, d: SimConfig) -> Stack {
    Stack::builder()
        .protocol(protocol)
        .prefill(vec![p])
        .decode(vec![d])
        .build()
        .await
}

/// What a plain engine (no disaggregation) answers to the same request.
async fn direct(path: &str, body: &str) -> Answer {
    let plain = SimEngine::start(SimConfig::default()).await.unwrap();
    let a = post(&plain.url(), path, body.to_owned(), &[]).await;
    plain.shutdown().await;
    a
}

/// The texts of every choice, streamed or not, by choice index.
fn choice_texts(a: &Answer) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut put = |i: usize, t: &str| {
        if out.len() <= i {
            out.resize(i + 1, String::new());
        }
        out[i].push_str(t);
    };
    let text_of = |c: &Value| -> String {
        c["delta"]["content"]
            .as_str()
            .or_else(|| c["message"]["content"].as_str())
            .or_else(|| c["text"].as_str())
            .unwrap_or_default()
            .to_owned()
    };
    if a.header("content-type")
        .is_some_and(|c| c.starts_with("text/event-stream"))
    {
        for e in a.events() {
            if e == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(&e).unwrap();
            assert!(v.get("error").is_none(), "in-band error: {v}");
            for c in v["choices"].as_array().into_iter().flatten() {
                put(c["index"].as_u64().unwrap() as usize, &text_of(c));
            }
        }
    } else {
        for c in a.json()["choices"].as_array().unwrap() {
            put(c["index"].as_u64().unwrap() as usize, &text_of(c));
        }
    }
    out
}

// === output equals a direct run ===

async fn outputs_equal_a_direct_run(protocol: Protocol) {
    let s = stack(protocol, engine(), engine()).await;
    let cases = [
        (
            "/v1/chat/completions",
            chat("the quick brown fox", 12, false),
        ),
        (
            "/v1/chat/completions",
            chat("the quick brown fox", 12, true),
        ),
        (
            "/v1/completions",
            completion("jumps over the lazy dog", 9, false),
        ),
        (
            "/v1/completions",
            completion("jumps over the lazy dog", 9, true),
        ),
    ];
    for (i, (path, body)) in cases.iter().enumerate() {
        let a = post(&s.url, path, body.clone(), &[]).await;
        assert_eq!(a.status, 200, "{protocol:?} {path}: {}", a.text());
        assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
        let want = direct(path, body).await;
        assert_eq!(a.content(), want.content(), "{protocol:?} {path} {body}");
        assert!(!a.content().is_empty());
        // The KV really came from the prefill: the decode computed no prompt itself.
        let (p, d) = (s.p().stats(), s.d().stats());
        assert_eq!(p.prefill_requests, i as u64 + 1, "{p:?}");
        assert_eq!(d.remote_decodes, i as u64 + 1, "{d:?}");
        assert_eq!(d.local_prefills, 0, "{d:?}");
    }
    assert!(eventually(Duration::from_secs(1), || s.in_flight() == 0).await);
    assert!(
        eventually(Duration::from_secs(1), || s
            .p()
            .stats()
            .kv_transfers_pending
            == 0)
        .await,
        "{:?}",
        s.p().stats()
    );
}

#[tokio::test]
async fn sglang_outputs_equal_a_direct_run() {
    outputs_equal_a_direct_run(Protocol::Sglang).await;
}

#[tokio::test]
async fn mooncake_outputs_equal_a_direct_run() {
    outputs_equal_a_direct_run(Protocol::Mooncake).await;
}

// === batches ===

#[tokio::test]
async fn sglang_batches_get_one_distinct_room_per_prompt_and_samples_are_refused() {
    let s = stack(Protocol::Sglang, engine(), engine()).await;
    // SGLang 0.5.23 gives a prompt's samples one bootstrap room inside the engine,
    // whatever rooms the request carries: n > 1 is refused before any engine is asked.
    let chat_n3 = json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "count the stars"}],
        "max_tokens": 6,
        "n": 3,
    })
    .to_string();
    let refused = post(&s.url, "/v1/chat/completions", chat_n3, &[]).await;
    assert_eq!(refused.status, 400, "{}", refused.text());
    assert_eq!(refused.json()["error"]["param"], "n");
    assert!(s.p().requests().is_empty() && s.d().requests().is_empty());
    let prompts2 = json!({
        "model": "sim-model",
        "prompt": ["alpha beta", "gamma delta epsilon"],
        "max_tokens": 5,
        "stream": true,
    })
    .to_string();
    for (path, body, n) in [("/v1/completions", &prompts2, 2)] {
        s.p().clear_requests();
        s.d().clear_requests();
        let a = post(&s.url, path, body.clone(), &[]).await;
        assert_eq!(a.status, 200, "{}", a.text());
        let want = direct(path, body).await;
        assert_eq!(choice_texts(&a), choice_texts(&want), "{body}");
        assert_eq!(choice_texts(&a).len(), n);

        let (p, d) = (&s.p().requests()[0], &s.d().requests()[0]);
        // The identical JSON went to both legs.
        assert_eq!(p.body, d.body);
        let rooms: Vec<u64> = p.body["bootstrap_room"]
            .as_array()
            .expect("an array of rooms")
            .iter()
            .map(|r| r.as_u64().unwrap())
            .collect();
        assert_eq!(rooms.len(), n);
        assert_eq!(rooms.iter().collect::<HashSet<_>>().len(), n, "{rooms:?}");
        assert!(rooms.iter().all(|r| *r < 1 << 63));
        let port = s.p().bootstrap_addr().unwrap().port();
        assert_eq!(p.body["bootstrap_port"], json!(vec![port; n]));
        assert_eq!(p.body["bootstrap_host"], json!(vec!["127.0.0.1"; n]));
    }
}

#[tokio::test]
async fn mooncake_n_greater_than_one_equals_a_direct_run() {
    let s = stack(Protocol::Mooncake, engine(), engine()).await;
    let body = json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "name three rivers"}],
        "max_tokens": 6,
        "n": 3,
        "stream": true,
    })
    .to_string();
    let a = post(&s.url, "/v1/chat/completions", body.clone(), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let want = direct("/v1/chat/completions", &body).await;
    assert_eq!(choice_texts(&a), choice_texts(&want));
    assert_eq!(choice_texts(&a).len(), 3);
    let (p, d) = (&s.p().requests()[0], &s.d().requests()[0]);
    let xfer = &p.body["kv_transfer_params"]["transfer_id"];
    assert!(xfer.as_str().is_some_and(|x| x.starts_with("xfer-")));
    assert_eq!(&d.body["kv_transfer_params"]["transfer_id"], xfer);
    assert_eq!(
        d.body["kv_transfer_params"]["remote_engine_id"],
        s.p().engine_id()
    );
    assert_eq!(
        d.body["kv_transfer_params"]["remote_bootstrap_addr"],
        format!("http://{}", s.p().bootstrap_addr().unwrap())
    );
}

// === fail fast ===

async fn prefill_failure_aborts_the_decode(protocol: Protocol) {
    for stream in [false, true] {
        let s = stack(
            protocol,
            faulty(Faults {
                status: Some(500),
                ..Faults::default()
            }),
            engine(),
        )
        .await;
        let started = Instant::now();
        let a = post(
            &s.url,
            "/v1/chat/completions",
            chat("doomed", 8, stream),
            &[],
        )
        .await;
        let took = started.elapsed();
        if a.status == 200 {
            // A streamed decode's head may come first (vLLM sends it before it tries its
            // KV load; SGLang's decode answers only after its bootstrap): relayed at
            // once, the stream then ends with the prefill's failure, no `[DONE]`.
            assert!(stream && protocol == Protocol::Mooncake, "{}", a.text());
            let events = a.events();
            let [only] = &events[..] else {
                panic!("{protocol:?}: one error event: {events:?}")
            };
            let error: serde_json::Value = serde_json::from_str(only).unwrap();
            assert_eq!(error["error"]["code"], "prefill_failed", "{only}");
        } else {
            assert_openai_error(&a, 502, "prefill_failed");
        }
        assert!(a.text().contains("500"), "{}", a.text());
        assert!(
            took < Duration::from_secs(1),
            "{protocol:?}: the error took {took:?}"
        );
        // The decode leg was waiting for a KV that will never come: it is gone.
        assert!(
            eventually(Duration::from_secs(1), || s.d().stats().cancelled == 1).await,
            "{protocol:?}: {:?}",
            s.d().stats()
        );
        assert_eq!(s.d().stats().active_requests, 0);
        assert!(eventually(Duration::from_secs(1), || s.in_flight() == 0).await);
    }
}

#[tokio::test]
async fn sglang_prefill_failure_aborts_the_decode() {
    prefill_failure_aborts_the_decode(Protocol::Sglang).await;
}

/// vLLM Mooncake, streamed: the decode's 200 head comes at once (vLLM sends it before
/// its KV load), and its first token only once the prefill (800 ms) handed the KV over.
/// That wait is the prefill's, within its own budget: a decode idle limit shorter than
/// the prefill (300 ms) does not cut the stream.
#[tokio::test]
async fn a_streamed_decode_waiting_for_a_slow_concurrent_prefill_is_not_idle() {
    let s = Stack::builder()
        .protocol(Protocol::Mooncake)
        .prefill(vec![slow(Duration::from_millis(800))])
        .decode(vec![engine()])
        .config(|c| c.decode_idle_timeout = Some(Duration::from_millis(300)))
        .build()
        .await;
    let a = post(&s.url, "/v1/chat/completions", chat("hello", 4, true), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let events = a.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    assert!(!a.text().contains("decode_idle_timeout"), "{}", a.text());
    assert!(!a.content().is_empty(), "{}", a.text());
    assert!(eventually(Duration::from_secs(1), || s.in_flight() == 0).await);
}

#[tokio::test]
async fn mooncake_prefill_failure_aborts_the_decode() {
    prefill_failure_aborts_the_decode(Protocol::Mooncake).await;
}

async fn decode_failure_aborts_the_prefill(protocol: Protocol) {
    // The prefill is still busy (SGLang: waiting for the decode to take its KV; Mooncake:
    // computing) when the decode fails.
    let p = SimConfig {
        request_delay: Duration::from_millis(300),
        ..engine()
    };
    let s = stack(
        protocol,
        p,
        faulty(Faults {
            status: Some(503),
            ..Faults::default()
        }),
    )
    .await;
    let started = Instant::now();
    let a = post(
        &s.url,
        "/v1/completions",
        completion("doomed too", 8, false),
        &[],
    )
    .await;
    assert_eq!(a.status, 503, "{}", a.text());
    assert_eq!(a.header("x-disagg-failed-leg"), Some("decode"));
    assert!(started.elapsed() < Duration::from_secs(1));
    assert!(
        eventually(Duration::from_secs(1), || s.p().stats().cancelled == 1).await,
        "{protocol:?}: {:?}",
        s.p().stats()
    );
    assert!(
        eventually(Duration::from_secs(1), || {
            let st = s.p().stats();
            st.active_requests == 0 && st.kv_transfers_pending == 0
        })
        .await
    );
    assert!(eventually(Duration::from_secs(1), || s.in_flight() == 0).await);
}

#[tokio::test]
async fn sglang_decode_failure_aborts_the_prefill() {
    decode_failure_aborts_the_prefill(Protocol::Sglang).await;
}

#[tokio::test]
async fn mooncake_decode_failure_aborts_the_prefill() {
    decode_failure_aborts_the_prefill(Protocol::Mooncake).await;
}

async fn client_disconnect_aborts_both_legs(protocol: Protocol) {
    // A slow prefill: both legs are in flight (the decode waits for the KV) when the
    // client hangs up.
    let s = stack(protocol, slow(Duration::from_secs(3)), engine()).await;
    let sock = raw_request(&s.url, "/v1/chat/completions", &chat("bye", 8, true)).await;
    assert!(
        eventually(Duration::from_secs(2), || {
            s.p().stats().active_requests == 1 && s.d().stats().active_requests == 1
        })
        .await,
        "both legs start"
    );
    let hung_up = Instant::now();
    drop(sock);
    assert!(
        eventually(Duration::from_secs(1), || {
            s.p().stats().cancelled == 1 && s.d().stats().cancelled == 1
        })
        .await,
        "{protocol:?}: p {:?} d {:?}",
        s.p().stats(),
        s.d().stats()
    );
    assert!(hung_up.elapsed() < Duration::from_secs(1));
    assert!(eventually(Duration::from_secs(1), || s.in_flight() == 0).await);
    assert!(
        eventually(Duration::from_secs(1), || s
            .p()
            .stats()
            .kv_transfers_pending
            == 0)
        .await
    );
}

#[tokio::test]
async fn sglang_client_disconnect_aborts_both_legs() {
    client_disconnect_aborts_both_legs(Protocol::Sglang).await;
}

#[tokio::test]
async fn mooncake_client_disconnect_aborts_both_legs() {
    client_disconnect_aborts_both_legs(Protocol::Mooncake).await;
}

#[tokio::test]
async fn sglang_client_disconnect_mid_stream_aborts_both_legs() {
    // Mid-stream: the decode streams slowly, the prefill (waiting for nothing more) is
    // done or about to be.
    let d = SimConfig {
        inter_token_delay: Duration::from_millis(100),
        ..engine()
    };
    let s = stack(Protocol::Sglang, engine(), d).await;
    let mut sock = raw_request(
        &s.url,
        "/v1/chat/completions",
        &chat("long story", 64, true),
    )
    .await;
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), sock.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    drop(sock);
    assert!(
        eventually(Duration::from_secs(1), || s.d().stats().cancelled == 1).await,
        "{:?}",
        s.d().stats()
    );
    assert!(eventually(Duration::from_secs(1), || s.in_flight() == 0).await);
    assert_eq!(s.p().stats().active_requests, 0);
}

// === concurrent dispatch really overlaps ===

/// Time to the first content token of a streamed answer.
async fn ttft(base: &str, path: &str, body: String) -> Duration {
    let req = http::Request::post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let started = Instant::now();
    let resp = client().request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut seen = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            seen.extend_from_slice(&data);
            if sse_payloads(&seen)
                .iter()
                .any(|e| e.contains("\"content\":\"") && !e.contains("\"content\":\"\""))
            {
                return started.elapsed();
            }
        }
    }
    panic!("no token: {}", String::from_utf8_lossy(&seen));
}

/// The same request sent straight to both engines at once, as a router would, with the
/// handoff fields written by hand; the time to the decode's first token.
async fn ttft_engines_alone(protocol: Protocol, p: &SimEngine, d: &SimEngine, n: u64) -> Duration {
    let mut body: Value = serde_json::from_str(&chat("overlap please", 8, true)).unwrap();
    let (p_body, d_body) = match protocol {
        Protocol::Sglang => {
            body["bootstrap_host"] = json!("127.0.0.1");
            body["bootstrap_port"] = json!(p.bootstrap_addr().unwrap().port());
            body["bootstrap_room"] = json!(1000 + n);
            (body.clone(), body)
        }
        _ => {
            let xfer = format!("xfer-direct-{n}");
            let mut pb = body.clone();
            pb["stream"] = json!(false);
            pb["max_tokens"] = json!(1);
            pb["kv_transfer_params"] =
                json!({"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": xfer});
            let mut db = body;
            db["kv_transfer_params"] = json!({
                "do_remote_prefill": true,
                "do_remote_decode": false,
                "remote_bootstrap_addr": format!("http://{}", p.bootstrap_addr().unwrap()),
                "remote_engine_id": p.engine_id(),
                "transfer_id": xfer,
            });
            (pb, db)
        }
    };
    let p_url = p.url();
    let prefill =
        tokio::spawn(
            async move { post(&p_url, "/v1/chat/completions", p_body.to_string(), &[]).await },
        );
    let t = ttft(&d.url(), "/v1/chat/completions", d_body.to_string()).await;
    assert_eq!(prefill.await.unwrap().status, 200);
    t
}

async fn concurrent_dispatch_overlaps(protocol: Protocol) {
    // A 200 ms prefill, and a decode that spends 150 ms of its own before it asks for
    // the KV. Overlapped: first token after about 200 ms; one after the other: 350 ms.
    // Medians of 5, so that a run slowed by a loaded machine does not decide.
    let p = slow(Duration::from_millis(200));
    let d = slow(Duration::from_millis(150));
    let s = stack(protocol, p, d).await;
    let mut alone = Vec::new();
    let mut proxied = Vec::new();
    for n in 0..5 {
        alone.push(ttft_engines_alone(protocol, s.p(), s.d(), n).await);
        proxied.push(
            ttft(
                &s.url,
                "/v1/chat/completions",
                chat("overlap please", 8, true),
            )
            .await,
        );
    }
    alone.sort();
    proxied.sort();
    let (alone, proxied) = (alone[2], proxied[2]);
    assert!(
        alone >= Duration::from_millis(200) && alone < Duration::from_millis(340),
        "{protocol:?}: the engines alone took {alone:?}"
    );
    // The proxy's hop costs a few ms; legs one after the other would cost the decode's
    // 150 ms more.
    assert!(
        proxied < alone + Duration::from_millis(100),
        "{protocol:?}: through the proxy {proxied:?}, engines alone {alone:?}"
    );
}

#[tokio::test]
async fn sglang_concurrent_dispatch_overlaps_the_legs() {
    concurrent_dispatch_overlaps(Protocol::Sglang).await;
}

#[tokio::test]
async fn mooncake_concurrent_dispatch_overlaps_the_legs() {
    concurrent_dispatch_overlaps(Protocol::Mooncake).await;
}

// === retries ===

/// Puts attempt k on prefill `(len - 1 + k) % len`: the first attempt on the last
/// prefill (the dead one the stack appends), the retry on the first.
struct DeadFirst(std::sync::atomic::AtomicUsize);

impl disagg_core::Router for DeadFirst {
    fn select(
        &self,
        _req: &disagg_core::router::RequestView<'_>,
        set: &disagg_core::endpoint::EndpointSet,
    ) -> Result<disagg_core::router::Route, disagg_core::error::RouteError> {
        let k = self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ps = set.by_role(Role::Prefill);
        Ok(disagg_core::router::Route::new(
            Some(ps[(ps.len() - 1 + k) % ps.len()].clone()),
            set.by_role(Role::Decode)[0].clone(),
        ))
    }
}

#[tokio::test]
async fn a_retry_picks_a_new_pair_and_a_new_room() {
    for protocol in CONCURRENT {
        // The first attempt goes to an overloaded prefill (503) after both legs were
        // sent; a 503 is retryable, and the retry goes to the healthy prefill.
        let hanging = faulty(Faults {
            status: Some(503),
            ..Faults::default()
        });
        let s = Stack::builder()
            .protocol(protocol)
            .prefill(vec![engine(), hanging])
            .decode(vec![engine()])
            .router(DeadFirst(Default::default()))
            .retry(RetryPolicy::retries(1))
            .config(|c| c.prefill_timeout = Duration::from_millis(300))
            .build()
            .await;
        let body = completion("second time lucky", 6, false);
        let a = post(&s.url, "/v1/completions", body.clone(), &[]).await;
        assert_eq!(a.status, 200, "{protocol:?}: {}", a.text());
        assert_eq!(
            a.content(),
            direct("/v1/completions", &body).await.content()
        );
        let (healthy, stuck) = (&s.prefill[0], &s.prefill[1]);
        assert_eq!(healthy.stats().prefill_requests, 1);
        assert_eq!(stuck.stats().requests, 1);
        // Both attempts reached the decode, the first dropped when its prefill failed;
        // each carried its own room or transfer id and its own prefill's address.
        assert!(eventually(Duration::from_secs(1), || s.d().stats().cancelled == 1).await);
        let d = s.d().requests();
        assert_eq!(d.len(), 2, "{protocol:?}");
        let (first, retry) = (&d[0].body, &d[1].body);
        match protocol {
            Protocol::Sglang => {
                assert_ne!(first["bootstrap_room"], retry["bootstrap_room"]);
                assert_eq!(
                    first["bootstrap_port"],
                    stuck.bootstrap_addr().unwrap().port()
                );
                assert_eq!(
                    retry["bootstrap_port"],
                    healthy.bootstrap_addr().unwrap().port()
                );
            }
            _ => {
                let (f, r) = (&first["kv_transfer_params"], &retry["kv_transfer_params"]);
                assert_ne!(f["transfer_id"], r["transfer_id"]);
                assert_eq!(f["remote_engine_id"], stuck.engine_id());
                assert_eq!(r["remote_engine_id"], healthy.engine_id());
            }
        }
        assert!(eventually(Duration::from_secs(1), || s.in_flight() == 0).await);
    }
}

#[tokio::test]
async fn a_retry_passes_over_an_unreachable_prefill() {
    for protocol in CONCURRENT {
        let (dead, _held) = held_dead_url();
        let s = Stack::builder()
            .protocol(protocol)
            .prefill(vec![engine()])
            .decode(vec![engine()])
            .dead_prefill(dead)
            .router(DeadFirst(Default::default()))
            .retry(RetryPolicy::retries(1))
            .build()
            .await;
        let a = post(
            &s.url,
            "/v1/completions",
            completion("knock knock", 6, false),
            &[],
        )
        .await;
        assert_eq!(a.status, 200, "{protocol:?}: {}", a.text());
        assert_eq!(s.p().stats().prefill_requests, 1);
        assert!(eventually(Duration::from_secs(1), || s.in_flight() == 0).await);
    }
}

#[tokio::test]
async fn without_retries_an_unreachable_prefill_is_502() {
    for protocol in CONCURRENT {
        let (dead, _held) = held_dead_url();
        let s = Stack::builder()
            .protocol(protocol)
            .prefill(vec![])
            .decode(vec![engine()])
            .dead_prefill(dead)
            .build()
            .await;
        let a = post(
            &s.url,
            "/v1/completions",
            completion("nobody home", 6, false),
            &[],
        )
        .await;
        assert_openai_error(&a, 502, "prefill_failed");
        assert!(eventually(Duration::from_secs(1), || s.in_flight() == 0).await);
        assert!(
            eventually(Duration::from_secs(1), || s.d().stats().active_requests
                == 0)
            .await
        );
    }
}
