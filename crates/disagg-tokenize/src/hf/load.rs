//! Loading a model's tokenizer files, each within a ceiling before it is held: the file
//! sizes, how many chat templates and how many bytes of them, and what of
//! `tokenizer_config.json` is built (the members the loader uses; the others, such as
//! an `added_tokens_decoder` of thousands of entries, are skipped unbuilt).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use disagg_core::json::raw;
use serde_json::value::RawValue;
use tokenizers::tokenizer::AddedToken;

use super::template::{Fields, Templates};
use super::{ContentFormat, DEFAULT_OFF_LOOP_FROM, HfTokenizer, Inner, LoadError};
use crate::prompt::BlockingLimit;

/// The largest `tokenizer.json` read (the largest published ones are tens of MB).
pub(super) const MAX_TOKENIZER_FILE: u64 = 256 * 1024 * 1024;

/// The largest `tokenizer_config.json` or chat template read.
pub(super) const MAX_CONFIG_FILE: u64 = 16 * 1024 * 1024;

/// The most chat templates loaded from one source: `.jinja` files in a model's
/// `additional_chat_templates` directory, or entries of a `tokenizer_config.json`'s
/// `chat_template` list. Models ship a few (`default`, `tool_use`, `rag`); each is
/// compiled and held for the tokenizer's life, so a directory of thousands is refused
/// ([`LoadError::TooManyTemplates`]) before more are read.
pub const MAX_CHAT_TEMPLATES: usize = 256;

/// The most bytes of chat template files loaded from a model directory
/// (`chat_template.jinja` and `additional_chat_templates/*.jinja` together; each is
/// within 16 MiB too): four of the largest. Past it the directory is refused
/// ([`LoadError::TemplatesTooLarge`]) before the file that passes it is read.
pub const MAX_CHAT_TEMPLATE_BYTES: u64 = 64 * 1024 * 1024;

/// The members of `tokenizer_config.json` the loader reads: the named special tokens
/// of transformers' `SPECIAL_TOKENS_ATTRIBUTES` (in its order), then
/// `split_special_tokens` and `chat_template`.
const CONFIG_KEYS: [&str; 9] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
    "split_special_tokens",
    "chat_template",
];

/// The bytes of `path`, a regular file of at most `limit` bytes: a FIFO or a device is
/// refused before it is opened (reading one would block start-up), a longer file
/// before it is held whole ([`disagg_files::read_regular`]).
pub(super) fn read_file(path: &Path, limit: u64) -> Result<Vec<u8>, LoadError> {
    disagg_files::read_regular_within(path, limit).map_err(|source| LoadError::Read {
        path: path.to_owned(),
        source,
    })
}

/// The standalone chat templates of `dir`, by name: `chat_template.jinja` as
/// `default`, then `additional_chat_templates/<name>.jinja` in the order of their
/// names. At most [`MAX_CHAT_TEMPLATES`] additional ones are listed, and at most
/// [`MAX_CHAT_TEMPLATE_BYTES`] read in all.
///
/// # Errors
///
/// [`LoadError::TooManyTemplates`], [`LoadError::TemplatesTooLarge`], or
/// [`LoadError::Read`] for a file that cannot be read (or passes its own ceiling, or
/// is not UTF-8).
pub(super) fn template_files(dir: &Path) -> Result<Vec<(String, String)>, LoadError> {
    let mut paths = Vec::new();
    let single = dir.join("chat_template.jinja");
    if single.exists() {
        paths.push(("default".to_owned(), single));
    }
    let extra = dir.join("additional_chat_templates");
    if let Ok(entries) = std::fs::read_dir(&extra) {
        let mut listed = Vec::new();
        for path in entries.filter_map(Result::ok).map(|e| e.path()) {
            if path.extension().is_none_or(|x| x != "jinja") {
                continue;
            }
            if listed.len() == MAX_CHAT_TEMPLATES {
                return Err(LoadError::TooManyTemplates {
                    path: extra,
                    limit: MAX_CHAT_TEMPLATES,
                });
            }
            listed.push(path);
        }
        listed.sort();
        paths.extend(listed.into_iter().map(|path| {
            let name = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            (name, path)
        }));
    }
    let mut left = MAX_CHAT_TEMPLATE_BYTES;
    let mut files = Vec::with_capacity(paths.len());
    for (name, path) in paths {
        // A file past its own ceiling is refused as such (by the read); one within it
        // but past what is left of the total, before it is read. The read is bounded
        // by both, should the file grow meanwhile.
        let size = std::fs::metadata(&path).map_or(0, |m| m.len());
        let limit = if size > MAX_CONFIG_FILE {
            MAX_CONFIG_FILE
        } else if size > left {
            return Err(LoadError::TemplatesTooLarge {
                dir: dir.to_owned(),
                limit: MAX_CHAT_TEMPLATE_BYTES,
            });
        } else {
            left.min(MAX_CONFIG_FILE)
        };
        let text = read_template(&path, limit)?;
        left = left.saturating_sub(text.len() as u64);
        files.push((name, text));
    }
    Ok(files)
}

