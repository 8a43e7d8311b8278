//! SGLang's native `/generate`, migrated: which requests may be, the continuation's
//! body, and its events spliced into the client's stream.
//!
//! Facts (SGLang 0.5.23 `python/sglang/srt/managers/io_struct.py` `GenerateReqInput`,
//! `srt/sampling/sampling_params.py` `SamplingParams`,
//! `srt/managers/tokenizer_manager.py`): the prompt is `text` or `input_ids` (one of
//! them; a flat list of ids is one prompt), the limits are
//! `sampling_params.max_new_tokens` and `min_new_tokens`; a streamed answer is
//! `data: {"text", "output_ids", "meta_info"}` events whose `text` and `output_ids` hold
//! everything generated so far (the default, non-incremental streaming), the finish in
//! `meta_info.finish_reason` (an object, `null` until the end), then `data: [DONE]`. The
//! stream carries no prompt ids: only a request with `input_ids` is migrated, and the
//! tracking keeps the last event relayed (a slice of its frame, no copy), read only
//! when the stream breaks.

use std::io::Write as _;

use bytes::{Bytes, BytesMut};
use serde_json::value::RawValue;

use crate::request::PdRequest;
use disagg_json::JsonBody;
use disagg_json::raw::{self, Edit};

use super::plan::{Plan, REFUSED, set};
use super::scan::parse_ids_into;
use super::{Migrating, MigrationConfig, Reason};

/// Top-level fields of a `/generate` request whose state a token prompt cannot carry:
/// another prompt form, media, log probabilities, hidden states, a session, a custom
/// logit processor.
const REFUSED_GENERATE: [&str; 10] = [
    "text",
    "input_embeds",
    "image_data",
    "audio_data",
    "video_data",
    "return_logprob",
    "return_hidden_states",
    "session_params",
    "custom_logit_processor",
    "token_ids_logprob",
];

/// `sampling_params` that make structured output (a grammar's state is not carried).
const STRUCTURED: [&str; 4] = ["json_schema", "regex", "ebnf", "structural_tag"];

/// Whether the `/generate` request `req` may be migrated: streamed, one prompt given
/// as `input_ids`, one sample, `max_new_tokens` set (the engine's default differs by
/// version, so what is left of it would be a guess), nothing [`REFUSED_GENERATE`] or
/// structured, and a `sampling_seed` only with [`MigrationConfig::allow_seed`].
pub(super) fn plan(config: &MigrationConfig, req: &PdRequest) -> Option<Plan> {
    let b = req.body();
    if REFUSED_GENERATE.iter().any(|k| set(b.get(k))) || REFUSED.iter().any(|k| set(b.get(k))) {
        return None;
    }
    let mut prompt = Vec::new();
    parse_ids_into(b.get("input_ids")?.trim_ascii(), &mut prompt)?;
    if prompt.is_empty() || prompt.len() > config.max_seq_len {
        return None;
    }
    // The few parameters read in one walk (the last of a repeated key counts); the
    // rest is not built. A parameter that is null or false is unset.
    let params = std::str::from_utf8(b.get("sampling_params")?).ok()?;
    let [structured @ .., n, seed, max_new, min_new] = raw::members_named(
        params,
        [
            STRUCTURED[0],
            STRUCTURED[1],
            STRUCTURED[2],
            STRUCTURED[3],
            "n",
            "sampling_seed",
            "max_new_tokens",
            "min_new_tokens",
        ],
    )
    .ok()?
    .map(|v| v.filter(|v| !matches!(v.get(), "null" | "false")));
    if structured.iter().any(Option::is_some) {
        return None;
    }
    if n.and_then(raw::u64_of).is_some_and(|n| n > 1) {
        return None;
    }
    if !config.allow_seed && seed.is_some() {
        return None;
    }
    let max_tokens = Some(raw::u64_of(max_new?)?);
    let min_tokens = min_new.and_then(raw::u64_of);
    Some(Plan {
        chat: false,
        generate: Some(prompt),
        client_ids: false,
        usage: false,
        max_tokens,
        min_tokens,
        body: b.clone(),
    })
}

