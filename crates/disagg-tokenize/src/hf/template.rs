//! Chat templates, rendered as transformers renders them.
//!
//! transformers 5 (`transformers/utils/chat_template_utils.py`,
//! `_compile_jinja_template`) renders a model's template in a sandboxed Jinja2
//! environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension,
//! no autoescaping, a `tojson` filter that is Python's `json.dumps` (no HTML escaping,
//! `ensure_ascii=False`, with `indent`, `separators` and `sort_keys`), and the globals
//! `raise_exception(message)` and `strftime_now(format)`. This module sets up
//! minijinja the same way: Python's string and dict methods (`.strip()`,
//! `.startswith()`, `.items()`, `.get()`) come from `minijinja-contrib`'s pycompat, and
//! maps keep their keys in the order the client sent them, as Python's dicts do.

use std::cell::Cell;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::io;
use std::sync::Arc;

use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Value, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind};
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};

/// A set of compiled chat templates, by name (`default`, `tool_use`, ...).
#[derive(Debug, Clone)]
pub(crate) struct Templates {
    env: Environment<'static>,
    /// Name, whether the template names the `developer` role, whether it iterates
    /// over message content (OpenAI content format).
    entries: Vec<Entry>,
}

#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) name: String,
    pub(crate) developer_role: bool,
    pub(crate) iterates_content: bool,
}

impl Templates {
    /// Compile `templates` (name, source).
    pub(crate) fn new(templates: Vec<(String, String)>) -> Result<Templates, (String, Error)> {
        let mut env = Environment::new();
        let mut syntax = minijinja::syntax::SyntaxConfig::builder();
        // jinja2's default too: a trailing newline of the template is dropped.
        syntax
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false);
        env.set_syntax(syntax.build().map_err(|e| (String::new(), e))?);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let mut entries = Vec::with_capacity(templates.len());
        for (name, source) in templates {
            entries.push(Entry {
                name: name.clone(),
                // vLLM's test (`_detect_developer_role_support`, vllm/renderers/hf.py).
                developer_role: source.contains("\"developer\"") || source.contains("'developer'"),
                iterates_content: iterates_content(&source),
            });
            env.add_template_owned(name.clone(), source)
                .map_err(|e| (name, e))?;
        }
        Ok(Templates { env, entries })
    }

    /// The template a request uses: transformers' `get_chat_template` picks `tool_use`
    /// when the request has tools and the model has one, else `default`.
    pub(crate) fn select(&self, with_tools: bool) -> Option<&Entry> {
        let named = |n: &str| self.entries.iter().find(|e| e.name == n);
        if with_tools && let Some(e) = named("tool_use") {
            return Some(e);
        }
        named("default")
    }

    /// Render template `name` with `context`, its output at most `ceiling` bytes, and
    /// what its `tojson` calls write, together, at most `ceiling` bytes too: both are
    /// counted as they are written, and the render stops at the first byte past
    /// ([`RenderError::TooLarge`]), so that a client's value a template expands (a
    /// deeply nested list dumped with an indent: some 250 bytes out for each 2 in)
    /// costs at most the ceiling, never what the expansion would reach.
    ///
    /// The render's work is bounded by `fuel` (minijinja's: one per instruction run,
    /// one per 64 bytes of values made or written): a template that loops for longer
    /// stops there ([`RenderError::OutOfFuel`]) instead of holding its thread for
    /// ever.
    pub(crate) fn render(
        &self,
        name: &str,
        context: Value,
        ceiling: usize,
        fuel: u64,
    ) -> Result<String, RenderError> {
        // The environment with this render's fuel. A copy shares the compiled
        // templates, filters and globals (reference-counted): it copies a map of a
        // handle per template.
        let mut env = self.env.clone();
        env.set_fuel(Some(fuel));
        let template = env.get_template(name).map_err(RenderError::Template)?;
        let budget = DumpBudget::install(ceiling);
        let mut out = Capped {
            buf: Vec::new(),
            ceiling,
            over: false,
        };
        let rendered = template.render_captured_to(context, &mut out);
        if out.over || budget.exceeded() {
            return Err(RenderError::TooLarge);
        }
        match rendered {
            Err(e) if out_of_fuel(&e) => return Err(RenderError::OutOfFuel),
            Err(e) => return Err(RenderError::Template(e)),
            #[cfg(test)]
            Ok(captured) => FUEL_USED.set(captured.state().fuel_levels().map(|(used, _)| used)),
            #[cfg(not(test))]
            Ok(_) => {}
        }
        String::from_utf8(out.buf).map_err(|_| {
            RenderError::Template(Error::new(
                ErrorKind::InvalidOperation,
                "the rendered chat is not UTF-8",
            ))
        })
    }
}

#[cfg(test)]
thread_local! {
    /// The fuel the last successful render on this thread used.
    pub(crate) static FUEL_USED: Cell<Option<u64>> = const { Cell::new(None) };
}

