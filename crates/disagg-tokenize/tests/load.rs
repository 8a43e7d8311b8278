//! Loading a model directory within ceilings: how many chat templates, how many bytes
//! of them, and what of `tokenizer_config.json` is built; and the config's fields read
//! as transformers reads them.

mod fixture;
#[cfg(target_os = "linux")]
mod peak;

use disagg_core::{json::JsonBody, request::Api};
use disagg_tokenize::hf::{MAX_CHAT_TEMPLATE_BYTES, MAX_CHAT_TEMPLATES};
use disagg_tokenize::{HfTokenizer, LoadError, Prompt, PromptInput};

/// A word-level tokenizer whose post-processor adds `<s>` (id 0).
const TOKENIZER: &str = r#"{
  "version": "1.0", "truncation": null, "padding": null, "normalizer": null,
  "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true}],
  "pre_tokenizer": {"type": "Whitespace"},
  "post_processor": null,
  "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"<s>": 0, "<unk>": 1, "hello": 2, "world": 3},
            "unk_token": "<unk>"}
}"#;

/// A model directory: the word-level tokenizer, `config` as `tokenizer_config.json`
/// when given.
fn model(tag: &str, config: Option<&str>) -> fixture::TempDir {
    let dir = fixture::temp_dir(tag);
    std::fs::write(dir.join("tokenizer.json"), TOKENIZER).unwrap();
    if let Some(c) = config {
        std::fs::write(dir.join("tokenizer_config.json"), c).unwrap();
    }
    dir
}

