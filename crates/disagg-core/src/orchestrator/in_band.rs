//! The proxy's own error event, ending a stream whose head went out: written in the
//! shape the client's API reads errors in ([`EventShape`]).
//!
//! A client library reads a stream's error only in its API's shape. OpenAI's clients
//! raise `data: {"error": {...}}` whatever the event's name; Anthropic's skip every
//! event without an `event:` name and raise only `event: error` (its
//! `Stream.__stream__`); Cohere's stream ends with a `message-end` event, which tells a
//! failure in its `delta` (vLLM 0.33's `/cohere/v2/chat` writes
//! `{"type": "message-end", "delta": {"error": ..., "finish_reason": "ERROR"}}` then
//! `data: [DONE]` when its stream fails).

use std::task::Poll;

use bytes::Bytes;
use http_body::Frame;

use super::body::{Finish, PollFrame, Tail};
use crate::error::{Side, error_chain};
use crate::outcome::{LegOutcome, Outcome, Report};
use crate::request::Api;

/// The shape of the error event that ends a stream, by the client's API.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum EventShape {
    /// `data: {"error": {"message", "type", "param", "code"}}`: OpenAI's (chat,
    /// completions, Responses, SGLang's `/generate`, and any stream no API names).
    #[default]
    OpenAi,
    /// `event: error` and `data: {"type": "error", "error": {"type", "message"}}`:
    /// Anthropic's (`/v1/messages`).
    Anthropic,
    /// `data: {"type": "message-end", "delta": {"error", "finish_reason": "ERROR"}}`
    /// then `data: [DONE]`: Cohere's (`/cohere/v2/chat`).
    Cohere,
}

impl EventShape {
    /// The shape `api`'s clients read.
    pub(crate) fn of(api: Api) -> Self {
        match api {
            Api::Messages => EventShape::Anthropic,
            Api::CohereChat => EventShape::Cohere,
            _ => EventShape::OpenAi,
        }
    }

    /// One error event (OpenAI's `type` `error_type` and `code` `code`; Anthropic's
    /// type follows `error_type`). It starts with a blank line, which ends an event the
    /// broken stream may have left half-written.
    pub(crate) fn error_event(self, message: &str, error_type: &str, code: &str) -> Bytes {
        let mut out = Vec::with_capacity(message.len() + 96);
        out.extend_from_slice(b"\n\n");
        match self {
            EventShape::OpenAi => {
                out.extend_from_slice(b"data: ");
                out.extend_from_slice(&disagg_json::openai_error_body(
                    message, error_type, None, code,
                ));
            }
            EventShape::Anthropic => {
                let kind = match error_type {
                    "invalid_request_error" | "rate_limit_error" => error_type,
                    _ => "api_error",
                };
                // `type` first, as vLLM's pydantic writes it.
                out.extend_from_slice(
                    b"event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"",
                );
                out.extend_from_slice(kind.as_bytes());
                out.extend_from_slice(b"\",\"message\":");
                disagg_json::write_json_str(&mut out, message.as_bytes());
                out.extend_from_slice(b"}}");
            }
            EventShape::Cohere => {
                // In the order vLLM writes it.
                out.extend_from_slice(b"data: {\"type\":\"message-end\",\"delta\":{\"error\":");
                disagg_json::write_json_str(&mut out, message.as_bytes());
                out.extend_from_slice(b",\"finish_reason\":\"ERROR\"}}\n\ndata: [DONE]");
            }
        }
        out.extend_from_slice(b"\n\n");
        Bytes::from(out)
    }
}

impl Finish {
    /// Whether the decode's failure, answered as a lost KV load answers (`answered_so`),
    /// may be one ([`Report::kv_load_suspect`](crate::outcome::Report)): it was handed
    /// the prefill's KV, and the prefill's leg answered.
    pub(super) fn lost_kv(&self, report: &Report, answered_so: bool) -> bool {
        answered_so && self.kv && report.prefill == LegOutcome::Answered
    }

    /// `report`, of a stream whose concurrent prefill was dropped at the decode's end
    /// while it still ran ([`kv_untaken`](Self::kv_untaken)): a decode leg that failed
    /// there (its error event, SGLang's abort: the transfer from a prefill that had not
    /// answered) is judged neither way. Which engine failed the transfer cannot be told
    /// (a prefill hung or queued past the decode's wait, or either side's network), and
    /// blaming the decode would eject healthy decodes in turn behind one bad prefill,
    /// which the rule across decodes cannot catch (it weighs prefills that answered).
    /// A leg the answer moved on to is its own.
    pub(super) fn unjudged(&self, report: &mut Report) {
        if self.dropped_prefill && !report.moved && report.decode == LegOutcome::Failed {
            report.decode = LegOutcome::Abandoned;
            report.kv_load_suspect = false;
        }
    }