/// Whether `e`, or an error it wraps, is minijinja's out of fuel.
fn out_of_fuel(e: &Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if c.downcast_ref::<Error>()
            .is_some_and(|e| e.kind() == ErrorKind::OutOfFuel)
        {
            return true;
        }
        cause = c.source();
    }
    false
}

/// Why a render gave no text.
#[derive(Debug)]
pub(crate) enum RenderError {
    /// The template failed, or raised.
    Template(Error),
    /// The output, or what `tojson` wrote, went past the render's ceiling.
    TooLarge,
    /// The render did more work than its fuel pays for.
    OutOfFuel,
}

/// A render's output, refused from the first byte past `ceiling`.
struct Capped {
    buf: Vec<u8>,
    ceiling: usize,
    over: bool,
}

impl io::Write for Capped {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        if bytes.len() > self.ceiling.saturating_sub(self.buf.len()) {
            self.over = true;
            return Err(io::Error::other("the render's ceiling"));
        }
        self.buf.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

thread_local! {
    /// What the `tojson` calls of the render running on this thread may still write,
    /// and whether one went past it (`None`: no render, no limit). A render runs on
    /// the thread that calls it, start to end, and so do its filters.
    static DUMP_LEFT: Cell<Option<(usize, bool)>> = const { Cell::new(None) };
}

/// The `tojson` budget of the render in progress, removed when the render ends (or
/// unwinds).
struct DumpBudget {
    outer: Option<(usize, bool)>,
}

impl DumpBudget {
    fn install(ceiling: usize) -> DumpBudget {
        DumpBudget {
            outer: DUMP_LEFT.replace(Some((ceiling, false))),
        }
    }

    fn exceeded(&self) -> bool {
        DUMP_LEFT.get().is_some_and(|(_, over)| over)
    }

    /// What `tojson` may still write.
    fn left() -> usize {
        DUMP_LEFT.get().map_or(usize::MAX, |(left, _)| left)
    }

    /// `tojson` wrote `n` bytes.
    fn spend(n: usize) {
        if let Some((left, over)) = DUMP_LEFT.get() {
            DUMP_LEFT.set(Some((left.saturating_sub(n), over)));
        }
    }

