//! vLLM's NIXL connector in pull mode: the handoff comes back in the prefill's answer.
//!
//! Protocol (vLLM `vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py` and
//! its successors under `…/v1/nixl/`; the reference proxy is
//! `tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`):
//!
//! 1. the prefill gets the [rewritten](crate::vllm::rewrite) body plus
//!    `kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false,
//!    "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
//!    "remote_port": null}`;
//! 2. its non-streaming answer carries a top-level `kv_transfer_params` naming its engine
//!    id, the KV block ids, its side-channel host and port (and, by version,
//!    `remote_request_id`, `tp_size`, `remote_num_tokens`);
//! 3. the decode gets the client's body plus that dict **verbatim**: its shape changes
//!    between vLLM versions, so it is copied as raw bytes, never interpreted;
//! 4. when the route names data-parallel ranks (endpoints written `URL@RANK`), each leg
//!    carries its rank in `X-data-parallel-rank`, the header by which the vLLM API
//!    server lets a request pick its rank.
//!
//! When the answer's `kv_transfer_params` is missing, `null` or `{}` (the prefill ended
//! "stopped" on older vLLM, or the engine runs no KV connector), `complete` reports
//! [`HandoffFound::Missing`].
//!
//! A dict is checked before the decode sees it, as vLLM 0.33's decode reads it
//! (`vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py`
//! `update_state_after_alloc`, `…/nixl/push_scheduler.py`): with `do_remote_prefill`
//! true, a dict without `remote_block_ids` (or with none in them) trips an assertion in
//! the decode's scheduler that kills its engine core, and one without
//! `remote_engine_id`, `remote_request_id`, `remote_host` or `remote_port` parks the
//! request waiting for KV that never comes (push mode: a `KeyError`, also fatal,
//! without `remote_engine_id`, `remote_host`, `remote_port` or `tp_size`). So the dict
//! is handed on only when `do_remote_prefill` is `true`, `remote_block_ids` holds at
//! least one block id (a flat list, or one list per KV-cache group as 0.33 writes
//! them), `remote_engine_id` and `remote_request_id` are non-empty strings without
//! control characters, `remote_host` a name or IPv4 address (ASCII letters, digits, `-`,
//! `.`, `_`) or an IPv6 literal, bracketed or not, with an optional zone (at most 255
//! bytes), and `remote_port` a port number
//! from 1 to 65535 (and, when `transfer_mode` is `"push"`, `tp_size` a positive
//! integer). Anything less is [`HandoffFound::Incomplete`]: the orchestrator treats it
//! as a missing handoff. Other keys are not read (0.33 added `dcp_size`, `pp_size`,
//! `transfer_mode`, `remote_registration_generation`, `remote_blocks_expiry_time`; later
//! versions add more), and a dict that passes is still forwarded byte for byte. A dict
//! that carries `prompt_token_ids` is refused as well: a decode takes that key as the
//! prompt itself (vLLM 0.33's prompt-token reuse), which only the proxy may set (see
//! [`reuse`](crate::vllm::reuse)); so is one whose `do_remote_decode` is anything but
//! absent or `false` (a prefill answers `false`): a decode told to hand its own KV on
//! keeps the request's blocks, when it ends, for a remote decode that never comes,
//! until vLLM's abort timeout (480 s).
//!
//! Keys are read as the decode's parser (Python's `json`) reads them: a key spelled with
//! escapes (`"remote_\u0070ort"`) is decoded first, and a key repeated under any
//! spelling is refused (Python would keep the last, which the check might not have
//! read).
//!
//! With prompt-token reuse on for the decode (chat only), the prefill leg also asks for
//! `return_token_ids`, and the decode's dict gets the prefill's `prompt_token_ids`
//! spliced in as its last key, both read in the one pass over the prefill's answer.

use std::borrow::Cow;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

use self::bidi::BidiStore;

use crate::vllm::reuse::{self, PromptTokenReuse, Reuse, ReuseStats};
use crate::vllm::rewrite::PrefillRewriter;
use disagg_core::connector::{Dispatch, Handoff, HandoffFound, KvConnector, Leg, PrefillAnswer};
use disagg_core::error::ConnectorError;
use disagg_core::policy::Decision;
use disagg_core::request::{Api, PdRequest};
use disagg_core::router::Route;
use disagg_json::InvalidParam;

