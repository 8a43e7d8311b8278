//! API keys at the edge: the clients' keys checked by a tower layer, limits per key, and
//! the engines' own keys sent by the transport.
//!
//! # Clients
//!
//! [`ApiKeyLayer`] wraps any HTTP service (a [`PdService`](crate::PdService), an axum
//! router). A request must carry `Authorization: Bearer KEY` with one of the
//! [`ApiKeys`], or it is answered 401 in OpenAI's error format, before the inner service
//! is called: no byte of its body is read and no engine is contacted.
//!
//! - `GET /health` stays open (load balancers and orchestrators probe it without
//!   credentials), and so does `/metrics` unless [`ApiKeyLayer::metrics_keys`] names the
//!   keys a scraper must present (then only those open it; a client's key does not).
//! - Every other path needs a client key, the OpenAI routes and the paths the service
//!   forwards to engines alike: a path nobody thought of is closed, not open.
//! - The scheme is matched case-insensitively (RFC 9110 §11.1), as vLLM does.
//!
//! The 401 is OpenAI's: `{"error": {"message", "type": "invalid_request_error", "param":
//! null, "code": "invalid_api_key"}}` with `www-authenticate: Bearer` (RFC 9110 §11.6.1).
//! vLLM's `--api-key` answers `{"error": "Unauthorized"}` instead (`vllm-project/vllm
//! vllm/entrypoints/openai/server_utils.py`, `AuthenticationMiddleware`); the proxy speaks
//! to OpenAI clients, whose SDKs read `error.message` and `error.code`.
//!
//! ## Comparison in constant time
//!
//! Keys are kept only as SHA-256 digests. A presented key is hashed and compared with
//! every configured digest with `subtle`'s constant-time equality, all of them, without
//! stopping at a match. Hashing first makes every comparison 32 bytes long whatever the
//! key's length (a byte-wise comparison of the keys themselves would stop at the first
//! difference, or at a length mismatch, and time tells how much of a guess was right);
//! comparing all digests hides which key matched and how many there are. vLLM does the
//! same (`hashlib.sha256` then `secrets.compare_digest` over every token).
//!
//! ## Keys are never logged
//!
//! Neither this module's logs nor its metrics hold a key or a digest. A request's key is
//! named by its [`KeyId`], the first 8 hex digits of the key's SHA-256, put in the
//! request's extensions for the layers inside (an access log): an operator can compute
//! it (`printf %s "$KEY" | sha256sum | cut -c1-8`), 32 bits of a digest cannot be turned
//! back into a key.
//!
//! ## Limits per key
//!
//! [`KeyLimits`] bounds each key on its own: requests in flight (a streaming answer
//! counts until its body ends or is dropped) and a token bucket of requests per second.
//! A key over either gets 429 with `retry-after` (whole seconds, rounded up) and code
//! `rate_limit_exceeded`, OpenAI's; the other keys are unaffected. The state per key
//! lives with the configured key, so it is bounded by the configuration, and a key
//! removed by a reload takes its state with it.
//!
//! ## Reloading
//!
//! [`ApiKeys::watch`] polls a key file ([`KeyFile`]: one key per line, `#` comments and
//! blank lines ignored) and swaps the keys when its content changes. Polling rather than
//! inotify: a Kubernetes Secret or ConfigMap volume swaps a symlink to a new directory,
//! which an inotify watch on the file never sees. An unreadable or invalid file keeps
//! the keys in force, logged and counted once per distinct state.
//!
//! # Engines
//!
//! [`EngineKeys`] are the keys the proxy presents to engines started with `--api-key`
//! (vLLM, SGLang): [`HttpTransport`](crate::HttpTransport) sets `Authorization: Bearer
//! KEY` on every request it sends to an engine that has one (both legs, `GET /v1/models`,
//! Mooncake's `/query`, LMCache's `/tokenize`, health checks), replacing whatever
//! `authorization` the request had. A client's own `authorization` never reaches an
//! engine unless the orchestrator is told to forward it
//! ([`OrchestratorConfig::forward_authorization`](disagg_core::OrchestratorConfig::forward_authorization)),
//! and an engine key replaces it even then.
//!
//! # Examples
//!
//! ```
//! use std::convert::Infallible;
//! use disagg_http::auth::{ApiKeyLayer, ApiKeys, KeyId, KeyLimits};
//! use tower::{Service, ServiceBuilder, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut limits = KeyLimits::default();
//! limits.max_in_flight = Some(8);
//! let keys = ApiKeys::with_limits(["sk-team-a", "sk-team-b"], limits)?;
//! let app = tower::service_fn(|req: http::Request<String>| async move {
//!     let who = req.extensions().get::<KeyId>().map(ToString::to_string);
//!     Ok::<_, Infallible>(http::Response::new(http_body_util::Full::new(
//!         bytes::Bytes::from(who.unwrap_or_default()),
//!     )))
//! });
//! let mut service = ServiceBuilder::new().layer(ApiKeyLayer::new(keys)).service(app);
//!
//! let refused = http::Request::post("/v1/completions").body(String::new())?;
//! let resp = service.ready().await?.call(refused).await?;
//! assert_eq!(resp.status(), 401);
//!
//! let allowed = http::Request::post("/v1/completions")
//!     .header("authorization", "Bearer sk-team-a")
//!     .body(String::new())?;
//! let resp = service.ready().await?.call(allowed).await?;
//! assert_eq!(resp.status(), 200);
//! # Ok(())
//! # }
//! ```

