//! `disagg-proxy sim`: a simulated vLLM-like engine on chosen ports.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use clap::{Args, ValueEnum};
use disagg_sim::{Faults, KvMode, LmcacheReceiver, SimConfig, SimEngine, SimRole, SimTls};
use tokio::net::TcpListener;

use crate::BoxError;
use crate::serve::{millis, secs};

/// The P/D KV protocol of a simulated engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum KvModeArg {
    /// vLLM NIXL connector (sequential P then D; one engine plays both roles).
    Nixl,
    /// vLLM NixlPushConnector: the decode registers under its own request id and the
    /// prefill pairs it with a finished request of the same base id (one engine plays
    /// both roles).
    NixlPush,
    /// SGLang `--disaggregation-mode prefill` (bootstrap server on `--bootstrap`).
    SglangPrefill,
    /// SGLang `--disaggregation-mode decode`.
    SglangDecode,
    /// vLLM MooncakeConnector `kv_producer` (bootstrap HTTP server on `--bootstrap`).
    MooncakePrefill,
    /// vLLM MooncakeConnector `kv_consumer`.
    MooncakeDecode,
    /// vLLM + LMCacheConnectorV1 P/D sender (`kv_producer`): pushes the KV to the decode's
    /// receiver ports named in `disagg_spec` and notifies `--lmcache-proxy` over ZMQ.
    LmcachePrefill,
    /// vLLM + LMCacheConnectorV1 P/D receiver (`kv_consumer`), listening on
    /// `--lmcache-init-ports` and `--lmcache-alloc-ports`.
    LmcacheDecode,
}

impl From<KvModeArg> for KvMode {
    fn from(mode: KvModeArg) -> Self {
        match mode {
            KvModeArg::Nixl => KvMode::Nixl,
            KvModeArg::NixlPush => KvMode::NixlPush,
            KvModeArg::SglangPrefill => KvMode::Sglang(SimRole::Prefill),
            KvModeArg::SglangDecode => KvMode::Sglang(SimRole::Decode),
            KvModeArg::MooncakePrefill => KvMode::Mooncake(SimRole::Prefill),
            KvModeArg::MooncakeDecode => KvMode::Mooncake(SimRole::Decode),
            KvModeArg::LmcachePrefill => KvMode::Lmcache(SimRole::Prefill),
            KvModeArg::LmcacheDecode => KvMode::Lmcache(SimRole::Decode),
        }
    }
}

