//! The OpenAI request and response shapes, as vLLM parses and renders them.

use http::StatusCode;
use serde::Serialize;
use serde_json::{Map, Value};
use thiserror::Error;

use crate::body::Endpoint;
use crate::config::SimConfig;
use crate::generate::{Generation, VOCAB_SIZE, tokenize};

/// An error answered in vLLM's shape:
/// `{"error":{"message":..,"type":..,"param":null,"code":..}}`.
#[derive(Debug, Error)]
#[error("{message}")]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// The JSON body of the error.
    pub(crate) fn body(&self) -> Vec<u8> {
        #[derive(Serialize)]
        struct Inner<'a> {
            message: &'a str,
            #[serde(rename = "type")]
            kind: String,
            param: Option<()>,
            code: u16,
        }
        #[derive(Serialize)]
        struct Outer<'a> {
            error: Inner<'a>,
        }
        let outer = Outer {
            error: Inner {
                message: &self.message,
                kind: error_type(self.status),
                param: None,
                code: self.status.as_u16(),
            },
        };
        serde_json::to_vec(&outer).unwrap_or_default()
    }
}

/// vLLM's error `type` for a status.
fn error_type(status: StatusCode) -> String {
    match status.as_u16() {
        400 => "BadRequestError".to_owned(),
        401 => "AuthenticationError".to_owned(),
        403 => "PermissionDeniedError".to_owned(),
        404 => "NotFoundError".to_owned(),
        422 => "UnprocessableEntityError".to_owned(),
        429 => "RateLimitError".to_owned(),
        501 => "NotImplementedError".to_owned(),
        503 => "ServiceUnavailableError".to_owned(),
        s if s >= 500 => "InternalServerError".to_owned(),
        _ => {
            let phrase = status.canonical_reason().unwrap_or("Unknown");
            let mut kind: String = phrase.split_whitespace().collect();
            kind.push_str("Error");
            kind
        }
    }
}

/// A completion request, validated.
#[derive(Debug)]
pub(crate) struct CompletionRequest {
    pub(crate) endpoint: Endpoint,
    /// The prompts as token ids (one prompt for chat: its messages rendered
    /// by [`chat_prompt`]).
    pub(crate) prompts: Vec<Vec<u32>>,
    pub(crate) prompt_tokens: u64,
    pub(crate) max_tokens: u32,
    pub(crate) min_tokens: u32,
    pub(crate) n: u32,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    pub(crate) stop: Vec<String>,
    pub(crate) ignore_eos: bool,
    pub(crate) include_stop_str_in_output: bool,
    pub(crate) kv_transfer_params: Option<Map<String, Value>>,
}

fn opt_field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<bool, ApiError> {
    match opt_field(obj, key) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad_request(format!(
            "{key}: Input should be a valid boolean"
        ))),
    }
}

fn opt_int(obj: &Map<String, Value>, key: &str) -> Result<Option<i64>, ApiError> {
    match opt_field(obj, key) {
        None => Ok(None),
        Some(v) => v.as_i64().map(Some).ok_or_else(|| {
            ApiError::bad_request(format!("{key}: Input should be a valid integer"))
        }),
    }
}

/// Appends the whitespace-separated text of a chat message's `content`.
fn push_content(out: &mut String, content: &Value) -> Result<(), ApiError> {
    match content {
        Value::Null => Ok(()),
        Value::String(s) => {
            out.push_str(s);
            out.push('\n');
            Ok(())
        }
        Value::Array(parts) => {
            for part in parts {
                let text = part
                    .get("type")
                    .and_then(Value::as_str)
                    .filter(|t| *t == "text")
                    .and_then(|_| part.get("text"))
                    .and_then(Value::as_str);
                match text {
                    Some(t) => {
                        out.push_str(t);
                        out.push('\n');
                    }
                    None => {
                        return Err(ApiError::bad_request(
                            "messages: only content parts of type `text` are supported",
                        ));
                    }
                }
            }
            Ok(())
        }
        _ => Err(ApiError::bad_request(
            "messages: content should be a string or a list of content parts",
        )),
    }
}

/// Token ids as given; `None` if one is not a non-negative integer.
fn token_ids(ids: &[Value]) -> Option<Vec<u64>> {
    ids.iter().map(Value::as_u64).collect()
}

/// Checks that every id is a token of the vocabulary, like vLLM.
fn in_vocab(ids: Vec<u64>) -> Result<Vec<u32>, ApiError> {
    ids.into_iter()
        .map(|id| {
            u32::try_from(id)
                .ok()
                .filter(|id| *id < VOCAB_SIZE)
                .ok_or_else(|| ApiError::bad_request(format!("Token id {id} is out of vocabulary")))
        })
        .collect()
}

