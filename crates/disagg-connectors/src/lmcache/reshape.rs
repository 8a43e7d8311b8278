//! LMCache's change of form: the decode's completions answer, continuing after the
//! prefill's first token, made into the client's own API's answer (chat or completions,
//! streamed or whole), first token and usage included.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use disagg_core::connector::Reshape;
use disagg_core::error::BoxError;
use disagg_core::transport::{BoxBody, read_limited};
use http_body::Frame;
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

use super::connector::{First, MAX_BODY, Plan};
use crate::common::sse::{EventMap, MapEvents};
use disagg_json::raw::{self as json, Edit};

/// LMCache's change of form ([`Reshape`]): the decode answered a completions request
/// (the legs speak completions whatever the client asked) that continues after the
/// prefill's first token; the client gets its own API's answer, first token included.
#[derive(Debug)]
pub(super) struct Reshaper {
    shape: Arc<Shape>,
    stream: bool,
}

impl Reshape for Reshaper {
    fn body(&self, decode: BoxBody) -> BoxBody {
        let shape = Arc::clone(&self.shape);
        if self.stream {
            BoxBody::new(MapEvents::new(decode, shape))
        } else {
            BoxBody::new(http_body_util::StreamBody::new(futures::stream::once(
                whole_answer(decode, shape),
            )))
        }
    }
}

/// The plan's reshape, when the client's answer differs from the decode's: a chat
/// request, or a first token from the prefill.
pub(super) fn reshaper(plan: &Plan) -> Option<Arc<dyn Reshape>> {
    let shape = Shape::of(plan);
    if !shape.chat && shape.first.is_none() {
        // Nothing to change: the decode answers the client's own request.
        return None;
    }
    Some(Arc::new(Reshaper {
        shape: Arc::new(shape),
        stream: plan.stream,
    }))
}

/// The client's non-streaming answer, from the decode's whole body.
pub(super) async fn whole_answer(
    body: BoxBody,
    shape: Arc<Shape>,
) -> Result<Frame<Bytes>, BoxError> {
    let bytes = read_limited(body, MAX_BODY).await?;
    shape.whole(&bytes).map(Frame::data)
}

/// The first chunk(s) of a streaming answer, from the prefill's first token, as vLLM
/// 0.33 streams them (`vllm/entrypoints/openai/chat_completion/serving.py` and
/// `.../completion/serving.py`): for chat, a role-only chunk (`delta` of
/// `{"role": "assistant", "content": ""}`, with the request's `prompt_token_ids` and
/// `prompt_text`, null), then the token's content; for completions the token with its
/// `stop_reason`. Each token chunk has the fields vLLM sets on it, null where vLLM's are
/// (`token_ids`, `kv_transfer_params`, and on the last one `weight_versions`). When
/// the token ended the answer: its finish and `stop_reason`, the usage asked for and
/// `[DONE]`.
pub(super) fn lead(plan: &Plan) -> Bytes {
    let Some(first) = &plan.first else {
        return Bytes::new();
    };
    let mut out = Vec::with_capacity(512);
    let shape = Shape::of(plan);
    if plan.chat {
        let role = json!({
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": null,
            "finish_reason": null,
        });
        let mut chunk = shape.envelope(vec![role]);
        chunk.insert("prompt_token_ids".into(), Value::Null);
        chunk.insert("prompt_text".into(), Value::Null);
        event(&mut out, &chunk);
    }
    let last = first.finish.is_some();
    let mut choice = Map::new();
    choice.insert("index".into(), json!(0));
    if plan.chat {
        choice.insert("delta".into(), json!({"content": first.text}));
    } else {
        choice.insert("text".into(), json!(first.text));
    }
    choice.insert("logprobs".into(), Value::Null);
    choice.insert("finish_reason".into(), json!(first.finish));
    // vLLM sets `stop_reason` on every completions chunk, on a chat chunk only with
    // its finish.
    if !plan.chat || last {
        choice.insert("stop_reason".into(), first.stop_reason.clone());
    }
    if !plan.chat {
        choice.insert("prompt_token_ids".into(), Value::Null);
    }
    choice.insert("token_ids".into(), Value::Null);
    if !plan.chat || last {
        choice.insert("weight_versions".into(), Value::Null);
    }
    let mut chunk = shape.envelope(vec![Value::Object(choice)]);
    chunk.insert("kv_transfer_params".into(), Value::Null);
    event(&mut out, &chunk);
    if last {
        if plan.include_usage {
            let mut chunk = shape.envelope(Vec::new());
            let own = first.usage.clone();
            chunk.insert(
                "usage".into(),
                own.unwrap_or_else(|| usage(shape.prompt_tokens as u64, 1)),
            );
            event(&mut out, &chunk);
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
    }
    Bytes::from(out)
}

pub(super) fn event(out: &mut Vec<u8>, chunk: &Map<String, Value>) {
    out.extend_from_slice(b"data: ");
    // A map of JSON values always encodes.
    if serde_json::to_writer(&mut *out, chunk).is_err() {
        out.extend_from_slice(b"{}");
    }
    out.extend_from_slice(b"\n\n");
}

pub(super) fn usage(prompt: u64, completion: u64) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt.saturating_add(completion),
    })
}

