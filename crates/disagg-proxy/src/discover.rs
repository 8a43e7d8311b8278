//! `serve`'s discovery flags: Kubernetes pods, DNS names and an endpoints file, merged
//! with `--prefill` / `--decode` into the set the proxy routes over.
//!
//! The sources run on a thread of their own (one small tokio runtime): their watches
//! and refreshes never share an event loop with requests. The chain they feed is built
//! there too, since its pieces follow their inner source from that runtime:
//! `MergedSource` (CLI endpoints first, then each source) → `ValidatedSource` (an engine
//! that cannot pair, by its declared profile or by its `GET /version`, is left out,
//! never crashing the proxy) → `HealthSource` (passive and active health). Health is outermost because it follows its inner set lazily, when
//! the orchestrator reads it; the pair check follows the merged set eagerly, on its own
//! task. The proxy waits, bounded by `--discovery-sync-timeout`, for
//! every source's first complete list before it serves, so it does not start by
//! answering 503 while a watch is still listing.

use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use disagg_core::{Endpoint, EndpointSource, KvConnector, Role, endpoint::AddressPolicy};
use disagg_discovery::dns::{self, DnsConfig, DnsTarget};
use disagg_discovery::file::{self, FileConfig};
use disagg_discovery::kubernetes::{self, KubernetesConfig};
use disagg_discovery::{
    Bounds, DEFAULT_MAX_DP_RANKS, DEFAULT_MAX_ENDPOINTS_PER_SOURCE, MergedSource,
};
use disagg_http::{HttpTransport, HttpTransportConfig};
use disagg_resilience::pairing::{PairingStats, VersionProbe, Versions};
use disagg_resilience::{Health, HealthConfig, HealthSource, ValidatedSource};

use crate::BoxError;

