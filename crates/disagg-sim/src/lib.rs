//! Simulated LLM engines that behave, on the wire, like a vLLM OpenAI server
//! running the NIXL connector, for the `disagg` demo, integration tests and
//! benchmarks.
//!
//! A [`SimEngine`] serves `POST /v1/chat/completions` and
//! `POST /v1/completions` (streamed or not), `GET /health`, `GET /v1/models`
//! and `GET /stats` over real HTTP/1.1 on a loopback port. Its "model" is a
//! deterministic function of the prompt (see [`generate`]), so a prompt gets
//! the same answer whether it is served in one piece or disaggregated.
//!
//! # Prefill/decode disaggregation
//!
//! The engine plays both roles of vLLM's NIXL pull mode:
//!
//! * **Prefill.** A request with `"kv_transfer_params":
//!   {"do_remote_decode": true}` that finishes length-capped keeps its prompt's
//!   KV blocks (one per [`SimConfig::block_size`] prompt tokens) for
//!   [`SimConfig::kv_lease`] and answers with a top-level
//!   `kv_transfer_params` naming them: `do_remote_prefill`,
//!   `remote_block_ids`, `remote_engine_id`, `remote_request_id`,
//!   `remote_host`, `remote_port` (the side channel) and `tp_size`. If it
//!   finishes with `"stop"` (EOS or a stop string) it keeps nothing and
//!   answers `"kv_transfer_params": null`, as vLLM does.
//! * **Decode.** A request carrying such parameters connects to
//!   `remote_host:remote_port`, pulls the blocks and checks them against the
//!   KV it would have computed for its own prompt. Any failure (nobody
//!   listening, wrong engine id, unknown request id, wrong block ids, KV of
//!   another prompt, expired lease) is answered with HTTP 500
//!   `"KV transfer failed: ..."` before any response head, like vLLM with
//!   `kv_load_failure_policy="fail"`. Parameters vLLM deems invalid (missing
//!   keys, empty `remote_block_ids`) are ignored and the prompt is prefilled
//!   locally.
//!
//! # Side channel protocol
//!
//! The side channel is the simulator's own, line-based stand-in for NIXL:
//! the decode connects to the prefill's side-channel TCP port and sends one
//! JSON line, a [`SideChannelRequest`]:
//!
//! ```text
//! {"engine_id":"<remote_engine_id>","request_id":"<remote_request_id>","block_ids":[0,1,2]}
//! ```
//!
//! The prefill answers one JSON line, a [`SideChannelResponse`], and closes:
//! `{"ok":true,"blocks":["<digest>",..],"prompt_digest":"<digest>"}` on
//! success (the blocks are then freed, like vLLM's "read done"
//! notification), or `{"ok":false,"error":"..."}`. Each block's "KV" is a
//! digest of the model name and the block's tokens, chained to the previous
//! block's digest.
//!
//! # Faults
//!
//! [`Faults`] make the completion routes answer an error status, hang until
//! the client leaves, or abort the connection mid-answer; they can be
//! changed at run time with [`SimEngine::set_faults`].
//!
//! # Example
//!
//! ```
//! use disagg_sim::{SimConfig, SimEngine, generate};
//! use tokio::io::{AsyncReadExt, AsyncWriteExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> std::io::Result<()> {
//! let engine = SimEngine::start(SimConfig::default()).await?;
//!
//! let body = r#"{"model":"sim-model","prompt":"Hello world","max_tokens":3}"#;
//! let mut conn = tokio::net::TcpStream::connect(engine.addr()).await?;
//! let request = format!(
//!     "POST /v1/completions HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\n\
//!      content-length: {}\r\nconnection: close\r\n\r\n{body}",
//!     body.len()
//! );
//! conn.write_all(request.as_bytes()).await?;
//! let mut answer = String::new();
//! conn.read_to_string(&mut answer).await?;
//!
//! assert!(answer.starts_with("HTTP/1.1 200 OK"));
//! let text = generate("Hello world", 3, 0).concat();
//! assert!(answer.contains(&format!(r#""text":"{text}""#)));
//! assert_eq!(engine.stats().local_prefills, 1);
//! engine.shutdown().await;
//! # Ok(())
//! # }
//! ```

mod api;
mod body;
mod config;
mod generate;
mod kv;
mod server;
mod stats;

pub use config::{Faults, SimConfig};
pub use generate::generate;
pub use kv::{SideChannelRequest, SideChannelResponse};
pub use server::{RecordedRequest, SimEngine};
pub use stats::Stats;
