//! The data a discovery source publishes: one [`EndpointSpec`] per engine it finds.
//!
//! A spec is plain data (URL, role, models, bootstrap port, data-parallel ranks, weight,
//! KV profile, LMCache receiver, KV-events endpoint). Sources compare specs to publish
//! only real changes, and [`MergedSource`](crate::MergedSource) compares them to keep
//! the same [`Endpoint`] (the same `Arc`, with its in-flight counts and the health and
//! affinity state keyed to it) for an engine whose spec did not change.
//! [`EndpointSpec::to_endpoints`] turns a spec into the core's endpoints, one per
//! data-parallel rank, with the connector data in their extensions, exactly as the
//! `serve` command line does for `--prefill`, `--decode`, `--kv-profile`,
//! `--served-model` and `--lmcache-receiver`.

use std::fmt;
use std::str::FromStr;

use disagg_core::endpoint::EndpointError;
use disagg_core::pairing::{KvProfile, KvRole};
use disagg_core::{BootstrapPort, Endpoint, Role};

/// One engine as a discovery source describes it.
///
/// Build one with [`new`](Self::new) and set the optional parts as fields (the struct is
/// `#[non_exhaustive]` so that sources can learn more later).
///
/// # Examples
///
/// ```
/// use disagg_core::{BootstrapPort, Role};
/// use disagg_discovery::{EndpointSpec, Ranks};
///
/// let mut spec = EndpointSpec::new("http://10.0.0.5:8100", Role::Prefill);
/// spec.bootstrap_port = Some(8998);
/// spec.ranks = Some(Ranks::new(0, 1)?);
/// let endpoints = spec.to_endpoints()?;
/// assert_eq!(endpoints[1].id().as_str(), "http://10.0.0.5:8100@1");
/// assert_eq!(endpoints[1].ext().get::<BootstrapPort>(), Some(&BootstrapPort(Some(8998))));
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
    /// [`Endpoint::with_models`]).
    pub models: Vec<String>,
    /// A prefill's bootstrap port (SGLang's `--disaggregation-bootstrap-port`, vLLM
    /// Mooncake's `VLLM_MOONCAKE_BOOTSTRAP_PORT`); ignored on a decode.
    pub bootstrap_port: Option<u16>,
    /// The data-parallel ranks the engine runs behind its one HTTP server: one endpoint
    /// per rank (`URL@RANK`), as `--prefill URL@FIRST-LAST` does; `None`: one endpoint
    /// for the whole engine.
    pub ranks: Option<Ranks>,
    /// The engine's weight for weighted policies (positive); `None`: the policy's
    /// default. Kept in the endpoints' extensions as [`Weight`].
    pub weight: Option<f64>,
    /// What the engine declares about its KV transfer, checked for every pair by the
    /// core's pairing validation.
    pub kv_profile: Option<KvProfile>,
    /// Where a decode engine receives LMCache's KV pushes.
    pub lmcache: Option<LmcacheSpec>,
    /// The engine's KV-cache events publisher (`tcp://host:port`, its
    /// `--kv-events-config` endpoint); kept in the extensions as [`KvEventsEndpoint`].
    pub kv_events: Option<String>,
}

impl EndpointSpec {
    /// A spec for the engine at `url` serving `role`, with nothing else declared.
    pub fn new(url: impl Into<String>, role: Role) -> Self {
        EndpointSpec {
            url: url.into(),
            role,
            models: Vec::new(),
            bootstrap_port: None,
            ranks: None,
            weight: None,
            kv_profile: None,
            lmcache: None,
            kv_events: None,
        }
    }

    /// The ids of the endpoints this spec stands for: the URL, or `URL@RANK` per rank.
    pub fn endpoint_urls(&self) -> Vec<String> {
        let base = self.url.trim_end_matches('/');
        match self.ranks {
            None => vec![base.to_owned()],
            Some(ranks) => ranks.iter().map(|r| format!("{base}@{r}")).collect(),
        }
    }