/// How the decode's answer becomes the client's.
#[derive(Debug)]
pub(super) struct Shape {
    pub(super) chat: bool,
    pub(super) first: Option<First>,
    pub(super) prompt_tokens: usize,
}

impl Shape {
    /// The shape of `plan`'s answer.
    fn of(plan: &Plan) -> Self {
        Shape {
            chat: plan.chat,
            first: plan.first.clone(),
            prompt_tokens: plan.tokens.as_ref().map_or(0, |t| t.len()),
        }
    }

    /// A chunk's envelope: id, object, created, model.
    fn envelope(&self, choices: Vec<Value>) -> Map<String, Value> {
        let mut m = Map::new();
        if let Some(f) = &self.first {
            m.insert("id".into(), json!(self.id(&f.id)));
            m.insert(
                "object".into(),
                json!(if self.chat {
                    "chat.completion.chunk"
                } else {
                    "text_completion"
                }),
            );
            m.insert("created".into(), json!(f.created));
            m.insert("model".into(), json!(f.model));
        }
        m.insert("choices".into(), Value::Array(choices));
        m
    }

    fn id(&self, id: &str) -> String {
        match (self.chat, id.strip_prefix("cmpl-")) {
            (true, Some(rest)) => format!("chatcmpl-{rest}"),
            (true, None) if !id.starts_with("chatcmpl-") => format!("chatcmpl-{id}"),
            _ => id.to_owned(),
        }
    }

    /// Writes `usage` as the client counts it: the prompt once, every generated token
    /// once (the decode saw the first token as part of its prompt); the other members
    /// as the decode wrote them. The decode's count is any u64 it wrote: the sums
    /// saturate rather than panic (debug) or wrap to a small count (release). A usage
    /// that is not an object, or an answer without a first token, keeps its own.
    fn usage(&self, usage: &RawValue, out: &mut Vec<u8>) -> Edit {
        if self.first.is_none() || !json::is_object(usage.get()) {
            return Edit::Keep;
        }
        let generated = json::member_u64(usage.get(), "completion_tokens")
            .unwrap_or(0)
            .saturating_add(1);
        let prompt = self.prompt_tokens as u64;
        let mut u = json::Object::open(out);
        // A valid object: its members always visit.
        let _ = u.copy(usage.get(), |key, _, _| match key {
            "prompt_tokens" | "completion_tokens" | "total_tokens" => Edit::Drop,
            _ => Edit::Keep,
        });
        u.value("prompt_tokens", &prompt);
        u.value("completion_tokens", &generated);
        u.value("total_tokens", &prompt.saturating_add(generated));
        u.close();
        Edit::Wrote
    }

