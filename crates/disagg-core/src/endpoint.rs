//! The model: endpoints, their role, live load, and the immutable set routers read.
//!
//! An [`Endpoint`] is one engine's HTTP base URL with a [`Role`]. Endpoints live in an
//! [`EndpointSet`], published as an immutable snapshot by an
//! [`EndpointSource`](crate::source::EndpointSource). Each endpoint carries its own
//! in-flight counter, so a router reads load from the snapshot it already has, and the
//! orchestrator's [`InFlightGuard`]s keep the count exact whatever way a request ends.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use http::Uri;

use crate::request::Api;
use http::uri::{Authority, Scheme};

/// An endpoint's identity: its base URL as configured.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointId(Arc<str>);

impl EndpointId {
    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<&str> for EndpointId {
    fn from(s: &str) -> Self {
        EndpointId(Arc::from(s))
    }
}

impl From<String> for EndpointId {
    fn from(s: String) -> Self {
        EndpointId(Arc::from(s))
    }
}

impl fmt::Display for EndpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for EndpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// The leg an endpoint serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Computes the prompt's KV cache.
    Prefill,
    /// Receives the KV cache and generates the tokens.
    Decode,
}

/// The URL given for an endpoint is not usable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointError {
    /// Not a URL.
    #[error("invalid endpoint url `{url}`")]
    InvalidUrl {
        /// What was given.
        url: String,
        /// Why it did not parse.
        #[source]
        source: http::uri::InvalidUri,
    },
    /// Not an `http://host:port` URL.
    #[error("endpoint url `{url}` must be http://host[:port] with no path")]
    Unsupported {
        /// What was given.
        url: String,
    },
}

/// One engine: where it is, what it does, and how busy it is now.
///
/// Protocol data (a bootstrap port, NIXL ranks) does not live here as fields: connectors
/// keep their typed values in [`ext`](Self::ext).
pub struct Endpoint {
    id: EndpointId,
    scheme: Scheme,
    authority: Authority,
    role: Role,
    in_flight: AtomicUsize,
    ext: http::Extensions,
    /// The URIs of the two completion APIs, built once: a leg's request then clones
    /// shared bytes instead of parsing and allocating a URI per request.
    chat_uri: Uri,
    completions_uri: Uri,
}

impl Endpoint {
    /// An endpoint at `url` (`http://host:port`, a trailing `/` allowed) with `role`.
    ///
    /// # Errors
    ///
    /// [`EndpointError`] when `url` is not an absolute `http` URL without a path.
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_core::endpoint::{Endpoint, Role};
    /// let p = Endpoint::new("http://10.0.0.5:8100", Role::Prefill)?;
    /// assert_eq!(p.host(), "10.0.0.5");
    /// # Ok::<(), disagg_core::endpoint::EndpointError>(())
    /// ```
    pub fn new(url: &str, role: Role) -> Result<Self, EndpointError> {
        Self::with_extensions(url, role, http::Extensions::new())
    }