/// Where else endpoints come from (docs/discovery.md has every flag, label and
/// annotation).
#[derive(Debug, Clone, Default, Args)]
pub struct DiscoveryArgs {
    /// Kubernetes: the label selector of prefill pods (`app=vllm,role=prefill`).
    #[arg(long, value_name = "LABELS")]
    k8s_prefill_selector: Option<String>,
    /// Kubernetes: the label selector of decode pods.
    #[arg(long, value_name = "LABELS")]
    k8s_decode_selector: Option<String>,
    /// Kubernetes: the label selector of encoder-only pods (E/P/D:
    /// `app=vllm,role=encode`).
    #[arg(long, value_name = "LABELS")]
    k8s_encode_selector: Option<String>,
    /// Kubernetes: the namespace to watch (default: the pod's own, else the kubeconfig
    /// context's, else `default`). The API server comes from KUBECONFIG or the
    /// in-cluster service account.
    #[arg(long, value_name = "NS")]
    k8s_namespace: Option<String>,
    /// Kubernetes: the engines' HTTP port, a number or a container port's name
    /// (default: the pod's first container port).
    #[arg(long, value_name = "PORT|NAME")]
    k8s_port: Option<String>,
    /// Kubernetes: the pod label naming its model.
    #[arg(long, value_name = "LABEL", default_value = kubernetes::DEFAULT_MODEL_LABEL)]
    k8s_model_label: String,
    /// Kubernetes: how long a request to the API server may wait for its next bytes, in
    /// seconds, before its connection is given up (a half-open connection) and the
    /// request retried with backoff (default: 30 s past the end of a watch, 320 s, so a
    /// quiet watch is never cut).
    #[arg(long, value_name = "SECS")]
    k8s_read_timeout: Option<f64>,
    /// Kubernetes: the longest a list request may take, its body included, and a watch
    /// until its response headers, in seconds [default: 90].
    #[arg(long, value_name = "SECS")]
    k8s_request_timeout: Option<f64>,
    /// Kubernetes: the most bytes taken for a list response, and for one watch event;
    /// past it the request fails (retried with backoff) before more is read. 1 MiB to
    /// 1 GiB [default: 67108864, 64 MiB].
    #[arg(long, value_name = "BYTES")]
    k8s_max_response_bytes: Option<usize>,
    /// Kubernetes: the pods asked for in one list page, 1 to 10,000 [default: 100].
    #[arg(long, value_name = "N")]
    k8s_page_size: Option<u32>,
    /// DNS: prefill engines at every A/AAAA address of NAME:PORT (a headless Service),
    /// or at the targets of an SRV name `_service._proto.name`. Repeatable.
    #[arg(long, value_name = "NAME:PORT|SRV")]
    prefill_dns: Vec<String>,
    /// DNS: decode engines, as --prefill-dns. Repeatable.
    #[arg(long, value_name = "NAME:PORT|SRV")]
    decode_dns: Vec<String>,
    /// DNS: encoder-only engines (E/P/D), as --prefill-dns. Repeatable.
    #[arg(long, value_name = "NAME:PORT|SRV")]
    encode_dns: Vec<String>,
    /// DNS: the longest time between two lookups of a name (records are looked up
    /// again when their TTL ends, at most this long after).
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    dns_refresh: f64,
    /// DNS: the longest time a name whose lookups fail keeps its last good engines,
    /// from its last good answer (then it has none until it answers again).
    #[arg(long, value_name = "SECS", default_value_t = 3600.0)]
    dns_max_stale: f64,
    /// DNS: the resolver to ask instead of the system's (/etc/resolv.conf).
    #[arg(long, value_name = "IP:PORT")]
    dns_server: Option<std::net::SocketAddr>,
    /// A TOML file of `[[prefill]]`, `[[decode]]` and `[[encode]]` entries, reloaded within 2 s of a
    /// change; an invalid edit keeps the previous set.
    #[arg(long, value_name = "PATH")]
    endpoints_file: Option<std::path::PathBuf>,
    /// How long to wait at start for every discovery source's first list before
    /// serving anyway.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    discovery_sync_timeout: f64,
    /// Data-parallel ranks one engine may have (`URL@FIRST-LAST`, an endpoints file's
    /// `ranks`, the `disagg.io/dp-ranks` annotation). More stops the proxy at start;
    /// found by discovery later, the edit is refused (the file) or the engine left out
    /// (Kubernetes), the last good endpoints kept.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_DP_RANKS)]
    max_dp_ranks: u32,
    /// Endpoints one discovery source may contribute, ranks counted. A list (a file
    /// edit, a watch, a lookup) with more is refused whole, logged and counted
    /// (`disagg_discovery_over_limit_total`), and that source's last good endpoints stay.
    /// Each Kubernetes selector also holds at most twice as many pods (ready or not), and
    /// the endpoints file may be 1 KiB per endpoint (at least 4 MiB).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_ENDPOINTS_PER_SOURCE)]
    max_endpoints_per_source: usize,
    /// Allow engines at link-local and cloud metadata addresses (169.254.0.0/16,
    /// fe80::/10, fd00:ec2::254, and IPv4 ones written as IPv6), refused by default
    /// from every source: --prefill/--decode, the endpoints file, DNS answers,
    /// Kubernetes pod IPs, and the addresses a hostname resolves to when the proxy
    /// connects.
    #[arg(long)]
    allow_link_local_engines: bool,
}

impl DiscoveryArgs {
    /// The ceilings and the address rule every source is held to (the command line's
    /// `--prefill` / `--decode` too).
    pub(crate) fn bounds(&self) -> Bounds {
        let mut b = Bounds::default();
        b.max_ranks = self.max_dp_ranks;
        b.max_endpoints = self.max_endpoints_per_source;
        if self.allow_link_local_engines {
            b.addresses = AddressPolicy::allow_link_local();
        }
        b
    }

    /// Whether any discovery source is asked for.
    pub fn any(&self) -> bool {
        self.k8s_prefill_selector.is_some()
            || self.k8s_decode_selector.is_some()
            || self.k8s_encode_selector.is_some()
            || !self.prefill_dns.is_empty()
            || !self.decode_dns.is_empty()
            || !self.encode_dns.is_empty()
            || self.endpoints_file.is_some()
    }

    /// `--dns-server`, if given.
    pub(crate) fn dns_server(&self) -> Option<std::net::SocketAddr> {
        self.dns_server
    }