/// Flags of `sim`.
#[derive(Debug, Args)]
pub(crate) struct SimArgs {
    /// The OpenAI HTTP address.
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:8100")]
    listen: SocketAddr,
    /// The KV side-channel address (vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT).
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:5600")]
    side_channel: SocketAddr,
    /// The host this engine advertises as `remote_host` in `kv_transfer_params`.
    #[arg(long, default_value = "127.0.0.1")]
    advertised_host: String,
    /// The served model name.
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// The engine id (default: random).
    #[arg(long)]
    engine_id: Option<String>,
    /// Prefill cost per prompt token, in milliseconds.
    #[arg(long, default_value_t = 0.0)]
    prefill_ms_per_token: f64,
    /// Time between generated tokens, in milliseconds.
    #[arg(long, default_value_t = 0.0)]
    inter_token_ms: f64,
    /// The P/D KV protocol the engine speaks.
    #[arg(long, value_enum, default_value_t = KvModeArg::Nixl)]
    kv_mode: KvModeArg,
    /// The bootstrap server address of an SGLang or Mooncake prefill (default: an
    /// ephemeral port of 127.0.0.1, printed at start).
    #[arg(long, value_name = "HOST:PORT")]
    bootstrap: Option<SocketAddr>,
    /// How long a side waits for its peer (SGLang's bootstrap timeout), in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 300.0)]
    bootstrap_timeout: f64,
    /// Fixed scheduling delay before any completion request is worked on, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 0.0)]
    request_delay_ms: f64,
    /// Data-parallel ranks. vLLM modes: the X-data-parallel-rank header pins a request,
    /// else the engine's balancer picks (Mooncake: one engine id per rank). SGLang: the
    /// X-Data-Parallel-Rank header, routed_dp_rank or data_parallel_rank pins it, else a
    /// prefill follows the bootstrap room and a decode takes turns.
    #[arg(long, value_name = "N", default_value_t = 1)]
    dp_size: u32,
    /// vLLM's --max-num-seqs: at most N requests run at once, the others wait in the
    /// queue (a decode pulls their KV only once they run; the prefill holds it until
    /// then, or until --kv-lease).
    #[arg(long, value_name = "N")]
    max_num_seqs: Option<usize>,
    /// vLLM's --max-logprobs: requests asking for more logprobs per token are refused
    /// with 400 (vLLM modes).
    #[arg(long, value_name = "N", default_value_t = 20)]
    max_logprobs: u32,
    /// vLLM's --max-model-len: the context in tokens (prompt and completion); longer
    /// requests are refused with 400.
    #[arg(long, value_name = "TOKENS", default_value_t = SimConfig::default().max_model_len)]
    max_model_len: u32,
    /// LMCache prefill: its tensor-parallel size, each rank pushing to the receiver port
    /// of its index and notifying once (default: as many as the disagg_spec names ports).
    #[arg(long, value_name = "N")]
    lmcache_prefill_tp_size: Option<usize>,
    /// Fault: answer every completion request with this HTTP status and a vLLM-style error.
    #[arg(long, value_name = "STATUS")]
    fail_status: Option<u16>,
    /// Fault: answer the admin routes (LoRA load/unload, prefix-cache reset) with this
    /// HTTP status and a vLLM-style error, changing nothing.
    #[arg(long, value_name = "STATUS")]
    fail_admin_status: Option<u16>,
    /// Fault: accept completion requests and never answer them.
    #[arg(long)]
    hang: bool,
    /// Fault: abort each answer's connection after this many SSE events (0 for
    /// non-streaming answers: before the body is complete).
    #[arg(long, value_name = "N")]
    drop_after_chunks: Option<usize>,
    /// Fault: after this many SSE events, send nothing more and keep the connection open
    /// until the client leaves (non-streaming answers: after half the body). Wins over
    /// --drop-after-chunks.
    #[arg(long, value_name = "N")]
    stall_after_chunks: Option<usize>,
    /// Fault: vLLM NIXL prefills answer a JSON string as `kv_transfer_params` and hold
    /// no KV blocks.
    #[arg(long)]
    malformed_kv_params: bool,
    /// LMCache prefill: the proxy's ZMQ PULL address for KV-ready notifications
    /// (LMCache's pd_proxy_host:pd_proxy_port).
    #[arg(long, value_name = "HOST:PORT")]
    lmcache_proxy: Option<String>,
    /// LMCache decode: the address the receiver ports listen on (LMCache's pd_peer_host).
    #[arg(long, value_name = "IP", default_value_t = IpAddr::V4(Ipv4Addr::LOCALHOST))]
    lmcache_receiver_host: IpAddr,
    /// LMCache decode: the init port of each TP rank, comma-separated (0: ephemeral).
    #[arg(long, value_name = "PORTS", value_delimiter = ',', default_value = "0")]
    lmcache_init_ports: Vec<u16>,
    /// LMCache decode: the alloc port of each TP rank, comma-separated (0: ephemeral); as
    /// many as --lmcache-init-ports.
    #[arg(long, value_name = "PORTS", value_delimiter = ',', default_value = "0")]
    lmcache_alloc_ports: Vec<u16>,
    /// How long a decode holds received (LMCache) or a prefill held (NIXL, Mooncake) KV
    /// that nobody took, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    kv_lease: f64,
    /// vLLM NIXL decode with `bidirectional_kv_xfer`: answer with a KV handoff of its own
    /// (body, terminal stream chunk, Responses' final `response`) and hold those blocks
    /// for --decoder-kv-blocks-ttl, for the next turn's prefill to pull.
    #[arg(long)]
    decode_handoff: bool,
    /// How long a --decode-handoff decode holds its blocks, in seconds (vLLM's
    /// `decoder_kv_blocks_ttl`).
    #[arg(long, value_name = "SECS", default_value_t = 480.0)]
    decoder_kv_blocks_ttl: f64,
    /// vLLM NIXL prefill given a decode's own handoff: pull it only when it names at
    /// least this many tokens (vLLM's `kv_recompute_threshold`).
    #[arg(long, value_name = "N", default_value_t = 64)]
    kv_recompute_threshold: u64,
    /// Fault (LMCache prefill): send the KV-ready notifications this long after the push,
    /// in milliseconds, while the answer goes out at once.
    #[arg(long, value_name = "MS", default_value_t = 0.0)]
    notify_delay_ms: f64,
    /// Fault (LMCache prefill): probability (0 to 1) that each notification is lost.
    #[arg(long, value_name = "P", default_value_t = 0.0)]
    notify_loss: f64,
    /// Fault (LMCache prefill): extra copies of each notification.
    #[arg(long, value_name = "N", default_value_t = 0)]
    notify_duplicates: u32,
    /// Fault (vLLM NIXL decode): lose every handoff silently: answer 200 but never pull
    /// the KV, computing the prompt here (counted `local_compute` in GET /metrics); the
    /// prefill's KV expires unclaimed after its --kv-lease.
    #[arg(long)]
    lose_handoff: bool,
    /// Fault (vLLM NIXL decode): every KV transfer fails (counted in
    /// `vllm:nixl_num_failed_transfers`); the prompt is computed here, answered 200.
    #[arg(long)]
    fail_transfers: bool,
    /// Seed of the generator that decides which notifications --notify-loss loses.
    #[arg(long, value_name = "N", default_value_t = 0)]
    notify_seed: u64,
    /// What GET /version answers (default: 0.33.0, the vLLM release followed): a
    /// prefill and a decode of different versions model engines of different builds.
    #[arg(long, value_name = "VERSION")]
    engine_version: Option<String>,
    /// vLLM's --api-key: requests to /v1/... without `Authorization: Bearer KEY` are
    /// answered 401 `{"error": "Unauthorized"}` (other paths stay open, as in vLLM).
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
    /// Encoder disaggregation (E/P/D), as vLLM's `ec_role` with its shared-storage EC
    /// connector: `producer` (an encoder-only engine: every chat request is an encoder
    /// leg, its media items written to --ec-store, answered with `ec_transfer_params`)
    /// or `consumer` (every media item of a chat, Responses or Messages request, and
    /// every `image_embeds` / `audio_embeds` placeholder, is read from --ec-store; one
    /// never encoded fails the request with 500).
    #[arg(long, value_enum, requires = "ec_store")]
    ec_role: Option<EcRoleArg>,
    /// The directory encoders and consumers share (vLLM's `shared_storage_path`).
    #[arg(long, value_name = "DIR", requires = "ec_role")]
    ec_store: Option<std::path::PathBuf>,
    /// Encoder disaggregation by push, as vLLM's Mooncake EC connector: an encoder
    /// (`--ec-role producer`) pushes every item of a leg naming a `consumer_zmq` there;
    /// a consumer (`--ec-role consumer`) takes its items only from what was pushed to
    /// its EC ports (--ec-push-port) under the transfer ids its requests name. Without
    /// it both use --ec-store.
    #[arg(long, requires = "ec_role")]
    ec_push: bool,
    /// A push consumer's EC port (vLLM's `ec_port`; data-parallel rank `d` at PORT + d);
    /// implies --ec-push. Default: free ports, logged at start.
    #[arg(long, value_name = "PORT", requires = "ec_role")]
    ec_push_port: Option<u16>,
    /// How long a client may take to send a request head, in seconds, counted from the
    /// connection's opening or the end of the previous answer: past it the connection
    /// closes without an answer, so a kept-alive connection idle that long closes too
    /// (vLLM's uvicorn closes one idle for 5 s and has no limit on a head). More than 0.
    #[arg(long, value_name = "SECS", default_value_t = SimConfig::default().header_read_timeout.as_secs_f64())]
    header_read_timeout: f64,
    /// How long a client may take to send a request's whole body, in seconds, counted
    /// from its head: past it the request is answered 408 and the connection closed
    /// (vLLM's uvicorn waits for ever). More than 0.
    #[arg(long, value_name = "SECS", default_value_t = SimConfig::default().body_read_timeout.as_secs_f64())]
    body_read_timeout: f64,
    /// Serve HTTPS with this certificate chain (PEM), as vLLM's --ssl-certfile.
    #[arg(long, value_name = "PATH", requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The private key of --tls-cert (PEM), as vLLM's --ssl-keyfile.
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// Require client certificates signed by the CAs of this PEM file (mutual TLS), as
    /// vLLM's --ssl-ca-certs with --ssl-cert-reqs 2.
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    tls_client_ca: Option<std::path::PathBuf>,
}

