//! Deadlines, retries and their budget, the prefill-failure policy, admission, early KV
//! release and `/metrics`, over real sockets against simulated engines. Each test also
//! checks that nothing outlives its request: endpoint in-flight counts, the
//! orchestrator's in-flight gauge, and running releases all return to zero.

#[path = "../support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use disagg_core::orchestrator::{KvRelease, PrefillFailure};
use disagg_resilience::AdmissionConfig;
use disagg_resilience::RetryPolicy;
use disagg_sim::{Faults, SimConfig};
use support::*;

fn faulty(faults: Faults) -> SimConfig {
    SimConfig {
        faults,
        ..Default::default()
    }
}

fn delayed(ms: u64) -> SimConfig {
    SimConfig {
        request_delay: Duration::from_millis(ms),
        ..Default::default()
    }
}

/// Nothing of any request is left: no endpoint in-flight count, no admitted request,
/// no release running.
async fn assert_settled(s: &Stack) {
    let settled = eventually(Duration::from_secs(3), || {
        let st = s.orchestrator.stats();
        s.in_flight() == 0
            && st.in_flight == 0
            && st.queued_now == 0
            && st.kv_releases_in_flight == 0
    })
    .await;
    assert!(
        settled,
        "left over: {} in flight, {:?}",
        s.in_flight(),
        s.orchestrator.stats()
    );
}

#[tokio::test]
async fn the_deadline_cuts_a_slow_prefill_with_deadline_exceeded() {
    let s = Stack::builder()
        .prefill(vec![delayed(3000)])
        .config(|c| c.deadline = Some(Duration::from_millis(300)))
        .build()
        .await;
    let start = Instant::now();
    let a = post(&s.url, "/v1/completions", completion("slow", 4, false), &[]).await;
    let took = start.elapsed();
    assert_openai_error(&a, 504, "deadline_exceeded");
    assert!(
        took >= Duration::from_millis(290) && took < Duration::from_millis(1500),
        "{took:?}"
    );
    // The prefill was abandoned, no decode leg was sent.
    assert!(eventually(Duration::from_secs(1), || s.p().stats().cancelled == 1).await);
    assert_eq!(s.d().stats().requests, 0);
    assert_eq!(s.orchestrator.stats().deadlines_exceeded, 1);
    assert_settled(&s).await;
}

#[tokio::test]
async fn a_client_may_shorten_its_deadline_only_when_allowed() {
    let header = [("x-disagg-deadline-ms", "150")];
    let allowed = Stack::builder()
        .prefill(vec![delayed(600)])
        .config(|c| c.client_deadline = true)
        .build()
        .await;
    let start = Instant::now();
    let a = post(
        &allowed.url,
        "/v1/completions",
        completion("x", 2, false),
        &header,
    )
    .await;
    assert_openai_error(&a, 504, "deadline_exceeded");
    assert!(
        start.elapsed() < Duration::from_millis(550),
        "{:?}",
        start.elapsed()
    );

    // Not allowed: the header is ignored and the request is served.
    let ignored = Stack::builder().prefill(vec![delayed(300)]).build().await;
    let a = post(
        &ignored.url,
        "/v1/completions",
        completion("x", 2, false),
        &header,
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());

    // A client cannot extend the configured deadline.
    let capped = Stack::builder()
        .prefill(vec![delayed(600)])
        .config(|c| {
            c.client_deadline = true;
            c.deadline = Some(Duration::from_millis(150));
        })
        .build()
        .await;
    let long = [("x-disagg-deadline-ms", "60000")];
    let a = post(
        &capped.url,
        "/v1/completions",
        completion("x", 2, false),
        &long,
    )
    .await;
    assert_openai_error(&a, 504, "deadline_exceeded");
}

