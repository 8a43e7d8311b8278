//! Reading the prompt out of a request ([`Prompt::read`]), with vLLM 0.33's defaults.
//!
//! The fields and defaults are vLLM's (`vllm/entrypoints/openai/completion/protocol.py`,
//! `vllm/entrypoints/openai/chat_completion/protocol.py`, `vllm/renderers/params.py`):
//!
//! - completions: `prompt` is a string (tokenized with `add_special_tokens`, default
//!   `true`) or token ids (taken as they are); a batch of one is that one prompt, a
//!   larger batch is [not supported](TokenizeError::NotSupported);
//! - chat: `messages` rendered with the chat template (`add_generation_prompt` default
//!   `true`, `continue_final_message` default `false`, both at once refused),
//!   `chat_template_kwargs`, `tools`, `documents` and `reasoning_effort` reaching the
//!   template; the text is then tokenized with `add_special_tokens` (default `false`:
//!   the template writes the special tokens itself);
//! - both: `truncate_prompt_tokens` keeps the last (or, with `truncation_side:
//!   "right"`, the first) tokens.
//!
//! Booleans are read as pydantic's lax mode reads them (`"yes"`, `1`), as the engines do.

use bytes::Bytes;
use disagg_core::json::JsonBody;
use disagg_core::request::Api;
use serde_json::Value;

use crate::error::TokenizeError;

/// A request's prompt, read: what any [`Tokenize`](crate::Tokenize) implementation
/// turns into token ids.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Prompt {
    /// What is tokenized.
    pub input: PromptInput,
    /// `truncate_prompt_tokens`, when the request sets it.
    pub truncation: Option<Truncation>,
    /// The raw `model` field, forwarded to an engine's `/tokenize`.
    pub model: Option<Bytes>,
}

/// The prompt itself.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum PromptInput {
    /// A completions prompt given as token ids: taken as they are.
    Ids(Vec<u32>),
    /// A completions prompt given as text.
    Text {
        /// The text.
        text: String,
        /// Whether the tokenizer adds its special tokens (vLLM's default: `true`).
        add_special_tokens: bool,
    },
    /// A chat conversation.
    Chat(ChatPrompt),
}

/// A chat request's fields that decide its prompt.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ChatPrompt {
    /// `messages`, as the raw JSON array the client sent.
    pub messages: Bytes,
    /// `add_generation_prompt` (default `true`).
    pub add_generation_prompt: bool,
    /// `continue_final_message` (default `false`).
    pub continue_final_message: bool,
    /// `add_special_tokens` (default `false` for chat).
    pub add_special_tokens: bool,
    /// `tools`, raw, when set and not null.
    pub tools: Option<Bytes>,
    /// `documents`, raw, when set and not null.
    pub documents: Option<Bytes>,
    /// `chat_template_kwargs`, raw, when set and not null (a JSON object).
    pub chat_template_kwargs: Option<Bytes>,
    /// `reasoning_effort`, when set.
    pub reasoning_effort: Option<String>,
    /// Which of the defaulted fields the client sent itself (an engine's `/tokenize`
    /// gets only those, so that each engine applies its own default).
    pub(crate) sent_generation_prompt: bool,
    pub(crate) sent_special_tokens: bool,
}

/// `truncate_prompt_tokens`: how many tokens of the prompt the engine keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Truncation {
    /// How many tokens are kept.
    pub keep: usize,
    /// `truncation_side`; `None` uses the tokenizer's side, which vLLM sets to `Left`
    /// for generative models (`vllm/tokenizers/registry.py`).
    pub side: Option<Side>,
}

/// Which end of the prompt truncation removes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Drop tokens from the start (keep the last ones).
    Left,
    /// Drop tokens from the end (keep the first ones).
    Right,
}

impl Truncation {
    /// Apply to token ids already tokenized in full (no-op when they fit).
    pub fn apply(&self, ids: &mut Vec<u32>) {
        if ids.len() <= self.keep {
            return;
        }
        match self.side.unwrap_or(Side::Left) {
            Side::Left => {
                ids.drain(..ids.len() - self.keep);
            }
            Side::Right => ids.truncate(self.keep),
        }
    }
}