/// The field that carries the handoff, on requests and on the prefill's answer.
pub(crate) const KV_TRANSFER_PARAMS: &str = "kv_transfer_params";

/// The prefill leg's `kv_transfer_params`: only `do_remote_decode` matters to the engine;
/// the `null` keys are the convention every reference proxy follows.
const PREFILL_PARAMS: &[u8] = br#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// The vLLM NIXL (pull) connector: sequential, handoff in the prefill's answer.
///
/// # Examples
///
/// ```
/// use disagg_connectors::vllm::VllmNixl;
/// use disagg_core::connector::{Dispatch, KvConnector};
/// use disagg_core::endpoint::{Endpoint, Role};
/// use disagg_core::request::{Api, PdRequest};
/// use disagg_core::router::Route;
/// use std::sync::Arc;
///
/// let route = Route::new(
///     Some(Arc::new(Endpoint::new("http://p:8100", Role::Prefill)?)),
///     Arc::new(Endpoint::new("http://d:8200", Role::Decode)?),
/// );
/// let req = PdRequest::new(
///     Api::Completions,
///     Default::default(),
///     &r#"{"prompt":"hi","max_tokens":8}"#.into(),
/// )?;
/// let handoff = VllmNixl::new().prepare(&route, &req)?;
/// assert_eq!(handoff.dispatch, Dispatch::AfterPrefill);
/// assert_eq!(handoff.prefill.body.get("max_tokens"), Some(&b"1"[..]));
/// assert_eq!(handoff.decode.body.get("max_tokens"), Some(&b"8"[..]));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct VllmNixl {
    rewriter: PrefillRewriter,
    /// Bidirectional multi-turn KV, when on: the decodes' own handoffs, by conversation.
    bidi: Option<Arc<BidiStore>>,
    reuse: Reuse,
}

impl VllmNixl {
    /// The connector with the default [`PrefillRewriter`].
    pub fn new() -> Self {
        Self::default()
    }

    /// The connector with a custom rewriter.
    pub fn with_rewriter(rewriter: PrefillRewriter) -> Self {
        VllmNixl {
            rewriter,
            bidi: None,
            reuse: Reuse::default(),
        }
    }

    /// The connector with bidirectional multi-turn KV ([`bidi`]): a decode's own
    /// handoff is kept in `store` by conversation and sent on the prefill leg of the
    /// conversation's next turn. Off (the default), nothing is kept.
    #[must_use]
    pub fn with_bidirectional(mut self, store: Arc<BidiStore>) -> Self {
        self.bidi = Some(store);
        self
    }

    /// The connector with prompt-token reuse set to `mode` (the default is
    /// [`PromptTokenReuse::Auto`]), counted in `stats` (see [`reuse`]).
    pub fn with_prompt_token_reuse(
        mut self,
        mode: PromptTokenReuse,
        stats: Arc<ReuseStats>,
    ) -> Self {
        self.reuse.mode = mode;
        self.reuse.stats = stats;
        self
    }

    /// The connector passing on at most `max` reused prompt token ids (a prefill's
    /// longer list is dropped and counted; the default is
    /// [`DEFAULT_MAX_IDS`](crate::vllm::reuse::DEFAULT_MAX_IDS)).
    pub fn with_max_reused_ids(mut self, max: usize) -> Self {
        self.reuse.max_ids = max;
        self
    }
}