#[tokio::test]
async fn a_stalled_stream_ends_with_a_decode_idle_timeout_event() {
    let s = Stack::builder()
        .decode(vec![faulty(Faults {
            stall_after_chunks: Some(2),
            ..Faults::default()
        })])
        .config(|c| c.decode_idle_timeout = Some(Duration::from_millis(300)))
        .build()
        .await;
    let start = Instant::now();
    let a = post(&s.url, "/v1/chat/completions", chat("stall", 20, true), &[]).await;
    let took = start.elapsed();
    assert_eq!(a.status, 200);
    let events = a.events();
    let last = events.last().expect("events");
    let err: serde_json::Value = serde_json::from_str(last).unwrap();
    assert_eq!(err["error"]["code"], "decode_idle_timeout", "{events:?}");
    assert!(
        events.len() >= 3,
        "the chunks before the stall reached the client: {events:?}"
    );
    assert!(!events.iter().any(|e| e == "[DONE]"));
    assert!(
        took >= Duration::from_millis(290) && took < Duration::from_secs(2),
        "{took:?}"
    );
    // The stalled decode request was dropped.
    assert!(eventually(Duration::from_secs(1), || s.d().stats().cancelled == 1).await);
    assert_settled(&s).await;
}

#[tokio::test]
async fn the_deadline_ends_a_long_stream_with_an_error_event() {
    let s = Stack::builder()
        .decode(vec![SimConfig {
            inter_token_delay: Duration::from_millis(40),
            ..Default::default()
        }])
        .config(|c| c.deadline = Some(Duration::from_millis(500)))
        .build()
        .await;
    let start = Instant::now();
    let a = post(
        &s.url,
        "/v1/completions",
        completion("long", 200, true),
        &[],
    )
    .await;
    let took = start.elapsed();
    let events = a.events();
    let err: serde_json::Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(err["error"]["code"], "deadline_exceeded", "{events:?}");
    assert!(events.len() > 3, "{events:?}");
    assert!(took < Duration::from_millis(1500), "{took:?}");
    assert!(eventually(Duration::from_secs(1), || s.d().stats().cancelled == 1).await);
    assert_eq!(
        s.orchestrator.stats().deadlines_exceeded,
        0,
        "counted only for failed heads"
    );
    assert_settled(&s).await;
}

