//! What a vLLM engine refuses in the fields a prefill rewrite changes, checked before any
//! leg is sent.
//!
//! The rewriter sends the prefill engine other values than the client's for a handful of
//! fields (the token caps, `n`, `stream`, the stop and logprob families, the grammar
//! fields). The prefill engine therefore never sees, and never refuses, a client value
//! that only the decode engine would refuse: without these checks a whole prefill runs,
//! and with NIXL its KV stays pinned until the engine's lease ends, for a request that
//! then fails on its decode leg. So the proxy checks exactly those fields as vLLM 0.33
//! does, and refuses with 400 before routing; every other field reaches both engines
//! unchanged and is left to them.
//!
//! The rules follow vLLM's own code, stage by stage (vllm-project/vllm v0.33.0):
//!
//! - *parse*: the request models' `mode="before"` validators, which read the raw body
//!   with Python truthiness (`check_logprobs`, `validate_stream_options`,
//!   `check_structured_outputs_count`, `validate_response_format` in
//!   `vllm/entrypoints/openai/chat_completion/protocol.py` and
//!   `.../completion/protocol.py`), then pydantic's lax field types (see
//!   `disagg_json::lax`);
//! - *max tokens*: the handler's `get_max_tokens`
//!   (`vllm/entrypoints/serve/utils/api_utils.py`: chat reads
//!   `max_completion_tokens`, else `max_tokens`);
//! - *sampling*: `to_sampling_params` and `SamplingParams._verify_args`,
//!   `_verify_greedy_sampling`, `_validate_logprobs` (`vllm/sampling_params.py`), with
//!   the server's `--max-logprobs` (default 20) and `VLLM_MAX_STOP_STRINGS` (default 4)
//!   as [`VllmLimits`].
//!
//! What the proxy cannot know it leaves to the engines: the prompt's length (a
//! `min_tokens` above the context left), the vocabulary (out-of-range token ids), a
//! server's sampling defaults (a model whose generation config makes sampling greedy),
//! and the inside of a JSON schema or grammar (only the shape of `response_format` and
//! `structured_outputs` is checked). Such a request is refused by the decode after its
//! prefill ran; `KvRelease::AbortDecode` then releases the prefill's KV.

use disagg_core::policy::Decision;
use disagg_core::request::{Api, PdRequest};
use disagg_json::InvalidParam;
use disagg_json::JsonBody;
use disagg_json::lax::{TokenLimit, bool_value, int_value, token_limit, truthy};
use disagg_json::raw as json;

/// Engine settings the checks depend on, as the vLLM servers behind the proxy run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct VllmLimits {
    /// The servers' `--max-logprobs` (vLLM's default 20; `-1` means the vocabulary size,
    /// which the proxy treats as unbounded).
    pub max_logprobs: i64,
    /// The servers' `VLLM_MAX_STOP_STRINGS` (default 4): the longest `stop` list.
    pub max_stop_strings: usize,
}

impl Default for VllmLimits {
    fn default() -> Self {
        VllmLimits {
            max_logprobs: 20,
            max_stop_strings: 4,
        }
    }
}

/// Check `req` as vLLM would, for the fields a prefill rewrite changes, and say whether
/// P/D can carry it (beam search and `echo` without generation go to a decode engine
/// alone, [`Decision::Direct`]). Also the client's own `kv_transfer_params`, which the
/// legs never carry (the connector writes its own) but which vLLM's request model types
/// as an object, so a client's string or number there is refused as vLLM would refuse it.
///
/// Pure and cheap (the top level is already parsed; only the handful of sampling fields
/// are read). A connector calls it from its
/// [`KvConnector::check`](disagg_core::connector::KvConnector::check), with its
/// [`PrefillRewriter::limits`](super::PrefillRewriter::limits) or, building its vLLM legs
/// without the rewriter (LMCache), limits of its own: a request it refuses is answered
/// 400 with no engine contacted.
///
/// # Errors
///
/// [`InvalidParam`] naming the field vLLM would refuse, and why.
///
/// # Examples
///
/// ```
/// use disagg_core::policy::Decision;
/// use disagg_core::request::{Api, PdRequest};
/// use disagg_connectors::vllm::rewrite::check::check_request;
/// use disagg_connectors::vllm::rewrite::check::VllmLimits;
///
/// let limits = VllmLimits::default();
/// let bad = PdRequest::new(Api::Chat, Default::default(), &r#"{"messages":[],"max_tokens":-1}"#.into())?;
/// assert_eq!(check_request(&bad, &limits).unwrap_err().param, "max_tokens");
/// let beam = PdRequest::new(Api::Completions, Default::default(), &r#"{"prompt":"p","use_beam_search":true}"#.into())?;
/// assert!(matches!(check_request(&beam, &limits), Ok(Decision::Direct { .. })));
/// # Ok::<(), disagg_json::BodyError>(())
/// ```
pub fn check_request(req: &PdRequest, limits: &VllmLimits) -> Result<Decision, InvalidParam> {
    if req.api() == disagg_core::request::Api::Generate {
        // SGLang's API, not vLLM's: a vLLM connector refuses it when it plans the legs
        // (`unsupported_by_connector`), whatever its fields.
        return Ok(Decision::Disaggregate);
    }
    if let Some(raw) = disagg_core::proto::client_handoff(req, "kv_transfer_params")
        && raw.first() != Some(&b'{')
        && raw != b"null"
    {
        return Err(InvalidParam::new(
            "kv_transfer_params",
            "kv_transfer_params: Input should be a valid dictionary",
        ));
    }
    // The handoff spelled inside `vllm_xargs` was removed too; vLLM takes a string, a
    // number or a list of them there, and refuses the body for anything else.
    for field in [
        "vllm_xargs.kv_transfer_params",
        "vllm_xargs.ec_transfer_params",
    ] {
        if let Some(raw) = disagg_core::proto::client_handoff(req, field)
            && !xarg_value(raw)
        {
            return Err(InvalidParam::new(
                "vllm_xargs",
                "vllm_xargs: Input should be a valid string, number or list of them",
            ));
        }
    }
    match req.api() {
        Api::TokenGenerate => return super::token_in::check(req.body(), limits),
        Api::Messages => return super::messages::check(req.body()),
        Api::Responses => return super::responses::check(req.body()),
        Api::CohereChat => return super::cohere::check(req.body()),
        _ => {}
    }
    check(req.api(), req.body(), limits)
}

