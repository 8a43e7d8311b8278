//! vLLM 0.33's prompt-token reuse, for the NIXL connector: the decode engine takes the
//! prompt's token ids the prefill already made instead of templating and tokenizing the
//! messages again.
//!
//! Protocol (vLLM 0.33, PR #48145 with the vocabulary check of #59555):
//!
//! * a chat request with `return_token_ids: true` is answered with a top-level
//!   `prompt_token_ids`, the ids of the templated prompt
//!   (`vllm/entrypoints/openai/chat_completion/serving.py`);
//! * a chat request whose `kv_transfer_params` carries `prompt_token_ids` skips the
//!   template and the tokenizer: the renderer pops the key before the engine sees the
//!   dict (`vllm/renderers/online_renderer.py`, `_reused_prompt_token_ids`), answers 400
//!   (`param: "kv_transfer_params.prompt_token_ids"`) unless it is a non-empty list of
//!   non-negative in-vocabulary integers, and ignores it when the request has `echo` or
//!   a message that is not text. `/v1/chat/completions/batch` refuses it; the proxy does
//!   not disaggregate that route.
//!
//! So the prefill leg of a chat request asks for `return_token_ids` (the decode leg keeps
//! the client's own value, and the prefill's answer never reaches the client), and the
//! ids the prefill answered go into the decode leg's `kv_transfer_params` next to the
//! handoff. The ids are a peer's bytes: they are read in the same pass over the prefill's
//! answer as the handoff ([`top_level_read_pair`]), checked by a byte scan (a
//! JSON list of at most [`DEFAULT_MAX_IDS`] non-negative integers below 2³², or the
//! ceiling of [`VllmNixl::with_max_reused_ids`](crate::vllm::VllmNixl::with_max_reused_ids)),
//! never parsed into numbers and written again, and copied once, into the decode's dict. A
//! list that fails the check is dropped (the decode tokenizes, as without reuse) and
//! counted in [`ReuseStats::refused`]; it never fails the request.
//!
//! Whether a request reuses is decided per decode endpoint by [`PromptTokenReuse`]: `on`,
//! `off`, or `auto`, on for a decode whose [`Facts::ENGINE_VERSION`] says vLLM 0.33 or
//! later. Reading the fact is a search of the endpoint's few facts and a parse of a
//! short string, with no allocation and no lock.
//!
//! [`top_level_read_pair`]: disagg_json::top_level_read_pair

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use disagg_core::endpoint::{Endpoint, Facts};

/// The prefill answer's field holding the prompt's ids, and the decode dict's key.
pub(crate) const PROMPT_TOKEN_IDS: &str = "prompt_token_ids";

/// The prefill leg's field that asks for them.
pub(crate) const RETURN_TOKEN_IDS: &str = "return_token_ids";

/// When the decode leg of a chat request carries the prefill's prompt token ids.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PromptTokenReuse {
    /// Never: the prefill leg does not ask for them.
    Off,
    /// Always (the decode engines are known to be vLLM 0.33 or later).
    On,
    /// For a decode endpoint whose [`Facts::ENGINE_VERSION`] is vLLM 0.33 or later; off
    /// for one whose version is older or unknown.
    #[default]
    Auto,
}

/// What prompt-token reuse did, for `/metrics`.
#[derive(Debug, Default)]
pub struct ReuseStats {
    sent: AtomicU64,
    refused: AtomicU64,
}

impl ReuseStats {
    /// Decode legs sent with the prefill's prompt token ids.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Prefill answers whose `prompt_token_ids` were refused (not a list of non-negative
    /// integers, empty, or longer than the ceiling) and dropped.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

/// The NIXL connector's reuse settings.
#[derive(Debug, Clone)]
pub(crate) struct Reuse {
    pub(crate) mode: PromptTokenReuse,
    /// The most ids a prefill's answer may hold to be passed on.
    pub(crate) max_ids: usize,
    pub(crate) stats: Arc<ReuseStats>,
}

impl Default for Reuse {
    fn default() -> Self {
        Reuse {
            mode: PromptTokenReuse::default(),
            max_ids: DEFAULT_MAX_IDS,
            stats: Arc::default(),
        }
    }
}

/// The default ceiling on the ids passed on: 2²⁰, above every context length vLLM
/// serves today (about 11 MiB of JSON at most).
pub const DEFAULT_MAX_IDS: usize = 1 << 20;

impl Reuse {
    /// Whether a decode leg to `decode` may carry reused ids.
    pub(crate) fn applies(&self, decode: &Endpoint) -> bool {
        match self.mode {
            PromptTokenReuse::Off => false,
            PromptTokenReuse::On => true,
            PromptTokenReuse::Auto => decode
                .facts()
                .get(Facts::ENGINE_VERSION)
                .is_some_and(reuses),
        }
    }

