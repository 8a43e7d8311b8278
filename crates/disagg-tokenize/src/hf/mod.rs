//! [`HfTokenizer`]: the model's Hugging Face tokenizer and chat template, in process.
//!
//! What it loads, as transformers 5 loads a model's tokenizer (vLLM 0.33 uses
//! transformers' `AutoTokenizer`):
//!
//! - `tokenizer.json` with the `tokenizers` crate: normalizer, pre-tokenizer, model,
//!   post-processor (the special tokens `add_special_tokens` adds) and added tokens, as
//!   Python's `tokenizers` reads the same file;
//! - `tokenizer_config.json`: the named special tokens (`bos_token`, `eos_token`,
//!   `unk_token`, `sep_token`, `pad_token`, `cls_token`, `mask_token`; a string or an
//!   `{"content": ...}` object), added as special tokens when `tokenizer.json` lacks
//!   them and passed to the template; `split_special_tokens`; and `chat_template`, a
//!   string or a list of `{"name", "template"}`;
//! - `chat_template.jinja` beside it, and `additional_chat_templates/<name>.jinja`,
//!   which take priority over the config's templates, as in transformers 5.
//!
//! Each within a ceiling before it is held: `tokenizer.json` 256 MiB, the config and
//! each template 16 MiB, at most [`MAX_CHAT_TEMPLATES`] templates from one source and
//! [`MAX_CHAT_TEMPLATE_BYTES`] of template files in all; of the config only the members
//! above are built.
//!
//! The `tokenizers` crate is built with the pure-Rust `fancy-regex` engine instead of
//! its default Oniguruma (a C library built from source) and without `esaxx_fast` (C++,
//! only for training), so the crate builds with the Rust toolchain alone. The
//! pre-tokenizer patterns of the common BPE tokenizers (GPT-2, Llama 3, Qwen) use only
//! what both engines implement alike (Unicode classes, `(?i:...)`, `(?!\S)`); the
//! cross-check script (`scripts/tokenize_crosscheck.py`) compares the ids with Python's
//! `tokenizers` on such a tokenizer.
//!
//! Not reproduced: transformers' model-specific tokenizer classes that rebuild part of
//! the pipeline instead of reading `tokenizer.json` (a few SentencePiece models with
//! `legacy` settings), and chat templates that need Jinja2 features minijinja lacks.
//! For those, tokenize through the engine ([`EngineTokenizer`](crate::EngineTokenizer)).

mod load;
mod messages;
mod template;

use std::borrow::Cow;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use disagg_core::json::{JsonBody, raw};
use disagg_core::request::Api;
use minijinja::value::Value;
use tokenizers::tokenizer::PostProcessor;
use tokenizers::utils::truncation::TruncationDirection;

pub use self::load::{MAX_CHAT_TEMPLATE_BYTES, MAX_CHAT_TEMPLATES};
use self::template::{Fields, RenderError, Templates};
use crate::error::TokenizeError;
use crate::prompt::{BlockingLimit, ChatPrompt, Prompt, PromptInput, off_loop, read_off_loop};
use crate::{Tokenize, Tokens};

/// Prompts from this size on (bytes of text, or of messages, tools, documents and
/// `chat_template_kwargs`) are tokenized on Tokio's blocking pool (`spawn_blocking`),
/// not on the event loop.
///
/// The bench (`cargo bench -p disagg-tokenize`) measures a byte-level BPE tokenizer
/// with Llama 3's pre-tokenizer at about 6 MB/s of text on one core of the reference
/// machine (2k tokens, 7.6 KB: 1.2 ms), so 4 KiB costs some 0.7 ms: about the most the
/// event loop, and every connection on it, should wait for one request (the same
/// budget as the core's off-loop JSON parse, "well under a millisecond"). Below it the
/// handoff to another thread (tens of microseconds with the wake-up) buys little.
///
/// A smaller chat is rendered on the event loop, and its text, when the template made
/// it this size or more, is tokenized on the blocking pool. The render itself is
/// bounded by [`render_ceiling`]'s floor: a tool list nested 120 deep, 3.8 KB of body,
/// renders 0.46 MB in 0.6 ms (8.5 KB: 1 MB in 1.4 ms), release build, one core of a
/// 2-core x86-64 VM.
pub const DEFAULT_OFF_LOOP_FROM: usize = 4 * 1024;

/// The most JSON objects and lists a chat's template inputs (`messages`, `tools`,
/// `documents`, `chat_template_kwargs`) may hold for the chat to be rendered: each
/// becomes a template value of its own (a small map some hundreds of bytes), so a body
/// of `[{},{},...]` would cost about a hundred times its size. A chat past it is
/// [not supported](TokenizeError::NotSupported): it is routed without token ids. A
/// conversation of thousands of turns, each with its content parts, holds a few tens
/// of thousands.
pub const MAX_TEMPLATE_CONTAINERS: usize = 100_000;

/// The least a chat's render may write (see [`render_ceiling`]): 1 MiB, some hundred
/// times what a chat template adds to a short conversation, and ten times a large tool
/// set dumped with an indent, so that no real chat of a small request meets it.
pub const RENDER_CEILING_FLOOR: usize = 1024 * 1024;

/// How many times the size of its template inputs (`messages`, `tools`, `documents`,
/// `chat_template_kwargs`) a chat's render may write, above the floor (see
/// [`render_ceiling`]).
pub const RENDER_CEILING_FACTOR: usize = 4;