impl Prompt {
    /// Read the prompt of a request for `api` from its parsed body.
    ///
    /// Cheap for chat (the messages stay raw) and for text; token-id prompts are
    /// parsed here.
    ///
    /// # Errors
    ///
    /// [`TokenizeError::NotSupported`] for SGLang's `/generate`, and for prompts that
    /// are not one sequence (batches,
    /// `prompt_embeds`, `suffix`, a request's own `chat_template`,
    /// `truncate_prompt_tokens: -1`); [`TokenizeError::Invalid`] for fields of the
    /// wrong type, as the engine would refuse them.
    pub fn read(api: Api, body: &JsonBody) -> Result<Prompt, TokenizeError> {
        let truncation = truncation(body)?;
        let model = body.get_bytes("model").filter(|m| &m[..] != b"null");
        let input = match api {
            Api::Completions => completion(body)?,
            Api::Chat => PromptInput::Chat(chat(body)?),
            // SGLang's native /generate carries `text` or `input_ids` (often a batch)
            // and SGLang's own sampling fields; no vLLM prompt reader applies.
            _ => return Err(TokenizeError::not_supported("SGLang's native /generate")),
        };
        Ok(Prompt {
            input,
            truncation,
            model,
        })
    }
}

fn present<'a>(body: &'a JsonBody, key: &str) -> Option<&'a [u8]> {
    body.get(key).filter(|raw| *raw != b"null")
}

fn completion(body: &JsonBody) -> Result<PromptInput, TokenizeError> {
    if present(body, "prompt_embeds").is_some() {
        return Err(TokenizeError::not_supported("prompt_embeds"));
    }
    // A fill-in-the-middle prompt is rendered by the model's own suffix rules.
    if present(body, "suffix").is_some() {
        return Err(TokenizeError::not_supported("suffix"));
    }
    let add_special_tokens = lax_bool(body, "add_special_tokens")?.unwrap_or(true);
    let Some(raw) = present(body, "prompt") else {
        return Err(TokenizeError::invalid("prompt", "field required"));
    };
    let value: Value =
        serde_json::from_slice(raw).map_err(|_| TokenizeError::invalid("prompt", "not JSON"))?;
    match value {
        Value::String(text) => Ok(PromptInput::Text {
            text,
            add_special_tokens,
        }),
        Value::Array(items) => {
            if items.is_empty() {
                return Err(TokenizeError::invalid("prompt", "empty prompt"));
            }
            if items.iter().all(Value::is_number) {
                return ids(&items).map(PromptInput::Ids);
            }
            // A batch of one is answered exactly as that one prompt.
            match <[Value; 1]>::try_from(items) {
                Ok([Value::String(text)]) => Ok(PromptInput::Text {
                    text,
                    add_special_tokens,
                }),
                Ok([Value::Array(inner)]) if inner.iter().all(Value::is_number) => {
                    ids(&inner).map(PromptInput::Ids)
                }
                Ok(_) => Err(TokenizeError::invalid(
                    "prompt",
                    "expected a string, a list of strings, token ids or lists of token ids",
                )),
                Err(_) => Err(TokenizeError::not_supported("a batch of prompts")),
            }
        }
        _ => Err(TokenizeError::invalid(
            "prompt",
            "expected a string or token ids",
        )),
    }
}

fn ids(items: &[Value]) -> Result<Vec<u32>, TokenizeError> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| TokenizeError::invalid("prompt", "token ids must be integers"))
        })
        .collect()
}

