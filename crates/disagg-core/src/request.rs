//! [`PdRequest`]: one client request, parsed once, cleaned of handoff fields.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};

use disagg_json::BodyError;
use disagg_json::JsonBody;
use disagg_json::raw;

/// The API a request belongs to: OpenAI's chat and completions, SGLang's native
/// `/generate`, and the other generation routes vLLM 0.33 takes a KV handoff on
/// (`kv_transfer_params`, `vllm/entrypoints/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Api {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
    /// `POST /generate`, SGLang's native API (`text` or `input_ids`, single or batch;
    /// `sampling_params`; `return_logprob`), served P/D by the SGLang connector
    /// (`sglang/srt/entrypoints/http_server.py` `generate_request`).
    Generate,
    /// `POST /inference/v1/generate`, vLLM's token-in, token-out API (`token_ids`,
    /// `sampling_params`; `vllm/entrypoints/scale_out/token_in_token_out/`).
    TokenGenerate,
    /// `POST /v1/messages`, vLLM's Anthropic Messages API (`max_tokens` required;
    /// `vllm/entrypoints/anthropic/`), served through vLLM's chat handler.
    Messages,
    /// `POST /v1/responses`, vLLM's Responses API (`max_output_tokens`;
    /// `vllm/entrypoints/openai/responses/`).
    Responses,
    /// `POST /cohere/v2/chat`, vLLM's Cohere chat API (`vllm/entrypoints/cohere/`),
    /// served through vLLM's chat handler.
    CohereChat,
}

impl Api {
    /// The request path of this API, sent to both legs.
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
            Api::Generate => "/generate",
            Api::TokenGenerate => "/inference/v1/generate",
            Api::Messages => "/v1/messages",
            Api::Responses => "/v1/responses",
            Api::CohereChat => "/cohere/v2/chat",
        }
    }

    /// The API served at `path`, if any.
    pub fn from_path(path: &str) -> Option<Api> {
        match path {
            "/v1/chat/completions" => Some(Api::Chat),
            "/v1/completions" => Some(Api::Completions),
            "/generate" => Some(Api::Generate),
            "/inference/v1/generate" => Some(Api::TokenGenerate),
            "/v1/messages" => Some(Api::Messages),
            "/v1/responses" => Some(Api::Responses),
            "/cohere/v2/chat" => Some(Api::CohereChat),
            _ => None,
        }
    }
}

/// Top-level fields that carry a KV handoff between legs, or pin a leg to an engine's
/// data-parallel rank.
///
/// They are the proxy's to write, never the client's: a client-supplied value is removed
/// when the request is built, otherwise any client could point a decode engine at a host
/// of its choosing (vLLM `kv_transfer_params.remote_host`, SGLang `bootstrap_host`), or
/// pin a leg to a rank the other leg does not expect (SGLang reads `routed_dp_rank`, its
/// deprecated alias `data_parallel_rank`, and `disagg_prefill_dp_rank`; a decode told
/// another prefill rank than the one that holds the KV fails). SGLang's
/// `GenerateReqInput` (`srt/managers/io_struct.py`) also takes `decode_tp_size` beside
/// `bootstrap_pair_key` among its disaggregation fields (the decode's tensor-parallel
/// size a prefill plans its KV transfer by) and `kv_router_hint` (a router's word on
/// which peer's HiCache storage holds a reusable prefix, passed to the storage
/// backend): both a router's to set, never a client's.
pub(crate) const HANDOFF_FIELDS: &[&str] = &[
    "kv_transfer_params",
    "ec_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "routed_dp_rank",
    "data_parallel_rank",
    "disagg_prefill_dp_rank",
    "data_parallel_rank_decode",
    "decode_tp_size",
    "kv_router_hint",
];

/// An object below the top level whose members an engine reads as if the client had
/// sent them at the top level, and which of its keys are handoffs there.
struct Nested {
    /// The keys from the top level down to the object.
    path: &'static [&'static str],
    /// Each key removed there, with the name it is given to `removed` by (`path.key`).
    keys: &'static [(&'static str, &'static str)],
}