/// The continuation's body: the client's, with `input_ids` = `ids` (the prompt and the
/// generated ids), the token limits less what was generated, streamed, without the
/// client's `rid` (the engines must not see one id twice).
pub(super) fn continuation_body(
    plan: &Plan,
    ids: &[u32],
    generated: u64,
    left: Option<u64>,
) -> Bytes {
    let mut body: JsonBody = plan.body.clone();
    body.remove("rid");
    body.set("input_ids", ids);
    // The client's parameters as written (the plan read them as an object), the
    // limits replaced.
    let client = body
        .get("sampling_params")
        .and_then(|p| std::str::from_utf8(p).ok())
        .unwrap_or("{}");
    let mut params = Vec::with_capacity(client.len() + 64);
    let mut o = raw::Object::open(&mut params);
    let _ = o.copy(client, |k, _, _| match k {
        "max_new_tokens" if left.is_some() => raw::Edit::Drop,
        "min_new_tokens" if plan.min_tokens.is_some() => raw::Edit::Drop,
        _ => raw::Edit::Keep,
    });
    if let Some(left) = left {
        o.value("max_new_tokens", &left);
    }
    if let Some(min) = plan.min_tokens {
        o.value("min_new_tokens", &min.saturating_sub(generated));
    }
    o.close();
    body.set_raw("sampling_params", Bytes::from(params));
    body.set_raw("stream", Bytes::from_static(b"true"));
    body.to_bytes()
}

/// What the client's stream held when it broke: the text and ids generated so far and
/// the answer's id (as the engine wrote it), from its last event; every spliced event
/// starts from them.
#[derive(Debug, Clone)]
pub(super) struct Prefix {
    text: String,
    pub(super) ids: Vec<u32>,
    id: Box<RawValue>,
}

/// The prefix the last event relayed to the client holds (`None` when it is not an
/// answer event of one sequence). The event is walked, not built: its text decoded,
/// its ids read, its id kept as written, the rest skipped.
pub(super) fn prefix(last: &[u8]) -> Option<Prefix> {
    let last = std::str::from_utf8(last).ok()?;
    let [text, ids, meta] = raw::members_named(last, ["text", "output_ids", "meta_info"]).ok()?;
    let text = serde_json::from_str::<String>(text?.get()).ok()?;
    let mut read = Vec::new();
    parse_ids_into(ids?.get().as_bytes(), &mut read)?;
    let id = raw::member(meta?.get(), "id")?.to_owned();
    Some(Prefix {
        text,
        ids: read,
        id,
    })
}

/// A continuation's event `data` rewritten into the client's stream: its text and ids
/// after the prefix's, the first leg's id, the original prompt's length and every
/// leg's completion tokens; whether it finishes the answer. `None` for what is not an
/// answer event.
///
/// The event is walked, never built as a `Value` (which costs up to ninety bytes per
/// byte of an engine's `[{"":0},...]`): the members the splice does not touch, at the
/// top and in `meta_info`, are copied as the engine wrote them, and so are the
/// continuation's ids; only the text, the counts and the finish are read. A key that
/// repeats is written once, where its last member was (the one a parser keeps).
pub(super) fn splice(prefix: &Prefix, prompt_len: usize, data: &[u8]) -> Option<(Vec<u8>, bool)> {
    let data = std::str::from_utf8(data).ok()?;
    let [text, ids, meta] = raw::members_named(data, ["text", "output_ids", "meta_info"]).ok()?;
    let text = text?;
    let decoded = serde_json::from_str::<String>(text.get()).ok()?;
    let ids = ids.filter(|v| raw::is_list(v.get()))?;
    let meta = meta.filter(|v| raw::is_object(v.get()))?;
    let mut all = String::with_capacity(prefix.text.len() + decoded.len());
    all.push_str(&prefix.text);
    all.push_str(&decoded);
    drop(decoded);
    let [id, prompt, completion, finish] = raw::members_named(
        meta.get(),
        ["id", "prompt_tokens", "completion_tokens", "finish_reason"],
    )
    .ok()?;
    let carried = prefix.ids.len() as u64;
    // The engine's counts are any u64 it wrote: saturate rather than panic (debug) or
    // wrap to a small count (release).
    let completion_tokens = carried.saturating_add(completion.and_then(raw::u64_of).unwrap_or(0));
    // A length finish names the limit, the client's: the continuation's plus the
    // tokens carried.
    let length = finish.filter(|f| raw::is_object(f.get())).and_then(|f| {
        let [kind, length] = raw::members_named(f.get(), ["type", "length"]).ok()?;
        // Any spelling of "length" is short: a longer string is not read.
        let kind = kind.filter(|k| k.get().len() <= 64)?;
        let kind = serde_json::from_str::<String>(kind.get()).ok()?;
        let length = length?;
        let n = raw::u64_of(length)?;
        (kind == "length").then_some((length, carried.saturating_add(n)))
    });
    let finished = finish.is_some_and(|f| f.get() != "null");
    let mut out = Vec::with_capacity(
        data.len() + all.len() + prefix.ids.len() * 11 + prefix.id.get().len() + 64,
    );
    let mut o = raw::Object::open(&mut out);
    // A valid object (the members were found in it): its members always visit.
    let _ = o.copy(data, |key, v, out| match key {
        "text" if same(v, text) => {
            // A string always encodes.
            let _ = serde_json::to_writer(&mut *out, &all);
            Edit::Wrote
        }
        "output_ids" if same(v, ids) => {
            write_ids(out, &prefix.ids, v);
            Edit::Wrote
        }
        "meta_info" if same(v, meta) => {
            let mut m = raw::Object::open(out);
            let _ = m.copy(meta.get(), |key, v, out| match key {
                "id" if id.is_some_and(|id| same(v, id)) => {
                    out.extend_from_slice(prefix.id.get().as_bytes());
                    Edit::Wrote
                }
                "prompt_tokens" if prompt.is_some_and(|p| same(v, p)) => {
                    let _ = write!(out, "{prompt_len}");
                    Edit::Wrote
                }
                "completion_tokens" if completion.is_some_and(|c| same(v, c)) => {
                    let _ = write!(out, "{completion_tokens}");
                    Edit::Wrote
                }
                "finish_reason" if finish.is_some_and(|f| same(v, f)) => {
                    let Some((length, n)) = length else {
                        return Edit::Keep;
                    };
                    let mut f = raw::Object::open(out);
                    let _ = f.copy(v.get(), |key, v, out| match key {
                        "length" if same(v, length) => {
                            let _ = write!(out, "{n}");
                            Edit::Wrote
                        }
                        "length" => Edit::Drop,
                        _ => Edit::Keep,
                    });
                    f.close();
                    Edit::Wrote
                }
                "id" | "prompt_tokens" | "completion_tokens" | "finish_reason" => Edit::Drop,
                _ => Edit::Keep,
            });
            if id.is_none() {
                m.raw("id", prefix.id.get().as_bytes());
            }
            if prompt.is_none() {
                m.value("prompt_tokens", &prompt_len);
            }
            if completion.is_none() {
                m.value("completion_tokens", &completion_tokens);
            }
            m.close();
            Edit::Wrote
        }
        // An earlier member of a key the splice writes: the last one is written, once
        // (a parser keeps the last).
        "text" | "output_ids" | "meta_info" => Edit::Drop,
        _ => Edit::Keep,
    });
    o.close();
    Some((out, finished))
}

