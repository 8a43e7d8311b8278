//! [`EngineTokenizer`]: the engine's own `POST /tokenize`.
//!
//! Exact by construction (the engine tokenizes with its own tokenizer and template),
//! at the price of one loopback or network round trip per request before routing.
//!
//! The request body carries the fields both engines read:
//! - vLLM 0.33 (`vllm/entrypoints/serve/tokenize/protocol.py`): `{"model", "prompt",
//!   "add_special_tokens"}` or `{"model", "messages", "add_generation_prompt",
//!   "continue_final_message", "add_special_tokens", "chat_template_kwargs", "tools"}`;
//! - SGLang 0.5.23 (`sglang/srt/entrypoints/openai/protocol.py`, `TokenizeRequest`, at
//!   `/tokenize` and `/v1/tokenize`): the same, plus `reasoning_effort`; an absent
//!   `add_generation_prompt` renders the messages as for a chat completion, so it is
//!   sent only when the client sent it.
//!
//! Both answer `{"tokens": [...], "count": n, "max_model_len": m}`.
//!
//! A call that fails through the engine's fault (unreachable, 5xx, an oversized or
//! unusable answer) or outlasts the orchestrator's tokenize budget counts against the
//! engine ([`disagg_core::tokens::Asked`]): with passive health an engine whose
//! `/tokenize` hangs is ejected like one whose legs fail.
//!
//! What the engine's route does not see: vLLM's `/tokenize` ignores `documents` and
//! `reasoning_effort`, which its chat route passes to the template; a request setting
//! them may tokenize differently there.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use disagg_core::endpoint::Endpoint;
use disagg_core::json::JsonBody;
use disagg_core::request::Api;
use disagg_core::tokens::Asked;
use disagg_core::transport::{Transport, read_limited};
use http::{HeaderValue, header};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::error::{EngineError, TokenizeError};
use crate::prompt::{Prompt, PromptInput};
use crate::{Tokenize, Tokens};

/// The largest `/tokenize` answer read by default: room for a prompt of a few million
/// tokens written as decimal ids.
pub const DEFAULT_MAX_ANSWER: usize = 64 * 1024 * 1024;

/// Tokenizes through an engine's `POST /tokenize`.
///
/// Any engine serving the model will do: they share its tokenizer. Token-id prompts are
/// answered without asking the engine.
///
/// # Examples
///
/// ```no_run
/// use std::sync::Arc;
///
/// use disagg_core::{Endpoint, Role};
/// use disagg_tokenize::EngineTokenizer;
///
/// # fn doc(transport: Arc<dyn disagg_core::transport::Transport>) -> Result<(), Box<dyn std::error::Error>> {
/// let engine = Arc::new(Endpoint::new("http://10.0.0.5:8000", Role::Prefill)?);
/// let tokenizer = EngineTokenizer::new(transport, engine);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct EngineTokenizer {
    transport: Arc<dyn Transport>,
    endpoint: Arc<Endpoint>,
    path: &'static str,
    max_answer: usize,
}

