//! Bidirectional multi-turn KV for vLLM NIXL: a decode's own handoff, kept for the next
//! turn of its conversation.
//!
//! A vLLM 0.33 decode running NIXL with `kv_connector_extra_config.bidirectional_kv_xfer`
//! ends each answer (the body, a stream's terminal chunk, a Responses stream's terminal
//! `response`) with a `kv_transfer_params` of its own: `do_remote_prefill: false,
//! do_remote_decode: true`, its engine id, block ids, request id, side-channel host and
//! port, `remote_num_tokens` (the tokens it computed) and `remote_blocks_expiry_time`
//! (`vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py`). Sent as the
//! **prefill** leg's `kv_transfer_params` of the conversation's next turn, the prefill
//! pulls that prefix from the decode instead of computing it, when `remote_num_tokens` is
//! at least its `kv_recompute_threshold` (64 tokens by default); the decode holds the
//! blocks until they are read or its `decoder_kv_blocks_ttl` (480 s) ends.
//!
//! A [`BidiStore`] does the proxy's part:
//!
//! - **Capture.** [`VllmNixl::with_bidirectional`](super::VllmNixl::with_bidirectional)
//!   puts a receiver on the plan of every chat, completions and Responses request that
//!   names a conversation ([`ConversationKey`]); the orchestrator gives it the decode's
//!   `kv_transfer_params` as it blanks it for the client (nothing more is buffered). The
//!   value is peer bytes: it is kept only when it is at most
//!   [`BidiConfig::max_handoff_bytes`], a JSON object with `do_remote_decode: true`, a
//!   non-empty `remote_engine_id` and `remote_request_id` (without control
//!   characters) and `remote_block_ids`, a `remote_port` from 1 to 65535 and a
//!   `remote_num_tokens`, and no `prompt_token_ids` (a prefill given that key takes it
//!   as its prompt, vLLM 0.33's prompt-token reuse; only the proxy sets it, so a decode
//!   writing it is not trusted with the rest of its dict either); anything else is
//!   dropped and counted.
//!   Its `remote_host` is replaced by the decode endpoint's host, as vLLM's example
//!   proxy does (an engine's side-channel host defaults to `localhost`).
//! - **Scope.** The key is client input: with client keys (`--api-key`) it is scoped by
//!   the client's key, so a client cannot name another's conversation; without them it
//!   is taken as given, and a client naming another's conversation would have its
//!   prefill pull that conversation's KV (vLLM does not check that the pulled prefix is
//!   the prompt's): use unguessable conversation ids, or client keys.
//! - **Store.** One entry per conversation (a newer turn's replaces the older one),
//!   bounded in count and bytes (the oldest entries go first, counted), each dropped
//!   [`BidiConfig::ttl`] after it was stored (counted as expired unused). The TTL is the
//!   proxy's own: `remote_blocks_expiry_time` is the decode's monotonic clock and is
//!   never compared with the proxy's.
//! - **Reuse.** The next turn of the conversation takes the entry (it is used once) and
//!   sends it as its prefill leg's `kv_transfer_params`. Any prefill can pull it (NIXL
//!   reads from the decode wherever it is), so routing is unchanged.
//!
//! `/v1/messages`, `/cohere/v2/chat` and `/inference/v1/generate` answers have no field
//! for the decode's handoff: nothing is captured there, and a decode running the flag
//! keeps its blocks until its TTL ends.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::vllm::reuse::PROMPT_TOKEN_IDS;
use bytes::Bytes;
use disagg_core::connector::ReturnedHandoff;
use disagg_core::request::{Api, PdRequest};
use http::HeaderName;
use serde_json::{Map, Value};

/// The longest conversation key kept, in bytes: a longer one is client input the proxy
/// does not store (the request captures nothing and reuses nothing).
pub const MAX_KEY_LEN: usize = 256;

/// Where a request names its conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConversationKey {
    /// A request header (`header:x-session-id`).
    Header(HeaderName),
    /// A top-level string field of the body (`field:conversation_id`, `field:user`).
    Field(String),
}

impl Default for ConversationKey {
    /// `field:conversation_id`, the top-level field vLLM's own example proxy keys turns by.
    fn default() -> Self {
        ConversationKey::Field("conversation_id".to_owned())
    }
}

