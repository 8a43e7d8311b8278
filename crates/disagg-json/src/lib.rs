//! The JSON toolkit of **disagg**'s engine protocols: what a connector needs to read and
//! rewrite a client's request body and to read one field of an engine's answer, without
//! building either as a tree.
//!
//! | item | for |
//! |---|---|
//! | [`JsonBody`] | the top level of a request body, edited in place: values stay the bytes they arrived as |
//! | [`lax`] | pydantic's lax reading of JSON values (`bool`, `int`), as vLLM and SGLang read request fields |
//! | [`top_level_field`], [`top_level_read`], [`top_level_read_pair`] | one or two fields of an engine's answer, found without building the rest |
//! | [`write_json_str`] | a JSON string, copied between quotes when nothing needs escaping |
//! | [`BodyError`], [`InvalidParam`] | why a body could not be used |
//! | [`openai_error_body`] | OpenAI's error body, the shape every error answer and error event takes |
//! | [`ErrorEvents`] | an engine's in-band error event, spotted in its stream as it is relayed |
//! | [`FinishReasons`] | whether an OpenAI-style stream carried a choice's finish reason (one that ends without did not answer) |
//!
//! Nothing here knows the orchestrator or any engine: `disagg-core` builds its
//! `PdRequest` on [`JsonBody`] (and re-exports this crate as `disagg_core::json`), and
//! the connectors of `disagg-connectors` rewrite the legs' bodies with it. `serde_json`
//! is the only JSON dependency; values are validated by it, never built.
//!
//! # Examples
//!
//! ```
//! use disagg_json::JsonBody;
//!
//! let mut body = JsonBody::parse(br#"{"model":"m","prompt":"hi","stream":true}"#)?;
//! body.set("stream", &false);
//! body.retain(|key| key != b"model");
//! assert_eq!(&body.to_bytes()[..], br#"{"prompt":"hi","stream":false}"#);
//! # Ok::<(), disagg_json::BodyError>(())
//! ```

mod abort;
mod body;
mod error;
mod event;
mod finish;
pub mod lax;
mod output;
pub mod raw;
mod tail;

pub use body::{
    JsonBody, MAX_FIELDS, ReadPair, top_level_field, top_level_read, top_level_read_pair,
    write_json_str,
};
pub use error::{BodyError, InvalidParam, openai_error_body};
pub use event::{ErrorEvent, ErrorEvents, MAX_ERROR_EVENT};
pub use finish::FinishReasons;
pub use output::ResponsesOutput;
