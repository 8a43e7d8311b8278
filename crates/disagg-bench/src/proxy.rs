//! The hidden `proxy` subcommand: the disagg proxy, run by the very code of
//! `disagg-proxy serve` (its library half) with the flags given, in a process of its own
//! so that its CPU time and memory can be read from `/proc/<pid>`.
//!
//! It prints its bound address on one stdout line, then serves until its stdin closes:
//! the bench holds the write end, so the proxy also ends when the bench dies.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr};

use clap::Args;
use disagg_proxy::serve::ServeArgs;
use tokio::io::AsyncReadExt;

use crate::BoxError;

/// Flags of the hidden `proxy` subcommand: exactly those of `disagg-proxy serve`.
#[derive(Debug, Args)]
pub(crate) struct ProxyArgs {
    #[command(flatten)]
    serve: ServeArgs,
}

/// Whether `url` is `http://127.0.0.1:<port>[/...]`: the bench talks to nothing else.
pub(crate) fn is_loopback_url(url: &str) -> bool {
    url.strip_prefix("http://127.0.0.1:")
        .map(|rest| rest.split('/').next().unwrap_or(""))
        .is_some_and(|port| port.parse::<u16>().is_ok())
}

/// Run the proxy until stdin closes.
pub(crate) fn main(args: ProxyArgs) -> Result<(), BoxError> {
    let args = args.serve;
    if args.listen().ip() != IpAddr::V4(Ipv4Addr::LOCALHOST) {
        return Err(format!("--listen must be on 127.0.0.1, not {}", args.listen()).into());
    }
    if let Some(url) = args.engine_urls().find(|u| !is_loopback_url(u)) {
        return Err(format!("engine URLs must be http://127.0.0.1:PORT, not {url}").into());
    }
    init_tracing();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stdin_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("bench-proxy-stdin".into())
        .spawn(move || {
            stdin_rt.block_on(stdin_closed());
            let _ = stop_tx.send(true);
        })?;
    let mut printed = Ok(());
    disagg_proxy::serve::run(&args, stop_rx, |addr| {
        let mut out = std::io::stdout().lock();
        printed = writeln!(out, "{addr}").and_then(|()| out.flush());
    })?;
    Ok(printed?)
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
pub(crate) async fn stdin_closed() {
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
