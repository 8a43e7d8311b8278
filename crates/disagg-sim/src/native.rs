//! SGLang's native `POST /generate`, served by an engine in
//! [`KvMode::Sglang`](crate::KvMode::Sglang) on both roles.
//!
//! As SGLang 0.5.23 (`python/sglang/srt/managers/io_struct.py` `GenerateReqInput`,
//! `managers/tokenizer_manager.py`, `entrypoints/http_server.py` `generate_request`):
//!
//! - the prompt is `text` (a string, or a list of strings: a batch) or `input_ids`
//!   (token ids, or a list of token-id lists: a batch), exactly one of them;
//! - `sampling_params` holds `max_new_tokens` (default 128), `min_new_tokens`, `stop`,
//!   `ignore_eos`, `temperature` and `n` (samples per prompt, at most 128 here, and
//!   at most 1024 prompts × samples and 2^22 tokens to generate in all): a
//!   request of B prompts and `n` samples is B·n requests on the engine, answered as a
//!   list in prompt order (each prompt's samples in turn), as is one prompt with
//!   `n` > 1;
//! - the answer is `{"text", "output_ids", "meta_info"}`, a list of them for a batch;
//!   streamed (`"stream": true`), one `data: {...}` event per generated token whose
//!   `text` and `output_ids` hold everything generated so far (SGLang's default,
//!   non-incremental streaming), with `"index"` for a batch, then `data: [DONE]`;
//! - `meta_info` holds `id`, `finish_reason` (`{"type": "length", "length": n}` or
//!   `{"type": "stop", "matched": token id or stop string}`, null until the end; a
//!   decode whose KV transfer failed: `{"type": "abort", ...}`, see [`aborted_stream`]),
//!   `prompt_tokens`, `completion_tokens`, `cached_tokens`, and with `return_logprob`
//!   `input_token_logprobs` and `output_token_logprobs` (`[logprob, token id, null]`
//!   entries) and `output_token_logprobs_length`.
//!
//! The prompt's logprobs are computed where the prompt is: a prefill answers them for
//! every prompt token (the first has a null logprob), a decode whose KV came from a
//! prefill answers an empty list, which SGLang's routers complete with the prefill's.
//! Logprobs are a deterministic function of the token and its position.

use std::time::Instant;

use bytes::Bytes;
use serde_json::{Map, Value, json};

use crate::SimConfig;
use crate::api::{ApiError, CompletionRequest, completion_prompts};
use crate::body::Endpoint;
use crate::generate::{EOS_TOKEN_ID, Finish, Generation, mix};
use crate::lax;

use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Response, StatusCode};

use crate::body::{Events, EventsBody, SimBody};
use crate::config::Faults;
use crate::server::json_response;
use crate::stats::RequestGuard;

/// SGLang's default `max_new_tokens` (`sampling_params.py`).
const DEFAULT_MAX_NEW_TOKENS: u32 = 128;

/// How a `/generate` answer is written.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Native {
    /// The answer is a list: `text` or `input_ids` was a list of prompts, or each
    /// prompt is sampled several times (`sampling_params.n` > 1).
    pub(crate) batch: bool,
    /// `text` or `input_ids` was a list of prompts (SGLang's batch size is then the
    /// list's length, else one prompt).
    pub(crate) prompt_list: bool,
    /// `return_logprob`.
    pub(crate) return_logprob: bool,
}

