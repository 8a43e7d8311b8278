//! Requests with `truncate_prompt_tokens` cost no memory that stays: the ids are taken
//! from the tokenizer the other requests use, whose cache of merged words is bounded.
//! A copy of the tokenizer made per request (to set its truncation) started a cache of
//! its own on each thread it ran on, never dropped: some kilobytes more per request,
//! for the life of the process. Measured as `memory.rs` measures (see `peak`), in a
//! binary of its own.

#![cfg(all(target_os = "linux", feature = "hf"))]

mod fixture;
mod peak;

use disagg_core::{json::JsonBody, request::Api};
use disagg_tokenize::{HfTokenizer, Prompt};
use peak::{isolated, within};

/// How many requests.
const REQUESTS: usize = 1000;

/// Each request's prompt, in bytes.
const PROMPT: usize = 2048;

/// The same thousand truncated requests, run once to warm every cache, then again,
/// measured: the second run adds at most a tenth of its requests' size to the peak
/// (each request's own encoding, freed before the next). A copy of the tokenizer per
/// request added some 20 MB, its caches kept.
#[test]
fn truncated_requests_keep_no_memory() {
    isolated("truncated_requests_keep_no_memory", || {
        let json = fixture::tokenizer(1200)
            .to_string(false)
            .expect("tokenizer.json");
        let config = fixture::config(Some(fixture::TEMPLATE));
        let t =
            HfTokenizer::from_bytes(json.as_bytes(), Some(config.as_bytes())).expect("a tokenizer");
        let bodies: Vec<JsonBody> = (0..REQUESTS)
            .map(|i| {
                let body = serde_json::json!({
                    "prompt": fixture::text(PROMPT, i as u64),
                    "truncate_prompt_tokens": 64,
                });
                JsonBody::parse(body.to_string().as_bytes()).expect("a body")
            })
            .collect();
        let run = || {
            for body in &bodies {
                let prompt = Prompt::read(Api::Completions, body).expect("a prompt");
                let ids = t.tokenize_prompt_blocking(&prompt).expect("ids");
                assert_eq!(ids.len(), 64);
            }
        };
        within("truncated requests", REQUESTS * PROMPT, 10, run, run);
    });
}
