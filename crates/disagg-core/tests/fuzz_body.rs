//! Property tests of the client body parser (`JsonBody`, `PdRequest::new`) and the
//! prefill rewriter against hostile input: arbitrary bytes, arbitrary JSON (deep, huge
//! numbers, lone surrogates), duplicate and escaped keys, invalid UTF-8, wrong field
//! types.
//!
//! Properties: nothing panics; an error is a 4xx with a message; a parsed body is exactly
//! the client's object (last duplicate wins, first position kept); and the prefill body
//! built from it is one JSON object that follows every rule of the rewriter's table and
//! keeps every other field byte for byte, in order.

use std::fmt;

use bytes::Bytes;
use disagg_connectors::vllm::rewrite::PrefillRewriter;
use disagg_core::error::{PdError, error_chain};
use disagg_core::json::BodyError;
use disagg_core::json::JsonBody;
use disagg_core::json::top_level_field;
use disagg_core::request::{Api, PdRequest};
use http::HeaderMap;
use proptest::prelude::*;
use proptest::test_runner::Config;
use serde::Deserialize;
use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

// === the rewriter's documented table (`disagg_core::rewrite`; sources: vllm-project/vllm
// `tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`, ray-project/ray
// `python/ray/llm/_internal/serve/serving_patterns/prefill_decode/pd_server.py`) ===

/// Removed from the prefill leg.
const REMOVED: &[&str] = &[
    "min_tokens",
    "min_completion_tokens",
    "stream_options",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "logprobs",
    "top_logprobs",
    "logprob_token_ids",
    "echo",
    "prompt_logprobs",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_whitespace_pattern",
    "guided_decoding_backend",
    "structural_tag",
];

/// Set to `1` when the client sent them.
const ONE_WHEN_PRESENT: &[&str] = &["n", "best_of"];

/// The handoff and rank fields a client may not send (`disagg_core::request` strips them
/// when it builds a request; vLLM `kv_transfer_params`, SGLang's bootstrap and
/// data-parallel rank fields): restated here, so that a field dropped from the core's
/// list fails these tests.
const HANDOFF_FIELDS: &[&str] = &[
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "routed_dp_rank",
    "data_parallel_rank",
    "disagg_prefill_dp_rank",
    "data_parallel_rank_decode",
    "decode_tp_size",
    "kv_router_hint",
];

/// Keys the generated objects draw from: every field the request path reads or rewrites.
const SPECIAL_KEYS: &[&str] = &[
    "model",
    "stream",
    "max_tokens",
    "max_completion_tokens",
    "stream_options",
    "n",
    "best_of",
    "messages",
    "prompt",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "logprobs",
    "logprob_token_ids",
    "response_format",
    "guided_json",
    "echo",
    "kv_transfer_params",
    "routed_dp_rank",
    "bootstrap_host",
    "bootstrap_room",
    "decode_tp_size",
    "kv_router_hint",
    "temperature",
];

fn config(cases: u32) -> Config {
    Config::with_cases(cases)
}

// === checks ===

/// The top level of a JSON object as `(key, raw value)` pairs, duplicates kept; built
/// with serde_json's own parser, independently of `JsonBody`.
struct Pairs(Vec<(String, Box<RawValue>)>);

