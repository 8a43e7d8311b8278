//! Every engine protocol **disagg** speaks, one module and one cargo feature per engine
//! family.
//!
//! The core (`disagg-core`) knows no engine: it holds the [`KvConnector`] seam, and the
//! orchestrator runs every connector through one code path. This crate holds the
//! connectors, what they share, and what each needs of its engines:
//!
//! ```text
//! client body ─▶ KvConnector::check   (vllm::rewrite::check: vLLM's rules on rewritten fields)
//!            ─▶ KvConnector::prepare  (both legs: vllm::rewrite for a one-token prefill;
//!                                      common::Rooms for SGLang rooms, Mooncake transfer ids)
//!            ─▶ KvConnector::resolve  (vllm::mooncake: the prefill's engine id from /query)
//!            ─▶ KvConnector::complete (vllm::nixl: kv_transfer_params; lmcache: the first
//!                                      token, a KvGate on the ZMQ notifications)
//!            ─▶ Reshape               (common::sse: per-event mapping of a decode stream)
//! ```
//!
//! | module | feature | holds |
//! |---|---|---|
//! | [`common`] | always | what protocols share: [`Rooms`](common::Rooms) (handoff ids), SSE event mapping ([`common::sse`]), refusing SGLang's native API where it is not carried |
//! | `vllm` | `vllm` (default) | `VllmNixl` (NIXL, pull mode), `VllmMooncake` (Mooncake, bootstrap server), the prefill rewriter and vLLM's request checks (`vllm::rewrite`) |
//! | `sglang` | `sglang` (default) | `SglangBootstrap` (bootstrap host, port and room), SGLang's native `/generate` API and its logprob merge |
//! | `lmcache` | `lmcache` (brings `vllm`) | `Lmcache` (the first token from the prefill, the decode gated on KV-ready notifications), the reshape from completions to chat, the ZMQ PULL listener (`Notifications`) |
//!
//! The JSON toolkit every protocol rewrites bodies with is `disagg-json`
//! ([`JsonBody`](disagg_json::JsonBody), pydantic's lax reading of JSON values in
//! [`disagg_json::lax`], which the core's `PdRequest` also reads `stream` with).
//!
//! A new protocol is one module here plus one feature (the [`guide`] walks through it).
//!
//! # Examples
//!
//! Planning one request with the vLLM NIXL connector (no I/O):
//!
//! ```
//! # #[cfg(feature = "vllm")] {
//! use std::sync::Arc;
//! use disagg_connectors::vllm::VllmNixl;
//! use disagg_core::connector::KvConnector;
//! use disagg_core::endpoint::{Endpoint, Role};
//! use disagg_core::request::{Api, PdRequest};
//! use disagg_core::router::Route;
//! use disagg_core::source::{EndpointSource, StaticSource};
//!
//! let source = StaticSource::new([
//!     Endpoint::new("http://127.0.0.1:8100", Role::Prefill).unwrap(),
//!     Endpoint::new("http://127.0.0.1:8200", Role::Decode).unwrap(),
//! ]);
//! let req = PdRequest::new(
//!     Api::Chat,
//!     Default::default(),
//!     &r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#.into(),
//! )
//! .unwrap();
//! let set = source.snapshot();
//! let prefill = Arc::clone(&set.by_role(Role::Prefill)[0]);
//! let route = Route::new(Some(prefill), Arc::clone(&set.by_role(Role::Decode)[0]));
//! let handoff = VllmNixl::new().prepare(&route, &req).unwrap();
//! assert_eq!(handoff.prefill.body.get("stream"), Some(&b"false"[..]));
//! assert_eq!(handoff.decode.body.get("stream"), Some(&b"true"[..]));
//! # }
//! ```
//!
//! [`KvConnector`]: disagg_core::connector::KvConnector

// docs.rs builds with `--cfg docsrs` (package.metadata.docs.rs) on a nightly toolchain,
// where each feature-gated item is marked with the features it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

pub mod common;
#[cfg(feature = "lmcache")]
#[cfg_attr(docsrs, doc(cfg(feature = "lmcache")))]
pub mod lmcache;
#[cfg(feature = "sglang")]
#[cfg_attr(docsrs, doc(cfg(feature = "sglang")))]
pub mod sglang;
#[cfg(feature = "vllm")]
#[cfg_attr(docsrs, doc(cfg(feature = "vllm")))]
pub mod vllm;

#[cfg(all(feature = "vllm", feature = "sglang"))]
#[cfg_attr(docsrs, doc(cfg(all(feature = "vllm", feature = "sglang"))))]
pub mod guide {
    //! The connector guide (`docs/connectors.md`), with its example compiled.
    #![doc = include_str!("../docs/connectors.md")]
}