    /// The flags of each discovery source asked for: its engines are known only once it
    /// runs.
    pub(crate) fn sources_given(&self) -> Vec<&'static str> {
        [
            (
                "--k8s-prefill-selector",
                self.k8s_prefill_selector.is_some(),
            ),
            ("--k8s-decode-selector", self.k8s_decode_selector.is_some()),
            ("--k8s-encode-selector", self.k8s_encode_selector.is_some()),
            ("--prefill-dns", !self.prefill_dns.is_empty()),
            ("--decode-dns", !self.decode_dns.is_empty()),
            ("--encode-dns", !self.encode_dns.is_empty()),
            ("--endpoints-file", self.endpoints_file.is_some()),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect()
    }

    /// Whether encoder engines may come from discovery (so the encoder stage is made
    /// though `--encode` is absent).
    pub fn may_find_encode(&self) -> bool {
        self.k8s_encode_selector.is_some()
            || !self.encode_dns.is_empty()
            || self.endpoints_file.is_some()
    }

    /// Whether prefill engines may come from discovery.
    pub fn may_find_prefill(&self) -> bool {
        self.k8s_prefill_selector.is_some()
            || !self.prefill_dns.is_empty()
            || self.endpoints_file.is_some()
    }

    /// Whether decode engines may come from discovery (so `--decode` may be absent).
    pub fn may_find_decode(&self) -> bool {
        self.k8s_decode_selector.is_some()
            || !self.decode_dns.is_empty()
            || self.endpoints_file.is_some()
    }

