//! Engines from DNS (`--prefill-dns`, `--decode-dns`), with `hickory-resolver`.
//!
//! Two kinds of names:
//!
//! - `NAME:PORT`: every A and AAAA address of `NAME` is an engine at `PORT`; a
//!   Kubernetes headless Service (`prefill.llm.svc.cluster.local:8100`) is the common
//!   case;
//! - `_service._proto.name` (an SRV name, without a port: its records give the ports):
//!   every SRV record of the lowest priority value (higher values are fallbacks, RFC
//!   2782) names a target host and port; each address of each target is an engine at
//!   that port, weighing the record's weight ([`srv_weight`]: a weight of 0 weighs 0.01,
//!   RFC 2782's "very small chance" next to records of positive weight). A target and
//!   port named by several records is resolved once (the first record's weight), and at
//!   most [`MAX_SRV_TARGETS`] distinct targets are resolved per name and refresh: the
//!   rest are left out, logged. The targets are looked up [`SRV_LOOKUPS_IN_FLIGHT`] at
//!   a time, their answers taken in the records' order.
//!
//! Every answer becomes an endpoint only within the merged source's bounds: an address
//! that is link-local or a cloud metadata service's makes no endpoint
//! ([`Bounds`](crate::Bounds)), and a name answering more engines than the ceiling per
//! source is refused whole, its last good engines kept.
//!
//! Each name is resolved again when its records' time to live runs out (the smallest
//! TTL among the answers, the SRV records' and their targets'), bounded by
//! [`DnsConfig::max_refresh`] (`--dns-refresh`) above and [`DnsConfig::min_refresh`]
//! below (a TTL of 0 would otherwise mean a query loop). The names due are looked up
//! together, each on its own: a name whose lookup waits out [`DnsConfig::timeout`]
//! holds back no other name's refresh, and each name's outcome is published as it
//! comes (every name's engines merged: an engine two names give is kept as the name
//! given first has it).
//!
//! The source publishes its first list once every name has had an answer (records, or
//! an answer without records): until then it publishes nothing (`None`, not an empty
//! list), as a name whose lookups fail would otherwise count as one without engines.
//! Then, what a lookup's outcome does:
//!
//! - an answer with records replaces the name's engines;
//! - an answer without records (NXDOMAIN, or the name without addresses) is an answer:
//!   the name has no engines now (a headless Service scaled to zero, a record removed);
//!   it is asked again after the answer's negative TTL (bounded likewise);
//! - a failed lookup (timeout, SERVFAIL, refused, an unreachable server) keeps the
//!   name's last good engines, is logged and counted
//!   ([`SourceStats::errors`](crate::SourceStats::errors)), and is retried with a
//!   backoff from `min_refresh` doubling up to `max_refresh`; the engines are kept at
//!   most [`DnsConfig::max_stale`] (1 h) after the name's last good answer, then dropped
//!   (logged and counted once), a lookup under way or not, until the name answers.
//!
//! A name's A and AAAA records (and each SRV target's) are asked each on its own.
//! "No addresses" is the answer only when both families answered so; a family that
//! fails beside one without records fails the lookup; a family that fails beside one
//! with records keeps its own last good addresses (of that name, or that SRV target and
//! port) beside the other's new ones, each at most `max_stale` after its family last
//! answered with it (then dropped at that time, not at the next lookup, whether the
//! name answers meanwhile, fails, or answers past the ceiling: logged and counted
//! once), is counted each time, logged as it starts (a warning) and ends, and the name
//! is asked again with a failed lookup's backoff (within the answer's TTL), from
//! `min_refresh` again once the family answers. The addresses kept for this are each
//! origin's distinct ones, at most the ceiling per source in all for a name: an origin
//! past it is not remembered (a family of it that fails keeps none), its answer still
//! taken. An address both families give (an
//! IPv4-mapped IPv6 address, `::ffff:a.b.c.d`, is the IPv4 address it maps) is one
//! engine: a name's engines are one per address and port.
//!
//! The resolver is the system's (`/etc/resolv.conf` and `/etc/hosts`) unless
//! [`DnsConfig::server`] (`--dns-server IP:PORT`) names one; then only that server is
//! asked, over UDP with TCP for truncated answers, without search domains or
//! `/etc/hosts`. A name `/etc/hosts` lists (in either family) is answered from it
//! alone. A name that is not fully qualified (no final `.`) is completed as the
//! system's resolver completes it, from resolv.conf's search list and `ndots` (a
//! Kubernetes pod's `ndots:5` tries `prefill.llm.svc:8100` under each search domain
//! before the name as written): the names are asked in turn, and the first name with
//! records answers. A name answering "no such name" passes on to the next; so does a
//! SERVFAIL, as with glibc's resolver (a search domain whose upstream server fails
//! hides no name under the next), but it is remembered: without a name with records
//! after it, the lookup failed (the name that failed may be the one that has the
//! records); with one, that name's answer is taken and the SERVFAIL counted as an error
//! (a warning logged as the name passed over changes). Any other failure (a timeout, a
//! refusal, a family timing out beside the other's SERVFAIL) ends the walk as a failed
//! lookup: stricter than glibc's `res_search`, which goes on to the search list past
//! such a failure of the name as written asked first, and past one in the search list
//! still asks the name as written if it has not yet; here no answer is taken past a
//! name whose answer is unknown. The search list is resolv.conf's last `search` or
//! `domain` line (each replaces the other, as with glibc), and the system's domain only
//! when it has neither. The fully qualified name that answered is then pinned: later
//! refreshes ask it alone; not a name found past a SERVFAIL (the name that failed comes
//! first and may be the one meant: each refresh walks the list again, until a name
//! answers with none failing before it). Answers are not cached between refreshes: each
//! refresh asks the server.

use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use disagg_core::Role;
use futures::stream::FuturesUnordered;
use futures::{Stream, StreamExt};
use hickory_resolver::config::{NameServerConfig, ResolveHosts, ResolverConfig, ResolverOpts};
use hickory_resolver::net::NetError;
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::{Name, RData};
use hickory_resolver::{Hosts, Resolver, TokioResolver};
use tokio::time::Instant;

use crate::source::{SpecPublisher, SpecSource};
use crate::spec::{EndpointSpec, ModelsError, model_names};

mod addresses;
mod engines;
mod outcome;
mod search;
mod stale;
use engines::Engines;
use outcome::{Failure, FamilyFailure, Kept, Origins, Resolved};
use search::{first_answer, search_list};

/// The default source name of DNS discovery (the `source` label of its metrics).
pub const SOURCE_NAME: &str = "dns";

/// The most distinct SRV targets (host and port) resolved for one name in one refresh.
///
/// Each target is one more lookup (two, A and AAAA) in the refresh, and an SRV answer of
/// a few kilobytes can name thousands of them. 256 is far above the engines one
/// service's SRV records name (a record per engine pod or host), and bounds a refresh
/// of a name to 256 target lookups; the targets past it (in the answer's order) are
/// left out, logged. Records naming a target and port already named count once.
pub const MAX_SRV_TARGETS: usize = 256;

/// The most SRV target lookups (each an A and an AAAA query) under way at once for one
/// name.
///
/// One after another, a name's [`MAX_SRV_TARGETS`] targets would take as many round
/// trips to the server; 16 at a time take a sixteenth of them and ask at most 32
/// queries of the server at once. The answers are taken in the records' order,
/// whichever comes first: a target's weight, the engines two targets share and the
/// failure that fails the name are those of the earlier record, as one after another;
/// a lookup under way when the name fails is dropped, its answer unused.
pub const SRV_LOOKUPS_IN_FLIGHT: usize = 16;

/// A DNS name to find engines under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DnsName {
    /// `NAME:PORT`: each A/AAAA address of the name, at the port.
    Host {
        /// The name.
        name: String,
        /// The engines' HTTP port.
        port: u16,
    },
    /// `_service._proto.name`: the SRV records' targets and ports.
    Srv(String),
}

impl FromStr for DnsName {
    type Err = DnsNameError;

    /// `_service._proto.name` (a name starting with `_`) is an SRV name, without a
    /// port (its records give the ports); anything else must be `NAME:PORT`.
    fn from_str(s: &str) -> Result<Self, DnsNameError> {
        let s = s.trim();
        let neither = || DnsNameError {
            name: s.to_owned(),
            reason: NameError::Neither,
        };
        if s.starts_with('_') {
            if s.contains(':') {
                return Err(DnsNameError {
                    name: s.to_owned(),
                    reason: NameError::SrvPort,
                });
            }
            let labels: Vec<&str> = s.trim_end_matches('.').split('.').collect();
            if labels.len() < 3
                || !labels[1].starts_with('_')
                || labels.iter().any(|l| l.is_empty())
            {
                return Err(neither());
            }
            return Ok(DnsName::Srv(s.to_owned()));
        }
        let (name, port) = s.rsplit_once(':').ok_or_else(neither)?;
        let port = port.parse().map_err(|_| neither())?;
        if name.is_empty() || name.contains(':') {
            return Err(neither());
        }
        Ok(DnsName::Host {
            name: name.to_owned(),
            port,
        })
    }
}

impl std::fmt::Display for DnsName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DnsName::Host { name, port } => write!(f, "{name}:{port}"),
            DnsName::Srv(name) => f.write_str(name),
        }
    }
}

/// A DNS name that is neither `NAME:PORT` nor `_service._proto.name` (an SRV name
/// written with a port included).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{name}` {reason}")]
pub struct DnsNameError {
    name: String,
    reason: NameError,
}

/// Why a [`DnsNameError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
enum NameError {
    #[error("is neither NAME:PORT nor an SRV name _service._proto.name")]
    Neither,
    #[error("is an SRV name with a port: an SRV name takes none (its records give the ports)")]
    SrvPort,
}

/// One name and the role (and fixed attributes) of the engines found under it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DnsTarget {
    /// The name.
    pub name: DnsName,
    /// The role of every engine found under it.
    pub role: Role,
    /// The prefill engines' bootstrap port (one for all: DNS carries none).
    pub bootstrap_port: Option<u16>,
    /// The models every engine found under it serves (empty: any): at most
    /// [`MAX_MODELS_PER_ENGINE`](crate::spec::MAX_MODELS_PER_ENGINE) distinct names of at
    /// most [`MAX_MODEL_NAME_BYTES`](crate::spec::MAX_MODEL_NAME_BYTES), or [`spawn`]
    /// refuses the configuration ([`DnsError::Models`]); duplicates count once.
    pub models: Vec<String>,
}