    /// Writes one streamed chunk of the decode (a JSON object) in the client's form.
    fn chunk(&self, obj: &str, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
        let mut o = json::Object::open(out);
        o.copy(obj, |key, value, out| match key {
            "id" if self.first.is_some() => Edit::Drop,
            "object" if self.chat => Edit::Drop,
            "choices" if self.chat && json::is_list(value.get()) => {
                list(value, out, chat_delta);
                Edit::Wrote
            }
            "usage" => self.usage(value, out),
            _ => Edit::Keep,
        })?;
        if let Some(f) = &self.first {
            o.value("id", &self.id(&f.id));
        }
        if self.chat {
            o.value("object", &"chat.completion.chunk");
        }
        o.close();
        Ok(())
    }

    /// The client's whole (non-streaming) answer from the decode's, which is empty when
    /// no decode leg was sent. The decode's members the change of form does not touch
    /// are copied as it wrote them, never built: a 64 MiB answer costs its own size,
    /// not a gigabyte of `Value`s.
    pub(super) fn whole(&self, decode: &[u8]) -> Result<Bytes, BoxError> {
        if decode.is_empty() {
            return self.first_only();
        }
        let text = std::str::from_utf8(decode)?;
        if !json::is_object(text) {
            return Err("the decode's answer is not a JSON object".into());
        }
        let mut out = Vec::with_capacity(decode.len().saturating_add(256));
        let mut too_many = None;
        let mut o = json::Object::open(&mut out);
        o.copy(text, |key, value, out| match key {
            "id" | "created" | "model" if self.first.is_some() => Edit::Drop,
            "object" => Edit::Drop,
            "choices" => self.choices(value, out, &mut too_many),
            "usage" => self.usage(value, out),
            _ => Edit::Keep,
        })?;
        if let Some(n) = too_many {
            return Err(format!(
                "the decode answered {n} choices; the request can have {MAX_CHOICES}"
            )
            .into());
        }
        if let Some(f) = &self.first {
            o.value("id", &self.id(&f.id));
            o.value("created", &f.created);
            o.value("model", &f.model);
        }
        o.value("object", &self.whole_object());
        o.close();
        Ok(Bytes::from(out))
    }

    /// The whole answer when the prefill's first token ended it (no decode leg).
    fn first_only(&self) -> Result<Bytes, BoxError> {
        let first = self
            .first
            .as_ref()
            .ok_or("no decode answer and no first token")?;
        let mut m = Map::new();
        m.insert("id".into(), json!(self.id(&first.id)));
        m.insert("created".into(), json!(first.created));
        m.insert("model".into(), json!(first.model));
        let choice = if self.chat {
            json!({"index": 0, "message": {"role": "assistant", "content": first.text},
                "logprobs": null, "finish_reason": first.finish})
        } else {
            json!({"index": 0, "text": first.text, "logprobs": null, "finish_reason": first.finish})
        };
        m.insert("choices".into(), json!([choice]));
        // The prefill's own usage: the prompt and its one token.
        let own = first.usage.clone();
        m.insert(
            "usage".into(),
            own.unwrap_or_else(|| usage(self.prompt_tokens as u64, 1)),
        );
        m.insert("object".into(), json!(self.whole_object()));
        Ok(Bytes::from(serde_json::to_vec(&m)?))
    }