use std::fmt::{self, Write as _};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue, RETRY_AFTER, WWW_AUTHENTICATE};
use http::uri::{Authority, Scheme, Uri};
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use subtle::{ConditionallySelectable, ConstantTimeEq};

pub mod guide {
    //! The security guide (`docs/security.md`).
    #![doc = include_str!("../../../docs/security.md")]
}

/// The longest key accepted: far above any real one (OpenAI's are under 200 bytes), low
/// enough that a key file mistaken for another file is refused.
const MAX_KEY_BYTES: usize = 4096;

/// The largest key file read.
const MAX_KEY_FILE_BYTES: u64 = 1024 * 1024;

/// The request header is read only up to this size: the longest key and its scheme. A
/// longer value cannot hold a configured key and is not hashed.
const MAX_HEADER_BYTES: usize = MAX_KEY_BYTES + 16;

type Digest = [u8; 32];

fn sha256(bytes: &[u8]) -> Digest {
    let d = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

// === KeyId ===

/// Names an API key without revealing it: the first 4 bytes of the key's SHA-256, shown
/// as 8 lowercase hex digits.
///
/// [`ApiKeyLayer`] puts the admitted request's `KeyId` in its extensions. The same id
/// can be computed from the key: `printf %s "$KEY" | sha256sum | cut -c1-8`.
///
/// # Examples
///
/// ```
/// use disagg_http::auth::KeyId;
/// // printf %s sk-test | sha256sum
/// assert_eq!(KeyId::of("sk-test").to_string(), "f3abf2a6");
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyId([u8; 4]);

impl KeyId {
    /// The id of `key`.
    pub fn of(key: &str) -> KeyId {
        KeyId::from_digest(&sha256(key.as_bytes()))
    }

    fn from_digest(d: &Digest) -> KeyId {
        KeyId([d[0], d[1], d[2], d[3]])
    }
}

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyId({self})")
    }
}

// === errors ===

/// A key, a set of keys or a key file could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// A key is empty, too long, or holds a character a bearer token cannot (space,
    /// control, non-ASCII). The key itself is never part of the message.
    #[error("{what}: a key must be 1 to {MAX_KEY_BYTES} visible ASCII characters without spaces")]
    Invalid {
        /// Which key: its place (`--api-key #2`, `line 7`).
        what: String,
    },
    /// The key file could not be read.
    #[error("cannot read key file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The key file is larger than any key file should be.
    #[error("key file {path} is larger than {MAX_KEY_FILE_BYTES} bytes")]
    TooLarge {
        /// The file.
        path: PathBuf,
    },
    /// An engine URL given with a key is not `http(s)://host[:port]`.
    #[error("engine url `{url}` must be http://host[:port] or https://host[:port]")]
    EngineUrl {
        /// What was given.
        url: String,
    },
}

/// Checks `key` is usable as a bearer token; `what` names it in the error.
fn valid_key(key: &str, what: impl FnOnce() -> String) -> Result<(), KeyError> {
    let ok =
        !key.is_empty() && key.len() <= MAX_KEY_BYTES && key.bytes().all(|b| b.is_ascii_graphic());
    if ok {
        Ok(())
    } else {
        Err(KeyError::Invalid { what: what() })
    }
}

// === KeyLimits ===

/// Limits that every API key gets on its own.
///
/// # Examples
///
/// ```
/// use disagg_http::auth::KeyLimits;
/// let mut limits = KeyLimits::default();
/// limits.rate = Some(0.5);
/// // Burst: at least one request, else one second's worth.
/// assert_eq!(limits.burst(), Some(1.0));
/// limits.rate = Some(20.0);
/// assert_eq!(limits.burst(), Some(20.0));
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct KeyLimits {
    /// Requests a key may have in flight at once (a stream counts until its body ends);
    /// one more is answered 429 at once. `None`: no limit.
    pub max_in_flight: Option<usize>,
    /// Requests per second a key may start, as a token bucket refilled at this rate;
    /// a request finding the bucket empty is answered 429. `None`: no limit.
    pub rate: Option<f64>,
    /// The bucket's size: how many requests a key that was idle may start at once.
    /// Default ([`burst`](Self::burst)): one second's worth of `rate`, at least 1, so a
    /// key at 0.5/s may send one request every two seconds and a key at 20/s may send
    /// 20 at once after a pause, never more than `rate` on average.
    pub burst_size: Option<f64>,
}

