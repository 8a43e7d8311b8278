//! `disagg-proxy sim`: a simulated vLLM-like engine on chosen ports.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, ValueEnum};
use disagg_sim::{Faults, KvMode, SimConfig, SimEngine, SimRole};
use tokio::net::TcpListener;

use crate::BoxError;

/// The P/D KV protocol of a simulated engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum KvModeArg {
    /// vLLM NIXL connector (sequential P then D; one engine plays both roles).
    Nixl,
    /// SGLang `--disaggregation-mode prefill` (bootstrap server on `--bootstrap`).
    SglangPrefill,
    /// SGLang `--disaggregation-mode decode`.
    SglangDecode,
    /// vLLM MooncakeConnector `kv_producer` (bootstrap HTTP server on `--bootstrap`).
    MooncakePrefill,
    /// vLLM MooncakeConnector `kv_consumer`.
    MooncakeDecode,
}

impl From<KvModeArg> for KvMode {
    fn from(mode: KvModeArg) -> Self {
        match mode {
            KvModeArg::Nixl => KvMode::Nixl,
            KvModeArg::SglangPrefill => KvMode::Sglang(SimRole::Prefill),
            KvModeArg::SglangDecode => KvMode::Sglang(SimRole::Decode),
            KvModeArg::MooncakePrefill => KvMode::Mooncake(SimRole::Prefill),
            KvModeArg::MooncakeDecode => KvMode::Mooncake(SimRole::Decode),
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
    /// Data-parallel ranks (Mooncake: one engine id per rank).
    #[arg(long, value_name = "N", default_value_t = 1)]
    dp_size: u32,
    /// Fault: answer every completion request with this HTTP status and a vLLM-style error.
    #[arg(long, value_name = "STATUS")]
    fail_status: Option<u16>,
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
}

pub(crate) async fn run(args: SimArgs) -> Result<(), BoxError> {
    let config = SimConfig {
        model: args.model,
        engine_id: args.engine_id,
        advertised_host: args.advertised_host,
        prefill_delay_per_token: Duration::from_secs_f64(args.prefill_ms_per_token.max(0.0) / 1e3),
        inter_token_delay: Duration::from_secs_f64(args.inter_token_ms.max(0.0) / 1e3),
        kv_mode: args.kv_mode.into(),
        bootstrap_timeout: Duration::try_from_secs_f64(args.bootstrap_timeout.max(0.0))
            .map_err(|e| format!("--bootstrap-timeout: {e}"))?,
        request_delay: Duration::from_secs_f64(args.request_delay_ms.max(0.0) / 1e3),
        dp_size: args.dp_size.max(1),
        faults: Faults {
            status: args.fail_status,
            hang: args.hang,
            drop_after_chunks: args.drop_after_chunks,
            stall_after_chunks: args.stall_after_chunks,
            malformed_kv_params: args.malformed_kv_params,
        },
        ..SimConfig::default()
    };
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
            side_channel = %engine.side_channel_addr(),
            kv_mode,
            engine_id = engine.engine_id(),
            "simulated engine serving"
        ),
    }
    crate::shutdown_signal().await;
    drop(engine);
    Ok(())
}
