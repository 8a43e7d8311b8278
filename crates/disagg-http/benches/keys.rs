//! The API key set at scale: building a set of 100,000 keys (what a start with a large
//! `--api-key-file` costs), reloading it with one key appended (what every edit of that
//! file costs, off the request path), and one check of a key against 1 and 100,000 keys
//! (what every request pays: it must not grow with the set).
//!
//! Run: `cargo bench -p disagg-http --bench keys`.
#![allow(missing_docs)] // criterion's macros generate undocumented items

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use disagg_http::auth::ApiKeys;
use http::HeaderValue;

fn keys(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("sk-bench-{i:08}-0123456789abcdef0123456789abcdef"))
        .collect()
}

fn bench(c: &mut Criterion) {
    let all = keys(100_000);
    let mut group = c.benchmark_group("api_keys");
    group.sample_size(10);
    group.bench_function("build_100k", |b| {
        b.iter(|| ApiKeys::new(black_box(&all)).expect("valid keys"))
    });
    let set = ApiKeys::new(["sk-fixed"]).expect("valid key");
    set.reload(&all).expect("valid keys");
    let mut appended = all.clone();
    appended.push("sk-appended".into());
    group.bench_function("reload_100k_plus_one", |b| {
        b.iter(|| set.reload(black_box(&appended)).expect("valid keys"))
    });
    group.finish();
    let mut group = c.benchmark_group("api_key_check");
    for n in [1usize, 100_000] {
        let ks = keys(n);
        let set = ApiKeys::new(&ks).expect("valid keys");
        let hit = HeaderValue::from_str(&format!("Bearer {}", ks[n / 2])).expect("header");
        let miss = HeaderValue::from_static("Bearer sk-not-a-key");
        group.bench_with_input(BenchmarkId::new("hit", n), &n, |b, _| {
            b.iter(|| set.check(Some(black_box(&hit))).is_ok())
        });
        group.bench_with_input(BenchmarkId::new("miss", n), &n, |b, _| {
            b.iter(|| set.check(Some(black_box(&miss))).is_err())
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