#[async_trait]
impl KvConnector for VllmNixl {
    fn name(&self) -> &'static str {
        "vllm-nixl"
    }

    /// [`check_request`](crate::vllm::rewrite::check::check_request) with the rewriter's
    /// limits: what vLLM refuses in the fields the prefill leg changes, and beam search
    /// served direct; so is a completions request of several prompts (reason `batch`:
    /// the prefill's answer carries one handoff, prompt 0's).
    fn check(&self, req: &PdRequest) -> Result<Decision, InvalidParam> {
        crate::vllm::rewrite::check::check_one_handoff(req, self.rewriter.limits())
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        crate::common::openai_only(self.name(), req.api())?;
        let prefill_ep = route.prefill.clone().ok_or(ConnectorError::NeedsPrefill {
            connector: self.name(),
        })?;
        let mut prefill = self.rewriter.rewrite(req.api(), req.body());
        // The conversation's last decode handoff, if kept: the prefill pulls that prefix.
        let conversation = self.bidi.as_ref().and_then(|s| Some((s, s.key(req)?)));
        let taken = conversation
            .as_ref()
            .and_then(|(store, key)| store.take(key));
        let params = taken
            .as_ref()
            .map_or(Bytes::from_static(PREFILL_PARAMS), |t| t.dict.clone());
        prefill.set_raw(KV_TRANSFER_PARAMS, params);
        if req.api() == Api::Chat && self.reuse.applies(&route.decode) {
            prefill.set_raw(reuse::RETURN_TOKEN_IDS, Bytes::from_static(b"true"));
        }
        let mut prefill = Leg::new(prefill_ep, prefill);
        prefill.set_rank(route.prefill_rank);
        let mut decode = Leg::new(route.decode.clone(), req.body().clone());
        decode.set_rank(route.decode_rank);
        let mut handoff = Handoff::new(Dispatch::AfterPrefill, prefill, decode);
        if let Some((store, key)) = conversation {
            handoff.returned = Some(Arc::new(bidi::Capture {
                store: Arc::clone(store),
                key,
                host: route.decode.host().into(),
                taken: std::sync::Mutex::new(taken),
            }));
        }
        Ok(handoff)
    }

    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<HandoffFound, ConnectorError> {
        let invalid = |source| ConnectorError::InvalidAnswer {
            endpoint: handoff.prefill.endpoint.id().clone(),
            source,
        };
        // The dict's bytes are read once, by the handoff's own validating reading; with
        // reuse on (the prefill leg asked for them), the prompt's ids in the same pass.
        let reusing = self.reuse.applies(&handoff.decode.endpoint)
            && handoff.prefill.body.get(reuse::RETURN_TOKEN_IDS) == Some(b"true");
        let (found, ids) = if reusing {
            let max = self.reuse.max_ids;
            disagg_json::top_level_read_pair(
                &answer.body,
                (KV_TRANSFER_PARAMS, read_handoff),
                (reuse::PROMPT_TOKEN_IDS, |b: &[u8]| reuse::read_ids(b, max)),
            )
            .map_err(invalid)?
        } else {
            let found = disagg_json::top_level_read(&answer.body, KV_TRANSFER_PARAMS, read_handoff)
                .map_err(invalid)?;
            (found, None)
        };
        let Some((params, read)) = found else {
            return Ok(HandoffFound::Missing);
        };
        match read {
            Read::Other if &params[..] == b"null" => return Ok(HandoffFound::Missing),
            Read::Other => {
                return Err(ConnectorError::InvalidHandoff {
                    endpoint: handoff.prefill.endpoint.id().clone(),
                    field: KV_TRANSFER_PARAMS,
                });
            }
            Read::Dict(_) if is_empty_object(&params) => return Ok(HandoffFound::Missing),
            Read::Dict(Err(problem)) => return Ok(HandoffFound::Incomplete { problem }),
            Read::Dict(Ok(())) => {}
        }
        let params = match self.reuse.fold(&params, ids) {
            Some(with_ids) => with_ids,
            None => params,
        };
        handoff.decode.body.set_raw(KV_TRANSFER_PARAMS, params);
        Ok(HandoffFound::Handed)
    }

    /// The decode leg as a one-token, non-streaming prefill (the [default
    /// rewriter](PrefillRewriter::new)'s body, a Messages body without an `enabled`
    /// `thinking` block, which vLLM would refuse at one token): the decode engine pulls
    /// the KV the handoff names and frees it once that token is made.
    fn release_leg(&self, api: Api, decode: &Leg) -> Option<bytes::Bytes> {
        Some(crate::vllm::rewrite::release_body(api, &decode.body).to_bytes())
    }

    /// NIXL's handshake refuses a peer whose compatibility hash differs, and the hash
    /// covers the vLLM version (`vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py`).
    fn equal_versions(&self) -> bool {
        true
    }

    /// NIXL maps ranks by the ratio of the sizes (a decode rank reads from prefill rank
    /// `tp_rank / (decode_tp / prefill_tp)`; vLLM's compatibility matrix lists
    /// heterogeneous TP as supported), so one size must divide the other.
    fn bridges_tp(&self, prefill_tp: u32, decode_tp: u32) -> bool {
        let (lo, hi) = (prefill_tp.min(decode_tp), prefill_tp.max(decode_tp));
        lo > 0 && hi % lo == 0
    }
}

