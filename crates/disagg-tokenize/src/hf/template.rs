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

use std::fmt::Write as _;
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

    /// Render template `name` with `context`.
    pub(crate) fn render(&self, name: &str, context: Value) -> Result<String, Error> {
        self.env.get_template(name)?.render(context)
    }
}

/// Whether a template loops over a message's content (`for part in
/// message['content']`, `message.content`), the sign of templates that take OpenAI's
/// list-of-parts content.
///
/// vLLM decides this from the template's syntax tree (`_detect_content_format`); this
/// recognises the loop as written in the models' templates. Set the format explicitly
/// ([`ContentFormat`](super::ContentFormat)) for a template it misreads.
fn iterates_content(source: &str) -> bool {
    let mut rest = source;
    while let Some(at) = rest.find("for ") {
        let after = &rest[at + 4..];
        rest = after;
        // `for <name> in <expr>`: the iterated expression, up to the block's end.
        let Some(in_at) = after.find(" in ") else {
            continue;
        };
        let target = after[..in_at].trim();
        if target.is_empty() || !target.chars().all(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let expr = &after[in_at + 4..];
        let end = expr.find("%}").unwrap_or(expr.len());
        let expr: String = expr[..end].chars().filter(|c| !c.is_whitespace()).collect();
        let head = expr.split('|').next().unwrap_or("");
        if head.ends_with("['content']")
            || head.ends_with("[\"content\"]")
            || head.ends_with(".content")
        {
            return true;
        }
    }
    false
}

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
            Some(n) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
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
    };
    let mut out = String::new();
    dumper.value(&mut out, &value, 0)?;
    Ok(Value::from(out))
}

struct Dumper {
    indent: Option<String>,
    item: String,
    key: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl Dumper {
    fn newline(&self, out: &mut String, level: usize) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    }

    fn value(&self, out: &mut String, v: &Value, level: usize) -> Result<(), Error> {
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
            ValueKind::String => self.string(out, v.as_str().unwrap_or("")),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.seq(out, &items, level)?;
            }
            ValueKind::Map => {
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
            self.newline(out, level + 1);
            self.value(out, item, level + 1)?;
        }
        self.newline(out, level);
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
            self.newline(out, level + 1);
            self.string(out, k);
            out.push_str(&self.key);
            self.value(out, v, level + 1)?;
        }
        self.newline(out, level);
        out.push('}');
        Ok(())
    }

    /// A JSON string as Python's encoder writes it.
    fn string(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
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

/// A JSON object with its keys in their order: a message, or a dict the normalisation
/// rebuilt. Templates see it as a mapping.
#[derive(Debug, Clone, Default)]
pub(crate) struct Fields(pub(crate) Vec<(String, Value)>);

impl Fields {
    pub(crate) fn get(&self, key: &str) -> Option<&Value> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Set `key`, in place when it exists (a Python dict keeps the key's position).
    pub(crate) fn set(&mut self, key: &str, value: Value) {
        match self.0.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.0.push((key.to_owned(), value)),
        }
    }

    pub(crate) fn remove(&mut self, key: &str) {
        self.0.retain(|(k, _)| k != key);
    }

    /// The fields of a mapping value, in its order.
    pub(crate) fn of(v: &Value) -> Result<Fields, Error> {
        let mut fields = Vec::new();
        for k in v.try_iter()? {
            let val = v.get_item(&k)?;
            fields.push((key_text(&k)?, val));
        }
        Ok(Fields(fields))
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
            self.0
                .iter()
                .map(|(k, _)| Value::from(k.as_str()))
                .collect(),
        )
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.0.len())
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
                let mut fields: Vec<(String, Value)> = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, Value>()? {
                    // Python's `json` keeps a repeated key's first position, last value.
                    match fields.iter_mut().find(|(f, _)| *f == k) {
                        Some(slot) => slot.1 = v,
                        None => fields.push((k, v)),
                    }
                }
                Ok(Fields(fields))
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
        t.render("default", ctx)
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

    #[test]
    fn fields_keep_their_order_and_fold_repeats() {
        let f: Fields = serde_json::from_str(r#"{"z":1,"a":2,"z":3}"#).unwrap();
        let keys: Vec<&str> = f.0.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["z", "a"]);
        assert_eq!(f.get("z").and_then(Value::as_i64), Some(3));
        let got = render(
            "{{ f | tojson }}",
            minijinja::context! { f => f.into_value() },
        )
        .unwrap();
        assert_eq!(got, r#"{"z": 3, "a": 2}"#);
    }
}