/// A chat template's text (UTF-8), read as [`read_file`] reads, within `limit` bytes.
fn read_template(path: &Path, limit: u64) -> Result<String, LoadError> {
    let bytes = read_file(path, limit)?;
    String::from_utf8(bytes).map_err(|e| LoadError::Read {
        path: path.to_owned(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
    })
}

/// What the loader uses of `tokenizer_config.json`.
#[derive(Debug, Default)]
struct Config {
    /// The named special tokens it sets, in [`CONFIG_KEYS`]' order.
    special: Vec<(&'static str, String)>,
    /// `split_special_tokens: true`.
    split_special_tokens: bool,
    /// `chat_template`: one (`default`) or a named list.
    templates: Option<Vec<(String, String)>>,
}

/// The members of `tokenizer_config.json` (`bytes`, read from `path`) the loader uses,
/// found in one walk of the object (each the last when a key repeats, as Python's
/// `json` keeps it); the others are skipped, not built (a `serde_json::Value` of an
/// unused member cost some sixteen bytes per byte of it).
fn read_config(path: &Path, bytes: &[u8]) -> Result<Config, LoadError> {
    let bad = |reason: &'static str| LoadError::Config {
        path: path.to_owned(),
        reason: reason.into(),
    };
    let text = std::str::from_utf8(bytes).map_err(|_| bad(NOT_OBJECT))?;
    let found = raw::members_named(text, CONFIG_KEYS).map_err(|_| bad(NOT_OBJECT))?;
    let [tokens @ .., split, template] = found;
    let mut config = Config::default();
    for (name, value) in CONFIG_KEYS.into_iter().zip(tokens) {
        let Some(value) = value else { continue };
        if let Some(content) = special_token(value).map_err(bad)? {
            config.special.push((name, content));
        }
    }
    config.split_special_tokens = split.is_some_and(|v| v.get() == "true");
    config.templates = match template {
        None => None,
        Some(t) => templates(path, t)?,
    };
    Ok(config)
}

/// The reason of a config that is not one JSON object (a string that does not decode,
/// a lone surrogate, included: Python's `json` refuses the file too).
const NOT_OBJECT: &str = "not a JSON object";

/// The text of `value` when it is a string; `Err` for one that does not decode.
fn string(value: &RawValue) -> Result<Option<String>, &'static str> {
    if !value.get().starts_with('"') {
        return Ok(None);
    }
    serde_json::from_str(value.get())
        .map(Some)
        .map_err(|_| NOT_OBJECT)
}

/// A special token's text: a string, or an object's `content` string; `None` for
/// `null`.
fn special_token(value: &RawValue) -> Result<Option<String>, &'static str> {
    const NEITHER: &str = "a special token must be a string or an object";
    let text = value.get();
    match text.as_bytes().first() {
        Some(b'n') => Ok(None),
        Some(b'"') => string(value),
        Some(b'{') => match raw::member(text, "content") {
            Some(content) => string(content)?
                .map(Some)
                .ok_or("a special token object without content"),
            None => Err("a special token object without content"),
        },
        _ => Err(NEITHER),
    }
}

