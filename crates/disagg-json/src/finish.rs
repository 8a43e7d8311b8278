//! Whether an OpenAI-style event stream carried a choice's finish reason
//! ([`FinishReasons`]).
//!
//! Every answer of `/v1/completions` (and `/v1/chat/completions`) ends each choice with
//! a chunk whose `finish_reason` is set (`"stop"`, `"length"`, ...); the chunks before
//! it carry `null`. A stream that ends without one did not answer. vLLM 0.33 ends so a
//! streamed completions request whose KV load failed (`kv_load_failure_policy="fail"`):
//! its stream generator skips the output that has no text before it reads the output's
//! `error` finish, and the stream ends normally, with no chunk of the answer (only the
//! usage chunk, when asked for) and `data: [DONE]`
//! (`vllm/entrypoints/openai/completion/serving.py`, `completion_stream_generator`).

use std::sync::LazyLock;

use memchr::memmem::Finder;

use crate::tail::Tail;

/// The key searched for. A JSON string cannot hold it: its closing quote would be
/// escaped.
const KEY: &[u8] = b"\"finish_reason\"";

/// The searcher for [`KEY`], built once.
static FINDER: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(KEY));

/// Bytes kept from one frame to the next: enough for a key cut between two frames.
const TAIL: usize = 16;

/// Watches the bytes of an OpenAI-style event stream, frame by frame, for a choice's
/// finish reason set: to a string, or to an object as SGLang's native stream sets it
/// (not `null`).
///
/// One `memchr` search per frame for `"finish_reason"` (a key cut between two frames is
/// found too), then the bytes up to its value's first byte; the first value set ends
/// the watch. Nothing is allocated.
///
/// ```
/// use disagg_json::FinishReasons;
///
/// let mut watch = FinishReasons::new();
/// watch.watch(br#"data: {"choices":[{"text":"a","finish_reason":null}]}"#);
/// watch.watch(b"\n\ndata: {\"choices\":[{\"text\":\"\",\"finish_re");
/// assert!(!watch.finished());
/// watch.watch(br#"ason": "length"}]}"#);
/// assert!(watch.finished());
/// ```
pub struct FinishReasons {
    values: ReasonValues,
    finished: bool,
}

impl Default for FinishReasons {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for FinishReasons {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FinishReasons")
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl FinishReasons {
    /// A watch over a stream not begun.
    pub const fn new() -> Self {
        FinishReasons {
            values: ReasonValues::new(),
            finished: false,
        }
    }

    /// Whether `payload` (one event's, or any bytes of JSON) sets a finish reason: the
    /// rule the watch applies to a stream, applied to bytes the caller framed.
    ///
    /// ```
    /// use disagg_json::FinishReasons;
    ///
    /// assert!(FinishReasons::set_in(br#"{"meta_info":{"finish_reason":{"type":"stop"}}}"#));
    /// assert!(!FinishReasons::set_in(br#"{"choices":[{"finish_reason":null}]}"#));
    /// ```
    pub fn set_in(payload: &[u8]) -> bool {
        let mut watch = FinishReasons::new();
        watch.watch(payload);
        watch.finished()
    }

    /// Whether a finish reason was set in the stream so far.
    pub fn finished(&self) -> bool {
        self.finished
    }

    /// The stream's next bytes.
    pub fn watch(&mut self, data: &[u8]) {
        if self.finished {
            return;
        }
        let mut at = 0;
        while let Some(v) = self.values.next(data, at) {
            // A string, or SGLang's object; not `null`.
            if matches!(data[v], b'"' | b'{') {
                self.finished = true;
                return;
            }
            at = v + 1;
        }
        self.values.end_frame(data);
    }
}

/// Finds, frame by frame, the first byte of each value of a `"finish_reason"` key in a
/// stream: the one scan of [`FinishReasons`] and of SGLang's abort watch
/// ([`ErrorEvents::with_aborts`](crate::ErrorEvents::with_aborts)).
///
/// One `memchr` search per frame for `"finish_reason"` (a key cut between two frames is
/// found by comparing the frame's first bytes with the last one's), and where it is
/// found, the bytes after it up to its value's first byte (`:` and JSON's whitespace
/// between, in this frame or the next). Nothing is allocated.
pub(crate) struct ReasonValues {
    tail: Tail<TAIL>,
    after: After,
}

/// Where the scan stands after a key it found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum After {
    /// Not after a key.
    Nothing,
    /// After the key: its `:` comes next.
    Key,
    /// After the `:`: the value's first byte comes next.
    Colon,
}

impl ReasonValues {
    /// A scan of a stream not begun.
    pub(crate) const fn new() -> Self {
        ReasonValues {
            tail: Tail::new(),
            after: After::Nothing,
        }
    }

