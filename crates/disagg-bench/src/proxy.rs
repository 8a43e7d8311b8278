//! The hidden `proxy` subcommand: the disagg proxy, built exactly as `disagg-proxy serve`
//! builds it with its default flags, in a process of its own so that its CPU time and
//! memory can be read from `/proc/<pid>`.
//!
//! It prints its bound address on one stdout line, then serves until its stdin closes:
//! the bench holds the write end, so the proxy also ends when the bench dies.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use clap::Args;
use disagg_core::orchestrator::{MissingKv, NoPrefill};
use disagg_core::{
    Endpoint, Orchestrator, OrchestratorConfig, Role, RoundRobin, StaticSource, VllmNixl,
};
use disagg_http::{HttpTransport, HttpTransportConfig, PdService, PdServiceConfig};
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;

use crate::BoxError;

/// Flags of the hidden `proxy` subcommand.
#[derive(Debug, Args)]
pub(crate) struct ProxyArgs {
    /// A prefill engine's base URL (http://127.0.0.1:port). Repeat for several engines.
    #[arg(long = "prefill", value_name = "URL", required = true)]
    pub(crate) prefill: Vec<String>,
    /// A decode engine's base URL (http://127.0.0.1:port). Repeat for several engines.
    #[arg(long = "decode", value_name = "URL", required = true)]
    pub(crate) decode: Vec<String>,
    /// The address to listen on (127.0.0.1 only).
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:0")]
    pub(crate) listen: SocketAddr,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 2)]
    pub(crate) threads: usize,
}

/// Whether `url` is `http://127.0.0.1:<port>[/...]`: the bench talks to nothing else.
pub(crate) fn is_loopback_url(url: &str) -> bool {
    url.strip_prefix("http://127.0.0.1:")
        .map(|rest| rest.split('/').next().unwrap_or(""))
        .is_some_and(|port| port.parse::<u16>().is_ok())
}

/// Run the proxy until stdin closes.
pub(crate) fn main(args: ProxyArgs) -> Result<(), BoxError> {
    if args.listen.ip() != IpAddr::V4(Ipv4Addr::LOCALHOST) {
        return Err(format!("--listen must be on 127.0.0.1, not {}", args.listen).into());
    }
    if let Some(url) = args
        .prefill
        .iter()
        .chain(&args.decode)
        .find(|u| !is_loopback_url(u))
    {
        return Err(format!("engine URLs must be http://127.0.0.1:PORT, not {url}").into());
    }
    init_tracing();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let service = build(&args)?;
        let listener = TcpListener::bind(args.listen)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
        let addr = listener.local_addr()?;
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "{addr}")?;
            out.flush()?;
        }
        disagg_http::server::serve(listener, service, stdin_closed()).await?;
        Ok(())
    })
}

/// The service, as `disagg-proxy serve` builds it from its default flags
/// (`--policy round_robin`, 300 s prefill and decode timeouts, 5 s connect timeout,
/// 32 MiB body limit, `--missing-kv local-prefill`, no decode-only fallback, no
/// `Authorization` forwarding), with the vLLM NIXL connector.
fn build(args: &ProxyArgs) -> Result<PdService, BoxError> {
    let mut endpoints = Vec::new();
    for url in &args.prefill {
        endpoints.push(Endpoint::new(url, Role::Prefill)?);
    }
    for url in &args.decode {
        endpoints.push(Endpoint::new(url, Role::Decode)?);
    }
    let mut transport = HttpTransportConfig::default();
    transport.connect_timeout = Duration::from_secs(5);
    let mut config = OrchestratorConfig::default();
    config.prefill_timeout = Duration::from_secs(300);
    config.decode_head_timeout = Duration::from_secs(300);
    config.forward_authorization = false;
    config.no_prefill = NoPrefill::Fail;
    config.missing_kv = MissingKv::LocalPrefill;
    let orchestrator =
        Orchestrator::builder(StaticSource::new(endpoints), HttpTransport::new(transport))
            .config(config)
            .router(RoundRobin::new())
            .connector(VllmNixl::new())
            .build();
    let mut svc = PdServiceConfig::default();
    svc.max_body_bytes = 32 * 1024 * 1024;
    Ok(PdService::with_config(orchestrator, svc))
}

/// Like `disagg-proxy`: `RUST_LOG` or `info`, on stderr (the bench leaves stderr open).
fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Resolves when stdin reaches its end (or fails): the bench closed it or died.
async fn stdin_closed() {
    let mut stdin = tokio::io::stdin();
    let mut buf = [0u8; 64];
    while let Ok(n) = stdin.read(&mut buf).await {
        if n == 0 {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::is_loopback_url;

    #[test]
    fn only_loopback_urls() {
        assert!(is_loopback_url("http://127.0.0.1:8000"));
        assert!(is_loopback_url("http://127.0.0.1:8000/v1"));
        assert!(!is_loopback_url("http://127.0.0.1"));
        assert!(!is_loopback_url("http://127.0.0.1.evil:80"));
        assert!(!is_loopback_url("http://10.0.0.1:8000"));
        assert!(!is_loopback_url("https://127.0.0.1:8000"));
    }
}
