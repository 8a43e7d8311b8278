//! SGLang's native `/generate` API, as the SGLang connector carries it over P/D.
//!
//! Facts (SGLang 0.5.23 `python/sglang/srt/managers/io_struct.py` `GenerateReqInput`,
//! `managers/tokenizer_manager.py`, `entrypoints/http_server.py`; the routers
//! `python/sglang/srt/disaggregation/mini_lb.py` and
//! `sgl-model-gateway/src/routers/http/pd_router.rs`):
//!
//! - a request is a **batch** when `text` is a list of strings, or `input_ids` a list of
//!   token-id lists, and each prompt is sampled `sampling_params.n` times: each of the
//!   B·n is a request of its own on the engines, so each needs a room of its own (see
//!   [`super::sglang`] for how SGLang expands the rooms it is given);
//! - both legs get the same body (the prefill engine, in `--disaggregation-mode
//!   prefill`, stops after the prompt whatever the sampling parameters say);
//! - with `return_logprob`, the prompt's logprobs (`meta_info.input_token_logprobs`)
//!   are computed by the prefill only; the routers prepend the prefill's list to the
//!   decode's in every answer the client gets: the whole JSON, or every streamed `data:`
//!   event (a batch: element by element, by position or by the event's `index`). The
//!   decode's answer waits for the prefill's ([`Dispatch::Joined`](super::Dispatch::Joined)).
//! - SGLang streams `data: {"text", "output_ids", "meta_info", ("index")}` events, then
//!   `data: [DONE]`.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http_body::Frame;
use serde_json::value::RawValue;

use crate::common::sse::{EventMap, MapEvents, event_end};
use disagg_core::connector::{PrefillAnswer, Reshape};
use disagg_core::error::BoxError;
use disagg_core::transport::{BoxBody, read_limited};
use disagg_json::JsonBody;
use disagg_json::raw::{self as json, Edit};

/// Largest non-streaming decode answer merged with the prefill's logprobs: it is read
/// whole to be rewritten. Logprob-laden batch answers are large; 64 MiB holds a batch of
/// long prompts with every token's logprob and leaves room.
const MAX_MERGED_ANSWER: usize = 64 * 1024 * 1024;

/// How many sequences a `/generate` request asks for: `Some(n)` for a batch of `n`
/// (`text` a list of strings, `input_ids` a list of token-id lists), `None` for one.
pub(crate) fn batch_size(body: &JsonBody) -> Option<usize> {
    if let Some(text) = body.get("text") {
        return list_len(text);
    }
    // A flat list of token ids is one prompt; a list of lists is a batch.
    let list = json::list_head(body.get("input_ids")?)?;
    (list.first == Some(b'[')).then_some(list.len)
}

/// The length of `raw` when it is a non-empty JSON list.
fn list_len(raw: &[u8]) -> Option<usize> {
    json::list_head(raw).map(|l| l.len).filter(|n| *n > 0)
}

/// Whether the request asks for logprobs: `return_logprob` true (read as pydantic's lax
/// `bool`), or a per-element list holding a true.
pub(crate) fn wants_logprobs(body: &JsonBody) -> bool {
    let Some(raw) = body.get("return_logprob") else {
        return false;
    };
    if raw.first() == Some(&b'[') {
        let mut any = false;
        let _ = std::str::from_utf8(raw).map(|text| {
            json::elements(text, |v| {
                any |= disagg_json::lax::bool_value(v.get().as_bytes()) == Ok(Some(true));
            })
        });
        return any;
    }
    disagg_json::lax::bool_value(raw) == Ok(Some(true))
}

/// How many sequences a `/generate` request makes on the engines: its prompts (1, or
/// the batch's size) times its samples (`sampling_params.n`, read from the first
/// element of a per-prompt list as SGLang reads it; 1 when absent or not a positive
/// integer). Every `index` of an answer is below it.
pub(crate) fn sequences(body: &JsonBody) -> usize {
    batch_size(body).unwrap_or(1).saturating_mul(samples(body))
}

/// `sampling_params.n` of a `/generate` request, 1 when [`sample_count`] cannot read it
/// (the check refuses such a request before any leg is planned).
pub(crate) fn samples(body: &JsonBody) -> usize {
    sample_count(body).unwrap_or(1)
}

