//! `JsonBody`'s tests.

use super::*;

fn s(b: &JsonBody) -> String {
    String::from_utf8(b.to_bytes().to_vec()).unwrap()
}

#[test]
fn keeps_order_and_raw_values() {
    let b = JsonBody::parse(br#" { "z": 1.50, "a" : {"x": [1, 2]}, "s": "\u00e9\n", "n": null } "#)
        .unwrap();
    assert_eq!(
        s(&b),
        r#"{"z":1.50,"a":{"x": [1, 2]},"s":"\u00e9\n","n":null}"#
    );
    assert_eq!(b.keys().collect::<Vec<_>>(), ["z", "a", "s", "n"]);
    assert!(b.is_null_or_absent("n"));
    assert!(b.is_null_or_absent("missing"));
    assert!(!b.is_null_or_absent("z"));
}

#[test]
fn duplicate_keys_take_first_position_last_value() {
    let b = JsonBody::parse(br#"{"a":1,"b":2,"a":3}"#).unwrap();
    assert_eq!(s(&b), r#"{"a":3,"b":2}"#);
}

/// The fold as Python's `json` does it, written the plain way: a key keeps the
/// position of its first occurrence and takes the value of its last.
fn python_fold(pairs: &[(String, String)]) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for (k, v) in pairs {
        match out.iter_mut().find(|(ok, _)| ok == k) {
            Some(slot) => slot.1 = v.clone(),
            None => out.push((k.clone(), v.clone())),
        }
    }
    out
}

fn object(pairs: &[(String, String)]) -> String {
    let fields: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}:{v}")).collect();
    format!("{{{}}}", fields.join(","))
}

#[test]
fn many_keys_fold_as_python_does() {
    // Past the index threshold: 1000 fields over 300 distinct keys, repeated out of
    // order, some written with escapes (`"\u006b12"` is `"k12"`).
    let mut pairs = Vec::new();
    for i in 0..1000usize {
        let k = (i * 7919) % 300;
        let key = if i % 11 == 0 {
            format!("\"\\u006b{k}\"")
        } else {
            format!("\"k{k}\"")
        };
        pairs.push((key, i.to_string()));
    }
    let text = object(&pairs);
    let b = JsonBody::parse(text.as_bytes()).unwrap();
    let unescaped: Vec<(String, String)> = pairs
        .iter()
        .map(|(k, v)| (serde_json::from_str::<String>(k).unwrap(), v.clone()))
        .collect();
    let want = python_fold(&unescaped);
    assert_eq!(want.len(), 300);
    assert_eq!(b.keys().count(), 300);
    let got: Vec<(String, String)> = b
        .keys()
        .map(|k| {
            (
                k.to_owned(),
                String::from_utf8(b.get(k).unwrap().to_vec()).unwrap(),
            )
        })
        .collect();
    assert_eq!(got, want);
}

#[test]
fn both_fold_paths_agree_around_the_threshold() {
    // Bodies just below, at and above the threshold, with their first and last keys
    // repeated: the linear fold and the indexed one give the same object.
    for n in [
        INDEX_FROM_KEYS - 1,
        INDEX_FROM_KEYS,
        INDEX_FROM_KEYS + 1,
        200,
    ] {
        let mut pairs: Vec<(String, String)> = (0..n)
            .map(|i| (format!("\"k{i}\""), i.to_string()))
            .collect();
        pairs.push(("\"k0\"".into(), "\"last\"".into()));
        pairs.push((format!("\"k{}\"", n - 1), "null".into()));
        let b = JsonBody::parse(object(&pairs).as_bytes()).unwrap();
        assert_eq!(b.keys().count(), n, "{n}");
        assert_eq!(b.keys().next(), Some("k0"));
        assert_eq!(b.get("k0"), Some(&b"\"last\""[..]), "{n}");
        assert_eq!(b.get(&format!("k{}", n - 1)), Some(&b"null"[..]), "{n}");
        assert_eq!(b.get("k1"), Some(&b"1"[..]), "{n}");
        let unquoted: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.trim_matches('"').to_owned(), v.clone()))
            .collect();
        let want = python_fold(&unquoted);
        let got: Vec<(&str, &[u8])> = b.keys().map(|k| (k, b.get(k).unwrap())).collect();
        let want: Vec<(&str, &[u8])> = want
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_bytes()))
            .collect();
        assert_eq!(got, want, "{n}");
    }
}