/// Parses and validates a `/generate` body into the engine's request.
pub(crate) fn parse(body: &Value, config: &SimConfig) -> Result<CompletionRequest, ApiError> {
    let Some(obj) = body.as_object() else {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    };
    let text = obj.get("text").filter(|v| !v.is_null());
    let ids = obj.get("input_ids").filter(|v| !v.is_null());
    let (prompts, batch) = match (text, ids) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "Only one of text, input_ids, or input_embeds should be provided.",
            ));
        }
        (None, None) => {
            return Err(ApiError::bad_request(
                "Either text, input_ids or input_embeds should be provided.",
            ));
        }
        (Some(t), None) => {
            // A batch of more prompts than choices served is refused before it is
            // tokenized.
            crate::limits::check_batch(crate::limits::batch_len(Some(t)), 1, 0)?;
            if !(t.is_string() || t.as_array().is_some_and(|a| a.iter().all(Value::is_string))) {
                return Err(ApiError::bad_request(
                    "text: should be a string or a list of strings",
                ));
            }
            (completion_prompts(Some(t))?, t.is_array())
        }
        (None, Some(i)) => {
            let nested = i
                .as_array()
                .and_then(|a| a.first())
                .is_some_and(Value::is_array);
            if !i.is_array() {
                return Err(ApiError::bad_request(
                    "input_ids: should be a list of token ids or a list of lists of them",
                ));
            }
            crate::limits::check_batch(crate::limits::batch_len(Some(i)), 1, 0)?;
            (completion_prompts(Some(i))?, nested)
        }
    };
    let empty = Map::new();
    let sampling = match obj.get("sampling_params") {
        None | Some(Value::Null) => &empty,
        Some(Value::Object(o)) => o,
        Some(_) => {
            return Err(ApiError::bad_request(
                "sampling_params: the simulator takes one object for every element",
            ));
        }
    };
    let max_new = lax::opt_int(sampling, "max_new_tokens")?;
    let max_tokens = match max_new {
        None => DEFAULT_MAX_NEW_TOKENS,
        Some(m) if m < 0 => {
            return Err(ApiError::bad_request(format!(
                "max_new_tokens must be at least 0, got {m}."
            )));
        }
        Some(m) => u32::try_from(m).unwrap_or(u32::MAX),
    };
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) as u64;
    if longest + u64::from(max_tokens) > u64::from(config.max_model_len) {
        return Err(ApiError::bad_request(format!(
            "Requested token count exceeds the model's maximum context length of {} tokens.",
            config.max_model_len
        )));
    }
    let min_tokens = match lax::opt_int(sampling, "min_new_tokens")? {
        None => 0,
        Some(m) if m < 0 || m > i64::from(max_tokens) => {
            return Err(ApiError::bad_request(format!(
                "min_new_tokens must be in [0, max_new_tokens], got {m}."
            )));
        }
        Some(m) => u32::try_from(m).unwrap_or(0),
    };
    if lax::opt_float(sampling, "temperature")?.is_some_and(|t| t < 0.0) {
        return Err(ApiError::bad_request("temperature must be non-negative"));
    }
    let n = match lax::opt_int(sampling, "n")? {
        None => 1,
        Some(n) if n < 1 => {
            return Err(ApiError::bad_request(format!(
                "sampling_params.n must be at least 1, got {n}"
            )));
        }
        Some(n) if n > 128 => {
            return Err(ApiError::bad_request(format!(
                "sampling_params.n: the simulator samples at most 128 times, got {n}"
            )));
        }
        Some(n) => u32::try_from(n).unwrap_or(1),
    };
    crate::limits::check_batch(prompts.len(), n, max_tokens)?;
    let return_logprob = match obj.get("return_logprob") {
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| lax::to_bool("return_logprob", v))
            .collect::<Result<Vec<_>, _>>()?
            .contains(&true),
        _ => lax::opt_bool(obj, "return_logprob")?.unwrap_or(false),
    };
    Ok(CompletionRequest {
        // Generation and the KV protocol read the request as completions do.
        endpoint: Endpoint::Completions,
        // SGLang's `/generate` names no model.
        adapter: None,
        prompt_tokens: prompts.iter().map(|p| p.len() as u64).sum(),
        prompts,
        max_tokens,
        min_tokens,
        n,
        stream: lax::opt_bool(obj, "stream")?.unwrap_or(false),
        include_usage: false,
        continuous_usage: false,
        stop: lax::opt_str_or_list(sampling, "stop")?.unwrap_or_default(),
        ignore_eos: lax::opt_bool(sampling, "ignore_eos")?.unwrap_or(false),
        include_stop_str_in_output: false,
        kv_transfer_params: None,
        beam_search: false,
        grammar: false,
        native: Some(Native {
            batch: batch || n > 1,
            prompt_list: batch,
            return_logprob,
        }),
        gen_api: None,
        responses: None,
        tokenized: false,
        reused_ids: false,
        return_token_ids: false,
        null_max_tokens: false,
        echo: false,
    })
}

/// A deterministic logprob for `token` at `pos` of a sequence, in `(-10, 0)`.
fn logprob(token: u32, pos: usize) -> f64 {
    let h = mix(u64::from(token) ^ mix(pos as u64));
    -((h % 10_000) as f64 + 1.0) / 1000.0
}

