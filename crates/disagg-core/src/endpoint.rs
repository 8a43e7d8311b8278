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

use crate::error::RouteError;
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
    /// Not an `http://host:port` or `https://host:port` URL.
    #[error("endpoint url `{url}` must be http://host[:port] or https://host[:port] with no path")]
    Unsupported {
        /// What was given.
        url: String,
    },
    /// The `@RANK` suffix is not a data-parallel rank.
    #[error("endpoint `{url}`: the data-parallel rank after `@` must fit in 32 bits")]
    InvalidRank {
        /// What was given.
        url: String,
    },
}

/// One engine (or one data-parallel rank of an engine): where it is, what it does, what
/// it serves and how busy it is now.
///
/// An engine that runs several data-parallel (DP) ranks behind one HTTP server is
/// configured as one endpoint per rank, written `URL@RANK` (`http://10.0.0.5:8100@1`).
/// Each rank is then a routing candidate of its own with its own in-flight count, so
/// every policy spreads, pins or balances over ranks without knowing about them; the
/// ranks share the engine's connection pool, and the route carries the rank to the
/// connector, which passes it on as its protocol says.
///
/// Protocol data (a bootstrap port, NIXL ranks) does not live here as fields: connectors
/// keep their typed values in [`ext`](Self::ext).
pub struct Endpoint {
    id: EndpointId,
    scheme: Scheme,
    authority: Authority,
    role: Role,
    rank: Option<u32>,
    models: Option<Arc<[Arc<str>]>>,
    in_flight: AtomicUsize,
    /// The whole engine, for a rank endpoint made by [`Endpoint::dp_rank`]: its requests
    /// count there too.
    engine: Option<Arc<Endpoint>>,
    ext: http::Extensions,
    /// The URIs of the APIs legs are sent to, built once: a leg's request then clones
    /// shared bytes instead of parsing and allocating a URI per request.
    chat_uri: Uri,
    completions_uri: Uri,
    generate_uri: Uri,
}