#[test]
fn a_smuggled_duplicate_cannot_outlive_removal_among_many_keys() {
    // The safety property behind the fold, past the index threshold: a handoff field
    // sent twice is one field, so removing it once leaves none.
    let mut pairs: Vec<(String, String)> = (0..100)
        .map(|i| (format!("\"f{i}\""), "0".into()))
        .collect();
    pairs.insert(3, ("\"kv_transfer_params\"".into(), "{}".into()));
    pairs.push((
        "\"kv_transfer_params\"".into(),
        r#"{"remote_host":"evil"}"#.into(),
    ));
    let mut b = JsonBody::parse(object(&pairs).as_bytes()).unwrap();
    assert_eq!(b.keys().nth(3), Some("kv_transfer_params"));
    assert!(b.remove("kv_transfer_params").is_some());
    assert!(b.get("kv_transfer_params").is_none());
    assert!(!String::from_utf8_lossy(&b.to_bytes()).contains("evil"));
}

#[test]
fn escaped_keys_round_trip() {
    let b = JsonBody::parse(br#"{"a\"b":1,"\u0041":2}"#).unwrap();
    assert_eq!(s(&b), r#"{"a\"b":1,"A":2}"#);
    assert!(b.get("A").is_some());
}

#[test]
fn rejects_non_objects_and_garbage() {
    assert!(matches!(
        JsonBody::parse(b"[1]"),
        Err(BodyError::NotAnObject)
    ));
    assert!(matches!(
        JsonBody::parse(b"\"x\""),
        Err(BodyError::NotAnObject)
    ));
    assert!(matches!(
        JsonBody::parse(b"{"),
        Err(BodyError::InvalidJson(_))
    ));
    assert!(matches!(
        JsonBody::parse(b"{}x"),
        Err(BodyError::InvalidJson(_))
    ));
    assert!(matches!(
        JsonBody::parse(b""),
        Err(BodyError::InvalidJson(_))
    ));
    assert!(matches!(
        JsonBody::parse(br#"{"a":tru}"#),
        Err(BodyError::InvalidJson(_))
    ));
}

#[test]
fn set_and_remove() {
    let mut b = JsonBody::parse(br#"{"a":1,"b":2}"#).unwrap();
    b.set("a", &"x");
    b.set("c", &serde_json::json!({"k": true}));
    assert_eq!(b.remove("b").as_deref(), Some(&b"2"[..]));
    assert_eq!(s(&b), r#"{"a":"x","c":{"k":true}}"#);
    assert_eq!(b.get_as::<String>("a").unwrap().unwrap(), "x");
    assert!(b.remove("b").is_none());
    let empty = JsonBody::parse(b"{}").unwrap();
    assert_eq!(s(&empty), "{}");
}

#[test]
fn top_level_field_finds_only_top_level_keys() {
    let f = |body: &str, key: &str| {
        top_level_field(&Bytes::from(body.to_owned()), key)
            .map(|v| v.map(|v| String::from_utf8(v.to_vec()).unwrap()))
    };
    let body = r#" {"a": {"k": 1, "s": "}\"k\""}, "list": [[1], {"k": [2]}], "k" : {"x": [1, 2]} , "n": -1.5e3 } "#;
    assert_eq!(f(body, "k").unwrap().as_deref(), Some(r#"{"x": [1, 2]}"#));
    assert_eq!(f(body, "n").unwrap().as_deref(), Some("-1.5e3"));
    assert_eq!(f(body, "missing").unwrap(), None);
    assert_eq!(
        f(r#"{"k\u0041":true}"#, "kA").unwrap().as_deref(),
        Some("true")
    );
    assert_eq!(f(r#"{"k":1,"k":2}"#, "k").unwrap().as_deref(), Some("2"));
    assert_eq!(f("{}", "k").unwrap(), None);
    for bad in [
        r#"{"k":1"#,
        r#"{"k" 1}"#,
        "[1]",
        r#"{"k":{"a":}}"#,
        r#"{"k":1}x"#,
        "",
    ] {
        assert!(f(bad, "k").is_err(), "{bad}");
    }
}

#[test]
fn top_level_read_reads_the_last_value_of_the_key_and_skips_the_rest() {
    // A reader of one JSON number, at the start of what it is given.
    let number = |b: &[u8]| {
        let len = b.iter().take_while(|c| c.is_ascii_digit()).count();
        (len > 0).then(|| (len, b[..len].to_vec()))
    };
    let read = |body: &'static str| {
        top_level_read(&Bytes::from_static(body.as_bytes()), "k", number)
            .map(|v| v.map(|(span, n)| (String::from_utf8(span.to_vec()).unwrap(), n)))
    };
    let (span, n) = read(r#"{"a":{"k":"}"},"k":12 ,"k":345,"z":[1]}"#)
        .unwrap()
        .unwrap();
    assert_eq!((span.as_str(), &n[..]), ("345", &b"345"[..]));
    assert_eq!(read(r#"{"a":1}"#).unwrap(), None);
    // The reader refusing the value makes the answer malformed; a reader that says
    // it took more than there is, too.
    assert!(read(r#"{"k":"x"}"#).is_err());
    let greedy = top_level_read(&Bytes::from_static(br#"{"k":1}"#), "k", |b| {
        Some((b.len() + 1, ()))
    });
    assert!(greedy.is_err());
    // The rest of the object is still checked.
    assert!(read(r#"{"k":1,"x"}"#).is_err());
}

#[test]
fn top_level_read_pair_reads_both_keys_in_one_pass() {
    let number = |b: &[u8]| {
        let len = b.iter().take_while(|c| c.is_ascii_digit()).count();
        (len > 0).then_some((len, len))
    };
    let read = |body: &'static str| {
        top_level_read_pair(
            &Bytes::from_static(body.as_bytes()),
            ("a", number),
            ("b", number),
        )
        .map(|(a, b)| {
            (
                a.map(|(v, n)| (v.to_vec(), n)),
                b.map(|(v, n)| (v.to_vec(), n)),
            )
        })
    };
    let (a, b) = read(r#"{"b":12,"x":{"a":1},"a":345,"b":6}"#).unwrap();
    assert_eq!(a, Some((b"345".to_vec(), 3)));
    assert_eq!(b, Some((b"6".to_vec(), 1)));
    assert_eq!(read(r#"{"x":1}"#).unwrap(), (None, None));
    // Either reader refusing its value makes the answer malformed; so does a bad
    // object after both.
    assert!(read(r#"{"a":1,"b":"x"}"#).is_err());
    assert!(read(r#"{"a":"x","b":1}"#).is_err());
    assert!(read(r#"{"a":1,"b":2,}"#).is_err());
}

#[test]
fn set_raw_replaces_or_appends() {
    let mut b = JsonBody::parse(br#"{"a":1,"k":2}"#).unwrap();
    b.set_raw("k", Bytes::from_static(b"3"));
    b.set_raw("z", Bytes::from_static(b"true"));
    assert_eq!(&b.to_bytes()[..], br#"{"a":1,"k":3,"z":true}"#);
}

#[test]
fn top_level_field_agrees_with_the_full_parse() {
    let body = br#"{"id":"x","choices":[{"index":0,"message":{"content":"a \" } ]"}}],"usage":{"p":1},"kv_transfer_params":{"remote_block_ids":[[1,2]],"remote_host":"h"}}"#;
    let bytes = Bytes::from_static(body);
    let full = JsonBody::parse_bytes(&bytes).unwrap();
    for key in ["id", "choices", "usage", "kv_transfer_params", "nope"] {
        assert_eq!(
            top_level_field(&bytes, key).unwrap(),
            full.get_bytes(key),
            "{key}"
        );
    }
}

#[test]
fn parts_are_the_bytes_with_long_values_as_slices() {
    let input = Bytes::from_static(
        br#"{"model":"m","messages":[{"role":"user","content":"a long, long prompt"}],"a\"b":"0123456789","n":1}"#,
    );
    let mut b = JsonBody::parse_bytes(&input).unwrap();
    b.set("n", &2);
    b.set("tail", &"0123456789");
    let whole = b.to_bytes();
    for slice_from in [0, 1, 10, 11, 60, 1000] {
        let mut parts = Vec::new();
        b.write_parts(slice_from, |p| parts.push(p));
        assert!(parts.iter().all(|p| !p.is_empty()), "{slice_from}");
        assert_eq!(parts.concat(), whole.to_vec(), "{slice_from}");
        // Each value at least `slice_from` long is a piece of its own, pointing
        // into the input (or into its own buffer, for one that was set).
        let messages = b.get_bytes("messages").unwrap();
        let sliced = parts.iter().any(|p| p.as_ptr() == messages.as_ptr());
        assert_eq!(sliced, messages.len() >= slice_from, "{slice_from}");
        if slice_from > messages.len() {
            assert_eq!(parts.len(), 1, "{slice_from}");
        }
    }
    let empty = JsonBody::parse(b"{}").unwrap();
    let mut parts = Vec::new();
    empty.write_parts(0, |p| parts.push(p));
    assert_eq!(parts.concat(), b"{}".to_vec());
}

#[test]
fn values_share_the_input_buffer() {
    let input = Bytes::from_static(br#"{"prompt":"a long prompt"}"#);
    let b = JsonBody::parse_bytes(&input).unwrap();
    let v = b.get_bytes("prompt").unwrap();
    assert_eq!(&v[..], br#""a long prompt""#);
    // Same allocation: the slice points inside the input.
    let start = v.as_ptr() as usize - input.as_ptr() as usize;
    assert_eq!(start, 10);
    // So does the key (it has no escapes).
    let key = &b.fields[0].0;
    assert_eq!(key.as_ptr() as usize - input.as_ptr() as usize, 2);
}

/// A body of more than [`MAX_FIELDS`] top-level fields is refused, duplicates counted,
/// whichever reader reads it (the scan, or serde for what the scan leaves to it: here
/// a value nested deeper than the scan follows), and however far past the ceiling.
#[test]
fn bodies_past_the_field_ceiling_are_refused() {
    let body = |n: usize, dup: bool, deep: bool| {
        let mut pairs: Vec<(String, String)> = (0..n)
            .map(|i| {
                let k = if dup { 0 } else { i };
                (format!("\"k{k}\""), "0".to_owned())
            })
            .collect();
        if deep {
            pairs[0].1 = format!("{}{}", "[".repeat(300), "]".repeat(300));
        }
        object(&pairs)
    };
    for deep in [false, true] {
        let ok = JsonBody::parse(body(MAX_FIELDS, false, deep).as_bytes()).unwrap();
        assert_eq!(ok.keys().count(), MAX_FIELDS);
        for (n, dup) in [
            (MAX_FIELDS + 1, false),
            (MAX_FIELDS + 1, true),
            (200_000, false),
        ] {
            match JsonBody::parse(body(n, dup, deep).as_bytes()) {
                Err(BodyError::TooManyFields { limit }) => assert_eq!(limit, MAX_FIELDS),
                other => panic!("{n} {dup} {deep}: {:?}", other.map(|b| b.keys().count())),
            }
        }
    }
    // Broken JSON past the ceiling is still said to be broken.
    let broken = body(MAX_FIELDS + 10, false, false);
    assert!(matches!(
        JsonBody::parse(&broken.as_bytes()[..broken.len() - 1]),
        Err(BodyError::InvalidJson(_))
    ));
}
