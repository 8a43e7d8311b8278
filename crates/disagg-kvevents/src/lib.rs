//! Precise KV-cache-aware routing for disagg, from the engines' own KV-cache events.
//!
//! vLLM and SGLang publish what their prefix caches hold (blocks stored, blocks
//! evicted, everything cleared) over ZMQ. This crate turns those events into an index
//! a router reads on the request path:
//!
//! - [`event`]: the wire format, decoded (both encodings in the field);
//! - [`key`]: our chained prefix keys, recomputed from each event's token ids so that
//!   every proxy replica computes the same keys as a request's;
//! - [`index`]: [`KvIndex`], per (engine, DP rank) the prefixes it holds, bounded in
//!   memory, read without blocking while the subscriber writes;
//! - [`subscriber`]: [`Subscriber`], one task per engine and rank feeding the index,
//!   with replay on sequence gaps, resubscription of silent or restarted engines, and
//!   entries dropped for engines that leave or stay unreachable;
//! - [`load`]: the engines' own load reports (SGLang's load publisher), kept per rank
//!   next to the index, so that every router prices the same queues;
//! - [`score`]: [`KvScorer`], the routing decision: the candidate engine whose cached
//!   prefix, traded against its load, makes the request cheapest, plus a short-lived
//!   provisional entry for what was just routed;
//! - [`policy`]: the scorer behind the core's seams: [`KvEventsPick`] (a per-leg
//!   `Pick`, the proxy's `kv_events` policy) and [`CachedPrefixThreshold`] (a
//!   `Disaggregate` hook counting only the prompt the decode engine lacks).
//!
//! # Wiring into a router
//!
//! Start one [`Subscriber`] per proxy over a shared [`KvIndex`] and keep its endpoint
//! set in step with discovery ([`Subscriber::set_endpoints`]). On the request path,
//! with the request's token ids (as the engine tokenizes them):
//!
//! - [`KvScorer::choose`] over the leg's candidates ([`Candidate::new`] with the
//!   endpoint's id and in-flight count, [`Candidate::with_dp_rank`] for rank
//!   endpoints) gives the chosen index (nothing to keep until the request ends: the
//!   in-flight count prices the requests still queued), and pin [`Decision::dp_rank`]
//!   when the candidates are whole engines;
//! - [`KvScorer::cached_tokens`] on the chosen decode engine tells how much of the
//!   prompt it already holds, for conditional disaggregation.
//!
//! Engine ids must be the same strings in the [`EngineEndpoint`]s and the candidates.
//!
//! # Examples
//!
//! ```
//! use std::sync::Arc;
//!
//! use disagg_kvevents::event::{BlockHash, BlockStored, EventBatch, KvEvent};
//! use disagg_kvevents::{Candidate, IndexConfig, KvIndex, KvScorer, ScorerConfig};
//!
//! let index = Arc::new(KvIndex::new(IndexConfig::default()));
//! let prompt: Vec<u32> = (0..64).collect();
//! // Engine B stored the first 48 tokens (the subscriber does this from its events).
//! let stored = BlockStored {
//!     block_hashes: (1..=3).map(BlockHash::Int).collect(),
//!     token_ids: prompt[..48].to_vec(),
//!     block_size: 16,
//!     ..BlockStored::default()
//! };
//! let batch = EventBatch { ts: 0.0, events: vec![KvEvent::BlockStored(stored)], dp_rank: None };
//! index.apply("http://b:8000", 0, &batch);
//!
//! let scorer = KvScorer::new(index, ScorerConfig::default());
//! let candidates = [Candidate::new("http://a:8000", 0), Candidate::new("http://b:8000", 0)];
//! let decision = scorer.choose(&prompt, &candidates).expect("two candidates");
//! assert_eq!(decision.index, 1);
//! assert_eq!(decision.cached_tokens, 48);
//! ```

pub mod event;
pub mod index;
pub mod key;
pub mod load;
mod msgpack;
pub mod policy;
pub mod score;
pub mod subscriber;

pub use event::{DecodeError, EventBatch, KvEvent};
pub use index::{HolderMatch, IndexConfig, KvIndex, PrefixMatch};
pub use load::{LoadBoard, LoadStat};
pub use policy::{CachedPrefixThreshold, FewestInFlight, KvEventsPick};
pub use score::{Candidate, Decision, KvScorer, ScorerConfig};
pub use subscriber::{EndpointError, EngineEndpoint, RankStatus, Subscriber, SubscriberConfig};