/// The most a chat's render may write, for template inputs of `input` bytes: the
/// rendered text, and, separately, the text its `tojson` calls write (together), each
/// at most `max(RENDER_CEILING_FLOOR, RENDER_CEILING_FACTOR * input)`, counted as it is
/// written. A render past it is [not supported](TokenizeError::NotSupported): the chat
/// is routed without token ids.
///
/// A chat template writes each message's content once, and the tools as JSON, with
/// an indent in most templates: some 2 to 3 times their compact size for real tool
/// schemas (a few levels deep), all of it well under the floor for any request but
/// large conversations, where the content, written once, dominates; four times the
/// input leaves room for a template that writes the content twice. A client's value
/// built to expand (a list nested 124 deep dumped with `indent`: 2 bytes in, some 250
/// to 500 out) stops at the ceiling: a render costs at most 4 times its request (and the
/// floor), and so does tokenizing its text. The floor bounds a small request's render
/// on the event loop: at most 1 MiB written (about 1.5 ms, see
/// [`DEFAULT_OFF_LOOP_FROM`]); its text, if past the tokenizer's off-loop threshold, is
/// tokenized on the blocking pool.
pub fn render_ceiling(input: usize) -> usize {
    input
        .saturating_mul(RENDER_CEILING_FACTOR)
        .max(RENDER_CEILING_FLOOR)
}

/// The least work a chat's render may do (see [`render_fuel`]), in minijinja's fuel:
/// one per instruction the template runs, one per 64 bytes of values it makes or
/// writes. 32 Ki: some twenty times what a conversation of twenty short turns takes
/// (about 1,400 for a template that walks the messages twice, as Qwen 3's does; a
/// single turn about 100), so that no real short chat meets it.
pub const RENDER_FUEL_FLOOR: u64 = 32 * 1024;

/// How much fuel a chat's render may use per byte of its template inputs
/// (`messages`, `tools`, `documents`, `chat_template_kwargs`), above the floor (see
/// [`render_fuel`]): 16, some eight times what templates take (1 to 2 per byte,
/// measured with a template that walks the messages twice and one that lists each
/// tool parameter through a macro, on conversations of 1 to 2,000 turns and on 1 to
/// 50 tools of 1 to 20 parameters).
pub const RENDER_FUEL_PER_BYTE: u64 = 16;

/// The most work a chat's render may do, for template inputs of `input` bytes:
/// `RENDER_FUEL_FLOOR + RENDER_FUEL_PER_BYTE * input` of minijinja's fuel. A render
/// that needs more stops there and is [not supported](TokenizeError::NotSupported):
/// the chat is routed without token ids, as for a render past its
/// [`render_ceiling`].
///
/// The fuel bounds the time a template may take whatever it does (a loop that never
/// ends in a model's template, a template whose work grows faster than its input):
/// without it such a render held the event loop (a small chat is rendered there) or a
/// place on the blocking pool for ever. A chat rendered on the event loop (template
/// inputs under [`DEFAULT_OFF_LOOP_FROM`]) has at most `32 Ki + 16 × 4 Ki` = 96 Ki of
/// fuel: about 4.5 ms of a template looping on nothing (some 45 ns per fuel, release
/// build, one core of a 2-core x86-64 VM), where a real one needs a few thousand.
pub fn render_fuel(input: usize) -> u64 {
    u64::try_from(input)
        .unwrap_or(u64::MAX)
        .saturating_mul(RENDER_FUEL_PER_BYTE)
        .saturating_add(RENDER_FUEL_FLOOR)
}

/// The client's fields a chat's render builds as template values: `messages`, and
/// `tools`, `documents` and `chat_template_kwargs` when set.
fn template_inputs(chat: &ChatPrompt) -> impl Iterator<Item = &Bytes> {
    std::iter::once(&chat.messages).chain(
        [&chat.tools, &chat.documents, &chat.chat_template_kwargs]
            .into_iter()
            .flatten(),
    )
}

/// Keyword arguments of transformers' `apply_chat_template` that it consumes itself:
/// given in `chat_template_kwargs`, they never reach the template.
const CONSUMED_KWARGS: [&str; 12] = [
    "conversation",
    "chat_template",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "continue_final_message",
    "sanitize_control_tokens",
];

/// The marker transformers appends to the final message to find where it ends
/// (`render_jinja_template`, `continue_final_message`).
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// How message content reaches the chat template (vLLM's
/// `--chat-template-content-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ContentFormat {
    /// Decide per template, as vLLM's `auto`: [`OpenAi`](Self::OpenAi) when the
    /// template loops over a message's content, else [`String`](Self::String).
    #[default]
    Auto,
    /// Content is a string (text parts joined with newlines).
    String,
    /// Content is a list of `{"type": "text", "text": ...}` parts.
    OpenAi,
}

/// Why a tokenizer could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// A file could not be read (missing `tokenizer.json` included).
    #[error("cannot read {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `tokenizer.json` is not a tokenizer the `tokenizers` crate can load.
    #[error("invalid tokenizer file {}", path.display())]
    Tokenizer {
        /// The file (`tokenizer.json` for bytes given directly).
        path: PathBuf,
        /// Why.
        #[source]
        source: tokenizers::Error,
    },
    /// `tokenizer_config.json` is not valid JSON of the expected shape.
    #[error("invalid tokenizer config {}: {reason}", path.display())]
    Config {
        /// The file (`tokenizer_config.json` for bytes given directly).
        path: PathBuf,
        /// What is wrong.
        reason: Cow<'static, str>,
    },
    /// More chat templates than are loaded ([`MAX_CHAT_TEMPLATES`]): `.jinja` files in
    /// a model's `additional_chat_templates` directory, or entries of a
    /// `tokenizer_config.json`'s `chat_template` list. Refused before more are read.
    #[error("{} holds more than {limit} chat templates", path.display())]
    TooManyTemplates {
        /// The `additional_chat_templates` directory, or the `tokenizer_config.json`.
        path: PathBuf,
        /// The ceiling.
        limit: usize,
    },
    /// A model directory's chat template files (`chat_template.jinja` and
    /// `additional_chat_templates/*.jinja`) total more bytes than are loaded
    /// ([`MAX_CHAT_TEMPLATE_BYTES`]), each within its own ceiling. Refused before the
    /// file past the total is read.
    #[error(
        "the chat template files of {} total more than {limit} bytes",
        dir.display()
    )]
    TemplatesTooLarge {
        /// The model directory.
        dir: PathBuf,
        /// The ceiling, in bytes.
        limit: u64,
    },
    /// A chat template does not compile.
    #[error("invalid chat template `{name}`")]
    Template {
        /// The template's name (`default` for the single one).
        name: String,
        /// Why.
        #[source]
        source: minijinja::Error,
    },
}

