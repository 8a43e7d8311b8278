//! The engine's routes beyond generation: its model list, the tokenizer routes, its
//! version, embeddings, the Responses API and the LoRA admin routes, each as vLLM 0.33
//! answers it (`vllm/entrypoints/openai/models`, `serve/tokenize`,
//! `serve/instrumentator/basic.py`, `pooling/embed`, `openai/responses`,
//! `serve/lora`).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use bytes::Bytes;
use http::StatusCode;
use serde_json::{Map, Value, json};

use crate::SimConfig;
use crate::api::{ApiError, chat_prompt, check_model};
use crate::generate::{Fnv, Generation, ids_hash, mix, word_id};
use crate::{lax, tokenize};

/// What `GET /version` answers: the vLLM release the simulator follows.
pub(crate) const VERSION: &str = "0.33.0";

/// Dimensions of the simulated embeddings.
pub(crate) const EMBEDDING_DIM: usize = 8;

/// Words the engine can turn back into text (`/detokenize`) at most: its generation
/// vocabulary and the words it tokenized since it started, up to this many, so that
/// the map stays bounded whatever clients send.
const MAX_KNOWN_WORDS: usize = 1 << 16;

/// The words behind token ids, learned from `/tokenize` (a hash cannot be inverted).
#[derive(Debug, Default)]
pub(crate) struct Vocab(Mutex<HashMap<u32, Box<str>>>);

impl Vocab {
    /// A vocabulary that knows the generation's own words.
    pub(crate) fn new() -> Self {
        let v = Vocab::default();
        for w in crate::generate::vocab_words() {
            v.learn(w);
        }
        v
    }

    /// Remember the words of `text`.
    pub(crate) fn learn(&self, text: &str) {
        let mut map = lock(&self.0);
        for w in text.split_whitespace() {
            if map.len() >= MAX_KNOWN_WORDS {
                return;
            }
            map.entry(word_id(w)).or_insert_with(|| w.into());
        }
    }

