//! JSON read and rewritten without building it: the members of an object and the
//! elements of a list visited one at a time, each a [`RawValue`] slice of the input.
//!
//! Bytes from a client or an engine are never built as [`serde_json::Value`] to read a
//! few members of them: a `Value` costs about sixteen bytes per byte of `[0,0,...]` and
//! over ninety per byte of `[{"":0},...]` (each small object is a B-tree leaf), so a
//! 32 MiB body could cost gigabytes. A reshape (SGLang's logprob merge, LMCache's
//! change of form) touches a handful of an answer's members: with [`Object::copy`] what
//! it does not touch is copied as the engine wrote it (its order, its numbers, its
//! nesting: a raw value is skipped without recursion), and the output is the only
//! allocation, about the input's size.
//!
//! Duplicate keys: a lookup ([`member`], [`members_named`]) finds the last, as a parser
//! into a map keeps it; a copy passes each in order, edited alike, so a client's parser
//! still keeps the last.

use serde::de::{Deserializer as _, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

/// The JSON whitespace around a value (RFC 8259): space, tab, line feed, return.
const WHITESPACE: [char; 4] = [' ', '\t', '\n', '\r'];

/// `raw` without the JSON whitespace around it.
pub fn trim(raw: &str) -> &str {
    raw.trim_matches(WHITESPACE)
}

/// Whether the JSON text `raw` (leading whitespace allowed) is an object.
pub fn is_object(raw: &str) -> bool {
    trim(raw).starts_with('{')
}

/// Whether the JSON text `raw` (leading whitespace allowed) is a list.
pub fn is_list(raw: &str) -> bool {
    trim(raw).starts_with('[')
}

/// Calls `f` with each member of the JSON object `raw`, in order, its value unbuilt.
///
/// # Errors
///
/// `raw` is not one JSON object (a data error when it is JSON of another type).
pub fn members<'a>(
    raw: &'a str,
    f: impl FnMut(String, &'a RawValue),
) -> Result<(), serde_json::Error> {
    struct Members<F>(F);
    impl<'de, F: FnMut(String, &'de RawValue)> Visitor<'de> for Members<F> {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
            while let Some(key) = map.next_key::<String>()? {
                let value = map.next_value::<&'de RawValue>()?;
                (self.0)(key, value);
            }
            Ok(())
        }
    }
    let mut de = serde_json::Deserializer::from_str(raw);
    (&mut de).deserialize_map(Members(f))?;
    de.end()
}

/// Calls `f` with each element of the JSON list `raw`, in order, unbuilt.
///
/// # Errors
///
/// `raw` is not one JSON list.
pub fn elements<'a>(raw: &'a str, f: impl FnMut(&'a RawValue)) -> Result<(), serde_json::Error> {
    struct Elements<F>(F);
    impl<'de, F: FnMut(&'de RawValue)> Visitor<'de> for Elements<F> {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON list")
        }
        fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
            while let Some(value) = seq.next_element::<&'de RawValue>()? {
                (self.0)(value);
            }
            Ok(())
        }
    }
    let mut de = serde_json::Deserializer::from_str(raw);
    (&mut de).deserialize_seq(Elements(f))?;
    de.end()
}

/// A JSON list's length and the first byte of its first element, read without building
/// anything (a `Vec<&RawValue>` is 16 bytes per element: eight times a client's
/// `[0,0,...]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListHead {
    /// How many elements the list has.
    pub len: usize,
    /// The first byte of its first element (`None` when empty).
    pub first: Option<u8>,
}

/// The [`ListHead`] of `raw` when it is one JSON list.
pub fn list_head(raw: &[u8]) -> Option<ListHead> {
    let text = std::str::from_utf8(raw).ok()?;
    if !is_list(text) {
        return None;
    }
    let mut head = ListHead {
        len: 0,
        first: None,
    };
    elements(text, |v| {
        if head.len == 0 {
            head.first = v.get().as_bytes().first().copied();
        }
        head.len += 1;
    })
    .ok()?;
    Some(head)
}