impl DnsTarget {
    /// Engines of `role` under `name`.
    pub fn new(name: DnsName, role: Role) -> Self {
        DnsTarget {
            name,
            role,
            bootstrap_port: None,
            models: Vec::new(),
        }
    }
}

/// DNS discovery settings (`--prefill-dns`, `--decode-dns`, `--dns-refresh`,
/// `--dns-server`).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DnsConfig {
    /// The names to resolve.
    pub targets: Vec<DnsTarget>,
    /// The DNS server to ask instead of the system's resolver configuration.
    pub server: Option<SocketAddr>,
    /// The longest time between two resolutions of a name, whatever its TTL
    /// (`--dns-refresh`): 30 s by default.
    pub max_refresh: Duration,
    /// The shortest time between two resolutions of a name (a TTL of 0 waits this
    /// long): 1 s by default.
    pub min_refresh: Duration,
    /// How long one query may take before it is a failure: 5 s by default.
    pub timeout: Duration,
    /// The source's name in metrics and logs ([`SOURCE_NAME`] by default).
    pub name: String,
    /// The most engines one name may give (`--max-endpoints-per-source`, 4,096 by
    /// default): an SRV answer's targets each resolve to many addresses, so a few
    /// kilobytes of answers can name millions of engines. A name past it fails its
    /// lookup, as a server error does (its last good engines are kept), before the rest
    /// of its targets are resolved (the lookups already under way, at most
    /// [`SRV_LOOKUPS_IN_FLIGHT`], are dropped).
    pub max_endpoints: usize,
    /// How long the first list waits for every name's first answer: 30 s by default.
    /// Until every name has answered (with records or without), the source publishes
    /// nothing, as a name whose lookups fail is not one without engines; past this wait
    /// it publishes the names that answered, and a name that answers later joins them.
    /// One name that never answers thus holds the others back this long, not forever.
    pub first_list_wait: Duration,
    /// How long a name whose lookups fail keeps its last good engines, counted from its
    /// last good answer (and an address family failing beside one that answers, its
    /// last good addresses, from the family's last answer with each, even while the name
    /// answers past the endpoint ceiling): 1 h by default,
    /// the default of CoreDNS's `serve_stale` (how long its cache answers with expired
    /// records while the upstream fails). Past it the engines are dropped, logged and
    /// counted once ([`SourceStats::expired`](crate::SourceStats::expired)): a server
    /// down for hours leaves no routing to addresses long gone. Zero drops them at the
    /// first failed lookup; [`Duration::MAX`] keeps them while the lookups fail,
    /// however long.
    pub max_stale: Duration,
}

impl DnsConfig {
    /// Resolves `targets` with the system's resolver, refreshing at most every 30 s.
    pub fn new(targets: impl IntoIterator<Item = DnsTarget>) -> Self {
        DnsConfig {
            targets: targets.into_iter().collect(),
            server: None,
            max_refresh: Duration::from_secs(30),
            min_refresh: Duration::from_secs(1),
            timeout: Duration::from_secs(5),
            name: SOURCE_NAME.to_owned(),
            max_endpoints: crate::DEFAULT_MAX_ENDPOINTS_PER_SOURCE,
            first_list_wait: Duration::from_secs(30),
            max_stale: Duration::from_secs(3600),
        }
    }
}

/// DNS discovery could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DnsError {
    /// The system's resolver configuration could not be read.
    #[error("cannot read the system's DNS configuration")]
    SystemConfig(#[source] NetError),
    /// The resolver could not be built.
    #[error("cannot build the DNS resolver")]
    Resolver(#[source] NetError),
    /// No names to resolve.
    #[error("no DNS names to resolve")]
    NoTargets,
    /// The refresh bounds are inverted or zero.
    #[error("the DNS refresh bounds must satisfy 0 < min_refresh <= max_refresh")]
    Refresh,
    /// A name's models are more, or longer, than an engine may declare.
    #[error("DNS name {name}: models: {source}")]
    Models {
        /// The name.
        name: String,
        /// What is past which ceiling.
        #[source]
        source: ModelsError,
    },
}

/// Resolves every name once, publishes the engines found, and starts the task that
/// resolves them again as their TTLs run out.
///
/// # Errors
///
/// [`DnsError`] when the resolver cannot be set up or a target declares models past
/// their ceilings (no failed lookup is an error: it is retried).
///
/// # Panics
///
/// When called outside a tokio runtime.
pub async fn spawn(config: DnsConfig) -> Result<SpecSource, DnsError> {
    let config = checked(config)?;
    let dns = resolver(&config)?;
    let (publisher, source) = SpecSource::channel(config.name.as_str());
    let mut refresher = Refresher::new(dns, config, publisher);
    // Every name's first lookup done, each having answered or failed (a name answering
    // sooner may be looked up again meanwhile, as its TTL runs out).
    while !refresher.names.iter().all(NameState::tried) {
        refresher.step().await;
    }
    let task = tokio::spawn(refresher.run());
    Ok(source.with_task(task))
}

/// `config` checked: targets given, refresh bounds in order, and each target's models
/// within their ceilings (duplicates collapsed), before one engine is made with them.
fn checked(mut config: DnsConfig) -> Result<DnsConfig, DnsError> {
    if config.targets.is_empty() {
        return Err(DnsError::NoTargets);
    }
    if config.min_refresh.is_zero() || config.min_refresh > config.max_refresh {
        return Err(DnsError::Refresh);
    }
    for target in &mut config.targets {
        target.models =
            model_names(target.models.iter().map(String::as_str)).map_err(|source| {
                DnsError::Models {
                    name: target.name.to_string(),
                    source,
                }
            })?;
    }
    Ok(config)
}

/// The resolver, and what completes a name that is not fully qualified.
///
/// Every query the resolver is given is for a fully qualified name, which it asks as
/// it is: the search list is walked here ([`first_answer`]), so that a failure on one
/// of its names is not hidden behind the "no such name" of the next (the resolver
/// walks it answering with the last name's outcome alone), and `/etc/hosts` is read
/// here, for both families at once.
#[derive(Clone)]
struct Dns {
    resolver: TokioResolver,
    /// The search list ([`search_list`]: resolv.conf's last `search` or `domain` line,
    /// else the system's domain); none with `--dns-server`.
    search: Arc<[Name]>,
    /// resolv.conf's `ndots`: a name with at least this many dots is asked as it is
    /// before the search list, one with fewer after it.
    ndots: usize,
    /// `/etc/hosts` (empty with `--dns-server`): a name it knows is answered from it
    /// alone.
    hosts: Arc<Hosts>,
}

fn resolver(config: &DnsConfig) -> Result<Dns, DnsError> {
    let (resolver_config, mut opts) = match config.server {
        Some(addr) => {
            let mut server = NameServerConfig::udp_and_tcp(addr.ip());
            for connection in &mut server.connections {
                connection.port = addr.port();
            }
            let mut opts = ResolverOpts::default();
            // The server named is the one asked, not /etc/hosts.
            opts.use_hosts_file = ResolveHosts::Never;
            (ResolverConfig::from_name_servers(vec![server]), opts)
        }
        None => system_config()?,
    };
    let search = search_list(&resolver_config);
    let hosts = match opts.use_hosts_file {
        ResolveHosts::Always | ResolveHosts::Auto => Hosts::from_system().unwrap_or_default(),
        ResolveHosts::Never => Hosts::default(),
    };
    let ndots = opts.ndots;
    opts.use_hosts_file = ResolveHosts::Never;
    opts.timeout = config.timeout;
    opts.attempts = 1;
    let resolver = Resolver::builder_with_config(resolver_config, TokioRuntimeProvider::default())
        .with_options(opts)
        .build()
        .map_err(DnsError::Resolver)?;
    Ok(Dns {
        resolver,
        search: search.into(),
        ndots,
        hosts: Arc::new(hosts),
    })
}

/// The system's resolver configuration (`/etc/resolv.conf` on Unix).
fn system_config() -> Result<(ResolverConfig, ResolverOpts), DnsError> {
    // A `NetError` on Unix, a `ProtoError` on other systems.
    #[allow(
        clippy::useless_conversion,
        reason = "not the same type on every system"
    )]
    let read = hickory_resolver::system_conf::read_system_conf()
        .map_err(|e| DnsError::SystemConfig(e.into()));
    read
}

/// One name's state between refreshes.
struct NameState {
    target: DnsTarget,
    /// The name's last good engines (`None` before any answer).
    last: Option<Vec<EndpointSpec>>,
    /// When it last answered, with records or without (`None` before any answer).
    answered_at: Option<Instant>,
    /// Its last lookup failed (not an answer past the endpoint ceiling, which is an
    /// answer): its last good engines are kept for `max_stale` from `answered_at`.
    lookups_failing: bool,
    /// The fully qualified name that first answered with records (the target's name
    /// itself, or under a search domain): the only one asked from then on, so that
    /// the search list is walked once, not at each refresh, and a failure of the name
    /// that answers cannot pass for another's "no such name". A name found past a
    /// SERVFAIL on an earlier one is not pinned: the list is walked again.
    pinned: Option<Name>,
    /// The addresses each origin gave in the last good answer (the name's own, or each
    /// SRV target's): a family that fails beside one that answers keeps its own.
    origins: Arc<Origins>,
    /// The engines among `last` only as a failed family's last good addresses, each
    /// dropped `max_stale` after its family last answered with it.
    kept: Kept,
    /// When to resolve it next.
    due: Instant,
    /// Failed lookups in a row.
    failures: u32,
    /// Answers in a row with a family failing beside one that answered: the name is
    /// asked again as after as many failed lookups (within the answer's TTL).
    half_failures: u32,
    /// The family that failed beside one that answered in the last answer (the name
    /// asked, and whether it is IPv6), and the name last passed over for its SERVFAIL:
    /// each is warned about as it starts or changes, counted each time.
    family_failed: Option<(Name, bool)>,
    passed_over: Option<Name>,
    /// Whether its lookup is under way.
    looking_up: bool,
}

