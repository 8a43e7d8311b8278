//! Sidecar mode: an axum app that stands for a decode engine (here a simulated vLLM
//! engine, called in process), with `PdLayer` in front. Each chat or completion
//! request first goes to a remote prefill engine, then to the app's own completion
//! handler with the prefill's KV handoff (`kv_transfer_params`) injected: the decode leg
//! never touches the network. The app keeps its own `/health` and `/v1/models`.
//!
//! The prefill engine is the one an upstream scheduler names in
//! `x-prefiller-host-port: host:port` (llm-d), accepted only when it is one of the
//! prefill URLs given here; without the header, they take turns.
//!
//! Run (a prefill engine first, real or simulated):
//!
//! ```text
//! cargo run -p disagg-proxy -- sim --listen 127.0.0.1:8100 --side-channel 127.0.0.1:5600 &
//! cargo run --example sidecar -- http://127.0.0.1:8100 127.0.0.1:8200
//! curl localhost:8200/v1/chat/completions -H 'x-prefiller-host-port: 127.0.0.1:8100' \
//!     -d '{"model":"sim-model","messages":[{"role":"user","content":"hi"}]}'
//! ```
//!
//! The arguments can also come from `DISAGG_PREFILL` (comma-separated URLs) and
//! `DISAGG_LISTEN`.

use std::future::Future;

use axum::Router;
use axum::routing::get;
use disagg::core::{Endpoint, Role, source::StaticSource};
use disagg::http::PdLayer;
use disagg_sim::{SimConfig, SimEngine};
use tokio::net::TcpListener;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The engine's app: its own routes, and the completion handlers of `engine` (which
/// pull the KV the prefill engine holds), all behind the sidecar layer.
pub fn app(engine: &SimEngine, prefill: &[String]) -> Result<Router, BoxError> {
    let pool = prefill
        .iter()
        .map(|url| Endpoint::new(url, Role::Prefill))
        .collect::<Result<Vec<_>, _>>()?;
    let layer = PdLayer::sidecar(StaticSource::new(pool));
    Ok(Router::new()
        .route("/health", get(|| async { "ok" }))
        .route_service("/v1/models", engine.service())
        .route_service("/v1/chat/completions", engine.service())
        .route_service("/v1/completions", engine.service())
        .layer(layer))
}

/// Serve the app on `listener` until `shutdown` resolves.
pub async fn run(
    listener: TcpListener,
    engine: &SimEngine,
    prefill: &[String],
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), BoxError> {
    let app = app(engine, prefill)?;
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let prefill = args
        .next()
        .or_else(|| std::env::var("DISAGG_PREFILL").ok())
        .unwrap_or_else(|| "http://127.0.0.1:8100".into());
    let prefill: Vec<String> = prefill.split(',').map(str::to_owned).collect();
    let listen = args
        .next()
        .or_else(|| std::env::var("DISAGG_LISTEN").ok())
        .unwrap_or_else(|| "127.0.0.1:8200".into());
    // The stand-in decode engine: its own listeners stay on ephemeral ports, unused.
    let engine = SimEngine::start(SimConfig::default()).await?;
    let listener = TcpListener::bind(&listen).await?;
    println!("sidecar on http://{}", listener.local_addr()?);
    run(listener, &engine, &prefill, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
}
