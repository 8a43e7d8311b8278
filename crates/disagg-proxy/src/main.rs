//! `disagg-proxy`: a prefill/decode disaggregating proxy for OpenAI-compatible engines.
//!
//! - `disagg-proxy serve --prefill URL --decode URL` runs the proxy;
//! - `disagg-proxy demo` runs one request end to end against simulated engines;
//! - `disagg-proxy sim` runs a simulated vLLM-like engine.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod demo;
mod nixl;
mod sim;

use disagg_proxy::{BoxError, serve};

/// A prefill/decode disaggregating proxy for OpenAI-compatible LLM engines.
#[derive(Debug, Parser)]
#[command(name = "disagg-proxy", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve OpenAI requests disaggregated across prefill and decode engines.
    Serve(serve::ServeArgs),
    /// Run one streaming request through the proxy against simulated engines, in-process.
    Demo(demo::DemoArgs),
    /// Run a simulated vLLM-like engine (NIXL-style KV side channel included).
    Sim(sim::SimArgs),
    /// Plan NIXL side-channel ports and engine ids from a plan file (TOML), or say why it fails.
    NixlPorts(nixl::NixlPortsArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(matches!(cli.command, Command::Demo(_)));
    if let Command::Serve(args) = &cli.command {
        return report(run_serve(args));
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: could not start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    report(runtime.block_on(async {
        match cli.command {
            Command::Serve(_) => Ok(()),
            Command::Demo(args) => demo::run(args).await,
            Command::Sim(args) => sim::run(args).await,
            Command::NixlPorts(args) => nixl::run(args).await,
        }
    }))
}

/// `serve`: the serving threads run their own event loops; this thread waits for the
/// stop signal on a small one of its own.
fn run_serve(args: &serve::ServeArgs) -> Result<(), BoxError> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let signals = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let waiter = std::thread::Builder::new()
        .name("disagg-signals".into())
        .spawn(move || {
            signals.block_on(shutdown_signal());
            let _ = stop_tx.send(true);
        })?;
    let result = serve::run(args, stop_rx, |addr| {
        tracing::info!(listen = %addr, engines = ?args.engine_urls().collect::<Vec<_>>(), "disagg-proxy serving");
    });
    if result.is_ok() {
        let _ = waiter.join();
    }
    result
}

fn report(result: Result<(), BoxError>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", disagg_core::error::error_chain(&*e));
            ExitCode::FAILURE
        }
    }
}

fn init_tracing(quiet: bool) {
    use tracing_subscriber::EnvFilter;
    let default = if quiet { "error" } else { "info" };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Resolves when the process is asked to stop (Ctrl-C or SIGTERM).
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    tracing::info!("shutting down: finishing in-flight requests");
}