    fn whole_object(&self) -> &'static str {
        if self.chat {
            "chat.completion"
        } else {
            "text_completion"
        }
    }

    /// Writes the whole answer's `choices` in the client's form: the first token
    /// begins the choice of index 0 (the one choice, unless it names another index).
    /// A list of more than [`MAX_CHOICES`] is counted, its elements unbuilt, and noted
    /// in `too_many` (the answer is refused).
    fn choices(&self, value: &RawValue, out: &mut Vec<u8>, too_many: &mut Option<usize>) -> Edit {
        if !json::is_list(value.get()) {
            return Edit::Keep;
        }
        let mut n = 0usize;
        // A valid list: its elements always visit.
        let _ = json::elements(value.get(), |_| n += 1);
        if n > MAX_CHOICES {
            *too_many = Some(n);
            return Edit::Keep;
        }
        list(value, out, |c, out| self.whole_choice(c, out));
        Edit::Wrote
    }

    /// Writes one choice of a whole answer (a JSON object) in the client's form.
    fn whole_choice(&self, c: &str, out: &mut Vec<u8>) {
        // One walk for both (each the last of its key).
        let [index, own] = json::members_named(c, ["index", "text"]).unwrap_or_default();
        let begins = index.is_none_or(|i| i.get() == "null" || json::u64_of(i) == Some(0));
        let mut text = match &self.first {
            Some(f) if begins => f.text.clone(),
            _ => String::new(),
        };
        // The last `text`, when it is a string.
        if let Some(own) = own.and_then(|t| serde_json::from_str::<String>(t.get()).ok()) {
            text.push_str(&own);
        }
        let mut o = json::Object::open(out);
        // A valid object: its members always visit.
        let _ = o.copy(c, |key, _, _| match key {
            "text" => Edit::Drop,
            "prompt_logprobs" | "message" | "logprobs" if self.chat => Edit::Drop,
            _ => Edit::Keep,
        });
        if self.chat {
            o.value("message", &json!({"role": "assistant", "content": text}));
            o.raw("logprobs", b"null");
        } else {
            o.value("text", &text);
        }
        o.close();
    }
}

/// Writes the JSON list `value` with each object element as `choice` writes it, other
/// elements as they came.
fn list(value: &RawValue, out: &mut Vec<u8>, mut choice: impl FnMut(&str, &mut Vec<u8>)) {
    out.push(b'[');
    let mut first = true;
    // A valid list: its elements always visit.
    let _ = json::elements(value.get(), |c| {
        if !first {
            out.push(b',');
        }
        first = false;
        if json::is_object(c.get()) {
            choice(c.get(), out);
        } else {
            out.extend_from_slice(c.get().as_bytes());
        }
    });
    out.push(b']');
}

/// Writes one choice of a streamed completions chunk (a JSON object) as a chat
/// chunk's: its `text` becomes `delta.content`; the fields of a completions choice that
/// a chat choice lacks go: `prompt_logprobs`, the prompt's ids, and before the finish
/// `stop_reason` and `weight_versions` (vLLM sets those on a chat chunk only with its
/// finish).
fn chat_delta(c: &str, out: &mut Vec<u8>) {
    let [text, finish] = json::members_named(c, ["text", "finish_reason"]).unwrap_or_default();
    let finished = finish.is_some_and(|f| f.get() != "null");
    let mut o = json::Object::open(out);
    // A valid object: its members always visit.
    let _ = o.copy(c, |key, _, _| match key {
        "text" | "prompt_logprobs" | "prompt_token_ids" | "delta" | "logprobs" => Edit::Drop,
        "stop_reason" | "weight_versions" if !finished => Edit::Drop,
        _ => Edit::Keep,
    });
    let delta = o.key("delta");
    delta.extend_from_slice(b"{\"content\":");
    delta.extend_from_slice(text.map_or("null", RawValue::get).as_bytes());
    delta.push(b'}');
    o.raw("logprobs", b"null");
    o.close();
}

/// The most choices a decode may answer: the connector refuses a request for more
/// than one (`n`, `best_of`), so a decode's answer has exactly one.
const MAX_CHOICES: usize = 1;

impl EventMap for Shape {
    /// One SSE event (without its blank-line terminator), in the client's form; an
    /// event's members the change of form does not touch are copied, never built.
    fn event(&self, ev: &[u8], out: &mut BytesMut) {
        let data = ev
            .strip_prefix(b"data: ")
            .or_else(|| ev.strip_prefix(b"data:"))
            .filter(|d| d.first() == Some(&b'{'))
            .and_then(|d| std::str::from_utf8(d).ok())
            .filter(|d| json::member(d, "error").is_none());
        if let Some(data) = data {
            let mut v = Vec::with_capacity(ev.len() + 64);
            v.extend_from_slice(b"data: ");
            if self.chunk(data, &mut v).is_ok() {
                v.extend_from_slice(b"\n\n");
                out.extend_from_slice(&v);
                return;
            }
        }
        // Error events, `[DONE]`, comments, anything else: as it came.
        out.extend_from_slice(ev);
        out.extend_from_slice(b"\n\n");
    }
}