impl fmt::Debug for EngineTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineTokenizer")
            .field("endpoint", &self.endpoint.id())
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl EngineTokenizer {
    /// Tokenize through `endpoint`'s `/tokenize`, sent over `transport`.
    pub fn new(transport: Arc<dyn Transport>, endpoint: Arc<Endpoint>) -> Self {
        EngineTokenizer {
            transport,
            endpoint,
            path: "/tokenize",
            max_answer: DEFAULT_MAX_ANSWER,
        }
    }

    /// Use another path than `/tokenize` (SGLang also serves `/v1/tokenize`).
    pub fn with_path(mut self, path: &'static str) -> Self {
        self.path = path;
        self
    }

    /// The largest answer read, in bytes ([`DEFAULT_MAX_ANSWER`] by default).
    pub fn with_max_answer(mut self, bytes: usize) -> Self {
        self.max_answer = bytes;
        self
    }

    /// The token ids of an already read prompt.
    ///
    /// # Errors
    ///
    /// As [`Tokenize::tokenize`].
    pub async fn tokenize_prompt(&self, prompt: &Prompt) -> Result<Tokens, TokenizeError> {
        self.tokenize_prompt_asking(prompt, &mut Asked::default())
            .await
    }

    /// [`Tokenize::tokenize`], telling `asked` that this tokenizer's engine is asked
    /// (when the prompt needs the engine at all) and whether it answered: with ids, or
    /// with a 4xx the request caused. A transport error, a 5xx, an oversized or
    /// unusable answer leave it unanswered: the engine's fault (see
    /// [`disagg_core::tokens`]).
    ///
    /// # Errors
    ///
    /// As [`Tokenize::tokenize`].
    pub async fn tokenize_asking(
        &self,
        api: Api,
        body: &JsonBody,
        asked: &mut Asked,
    ) -> Result<Tokens, TokenizeError> {
        let prompt = Prompt::read(api, body)?;
        if let PromptInput::Chat(chat) = &prompt.input {
            check_messages(&chat.messages)?;
        }
        self.tokenize_prompt_asking(&prompt, asked).await
    }

    async fn tokenize_prompt_asking(
        &self,
        prompt: &Prompt,
        asked: &mut Asked,
    ) -> Result<Tokens, TokenizeError> {
        let mut ids = match &prompt.input {
            PromptInput::Ids(ids) => ids.clone(),
            _ => {
                // Without an explicit side vLLM truncates text inside the tokenizer,
                // which keeps the special tokens it adds; which of the answer's ids
                // those are is not known here.
                let special = match &prompt.input {
                    PromptInput::Text {
                        add_special_tokens, ..
                    } => *add_special_tokens,
                    PromptInput::Chat(chat) => chat.add_special_tokens,
                    PromptInput::Ids(_) => false,
                };
                if special && prompt.truncation.is_some_and(|t| t.side.is_none()) {
                    return Err(TokenizeError::not_supported(
                        "truncate_prompt_tokens with special tokens, through the engine",
                    ));
                }
                let Some(body) = request_body(prompt)? else {
                    return Err(TokenizeError::not_supported("this prompt"));
                };
                let uri = self
                    .endpoint
                    .uri(self.path)
                    .map_err(|e| TokenizeError::Engine(EngineError::Uri(e)))?;
                asked.engine = Some(Arc::clone(&self.endpoint));
                let answer = request_tokens(&*self.transport, uri, body, self.max_answer).await;
                asked.answered = match &answer {
                    Ok(_) => true,
                    Err(EngineError::Status { status, .. }) => status.is_client_error(),
                    Err(_) => false,
                };
                answer.map_err(TokenizeError::Engine)?
            }
        };
        if let Some(t) = &prompt.truncation {
            t.apply(&mut ids);
        }
        Ok(ids.into())
    }
}

#[async_trait]
impl Tokenize for EngineTokenizer {
    async fn tokenize(&self, api: Api, body: &JsonBody) -> Result<Tokens, TokenizeError> {
        self.tokenize_asking(api, body, &mut Asked::default()).await
    }
}

/// Refuse what the engine would tokenize but not as one text sequence: messages with
/// other content parts than text (images, audio, video, embeddings).
fn check_messages(raw: &[u8]) -> Result<(), TokenizeError> {
    #[derive(Deserialize)]
    struct Message<'a> {
        #[serde(borrow, default)]
        content: Option<&'a RawValue>,
    }
    #[derive(Deserialize)]
    struct Part<'a> {
        #[serde(rename = "type", default)]
        kind: Option<&'a str>,
    }
    let messages: Vec<Message<'_>> = serde_json::from_slice(raw)
        .map_err(|_| TokenizeError::invalid("messages", "expected a list of objects"))?;
    for m in messages {
        let Some(content) = m.content else { continue };
        if !content.get().starts_with('[') {
            continue;
        }
        let parts: Vec<serde_json::Value> = serde_json::from_str(content.get())
            .map_err(|_| TokenizeError::invalid("messages", "content: expected a list"))?;
        for part in parts {
            if part.is_string() {
                continue;
            }
            let kind = Part::deserialize(&part)
                .ok()
                .and_then(|p| p.kind.map(str::to_owned));
            if !matches!(kind.as_deref(), Some("text" | "input_text" | "output_text")) {
                return Err(TokenizeError::not_supported("non-text content parts"));
            }
        }
    }
    Ok(())
}