/// The value of `key` in the JSON object `raw` (the last, when the key repeats, as a
/// parser into a map keeps it); `None` when `raw` is not an object or lacks the key.
pub fn member<'a>(raw: &'a str, key: &str) -> Option<&'a RawValue> {
    let [found] = members_named(raw, [key]).ok()?;
    found
}

/// The values of `keys` in the JSON object `raw`, in the order of `keys`, found in one
/// walk (each the last, when its key repeats, as a parser into a map keeps it); the
/// other members are skipped, not built.
///
/// ```
/// let [a, b] = disagg_json::raw::members_named(r#"{"a":1,"x":[],"a":2}"#, ["a", "b"])?;
/// assert_eq!((a.map(|v| v.get()), b.is_none()), (Some("2"), true));
/// # Ok::<(), serde_json::Error>(())
/// ```
///
/// # Errors
///
/// `raw` is not one JSON object.
pub fn members_named<'a, const N: usize>(
    raw: &'a str,
    keys: [&str; N],
) -> Result<[Option<&'a RawValue>; N], serde_json::Error> {
    let mut found = [None; N];
    members(raw, |k, v| {
        if let Some(i) = keys.iter().position(|key| *key == k) {
            found[i] = Some(v);
        }
    })?;
    Ok(found)
}

/// The value of `key` in the JSON object `raw` when it is a non-negative integer that
/// fits a `u64` (as `Value::as_u64` reads one: `1.0`, `-1` and `"1"` are not).
pub fn member_u64(raw: &str, key: &str) -> Option<u64> {
    u64_of(member(raw, key)?)
}

/// `raw` as a non-negative integer that fits a `u64`.
pub fn u64_of(raw: &RawValue) -> Option<u64> {
    serde_json::from_str(raw.get()).ok()
}

/// How many objects and lists the JSON text `raw` holds, counted in one pass (strings
/// skipped), up to `stop_after` + 1: what building it as values would allocate a
/// container for, told without building it.
///
/// ```
/// assert_eq!(disagg_json::raw::containers(br#"[{"a":"[{"}, [], 1]"#, 100), 3);
/// assert_eq!(disagg_json::raw::containers(b"[[[[[[", 2), 3);
/// ```
pub fn containers(raw: &[u8], stop_after: usize) -> usize {
    let mut count = 0usize;
    brackets(raw, |b| {
        if matches!(b, b'[' | b'{') {
            count += 1;
        }
        count <= stop_after
    });
    count
}

/// Whether the JSON text `raw` nests objects and lists more than `max` deep, told in
/// one pass (strings skipped), where a walk down to the fault would recurse once per
/// level (a client's `[[[...]]]` of 200,000 levels overflows a thread's stack).
///
/// ```
/// assert!(!disagg_json::raw::nests_deeper(br#"[[1], {"a": [2]}]"#, 3));
/// assert!(disagg_json::raw::nests_deeper(br#"[[1], {"a": [[2]]}]"#, 3));
/// assert!(!disagg_json::raw::nests_deeper(br#"["[[[[", "\\", "\"[[[[", {"{{{{": 1}]"#, 2));
/// ```
pub fn nests_deeper(raw: &[u8], max: usize) -> bool {
    let (mut depth, mut deeper) = (0usize, false);
    brackets(raw, |b| {
        if matches!(b, b'[' | b'{') {
            depth += 1;
            deeper = depth > max;
        } else {
            depth = depth.saturating_sub(1);
        }
        !deeper
    });
    deeper
}

/// Calls `f` with each bracket of the JSON text `raw` (`[`, `{`, `]`, `}`) outside its
/// strings, in order, while `f` says to go on.
fn brackets(raw: &[u8], mut f: impl FnMut(u8) -> bool) {
    let (mut in_string, mut escaped) = (false, false);
    for &b in raw {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' | b']' | b'}' if !f(b) => return,
            _ => {}
        }
    }
}

