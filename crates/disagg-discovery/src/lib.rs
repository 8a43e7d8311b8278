//! Service discovery for disagg: the prefill and decode engines found in Kubernetes,
//! in DNS or in a watched endpoints file, merged with those given on the command line
//! into the one endpoint set the orchestrator routes over.
//!
//! # How it fits
//!
//! The core reads endpoints through its `EndpointSource` seam
//! ([`disagg_core::EndpointSource`]): immutable [`EndpointSet`](disagg_core::endpoint::EndpointSet)
//! snapshots published through a `tokio::sync::watch`. This crate provides:
//!
//! - the [`EndpointSpec`]: one engine as a source finds it, plain data (URL, role,
//!   models, data-parallel ranks, weight, KV profile, KV-events endpoint, and protocol
//!   facts such as a bootstrap port or an LMCache receiver, kept as the endpoints'
//!   [`Facts`](disagg_core::endpoint::Facts) for the connectors to read: no protocol
//!   crate is a dependency), turned into the core's endpoints exactly as the command
//!   line's flags are;
//! - the sources, one cargo feature each, each a background task publishing its whole
//!   list of specs whenever it changes, and nothing when discovery fails (the last good
//!   list stays; a DNS name's, at most an hour by default): `kubernetes` (pods by label
//!   selector, through kube-rs's watcher), `dns` (A/AAAA and SRV names, with
//!   hickory-resolver) and `file` (a TOML file, reloaded on change);
//! - the [`MergedSource`], an `EndpointSource` merging the fixed endpoints and every
//!   source's specs into one set, keeping the same `Arc<Endpoint>` for an engine whose
//!   spec did not change, so that in-flight counts, health and cache affinity survive
//!   every change, and counting per source the endpoints and changes for `/metrics`
//!   ([`MergedSource::register_metrics`]).
//!
//! The [`guide`] (`docs/discovery.md`) has every flag, label and annotation, the
//! Kubernetes manifests and what the tests prove.
//!
//! # Features
//!
//! | feature | what |
//! |---|---|
//! | (default) | the specs and the merged source, no discovery backend |
//! | `kubernetes` | [`kubernetes`]: pods by label selector (kube-rs, k8s-openapi) |
//! | `dns` | [`dns`]: A/AAAA and SRV names (hickory-resolver) |
//! | `file` | [`file`](mod@file): a TOML endpoints file |
//! | `full` | all of the above |
//!
//! # Examples
//!
//! An embedder's own source, merged with a fixed prefill engine:
//!
//! ```
//! use disagg_core::{Endpoint, EndpointSource, Role};
//! use disagg_discovery::{EndpointSpec, MergedSource, SpecSource};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let (publisher, admin) = SpecSource::channel("admin");
//! publisher.publish(vec![EndpointSpec::new("http://10.0.0.7:8200", Role::Decode)]);
//! let source = MergedSource::builder()
//!     .endpoints([Endpoint::new("http://10.0.0.5:8100", Role::Prefill)?])
//!     .source(admin)
//!     .build();
//! source.synced().await;
//! let set = source.snapshot();
//! let counts = (set.by_role(Role::Prefill).len(), set.by_role(Role::Decode).len());
//! assert_eq!(counts, (1, 1));
//! # Ok(())
//! # }
//! ```

// docs.rs builds with `--cfg docsrs` (package.metadata.docs.rs) on a nightly toolchain,
// where each feature-gated item is marked with the features it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

#[cfg(feature = "dns")]
#[cfg_attr(docsrs, doc(cfg(feature = "dns")))]
pub mod dns;
#[cfg(feature = "file")]
#[cfg_attr(docsrs, doc(cfg(feature = "file")))]
pub mod file;
mod identity;
#[cfg(feature = "kubernetes")]
#[cfg_attr(docsrs, doc(cfg(feature = "kubernetes")))]
pub mod kubernetes;
pub mod merge;
pub mod source;
pub mod spec;

/// The guide: sources, flags, labels and annotations, merge rules, metrics, the
/// Kubernetes walkthrough and what the tests prove (`docs/discovery.md`).
#[doc = include_str!("../docs/discovery.md")]
pub mod guide {}

pub use merge::{MergedSource, MergedSourceBuilder, STATIC_SOURCE};
pub use source::{SourceStats, SpecPublisher, SpecSource, Specs};
pub use spec::{
    Bounds, DEFAULT_MAX_DP_RANKS, DEFAULT_MAX_ENDPOINTS_PER_SOURCE, EndpointSpec, KvEventsEndpoint,
    MAX_CONNECTOR_NAME_BYTES, MAX_MODEL_NAME_BYTES, MAX_MODELS_PER_ENGINE, ModelsError,
    ProfileError, Ranks, RanksError, SpecError, check_facts, endpoint_count, model_names,
    parse_kv_profile,
};
