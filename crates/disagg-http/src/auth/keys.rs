//! The client keys: [`ApiKeys`] (keyed digests, the check, reloads, counters) and what
//! a check gives back.
//!
//! # The key set
//!
//! Each key is kept as its HMAC-SHA256 under a salt drawn at random when the
//! [`ApiKeys`] is made (never stored, never shown), and as its [`KeyId`]. The set is a
//! hash map from the first 8 bytes of a digest to the key(s) whose digest starts so
//! (two keys share a prefix with odds of about one in 2^64 per pair: they are chained,
//! never lost). A check computes the presented key's digest, looks its prefix up and
//! compares the whole digest of what it finds in constant time (`subtle`): one hash, one
//! map lookup, one comparison, whatever the number of keys. What the timing of the
//! lookup could tell is where an attacker's own guess hashes to under a secret salt,
//! nothing about any configured key.
//!
//! A reload builds the new set in O(n) (a map lookup per key to carry a kept key's
//! state over) outside any lock the checks take, then swaps it in under a write lock
//! held for the pointer swap only: checks are never held up by a reload's work.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use disagg_files::TimedReader;
use http::header::HeaderValue;
use subtle::ConstantTimeEq;

use super::file::{KeyFile, parse_key_file, timed_read};
use super::limits::{InFlightSlot, KeyLimits, KeyState, take_token};
use super::{Digest, KeyError, KeyId, MAX_HEADER_BYTES, MAX_KEYS, Refusal, read, valid_key, write};

/// No next entry in a chain.
const NONE: u32 = u32::MAX;

/// One configured key: its keyed digest, its id and its state.
#[derive(Debug)]
struct Entry {
    digest: Digest,
    id: KeyId,
    state: Arc<KeyState>,
    /// The next entry whose digest has the same 8-byte prefix, or [`NONE`].
    next: u32,
}

/// The keys in force, replaced whole on a reload.
#[derive(Debug, Default)]
struct KeySet {
    entries: Vec<Entry>,
    /// The first entry of each digest prefix.
    index: HashMap<u64, u32>,
}

impl KeySet {
    /// The entry whose digest is `digest`: the prefix looked up, each candidate of the
    /// chain (nearly always one) compared in full in constant time.
    fn find(&self, digest: &Digest) -> Option<&Entry> {
        let mut i = *self.index.get(&prefix(digest))?;
        let mut found = None;
        while let Some(e) = self.entries.get(i as usize) {
            if bool::from(e.digest.ct_eq(digest)) {
                found = Some(e);
            }
            i = e.next;
        }
        found
    }

    /// Adds a key unless its digest is in already.
    fn insert(&mut self, digest: Digest, id: KeyId, state: impl FnOnce() -> Arc<KeyState>) {
        if self.find(&digest).is_some() {
            return;
        }
        let at = u32::try_from(self.entries.len()).unwrap_or(NONE);
        let head = self.index.entry(prefix(&digest)).or_insert(NONE);
        let next = std::mem::replace(head, at);
        self.entries.push(Entry {
            digest,
            id,
            state: state(),
            next,
        });
    }
}

/// A digest's first 8 bytes, its place in the map.
fn prefix(d: &Digest) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    u64::from_le_bytes(b)
}

/// Counters of an [`ApiKeys`], for `/metrics`.
#[derive(Debug, Default)]
struct Counters {
    missing: AtomicU64,
    invalid: AtomicU64,
    throttled_rate: AtomicU64,
    throttled_in_flight: AtomicU64,
    reloads: AtomicU64,
    file_errors: AtomicU64,
}