#[tokio::test]
async fn a_503_prefill_is_retried_on_another_endpoint() {
    let s = Stack::builder()
        .prefill(vec![
            faulty(Faults {
                status: Some(503),
                ..Faults::default()
            }),
            SimConfig::default(),
        ])
        .retry(RetryPolicy::retries(1))
        .build()
        .await;
    let body = completion("retry me", 5, false);
    let a = post(&s.url, "/v1/completions", body.clone(), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
    assert_eq!(s.prefill[0].stats().requests, 1);
    assert_eq!(s.prefill[1].stats().prefill_requests, 1);
    assert_eq!(s.orchestrator.stats().retries, 1);
    // A 500 is the engine failing on the request itself: not retried.
    s.prefill[1].set_faults(Faults {
        status: Some(500),
        ..Faults::default()
    });
    s.prefill[0].set_faults(Faults {
        status: Some(500),
        ..Faults::default()
    });
    let a = post(&s.url, "/v1/completions", body, &[]).await;
    assert_openai_error(&a, 502, "prefill_failed");
    assert_eq!(s.orchestrator.stats().retries, 1);
    assert_settled(&s).await;
}

#[tokio::test]
async fn the_retry_budget_stops_a_retry_storm() {
    let down = || {
        faulty(Faults {
            status: Some(503),
            ..Faults::default()
        })
    };
    let s = Stack::builder()
        .prefill(vec![down(), down()])
        .retry({
            let mut retry = RetryPolicy::retries(1);
            retry.budget_ratio = 0.0;
            retry.budget_reserve = 3;
            retry.backoff_base = Duration::from_millis(1);
            retry
        })
        .build()
        .await;
    for _ in 0..10 {
        let a = post(
            &s.url,
            "/v1/completions",
            completion("storm", 2, false),
            &[],
        )
        .await;
        assert_openai_error(&a, 502, "prefill_failed");
    }
    let st = s.orchestrator.stats();
    assert_eq!((st.retries, st.retries_denied), (3, 7), "{st:?}");
    let sent: u64 = s.prefill.iter().map(|p| p.stats().requests).sum();
    assert_eq!(
        sent, 13,
        "ten requests and three retries reached the prefills"
    );
    assert_settled(&s).await;
}

#[tokio::test]
async fn a_failed_prefill_is_fatal_by_default_and_served_decode_only_when_configured() {
    let broken = || {
        faulty(Faults {
            status: Some(500),
            ..Faults::default()
        })
    };
    let body = completion("fall back", 6, false);
    let strict = Stack::builder().prefill(vec![broken()]).build().await;
    let a = post(&strict.url, "/v1/completions", body.clone(), &[]).await;
    assert_openai_error(&a, 502, "prefill_failed");
    assert_eq!(
        strict.d().stats().requests,
        0,
        "never a half-dispatched request"
    );
    assert_eq!(strict.orchestrator.stats().prefill_fallbacks, 0);

    let lenient = Stack::builder()
        .prefill(vec![broken()])
        .config(|c| c.prefill_failure = PrefillFailure::DecodeOnly)
        .build()
        .await;
    let a = post(&lenient.url, "/v1/completions", body.clone(), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.header("x-disagg-handoff"), Some("decode-only"));
    assert_eq!(a.header("x-disagg-fallback"), Some("prefill_failed"));
    assert_eq!(lenient.orchestrator.stats().prefill_fallbacks, 1);
    let d = lenient.d().stats();
    assert_eq!((d.requests, d.local_prefills, d.remote_decodes), (1, 1, 0));
    assert_eq!(a.content(), direct(&lenient, &body).await);
    assert_settled(&lenient).await;
}

/// The answer of the stack's decode engine to `body` sent straight to it.
async fn direct(s: &Stack, body: &str) -> String {
    post(&s.d().url(), "/v1/completions", body.to_owned(), &[])
        .await
        .content()
}

#[tokio::test]
async fn a_full_queue_is_429_with_retry_after_and_a_long_wait_is_503() {
    let s = Stack::builder()
        .decode(vec![SimConfig {
            inter_token_delay: Duration::from_millis(50),
            ..Default::default()
        }])
        .admission({
            let mut a = AdmissionConfig::default();
            a.max_in_flight = Some(1);
            a.max_queue = 1;
            a.queue_timeout = Duration::from_millis(300);
            a
        })
        .build()
        .await;
    let url = s.url.clone();
    // One request streams for about a second and holds the only place.
    let first = tokio::spawn(async move {
        post(&url, "/v1/completions", completion("long", 20, true), &[]).await
    });
    assert!(
        eventually(Duration::from_secs(2), || s.orchestrator.stats().in_flight
            == 1)
        .await
    );
    let url = s.url.clone();
    let queued = tokio::spawn(async move {
        let start = Instant::now();
        let a = post(&url, "/v1/completions", completion("waits", 2, false), &[]).await;
        (a, start.elapsed())
    });
    assert!(
        eventually(Duration::from_secs(1), || s.orchestrator.stats().queued_now
            == 1)
        .await
    );
    let refused = post(
        &s.url,
        "/v1/completions",
        completion("refused", 2, false),
        &[],
    )
    .await;
    assert_openai_error(&refused, 429, "queue_full");
    assert_eq!(refused.header("retry-after"), Some("1"));

    let (waited, took) = queued.await.unwrap();
    assert_openai_error(&waited, 503, "queue_timeout");
    assert!(
        took >= Duration::from_millis(290) && took < Duration::from_secs(1),
        "{took:?}"
    );
    let first = first.await.unwrap();
    assert_eq!(first.status, 200);
    assert!(first.events().iter().any(|e| e == "[DONE]"));
    let st = s.orchestrator.stats();
    assert_eq!(
        (st.rejected_queue_full, st.queue_timeouts),
        (1, 1),
        "{st:?}"
    );
    // Neither refused request reached an engine.
    assert_eq!(s.p().stats().requests, 1);
    assert_settled(&s).await;
}

#[tokio::test]
async fn a_queued_request_is_admitted_when_a_stream_ends() {
    let s = Stack::builder()
        .decode(vec![SimConfig {
            inter_token_delay: Duration::from_millis(20),
            ..Default::default()
        }])
        .per_endpoint(1)
        .build()
        .await;
    let mut tasks = Vec::new();
    for i in 0..3 {
        let url = s.url.clone();
        tasks.push(tokio::spawn(async move {
            post(
                &url,
                "/v1/completions",
                completion(&format!("q{i}"), 10, true),
                &[],
            )
            .await
        }));
    }
    for t in tasks {
        let a = t.await.unwrap();
        assert_eq!(a.status, 200, "{}", a.text());
        assert!(a.events().iter().any(|e| e == "[DONE]"));
    }
    let st = s.orchestrator.stats();
    assert!(
        st.queued >= 2,
        "the decode endpoint took one stream at a time: {st:?}"
    );
    assert_settled(&s).await;
}

/// A NIXL stack whose decode engine queues each request for `delay_ms` and does not
/// free the prefill's blocks when a request is aborted (as older engines do).
async fn forgetful_decode(release: KvRelease, delay_ms: u64) -> Stack {
    Stack::builder()
        .decode(vec![SimConfig {
            request_delay: Duration::from_millis(delay_ms),
            release_on_abort: false,
            ..Default::default()
        }])
        .config(|c| c.kv_release = release)
        .build()
        .await
}

/// Send a request and hang up once the decode engine holds it (queued).
async fn leave_while_the_decode_is_queued(s: &Stack) {
    let sock = raw_request(&s.url, "/v1/completions", &completion("bye", 8, false)).await;
    let d = s.d();
    assert!(eventually(Duration::from_secs(2), || d.stats().active_requests == 1).await);
    assert_eq!(
        s.p().stats().blocks_held,
        1,
        "the prefill holds the prompt's KV"
    );
    drop(sock);
}

#[tokio::test]
async fn early_release_frees_the_prefills_blocks_when_the_client_leaves() {
    let s = forgetful_decode(KvRelease::abort_decode(), 300).await;
    leave_while_the_decode_is_queued(&s).await;
    let p = s.p();
    assert!(
        eventually(Duration::from_secs(2), || p.stats().blocks_held == 0).await,
        "released well before the 30 s lease: {:?}",
        p.stats()
    );
    assert_eq!(s.orchestrator.stats().kv_releases, 1);
    assert_eq!(
        p.stats().side_channel_served,
        1,
        "the release pulled the KV"
    );
    assert_settled(&s).await;
    assert!(
        eventually(Duration::from_secs(1), || s.d().stats().active_requests
            == 0)
        .await
    );
}

#[tokio::test]
async fn without_early_release_an_engine_that_forgets_strands_the_blocks() {
    // The control for the test above: same engines, release off.
    let s = forgetful_decode(KvRelease::Off, 300).await;
    leave_while_the_decode_is_queued(&s).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(s.p().stats().blocks_held, 1, "held until the lease");
    assert_eq!(s.orchestrator.stats().kv_releases, 0);
    assert_settled(&s).await;
}

#[tokio::test]
async fn early_release_sends_nothing_for_a_request_that_completed() {
    let s = forgetful_decode(KvRelease::abort_decode(), 0).await;
    for stream in [false, true] {
        let a = post(
            &s.url,
            "/v1/completions",
            completion("done", 4, stream),
            &[],
        )
        .await;
        assert_eq!(a.status, 200);
    }
    assert_settled(&s).await;
    assert_eq!(s.orchestrator.stats().kv_releases, 0);
    assert_eq!(s.d().stats().requests, 2);
    assert_eq!(s.p().stats().blocks_held, 0);
}

#[tokio::test]
async fn metrics_are_served_in_the_prometheus_text_format() {
    let s = Stack::start().await;
    let a = post(
        &s.url,
        "/v1/completions",
        completion("count me", 2, false),
        &[],
    )
    .await;
    assert_eq!(a.status, 200);
    let m = get(&s.url, "/metrics").await;
    assert_eq!(m.status, 200);
    assert!(m.header("content-type").unwrap().starts_with("text/plain"));
    let text = m.text();
    let value = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing in\n{text}"))
    };
    assert_eq!(value("disagg_requests_total{route=\"orchestrated\"}"), 1);
    assert_eq!(value("disagg_requests_in_flight"), 0);
    assert_eq!(value("disagg_retries_total"), 0);
    assert!(text.contains("# TYPE disagg_prefill_fallbacks_total counter"));
    let decode = format!(
        "disagg_endpoint_in_flight{{role=\"decode\",endpoint=\"{}\"}} 0",
        s.d().url()
    );
    assert!(text.contains(&decode), "{text}");
}
