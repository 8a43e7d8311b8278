//! The cost of the KV-event index on the request path, at 8, 64 and 512 engines: a
//! 32k-token prompt (2,048 blocks of 16) looked up in an index where every engine holds
//! a shared 2k-token system prompt and 16 conversations of its own of 2k tokens, and
//! one engine holds the whole probe prompt.
//!
//! - `keys/32k`: hashing the prompt's 2,048 block keys alone;
//! - `match_prefix/hit/N`: the whole walk when one engine holds all 2,048 blocks (the
//!   system prompt's 128 first on every engine);
//! - `match_prefix/miss/N`: a prompt whose first block nobody holds;
//! - `choose/N`: the scorer's full decision over N candidates (keys, index walk,
//!   provisional entries, costs), as a router calls it;
//! - `choose_2k/N`: the same for a 2k-token prompt (the system prompt every engine
//!   holds, then 64 new tokens);
//! - `apply/32_blocks`: the writer applying one `BlockStored` of 32 blocks.
//!
//! Run: `cargo bench -p disagg-kvevents --bench index`.
#![allow(missing_docs)] // criterion's macros generate undocumented items

use std::hint::black_box;
use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use disagg_kvevents::event::{BlockHash, BlockStored, EventBatch, KvEvent};
use disagg_kvevents::key::BlockKeys;
use disagg_kvevents::{Candidate, IndexConfig, KvIndex, KvScorer, ScorerConfig};

const SIZES: [usize; 3] = [8, 64, 512];
const BLOCK: usize = 16;
const PROMPT: usize = 32 * 1024;
const SYSTEM: usize = 2048;

fn tokens(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| seed.wrapping_mul(2_654_435_761).wrapping_add(i) % 150_000)
        .collect()
}

fn store(index: &KvIndex, engine: &str, tokens: &[u32], hash_base: u64) {
    let blocks = tokens.len() / BLOCK;
    let stored = BlockStored {
        block_hashes: (0..blocks as u64)
            .map(|b| BlockHash::Int(hash_base + b))
            .collect(),
        token_ids: tokens[..blocks * BLOCK].to_vec(),
        block_size: BLOCK,
        ..BlockStored::default()
    };
    let batch = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(stored)],
        dp_rank: None,
    };
    index.apply(engine, 0, &batch);
}

/// The index of the module docs, the engines' names, and the probe prompt.
fn setup(engines: usize) -> (Arc<KvIndex>, Vec<String>, Vec<u32>) {
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    let names: Vec<String> = (0..engines)
        .map(|i| format!("http://10.0.{}.{}:8000", i / 250, i % 250))
        .collect();
    let system = tokens(1, SYSTEM);
    let mut probe = system.clone();
    probe.extend(tokens(2, PROMPT - SYSTEM));
    for (e, name) in names.iter().enumerate() {
        let base = (e as u64) << 32;
        store(&index, name, &system, base);
        for c in 0..16u32 {
            let mut conv = system.clone();
            conv.extend(tokens(1000 + e as u32 * 16 + c, 2048));
            // Only the conversation's own blocks are new; the chain starts at the root.
            store(&index, name, &conv, base + 1000 + u64::from(c) * 1000);
        }
    }
    let last = names.last().map(String::as_str).unwrap_or_default();
    store(&index, last, &probe, 1 << 62);
    (index, names, probe)
}

fn bench(c: &mut Criterion) {
    let probe = tokens(2, PROMPT);
    c.bench_function("keys/32k", |b| {
        b.iter(|| BlockKeys::new(black_box(&probe), BLOCK))
    });

    let mut group = c.benchmark_group("match_prefix");
    for &n in &SIZES {
        let (index, names, probe) = setup(n);
        let m = index.match_prefix(&probe);
        assert_eq!(
            m.engine(names.last().unwrap()).map(|m| m.blocks),
            Some(PROMPT / BLOCK)
        );
        assert_eq!(m.holders().len(), n);
        group.bench_with_input(BenchmarkId::new("hit", n), &n, |b, _| {
            b.iter(|| index.match_prefix(black_box(&probe)))
        });
        let miss = tokens(3, PROMPT);
        group.bench_with_input(BenchmarkId::new("miss", n), &n, |b, _| {
            b.iter(|| index.match_prefix(black_box(&miss)))
        });
    }
    group.finish();

    let mut group = c.benchmark_group("choose");
    for &n in &SIZES {
        let (index, names, probe) = setup(n);
        let scorer = KvScorer::new(index, ScorerConfig::default());
        let candidates: Vec<Candidate<'_>> = names
            .iter()
            .map(|engine| Candidate::new(engine, 0))
            .collect();
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| {
                scorer
                    .choose(black_box(&probe), &candidates)
                    .map(|d| d.index)
            })
        });
    }
    group.finish();

    let mut group = c.benchmark_group("choose_2k");
    for &n in &SIZES {
        let (index, names, _) = setup(n);
        let scorer = KvScorer::new(index, ScorerConfig::default());
        let candidates: Vec<Candidate<'_>> = names
            .iter()
            .map(|engine| Candidate::new(engine, 0))
            .collect();
        let mut short = tokens(1, SYSTEM);
        short.extend(tokens(5, 64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| {
                scorer
                    .choose(black_box(&short), &candidates)
                    .map(|d| d.index)
            })
        });
    }
    group.finish();

    let (index, _, _) = setup(8);
    // 1,024 distinct prompts in turn: new blocks, then the same ones stored again.
    let fresh: Vec<Vec<u32>> = (0..1024).map(|i| tokens(10_000 + i, 32 * BLOCK)).collect();
    let mut round = 0usize;
    c.bench_function("apply/32_blocks", |b| {
        b.iter(|| {
            round = (round + 1) % fresh.len();
            store(
                &index,
                "http://10.9.9.9:8000",
                &fresh[round],
                (round as u64) << 8,
            );
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