/// The index just past the JSON value that starts at `raw[start]`, found by its shape
/// alone: a string to its closing quote, a list or an object to its matching bracket
/// (the strings inside skipped, escapes stepped over), any other value to the next
/// `,`, `]`, `}` or whitespace, or to the end of `raw`.
///
/// `raw` must be validated JSON (a value a parser accepted, or a text cut short within
/// one): only the brackets of the value's own kind are counted, which finds the match
/// only because the other kind nests evenly within a valid value. Invalid JSON (`[{]`,
/// say) never panics but gives a meaningless index; to step over a value of unvalidated
/// bytes, walk both kinds of brackets.
///
/// `None` when `start` is past the end, when `raw[start]` starts no value (a separator,
/// whitespace), or when a string, list or object is not closed before the end of
/// `raw`; a cut number or literal cannot be told from a whole one and ends at the end
/// of `raw`.
///
/// ```
/// use disagg_json::raw::validated_value_end;
///
/// let raw = br#"[{"a":"]}"},[1,[2]]] "#;
/// assert_eq!(validated_value_end(raw, 0), Some(20));
/// assert_eq!(validated_value_end(raw, 1), Some(11));
/// assert_eq!(validated_value_end(raw, 12), Some(19));
/// assert_eq!(validated_value_end(&raw[..15], 0), None);
/// ```
pub fn validated_value_end(raw: &[u8], start: usize) -> Option<usize> {
    let (open, close) = match *raw.get(start)? {
        b'"' => return string_end(raw, start),
        b'[' => (b'[', b']'),
        b'{' => (b'{', b'}'),
        _ => {
            let len = raw[start..]
                .iter()
                .position(|c| matches!(c, b',' | b']' | b'}') || c.is_ascii_whitespace())
                .unwrap_or(raw.len() - start);
            return (len > 0).then_some(start + len);
        }
    };
    // Brackets of the other kind nest evenly within a valid value: only this kind's
    // are counted, each found with the strings' quotes by one `memchr3` search. The
    // first found is `raw[start]`, an opening one: the depth never goes below zero.
    let (mut depth, mut j) = (0usize, start);
    loop {
        j += memchr::memchr3(b'"', open, close, raw.get(j..)?)?;
        match raw[j] {
            b'"' => {
                j = string_end(raw, j)?;
                continue;
            }
            c if c == open => depth += 1,
            _ => {
                depth -= 1;
                if depth == 0 {
                    return Some(j + 1);
                }
            }
        }
        j += 1;
    }
}

/// The index just past the JSON string that opens at `raw[start]`: the next quote or
/// backslash found by one `memchr2` search (most strings hold neither), a backslash
/// stepping over the byte it escapes. Only quotes and backslashes are read, so any
/// bytes will do (the string's content is not checked: control bytes, escapes' letters,
/// UTF-8). `None` when `raw[start]` is not a quote or the string is not closed before
/// the end of `raw` (a backslash as its last byte included).
pub(crate) fn string_end(raw: &[u8], start: usize) -> Option<usize> {
    if raw.get(start) != Some(&b'"') {
        return None;
    }
    let mut j = start + 1;
    loop {
        j += memchr::memchr2(b'"', b'\\', raw.get(j..)?)?;
        if raw[j] == b'"' {
            return Some(j + 1);
        }
        j += 2;
    }
}

/// What to do with one member of an object being copied ([`Object::copy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Edit {
    /// Copy it as it came.
    Keep,
    /// Leave it out.
    Drop,
    /// The edit wrote the member's value itself, after its key.
    Wrote,
}

/// A JSON object being written into a buffer, member by member.
///
/// ```
/// use disagg_json::raw::{Edit, Object};
///
/// let mut out = Vec::new();
/// let mut o = Object::open(&mut out);
/// o.copy(r#"{"a":[1, 2],"secret":1}"#, |key, _, _| {
///     if key == "secret" { Edit::Drop } else { Edit::Keep }
/// })?;
/// o.value("b", &true);
/// o.close();
/// assert_eq!(out, br#"{"a":[1, 2],"b":true}"#);
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Debug)]
pub struct Object<'o> {
    out: &'o mut Vec<u8>,
    empty: bool,
}

