//! SGLang's bootstrap protocol: both legs at once, meeting by host, port and room.
//!
//! Protocol (SGLang `python/sglang/srt/managers/io_struct.py` `GenerateReqInput`; the
//! router's side in `sgl-model-gateway/src/routers/http/pd_router.rs`):
//!
//! - the prefill and the decode get the **same** body: the client's, untouched (the
//!   prefill engine, started with `--disaggregation-mode prefill`, only prefills), plus
//!   `bootstrap_host` (the prefill endpoint's host, an IPv6 address in brackets: the
//!   engines join it to a port as `f"{bootstrap_host}:{port}"`, and SGLang's `mini_lb`
//!   brackets it too), `bootstrap_port` (its
//!   `--disaggregation-bootstrap-port`, or `null`) and `bootstrap_room` (a 63-bit id);
//! - a batch of B prompts (completions when `prompt` is a list of prompts, `/generate`
//!   when `text` or `input_ids` is one) gets arrays of the three, with B elements and a
//!   distinct room each (SGLang 0.5.23 `srt/managers/io_struct.py`
//!   `_normalize_bootstrap_params` gives element `i` the list's entry `i`); past
//!   [`MAX_SEQUENCES`] prompts the request is refused. A request sampling a prompt
//!   more than once (`n > 1`) is refused: SGLang's tokenizer manager sends a prompt's
//!   samples, and a warm-up, each with the prompt's room
//!   (`managers/tokenizer_manager.py` `_handle_batch_request`), where their KV
//!   transfers collide whatever rooms the request carries;
//! - when the route names data-parallel ranks, the two legs differ, as SGLang reads them
//!   (`io_struct.py` `GenerateReqInput`, `disaggregation/common/conn.py`,
//!   `disaggregation/decode.py`): the prefill gets `routed_dp_rank = p` and
//!   `disagg_prefill_dp_rank = p`, the decode `routed_dp_rank = d` and
//!   `disagg_prefill_dp_rank = p`. A prefill engine balances with
//!   `follow_bootstrap_room` by default (rank = room mod DP size); its KV sender fails a
//!   request dispatched to another rank with "follow_bootstrap_room conflict" unless the
//!   request itself carries `disagg_prefill_dp_rank` (`CommonKVSender`), and a decode
//!   not told `disagg_prefill_dp_rank` looks for the KV on rank room mod DP size
//!   (`_resolve_prefill_dp_rank`). SGLang writes the prefill leg the same way when it
//!   re-sends one itself (`Req.build_rebootstrap_payload` in
//!   `managers/schedule_batch.py`). (`data_parallel_rank` is only a deprecated alias of
//!   `routed_dp_rank`; an older `data_parallel_rank_decode` is read by no current
//!   SGLang.)
//! - both legs are sent concurrently: the decode engine connects to the prefill's
//!   bootstrap server and waits for the room (SGLang waits up to
//!   `SGLANG_DISAGGREGATION_WAITING_TIMEOUT`, 300 s), which is why a failed prefill must
//!   abort the decode leg at once rather than leave it waiting.
//!
//! SGLang's native `/generate` ([`Api::Generate`]) is carried the same way: a `text`
//! list or an `input_ids` list of lists is a batch, one room per element. With
//! `return_logprob` the plan is [`Dispatch::Joined`]: the decode's answer waits for the
//! prefill's, whose `meta_info.input_token_logprobs` (the prompt's logprobs, which only
//! the prefill computes) are prepended to the decode's in the whole answer or in every
//! streamed event, as SGLang's routers do. The OpenAI routes carry no `meta_info`, so
//! their answers pass through unchanged.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

use crate::common::Rooms;
use crate::sglang::generate::{self, LogprobMerge, MergeLogprobs};
use disagg_core::connector::{Dispatch, Handoff, HandoffFound, KvConnector, Leg, PrefillAnswer};
use disagg_core::error::ConnectorError;
use disagg_core::policy::Decision;
use disagg_core::request::{Api, PdRequest};
use disagg_core::router::Route;
use disagg_json::InvalidParam;