/// A Hugging Face tokenizer and chat template, tokenizing requests as vLLM 0.33 does.
///
/// Cheap to clone (shared). Tokenization runs on the calling thread for small prompts
/// and on Tokio's blocking pool for large ones ([`DEFAULT_OFF_LOOP_FROM`]); a large
/// body is read there too ([`READ_OFF_LOOP_FROM`](crate::prompt::READ_OFF_LOOP_FROM)).
/// At most so many of its jobs are there at once ([`BlockingLimit`]).
///
/// # Examples
///
/// ```
/// use disagg_core::{request::Api, json::JsonBody};
/// use disagg_tokenize::{HfTokenizer, Tokenize};
///
/// // A word-level tokenizer with a BOS token the post-processor adds.
/// let tokenizer_json = r#"{
///   "version": "1.0", "truncation": null, "padding": null, "normalizer": null,
///   "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false,
///                     "rstrip": false, "normalized": false, "special": true}],
///   "pre_tokenizer": {"type": "Whitespace"},
///   "post_processor": {"type": "TemplateProcessing",
///     "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
///     "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
///     "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}},
///   "decoder": null,
///   "model": {"type": "WordLevel", "vocab": {"<s>": 0, "<unk>": 1, "hello": 2, "world": 3},
///             "unk_token": "<unk>"}
/// }"#;
/// let config = r#"{"bos_token": "<s>",
///   "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content.strip() }} {% endfor %}"}"#;
/// let tokenizer = HfTokenizer::from_bytes(tokenizer_json.as_bytes(), Some(config.as_bytes()))?;
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let body = JsonBody::parse(br#"{"prompt": "hello world"}"#)?;
/// assert_eq!(&*tokenizer.tokenize(Api::Completions, &body).await?, [0, 2, 3]);
///
/// let body = JsonBody::parse(br#"{"messages": [{"role": "user", "content": " hello "}]}"#)?;
/// assert_eq!(&*tokenizer.tokenize(Api::Chat, &body).await?, [0, 2]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct HfTokenizer {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Inner {
    tokenizer: tokenizers::Tokenizer,
    templates: Option<Templates>,
    /// The named special tokens the config sets, for the template's context.
    special: Vec<(&'static str, String)>,
    content_format: ContentFormat,
    /// The server's `--default-chat-template-kwargs`, below the request's.
    default_kwargs: Fields,
    off_loop_from: usize,
    /// How many of its jobs are on the blocking pool at once.
    blocking: BlockingLimit,
}

impl fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("vocab_size", &self.inner.tokenizer.get_vocab_size(true))
            .field("chat_template", &self.inner.templates.is_some())
            .field("content_format", &self.inner.content_format)
            .field("off_loop_from", &self.inner.off_loop_from)
            .field("blocking", &self.inner.blocking)
            .finish_non_exhaustive()
    }
}

