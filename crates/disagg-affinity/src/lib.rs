//! Session affinity for disagg: keep a multi-turn session on the same engines.
//!
//! Three pieces, each usable alone:
//!
//! - [`key`]: find a request's session key — the `x-session-id` header under any spelling
//!   a proxy may have rewritten it to (`X-Session-Id`, `x_session_id`, ...), then a
//!   configurable priority list of other headers and top-level body fields (`user` by
//!   default). Only the one body field asked for is decoded.
//! - [`hrw`]: weighted rendezvous (highest random weight) hashing over endpoint ids with
//!   a stable, process-independent 64-bit hash, so every proxy replica and every restart
//!   maps a key to the same endpoint, and adding or removing an endpoint moves only the
//!   keys that must move.
//! - [`consistent`]: [`ConsistentHash`], a [`Pick`](disagg_core::policy::Pick) policy
//!   for one leg: sticky per session key, bounded by load so one hot session cannot
//!   overload an engine, and a fallback policy (least in flight by default) for requests
//!   without a key.
//!
//! # Examples
//!
//! ```
//! use std::sync::Arc;
//!
//! use disagg_affinity::ConsistentHash;
//! use disagg_core::policy::{PerLeg, Pick};
//! use disagg_core::router::RequestView;
//! use disagg_core::{Api, Endpoint, JsonBody, Role};
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
//! let view = RequestView { api: Api::Chat, model: Some("m"), headers: &headers, body: &body };
//!
//! let first = policy.pick(&view, &engines);
//! for _ in 0..10 {
//!     assert_eq!(policy.pick(&view, &engines), first);
//! }
//!
//! // One policy per leg: sticky decode, sticky prefill.
//! let _router = PerLeg::new(ConsistentHash::default(), ConsistentHash::default());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod consistent;
pub mod hrw;
pub mod key;
pub mod prefix;

pub use consistent::{ConsistentHash, LoadFactorError};
pub use hrw::{WeightError, Weights};
pub use key::{KeySource, SessionKey};
pub use prefix::{PrefixError, PrefixHasher};
