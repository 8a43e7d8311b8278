//! The scan against `serde_json`: on every input, either both read the same fields at
//! the same places, or the scan gives up (and serde decides); the scan never accepts what
//! serde refuses.

use proptest::prelude::*;

use super::super::{Key, serde_fields};
use super::object_fields;

/// A field as `(key text, start, end)`.
fn fields(b: &[u8], spans: Vec<(Key, usize, usize)>) -> Vec<(String, usize, usize)> {
    spans
        .into_iter()
        .map(|(k, s, e)| {
            let k = match k {
                Key::Span(a, z) => String::from_utf8(b[a..z].to_vec()).unwrap(),
                Key::Owned(k) => k,
            };
            (k, s, e)
        })
        .collect()
}

/// What serde reads of `b`, `None` when it refuses it.
fn serde(b: &[u8]) -> Option<Vec<(String, usize, usize)>> {
    serde_fields(b).ok().map(|s| fields(b, s))
}

/// What the scan reads of `b`, `None` when it gives up.
fn scan(b: &[u8]) -> Option<Vec<(String, usize, usize)>> {
    object_fields(b).map(|s| fields(b, s))
}

/// The scan agrees with serde on `b`: the same fields when both read it, and never a
/// reading where serde refuses. Returns whether the scan read it.
fn agrees(b: &[u8]) -> bool {
    let (fast, slow) = (scan(b), serde(b));
    if let Some(fast) = &fast {
        assert_eq!(
            Some(fast),
            slow.as_ref(),
            "scan and serde differ on {:?}",
            String::from_utf8_lossy(b)
        );
    }
    fast.is_some()
}

#[test]
fn reads_what_serde_reads() {
    for ok in [
        r#"{}"#,
        " \t\r\n{ } \n",
        r#"{"a":1}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#,
        r#" { "z": 1.50, "a" : {"x": [1, 2]}, "s": "\u00e9\n", "n": null } "#,
        r#"{"a":-0,"b":0.5e-3,"c":1E+9,"d":-12.25,"e":[],"f":{},"g":[[],[{}]]}"#,
        r#"{"a":true,"b":false,"c":null,"a":"again"}"#,
        r#"{"a\"b":1,"\u0041":2,"k\/":3}"#,
        "{\"é\":\"ünïcødé ✓ 🦀\"}",
        r#"{"s":"\ud800"}"#,
        r#"{"o":{"k":"\"}\\","l":[1,"]",{"x":"{"}]}}"#,
        "{\"a\":\"\x7f\"}",
    ] {
        assert!(agrees(ok.as_bytes()), "the scan gave up on {ok}");
    }
}

#[test]
fn refuses_what_serde_refuses() {
    for bad in [
        &b""[..],
        b"{",
        b"}",
        b"[1]",
        b"\"x\"",
        b"{}x",
        b"{},",
        br#"{"a":1,}"#,
        br#"{,"a":1}"#,
        br#"{"a" 1}"#,
        br#"{"a":}"#,
        br#"{a:1}"#,
        br#"{"a":tru}"#,
        br#"{"a":truex}"#,
        br#"{"a":nul}"#,
        br#"{"a":01}"#,
        br#"{"a":-}"#,
        br#"{"a":1.}"#,
        br#"{"a":.5}"#,
        br#"{"a":1e}"#,
        br#"{"a":1e+}"#,
        br#"{"a":+1}"#,
        br#"{"a":1.5.3}"#,
        br#"{"a":[1,]}"#,
        br#"{"a":[1 2]}"#,
        br#"{"a":{"k"}}"#,
        br#"{"a":{"k":1,}}"#,
        br#"{"a":{1:1}}"#,
        br#"{"a":[}"#,
        br#"{"a":{]}"#,
        br#"{"a":"\x"}"#,
        br#"{"a":"\u12"}"#,
        br#"{"a":"\u12g4"}"#,
        br#"{"a":"unterminated}"#,
        b"{\"a\":\"tab\there\"}",
        b"{\"a\":\"nl\nhere\"}",
        b"{\"a\":\"\x00\"}",
        b"{\"a\":\"\x1f\"}",
        b"{\"a\":\"\xff\"}",
        b"{\"a\":\"\xc3\"}",
        b"{\"a\":\"\xed\xa0\x80\"}",
        b"{\"\xff\":1}",
        b"{\"a\":1}\x0c",
        b"\x0c{\"a\":1}",
        b"{\"a\":\x0c1}",
        br#"{"\ud800":1}"#,
    ] {
        assert!(
            !agrees(bad),
            "the scan read {:?}",
            String::from_utf8_lossy(bad)
        );
        assert!(
            serde(bad).is_none(),
            "serde read {:?}",
            String::from_utf8_lossy(bad)
        );
    }
}

