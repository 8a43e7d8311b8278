//! A continuation's chunks rewritten into the client's stream: its choices renumbered
//! and its generated ids counted, and the usage chunk the proxy writes itself.

use disagg_json::raw;
use serde_json::value::RawValue;

use super::head::Head;
use super::plan::*;
use super::scan::ids_of;

/// A continuation's chunk rewritten for the client ([`splice_chunk`]).
#[derive(Debug)]
pub(super) struct Spliced {
    /// The client's chunk (`None`: a usage chunk the client did not ask for).
    pub(super) json: Option<Vec<u8>>,
    /// The generated ids its choices carry.
    pub(super) ids: Vec<u32>,
    /// A choice has a finish reason.
    pub(super) finished: bool,
    /// It carries the usage, which goes out.
    pub(super) usage: bool,
}

/// The chunk `data` of a continuation rewritten for the client: `head`'s `id`,
/// `object`, `created` and `model`; each choice at index 0 with its text (a chat's as
/// `delta.content`), finish and stop reasons, and its token ids when the client asked
/// for them, and the prompt's ids too when the chunk is the client's `first` of the
/// answer (nothing came before the continuation: vLLM writes them on its first chunk,
/// a chat's on the chunk, a completion's on its choice); a usage counting the original
/// prompt once and the completion tokens of every leg (`carried` before this one).
/// `None` when `data` is not one JSON value.
///
/// The chunk is walked, never built as a `Value` (which costs up to ninety bytes per
/// byte of an engine's `[{"":0},...]`): the values carried over are copied as the
/// engine wrote them, the rest is skipped, and only the ids, the finish and the counts
/// are read.
pub(super) fn splice_chunk(
    head: &Head,
    plan: &Plan,
    carried: u64,
    first: bool,
    data: &[u8],
) -> Option<Spliced> {
    let text = std::str::from_utf8(data).ok()?;
    // One JSON value (an object's walk checks all of it), never built.
    let [choices, usage] = if raw::is_object(text) {
        raw::members_named(text, ["choices", "usage"]).ok()?
    } else {
        // Another value has neither choices nor usage.
        serde_json::from_str::<&RawValue>(text).ok()?;
        [None, None]
    };
    let usage = usage.filter(|u| u.get() != "null");
    let mut spliced = Spliced {
        json: None,
        ids: Vec::new(),
        finished: false,
        usage: false,
    };
    let mut json = Vec::with_capacity(head.size() + 256);
    let mut chunk = raw::Object::open(&mut json);
    head.write(&mut chunk);
    let list = chunk.key("choices");
    list.push(b'[');
    // The prompt's ids the client asked for, on its first chunk of the answer (the
    // continuation's, on its choice).
    let ask = first && plan.client_ids;
    let mut prompt = None;
    if let Some(choices) = choices.filter(|c| raw::is_list(c.get())) {
        let mut once = true;
        // A list within a valid value: its elements always visit.
        let _ = raw::elements(choices.get(), |c| {
            if !std::mem::take(&mut once) {
                list.push(b',');
            }
            let ids = write_choice(c, plan, list, &mut spliced, ask);
            prompt = prompt.or(ids);
        });
    }
    list.push(b']');
    if let Some(ids) = prompt.filter(|_| plan.chat) {
        chunk.raw("prompt_token_ids", ids.get().as_bytes());
    }
    if let Some(usage) = usage {
        if !plan.usage {
            return Some(spliced);
        }
        spliced.usage = true;
        // A usage that is not an object counts nothing.
        let [leg, prompt] = raw::members_named(usage.get(), ["completion_tokens", "prompt_tokens"])
            .unwrap_or([None, None]);
        let count = |v: Option<&RawValue>| v.and_then(raw::u64_of).unwrap_or(0);
        // The engine's counts are any u64 it wrote: saturate rather than panic (debug)
        // or wrap to a small count (release).
        let completion = carried.saturating_add(count(leg));
        let prompt = count(prompt).saturating_sub(carried);
        write_usage(chunk.key("usage"), prompt, completion);
    }
    chunk.close();
    spliced.json = Some(json);
    Some(spliced)
}

/// Writes the continuation's choice `c` (a value of its `choices`) as the client's, at
/// index 0: its `text`, `finish_reason` and `stop_reason` copied as written, its
/// `token_ids` read into `spliced` (and written, when the client asked for them and
/// they are ids; `null` when they are not). A choice that is not an object has an
/// empty text and no finish. With `prompt`, its `prompt_token_ids` are returned, and
/// written on a completion's choice (a chat's go on its chunk).
fn write_choice<'a>(
    c: &'a RawValue,
    plan: &Plan,
    out: &mut Vec<u8>,
    spliced: &mut Spliced,
    prompt: bool,
) -> Option<&'a RawValue> {
    let [text, finish, ids, stop, prompt_ids] = raw::members_named(
        c.get(),
        [
            "text",
            "finish_reason",
            "token_ids",
            "stop_reason",
            "prompt_token_ids",
        ],
    )
    .unwrap_or([None; 5]);
    let prompt_ids = prompt_ids.filter(|p| prompt && p.get() != "null");
    let finish = finish.map_or("null", RawValue::get);
    spliced.finished |= finish != "null";
    let ids = ids.filter(|ids| ids_of(ids, &mut spliced.ids));
    let text = text.map_or("\"\"", RawValue::get).as_bytes();
    let mut o = raw::Object::open(out);
    o.raw("index", b"0");
    if plan.chat {
        let mut delta = raw::Object::open(o.key("delta"));
        delta.raw("content", text);
        delta.close();
    } else {
        o.raw("text", text);
    }
    o.raw("logprobs", b"null");
    o.raw("finish_reason", finish.as_bytes());
    if let Some(stop) = stop {
        o.raw("stop_reason", stop.get().as_bytes());
    }
    if plan.client_ids {
        o.raw("token_ids", ids.map_or("null", RawValue::get).as_bytes());
    }
    if let Some(p) = prompt_ids.filter(|_| !plan.chat) {
        o.raw("prompt_token_ids", p.get().as_bytes());
    }
    o.close();
    prompt_ids
}

/// Writes a usage object of `prompt` and `completion` tokens into `out`.
fn write_usage(out: &mut Vec<u8>, prompt: u64, completion: u64) {
    let mut u = raw::Object::open(out);
    u.value("prompt_tokens", &prompt);
    u.value("completion_tokens", &completion);
    u.value("total_tokens", &prompt.saturating_add(completion));
    u.close();
}

/// The usage chunk the proxy writes at the end of a stream whose last token is out:
/// `head`'s header, no choices, the usage of `prompt` and `completion` tokens.
pub(super) fn usage_chunk(head: &Head, prompt: u64, completion: u64) -> Vec<u8> {
    let mut json = Vec::with_capacity(head.size() + 128);
    let mut chunk = raw::Object::open(&mut json);
    head.write(&mut chunk);
    chunk.raw("choices", b"[]");
    write_usage(chunk.key("usage"), prompt, completion);
    chunk.close();
    json
}
