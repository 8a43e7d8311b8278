//! LMCache's change of form: the decode's completions answer, continuing after the
//! prefill's first token, made into the client's own API's answer (chat or completions,
//! streamed or whole), first token and usage included.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use disagg_core::connector::Reshape;
use disagg_core::error::BoxError;
use disagg_core::transport::{BoxBody, read_limited};
use http_body::Frame;
use serde_json::{Map, Value, json};

use super::connector::{First, MAX_BODY, Plan};
use crate::common::sse::{EventMap, MapEvents};

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

    /// Usage as the client counts it: the prompt once, every generated token once (the
    /// decode saw the first token as part of its prompt). Other usage fields stay. The
    /// decode's count is any u64 it wrote: the sums saturate rather than panic (debug)
    /// or wrap to a small count (release).
    fn fix_usage(&self, obj: &mut Map<String, Value>) {
        let Some(Value::Object(u)) = obj.get_mut("usage") else {
            return;
        };
        if self.first.is_none() {
            return;
        }
        let generated = u
            .get("completion_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0)
            .saturating_add(1);
        let prompt = self.prompt_tokens as u64;
        u.insert("prompt_tokens".into(), json!(prompt));
        u.insert("completion_tokens".into(), json!(generated));
        u.insert(
            "total_tokens".into(),
            json!(prompt.saturating_add(generated)),
        );
    }

    /// One streamed chunk of the decode, in the client's form.
    fn chunk(&self, mut obj: Map<String, Value>) -> Map<String, Value> {
        if let Some(f) = &self.first {
            obj.insert("id".into(), json!(self.id(&f.id)));
        }
        if self.chat {
            obj.insert("object".into(), json!("chat.completion.chunk"));
            if let Some(Value::Array(choices)) = obj.get_mut("choices") {
                for c in choices.iter_mut() {
                    if let Value::Object(c) = c {
                        let text = c.remove("text").unwrap_or(Value::Null);
                        c.remove("prompt_logprobs");
                        // Fields of a completions choice that a chat choice lacks:
                        // the prompt's ids, and before the finish `stop_reason` and
                        // `weight_versions` (vLLM sets those on a chat chunk only
                        // with its finish).
                        c.remove("prompt_token_ids");
                        if c.get("finish_reason").is_none_or(Value::is_null) {
                            c.remove("stop_reason");
                            c.remove("weight_versions");
                        }
                        c.insert("delta".into(), json!({ "content": text }));
                        c.insert("logprobs".into(), Value::Null);
                    }
                }
            }
        }
        self.fix_usage(&mut obj);
        obj
    }

    /// The client's whole (non-streaming) answer from the decode's, which is empty when
    /// no decode leg was sent.
    pub(super) fn whole(&self, decode: &[u8]) -> Result<Bytes, BoxError> {
        let (mut obj, from_decode) = if decode.is_empty() {
            let first = self
                .first
                .as_ref()
                .ok_or("no decode answer and no first token")?;
            let mut m = Map::new();
            m.insert(
                "choices".into(),
                json!([{"index": 0, "text": "", "logprobs": null, "finish_reason": first.finish}]),
            );
            // The prefill's own usage: the prompt and its one token.
            let own = first.usage.clone();
            m.insert(
                "usage".into(),
                own.unwrap_or_else(|| usage(self.prompt_tokens as u64, 1)),
            );
            (m, false)
        } else {
            (decode_answer(decode)?, true)
        };
        if let Some(f) = &self.first {
            obj.insert("id".into(), json!(self.id(&f.id)));
            obj.insert("created".into(), json!(f.created));
            obj.insert("model".into(), json!(f.model));
        }
        if let Some(Value::Array(choices)) = obj.get_mut("choices") {
            // The prefill's first token begins the choice of index 0 only: the first one
            // naming index 0, or the first one when none names an index.
            let first_at = choices
                .iter()
                .position(|c| c.get("index").and_then(Value::as_u64) == Some(0))
                .or_else(|| {
                    let indexed = |c: &Value| c.get("index").is_some_and(|i| !i.is_null());
                    (!choices.iter().any(indexed)).then_some(0)
                });
            for (i, c) in choices.iter_mut().enumerate() {
                let Value::Object(c) = c else { continue };
                let mut text = match &self.first {
                    Some(f) if first_at == Some(i) => f.text.clone(),
                    _ => String::new(),
                };
                if let Some(Value::String(t)) = c.remove("text") {
                    text.push_str(&t);
                }
                if self.chat {
                    c.remove("prompt_logprobs");
                    c.insert(
                        "message".into(),
                        json!({"role": "assistant", "content": text}),
                    );
                    c.insert("logprobs".into(), Value::Null);
                } else {
                    c.insert("text".into(), json!(text));
                }
            }
        }
        obj.insert(
            "object".into(),
            json!(if self.chat {
                "chat.completion"
            } else {
                "text_completion"
            }),
        );
        if from_decode {
            self.fix_usage(&mut obj);
        }
        Ok(Bytes::from(serde_json::to_vec(&obj)?))
    }
}

