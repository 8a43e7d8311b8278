//! What a migration leaves behind: its span (a child of the request's, the
//! continuation's leg under it), its record in the request's summary, and the time it
//! lost in `disagg_migration_duration_seconds`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use disagg_http::metrics::Metrics;
use opentelemetry::Value as OtelValue;
use opentelemetry::trace::SpanKind;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SpanData, SpanProcessor};
use serde_json::json;

use super::*;

/// The spans a tracer hands over, kept.
#[derive(Debug, Clone, Default)]
struct Spans(Arc<Mutex<Vec<SpanData>>>);

impl SpanProcessor for Spans {
    fn on_start(&self, _: &mut opentelemetry_sdk::trace::Span, _: &opentelemetry::Context) {}

    fn on_end(&self, span: SpanData) {
        self.0.lock().unwrap().push(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
        Ok(())
    }
}

fn attr<'a>(span: &'a SpanData, key: &str) -> Option<&'a OtelValue> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| &kv.value)
}

fn text(span: &SpanData, key: &str) -> String {
    attr(span, key)
        .map(|v| v.as_str().into_owned())
        .unwrap_or_else(|| panic!("no {key} on {span:?}"))
}

#[tokio::test]
async fn a_migration_has_a_span_a_summary_record_and_a_time_lost() {
    let spans = Spans::default();
    let summaries = Heard::default();
    let metrics = Metrics::new("nixl");
    let m = metrics.clone();
    let s = Stack::builder()
        .decode(vec![dying(6), dying(6)])
        .config(|c| {
            c.migration.limit = 1;
            c.trace_ratio = Some(1.0);
        })
        .service(move |c| c.metrics = Some(m))
        .listener(metrics)
        .listener(disagg_otel::Tracer::with_processor(spans.clone()))
        .listener(summaries.clone())
        .build()
        .await;
    let body = chat_body("tell me a long story", 8, json!({}));
    let a = post(&s.url, "/v1/chat/completions", body, &[]).await;
    assert_eq!(a.status, 200);
    assert_one_answer(&a, true);

    // The summary has the migration: from the decode that broke to the other one, the
    // 5 tokens carried, and the time the stream stood still.
    let summary = summaries.first(1).await.remove(0);
    assert_eq!(summary.migrations, 1);
    assert_eq!(summary.migrated.len(), 1, "{:?}", summary.migrated);
    let mig = &summary.migrated[0];
    let to = mig.to.as_ref().expect("the continuation's decode");
    assert_ne!(mig.from.id(), to.id());
    let urls: Vec<String> = s.decode.iter().map(|d| d.url()).collect();
    for ep in [&mig.from, to] {
        assert!(urls.contains(&ep.id().as_str().to_owned()), "{ep:?}");
    }
    // The request was disaggregated: so is its continuation, on the same prefill.
    let prefill = mig
        .prefill
        .as_ref()
        .expect("a continuation through a prefill");
    assert_eq!(prefill.id().as_str(), s.p().url());
    assert_eq!(mig.tokens, 5);
    let lost = mig.time_lost.expect("the continuation reached the client");
    assert!(lost <= summary.duration, "{lost:?}");
    assert!(["reset", "eof", "error_frame"].contains(&mig.reason));

    // Its span: a child of the request's, from the break to the continuation's first
    // byte, naming both decodes and the tokens carried.
    let all = spans.0.lock().unwrap().clone();
    let request = all
        .iter()
        .find(|s| s.span_kind == SpanKind::Server)
        .expect("the request span");
    let migration: Vec<&SpanData> = all.iter().filter(|s| s.name == "migration").collect();
    assert_eq!(migration.len(), 1, "{all:#?}");
    let span = migration[0];
    assert_eq!(span.parent_span_id, request.span_context.span_id());
    assert_eq!(
        span.span_context.trace_id(),
        request.span_context.trace_id()
    );
    assert_eq!(text(span, "disagg.migration.from"), mig.from.id().as_str());
    assert_eq!(text(span, "disagg.migration.to"), to.id().as_str());
    assert_eq!(text(span, "disagg.migration.reason"), mig.reason);
    assert_eq!(
        attr(span, "disagg.migration.tokens"),
        Some(&OtelValue::I64(5))
    );
    assert_eq!(
        attr(span, "disagg.migration.index"),
        Some(&OtelValue::I64(1))
    );
    let took = span.end_time.duration_since(span.start_time).unwrap();
    assert_eq!(took, lost);
    assert!(span.start_time >= request.start_time && span.end_time <= request.end_time);
    assert_eq!(span.status, opentelemetry::trace::Status::Unset);

    // The continuation's leg named the migration's span as its parent, in the
    // request's trace.
    let engine = s
        .decode
        .iter()
        .find(|d| d.url() == to.id().as_str())
        .unwrap();
    let leg = engine.requests().last().cloned().expect("the continuation");
    assert_eq!(leg.path, "/v1/completions");
    let want = format!(
        "00-{}-{}-01",
        span.span_context.trace_id(),
        span.span_context.span_id()
    );
    assert_eq!(leg.header("traceparent"), Some(want.as_str()));
    let prefill_leg = s.p().requests().last().cloned().expect("the prefill leg");
    assert_eq!(prefill_leg.header("traceparent"), Some(want.as_str()));

    // And the time lost is in the histogram, once.
    let text = get(&s.url, "/metrics").await.text();
    assert!(
        text.contains("disagg_migration_duration_seconds_count 1"),
        "{text}"
    );
}

