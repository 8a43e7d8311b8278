//! `HfTokenizer` on a model directory the test makes (see `fixture`): text and chat
//! ids, special tokens, the generation prompt, template errors, loading errors.

mod fixture;
mod ticks;

use std::sync::OnceLock;

use disagg_core::{json::JsonBody, request::Api};
use disagg_tokenize::prompt::READ_OFF_LOOP_FROM;
use disagg_tokenize::{HfTokenizer, LoadError, Tokenize, TokenizeError};
use fixture::{BOS, END_HEADER, EOT, START_HEADER};
use ticks::ticks_while;

/// The model's `tokenizer.json`, trained once per test binary.
fn tokenizer_json() -> &'static str {
    static JSON: OnceLock<String> = OnceLock::new();
    JSON.get_or_init(|| fixture::tokenizer(1200).to_string(false).unwrap())
}

/// The model directory's files as they would be read.
fn hf() -> HfTokenizer {
    let config = fixture::config(Some(fixture::TEMPLATE));
    HfTokenizer::from_bytes(tokenizer_json().as_bytes(), Some(config.as_bytes())).unwrap()
}

/// The raw tokenizer, to encode expected texts and decode ids.
fn raw() -> tokenizers::Tokenizer {
    tokenizer_json().parse().unwrap()
}

fn encode(text: &str, special: bool) -> Vec<u32> {
    raw().encode(text, special).unwrap().get_ids().to_vec()
}

async fn tokenize(t: &HfTokenizer, api: Api, body: &str) -> Result<Vec<u32>, TokenizeError> {
    let body = JsonBody::parse(body.as_bytes()).unwrap();
    t.tokenize(api, &body).await.map(|ids| ids.to_vec())
}

fn completion(prompt: &str, extra: &str) -> String {
    format!(
        r#"{{"model":"m","prompt":{}{extra}}}"#,
        serde_json::to_string(prompt).unwrap()
    )
}

const CHAT: &str = r#"[{"role":"system","content":"  You are terse. "},{"role":"user","content":"What is the weather in Paris today?\n"}]"#;

