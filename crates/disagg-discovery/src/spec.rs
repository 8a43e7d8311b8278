//! The data a discovery source publishes: one [`EndpointSpec`] per engine it finds.
//!
//! A spec is plain data (URL, role, models, bootstrap port, data-parallel ranks, weight,
//! KV profile, LMCache receiver, KV-events endpoint). Sources compare specs to publish
//! only real changes, and [`MergedSource`](crate::MergedSource) compares them to keep
//! the same [`Endpoint`] (the same `Arc`, with its in-flight counts and the health and
//! affinity state keyed to it) for an engine whose spec did not change.
//! [`EndpointSpec::to_endpoints`] turns a spec into the core's endpoints, one per
//! data-parallel rank, with its weight and the connector data in their extensions,
//! exactly as the `serve` command line does for `--prefill`, `--decode`, `--weight`,
//! `--kv-profile`, `--served-model` and `--lmcache-receiver`.
//!
//! What a source describes comes from outside the proxy (a file anyone with write
//! access edits, a pod's annotations, DNS answers), so it is held to [`Bounds`] before
//! anything is allocated for it: ranks per engine, endpoints per source, and the
//! addresses an engine may have; and to the fixed ceilings on the models an engine
//! declares ([`MAX_MODELS_PER_ENGINE`], [`MAX_MODEL_NAME_BYTES`]), which every source
//! checks as it reads the names ([`model_names`]). What every rank's endpoint holds a
//! copy of is bounded in [`EndpointSpec::extensions`], the one place every source's
//! specs go through: a KV-events endpoint is `tcp://HOST:PORT`, a connector name at most
//! [`MAX_CONNECTOR_NAME_BYTES`]; the protocol facts are shared by the ranks, not copied.

use std::collections::HashSet;
use std::fmt;
use std::hash::Hash;
use std::net::Ipv6Addr;
use std::str::FromStr;
use std::sync::Arc;

use disagg_core::endpoint::{AddressPolicy, EndpointError, FactError, Facts};
use disagg_core::{Endpoint, Role};
use disagg_pairing::{EcProfile, KvProfile, KvRole};

use crate::identity::check_kv_events;
pub(crate) use crate::identity::{core_id, identity_or_id};

/// The most data-parallel ranks one engine may be given by default (`URL@FIRST-LAST`,
/// an endpoints file's `ranks`, the `disagg.io/dp-ranks` annotation): far above any
/// deployment's DP size, low enough that a typo cannot make millions of endpoints (each
/// with its own health state and `/metrics` lines).
pub const DEFAULT_MAX_DP_RANKS: u32 = 1024;

/// The most distinct model names one engine may declare (a pod's `disagg.io/models`
/// annotation, an endpoints file's `model`, a DNS target's models, `--served-model`).
///
/// An engine serves one base model under its `--served-model-name`s (vLLM takes a
/// list, without a limit of its own) and the LoRA adapters it lists (`--lora-modules`;
/// `--max-loras`, default 1, are loaded at once): a declaration of a few names is the
/// norm, a few dozen a large multi-LoRA engine. 256 leaves ample room for that, and
/// bounds what one declaration costs however many ranks share it: names are checked
/// before any is kept, and every routing snapshot indexes each declared name.
pub const MAX_MODELS_PER_ENGINE: usize = 256;

/// The longest model name one engine may declare, in bytes.
///
/// A served name is what clients write in `model`: a Hugging Face repository id (at
/// most 96 characters, `validate_repo_id`), an alias, or, when vLLM is given no
/// `--served-model-name`, the `--model` argument itself, which may be a local path
/// (`/models/hub/models--org--name/snapshots/<40 hex digits>` is ~130 bytes); vLLM
/// caps neither. 512 bytes is five times a repository id and room for deep paths, while
/// [`MAX_MODELS_PER_ENGINE`] names of it stay within 128 KiB per engine.
pub const MAX_MODEL_NAME_BYTES: usize = 512;

/// The longest KV or EC connector name an engine may declare, in bytes (a
/// [`KvProfile::connector`] or [`EcProfile::connector`], from an endpoints file's
/// `kv_profile` and `ec_profile` or a pod's `disagg.io/kv-connector` and
/// `disagg.io/ec-profile`).
///
/// A connector name is a class name (`LMCacheConnectorV1`, `ECMooncakeConnector`: about
/// 20 bytes) or a disagg connector's name (`vllm-mooncake`). 128 bytes is six times the
/// longest of them, and bounds what the name costs: every rank's endpoint keeps a copy
/// of its engine's profile.
pub const MAX_CONNECTOR_NAME_BYTES: usize = 128;

/// The longest engine URL a spec may have, in bytes (an endpoints file's `url`, an
/// embedder's [`EndpointSpec::url`]).
///
/// An engine URL is `http://HOST:PORT`: a DNS name has at most 253 bytes, so 2 KiB is
/// eight times any real one. Each of an engine's endpoints (one per data-parallel rank)
/// keeps its own copy of the URL, and the checks that compare endpoints write it out
/// again, so the URL is checked once, before anything is made per rank: a 4 MB URL
/// with 1,024 ranks would otherwise take gigabytes before the first endpoint refused
/// it.
pub const MAX_URL_BYTES: usize = 2048;

/// Model names past [`MAX_MODELS_PER_ENGINE`] or [`MAX_MODEL_NAME_BYTES`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ModelsError {
    /// More distinct names than one engine may declare.
    #[error("more than {max} model names, the most one engine may declare")]
    TooMany {
        /// The ceiling ([`MAX_MODELS_PER_ENGINE`]).
        max: usize,
    },
    /// A name longer than allowed.
    #[error("a model name of {len} bytes, longer than the {max} allowed")]
    TooLong {
        /// The name's length in bytes.
        len: usize,
        /// The ceiling ([`MAX_MODEL_NAME_BYTES`]).
        max: usize,
    },
}

/// Distinct model names, in the order first given, held to the ceilings as each one
/// comes: at most [`MAX_MODELS_PER_ENGINE`] kept and none longer than
/// [`MAX_MODEL_NAME_BYTES`], so that a list of any length costs at most that much
/// (duplicates are looked up, not kept).
#[derive(Debug)]
pub(crate) struct DistinctNames<S> {
    kept: Vec<S>,
    seen: HashSet<S>,
}

impl<S> Default for DistinctNames<S> {
    fn default() -> Self {
        DistinctNames {
            kept: Vec::new(),
            seen: HashSet::new(),
        }
    }
}

impl<S: AsRef<str> + Clone + Eq + Hash> DistinctNames<S> {
    /// Adds `name` unless it is there already.
    ///
    /// # Errors
    ///
    /// [`ModelsError`] for a name past [`MAX_MODEL_NAME_BYTES`], or a new name past
    /// [`MAX_MODELS_PER_ENGINE`]; nothing is added then.
    pub(crate) fn push(&mut self, name: S) -> Result<(), ModelsError> {
        let len = name.as_ref().len();
        if len > MAX_MODEL_NAME_BYTES {
            return Err(ModelsError::TooLong {
                len,
                max: MAX_MODEL_NAME_BYTES,
            });
        }
        if self.seen.contains(&name) {
            return Ok(());
        }
        if self.kept.len() >= MAX_MODELS_PER_ENGINE {
            return Err(ModelsError::TooMany {
                max: MAX_MODELS_PER_ENGINE,
            });
        }
        self.seen.insert(name.clone());
        self.kept.push(name);
        Ok(())
    }

    /// The names, in the order first given.
    pub(crate) fn into_vec(self) -> Vec<S> {
        self.kept
    }
}

