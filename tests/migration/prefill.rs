//! A disaggregated request's continuation goes through a fresh prefill leg and its
//! handoff, whose prefix cache holds the original prompt; decode-only when the policy
//! says so.

use serde_json::json;

use super::*;

/// One prefill with a prefix cache, decodes that die after `chunks` events, migration
/// allowed once, continuations decode-only when `decode_only`.
async fn pd_stack(chunks: usize, decode_only: bool) -> Stack {
    Stack::builder()
        .prefill(vec![SimConfig {
            prefix_cache_blocks: 256,
            ..SimConfig::default()
        }])
        .decode(vec![dying(chunks), dying(chunks)])
        .config(|c| {
            c.migration.limit = 1;
            c.migration.decode_only = decode_only;
        })
        .build()
        .await
}

/// A prompt of several blocks of the simulator's 16 tokens.
/// The continuation legs the decodes got (the first legs are chat requests).
fn continuation_legs(s: &Stack) -> Vec<disagg_sim::RecordedRequest> {
    s.decode
        .iter()
        .flat_map(|d| d.requests())
        .filter(|r| r.path == "/v1/completions")
        .collect()
}

fn long_prompt() -> String {
    "the quick brown fox jumps over the lazy dog and keeps running far away ".repeat(8)
}

#[tokio::test]
async fn a_disaggregated_stream_is_continued_through_a_fresh_prefill_that_hits_its_cache() {
    let s = pd_stack(6, false).await;
    let body = chat_body(
        &long_prompt(),
        8,
        json!({"stream_options": {"include_usage": true}}),
    );
    let a = post(&s.url, "/v1/chat/completions", body.clone(), &[]).await;
    assert_eq!(a.status, 200);
    assert_one_answer(&a, true);
    let want = unbroken("/v1/chat/completions", &body).await;
    assert_eq!(a.content(), want.content());
    let prompt_tokens = events(&want)
        .into_iter()
        .find_map(|e| e["usage"]["prompt_tokens"].as_u64())
        .expect("usage");
    assert!(prompt_tokens >= 64, "{prompt_tokens} prompt tokens");

    // The prefill served the request and its continuation: a token prompt of the
    // original prompt's ids and the 5 generated, of which the cache held the original
    // prompt's full blocks.
    let p = s.p().stats();
    assert_eq!(p.requests, 2);
    let block = 16;
    assert!(
        p.prefix_cache_hit_tokens >= prompt_tokens / block * block - block,
        "hit {} of a {prompt_tokens}-token prompt: {p:?}",
        p.prefix_cache_hit_tokens
    );
    assert!(p.prefix_cache_hit_tokens <= prompt_tokens + 5);
    let continuation = s.p().requests().last().cloned().unwrap();
    assert_eq!(continuation.path, "/v1/completions");
    let ids = continuation.body["prompt"]
        .as_array()
        .expect("a token prompt");
    assert_eq!(ids.len() as u64, prompt_tokens + 5);

    // The continuation's decode got the prefill's handoff.
    let legs = continuation_legs(&s);
    assert_eq!(legs.len(), 1, "{legs:?}");
    assert!(
        legs[0].body["kv_transfer_params"].is_object(),
        "{:?}",
        legs[0].body
    );
    let usage = events(&a)
        .into_iter()
        .find_map(|e| e.get("usage").filter(|u| !u.is_null()).cloned())
        .unwrap();
    assert_eq!(usage["prompt_tokens"], prompt_tokens);
    assert_eq!(usage["completion_tokens"], 8);
}

#[tokio::test]
async fn the_decode_only_policy_continues_without_a_prefill() {
    let s = pd_stack(6, true).await;
    let body = chat_body(&long_prompt(), 8, json!({}));
    let a = post(&s.url, "/v1/chat/completions", body.clone(), &[]).await;
    assert_one_answer(&a, true);
    let want = unbroken("/v1/chat/completions", &body).await;
    assert_eq!(a.content(), want.content());
    assert_eq!(s.p().stats().requests, 1);
    let legs = continuation_legs(&s);
    assert_eq!(legs.len(), 1);
    assert!(
        legs[0]
            .body
            .get("kv_transfer_params")
            .is_none_or(|v| v.is_null())
    );
}

/// Serves every request on a decode alone.
struct Direct;

impl disagg_core::policy::Disaggregate for Direct {
    fn decide(&self, _: &disagg_core::router::RequestView<'_>) -> disagg_core::policy::Decision {
        disagg_core::policy::Decision::Direct { reason: "test" }
    }
}

