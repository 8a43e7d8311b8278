//! Routing policies for disagg: which engine each leg of a request goes to, from the
//! simple turn-taking and load-based picks to keeping a request on the engine that
//! already holds its context, by session key or by prompt prefix; and whether a request
//! is worth a prefill leg at all.
//!
//! `disagg-core` holds the seams these plug into: the
//! [`Router`](disagg_core::router::Router) trait an orchestrator routes with, and the
//! [`Pick`](disagg_core::router::Pick) trait, a policy for one leg, and the
//! [`Disaggregate`](disagg_core::policy::Disaggregate) hook. This crate holds the
//! policies.
//!
//! # Naming
//!
//! A pick (a [`Pick`](disagg_core::router::Pick) implementation) is named after its
//! strategy, with no suffix: [`RoundRobin`], [`LeastInFlight`], [`Random`],
//! [`WeightedRandom`], [`PowerOfTwo`], [`ConsistentHash`], [`CacheAware`]. A pick decides
//! one leg; the router is [`PerLeg`], named after how it is built: one pick for the
//! prefill leg and one for the decode leg ([`PerLeg::new`]), or one of the same kind for
//! each ([`PerLeg::both`]: `PerLeg::both(RoundRobin::new)` is round robin over each
//! role, each leg in its own turn).
//!
//! The pieces, each usable alone:
//!
//! - [`policy`]: the simple picks (round robin, least in flight, random, weighted random,
//!   power of two choices) and [`PerLeg`].
//! - [`key`]: find a request's session key — the `x-session-id` header under any spelling
//!   a proxy may have rewritten it to (`X-Session-Id`, `x_session_id`, ...), then a
//!   configurable priority list of other headers and top-level body fields (`user` by
//!   default). Only the one body field asked for is decoded.
//! - [`hrw`]: weighted rendezvous (highest random weight) hashing over endpoint ids with
//!   a stable, process-independent 64-bit hash, so every proxy replica and every restart
//!   maps a key to the same endpoint, and adding or removing an endpoint moves only the
//!   keys that must move.
//! - [`consistent`]: [`ConsistentHash`], a pick for one leg: sticky per session key,
//!   bounded by load so one hot session cannot overload an engine, and a fallback pick
//!   (least in flight by default) for requests without a key.
//! - [`prefix`]: [`PrefixHasher`], a request's prompt (chat `messages` or completions
//!   `prompt`) as chained hashes of fixed-size blocks, read lazily and within a bounded
//!   budget: equal leading hashes mean equal prompt prefixes.
//! - [`cache_aware`]: [`CacheAware`], a pick for the prefill leg that remembers,
//!   in a table of bounded memory, which engine was last sent which prefix blocks, and
//!   sends a request to the engine holding the longest part of its prompt unless the
//!   engines' loads are too far apart.
//! - [`disaggregate`]: [`PromptThreshold`], a
//!   [`Disaggregate`](disagg_core::policy::Disaggregate) hook that serves prompts
//!   estimated shorter than a threshold on a decode engine alone, before any routing.
//!
//! | affinity policy | needs | state | use it when |
//! |---|---|---|---|
//! | [`ConsistentHash`] | a session key | none: any proxy replica decides alike | multi-turn sessions that name themselves |
//! | [`CacheAware`] | a prompt | a table per proxy (≤ 58 bytes per entry) | shared prefixes without a key: long system prompts, few-shot templates, agents |
//!
//! # Examples
//!
//! ```
//! use std::sync::Arc;
//!
//! use disagg_affinity::{ConsistentHash, PerLeg};
//! use disagg_core::router::{Pick, RequestView};
//! use disagg_core::{request::Api, Endpoint, json::JsonBody, Role};
//! use http::HeaderMap;
//!
//! let engines: Vec<Arc<Endpoint>> = (0..3)
//!     .map(|i| Endpoint::new(&format!("http://10.0.0.{i}:8200"), Role::Decode).map(Arc::new))
//!     .collect::<Result<_, _>>()?;
//!
//! let policy = ConsistentHash::default();
//! let mut headers = HeaderMap::new();
//! // A proxy upstream rewrote the dash to an underscore; the session still sticks.
//! headers.insert("x_session_id", "chat-42".parse()?);
//! let body = JsonBody::parse(br#"{"model":"m","messages":[]}"#)?;
//! let view = RequestView::new(Api::Chat, Some("m"), &headers, &body);
//!
//! let first = policy.pick(&view, &engines);
//! for _ in 0..10 {
//!     assert_eq!(policy.pick(&view, &engines), first);
//! }
//!
//! // One policy per leg: sticky decode, sticky prefill.
//! let _router = PerLeg::both(ConsistentHash::default);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod cache_aware;
pub mod consistent;
pub mod disaggregate;
pub mod hrw;
pub mod key;
pub mod policy;
pub mod prefix;

pub use cache_aware::{CacheAware, CacheAwareError};
pub use consistent::{ConsistentHash, LoadFactorError};
pub use disaggregate::PromptThreshold;
pub use hrw::{WeightError, Weights};
pub use key::{KeySource, SessionKey};
pub use policy::{LeastInFlight, PerLeg, PowerOfTwo, Random, RoundRobin, WeightedRandom};
pub use prefix::{PrefixError, PrefixHasher};
