//! [`EngineKeys`]: the bearer keys the transport presents to engines.

use std::fmt;

use http::header::HeaderValue;
use http::uri::{Authority, Scheme, Uri};

use super::{KeyError, valid_key};

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
