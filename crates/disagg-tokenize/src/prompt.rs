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
//!
//! The client's lists and objects are walked, never built as `serde_json::Value` (which
//! takes 16 to 100 times their size): a batch of prompts or a large
//! `chat_template_kwargs` costs no memory, a list of token ids the ids.
//!
//! The tokenizers read the prompt of a body of [`READ_OFF_LOOP_FROM`] bytes or more on
//! Tokio's blocking pool, off the event loop, a bounded number at once
//! ([`BlockingLimit`]).

use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use bytes::Bytes;
use disagg_core::json::JsonBody;
use disagg_core::json::lax::bool_value;
use disagg_core::request::Api;
use serde::de::{DeserializeSeed, MapAccess, SeqAccess, Visitor};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::{JoinError, JoinHandle};

use crate::error::TokenizeError;
use crate::walk::{Skip, skip_map, skip_seq};

/// Bodies from this size on (the bytes of their top-level keys and values) have their
/// prompt read on Tokio's blocking pool (`spawn_blocking`) by `HfTokenizer` (feature
/// `hf`) and [`EngineTokenizer`], not on the event loop; the engine tokenizer's message check and
/// `/tokenize` request go along.
///
/// [`Prompt::read`] walks a list of token ids and a `chat_template_kwargs` object at
/// about 400 MB/s on one core of the reference machine (a 2-core x86-64 VM shared with
/// other builds, release build: 10 µs for 4 KiB of ids, 0.65 ms for 256 KiB, 2.8 ms for
/// 1 MiB, 107 ms for 32 MiB), a text prompt at about 1.6 GB/s; the engine tokenizer's
/// message check walks `messages` at about 500 MB/s (0.5 ms for 256 KiB). So 256 KiB
/// costs at most some 0.65 ms: about the most the event loop, and every connection on
/// it, should wait for one request, and the size from which `disagg-http` parses a
/// body off the loop (`PARSE_OFF_LOOP_FROM`), for the same reason. Below it a read is
/// short enough to stay, and saves the handoff to another thread and back (tens of
/// microseconds with the wake-up). The body moves to the pool without a copy: its
/// values are shared `Bytes` (a clone costs about 0.1 µs).
///
/// [`EngineTokenizer`]: crate::EngineTokenizer
pub const READ_OFF_LOOP_FROM: usize = 256 * 1024;

/// How many of a tokenizer's jobs may be on Tokio's blocking pool at once: those reading
/// a large body ([`READ_OFF_LOOP_FROM`]) and, for `HfTokenizer` (feature `hf`),
/// tokenizing a large prompt. Each job holds its body (or prompt) until it ends, and the
/// body's share of the server's memory budget is given back once it is read, so without
/// a bound many clients sending large prompts, and disconnecting, would pile up work and
/// memory.
///
/// A call waits for a place before it hands its job to the pool; a call dropped while
/// it waits (the client gone, the orchestrator's tokenize timeout) starts nothing, and
/// one dropped after its job was handed over but before the pool started it keeps it
/// from starting. A job already running finishes, and holds its place until then.
///
/// Each tokenizer has its own by default ([`BlockingLimit::default`]), shared by its
/// clones; give several tokenizers one limit (`with_blocking_limit`) to bound them
/// together, as a caller that builds an [`EngineTokenizer`] per request must.
///
/// [`EngineTokenizer`]: crate::EngineTokenizer
#[derive(Clone, Default)]
pub struct BlockingLimit(Arc<OnceLock<Arc<Semaphore>>>);

impl BlockingLimit {
    /// At most `jobs` at once (at least one).
    pub fn new(jobs: usize) -> BlockingLimit {
        let jobs = jobs.clamp(1, Semaphore::MAX_PERMITS);
        BlockingLimit(Arc::new(OnceLock::from(Arc::new(Semaphore::new(jobs)))))
    }

    /// The places: those given to [`new`](Self::new), or by default as many as the
    /// process may run threads at once (`std::thread::available_parallelism`, 2 when
    /// unknown), counted at first use (a tokenizer built per request pays nothing for
    /// small bodies).
    fn permits(&self) -> &Arc<Semaphore> {
        self.0.get_or_init(|| {
            let jobs = std::thread::available_parallelism().map_or(2, usize::from);
            Arc::new(Semaphore::new(jobs))
        })
    }

