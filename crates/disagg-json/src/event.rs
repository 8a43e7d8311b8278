//! An engine's in-band error event, spotted in an event stream as it goes by
//! ([`ErrorEvents`]).
//!
//! An engine that has sent its `200` head for a streamed answer can no longer answer an
//! error status: it writes one server-sent event in its API's error shape instead.
//!
//! * OpenAI's, `data: {"error": {"message": ..., "type": ..., "code": N}}`, with the
//!   HTTP status the error would have had as its `code` (vLLM's
//!   `create_streaming_error_response` in `vllm/entrypoints/openai/engine/serving.py`,
//!   SGLang's in `sglang/srt/entrypoints/openai/serving_base.py`; SGLang's native
//!   `/generate` may leave the `code` out). vLLM 0.33 streams one for a chat whose KV
//!   load failed.
//! * Anthropic's (vLLM's `/v1/messages`, `vllm/entrypoints/anthropic/`):
//!   `event: error` then `data: {"type":"error","error":{"type": T, "message": ...}}`,
//!   `T` named after the status (`invalid_request_error` 400, `authentication_error`
//!   401, `permission_error` 403, `not_found_error` 404, `request_too_large` 413,
//!   `rate_limit_error` 429, `overloaded_error` 503, `api_error` for another 5xx).
//! * OpenAI's Responses stream: `data: {"type":"error","code": ..., "message": ...}`.
//! * An error response written as an event, `data: {"object": "error", ...}` (OpenAI-style
//!   servers' error body, its `code` the status).
//! * Cohere's (vLLM's `/cohere/v2/chat`, `vllm/entrypoints/cohere/serving.py`): a
//!   `message-end` event whose `delta` holds the error, `data: {"type": "message-end",
//!   "delta": {"error": "...", "finish_reason": "ERROR"}}` (`json.dumps`), written when
//!   the chat stream it converts fails; it names no status, and is read as a 500 (the
//!   engine's failure).
//!
//! * SGLang's native `/generate` stream, which has no error event for a request its
//!   engine aborted: the event's `meta_info.finish_reason` is
//!   `{"type":"abort","message":...,"status_code":N,"err_type":...}` (`FINISH_ABORT` in
//!   `sglang/srt/managers/schedule_batch.py`, written by `orjson`), then `[DONE]`. A
//!   decode whose KV transfer failed aborts so with 500 (`prepare_abort` in
//!   `sglang/srt/disaggregation/decode.py`). Read only where asked
//!   ([`ErrorEvents::with_aborts`], [`ErrorEvent::of_generate_payload`]).
//!
//! The bytes pass through untouched; the watch only tells the relay's caller that the
//! answer carried an error, and the status it names, so that a stream ending in one is
//! not counted as served.

use std::sync::LazyLock;

use memchr::memmem::Finder;

use crate::tail::Tail;

/// What every error event's payload holds at its start, as the engines write it: the key
/// of a dict whose first key is `error` (OpenAI's shape, `json.dumps`), or the value of
/// a first member `"type":"error"` (Anthropic's and the Responses API's, pydantic's
/// `model_dump_json`; `json.dumps`'s spacing accepted too). A JSON string cannot hold it:
/// its quotes would be escaped. The one needle searched for; what comes before it is
/// looked at only when it is found.
const KEY: &[u8] = b"\"error\"";

/// What comes before [`KEY`] in each error payload's shape, from the payload's start,
/// token by token (blanks allowed before each token and before the key): OpenAI's
/// `{"error"`; Anthropic's and the Responses API's `{"type":"error"`; the
/// `{"object":"error"` of an error response OpenAI-style servers write (an engine that
/// wrote its error body as an event); Cohere's `message-end` whose `delta` holds the
/// error (`{"type": "message-end", "delta": {"error": ...`, vLLM's `/cohere/v2/chat`).
const SHAPES: [&[&[u8]]; 4] = [
    &[b"{"],
    &[b"{\"type\":"],
    &[b"{\"object\":"],
    &[b"{\"type\":", b"\"message-end\",", b"\"delta\":", b"{"],
];

/// Whether `b` is a blank JSON allows between tokens on one line.
fn blank(b: u8) -> bool {
    matches!(b, b' ' | b'\t')
}

/// `bytes` from its first byte that is neither a space nor a tab.
fn skip_blanks(bytes: &[u8]) -> &[u8] {
    let blanks = bytes.iter().take_while(|&&b| blank(b)).count();
    &bytes[blanks..]
}

/// The searcher for [`KEY`], built once: an immutable table, as a compiled regex in a
/// static is (building it for each stream cost more than searching the stream).
static FINDER: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(KEY));