/// `sampling_params.n` as SGLang 0.5.23 reads it (`io_struct.py`
/// `GenerateReqInput._handle_parallel_sampling`: `sampling_params.get("n", 1)`, of the
/// first element of a per-prompt list), the raw value, parsed by Python's `json`: the
/// last of a repeated key. 1 when `sampling_params` is absent or `null`, lacks `n`, or
/// is not an object (nor a list starting with one: the engine refuses those itself),
/// and for an integer below 1 (left to the engine, as before).
///
/// # Errors
///
/// [`Unreadable`] when `n` is there but no integer (a string, `null`, a boolean, a
/// fraction, a container): SGLang compares the raw value with 1 (`"2" > 1` raises), so
/// such a value is no single sample, and the proxy cannot tell how many rooms it needs.
pub(crate) fn sample_count(body: &JsonBody) -> Result<usize, Unreadable> {
    let Some(params) = body
        .get("sampling_params")
        .and_then(|raw| std::str::from_utf8(raw).ok())
    else {
        return Ok(1);
    };
    let first = if json::is_list(params) {
        let mut first = None;
        let _ = json::elements(params, |v| {
            first.get_or_insert(v);
        });
        match first {
            Some(v) => v.get(),
            None => return Ok(1),
        }
    } else {
        params
    };
    let Some(n) = json::member(first, "n") else {
        return Ok(1);
    };
    let n: serde_json::Number = serde_json::from_str(n.get()).map_err(|_| Unreadable)?;
    let n = match (n.as_u64(), n.as_i64(), n.as_f64()) {
        (Some(n), _, _) => n,
        (None, Some(_), _) => return Ok(1),
        (None, None, Some(f)) if f.fract() == 0.0 => {
            if f < 1.0 {
                return Ok(1);
            }
            // Saturating: every count past the ceiling is refused alike.
            f as u64
        }
        _ => return Err(Unreadable),
    };
    Ok(usize::try_from(n).unwrap_or(usize::MAX).max(1))
}

/// A `sampling_params.n` that is no integer ([`sample_count`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Unreadable;

/// What the plan of a `/generate` request with logprobs remembers until the prefill
/// answered (kept in [`Handoff::ext`](super::Handoff::ext)): whether the client
/// streams, and how many sequences the request makes ([`sequences`]), the bound of
/// every index an answer may name.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MergeLogprobs {
    pub(crate) stream: bool,
    pub(crate) sequences: usize,
}

/// An engine's answer named a sequence the request does not have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OutOfRange {
    /// What was out of range (`"index"`, `"list length"`).
    pub(crate) what: &'static str,
    /// The value the engine wrote.
    pub(crate) found: String,
    /// The request's sequences.
    pub(crate) sequences: usize,
}

/// The prefill's prompt logprobs, by element, from its whole answer: a JSON object (one
/// element), a JSON list (a batch, by position), or an event stream (the first event of
/// each `index`). `None` when the answer carries none. Each element's list is kept as
/// the engine wrote it (a raw slice, not a built `Value`: it is held until the decode's
/// answer ends).
///
/// # Errors
///
/// [`OutOfRange`] when the answer names an element the request does not have (an
/// `index` not below `sequences`, or not a non-negative integer; a list of more than
/// `sequences` answers): nothing is allocated for it.
pub(crate) fn prefill_logprobs(
    answer: &PrefillAnswer,
    sequences: usize,
) -> Result<Option<Vec<Option<Box<RawValue>>>>, OutOfRange> {
    let mut out: Vec<Option<Box<RawValue>>> = Vec::new();
    let mut put = |index: usize, v: Option<Box<RawValue>>| {
        if out.len() <= index {
            out.resize(index + 1, None);
        }
        if out[index].is_none() {
            out[index] = v;
        }
    };
    let text = std::str::from_utf8(&answer.body).ok();
    match text.and_then(|t| serde_json::from_str::<&RawValue>(t).ok()) {
        Some(one) if json::is_object(one.get()) => put(0, input_logprobs(one.get())),
        Some(list) if json::is_list(list.get()) => {
            let mut count = 0usize;
            // A valid list: its elements always visit.
            let _ = json::elements(list.get(), |item| {
                if count < sequences && json::is_object(item.get()) {
                    put(count, input_logprobs(item.get()));
                }
                count += 1;
            });
            if count > sequences {
                return Err(OutOfRange {
                    what: "list length",
                    found: count.to_string(),
                    sequences,
                });
            }
        }
        Some(_) => return Ok(None),
        // Not one JSON value: a stream of events.
        None => {
            let mut rest = &answer.body[..];
            while let Some((end, next)) = event_end(rest) {
                if let Some(data) = data_object(&rest[..end])
                    && let Ok([index]) = json::members_named(data, ["index"])
                {
                    put(checked_index(index, sequences)?, input_logprobs(data));
                }
                rest = &rest[next..];
            }
        }
    }
    Ok(out.iter().any(Option::is_some).then_some(out))
}

