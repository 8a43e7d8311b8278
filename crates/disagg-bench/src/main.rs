//! `disagg-bench`: what the disagg proxy costs, measured in one run on one machine.
//!
//! ```sh
//! cargo run --release -p disagg-bench -- [--duration SECS] [--json PATH] ...
//! ```
//!
//! # Set-up
//!
//! Everything runs on 127.0.0.1, nothing else is ever addressed:
//!
//! - **Engines.** Three simulated vLLM-like engines ([`disagg_sim::SimEngine`], request
//!   recording off) run in the bench process on a Tokio runtime of their own: a
//!   prefill, a decode (both with zero delay) and a second decode with an inter-token
//!   delay, for the held streams.
//! - **Proxy.** The proxy runs in a process of its own, so that its CPU time and memory
//!   can be read apart from everything else: the bench re-executes itself
//!   (`std::env::current_exe()`) with the hidden subcommand
//!   `proxy --prefill URL --decode URL --listen 127.0.0.1:0 --threads N`, which runs
//!   the very code of `disagg-proxy serve` (`disagg_proxy::serve::run`, same flags and
//!   defaults) and prints its bound address. The child ends when
//!   its stdin closes, which the bench does at the end, and which happens as well when
//!   the bench dies; the bench also kills it on every error path.
//! - **Load generator.** In the bench process, on a second runtime: one hyper-util
//!   legacy `Client` (large pool, `TCP_NODELAY`), `N` tasks each sending one request
//!   after the other with a prebuilt `Bytes` body and recording its latencies in its
//!   own vector (no lock on the hot path); the vectors are merged when the phase ends.
//!   A phase ends after `--duration` seconds or `--max-requests` requests, whichever
//!   comes first; requests in flight then complete. `--max-requests` is at least 64,
//!   the largest concurrency, so that every phase runs as many clients as it says.
//!
//! # Phases
//!
//! For non-streaming and streaming chat requests (a ~256-byte body asking for 16
//! tokens), at concurrency 1, 16 and 64, first directly to the decode engine (the
//! baseline) and then through the proxy (prefill on one engine, KV pulled by the decode
//! engine over the simulator's side channel, the decode's answer streamed back). Each
//! measured phase follows a warm-up with the same load.
//!
//! Every answer is checked: status 200, `x-disagg-handoff: kv` through the proxy, a
//! JSON object when not streamed, a body ending with `data: [DONE]\n\n` when streamed.
//! Failures are counted and a run with any is flagged (and exits with status 1).
//!
//! `x-disagg-handoff: kv` is only the proxy's claim, so at the end the engines' own
//! counters (what their `GET /stats` serves) are compared with the answers so marked:
//! the prefill must have returned `kv_transfer_params` and served a side-channel pull
//! for each, each decode engine must have pulled the KV of each of its proxied requests
//! (`remote_decodes`) and computed no prompt but those of the direct requests
//! (`local_prefills`), and the prefill must hold no KV left. A run where they differ is
//! flagged likewise.
//!
//! # Figures
//!
//! - **Throughput**: successful answers per second of wall time, at concurrency 64.
//! - **Latency p50/p99**: from sending the request to the end of the answer.
//! - **TTFT p50/p99**: to the first body frame carrying SSE data (`data:`) for streams;
//!   the whole answer otherwise.
//! - **Added latency**: proxy p50 − direct p50 at concurrency 1. It includes the
//!   disaggregation itself (the prefill round trip and the KV pull), not only the
//!   proxy's own work.
//! - **Proxy CPU per request**: the proxy process's on-CPU time in the measured phase,
//!   divided by the successful requests: CPU seconds per 1,000 requests × 1000 = µs per
//!   request. Read before and after the phase as the sum over its threads of the
//!   scheduler's nanoseconds (`/proc/<pid>/task/<tid>/schedstat`), checked against the
//!   whole process's `utime + stime` (`/proc/<pid>/stat`, clock ticks: `getconf
//!   CLK_TCK`, 100 assumed if it cannot be read), which keep the time of threads that
//!   ended; the ticks are taken instead, and the phase marked, when a thread ended during
//!   the phase (the ticks more than 2 ticks ahead of the nanoseconds, or a thread of the
//!   first reading gone) or the kernel keeps no schedstat. The bench process's own CPU
//!   per request (engines and load generator) is shown beside it, in ticks.
//! - **Idle RSS**: `VmRSS` of the proxy after start-up and a warm-up at concurrency 1;
//!   **peak RSS**: its `VmHWM` after every phase.
//! - **Memory per stream**: a second proxy process in front of the slow decode engine
//!   (default 50 ms × 16 tokens); after a small warm-up its `VmRSS` is the idle figure;
//!   then `--streams` (256) streams are started, spread over a quarter of a stream's
//!   time (the figure is memory per open stream, not how the proxy takes a burst of
//!   connections at one instant), and `VmRSS` is sampled every 5 ms: (RSS with the most
//!   streams open − idle RSS) / streams open.
//!
//! The 2-core machine this was written for is shared by the proxy, the engines and the
//! load generator: throughput figures are those of the whole set-up, and the proxy's
//! CPU per request is the figure that carries across machines.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod floor;
mod hold;
mod load;
mod procfs;
mod proxy;
mod report;
mod routing;
mod run;

/// The error everything ends with.
type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Benchmark the disagg proxy against simulated engines on 127.0.0.1: throughput,
/// latency, time to first token, CPU per request and memory, next to a direct
/// connection to the decode engine.
#[derive(Debug, Parser)]
#[command(name = "disagg-bench", version, about, long_about = None)]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: run::RunArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Internal: the proxy process the bench starts.
    #[command(hide = true)]
    Proxy(Box<proxy::ProxyArgs>),
    /// Internal: the floor proxy the bench compares with (`--floor`).
    #[command(hide = true)]
    Floor(floor::FloorArgs),
    /// The prefix-cache routing benchmark: prefix hit rate and time to first token of
    /// `round_robin`, `cache_aware` and `kv_events` on a multi-turn chat workload.
    Routing(routing::RoutingArgs),
    /// Stranded KV under saturated decodes: the prefills' expired KV and the failed
    /// pulls with the decode admission hold off and on.
    Hold(hold::HoldArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Proxy(args)) => proxy::main(*args).map(|()| true),
        Some(Command::Floor(args)) => floor::main(args).map(|()| true),
        Some(Command::Routing(args)) => routing::main(args),
        Some(Command::Hold(args)) => hold::main(args),
        None => run::main(cli.run),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {}", disagg_core::error::error_chain(&*e));
            ExitCode::FAILURE
        }
    }
}