/// Whether vLLM's `vllm_xargs` takes `raw` as a value (`dict[str, str | int | float |
/// list[str | int | float]]`): not an object, not `null`, not a list holding either or
/// a list. A list is walked, not collected.
fn xarg_value(raw: &[u8]) -> bool {
    let scalar = |v: &[u8]| !matches!(v.first(), Some(b'{' | b'[' | b'n'));
    match raw.first() {
        Some(b'[') => std::str::from_utf8(raw).is_ok_and(|text| {
            let mut all = true;
            json::elements(text, |item| all &= scalar(item.get().as_bytes())).is_ok() && all
        }),
        _ => scalar(raw),
    }
}

/// vLLM's `_SAMPLING_EPS`: a temperature below it samples greedily.
const SAMPLING_EPS: f64 = 1e-5;
/// vLLM's `MAX_LOGPROB_TOKEN_IDS`.
const MAX_LOGPROB_TOKEN_IDS: usize = 128;

/// Why the proxy serves a request on a decode engine alone: vLLM builds beam-search
/// parameters for it, which carry no `kv_transfer_params`, so neither leg's handoff
/// would be read (`chat_completion/serving.py`: `to_beam_search_params`).
pub(crate) const BEAM_SEARCH: &str = "beam_search";
/// Why the proxy serves a request on a decode engine alone: a completions request with
/// `echo` and `max_tokens: 0` generates nothing (vLLM answers with the prompt only), so
/// there is no decode for a KV handoff to feed.
pub(crate) const PROMPT_ONLY: &str = "prompt_only";

/// Why the proxy serves a request on a decode engine alone: a completions request of
/// several prompts (`prompt` a list of strings or of token-id lists) runs them all on
/// the prefill, whose non-streaming answer carries only prompt 0's
/// `kv_transfer_params` (vLLM 0.33 `completion/serving.py`: `final_res_batch[0]`), so
/// the other prompts' KV would be pinned on the prefill for nothing while the decode
/// read prompt 0's handoff for all of them (Mooncake: one `transfer_id` for all).
pub(crate) const BATCH: &str = "batch";

/// [`check_request`] as the vLLM connectors whose handoff is one dict per request
/// (NIXL, Mooncake) take it: a completions request of more than one prompt is served
/// on one engine too ([`BATCH`]); a list of one prompt is one prompt. The field checks
/// come first, as for any request.
pub(crate) fn check_one_handoff(
    req: &PdRequest,
    limits: &VllmLimits,
) -> Result<Decision, InvalidParam> {
    let decision = check_request(req, limits)?;
    if decision == Decision::Disaggregate
        && req.api() == Api::Completions
        && crate::common::several_prompts(req.body())
    {
        return Ok(Decision::Direct { reason: BATCH });
    }
    Ok(decision)
}

/// The raw values of the fields the checks read, gathered in one pass over the body
/// (a search per field would cost more than the checks).
#[derive(Default)]
struct Fields<'a> {
    use_beam_search: Option<&'a [u8]>,
    stream: Option<&'a [u8]>,
    stream_options: Option<&'a [u8]>,
    max_tokens: Option<&'a [u8]>,
    max_completion_tokens: Option<&'a [u8]>,
    min_tokens: Option<&'a [u8]>,
    n: Option<&'a [u8]>,
    stop: Option<&'a [u8]>,
    stop_token_ids: Option<&'a [u8]>,
    include_stop_str_in_output: Option<&'a [u8]>,
    ignore_eos: Option<&'a [u8]>,
    logprobs: Option<&'a [u8]>,
    top_logprobs: Option<&'a [u8]>,
    logprob_token_ids: Option<&'a [u8]>,
    prompt_logprobs: Option<&'a [u8]>,
    echo: Option<&'a [u8]>,
    temperature: Option<&'a [u8]>,
    response_format: Option<&'a [u8]>,
    structured_outputs: Option<&'a [u8]>,
    tool_choice: Option<&'a [u8]>,
}