    /// Where, in `data` from `at`, the next finish reason's value starts; `None` once
    /// `data` is used up (a key whose value is not reached yet is carried to the next
    /// frame). `at` 0 is the frame's start, where a key cut between the last frame and
    /// this one is looked for. [`end_frame`](Self::end_frame) follows the frame's last
    /// call.
    pub(crate) fn next(&mut self, data: &[u8], mut at: usize) -> Option<usize> {
        if at == 0
            && self.after == After::Nothing
            && let Some(k) = self.tail.cut(KEY, data).next()
        {
            self.after = After::Key;
            at = KEY.len() - k;
        }
        loop {
            if self.after == After::Nothing {
                let hit = FINDER.find(&data[at..])?;
                self.after = After::Key;
                at += hit + KEY.len();
            }
            // After a key: JSON's whitespace, its `:`, whitespace, the value.
            while let Some(&b) = data.get(at) {
                match (self.after, b) {
                    (_, b' ' | b'\t' | b'\n' | b'\r') => {}
                    (After::Key, b':') => self.after = After::Colon,
                    (After::Colon, _) => {
                        self.after = After::Nothing;
                        return Some(at);
                    }
                    // No key (not followed by `:`): looked past.
                    _ => {
                        self.after = After::Nothing;
                        break;
                    }
                }
                at += 1;
            }
            if self.after != After::Nothing {
                return None;
            }
        }
    }

    /// The frame `data` was scanned.
    pub(crate) fn end_frame(&mut self, data: &[u8]) {
        self.tail.keep(data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `stream`, fed in frames cut at `cuts`, carried a finish reason.
    fn finished(stream: &[u8], cuts: &[usize]) -> bool {
        let mut w = FinishReasons::new();
        let mut from = 0;
        for &cut in cuts.iter().chain([&stream.len()]) {
            w.watch(&stream[from..cut]);
            from = cut;
        }
        w.finished()
    }

    /// vLLM's completions stream: chunks with `null`, the last one's set, usage, done.
    const SERVED: &[u8] = b"data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"a\",\"logprobs\":null,\"finish_reason\":null,\"stop_reason\":null}]}\n\n\
data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"b\",\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null}]}\n\n\
data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[],\"usage\":{\"prompt_tokens\":3}}\n\n\
data: [DONE]\n\n";

    #[test]
    fn a_finish_reason_is_found_however_the_stream_is_cut() {
        for cut in 0..=SERVED.len() {
            assert!(finished(SERVED, &[cut]), "cut at {cut}");
        }
        let cuts: Vec<usize> = (1..SERVED.len()).collect();
        assert!(finished(SERVED, &cuts), "a byte per frame");
        // Spaced as `json.dumps` writes it.
        assert!(finished(
            b"data: {\"finish_reason\" :  \"stop\"}\n\n",
            &[17, 19]
        ));
    }

    #[test]
    fn a_stream_with_none_set_did_not_finish() {
        // vLLM's completions stream whose KV load failed: the usage chunk and `[DONE]`.
        let failed = b"data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":0}}\n\ndata: [DONE]\n\n";
        // Chunks whose reason is `null`; the key's name in text or as a value.
        let unfinished = b"data: {\"choices\":[{\"text\":\"\\\"finish_reason\\\": \\\"stop\\\"\",\"finish_reason\":null}]}\n\n\
data: {\"choices\":[{\"text\":\"x\",\"finish_reason\" : null}],\"note\":\"finish_reason\"}\n\n\
data: {\"x\":[\"finish_reason\",\"stop\"]}\n\ndata: [DONE]\n\n";
        for stream in [&failed[..], &unfinished[..], b"data: [DONE]\n\n", b""] {
            for cut in 0..=stream.len() {
                assert!(!finished(stream, &[cut]), "cut at {cut}");
            }
            let cuts: Vec<usize> = (1..stream.len()).collect();
            assert!(!finished(stream, &cuts), "a byte per frame");
        }
    }
}