/// The SGLang bootstrap connector: concurrent dispatch, `bootstrap_host/port/room` on
/// both legs.
///
/// The bootstrap port of each prefill endpoint comes from its
/// [`Facts::BOOTSTRAP_PORT`](disagg_core::endpoint::Facts::BOOTSTRAP_PORT) fact; an
/// endpoint without one gets `bootstrap_port: null` (SGLang's `none`), one whose value is
/// not a port number fails the request (`ConnectorError::NotConfigured`, naming the
/// endpoint and the key).
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use disagg_connectors::common::Rooms;
/// use disagg_connectors::sglang::SglangBootstrap;
/// use disagg_core::connector::{Dispatch, KvConnector};
/// use disagg_core::endpoint::{Endpoint, Facts, Role};
/// use disagg_core::request::{Api, PdRequest};
/// use disagg_core::router::Route;
///
/// let facts = Facts::default().with(Facts::BOOTSTRAP_PORT, "8998")?;
/// let p = Endpoint::new("http://10.0.0.5:30000", Role::Prefill)?.with_facts(facts);
/// let route = Route::new(
///     Some(Arc::new(p)),
///     Arc::new(Endpoint::new("http://10.0.0.7:30001", Role::Decode)?),
/// );
/// let req = PdRequest::new(Api::Completions, Default::default(), &r#"{"prompt":"hi"}"#.into())?;
/// let h = SglangBootstrap::with_rooms(Rooms::from_seed(7)).prepare(&route, &req)?;
/// assert_eq!(h.dispatch, Dispatch::Concurrent);
/// assert_eq!(h.prefill.body.get("bootstrap_host"), Some(&br#""10.0.0.5""#[..]));
/// assert_eq!(h.prefill.body.get("bootstrap_port"), Some(&b"8998"[..]));
/// assert_eq!(h.prefill.body.to_bytes(), h.decode.body.to_bytes());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Default)]
pub struct SglangBootstrap {
    rooms: Rooms,
}

impl SglangBootstrap {
    /// The connector, drawing rooms from a randomly keyed [`Rooms`].
    pub fn new() -> Self {
        Self::default()
    }

    /// The connector drawing rooms from `rooms` (a seeded one makes tests deterministic).
    pub fn with_rooms(rooms: Rooms) -> Self {
        SglangBootstrap { rooms }
    }
}

/// The body field that pins a request to a data-parallel rank of the engine it is sent
/// to (SGLang `GenerateReqInput.routed_dp_rank`).
pub(crate) const ROUTED_DP_RANK: &str = "routed_dp_rank";

/// The decode leg's field naming the prefill's data-parallel rank (SGLang
/// `GenerateReqInput.disagg_prefill_dp_rank`).
pub(crate) const PREFILL_DP_RANK: &str = "disagg_prefill_dp_rank";

/// The most sequences (prompts times samples) a request may expand to: each gets a
/// room, a host and a port in both legs' bodies, and a client's `n` must not make the
/// proxy write millions of them.
pub const MAX_SEQUENCES: usize = 65_536;

/// How many requests SGLang makes of one (SGLang 0.5.23 `srt/managers/io_struct.py`
/// `GenerateReqInput.normalize_batch_and_arguments`): `None` for a single request
/// (one prompt, one sample: the bootstrap fields are scalars), else `Some(N)`, N = B
/// prompts (1 for a single prompt) times `n` samples, each of which takes its own
/// element of the bootstrap fields. The OpenAI routes build the same input
/// (`srt/entrypoints/openai/serving_chat.py`, `serving_completions.py`): chat has one
/// prompt and the request's `n`; completions a batch when `prompt` is a list of
/// strings or of token-id lists, and `n`; `/generate` a batch when `text` or
/// `input_ids` is a list of prompts, and `sampling_params.n`.
pub(crate) fn expansion(api: Api, body: &disagg_json::JsonBody) -> Option<usize> {
    let (prompts, samples) = match api {
        Api::Chat => (None, openai_n(body)),
        Api::Completions => (crate::common::completion_batch(body), openai_n(body)),
        Api::Generate => (generate::batch_size(body), generate::samples(body)),
        _ => (None, openai_n(body)),
    };
    if prompts.is_none() && samples == 1 {
        return None;
    }
    Some(prompts.unwrap_or(1).saturating_mul(samples))
}