/// The handoffs spelled below the top level. A leg without the proxy's own handoff (a
/// direct or decode-only one, a forwarded request, any leg of a connector that sends
/// none) would otherwise carry the client's.
const NESTED_HANDOFF: &[Nested] = &[
    // vLLM copies `vllm_xargs` into the request's `extra_args`, and its KV and EC
    // connectors read `kv_transfer_params` and `ec_transfer_params` from there, as if
    // the top-level field had been sent (`vllm/entrypoints/openai/.../protocol.py`,
    // `to_sampling_params`: `extra_args = vllm_xargs`, then the top-level
    // `kv_transfer_params` over it when there is one).
    Nested {
        path: &["vllm_xargs"],
        keys: &[
            ("kv_transfer_params", "vllm_xargs.kv_transfer_params"),
            ("ec_transfer_params", "vllm_xargs.ec_transfer_params"),
        ],
    },
    // vLLM's token-in route (`/inference/v1/generate`) takes `sampling_params` as
    // `SamplingParams` itself, `extra_args` included, and hands it to the engine, whose
    // request reads its handoff from `extra_args` (`vllm/v1/request.py`); the route
    // writes a top-level `kv_transfer_params` over it only when there is one.
    Nested {
        path: &["sampling_params", "extra_args"],
        keys: &[
            (
                "kv_transfer_params",
                "sampling_params.extra_args.kv_transfer_params",
            ),
            (
                "ec_transfer_params",
                "sampling_params.extra_args.ec_transfer_params",
            ),
        ],
    },
    // SGLang's Vertex AI route (`/vertex_generate`, or what `AIP_PREDICT_ROUTE` names)
    // builds its `GenerateReqInput` from `parameters`' members
    // (`sglang/srt/entrypoints/http_server.py`, `vertex_generate`): every handoff field
    // of `/generate` is one there.
    Nested {
        path: &["parameters"],
        keys: &[
            ("kv_transfer_params", "parameters.kv_transfer_params"),
            ("ec_transfer_params", "parameters.ec_transfer_params"),
            ("bootstrap_host", "parameters.bootstrap_host"),
            ("bootstrap_port", "parameters.bootstrap_port"),
            ("bootstrap_room", "parameters.bootstrap_room"),
            ("bootstrap_pair_key", "parameters.bootstrap_pair_key"),
            ("routed_dp_rank", "parameters.routed_dp_rank"),
            ("data_parallel_rank", "parameters.data_parallel_rank"),
            (
                "disagg_prefill_dp_rank",
                "parameters.disagg_prefill_dp_rank",
            ),
            (
                "data_parallel_rank_decode",
                "parameters.data_parallel_rank_decode",
            ),
            ("decode_tp_size", "parameters.decode_tp_size"),
            ("kv_router_hint", "parameters.kv_router_hint"),
        ],
    },
];

/// The longest list of keys of a [`Nested`].
const MAX_NESTED_KEYS: usize = HANDOFF_FIELDS.len();

const _: () = {
    let mut i = 0;
    while i < NESTED_HANDOFF.len() {
        assert!(NESTED_HANDOFF[i].keys.len() <= MAX_NESTED_KEYS);
        i += 1;
    }
};