    /// A place, waited for.
    pub(crate) async fn acquire(&self) -> Result<OwnedSemaphorePermit, TokenizeError> {
        Arc::clone(self.permits())
            .acquire_owned()
            .await
            // Never closed: no error comes, but one would not be a panic.
            .map_err(|e| TokenizeError::Tokenizer(Box::new(e)))
    }
}

impl fmt::Debug for BlockingLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockingLimit")
            .field("free", &self.0.get().map(|s| s.available_permits()))
            .finish()
    }
}

/// `work` on `body`, off the event loop ([`off_loop`]) within `limit`, when the body is
/// large ([`READ_OFF_LOOP_FROM`]); `None` (nothing run) otherwise, for the caller to run
/// it on its own thread.
pub(crate) async fn read_off_loop<T, F>(
    limit: &BlockingLimit,
    body: &JsonBody,
    work: F,
) -> Option<Result<T, TokenizeError>>
where
    T: Send + 'static,
    F: FnOnce(&JsonBody) -> Result<T, TokenizeError> + Send + 'static,
{
    if body.size() < READ_OFF_LOOP_FROM {
        return None;
    }
    // Cheap: the clone shares the body's buffers.
    let body = body.clone();
    Some(off_loop(limit, move || work(&body)).await)
}

/// `work` on the current runtime's blocking pool, once `limit` has a place for it (see
/// [`BlockingLimit`]); on the calling thread outside a runtime. Its panic resumes here;
/// a runtime shutting down (the task cancelled) is a [`TokenizeError::Tokenizer`].
/// Public for a caller's own walk of a large prompt within the same limit (the LMCache
/// connector's telling a batch from a list of ids, say).
///
/// Dropped while it waits for a place, nothing is spawned; dropped once spawned, the
/// job is aborted, which keeps it from starting if the pool has not started it yet.
/// The place goes with the job, and comes back when the job ends (or is dropped
/// unstarted).
///
/// # Errors
///
/// `work`'s own, and [`TokenizeError::Tokenizer`] when the job was lost.
pub async fn off_loop<T, F>(limit: &BlockingLimit, work: F) -> Result<T, TokenizeError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, TokenizeError> + Send + 'static,
{
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return work();
    };
    let place = limit.acquire().await?;
    let job = AbortOnDrop(runtime.spawn_blocking(move || {
        let _place = place;
        work()
    }));
    match job.await {
        Ok(result) => result,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(TokenizeError::Tokenizer(Box::new(e))),
    }
}

/// A spawned task that is aborted when its handle is dropped: a blocking job the pool
/// has not started then never runs (one running finishes: a thread is not stopped).
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Future for AbortOnDrop<T> {
    type Output = Result<T, JoinError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx)
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        // Once the task has ended, a no-op.
        self.0.abort();
    }
}

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
    /// parsed here. Runs on the calling thread (the tokenizers call it off the event
    /// loop for bodies from [`READ_OFF_LOOP_FROM`] bytes on).
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
    match serde_json::from_slice::<Shape>(raw) {
        Err(_) => Err(TokenizeError::invalid("prompt", "not JSON")),
        Ok(Shape::Text(text) | Shape::One(Item::Text(text))) => Ok(PromptInput::Text {
            text,
            add_special_tokens,
        }),
        Ok(Shape::Ids(Some(ids)) | Shape::One(Item::Ids(Some(ids)))) => Ok(PromptInput::Ids(ids)),
        Ok(Shape::Ids(None) | Shape::One(Item::Ids(None))) => Err(TokenizeError::invalid(
            "prompt",
            "token ids must be integers",
        )),
        Ok(Shape::Empty) => Err(TokenizeError::invalid("prompt", "empty prompt")),
        // A batch of one is answered exactly as that one prompt (above); another list
        // of one is not a prompt.
        Ok(Shape::One(Item::Number(_) | Item::Other)) => Err(TokenizeError::invalid(
            "prompt",
            "expected a string, a list of strings, token ids or lists of token ids",
        )),
        Ok(Shape::Batch) => Err(TokenizeError::not_supported("a batch of prompts")),
        Ok(Shape::Other) => Err(TokenizeError::invalid(
            "prompt",
            "expected a string or token ids",
        )),
    }
}

