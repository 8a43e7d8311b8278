//! The requests the connector serves on a decode engine alone ([`reason`]), though
//! vLLM's checks pass them: what the two completions legs cannot carry as the client
//! asked it.

use disagg_core::request::{Api, PdRequest};
use disagg_json::{JsonBody, lax};
use disagg_tokenize::prompt::READ_OFF_LOOP_FROM;

/// Why a grammar-constrained request is served by a decode engine alone (see
/// `Lmcache`'s `check`).
const GRAMMAR: &str = "grammar";
/// Why a chat with `echo` is served by a decode engine alone (see `Lmcache`'s
/// `check`).
const ECHO: &str = "echo";

/// Why `req`, which vLLM's checks let through, is served by a decode engine alone: a
/// grammar ([`GRAMMAR`]), or a chat's `echo` read true as vLLM reads it when it would
/// put a message in front of the answer ([`ECHO`], see [`echoes`]). `None`: the legs
/// carry it (a chat's `echo` that echoes nothing is dropped from them).
pub(super) fn reason(req: &PdRequest) -> Option<&'static str> {
    let body = req.body();
    if has_grammar(body) {
        return Some(GRAMMAR);
    }
    let echo = body.get("echo").map(lax::bool_value);
    (req.api() == Api::Chat && echo == Some(Ok(Some(true))) && echoes(body)).then_some(ECHO)
}

/// Whether a chat's true `echo` puts the last message in front of the answer: vLLM
/// 0.33 (`chat_completion/serving.py`) echoes the last message only when its role is
/// the answer's, which is the server's response role (`assistant` unless
/// `--response-role` says otherwise) under `add_generation_prompt` (true by default)
/// and the last message's own role without it. So it echoes unless the generation
/// prompt is on and the last message is not the assistant's. When that cannot be told
/// cheaply it is taken to echo (the request then goes to one engine, which answers as
/// vLLM does): messages of [`READ_OFF_LOOP_FROM`] bytes or more, not walked on the event
/// loop for their last role; an `add_generation_prompt` not read as true (lax); a last
/// message whose role is not read as a string.
fn echoes(body: &JsonBody) -> bool {
    let generation_prompt = body
        .get("add_generation_prompt")
        .is_none_or(|v| lax::bool_value(v) == Ok(Some(true)));
    if !generation_prompt {
        return true;
    }
    let Some(messages) = body
        .get("messages")
        .filter(|m| m.len() < READ_OFF_LOOP_FROM)
        .and_then(|m| std::str::from_utf8(m).ok())
    else {
        return true;
    };
    let mut last = None;
    if disagg_json::raw::elements(messages, |m| last = Some(m)).is_err() {
        return true;
    }
    let role = last
        .and_then(|m| disagg_json::raw::member(m.get(), "role"))
        .map(|r| serde_json::from_str::<String>(r.get()));
    !matches!(role, Some(Ok(r)) if r != "assistant")
}

/// Whether `body` asks for a grammar: a `response_format` other than `text`,
/// `structured_outputs`, or one of the older `guided_*` fields.
fn has_grammar(body: &JsonBody) -> bool {
    let present = |k: &str| !body.is_null_or_absent(k);
    // Read, not built: only its `type` counts.
    let format = body
        .get("response_format")
        .filter(|f| *f != b"null")
        .and_then(|f| std::str::from_utf8(f).ok())
        .is_some_and(|f| {
            disagg_json::raw::member(f, "type")
                .and_then(|t| serde_json::from_str::<String>(t.get()).ok())
                != Some("text".to_owned())
        });
    format
        || present("structured_outputs")
        || [
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
        ]
        .iter()
        .any(|k| present(k))
}
