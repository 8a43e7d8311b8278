//! The first chunk of a tracked vLLM leg, read once: the header every spliced chunk
//! carries, and the prompt's ids.

use disagg_json::raw;
use serde_json::value::RawValue;

use super::scan::parse_ids_into;

/// The first leg's chunk header, written on every spliced chunk: the JSON object of
/// its `id`, `object`, `created` and `model` as the engine wrote them (kept as text, one
/// allocation; copied as written into each chunk the proxy writes, never built).
pub(super) struct Head(Box<str>);

impl Head {
    /// The header of the first chunk `first`.
    pub(super) fn of(first: &FirstChunk<'_>) -> Self {
        fn text(v: Option<&RawValue>) -> &str {
            v.map_or("null", RawValue::get)
        }
        let mut out = String::with_capacity(64);
        for (key, value) in [
            ("{\"id\":", first.id),
            (",\"object\":", first.object),
            (",\"created\":", first.created),
            (",\"model\":", first.model),
        ] {
            out.push_str(key);
            out.push_str(text(value));
        }
        out.push('}');
        Head(out.into_boxed_str())
    }

    /// Writes the header's members into `chunk`, the start of a chunk written by the
    /// proxy: each value as the engine wrote it (a number such as `1e400` that a
    /// `Value` would refuse included).
    pub(super) fn write(&self, chunk: &mut raw::Object<'_>) {
        // Four JSON values the first chunk's read took whole, in an object: its members
        // always visit.
        let _ = chunk.copy(&self.0, |_, _, _| raw::Edit::Keep);
    }

    /// The header's size in bytes (what a chunk written from it holds of it).
    pub(super) fn size(&self) -> usize {
        self.0.len()
    }
}

/// What the first chunk of a tracked leg is read for: its header and the prompt's ids
/// (at the top, vLLM's chat; or on the first choice, its completions), every value kept
/// as the engine's text; the rest of the chunk is skipped, not built.
#[derive(serde::Deserialize)]
pub(super) struct FirstChunk<'a> {
    #[serde(borrow, default)]
    id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    object: Option<&'a RawValue>,
    #[serde(borrow, default)]
    created: Option<&'a RawValue>,
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prompt_token_ids: Option<&'a RawValue>,
    #[serde(borrow, default)]
    choices: Option<&'a RawValue>,
}

/// A choice of the first chunk, read for its prompt ids.
#[derive(serde::Deserialize)]
struct FirstChoice<'a> {
    #[serde(borrow, default)]
    prompt_token_ids: Option<&'a RawValue>,
}

impl FirstChunk<'_> {
    /// Whether the chunk has a choice (a usage chunk has none, `"choices":[]`).
    pub(super) fn answers(&self) -> bool {
        let mut any = false;
        if let Some(choices) = self.choices {
            // Not a list: no choice.
            let _ = raw::elements(choices.get(), |_| any = true);
        }
        any
    }

    /// The prompt's ids: at the top when set, else on the first choice (`None` when
    /// neither is a list of ids below 2^32).
    pub(super) fn prompt(&self) -> Option<Vec<u32>> {
        let raw = match self.prompt_token_ids {
            Some(ids) => ids,
            None => {
                // The first choice only; the others are walked, not built.
                let mut first = None;
                disagg_json::raw::elements(self.choices?.get(), |c| {
                    first.get_or_insert(c);
                })
                .ok()?;
                serde_json::from_str::<FirstChoice<'_>>(first?.get())
                    .ok()?
                    .prompt_token_ids?
            }
        };
        let mut ids = Vec::new();
        parse_ids_into(raw.get().as_bytes(), &mut ids)?;
        Some(ids)
    }
}
