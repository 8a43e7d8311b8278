//! The flags of `serve`, as clap reads them, and their checks: engines, routing,
//! connector, reliability, client bodies; each flag's help is its documentation.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use disagg_affinity::{
    CacheAware, ConsistentHash, LeastInFlight, PowerOfTwo, Random, RoundRobin, WeightedRandom,
};
use disagg_connectors::lmcache::LmcacheReceiver;
use disagg_core::orchestrator::OrchestratorConfig;
use disagg_core::orchestrator::{KvRelease, PrefillFailure};
use disagg_core::router::Pick;
use disagg_http::PdServiceConfig;
use disagg_pairing::{EcProfile, KvProfile};
use disagg_resilience::{AdmissionConfig, HealthConfig, RetryPolicy};

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
    pub(crate) prefill: Vec<String>,
    /// A decode engine's base URL (http://host:port). Repeat for several engines.
    ///
    /// An engine running several data-parallel ranks can be given once per rank as
    /// URL@RANK, or as URL@FIRST-LAST for a range (`http://d:8200@0-3`; also for
    /// --prefill): each rank is then routed to, and load-counted, on its own, and the
    /// connector names the rank to the engine.
    #[arg(long = "decode", value_name = "URL")]
    pub(crate) decode: Vec<String>,
    /// An encoder-only engine (E/P/D; vLLM `--ec-transfer-config` with `ec_role:
    /// ec_producer`): its base URL. Repeat for several. A chat request with media parts
    /// (`image_url`, `input_audio`, `audio_url`, `video_url`), a Responses request with
    /// `input_image` or `input_audio` parts, or a Messages request with `image` blocks
    /// has its items encoded there first, concurrently, and its prefill and decode legs
    /// carry the encoders' `ec_transfer_params`; other requests never touch an encoder.
    /// With `--connector sglang` the prefill calls its encoders itself (`--language-only
    /// --encoder-urls`): encoders given here are then health-checked and listed in
    /// metrics, never sent a leg.
    #[arg(long = "encode", value_name = "URL")]
    pub(crate) encode: Vec<String>,
    /// Seconds for the whole encoder stage of a request (every encoder leg, retries
    /// included); past it, 504 `encode_timeout`.
    #[arg(long, value_name = "SECS", default_value_t = 60.0)]
    pub(crate) encode_timeout: f64,
    /// At most N images per encoder leg (audio and video items go one per leg).
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = at_least_one)]
    pub(crate) encode_image_batch: usize,
    /// E/P/D: a chat request's image, audio and video items whose embeddings the
    /// encoders handed over reach the prefill and decode as vLLM's `image_embeds`,
    /// `audio_embeds` and `video_embeds` placeholder parts (same `uuid`, the encoder's
    /// metadata) instead of their media, so no engine after the encoders receives the
    /// media bytes. The engines must run with `--enable-mm-embeds`. A modality with any
    /// item not handed over keeps its media (vLLM refuses raw and embedded items of one
    /// modality in one request); the Responses and Messages APIs always do.
    #[arg(long)]
    pub(crate) encode_placeholders: bool,
    /// E/P/D: vLLM's EC connector between the encoders and their consumers. `example`
    /// (a shared store, `ECExampleConnector`, also what `ECCPUConnector` needs of the
    /// proxy): encoders first, then routing. `mooncake` (`ECMooncakeConnector`, push):
    /// the request is routed first, its encoder legs name the consumer's address
    /// (`--ec-address`) and a transfer id per item, and its consumer leg (pinned to that
    /// engine and data-parallel rank) names each item's hash and transfer id.
    #[arg(long, value_enum, default_value_t = EcConnectorArg::Example)]
    pub(crate) ec_connector: EcConnectorArg,
    /// With `--ec-connector mooncake`: where a consumer engine (its URL without @RANK)
    /// listens for its encoders, its vLLM `ec_ip` and `ec_port`, as URL=HOST:PORT
    /// (default 127.0.0.1:14579, vLLM's). Rank D listens at PORT + D·`--ec-tp-size`.
    /// Once per engine; repeatable for several.
    #[arg(long = "ec-address", value_name = "URL=HOST:PORT", value_parser = parse_ec_address)]
    pub(crate) ec_addresses: Vec<(String, String, u16)>,
    /// With `--ec-connector mooncake`: the consumers' tensor-parallel size (default 1).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) ec_tp_size: Option<u32>,
    /// With `--ec-connector mooncake`: the consumers' data-parallel size (vLLM's
    /// `--data-parallel-size`; default 1). A request whose consumer is given without
    /// @RANK is given one of its N ranks, round robin per consumer, its items pushed to
    /// that rank's port and its consumer leg pinned there (`X-data-parallel-rank`); a
    /// rank the endpoint names is kept. With 1, rank 0 is pinned.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) ec_dp_size: Option<u32>,
    /// The model an engine serves, as URL=NAME[,NAME...] (URL without @RANK covers every
    /// rank). Once any engine declares models, requests are routed by their `model` to
    /// the engines serving it, an unknown model is answered 404 naming the served ones,
    /// and GET /v1/models lists the declared models. Engines declaring none serve any
    /// other name. Once per engine (all its names in one); repeatable for several.
    #[arg(long = "served-model", value_name = "URL=NAME[,NAME]", value_parser = parse_models)]
    pub(crate) served_models: Vec<(String, Vec<String>)>,
    /// Disaggregate only requests whose prompt is estimated at N tokens or more (one
    /// token per 4 bytes of prompt JSON; token-id prompts counted exactly); shorter ones
    /// go to a decode engine alone and their answer carries `x-disagg-handoff: direct`.
    /// With `--decode-policy kv_events`, only the tokens the best decode engine does not
    /// already cache count (a follow-up turn whose prefix sits on a decode engine is
    /// served there alone).
    #[arg(long, value_name = "N")]
    pub(crate) min_prefill_tokens: Option<usize>,
    /// Open the engines' admin routes (LoRA load and unload, cache resets, sleep and
    /// wake, profiling, weight updates; the list in docs/routes.md), closed by default
    /// (403 `admin_route_closed`). Opened, each goes to every prefill and decode engine
    /// of the body's `model` (every engine when it names none), and the answer lists
    /// each engine's result: a pair whose sides disagree about a LoRA adapter cannot
    /// hand KV over.
    #[arg(long)]
    pub(crate) admin_routes: bool,
    /// The KV-transfer protocol the engines speak: vLLM NIXL (sequential: the prefill's
    /// answer carries the handoff), SGLang bootstrap or vLLM Mooncake (concurrent: both
    /// legs at once, meeting through the prefill's bootstrap server).
    #[arg(long, value_enum, default_value_t = ConnectorArg::Nixl)]
    pub(crate) connector: ConnectorArg,
    /// LMCache (`--connector lmcache`): where its notifications come in and where each
    /// decode receives KV.
    #[command(flatten)]
    pub(crate) lmcache: LmcacheArgs,
    /// Bidirectional multi-turn KV (vLLM NIXL).
    #[command(flatten)]
    pub(crate) bidi: super::bidi::BidiArgs,
    /// What an engine declares about its KV transfer, checked for every prefill/decode
    /// pair at start-up: URL=CONNECTOR,ROLE,TP, each part optional (e.g.
    /// `http://p:8100=NixlConnector,kv_producer,8` or `http://d:8200=,,4`). A pair whose
    /// connectors differ, whose roles cannot hand over, or whose TP sizes the connector
    /// cannot bridge stops the proxy with an error naming both engines (LMCache: equal
    /// sizes only, a decode's size being its --lmcache-receiver port count). Once per
    /// engine; repeatable for several.
    #[arg(long = "kv-profile", value_name = "URL=CONNECTOR,ROLE,TP", value_parser = parse_profile)]
    pub(crate) kv_profiles: Vec<(String, KvProfile)>,
    /// What an engine declares about its encoder-output transfer (E/P/D; vLLM
    /// `--ec-transfer-config`): URL=CONNECTOR,ROLE, each part optional, ROLE one of
    /// `ec_producer`, `ec_consumer`, `ec_both` (e.g. `http://e:8300=ECExampleConnector,ec_producer`,
    /// `http://p:8100=example,ec_consumer`). An encoder whose consumer (the prefill, or
    /// the decode when there is no prefill) runs another EC connector, or roles that
    /// cannot hand over, stop the proxy with an error naming both engines. Once per
    /// engine; repeatable for several.
    #[arg(long = "ec-profile", value_name = "URL=CONNECTOR,ROLE", value_parser = parse_ec_profile)]
    pub(crate) ec_profiles: Vec<(String, EcProfile)>,
    /// Further attempts, on a newly picked pair (and a new room or transfer id), after a
    /// prefill leg that could not connect or answered 502/503/504, or a decode leg that
    /// could not connect, before any answer reached the client; with jittered
    /// exponential backoff, within the deadline and the retry budget.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub(crate) retries: u32,
    /// Deadlines, retries, admission and KV release.
    #[command(flatten)]
    pub(crate) reliability: ReliabilityArgs,
    /// Endpoints discovered in Kubernetes, DNS or a file, besides --prefill/--decode.
    #[command(flatten)]
    pub(crate) discovery: crate::discover::DiscoveryArgs,
    /// The `kv_events` policy: the engines' KV-event publishers, and the tokenizer.
    #[command(flatten)]
    pub(crate) kv_events: crate::kv_events::KvEventsArgs,
    /// Metrics, traces and the access log.
    #[command(flatten)]
    pub(crate) observe: crate::observe::ObserveArgs,
    /// The address the proxy listens on.
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:8000")]
    pub(crate) listen: SocketAddr,
    /// Threads serving requests, each with its own event loop, listening socket and
    /// connection pool (default: the number of CPUs).
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    pub(crate) threads: Option<usize>,
    /// How endpoints are picked, for both legs (see --prefill-policy, --decode-policy).
    #[arg(long, value_enum, default_value_t = Policy::RoundRobin)]
    pub(crate) policy: Policy,
    /// How the prefill endpoint is picked (default: --policy).
    #[arg(long, value_enum)]
    pub(crate) prefill_policy: Option<Policy>,
    /// How the decode endpoint is picked (default: --policy).
    #[arg(long, value_enum)]
    pub(crate) decode_policy: Option<Policy>,
    /// An engine's weight for `weighted_random` and `consistent_hash`, as URL=WEIGHT
    /// (default 1): URL without @RANK weighs every rank endpoint of the engine (each
    /// draws W), URL@RANK one rank. It overrides a weight discovery found for the same
    /// engine. Once per engine or rank; repeatable for several.
    #[arg(long = "weight", value_name = "URL=WEIGHT", value_parser = parse_weight)]
    pub(crate) weights: Vec<(String, f64)>,
    /// Seconds for the whole prefill exchange (connect, head and answer); past it, 504.
    #[arg(long, value_name = "SECS", default_value_t = 300.0)]
    pub(crate) prefill_timeout: f64,
    /// Seconds from sending the decode leg to its response head; past it, 504.
    #[arg(long, value_name = "SECS", default_value_t = 300.0)]
    pub(crate) decode_timeout: f64,
    /// Seconds to establish a TCP connection to an engine.
    #[arg(long, value_name = "SECS", default_value_t = 5.0)]
    pub(crate) connect_timeout: f64,
    /// Largest client request body, in bytes; larger ones are answered 413.
    #[arg(long, value_name = "BYTES", default_value_t = 32 * 1024 * 1024)]
    pub(crate) max_body_bytes: usize,
    /// Time and memory limits on client request bodies.
    #[command(flatten)]
    pub(crate) client_body: ClientBodyArgs,
    /// Same as `--prefill-failure decode-only` (the proxy then starts with no prefill
    /// engine too).
    #[arg(long, hide = true)]
    pub(crate) decode_only_fallback: bool,
    /// What to do when the prefill answers without `kv_transfer_params`: let the decode
    /// engine compute the prompt itself (`x-disagg-handoff: none`), or fail with 502.
    #[arg(long, value_enum, default_value_t = MissingKvArg::LocalPrefill)]
    pub(crate) missing_kv: MissingKvArg,
    /// The vLLM engines' `--max-logprobs` (vLLM's default 20; -1: unbounded). The proxy
    /// refuses, before any engine is contacted, logprob counts above it: the prefill
    /// leg carries none, so only the decode would refuse them, after a prefill ran.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 20,
        allow_negative_numbers = true
    )]
    pub(crate) max_logprobs: i64,
    /// The vLLM engines' `VLLM_MAX_STOP_STRINGS` (default 4): longer `stop` lists are
    /// refused before any engine is contacted, for the same reason.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub(crate) max_stop_strings: usize,
    /// `--connector nixl`, chat: the decode leg carries the prompt's token ids the
    /// prefill made (vLLM 0.33's `kv_transfer_params.prompt_token_ids`), so the decode
    /// neither templates nor tokenizes. `auto`: for the decode engines whose
    /// `GET /version` (read at start) says vLLM 0.33 or later, or whose endpoints file
    /// entry declares `engine_version`.
    #[arg(long, value_enum, value_name = "WHEN", default_value_t = ReuseArg::Auto)]
    pub(crate) prompt_token_reuse: ReuseArg,
    /// Forward the client's `Authorization` header to the engines (not with client keys:
    /// the proxy's keys are never passed on; an --engine-api-key replaces it).
    #[arg(long)]
    pub(crate) forward_authorization: bool,
    /// API keys, limits per key, TLS in and out (docs/security.md).
    #[command(flatten)]
    pub(crate) edge: crate::edge::EdgeArgs,
    /// Seconds that requests in flight at SIGTERM or Ctrl-C (streams included) may run
    /// on. The listening socket closes at once and idle connections are closed; past
    /// this deadline the connections still open are cut and the process exits (status 0).
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    pub(crate) drain_timeout: f64,
    /// Seconds a write to a client may wait with the client taking no byte before its
    /// connection is closed (0: no limit). A client that stops reading a stream would
    /// otherwise hold its engine's slot for as long as it stays connected.
    #[arg(long, value_name = "SECS", default_value_t = 60.0)]
    pub(crate) client_send_timeout: f64,
    /// Client connections open at once, all threads together (at least 1). Past it, new
    /// connections wait in the listen backlog until one closes. Keep it under the
    /// process's open-file limit (`ulimit -n`) less the engine connections.
    #[arg(long, value_name = "N", default_value_t = disagg_http::server::DEFAULT_MAX_CONNECTIONS, value_parser = at_least_one)]
    pub(crate) max_connections: usize,
}

