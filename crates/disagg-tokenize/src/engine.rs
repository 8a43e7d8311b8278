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
//!   `/tokenize` and `/v1/tokenize`): the same, plus `reasoning_effort` (never sent:
//!   see below); an absent `add_generation_prompt` renders the messages as for a chat
//!   completion, so it is sent only when the client sent it.
//!
//! Both answer `{"tokens": [...], "count": n, "max_model_len": m}`.
//!
//! A call that fails through the engine's fault (unreachable, 5xx, an oversized or
//! unusable answer) or outlasts the orchestrator's tokenize budget counts against the
//! engine ([`disagg_core::tokens::Asked`]): with passive health an engine whose
//! `/tokenize` hangs is ejected like one whose legs fail.
//!
//! What the engine's route does not see: vLLM's `/tokenize` ignores `documents` and
//! `reasoning_effort`, which its chat route passes to the template (the latter with the
//! `enable_thinking` it implies), so its ids for a chat that sets either would be those
//! of another render. Such a chat is [not supported](TokenizeError::NotSupported): it is
//! routed without ids, and the engine is not asked. The tokenizer does not know which
//! engine answers, so this holds for SGLang too, whose `/tokenize` would read
//! `reasoning_effort`: such a chat routes without ids there as well.

use std::cell::Cell;
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
use serde::de::{
    Deserialize, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor,
};
use serde_json::value::RawValue;

use crate::error::{EngineError, TokenizeError};
use crate::prompt::{
    BlockingLimit, Prompt, PromptInput, READ_OFF_LOOP_FROM, Truncation, off_loop, read_off_loop,
};
use crate::walk::{Skip, skip_map, skip_seq};
use crate::{Tokenize, Tokens};

mod max_len;
pub use max_len::TokenizeAnswer;

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
    blocking: BlockingLimit,
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
            blocking: BlockingLimit::default(),
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

    /// Bound this tokenizer's work on the blocking pool (reading a large body, checking
    /// its messages and writing its request) by `limit`, which other tokenizers may share;
    /// by default each tokenizer has its own, shared by its clones (see
    /// [`BlockingLimit`]). A caller that builds a tokenizer per request (one per engine
    /// asked) should give them all one limit, or it bounds nothing.
    pub fn with_blocking_limit(mut self, limit: BlockingLimit) -> Self {
        self.blocking = limit;
        self
    }

    /// The token ids of an already read prompt.
    ///
    /// # Errors
    ///
    /// As [`Tokenize::tokenize`].
    pub async fn tokenize_prompt(&self, prompt: &Prompt) -> Result<Tokens, TokenizeError> {
        self.ask(plan(prompt)?, prompt.truncation, &mut Asked::default())
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
        // Reading the prompt, checking the messages and writing the `/tokenize` request
        // each walk the body: a large one would hold the event loop, and every
        // connection on it, for milliseconds; see `READ_OFF_LOOP_FROM`. How many walk at
        // once is bounded; see `BlockingLimit`.
        let prepared = read_off_loop(&self.blocking, body, move |body| prepare(api, body)).await;
        let (plan, truncation) = match prepared {
            Some(prepared) => prepared?,
            None => prepare(api, body)?,
        };
        self.ask(plan, truncation, asked).await
    }

    /// The ids `plan` gives: its own, or the engine's answer to its request, truncated
    /// to `truncation`.
    async fn ask(
        &self,
        plan: Plan,
        truncation: Option<Truncation>,
        asked: &mut Asked,
    ) -> Result<Tokens, TokenizeError> {
        let body = match plan {
            Plan::Ids(ids) => return Ok(ids),
            Plan::Ask(body) => body,
        };
        let uri = self
            .endpoint
            .uri(self.path)
            .map_err(|e| TokenizeError::Engine(EngineError::Uri(e)))?;
        asked.engine = Some(Arc::clone(&self.endpoint));
        let answer = match fetch_answer(&*self.transport, uri, body, self.max_answer).await {
            // A large answer (up to `max_answer`, 64 MiB: some 150 ms for 8M ids) is
            // decoded off the event loop, as a large body is read.
            Ok(bytes) if bytes.len() >= READ_OFF_LOOP_FROM => {
                off_loop(&self.blocking, move || Ok(decode_answer(&bytes))).await?
            }
            Ok(bytes) => decode_answer(&bytes),
            Err(e) => Err(e),
        };
        asked.answered = match &answer {
            Ok(_) => true,
            Err(EngineError::Status { status, .. }) => status.is_client_error(),
            Err(_) => false,
        };
        let mut ids = answer.map_err(TokenizeError::Engine)?;
        if let Some(t) = &truncation {
            t.apply(&mut ids);
        }
        Ok(ids.into())
    }
}

/// What a prompt needs of the engine: nothing (a token-id prompt: its ids, truncated),
/// or an answer to this `/tokenize` request.
enum Plan {
    Ids(Tokens),
    Ask(Bytes),
}

/// The prompt of `body`, a request for `api`, read and checked ([`check_messages`]), as
/// a [`Plan`] and the truncation to apply to the engine's answer.
fn prepare(api: Api, body: &JsonBody) -> Result<(Plan, Option<Truncation>), TokenizeError> {
    let prompt = Prompt::read(api, body)?;
    if let PromptInput::Chat(chat) = &prompt.input {
        check_messages(&chat.messages)?;
    }
    Ok((plan(&prompt)?, prompt.truncation))
}