/// A [`ConversationKey`] that cannot be read from its text.
#[derive(Debug, thiserror::Error)]
#[error("a conversation key is header:NAME or field:NAME, not {0:?}")]
pub struct ConversationKeyError(String);

impl FromStr for ConversationKey {
    type Err = ConversationKeyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ConversationKeyError(s.to_owned());
        match s.split_once(':') {
            Some(("header", name)) => HeaderName::from_str(name)
                .map(ConversationKey::Header)
                .map_err(|_| bad()),
            Some(("field", name)) if !name.is_empty() => {
                Ok(ConversationKey::Field(name.to_owned()))
            }
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for ConversationKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConversationKey::Header(h) => write!(f, "header:{h}"),
            ConversationKey::Field(n) => write!(f, "field:{n}"),
        }
    }
}

impl ConversationKey {
    /// The conversation `req` names, if any: a non-empty header value or JSON string of
    /// at most [`MAX_KEY_LEN`] bytes, scoped by the client that sent it when the server
    /// knows it (a client key): one client cannot name another's conversation.
    fn of(&self, req: &PdRequest) -> Option<Box<str>> {
        let key: Box<str> = match self {
            ConversationKey::Header(h) => req.header(h.as_str())?.to_str().ok()?.into(),
            ConversationKey::Field(name) => {
                let raw = req.body().get(name)?;
                // The escapes of a JSON string make it at most 6 bytes per character
                // longer: refuse what cannot fit before reading it.
                if raw.len() > MAX_KEY_LEN * 6 + 2 {
                    return None;
                }
                serde_json::from_slice::<String>(raw).ok()?.into()
            }
        };
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            return None;
        }
        Some(match req.client() {
            Some(client) => format!("{client}\u{0}{key}").into(),
            None => key,
        })
    }
}

/// The bounds of a [`BidiStore`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct BidiConfig {
    /// Where a request names its conversation.
    pub key: ConversationKey,
    /// Conversations kept at most (default 10,000).
    pub max_entries: usize,
    /// Bytes of kept handoffs at most, keys included (default 64 MiB).
    pub max_bytes: usize,
    /// The largest decode handoff kept (default 64 KiB; a vLLM handoff is a few hundred
    /// bytes plus its block ids).
    pub max_handoff_bytes: usize,
    /// How long an entry is kept: the decode engines' `decoder_kv_blocks_ttl` (default
    /// 480 s, vLLM's), after which the decode has freed the blocks.
    pub ttl: Duration,
}

impl Default for BidiConfig {
    fn default() -> Self {
        BidiConfig {
            key: ConversationKey::default(),
            max_entries: 10_000,
            max_bytes: 64 * 1024 * 1024,
            max_handoff_bytes: 64 * 1024,
            ttl: Duration::from_secs(480),
        }
    }
}

/// What a [`BidiStore`] did, since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BidiStats {
    /// Decode handoffs kept.
    pub captured: u64,
    /// Turns whose prefill leg was sent the decode's handoff.
    pub reused: u64,
    /// Tokens those handoffs named (`remote_num_tokens`): the prefix the prefills could
    /// pull rather than compute.
    pub reused_tokens: u64,
    /// Handoffs dropped unused when their TTL ended.
    pub expired: u64,
    /// Handoffs dropped as invalid (too large, not JSON, not a decode's dict).
    pub invalid: u64,
    /// Handoffs dropped unused to keep the store within its bounds.
    pub evicted: u64,
    /// Conversations kept now.
    pub entries: u64,
    /// Bytes kept now.
    pub bytes: u64,
}

/// The decode handoffs kept for the next turn of their conversations (see the
/// [module docs](self)). Shared by the connector and whoever reads its
/// [`stats`](Self::stats); no lock is held across an await.
#[derive(Debug)]
pub struct BidiStore {
    config: BidiConfig,
    entries: Mutex<Entries>,
    captured: AtomicU64,
    reused: AtomicU64,
    reused_tokens: AtomicU64,
    expired: AtomicU64,
    invalid: AtomicU64,
    evicted: AtomicU64,
}

#[derive(Debug, Default)]
struct Entries {
    map: HashMap<Box<str>, Entry>,
    /// Keys in the order stored, with the entry's number (a replaced entry's old place
    /// is skipped when reached).
    order: VecDeque<(Box<str>, u64)>,
    bytes: usize,
    next: u64,
}

