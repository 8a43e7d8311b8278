//! An engine's in-band error event, spotted in an event stream as it goes by
//! ([`ErrorEvents`]).
//!
//! An engine that has sent its `200` head for a streamed answer can no longer answer an
//! error status: vLLM and SGLang then write one server-sent event whose data is
//! OpenAI's error shape, `data: {"error": {"message": ..., "type": ..., "code": N}}`,
//! with the HTTP status the error would have had as its `code` (vLLM's
//! `create_streaming_error_response` in `vllm/entrypoints/openai/engine/serving.py`,
//! SGLang's in `sglang/srt/entrypoints/openai/serving_base.py`). vLLM 0.33 streams one
//! so for a chat whose KV load failed. The bytes pass through untouched; the watch
//! only tells the relay's caller that the answer carried an error, so that a stream that
//! ends in one is not counted as served.

use memchr::memmem::Finder;

/// How an error event's payload starts, as both engines write it (`json.dumps` of a
/// dict whose first key is `error`). A JSON string cannot hold it: its quotes would
/// be escaped.
const NEEDLE: &[u8] = b"{\"error\"";

/// Bytes of the stream kept from one frame to the next: enough to see a needle cut
/// between two frames and the `data:` field name before it.
const TAIL: usize = 32;

/// Most bytes of an error event's line read to learn its code; an event longer than
/// that is an error of unknown code.
pub const MAX_ERROR_EVENT: usize = 4096;

/// An error event an engine sent in its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorEvent {
    status: Option<u16>,
}

impl ErrorEvent {
    /// The HTTP status the event's `code` names, when it names one (a number from 100
    /// to 599, or such a number in a string).
    pub fn status(&self) -> Option<u16> {
        self.status
    }

    /// Whether the error is the request's own fault (a 4xx `code`), not the engine's: an
    /// event without a readable status is the engine's.
    pub fn is_client_error(&self) -> bool {
        self.status.is_some_and(|s| (400..500).contains(&s))
    }

    /// The event whose data line is `line` (from its payload's `{` on, at most
    /// [`MAX_ERROR_EVENT`] bytes).
    fn read(line: &[u8]) -> Self {
        let code = serde_json::from_slice::<serde_json::Value>(line.trim_ascii())
            .ok()
            .and_then(|v| v.get("error")?.get("code").cloned());
        let status = match code {
            Some(serde_json::Value::Number(n)) => n.as_u64(),
            Some(serde_json::Value::String(s)) => s.trim().parse().ok(),
            _ => None,
        }
        .and_then(|n| u16::try_from(n).ok())
        .filter(|s| (100..600).contains(s));
        ErrorEvent { status }
    }
}

/// Watches the bytes of an event stream, frame by frame, for the first error event an
/// engine wrote in it.
///
/// Each byte is looked at once (a `memchr` search for the payload's start, `{"error"`,
/// which also finds one cut between two frames); only an event found is copied, up to
/// its line's end or [`MAX_ERROR_EVENT`] bytes, and read as JSON for its `code`. Its
/// payload must follow a `data:` field name (spaces between) at a line's start.
///
/// ```
/// use disagg_json::ErrorEvents;
///
/// let mut watch = ErrorEvents::new();
/// watch.watch(b"data: {\"choices\":[]}\n\ndata: {\"err");
/// watch.watch(b"or\": {\"message\": \"Internal server error\", \"code\": 500}}\n\n");
/// let event = watch.finish().expect("an error event");
/// assert_eq!(event.status(), Some(500));
/// assert!(!event.is_client_error());
/// ```
pub struct ErrorEvents {
    finder: Finder<'static>,
    /// The last bytes seen, the oldest first.
    tail: [u8; TAIL],
    tail_len: usize,
    /// Bytes seen before the current frame.
    seen: u64,
    state: State,
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
            .field("seen", &self.seen)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl ErrorEvents {
    /// A watch over a stream not begun.
    pub fn new() -> Self {
        ErrorEvents {
            finder: Finder::new(NEEDLE),
            tail: [0; TAIL],
            tail_len: 0,
            seen: 0,
            state: State::Watching,
        }
    }

    /// Whether an error event has been seen (its line may not be whole yet).
    pub fn seen(&self) -> bool {
        !matches!(self.state, State::Watching)
    }

    /// The stream's next bytes.
    pub fn watch(&mut self, data: &[u8]) {
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
            if at < self.tail_len {
                line.extend_from_slice(&self.tail[at..self.tail_len]);
            }
            let from = at.saturating_sub(self.tail_len);
            self.state = match read_on(&mut line, &data[from..]) {
                Some(event) => State::Read(event),
                None => State::Reading(line),
            };
            return;
        }
        self.keep(data);
    }