/// `--ec-role`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum EcRoleArg {
    /// vLLM `ec_producer`: an encoder-only engine.
    Producer,
    /// vLLM `ec_consumer`: a prefill or prefill-decode engine reading the encoders'
    /// output.
    Consumer,
}

/// The HTTPS settings the flags describe.
fn tls(args: &SimArgs) -> Result<Option<SimTls>, BoxError> {
    // Regular files of at most 1 MiB each (a PEM file is a few KiB).
    let read = |flag: &str, path: &std::path::Path| {
        crate::files::read_text(path, crate::files::MAX_FILE_BYTES)
            .map_err(|e| format!("{flag} {}: {e}", path.display()))
    };
    let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) else {
        return Ok(None);
    };
    Ok(Some(SimTls {
        cert_pem: read("--tls-cert", cert)?,
        key_pem: read("--tls-key", key)?,
        client_ca_pem: args
            .tls_client_ca
            .as_deref()
            .map(|p| read("--tls-client-ca", p))
            .transpose()?,
    }))
}

/// `--{flag}` in seconds, as [`secs`] reads it, and more than 0: a read limit of 0
/// would cut every connection (or body) at once.
fn read_limit(v: f64, flag: &str) -> Result<std::time::Duration, BoxError> {
    let limit = secs(v, flag)?;
    if limit.is_zero() {
        return Err(format!("--{flag} must be more than 0 seconds").into());
    }
    Ok(limit)
}