    /// The text of `ids`: known words joined by spaces; an id never seen as
    /// `<|id|>`.
    fn text(&self, ids: &[u32]) -> String {
        let map = lock(&self.0);
        let words: Vec<String> = ids
            .iter()
            .map(|id| {
                map.get(id)
                    .map_or_else(|| format!("<|{id}|>"), |w| w.to_string())
            })
            .collect();
        words.join(" ")
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The LoRA adapters an engine has loaded: `(name, path)`, in load order.
#[derive(Debug, Default)]
pub(crate) struct Loras(Mutex<Vec<(String, String)>>);

impl Loras {
    /// Whether an adapter of this name is loaded.
    pub(crate) fn contains(&self, name: &str) -> bool {
        lock(&self.0).iter().any(|(n, _)| n == name)
    }

    pub(crate) fn names(&self) -> Vec<String> {
        lock(&self.0).iter().map(|(n, _)| n.clone()).collect()
    }
}

/// vLLM's `ModelPermission`, as each model card carries it.
fn permission(created: u64) -> Value {
    json!({
        "id": format!("modelperm-{:032x}", uuid::Uuid::new_v4().as_u128()),
        "object": "model_permission",
        "created": created,
        "allow_create_engine": false,
        "allow_sampling": true,
        "allow_logprobs": true,
        "allow_search_indices": false,
        "allow_view": true,
        "allow_fine_tuning": false,
        "organization": "*",
        "group": null,
        "is_blocking": false,
    })
}

/// `GET /v1/models`: the base model, then every LoRA adapter loaded (vLLM's
/// `OpenAIServingModels.show_available_models`).
pub(crate) fn models(config: &SimConfig, loras: &Loras, created: u64) -> Value {
    let mut data = vec![json!({
        "id": config.model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": config.model,
        "parent": null,
        "max_model_len": config.max_model_len,
        "permission": [permission(created)],
    })];
    for (name, path) in lock(&loras.0).iter() {
        data.push(json!({
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": path,
            "parent": config.model,
            "max_model_len": null,
            "permission": [permission(created)],
        }));
    }
    json!({"object": "list", "data": data})
}

fn object(body: &Value) -> Result<&Map<String, Value>, ApiError> {
    body.as_object().ok_or_else(|| {
        ApiError::bad_request("Input should be a valid dictionary or object to extract fields from")
    })
}

/// `POST /detokenize` `{"model"?, "tokens": [ids]}`: `{"prompt": text}`.
pub(crate) fn detokenize(
    body: &Value,
    config: &SimConfig,
    loras: &Loras,
    vocab: &Vocab,
) -> Result<Value, ApiError> {
    let obj = object(body)?;
    check_model(obj, config, loras)?;
    let ids = lax::opt_int_list(obj, "tokens")?
        .ok_or_else(|| ApiError::bad_request("tokens: Field required"))?;
    let ids = ids
        .into_iter()
        .map(|i| {
            u32::try_from(i)
                .ok()
                .filter(|i| *i < crate::VOCAB_SIZE)
                .ok_or_else(|| ApiError::bad_request(format!("Token id {i} is out of vocabulary")))
        })
        .collect::<Result<Vec<u32>, _>>()?;
    Ok(json!({"prompt": vocab.text(&ids)}))
}

/// A deterministic unit vector for a prompt's token ids.
pub(crate) fn embedding(ids: &[u32]) -> Vec<f32> {
    let seed = ids_hash(ids);
    let raw: Vec<f64> = (0..EMBEDDING_DIM as u64)
        .map(|i| (mix(seed ^ mix(i)) % 2001) as f64 / 1000.0 - 1.0)
        .collect();
    let norm = raw
        .iter()
        .map(|x| x * x)
        .sum::<f64>()
        .sqrt()
        .max(f64::EPSILON);
    raw.iter().map(|x| (x / norm) as f32).collect()
}

/// Standard base64 (RFC 4648, padded), for `encoding_format: "base64"`.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> shift) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// `POST /v1/embeddings`: one deterministic vector per input (a string, a list of
/// strings, token ids, or a list of token-id lists), as vLLM's `EmbeddingResponse`.
pub(crate) fn embeddings(
    body: &Value,
    config: &SimConfig,
    loras: &Loras,
    request_id: &str,
    created: u64,
) -> Result<Value, ApiError> {
    let obj = object(body)?;
    let adapter = check_model(obj, config, loras)?;
    let inputs = crate::api::completion_prompts(obj.get("input"))
        .map_err(|_| ApiError::bad_request("input: should be a string, a list of strings, a list of token ids or a list of lists of token ids"))?;
    if obj.get("dimensions").is_some_and(|d| !d.is_null()) {
        return Err(ApiError::bad_request(
            "Model \"sim-model\" does not support matryoshka representation, changing output dimensions will lead to poor results.",
        ));
    }
    let base64_format = match lax::field(obj, "encoding_format") {
        None => false,
        Some(Value::String(f)) if f == "float" => false,
        Some(Value::String(f)) if f == "base64" => true,
        Some(_) => {
            return Err(ApiError::bad_request(
                "encoding_format: Input should be 'float' or 'base64'",
            ));
        }
    };
    let prompt_tokens: usize = inputs.iter().map(Vec::len).sum();
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, ids)| {
            let v = embedding(ids);
            let embedding = if base64_format {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64(&bytes))
            } else {
                json!(v)
            };
            json!({"index": index, "object": "embedding", "embedding": embedding})
        })
        .collect();
    Ok(json!({
        "id": format!("embd-{request_id}"),
        "object": "list",
        "created": created,
        "model": adapter.as_deref().unwrap_or(&config.model),
        "data": data,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": null,
        },
    }))
}

/// A Responses API request, read.
#[derive(Debug)]
pub(crate) struct ResponsesRequest {
    pub(crate) prompt: Vec<u32>,
    pub(crate) stream: bool,
    instructions: Value,
    pub(crate) max_output_tokens: Option<u32>,
    /// When the request was read (Unix seconds): every response object of its answer
    /// says it as `created_at`, as vLLM's one `created_time` of the request.
    pub(crate) created: u64,
}