/// The OpenAI routes' `n`, read as pydantic's lax `int` (`"2"` too); 1 when absent or
/// not a positive integer (the engine refuses those itself).
fn openai_n(body: &disagg_json::JsonBody) -> usize {
    body.get("n")
        .and_then(|raw| disagg_json::lax::int_value(raw).ok().flatten())
        .and_then(|n| usize::try_from(n).ok())
        .filter(|n| *n > 0)
        .unwrap_or(1)
}

#[async_trait]
impl KvConnector for SglangBootstrap {
    fn name(&self) -> &'static str {
        "sglang"
    }

    /// A batch of more than [`MAX_SEQUENCES`] prompts is refused (400 on its prompt
    /// field), and so is a request sampling a prompt more than once (`n > 1`):
    /// SGLang 0.5.23's tokenizer manager sends a prompt's samples, and a warm-up before
    /// them, each with the room of the prompt's first element
    /// (`managers/tokenizer_manager.py` `_handle_batch_request`), so under P/D they
    /// collide on one room whatever rooms the proxy sends ("Duplicate or cancelled
    /// bootstrap room"); the client gets a clear 400 before any engine is asked.
    fn check(&self, req: &PdRequest) -> Result<Decision, InvalidParam> {
        // A Responses request that continues or keeps a response needs it on one
        // server: the prefill would not find a `previous_response_id` the decode stored.
        if req.api() == Api::Responses
            && ["previous_response_id", "store", "background"]
                .iter()
                .any(|f| !matches!(req.body().get(f), None | Some(b"null" | b"false")))
        {
            return Ok(Decision::Direct {
                reason: "responses_state",
            });
        }
        let samples = match req.api() {
            Api::Generate => generate::sample_count(req.body()).map_err(|_| {
                InvalidParam::new(
                    "sampling_params.n",
                    "sampling_params.n must be an integer (SGLang compares it with 1 as \
                     written)",
                )
            })?,
            _ => openai_n(req.body()),
        };
        if samples > 1 {
            let param = match req.api() {
                Api::Generate => "sampling_params.n",
                _ => "n",
            };
            return Err(InvalidParam::new(
                param,
                format!(
                    "{samples} samples of a prompt cannot be disaggregated on SGLang: its \
                     engines give a prompt's samples one bootstrap room, where their KV \
                     transfers collide; send {samples} requests of one sample instead"
                ),
            ));
        }
        match expansion(req.api(), req.body()) {
            Some(n) if n > MAX_SEQUENCES => Err(InvalidParam::new(
                match req.api() {
                    Api::Generate => "text",
                    _ => "prompt",
                },
                format!(
                    "a batch of {n} prompts, each with a bootstrap room of its own on both \
                     legs; at most {MAX_SEQUENCES} are carried"
                ),
            )),
            _ => Ok(Decision::Disaggregate),
        }
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        // SGLang 0.5.23 takes bootstrap fields on chat, completions, `/generate`, and
        // `/v1/messages` and `/v1/responses` (`srt/entrypoints/openai/protocol.py`
        // `PDRoutingFields`, which `ResponsesRequest` and the Anthropic request extend).
        crate::common::carries(
            self.name(),
            req.api(),
            &[
                Api::Chat,
                Api::Completions,
                Api::Generate,
                Api::Messages,
                Api::Responses,
            ],
        )?;
        let prefill_ep = route.prefill.clone().ok_or(ConnectorError::NeedsPrefill {
            connector: self.name(),
        })?;
        // Bracketed when IPv6: SGLang joins it to a port as `f"{host}:{port}"`.
        let host = serde_json::to_vec(prefill_ep.authority().host()).map_err(|source| {
            ConnectorError::Encode {
                field: "bootstrap_host",
                source,
            }
        })?;
        let port = match crate::common::bootstrap_port(&prefill_ep)? {
            Some(p) => p.to_string().into_bytes(),
            None => b"null".to_vec(),
        };
        let mut body = req.body().clone();
        match expansion(req.api(), req.body()) {
            None => {
                body.set_raw("bootstrap_host", Bytes::from(host));
                body.set_raw("bootstrap_port", Bytes::from(port));
                body.set("bootstrap_room", &self.rooms.next_room());
            }
            Some(n) => {
                body.set_raw("bootstrap_host", repeat(&host, n));
                body.set_raw("bootstrap_port", repeat(&port, n));
                let rooms: Vec<u64> = (0..n).map(|_| self.rooms.next_room()).collect();
                body.set("bootstrap_room", &rooms);
            }
        }
        let mut prefill = body.clone();
        let mut decode = body;
        if let Some(p) = route.prefill_rank {
            prefill.set(ROUTED_DP_RANK, &p);
            // Also on the prefill: without it, its KV sender refuses a rank other than
            // room mod DP size ("follow_bootstrap_room conflict").
            prefill.set(PREFILL_DP_RANK, &p);
            decode.set(PREFILL_DP_RANK, &p);
        }
        if let Some(d) = route.decode_rank {
            decode.set(ROUTED_DP_RANK, &d);
        }
        // `/generate` with logprobs: the client's answer holds the prefill's logprobs.
        let merge = req.api() == Api::Generate && generate::wants_logprobs(req.body());
        let dispatch = if merge {
            Dispatch::Joined
        } else {
            Dispatch::Concurrent
        };
        let mut handoff = Handoff::new(
            dispatch,
            Leg::new(prefill_ep, prefill),
            Leg::new(Arc::clone(&route.decode), decode),
        );
        if merge {
            handoff.ext.insert(MergeLogprobs {
                stream: req.is_stream(),
                sequences: generate::sequences(req.body()),
            });
        }
        Ok(handoff)
    }

    /// A [`Dispatch::Joined`] plan (`/generate` with logprobs): the prefill's prompt
    /// logprobs become the reshape that merges them into the decode's answer. An answer
    /// without any leaves the decode's as it is; one naming a sequence the request does
    /// not have (an `index` past its prompts times `n`) fails the request.
    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<HandoffFound, ConnectorError> {
        let Some(MergeLogprobs { stream, sequences }) = handoff.ext.get::<MergeLogprobs>().copied()
        else {
            return Ok(HandoffFound::Handed);
        };
        let logprobs = generate::prefill_logprobs(answer, sequences).map_err(|e| {
            ConnectorError::OutOfRange {
                endpoint: handoff.prefill.endpoint.id().clone(),
                what: e.what,
                found: e.found,
                sequences: e.sequences,
            }
        })?;
        if let Some(logprobs) = logprobs {
            handoff.reshape = Some(Arc::new(LogprobMerge::new(logprobs, stream)));
        }
        Ok(HandoffFound::Handed)
    }
}