/// Remove from `body` what no client may send an engine: the [`HANDOFF_FIELDS`] at the
/// top level and the [`NESTED_HANDOFF`] keys below it (each one removed is given to
/// `removed`, a nested one by its dotted name, for the checks of connectors whose
/// engines validate them). Whether anything was removed.
///
/// # Errors
///
/// An object on a [`NESTED_HANDOFF`] path that cannot be walked as serde reads JSON (a
/// key holding a lone UTF-16 surrogate, which Python takes and serde does not): its
/// keys cannot be told, so the body is refused rather than passed with them.
pub(crate) fn remove_handoff(
    body: &mut JsonBody,
    mut removed: impl FnMut(&'static str, Bytes),
) -> Result<bool, BodyError> {
    let mut any = false;
    for field in HANDOFF_FIELDS {
        if let Some(raw) = body.remove(field) {
            removed(field, raw);
            any = true;
        }
    }
    // Rare: an object is read only when the client sent one, member by member (no
    // value a `Value` could not hold, a `1e400` beside the key, and no count of members,
    // lets the key through); its keys are read unescaped and a repeated key's every
    // copy goes (at every level of the path), the last given to `removed`, as the
    // engines read it. Its other members keep their bytes.
    for nested in NESTED_HANDOFF {
        let Some((first, below)) = nested.path.split_first() else {
            continue;
        };
        let Some(top) = body
            .get_bytes(first)
            .filter(|raw| raw.first() == Some(&b'{'))
        else {
            continue;
        };
        let Ok(text) = std::str::from_utf8(&top) else {
            continue;
        };
        let mut found: [Option<Bytes>; MAX_NESTED_KEYS] = Default::default();
        let stripped = strip_nested(&top, text, below, nested.keys, &mut found)
            .map_err(BodyError::InvalidJson)?;
        if let Some(out) = stripped {
            for ((_, named), raw) in nested.keys.iter().zip(found) {
                if let Some(raw) = raw {
                    removed(named, raw);
                }
            }
            body.set_raw(first, Bytes::from(out));
            any = true;
        }
    }
    Ok(any)
}

/// The object `raw` (a slice of `top`) without the members `keys` names in the object
/// `path` leads to below it, and each removed value into `found` (by its place in
/// `keys`, as slices of `top`); `None` when nothing was removed or `raw` is no object.
///
/// # Errors
///
/// An object on the path that serde cannot walk (see [`remove_handoff`]).
fn strip_nested(
    top: &Bytes,
    raw: &str,
    path: &[&str],
    keys: &[(&str, &str)],
    found: &mut [Option<Bytes>],
) -> Result<Option<Vec<u8>>, serde_json::Error> {
    if !raw.starts_with('{') {
        return Ok(None);
    }
    let mut any = false;
    let mut below_failed = None;
    let mut out = Vec::with_capacity(raw.len());
    let mut o = raw::Object::open(&mut out);
    o.copy(raw, |key, value, buf| match path.split_first() {
        None => match keys.iter().position(|(k, _)| *k == key) {
            Some(i) => {
                found[i] = Some(top.slice_ref(value.get().as_bytes()));
                any = true;
                raw::Edit::Drop
            }
            None => raw::Edit::Keep,
        },
        Some((next, below)) if *next == key => {
            match strip_nested(top, value.get(), below, keys, found) {
                Ok(Some(inner)) => {
                    buf.extend_from_slice(&inner);
                    any = true;
                    raw::Edit::Wrote
                }
                Ok(None) => raw::Edit::Keep,
                Err(e) => {
                    below_failed = Some(e);
                    raw::Edit::Keep
                }
            }
        }
        Some(_) => raw::Edit::Keep,
    })?;
    o.close();
    if let Some(e) = below_failed {
        return Err(e);
    }
    Ok(any.then_some(out))
}

/// The request id header, sent on both legs.
pub(crate) const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Longest client-supplied request id that is kept; a longer one is replaced.
const MAX_REQUEST_ID_LEN: usize = 256;

/// One client request on its way through the orchestrator.
///
/// Built once per request: the body's top level is parsed here and nowhere else, handoff
/// fields the client sent are removed, and the request id is fixed.
#[derive(Debug, Clone)]
pub struct PdRequest {
    api: Api,
    headers: HeaderMap,
    body: JsonBody,
    request_id: HeaderValue,
    /// Whether `request_id` was drawn here (the client sent none usable).
    generated_id: bool,
    model: Option<Arc<str>>,
    stream: bool,
    /// When the request arrived (its parse, unless the server says otherwise).
    arrival: Instant,
    /// The size of the body it was parsed from: the buffer its fields, and every leg
    /// cut from them, keep alive (whitespace, a repeated key's earlier values and the
    /// fields removed included).
    received: usize,
    /// The handoff fields the client sent (removed from `body`), kept for the checks of
    /// connectors whose engines validate them; empty, and unallocated, for almost every
    /// request.
    removed: Vec<(&'static str, Bytes)>,
    /// The prompt's token ids, once a [`Tokenizer`](crate::tokens::Tokenizer) gave them
    /// (see [`tokens`](crate::tokens)).
    tokens: Option<crate::tokens::TokenIds>,
    /// Who sent the request, as the server identified it (an API key's short hash),
    /// for logs and summaries; never a credential.
    client: Option<Arc<str>>,
}

impl PdRequest {
    /// Parse a client request for `api` from its headers and raw body.
    ///
    /// The `x-request-id` header is kept when it is present and sane (visible ASCII, at most
    /// 256 bytes); otherwise a new random one is drawn. Servers should prefer
    /// [`Orchestrator::request`](crate::Orchestrator::request), whose ids draw no
    /// randomness per request.
    ///
    /// # Errors
    ///
    /// [`BodyError`] when the body is not a JSON object, or `model`/`stream` have the
    /// wrong type.
    pub fn new(api: Api, headers: HeaderMap, body: &Bytes) -> Result<Self, BodyError> {
        Self::build(api, headers, body, new_request_id)
    }

    /// Like [`new`](Self::new), generating a missing request id with `ids`.
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new).
    pub(crate) fn with_ids(
        api: Api,
        headers: HeaderMap,
        body: &Bytes,
        ids: &RequestIds,
    ) -> Result<Self, BodyError> {
        Self::build(api, headers, body, || ids.next_id())
    }

    fn build(
        api: Api,
        headers: HeaderMap,
        body: &Bytes,
        new_id: impl FnOnce() -> HeaderValue,
    ) -> Result<Self, BodyError> {
        let received = body.len();
        let mut body = JsonBody::parse_bytes(body)?;
        let mut removed = Vec::new();
        remove_handoff(&mut body, |field, raw| removed.push((field, raw)))?;
        let model = match body.get_as::<Option<String>>("model") {
            None => None,
            Some(Ok(m)) => m.map(Arc::from),
            Some(Err(_)) => {
                return Err(BodyError::FieldType {
                    field: "model",
                    expected: "a string",
                });
            }
        };
        // Read as the engines' pydantic models read it (`"yes"`, `1` and `"true"` are
        // true): the decode leg carries the client's value, and the proxy must frame the
        // answer as the engine will.
        let stream = match body.get("stream").map(disagg_json::lax::bool_value) {
            None | Some(Ok(None)) => false,
            Some(Ok(Some(s))) => s,
            Some(Err(disagg_json::lax::Refused)) => {
                return Err(BodyError::FieldType {
                    field: "stream",
                    expected: "a boolean",
                });
            }
        };
        let client_id = headers
            .get(&REQUEST_ID)
            .filter(|v| {
                !v.is_empty()
                    && v.len() <= MAX_REQUEST_ID_LEN
                    && v.as_bytes().iter().all(|b| b.is_ascii_graphic())
            })
            .cloned();
        let generated_id = client_id.is_none();
        let request_id = client_id.unwrap_or_else(new_id);
        Ok(PdRequest {
            api,
            headers,
            body,
            request_id,
            generated_id,
            model,
            stream,
            arrival: crate::outcome::now(),
            received,
            removed,
            tokens: None,
            client: None,
        })
    }

    /// The raw value of a handoff field the client sent (one `PdRequest::new` removes:
    /// `kv_transfer_params`, the bootstrap fields, the rank fields), which the legs never
    /// carry (the vLLM connectors refuse a `kv_transfer_params` that is not an object,
    /// as vLLM would).
    pub(crate) fn client_handoff(&self, field: &str) -> Option<&[u8]> {
        self.removed
            .iter()
            .find(|(f, _)| *f == field)
            .map(|(_, raw)| &raw[..])
    }

    /// The API.
    pub fn api(&self) -> Api {
        self.api
    }

    /// The client's headers, as received.
    pub(crate) fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The client's header `name`, as received (a connector keying a conversation by a
    /// session header reads it here).
    pub fn header(&self, name: &str) -> Option<&HeaderValue> {
        self.headers.get(name)
    }

    /// The client's body, without handoff fields.
    pub fn body(&self) -> &JsonBody {
        &self.body
    }

    /// The parsed body, to change before the legs are planned (the encoder stage's
    /// fields).
    pub(crate) fn body_mut(&mut self) -> &mut JsonBody {
        &mut self.body
    }

    /// The request's id: the client's `x-request-id` when it sent a usable one, else one
    /// drawn for it. It names the request in the answer and the logs; the engines get an
    /// id of the proxy's per attempt (the orchestrator's), which for a first attempt is
    /// this one when it was drawn here.
    pub(crate) fn request_id(&self) -> &HeaderValue {
        &self.request_id
    }

    /// Whether [`request_id`](Self::request_id) was drawn by the proxy rather than sent
    /// by the client (and so is unique, and fit to be an engine-side id).
    pub(crate) fn has_generated_id(&self) -> bool {
        self.generated_id
    }

    /// The requested model, if the body names one.
    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    /// The requested model, shared.
    pub(crate) fn model_arc(&self) -> Option<Arc<str>> {
        self.model.clone()
    }

    /// Whether the client asked for a stream.
    pub fn is_stream(&self) -> bool {
        self.stream
    }

    /// When the request arrived: when it was parsed, unless the server said when its
    /// head came in ([`set_received`](Self::set_received)). Request durations and the
    /// time to the first byte count from here.
    pub(crate) fn arrival(&self) -> Instant {
        self.arrival
    }

    /// The size of the body the request was parsed from, which its legs keep alive.
    pub(crate) fn received_len(&self) -> usize {
        self.received
    }

    /// Record what the server knows of how the request came in: `at`, when its head
    /// came in, before the body was read (request durations and the time to the first
    /// byte then count from there rather than from the parse); and `client`, who sent
    /// it when the server identified the client (an API key's short hash; never the
    /// key), carried into the request's [`Summary`](crate::outcome::Summary) for logs.
    pub fn set_received(&mut self, at: Instant, client: Option<Arc<str>>) {
        self.arrival = at;
        self.client = client;
    }

    /// The prompt's token ids, when the orchestrator's
    /// [`Tokenizer`](crate::tokens::Tokenizer) gave them (or the application set them):
    /// see [`tokens`](crate::tokens). `None` for a request nothing asked ids for, or
    /// whose prompt could not be tokenized.
    pub fn tokens(&self) -> Option<&[u32]> {
        self.tokens.as_deref()
    }

    /// Set the prompt's token ids (an application that tokenized the request itself;
    /// the orchestrator then does not tokenize it again).
    pub fn set_tokens(&mut self, tokens: Option<crate::tokens::TokenIds>) {
        self.tokens = tokens;
    }

    /// Who sent the request, as the server named it
    /// ([`set_received`](Self::set_received)): with client keys, the key's short hash; a
    /// connector keeping state per client scopes it by this.
    pub fn client(&self) -> Option<Arc<str>> {
        self.client.clone()
    }
}

/// Generates request ids: a counter, keyed.
///
/// Ids are 32 lowercase hex digits: the high half is the counter under a keyed hash
/// (std's `RandomState`: SipHash-1-3 under the process's secret 128-bit key, varied per
/// generator), the low half
/// the counter plus a random offset, so ids are unique within the generator (the low
/// half alone differs), and no number of ids seen tells the next one (a client that
/// could name another request's engine-side id could collide with it on an engine).
/// Drawing one costs no system call. (Private: `generated_ids_are_distinct_hex` below
/// pins the format.)
#[derive(Debug)]
pub(crate) struct RequestIds {
    keys: std::collections::hash_map::RandomState,
    offset: u64,
    counter: std::sync::atomic::AtomicU64,
}

impl Default for RequestIds {
    fn default() -> Self {
        Self::new()
    }
}

impl RequestIds {
    /// A generator with a random key and offset.
    pub(crate) fn new() -> Self {
        Self::from_offset(uuid::Uuid::new_v4().as_u128() as u64)
    }

    /// A generator whose low halves start at `offset` (its key is random).
    pub(crate) fn from_offset(offset: u64) -> Self {
        RequestIds {
            keys: std::collections::hash_map::RandomState::new(),
            offset,
            counter: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The next id.
    pub(crate) fn next_id(&self) -> HeaderValue {
        use std::hash::BuildHasher;
        let n = self
            .counter
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let hi = self.keys.hash_one(n);
        let lo = self.offset.wrapping_add(n);
        let mut buf = [0u8; 32];
        for (i, byte) in hi.to_be_bytes().iter().chain(&lo.to_be_bytes()).enumerate() {
            buf[2 * i] = HEX[usize::from(byte >> 4)];
            buf[2 * i + 1] = HEX[usize::from(byte & 0xf)];
        }
        // Hex digits are always a valid header value.
        HeaderValue::from_bytes(&buf).unwrap_or_else(|_| HeaderValue::from_static("0"))
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// A fresh request id: a random UUID, hyphenless.
pub(crate) fn new_request_id() -> HeaderValue {
    let mut buf = [0u8; 32];
    let s = uuid::Uuid::new_v4().simple().encode_lower(&mut buf);
    HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static("0"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(headers: HeaderMap, body: &str) -> Result<PdRequest, BodyError> {
        PdRequest::new(Api::Chat, headers, &Bytes::from(body.to_owned()))
    }

    #[test]
    fn strips_client_handoff_fields() {
        let r = req(
            HeaderMap::new(),
            r#"{"model":"m","kv_transfer_params":{"remote_host":"evil"},"bootstrap_host":"evil","bootstrap_port":1,"bootstrap_room":2,"routed_dp_rank":1,"data_parallel_rank":1,"disagg_prefill_dp_rank":1,"data_parallel_rank_decode":1,"decode_tp_size":3,"kv_router_hint":{"source_control_endpoint":"tcp://evil:25000","block_hashes":["1"]},"messages":[]}"#,
        )
        .unwrap();
        assert_eq!(r.body().keys().collect::<Vec<_>>(), ["model", "messages"]);
        assert_eq!(r.model(), Some("m"));
        assert!(!r.is_stream());
    }

    /// vLLM reads `vllm_xargs.kv_transfer_params` as the handoff when the top level has
    /// none: the nested spelling is removed too, escaped or repeated, and the client's
    /// other extra arguments stay.
    #[test]
    fn strips_the_handoff_nested_in_vllm_xargs() {
        let r = req(
            HeaderMap::new(),
            r#"{"model":"m","vllm_xargs":{"kv_transfer_params":"x","\u0065c_transfer_params":{"a":1},"mine":2,"kv_transfer_params":{"remote_host":"evil"}},"prompt":"p"}"#,
        )
        .unwrap();
        assert_eq!(
            r.body().keys().collect::<Vec<_>>(),
            ["model", "vllm_xargs", "prompt"]
        );
        let xargs: serde_json::Value = r.body().get_as("vllm_xargs").unwrap().unwrap();
        assert_eq!(xargs, serde_json::json!({"mine": 2}));
        // Nothing else touched: a body without them keeps its bytes.
        let plain = r#"{"model":"m","vllm_xargs":{"mine":"kv_transfer_params"}}"#;
        let r = req(HeaderMap::new(), plain).unwrap();
        assert_eq!(
            r.body().get("vllm_xargs"),
            Some(&br#"{"mine":"kv_transfer_params"}"#[..])
        );
    }

    /// vLLM's token-in route reads the handoff from `sampling_params.extra_args`, and
    /// SGLang's Vertex route splats `parameters` into its request: both spellings go,
    /// escaped or repeated at either level, and everything beside them stays as written.
    #[test]
    fn strips_the_handoff_nested_in_sampling_params_and_parameters() {
        let body = r#"{"token_ids":[1],"sampling_params":{"max_tokens":8,"extra_args":{"kv_transfer_params":{"remote_host":"evil"},"mine":1},"extra_args":{"\u006bv_transfer_params":{"remote_host":"evil2"},"ec_transfer_params":1,"keep":2}},"parameters":{"bootstrap_host":"evil","b\u006fotstrap_port":8998,"bootstrap_room":1,"routed_dp_rank":0,"decode_tp_size":3,"kv_router_hint":{"source_control_endpoint":"tcp://evil:25000"},"temperature":0}}"#;
        let r = req(HeaderMap::new(), body).unwrap();
        let text = String::from_utf8(r.body().to_bytes().to_vec()).unwrap();
        assert!(!text.contains("evil") && !text.contains("8998"), "{text}");
        assert_eq!(
            r.body().get("sampling_params"),
            Some(&br#"{"max_tokens":8,"extra_args":{"mine":1},"extra_args":{"keep":2}}"#[..])
        );
        assert_eq!(
            r.body().get("parameters"),
            Some(&br#"{"temperature":0}"#[..])
        );
        let mut removed: Vec<&str> = r.removed.iter().map(|(name, _)| *name).collect();
        removed.sort_unstable();
        assert_eq!(
            removed,
            [
                "parameters.bootstrap_host",
                "parameters.bootstrap_port",
                "parameters.bootstrap_room",
                "parameters.decode_tp_size",
                "parameters.kv_router_hint",
                "parameters.routed_dp_rank",
                "sampling_params.extra_args.ec_transfer_params",
                "sampling_params.extra_args.kv_transfer_params",
            ]
        );
        // The last of a repeated key is the one given, as the engines read it.
        let kv = r.client_handoff("sampling_params.extra_args.kv_transfer_params");
        assert_eq!(kv, Some(&br#"{"remote_host":"evil2"}"#[..]));
        // A key of the same name elsewhere, or the objects without one, keep their bytes.
        let plain = r#"{"sampling_params":{"kv_transfer_params":1,"extra_args":{"mine":"kv_transfer_params"}},"parameters":[{"bootstrap_host":"h"}],"extra_args":{"kv_transfer_params":1}}"#;
        let r = req(HeaderMap::new(), plain).unwrap();
        assert_eq!(&r.body().to_bytes()[..], plain.as_bytes());
        assert!(r.removed.is_empty());
    }

    /// A nested object whose keys serde cannot read (a lone surrogate, which Python
    /// reads) is refused, at either level of a path and in either place: its handoff
    /// keys could not be told, and would reach the engine.
    #[test]
    fn a_nested_object_whose_keys_cannot_be_read_is_refused() {
        for body in [
            r#"{"vllm_xargs":{"\udc00":0,"kv_transfer_params":{"remote_host":"evil"}}}"#,
            r#"{"sampling_params":{"extra_args":{"kv_transfer_params":1,"\ud800":0}}}"#,
            r#"{"sampling_params":{"\udfff":0,"extra_args":{"kv_transfer_params":1}}}"#,
            r#"{"parameters":{"\udc00x":0,"bootstrap_host":"evil"}}"#,
        ] {
            let r = req(HeaderMap::new(), body);
            assert!(matches!(r, Err(BodyError::InvalidJson(_))), "{body}: {r:?}");
        }
        // Elsewhere such a key is the engine's business, as before.
        let fine = r#"{"other":{"\udc00":0},"sampling_params":{"extra_args":{"x":{"\udc00":1}}}}"#;
        assert!(req(HeaderMap::new(), fine).is_ok());
    }

    /// A value `serde_json::Value` cannot hold (a number past `f64`, which Python reads
    /// as `inf`) beside the nested key does not let the key through.
    #[test]
    fn the_nested_handoff_goes_whatever_sits_beside_it() {
        let r = req(
            HeaderMap::new(),
            r#"{"model":"m","vllm_xargs":{"pad":1e400,"kv_transfer_params":"x","big":123456789012345678901234567890}}"#,
        )
        .unwrap();
        assert_eq!(
            r.body().get("vllm_xargs"),
            Some(&br#"{"pad":1e400,"big":123456789012345678901234567890}"#[..])
        );
        // However many members sit beside it: past the top level's field ceiling too
        // (a parse of the object as a body refused it, and the key went through).
        let pad: Vec<String> = (0..2000).map(|i| format!(r#""k{i}":0"#)).collect();
        let body = format!(
            r#"{{"model":"m","vllm_xargs":{{{},"kv_transfer_params":{{"remote_host":"evil"}}}}}}"#,
            pad.join(",")
        );
        let r = req(HeaderMap::new(), &body).unwrap();
        let xargs = std::str::from_utf8(r.body().get("vllm_xargs").unwrap()).unwrap();
        assert!(!xargs.contains("evil") && xargs.contains(r#""k1999":0"#));
        assert_eq!(r.removed.len(), 1);
    }

    #[test]
    fn request_id_kept_or_generated() {
        let mut h = HeaderMap::new();
        h.insert(REQUEST_ID, HeaderValue::from_static("abc-123"));
        assert_eq!(req(h, "{}").unwrap().request_id(), "abc-123");
        let a = req(HeaderMap::new(), "{}").unwrap();
        let b = req(HeaderMap::new(), "{}").unwrap();
        assert_eq!(a.request_id().len(), 32);
        assert_ne!(a.request_id(), b.request_id());
        let mut h = HeaderMap::new();
        h.insert(REQUEST_ID, HeaderValue::from_static("has space"));
        assert_ne!(req(h, "{}").unwrap().request_id(), "has space");
    }

    #[test]
    fn generated_ids_are_distinct_hex() {
        // The low half wraps past `u64::MAX` here.
        let ids = RequestIds::from_offset(u64::MAX - 10);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..10_000 {
            let id = ids.next_id();
            assert_eq!(id.len(), 32);
            assert!(id.as_bytes().iter().all(u8::is_ascii_hexdigit));
            assert!(seen.insert(id));
        }
        // Two generators: the same low halves, unrelated high halves (each its own key),
        // so a run of ids seen says nothing of another generator's, nor of the next.
        let (a, b) = (RequestIds::from_offset(0), RequestIds::from_offset(0));
        let (x, y) = (a.next_id(), b.next_id());
        assert_eq!(x.as_bytes()[16..], y.as_bytes()[16..]);
        assert_ne!(x.as_bytes()[..16], y.as_bytes()[..16]);
        let r = PdRequest::with_ids(Api::Chat, HeaderMap::new(), &Bytes::from("{}"), &ids).unwrap();
        assert!(!seen.contains(r.request_id()));
    }

    #[test]
    fn field_types_checked() {
        assert!(matches!(
            req(HeaderMap::new(), r#"{"model":1}"#),
            Err(BodyError::FieldType { field: "model", .. })
        ));
        for lax in [r#""yes""#, r#""true""#, "1", "1.0", r#""On""#] {
            let r = req(HeaderMap::new(), &format!(r#"{{"stream":{lax}}}"#)).unwrap();
            assert!(r.is_stream(), "{lax}");
        }
        for no in [r#""no""#, "0", "false"] {
            let r = req(HeaderMap::new(), &format!(r#"{{"stream":{no}}}"#)).unwrap();
            assert!(!r.is_stream(), "{no}");
        }
        for bad in ["2", r#""maybe""#, "[]", r#"" yes ""#] {
            assert!(
                matches!(
                    req(HeaderMap::new(), &format!(r#"{{"stream":{bad}}}"#)),
                    Err(BodyError::FieldType {
                        field: "stream",
                        ..
                    })
                ),
                "{bad}"
            );
        }
        assert!(
            req(HeaderMap::new(), r#"{"stream":true}"#)
                .unwrap()
                .is_stream()
        );
        assert!(
            !req(HeaderMap::new(), r#"{"stream":null}"#)
                .unwrap()
                .is_stream()
        );
    }
}
