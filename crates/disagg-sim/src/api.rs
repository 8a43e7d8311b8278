//! The OpenAI request and response shapes, as vLLM parses and renders them
//! (and SGLang, whose request rules are laxer: see [`Dialect`]).

use http::StatusCode;
use serde::Serialize;
use serde_json::{Map, Value};
use thiserror::Error;

use crate::body::Endpoint;
use crate::config::{KvMode, SimConfig};
use crate::generate::{Generation, VOCAB_SIZE, tokenize};
use crate::handoff::KvParamsOut;
use crate::lax;
use crate::limits::{batch_len, check_batch, check_context};
use crate::surface::Loras;

/// An error answered in vLLM's shape:
/// `{"error":{"message":..,"type":..,"param":null,"code":..}}`, or in SGLang's
/// ([`ApiError::in_sglang_shape`]).
#[derive(Debug, Error)]
#[error("{message}")]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
    /// The error's `param`, when vLLM names the field.
    pub(crate) param: Option<&'static str>,
    /// Written as SGLang's `ErrorResponse` rather than vLLM's error.
    sglang: bool,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
            sglang: false,
        }
    }

    /// The same error, written as SGLang answers a request its scheduler aborted
    /// ([`crate::kv_load_failure::sglang_error_body`]).
    pub(crate) fn in_sglang_shape(mut self) -> Self {
        self.sglang = true;
        self
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// The JSON body of the error.
    pub(crate) fn body(&self) -> Vec<u8> {
        if self.sglang {
            return crate::kv_load_failure::sglang_error_body(self);
        }
        #[derive(Serialize)]
        struct Inner<'a> {
            message: &'a str,
            #[serde(rename = "type")]
            kind: String,
            param: Option<&'a str>,
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
                param: self.param,
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
    /// The LoRA adapter the request's `model` names (`None`: the base model), which
    /// the answer names as its `model`, as vLLM does.
    pub(crate) adapter: Option<String>,
    /// The prompts as token ids (one prompt for chat: its messages rendered
    /// by [`chat_prompt`]).
    pub(crate) prompts: Vec<Vec<u32>>,
    pub(crate) prompt_tokens: u64,
    pub(crate) max_tokens: u32,
    pub(crate) min_tokens: u32,
    pub(crate) n: u32,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    /// `stream_options.continuous_usage_stats` with `include_usage`: every streamed
    /// chunk carries `usage`, as vLLM writes it.
    pub(crate) continuous_usage: bool,
    pub(crate) stop: Vec<String>,
    pub(crate) ignore_eos: bool,
    pub(crate) include_stop_str_in_output: bool,
    pub(crate) kv_transfer_params: Option<Map<String, Value>>,
    /// `use_beam_search`: vLLM builds beam-search parameters, which carry no
    /// `kv_transfer_params`.
    pub(crate) beam_search: bool,
    /// Whether the request asks for structured output (a grammar to compile).
    pub(crate) grammar: bool,
    /// SGLang's native `/generate`: how its answer is written (`None` for the
    /// OpenAI routes, whose `endpoint` says).
    pub(crate) native: Option<crate::native::Native>,
    /// A generation route other than chat and completions
    /// ([`crate::gen_apis`]): how its answer is written.
    pub(crate) gen_api: Option<crate::gen_apis::GenApi>,
    /// `/v1/responses`: the request as that route read it, for its answer.
    pub(crate) responses: Option<Box<crate::surface::ResponsesRequest>>,
    /// Chat: the prompt was templated and tokenized here (not taken from
    /// `kv_transfer_params.prompt_token_ids`).
    pub(crate) tokenized: bool,
    /// Chat: the prompt is the ids `kv_transfer_params.prompt_token_ids` carried
    /// (vLLM 0.33's prompt-token reuse, [`crate::reuse`]).
    pub(crate) reused_ids: bool,
    /// `return_token_ids`: the answer carries the prompt's ids.
    pub(crate) return_token_ids: bool,
    /// vLLM's completions route given `"max_tokens": null`: fails ([`crate::null_limit`]).
    pub(crate) null_max_tokens: bool,
    /// `echo`: read for what vLLM streams when a KV load fails ([`crate::kv_load_failure`]).
    pub(crate) echo: bool,
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
                // A media item is one placeholder word (its encoder output, under
                // E/P/D, is the `ec` module's).
                // vLLM's `image_embeds`, `audio_embeds` and `video_embeds` parts (pre-computed
                // embeddings) hold the same place.
                let media = part.get("type").and_then(Value::as_str).and_then(|t| {
                    t.strip_suffix("_url")
                        .or((t == "input_audio").then_some("audio"))
                        .or(t.strip_suffix("_embeds").filter(|m| *m != "prompt"))
                });
                match (text, media) {
                    (Some(t), _) => {
                        out.push_str(t);
                        out.push('\n');
                    }
                    (None, Some(m)) => {
                        out.push('<');
                        out.push_str(m);
                        out.push_str(">\n");
                    }
                    (None, None) => {
                        return Err(ApiError::bad_request(
                            "messages: only content parts of type `text`, `image_url`, `input_audio`, `audio_url`, `video_url`, `image_embeds`, `audio_embeds` and `video_embeds` are supported",
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

pub(crate) fn completion_prompts(prompt: Option<&Value>) -> Result<Vec<Vec<u32>>, ApiError> {
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

/// Checks a request's optional `model` against the served ones, like vLLM
/// (`OpenAIServing._check_model`): the base model or a LoRA adapter loaded
/// (`/v1/load_lora_adapter`). The adapter's name, when the request names one: vLLM
/// names it as the answer's `model`.
pub(crate) fn check_model(
    obj: &Map<String, Value>,
    config: &SimConfig,
    loras: &Loras,
) -> Result<Option<String>, ApiError> {
    match lax::field(obj, "model") {
        None => Ok(None),
        Some(Value::String(m)) if *m == config.model => Ok(None),
        Some(Value::String(m)) if loras.contains(m) => Ok(Some(m.clone())),
        Some(Value::String(m)) => {
            let mut e = ApiError::new(
                StatusCode::NOT_FOUND,
                format!("The model `{m}` does not exist."),
            );
            e.param = Some("model");
            Err(e)
        }
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
    loras: &Loras,
) -> Result<TokenizeAnswer, ApiError> {
    let Some(obj) = body.as_object() else {
        return Err(ApiError::bad_request(
            "Input should be a valid dictionary or object to extract fields from",
        ));
    };
    check_model(obj, config, loras)?;
    let tokens = if obj.contains_key("messages") {
        // Validated, although the template has no generation prompt to add.
        lax::opt_bool(obj, "add_generation_prompt")?;
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
    /// Parses and validates a request body like the engine the
    /// [`KvMode`](crate::KvMode) stands for: vLLM's rules (its request
    /// model's validators, then the checks of its sampling parameters) or
    /// SGLang's laxer ones. See [`Dialect`].
    pub(crate) fn parse(
        endpoint: Endpoint,
        body: &Value,
        config: &SimConfig,
        loras: &Loras,
    ) -> Result<Self, ApiError> {
        let Some(obj) = body.as_object() else {
            return Err(ApiError::bad_request(
                "Input should be a valid dictionary or object to extract fields from",
            ));
        };
        let adapter = check_model(obj, config, loras)?;
        let dialect = Dialect::of(config.kv_mode);
        let vllm = dialect == Dialect::Vllm;
        if vllm {
            vllm_before_validators(endpoint, obj)?;
        }

        // vLLM's check reads the raw values with Python truthiness (so
        // `"stream_options": {}` passes, and so does `"stream": "no"`);
        // SGLang's request model does the same.
        if truthy(obj.get("stream_options")) && !truthy(obj.get("stream")) {
            return Err(ApiError::bad_request(
                "Stream options can only be defined when `stream=True`.",
            ));
        }
        let stream = lax::opt_bool(obj, "stream")?.unwrap_or(false);
        // vLLM's `should_include_usage`: continuous usage only with `include_usage`.
        let (include_usage, continuous_usage) = match lax::field(obj, "stream_options") {
            None => (false, false),
            Some(Value::Object(o)) => {
                let continuous = lax::opt_bool(o, "continuous_usage_stats")?.unwrap_or(false);
                let include = lax::opt_bool(o, "include_usage")?.unwrap_or(false);
                (include, include && continuous)
            }
            Some(_) => {
                return Err(ApiError::bad_request(
                    "stream_options: Input should be a valid dictionary",
                ));
            }
        };

        // vLLM 0.33 pops `prompt_token_ids` from a chat request's
        // `kv_transfer_params` before the engine sees the dict, and takes them as
        // the prompt instead of templating and tokenizing it.
        let mut kv_transfer_params = match lax::field(obj, "kv_transfer_params") {
            None => None,
            Some(Value::Object(o)) => Some(o.clone()),
            Some(_) => {
                return Err(ApiError::bad_request(
                    "kv_transfer_params: Input should be a valid dictionary",
                ));
            }
        };
        let reused = match (endpoint, kv_transfer_params.as_mut()) {
            (Endpoint::Chat, Some(params)) if vllm => crate::reuse::reused_prompt(params, obj)?,
            _ => None,
        };
        let (tokenized, reused_ids) = (
            endpoint == Endpoint::Chat && reused.is_none(),
            reused.is_some(),
        );
        // A batch of more prompts than choices served is refused before it is tokenized.
        if endpoint == Endpoint::Completions {
            check_batch(batch_len(obj.get("prompt")), 1, 0)?;
        }
        let prompts = match (endpoint, reused) {
            (Endpoint::Chat, Some(ids)) => vec![ids],
            (Endpoint::Chat, None) => vec![tokenize(&chat_prompt(obj.get("messages"))?)],
            (Endpoint::Completions, _) => completion_prompts(obj.get("prompt"))?,
        };
        let return_token_ids = lax::opt_bool(obj, "return_token_ids")?.unwrap_or(false);
        let prompt_tokens: u64 = prompts.iter().map(|p| p.len() as u64).sum();

        // Typed fields, coerced like pydantic's lax mode in both dialects.
        let beam_search = lax::opt_bool(obj, "use_beam_search")?.unwrap_or(false);
        let temperature = lax::opt_float(obj, "temperature")?;
        lax::opt_int_list(obj, "stop_token_ids")?;
        let echo = lax::opt_bool(obj, "echo")?.unwrap_or(false);
        let (sample_logprobs, prompt_logprobs) = logprob_fields(endpoint, obj)?;
        let grammar = grammar_fields(obj)?;

        let requested = match endpoint {
            Endpoint::Chat => match lax::opt_int(obj, "max_completion_tokens")? {
                Some(m) => Some(("max_completion_tokens", m)),
                None => lax::opt_int(obj, "max_tokens")?.map(|m| ("max_tokens", m)),
            },
            Endpoint::Completions => lax::opt_int(obj, "max_tokens")?.map(|m| ("max_tokens", m)),
        };
        let max_model_len = u64::from(config.max_model_len);
        let max_prompt = prompts.iter().map(|p| p.len() as u64).max().unwrap_or(0);
        // vLLM refuses fewer than one token; SGLang serves `max_tokens: 0`
        // (an answer without tokens).
        let least_tokens = if vllm { 1 } else { 0 };
        if let Some((key, m)) = requested
            && m < least_tokens
        {
            return Err(ApiError::bad_request(format!(
                "{key} must be at least {least_tokens}, got {m}."
            )));
        }
        if vllm {
            let limit = requested.and_then(|(_, m)| u64::try_from(m).ok());
            check_context(&prompts, limit, max_model_len)?;
        }
        let max_tokens = match requested {
            Some((_, m)) => {
                let m = u64::try_from(m).unwrap_or(0);
                if max_prompt.saturating_add(m) > max_model_len {
                    return Err(ApiError::bad_request(format!(
                        "This model's maximum context length is {max_model_len} tokens. However, you requested {} tokens ({max_prompt} in the messages, {m} in the completion). Please reduce the length of the messages or completion.",
                        max_prompt.saturating_add(m)
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
        let min_tokens = match lax::opt_int(obj, "min_tokens")? {
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
        // vLLM refuses `n < 1`; SGLang takes `n: 0` and answers one choice.
        let least_n = if vllm { 1 } else { 0 };
        let n = match lax::opt_int(obj, "n")? {
            None => 1,
            Some(n) if n < least_n => {
                return Err(ApiError::bad_request(format!(
                    "n must be at least {least_n}, got {n}."
                )));
            }
            Some(n) if n > 128 => {
                return Err(ApiError::bad_request(format!(
                    "n must be at most 128, got {n}."
                )));
            }
            Some(n) => u32::try_from(n).unwrap_or(1).max(1),
        };
        check_batch(prompts.len(), n, max_tokens)?;
        let stop = lax::opt_str_or_list(obj, "stop")?.unwrap_or_default();
        let ignore_eos = lax::opt_bool(obj, "ignore_eos")?.unwrap_or(false);
        let include_stop_str_in_output =
            lax::opt_bool(obj, "include_stop_str_in_output")?.unwrap_or(false);

        match dialect {
            Dialect::Vllm => {
                let sampling = SamplingChecks {
                    beam_search,
                    temperature,
                    n,
                    stop: &stop,
                    sample_logprobs,
                    prompt_logprobs,
                    max_logprobs: config.max_logprobs,
                };
                sampling.check()?;
            }
            Dialect::Sglang => {
                // SGLang's own sampling check: only a negative temperature.
                if temperature.is_some_and(|t| t < 0.0) {
                    return Err(ApiError::bad_request("temperature must be non-negative"));
                }
            }
        }

        Ok(Self {
            endpoint,
            adapter,
            prompts,
            prompt_tokens,
            max_tokens,
            min_tokens,
            n,
            stream,
            include_usage,
            continuous_usage,
            stop,
            ignore_eos,
            include_stop_str_in_output,
            kv_transfer_params,
            beam_search,
            grammar,
            native: None,
            gen_api: None,
            responses: None,
            tokenized,
            reused_ids,
            return_token_ids,
            null_max_tokens: crate::null_limit::fails_on(vllm, endpoint, obj),
            echo,
        })
    }

    /// All prompt tokens, prompt after prompt.
    pub(crate) fn tokens(&self) -> impl Iterator<Item = u32> + '_ {
        self.prompts.iter().flatten().copied()
    }
}

/// Whose request rules an engine applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dialect {
    /// vLLM 0.33 (every vLLM [`KvMode`](crate::KvMode)): its request
    /// model's validators on the raw body, pydantic's lax types, then the
    /// checks of its sampling parameters (`SamplingParams._verify_args`,
    /// the engine's `--max-logprobs`).
    Vllm,
    /// SGLang 0.5.23 ([`KvMode::Sglang`](crate::KvMode::Sglang)): pydantic's
    /// lax types, but `max_tokens: 0`, `n: 0`, `temperature: 3` or
    /// `top_logprobs: 50` are served.
    Sglang,
}

impl Dialect {
    pub(crate) fn of(mode: KvMode) -> Self {
        if mode.is_vllm() {
            Dialect::Vllm
        } else {
            Dialect::Sglang
        }
    }
}

/// A raw number as vLLM's `mode="before"` validators compare it (Python
/// compares `true` as 1); `Err` for a value that is not a number.
fn raw_number(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>, ApiError> {
    match lax::field(obj, key) {
        None => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(Value::Bool(b)) => Ok(Some(f64::from(u8::from(*b)))),
        Some(_) => Err(ApiError::bad_request(format!(
            "`{key}` must be an integer."
        ))),
    }
}

/// vLLM's `mode="before"` validators of the chat and completion request
/// models (`vllm/entrypoints/openai/chat_completion/protocol.py`,
/// `.../completion/protocol.py`): they read the raw body, with Python
/// truthiness, before any field is typed.
fn vllm_before_validators(endpoint: Endpoint, obj: &Map<String, Value>) -> Result<(), ApiError> {
    let bad = |m: &str| Err(ApiError::bad_request(m));
    if let Some(Value::Object(rf)) = lax::field(obj, "response_format")
        && rf.get("type").and_then(Value::as_str) == Some("json_schema")
        && lax::field(rf, "json_schema").is_none()
    {
        return bad(
            "When response_format type is 'json_schema', the 'json_schema' field must be provided.",
        );
    }
    if let Some(Value::Object(so)) = lax::field(obj, "structured_outputs") {
        let kinds = ["json", "regex", "choice"]
            .iter()
            .filter(|k| lax::field(so, k).is_some())
            .count();
        if kinds > 1 {
            return bad(
                "You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice').",
            );
        }
    }
    let stream = truthy(obj.get("stream"));
    let logprobs = truthy(obj.get("logprobs"));
    if endpoint == Endpoint::Chat
        && let Some(Value::Array(ids)) = lax::field(obj, "logprob_token_ids")
    {
        if ids.is_empty() {
            return bad("`logprob_token_ids` must not be an empty list.");
        }
        if truthy(obj.get("use_beam_search")) {
            return bad("`logprob_token_ids` is not supported with beam search.");
        }
        if !logprobs {
            return bad("when using `logprob_token_ids`, `logprobs` must be set to true.");
        }
    }
    if let Some(p) = raw_number(obj, "prompt_logprobs")? {
        if stream && (p > 0.0 || p == -1.0) {
            return bad("`prompt_logprobs` are not available when `stream=True`.");
        }
        if p < 0.0 && p != -1.0 {
            return bad("`prompt_logprobs` must be a positive value or -1.");
        }
    }
    match endpoint {
        Endpoint::Chat => {
            if let Some(top) = raw_number(obj, "top_logprobs")? {
                if top < 0.0 && top != -1.0 {
                    return bad("`top_logprobs` must be a positive value or -1.");
                }
                if (top == -1.0 || top > 0.0) && !logprobs {
                    return bad("when using `top_logprobs`, `logprobs` must be set to true.");
                }
            }
        }
        Endpoint::Completions => {
            if raw_number(obj, "logprobs")?.is_some_and(|l| l < 0.0) {
                return bad("`logprobs` must be a positive value.");
            }
        }
    }
    Ok(())
}

/// The logprobs a request asks for, typed: (per generated token, per
/// prompt token), `-1` meaning the whole vocabulary. Chat asks per token
/// with `logprobs: true` and `top_logprobs` (none when `logprob_token_ids`
/// names the tokens instead); completions with an integer `logprobs`.
fn logprob_fields(
    endpoint: Endpoint,
    obj: &Map<String, Value>,
) -> Result<(Option<i64>, Option<i64>), ApiError> {
    let prompt = lax::opt_int(obj, "prompt_logprobs")?;
    let sample = match endpoint {
        Endpoint::Chat => {
            let on = lax::opt_bool(obj, "logprobs")?.unwrap_or(false);
            let top = lax::opt_int(obj, "top_logprobs")?.unwrap_or(0);
            let ids = lax::opt_int_list(obj, "logprob_token_ids")?;
            (on && ids.is_none()).then_some(top)
        }
        Endpoint::Completions => lax::opt_int(obj, "logprobs")?,
    };
    Ok((sample, prompt))
}

/// Whether the request makes the engine compile a grammar (structured
/// output): `response_format` of type `json_object`, `json_schema` or
/// `structural_tag`, `structured_outputs`, or one of the older `guided_json`,
/// `guided_regex`, `guided_choice`, `guided_grammar` fields. A malformed
/// `response_format` is a 400, as its pydantic model refuses it.
fn grammar_fields(obj: &Map<String, Value>) -> Result<bool, ApiError> {
    let response_format = match lax::field(obj, "response_format") {
        None => false,
        Some(Value::Object(rf)) => match rf.get("type").and_then(Value::as_str) {
            Some("text") => false,
            Some("json_object" | "json_schema" | "structural_tag") => true,
            _ => {
                return Err(ApiError::bad_request(
                    "response_format: type should be 'text', 'json_object', 'json_schema' or 'structural_tag'",
                ));
            }
        },
        Some(_) => {
            return Err(ApiError::bad_request(
                "response_format: Input should be a valid dictionary",
            ));
        }
    };
    let structured = match lax::field(obj, "structured_outputs") {
        None => false,
        Some(Value::Object(so)) => so.values().any(|v| !v.is_null()),
        Some(_) => {
            return Err(ApiError::bad_request(
                "structured_outputs: Input should be a valid dictionary",
            ));
        }
    };
    let guided = [
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    ]
    .iter()
    .any(|k| lax::field(obj, k).is_some());
    Ok(response_format || structured || guided)
}

/// What vLLM checks when it builds a request's sampling parameters
/// (`vllm/sampling_params.py`, `SamplingParams._verify_args` and
/// `_verify_greedy_sampling`) and when the engine takes them (the
/// `--max-logprobs` limit). A beam search builds other parameters, which
/// check none of the temperature rules.
#[derive(Debug)]
struct SamplingChecks<'a> {
    beam_search: bool,
    temperature: Option<f64>,
    n: u32,
    stop: &'a [String],
    sample_logprobs: Option<i64>,
    prompt_logprobs: Option<i64>,
    max_logprobs: u32,
}

/// Below this temperature vLLM samples greedily (`_SAMPLING_EPS`).
const SAMPLING_EPS: f64 = 1e-5;

impl SamplingChecks<'_> {
    fn check(&self) -> Result<(), ApiError> {
        let bad = |m: String| Err(ApiError::bad_request(m));
        if !self.beam_search
            && let Some(t) = self.temperature
        {
            if !t.is_finite() {
                return bad(format!("temperature must be a finite number, got {t}."));
            }
            if t < 0.0 {
                return bad(format!("temperature must be non-negative, got {t}."));
            }
            if t > 2.0 {
                return bad(format!("temperature must be in [0, 2], got {t}."));
            }
            // Greedy sampling gives every choice the same text.
            if t < SAMPLING_EPS && self.n > 1 {
                return bad(format!(
                    "n must be 1 when using greedy sampling, got {}.",
                    self.n
                ));
            }
        }
        if self.stop.iter().any(String::is_empty) {
            return bad("stop cannot contain an empty string.".to_owned());
        }
        // -1 asks for the whole vocabulary.
        let count = |n: i64| if n == -1 { i64::from(VOCAB_SIZE) } else { n };
        let max = i64::from(self.max_logprobs);
        if let Some(n) = self.sample_logprobs.map(count)
            && n > max
        {
            return bad(format!(
                "Requested sample logprobs of {n}, which is greater than max allowed: {max}"
            ));
        }
        if let Some(n) = self.prompt_logprobs.map(count)
            && n > max
        {
            return bad(format!(
                "Requested prompt logprobs of {n}, which is greater than max allowed: {max}"
            ));
        }
        Ok(())
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

/// The `kv_transfer_params` field of an answer, when not `null`.
#[derive(Clone, Copy, Debug, Serialize)]
#[serde(untagged)]
pub(crate) enum KvParamsField<'a> {
    /// The parameters of the held blocks.
    Params(&'a KvParamsOut<'a>),
    /// An unusable value of fault injection.
    Malformed(&'static str),
    /// A partial dict of fault injection ([`Faults::partial_kv_params`](crate::Faults::partial_kv_params)).
    Partial(&'a Value),
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
    prompt_tokens_details: Option<PromptTokensDetails>,
}

/// vLLM's `usage.prompt_tokens_details` (with `--enable-prompt-tokens-details`).
#[derive(Serialize)]
struct PromptTokensDetails {
    cached_tokens: u64,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_token_ids: Option<&'a Value>,
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
    /// Prompt tokens served from the prefix cache (`None` without one).
    pub(crate) cached_tokens: Option<u64>,
    pub(crate) kv_transfer_params: Option<KvParamsField<'a>>,
    /// Chat with `return_token_ids`: the prompt's ids, top-level.
    pub(crate) prompt_token_ids: Option<&'a Value>,
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
            prompt_tokens_details: self
                .cached_tokens
                .map(|cached_tokens| PromptTokensDetails { cached_tokens }),
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
                prompt_token_ids: self.prompt_token_ids,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SimRole;
    use serde_json::json;

    const CHAT: Endpoint = Endpoint::Chat;
    const COMPLETIONS: Endpoint = Endpoint::Completions;

    fn parse(mode: KvMode, endpoint: Endpoint, extra: Value) -> Result<CompletionRequest, String> {
        let mut body = match endpoint {
            Endpoint::Chat => json!({"messages": [{"role": "user", "content": "hi there"}]}),
            Endpoint::Completions => json!({"prompt": "hi there"}),
        };
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let config = SimConfig {
            kv_mode: mode,
            ..SimConfig::default()
        };
        CompletionRequest::parse(endpoint, &body, &config, &Loras::default()).map_err(|e| {
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{}", e.message);
            e.message
        })
    }

    /// Bodies and what vLLM 0.33 answers: `Ok` accepted, `Err(needle)` a 400
    /// whose message contains `needle`. Each refusal is where vLLM refuses
    /// (its request model's validators, pydantic's lax types, its sampling
    /// parameters' checks); the accepted rows are the edges it lets through.
    #[test]
    fn vllm_accepts_and_refuses_like_vllm() {
        let table: &[(Endpoint, Value, Result<(), &str>)] = &[
            // Dependent fields.
            (
                CHAT,
                json!({"logprob_token_ids": [1, 2]}),
                Err("`logprobs` must be set to true"),
            ),
            (
                CHAT,
                json!({"logprob_token_ids": [1], "logprobs": true}),
                Ok(()),
            ),
            (
                CHAT,
                json!({"logprob_token_ids": [], "logprobs": true}),
                Err("must not be an empty list"),
            ),
            (
                CHAT,
                json!({"logprob_token_ids": [1], "logprobs": true, "use_beam_search": true}),
                Err("not supported with beam search"),
            ),
            (
                CHAT,
                json!({"top_logprobs": 3}),
                Err("when using `top_logprobs`, `logprobs` must be set to true"),
            ),
            (CHAT, json!({"top_logprobs": 0}), Ok(())),
            (CHAT, json!({"top_logprobs": 3, "logprobs": true}), Ok(())),
            (
                CHAT,
                json!({"top_logprobs": -2, "logprobs": true}),
                Err("`top_logprobs` must be a positive value or -1"),
            ),
            (
                CHAT,
                json!({"top_logprobs": "3", "logprobs": true}),
                Err("`top_logprobs` must be an integer"),
            ),
            (
                CHAT,
                json!({"stream_options": {"include_usage": true}}),
                Err("Stream options can only be defined when `stream=True`"),
            ),
            (
                CHAT,
                json!({"stream_options": {"include_usage": true}, "stream": true}),
                Ok(()),
            ),
            // vLLM's check reads the raw values: an empty dict is falsy.
            (CHAT, json!({"stream_options": {}}), Ok(())),
            (
                CHAT,
                json!({"prompt_logprobs": 1, "stream": true}),
                Err("`prompt_logprobs` are not available when `stream=True`"),
            ),
            (CHAT, json!({"prompt_logprobs": 0, "stream": true}), Ok(())),
            (CHAT, json!({"prompt_logprobs": 1}), Ok(())),
            (
                COMPLETIONS,
                json!({"prompt_logprobs": 2, "stream": true}),
                Err("`prompt_logprobs` are not available"),
            ),
            (
                COMPLETIONS,
                json!({"logprobs": -1}),
                Err("`logprobs` must be a positive value"),
            ),
            (COMPLETIONS, json!({"logprobs": 5}), Ok(())),
            // The server's --max-logprobs (20).
            (CHAT, json!({"top_logprobs": 20, "logprobs": true}), Ok(())),
            (
                CHAT,
                json!({"top_logprobs": 21, "logprobs": true}),
                Err("Requested sample logprobs of 21, which is greater than max allowed: 20"),
            ),
            (
                CHAT,
                json!({"top_logprobs": -1, "logprobs": true}),
                Err("greater than max allowed: 20"),
            ),
            (
                COMPLETIONS,
                json!({"logprobs": 50}),
                Err("Requested sample logprobs of 50"),
            ),
            (
                COMPLETIONS,
                json!({"prompt_logprobs": 21}),
                Err("Requested prompt logprobs of 21"),
            ),
            // Ranges and types.
            (
                CHAT,
                json!({"max_tokens": 0}),
                Err("max_tokens must be at least 1, got 0"),
            ),
            (
                CHAT,
                json!({"max_completion_tokens": -1}),
                Err("max_completion_tokens must be at least 1"),
            ),
            (
                COMPLETIONS,
                json!({"max_tokens": "abc"}),
                Err("max_tokens: Input should be a valid integer"),
            ),
            (
                COMPLETIONS,
                json!({"max_tokens": 1.5}),
                Err("got a number with a fractional part"),
            ),
            (COMPLETIONS, json!({"max_tokens": "2"}), Ok(())),
            (COMPLETIONS, json!({"max_tokens": 2.0}), Ok(())),
            (CHAT, json!({"n": 0}), Err("n must be at least 1, got 0")),
            (
                CHAT,
                json!({"n": 2, "temperature": 0}),
                Err("n must be 1 when using greedy sampling, got 2"),
            ),
            (CHAT, json!({"n": 2, "temperature": 0.7}), Ok(())),
            (CHAT, json!({"n": 2}), Ok(())),
            (
                CHAT,
                json!({"temperature": 3}),
                Err("temperature must be in [0, 2], got 3"),
            ),
            (
                CHAT,
                json!({"temperature": -0.5}),
                Err("temperature must be non-negative"),
            ),
            (
                CHAT,
                json!({"stop": [""]}),
                Err("stop cannot contain an empty string"),
            ),
            (
                CHAT,
                json!({"stop": ""}),
                Err("stop cannot contain an empty string"),
            ),
            (
                CHAT,
                json!({"stop": 5}),
                Err("stop: Input should be a valid string"),
            ),
            (
                CHAT,
                json!({"stop": ["a", 5]}),
                Err("stop: Input should be a valid string"),
            ),
            (CHAT, json!({"stop": ["a", "b"]}), Ok(())),
            (
                CHAT,
                json!({"stop_token_ids": ["a"]}),
                Err("stop_token_ids: Input should be a valid integer"),
            ),
            (
                CHAT,
                json!({"stop_token_ids": 5}),
                Err("stop_token_ids: Input should be a valid list"),
            ),
            (CHAT, json!({"stop_token_ids": [5, "6"]}), Ok(())),
            (
                CHAT,
                json!({"min_tokens": -1}),
                Err("min_tokens must be greater than or equal to 0"),
            ),
            (
                CHAT,
                json!({"min_tokens": 5, "max_tokens": 4}),
                Err("min_tokens must be less than or equal to max_tokens=4"),
            ),
            // Lax booleans.
            (CHAT, json!({"stream": "yes"}), Ok(())),
            (CHAT, json!({"stream": "true"}), Ok(())),
            (CHAT, json!({"stream": 1}), Ok(())),
            (CHAT, json!({"stream": "on"}), Ok(())),
            (CHAT, json!({"stream": "off"}), Ok(())),
            (
                CHAT,
                json!({"stream": "maybe"}),
                Err("stream: Input should be a valid boolean"),
            ),
            (
                CHAT,
                json!({"stream": 2}),
                Err("stream: Input should be a valid boolean"),
            ),
            (CHAT, json!({"ignore_eos": "no"}), Ok(())),
            (
                CHAT,
                json!({"use_beam_search": "sure"}),
                Err("use_beam_search: Input should be a valid boolean"),
            ),
            // Beam search builds other parameters: no greedy or temperature rule.
            (
                CHAT,
                json!({"use_beam_search": true, "n": 2, "temperature": 0}),
                Ok(()),
            ),
            // Structured output.
            (
                CHAT,
                json!({"response_format": {"type": "json_schema"}}),
                Err("'json_schema' field must be provided"),
            ),
            (
                CHAT,
                json!({"response_format": {"type": "yaml"}}),
                Err("response_format"),
            ),
            (
                CHAT,
                json!({"structured_outputs": {"json": {}, "regex": "a+"}}),
                Err("only use one kind of constraints"),
            ),
            (
                CHAT,
                json!({"response_format": {"type": "json_object"}}),
                Ok(()),
            ),
        ];
        for (endpoint, extra, expected) in table {
            let got = parse(KvMode::Nixl, *endpoint, extra.clone());
            match (expected, &got) {
                (Ok(()), Ok(_)) => {}
                (Err(needle), Err(message)) => {
                    assert!(
                        message.contains(needle),
                        "{extra}: {message:?} lacks {needle:?}"
                    );
                }
                _ => panic!(
                    "{endpoint:?} {extra}: expected {expected:?}, got {:?}",
                    got.map(|_| ())
                ),
            }
        }
    }

    #[test]
    fn every_vllm_mode_uses_vllm_rules_and_sglang_its_own() {
        let vllm = [
            KvMode::Nixl,
            KvMode::NixlPush,
            KvMode::Mooncake(SimRole::Prefill),
            KvMode::Mooncake(SimRole::Decode),
            KvMode::Lmcache(SimRole::Prefill),
            KvMode::Lmcache(SimRole::Decode),
        ];
        let sglang_only = [
            json!({"max_tokens": 0}),
            json!({"n": 0}),
            json!({"temperature": 3}),
            json!({"top_logprobs": 50, "logprobs": true}),
            json!({"top_logprobs": 50}),
        ];
        for extra in &sglang_only {
            for mode in vllm {
                assert!(
                    parse(mode, CHAT, extra.clone()).is_err(),
                    "{mode:?} {extra}"
                );
            }
            for role in [SimRole::Prefill, SimRole::Decode] {
                let parsed = parse(KvMode::Sglang(role), CHAT, extra.clone());
                assert!(parsed.is_ok(), "SGLang {extra}: {parsed:?}");
            }
        }
        // SGLang: no tokens asked, none generated; n: 0 is one choice.
        let r = parse(
            KvMode::Sglang(SimRole::Decode),
            CHAT,
            json!({"max_tokens": 0, "n": 0}),
        )
        .unwrap();
        assert_eq!((r.max_tokens, r.n), (0, 1));
        // Both read lax types the same way.
        for mode in [KvMode::Nixl, KvMode::Sglang(SimRole::Decode)] {
            assert!(parse(mode, CHAT, json!({"stream": "yes"})).unwrap().stream);
            assert!(!parse(mode, CHAT, json!({"stream": "no"})).unwrap().stream);
            assert_eq!(
                parse(mode, CHAT, json!({"max_tokens": "3"}))
                    .unwrap()
                    .max_tokens,
                3
            );
            assert!(parse(mode, CHAT, json!({"max_tokens": "abc"})).is_err());
            assert!(parse(mode, CHAT, json!({"stream": "maybe"})).is_err());
        }
    }

    #[test]
    fn beam_search_and_grammar_are_read() {
        let r = parse(KvMode::Nixl, CHAT, json!({"use_beam_search": "true"})).unwrap();
        assert!(r.beam_search);
        assert!(!r.grammar);
        for extra in [
            json!({"response_format": {"type": "json_object"}}),
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}),
            json!({"structured_outputs": {"regex": "[a-z]+"}}),
            json!({"guided_json": {"type": "object"}}),
            json!({"guided_regex": "a+"}),
            json!({"guided_choice": ["a", "b"]}),
            json!({"guided_grammar": "root ::= \"a\""}),
        ] {
            assert!(
                parse(KvMode::Nixl, CHAT, extra.clone()).unwrap().grammar,
                "{extra}"
            );
            assert!(
                parse(KvMode::Nixl, COMPLETIONS, extra.clone())
                    .unwrap()
                    .grammar,
                "{extra}"
            );
        }
        for extra in [
            json!({"response_format": {"type": "text"}}),
            json!({"response_format": null}),
            json!({"guided_json": null}),
        ] {
            assert!(
                !parse(KvMode::Nixl, CHAT, extra.clone()).unwrap().grammar,
                "{extra}"
            );
        }
    }
}
