//! The model: endpoints, their role, weight and live load, and the immutable set
//! routers read.
//!
//! An [`Endpoint`] is one engine's HTTP base URL with a [`Role`] and a routing weight.
//! Endpoints live in an [`EndpointSet`], published as an immutable snapshot by an
//! [`EndpointSource`](crate::source::EndpointSource). Each endpoint carries its own
//! in-flight counter, so a router reads load from the snapshot it already has, and the
//! orchestrator's [`InFlightGuard`]s keep the count exact whatever way a request ends.
//!
//! Two rules hold for every endpoint, whatever made it (a flag, a file, a DNS answer, a
//! Kubernetes pod):
//!
//! - an IP address that is link-local or a cloud metadata service's is no engine's
//!   ([`AddressPolicy`]): such a URL is refused unless the policy allows it explicitly;
//! - an engine's data-parallel ranks are counted before one endpoint per rank is made,
//!   so that a range such as `0-4294967295` is refused instead of allocated (the
//!   ranges and their ceiling are `disagg_discovery::{Ranks, DEFAULT_MAX_DP_RANKS}`,
//!   where every list of endpoints, the command line's included, is expanded).

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use http::Uri;

use crate::error::RouteError;
use crate::request::Api;
use http::uri::{Authority, Scheme};

mod facts;
pub use facts::{FactError, Facts};

/// An endpoint's identity: its base URL as configured.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointId(Arc<str>);

impl EndpointId {
    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether this id and `other` name the same engine: the same id, or data-parallel
    /// ranks of one engine (`URL@RANK` and `URL`, or `URL@RANK` and `URL@OTHER`), as a
    /// connector that picks the rank after routing makes them
    /// ([`proto::dp_rank`](crate::proto::dp_rank)).
    pub(crate) fn same_engine(&self, other: &EndpointId) -> bool {
        self == other || engine_url(self.as_str()) == engine_url(other.as_str())
    }
}

/// The engine's URL in an endpoint id: the id without a trailing `@RANK`.
fn engine_url(id: &str) -> &str {
    split_rank(id).map_or(id, |(base, _)| base)
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
///
/// Not exhaustive: a match outside this crate keeps an arm for roles to come.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Role {
    /// Computes the prompt's KV cache.
    Prefill,
    /// Receives the KV cache and generates the tokens.
    Decode,
    /// Encodes a multimodal request's media items before its prefill (E/P/D, an
    /// encoder-only engine: [`encode`](crate::encode)). Never routed a prefill or decode
    /// leg.
    Encode,
}

impl Role {
    /// The role's name, as metrics labels, logs and discovery write it: `prefill`,
    /// `decode`, `encode`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Encode => "encode",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
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
    /// The host is an IP address no engine has: link-local or a cloud metadata
    /// service's ([`AddressPolicy`]).
    #[error(
        "endpoint `{url}`: {ip} is a link-local or cloud metadata address, not an engine's \
         (refused unless link-local engines are allowed explicitly)"
    )]
    RefusedAddress {
        /// What was given.
        url: String,
        /// The refused address.
        ip: IpAddr,
    },
    /// The weight is not a finite positive number.
    #[error("endpoint `{url}`: weight {weight} is not a finite positive number")]
    InvalidWeight {
        /// The endpoint.
        url: String,
        /// The refused weight.
        weight: f64,
    },
}

// === addresses ===

/// Which IP addresses an engine may have.
///
/// By default ([`AddressPolicy::default`]) an endpoint whose host is a link-local or
/// cloud metadata address ([`allows`](Self::allows)) is refused: a proxy would
/// otherwise send prompts, and the engines' keys, to the metadata service every cloud
/// VM and most pods can reach (`169.254.169.254`, AWS's `fd00:ec2::254`), because one
/// line of an endpoints file, one DNS answer or one pod IP said so. An operator who
/// really runs engines on link-local addresses allows them with
/// [`allow_link_local`](Self::allow_link_local).
///
/// The check reads IP literals only: a hostname is resolved when a connection is made,
/// so the rule holds for names where they are resolved (the DNS discovery source checks
/// its answers; `disagg-http`'s transport checks the addresses it connects to).
///
/// # Examples
///
/// ```
/// use disagg_core::endpoint::{AddressPolicy, Endpoint, EndpointError, Role};
///
/// assert!(matches!(
///     Endpoint::new("http://169.254.169.254", Role::Decode),
///     Err(EndpointError::RefusedAddress { .. })
/// ));
/// assert!(matches!(
///     Endpoint::new("http://[::ffff:169.254.169.254]:80", Role::Decode),
///     Err(EndpointError::RefusedAddress { .. })
/// ));
/// let allowed = Endpoint::with_address_policy(
///     "http://169.254.10.1:8000",
///     Role::Decode,
///     http::Extensions::new(),
///     AddressPolicy::allow_link_local(),
/// )?;
/// assert_eq!(allowed.host(), "169.254.10.1");
/// # Ok::<(), EndpointError>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AddressPolicy {
    allow_link_local: bool,
}

