//! The first look at each event of a tracked decode stream: what is not a chunk (a
//! comment, `[DONE]`, an error event) is told apart before the chunk is read.
//!
//! An error event is read by the classifier every relayed stream is watched with
//! ([`ErrorEvent`]): one naming a 5xx breaks the leg (its engine failed: continued when
//! the request may migrate), one naming a 4xx or no status is the decode's refusal
//! (relayed as it came, not continued, no engine blamed).

use bytes::{Bytes, BytesMut};
use disagg_json::ErrorEvent;

use super::scan::payload;
use super::{Migrating, Reason};

impl Migrating {
    /// A first leg's event, before its chunk is read: one that is not a chunk is relayed
    /// as it came (`[DONE]` also ends the stream), an error frame breaks the stream.
    /// The chunk's data otherwise.
    pub(super) fn relayed<'a>(
        &mut self,
        event: &'a Bytes,
        out: &mut BytesMut,
    ) -> Result<Option<&'a [u8]>, Reason> {
        let Some(data) = payload(event) else {
            out.extend_from_slice(event);
            return Ok(None);
        };
        if data == b"[DONE]" {
            if self.answer_missing() {
                // The answer never finished: a broken stream, its `[DONE]` not relayed.
                return Err(Reason::Eof);
            }
            self.done = true;
            out.extend_from_slice(event);
            return Ok(None);
        }
        self.error(data)?;
        Ok(Some(data))
    }

    /// A continuation's event, before its chunk is read: a line that is not a chunk is
    /// dropped, `[DONE]` ends the client's stream, an error frame breaks it. The chunk's
    /// data otherwise.
    pub(super) fn continued<'a>(
        &mut self,
        event: &'a Bytes,
        out: &mut BytesMut,
    ) -> Result<Option<&'a [u8]>, Reason> {
        let Some(data) = payload(event) else {
            return Ok(None);
        };
        if data == b"[DONE]" {
            if self.answer_missing() {
                return Err(Reason::Eof);
            }
            self.done = true;
            out.extend_from_slice(b"data: [DONE]\n\n");
            return Ok(None);
        }
        self.error(data)?;
        Ok(Some(data))
    }

    /// A chunk's payload that is an error event breaks the leg ([`Reason::ErrorFrame`]),
    /// the event kept for [`refusal`](Self::refusal) to read.
    fn error(&mut self, data: &[u8]) -> Result<(), Reason> {
        // SGLang's `/generate` tells a request its engine aborted in its finish reason.
        let event = match self.ctx.plan.generate {
            Some(_) => ErrorEvent::of_generate_payload(data),
            None => ErrorEvent::of_payload(data),
        };
        match event {
            Some(event) => {
                self.error_event = Some(event);
                Err(Reason::ErrorFrame)
            }
            None => Ok(()),
        }
    }

    /// The error event that broke the current leg, when it is its decode's refusal: it
    /// names a 4xx, or no status ([`ErrorEvent::is_server_error`], as for a stream
    /// relayed without migration), and the leg's stream did not end for a fresh prefill
    /// riding in it (whose failure the proxy writes as an event of its own).
    pub(super) fn refusal(&mut self) -> Option<ErrorEvent> {
        let event = self.error_event.take()?;
        (!event.is_server_error() && self.leg.failed_prefill().is_none()).then_some(event)
    }
}