impl KeyLimits {
    /// The bucket size in force: [`burst_size`](Self::burst_size), else `max(1, rate)`;
    /// `None` without a rate.
    pub fn burst(&self) -> Option<f64> {
        let rate = self.rate?;
        Some(self.burst_size.unwrap_or(rate.max(1.0)))
    }

    fn is_none(&self) -> bool {
        self.max_in_flight.is_none() && self.rate.is_none()
    }
}

// === per-key state ===

/// The token bucket of one key.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    last: Instant,
}

/// What one configured key carries while it is configured.
#[derive(Debug)]
struct KeyState {
    in_flight: AtomicUsize,
    bucket: Mutex<Bucket>,
}

impl KeyState {
    fn new(limits: &KeyLimits) -> Self {
        KeyState {
            in_flight: AtomicUsize::new(0),
            bucket: Mutex::new(Bucket {
                tokens: limits.burst().unwrap_or(0.0),
                last: Instant::now(),
            }),
        }
    }
}

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
    id: KeyId,
    slot: Option<InFlightSlot>,
}

impl Admitted {
    /// The admitted key's id.
    pub fn id(&self) -> KeyId {
        self.id
    }
}

/// Holds one of a key's in-flight places until dropped.
#[derive(Debug)]
struct InFlightSlot(Arc<KeyState>);

impl Drop for InFlightSlot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Release);
    }
}

/// Why a request was refused by [`ApiKeys::check`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// No `Authorization: Bearer` key (401).
    #[error("missing API key: send it in the Authorization header as `Authorization: Bearer KEY`")]
    Missing,
    /// A key that is not configured (401). The key is never part of the message.
    #[error("invalid API key")]
    Invalid,
    /// The key's request rate is used up (429).
    #[error("rate limit reached for this API key ({rate} requests per second); try again later")]
    Rate {
        /// The key's rate.
        rate: String,
        /// When one more request would be allowed.
        retry_after: Duration,
    },
    /// The key has its most requests in flight (429).
    #[error("this API key has {max} requests in flight, its limit; try again when one ends")]
    InFlight {
        /// The limit.
        max: usize,
    },
}

impl Refusal {
    /// The answer's status: 401 or 429.
    pub fn status(&self) -> StatusCode {
        match self {
            Refusal::Missing | Refusal::Invalid => StatusCode::UNAUTHORIZED,
            Refusal::Rate { .. } | Refusal::InFlight { .. } => StatusCode::TOO_MANY_REQUESTS,
        }
    }