impl AddressPolicy {
    /// Link-local and metadata addresses allowed: for engines that really sit on
    /// link-local addresses, by an operator's explicit choice.
    pub const fn allow_link_local() -> Self {
        AddressPolicy {
            allow_link_local: true,
        }
    }

    /// Whether an engine may be reached at `ip`: under the default policy, any address
    /// but a link-local or cloud metadata one (see [`AddressPolicy`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_core::endpoint::AddressPolicy;
    /// let policy = AddressPolicy::default();
    /// for bad in ["169.254.169.254", "fe80::1", "fd00:ec2::254", "::ffff:169.254.169.254"] {
    ///     assert!(!policy.allows(bad.parse().unwrap()), "{bad}");
    /// }
    /// for good in ["10.0.0.5", "127.0.0.1", "::1", "fd00:ec2::253", "2001:db8::1"] {
    ///     assert!(policy.allows(good.parse().unwrap()), "{good}");
    /// }
    /// ```
    pub fn allows(&self, ip: IpAddr) -> bool {
        self.allow_link_local || !is_link_local_or_metadata(ip)
    }

    /// The IP address of `host` (a URL's host, IPv6 with or without brackets) when it is
    /// one this policy refuses; `None` for an allowed address and for a hostname.
    pub(crate) fn refused_host(&self, host: &str) -> Option<IpAddr> {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let ip = bare.parse::<IpAddr>().ok()?;
        (!self.allows(ip)).then_some(ip)
    }
}

/// Whether `ip` is link-local or a cloud metadata service's: `169.254.0.0/16` (IPv4
/// link-local, where AWS, GCP, Azure and others serve instance metadata), `fe80::/10`
/// (IPv6 link-local), `fd00:ec2::254` (AWS's IPv6 metadata service), and the IPv4 ones
/// written as IPv6: IPv4-mapped (`::ffff:169.254.169.254`), IPv4-compatible
/// (`::169.254.169.254`) and behind the NAT64 well-known prefix
/// (`64:ff9b::169.254.169.254`, RFC 6052). Public as [`AddressPolicy::allows`].
pub(crate) fn is_link_local_or_metadata(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => {
            const AWS_METADATA: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x0254);
            let s = v6.segments();
            let embedded = |hi: u16, lo: u16| Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo));
            (s[0] & 0xffc0) == 0xfe80
                || v6 == AWS_METADATA
                // ::ffff:a.b.c.d (mapped) and ::a.b.c.d (compatible; `::` and `::1` are
                // no IPv4 address in disguise and stay allowed).
                || (s[..5] == [0; 5] && (s[5] == 0xffff || s[5] == 0) && embedded(s[6], s[7]).is_link_local())
                // 64:ff9b::a.b.c.d, the NAT64 well-known prefix.
                || (s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] && embedded(s[6], s[7]).is_link_local())
        }
    }
}

// === data-parallel ranks ===