impl<'o> Object<'o> {
    /// Opens an object at the end of `out`.
    pub fn open(out: &'o mut Vec<u8>) -> Self {
        out.push(b'{');
        Object { out, empty: true }
    }

    /// Writes `key` and returns the buffer for its value, which the caller writes.
    pub fn key(&mut self, key: &str) -> &mut Vec<u8> {
        if !self.empty {
            self.out.push(b',');
        }
        self.empty = false;
        // A string always encodes.
        let _ = serde_json::to_writer(&mut *self.out, key);
        self.out.push(b':');
        self.out
    }

    /// Writes the member `key` with the JSON text `value`.
    pub fn raw(&mut self, key: &str, value: &[u8]) {
        self.key(key).extend_from_slice(value);
    }

    /// Writes the member `key` with `value` encoded as JSON.
    pub fn value(&mut self, key: &str, value: &impl serde::Serialize) {
        let out = self.key(key);
        let mark = out.len();
        if serde_json::to_writer(&mut *out, value).is_err() {
            // The values given here (strings, numbers, nulls) always encode.
            out.truncate(mark);
            out.extend_from_slice(b"null");
        }
    }

    /// Copies the members of the JSON object `raw`, each as `edit` says; an edit that
    /// returns [`Edit::Wrote`] has written the value into the buffer it was given,
    /// after the member's key.
    ///
    /// # Errors
    ///
    /// `raw` is not one JSON object; what was written of it stays, the caller discards
    /// the buffer.
    pub fn copy<'a>(
        &mut self,
        raw: &'a str,
        mut edit: impl FnMut(&str, &'a RawValue, &mut Vec<u8>) -> Edit,
    ) -> Result<(), serde_json::Error> {
        members(raw, |key, value| {
            let (mark, empty) = (self.out.len(), self.empty);
            let out = self.key(&key);
            match edit(&key, value, out) {
                Edit::Keep => out.extend_from_slice(value.get().as_bytes()),
                Edit::Wrote => {}
                Edit::Drop => {
                    self.out.truncate(mark);
                    self.empty = empty;
                }
            }
        })
    }

    /// Closes the object.
    pub fn close(self) {
        self.out.push(b'}');
    }
}

/// Writes the JSON list of `head`'s elements, then `tail`'s: both must be lists.
pub fn concat_lists(head: &str, tail: &str, out: &mut Vec<u8>) {
    let (h, t) = (inner(head), inner(tail));
    out.push(b'[');
    out.extend_from_slice(h.as_bytes());
    if !h.is_empty() && !t.is_empty() {
        out.push(b',');
    }
    out.extend_from_slice(t.as_bytes());
    out.push(b']');
}