    /// The discovery time flags, by name, for the checks made before anything is built
    /// (read again where they are used).
    pub(crate) fn time_flags(&self) -> [(&'static str, f64); 3] {
        [
            ("dns-refresh", self.dns_refresh),
            ("dns-max-stale", self.dns_max_stale),
            ("discovery-sync-timeout", self.discovery_sync_timeout),
        ]
    }

    /// A flag that only a source not asked for would read, refused rather than
    /// ignored: `--dns-server` without a `--*-dns` name, `--k8s-namespace`,
    /// `--k8s-port` or a Kubernetes client bound without a `--k8s-*-selector`.
    pub(crate) fn check_needs(&self) -> Result<(), BoxError> {
        let dns = !self.prefill_dns.is_empty()
            || !self.decode_dns.is_empty()
            || !self.encode_dns.is_empty();
        if self.dns_server.is_some() && !dns {
            return Err(
                "--dns-server is read only by DNS discovery: add --prefill-dns, --decode-dns or --encode-dns"
                    .into(),
            );
        }
        let k8s = self.k8s_prefill_selector.is_some()
            || self.k8s_decode_selector.is_some()
            || self.k8s_encode_selector.is_some();
        let k8s_flag = [
            ("--k8s-namespace", self.k8s_namespace.is_some()),
            ("--k8s-port", self.k8s_port.is_some()),
            ("--k8s-read-timeout", self.k8s_read_timeout.is_some()),
            ("--k8s-request-timeout", self.k8s_request_timeout.is_some()),
            (
                "--k8s-max-response-bytes",
                self.k8s_max_response_bytes.is_some(),
            ),
            ("--k8s-page-size", self.k8s_page_size.is_some()),
        ]
        .into_iter()
        .find_map(|(flag, given)| given.then_some(flag));
        match k8s_flag {
            Some(flag) if !k8s => Err(format!(
                "{flag} is read only by Kubernetes discovery: add --k8s-prefill-selector, --k8s-decode-selector or --k8s-encode-selector"
            )
            .into()),
            _ => Ok(()),
        }
    }

    fn dns(&self) -> Result<Option<DnsConfig>, BoxError> {
        let mut targets = Vec::new();
        let roles = [
            (&self.prefill_dns, Role::Prefill, "--prefill-dns"),
            (&self.decode_dns, Role::Decode, "--decode-dns"),
            (&self.encode_dns, Role::Encode, "--encode-dns"),
        ];
        for (names, role, flag) in roles {
            for n in names {
                let name = n.parse().map_err(|e| format!("{flag} {n}: {e}"))?;
                targets.push(DnsTarget::new(name, role));
            }
        }
        if targets.is_empty() {
            return Ok(None);
        }
        let mut c = DnsConfig::new(targets);
        c.max_refresh = crate::serve::secs(self.dns_refresh, "dns-refresh")?;
        c.max_stale = crate::serve::secs(self.dns_max_stale, "dns-max-stale")?;
        c.server = self.dns_server;
        c.max_endpoints = self.max_endpoints_per_source;
        // The DNS names' first answers are waited for as long as every source's first
        // list is: then the names that answered are served.
        c.first_list_wait =
            crate::serve::secs(self.discovery_sync_timeout, "discovery-sync-timeout")?;
        Ok(Some(c))
    }

    fn kubernetes(&self) -> Result<Option<KubernetesConfig>, BoxError> {
        if self.k8s_prefill_selector.is_none()
            && self.k8s_decode_selector.is_none()
            && self.k8s_encode_selector.is_none()
        {
            return Ok(None);
        }
        let bounds = self.k8s_bounds()?;
        let mut c = KubernetesConfig::new(
            self.k8s_prefill_selector.clone(),
            self.k8s_decode_selector.clone(),
        );
        c.encode_selector = self.k8s_encode_selector.clone();
        c.namespace = self.k8s_namespace.clone();
        c.port = self.k8s_port.as_deref().map(|p| match p.parse() {
            Ok(p) => p,
            Err(never) => match never {},
        });
        c.model_label = self.k8s_model_label.clone();
        c.read_timeout = bounds.read_timeout;
        c.request_timeout = bounds.request_timeout;
        c.max_response_bytes = bounds.max_response_bytes;
        c.page_size = bounds.page_size;
        c.max_endpoints = self.max_endpoints_per_source;
        c.max_ranks = self.max_dp_ranks;
        if let Some(read) = c.read_timeout
            && read <= WATCH_TIMEOUT
        {
            tracing::warn!(
                read_timeout_secs = read.as_secs_f64(),
                watch_timeout_secs = WATCH_TIMEOUT.as_secs_f64(),
                "--k8s-read-timeout is not longer than a watch: a quiet watch is cut, and resumed, each time it runs out (counted as an error)"
            );
        }
        Ok(Some(c))
    }

    /// The Kubernetes client's bounds the flags give, checked: whether or not a
    /// selector is set, so that a bad value stops the proxy at start.
    ///
    /// # Errors
    ///
    /// A message naming the flag: a time that [`secs`](crate::serve::secs) refuses or
    /// is 0, a byte ceiling outside [`K8S_MAX_RESPONSE_BYTES`], a page size outside
    /// [`K8S_PAGE_SIZE`].
    pub(crate) fn check_k8s_bounds(&self) -> Result<(), BoxError> {
        self.k8s_bounds().map(drop)
    }

    fn k8s_bounds(&self) -> Result<K8sBounds, BoxError> {
        let time = |v: f64, flag: &str| {
            let d = crate::serve::secs(v, flag)?;
            if d.is_zero() {
                return Err(BoxError::from(format!(
                    "--{flag} must be more than 0 seconds"
                )));
            }
            Ok(d)
        };
        let read_timeout = self
            .k8s_read_timeout
            .map(|v| time(v, "k8s-read-timeout"))
            .transpose()?;
        let request_timeout = match self.k8s_request_timeout {
            Some(v) => time(v, "k8s-request-timeout")?,
            None => kubernetes::DEFAULT_REQUEST_TIMEOUT,
        };
        let max_response_bytes = self
            .k8s_max_response_bytes
            .unwrap_or(kubernetes::DEFAULT_MAX_RESPONSE_BYTES);
        if !K8S_MAX_RESPONSE_BYTES.contains(&max_response_bytes) {
            return Err(format!(
                "--k8s-max-response-bytes must be between {} (1 MiB: one pod may take 1.5 MiB) and {} (1 GiB), not {max_response_bytes}",
                K8S_MAX_RESPONSE_BYTES.start(),
                K8S_MAX_RESPONSE_BYTES.end()
            )
            .into());
        }
        let page_size = self.k8s_page_size.unwrap_or(kubernetes::DEFAULT_PAGE_SIZE);
        if !K8S_PAGE_SIZE.contains(&page_size) {
            return Err(format!(
                "--k8s-page-size must be between {} and {} pods, not {page_size}",
                K8S_PAGE_SIZE.start(),
                K8S_PAGE_SIZE.end()
            )
            .into());
        }
        Ok(K8sBounds {
            read_timeout,
            request_timeout,
            max_response_bytes,
            page_size,
        })
    }
}

/// The `--k8s-max-response-bytes` accepted: from 1 MiB (a pod object may take 1.5 MiB
/// in etcd; a ceiling far below would refuse one pod's list or event each time) to
/// 1 GiB (held whole while it is parsed).
pub(crate) const K8S_MAX_RESPONSE_BYTES: std::ops::RangeInclusive<usize> = (1 << 20)..=(1 << 30);

/// The `--k8s-page-size` accepted.
pub(crate) const K8S_PAGE_SIZE: std::ops::RangeInclusive<u32> = 1..=10_000;

/// How long the API server holds a watch (kube-rs's `timeoutSeconds`, 290 s): a read
/// timeout no longer cuts a quiet watch.
const WATCH_TIMEOUT: Duration = Duration::from_secs(290);

/// The Kubernetes client's bounds, as the flags give them.
struct K8sBounds {
    read_timeout: Option<Duration>,
    request_timeout: Duration,
    max_response_bytes: usize,
    page_size: u32,
}

/// How long an engine has to answer `GET /version` when it is paired.
const VERSION_TIMEOUT: Duration = Duration::from_secs(2);

/// The versions of `set`'s engines now, when `connector` compares them (none
/// otherwise): read through a transport of `config` on a small runtime of their own,
/// each within [`VERSION_TIMEOUT`], all at once.
///
/// # Errors
///
/// When the runtime cannot start.
pub(crate) fn versions_now(
    set: &disagg_core::endpoint::EndpointSet,
    connector: &dyn KvConnector,
    config: &HttpTransportConfig,
) -> Result<Versions, BoxError> {
    let mut versions = Versions::new();
    if !connector.equal_versions() {
        return Ok(versions);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let probe = VersionProbe::new(HttpTransport::new(config.clone()), VERSION_TIMEOUT);
        probe.probe(set, &mut versions).await;
    });
    Ok(versions)
}