/// `names` as an engine's declared models: checked against [`MAX_MODEL_NAME_BYTES`]
/// and [`MAX_MODELS_PER_ENGINE`] (distinct names counted) before any is copied,
/// duplicates collapsed to the first. Callers trim and skip empty names as their
/// syntax says; this checks only the ceilings.
///
/// # Errors
///
/// [`ModelsError`] at the first name too long, or the first distinct name past the
/// ceiling: the rest is not read.
///
/// # Examples
///
/// ```
/// use disagg_discovery::spec::{MAX_MODELS_PER_ENGINE, model_names};
///
/// assert_eq!(model_names(["llama", "qwen", "llama"])?, ["llama", "qwen"]);
/// // Any number of repeats is one name.
/// assert_eq!(model_names(std::iter::repeat_n("a", 100_000))?, ["a"]);
/// let many: Vec<String> = (0..=MAX_MODELS_PER_ENGINE).map(|i| format!("m{i}")).collect();
/// assert!(model_names(many.iter().map(String::as_str)).is_err());
/// assert!(model_names([&*"x".repeat(513)]).is_err());
/// # Ok::<(), disagg_discovery::spec::ModelsError>(())
/// ```
pub fn model_names<'a>(
    names: impl IntoIterator<Item = &'a str>,
) -> Result<Vec<String>, ModelsError> {
    let mut distinct = DistinctNames::default();
    for name in names {
        distinct.push(name)?;
    }
    Ok(distinct.into_vec().into_iter().map(str::to_owned).collect())
}

/// The data-parallel ranks of one engine: `FIRST-LAST`, both included, or one rank `N`.
///
/// Parsing checks the syntax and the order only; [`within`](Self::within) checks the
/// count against a ceiling, which every place that makes one endpoint per rank applies
/// first.
///
/// # Examples
///
/// ```
/// use disagg_discovery::{DEFAULT_MAX_DP_RANKS, Ranks};
/// let ranks: Ranks = "0-3".parse()?;
/// assert_eq!(ranks.count(), 4);
/// assert_eq!(ranks.into_iter().collect::<Vec<_>>(), [0, 1, 2, 3]);
/// let huge: Ranks = "0-4294967295".parse()?;
/// assert_eq!(huge.count(), 1 << 32);
/// assert!(huge.within(DEFAULT_MAX_DP_RANKS).is_err());
/// # Ok::<(), disagg_discovery::RanksError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ranks {
    first: u32,
    last: u32,
}

impl Ranks {
    /// Ranks `first` to `last`, both included.
    ///
    /// # Errors
    ///
    /// [`RanksError::Syntax`] when `first > last`.
    pub fn new(first: u32, last: u32) -> Result<Self, RanksError> {
        if first > last {
            return Err(RanksError::Syntax(format!("{first}-{last}")));
        }
        Ok(Ranks { first, last })
    }

    /// How many ranks (at least 1; up to 2^32, hence a `u64`).
    pub fn count(&self) -> u64 {
        u64::from(self.last - self.first) + 1
    }

    /// These ranks, if there are at most `max` of them and each is below `max`: a rank
    /// is an index into an engine's data-parallel group, so rank 60000 alone says the
    /// group is 60,001 ranks large (and whoever follows every rank of it, the KV-event
    /// subscriber for one, would open that many subscriptions).
    ///
    /// # Errors
    ///
    /// [`RanksError::TooMany`] for more than `max` ranks, [`RanksError::Beyond`] for a
    /// rank not below `max`.
    pub fn within(self, max: u32) -> Result<Self, RanksError> {
        if self.count() > u64::from(max) {
            return Err(RanksError::TooMany {
                ranks: self,
                count: self.count(),
                max,
            });
        }
        if self.last >= max {
            return Err(RanksError::Beyond {
                rank: self.last,
                max,
            });
        }
        Ok(self)
    }
}

/// Every rank, in order.
impl IntoIterator for Ranks {
    type Item = u32;
    type IntoIter = std::ops::RangeInclusive<u32>;

    fn into_iter(self) -> Self::IntoIter {
        self.first..=self.last
    }
}

impl FromStr for Ranks {
    type Err = RanksError;

    /// `FIRST-LAST` (`0-3`) or a single rank (`2`), as after the `@` of `--prefill`.
    fn from_str(s: &str) -> Result<Self, RanksError> {
        let bad = || RanksError::Syntax(s.to_owned());
        let (first, last) = match s.trim().split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (s.trim(), s.trim()),
        };
        let first = first.parse().map_err(|_| bad())?;
        let last = last.parse().map_err(|_| bad())?;
        Ranks::new(first, last).map_err(|_| bad())
    }
}

impl fmt::Display for Ranks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

/// Data-parallel ranks that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RanksError {
    /// Not `FIRST-LAST` or `N`, or `FIRST` after `LAST`.
    #[error("`{0}` is not data-parallel ranks: write FIRST-LAST (0-3) or one rank (2)")]
    Syntax(String),
    /// More ranks than the ceiling allows.
    #[error(
        "data-parallel ranks {ranks} are {count} ranks, more than the {max} allowed per engine"
    )]
    TooMany {
        /// The ranks.
        ranks: Ranks,
        /// How many they are.
        count: u64,
        /// The ceiling.
        max: u32,
    },
    /// A rank at or past the ceiling on a group's size.
    #[error("data-parallel rank {rank} is not below the {max} ranks allowed per engine")]
    Beyond {
        /// The highest rank named.
        rank: u32,
        /// The ceiling.
        max: u32,
    },
}

/// The most endpoints one discovery source may contribute by default, every rank
/// counted (`--max-endpoints-per-source`): far above any fleet one proxy routes, low
/// enough that one edit or one answer cannot make the proxy hold, check and export
/// millions of endpoints.
pub const DEFAULT_MAX_ENDPOINTS_PER_SOURCE: usize = 4096;

/// The ceilings and the address rule that discovered engines are held to.
///
/// - `max_ranks`: data-parallel ranks one engine may have ([`DEFAULT_MAX_DP_RANKS`],
///   1,024); an engine with more makes no endpoint;
/// - `max_endpoints`: endpoints one source may contribute, ranks counted
///   ([`DEFAULT_MAX_ENDPOINTS_PER_SOURCE`], 4,096); a list with more is refused whole
///   and the source's last good list stays;
/// - `addresses`: which addresses engines may have (link-local and cloud metadata
///   addresses refused by default, [`AddressPolicy`]).
///
/// Beside them, fixed as the protocol facts' ceilings are ([`Facts`]: 32 entries of at
/// most 4 KiB), every engine's declared models are held to [`MAX_MODELS_PER_ENGINE`]
/// distinct names of at most [`MAX_MODEL_NAME_BYTES`] bytes: by each source as it reads
/// them ([`model_names`]), and again when endpoints are made; its connector names to
/// [`MAX_CONNECTOR_NAME_BYTES`] and its KV-events endpoint to `tcp://HOST:PORT`
/// ([`EndpointSpec::extensions`]).
///
/// # Examples
///
/// ```
/// use disagg_core::Role;
/// use disagg_discovery::{Bounds, EndpointSpec};
///
/// let mut spec = EndpointSpec::new("http://10.0.0.5:8100", Role::Decode);
/// spec.ranks = Some("0-4294967295".parse()?);
/// // Counted, never expanded: refused before one endpoint is made.
/// assert_eq!(spec.endpoint_count(), 1 << 32);
/// assert!(spec.to_endpoints().is_err());
/// let metadata = EndpointSpec::new("http://169.254.169.254", Role::Decode);
/// assert!(metadata.to_endpoints_within(&Bounds::default()).is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Bounds {
    /// Data-parallel ranks one engine may have.
    pub max_ranks: u32,
    /// Endpoints one source may contribute, ranks counted.
    pub max_endpoints: usize,
    /// Which addresses engines may have.
    pub addresses: AddressPolicy,
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds {
            max_ranks: DEFAULT_MAX_DP_RANKS,
            max_endpoints: DEFAULT_MAX_ENDPOINTS_PER_SOURCE,
            addresses: AddressPolicy::default(),
        }
    }
}