/// The most choices a decode may answer: the connector refuses a request for more
/// than one (`n`, `best_of`), so a decode's answer has exactly one.
const MAX_CHOICES: usize = 1;

/// The decode's whole answer as an object, refused (naming the count) when it has
/// more than [`MAX_CHOICES`] choices. The choices are counted on the raw text before
/// any is built: a 64 MiB answer of `{}` choices would be 21 million maps (and as many
/// reshaped ones) that a refusal must not pay for.
fn decode_answer(bytes: &[u8]) -> Result<Map<String, Value>, BoxError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let answer = match serde::de::Deserializer::deserialize_map(&mut de, AnswerVisitor) {
        Ok(a) => a,
        // The only data error the visitor's input can raise: the top level is not a map.
        Err(e) if e.classify() == serde_json::error::Category::Data => {
            return Err("the decode's answer is not a JSON object".into());
        }
        Err(e) => return Err(e.into()),
    };
    de.end()?;
    match answer {
        Answer::Object(m) => Ok(m),
        Answer::TooManyChoices(n) => Err(format!(
            "the decode answered {n} choices; the request can have {MAX_CHOICES}"
        )
        .into()),
        Answer::Choices(e) => Err(format!("the decode's choices do not parse: {e}").into()),
    }
}

enum Answer {
    Object(Map<String, Value>),
    TooManyChoices(usize),
    /// The `choices` list is JSON the answer's value cannot hold (a number past `f64`,
    /// nesting past serde's limit): said as such, not as "not a JSON object".
    Choices(serde_json::Error),
}

/// Reads an object as [`Value`] would (a repeated key: the last wins), except that a
/// `choices` list is counted, its elements unbuilt, before it is read.
struct AnswerVisitor;

impl<'de> serde::de::Visitor<'de> for AnswerVisitor {
    type Value = Answer;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Answer, A::Error> {
        use serde::de::IgnoredAny;
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if key != "choices" {
                let value = map.next_value::<Value>()?;
                out.insert(key, value);
                continue;
            }
            let raw = map.next_value::<&serde_json::value::RawValue>()?;
            // A list of zero-sized elements allocates nothing: a count for a scan.
            let count = serde_json::from_str::<Vec<IgnoredAny>>(raw.get()).map(|v| v.len());
            if let Ok(n) = count
                && n > MAX_CHOICES
            {
                // The rest is read (unbuilt) for the parser to see the object's end.
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                return Ok(Answer::TooManyChoices(n));
            }
            let value = match serde_json::from_str::<Value>(raw.get()) {
                Ok(v) => v,
                Err(e) => {
                    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                    return Ok(Answer::Choices(e));
                }
            };
            out.insert(key, value);
        }
        Ok(Answer::Object(out))
    }
}

impl EventMap for Shape {
    /// One SSE event (without its blank-line terminator), in the client's form.
    fn event(&self, ev: &[u8], out: &mut BytesMut) {
        let data = ev
            .strip_prefix(b"data: ")
            .or_else(|| ev.strip_prefix(b"data:"));
        let parsed = data
            .filter(|d| d.first() == Some(&b'{'))
            .and_then(|d| serde_json::from_slice::<Map<String, Value>>(d).ok());
        match parsed {
            Some(obj) if !obj.contains_key("error") => {
                let mut v = Vec::with_capacity(ev.len() + 64);
                event(&mut v, &self.chunk(obj));
                out.extend_from_slice(&v);
            }
            // Error events, `[DONE]`, comments, anything else: as it came.
            _ => {
                out.extend_from_slice(ev);
                out.extend_from_slice(b"\n\n");
            }
        }
    }
}