impl Endpoint {
    /// An endpoint at `url` (`http://host:port` or `https://host:port`, a trailing `/`
    /// allowed) with `role`; `url@RANK` names one data-parallel rank of the engine.
    ///
    /// # Errors
    ///
    /// [`EndpointError`] when `url` is not an absolute `http` or `https` URL without a
    /// path, or its rank is not a number.
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_core::endpoint::{Endpoint, Role};
    /// let p = Endpoint::new("http://10.0.0.5:8100", Role::Prefill)?;
    /// assert_eq!(p.host(), "10.0.0.5");
    /// assert_eq!(p.rank(), None);
    ///
    /// let rank = Endpoint::new("http://10.0.0.5:8100@3", Role::Prefill)?;
    /// assert_eq!((rank.authority().as_str(), rank.rank()), ("10.0.0.5:8100", Some(3)));
    /// assert_eq!(rank.id().as_str(), "http://10.0.0.5:8100@3");
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
        let (base, rank) = split_rank(url)?;
        let trimmed = base.trim_end_matches('/');
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
        // `https` is the transport's business (TLS to the engine); the core only keeps
        // the scheme in the URIs it builds.
        if scheme != Scheme::HTTP && scheme != Scheme::HTTPS {
            return Err(unsupported());
        }
        let authority = parts
            .authority
            .filter(|a| !a.as_str().contains('@'))
            .ok_or_else(unsupported)?;
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
        let id = match rank {
            Some(r) => EndpointId::from(format!("{trimmed}@{r}")),
            None => EndpointId::from(trimmed),
        };
        Ok(Endpoint {
            id,
            rank,
            models: None,
            chat_uri: api_uri(Api::Chat)?,
            completions_uri: api_uri(Api::Completions)?,
            generate_uri: api_uri(Api::Generate)?,
            scheme,
            authority,
            role,
            in_flight: AtomicUsize::new(0),
            engine: None,
            ext,
        })
    }

    /// One data-parallel rank of this engine, for a connector that picks the rank itself
    /// after routing (vLLM Mooncake asks the engine which ranks it runs): `URL@rank`, with
    /// this endpoint's role, models and connector data, and its own in-flight count,
    /// which also counts towards this endpoint's, so that routers keep seeing the whole
    /// engine's load.
    pub(crate) fn dp_rank(self: &Arc<Self>, rank: u32) -> Endpoint {
        let base = self.engine.as_ref().unwrap_or(self);
        // An endpoint configured as `URL@RANK` names a rank already: its engine's URL is
        // the part before the `@`.
        let base_url = match base.rank {
            Some(_) => base
                .id
                .as_str()
                .rsplit_once('@')
                .map_or(base.id.as_str(), |(u, _)| u),
            None => base.id.as_str(),
        };
        Endpoint {
            id: EndpointId::from(format!("{base_url}@{rank}")),
            scheme: base.scheme.clone(),
            authority: base.authority.clone(),
            role: base.role,
            rank: Some(rank),
            models: base.models.clone(),
            in_flight: AtomicUsize::new(0),
            engine: Some(Arc::clone(base)),
            ext: base.ext.clone(),
            chat_uri: base.chat_uri.clone(),
            completions_uri: base.completions_uri.clone(),
            generate_uri: base.generate_uri.clone(),
        }
    }

    /// The same endpoint, serving only `models` (the names clients put in `model`).
    ///
    /// An endpoint that declares no models serves any model. Once any endpoint of a set
    /// declares models, the set routes by model: see [`EndpointSet::for_model`].
    pub fn with_models<I>(mut self, models: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<Arc<str>>,
    {
        self.models = Some(models.into_iter().map(Into::into).collect());
        self
    }

    /// The endpoint's id: its base URL, with `@RANK` for a data-parallel rank.
    pub fn id(&self) -> &EndpointId {
        &self.id
    }

    /// The data-parallel rank this endpoint stands for, if it names one.
    pub fn rank(&self) -> Option<u32> {
        self.rank
    }

    /// The models this endpoint declares it serves; `None` when it declares none (and
    /// serves any).
    pub fn models(&self) -> Option<&[Arc<str>]> {
        self.models.as_deref()
    }

    /// Whether this endpoint serves `model`: it declares it, or declares no models.
    pub(crate) fn serves(&self, model: &str) -> bool {
        self.models
            .as_deref()
            .is_none_or(|ms| ms.iter().any(|m| &**m == model))
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
    pub(crate) fn api_uri(&self, api: Api) -> Result<Uri, http::Error> {
        Ok(match api {
            Api::Chat => self.chat_uri.clone(),
            Api::Completions => self.completions_uri.clone(),
            Api::Generate => self.generate_uri.clone(),
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
        if let Some(engine) = &self.engine {
            engine.in_flight.fetch_add(1, Ordering::Relaxed);
        }
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

/// `url` without a trailing `@RANK`, and the rank. A URL with user information
/// (`http://user@host`) is not an engine URL; an `@` whose tail is not a number is left
/// for the URL check to refuse.
fn split_rank(url: &str) -> Result<(&str, Option<u32>), EndpointError> {
    match url.rsplit_once('@') {
        Some((base, rank)) if !rank.is_empty() && rank.bytes().all(|b| b.is_ascii_digit()) => {
            let rank = rank.parse().map_err(|_| EndpointError::InvalidRank {
                url: url.to_owned(),
            })?;
            Ok((base, Some(rank)))
        }
        _ => Ok((url, None)),
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
    pub(crate) fn endpoint(&self) -> &Arc<Endpoint> {
        &self.endpoint
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.endpoint.in_flight.fetch_sub(1, Ordering::Relaxed);
        if let Some(engine) = &self.endpoint.engine {
            engine.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// An immutable snapshot of the endpoints requests may go to, by role.
///
/// When any endpoint declares the models it serves ([`Endpoint::with_models`]), the set
/// also holds, built once here, the subset of endpoints for each model, and requests are
/// routed by their `model` ([`for_model`](Self::for_model)); a lookup on the request path
/// costs one hash of the model name and allocates nothing.
#[derive(Debug, Clone, Default)]
pub struct EndpointSet {
    prefill: Vec<Arc<Endpoint>>,
    decode: Vec<Arc<Endpoint>>,
    models: Option<Arc<ModelIndex>>,
}

/// The per-model subsets of a set whose endpoints declare models.
#[derive(Debug)]
struct ModelIndex {
    /// Each declared model: the endpoints declaring it, plus those declaring none.
    by_model: std::collections::HashMap<Arc<str>, EndpointSet>,
    /// The endpoints declaring no model: they serve any name the others do not.
    undeclared: EndpointSet,
    /// The models some decode endpoint declares, sorted.
    served: Arc<[Arc<str>]>,
}

impl EndpointSet {
    /// A set from endpoints of either role.
    pub fn new(endpoints: impl IntoIterator<Item = Arc<Endpoint>>) -> Self {
        let mut set = Self::by_roles(endpoints);
        set.models = ModelIndex::build(&set).map(Arc::new);
        set
    }

    fn by_roles(endpoints: impl IntoIterator<Item = Arc<Endpoint>>) -> Self {
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

    /// The models some decode endpoint declares, sorted; empty when no endpoint
    /// declares any.
    pub fn served_models(&self) -> &[Arc<str>] {
        self.models.as_ref().map_or(&[], |m| &m.served)
    }

    /// The endpoints that serve `model`: the whole set when no endpoint declares models;
    /// otherwise those declaring `model` and those declaring none. A request without a
    /// model goes to the one model served, if there is just one.
    ///
    /// # Errors
    ///
    /// [`RouteError::UnknownModel`] when no decode
    /// endpoint serves `model`, and
    /// [`RouteError::ModelRequired`] when the request
    /// names no model and the endpoints serve several.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use disagg_core::error::RouteError;
    /// use disagg_core::{Endpoint, EndpointSet, Role};
    ///
    /// let set = EndpointSet::new([
    ///     Endpoint::new("http://p1:8100", Role::Prefill)?.with_models(["llama"]),
    ///     Endpoint::new("http://d1:8200", Role::Decode)?.with_models(["llama"]),
    ///     Endpoint::new("http://d2:8200", Role::Decode)?.with_models(["qwen"]),
    /// ].map(Arc::new));
    /// let llama = set.for_model(Some("llama"))?;
    /// assert_eq!(llama.decode()[0].id().as_str(), "http://d1:8200");
    /// assert!(matches!(set.for_model(Some("gpt")), Err(RouteError::UnknownModel { .. })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn for_model(&self, model: Option<&str>) -> Result<&EndpointSet, RouteError> {
        let Some(index) = &self.models else {
            return Ok(self);
        };
        let found = match model {
            Some(m) => index.by_model.get(m).or(Some(&index.undeclared)),
            None => match &*index.served {
                [only] => index.by_model.get(only),
                _ => Some(&index.undeclared),
            },
        };
        match (found, model) {
            (Some(set), _) if !set.decode.is_empty() => Ok(set),
            (_, Some(m)) => Err(RouteError::UnknownModel {
                model: m.to_owned(),
                served: Arc::clone(&index.served),
            }),
            (_, None) => Err(RouteError::ModelRequired {
                served: Arc::clone(&index.served),
            }),
        }
    }
}

impl ModelIndex {
    /// The index of `set`, or `None` when no endpoint declares a model.
    fn build(set: &EndpointSet) -> Option<ModelIndex> {
        let all = || set.prefill.iter().chain(&set.decode);
        all().find_map(|e| e.models())?;
        let declared: std::collections::BTreeSet<&Arc<str>> =
            all().filter_map(|e| e.models()).flatten().collect();
        let subset = |keep: &dyn Fn(&Endpoint) -> bool| {
            EndpointSet::by_roles(all().filter(|e| keep(e)).cloned())
        };
        let by_model = declared
            .iter()
            .map(|m| ((*m).clone(), subset(&|e| e.serves(m))))
            .collect();
        let served = set
            .decode
            .iter()
            .filter_map(|e| e.models())
            .flatten()
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .cloned()
            .collect();
        Some(ModelIndex {
            by_model,
            undeclared: subset(&|e| e.models().is_none()),
            served,
        })
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
        let tls = Endpoint::new("https://h:1", Role::Decode).unwrap();
        assert_eq!(
            tls.uri("/health").unwrap().to_string(),
            "https://h:1/health"
        );
        assert!(Endpoint::new("ftp://h:1", Role::Decode).is_err());
        assert!(Endpoint::new("h:1", Role::Decode).is_err());
        assert!(Endpoint::new("not a url", Role::Decode).is_err());
    }

    #[test]
    fn a_rank_endpoint_counts_towards_its_engine() {
        let engine = Arc::new(Endpoint::new("http://10.0.0.5:8100", Role::Prefill).unwrap());
        let rank = Arc::new(engine.dp_rank(1));
        assert_eq!(rank.id().as_str(), "http://10.0.0.5:8100@1");
        let guard = rank.track();
        assert_eq!((rank.in_flight(), engine.in_flight()), (1, 1));
        drop(guard);
        assert_eq!((rank.in_flight(), engine.in_flight()), (0, 0));
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

    #[test]
    fn a_rank_suffix_names_a_data_parallel_rank() {
        let ep = Endpoint::new("http://10.0.0.1:8100/@7", Role::Prefill).unwrap();
        assert_eq!(ep.rank(), Some(7));
        assert_eq!(ep.id().as_str(), "http://10.0.0.1:8100@7");
        assert_eq!(ep.authority().as_str(), "10.0.0.1:8100");
        assert_eq!(
            ep.api_uri(Api::Chat).unwrap().to_string(),
            "http://10.0.0.1:8100/v1/chat/completions"
        );
        assert!(matches!(
            Endpoint::new("http://h:1@99999999999", Role::Decode),
            Err(EndpointError::InvalidRank { .. })
        ));
        // User information is no rank, and no engine URL either.
        assert!(Endpoint::new("http://user@h:1", Role::Decode).is_err());
        let route = crate::router::Route::new(
            Some(Arc::new(ep)),
            Arc::new(Endpoint::new("http://d:1@2", Role::Decode).unwrap()),
        );
        assert_eq!((route.prefill_rank, route.decode_rank), (Some(7), Some(2)));
    }

    fn ep(url: &str, role: Role, models: &[&str]) -> Arc<Endpoint> {
        let ep = Endpoint::new(url, role).unwrap();
        Arc::new(if models.is_empty() {
            ep
        } else {
            ep.with_models(models.iter().copied())
        })
    }

    fn ids(eps: &[Arc<Endpoint>]) -> Vec<&str> {
        eps.iter().map(|e| e.id().as_str()).collect()
    }

    #[test]
    fn a_set_without_declared_models_serves_any() {
        let set = EndpointSet::new([
            ep("http://p:1", Role::Prefill, &[]),
            ep("http://d:1", Role::Decode, &[]),
        ]);
        // No endpoint declares models: the set does not route by model.
        assert!(set.models.is_none());
        assert!(set.served_models().is_empty());
        assert!(std::ptr::eq(set.for_model(Some("anything")).unwrap(), &set));
        assert!(std::ptr::eq(set.for_model(None).unwrap(), &set));
    }

    #[test]
    fn models_limit_the_candidates() {
        let set = EndpointSet::new([
            ep("http://p1:1", Role::Prefill, &["llama"]),
            ep("http://p2:1", Role::Prefill, &["qwen", "llama"]),
            ep("http://d1:1", Role::Decode, &["llama"]),
            ep("http://d2:1", Role::Decode, &["qwen"]),
            ep("http://p3:1", Role::Prefill, &["mistral"]),
        ]);
        // Some endpoint declares models: the set routes by model.
        assert!(set.models.is_some());
        assert_eq!(
            set.served_models().iter().map(|m| &**m).collect::<Vec<_>>(),
            ["llama", "qwen"],
            "a model only a prefill serves cannot be served"
        );
        let llama = set.for_model(Some("llama")).unwrap();
        assert_eq!(ids(llama.prefill()), ["http://p1:1", "http://p2:1"]);
        assert_eq!(ids(llama.decode()), ["http://d1:1"]);
        let qwen = set.for_model(Some("qwen")).unwrap();
        assert_eq!(ids(qwen.prefill()), ["http://p2:1"]);
        assert_eq!(ids(qwen.decode()), ["http://d2:1"]);
        match set.for_model(Some("mistral")) {
            Err(RouteError::UnknownModel { model, served }) => {
                assert_eq!(model, "mistral");
                assert_eq!(served.len(), 2);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            set.for_model(Some("gpt")),
            Err(RouteError::UnknownModel { .. })
        ));
        assert!(matches!(
            set.for_model(None),
            Err(RouteError::ModelRequired { .. })
        ));
    }

    #[test]
    fn undeclared_endpoints_serve_every_model_and_the_rest() {
        let set = EndpointSet::new([
            ep("http://p1:1", Role::Prefill, &[]),
            ep("http://d1:1", Role::Decode, &["llama"]),
            ep("http://d2:1", Role::Decode, &[]),
        ]);
        let llama = set.for_model(Some("llama")).unwrap();
        assert_eq!(ids(llama.prefill()), ["http://p1:1"]);
        assert_eq!(ids(llama.decode()), ["http://d1:1", "http://d2:1"]);
        let other = set.for_model(Some("other")).unwrap();
        assert_eq!(ids(other.decode()), ["http://d2:1"]);
        // One declared model: a request naming none goes to it.
        let one = EndpointSet::new([ep("http://d1:1", Role::Decode, &["llama"])]);
        assert_eq!(ids(one.for_model(None).unwrap().decode()), ["http://d1:1"]);
    }
}