/// What `prompt` needs of the engine.
fn plan(prompt: &Prompt) -> Result<Plan, TokenizeError> {
    let special = match &prompt.input {
        PromptInput::Ids(ids) => {
            let mut ids = ids.clone();
            if let Some(t) = &prompt.truncation {
                t.apply(&mut ids);
            }
            return Ok(Plan::Ids(ids.into()));
        }
        PromptInput::Text {
            add_special_tokens, ..
        } => *add_special_tokens,
        PromptInput::Chat(chat) => {
            // vLLM's chat route passes these to the template (`documents`, and
            // `reasoning_effort` with the `enable_thinking` it implies); its `/tokenize`
            // ignores them, so its ids would be those of another render.
            if chat.documents.is_some() {
                return Err(TokenizeError::not_supported(
                    "documents, through the engine",
                ));
            }
            if chat.reasoning_effort.is_some() {
                return Err(TokenizeError::not_supported(
                    "reasoning_effort, through the engine",
                ));
            }
            chat.add_special_tokens
        }
    };
    // Without an explicit side vLLM truncates text inside the tokenizer, which keeps the
    // special tokens it adds; which of the answer's ids those are is not known here.
    if special && prompt.truncation.is_some_and(|t| t.side.is_none()) {
        return Err(TokenizeError::not_supported(
            "truncate_prompt_tokens with special tokens, through the engine",
        ));
    }
    match request_body(prompt)? {
        Some(body) => Ok(Plan::Ask(body)),
        None => Err(TokenizeError::not_supported("this prompt")),
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
///
/// The messages are walked one at a time and their content parts one at a time, each
/// parsed and dropped: nothing of the client's list is built, however long. Errors come
/// in the order of a reader that parses the whole list first: a malformed message is
/// reported before any content, then the first message whose content is malformed or
/// has other parts than text.
fn check_messages(raw: &[u8]) -> Result<(), TokenizeError> {
    match serde_json::from_slice::<Messages>(raw) {
        Ok(Messages(verdict)) => verdict,
        Err(_) => Err(TokenizeError::invalid(
            "messages",
            "expected a list of objects",
        )),
    }
}

/// A message as [`check_messages`] reads it: its content, raw (`None` when absent or
/// `null`).
///
/// Read as a derived struct would read it (an object, or a list whose first element is
/// the content; other fields skipped unchecked), except that a repeated `content`
/// counts by its last value, as the engines (Python's `json.loads`, then pydantic) and
/// the HF tokenizer read it: a derived struct refuses a repeated field. Every value of
/// a repeated key is parsed; only the last is checked.
struct Message<'a> {
    content: Option<&'a RawValue>,
}

impl<'de> Deserialize<'de> for Message<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Message<'de>, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Message<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a message")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Message<'de>, A::Error> {
                let mut content = None;
                while let Some(key) = map.next_key::<MessageKey>()? {
                    match key {
                        // The last of a repeated `content` wins.
                        MessageKey::Content => {
                            content = map.next_value::<Option<&'de RawValue>>()?
                        }
                        MessageKey::Other => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(Message { content })
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Message<'de>, A::Error> {
                // As serde reads a struct from a list: the first element is `content`
                // (the deserializer refuses more elements than the struct has fields).
                let content = seq.next_element::<Option<&'de RawValue>>()?.flatten();
                Ok(Message { content })
            }
        }
        d.deserialize_struct("Message", &["content"], V)
    }
}

/// A message's key: `content` or another.
enum MessageKey {
    Content,
    Other,
}

impl<'de> Deserialize<'de> for MessageKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<MessageKey, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = MessageKey;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a field name")
            }

            fn visit_str<E>(self, s: &str) -> Result<MessageKey, E> {
                Ok(if s == "content" {
                    MessageKey::Content
                } else {
                    MessageKey::Other
                })
            }
        }
        d.deserialize_identifier(V)
    }
}

/// The messages list, walked: the verdict on the first content that fails, if any.
struct Messages(Result<(), TokenizeError>);

impl<'de> Deserialize<'de> for Messages {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Messages, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Messages;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of messages")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Messages, A::Error> {
                let mut verdict = Ok(());
                while let Some(m) = seq.next_element::<Message<'de>>()? {
                    if verdict.is_ok()
                        && let Some(content) = m.content
                    {
                        verdict = check_content(content.get());
                    }
                }
                Ok(Messages(verdict))
            }
        }
        d.deserialize_seq(V)
    }
}

/// A message's content: a list must hold only text parts (a string, or an object whose
/// `type` is a text type); anything else is not a list and not checked.
fn check_content(content: &str) -> Result<(), TokenizeError> {
    if !content.starts_with('[') {
        return Ok(());
    }
    match serde_json::from_str::<TextOnly>(content) {
        Ok(TextOnly(true)) => Ok(()),
        Ok(TextOnly(false)) => Err(TokenizeError::not_supported("non-text content parts")),
        Err(_) => Err(TokenizeError::invalid(
            "messages",
            "content: expected a list",
        )),
    }
}

/// Whether every part of a content list is a text part (every part is parsed).
struct TextOnly(bool);

impl<'de> Deserialize<'de> for TextOnly {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<TextOnly, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TextOnly;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of content parts")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TextOnly, A::Error> {
                let mut text_only = true;
                while let Some(IsText(text)) = seq.next_element()? {
                    text_only &= text;
                }
                Ok(TextOnly(text_only))
            }
        }
        d.deserialize_seq(V)
    }
}