/// What [`read_handoff`] found in a value that is JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Read {
    /// A dict: whether a vLLM 0.33 decode can take it, or what is wrong, in words.
    Dict(Result<(), &'static str>),
    /// Another type of value.
    Other,
}

/// Whether `raw` (the whole of it, whitespace around it allowed) is a handoff dict a
/// vLLM 0.33 decode can take: `Err(None)` when it is not JSON, `Err(Some(problem))`
/// when it is JSON but not such a dict.
#[cfg(test)]
fn check_handoff(raw: &[u8]) -> Result<(), Option<&'static str>> {
    let start = raw.iter().take_while(|c| c.is_ascii_whitespace()).count();
    let (len, read) = read_handoff(&raw[start..]).ok_or(None)?;
    if !raw[start + len..].iter().all(u8::is_ascii_whitespace) {
        return Err(None);
    }
    match read {
        Read::Dict(rule) => rule.map_err(Some),
        Read::Other => Err(Some("not a dict")),
    }
}

/// Reads the handoff value at the start of `b` (the prefill's answer from the value's
/// first byte on): how many bytes it takes and whether it is a dict a vLLM 0.33 decode
/// can take (see the [module docs](self)), or `None` when the bytes are not JSON.
///
/// One validating scan of the value's bytes, inside the reading of the answer, rather
/// than serde: a serde pass to check the answer's value as JSON, then a derived struct
/// of raw values and one parse per read value, cost ~11,500 instructions per request,
/// 9% of the whole NIXL request path (docs/performance.md). It refuses what serde_json
/// refuses (a control byte or an unknown escape in a string, a number outside JSON's
/// grammar, a bad literal; bytes that are not UTF-8 pass both, and the decode's own
/// parser refuses them), and on JSON it decides as a reading of the parsed dict would
/// (property tests hold it to both). It never panics or reads past its input; it
/// recurses, so a dict nesting deeper than 127 levels is refused as a handoff (no
/// handoff nests beyond three). A key spelled with escapes (`"remote\u005fport"`,
/// which no engine writes) is decoded before it is matched, as the decode's parser
/// decodes it, so its value is checked and a second spelling of a key is a repeat; a
/// key whose escapes make no Unicode text (a lone surrogate) refuses the dict.
pub(crate) fn read_handoff(b: &[u8]) -> Option<(usize, Read)> {
    let mut s = Scan {
        b,
        i: 0,
        too_deep: false,
    };
    if s.peek()? != b'{' {
        s.value(0)?;
        return Some((s.i, Read::Other));
    }
    let rule = handoff_dict(&mut s)?;
    let rule = if s.too_deep {
        Err("kv_transfer_params nests deeper than 127 levels")
    } else {
        rule
    };
    Some((s.i, Read::Dict(rule)))
}

/// The dict at the cursor, read to its end: `None` when it is not JSON, else whether a
/// vLLM 0.33 decode can take it.
fn handoff_dict<'a>(s: &mut Scan<'a>) -> Option<Result<(), &'static str>> {
    let raw = s.b;
    // One slot per key read: the value's bytes, exactly as written.
    let mut read: [Option<&'a [u8]>; KEYS.len()] = [None; KEYS.len()];
    let mut blocks = None;
    let mut repeated = false;
    let mut unreadable_key = false;
    if !s.eat(b'{') {
        return None;
    }
    s.skip_ws();
    if !s.eat(b'}') {
        loop {
            let key = s.string()?;
            s.skip_ws();
            if !s.eat(b':') {
                return None;
            }
            s.skip_ws();
            // A key of its own (`"a"`) has its quotes: compare what is between them, as
            // the decode's parser reads it (a key spelled with escapes decoded first).
            let slot = match key_slot(key) {
                Some(slot) => slot,
                None => {
                    unreadable_key = true;
                    None
                }
            };
            let value = if slot == Some(BLOCKS) {
                // Counted as it is stepped over, so the list is read once.
                let start = s.i;
                blocks = s.block_ids();
                if blocks.is_none() {
                    s.i = start;
                    s.value(1)?;
                }
                &raw[start..s.i]
            } else {
                s.value(1)?
            };
            // A repeated key is refused once the whole dict is known to be JSON.
            repeated |= slot.is_some_and(|k| read[k].replace(value).is_some());
            s.skip_ws();
            if s.eat(b',') {
                s.skip_ws();
                continue;
            }
            if s.eat(b'}') {
                break;
            }
            return None;
        }
    }
    if unreadable_key {
        return Some(Err("kv_transfer_params has a key that is not Unicode text"));
    }
    Some(handoff_rules(read, blocks, repeated))
}