impl NameState {
    /// Whether a lookup of the name has been done: it answered, or failed.
    fn tried(&self) -> bool {
        self.last.is_some() || self.failures > 0
    }
}

/// One name's lookup under way: the name's index, and the lookup's outcome.
type Lookup = Pin<Box<dyn Future<Output = (usize, Result<Resolved, Failure>)> + Send>>;

/// The names, their lookups under way, and where their engines go.
///
/// Each name is looked up on its own as it comes due, all the names due at once (they
/// are the operator's configured names, a few): a lookup waiting out the timeout holds
/// no other name's refresh back, and each outcome is published as it comes.
struct Refresher {
    dns: Dns,
    config: DnsConfig,
    publisher: SpecPublisher,
    names: Vec<NameState>,
    first_list_by: Option<Instant>,
    lookups: FuturesUnordered<Lookup>,
}

impl Refresher {
    fn new(dns: Dns, config: DnsConfig, publisher: SpecPublisher) -> Refresher {
        let names: Vec<NameState> = config
            .targets
            .iter()
            .cloned()
            .map(|target| NameState {
                target,
                last: None,
                answered_at: None,
                lookups_failing: false,
                pinned: None,
                origins: Arc::default(),
                kept: Kept::new(),
                due: Instant::now(),
                failures: 0,
                half_failures: 0,
                family_failed: None,
                passed_over: None,
                looking_up: false,
            })
            .collect();
        // A wait past any clock's reach is no wait's end (Duration::MAX would overflow).
        let first_list_by = Instant::now().checked_add(config.first_list_wait);
        Refresher {
            dns,
            config,
            publisher,
            names,
            first_list_by,
            lookups: FuturesUnordered::new(),
        }
    }

    async fn run(mut self) {
        while !self.publisher.is_closed() {
            self.step().await;
        }
    }

    /// Starts the lookups of the names due, then waits for one outcome (taken and
    /// published), for the next name to come due, or for the first list's deadline.
    async fn step(&mut self) {
        self.start_due();
        // The names not under way; before the first list, its deadline is a wake-up too.
        let mut next = self
            .names
            .iter()
            .filter(|n| !n.looking_up)
            .map(|n| n.due)
            .min();
        if !self.publisher.has_published()
            && let Some(by) = self.first_list_by
        {
            next = Some(next.map_or(by, |n| n.min(by)));
        }
        // A name's engines are dropped at their limit, even while a lookup is under way.
        if let Some(at) = self.next_stale() {
            next = Some(next.map_or(at, |n| n.min(at)));
        }
        let wake = async {
            match next {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            Some((i, outcome)) = self.lookups.next() => self.settle(i, outcome),
            () = wake => {}
        }
        self.expire();
        self.publish();
    }

    /// Starts a lookup of each name that is due and not under way.
    fn start_due(&mut self) {
        let now = Instant::now();
        let due = |n: &NameState| !n.looking_up && n.due <= now;
        if !self.names.iter().any(due) {
            return;
        }
        // Each refresh asks the server: the resolver's cache would answer within the TTL
        // (or past it, for a bound shorter than the TTL) with what it already has.
        self.dns.resolver.clear_cache();
        let (max, max_stale) = (self.config.max_endpoints, self.config.max_stale);
        for (i, state) in self.names.iter_mut().enumerate() {
            if !due(state) {
                continue;
            }
            state.looking_up = true;
            let dns = self.dns.clone();
            let target = state.target.clone();
            let pinned = state.pinned.clone();
            let last = Arc::clone(&state.origins);
            self.lookups.push(Box::pin(async move {
                (
                    i,
                    resolve(&dns, &target, pinned, &last, max, max_stale).await,
                )
            }));
        }
    }

    /// Takes the outcome of name `i`'s lookup: its engines, its next due time.
    fn settle(&mut self, i: usize, outcome: Result<Resolved, Failure>) {
        let config = &self.config;
        let Some(state) = self.names.get_mut(i) else {
            return;
        };
        state.looking_up = false;
        let bound = |d: Duration| d.clamp(config.min_refresh, config.max_refresh);
        match outcome {
            Ok(Resolved {
                specs,
                ttl,
                pin,
                passed_over,
                failed,
                origins,
                kept,
                stale,
            }) => {
                // Left out past their limit: counted unless the limit dropped them
                // while the lookup was under way.
                if state.holds_any(&stale) {
                    tracing::warn!(
                        name = %state.target.name,
                        addresses = stale.len(),
                        max_stale = ?config.max_stale,
                        "DNS lookups of one address family have failed for longer than its addresses are kept after their last good answer; dropping them"
                    );
                    self.publisher.record_expired();
                }
                let mut due = Instant::now() + bound(ttl);
                // One family failed beside one that answered: that family's last good
                // engines stayed (they are among `specs`), and the name is asked again
                // as after a failed lookup, with a backoff.
                if let Some(FamilyFailure { name, v6, error }) = failed {
                    self.publisher.record_error();
                    state.half_failures = state.half_failures.saturating_add(1);
                    let retry = bound(backoff(config.min_refresh, state.half_failures));
                    let family = if v6 { "AAAA" } else { "A" };
                    // Warned as it starts or changes, counted each time.
                    let failing = (name, v6);
                    let (target, asked) = (&state.target.name, &failing.0);
                    if state.family_failed.as_ref() == Some(&failing) {
                        tracing::debug!(
                            name = %target,
                            asked = %asked,
                            family,
                            error = %error,
                            retry_in = ?retry,
                            "DNS lookup of one address family failed again"
                        );
                    } else {
                        tracing::warn!(
                            name = %target,
                            asked = %asked,
                            family,
                            error = %error,
                            retry_in = ?retry,
                            "DNS lookup of one address family failed; keeping its last good engines"
                        );
                    }
                    state.family_failed = Some(failing);
                    due = due.min(Instant::now() + retry);
                } else {
                    state.half_failures = 0;
                    if let Some((asked, v6)) = state.family_failed.take() {
                        tracing::info!(
                            name = %state.target.name,
                            asked = %asked,
                            family = if v6 { "AAAA" } else { "A" },
                            "DNS lookup of the address family that failed answers again"
                        );
                    }
                }
                // Found past a SERVFAIL on an earlier name of the search list.
                if let Some((name, error)) = passed_over {
                    self.publisher.record_error();
                    if state.passed_over.as_ref() != Some(&name) {
                        tracing::warn!(
                            name = %state.target.name,
                            failed = %name,
                            error = %error,
                            "DNS server failure on a search-list name; took a later name's answer"
                        );
                    }
                    state.passed_over = Some(name);
                } else {
                    state.passed_over = None;
                }
                state.last = Some(specs);
                state.answered_at = Some(Instant::now());
                state.lookups_failing = false;
                state.origins = Arc::new(origins);
                state.kept = kept;
                state.pinned = state.pinned.take().or(pin);
                state.failures = 0;
                state.due = due;
            }
            Err(Failure::NoRecords { negative_ttl }) => {
                state.last = Some(Vec::new());
                state.answered_at = Some(Instant::now());
                state.lookups_failing = false;
                state.origins = Arc::default();
                state.kept.clear();
                // The name that answered is gone: the next lookup walks the search list
                // again (the Service may come back under another of its names).
                state.pinned = None;
                state.failures = 0;
                state.half_failures = 0;
                state.family_failed = None;
                state.passed_over = None;
                let wait =
                    negative_ttl.map_or(config.max_refresh, |t| Duration::from_secs(t.into()));
                state.due = Instant::now() + bound(wait);
            }
            // A lookup that failed, or answers past the ceiling.
            Err(failed) => {
                self.publisher.record_error();
                // A name that answered past the ceiling keeps its last good list (refused
                // whole): the stale limit is for a name whose lookups fail.
                state.lookups_failing = !matches!(failed, Failure::TooMany { .. });
                state.failures = state.failures.saturating_add(1);
                let wait = backoff(config.min_refresh, state.failures);
                tracing::warn!(
                    name = %state.target.name,
                    error = %failed,
                    retry_in = ?bound(wait),
                    "DNS lookup failed; keeping the name's last good engines"
                );
                state.due = Instant::now() + bound(wait);
            }
        }
    }

    /// Publishes every name's engines (an engine two names give as the name given
    /// first has it).
    fn publish(&self) {
        // No partial first list: nothing until every name has had an answer (a name
        // whose lookups all failed so far is not one without engines), for at most
        // `first_list_wait`; then the names that answered.
        let waiting = self.names.iter().any(|n| n.last.is_none());
        if waiting
            && !self.publisher.has_published()
            && self.first_list_by.is_none_or(|by| Instant::now() < by)
        {
            return;
        }
        let specs = self
            .names
            .iter()
            .flat_map(|n| n.last.iter().flatten().cloned())
            .collect::<Vec<_>>();
        self.publisher.publish(dedup(specs));
    }
}

/// The wait after `n` failures in a row (from 1): 1, 2, 4 ... times `min_refresh`
/// (bounded by `max_refresh` where it is used).
fn backoff(min_refresh: Duration, n: u32) -> Duration {
    min_refresh.saturating_mul(1u32 << n.saturating_sub(1).min(16))
}

/// One engine once, when two names (or an SRV name's targets) give the same address.
fn dedup(mut specs: Vec<EndpointSpec>) -> Vec<EndpointSpec> {
    let mut seen = std::collections::HashSet::new();
    specs.retain(|s| seen.insert((crate::source::role_order(s.role), s.url.clone())));
    specs
}

/// Resolves `target`: through its `pinned` name when it has one, else walking the
/// names it may stand for ([`Dns::candidates`], [`first_answer`]). `last` is the
/// addresses each origin gave in the name's last good answer: a family that fails
/// beside one that answers keeps its own from there.
async fn resolve(
    dns: &Dns,
    target: &DnsTarget,
    pinned: Option<Name>,
    last: &Origins,
    max: usize,
    max_stale: Duration,
) -> Result<Resolved, Failure> {
    let names = |name: &str| match &pinned {
        Some(pinned) => Ok(vec![pinned.clone()]),
        None => dns.candidates(name),
    };
    let mut engines = Engines::new(target, last, max, max_stale);
    match &target.name {
        DnsName::Host { name, port } => {
            // An address written as the name is its one engine (as the resolver has it).
            if let Ok(ip) = name.parse::<IpAddr>() {
                return Ok(Resolved {
                    specs: vec![spec(target, ip, *port)],
                    ttl: Duration::MAX,
                    pin: None,
                    passed_over: None,
                    failed: None,
                    origins: Origins::new(),
                    kept: Kept::new(),
                    stale: Vec::new(),
                });
            }
            let walked =
                first_answer(names(name)?, |n| async move { dns.addresses(&n).await }).await?;
            let until = walked.found.until;
            engines.add((walked.name.clone(), *port), walked.found, None)?;
            Ok(engines.resolved(until, walked.name, walked.passed_over))
        }
        DnsName::Srv(name) => {
            let walked = first_answer(names(name)?, |n| async move {
                let lookup = dns.resolver.srv_lookup(n).await?;
                let records: Vec<_> = lookup
                    .answers()
                    .iter()
                    .filter_map(|r| match &r.data {
                        RData::SRV(srv) => Some(srv.clone()),
                        _ => None,
                    })
                    .collect();
                if records.is_empty() {
                    return Err(Failure::NoRecords { negative_ttl: None });
                }
                Ok((records, Instant::from_std(lookup.valid_until())))
            })
            .await?;
            let (records, mut valid_until) = walked.found;
            let Some(best) = records.iter().map(|s| s.priority).min() else {
                return Err(Failure::NoRecords { negative_ttl: None });
            };
            // Each target and port once (the first record's weight), at most
            // MAX_SRV_TARGETS of them. The targets are fully qualified names: asked as
            // they are.
            let mut targets: Vec<(Name, u16, u16)> = Vec::new();
            let mut named = std::collections::HashSet::new();
            let mut cut = 0usize;
            for srv in records.iter().filter(|s| s.priority == best) {
                let mut host = srv.target.to_lowercase();
                host.set_fqdn(true);
                let key = (host, srv.port);
                if named.contains(&key) {
                    continue;
                }
                if targets.len() >= MAX_SRV_TARGETS {
                    cut += 1;
                    continue;
                }
                targets.push((key.0.clone(), key.1, srv.weight));
                named.insert(key);
            }
            if cut > 0 {
                tracing::warn!(
                    name = %name,
                    resolved = MAX_SRV_TARGETS,
                    records_left_out = cut,
                    "SRV answer names more targets than are resolved per name and refresh; the rest are left out"
                );
            }
            // Looked up SRV_LOOKUPS_IN_FLIGHT at a time, the answers taken in the
            // targets' order; returning drops the lookups still under way. A host
            // named at several ports is still asked once: the resolver shares a query
            // under way among identical lookups, and answers later ones from its cache.
            let mut answers = in_order(targets, |(host, port, weight)| async move {
                (dns.addresses(&host).await, host, port, weight)
            });
            while let Some((answer, host, port, weight)) = answers.next().await {
                // A target without addresses contributes nothing; one whose lookup
                // fails in both families (or in one, the other without records) fails
                // the whole name, so that its engines are kept. A family that fails
                // beside one with records keeps the target's last good addresses of it.
                let found = match answer {
                    Ok(found) => found,
                    Err(Failure::NoRecords { .. }) => continue,
                    Err(e) => return Err(e),
                };
                valid_until = valid_until.min(found.until);
                engines.add((host, port), found, Some(srv_weight(weight)))?;
            }
            Ok(engines.resolved(valid_until, walked.name, walked.passed_over))
        }
    }
}

/// `lookup` of each of `items`, at most [`SRV_LOOKUPS_IN_FLIGHT`] under way at a time,
/// the outcomes in the items' order: an outcome ready before an earlier item's is held
/// until that one's, so at most `SRV_LOOKUPS_IN_FLIGHT - 1` are held (each one
/// target's addresses, from one answer per family).
fn in_order<T, F, Fut>(items: Vec<T>, lookup: F) -> impl Stream<Item = Fut::Output>
where
    F: FnMut(T) -> Fut,
    Fut: Future,
{
    futures::stream::iter(items)
        .map(lookup)
        .buffered(SRV_LOOKUPS_IN_FLIGHT)
}

/// The routing weight of an SRV record's engines: its weight, and 0.01 for a weight of
/// 0 (RFC 2782: such records "should have a very small chance of being selected" next
/// to records of positive weight; when all are 0, all weigh alike).
pub fn srv_weight(weight: u16) -> f64 {
    if weight == 0 { 0.01 } else { f64::from(weight) }
}

/// The URL of the engine at `ip` and `port`.
fn url(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(v4) => format!("http://{v4}:{port}"),
        IpAddr::V6(v6) => format!("http://[{v6}]:{port}"),
    }
}

