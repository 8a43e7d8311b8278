//! A chat's render costs at most its ceiling (`render_ceiling`), however far the
//! template would expand the client's values: measured as `memory.rs` measures (see
//! `peak`), in a binary of its own (the tokenizer's code, linked in, changes what
//! `memory.rs` measures of its own reads).

#![cfg(all(target_os = "linux", feature = "hf"))]

mod peak;

use disagg_core::{json::JsonBody, request::Api};
use disagg_tokenize::{HfTokenizer, Tokenize};
use peak::{isolated, shaped, within};

/// A million elements.
const N: usize = 1_000_000;

/// A word-level tokenizer (`<s>` added in front) with a chat template that dumps the
/// tools with an indent, as most templates do.
fn dumping_tokenizer() -> HfTokenizer {
    let tokenizer = r#"{
      "version": "1.0", "truncation": null, "padding": null, "normalizer": null,
      "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false,
                        "rstrip": false, "normalized": false, "special": true}],
      "pre_tokenizer": {"type": "Whitespace"},
      "post_processor": {"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}},
      "decoder": null,
      "model": {"type": "WordLevel", "vocab": {"<s>": 0, "<unk>": 1, "0": 2},
                "unk_token": "<unk>"}
    }"#;
    let config = r#"{"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}{% for t in tools %}{{ t | tojson(indent=2) }}{% endfor %}"}"#;
    HfTokenizer::from_bytes(tokenizer.as_bytes(), Some(config.as_bytes())).expect("a tokenizer")
}

/// Tool parameters of 400,000 zeros in a list nested 120 deep: dumped with an indent,
/// each `0,` (2 bytes) is some 250 bytes of text (100 MB for this 0.8 MB body, 8 GB
/// for 32 MiB), then tokenized. The render stops at its ceiling (here its 1 MiB floor):
/// what is left is the template values of the zeros (some 24 bytes each, twice while
/// the dump lists them) and the ceiling's buffers.
#[test]
fn a_render_that_expands_stops_at_its_ceiling() {
    isolated("a_render_that_expands_stops_at_its_ceiling", || {
        let depth = 120;
        let start = format!(
            r#"{{"messages":[{{"role":"user","content":"hi"}}],"tools":[{{"type":"function","function":{{"name":"f","parameters":{}"#,
            "[".repeat(depth)
        );
        let end = format!("{}}}}}]}}", "]".repeat(depth));
        let b = shaped(&start, "0", 4 * N / 10, &end);
        let tokenizer = dumping_tokenizer();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let warm = JsonBody::parse(b.warm.as_bytes()).expect("a body");
        let parsed = JsonBody::parse(b.full.as_bytes()).expect("a body");
        let got = within(
            "HfTokenizer::tokenize",
            b.full.len(),
            6000,
            || drop(runtime.block_on(tokenizer.tokenize(Api::Chat, &warm))),
            || runtime.block_on(tokenizer.tokenize(Api::Chat, &parsed)),
        );
        assert!(matches!(&got, Err(e) if e.is_not_supported()), "{got:?}");
    });
}