    /// The connector data this spec puts into its endpoints' extensions: a prefill's
    /// [`BootstrapPort`] (always, `None` when not declared, as `--prefill URL` does), the
    /// [`KvProfile`], the LMCache receiver (as a `disagg_lmcache::LmcacheReceiver` with
    /// the `lmcache` feature, declaring the decode's TP size the way
    /// `LmcacheReceiver::insert_into` does; as an [`LmcacheSpec`] without it), the
    /// [`Weight`] and the [`KvEventsEndpoint`].
    ///
    /// # Errors
    ///
    /// [`SpecError`] when a part is unusable: a weight that is not a positive number, an
    /// LMCache receiver whose port lists are empty or differ in length, or (with the
    /// `lmcache` feature) one whose port count contradicts the declared TP size.
    pub fn extensions(&self) -> Result<http::Extensions, SpecError> {
        let mut ext = http::Extensions::new();
        if self.role == Role::Prefill {
            ext.insert(BootstrapPort(self.bootstrap_port));
        }
        if let Some(profile) = &self.kv_profile {
            ext.insert(profile.clone());
        }
        if let Some(w) = self.weight {
            if !(w.is_finite() && w > 0.0) {
                return Err(SpecError::Weight(w));
            }
            ext.insert(Weight(w));
        }
        if let Some(events) = &self.kv_events {
            ext.insert(KvEventsEndpoint(events.clone()));
        }
        if let Some(lmcache) = &self.lmcache {
            lmcache.check()?;
            insert_lmcache(lmcache, &mut ext)?;
        }
        Ok(ext)
    }

    /// The core's endpoints for this spec: one per rank (or one), with the models and
    /// [`extensions`](Self::extensions).
    ///
    /// # Errors
    ///
    /// [`SpecError`] when the URL is not an `http://host:port` URL, or a part is
    /// unusable (see [`extensions`](Self::extensions)).
    pub fn to_endpoints(&self) -> Result<Vec<Endpoint>, SpecError> {
        self.to_endpoints_with(self.extensions()?)
    }

    /// Like [`to_endpoints`](Self::to_endpoints), with `ext` as the extensions of every
    /// endpoint (the spec's own [`extensions`](Self::extensions), say, with more
    /// connector data added).
    ///
    /// # Errors
    ///
    /// [`SpecError::Url`] when the URL is not an `http://host:port` URL.
    pub fn to_endpoints_with(&self, ext: http::Extensions) -> Result<Vec<Endpoint>, SpecError> {
        self.endpoint_urls()
            .iter()
            .map(|url| {
                let ep = Endpoint::with_extensions(url, self.role, ext.clone())?;
                Ok(if self.models.is_empty() {
                    ep
                } else {
                    ep.with_models(self.models.iter().map(String::as_str))
                })
            })
            .collect()
    }
}

#[cfg(feature = "lmcache")]
fn insert_lmcache(spec: &LmcacheSpec, ext: &mut http::Extensions) -> Result<(), SpecError> {
    let receiver = disagg_lmcache::LmcacheReceiver::new(
        spec.host.clone(),
        spec.init_ports.clone(),
        spec.alloc_ports.clone(),
    )
    .map_err(|e| SpecError::Lmcache(e.to_string()))?;
    receiver
        .insert_into(ext)
        .map_err(|e| SpecError::Lmcache(e.to_string()))
}

#[cfg(not(feature = "lmcache"))]
fn insert_lmcache(spec: &LmcacheSpec, ext: &mut http::Extensions) -> Result<(), SpecError> {
    ext.insert(spec.clone());
    Ok(())
}

/// A spec could not become an endpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// The URL (with its rank) is not an engine URL.
    #[error(transparent)]
    Url(#[from] EndpointError),
    /// The weight is not a positive number.
    #[error("weight {0} is not a positive number")]
    Weight(f64),
    /// The LMCache receiver is unusable.
    #[error("lmcache receiver: {0}")]
    Lmcache(String),
}

/// An engine's weight for weighted policies, kept in its endpoints' extensions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weight(pub f64);

/// Where an engine publishes its KV-cache events (`tcp://host:port`, vLLM's and SGLang's
/// `--kv-events-config` `endpoint`, its `*` replaced by the engine's address), kept in
/// its endpoints' extensions for a KV-event subscriber.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsEndpoint(pub String);