/// The element an event of an engine answers: its `index` (0 without one), which must
/// be a non-negative integer below `sequences`.
fn checked_index(index: Option<&RawValue>, sequences: usize) -> Result<usize, OutOfRange> {
    let Some(raw) = index else {
        return Ok(0);
    };
    json::u64_of(raw)
        .and_then(|i| usize::try_from(i).ok())
        .filter(|i| *i < sequences)
        .ok_or_else(|| OutOfRange {
            what: "index",
            found: raw.get().to_owned(),
            sequences,
        })
}

/// `meta_info.input_token_logprobs` of one answer object, when it is a list.
fn input_logprobs(obj: &str) -> Option<Box<RawValue>> {
    let meta = json::member(obj, "meta_info")?;
    let list = json::member(meta.get(), "input_token_logprobs")?;
    json::is_list(list.get()).then(|| list.to_owned())
}

/// Writes the answer object `obj` with the prefill's logprobs of the element `index`
/// before its own `meta_info.input_token_logprobs`; every other member as it came.
fn merge_object(obj: &str, prefill: &[Option<Box<RawValue>>], index: usize, out: &mut Vec<u8>) {
    let Some(Some(head)) = prefill.get(index) else {
        out.extend_from_slice(obj.as_bytes());
        return;
    };
    let mark = out.len();
    let mut o = json::Object::open(out);
    let copied = o.copy(obj, |key, meta, out| {
        if key != "meta_info" || !json::is_object(meta.get()) {
            return Edit::Keep;
        }
        let mut m = json::Object::open(out);
        // `meta` is a valid object: its members always visit.
        let _ = m.copy(meta.get(), |key, own, out| {
            if key == "input_token_logprobs" && json::is_list(own.get()) {
                json::concat_lists(head.get(), own.get(), out);
                Edit::Wrote
            } else {
                Edit::Keep
            }
        });
        m.close();
        Edit::Wrote
    });
    match copied {
        Ok(()) => o.close(),
        Err(_) => {
            // Not an object after all: as it came.
            out.truncate(mark);
            out.extend_from_slice(obj.as_bytes());
        }
    }
}

/// The change of form of a `/generate` answer with logprobs: the prefill's prompt
/// logprobs prepended to the decode's, element by element.
#[derive(Debug)]
pub(crate) struct LogprobMerge {
    prefill: Arc<[Option<Box<RawValue>>]>,
    stream: bool,
}

impl LogprobMerge {
    /// A merge of `prefill`'s logprobs into a streamed (`stream`) or whole answer.
    pub(crate) fn new(prefill: Vec<Option<Box<RawValue>>>, stream: bool) -> Self {
        LogprobMerge {
            prefill: prefill.into(),
            stream,
        }
    }
}

impl Reshape for LogprobMerge {
    fn body(&self, decode: BoxBody) -> BoxBody {
        let prefill = Arc::clone(&self.prefill);
        if self.stream {
            BoxBody::new(MapEvents::new(decode, MergeEvents { prefill }))
        } else {
            BoxBody::new(http_body_util::StreamBody::new(futures::stream::once(
                whole(decode, prefill),
            )))
        }
    }
}

/// The whole decode answer, merged; passed as it came when it is not a JSON object or
/// list (as SGLang's routers do). Its members are copied as the decode wrote them, never
/// built: a 64 MiB answer costs about 64 MiB of output, not a gigabyte of `Value`s.
async fn whole(
    decode: BoxBody,
    prefill: Arc<[Option<Box<RawValue>>]>,
) -> Result<Frame<Bytes>, BoxError> {
    let bytes = read_limited(decode, MAX_MERGED_ANSWER).await?;
    let merged = std::str::from_utf8(&bytes)
        .ok()
        .and_then(|text| merged_answer(text, &prefill));
    Ok(Frame::data(merged.map_or(bytes, Bytes::from)))
}