fn spec(target: &DnsTarget, ip: IpAddr, port: u16) -> EndpointSpec {
    let mut spec = EndpointSpec::new(url(ip, port), target.role);
    spec.models.clone_from(&target.models);
    if target.role == Role::Prefill
        && let Some(port) = target.bootstrap_port
    {
        // A u16's digits: always within the facts' ceilings.
        let _ = spec.facts.insert(
            disagg_core::endpoint::Facts::BOOTSTRAP_PORT,
            port.to_string(),
        );
    }
    spec
}

#[cfg(test)]
mod tests {
    use super::outcome::Addresses;
    use super::*;
    use hickory_resolver::proto::op::{Message, ResponseCode};
    use hickory_resolver::proto::rr::rdata::A;
    use hickory_resolver::proto::rr::{Record, RecordType};
    use std::collections::HashMap;
    use std::net::Ipv4Addr;
    use std::sync::{Arc, Mutex};

    /// How [`TestServer`] answers a name's queries.
    #[derive(Clone, Copy)]
    enum Reply {
        /// An A record (TTL 0); no AAAA record.
        A(Ipv4Addr),
        /// No answer: the query times out.
        Silent,
        /// An A record (TTL 0), and no answer to AAAA queries (a server that drops
        /// them).
        ADropsAaaa(Ipv4Addr),
        /// SERVFAIL, for every type.
        ServFail,
        /// No answer to A queries (a timeout), SERVFAIL to AAAA queries.
        ASilentAaaaServFail,
        /// An A record with a TTL of 60 s, and SERVFAIL to AAAA queries.
        AServFailsAaaa(Ipv4Addr),
    }

    /// A DNS server on a loopback UDP port: each name of `zone` answered as it says,
    /// any other name NXDOMAIN; the names asked are logged, in order.
    struct TestServer {
        addr: SocketAddr,
        zone: Arc<Mutex<HashMap<String, Reply>>>,
        asked: Arc<Mutex<Vec<String>>>,
        task: tokio::task::JoinHandle<()>,
    }

    impl TestServer {
        async fn start(zone: &[(&str, Reply)]) -> TestServer {
            let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
            let addr = socket.local_addr().unwrap();
            let zone: HashMap<String, Reply> =
                zone.iter().map(|(n, r)| ((*n).to_owned(), *r)).collect();
            let zone = Arc::new(Mutex::new(zone));
            let asked = Arc::new(Mutex::new(Vec::new()));
            let task = tokio::spawn({
                let (zone, asked) = (zone.clone(), asked.clone());
                async move {
                    let mut buf = [0u8; 1500];
                    while let Ok((n, from)) = socket.recv_from(&mut buf).await {
                        let Ok(query) = Message::from_vec(&buf[..n]) else {
                            continue;
                        };
                        let Some(q) = query.queries.first().cloned() else {
                            continue;
                        };
                        let name = q.name().to_lowercase().to_utf8();
                        asked.lock().unwrap().push(name.clone());
                        let reply = zone.lock().unwrap().get(&name).copied();
                        let mut answer =
                            Message::response(query.metadata.id, query.metadata.op_code);
                        answer.metadata.recursion_desired = query.metadata.recursion_desired;
                        answer.metadata.recursion_available = true;
                        answer.add_query(q.clone());
                        let (a, aaaa) = (
                            q.query_type() == RecordType::A,
                            q.query_type() == RecordType::AAAA,
                        );
                        let record =
                            |ip, ttl| Record::from_rdata(q.name().clone(), ttl, RData::A(A(ip)));
                        match reply {
                            Some(Reply::Silent) => continue,
                            Some(Reply::ADropsAaaa(_)) if aaaa => continue,
                            Some(Reply::ASilentAaaaServFail) if a => continue,
                            Some(Reply::ServFail) => {
                                answer.metadata.response_code = ResponseCode::ServFail;
                            }
                            Some(Reply::ASilentAaaaServFail | Reply::AServFailsAaaa(_)) if aaaa => {
                                answer.metadata.response_code = ResponseCode::ServFail;
                            }
                            Some(Reply::A(ip) | Reply::ADropsAaaa(ip)) if a => {
                                answer.add_answer(record(ip, 0));
                            }
                            Some(Reply::AServFailsAaaa(ip)) if a => {
                                answer.add_answer(record(ip, 60));
                            }
                            // No records of the type.
                            Some(_) => {}
                            None => answer.metadata.response_code = ResponseCode::NXDomain,
                        }
                        if let Ok(bytes) = answer.to_vec() {
                            let _ = socket.send_to(&bytes, from).await;
                        }
                    }
                }
            });
            TestServer {
                addr,
                zone,
                asked,
                task,
            }
        }

        fn set(&self, name: &str, reply: Reply) {
            self.zone.lock().unwrap().insert(name.to_owned(), reply);
        }

        /// `name` answered NXDOMAIN from now on.
        fn remove(&self, name: &str) {
            self.zone.lock().unwrap().remove(name);
        }

        /// The names asked since the last call.
        fn asked(&self) -> Vec<String> {
            std::mem::take(&mut *self.asked.lock().unwrap())
        }
    }