/// The elements of the JSON list `raw` as written, without its brackets.
fn inner(raw: &str) -> &str {
    let t = trim(raw);
    trim(t.get(1..t.len().saturating_sub(1)).unwrap_or(""))
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    #[test]
    fn members_come_in_order_unbuilt_and_the_last_of_a_key_is_found() {
        let raw = r#" {"a": [1, 2], "b":{"c":1e400}, "a":"x"} "#;
        let mut seen = Vec::new();
        members(raw, |k, v| seen.push((k, v.get().to_owned()))).unwrap();
        assert_eq!(
            seen,
            [
                ("a".to_owned(), "[1, 2]".to_owned()),
                ("b".to_owned(), r#"{"c":1e400}"#.to_owned()),
                ("a".to_owned(), r#""x""#.to_owned()),
            ]
        );
        assert_eq!(member(raw, "a").unwrap().get(), r#""x""#);
        assert!(member(raw, "z").is_none());
        assert!(member("[1]", "a").is_none());
        assert!(members("{\"a\":1", |_, _| {}).is_err());
        assert_eq!(member_u64(r#"{"i":3}"#, "i"), Some(3));
        for not in ["-1", "1.0", "\"1\"", "null", "18446744073709551616"] {
            assert_eq!(member_u64(&format!(r#"{{"i":{not}}}"#), "i"), None, "{not}");
        }
    }

    #[test]
    fn a_copy_edits_drops_and_appends_and_keeps_the_rest_as_written() {
        let raw = r#"{"keep": [0, 0,0], "drop":1, "edit":"old", "deep":[[[[]]]]}"#;
        let mut out = Vec::new();
        let mut obj = Object::open(&mut out);
        obj.copy(raw, |k, _, out| match k {
            "drop" => Edit::Drop,
            "edit" => {
                out.extend_from_slice(b"\"new\"");
                Edit::Wrote
            }
            _ => Edit::Keep,
        })
        .unwrap();
        obj.value("added", &7);
        obj.close();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            r#"{"keep":[0, 0,0],"edit":"new","deep":[[[[]]]],"added":7}"#
        );
        // Dropping the first member leaves no stray comma.
        let mut out = Vec::new();
        let mut obj = Object::open(&mut out);
        obj.copy(r#"{"drop":1,"a":2}"#, |k, _, _| {
            if k == "drop" { Edit::Drop } else { Edit::Keep }
        })
        .unwrap();
        obj.close();
        assert_eq!(out, br#"{"a":2}"#);
    }

    /// Nesting far past serde's recursion limit is copied, not recursed into.
    #[test]
    fn deep_values_are_copied_without_recursion() {
        let deep = format!("{}{}", "[".repeat(1_000_000), "]".repeat(1_000_000));
        let raw = format!(r#"{{"d":{deep}}}"#);
        let mut out = Vec::new();
        let mut obj = Object::open(&mut out);
        obj.copy(&raw, |_, _, _| Edit::Keep).unwrap();
        obj.close();
        assert_eq!(out, raw.as_bytes());
    }

    #[test]
    fn lists_concatenate_whatever_their_whitespace() {
        for (head, tail, want) in [
            ("[1]", "[2,3]", json!([1, 2, 3])),
            ("[ ]", "[2]", json!([2])),
            ("[1]", " [ ] ", json!([1])),
            ("[]", "[]", json!([])),
            (
                "[[null,1,null]]",
                "[ [-1.0,2,null] ]",
                json!([[null, 1, null], [-1.0, 2, null]]),
            ),
        ] {
            let mut out = Vec::new();
            concat_lists(head, tail, &mut out);
            let got: Value = serde_json::from_slice(&out).unwrap();
            assert_eq!(got, want, "{head} {tail}");
        }
        let mut n = 0;
        elements("[1, {\"a\":[]}, \"x\"]", |_| n += 1).unwrap();
        assert_eq!(n, 3);
    }

    #[test]
    fn a_string_ends_past_its_first_unescaped_quote() {
        for (raw, end) in [
            (&br#""""#[..], Some(2)),
            // Escaped quotes and backslashes.
            (br#""a\"b" , "c""#, Some(6)),
            (br#""a\\"b""#, Some(5)),
            (br#""a\\\"b""#, Some(8)),
            (br#""\\\\""#, Some(6)),
            // A backslash as the last byte escapes nothing: the string is not closed.
            (br#""ab\"#, None),
            (br#""ab\""#, None),
            // Cut short.
            (br#""abc"#, None),
            (br#"""#, None),
            // UTF-8's multibyte sequences hold no byte below 0x80: no quote, no backslash.
            ("\"é長🦀\"".as_bytes(), Some(11)),
            ("\"🦀\\\"長\"]".as_bytes(), Some(11)),
            // Control bytes and invalid UTF-8 are not checked.
            (b"\"\n\xff\"", Some(4)),
            // Not a string.
            (br#"a"b""#, None),
            (b"", None),
        ] {
            assert_eq!(string_end(raw, 0), end, "{}", String::from_utf8_lossy(raw));
        }
        let raw = br#"{"k":"v\""}"#;
        assert_eq!(string_end(raw, 1), Some(4));
        assert_eq!(string_end(raw, 5), Some(10));
        assert_eq!(string_end(raw, 10), None);
        assert_eq!(string_end(raw, 12), None);
    }

    #[test]
    fn a_validated_value_ends_at_its_matching_bracket_strings_skipped() {
        for (raw, end) in [
            // Brackets of both kinds inside strings, at every depth.
            (&br#"[{"a":"]}"},"[",["]"]] ,1"#[..], Some(22)),
            (br#"{"a":["}",{"b":"{"}],"]":"}"}]"#, Some(29)),
            (br#"{"{":{"}":{}}}"#, Some(14)),
            // Escaped quotes and backslashes inside them.
            (br#"["\"]",1]"#, Some(9)),
            (br#"["\\"]]"#, Some(6)),
            (br#"{"\\\"}":"\"{"}}"#, Some(15)),
            (br#""a]\"}" ]"#, Some(7)),
            // Multibyte UTF-8.
            ("[\"長🦀\",{\"é\":\"]\"}]]".as_bytes(), Some(22)),
            // Other values end at a separator, whitespace or the end.
            (b"12.5e3,", Some(6)),
            (b"true]", Some(4)),
            (b"-1 ", Some(2)),
            (b"null", Some(4)),
            // Nothing starts here.
            (b",1", None),
            (b" 1", None),
            (b"]", None),
            (b"", None),
            // Cut short: a list, an object or a string not closed.
            (b"[[1,2],[3", None),
            (br#"{"a":"}"#, None),
            (br#"["a\"#, None),
            (br#"["a\"]"#, None),
            (br#"{"a":[1]"#, None),
        ] {
            assert_eq!(
                validated_value_end(raw, 0),
                end,
                "{}",
                String::from_utf8_lossy(raw)
            );
        }
        let raw = br#"{"k": [1, {"x": "]"}], "n": 2}"#;
        assert_eq!(validated_value_end(raw, 6), Some(21));
        assert_eq!(validated_value_end(raw, 28), Some(29));
        assert_eq!(validated_value_end(raw, 30), None);
        assert_eq!(validated_value_end(raw, 99), None);
    }

    /// Any JSON value, its strings drawn from brackets, quotes, backslashes, control
    /// and multibyte characters, containers nested a few deep.
    fn value() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            "[\\[\\]{}\",\\\\ a\n\u{1}é長🦀]{0,8}".prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 32, 5, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::from),
                proptest::collection::btree_map("[\\[\\]{}\"\\\\a]{0,4}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        /// Each element of a list, compact or pretty-printed, ends where the parser
        /// ends it; the whole list ends at its last byte, and a cut anywhere before
        /// its last byte leaves it unclosed.
        #[test]
        fn a_validated_value_ends_where_the_parser_ends_it(
            list in proptest::collection::vec(value(), 0..5),
            pretty in proptest::prelude::any::<bool>(),
        ) {
            let list = Value::from(list);
            let text = if pretty {
                serde_json::to_string_pretty(&list)
            } else {
                serde_json::to_string(&list)
            }
            .unwrap();
            let b = text.as_bytes();
            let mut spans = Vec::new();
            elements(&text, |v| {
                let start = v.get().as_ptr() as usize - text.as_ptr() as usize;
                spans.push((start, start + v.get().len()));
            })
            .unwrap();
            for (start, end) in spans {
                proptest::prop_assert_eq!(validated_value_end(b, start), Some(end), "{}", text);
            }
            proptest::prop_assert_eq!(validated_value_end(b, 0), Some(b.len()));
            for cut in 0..b.len() {
                proptest::prop_assert_eq!(validated_value_end(&b[..cut], 0), None, "{}", cut);
            }
        }
    }
}