/// A completions `prompt`, read in one pass that keeps only what the answer needs: the
/// text, or the token ids. A batch's elements are parsed (a malformed one is "not
/// JSON", as when the prompt was built as a `serde_json::Value`) but not kept, so a
/// batch costs no memory however large.
#[derive(Debug)]
enum Shape {
    /// A string.
    Text(String),
    /// A non-empty list of numbers: their ids, or `None` when one is not a `u32`.
    Ids(Option<Vec<u32>>),
    /// `[]`.
    Empty,
    /// A list of one element that is not a number.
    One(Item),
    /// A list of two elements or more, not all numbers.
    Batch,
    /// Anything else: a number, a boolean, an object.
    Other,
}

/// An element of a `prompt` list, as far as the answer needs it.
#[derive(Debug)]
enum Item {
    /// A number: the token id it is, if it is one.
    Number(Option<u32>),
    /// A string (kept only for the list's first element).
    Text(String),
    /// A list of numbers, possibly empty (kept only for the list's first element): their
    /// ids, or `None` when one is not a `u32`.
    Ids(Option<Vec<u32>>),
    /// Anything else, or an element not kept.
    Other,
}

/// A token id as `Value::as_u64` then `u32::try_from` read it: integers only.
fn token_id(n: u64) -> Option<u32> {
    u32::try_from(n).ok()
}

/// Token ids, collected while every element is a number.
struct Collect {
    /// Every element so far is a number.
    numbers: bool,
    /// Their ids, while every one is a token id.
    ids: Option<Vec<u32>>,
}

impl Collect {
    fn new() -> Collect {
        Collect {
            numbers: true,
            ids: Some(Vec::new()),
        }
    }

    fn push(&mut self, item: &Item) {
        match item {
            Item::Number(Some(id)) => {
                if let Some(ids) = &mut self.ids {
                    ids.push(*id);
                }
            }
            Item::Number(None) => self.ids = None,
            _ => {
                self.numbers = false;
                self.ids = None;
            }
        }
    }
}

impl<'de> serde::Deserialize<'de> for Shape {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Shape, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Shape;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a prompt")
            }

            fn visit_str<E>(self, s: &str) -> Result<Shape, E> {
                Ok(Shape::Text(s.to_owned()))
            }

            fn visit_bool<E>(self, _: bool) -> Result<Shape, E> {
                Ok(Shape::Other)
            }

            fn visit_i64<E>(self, _: i64) -> Result<Shape, E> {
                Ok(Shape::Other)
            }

            fn visit_u64<E>(self, _: u64) -> Result<Shape, E> {
                Ok(Shape::Other)
            }

            fn visit_f64<E>(self, _: f64) -> Result<Shape, E> {
                Ok(Shape::Other)
            }

            fn visit_unit<E>(self) -> Result<Shape, E> {
                Ok(Shape::Other)
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Shape, A::Error> {
                skip_map(map).map(|()| Shape::Other)
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Shape, A::Error> {
                let mut count = 0usize;
                let mut collect = Collect::new();
                let mut first = None;
                // Only the first element can be the prompt of a batch of one; once the
                // list is a batch, the rest is parsed and dropped.
                while let Some(item) = seq.next_element_seed(ItemSeed { keep: count == 0 })? {
                    collect.push(&item);
                    if count == 0 {
                        first = Some(item);
                    }
                    count += 1;
                    if !collect.numbers && count >= 2 {
                        return skip_seq(seq).map(|()| Shape::Batch);
                    }
                }
                Ok(match first {
                    None => Shape::Empty,
                    Some(_) if collect.numbers => Shape::Ids(collect.ids),
                    Some(item) => Shape::One(item),
                })
            }
        }
        d.deserialize_any(V)
    }
}

/// An element of a `prompt` list; strings and lists are kept when `keep`.
struct ItemSeed {
    keep: bool,
}

impl<'de> DeserializeSeed<'de> for ItemSeed {
    type Value = Item;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Item, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ItemSeed {
    type Value = Item;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a prompt")
    }

