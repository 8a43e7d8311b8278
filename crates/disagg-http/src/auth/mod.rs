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
//! - Paths are compared in the normal form the service routes
//!   ([`crate::path::normalize`]): `//metrics` and `/%6detrics` need the metrics key as
//!   `/metrics` does. A model card's id with an encoded `/` (`/v1/models/org%2Fmodel`)
//!   needs what `/v1/models/org/model` needs; any other path with no normal form needs
//!   a client key (the service then refuses it with 400).
//! - The scheme is matched case-insensitively (RFC 9110 §11.1), as vLLM does.
//!
//! The 401 is OpenAI's: `{"error": {"message", "type": "invalid_request_error", "param":
//! null, "code": "invalid_api_key"}}` with `www-authenticate: Bearer` (RFC 9110 §11.6.1).
//! vLLM's `--api-key` answers `{"error": "Unauthorized"}` instead (`vllm-project/vllm
//! vllm/entrypoints/openai/server_utils.py`, `AuthenticationMiddleware`); the proxy speaks
//! to OpenAI clients, whose SDKs read `error.message` and `error.code`.
//!
//! ## Comparison in constant time, in constant time per key set
//!
//! Keys are kept only as keyed digests: HMAC-SHA256 under a salt drawn at random for
//! each [`ApiKeys`] (never stored or shown). A presented key is digested the same way,
//! the digest's first 8 bytes are looked up in a hash map, and the whole digest found is
//! compared with `subtle`'s constant-time equality. Digesting first makes every
//! comparison 32 bytes long whatever the key's length (a byte-wise comparison of the
//! keys themselves would stop at the first difference, and time would tell how much of
//! a guess was right); the salt makes the digest of a guess unpredictable, so the
//! map lookup's timing tells nothing about any configured key. A check costs one HMAC
//! and one lookup whether the set holds one key or 100,000 (vLLM hashes with
//! `hashlib.sha256` and compares with `secrets.compare_digest` against every token,
//! which is linear in their number). A reload builds the new set in O(n) outside the
//! lock the checks read, and swaps it in.
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
//! which an inotify watch on the file never sees. Its first read is compared with the
//! keys in force, not taken as loaded: a key revoked between the load and the watch's
//! start (while a proxy probes its engines) is revoked then. An unreadable or invalid
//! file keeps the keys in force, logged and counted once per distinct state.
//!
//! # Engines
//!
//! [`EngineKeys`] are the keys the proxy presents to engines started with `--api-key`
//! (vLLM, SGLang): [`HttpTransport`](crate::HttpTransport) sets `Authorization: Bearer
//! KEY` on every request it sends to an engine that has one (both legs, `GET /v1/models`,
//! Mooncake's `/query`, LMCache's `/tokenize`, health checks), replacing whatever
//! `authorization` the request had. A client's own `authorization` never reaches an
//! engine unless the orchestrator is told to forward it
//! ([`OrchestratorConfig::forward_authorization`](disagg_core::orchestrator::OrchestratorConfig::forward_authorization)),
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

mod engine;
mod file;
mod keys;
mod layer;
mod limits;
mod refusal;
#[cfg(test)]
mod tests;

use std::fmt;
use std::path::PathBuf;
use std::sync::RwLock;

pub use engine::EngineKeys;
pub use file::{KeyFile, parse_key_file};
pub use keys::{Admitted, ApiKeys, KeyStats};
pub use layer::{ApiKeyLayer, ApiKeyService, KeyBody, ResponseFuture};
pub use limits::KeyLimits;
pub use refusal::Refusal;

pub mod guide {
    //! The security guide (`docs/security.md`).
    #![doc = include_str!("../../docs/security.md")]
}

/// The longest key accepted: far above any real one (OpenAI's are under 200 bytes), low
/// enough that a key file mistaken for another file is refused.
const MAX_KEY_BYTES: usize = 4096;

/// The largest key file read: 250,000 keys of 64 characters fit in it.
const MAX_KEY_FILE_BYTES: u64 = 16 * 1024 * 1024;

/// The most keys one set holds (about 40 MB of state at most): beyond any one proxy's
/// clients, low enough that a file of one-letter lines cannot make millions.
const MAX_KEYS: usize = 250_000;

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
    /// More keys than one set may hold.
    #[error("more than {max} keys")]
    TooMany {
        /// The ceiling.
        max: usize,
    },
    /// The random salt of the keys' digests could not be drawn from the OS.
    #[error("no randomness from the operating system for the key digests' salt")]
    Salt,
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

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    // Nothing panics while holding it with the set half-replaced.
    lock.read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