#[tokio::test]
async fn a_request_served_by_a_decode_alone_is_continued_decode_only() {
    // A prefill is there, but the hook served the request direct: its continuation
    // is decode-only too.
    let s = Stack::builder()
        .decode(vec![dying(6), dying(6)])
        .config(|c| c.migration.limit = 1)
        .disaggregate(Direct)
        .build()
        .await;
    let body = chat_body("tell me a long story", 8, json!({}));
    let a = post(&s.url, "/v1/chat/completions", body.clone(), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_one_answer(&a, true);
    let want = unbroken("/v1/chat/completions", &body).await;
    assert_eq!(a.content(), want.content());
    let stats = s.orchestrator.stats();
    assert_eq!(stats.migrations.iter().map(|(_, n)| n).sum::<u64>(), 1);
    assert_eq!(
        s.p().stats().requests,
        0,
        "no prefill leg, first or continued"
    );
}

#[tokio::test]
async fn a_continuation_whose_prefill_fails_goes_decode_only() {
    let slow_dying = SimConfig {
        inter_token_delay: std::time::Duration::from_millis(40),
        ..dying(6)
    };
    let s = Stack::builder()
        .decode(vec![slow_dying.clone(), slow_dying])
        .config(|c| c.migration.limit = 1)
        .build()
        .await;
    let body = chat_body("tell me a long story", 8, json!({}));
    let url = s.url.clone();
    let sent = body.clone();
    let answer = tokio::spawn(async move { post(&url, "/v1/chat/completions", sent, &[]).await });
    // Once the first prefill answered, the prefill fails everything after it.
    assert!(
        eventually(std::time::Duration::from_secs(2), || s.p().stats().requests
            == 1)
        .await
    );
    s.p().set_faults(Faults {
        status: Some(503),
        ..Faults::default()
    });
    let a = answer.await.unwrap();
    assert_eq!(a.status, 200);
    assert_one_answer(&a, true);
    let want = unbroken("/v1/chat/completions", &body).await;
    assert_eq!(a.content(), want.content());
    // The continuation went to the prefill, which failed, then to the other decode
    // alone.
    let continued = s.p().requests().last().cloned().unwrap();
    assert_eq!(continued.path, "/v1/completions");
    let legs = continuation_legs(&s);
    assert_eq!(legs.len(), 1, "{legs:?}");
    assert!(
        legs[0]
            .body
            .get("kv_transfer_params")
            .is_none_or(|v| v.is_null())
    );
}

/// The value of `disagg_endpoint_requests_total` for `role`'s leg on `endpoint` that
/// ended as `outcome` in the exposition `text` (0 when it has no series).
fn legs(text: &str, role: &str, endpoint: &str, outcome: &str) -> u64 {
    let labels = [
        format!("role=\"{role}\""),
        format!("endpoint=\"{endpoint}\""),
        format!("outcome=\"{outcome}\""),
    ];
    text.lines()
        .filter(|l| l.starts_with("disagg_endpoint_requests_total{"))
        .filter(|l| labels.iter().all(|label| l.contains(label.as_str())))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// A continuation's fresh prefill leg is counted as any prefill leg is: the prefill
/// answered two legs (the request's and the continuation's); each decode's leg is
/// counted once (the one that broke failed, the one that finished answered).
#[tokio::test]
async fn a_continuations_fresh_prefill_leg_is_counted_like_any_prefill_leg() {
    let metrics = disagg_http::metrics::Metrics::new("nixl");
    let m = metrics.clone();
    let s = Stack::builder()
        .prefill(vec![SimConfig {
            prefix_cache_blocks: 256,
            ..SimConfig::default()
        }])
        .decode(vec![dying(6), dying(6)])
        .config(|c| c.migration.limit = 1)
        .service(move |c| c.metrics = Some(m))
        .listener(metrics)
        .build()
        .await;
    let body = chat_body(&long_prompt(), 8, json!({}));
    let a = post(&s.url, "/v1/chat/completions", body, &[]).await;
    assert_one_answer(&a, true);
    assert_eq!(s.p().stats().requests, 2, "through a fresh prefill");
    // The request's report is told once its stream ended on the proxy's side.
    let p = s.p().url();
    let [d1, d2] = [s.decode[0].url(), s.decode[1].url()];
    let mut text = String::new();
    for _ in 0..200 {
        text = get(&s.url, "/metrics").await.text();
        if legs(&text, "decode", &d1, "answered") + legs(&text, "decode", &d2, "answered") > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(legs(&text, "prefill", &p, "answered"), 2, "{text}");
    assert_eq!(legs(&text, "prefill", &p, "failed"), 0, "{text}");
    let decoded =
        [d1, d2].map(|d| ["answered", "failed", "abandoned"].map(|o| legs(&text, "decode", &d, o)));
    assert!(
        decoded == [[0, 1, 0], [1, 0, 0]] || decoded == [[1, 0, 0], [0, 1, 0]],
        "each decode's leg once: {decoded:?}\n{text}"
    );
}