struct Shared {
    /// The HMAC key (a random salt) every digest is made with.
    salt: ring::hmac::Key,
    /// The keys given to [`ApiKeys::new`], kept across reloads.
    fixed: Vec<(Digest, KeyId)>,
    /// The set in force; the lock is held to read the set or to swap the pointer.
    set: RwLock<Arc<KeySet>>,
    /// Taken by a reload for its whole work, so that two reloads cannot lose each
    /// other's carried-over state; never taken by a check. It holds the digests of the
    /// reloadable keys in force (a key file's), sorted, for [`ApiKeys::watch`]'s first
    /// look at the file.
    reloading: Mutex<Vec<Digest>>,
    limits: KeyLimits,
    counters: Counters,
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the salt.
        f.debug_struct("Shared")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl Shared {
    /// The keyed digest of `key`.
    fn digest(&self, key: &[u8]) -> Digest {
        let tag = ring::hmac::sign(&self.salt, key);
        let mut out = [0u8; 32];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// The set in force.
    fn current(&self) -> Arc<KeySet> {
        Arc::clone(&read(&self.set))
    }
}

/// A snapshot of an [`ApiKeys`]' counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyStats {
    /// Keys in force.
    pub keys: usize,
    /// Requests refused 401 without a bearer key.
    pub missing: u64,
    /// Requests refused 401 with a key that is not configured.
    pub invalid: u64,
    /// Requests refused 429 by their key's rate.
    pub throttled_rate: u64,
    /// Requests refused 429 by their key's in-flight limit.
    pub throttled_in_flight: u64,
    /// Key file reloads that changed the keys.
    pub reloads: u64,
    /// Key file states refused (unreadable, invalid), each counted once.
    pub file_errors: u64,
}

// === ApiKeys ===

/// The API keys a service accepts, with their [`KeyLimits`]; reloadable.
///
/// Cheap to clone; clones share the keys, their limits and their counters, so give every
/// serving thread a clone of one `ApiKeys` and the limits hold across threads. Only
/// keyed digests of the keys (HMAC-SHA256 under a random salt of this set's own) and
/// their [`KeyId`]s are kept; a check costs one digest and one map lookup whatever the
/// number of keys (see the [`auth`](crate::auth) module docs).
///
/// An empty set refuses every request (a key file emptied by mistake closes the
/// service rather than opening it).
#[derive(Clone)]
pub struct ApiKeys {
    shared: Arc<Shared>,
}

impl fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The count, never the keys or their digests.
        f.debug_struct("ApiKeys")
            .field("keys", &self.len())
            .field("limits", &self.shared.limits)
            .finish_non_exhaustive()
    }
}

/// A key's admission: its id, and its place among the key's requests in flight until
/// dropped.
#[derive(Debug)]
pub struct Admitted {
    pub(super) id: KeyId,
    pub(super) slot: Option<InFlightSlot>,
}

impl Admitted {
    /// The admitted key's id.
    pub fn id(&self) -> KeyId {
        self.id
    }
}