fn completion_prompts(prompt: Option<&Value>) -> Result<Vec<Vec<u32>>, ApiError> {
    let invalid = || {
        ApiError::bad_request(
            "prompt: should be a string, a list of strings, a list of token ids or a list of lists of token ids",
        )
    };
    let prompts = match prompt {
        None => return Err(ApiError::bad_request("prompt: Field required")),
        Some(Value::String(s)) => vec![tokenize(s)],
        Some(Value::Array(items)) if items.is_empty() => return Err(invalid()),
        Some(Value::Array(items)) if items.iter().all(Value::is_string) => items
            .iter()
            .filter_map(|s| s.as_str().map(tokenize))
            .collect(),
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => {
            vec![in_vocab(token_ids(items).ok_or_else(invalid)?)?]
        }
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| item.as_array().and_then(|ids| token_ids(ids)))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(invalid)?
            .into_iter()
            .map(in_vocab)
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(invalid()),
    };
    if prompts.iter().any(Vec::is_empty) {
        return Err(ApiError::bad_request("The decoder prompt cannot be empty"));
    }
    Ok(prompts)
}

/// The simulator's chat template: the text of every message's `content`,
/// each followed by a newline (roles are not rendered, and there is no
/// assistant header, so `add_generation_prompt` adds nothing). The chat route
/// and `POST /tokenize {"messages"}` both tokenize this text.
pub(crate) fn chat_prompt(messages: Option<&Value>) -> Result<String, ApiError> {
    let Some(messages) = messages else {
        return Err(ApiError::bad_request("messages: Field required"));
    };
    let Some(messages) = messages.as_array() else {
        return Err(ApiError::bad_request(
            "messages: Input should be a valid list",
        ));
    };
    let mut text = String::new();
    for message in messages {
        if !message.is_object() {
            return Err(ApiError::bad_request(
                "messages: each message should be an object",
            ));
        }
        push_content(&mut text, message.get("content").unwrap_or(&Value::Null))?;
    }
    Ok(text)
}

/// Checks a request's optional `model` against the served one, like vLLM.
fn check_model(obj: &Map<String, Value>, config: &SimConfig) -> Result<(), ApiError> {
    match opt_field(obj, "model") {
        None => Ok(()),
        Some(Value::String(m)) if *m == config.model => Ok(()),
        Some(Value::String(m)) => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("The model `{m}` does not exist."),
        )),
        Some(_) => Err(ApiError::bad_request(
            "model: Input should be a valid string",
        )),
    }
}

/// The answer to `POST /tokenize`.
#[derive(Debug, Serialize)]
pub(crate) struct TokenizeAnswer {
    count: usize,
    max_model_len: u32,
    tokens: Vec<u32>,
    token_strs: Option<()>,
}

/// Serves `POST /tokenize`: `{"prompt": "text"}` or `{"messages": [..]}`
/// (with an optional `add_generation_prompt`), as vLLM's tokenizer route.
pub(crate) fn tokenize_request(
    body: &Value,
    config: &SimConfig,
) -> Result<TokenizeAnswer, ApiError> {
    let Some(obj) = body.as_object() else {
        return Err(ApiError::bad_request(
            "Input should be a valid dictionary or object to extract fields from",
        ));
    };
    check_model(obj, config)?;
    let tokens = if obj.contains_key("messages") {
        // Validated, although the template has no generation prompt to add.
        opt_bool(obj, "add_generation_prompt")?;
        tokenize(&chat_prompt(obj.get("messages"))?)
    } else {
        match obj.get("prompt") {
            None => return Err(ApiError::bad_request("prompt: Field required")),
            Some(Value::String(s)) => tokenize(s),
            Some(_) => {
                return Err(ApiError::bad_request(
                    "prompt: Input should be a valid string",
                ));
            }
        }
    };
    Ok(TokenizeAnswer {
        count: tokens.len(),
        max_model_len: config.max_model_len,
        tokens,
        token_strs: None,
    })
}