    /// OpenAI's `error.code`: `invalid_api_key` or `rate_limit_exceeded`.
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::Missing | Refusal::Invalid => "invalid_api_key",
            Refusal::Rate { .. } | Refusal::InFlight { .. } => "rate_limit_exceeded",
        }
    }

    /// OpenAI's `error.type`: `invalid_request_error`, or `requests` for a limit on
    /// requests (as OpenAI's own rate-limit errors say).
    pub fn error_type(&self) -> &'static str {
        match self {
            Refusal::Missing | Refusal::Invalid => "invalid_request_error",
            Refusal::Rate { .. } | Refusal::InFlight { .. } => "requests",
        }
    }

    /// How long a client should wait before trying again (429 only). An in-flight limit
    /// cannot know when a request will end: 1 s.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Refusal::Rate { retry_after, .. } => Some(*retry_after),
            Refusal::InFlight { .. } => Some(Duration::from_secs(1)),
            Refusal::Missing | Refusal::Invalid => None,
        }
    }

    /// The answer: status, OpenAI-format body, `www-authenticate: Bearer` on a 401 and
    /// `retry-after` (whole seconds, rounded up, at least 1) on a 429.
    pub fn to_response(&self) -> Response<Bytes> {
        let body = disagg_core::error::openai_error_body(
            &self.to_string(),
            self.error_type(),
            None,
            self.code(),
        );
        let mut resp = Response::new(body);
        *resp.status_mut() = self.status();
        let h = resp.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if self.status() == StatusCode::UNAUTHORIZED {
            h.insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(after) = self.retry_after() {
            let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            h.insert(RETRY_AFTER, HeaderValue::from(secs.max(1)));
        }
        resp
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

    /// Append the counters to `out` in the Prometheus text format, for
    /// [`ExtraMetrics`](crate::metrics::ExtraMetrics). No key material: counts only.
    ///
    /// | metric | type | meaning |
    /// |---|---|---|
    /// | `disagg_api_keys` | gauge | keys in force |
    /// | `disagg_auth_refused_total{reason}` | counter | requests refused 401: `missing` key, `invalid` key |
    /// | `disagg_key_throttled_total{reason}` | counter | requests refused 429 by their key's limit: `rate`, `in_flight` |
    /// | `disagg_api_key_reloads_total` | counter | key file reloads that changed the keys |
    /// | `disagg_api_key_file_errors_total` | counter | key file states refused (unreadable, invalid) |
    pub fn render_metrics(&self, out: &mut String) {
        let s = self.stats();
        let _ = write!(
            out,
            "# HELP disagg_api_keys API keys in force.\n# TYPE disagg_api_keys gauge\ndisagg_api_keys {}\n\
             # HELP disagg_auth_refused_total Requests refused 401 by the API key check.\n\
             # TYPE disagg_auth_refused_total counter\n\
             disagg_auth_refused_total{{reason=\"missing\"}} {}\n\
             disagg_auth_refused_total{{reason=\"invalid\"}} {}\n\
             # HELP disagg_key_throttled_total Requests refused 429 by their API key's limits.\n\
             # TYPE disagg_key_throttled_total counter\n\
             disagg_key_throttled_total{{reason=\"rate\"}} {}\n\
             disagg_key_throttled_total{{reason=\"in_flight\"}} {}\n\
             # HELP disagg_api_key_reloads_total Key file reloads that changed the keys.\n\
             # TYPE disagg_api_key_reloads_total counter\ndisagg_api_key_reloads_total {}\n\
             # HELP disagg_api_key_file_errors_total Key file states refused (unreadable or invalid).\n\
             # TYPE disagg_api_key_file_errors_total counter\ndisagg_api_key_file_errors_total {}\n",
            s.keys,
            s.missing,
            s.invalid,
            s.throttled_rate,
            s.throttled_in_flight,
            s.reloads,
            s.file_errors,
        );
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

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    // Nothing panics while holding it with the set half-replaced.
    lock.read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
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
fn bearer(value: &HeaderValue) -> Option<&[u8]> {
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

/// Take one token from the key's bucket, or say how long until one is there.
fn take_token(state: &KeyState, rate: f64, burst: f64) -> Result<(), Duration> {
    let mut b = state
        .bucket
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let now = Instant::now();
    let refill = now.saturating_duration_since(b.last).as_secs_f64() * rate;
    b.tokens = (b.tokens + refill).min(burst);
    b.last = now;
    if b.tokens >= 1.0 {
        b.tokens -= 1.0;
        return Ok(());
    }
    let wait = (1.0 - b.tokens) / rate;
    Err(Duration::try_from_secs_f64(wait).unwrap_or(Duration::from_secs(1)))
}

// === KeyFile ===

/// A file of API keys: one key per line; `#` starts a comment line; blank lines and the
/// spaces around a key are ignored.
///
/// ```text
/// # team A
/// sk-team-a-0123456789
///
/// sk-team-b-9876543210
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct KeyFile {
    /// The file.
    pub path: PathBuf,
    /// How often [`ApiKeys::watch`] reads it: 1 s by default, so a change is in force
    /// within about 2 s.
    pub poll_interval: Duration,
}

impl KeyFile {
    /// The file at `path`, polled every second.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        KeyFile {
            path: path.into(),
            poll_interval: Duration::from_secs(1),
        }
    }

    /// Read and parse the file now (blocking).
    ///
    /// # Errors
    ///
    /// [`KeyError::Read`], [`KeyError::TooLarge`], or [`KeyError::Invalid`] naming the
    /// line (never the key).
    pub fn read(&self) -> Result<Vec<String>, KeyError> {
        parse_key_file(&read_file(&self.path)?)
    }
}

/// Parse a key file's content (see [`KeyFile`]).
///
/// # Errors
///
/// [`KeyError::Invalid`] naming the first bad line.
///
/// # Examples
///
/// ```
/// use disagg_http::auth::parse_key_file;
/// let keys = parse_key_file(b"# comment\nsk-a\n\n  sk-b  \n")?;
/// assert_eq!(keys, ["sk-a", "sk-b"]);
/// assert!(parse_key_file(b"sk a\n").is_err());
/// # Ok::<(), disagg_http::auth::KeyError>(())
/// ```
pub fn parse_key_file(bytes: &[u8]) -> Result<Vec<String>, KeyError> {
    let text = std::str::from_utf8(bytes).map_err(|_| KeyError::Invalid {
        what: "key file (not UTF-8 text)".into(),
    })?;
    let mut keys = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        valid_key(line, || format!("key file line {}", i + 1))?;
        keys.push(line.to_owned());
    }
    Ok(keys)
}

fn read_file(path: &std::path::Path) -> Result<Vec<u8>, KeyError> {
    use std::io::Read;
    let read = || {
        let file = std::fs::File::open(path)?;
        let mut bytes = Vec::new();
        // One byte past the limit tells a file at the limit from a larger one.
        file.take(MAX_KEY_FILE_BYTES + 1).read_to_end(&mut bytes)?;
        Ok::<_, std::io::Error>(bytes)
    };
    let bytes = read().map_err(|source| KeyError::Read {
        path: path.to_owned(),
        source,
    })?;
    if bytes.len() as u64 > MAX_KEY_FILE_BYTES {
        return Err(KeyError::TooLarge {
            path: path.to_owned(),
        });
    }
    Ok(bytes)
}

/// The file's bytes, read on the blocking pool (the file may sit on a slow volume).
async fn blocking_read(file: &KeyFile) -> Result<Vec<u8>, KeyError> {
    let path = file.path.clone();
    match tokio::task::spawn_blocking(move || read_file(&path)).await {
        Ok(r) => r,
        Err(e) => Err(KeyError::Read {
            path: file.path.clone(),
            source: std::io::Error::other(e),
        }),
    }
}

// === ApiKeyLayer ===

/// Which keys a path needs.
#[derive(Debug)]
struct Policy {
    /// Client keys for every path but the open ones; `None`: no client key needed.
    clients: Option<ApiKeys>,
    /// Keys for `/metrics`; `None`: `/metrics` is as open as `open` says.
    metrics: Option<ApiKeys>,
    /// Paths open to anyone.
    open: Vec<String>,
}

impl Policy {
    fn keys_for(&self, path: &str) -> Option<&ApiKeys> {
        if path == "/metrics"
            && let Some(m) = &self.metrics
        {
            return Some(m);
        }
        if self.open.iter().any(|p| p == path) {
            return None;
        }
        self.clients.as_ref()
    }
}

/// A tower layer that checks API keys (and their limits) before the inner service
/// sees a request: see the [module documentation](self).
#[derive(Debug, Clone)]
pub struct ApiKeyLayer {
    policy: Arc<Policy>,
}

impl ApiKeyLayer {
    /// Every path needs one of `keys`, except `/health` and `/metrics`.
    pub fn new(keys: ApiKeys) -> Self {
        ApiKeyLayer {
            policy: Arc::new(Policy {
                clients: Some(keys),
                metrics: None,
                open: vec!["/health".to_owned(), "/metrics".to_owned()],
            }),
        }
    }

    /// Only `/metrics` needs a key, one of `keys`; every other path is open.
    pub fn metrics_only(keys: ApiKeys) -> Self {
        ApiKeyLayer {
            policy: Arc::new(Policy {
                clients: None,
                metrics: Some(keys),
                open: Vec::new(),
            }),
        }
    }

    /// `/metrics` needs one of `keys` (a scraper's; the client keys do not open it).
    pub fn metrics_keys(self, keys: ApiKeys) -> Self {
        self.map_policy(|p| p.metrics = Some(keys))
    }

    /// `path` is open to anyone, like `/health`.
    pub fn open_path(self, path: impl Into<String>) -> Self {
        let path = path.into();
        self.map_policy(|p| p.open.push(path))
    }

    fn map_policy(self, f: impl FnOnce(&mut Policy)) -> Self {
        let mut policy = Policy {
            clients: self.policy.clients.clone(),
            metrics: self.policy.metrics.clone(),
            open: self.policy.open.clone(),
        };
        f(&mut policy);
        ApiKeyLayer {
            policy: Arc::new(policy),
        }
    }
}

impl<S> tower::Layer<S> for ApiKeyLayer {
    type Service = ApiKeyService<S>;

    fn layer(&self, inner: S) -> ApiKeyService<S> {
        ApiKeyService {
            inner,
            policy: Arc::clone(&self.policy),
        }
    }
}

/// The service of [`ApiKeyLayer`].
#[derive(Debug, Clone)]
pub struct ApiKeyService<S> {
    inner: S,
    policy: Arc<Policy>,
}

impl<S, B, RB> tower::Service<Request<B>> for ApiKeyService<S>
where
    S: tower::Service<Request<B>, Response = Response<RB>>,
    RB: Body<Data = Bytes>,
{
    type Response = Response<KeyBody<RB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> ResponseFuture<S::Future> {
        let Some(keys) = self.policy.keys_for(req.uri().path()) else {
            return ResponseFuture::called(self.inner.call(req), None);
        };
        match keys.check(req.headers().get(AUTHORIZATION)) {
            Ok(admitted) => {
                req.extensions_mut().insert(admitted.id);
                ResponseFuture::called(self.inner.call(req), admitted.slot)
            }
            Err(refusal) => ResponseFuture::refused(refusal.to_response()),
        }
    }
}

pin_project_lite::pin_project! {
    /// The future of [`ApiKeyService`]: the inner service's answer with the key's
    /// in-flight place moved into its body, or the refusal.
    pub struct ResponseFuture<F> {
        #[pin]
        state: State<F>,
    }
}

pin_project_lite::pin_project! {
    #[project = StateProj]
    enum State<F> {
        Called {
            #[pin]
            future: F,
            slot: Option<InFlightSlot>,
        },
        Refused {
            response: Option<Response<Bytes>>,
        },
    }
}

impl<F> ResponseFuture<F> {
    fn called(future: F, slot: Option<InFlightSlot>) -> Self {
        ResponseFuture {
            state: State::Called { future, slot },
        }
    }

    fn refused(response: Response<Bytes>) -> Self {
        ResponseFuture {
            state: State::Refused {
                response: Some(response),
            },
        }
    }
}

impl<F> fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<F, RB, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<RB>, E>>,
{
    type Output = Result<Response<KeyBody<RB>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Called { future, slot } => {
                let resp = std::task::ready!(future.poll(cx))?;
                let slot = slot.take();
                Poll::Ready(Ok(resp.map(|body| KeyBody {
                    inner: Inner::Served { body, slot },
                })))
            }
            StateProj::Refused { response } => {
                // Polled again after it completed: an empty answer rather than a panic.
                let resp = response.take().unwrap_or_default();
                Poll::Ready(Ok(resp.map(|bytes| KeyBody {
                    inner: Inner::Refused { bytes: Some(bytes) },
                })))
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// The response body of [`ApiKeyService`]: the inner service's body, holding the
    /// key's in-flight place until it ends or is dropped, or a refusal's error body.
    pub struct KeyBody<B> {
        #[pin]
        inner: Inner<B>,
    }
}

pin_project_lite::pin_project! {
    #[project = InnerProj]
    enum Inner<B> {
        Served {
            #[pin]
            body: B,
            slot: Option<InFlightSlot>,
        },
        Refused {
            bytes: Option<Bytes>,
        },
    }
}

impl<B> fmt::Debug for KeyBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyBody").finish_non_exhaustive()
    }
}