impl ApiKeys {
    /// The keys `keys`, without limits.
    ///
    /// # Errors
    ///
    /// [`KeyError::Invalid`] when a key is empty, longer than 4096 bytes, or holds a
    /// space, a control or a non-ASCII character; [`KeyError::TooMany`] past 250,000
    /// keys.
    pub fn new<I>(keys: I) -> Result<Self, KeyError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        Self::with_limits(keys, KeyLimits::default())
    }

    /// The keys `keys`, each limited by `limits`.
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new).
    pub fn with_limits<I>(keys: I, limits: KeyLimits) -> Result<Self, KeyError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let mut salt = [0u8; 32];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut salt)
            .map_err(|_| KeyError::Salt)?;
        let mut shared = Shared {
            salt: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &salt),
            fixed: Vec::new(),
            set: RwLock::new(Arc::new(KeySet::default())),
            reloading: Mutex::new(Vec::new()),
            limits,
            counters: Counters::default(),
        };
        shared.fixed = digests(&shared, keys, |i| format!("key #{}", i + 1))?;
        let set = build_set(&shared.fixed, &[], None, &shared.limits);
        shared.set = RwLock::new(Arc::new(set));
        Ok(ApiKeys {
            shared: Arc::new(shared),
        })
    }

    /// Replace the reloadable keys (those of a key file) with `keys`; the keys given to
    /// [`new`](Self::new) stay. A key kept keeps its in-flight count and bucket; a key
    /// removed loses them (its requests in flight run to their end).
    ///
    /// The new set is built in O(n) while the old one keeps answering checks, and
    /// swapped in whole: a check sees the old keys or the new ones, never a mix, and
    /// never waits for the build.
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new); the keys in force are then unchanged.
    pub fn reload<I>(&self, keys: I) -> Result<(), KeyError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let shared = &*self.shared;
        let loaded = digests(shared, keys, |i| format!("key #{}", i + 1))?;
        let mut in_force = shared
            .reloading
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let old = shared.current();
        let set = build_set(&shared.fixed, &loaded, Some(&old), &shared.limits);
        // The write lock for the pointer swap only; the old set drops after it.
        let old = std::mem::replace(&mut *write(&shared.set), Arc::new(set));
        drop(old);
        *in_force = sorted(&loaded);
        Ok(())
    }

    /// Whether `keys` are the reloadable keys in force (in any order, each once or
    /// more), so that reloading them would change nothing.
    fn in_force(&self, keys: &[String]) -> bool {
        let shared = &*self.shared;
        let Ok(given) = digests(shared, keys, |i| format!("key #{}", i + 1)) else {
            return false;
        };
        let in_force = shared
            .reloading
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        sorted(&given) == *in_force
    }

    /// Keys in force (a key given twice counts once).
    pub fn len(&self) -> usize {
        read(&self.shared.set).entries.len()
    }

    /// Whether no key is in force (every request is then refused).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The ids of the keys in force, in no particular order.
    pub fn ids(&self) -> Vec<KeyId> {
        read(&self.shared.set)
            .entries
            .iter()
            .map(|e| e.id)
            .collect()
    }

    /// The limits each key gets.
    pub fn limits(&self) -> &KeyLimits {
        &self.shared.limits
    }

    /// Check a request's `authorization` header value against the keys and the key's
    /// limits: the key's [`Admitted`] (hold it until the request's answer has ended: it
    /// is the key's in-flight place), or why the request is refused.
    ///
    /// Cheap and synchronous: one HMAC-SHA256 of the presented key, one map lookup and
    /// one constant-time comparison whatever the number of keys, and with limits an
    /// atomic counter and a short-held lock on the key's bucket.
    ///
    /// # Errors
    ///
    /// [`Refusal`], counted in [`stats`](Self::stats).
    pub fn check(&self, authorization: Option<&HeaderValue>) -> Result<Admitted, Refusal> {
        let c = &self.shared.counters;
        let Some(token) = authorization.and_then(bearer) else {
            c.missing.fetch_add(1, Ordering::Relaxed);
            return Err(Refusal::Missing);
        };
        let presented = self.shared.digest(token);
        // Held for the lookup: a reload's swap waits for it (a map lookup), its build
        // does not hold it at all.
        let set = read(&self.shared.set);
        let Some(entry) = set.find(&presented) else {
            c.invalid.fetch_add(1, Ordering::Relaxed);
            return Err(Refusal::Invalid);
        };
        let id = entry.id;
        let limits = &self.shared.limits;
        if limits.is_none() {
            return Ok(Admitted { id, slot: None });
        }
        let slot =
            match limits.max_in_flight {
                None => None,
                Some(max) => {
                    let taken = entry.state.in_flight.fetch_update(
                        Ordering::AcqRel,
                        Ordering::Acquire,
                        |n| (n < max).then_some(n + 1),
                    );
                    if taken.is_err() {
                        c.throttled_in_flight.fetch_add(1, Ordering::Relaxed);
                        return Err(Refusal::InFlight { max });
                    }
                    Some(InFlightSlot(Arc::clone(&entry.state)))
                }
            };
        if let (Some(rate), Some(burst)) = (limits.rate, limits.burst())
            && let Err(wait) = take_token(&entry.state, rate, burst)
        {
            // The in-flight place taken above goes back with `slot`.
            drop(slot);
            c.throttled_rate.fetch_add(1, Ordering::Relaxed);
            return Err(Refusal::Rate {
                rate: format!("{rate}"),
                retry_after: wait,
            });
        }
        Ok(Admitted { id, slot })
    }

    /// The counters and the number of keys in force.
    pub fn stats(&self) -> KeyStats {
        let c = &self.shared.counters;
        KeyStats {
            keys: self.len(),
            missing: c.missing.load(Ordering::Relaxed),
            invalid: c.invalid.load(Ordering::Relaxed),
            throttled_rate: c.throttled_rate.load(Ordering::Relaxed),
            throttled_in_flight: c.throttled_in_flight.load(Ordering::Relaxed),
            reloads: c.reloads.load(Ordering::Relaxed),
            file_errors: c.file_errors.load(Ordering::Relaxed),
        }
    }

    /// Registers the counters into a Prometheus `registry`, read at each scrape (for
    /// [`ExtraMetrics`](crate::metrics::ExtraMetrics)). No key material: counts only,
    /// never a key, a digest or a [`KeyId`](super::KeyId) as a label.
    ///
    /// | metric | type | meaning |
    /// |---|---|---|
    /// | `disagg_api_keys` | gauge | keys in force |
    /// | `disagg_auth_refused_total{reason}` | counter | requests refused 401: `missing` key, `invalid` key |
    /// | `disagg_key_throttled_total{reason}` | counter | requests refused 429 by their key's limit: `rate`, `in_flight` |
    /// | `disagg_api_key_reloads_total` | counter | key file reloads that changed the keys |
    /// | `disagg_api_key_file_errors_total` | counter | key file states refused (unreadable, invalid) |
    #[cfg(feature = "metrics")]
    #[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register_collector(Box::new(KeysCollector(self.clone())));
    }

    /// Poll `file` every [`KeyFile::poll_interval`] and [`reload`](Self::reload) its
    /// keys when its content changes, until the future is dropped.
    ///
    /// The file is read at once and compared with the keys in force (load it first
    /// with [`KeyFile::read`] and [`reload`](Self::reload)): an edit made since they
    /// were loaded (while the caller was still starting up) is applied then, not at the
    /// file's next change; a file that holds the keys in force (in any order or
    /// spelling) changes nothing and is not counted. A change is logged at `info` with
    /// the number of keys; a file that cannot be read, or that holds an invalid key,
    /// keeps the keys in force and is logged at `warn` and counted
    /// ([`KeyStats::file_errors`]) once per distinct state. The file must be a regular
    /// file (a FIFO or a device is refused without a blocking read), read on a thread of
    /// its own within [`KeyFile::read_timeout`]: a read that does not finish is such an
    /// error, never a watch that stops ([`disagg_files`]).
    pub fn watch(&self, file: KeyFile) -> impl Future<Output = ()> + Send + 'static {
        let keys = self.clone();
        async move {
            let reader = TimedReader::new();
            // The file against the keys in force, not against itself: it may have been
            // edited since they were loaded.
            let mut seen = Seen::Start;
            keys.poll_once(&file, &reader, &mut seen).await;
            let mut tick = tokio::time::interval(file.poll_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                keys.poll_once(&file, &reader, &mut seen).await;
            }
        }
    }

    async fn poll_once(&self, file: &KeyFile, reader: &TimedReader, seen: &mut Seen) {
        let c = &self.shared.counters;
        let bytes = match timed_read(file, reader).await {
            Ok(bytes) => bytes,
            Err(e) => {
                if *seen != Seen::Unreadable {
                    tracing::warn!(path = %file.path.display(), error = %disagg_core::error::error_chain(&e), "API key file unreadable; keeping the keys in force");
                    c.file_errors.fetch_add(1, Ordering::Relaxed);
                    *seen = Seen::Unreadable;
                }
                return;
            }
        };
        if matches!(seen, Seen::Content(b) if *b == bytes) {
            return;
        }
        let parsed = parse_key_file(&bytes);
        if *seen == Seen::Start
            && let Ok(keys) = &parsed
            && self.in_force(keys)
        {
            // The keys loaded before the watch: nothing to apply, nothing to tell.
            *seen = Seen::Content(bytes);
            return;
        }
        let loaded = parsed.and_then(|keys| self.reload(&keys).map(|()| keys.len()));
        match loaded {
            Ok(n) => {
                c.reloads.fetch_add(1, Ordering::Relaxed);
                if n == 0 {
                    tracing::warn!(path = %file.path.display(), "API key file reloaded: it holds no key");
                } else {
                    tracing::info!(path = %file.path.display(), keys = n, "API key file reloaded");
                }
            }
            Err(e) => {
                tracing::warn!(path = %file.path.display(), error = %e, "API key file edit refused; keeping the keys in force");
                c.file_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        *seen = Seen::Content(bytes);
    }
}

/// What the key file's last poll saw, so that each state is logged and counted once.
#[derive(PartialEq)]
enum Seen {
    /// Nothing yet: the first poll compares the file with the keys in force.
    Start,
    Content(Vec<u8>),
    Unreadable,
}

/// The digests of `keys`, sorted, each once.
fn sorted(keys: &[(Digest, KeyId)]) -> Vec<Digest> {
    let mut d: Vec<Digest> = keys.iter().map(|(d, _)| *d).collect();
    d.sort_unstable();
    d.dedup();
    d
}

/// Each key's keyed digest and id, the keys checked first (`what` names a bad one).
fn digests<I>(
    shared: &Shared,
    keys: I,
    what: impl Fn(usize) -> String,
) -> Result<Vec<(Digest, KeyId)>, KeyError>
where
    I: IntoIterator,
    I::Item: AsRef<str>,
{
    let mut out = Vec::new();
    for (i, k) in keys.into_iter().enumerate() {
        if i >= MAX_KEYS {
            return Err(KeyError::TooMany { max: MAX_KEYS });
        }
        let k = k.as_ref();
        valid_key(k, || what(i))?;
        out.push((shared.digest(k.as_bytes()), KeyId::of(k)));
    }
    Ok(out)
}

/// The set of `fixed` and `loaded` keys (each once), reusing the state of the keys
/// `old` already holds: O(n), one map lookup per key.
fn build_set(
    fixed: &[(Digest, KeyId)],
    loaded: &[(Digest, KeyId)],
    old: Option<&KeySet>,
    limits: &KeyLimits,
) -> KeySet {
    let n = fixed.len() + loaded.len();
    let mut set = KeySet {
        entries: Vec::with_capacity(n),
        index: HashMap::with_capacity(n),
    };
    for (d, id) in fixed.iter().chain(loaded) {
        set.insert(*d, *id, || {
            old.and_then(|o| o.find(d))
                .map_or_else(|| Arc::new(KeyState::new(limits)), |e| Arc::clone(&e.state))
        });
    }
    set
}

/// The token of a `Bearer` authorization value, if it is one (scheme matched
/// case-insensitively, spaces around the token ignored).
pub(super) fn bearer(value: &HeaderValue) -> Option<&[u8]> {
    let v = value.as_bytes();
    if v.len() > MAX_HEADER_BYTES || v.len() < 7 {
        return None;
    }
    let (scheme, rest) = v.split_at(6);
    if !scheme.eq_ignore_ascii_case(b"bearer") || rest[0] != b' ' {
        return None;
    }
    let token = rest.trim_ascii();
    (!token.is_empty()).then_some(token)
}

/// A counter family by `reason`: its name, its help, each reason's count.
#[cfg(feature = "metrics")]
type Labelled = (&'static str, &'static str, [(&'static str, u64); 2]);

/// [`ApiKeys::register_metrics`]' collector: the keys' counters, read at each scrape
/// (the check counts in atomics it already keeps; nothing more on the request path).
#[cfg(feature = "metrics")]
#[derive(Debug)]
struct KeysCollector(ApiKeys);

#[cfg(feature = "metrics")]
impl prometheus_client::collector::Collector for KeysCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::MetricType;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        let s = self.0.stats();
        let keys = ConstGauge::new(i64::try_from(s.keys).unwrap_or(i64::MAX));
        keys.encode(encoder.encode_descriptor(
            "disagg_api_keys",
            "API keys in force.",
            None,
            MetricType::Gauge,
        )?)?;
        // Counters are named without `_total`: the encoders append it.
        let labelled: [Labelled; 2] = [
            (
                "disagg_auth_refused",
                "Requests refused 401 by the API key check.",
                [("missing", s.missing), ("invalid", s.invalid)],
            ),
            (
                "disagg_key_throttled",
                "Requests refused 429 by their API key's limits.",
                [
                    ("rate", s.throttled_rate),
                    ("in_flight", s.throttled_in_flight),
                ],
            ),
        ];
        for (name, help, values) in labelled {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (reason, n) in values {
                ConstCounter::new(n).encode(family.encode_family(&[("reason", reason)])?)?;
            }
        }
        let single = [
            (
                "disagg_api_key_reloads",
                "Key file reloads that changed the keys.",
                s.reloads,
            ),
            (
                "disagg_api_key_file_errors",
                "Key file states refused (unreadable or invalid).",
                s.file_errors,
            ),
        ];
        for (name, help, n) in single {
            ConstCounter::new(n).encode(encoder.encode_descriptor(
                name,
                help,
                None,
                MetricType::Counter,
            )?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_sharing_a_prefix_are_chained_and_each_found() {
        let limits = KeyLimits::default();
        let state = || Arc::new(KeyState::new(&limits));
        let mut a = [7u8; 32];
        let mut b = [7u8; 32];
        a[31] = 1;
        b[31] = 2;
        let mut set = KeySet::default();
        set.insert(a, KeyId([0, 0, 0, 1]), state);
        set.insert(b, KeyId([0, 0, 0, 2]), state);
        set.insert(a, KeyId([0, 0, 0, 3]), state);
        assert_eq!((set.entries.len(), set.index.len()), (2, 1));
        assert_eq!(set.find(&a).map(|e| e.id), Some(KeyId([0, 0, 0, 1])));
        assert_eq!(set.find(&b).map(|e| e.id), Some(KeyId([0, 0, 0, 2])));
        let mut c = a;
        c[31] = 3;
        assert!(set.find(&c).is_none());
    }
}
