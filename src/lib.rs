//! **disagg**: prefill/decode disaggregated LLM serving, as a library.
//!
//! This facade re-exports the workspace's crates, each behind a feature so that an
//! embedder takes only what it needs:
//!
//! | module | crate | feature |
//! |---|---|---|
//! | [`core`] | `disagg-core`: the model, the seams (router, source, connector, transport, admission, retry, listeners), the orchestrator | always |
//! | `http` | `disagg-http`: the pooled transport, the tower service and layer, serving | `http` (default) |
//! | `affinity` | `disagg-affinity`: routing policies (session affinity, consistent hashing, cache-aware) | `affinity` |
//! | `resilience` | `disagg-resilience`: health, admission limits, retries | `resilience` |
//! | `connectors` | `disagg-connectors`: the engines' protocols: `vllm` (NIXL, Mooncake, the prefill rewriter), `sglang` | `connectors` (default) |
//! | `lmcache` | `disagg-connectors`' `lmcache` module: the LMCache connector and its notification listener (also at `connectors::lmcache`) | `lmcache` |
//! | `nixl` | `disagg-nixl`: NIXL side-channel port planning | `nixl` |
//! | `sim` | `disagg-sim`: simulated engines for demos and tests | `sim` |
//! | `discovery` | `disagg-discovery`: endpoints from DNS, a watched file and (with `kubernetes`) Kubernetes pods | `discovery`, `kubernetes` |
//! | `kv_events` | `disagg-kvevents`: routing on the engines' own KV events and load reports | `kv-events` |
//! | `otel` | `disagg-otel`: OpenTelemetry traces over OTLP | `otel` |
//! | `tokenize` | `disagg-tokenize`: a request's token ids, in process or from the engine | `tokenize` |
//!
//! `full` turns every one on. The README follows; its code sample is compiled as a doc
//! test.
//!

// docs.rs builds with `--cfg docsrs` (package.metadata.docs.rs) on a nightly toolchain,
// where each feature-gated item is marked with the features it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![doc = include_str!("../README.md")]

#[cfg(feature = "affinity")]
#[cfg_attr(docsrs, doc(cfg(feature = "affinity")))]
pub use disagg_affinity as affinity;
#[cfg(feature = "connectors")]
#[cfg_attr(docsrs, doc(cfg(feature = "connectors")))]
pub use disagg_connectors as connectors;
#[cfg(feature = "lmcache")]
#[cfg_attr(docsrs, doc(cfg(feature = "lmcache")))]
pub use disagg_connectors::lmcache;
pub use disagg_core as core;
#[cfg(feature = "discovery")]
#[cfg_attr(docsrs, doc(cfg(feature = "discovery")))]
pub use disagg_discovery as discovery;
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub use disagg_http as http;
#[cfg(feature = "kv-events")]
#[cfg_attr(docsrs, doc(cfg(feature = "kv-events")))]
pub use disagg_kvevents as kv_events;
#[cfg(feature = "nixl")]
#[cfg_attr(docsrs, doc(cfg(feature = "nixl")))]
pub use disagg_nixl as nixl;
#[cfg(feature = "otel")]
#[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
pub use disagg_otel as otel;
// The pairing facts an embedder declares on its endpoints (they were `core::pairing`).
pub use disagg_pairing as pairing;
#[cfg(feature = "resilience")]
#[cfg_attr(docsrs, doc(cfg(feature = "resilience")))]
pub use disagg_resilience as resilience;
#[cfg(feature = "sim")]
#[cfg_attr(docsrs, doc(cfg(feature = "sim")))]
pub use disagg_sim as sim;
#[cfg(feature = "tokenize")]
#[cfg_attr(docsrs, doc(cfg(feature = "tokenize")))]
pub use disagg_tokenize as tokenize;