impl CompletionRequest {
    /// Parses and validates a request body like vLLM's OpenAI server.
    pub(crate) fn parse(
        endpoint: Endpoint,
        body: &Value,
        config: &SimConfig,
    ) -> Result<Self, ApiError> {
        let Some(obj) = body.as_object() else {
            return Err(ApiError::bad_request(
                "Input should be a valid dictionary or object to extract fields from",
            ));
        };
        check_model(obj, config)?;

        let stream = opt_bool(obj, "stream")?;
        let include_usage = match opt_field(obj, "stream_options") {
            None => false,
            Some(_) if !stream => {
                return Err(ApiError::bad_request(
                    "Stream options can only be defined when `stream=True`.",
                ));
            }
            Some(Value::Object(o)) => opt_bool(o, "include_usage")?,
            Some(_) => {
                return Err(ApiError::bad_request(
                    "stream_options: Input should be a valid dictionary",
                ));
            }
        };

        let prompts = match endpoint {
            Endpoint::Chat => vec![tokenize(&chat_prompt(obj.get("messages"))?)],
            Endpoint::Completions => completion_prompts(obj.get("prompt"))?,
        };
        let prompt_tokens: u64 = prompts.iter().map(|p| p.len() as u64).sum();

        let requested = match endpoint {
            Endpoint::Chat => match opt_int(obj, "max_completion_tokens")? {
                Some(m) => Some(("max_completion_tokens", m)),
                None => opt_int(obj, "max_tokens")?.map(|m| ("max_tokens", m)),
            },
            Endpoint::Completions => opt_int(obj, "max_tokens")?.map(|m| ("max_tokens", m)),
        };
        let max_model_len = u64::from(config.max_model_len);
        let max_prompt = prompts.iter().map(|p| p.len() as u64).max().unwrap_or(0);
        let max_tokens = match requested {
            Some((key, m)) if m < 1 => {
                return Err(ApiError::bad_request(format!(
                    "{key} must be at least 1, got {m}."
                )));
            }
            Some((_, m)) => {
                if max_prompt + m as u64 > max_model_len {
                    return Err(ApiError::bad_request(format!(
                        "This model's maximum context length is {max_model_len} tokens. However, you requested {} tokens ({max_prompt} in the messages, {m} in the completion). Please reduce the length of the messages or completion.",
                        max_prompt + m as u64
                    )));
                }
                u32::try_from(m).unwrap_or(u32::MAX)
            }
            None => {
                if max_prompt >= max_model_len {
                    return Err(ApiError::bad_request(format!(
                        "This model's maximum context length is {max_model_len} tokens. However, your request has {max_prompt} input tokens. Please reduce the length of the input messages."
                    )));
                }
                let room = u32::try_from(max_model_len - max_prompt).unwrap_or(u32::MAX);
                config.default_max_tokens.min(room).max(1)
            }
        };
        let min_tokens = match opt_int(obj, "min_tokens")? {
            None => 0,
            Some(m) if m < 0 => {
                return Err(ApiError::bad_request(format!(
                    "min_tokens must be greater than or equal to 0, got {m}."
                )));
            }
            Some(m) if m > i64::from(max_tokens) => {
                return Err(ApiError::bad_request(format!(
                    "min_tokens must be less than or equal to max_tokens={max_tokens}, got {m}."
                )));
            }
            Some(m) => u32::try_from(m).unwrap_or(u32::MAX),
        };
        let n = match opt_int(obj, "n")? {
            None => 1,
            Some(n) if n < 1 => {
                return Err(ApiError::bad_request(format!(
                    "n must be at least 1, got {n}."
                )));
            }
            Some(n) if n > 128 => {
                return Err(ApiError::bad_request(format!(
                    "n must be at most 128, got {n}."
                )));
            }
            Some(n) => u32::try_from(n).unwrap_or(1),
        };
        let stop = match opt_field(obj, "stop") {
            None => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) => items
                .iter()
                .map(|s| s.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    ApiError::bad_request("stop: Input should be a string or a list of strings")
                })?,
            Some(_) => {
                return Err(ApiError::bad_request(
                    "stop: Input should be a string or a list of strings",
                ));
            }
        };
        let kv_transfer_params = match opt_field(obj, "kv_transfer_params") {
            None => None,
            Some(Value::Object(o)) => Some(o.clone()),
            Some(_) => {
                return Err(ApiError::bad_request(
                    "kv_transfer_params: Input should be a valid dictionary",
                ));
            }
        };
        Ok(Self {
            endpoint,
            prompts,
            prompt_tokens,
            max_tokens,
            min_tokens,
            n,
            stream,
            include_usage,
            stop,
            ignore_eos: opt_bool(obj, "ignore_eos")?,
            include_stop_str_in_output: opt_bool(obj, "include_stop_str_in_output")?,
            kv_transfer_params,
        })
    }

    /// All prompt tokens, prompt after prompt.
    pub(crate) fn tokens(&self) -> impl Iterator<Item = u32> + '_ {
        self.prompts.iter().flatten().copied()
    }
}