impl<'a> Fields<'a> {
    fn of(body: &'a JsonBody) -> Self {
        let mut f = Fields::default();
        for (key, value) in body.fields() {
            let slot = match key {
                b"use_beam_search" => &mut f.use_beam_search,
                b"stream" => &mut f.stream,
                b"stream_options" => &mut f.stream_options,
                b"max_tokens" => &mut f.max_tokens,
                b"max_completion_tokens" => &mut f.max_completion_tokens,
                b"min_tokens" => &mut f.min_tokens,
                b"n" => &mut f.n,
                b"stop" => &mut f.stop,
                b"stop_token_ids" => &mut f.stop_token_ids,
                b"include_stop_str_in_output" => &mut f.include_stop_str_in_output,
                b"ignore_eos" => &mut f.ignore_eos,
                b"logprobs" => &mut f.logprobs,
                b"top_logprobs" => &mut f.top_logprobs,
                b"logprob_token_ids" => &mut f.logprob_token_ids,
                b"prompt_logprobs" => &mut f.prompt_logprobs,
                b"echo" => &mut f.echo,
                b"temperature" => &mut f.temperature,
                b"response_format" => &mut f.response_format,
                b"structured_outputs" => &mut f.structured_outputs,
                b"tool_choice" => &mut f.tool_choice,
                _ => continue,
            };
            *slot = Some(value);
        }
        f
    }
}

/// [`check_request`] on the body alone: `body` of `api`, checked as vLLM would check it.
pub(crate) fn check(
    api: Api,
    body: &JsonBody,
    limits: &VllmLimits,
) -> Result<Decision, InvalidParam> {
    let chat = api == Api::Chat;
    let f = Fields::of(body);
    if matches!(f.use_beam_search.map(bool_value), Some(Ok(Some(true)))) {
        // The body goes to the decode engine untouched, which checks it itself.
        return Ok(Decision::Direct {
            reason: BEAM_SEARCH,
        });
    }

    // Parse stage, `mode="before"` validators on the raw body.
    if truthy(f.stream_options) && !truthy(f.stream) {
        return Err(InvalidParam::new(
            "stream_options",
            "Stream options can only be defined when `stream=True`.",
        ));
    }
    if truthy(f.logprob_token_ids) {
        if chat && !truthy(f.logprobs) {
            return Err(InvalidParam::new(
                "logprob_token_ids",
                "when using `logprob_token_ids`, `logprobs` must be set to true.",
            ));
        }
        if !chat {
            if truthy(f.echo) && f.max_tokens == Some(b"0") {
                return Err(InvalidParam::new(
                    "logprob_token_ids",
                    "`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because no output tokens are generated.",
                ));
            }
            if f.logprobs.is_none_or(|v| v == b"null") {
                return Err(InvalidParam::new(
                    "logprob_token_ids",
                    "when using `logprob_token_ids`, `logprobs` must be set.",
                ));
            }
        }
    }
    let counts = if chat {
        [
            ("prompt_logprobs", f.prompt_logprobs),
            ("top_logprobs", f.top_logprobs),
        ]
    } else {
        [
            ("prompt_logprobs", f.prompt_logprobs),
            ("logprobs", f.logprobs),
        ]
    };
    for (field, raw) in counts {
        if let Some(v) = raw
            && v != b"null"
            && number(v).is_none()
        {
            return Err(InvalidParam::new(
                field,
                format!("`{field}` must be an integer."),
            ));
        }
    }
    if let Some(pl) = f.prompt_logprobs.and_then(number) {
        if truthy(f.stream) && (pl > 0.0 || pl == -1.0) {
            return Err(InvalidParam::new(
                "prompt_logprobs",
                "`prompt_logprobs` are not available when `stream=True`.",
            ));
        }
        if pl < 0.0 && pl != -1.0 {
            return Err(InvalidParam::new(
                "prompt_logprobs",
                "`prompt_logprobs` must be a positive value or -1.",
            ));
        }
    }
    if chat {
        if let Some(tl) = f.top_logprobs.and_then(number) {
            if tl < 0.0 && tl != -1.0 {
                return Err(InvalidParam::new(
                    "top_logprobs",
                    "`top_logprobs` must be a positive value or -1.",
                ));
            }
            if (tl == -1.0 || tl > 0.0) && !truthy(f.logprobs) {
                return Err(InvalidParam::new(
                    "top_logprobs",
                    "when using `top_logprobs`, `logprobs` must be set to true.",
                ));
            }
        }
    } else if let Some(lp) = f.logprobs.and_then(number)
        && lp < 0.0
        && lp != -1.0
    {
        return Err(InvalidParam::new(
            "logprobs",
            "`logprobs` must be a positive value or -1.",
        ));
    }
    check_grammar(chat, &f)?;

    // Parse stage, pydantic's lax field types.
    opt_bool("stream", f.stream)?;
    check_stream_options(f.stream_options)?;
    let limit = token_limit(f.max_completion_tokens, f.max_tokens, chat)
        .map_err(|e| type_error(e.key, "integer"))?;
    let min_tokens = int_not_null("min_tokens", f.min_tokens)?.unwrap_or(0);
    let n = if chat {
        opt_int("n", f.n)?
    } else {
        int_not_null("n", f.n)?
    }
    .unwrap_or(1);
    let stop_empty = stop_strings(f.stop, limits)?;
    let logprob_token_ids = int_list("logprob_token_ids", f.logprob_token_ids)?;
    int_list("stop_token_ids", f.stop_token_ids)?;
    bool_not_null("include_stop_str_in_output", f.include_stop_str_in_output)?;
    bool_not_null("ignore_eos", f.ignore_eos)?;
    let echo = if chat {
        bool_not_null("echo", f.echo)?
    } else {
        opt_bool("echo", f.echo)?
    }
    .unwrap_or(false);
    let logprobs_on = if chat {
        opt_bool("logprobs", f.logprobs)?.unwrap_or(false)
    } else {
        false
    };
    let top_logprobs = if chat {
        opt_int("top_logprobs", f.top_logprobs)?.unwrap_or(0)
    } else {
        0
    };
    let logprobs_count = if chat {
        None
    } else {
        opt_int("logprobs", f.logprobs)?
    };
    let prompt_logprobs = opt_int("prompt_logprobs", f.prompt_logprobs)?;
    let temperature = opt_float("temperature", f.temperature)?;

    // Max tokens, as the handler resolves them (`lax::token_limit`): chat's
    // `max_completion_tokens` unless `null` (a 0 there is refused below, naming it),
    // else `max_tokens`; completions' `max_tokens: int | None = 16`, 16 when the key is
    // absent. The key a refusal names is the one the limit was read from.
    let (requested, param) = match limit.limit {
        _ if limit.zero_completion_tokens => (Some(0), "max_completion_tokens"),
        TokenLimit::RestOfContext => (None, "max_tokens"),
        TokenLimit::Tokens { n, key } => (Some(n), key),
        TokenLimit::CompletionsNull => {
            // A `null` passes vLLM's request model, but its completions handler asserts
            // a number for every output (`completion_stream_generator`,
            // `request_output_to_completion_response`): the decode would fail after
            // generating (an error event, or a 500) and be blamed for it. Refused here,
            // with the remedy.
            return Err(InvalidParam::new(
                "max_tokens",
                "max_tokens must be a number on the completions API (vLLM's completions \
                 handler fails on null); leave it out for 16, or give the limit",
            ));
        }
    };
    if !chat && echo && requested == Some(0) {
        return Ok(Decision::Direct {
            reason: PROMPT_ONLY,
        });
    }

    // Sampling stage.
    if let Some(m) = requested
        && m < 1
    {
        return Err(InvalidParam::new(
            param,
            format!("max_tokens must be at least 1, got {m}."),
        ));
    }
    if min_tokens < 0 {
        return Err(InvalidParam::new(
            "min_tokens",
            format!("min_tokens must be greater than or equal to 0, got {min_tokens}."),
        ));
    }
    if let Some(m) = requested
        && min_tokens > m
    {
        return Err(InvalidParam::new(
            "min_tokens",
            format!("min_tokens must be less than or equal to max_tokens={m}, got {min_tokens}."),
        ));
    }
    if n < 1 {
        return Err(InvalidParam::new(
            "n",
            format!("n must be at least 1, got {n}."),
        ));
    }
    // vLLM's default temperature is 1.0 (a server's generation config may lower it; the
    // proxy cannot see that).
    if n > 1 && temperature.unwrap_or(1.0) < SAMPLING_EPS {
        return Err(InvalidParam::new(
            "n",
            format!("n must be 1 when using greedy sampling, got {n}."),
        ));
    }
    if stop_empty {
        return Err(InvalidParam::new(
            "stop",
            "stop cannot contain an empty string.",
        ));
    }
    if let Some(len) = logprob_token_ids
        && len > MAX_LOGPROB_TOKEN_IDS
    {
        return Err(InvalidParam::new(
            "logprob_token_ids",
            format!(
                "Requested logprob_token_ids of length {len}, which is greater than max allowed: {MAX_LOGPROB_TOKEN_IDS}",
            ),
        ));
    }
    let has_ids = logprob_token_ids.is_some_and(|len| len > 0);
    let sample = match (chat, has_ids) {
        (_, true) => None,
        (true, false) => logprobs_on.then_some(top_logprobs),
        (false, false) => logprobs_count,
    };
    let prompt = prompt_logprobs.or(if !echo {
        None
    } else if chat {
        Some(top_logprobs)
    } else {
        logprobs_count
    });
    if let Some(n) = sample.filter(|n| *n != 0) {
        if n < 0 && n != -1 {
            return Err(InvalidParam::new(
                "logprobs",
                format!("logprobs must be non-negative or -1, got {n}."),
            ));
        }
        over_max("sample", "logprobs", n, limits)?;
    }
    if let Some(n) = prompt.filter(|n| *n != 0) {
        if n < 0 && n != -1 {
            return Err(InvalidParam::new(
                "prompt_logprobs",
                format!("prompt_logprobs must be non-negative or -1, got {n}."),
            ));
        }
        over_max("prompt", "prompt_logprobs", n, limits)?;
    }
    Ok(Decision::Disaggregate)
}

