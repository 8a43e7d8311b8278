//! The client keys: [`ApiKeys`] (digests, the check, reloads, counters) and what a check
//! gives back.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use http::header::HeaderValue;
use subtle::{ConditionallySelectable, ConstantTimeEq};

use super::file::{KeyFile, blocking_read, parse_key_file};
use super::limits::{InFlightSlot, KeyLimits, KeyState, take_token};
use super::{Digest, KeyError, KeyId, MAX_HEADER_BYTES, Refusal, read, sha256, valid_key, write};

/// One configured key: its digest and its state.
#[derive(Debug)]
struct Entry {
    digest: Digest,
    state: Arc<KeyState>,
}

/// The keys in force, replaced whole on a reload.
#[derive(Debug, Default)]
struct KeySet {
    entries: Vec<Entry>,
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

#[derive(Debug)]
struct Shared {
    /// Digests of the keys given to [`ApiKeys::new`], kept across reloads.
    fixed: Vec<Digest>,
    set: RwLock<Arc<KeySet>>,
    limits: KeyLimits,
    counters: Counters,
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
/// SHA-256 digests of the keys are kept.
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
    /// space, a control or a non-ASCII character.
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
        let fixed = digests(keys, |i| format!("key #{}", i + 1))?;
        let set = build_set(&fixed, &[], None, &limits);
        Ok(ApiKeys {
            shared: Arc::new(Shared {
                fixed,
                set: RwLock::new(Arc::new(set)),
                limits,
                counters: Counters::default(),
            }),
        })
    }

    /// Replace the reloadable keys (those of a key file) with `keys`; the keys given to
    /// [`new`](Self::new) stay. A key kept keeps its in-flight count and bucket; a key
    /// removed loses them (its requests in flight run to their end).
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new); the keys in force are then unchanged.
    pub fn reload<I>(&self, keys: I) -> Result<(), KeyError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let loaded = digests(keys, |i| format!("key #{}", i + 1))?;
        let mut current = write(&self.shared.set);
        let set = build_set(
            &self.shared.fixed,
            &loaded,
            Some(&current),
            &self.shared.limits,
        );
        *current = Arc::new(set);
        Ok(())
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
            .map(|e| KeyId::from_digest(&e.digest))
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
    /// Cheap and synchronous: one SHA-256 of the presented key, one constant-time
    /// comparison per configured key, and with limits an atomic counter and a
    /// short-held lock on the key's bucket.
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
        let presented = sha256(token);
        // Held to the end of the check: a reload waits for it (microseconds).
        let set = read(&self.shared.set);
        // Every digest is compared, whatever matched: the time taken tells nothing of
        // which key matched or how far a guess was right.
        let mut found = subtle::Choice::from(0u8);
        let mut index = 0u32;
        for (i, e) in set.entries.iter().enumerate() {
            let eq = presented.ct_eq(&e.digest);
            index.conditional_assign(&u32::try_from(i).unwrap_or(u32::MAX), eq);
            found |= eq;
        }
        let entry = match bool::from(found) {
            true => set.entries.get(index as usize),
            false => None,
        };
        let Some(entry) = entry else {
            c.invalid.fetch_add(1, Ordering::Relaxed);
            return Err(Refusal::Invalid);
        };
        let id = KeyId::from_digest(&entry.digest);
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
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register_collector(Box::new(KeysCollector(self.clone())));
    }

    /// Poll `file` every [`KeyFile::poll_interval`] and [`reload`](Self::reload) its
    /// keys when its content changes, until the future is dropped.
    ///
    /// The file as it is now is taken as already loaded (load it first with
    /// [`KeyFile::read`]). A change is logged at `info` with the number of keys; a file
    /// that cannot be read, or that holds an invalid key, keeps the keys in force and
    /// is logged at `warn` and counted ([`KeyStats::file_errors`]) once per distinct
    /// state. The file is read on tokio's blocking pool.
    pub fn watch(&self, file: KeyFile) -> impl Future<Output = ()> + Send + 'static {
        let keys = self.clone();
        async move {
            let mut seen = match blocking_read(&file).await {
                Ok(bytes) => Seen::Content(bytes),
                Err(_) => Seen::Unreadable,
            };
            let mut tick = tokio::time::interval(file.poll_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                keys.poll_once(&file, &mut seen).await;
            }
        }
    }

    async fn poll_once(&self, file: &KeyFile, seen: &mut Seen) {
        let c = &self.shared.counters;
        let bytes = match blocking_read(file).await {
            Ok(bytes) => bytes,
            Err(e) => {
                if *seen != Seen::Unreadable {
                    tracing::warn!(path = %file.path.display(), error = %e, "API key file unreadable; keeping the keys in force");
                    c.file_errors.fetch_add(1, Ordering::Relaxed);
                    *seen = Seen::Unreadable;
                }
                return;
            }
        };
        if matches!(seen, Seen::Content(b) if *b == bytes) {
            return;
        }
        let loaded =
            parse_key_file(&bytes).and_then(|keys| self.reload(&keys).map(|()| keys.len()));
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
    Content(Vec<u8>),
    Unreadable,
}

fn digests<I>(keys: I, what: impl Fn(usize) -> String) -> Result<Vec<Digest>, KeyError>
where
    I: IntoIterator,
    I::Item: AsRef<str>,
{
    let mut out = Vec::new();
    for (i, k) in keys.into_iter().enumerate() {
        let k = k.as_ref();
        valid_key(k, || what(i))?;
        out.push(sha256(k.as_bytes()));
    }
    Ok(out)
}

/// The set of `fixed` and `loaded` keys (each once), reusing the state of the keys
/// `old` already holds.
fn build_set(
    fixed: &[Digest],
    loaded: &[Digest],
    old: Option<&KeySet>,
    limits: &KeyLimits,
) -> KeySet {
    let mut entries: Vec<Entry> = Vec::with_capacity(fixed.len() + loaded.len());
    for d in fixed.iter().chain(loaded) {
        if entries.iter().any(|e| e.digest == *d) {
            continue;
        }
        let state = old
            .and_then(|o| o.entries.iter().find(|e| e.digest == *d))
            .map_or_else(|| Arc::new(KeyState::new(limits)), |e| Arc::clone(&e.state));
        entries.push(Entry { digest: *d, state });
    }
    KeySet { entries }
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
type Labelled = (&'static str, &'static str, [(&'static str, u64); 2]);

/// [`ApiKeys::register_metrics`]' collector: the keys' counters, read at each scrape
/// (the check counts in atomics it already keeps; nothing more on the request path).
#[derive(Debug)]
struct KeysCollector(ApiKeys);

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