/// The answer of one `/generate` request, one element per sample of each prompt.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) native: Native,
    pub(crate) request_id: String,
    pub(crate) prompts: Vec<Vec<u32>>,
    /// One generation per sample of each prompt, prompt by prompt (SGLang's order:
    /// `managers/tokenizer_manager.py` sends each prompt's samples in turn, and a
    /// stream's `index` is the position in that order).
    pub(crate) choices: Vec<Generation>,
    /// Samples per prompt (`sampling_params.n`).
    pub(crate) samples: usize,
    /// The `index` every event says ([`Faults::generate_index`](crate::Faults::generate_index)).
    pub(crate) index_override: Option<u64>,
    /// Whether this engine computed the prompts (and so their logprobs): not a decode
    /// whose KV came from a prefill.
    pub(crate) computed_prompt: bool,
    /// `cached_tokens` of the request, all elements together.
    pub(crate) cached_tokens: u64,
    pub(crate) started: Instant,
    /// The finish reason of every element in place of its own: the request was
    /// aborted ([`aborted_stream`]).
    pub(crate) abort: Option<Value>,
}

impl Answer {
    /// The answer object of element `e` after its first `k` generated tokens.
    fn element(&self, e: usize, k: usize) -> Value {
        let prompt = self
            .prompts
            .get(e / self.samples.max(1))
            .map_or(&[][..], Vec::as_slice);
        let Some(choice) = self.choices.get(e) else {
            return Value::Null;
        };
        let k = k.min(choice.ids.len());
        let done = k == choice.ids.len();
        let finish = done.then(|| match (&self.abort, choice.finish, &choice.stop_reason) {
            (Some(abort), _, _) => abort.clone(),
            (None, Finish::Length, _) => json!({"type": "length", "length": choice.ids.len()}),
            (None, Finish::Stop, Some(stop)) => json!({"type": "stop", "matched": stop}),
            (None, Finish::Stop, None) => json!({"type": "stop", "matched": EOS_TOKEN_ID}),
        });
        let id = if self.native.batch {
            format!("{}-{e}", self.request_id)
        } else {
            self.request_id.clone()
        };
        let mut meta = json!({
            "id": id,
            "finish_reason": finish,
            "prompt_tokens": prompt.len(),
            "weight_version": "default",
            "reasoning_tokens": 0,
            "completion_tokens": k,
            // The whole request's, on its first element (the engine caches per request).
            "cached_tokens": if e == 0 { self.cached_tokens } else { 0 },
            "e2e_latency": self.started.elapsed().as_secs_f64(),
        });
        if self.native.return_logprob {
            let input: Vec<Value> = if self.computed_prompt {
                prompt
                    .iter()
                    .enumerate()
                    .map(|(pos, &t)| {
                        let lp = (pos > 0).then(|| logprob(t, pos));
                        json!([lp, t, null])
                    })
                    .collect()
            } else {
                Vec::new()
            };
            let output: Vec<Value> = choice.ids[..k]
                .iter()
                .enumerate()
                .map(|(j, &t)| json!([logprob(t, prompt.len() + j), t, null]))
                .collect();
            meta["input_token_logprobs"] = Value::Array(input);
            meta["output_token_logprobs_length"] = json!(output.len());
            meta["output_token_logprobs"] = Value::Array(output);
        }
        json!({
            "text": choice.steps[..k].concat(),
            "output_ids": &choice.ids[..k],
            "meta_info": meta,
        })
    }

    /// The whole (non-streaming) answer.
    pub(crate) fn whole(&self) -> Result<Vec<u8>, serde_json::Error> {
        if self.native.batch {
            let all: Vec<Value> = (0..self.choices.len())
                .map(|e| self.element(e, usize::MAX))
                .collect();
            serde_json::to_vec(&all)
        } else {
            serde_json::to_vec(&self.element(0, usize::MAX))
        }
    }

    /// The event of element `e` after its first `k` generated tokens.
    fn event(&self, e: usize, k: usize) -> Result<Bytes, serde_json::Error> {
        let mut v = self.element(e, k);
        if let Some(index) = self.index_override {
            v["index"] = json!(index);
        } else if self.native.batch {
            v["index"] = json!(e);
        }
        let mut event = b"data: ".to_vec();
        serde_json::to_writer(&mut event, &v)?;
        event.extend_from_slice(b"\n\n");
        Ok(Bytes::from(event))
    }

    /// The event after step `k` of element `e` (`(1, 0)` the first): step by step,
    /// elements in turn, each element's events up to its last token (a generation of
    /// no token still has one event); `None` after the last.
    fn next_event(&self, last: usize, mut k: usize, mut e: usize) -> Option<(usize, usize)> {
        while k <= last {
            if let Some(found) =
                (e..self.choices.len()).find(|&i| k <= self.choices[i].ids.len().max(1))
            {
                return Some((k, found));
            }
            k += 1;
            e = 0;
        }
        None
    }