/// What `t` renders for a one-message chat, with a tool when `tools`.
fn render(t: &HfTokenizer, tools: bool) -> String {
    let tools = if tools {
        r#","tools":[{"type":"function","function":{"name":"f"}}]"#
    } else {
        ""
    };
    let body = format!(r#"{{"messages":[{{"role":"user","content":"x"}}]{tools}}}"#);
    let body = JsonBody::parse(body.as_bytes()).unwrap();
    match Prompt::read(Api::Chat, &body).unwrap().input {
        PromptInput::Chat(chat) => t.render_chat(&chat).unwrap(),
        other => panic!("{other:?}"),
    }
}

/// `additional_chat_templates/` holding `n` templates (and, not counted, as many
/// files of another kind).
fn with_templates(tag: &str, n: usize) -> fixture::TempDir {
    let dir = model(tag, None);
    let extra = dir.join("additional_chat_templates");
    std::fs::create_dir(&extra).unwrap();
    for i in 0..n {
        std::fs::write(
            extra.join(format!("t{i:05}.jinja")),
            format!("template {i}"),
        )
        .unwrap();
        std::fs::write(extra.join(format!("t{i:05}.txt")), "not a template").unwrap();
    }
    dir
}

/// A directory of more `additional_chat_templates/*.jinja` than the ceiling is refused,
/// naming the directory and the ceiling; at the ceiling it loads.
#[test]
fn templates_past_the_count_ceiling_are_refused() {
    let dir = with_templates("count", MAX_CHAT_TEMPLATES + 1);
    let err = HfTokenizer::from_dir(&dir).expect_err("too many templates");
    match &err {
        LoadError::TooManyTemplates { path: named, limit } => {
            assert_eq!(*named, dir.join("additional_chat_templates"));
            assert_eq!(*limit, MAX_CHAT_TEMPLATES);
        }
        other => panic!("{other:?}"),
    }
    let message = err.to_string();
    assert!(
        message.contains("additional_chat_templates")
            && message.contains(&MAX_CHAT_TEMPLATES.to_string()),
        "{message}"
    );
    let dir = with_templates("count-at", MAX_CHAT_TEMPLATES);
    let t = HfTokenizer::from_dir(&dir).expect("at the ceiling");
    assert!(t.has_chat_template());
}

/// A config listing more named templates than the ceiling is refused too, naming the
/// file.
#[test]
fn a_config_of_too_many_templates_is_refused() {
    let list = |n: usize| {
        let entries: Vec<_> = (0..n)
            .map(|i| serde_json::json!({"name": format!("t{i}"), "template": "x"}))
            .collect();
        serde_json::json!({ "chat_template": entries }).to_string()
    };
    let dir = model("config-count", Some(&list(MAX_CHAT_TEMPLATES + 1)));
    match HfTokenizer::from_dir(&dir) {
        Err(LoadError::TooManyTemplates { path: named, limit }) => {
            assert_eq!(named, dir.join("tokenizer_config.json"));
            assert_eq!(limit, MAX_CHAT_TEMPLATES);
        }
        other => panic!("{other:?}"),
    }
    let dir = model("config-count-at", Some(&list(MAX_CHAT_TEMPLATES)));
    assert!(HfTokenizer::from_dir(&dir).is_ok());
}

/// Template files each within their own ceiling (16 MiB) but past the ceiling on
/// their total are refused, naming the directory and the ceiling, before the one that
/// passes it is read.
#[test]
fn template_files_past_their_total_are_refused() {
    let dir = model("bytes", None);
    let extra = dir.join("additional_chat_templates");
    std::fs::create_dir(&extra).unwrap();
    let each = 15 * 1024 * 1024;
    let n = MAX_CHAT_TEMPLATE_BYTES as usize / each + 1;
    let text = "a".repeat(each);
    for i in 0..n {
        std::fs::write(extra.join(format!("t{i}.jinja")), &text).unwrap();
    }
    let err = HfTokenizer::from_dir(&dir).expect_err("too many bytes of templates");
    match &err {
        LoadError::TemplatesTooLarge { dir: named, limit } => {
            assert_eq!(*named, &*dir);
            assert_eq!(*limit, MAX_CHAT_TEMPLATE_BYTES);
        }
        other => panic!("{other:?}"),
    }
    assert!(
        err.to_string()
            .contains(&MAX_CHAT_TEMPLATE_BYTES.to_string()),
        "{err}"
    );
    // One fewer is within the total.
    std::fs::remove_file(extra.join("t0.jinja")).unwrap();
    assert!(HfTokenizer::from_dir(&dir).is_ok());
}

/// The config's fields, read as before: special tokens as strings or `{"content"}`
/// objects (null: none; a key given twice: the last), `split_special_tokens`, and
/// `chat_template` as a string or a named list; members it does not use, whatever
/// they hold, are not read.
#[test]
fn config_fields_are_read_as_transformers_reads_them() {
    let load =
        |config: &str| HfTokenizer::from_bytes(TOKENIZER.as_bytes(), Some(config.as_bytes()));
    let t = load(
        r#"{"bos_token":"<a>","bos_token":"<b>","eos_token":{"content":"<x>","content":"<e>","lstrip":false},
            "pad_token":null,"added_tokens_decoder":{"0":{"content":"<s>","special":true}},
            "unused":[[[[1]]],{"a":[null,true,-0.5e3]}],
            "chat_template":"{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ messages[0].content }}"}"#,
    )
    .unwrap();
    assert_eq!(render(&t, false), "<b>|<e>||x");
    // The named special tokens are special: one id each, and not split.
    let bos = t.encode("<b>", false).unwrap();
    assert_eq!(bos.len(), 1);
    assert_eq!(t.encode("hello <b>", false).unwrap(), [2, bos[0]]);
    let split = load(r#"{"bos_token":"<b>","split_special_tokens":true}"#).unwrap();
    assert_ne!(split.encode("<b>", false).unwrap(), bos);
    let not_split = load(r#"{"bos_token":"<b>","split_special_tokens":"true"}"#).unwrap();
    assert_eq!(not_split.encode("<b>", false).unwrap(), bos);

    let named = load(
        r#"{"chat_template":[{"name":"default","template":"plain"},{"name":"tool_use","x":1,"template":"tools"}]}"#,
    )
    .unwrap();
    assert_eq!(render(&named, false), "plain");
    assert_eq!(render(&named, true), "tools");
    let none = load(r#"{"chat_template":null}"#).unwrap();
    assert!(!none.has_chat_template());

    for (config, reason) in [
        ("[1, 2]", "not a JSON object"),
        ("{", "not a JSON object"),
        ("{} x", "not a JSON object"),
        (
            r#"{"bos_token":5}"#,
            "a special token must be a string or an object",
        ),
        (
            r#"{"bos_token":["<b>"]}"#,
            "a special token must be a string or an object",
        ),
        (
            r#"{"bos_token":{"text":"<b>"}}"#,
            "a special token object without content",
        ),
        (
            r#"{"bos_token":{"content":5}}"#,
            "a special token object without content",
        ),
        (
            r#"{"chat_template":5}"#,
            "chat_template must be a string or a list",
        ),
        (
            r#"{"chat_template":{"name":"a"}}"#,
            "chat_template must be a string or a list",
        ),
        (
            r#"{"chat_template":[{"name":"a"}]}"#,
            "a chat template entry needs a name and a template",
        ),
        (
            r#"{"chat_template":["x"]}"#,
            "a chat template entry needs a name and a template",
        ),
        (
            r#"{"chat_template":[{"name":"a","template":1}]}"#,
            "a chat template entry needs a name and a template",
        ),
    ] {
        match load(config) {
            Err(LoadError::Config { reason: got, .. }) => assert_eq!(got, reason, "{config}"),
            other => panic!("{config}: {other:?}"),
        }
    }
}

#[cfg(target_os = "linux")]
mod memory {
    use super::{TOKENIZER, peak};
    use disagg_tokenize::HfTokenizer;

    /// A config whose members the loader does not use holds some 8 MiB of them (a
    /// list of four million zeros, 128 MiB built as `serde_json::Value`): they are
    /// skipped, not built, and the load costs about the file.
    #[test]
    fn a_config_is_read_without_building_what_it_does_not_use() {
        peak::isolated(
            "memory::a_config_is_read_without_building_what_it_does_not_use",
            || {
                let config = |n: usize| {
                    format!(
                        r#"{{"bos_token":"<b>","unused":[{}],"chat_template":"x"}}"#,
                        vec!["0"; n].join(",")
                    )
                };
                let (warm, full) = (config(16), config(4 * 1024 * 1024));
                let t = peak::within(
                    "HfTokenizer::from_bytes",
                    full.len(),
                    150,
                    || {
                        drop(HfTokenizer::from_bytes(
                            TOKENIZER.as_bytes(),
                            Some(warm.as_bytes()),
                        ))
                    },
                    || HfTokenizer::from_bytes(TOKENIZER.as_bytes(), Some(full.as_bytes())),
                );
                assert!(t.expect("loads").has_chat_template());
            },
        );
    }
}
