//! Simulated LLM engines that behave, on the wire, like a vLLM OpenAI server
//! running the NIXL or Mooncake connector, or an SGLang server in
//! disaggregation mode, for the `disagg` demo, integration tests and
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
//! An engine speaks one of three P/D KV protocols, chosen by
//! [`SimConfig::kv_mode`]. In each, the KV really travels over loopback
//! sockets, so a wrong host, port, room, transfer id or engine id fails
//! where it would fail between real engines. Every completion request first
//! waits [`SimConfig::request_delay`] (scheduling), then prefills (locally,
//! [`SimConfig::prefill_delay_per_token`] per prompt token, or from remote
//! KV). A decode whose KV cannot be fetched answers HTTP 500
//! `"KV transfer failed: ..."` before any response head.
//!
//! ## vLLM NIXL ([`KvMode::Nixl`], the default): sequential
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
//! ## SGLang ([`KvMode::Sglang`]): concurrent, by bootstrap room
//!
//! The router sends the same body to a prefill and a decode at once, with
//! `bootstrap_host`, `bootstrap_port` and `bootstrap_room` (a `u63`). A
//! request is a batch when it is a chat request with `n > 1` (`n`
//! elements, sharing the conversation) or a completion request whose
//! `prompt` is a list of strings or of token-id lists (one element per
//! prompt); the three fields are then lists of that length, otherwise
//! scalars (anything else is a 400). Each element's KV is that of its
//! prompt.
//!
//! * **Prefill** (`--disaggregation-mode prefill`, with a bootstrap server at
//!   [`SimEngine::bootstrap_addr`]). `bootstrap_room` is required. After the
//!   prefill, the KV of each element is registered under its room (a room
//!   already registered by another request: 409) and the request waits until
//!   decodes took every room, at most [`SimConfig::bootstrap_timeout`] (then
//!   500 `"KV transfer failed: no decode took room R within ..."`). It then
//!   answers like a plain engine, but with only the first token of each
//!   choice. Its rooms are withdrawn whenever it ends, client gone included.
//! * **Decode** (`--disaggregation-mode decode`). `bootstrap_host` and
//!   `bootstrap_room` are required, a null `bootstrap_port` means 8998
//!   (SGLang's default). It takes the KV of every element's room from
//!   `bootstrap_host:bootstrap_port`, all at once, within its own
//!   [`SimConfig::bootstrap_timeout`], checks it against its own prompt and
//!   generates normally.
//!
//! ## vLLM Mooncake ([`KvMode::Mooncake`]): concurrent, by transfer id
//!
//! The proxy sends both legs at once, correlated by a `transfer_id` it
//! chose.
//!
//! * **Prefill** (`kv_producer`). The request's `kv_transfer_params` must
//!   have `do_remote_decode: true` and a string `transfer_id`; the
//!   `X-data-parallel-rank` header picks one of the [`SimConfig::dp_size`]
//!   ranks (default 0), each with its own engine id
//!   ([`SimEngine::engine_ids`]). After the prefill, the KV is held under
//!   (engine id of the rank, transfer id) for [`SimConfig::kv_lease`] (a
//!   transfer id already held: 400) and the answer is a plain completion
//!   with `"kv_transfer_params": null`. A client that leaves before its
//!   answer is complete gets nothing held. The bootstrap HTTP server at
//!   [`SimEngine::bootstrap_addr`] answers `GET /query` with every rank:
//!   `{"0":{"engine_id":"<id>","worker_addr":{"0":{"0":"<host>:<side channel port>"}}},..}`.
//! * **Decode** (`kv_consumer`). The request's `kv_transfer_params` must have
//!   `do_remote_prefill: true`, `remote_bootstrap_addr`
//!   (`"http://HOST:PORT"`), `remote_engine_id` and `transfer_id`. The
//!   decode asks `GET {remote_bootstrap_addr}/query` for the worker address
//!   of `remote_engine_id`, pulls the transfer from that side channel (see
//!   below), checks the KV against its own prompt and generates normally,
//!   all of it within its own [`SimConfig::bootstrap_timeout`].
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
//! The prefill answers one JSON line, a [`SideChannelResponse`] (the
//! connection stays open for further lines, as a decode reuses it):
//! `{"ok":true,"blocks":["<digest>",..],"prompt_digest":"<digest>"}` on
//! success (the blocks are then freed, like vLLM's "read done"
//! notification), or `{"ok":false,"error":"..."}`. Each block's "KV" is a
//! digest of the model name and the block's tokens, chained to the previous
//! block's digest.
//!
//! A decode that will never pull the blocks it was given (its request was
//! aborted first, see [KV block lifetime](#kv-block-lifetime)) sends a
//! [`SideChannelRelease`] instead, the same fields nested under `release`:
//!
//! ```text
//! {"release":{"engine_id":"<remote_engine_id>","request_id":"<remote_request_id>","block_ids":[0,1,2]}}
//! ```
//!
//! The prefill frees the blocks if all three match blocks it holds and
//! answers `{"ok":true}`, or frees nothing and answers
//! `{"ok":false,"error":"..."}`.
//!
//! A Mooncake pull is a line with a `transfer_id` instead, a
//! [`MooncakePullRequest`]:
//!
//! ```text
//! {"engine_id":"<remote_engine_id>","transfer_id":"<transfer_id>"}
//! ```
//!
//! The prefill waits, up to its [`SimConfig::bootstrap_timeout`], for the
//! transfer to be held under that engine id (its own prefill may still be
//! running), then answers a [`BootstrapResponse`]:
//! `{"ok":true,"prompt_digest":"..","blocks":[..]}` (the KV is then freed),
//! `{"ok":false,"error":"..","timed_out":true}` when the wait ran out, or
//! `{"ok":false,"error":".."}` (unknown engine id, not a Mooncake prefill).
//! A decode that closes the connection while waiting takes nothing.
//!
//! # SGLang bootstrap protocol
//!
//! The simulator's own stand-in for SGLang's bootstrap server and KV
//! transfer: the decode connects to `bootstrap_host:bootstrap_port` and
//! sends one JSON line per room, a [`BootstrapRequest`]:
//! `{"room":123}`. The server waits, up to the prefill's
//! [`SimConfig::bootstrap_timeout`], for a request to register that room,
//! takes it (a room is taken once; a second taker waits like for an unknown
//! room) and answers one [`BootstrapResponse`] line, as above. The
//! connection stays open for further rooms; a decode that closes it while
//! waiting takes nothing.
//!
//! # Faults
//!
//! [`Faults`] make the completion routes answer an error status, hang until
//! the client leaves (before the response head, or mid-answer with
//! [`Faults::stall_after_chunks`]), abort the connection mid-answer, or make
//! a vLLM NIXL prefill answer unusable `kv_transfer_params`
//! ([`Faults::malformed_kv_params`]); they can be changed at run time with
//! [`SimEngine::set_faults`]. The status and hang faults apply in every
//! [`KvMode`], before any KV work: an SGLang prefill with an error status
//! answers it at once, without registering its rooms. The [`Faults`]
//! documentation says which wins when several are set and maps each fault
//! of a proxy's fault matrix to a knob.
//!
//! # Cancellation
//!
//! A request whose client leaves before its answer is complete is counted in
//! [`Stats::cancelled`] and dropped at once, whatever it was waiting for:
//! an SGLang prefill's rooms are withdrawn, a Mooncake prefill's KV is
//! freed, and a decode waiting for its peer closes its connection, which
//! makes the peer's bootstrap server or side channel stop waiting for it
//! (and take nothing). Rooms and transfers not yet taken are counted in
//! [`Stats::kv_transfers_pending`]. What a cancelled request leaves behind
//! on its peer is the subject of the next section.
//!
//! # KV block lifetime
//!
//! How long a prefill keeps the KV it computed for a decode, as the real
//! engines do. Every block held is counted in [`Stats::blocks_held`],
//! whatever the protocol, so `blocks_held == 0` on every prefill proves that
//! nothing is stranded; SGLang rooms and Mooncake transfers are also
//! counted in [`Stats::kv_transfers_pending`].
//!
//! * **vLLM NIXL.** A length-capped prefill holds its blocks when it
//!   answers. They are freed when a decode pulls them, when the lease
//!   ([`SimConfig::kv_lease`]) runs out, or when a decode is aborted before
//!   its pull: a decode request with valid remote-prefill
//!   `kv_transfer_params` whose client leaves (or that is otherwise
//!   dropped) before the pull completed, whether it was waiting in
//!   [`SimConfig::request_delay`] or in the pull itself, sends the prefill a
//!   [`SideChannelRelease`] at once, as vLLM's decode worker notifies the
//!   prefill of a request aborted before its KV was loaded. The prefill
//!   frees the blocks ([`Stats::kv_released_on_abort`]; the decode counts
//!   [`Stats::kv_releases_sent`]). Once the pull is over, successful or
//!   not, nothing is sent: a pulled prefill already freed its blocks, and a
//!   request that completes, with or without an error, never sends one. So
//!   a proxy can free a prefill's blocks early by sending the decode leg and
//!   aborting it right away. Neither a decode rejected before its pull (a
//!   validation error, a [`Faults::status`]) or hung by [`Faults::hang`],
//!   nor a prefill whose client leaves
//!   after its blocks were held (while its answer is being written) frees
//!   anything: those blocks wait for the lease, like vLLM's. A prefill
//!   cancelled before it finished holds nothing.
//! * **SGLang.** A prefill's rooms live as long as its request: they are
//!   withdrawn when a decode took them, when the request is cancelled, or
//!   when no decode took them within [`SimConfig::bootstrap_timeout`] (the
//!   prefill then answers 500). A decode aborted before it took its room
//!   tells nobody: the room stays until the prefill's request ends.
//! * **vLLM Mooncake.** A prefill holds its transfer from its answer until a
//!   decode pulls it or the lease runs out ([`SimConfig::kv_lease`], the
//!   stand-in for `VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`); a prefill whose
//!   client leaves before its answer holds nothing. A decode aborted before
//!   it pulled tells nobody: the transfer stays until the lease runs out.
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
mod lmcache;
mod mooncake;
mod rendezvous;
mod server;
mod sglang;
mod stats;

pub use config::{Faults, KvMode, LmcacheReceiver, SimConfig, SimRole};
pub use generate::{EOS_TOKEN_ID, VOCAB_SIZE, generate, generate_from_ids, tokenize};
pub use kv::{
    BootstrapResponse, MooncakePullRequest, SideChannelRelease, SideChannelRequest,
    SideChannelResponse,
};
pub use server::{BoxError, RecordedRequest, SimEngine, SimService, SimServiceBody};
pub use sglang::BootstrapRequest;
pub use stats::Stats;