/// The `/tokenize` body for `prompt`, or `None` when it is token ids already.
///
/// Fields the client left out are left out (each engine applies its own default, and
/// SGLang's differ in meaning when present); `model` is forwarded so the engine checks
/// it as its chat and completions routes do.
///
/// # Errors
///
/// [`TokenizeError::Invalid`] when a value cannot be encoded (never for a prompt read
/// by [`Prompt::read`]).
pub fn request_body(prompt: &Prompt) -> Result<Option<Bytes>, TokenizeError> {
    let mut out = Vec::with_capacity(256);
    out.push(b'{');
    let field = |out: &mut Vec<u8>, key: &str, raw: &[u8]| {
        if out.len() > 1 {
            out.push(b',');
        }
        out.push(b'"');
        out.extend_from_slice(key.as_bytes());
        out.extend_from_slice(b"\":");
        out.extend_from_slice(raw);
    };
    if let Some(model) = &prompt.model {
        field(&mut out, "model", model);
    }
    let boolean = |b: bool| if b { &b"true"[..] } else { &b"false"[..] };
    match &prompt.input {
        PromptInput::Ids(_) => return Ok(None),
        PromptInput::Text {
            text,
            add_special_tokens,
        } => {
            let text = serde_json::to_vec(text)
                .map_err(|_| TokenizeError::invalid("prompt", "cannot be encoded"))?;
            field(&mut out, "prompt", &text);
            field(&mut out, "add_special_tokens", boolean(*add_special_tokens));
        }
        PromptInput::Chat(chat) => {
            field(&mut out, "messages", &chat.messages);
            if chat.sent_generation_prompt {
                field(
                    &mut out,
                    "add_generation_prompt",
                    boolean(chat.add_generation_prompt),
                );
            }
            if chat.continue_final_message {
                field(&mut out, "continue_final_message", b"true");
            }
            if chat.sent_special_tokens {
                field(
                    &mut out,
                    "add_special_tokens",
                    boolean(chat.add_special_tokens),
                );
            }
            for (key, raw) in [
                ("tools", &chat.tools),
                ("chat_template_kwargs", &chat.chat_template_kwargs),
            ] {
                if let Some(raw) = raw {
                    field(&mut out, key, raw);
                }
            }
            if let Some(effort) = &chat.reasoning_effort {
                let effort = serde_json::to_vec(effort)
                    .map_err(|_| TokenizeError::invalid("reasoning_effort", "cannot be encoded"))?;
                field(&mut out, "reasoning_effort", &effort);
            }
        }
    }
    out.push(b'}');
    Ok(Some(Bytes::from(out)))
}

/// A `/tokenize` answer: one list of ids (a batch answer's list of lists is refused).
#[derive(Deserialize)]
struct Answer {
    tokens: Vec<u32>,
}

/// `POST body` to `uri` (an engine's `/tokenize`) and read the token ids it answers.
///
/// At most `max_answer` bytes of answer are read. The engine's error answers keep their
/// status and the start of their body.
///
/// # Errors
///
/// [`EngineError`] for no answer, an error status, an unreadable or oversized body, or
/// one that is not a `/tokenize` answer.
pub async fn request_tokens(
    transport: &dyn Transport,
    uri: http::Uri,
    body: Bytes,
    max_answer: usize,
) -> Result<Vec<u32>, EngineError> {
    let mut req = http::Request::new(body);
    *req.method_mut() = http::Method::POST;
    *req.uri_mut() = uri;
    req.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let resp = transport.send(req).await.map_err(EngineError::Transport)?;
    let status = resp.status();
    let bytes = read_limited(resp.into_body(), max_answer)
        .await
        .map_err(EngineError::Body)?;
    if !status.is_success() {
        let shown = String::from_utf8_lossy(&bytes[..bytes.len().min(512)]).into_owned();
        return Err(EngineError::Status {
            status,
            message: shown,
        });
    }
    let answer: Answer = serde_json::from_slice(&bytes).map_err(EngineError::Decode)?;
    Ok(answer.tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(api: Api, json: &str) -> Option<String> {
        let prompt = Prompt::read(api, &JsonBody::parse(json.as_bytes()).unwrap()).unwrap();
        request_body(&prompt)
            .unwrap()
            .map(|b| String::from_utf8(b.to_vec()).unwrap())
    }

    #[test]
    fn completions_body_carries_the_prompt_and_special_tokens() {
        assert_eq!(
            body(
                Api::Completions,
                r#"{"model":"m","prompt":"a \"b\"","max_tokens":3}"#
            )
            .unwrap(),
            r#"{"model":"m","prompt":"a \"b\"","add_special_tokens":true}"#
        );
        assert_eq!(body(Api::Completions, r#"{"prompt":[1,2]}"#), None);
    }

    #[test]
    fn chat_body_forwards_only_what_the_client_sent() {
        assert_eq!(
            body(
                Api::Chat,
                r#"{"messages":[{"role":"user","content":"x"}],"stream":true}"#
            )
            .unwrap(),
            r#"{"messages":[{"role":"user","content":"x"}]}"#
        );
        assert_eq!(
            body(
                Api::Chat,
                r#"{"model":"m","messages":[],"add_generation_prompt":false,"continue_final_message":true,"add_special_tokens":"yes","tools":[{"type":"function","function":{"name":"f"}}],"chat_template_kwargs":{"enable_thinking":false},"reasoning_effort":"low"}"#
            )
            .unwrap(),
            r#"{"model":"m","messages":[],"add_generation_prompt":false,"continue_final_message":true,"add_special_tokens":true,"tools":[{"type":"function","function":{"name":"f"}}],"chat_template_kwargs":{"enable_thinking":false},"reasoning_effort":"low"}"#
        );
    }

    #[test]
    fn non_text_parts_are_not_supported() {
        assert!(
            check_messages(br#"[{"role":"user","content":[{"type":"text","text":"a"},"b"]}]"#)
                .is_ok()
        );
        let err = check_messages(
            br#"[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]"#,
        )
        .unwrap_err();
        assert!(err.is_not_supported());
    }
}