#[tokio::test]
async fn an_unbroken_stream_has_no_migration() {
    let summaries = Heard::default();
    let metrics = Metrics::new("nixl");
    let m = metrics.clone();
    let s = Stack::builder()
        .config(|c| c.migration.limit = 1)
        .service(move |c| c.metrics = Some(m))
        .listener(metrics)
        .listener(summaries.clone())
        .build()
        .await;
    let body = chat_body("tell me a long story", 8, json!({}));
    let a = post(&s.url, "/v1/chat/completions", body, &[]).await;
    assert_one_answer(&a, true);
    let summary = summaries.first(1).await.remove(0);
    assert!(summary.migrated.is_empty());
    let text = get(&s.url, "/metrics").await.text();
    assert!(
        text.contains("disagg_migration_duration_seconds_count 0"),
        "{text}"
    );
}

/// Every span of a migrated request has an id of its own: the continuation's fresh
/// prefill leg span is not the migration's (whose id its engine's `traceparent` names),
/// nor the first attempt's prefill leg's.
#[tokio::test]
async fn a_migrated_requests_spans_each_have_an_id_of_their_own() {
    let spans = Spans::default();
    let summaries = Heard::default();
    let s = Stack::builder()
        .decode(vec![dying(6), dying(6)])
        .config(|c| {
            c.migration.limit = 1;
            c.trace_ratio = Some(1.0);
        })
        .listener(disagg_otel::Tracer::with_processor(spans.clone()))
        .listener(summaries.clone())
        .build()
        .await;
    let body = chat_body("tell me a long story", 8, json!({}));
    let a = post(&s.url, "/v1/chat/completions", body, &[]).await;
    assert_eq!(a.status, 200);
    assert_one_answer(&a, true);
    let summary = summaries.first(1).await.remove(0);
    assert_eq!(summary.migrated.len(), 1, "{:?}", summary.migrated);
    let all = spans.0.lock().unwrap().clone();
    let names = |name: &str| all.iter().filter(|s| s.name == name).count();
    // The request, the migration, and a prefill leg span per attempt: the first
    // attempt's and the continuation's fresh prefill's.
    assert_eq!((names("migration"), names("prefill")), (1, 2), "{all:#?}");
    let mut ids: Vec<_> = all.iter().map(|s| s.span_context.span_id()).collect();
    ids.sort_unstable_by_key(|id| id.to_bytes());
    let spans_n = ids.len();
    ids.dedup();
    assert_eq!(ids.len(), spans_n, "spans sharing an id: {all:#?}");
}
