//! Micro-benchmarks of the request path's hot pieces: body parse + prefill rewrite for
//! 1 KB, 64 KB and 1 MB bodies, the parse of bodies of many distinct keys (12 to 120k),
//! and SSE frame forwarding (routing decisions are measured with the policies, in
//! `disagg-affinity`; the health feedback in `disagg-resilience`).
//!
//! Run: `cargo bench -p disagg-core --bench hot_path`.
#![allow(missing_docs)] // criterion's macros generate undocumented items

use std::hint::black_box;
use std::sync::Arc;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use disagg_connectors::vllm::VllmNixl;
use disagg_core::connector::KvConnector;
use disagg_core::endpoint::{Endpoint, Role};
use disagg_core::error::BoxError;
use disagg_core::json::JsonBody;
use disagg_core::orchestrator::PdBody;
use disagg_core::request::{Api, PdRequest};
use http::HeaderMap;
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};

/// A chat body of about `size` bytes: one user message padded with words.
fn chat_body(size: usize) -> Bytes {
    let mut words = String::new();
    while words.len() + 200 < size {
        words.push_str("lorem ipsum dolor sit amet ");
    }
    Bytes::from(
        serde_json::json!({
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": words},
            ],
            "max_tokens": 128,
            "temperature": 0.7,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string(),
    )
}

fn route() -> disagg_core::router::Route {
    disagg_core::router::Route::new(
        Some(Arc::new(
            Endpoint::new("http://10.0.0.1:8100", Role::Prefill).unwrap(),
        )),
        Arc::new(Endpoint::new("http://10.0.0.2:8200", Role::Decode).unwrap()),
    )
}

fn parse_and_rewrite(c: &mut Criterion) {
    let mut g = c.benchmark_group("parse_rewrite");
    let nixl = VllmNixl::new();
    let route = route();
    for (name, size) in [("1KB", 1024), ("64KB", 64 * 1024), ("1MB", 1024 * 1024)] {
        let body = chat_body(size);
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_with_input(BenchmarkId::from_parameter(name), &body, |b, body| {
            b.iter(|| {
                let req = PdRequest::new(Api::Chat, HeaderMap::new(), black_box(body)).unwrap();
                let h = nixl.prepare(&route, &req).unwrap();
                // Both legs as they go on the wire.
                black_box((h.prefill.body.to_bytes(), h.decode.body.to_bytes()))
            })
        });
    }
    let body = chat_body(1024);
    let mut headers = HeaderMap::new();
    headers.insert(
        "x-request-id",
        http::HeaderValue::from_static("client-supplied-id"),
    );
    g.bench_function("1KB_client_request_id", |b| {
        b.iter(|| {
            let req = PdRequest::new(Api::Chat, headers.clone(), black_box(&body)).unwrap();
            let h = nixl.prepare(&route, &req).unwrap();
            black_box((h.prefill.body.to_bytes(), h.decode.body.to_bytes()))
        })
    });
    g.finish();
}

/// A hostile body: `n` distinct top-level keys (`"k0":0,"k1":1,...`), 120k of them
/// making 1.3 MB. Parsing it was quadratic in the keys before duplicate keys were folded
/// through a hash index; past `disagg_json::MAX_FIELDS` (1,024) it is refused, and the
/// bench times the refusal.
fn many_keys_body(n: usize) -> Bytes {
    let mut s = String::from("{");
    for i in 0..n {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&format!("\"k{i}\":{i}"));
    }
    s.push('}');
    Bytes::from(s)
}

fn parse_many_keys(c: &mut Criterion) {
    let mut g = c.benchmark_group("parse_many_keys");
    g.sample_size(10);
    for n in [12usize, 1_000, 120_000] {
        let body = many_keys_body(n);
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &body, |b, body| {
            b.iter(|| black_box(JsonBody::parse_bytes(black_box(body)).ok()))
        });
    }
    g.finish();
}

fn sse_forwarding(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let event = Bytes::from_static(
        br#"data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" word"},"logprobs":null,"finish_reason":null}]}

"#,
    );
    let mut g = c.benchmark_group("sse_forward");
    g.throughput(Throughput::Elements(16));
    g.bench_function("16_events", |b| {
        b.iter(|| {
            let event = event.clone();
            let frames = (0..16).map(move |_| Ok::<_, BoxError>(Frame::data(event.clone())));
            let inner = StreamBody::new(futures::stream::iter(frames)).boxed();
            let body = PdBody::forward(inner, true);
            rt.block_on(async { black_box(body.collect().await.unwrap()) })
        })
    });
    g.finish();
}

criterion_group!(benches, parse_and_rewrite, parse_many_keys, sse_forwarding);
criterion_main!(benches);