impl<'de> Deserialize<'de> for Pairs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Pairs;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Pairs, A::Error> {
                let mut out = Vec::new();
                while let Some(entry) = map.next_entry::<String, Box<RawValue>>()? {
                    out.push(entry);
                }
                Ok(Pairs(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// An error for the client: 400 `invalid_request_body`, with a message.
fn check_error(e: BodyError) {
    assert!(!e.to_string().is_empty());
    let e = PdError::body(e);
    assert!(e.http().status.is_client_error(), "{}", e.http().status);
    assert_eq!(e.http().code, "invalid_request_body");
    assert!(
        error_chain(&e).len() > "invalid request body: ".len(),
        "{e}"
    );
}

/// The prefill body built from `client` follows the rewriter's table exactly.
fn check_prefill(api: Api, client: &JsonBody) {
    let prefill = PrefillRewriter::new().rewrite(api, client).to_bytes();
    let Pairs(pairs) = serde_json::from_slice(&prefill).unwrap_or_else(|e| {
        panic!(
            "prefill body is not a JSON object ({e}): {}",
            String::from_utf8_lossy(&prefill)
        )
    });
    for (i, (k, _)) in pairs.iter().enumerate() {
        assert!(
            pairs[..i].iter().all(|(other, _)| other != k),
            "duplicate `{k}` in the prefill body"
        );
    }
    let get = |k: &str| pairs.iter().find(|(p, _)| p == k).map(|(_, v)| v.get());
    let client_get = |k: &str| client.get(k).map(|v| std::str::from_utf8(v).unwrap());

    assert_eq!(get("max_tokens"), Some("1"));
    match api {
        // Set even when absent: vLLM reads `max_completion_tokens or max_tokens`.
        Api::Chat => assert_eq!(get("max_completion_tokens"), Some("1")),
        // Not a completions field: passes through as sent (the fuzz draws only the
        // two OpenAI APIs the rewriter serves).
        _ => {
            assert_eq!(
                get("max_completion_tokens"),
                client_get("max_completion_tokens")
            )
        }
    }
    assert_eq!(get("stream"), Some("false"));
    assert_eq!(get("ignore_eos"), Some("true"));
    for k in REMOVED.iter().chain(HANDOFF_FIELDS) {
        assert_eq!(get(k), None, "`{k}` reached the prefill body");
    }
    for k in ONE_WHEN_PRESENT {
        assert_eq!(get(k), client.get(k).is_some().then_some("1"), "`{k}`");
    }

    // Everything else is the client's, byte for byte and in the client's order.
    let rewritten = |k: &str| {
        REMOVED.contains(&k)
            || ONE_WHEN_PRESENT.contains(&k)
            || ["max_tokens", "stream", "ignore_eos"].contains(&k)
            || (api == Api::Chat && k == "max_completion_tokens")
    };
    let kept: Vec<&str> = client.keys().filter(|k| !rewritten(k)).collect();
    let kept_out: Vec<&str> = pairs
        .iter()
        .map(|(k, _)| k.as_str())
        .filter(|k| !rewritten(k))
        .collect();
    assert_eq!(
        kept_out, kept,
        "other fields: not the client's, or reordered"
    );
    for k in kept {
        assert_eq!(get(k), client_get(k), "`{k}` changed");
    }
}

/// `top_level_field` agrees with a full parse that succeeded.
fn check_scanner(bytes: &Bytes, body: &JsonBody) {
    for key in body.keys().chain(["model", "absent-key"]) {
        let found = top_level_field(bytes, key)
            .unwrap_or_else(|e| panic!("the scan failed where the full parse worked: {e}"));
        assert_eq!(found, body.get_bytes(key), "`{key}`");
    }
}

/// Every property that holds for any input.
fn check_any(api: Api, bytes: &Bytes) -> Option<PdRequest> {
    match PdRequest::new(api, HeaderMap::new(), bytes) {
        Err(e) => {
            check_error(e);
            // The scanner must not panic either, whatever it answers.
            let _ = top_level_field(bytes, "stream");
            None
        }
        Ok(req) => {
            check_prefill(api, req.body());
            check_scanner(bytes, req.body());
            Some(req)
        }
    }
}

// === generators ===

/// A generated JSON value: its text, and what it is.
#[derive(Clone, Debug)]
struct Json {
    text: String,
    kind: Kind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Null,
    Bool,
    Number,
    /// `valid`: decodes to a Rust string (no lone surrogate).
    Str {
        valid: bool,
    },
    Array,
    Object,
}

fn ws() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec!["", "", "", " ", "\n", "\t", "\r\n  "])
}

/// JSON string text, quotes included: plain characters (any Unicode, no control
/// characters), short escapes, `\u` escapes of any code unit (lone surrogates too) and
/// surrogate pairs.
fn json_string() -> impl Strategy<Value = Json> {
    let piece = prop_oneof![
        6 => any::<char>()
            .prop_filter("needs escaping", |c| *c >= ' ' && *c != '"' && *c != '\\')
            .prop_map(String::from),
        2 => "[a-z ]{1,6}",
        1 => prop::sample::select(vec!["\\n", "\\\"", "\\\\", "\\/", "\\t", "\\b", "\\f", "\\r"])
            .prop_map(String::from),
        1 => any::<u16>().prop_map(|u| format!("\\u{u:04x}")),
        1 => (0xd800u16..0xe000).prop_map(|u| format!("\\u{u:04X}")),
        1 => (0xd800u16..0xdc00, 0xdc00u16..0xe000)
            .prop_map(|(hi, lo)| format!("\\u{hi:04x}\\u{lo:04x}")),
    ];
    prop::collection::vec(piece, 0..8).prop_map(|pieces| {
        let text = format!("\"{}\"", pieces.concat());
        // Whether a lone surrogate is left is serde_json's call: it is what the request
        // path uses to read `model`.
        let valid = serde_json::from_str::<String>(&text).is_ok();
        Json {
            text,
            kind: Kind::Str { valid },
        }
    })
}

fn json_number() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<i64>().prop_map(|n| n.to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| format!("{f:e}")),
        (-1000i32..1000, 0u32..1000).prop_map(|(i, f)| format!("{i}.{f}")),
        prop::sample::select(vec![
            "1e400",
            "-1e400",
            "1.5e-400",
            "123456789012345678901234567890",
            "-123456789012345678901234567890.5e10",
            "18446744073709551616",
            "-9223372036854775809",
            "-0",
            "0.0",
            "1E+2",
            "4.9e-324",
        ])
        .prop_map(String::from),
    ]
}

