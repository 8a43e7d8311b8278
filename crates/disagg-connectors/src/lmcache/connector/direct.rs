//! The requests the connector serves on a decode engine alone ([`reason`]), though
//! vLLM's checks pass them: what the two completions legs cannot carry as the client
//! asked it.

use disagg_core::request::{Api, PdRequest};
use disagg_json::JsonBody;

/// Why a grammar-constrained request is served by a decode engine alone (see
/// `Lmcache`'s `check`).
const GRAMMAR: &str = "grammar";
/// Why a chat with `echo` is served by a decode engine alone (see `Lmcache`'s
/// `check`).
const ECHO: &str = "echo";

/// Why `req`, which vLLM's checks let through, is served by a decode engine alone: a
/// grammar ([`GRAMMAR`]), or a chat's `echo` read true as vLLM reads it ([`ECHO`]).
/// `None`: the legs carry it.
pub(super) fn reason(req: &PdRequest) -> Option<&'static str> {
    let body = req.body();
    if has_grammar(body) {
        return Some(GRAMMAR);
    }
    let echo = body.get("echo").map(disagg_json::lax::bool_value);
    (req.api() == Api::Chat && echo == Some(Ok(Some(true)))).then_some(ECHO)
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
