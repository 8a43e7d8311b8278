//! Whether a Responses API event stream began its output ([`ResponsesOutput`]).
//!
//! vLLM's `/v1/responses` stream (`vllm/entrypoints/openai/responses/serving.py`,
//! `responses_stream_generator`) opens with `response.created` and
//! `response.in_progress` before the engine has produced anything, then adds each output
//! item (`response.output_item.added`: a message, a reasoning item, a function call)
//! before its content. Each event goes out as `event: <type>` then its `data:` line. A
//! streamed request whose KV load failed is cut off after the two opening events (the
//! generator's output fails validation and the server closes the connection): a stream
//! that broke before its first output item told nothing of its answer.

use std::sync::LazyLock;

use memchr::memmem::Finder;

use crate::tail::Tail;

/// The line that adds an output item, from the newline that ends the event before it.
/// An event's `data:` line is JSON, which holds no raw newline: only an `event:` field at
/// a line's start matches.
const LINE: &[u8] = b"\nevent: response.output_item.added";

/// The searcher for [`LINE`], built once.
static FINDER: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(LINE));

/// Bytes kept from one frame to the next: enough for a line cut between two frames.
const TAIL: usize = 40;

/// Watches the bytes of a Responses API event stream, frame by frame, for its first
/// output item (an `event: response.output_item.added` line).
///
/// One `memchr` search per frame (a line cut between two frames is found by comparing
/// the frame's first bytes with the last one's); nothing is allocated. The first one
/// found ends the watch.
///
/// ```
/// use disagg_json::ResponsesOutput;
///
/// let mut watch = ResponsesOutput::new();
/// watch.watch(b"event: response.created\ndata: {\"type\":\"response.created\"}\n\n");
/// watch.watch(b"event: response.in_progress\ndata: {}\n\nevent: response.outp");
/// assert!(!watch.began());
/// watch.watch(b"ut_item.added\ndata: {}\n\n");
/// assert!(watch.began());
/// ```
pub struct ResponsesOutput {
    tail: Tail<TAIL>,
    began: bool,
}

impl Default for ResponsesOutput {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for ResponsesOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponsesOutput")
            .field("began", &self.began)
            .finish_non_exhaustive()
    }
}

impl ResponsesOutput {
    /// A watch over a stream not begun.
    pub const fn new() -> Self {
        ResponsesOutput {
            tail: Tail::new(),
            began: false,
        }
    }

    /// Whether the stream so far added an output item.
    pub fn began(&self) -> bool {
        self.began
    }

    /// The stream's next bytes.
    pub fn watch(&mut self, data: &[u8]) {
        if self.began {
            return;
        }
        if self.tail.seen() == 0 && !data.is_empty() {
            // The stream's start is a line's start: as if a newline came before it.
            self.tail.keep(b"\n");
        }
        self.began = self.tail.cut(LINE, data).next().is_some() || FINDER.find(data).is_some();
        self.tail.keep(data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `stream`, fed in frames cut at `cuts`, began its output.
    fn began(stream: &[u8], cuts: &[usize]) -> bool {
        let mut w = ResponsesOutput::new();
        let mut from = 0;
        for &cut in cuts.iter().chain([&stream.len()]) {
            w.watch(&stream[from..cut]);
            from = cut;
        }
        w.began()
    }

    /// The opening events of vLLM's Responses stream, the response echoing what the
    /// client sent (which may name any event in its text).
    const OPENING: &[u8] = b"event: response.created\n\
data: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"instructions\":\"say \\\"event: response.output_item.added\\\"\\nevent: response.output_item.added\",\"output\":[]}}\n\n\
event: response.in_progress\n\
data: {\"type\":\"response.in_progress\",\"sequence_number\":1,\"response\":{\"output\":[]}}\n\n";

    const ITEM: &[u8] = b"event: response.output_item.added\n\
data: {\"type\":\"response.output_item.added\",\"sequence_number\":2,\"output_index\":0,\"item\":{\"type\":\"message\"}}\n\n";

    #[test]
    fn the_opening_events_alone_began_nothing_however_cut() {
        for cut in 0..=OPENING.len() {
            assert!(!began(OPENING, &[cut]), "cut at {cut}");
        }
        let cuts: Vec<usize> = (1..OPENING.len()).collect();
        assert!(!began(OPENING, &cuts), "a byte per frame");
    }

    #[test]
    fn an_output_item_is_found_however_the_stream_is_cut() {
        let stream = [OPENING, ITEM].concat();
        for cut in 0..=stream.len() {
            assert!(began(&stream, &[cut]), "cut at {cut}");
        }
        let cuts: Vec<usize> = (1..stream.len()).collect();
        assert!(began(&stream, &cuts), "a byte per frame");
        // At the stream's start too.
        assert!(began(ITEM, &[3]));
    }
}
