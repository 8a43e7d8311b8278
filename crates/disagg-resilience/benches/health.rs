//! The per-request cost of passive health: `Health::record` and `HealthSource::snapshot`.
#![allow(missing_docs)] // a benchmark binary

use std::hint::black_box;
use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use disagg_core::endpoint::{Endpoint, Role};

/// `Health::record` (a success on a closed breaker: the per-leg cost the orchestrator
/// adds) and `HealthSource::snapshot` (the per-request cost), against the inner
/// `StaticSource::snapshot`, at 8, 64 and 512 endpoints.
fn health(c: &mut Criterion) {
    use disagg_core::source::{EndpointSource, StaticSource};
    use disagg_resilience::{HealthConfig, HealthSource};
    let mut g = c.benchmark_group("health");
    for n in [8usize, 64, 512] {
        let endpoints = (0..n).map(|i| {
            let role = if i % 2 == 0 {
                Role::Prefill
            } else {
                Role::Decode
            };
            Endpoint::new(&format!("http://10.0.{}.{}:8100", i / 250, i % 250), role).unwrap()
        });
        let inner = Arc::new(StaticSource::new(endpoints));
        let source = HealthSource::new(Arc::clone(&inner), HealthConfig::default());
        let health = Arc::clone(source.health());
        let set = source.snapshot();
        let target = Arc::clone(set.by_role(Role::Decode).last().unwrap());
        g.bench_with_input(BenchmarkId::new("record_ok", n), &n, |b, _| {
            b.iter(|| health.record(black_box(&target), black_box(true)))
        });
        g.bench_with_input(BenchmarkId::new("static_snapshot", n), &n, |b, _| {
            b.iter(|| black_box(inner.snapshot()))
        });
        g.bench_with_input(BenchmarkId::new("health_snapshot", n), &n, |b, _| {
            b.iter(|| black_box(source.snapshot()))
        });
        // One endpoint ejected: the fast path also reads the clock.
        let first = Arc::clone(&set.by_role(Role::Prefill)[0]);
        for _ in 0..5 {
            health.record(&first, false);
        }
        g.bench_with_input(
            BenchmarkId::new("health_snapshot_ejected", n),
            &n,
            |b, _| b.iter(|| black_box(source.snapshot())),
        );
    }
    g.finish();
}

criterion_group!(benches, health);
criterion_main!(benches);