/// Whether `a` and `b` are the same member's value of one text (not merely equal).
fn same(a: &RawValue, b: &RawValue) -> bool {
    std::ptr::addr_eq(a, b)
}

/// Writes the JSON list of `head`, then the elements of the JSON list `tail` as written.
fn write_ids(out: &mut Vec<u8>, head: &[u32], tail: &RawValue) {
    out.push(b'[');
    let mut first = true;
    for id in head {
        if !std::mem::take(&mut first) {
            out.push(b',');
        }
        let _ = write!(out, "{id}");
    }
    // A list within a valid value: its elements always visit.
    let _ = raw::elements(tail.get(), |v| {
        if !std::mem::take(&mut first) {
            out.push(b',');
        }
        out.extend_from_slice(v.get().as_bytes());
    });
    out.push(b']');
}

impl Migrating {
    /// The stream broke: what it held is the prefix a continuation goes on from, read
    /// from the last event relayed; a stream with none, or past the bound, is no longer
    /// migratable.
    pub(super) fn generate_prefix(&mut self) {
        if !self.on || self.raw {
            return;
        }
        let len = self.prompt.as_ref().map_or(0, Vec::len);
        match self.last.as_deref().and_then(prefix) {
            Some(p) if len + p.ids.len() <= self.ctx.config.max_seq_len => {
                self.generated = p.ids.clone();
                self.prefix = Some(p);
            }
            _ => self.untrack(),
        }
    }

    /// An event of a `/generate` first leg: relayed as it came, the last one kept (a
    /// slice of its frame).
    pub(super) fn generate_first_leg(
        &mut self,
        event: &Bytes,
        out: &mut BytesMut,
    ) -> Result<(), Reason> {
        let Some(data) = self.relayed(event, out)? else {
            return Ok(());
        };
        if super::has_finish(data) {
            self.finished = true;
        }
        self.last = Some(event.slice_ref(data));
        out.extend_from_slice(event);
        Ok(())
    }

    /// An event of a `/generate` continuation, rewritten into the client's stream.
    pub(super) fn generate_spliced(
        &mut self,
        event: &Bytes,
        out: &mut BytesMut,
    ) -> Result<(), Reason> {
        let Some(data) = self.continued(event, out)? else {
            return Ok(());
        };
        let (Some(prefix), Some(prompt)) = (&self.prefix, &self.prompt) else {
            return Err(Reason::ErrorFrame);
        };
        let Some((json, finished)) = splice(prefix, prompt.len(), data) else {
            return Err(Reason::ErrorFrame);
        };
        self.finished |= finished;
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(&json);
        out.extend_from_slice(b"\n\n");
        self.last = Some(Bytes::from(json));
        Ok(())
    }
}