impl<B> Body for KeyBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().inner.project() {
            InnerProj::Served { body, slot } => {
                let polled = std::task::ready!(body.poll_frame(cx));
                if polled.is_none() {
                    // The answer is over: the key's place frees now, not when the
                    // connection gets round to dropping the body.
                    slot.take();
                }
                Poll::Ready(polled)
            }
            InnerProj::Refused { bytes } => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Served { body, .. } => body.is_end_stream(),
            Inner::Refused { bytes } => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Served { body, .. } => body.size_hint(),
            Inner::Refused { bytes } => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
        }
    }
}

// === EngineKeys ===

/// The keys the proxy presents to engines, as `Authorization: Bearer KEY`: one for every
/// engine, and one per engine (by its URL's scheme, host and port) that wins over it.
///
/// Set in [`HttpTransportConfig::engine_keys`](crate::HttpTransportConfig::engine_keys);
/// the transport then sends the key on every request to that engine, replacing any
/// `authorization` the request carried. `Debug` shows how many keys there are, never
/// the keys.
///
/// # Examples
///
/// ```
/// use disagg_http::auth::EngineKeys;
/// let keys = EngineKeys::default()
///     .with_default("sk-engines")?
///     .with_engine("https://10.0.0.7:8200", "sk-decode-7")?;
/// assert!(!keys.is_empty());
/// assert!(!format!("{keys:?}").contains("sk-"));
/// # Ok::<(), disagg_http::auth::KeyError>(())
/// ```
#[derive(Clone, Default)]
pub struct EngineKeys {
    default: Option<HeaderValue>,
    per_engine: Vec<(bool, Authority, HeaderValue)>,
}