/// The engine configuration the flags describe.
fn config(args: &SimArgs) -> Result<SimConfig, BoxError> {
    if args.lmcache_init_ports.len() != args.lmcache_alloc_ports.len() {
        return Err(format!(
            "--lmcache-init-ports names {} ports but --lmcache-alloc-ports {} (one of each per TP rank)",
            args.lmcache_init_ports.len(),
            args.lmcache_alloc_ports.len()
        )
        .into());
    }
    if !(0.0..=1.0).contains(&args.notify_loss) {
        return Err(format!(
            "--notify-loss: {} is not a probability (0 to 1)",
            args.notify_loss
        )
        .into());
    }
    if args.kv_mode == KvModeArg::LmcachePrefill && args.lmcache_proxy.is_none() {
        tracing::warn!(
            "--kv-mode lmcache-prefill without --lmcache-proxy: requests with a disagg_spec will fail"
        );
    }
    Ok(SimConfig {
        model: args.model.clone(),
        engine_id: args.engine_id.clone(),
        advertised_host: args.advertised_host.clone(),
        prefill_delay_per_token: millis(args.prefill_ms_per_token, "prefill-ms-per-token")?,
        inter_token_delay: millis(args.inter_token_ms, "inter-token-ms")?,
        kv_mode: args.kv_mode.into(),
        bootstrap_timeout: secs(args.bootstrap_timeout, "bootstrap-timeout")?,
        request_delay: millis(args.request_delay_ms, "request-delay-ms")?,
        dp_size: args.dp_size.max(1),
        max_num_seqs: args.max_num_seqs,
        max_logprobs: args.max_logprobs,
        max_model_len: args.max_model_len,
        lmcache_prefill_tp_size: args.lmcache_prefill_tp_size,
        kv_lease: secs(args.kv_lease, "kv-lease")?,
        decode_handoff: args.decode_handoff,
        decoder_kv_blocks_ttl: secs(args.decoder_kv_blocks_ttl, "decoder-kv-blocks-ttl")?,
        kv_recompute_threshold: args.kv_recompute_threshold,
        lmcache_proxy: args.lmcache_proxy.clone(),
        lmcache_receiver: LmcacheReceiver {
            host: args.lmcache_receiver_host,
            init_ports: args.lmcache_init_ports.clone(),
            alloc_ports: args.lmcache_alloc_ports.clone(),
        },
        notify_seed: args.notify_seed,
        api_key: args.api_key.clone(),
        version: args
            .engine_version
            .clone()
            .unwrap_or_else(|| SimConfig::default().version),
        header_read_timeout: read_limit(args.header_read_timeout, "header-read-timeout")?,
        body_read_timeout: read_limit(args.body_read_timeout, "body-read-timeout")?,
        tls: tls(args)?,
        ec: match (args.ec_role, &args.ec_store) {
            (Some(role), Some(store)) => Some(disagg_sim::EcConfig {
                role: match role {
                    EcRoleArg::Producer => disagg_sim::EcRole::Producer,
                    EcRoleArg::Consumer => disagg_sim::EcRole::Consumer,
                },
                store: store.clone(),
            }),
            _ => None,
        },
        ec_push: args.ec_push || args.ec_push_port.is_some(),
        ec_push_port: args.ec_push_port,
        faults: Faults {
            status: args.fail_status,
            hang: args.hang,
            drop_after_chunks: args.drop_after_chunks,
            stall_after_chunks: args.stall_after_chunks,
            malformed_kv_params: args.malformed_kv_params,
            notify_delay: millis(args.notify_delay_ms, "notify-delay-ms")?,
            notify_loss: args.notify_loss,
            notify_duplicates: args.notify_duplicates,
            admin_status: args.fail_admin_status,
            lose_handoff: args.lose_handoff,
            fail_transfers: args.fail_transfers,
            ..Faults::default()
        },
        ..SimConfig::default()
    })
}