    /// The first decode's stream ended without taking the prefill's KV for an answer: it
    /// carried its error (an error event; SGLang's abort, as a decode whose KV transfer
    /// failed ends its `/generate` stream), or, migrating, the answer moved on to
    /// another decode or was the decode's refusal. A concurrent prefill still running
    /// then holds KV no decode will take: the stream does not wait for it.
    pub(super) fn kv_untaken(&self) -> bool {
        self.errors
            .as_ref()
            .is_some_and(disagg_json::ErrorEvents::found)
            || self.moved.as_ref().is_some_and(|m| m.left_first_leg())
    }
}

/// The body's end: `end`, told to `finish`; a broken event stream (`events`, its error
/// event's shape) ends with an error event, any other body with the error.
pub(super) fn end_with(
    end: Tail,
    events: Option<EventShape>,
    done: &mut bool,
    finish: &mut Option<Box<Finish>>,
) -> PollFrame {
    match end {
        Tail::Trailers(t) => Poll::Ready(Some(Ok(Frame::trailers(t)))),
        Tail::Eos => {
            *done = true;
            if let Some(mut f) = finish.take() {
                f.done(Outcome::Success, None);
            }
            Poll::Ready(None)
        }
        Tail::Error(err) => {
            *done = true;
            let chain = error_chain(&*err);
            let (message, code) = if finish.as_ref().is_some_and(|f| f.refusal()) {
                let message = format!("prefill refusal broke: {chain}");
                tracing::warn!(%message, "the prefill's answer could not be relayed");
                (message, "prefill_failed")
            } else {
                let message = format!("decode stream broke: {chain}");
                tracing::warn!(%message, "decode stream failed mid-response");
                (message, "decode_stream_failed")
            };
            if let Some(mut f) = finish.take() {
                f.done(Outcome::DecodeFailed, None);
            }
            if let Some(shape) = events {
                let event = shape.error_event(&message, "server_error", code);
                Poll::Ready(Some(Ok(Frame::data(event))))
            } else {
                Poll::Ready(Some(Err(err)))
            }
        }
        Tail::Abort(err) => {
            *done = true;
            let message = error_chain(&err);
            let outcome = if err.side() == Side::Prefill {
                tracing::warn!(%message, "prefill leg failed after the decode's answer began");
                Outcome::PrefillFailed
            } else {
                tracing::warn!(%message, "decode stream ended: out of time");
                Outcome::DecodeFailed
            };
            if let Some(mut f) = finish.take() {
                f.done(outcome, Some(&err));
            }
            if let Some(shape) = events {
                let event = shape.error_event(&message, err.event_type(), err.code());
                Poll::Ready(Some(Ok(Frame::data(event))))
            } else {
                Poll::Ready(Some(Err(Box::new(err))))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each shape's event, read back as its clients read it: one JSON payload per
    /// `data:` line, Anthropic's under `event: error`, each found by the stream watch
    /// as an error event.
    #[test]
    fn each_shape_is_its_apis_error_event() {
        let message = "decode stream broke: \"x\"";
        let events = |shape: EventShape, error_type: &str| {
            let bytes = shape.error_event(message, error_type, "decode_stream_failed");
            let text = String::from_utf8(bytes.to_vec()).unwrap();
            assert!(
                text.starts_with("\n\n") && text.ends_with("\n\n"),
                "{text:?}"
            );
            let mut watch = disagg_json::ErrorEvents::new();
            watch.watch(&bytes);
            assert!(watch.finish().is_some(), "the watch finds it: {text:?}");
            text
        };
        let openai = events(EventShape::OpenAi, "server_error");
        let v: serde_json::Value =
            serde_json::from_str(openai.trim().strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(
            (&v["error"]["message"], &v["error"]["code"]),
            (&message.into(), &"decode_stream_failed".into())
        );
        for (error_type, kind) in [
            ("server_error", "api_error"),
            ("invalid_request_error", "invalid_request_error"),
            ("rate_limit_error", "rate_limit_error"),
        ] {
            let anthropic = events(EventShape::Anthropic, error_type);
            let data = anthropic
                .trim()
                .strip_prefix("event: error\ndata: ")
                .unwrap_or_else(|| panic!("{anthropic:?}"));
            let v: serde_json::Value = serde_json::from_str(data).unwrap();
            assert_eq!(
                v,
                serde_json::json!({"type": "error", "error": {"type": kind, "message": message}})
            );
        }
        let cohere = events(EventShape::Cohere, "server_error");
        let lines: Vec<&str> = cohere.trim().split("\n\n").collect();
        assert_eq!(lines.len(), 2, "{cohere:?}");
        let v: serde_json::Value =
            serde_json::from_str(lines[0].strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"type": "message-end", "delta": {"error": message, "finish_reason": "ERROR"}})
        );
        assert_eq!(lines[1], "data: [DONE]");
        assert_eq!(EventShape::of(Api::Messages), EventShape::Anthropic);
        assert_eq!(EventShape::of(Api::CohereChat), EventShape::Cohere);
        assert_eq!(EventShape::of(Api::Responses), EventShape::OpenAi);
    }
}
