//! The library half of `disagg-proxy`: the `serve` subcommand's flags and runner, so
//! that other binaries (the benchmark) run exactly the proxy users run.

pub mod discover;
pub mod edge;
pub mod kv_events;
pub mod observe;
pub mod serve;

/// The error the subcommands end with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;
