//! Prefill, decode and encoder pods found by label selectors, watched through the
//! Kubernetes API with kube-rs's watcher and reflector (`--k8s-prefill-selector`,
//! `--k8s-decode-selector`, `--k8s-encode-selector`, `--k8s-namespace`, `--k8s-port`,
//! `--k8s-model-label`).
//!
//! # What makes an engine
//!
//! A pod matching a role's selector in the namespace is an engine of that role while
//! it is routable: `status.phase` is `Running`, its `Ready` condition is `True`, it is
//! not being deleted (no `metadata.deletionTimestamp`: a terminating pod finishes what
//! it has but takes nothing new, as a Service's endpoints do) and it has a
//! `status.podIP`. The engine is `http://POD_IP:PORT`, the port being
//! [`KubernetesConfig::port`]: a number, or the name of a container port; by default the
//! first port the pod's containers declare. A pod that turns not-ready or is deleted
//! leaves the set; the requests already sent to it finish.
//!
//! # Labels and annotations
//!
//! | key | kind | meaning |
//! |---|---|---|
//! | `model` ([`KubernetesConfig::model_label`]) | label | the model the engine serves |
//! | `disagg.io/models` | annotation | the models it serves, comma-separated (names a label value cannot hold, such as `meta-llama/Llama-3.1-8B`); wins over the label; at most 256 distinct names ([`MAX_MODELS_PER_ENGINE`](crate::spec::MAX_MODELS_PER_ENGINE)) of at most 512 bytes ([`MAX_MODEL_NAME_BYTES`](crate::spec::MAX_MODEL_NAME_BYTES)), duplicates counted once |
//! | `sglang.ai/bootstrap-port` | annotation | a prefill's bootstrap port (SGLang's gateway reads the same) |
//! | `vllm.ai/bootstrap-port` | annotation | the same, as vLLM's router names it (read when the SGLang one is absent) |
//! | `disagg.io/dp-ranks` | annotation | data-parallel ranks behind the pod's one server, `FIRST-LAST` or `N`: one endpoint per rank |
//! | `disagg.io/weight` | annotation | the engine's weight for weighted policies |
//! | `disagg.io/kv-connector` | annotation | the KV connector the engine runs (`NixlConnector`, ...) |
//! | `disagg.io/kv-role` | annotation | its `kv_role` (`kv_producer`, `kv_consumer`, `kv_both`) |
//! | `disagg.io/tp-size` | annotation | its tensor-parallel size |
//! | `disagg.io/ec-profile` | annotation | its encoder-output transfer (E/P/D), `CONNECTOR,ROLE` as `--ec-profile` (`ECExampleConnector,ec_producer`) |
//! | `disagg.io/lmcache-init-ports` | annotation | a decode's LMCache `pd_peer_init_port`s, comma-separated, one per TP rank (the host is the pod IP, an IPv6 one in brackets: `[fd00::7]:7300:7400`) |
//! | `disagg.io/lmcache-alloc-ports` | annotation | its `pd_peer_alloc_port`s, likewise |
//! | `disagg.io/kv-events` | annotation | its KV-events publisher: a port (`tcp://POD_IP:PORT`) or `tcp://HOST:PORT` |
//!
//! A pod whose annotations do not parse, or that has no port to use, is left out,
//! logged and counted as rejected ([`SourceStats::rejected`](crate::SourceStats::rejected)),
//! rather than routed with a guess.
//!
//! # Watching
//!
//! The watcher lists the pods (`labelSelector`), then watches from the list's
//! `resourceVersion` with bookmarks; a watch the server ends (its `timeoutSeconds`, a
//! dropped connection) resumes from the last version seen; an expired version (`410
//! Gone`) relists. Errors back off exponentially (kube-rs's default backoff, 0.8 s to
//! 30 s) and are counted ([`SourceStats::errors`](crate::SourceStats::errors)); the
//! reflector's store keeps the last good pods meanwhile, and a relist replaces them only
//! once it is complete. A watch the server ends within 5 s of its request (or half its
//! `timeoutSeconds`, if less) right after another did (a gateway closing each watch at
//! once) is an error too, counted and backed off as one, rather than reopened at once
//! without end; a lone one (a server restarting) is reopened at once, and a longer watch
//! or a list starts the count over. The source publishes its first list once every
//! selector's first list is complete; so that a selector the API server refuses (`400
//! Bad Request`, on every retry) cannot hold back the other roles' pods, every selector
//! is checked against Kubernetes' label-selector syntax at start ([`spawn`],
//! [`KubernetesError::Selector`]).
//!
//! No request waits for ever: [`spawn`]'s client gives up a connection on which the API
//! server sends nothing for [`KubernetesConfig::read_timeout`] (a half-open connection:
//! an API server gone without a reset, a load balancer that failed over), ends a list
//! page that takes longer than [`KubernetesConfig::request_timeout`], its body included,
//! and refuses a list page or a watch event larger than
//! [`KubernetesConfig::max_response_bytes`], or holding more than 4,096 JSON objects or
//! 16,384 JSON values (array elements, object members) for each pod of a page, the page
//! counted as at least 16 pods (a smaller page lowers them no further), before reading
//! more; each is an error as above, retried with backoff. Pods are decoded into the
//! fields discovery reads ([`EnginePod`]), the rest skipped unread (but for what
//! kube-rs buffers: `bounds.rs`); bytes do not bound what that makes: `{}` is a pod of
//! 456 bytes, `"k":"v",` a label of about 160 (a lone one a B-tree leaf of 544, needing
//! a pod and metadata). The counts bound it per page or watch event, not per process (a
//! relist keeps clones beside the store): a default page of 100 holds at worst 0.47 GB,
//! peaking at 0.52 (an escaped string's scratch copy), one of 16 0.13 and 0.19 GB, its
//! text besides. Lists ask for [`KubernetesConfig::page_size`] pods a page.
//!
//! # Ceilings on the pods
//!
//! One selector holds at most twice [`KubernetesConfig::max_endpoints`] pods (8,192 by
//! default): a list past it is given up at the first pod past it, and so is a watch
//! event adding a pod to a selector that holds as many; the selector relists after a
//! backoff (0.8 s, doubling to 30 s across lists taken, starting over after 2 minutes
//! without a refusal), keeping its last good pods meanwhile, and each
//! refusal is logged and counted ([`SourceStats::over_limit`](crate::SourceStats::over_limit),
//! an error too). Pods making more endpoints than `max_endpoints`, ranks counted, are not
//! published (specs are made up to the first endpoint past it): the last good list
//! stays, the refusal logged and counted once until a list within it is published.
//! Before that, a pod with more data-parallel ranks than [`KubernetesConfig::max_ranks`],
//! or a rank not below it, is left out alone (logged, counted as rejected): its ranks
//! never count toward `max_endpoints`.

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use disagg_core::Role;
use disagg_core::endpoint::Facts;
use disagg_pairing::KvProfile;
use futures::{FutureExt, StreamExt};
use kube::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;