/// Refuse `n` logprobs above the servers' `--max-logprobs` (`-1` asks for the whole
/// vocabulary, which only an unbounded server allows).
fn over_max(
    kind: &str,
    param: &'static str,
    n: i64,
    limits: &VllmLimits,
) -> Result<(), InvalidParam> {
    if limits.max_logprobs == -1 {
        return Ok(());
    }
    if n == -1 || n > limits.max_logprobs {
        let asked = if n == -1 {
            "the whole vocabulary".to_owned()
        } else {
            n.to_string()
        };
        return Err(InvalidParam::new(
            param,
            format!(
                "Requested {kind} logprobs of {asked}, which is greater than max allowed: {}",
                limits.max_logprobs
            ),
        ));
    }
    Ok(())
}

/// The shape of the grammar fields, as vLLM's `mode="before"` validators check it; the
/// rewriter removes these fields from prefill legs whose token is discarded.
fn check_grammar(chat: bool, f: &Fields<'_>) -> Result<(), InvalidParam> {
    if let Some(raw) = f.response_format.filter(|v| *v != b"null") {
        #[derive(serde::Deserialize)]
        struct Format<'a> {
            #[serde(rename = "type", borrow)]
            kind: Option<&'a str>,
            #[serde(borrow)]
            json_schema: Option<&'a serde_json::value::RawValue>,
        }
        let format: Format<'_> = serde_json::from_slice(raw).map_err(|_| {
            InvalidParam::new(
                "response_format",
                "response_format: Input should be a valid dictionary",
            )
        })?;
        match format.kind {
            Some("text" | "json_object" | "structural_tag") => {}
            Some("json_schema") => {
                if format.json_schema.is_none_or(|s| s.get() == "null") {
                    return Err(InvalidParam::new(
                        "response_format",
                        "When response_format type is 'json_schema', the 'json_schema' field must be provided.",
                    ));
                }
            }
            _ => {
                return Err(InvalidParam::new(
                    "response_format",
                    "response_format: type must be one of 'text', 'json_object', 'json_schema', 'structural_tag'",
                ));
            }
        }
    }
    if let Some(raw) = f.structured_outputs.filter(|v| *v != b"null") {
        // Read member by member, nothing built: a client's `{"json":[0,0,...]}` is no
        // `Value` per element (a repeated key: the last counts, as in a dict).
        let not_a_dict = || {
            InvalidParam::new(
                "structured_outputs",
                "structured_outputs: Input should be a valid dictionary",
            )
        };
        let text = std::str::from_utf8(raw).map_err(|_| not_a_dict())?;
        let set =
            json::members_named(text, ["json", "regex", "choice"]).map_err(|_| not_a_dict())?;
        let count = set.iter().flatten().filter(|v| v.get() != "null").count();
        if count > 1 {
            return Err(InvalidParam::new(
                "structured_outputs",
                "You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice').",
            ));
        }
        // `SamplingParams._validate_structured_outputs`.
        if set[2]
            .and_then(|c| json::list_head(c.get().as_bytes()))
            .is_some_and(|l| l.len == 0)
        {
            return Err(InvalidParam::new(
                "structured_outputs",
                "Choice '[]' cannot be an empty list",
            ));
        }
        if chat && count > 0 {
            let choice = f.tool_choice.unwrap_or(br#""none""#);
            if !matches!(choice, br#""none""# | br#""auto""# | br#""required""#) {
                return Err(InvalidParam::new(
                    "structured_outputs",
                    "You can only either use constraints for structured outputs or tools, not both.",
                ));
            }
        }
    }
    Ok(())
}