pub(crate) async fn run(args: SimArgs) -> Result<(), BoxError> {
    let config = config(&args)?;
    let http = TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let side = TcpListener::bind(args.side_channel)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.side_channel))?;
    let engine = match args.bootstrap {
        Some(addr) => {
            let bootstrap = TcpListener::bind(addr)
                .await
                .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
            SimEngine::start_with_bootstrap(config, http, side, bootstrap).await?
        }
        None => SimEngine::start_on(config, http, side).await?,
    };
    let kv_mode = args.kv_mode.to_possible_value();
    let kv_mode = kv_mode.as_ref().map_or("nixl", |v| v.get_name());
    if !engine.lmcache_init_ports().is_empty() {
        tracing::info!(
            init_ports = ?engine.lmcache_init_ports(),
            alloc_ports = ?engine.lmcache_alloc_ports(),
            "LMCache receiver listening"
        );
    }
    if !engine.ec_push_ports().is_empty() {
        tracing::info!(ports = ?engine.ec_push_ports(), "EC push consumer listening");
    }
    match engine.bootstrap_addr() {
        Some(bootstrap) => tracing::info!(
            url = %engine.url(),
            side_channel = %engine.side_channel_addr(),
            %bootstrap,
            kv_mode,
            engine_ids = ?engine.engine_ids(),
            "simulated engine serving"
        ),
        None => tracing::info!(
            url = %engine.url(),
            side_channels = ?engine.side_channel_addrs(),
            kv_mode,
            engine_id = engine.engine_id(),
            "simulated engine serving"
        ),
    }
    crate::shutdown_signal().await;
    drop(engine);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use std::time::Duration;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        sim: SimArgs,
    }

    fn parse(args: &[&str]) -> Result<SimConfig, BoxError> {
        let cli = Cli::try_parse_from(std::iter::once("sim").chain(args.iter().copied()))?;
        config(&cli.sim)
    }

    #[test]
    fn time_flags_that_are_no_duration_are_refused_not_taken_as_zero() {
        for (flag, value) in [
            ("--inter-token-ms", "-1"),
            ("--inter-token-ms", "NaN"),
            ("--prefill-ms-per-token", "inf"),
            ("--request-delay-ms", "-5"),
            ("--notify-delay-ms", "NaN"),
            ("--bootstrap-timeout", "-1"),
            ("--kv-lease", "NaN"),
            ("--kv-lease", "1e19"),
            ("--decoder-kv-blocks-ttl", "-480"),
        ] {
            let arg = format!("{flag}={value}");
            let err = parse(&[&arg]).expect_err(&arg).to_string();
            assert!(err.starts_with(flag), "{arg}: {err}");
        }
        let c = parse(&["--inter-token-ms", "0", "--kv-lease", "0.5"]).expect("valid");
        assert_eq!(c.inter_token_delay, Duration::ZERO);
        assert_eq!(c.kv_lease, Duration::from_millis(500));
    }

    /// `--header-read-timeout` and `--body-read-timeout` reach the engine's config;
    /// a value that is no duration, or 0 (every connection or body cut at once), is
    /// refused naming the flag.
    #[test]
    fn read_timeout_flags_reach_the_config() {
        let c = parse(&["--header-read-timeout", "5", "--body-read-timeout", "0.25"]).unwrap();
        assert_eq!(c.header_read_timeout, Duration::from_secs(5));
        assert_eq!(c.body_read_timeout, Duration::from_millis(250));
        // Defaults: the engine's own.
        let c = parse(&[]).unwrap();
        let d = SimConfig::default();
        assert_eq!(
            (c.header_read_timeout, c.body_read_timeout),
            (d.header_read_timeout, d.body_read_timeout)
        );
        for flag in ["--header-read-timeout", "--body-read-timeout"] {
            for value in ["0", "-1", "NaN", "1e19"] {
                let arg = format!("{flag}={value}");
                let err = parse(&[&arg]).expect_err(&arg).to_string();
                assert!(err.starts_with(flag), "{arg}: {err}");
            }
        }
    }

    #[test]
    fn ec_flags() {
        let c = parse(&["--ec-role", "producer", "--ec-store", "/tmp/ec"]).unwrap();
        let ec = c.ec.expect("an EC config");
        assert_eq!(ec.role, disagg_sim::EcRole::Producer);
        assert_eq!(ec.store, std::path::Path::new("/tmp/ec"));
        let c = parse(&["--ec-role", "consumer", "--ec-store", "/tmp/ec"]).unwrap();
        assert_eq!(c.ec.map(|e| e.role), Some(disagg_sim::EcRole::Consumer));
        assert!(parse(&[]).unwrap().ec.is_none());
        // Each needs the other.
        assert!(parse(&["--ec-role", "producer"]).is_err());
        assert!(parse(&["--ec-store", "/tmp/ec"]).is_err());
        // Push mode: an encoder pushes, a consumer listens from a given port.
        assert!(!c.ec_push);
        let ec = ["--ec-store", "/tmp/ec", "--ec-role"];
        let c = parse(&[&ec[..], &["producer", "--ec-push"]].concat()).unwrap();
        assert!(c.ec_push);
        assert_eq!(c.ec_push_port, None);
        let c = parse(&[&ec[..], &["consumer", "--ec-push-port", "14579"]].concat()).unwrap();
        assert!(c.ec_push);
        assert_eq!(c.ec_push_port, Some(14579));
        assert!(parse(&["--ec-push"]).is_err());
    }

    #[test]
    fn lmcache_flags() {
        let c = parse(&[
            "--kv-mode",
            "lmcache-prefill",
            "--lmcache-proxy",
            "127.0.0.1:7500",
            "--notify-delay-ms",
            "250",
            "--notify-loss",
            "0.5",
            "--notify-duplicates",
            "2",
            "--notify-seed",
            "9",
        ])
        .unwrap();
        assert_eq!(c.kv_mode, KvMode::Lmcache(SimRole::Prefill));
        assert_eq!(c.lmcache_proxy.as_deref(), Some("127.0.0.1:7500"));
        assert_eq!(c.faults.notify_delay, Duration::from_millis(250));
        assert_eq!(c.faults.notify_loss, 0.5);
        assert_eq!(c.faults.notify_duplicates, 2);
        assert_eq!(c.notify_seed, 9);
        assert!(!c.faults.lose_handoff && !c.faults.fail_transfers);
        let c = parse(&["--lose-handoff", "--fail-transfers"]).unwrap();
        assert!(c.faults.lose_handoff && c.faults.fail_transfers);

        let c = parse(&[
            "--kv-mode",
            "lmcache-decode",
            "--lmcache-init-ports",
            "7300,7301",
            "--lmcache-alloc-ports",
            "7400,7401",
            "--lmcache-receiver-host",
            "0.0.0.0",
            "--kv-lease",
            "5",
        ])
        .unwrap();
        assert_eq!(c.kv_mode, KvMode::Lmcache(SimRole::Decode));
        assert_eq!(c.lmcache_receiver.init_ports, [7300, 7301]);
        assert_eq!(c.lmcache_receiver.alloc_ports, [7400, 7401]);
        assert_eq!(c.lmcache_receiver.host, IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        assert_eq!(c.kv_lease, Duration::from_secs(5));

        // Defaults: one rank on ephemeral ports, no notification fault.
        let c = parse(&["--kv-mode", "lmcache-decode"]).unwrap();
        assert_eq!(c.lmcache_receiver, LmcacheReceiver::ephemeral(1));
        assert_eq!(c.faults, Faults::default());

        assert!(
            parse(&[
                "--lmcache-init-ports",
                "7300,7301",
                "--lmcache-alloc-ports",
                "7400"
            ])
            .is_err()
        );
        assert!(parse(&["--notify-loss", "1.5"]).is_err());
        assert!(parse(&["--lmcache-init-ports", "70000"]).is_err());
    }

    #[test]
    fn engine_behaviour_flags() {
        let c = parse(&[
            "--kv-mode",
            "nixl-push",
            "--dp-size",
            "2",
            "--max-logprobs",
            "5",
            "--bootstrap-timeout",
            "0.5",
            "--max-model-len",
            "131136",
        ])
        .unwrap();
        assert_eq!(c.kv_mode, KvMode::NixlPush);
        assert_eq!(c.dp_size, 2);
        assert_eq!(c.max_logprobs, 5);
        assert_eq!(c.max_model_len, 131_136);
        assert_eq!(c.bootstrap_timeout, Duration::from_millis(500));
        let c = parse(&[
            "--kv-mode",
            "lmcache-prefill",
            "--lmcache-prefill-tp-size",
            "3",
        ])
        .unwrap();
        assert_eq!(c.lmcache_prefill_tp_size, Some(3));
        // Defaults: vLLM's --max-logprobs, the prefill TP of the spec, the simulator's
        // context.
        let c = parse(&[]).unwrap();
        assert_eq!((c.max_logprobs, c.lmcache_prefill_tp_size), (20, None));
        assert_eq!(c.max_model_len, SimConfig::default().max_model_len);
        assert!(parse(&["--kv-mode", "nixl-pull"]).is_err());
    }

    #[tokio::test]
    async fn lmcache_decode_binds_the_flagged_ports() {
        let port = |l: &std::net::TcpListener| l.local_addr().unwrap().port();
        // Free ports, released for the engine to bind: a test running beside this one
        // may take one in between (a CI run saw it), so a port found taken is drawn again.
        let mut attempts = 0;
        let (engine, ports) = loop {
            let listeners: Vec<_> = (0..4)
                .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
                .collect();
            let ports: Vec<String> = listeners.iter().map(|l| port(l).to_string()).collect();
            drop(listeners);
            let init = format!("{},{}", ports[0], ports[1]);
            let alloc = format!("{},{}", ports[2], ports[3]);
            let c = parse(&[
                "--kv-mode",
                "lmcache-decode",
                "--lmcache-init-ports",
                &init,
                "--lmcache-alloc-ports",
                &alloc,
            ])
            .unwrap();
            match SimEngine::start(c).await {
                Ok(engine) => break (engine, ports),
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && attempts < 5 => {
                    attempts += 1;
                }
                Err(e) => panic!("the engine did not start: {e}"),
            }
        };
        let as_strings = |v: Vec<u16>| v.iter().map(u16::to_string).collect::<Vec<_>>();
        assert_eq!(as_strings(engine.lmcache_init_ports()), ports[..2]);
        assert_eq!(as_strings(engine.lmcache_alloc_ports()), ports[2..]);
    }
}