/// Reads a `POST /v1/responses` body: `input` (a string, or messages whose `content`
/// is a string or `input_text` parts), `instructions`, `max_output_tokens`, `stream`.
pub(crate) fn responses_request(
    body: &Value,
    config: &SimConfig,
    loras: &Loras,
) -> Result<ResponsesRequest, ApiError> {
    let obj = object(body)?;
    check_model(obj, config, loras)?;
    let mut text = String::new();
    if let Some(Value::String(i)) = obj.get("instructions") {
        text.push_str(i);
        text.push('\n');
    }
    match obj.get("input") {
        Some(Value::String(s)) => text.push_str(s),
        Some(Value::Array(items)) => {
            let messages: Vec<Value> = items
                .iter()
                .map(|m| {
                    let content = match m.get("content") {
                        Some(Value::Array(parts)) => Value::String(
                            parts
                                .iter()
                                .filter_map(|p| p.get("text").and_then(Value::as_str))
                                .collect::<Vec<_>>()
                                .join(" "),
                        ),
                        Some(c) => c.clone(),
                        None => Value::Null,
                    };
                    json!({"role": m.get("role").cloned().unwrap_or(Value::Null), "content": content})
                })
                .collect();
            text.push_str(&chat_prompt(Some(&Value::Array(messages)))?);
        }
        _ => return Err(ApiError::bad_request("input: Field required")),
    }
    let prompt = tokenize(&text);
    if prompt.is_empty() {
        return Err(ApiError::bad_request("The decoder prompt cannot be empty"));
    }
    let max_output_tokens = match lax::opt_int(obj, "max_output_tokens")? {
        Some(m) if m < 1 => {
            return Err(ApiError::bad_request(format!(
                "max_output_tokens must be at least 1, got {m}."
            )));
        }
        m => m.map(|m| u32::try_from(m).unwrap_or(u32::MAX)),
    };
    Ok(ResponsesRequest {
        prompt,
        stream: lax::opt_bool(obj, "stream")?.unwrap_or(false),
        instructions: obj.get("instructions").cloned().unwrap_or(Value::Null),
        max_output_tokens,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    })
}

/// The answer of one Responses API request.
#[derive(Debug)]
pub(crate) struct Responses<'a> {
    request: &'a ResponsesRequest,
    id: String,
    item_id: String,
    model: &'a str,
    created: u64,
    generation: Generation,
    max_tokens: u32,
    /// The decode's own `kv_transfer_params`, in the final response
    /// ([`SimConfig::decode_handoff`]).
    handoff: Option<Value>,
}

impl<'a> Responses<'a> {
    /// The same answer, its final response carrying `handoff` as `kv_transfer_params`.
    pub(crate) fn with_handoff(mut self, handoff: Option<Value>) -> Self {
        self.handoff = handoff;
        self
    }

    /// The answer to `request` made of `generation` (a P/D leg's, by the engine's KV
    /// protocols) with `max_tokens` as its limit.
    pub(crate) fn of(
        request: &'a ResponsesRequest,
        model: &'a str,
        request_id: &str,
        created: u64,
        generation: Generation,
        max_tokens: u32,
    ) -> Self {
        let item = Fnv::new().bytes(request_id.as_bytes()).finish();
        Responses {
            request,
            id: format!("resp_{request_id}"),
            item_id: format!("msg_{item:016x}"),
            model,
            created,
            generation,
            max_tokens,
            handoff: None,
        }
    }

    fn text_part(text: &str) -> Value {
        json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
    }

    fn message(&self, status: &str, content: Vec<Value>) -> Value {
        json!({
            "id": self.item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        })
    }