/// Where a decode engine receives LMCache's KV pushes: its `pd_peer_host`, and one
/// `pd_peer_init_port` and one `pd_peer_alloc_port` per tensor-parallel rank (the
/// fields of `serve --lmcache-receiver`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LmcacheSpec {
    /// The host the prefill pushes to.
    pub host: String,
    /// One init port per TP rank.
    pub init_ports: Vec<u16>,
    /// One alloc port per TP rank.
    pub alloc_ports: Vec<u16>,
}

impl LmcacheSpec {
    /// Parses `HOST:INIT[,INIT...]:ALLOC[,ALLOC...]`, the form of `--lmcache-receiver`.
    ///
    /// # Errors
    ///
    /// [`SpecError::Lmcache`] when the text is not of that form.
    pub fn parse(s: &str) -> Result<Self, SpecError> {
        let syntax = || SpecError::Lmcache(format!("`{s}` is not HOST:INIT[,INIT]:ALLOC[,ALLOC]"));
        let mut parts = s.rsplitn(3, ':');
        let (Some(alloc), Some(init), Some(host)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(syntax());
        };
        if host.is_empty() {
            return Err(syntax());
        }
        let spec = LmcacheSpec {
            host: host.to_owned(),
            init_ports: parse_ports(init).map_err(|_| syntax())?,
            alloc_ports: parse_ports(alloc).map_err(|_| syntax())?,
        };
        spec.check()?;
        Ok(spec)
    }

    /// Checks the port lists: both non-empty and of one length (one of each per rank).
    fn check(&self) -> Result<(), SpecError> {
        if self.init_ports.is_empty() || self.alloc_ports.is_empty() {
            return Err(SpecError::Lmcache(
                "needs at least one init and one alloc port".into(),
            ));
        }
        if self.init_ports.len() != self.alloc_ports.len() {
            return Err(SpecError::Lmcache(format!(
                "{} init ports but {} alloc ports: give one of each per TP rank",
                self.init_ports.len(),
                self.alloc_ports.len()
            )));
        }
        Ok(())
    }
}

/// A comma-separated list of ports (`7300,7301`).
pub(crate) fn parse_ports(list: &str) -> Result<Vec<u16>, std::num::ParseIntError> {
    list.split(',').map(|p| p.trim().parse::<u16>()).collect()
}

/// The data-parallel ranks of one engine: `FIRST-LAST`, both included, or one rank `N`.
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
    /// [`RanksError`] when `first > last`.
    pub fn new(first: u32, last: u32) -> Result<Self, RanksError> {
        if first > last {
            return Err(RanksError(format!("{first}-{last}")));
        }
        Ok(Ranks { first, last })
    }

    /// The first rank.
    pub fn first(&self) -> u32 {
        self.first
    }

    /// The last rank (included).
    pub fn last(&self) -> u32 {
        self.last
    }

    /// Every rank, in order.
    pub fn iter(&self) -> impl Iterator<Item = u32> + use<> {
        self.first..=self.last
    }
}

impl FromStr for Ranks {
    type Err = RanksError;