    /// What to do with the `prompt_token_ids` the prefill answered (`None`: there were
    /// none), the handoff dict `params` being passed on: the dict with the ids in it,
    /// or `None` to pass `params` unchanged. Counts both outcomes.
    pub(crate) fn fold(&self, params: &Bytes, ids: Option<(Bytes, Ids)>) -> Option<Bytes> {
        match ids? {
            (ids, Ids::Valid) => {
                self.stats.sent.fetch_add(1, Ordering::Relaxed);
                Some(splice(params, &ids))
            }
            (_, Ids::Null) => None,
            (_, Ids::Refused(problem)) => {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(problem, "prefill's prompt_token_ids dropped");
                None
            }
        }
    }
}

/// Whether a vLLM release string (`"0.33.0"`, `"v0.34.1rc1"`, `"0.33.0.dev12+g1a2b"`)
/// is 0.33 or later: its first two numbers compared; anything else is not.
pub(crate) fn reuses(version: &str) -> bool {
    let v = version.strip_prefix('v').unwrap_or(version);
    let mut parts = v.split('.');
    let number = |p: Option<&str>| -> Option<u64> {
        let p = p?;
        let digits = p.bytes().take_while(u8::is_ascii_digit).count();
        p.get(..digits)?.parse().ok()
    };
    match (number(parts.next()), number(parts.next())) {
        (Some(major), Some(minor)) => (major, minor) >= (0, 33),
        _ => false,
    }
}

/// What [`read_ids`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ids {
    /// A non-empty list of non-negative integers below 2³², within the ceiling.
    Valid,
    /// `null`: no ids (not refused).
    Null,
    /// Anything else, in words.
    Refused(&'static str),
}

/// Reads the `prompt_token_ids` value at the start of `b`: how many bytes it takes and
/// whether it may be passed on, or `None` when the bytes are not JSON (the answer is then
/// malformed). A list of digits is read by one byte scan; any other value is stepped over
/// as JSON and refused.
pub(crate) fn read_ids(b: &[u8], max_ids: usize) -> Option<(usize, Ids)> {
    if let Some(found) = scan_compact(b, max_ids) {
        return Some(found);
    }
    match scan_ids(b, max_ids) {
        Some(found) => Some(found),
        None => {
            let len = crate::vllm::nixl::skip_json(b)?;
            let found = if &b[..len] == b"null" {
                Ids::Null
            } else {
                Ids::Refused("not a list of non-negative integers")
            };
            Some((len, found))
        }
    }
}

/// The fastest path of [`read_ids`], for the list as vLLM and serde write it (digits
/// and commas, no whitespace; [`digit_list`](crate::vllm::nixl::digit_list)), each id
/// checked by its length and first byte. `None` for anything else, which [`scan_ids`]
/// reads.
fn scan_compact(b: &[u8], max_ids: usize) -> Option<(usize, Ids)> {
    let mut too_large = false;
    let (len, n) = crate::vllm::nixl::digit_list(b, |id| {
        match id.len() {
            1..=9 => {}
            // Equal lengths of digits compare as their numbers.
            10 => too_large |= id > b"4294967295".as_slice(),
            _ => too_large = true,
        }
        true
    })?;
    Some((len, verdict(n, too_large, max_ids)))
}

/// What the two scans of a list of `n` unsigned integers conclude: refused past the
/// ceiling or with an id of 2³² or more, else valid.
fn verdict(n: usize, too_large: bool, max_ids: usize) -> Ids {
    if n > max_ids {
        Ids::Refused("more ids than the ceiling")
    } else if too_large {
        Ids::Refused("an id of 2^32 or more")
    } else {
        Ids::Valid
    }
}

/// The fast path of [`read_ids`]: a list of unsigned integers (JSON's grammar: no
/// leading zero, no sign, no fraction), `None` for anything else.
fn scan_ids(b: &[u8], max_ids: usize) -> Option<(usize, Ids)> {
    let ws = |i: &mut usize| {
        while matches!(b.get(*i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            *i += 1;
        }
    };
    if b.first() != Some(&b'[') {
        return None;
    }
    let mut i = 1;
    ws(&mut i);
    if b.get(i) == Some(&b']') {
        return Some((i + 1, Ids::Refused("an empty list")));
    }
    let mut n = 0usize;
    let mut too_large = false;
    loop {
        let start = i;
        let mut value = 0u64;
        while let Some(d) = b.get(i).filter(|d| d.is_ascii_digit()) {
            // Saturates past u32::MAX (refused below) without overflowing.
            value = (value * 10 + u64::from(d - b'0')).min(u64::from(u32::MAX) + 1);
            i += 1;
        }
        let digits = i - start;
        if digits == 0 || (digits > 1 && b[start] == b'0') {
            return None;
        }
        if matches!(b.get(i), Some(b'.' | b'e' | b'E')) {
            return None;
        }
        too_large |= value > u64::from(u32::MAX);
        n += 1;
        ws(&mut i);
        match b.get(i) {
            Some(b',') => {
                i += 1;
                ws(&mut i);
            }
            Some(b']') => return Some((i + 1, verdict(n, too_large, max_ids))),
            _ => return None,
        }
    }
}

/// `params` (a JSON object, checked) with `"prompt_token_ids": ids` as its last key: one
/// copy of each. A key of the same name already in `params` is overridden (the last of
/// duplicate keys wins in Python's `json`).
fn splice(params: &Bytes, ids: &[u8]) -> Bytes {
    const KEY: &[u8] = b"\"prompt_token_ids\":";
    let end = params
        .iter()
        .rposition(|&c| c == b'}')
        .unwrap_or(params.len());
    let head = &params[..end];
    let empty = head
        .iter()
        .rev()
        .find(|c| !c.is_ascii_whitespace())
        .is_none_or(|&c| c == b'{');
    let mut out = Vec::with_capacity(end + KEY.len() + ids.len() + 2);
    out.extend_from_slice(head);
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(KEY);
    out.extend_from_slice(ids);
    out.push(b'}');
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_from_0_33_reuse() {
        for v in [
            "0.33.0",
            "v0.33.1",
            "0.34.0rc1",
            "0.33.0.dev12+g1a2b",
            "1.0.0",
            "0.100",
        ] {
            assert!(reuses(v), "{v}");
        }
        for v in ["0.32.9", "0.9.2", "", "x", "0", "0.x", "-1.40", "0.32.99"] {
            assert!(!reuses(v), "{v}");
        }
    }

    #[test]
    fn ids_are_read_by_one_scan_and_refused_unless_a_list_of_unsigned_ints() {
        let read = |s: &str| read_ids(s.as_bytes(), 4);
        assert_eq!(read("[1,2, 3 ,4]rest"), Some((11, Ids::Valid)));
        assert_eq!(read("[ 0 ]"), Some((5, Ids::Valid)));
        assert_eq!(read("[4294967295]"), Some((12, Ids::Valid)));
        assert_eq!(
            read("[4294967296]"),
            Some((12, Ids::Refused("an id of 2^32 or more")))
        );
        assert_eq!(
            read("[99999999999999999999999]").map(|r| r.1),
            Some(Ids::Refused("an id of 2^32 or more"))
        );
        assert_eq!(
            read("[1,2,3,4,5]"),
            Some((11, Ids::Refused("more ids than the ceiling")))
        );
        assert_eq!(read("[]"), Some((2, Ids::Refused("an empty list"))));
        assert_eq!(read("null,"), Some((4, Ids::Null)));
        let refused = Ids::Refused("not a list of non-negative integers");
        for s in [
            "[-1]",
            "[1.5]",
            "[1e3]",
            "[\"1\"]",
            "[[1]]",
            "{\"a\":1}",
            "\"[1]\"",
            "[1,null]",
        ] {
            assert_eq!(read(s), Some((s.len(), refused)), "{s}");
        }
        // Not JSON: the answer is malformed.
        for s in ["[01]", "[1,]", "[1", "[", "[1 2]", "nul", "[-]"] {
            assert_eq!(read(s), None, "{s}");
        }
    }

    #[test]
    fn the_compact_reading_agrees_with_the_byte_scan() {
        let cases = [
            "[1,2,3]",
            "[0]",
            "[4294967295]",
            "[4294967296]",
            "[12345678901]",
            "[1,2,3,4,5]",
            "[01]",
            "[1,,2]",
            "[,1]",
            "[1,]",
            "[1 ,2]",
            "[-1]",
            "[1.5]",
            "[]",
            "[1]x",
            "[1,2]]",
        ];
        for s in cases {
            let compact = scan_compact(s.as_bytes(), 4);
            if compact.is_some() {
                assert_eq!(compact, scan_ids(s.as_bytes(), 4), "{s}");
            }
        }
        assert_eq!(scan_compact(b"[7,8]", 4), Some((5, Ids::Valid)));
    }

    #[test]
    fn ids_go_last_in_the_dict() {
        let p = Bytes::from_static(br#"{"do_remote_prefill":true,"remote_port":5600 }"#);
        assert_eq!(
            &splice(&p, b"[1,2]")[..],
            br#"{"do_remote_prefill":true,"remote_port":5600 ,"prompt_token_ids":[1,2]}"#
        );
        assert_eq!(
            &splice(&Bytes::from_static(b"{ }"), b"[7]")[..],
            br#"{ "prompt_token_ids":[7]}"#
        );
    }

    #[test]
    fn fold_counts_what_it_passes_on_and_what_it_drops() {
        let reuse = Reuse::default();
        let p = Bytes::from_static(br#"{"a":1}"#);
        let ids = |s: &'static str, found| Some((Bytes::from_static(s.as_bytes()), found));
        assert_eq!(
            reuse.fold(&p, ids("[5]", Ids::Valid)).as_deref(),
            Some(&br#"{"a":1,"prompt_token_ids":[5]}"#[..])
        );
        assert_eq!(reuse.fold(&p, ids("[-5]", Ids::Refused("x"))), None);
        assert_eq!(reuse.fold(&p, ids("null", Ids::Null)), None);
        assert_eq!(reuse.fold(&p, None), None);
        assert_eq!((reuse.stats.sent(), reuse.stats.refused()), (1, 1));
    }
}