/// How many endpoints `specs` make, ranks counted (without making them).
pub fn endpoint_count(specs: &[EndpointSpec]) -> u64 {
    specs
        .iter()
        .fold(0u64, |n, s| n.saturating_add(s.endpoint_count()))
}

/// One engine as a discovery source describes it.
///
/// Build one with [`new`](Self::new) and set the optional parts as fields (the struct is
/// `#[non_exhaustive]` so that sources can learn more later).
///
/// # Examples
///
/// ```
/// use disagg_core::Role;
/// use disagg_core::endpoint::Facts;
/// use disagg_discovery::{EndpointSpec, Ranks};
///
/// let mut spec = EndpointSpec::new("http://10.0.0.5:8100", Role::Prefill);
/// spec.facts.insert(Facts::BOOTSTRAP_PORT, "8998")?;
/// spec.ranks = Some(Ranks::new(0, 1)?);
/// let endpoints = spec.to_endpoints()?;
/// assert_eq!(endpoints[1].id().as_str(), "http://10.0.0.5:8100@1");
/// assert_eq!(endpoints[1].facts().get(Facts::BOOTSTRAP_PORT), Some("8998"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct EndpointSpec {
    /// The engine's base URL, `http://host:port`, without a `@RANK` suffix (ranks are
    /// [`ranks`](Self::ranks)).
    pub url: String,
    /// The leg the engine serves.
    pub role: Role,
    /// The model names the engine serves; empty: any (see
    /// [`Endpoint::with_models`]). At most [`MAX_MODELS_PER_ENGINE`] distinct names of
    /// at most [`MAX_MODEL_NAME_BYTES`] bytes make endpoints (the sources check as they
    /// read, [`model_names`]); duplicates count once.
    pub models: Vec<String>,
    /// The engine's protocol facts (a prefill's [`Facts::BOOTSTRAP_PORT`], a decode's
    /// [`Facts::KV_RECEIVER`]), given to each of its endpoints as
    /// [`Endpoint::facts`] for the connector to read; bounded as [`Facts`] holds every
    /// entry, since they come from outside.
    pub facts: Facts,
    /// The data-parallel ranks the engine runs behind its one HTTP server: one endpoint
    /// per rank (`URL@RANK`), as `--prefill URL@FIRST-LAST` does; `None`: one endpoint
    /// for the whole engine.
    pub ranks: Option<Ranks>,
    /// The engine's weight for weighted policies (positive); `None`: 1.0. Each of its
    /// endpoints gets it as its [`Endpoint::weight`].
    pub weight: Option<f64>,
    /// What the engine declares about its KV transfer, checked for every pair by the
    /// core's pairing validation.
    pub kv_profile: Option<KvProfile>,
    /// What the engine declares about its encoder-output transfer (E/P/D), checked for
    /// every encoder and consumer by the core's pairing validation.
    pub ec_profile: Option<EcProfile>,
    /// The engine's KV-cache events publisher (`tcp://HOST:PORT`, its
    /// `--kv-events-config` endpoint: HOST a DNS name of at most 253 bytes, an IPv4
    /// address or a bracketed IPv6 address); kept in the extensions as
    /// [`KvEventsEndpoint`]. Anything else makes no endpoint
    /// ([`extensions`](Self::extensions)).
    pub kv_events: Option<String>,
}

impl EndpointSpec {
    /// A spec for the engine at `url` serving `role`, with nothing else declared.
    pub fn new(url: impl Into<String>, role: Role) -> Self {
        EndpointSpec {
            url: url.into(),
            role,
            models: Vec::new(),
            facts: Facts::default(),
            ranks: None,
            weight: None,
            kv_profile: None,
            ec_profile: None,
            kv_events: None,
        }
    }

    /// How many endpoints this spec stands for: 1, or one per rank (up to 2^32).
    pub fn endpoint_count(&self) -> u64 {
        self.ranks.map_or(1, |r| r.count())
    }

    /// The ids of the endpoints this spec stands for, as [`Endpoint::id`] writes them:
    /// the URL, or `URL@RANK` per rank (a trailing `/` left out, a rank written in the
    /// URL reprinted: `http://h:1/@03` is `http://h:1@3`). One string per rank: check
    /// [`endpoint_count`](Self::endpoint_count) (or the ranks against
    /// [`Bounds::max_ranks`]) and the URL's length against [`MAX_URL_BYTES`] before
    /// calling it on a spec from outside.
    pub fn endpoint_urls(&self) -> Vec<String> {
        match self.ranks {
            None => vec![core_id(&self.url)],
            Some(ranks) => {
                let base = self.url.trim_end_matches('/');
                ranks.into_iter().map(|r| format!("{base}@{r}")).collect()
            }
        }
    }

    /// Checks the URL's length against [`MAX_URL_BYTES`], without reading it.
    pub(crate) fn check_url_len(&self) -> Result<(), SpecError> {
        match self.url.len() {
            len if len > MAX_URL_BYTES => Err(SpecError::UrlTooLong {
                len,
                max: MAX_URL_BYTES,
            }),
            _ => Ok(()),
        }
    }

    /// Checks the URL once, as every endpoint of the spec would have it, before anything
    /// is made per rank: at most [`MAX_URL_BYTES`], and the endpoint of its first rank
    /// (or its one endpoint) one the core makes within `bounds.addresses`. The ranks'
    /// endpoints differ only in their rank, so the others' URLs pass too.
    pub(crate) fn check_url(&self, bounds: &Bounds) -> Result<(), SpecError> {
        self.check_url_len()?;
        let first = match self.ranks {
            None => self.url.clone(),
            Some(ranks) => format!("{}@{}", self.url.trim_end_matches('/'), ranks.first),
        };
        Endpoint::with_address_policy(
            &first,
            self.role,
            http::Extensions::new(),
            bounds.addresses,
        )?;
        Ok(())
    }

    /// This spec's endpoints as the engine they belong to and their ranks, without an
    /// id written out per rank: the engine's identity (one string for all its ranks,
    /// however its URL is spelled) and each endpoint's rank (`None` for an engine
    /// without ranks). `URL@1` and `URL` with ranks `0-1` share the key of rank 1.
    pub(crate) fn endpoint_keys(&self) -> (String, impl Iterator<Item = Option<u32>>) {
        let (engine, own) = match self.ranks {
            Some(_) => (identity_or_id(self.url.trim_end_matches('/')), None),
            None => {
                let id = identity_or_id(&self.url);
                let rank = id.rsplit_once('@').and_then(|(engine, rank)| {
                    if !rank.bytes().all(|b| b.is_ascii_digit()) {
                        return None;
                    }
                    let rank = rank.parse::<u32>().ok()?;
                    Some((engine.len(), rank))
                });
                match rank {
                    Some((len, rank)) => (id[..len].to_owned(), Some(Some(rank))),
                    None => (id, Some(None)),
                }
            }
        };
        (
            engine,
            self.ranks.into_iter().flatten().map(Some).chain(own),
        )
    }