    /// The error event seen, once the stream has ended (a line cut by the stream's end
    /// is read as far as it came); `None` when the stream carried none.
    pub fn finish(&mut self) -> Option<ErrorEvent> {
        match std::mem::replace(&mut self.state, State::Watching) {
            State::Watching => None,
            State::Reading(line) => Some(ErrorEvent::read(&line)),
            State::Read(event) => Some(event),
        }
    }

    /// Where, in the tail followed by `data`, the first error event's payload starts.
    fn find(&self, data: &[u8]) -> Option<usize> {
        // A payload's start cut between the last frame and this one.
        let mut window = [0u8; TAIL + NEEDLE.len()];
        let head = data.len().min(NEEDLE.len() - 1);
        window[..self.tail_len].copy_from_slice(&self.tail[..self.tail_len]);
        window[self.tail_len..self.tail_len + head].copy_from_slice(&data[..head]);
        let window = &window[..self.tail_len + head];
        let first = self.tail_len.saturating_sub(NEEDLE.len() - 1);
        let mut at = first;
        while let Some(hit) = self.finder.find(&window[at..]) {
            let v = at + hit;
            if self.starts_event(v, data) {
                return Some(v);
            }
            at = v + 1;
        }
        // One in this frame.
        let mut at = 0;
        while let Some(hit) = self.finder.find(&data[at..]) {
            let v = self.tail_len + at + hit;
            if self.starts_event(v, data) {
                return Some(v);
            }
            at += hit + 1;
        }
        None
    }

    /// Whether the payload found at `v` (an index into the tail followed by `data`)
    /// follows `data:` and spaces at a line's start.
    fn starts_event(&self, v: usize, data: &[u8]) -> bool {
        let byte = |i: usize| {
            if i < self.tail_len {
                self.tail[i]
            } else {
                data[i - self.tail_len]
            }
        };
        let low = v.saturating_sub(TAIL);
        let mut i = v;
        while i > low && matches!(byte(i - 1), b' ' | b'\t') {
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
        name == 0 && self.seen == self.tail_len as u64
    }

    /// Keep the last bytes of the tail followed by `data`.
    fn keep(&mut self, data: &[u8]) {
        self.seen += data.len() as u64;
        if data.len() >= TAIL {
            self.tail.copy_from_slice(&data[data.len() - TAIL..]);
            self.tail_len = TAIL;
            return;
        }
        let keep = (TAIL - data.len()).min(self.tail_len);
        self.tail
            .copy_within(self.tail_len - keep..self.tail_len, 0);
        self.tail[keep..keep + data.len()].copy_from_slice(data);
        self.tail_len = keep + data.len();
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
        let mut w = ErrorEvents::new();
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
    fn the_code_says_whose_fault_it_is() {
        let event = |code: &str| {
            let s = format!("data: {{\"error\": {{\"message\": \"m\", \"code\": {code}}}}}\n\n");
            watched(s.as_bytes(), &[])
        };
        assert!(event("400").unwrap().is_client_error());
        assert!(event("\"422\"").unwrap().is_client_error());
        assert!(!event("500").unwrap().is_client_error());
        // No status: the engine's.
        for code in [
            "null",
            "\"decode_stream_failed\"",
            "7",
            "70000",
            "-1",
            "4.5",
        ] {
            let e = event(code).unwrap();
            assert_eq!(e.status(), None, "{code}");
            assert!(!e.is_client_error());
        }
        // SGLang's spelling, no space, at the stream's start; `\r\n` line ends.
        let e = watched(b"data:{\"error\":{\"code\":404}}\r\n\r\n", &[]).unwrap();
        assert_eq!(e.status(), Some(404));
        // An event cut by the stream's end, or too long to read: unknown code.
        assert_eq!(
            watched(b"data: {\"error\": {\"code\": 4", &[]).map(|e| e.status()),
            Some(None)
        );
        let long = format!(
            "data: {{\"error\": {{\"message\": \"{}\", \"code\": 400}}}}\n\n",
            "x".repeat(MAX_ERROR_EVENT)
        );
        assert_eq!(
            watched(long.as_bytes(), &[100, 2000]).map(|e| e.status()),
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
        assert!(w.seen());
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