/// The request header by which an engine serving several data-parallel ranks lets a
/// request pick its rank (`X-Data-Parallel-Rank`; see [`Leg::set_rank`]). It is a fact
/// of the engine an endpoint stands for, the same for every protocol that pins a rank,
/// and the orchestrator sets it on a decode served alone. Clients never set it
/// ([`forwardable_header`](crate::proto::forwardable_header)).
///
/// [`Leg::set_rank`]: crate::connector::Leg::set_rank
pub(crate) const DATA_PARALLEL_RANK: http::HeaderName =
    http::HeaderName::from_static("x-data-parallel-rank");

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
/// Protocol data (a bootstrap port, an LMCache receiver) does not live here as fields:
/// it is in the endpoint's [`facts`](Self::facts), plain strings under well-known keys
/// that the sources fill and each connector parses, or, for an embedder's own typed
/// values, in [`ext`](Self::ext). The routing [`weight`](Self::weight)
/// is a field, as in pingora's `Backend { addr, weight, ext }`: every weighing policy
/// reads it, whatever source made the endpoint.
pub struct Endpoint {
    id: EndpointId,
    scheme: Scheme,
    authority: Authority,
    role: Role,
    rank: Option<u32>,
    models: Option<Arc<[Arc<str>]>>,
    /// The routing weight (1.0 unless set).
    weight: f64,
    in_flight: AtomicUsize,
    /// The engine's own count of its requests (waiting and running) at its latest read,
    /// in the high 32 bits, and this endpoint's in-flight count at that moment in the
    /// low 32; [`NO_ENGINE_LOAD`] until one is set (see [`load`](Self::load)).
    engine_load: AtomicU64,
    /// The whole engine, for a rank endpoint made by [`proto::dp_rank`](crate::proto::dp_rank): its requests
    /// count there too.
    engine: Option<Arc<Endpoint>>,
    /// Protocol facts, read by connectors.
    facts: Facts,
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
    /// path, its rank is not a number, or its host is an address the default
    /// [`AddressPolicy`] refuses.
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
        Self::with_address_policy(url, role, ext, AddressPolicy::default())
    }

    /// Like [`with_extensions`](Self::with_extensions), with the addresses `policy`
    /// allows instead of the default.
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new), the host checked against `policy`.
    pub fn with_address_policy(
        url: &str,
        role: Role,
        ext: http::Extensions,
        policy: AddressPolicy,
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
        if let Some(ip) = policy.refused_host(authority.host()) {
            return Err(EndpointError::RefusedAddress {
                url: url.to_owned(),
                ip,
            });
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
            weight: 1.0,
            chat_uri: api_uri(Api::Chat)?,
            completions_uri: api_uri(Api::Completions)?,
            generate_uri: api_uri(Api::Generate)?,
            scheme,
            authority,
            role,
            in_flight: AtomicUsize::new(0),
            engine_load: AtomicU64::new(NO_ENGINE_LOAD),
            engine: None,
            facts: Facts::default(),
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
            weight: base.weight,
            in_flight: AtomicUsize::new(0),
            engine_load: AtomicU64::new(base.engine_load.load(Ordering::Relaxed)),
            engine: Some(Arc::clone(base)),
            facts: base.facts.clone(),
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

    /// The same endpoint with routing weight `weight` (1.0 unless set): a weighing
    /// policy sends it a share of the requests in proportion to its weight (see
    /// `disagg_affinity::WeightedRandom`). Each endpoint weighs on its own: an engine
    /// given as N rank endpoints of weight `w` draws `N × w`.
    ///
    /// # Errors
    ///
    /// [`EndpointError::InvalidWeight`] when `weight` is not finite and positive (drain
    /// an engine by removing it, not with weight 0).
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_core::endpoint::{Endpoint, Role};
    /// let big = Endpoint::new("http://10.0.0.7:8200", Role::Decode)?.with_weight(2.0)?;
    /// assert_eq!(big.weight(), 2.0);
    /// assert_eq!(Endpoint::new("http://10.0.0.8:8200", Role::Decode)?.weight(), 1.0);
    /// # Ok::<(), disagg_core::endpoint::EndpointError>(())
    /// ```
    pub fn with_weight(mut self, weight: f64) -> Result<Self, EndpointError> {
        if !(weight.is_finite() && weight > 0.0) {
            return Err(EndpointError::InvalidWeight {
                url: self.id.to_string(),
                weight,
            });
        }
        self.weight = weight;
        Ok(self)
    }

    /// The same endpoint with `facts` (replacing any it had): the protocol facts its
    /// connector reads (see [`Facts`]).
    pub fn with_facts(mut self, facts: Facts) -> Self {
        self.facts = facts;
        self
    }

    /// The endpoint's protocol facts (see [`Facts`]); a rank endpoint has its engine's.
    pub fn facts(&self) -> &Facts {
        &self.facts
    }

    /// The routing weight: 1.0 unless set with [`with_weight`](Self::with_weight).
    pub fn weight(&self) -> f64 {
        self.weight
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

    /// Whether this endpoint serves `model`: it declares it, or declares no models. A
    /// scan of the declared names: the tests' reference for [`EndpointSet::for_model`],
    /// whose index is built without it.
    #[cfg(test)]
    pub(crate) fn serves(&self, model: &str) -> bool {
        self.models.as_deref().is_none_or(|ms| {
            ms.iter().any(|m| {
                index_cost::add(1);
                &**m == model
            })
        })
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

    /// The absolute URI of `api` on this endpoint: built once for chat, completions and
    /// `/generate`, cloned cheaply; built per request for the other APIs.
    ///
    /// # Errors
    ///
    /// None in practice: every API's path is a valid request target.
    pub(crate) fn api_uri(&self, api: Api) -> Result<Uri, http::Error> {
        Ok(match api {
            Api::Chat => self.chat_uri.clone(),
            Api::Completions => self.completions_uri.clone(),
            Api::Generate => self.generate_uri.clone(),
            other => return self.uri(other.path()),
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

    /// The load a load-aware policy weighs this endpoint by: its
    /// [`in_flight`](Self::in_flight) count, unless the engine's own count was set
    /// ([`set_engine_load`](Self::set_engine_load), from its `/metrics` when the proxy
    /// runs with `--load-source engine-metrics`); then that count (every router's
    /// requests, waiting and running) plus the change of this endpoint's in-flight count
    /// since it was read, so that a burst this router sends between two reads still
    /// spreads, and requests that ended since count no more.
    ///
    /// Cost: two relaxed atomic loads; no lock, no allocation.
    pub fn load(&self) -> usize {
        let in_flight = self.in_flight();
        let engine = self.engine_load.load(Ordering::Relaxed);
        if engine == NO_ENGINE_LOAD {
            return in_flight;
        }
        let (count, then) = ((engine >> 32) as usize, (engine & 0xffff_ffff) as usize);
        count.saturating_add(in_flight).saturating_sub(then)
    }

    /// Sets the engine's own count of its requests (waiting and running), read now:
    /// from now on [`load`](Self::load) reads it (plus this endpoint's in-flight change
    /// since now) instead of the in-flight count alone. Counts beyond `u32::MAX - 1`
    /// are taken as that. `None` forgets the count: `load` is the in-flight count again
    /// (an engine whose `/metrics` can no longer be read).
    pub fn set_engine_load(&self, requests: Option<u64>) {
        let Some(requests) = requests else {
            self.engine_load.store(NO_ENGINE_LOAD, Ordering::Relaxed);
            return;
        };
        let count = requests.min(u64::from(u32::MAX - 1));
        let then = (self.in_flight() as u64).min(u64::from(u32::MAX));
        self.engine_load
            .store((count << 32) | then, Ordering::Relaxed);
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
            .field("weight", &self.weight)
            .field("in_flight", &self.in_flight())
            .finish_non_exhaustive()
    }
}

/// [`Endpoint::engine_load`]'s value while no engine count is set: a count of
/// `u32::MAX` is never stored.
const NO_ENGINE_LOAD: u64 = u64::MAX;

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
    /// Encoder-only engines (E/P/D): the encoder stage's pool, never a P/D leg's.
    encode: Vec<Arc<Endpoint>>,
    models: Option<Arc<ModelIndex>>,
}

/// The per-model subsets of a set whose endpoints declare models.
#[derive(Debug)]
struct ModelIndex {
    /// Each declared model: the endpoints declaring it, plus those declaring none.
    by_model: HashMap<Arc<str>, EndpointSet>,
    /// The endpoints declaring no model: they serve any name the others do not.
    undeclared: EndpointSet,
    /// The models some decode endpoint declares, sorted.
    served: Arc<[Arc<str>]>,
}

impl EndpointSet {
    /// A set from endpoints of any role.
    pub fn new(endpoints: impl IntoIterator<Item = Arc<Endpoint>>) -> Self {
        let mut set = Self::by_roles(endpoints);
        set.models = ModelIndex::build(&set).map(Arc::new);
        set
    }

    fn by_roles(endpoints: impl IntoIterator<Item = Arc<Endpoint>>) -> Self {
        let mut set = EndpointSet::default();
        for ep in endpoints {
            set.push(ep);
        }
        set
    }

    /// Every endpoint of the set: prefill, then decode, then encode.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Endpoint>> + '_ {
        self.prefill.iter().chain(&self.decode).chain(&self.encode)
    }

    /// How many endpoints the set holds, of every role.
    pub(crate) fn len(&self) -> usize {
        self.prefill.len() + self.decode.len() + self.encode.len()
    }

    /// The prefill endpoints (the core's own shorthand for
    /// [`by_role`](Self::by_role)).
    pub(crate) fn prefill(&self) -> &[Arc<Endpoint>] {
        &self.prefill
    }

    /// The decode endpoints (the core's own shorthand for [`by_role`](Self::by_role)).
    pub(crate) fn decode(&self) -> &[Arc<Endpoint>] {
        &self.decode
    }

    /// The endpoints of `role`.
    pub fn by_role(&self, role: Role) -> &[Arc<Endpoint>] {
        match role {
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
            Role::Encode => &self.encode,
        }
    }

    /// The endpoints `keep` keeps (each role's order kept), as a health filter publishes
    /// them, with this set's served models: a model whose decodes are all left out is
    /// one that cannot be served now ([`RouteError::NoDecode`], 503), not an unknown one
    /// (404), and a request naming no model must still name one where this set serves
    /// several. [`EndpointSet::new`] would know only the models they declare.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use disagg_core::error::RouteError;
    /// use disagg_core::{Endpoint, endpoint::EndpointSet, Role};
    ///
    /// let set = EndpointSet::new([
    ///     Endpoint::new("http://d1:8200", Role::Decode)?.with_models(["llama"]),
    ///     Endpoint::new("http://d2:8200", Role::Decode)?.with_models(["qwen"]),
    /// ].map(Arc::new));
    /// // qwen's only decode is ejected.
    /// let up = set.retain(|e| e.id().as_str() != "http://d2:8200");
    /// assert_eq!(up.served_models().len(), 2);
    /// assert!(matches!(up.for_model(Some("qwen")), Err(RouteError::NoDecode)));
    /// assert!(matches!(up.for_model(None), Err(RouteError::ModelRequired { .. })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn retain(&self, mut keep: impl FnMut(&Arc<Endpoint>) -> bool) -> EndpointSet {
        let mut set = Self::by_roles(self.iter().filter(|e| keep(e)).cloned());
        if let Some(parent) = &self.models {
            // Left with endpoints declaring no model, which serve any name: each
            // request goes to them.
            let mut index = ModelIndex::build(&set).unwrap_or_else(|| ModelIndex {
                by_model: HashMap::new(),
                undeclared: set.clone(),
                served: Arc::from([]),
            });
            index.served = Arc::clone(&parent.served);
            set.models = Some(Arc::new(index));
        }
        set
    }

    /// The models some decode endpoint declares, sorted; empty when no endpoint
    /// declares any. For a set [retained](Self::retain) from another, the other's.
    pub fn served_models(&self) -> &[Arc<str>] {
        self.models.as_ref().map_or(&[], |m| &m.served)
    }

    /// The endpoints that serve `model`: the whole set when no endpoint declares models;
    /// otherwise those declaring `model` and those declaring none (encoders included,
    /// by the same rule: an encoder declaring other models encodes none of this one's
    /// items). A request without a
    /// model goes to the one model served, if there is just one.
    ///
    /// # Errors
    ///
    /// [`RouteError::UnknownModel`] when no decode
    /// endpoint serves `model`,
    /// [`RouteError::ModelRequired`] when the request
    /// names no model and the endpoints serve several, and [`RouteError::NoDecode`]
    /// when the model is served but none of its decode endpoints is in this set (a set
    /// [retained](Self::retain) by health).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use disagg_core::error::RouteError;
    /// use disagg_core::{Endpoint, endpoint::EndpointSet, Role};
    ///
    /// let set = EndpointSet::new([
    ///     Endpoint::new("http://p1:8100", Role::Prefill)?.with_models(["llama"]),
    ///     Endpoint::new("http://d1:8200", Role::Decode)?.with_models(["llama"]),
    ///     Endpoint::new("http://d2:8200", Role::Decode)?.with_models(["qwen"]),
    /// ].map(Arc::new));
    /// let llama = set.for_model(Some("llama"))?;
    /// assert_eq!(llama.by_role(Role::Decode)[0].id().as_str(), "http://d1:8200");
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
                [only] => index.by_model.get(only).or(Some(&index.undeclared)),
                _ => Some(&index.undeclared),
            },
        };
        match (found, model) {
            (Some(set), _) if !set.decode.is_empty() => Ok(set),
            // A model served whose decodes are all left out now (ejected): none to
            // send it to, not an unknown model; likewise the one model served.
            (_, Some(m)) if index.served.binary_search_by(|s| (**s).cmp(m)).is_ok() => {
                Err(RouteError::NoDecode)
            }
            (_, None) if index.served.len() <= 1 => Err(RouteError::NoDecode),
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
    ///
    /// Inverted in one pass over the declarations: each declared name is looked up
    /// once per endpoint declaring it (the endpoints joining that name's subset), and
    /// each endpoint declaring none joins every subset, as it serves every name. The
    /// cost is the declarations plus the subsets made, where a scan of every endpoint's
    /// names for every model cost models × endpoints × names per endpoint. Each subset
    /// keeps the set's order.
    fn build(set: &EndpointSet) -> Option<ModelIndex> {
        set.iter().find_map(|e| e.models())?;
        // The declared names, each numbered once.
        let mut number: HashMap<&str, usize> = HashMap::new();
        let mut names: Vec<&Arc<str>> = Vec::new();
        for m in set.iter().filter_map(|e| e.models()).flatten() {
            #[cfg(test)]
            index_cost::add(1);
            number.entry(&**m).or_insert_with(|| {
                names.push(m);
                names.len() - 1
            });
        }
        let mut subsets: Vec<EndpointSet> = vec![EndpointSet::default(); names.len()];
        // The last endpoint added to each subset: an endpoint naming a model twice
        // joins its subset once.
        let mut last: Vec<usize> = vec![usize::MAX; names.len()];
        let mut served = vec![false; names.len()];
        let mut undeclared = EndpointSet::default();
        for (at, e) in set.iter().enumerate() {
            let Some(models) = e.models() else {
                undeclared.push(Arc::clone(e));
                for subset in &mut subsets {
                    subset.push(Arc::clone(e));
                }
                continue;
            };
            for m in models {
                #[cfg(test)]
                index_cost::add(1);
                let Some(&k) = number.get(&**m) else {
                    continue;
                };
                if last[k] != at {
                    last[k] = at;
                    subsets[k].push(Arc::clone(e));
                    served[k] |= e.role() == Role::Decode;
                }
            }
        }
        let mut served: Vec<Arc<str>> = names
            .iter()
            .zip(&served)
            .filter(|(_, decode)| **decode)
            .map(|(m, _)| Arc::clone(m))
            .collect();
        served.sort_unstable();
        let by_model = names.into_iter().cloned().zip(subsets).collect();
        Some(ModelIndex {
            by_model,
            undeclared,
            served: served.into(),
        })
    }
}

impl EndpointSet {
    /// Adds `e` to the endpoints of its role.
    fn push(&mut self, e: Arc<Endpoint>) {
        match e.role() {
            Role::Prefill => self.prefill.push(e),
            Role::Decode => self.decode.push(e),
            Role::Encode => self.encode.push(e),
        }
    }
}

/// A count of the model-name steps (lookups and comparisons) [`ModelIndex::build`]
/// makes, per thread, for the tests of its cost: a count, never a clock.
#[cfg(test)]
pub(crate) mod index_cost {
    use std::cell::Cell;

    thread_local! {
        static STEPS: Cell<u64> = const { Cell::new(0) };
    }

    /// Counts `n` more steps.
    pub(crate) fn add(n: u64) {
        STEPS.with(|s| s.set(s.get() + n));
    }

    /// The steps counted on this thread since the last call, and a new count started.
    pub(crate) fn take() -> u64 {
        STEPS.with(|s| s.replace(0))
    }
}

#[cfg(test)]
mod tests;