    impl Drop for TestServer {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    /// DNS discovery asking `server`, with `search` as its search list and `ndots`, as
    /// the system's configuration would give them.
    fn dns_at(server: SocketAddr, search: &[&str], ndots: usize) -> (Dns, DnsConfig) {
        let mut config = DnsConfig::new([DnsTarget::new(
            "d.hole.test:8200".parse().unwrap(),
            Role::Decode,
        )]);
        config.server = Some(server);
        // Only a family left unanswered waits it out: long enough that no answer of the
        // test server (on the test's own runtime, on a loaded machine) comes after it.
        config.timeout = Duration::from_secs(2);
        let mut dns = resolver(&config).unwrap();
        dns.search = search.iter().map(|d| Name::from_utf8(d).unwrap()).collect();
        dns.ndots = ndots;
        (dns, config)
    }

    /// Refreshes the refresher's first name now, and takes its outcome.
    async fn refresh(r: &mut Refresher) {
        r.names[0].due = Instant::now();
        r.start_due();
        let (i, outcome) = r.lookups.next().await.unwrap();
        r.settle(i, outcome);
    }

    /// A name's engines' URLs.
    fn urls(s: &NameState) -> Vec<String> {
        s.last.iter().flatten().map(|e| e.url.clone()).collect()
    }

    #[tokio::test]
    async fn candidates_follow_ndots_and_the_search_list() {
        let (dns, _) = dns_at(([127, 0, 0, 1], 53).into(), &["llm.svc.", "svc."], 5);
        let names = |n: &str| -> Vec<String> {
            match dns.candidates(n) {
                Ok(names) => names.iter().map(Name::to_utf8).collect(),
                Err(e) => panic!("{n}: {e}"),
            }
        };
        // Fewer than five dots: the search list first, the name itself last.
        assert_eq!(
            names("prefill"),
            ["prefill.llm.svc.", "prefill.svc.", "prefill."]
        );
        // Fully qualified: only itself.
        assert_eq!(names("prefill.llm.svc."), ["prefill.llm.svc."]);
        let (dns, _) = dns_at(([127, 0, 0, 1], 53).into(), &["llm.svc."], 1);
        // At least `ndots` dots: the name itself first.
        assert_eq!(
            dns.candidates("d.hole.test")
                .unwrap()
                .iter()
                .map(Name::to_utf8)
                .collect::<Vec<_>>(),
            ["d.hole.test.", "d.hole.test.llm.svc."]
        );
    }

    /// A name asked as it is first (enough dots) that times out, before a search-domain
    /// name that does not exist: the lookup failed (the name's engines are kept), it
    /// did not answer "no such name" (which would empty them). The walk stops at the
    /// failure.
    #[tokio::test]
    async fn a_failure_on_one_name_of_the_search_list_fails_the_lookup() {
        let server = TestServer::start(&[("d.hole.test.", Reply::Silent)]).await;
        let (dns, config) = dns_at(server.addr, &["search.test."], 1);
        let outcome = resolve(
            &dns,
            &config.targets[0],
            None,
            &Origins::new(),
            100,
            Duration::MAX,
        )
        .await;
        assert!(
            matches!(outcome, Err(Failure::Lookup(_))),
            "{}",
            outcome.map_or_else(|e| e.to_string(), |_| "records".into())
        );
        let asked = server.asked();
        assert!(
            asked.iter().all(|n| n == "d.hole.test."),
            "the walk stopped at the failure: {asked:?}"
        );
        // Each name of the list answering "no such name": the name has no engines.
        server.set("d.hole.test.", Reply::A(Ipv4Addr::LOCALHOST));
        let (dns, mut config) = dns_at(server.addr, &["search.test."], 1);
        config.targets[0].name = "e.hole.test:8200".parse().unwrap();
        let outcome = resolve(
            &dns,
            &config.targets[0],
            None,
            &Origins::new(),
            100,
            Duration::MAX,
        )
        .await;
        assert!(matches!(outcome, Err(Failure::NoRecords { .. })));
        assert_eq!(
            server.asked(),
            [
                "e.hole.test.",
                "e.hole.test.",
                "e.hole.test.search.test.",
                "e.hole.test.search.test."
            ]
        );
    }

    /// A SERVFAIL on one name of the search list moves on to the next, as glibc's
    /// resolver does (a search domain whose upstream server fails does not hide the
    /// name's records under the next one): the first name with records answers. It is
    /// not pinned, as the name that failed comes first and may be the one meant: each
    /// refresh walks the list again, and once the failing name answers with records, it
    /// is the one taken, and pinned. No name with records, with a SERVFAIL among them,
    /// is a failed lookup: the name's last good engines are kept, not emptied.
    #[tokio::test]
    async fn a_server_failure_on_a_search_list_name_moves_on_and_pins_nothing() {
        let server = TestServer::start(&[
            ("d.hole.test.broken.test.", Reply::ServFail),
            ("d.hole.test.", Reply::A(Ipv4Addr::new(127, 0, 0, 8))),
        ])
        .await;
        // Two dots, fewer than ndots: the search list first, the name as written last.
        let (dns, config) = dns_at(server.addr, &["broken.test.", "search.test."], 5);
        let (publisher, source) = SpecSource::channel("dns");
        let mut refresher = Refresher::new(dns, config, publisher);
        refresh(&mut refresher).await;
        let state = &refresher.names[0];
        assert_eq!(urls(state), ["http://127.0.0.8:8200"]);
        assert_eq!(state.failures, 0);
        assert_eq!(state.pinned, None, "found past a failure: not pinned");
        assert_eq!(
            source.stats().errors(),
            1,
            "the SERVFAIL passed over counted"
        );
        let mut asked = server.asked();
        asked.dedup();
        assert_eq!(
            asked,
            [
                "d.hole.test.broken.test.",
                "d.hole.test.search.test.",
                "d.hole.test."
            ]
        );
        // The name as written gone too: no name with records, a SERVFAIL among them.
        server.remove("d.hole.test.");
        refresh(&mut refresher).await;
        let state = &refresher.names[0];
        assert_eq!(state.failures, 1, "a failed lookup");
        assert_eq!(urls(state), ["http://127.0.0.8:8200"], "the engines kept");
        assert_eq!(source.stats().errors(), 2);
        // The failing name answers: it is taken, and pinned.
        server.set(
            "d.hole.test.broken.test.",
            Reply::A(Ipv4Addr::new(127, 0, 0, 9)),
        );
        refresh(&mut refresher).await;
        let state = &refresher.names[0];
        assert_eq!(urls(state), ["http://127.0.0.9:8200"]);
        assert_eq!(source.stats().errors(), 2, "nothing failed");
        assert_eq!(
            state.pinned.as_ref().map(Name::to_utf8).as_deref(),
            Some("d.hole.test.broken.test.")
        );
    }

    /// A name whose A lookup times out while its AAAA lookup SERVFAILs failed by the
    /// timeout, not by the SERVFAIL: the walk ends there, as at any timeout (the
    /// search-list name after it, which has records, is not asked), and the name's
    /// last good engines are kept.
    #[tokio::test]
    async fn a_timeout_beside_a_server_failure_ends_the_walk() {
        let server = TestServer::start(&[
            ("d.hole.test.", Reply::ASilentAaaaServFail),
            (
                "d.hole.test.search.test.",
                Reply::A(Ipv4Addr::new(127, 0, 0, 10)),
            ),
        ])
        .await;
        // Enough dots: the name as written first, then under the search domain.
        let (dns, config) = dns_at(server.addr, &["search.test."], 1);
        let (publisher, source) = SpecSource::channel("dns");
        let mut refresher = Refresher::new(dns, config, publisher);
        let kept = spec(
            &refresher.names[0].target,
            Ipv4Addr::new(127, 0, 0, 4).into(),
            8200,
        );
        refresher.names[0].last = Some(vec![kept]);
        refresh(&mut refresher).await;
        let state = &refresher.names[0];
        assert_eq!(urls(state), ["http://127.0.0.4:8200"], "the engines kept");
        assert_eq!(state.failures, 1, "a failed lookup");
        assert_eq!(source.stats().errors(), 1);
        let asked = server.asked();
        assert!(
            asked.iter().all(|n| n == "d.hole.test."),
            "the walk ended at the timeout: {asked:?}"
        );
    }

    /// The search list is resolv.conf's last `search` or `domain` line, as glibc reads
    /// it (each replaces the other); the system's domain (a `domain` line, else the
    /// host name's domain) is the list only when resolv.conf has neither.
    #[test]
    fn the_search_list_is_the_last_search_or_domain_line() {
        use hickory_resolver::system_conf::parse_resolv_conf;
        let list = |config: &ResolverConfig| -> Vec<String> {
            search_list(config).iter().map(Name::to_utf8).collect()
        };
        let conf = |text: &str| parse_resolv_conf(text).unwrap().0;
        let ns = "nameserver 127.0.0.1\n";
        assert_eq!(
            list(&conf(&format!("domain a.test\nsearch b.test c.test\n{ns}"))),
            ["b.test", "c.test"]
        );
        assert_eq!(
            list(&conf(&format!("search b.test c.test\ndomain a.test\n{ns}"))),
            ["a.test"]
        );
        assert_eq!(list(&conf(&format!("domain a.test\n{ns}"))), ["a.test"]);
        // A `search` line beside the host name's domain (hickory's `domain` when
        // resolv.conf has no `domain` line): the search line alone.
        let server = NameServerConfig::udp_and_tcp(Ipv4Addr::LOCALHOST.into());
        let from_host = |search: Vec<Name>| {
            ResolverConfig::from_parts(
                Some(Name::from_utf8("host.test").unwrap()),
                search,
                vec![server.clone()],
            )
        };
        assert_eq!(
            list(&from_host(vec![Name::from_utf8("b.test").unwrap()])),
            ["b.test"]
        );
        // Neither line: the host name's domain.
        assert_eq!(list(&from_host(Vec::new())), ["host.test"]);
    }