    /// The connector data this spec puts into its endpoints' extensions (its protocol
    /// facts go to [`Endpoint::facts`]): the [`KvProfile`], the [`EcProfile`] and the
    /// [`KvEventsEndpoint`]. A decode's [`Facts::KV_RECEIVER`] declares its
    /// tensor-parallel size in the profile (one init and one alloc port per rank), as
    /// `serve --lmcache-receiver` does, so that pair validation refuses a prefill of
    /// another declared size.
    ///
    /// Every source's specs go through here before an endpoint is made, and every rank's
    /// endpoint gets a copy of what it returns, so its parts are bounded here: the
    /// KV-events endpoint is `tcp://HOST:PORT` (HOST a DNS name of at most 253 bytes, an
    /// IPv4 address or a bracketed IPv6 address; PORT from 1 to 65535), and a connector
    /// name has at most [`MAX_CONNECTOR_NAME_BYTES`]. The well-known facts are held to
    /// their roles as the sources' named keys are: a [`Facts::BOOTSTRAP_PORT`] on a
    /// prefill only, a [`Facts::KV_RECEIVER`] on a decode only.
    ///
    /// # Errors
    ///
    /// [`SpecError`] when a well-known fact is malformed ([`check_facts`]) or on an
    /// engine of another role ([`SpecError::FactRole`]), an LMCache receiver's port
    /// count contradicts the declared TP size, the KV-events endpoint is not
    /// `tcp://HOST:PORT` ([`SpecError::KvEvents`]), or a connector name is too long
    /// ([`SpecError::ConnectorName`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_core::Role;
    /// use disagg_core::endpoint::Facts;
    /// use disagg_discovery::{EndpointSpec, SpecError};
    ///
    /// let mut spec = EndpointSpec::new("http://10.0.0.7:8200", Role::Decode);
    /// spec.kv_events = Some("tcp://[fd00::7]:5557".into());
    /// assert!(spec.extensions().is_ok());
    /// spec.kv_events = Some("tcp://*:5557".into());
    /// assert!(matches!(spec.extensions(), Err(SpecError::KvEvents(_))));
    /// spec.kv_events = None;
    /// spec.facts.insert(Facts::BOOTSTRAP_PORT, "8998")?;
    /// assert!(matches!(spec.extensions(), Err(SpecError::FactRole { .. })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn extensions(&self) -> Result<http::Extensions, SpecError> {
        if let Some(events) = &self.kv_events {
            check_kv_events(events)?;
        }
        let connectors = [
            (
                "kv",
                self.kv_profile
                    .as_ref()
                    .and_then(|p| p.connector.as_deref()),
            ),
            (
                "ec",
                self.ec_profile
                    .as_ref()
                    .and_then(|p| p.connector.as_deref()),
            ),
        ];
        for (kind, name) in connectors {
            if let Some(name) = name
                && name.len() > MAX_CONNECTOR_NAME_BYTES
            {
                return Err(SpecError::ConnectorName {
                    kind,
                    len: name.len(),
                    max: MAX_CONNECTOR_NAME_BYTES,
                });
            }
        }
        check_facts(&self.facts)?;
        for (key, role) in [
            (Facts::BOOTSTRAP_PORT, Role::Prefill),
            (Facts::KV_RECEIVER, Role::Decode),
        ] {
            if self.role != role && self.facts.get(key).is_some() {
                return Err(SpecError::FactRole {
                    key,
                    applies_to: role,
                    role: self.role,
                });
            }
        }
        let mut ext = http::Extensions::new();
        let mut profile = self.kv_profile.clone();
        // A decode's receiver (no other role has one now) declares its TP size.
        if let Some(receiver) = self.facts.get(Facts::KV_RECEIVER)
            && self.role == Role::Decode
        {
            let ranks = receiver_ranks(receiver)?;
            let tp = u32::try_from(ranks).unwrap_or(u32::MAX);
            let p = profile.get_or_insert_with(KvProfile::default);
            match p.tp_size {
                Some(declared) if declared != tp => {
                    return Err(SpecError::Lmcache(format!(
                        "the decode declares tensor-parallel size {declared} but its LMCache receiver has {ranks} port(s) of each kind, one per TP rank"
                    )));
                }
                _ => p.tp_size = Some(tp),
            }
        }
        if let Some(profile) = profile {
            ext.insert(profile);
        }
        if let Some(ec) = &self.ec_profile {
            ext.insert(ec.clone());
        }
        if let Some(events) = &self.kv_events {
            ext.insert(KvEventsEndpoint(events.clone()));
        }
        Ok(ext)
    }

    /// The core's endpoints for this spec: one per rank (or one), with the models, the
    /// weight and [`extensions`](Self::extensions), within the default [`Bounds`].
    ///
    /// # Errors
    ///
    /// [`SpecError`] when the URL is not an `http://host:port` URL or its address is
    /// refused, the ranks are too many, or a part is unusable (see
    /// [`extensions`](Self::extensions)).
    pub fn to_endpoints(&self) -> Result<Vec<Endpoint>, SpecError> {
        self.to_endpoints_within(&Bounds::default())
    }

    /// Like [`to_endpoints`](Self::to_endpoints), within `bounds`.
    ///
    /// # Errors
    ///
    /// As [`to_endpoints`](Self::to_endpoints).
    pub fn to_endpoints_within(&self, bounds: &Bounds) -> Result<Vec<Endpoint>, SpecError> {
        self.to_endpoints_bounded(self.extensions()?, bounds)
    }

    /// Like [`to_endpoints`](Self::to_endpoints), with `ext` as the extensions of every
    /// endpoint (the spec's own [`extensions`](Self::extensions), say, with more
    /// connector data added).
    ///
    /// # Errors
    ///
    /// As [`to_endpoints_bounded`](Self::to_endpoints_bounded), within the default
    /// [`Bounds`].
    pub fn to_endpoints_with(&self, ext: http::Extensions) -> Result<Vec<Endpoint>, SpecError> {
        self.to_endpoints_bounded(ext, &Bounds::default())
    }

    /// The endpoints with `ext` as every endpoint's extensions, within `bounds`: the
    /// ranks and the models are counted before any endpoint is made. The model names
    /// are made once and shared by every rank's endpoint (each rank holds its own list
    /// of them: `Endpoint::with_models` takes names, not a shared list), duplicates
    /// collapsed.
    ///
    /// # Errors
    ///
    /// [`SpecError::Ranks`] when the engine has more ranks than `bounds.max_ranks`,
    /// [`SpecError::UrlTooLong`] when its URL is longer than [`MAX_URL_BYTES`] (checked
    /// before anything is made per rank),
    /// [`SpecError::Models`] when it declares more models, or a longer name, than
    /// [`MAX_MODELS_PER_ENGINE`] and [`MAX_MODEL_NAME_BYTES`] allow,
    /// [`SpecError::Weight`] when its weight is not a positive number, and
    /// [`SpecError::Url`] when the URL is not an `http://host:port` URL or its address
    /// is one `bounds.addresses` refuses.
    pub fn to_endpoints_bounded(
        &self,
        ext: http::Extensions,
        bounds: &Bounds,
    ) -> Result<Vec<Endpoint>, SpecError> {
        if let Some(ranks) = self.ranks {
            ranks.within(bounds.max_ranks)?;
        }
        // The URL checked once, before it is written out per rank.
        self.check_url(bounds)?;
        // Checked whole before a name is made; then made once for all the ranks.
        let mut distinct = DistinctNames::default();
        for name in &self.models {
            distinct.push(name.as_str())?;
        }
        let models: Vec<Arc<str>> = distinct.into_vec().into_iter().map(Arc::from).collect();
        if let Some(w) = self.weight
            && !(w.is_finite() && w > 0.0)
        {
            return Err(SpecError::Weight(w));
        }
        self.endpoint_urls()
            .iter()
            .map(|url| {
                let mut ep =
                    Endpoint::with_address_policy(url, self.role, ext.clone(), bounds.addresses)?
                        .with_facts(self.facts.clone());
                // A rank written in the URL (`http://h:1@60000`) is held to the ceiling
                // as one in `ranks` is.
                if let Some(rank) = ep.rank() {
                    Ranks::new(rank, rank)?.within(bounds.max_ranks)?;
                }
                if let Some(w) = self.weight {
                    ep = ep.with_weight(w)?;
                }
                Ok(if models.is_empty() {
                    ep
                } else {
                    ep.with_models(models.iter().cloned())
                })
            })
            .collect()
    }
}