impl HfTokenizer {
    /// Load a model directory: `tokenizer.json`, and when present
    /// `tokenizer_config.json`, `chat_template.jinja` and
    /// `additional_chat_templates/*.jinja`.
    ///
    /// # Errors
    ///
    /// [`LoadError`] when `tokenizer.json` is missing or any file is invalid, or the
    /// templates pass their ceilings ([`MAX_CHAT_TEMPLATES`],
    /// [`MAX_CHAT_TEMPLATE_BYTES`]).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<HfTokenizer, LoadError> {
        let dir = dir.as_ref();
        HfTokenizer::from_file_in(&dir.join("tokenizer.json"), dir)
    }

    /// Load the `tokenizer.json` file at `path` (whatever its name) with what its
    /// directory holds beside it, as [`from_dir`](Self::from_dir) loads a model
    /// directory: `tokenizer_config.json`, `chat_template.jinja` and
    /// `additional_chat_templates/*.jinja` when present (the standalone templates
    /// taking priority over the config's, as in transformers 5).
    ///
    /// # Errors
    ///
    /// [`LoadError`] when `path` is missing or any file is invalid.
    pub fn from_tokenizer_file(path: impl AsRef<Path>) -> Result<HfTokenizer, LoadError> {
        let path = path.as_ref();
        // A bare file name's directory is the current one.
        let dir = path.parent().unwrap_or(Path::new(""));
        HfTokenizer::from_file_in(path, dir)
    }

    /// `tokenizer_json`, with the config and templates of `dir`.
    fn from_file_in(tokenizer_json: &Path, dir: &Path) -> Result<HfTokenizer, LoadError> {
        let config = dir.join("tokenizer_config.json");
        let config = config.exists().then_some(config);
        let mut tokenizer = HfTokenizer::from_files(tokenizer_json, config.as_deref())?;
        // Standalone template files take priority over the config's, as in
        // transformers 5 (`PreTrainedTokenizerBase.from_pretrained`).
        let files = load::template_files(dir)?;
        if !files.is_empty() {
            tokenizer = tokenizer.with_templates(files)?;
        }
        Ok(tokenizer)
    }

    /// Load `tokenizer.json` and, optionally, `tokenizer_config.json` from their paths.
    ///
    /// # Errors
    ///
    /// [`LoadError`] when a file is missing or invalid.
    pub fn from_files(
        tokenizer_json: impl AsRef<Path>,
        tokenizer_config: Option<&Path>,
    ) -> Result<HfTokenizer, LoadError> {
        let tokenizer_json = tokenizer_json.as_ref();
        let json = load::read_file(tokenizer_json, load::MAX_TOKENIZER_FILE)?;
        let config = match tokenizer_config {
            None => None,
            Some(p) => Some((p.to_owned(), load::read_file(p, load::MAX_CONFIG_FILE)?)),
        };
        load::load(
            (tokenizer_json.to_owned(), &json),
            config.as_ref().map(|(p, b)| (p.clone(), &b[..])),
        )
    }

    /// Load from the contents of `tokenizer.json` and, optionally,
    /// `tokenizer_config.json`.
    ///
    /// # Errors
    ///
    /// [`LoadError`] when either is invalid.
    pub fn from_bytes(
        tokenizer_json: &[u8],
        tokenizer_config: Option<&[u8]>,
    ) -> Result<HfTokenizer, LoadError> {
        load::load(
            (PathBuf::from("tokenizer.json"), tokenizer_json),
            tokenizer_config.map(|c| (PathBuf::from("tokenizer_config.json"), c)),
        )
    }

    /// Use `source` as the chat template, whatever the model ships (vLLM's
    /// `--chat-template`).
    ///
    /// # Errors
    ///
    /// [`LoadError::Template`] when it does not compile.
    pub fn with_chat_template(self, source: impl Into<String>) -> Result<HfTokenizer, LoadError> {
        self.with_templates(vec![("default".to_owned(), source.into())])
    }

    fn with_templates(
        mut self,
        templates: Vec<(String, String)>,
    ) -> Result<HfTokenizer, LoadError> {
        let compiled = Templates::new(templates)
            .map_err(|(name, source)| LoadError::Template { name, source })?;
        Arc::make_mut(&mut self.inner).templates = Some(compiled);
        Ok(self)
    }

    /// How message content reaches the template ([`ContentFormat::Auto`] by default,
    /// as vLLM).
    pub fn with_content_format(mut self, format: ContentFormat) -> HfTokenizer {
        Arc::make_mut(&mut self.inner).content_format = format;
        self
    }

    /// The server's default chat template arguments (vLLM's
    /// `--default-chat-template-kwargs`), a JSON object; a request's own override them.
    ///
    /// # Errors
    ///
    /// [`LoadError::Config`] when `json` is not a JSON object.
    pub fn with_default_chat_template_kwargs(
        mut self,
        json: &str,
    ) -> Result<HfTokenizer, LoadError> {
        let fields: Fields = serde_json::from_str(json).map_err(|_| LoadError::Config {
            path: PathBuf::from("--default-chat-template-kwargs"),
            reason: "not a JSON object".into(),
        })?;
        Arc::make_mut(&mut self.inner).default_kwargs = fields;
        Ok(self)
    }

    /// Prompts from `bytes` on are tokenized on the blocking pool
    /// ([`DEFAULT_OFF_LOOP_FROM`] by default; `usize::MAX` never moves them, except
    /// those of bodies from [`READ_OFF_LOOP_FROM`](crate::prompt::READ_OFF_LOOP_FROM)
    /// bytes on, which are read there and tokenized in the same trip).
    pub fn with_off_loop_from(mut self, bytes: usize) -> HfTokenizer {
        Arc::make_mut(&mut self.inner).off_loop_from = bytes;
        self
    }

    /// Bound this tokenizer's work on the blocking pool (tokenizing a large prompt,
    /// reading a large body) by `limit`, which other tokenizers may share; by default
    /// each tokenizer has its own, shared by its clones (see [`BlockingLimit`]).
    pub fn with_blocking_limit(mut self, limit: BlockingLimit) -> HfTokenizer {
        Arc::make_mut(&mut self.inner).blocking = limit;
        self
    }

    /// Whether a chat template was loaded.
    pub fn has_chat_template(&self) -> bool {
        self.inner.templates.is_some()
    }

    /// The ids of `text`, with the post-processor's special tokens when
    /// `add_special_tokens`. Runs on the calling thread.
    ///
    /// # Errors
    ///
    /// [`TokenizeError::Tokenizer`] when the tokenizer fails.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        self.inner.encode(text, add_special_tokens, None)
    }

    /// The text vLLM renders for a chat prompt, before tokenization. Runs on the
    /// calling thread.
    ///
    /// # Errors
    ///
    /// [`TokenizeError::NotSupported`] without a chat template, for non-text content, or
    /// for a render past its [`render_ceiling`] or its [`render_fuel`];
    /// [`TokenizeError::Invalid`] for malformed messages, [`TokenizeError::Template`]
    /// when the template fails or raises.
    pub fn render_chat(&self, chat: &ChatPrompt) -> Result<String, TokenizeError> {
        self.inner.render(chat)
    }

    /// The token ids of an already read prompt, on the calling thread.
    ///
    /// # Errors
    ///
    /// As [`Tokenize::tokenize`].
    pub fn tokenize_prompt_blocking(&self, prompt: &Prompt) -> Result<Tokens, TokenizeError> {
        self.inner.tokenize(prompt)
    }
}

