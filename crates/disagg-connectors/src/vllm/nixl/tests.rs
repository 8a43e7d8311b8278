//! The NIXL connector's tests: its legs, the handoff's reading and its property tests.

use std::sync::Arc;

use http::{HeaderMap, StatusCode};

use super::*;
use crate::vllm::reuse::{PromptTokenReuse, ReuseStats};
use disagg_core::endpoint::{Endpoint, Role};
use disagg_core::request::Api;
use disagg_json::JsonBody;

fn route() -> Route {
    Route::new(
        Some(Arc::new(
            Endpoint::new("http://p:1", Role::Prefill).unwrap(),
        )),
        Arc::new(Endpoint::new("http://d:1", Role::Decode).unwrap()),
    )
}

fn req(api: Api, body: &str) -> PdRequest {
    PdRequest::new(api, HeaderMap::new(), &Bytes::from(body.to_owned())).unwrap()
}

fn answer(body: &str) -> PrefillAnswer {
    PrefillAnswer {
        status: StatusCode::OK,
        headers: HeaderMap::new(),
        body: Bytes::from(body.to_owned()),
    }
}

fn text(b: &JsonBody) -> String {
    String::from_utf8(b.to_bytes().to_vec()).unwrap()
}

#[test]
fn golden_chat_stream() {
    let r = req(
        Api::Chat,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":32,"kv_transfer_params":{"remote_host":"evil"}}"#,
    );
    let h = VllmNixl::new().prepare(&route(), &r).unwrap();
    assert_eq!(
        text(&h.prefill.body),
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":false,"max_tokens":1,"max_completion_tokens":1,"ignore_eos":true,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}"#
    );
    assert_eq!(
        text(&h.decode.body),
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":32}"#
    );
    assert_eq!(h.prefill.endpoint.id().as_str(), "http://p:1");
    assert_eq!(h.decode.endpoint.id().as_str(), "http://d:1");
}