    /// `tojson` went past what it may write.
    fn overrun() {
        if let Some((left, _)) = DUMP_LEFT.get() {
            DUMP_LEFT.set(Some((left, true)));
        }
    }
}

impl Drop for DumpBudget {
    fn drop(&mut self) {
        DUMP_LEFT.set(self.outer);
    }
}

/// Whether a template loops over a message's content (`for part in
/// message['content']`, `message.content`), the sign of templates that take OpenAI's
/// list-of-parts content.
///
/// vLLM decides this from the template's syntax tree (`_detect_content_format`); this
/// recognises the loop as written in the models' templates: a block (`{% ... %}`) that
/// is a `for`, its iterated expression read up to the block's end, its whitespace
/// control (`-%}`, `+%}`) left out, or up to a loop filter (`if`) or `recursive`,
/// whichever comes first. Set the format explicitly
/// ([`ContentFormat`](super::ContentFormat)) for a template it misreads.
///
/// Each byte of the template is read a bounded number of times: blocks are read one
/// after the other, each within its own `{%` and `%}`, and the scan ends at a block
/// that does not end (the template would not compile).
fn iterates_content(source: &str) -> bool {
    let mut rest = source;
    while let Some(open) = rest.find("{%") {
        let block = &rest[open + 2..];
        let Some(close) = block.find("%}") else {
            scanned(open + 2 + block.len());
            return false;
        };
        scanned(open + 2 + close + 2);
        if loops_over_content(&block[..close]) {
            return true;
        }
        rest = &block[close + 2..];
    }
    scanned(rest.len());
    false
}

/// Whether `block`, what is between a block's `{%` and `%}`, is a `for` over a
/// message's content.
fn loops_over_content(block: &str) -> bool {
    // The block's whitespace control (`{%-`, `{%+`, `-%}`, `+%}`) is not the statement's.
    let statement = block
        .strip_prefix(['-', '+'])
        .unwrap_or(block)
        .trim_start()
        .trim_end()
        .trim_end_matches(['-', '+']);
    scanned(block.len());
    // Jinja2's `for`: `for <target> in <iter> [if <test>] [recursive]`.
    let Some(rest) = statement.strip_prefix("for") else {
        return false;
    };
    let Some((target, rest)) = next_word(rest) else {
        return false;
    };
    if target.is_empty() || !target.chars().all(|c| c.is_alphanumeric() || c == '_') {
        return false;
    }
    let Some(("in", iter)) = next_word(rest) else {
        return false;
    };
    // The iterated expression ends at the first word `if` or `recursive`, and is read
    // up to its first filter (`|`), its words put together.
    let mut rest = iter;
    let end = loop {
        let word_at = rest.trim_start();
        let offset = iter.len() - word_at.len();
        let word_end = word_at.find(char::is_whitespace).unwrap_or(word_at.len());
        let (word, after) = word_at.split_at(word_end);
        if word.is_empty() {
            break iter.len();
        }
        if matches!(word, "if" | "recursive") {
            break offset;
        }
        if let Some(bar) = word.find('|') {
            break offset + bar;
        }
        rest = after;
    };
    scanned(iter.len() - rest.len());
    let head = &iter[..end];
    ["['content']", "[\"content\"]", ".content"]
        .iter()
        .any(|suffix| ends_with_outside_whitespace(head, suffix))
}

/// The word at the start of `text` after its leading whitespace (`text` starts with
/// some, or the word does not start there: `None`), and what follows it.
fn next_word(text: &str) -> Option<(&str, &str)> {
    if !text.is_empty() && !text.starts_with(char::is_whitespace) {
        return None;
    }
    let text = text.trim_start();
    let end = text.find(char::is_whitespace).unwrap_or(text.len());
    Some(text.split_at(end))
}

/// Whether `text`, its whitespace left out, ends with `suffix`.
fn ends_with_outside_whitespace(text: &str, suffix: &str) -> bool {
    let mut read = 0;
    let mut tail = text
        .chars()
        .rev()
        .inspect(|c| read += c.len_utf8())
        .filter(|c| !c.is_whitespace());
    let ends = suffix.chars().rev().all(|c| tail.next() == Some(c));
    drop(tail);
    scanned(read);
    ends
}

#[cfg(test)]
thread_local! {
    /// The bytes [`iterates_content`] read on this thread.
    pub(crate) static SCANNED: Cell<u64> = const { Cell::new(0) };
}

/// [`iterates_content`] read `n` more bytes.
#[inline]
fn scanned(n: usize) {
    #[cfg(test)]
    SCANNED.set(SCANNED.get() + n as u64);
    #[cfg(not(test))]
    let _ = n;
}

/// The most containers (lists, maps) `tojson` writes one inside another: 256, twice
/// the most a client's JSON nests (serde_json's limit, 128, which a request body and a
/// tool call's `arguments` each meet), so that a template dumping any of a request's
/// values, or a few levels around it, writes it. A deeper value, which only a template
/// can build (a namespace's list wrapped in itself in a loop), fails the render: the
/// writer recurses once per level, on the stack of the thread that renders.
pub(crate) const MAX_DUMP_DEPTH: usize = 256;

/// `raise_exception(message)`: the template refuses the conversation.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the local time, as Python's `datetime.now().strftime`.
fn strftime_now(format: String) -> Result<String, Error> {
    let now = jiff::Zoned::now();
    let mut out = String::new();
    jiff::fmt::strtime::format(format.as_bytes(), &now)
        .map(|s| out.push_str(&s))
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("strftime_now: {e}")))?;
    Ok(out)
}

/// `tojson`: Python's `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, as transformers installs it.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_owned()),
        Some(v) => match v.as_i64() {
            Some(n) => {
                // Python's `" " * indent` (a negative indent: none). The template's
                // number, refused before it is made when larger than what the dump may
                // still write (`indent=10**12`: a terabyte): any use of it would be.
                let n = usize::try_from(n).unwrap_or(0);
                if n > DumpBudget::left() {
                    DumpBudget::overrun();
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: the indent is larger than the render may write",
                    ));
                }
                Some(" ".repeat(n))
            }
            None => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ));
            }
        },
    };
    let (item, key) = match separators.filter(|s| !s.is_none()) {
        Some(s) => {
            let item = s.get_item(&Value::from(0))?;
            let key = s.get_item(&Value::from(1))?;
            match (item.as_str(), key.as_str()) {
                (Some(i), Some(k)) => (i.to_owned(), k.to_owned()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ));
                }
            }
        }
        // Python's defaults: `(", ", ": ")`, or `(",", ": ")` with an indent.
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let dumper = Dumper {
        indent,
        item,
        key,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
        limit: DumpBudget::left(),
    };
    let mut out = String::new();
    if let Err(e) = dumper.value(&mut out, &value, 0) {
        if out.len() > dumper.limit {
            DumpBudget::overrun();
        }
        return Err(e);
    }
    DumpBudget::spend(out.len());
    Ok(Value::from(out))
}

struct Dumper {
    indent: Option<String>,
    item: String,
    key: String,
    ensure_ascii: bool,
    sort_keys: bool,
    /// The most it may write: what is left of the render's budget.
    limit: usize,
}

