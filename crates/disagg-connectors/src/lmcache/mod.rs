//! LMCache's P/D mode: the connector, its reshape, and the KV-ready notification listener.
//!
//! With LMCache's P/D mode (vLLM `LMCacheConnectorV1`, KV moved over NIXL) the prefill's
//! HTTP answer does not say when the KV cache has reached the decode. Instead every
//! prefill tensor-parallel rank PUSH-connects to a ZMQ PULL socket owned by the proxy and,
//! once its share of a request's KV has been written to the decode, sends a msgpack map
//! `{"type": "ProxyNotif", "req_id": "<id>"}` (older LMCache: `"NixlProxyNotif"`). The
//! proxy sends the decode leg only after it has as many notifications for the request as
//! the decode has TP ranks, so a prefill and a decode pair only at equal TP sizes. The
//! wire format's source is LMCache/LMCache `lmcache/v1/storage_backend/pd_backend.py`
//! (`ProxyNotif`, a `msgspec.Struct` with `tag=True`); LMCache's reference proxy is
//! `examples/disagg_prefill/xpyd/disagg_proxy_server_first_token_from_prefiller_xpyd.py`.
//!
//! | file | holds |
//! |---|---|
//! | `connector.rs` | [`Lmcache`]: the plan (both legs to `/v1/completions`, the prefill's first token as the stream's lead, the decode gated on its notifications), [`LmcacheReceiver`] (an endpoint's notification address and TP size), the reshape from completions to chat |
//! | `reshape.rs` | the reshape from the decode's completions answer to the client's API, the prefill's first token first |
//! | `notify.rs` | [`Notifications`], the PULL socket and its bounded registry, with [`Pending`] |
//!
//! The listener:
//!
//! - [`Notifications`] binds the PULL socket (pure-Rust ZMQ, no libzmq) and keeps a
//!   bounded registry of the requests waiting for their KV;
//! - [`Pending`] is one registration: [`Pending::ready`] resolves when the expected
//!   number of notifications arrived, and dropping it forgets the request.
//!
//! # Examples
//!
//! A prefill rank's notification, sent over a real PUSH socket:
//!
//! ```
//! use disagg_connectors::lmcache::{Notifications, NotifyConfig};
//! use zeromq::{Socket, SocketSend};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let notifications = Notifications::bind("127.0.0.1:0", NotifyConfig::default()).await?;
//! let addr = notifications.local_addr().ok_or("no address")?;
//!
//! // Register before the prefill is sent: a decode with one TP rank waits for one
//! // notification.
//! let pending = notifications.register("req-42", 1)?;
//!
//! // What an LMCache prefill rank does once the KV is on the decode.
//! let mut push = zeromq::PushSocket::new();
//! push.connect(&format!("tcp://{addr}")).await?;
//! #[derive(serde::Serialize)]
//! struct ProxyNotif<'a> {
//!     #[serde(rename = "type")]
//!     kind: &'a str,
//!     req_id: &'a str,
//! }
//! let wire = rmp_serde::to_vec_named(&ProxyNotif { kind: "ProxyNotif", req_id: "req-42" })?;
//! push.send(wire.into()).await?;
//!
//! pending.ready().await?;
//! assert_eq!(notifications.stats().completed, 1);
//! # Ok(())
//! # }
//! ```

mod connector;
mod notify;
mod reshape;

pub use connector::{
    CONTEXT_PROBE_TIMEOUT, Lmcache, LmcacheReceiver, MAX_PROMPT_TOKENS, ReceiverError,
};
pub use notify::{
    DEFAULT_MAX_NOTIFICATION, Notifications, NotifyConfig, NotifyError, NotifyStats, Pending,
    WaitError,
};