#[async_trait]
impl Tokenize for HfTokenizer {
    async fn tokenize(&self, api: Api, body: &JsonBody) -> Result<Tokens, TokenizeError> {
        // A large body is read off the event loop too (reading 32 MiB of token ids takes
        // some 100 ms; see `READ_OFF_LOOP_FROM`), and tokenized in the same trip.
        let inner = Arc::clone(&self.inner);
        if let Some(result) = read_off_loop(&self.inner.blocking, body, move |body| {
            inner.tokenize(&Prompt::read(api, body)?)
        })
        .await
        {
            return result;
        }
        let prompt = Prompt::read(api, body)?;
        let size = match &prompt.input {
            PromptInput::Ids(_) => 0,
            PromptInput::Text { text, .. } => text.len(),
            // Every client field the render builds as template values counts.
            PromptInput::Chat(c) => template_inputs(c).map(Bytes::len).sum(),
        };
        // A large prompt would hold the event loop, and every connection on it, for
        // milliseconds; see `DEFAULT_OFF_LOOP_FROM`.
        if size >= self.inner.off_loop_from {
            let inner = Arc::clone(&self.inner);
            return off_loop(&self.inner.blocking, move || inner.tokenize(&prompt)).await;
        }
        let PromptInput::Chat(chat) = &prompt.input else {
            return self.inner.tokenize(&prompt);
        };
        // A small chat is rendered here: at most `RENDER_CEILING_FLOOR` bytes written
        // (see `render_ceiling`). The text it expands to, if large, is tokenized on the
        // blocking pool as a large prompt would be.
        let text = self.inner.render(chat)?;
        let add_special_tokens = chat.add_special_tokens;
        if text.len() >= self.inner.off_loop_from {
            let inner = Arc::clone(&self.inner);
            return off_loop(&self.inner.blocking, move || {
                inner.tokenize_text(&prompt, &text, add_special_tokens)
            })
            .await;
        }
        self.inner.tokenize_text(&prompt, &text, add_special_tokens)
    }
}

// === impl Inner ===

impl Inner {
    fn tokenize(&self, prompt: &Prompt) -> Result<Tokens, TokenizeError> {
        match &prompt.input {
            PromptInput::Ids(ids) => {
                let mut ids = ids.clone();
                if let Some(t) = prompt.truncation {
                    t.apply(&mut ids);
                }
                Ok(ids.into())
            }
            PromptInput::Text {
                text,
                add_special_tokens,
            } => self.tokenize_text(prompt, text, *add_special_tokens),
            PromptInput::Chat(chat) => {
                let text = self.render(chat)?;
                self.tokenize_text(prompt, &text, chat.add_special_tokens)
            }
        }
    }