    /// The fully qualified name that first answered is the one asked from then on: a
    /// name earlier in the search walk that later fails (here the name as written, timing
    /// out) is not asked again, and fails nothing.
    #[tokio::test]
    async fn the_name_that_answered_is_pinned() {
        let server = TestServer::start(&[(
            "d.hole.test.search.test.",
            Reply::A(Ipv4Addr::new(127, 0, 0, 5)),
        )])
        .await;
        let (dns, config) = dns_at(server.addr, &["search.test."], 1);
        let (publisher, _source) = SpecSource::channel("dns");
        let mut refresher = Refresher::new(dns, config, publisher);
        refresh(&mut refresher).await;
        let state = &refresher.names[0];
        assert_eq!(urls(state), ["http://127.0.0.5:8200"]);
        assert_eq!(
            state.pinned.as_ref().map(Name::to_utf8).as_deref(),
            Some("d.hole.test.search.test.")
        );
        assert!(server.asked().contains(&"d.hole.test.".to_owned()));
        // The name as written now times out: not asked, so no failure.
        server.set("d.hole.test.", Reply::Silent);
        refresh(&mut refresher).await;
        let state = &refresher.names[0];
        assert_eq!(state.failures, 0);
        assert_eq!(urls(state), ["http://127.0.0.5:8200"]);
        assert_eq!(
            server.asked(),
            ["d.hole.test.search.test.", "d.hole.test.search.test."]
        );
        // The pinned name is gone (NXDOMAIN): no engines, and the pin with it; the
        // name comes back as written, and the next lookup walks the list to find it.
        server.remove("d.hole.test.search.test.");
        refresh(&mut refresher).await;
        let state = &refresher.names[0];
        assert!(urls(state).is_empty());
        assert_eq!(state.pinned, None);
        server.set("d.hole.test.", Reply::A(Ipv4Addr::new(127, 0, 0, 6)));
        refresh(&mut refresher).await;
        let state = &refresher.names[0];
        assert_eq!(urls(state), ["http://127.0.0.6:8200"]);
        assert_eq!(
            state.pinned.as_ref().map(Name::to_utf8).as_deref(),
            Some("d.hole.test.")
        );
    }

    /// A server that drops AAAA queries does not make an IPv4 name fail: the A records
    /// are taken, the failed family's last good engines (none here) kept, an error
    /// counted, and the name asked again soon.
    #[tokio::test]
    async fn a_family_that_fails_beside_one_with_records_keeps_its_own_engines() {
        let server = TestServer::start(&[(
            "d.hole.test.",
            Reply::ADropsAaaa(Ipv4Addr::new(127, 0, 0, 7)),
        )])
        .await;
        let (dns, config) = dns_at(server.addr, &[], 1);
        let (publisher, _source) = SpecSource::channel("dns");
        let mut refresher = Refresher::new(dns, config, publisher);
        refresher.names[0].due = Instant::now();
        refresher.start_due();
        let (i, outcome) = refresher.lookups.next().await.unwrap();
        refresher.settle(i, outcome);
        let state = &refresher.names[0];
        let urls: Vec<&str> = state
            .last
            .iter()
            .flatten()
            .map(|e| e.url.as_str())
            .collect();
        assert_eq!(urls, ["http://127.0.0.7:8200"]);
        assert_eq!(state.failures, 0);
        // An IPv6 address the name gave before stays while its family fails; one of
        // another origin (another port) is no address of this one.
        let asked = Name::from_utf8("d.hole.test.").unwrap();
        let now = Instant::now();
        refresher.names[0].origins = Arc::new(Origins::from([
            (
                (asked.clone(), 8200),
                vec![
                    ("127.0.0.3".parse().unwrap(), now),
                    ("fd00::1".parse().unwrap(), now),
                ],
            ),
            ((asked, 8201), vec![("fd00::2".parse().unwrap(), now)]),
        ]));
        refresher.names[0].due = Instant::now();
        refresher.start_due();
        let (i, outcome) = refresher.lookups.next().await.unwrap();
        refresher.settle(i, outcome);
        let urls: Vec<&str> = refresher.names[0]
            .last
            .iter()
            .flatten()
            .map(|e| e.url.as_str())
            .collect();
        assert_eq!(urls, ["http://127.0.0.7:8200", "http://[fd00::1]:8200"]);
    }

    /// The last good addresses of a family that fails beside one that answers are kept
    /// at most `max_stale` after that family last answered with them, not after the
    /// name's last answer: then they are dropped, logged and counted once, the other
    /// family's engines taken as they come.
    #[tokio::test]
    async fn a_failing_familys_addresses_are_dropped_past_the_stale_limit() {
        let ip = Ipv4Addr::new(127, 0, 0, 15);
        let server = TestServer::start(&[("d.hole.test.", Reply::AServFailsAaaa(ip))]).await;
        let (dns, config) = dns_at(server.addr, &[], 1);
        let (publisher, source) = SpecSource::channel("dns");
        let mut refresher = Refresher::new(dns, config, publisher);
        // The name's IPv6 address, as its AAAA records last gave it.
        let answered = Instant::now();
        let origin = (Name::from_utf8("d.hole.test.").unwrap(), 8200);
        let v6 = "fd00::15".parse().unwrap();
        refresher.names[0].origins =
            Arc::new(Origins::from([(origin.clone(), vec![(v6, answered)])]));
        let both = ["http://127.0.0.15:8200", "http://[fd00::15]:8200"];
        // Within the hour: kept, remembered with its own answer's time.
        for _ in 0..2 {
            refresh(&mut refresher).await;
            assert_eq!(urls(&refresher.names[0]), both);
            let remembered = &refresher.names[0].origins[&origin];
            assert!(remembered.contains(&(v6, answered)), "{remembered:?}");
        }
        assert_eq!(source.stats().expired(), 0);
        // The limit is what has passed since that answer: past it, dropped.
        refresher.config.max_stale = answered.elapsed();
        refresh(&mut refresher).await;
        assert_eq!(urls(&refresher.names[0]), ["http://127.0.0.15:8200"]);
        assert_eq!(source.stats().expired(), 1);
        // The family failing on: nothing more to drop, nothing more counted.
        refresh(&mut refresher).await;
        assert_eq!(urls(&refresher.names[0]), ["http://127.0.0.15:8200"]);
        assert_eq!(source.stats().expired(), 1, "counted once");
        assert!(source.stats().errors() >= 4, "each failure counted");
    }

    /// A refresher asking `server` about `d.hole.test:8200`, whose AAAA records gave
    /// `fd00::<last>` `ago`, and what it publishes; after a first refresh, the name
    /// answering its A record while its AAAA lookups fail (SERVFAIL): both engines.
    async fn family_failing_since(
        server: &TestServer,
        v4: Ipv4Addr,
        ago: Duration,
    ) -> (Refresher, SpecSource, Instant) {
        let (dns, config) = dns_at(server.addr, &[], 1);
        let (publisher, source) = SpecSource::channel("dns");
        let mut refresher = Refresher::new(dns, config, publisher);
        let answered = Instant::now().checked_sub(ago).unwrap();
        let origin = (Name::from_utf8("d.hole.test.").unwrap(), 8200);
        let v6: IpAddr = format!("fd00::{}", v4.octets()[3]).parse().unwrap();
        refresher.names[0].origins = Arc::new(Origins::from([(origin, vec![(v6, answered)])]));
        refresh(&mut refresher).await;
        refresher.publish();
        assert_eq!(published(&source).len(), 2, "both families' engines");
        (refresher, source, answered)
    }

    /// What `source` publishes, as URLs.
    fn published(source: &SpecSource) -> Vec<String> {
        let specs = source.watch().borrow().clone().unwrap_or_default();
        specs.iter().map(|s| s.url.clone()).collect()
    }

    /// A failing family's last good addresses are dropped at their own limit,
    /// `max_stale` after the family last answered with them, not at the name's next
    /// lookup (an hour off here): the other family's answers keep the name from being
    /// stale, so only the family's own deadline can wake the source.
    #[tokio::test]
    async fn a_failing_familys_addresses_are_dropped_at_their_limit_not_at_the_next_lookup() {
        let ip = Ipv4Addr::new(127, 0, 0, 16);
        let server = TestServer::start(&[("d.hole.test.", Reply::AServFailsAaaa(ip))]).await;
        let (mut refresher, source, answered) =
            family_failing_since(&server, ip, Duration::from_secs(10)).await;
        // The family's limit ends 300 ms from now at the latest.
        let max_stale = answered.elapsed() + Duration::from_millis(300);
        refresher.config.max_stale = max_stale;
        refresher.names[0].due = Instant::now() + Duration::from_secs(3600);
        let errors = source.stats().errors();
        tokio::time::timeout(Duration::from_secs(5), async {
            while published(&source).len() > 1 {
                refresher.step().await;
            }
        })
        .await
        .expect("the family's addresses dropped at their limit, not at the next lookup");
        assert!(
            Instant::now() >= answered + max_stale,
            "not before the limit"
        );
        assert_eq!(published(&source), ["http://127.0.0.16:8200"]);
        assert_eq!(source.stats().errors(), errors, "no lookup ran meanwhile");
        assert_eq!(source.stats().expired(), 1);
        assert_eq!(refresher.next_stale(), None, "nothing more to drop");
        // The next lookup, the family failing on: nothing more dropped, nor counted.
        refresh(&mut refresher).await;
        refresher.expire();
        assert_eq!(urls(&refresher.names[0]), ["http://127.0.0.16:8200"]);
        assert_eq!(source.stats().expired(), 1, "counted once");
    }

    /// A name whose lookups fail after an answer in which one family failed: that
    /// family's addresses are dropped at their own limit, not kept until the name's
    /// (`max_stale` after its last answer, later); the name's engines then go at
    /// theirs, counted once more.
    #[tokio::test]
    async fn a_failing_familys_addresses_keep_their_limit_when_the_name_fails() {
        let ip = Ipv4Addr::new(127, 0, 0, 17);
        let server = TestServer::start(&[("d.hole.test.", Reply::AServFailsAaaa(ip))]).await;
        let (mut refresher, source, answered) =
            family_failing_since(&server, ip, Duration::from_secs(10)).await;
        server.set("d.hole.test.", Reply::ServFail);
        refresh(&mut refresher).await;
        assert_eq!(refresher.names[0].failures, 1);
        // The family's limit ends 300 ms from now at the latest, the name's 10 s later.
        let max_stale = answered.elapsed() + Duration::from_millis(300);
        refresher.config.max_stale = max_stale;
        refresher.names[0].due = Instant::now() + Duration::from_secs(3600);
        tokio::time::timeout(Duration::from_secs(5), async {
            while published(&source).len() > 1 {
                refresher.step().await;
            }
        })
        .await
        .expect("the family's addresses dropped at their own limit, not the name's");
        assert_eq!(published(&source), ["http://127.0.0.17:8200"]);
        assert_eq!(source.stats().expired(), 1);
        // The name's own limit: its last engine dropped, counted once more.
        let name_answered = refresher.names[0].answered_at.unwrap();
        refresher.config.max_stale = name_answered.elapsed();
        refresher.expire();
        assert!(urls(&refresher.names[0]).is_empty());
        assert_eq!(source.stats().expired(), 2);
    }

