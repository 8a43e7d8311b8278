//! SGLang's P/D protocol: both legs at once, meeting at the prefill's bootstrap server.
//!
//! ```text
//! check:    n > 1 refused; batches within MAX_SEQUENCES
//! prepare:  the client's body to both legs + bootstrap_host/port/room (one room per
//!           prompt of a batch), data-parallel ranks as SGLang reads them
//! send:     prefill ∥ decode (Concurrent); /generate with return_logprob: Joined, the
//!           prompt's logprobs merged from the prefill's answer into the decode's
//! ```
//!
//! | file | holds |
//! |---|---|
//! | `bootstrap.rs` | [`SglangBootstrap`]: the plan, its checks, the rooms drawn per attempt |
//! | `generate.rs` | SGLang's native `/generate`: batch sizes, and the logprob merge (a reshape, streamed per event) |

mod bootstrap;
mod generate;

pub use bootstrap::{MAX_SEQUENCES, SglangBootstrap};