/// Whether a content part is text: a string; an object whose `type` (the last, when
/// repeated) is `text`, `input_text` or `output_text`; or, as serde reads a struct from
/// a list, a list of one such string.
struct IsText(bool);

impl<'de> Deserialize<'de> for IsText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<IsText, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = IsText;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a content part")
            }

            fn visit_str<E>(self, _: &str) -> Result<IsText, E> {
                Ok(IsText(true))
            }

            fn visit_bool<E>(self, _: bool) -> Result<IsText, E> {
                Ok(IsText(false))
            }

            fn visit_i64<E>(self, _: i64) -> Result<IsText, E> {
                Ok(IsText(false))
            }

            fn visit_u64<E>(self, _: u64) -> Result<IsText, E> {
                Ok(IsText(false))
            }

            fn visit_f64<E>(self, _: f64) -> Result<IsText, E> {
                Ok(IsText(false))
            }

            fn visit_unit<E>(self) -> Result<IsText, E> {
                Ok(IsText(false))
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<IsText, A::Error> {
                let mut text = false;
                while let Some(key) = map.next_key::<PartKey>()? {
                    match key {
                        PartKey::Type => text = map.next_value::<TextType>()?.0,
                        PartKey::Other => {
                            map.next_value::<Skip>()?;
                        }
                    }
                }
                Ok(IsText(text))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<IsText, A::Error> {
                let text = match seq.next_element::<TextType>()? {
                    None => false,
                    Some(TextType(first)) => first && seq.next_element::<Skip>()?.is_none(),
                };
                skip_seq(seq).map(|()| IsText(text))
            }
        }
        d.deserialize_any(V)
    }
}

/// A content part's key: `type` or another.
enum PartKey {
    Type,
    Other,
}

impl<'de> Deserialize<'de> for PartKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<PartKey, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = PartKey;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }

            fn visit_str<E>(self, s: &str) -> Result<PartKey, E> {
                Ok(if s == "type" {
                    PartKey::Type
                } else {
                    PartKey::Other
                })
            }
        }
        d.deserialize_str(V)
    }
}

/// Whether a value is the string `text`, `input_text` or `output_text` (anything else
/// is parsed, not kept).
struct TextType(bool);

impl<'de> Deserialize<'de> for TextType {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<TextType, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TextType;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }

            fn visit_str<E>(self, s: &str) -> Result<TextType, E> {
                Ok(TextType(matches!(s, "text" | "input_text" | "output_text")))
            }

            fn visit_bool<E>(self, _: bool) -> Result<TextType, E> {
                Ok(TextType(false))
            }

            fn visit_i64<E>(self, _: i64) -> Result<TextType, E> {
                Ok(TextType(false))
            }

            fn visit_u64<E>(self, _: u64) -> Result<TextType, E> {
                Ok(TextType(false))
            }

            fn visit_f64<E>(self, _: f64) -> Result<TextType, E> {
                Ok(TextType(false))
            }

            fn visit_unit<E>(self) -> Result<TextType, E> {
                Ok(TextType(false))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<TextType, A::Error> {
                skip_seq(seq).map(|()| TextType(false))
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<TextType, A::Error> {
                skip_map(map).map(|()| TextType(false))
            }
        }
        d.deserialize_any(V)
    }
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
        }
    }
    out.push(b'}');
    Ok(Some(Bytes::from(out)))
}

/// The bytes a `/tokenize` answer of at most `max_ids` token ids takes at most, the
/// most [`request_tokens`] reads: 12 per id (a `u32`'s ten digits and a separator,
/// `", "` included) and 4 KiB for the rest of the answer (`count`, `max_model_len`, a
/// `token_strs: null`), saturating.
pub fn answer_limit(max_ids: usize) -> usize {
    max_ids.saturating_mul(12).saturating_add(4 * 1024)
}