/// Flags that hold client request bodies in time and in memory (docs/reliability.md).
#[derive(Debug, Clone, Args)]
pub struct ClientBodyArgs {
    /// Seconds for a client's whole request body to arrive once its head is read; past
    /// it, 408 `request_timeout` and the connection is closed.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    pub(crate) body_timeout: f64,
    /// Bytes that the request bodies being received may hold at once, all connections
    /// together, taken as their bytes arrive (default 1 GiB; at least --max-body-bytes).
    /// A body whose next bytes would go past it is answered 503 `server_busy` with
    /// `retry-after` there, the rest unread, and its connection closed.
    #[arg(long, value_name = "BYTES", default_value_t = disagg_http::body::DEFAULT_BODY_BUDGET)]
    pub(crate) max_buffered_bytes: usize,
}

impl ClientBodyArgs {
    /// Apply the flags to `config`, whose `max_body_bytes` is already set.
    pub(crate) fn apply(&self, config: &mut PdServiceConfig) -> Result<(), BoxError> {
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
    pub(crate) lmcache_notify: Option<String>,
    /// LMCache: where a decode engine receives KV, as
    /// URL=HOST:INIT_PORT[,INIT_PORT...]:ALLOC_PORT[,ALLOC_PORT...] (its `pd_peer_host`,
    /// `pd_peer_init_port`, `pd_peer_alloc_port`; one port of each per TP rank, and the
    /// decode leg waits for one notification per rank). Required for every --decode
    /// engine with `--connector lmcache`. The port count is the decode's TP size: a
    /// prefill whose --kv-profile declares another TP size is refused at start-up (each
    /// prefill rank pushes to the port of its own rank). Once per engine; repeatable for
    /// several.
    #[arg(long = "lmcache-receiver", value_name = "URL=HOST:INIT:ALLOC", value_parser = parse_receiver)]
    pub(crate) lmcache_receivers: Vec<(String, LmcacheReceiver)>,
    /// LMCache: seconds after which a request's registration for its notifications,
    /// made before its prefill leg is sent, is forgotten (the prefill and handoff
    /// budgets normally end the wait first). Default: --prefill-timeout plus
    /// --handoff-timeout plus 10 s (320 s with their defaults; at least 10 s, a 0 budget
    /// being no time for its step, not "no limit"). Shorter than --prefill-timeout plus
    /// --handoff-timeout is refused at start: a slow prefill's request would fail.
    #[arg(long, value_name = "SECS")]
    pub(crate) lmcache_notify_ttl: Option<f64>,
}

pub(crate) fn parse_receiver(s: &str) -> Result<(String, LmcacheReceiver), String> {
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
    pub(crate) deadline: Option<f64>,
    /// Let clients shorten their deadline with `x-disagg-deadline-ms`.
    #[arg(long)]
    pub(crate) client_deadline: bool,
    /// Seconds for each step of the connector's handoff work (bootstrap lookups,
    /// folding the prefill's answer into the decode leg); past it, 504
    /// `handoff_timeout`.
    #[arg(long, value_name = "SECS", default_value_t = 10.0)]
    pub(crate) handoff_timeout: f64,
    /// Seconds of silence allowed between two chunks of the decode's answer (0: no
    /// limit); past it, the stream ends with `decode_idle_timeout`.
    #[arg(long, value_name = "SECS", default_value_t = 120.0)]
    pub(crate) decode_idle_timeout: f64,
    /// Milliseconds of backoff before the first retry, doubled for each further one,
    /// drawn with full jitter.
    #[arg(long, value_name = "MS", default_value_t = 20)]
    pub(crate) retry_backoff_ms: u64,
    /// Retries allowed per request on average (the retry budget), beyond a reserve of
    /// 10; stops retry storms when a pool fails.
    #[arg(long, value_name = "RATIO", default_value_t = 0.2)]
    pub(crate) retry_budget: f64,
    /// When the prefill cannot be had (no prefill engine available, or its leg failed
    /// on the engine's side after retries): `fail` (503 or the prefill's error), or
    /// `decode-only` (serve on a decode engine alone, marked `x-disagg-handoff:
    /// decode-only` and `x-disagg-fallback: REASON`, counted in /metrics; the proxy then
    /// starts with decode engines only, too).
    #[arg(long, value_enum, default_value_t = PrefillFailureArg::Fail)]
    pub(crate) prefill_failure: PrefillFailureArg,
    /// Requests served at once, all engines together (default: no limit); more wait in
    /// a FIFO queue.
    #[arg(long, value_name = "N")]
    pub(crate) max_in_flight: Option<usize>,
    /// Requests in flight on one engine endpoint (default: no limit); more wait in the
    /// queue.
    #[arg(long, value_name = "N")]
    pub(crate) max_in_flight_per_endpoint: Option<usize>,
    /// Hold a request, before its prefill is sent, while every decode engine of its
    /// model runs --decode-max-running requests or more (the engines' own counts with
    /// --load-source engine-metrics, this proxy's otherwise), for at most SECS; then 503
    /// `queue_timeout`. 0 (the default): never held.
    #[arg(long, value_name = "SECS", default_value_t = 0.0)]
    pub(crate) decode_admission_wait: f64,
    /// The requests one decode engine runs at once (vLLM's --max-num-seqs, SGLang's
    /// --max-running-requests; neither exposes it in its /metrics), for
    /// --decode-admission-wait.
    #[arg(long, value_name = "N")]
    pub(crate) decode_max_running: Option<usize>,
    /// Requests that may wait for admission; one more is answered 429 with
    /// `retry-after`.
    #[arg(long, value_name = "N", default_value_t = 1024)]
    pub(crate) max_queue: usize,
    /// Seconds a request may wait for admission; past it, 503 `queue_timeout`.
    #[arg(long, value_name = "SECS", default_value_t = 10.0)]
    pub(crate) queue_timeout: f64,
    /// Early release of a prefill's KV blocks when a NIXL request ends before its
    /// decode took them: `off` (the engine's lease frees them), or `abort-decode`
    /// (send the decode leg as a one-token request and drop it, so the decode engine
    /// frees them now).
    #[arg(long, value_enum, default_value_t = KvReleaseArg::Off)]
    pub(crate) kv_release: KvReleaseArg,
    /// Consecutive failures of an engine on one leg (unreachable, 5xx, out of its
    /// budget) that take that endpoint out of routing (0: never); it returns after
    /// --ejection-time, half-open, and the next result decides.
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub(crate) eject_after: u32,
    /// Seconds an endpoint stays out after its first ejection; doubled on each
    /// repeated one, up to --max-ejection-time.
    #[arg(long, value_name = "SECS", default_value_t = 5.0)]
    pub(crate) ejection_time: f64,
    /// Longest ejection, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 60.0)]
    pub(crate) max_ejection_time: f64,
    /// Seconds between active health checks (`GET --health-check-path` on every engine;
    /// 0: no active checks). Two failed checks in a row take the engine out, one pass
    /// brings it back.
    #[arg(long, value_name = "SECS", default_value_t = 0.0)]
    pub(crate) health_check_interval: f64,
    /// Seconds a health check may take.
    #[arg(long, value_name = "SECS", default_value_t = 1.0)]
    pub(crate) health_check_timeout: f64,
    /// The path of the engines' health check.
    #[arg(long, value_name = "PATH", default_value = "/health")]
    pub(crate) health_check_path: String,
    /// Seconds between reads of every engine's `GET /metrics` (engine telemetry and KV
    /// receipts; 0: never read), with the legs' engine key and TLS.
    #[arg(long, value_name = "SECS", default_value_t = 5.0)]
    pub(crate) engine_metrics_interval: f64,
    /// Seconds one read of an engine's `/metrics` may take.
    #[arg(long, value_name = "SECS", default_value_t = 2.0)]
    pub(crate) engine_metrics_timeout: f64,
    /// The largest `/metrics` body read from an engine, in bytes; a larger one fails
    /// that read.
    #[arg(long, value_name = "BYTES", default_value_t = 4 << 20)]
    pub(crate) engine_metrics_max_bytes: usize,
    /// A decode's KV receipt ratio (prompt tokens that arrived by KV transfer over those
    /// it took, in a window in which it was handed KV) below this counts against it.
    #[arg(long, value_name = "RATIO", default_value_t = 0.5)]
    pub(crate) receipt_threshold: f64,
    /// Windows in a row below --receipt-threshold that flag a decode as suspect.
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub(crate) receipt_windows: u32,
    /// What a suspect decode gets: `warn` (a flag and a warning) or `eject` (also taken
    /// out of the decode pool like an unhealthy endpoint, for --ejection-time, doubled
    /// on each repeat).
    #[arg(long, value_enum, default_value_t = SuspectActionArg::Warn)]
    pub(crate) suspect_action: SuspectActionArg,
    /// What the load-aware policies (least_in_flight, power_of_two, kv_events) weigh an
    /// engine by: `proxy` (this proxy's requests in flight there) or `engine-metrics`
    /// (the engine's own waiting plus running requests, every router's, from its
    /// `/metrics` at each --engine-metrics-interval, plus this proxy's change since).
    #[arg(long, value_enum, default_value_t = LoadSourceArg::Proxy)]
    pub(crate) load_source: LoadSourceArg,
    /// Mid-stream migration: a streamed vLLM answer whose decode breaks after it began
    /// is continued on another decode engine from the tokens already generated, up to
    /// N times per request (0, the default: off). vLLM >= 0.33 decodes
    /// (`return_token_ids`); see docs/reliability.md for what is not migrated.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub(crate) migration_limit: u32,
    /// Longest sequence (prompt and generated tokens) a request is tracked for
    /// migration; past it the request is no longer migratable.
    #[arg(long, value_name = "TOKENS", default_value_t = 32_768)]
    pub(crate) migration_max_seq_len: usize,
    /// Migrate requests that carry a `seed` too (their continuation's randomness
    /// differs from an unbroken run's).
    #[arg(long)]
    pub(crate) migration_allow_seed: bool,
    /// Continue migrated streams decode-only even when the request was disaggregated
    /// (by default such a continuation goes through a fresh prefill leg, whose prefix
    /// cache holds the prompt, and its KV handoff).
    #[arg(long)]
    pub(crate) migration_decode_only: bool,
}

/// `--load-source`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum LoadSourceArg {
    Proxy,
    EngineMetrics,
}