    /// `FIRST-LAST` (`0-3`) or a single rank (`2`), as after the `@` of `--prefill`.
    fn from_str(s: &str) -> Result<Self, RanksError> {
        let bad = || RanksError(s.to_owned());
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

/// Data-parallel ranks that are not `FIRST-LAST` or `N`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not data-parallel ranks: write FIRST-LAST (0-3) or one rank (2)")]
pub struct RanksError(String);

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
        .map_err(|e: disagg_core::pairing::KvRoleError| ProfileError(e.to_string()))
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

    #[test]
    fn ranks_parse_as_on_the_command_line() {
        assert_eq!("0-3".parse::<Ranks>().unwrap(), Ranks::new(0, 3).unwrap());
        assert_eq!("2".parse::<Ranks>().unwrap(), Ranks::new(2, 2).unwrap());
        assert!("3-1".parse::<Ranks>().is_err());
        assert!("a-b".parse::<Ranks>().is_err());
        assert!("".parse::<Ranks>().is_err());
        assert_eq!(
            Ranks::new(1, 3).unwrap().iter().collect::<Vec<_>>(),
            [1, 2, 3]
        );
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
        // A decode carries no bootstrap port; a prefill always does (None when absent).
        assert!(eps[0].ext().get::<BootstrapPort>().is_none());
        let p = EndpointSpec::new("http://10.0.0.5:8100", Role::Prefill);
        let p = p.to_endpoints().unwrap();
        assert_eq!(
            p[0].ext().get::<BootstrapPort>(),
            Some(&BootstrapPort(None))
        );
    }

    #[test]
    fn connector_data_goes_into_the_extensions() {
        let mut spec = EndpointSpec::new("http://10.0.0.7:8200", Role::Decode);
        spec.kv_profile = Some(parse_kv_profile("NixlConnector,kv_consumer,4").unwrap());
        spec.weight = Some(2.5);
        spec.kv_events = Some("tcp://10.0.0.7:5557".into());
        let ext = spec.extensions().unwrap();
        let profile = ext.get::<KvProfile>().unwrap();
        assert_eq!(profile.connector.as_deref(), Some("NixlConnector"));
        assert_eq!(profile.role, Some(KvRole::Consumer));
        assert_eq!(profile.tp_size, Some(4));
        assert_eq!(ext.get::<Weight>(), Some(&Weight(2.5)));
        assert_eq!(
            ext.get::<KvEventsEndpoint>().map(|e| e.0.as_str()),
            Some("tcp://10.0.0.7:5557")
        );
        spec.weight = Some(0.0);
        assert!(matches!(spec.extensions(), Err(SpecError::Weight(_))));
    }

    #[test]
    fn bad_urls_and_receivers_are_refused() {
        let spec = EndpointSpec::new("ftp://10.0.0.7:8200", Role::Decode);
        assert!(matches!(spec.to_endpoints(), Err(SpecError::Url(_))));
        assert!(LmcacheSpec::parse("10.0.0.7:7300,7301:7400").is_err());
        assert!(LmcacheSpec::parse(":7300:7400").is_err());
        let ok = LmcacheSpec::parse("10.0.0.7:7300,7301:7400,7401").unwrap();
        assert_eq!(ok.init_ports, [7300, 7301]);
        assert_eq!(ok.alloc_ports, [7400, 7401]);
        let mut spec = EndpointSpec::new("http://10.0.0.7:8200", Role::Decode);
        spec.lmcache = Some(LmcacheSpec {
            host: "10.0.0.7".into(),
            init_ports: vec![1, 2],
            alloc_ports: vec![3],
        });
        assert!(matches!(spec.to_endpoints(), Err(SpecError::Lmcache(_))));
    }

    #[test]
    fn kv_profiles_parse_as_on_the_command_line() {
        let p = parse_kv_profile(",,4").unwrap();
        assert_eq!((p.connector, p.role, p.tp_size), (None, None, Some(4)));
        assert!(parse_kv_profile("a,kv_nothing,1").is_err());
        assert!(parse_kv_profile("a,kv_both,0").is_err());
        assert!(parse_kv_profile("a,kv_both,1,extra").is_err());
    }

    #[cfg(feature = "lmcache")]
    #[test]
    fn an_lmcache_receiver_declares_the_decode_tp_size() {
        let mut spec = EndpointSpec::new("http://10.0.0.7:8200", Role::Decode);
        spec.lmcache = Some(LmcacheSpec::parse("10.0.0.7:7300,7301:7400,7401").unwrap());
        let ext = spec.extensions().unwrap();
        assert!(ext.get::<disagg_lmcache::LmcacheReceiver>().is_some());
        assert_eq!(ext.get::<KvProfile>().and_then(|p| p.tp_size), Some(2));
        // A profile declaring another size contradicts the receiver.
        spec.kv_profile = Some(parse_kv_profile(",,4").unwrap());
        assert!(matches!(spec.extensions(), Err(SpecError::Lmcache(_))));
    }
}