impl fmt::Debug for EngineKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineKeys")
            .field("default", &self.default.is_some())
            .field("per_engine", &self.per_engine.len())
            .finish()
    }
}

fn bearer_value(key: &str, what: impl FnOnce() -> String) -> Result<HeaderValue, KeyError> {
    valid_key(key, what)?;
    let mut v = HeaderValue::try_from(format!("Bearer {key}")).map_err(|_| KeyError::Invalid {
        what: "engine key".into(),
    })?;
    // Shown as `Sensitive` by `Debug`; HTTP/2 encoders keep it out of their tables.
    v.set_sensitive(true);
    Ok(v)
}

impl EngineKeys {
    /// The same keys, with `key` for every engine that has no key of its own.
    ///
    /// # Errors
    ///
    /// [`KeyError::Invalid`] for a key that is no bearer token.
    pub fn with_default(mut self, key: &str) -> Result<Self, KeyError> {
        self.default = Some(bearer_value(key, || "engine key".into())?);
        Ok(self)
    }

    /// The same keys, with `key` for the engine at `url` (`http(s)://host:port`, a
    /// trailing `/` or `@RANK` allowed: every rank of the engine gets it).
    ///
    /// # Errors
    ///
    /// [`KeyError::EngineUrl`] for a URL that names no engine, [`KeyError::Invalid`]
    /// for a key that is no bearer token.
    pub fn with_engine(mut self, url: &str, key: &str) -> Result<Self, KeyError> {
        let bad = || KeyError::EngineUrl {
            url: url.to_owned(),
        };
        let base = match url.rsplit_once('@') {
            Some((base, rank)) if rank.bytes().all(|b| b.is_ascii_digit()) => base,
            _ => url,
        };
        let uri: Uri = base.trim_end_matches('/').parse().map_err(|_| bad())?;
        let tls = match uri.scheme() {
            Some(s) if *s == Scheme::HTTPS => true,
            Some(s) if *s == Scheme::HTTP => false,
            _ => return Err(bad()),
        };
        let authority = uri.authority().cloned().ok_or_else(bad)?;
        let value = bearer_value(key, || format!("engine key for {url}"))?;
        self.per_engine
            .retain(|(t, a, _)| !(*t == tls && *a == authority));
        self.per_engine.push((tls, authority, value));
        Ok(self)
    }