#[derive(Debug)]
struct Entry {
    dict: Bytes,
    tokens: u64,
    stored: Instant,
    seq: u64,
}

impl Entries {
    fn size(key: &str, e: &Entry) -> usize {
        key.len() + e.dict.len()
    }

    fn remove(&mut self, key: &str) -> Option<Entry> {
        let e = self.map.remove(key)?;
        self.bytes -= Self::size(key, &e);
        Some(e)
    }

    /// Drop the oldest entries while `over` says so; `expired` counts those past
    /// `ttl` at `now`, `evicted` the others.
    fn drop_front(
        &mut self,
        mut over: impl FnMut(&Self, &Entry) -> bool,
        expired: &mut u64,
        evicted: &mut u64,
        is_expired: impl Fn(&Entry) -> bool,
    ) {
        while let Some((key, seq)) = self.order.front() {
            let Some(e) = self.map.get(key) else {
                self.order.pop_front();
                continue;
            };
            if e.seq != *seq {
                self.order.pop_front();
                continue;
            }
            if !over(self, e) {
                break;
            }
            if is_expired(e) {
                *expired += 1;
            } else {
                *evicted += 1;
            }
            let (key, _) = self.order.pop_front().unwrap_or_default();
            self.remove(&key);
        }
    }
}

impl BidiStore {
    /// An empty store.
    pub fn new(config: BidiConfig) -> Arc<Self> {
        Arc::new(BidiStore {
            config,
            entries: Mutex::new(Entries::default()),
            captured: AtomicU64::new(0),
            reused: AtomicU64::new(0),
            reused_tokens: AtomicU64::new(0),
            expired: AtomicU64::new(0),
            invalid: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
        })
    }

    /// The store's bounds.
    pub fn config(&self) -> &BidiConfig {
        &self.config
    }