/// Why [`request_tokens`] or [`read_ids`] gave no token ids.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdsError {
    /// The list names more than `max` ids: it was read no further than the first id
    /// past the ceiling.
    #[error("more than {max} token ids")]
    TooMany {
        /// The ceiling.
        max: usize,
    },
    /// The `/tokenize` exchange failed, or its answer is not a `/tokenize` answer
    /// ([`EngineError::Decode`]).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The JSON given to [`read_ids`] is not a list of token ids.
    #[error("not a list of token ids")]
    Invalid(#[source] serde_json::Error),
    /// The decoding handed to the blocking pool was lost (the runtime shutting down).
    #[error("decoding the token ids on the blocking pool failed")]
    Blocking(#[source] TokenizeError),
}

/// The most bytes of an engine's error answer read, for the start of it kept in
/// [`EngineError::Status`].
const ERROR_READ: usize = 64 * 1024;

/// `POST body` to `uri` (an engine's `/tokenize`) and read the token ids it answers, at
/// most `max_ids` of them.
///
/// A successful answer is read up to [`answer_limit`]`(max_ids)` bytes: one longer
/// names more ids than that, or is not one an engine writes, and is read no further
/// ([`EngineError::Body`], whose source is `http_body_util`'s `LengthLimitError`). An
/// answer naming more than `max_ids` ids is [`IdsError::TooMany`] at the first id past
/// the ceiling, and no more than `max_ids` ids are held. An answer of
/// [`READ_OFF_LOOP_FROM`] bytes or more is decoded on the blocking pool, within
/// `blocking` (as [`EngineTokenizer`] decodes one). An error answer keeps its status and
/// the start of its body (of at most 64 KiB read).
///
/// # Errors
///
/// [`IdsError::TooMany`] past the ceiling; [`IdsError::Engine`] for no answer, an
/// error status, an unreadable or oversized body, or one that is not a `/tokenize`
/// answer; [`IdsError::Blocking`] when the blocking pool's job is lost.
pub async fn request_tokens(
    transport: &dyn Transport,
    uri: http::Uri,
    body: Bytes,
    max_ids: usize,
    blocking: &BlockingLimit,
) -> Result<Vec<u32>, IdsError> {
    let answer = request_answer(transport, uri, body, max_ids, blocking).await?;
    Ok(answer.ids)
}

/// [`request_tokens`], with the answer's `max_model_len` as well.
///
/// # Errors
///
/// As [`request_tokens`].
pub async fn request_answer(
    transport: &dyn Transport,
    uri: http::Uri,
    body: Bytes,
    max_ids: usize,
    blocking: &BlockingLimit,
) -> Result<TokenizeAnswer, IdsError> {
    let resp = send(transport, uri, body).await?;
    let status = resp.status();
    if !status.is_success() {
        let start = read_limited(resp.into_body(), ERROR_READ)
            .await
            .unwrap_or_default();
        let message = shown(&start);
        return Err(EngineError::Status { status, message }.into());
    }
    let bytes = read_limited(resp.into_body(), answer_limit(max_ids))
        .await
        .map_err(EngineError::Body)?;
    let decode = move |bytes: &[u8]| {
        let (over, max_model_len) = (Cell::new(false), Cell::new(None));
        let seed = AnswerSeed {
            max: max_ids,
            over: &over,
            max_model_len: &max_model_len,
        };
        let ids = finished(whole(bytes, seed), &over, max_ids).map_err(|e| match e {
            IdsError::Invalid(e) => IdsError::Engine(EngineError::Decode(e)),
            e => e,
        })?;
        let max_model_len = max_model_len.get();
        Ok(TokenizeAnswer { ids, max_model_len })
    };
    if bytes.len() < READ_OFF_LOOP_FROM {
        return decode(&bytes);
    }
    off_loop(blocking, move || Ok(decode(&bytes)))
        .await
        .map_err(IdsError::Blocking)?
}

/// The token ids of `json`, a JSON list of at most `max_ids` of them (a client's
/// prompt, say): the list is read no further than its first id past the ceiling, and
/// no more than `max_ids` ids are held. From [`READ_OFF_LOOP_FROM`] bytes on the list
/// is decoded on the blocking pool, within `blocking`.
///
/// # Errors
///
/// [`IdsError::TooMany`] past the ceiling, [`IdsError::Invalid`] when `json` is not
/// a list of `T`, [`IdsError::Blocking`] when the blocking pool's job is lost.
pub async fn read_ids<T>(
    json: Bytes,
    max_ids: usize,
    blocking: &BlockingLimit,
) -> Result<Vec<T>, IdsError>
where
    T: serde::de::DeserializeOwned + Send + 'static,
{
    let decode = move |json: &[u8]| {
        let over = Cell::new(false);
        let read = whole(json, AtMost::<T>::new(max_ids, &over));
        finished(read, &over, max_ids)
    };
    if json.len() < READ_OFF_LOOP_FROM {
        return decode(&json);
    }
    off_loop(blocking, move || Ok(decode(&json)))
        .await
        .map_err(IdsError::Blocking)?
}

/// `seed`'s reading of the JSON text `bytes`, which nothing but whitespace may follow.
fn whole<'de, S: DeserializeSeed<'de>>(bytes: &'de [u8], seed: S) -> serde_json::Result<S::Value> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = seed.deserialize(&mut de)?;
    de.end()?;
    Ok(value)
}

/// What a bounded decoding (`read`, whose seed set `over` past `max`) gives.
fn finished<T>(
    read: Result<T, serde_json::Error>,
    over: &Cell<bool>,
    max: usize,
) -> Result<T, IdsError> {
    match read {
        Err(_) if over.get() => Err(IdsError::TooMany { max }),
        Err(e) => Err(IdsError::Invalid(e)),
        Ok(v) => Ok(v),
    }
}

/// Reads a JSON list of ids into a `Vec` of at most `max` of them: at the list's
/// `max + 1`th id it sets `over` and fails, and the rest of the list is not read. The
/// `Vec` grows by at most doubling and never past `max` ids of capacity.
struct AtMost<'a, T> {
    max: usize,
    over: &'a Cell<bool>,
    id: std::marker::PhantomData<fn() -> T>,
}

impl<'a, T> AtMost<'a, T> {
    fn new(max: usize, over: &'a Cell<bool>) -> Self {
        AtMost {
            max,
            over,
            id: std::marker::PhantomData,
        }
    }
}

impl<'de, T: Deserialize<'de>> DeserializeSeed<'de> for AtMost<'_, T> {
    type Value = Vec<T>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<T>, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for AtMost<'_, T> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a list of at most {} token ids", self.max)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        let mut ids = Vec::new();
        while let Some(id) = seq.next_element::<T>()? {
            if ids.len() == self.max {
                self.over.set(true);
                return Err(serde::de::Error::custom(format_args!(
                    "more than {} token ids",
                    self.max
                )));
            }
            if ids.len() == ids.capacity() {
                ids.reserve_exact(ids.len().max(64).min(self.max - ids.len()));
            }
            ids.push(id);
        }
        Ok(ids)
    }
}

