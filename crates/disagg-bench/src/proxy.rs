//! The hidden `proxy` subcommand: the disagg proxy, run by the very code of
//! `disagg-proxy serve` (its library half) with the flags given, in a process of its own
//! so that its CPU time and memory can be read from `/proc/<pid>`.
//!
//! It prints its bound address on one stdout line, then serves until its stdin closes:
//! the bench holds the write end, so the proxy also ends when the bench dies.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr};

use clap::Args;
use disagg_proxy::serve::{Addressed, ServeArgs};
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

/// Refuses flags that would make the proxy address a host other than 127.0.0.1 (or tell
/// an engine to): `--listen`, the engine URLs, every other address
/// ([`ServeArgs::other_addresses`]), and any discovery source, whose engines may be
/// anywhere.
pub(crate) fn check_loopback_only(args: &ServeArgs) -> Result<(), BoxError> {
    if args.listen().ip() != IpAddr::V4(Ipv4Addr::LOCALHOST) {
        return Err(format!("--listen must be on 127.0.0.1, not {}", args.listen()).into());
    }
    if let Some(url) = args.engine_urls().find(|u| !is_loopback_url(u)) {
        return Err(format!("engine URLs must be http://127.0.0.1:PORT, not {url}").into());
    }
    for Addressed { flag, host } in args.other_addresses() {
        match host {
            Some(host) if host == "127.0.0.1" => {}
            Some(host) => {
                return Err(
                    format!("{flag} addresses {host}: the bench addresses 127.0.0.1 only").into(),
                );
            }
            None => {
                return Err(format!(
                    "{flag} finds engines at run time, at any host: the bench addresses \
                     127.0.0.1 only (give its engines with --prefill / --decode)"
                )
                .into());
            }
        }
    }
    Ok(())
}

/// Checks `--proxy-args` (`extra`) before anything starts: they must be flags of
/// `disagg-proxy serve` that address 127.0.0.1 only ([`check_loopback_only`]), with
/// the engines and the listening address the bench gives the proxy.
pub(crate) fn check_proxy_args(extra: &[&str]) -> Result<(), BoxError> {
    use clap::Parser;
    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        proxy: ProxyArgs,
    }
    let bench_gives = [
        "proxy",
        "--listen",
        "127.0.0.1:0",
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
        "http://127.0.0.1:1",
    ];
    let cli = Cli::try_parse_from(bench_gives.iter().chain(extra))
        .map_err(|e| format!("--proxy-args: {}", e.render().to_string().trim_end()))?;
    check_loopback_only(&cli.proxy.serve).map_err(|e| format!("--proxy-args: {e}").into())
}

/// Run the proxy until stdin closes.
pub(crate) fn main(args: ProxyArgs) -> Result<(), BoxError> {
    let args = args.serve;
    check_loopback_only(&args)?;
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
    use super::{check_proxy_args, is_loopback_url};

    /// What `--proxy-args` may hold: flags addressing 127.0.0.1 only, or none.
    #[test]
    fn proxy_args_address_loopback_only() {
        for fine in [
            &[][..],
            &["--prompt-token-reuse", "off"],
            &["--otlp-endpoint", "http://127.0.0.1:4318"],
            &["--lmcache-notify", "tcp://127.0.0.1:7500"],
            &["--decode", "http://127.0.0.1:9"],
        ] {
            check_proxy_args(fine).unwrap_or_else(|e| panic!("{fine:?}: {e}"));
        }
        for (bad, says) in [
            (
                &["--otlp-endpoint", "http://collector:4318"][..],
                "--otlp-endpoint addresses collector",
            ),
            (
                &["--lmcache-notify", "tcp://*:7500"],
                "--lmcache-notify addresses *",
            ),
            (
                &["--lmcache-notify", "tcp://[::1]:7500"],
                "--lmcache-notify addresses ::1",
            ),
            (
                &[
                    "--lmcache-receiver",
                    "http://127.0.0.1:1=10.0.0.3:7300:7400",
                ],
                "--lmcache-receiver",
            ),
            (
                &["--ec-address", "http://127.0.0.1:1=10.0.0.4:1"],
                "--ec-address",
            ),
            (
                &[
                    "--kv-events-endpoint",
                    "http://127.0.0.1:1=tcp://10.0.0.5:5557",
                ],
                "--kv-events-endpoint",
            ),
            (&["--dns-server", "10.0.0.6:53"], "--dns-server"),
            (
                &["--prefill-dns", "engines:8000"],
                "--prefill-dns finds engines at run time",
            ),
            (&["--endpoints-file", "/e.toml"], "--endpoints-file"),
            (
                &["--k8s-decode-selector", "app=vllm"],
                "--k8s-decode-selector",
            ),
            (
                &["--decode", "http://10.0.0.7:8000"],
                "http://10.0.0.7:8000",
            ),
            (
                &["--encode", "http://localhost:8000"],
                "http://localhost:8000",
            ),
            (&["--listen", "0.0.0.0:0"], "--listen"),
            (&["--no-such-flag"], "--no-such-flag"),
        ] {
            let err = check_proxy_args(bad).expect_err(says).to_string();
            assert!(
                err.starts_with("--proxy-args: ") && err.contains(says),
                "{bad:?}: {err}"
            );
        }
    }

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