fn chat(body: &JsonBody) -> Result<ChatPrompt, TokenizeError> {
    let Some(messages) = present(body, "messages") else {
        return Err(TokenizeError::invalid("messages", "field required"));
    };
    if messages.first() != Some(&b'[') {
        return Err(TokenizeError::invalid("messages", "expected a list"));
    }
    // vLLM refuses a request's own template unless the server trusts request
    // templates; a template from the client is not rendered in the proxy either.
    if present(body, "chat_template").is_some() {
        return Err(TokenizeError::not_supported(
            "a request's own chat_template",
        ));
    }
    let chat_template_kwargs = body
        .get_bytes("chat_template_kwargs")
        .filter(|raw| &raw[..] != b"null");
    if let Some(raw) = &chat_template_kwargs {
        let kwargs: serde_json::Map<String, Value> = serde_json::from_slice(raw)
            .map_err(|_| TokenizeError::invalid("chat_template_kwargs", "expected an object"))?;
        if kwargs.get("chat_template").is_some_and(|t| !t.is_null()) {
            return Err(TokenizeError::not_supported(
                "a request's own chat_template",
            ));
        }
    }
    let sent_generation_prompt = lax_bool(body, "add_generation_prompt")?;
    let continue_final_message = lax_bool(body, "continue_final_message")?.unwrap_or(false);
    let add_generation_prompt = sent_generation_prompt.unwrap_or(true);
    // vLLM's request model refuses both at once; with `add_generation_prompt` left at
    // its default of true, transformers' `apply_chat_template` refuses them (400 too).
    if continue_final_message && add_generation_prompt {
        return Err(TokenizeError::invalid(
            "continue_final_message",
            "cannot be used with add_generation_prompt",
        ));
    }
    let sent_special_tokens = lax_bool(body, "add_special_tokens")?;
    let tools = body.get_bytes("tools").filter(|raw| &raw[..] != b"null");
    if let Some(raw) = &tools
        && raw.first() != Some(&b'[')
    {
        return Err(TokenizeError::invalid("tools", "expected a list"));
    }
    let documents = body
        .get_bytes("documents")
        .filter(|raw| &raw[..] != b"null");
    let reasoning_effort = match present(body, "reasoning_effort") {
        None => None,
        Some(raw) => Some(
            serde_json::from_slice::<String>(raw)
                .map_err(|_| TokenizeError::invalid("reasoning_effort", "expected a string"))?,
        ),
    };
    Ok(ChatPrompt {
        messages: body.get_bytes("messages").unwrap_or_default(),
        add_generation_prompt,
        continue_final_message,
        add_special_tokens: sent_special_tokens.unwrap_or(false),
        tools,
        documents,
        chat_template_kwargs,
        reasoning_effort,
        sent_generation_prompt: sent_generation_prompt.is_some(),
        sent_special_tokens: sent_special_tokens.is_some(),
    })
}

fn truncation(body: &JsonBody) -> Result<Option<Truncation>, TokenizeError> {
    let Some(raw) = present(body, "truncate_prompt_tokens") else {
        return Ok(None);
    };
    let keep: i64 = serde_json::from_slice(raw)
        .map_err(|_| TokenizeError::invalid("truncate_prompt_tokens", "expected an integer"))?;
    // -1 means "the model's context length less one", which only the engine knows.
    let keep = match usize::try_from(keep) {
        Ok(keep) => keep,
        Err(_) if keep == -1 => {
            return Err(TokenizeError::not_supported("truncate_prompt_tokens: -1"));
        }
        Err(_) => {
            return Err(TokenizeError::invalid(
                "truncate_prompt_tokens",
                "must be -1 or at least 0",
            ));
        }
    };
    let side = match present(body, "truncation_side") {
        None => None,
        Some(b"\"left\"") => Some(Side::Left),
        Some(b"\"right\"") => Some(Side::Right),
        Some(_) => {
            return Err(TokenizeError::invalid(
                "truncation_side",
                "expected \"left\" or \"right\"",
            ));
        }
    };
    Ok(Some(Truncation { keep, side }))
}