fn check_stream_options(raw: Option<&[u8]>) -> Result<(), InvalidParam> {
    let Some(raw) = raw.filter(|v| *v != b"null") else {
        return Ok(());
    };
    let not_a_dict = || {
        InvalidParam::new(
            "stream_options",
            "stream_options: Input should be a valid dictionary",
        )
    };
    let text = std::str::from_utf8(raw).map_err(|_| not_a_dict())?;
    // The last of a repeated key counts, as in a dict.
    let keys = ["include_usage", "continuous_usage_stats"];
    let set = json::members_named(text, keys).map_err(|_| not_a_dict())?;
    for (key, v) in keys.iter().zip(set) {
        if let Some(v) = v
            && bool_value(v.get().as_bytes()).is_err()
        {
            return Err(InvalidParam::new(
                "stream_options",
                format!("stream_options.{key}: Input should be a valid boolean"),
            ));
        }
    }
    Ok(())
}

/// A raw JSON number (booleans count: Python's `bool` is an `int`), as vLLM's
/// `isinstance(value, (int, float))` accepts it.
fn number(raw: &[u8]) -> Option<f64> {
    match raw {
        b"true" => Some(1.0),
        b"false" => Some(0.0),
        _ => serde_json::from_slice::<f64>(raw).ok(),
    }
}

fn type_error(field: &'static str, expected: &str) -> InvalidParam {
    InvalidParam::new(
        field,
        format!("{field}: Input should be a valid {expected}"),
    )
}

pub(super) fn opt_bool(
    field: &'static str,
    raw: Option<&[u8]>,
) -> Result<Option<bool>, InvalidParam> {
    raw.map_or(Ok(None), |raw| {
        bool_value(raw).map_err(|_| type_error(field, "boolean"))
    })
}

/// An optional list of strings (`null` allowed), as pydantic reads `list[str] | None`.
pub(super) fn opt_string_list(field: &'static str, raw: Option<&[u8]>) -> Result<(), InvalidParam> {
    let Some(raw) = raw.filter(|v| *v != b"null") else {
        return Ok(());
    };
    let mut strings = true;
    // Each element read on its own, none kept: no `Vec` of the client's list.
    let listed = strings_of(raw, |_| {}).map(|all| strings = all);
    match listed {
        Ok(()) if strings => Ok(()),
        _ => Err(type_error(field, "list of strings")),
    }
}

/// Walks the JSON list `raw`, calling `each` with every element that is a string (as
/// `String` reads it, lone surrogates refused); `Ok(false)` when one is not. One
/// element is built at a time.
fn strings_of(raw: &[u8], mut each: impl FnMut(&str)) -> Result<bool, ()> {
    let text = std::str::from_utf8(raw).map_err(|_| ())?;
    if !text.starts_with('[') {
        return Err(());
    }
    let mut all = true;
    json::elements(text, |v| match serde_json::from_str::<String>(v.get()) {
        Ok(s) if all => each(&s),
        Ok(_) => {}
        Err(_) => all = false,
    })
    .map_err(|_| ())?;
    Ok(all)
}

