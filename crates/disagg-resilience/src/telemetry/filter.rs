//! What of an engine's `/metrics` text reaches the parser.
//!
//! `prom_text_format_parser` first turns the whole text into a vector of its lines
//! (about 100 bytes a line, plus its strings), so the 4 MiB an engine may answer, as
//! one-byte lines, would cost some 500 MiB at every scrape. [`filter`] reads the text
//! once, line by line, allocating nothing per line, and keeps for the parser only the
//! lines of the metrics `names.rs` reads ([`READ`]): their samples (with the `_bucket`,
//! `_sum` and `_count` lines a histogram or summary of that name writes) and their
//! `# HELP` and `# TYPE` lines, at most [`MAX_KEPT_LINES`] of them and
//! [`MAX_KEPT_BYTES`], copied into one string allocated once at the text's size or
//! at that ceiling, whichever is smaller.
//!
//! The parser also holds a sample's labels as a vector of strings: some 20 to 30 times
//! the bytes of a line of one-letter labels. So no sample line longer than
//! [`MAX_SAMPLE_LINE`] reaches it, read or not, and the kept text is bounded in bytes;
//! a body over either ceiling is refused, not read in part.
//!
//! The answer is the one the parser gives on the whole text:
//!
//! - The lines dropped are still checked to be the text format, by the parser, at most
//!   [`CHECK_CHUNK`] bytes of them at a time (blank lines need no check): a body that is
//!   not the format still fails the scrape.
//! - The parser groups consecutive lines of one name into one metric, and a `HELP`,
//!   `TYPE` or sample line of another name ends it. Where dropped lines did that before
//!   a kept line, one sample line of a name nothing reads ([`BREAK`]) stands in for
//!   them, so the kept lines group as they did.
//! - The engine family is that of the first sample line, read or not ([`Kept::family`]).
//! - The parser finds no metric in a text without any sample line: an error if the text
//!   is empty or has a `HELP` or `TYPE` line (a metric without samples), else nothing
//!   ([`Kept::samples`], [`Kept::descriptor`]).

use prom_text_format_parser::{ScrapeParseError, Type, parse_scrape};

use super::names::READ;
use super::{EngineFamily, ScrapeError};

/// The most lines kept for the parser ([`BREAK`]s included): a vLLM engine writes
/// about ten series of the names read per data-parallel rank, so an engine of
/// `--max-dp-ranks` (1,024) ranks writes some 10,000 of them.
pub(super) const MAX_KEPT_LINES: usize = 16_384;

/// The most bytes kept for the parser: an engine writes some 130 bytes a series, so
/// 1,024 ranks some 1.3 MiB. (The parser holds a line's labels in up to 30 times its
/// bytes: this bounds a scrape's parse near 60 MiB.)
pub(super) const MAX_KEPT_BYTES: usize = 2 << 20;

/// The longest sample line, newline included, handed to the parser, read or not: an
/// engine writes a few hundred bytes, an info metric's labels a few kilobytes.
pub(super) const MAX_SAMPLE_LINE: usize = 64 << 10;

// The ceilings' errors name them.
const _: () = assert!(MAX_KEPT_LINES == 16_384 && MAX_KEPT_BYTES == 2 << 20);
const _: () = assert!(MAX_SAMPLE_LINE == 64 << 10);

/// The most bytes of dropped lines the parser checks at once (its lines' vector for
/// them is then at most about 100 times this, some 1.6 MB).
const CHECK_CHUNK: usize = 16 << 10;

/// A sample of a name nothing reads, put where dropped lines ended a metric. No valid
/// `HELP`, `TYPE` or sample line is shorter (a sample needs a name, a separator and a
/// value: `a 1`, `a+1`), so the kept text never outgrows the text.
pub(super) const BREAK: &str = "_ 0\n";

/// The suffixes of a histogram's or summary's sample lines, kept with a read name.
const SUFFIXES: [&str; 3] = ["_bucket", "_sum", "_count"];

/// The lines kept for the parser, and what the parser would have found elsewhere.
#[derive(Debug)]
pub(super) struct Kept<'a> {
    /// The kept lines, each as written, with [`BREAK`]s between them.
    pub(super) text: String,
    /// The family of the first sample line whose name is a family's.
    pub(super) family: Option<EngineFamily>,
    /// Whether the text has any sample line (then the parser finds a metric).
    pub(super) samples: bool,
    /// The first `HELP` or `TYPE` line, with its index (from 0), whatever its name.
    pub(super) descriptor: Option<(usize, &'a str)>,
}

