//! A small, bounded ZMTP 3 (ZeroMQ) implementation for the sockets disagg reads from
//! peers it does not control: the engines' KV events, replay answers and load reports,
//! and LMCache's KV-ready notifications.
//!
//! Every byte a peer sends has a ceiling before it is stored: a frame header
//! announcing more than [`Limits::max_frame`], a message beyond
//! [`Limits::max_message`] or [`Limits::max_frames`], a command beyond
//! [`conn::MAX_COMMAND`], a handshake slower than [`Limits::handshake_timeout`] is a
//! disconnection with its reason ([`Reject`]), never an allocation; frame bodies grow
//! with the bytes that actually arrive. Why this exists instead of the `zeromq` crate
//! or libzmq: docs/security.md ("ZMQ peers").
//!
//! - [`wire`]: the greeting, frame headers and commands as pure functions;
//! - [`conn`]: one connection: the NULL-mechanism handshake (READY with
//!   `Socket-Type`, checked against ours), whole messages in and out, PING answered
//!   with PONG;
//! - [`socket`]: [`Sub`] (connect and subscribe), [`Dealer`] (connect, request and
//!   answers), [`Pull`] (bind, many `PUSH` peers, each on its own task, counted in
//!   [`PullStats`]).
//!
//! Only TCP and the NULL mechanism; the version advertised is 3.0 (subscriptions as
//! `\x01topic` data frames), which libzmq 4.x and the `zeromq` crate both speak with.
//! Nothing reconnects on its own: the callers renew connections with their own back-off.
//!
//! # Examples
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use disagg_zmtp::{Limits, Sub};
//!
//! # async fn run() -> Result<(), disagg_zmtp::Error> {
//! let mut sub = Sub::connect("tcp://127.0.0.1:5557", b"", Limits::new(8 << 20), Duration::from_secs(2)).await?;
//! let frames = sub.recv().await?; // at most 16 frames, 8 MiB in all
//! # drop(frames);
//! # Ok(())
//! # }
//! ```

pub mod conn;
pub mod socket;
pub mod wire;

pub use conn::{Connection, Error, Limits, Message, Reject, SocketType};
pub use socket::{Dealer, Pull, PullConfig, PullStats, PullStatsHandle, Sub};