/// A `bool` field without `None` in its type: `null` is refused too.
fn bool_not_null(field: &'static str, raw: Option<&[u8]>) -> Result<Option<bool>, InvalidParam> {
    match opt_bool(field, raw)? {
        None if raw.is_some() => Err(type_error(field, "boolean")),
        v => Ok(v),
    }
}

fn opt_int(field: &'static str, raw: Option<&[u8]>) -> Result<Option<i64>, InvalidParam> {
    raw.map_or(Ok(None), |raw| {
        int_value(raw).map_err(|_| type_error(field, "integer"))
    })
}

/// An `int` field without `None` in its type: `null` is refused too.
fn int_not_null(field: &'static str, raw: Option<&[u8]>) -> Result<Option<i64>, InvalidParam> {
    match opt_int(field, raw)? {
        None if raw.is_some() => Err(type_error(field, "integer")),
        v => Ok(v),
    }
}

fn opt_float(field: &'static str, raw: Option<&[u8]>) -> Result<Option<f64>, InvalidParam> {
    let Some(raw) = raw.filter(|v| *v != b"null") else {
        return Ok(None);
    };
    if let Some(n) = number(raw) {
        return Ok(Some(n));
    }
    // Pydantic's lax float also takes numeric strings.
    serde_json::from_slice::<String>(raw)
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .map(Some)
        .ok_or_else(|| type_error(field, "number"))
}

/// `list[int] | None` with lax elements: its length. The elements are read one by one,
/// none kept.
fn int_list(field: &'static str, raw: Option<&[u8]>) -> Result<Option<usize>, InvalidParam> {
    let Some(raw) = raw.filter(|v| *v != b"null") else {
        return Ok(None);
    };
    let text = std::str::from_utf8(raw)
        .ok()
        .filter(|t| t.starts_with('['))
        .ok_or_else(|| type_error(field, "list"))?;
    let (mut len, mut ints) = (0usize, true);
    json::elements(text, |item| {
        len += 1;
        ints &= matches!(int_value(item.get().as_bytes()), Ok(Some(_)));
    })
    .map_err(|_| type_error(field, "list"))?;
    if !ints {
        return Err(InvalidParam::new(
            field,
            format!("{field}: Input should be a valid list of integers"),
        ));
    }
    Ok(Some(len))
}