/// What a line is, as the parser reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind<'a> {
    /// Spaces or tabs only, ended by a newline.
    Blank,
    /// A line beginning with a name: a sample of that metric (or not the format).
    Sample(&'a str),
    /// A `HELP` or `TYPE` line of that metric.
    Descriptor(&'a str),
    /// A comment, or not the format.
    Other,
}

/// The lines of `text` the telemetry reads, checked as described in the module
/// documentation.
///
/// # Errors
///
/// [`ScrapeError::Parse`] when a dropped line is not the text format,
/// [`ScrapeError::Ceiling`] beyond [`MAX_KEPT_LINES`], [`MAX_KEPT_BYTES`] or
/// [`MAX_SAMPLE_LINE`].
pub(super) fn filter(text: &str) -> Result<Kept<'_>, ScrapeError> {
    let mut kept = Kept {
        // Never more than either: the kept text is no longer than the text (see
        // [`BREAK`]), and a line that would take it past the ceiling is refused before
        // it is copied.
        text: String::with_capacity(text.len().min(MAX_KEPT_BYTES)),
        family: None,
        samples: false,
        descriptor: None,
    };
    let mut lines = 0usize;
    // A dropped line ended the metric the parser was in since the last kept line.
    let mut broken = false;
    let mut dropped = Dropped::at(0, 0);
    let (mut start, mut index) = (0, 0);
    while start < text.len() {
        let (end, kind) = line(text, start);
        let here = &text[start..end];
        let keep = match kind {
            Kind::Sample(_) if here.len() > MAX_SAMPLE_LINE => {
                return Err(ScrapeError::Ceiling("a sample line over 64 KiB"));
            }
            Kind::Sample(name) => {
                kept.samples = true;
                if kept.family.is_none() {
                    kept.family = family(name);
                }
                reads_sample(name)
            }
            Kind::Descriptor(name) => {
                kept.descriptor.get_or_insert((index, here));
                READ.contains(&name)
            }
            Kind::Blank | Kind::Other => false,
        };
        if keep {
            // Every dropped line is checked before a BREAK stands in for one.
            dropped.check(text)?;
            lines += 1 + usize::from(broken);
            if lines > MAX_KEPT_LINES {
                return Err(ScrapeError::Ceiling(
                    "more than 16,384 lines of the metrics read",
                ));
            }
            if kept.text.len() + BREAK.len() + here.len() > MAX_KEPT_BYTES {
                return Err(ScrapeError::Ceiling("more than 2 MiB of the metrics read"));
            }
            if broken {
                kept.text.push_str(BREAK);
            }
            kept.text.push_str(here);
            broken = false;
            dropped = Dropped::at(end, index + 1);
        } else {
            // A line shorter than BREAK is not the format: its check fails the scrape.
            broken |=
                matches!(kind, Kind::Sample(_) | Kind::Descriptor(_)) && here.len() >= BREAK.len();
            dropped.end = end;
            dropped.unchecked |= kind != Kind::Blank;
            if dropped.end - dropped.start >= CHECK_CHUNK {
                dropped.check(text)?;
                dropped = Dropped::at(end, index + 1);
            }
        }
        start = end;
        index += 1;
    }
    dropped.check(text)?;
    debug_assert!(kept.text.len() <= text.len());
    Ok(kept)
}

/// Consecutive dropped lines not checked yet.
struct Dropped {
    start: usize,
    end: usize,
    /// The index of the first.
    index: usize,
    /// Whether one is not blank (blank lines are the format).
    unchecked: bool,
}

impl Dropped {
    fn at(start: usize, index: usize) -> Self {
        Dropped {
            start,
            end: start,
            index,
            unchecked: false,
        }
    }

    /// Has the parser read the lines, failing if they are not the text format (a
    /// metric they leave incomplete is not a failure: the lines around them finish it).
    fn check(&mut self, text: &str) -> Result<(), ScrapeError> {
        if !self.unchecked {
            return Ok(());
        }
        self.unchecked = false;
        match parse_scrape(&text[self.start..self.end]).1 {
            Some(ScrapeParseError::Parse(m)) => Err(super::parse_error(format!(
                "in the lines from {}: {m}",
                self.index + 1
            ))),
            _ => Ok(()),
        }
    }
}