/// The whole answer `text` merged: an object (element 0) or a list (by position);
/// `None` when it is neither.
fn merged_answer(text: &str, prefill: &[Option<Box<RawValue>>]) -> Option<Vec<u8>> {
    // Read once, as it is merged: an object that is not JSON is written as it came
    // (`merge_object`), a list that is not JSON gives `None`.
    let text = json::trim(text);
    let heads: usize = prefill.iter().flatten().map(|h| h.get().len()).sum();
    let mut out = Vec::with_capacity(text.len().saturating_add(heads));
    if json::is_object(text) {
        merge_object(text, prefill, 0, &mut out);
    } else if json::is_list(text) {
        out.push(b'[');
        let mut i = 0usize;
        json::elements(text, |item| {
            if i > 0 {
                out.push(b',');
            }
            if json::is_object(item.get()) {
                merge_object(item.get(), prefill, i, &mut out);
            } else {
                out.extend_from_slice(item.get().as_bytes());
            }
            i += 1;
        })
        .ok()?;
        out.push(b']');
    } else {
        return None;
    }
    Some(out)
}

/// The decode's event stream with each `data:` event merged; only an unfinished event is
/// held back, each frame's complete events go out with it.
struct MergeEvents {
    prefill: Arc<[Option<Box<RawValue>>]>,
}

impl EventMap for MergeEvents {
    fn event(&self, ev: &[u8], out: &mut BytesMut) {
        if let Some(data) = data_object(ev)
            && let Ok([None, index]) = json::members_named(data, ["error", "index"])
        {
            // Unchecked: an index the request does not have finds no logprobs, and the
            // event passes unmerged.
            let index = index
                .and_then(json::u64_of)
                .and_then(|i| usize::try_from(i).ok())
                .unwrap_or(0);
            let mut v = Vec::with_capacity(data.len() + 64);
            v.extend_from_slice(b"data: ");
            merge_object(data, &self.prefill, index, &mut v);
            v.extend_from_slice(b"\n\n");
            out.extend_from_slice(&v);
            return;
        }
        // `[DONE]`, error events, comments, what is not JSON: as they came.
        out.extend_from_slice(ev);
        out.extend_from_slice(b"\n\n");
    }
}