    /// Whether no key is configured (the transport then sends none).
    pub fn is_empty(&self) -> bool {
        self.default.is_none() && self.per_engine.is_empty()
    }

    /// The `authorization` value for the engine at `authority` (over TLS or not).
    pub(crate) fn for_engine(&self, tls: bool, authority: &Authority) -> Option<&HeaderValue> {
        self.per_engine
            .iter()
            .find(|(t, a, _)| *t == tls && a == authority)
            .map(|(_, _, v)| v)
            .or(self.default.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(v: &str) -> HeaderValue {
        HeaderValue::from_str(v).unwrap()
    }

    #[test]
    fn bearer_tokens_are_read_like_vllm_reads_them() {
        assert_eq!(bearer(&header("Bearer sk-a")), Some(&b"sk-a"[..]));
        assert_eq!(bearer(&header("bearer sk-a")), Some(&b"sk-a"[..]));
        assert_eq!(bearer(&header("BEARER   sk-a  ")), Some(&b"sk-a"[..]));
        for bad in ["Basic c2s=", "Bearer", "Bearer ", "Bearersk-a", "sk-a"] {
            assert_eq!(bearer(&header(bad)), None, "{bad}");
        }
    }

    #[test]
    fn keys_are_checked_and_named_by_their_id() {
        let keys = ApiKeys::new(["sk-a", "sk-b", "sk-a"]).unwrap();
        assert_eq!(keys.len(), 2);
        let ok = keys.check(Some(&header("Bearer sk-b"))).unwrap();
        assert_eq!(ok.id(), KeyId::of("sk-b"));
        assert_eq!(keys.check(None).unwrap_err(), Refusal::Missing);
        assert_eq!(
            keys.check(Some(&header("Bearer sk-c"))).unwrap_err(),
            Refusal::Invalid
        );
        // A prefix of a key is no key.
        assert_eq!(
            keys.check(Some(&header("Bearer sk-"))).unwrap_err(),
            Refusal::Invalid
        );
        let s = keys.stats();
        assert_eq!((s.missing, s.invalid), (1, 2));
    }

    #[test]
    fn an_empty_set_refuses_everyone() {
        let keys = ApiKeys::new(Vec::<String>::new()).unwrap();
        assert!(keys.is_empty());
        assert_eq!(
            keys.check(Some(&header("Bearer anything"))).unwrap_err(),
            Refusal::Invalid
        );
    }

    #[test]
    fn invalid_keys_are_refused_without_showing_them() {
        for bad in ["", "sk a", "sk\u{e9}", "sk\ta"] {
            let err = ApiKeys::new([bad]).unwrap_err().to_string();
            assert!(err.contains("key #1"), "{err}");
            if !bad.is_empty() {
                assert!(!err.contains(bad), "{err}");
            }
        }
        let err = parse_key_file(b"# ok\nsk-ok\nsk secret\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 3") && !err.contains("secret"), "{err}");
    }

    #[test]
    fn reloads_keep_fixed_keys_and_the_state_of_kept_keys() {
        let mut limits = KeyLimits::default();
        limits.max_in_flight = Some(1);
        let keys = ApiKeys::with_limits(["sk-fixed"], limits).unwrap();
        keys.reload(["sk-file-1", "sk-file-2"]).unwrap();
        assert_eq!(keys.len(), 3);
        let held = keys.check(Some(&header("Bearer sk-file-1"))).unwrap();
        // The key kept by a reload keeps its in-flight count...
        keys.reload(["sk-file-1"]).unwrap();
        assert!(matches!(
            keys.check(Some(&header("Bearer sk-file-1"))),
            Err(Refusal::InFlight { max: 1 })
        ));
        // ...a removed key is refused, and the fixed key stays.
        assert_eq!(
            keys.check(Some(&header("Bearer sk-file-2"))).unwrap_err(),
            Refusal::Invalid
        );
        assert!(keys.check(Some(&header("Bearer sk-fixed"))).is_ok());
        drop(held);
        assert!(keys.check(Some(&header("Bearer sk-file-1"))).is_ok());
        // An invalid reload changes nothing.
        assert!(keys.reload(["sk bad"]).is_err());
        assert_eq!(keys.len(), 2);
    }

    #[test]
    fn in_flight_places_come_back_when_admissions_drop() {
        let mut limits = KeyLimits::default();
        limits.max_in_flight = Some(2);
        let keys = ApiKeys::with_limits(["sk-a", "sk-b"], limits).unwrap();
        let a = header("Bearer sk-a");
        let (one, two) = (keys.check(Some(&a)).unwrap(), keys.check(Some(&a)).unwrap());
        let refused = keys.check(Some(&a)).unwrap_err();
        assert_eq!(refused, Refusal::InFlight { max: 2 });
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        // Another key is unaffected.
        assert!(keys.check(Some(&header("Bearer sk-b"))).is_ok());
        drop(one);
        assert!(keys.check(Some(&a)).is_ok());
        drop(two);
        assert_eq!(keys.stats().throttled_in_flight, 1);
    }

    #[test]
    fn the_bucket_allows_its_burst_then_names_the_wait() {
        let mut limits = KeyLimits::default();
        limits.rate = Some(0.25);
        limits.burst_size = Some(2.0);
        let keys = ApiKeys::with_limits(["sk-a", "sk-b"], limits).unwrap();
        let a = header("Bearer sk-a");
        assert!(keys.check(Some(&a)).is_ok());
        assert!(keys.check(Some(&a)).is_ok());
        let refused = keys.check(Some(&a)).unwrap_err();
        // At 0.25/s the next token is up to 4 s away.
        let wait = refused.retry_after().unwrap();
        assert!(
            wait > Duration::from_secs(3) && wait <= Duration::from_secs(4),
            "{wait:?}"
        );
        let resp = refused.to_response();
        assert_eq!(resp.headers()[RETRY_AFTER], "4");
        let body: serde_json::Value = serde_json::from_slice(resp.body()).unwrap();
        assert_eq!(body["error"]["code"], "rate_limit_exceeded");
        // Another key has its own bucket.
        assert!(keys.check(Some(&header("Bearer sk-b"))).is_ok());
    }

    #[test]
    fn refusals_are_openai_errors() {
        let resp = Refusal::Missing.to_response();
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(resp.headers()[WWW_AUTHENTICATE], "Bearer");
        let body: serde_json::Value = serde_json::from_slice(resp.body()).unwrap();
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["code"], "invalid_api_key");
        assert!(body["error"]["param"].is_null());
    }

    #[test]
    fn metrics_hold_no_key_material() {
        let keys = ApiKeys::new(["sk-secret-value"]).unwrap();
        let _ = keys.check(Some(&header("Bearer sk-wrong")));
        let mut out = String::new();
        keys.render_metrics(&mut out);
        assert!(
            out.contains("disagg_auth_refused_total{reason=\"invalid\"} 1"),
            "{out}"
        );
        assert!(!out.contains("sk-") && !out.contains(&KeyId::of("sk-secret-value").to_string()));
        assert!(!format!("{keys:?}").contains("sk-"));
    }

    #[test]
    fn engine_keys_go_by_scheme_host_and_port() {
        let keys = EngineKeys::default()
            .with_default("sk-all")
            .unwrap()
            .with_engine("https://d:1@3", "sk-d")
            .unwrap();
        let a: Authority = "d:1".parse().unwrap();
        assert_eq!(keys.for_engine(true, &a).unwrap(), "Bearer sk-d");
        assert_eq!(keys.for_engine(false, &a).unwrap(), "Bearer sk-all");
        assert!(EngineKeys::default().for_engine(true, &a).is_none());
        assert!(EngineKeys::default().with_engine("d:1", "k").is_err());
    }
}