    /// The streamed answer, rendered event by event as it is sent (an event holds
    /// everything generated so far, so rendering them all up front would hold a
    /// number of bytes quadratic in the tokens).
    /// The step of the longest choice (at least 1: an answer without tokens still has
    /// an event): counted once per stream, not per event.
    fn last_step(&self) -> usize {
        self.choices
            .iter()
            .map(|c| c.ids.len())
            .max()
            .unwrap_or(0)
            .max(1)
    }

    pub(crate) fn stream(self, unterminated: Option<usize>) -> NativeStream {
        let last = self.last_step();
        let phase = match self.next_event(last, 1, 0) {
            Some((k, e)) => StreamPhase::Event { k, e },
            None => StreamPhase::Done,
        };
        NativeStream {
            answer: self,
            last,
            phase,
            unterminated,
            filler: None,
        }
    }
}

/// Where a [`NativeStream`] is.
#[derive(Debug, Clone, Copy)]
enum StreamPhase {
    /// The event of element `e` after its first `k` tokens.
    Event {
        k: usize,
        e: usize,
    },
    /// `data: [DONE]`.
    Done,
    /// [`Faults::unterminated_event`](crate::Faults::unterminated_event): the head of
    /// the event that never ends.
    Head,
    /// ... and this many bytes of it still to send.
    Filler(usize),
    End,
}

/// A `/generate` stream ([`Answer::stream`]): one event per generated token of each
/// element (step by step, elements in turn), then `data: [DONE]`, each rendered when
/// the body is polled for it.
#[derive(Debug)]
pub(crate) struct NativeStream {
    answer: Answer,
    /// [`Answer::last_step`].
    last: usize,
    phase: StreamPhase,
    /// [`Faults::unterminated_event`](crate::Faults::unterminated_event): the first
    /// event, then one of this many bytes that never ends (in frames of 64 KiB, one
    /// buffer shared by all), and the end.
    unterminated: Option<usize>,
    filler: Option<Bytes>,
}

impl NativeStream {
    /// The next frame, `None` at the end.
    pub(crate) fn next_frame(&mut self) -> Option<Result<Bytes, serde_json::Error>> {
        const FRAME: usize = 64 * 1024;
        const HEAD: &[u8] = b"data: {\"text\":\"";
        // After the first frame, an unterminated event takes the rest of the stream.
        let after_first = |this: &Self, next: StreamPhase| match this.unterminated {
            Some(_) if matches!(this.phase, StreamPhase::Event { k: 1, e: 0 }) => StreamPhase::Head,
            _ => next,
        };
        let (frame, next) = match self.phase {
            StreamPhase::Event { k, e } => {
                let next = match self.answer.next_event(self.last, k, e + 1) {
                    Some((k, e)) => StreamPhase::Event { k, e },
                    None => StreamPhase::Done,
                };
                (self.answer.event(e, k), after_first(self, next))
            }
            StreamPhase::Done => {
                let next = match self.unterminated {
                    // No event came before `[DONE]`: the unterminated one follows it.
                    Some(_) if self.answer.choices.is_empty() => StreamPhase::Head,
                    _ => StreamPhase::End,
                };
                (Ok(Bytes::from_static(b"data: [DONE]\n\n")), next)
            }
            StreamPhase::Head => {
                let left = self.unterminated.unwrap_or(0).saturating_sub(HEAD.len());
                let next = if left > 0 {
                    StreamPhase::Filler(left)
                } else {
                    StreamPhase::End
                };
                (Ok(Bytes::from_static(HEAD)), next)
            }
            StreamPhase::Filler(left) => {
                let n = left.min(FRAME);
                let filler = self
                    .filler
                    .get_or_insert_with(|| Bytes::from(vec![b'x'; FRAME]));
                let next = if left > n {
                    StreamPhase::Filler(left - n)
                } else {
                    StreamPhase::End
                };
                (Ok(filler.slice(..n)), next)
            }
            StreamPhase::End => return None,
        };
        self.phase = next;
        Some(frame)
    }

    /// Whether every frame was sent.
    pub(crate) fn is_end(&self) -> bool {
        matches!(self.phase, StreamPhase::End)
    }
}

/// What SGLang's `/generate` answers with, besides the request.
pub(crate) struct NativeParts {
    pub(crate) native: Native,
    /// One generation per sample of each prompt.
    pub(crate) choices: Vec<Generation>,
    /// Whether the prompt was computed here (not taken from a prefill).
    pub(crate) computed_prompt: bool,
    pub(crate) cached_tokens: Option<u64>,
}