    /// The response object: `in_progress` with no output, or the final one.
    fn response(&self, done: bool) -> Value {
        let incomplete = done && self.generation.finish == crate::generate::Finish::Length;
        let (status, output, usage) = if done {
            let input = self.request.prompt.len();
            let output = self.generation.ids.len();
            (
                if incomplete {
                    "incomplete"
                } else {
                    "completed"
                },
                vec![self.message("completed", vec![Self::text_part(&self.generation.text())])],
                json!({
                    "input_tokens": input,
                    "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens": output,
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": input + output,
                }),
            )
        } else {
            ("in_progress", Vec::new(), Value::Null)
        };
        let mut response = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "incomplete_details": if incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null },
            "instructions": self.request.instructions,
            "metadata": null,
            "output": output,
            "parallel_tool_calls": true,
            "temperature": 1.0,
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "background": false,
            "max_output_tokens": self.max_tokens,
            "previous_response_id": null,
            "reasoning": null,
            "service_tier": "auto",
            "status_detail": null,
            "text": {"format": {"type": "text"}},
            "top_logprobs": null,
            "truncation": "disabled",
            "usage": usage,
            "user": null,
        });
        if let (true, Some(handoff)) = (done, &self.handoff) {
            response["kv_transfer_params"] = handoff.clone();
        }
        response
    }

    /// The whole (non-streaming) answer.
    pub(crate) fn whole(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(&self.response(true))
    }

    /// The events vLLM's `responses_stream_generator` yields before the engine's first
    /// output: `response.created` and `response.in_progress`, the response in progress.
    fn opening_list(&self) -> Vec<Value> {
        vec![
            json!({"type": "response.created", "response": self.response(false)}),
            json!({"type": "response.in_progress", "response": self.response(false)}),
        ]
    }

    /// The stream's opening events ([`Self::events`]' first two), as written.
    pub(crate) fn opening(&self) -> Result<VecDeque<Bytes>, serde_json::Error> {
        render_events(self.opening_list())
    }

    /// The streamed answer, the event sequence vLLM emits for a plain text answer
    /// (`serving.py` `responses_stream_generator`, `streaming_events.py`): `event:
    /// TYPE` then `data: {...}`, numbered by `sequence_number`.
    pub(crate) fn events(&self) -> Result<VecDeque<Bytes>, serde_json::Error> {
        let item = &self.item_id;
        let mut list = self.opening_list();
        list.extend([
            json!({"type": "response.output_item.added", "output_index": 0, "item": self.message("in_progress", Vec::new())}),
            json!({"type": "response.content_part.added", "output_index": 0, "item_id": item, "content_index": 0, "part": Self::text_part("")}),
        ]);
        for step in &self.generation.steps {
            list.push(json!({"type": "response.output_text.delta", "content_index": 0, "output_index": 0, "item_id": item, "delta": step, "logprobs": []}));
        }
        let text = self.generation.text();
        let part = json!({"type": "output_text", "text": text, "annotations": []});
        list.push(json!({"type": "response.output_text.done", "output_index": 0, "content_index": 0, "text": text, "logprobs": [], "item_id": item}));
        list.push(json!({"type": "response.content_part.done", "item_id": item, "output_index": 0, "content_index": 0, "part": part}));
        list.push(json!({"type": "response.output_item.done", "output_index": 0, "item": self.message("completed", vec![part])}));
        let done = self.response(true);
        let last = if done["status"] == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        list.push(json!({"type": last, "response": done}));
        render_events(list)
    }
}

/// A Responses stream's events as written: each numbered by its place
/// (`sequence_number`), `event: TYPE` then `data: {...}`.
fn render_events(list: Vec<Value>) -> Result<VecDeque<Bytes>, serde_json::Error> {
    let mut out = VecDeque::with_capacity(list.len());
    for (seq, mut ev) in list.into_iter().enumerate() {
        ev["sequence_number"] = json!(seq);
        let kind = ev["type"].as_str().unwrap_or("unknown").to_owned();
        let mut bytes = format!("event: {kind}\ndata: ").into_bytes();
        serde_json::to_writer(&mut bytes, &ev)?;
        bytes.extend_from_slice(b"\n\n");
        out.push_back(Bytes::from(bytes));
    }
    Ok(out)
}

/// What a LoRA admin route answers: 200 with vLLM's text, or an error.
pub(crate) type AdminAnswer = Result<String, ApiError>;