    /// A name answering past the endpoint ceiling keeps its last good list, but not a
    /// failed family's addresses in it past their limit: nothing has answered with
    /// them since.
    #[tokio::test]
    async fn a_name_past_the_ceiling_drops_a_failed_familys_addresses_at_their_limit() {
        let ip = Ipv4Addr::new(127, 0, 0, 18);
        let server = TestServer::start(&[("d.hole.test.", Reply::AServFailsAaaa(ip))]).await;
        let (mut refresher, source, answered) =
            family_failing_since(&server, ip, Duration::from_secs(10)).await;
        refresher.config.max_endpoints = 0;
        refresh(&mut refresher).await;
        assert_eq!(refresher.names[0].failures, 1, "refused");
        let max_stale = answered.elapsed() + Duration::from_millis(300);
        refresher.config.max_stale = max_stale;
        refresher.names[0].due = Instant::now() + Duration::from_secs(3600);
        let limit = refresher.next_stale().expect("the family's limit runs");
        assert!(limit <= answered + max_stale);
        tokio::time::timeout(Duration::from_secs(5), async {
            while published(&source).len() > 1 {
                refresher.step().await;
            }
        })
        .await
        .expect("the family's addresses dropped at their limit");
        assert_eq!(published(&source), ["http://127.0.0.18:8200"]);
        assert_eq!(source.stats().expired(), 1);
        assert_eq!(refresher.next_stale(), None, "the name's list kept");
    }

    /// A failing family's addresses are dropped at their limit while a lookup waits
    /// (its AAAA query unanswered, for the 2 s timeout), and counted once: not again
    /// when that lookup, begun before the limit, ends past it.
    #[tokio::test]
    async fn a_failing_familys_limit_runs_while_a_lookup_waits_and_counts_once() {
        let ip = Ipv4Addr::new(127, 0, 0, 19);
        let server = TestServer::start(&[("d.hole.test.", Reply::AServFailsAaaa(ip))]).await;
        let (mut refresher, source, answered) =
            family_failing_since(&server, ip, Duration::from_secs(10)).await;
        server.set("d.hole.test.", Reply::ADropsAaaa(ip));
        refresher.config.max_stale = answered.elapsed() + Duration::from_millis(300);
        refresher.names[0].due = Instant::now();
        let errors = source.stats().errors();
        tokio::time::timeout(Duration::from_secs(5), async {
            while published(&source).len() > 1 {
                refresher.step().await;
            }
        })
        .await
        .expect("dropped");
        assert!(refresher.names[0].looking_up, "while the lookup waits");
        assert_eq!(source.stats().errors(), errors);
        assert_eq!(source.stats().expired(), 1);
        tokio::time::timeout(Duration::from_secs(5), async {
            while source.stats().errors() == errors {
                refresher.step().await;
            }
        })
        .await
        .expect("the lookup's outcome, its AAAA query timed out");
        assert_eq!(published(&source), ["http://127.0.0.19:8200"]);
        assert_eq!(source.stats().expired(), 1, "counted once");
    }

    /// A family failing beside one that answers is asked again with a backoff, as a
    /// failed lookup is: after `min_refresh`, then twice and four times as long (within
    /// the records' TTL, 60 s here), each time an error counted; once the family
    /// answers, the backoff starts over.
    #[tokio::test]
    async fn a_family_failing_beside_one_that_answers_backs_off() {
        let ip = Ipv4Addr::new(127, 0, 0, 11);
        let server = TestServer::start(&[("d.hole.test.", Reply::AServFailsAaaa(ip))]).await;
        let (dns, config) = dns_at(server.addr, &[], 1);
        let min = config.min_refresh;
        let (publisher, source) = SpecSource::channel("dns");
        let mut refresher = Refresher::new(dns, config, publisher);
        // The name is asked again `wait` after its outcome was taken.
        let asked_again_in = async |r: &mut Refresher, wait: Duration| {
            let before = Instant::now();
            refresh(r).await;
            let due = r.names[0].due;
            assert!(
                due >= before + wait && due <= Instant::now() + wait,
                "due in {:?}, not {wait:?}",
                due.saturating_duration_since(before)
            );
        };
        let asked = Name::from_utf8("d.hole.test.").unwrap();
        for (n, factor) in [1, 2, 4].into_iter().enumerate() {
            asked_again_in(&mut refresher, min * factor).await;
            let state = &refresher.names[0];
            assert_eq!(urls(state), ["http://127.0.0.11:8200"]);
            assert_eq!(source.stats().errors(), n as u64 + 1, "each counted");
            // What the warning is given for once, not at each failure.
            assert_eq!(state.family_failed, Some((asked.clone(), true)));
        }
        // AAAA answers (without records): no failure, and the backoff starts over.
        server.set("d.hole.test.", Reply::A(ip));
        refresh(&mut refresher).await;
        assert_eq!(source.stats().errors(), 3);
        assert_eq!(refresher.names[0].family_failed, None);
        server.set("d.hole.test.", Reply::AServFailsAaaa(ip));
        asked_again_in(&mut refresher, min).await;
        assert_eq!(source.stats().errors(), 4);
    }

    /// A name whose lookups fail keeps its last good engines for `max_stale` after its
    /// last good answer, and no longer: at that time (not at the next lookup) they are
    /// dropped and published so, counted once however many lookups fail after. An
    /// answer brings the engines back and starts the time again.
    /// A name that answers past the endpoint ceiling is refused whole, its last good
    /// list kept: the DNS works, so the stale limit (for lookups that fail) never drops
    /// that list, however long the name stays past the ceiling.
    #[tokio::test]
    async fn a_name_past_the_ceiling_keeps_its_list_past_the_stale_limit() {
        let server =
            TestServer::start(&[("d.hole.test.", Reply::A(Ipv4Addr::new(127, 0, 0, 12)))]).await;
        let (dns, config) = dns_at(server.addr, &[], 1);
        let (publisher, source) = SpecSource::channel("dns");
        let mut refresher = Refresher::new(dns, config, publisher);
        let first = Instant::now();
        refresh(&mut refresher).await;
        // Past the ceiling now: the same answer, one engine over none allowed.
        refresher.config.max_endpoints = 0;
        refresh(&mut refresher).await;
        assert_eq!(refresher.names[0].failures, 1, "refused");
        refresher.config.max_stale = Duration::ZERO;
        tokio::time::sleep(Duration::from_millis(20)).await;
        refresher.expire();
        refresher.publish();
        assert!(first.elapsed() > refresher.config.max_stale);
        assert_eq!(
            urls(&refresher.names[0]),
            ["http://127.0.0.12:8200"],
            "kept"
        );
        assert_eq!(source.stats().expired(), 0);
        assert_eq!(refresher.next_stale(), None, "no limit runs for it");
    }

    #[tokio::test]
    async fn a_failing_names_engines_are_dropped_past_the_stale_limit() {
        let server =
            TestServer::start(&[("d.hole.test.", Reply::A(Ipv4Addr::new(127, 0, 0, 12)))]).await;
        let (dns, config) = dns_at(server.addr, &[], 1);
        assert_eq!(config.max_stale, Duration::from_secs(3600), "the default");
        let (publisher, source) = SpecSource::channel("dns");
        let mut refresher = Refresher::new(dns, config, publisher);
        let published = || -> Vec<String> {
            let specs = source.watch().borrow().clone().unwrap_or_default();
            specs.iter().map(|s| s.url.clone()).collect()
        };
        let before_answer = Instant::now();
        refresh(&mut refresher).await;
        let after_answer = Instant::now();
        refresher.publish();
        assert_eq!(published(), ["http://127.0.0.12:8200"]);
        // The server fails: within the hour, the engines are kept.
        server.set("d.hole.test.", Reply::ServFail);
        refresh(&mut refresher).await;
        refresher.publish();
        assert_eq!(refresher.names[0].failures, 1);
        assert_eq!(published(), ["http://127.0.0.12:8200"], "kept");
        assert_eq!(source.stats().expired(), 0);
        // The limit now ends 300 ms from now at the latest; the next lookup is far off,
        // so only the limit's own time can drop the engines.
        let max_stale = after_answer.elapsed() + Duration::from_millis(300);
        refresher.config.max_stale = max_stale;
        refresher.names[0].due = Instant::now() + Duration::from_secs(3600);
        let errors = source.stats().errors();
        tokio::time::timeout(Duration::from_secs(5), async {
            while !published().is_empty() {
                refresher.step().await;
            }
        })
        .await
        .expect("the engines dropped at the limit, not at the next lookup");
        assert!(
            Instant::now() >= before_answer + max_stale,
            "not before the limit"
        );
        assert!(urls(&refresher.names[0]).is_empty());
        assert_eq!(source.stats().errors(), errors, "no lookup ran meanwhile");
        assert_eq!(source.stats().expired(), 1);
        // More failures: nothing more to drop, nothing more counted.
        for _ in 0..2 {
            refresh(&mut refresher).await;
            refresher.expire();
        }
        assert_eq!(refresher.names[0].failures, 3);
        assert_eq!(source.stats().expired(), 1, "counted once");
        // The name answers again: its engines are back, and the time starts over from
        // that answer (a limit the first answer is past keeps them).
        server.set("d.hole.test.", Reply::A(Ipv4Addr::new(127, 0, 0, 13)));
        let reanswered = Instant::now();
        refresh(&mut refresher).await;
        server.set("d.hole.test.", Reply::ServFail);
        refresh(&mut refresher).await;
        assert!(refresher.names[0].answered_at >= Some(reanswered));
        refresher.config.max_stale = reanswered - before_answer;
        refresher.expire();
        refresher.publish();
        assert_eq!(published(), ["http://127.0.0.13:8200"]);
        assert_eq!(source.stats().expired(), 1);
    }