/// The answer of SGLang's `/generate`, streamed or whole (see the [module docs](self)).
pub(crate) fn answer(
    config: &SimConfig,
    request: &CompletionRequest,
    parts: NativeParts,
    request_id: &str,
    faults: Faults,
    guard: RequestGuard,
) -> Result<Response<SimBody>, (ApiError, RequestGuard)> {
    let answer = Answer {
        native: parts.native,
        request_id: request_id.to_owned(),
        prompts: request.prompts.clone(),
        choices: parts.choices,
        samples: request.n as usize,
        index_override: faults.generate_index,
        computed_prompt: parts.computed_prompt,
        cached_tokens: parts.cached_tokens.unwrap_or(0),
        started: std::time::Instant::now(),
        abort: None,
    };
    let internal =
        |e: serde_json::Error| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
    if request.stream {
        let events = answer.stream(faults.unterminated_event);
        let body = EventsBody::new(
            Events::Native(Box::new(events)),
            config.inter_token_delay,
            faults.stall_after_chunks,
            guard,
        )
        .dropping_after(faults.drop_after_chunks);
        let mut response = Response::new(SimBody::Events(Box::new(body)));
        response.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream; charset=utf-8"),
        );
        return Ok(response);
    }
    match answer.whole() {
        Ok(body) => Ok(json_response(
            StatusCode::OK,
            SimBody::Full {
                data: Some(Bytes::from(body)),
                guard: Some(guard),
            },
            None,
        )),
        Err(e) => Err((internal(e), guard)),
    }
}

