//! `disagg-proxy`: a prefill/decode disaggregating proxy for OpenAI-compatible engines.
//!
//! - `disagg-proxy serve --prefill URL --decode URL` runs the proxy;
//! - `disagg-proxy demo` runs one request end to end against simulated engines;
//! - `disagg-proxy sim` runs a simulated vLLM-like engine.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod demo;
mod files;
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
    Serve(Box<serve::ServeArgs>),
    /// Run one streaming request through the proxy against simulated engines, in-process.
    Demo(demo::DemoArgs),
    /// Run a simulated vLLM-like engine (NIXL-style KV side channel included).
    Sim(Box<sim::SimArgs>),
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
            Command::Sim(args) => sim::run(*args).await,
            Command::NixlPorts(args) => nixl::run(args).await,
        }
    }))
}

/// `serve`: the serving threads run their own event loops; this thread waits for the
/// stop signal on a small one of its own.
///
/// The first SIGTERM or SIGINT (Ctrl-C) starts the drain (`--drain-timeout`); the process
/// exits 0 once it has ended. A second signal during the drain exits at once, status 1.
fn run_serve(args: &serve::ServeArgs) -> Result<(), BoxError> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let signals = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Install the handlers before the port opens: a signal that arrives once clients can
    // connect must start the drain, not kill the process on the default action.
    let mut stop = {
        let _runtime = signals.enter();
        StopSignals::install()?
    };
    std::thread::Builder::new()
        .name("disagg-signals".into())
        .spawn(move || {
            let name = signals.block_on(stop.recv());
            tracing::info!(
                signal = name,
                "stop asked: draining (a second signal exits at once)"
            );
            let _ = stop_tx.send(true);
            let name = signals.block_on(stop.recv());
            tracing::warn!(
                signal = name,
                "second stop signal: exiting without draining"
            );
            std::process::exit(1);
        })?;
    // The signal thread is not joined: it waits for a second signal that may never come,
    // and returning from `main` ends the process with it.
    serve::run(args, stop_rx, |addr| {
        tracing::info!(listen = %addr, engines = ?args.engine_urls().collect::<Vec<_>>(), "disagg-proxy serving");
    })
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

/// The signals that stop the proxy: SIGTERM and SIGINT (Ctrl-C).
struct StopSignals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl StopSignals {
    /// Install the handlers, replacing the default action (termination). Must run inside
    /// a Tokio runtime context.
    fn install() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(StopSignals {
                term: signal(SignalKind::terminate())?,
                int: signal(SignalKind::interrupt())?,
            })
        }
        #[cfg(not(unix))]
        Ok(StopSignals {})
    }

    /// The next stop signal, by name.
    async fn recv(&mut self) -> &'static str {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.term.recv() => "SIGTERM",
                _ = self.int.recv() => "SIGINT",
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            "Ctrl-C"
        }
    }
}

/// Resolves when the process is asked to stop (Ctrl-C or SIGTERM), for subcommands that
/// need no drain (`sim`).
async fn shutdown_signal() {
    match StopSignals::install() {
        Ok(mut signals) => {
            let name = signals.recv().await;
            tracing::info!(signal = name, "shutting down");
        }
        // No handler: the default action (termination) stops the process instead.
        Err(_) => std::future::pending::<()>().await,
    }
}