/// Where the scanned key `key` (quotes included) is in [`KEYS`]: `Some(None)` for
/// another key, `None` for a key whose escapes make no Unicode text (a lone surrogate).
/// A key spelled with escapes is decoded first, as Python's `json` (the decode's parser)
/// decodes it: `"remote_\u0070ort"` is `remote_port`, so a second spelling of a key is a
/// repeat, never a key the check does not see.
fn key_slot(key: &[u8]) -> Option<Option<usize>> {
    let name = string_bytes(key)?;
    Some(KEYS.iter().position(|k| k.as_bytes() == &*name))
}

/// The text of the JSON string `raw` (its quotes included) as the decode's parser reads
/// it: the bytes as written when they hold no escape (nothing allocated), else decoded.
/// `None` for a value that is no string, or whose escapes make no Unicode text (a lone
/// surrogate).
fn string_bytes(raw: &[u8]) -> Option<Cow<'_, [u8]>> {
    let text = raw.strip_prefix(b"\"")?.strip_suffix(b"\"")?;
    if memchr::memchr(b'\\', text).is_none() {
        return Some(Cow::Borrowed(text));
    }
    let decoded = serde_json::from_slice::<String>(raw).ok()?;
    Some(Cow::Owned(decoded.into_bytes()))
}

/// Whether the keys read from a dict (see [`KEYS`]) make a handoff a vLLM 0.33 decode
/// can take.
fn handoff_rules(
    read: [Option<&[u8]>; KEYS.len()],
    blocks: Option<usize>,
    repeated: bool,
) -> Result<(), &'static str> {
    if repeated {
        return Err("kv_transfer_params repeats a key");
    }
    let [
        prefill,
        _,
        engine,
        request,
        host,
        port,
        tp,
        mode,
        ids,
        decode,
    ] = read;
    if ids.is_some() {
        return Err("kv_transfer_params carries prompt_token_ids, which only the proxy sets");
    }
    if prefill != Some(b"true") {
        return Err("do_remote_prefill is not true");
    }
    if decode.is_some_and(|d| d != b"false") {
        return Err("do_remote_decode is not absent or false");
    }
    if blocks.is_none_or(|n| n == 0) {
        return Err("remote_block_ids is missing or holds no block id");
    }
    if !id_str(engine) {
        return Err(
            "remote_engine_id is missing or not a non-empty string without control characters",
        );
    }
    if !id_str(request) {
        return Err(
            "remote_request_id is missing or not a non-empty string without control characters",
        );
    }
    if !host_str(host) {
        return Err("remote_host is missing or not a host name or IP address");
    }
    if port
        .and_then(unsigned)
        .is_none_or(|p| p == 0 || p > u64::from(u16::MAX))
    {
        return Err("remote_port is missing or not a port number (1 to 65535)");
    }
    // Read as the decode reads it: `"pus\u0068"` is push mode too.
    let push = mode.and_then(string_bytes).is_some_and(|m| &*m == b"push");
    let tp = tp.and_then(unsigned);
    if push && tp.is_none_or(|t| t == 0 || t > u64::from(u32::MAX)) {
        return Err("tp_size is missing or not a positive integer (push mode)");
    }
    Ok(())
}