fn json_leaf() -> impl Strategy<Value = Json> {
    let leaf = |text: &str, kind| Json {
        text: text.to_owned(),
        kind,
    };
    prop_oneof![
        Just(leaf("null", Kind::Null)),
        Just(leaf("true", Kind::Bool)),
        Just(leaf("false", Kind::Bool)),
        json_number().prop_map(|text| Json {
            text,
            kind: Kind::Number,
        }),
        json_string(),
    ]
}

/// Any JSON value, nested a few levels; objects may repeat keys.
fn json_value() -> impl Strategy<Value = Json> {
    json_leaf().prop_recursive(4, 48, 5, |inner| {
        prop_oneof![
            prop::collection::vec((ws(), inner.clone(), ws()), 0..5).prop_map(|items| {
                let items: Vec<String> = items
                    .into_iter()
                    .map(|(a, v, b)| format!("{a}{}{b}", v.text))
                    .collect();
                Json {
                    text: format!("[{}]", items.join(",")),
                    kind: Kind::Array,
                }
            }),
            prop::collection::vec((json_key(), ws(), inner), 0..5).prop_map(|fields| {
                let fields: Vec<String> = fields
                    .into_iter()
                    .map(|(k, w, v)| format!("{}{w}:{w}{}", k.text, v.text))
                    .collect();
                Json {
                    text: format!("{{{}}}", fields.join(",")),
                    kind: Kind::Object,
                }
            }),
        ]
    })
}

/// An object key: the text as written and the key it decodes to.
#[derive(Clone, Debug)]
struct Key {
    text: String,
    decoded: String,
}

fn json_key() -> impl Strategy<Value = Key> {
    let plain = |k: String| Key {
        text: format!("\"{k}\""),
        decoded: k,
    };
    prop_oneof![
        4 => prop::sample::select(SPECIAL_KEYS).prop_map(move |k| plain(k.to_owned())),
        // A special key with its first letter escaped: the same key to a JSON reader,
        // so it must fold with (and be rewritten like) the plain spelling.
        2 => prop::sample::select(SPECIAL_KEYS).prop_map(|k| Key {
            text: format!("\"\\u{:04x}{}\"", u32::from(k.as_bytes()[0]), &k[1..]),
            decoded: k.to_owned(),
        }),
        1 => "[a-z_]{1,8}".prop_map(plain),
        1 => any::<String>().prop_map(|k| Key {
            text: serde_json::to_string(&k).unwrap(),
            decoded: k,
        }),
    ]
}

/// A client object: its fields as written (duplicates possible) and its text.
#[derive(Clone, Debug)]
struct Object {
    fields: Vec<(Key, Json)>,
    text: String,
}

fn field_value() -> impl Strategy<Value = Json> {
    prop_oneof![
        // Well-typed for most fields, so that many bodies parse.
        2 => json_leaf(),
        1 => json_value(),
        1 => Just(Json {
            text: r#"[{"role":"user","content":"hi"}]"#.to_owned(),
            kind: Kind::Array,
        }),
    ]
}

fn json_object() -> impl Strategy<Value = Object> {
    (
        prop::collection::vec((ws(), json_key(), ws(), field_value(), ws()), 0..10),
        ws(),
    )
        .prop_map(|(fields, end)| {
            let text = format!(
                "{end}{{{}{end}}}{end}",
                fields
                    .iter()
                    .map(|(a, k, b, v, c)| format!("{a}{}{b}:{c}{}{a}", k.text, v.text))
                    .collect::<Vec<_>>()
                    .join(",")
            );
            Object {
                fields: fields.into_iter().map(|(_, k, _, v, _)| (k, v)).collect(),
                text,
            }
        })
}

fn api() -> impl Strategy<Value = Api> {
    prop_oneof![Just(Api::Chat), Just(Api::Completions)]
}

