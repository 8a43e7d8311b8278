//! `disagg-proxy sim`: a simulated vLLM-like engine on chosen ports.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;
use disagg_sim::{Faults, SimConfig, SimEngine};
use tokio::net::TcpListener;

use crate::BoxError;

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
}

pub(crate) async fn run(args: SimArgs) -> Result<(), BoxError> {
    let config = SimConfig {
        model: args.model,
        engine_id: args.engine_id,
        advertised_host: args.advertised_host,
        prefill_delay_per_token: Duration::from_secs_f64(args.prefill_ms_per_token.max(0.0) / 1e3),
        inter_token_delay: Duration::from_secs_f64(args.inter_token_ms.max(0.0) / 1e3),
        faults: Faults {
            status: args.fail_status,
            hang: args.hang,
            drop_after_chunks: args.drop_after_chunks,
        },
        ..SimConfig::default()
    };
    let http = TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let side = TcpListener::bind(args.side_channel)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.side_channel))?;
    let engine = SimEngine::start_on(config, http, side).await?;
    tracing::info!(
        url = %engine.url(),
        side_channel = %engine.side_channel_addr(),
        engine_id = engine.engine_id(),
        "simulated engine serving"
    );
    crate::shutdown_signal().await;
    drop(engine);
    Ok(())
}
