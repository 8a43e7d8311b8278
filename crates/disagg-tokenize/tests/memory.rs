//! Reading a request's prompt costs little memory beyond the body itself, whatever the
//! client sends: lists and objects are walked, not built as `serde_json::Value` (which
//! costs 16 bytes per `0,` of a list of numbers and over 600 per `{"":0},` of a list
//! of objects: some 3 GiB for a body of 32 MiB).
//!
//! Measured as the process's peak resident memory (`VmHWM` in `/proc/self/status`,
//! reset through `/proc/self/clear_refs`) around each call: the workspace forbids the
//! `unsafe` a counting global allocator needs. Each case runs in a process of its own
//! (the test runs its own binary again, for that one test), so that no other test
//! allocates meanwhile and no memory freed earlier is reused unseen. Linux only.

#![cfg(target_os = "linux")]

mod peak;

use std::sync::Arc;

use disagg_core::transport::Transport;
use disagg_core::{Endpoint, Role, json::JsonBody, request::Api};
use disagg_http::HttpTransport;
use disagg_tokenize::{EngineTokenizer, Prompt, PromptInput, Tokenize, TokenizeError};
use peak::{Shaped, isolated, shaped, within};

/// A million elements: some 7 MB of `{"":0},`, 700 MB built as `Value`.
const N: usize = 1_000_000;

/// What walking a list may cost, in % of the body: serde_json's scratch space for one
/// string, and the odd page.
const WALKED: usize = 10;

/// What a list of token ids may cost, in % of the body: the ids (4 bytes for the 2 of
/// `7,`) and the spare capacity of a growing `Vec`. Built as `Value`: 1,600%.
const IDS: usize = 300;

fn read(api: Api, body: &Shaped, percent: usize) -> Result<Prompt, TokenizeError> {
    let warm = JsonBody::parse(body.warm.as_bytes()).expect("a body");
    let parsed = JsonBody::parse(body.full.as_bytes()).expect("a body");
    within(
        "Prompt::read",
        body.full.len(),
        percent,
        || drop(Prompt::read(api, &warm)),
        || Prompt::read(api, &parsed),
    )
}

/// A batch of a million small objects is refused as a batch, and nothing of it is
/// kept (built, it took 96 times the body).
#[test]
fn batch_prompt_is_refused_without_building_it() {
    isolated("batch_prompt_is_refused_without_building_it", || {
        let b = shaped(r#"{"prompt":["#, r#"{"":0}"#, N, "]}");
        let err = read(Api::Completions, &b, WALKED).expect_err("a batch");
        assert!(err.is_not_supported(), "{err}");
    });
}

/// Four million token ids cost the ids (4 bytes for each 2 of body, 16 built).
#[test]
fn token_id_prompt_costs_its_ids() {
    isolated("token_id_prompt_costs_its_ids", || {
        let b = shaped(r#"{"prompt":["#, "7", 4 * N, "]}");
        let prompt = read(Api::Completions, &b, IDS).expect("token ids");
        assert!(
            matches!(&prompt.input, PromptInput::Ids(ids) if ids.len() == 4 * N && ids.iter().all(|&id| id == 7))
        );
    });
}

/// A batch of one long list of ids is that prompt, at the cost of its ids.
#[test]
fn batch_of_one_costs_its_ids() {
    isolated("batch_of_one_costs_its_ids", || {
        let b = shaped(r#"{"prompt":[["#, "7", 4 * N, "]]}");
        let prompt = read(Api::Completions, &b, IDS).expect("token ids");
        assert!(matches!(&prompt.input, PromptInput::Ids(ids) if ids.len() == 4 * N));
    });
}

/// `chat_template_kwargs` is looked into for a `chat_template`, not built.
#[test]
fn chat_template_kwargs_are_checked_without_building_them() {
    isolated(
        "chat_template_kwargs_are_checked_without_building_them",
        || {
            let b = shaped(
                r#"{"messages":[],"chat_template_kwargs":{"a":["#,
                r#"{"":0}"#,
                N,
                "]}}",
            );
            let prompt = read(Api::Chat, &b, WALKED);
            assert!(prompt.is_ok(), "{prompt:?}");
        },
    );
}

/// A lax boolean is refused from its first byte.
#[test]
fn lax_boolean_is_refused_from_its_first_byte() {
    isolated("lax_boolean_is_refused_from_its_first_byte", || {
        let b = shaped(
            r#"{"prompt":"a","add_special_tokens":["#,
            r#"{"":0}"#,
            N,
            "]}",
        );
        let err = read(Api::Completions, &b, WALKED).expect_err("not a boolean");
        assert!(
            matches!(
                err,
                TokenizeError::Invalid {
                    field: "add_special_tokens",
                    ..
                }
            ),
            "{err}"
        );
    });
}

/// The engine tokenizer's check of the messages, refusing an image at the end of a
/// long list, before the engine is asked.
fn engine_check(body: &Shaped) {
    let transport: Arc<dyn Transport> = Arc::new(HttpTransport::default());
    let engine = Arc::new(Endpoint::new("http://127.0.0.1:9", Role::Prefill).expect("endpoint"));
    let tokenizer = EngineTokenizer::new(transport, engine);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let warm = JsonBody::parse(body.warm.as_bytes()).expect("a body");
    let parsed = JsonBody::parse(body.full.as_bytes()).expect("a body");
    let err = within(
        "EngineTokenizer::tokenize",
        body.full.len(),
        WALKED,
        || drop(runtime.block_on(tokenizer.tokenize(Api::Chat, &warm))),
        || runtime.block_on(tokenizer.tokenize(Api::Chat, &parsed)),
    )
    .expect_err("an image");
    assert!(err.is_not_supported(), "{err}");
}

/// A million text parts and then an image: the parts are walked (built, 12 times the
/// body).
#[test]
fn content_parts_are_walked() {
    isolated("content_parts_are_walked", || {
        engine_check(&shaped(
            r#"{"model":"m","messages":[{"role":"user","content":["#,
            r#"{"type":"text","text":""}"#,
            N,
            r#",{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
        ));
    });
}

/// Two million empty messages and then one with an image: the messages are walked
/// (as a list of their contents, 5 to 10 times the body).
#[test]
fn messages_are_walked() {
    isolated("messages_are_walked", || {
        engine_check(&shaped(
            r#"{"model":"m","messages":["#,
            "{}",
            2 * N,
            r#",{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
        ));
    });
}