use crate::source::{SpecPublisher, SpecSource};
use crate::spec::{EndpointSpec, Ranks, lmcache_receiver, model_names, parse_kv_role, parse_tp};

mod bounds;
mod held;
mod pace;
mod pod;
mod selector;
pub use pod::{
    EngineContainer, EngineContainerPort, EnginePod, EnginePodCondition, EnginePodSpec,
    EnginePodStatus,
};

/// The default source name of Kubernetes discovery (the `source` label of its metrics).
pub const SOURCE_NAME: &str = "kubernetes";
/// The label holding a pod's model, unless configured otherwise (production-stack's).
pub const DEFAULT_MODEL_LABEL: &str = "model";

/// [`KubernetesConfig::request_timeout`] by default: the API server's own limit on a
/// request (`--request-timeout`, 60 s by default), and a margin.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(90);
/// How much longer than the server's end of a watch the read timeout is by default.
const READ_TIMEOUT_MARGIN: Duration = Duration::from_secs(30);
/// [`KubernetesConfig::max_response_bytes`] by default: 64 MiB, room for a page of
/// [`DEFAULT_PAGE_SIZE`] pods of 640 KiB each (a pod's annotations alone may hold
/// 256 KiB; a whole object, 1.5 MiB in etcd by default).
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 64 * 1024 * 1024;
/// [`KubernetesConfig::page_size`] by default.
pub const DEFAULT_PAGE_SIZE: u32 = 100;

/// SGLang's bootstrap-port annotation (sgl-project/sglang
/// `sgl-model-gateway/src/service_discovery.rs`, `bootstrap_port_annotation`).
pub const SGLANG_BOOTSTRAP_PORT: &str = "sglang.ai/bootstrap-port";
/// vLLM router's bootstrap-port annotation.
pub const VLLM_BOOTSTRAP_PORT: &str = "vllm.ai/bootstrap-port";
/// The models a pod serves, comma-separated; wins over the model label. A list past
/// [`MAX_MODELS_PER_ENGINE`](crate::spec::MAX_MODELS_PER_ENGINE) distinct names, or
/// with a name past [`MAX_MODEL_NAME_BYTES`](crate::spec::MAX_MODEL_NAME_BYTES),
/// leaves the pod out.
pub const MODELS: &str = "disagg.io/models";
/// The data-parallel ranks behind the pod's server: `FIRST-LAST` or `N`.
pub const DP_RANKS: &str = "disagg.io/dp-ranks";
/// The engine's weight for weighted policies.
pub const WEIGHT: &str = "disagg.io/weight";
/// The engine's KV connector.
pub const KV_CONNECTOR: &str = "disagg.io/kv-connector";
/// The engine's `kv_role`.
pub const KV_ROLE: &str = "disagg.io/kv-role";
/// The engine's encoder-output transfer (E/P/D): `CONNECTOR,ROLE`, as `--ec-profile`.
pub const EC_PROFILE: &str = "disagg.io/ec-profile";
/// The engine's tensor-parallel size.
pub const TP_SIZE: &str = "disagg.io/tp-size";
/// A decode's LMCache init ports, comma-separated, one per TP rank.
pub const LMCACHE_INIT_PORTS: &str = "disagg.io/lmcache-init-ports";
/// A decode's LMCache alloc ports, comma-separated, one per TP rank.
pub const LMCACHE_ALLOC_PORTS: &str = "disagg.io/lmcache-alloc-ports";
/// The engine's KV-events publisher: a port on the pod, or `tcp://HOST:PORT`.
pub const KV_EVENTS: &str = "disagg.io/kv-events";
/// The engine's version as its `GET /version` says it (`0.33.0`): the
/// `engine_version` fact (`Facts::ENGINE_VERSION`), which `--prompt-token-reuse auto`
/// reads for a decode (discovered engines are not asked their version at start).
pub const ENGINE_VERSION: &str = "disagg.io/engine-version";

/// The engines' HTTP port on their pods: a number, or a container port's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortRef {
    /// This port number.
    Number(u16),
    /// The container port of this name (`ports[].name`).
    Name(String),
}

impl FromStr for PortRef {
    type Err = std::convert::Infallible;

    /// A number is a port number; anything else a port name.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.trim().parse() {
            Ok(n) => PortRef::Number(n),
            Err(_) => PortRef::Name(s.trim().to_owned()),
        })
    }
}

/// Where the API server's address and credentials come from.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub enum ClientConfig {
    /// `KUBECONFIG` (or `~/.kube/config`) when set, else the in-cluster service account
    /// (kube-rs's `Config::infer`).
    #[default]
    Infer,
    /// This kubeconfig file, its current context.
    Kubeconfig(PathBuf),
}