/// Python truthiness of a JSON value.
pub(crate) fn truthy(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) => n.as_f64().is_some_and(|f| f != 0.0),
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
    }
}

/// `kv_transfer_params` a prefill answers with.
#[derive(Debug, Serialize)]
pub(crate) struct KvParamsOut<'a> {
    pub(crate) do_remote_prefill: bool,
    pub(crate) do_remote_decode: bool,
    pub(crate) remote_block_ids: Vec<u64>,
    pub(crate) remote_engine_id: &'a str,
    pub(crate) remote_request_id: String,
    pub(crate) remote_host: &'a str,
    pub(crate) remote_port: u16,
    pub(crate) tp_size: u32,
}

/// The `kv_transfer_params` field of an answer, when not `null`.
#[derive(Clone, Copy, Debug, Serialize)]
#[serde(untagged)]
pub(crate) enum KvParamsField<'a> {
    /// The parameters of the held blocks.
    Params(&'a KvParamsOut<'a>),
    /// An unusable value of fault injection.
    Malformed(&'static str),
    /// An LMCache prefill's first token.
    FirstTok(FirstTok),
}

/// The `kv_transfer_params` of an LMCache prefill's answer (`ret_first_tok`).
#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct FirstTok {
    pub(crate) first_tok: u32,
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u64,
    total_tokens: u64,
    completion_tokens: u64,
    prompt_tokens_details: Option<()>,
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    content: &'a str,
    tool_calls: [(); 0],
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: usize,
    message: Message<'a>,
    logprobs: Option<()>,
    finish_reason: &'static str,
    stop_reason: Option<&'a str>,
}

#[derive(Serialize)]
struct TextChoice<'a> {
    index: usize,
    text: &'a str,
    logprobs: Option<()>,
    finish_reason: &'static str,
    stop_reason: Option<&'a str>,
    prompt_logprobs: Option<()>,
}

#[derive(Serialize)]
struct ChatResponse<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<ChatChoice<'a>>,
    usage: Usage,
    prompt_logprobs: Option<()>,
    kv_transfer_params: Option<KvParamsField<'a>>,
}

#[derive(Serialize)]
struct TextResponse<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<TextChoice<'a>>,
    usage: Usage,
    kv_transfer_params: Option<KvParamsField<'a>>,
}

/// Everything a non-streamed answer is made of.
#[derive(Debug)]
pub(crate) struct Answer<'a> {
    pub(crate) endpoint: Endpoint,
    pub(crate) id: &'a str,
    pub(crate) created: u64,
    pub(crate) model: &'a str,
    pub(crate) choices: &'a [Generation],
    pub(crate) prompt_tokens: u64,
    pub(crate) kv_transfer_params: Option<KvParamsField<'a>>,
}

impl Answer<'_> {
    /// Renders the JSON body.
    pub(crate) fn render(&self) -> Result<Vec<u8>, serde_json::Error> {
        let texts: Vec<String> = self.choices.iter().map(Generation::text).collect();
        let completion_tokens: u64 = self.choices.iter().map(|c| c.steps.len() as u64).sum();
        let usage = Usage {
            prompt_tokens: self.prompt_tokens,
            total_tokens: self.prompt_tokens + completion_tokens,
            completion_tokens,
            prompt_tokens_details: None,
        };
        match self.endpoint {
            Endpoint::Chat => serde_json::to_vec(&ChatResponse {
                id: self.id,
                object: "chat.completion",
                created: self.created,
                model: self.model,
                choices: self
                    .choices
                    .iter()
                    .zip(&texts)
                    .enumerate()
                    .map(|(index, (g, text))| ChatChoice {
                        index,
                        message: Message {
                            role: "assistant",
                            content: text,
                            tool_calls: [],
                        },
                        logprobs: None,
                        finish_reason: g.finish.as_str(),
                        stop_reason: g.stop_reason.as_deref(),
                    })
                    .collect(),
                usage,
                prompt_logprobs: None,
                kv_transfer_params: self.kv_transfer_params,
            }),
            Endpoint::Completions => serde_json::to_vec(&TextResponse {
                id: self.id,
                object: "text_completion",
                created: self.created,
                model: self.model,
                choices: self
                    .choices
                    .iter()
                    .zip(&texts)
                    .enumerate()
                    .map(|(index, (g, text))| TextChoice {
                        index,
                        text,
                        logprobs: None,
                        finish_reason: g.finish.as_str(),
                        stop_reason: g.stop_reason.as_deref(),
                        prompt_logprobs: None,
                    })
                    .collect(),
                usage,
                kv_transfer_params: self.kv_transfer_params,
            }),
        }
    }
}