/// The JSON object text of a `data:` event, if it is one.
fn data_object(ev: &[u8]) -> Option<&str> {
    let data = ev
        .strip_prefix(b"data: ")
        .or_else(|| ev.strip_prefix(b"data:"))?;
    let data = std::str::from_utf8(data.trim_ascii()).ok()?;
    data.starts_with('{').then_some(data)
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;
    use serde_json::{Value, json};

    use super::*;

    fn body(s: &str) -> JsonBody {
        JsonBody::parse(s.as_bytes()).unwrap()
    }

    /// A prefill's logprob list as the merge holds it.
    fn raw(v: Value) -> Option<Box<RawValue>> {
        Some(serde_json::value::to_raw_value(&v).unwrap())
    }

    /// The logprob lists found, built to compare.
    fn built(found: Vec<Option<Box<RawValue>>>) -> Vec<Option<Value>> {
        found
            .into_iter()
            .map(|v| v.map(|v| serde_json::from_str(v.get()).unwrap()))
            .collect()
    }

    fn answer(s: &str) -> PrefillAnswer {
        PrefillAnswer {
            status: http::StatusCode::OK,
            headers: http::HeaderMap::new(),
            body: Bytes::from(s.to_owned()),
        }
    }

    #[test]
    fn batches_are_text_lists_and_id_list_lists() {
        let cases = [
            (r#"{"text":"a"}"#, None),
            (r#"{"text":["a","b","c"]}"#, Some(3)),
            (r#"{"text":[]}"#, None),
            (r#"{"input_ids":[1,2,3]}"#, None),
            (r#"{"input_ids":[[1,2],[3]]}"#, Some(2)),
            (r#"{"sampling_params":{"n":4},"text":"a"}"#, None),
            ("{}", None),
        ];
        for (b, want) in cases {
            assert_eq!(batch_size(&body(b)), want, "{b}");
        }
    }

    #[test]
    fn logprobs_are_wanted_as_sglang_reads_the_flag() {
        for (b, want) in [
            (r#"{"return_logprob":true}"#, true),
            (r#"{"return_logprob":"yes"}"#, true),
            (r#"{"return_logprob":[false,true]}"#, true),
            (r#"{"return_logprob":[false]}"#, false),
            (r#"{"return_logprob":false}"#, false),
            (r#"{"return_logprob":null}"#, false),
            ("{}", false),
        ] {
            assert_eq!(wants_logprobs(&body(b)), want, "{b}");
        }
    }

    #[test]
    fn prefill_logprobs_from_json_lists_and_streams() {
        let one = answer(
            r#"{"text":"x","meta_info":{"input_token_logprobs":[[null,1,null],[-0.5,2,null]]}}"#,
        );
        assert_eq!(
            built(prefill_logprobs(&one, 1).unwrap().unwrap()),
            [Some(json!([[null, 1, null], [-0.5, 2, null]]))]
        );
        let batch = answer(
            r#"[{"meta_info":{"input_token_logprobs":[[null,1,null]]}},{"meta_info":{"input_token_logprobs":[[null,7,null]]}}]"#,
        );
        assert_eq!(
            built(prefill_logprobs(&batch, 2).unwrap().unwrap()),
            [
                Some(json!([[null, 1, null]])),
                Some(json!([[null, 7, null]]))
            ]
        );
        // A stream: the first event of each index counts.
        let stream = answer(concat!(
            "data: {\"index\":1,\"meta_info\":{\"input_token_logprobs\":[[null,9,null]]}}\n\n",
            "data: {\"index\":0,\"meta_info\":{\"input_token_logprobs\":[[null,8,null]]}}\n\n",
            "data: {\"index\":1,\"meta_info\":{\"input_token_logprobs\":[[null,0,null]]}}\n\n",
            "data: [DONE]\n\n"
        ));
        assert_eq!(
            built(prefill_logprobs(&stream, 2).unwrap().unwrap()),
            [
                Some(json!([[null, 8, null]])),
                Some(json!([[null, 9, null]]))
            ]
        );
        assert!(
            prefill_logprobs(&answer(r#"{"text":"x","meta_info":{}}"#), 1)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn sequences_are_prompts_times_samples() {
        let cases = [
            (r#"{"text":"a"}"#, 1),
            (r#"{"text":"a","sampling_params":{"n":3}}"#, 3),
            (r#"{"text":["a","b"],"sampling_params":{"n":2}}"#, 4),
            (
                r#"{"input_ids":[[1],[2],[3]],"sampling_params":[{"n":2},{"n":2},{"n":2}]}"#,
                6,
            ),
            (r#"{"text":["a","b"],"sampling_params":{"n":0}}"#, 2),
            (r#"{"text":["a","b"],"sampling_params":{"n":"x"}}"#, 2),
            (r#"{"text":"a","sampling_params":{"max_new_tokens":3}}"#, 1),
        ];
        for (b, want) in cases {
            assert_eq!(sequences(&body(b)), want, "{b}");
        }
    }

    /// An index or a list longer than the request's sequences fails, and nothing is
    /// allocated for it: SGLang's router resized its list to `index + 1`.
    #[test]
    fn indexes_past_the_requests_sequences_are_refused() {
        let event = |index: &str| {
            answer(&format!(
                "data: {{\"index\":{index},\"meta_info\":{{\"input_token_logprobs\":[[null,1,null]]}}}}\n\ndata: [DONE]\n\n"
            ))
        };
        for (index, sequences) in [
            ("4000000000000", 4),
            ("20000000", 4),
            ("4", 4),
            ("-1", 4),
            ("1.5", 4),
            ("\"1\"", 4),
        ] {
            let err = prefill_logprobs(&event(index), sequences).unwrap_err();
            assert_eq!((err.what, err.found.as_str()), ("index", index), "{index}");
        }
        // Past u64: read as a float, refused all the same.
        let err = prefill_logprobs(&event("18446744073709551616"), 4).unwrap_err();
        assert_eq!(err.what, "index");
        assert_eq!(prefill_logprobs(&event("3"), 4).unwrap().unwrap().len(), 4);
        let list = answer(r#"[{"meta_info":{}},{"meta_info":{}},{"meta_info":{}}]"#);
        let err = prefill_logprobs(&list, 2).unwrap_err();
        assert_eq!((err.what, err.found.as_str()), ("list length", "3"));
        assert!(prefill_logprobs(&list, 3).unwrap().is_none());
    }

    async fn reshape(merge: &LogprobMerge, frames: &[&str]) -> String {
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = frames
            .iter()
            .map(|f| Ok(Frame::data(Bytes::from(f.to_string()))))
            .collect();
        let inner = BoxBody::new(http_body_util::StreamBody::new(futures::stream::iter(
            frames,
        )));
        let out = merge.body(inner).collect().await.unwrap().to_bytes();
        String::from_utf8(out.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn whole_answers_get_the_prefill_logprobs_first() {
        let m = LogprobMerge::new(vec![raw(json!([[null, 1, null]]))], false);
        let out = reshape(
            &m,
            &[r#"{"text":"y","meta_info":{"input_token_logprobs":[[-1.0,2,null]],"id":"a"}}"#],
        )
        .await;
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            v["meta_info"]["input_token_logprobs"],
            json!([[null, 1, null], [-1.0, 2, null]])
        );
        assert_eq!(v["text"], "y");
        // A batch, element by element.
        let m = LogprobMerge::new(
            vec![raw(json!([[null, 1, null]])), raw(json!([[null, 5, null]]))],
            false,
        );
        let out = reshape(
            &m,
            &[r#"[{"meta_info":{"input_token_logprobs":[]}},{"meta_info":{"input_token_logprobs":[]}}]"#],
        )
        .await;
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            v[0]["meta_info"]["input_token_logprobs"],
            json!([[null, 1, null]])
        );
        assert_eq!(
            v[1]["meta_info"]["input_token_logprobs"],
            json!([[null, 5, null]])
        );
        // Not JSON: as it came.
        assert_eq!(reshape(&m, &["oops"]).await, "oops");
    }

    /// The decode's members the merge does not touch are copied as written, never
    /// built: a hostile `"x":[0,0,...]` costs its own size (a `Value` per `0,` was 16
    /// bytes per byte), and JSON no `Value` holds (`1e400`) no longer stops the merge.
    #[tokio::test]
    async fn a_whole_answers_untouched_members_are_copied_as_written() {
        let m = LogprobMerge::new(vec![raw(json!([[null, 1, null]]))], false);
        let zeros = vec!["0"; 1_000_000].join(",");
        let decode = format!(
            r#"{{"x":[{zeros}],"big":1e400,"meta_info":{{"y":[{zeros}],"input_token_logprobs":[[-1.0,2,null]]}}}}"#
        );
        let out = reshape(&m, &[&decode]).await;
        assert!(
            out.len() < decode.len() + 64,
            "{} from {}",
            out.len(),
            decode.len()
        );
        assert!(out.starts_with(&format!(
            r#"{{"x":[{zeros}],"big":1e400,"meta_info":{{"y":[{zeros}],"#
        )));
        assert!(
            out.ends_with(r#""input_token_logprobs":[[null,1,null],[-1.0,2,null]]}}"#),
            "{}",
            &out[out.len() - 80..]
        );
    }

    #[tokio::test]
    async fn streamed_events_are_merged_wherever_the_frames_are_cut() {
        let m = LogprobMerge::new(
            vec![raw(json!([[null, 1, null]])), raw(json!([[null, 2, null]]))],
            true,
        );
        let out = reshape(
            &m,
            &[
                "data: {\"index\":1,\"text\":\"a\",\"meta_info\":{\"input_token_logpro",
                "bs\":[]}}\n\ndata: {\"text\":\"b\",\"meta_info\":{\"input_token_logprobs\":[[-2.0,3,null]]}}\n",
                "\ndata: {\"error\":{\"message\":\"x\"}}\n\ndata: [DONE]\n\n",
            ],
        )
        .await;
        let events: Vec<&str> = out.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(events.len(), 4, "{out}");
        let e0: Value = serde_json::from_str(events[0].strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(
            e0["meta_info"]["input_token_logprobs"],
            json!([[null, 2, null]])
        );
        let e1: Value = serde_json::from_str(events[1].strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(
            e1["meta_info"]["input_token_logprobs"],
            json!([[null, 1, null], [-2.0, 3, null]])
        );
        assert_eq!(events[2], "data: {\"error\":{\"message\":\"x\"}}");
        assert_eq!(events[3], "data: [DONE]");
    }
}
