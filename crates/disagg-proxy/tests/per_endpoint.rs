//! `disagg-proxy serve --max-in-flight-per-endpoint`: the per-endpoint limit, a router
//! decorator (`disagg_resilience::PerEndpointLimit`) since issue #31, still holds a
//! request whose decode endpoint is at its limit until the running stream ends, through
//! the real binary; the same scenario without the flag is the control.

#![allow(missing_docs)] // a test binary

use std::time::{Duration, Instant};

use disagg_sim::{SimConfig, SimEngine};

mod common;
use common::{Proxy, completion, eventually, post};

const COMPLETIONS: &str = "/v1/completions";

async fn engine(config: SimConfig) -> SimEngine {
    SimEngine::start(config)
        .await
        .expect("start a simulated engine")
}

/// A short request sent while a stream runs on the only decode engine: its status,
/// whether it was answered before the stream ended, and the proxy's queued count.
async fn second_request_during_a_stream(extra: &[&str]) -> (u16, bool, u64) {
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
    assert_eq!(short.status, 200, "{}", short.text());
    assert_eq!(short.header("x-disagg-handoff"), Some("kv"));
    let queued = proxy.metric("disagg_queued_total").await;
    (short.status.as_u16(), answered < ended, queued)
}

#[tokio::test]
async fn a_full_decode_endpoint_holds_the_next_request_until_its_stream_ends() {
    let (status, before_end, queued) =
        second_request_during_a_stream(&["--max-in-flight-per-endpoint", "1"]).await;
    assert_eq!(status, 200);
    assert!(
        !before_end,
        "routed to the decode while it was at its limit"
    );
    assert_eq!(queued, 1, "it waited in the admission's queue");
    // The control: without the limit it is served alongside the stream.
    let (status, before_end, queued) = second_request_during_a_stream(&[]).await;
    assert_eq!(status, 200);
    assert!(
        before_end,
        "without a limit the short request did not overtake"
    );
    assert_eq!(queued, 0);
}