impl Dumper {
    /// Fails once `out` is past the limit: checked as the text grows (after each
    /// indent, each scalar and each character of a string), so the dump stops within
    /// a few bytes of it.
    fn room(&self, out: &str) -> Result<(), Error> {
        if out.len() > self.limit {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: the dump is larger than the render may write",
            ));
        }
        Ok(())
    }

    fn newline(&self, out: &mut String, level: usize) -> Result<(), Error> {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
                self.room(out)?;
            }
        }
        Ok(())
    }

    fn value(&self, out: &mut String, v: &Value, level: usize) -> Result<(), Error> {
        self.room(out)?;
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if v.is_integer() {
                    let _ = write!(out, "{v}");
                } else {
                    let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                    out.push_str(&py_float(f));
                }
            }
            ValueKind::String => self.string(out, v.as_str().unwrap_or(""))?,
            ValueKind::Seq | ValueKind::Iterable => {
                Self::nest(level)?;
                let items: Vec<Value> = v.try_iter()?.collect();
                self.seq(out, &items, level)?;
            }
            ValueKind::Map => {
                Self::nest(level)?;
                let mut pairs = Vec::new();
                for k in v.try_iter()? {
                    let val = v.get_item(&k)?;
                    pairs.push((key_text(&k)?, val));
                }
                if self.sort_keys {
                    pairs.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.map(out, &pairs, level)?;
            }
            kind => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: a {kind} is not JSON serializable"),
                ));
            }
        }
        self.room(out)
    }

    /// Fails for a container at `level` (the outermost at 0) past [`MAX_DUMP_DEPTH`]:
    /// the dump recurses once per level, on the render's stack.
    fn nest(level: usize) -> Result<(), Error> {
        if level >= MAX_DUMP_DEPTH {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: the value is nested deeper than {MAX_DUMP_DEPTH} levels"),
            ));
        }
        Ok(())
    }

    fn seq(&self, out: &mut String, items: &[Value], level: usize) -> Result<(), Error> {
        if items.is_empty() {
            out.push_str("[]");
            return Ok(());
        }
        out.push('[');
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item);
            }
            self.newline(out, level + 1)?;
            self.value(out, item, level + 1)?;
        }
        self.newline(out, level)?;
        out.push(']');
        Ok(())
    }

    fn map(&self, out: &mut String, pairs: &[(String, Value)], level: usize) -> Result<(), Error> {
        if pairs.is_empty() {
            out.push_str("{}");
            return Ok(());
        }
        out.push('{');
        for (i, (k, v)) in pairs.iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item);
            }
            self.newline(out, level + 1)?;
            self.string(out, k)?;
            out.push_str(&self.key);
            self.value(out, v, level + 1)?;
        }
        self.newline(out, level)?;
        out.push('}');
        Ok(())
    }

    /// A JSON string as Python's encoder writes it.
    fn string(&self, out: &mut String, s: &str) -> Result<(), Error> {
        out.push('"');
        for c in s.chars() {
            self.room(out)?;
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(out, "\\u{:04x}", c as u32);
                }
                c if self.ensure_ascii && !c.is_ascii() => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
        self.room(out)
    }
}

/// A map key as Python's `json.dumps` writes it (strings as they are; numbers, booleans
/// and `None` converted).
fn key_text(k: &Value) -> Result<String, Error> {
    match k.kind() {
        ValueKind::String => Ok(k.as_str().unwrap_or("").to_owned()),
        ValueKind::Bool => Ok(if k.is_true() { "true" } else { "false" }.to_owned()),
        ValueKind::None => Ok("null".to_owned()),
        ValueKind::Number if k.is_integer() => Ok(k.to_string()),
        ValueKind::Number => Ok(py_float(f64::try_from(k.clone()).unwrap_or(f64::NAN))),
        kind => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
        )),
    }
}

/// A float as Python's `repr` writes it: the shortest round-tripping digits, positional
/// for exponents from -4 to 15, else `d.ddde+XX`.
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    // Rust's `{:e}` gives the shortest round-tripping digits: `-1.2345e-7`.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let s = if point <= 0 {
            let zeros = usize::try_from(-point).unwrap_or(0);
            format!("0.{}{digits}", "0".repeat(zeros))
        } else {
            let point = usize::try_from(point).unwrap_or(0);
            if digits.len() <= point {
                format!("{digits}{}.0", "0".repeat(point - digits.len()))
            } else {
                format!("{}.{}", &digits[..point], &digits[point..])
            }
        };
        format!("{sign}{s}")
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{esign}{:02}", exp.abs())
    }
}

/// From this many keys on, a [`Fields`] keeps an index of them (key to position), so
/// that finding a key costs one hash look-up, not a comparison with each key: a
/// client's object of `n` distinct keys (a message, `chat_template_kwargs`, a tool, a
/// tool call's `arguments`) then costs `n` look-ups to build and to read, where the
/// scan cost `n²/2` comparisons (90,000 keys: 4 billion). Below it the scan is as fast
/// and allocates nothing.
const INDEX_FROM: usize = 8;

