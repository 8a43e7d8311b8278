//! `disagg-proxy serve`: the proxy, from command-line flags.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use disagg_affinity::{
    CacheAware, ConsistentHash, LeastInFlight, PerLeg, PowerOfTwo, PromptThreshold, Random,
    RoundRobin, WeightedRandom,
};
use disagg_core::disaggregate::{Always, Disaggregate};
use disagg_core::endpoint::EndpointError;
use disagg_core::orchestrator::{KvRelease, MissingKv, PrefillFailure};
use disagg_core::pairing::KvProfile;
use disagg_core::rewrite::PrefillRewriter;
use disagg_core::rewrite::check::VllmLimits;
use disagg_core::router::Pick;
use disagg_core::{
    BootstrapPort, Endpoint, EndpointSource, KvConnector, Orchestrator, OrchestratorConfig, Role,
    Router, SglangBootstrap, StaticSource, VllmMooncake, VllmNixl,
};
use disagg_http::metrics::ExtraMetrics;
use disagg_http::{HttpTransport, HttpTransportConfig, PdService, PdServiceConfig};
use disagg_lmcache::{Lmcache, LmcacheReceiver, Notifications, NotifyConfig};
use disagg_resilience::pairing::check_pairs_with;
use disagg_resilience::{
    AdmissionConfig, Backoff, Health, HealthConfig, HealthSource, Limits, RetryPolicy,
};

use crate::BoxError;

/// Flags of `serve`. `--prefill` and `--decode` follow the SGLang and vLLM routers.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// A prefill engine: its base URL (http://host:port), then optionally its bootstrap
    /// port, as SGLang's router writes it (`--prefill http://p1:30000 8998`, or `none`):
    /// SGLang's --disaggregation-bootstrap-port (sent as `bootstrap_port`, `null` when
    /// absent), vLLM Mooncake's VLLM_MOONCAKE_BOOTSTRAP_PORT (default 8998). Repeat for
    /// several engines.
    #[arg(
        long = "prefill",
        value_names = ["URL", "BOOTSTRAP_PORT"],
        num_args = 1..=2,
        action = clap::ArgAction::Append
    )]
    prefill: Vec<String>,
    /// A decode engine's base URL (http://host:port). Repeat for several engines.
    ///
    /// An engine running several data-parallel ranks can be given once per rank as
    /// URL@RANK, or as URL@FIRST-LAST for a range (`http://d:8200@0-3`; also for
    /// --prefill): each rank is then routed to, and load-counted, on its own, and the
    /// connector names the rank to the engine.
    #[arg(long = "decode", value_name = "URL")]
    decode: Vec<String>,
    /// The model an engine serves, as URL=NAME[,NAME...] (URL without @RANK covers every
    /// rank). Once any engine declares models, requests are routed by their `model` to
    /// the engines serving it, an unknown model is answered 404 naming the served ones,
    /// and GET /v1/models lists the declared models. Engines declaring none serve any
    /// other name. Repeatable.
    #[arg(long = "served-model", value_name = "URL=NAME[,NAME]", value_parser = parse_models)]
    served_models: Vec<(String, Vec<String>)>,
    /// Disaggregate only requests whose prompt is estimated at N tokens or more (one
    /// token per 4 bytes of prompt JSON; token-id prompts counted exactly); shorter ones
    /// go to a decode engine alone and their answer carries `x-disagg-handoff: direct`.
    /// With `--decode-policy kv_events`, only the tokens the best decode engine does not
    /// already cache count (a follow-up turn whose prefix sits on a decode engine is
    /// served there alone).
    #[arg(long, value_name = "N")]
    min_prefill_tokens: Option<usize>,
    /// Open the engines' admin routes (LoRA load and unload, cache resets, sleep and
    /// wake, profiling, weight updates; the list in docs/routes.md), closed by default
    /// (403 `admin_route_closed`). Opened, each goes to every prefill and decode engine
    /// of the body's `model` (every engine when it names none), and the answer lists
    /// each engine's result: a pair whose sides disagree about a LoRA adapter cannot
    /// hand KV over.
    #[arg(long)]
    admin_routes: bool,
    /// The KV-transfer protocol the engines speak: vLLM NIXL (sequential: the prefill's
    /// answer carries the handoff), SGLang bootstrap or vLLM Mooncake (concurrent: both
    /// legs at once, meeting through the prefill's bootstrap server).
    #[arg(long, value_enum, default_value_t = ConnectorArg::Nixl)]
    connector: ConnectorArg,
    /// LMCache (`--connector lmcache`): where its notifications come in and where each
    /// decode receives KV.
    #[command(flatten)]
    lmcache: LmcacheArgs,
    /// What an engine declares about its KV transfer, checked for every prefill/decode
    /// pair at start-up: URL=CONNECTOR,ROLE,TP, each part optional (e.g.
    /// `http://p:8100=NixlConnector,kv_producer,8` or `http://d:8200=,,4`). A pair whose
    /// connectors differ, whose roles cannot hand over, or whose TP sizes the connector
    /// cannot bridge stops the proxy with an error naming both engines (LMCache: equal
    /// sizes only, a decode's size being its --lmcache-receiver port count). Repeatable.
    #[arg(long = "kv-profile", value_name = "URL=CONNECTOR,ROLE,TP", value_parser = parse_profile)]
    kv_profiles: Vec<(String, KvProfile)>,
    /// Further attempts, on a newly picked pair (and a new room or transfer id), after a
    /// prefill leg that could not connect or answered 502/503/504, or a decode leg that
    /// could not connect, before any answer reached the client; with jittered
    /// exponential backoff, within the deadline and the retry budget.
    #[arg(long, value_name = "N", default_value_t = 0)]
    retries: u32,
    /// Deadlines, retries, admission and KV release.
    #[command(flatten)]
    reliability: ReliabilityArgs,
    /// Endpoints discovered in Kubernetes, DNS or a file, besides --prefill/--decode.
    #[command(flatten)]
    discovery: crate::discover::DiscoveryArgs,
    /// The `kv_events` policy: the engines' KV-event publishers, and the tokenizer.
    #[command(flatten)]
    kv_events: crate::kv_events::KvEventsArgs,
    /// Metrics, traces and the access log.
    #[command(flatten)]
    observe: crate::observe::ObserveArgs,
    /// The address the proxy listens on.
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:8000")]
    listen: SocketAddr,
    /// Threads serving requests, each with its own event loop, listening socket and
    /// connection pool (default: the number of CPUs).
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// How endpoints are picked, for both legs (see --prefill-policy, --decode-policy).
    #[arg(long, value_enum, default_value_t = Policy::RoundRobin)]
    policy: Policy,
    /// How the prefill endpoint is picked (default: --policy).
    #[arg(long, value_enum)]
    prefill_policy: Option<Policy>,
    /// How the decode endpoint is picked (default: --policy).
    #[arg(long, value_enum)]
    decode_policy: Option<Policy>,
    /// An engine's weight for `weighted_random` and `consistent_hash`, as URL=WEIGHT
    /// (default 1): URL without @RANK weighs every rank endpoint of the engine (each
    /// draws W), URL@RANK one rank. It overrides a weight discovery found for the same
    /// engine. Repeatable.
    #[arg(long = "weight", value_name = "URL=WEIGHT", value_parser = parse_weight)]
    weights: Vec<(String, f64)>,
    /// Seconds for the whole prefill exchange (connect, head and answer); past it, 504.
    #[arg(long, value_name = "SECS", default_value_t = 300.0)]
    prefill_timeout: f64,
    /// Seconds from sending the decode leg to its response head; past it, 504.
    #[arg(long, value_name = "SECS", default_value_t = 300.0)]
    decode_timeout: f64,
    /// Seconds to establish a TCP connection to an engine.
    #[arg(long, value_name = "SECS", default_value_t = 5.0)]
    connect_timeout: f64,
    /// Largest client request body, in bytes; larger ones are answered 413.
    #[arg(long, value_name = "BYTES", default_value_t = 32 * 1024 * 1024)]
    max_body_bytes: usize,
    /// Time and memory limits on client request bodies.
    #[command(flatten)]
    client_body: ClientBodyArgs,
    /// Same as `--prefill-failure decode-only`.
    #[arg(long, hide = true)]
    decode_only_fallback: bool,
    /// What to do when the prefill answers without `kv_transfer_params`: let the decode
    /// engine compute the prompt itself (`x-disagg-handoff: none`), or fail with 502.
    #[arg(long, value_enum, default_value_t = MissingKvArg::LocalPrefill)]
    missing_kv: MissingKvArg,
    /// The vLLM engines' `--max-logprobs` (vLLM's default 20; -1: unbounded). The proxy
    /// refuses, before any engine is contacted, logprob counts above it: the prefill
    /// leg carries none, so only the decode would refuse them, after a prefill ran.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 20,
        allow_negative_numbers = true
    )]
    max_logprobs: i64,
    /// The vLLM engines' `VLLM_MAX_STOP_STRINGS` (default 4): longer `stop` lists are
    /// refused before any engine is contacted, for the same reason.
    #[arg(long, value_name = "N", default_value_t = 4)]
    max_stop_strings: usize,
    /// Forward the client's `Authorization` header to the engines (not with client keys:
    /// the proxy's keys are never passed on; an --engine-api-key replaces it).
    #[arg(long)]
    forward_authorization: bool,
    /// API keys, limits per key, TLS in and out (docs/security.md).
    #[command(flatten)]
    edge: crate::edge::EdgeArgs,
    /// Seconds that requests in flight at SIGTERM or Ctrl-C (streams included) may run
    /// on. The listening socket closes at once and idle connections are closed; past
    /// this deadline the connections still open are cut and the process exits (status 0).
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    drain_timeout: f64,
}

