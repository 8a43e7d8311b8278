//! The checks of a client's prompt: a completions prompt's [`Kind`] (a batch is
//! refused, the client's token ids are carried, anything else is tokenized by the
//! prefill's `/tokenize`, which refuses what is no prompt), and a chat's media parts
//! (refused: see `media`).
//!
//! Each takes a walk of the prompt, which is `prepare`'s on the event loop only below
//! [`READ_OFF_LOOP_FROM`]: a larger completions prompt (a client's list of millions of
//! ids) is looked at no further than its first element there ([`at_a_glance`]), and
//! what that does not settle, like a larger chat's media, is left to `resolve`, on the
//! blocking pool ([`check_off_loop`]).

use bytes::Bytes;
use disagg_core::error::ConnectorError;
use disagg_tokenize::prompt::{BlockingLimit, READ_OFF_LOOP_FROM, off_loop};

use super::{completion_tokenize, ids, media, refused};

/// What a completions `prompt` is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// A list holding a string or a list (anywhere in it): a batch of prompts.
    Batch,
    /// A list of integers that fit a `u64` (or an empty list): the client's ids.
    Ids,
    /// Anything else (a string, or a list of other values): for `/tokenize`.
    Other,
}

/// How far into a large prompt [`at_a_glance`] looks for its first element: past a
/// run of whitespace this long it does not look.
const GLANCE: usize = 64;

/// The [`Kind`] of `raw` (a JSON value), told in one walk of its elements, none of
/// them built (a client's prompt of millions of ids is one prompt, and no `Value` per
/// id). Text that is not one JSON list is [`Kind::Other`].
pub(super) fn kind(raw: &[u8]) -> Kind {
    let Ok(text) = std::str::from_utf8(raw) else {
        return Kind::Other;
    };
    let (mut batch, mut ids) = (false, true);
    let listed = disagg_json::raw::elements(text, |x| {
        batch |= matches!(x.get().as_bytes().first(), Some(b'"' | b'['));
        ids = ids && !batch && disagg_json::raw::u64_of(x).is_some();
    });
    match listed {
        Err(_) => Kind::Other,
        Ok(()) if batch => Kind::Batch,
        Ok(()) if ids && text.starts_with('[') => Kind::Ids,
        Ok(()) => Kind::Other,
    }
}

/// The [`Kind`] of `raw` (a value of a parsed body, so valid JSON) as far as its
/// first bytes tell it: a value that is no list is [`Kind::Other`], a list whose first
/// element is a string or a list is a [`Kind::Batch`] (whatever follows), an empty one
/// [`Kind::Ids`]. `None`: only a walk of the rest tells (the first element is some
/// other value, or lies past [`GLANCE`] bytes of whitespace).
pub(super) fn at_a_glance(raw: &[u8]) -> Option<Kind> {
    match raw.first()? {
        b'[' => {}
        // A value of a parsed body starts with its first byte; whitespace is left to
        // the walk.
        b if b.is_ascii_whitespace() => return None,
        _ => return Some(Kind::Other),
    }
    let first = raw[1..]
        .iter()
        .take(GLANCE)
        .copied()
        .find(|b| !b.is_ascii_whitespace())?;
    match first {
        b'"' | b'[' => Some(Kind::Batch),
        b']' => Some(Kind::Ids),
        _ => None,
    }
}

/// The [`Kind`] of `raw` as `prepare` may tell it on the event loop: walked whole
/// below [`READ_OFF_LOOP_FROM`] bytes (at most some 0.65 ms), else [`at_a_glance`];
/// `None` leaves it to [`check_off_loop`].
pub(super) fn on_the_loop(raw: &[u8]) -> Option<Kind> {
    if raw.len() < READ_OFF_LOOP_FROM {
        return Some(kind(raw));
    }
    at_a_glance(raw)
}

/// A check of the client's prompt that `prepare` left to `resolve`.
#[derive(Debug, Clone)]
pub(crate) enum Unchecked {
    /// A completions prompt its first element does not tell apart.
    Prompt {
        /// The client's prompt, as written.
        prompt: Bytes,
        /// The client's `model` (not `null`), for the `/tokenize` request.
        model: Option<Bytes>,
        /// Whether the orchestrator gave the ids (`PdRequest::tokens`): then only a
        /// batch matters.
        known: bool,
    },
    /// A chat's `messages`, to be looked through for media parts.
    Messages(Bytes),
}

/// The refusal (400) of a batch of completions prompts.
pub(super) fn batch() -> ConnectorError {
    refused("a batch of prompts")
}

/// The refusal (400) of a chat with a media part of `kind`.
pub(super) fn with_media(kind: &str) -> ConnectorError {
    refused(format!(
        "media in a chat (a `{kind}` part): its legs carry token ids, not media"
    ))
}

/// `unchecked`, checked on Tokio's blocking pool within `blocking`, as `prepare` checks
/// a smaller prompt: the `/tokenize` request then (`tokenize`, unless a completions
/// prompt turns out to be text, whose request is made here).
///
/// # Errors
///
/// The refusals of `prepare` ([`batch`], [`with_media`]), and
/// [`ConnectorError::NotReady`] when the blocking pool lost the job (the proxy's
/// runtime shutting down: no engine's fault).
pub(super) async fn check_off_loop(
    unchecked: Unchecked,
    tokenize: Option<Bytes>,
    blocking: &BlockingLimit,
) -> Result<Option<Bytes>, ConnectorError> {
    let lost = |e: disagg_tokenize::TokenizeError| ids::lost("reading the prompt", &e);
    match unchecked {
        Unchecked::Prompt {
            prompt,
            model,
            known,
        } => {
            let raw = prompt.clone();
            match off_loop(blocking, move || Ok(kind(&raw)))
                .await
                .map_err(lost)?
            {
                Kind::Batch => Err(batch()),
                Kind::Other if !known => Ok(Some(completion_tokenize(model.as_deref(), &prompt))),
                Kind::Ids | Kind::Other => Ok(tokenize),
            }
        }
        Unchecked::Messages(messages) => {
            let found = off_loop(blocking, move || Ok(media::media_part(&messages)));
            match found.await.map_err(lost)? {
                Some(kind) => Err(with_media(kind)),
                None => Ok(tokenize),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Kind, at_a_glance, kind};

    /// The glance never contradicts the walk: where it tells, it tells the same.
    #[test]
    fn the_glance_agrees_with_the_walk() {
        for raw in [
            "[1,2,3]",
            r#"["a","b"]"#,
            "[[1],[2]]",
            r#"[1, "a"]"#,
            r#""a""#,
            "[]",
            "[ ]",
            " [ \"a\" ]",
            " []",
            "[1,-2]",
            "[1,2.5]",
            "[-1,[2]]",
            "[18446744073709551616]",
            "[{}]",
            "{}",
            "7",
            "null",
        ] {
            let walked = kind(raw.as_bytes());
            if let Some(glanced) = at_a_glance(raw.as_bytes()) {
                assert_eq!(glanced, walked, "{raw}");
            }
        }
        let spaced = format!("[{}\"a\"]", " ".repeat(100));
        assert_eq!(at_a_glance(spaced.as_bytes()), None);
        assert_eq!(kind(spaced.as_bytes()), Kind::Batch);
    }
}