    /// Like [`new`](Self::new), with connector data in `ext`.
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new).
    pub fn with_extensions(
        url: &str,
        role: Role,
        ext: http::Extensions,
    ) -> Result<Self, EndpointError> {
        let trimmed = url.trim_end_matches('/');
        let uri: Uri = trimmed
            .parse()
            .map_err(|source| EndpointError::InvalidUrl {
                url: url.to_owned(),
                source,
            })?;
        let parts = uri.into_parts();
        let unsupported = || EndpointError::Unsupported {
            url: url.to_owned(),
        };
        let scheme = parts.scheme.ok_or_else(unsupported)?;
        if scheme != Scheme::HTTP {
            return Err(unsupported());
        }
        let authority = parts.authority.ok_or_else(unsupported)?;
        if parts
            .path_and_query
            .is_some_and(|p| p.as_str() != "/" && !p.as_str().is_empty())
        {
            return Err(unsupported());
        }
        let api_uri = |api: Api| {
            Uri::builder()
                .scheme(scheme.clone())
                .authority(authority.clone())
                .path_and_query(api.path())
                .build()
                .map_err(|_| unsupported())
        };
        Ok(Endpoint {
            id: EndpointId::from(trimmed),
            chat_uri: api_uri(Api::Chat)?,
            completions_uri: api_uri(Api::Completions)?,
            scheme,
            authority,
            role,
            in_flight: AtomicUsize::new(0),
            ext,
        })
    }

    /// The endpoint's id (its base URL).
    pub fn id(&self) -> &EndpointId {
        &self.id
    }

    /// The endpoint's role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The `host:port` part of the URL.
    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    /// The host part of the URL, without brackets for IPv6.
    pub fn host(&self) -> &str {
        self.authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
    }

    /// An absolute URI for `path_and_query` on this endpoint.
    ///
    /// # Errors
    ///
    /// When `path_and_query` is not a valid request target.
    pub fn uri(&self, path_and_query: &str) -> Result<Uri, http::Error> {
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(path_and_query)
            .build()
    }

    /// The absolute URI of `api` on this endpoint (built once, cloned cheaply).
    ///
    /// # Errors
    ///
    /// None today; the `Result` keeps room for endpoints whose API paths are configured.
    pub fn api_uri(&self, api: Api) -> Result<Uri, http::Error> {
        Ok(match api {
            Api::Chat => self.chat_uri.clone(),
            Api::Completions => self.completions_uri.clone(),
        })
    }

    /// Connector data attached to this endpoint.
    pub fn ext(&self) -> &http::Extensions {
        &self.ext
    }

    /// Requests in flight on this endpoint now (counted until their body ends).
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Count one more request in flight until the returned guard drops.
    pub fn track(self: &Arc<Self>) -> InFlightGuard {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlightGuard {
            endpoint: Arc::clone(self),
        }
    }
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("id", &self.id)
            .field("role", &self.role)
            .field("in_flight", &self.in_flight())
            .finish_non_exhaustive()
    }
}

/// Holds one unit of an endpoint's in-flight count; dropping it releases the unit.
///
/// The orchestrator keeps the decode leg's guard inside the response body, so a stream is
/// counted until its last byte is sent or the client goes away.
#[derive(Debug)]
pub struct InFlightGuard {
    endpoint: Arc<Endpoint>,
}

impl InFlightGuard {
    /// The endpoint this guard counts against.
    pub fn endpoint(&self) -> &Arc<Endpoint> {
        &self.endpoint
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.endpoint.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An immutable snapshot of the endpoints requests may go to, by role.
#[derive(Debug, Clone, Default)]
pub struct EndpointSet {
    prefill: Vec<Arc<Endpoint>>,
    decode: Vec<Arc<Endpoint>>,
}

impl EndpointSet {
    /// A set from endpoints of either role.
    pub fn new(endpoints: impl IntoIterator<Item = Arc<Endpoint>>) -> Self {
        let mut set = EndpointSet::default();
        for ep in endpoints {
            match ep.role() {
                Role::Prefill => set.prefill.push(ep),
                Role::Decode => set.decode.push(ep),
            }
        }
        set
    }

    /// The prefill endpoints.
    pub fn prefill(&self) -> &[Arc<Endpoint>] {
        &self.prefill
    }

    /// The decode endpoints.
    pub fn decode(&self) -> &[Arc<Endpoint>] {
        &self.decode
    }

    /// The endpoints of `role`.
    pub fn by_role(&self, role: Role) -> &[Arc<Endpoint>] {
        match role {
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_base_urls() {
        let ep = Endpoint::new("http://127.0.0.1:8000/", Role::Decode).unwrap();
        assert_eq!(ep.id().as_str(), "http://127.0.0.1:8000");
        assert_eq!(ep.authority().as_str(), "127.0.0.1:8000");
        assert_eq!(
            ep.uri("/v1/completions").unwrap().to_string(),
            "http://127.0.0.1:8000/v1/completions"
        );
        assert!(Endpoint::new("http://h:1/v1", Role::Decode).is_err());
        assert!(Endpoint::new("https://h:1", Role::Decode).is_err());
        assert!(Endpoint::new("h:1", Role::Decode).is_err());
        assert!(Endpoint::new("not a url", Role::Decode).is_err());
    }

    #[test]
    fn guards_count_in_flight() {
        let ep = Arc::new(Endpoint::new("http://h:1", Role::Prefill).unwrap());
        let a = ep.track();
        let b = ep.track();
        assert_eq!(ep.in_flight(), 2);
        drop(a);
        assert_eq!(ep.in_flight(), 1);
        drop(b);
        assert_eq!(ep.in_flight(), 0);
    }
}
