//! The HTTP adapter of **disagg**: a pooled keep-alive [`HttpTransport`] on hyper, the tower
//! [`PdService`] that serves OpenAI chat and completion requests disaggregated, the
//! OpenAI error format, and a small server ([`server::Builder`]).
//!
//! At the edge: API keys checked by a tower layer with limits per key, and keys sent to
//! engines ([`auth`]); with the `tls` feature, HTTPS served to clients and `https://`
//! engines ([`tls`]).
//!
//! Features (additive): `auth`, `metrics` and `access-log`, on by default, bring the
//! [`auth`], [`metrics`] and [`access_log`] modules (and, with `metrics`, the answer to
//! `GET /metrics`); `tls`, off by default, HTTPS. The embedding guide
//! ([`layer::guide`]) lists what each one adds.
//!
//! # Examples
//!
//! A proxy in front of one prefill and one decode engine:
//!
//! ```no_run
//! use disagg_core::{Endpoint, Orchestrator, Role, source::StaticSource};
//! use disagg_connectors::vllm::VllmNixl;
//! use disagg_http::{HttpTransport, PdService, server};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let source = StaticSource::new([
//!     Endpoint::new("http://127.0.0.1:8100", Role::Prefill)?,
//!     Endpoint::new("http://127.0.0.1:8200", Role::Decode)?,
//! ]);
//! let orchestrator = Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new()).build();
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8000").await?;
//! server::Builder::new()
//!     .serve(listener, PdService::new(orchestrator), std::future::pending())
//!     .await?;
//! # Ok(())
//! # }
//! ```

// docs.rs builds with `--cfg docsrs` (package.metadata.docs.rs) on a nightly toolchain,
// where each feature-gated item is marked with the features it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "access-log")]
#[cfg_attr(docsrs, doc(cfg(feature = "access-log")))]
pub mod access_log;
#[cfg(feature = "auth")]
#[cfg_attr(docsrs, doc(cfg(feature = "auth")))]
pub mod auth;
pub mod body;
mod coding;
mod connect;
pub mod error;
pub mod forward;
pub mod layer;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
pub mod models;
pub mod path;
pub mod routed;
pub mod routes;
pub mod server;
pub mod service;
mod stall;
mod tap;
#[cfg(feature = "tls")]
#[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
pub mod tls;
pub mod transport;

pub use layer::{PdLayer, PdMiddleware};
pub use routes::{RouteAction, RouteTable};
pub use service::{PdService, PdServiceConfig};
pub use transport::{HttpTransport, HttpTransportConfig};

/// `make()`'s future, boxed and pinned, written straight into its allocation.
///
/// `Box::pin(fut)` builds the future on the stack and copies all of it into the box: an
/// `async` block is as large as its largest state, several KiB on the request path, even
/// when it has not started. Allocating first and then writing `make()`'s result lets the
/// compiler build it in place (docs/performance.md, "Futures and bodies copied whole").
fn pin_in_place<F: std::future::Future>(make: impl FnOnce() -> F) -> std::pin::Pin<Box<F>> {
    Box::into_pin(Box::write(Box::new_uninit(), make()))
}