/// A field read as pydantic's lax `bool` (`true`, `1`, `"yes"`, `"on"`, ...).
fn lax_bool(body: &JsonBody, field: &'static str) -> Result<Option<bool>, TokenizeError> {
    let Some(raw) = body.get(field) else {
        return Ok(None);
    };
    let bad = || TokenizeError::invalid(field, "expected a boolean");
    match raw {
        b"true" => Ok(Some(true)),
        b"false" => Ok(Some(false)),
        b"null" => Ok(None),
        _ => match serde_json::from_slice::<Value>(raw).map_err(|_| bad())? {
            Value::String(s) => match s.to_ascii_lowercase().as_str() {
                "1" | "on" | "t" | "true" | "y" | "yes" => Ok(Some(true)),
                "0" | "off" | "f" | "false" | "n" | "no" => Ok(Some(false)),
                _ => Err(bad()),
            },
            Value::Number(n) => match n.as_f64() {
                Some(1.0) => Ok(Some(true)),
                Some(0.0) => Ok(Some(false)),
                _ => Err(bad()),
            },
            _ => Err(bad()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(api: Api, body: &str) -> Result<Prompt, TokenizeError> {
        Prompt::read(api, &JsonBody::parse(body.as_bytes()).unwrap())
    }

    #[test]
    fn completions_prompts_take_vllm_defaults() {
        let p = read(Api::Completions, r#"{"prompt":"hi"}"#).unwrap();
        assert!(matches!(
            p.input,
            PromptInput::Text { ref text, add_special_tokens: true } if text == "hi"
        ));
        let p = read(
            Api::Completions,
            r#"{"prompt":["hi"],"add_special_tokens":"no"}"#,
        )
        .unwrap();
        assert!(matches!(
            p.input,
            PromptInput::Text {
                add_special_tokens: false,
                ..
            }
        ));
        let p = read(Api::Completions, r#"{"prompt":[1,2,3]}"#).unwrap();
        assert!(matches!(p.input, PromptInput::Ids(ref ids) if ids == &[1, 2, 3]));
        let p = read(Api::Completions, r#"{"prompt":[[4,5]]}"#).unwrap();
        assert!(matches!(p.input, PromptInput::Ids(ref ids) if ids == &[4, 5]));
    }

    #[test]
    fn batches_and_embeddings_are_not_supported() {
        for body in [
            r#"{"prompt":["a","b"]}"#,
            r#"{"prompt":[[1],[2]]}"#,
            r#"{"prompt":"a","prompt_embeds":"AAAA"}"#,
            r#"{"prompt":"a","suffix":"b"}"#,
            r#"{"prompt":"a","truncate_prompt_tokens":-1}"#,
        ] {
            let err = read(Api::Completions, body).unwrap_err();
            assert!(err.is_not_supported(), "{body}: {err}");
        }
        let err = read(Api::Chat, r#"{"messages":[],"chat_template":"{{x}}"}"#).unwrap_err();
        assert!(err.is_not_supported(), "{err}");
    }

    #[test]
    fn malformed_fields_are_invalid() {
        for (api, body, field) in [
            (Api::Completions, r#"{}"#, "prompt"),
            (Api::Completions, r#"{"prompt":5}"#, "prompt"),
            (Api::Completions, r#"{"prompt":[]}"#, "prompt"),
            (Api::Completions, r#"{"prompt":[1,-2]}"#, "prompt"),
            (
                Api::Completions,
                r#"{"prompt":"a","add_special_tokens":2}"#,
                "add_special_tokens",
            ),
            (Api::Chat, r#"{}"#, "messages"),
            (Api::Chat, r#"{"messages":{}}"#, "messages"),
            (
                Api::Chat,
                r#"{"messages":[],"continue_final_message":true}"#,
                "continue_final_message",
            ),
            (Api::Chat, r#"{"messages":[],"tools":{}}"#, "tools"),
            (
                Api::Chat,
                r#"{"messages":[],"truncation_side":"middle","truncate_prompt_tokens":3}"#,
                "truncation_side",
            ),
        ] {
            match read(api, body) {
                Err(TokenizeError::Invalid { field: f, .. }) => assert_eq!(f, field, "{body}"),
                other => panic!("{body}: {other:?}"),
            }
        }
    }

    #[test]
    fn chat_defaults_and_what_the_client_sent() {
        let p = read(
            Api::Chat,
            r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#,
        )
        .unwrap();
        let PromptInput::Chat(c) = p.input else {
            panic!("not chat")
        };
        assert!(c.add_generation_prompt && !c.sent_generation_prompt);
        assert!(!c.add_special_tokens && !c.sent_special_tokens);
        assert!(!c.continue_final_message);
        assert_eq!(p.model.as_deref(), Some(&b"\"m\""[..]));
        let p = read(
            Api::Chat,
            r#"{"messages":[],"add_generation_prompt":false,"continue_final_message":true}"#,
        )
        .unwrap();
        let PromptInput::Chat(c) = p.input else {
            panic!("not chat")
        };
        assert!(!c.add_generation_prompt && c.sent_generation_prompt && c.continue_final_message);
    }

    #[test]
    fn truncation_keeps_the_last_tokens_unless_told_right() {
        let p = read(
            Api::Completions,
            r#"{"prompt":"a","truncate_prompt_tokens":2}"#,
        )
        .unwrap();
        let t = p.truncation.unwrap();
        let mut ids = vec![1, 2, 3, 4];
        t.apply(&mut ids);
        assert_eq!(ids, [3, 4]);
        let p = read(
            Api::Completions,
            r#"{"prompt":"a","truncate_prompt_tokens":2,"truncation_side":"right"}"#,
        )
        .unwrap();
        let mut ids = vec![1, 2, 3, 4];
        p.truncation.unwrap().apply(&mut ids);
        assert_eq!(ids, [1, 2]);
    }
}