/// Bytes of the stream kept from one frame to the next, and looked back over from a
/// needle: enough to see a needle cut between two frames, and the longest of the
/// [`SHAPES`] and the `data:` field name before it.
const TAIL: usize = 64;

/// Most bytes of an error event's line read to learn its code (64 KiB); an event longer
/// than that is an error of unknown code. vLLM writes the `code` after the `message`,
/// and a message can carry an exception's whole text: a ceiling of a few KiB read such a
/// 5xx as an error of no status, the engine's failure as a refusal. The line is kept
/// only once an error event is found, one per stream, so a stream without one costs
/// nothing of it.
pub const MAX_ERROR_EVENT: usize = 64 * 1024;

/// An error event an engine sent in its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorEvent {
    status: Option<u16>,
}

impl ErrorEvent {
    /// The HTTP status the event names, when it names one: OpenAI's `error.code` (a
    /// number from 100 to 599, or such a number in a string), else the status an error
    /// type stands for (Anthropic's, or vLLM's own exception names such as
    /// `InternalServerError`), else a Responses event's `code`; Cohere's `message-end`
    /// holding an error is a 500.
    pub fn status(&self) -> Option<u16> {
        self.status
    }

    /// Whether the event names a 5xx status: the engine's own failure. An event naming
    /// a 4xx, or no status at all (SGLang's `/generate` leaves the code out of a
    /// request it found invalid; a message over [`MAX_ERROR_EVENT`] bytes hides a code
    /// written after it), is not blamed on the engine.
    pub fn is_server_error(&self) -> bool {
        self.status.is_some_and(|s| s >= 500)
    }

    /// The error event whose `data:` payload is `payload` (one event's, from its first
    /// byte: spaces before it are skipped), read as [`ErrorEvents`] reads the one it
    /// finds in a stream, but whole: a caller that framed the event holds all of it
    /// already (and bounds it), so a status written after a long message is read too;
    /// `None` when the payload is not an error event's. For a reader that frames the
    /// events itself.
    ///
    /// ```
    /// use disagg_json::ErrorEvent;
    ///
    /// let event = ErrorEvent::of_payload(br#"{"error": {"message": "m", "code": 400}}"#);
    /// assert_eq!(event.map(|e| e.is_server_error()), Some(false));
    /// assert_eq!(ErrorEvent::of_payload(br#"{"choices": []}"#), None);
    /// ```
    pub fn of_payload(payload: &[u8]) -> Option<ErrorEvent> {
        let payload = skip_blanks(payload);
        let shaped = |shape: &&[&[u8]]| {
            let mut rest = payload;
            for token in *shape {
                match skip_blanks(rest).strip_prefix(*token) {
                    Some(after) => rest = after,
                    None => return false,
                }
            }
            skip_blanks(rest).starts_with(KEY)
        };
        SHAPES.iter().any(shaped).then(|| ErrorEvent::read(payload))
    }

    /// [`of_payload`](Self::of_payload), or the payload of an SGLang `/generate` event
    /// whose finish reason is an abort, read as an error naming the abort's
    /// `status_code` (none named: an error of no status). For a reader of a `/generate`
    /// stream that frames the events itself.
    ///
    /// ```
    /// use disagg_json::ErrorEvent;
    ///
    /// let aborted = br#"{"text":"","meta_info":{"finish_reason":{"type":"abort","message":"m","status_code":500,"err_type":null}}}"#;
    /// assert_eq!(ErrorEvent::of_generate_payload(aborted).and_then(|e| e.status()), Some(500));
    /// let stopped = br#"{"text":"a","meta_info":{"finish_reason":{"type":"stop"}}}"#;
    /// assert_eq!(ErrorEvent::of_generate_payload(stopped), None);
    /// ```
    pub fn of_generate_payload(payload: &[u8]) -> Option<ErrorEvent> {
        ErrorEvent::of_payload(payload).or_else(|| crate::abort::in_payload(payload))
    }

    /// The error an abort finish reason names: its `status_code`, if any.
    pub(crate) fn of_abort(status_code: Option<&serde_json::Value>) -> Self {
        ErrorEvent {
            status: status_code.and_then(as_status),
        }
    }

    /// The event whose data line is `line` (from its payload's `{` on).
    fn read(line: &[u8]) -> Self {
        let value = serde_json::from_slice::<serde_json::Value>(line.trim_ascii()).ok();
        let status = value.as_ref().and_then(|v| {
            let error = v.get("error");
            let code = error.and_then(|e| e.get("code")).and_then(as_status);
            let kind = || error?.get("type")?.as_str().and_then(type_status);
            code.or_else(kind)
                .or_else(|| v.get("code").and_then(as_status))
                .or_else(|| cohere_failure(v).then_some(500))
        });
        ErrorEvent { status }
    }
}