/// Kubernetes discovery settings.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct KubernetesConfig {
    /// The label selector of prefill pods (`app=vllm,role=prefill`); `None`: none.
    pub prefill_selector: Option<String>,
    /// The label selector of decode pods; `None`: none.
    pub decode_selector: Option<String>,
    /// The label selector of encoder-only pods (E/P/D: `app=vllm,role=encode`); `None`:
    /// none. Set it after [`new`](Self::new).
    pub encode_selector: Option<String>,
    /// The namespace to watch; `None`: in a cluster, the pod's own (its service
    /// account's `/var/run/secrets/kubernetes.io/serviceaccount/namespace`); with a
    /// kubeconfig, its context's namespace; else `default`.
    pub namespace: Option<String>,
    /// The engines' HTTP port; `None`: the first container port the pod declares.
    pub port: Option<PortRef>,
    /// The label holding a pod's model ([`DEFAULT_MODEL_LABEL`] by default).
    pub model_label: String,
    /// Where the API server's address and credentials come from.
    pub client: ClientConfig,
    /// The `timeoutSeconds` of each watch request (the server ends the watch then and
    /// the watcher resumes it); `None`: kube-rs's 290 s.
    pub watch_timeout: Option<u32>,
    /// How long a request may wait for the API server's next bytes (kube-rs's
    /// `Config::read_timeout`, counted from the request's last write): past it the
    /// connection is given up and the request fails (logged, counted, retried with
    /// backoff). This is what ends a request on a half-open connection (an API server
    /// gone without a reset, a load balancer that failed over). `None`: 30 s more than
    /// the watch timeout ([`watch_timeout`](Self::watch_timeout); 320 s with kube-rs's
    /// 290 s; with `Some(0)`, which leaves a watch's length to the API server, 3,630 s,
    /// its longest watch by default): a watch that stays silent to its end is never cut.
    /// A shorter one cuts a silent watch, which then resumes from its version (counted
    /// as an error). Not used by [`spawn_with_client`].
    pub read_timeout: Option<Duration>,
    /// The longest a list request may take, its whole body included, and a watch
    /// request until its response headers (a watch's events are bounded by
    /// [`read_timeout`](Self::read_timeout) and the watch timeout instead):
    /// [`DEFAULT_REQUEST_TIMEOUT`] by default. Not used by [`spawn_with_client`].
    pub request_timeout: Duration,
    /// The most bytes taken from the API server for a list response's body, and for one
    /// event of a watch (a line of its stream): a response or an event past it fails
    /// the request (logged, counted, retried with backoff) before more is read.
    /// [`DEFAULT_MAX_RESPONSE_BYTES`] by default. Not used by [`spawn_with_client`].
    pub max_response_bytes: usize,
    /// The pods asked for in one list page (`limit`; at least 1):
    /// [`DEFAULT_PAGE_SIZE`] by default, so that a page of large pods stays well under
    /// [`max_response_bytes`](Self::max_response_bytes). A page or a watch event may hold
    /// 4,096 JSON objects and 16,384 values for each pod of a page, at least 16 pods'.
    pub page_size: u32,
    /// The most endpoints the source publishes, every rank counted
    /// (`--max-endpoints-per-source`, 4,096 by default,
    /// [`DEFAULT_MAX_ENDPOINTS_PER_SOURCE`](crate::DEFAULT_MAX_ENDPOINTS_PER_SOURCE)):
    /// pods making more are not published, the last good list staying; and one
    /// selector holds at most twice as many pods, a list or watch past that refused
    /// (see [Ceilings on the pods](self#ceilings-on-the-pods)). Give it the
    /// [`MergedSource`](crate::MergedSource)'s `Bounds::max_endpoints`.
    pub max_endpoints: usize,
    /// The most data-parallel ranks one pod may have, each rank below it
    /// (`--max-dp-ranks`, 1,024 by default,
    /// [`DEFAULT_MAX_DP_RANKS`](crate::DEFAULT_MAX_DP_RANKS)): a pod whose
    /// [`DP_RANKS`] annotation passes it is left out, logged and counted as rejected,
    /// before its ranks count toward [`max_endpoints`](Self::max_endpoints). Give it the
    /// [`MergedSource`](crate::MergedSource)'s `Bounds::max_ranks`.
    pub max_ranks: u32,
    /// The source's name in metrics and logs ([`SOURCE_NAME`] by default).
    pub name: String,
}

impl KubernetesConfig {
    /// Prefill pods matching `prefill_selector` and decode pods matching
    /// `decode_selector`, everything else by default.
    pub fn new(prefill_selector: Option<String>, decode_selector: Option<String>) -> Self {
        KubernetesConfig {
            prefill_selector,
            decode_selector,
            encode_selector: None,
            namespace: None,
            port: None,
            model_label: DEFAULT_MODEL_LABEL.to_owned(),
            client: ClientConfig::Infer,
            watch_timeout: None,
            read_timeout: None,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            page_size: DEFAULT_PAGE_SIZE,
            max_endpoints: crate::DEFAULT_MAX_ENDPOINTS_PER_SOURCE,
            max_ranks: crate::DEFAULT_MAX_DP_RANKS,
            name: SOURCE_NAME.to_owned(),
        }
    }
}