/// A JSON object with its keys in their order: a message, or a dict the normalisation
/// rebuilt. Templates see it as a mapping.
#[derive(Debug, Clone, Default)]
pub(crate) struct Fields {
    pairs: Vec<(String, Value)>,
    /// Each key's position in `pairs`, once there are [`INDEX_FROM`] of them.
    index: Option<HashMap<String, usize>>,
}

#[cfg(test)]
thread_local! {
    /// Key comparisons and index look-ups made on this thread ([`Fields`]' cost).
    pub(crate) static PROBES: Cell<u64> = const { Cell::new(0) };
}

/// One key comparison, or one index look-up.
#[inline]
fn probe() {
    #[cfg(test)]
    PROBES.set(PROBES.get() + 1);
}

impl Fields {
    /// `pairs` as an object, a repeated key keeping its first position and its last
    /// value (as Python's `json` and dicts do).
    pub(crate) fn new(pairs: Vec<(String, Value)>) -> Fields {
        let mut fields = Fields {
            pairs: Vec::with_capacity(pairs.len()),
            index: None,
        };
        for (k, v) in pairs {
            fields.insert(k, v);
        }
        fields
    }

    /// The key-value pairs, in order.
    #[cfg(test)]
    pub(crate) fn pairs(&self) -> &[(String, Value)] {
        &self.pairs
    }

    pub(crate) fn into_pairs(self) -> Vec<(String, Value)> {
        self.pairs
    }

    fn position(&self, key: &str) -> Option<usize> {
        match &self.index {
            Some(index) => {
                probe();
                index.get(key).copied()
            }
            None => self.pairs.iter().position(|(k, _)| {
                probe();
                k == key
            }),
        }
    }

    pub(crate) fn get(&self, key: &str) -> Option<&Value> {
        self.position(key).map(|i| &self.pairs[i].1)
    }

    /// Set `key`, in place when it exists (a Python dict keeps the key's position).
    pub(crate) fn set(&mut self, key: &str, value: Value) {
        match self.position(key) {
            Some(i) => self.pairs[i].1 = value,
            None => self.push(key.to_owned(), value),
        }
    }

    /// [`set`](Self::set) with an owned key.
    pub(crate) fn insert(&mut self, key: String, value: Value) {
        match self.position(&key) {
            Some(i) => self.pairs[i].1 = value,
            None => self.push(key, value),
        }
    }

    /// A key not there yet.
    fn push(&mut self, key: String, value: Value) {
        if let Some(index) = &mut self.index {
            index.insert(key.clone(), self.pairs.len());
        }
        self.pairs.push((key, value));
        if self.index.is_none() && self.pairs.len() >= INDEX_FROM {
            self.reindex();
        }
    }

    fn reindex(&mut self) {
        self.index = (self.pairs.len() >= INDEX_FROM).then(|| {
            self.pairs
                .iter()
                .enumerate()
                .map(|(i, (k, _))| (k.clone(), i))
                .collect()
        });
    }

    pub(crate) fn remove(&mut self, key: &str) {
        if self.position(key).is_some() {
            self.pairs.retain(|(k, _)| k != key);
            self.reindex();
        }
    }

    /// The fields of a mapping value, in its order.
    pub(crate) fn of(v: &Value) -> Result<Fields, Error> {
        let mut fields = Fields::default();
        for k in v.try_iter()? {
            let val = v.get_item(&k)?;
            fields.insert(key_text(&k)?, val);
        }
        Ok(fields)
    }

    pub(crate) fn into_value(self) -> Value {
        Value::from_object(self)
    }
}

impl Object for Fields {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        self.get(key.as_str()?).cloned()
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(
            self.pairs
                .iter()
                .map(|(k, _)| Value::from(k.as_str()))
                .collect(),
        )
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.pairs.len())
    }
}