    /// The ids of `text` (a text prompt, or a chat's rendered text), truncated as
    /// `prompt` says.
    fn tokenize_text(
        &self,
        prompt: &Prompt,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Tokens, TokenizeError> {
        let truncation = prompt.truncation;
        // Without an explicit side vLLM truncates text inside the tokenizer
        // (`TokenizeParams.get_encode_kwargs`), which keeps the special tokens it adds;
        // a chat's rendered text included.
        let inside = truncation.filter(|t| t.side.is_none()).map(|t| t.keep);
        let mut ids = self.encode(text, add_special_tokens, inside)?;
        if let Some(t) = truncation {
            t.apply(&mut ids);
        }
        Ok(ids.into())
    }

    fn encode(
        &self,
        text: &str,
        add_special_tokens: bool,
        max_length: Option<usize>,
    ) -> Result<Vec<u32>, TokenizeError> {
        let added = match (add_special_tokens, self.tokenizer.get_post_processor()) {
            (true, Some(p)) => p.added_tokens(false),
            _ => 0,
        };
        // The `tokenizers` crate computes `max_length - added tokens` unchecked (a
        // panic in debug builds, a wrap to "no limit" in Python's release wheels). vLLM,
        // on those wheels, then gets the text's full ids and keeps their last
        // `max_length` (`TokenizeParams._token_truncation`); so does the caller's
        // `Truncation::apply` when the tokenizer truncates nothing here. Without special
        // tokens, truncating inside the tokenizer keeps the last `max_length` ids: the
        // caller's `Truncation::apply` does that too.
        let Some(content) = max_length
            .filter(|&m| add_special_tokens && m >= added)
            .map(|m| m - added)
        else {
            return self
                .tokenizer
                .encode_fast(text, add_special_tokens)
                .map(|e| e.get_ids().to_vec())
                .map_err(TokenizeError::Tokenizer);
        };
        // What a tokenizer set to truncate from the left to `max_length` gives, as
        // vLLM's does (`truncation_side="left"`): the text's ids without special
        // tokens, their last `max_length - added` kept, then the post-processor's
        // special tokens around them. With this shared tokenizer, not a copy of it set
        // to truncate: a copy, made per request, rebuilt the vocabulary and the
        // patterns, and started a cache of merged words of its own on each thread it
        // ran on, never dropped.
        let mut encoding = self
            .tokenizer
            .encode_fast(text, false)
            .map_err(TokenizeError::Tokenizer)?;
        encoding.truncate(content, 0, TruncationDirection::Left);
        // The parts cut off (which the tokenizer would post-process too) are not used.
        drop(encoding.take_overflowing());
        self.tokenizer
            .post_process(encoding, None, true)
            .map(|e| e.get_ids().to_vec())
            .map_err(TokenizeError::Tokenizer)
    }

    fn render(&self, chat: &ChatPrompt) -> Result<String, TokenizeError> {
        let Some(templates) = &self.templates else {
            return Err(TokenizeError::not_supported("no chat template"));
        };
        // One budget of objects and lists for the whole request: the client's fields,
        // then the tool-call `arguments` strings parsed into objects.
        let held = template_inputs(chat)
            .map(|raw| raw::containers(raw, MAX_TEMPLATE_CONTAINERS))
            .fold(0, usize::saturating_add);
        if held > MAX_TEMPLATE_CONTAINERS {
            return Err(TokenizeError::not_supported(
                "a chat of more JSON objects and lists than the template renders",
            ));
        }
        let mut containers = MAX_TEMPLATE_CONTAINERS - held;
        let input = template_inputs(chat).map(Bytes::len).sum();
        let ceiling = render_ceiling(input);
        let fuel = render_fuel(input);
        // Tools: the request's, unless its chat_template_kwargs carry their own.
        let mut kwargs = self.default_kwargs.clone();
        let mut request_kwargs: Vec<(String, Value)> = Vec::new();
        if let Some(raw) = &chat.chat_template_kwargs {
            let fields: Fields = serde_json::from_slice(raw).map_err(|_| {
                TokenizeError::invalid("chat_template_kwargs", "expected an object")
            })?;
            // vLLM's merge drops `None` values: they leave the default in place.
            request_kwargs = fields
                .into_pairs()
                .into_iter()
                .filter(|(_, v)| !v.is_none())
                .collect();
        }
        let user_tools = request_kwargs.iter().any(|(k, _)| k == "tools");
        let tools = match (&chat.tools, user_tools) {
            (Some(raw), false) => Some(messages::tools(raw)?),
            _ => None,
        };
        let has_tools = tools.is_some() || user_tools;
        let Some(entry) = templates.select(has_tools) else {
            return Err(TokenizeError::not_supported(
                "several chat templates and none named default",
            ));
        };
        let openai = match self.content_format {
            ContentFormat::Auto => entry.iterates_content,
            ContentFormat::String => false,
            ContentFormat::OpenAi => true,
        };
        let mut conversation = messages::conversation(
            &chat.messages,
            openai,
            entry.developer_role,
            &mut containers,
        )?;
        if conversation.is_empty() {
            return Err(TokenizeError::invalid(
                "messages",
                "cannot apply the chat template to an empty conversation",
            ));
        }
        for (k, v) in request_kwargs {
            kwargs.insert(k, v);
        }
        // The request's own fields win over its chat_template_kwargs (vLLM's
        // `build_chat_params`).
        kwargs.set(
            "add_generation_prompt",
            Value::from(chat.add_generation_prompt),
        );
        if let Some(raw) = &chat.documents {
            let docs: Value = serde_json::from_slice(raw)
                .map_err(|_| TokenizeError::invalid("documents", "not JSON"))?;
            kwargs.set("documents", docs);
        }
        if let Some(effort) = &chat.reasoning_effort {
            if kwargs.get("enable_thinking").is_none() {
                kwargs.set("enable_thinking", Value::from(effort != "none"));
            }
            kwargs.set("reasoning_effort", Value::from(effort.as_str()));
        }
        if let Some(tools) = tools {
            kwargs.set("tools", tools);
        }
        if kwargs
            .get("sanitize_control_tokens")
            .is_some_and(Value::is_true)
        {
            return Err(TokenizeError::not_supported("sanitize_control_tokens"));
        }
        // transformers' `continue_final_message`: mark the end of the final message,
        // render, and cut the text there.
        if chat.continue_final_message {
            let last = conversation.last_mut().ok_or_else(|| {
                TokenizeError::invalid("messages", "no final message to continue")
            })?;
            mark_final(last)?;
        }
        // The context: special tokens, then the kwargs (which override them), then
        // what `render_jinja_template` passes by name.
        let mut context = Fields::default();
        for (name, value) in &self.special {
            context.set(name, Value::from(value.as_str()));
        }
        let mut documents = Value::from(());
        let mut tools_value = Value::from(());
        let mut add_generation_prompt = Value::from(false);
        for (k, v) in kwargs.into_pairs() {
            match k.as_str() {
                "documents" => documents = v,
                "tools" => tools_value = v,
                "add_generation_prompt" => add_generation_prompt = v,
                k if CONSUMED_KWARGS.contains(&k) => {}
                _ => context.set(&k, v),
            }
        }
        context.set(
            "messages",
            Value::from(
                conversation
                    .into_iter()
                    .map(Fields::into_value)
                    .collect::<Vec<_>>(),
            ),
        );
        context.set("tools", tools_value);
        context.set("documents", documents);
        context.set("add_generation_prompt", add_generation_prompt);
        let rendered = templates
            .render(&entry.name, context.into_value(), ceiling, fuel)
            .map_err(|e| match e {
                RenderError::Template(e) => TokenizeError::Template {
                    message: template_message(&e),
                },
                RenderError::TooLarge => TokenizeError::not_supported(
                    "a chat whose rendered text is larger than its render's ceiling",
                ),
                RenderError::OutOfFuel => TokenizeError::not_supported(
                    "a chat whose render takes more work than its budget",
                ),
            })?;
        if !chat.continue_final_message {
            return Ok(rendered);
        }
        let tag = CONTINUE_TAG.trim();
        let Some(at) = rendered.rfind(tag) else {
            return Err(TokenizeError::invalid(
                "continue_final_message",
                "the final message does not appear in the rendered chat",
            ));
        };
        Ok(if rendered[at..].starts_with(CONTINUE_TAG) {
            rendered[..at].to_owned()
        } else {
            // The template trimmed the message's trailing space.
            rendered[..at].trim_end().to_owned()
        })
    }
}

/// Append transformers' marker to the final message's content (a string, or its last
/// text part).
fn mark_final(message: &mut Fields) -> Result<(), TokenizeError> {
    let missing = || {
        TokenizeError::invalid(
            "continue_final_message",
            "the final message has no content to continue",
        )
    };
    let content = message.get("content").cloned().ok_or_else(missing)?;
    if let Some(s) = content.as_str() {
        message.set("content", Value::from(format!("{s}{CONTINUE_TAG}")));
        return Ok(());
    }
    let mut parts: Vec<Value> = content.try_iter().map_err(|_| missing())?.collect();
    let Some(i) = parts
        .iter()
        .rposition(|p| p.get_attr("text").is_ok_and(|t| t.as_str().is_some()))
    else {
        return Err(missing());
    };
    let mut part = Fields::of(&parts[i]).map_err(|_| missing())?;
    let text = part
        .get("text")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    part.set("text", Value::from(format!("{text}{CONTINUE_TAG}")));
    parts[i] = part.into_value();
    message.set("content", Value::from(parts));
    Ok(())
}

/// The reason a render failed: the template's own (`raise_exception`) or minijinja's.
fn template_message(e: &minijinja::Error) -> String {
    match e.detail() {
        Some(detail) if e.kind() == minijinja::ErrorKind::InvalidOperation => detail.to_owned(),
        _ => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::timeout;

    use super::*;
    use serde_json::Value as Json;

    /// A word-level tokenizer whose post-processor adds `<s>` (id 0).
    const TOKENIZER: &str = r#"{
      "version": "1.0", "truncation": null, "padding": null, "normalizer": null,
      "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false,
                        "rstrip": false, "normalized": false, "special": true}],
      "pre_tokenizer": {"type": "Whitespace"},
      "post_processor": {"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}},
      "decoder": null,
      "model": {"type": "WordLevel", "vocab": {"<s>": 0, "<unk>": 1, "hello": 2, "world": 3},
                "unk_token": "<unk>"}
    }"#;