/// `bytes` damaged once: cut, a byte inserted or overwritten (invalid UTF-8 among them),
/// or a slice repeated.
fn damaged(bytes: Vec<u8>) -> impl Strategy<Value = Vec<u8>> {
    let len = bytes.len();
    let nasty = prop_oneof![
        any::<u8>().prop_map(|b| vec![b]),
        prop::sample::select(vec![
            vec![0xff],
            vec![0xc0, 0x80],
            vec![0x80],
            vec![0xed, 0xa0, 0x80],
            vec![0xf4, 0x90, 0x80, 0x80],
            vec![0xe2, 0x82],
            vec![0],
            b"\"".to_vec(),
            b"{".to_vec(),
            b"]".to_vec(),
            b"\\".to_vec(),
            b"\\u12".to_vec(),
        ]),
    ];
    (0..=len, 0..=len, nasty, 0u8..4).prop_map(move |(i, j, nasty, how)| {
        let mut b = bytes.clone();
        let (i, j) = (i.min(j), i.max(j));
        match how {
            0 => b.truncate(i),
            1 => {
                b.splice(i..i, nasty);
            }
            2 => {
                b.splice(i..(i + 1).min(len), nasty);
            }
            _ => {
                let slice = b[i..j].to_vec();
                b.splice(j..j, slice);
            }
        }
        b
    })
}

// === the expected outcome of a generated object ===

/// The object a JSON reader sees: duplicates folded (first position, last value).
fn folded(fields: &[(Key, Json)]) -> Vec<(String, Json)> {
    let mut out: Vec<(String, Json)> = Vec::new();
    for (k, v) in fields {
        match out.iter_mut().find(|(o, _)| *o == k.decoded) {
            Some(slot) => slot.1 = v.clone(),
            None => out.push((k.decoded.clone(), v.clone())),
        }
    }
    out
}

/// The field `PdRequest::new` must reject, if any: `model` must be a string or null,
/// then `stream` a boolean or null.
/// Pydantic's lax boolean, as both engines read `stream` (written here independently of
/// the library): `Some(None)` for null, `None` for a value pydantic refuses.
fn lax_bool(text: &str) -> Option<Option<bool>> {
    match serde_json::from_str::<serde_json::Value>(text).ok()? {
        serde_json::Value::Null => Some(None),
        serde_json::Value::Bool(b) => Some(Some(b)),
        serde_json::Value::Number(n) => match n.as_f64()? {
            1.0 => Some(Some(true)),
            0.0 => Some(Some(false)),
            _ => None,
        },
        serde_json::Value::String(s) => match s.to_lowercase().as_str() {
            "1" | "on" | "t" | "true" | "y" | "yes" => Some(Some(true)),
            "0" | "off" | "f" | "false" | "n" | "no" => Some(Some(false)),
            _ => None,
        },
        _ => None,
    }
}

fn rejected_field(object: &[(String, Json)]) -> Option<&'static str> {
    let kind = |k: &str| object.iter().find(|(o, _)| o == k).map(|(_, v)| v.kind);
    let model_ok = matches!(
        kind("model"),
        None | Some(Kind::Null) | Some(Kind::Str { valid: true })
    );
    let stream_ok = object
        .iter()
        .find(|(o, _)| o == "stream")
        .is_none_or(|(_, v)| lax_bool(&v.text).is_some());
    if !model_ok {
        Some("model")
    } else if !stream_ok {
        Some("stream")
    } else {
        None
    }
}

proptest! {
    #![proptest_config(config(2048))]

    #[test]
    fn arbitrary_bytes_never_panic(api in api(), bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        check_any(api, &Bytes::from(bytes));
    }

    #[test]
    fn arbitrary_json_top_levels(api in api(), value in json_value(), pad in ws()) {
        let bytes = Bytes::from(format!("{pad}{}{pad}", value.text));
        let parsed = PdRequest::new(api, HeaderMap::new(), &bytes);
        if value.kind != Kind::Object {
            // Valid JSON, but no object: told apart from malformed JSON.
            prop_assert!(matches!(parsed, Err(BodyError::NotAnObject)), "{parsed:?}");
        }
        check_any(api, &bytes);
    }
}

