//! Embed disagg in your own server: a P/D proxy in a dozen lines.
//!
//! Run (with engines at those addresses, e.g. `disagg-proxy sim`):
//! `cargo run --example embed -- http://127.0.0.1:8100 http://127.0.0.1:8200`

use disagg::connectors::vllm::VllmNixl;
use disagg::core::{Endpoint, Orchestrator, Role, source::StaticSource};
use disagg::http::{HttpTransport, PdService, server};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let prefill = args
        .next()
        .unwrap_or_else(|| "http://127.0.0.1:8100".into());
    let decode = args
        .next()
        .unwrap_or_else(|| "http://127.0.0.1:8200".into());
    let source = StaticSource::new([
        Endpoint::new(&prefill, Role::Prefill)?,
        Endpoint::new(&decode, Role::Decode)?,
    ]);
    let orchestrator =
        Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new()).build();
    // PdService is a tower::Service: serve it with hyper as here, or mount it in axum.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:8000").await?;
    println!("disagg proxy on http://{}", listener.local_addr()?);
    server::Builder::new()
        .serve(listener, PdService::new(orchestrator), async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