/// A JSON array of `n` copies of the raw value `item`.
fn repeat(item: &[u8], n: usize) -> Bytes {
    let mut out = Vec::with_capacity(2 + n * (item.len() + 1));
    out.push(b'[');
    for i in 0..n {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(item);
    }
    out.push(b']');
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use http::HeaderMap;
    use serde_json::Value;

    use super::*;
    use disagg_core::endpoint::{Endpoint, Facts, Role};

    fn route(port: Option<&str>) -> Route {
        let mut facts = Facts::default();
        if let Some(p) = port {
            facts.insert(Facts::BOOTSTRAP_PORT, p).unwrap();
        }
        Route::new(
            Some(Arc::new(
                Endpoint::new("http://10.1.2.3:30000", Role::Prefill)
                    .unwrap()
                    .with_facts(facts),
            )),
            Arc::new(Endpoint::new("http://10.1.2.4:30001", Role::Decode).unwrap()),
        )
    }

    /// `route(None)` with data-parallel ranks named for each leg.
    fn ranked(prefill_rank: Option<u32>, decode_rank: Option<u32>) -> Route {
        let mut route = route(None);
        route.prefill_rank = prefill_rank;
        route.decode_rank = decode_rank;
        route
    }

    fn req(api: Api, body: &str) -> PdRequest {
        PdRequest::new(api, HeaderMap::new(), &Bytes::from(body.to_owned())).unwrap()
    }

    fn json(b: &disagg_json::JsonBody) -> Value {
        serde_json::from_slice(&b.to_bytes()).unwrap()
    }

    #[test]
    fn golden_single() {
        let c = SglangBootstrap::with_rooms(Rooms::from_seed(0));
        let r = req(
            Api::Chat,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":9,"bootstrap_room":5,"future":{"x":[1]}}"#,
        );
        let h = c.prepare(&route(Some("8998")), &r).unwrap();
        let expected_room = Rooms::from_seed(0).next_room();
        assert_eq!(
            String::from_utf8(h.decode.body.to_bytes().to_vec()).unwrap(),
            format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"stream":true,"max_tokens":9,"future":{{"x":[1]}},"bootstrap_host":"10.1.2.3","bootstrap_port":8998,"bootstrap_room":{expected_room}}}"#
            )
        );
        // The identical JSON goes to both legs: no rewrite for the prefill.
        assert_eq!(h.prefill.body.to_bytes(), h.decode.body.to_bytes());
        assert_eq!(h.prefill.endpoint.id().as_str(), "http://10.1.2.3:30000");
        assert_eq!(h.decode.endpoint.id().as_str(), "http://10.1.2.4:30001");
    }

    #[test]
    fn port_is_null_without_configuration_or_when_none() {
        let c = SglangBootstrap::new();
        let r = req(Api::Completions, r#"{"prompt":"a"}"#);
        let h = c.prepare(&route(None), &r).unwrap();
        assert_eq!(h.decode.body.get("bootstrap_port"), Some(&b"null"[..]));
    }

    #[test]
    fn a_malformed_bootstrap_port_fact_fails_the_request_naming_endpoint_and_key() {
        let c = SglangBootstrap::new();
        let r = req(Api::Completions, r#"{"prompt":"a"}"#);
        for bad in ["x", "70000", "-1", ""] {
            let err = c.prepare(&route(Some(bad)), &r).unwrap_err();
            assert!(
                matches!(err, ConnectorError::NotConfigured { .. }),
                "{bad}: {err:?}"
            );
            let msg = err.to_string();
            assert!(msg.contains("http://10.1.2.3:30000"), "{msg}");
            assert!(msg.contains("`bootstrap_port`"), "{msg}");
        }
    }

    #[test]
    fn batches_get_arrays_with_distinct_rooms() {
        let c = SglangBootstrap::new();
        let cases = [
            (Api::Chat, r#"{"messages":[],"n":3}"#, Some(3)),
            (Api::Chat, r#"{"messages":[],"n":1}"#, None),
            (Api::Completions, r#"{"prompt":["a","b"]}"#, Some(2)),
            (Api::Completions, r#"{"prompt":[[1,2],[3],[4]]}"#, Some(3)),
            (Api::Completions, r#"{"prompt":[1,2,3]}"#, None),
            // Samples expand too: one prompt times n, B prompts times n.
            (Api::Completions, r#"{"prompt":"a","n":4}"#, Some(4)),
            (Api::Completions, r#"{"prompt":["a","b"],"n":3}"#, Some(6)),
            (Api::Completions, r#"{"prompt":[[1],[2]],"n":"2"}"#, Some(4)),
            (Api::Chat, r#"{"messages":[],"n":"3"}"#, Some(3)),
            (
                Api::Generate,
                r#"{"text":["a","b"],"sampling_params":{"n":2}}"#,
                Some(4),
            ),
            (
                Api::Generate,
                r#"{"text":"a","sampling_params":{"n":2}}"#,
                Some(2),
            ),
            (
                Api::Generate,
                r#"{"input_ids":[[1],[2],[3]],"sampling_params":[{"n":2},{"n":2},{"n":2}]}"#,
                Some(6),
            ),
            (
                Api::Generate,
                r#"{"text":"a","sampling_params":{"n":1}}"#,
                None,
            ),
        ];
        for (api, body, want) in cases {
            let h = c.prepare(&route(Some("1")), &req(api, body)).unwrap();
            let v = json(&h.prefill.body);
            match want {
                None => {
                    assert!(v["bootstrap_room"].is_u64(), "{body}");
                    assert_eq!(v["bootstrap_host"], "10.1.2.3");
                }
                Some(n) => {
                    let rooms: Vec<u64> = v["bootstrap_room"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|r| r.as_u64().unwrap())
                        .collect();
                    assert_eq!(rooms.len(), n, "{body}");
                    let distinct: std::collections::HashSet<_> = rooms.iter().collect();
                    assert_eq!(distinct.len(), n, "rooms must differ: {rooms:?}");
                    assert!(rooms.iter().all(|r| *r <= crate::common::MAX_ROOM));
                    assert_eq!(v["bootstrap_host"], serde_json::json!(vec!["10.1.2.3"; n]));
                    assert_eq!(v["bootstrap_port"], serde_json::json!(vec![1; n]));
                }
            }
        }
    }

    /// SGLang's expansion of the rooms sent (`_normalize_bootstrap_params`): a list
    /// repeated n times, its first B·n entries used. The rooms sent here expand without
    /// a repeat; one per prompt, as SGLang's router sends them, would not.
    #[test]
    fn a_batch_gets_distinct_rooms_equal_on_both_legs() {
        let c = SglangBootstrap::new();
        let r = route(Some("8998"));
        let body = r#"{"text":["a","b","c"]}"#;
        let h = c.prepare(&r, &req(Api::Generate, body)).unwrap();
        let rooms: Vec<u64> =
            serde_json::from_value(json(&h.prefill.body)["bootstrap_room"].clone()).unwrap();
        let distinct: std::collections::HashSet<_> = rooms.iter().collect();
        assert_eq!(distinct.len(), 3, "{rooms:?}");
        assert_eq!(h.prefill.body.to_bytes(), h.decode.body.to_bytes());
    }

    #[test]
    fn samples_of_a_prompt_and_batches_past_the_ceiling_are_refused() {
        let c = SglangBootstrap::new();
        // SGLang gives a prompt's samples one room: n > 1 cannot be disaggregated.
        for (api, body, param) in [
            (Api::Chat, r#"{"messages":[],"n":2}"#, "n"),
            (Api::Completions, r#"{"prompt":["a","b"],"n":"2"}"#, "n"),
            (
                Api::Generate,
                r#"{"text":"a","sampling_params":{"n":2}}"#,
                "sampling_params.n",
            ),
        ] {
            let err = c.check(&req(api, body)).unwrap_err();
            assert_eq!(err.param, param, "{body}");
            // The OpenAI routes read `n` as pydantic does: `"2"` is two samples.
            let message = err.to_string();
            assert!(
                message.starts_with("2 samples of a prompt cannot be disaggregated"),
                "{body}: {message}"
            );
        }
        for ok in [r#"{"messages":[],"n":1}"#, r#"{"messages":[]}"#] {
            assert_eq!(
                c.check(&req(Api::Chat, ok)).unwrap(),
                Decision::Disaggregate
            );
        }
        // A batch gets a room per prompt, up to the ceiling.
        let batch = |n: usize| format!(r#"{{"prompt":[{}]}}"#, vec![r#""a""#; n].join(","));
        let err = c
            .check(&req(Api::Completions, &batch(MAX_SEQUENCES + 1)))
            .unwrap_err();
        assert_eq!(err.param, "prompt");
        let ok = req(Api::Completions, &batch(MAX_SEQUENCES));
        assert_eq!(c.check(&ok).unwrap(), Decision::Disaggregate);
    }

    /// `sampling_params.n` is read as SGLang's parser reads it (the last of a repeated
    /// key), and a value that is no integer is refused rather than taken for 1: SGLang
    /// reads the raw value (`sampling_params.get("n", 1)`), so `"2"` or `null` is no
    /// single sample there.
    #[test]
    fn generate_samples_are_read_as_sglang_reads_them() {
        let c = SglangBootstrap::new();
        let check = |body: &str| c.check(&req(Api::Generate, body));
        // Both refusals name the field: the message tells which one it was.
        let several = |n: usize| format!("{n} samples of a prompt cannot be disaggregated");
        let no_integer = || "sampling_params.n must be an integer".to_owned();
        for (refused, why) in [
            (
                r#"{"text":"a","sampling_params":{"n":1,"n":2}}"#,
                several(2),
            ),
            (
                r#"{"text":["a","b"],"sampling_params":[{"n":1,"n":3},{"n":3}]}"#,
                several(3),
            ),
            (r#"{"text":"a","sampling_params":{"n":"2"}}"#, no_integer()),
            (r#"{"text":"a","sampling_params":{"n":"1"}}"#, no_integer()),
            (r#"{"text":"a","sampling_params":{"n":null}}"#, no_integer()),
            (r#"{"text":"a","sampling_params":{"n":1.5}}"#, no_integer()),
            (r#"{"text":"a","sampling_params":{"n":[2]}}"#, no_integer()),
        ] {
            let err = check(refused).unwrap_err();
            assert_eq!(err.param, "sampling_params.n", "{refused}");
            let message = err.to_string();
            assert!(message.starts_with(&why), "{refused}: {message}");
        }
        for one in [
            r#"{"text":"a","sampling_params":{"n":2,"n":1}}"#,
            r#"{"text":"a","sampling_params":{"n":1.0}}"#,
            r#"{"text":"a","sampling_params":{"max_new_tokens":3}}"#,
            r#"{"text":"a","sampling_params":null}"#,
            r#"{"text":"a"}"#,
            r#"{"text":["a","b"],"sampling_params":[{"n":1},{"n":1}]}"#,
        ] {
            assert_eq!(check(one).unwrap(), Decision::Disaggregate, "{one}");
        }
    }

    #[test]
    fn generate_batches_get_a_room_per_element_and_logprobs_join_the_legs() {
        let c = SglangBootstrap::new();
        let r = route(Some("8998"));
        for (body, n) in [
            (
                r#"{"text":["a","b","c"],"sampling_params":{"max_new_tokens":4}}"#,
                3,
            ),
            (r#"{"input_ids":[[1,2],[3]]}"#, 2),
        ] {
            let h = c.prepare(&r, &req(Api::Generate, body)).unwrap();
            assert_eq!(h.dispatch, Dispatch::Concurrent);
            let v = json(&h.decode.body);
            let rooms = v["bootstrap_room"].as_array().unwrap();
            let distinct: std::collections::HashSet<_> = rooms.iter().collect();
            assert_eq!((rooms.len(), distinct.len()), (n, n), "{body}");
            assert_eq!(v["bootstrap_port"], serde_json::json!(vec![8998; n]));
            assert_eq!(h.prefill.body.to_bytes(), h.decode.body.to_bytes());
        }
        let h = c
            .prepare(
                &r,
                &req(Api::Generate, r#"{"text":"a","return_logprob":true}"#),
            )
            .unwrap();
        assert_eq!(h.dispatch, Dispatch::Joined);
        assert!(json(&h.decode.body)["bootstrap_room"].is_u64());
    }

    #[tokio::test]
    async fn a_joined_plan_takes_the_prefill_logprobs_as_its_reshape() {
        let c = SglangBootstrap::new();
        let r = route(None);
        let mut h = c
            .prepare(
                &r,
                &req(Api::Generate, r#"{"text":"a","return_logprob":true}"#),
            )
            .unwrap();
        let answer = PrefillAnswer {
            status: http::StatusCode::OK,
            headers: HeaderMap::new(),
            body: Bytes::from_static(
                br#"{"text":"x","meta_info":{"input_token_logprobs":[[null,5,null]]}}"#,
            ),
        };
        assert_eq!(
            c.complete(&mut h, &answer).await.unwrap(),
            HandoffFound::Handed
        );
        assert!(h.reshape.is_some());
        // Without logprobs in the prefill's answer, the decode's passes unchanged.
        let mut h = c
            .prepare(
                &r,
                &req(Api::Generate, r#"{"text":"a","return_logprob":true}"#),
            )
            .unwrap();
        let bare = PrefillAnswer {
            body: Bytes::from_static(br#"{"text":"x","meta_info":{}}"#),
            ..answer
        };
        c.complete(&mut h, &bare).await.unwrap();
        assert!(h.reshape.is_none());
    }

    #[test]
    fn each_prepare_draws_new_rooms() {
        let c = SglangBootstrap::new();
        let r = req(Api::Completions, r#"{"prompt":"a"}"#);
        let a = c.prepare(&route(None), &r).unwrap();
        let b = c.prepare(&route(None), &r).unwrap();
        assert_ne!(
            a.decode.body.get("bootstrap_room"),
            b.decode.body.get("bootstrap_room")
        );
    }

    #[test]
    fn ranks_go_where_sglang_reads_them() {
        let c = SglangBootstrap::new();
        let r = req(Api::Completions, r#"{"prompt":"a"}"#);
        let h = c.prepare(&route(None), &r).unwrap();
        for leg in [&h.prefill, &h.decode] {
            for field in [ROUTED_DP_RANK, PREFILL_DP_RANK, "data_parallel_rank"] {
                assert!(leg.body.get(field).is_none(), "{field}");
            }
        }
        // Both ranks: the legs differ.
        let h = c.prepare(&ranked(Some(2), Some(5)), &r).unwrap();
        let (p, d) = (json(&h.prefill.body), json(&h.decode.body));
        assert_eq!(p[ROUTED_DP_RANK], 2);
        assert_eq!(p[PREFILL_DP_RANK], 2);
        assert_eq!(d[ROUTED_DP_RANK], 5);
        assert_eq!(d[PREFILL_DP_RANK], 2);
        for v in [&p, &d] {
            assert!(v.get("data_parallel_rank").is_none());
            assert!(v.get("data_parallel_rank_decode").is_none());
        }
        assert_eq!(p["bootstrap_room"], d["bootstrap_room"]);
        // Only the prefill's rank: the decode is told where the KV is, and picks its own.
        let h = c.prepare(&ranked(Some(1), None), &r).unwrap();
        let d = json(&h.decode.body);
        assert_eq!(d[PREFILL_DP_RANK], 1);
        assert!(d.get(ROUTED_DP_RANK).is_none());
        // Only the decode's rank: the prefill follows its room, as the decode assumes.
        let h = c.prepare(&ranked(None, Some(3)), &r).unwrap();
        let (p, d) = (json(&h.prefill.body), json(&h.decode.body));
        assert!(p.get(ROUTED_DP_RANK).is_none());
        assert_eq!(d[ROUTED_DP_RANK], 3);
        assert!(d.get(PREFILL_DP_RANK).is_none());
    }

    /// An IPv6 prefill's host goes out bracketed, single and batched: SGLang's engines
    /// join it to the port as `f"{bootstrap_host}:{port}"` (the bootstrap address of
    /// the prefill's KV sender and of the decode's KV receiver), and SGLang's own
    /// `mini_lb` brackets it (`maybe_wrap_ipv6_address`).
    #[test]
    fn an_ipv6_prefill_host_is_sent_bracketed() {
        let route = Route::new(
            Some(Arc::new(
                Endpoint::new("http://[::1]:30000", Role::Prefill)
                    .unwrap()
                    .with_facts(
                        Facts::default()
                            .with(Facts::BOOTSTRAP_PORT, "8998")
                            .unwrap(),
                    ),
            )),
            Arc::new(Endpoint::new("http://[fd00::2]:30001", Role::Decode).unwrap()),
        );
        let c = SglangBootstrap::new();
        let h = c
            .prepare(&route, &req(Api::Completions, r#"{"prompt":"a"}"#))
            .unwrap();
        for leg in [&h.prefill, &h.decode] {
            assert_eq!(leg.body.get("bootstrap_host"), Some(&br#""[::1]""#[..]));
            assert_eq!(leg.body.get("bootstrap_port"), Some(&b"8998"[..]));
        }
        let h = c
            .prepare(&route, &req(Api::Completions, r#"{"prompt":["a","b"]}"#))
            .unwrap();
        assert_eq!(
            h.decode.body.get("bootstrap_host"),
            Some(&br#"["[::1]","[::1]"]"#[..])
        );
    }

    #[test]
    fn needs_a_prefill_endpoint() {
        let mut r = route(None);
        r.prefill = None;
        assert!(matches!(
            SglangBootstrap::new().prepare(&r, &req(Api::Completions, "{}")),
            Err(ConnectorError::NeedsPrefill { .. })
        ));
    }
}