#[tokio::test]
async fn complete_copies_params_verbatim() {
    let c = VllmNixl::new();
    let mut h = c
        .prepare(&route(), &req(Api::Completions, r#"{"prompt":"p","n":2}"#))
        .unwrap();
    let params = r#"{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1, 2]],"remote_engine_id":"e","remote_request_id":"r","remote_host":"10.0.0.5","remote_port":5600,"tp_size":8,"future_key":{"x":1.0}}"#;
    let a = answer(&format!(
        r#"{{"id":"x","choices":[],"kv_transfer_params":{params}}}"#
    ));
    assert_eq!(c.complete(&mut h, &a).await.unwrap(), HandoffFound::Handed);
    assert_eq!(
        text(&h.decode.body),
        format!(r#"{{"prompt":"p","n":2,"kv_transfer_params":{params}}}"#)
    );
}

#[tokio::test]
async fn complete_reports_missing_params() {
    let c = VllmNixl::new();
    for body in [
        r#"{"choices":[]}"#,
        r#"{"kv_transfer_params":null}"#,
        r#"{"kv_transfer_params": { } }"#,
    ] {
        let mut h = c
            .prepare(&route(), &req(Api::Completions, r#"{"prompt":"p"}"#))
            .unwrap();
        assert_eq!(
            c.complete(&mut h, &answer(body)).await.unwrap(),
            HandoffFound::Missing
        );
        assert!(h.decode.body.get(KV_TRANSFER_PARAMS).is_none());
    }
    let mut h = c
        .prepare(&route(), &req(Api::Completions, r#"{"prompt":"p"}"#))
        .unwrap();
    assert!(matches!(
        c.complete(&mut h, &answer(r#"{"kv_transfer_params":"x"}"#))
            .await,
        Err(ConnectorError::InvalidHandoff { .. })
    ));
    assert!(matches!(
        c.complete(&mut h, &answer(r#"{"choices":[}"#)).await,
        Err(ConnectorError::InvalidAnswer { .. })
    ));
}

/// The bytes JSON's grammar turns on, and some it refuses.
const GRAMMAR: &[u8] = b"{}[]:,\"\\/ \t\n\r0123456789-+.eEtrufalsnxbu\x00\x1f\x7f";

#[tokio::test]
async fn a_dict_that_is_not_json_is_an_invalid_answer() {
    let c = VllmNixl::new();
    let good = V033.to_owned();
    for bad in [
        good.replace("5600", "05600"),
        good.replace("5600", "56.e0"),
        good.replace("true", "True"),
        good.replace("10.0.0.5", "10.0\\q.5"),
        good.replace("10.0.0.5", "10.0.0\\u00g5"),
        good.replace("10.0.0.5", "10.0.0\n.5"),
        good.replace("\"pull\"", "[1,{\"a\":}]"),
        good.replace("null", "nul"),
        good.replace("\"dcp_size\":1", "\"dcp_size\":-"),
    ] {
        assert_eq!(check_handoff(bad.as_bytes()), Err(None), "{bad}");
        let mut h = c
            .prepare(&route(), &req(Api::Completions, r#"{"prompt":"p"}"#))
            .unwrap();
        let body = format!(r#"{{"choices":[],"kv_transfer_params":{bad}}}"#);
        assert!(
            matches!(
                c.complete(&mut h, &answer(&body)).await,
                Err(ConnectorError::InvalidAnswer { .. })
            ),
            "{bad}"
        );
        assert!(h.decode.body.get(KV_TRANSFER_PARAMS).is_none());
    }
    // Nesting is bounded (the scan recurses): a dict nested deeper than 127 levels,
    // which serde's skipping reader takes, is refused as a handoff, never a crash.
    let nested = |n: usize| format!(r#"{{"x":{}1{}}}"#, "[".repeat(n), "]".repeat(n));
    assert_eq!(
        check_handoff(nested(125).as_bytes()),
        Err(Some("do_remote_prefill is not true"))
    );
    let deep = V033.replace("\"pull\"", &nested(200_000));
    assert!(serde_json::from_str::<serde::de::IgnoredAny>(&deep).is_ok());
    const TOO_DEEP: &str = "kv_transfer_params nests deeper than 127 levels";
    assert_eq!(check_handoff(deep.as_bytes()), Err(Some(TOO_DEEP)));
    let mut h = c
        .prepare(&route(), &req(Api::Completions, r#"{"prompt":"p"}"#))
        .unwrap();
    let body = format!(r#"{{"choices":[],"kv_transfer_params":{deep}}}"#);
    assert_eq!(
        c.complete(&mut h, &answer(&body)).await.unwrap(),
        HandoffFound::Incomplete { problem: TOO_DEEP }
    );
}

/// vLLM 0.33's pull answer (`…/nixl/pull_scheduler.py` `request_finished`).
const V033: &str = r#"{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[12,13,14],[]],"remote_engine_id":"9b1c","remote_request_id":"chatcmpl-1-abcd0123","remote_host":"10.0.0.5","remote_port":5600,"tp_size":8,"dcp_size":1,"pp_size":1,"remote_num_tokens":40,"remote_blocks_expiry_time":null,"remote_registration_generation":3,"transfer_mode":"pull"}"#;

/// The handoff `dict` with `edit` applied to its keys.
fn edited(
    dict: &str,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> String {
    let mut v: serde_json::Value = serde_json::from_str(dict).unwrap();
    edit(v.as_object_mut().unwrap());
    v.to_string()
}

async fn outcome_of(params: &str) -> (HandoffFound, JsonBody) {
    let c = VllmNixl::new();
    let mut h = c
        .prepare(&route(), &req(Api::Completions, r#"{"prompt":"p"}"#))
        .unwrap();
    let a = answer(&format!(r#"{{"id":"x","kv_transfer_params":{params}}}"#));
    let outcome = c.complete(&mut h, &a).await.unwrap();
    (outcome, h.decode.body)
}

#[tokio::test]
async fn complete_dicts_of_every_generation_pass_verbatim() {
    let push = edited(V033, |m| {
        m.insert("transfer_mode".into(), "push".into());
        m.remove("remote_blocks_expiry_time");
        m.remove("remote_registration_generation");
    });
    let flat = r#"{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3],"remote_engine_id":"e","remote_request_id":"r","remote_host":"h","remote_port":5557}"#;
    let unknown = edited(V033, |m| {
        m.insert("a_key_of_vllm_0_40".into(), serde_json::json!({"x": [1.5]}));
    });
    // Odd spacing and key order stay as the engine wrote them.
    let spaced = r#"{ "remote_port" : 1, "remote_host":"h" ,"do_remote_prefill": true,"remote_block_ids":[ [ 0 ] ],"remote_engine_id":"e\u00e9","remote_request_id":"r"}"#;
    for params in [V033, &push, flat, &unknown, spaced] {
        let (outcome, decode) = outcome_of(params).await;
        assert_eq!(outcome, HandoffFound::Handed, "{params}");
        assert_eq!(decode.get(KV_TRANSFER_PARAMS), Some(params.as_bytes()));
    }
}

/// The scan reads what serde reads: escapes inside strings, nesting and odd
/// spacing in skipped keys, and it refuses a cut or malformed dict anywhere.
#[test]
fn the_handoff_scan_steps_over_escapes_and_refuses_cut_dicts() {
    let tricky = edited(V033, |m| {
        m.insert(
            "z".into(),
            serde_json::json!({"q\"]}": ["\\", {"a": [[]]}]}),
        );
        m.insert("remote_request_id".into(), "h\"o\\st".into());
    });
    assert_eq!(check_handoff(tricky.as_bytes()), Ok(()));
    assert_eq!(check_handoff(format!(" \n{V033}\t").as_bytes()), Ok(()));
    for cut in 0..V033.len() {
        assert!(check_handoff(&V033.as_bytes()[..cut]).is_err(), "{cut}");
    }
    for bad in [
        &br#"{"do_remote_prefill":true}x"#[..],
        br#"{"do_remote_prefill" true}"#,
        br#"{"do_remote_prefill":true,}"#,
        br#"["do_remote_prefill"]"#,
        br#"{"remote_block_ids":[1 2]}"#,
    ] {
        assert!(check_handoff(bad).is_err());
    }
    assert_eq!(block_ids(b"[[1,2],[3]]"), Some(3));
    assert_eq!(block_ids(b"[ 1 , 2 ]"), Some(2));
    assert_eq!(block_ids(b"[1.5]"), None);
    assert_eq!(block_ids(b"[18446744073709551616]"), None);
    assert_eq!(block_ids(b"[[1],2]"), None);
    // The compact spelling engines write takes the one-pass reading, with the same
    // verdicts as the step-by-step one.
    assert_eq!(block_ids(b"[7,0,18446744073709551616]"), None);
    assert_eq!(block_ids(b"[7,0,12345678901234567890]"), Some(3));
    assert_eq!(block_ids(b"[7,0,1234567890123456789]"), Some(3));
    assert_eq!(block_ids(b"[01]"), None);
    assert_eq!(block_ids(b"[1,,2]"), None);
    assert_eq!(block_ids(b"[1,2,]"), None);
    assert_eq!(block_ids(b"[]"), Some(0));
}

proptest::proptest! {
    /// No bytes make the scan panic or read past its input.
    #[test]
    fn the_handoff_scan_takes_any_bytes(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)) {
        let _ = check_handoff(&bytes);
        let _ = block_ids(&bytes);
    }

    /// On JSON, the scan decides as a reading of the parsed value does: every
    /// one-byte change of a good dict that is still JSON passes or fails alike.
    #[test]
    fn the_handoff_scan_agrees_with_serde_on_changed_dicts(at in 0usize..400, byte in proptest::prelude::any::<u8>()) {
        let mut bytes = V033.as_bytes().to_vec();
        let at = at % bytes.len();
        bytes[at] = byte;
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&bytes) {
            proptest::prop_assert_eq!(check_handoff(&bytes).is_ok(), takes(&v), "{}", String::from_utf8_lossy(&bytes));
        }
    }

    /// The scan refuses as not JSON exactly what serde_json refuses (the check that
    /// used to run before it): a one- or two-byte change of a good dict, the bytes
    /// drawn from what JSON's grammar turns on.
    #[test]
    fn the_handoff_scan_refuses_what_serde_refuses(
        edits in proptest::collection::vec((0usize..400, proptest::sample::select(GRAMMAR.to_vec())), 1..3),
    ) {
        let mut bytes = V033.replace("10.0.0.5", "10.0.0.5 \\u00e9\\n").into_bytes();
        for (at, byte) in edits {
            let at = at % bytes.len();
            bytes[at] = byte;
        }
        let json = serde_json::from_slice::<serde::de::IgnoredAny>(&bytes).is_ok();
        proptest::prop_assert_eq!(check_handoff(&bytes) != Err(None), json, "{}", String::from_utf8_lossy(&bytes));
    }
}

/// What a vLLM 0.33 decode takes, read from a parsed dict (the module docs' rule).
fn takes(v: &serde_json::Value) -> bool {
    let text = |k: &str| {
        v[k].as_str()
            .is_some_and(|s| !s.is_empty() && !s.chars().any(char::is_control))
    };
    let name = |h: &str| {
        !h.is_empty()
            && h.bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"-._".contains(&c))
    };
    let host = v["remote_host"].as_str().is_some_and(|h| {
        let bare = h.trim_start_matches('[').trim_end_matches(']');
        let bracketed = bare.len() + 2 == h.len() && h.starts_with('[');
        let (addr, zone) = bare.split_once('%').unwrap_or((bare, "x"));
        (1..=255).contains(&h.len())
            && if h.contains(':') {
                (bracketed || bare.len() == h.len())
                    && name(zone)
                    && addr.parse::<std::net::Ipv6Addr>().is_ok()
            } else {
                name(h)
            }
    });
    let ids = |l: &serde_json::Value| {
        l.as_array()
            .filter(|l| l.iter().all(|i| i.as_u64().is_some()))
            .map(Vec::len)
    };
    let blocks = v["remote_block_ids"].as_array().and_then(|l| {
        if l.iter().all(|i| i.is_array()) {
            l.iter().map(ids).sum::<Option<usize>>()
        } else {
            ids(&v["remote_block_ids"])
        }
    });
    let push = v["transfer_mode"] == "push";
    v.is_object()
        && v.get("prompt_token_ids").is_none()
        && v["do_remote_prefill"] == true
        && blocks.is_some_and(|n| n > 0)
        && text("remote_engine_id")
        && text("remote_request_id")
        && v.get("do_remote_decode")
            .is_none_or(|d| *d == serde_json::Value::Bool(false))
        && host
        && v["remote_port"]
            .as_u64()
            .is_some_and(|p| (1..=65535).contains(&p))
        && (!push
            || v["tp_size"]
                .as_u64()
                .is_some_and(|t| t > 0 && t <= u64::from(u32::MAX)))
}

#[tokio::test]
async fn partial_dicts_are_incomplete_and_never_reach_the_decode() {
    use serde_json::json;
    type Edit = fn(&mut serde_json::Map<String, serde_json::Value>);
    let cases: [(&str, Edit, &str); 17] = [
        (
            "no block ids",
            |m| drop(m.remove("remote_block_ids")),
            "remote_block_ids",
        ),
        (
            "null block ids",
            |m| drop(m.insert("remote_block_ids".into(), json!(null))),
            "remote_block_ids",
        ),
        (
            "empty block ids",
            |m| drop(m.insert("remote_block_ids".into(), json!([]))),
            "remote_block_ids",
        ),
        (
            "empty groups",
            |m| drop(m.insert("remote_block_ids".into(), json!([[], []]))),
            "remote_block_ids",
        ),
        (
            "mixed ids and groups",
            |m| drop(m.insert("remote_block_ids".into(), json!([1, [2]]))),
            "remote_block_ids",
        ),
        (
            "negative id",
            |m| drop(m.insert("remote_block_ids".into(), json!([[-1]]))),
            "remote_block_ids",
        ),
        (
            "string ids",
            |m| drop(m.insert("remote_block_ids".into(), json!("1,2"))),
            "remote_block_ids",
        ),
        (
            "no engine id",
            |m| drop(m.remove("remote_engine_id")),
            "remote_engine_id",
        ),
        (
            "empty engine id",
            |m| drop(m.insert("remote_engine_id".into(), json!(""))),
            "remote_engine_id",
        ),
        (
            "no request id",
            |m| drop(m.remove("remote_request_id")),
            "remote_request_id",
        ),
        ("no host", |m| drop(m.remove("remote_host")), "remote_host"),
        (
            "null host",
            |m| drop(m.insert("remote_host".into(), json!(null))),
            "remote_host",
        ),
        ("no port", |m| drop(m.remove("remote_port")), "remote_port"),
        (
            "port out of range",
            |m| drop(m.insert("remote_port".into(), json!(70000))),
            "remote_port",
        ),
        (
            "port as a string",
            |m| drop(m.insert("remote_port".into(), json!("5600"))),
            "remote_port",
        ),
        (
            "not a remote prefill",
            |m| drop(m.insert("do_remote_prefill".into(), json!(false))),
            "do_remote_prefill",
        ),
        (
            "push without tp_size",
            |m| {
                m.insert("transfer_mode".into(), json!("push"));
                m.remove("tp_size");
            },
            "tp_size",
        ),
    ];
    for (what, edit, field) in cases {
        let params = edited(V033, edit);
        let (outcome, decode) = outcome_of(&params).await;
        match outcome {
            HandoffFound::Incomplete { problem } => {
                assert!(problem.starts_with(field), "{what}: {problem}")
            }
            other => panic!("{what}: {other:?}"),
        }
        assert!(decode.get(KV_TRANSFER_PARAMS).is_none(), "{what}");
    }
    // The same check for an answer whose dict is not an object of the right keys.
    assert!(check_handoff(br#"{"do_remote_prefill":1}"#).is_err());
    assert!(check_handoff(br#"{"do_remote_prefill":true,"do_remote_prefill":true}"#).is_err());
}

#[test]
fn needs_a_prefill_endpoint() {
    let mut r = route();
    r.prefill = None;
    assert!(matches!(
        VllmNixl::new().prepare(&r, &req(Api::Completions, "{}")),
        Err(ConnectorError::NeedsPrefill { .. })
    ));
}

#[test]
fn sglang_generate_is_not_carried() {
    let err = VllmNixl::new()
        .prepare(&route(), &req(Api::Generate, r#"{"text":"hi"}"#))
        .unwrap_err();
    assert!(matches!(err, ConnectorError::Unsupported { .. }), "{err}");
    let pd = disagg_core::error::PdError::connector(disagg_core::error::Side::Prefill, err);
    assert_eq!(
        (pd.http().status.as_u16(), pd.http().code),
        (400, "unsupported_by_connector")
    );
}

/// A NIXL connector with prompt-token reuse `mode`, at most `max` ids, and its counters.
fn reusing(mode: PromptTokenReuse, max: usize) -> (VllmNixl, Arc<ReuseStats>) {
    let stats = Arc::new(ReuseStats::default());
    let c = VllmNixl::new()
        .with_prompt_token_reuse(mode, Arc::clone(&stats))
        .with_max_reused_ids(max);
    (c, stats)
}

/// A route whose decode reports `version` (as `serve` records a probed `/version`).
fn route_with_version(version: &str) -> Route {
    use disagg_core::endpoint::Facts;
    let facts = Facts::default()
        .with(Facts::ENGINE_VERSION, version)
        .unwrap();
    Route::new(
        Some(Arc::new(
            Endpoint::new("http://p:1", Role::Prefill).unwrap(),
        )),
        Arc::new(
            Endpoint::new("http://d:1", Role::Decode)
                .unwrap()
                .with_facts(facts),
        ),
    )
}

const CHAT: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":8}"#;

#[tokio::test]
async fn reuse_asks_the_prefill_for_ids_and_splices_them_into_the_decode_dict() {
    let (c, stats) = reusing(PromptTokenReuse::On, 8);
    let mut h = c.prepare(&route(), &req(Api::Chat, CHAT)).unwrap();
    assert_eq!(h.prefill.body.get("return_token_ids"), Some(&b"true"[..]));
    // The client's body, unchanged, on the decode leg.
    assert_eq!(h.decode.body.get("return_token_ids"), None);
    let a = answer(&format!(
        r#"{{"id":"x","prompt_token_ids":[17, 4,99],"choices":[],"kv_transfer_params":{V033}}}"#
    ));
    assert_eq!(c.complete(&mut h, &a).await.unwrap(), HandoffFound::Handed);
    let want = format!(
        "{},\"prompt_token_ids\":[17, 4,99]}}",
        &V033[..V033.len() - 1]
    );
    assert_eq!(
        h.decode.body.get("kv_transfer_params"),
        Some(want.as_bytes())
    );
    assert_eq!((stats.sent(), stats.refused()), (1, 0));
}

#[tokio::test]
async fn malformed_or_oversized_ids_are_dropped_and_counted_never_fatal() {
    for ids in [
        "[1,2,3,4]",
        "[-1]",
        "[]",
        "[1.5]",
        "\"1 2\"",
        "[4294967296]",
        "{}",
    ] {
        let (c, stats) = reusing(PromptTokenReuse::On, 3);
        let mut h = c.prepare(&route(), &req(Api::Chat, CHAT)).unwrap();
        let a = answer(&format!(
            r#"{{"prompt_token_ids":{ids},"kv_transfer_params":{V033}}}"#
        ));
        assert_eq!(
            c.complete(&mut h, &a).await.unwrap(),
            HandoffFound::Handed,
            "{ids}"
        );
        assert_eq!(
            h.decode.body.get("kv_transfer_params"),
            Some(V033.as_bytes())
        );
        assert_eq!((stats.sent(), stats.refused()), (0, 1), "{ids}");
    }
}

#[tokio::test]
async fn reuse_is_off_for_other_apis_old_decodes_and_when_turned_off() {
    let cases = [
        (
            PromptTokenReuse::On,
            route(),
            Api::Completions,
            r#"{"prompt":"p"}"#,
        ),
        (PromptTokenReuse::Off, route(), Api::Chat, CHAT),
        (PromptTokenReuse::Auto, route(), Api::Chat, CHAT),
        (
            PromptTokenReuse::Auto,
            route_with_version("0.32.1"),
            Api::Chat,
            CHAT,
        ),
    ];
    for (mode, route, api, body) in cases {
        let (c, stats) = reusing(mode, 8);
        let mut h = c.prepare(&route, &req(api, body)).unwrap();
        assert_eq!(
            h.prefill.body.get("return_token_ids"),
            None,
            "{mode:?} {api:?}"
        );
        let a = answer(&format!(
            r#"{{"prompt_token_ids":[1],"kv_transfer_params":{V033}}}"#
        ));
        c.complete(&mut h, &a).await.unwrap();
        assert_eq!(
            h.decode.body.get("kv_transfer_params"),
            Some(V033.as_bytes())
        );
        assert_eq!(stats.sent(), 0);
    }
    let (c, _) = reusing(PromptTokenReuse::Auto, 8);
    let h = c
        .prepare(&route_with_version("0.33.0"), &req(Api::Chat, CHAT))
        .unwrap();
    assert_eq!(h.prefill.body.get("return_token_ids"), Some(&b"true"[..]));
}

#[tokio::test]
async fn a_prefill_dict_carrying_prompt_token_ids_never_reaches_the_decode() {
    let (c, stats) = reusing(PromptTokenReuse::Off, 8);
    let mut h = c.prepare(&route(), &req(Api::Chat, CHAT)).unwrap();
    let forged = format!("{},\"prompt_token_ids\":[6]}}", &V033[..V033.len() - 1]);
    let a = answer(&format!(r#"{{"kv_transfer_params":{forged}}}"#));
    assert!(matches!(
        c.complete(&mut h, &a).await.unwrap(),
        HandoffFound::Incomplete { .. }
    ));
    assert_eq!(h.decode.body.get("kv_transfer_params"), None);
    assert_eq!(stats.sent(), 0);
}

/// `V033` with `extra` (`,"key":value` members) added after its last member.
fn v033_with(extra: &str) -> String {
    format!("{}{extra}}}", &V033[..V033.len() - 1])
}

/// A key spelled with escapes is read as the decode's parser reads it (Python's `json`
/// decodes it, and keeps the last of repeated keys): a second, escaped spelling of a key
/// the check reads is a repeat, never a key the check does not see.
#[tokio::test]
async fn escaped_keys_are_read_decoded_and_their_repeats_refused() {
    for extra in [
        r#","remote_block_id\u0073":[]"#,
        r#","remote_\u0070ort":"x""#,
        r#","\u0072emote_host":"""#,
        r#","do_remote_prefil\u006c":false"#,
    ] {
        let params = v033_with(extra);
        let (outcome, decode) = outcome_of(&params).await;
        assert_eq!(
            outcome,
            HandoffFound::Incomplete {
                problem: "kv_transfer_params repeats a key"
            },
            "{params}"
        );
        assert!(decode.get(KV_TRANSFER_PARAMS).is_none(), "{params}");
    }
    // An escaped value the rules read is read decoded too: push mode without `tp_size`.
    let push = V033
        .replace(
            r#""transfer_mode":"pull""#,
            r#""transfer_mode":"pus\u0068""#,
        )
        .replace(r#""tp_size":8,"#, "");
    assert!(push.contains("pus\\u0068") && !push.contains("tp_size"));
    let (outcome, decode) = outcome_of(&push).await;
    assert!(
        matches!(outcome, HandoffFound::Incomplete { problem } if problem.starts_with("tp_size")),
        "{outcome:?}"
    );
    assert!(decode.get(KV_TRANSFER_PARAMS).is_none());
    // The forbidden key, spelled with escapes, is the forbidden key.
    let forged = v033_with(r#","prompt_token_id\u0073":[6]"#);
    let (outcome, decode) = outcome_of(&forged).await;
    assert!(
        matches!(outcome, HandoffFound::Incomplete { problem } if problem.contains("prompt_token_ids")),
        "{outcome:?}"
    );
    assert!(decode.get(KV_TRANSFER_PARAMS).is_none());
    // A required key spelled with escapes is that key: read, checked and passed on.
    let escaped = V033.replace("\"remote_port\"", r#""remote\u005fport""#);
    let (outcome, decode) = outcome_of(&escaped).await;
    assert_eq!(outcome, HandoffFound::Handed);
    assert_eq!(decode.get(KV_TRANSFER_PARAMS), Some(escaped.as_bytes()));
    let bad = V033.replace("\"remote_port\":5600", r#""remote\u005fport":"x""#);
    assert!(matches!(
        outcome_of(&bad).await.0,
        HandoffFound::Incomplete { problem } if problem.starts_with("remote_port")
    ));
    // A key no text is (a lone surrogate) is refused, not guessed at.
    let lone = v033_with(r#","\ud800":1"#);
    assert!(matches!(
        outcome_of(&lone).await.0,
        HandoffFound::Incomplete { .. }
    ));
    // Unknown keys with escapes pass, as before.
    let unknown = v033_with(r#","x\u00e9\n":1"#);
    assert_eq!(outcome_of(&unknown).await.0, HandoffFound::Handed);
}

/// A prefill's dict telling the decode to keep its blocks for a remote decode
/// (`do_remote_decode` true) never reaches the decode: a decode given it would hold the
/// request's blocks until vLLM's abort timeout.
#[tokio::test]
async fn a_prefill_dict_asking_for_a_remote_decode_never_reaches_the_decode() {
    for value in ["true", "1", "\"yes\"", "null"] {
        let params = V033.replace(
            "\"do_remote_decode\":false",
            &format!("\"do_remote_decode\":{value}"),
        );
        assert_ne!(params, V033);
        let (outcome, decode) = outcome_of(&params).await;
        assert!(
            matches!(outcome, HandoffFound::Incomplete { problem } if problem.starts_with("do_remote_decode")),
            "{value}: {outcome:?}"
        );
        assert!(decode.get(KV_TRANSFER_PARAMS).is_none(), "{value}");
    }
    // Absent or false, it passes.
    let absent = V033.replace("\"do_remote_decode\":false,", "");
    assert_eq!(outcome_of(&absent).await.0, HandoffFound::Handed);
    assert_eq!(outcome_of(V033).await.0, HandoffFound::Handed);
}

/// The side channel's address and the ids are checked as the decode uses them: a host
/// is a host name or an IP literal, an id holds no control character, a port is 1 to
/// 65535.
#[tokio::test]
async fn hosts_ids_and_ports_the_decode_cannot_use_are_refused() {
    use serde_json::json;
    let cases = [
        ("remote_host", json!("\u{0}")),
        ("remote_host", json!("a b")),
        ("remote_host", json!("h\n")),
        ("remote_host", json!("h\t")),
        ("remote_host", json!("h/x")),
        ("remote_host", json!("h\u{e9}")),
        ("remote_host", json!("x".repeat(256))),
        ("remote_host", json!("evil:1234")),
        ("remote_host", json!("a]b")),
        ("remote_host", json!("%")),
        ("remote_host", json!("[::1")),
        ("remote_host", json!("[node]")),
        ("remote_host", json!("fe80::1%")),
        ("remote_engine_id", json!("e\u{0}")),
        ("remote_engine_id", json!("e\n")),
        ("remote_engine_id", json!("e\u{7f}")),
        ("remote_engine_id", json!("e\u{85}")),
        ("remote_request_id", json!("r\r")),
        ("remote_port", json!(0)),
    ];
    for (key, value) in cases {
        let params = edited(V033, |m| drop(m.insert(key.into(), value.clone())));
        let (outcome, decode) = outcome_of(&params).await;
        assert!(
            matches!(outcome, HandoffFound::Incomplete { problem } if problem.starts_with(key)),
            "{params}: {outcome:?}"
        );
        assert!(decode.get(KV_TRANSFER_PARAMS).is_none(), "{params}");
    }
    for (key, value) in [
        ("remote_host", json!("prefill-0.svc.cluster.local")),
        ("remote_host", json!("localhost")),
        ("remote_host", json!("[fe80::1%eth0]")),
        ("remote_host", json!("::1")),
        ("remote_host", json!("[::1]")),
        ("remote_host", json!("fe80::1%eth0")),
        ("remote_host", json!("10.0.0.5")),
        ("remote_host", json!("node_7")),
        ("remote_engine_id", json!("e\u{e9}\"\\/")),
        ("remote_port", json!(1)),
        ("remote_port", json!(65535)),
    ] {
        let params = edited(V033, |m| drop(m.insert(key.into(), value.clone())));
        assert_eq!(
            outcome_of(&params).await.0,
            HandoffFound::Handed,
            "{params}"
        );
    }
}

/// What the connector's check decides for a completions request with `prompt`.
fn decided(prompt: &str) -> Decision {
    let body = format!(r#"{{"model":"m","prompt":{prompt},"max_tokens":32}}"#);
    VllmNixl::new()
        .check(&req(Api::Completions, &body))
        .unwrap()
}

/// A completions request of several prompts runs them all on the prefill, whose answer
/// carries prompt 0's handoff only (vLLM 0.33 `final_res_batch[0]`): it is served on one
/// engine. A list of one prompt is one prompt, and stays disaggregated.
#[test]
fn several_completions_prompts_are_served_on_one_engine() {
    let direct = Decision::Direct { reason: "batch" };
    for several in [r#"["A","B"]"#, "[[1,2],[3]]", r#"[ "A" , "B" , "C" ]"#] {
        assert_eq!(decided(several), direct, "{several}");
    }
    for one in [r#""A""#, r#"["A"]"#, "[[1,2]]", "[1,2,3]", "[ [1] ]"] {
        assert_eq!(decided(one), Decision::Disaggregate, "{one}");
    }
    // Chat has one prompt, whatever its messages.
    let chat =
        r#"{"model":"m","messages":[{"role":"user","content":"a"},{"role":"user","content":"b"}]}"#;
    assert_eq!(
        VllmNixl::new().check(&req(Api::Chat, chat)).unwrap(),
        Decision::Disaggregate
    );
}

/// The release leg of a Messages request with an enabled `thinking` block: the decode's
/// body at one token, whose `kv_transfer_params` (the prefill's answer) hold no truthy
/// `do_remote_decode`, so vLLM 0.33 would check `budget_tokens < max_tokens` (1) and
/// answer 400, releasing nothing. The block is dropped there; the rest is the prefill
/// rewrite.
#[test]
fn the_release_leg_of_a_messages_request_drops_an_enabled_thinking_block() {
    let handoff = r#"{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1],"remote_engine_id":"e","remote_request_id":"r","remote_host":"h","remote_port":5}"#;
    let release = |thinking: &str| {
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"max_tokens":300,"thinking":{thinking},"kv_transfer_params":{handoff}}}"#
        );
        let leg = Leg::new(route().decode, JsonBody::parse(body.as_bytes()).unwrap());
        let out = VllmNixl::new().release_leg(Api::Messages, &leg).unwrap();
        JsonBody::parse(&out[..]).unwrap()
    };
    let out = release(r#"{"type":"enabled","budget_tokens":100}"#);
    assert_eq!(out.get("thinking"), None, "{}", text(&out));
    assert_eq!(out.get("max_tokens"), Some(&b"1"[..]));
    assert_eq!(out.get("kv_transfer_params"), Some(handoff.as_bytes()));
    // A block vLLM does not check is left as the client wrote it.
    let disabled = r#"{"type":"disabled"}"#;
    assert_eq!(release(disabled).get("thinking"), Some(disabled.as_bytes()));
}