/// Flags that hold client request bodies in time and in memory (docs/reliability.md).
#[derive(Debug, Clone, Args)]
pub struct ClientBodyArgs {
    /// Seconds for a client's whole request body to arrive once its head is read; past
    /// it, 408 `request_timeout` and the connection is closed.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    body_timeout: f64,
    /// Bytes that the request bodies being received may hold at once, all connections
    /// together (default 1 GiB; at least --max-body-bytes). A body that would go past it
    /// is answered 503 `server_busy` with `retry-after` at once, unread, and its
    /// connection closed.
    #[arg(long, value_name = "BYTES", default_value_t = disagg_http::body::DEFAULT_BODY_BUDGET)]
    max_buffered_bytes: usize,
}

impl ClientBodyArgs {
    /// Apply the flags to `config`, whose `max_body_bytes` is already set.
    fn apply(&self, config: &mut PdServiceConfig) -> Result<(), BoxError> {
        config.body_timeout = secs(self.body_timeout, "body-timeout")?;
        if config.body_timeout.is_zero() {
            return Err("--body-timeout must be more than 0 seconds".into());
        }
        // A budget smaller than one body would refuse the largest bodies for ever.
        if self.max_buffered_bytes < config.max_body_bytes {
            return Err(format!(
                "--max-buffered-bytes ({}) must be at least --max-body-bytes ({})",
                self.max_buffered_bytes, config.max_body_bytes
            )
            .into());
        }
        config.body_budget = disagg_http::body::BodyBudget::new(self.max_buffered_bytes);
        Ok(())
    }
}

/// Flags of the LMCache connector.
#[derive(Debug, Clone, Args)]
pub struct LmcacheArgs {
    /// LMCache: the address the ZMQ PULL socket for the prefill engines' KV-ready
    /// notifications binds (their `pd_proxy_host`/`pd_proxy_port`). Default: port 7500
    /// on --listen's host (the socket has no credential: give an address the prefill
    /// engines reach and others do not; `tcp://*:7500` for every interface).
    #[arg(long, value_name = "HOST:PORT")]
    lmcache_notify: Option<String>,
    /// LMCache: where a decode engine receives KV, as
    /// URL=HOST:INIT_PORT[,INIT_PORT...]:ALLOC_PORT[,ALLOC_PORT...] (its `pd_peer_host`,
    /// `pd_peer_init_port`, `pd_peer_alloc_port`; one port of each per TP rank, and the
    /// decode leg waits for one notification per rank). Required for every --decode
    /// engine with `--connector lmcache`. The port count is the decode's TP size: a
    /// prefill whose --kv-profile declares another TP size is refused at start-up (each
    /// prefill rank pushes to the port of its own rank). Repeatable.
    #[arg(long = "lmcache-receiver", value_name = "URL=HOST:INIT:ALLOC", value_parser = parse_receiver)]
    lmcache_receivers: Vec<(String, LmcacheReceiver)>,
    /// LMCache: seconds after which a request still waiting for notifications is
    /// forgotten (the handoff budget, --handoff-timeout, normally ends the wait first).
    #[arg(long, value_name = "SECS", default_value_t = 120.0)]
    lmcache_notify_ttl: f64,
}