/// `chat_template`: `null` (none), a string (`default`), or a list of
/// `{"name", "template"}` of at most [`MAX_CHAT_TEMPLATES`] entries.
fn templates(path: &Path, value: &RawValue) -> Result<Option<Vec<(String, String)>>, LoadError> {
    let bad = |reason: &'static str| LoadError::Config {
        path: path.to_owned(),
        reason: reason.into(),
    };
    let text = value.get();
    match text.as_bytes().first() {
        Some(b'n') => return Ok(None),
        Some(b'"') => {
            let t = string(value).map_err(bad)?.unwrap_or_default();
            return Ok(Some(vec![("default".to_owned(), t)]));
        }
        Some(b'[') => {}
        _ => return Err(bad("chat_template must be a string or a list")),
    }
    const ENTRY: &str = "a chat template entry needs a name and a template";
    // An entry's name and template, both strings.
    let entry = |item: &RawValue| -> Result<(String, String), &'static str> {
        let [name, template] =
            raw::members_named(item.get(), ["name", "template"]).map_err(|_| ENTRY)?;
        match (
            name.map(string).transpose()?,
            template.map(string).transpose()?,
        ) {
            (Some(Some(n)), Some(Some(t))) => Ok((n, t)),
            _ => Err(ENTRY),
        }
    };
    let mut named = Vec::new();
    let mut fault = None;
    let listed = raw::elements(text, |item| {
        if fault.is_some() {
            return;
        }
        if named.len() == MAX_CHAT_TEMPLATES {
            fault = Some(LoadError::TooManyTemplates {
                path: path.to_owned(),
                limit: MAX_CHAT_TEMPLATES,
            });
            return;
        }
        match entry(item) {
            Ok(e) => named.push(e),
            Err(reason) => fault = Some(bad(reason)),
        }
    });
    if let Some(e) = fault {
        return Err(e);
    }
    listed.map_err(|_| bad(NOT_OBJECT))?;
    Ok(Some(named))
}

/// A tokenizer from the contents of `tokenizer.json` and, optionally,
/// `tokenizer_config.json` (each with the path it is named by in errors).
pub(super) fn load(
    (json_path, json): (PathBuf, &[u8]),
    config: Option<(PathBuf, &[u8])>,
) -> Result<HfTokenizer, LoadError> {
    let mut tokenizer =
        tokenizers::Tokenizer::from_bytes(json).map_err(|source| LoadError::Tokenizer {
            path: json_path.clone(),
            source,
        })?;
    // The truncation and padding the file may set are off, as transformers turns them
    // off for every call that does not ask for them (`set_truncation_and_padding`), and
    // vLLM's calls do not: `truncate_prompt_tokens` is applied per request (`encode`).
    tokenizer
        .with_truncation(None)
        .map_err(|source| LoadError::Tokenizer {
            path: json_path,
            source,
        })?;
    tokenizer.with_padding(None);
    let mut special = Vec::new();
    let mut templates = None;
    if let Some((path, bytes)) = config {
        let config = read_config(&path, bytes)?;
        special = config.special;
        // Named special tokens missing from tokenizer.json are added as special
        // tokens, as transformers' `TokenizersBackend` does when it loads.
        let missing: Vec<AddedToken> = special
            .iter()
            .filter(|(_, c)| tokenizer.token_to_id(c).is_none())
            .map(|(_, c)| AddedToken::from(c.clone(), true))
            .collect();
        if !missing.is_empty() {
            tokenizer
                .add_special_tokens(missing)
                .map_err(|source| LoadError::Tokenizer {
                    path: path.clone(),
                    source,
                })?;
        }
        if config.split_special_tokens {
            tokenizer.set_encode_special_tokens(true);
        }
        templates = config.templates;
    }
    let templates = match templates {
        None => None,
        Some(t) => {
            Some(Templates::new(t).map_err(|(name, source)| LoadError::Template { name, source })?)
        }
    };
    Ok(HfTokenizer {
        inner: Arc::new(Inner {
            tokenizer,
            templates,
            special,
            content_format: ContentFormat::Auto,
            default_kwargs: Fields::default(),
            off_loop_from: DEFAULT_OFF_LOOP_FROM,
            blocking: BlockingLimit::default(),
        }),
    })
}