#[test]
fn escapes_and_stops_at_every_offset_of_a_block() {
    // A quote, backslash, control or non-ASCII byte at each place of the 8 bytes
    // stepped before any block, of the first two 64-byte blocks and their 32-byte
    // halves (and across their edges), the string starting at several alignments; the
    // keys (0-3 bytes) end within the first 8.
    for lead in 0..4 {
        for at in 0..160 {
            for (piece, valid) in [
                (&br#"\""#[..], true),
                (br"\\", true),
                (br"\u00e9", true),
                (br"\n", true),
                ("é".as_bytes(), true),
                ("🦀".as_bytes(), true),
                (b"\x01", false),
                (b"\xe2\x82", false),
                (br"\q", false),
                (br"\u00", false),
            ] {
                let mut body = b"{\"".to_vec();
                body.extend(std::iter::repeat_n(b'k', lead));
                body.extend_from_slice(b"\":\"");
                body.extend(std::iter::repeat_n(b'x', at));
                body.extend_from_slice(piece);
                body.extend(std::iter::repeat_n(b'y', 140));
                body.extend_from_slice(b"\"}");
                assert_eq!(agrees(&body), valid, "{lead} {at} {piece:?}");
                assert_eq!(serde(&body).is_some(), valid, "{lead} {at} {piece:?}");
            }
        }
    }
}

#[test]
fn huge_strings() {
    let prompt = "All work and no play makes Jack a dull boy. ".repeat(30_000);
    let body = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{prompt}"}}],"max_tokens":16}}"#
    );
    assert!(agrees(body.as_bytes()));
    let unicode = "Ünïcødé prompts, 長い文章, and escapes \\\" \\u00e9 \\n. ".repeat(20_000);
    let body = format!(r#"{{"prompt":"{unicode}","stream":false}}"#);
    assert!(agrees(body.as_bytes()));
    // One bad byte deep inside is still found.
    for bad in [b'\x1f', b'\xfe'] {
        let mut b = body.clone().into_bytes();
        let at = b.len() / 2 + 7;
        b[at] = bad;
        assert!(!agrees(&b));
        assert!(serde(&b).is_none());
    }
}

#[test]
fn nesting_past_the_scans_depth_is_left_to_serde() {
    let deep = |n: usize| format!("{{\"a\":{}1{}}}", "[".repeat(n), "]".repeat(n));
    assert!(agrees(deep(super::MAX_DEPTH).as_bytes()));
    let deeper = deep(super::MAX_DEPTH + 1);
    assert!(!agrees(deeper.as_bytes()));
    // serde skips values of any depth, so the body is still read, by the fallback.
    assert!(serde(deeper.as_bytes()).is_some());
    let parsed = crate::body::JsonBody::parse(deeper.as_bytes()).unwrap();
    assert!(parsed.get("a").is_some());
}

/// JSON text of random values, with random whitespace, escapes and non-ASCII text.
fn json_value() -> impl Strategy<Value = String> {
    let ws = prop::sample::select(vec!["", "", "", " ", "\n", "\t ", "\r\n  "]);
    let string = prop::collection::vec(
        prop_oneof![
            4 => "[a-zA-Z0-9 ,.:{}\\[\\]]{0,40}".prop_map(|s| s),
            1 => Just("\\\"".to_owned()),
            1 => Just("\\\\".to_owned()),
            1 => Just("\\/\\b\\f\\n\\r\\t".to_owned()),
            1 => "\\\\u[0-9a-fA-F]{4}".prop_map(|s| s),
            1 => "[é長🦀ü\u{7f}]{1,5}".prop_map(|s| s),
        ],
        0..12,
    )
    .prop_map(|parts| format!("\"{}\"", parts.concat()));
    let number = prop_oneof![
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| format!("{f:e}")),
        Just("-0.0E-0".to_owned()),
        Just("0.125".to_owned()),
    ];
    let leaf = prop_oneof![
        string.clone(),
        number,
        Just("true".to_owned()),
        Just("false".to_owned()),
        Just("null".to_owned()),
    ];
    leaf.prop_recursive(4, 48, 6, move |inner| {
        let ws = ws.clone();
        prop_oneof![
            (
                prop::collection::vec((inner.clone(), ws.clone()), 0..6),
                ws.clone()
            )
                .prop_map(|(items, w)| {
                    let items: Vec<String> = items
                        .into_iter()
                        .map(|(v, w2)| format!("{w}{v}{w2}"))
                        .collect();
                    format!("[{}]", items.join(","))
                }),
            (
                prop::collection::vec((string.clone(), inner, ws.clone()), 0..6),
                ws
            )
                .prop_map(|(items, w)| {
                    let items: Vec<String> = items
                        .into_iter()
                        .map(|(k, v, w2)| format!("{w}{k}{w2}:{w}{v}{w2}"))
                        .collect();
                    format!("{{{}}}", items.join(","))
                }),
        ]
    })
}