#[tokio::test]
async fn text_prompts_round_trip_with_the_bos_the_post_processor_adds() {
    let t = hf();
    let text = "Hello world, the engine's prefix cache holds 12345 blocks.\nCafé über naïve!";
    let ids = tokenize(&t, Api::Completions, &completion(text, ""))
        .await
        .unwrap();
    assert_eq!(
        ids[0], BOS,
        "add_special_tokens defaults to true for completions"
    );
    assert_eq!(raw().decode(&ids[1..], false).unwrap(), text);
    // Merges were applied: fewer ids than bytes.
    assert!(
        ids.len() < text.len() / 2,
        "{} ids for {} bytes",
        ids.len(),
        text.len()
    );

    let without = tokenize(
        &t,
        Api::Completions,
        &completion(text, r#","add_special_tokens":false"#),
    )
    .await
    .unwrap();
    assert_eq!(without, ids[1..]);
    // A batch of one is that prompt.
    let one = format!(r#"{{"prompt":[{}]}}"#, serde_json::to_string(text).unwrap());
    assert_eq!(tokenize(&t, Api::Completions, &one).await.unwrap(), ids);
}

#[tokio::test]
async fn special_token_text_in_a_prompt_is_one_token() {
    let ids = tokenize(&hf(), Api::Completions, &completion("<|eot_id|>hello", ""))
        .await
        .unwrap();
    assert_eq!(ids[..2], [BOS, EOT]);
}

#[tokio::test]
async fn token_id_prompts_are_taken_as_they_are_and_truncated_as_vllm() {
    let t = hf();
    let ids = tokenize(&t, Api::Completions, r#"{"prompt":[9,8,7,6]}"#)
        .await
        .unwrap();
    assert_eq!(ids, [9, 8, 7, 6]);
    let ids = tokenize(
        &t,
        Api::Completions,
        r#"{"prompt":[9,8,7,6],"truncate_prompt_tokens":2}"#,
    )
    .await
    .unwrap();
    assert_eq!(ids, [7, 6]);
    // A text prompt truncated inside the tokenizer keeps the BOS (vLLM's tokenizer
    // truncates from the left, leaving room for the special tokens).
    let text = "the model and the engine and the cache";
    let full = encode(text, false);
    let ids = tokenize(
        &t,
        Api::Completions,
        &completion(text, r#","truncate_prompt_tokens":3"#),
    )
    .await
    .unwrap();
    assert_eq!(ids, [BOS, full[full.len() - 2], full[full.len() - 1]]);
    // With an explicit side, vLLM slices the full ids.
    let ids = tokenize(
        &t,
        Api::Completions,
        &completion(
            text,
            r#","truncate_prompt_tokens":3,"truncation_side":"left""#,
        ),
    )
    .await
    .unwrap();
    assert_eq!(ids, full[full.len() - 3..]);
    // A chat's rendered text is truncated the same way: with `add_special_tokens` the
    // BOS the tokenizer adds stays in front.
    let chat = encode(&rendered(true), false);
    let ids = tokenize(
        &t,
        Api::Chat,
        &format!(r#"{{"messages":{CHAT},"add_special_tokens":true,"truncate_prompt_tokens":3}}"#),
    )
    .await
    .unwrap();
    assert_eq!(ids, [BOS, chat[chat.len() - 2], chat[chat.len() - 1]]);
}

/// `truncate_prompt_tokens` without a side gives, for text and chat, with and without
/// special tokens, the ids a copy of the tokenizer set to truncate from the left (room
/// kept for the special tokens) gives: what vLLM's tokenizer gives.
#[tokio::test]
async fn truncation_inside_the_tokenizer_matches_a_truncating_tokenizer() {
    use tokenizers::utils::truncation::{
        TruncationDirection, TruncationParams, TruncationStrategy,
    };
    let truncating = |keep: usize| {
        let mut t = raw();
        t.with_truncation(Some(TruncationParams {
            direction: TruncationDirection::Left,
            max_length: keep,
            strategy: TruncationStrategy::LongestFirst,
            stride: 0,
        }))
        .unwrap();
        t
    };
    let t = hf();
    let texts = [
        "hello".to_owned(),
        "the model and the engine and the cache".to_owned(),
        "<|eot_id|>Café über naïve 12345678!\n\n  spaces  ".to_owned(),
        fixture::text(3000, 5),
    ];
    for text in &texts {
        let full = encode(text, true).len();
        for keep in [1, 2, 3, 7, full - 1, full, full + 4] {
            for special in [true, false] {
                let want = truncating(keep)
                    .encode(text.as_str(), special)
                    .unwrap()
                    .get_ids()
                    .to_vec();
                let got = tokenize(
                    &t,
                    Api::Completions,
                    &completion(
                        text,
                        &format!(
                            r#","truncate_prompt_tokens":{keep},"add_special_tokens":{special}"#
                        ),
                    ),
                )
                .await
                .unwrap();
                assert_eq!(got, want, "{keep} of {text:?}, special {special}");
            }
        }
    }
    // A chat's rendered text, with the tokenizer's special tokens added.
    for keep in [1, 4, 9, 100] {
        let want = truncating(keep)
            .encode(rendered(true), true)
            .unwrap()
            .get_ids()
            .to_vec();
        let got = tokenize(
            &t,
            Api::Chat,
            &format!(
                r#"{{"messages":{CHAT},"add_special_tokens":true,"truncate_prompt_tokens":{keep}}}"#
            ),
        )
        .await
        .unwrap();
        assert_eq!(got, want, "chat, {keep}");
    }
}

/// The truncation and padding a `tokenizer.json` sets are not applied: transformers
/// turns them off for every call that does not ask for them
/// (`set_truncation_and_padding`), as vLLM's calls do not.
#[tokio::test]
async fn the_tokenizer_files_truncation_and_padding_are_not_applied() {
    let mut json: serde_json::Value = serde_json::from_str(tokenizer_json()).unwrap();
    json["truncation"] = serde_json::json!({
        "direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0
    });
    json["padding"] = serde_json::json!({
        "strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": null,
        "pad_id": 1, "pad_type_id": 0, "pad_token": "<|end_of_text|>"
    });
    let config = fixture::config(Some(fixture::TEMPLATE));
    let t = HfTokenizer::from_bytes(json.to_string().as_bytes(), Some(config.as_bytes())).unwrap();
    let text = "the model and the engine and the cache";
    let full = encode(text, true);
    assert_eq!(
        tokenize(&t, Api::Completions, &completion(text, ""))
            .await
            .unwrap(),
        full
    );
    let ids = tokenize(
        &t,
        Api::Completions,
        &completion(text, r#","truncate_prompt_tokens":5"#),
    )
    .await
    .unwrap();
    assert_eq!(ids[0], BOS);
    assert_eq!(ids[1..], full[full.len() - 4..]);
}

/// The text the template must render for `CHAT` (its content stripped, headers and
/// `<|eot_id|>` around each message).
fn rendered(generation_prompt: bool) -> String {
    let mut s = String::from(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nWhat is the weather in Paris today?<|eot_id|>",
    );
    if generation_prompt {
        s.push_str("<|start_header_id|>assistant<|end_header_id|>\n\n");
    }
    s
}

#[tokio::test]
async fn chat_renders_the_template_then_tokenizes_without_adding_special_tokens() {
    let t = hf();
    let ids = tokenize(&t, Api::Chat, &format!(r#"{{"messages":{CHAT}}}"#))
        .await
        .unwrap();
    assert_eq!(ids, encode(&rendered(true), false));
    // One BOS (the template's), the special tokens as single ids.
    assert_eq!(ids.iter().filter(|&&i| i == BOS).count(), 1);
    assert_eq!(ids[..2], [BOS, START_HEADER]);
    assert_eq!(ids.iter().filter(|&&i| i == START_HEADER).count(), 3);
    assert_eq!(ids.iter().filter(|&&i| i == EOT).count(), 2);
    let last_header = ids.iter().rposition(|&i| i == END_HEADER).unwrap();
    assert_eq!(
        raw().decode(&ids[last_header + 1..], false).unwrap(),
        "\n\n"
    );

    // The same text as a completions prompt (which adds its own BOS) gives the same
    // ids after the extra BOS: the rendered text is exactly what we expect.
    let as_text = tokenize(
        &t,
        Api::Completions,
        &completion(&rendered(true), r#","add_special_tokens":false"#),
    )
    .await
    .unwrap();
    assert_eq!(as_text, ids);

    // `add_special_tokens: true` on chat adds the post-processor's BOS on top.
    let doubled = tokenize(
        &t,
        Api::Chat,
        &format!(r#"{{"messages":{CHAT},"add_special_tokens":true}}"#),
    )
    .await
    .unwrap();
    assert_eq!(doubled[..2], [BOS, BOS]);
    assert_eq!(doubled[1..], ids);
}

#[tokio::test]
async fn generation_prompt_on_and_off() {
    let t = hf();
    let off = tokenize(
        &t,
        Api::Chat,
        &format!(r#"{{"messages":{CHAT},"add_generation_prompt":false}}"#),
    )
    .await
    .unwrap();
    assert_eq!(off, encode(&rendered(false), false));
    assert_eq!(*off.last().unwrap(), EOT);
    let on = tokenize(&t, Api::Chat, &format!(r#"{{"messages":{CHAT}}}"#))
        .await
        .unwrap();
    assert!(on.len() > off.len() && on[..off.len()] == off[..]);

    // A template argument reaches the template.
    let thinking = tokenize(
        &t,
        Api::Chat,
        &format!(r#"{{"messages":{CHAT},"chat_template_kwargs":{{"enable_thinking":true}}}}"#),
    )
    .await
    .unwrap();
    assert_eq!(
        thinking,
        encode(&format!("{}<think>", rendered(true)), false)
    );
    // `reasoning_effort` turns thinking on as vLLM's chat route does, unless the
    // request's template arguments say otherwise.
    let effort = tokenize(
        &t,
        Api::Chat,
        &format!(r#"{{"messages":{CHAT},"reasoning_effort":"high"}}"#),
    )
    .await
    .unwrap();
    assert_eq!(effort, thinking);
    let overridden = tokenize(
        &t,
        Api::Chat,
        &format!(
            r#"{{"messages":{CHAT},"reasoning_effort":"high","chat_template_kwargs":{{"enable_thinking":false}}}}"#
        ),
    )
    .await
    .unwrap();
    assert_eq!(overridden, on);
}

#[tokio::test]
async fn continue_final_message_leaves_the_last_message_open() {
    let t = hf();
    let body = r#"{"messages":[{"role":"user","content":"Say hello"},{"role":"assistant","content":"Hello, the "}],"add_generation_prompt":false,"continue_final_message":true}"#;
    let ids = tokenize(&t, Api::Chat, body).await.unwrap();
    let expected = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nSay hello<|eot_id|>\
                    <|start_header_id|>assistant<|end_header_id|>\n\nHello, the";
    assert_eq!(ids, encode(expected, false));
    // Both at once is refused, as vLLM refuses it.
    let err = tokenize(
        &t,
        Api::Chat,
        r#"{"messages":[{"role":"user","content":"x"}],"continue_final_message":true}"#,
    )
    .await
    .unwrap_err();
    assert!(matches!(
        err,
        TokenizeError::Invalid {
            field: "continue_final_message",
            ..
        }
    ));
}

#[tokio::test]
async fn tools_are_rendered_as_vllm_dumps_them() {
    let t = hf();
    let body = format!(
        r#"{{"messages":{CHAT},"tools":[{{"type":"function","function":{{"name":"weather","parameters":{{"type":"object","properties":{{"city":{{"type":"string"}}}}}}}}}}]}}"#
    );
    let ids = tokenize(&t, Api::Chat, &body).await.unwrap();
    let tool = "{\n  \"type\": \"function\",\n  \"function\": {\n    \"name\": \"weather\",\n    \"description\": null,\n    \"parameters\": {\n      \"type\": \"object\",\n      \"properties\": {\n        \"city\": {\n          \"type\": \"string\"\n        }\n      }\n    }\n  }\n}";
    let expected = rendered(true).replacen(
        "<|begin_of_text|>",
        &format!("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nTools:\n{tool}\n<|eot_id|>"),
        1,
    );
    assert_eq!(ids, encode(&expected, false));
}

#[tokio::test]
async fn a_template_that_raises_gives_a_typed_error_with_its_reason() {
    let t = hf();
    let err = tokenize(
        &t,
        Api::Chat,
        r#"{"messages":[{"role":"assistant","content":"first"}]}"#,
    )
    .await
    .unwrap_err();
    match err {
        TokenizeError::Template { message } => {
            assert_eq!(
                message,
                "Conversations must start with a user or system message"
            );
        }
        other => panic!("{other:?}"),
    }
    let err = tokenize(
        &t,
        Api::Chat,
        r#"{"messages":[{"role":"tool","content":"x"}]}"#,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, TokenizeError::Template { ref message } if message == "Unknown role: tool"),
        "{err:?}"
    );
}

#[tokio::test]
async fn shapes_it_cannot_reproduce_are_not_supported() {
    let t = hf();
    for (api, body) in [
        (Api::Completions, r#"{"prompt":["a","b"]}"#),
        (
            Api::Chat,
            r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://x/y.png"}}]}]}"#,
        ),
        (
            Api::Chat,
            r#"{"messages":[{"role":"user","content":"x"}],"chat_template":"{{ 1 }}"}"#,
        ),
    ] {
        let err = tokenize(&t, api, body).await.unwrap_err();
        assert!(err.is_not_supported(), "{body}: {err:?}");
    }
    // Without a chat template, chat requests are not supported; text still works.
    let dir = fixture::temp_dir("no-template");
    fixture::write_model(&dir, &raw(), None);
    let bare = HfTokenizer::from_dir(&dir).unwrap();
    assert!(!bare.has_chat_template());
    let err = tokenize(&bare, Api::Chat, &format!(r#"{{"messages":{CHAT}}}"#))
        .await
        .unwrap_err();
    assert!(err.is_not_supported());
    assert_eq!(
        tokenize(&bare, Api::Completions, &completion("hello", ""))
            .await
            .unwrap(),
        encode("hello", true)
    );
}

/// A `tokenizer.json` given by its path (named as it may be) is loaded with what lies
/// beside it, as a directory is: `tokenizer_config.json`, and `chat_template.jinja`,
/// which takes priority over the config's template, as in transformers 5.
#[tokio::test]
async fn a_tokenizer_file_brings_its_directorys_templates() {
    let dir = fixture::temp_dir("file");
    fixture::write_model(&dir, &raw(), Some(fixture::TEMPLATE));
    std::fs::rename(dir.join("tokenizer.json"), dir.join("my-tokenizer.json")).unwrap();
    let body = r#"{"messages":[{"role":"user","content":"hello"}]}"#;
    let t = HfTokenizer::from_tokenizer_file(dir.join("my-tokenizer.json")).unwrap();
    let ids = tokenize(&t, Api::Chat, body).await.unwrap();
    assert_eq!(ids, tokenize(&hf(), Api::Chat, body).await.unwrap());
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{% for m in messages %}{{ m.role | upper }}: {{ m.content }}\n{% endfor %}",
    )
    .unwrap();
    let t = HfTokenizer::from_tokenizer_file(dir.join("my-tokenizer.json")).unwrap();
    let ids = tokenize(&t, Api::Chat, body).await.unwrap();
    assert_eq!(ids, encode("USER: hello\n", false));
    // A file that is not there is a read error.
    let err = HfTokenizer::from_tokenizer_file(dir.join("tokenizer.json")).unwrap_err();
    assert!(matches!(err, LoadError::Read { .. }), "{err:?}");
}

#[tokio::test]
async fn a_standalone_chat_template_file_takes_priority() {
    let dir = fixture::temp_dir("jinja");
    fixture::write_model(&dir, &raw(), Some(fixture::TEMPLATE));
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{% for m in messages %}{{ m.role | upper }}: {{ m.content }}\n{% endfor %}",
    )
    .unwrap();
    let t = HfTokenizer::from_dir(&dir).unwrap();
    let ids = tokenize(
        &t,
        Api::Chat,
        r#"{"messages":[{"role":"user","content":"hello"}]}"#,
    )
    .await
    .unwrap();
    assert_eq!(ids, encode("USER: hello\n", false));
}

/// A chat template written as Gemma 3's: the content a string or a list of parts, the
/// parts' loop with whitespace control on both ends (`{%- for ... -%}`), each text part
/// trimmed, no separator between them.
const GEMMA3: &str = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first = messages[0]['content'] if messages[0]['content'] is string else messages[0]['content'][0]['text'] -%}
    {%- set prefix = first + '\n\n' -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set prefix = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
    {{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' + (prefix if loop.first else '') }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"#;

/// A template written as Gemma 3's loops over the content (`{%- for item in
/// message['content'] -%}`): vLLM gives it the parts (the OpenAI format), each trimmed
/// and written with no separator; as a string (the parts joined with newlines) the
/// words would run on another line.
#[tokio::test]
async fn gemma3s_template_gets_the_content_parts() {
    let t = hf().with_chat_template(GEMMA3).unwrap();
    let body = r#"{"messages":[{"role":"system","content":[{"type":"text","text":"Be terse."}]},{"role":"user","content":[{"type":"text","text":" What is "},{"type":"text","text":"the weather? "}]}]}"#;
    let ids = tokenize(&t, Api::Chat, body).await.unwrap();
    assert_eq!(
        ids,
        encode(
            "<|begin_of_text|><start_of_turn>user\nBe terse.\n\nWhat isthe weather?<end_of_turn>\n<start_of_turn>model\n",
            false
        )
    );
}

#[tokio::test]
async fn content_parts_follow_the_templates_content_format() {
    let t = hf();
    // The fixture's template uses `.strip()` on the content: the string format, parts
    // joined with newlines.
    let parts = r#"{"messages":[{"role":"user","content":[{"type":"text","text":"What is"},{"type":"text","text":"the weather?"}]}],"add_generation_prompt":false}"#;
    let ids = tokenize(&t, Api::Chat, parts).await.unwrap();
    assert_eq!(
        ids,
        encode(
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is\nthe weather?<|eot_id|>",
            false
        )
    );
    // A template that loops over the content gets the parts.
    let t = hf()
        .with_chat_template(
            "{% for m in messages %}{% for p in m['content'] %}[{{ p.type }}:{{ p.text }}]{% endfor %}{% endfor %}",
        )
        .unwrap();
    let ids = tokenize(&t, Api::Chat, parts).await.unwrap();
    assert_eq!(ids, encode("[text:What is][text:the weather?]", false));
    let plain = tokenize(
        &t,
        Api::Chat,
        r#"{"messages":[{"role":"user","content":"hi"}]}"#,
    )
    .await
    .unwrap();
    assert_eq!(plain, encode("[text:hi]", false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_prompts_tokenized_off_the_event_loop_give_the_same_ids() {
    let text = fixture::text(64 * 1024, 11);
    let body = completion(&text, "");
    let inline = hf().with_off_loop_from(usize::MAX);
    let off_loop = hf().with_off_loop_from(0);
    let a = tokenize(&inline, Api::Completions, &body).await.unwrap();
    let b = tokenize(&off_loop, Api::Completions, &body).await.unwrap();
    assert_eq!(a, b);
    assert_eq!(a, encode(&text, true));
}

/// A body from `READ_OFF_LOOP_FROM` bytes on is read on the blocking pool (and
/// tokenized in the same trip): the event loop runs another task meanwhile. A token-id
/// prompt is never tokenized, so only its read can take it off the loop; a smaller one
/// is read inline, and the other task never runs. The ids are the same either way,
/// whatever the tokenization threshold.
#[test]
fn large_bodies_are_read_off_the_event_loop() {
    for t in [hf(), hf().with_off_loop_from(usize::MAX)] {
        for (n, off_loop) in [(100u32, false), (80_000, true)] {
            let ids: Vec<u32> = (0..n)
                .map(|i| i.wrapping_mul(2_654_435_761) % 1000)
                .collect();
            let body = format!(
                r#"{{"prompt":{},"truncate_prompt_tokens":{}}}"#,
                serde_json::to_string(&ids).unwrap(),
                n - 1
            );
            assert_eq!(body.len() >= READ_OFF_LOOP_FROM, off_loop, "{n} ids");
            let body = JsonBody::parse(body.as_bytes()).unwrap();
            let (got, ticks) = ticks_while(t.tokenize(Api::Completions, &body));
            assert_eq!(&*got.unwrap(), &ids[1..]);
            assert_eq!(ticks > 0, off_loop, "{n} ids: {ticks} ticks");
        }
    }
    // A refusal found off the loop is the same refusal.
    let batch = format!(r#"{{"prompt":[{}]}}"#, vec![r#""a""#; 100_000].join(","));
    assert!(batch.len() >= READ_OFF_LOOP_FROM);
    let body = JsonBody::parse(batch.as_bytes()).unwrap();
    let (got, ticks) = ticks_while(hf().tokenize(Api::Completions, &body));
    assert!(matches!(&got, Err(e) if e.is_not_supported()), "{got:?}");
    assert!(ticks > 0);
}

/// A `tokenizer.json` that is a FIFO is refused before it is opened (a read would wait
/// for a writer and hold start-up for ever), as a directory is.
#[cfg(unix)]
#[test]
fn a_tokenizer_file_that_is_no_regular_file_is_refused_unread() {
    let dir = fixture::temp_dir("fifo");
    let fifo = dir.join("tokenizer.json");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    match HfTokenizer::from_dir(&dir) {
        Err(LoadError::Read { path, source }) => {
            assert_eq!(path, fifo);
            assert_eq!(source.kind(), std::io::ErrorKind::InvalidInput, "{source}");
        }
        other => panic!("{other:?}"),
    }
    std::fs::remove_file(&fifo).unwrap();
    std::fs::create_dir(&fifo).unwrap();
    assert!(matches!(
        HfTokenizer::from_dir(&dir),
        Err(LoadError::Read { .. })
    ));
}

/// A chat template past its ceiling (16 MiB) is refused whole, not read cut short.
#[test]
fn a_template_past_its_ceiling_is_refused_not_cut() {
    let dir = fixture::temp_dir("big");
    raw().save(dir.join("tokenizer.json"), false).unwrap();
    let big = "{{ messages[0].content }}".repeat(16 * 1024 * 1024 / 25 + 1);
    assert!(big.len() > 16 * 1024 * 1024);
    std::fs::write(dir.join("chat_template.jinja"), &big).unwrap();
    match HfTokenizer::from_dir(&dir) {
        Err(LoadError::Read { path, source }) => {
            assert!(path.ends_with("chat_template.jinja"));
            assert_eq!(source.kind(), std::io::ErrorKind::FileTooLarge, "{source}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn loading_errors_name_the_file_and_the_fault() {
    let dir = fixture::temp_dir("errors");
    match HfTokenizer::from_dir(&dir) {
        Err(LoadError::Read { path, source }) => {
            assert!(path.ends_with("tokenizer.json"));
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("{other:?}"),
    }
    std::fs::write(dir.join("tokenizer.json"), "{\"not\": \"a tokenizer\"}").unwrap();
    assert!(matches!(
        HfTokenizer::from_dir(&dir),
        Err(LoadError::Tokenizer { .. })
    ));

    raw().save(dir.join("tokenizer.json"), false).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), "[1, 2]").unwrap();
    assert!(matches!(
        HfTokenizer::from_dir(&dir),
        Err(LoadError::Config { .. })
    ));

    std::fs::write(
        dir.join("tokenizer_config.json"),
        fixture::config(Some("{% for m in messages %}{{ m.content }")),
    )
    .unwrap();
    match HfTokenizer::from_dir(&dir) {
        Err(LoadError::Template { name, .. }) => assert_eq!(name, "default"),
        other => panic!("{other:?}"),
    }
    // Named templates: `tool_use` is chosen when the request has tools.
    let named = serde_json::json!({
        "bos_token": "<|begin_of_text|>",
        "chat_template": [
            {"name": "default", "template": "plain"},
            {"name": "tool_use", "template": "with tools"},
        ],
    });
    std::fs::write(dir.join("tokenizer_config.json"), named.to_string()).unwrap();
    let t = HfTokenizer::from_dir(&dir).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let plain = rt
        .block_on(tokenize(
            &t,
            Api::Chat,
            r#"{"messages":[{"role":"user","content":"x"}]}"#,
        ))
        .unwrap();
    assert_eq!(plain, encode("plain", false));
    let tools = rt
        .block_on(tokenize(
            &t,
            Api::Chat,
            r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}]}"#,
        ))
        .unwrap();
    assert_eq!(tools, encode("with tools", false));
}

/// A chat holding more objects and lists than `MAX_TEMPLATE_CONTAINERS` is not rendered
/// (each would be a template value of its own: a body of `{}`s, a hundred times its
/// size): not supported, so it is routed without ids. Objects inside strings do not
/// count, and a chat at the ceiling renders.
#[tokio::test]
async fn a_chat_of_too_many_objects_is_not_rendered() {
    use disagg_tokenize::hf::MAX_TEMPLATE_CONTAINERS;
    let t = hf();
    // The messages list, each message and `kwargs` count: `n` more in `kwargs.x`.
    let chat = |n: usize| {
        format!(
            r#"{{"model":"m","messages":{CHAT},"chat_template_kwargs":{{"x":[{}],"s":"{}"}}}}"#,
            vec!["{}"; n].join(","),
            "[{".repeat(1000)
        )
    };
    let fixed = 1 + 2 + 1 + 1;
    let err = tokenize(
        &t,
        Api::Chat,
        &chat(MAX_TEMPLATE_CONTAINERS + 1 - fixed + 1),
    )
    .await
    .unwrap_err();
    assert!(err.is_not_supported(), "{err}");
    let at = tokenize(&t, Api::Chat, &chat(MAX_TEMPLATE_CONTAINERS - fixed)).await;
    assert!(at.is_ok(), "{at:?}");
}

/// A chat whose tool parameters hold a list nested `depth` deep around `zeros` zeros:
/// the template dumps tools with `indent=2`, some `2 * depth` bytes out for each `0,`.
fn nested_tools_chat(depth: usize, zeros: usize) -> String {
    let parameters = format!(
        "{}{}{}",
        "[".repeat(depth),
        vec!["0"; zeros].join(","),
        "]".repeat(depth)
    );
    format!(
        r#"{{"model":"m","messages":{CHAT},"tools":[{{"type":"function","function":{{"name":"f","parameters":{parameters}}}}}]}}"#
    )
}

/// A render that would write past its ceiling (`render_ceiling`: here its 1 MiB floor)
/// stops there and is not supported, so the chat is routed without ids: 10 KiB of
/// nested list would render some 1.3 MB (a 32 MiB body, some 8 GB). The same tools,
/// less of them, render.
#[tokio::test]
async fn a_chat_that_renders_past_its_ceiling_is_not_supported() {
    use disagg_tokenize::hf::{RENDER_CEILING_FLOOR, render_ceiling};
    let t = hf();
    let body = nested_tools_chat(120, 5000);
    assert!(body.len() * 4 < RENDER_CEILING_FLOOR);
    assert_eq!(render_ceiling(body.len()), RENDER_CEILING_FLOOR);
    let err = tokenize(&t, Api::Chat, &body).await.unwrap_err();
    assert!(err.is_not_supported(), "{err}");
    let small = tokenize(&t, Api::Chat, &nested_tools_chat(120, 50)).await;
    assert!(small.is_ok(), "{small:?}");
}

/// A small chat is rendered on the event loop (its render is bounded by the ceiling's
/// floor); the text it expands to, past the off-loop threshold, is tokenized on the
/// blocking pool, with the same ids.
#[test]
fn a_small_chat_that_renders_large_is_tokenized_off_the_event_loop() {
    let body = nested_tools_chat(30, 200);
    assert!(body.len() < disagg_tokenize::hf::DEFAULT_OFF_LOOP_FROM);
    let body = JsonBody::parse(body.as_bytes()).unwrap();
    let (off, ticks) = ticks_while(hf().tokenize(Api::Chat, &body));
    assert!(ticks > 0, "{ticks} ticks");
    let (inline, ticks) = ticks_while(
        hf().with_off_loop_from(usize::MAX)
            .tokenize(Api::Chat, &body),
    );
    assert_eq!(ticks, 0);
    let (off, inline) = (off.unwrap(), inline.unwrap());
    assert!(off.len() > 1000, "{} ids", off.len());
    assert_eq!(off, inline);
}

/// A tool call's `arguments` string, parsed into template values, counts against the
/// same `MAX_TEMPLATE_CONTAINERS` as the rest of the chat (its objects are inside a
/// string, which the count of the body skips).
#[tokio::test]
async fn tool_call_arguments_count_against_the_container_budget() {
    use disagg_tokenize::hf::MAX_TEMPLATE_CONTAINERS;
    let t = hf();
    // The messages list, two messages, the tool calls list, the call, its function: 6;
    // the arguments' object and list: 2, then `n` objects in the list.
    let chat = |n: usize| {
        let arguments = format!(r#"{{"x":[{}]}}"#, vec!["{}"; n].join(","));
        let arguments = serde_json::to_string(&arguments).unwrap();
        format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"x"}},{{"role":"assistant","content":"y","tool_calls":[{{"type":"function","function":{{"name":"f","arguments":{arguments}}}}}]}}]}}"#
        )
    };
    let fixed = 6 + 2;
    let err = tokenize(&t, Api::Chat, &chat(MAX_TEMPLATE_CONTAINERS - fixed + 1))
        .await
        .unwrap_err();
    assert!(err.is_not_supported(), "{err}");
    let at = tokenize(&t, Api::Chat, &chat(MAX_TEMPLATE_CONTAINERS - fixed)).await;
    assert!(at.is_ok(), "{at:?}");
}

/// `truncate_prompt_tokens` below the count of special tokens the tokenizer adds (here
/// 0, below the one BOS) keeps the last ids of the full encoding, as vLLM does (its
/// `tokenizers` wheel truncates nothing then, and vLLM slices the ids), with or without
/// special tokens, for text and chat alike; it does not reach `tokenizers` (whose
/// `max_length - added` underflows).
#[tokio::test]
async fn truncation_below_the_special_tokens_keeps_the_last_ids() {
    let t = hf();
    for extra in [
        r#","truncate_prompt_tokens":0"#,
        r#","truncate_prompt_tokens":0,"add_special_tokens":false"#,
    ] {
        let ids = tokenize(&t, Api::Completions, &completion("hello world", extra))
            .await
            .unwrap();
        assert!(ids.is_empty(), "{extra}: {ids:?}");
    }
    let ids = tokenize(
        &t,
        Api::Chat,
        &format!(r#"{{"messages":{CHAT},"add_special_tokens":true,"truncate_prompt_tokens":0}}"#),
    )
    .await
    .unwrap();
    assert!(ids.is_empty(), "{ids:?}");
    // At the count of special tokens, the tokenizer truncates: the BOS is kept.
    let ids = tokenize(
        &t,
        Api::Completions,
        &completion("hello world", r#","truncate_prompt_tokens":1"#),
    )
    .await
    .unwrap();
    assert_eq!(ids, [BOS]);
}

/// `f`'s result, run on a thread with the stack the proxy renders chats on: its serving
/// threads' (a small chat is rendered on the event loop) and Tokio's blocking pool's
/// (a large one), Rust's default of 2 MiB.
fn on_render_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::Builder::new()
        .stack_size(2 * 1024 * 1024)
        .spawn(f)
        .unwrap()
        .join()
        .unwrap()
}

/// A template that nests a value 2,000 deep (a namespace's list wrapped in itself in a
/// loop) and dumps it fails the request with a template error, on the stack the proxy
/// renders on: `tojson` recursed once per level and overflowed it, aborting the
/// process. A client's tools nested as deep as a body may be (120 levels) are dumped.
#[test]
fn a_template_that_dumps_a_value_nested_too_deep_fails_the_request() {
    on_render_stack(|| {
        let template = "{% set ns = namespace(x=[]) %}{% for i in range(2000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x | tojson }}";
        let config = fixture::config(Some(template));
        let t =
            HfTokenizer::from_bytes(tokenizer_json().as_bytes(), Some(config.as_bytes())).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let body = format!(r#"{{"messages":{CHAT}}}"#);
        let err = runtime
            .block_on(tokenize(&t, Api::Chat, &body))
            .unwrap_err();
        assert!(
            matches!(&err, TokenizeError::Template { message } if message.contains("nested deeper than")),
            "{err:?}"
        );
        let nested = runtime.block_on(tokenize(&hf(), Api::Chat, &nested_tools_chat(120, 3)));
        assert!(nested.is_ok(), "{nested:?}");
    });
}