/// The line at `start`: where it ends (after its newline, or at the end of the text)
/// and what it is.
///
/// Lines end at a newline, but for one inside a quoted label value: the parser reads
/// a sample's labels up to their closing brace, newlines and all.
fn line(text: &str, start: usize) -> (usize, Kind<'_>) {
    let b = text.as_bytes();
    if b.get(start).copied().is_some_and(name_start) {
        let name_end = name_end(b, start);
        let mut i = skip_space(b, name_end);
        if b.get(i) == Some(&b'{') {
            i = labels_end(b, i + 1);
        }
        return (line_end(b, i), Kind::Sample(&text[start..name_end]));
    }
    let end = line_end(b, start);
    let kind = match text[start..end].strip_suffix('\n') {
        Some(content) if content.bytes().all(|c| c == b' ' || c == b'\t') => Kind::Blank,
        Some(content) => descriptor(content).map_or(Kind::Other, Kind::Descriptor),
        None => descriptor(&text[start..end]).map_or(Kind::Other, Kind::Descriptor),
    };
    (end, kind)
}

/// The metric a `HELP` or `TYPE` line (without its newline) is about, as the parser
/// reads one: `#`, `HELP` or `TYPE`, a name and a non-empty rest (for `TYPE`, a type),
/// spaces and tabs allowed between them; else `None` (a comment, or not the format).
fn descriptor(line: &str) -> Option<&str> {
    let rest = trim_space(trim_space(line).strip_prefix('#')?);
    let (help, rest) = match rest.strip_prefix("HELP") {
        Some(rest) => (true, rest),
        None => (false, rest.strip_prefix("TYPE")?),
    };
    let rest = trim_space(rest);
    let b = rest.as_bytes();
    if !b.first().copied().is_some_and(name_start) {
        return None;
    }
    let (name, after) = rest.split_at(name_end(b, 0));
    let after = trim_space(after);
    let described = !after.is_empty() && (help || after.parse::<Type>().is_ok());
    described.then_some(name)
}

/// Whether a sample line of `name` belongs to a metric read.
fn reads_sample(name: &str) -> bool {
    READ.contains(&name)
        || SUFFIXES.iter().any(|s| {
            name.strip_suffix(s)
                .is_some_and(|base| READ.contains(&base))
        })
}

fn family(name: &str) -> Option<EngineFamily> {
    if name.starts_with("vllm:") {
        Some(EngineFamily::Vllm)
    } else if name.starts_with("sglang:") {
        Some(EngineFamily::Sglang)
    } else {
        None
    }
}

fn name_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || c == b'_' || c == b':'
}

/// The end of the name beginning at `i`.
fn name_end(b: &[u8], i: usize) -> usize {
    let len = b[i..]
        .iter()
        .position(|&c| !(name_start(c) || c.is_ascii_digit()))
        .unwrap_or(b.len() - i);
    i + len
}

fn skip_space(b: &[u8], i: usize) -> usize {
    i + b[i..]
        .iter()
        .position(|&c| c != b' ' && c != b'\t')
        .unwrap_or(b.len() - i)
}

fn trim_space(s: &str) -> &str {
    s.trim_start_matches([' ', '\t'])
}

/// After the `}` closing the labels begun before `i`, skipping quoted values (and
/// their escapes); at a newline outside quotes (not the format: the line ends there),
/// or at the end.
fn labels_end(b: &[u8], mut i: usize) -> usize {
    let mut quoted = false;
    while let Some(&c) = b.get(i) {
        match (quoted, c) {
            (true, b'\\') => i += 1,
            (true, b'"') => quoted = false,
            (false, b'"') => quoted = true,
            (false, b'}') => return i + 1,
            (false, b'\n') => return i,
            _ => {}
        }
        i += 1;
    }
    b.len()
}

/// After the next newline from `i`, or the end.
fn line_end(b: &[u8], i: usize) -> usize {
    b[i..]
        .iter()
        .position(|&c| c == b'\n')
        .map_or(b.len(), |p| i + p + 1)
}
