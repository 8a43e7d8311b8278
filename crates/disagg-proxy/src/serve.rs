//! `disagg-proxy serve`: the proxy, from command-line flags.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use disagg_affinity::ConsistentHash;
use disagg_core::orchestrator::{MissingKv, NoPrefill};
use disagg_core::policy::{
    LeastInFlightPick, PerLeg, Pick, PowerOfTwo, RandomPick, RoundRobinPick, WeightedRandom,
};
use disagg_core::{
    Endpoint, KvConnector, Orchestrator, OrchestratorConfig, Role, Router, StaticSource, VllmNixl,
};
use disagg_http::{HttpTransport, HttpTransportConfig, PdService, PdServiceConfig};

use crate::BoxError;

/// Flags of `serve`. `--prefill` and `--decode` follow the SGLang and vLLM routers.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// A prefill engine's base URL (http://host:port). Repeat for several engines.
    #[arg(long = "prefill", value_name = "URL", required = true)]
    prefill: Vec<String>,
    /// A decode engine's base URL (http://host:port). Repeat for several engines.
    #[arg(long = "decode", value_name = "URL", required = true)]
    decode: Vec<String>,
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
    /// An engine's weight for `weighted_random`, as URL=WEIGHT (default 1). Repeatable.
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
    /// When no prefill engine is configured or available, serve requests on a decode
    /// engine alone (it computes the prompt itself) instead of answering 503. Answers
    /// served this way carry `x-disagg-handoff: decode-only`.
    #[arg(long)]
    decode_only_fallback: bool,
    /// What to do when the prefill answers without `kv_transfer_params`: let the decode
    /// engine compute the prompt itself (`x-disagg-handoff: none`), or fail with 502.
    #[arg(long, value_enum, default_value_t = MissingKvArg::LocalPrefill)]
    missing_kv: MissingKvArg,
    /// Forward the client's `Authorization` header to the engines.
    #[arg(long)]
    forward_authorization: bool,
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
    /// Sticky per session (x-session-id, then `user`), bounded by load.
    ConsistentHash,
}

impl Policy {
    fn pick(self, weights: &[(String, f64)]) -> Box<dyn Pick> {
        match self {
            Policy::WeightedRandom => Box::new(
                weights
                    .iter()
                    .fold(WeightedRandom::new(), |w, (url, weight)| {
                        w.with_weight(url.trim_end_matches('/'), *weight)
                    }),
            ),
            Policy::RoundRobin => Box::new(RoundRobinPick::new()),
            Policy::Random => Box::new(RandomPick::new()),
            Policy::LeastInFlight => Box::new(LeastInFlightPick::new()),
            Policy::PowerOfTwo => Box::new(PowerOfTwo::new()),
            Policy::ConsistentHash => Box::new(ConsistentHash::default()),
        }
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
    Ok((url.to_owned(), w))
}

fn secs(v: f64, flag: &str) -> Result<Duration, BoxError> {
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
        self.prefill.iter().chain(&self.decode).map(String::as_str)
    }
}

/// The proxy's parts that every serving thread shares.
struct Shared {
    source: Arc<StaticSource>,
    router: Arc<dyn Router>,
    connector: Arc<dyn KvConnector>,
    transport: HttpTransportConfig,
    config: OrchestratorConfig,
    service: PdServiceConfig,
}

impl Shared {
    fn from_args(args: &ServeArgs) -> Result<Self, BoxError> {
        let mut endpoints = Vec::new();
        for url in &args.prefill {
            endpoints.push(Endpoint::new(url, Role::Prefill)?);
        }
        for url in &args.decode {
            endpoints.push(Endpoint::new(url, Role::Decode)?);
        }
        let mut transport = HttpTransportConfig::default();
        transport.connect_timeout = secs(args.connect_timeout, "connect-timeout")?;
        let mut config = OrchestratorConfig::default();
        config.prefill_timeout = secs(args.prefill_timeout, "prefill-timeout")?;
        config.decode_head_timeout = secs(args.decode_timeout, "decode-timeout")?;
        config.forward_authorization = args.forward_authorization;
        if args.decode_only_fallback {
            config.no_prefill = NoPrefill::DecodeOnly;
        }
        config.missing_kv = match args.missing_kv {
            MissingKvArg::LocalPrefill => MissingKv::LocalPrefill,
            MissingKvArg::Fail => MissingKv::Fail,
        };
        let router: Arc<dyn Router> = Arc::new(PerLeg::new(
            args.prefill_policy
                .unwrap_or(args.policy)
                .pick(&args.weights),
            args.decode_policy
                .unwrap_or(args.policy)
                .pick(&args.weights),
        ));
        let mut service = PdServiceConfig::default();
        service.max_body_bytes = args.max_body_bytes;
        Ok(Shared {
            source: Arc::new(StaticSource::new(endpoints)),
            router,
            connector: Arc::new(VllmNixl::new()),
            transport,
            config,
            service,
        })
    }

    /// One thread's service: shared source, router and connector (so load and
    /// round-robin state are global), a transport and its pool of its own.
    fn service(&self) -> PdService {
        let orchestrator = Orchestrator::builder(
            Arc::clone(&self.source),
            HttpTransport::new(self.transport.clone()),
        )
        .router(Arc::clone(&self.router))
        .connector(Arc::clone(&self.connector))
        .config(self.config.clone())
        .build();
        PdService::with_config(orchestrator, self.service.clone())
    }
}

/// Run the proxy described by `args` until `shutdown` turns `true`; `on_bound` gets the
/// listening address once every serving thread is up. Blocks the calling thread.
///
/// # Errors
///
/// Invalid flags, or an address that cannot be bound.
pub fn run(
    args: &ServeArgs,
    shutdown: tokio::sync::watch::Receiver<bool>,
    on_bound: impl FnOnce(SocketAddr),
) -> Result<(), BoxError> {
    let shared = Shared::from_args(args)?;
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from));
    disagg_http::server::serve_threads(
        args.listen,
        threads,
        move || shared.service(),
        shutdown,
        on_bound,
    )
    .map_err(|e| format!("cannot serve on {}: {e}", args.listen))?;
    Ok(())
}