/// A spec could not become an endpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// The URL (with its rank) is not an engine URL.
    #[error(transparent)]
    Url(#[from] EndpointError),
    /// The URL is longer than [`MAX_URL_BYTES`].
    #[error("the URL is {len} bytes, longer than the {max} allowed")]
    UrlTooLong {
        /// The URL's length in bytes.
        len: usize,
        /// The ceiling ([`MAX_URL_BYTES`]).
        max: usize,
    },
    /// The weight is not a positive number.
    #[error("weight {0} is not a positive number")]
    Weight(f64),
    /// The engine has more data-parallel ranks than allowed.
    #[error(transparent)]
    Ranks(#[from] RanksError),
    /// The engine declares more models, or a longer model name, than allowed.
    #[error("models: {0}")]
    Models(#[from] ModelsError),
    /// The LMCache receiver is unusable.
    #[error("lmcache receiver: {0}")]
    Lmcache(String),
    /// A well-known fact's value is not of its form ([`check_facts`]).
    #[error("fact `{key}` is not {expected}")]
    Malformed {
        /// The key.
        key: &'static str,
        /// Its form.
        expected: &'static str,
    },
    /// A protocol fact is refused (too long, too many, a bad key).
    #[error(transparent)]
    Fact(#[from] FactError),
    /// A well-known fact on an engine of a role it does not apply to (a bootstrap port
    /// on a decode, an LMCache receiver on a prefill).
    #[error("fact `{key}` applies to {applies_to} engines only, not to {role} engines")]
    FactRole {
        /// The key.
        key: &'static str,
        /// The role it applies to.
        applies_to: Role,
        /// The engine's role.
        role: Role,
    },
    /// The KV-events endpoint is not `tcp://HOST:PORT`; the value quoted is cut to its
    /// first 64 characters.
    #[error(
        "kv_events {0} is not tcp://HOST:PORT (HOST a DNS name of at most 253 bytes, an IPv4 \
         address or a bracketed IPv6 address; PORT 1-65535)"
    )]
    KvEvents(String),
    /// A KV or EC connector name is longer than [`MAX_CONNECTOR_NAME_BYTES`].
    #[error("a {kind} connector name of {len} bytes is longer than the {max} allowed")]
    ConnectorName {
        /// `kv` or `ec`.
        kind: &'static str,
        /// The name's length in bytes.
        len: usize,
        /// The ceiling ([`MAX_CONNECTOR_NAME_BYTES`]).
        max: usize,
    },
}

/// Where an engine publishes its KV-cache events (`tcp://host:port`, vLLM's and SGLang's
/// `--kv-events-config` `endpoint`, its `*` replaced by the engine's address), kept in
/// its endpoints' extensions for a KV-event subscriber.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsEndpoint(pub String);

/// Checks the well-known facts whose form discovery knows (the core documents them
/// with [`Facts`]'s keys): a [`Facts::BOOTSTRAP_PORT`] is a port number, a
/// [`Facts::KV_RECEIVER`] is `HOST:INIT[,INIT...]:ALLOC[,ALLOC...]` with one port
/// of each kind per rank, an IPv6 HOST in brackets (`[fd00::7]:7300:7400`, the form
/// the Kubernetes source writes for an IPv6 pod: the one whose port lists cannot be
/// read as part of the address). Which role each applies to is the spec's business
/// ([`EndpointSpec::extensions`]). A spec with a malformed one makes no endpoint, so the
/// connector never meets it; other keys are kept as they are, for the connector that
/// reads them.
///
/// # Errors
///
/// [`SpecError::Fact`] or [`SpecError::Lmcache`] naming the key and the value.
///
/// # Examples
///
/// ```
/// use disagg_core::endpoint::Facts;
/// use disagg_discovery::check_facts;
///
/// assert!(check_facts(&Facts::default().with(Facts::BOOTSTRAP_PORT, "8998")?).is_ok());
/// let bad = Facts::default().with(Facts::BOOTSTRAP_PORT, "89x")?;
/// assert!(check_facts(&bad).unwrap_err().to_string().contains("bootstrap_port"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn check_facts(facts: &Facts) -> Result<(), SpecError> {
    if let Some(Err(_)) = facts.get(Facts::BOOTSTRAP_PORT).map(str::parse::<u16>) {
        return Err(SpecError::Malformed {
            key: Facts::BOOTSTRAP_PORT,
            expected: "a port number (0-65535)",
        });
    }
    if let Some(r) = facts.get(Facts::KV_RECEIVER) {
        receiver_ranks(r)?;
    }
    Ok(())
}

/// An LMCache receiver's text, `HOST:INIT[,INIT...]:ALLOC[,ALLOC...]` (the form of
/// `--lmcache-receiver`, an IPv6 HOST in brackets), checked: its rank count.
fn receiver_ranks(s: &str) -> Result<usize, SpecError> {
    let syntax = || SpecError::Lmcache(format!("`{s}` is not HOST:INIT[,INIT]:ALLOC[,ALLOC]"));
    let mut parts = s.rsplitn(3, ':');
    let (Some(alloc), Some(init), Some(host)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(syntax());
    };
    if host.is_empty() {
        return Err(syntax());
    }
    // An IPv6 host goes in brackets: unbracketed, a missing port list would be read
    // as part of the address (`fd00::1:7300` as host `fd00:`, ports 1 and 7300).
    if host.contains(':') || host.starts_with('[') {
        let v6 = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .is_some_and(|ip| ip.parse::<Ipv6Addr>().is_ok());
        if !v6 {
            return Err(SpecError::Lmcache(format!(
                "`{s}`: an IPv6 host goes in brackets, [ADDRESS]:INIT[,INIT]:ALLOC[,ALLOC]"
            )));
        }
    }
    let init = parse_ports(init).map_err(|_| syntax())?;
    let alloc = parse_ports(alloc).map_err(|_| syntax())?;
    if init.len() != alloc.len() {
        return Err(SpecError::Lmcache(format!(
            "{} init ports but {} alloc ports: give one of each per TP rank",
            init.len(),
            alloc.len()
        )));
    }
    Ok(init.len())
}

/// An LMCache receiver's fact value from its parts (a pod's IP, an IPv6 one in
/// brackets, and its annotations' port lists), checked as [`check_facts`] does.
#[cfg_attr(not(feature = "kubernetes"), allow(dead_code))]
pub(crate) fn lmcache_receiver(host: &str, init: &str, alloc: &str) -> Result<String, SpecError> {
    let list = |l: &str| l.split(',').map(str::trim).collect::<Vec<_>>().join(",");
    let text = format!("{host}:{}:{}", list(init), list(alloc));
    receiver_ranks(&text)?;
    Ok(text)
}

/// A comma-separated list of ports (`7300,7301`).
pub(crate) fn parse_ports(list: &str) -> Result<Vec<u16>, std::num::ParseIntError> {
    list.split(',').map(|p| p.trim().parse::<u16>()).collect()
}

/// Parses a KV profile as `serve --kv-profile` writes it after the `=`:
/// `CONNECTOR,ROLE,TP`, each part optional (`NixlConnector,kv_producer,8`, `,,4`).
///
/// # Errors
///
/// [`ProfileError`] when the role is not a `kv_role`, the TP size not a positive
/// number, or there are more than three parts.
pub fn parse_kv_profile(spec: &str) -> Result<KvProfile, ProfileError> {
    let mut parts = spec.split(',').map(str::trim);
    let connector = parts.next().filter(|c| !c.is_empty()).map(str::to_owned);
    let role = parts
        .next()
        .filter(|r| !r.is_empty())
        .map(parse_kv_role)
        .transpose()?;
    let tp_size = parts
        .next()
        .filter(|t| !t.is_empty())
        .map(parse_tp)
        .transpose()?;
    if parts.next().is_some() {
        return Err(ProfileError(format!(
            "`{spec}` has more than CONNECTOR,ROLE,TP"
        )));
    }
    Ok(KvProfile {
        connector,
        role,
        tp_size,
    })
}