    /// The counters, after dropping the entries whose TTL ended.
    pub fn stats(&self) -> BidiStats {
        let (entries, bytes) = {
            let mut e = self.lock();
            self.sweep(&mut e, Instant::now());
            (e.map.len() as u64, e.bytes as u64)
        };
        BidiStats {
            captured: self.captured.load(Relaxed),
            reused: self.reused.load(Relaxed),
            reused_tokens: self.reused_tokens.load(Relaxed),
            expired: self.expired.load(Relaxed),
            invalid: self.invalid.load(Relaxed),
            evicted: self.evicted.load(Relaxed),
            entries,
            bytes,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Drop (and count) the entries whose TTL ended by `now`: they are stored in
    /// order, so they are at the front.
    fn sweep(&self, e: &mut Entries, now: Instant) {
        let ttl = self.config.ttl;
        let is_expired = |x: &Entry| now.saturating_duration_since(x.stored) >= ttl;
        let (mut expired, mut evicted) = (0, 0);
        e.drop_front(|_, x| is_expired(x), &mut expired, &mut evicted, is_expired);
        self.expired.fetch_add(expired, Relaxed);
    }

    /// The conversation `req` names, when it is one whose answers carry a decode's
    /// handoff (chat, completions, Responses).
    pub(crate) fn key(&self, req: &PdRequest) -> Option<Box<str>> {
        matches!(req.api(), Api::Chat | Api::Completions | Api::Responses)
            .then(|| self.config.key.of(req))
            .flatten()
    }

    /// Take the handoff kept for `key` (used once), if its TTL has not ended; counted
    /// as a reuse.
    pub(crate) fn take(&self, key: &str) -> Option<Taken> {
        let now = Instant::now();
        let entry = {
            let mut e = self.lock();
            self.sweep(&mut e, now);
            e.remove(key)?
        };
        // An entry put back after others were stored is checked on its own.
        if now.saturating_duration_since(entry.stored) >= self.config.ttl {
            self.expired.fetch_add(1, Relaxed);
            return None;
        }
        self.reused.fetch_add(1, Relaxed);
        self.reused_tokens.fetch_add(entry.tokens, Relaxed);
        Some(Taken {
            dict: entry.dict,
            tokens: entry.tokens,
            stored: entry.stored,
        })
    }

    /// Keep again for `key` a handoff [`take`](Self::take) gave, whose prefill leg
    /// never reached its engine: its TTL still counts from when it was first stored,
    /// and its reuse is no longer counted. A newer turn's handoff kept since wins.
    pub(crate) fn put_back(&self, key: &str, taken: Taken) {
        self.reused.fetch_sub(1, Relaxed);
        self.reused_tokens.fetch_sub(taken.tokens, Relaxed);
        let now = Instant::now();
        if now.saturating_duration_since(taken.stored) >= self.config.ttl {
            self.expired.fetch_add(1, Relaxed);
            return;
        }
        // Checked under the lock that inserts: a turn's handoff kept in between wins.
        self.insert_if(key, taken.dict, taken.tokens, taken.stored, now, false);
    }

    /// Keep the decode's handoff `raw` for `key`, its `remote_host` made `host`, if it
    /// is one (else count it invalid).
    pub(crate) fn put(&self, key: &str, host: &str, raw: &[u8]) {
        let Some((dict, tokens)) = self.checked(host, raw) else {
            self.invalid.fetch_add(1, Relaxed);
            tracing::debug!(
                bytes = raw.len(),
                "a decode's KV handoff was not kept: not a valid decode handoff"
            );
            return;
        };
        let now = Instant::now();
        if self.insert(key, dict, tokens, now, now) {
            self.captured.fetch_add(1, Relaxed);
        }
    }

    /// Keep `dict` (naming `tokens`, first stored at `stored`) for `key`, replacing
    /// what was kept for it, within the bounds (the oldest entries go first); whether
    /// it was kept.
    fn insert(&self, key: &str, dict: Bytes, tokens: u64, stored: Instant, now: Instant) -> bool {
        self.insert_if(key, dict, tokens, stored, now, true)
    }

    /// [`insert`](Self::insert), or nothing when `key` holds an entry and `replace` is
    /// false (decided under the lock that inserts).
    fn insert_if(
        &self,
        key: &str,
        dict: Bytes,
        tokens: u64,
        stored: Instant,
        now: Instant,
        replace: bool,
    ) -> bool {
        let (mut expired, mut evicted) = (0, 0);
        let mut kept = false;
        {
            let mut e = self.lock();
            if !replace && e.map.contains_key(key) {
                return false;
            }
            let seq = e.next;
            e.next += 1;
            e.remove(key);
            let entry = Entry {
                dict,
                tokens,
                stored,
                seq,
            };
            let size = Entries::size(key, &entry);
            if size > self.config.max_bytes || self.config.max_entries == 0 {
                evicted += 1;
            } else {
                let (max_entries, max_bytes, ttl) = (
                    self.config.max_entries,
                    self.config.max_bytes,
                    self.config.ttl,
                );
                // Room for one more entry of `size` bytes, expired ones first.
                let is_expired = |x: &Entry| now.saturating_duration_since(x.stored) >= ttl;
                e.drop_front(
                    |s, x| {
                        is_expired(x) || s.map.len() >= max_entries || s.bytes + size > max_bytes
                    },
                    &mut expired,
                    &mut evicted,
                    is_expired,
                );
                let key: Box<str> = key.into();
                e.bytes += size;
                e.order.push_back((key.clone(), seq));
                e.map.insert(key, entry);
                kept = true;
            }
            // Places of replaced entries pile up at most as long as the entries do.
            if e.order.len() > 2 * e.map.len() + 16 {
                let Entries { map, order, .. } = &mut *e;
                order.retain(|(k, s)| map.get(k).is_some_and(|x| x.seq == *s));
            }
        }
        self.expired.fetch_add(expired, Relaxed);
        self.evicted.fetch_add(evicted, Relaxed);
        kept
    }

    /// `raw` as the dict to keep (its `remote_host` made `host`) and its
    /// `remote_num_tokens`, if it is a decode's handoff within the size ceiling.
    fn checked(&self, host: &str, raw: &[u8]) -> Option<(Bytes, u64)> {
        if raw.len() > self.config.max_handoff_bytes {
            return None;
        }
        // Parsed as the engines' parser reads it: escaped keys decoded, the last of
        // repeated keys kept; written back from what was read.
        let mut dict: Map<String, Value> = serde_json::from_slice(raw).ok()?;
        let id_str = |k: &str| {
            dict.get(k)
                .and_then(Value::as_str)
                .is_some_and(|s| !s.is_empty() && !s.chars().any(char::is_control))
        };
        let ok = dict.get("do_remote_decode") == Some(&Value::Bool(true))
            && dict.get("do_remote_prefill") != Some(&Value::Bool(true))
            // The next prefill would take it as its prompt: only the proxy sets it.
            && !dict.contains_key(PROMPT_TOKEN_IDS)
            && id_str("remote_engine_id")
            && id_str("remote_request_id")
            && dict
                .get("remote_block_ids")
                .and_then(Value::as_array)
                .is_some_and(|b| !b.is_empty())
            && dict
                .get("remote_port")
                .and_then(Value::as_u64)
                .is_some_and(|p| (1..=u64::from(u16::MAX)).contains(&p));
        let tokens = dict.get("remote_num_tokens").and_then(Value::as_u64)?;
        if !ok || host.is_empty() {
            return None;
        }
        dict.insert("remote_host".to_owned(), Value::String(host.to_owned()));
        let bytes = serde_json::to_vec(&dict).ok()?;
        Some((Bytes::from(bytes), tokens))
    }
}

/// A kept handoff [`BidiStore::take`] gave to a prefill leg.
#[derive(Debug)]
pub(crate) struct Taken {
    pub(crate) dict: Bytes,
    tokens: u64,
    stored: Instant,
}

/// One request's receiver of its decode's handoff: the store, the conversation, the
/// decode endpoint's host, and the handoff its prefill leg was given, if any (kept
/// again when that leg never reached its engine). Dropped with the request.
#[derive(Debug)]
pub(crate) struct Capture {
    pub(crate) store: Arc<BidiStore>,
    pub(crate) key: Box<str>,
    pub(crate) host: Box<str>,
    pub(crate) taken: Mutex<Option<Taken>>,
}

impl ReturnedHandoff for Capture {
    fn returned(&self, value: &[u8]) {
        self.store.put(&self.key, &self.host, value);
    }

    /// The prefill leg never reached its engine: the handoff it was given is kept
    /// again for the conversation's next attempt (the retry of this request).
    fn unsent(&self) {
        let taken = self
            .taken
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(taken) = taken {
            self.store.put_back(&self.key, taken);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dict(tokens: u64) -> String {
        format!(
            r#"{{"do_remote_prefill":false,"do_remote_decode":true,"remote_engine_id":"d","remote_request_id":"r","remote_block_ids":[0,1],"remote_host":"localhost","remote_port":5600,"remote_num_tokens":{tokens},"remote_blocks_expiry_time":123.5}}"#
        )
    }

    fn store(config: BidiConfig) -> Arc<BidiStore> {
        BidiStore::new(config)
    }

    #[test]
    fn a_kept_handoff_is_taken_once_with_the_decodes_host() {
        let s = store(BidiConfig::default());
        s.put("c1", "10.0.0.9", dict(100).as_bytes());
        assert!(s.take("c2").is_none());
        let got: Map<String, Value> = serde_json::from_slice(&s.take("c1").unwrap().dict).unwrap();
        assert_eq!(got["remote_host"], "10.0.0.9");
        assert_eq!(got["remote_num_tokens"], 100);
        assert!(s.take("c1").is_none());
        let st = s.stats();
        assert_eq!((st.captured, st.reused, st.reused_tokens), (1, 1, 100));
        assert_eq!((st.entries, st.bytes), (0, 0));
    }

    /// A handoff whose prefill leg never reached its engine is kept again, once, with
    /// its reuse no longer counted, unless a newer turn's was kept since or its TTL
    /// ended.
    #[test]
    fn a_handoff_put_back_is_found_again_unless_a_newer_one_was_kept() {
        let s = store(BidiConfig::default());
        s.put("c", "h", dict(100).as_bytes());
        let taken = s.take("c").unwrap();
        s.put_back("c", taken);
        let st = s.stats();
        assert_eq!((st.reused, st.reused_tokens, st.entries), (0, 0, 1));
        let again = s.take("c").unwrap();
        assert_eq!(s.stats().reused, 1);
        // A newer turn kept its own meanwhile: it stays.
        s.put("c", "h", dict(200).as_bytes());
        s.put_back("c", again);
        let got: Map<String, Value> = serde_json::from_slice(&s.take("c").unwrap().dict).unwrap();
        assert_eq!(got["remote_num_tokens"], 200);
        // Past its TTL, nothing is kept again: the handoff taken is made as old as the
        // TTL (a TTL short enough to sleep past could also end between put and take).
        let ttl = Duration::from_secs(10);
        let s = store(BidiConfig {
            ttl,
            ..BidiConfig::default()
        });
        s.put("c", "h", dict(100).as_bytes());
        let taken = s.take("c").unwrap();
        let taken = Taken {
            stored: taken
                .stored
                .checked_sub(ttl)
                .expect("the monotonic clock is past the TTL"),
            ..taken
        };
        s.put_back("c", taken);
        assert!(s.take("c").is_none());
        assert_eq!(s.stats().expired, 1);
    }

    #[test]
    fn what_is_no_decode_handoff_is_dropped_and_counted() {
        let s = store(BidiConfig {
            max_handoff_bytes: 512,
            ..BidiConfig::default()
        });
        let big = dict(1).replace("[0,1]", &format!("[{}0]", "0,".repeat(300)));
        for bad in [
            "null".to_owned(),
            "[1]".to_owned(),
            "{\"do_remote_decode\":true".to_owned(),
            dict(1).replace("\"do_remote_decode\":true", "\"do_remote_decode\":false"),
            dict(1).replace("\"remote_engine_id\":\"d\",", ""),
            dict(1).replace("[0,1]", "[]"),
            dict(1).replace(",\"remote_num_tokens\":1", ""),
            dict(1).replace("5600", "70000"),
            dict(1).replace("5600", "0"),
            dict(1).replace(r#""d""#, r#""d\u0000""#),
            dict(1).replace(r#""r""#, r#""r\n""#),
            big,
        ] {
            s.put("c", "h", bad.as_bytes());
            assert!(s.take("c").is_none(), "{bad}");
        }
        assert_eq!(s.stats().invalid, 12);
    }

    /// A decode's dict naming `prompt_token_ids`, under any spelling, is never sent on
    /// to the next turn's prefill, which would take those ids as its prompt.
    #[test]
    fn a_decode_dict_carrying_prompt_token_ids_is_never_kept() {
        let s = store(BidiConfig::default());
        let with = |extra: &str| {
            let d = dict(100);
            format!("{}{extra}}}", &d[..d.len() - 1])
        };
        for forged in [
            with(r#","prompt_token_ids":[6,6,6]"#),
            with(r#","prompt_token_id\u0073":[6]"#),
        ] {
            s.put("c", "h", forged.as_bytes());
            assert!(s.take("c").is_none(), "{forged}");
        }
        assert_eq!(s.stats().invalid, 2);
        // Without it, the same dict is kept.
        s.put("c", "h", with(r#","other":[6]"#).as_bytes());
        assert!(s.take("c").is_some());
    }

    #[test]
    fn the_store_keeps_its_bounds_and_its_ttl() {
        let s = store(BidiConfig {
            max_entries: 2,
            ..BidiConfig::default()
        });
        for k in ["a", "b", "c"] {
            s.put(k, "h", dict(64).as_bytes());
        }
        assert!(s.take("a").is_none());
        assert_eq!(s.stats().evicted, 1);
        // A newer turn replaces the older one in place.
        s.put("b", "h", dict(70).as_bytes());
        assert_eq!(s.stats().entries, 2);
        let one = dict(64).len() + 1;
        let s = store(BidiConfig {
            max_bytes: 2 * one,
            ..BidiConfig::default()
        });
        for k in ["a", "b", "c"] {
            s.put(k, "h", dict(64).as_bytes());
        }
        let st = s.stats();
        assert!(st.bytes <= 2 * one as u64, "{st:?}");
        assert_eq!(st.evicted, 1);

        let s = store(BidiConfig {
            ttl: Duration::ZERO,
            ..BidiConfig::default()
        });
        s.put("a", "h", dict(64).as_bytes());
        assert!(s.take("a").is_none());
        let st = s.stats();
        assert_eq!((st.expired, st.reused, st.entries), (1, 0, 0));
    }

    #[test]
    fn conversation_keys_read_from_text() {
        assert_eq!(
            "field:user".parse::<ConversationKey>().unwrap(),
            ConversationKey::Field("user".into())
        );
        assert_eq!(
            "header:x-session-id"
                .parse::<ConversationKey>()
                .unwrap()
                .to_string(),
            "header:x-session-id"
        );
        for bad in ["user", "field:", "header:bad name", "cookie:x"] {
            assert!(bad.parse::<ConversationKey>().is_err(), "{bad}");
        }
    }
}