/// Kubernetes discovery could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KubernetesError {
    /// No selector is set.
    #[error("kubernetes discovery needs a prefill, decode or encode label selector")]
    NoSelector,
    /// No kubeconfig and no in-cluster service account.
    #[error("no kubernetes configuration (KUBECONFIG, ~/.kube/config or in-cluster)")]
    Infer(#[source] kube::config::InferConfigError),
    /// The kubeconfig file could not be used.
    #[error("cannot use the kubeconfig")]
    Kubeconfig(#[source] kube::config::KubeconfigError),
    /// The client could not be built.
    #[error("cannot build the kubernetes client")]
    Client(#[source] kube::Error),
    /// A label selector is not of Kubernetes' label-selector syntax: the API server
    /// would answer every list of it `400 Bad Request`, and the other roles' pods would
    /// never be published either (the source publishes once every selector has listed).
    #[error("the {role} label selector `{selector}` is invalid: {reason}")]
    Selector {
        /// The role it selects.
        role: Role,
        /// The selector.
        selector: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// Connects to the API server as `config` says and starts watching the pods.
///
/// The source publishes once every selector's first list is complete
/// ([`SpecSource::synced`]).
///
/// # Errors
///
/// [`KubernetesError`] when no selector is set, a selector is not of Kubernetes'
/// label-selector syntax ([`KubernetesError::Selector`], checked before the client is
/// configured) or the client cannot be configured. An API server that does not answer
/// is no error: the watcher retries with backoff.
///
/// # Panics
///
/// When called outside a tokio runtime.
pub async fn spawn(config: KubernetesConfig) -> Result<SpecSource, KubernetesError> {
    check_selectors(&config)?;
    let kube_config = match &config.client {
        ClientConfig::Infer => kube::Config::infer()
            .await
            .map_err(KubernetesError::Infer)?,
        ClientConfig::Kubeconfig(path) => {
            let file =
                kube::config::Kubeconfig::read_from(path).map_err(KubernetesError::Kubeconfig)?;
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(KubernetesError::Kubeconfig)?
        }
    };
    let client = bounded_client(kube_config, &config)?;
    spawn_with_client(client, config)
}

/// The watch timeout the API server ends each watch at: [`KubernetesConfig::watch_timeout`],
/// else kube-rs's; `0` leaves it to the server, whose longest is twice its
/// `--min-request-timeout` (1,800 s by default).
fn server_watch_timeout(config: &KubernetesConfig) -> Duration {
    match config.watch_timeout {
        None => Duration::from_secs(290),
        Some(0) => Duration::from_secs(3600),
        Some(t) => Duration::from_secs(u64::from(t)),
    }
}

/// kube-rs's client for `kube_config`, within `config`'s read timeout, request timeout
/// and byte ceiling.
fn bounded_client(
    mut kube_config: kube::Config,
    config: &KubernetesConfig,
) -> Result<kube::Client, KubernetesError> {
    // A read timeout past the server's end of a silent watch never cuts a healthy one;
    // kube-rs's own default is none, so a half-open connection would be waited on for
    // ever. Counted from the request's last write, not from when its pooled connection
    // went idle.
    kube_config.read_timeout = Some(
        config
            .read_timeout
            .unwrap_or_else(|| server_watch_timeout(config) + READ_TIMEOUT_MARGIN),
    );
    kube_config.reset_reader_on_write = true;
    let bounds = bounds::Bounds {
        request_timeout: config.request_timeout,
        max_bytes: config.max_response_bytes,
        max_objects: bounds::max_objects(config.page_size),
        max_values: bounds::max_values(config.page_size),
    };
    Ok(kube::client::ClientBuilder::try_from(kube_config)
        .map_err(KubernetesError::Client)?
        .with_layer(&bounds)
        .build())
}

/// Like [`spawn`], with a client the embedder built (its own credentials, timeouts or
/// middleware); [`KubernetesConfig::client`], [`read_timeout`](KubernetesConfig::read_timeout),
/// [`request_timeout`](KubernetesConfig::request_timeout) and
/// [`max_response_bytes`](KubernetesConfig::max_response_bytes) are not used: the client's
/// own bounds apply (kube-rs's default client has no read timeout and no byte ceiling).
/// Its watches are paced as [`spawn`]'s are (see [Watching](self#watching)).
///
/// # Errors
///
/// [`KubernetesError::NoSelector`] when no selector is set,
/// [`KubernetesError::Selector`] when one is not of Kubernetes' label-selector syntax.
///
/// # Panics
///
/// When called outside a tokio runtime.
pub fn spawn_with_client(
    client: kube::Client,
    config: KubernetesConfig,
) -> Result<SpecSource, KubernetesError> {
    check_selectors(&config)?;
    // The client's default namespace is the pod's own in a cluster (kube-rs reads the
    // service account's namespace file), the kubeconfig context's otherwise, else
    // `default`.
    let namespace = config
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_owned());
    let mut watched = Vec::new();
    let mut streams = Vec::new();
    for (role, selector) in [
        (Role::Prefill, &config.prefill_selector),
        (Role::Decode, &config.decode_selector),
        (Role::Encode, &config.encode_selector),
    ] {
        let Some(selector) = selector else { continue };
        let mut wc = watcher::Config::default()
            .labels(selector)
            .page_size(config.page_size.max(1));
        if let Some(t) = config.watch_timeout {
            wc = wc.timeout(t);
        }
        let (reader, writer) = reflector::store();
        let index = watched.len();
        // Each selector's own client: its watches paced apart from the others'.
        let api = Api::namespaced(pace::paced(client.clone()), &namespace);
        streams.push(
            held::pod_events(api, wc, held::max_pods(&config), reader.clone(), writer)
                .map(move |event| (index, event))
                .boxed(),
        );
        watched.push(Watched {
            role,
            selector: selector.clone(),
            store: reader,
            listed: false,
        });
    }
    tracing::info!(%namespace, "watching pods for engines");
    let (publisher, source) = SpecSource::channel(config.name.as_str());
    let task = tokio::spawn(run(
        config,
        publisher,
        watched,
        futures::stream::select_all(streams),
    ));
    Ok(source.with_task(task))
}

/// Checks that `config` has a selector and that each is of Kubernetes' label-selector
/// syntax ([`selector::check_selector`]).
fn check_selectors(config: &KubernetesConfig) -> Result<(), KubernetesError> {
    let selectors = [
        (Role::Prefill, &config.prefill_selector),
        (Role::Decode, &config.decode_selector),
        (Role::Encode, &config.encode_selector),
    ];
    if selectors.iter().all(|(_, s)| s.is_none()) {
        return Err(KubernetesError::NoSelector);
    }
    for (role, selector) in selectors {
        if let Some(selector) = selector {
            selector::check_selector(selector).map_err(|reason| KubernetesError::Selector {
                role,
                selector: selector.clone(),
                reason,
            })?;
        }
    }
    Ok(())
}

/// Every selector's watch events, tagged with the index of its [`Watched`].
type PodEvents = futures::stream::SelectAll<
    futures::stream::BoxStream<'static, (usize, Result<watcher::Event<EnginePod>, watcher::Error>)>,
>;

/// One role's watch.
struct Watched {
    role: Role,
    selector: String,
    store: Store<EnginePod>,
    /// Whether its first list is complete.
    listed: bool,
}

/// The most events taken together before one publish ([`run`]): a steady flood of
/// events still publishes between them.
const COALESCED_EVENTS: usize = 1024;

async fn run(
    config: KubernetesConfig,
    publisher: SpecPublisher,
    mut watched: Vec<Watched>,
    mut events: PodEvents,
) {
    let mut rejected: HashSet<(Role, String, String)> = HashSet::new();
    // Whether the pods make more endpoints than the ceiling now (refused once).
    let mut over = false;
    while let Some((index, event)) = events.next().await {
        if publisher.is_closed() {
            return;
        }
        let mut changed = take(&mut watched, &publisher, index, event);
        // The events already queued (a burst of changes, a watch's replay) are taken
        // before the pods are published once: specs are made for every pod each time.
        for _ in 0..COALESCED_EVENTS {
            let Some(Some((index, event))) = events.next().now_or_never() else {
                break;
            };
            changed |= take(&mut watched, &publisher, index, event);
        }
        if changed && watched.iter().all(|w| w.listed) {
            publish(&config, &publisher, &watched, &mut rejected, &mut over);
        }
    }
}

/// Takes one event of `watched[index]`'s watch (its store already holds what it
/// changed); logs and counts an error. Whether the pods may have changed.
fn take(
    watched: &mut [Watched],
    publisher: &SpecPublisher,
    index: usize,
    event: Result<watcher::Event<EnginePod>, watcher::Error>,
) -> bool {
    match event {
        Ok(watcher::Event::InitDone) => {
            watched[index].listed = true;
            true
        }
        Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_)) => true,
        // A list in progress: the store swaps it in at InitDone.
        Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => false,
        Err(watcher::Error::WatchError(status)) if status.code == 410 => {
            // Expected: the server no longer has the version the watch resumed
            // from. The watcher relists; the store keeps the pods until then.
            tracing::debug!(selector = %watched[index].selector, "watch expired (410 Gone); relisting");
            false
        }
        Err(e) => {
            let selector = &watched[index].selector;
            match held::refused(&e) {
                Some(why @ held::Refused::TooManyPods(_)) => {
                    tracing::warn!(%selector, error = %why, "kubernetes pods refused: over the ceiling");
                    publisher.record_over_limit();
                }
                _ => {
                    tracing::warn!(%selector, error = %e, "kubernetes watch failed; keeping the last good pods and retrying");
                    publisher.record_error();
                }
            }
            false
        }
    }
}

/// Publishes the routable pods of every role; logs and counts pods newly rejected.
/// Pods making more endpoints than [`KubernetesConfig::max_endpoints`] (counted as
/// their specs are made, which stops at the first past it) publish nothing: the last
/// good list stays, the refusal logged and counted once until a list is published.
fn publish(
    config: &KubernetesConfig,
    publisher: &SpecPublisher,
    watched: &[Watched],
    rejected: &mut HashSet<(Role, String, String)>,
    over: &mut bool,
) {
    let mut specs = Vec::new();
    let mut endpoints = 0u64;
    let mut now_rejected = HashSet::new();
    for w in watched {
        for pod in w.store.state() {
            match pod_spec(&pod, w.role, config) {
                Ok(Some(spec)) => {
                    endpoints = endpoints.saturating_add(spec.endpoint_count());
                    if endpoints > config.max_endpoints as u64 {
                        if !*over {
                            tracing::warn!(
                                max = config.max_endpoints,
                                "kubernetes pods refused: more endpoints than the ceiling per source (--max-endpoints-per-source); keeping the last good endpoints"
                            );
                            publisher.record_over_limit();
                            *over = true;
                        }
                        return;
                    }
                    specs.push(spec);
                }
                Ok(None) => {}
                Err(why) => {
                    let name = pod.metadata.name.clone().unwrap_or_default();
                    let key = (w.role, name, why);
                    if !rejected.contains(&key) {
                        tracing::warn!(pod = %key.1, role = ?w.role, reason = %key.2, "pod left out");
                        publisher.record_rejected(1);
                    }
                    now_rejected.insert(key);
                }
            }
        }
    }
    *rejected = now_rejected;
    *over = false;
    publisher.publish(specs);
}

/// The engine a pod stands for: `Ok(None)` while it is not routable, `Err` (the reason)
/// when its description is unusable.
///
/// # Errors
///
/// The reason, when the pod has no port to use or an annotation does not parse.
pub fn pod_spec(
    pod: &EnginePod,
    role: Role,
    config: &KubernetesConfig,
) -> Result<Option<EndpointSpec>, String> {
    let Some(ip) = routable_ip(pod) else {
        return Ok(None);
    };
    let port = pod_port(pod, config.port.as_ref())?;
    let url = match ip {
        IpAddr::V4(v4) => format!("http://{v4}:{port}"),
        IpAddr::V6(v6) => format!("http://[{v6}]:{port}"),
    };
    let empty = BTreeMap::new();
    let annotations = pod.metadata.annotations.as_ref().unwrap_or(&empty);
    let labels = pod.metadata.labels.as_ref().unwrap_or(&empty);
    let get = |key: &str| {
        annotations
            .get(key)
            .map(|v| v.trim())
            .filter(|v| !v.is_empty())
    };
    let bad = |key: &str, why: &dyn std::fmt::Display| format!("annotation {key}: {why}");

    let mut spec = EndpointSpec::new(url, role);
    // Held to the ceilings name by name, before any is kept (an annotation may hold
    // 256 KiB of names); duplicates collapse to one.
    spec.models = match get(MODELS) {
        Some(list) => model_names(list.split(',').map(str::trim).filter(|m| !m.is_empty()))
            .map_err(|e| bad(MODELS, &e))?,
        None => model_names(
            labels
                .get(&config.model_label)
                .map(String::as_str)
                .filter(|m| !m.is_empty()),
        )
        .map_err(|e| format!("label {}: {e}", config.model_label))?,
    };
    if role == Role::Prefill {
        for key in [SGLANG_BOOTSTRAP_PORT, VLLM_BOOTSTRAP_PORT] {
            if let Some(v) = get(key) {
                let port: u16 = v.parse().map_err(|_| bad(key, &"not a port number"))?;
                spec.facts
                    .insert(Facts::BOOTSTRAP_PORT, port.to_string())
                    .map_err(|e| bad(key, &e))?;
                break;
            }
        }
    }
    if let Some(version) = get(ENGINE_VERSION) {
        if !version
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'+' | b'_'))
        {
            return Err(bad(
                ENGINE_VERSION,
                &"not a version (digits, letters, . - + _)",
            ));
        }
        spec.facts
            .insert(Facts::ENGINE_VERSION, version)
            .map_err(|e| bad(ENGINE_VERSION, &e))?;
    }
    if let Some(v) = get(DP_RANKS) {
        // Held to the rank ceiling here, so that one pod's ranks cannot count toward
        // the endpoint ceiling and hold back every other pod's changes.
        let ranks = v.parse::<Ranks>().and_then(|r| r.within(config.max_ranks));
        spec.ranks = Some(ranks.map_err(|e| bad(DP_RANKS, &e))?);
    }
    if let Some(v) = get(WEIGHT) {
        let w: f64 = v.parse().map_err(|_| bad(WEIGHT, &"not a number"))?;
        if !(w.is_finite() && w > 0.0) {
            return Err(bad(WEIGHT, &"not a positive number"));
        }
        spec.weight = Some(w);
    }
    let profile = KvProfile {
        connector: get(KV_CONNECTOR).map(str::to_owned),
        role: get(KV_ROLE)
            .map(parse_kv_role)
            .transpose()
            .map_err(|e| bad(KV_ROLE, &e))?,
        tp_size: get(TP_SIZE)
            .map(parse_tp)
            .transpose()
            .map_err(|e| bad(TP_SIZE, &e))?,
    };
    if profile != KvProfile::default() {
        spec.kv_profile = Some(profile);
    }
    if let Some(v) = get(EC_PROFILE) {
        let ec = v
            .parse::<disagg_pairing::EcProfile>()
            .map_err(|e| bad(EC_PROFILE, &e))?;
        spec.ec_profile = Some(ec);
    }
    match (get(LMCACHE_INIT_PORTS), get(LMCACHE_ALLOC_PORTS)) {
        (None, None) => {}
        (Some(init), Some(alloc)) if role == Role::Decode => {
            let keys = format!("{LMCACHE_INIT_PORTS} and {LMCACHE_ALLOC_PORTS}");
            // An IPv6 host in brackets, as the file writes it: the one form whose port
            // lists cannot be read as part of the address.
            let host = match ip {
                IpAddr::V4(v4) => v4.to_string(),
                IpAddr::V6(v6) => format!("[{v6}]"),
            };
            let receiver = lmcache_receiver(&host, init, alloc).map_err(|e| bad(&keys, &e))?;
            spec.facts
                .insert(Facts::KV_RECEIVER, receiver)
                .map_err(|e| bad(&keys, &e))?;
        }
        (Some(_), Some(_)) => {
            return Err(format!(
                "annotations {LMCACHE_INIT_PORTS} and {LMCACHE_ALLOC_PORTS} apply to decode pods only"
            ));
        }
        _ => {
            return Err(format!(
                "annotations {LMCACHE_INIT_PORTS} and {LMCACHE_ALLOC_PORTS} go together"
            ));
        }
    }
    if let Some(v) = get(KV_EVENTS) {
        spec.kv_events = Some(if v.starts_with("tcp://") {
            v.to_owned()
        } else {
            let port: u16 = v
                .parse()
                .map_err(|_| bad(KV_EVENTS, &"neither a port nor tcp://HOST:PORT"))?;
            match ip {
                IpAddr::V4(v4) => format!("tcp://{v4}:{port}"),
                IpAddr::V6(v6) => format!("tcp://[{v6}]:{port}"),
            }
        });
    }
    // What would make no endpoint is refused here, with the pod's name in the log.
    spec.extensions().map_err(|e| e.to_string())?;
    Ok(Some(spec))
}

