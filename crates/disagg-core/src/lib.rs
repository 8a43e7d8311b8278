//! The core of **disagg**: prefill/decode (P/D) disaggregated LLM serving, without an
//! HTTP stack.
//!
//! A disaggregated deployment splits inference in two: a *prefill* engine computes the
//! prompt's KV cache, a *decode* engine receives it and generates the tokens. This crate
//! orchestrates one request across both:
//!
//! 1. an [`EndpointSource`] publishes the endpoints as an
//!    immutable snapshot;
//! 2. a [`Router`] picks a prefill and a decode endpoint (the policies are in
//!    `disagg-affinity`; the orchestrator's default is a round robin over each role);
//! 3. a [`KvConnector`] plans both legs: the prefill body, the decode body, and how to
//!    dispatch them (the engines' protocols are in `disagg-connectors`; the core knows
//!    none of them);
//! 4. the [`Orchestrator`] sends them through a
//!    [`Transport`] and streams the decode's answer back, frame by
//!    frame, in a [`PdBody`](orchestrator::PdBody).
//!
//! The core knows nothing of hyper: `disagg-http` supplies the pooled transport and the
//! tower service.
//!
//! # Examples
//!
//! Planning one request with the vLLM NIXL connector (no I/O; the connector is
//! `disagg-connectors`'):
//!
//! ```
//! use std::sync::Arc;
//! use disagg_connectors::vllm::VllmNixl;
//! use disagg_core::connector::KvConnector;
//! use disagg_core::endpoint::{Endpoint, Role};
//! use disagg_core::request::{Api, PdRequest};
//! use disagg_core::router::Route;
//! use disagg_core::source::{EndpointSource, StaticSource};
//!
//! let source = StaticSource::new([
//!     Endpoint::new("http://127.0.0.1:8100", Role::Prefill)?,
//!     Endpoint::new("http://127.0.0.1:8200", Role::Decode)?,
//! ]);
//! let req = PdRequest::new(
//!     Api::Chat,
//!     Default::default(),
//!     &r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#.into(),
//! )?;
//! // What a router returns: here the set's first prefill and decode endpoint.
//! let set = source.snapshot();
//! let prefill = Arc::clone(&set.by_role(Role::Prefill)[0]);
//! let route = Route::new(Some(prefill), Arc::clone(&set.by_role(Role::Decode)[0]));
//! let handoff = VllmNixl::new().prepare(&route, &req)?;
//! assert_eq!(handoff.prefill.body.get("stream"), Some(&b"false"[..]));
//! assert_eq!(handoff.decode.body.get("stream"), Some(&b"true"[..]));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod connector;
pub mod encode;
pub mod endpoint;
pub mod error;
pub mod orchestrator;
pub mod outcome;
pub mod policy;
pub mod proto;
pub mod request;
pub mod router;
pub mod source;
pub mod tokens;
mod trace;
pub mod transport;

// The JSON toolkit requests are built on (`disagg-json`): `json::JsonBody` is what
// `PdRequest::body` returns, `json::BodyError` why a body was refused.
pub use disagg_json as json;

// The handful of names a user writes daily, at the root; everything else at its
// module's path (one path per item), and the connector and adapter author's helpers in
// [`proto`].
pub use connector::KvConnector;
pub use endpoint::{Endpoint, Role};
pub use error::PdError;
pub use orchestrator::Orchestrator;
pub use request::PdRequest;
pub use router::Router;
pub use source::EndpointSource;
pub use transport::Transport;