    /// Both trips to the blocking pool (a large body read and tokenized, a large prompt
    /// of a small body tokenized) take a place in the limit the tokenizer is given:
    /// while its one place is taken they wait; once it is free their ids come. A small
    /// prompt is tokenized inline, whatever the limit.
    #[tokio::test]
    async fn large_work_waits_for_a_place_in_the_tokenizers_limit() {
        let limit = BlockingLimit::new(1);
        let t = HfTokenizer::from_bytes(TOKENIZER.as_bytes(), None)
            .unwrap()
            .with_blocking_limit(limit.clone());
        let ids: Vec<u32> = (0..140_000).map(|i| i % 4).collect();
        let large_body = format!(r#"{{"prompt":{}}}"#, serde_json::to_string(&ids).unwrap());
        assert!(large_body.len() >= crate::prompt::READ_OFF_LOOP_FROM);
        let large_body = JsonBody::parse(large_body.as_bytes()).unwrap();
        let text = "hello world ".repeat(400);
        assert!(text.len() >= DEFAULT_OFF_LOOP_FROM);
        let large_prompt = serde_json::json!({ "prompt": text }).to_string();
        let large_prompt = JsonBody::parse(large_prompt.as_bytes()).unwrap();
        let small = JsonBody::parse(br#"{"prompt":"hello world"}"#).unwrap();

        let place = limit.acquire().await.unwrap();
        for body in [&large_body, &large_prompt] {
            let waited = timeout(
                Duration::from_millis(200),
                t.tokenize(Api::Completions, body),
            )
            .await;
            assert!(waited.is_err(), "{waited:?}");
        }
        assert_eq!(
            &*t.tokenize(Api::Completions, &small).await.unwrap(),
            [0, 2, 3]
        );
        drop(place);
        assert_eq!(
            &*t.tokenize(Api::Completions, &large_body).await.unwrap(),
            &ids[..]
        );
        let want: Vec<u32> = std::iter::once(0).chain([2, 3].repeat(400)).collect();
        assert_eq!(
            &*t.tokenize(Api::Completions, &large_prompt).await.unwrap(),
            &want[..]
        );
    }

    /// A chat whose message, `chat_template_kwargs`, tool and tool-call `arguments`
    /// each have `n` distinct keys renders at a few key look-ups per key: the scans
    /// made `n²/2` comparisons for each (5,000 keys: 12,500,000), some 15 s for a
    /// 1 MiB object of 90,000 keys.
    #[test]
    fn objects_of_many_keys_cost_a_few_look_ups_per_key() {
        let n = 5000;
        let members = |v: &str| {
            (0..n)
                .map(|i| format!(r#""k{i}":{v}"#))
                .collect::<Vec<_>>()
                .join(",")
        };
        let arguments = serde_json::to_string(&format!("{{{}}}", members("1"))).unwrap();
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":"hello",{m}}},
                {{"role":"assistant","content":"","tool_calls":[{{"type":"function","function":{{"name":"f","arguments":{arguments},{m}}}}}]}}],
              "chat_template_kwargs":{{{m}}},
              "tools":[{{"type":"function","function":{{"name":"g",{m}}},{m}}}]}}"#,
            m = members("2"),
        );
        let config = r#"{"chat_template": "{% for m in messages %}{{ m.role }} {{ m.tool_calls | tojson }}{% endfor %}{{ k4999 }}{{ tools | length }}"}"#;
        let t = HfTokenizer::from_bytes(TOKENIZER.as_bytes(), Some(config.as_bytes())).unwrap();
        let body = JsonBody::parse(body.as_bytes()).unwrap();
        let PromptInput::Chat(chat) = Prompt::read(Api::Chat, &body).unwrap().input else {
            panic!("a chat");
        };
        template::PROBES.set(0);
        let text = t.render_chat(&chat).unwrap();
        assert!(
            text.ends_with(r#""k4999": 2}}]21"#),
            "{}",
            &text[text.len() - 40..]
        );
        let probes = template::PROBES.get();
        assert!(
            probes <= 40 * n as u64,
            "{probes} key comparisons and look-ups for objects of {n} keys"
        );
    }

    /// Templates of the kinds models ship use a small part of their fuel: an eighth at
    /// most, on conversations of 1 to 2,000 turns (a turn as small as a message gets)
    /// and on 1 to 50 tools of 1 to 20 parameters.
    #[test]
    fn templates_use_a_small_part_of_their_fuel() {
        // Walks the messages twice (finding the last user turn first), as Qwen 3's.
        let two_pass = r#"{%- set ns = namespace(last_user=-1) %}
{%- for message in messages[::-1] %}
    {%- if ns.last_user < 0 and message.role == 'user' %}
        {%- set ns.last_user = messages | length - 1 - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- if tools %}<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>{% endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' and loop.index0 > ns.last_user %}<think>{% endif %}
    {{- '<|' + message.role + '|>\n' + message.content.strip() + '<|end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"#;
        // Lists each tool parameter and its other keys through a macro, as
        // Qwen3-Coder's.
        let parameters = r#"{%- macro extra(d, skip) %}
    {%- for k in d if k not in skip %}
        {{- '<' ~ k ~ '>' ~ (d[k] | tojson if d[k] is mapping or (d[k] is sequence and d[k] is not string) else d[k] | string) ~ '</' ~ k ~ '>' }}
    {%- endfor %}
{%- endmacro %}
{%- for tool in tools or [] %}
    {%- set f = tool.function %}
    {{- '<function><name>' ~ f.name ~ '</name>' }}
    {%- for name, p in f.parameters.properties | items %}
        {{- '<parameter><name>' ~ name ~ '</name><type>' ~ (p.type | string) ~ '</type>' }}
        {{- extra(p, ['type']) }}
        {{- '</parameter>' }}
    {%- endfor %}
    {{- extra(f.parameters, ['type', 'properties']) ~ '</function>\n' }}
{%- endfor %}
{%- for message in messages %}<|{{ message.role }}|>{{ message.content }}<|end|>{% endfor %}"#;
        let chat = |messages: usize, words: usize, tools: usize, params: usize| {
            let messages: Vec<Json> = (0..messages)
                .map(|i| {
                    let role = if i % 2 == 0 { "user" } else { "assistant" };
                    serde_json::json!({"role": role, "content": "word ".repeat(words)})
                })
                .collect();
            let mut body = serde_json::json!({ "messages": messages });
            if tools > 0 {
                let tools: Vec<Json> = (0..tools)
                    .map(|t| {
                        let properties: serde_json::Map<String, Json> = (0..params)
                            .map(|p| {
                                let field = serde_json::json!({
                                    "type": "string", "description": "a parameter",
                                    "enum": ["a", "b"]
                                });
                                (format!("p{p}"), field)
                            })
                            .collect();
                        serde_json::json!({"type": "function", "function": {
                            "name": format!("f{t}"), "description": "does a thing",
                            "parameters": {"type": "object", "properties": properties,
                                           "required": ["p0"]}}})
                    })
                    .collect();
                body["tools"] = tools.into();
            }
            body.to_string()
        };
        for template in [two_pass, parameters] {
            let t = HfTokenizer::from_bytes(TOKENIZER.as_bytes(), None)
                .unwrap()
                .with_chat_template(template)
                .unwrap();
            for (messages, words, tools, params) in [
                (1, 3, 0, 0),
                (20, 3, 0, 0),
                (2000, 0, 0, 0),
                (200, 1, 1, 1),
                (2, 3, 10, 5),
                (2, 3, 50, 20),
            ] {
                let body = chat(messages, words, tools, params);
                let body = JsonBody::parse(body.as_bytes()).unwrap();
                let PromptInput::Chat(chat) = Prompt::read(Api::Chat, &body).unwrap().input else {
                    panic!("a chat");
                };
                let input = template_inputs(&chat).map(Bytes::len).sum();
                template::FUEL_USED.set(None);
                t.render_chat(&chat).unwrap();
                let used = template::FUEL_USED.get().unwrap();
                assert!(
                    used.saturating_mul(8) <= render_fuel(input),
                    "{messages} messages, {tools} tools of {params}: {used} fuel of {}",
                    render_fuel(input)
                );
            }
        }
    }

    /// A template that would loop for ever (10^10 iterations) runs out of fuel: the
    /// chat is not supported (routed without ids), rendered on the event loop or off
    /// it. (The bound on the wait only turns a hang into a failure.)
    #[test]
    fn a_template_that_would_run_for_ever_is_not_supported() {
        let t = HfTokenizer::from_bytes(TOKENIZER.as_bytes(), None)
            .unwrap()
            .with_chat_template(
                "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            )
            .unwrap();
        let small = JsonBody::parse(br#"{"messages":[{"role":"user","content":"hi"}]}"#).unwrap();
        let large = serde_json::json!({
            "messages": [{"role": "user", "content": "hello ".repeat(2000)}]
        })
        .to_string();
        let large = JsonBody::parse(large.as_bytes()).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            for body in [&small, &large] {
                let _ = tx.send(runtime.block_on(t.tokenize(Api::Chat, body)));
            }
        });
        for _ in 0..2 {
            let err = rx
                .recv_timeout(Duration::from_secs(300))
                .expect("an answer, not a hang")
                .unwrap_err();
            assert!(err.is_not_supported(), "{err}");
        }
    }
}