/// The discovered, health-filtered, pair-checked endpoint set, its health, what the
/// pair check left out, and the thread its sources run on (it ends at `shutdown`).
pub(crate) struct Discovered {
    pub(crate) source: HealthSource,
    pub(crate) health: Arc<Health>,
    pub(crate) merged: Arc<MergedSource>,
    pub(crate) pairing: Arc<PairingStats>,
    pub(crate) thread: std::thread::JoinHandle<()>,
}

/// Start the sources `args` asks for on a thread of their own and build the chain over
/// them and `cli` (the `--prefill` / `--decode` endpoints).
pub(crate) fn start(
    args: &DiscoveryArgs,
    cli: Vec<Endpoint>,
    connector: Arc<dyn KvConnector>,
    health: HealthConfig,
    transport: HttpTransportConfig,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> Result<Discovered, BoxError> {
    let kubernetes = args.kubernetes()?;
    let dns = args.dns()?;
    let bounds = args.bounds();
    let file = args.endpoints_file.clone().map(|path| {
        let mut c = FileConfig::new(path);
        c.bounds = bounds;
        c
    });
    let sync = crate::serve::secs(args.discovery_sync_timeout, "discovery-sync-timeout")?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("disagg-discovery".into())
        .spawn(move || {
            runtime.block_on(async move {
                let chain = Chain {
                    connector,
                    health,
                    sync,
                    bounds,
                    transport,
                };
                let built = build(kubernetes, dns, file, cli, chain).await;
                let failed = built.is_err();
                if tx.send(built).is_err() || failed {
                    return;
                }
                // The sources' tasks run on this runtime until the proxy stops.
                let _ = shutdown.wait_for(|stop| *stop).await;
            });
            // Work stuck on the blocking pool never holds the process at exit.
            runtime.shutdown_timeout(crate::edge::RUNTIME_SHUTDOWN);
        })?;
    match rx.recv() {
        Ok(Ok((source, health, merged, pairing))) => Ok(Discovered {
            source,
            health,
            merged,
            pairing,
            thread,
        }),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => Err("the discovery thread ended before it started its sources".into()),
    }
}

type Built = (
    HealthSource,
    Arc<Health>,
    Arc<MergedSource>,
    Arc<PairingStats>,
);

/// What the chain over the sources is built with.
struct Chain {
    connector: Arc<dyn KvConnector>,
    health: HealthConfig,
    sync: Duration,
    bounds: Bounds,
    /// For the engines' `GET /version`.
    transport: HttpTransportConfig,
}

async fn build(
    kubernetes: Option<KubernetesConfig>,
    dns: Option<DnsConfig>,
    file: Option<FileConfig>,
    cli: Vec<Endpoint>,
    chain: Chain,
) -> Result<Built, BoxError> {
    let Chain {
        connector,
        health,
        sync,
        bounds,
        transport,
    } = chain;
    let mut merged = MergedSource::builder().endpoints(cli).bounds(bounds);
    if let Some(c) = kubernetes {
        merged = merged.source(kubernetes::spawn(c).await?);
    }
    if let Some(c) = dns {
        merged = merged.source(dns::spawn(c).await?);
    }
    if let Some(c) = file {
        merged = merged.source(file::spawn(c).await?);
    }
    let merged = Arc::new(merged.build());
    if tokio::time::timeout(sync, merged.synced()).await.is_err() {
        tracing::warn!(
            waited_secs = sync.as_secs_f64(),
            "not every discovery source has listed its endpoints yet; serving with what is known"
        );
    }
    let set = merged.snapshot();
    tracing::info!(
        prefill = set.by_role(Role::Prefill).len(),
        decode = set.by_role(Role::Decode).len(),
        encode = set.by_role(Role::Encode).len(),
        "endpoints discovered"
    );
    // The probe's transport runs on this runtime, as the sources do.
    let probe = VersionProbe::new(HttpTransport::new(transport), VERSION_TIMEOUT);
    let validated = ValidatedSource::with_versions(Arc::clone(&merged), connector, probe).await?;
    let pairing = validated.stats();
    let source = HealthSource::new(validated, health);
    let h = Arc::clone(source.health());
    Ok((source, h, merged, pairing))
}

/// `endpoints` with [`Facts::ENGINE_VERSION`](disagg_core::endpoint::Facts::ENGINE_VERSION)
/// set on each decode endpoint whose engine answered `GET /version` (read once per
/// engine, all at once, each within [`VERSION_TIMEOUT`], through a transport of
/// `config` on a small runtime of their own): what `--prompt-token-reuse auto` reads. An
/// engine that does not answer, or answers a version no fact can hold, keeps its facts
/// (reuse stays off for it), with a warning.
///
/// # Errors
///
/// When the runtime cannot start.
pub(crate) fn with_decode_versions(
    endpoints: Vec<Endpoint>,
    config: &HttpTransportConfig,
) -> Result<Vec<Endpoint>, BoxError> {
    use disagg_core::endpoint::Facts;
    use disagg_resilience::pairing::{VERSION_PATH, read_version};
    use std::collections::HashMap;

    let engine = |e: &Endpoint| e.uri(VERSION_PATH).ok().map(|u| u.to_string());
    let mut wanted: HashMap<String, usize> = HashMap::new();
    for (i, e) in endpoints.iter().enumerate() {
        if e.role() == Role::Decode
            && let Some(k) = engine(e)
        {
            wanted.entry(k).or_insert(i);
        }
    }
    if wanted.is_empty() {
        return Ok(endpoints);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let transport = HttpTransport::new(config.clone());
    let versions: HashMap<String, String> = runtime.block_on(async {
        let reads = wanted.iter().map(|(k, &i)| {
            let transport = &transport;
            let e = &endpoints[i];
            async move {
                match read_version(transport, e, VERSION_TIMEOUT).await {
                    Ok(v) => Some((k.clone(), v)),
                    Err(err) => {
                        tracing::warn!(
                            endpoint = %e.id(),
                            error = %disagg_core::error::error_chain(&err),
                            "decode engine version unknown: no prompt-token reuse for it"
                        );
                        None
                    }
                }
            }
        });
        futures::future::join_all(reads)
            .await
            .into_iter()
            .flatten()
            .collect()
    });
    Ok(endpoints
        .into_iter()
        .map(|e| {
            let Some(v) = engine(&e).and_then(|k| versions.get(&k)) else {
                return e;
            };
            let mut facts = e.facts().clone();
            match facts.insert(Facts::ENGINE_VERSION, v.clone()) {
                Ok(()) => {
                    tracing::info!(endpoint = %e.id(), version = %v, "decode engine version read");
                    e.with_facts(facts)
                }
                Err(err) => {
                    tracing::warn!(endpoint = %e.id(), error = %err, "decode engine version not kept");
                    e
                }
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        discovery: DiscoveryArgs,
    }

    fn args(flags: &[&str]) -> DiscoveryArgs {
        Cli::try_parse_from(std::iter::once("x").chain(flags.iter().copied()))
            .unwrap()
            .discovery
    }

    const SELECTOR: [&str; 2] = ["--k8s-decode-selector", "app=vllm"];

    /// The Kubernetes client's bounds, as flags, reach the config discovery starts with;
    /// without them, the library's defaults.
    #[test]
    fn k8s_bound_flags_reach_the_kubernetes_config() {
        let a = args(
            &[
                &SELECTOR[..],
                &[
                    "--k8s-read-timeout",
                    "400",
                    "--k8s-request-timeout",
                    "2.5",
                    "--k8s-max-response-bytes",
                    "8388608",
                    "--k8s-page-size",
                    "20",
                    "--max-dp-ranks",
                    "64",
                ],
            ]
            .concat(),
        );
        a.check_k8s_bounds().unwrap();
        let c = a.kubernetes().unwrap().expect("kubernetes discovery");
        // The rank ceiling every source applies reaches the pods' `dp-ranks` too.
        assert_eq!(c.max_ranks, 64);
        assert_eq!(c.read_timeout, Some(Duration::from_secs(400)));
        assert_eq!(c.request_timeout, Duration::from_millis(2500));
        assert_eq!(c.max_response_bytes, 8 << 20);
        assert_eq!(c.page_size, 20);

        let c = args(&SELECTOR).kubernetes().unwrap().expect("kubernetes");
        assert_eq!(c.read_timeout, None);
        assert_eq!(c.request_timeout, kubernetes::DEFAULT_REQUEST_TIMEOUT);
        assert_eq!(c.max_response_bytes, kubernetes::DEFAULT_MAX_RESPONSE_BYTES);
        assert_eq!(c.page_size, kubernetes::DEFAULT_PAGE_SIZE);
        // No selector, no Kubernetes discovery.
        assert!(args(&[]).kubernetes().unwrap().is_none());
    }

    /// 0, a value that is no duration, and values no API server needs are refused,
    /// naming the flag and what it takes.
    #[test]
    fn k8s_bound_flags_refuse_zero_and_absurd_values() {
        for (flag, value, says) in [
            ("--k8s-read-timeout", "0", "more than 0"),
            ("--k8s-read-timeout", "-1", "non-negative"),
            ("--k8s-read-timeout", "nan", "non-negative"),
            ("--k8s-read-timeout", "1e300", "too large"),
            ("--k8s-request-timeout", "0", "more than 0"),
            ("--k8s-request-timeout", "1e300", "too large"),
            ("--k8s-max-response-bytes", "0", "between"),
            ("--k8s-max-response-bytes", "1024", "between"),
            ("--k8s-max-response-bytes", "1099511627776", "between"),
            ("--k8s-page-size", "0", "between"),
            ("--k8s-page-size", "1000000", "between"),
        ] {
            let arg = format!("{flag}={value}");
            let a = args(&[&SELECTOR[..], &[&arg]].concat());
            let err = a.check_k8s_bounds().expect_err(&arg).to_string();
            assert!(err.contains(flag) && err.contains(says), "{arg}: {err}");
            assert!(a.kubernetes().is_err(), "{arg}");
        }
    }

    /// Like --k8s-namespace, the bounds are read only by Kubernetes discovery: given
    /// without a selector, refused rather than ignored.
    #[test]
    fn k8s_bound_flags_need_a_selector() {
        for flag in [
            "--k8s-read-timeout=10",
            "--k8s-request-timeout=10",
            "--k8s-max-response-bytes=8388608",
            "--k8s-page-size=10",
        ] {
            let err = args(&[flag]).check_needs().expect_err(flag).to_string();
            let name = flag.split('=').next().unwrap_or(flag);
            assert!(
                err.contains(name) && err.contains("read only by Kubernetes discovery"),
                "{flag}: {err}"
            );
            args(&[&SELECTOR[..], &[flag]].concat())
                .check_needs()
                .unwrap();
        }
    }
}
