//! SGLang's abort finish reason, read as an error event ([`Aborts`]).
//!
//! SGLang's native `/generate` stream has no error event for a request its engine
//! aborted: the element's last event carries `meta_info.finish_reason` =
//! `{"type": "abort", "message": ..., "status_code": N, "err_type": ...}`
//! (`FINISH_ABORT.to_json()`, `sglang/srt/managers/schedule_batch.py`), then the stream
//! ends with `[DONE]` as a served one does. A decode whose KV transfer failed aborts so,
//! naming 500 (`prepare_abort` in `sglang/srt/disaggregation/decode.py`).
//!
//! The watch finds each finish reason set to an object (the `"finish_reason"` key, then
//! `:` and `{`, JSON's whitespace allowed between, cut between frames or not: the
//! reasons before the last event are `null`), reads that object as JSON up to its line's
//! end, and tells an abort by its `type`, wherever its members stand.

use crate::event::{ErrorEvent, MAX_ERROR_EVENT};
use crate::finish::ReasonValues;

/// Watches an SGLang `/generate` stream, frame by frame, for the first finish reason that
/// is an abort.
pub(crate) struct Aborts {
    /// Where each finish reason's value starts.
    values: ReasonValues,
    /// A finish reason's object being read: its bytes so far, from its `{`.
    object: Option<Vec<u8>>,
    found: Option<ErrorEvent>,
}

impl Default for Aborts {
    fn default() -> Self {
        Aborts {
            values: ReasonValues::new(),
            object: None,
            found: None,
        }
    }
}

impl std::fmt::Debug for Aborts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Aborts")
            .field("found", &self.found)
            .finish_non_exhaustive()
    }
}

impl Aborts {
    /// Whether an abort was found.
    pub(crate) fn found(&self) -> bool {
        self.found.is_some()
    }

    /// The abort found, once the stream has ended (a finish reason cut by the stream's
    /// end is read as far as it came).
    pub(crate) fn finish(&mut self) -> Option<ErrorEvent> {
        if let Some(object) = self.object.take() {
            self.found = self.found.or_else(|| read(&object));
        }
        self.found
    }

    /// The stream's next bytes.
    pub(crate) fn watch(&mut self, data: &[u8]) {
        if self.found.is_some() {
            return;
        }
        let mut at = 0;
        loop {
            if let Some(object) = self.object.as_mut() {
                let Some(used) = read_on(object, &data[at..]) else {
                    break;
                };
                at += used;
                let object = self.object.take().unwrap_or_default();
                if let Some(event) = read(&object) {
                    self.found = Some(event);
                    return;
                }
            }
            match self.values.next(data, at) {
                // An object: read to its line's end. `null` or a string: looked past.
                Some(v) if data[v] == b'{' => {
                    self.object = Some(Vec::new());
                    at = v;
                }
                Some(v) => at = v + 1,
                None => break,
            }
        }
        self.values.end_frame(data);
    }
}

/// `object` with `more` after it, up to its line's end or [`MAX_ERROR_EVENT`] bytes: the
/// bytes of `more` taken once either is reached, `None` (all taken) before.
fn read_on(object: &mut Vec<u8>, more: &[u8]) -> Option<usize> {
    let room = MAX_ERROR_EVENT.saturating_sub(object.len());
    let (taken, full) = match memchr::memchr2(b'\n', b'\r', more) {
        Some(end) if end <= room => (end, true),
        _ if more.len() >= room => (room, true),
        _ => (more.len(), false),
    };
    object.extend_from_slice(&more[..taken]);
    full.then_some(taken)
}

/// The abort `object` (a finish reason's object, from its `{`, what follows it on its
/// line after it) is, if it is one: the error naming its `status_code`. One cut before
/// its end (the ceiling, the stream's end) is an abort of no status when it starts as
/// SGLang writes one.
fn read(object: &[u8]) -> Option<ErrorEvent> {
    let value = serde_json::Deserializer::from_slice(object)
        .into_iter::<serde_json::Value>()
        .next();
    match value {
        Some(Ok(v)) => (v.get("type").and_then(serde_json::Value::as_str) == Some("abort"))
            .then(|| ErrorEvent::of_abort(v.get("status_code"))),
        _ => object
            .starts_with(br#"{"type":"abort""#)
            .then(|| ErrorEvent::of_abort(None)),
    }
}

/// The abort a framed event's payload carries, if any.
pub(crate) fn in_payload(payload: &[u8]) -> Option<ErrorEvent> {
    let mut aborts = Aborts::default();
    aborts.watch(payload);
    aborts.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_finish_reason_that_never_ends_keeps_at_most_the_ceiling() {
        // An engine's object with no line end (a hostile or broken peer): read up to the
        // ceiling, then judged by what came; nothing more is kept.
        let mut aborts = Aborts::default();
        aborts.watch(br#"data: {"meta_info":{"finish_reason":{"type":"abort","message":""#);
        for _ in 0..1000 {
            aborts.watch(&[b'x'; 1024]);
            let kept = aborts.object.as_ref().map_or(0, Vec::len);
            assert!(kept <= MAX_ERROR_EVENT, "{kept}");
        }
        // Cut at the ceiling, it starts as SGLang writes an abort: one of no status.
        assert!(aborts.found());
        assert!(aborts.object.is_none());
        assert_eq!(aborts.finish().map(|e| e.status()), Some(None));
    }
}
