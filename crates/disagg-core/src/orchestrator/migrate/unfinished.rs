//! A tracked vLLM stream that ends before its answer did: `data: [DONE]` (or the end of
//! its body) came while the choice had no finish reason yet. vLLM 0.33 ends so a
//! streamed completions request whose KV load failed (`kv_load_failure_policy="fail"`:
//! its completion stream generator skips the output that has no text before it reads
//! its `error` finish), with no chunk of the answer at all, or only its usage chunk. It
//! is a broken stream, continued as any other; when it is not, the client's stream ends
//! with the proxy's error event ([`Unfinished`]), never with a `[DONE]` that looks like
//! an answer.
//!
//! Such a first leg may have told nothing of its prompt: a completions request with
//! nothing generated is then continued from the client's own prompt, and its header
//! and prompt ids are read from the continuation's first chunk.

use bytes::{Bytes, BytesMut};
use http_body::Frame;

use super::head::FirstChunk;
use super::start::failing;
use super::{BoxError, Migrating};

/// Why a tracked stream that was not continued ended the client's stream with an error:
/// its answer never finished.
#[derive(Debug, thiserror::Error)]
pub(super) enum Unfinished {
    /// The decode's stream reached `data: [DONE]` while its answer had no finish reason.
    #[error("the decode's stream reached `data: [DONE]` before its answer finished")]
    Done,
    /// The decode's body ended before `data: [DONE]` and before its answer's finish.
    #[error("the decode's stream ended before its answer finished")]
    Eof,
}

impl Migrating {
    /// A `[DONE]` now would end a vLLM answer that never finished: its choice had no
    /// finish reason. (SGLang's `/generate`, whose decode answers a failed KV load with
    /// an error before its head, is not held to it.)
    pub(super) fn answer_missing(&self) -> bool {
        !self.finished && self.ctx.plan.generate.is_none()
    }

    /// The stream may be continued from the client's own prompt: a completions request
    /// none of whose answer came (nothing generated), its prompt's ids not told.
    pub(super) fn unstarted(&self) -> bool {
        self.on
            && !self.raw
            && self.prompt.is_none()
            && self.generated.is_empty()
            && !self.ctx.plan.chat
            && self.ctx.plan.generate.is_none()
    }

    /// `data`, a chunk of a tracked vLLM leg while the prompt's ids are not known yet,
    /// read once for the header every chunk the proxy writes carries (the first one's)
    /// and the prompt's ids; the rest skipped, not built. A chunk of the answer without
    /// them (or a bad one) ends tracking; a chunk with no choice (a usage chunk) leaves
    /// them to the answer's first chunk, which may come from a continuation.
    pub(super) fn read_first(&mut self, data: &[u8]) {
        match serde_json::from_slice::<FirstChunk<'_>>(data) {
            Ok(first) => {
                if self.head.is_none() {
                    self.head = Some(super::Head::of(&first));
                }
                match first.prompt() {
                    Some(ids) if ids.len() <= self.ctx.config.max_seq_len => {
                        self.prompt = Some(ids);
                    }
                    None if !first.answers() => {}
                    _ => self.untrack(),
                }
            }
            Err(_) => self.untrack(),
        }
    }

    /// A usage chunk (`usage`) before the answer's finish: vLLM writes it after the
    /// finish, so one before it ends an answer that never finished (a completions
    /// decode whose KV load failed). It is not relayed: the stream is continued, and
    /// the continuation's usage chunk counts the answer, or it ends in an error.
    pub(super) fn early_usage(&self, usage: bool) -> bool {
        usage && self.answer_missing()
    }

    /// The client's stream ends, not continued, with `e` after `out` (what went before
    /// it in its frame): `out` now and the error at the next poll, or the error now.
    pub(super) fn fail_after(
        &mut self,
        out: BytesMut,
        e: Unfinished,
    ) -> Result<Frame<Bytes>, BoxError> {
        let e: BoxError = Box::new(e);
        if out.is_empty() {
            self.ended = true;
            return Err(e);
        }
        self.inner = failing(e);
        Ok(Frame::data(out.freeze()))
    }
}
