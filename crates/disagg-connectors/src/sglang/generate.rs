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
use serde_json::Value;
use serde_json::value::RawValue;

use crate::common::sse::{EventMap, MapEvents, event_end};
use disagg_core::connector::{PrefillAnswer, Reshape};
use disagg_core::error::BoxError;
use disagg_core::transport::{BoxBody, read_limited};
use disagg_json::JsonBody;

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
    let ids = body.get("input_ids")?;
    // A flat list of token ids is one prompt; a list of lists is a batch.
    let items: Vec<&RawValue> = serde_json::from_slice(ids).ok()?;
    let first = items.first()?.get().as_bytes().first().copied();
    (first == Some(b'[')).then_some(items.len())
}

/// The length of `raw` when it is a non-empty JSON list.
fn list_len(raw: &[u8]) -> Option<usize> {
    if raw.first() != Some(&b'[') {
        return None;
    }
    let items: Vec<&RawValue> = serde_json::from_slice(raw).ok()?;
    (!items.is_empty()).then_some(items.len())
}

/// Whether the request asks for logprobs: `return_logprob` true (read as pydantic's lax
/// `bool`), or a per-element list holding a true.
pub(crate) fn wants_logprobs(body: &JsonBody) -> bool {
    let Some(raw) = body.get("return_logprob") else {
        return false;
    };
    if raw.first() == Some(&b'[') {
        let items: Vec<&RawValue> = serde_json::from_slice(raw).unwrap_or_default();
        return items
            .iter()
            .any(|v| disagg_json::lax::bool_value(v.get().as_bytes()) == Ok(Some(true)));
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

/// `sampling_params.n` of a `/generate` request (1 when absent, or not a positive
/// integer the engine would take).
pub(crate) fn samples(body: &JsonBody) -> usize {
    #[derive(serde::Deserialize)]
    struct Sampling {
        #[serde(default)]
        n: Option<u64>,
    }
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Params {
        One(Sampling),
        PerPrompt(Vec<Sampling>),
    }
    let Some(raw) = body.get("sampling_params") else {
        return 1;
    };
    let n = match serde_json::from_slice::<Params>(raw) {
        Ok(Params::One(s)) => s.n,
        Ok(Params::PerPrompt(list)) => list.first().and_then(|s| s.n),
        Err(_) => None,
    };
    n.and_then(|n| usize::try_from(n).ok())
        .filter(|n| *n > 0)
        .unwrap_or(1)
}

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
/// each `index`). `None` when the answer carries none.
///
/// # Errors
///
/// [`OutOfRange`] when the answer names an element the request does not have (an
/// `index` not below `sequences`, or not a non-negative integer; a list of more than
/// `sequences` answers): nothing is allocated for it.
pub(crate) fn prefill_logprobs(
    answer: &PrefillAnswer,
    sequences: usize,
) -> Result<Option<Vec<Option<Value>>>, OutOfRange> {
    let mut out: Vec<Option<Value>> = Vec::new();
    let mut put = |index: usize, v: Option<Value>| {
        if out.len() <= index {
            out.resize(index + 1, None);
        }
        if out[index].is_none() {
            out[index] = v;
        }
    };
    match serde_json::from_slice::<Value>(&answer.body) {
        Ok(Value::Object(o)) => put(0, input_logprobs(&o)),
        Ok(Value::Array(items)) => {
            if items.len() > sequences {
                return Err(OutOfRange {
                    what: "list length",
                    found: items.len().to_string(),
                    sequences,
                });
            }
            for (i, item) in items.iter().enumerate() {
                if let Value::Object(o) = item {
                    put(i, input_logprobs(o));
                }
            }
        }
        Ok(_) => return Ok(None),
        // Not one JSON value: a stream of events.
        Err(_) => {
            let mut rest = &answer.body[..];
            while let Some((end, next)) = event_end(rest) {
                if let Some(Value::Object(o)) = data_json(&rest[..end]) {
                    put(checked_index(&o, sequences)?, input_logprobs(&o));
                }
                rest = &rest[next..];
            }
        }
    }
    Ok(out.iter().any(Option::is_some).then_some(out))
}

/// The element an event of an engine answers: its `index` (0 without one), which must
/// be a non-negative integer below `sequences`.
fn checked_index(
    o: &serde_json::Map<String, Value>,
    sequences: usize,
) -> Result<usize, OutOfRange> {
    let Some(raw) = o.get("index") else {
        return Ok(0);
    };
    raw.as_u64()
        .and_then(|i| usize::try_from(i).ok())
        .filter(|i| *i < sequences)
        .ok_or_else(|| OutOfRange {
            what: "index",
            found: raw.to_string(),
            sequences,
        })
}

/// `meta_info.input_token_logprobs` of one answer object, when it is a list.
fn input_logprobs(o: &serde_json::Map<String, Value>) -> Option<Value> {
    o.get("meta_info")?
        .get("input_token_logprobs")
        .filter(|v| v.is_array())
        .cloned()
}

/// The element a decode's event answers: its `index`, 0 without one. Unchecked: it
/// only looks up the prefill's logprobs, and an index the request does not have finds
/// none (the event passes unmerged).
fn index_of(o: &serde_json::Map<String, Value>) -> usize {
    o.get("index")
        .and_then(Value::as_u64)
        .and_then(|i| usize::try_from(i).ok())
        .unwrap_or(0)
}

/// Prepend the prefill's logprobs of the element `index` to the answer object's own.
fn merge_into(o: &mut serde_json::Map<String, Value>, prefill: &[Option<Value>], index: usize) {
    let Some(Some(Value::Array(head))) = prefill.get(index) else {
        return;
    };
    let Some(Value::Array(own)) = o
        .get_mut("meta_info")
        .and_then(|m| m.get_mut("input_token_logprobs"))
    else {
        return;
    };
    let mut merged = Vec::with_capacity(head.len() + own.len());
    merged.extend(head.iter().cloned());
    merged.append(own);
    *own = merged;
}

/// The change of form of a `/generate` answer with logprobs: the prefill's prompt
/// logprobs prepended to the decode's, element by element.
#[derive(Debug)]
pub(crate) struct LogprobMerge {
    prefill: Arc<[Option<Value>]>,
    stream: bool,
}

impl LogprobMerge {
    /// A merge of `prefill`'s logprobs into a streamed (`stream`) or whole answer.
    pub(crate) fn new(prefill: Vec<Option<Value>>, stream: bool) -> Self {
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

/// The whole decode answer, merged; passed as it came when it is not JSON (as SGLang's
/// routers do).
async fn whole(decode: BoxBody, prefill: Arc<[Option<Value>]>) -> Result<Frame<Bytes>, BoxError> {
    let bytes = read_limited(decode, MAX_MERGED_ANSWER).await?;
    let merged = match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(mut o)) => {
            merge_into(&mut o, &prefill, 0);
            serde_json::to_vec(&o).ok()
        }
        Ok(Value::Array(mut items)) => {
            for (i, item) in items.iter_mut().enumerate() {
                if let Value::Object(o) = item {
                    merge_into(o, &prefill, i);
                }
            }
            serde_json::to_vec(&items).ok()
        }
        _ => None,
    };
    Ok(Frame::data(merged.map_or(bytes, Bytes::from)))
}

/// The decode's event stream with each `data:` event merged; only an unfinished event is
/// held back, each frame's complete events go out with it.
struct MergeEvents {
    prefill: Arc<[Option<Value>]>,
}

impl EventMap for MergeEvents {
    fn event(&self, ev: &[u8], out: &mut BytesMut) {
        match data_json(ev) {
            Some(Value::Object(mut o)) if !o.contains_key("error") => {
                let index = index_of(&o);
                merge_into(&mut o, &self.prefill, index);
                out.extend_from_slice(b"data: ");
                match serde_json::to_vec(&o) {
                    Ok(v) => out.extend_from_slice(&v),
                    Err(_) => out.extend_from_slice(b"{}"),
                }
                out.extend_from_slice(b"\n\n");
            }
            // `[DONE]`, error events, comments: as they came.
            _ => {
                out.extend_from_slice(ev);
                out.extend_from_slice(b"\n\n");
            }
        }
    }
}

/// The JSON of a `data:` event, if it is one.
fn data_json(ev: &[u8]) -> Option<Value> {
    let data = ev
        .strip_prefix(b"data: ")
        .or_else(|| ev.strip_prefix(b"data:"))?;
    let data = data.trim_ascii();
    if data.first() != Some(&b'{') {
        return None;
    }
    serde_json::from_slice(data).ok()
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;
    use serde_json::json;

    use super::*;

    fn body(s: &str) -> JsonBody {
        JsonBody::parse(s.as_bytes()).unwrap()
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
            prefill_logprobs(&one, 1).unwrap().unwrap(),
            [Some(json!([[null, 1, null], [-0.5, 2, null]]))]
        );
        let batch = answer(
            r#"[{"meta_info":{"input_token_logprobs":[[null,1,null]]}},{"meta_info":{"input_token_logprobs":[[null,7,null]]}}]"#,
        );
        assert_eq!(
            prefill_logprobs(&batch, 2).unwrap().unwrap(),
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
            prefill_logprobs(&stream, 2).unwrap().unwrap(),
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
        let m = LogprobMerge::new(vec![Some(json!([[null, 1, null]]))], false);
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
            vec![
                Some(json!([[null, 1, null]])),
                Some(json!([[null, 5, null]])),
            ],
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

    #[tokio::test]
    async fn streamed_events_are_merged_wherever_the_frames_are_cut() {
        let m = LogprobMerge::new(
            vec![
                Some(json!([[null, 1, null]])),
                Some(json!([[null, 2, null]])),
            ],
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