/// `--suspect-action`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum SuspectActionArg {
    Warn,
    Eject,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum PrefillFailureArg {
    Fail,
    DecodeOnly,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum KvReleaseArg {
    Off,
    AbortDecode,
}

impl ReliabilityArgs {
    /// `--prefill-failure decode-only`: a decode may serve a request alone.
    pub(crate) fn decode_only_on_prefill_failure(&self) -> bool {
        matches!(self.prefill_failure, PrefillFailureArg::DecodeOnly)
    }

    /// The time flags, by name, for the checks made before anything is built (read
    /// again where they are used; 0 is a duration too, where it means "off").
    pub(crate) fn time_flags(&self) -> Vec<(&'static str, f64)> {
        let mut flags = vec![
            ("handoff-timeout", self.handoff_timeout),
            ("decode-idle-timeout", self.decode_idle_timeout),
            ("decode-admission-wait", self.decode_admission_wait),
            ("queue-timeout", self.queue_timeout),
            ("ejection-time", self.ejection_time),
            ("max-ejection-time", self.max_ejection_time),
            ("health-check-interval", self.health_check_interval),
            ("health-check-timeout", self.health_check_timeout),
            ("engine-metrics-interval", self.engine_metrics_interval),
            ("engine-metrics-timeout", self.engine_metrics_timeout),
        ];
        flags.extend(self.deadline.map(|d| ("deadline", d)));
        flags
    }

    /// `--receipt-threshold` is a ratio, whether or not the engines' `/metrics` are read.
    pub(crate) fn check_receipt_threshold(&self) -> Result<(), BoxError> {
        if (0.0..=1.0).contains(&self.receipt_threshold) {
            Ok(())
        } else {
            Err("--receipt-threshold must be between 0 and 1".into())
        }
    }

    /// The health settings, and whether active checks run.
    pub(crate) fn health(&self) -> Result<(HealthConfig, bool), BoxError> {
        let mut config = HealthConfig::default();
        config.failure_threshold = self.eject_after;
        config.base_ejection = secs(self.ejection_time, "ejection-time")?;
        config.max_ejection = secs(self.max_ejection_time, "max-ejection-time")?;
        // 0 turns the checks off; anything else must be a duration (a negative or NaN
        // interval is refused, not taken for "off").
        let active = self.health_check_interval != 0.0;
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

    /// The engine telemetry settings, when `/metrics` is read at all.
    pub(crate) fn telemetry(&self) -> Result<Option<disagg_resilience::TelemetryConfig>, BoxError> {
        let engine_load = self.load_source == LoadSourceArg::EngineMetrics;
        self.check_receipt_threshold()?;
        let timeout = secs(self.engine_metrics_timeout, "engine-metrics-timeout")?;
        if self.engine_metrics_interval == 0.0 {
            if engine_load {
                return Err(
                    "--load-source engine-metrics reads the engines' /metrics: it needs an --engine-metrics-interval above 0".into(),
                );
            }
            return Ok(None);
        }
        let mut config = disagg_resilience::TelemetryConfig::default();
        config.interval = secs(self.engine_metrics_interval, "engine-metrics-interval")?;
        config.timeout = timeout;
        config.max_body = self.engine_metrics_max_bytes;
        config.receipt_threshold = self.receipt_threshold;
        config.suspect_windows = self.receipt_windows;
        config.suspect_action = match self.suspect_action {
            SuspectActionArg::Warn => disagg_resilience::SuspectAction::Warn,
            SuspectActionArg::Eject => disagg_resilience::SuspectAction::Eject,
        };
        config.engine_load = engine_load;
        Ok(Some(config))
    }

    /// Apply the flags to `config`; the retry policy and admission limits they ask for.
    pub(crate) fn apply(
        &self,
        config: &mut OrchestratorConfig,
        retries: u32,
    ) -> Result<Resilience, BoxError> {
        config.deadline = self.deadline.map(|d| secs(d, "deadline")).transpose()?;
        config.client_deadline = self.client_deadline;
        config.migration.limit = self.migration_limit;
        config.migration.max_seq_len = self.migration_max_seq_len;
        config.migration.allow_seed = self.migration_allow_seed;
        config.migration.decode_only = self.migration_decode_only;
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
        admission.max_queue = self.max_queue;
        admission.queue_timeout = secs(self.queue_timeout, "queue-timeout")?;
        config.kv_release = match self.kv_release {
            KvReleaseArg::Off => KvRelease::Off,
            KvReleaseArg::AbortDecode => KvRelease::abort_decode(),
        };
        let hold = self.decode_admission_wait != 0.0;
        let decode_hold = match (self.decode_admission_wait, self.decode_max_running) {
            _ if !hold => None,
            (_, None) => {
                return Err(
                    "--decode-admission-wait needs --decode-max-running (the engines do not expose their limit)".into(),
                );
            }
            (_, Some(0)) => return Err("--decode-max-running must be at least 1".into()),
            (wait, Some(n)) => Some((n, secs(wait, "decode-admission-wait")?)),
        };
        Ok(Resilience {
            retry,
            admission,
            per_endpoint: self.max_in_flight_per_endpoint,
            decode_hold,
        })
    }
}

/// The resilience pieces the flags ask for.
pub(crate) struct Resilience {
    pub(crate) retry: RetryPolicy,
    pub(crate) admission: AdmissionConfig,
    /// `--max-in-flight-per-endpoint`: the router's decorator
    /// (`disagg_resilience::Limits::per_endpoint`), the only place the limit lives.
    pub(crate) per_endpoint: Option<usize>,
    /// `--decode-admission-wait` with `--decode-max-running`: the router's decorator
    /// (`disagg_resilience::Limits::decode_hold`).
    pub(crate) decode_hold: Option<(usize, Duration)>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
#[value(rename_all = "snake_case")]
pub(crate) enum Policy {
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
    pub(crate) fn pick(
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

/// `--prompt-token-reuse`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReuseArg {
    /// For decode engines that report vLLM 0.33 or later.
    Auto,
    /// Always.
    On,
    /// Never.
    Off,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
#[value(rename_all = "kebab-case")]
pub(crate) enum MissingKvArg {
    /// Send the decode leg without a handoff.
    LocalPrefill,
    /// Answer 502.
    Fail,
}

/// vLLM's EC connector between encoders and consumers, as far as the proxy's legs differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum EcConnectorArg {
    /// A shared store (`ECExampleConnector`): the encoders run first, then routing.
    Example,
    /// `ECMooncakeConnector`: the consumer chosen first, the encoders push to it.
    Mooncake,
}

/// A count of at least 1 (0 would mean nothing, and is refused rather than taken as 1).
pub(crate) fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".to_owned()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// `URL=HOST:PORT`: a consumer's EC push address.
pub(crate) fn parse_ec_address(s: &str) -> Result<(String, String, u16), String> {
    let (url, addr) = s
        .split_once('=')
        .ok_or_else(|| format!("expected URL=HOST:PORT, got {s:?}"))?;
    let (host, port) = addr
        .rsplit_once(':')
        .ok_or_else(|| format!("expected HOST:PORT after '=', got {addr:?}"))?;
    let port: u16 = port.parse().map_err(|_| format!("not a port: {port:?}"))?;
    if url.is_empty() || host.is_empty() {
        return Err(format!("expected URL=HOST:PORT, got {s:?}"));
    }
    let url = url.trim_end_matches('/');
    if base_url(url) != url {
        return Err(format!(
            "{url}: the engine's URL without @RANK (rank D listens at PORT + D·--ec-tp-size)"
        ));
    }
    Ok((url.to_owned(), host.to_owned(), port))
}

pub(crate) fn parse_weight(s: &str) -> Result<(String, f64), String> {
    let (url, w) = s
        .rsplit_once('=')
        .ok_or_else(|| format!("`{s}` is not URL=WEIGHT"))?;
    let w: f64 = w.parse().map_err(|_| format!("`{w}` is not a number"))?;
    if !(w.is_finite() && w > 0.0) {
        return Err(format!("weight `{w}` must be a positive number"));
    }
    Ok((url.trim_end_matches('/').to_owned(), w))
}

/// `URL=NAME[,NAME...]`: the names held to the ceilings every source's are
/// ([`disagg_discovery::spec::model_names`]: 256 distinct names of at most 512 bytes),
/// duplicates collapsed.
pub(crate) fn parse_models(s: &str) -> Result<(String, Vec<String>), String> {
    let (url, names) = s
        .rsplit_once('=')
        .ok_or_else(|| format!("`{s}` is not URL=NAME[,NAME]"))?;
    let names = disagg_discovery::spec::model_names(
        names.split(',').map(str::trim).filter(|n| !n.is_empty()),
    )
    .map_err(|e| format!("{url}: {e}"))?;
    if names.is_empty() {
        return Err(format!("`{s}` names no model"));
    }
    Ok((url.trim_end_matches('/').to_owned(), names))
}

/// `url` without a data-parallel `@RANK` or `@FIRST-LAST` suffix, and its trailing `/`.
pub(crate) fn base_url(url: &str) -> &str {
    let base = match url.rsplit_once('@') {
        Some((base, ranks)) if ranks.bytes().all(|b| b.is_ascii_digit() || b == b'-') => base,
        _ => url,
    };
    base.trim_end_matches('/')
}

/// `url`, or one URL per rank when it ends in `@FIRST-LAST` (at most `max` ranks,
/// counted before any URL is made).
pub(crate) fn expand_ranks(url: &str, max: u32) -> Result<Vec<String>, BoxError> {
    let Some((base, range)) = url.rsplit_once('@') else {
        return Ok(vec![url.to_owned()]);
    };
    if !range.contains('-') {
        // One rank: its number is checked too (rank 60000 says a group of 60,001).
        if let Ok(rank) = range.parse::<disagg_discovery::Ranks>() {
            rank.within(max)
                .map_err(|e| format!("{url}: {e} (--max-dp-ranks)"))?;
        }
        return Ok(vec![url.to_owned()]);
    }
    let ranks: disagg_discovery::Ranks = range.parse().map_err(|_| {
        format!("{url}: the ranks after `@` must be RANK or FIRST-LAST (e.g. @0-3)")
    })?;
    let ranks = ranks
        .within(max)
        .map_err(|e| format!("{url}: {e} (--max-dp-ranks)"))?;
    Ok(ranks.into_iter().map(|r| format!("{base}@{r}")).collect())
}

/// `--ec-profile URL=CONNECTOR,ROLE`.
pub(crate) fn parse_ec_profile(s: &str) -> Result<(String, EcProfile), String> {
    let (url, spec) = s
        .rsplit_once('=')
        .ok_or_else(|| format!("`{s}` is not URL=CONNECTOR,ROLE"))?;
    let profile = spec.parse::<EcProfile>().map_err(|e| e.to_string())?;
    Ok((url.trim_end_matches('/').to_owned(), profile))
}

pub(crate) fn parse_profile(s: &str) -> Result<(String, KvProfile), String> {
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
                .map_err(|e: disagg_pairing::KvRoleError| e.to_string())?,
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
pub(crate) fn parse_prefills(values: &[String]) -> Result<Vec<(&str, Option<u16>)>, BoxError> {
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

/// The most seconds any seconds flag takes: 10^9 s, about 31 years. Far past any
/// timeout or interval that means something, and far below what a clock reading plus
/// the duration could overflow (`Instant + Duration` panics past the clock's range).
pub(crate) const MAX_SECS: f64 = 1e9;

/// `--{flag}`'s value in seconds, as a duration: refused when negative, not a number,
/// or above 10^9 seconds, about 31 years (none is taken as 0 or capped silently: a
/// clock reading plus a larger one could overflow, which panics). Every subcommand's
/// time flags are read with it or [`millis`].
///
/// # Errors
///
/// A message naming the flag.
pub fn secs(v: f64, flag: &str) -> Result<Duration, BoxError> {
    duration(v, 1.0, "seconds", flag)
}

/// `--{flag}`'s value in milliseconds, as a duration: refused as [`secs`] refuses
/// seconds.
///
/// # Errors
///
/// A message naming the flag.
pub fn millis(v: f64, flag: &str) -> Result<Duration, BoxError> {
    duration(v, 1e3, "milliseconds", flag)
}

/// `v` of `unit`, `per_second` of which make a second, as a duration.
fn duration(v: f64, per_second: f64, unit: &str, flag: &str) -> Result<Duration, BoxError> {
    let negative = || format!("--{flag} must be a non-negative number of {unit}").into();
    if v.is_nan() || v < 0.0 {
        return Err(negative());
    }
    let s = v / per_second;
    if s > MAX_SECS {
        return Err(format!(
            "--{flag} is too large: {v} {unit} (at most {MAX_SECS} seconds, about 31 years)"
        )
        .into());
    }
    Duration::try_from_secs_f64(s).map_err(|_| negative())
}

impl ServeArgs {
    /// The address to listen on.
    pub fn listen(&self) -> SocketAddr {
        self.listen
    }

    /// Whether a decode may serve a request alone when its prefill cannot be had:
    /// `--prefill-failure decode-only`, or its hidden alias `--decode-only-fallback`.
    pub(crate) fn decode_only(&self) -> bool {
        self.decode_only_fallback || self.reliability.decode_only_on_prefill_failure()
    }

    /// Every engine URL given, prefill then decode.
    pub fn engine_urls(&self) -> impl Iterator<Item = &str> {
        self.prefill
            .iter()
            .filter(|v| v.contains("://"))
            .chain(&self.decode)
            .chain(&self.encode)
            .map(String::as_str)
    }
}