/// The keys of a prefill's handoff dict a vLLM 0.33 decode reads, in the order
/// [`handoff_rules`] unpacks them; the others are skipped unread.
const KEYS: [&str; 10] = [
    "do_remote_prefill",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "transfer_mode",
    "prompt_token_ids",
    "do_remote_decode",
];

/// Where `remote_block_ids` is in [`KEYS`].
const BLOCKS: usize = 1;

/// Whether `raw` is a JSON string with at least one character and no control character
/// (Unicode's `Cc`: C0, DEL, C1), escaped or not (read by [`string_bytes`]: one whose
/// escapes make no Unicode text, a lone surrogate, is refused).
fn id_str(raw: Option<&[u8]>) -> bool {
    raw.and_then(string_bytes).is_some_and(|t| {
        !t.is_empty() && std::str::from_utf8(&t).is_ok_and(|t| !t.chars().any(char::is_control))
    })
}

/// The longest `remote_host` taken: a DNS name is at most 253 bytes, an IPv6 literal
/// with brackets and a zone far less.
const MAX_HOST: usize = 255;

/// Whether `raw` is a JSON string a side-channel host can be, written without escapes
/// and at most [`MAX_HOST`] bytes: a name or IPv4 address of ASCII letters, digits,
/// `-`, `.` and `_` (container and service names), or an IPv6 literal, bracketed or
/// not, with an optional `%zone`. No whitespace, control character, port or anything
/// else a ZMQ address would read as more than a host.
fn host_str(raw: Option<&[u8]>) -> bool {
    let Some(v) = raw.filter(|v| v.first() == Some(&b'"') && v.len() > 2) else {
        return false;
    };
    let host = &v[1..v.len() - 1];
    let name = |h: &[u8]| {
        !h.is_empty()
            && h.iter()
                .all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_'))
    };
    if host.len() > MAX_HOST {
        return false;
    }
    if !host.contains(&b':') {
        return name(host);
    }
    // With a colon, an IPv6 literal (vLLM brackets a bare one itself when it builds
    // `tcp://[host]:port`), bracketed or not, with an optional `%zone`: anything else
    // would read as a host and a port (`evil:1234` made `tcp://evil:1234:5600`).
    let inner = host
        .strip_prefix(b"[")
        .and_then(|h| h.strip_suffix(b"]"))
        .unwrap_or(host);
    let (addr, zone) = match inner.iter().position(|&c| c == b'%') {
        Some(at) => (&inner[..at], Some(&inner[at + 1..])),
        None => (inner, None),
    };
    zone.is_none_or(name)
        && std::str::from_utf8(addr).is_ok_and(|a| a.parse::<std::net::Ipv6Addr>().is_ok())
}

/// A JSON non-negative integer that fits a `u64`: digits only (a sign, a fraction or an
/// exponent make it something else, as for serde's `u64`).
fn unsigned(raw: &[u8]) -> Option<u64> {
    if raw.is_empty() {
        return None;
    }
    raw.iter().try_fold(0u64, |n, &d| {
        d.is_ascii_digit()
            .then(|| n.checked_mul(10)?.checked_add(u64::from(d - b'0')))
            .flatten()
    })
}