fn parse_receiver(s: &str) -> Result<(String, LmcacheReceiver), String> {
    let (url, spec) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}` is not URL=HOST:INIT_PORTS:ALLOC_PORTS"))?;
    let receiver = LmcacheReceiver::parse(spec).map_err(|e| e.to_string())?;
    Ok((base_url(url).to_owned(), receiver))
}

/// Flags for deadlines, retries, admission and KV release (docs/reliability.md).
#[derive(Debug, Clone, Args)]
pub struct ReliabilityArgs {
    /// Seconds a whole request may take, from arrival to its answer's last byte
    /// (default: no total deadline, only the per-step budgets); past it, 504
    /// `deadline_exceeded`, or an error event for a stream already under way.
    #[arg(long, value_name = "SECS")]
    deadline: Option<f64>,
    /// Let clients shorten their deadline with `x-disagg-deadline-ms`.
    #[arg(long)]
    client_deadline: bool,
    /// Seconds for each step of the connector's handoff work (bootstrap lookups,
    /// folding the prefill's answer into the decode leg); past it, 504
    /// `handoff_timeout`.
    #[arg(long, value_name = "SECS", default_value_t = 10.0)]
    handoff_timeout: f64,
    /// Seconds of silence allowed between two chunks of the decode's answer (0: no
    /// limit); past it, the stream ends with `decode_idle_timeout`.
    #[arg(long, value_name = "SECS", default_value_t = 120.0)]
    decode_idle_timeout: f64,
    /// Milliseconds of backoff before the first retry, doubled for each further one,
    /// drawn with full jitter.
    #[arg(long, value_name = "MS", default_value_t = 20)]
    retry_backoff_ms: u64,
    /// Retries allowed per request on average (the retry budget), beyond a reserve of
    /// 10; stops retry storms when a pool fails.
    #[arg(long, value_name = "RATIO", default_value_t = 0.2)]
    retry_budget: f64,
    /// When the prefill cannot be had (no prefill engine available, or its leg failed
    /// on the engine's side after retries): `fail` (503 or the prefill's error), or
    /// `decode-only` (serve on a decode engine alone, marked `x-disagg-handoff:
    /// decode-only` and `x-disagg-fallback: REASON`, counted in /metrics).
    #[arg(long, value_enum, default_value_t = PrefillFailureArg::Fail)]
    prefill_failure: PrefillFailureArg,
    /// Requests served at once, all engines together (default: no limit); more wait in
    /// a FIFO queue.
    #[arg(long, value_name = "N")]
    max_in_flight: Option<usize>,
    /// Requests in flight on one engine endpoint (default: no limit); more wait in the
    /// queue.
    #[arg(long, value_name = "N")]
    max_in_flight_per_endpoint: Option<usize>,
    /// Requests that may wait for admission; one more is answered 429 with
    /// `retry-after`.
    #[arg(long, value_name = "N", default_value_t = 1024)]
    max_queue: usize,
    /// Seconds a request may wait for admission; past it, 503 `queue_timeout`.
    #[arg(long, value_name = "SECS", default_value_t = 10.0)]
    queue_timeout: f64,
    /// Early release of a prefill's KV blocks when a NIXL request ends before its
    /// decode took them: `off` (the engine's lease frees them), or `abort-decode`
    /// (send the decode leg as a one-token request and drop it, so the decode engine
    /// frees them now).
    #[arg(long, value_enum, default_value_t = KvReleaseArg::Off)]
    kv_release: KvReleaseArg,
    /// Consecutive failures of an engine on one leg (unreachable, 5xx, out of its
    /// budget) that take that endpoint out of routing (0: never); it returns after
    /// --ejection-time, half-open, and the next result decides.
    #[arg(long, value_name = "N", default_value_t = 5)]
    eject_after: u32,
    /// Seconds an endpoint stays out after its first ejection; doubled on each
    /// repeated one, up to --max-ejection-time.
    #[arg(long, value_name = "SECS", default_value_t = 5.0)]
    ejection_time: f64,
    /// Longest ejection, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 60.0)]
    max_ejection_time: f64,
    /// Seconds between active health checks (`GET --health-check-path` on every engine;
    /// 0: no active checks). Two failed checks in a row take the engine out, one pass
    /// brings it back.
    #[arg(long, value_name = "SECS", default_value_t = 0.0)]
    health_check_interval: f64,
    /// Seconds a health check may take.
    #[arg(long, value_name = "SECS", default_value_t = 1.0)]
    health_check_timeout: f64,
    /// The path of the engines' health check.
    #[arg(long, value_name = "PATH", default_value = "/health")]
    health_check_path: String,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum PrefillFailureArg {
    Fail,
    DecodeOnly,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum KvReleaseArg {
    Off,
    AbortDecode,
}

impl ReliabilityArgs {
    /// The health settings, and whether active checks run.
    fn health(&self) -> Result<(HealthConfig, bool), BoxError> {
        let mut config = HealthConfig::default();
        config.failure_threshold = self.eject_after;
        config.base_ejection = secs(self.ejection_time, "ejection-time")?;
        config.max_ejection = secs(self.max_ejection_time, "max-ejection-time")?;
        let active = self.health_check_interval > 0.0;
        if active {
            config.checks.interval = secs(self.health_check_interval, "health-check-interval")?;
        }
        config.checks.timeout = secs(self.health_check_timeout, "health-check-timeout")?;
        config.checks.path = self
            .health_check_path
            .parse()
            .map_err(|e| format!("--health-check-path: {e}"))?;
        Ok((config, active))
    }

    /// Apply the flags to `config`; the retry policy and admission limits they ask for.
    fn apply(&self, config: &mut OrchestratorConfig, retries: u32) -> Result<Resilience, BoxError> {
        config.deadline = self.deadline.map(|d| secs(d, "deadline")).transpose()?;
        config.client_deadline = self.client_deadline;
        config.handoff_timeout = secs(self.handoff_timeout, "handoff-timeout")?;
        config.decode_idle_timeout = match self.decode_idle_timeout {
            0.0 => None,
            s => Some(secs(s, "decode-idle-timeout")?),
        };
        let mut retry = RetryPolicy::retries(retries);
        retry.backoff_base = Duration::from_millis(self.retry_backoff_ms);
        if !(self.retry_budget >= 0.0 && self.retry_budget.is_finite()) {
            return Err("--retry-budget must be a ratio of 0 or more".into());
        }
        retry.budget_ratio = self.retry_budget;
        config.prefill_failure = match self.prefill_failure {
            PrefillFailureArg::Fail => PrefillFailure::Fail,
            PrefillFailureArg::DecodeOnly => PrefillFailure::DecodeOnly,
        };
        let mut admission = AdmissionConfig::default();
        admission.max_in_flight = self.max_in_flight;
        admission.max_in_flight_per_endpoint = self.max_in_flight_per_endpoint;
        admission.max_queue = self.max_queue;
        admission.queue_timeout = secs(self.queue_timeout, "queue-timeout")?;
        config.kv_release = match self.kv_release {
            KvReleaseArg::Off => KvRelease::Off,
            KvReleaseArg::AbortDecode => KvRelease::abort_decode(),
        };
        Ok(Resilience { retry, admission })
    }
}

/// The resilience pieces the flags ask for.
struct Resilience {
    retry: RetryPolicy,
    admission: AdmissionConfig,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
#[value(rename_all = "snake_case")]
enum Policy {
    /// The next engine in turn.
    RoundRobin,
    /// A uniformly random engine.
    Random,
    /// The engine with the fewest requests in flight (streams count until they end).
    LeastInFlight,
    /// The less loaded of two distinct random engines (in flight until the body ends).
    PowerOfTwo,
    /// A random engine, in proportion to its --weight.
    WeightedRandom,
    /// Sticky per session (x-session-id, then `user`), bounded by load; sessions spread
    /// in proportion to the engines' weights.
    ConsistentHash,
    /// The engine that most recently received the longest prefix of this prompt, unless
    /// the engines' loads are out of balance (then the least loaded).
    CacheAware,
    /// The engine whose cache, by its own KV events, holds the longest prefix of this
    /// prompt, traded against its load (needs --tokenizer or --tokenize, and
    /// --kv-events-port, --kv-events-endpoint or discovered endpoints).
    KvEvents,
}

impl Policy {
    fn pick(
        self,
        weights: &[(String, f64)],
        kv: Option<&crate::kv_events::KvEvents>,
    ) -> Result<Box<dyn Pick>, BoxError> {
        Ok(match self {
            Policy::WeightedRandom => Box::new(
                weights
                    .iter()
                    .fold(WeightedRandom::new(), |w, (url, weight)| {
                        w.with_weight(url.trim_end_matches('/'), *weight)
                    }),
            ),
            Policy::RoundRobin => Box::new(RoundRobin::new()),
            Policy::Random => Box::new(Random::new()),
            Policy::LeastInFlight => Box::new(LeastInFlight::new()),
            Policy::PowerOfTwo => Box::new(PowerOfTwo::new()),
            Policy::ConsistentHash => {
                let mut w = disagg_affinity::Weights::new();
                for (url, weight) in weights {
                    w = w.with_weight(url.trim_end_matches('/'), *weight)?;
                }
                Box::new(ConsistentHash::default().with_weights(w))
            }
            Policy::CacheAware => Box::new(CacheAware::default()),
            Policy::KvEvents => Box::new(disagg_kvevents::KvEventsPick::new(Arc::clone(
                &kv.ok_or("kv_events: the policy's scorer was not built")?
                    .scorer,
            ))),
        })
    }
}

/// The KV-transfer protocol, as `--connector` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "kebab-case")]
pub enum ConnectorArg {
    /// vLLM NixlConnector (pull): sequential, `kv_transfer_params` from the prefill's answer.
    Nixl,
    /// SGLang: concurrent, `bootstrap_host/port/room` on both legs.
    Sglang,
    /// vLLM MooncakeConnector (concurrent generation): linked by a `transfer_id`.
    Mooncake,
    /// vLLM LMCacheConnectorV1 (P/D over NIXL): the prefill pushes KV to the decode's
    /// receiver ports and notifies over ZMQ; the first token comes from the prefill.
    Lmcache,
}

impl ConnectorArg {
    /// The protocol's name, as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ConnectorArg::Nixl => "nixl",
            ConnectorArg::Sglang => "sglang",
            ConnectorArg::Mooncake => "mooncake",
            ConnectorArg::Lmcache => "lmcache",
        }
    }

    /// The connector; LMCache's waits on `notifications`, which it needs.
    ///
    /// # Errors
    ///
    /// LMCache without a notification listener.
    pub fn connector(
        self,
        notifications: Option<Notifications>,
        limits: VllmLimits,
    ) -> Result<Arc<dyn KvConnector>, BoxError> {
        let rewriter = PrefillRewriter::new().with_limits(limits);
        Ok(match self {
            ConnectorArg::Nixl => Arc::new(VllmNixl::with_rewriter(rewriter)),
            ConnectorArg::Sglang => Arc::new(SglangBootstrap::new()),
            ConnectorArg::Mooncake => Arc::new(VllmMooncake::new().with_rewriter(rewriter)),
            ConnectorArg::Lmcache => Arc::new(
                Lmcache::new(
                    notifications.ok_or("the lmcache connector needs its notification listener")?,
                )
                .with_limits(limits),
            ),
        })
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
#[value(rename_all = "kebab-case")]
enum MissingKvArg {
    /// Send the decode leg without a handoff.
    LocalPrefill,
    /// Answer 502.
    Fail,
}

fn parse_weight(s: &str) -> Result<(String, f64), String> {
    let (url, w) = s
        .rsplit_once('=')
        .ok_or_else(|| format!("`{s}` is not URL=WEIGHT"))?;
    let w: f64 = w.parse().map_err(|_| format!("`{w}` is not a number"))?;
    if !(w.is_finite() && w > 0.0) {
        return Err(format!("weight `{w}` must be a positive number"));
    }
    Ok((url.trim_end_matches('/').to_owned(), w))
}

fn parse_models(s: &str) -> Result<(String, Vec<String>), String> {
    let (url, names) = s
        .rsplit_once('=')
        .ok_or_else(|| format!("`{s}` is not URL=NAME[,NAME]"))?;
    let names: Vec<String> = names
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(str::to_owned)
        .collect();
    if names.is_empty() {
        return Err(format!("`{s}` names no model"));
    }
    Ok((url.trim_end_matches('/').to_owned(), names))
}

/// `url` without a data-parallel `@RANK` or `@FIRST-LAST` suffix, and its trailing `/`.
fn base_url(url: &str) -> &str {
    let base = match url.rsplit_once('@') {
        Some((base, ranks)) if ranks.bytes().all(|b| b.is_ascii_digit() || b == b'-') => base,
        _ => url,
    };
    base.trim_end_matches('/')
}

/// `url`, or one URL per rank when it ends in `@FIRST-LAST` (at most `max` ranks,
/// counted before any URL is made).
fn expand_ranks(url: &str, max: u32) -> Result<Vec<String>, BoxError> {
    let Some((base, range)) = url.rsplit_once('@') else {
        return Ok(vec![url.to_owned()]);
    };
    if !range.contains('-') {
        return Ok(vec![url.to_owned()]);
    }
    let ranks: disagg_core::endpoint::Ranks = range.parse().map_err(|_| {
        format!("{url}: the ranks after `@` must be RANK or FIRST-LAST (e.g. @0-3)")
    })?;
    let ranks = ranks
        .within(max)
        .map_err(|e| format!("{url}: {e} (--max-dp-ranks)"))?;
    Ok(ranks.iter().map(|r| format!("{base}@{r}")).collect())
}

fn parse_profile(s: &str) -> Result<(String, KvProfile), String> {
    let (url, spec) = s
        .rsplit_once('=')
        .ok_or_else(|| format!("`{s}` is not URL=CONNECTOR,ROLE,TP"))?;
    let mut parts = spec.split(',').map(str::trim);
    let mut profile = KvProfile::default();
    if let Some(c) = parts.next().filter(|c| !c.is_empty()) {
        profile.connector = Some(c.to_owned());
    }
    if let Some(r) = parts.next().filter(|r| !r.is_empty()) {
        profile.role = Some(
            r.parse()
                .map_err(|e: disagg_core::pairing::KvRoleError| e.to_string())?,
        );
    }
    if let Some(tp) = parts.next().filter(|t| !t.is_empty()) {
        let tp: u32 = tp
            .parse()
            .ok()
            .filter(|t| *t > 0)
            .ok_or_else(|| format!("TP size `{tp}` is not a positive number"))?;
        profile.tp_size = Some(tp);
    }
    if parts.next().is_some() {
        return Err(format!("`{spec}` has more than CONNECTOR,ROLE,TP"));
    }
    Ok((url.trim_end_matches('/').to_owned(), profile))
}

/// The `--prefill` values regrouped per engine: a URL, then its bootstrap port if the
/// next value is a port or `none` (clap hands the values of every occurrence over as
/// one list; a port is never a URL, so the grouping is unambiguous).
fn parse_prefills(values: &[String]) -> Result<Vec<(&str, Option<u16>)>, BoxError> {
    let mut out: Vec<(&str, Option<u16>)> = Vec::new();
    let mut port_allowed = false;
    for v in values {
        if v.contains("://") {
            out.push((v, None));
            port_allowed = true;
            continue;
        }
        let Some(last) = out.last_mut().filter(|_| port_allowed) else {
            return Err(format!("--prefill {v}: expected an engine URL (http://host:port)").into());
        };
        port_allowed = false;
        if !v.eq_ignore_ascii_case("none") {
            let port: u16 = v.parse().map_err(|_| {
                format!(
                    "--prefill {} {v}: the bootstrap port must be a port number or `none`",
                    last.0
                )
            })?;
            last.1 = Some(port);
        }
    }
    Ok(out)
}

pub(crate) fn secs(v: f64, flag: &str) -> Result<Duration, BoxError> {
    Duration::try_from_secs_f64(v)
        .map_err(|_| format!("--{flag} must be a non-negative number of seconds").into())
}

impl ServeArgs {
    /// The address to listen on.
    pub fn listen(&self) -> SocketAddr {
        self.listen
    }

    /// Every engine URL given, prefill then decode.
    pub fn engine_urls(&self) -> impl Iterator<Item = &str> {
        self.prefill
            .iter()
            .filter(|v| v.contains("://"))
            .chain(&self.decode)
            .map(String::as_str)
    }
}

/// The proxy's parts that every serving thread shares: one orchestrator (endpoints,
/// router, connector, admission, retry budget, counters), of which each thread takes a
/// copy with a transport and connection pool of its own.
struct Shared {
    orchestrator: Orchestrator,
    transport: HttpTransportConfig,
    service: PdServiceConfig,
    /// Keys, limits and TLS at the edge.
    edge: crate::edge::Edge,
    /// Set when active health checks run.
    health: Option<Arc<Health>>,
    /// The discovery sources' thread, when discovery runs (it ends at shutdown).
    discovery: Option<std::thread::JoinHandle<()>>,
    /// The KV-event subscriber's thread, with the `kv_events` policy (it ends at
    /// shutdown).
    kv_events: Option<std::thread::JoinHandle<()>>,
    /// The access log and traces to flush at shutdown.
    finish: crate::observe::Finish,
}

impl Shared {
    fn from_args(
        args: &ServeArgs,
        notifications: Option<Notifications>,
        shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> Result<Self, BoxError> {
        if args.decode.is_empty() && !args.discovery.may_find_decode() {
            return Err(
                "no decode engine: give --decode, or a discovery source that can find one \
                 (--k8s-decode-selector, --decode-dns, --endpoints-file)"
                    .into(),
            );
        }
        if args.prefill.is_empty() && !args.discovery.any() && !args.decode_only_fallback {
            return Err("no prefill engine: give --prefill, or a discovery source".into());
        }
        let bounds = args.discovery.bounds();
        // Engine-wide settings are given for the engine URL and apply to all its ranks.
        let endpoint = |url: &str, role: Role, mut ext: http::Extensions| {
            let base = base_url(url);
            // One rank's own weight first, then its engine's.
            let id = url.trim_end_matches('/');
            let weight = (args.weights.iter().find(|(u, _)| u == id))
                .or_else(|| args.weights.iter().find(|(u, _)| u == base))
                .map(|(_, w)| *w);
            let profile = args.kv_profiles.iter().find(|(u, _)| u == base);
            if let Some((_, p)) = profile {
                ext.insert(p.clone());
            }
            // LMCache: a decode's receiver port count is its TP size, declared with it
            // for the pair check below.
            if let Some(r) = ext.remove::<LmcacheReceiver>() {
                r.insert_into(&mut ext).map_err(|e| {
                    format!("--kv-profile and --lmcache-receiver disagree on {base}: {e}")
                })?;
            }
            let models = args.served_models.iter().find(|(u, _)| u == base);
            let mut ep = Endpoint::with_address_policy(url, role, ext, bounds.addresses).map_err(
                |e| -> BoxError {
                    match e {
                        EndpointError::RefusedAddress { .. } => {
                            format!("{e}; allow it with --allow-link-local-engines").into()
                        }
                        e => e.into(),
                    }
                },
            )?;
            if let Some(w) = weight {
                ep = ep.with_weight(w)?;
            }
            Ok::<_, BoxError>(match models {
                Some((_, names)) => ep.with_models(names.iter().map(String::as_str)),
                None => ep,
            })
        };
        let mut endpoints = Vec::new();
        for (url, port) in parse_prefills(&args.prefill)? {
            for url in expand_ranks(url, bounds.max_ranks)? {
                let mut ext = http::Extensions::new();
                ext.insert(BootstrapPort(port));
                endpoints.push(endpoint(&url, Role::Prefill, ext)?);
            }
        }
        let lmcache = args.connector == ConnectorArg::Lmcache;
        for url in &args.decode {
            let mut ext = http::Extensions::new();
            let receiver = args.lmcache.lmcache_receivers.iter();
            match receiver.clone().find(|(u, _)| u == base_url(url)) {
                Some((_, r)) => {
                    ext.insert(r.clone());
                }
                None if lmcache => {
                    return Err(format!(
                        "--connector lmcache: decode engine {url} needs --lmcache-receiver {}=HOST:INIT_PORTS:ALLOC_PORTS",
                        base_url(url)
                    )
                    .into());
                }
                None => {}
            }
            for url in expand_ranks(url, bounds.max_ranks)? {
                endpoints.push(endpoint(&url, Role::Decode, ext.clone())?);
            }
        }
        let named = args.kv_profiles.iter().map(|(u, _)| ("--kv-profile", u));
        let named = named.chain(
            args.served_models
                .iter()
                .map(|(u, _)| ("--served-model", u)),
        );
        let named = named.chain(
            args.lmcache
                .lmcache_receivers
                .iter()
                .map(|(u, _)| ("--lmcache-receiver", u)),
        );
        for (flag, url) in named {
            if !args.engine_urls().any(|u| base_url(u) == url) {
                return Err(format!(
                    "{flag} names {url}, which is no --prefill or --decode engine"
                )
                .into());
            }
        }
        // LMCache's notification counters join GET /metrics.
        let lmcache_metrics = notifications
            .clone()
            .map(|n| ExtraMetrics::new(move |registry| n.register_metrics(registry)));
        let mut limits = VllmLimits::default();
        limits.max_logprobs = args.max_logprobs;
        limits.max_stop_strings = args.max_stop_strings;
        let connector = args.connector.connector(notifications, limits)?;
        let (health_config, active_checks) = args.reliability.health()?;
        if args.forward_authorization && args.edge.client_keys() {
            return Err("--forward-authorization cannot be used with client keys (--api-key, --api-key-file): the clients' keys are the proxy's and never go to engines; give the engines theirs with --engine-api-key".into());
        }
        let edge = args.edge.build(
            args.engine_urls().collect::<Vec<_>>().into_iter(),
            args.discovery.any(),
        )?;
        let mut transport = HttpTransportConfig::default();
        transport.connect_timeout = secs(args.connect_timeout, "connect-timeout")?;
        transport.addresses = bounds.addresses;
        edge.apply(&mut transport);
        let mut extra_metrics = Vec::new();
        let prefill_policy = args.prefill_policy.unwrap_or(args.policy);
        let decode_policy = args.decode_policy.unwrap_or(args.policy);
        let kv_events = [prefill_policy, decode_policy]
            .iter()
            .any(|p| matches!(p, Policy::KvEvents))
            .then(|| crate::kv_events::KvEvents::new(&args.kv_events))
            .transpose()?;
        if kv_events.is_none()
            && let Some(flag) = args.kv_events.needs_the_policy()
        {
            return Err(format!(
                "{flag} is read only by the kv_events policy: add --prefill-policy kv_events or --decode-policy kv_events"
            )
            .into());
        }
        // The set the KV-event subscriber follows: every engine found, before health
        // takes any out (an ejected engine keeps its cache, and its entries).
        let (source, health, discovery, follow): (
            Arc<dyn EndpointSource>,
            _,
            _,
            Arc<dyn EndpointSource>,
        ) = if args.discovery.any() {
            let d = crate::discover::start(
                &args.discovery,
                endpoints,
                Arc::clone(&connector),
                health_config,
                transport.clone(),
                shutdown.clone(),
            )?;
            let merged = Arc::clone(&d.merged);
            let pairing = Arc::clone(&d.pairing);
            extra_metrics.push(ExtraMetrics::new(move |registry| {
                merged.register_metrics(registry);
                pairing.register_metrics(registry);
            }));
            (Arc::new(d.source), d.health, Some(d.thread), d.merged)
        } else {
            let source = HealthSource::new(StaticSource::new(endpoints), health_config);
            // The engines' versions too, for the connectors whose handshake compares
            // them (a pair of different builds fails every request).
            let versions =
                crate::discover::versions_now(&source.snapshot(), &*connector, &transport)?;
            check_pairs_with(&source.snapshot(), &*connector, &versions)?;
            let health = Arc::clone(source.health());
            let all = Arc::new(crate::kv_events::Fixed::new(source.snapshot()));
            (Arc::new(source), health, None, all)
        };
        let mut config = OrchestratorConfig::default();
        config.prefill_timeout = secs(args.prefill_timeout, "prefill-timeout")?;
        config.decode_head_timeout = secs(args.decode_timeout, "decode-timeout")?;
        config.forward_authorization = args.forward_authorization;
        config.tokenize_timeout = args.kv_events.tokenize_timeout()?;
        let resilience = args.reliability.apply(&mut config, args.retries)?;
        let observe = args.observe.start(args.connector.name(), &mut config)?;
        if args.decode_only_fallback {
            config.prefill_failure = PrefillFailure::DecodeOnly;
        }
        config.missing_kv = match args.missing_kv {
            MissingKvArg::LocalPrefill => MissingKv::LocalPrefill,
            MissingKvArg::Fail => MissingKv::Fail,
        };
        let router: Arc<dyn Router> = Arc::new(PerLeg::new(
            prefill_policy.pick(&args.weights, kv_events.as_ref())?,
            decode_policy.pick(&args.weights, kv_events.as_ref())?,
        ));
        let disaggregate: Arc<dyn Disaggregate> = match (args.min_prefill_tokens, &kv_events) {
            // The decode leg is picked by what the decode engines hold: only the
            // prompt the best of them lacks is worth a prefill leg.
            (Some(n), Some(kv)) if matches!(decode_policy, Policy::KvEvents) => {
                Arc::new(disagg_kvevents::CachedPrefixThreshold::new(
                    Arc::clone(&kv.scorer),
                    Arc::clone(&source),
                    n,
                    Arc::new(PromptThreshold::new(n)),
                ))
            }
            (Some(n), _) => Arc::new(PromptThreshold::new(n)),
            (None, _) => Arc::new(Always),
        };
        let tokenizer = match &kv_events {
            None => None,
            Some(_) => Some(
                args.kv_events
                    .tokenizer(Arc::clone(&source), transport.clone())?
                    .ok_or("the kv_events policy needs token ids: give --tokenizer PATH or --tokenize engine")?,
            ),
        };
        let mut service = PdServiceConfig::default();
        service.max_body_bytes = args.max_body_bytes;
        service.routes = disagg_http::RouteTable::default().admin_routes(args.admin_routes);
        service.extra_metrics.extend(lmcache_metrics);
        service.extra_metrics.extend(edge.metrics());
        service.extra_metrics.extend(extra_metrics);
        let health_metrics = Arc::clone(&health);
        service
            .extra_metrics
            .push(ExtraMetrics::new(move |registry| {
                health_metrics.register_metrics(registry)
            }));
        observe.serve_metrics(&mut service);
        args.client_body.apply(&mut service)?;
        // The source's health hears every attempt (it is the source's listener).
        let mut builder = Orchestrator::builder(source, HttpTransport::new(transport.clone()))
            .router(router)
            .connector(connector)
            .disaggregate(disaggregate)
            .config(config);
        if let Some(t) = tokenizer {
            builder = builder.tokenizer(t);
        }
        // Each piece only when asked for: a proxy with no limit and no retry pays
        // nothing for them.
        let a = &resilience.admission;
        if a.max_in_flight.is_some() || a.max_in_flight_per_endpoint.is_some() {
            builder = builder.admission(Limits::new(resilience.admission));
        }
        if resilience.retry.max_retries > 0 {
            builder = builder.retry(Backoff::new(resilience.retry));
        }
        let orchestrator = observe.attach(builder).build();
        let kv_thread = match &kv_events {
            None => None,
            Some(kv) => {
                service.extra_metrics.push(kv.metrics());
                Some(kv.start(follow, shutdown)?)
            }
        };
        Ok(Shared {
            orchestrator,
            transport,
            service,
            edge,
            health: active_checks.then_some(health),
            discovery,
            kv_events: kv_thread,
            finish: observe.into_finish(),
        })
    }

    /// One thread's service: the shared orchestrator (so load, round-robin state,
    /// admission and counters are global), with a transport and pool of its own.
    fn service(&self) -> PdService {
        let orchestrator = self
            .orchestrator
            .with_transport(HttpTransport::new(self.transport.clone()));
        PdService::with_config(orchestrator, self.service.clone())
    }
}

/// Run the proxy described by `args` until `shutdown` turns `true`, then drain within
/// `--drain-timeout`; `on_bound` gets the listening address once every serving thread is
/// up. Blocks the calling thread.
///
/// # Errors
///
/// Invalid flags, or an address that cannot be bound.
pub fn run(
    args: &ServeArgs,
    shutdown: tokio::sync::watch::Receiver<bool>,
    on_bound: impl FnOnce(SocketAddr),
) -> Result<(), BoxError> {
    // LMCache's notification socket, on a small thread of its own until shutdown.
    let (notifications, listener) = match args.connector {
        ConnectorArg::Lmcache => {
            let (n, thread) = lmcache_listener(&args.lmcache, args.listen, shutdown.clone())?;
            (Some(n), Some(thread))
        }
        _ => (None, None),
    };
    let mut shared = Shared::from_args(args, notifications, shutdown.clone())?;
    let discovery = shared.discovery.take();
    let kv_events = shared.kv_events.take();
    let finish = std::mem::take(&mut shared.finish);
    // Active health checks on a small thread of their own, until shutdown.
    let checker = match &shared.health {
        None => None,
        Some(health) => {
            let (health, stop) = (Arc::clone(health), shutdown.clone());
            let transport = HttpTransport::new(shared.transport.clone());
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            Some(
                std::thread::Builder::new()
                    .name("disagg-health".into())
                    .spawn(move || runtime.block_on(health.run_checks(transport, stop)))?,
            )
        }
    };
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from));
    let server = disagg_http::server::Builder::new()
        .threads(threads)
        .drain_timeout(secs(args.drain_timeout, "drain-timeout")?)
        .tls(shared.edge.server_tls.clone());
    // The key file and certificates, re-read on a small thread of their own.
    let reloader = match shared.edge.reloads() {
        None => None,
        Some(reloads) => Some(crate::edge::spawn_until(
            "disagg-reload",
            reloads,
            shutdown.clone(),
        )?),
    };
    let served = match shared.edge.layer.clone() {
        // Without keys the service is served bare: no layer, no cost.
        None => server.serve_threads(args.listen, move || shared.service(), shutdown, on_bound),
        Some(layer) => server.serve_threads(
            args.listen,
            move || tower::Layer::layer(&layer, shared.service()),
            shutdown,
            on_bound,
        ),
    };
    served.map_err(|e| format!("cannot serve on {}: {e}", args.listen))?;
    if let Some(reloader) = reloader {
        let _ = reloader.join();
    }
    if let Some(checker) = checker {
        let _ = checker.join();
    }
    if let Some(discovery) = discovery {
        let _ = discovery.join();
    }
    if let Some(kv_events) = kv_events {
        let _ = kv_events.join();
    }
    if let Some(listener) = listener {
        let _ = listener.join();
    }
    // The requests are over: their last log lines and spans go out.
    finish.close();
    Ok(())
}

/// `--lmcache-notify`, or port 7500 on `--listen`'s host: the socket has no credential,
/// so it is not opened on every interface unless asked for.
fn notify_address(args: &LmcacheArgs, listen: SocketAddr) -> String {
    args.lmcache_notify
        .clone()
        .unwrap_or_else(|| SocketAddr::new(listen.ip(), 7500).to_string())
}

/// Binds LMCache's notification socket on a thread of its own, which runs the socket
/// until `shutdown` turns `true`.
fn lmcache_listener(
    args: &LmcacheArgs,
    listen: SocketAddr,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> Result<(Notifications, std::thread::JoinHandle<()>), BoxError> {
    let notify = notify_address(args, listen);
    let config = NotifyConfig {
        ttl: secs(args.lmcache_notify_ttl, "lmcache-notify-ttl")?,
        ..NotifyConfig::default()
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let notifications = runtime
        .block_on(Notifications::bind(&notify, config))
        .map_err(|e| format!("--lmcache-notify {notify}: {e}"))?;
    if let Some(addr) = notifications.local_addr() {
        tracing::info!(%addr, "LMCache notifications listening");
    }
    let thread = std::thread::Builder::new()
        .name("disagg-lmcache".into())
        .spawn(move || {
            runtime.block_on(async move {
                while !*shutdown.borrow_and_update() {
                    if shutdown.changed().await.is_err() {
                        break;
                    }
                }
            })
        })?;
    Ok((notifications, thread))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lmcache_socket_defaults_to_the_listen_host() {
        let args = |notify: Option<&str>| LmcacheArgs {
            lmcache_notify: notify.map(str::to_owned),
            lmcache_receivers: Vec::new(),
            lmcache_notify_ttl: 120.0,
        };
        let local: SocketAddr = "127.0.0.1:8000".parse().unwrap();
        assert_eq!(notify_address(&args(None), local), "127.0.0.1:7500");
        let v6: SocketAddr = "[::1]:8000".parse().unwrap();
        assert_eq!(notify_address(&args(None), v6), "[::1]:7500");
        assert_eq!(
            notify_address(&args(Some("tcp://*:7600")), local),
            "tcp://*:7600"
        );
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn prefill_values_group_as_sglang_writes_them() {
        let v = strings(&[
            "http://p1:30000",
            "8998",
            "http://p2:30000",
            "none",
            "http://p3:1",
        ]);
        assert_eq!(
            parse_prefills(&v).unwrap(),
            [
                ("http://p1:30000", Some(8998)),
                ("http://p2:30000", None),
                ("http://p3:1", None),
            ]
        );
        assert!(parse_prefills(&strings(&["8998"])).is_err());
        assert!(parse_prefills(&strings(&["http://p:1", "1", "2"])).is_err());
        assert!(parse_prefills(&strings(&["http://p:1", "port"])).is_err());
    }

    #[test]
    fn rank_ranges_expand_and_base_urls_drop_ranks() {
        let max = disagg_core::endpoint::DEFAULT_MAX_DP_RANKS;
        assert_eq!(expand_ranks("http://d:1", max).unwrap(), ["http://d:1"]);
        assert_eq!(expand_ranks("http://d:1@2", max).unwrap(), ["http://d:1@2"]);
        assert_eq!(
            expand_ranks("http://d:1@1-3", max).unwrap(),
            ["http://d:1@1", "http://d:1@2", "http://d:1@3"]
        );
        assert!(expand_ranks("http://d:1@3-1", max).is_err());
        assert!(expand_ranks("http://d:1@a-b", max).is_err());
        // Counted, not expanded: 2^32 URLs would never be made.
        let err = expand_ranks("http://d:1@0-4294967295", max).unwrap_err();
        assert!(err.to_string().contains("--max-dp-ranks"), "{err}");
        assert_eq!(expand_ranks("http://d:1@0-1023", max).unwrap().len(), 1024);
        assert!(expand_ranks("http://d:1@0-3", 2).is_err());
        assert_eq!(base_url("http://d:1/@0-3"), "http://d:1");
        assert_eq!(base_url("http://d:1@2"), "http://d:1");
        assert_eq!(base_url("http://d:1/"), "http://d:1");
    }

    #[test]
    fn served_models_parse() {
        assert_eq!(
            parse_models("http://d:1/=llama, qwen").unwrap(),
            (
                "http://d:1".to_owned(),
                vec!["llama".to_owned(), "qwen".to_owned()]
            )
        );
        assert!(parse_models("http://d:1=").is_err());
        assert!(parse_models("llama").is_err());
    }

    #[test]
    fn profiles_parse_with_optional_parts() {
        let (url, p) = parse_profile("http://p:8100/=NixlConnector,kv_producer,8").unwrap();
        assert_eq!(url, "http://p:8100");
        assert_eq!(p.connector.as_deref(), Some("NixlConnector"));
        assert_eq!(p.role, Some(disagg_core::pairing::KvRole::Producer));
        assert_eq!(p.tp_size, Some(8));
        let (_, p) = parse_profile("http://d:1=,,4").unwrap();
        assert_eq!(
            p,
            KvProfile {
                tp_size: Some(4),
                ..KvProfile::default()
            }
        );
        assert!(parse_profile("http://d:1=,kv_what,").is_err());
        assert!(parse_profile("http://d:1=,,0").is_err());
        assert!(parse_profile("no-equals").is_err());
    }

    /// The error with which `serve` refuses to start with `args` (after the program
    /// name), before it binds or spawns anything.
    fn refused_start<const N: usize>(args: [&str; N]) -> String {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeArgs,
        }
        let cli = Cli::try_parse_from(std::iter::once("x").chain(args)).unwrap();
        Shared::from_args(&cli.serve, None, tokio::sync::watch::channel(false).1)
            .err()
            .expect("refused")
            .to_string()
    }

    #[test]
    fn a_pair_that_cannot_hand_over_stops_the_proxy() {
        let err = refused_start([
            "--connector",
            "sglang",
            "--prefill",
            "http://127.0.0.1:1",
            "8998",
            "--decode",
            "http://127.0.0.1:2",
            "--kv-profile",
            "http://127.0.0.1:2=NixlConnector,,",
        ]);
        assert!(
            err.contains("http://127.0.0.1:1") && err.contains("http://127.0.0.1:2"),
            "{err}"
        );
        assert!(
            err.contains("NixlConnector") && err.contains("sglang"),
            "{err}"
        );
    }

    #[test]
    fn a_metadata_address_on_the_command_line_stops_the_proxy() {
        for url in [
            "http://169.254.169.254",
            "http://[::ffff:169.254.169.254]:80",
        ] {
            let err = refused_start(["--prefill", "http://127.0.0.1:1", "--decode", url]);
            assert!(
                err.contains("metadata") && err.contains("--allow-link-local-engines"),
                "{err}"
            );
        }
    }

    #[test]
    fn kv_events_without_a_tokenizer_stops_the_proxy() {
        let err = refused_start([
            "--prefill",
            "http://127.0.0.1:1",
            "--decode",
            "http://127.0.0.1:2",
            "--prefill-policy",
            "kv_events",
            "--kv-events-port",
            "5557",
        ]);
        assert!(
            err.contains("--tokenizer") && err.contains("--tokenize engine"),
            "{err}"
        );
    }

    #[test]
    fn kv_events_flags_without_the_policy_stop_the_proxy() {
        let err = refused_start([
            "--prefill",
            "http://127.0.0.1:1",
            "--decode",
            "http://127.0.0.1:2",
            "--kv-events-port",
            "5557",
        ]);
        assert!(
            err.contains("--kv-events-port") && err.contains("kv_events"),
            "{err}"
        );
    }
}