/// The stream of a `/generate` request its decode aborted with `error` (a failed KV
/// transfer: [`crate::kv_load_failure`]), as SGLang 0.5.23 writes it: one event per
/// element (each with its `index` in a batch), no text and no token, whose
/// `meta_info.finish_reason` is the abort (`FINISH_ABORT.to_json()` in
/// `managers/schedule_batch.py`: `type` `abort`, the `message`, the `status_code`,
/// `err_type` null), then `data: [DONE]` (`entrypoints/http_server.py`
/// `serve_generate_request`, after the tokenizer manager yielded the aborted output).
pub(crate) fn aborted_stream(
    request: &CompletionRequest,
    native: Native,
    request_id: &str,
    error: &ApiError,
) -> NativeStream {
    let samples = request.n.max(1) as usize;
    let elements = request.prompts.len().max(1) * samples;
    let answer = Answer {
        native,
        request_id: request_id.to_owned(),
        prompts: request.prompts.clone(),
        choices: (0..elements)
            .map(|_| crate::kv_load_failure::no_tokens())
            .collect(),
        samples,
        index_override: None,
        // A decode: the prompt's KV was to come from the prefill.
        computed_prompt: false,
        cached_tokens: 0,
        started: Instant::now(),
        abort: Some(json!({
            "type": "abort",
            "message": error.message,
            "status_code": error.status.as_u16(),
            "err_type": null,
        })),
    };
    answer.stream(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_json(v: Value) -> Result<CompletionRequest, ApiError> {
        parse(&v, &SimConfig::default())
    }

    #[test]
    fn prompts_and_batches_are_read_as_sglang_reads_them() {
        let r =
            parse_json(json!({"text": "a b c", "sampling_params": {"max_new_tokens": 4}})).unwrap();
        assert_eq!((r.prompts.len(), r.max_tokens), (1, 4));
        assert!(!r.native.unwrap().batch);
        let r = parse_json(json!({"text": ["a", "b c"]})).unwrap();
        assert_eq!((r.prompts.len(), r.max_tokens), (2, DEFAULT_MAX_NEW_TOKENS));
        assert!(r.native.unwrap().batch);
        let r = parse_json(json!({"input_ids": [[20, 21], [22]], "return_logprob": [false, true]}))
            .unwrap();
        assert!(r.native.unwrap().batch && r.native.unwrap().return_logprob);
        let r = parse_json(json!({"input_ids": [20, 21]})).unwrap();
        assert!(!r.native.unwrap().batch);
        // Samples make a list answer of one prompt too.
        let r = parse_json(json!({"text": "a", "sampling_params": {"n": 3}})).unwrap();
        let native = r.native.unwrap();
        assert!(native.batch && !native.prompt_list);
        assert_eq!((r.prompts.len(), r.n), (1, 3));
        for bad in [
            json!({}),
            json!({"text": "a", "input_ids": [20]}),
            json!({"text": 5}),
            json!({"text": "a", "sampling_params": {"max_new_tokens": -1}}),
            json!({"text": "a", "sampling_params": {"n": 0}}),
            json!({"text": "a", "sampling_params": {"n": 129}}),
        ] {
            assert_eq!(parse_json(bad.clone()).unwrap_err().status, 400, "{bad}");
        }
    }

    /// A stream's events hold everything generated so far: rendered up front, a
    /// 4000-token answer would hold some 100 MB before the first byte went out.
    #[tokio::test]
    async fn a_long_stream_is_rendered_as_it_is_sent() {
        use http_body_util::BodyExt;
        let config = SimConfig::default();
        let request = parse_json(json!({
            "text": "a b c",
            "stream": true,
            "return_logprob": true,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": true},
        }))
        .unwrap();
        let params = crate::generate::GenParams {
            start: 0,
            max_tokens: 4000,
            min_tokens: 0,
            eos_period: 0,
            ignore_eos: true,
            stop: &[],
            include_stop_str_in_output: false,
        };
        let hash = crate::generate::ids_hash(&request.prompts[0]);
        let choices = vec![crate::generate::generate_choice(hash, 0, &params)];
        assert_eq!(choices[0].ids.len(), 4000);
        let parts = NativeParts {
            native: request.native.unwrap(),
            choices,
            computed_prompt: true,
            cached_tokens: None,
        };
        let guard = RequestGuard::new(std::sync::Arc::default());
        let response = answer(&config, &request, parts, "r", Faults::default(), guard).unwrap();
        let mut body = response.into_body();
        let SimBody::Events(events) = &body else {
            panic!("a /generate stream is an events body: {body:?}");
        };
        let queued = events.queued_bytes();
        assert!(queued < 1 << 20, "{queued} bytes rendered before sending");
        // The events still come, one token more each.
        for k in 1..=3 {
            let frame = body.frame().await.unwrap().unwrap().into_data().unwrap();
            let v: Value = serde_json::from_slice(&frame[6..]).unwrap();
            assert_eq!(v["meta_info"]["completion_tokens"], k);
            assert_eq!(v["output_ids"].as_array().unwrap().len(), k);
        }
    }

    #[test]
    fn logprobs_cover_the_prompt_where_it_was_computed() {
        let prompts = [vec![20, 21, 22]];
        let choices = [Generation {
            steps: vec![" the", " of"],
            ids: vec![30, 31],
            finish: Finish::Length,
            stop_reason: None,
        }];
        let mut a = Answer {
            native: Native {
                batch: false,
                prompt_list: false,
                return_logprob: true,
            },
            request_id: "r".to_owned(),
            prompts: prompts.to_vec(),
            choices: choices.to_vec(),
            samples: 1,
            index_override: None,
            computed_prompt: true,
            cached_tokens: 0,
            started: Instant::now(),
            abort: None,
        };
        let v: Value = serde_json::from_slice(&a.whole().unwrap()).unwrap();
        assert_eq!(v["text"], " the of");
        assert_eq!(
            v["meta_info"]["finish_reason"],
            json!({"type": "length", "length": 2})
        );
        let input = v["meta_info"]["input_token_logprobs"].as_array().unwrap();
        assert_eq!(input.len(), 3);
        assert_eq!(input[0], json!([null, 20, null]));
        assert_eq!(input[1][1], 21);
        assert_eq!(
            v["meta_info"]["output_token_logprobs"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
        a.computed_prompt = false;
        let v: Value = serde_json::from_slice(&a.whole().unwrap()).unwrap();
        assert_eq!(v["meta_info"]["input_token_logprobs"], json!([]));
        // Streamed: cumulative text, the finish on the last event, then [DONE].
        let mut stream = a.stream(None);
        let events: Vec<Bytes> = std::iter::from_fn(|| stream.next_frame())
            .collect::<Result<_, _>>()
            .unwrap();
        assert!(stream.is_end());
        assert_eq!(events.len(), 3);
        let last: Value = serde_json::from_slice(&events[1][6..]).unwrap();
        assert_eq!(last["text"], " the of");
        let first: Value = serde_json::from_slice(&events[0][6..]).unwrap();
        assert_eq!(first["text"], " the");
        assert!(first["meta_info"]["finish_reason"].is_null());
        assert_eq!(&events[2][..], b"data: [DONE]\n\n");
    }
}