/// `stop`: `str | list[str] | None`, the list at most `max_stop_strings` long: whether
/// a stop string is empty. The list's strings are read one by one, none kept.
fn stop_strings(raw: Option<&[u8]>, limits: &VllmLimits) -> Result<bool, InvalidParam> {
    let Some(raw) = raw.filter(|v| *v != b"null") else {
        return Ok(false);
    };
    let bad = || {
        InvalidParam::new(
            "stop",
            "stop: Input should be a valid string or a list of strings",
        )
    };
    match raw.first() {
        Some(b'"') => Ok(serde_json::from_slice::<String>(raw)
            .map_err(|_| bad())?
            .is_empty()),
        Some(b'[') => {
            let (mut len, mut empty) = (0usize, false);
            let all = strings_of(raw, |s| {
                len += 1;
                empty |= s.is_empty();
            })
            .map_err(|_| bad())?;
            if !all {
                return Err(bad());
            }
            if len > limits.max_stop_strings {
                return Err(InvalidParam::new(
                    "stop",
                    format!(
                        "stop: List should have at most {} items after validation, not {len}",
                        limits.max_stop_strings,
                    ),
                ));
            }
            Ok(empty)
        }
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `check` says of `extra` added to a minimal body: `"ok"`, `"direct:REASON"`
    /// or the refused param.
    fn verdict(api: Api, extra: &str) -> String {
        let base = match api {
            Api::Chat => r#"{"model":"m","messages":[{"role":"user","content":"hi"}]"#,
            Api::Completions => r#"{"model":"m","prompt":"hi""#,
            Api::Generate => r#"{"model":"m","text":"hi""#,
            _ => unreachable!("no other API in the table"),
        };
        let sep = if extra.is_empty() { "" } else { "," };
        let body = JsonBody::parse(format!("{base}{sep}{extra}}}").as_bytes()).unwrap();
        match check(api, &body, &VllmLimits::default()) {
            Ok(Decision::Disaggregate) => "ok".to_owned(),
            Ok(Decision::Direct { reason }) => format!("direct:{reason}"),
            Ok(other) => format!("{other:?}"),
            Err(e) => e.param.to_owned(),
        }
    }

    /// The handoff spelled in `vllm_xargs` is removed from the legs; what vLLM would
    /// refuse there (`dict[str, str | int | float | list[...]]`) is refused as vLLM
    /// refuses it, what it would take passes.
    #[test]
    fn a_nested_handoff_of_a_type_vllm_refuses_is_refused() {
        let of = |xargs: &str| {
            let body = format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"vllm_xargs":{xargs}}}"#
            );
            let req = PdRequest::new(Api::Chat, Default::default(), &body.into()).unwrap();
            match check_request(&req, &VllmLimits::default()) {
                Ok(_) => "ok".to_owned(),
                Err(e) => e.param.to_owned(),
            }
        };
        for taken in [
            r#"{"kv_transfer_params":"x"}"#,
            r#"{"kv_transfer_params":1e400}"#,
            r#"{"ec_transfer_params":[1,"a",2.5]}"#,
            r#"{"ec_transfer_params":[]}"#,
            r#"{"kv_transfer_params":true,"mine":{"a":1}}"#,
        ] {
            assert_eq!(of(taken), "ok", "{taken}");
        }
        for refused in [
            r#"{"kv_transfer_params":{"remote_host":"evil"}}"#,
            r#"{"kv_transfer_params":null}"#,
            r#"{"ec_transfer_params":[{"a":1}]}"#,
            r#"{"kv_transfer_params":[[1]]}"#,
            r#"{"kv_transfer_params":[1,"a",null]}"#,
            r#"{"kv_transfer_params":[1,2,{"a":1},3]}"#,
        ] {
            assert_eq!(of(refused), "vllm_xargs", "{refused}");
        }
    }

    /// Each row was checked against vLLM 0.33's own request models and sampling code.
    #[test]
    fn rule_table() {
        use Api::{Chat, Completions as Cmpl};
        let rows: &[(Api, &str, &str)] = &[
            (Chat, "", "ok"),
            // Token caps: integers (lax) of at least 1; chat reads max_completion_tokens
            // first.
            (Chat, r#""max_tokens":5"#, "ok"),
            (Chat, r#""max_tokens":"5""#, "ok"),
            (Chat, r#""max_tokens":5.0"#, "ok"),
            (Chat, r#""max_tokens":null"#, "ok"),
            (Chat, r#""max_tokens":-1"#, "max_tokens"),
            (Chat, r#""max_tokens":0"#, "max_tokens"),
            (Chat, r#""max_tokens":"abc""#, "max_tokens"),
            (Chat, r#""max_tokens":1.5"#, "max_tokens"),
            (
                Chat,
                r#""max_completion_tokens":0"#,
                "max_completion_tokens",
            ),
            (
                Chat,
                r#""max_completion_tokens":-5"#,
                "max_completion_tokens",
            ),
            (Chat, r#""max_tokens":-1,"max_completion_tokens":5"#, "ok"),
            (
                Chat,
                r#""max_tokens":"x","max_completion_tokens":5"#,
                "max_tokens",
            ),
            // A completions `null` passes vLLM's model but fails its handler at the
            // first output (an assert): refused before any leg (see `check`).
            (Cmpl, r#""max_tokens":null"#, "max_tokens"),
            (Cmpl, r#""max_tokens":0"#, "max_tokens"),
            // min_tokens: an integer, not null, within [0, max_tokens].
            (Chat, r#""min_tokens":3,"max_tokens":5"#, "ok"),
            (Chat, r#""min_tokens":-1"#, "min_tokens"),
            (Chat, r#""min_tokens":6,"max_tokens":5"#, "min_tokens"),
            (Chat, r#""min_tokens":null"#, "min_tokens"),
            // Completions' `max_tokens` is 16 when absent (read from
            // `CompletionRequest.max_tokens: int | None = 16`); a `null` is refused.
            (Cmpl, r#""min_tokens":16"#, "ok"),
            (Cmpl, r#""min_tokens":17"#, "min_tokens"),
            (Cmpl, r#""max_tokens":null,"min_tokens":20"#, "max_tokens"),
            (Chat, r#""min_tokens":20"#, "ok"),
            // n: at least 1, and 1 under greedy sampling; completions' n is not nullable.
            (Chat, r#""n":"2""#, "ok"),
            (Chat, r#""n":null"#, "ok"),
            (Chat, r#""n":0"#, "n"),
            (Chat, r#""n":-1"#, "n"),
            (Chat, r#""n":"two""#, "n"),
            (Chat, r#""n":2,"temperature":0"#, "n"),
            (Chat, r#""n":2,"temperature":0.5"#, "ok"),
            (Cmpl, r#""n":null"#, "n"),
            // stream and stream_options.
            (Chat, r#""stream":"yes""#, "ok"),
            (Chat, r#""stream":1"#, "ok"),
            (Chat, r#""stream":2"#, "stream"),
            (
                Chat,
                r#""stream_options":{"include_usage":true}"#,
                "stream_options",
            ),
            (
                Chat,
                r#""stream":true,"stream_options":{"include_usage":true}"#,
                "ok",
            ),
            (
                Chat,
                r#""stream":true,"stream_options":5"#,
                "stream_options",
            ),
            (Chat, r#""stream":false,"stream_options":{}"#, "ok"),
            // Stops.
            (Chat, r#""stop":"x""#, "ok"),
            (Chat, r#""stop":["a","b"]"#, "ok"),
            (Chat, r#""stop":5"#, "stop"),
            (Chat, r#""stop":[""]"#, "stop"),
            (Chat, r#""stop":"""#, "stop"),
            (Chat, r#""stop":["a","b","c","d","e"]"#, "stop"),
            (Chat, r#""stop_token_ids":[1,"2"]"#, "ok"),
            (Chat, r#""stop_token_ids":["a"]"#, "stop_token_ids"),
            (Chat, r#""stop_token_ids":5"#, "stop_token_ids"),
            (Chat, r#""stop":["a",5]"#, "stop"),
            (Chat, r#""stop":["a",""]"#, "stop"),
            (Chat, r#""ignore_eos":"maybe""#, "ignore_eos"),
            (Chat, r#""ignore_eos":null"#, "ignore_eos"),
            (Chat, r#""include_stop_str_in_output":"yes""#, "ok"),
            // Logprobs, chat.
            (Chat, r#""logprobs":true,"top_logprobs":5"#, "ok"),
            (Chat, r#""top_logprobs":5"#, "top_logprobs"),
            (Chat, r#""top_logprobs":0"#, "ok"),
            (Chat, r#""logprobs":true,"top_logprobs":-2"#, "top_logprobs"),
            (
                Chat,
                r#""logprobs":true,"top_logprobs":"5""#,
                "top_logprobs",
            ),
            (Chat, r#""logprobs":true,"top_logprobs":21"#, "logprobs"),
            (Chat, r#""logprobs":true,"top_logprobs":-1"#, "logprobs"),
            (Chat, r#""logprobs":true,"logprob_token_ids":[5,6]"#, "ok"),
            (Chat, r#""logprob_token_ids":[5,6]"#, "logprob_token_ids"),
            (Chat, r#""prompt_logprobs":1"#, "ok"),
            (
                Chat,
                r#""prompt_logprobs":1,"stream":true"#,
                "prompt_logprobs",
            ),
            (Chat, r#""prompt_logprobs":0,"stream":true"#, "ok"),
            (Chat, r#""prompt_logprobs":-3"#, "prompt_logprobs"),
            (Chat, r#""prompt_logprobs":25"#, "prompt_logprobs"),
            (
                Chat,
                r#""echo":true,"logprobs":true,"top_logprobs":21"#,
                "logprobs",
            ),
            // Logprobs, completions.
            (Cmpl, r#""logprobs":3"#, "ok"),
            (Cmpl, r#""logprobs":-5"#, "logprobs"),
            (Cmpl, r#""logprobs":"3""#, "logprobs"),
            (Cmpl, r#""logprobs":21"#, "logprobs"),
            (Cmpl, r#""logprob_token_ids":[5]"#, "logprob_token_ids"),
            (Cmpl, r#""logprob_token_ids":[5],"logprobs":0"#, "ok"),
            // Grammars: their shape.
            (Chat, r#""response_format":{"type":"json_object"}"#, "ok"),
            (
                Chat,
                r#""response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{}}}"#,
                "ok",
            ),
            (
                Chat,
                r#""response_format":{"type":"json_schema"}"#,
                "response_format",
            ),
            (
                Chat,
                r#""response_format":{"type":"yaml"}"#,
                "response_format",
            ),
            (Chat, r#""structured_outputs":{"regex":"a+"}"#, "ok"),
            (
                Chat,
                r#""structured_outputs":{"choice":[]}"#,
                "structured_outputs",
            ),
            (Chat, r#""structured_outputs":{"choice":["a","b"]}"#, "ok"),
            // As a dict reads them: the last of a repeated key counts.
            (
                Chat,
                r#""structured_outputs":{"regex":"a+","choice":["a"],"choice":null}"#,
                "ok",
            ),
            (
                Chat,
                r#""structured_outputs":{"choice":["a"],"choice":[]}"#,
                "structured_outputs",
            ),
            (Chat, r#""structured_outputs":5"#, "structured_outputs"),
            (Chat, r#""structured_outputs":{"json":{"x":1e400}}"#, "ok"),
            (
                Chat,
                r#""stream":true,"stream_options":{"include_usage":"yes"}"#,
                "ok",
            ),
            (
                Chat,
                r#""stream":true,"stream_options":{"include_usage":true,"include_usage":2}"#,
                "stream_options",
            ),
            (
                Chat,
                r#""stream":true,"stream_options":[]"#,
                "stream_options",
            ),
            (
                Chat,
                r#""structured_outputs":{"regex":"a+","choice":["a"]}"#,
                "structured_outputs",
            ),
            (
                Chat,
                r#""structured_outputs":{"regex":"a+"},"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":{"type":"function","function":{"name":"f"}}"#,
                "structured_outputs",
            ),
            // Requests P/D cannot carry.
            (
                Chat,
                r#""use_beam_search":true,"n":2"#,
                "direct:beam_search",
            ),
            (Cmpl, r#""use_beam_search":"yes""#, "direct:beam_search"),
            (Cmpl, r#""use_beam_search":false"#, "ok"),
            (Cmpl, r#""echo":true,"max_tokens":0"#, "direct:prompt_only"),
        ];
        for (api, extra, want) in rows {
            assert_eq!(&verdict(*api, extra), want, "{api:?} {extra}");
        }
    }

    /// Long lists are walked, not collected, and refused naming their length.
    #[test]
    fn long_lists_are_counted_as_they_are_read() {
        let stops = vec![r#""s""#; 1_000_000].join(",");
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"stop":[{stops}]}}"#
        );
        let e = check(
            Api::Chat,
            &JsonBody::parse(body.as_bytes()).unwrap(),
            &VllmLimits::default(),
        )
        .unwrap_err();
        assert!(e.to_string().ends_with("not 1000000"), "{e}");
        let ids = vec!["7"; 1_000_000].join(",");
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"logprobs":true,"logprob_token_ids":[{ids}]}}"#
        );
        let e = check(
            Api::Chat,
            &JsonBody::parse(body.as_bytes()).unwrap(),
            &VllmLimits::default(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("of length 1000000"), "{e}");
    }

    #[test]
    fn limits_are_the_servers() {
        let body =
            JsonBody::parse(br#"{"messages":[],"logprobs":true,"top_logprobs":30}"#).unwrap();
        let wide = VllmLimits {
            max_logprobs: 50,
            ..VllmLimits::default()
        };
        assert!(check(Api::Chat, &body, &VllmLimits::default()).is_err());
        assert!(check(Api::Chat, &body, &wide).is_ok());
        let unbounded = VllmLimits {
            max_logprobs: -1,
            ..VllmLimits::default()
        };
        let all = JsonBody::parse(br#"{"messages":[],"logprobs":true,"top_logprobs":-1}"#).unwrap();
        assert!(check(Api::Chat, &all, &unbounded).is_ok());
    }
}
