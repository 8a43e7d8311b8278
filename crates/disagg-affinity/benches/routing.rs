//! The cost of one routing decision, per policy, at 8, 64 and 512 candidates:
//! `RoundRobin`, `Random`, `WeightedRandom`, `LeastInFlight`, `PowerOfTwo`,
//! `ConsistentHash` (with a session key) and `CacheAware` (on a chat body with a 2 KB
//! system prompt and varying user turns, the table warm). `prefix_hash` is
//! `CacheAware`'s hashing step alone, then split into building the canonical stream and
//! chaining the block hashes. `route` is a whole router's decision (both legs, a
//! `PerLeg` over 4 prefill and 4 decode endpoints).
//!
//! Run: `cargo bench -p disagg-affinity --bench routing`.
#![allow(missing_docs)] // criterion's macros generate undocumented items

use std::cell::Cell;
use std::hint::black_box;
use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use disagg_affinity::{
    CacheAware, ConsistentHash, LeastInFlight, PerLeg, PowerOfTwo, PrefixHasher, Random,
    RoundRobin, WeightedRandom,
};
use disagg_core::router::{Pick, RequestView, Router};
use disagg_core::{Endpoint, Role, endpoint::EndpointSet, json::JsonBody, request::Api};
use http::HeaderMap;

const SIZES: [usize; 3] = [8, 64, 512];

fn endpoints(n: usize) -> Vec<Arc<Endpoint>> {
    (0..n)
        .map(|i| {
            let url = format!("http://10.0.{}.{}:8100", i / 250, i % 250);
            Arc::new(Endpoint::new(&url, Role::Prefill).expect("valid url"))
        })
        .collect()
}

/// A 2 KB system prompt shared by every request, then one of several user turns.
fn chat_bodies() -> Vec<JsonBody> {
    let mut system = String::from("You are a support assistant for an online bookshop. ");
    let mut i = 0;
    while system.len() < 2048 {
        system.push_str(&format!(
            "Rule {i}: answer in the customer's language, cite the order number, never promise a refund. "
        ));
        i += 1;
    }
    (0..16)
        .map(|turn| {
            let body = serde_json::json!({
                "model": "meta-llama/Llama-3.1-8B-Instruct",
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": format!(
                        "Hello, my order {turn}0412 has not arrived yet and the tracking page \
                         says \"label created\" since last week. What can I do?"
                    )},
                ],
                "max_tokens": 256,
                "stream": true,
            });
            JsonBody::parse(body.to_string().as_bytes()).expect("a JSON object")
        })
        .collect()
}

fn view<'a>(headers: &'a HeaderMap, body: &'a JsonBody) -> RequestView<'a> {
    RequestView::new(
        Api::Chat,
        Some("meta-llama/Llama-3.1-8B-Instruct"),
        headers,
        body,
    )
}

fn bench_policy(c: &mut Criterion, name: &str, policy: &dyn Pick, headers: &HeaderMap) {
    let bodies = chat_bodies();
    let mut g = c.benchmark_group(name);
    for n in SIZES {
        let eps = endpoints(n);
        // Warm up any state (CacheAware's table) with every body once.
        for b in &bodies {
            policy.pick(&view(headers, b), &eps);
        }
        let next = Cell::new(0usize);
        g.bench_with_input(BenchmarkId::from_parameter(n), &eps, |bench, eps| {
            bench.iter(|| {
                let i = next.get();
                next.set((i + 1) % bodies.len());
                black_box(policy.pick(&view(headers, &bodies[i]), black_box(eps)))
            })
        });
    }
    g.finish();
}

fn policies(c: &mut Criterion) {
    let none = HeaderMap::new();
    let mut session = HeaderMap::new();
    session.insert(
        "x-session-id",
        "chat-7f3a9c".parse().expect("a header value"),
    );

    bench_policy(c, "round_robin", &RoundRobin::new(), &none);
    bench_policy(c, "random", &Random::from_seed(1), &none);
    let weighted = (0..512)
        .step_by(7)
        .fold(WeightedRandom::from_seed(1), |w, i| {
            w.with_weight(&format!("http://10.0.{}.{}:8100", i / 250, i % 250), 2.0)
        });
    bench_policy(c, "weighted_random", &weighted, &none);
    bench_policy(c, "least_in_flight", &LeastInFlight::new(), &none);
    bench_policy(c, "power_of_two", &PowerOfTwo::from_seed(1), &none);
    bench_policy(c, "consistent_hash", &ConsistentHash::new(), &session);
    bench_policy(c, "cache_aware", &CacheAware::new(), &none);
}

fn prefix_hash(c: &mut Criterion) {
    let none = HeaderMap::new();
    let bodies = chat_bodies();
    let hasher = PrefixHasher::new();
    c.bench_function("prefix_hash/2KB_chat", |b| {
        b.iter(|| black_box(hasher.block_hashes(&view(&none, black_box(&bodies[0])))))
    });
    c.bench_function("prefix_hash/2KB_chat_stream_only", |b| {
        b.iter(|| black_box(hasher.canonical(&view(&none, black_box(&bodies[0])))))
    });
    let stream = hasher.canonical(&view(&none, &bodies[0]));
    c.bench_function("prefix_hash/2KB_chat_chain_only", |b| {
        b.iter(|| black_box(hasher.hash_stream(None, black_box(&stream))))
    });
}

fn routing(c: &mut Criterion) {
    let mut g = c.benchmark_group("route");
    let mut eps = Vec::new();
    for i in 0..8 {
        let role = if i % 2 == 0 {
            Role::Prefill
        } else {
            Role::Decode
        };
        eps.push(Arc::new(
            Endpoint::new(&format!("http://10.0.0.{i}:8000"), role).expect("valid url"),
        ));
    }
    let set = EndpointSet::new(eps);
    let (headers, bodies) = (HeaderMap::new(), chat_bodies());
    let view = view(&headers, &bodies[0]);
    let rr = PerLeg::both(RoundRobin::new);
    let lif = PerLeg::both(LeastInFlight::new);
    g.bench_function("round_robin_4p4d", |b| {
        b.iter(|| black_box(rr.select(&view, &set)))
    });
    g.bench_function("least_in_flight_4p4d", |b| {
        b.iter(|| black_box(lif.select(&view, &set)))
    });
    g.finish();
}

criterion_group!(benches, policies, prefix_hash, routing);
criterion_main!(benches);