/// A random JSON object's text, top-level keys possibly repeated or escaped.
fn json_object() -> impl Strategy<Value = String> {
    let key = prop_oneof![
        "[a-z_]{1,12}".prop_map(|k| format!("\"{k}\"")),
        Just("\"model\"".to_owned()),
        Just("\"m\\u006fdel\"".to_owned()),
        Just("\"a\\\"b\"".to_owned()),
        Just("\"ké\"".to_owned()),
    ];
    prop::collection::vec((key, json_value()), 0..8).prop_map(|fields| {
        let fields: Vec<String> = fields
            .into_iter()
            .map(|(k, v)| format!(" {k} : {v} "))
            .collect();
        format!(" {{{}}} ", fields.join(","))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// On valid objects the scan reads every field where serde does.
    #[test]
    fn fields_agree_with_serde(text in json_object()) {
        prop_assert!(serde(text.as_bytes()).is_some(), "not JSON: {}", text);
        prop_assert!(agrees(text.as_bytes()), "the scan gave up on {}", text);
    }

    /// On damaged objects (a byte replaced, inserted or the text cut) the scan never
    /// accepts what serde refuses, and agrees with it on what it accepts.
    #[test]
    fn damage_is_refused_as_serde_refuses_it(
        text in json_object(),
        at in any::<prop::sample::Index>(),
        byte in prop::sample::select(vec![
            b'"', b'\\', b'{', b'}', b'[', b']', b',', b':', b'0', b'-', b'.', b'e',
            b'u', b'x', b' ', b'\n', b'\x0c', b'\x00', b'\x1f', b'\x80', b'\xc3', b'\xff',
        ]),
        how in 0..3u8,
    ) {
        let mut b = text.into_bytes();
        let i = at.index(b.len().max(1)).min(b.len());
        match how {
            0 if i < b.len() => b[i] = byte,
            1 => b.insert(i, byte),
            _ => b.truncate(i),
        }
        agrees(&b);
    }
}