/// Reads a `/tokenize` answer (`{"tokens": [...], ...}`, the other members skipped)
/// into its ids, at most `max` of them ([`AtMost`]). A repeated or missing `tokens` is
/// refused, as a derived reading refuses them; a batch answer's list of lists is
/// refused too. Its `max_model_len` (the last one given) is set in `max_model_len`.
struct AnswerSeed<'a> {
    max: usize,
    over: &'a Cell<bool>,
    max_model_len: &'a Cell<Option<u64>>,
}

impl<'de> DeserializeSeed<'de> for AnswerSeed<'_> {
    type Value = Vec<u32>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<u32>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for AnswerSeed<'_> {
    type Value = Vec<u32>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a /tokenize answer")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Vec<u32>, A::Error> {
        use serde::de::Error;
        let mut tokens = None;
        while let Some(key) = map.next_key::<AnswerKey>()? {
            match key {
                AnswerKey::Tokens if tokens.is_some() => {
                    return Err(A::Error::duplicate_field("tokens"));
                }
                AnswerKey::Tokens => {
                    tokens = Some(map.next_value_seed(AtMost::<u32>::new(self.max, self.over))?);
                }
                AnswerKey::MaxModelLen => {
                    self.max_model_len
                        .set(map.next_value::<max_len::MaxLen>()?.0);
                }
                AnswerKey::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        tokens.ok_or_else(|| A::Error::missing_field("tokens"))
    }
}

/// A key of a `/tokenize` answer: `tokens` (escapes decoded) or another.
enum AnswerKey {
    Tokens,
    MaxModelLen,
    Other,
}

impl<'de> Deserialize<'de> for AnswerKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<AnswerKey, D::Error> {
        struct Key;
        impl Visitor<'_> for Key {
            type Value = AnswerKey;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E>(self, s: &str) -> Result<AnswerKey, E> {
                Ok(match s {
                    "tokens" => AnswerKey::Tokens,
                    "max_model_len" => AnswerKey::MaxModelLen,
                    _ => AnswerKey::Other,
                })
            }
        }
        d.deserialize_identifier(Key)
    }
}

/// `POST body` to `uri` (an engine's `/tokenize`): the answer's head.
async fn send(
    transport: &dyn Transport,
    uri: http::Uri,
    body: Bytes,
) -> Result<http::Response<disagg_core::transport::BoxBody>, EngineError> {
    let mut req = http::Request::new(body);
    *req.method_mut() = http::Method::POST;
    *req.uri_mut() = uri;
    req.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    transport.send(req).await.map_err(EngineError::Transport)
}

/// `bytes`, the body of an answer of `status`, when the status is a success; else the
/// engine's error, keeping its status and the start of its body.
fn judged(status: http::StatusCode, bytes: Bytes) -> Result<Bytes, EngineError> {
    if !status.is_success() {
        return Err(EngineError::Status {
            status,
            message: shown(&bytes),
        });
    }
    Ok(bytes)
}

/// The start of an error answer's body (512 bytes), as text.
fn shown(body: &[u8]) -> String {
    String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned()
}

/// The body of a successful answer to `POST body` at `uri`, at most `max_answer` bytes.
async fn fetch_answer(
    transport: &dyn Transport,
    uri: http::Uri,
    body: Bytes,
    max_answer: usize,
) -> Result<Bytes, EngineError> {
    let resp = send(transport, uri, body).await?;
    let status = resp.status();
    let bytes = read_limited(resp.into_body(), max_answer)
        .await
        .map_err(EngineError::Body)?;
    judged(status, bytes)
}