/// `POST /v1/load_lora_adapter` `{"lora_name", "lora_path", "load_inplace"?}`, as
/// vLLM's `OpenAIServingModels.load_lora_adapter` checks it.
pub(crate) fn load_lora(body: &Value, config: &SimConfig, loras: &Loras) -> AdminAnswer {
    let obj = object(body)?;
    let name = obj.get("lora_name").and_then(Value::as_str).unwrap_or("");
    let path = obj.get("lora_path").and_then(Value::as_str).unwrap_or("");
    if name.is_empty() || path.is_empty() {
        return Err(ApiError::bad_request(
            "Both 'lora_name' and 'lora_path' must be provided.",
        ));
    }
    if name == config.model {
        return Err(ApiError::bad_request(format!(
            "The lora adapter '{name}' conflicts with a served base model."
        )));
    }
    let in_place = lax::opt_bool(obj, "load_inplace")?.unwrap_or(false);
    let mut list = lock(&loras.0);
    match list.iter_mut().find(|(n, _)| n == name) {
        Some(_) if !in_place => Err(ApiError::bad_request(format!(
            "The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True."
        ))),
        Some(entry) => {
            entry.1 = path.to_owned();
            Ok(format!(
                "Success: LoRA adapter '{name}' added successfully."
            ))
        }
        None => {
            list.push((name.to_owned(), path.to_owned()));
            Ok(format!(
                "Success: LoRA adapter '{name}' added successfully."
            ))
        }
    }
}

/// `POST /v1/unload_lora_adapter` `{"lora_name"}`.
pub(crate) fn unload_lora(body: &Value, loras: &Loras) -> AdminAnswer {
    let obj = object(body)?;
    let name = obj.get("lora_name").and_then(Value::as_str).unwrap_or("");
    if name.is_empty() {
        return Err(ApiError::bad_request(
            "'lora_name' needs to be provided to unload a LoRA adapter.",
        ));
    }
    let mut list = lock(&loras.0);
    let before = list.len();
    list.retain(|(n, _)| n != name);
    if list.len() == before {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("The lora adapter '{name}' cannot be found."),
        ));
    }
    Ok(format!(
        "Success: LoRA adapter '{name}' removed successfully."
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_standard() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
    }

    #[test]
    fn embeddings_are_deterministic_unit_vectors() {
        let a = embedding(&[20, 21]);
        assert_eq!(a.len(), EMBEDDING_DIM);
        assert_eq!(a, embedding(&[20, 21]));
        assert_ne!(a, embedding(&[21, 20]));
        let norm: f32 = a.iter().map(|x| x * x).sum();
        assert!((norm - 1.0).abs() < 1e-5, "{norm}");
    }

    #[test]
    fn detokenize_knows_what_was_tokenized() {
        let v = Vocab::new();
        v.learn("hello world");
        let ids = tokenize("hello world the");
        assert_eq!(v.text(&ids), "hello world the");
        assert_eq!(v.text(&[17]), "<|17|>");
    }

    #[test]
    fn lora_rules_are_vllms() {
        let (c, l) = (SimConfig::default(), Loras::default());
        assert!(load_lora(&json!({"lora_name": "a", "lora_path": "/a"}), &c, &l).is_ok());
        let again = load_lora(&json!({"lora_name": "a", "lora_path": "/a"}), &c, &l);
        assert_eq!(again.unwrap_err().status, 400);
        assert!(
            load_lora(
                &json!({"lora_name": "a", "lora_path": "/b", "load_inplace": true}),
                &c,
                &l
            )
            .is_ok()
        );
        assert_eq!(l.names(), ["a"]);
        assert!(unload_lora(&json!({"lora_name": "a"}), &l).is_ok());
        assert_eq!(
            unload_lora(&json!({"lora_name": "a"}), &l)
                .unwrap_err()
                .status,
            404
        );
        let m = models(&c, &l, 1);
        assert_eq!(m["data"].as_array().unwrap().len(), 1);
    }
}