    /// The limit is kept while a lookup is under way: a name whose server stops
    /// answering (each lookup waiting out a 10 s timeout) has its engines dropped when
    /// `max_stale` (1 s) has passed since its last good answer, not once the lookup
    /// under way gives up.
    #[tokio::test]
    async fn the_stale_limit_drops_engines_while_a_lookup_waits() {
        let server =
            TestServer::start(&[("d.hole.test.", Reply::A(Ipv4Addr::new(127, 0, 0, 14)))]).await;
        let (_, mut config) = dns_at(server.addr, &[], 1);
        config.timeout = Duration::from_secs(10);
        config.min_refresh = Duration::from_millis(100);
        config.max_refresh = Duration::from_secs(1);
        config.max_stale = Duration::from_secs(1);
        let source = spawn(config).await.unwrap();
        let mut rx = source.watch();
        let decodes = |rx: &mut tokio::sync::watch::Receiver<crate::Specs>| -> usize {
            rx.borrow_and_update().as_ref().map_or(0, |s| s.len())
        };
        assert_eq!(decodes(&mut rx), 1);
        // A failed lookup (SERVFAIL answers at once); then no answer at all.
        server.set("d.hole.test.", Reply::ServFail);
        tokio::time::timeout(Duration::from_secs(5), async {
            while source.stats().errors() == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("a failed lookup");
        server.set("d.hole.test.", Reply::Silent);
        let silent = Instant::now();
        tokio::time::timeout(Duration::from_secs(5), async {
            while decodes(&mut rx) > 0 {
                let _ = rx.changed().await;
            }
        })
        .await
        .expect("the engines dropped well before the 10 s lookup under way gives up");
        assert!(silent.elapsed() < Duration::from_secs(5));
        assert_eq!(source.stats().expired(), 1);
    }

    /// The addresses remembered for a family that fails later are each origin's
    /// distinct ones, at most the engine ceiling in all: 256 SRV targets answering the
    /// same 100 addresses ten times over are 100 engines, within the ceiling, but would
    /// be 256,000 addresses remembered. The origins past the ceiling are not remembered
    /// (a family of theirs that fails keeps nothing).
    #[test]
    fn remembered_addresses_are_distinct_and_within_the_ceiling() {
        let target = DnsTarget::new(DnsName::Srv("_h._tcp.hole.test".into()), Role::Decode);
        let last = Origins::new();
        let max = 1000;
        let mut engines = Engines::new(&target, &last, max, Duration::MAX);
        let ips: Vec<IpAddr> = (0..100)
            .map(|i| Ipv4Addr::new(127, 0, 1, i).into())
            .collect();
        let host = |t: usize| Name::from_utf8(format!("t{t}.hole.test.")).unwrap();
        for t in 0..MAX_SRV_TARGETS {
            let found = Addresses {
                ips: ips.repeat(10),
                until: Instant::now(),
                failed: None,
            };
            engines.add((host(t), 8200), found, Some(1.0)).unwrap();
        }
        let resolved = engines.resolved(Instant::now(), host(0), None);
        assert_eq!(resolved.specs.len(), 100, "one engine per address");
        for (origin, remembered) in &resolved.origins {
            let distinct: std::collections::HashSet<_> =
                remembered.iter().map(|(ip, _)| ip).collect();
            assert_eq!(distinct.len(), remembered.len(), "{origin:?}: repeats");
        }
        let total: usize = resolved.origins.values().map(Vec::len).sum();
        assert_eq!(total, max, "remembered in all");
        assert!(resolved.origins.contains_key(&(host(0), 8200)));
        assert!(!resolved.origins.contains_key(&(host(10), 8200)));
    }

    /// An engine a failed family keeps of one SRV target is no kept engine when
    /// another target answers with it (its limit is then that answer's, the name's);
    /// kept of two targets, its limit runs from the later of their families' answers.
    #[test]
    fn an_engine_another_origin_answers_with_is_not_kept() {
        let target = DnsTarget::new(DnsName::Srv("_h._tcp.hole.test".into()), Role::Decode);
        let host = |t: usize| Name::from_utf8(format!("t{t}.hole.test.")).unwrap();
        let (one, two): (IpAddr, IpAddr) = ("fd00::1".parse().unwrap(), "fd00::2".parse().unwrap());
        let old = Instant::now();
        let older = old.checked_sub(Duration::from_secs(1)).unwrap();
        let last = Origins::from([
            ((host(0), 8200), vec![(one, older), (two, older)]),
            ((host(1), 8200), vec![(two, old)]),
        ]);
        let mut engines = Engines::new(&target, &last, 100, Duration::MAX);
        let aaaa_failed = || Some((true, Failure::NoRecords { negative_ttl: None }));
        for (t, ips, failed) in [
            (0, vec!["127.0.0.1".parse().unwrap()], aaaa_failed()),
            (1, vec!["127.0.0.2".parse().unwrap()], aaaa_failed()),
            (2, vec![one], None),
        ] {
            let found = Addresses {
                ips,
                until: Instant::now(),
                failed,
            };
            engines.add((host(t), 8200), found, None).unwrap();
        }
        let resolved = engines.resolved(Instant::now(), host(0), None);
        assert_eq!(resolved.specs.len(), 4);
        assert_eq!(resolved.kept, Kept::from([((two, 8200), old)]));
        assert!(resolved.stale.is_empty());
    }

    #[test]
    fn names_parse() {
        assert_eq!(
            "prefill.llm.svc:8100".parse::<DnsName>().unwrap(),
            DnsName::Host {
                name: "prefill.llm.svc".into(),
                port: 8100
            }
        );
        assert_eq!(
            "_http._tcp.prefill.llm.svc".parse::<DnsName>().unwrap(),
            DnsName::Srv("_http._tcp.prefill.llm.svc".into())
        );
        for bad in [
            "prefill",
            "prefill:x",
            ":80",
            "_http.prefill",
            "_http._tcp",
            "a:b:1",
        ] {
            assert!(bad.parse::<DnsName>().is_err(), "{bad}");
        }
    }

    /// An SRV name carries no port (its records give the ports): one written with a
    /// port is refused, saying so.
    #[test]
    fn an_srv_name_with_a_port_is_refused() {
        for bad in ["_http._tcp.decode.llm:8200", "_http._tcp.decode.llm.:8200"] {
            let err = bad.parse::<DnsName>().unwrap_err().to_string();
            assert!(err.contains(bad) && err.contains("port"), "{err}");
        }
    }

    #[test]
    fn addresses_become_urls() {
        let t = DnsTarget::new("x:1".parse().unwrap(), Role::Decode);
        assert_eq!(
            spec(&t, "10.0.0.1".parse().unwrap(), 80).url,
            "http://10.0.0.1:80"
        );
        assert_eq!(
            spec(&t, "fd00::1".parse().unwrap(), 80).url,
            "http://[fd00::1]:80"
        );
    }

    #[test]
    fn a_target_with_models_past_their_ceilings_is_refused() {
        use crate::spec::{MAX_MODEL_NAME_BYTES, MAX_MODELS_PER_ENGINE};
        let mut t = DnsTarget::new("decode.llm.svc:8200".parse().unwrap(), Role::Decode);
        t.models = (0..=MAX_MODELS_PER_ENGINE)
            .map(|i| format!("m{i}"))
            .collect();
        let err = checked(DnsConfig::new([t.clone()])).unwrap_err();
        assert!(
            matches!(
                &err,
                DnsError::Models {
                    source: ModelsError::TooMany { max: 256 },
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("decode.llm.svc:8200"), "{err}");
        t.models = vec!["x".repeat(MAX_MODEL_NAME_BYTES + 1)];
        assert!(matches!(
            checked(DnsConfig::new([t.clone()])),
            Err(DnsError::Models {
                source: ModelsError::TooLong { .. },
                ..
            })
        ));
        t.models = vec!["llama".into(), "llama".into(), "qwen".into()];
        let ok = checked(DnsConfig::new([t])).unwrap();
        assert_eq!(ok.targets[0].models, ["llama", "qwen"]);
    }

    /// The targets' lookups run [`SRV_LOOKUPS_IN_FLIGHT`] at a time, no more, and
    /// their outcomes come in the targets' order even when later ones finish first.
    #[tokio::test(start_paused = true)]
    async fn lookups_run_a_bounded_number_at_a_time_in_order() {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        let in_flight = AtomicUsize::new(0);
        let most = AtomicUsize::new(0);
        let outcomes: Vec<u64> = in_order((0..40).collect(), |i: u64| {
            let (in_flight, most) = (&in_flight, &most);
            async move {
                most.fetch_max(in_flight.fetch_add(1, SeqCst) + 1, SeqCst);
                // Later items finish first.
                tokio::time::sleep(Duration::from_millis(100 - i)).await;
                in_flight.fetch_sub(1, SeqCst);
                i
            }
        })
        .collect()
        .await;
        assert_eq!(outcomes, (0..40).collect::<Vec<_>>());
        assert_eq!(most.load(SeqCst), SRV_LOOKUPS_IN_FLIGHT);
    }

    #[test]
    fn srv_weights_become_routing_weights() {
        assert_eq!(srv_weight(10), 10.0);
        assert_eq!(srv_weight(1), 1.0);
        // Zero: a very small chance next to positive weights, and any positive weight.
        assert!(srv_weight(0) > 0.0 && srv_weight(0) < srv_weight(1));
    }

    #[test]
    fn a_metadata_or_link_local_answer_makes_no_endpoint() {
        let t = DnsTarget::new("x:1".parse().unwrap(), Role::Decode);
        for ip in [
            "169.254.169.254",
            "fd00:ec2::254",
            "fe80::1",
            "::ffff:169.254.169.254",
        ] {
            let s = spec(&t, ip.parse().unwrap(), 80);
            assert!(s.to_endpoints().is_err(), "{ip}");
        }
        assert!(
            spec(&t, "10.0.0.1".parse().unwrap(), 80)
                .to_endpoints()
                .is_ok()
        );
    }
}