impl<'de> Deserialize<'de> for Fields {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Fields;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Fields, A::Error> {
                let mut fields = Fields::default();
                while let Some((k, v)) = map.next_entry::<String, Value>()? {
                    // Python's `json` keeps a repeated key's first position, last value.
                    fields.insert(k, v);
                }
                Ok(fields)
            }
        }
        d.deserialize_map(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, ctx: Value) -> Result<String, Error> {
        let t = Templates::new(vec![("default".into(), source.into())]).map_err(|e| e.1)?;
        t.render("default", ctx, usize::MAX, u64::MAX)
            .map_err(|e| match e {
                RenderError::Template(e) => e,
                RenderError::TooLarge => Error::new(ErrorKind::InvalidOperation, "too large"),
                RenderError::OutOfFuel => Error::from(ErrorKind::OutOfFuel),
            })
    }

    #[test]
    fn floats_print_as_python_repr() {
        for (f, s) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (123.456, "123.456"),
            (-0.0, "-0.0"),
        ] {
            assert_eq!(py_float(f), s, "{f}");
        }
    }

    #[test]
    fn tojson_writes_as_python_json_dumps() {
        let v: Value =
            serde_json::from_str(r#"{"b":1,"a":[true,null,"é\n\"x\""],"c":{},"d":[],"e":2.0}"#)
                .unwrap();
        let ctx = minijinja::context! { v => v };
        let got = render("{{ v | tojson }}", ctx.clone()).unwrap();
        assert_eq!(
            got,
            r#"{"b": 1, "a": [true, null, "é\n\"x\""], "c": {}, "d": [], "e": 2.0}"#
        );
        let got = render("{{ v | tojson(indent=2, sort_keys=true) }}", ctx.clone()).unwrap();
        assert_eq!(
            got,
            "{\n  \"a\": [\n    true,\n    null,\n    \"é\\n\\\"x\\\"\"\n  ],\n  \"b\": 1,\n  \"c\": {},\n  \"d\": [],\n  \"e\": 2.0\n}"
        );
        let got = render("{{ v.a | tojson(ensure_ascii=true) }}", ctx).unwrap();
        assert_eq!(got, r#"[true, null, "\u00e9\n\"x\""]"#);
    }

    #[test]
    fn python_methods_loop_controls_and_whitespace_follow_jinja2() {
        let source = "{% for m in messages %}\n  {% if loop.index > 2 %}{% break %}{% endif %}\n{{ m.content.strip().upper() }}|{{ m['role'].startswith('us') }}\n{% endfor %}\n";
        let messages: Value = serde_json::from_str(
            r#"[{"role":"user","content":"  a "},{"role":"bot","content":"b"},{"role":"user","content":"c"}]"#,
        )
        .unwrap();
        let got = render(source, minijinja::context! { messages => messages }).unwrap();
        // Python prints its booleans capitalised, and so does minijinja.
        assert_eq!(got, "A|True\nB|False\n");
    }

    #[test]
    fn raise_exception_fails_the_render_with_its_message() {
        let err = render("{{ raise_exception('no system role') }}", Value::UNDEFINED).unwrap_err();
        assert_eq!(err.detail(), Some("no system role"));
    }

    #[test]
    fn content_loops_are_recognised() {
        assert!(iterates_content(
            "{% for message in messages %}{% for part in message['content'] %}{{ part.text }}{% endfor %}{% endfor %}"
        ));
        assert!(iterates_content(
            "{%- for c in m.content | selectattr('type', 'equalto', 'text') -%}{%- endfor -%}"
        ));
        assert!(!iterates_content(
            "{% for message in messages %}{{ message['content'] }}{% endfor %}"
        ));
    }

    /// The loop's end may trim whitespace (`-%}`, `+%}`), filter (`if`) and recurse
    /// (`recursive`): the iterated expression is what comes before them, as Jinja2
    /// parses a `for` (vLLM reads the loop's `iter` from the syntax tree).
    #[test]
    fn content_loops_with_whitespace_control_filters_and_recursion_are_recognised() {
        for source in [
            // Gemma 3's.
            "{%- for item in message['content'] -%}{%- endfor -%}",
            "{% for item in message['content'] +%}{% endfor %}",
            "{%- for item in message[\"content\"]-%}{%- endfor -%}",
            "{% for part in message.content if part.type == 'text' %}{% endfor %}",
            "{%- for part in message.content if part['type'] == 'text' -%}{%- endfor -%}",
            "{% for part in message.content\n    if part.text %}{% endfor %}",
            "{% for part in message['content'] recursive %}{% endfor %}",
            "{% for part in message.content | selectattr('type', 'equalto', 'text') if part %}{% endfor %}",
        ] {
            assert!(iterates_content(source), "{source}");
        }
        for source in [
            "{%- for item in message['content_parts'] -%}{%- endfor -%}",
            "{% for m in messages if m.content %}{% endfor %}",
            "{% for m in messages recursive %}{{ m.content }}{% endfor %}",
        ] {
            assert!(!iterates_content(source), "{source}");
        }
    }

    #[test]
    fn fields_keep_their_order_and_fold_repeats() {
        let f: Fields = serde_json::from_str(r#"{"z":1,"a":2,"z":3}"#).unwrap();
        let keys: Vec<&str> = f.pairs().iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["z", "a"]);
        assert_eq!(f.get("z").and_then(Value::as_i64), Some(3));
        let got = render(
            "{{ f | tojson }}",
            minijinja::context! { f => f.into_value() },
        )
        .unwrap();
        assert_eq!(got, r#"{"z": 3, "a": 2}"#);
    }

    /// A list nested deep, dumped with an indent: 2 bytes of `0,` in, some 250 out.
    fn nested(depth: usize, zeros: usize) -> Value {
        let json = format!(
            "{}{}{}",
            "[".repeat(depth),
            vec!["0"; zeros].join(","),
            "]".repeat(depth)
        );
        serde_json::from_str(&json).unwrap()
    }

    /// What a render writes, and what its `tojson` calls write (printed or not), stop
    /// at its ceiling; under it the same render succeeds.
    #[test]
    fn renders_and_dumps_stop_at_the_ceiling() {
        let t = Templates::new(vec![
            ("out".into(), "{{ v | tojson(indent=2) }}".into()),
            (
                "kept".into(),
                "{% set x = v | tojson(indent=2) %}{{ x | length }}".into(),
            ),
            (
                "twice".into(),
                "{% for _ in range(4) %}{% set x = v | tojson(indent=2) %}{% endfor %}ok".into(),
            ),
        ])
        .map_err(|e| e.1)
        .unwrap();
        let v = nested(100, 1000);
        let ctx = || minijinja::context! { v => v.clone() };
        let full = t.render("out", ctx(), usize::MAX, u64::MAX).unwrap();
        assert!(full.len() > 200_000, "{}", full.len());
        for name in ["out", "kept"] {
            let err = t.render(name, ctx(), 64 * 1024, u64::MAX).unwrap_err();
            assert!(matches!(err, RenderError::TooLarge), "{name}: {err:?}");
            assert!(
                t.render(name, ctx(), full.len() + 10, u64::MAX).is_ok(),
                "{name}"
            );
        }
        // The dumps of one render share one budget.
        assert!(t.render("twice", ctx(), 2 * full.len(), u64::MAX).is_err());
        assert!(t.render("twice", ctx(), 4 * full.len(), u64::MAX).is_ok());
        // No budget is left behind on the thread.
        assert_eq!(DUMP_LEFT.get(), None);
    }

    /// An indent larger than what the render may still write is refused before it is
    /// made (`" " * 10**12` would be a terabyte: the allocation failed and aborted the
    /// process), whatever is dumped: Python's `json.dumps` makes it first too (and
    /// fails). An indent that fits is used.
    #[test]
    fn an_indent_larger_than_the_render_may_write_is_refused() {
        let t = Templates::new(vec![
            ("list".into(), "{{ v | tojson(indent=10**12) }}".into()),
            ("scalar".into(), "{{ 1 | tojson(indent=10**12) }}".into()),
            ("fits".into(), "{{ v | tojson(indent=1000) }}".into()),
        ])
        .map_err(|e| e.1)
        .unwrap();
        let ctx = || minijinja::context! { v => vec![1, 2] };
        for name in ["list", "scalar"] {
            let err = t.render(name, ctx(), 1 << 20, u64::MAX).unwrap_err();
            assert!(matches!(err, RenderError::TooLarge), "{name}: {err:?}");
        }
        let pad = " ".repeat(1000);
        assert_eq!(
            t.render("fits", ctx(), 1 << 20, u64::MAX).unwrap(),
            format!("[\n{pad}1,\n{pad}2\n]")
        );
        // Past what is left of the render's budget.
        let err = t.render("fits", ctx(), 999, u64::MAX).unwrap_err();
        assert!(matches!(err, RenderError::TooLarge), "{err:?}");
    }

    /// A render stops when its fuel is spent, however long the template would run (here
    /// 10^10 loop iterations, 2^40 macro calls): out of fuel, not a template error. A
    /// loop of 10^4 iterations runs out of 10^4 fuel, and renders with 10^6.
    #[test]
    fn a_render_that_would_run_for_ever_runs_out_of_fuel() {
        let t = Templates::new(vec![
            (
                "nested".into(),
                "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                    .into(),
            ),
            (
                "macro".into(),
                "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}"
                    .into(),
            ),
            (
                "short".into(),
                "{% for i in range(100) %}{% for j in range(100) %}{% endfor %}{% endfor %}ok"
                    .into(),
            ),
        ])
        .map_err(|e| e.1)
        .unwrap();
        for name in ["nested", "macro"] {
            let err = t
                .render(name, Value::UNDEFINED, usize::MAX, 10_000)
                .unwrap_err();
            assert!(matches!(err, RenderError::OutOfFuel), "{name}: {err:?}");
        }
        let err = t
            .render("short", Value::UNDEFINED, usize::MAX, 10_000)
            .unwrap_err();
        assert!(matches!(err, RenderError::OutOfFuel), "{err:?}");
        assert_eq!(
            t.render("short", Value::UNDEFINED, usize::MAX, 1_000_000)
                .unwrap(),
            "ok"
        );
        let used = FUEL_USED.get().unwrap();
        assert!((10_000..1_000_000).contains(&used), "{used}");
    }

    /// The stack the proxy renders on: its serving threads' and Tokio's blocking pool's
    /// are Rust's default, 2 MiB.
    const RENDER_STACK: usize = 2 * 1024 * 1024;

    /// `f`'s result, run on a thread with the proxy's render stack.
    fn on_render_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::Builder::new()
            .stack_size(RENDER_STACK)
            .spawn(f)
            .unwrap()
            .join()
            .unwrap()
    }

    /// A list nested `depth` deep around a zero, built level by level.
    fn deep_list(depth: usize) -> Value {
        let mut v = Value::from(0);
        for _ in 0..depth {
            v = Value::from_iter([v]);
        }
        v
    }

    /// Drops `v`, a [`deep_list`], level by level (minijinja's drop recurses once per
    /// level).
    fn drop_level_by_level(v: Value) {
        let mut next = Some(v);
        while let Some(v) = next.take() {
            let Some(items) = v.downcast_object::<Vec<Value>>() else {
                continue;
            };
            drop(v);
            next = Arc::try_unwrap(items)
                .ok()
                .and_then(|i| i.into_iter().next());
        }
    }

    /// `tojson` of a value nested deeper than [`MAX_DUMP_DEPTH`] fails the render,
    /// on the stack the proxy renders on; its writer recursed once per level and
    /// overflowed the stack, which aborts the process (a template can nest a value as
    /// deep as its fuel allows: `{% set ns.x = [ns.x] %}` in a loop). A value nested
    /// to the limit is dumped.
    #[test]
    fn tojson_of_a_value_nested_too_deep_fails_the_render() {
        on_render_stack(|| {
            let ctx = |v: &Value| Fields::new(vec![("v".into(), v.clone())]).into_value();
            let deep = deep_list(100_000);
            let err = render("{{ v | tojson }}", ctx(&deep)).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidOperation, "{err}");
            assert!(err.to_string().contains("nested deeper than"), "{err}");
            drop_level_by_level(deep);
            let limit = deep_list(MAX_DUMP_DEPTH);
            let got = render("{{ v | tojson(indent=1) }}", ctx(&limit)).unwrap();
            assert_eq!(got.matches('[').count(), MAX_DUMP_DEPTH);
            assert!(render("{{ [v] | tojson }}", ctx(&limit)).is_err());
            drop_level_by_level(limit);
        });
    }

    /// Deciding whether a template loops over message content reads each byte of it a
    /// bounded number of times, whatever the template holds: it read from each `for `
    /// to the end of the template (and copied it), so that a template of `for x in y `
    /// repeated, without a block's end, took time and copies quadratic in its size
    /// (16 MiB: some 10^13 bytes read, at startup).
    #[test]
    fn the_content_loop_scan_reads_each_byte_a_bounded_number_of_times() {
        let n = 5_000;
        let found = format!(
            "{}{{% for p in message.content %}}",
            "for x in y ".repeat(n)
        );
        for (source, loops) in [
            ("for x in y ".repeat(n), false),
            (format!("{{% {}%}}", "for x in y ".repeat(n)), false),
            ("{% for x in y ".repeat(n), false),
            (format!("{{% for x in {}%}}", "a ".repeat(n)), false),
            ("{% for x in y %}".repeat(n), false),
            (found, true),
        ] {
            SCANNED.set(0);
            assert_eq!(iterates_content(&source), loops, "{}", &source[..40]);
            let scanned = SCANNED.get();
            // A few passes over each byte, at most: finding the blocks, then reading one.
            assert!(
                scanned <= 8 * source.len() as u64,
                "{scanned} bytes read for a template of {}",
                source.len()
            );
        }
    }

    /// Building, reading, setting and dumping an object of `n` distinct keys costs a
    /// few look-ups per key, not a comparison with each other key (`n²/2`: the
    /// 12,500,000 comparisons of 5,000 keys the scan made).
    #[test]
    fn fields_cost_a_few_look_ups_per_key() {
        let n = 5000;
        let keys: Vec<String> = (0..n).map(|i| format!("k{i}")).collect();
        let json = format!(
            "{{{}}}",
            keys.iter()
                .map(|k| format!("\"{k}\":1"))
                .collect::<Vec<_>>()
                .join(",")
        );
        PROBES.set(0);
        let mut f: Fields = serde_json::from_str(&json).unwrap();
        for k in &keys {
            assert!(f.get(k).is_some());
            f.set(k, Value::from(2));
        }
        let copy = Fields::of(&f.clone().into_value()).unwrap();
        assert_eq!(copy.pairs().len(), n);
        let dumped = render(
            "{{ f | tojson }}",
            minijinja::context! { f => f.into_value() },
        )
        .unwrap();
        assert!(dumped.starts_with(r#"{"k0": 2, "k1": 2"#));
        let probes = PROBES.get();
        assert!(
            probes <= 8 * n as u64,
            "{probes} key comparisons and look-ups for {n} keys"
        );
    }
}