    fn visit_u64<E>(self, n: u64) -> Result<Item, E> {
        Ok(Item::Number(token_id(n)))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Item, E> {
        Ok(Item::Number(u64::try_from(n).ok().and_then(token_id)))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Item, E> {
        Ok(Item::Number(None))
    }

    fn visit_str<E>(self, s: &str) -> Result<Item, E> {
        Ok(if self.keep {
            Item::Text(s.to_owned())
        } else {
            Item::Other
        })
    }

    fn visit_bool<E>(self, _: bool) -> Result<Item, E> {
        Ok(Item::Other)
    }

    fn visit_unit<E>(self) -> Result<Item, E> {
        Ok(Item::Other)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Item, A::Error> {
        skip_map(map).map(|()| Item::Other)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Item, A::Error> {
        if !self.keep {
            return skip_seq(seq).map(|()| Item::Other);
        }
        let mut collect = Collect::new();
        while let Some(item) = seq.next_element_seed(ItemSeed { keep: false })? {
            collect.push(&item);
            if !collect.numbers {
                return skip_seq(seq).map(|()| Item::Other);
            }
        }
        Ok(Item::Ids(collect.ids))
    }
}

/// Whether a `chat_template_kwargs` object sets `chat_template` to anything but
/// `null`: the last of a repeated key counts, as in a `serde_json::Map`. The other
/// values are parsed, not kept.
struct SetsTemplate(bool);

impl<'de> serde::Deserialize<'de> for SetsTemplate {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<SetsTemplate, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = SetsTemplate;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<SetsTemplate, A::Error> {
                let mut set = false;
                while let Some(is_template) = map.next_key::<IsTemplateKey>()? {
                    if is_template.0 {
                        set = !map.next_value::<IsNull>()?.0;
                    } else {
                        map.next_value::<Skip>()?;
                    }
                }
                Ok(SetsTemplate(set))
            }
        }
        d.deserialize_map(V)
    }
}

/// Whether an object's key is `chat_template`.
struct IsTemplateKey(bool);

impl<'de> serde::Deserialize<'de> for IsTemplateKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<IsTemplateKey, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = IsTemplateKey;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }

            fn visit_str<E>(self, s: &str) -> Result<IsTemplateKey, E> {
                Ok(IsTemplateKey(s == "chat_template"))
            }
        }
        d.deserialize_str(V)
    }
}

/// Whether a value is `null` (anything else is parsed, not kept).
struct IsNull(bool);

