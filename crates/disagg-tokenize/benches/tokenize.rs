//! The cost of tokenizing a 2k- and a 32k-token prompt with `HfTokenizer`: as a
//! completions prompt (text) and as a chat message (template, then text), on the
//! calling thread. The tokenizer is the tests' fixture: a byte-level BPE with Llama 3's
//! pre-tokenizer, trained by the bench on generated English-like text.
//!
//! Run: `cargo bench -p disagg-tokenize --bench tokenize`.
#![allow(missing_docs)] // criterion's macros generate undocumented items

#[path = "../tests/fixture/mod.rs"]
mod fixture;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use disagg_core::{json::JsonBody, request::Api};
use disagg_tokenize::{HfTokenizer, Prompt};

/// Text of about `tokens` tokens for `tokenizer`.
fn text_of(tokenizer: &HfTokenizer, tokens: usize) -> String {
    let sample = fixture::text(16 * 1024, 5);
    let per_byte = tokenizer.encode(&sample, false).unwrap().len() as f64 / sample.len() as f64;
    let bytes = (tokens as f64 / per_byte) as usize;
    fixture::text(bytes, 5)
}

fn bench(c: &mut Criterion) {
    let trained = fixture::tokenizer(4000);
    let json = trained.to_string(false).unwrap();
    let config = fixture::config(Some(fixture::TEMPLATE));
    let tokenizer = HfTokenizer::from_bytes(json.as_bytes(), Some(config.as_bytes())).unwrap();

    let mut group = c.benchmark_group("tokenize");
    group.sample_size(20);
    for tokens in [2_000, 32_000] {
        let text = text_of(&tokenizer, tokens);
        let counted = tokenizer.encode(&text, true).unwrap().len();
        group.throughput(Throughput::Bytes(text.len() as u64));

        let body = serde_json::json!({"prompt": text}).to_string();
        let prompt =
            Prompt::read(Api::Completions, &JsonBody::parse(body.as_bytes()).unwrap()).unwrap();
        group.bench_with_input(
            BenchmarkId::new("completions", format!("{tokens} ({counted} ids)")),
            &prompt,
            |b, p| b.iter(|| tokenizer.tokenize_prompt_blocking(p).unwrap()),
        );

        let body = serde_json::json!({
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": text},
            ],
        })
        .to_string();
        let prompt = Prompt::read(Api::Chat, &JsonBody::parse(body.as_bytes()).unwrap()).unwrap();
        group.bench_with_input(
            BenchmarkId::new("chat", format!("{tokens} ({counted} ids)")),
            &prompt,
            |b, p| b.iter(|| tokenizer.tokenize_prompt_blocking(p).unwrap()),
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