/// Whether `v` is Cohere's `message-end` holding an error (`delta.error`, a string):
/// vLLM's `/cohere/v2/chat` writes it when the chat stream it converts failed, which
/// its chat generator does on the engine's side (a generation that failed, a KV load
/// among them), so it is read as a 500, though it names no status.
fn cohere_failure(v: &serde_json::Value) -> bool {
    v.get("type").and_then(serde_json::Value::as_str) == Some("message-end")
        && v.pointer("/delta/error")
            .is_some_and(serde_json::Value::is_string)
}

/// A status written as a number, or as a number in a string.
fn as_status(code: &serde_json::Value) -> Option<u16> {
    let n = match code {
        serde_json::Value::Number(n) => n.as_u64(),
        serde_json::Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }?;
    u16::try_from(n).ok().filter(|s| (100..600).contains(s))
}

/// The status an error's `type` stands for: Anthropic's types as vLLM's `/v1/messages`
/// names them after the status, and the exception names vLLM's OpenAI errors carry.
fn type_status(kind: &str) -> Option<u16> {
    Some(match kind {
        "invalid_request_error" | "BadRequestError" => 400,
        "authentication_error" => 401,
        "permission_error" => 403,
        "not_found_error" | "NotFoundError" => 404,
        "request_too_large" => 413,
        "rate_limit_error" => 429,
        // `internal_error`: older vLLM's `/v1/messages` stream, for any error.
        // `server_error`: OpenAI's own type for its failures, the one the proxy's own
        // error events carry (a decode stream that broke under a proxy in front).
        "api_error" | "internal_error" | "InternalServerError" | "server_error" => 500,
        "NotImplementedError" => 501,
        "overloaded_error" => 503,
        _ => return None,
    })
}

/// Watches the bytes of an event stream, frame by frame, for the first error event an
/// engine wrote in it.
///
/// Each byte is looked at once: one `memchr` search per frame for `"error"` (a key cut
/// between two frames is found by comparing the frame's first bytes with the last
/// one's), and only where it is found, the bytes before it: the payload's start (one
/// of the shapes above, such as `{"error"` or `{"type":"error"`) after a `data:` field name (spaces between) at a
/// line's start. Only an event found is copied, up to its line's end or
/// [`MAX_ERROR_EVENT`] bytes, and read as JSON for the status it names. The watch is a
/// 64-byte tail and a counter: nothing is allocated for a stream without an error.
///
/// ```
/// use disagg_json::ErrorEvents;
///
/// let mut watch = ErrorEvents::new();
/// watch.watch(b"data: {\"choices\":[]}\n\ndata: {\"err");
/// watch.watch(b"or\": {\"message\": \"Internal server error\", \"code\": 500}}\n\n");
/// let event = watch.finish().expect("an error event");
/// assert_eq!(event.status(), Some(500));
/// assert!(event.is_server_error());
/// ```
pub struct ErrorEvents {
    /// The last bytes seen.
    tail: Tail<TAIL>,
    state: State,
    /// The watch for SGLang's abort finish reason, when it is read as an error event.
    aborts: Option<crate::abort::Aborts>,
}

#[derive(Debug)]
enum State {
    Watching,
    /// An event found: its line so far (from the payload's `{`).
    Reading(Vec<u8>),
    Read(ErrorEvent),
}

