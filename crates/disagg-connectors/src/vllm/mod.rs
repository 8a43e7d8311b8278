//! vLLM's P/D connectors, and the prefill rewriter with the checks that keep it honest.
//!
//! ```text
//! check:    rewrite::check   vLLM's rules on the fields the rewriter changes (400 with
//!                            OpenAI's param), beam search served direct
//! prepare:  rewrite          the prefill leg: one token, non-streaming, no sampling extras
//! NIXL:     prefill ─▶ its kv_transfer_params (checked) ─▶ decode        (AfterPrefill)
//! Mooncake: resolve: the prefill's engine id per rank (GET /query, cached);
//!           prefill ∥ decode, paired by a transfer id                   (Concurrent)
//! ```
//!
//! | file | holds |
//! |---|---|
//! | `nixl.rs` | [`VllmNixl`]: NIXL in pull mode, the handoff dict checked as vLLM 0.33's decode reads it |
//! | `reuse.rs` | [`PromptTokenReuse`]: vLLM 0.33's prompt-token reuse on NIXL's decode leg (chat) |
//! | `encoder.rs` | [`VllmEncoder`]: the encoder legs of E/P/D and the `ec_transfer_params` they give the prefill; `encoder/chat.rs` reads a chat request's media parts as raw slices, `encoder/convert.rs` the Responses and Messages items as the chat parts vLLM makes of them |
//! | `mooncake.rs` | [`VllmMooncake`]: Mooncake, the bootstrap server's engine ids, data-parallel ranks pinned |
//! | `rewrite/mod.rs` | [`PrefillRewriter`](rewrite::PrefillRewriter): the prefill leg's body |
//! | `rewrite/check.rs` | [`check_request`](rewrite::check::check_request) and [`VllmLimits`](rewrite::check::VllmLimits): what vLLM refuses in the rewritten fields |
//!
//! Both connectors pin a leg's data-parallel rank with
//! [`Leg::set_rank`](disagg_core::connector::Leg::set_rank) (`X-Data-Parallel-Rank`, the
//! header vLLM's API server reads).

mod encoder;
mod mooncake;
mod nixl;
pub mod reuse;
pub mod rewrite;

pub use encoder::{DEFAULT_EC_HOST, DEFAULT_EC_PORT, MooncakeEcPush, VllmEncoder};
pub use mooncake::VllmMooncake;
pub use nixl::VllmNixl;
pub use nixl::bidi;
pub use reuse::{PromptTokenReuse, ReuseStats};