proptest! {
    #![proptest_config(config(1024))]

    #[test]
    fn objects_parse_exactly_and_rewrite_by_the_table(api in api(), object in json_object()) {
        let bytes = Bytes::from(object.text.clone());
        let expected = folded(&object.fields);
        match (PdRequest::new(api, HeaderMap::new(), &bytes), rejected_field(&expected)) {
            (Err(BodyError::FieldType { field, .. }), Some(want)) => {
                prop_assert_eq!(field, want);
            }
            (Err(e), _) => panic!("rejected ({e}): {}", object.text),
            (Ok(_), Some(want)) => panic!("`{want}` of the wrong type accepted: {}", object.text),
            (Ok(req), None) => {
                // Exactly the client's object, handoff fields removed.
                let want: Vec<(&str, &str)> = expected
                    .iter()
                    .filter(|(k, _)| !HANDOFF_FIELDS.contains(&k.as_str()))
                    .map(|(k, v)| (k.as_str(), v.text.as_str()))
                    .collect();
                let got: Vec<(&str, &str)> = req
                    .body()
                    .keys()
                    .map(|k| (k, std::str::from_utf8(req.body().get(k).unwrap()).unwrap()))
                    .collect();
                prop_assert_eq!(got, want);
                let field = |k: &str| expected.iter().find(|(o, _)| o == k).map(|(_, v)| v);
                let model = field("model")
                    .filter(|v| v.kind != Kind::Null)
                    .map(|v| serde_json::from_str::<String>(&v.text).unwrap());
                prop_assert_eq!(req.model(), model.as_deref());
                let stream = field("stream").and_then(|v| lax_bool(&v.text)).flatten();
                prop_assert_eq!(req.is_stream(), stream == Some(true));
                check_prefill(api, req.body());
                check_scanner(&bytes, req.body());
            }
        }
    }

    #[test]
    fn damaged_objects_never_panic(
        api in api(),
        bytes in json_object().prop_flat_map(|o| damaged(o.text.into_bytes())),
    ) {
        check_any(api, &Bytes::from(bytes));
    }
}

/// Raw invalid UTF-8 inside a string value, or inside a key: rejected, never passed on.
#[test]
fn invalid_utf8_in_strings_is_rejected() {
    for bad in [
        &b"{\"prompt\":\"a\xffb\"}"[..],
        b"{\"prompt\":\"\xc0\x80\"}",
        b"{\"prompt\":\"\xed\xa0\x80\"}",
        b"{\"prompt\":[\"ok\",\"\x80\"]}",
        b"{\"pro\xffmpt\":\"x\"}",
        b"{\"model\":\"m\xfe\"}",
    ] {
        for api in [Api::Chat, Api::Completions] {
            match PdRequest::new(api, HeaderMap::new(), &Bytes::from_static(bad)) {
                Err(e) => check_error(e),
                Ok(r) => panic!("accepted {bad:?}: {:?}", r.body()),
            }
        }
    }
}

/// A lone surrogate escape is JSON a reader may accept as a value (Python does), but no
/// Rust string: as a value it passes through verbatim, as a key or `model` it is a 400.
#[test]
fn lone_surrogates() {
    let ok = Bytes::from_static(br#"{"prompt":"\ud800","user":["\udfff x"]}"#);
    let req = PdRequest::new(Api::Completions, HeaderMap::new(), &ok).unwrap();
    assert_eq!(req.body().get("prompt"), Some(&br#""\ud800""#[..]));
    check_prefill(Api::Completions, req.body());
    for bad in [&br#"{"\ud800":1}"#[..], br#"{"model":"\ud800"}"#] {
        let e = PdRequest::new(Api::Chat, HeaderMap::new(), &Bytes::from_static(bad)).unwrap_err();
        check_error(e);
    }
}

/// 100,000 levels of nesting: an error or a body, never a stack overflow (the test
/// thread has the same 2 MiB stack as a Tokio worker).
#[test]
fn deep_nesting_does_not_overflow_the_stack() {
    const DEPTH: usize = 100_000;
    let open = "[".repeat(DEPTH);
    let close = "]".repeat(DEPTH);
    let objects = format!("{}1{}", r#"{"a":"#.repeat(DEPTH), "}".repeat(DEPTH));
    let inputs = [
        open.clone(),
        format!("{open}{close}"),
        format!(r#"{{"prompt":{open}"#),
        format!(r#"{{"prompt":{open}{close}}}"#),
        format!(r#"{{"model":{open}{close}}}"#),
        format!(r#"{{"prompt":{objects}}}"#),
        objects,
    ];
    for input in inputs {
        let bytes = Bytes::from(input);
        for api in [Api::Chat, Api::Completions] {
            check_any(api, &bytes);
        }
        let _ = JsonBody::parse_bytes(&bytes);
    }
}