/// A `kv_role` (`kv_producer`, `kv_consumer`, `kv_both`, or `producer`/`consumer`/`both`).
pub(crate) fn parse_kv_role(s: &str) -> Result<KvRole, ProfileError> {
    s.trim()
        .parse()
        .map_err(|e: disagg_pairing::KvRoleError| ProfileError(e.to_string()))
}

/// A tensor-parallel size: a positive number.
pub(crate) fn parse_tp(s: &str) -> Result<u32, ProfileError> {
    s.trim()
        .parse()
        .ok()
        .filter(|t| *t > 0)
        .ok_or_else(|| ProfileError(format!("TP size `{s}` is not a positive number")))
}

/// A KV profile that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("kv profile: {0}")]
pub struct ProfileError(String);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::endpoint_identity;

    #[test]
    fn ranks_parse_count_and_are_capped() {
        assert_eq!("0-3".parse::<Ranks>().unwrap(), Ranks::new(0, 3).unwrap());
        assert_eq!("2".parse::<Ranks>().unwrap().count(), 1);
        assert!("3-1".parse::<Ranks>().is_err());
        assert!("a-b".parse::<Ranks>().is_err());
        let all: Ranks = "0-4294967295".parse().unwrap();
        assert_eq!(all.count(), 1 << 32);
        match all.within(DEFAULT_MAX_DP_RANKS) {
            Err(RanksError::TooMany { count, max, .. }) => {
                assert_eq!((count, max), (1 << 32, 1024));
            }
            other => panic!("{other:?}"),
        }
        let most = Ranks::new(0, DEFAULT_MAX_DP_RANKS - 1).unwrap();
        assert_eq!(most.within(DEFAULT_MAX_DP_RANKS), Ok(most));
        assert!(
            Ranks::new(0, DEFAULT_MAX_DP_RANKS)
                .unwrap()
                .within(DEFAULT_MAX_DP_RANKS)
                .is_err()
        );
    }

    /// The rank a URL carries after `@` is held to the ceiling like `ranks`.
    #[test]
    fn a_rank_in_the_url_is_held_to_the_ceiling() {
        let spec = |url: &str| EndpointSpec::new(url, Role::Decode);
        let bounds = Bounds::default();
        let far =
            spec("http://10.0.0.5:1@60000").to_endpoints_bounded(http::Extensions::new(), &bounds);
        assert!(
            matches!(
                far,
                Err(SpecError::Ranks(RanksError::Beyond { rank: 60000, .. }))
            ),
            "{far:?}"
        );
        let near =
            spec("http://10.0.0.5:1@1023").to_endpoints_bounded(http::Extensions::new(), &bounds);
        assert_eq!(near.unwrap()[0].rank(), Some(1023));
    }

    #[test]
    fn one_rank_past_the_ceiling_is_refused_though_it_is_one() {
        let far: Ranks = "60000".parse().unwrap();
        assert_eq!(far.count(), 1);
        assert_eq!(
            far.within(DEFAULT_MAX_DP_RANKS),
            Err(RanksError::Beyond {
                rank: 60000,
                max: 1024
            })
        );
        let last = Ranks::new(1020, DEFAULT_MAX_DP_RANKS - 1).unwrap();
        assert_eq!(last.within(DEFAULT_MAX_DP_RANKS), Ok(last));
        assert!(
            Ranks::new(1021, DEFAULT_MAX_DP_RANKS)
                .unwrap()
                .within(DEFAULT_MAX_DP_RANKS)
                .is_err()
        );
        assert!(
            Ranks::new(u32::MAX, u32::MAX)
                .unwrap()
                .within(u32::MAX)
                .is_err()
        );
    }

    #[test]
    fn ranks_parse_as_on_the_command_line() {
        assert_eq!("0-3".parse::<Ranks>().unwrap(), Ranks::new(0, 3).unwrap());
        assert_eq!("2".parse::<Ranks>().unwrap(), Ranks::new(2, 2).unwrap());
        assert!("3-1".parse::<Ranks>().is_err());
        assert!("a-b".parse::<Ranks>().is_err());
        assert!("".parse::<Ranks>().is_err());
        assert_eq!(
            Ranks::new(1, 3).unwrap().into_iter().collect::<Vec<_>>(),
            [1, 2, 3]
        );
    }

    #[test]
    fn ranks_past_the_ceiling_make_no_endpoint_and_are_never_expanded() {
        let mut spec = EndpointSpec::new("http://10.0.0.5:8100", Role::Decode);
        spec.ranks = Some("0-4294967295".parse().unwrap());
        // This would allocate 2^32 endpoints (hundreds of GiB) if it expanded first.
        assert!(matches!(
            spec.to_endpoints(),
            Err(SpecError::Ranks(RanksError::TooMany { .. }))
        ));
        spec.ranks = Some(Ranks::new(0, 1023).unwrap());
        assert_eq!(spec.to_endpoints().unwrap().len(), 1024);
        spec.ranks = Some(Ranks::new(0, 1024).unwrap());
        assert!(spec.to_endpoints().is_err());
        let small = Bounds {
            max_ranks: 2,
            ..Bounds::default()
        };
        spec.ranks = Some(Ranks::new(4, 6).unwrap());
        let err = spec.to_endpoints_within(&small).unwrap_err().to_string();
        assert!(err.contains("4-6") && err.contains('2'), "{err}");
    }

    #[test]
    fn metadata_and_link_local_addresses_make_no_endpoint_unless_allowed() {
        for url in [
            "http://169.254.169.254",
            "http://[::ffff:169.254.169.254]",
            "http://[fe80::1]:8000",
            "http://[fd00:ec2::254]",
        ] {
            let spec = EndpointSpec::new(url, Role::Decode);
            assert!(
                matches!(
                    spec.to_endpoints(),
                    Err(SpecError::Url(EndpointError::RefusedAddress { .. }))
                ),
                "{url}"
            );
            let open = Bounds {
                addresses: AddressPolicy::allow_link_local(),
                ..Bounds::default()
            };
            assert_eq!(spec.to_endpoints_within(&open).unwrap().len(), 1, "{url}");
        }
    }

    #[test]
    fn a_weight_becomes_every_endpoints_weight() {
        let mut spec = EndpointSpec::new("http://10.0.0.5:8100", Role::Decode);
        spec.ranks = Some(Ranks::new(0, 1).unwrap());
        spec.weight = Some(2.5);
        let eps = spec.to_endpoints().unwrap();
        assert!(eps.iter().all(|e| e.weight() == 2.5));
        spec.weight = None;
        assert!(
            spec.to_endpoints()
                .unwrap()
                .iter()
                .all(|e| e.weight() == 1.0)
        );
        spec.weight = Some(0.0);
        assert!(matches!(spec.to_endpoints(), Err(SpecError::Weight(_))));
    }

    #[test]
    fn a_spec_with_ranks_makes_one_endpoint_per_rank() {
        let mut spec = EndpointSpec::new("http://10.0.0.5:8100/", Role::Decode);
        spec.ranks = Some(Ranks::new(2, 3).unwrap());
        spec.models = vec!["llama".into()];
        let eps = spec.to_endpoints().unwrap();
        let ids: Vec<_> = eps.iter().map(|e| e.id().as_str().to_owned()).collect();
        assert_eq!(ids, ["http://10.0.0.5:8100@2", "http://10.0.0.5:8100@3"]);
        assert!(eps.iter().all(|e| {
            e.models()
                .is_some_and(|ms| ms.len() == 1 && &*ms[0] == "llama")
        }));
        // The spec's facts go to every rank's endpoint; none declared, none kept.
        assert_eq!(eps[0].facts(), &Facts::default());
        let mut p = EndpointSpec::new("http://10.0.0.5:8100", Role::Prefill);
        p.facts.insert(Facts::BOOTSTRAP_PORT, "8998").unwrap();
        p.ranks = Some(Ranks::new(0, 1).unwrap());
        let p = p.to_endpoints().unwrap();
        assert_eq!(p.len(), 2);
        assert!(
            p.iter()
                .all(|e| e.facts().get(Facts::BOOTSTRAP_PORT) == Some("8998"))
        );
    }

    #[test]
    fn models_past_their_ceilings_make_no_endpoint() {
        let mut spec = EndpointSpec::new("http://10.0.0.5:8100", Role::Decode);
        spec.ranks = Some(Ranks::new(0, 1023).unwrap());
        spec.models = (0..=MAX_MODELS_PER_ENGINE)
            .map(|i| format!("m{i}"))
            .collect();
        let err = spec.to_endpoints().unwrap_err();
        assert!(
            matches!(
                err,
                SpecError::Models(ModelsError::TooMany {
                    max: MAX_MODELS_PER_ENGINE
                })
            ),
            "{err}"
        );
        assert!(err.to_string().contains("256"), "{err}");
        spec.models = vec!["x".repeat(MAX_MODEL_NAME_BYTES + 1)];
        let err = spec.to_endpoints().unwrap_err();
        assert!(
            matches!(
                err,
                SpecError::Models(ModelsError::TooLong { len: 513, .. })
            ),
            "{err}"
        );
        // At the ceilings, and any number of repeats (one name): endpoints.
        spec.ranks = None;
        spec.models = (0..MAX_MODELS_PER_ENGINE)
            .map(|i| format!("m{i}"))
            .collect();
        spec.models
            .extend(std::iter::repeat_n("m0".to_owned(), 10_000));
        let eps = spec.to_endpoints().unwrap();
        assert_eq!(eps[0].models().unwrap().len(), MAX_MODELS_PER_ENGINE);
        spec.models = vec!["x".repeat(MAX_MODEL_NAME_BYTES)];
        assert!(spec.to_endpoints().is_ok());
    }

    #[test]
    fn the_ranks_of_a_spec_share_its_model_names() {
        let mut spec = EndpointSpec::new("http://10.0.0.5:8100", Role::Decode);
        spec.ranks = Some(Ranks::new(0, 3).unwrap());
        spec.models = vec!["llama".into(), "qwen".into(), "llama".into()];
        let eps = spec.to_endpoints().unwrap();
        let first = eps[0].models().unwrap();
        assert_eq!(first.len(), 2, "duplicates collapse to one");
        for ep in &eps[1..] {
            let models = ep.models().unwrap();
            assert!(
                models.iter().zip(first).all(|(a, b)| Arc::ptr_eq(a, b)),
                "one allocation per name, not per rank"
            );
        }
    }

    #[test]
    fn model_names_are_checked_before_they_are_kept() {
        assert_eq!(
            model_names(["b", "a", "b", "c", "a"]).unwrap(),
            ["b", "a", "c"]
        );
        assert_eq!(
            model_names(std::iter::repeat_n("a", 200_000)).unwrap(),
            ["a"]
        );
        let names: Vec<String> = (0..MAX_MODELS_PER_ENGINE + 10)
            .map(|i| format!("m{i}"))
            .collect();
        assert_eq!(
            model_names(names.iter().map(String::as_str)),
            Err(ModelsError::TooMany { max: 256 })
        );
        assert_eq!(
            model_names(names[..MAX_MODELS_PER_ENGINE].iter().map(String::as_str))
                .unwrap()
                .len(),
            MAX_MODELS_PER_ENGINE
        );
        let long = "n".repeat(MAX_MODEL_NAME_BYTES + 1);
        assert_eq!(
            model_names(["a", &long]),
            Err(ModelsError::TooLong { len: 513, max: 512 })
        );
    }

    #[test]
    fn connector_data_goes_into_the_extensions() {
        let mut spec = EndpointSpec::new("http://10.0.0.7:8200", Role::Decode);
        spec.kv_profile = Some(parse_kv_profile("NixlConnector,kv_consumer,4").unwrap());
        spec.kv_events = Some("tcp://10.0.0.7:5557".into());
        let ext = spec.extensions().unwrap();
        let profile = ext.get::<KvProfile>().unwrap();
        assert_eq!(profile.connector.as_deref(), Some("NixlConnector"));
        assert_eq!(profile.role, Some(KvRole::Consumer));
        assert_eq!(profile.tp_size, Some(4));
        assert_eq!(
            ext.get::<KvEventsEndpoint>().map(|e| e.0.as_str()),
            Some("tcp://10.0.0.7:5557")
        );
    }

    #[test]
    fn bad_urls_and_receivers_are_refused() {
        let spec = EndpointSpec::new("ftp://10.0.0.7:8200", Role::Decode);
        assert!(matches!(spec.to_endpoints(), Err(SpecError::Url(_))));
        for bad in [
            "10.0.0.7:7300,7301:7400",
            ":7300:7400",
            "7300:7400",
            "h:x:1",
        ] {
            let mut spec = EndpointSpec::new("http://10.0.0.7:8200", Role::Decode);
            spec.facts.insert(Facts::KV_RECEIVER, bad).unwrap();
            assert!(
                matches!(spec.to_endpoints(), Err(SpecError::Lmcache(_))),
                "{bad}"
            );
        }
        assert_eq!(
            lmcache_receiver("10.0.0.7", "7300, 7301", "7400,7401").unwrap(),
            "10.0.0.7:7300,7301:7400,7401"
        );
        assert!(lmcache_receiver("10.0.0.7", "1,2", "3").is_err());
    }

    #[test]
    fn a_malformed_bootstrap_port_fact_makes_no_endpoint() {
        for bad in ["x", "70000", "-1", ""] {
            let mut spec = EndpointSpec::new("http://10.0.0.5:8100", Role::Prefill);
            spec.facts.insert(Facts::BOOTSTRAP_PORT, bad).unwrap();
            let err = spec.to_endpoints().unwrap_err();
            assert!(matches!(err, SpecError::Malformed { .. }), "{bad}: {err}");
            assert!(err.to_string().contains("`bootstrap_port`"), "{err}");
        }
    }

    /// A KV-events endpoint is copied into every rank's extensions: only
    /// `tcp://HOST:PORT` of bounded size is kept, whatever source declared it.
    #[test]
    fn kv_events_must_be_tcp_host_port() {
        let with = |events: &str| {
            let mut spec = EndpointSpec::new("http://10.0.0.7:8200", Role::Decode);
            spec.ranks = Some(Ranks::new(0, 1023).unwrap());
            spec.kv_events = Some(events.to_owned());
            spec
        };
        let long_host = format!("tcp://{}:5557", "a".repeat(5000));
        let label = "a".repeat(63);
        let name_253 = format!("{label}.{label}.{label}.{}", "b".repeat(61));
        assert_eq!(name_253.len(), 253);
        for bad in [
            long_host.as_str(),
            &format!("tcp://{name_253}x:5557"),
            &format!("tcp://{}.x:5557", "a".repeat(64)),
            "tcp://*:5557",
            "tcp://h:0",
            "tcp://h:65536",
            "tcp://h:+1",
            "tcp://h:",
            "tcp://h",
            "tcp://:5557",
            "tcp://fd00::1:5557",
            "tcp://[fd00::zz]:5557",
            "tcp://[10.0.0.1]:5557",
            "tcp://10.0.0.256:5557",
            "tcp://a..b:5557",
            "tcp://-a:5557",
            "tcp://a-:5557",
            "tcp://h/x:5557",
            "tcp://h:5557/",
            "tcp://user@h:5557",
            "udp://h:5557",
            "h:5557",
        ] {
            let err = with(bad).extensions().unwrap_err();
            assert!(matches!(err, SpecError::KvEvents(_)), "{bad}: {err}");
            let text = err.to_string();
            assert!(text.contains("kv_events"), "{text}");
            assert!(text.len() < 512, "the error quotes a bounded part: {text}");
            assert!(with(bad).to_endpoints().is_err(), "{bad}");
        }
        for good in [
            "tcp://10.0.0.7:5557",
            "tcp://[fd00::1]:5557",
            "tcp://engine-0.decode.llm.svc.cluster.local:65535",
            "tcp://localhost:1",
            "tcp://vllm_decode:5557",
            "tcp://engine-0.decode.llm.svc.cluster.local.:5557",
            &format!("tcp://{name_253}:5557"),
        ] {
            let ext = with(good).extensions().unwrap();
            assert_eq!(
                ext.get::<KvEventsEndpoint>().map(|e| e.0.as_str()),
                Some(good)
            );
        }
    }

    /// A connector name is copied into every rank's extensions: past 128 bytes it is no
    /// connector's.
    #[test]
    fn over_long_connector_names_are_refused() {
        let mut spec = EndpointSpec::new("http://10.0.0.7:8200", Role::Decode);
        spec.ranks = Some(Ranks::new(0, 1023).unwrap());
        let profile = |connector: String| KvProfile {
            connector: Some(connector),
            ..KvProfile::default()
        };
        spec.kv_profile = Some(profile("c".repeat(129)));
        let err = spec.extensions().unwrap_err();
        assert!(err.to_string().contains("128"), "{err}");
        assert!(spec.to_endpoints().is_err());
        spec.kv_profile = Some(profile("c".repeat(128)));
        assert!(spec.extensions().is_ok());
        spec.ec_profile = Some(EcProfile {
            connector: Some("c".repeat(129)),
            role: None,
        });
        let err = spec.extensions().unwrap_err();
        assert!(err.to_string().contains("128"), "{err}");
        spec.ec_profile = Some(EcProfile {
            connector: Some("c".repeat(128)),
            role: None,
        });
        assert!(spec.extensions().is_ok());
    }

    /// Every rank's endpoint holds the engine's facts: one copy, not one per rank.
    #[test]
    fn the_ranks_of_a_spec_share_one_copy_of_its_facts() {
        let mut spec = EndpointSpec::new("http://10.0.0.5:8100", Role::Decode);
        spec.ranks = Some(Ranks::new(0, 1023).unwrap());
        spec.facts.insert("note", "n".repeat(4096)).unwrap();
        let eps = spec.to_endpoints().unwrap();
        let first = eps[0].facts().get("note").map(str::as_ptr);
        assert!(first.is_some());
        assert!(
            eps.iter()
                .all(|e| e.facts().get("note").map(str::as_ptr) == first)
        );
    }

    /// The named keys' role rules hold for the same keys given as generic facts.
    #[test]
    fn facts_of_another_role_make_no_endpoint() {
        let mut p = EndpointSpec::new("http://10.0.0.5:8100", Role::Prefill);
        p.facts.insert(Facts::KV_RECEIVER, "h:1,2:3,4").unwrap();
        let err = p.extensions().unwrap_err();
        assert!(err.to_string().contains("kv_receiver"), "{err}");
        assert!(p.to_endpoints().is_err());
        let mut d = EndpointSpec::new("http://10.0.0.7:8200", Role::Decode);
        d.facts.insert(Facts::BOOTSTRAP_PORT, "8998").unwrap();
        let err = d.extensions().unwrap_err();
        assert!(err.to_string().contains("bootstrap_port"), "{err}");
        let mut e = EndpointSpec::new("http://10.0.0.9:8300", Role::Encode);
        e.facts.insert(Facts::BOOTSTRAP_PORT, "8998").unwrap();
        assert!(e.extensions().is_err());
        let mut e = EndpointSpec::new("http://10.0.0.9:8300", Role::Encode);
        e.facts.insert(Facts::KV_RECEIVER, "h:1:2").unwrap();
        assert!(e.extensions().is_err());
        // On their own roles: kept.
        let mut p = EndpointSpec::new("http://10.0.0.5:8100", Role::Prefill);
        p.facts.insert(Facts::BOOTSTRAP_PORT, "8998").unwrap();
        assert!(p.extensions().is_ok());
    }

    /// An IPv6 receiver host is written in brackets, the one form whose two port lists
    /// cannot be mistaken for part of the address.
    #[test]
    fn an_ipv6_receiver_host_is_bracketed() {
        let spec = |receiver: &str| {
            let mut d = EndpointSpec::new("http://10.0.0.7:8200", Role::Decode);
            d.facts.insert(Facts::KV_RECEIVER, receiver).unwrap();
            d
        };
        assert!(spec("[fd00::1]:7300,7301:7400,7401").extensions().is_ok());
        for bad in [
            "fd00::1:7300:7400",
            "fd00::1:7300",
            "[fd00::zz]:7300:7400",
            "[10.0.0.7]:7300:7400",
            "[fd00::1:7300:7400",
        ] {
            assert!(
                matches!(spec(bad).extensions(), Err(SpecError::Lmcache(_))),
                "{bad}"
            );
        }
        assert_eq!(
            lmcache_receiver("[fd00::1]", "7300", "7400").unwrap(),
            "[fd00::1]:7300:7400"
        );
    }

    #[test]
    fn endpoint_urls_are_the_ids_the_core_makes() {
        for url in [
            "http://d1:1@03",
            "http://d1:1/@3",
            "http://d1:1/",
            "http://d1:1",
            "HTTP://D1:01",
        ] {
            let spec = EndpointSpec::new(url, Role::Decode);
            let ids: Vec<String> = spec
                .to_endpoints()
                .unwrap()
                .iter()
                .map(|e| e.id().as_str().to_owned())
                .collect();
            assert_eq!(spec.endpoint_urls(), ids, "{url}");
        }
    }

    #[test]
    fn one_engine_written_two_ways_has_one_identity() {
        for (a, b) in [
            ("http://d:8200", "http://d:08200"),
            ("http://D:8200", "http://d:8200/"),
            ("HTTP://d:8200", "http://d:8200"),
            ("http://[FD00::1]:8200", "http://[fd00:0::1]:8200"),
            ("http://d:8200@3", "http://d:8200/@03"),
            ("http://d", "http://d:80"),
            ("https://d", "https://d:443"),
        ] {
            assert_eq!(endpoint_identity(a), endpoint_identity(b), "{a} {b}");
        }
        for (a, b) in [
            ("http://d:8200", "http://d:8201"),
            ("http://d:8200", "https://d:8200"),
            ("http://d:8200", "http://d:8200@0"),
            ("http://d:8200@1", "http://d:8200@2"),
        ] {
            assert_ne!(endpoint_identity(a), endpoint_identity(b), "{a} {b}");
        }
    }

    #[test]
    fn kv_profiles_parse_as_on_the_command_line() {
        let p = parse_kv_profile(",,4").unwrap();
        assert_eq!((p.connector, p.role, p.tp_size), (None, None, Some(4)));
        assert!(parse_kv_profile("a,kv_nothing,1").is_err());
        assert!(parse_kv_profile("a,kv_both,0").is_err());
        assert!(parse_kv_profile("a,kv_both,1,extra").is_err());
    }

    #[test]
    fn an_lmcache_receiver_declares_the_decode_tp_size() {
        let mut spec = EndpointSpec::new("http://10.0.0.7:8200", Role::Decode);
        let receiver = "10.0.0.7:7300,7301:7400,7401";
        spec.facts.insert(Facts::KV_RECEIVER, receiver).unwrap();
        let eps = spec.to_endpoints().unwrap();
        assert_eq!(eps[0].facts().get(Facts::KV_RECEIVER), Some(receiver));
        let ext = spec.extensions().unwrap();
        assert_eq!(ext.get::<KvProfile>().and_then(|p| p.tp_size), Some(2));
        // A profile declaring another size contradicts the receiver.
        spec.kv_profile = Some(parse_kv_profile(",,4").unwrap());
        assert!(matches!(spec.extensions(), Err(SpecError::Lmcache(_))));
    }
}