impl<'de> serde::Deserialize<'de> for IsNull {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<IsNull, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = IsNull;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }

            fn visit_unit<E>(self) -> Result<IsNull, E> {
                Ok(IsNull(true))
            }

            fn visit_bool<E>(self, _: bool) -> Result<IsNull, E> {
                Ok(IsNull(false))
            }

            fn visit_i64<E>(self, _: i64) -> Result<IsNull, E> {
                Ok(IsNull(false))
            }

            fn visit_u64<E>(self, _: u64) -> Result<IsNull, E> {
                Ok(IsNull(false))
            }

            fn visit_f64<E>(self, _: f64) -> Result<IsNull, E> {
                Ok(IsNull(false))
            }

            fn visit_str<E>(self, _: &str) -> Result<IsNull, E> {
                Ok(IsNull(false))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<IsNull, A::Error> {
                skip_seq(seq).map(|()| IsNull(false))
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<IsNull, A::Error> {
                skip_map(map).map(|()| IsNull(false))
            }
        }
        d.deserialize_any(V)
    }
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
        let SetsTemplate(sets_template) = serde_json::from_slice(raw)
            .map_err(|_| TokenizeError::invalid("chat_template_kwargs", "expected an object"))?;
        if sets_template {
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

/// A field read as pydantic's lax `bool` (`true`, `1`, `"yes"`, `"on"`, ...; see
/// [`bool_value`]): only strings and numbers are parsed, nothing else is built.
fn lax_bool(body: &JsonBody, field: &'static str) -> Result<Option<bool>, TokenizeError> {
    let Some(raw) = body.get(field) else {
        return Ok(None);
    };
    bool_value(raw).map_err(|_| TokenizeError::invalid(field, "expected a boolean"))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use tokio::time::timeout;

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

    /// The `prompt` reader as it was, building the value: the reference the walking
    /// reader is checked against.
    fn completion_as_value(
        raw: &[u8],
        add_special_tokens: bool,
    ) -> Result<PromptInput, TokenizeError> {
        use serde_json::Value;
        fn ids(items: &[Value]) -> Result<Vec<u32>, TokenizeError> {
            items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or_else(|| {
                            TokenizeError::invalid("prompt", "token ids must be integers")
                        })
                })
                .collect()
        }
        let value: Value = serde_json::from_slice(raw)
            .map_err(|_| TokenizeError::invalid("prompt", "not JSON"))?;
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

    fn outcome(r: Result<Prompt, TokenizeError>) -> String {
        match r {
            Ok(p) => format!("{:?}", p.input),
            Err(e) => format!("{e:?}"),
        }
    }

    /// The walking `prompt` reader answers every shape, malformed ones included, as the
    /// one that built a `serde_json::Value` did: same ids, same text, same errors.
    #[test]
    fn prompt_reader_answers_as_the_value_reader() {
        let deep = |n: usize| format!("{}0{}", "[".repeat(n), "]".repeat(n));
        let prompts = [
            r#""hi""#.to_owned(),
            r#""a \"b\" \u00e9 \ud83d\ude00""#.into(),
            r#""\ud800""#.into(),
            "[1,2,3]".into(),
            "[0]".into(),
            "[4294967295]".into(),
            "[4294967296]".into(),
            "[1,-2]".into(),
            "[-0]".into(),
            "[1.0]".into(),
            "[1e400]".into(),
            "[1,1e400]".into(),
            "[18446744073709551616]".into(),
            "[]".into(),
            "[[]]".into(),
            "[[],[]]".into(),
            "[[4,5]]".into(),
            "[[4,-5]]".into(),
            "[[4,5.5]]".into(),
            "[[4,\"a\"]]".into(),
            "[[4,[5]]]".into(),
            "[[4,5],[6]]".into(),
            "[[4,5],1e400]".into(),
            "[[4,5],[\"\\ud800\"]]".into(),
            "[\"a\"]".into(),
            "[\"a\",\"b\"]".into(),
            "[\"a\",1e400]".into(),
            "[\"\\ud800\"]".into(),
            "[1,\"a\"]".into(),
            "[\"a\",1]".into(),
            "[1,[2]]".into(),
            "[true]".into(),
            "[null]".into(),
            "[{}]".into(),
            "[{\"a\":1e400}]".into(),
            "[{\"\":0},{\"\":0}]".into(),
            "[true,false]".into(),
            "5".into(),
            "-5".into(),
            "1.5".into(),
            "1e400".into(),
            "true".into(),
            "{}".into(),
            "{\"a\":1,\"a\":2}".into(),
            "{\"a\":1e400}".into(),
            deep(127),
            deep(128),
            deep(129),
            format!("[1,{}]", deep(127)),
            format!("[1,{}]", deep(128)),
            format!("[\"a\",{}]", deep(128)),
        ];
        for prompt in &prompts {
            for special in ["", r#","add_special_tokens":false"#] {
                let body = format!(r#"{{"prompt":{prompt}{special}}}"#);
                let Ok(parsed) = JsonBody::parse(body.as_bytes()) else {
                    panic!("{body}: not a body")
                };
                let raw = parsed.get("prompt").unwrap_or_default();
                let add = special.is_empty();
                let want = outcome(completion_as_value(raw, add).map(|input| Prompt {
                    input,
                    truncation: None,
                    model: None,
                }));
                assert_eq!(
                    outcome(Prompt::read(Api::Completions, &parsed)),
                    want,
                    "{body}"
                );
            }
        }
    }

    /// serde_json builds `{"$serde_json::private::RawValue": "<json>"}` as the value
    /// the string holds (its token for raw values); the walking reader, as the engines,
    /// sees an object.
    #[test]
    fn serde_jsons_raw_value_token_is_an_object() {
        let body = r#"{"prompt":{"$serde_json::private::RawValue":"[1,2,3]"}}"#;
        match read(Api::Completions, body) {
            Err(TokenizeError::Invalid { field, reason }) => {
                assert_eq!(
                    (field, &*reason),
                    ("prompt", "expected a string or token ids")
                );
            }
            other => panic!("{other:?}"),
        }
    }

    /// `chat_template_kwargs` sets a template when its last `chat_template` is not
    /// null, as in a `serde_json::Map`; the other values are parsed as before.
    #[test]
    fn chat_template_kwargs_read_as_a_map() {
        fn as_map(raw: &[u8]) -> Result<bool, ()> {
            let kwargs: serde_json::Map<String, serde_json::Value> =
                serde_json::from_slice(raw).map_err(|_| ())?;
            Ok(kwargs.get("chat_template").is_some_and(|t| !t.is_null()))
        }
        // Nested one level below the object: 127 is serde_json's limit.
        let deep = |n: usize| format!(r#"{{"a":{}{}}}"#, "[".repeat(n), "]".repeat(n));
        for kwargs in [
            r#"{}"#,
            r#"{"enable_thinking":false}"#,
            r#"{"chat_template":"x"}"#,
            r#"{"chat_template":null}"#,
            r#"{"chat_template":"x","chat_template":null}"#,
            r#"{"chat_template":null,"chat_template":{"a":[1]}}"#,
            r#"{"chat\u005ftemplate":"x"}"#,
            r#"{"chat_template":[]}"#,
            r#"{"chat_template":false}"#,
            r#"{"a":1e400}"#,
            r#"{"a":"\ud800"}"#,
            &deep(126),
            &deep(127),
            r#"[]"#,
            r#""x""#,
            r#"5"#,
            r#"true"#,
        ] {
            let body = format!(r#"{{"messages":[],"chat_template_kwargs":{kwargs}}}"#);
            let Ok(parsed) = JsonBody::parse(body.as_bytes()) else {
                panic!("{body}: not a body")
            };
            let got = match Prompt::read(Api::Chat, &parsed) {
                Ok(_) => Ok(false),
                Err(e) if e.is_not_supported() => Ok(true),
                Err(TokenizeError::Invalid {
                    field: "chat_template_kwargs",
                    ..
                }) => Err(()),
                Err(e) => panic!("{body}: {e}"),
            };
            assert_eq!(got, as_map(kwargs.as_bytes()), "{body}");
        }
    }

    /// Lax booleans, as pydantic reads them, without building the value.
    #[test]
    fn lax_booleans() {
        for (raw, want) in [
            ("true", Some(Some(true))),
            ("false", Some(Some(false))),
            ("null", Some(None)),
            ("1", Some(Some(true))),
            ("0", Some(Some(false))),
            ("1.0", Some(Some(true))),
            ("-0", Some(Some(false))),
            ("0.0", Some(Some(false))),
            (r#""YES""#, Some(Some(true))),
            (r#""off""#, Some(Some(false))),
            (r#""\u0079""#, Some(Some(true))),
            ("2", None),
            ("1e400", None),
            (r#"" yes ""#, None),
            (r#""""#, None),
            ("[true]", None),
            (r#"[{"":0},{"":0}]"#, None),
            ("{}", None),
        ] {
            let body = format!(r#"{{"prompt":"a","add_special_tokens":{raw}}}"#);
            let got = match read(Api::Completions, &body) {
                Ok(Prompt {
                    input:
                        PromptInput::Text {
                            add_special_tokens, ..
                        },
                    ..
                }) => Some(Some(add_special_tokens).filter(|_| raw != "null")),
                Err(TokenizeError::Invalid {
                    field: "add_special_tokens",
                    ..
                }) => None,
                other => panic!("{raw}: {other:?}"),
            };
            // `null` is the default (`true`), as if absent.
            let want = want.map(|w| if raw == "null" { None } else { w });
            assert_eq!(got, want, "{raw}");
        }
    }

    /// A current-thread runtime whose blocking pool has at most `threads` threads.
    fn runtime(threads: usize) -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .max_blocking_threads(threads)
            .build()
            .unwrap()
    }

    /// [`blocking`] on the current runtime within `limit`, as a task can own it.
    fn call<T: Send + 'static>(
        limit: &BlockingLimit,
        work: impl FnOnce() -> Result<T, TokenizeError> + Send + 'static,
    ) -> impl Future<Output = Result<T, TokenizeError>> + Send + 'static {
        let limit = limit.clone();
        async move { off_loop(&limit, work).await }
    }

    /// A job's view from the test: whether it started, and the hand that lets it end.
    struct Held {
        started: tokio::sync::mpsc::UnboundedReceiver<()>,
        release: std::sync::mpsc::Sender<()>,
    }

    /// A job that says when it starts, then holds its thread until let go; it gives `n`.
    fn held(
        n: u32,
    ) -> (
        Held,
        impl FnOnce() -> Result<u32, TokenizeError> + Send + 'static,
    ) {
        let (started_tx, started) = tokio::sync::mpsc::unbounded_channel();
        let (release, released) = std::sync::mpsc::channel();
        let work = move || {
            started_tx.send(()).unwrap();
            released.recv().unwrap();
            Ok(n)
        };
        (Held { started, release }, work)
    }

    /// A job that only records that it ran.
    fn flag(ran: &Arc<AtomicBool>) -> impl FnOnce() -> Result<u32, TokenizeError> + Send + 'static {
        let ran = Arc::clone(ran);
        move || {
            ran.store(true, Ordering::SeqCst);
            Ok(0)
        }
    }

    const WHILE: Duration = Duration::from_millis(200);

    /// With one place, a second job is not handed to the pool (which has threads to
    /// spare) while the first runs: it starts when the first ends, and both answer.
    #[test]
    fn with_one_place_a_second_job_starts_when_the_first_ends() {
        runtime(4).block_on(async {
            let limit = BlockingLimit::new(1);
            let (mut first, work) = held(1);
            let first_call = tokio::spawn(call(&limit, work));
            first.started.recv().await.unwrap();
            let (mut second, work) = held(2);
            let second_call = tokio::spawn(call(&limit, work));
            assert!(timeout(WHILE, second.started.recv()).await.is_err());
            first.release.send(()).unwrap();
            assert_eq!(first_call.await.unwrap().unwrap(), 1);
            second.started.recv().await.unwrap();
            second.release.send(()).unwrap();
            assert_eq!(second_call.await.unwrap().unwrap(), 2);
            assert_eq!(limit.permits().available_permits(), 1);
        });
    }

    /// A call dropped while it waits for a place (the client gone, the tokenize timeout)
    /// hands nothing to the pool: its job never runs, and it takes no place.
    #[test]
    fn a_call_dropped_while_it_waits_runs_nothing() {
        runtime(4).block_on(async {
            let limit = BlockingLimit::new(1);
            let (mut first, work) = held(1);
            let first_call = tokio::spawn(call(&limit, work));
            first.started.recv().await.unwrap();
            let ran = Arc::new(AtomicBool::new(false));
            assert!(timeout(WHILE, call(&limit, flag(&ran))).await.is_err());
            first.release.send(()).unwrap();
            assert_eq!(first_call.await.unwrap().unwrap(), 1);
            // The place passes to the next call, not to the one dropped.
            assert_eq!(call(&limit, || Ok(3)).await.unwrap(), 3);
            assert!(!ran.load(Ordering::SeqCst));
            assert_eq!(limit.permits().available_permits(), 1);
        });
    }

    /// A call dropped after its job was handed to the pool but before the pool started
    /// it (its one thread busy) aborts it: the job never runs, and its place comes back
    /// when the pool drops it.
    #[test]
    fn a_job_dropped_before_the_pool_starts_it_never_runs() {
        runtime(1).block_on(async {
            let limit = BlockingLimit::new(2);
            let (mut first, work) = held(1);
            let first_call = tokio::spawn(call(&limit, work));
            first.started.recv().await.unwrap();
            let ran = Arc::new(AtomicBool::new(false));
            assert!(timeout(WHILE, call(&limit, flag(&ran))).await.is_err());
            // It had a place: it was handed to the pool, behind the first job.
            assert_eq!(limit.permits().available_permits(), 0);
            first.release.send(()).unwrap();
            assert_eq!(first_call.await.unwrap().unwrap(), 1);
            // The pool's one thread takes its jobs in order: the dropped one first.
            assert_eq!(call(&limit, || Ok(3)).await.unwrap(), 3);
            assert!(!ran.load(Ordering::SeqCst));
            assert_eq!(limit.permits().available_permits(), 2);
        });
    }

    /// A job's panic resumes in the caller, as before, and gives its place back.
    #[test]
    fn a_panicking_job_resumes_its_panic_and_frees_its_place() {
        runtime(4).block_on(async {
            let limit = BlockingLimit::new(1);
            let err = tokio::spawn(call(&limit, || -> Result<u32, TokenizeError> {
                std::panic::panic_any("job panicked")
            }))
            .await
            .unwrap_err();
            assert_eq!(
                err.into_panic().downcast_ref::<&str>(),
                Some(&"job panicked")
            );
            assert_eq!(call(&limit, || Ok(3)).await.unwrap(), 3);
            assert_eq!(limit.permits().available_permits(), 1);
        });
    }

    /// A limit asks for at least one place; the default is sized at first use.
    #[test]
    fn limits_have_a_place_at_least() {
        assert_eq!(BlockingLimit::new(0).permits().available_permits(), 1);
        let limit = BlockingLimit::default();
        assert!(limit.0.get().is_none());
        let shared = limit.clone();
        assert!(limit.permits().available_permits() >= 1);
        assert!(Arc::ptr_eq(limit.permits(), shared.permits()));
    }
}