impl Default for ErrorEvents {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for ErrorEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ErrorEvents")
            .field("seen", &self.tail.seen())
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl ErrorEvents {
    /// A watch over a stream not begun.
    pub fn new() -> Self {
        ErrorEvents {
            tail: Tail::new(),
            state: State::Watching,
            aborts: None,
        }
    }

    /// The watch, reading SGLang's abort finish reason as an error event too (the
    /// status its `status_code` names; [`ErrorEvent::of_generate_payload`]): for a
    /// `/generate` stream, whose engine tells a request it aborted (a failed KV
    /// transfer among them) so, not with an error event. One more `memchr` search per
    /// frame.
    ///
    /// ```
    /// use disagg_json::ErrorEvents;
    ///
    /// let mut watch = ErrorEvents::new().with_aborts();
    /// watch.watch(br#"data: {"text":"","meta_info":{"finish_reason":{"type":"abort","#);
    /// watch.watch(br#""message":"KV transfer failed","status_code":500}}}"#);
    /// watch.watch(b"\n\ndata: [DONE]\n\n");
    /// assert_eq!(watch.finish().and_then(|e| e.status()), Some(500));
    /// ```
    pub fn with_aborts(mut self) -> Self {
        self.aborts = Some(crate::abort::Aborts::default());
        self
    }

    /// The stream's next bytes.
    pub fn watch(&mut self, data: &[u8]) {
        if let Some(aborts) = self.aborts.as_mut() {
            aborts.watch(data);
        }
        match &mut self.state {
            State::Read(_) => return,
            State::Reading(line) => {
                if let Some(event) = read_on(line, data) {
                    self.state = State::Read(event);
                }
                return;
            }
            State::Watching => {}
        }
        if let Some(at) = self.find(data) {
            // The line from the payload's start: what the tail holds of it, then the
            // frame's bytes.
            let mut line = Vec::new();
            let tail = self.tail.as_slice();
            if at < tail.len() {
                line.extend_from_slice(&tail[at..]);
            }
            let from = at.saturating_sub(tail.len());
            self.state = match read_on(&mut line, &data[from..]) {
                Some(event) => State::Read(event),
                None => State::Reading(line),
            };
            return;
        }
        self.tail.keep(data);
    }

    /// Whether the stream so far carried an error event (its line may not be whole yet:
    /// [`finish`](Self::finish) reads it).
    pub fn found(&self) -> bool {
        !matches!(self.state, State::Watching)
            || self
                .aborts
                .as_ref()
                .is_some_and(crate::abort::Aborts::found)
    }

    /// The error event seen, once the stream has ended (a line cut by the stream's end
    /// is read as far as it came); `None` when the stream carried none. The watch is
    /// done: it reads nothing more.
    pub fn finish(&mut self) -> Option<ErrorEvent> {
        let abort = self.aborts.as_mut().and_then(crate::abort::Aborts::finish);
        let event = match &self.state {
            State::Watching => return abort,
            State::Reading(line) => ErrorEvent::read(line),
            State::Read(event) => *event,
        };
        self.state = State::Read(event);
        Some(event)
    }

    /// Where, in the tail followed by `data`, the first error event's payload starts.
    fn find(&self, data: &[u8]) -> Option<usize> {
        // The key cut between the last frame and this one: `k` of its bytes at the
        // tail's end (one wholly in the tail was looked at with the frame before).
        let kept = self.tail.len();
        if let Some(v) = self
            .tail
            .cut(KEY, data)
            .find_map(|k| self.payload_start(kept - k, data))
        {
            return Some(v);
        }
        let mut at = 0;
        while let Some(hit) = FINDER.find(&data[at..]) {
            if let Some(v) = self.payload_start(kept + at + hit, data) {
                return Some(v);
            }
            at += hit + 1;
        }
        None
    }

    /// The start (its `{`) of the error event's payload whose [`KEY`] is at `e` (an
    /// index into the tail followed by `data`): the key after one of the [`SHAPES`],
    /// following `data:` at a line's start; `None` when the key is anything else.
    fn payload_start(&self, e: usize, data: &[u8]) -> Option<usize> {
        SHAPES.iter().find_map(|shape| {
            self.shape_start(shape, e, data)
                .filter(|&brace| self.starts_event(brace, data))
        })
    }

    /// Where `shape` starts when its tokens end at `e` (an index into the tail followed
    /// by `data`), blanks allowed before each of them; `None` when they do not, or not
    /// within [`TAIL`] bytes.
    fn shape_start(&self, shape: &[&[u8]], e: usize, data: &[u8]) -> Option<usize> {
        let byte = |i: usize| self.byte(i, data);
        let low = e.saturating_sub(TAIL);
        let mut i = e;
        for token in shape.iter().rev() {
            while i > low && blank(byte(i - 1)) {
                i -= 1;
            }
            if i < low + token.len()
                || (0..token.len()).any(|k| byte(i - token.len() + k) != token[k])
            {
                return None;
            }
            i -= token.len();
        }
        Some(i)
    }

    /// Whether the payload found at `v` (an index into the tail followed by `data`)
    /// follows `data:` and spaces at a line's start.
    fn starts_event(&self, v: usize, data: &[u8]) -> bool {
        let byte = |i: usize| self.byte(i, data);
        let low = v.saturating_sub(TAIL);
        let mut i = v;
        while i > low && blank(byte(i - 1)) {
            i -= 1;
        }
        let field = b"data:";
        if i < low + field.len() {
            return false;
        }
        if (0..field.len()).any(|k| byte(i - field.len() + k) != field[k]) {
            return false;
        }
        let name = i - field.len();
        if name > low {
            return matches!(byte(name - 1), b'\n' | b'\r');
        }
        // Nothing kept before the field name: it starts a line only at the stream's
        // start (the tail then holds every byte seen).
        name == 0 && self.tail.seen() == self.tail.len() as u64
    }

    /// The byte at `i`, an index into the tail followed by `data`.
    fn byte(&self, i: usize, data: &[u8]) -> u8 {
        self.tail.byte(i, data)
    }
}

/// `line` with `more` after it, up to the line's end or [`MAX_ERROR_EVENT`] bytes: the
/// event, once either is reached.
fn read_on(line: &mut Vec<u8>, more: &[u8]) -> Option<ErrorEvent> {
    let room = MAX_ERROR_EVENT - line.len();
    let (more, full) = match memchr::memchr2(b'\n', b'\r', more) {
        Some(end) if end <= room => (&more[..end], true),
        _ if more.len() >= room => (&more[..room], true),
        _ => (more, false),
    };
    line.extend_from_slice(more);
    full.then(|| ErrorEvent::read(line))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The event `stream` carries, fed in frames cut at `cuts`.
    fn watched(stream: &[u8], cuts: &[usize]) -> Option<ErrorEvent> {
        watched_by(ErrorEvents::new(), stream, cuts)
    }

    /// The event `stream` carries, fed to `w` in frames cut at `cuts`.
    fn watched_by(mut w: ErrorEvents, stream: &[u8], cuts: &[usize]) -> Option<ErrorEvent> {
        let mut from = 0;
        for &cut in cuts.iter().chain([&stream.len()]) {
            w.watch(&stream[from..cut]);
            from = cut;
        }
        w.finish()
    }

    const VLLM: &[u8] = b"data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n\
data: {\"error\": {\"object\": \"error\", \"message\": \"Internal server error\", \"type\": \"InternalServerError\", \"param\": null, \"code\": 500}}\n\n\
data: [DONE]\n\n";

    #[test]
    fn an_error_event_is_found_however_the_stream_is_cut() {
        // Every cut, including inside the field name, the payload's start and its code.
        for cut in 0..=VLLM.len() {
            let event = watched(VLLM, &[cut]);
            assert_eq!(event.map(|e| e.status()), Some(Some(500)), "cut at {cut}");
        }
        // A byte per frame.
        let cuts: Vec<usize> = (1..VLLM.len()).collect();
        assert_eq!(watched(VLLM, &cuts).and_then(|e| e.status()), Some(500));
    }

    #[test]
    fn a_stream_without_one_has_none() {
        // The word in text and in a key, escaped in strings, is no event.
        let stream = b"data: {\"choices\":[{\"delta\":{\"content\":\"{\\\"error\\\": 1}\"}}]}\n\n\
data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"function\":{\"arguments\":\"{\\\"error\\\"\"}}]}}]}\n\n\
data: {\"x\": {\"error\": {\"code\": 500}}}\n\n\
data: [DONE]\n\n";
        for cut in 0..=stream.len() {
            assert_eq!(watched(stream, &[cut]), None, "cut at {cut}");
        }
        // Not at a line's start, or not a data field.
        assert_eq!(watched(b"xdata: {\"error\": {}}\n\n", &[]), None);
        assert_eq!(watched(b"event: {\"error\": {}}\n\n", &[]), None);
    }

    #[test]
    fn the_status_it_names_says_whose_fault_it_is() {
        let event = |code: &str| {
            let s = format!("data: {{\"error\": {{\"message\": \"m\", \"code\": {code}}}}}\n\n");
            watched(s.as_bytes(), &[])
        };
        let status = |code: &str| event(code).map(|e| (e.status(), e.is_server_error()));
        assert_eq!(status("400"), Some((Some(400), false)));
        assert_eq!(status("\"422\""), Some((Some(422), false)));
        assert_eq!(status("500"), Some((Some(500), true)));
        assert_eq!(status("503"), Some((Some(503), true)));
        // No status: not the engine's to answer for.
        for code in [
            "null",
            "\"decode_stream_failed\"",
            "7",
            "70000",
            "-1",
            "4.5",
        ] {
            assert_eq!(status(code), Some((None, false)), "{code}");
        }
        // SGLang's spelling, no space, at the stream's start; `\r\n` line ends; and its
        // `/generate`'s code-less error.
        let e = watched(b"data:{\"error\":{\"code\":404}}\r\n\r\n", &[]).unwrap();
        assert_eq!(e.status(), Some(404));
        let e = watched(b"data: {\"error\": {\"message\": \"too long\"}}\n\n", &[]).unwrap();
        assert_eq!((e.status(), e.is_server_error()), (None, false));
        // vLLM's exception name when the code is missing.
        let e = watched(
            b"data: {\"error\": {\"type\": \"InternalServerError\"}}\n\n",
            &[],
        );
        assert_eq!(e.and_then(|e| e.status()), Some(500));
        // The proxy's own (OpenAI's type for a server's failure, its code a name): a
        // decode stream that broke under a proxy in front is the engine side's failure.
        let e = watched(
            b"data: {\"error\": {\"message\": \"decode stream broke\", \"type\": \"server_error\", \"param\": null, \"code\": \"decode_stream_failed\"}}\n\n",
            &[],
        );
        assert_eq!(
            e.map(|e| (e.status(), e.is_server_error())),
            Some((Some(500), true))
        );
        // An event cut by the stream's end, or too long to read: unknown status.
        assert_eq!(
            watched(b"data: {\"error\": {\"code\": 5", &[]).map(|e| e.status()),
            Some(None)
        );
        let long = format!(
            "data: {{\"error\": {{\"message\": \"{}\", \"code\": 500}}}}\n\n",
            "x".repeat(MAX_ERROR_EVENT)
        );
        assert_eq!(
            watched(long.as_bytes(), &[100, 2000]).map(|e| e.status()),
            Some(None)
        );
        // A 5xx whose message holds an exception's long text (16 KiB, its code after
        // it, as vLLM writes them), cut in frames: read, the engine's failure.
        let traced = format!(
            "data: {{\"error\": {{\"message\": \"{}\", \"type\": \"InternalServerError\", \"param\": null, \"code\": 503}}}}\n\n",
            "Traceback line\\n".repeat(1024)
        );
        let cuts: Vec<usize> = (1..traced.len()).step_by(1500).collect();
        let event = watched(traced.as_bytes(), &cuts);
        assert_eq!(
            event.map(|e| (e.status(), e.is_server_error())),
            Some((Some(503), true))
        );
    }

    #[test]
    fn anthropic_and_responses_error_events_are_found_and_read() {
        // vLLM's `/v1/messages` stream: `event: error`, then the Anthropic error body,
        // its type named after the status.
        let messages = |kind: &str| {
            format!(
                "event: message_start\ndata: {{\"type\":\"message_start\",\"message\":{{}}}}\n\n\
event: error\ndata: {{\"type\":\"error\",\"error\":{{\"type\":\"{kind}\",\"message\":\"m\"}}}}\n\n"
            )
        };
        for (kind, status) in [
            ("api_error", Some(500)),
            ("internal_error", Some(500)),
            ("overloaded_error", Some(503)),
            ("invalid_request_error", Some(400)),
            ("rate_limit_error", Some(429)),
            ("something_else", None),
        ] {
            let stream = messages(kind);
            for cut in 0..=stream.len() {
                let e = watched(stream.as_bytes(), &[cut]);
                assert_eq!(e.map(|e| e.status()), Some(status), "{kind} cut at {cut}");
            }
        }
        // Spaced as `json.dumps` writes it; a Responses stream's error event.
        let e = watched(
            b"data: {\"type\": \"error\", \"error\": {\"type\": \"api_error\"}}\n\n",
            &[],
        );
        assert_eq!(e.and_then(|e| e.status()), Some(500));
        let e = watched(
            b"data: {\"type\":\"error\",\"code\":\"server_error\",\"message\":\"m\",\"sequence_number\":3}\n\n",
            &[],
        );
        assert_eq!(e.map(|e| e.status()), Some(None));
        // Other typed events are none.
        let other = b"data: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"{\\\"type\\\":\\\"error\\\"}\"}}\n\n\
data: {\"type\":\"errors\"}\n\n";
        for cut in 0..=other.len() {
            assert_eq!(watched(other, &[cut]), None, "cut at {cut}");
        }
    }

    #[test]
    fn an_error_body_written_as_an_event_is_one() {
        let stream = b"data: {\"object\": \"error\", \"message\": \"m\", \"code\": 503}\n\n";
        for cut in 0..=stream.len() {
            let e = watched(stream, &[cut]);
            assert_eq!(e.and_then(|e| e.status()), Some(503), "cut at {cut}");
        }
        let other = b"data: {\"object\":\"chat.completion.chunk\",\"x\":\"error\"}\n\n";
        assert_eq!(watched(other, &[]), None);
    }

    #[test]
    fn coheres_message_end_with_an_error_is_one() {
        // vLLM's `/cohere/v2/chat` when the chat stream it converts fails: no status
        // named, the engine's failure.
        let stream = b"data: {\"type\":\"message-start\",\"id\":\"chatcmpl-1\",\"delta\":{\"message\":{\"role\":\"assistant\"}}}\n\n\
data: {\"type\": \"message-end\", \"delta\": {\"error\": \"1 validation error\", \"finish_reason\": \"ERROR\"}}\n\n\
data: [DONE]\n\n";
        for cut in 0..=stream.len() {
            let e = watched(stream, &[cut]);
            assert_eq!(e.map(|e| e.status()), Some(Some(500)), "cut at {cut}");
        }
        let cuts: Vec<usize> = (1..stream.len()).collect();
        assert!(
            watched(stream, &cuts).is_some_and(|e| e.is_server_error()),
            "a byte per frame"
        );
        // A served stream's `message-end`, and other events naming an error in a delta.
        let served = b"data: {\"type\":\"message-end\",\"id\":\"c\",\"delta\":{\"finish_reason\":\"COMPLETE\",\"usage\":{}}}\n\n\
data: {\"type\":\"content-delta\",\"delta\":{\"error\":\"x\"}}\n\n";
        for cut in 0..=served.len() {
            assert_eq!(watched(served, &[cut]), None, "cut at {cut}");
        }
    }

    #[test]
    fn a_payload_is_read_as_the_watch_reads_its_event() {
        // Every shape the watch finds, and what it reads of each, the same from a
        // payload framed by its reader.
        let payloads: [&[u8]; 8] = [
            b"{\"error\": {\"message\": \"m\", \"code\": 500}}",
            b"{\"error\":{\"message\":\"too long\"}}",
            b"{\"error\": {\"type\": \"BadRequestError\"}}",
            b"{\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\"}}",
            b"{\"type\": \"error\", \"code\": \"429\"}",
            b"{\"object\":\"error\",\"message\":\"m\",\"code\":404}",
            b"{\"error\": {\"code\": 5",
            b"{\"type\": \"message-end\", \"delta\": {\"error\": \"m\"}}",
        ];
        for payload in payloads {
            let stream = [b"data: ".as_slice(), payload, b"\n\n"].concat();
            let read = ErrorEvent::of_payload(payload);
            assert!(read.is_some(), "{}", String::from_utf8_lossy(payload));
            assert_eq!(read, watched(&stream, &[]));
            // Blanks before the payload are the field's.
            let spaced = [b" \t".as_slice(), payload].concat();
            assert_eq!(ErrorEvent::of_payload(&spaced), read);
        }
        let statuses: Vec<_> = payloads
            .iter()
            .map(|p| ErrorEvent::of_payload(p).and_then(|e| e.status()))
            .collect();
        assert_eq!(
            statuses,
            [
                Some(500),
                None,
                Some(400),
                Some(503),
                Some(429),
                Some(404),
                None,
                Some(500)
            ]
        );
        // What is no error event's payload.
        for payload in [
            b"{\"choices\":[{\"delta\":{\"content\":\"{\\\"error\\\"\"}}]}".as_slice(),
            b"{\"x\": {\"error\": {\"code\": 500}}}",
            b"{\"type\":\"errors\"}",
            b"{\"type\":\"content_block_delta\"}",
            b"[DONE]",
            b"",
        ] {
            assert_eq!(
                ErrorEvent::of_payload(payload),
                None,
                "{}",
                String::from_utf8_lossy(payload)
            );
        }
        // Read whole: a code past the watch's ceiling is read (the caller holds it).
        let long = format!(
            "{{\"error\": {{\"message\": \"{}\", \"code\": 500}}}}",
            "x".repeat(MAX_ERROR_EVENT)
        );
        assert_eq!(
            ErrorEvent::of_payload(long.as_bytes()).map(|e| e.status()),
            Some(Some(500))
        );
    }

    /// SGLang 0.5.23's streamed `/generate` answer of a decode whose KV transfer
    /// failed: one event whose finish reason is an abort naming 500, then `[DONE]`.
    const SGLANG_ABORT: &[u8] = b"data: {\"text\":\"\",\"output_ids\":[],\"meta_info\":{\"id\":\"r\",\"finish_reason\":{\"type\":\"abort\",\"message\":\"Decode transfer failed for request rank=0 bootstrap_room=7\",\"status_code\":500,\"err_type\":null},\"prompt_tokens\":3,\"completion_tokens\":0}}\n\ndata: [DONE]\n\n";

    /// The abort `stream` carries, read by a watch `with_aborts`, fed in frames cut at
    /// `cuts`.
    fn aborted(stream: &[u8], cuts: &[usize]) -> Option<ErrorEvent> {
        watched_by(ErrorEvents::new().with_aborts(), stream, cuts)
    }

    #[test]
    fn an_sglang_abort_is_read_as_an_error_however_the_stream_is_cut() {
        for cut in 0..=SGLANG_ABORT.len() {
            let event = aborted(SGLANG_ABORT, &[cut]);
            assert_eq!(event.map(|e| e.status()), Some(Some(500)), "cut at {cut}");
        }
        let cuts: Vec<usize> = (1..SGLANG_ABORT.len()).collect();
        assert_eq!(
            aborted(SGLANG_ABORT, &cuts).and_then(|e| e.status()),
            Some(500)
        );
        // Only where asked: a watch of another stream reads no abort.
        assert_eq!(watched(SGLANG_ABORT, &[]), None);
        // Framed by the caller.
        let payload = &SGLANG_ABORT[6..SGLANG_ABORT.len() - 22];
        assert_eq!(ErrorEvent::of_payload(payload), None);
        assert_eq!(
            ErrorEvent::of_generate_payload(payload).and_then(|e| e.status()),
            Some(500)
        );
    }

    #[test]
    fn an_sglang_abort_names_its_status_or_none() {
        let event = |reason: &str| {
            format!(
                "data: {{\"text\":\"a\",\"meta_info\":{{\"finish_reason\":{reason},\"e2e_latency\":0.1}}}}\n\n"
            )
        };
        // A request the engine found invalid: its refusal.
        let bad = aborted(
            event(
                r#"{"type":"abort","message":"m","status_code":400,"err_type":"BadRequestError"}"#,
            )
            .as_bytes(),
            &[],
        );
        assert_eq!(
            bad.map(|e| (e.status(), e.is_server_error())),
            Some((Some(400), false))
        );
        // An abort naming no status (a request aborted by its client or an operator).
        let none = aborted(event(r#"{"type":"abort","message":"m"}"#).as_bytes(), &[]);
        assert_eq!(none.map(|e| e.status()), Some(None));
        // Its members in another order (a serializer that sorts them), spaced as
        // `json.dumps` writes them.
        let sorted = aborted(
            event(r#"{"err_type": null, "message": "m", "status_code": 503, "type": "abort"}"#)
                .replace("\"finish_reason\":", "\"finish_reason\" :  ")
                .as_bytes(),
            &[29, 31],
        );
        assert_eq!(sorted.and_then(|e| e.status()), Some(503));
        // A batch: the first element finished, the second aborted.
        let batch = format!(
            "{}{}",
            event(r#"{"type":"stop","matched":2}"#),
            event(r#"{"type":"abort","message":"m","status_code":500}"#)
        );
        for cut in 0..=batch.len() {
            let e = aborted(batch.as_bytes(), &[cut]);
            assert_eq!(e.and_then(|e| e.status()), Some(500), "cut at {cut}");
        }
        // Finished, or its text naming an abort: no error.
        for reason in [
            r#"{"type":"stop","matched":2}"#,
            r#"{"type":"length","length":4}"#,
            "null",
        ] {
            assert_eq!(aborted(event(reason).as_bytes(), &[]), None, "{reason}");
        }
        let quoted = "data: {\"text\":\"\\\"finish_reason\\\":{\\\"type\\\":\\\"abort\\\"\"}\n\n";
        assert_eq!(aborted(quoted.as_bytes(), &[5]), None, "{quoted}");
        // An error event before it is the one read.
        let both = format!(
            "data: {{\"error\": {{\"code\": 503}}}}\n\n{}",
            String::from_utf8_lossy(SGLANG_ABORT)
        );
        assert_eq!(
            aborted(both.as_bytes(), &[]).and_then(|e| e.status()),
            Some(503)
        );
        // A message past the ceiling hides the status written after it.
        let long = event(&format!(
            r#"{{"type":"abort","message":"{}","status_code":500}}"#,
            "x".repeat(MAX_ERROR_EVENT)
        ));
        assert_eq!(
            aborted(long.as_bytes(), &[40]).map(|e| e.status()),
            Some(None)
        );
    }

    #[test]
    fn only_the_first_event_is_read_and_bounded() {
        let stream =
            b"data: {\"error\": {\"code\": 400}}\n\ndata: {\"error\": {\"code\": 500}}\n\n";
        assert_eq!(watched(stream, &[]).and_then(|e| e.status()), Some(400));
        // A line that never ends keeps at most the ceiling.
        let mut w = ErrorEvents::new();
        w.watch(b"data: {\"error\": ");
        for _ in 0..1000 {
            w.watch(&[b'x'; 1024]);
        }
        assert!(matches!(w.state, State::Read(_)), "{:?}", w.state_len());
        assert_eq!(w.finish().map(|e| e.status()), Some(None));
    }

    impl ErrorEvents {
        fn state_len(&self) -> usize {
            match &self.state {
                State::Reading(l) => l.len(),
                _ => 0,
            }
        }
    }
}
