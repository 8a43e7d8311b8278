//! **disagg**: prefill/decode disaggregated LLM serving, as a library.
//!
//! This facade re-exports the workspace's crates: [`core`] (always), [`http`] (feature
//! `http`, on by default) and [`sim`] (feature `sim`). The README follows; its code
//! sample is compiled as a doc test.
//!
#![doc = include_str!("../README.md")]

pub use disagg_core as core;
#[cfg(feature = "http")]
pub use disagg_http as http;
#[cfg(feature = "sim")]
pub use disagg_sim as sim;