/// Whether `t` is a JSON number: an optional minus, an integer part without leading
/// zeros, an optional fraction and exponent, each with at least one digit.
fn is_number(t: &[u8]) -> bool {
    let digits = |i: &mut usize| {
        let from = *i;
        while t.get(*i).is_some_and(u8::is_ascii_digit) {
            *i += 1;
        }
        *i > from
    };
    let mut i = usize::from(t.first() == Some(&b'-'));
    match t.get(i) {
        Some(b'0') => i += 1,
        Some(b'1'..=b'9') => {
            digits(&mut i);
        }
        _ => return false,
    }
    if t.get(i) == Some(&b'.') {
        i += 1;
        if !digits(&mut i) {
            return false;
        }
    }
    if matches!(t.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(t.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        if !digits(&mut i) {
            return false;
        }
    }
    i == t.len()
}

/// How many bytes the JSON value at the start of `b` takes, `None` when it is not JSON
/// (the handoff scan's own reading, for values read for another field of the answer).
pub(crate) fn skip_json(b: &[u8]) -> Option<usize> {
    let mut s = Scan {
        b,
        i: 0,
        too_deep: false,
    };
    s.value(1)?;
    Some(s.i)
}

/// How many block ids the list `raw` holds (see [`Scan::block_ids`]); `None` for
/// anything else or for bytes after it.
#[cfg(test)]
fn block_ids(raw: &[u8]) -> Option<usize> {
    let mut s = Scan {
        b: raw,
        i: 0,
        too_deep: false,
    };
    let n = s.block_ids()?;
    (s.i == raw.len()).then_some(n)
}

/// A flat list of non-negative integers written compactly (digits and commas, no
/// whitespace, no leading zero) at the start of `b`: how many bytes it takes and how many
/// integers it holds, each of which `id_ok` accepted. `None` for anything else
/// (another spelling, an empty list, an id `id_ok` refuses), which the callers then read
/// the slow way. The closing bracket is found by `memchr`, the bytes checked by one pass
/// without branches (which the compiler vectorizes), the ids split in a second.
pub(crate) fn digit_list(b: &[u8], mut id_ok: impl FnMut(&[u8]) -> bool) -> Option<(usize, usize)> {
    if b.first() != Some(&b'[') {
        return None;
    }
    let end = memchr::memchr(b']', b)?;
    let body = b.get(1..end).filter(|body| !body.is_empty())?;
    let plain = body
        .iter()
        .fold(true, |ok, &c| ok & (c.is_ascii_digit() | (c == b',')));
    if !plain {
        return None;
    }
    let mut n = 0usize;
    for id in body.split(|&c| c == b',') {
        if id.is_empty() || (id.len() > 1 && id[0] == b'0') || !id_ok(id) {
            return None;
        }
        n += 1;
    }
    Some((end + 1, n))
}

/// The bytes a string's reading stops at: its end (`"`), an escape (`\\`) and the
/// control bytes JSON refuses inside a string. One table lookup per byte: strings are
/// most of a handoff's bytes.
static STOPS_STRING: [bool; 256] = {
    let mut stops = [false; 256];
    let mut c = 0;
    while c < 0x20 {
        stops[c] = true;
        c += 1;
    }
    stops[b'"' as usize] = true;
    stops[b'\\' as usize] = true;
    stops
};

/// A cursor over JSON bytes. Every step moves forward or fails (`None`), so a scan ends
/// within the input's length whatever the bytes are.
struct Scan<'a> {
    b: &'a [u8],
    i: usize,
    /// A container nested deeper than [`Scan::value`] reads was stepped over unread.
    too_deep: bool,
}