/// The pod's IP while it is routable: Running, Ready, not being deleted.
fn routable_ip(pod: &EnginePod) -> Option<IpAddr> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() != Some("Running") {
        return None;
    }
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready {
        return None;
    }
    status.pod_ip.as_deref()?.parse().ok()
}

/// The port to use on `pod`.
fn pod_port(pod: &EnginePod, port: Option<&PortRef>) -> Result<u16, String> {
    let declared = || {
        pod.spec
            .iter()
            .flat_map(|s| &s.containers)
            .flat_map(|c| c.ports.iter().flatten())
    };
    let number = |n: i32| u16::try_from(n).map_err(|_| format!("container port {n} is not a port"));
    match port {
        Some(PortRef::Number(n)) => Ok(*n),
        Some(PortRef::Name(name)) => declared()
            .find(|p| p.name.as_deref() == Some(name.as_str()))
            .ok_or_else(|| format!("no container port named `{name}`"))
            .and_then(|p| number(p.container_port)),
        None => declared()
            .next()
            .ok_or_else(|| "no container port declared (set the port to use)".to_owned())
            .and_then(|p| number(p.container_port)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ready: bool, annotations: &[(&str, &str)]) -> EnginePod {
        let annotations: BTreeMap<&str, &str> = annotations.iter().copied().collect();
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "labels": {"model": "llama"}, "annotations": annotations},
            "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 8100}]}]},
            "status": {
                "phase": "Running",
                "podIP": "10.1.2.3",
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
            },
        }))
        .unwrap()
    }

    fn config() -> KubernetesConfig {
        KubernetesConfig::new(Some("role=prefill".into()), None)
    }

    #[test]
    fn a_ready_pod_is_an_engine_with_its_annotations() {
        let pod = pod(
            true,
            &[
                (VLLM_BOOTSTRAP_PORT, "8998"),
                (DP_RANKS, "0-1"),
                (KV_CONNECTOR, "NixlConnector"),
                (TP_SIZE, "2"),
                (KV_EVENTS, "5557"),
                (WEIGHT, "3"),
                (ENGINE_VERSION, "0.33.0"),
            ],
        );
        let spec = pod_spec(&pod, Role::Prefill, &config()).unwrap().unwrap();
        assert_eq!(spec.facts.get(Facts::ENGINE_VERSION), Some("0.33.0"));
        assert_eq!(spec.url, "http://10.1.2.3:8100");
        assert_eq!(spec.models, ["llama"]);
        assert_eq!(spec.facts.get(Facts::BOOTSTRAP_PORT), Some("8998"));
        assert_eq!(spec.ranks, Some(Ranks::new(0, 1).unwrap()));
        assert_eq!(spec.kv_profile.as_ref().unwrap().tp_size, Some(2));
        assert_eq!(spec.kv_events.as_deref(), Some("tcp://10.1.2.3:5557"));
        assert_eq!(spec.weight, Some(3.0));
    }

    #[test]
    fn a_pod_at_a_metadata_ip_makes_no_endpoint_one_with_too_many_ranks_is_left_out_and_its_weight_is_read()
     {
        let bounds = crate::Bounds::default();
        let mut metadata = pod(true, &[]);
        if let Some(status) = metadata.status.as_mut() {
            status.pod_ip = Some("169.254.169.254".into());
        }
        let spec = pod_spec(&metadata, Role::Prefill, &config())
            .unwrap()
            .unwrap();
        assert!(matches!(
            spec.to_endpoints_within(&bounds),
            Err(crate::SpecError::Url(_))
        ));
        // Ranks past the ceiling (or a rank not below it) leave the pod out: refused
        // before they count toward the endpoint ceiling.
        for ranks in ["0-4294967295", "0-9999", "1024", "0-1024"] {
            let huge = pod(true, &[(DP_RANKS, ranks)]);
            let err = pod_spec(&huge, Role::Prefill, &config()).unwrap_err();
            assert!(err.contains(DP_RANKS) && err.contains("1024"), "{err}");
        }
        let mut lower = config();
        lower.max_ranks = 2;
        assert!(pod_spec(&pod(true, &[(DP_RANKS, "0-2")]), Role::Prefill, &lower).is_err());
        let most = pod(true, &[(DP_RANKS, "0-1023")]);
        let spec = pod_spec(&most, Role::Prefill, &config()).unwrap().unwrap();
        assert_eq!(spec.endpoint_count(), 1024);
        let weighed = pod(true, &[(DP_RANKS, "0-1"), (WEIGHT, "3")]);
        let spec = pod_spec(&weighed, Role::Prefill, &config())
            .unwrap()
            .unwrap();
        let eps = spec.to_endpoints_within(&bounds).unwrap();
        assert!(eps.len() == 2 && eps.iter().all(|e| e.weight() == 3.0));
    }

    #[test]
    fn the_sglang_annotation_wins_and_models_annotation_beats_the_label() {
        let pod = pod(
            true,
            &[
                (SGLANG_BOOTSTRAP_PORT, "9000"),
                (VLLM_BOOTSTRAP_PORT, "8998"),
                (MODELS, "meta-llama/Llama-3.1-8B, llama"),
            ],
        );
        let spec = pod_spec(&pod, Role::Prefill, &config()).unwrap().unwrap();
        assert_eq!(spec.facts.get(Facts::BOOTSTRAP_PORT), Some("9000"));
        assert_eq!(spec.models, ["meta-llama/Llama-3.1-8B", "llama"]);
    }

    #[test]
    fn a_models_annotation_past_its_ceilings_leaves_the_pod_out() {
        use crate::spec::{MAX_MODEL_NAME_BYTES, MAX_MODELS_PER_ENGINE};
        // 257 distinct names: one past the ceiling.
        let many = (0..=MAX_MODELS_PER_ENGINE)
            .map(|i| format!("m{i}"))
            .collect::<Vec<_>>()
            .join(",");
        let p = pod(true, &[(MODELS, &many), (DP_RANKS, "0-1023")]);
        let err = pod_spec(&p, Role::Decode, &config()).unwrap_err();
        assert!(err.contains(MODELS) && err.contains("256"), "{err}");
        // One name past 512 bytes.
        let long = format!("llama,{}", "x".repeat(MAX_MODEL_NAME_BYTES + 1));
        let err = pod_spec(&pod(true, &[(MODELS, &long)]), Role::Decode, &config()).unwrap_err();
        assert!(err.contains(MODELS) && err.contains("512"), "{err}");
        // 256 KiB of one repeated name (the annotations' own limit in Kubernetes) on
        // 1,024 ranks: one name, one allocation, shared by every rank.
        let repeated = vec!["a"; 128 * 1024].join(",");
        let p = pod(true, &[(MODELS, &repeated), (DP_RANKS, "0-1023")]);
        let spec = pod_spec(&p, Role::Decode, &config()).unwrap().unwrap();
        assert_eq!(spec.models, ["a"]);
        let eps = spec.to_endpoints().unwrap();
        assert_eq!(eps.len(), 1024);
        let first = &eps[0].models().unwrap()[0];
        assert!(
            eps.iter()
                .all(|e| std::sync::Arc::ptr_eq(&e.models().unwrap()[0], first))
        );
        // At the ceilings: kept.
        let most = (0..MAX_MODELS_PER_ENGINE)
            .map(|i| format!("{i:0>512}"))
            .collect::<Vec<_>>()
            .join(",");
        let spec = pod_spec(&pod(true, &[(MODELS, &most)]), Role::Decode, &config())
            .unwrap()
            .unwrap();
        assert_eq!(spec.models.len(), MAX_MODELS_PER_ENGINE);
    }

    #[test]
    fn only_running_ready_live_pods_with_an_ip_route() {
        assert!(
            pod_spec(&pod(false, &[]), Role::Decode, &config())
                .unwrap()
                .is_none()
        );
        let mut p = pod(true, &[]);
        p.status.as_mut().unwrap().phase = Some("Pending".into());
        assert!(pod_spec(&p, Role::Decode, &config()).unwrap().is_none());
        let mut p = pod(true, &[]);
        p.status.as_mut().unwrap().pod_ip = None;
        assert!(pod_spec(&p, Role::Decode, &config()).unwrap().is_none());
        let mut p = pod(true, &[]);
        p.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        ));
        assert!(pod_spec(&p, Role::Decode, &config()).unwrap().is_none());
    }

    #[test]
    fn ports_by_number_name_or_first_declared() {
        let p = pod(true, &[]);
        let mut c = config();
        assert_eq!(pod_port(&p, None), Ok(8100));
        c.port = Some("http".parse().unwrap());
        assert_eq!(pod_port(&p, c.port.as_ref()), Ok(8100));
        c.port = Some("9000".parse().unwrap());
        assert_eq!(pod_port(&p, c.port.as_ref()), Ok(9000));
        c.port = Some("grpc".parse().unwrap());
        assert!(pod_spec(&p, Role::Decode, &c).is_err());
    }

    #[test]
    fn an_oversized_lmcache_annotation_is_refused_before_it_is_kept() {
        // 1,000 ranks' ports: a value past the facts' ceiling (4,096 bytes).
        let ports = vec!["7300"; 1000].join(",");
        let p = pod(
            true,
            &[(LMCACHE_INIT_PORTS, &ports), (LMCACHE_ALLOC_PORTS, &ports)],
        );
        let err = pod_spec(&p, Role::Decode, &config()).unwrap_err();
        assert!(err.contains(LMCACHE_INIT_PORTS), "{err}");
        assert!(err.contains("longer than the 4096 allowed"), "{err}");
    }

    /// What every rank's endpoint copies is bounded: a KV-events annotation that is not
    /// `tcp://HOST:PORT` (a 5,000-byte host) and over-long connector names leave the pod
    /// out, however many ranks it has.
    #[test]
    fn unbounded_strings_copied_per_rank_leave_the_pod_out() {
        let long = format!("tcp://{}:5557", "a".repeat(5000));
        let connector = "c".repeat(129);
        let ec = format!("{connector},ec_consumer");
        for annotation in [
            (KV_EVENTS, long.as_str()),
            (KV_EVENTS, "tcp://*:5557"),
            (KV_CONNECTOR, connector.as_str()),
            (EC_PROFILE, ec.as_str()),
        ] {
            let p = pod(true, &[annotation, (DP_RANKS, "0-1023")]);
            let err = pod_spec(&p, Role::Decode, &config()).unwrap_err();
            assert!(
                err.len() < 1024,
                "the reason quotes a bounded part: {}",
                err.len()
            );
        }
        let p = pod(
            true,
            &[
                (KV_EVENTS, "tcp://engine.llm.svc:5557"),
                (DP_RANKS, "0-1023"),
            ],
        );
        assert!(pod_spec(&p, Role::Decode, &config()).unwrap().is_some());
    }

    /// An IPv6 pod's LMCache receiver host is bracketed, as the file writes it, and the
    /// LMCache connector reads the same host and ports from either.
    #[test]
    fn an_ipv6_pods_lmcache_receiver_is_bracketed_as_the_file_writes_it() {
        use disagg_connectors::lmcache::LmcacheReceiver;
        let mut p = pod(
            true,
            &[
                (LMCACHE_INIT_PORTS, "7300,7301"),
                (LMCACHE_ALLOC_PORTS, "7400,7401"),
                (KV_EVENTS, "5557"),
            ],
        );
        if let Some(status) = p.status.as_mut() {
            status.pod_ip = Some("fd00::1".into());
        }
        let spec = pod_spec(&p, Role::Decode, &config()).unwrap().unwrap();
        assert_eq!(spec.url, "http://[fd00::1]:8100");
        assert_eq!(
            spec.facts.get(Facts::KV_RECEIVER),
            Some("[fd00::1]:7300,7301:7400,7401")
        );
        assert_eq!(spec.kv_events.as_deref(), Some("tcp://[fd00::1]:5557"));
        let from_pod = LmcacheReceiver::from_facts(spec.to_endpoints().unwrap()[0].facts())
            .unwrap()
            .unwrap();
        assert_eq!(from_pod.host(), "[fd00::1]");
        assert_eq!(from_pod.init_ports(), [7300, 7301]);
        assert_eq!(from_pod.alloc_ports(), [7400, 7401]);
        let file = crate::file::parse(
            "[[decode]]\nurl = \"http://[fd00::1]:8100\"\n\
             lmcache_receiver = \"[fd00::1]:7300,7301:7400,7401\"\n",
        )
        .unwrap();
        let from_file = LmcacheReceiver::from_facts(&file[0].facts)
            .unwrap()
            .unwrap();
        assert_eq!(from_file, from_pod);
    }

    /// A selector the API server would answer 400 forever is refused at start, naming
    /// it; what the API server accepts is accepted.
    #[tokio::test]
    async fn label_selectors_are_checked_at_spawn() {
        let client = || {
            let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
            kube::Client::try_from(config).unwrap()
        };
        for bad in [
            "role in encode",
            "role notin encode",
            "role in (a,b",
            "role in (a b)",
            "=x",
            "role=a b",
            "role!",
            "a,,b",
            "a,",
            ",a",
            "!",
            "!a=b",
            "role=prefill;x",
            "role=a/b",
            "-role=x",
            "role-=x",
            "example.com/=x",
            "Example.com/role=x",
            "a/b/c=x",
            "gpu>x",
        ] {
            let mut config = KubernetesConfig::new(None, None);
            config.encode_selector = Some(bad.into());
            let err = spawn_with_client(client(), config).unwrap_err().to_string();
            assert!(
                err.contains("selector") && err.contains(bad),
                "{bad}: {err}"
            );
            // Before the client is configured: the selector is named, not the kubeconfig.
            let mut config = KubernetesConfig::new(Some(bad.into()), None);
            config.client = ClientConfig::Kubeconfig("/nonexistent/kubeconfig".into());
            let err = spawn(config).await.unwrap_err().to_string();
            assert!(err.contains("selector"), "{bad}: {err}");
        }
        let long_name = format!("{}=x", "n".repeat(64));
        let long_value = format!("a={}", "v".repeat(64));
        for bad in [long_name.as_str(), &long_value] {
            let config = KubernetesConfig::new(Some(bad.into()), None);
            assert!(spawn_with_client(client(), config).is_err(), "{bad}");
        }
        for good in [
            "",
            "app=vllm,role=prefill",
            "app = vllm , role == prefill",
            "role!=canary",
            "tier in (a,b)",
            "tier in (a, b), env notin (dev)",
            "tier in(a)",
            "tier in ()",
            "gpu",
            "!preview",
            "! preview",
            "app.kubernetes.io/name=vllm",
            "disagg.io/role=decode,app.kubernetes.io/part-of",
            "role=",
            "role==",
            "gpu>2,gpu<9",
            "Role_1.x-y=A_b.c-D",
        ] {
            let config = KubernetesConfig::new(Some(good.into()), Some("role=decode".into()));
            assert!(spawn_with_client(client(), config).is_ok(), "{good}");
        }
    }

    /// Events already queued when one is taken are taken too before the pods are
    /// published once: a burst of changes is one publish, not one per change.
    #[tokio::test]
    async fn queued_events_are_published_together() {
        use kube::runtime::WatchStreamExt;
        use kube::runtime::watcher::Event;
        let named = |i: u32| {
            let mut p = pod(true, &[]);
            p.metadata.name = Some(format!("p{i}"));
            p.metadata.namespace = Some("llm".into());
            if let Some(status) = p.status.as_mut() {
                status.pod_ip = Some(format!("10.1.2.{i}"));
            }
            p
        };
        let mut script = vec![Event::Init, Event::InitApply(named(0)), Event::InitDone];
        script.extend((1..=50).map(|i| Event::Apply(named(i))));
        let (store, writer) = reflector::store();
        let events = futures::stream::iter(script.into_iter().map(Ok))
            .reflect(writer)
            .map(|e| (0, e))
            .boxed();
        let watched = vec![Watched {
            role: Role::Prefill,
            selector: "role=prefill".into(),
            store,
            listed: false,
        }];
        let (publisher, source) = SpecSource::channel("kubernetes");
        run(
            config(),
            publisher,
            watched,
            futures::stream::select_all([events]),
        )
        .await;
        let specs = source.watch().borrow().clone().unwrap();
        assert_eq!(specs.len(), 51);
        assert_eq!(source.stats().updates(), 1, "one publish for the burst");
    }

    #[test]
    fn bad_annotations_leave_the_pod_out() {
        for (role, annotations) in [
            (Role::Prefill, vec![(SGLANG_BOOTSTRAP_PORT, "x")]),
            (Role::Prefill, vec![(VLLM_BOOTSTRAP_PORT, "70000")]),
            (Role::Decode, vec![(DP_RANKS, "3-1")]),
            (Role::Decode, vec![(WEIGHT, "0")]),
            (Role::Decode, vec![(KV_ROLE, "kv_maybe")]),
            (Role::Decode, vec![(TP_SIZE, "0")]),
            (Role::Decode, vec![(LMCACHE_INIT_PORTS, "7300")]),
            (
                Role::Decode,
                vec![
                    (LMCACHE_INIT_PORTS, "7300,7301"),
                    (LMCACHE_ALLOC_PORTS, "7400"),
                ],
            ),
            (Role::Decode, vec![(KV_EVENTS, "nowhere")]),
            (Role::Decode, vec![(ENGINE_VERSION, "0.33.0;x")]),
            (Role::Decode, vec![(ENGINE_VERSION, "0.33 beta")]),
        ] {
            let p = pod(true, &annotations);
            assert!(pod_spec(&p, role, &config()).is_err(), "{annotations:?}");
        }
        // A decode ignores bootstrap ports.
        let p = pod(true, &[(SGLANG_BOOTSTRAP_PORT, "x")]);
        assert!(pod_spec(&p, Role::Decode, &config()).unwrap().is_some());
        let p = pod(
            true,
            &[(LMCACHE_INIT_PORTS, "7300"), (LMCACHE_ALLOC_PORTS, "7400")],
        );
        let spec = pod_spec(&p, Role::Decode, &config()).unwrap().unwrap();
        assert_eq!(
            spec.facts.get(Facts::KV_RECEIVER),
            Some("10.1.2.3:7300:7400")
        );
        assert!(pod_spec(&p, Role::Prefill, &config()).is_err());
    }
}