/// The token ids of a `/tokenize` answer, however many.
fn decode_answer(bytes: &[u8]) -> Result<Vec<u32>, EngineError> {
    let (over, max_model_len) = (Cell::new(false), Cell::new(None));
    let seed = AnswerSeed {
        max: usize::MAX,
        over: &over,
        max_model_len: &max_model_len,
    };
    whole(bytes, seed).map_err(EngineError::Decode)
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
            // `reasoning_effort` is never sent: such a chat is not asked of the engine.
            r#"{"model":"m","messages":[],"add_generation_prompt":false,"continue_final_message":true,"add_special_tokens":true,"tools":[{"type":"function","function":{"name":"f"}}],"chat_template_kwargs":{"enable_thinking":false}}"#
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

    /// A repeated key of a message counts by its last value, as the engines
    /// (`json.loads`, then pydantic) and the HF tokenizer read it: only the last
    /// `content` is checked, and a repeated `role` (or any other field) is no error.
    #[test]
    fn a_repeated_key_counts_by_its_last_value() {
        let image = r#"{"type":"image_url","image_url":{"url":"x"}}"#;
        // An earlier value the check would refuse is overridden by a valid last one.
        for ok in [
            r#"[{"role":"user","content":[1e400],"content":"hello"}]"#.to_owned(),
            format!(
                r#"[{{"role":"user","content":[{image}],"content":[{{"type":"text","text":"a"}}]}}]"#
            ),
            format!(r#"[{{"role":"user","content":[{image}],"content":null}}]"#),
            r#"[{"role":"user","role":"assistant","content":"a","content":"b"}]"#.into(),
            r#"[{"role":"user","content":[{"type":"image","type":"text","text":"a","text":"b"}]}]"#
                .into(),
        ] {
            assert!(check_messages(ok.as_bytes()).is_ok(), "{ok}");
        }
        // A valid earlier value does not save an invalid last one.
        let err = check_messages(br#"[{"role":"user","content":"hello","content":[1e400]}]"#)
            .unwrap_err();
        assert!(
            matches!(
                err,
                TokenizeError::Invalid {
                    field: "messages",
                    ..
                }
            ),
            "{err:?}"
        );
        let err = check_messages(
            format!(r#"[{{"role":"user","content":"hello","content":[{image}]}}]"#).as_bytes(),
        )
        .unwrap_err();
        assert!(err.is_not_supported(), "{err:?}");
    }

    /// The messages check as it was, building each message and content list: the
    /// reference the walking check is checked against. A message object is built as a
    /// map (the last of a repeated key wins, as in Python's `json.loads`); a message
    /// written as a list is read by a derived struct, as serde reads a struct from a
    /// list.
    fn check_messages_as_value(raw: &[u8]) -> Result<(), TokenizeError> {
        #[derive(serde::Deserialize)]
        struct Part<'a> {
            #[serde(rename = "type", default)]
            kind: Option<&'a str>,
        }
        #[derive(serde::Deserialize)]
        struct ListMessage<'a> {
            #[serde(borrow, default)]
            content: Option<&'a RawValue>,
        }
        let malformed = || TokenizeError::invalid("messages", "expected a list of objects");
        let messages: Vec<&RawValue> = serde_json::from_slice(raw).map_err(|_| malformed())?;
        let mut contents = Vec::with_capacity(messages.len());
        for m in messages {
            let content = if m.get().starts_with('{') {
                let map: std::collections::BTreeMap<String, &RawValue> =
                    serde_json::from_str(m.get()).map_err(|_| malformed())?;
                map.get("content").copied().filter(|c| c.get() != "null")
            } else {
                serde_json::from_str::<ListMessage<'_>>(m.get())
                    .map_err(|_| malformed())?
                    .content
            };
            contents.push(content);
        }
        for content in contents {
            let Some(content) = content else { continue };
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

    /// The walking check answers every list of messages, malformed ones included, as
    /// the one that built the content parts did, in the same order.
    #[test]
    fn messages_check_answers_as_the_value_check() {
        let text = r#"{"type":"text","text":"a"}"#;
        let image = r#"{"type":"image_url","image_url":{"url":"x"}}"#;
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        let messages = [
            "[]".to_owned(),
            r#"[{"role":"user","content":"x"}]"#.into(),
            r#"[{"role":"user","content":null}]"#.into(),
            r#"[{"role":"user"}]"#.into(),
            r#"[{}]"#.into(),
            format!(r#"[{{"role":"user","content":[{text},"b",{text}]}}]"#),
            format!(r#"[{{"role":"user","content":[{text},{image}]}}]"#),
            format!(r#"[{{"role":"user","content":[{image},1e400]}}]"#),
            format!(r#"[{{"content":[{image}]}},{{"content":[1e400]}}]"#),
            format!(r#"[{{"content":[1e400]}},{{"content":[{image}]}}]"#),
            format!(r#"[{{"content":[{image}]}},5]"#),
            format!(r#"[{{"content":[{image}]}},{{"content":1,"content":2}}]"#),
            r#"[{"content":[1e400],"content":"x"}]"#.into(),
            r#"[{"content":"x","content":[1e400]}]"#.into(),
            r#"[{"content":[1e400],"content":null}]"#.into(),
            r#"[{"content":[1e400,],"content":"x"}]"#.into(),
            r#"[{"content":"x","cont\u0065nt":[1e400]}]"#.into(),
            format!(r#"[{{"content":[{image}],"content":[{text}]}}]"#),
            format!(r#"[{{"content":[{text}],"content":[{image}]}}]"#),
            format!(
                r#"[{{"content":[{image}],"content":"x"}},{{"content":"y","content":[{image}]}}]"#
            ),
            format!(r#"[{{"content":"x","content":[{image}]}},{{"content":[1e400]}}]"#),
            r#"[{"role":"user","role":"assistant","content":"x","role":5}]"#.into(),
            r#"[{"content":[{"type":"input_text"},{"type":"output_text"}]}]"#.into(),
            r#"[{"content":[{"type":"te\u0078t"}]}]"#.into(),
            r#"[{"content":[{"type":"image","type":"text"}]}]"#.into(),
            r#"[{"content":[{"type":"text","type":"image"}]}]"#.into(),
            r#"[{"content":[{"type":"text","type":null}]}]"#.into(),
            r#"[{"content":[{"type":null}]}]"#.into(),
            r#"[{"content":[{"type":5}]}]"#.into(),
            r#"[{"content":[{"type":["text"]}]}]"#.into(),
            r#"[{"content":[{"text":"a"}]}]"#.into(),
            r#"[{"content":[{"type":"text","text":1e400}]}]"#.into(),
            r#"[{"content":[{"type":"text","text":"\ud800"}]}]"#.into(),
            r#"[{"content":["\ud800"]}]"#.into(),
            r#"[{"content":[["text"]]}]"#.into(),
            r#"[{"content":[["input_text"]]}]"#.into(),
            r#"[{"content":[["text",1]]}]"#.into(),
            r#"[{"content":[["image"]]}]"#.into(),
            r#"[{"content":[[null]]}]"#.into(),
            r#"[{"content":[[]]}]"#.into(),
            r#"[{"content":[[5]]}]"#.into(),
            r#"[{"content":[["text",1e400]]}]"#.into(),
            r#"[{"content":[5]}]"#.into(),
            r#"[{"content":[true]}]"#.into(),
            r#"[{"content":[null]}]"#.into(),
            r#"[{"content":[]}]"#.into(),
            r#"[{"content":{"type":"image"}}]"#.into(),
            r#"[[]]"#.into(),
            r#"[["x"]]"#.into(),
            format!(r#"[[[{image}]]]"#),
            r#"[["x","y"]]"#.into(),
            r#"[5]"#.into(),
            r#"["x"]"#.into(),
            r#"[null]"#.into(),
            r#"[{"content":[{"type":"text"}],"role":1e400}]"#.into(),
            format!(r#"[{{"content":{}}}]"#, deep(128)),
            format!(r#"[{{"content":{}}}]"#, deep(129)),
            format!(r#"[{{"content":[{{"type":"text","x":{}}}]}}]"#, deep(125)),
            format!(r#"[{{"content":[{{"type":"text","x":{}}}]}}]"#, deep(126)),
        ];
        for raw in &messages {
            assert_eq!(
                format!("{:?}", check_messages(raw.as_bytes())),
                format!("{:?}", check_messages_as_value(raw.as_bytes())),
                "{raw}"
            );
        }
    }

    /// A transport never called: token-id prompts are answered without the engine.
    struct Unused;

    impl Transport for Unused {
        fn send(&self, _: http::Request<Bytes>) -> disagg_core::transport::ResponseFuture {
            unreachable!("token ids never reach the engine")
        }
    }

    /// A large body is read within the limit the tokenizer is given: while its one
    /// place is taken the call waits (nothing read); once it is free the ids come. A
    /// small body is read inline, whatever the limit.
    #[tokio::test]
    async fn a_large_body_waits_for_a_place_in_the_tokenizers_limit() {
        let limit = BlockingLimit::new(1);
        let endpoint = Endpoint::new("http://127.0.0.1:9", disagg_core::Role::Prefill).unwrap();
        let t = EngineTokenizer::new(Arc::new(Unused), Arc::new(endpoint))
            .with_blocking_limit(limit.clone());
        let ids: Vec<u32> = (0..80_000).collect();
        let large = format!(r#"{{"prompt":{}}}"#, serde_json::to_string(&ids).unwrap());
        assert!(large.len() >= crate::prompt::READ_OFF_LOOP_FROM);
        let large = JsonBody::parse(large.as_bytes()).unwrap();
        let small = JsonBody::parse(br#"{"prompt":[1,2,3]}"#).unwrap();

        let place = limit.acquire().await.unwrap();
        let wait = std::time::Duration::from_millis(200);
        let waited = tokio::time::timeout(wait, t.tokenize(Api::Completions, &large)).await;
        assert!(waited.is_err(), "{waited:?}");
        assert_eq!(
            &*t.tokenize(Api::Completions, &small).await.unwrap(),
            [1, 2, 3]
        );
        drop(place);
        assert_eq!(
            &*t.tokenize(Api::Completions, &large).await.unwrap(),
            &ids[..]
        );
    }

    /// A reader that counts the bytes taken from it (`serde_json` reads one at a time).
    struct Counted<'a> {
        rest: &'a [u8],
        read: usize,
    }

    impl std::io::Read for Counted<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = buf.len().min(self.rest.len());
            buf[..n].copy_from_slice(&self.rest[..n]);
            self.rest = &self.rest[n..];
            self.read += n;
            Ok(n)
        }
    }

    /// The bounded decoder fails at the first id past its ceiling and reads no further:
    /// of a list (or an answer) of 100,001 ids, a ceiling of 4 reads the first five and
    /// the byte or two that end the fifth.
    #[test]
    fn the_id_decoder_stops_at_the_first_id_past_its_ceiling() {
        let list = format!("[{}0]", "0,".repeat(100_000));
        let over = Cell::new(false);
        let mut r = Counted {
            rest: list.as_bytes(),
            read: 0,
        };
        let got = AtMost::<u64>::new(4, &over)
            .deserialize(&mut serde_json::Deserializer::from_reader(&mut r));
        assert!(got.is_err() && over.get(), "{got:?}");
        // The parser may look a byte or two ahead.
        assert!(r.read <= "[0,0,0,0,0,".len() + 2, "{} bytes", r.read);

        let answer = format!(r#"{{"count":100001,"tokens":{list},"max_model_len":8}}"#);
        let over = Cell::new(false);
        let mut r = Counted {
            rest: answer.as_bytes(),
            read: 0,
        };
        let seed = AnswerSeed {
            max: 4,
            over: &over,
            max_model_len: &Cell::new(None),
        };
        let got = seed.deserialize(&mut serde_json::Deserializer::from_reader(&mut r));
        assert!(got.is_err() && over.get(), "{got:?}");
        assert!(
            r.read <= r#"{"count":100001,"tokens":[0,0,0,0,0,"#.len() + 2,
            "{} bytes",
            r.read
        );
    }

    /// At the ceiling every id is kept, in a `Vec` whose capacity never passes the
    /// ceiling; one more is refused as too many, whatever follows; what is no list of
    /// ids, or no answer, is refused as such.
    #[tokio::test]
    async fn bounded_lists_hold_at_most_their_ceiling() {
        let limit = BlockingLimit::default();
        for (n, max) in [(4, 4), (70, 70), (70, 100), (0, 0), (1000, 1000)] {
            let ids: Vec<u64> = (0..n).collect();
            let json = Bytes::from(serde_json::to_vec(&ids).unwrap());
            let over = Cell::new(false);
            let got = whole(&json, AtMost::<u64>::new(max, &over)).unwrap();
            assert_eq!(got, ids);
            assert!(got.capacity() <= max, "{n} of {max}");
            assert_eq!(read_ids::<u64>(json, max, &limit).await.unwrap(), ids);
        }
        for json in ["[1,2,3,4,5]", "[1,2,3,4,5,\"x\"]", "[1,2,3,4,5,"] {
            let got = read_ids::<u64>(Bytes::from(json), 4, &limit).await;
            assert!(
                matches!(got, Err(IdsError::TooMany { max: 4 })),
                "{json}: {got:?}"
            );
        }
        for json in ["[1,\"x\"]", "[1,2] 3", "{}", "[-1]", "[1,2"] {
            let got = read_ids::<u64>(Bytes::from(json), 4, &limit).await;
            assert!(matches!(got, Err(IdsError::Invalid(_))), "{json}: {got:?}");
        }
        // A `/tokenize` answer: `tokens` once, the other members skipped.
        let answer = |json: &str| decode_answer(json.as_bytes());
        assert_eq!(
            answer(r#"{"count":2,"tok\u0065ns":[7,8],"x":{"tokens":[]}}"#).unwrap(),
            [7, 8]
        );
        for bad in [
            r#"{"tokens":[1],"tokens":[2]}"#,
            r#"{"count":1}"#,
            r#"{"tokens":[[1]]}"#,
            r#"[[1]]"#,
            r#"{"tokens":[4294967296]}"#,
            r#"{"tokens":[1]} x"#,
        ] {
            assert!(answer(bad).is_err(), "{bad}");
        }
    }

    /// Answers `/tokenize` with `.0` under the status `.1`.
    struct Answering(&'static str, http::StatusCode);

    impl Transport for Answering {
        fn send(&self, _: http::Request<Bytes>) -> disagg_core::transport::ResponseFuture {
            use http_body_util::BodyExt;
            let body = http_body_util::Full::new(Bytes::from_static(self.0.as_bytes()))
                .map_err(|never| match never {})
                .boxed();
            let mut resp = http::Response::new(body);
            *resp.status_mut() = self.1;
            Box::pin(std::future::ready(Ok(resp)))
        }
    }

    /// `request_answer` gives the answer's `max_model_len` when it is a positive
    /// integer, `None` for any other value or none, and still reads the ids.
    #[tokio::test]
    async fn request_answer_reads_the_context_length() {
        let limit = BlockingLimit::default();
        let uri: http::Uri = "http://127.0.0.1:9/tokenize".parse().unwrap();
        for (answer, want) in [
            (r#"{"count":2,"max_model_len":8,"tokens":[1,2]}"#, Some(8)),
            (r#"{"tokens":[1,2],"max_model_len":131072}"#, Some(131_072)),
            (r#"{"tokens":[1,2]}"#, None),
            (r#"{"tokens":[1,2],"max_model_len":0}"#, None),
            (r#"{"tokens":[1,2],"max_model_len":-3}"#, None),
            (r#"{"tokens":[1,2],"max_model_len":"8"}"#, None),
            (r#"{"tokens":[1,2],"max_model_len":null}"#, None),
            (r#"{"tokens":[1,2],"max_model_len":{"a":[1]}}"#, None),
        ] {
            let t = Answering(answer, http::StatusCode::OK);
            let got = request_answer(&t, uri.clone(), Bytes::new(), 4, &limit)
                .await
                .unwrap();
            assert_eq!((got.ids, got.max_model_len), (vec![1, 2], want), "{answer}");
        }
    }

    /// `request_tokens` reads a successful answer up to `answer_limit(max_ids)` bytes
    /// (the widest answer of `max_ids` ids fits), refuses one naming more ids as too
    /// many, and keeps an error answer's status and start, however long the answer.
    #[tokio::test]
    async fn request_tokens_holds_the_answer_to_the_id_ceiling() {
        let limit = BlockingLimit::default();
        let uri: http::Uri = "http://127.0.0.1:9/tokenize".parse().unwrap();
        let ask = |answer: &'static str, status| {
            let uri = uri.clone();
            let limit = limit.clone();
            async move {
                let t = Answering(answer, status);
                request_tokens(&t, uri, Bytes::new(), 4, &limit).await
            }
        };
        let widest = r#"{"count":4, "max_model_len":131072, "tokens":[4294967295, 4294967295, 4294967295, 4294967295], "token_strs":null}"#;
        assert_eq!(
            ask(widest, http::StatusCode::OK).await.unwrap(),
            [u32::MAX; 4]
        );
        let five = r#"{"tokens":[1,2,3,4,5]}"#;
        let got = ask(five, http::StatusCode::OK).await;
        assert!(matches!(got, Err(IdsError::TooMany { max: 4 })), "{got:?}");
        let long: &'static str =
            Box::leak(format!(r#"{{"tokens":[{}0]}}"#, "0,".repeat(4096)).into_boxed_str());
        assert!(long.len() > answer_limit(4));
        match ask(long, http::StatusCode::OK).await {
            Err(IdsError::Engine(EngineError::Body(e))) => {
                assert!(e.is::<http_body_util::LengthLimitError>(), "{e}");
            }
            got => panic!("{got:?}"),
        }
        match ask(long, http::StatusCode::BAD_REQUEST).await {
            Err(IdsError::Engine(EngineError::Status { status, message })) => {
                assert_eq!(status, http::StatusCode::BAD_REQUEST);
                assert_eq!(message, &long[..512]);
            }
            got => panic!("{got:?}"),
        }
        let got = ask("[1]", http::StatusCode::OK).await;
        assert!(
            matches!(got, Err(IdsError::Engine(EngineError::Decode(_)))),
            "{got:?}"
        );
    }
}