impl<'a> Scan<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn eat(&mut self, byte: u8) -> bool {
        let hit = self.peek() == Some(byte);
        self.i += usize::from(hit);
        hit
    }

    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    /// A string, quotes included, as JSON allows it: no control byte, every escape one
    /// JSON knows (`\uXXXX` with four hex digits). Escapes are checked, not decoded.
    fn string(&mut self) -> Option<&'a [u8]> {
        let start = self.i;
        if !self.eat(b'"') {
            return None;
        }
        loop {
            let at = self
                .b
                .get(self.i..)?
                .iter()
                .position(|&c| STOPS_STRING[usize::from(c)])?;
            self.i += at;
            match self.b[self.i] {
                b'"' => {
                    self.i += 1;
                    return Some(&self.b[start..self.i]);
                }
                b'\\' => match *self.b.get(self.i + 1)? {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => self.i += 2,
                    b'u' => {
                        let hex = self.b.get(self.i + 2..self.i + 6)?;
                        if !hex.iter().all(u8::is_ascii_hexdigit) {
                            return None;
                        }
                        self.i += 6;
                    }
                    _ => return None,
                },
                _ => return None,
            }
        }
    }

    /// One value of any type, as written, checked as JSON: `depth` containers enclose
    /// it (the dict is the first). The reading recurses, so a container nested deeper
    /// than 127 levels is refused (no handoff nests beyond three).
    fn value(&mut self, depth: usize) -> Option<&'a [u8]> {
        const MAX_DEPTH: usize = 127;
        let start = self.i;
        match self.peek()? {
            b'"' => {
                self.string()?;
            }
            b'[' if depth < MAX_DEPTH => {
                self.list(|s| s.value(depth + 1).map(drop))?;
            }
            b'{' if depth < MAX_DEPTH => {
                self.object(depth + 1)?;
            }
            // Too deep to read by recursion: stepped over by its shape, and the dict
            // refused (see `too_deep`), so these bytes are never passed on.
            b'[' | b'{' => {
                self.too_deep = true;
                self.skip_deep()?;
            }
            _ => {
                self.scalar()?;
            }
        }
        Some(&self.b[start..self.i])
    }

    /// A container stepped over by its shape alone, without recursion: strings to
    /// their end, brackets counted.
    fn skip_deep(&mut self) -> Option<()> {
        let mut depth = 0usize;
        loop {
            match self.peek()? {
                b'"' => {
                    self.string()?;
                    continue;
                }
                b'{' | b'[' => depth += 1,
                b'}' | b']' => depth = depth.checked_sub(1)?,
                _ => {}
            }
            self.i += 1;
            if depth == 0 {
                return Some(());
            }
        }
    }

    /// An object whose values are at `depth` (keys are strings, values any JSON),
    /// stepped over.
    fn object(&mut self, depth: usize) -> Option<()> {
        if !self.eat(b'{') {
            return None;
        }
        self.skip_ws();
        if self.eat(b'}') {
            return Some(());
        }
        loop {
            self.string()?;
            self.skip_ws();
            if !self.eat(b':') {
                return None;
            }
            self.skip_ws();
            self.value(depth)?;
            self.skip_ws();
            if self.eat(b'}') {
                return Some(());
            }
            if !self.eat(b',') {
                return None;
            }
            self.skip_ws();
        }
    }

    /// How many block ids the list here holds, stepping over it: a flat list of ids
    /// (older vLLM) or a list of per-group lists (0.33). Anything else (a mix, a
    /// negative id, another type) is `None`, with the cursor somewhere inside.
    fn block_ids(&mut self) -> Option<usize> {
        // The list as engines write it (`[3,4,5]`): one pass, which long prompts need
        // (a block id per 16 tokens). Anything else is read below.
        if let Some((len, n)) = self
            .b
            .get(self.i..)
            .and_then(|rest| digit_list(rest, |id| id.len() < 20))
        {
            self.i += len;
            return Some(n);
        }
        let mut total = 0usize;
        let mut grouped = None;
        self.list(|s| {
            let is_group = s.peek() == Some(b'[');
            if *grouped.get_or_insert(is_group) != is_group {
                return None;
            }
            let n = if is_group {
                s.list(|s| s.unsigned().map(drop))?
            } else {
                s.unsigned()?;
                1
            };
            total = total.saturating_add(n);
            Some(())
        })?;
        Some(total)
    }

    /// A non-negative integer that fits a `u64`, stepped over.
    fn unsigned(&mut self) -> Option<u64> {
        self.scalar().and_then(unsigned)
    }

    /// A number or a literal (`true`, `false`, `null`), up to the next delimiter,
    /// refused unless JSON's grammar allows it.
    fn scalar(&mut self) -> Option<&'a [u8]> {
        let start = self.i;
        let rest = self.b.get(start..)?;
        let len = rest
            .iter()
            .position(|&c| matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
            .unwrap_or(rest.len());
        let token = &rest[..len];
        if !(matches!(token, b"true" | b"false" | b"null") || is_number(token)) {
            return None;
        }
        self.i += len;
        Some(token)
    }

    /// A list whose every element `item` reads (from its first byte); how many there
    /// were.
    fn list(&mut self, mut item: impl FnMut(&mut Self) -> Option<()>) -> Option<usize> {
        self.skip_ws();
        if !self.eat(b'[') {
            return None;
        }
        self.skip_ws();
        if self.eat(b']') {
            return Some(0);
        }
        let mut n = 0usize;
        loop {
            item(self)?;
            n += 1;
            self.skip_ws();
            if self.eat(b']') {
                return Some(n);
            }
            if !self.eat(b',') {
                return None;
            }
            self.skip_ws();
        }
    }
}

fn is_empty_object(raw: &[u8]) -> bool {
    raw.iter()
        .filter(|b| !b.is_ascii_whitespace())
        .eq(b"{}".iter())
}

pub mod bidi;
#[cfg(test)]
mod tests;
