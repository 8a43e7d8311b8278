use disagg_json::raw;
use serde_json::Value;

use super::*;
use crate::request::Api;
use head::FirstChunk;

/// The header as a chunk the proxy writes holds it, read back.
fn head_value(head: &Head) -> Value {
    let mut out = Vec::new();
    let mut o = raw::Object::open(&mut out);
    head.write(&mut o);
    o.close();
    serde_json::from_slice(&out).unwrap()
}

#[test]
fn ids_are_found_in_choices_and_at_the_top_never_in_text() {
    let data = br#"{"id":"x","choices":[{"index":0,"text":"\"token_ids\":[9]","prompt_token_ids":[1, 2],"token_ids":[3]}],"prompt_token_ids":null}"#;
    let key = memchr::memmem::Finder::new(IDS_KEY);
    let next_ids = |data, at| next_ids(&key, data, at);
    let (k, s, e) = next_ids(data, 0).unwrap();
    assert_eq!(k, IdsKey::Prompt);
    assert_eq!(parse_ids(&data[s..e]), Some(vec![1, 2]));
    let (k, s2, e2) = next_ids(data, e).unwrap();
    assert_eq!(k, IdsKey::Generated);
    assert_eq!(parse_ids(&data[s2..e2]), Some(vec![3]));
    assert!(next_ids(data, e2).is_none());
    assert_eq!(parse_ids(b"[1,-2]"), None);
    assert_eq!(parse_ids(b"[4294967296]"), None);
    assert_eq!(parse_ids(b"[]"), Some(vec![]));
}

/// A usage chunk's usage is an object, however spaced (`"usage": {`, as a JSON
/// serializer with spaces writes it); `null` and a key inside a text are none.
#[test]
fn a_usage_is_found_however_spaced_never_in_text() {
    let key = memchr::memmem::Finder::new(scan::USAGE_KEY);
    let has = |data: &str| scan::has_usage(&key, data.as_bytes());
    for set in [
        r#"{"choices":[],"usage":{"prompt_tokens":3}}"#,
        r#"{"choices": [], "usage": {"prompt_tokens": 3}}"#,
        "{\"usage\" :\n\t{}}",
        r#"{"choices":[{"text":"\"usage\""}],"usage":{}}"#,
    ] {
        assert!(has(set), "{set}");
    }
    for unset in [
        r#"{"choices":[],"usage":null}"#,
        r#"{"choices":[], "usage" : null}"#,
        r#"{"choices":[{"text":"\"usage\":{}"}]}"#,
        r#"{"choices":[{"text":"say \"usage","finish_reason":null}]}"#,
        r#"{"choices":[],"usage":"#,
        "",
    ] {
        assert!(!has(unset), "{unset}");
    }
}

/// A set finish reason is a string (vLLM's) or an object (SGLang's), however spaced;
/// `null`, a key inside a text, and a text ending in the key's name are none.
#[test]
fn a_finish_reason_is_found_set_however_spaced_never_in_text() {
    let has = |data: &str| scan::has_finish(data.as_bytes());
    for set in [
        r#"{"choices":[{"index":0,"finish_reason":"stop"}]}"#,
        r#"{"choices":[{"index":0,"finish_reason" :	"length"}]}"#,
        "{\"finish_reason\":\n \"stop\"}",
        r#"{"meta_info":{"finish_reason":{"type":"length","length":4}}}"#,
        r#"{"meta_info":{"finish_reason" : {"type":"stop"}}}"#,
        r#"{"choices":[{"finish_reason":null},{"finish_reason":"stop"}]}"#,
    ] {
        assert!(has(set), "{set}");
    }
    for unset in [
        r#"{"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}"#,
        r#"{"choices":[{"index":0,"finish_reason" : null}]}"#,
        r#"{"choices":[{"delta":{"content":"\"finish_reason\":\"stop\""}}]}"#,
        r#"{"choices":[{"text":"say \"finish_reason","finish_reason":null}]}"#,
        r#"{"choices":[],"usage":{"prompt_tokens":3}}"#,
        r#"{"choices":[{"finish_reason":"#,
        "",
    ] {
        assert!(!has(unset), "{unset}");
    }
    assert!(scan::is_done(b"data: [DONE]\n\n"));
    assert!(scan::is_done(b"data:[DONE]\n\n"));
    assert!(!scan::is_done(b"data: {\"x\":\"[DONE]\"}\n\n"));
}

#[test]
fn an_event_ends_at_its_blank_line_and_a_cut_one_waits() {
    assert_eq!(event_end(b"data: {}\n\ndata: x"), Some(10));
    assert_eq!(event_end(b"data: {}\ndata: x\n\n"), Some(18));
    assert_eq!(event_end(b"data: {}\n"), None);
    assert_eq!(event_end(b"data: {\"a\":\"\\n\\n\"}\n"), None);
    assert_eq!(event_end(b""), None);
    assert_eq!(event_end(b"\n\n"), Some(2));
}

/// The caller's walk over what [`Held::push`] gives: the whole events, in order; the
/// rest held.
fn walk(held: &mut Held, data: &[u8]) -> Vec<Bytes> {
    let Some(mut src) = held.push(Bytes::copy_from_slice(data)) else {
        return Vec::new();
    };
    let mut events = Vec::new();
    while let Some(end) = event_end(&src) {
        events.push(src.split_to(end));
    }
    held.hold(&src);
    events
}

#[test]
fn a_cut_event_is_held_and_each_frame_scanned_once() {
    // An end straddling two frames is found.
    let mut held = Held::default();
    assert!(walk(&mut held, b"data: a\n\ndata: b\n").len() == 1);
    assert_eq!(
        walk(&mut held, b"\ndata: c"),
        vec![Bytes::from_static(b"data: b\n\n")]
    );
    assert_eq!(held.take().as_ref(), b"data: c");

    // One event of 64 KiB, a byte per frame: held whole until its end, and the bytes
    // copied and scanned are a few times its length (a rescan of all that is held per
    // frame would be its length squared over two: two billion).
    // Every other byte a line end, so each byte frame is one `memchr` hit.
    let event = format!("data: {}y\n\n", "x\n".repeat(32 << 10));
    let mut held = Held::default();
    let mut out = Vec::new();
    for b in event.as_bytes().chunks(1) {
        let got = walk(&mut held, b);
        assert!(out.is_empty() || got.is_empty(), "one event, given once");
        out.extend(got);
    }
    assert!(
        out.len() == 1 && out[0] == event.as_bytes(),
        "the event, once and whole"
    );
    assert!(held.is_empty());
    assert!(
        held.work < 4 * event.len(),
        "{} bytes of work for an event of {}",
        held.work,
        event.len()
    );
}

#[test]
fn the_first_chunk_is_read_for_its_header_and_prompt_ids_only() {
    let read = |data: &[u8]| {
        let first: FirstChunk<'_> = serde_json::from_slice(data).ok()?;
        let head = Head::of(&first);
        Some((head_value(&head), first.prompt()))
    };
    // Chat: the ids at the top; a key inside a string is text, not a key.
    let (head, ids) = read(
        br#"{"id":"c-1","object":"chat.completion.chunk","created":7,"model":"m\"prompt_token_ids\":[9]","choices":[{"index":0,"delta":{"role":"assistant","content":"\"prompt_token_ids\":[8]"}}],"prompt_token_ids":[1, 2,3]}"#,
    )
    .unwrap();
    assert_eq!(
        head,
        serde_json::json!({"id": "c-1", "object": "chat.completion.chunk", "created": 7, "model": "m\"prompt_token_ids\":[9]"})
    );
    assert_eq!(ids, Some(vec![1, 2, 3]));
    // Completions: on the first choice (the top one null); absent fields are null.
    let (head, ids) =
        read(br#"{"id":"x","prompt_token_ids":null,"choices":[{"text":"a","prompt_token_ids":[4294967295]},{"prompt_token_ids":[5]}]}"#)
            .unwrap();
    assert_eq!(
        head,
        serde_json::json!({"id": "x", "object": null, "created": null, "model": null})
    );
    assert_eq!(ids, Some(vec![u32::MAX]));
    // Hostile: ids past u32, not integers, nested, a cut chunk, no ids at all.
    assert_eq!(
        read(br#"{"prompt_token_ids":[4294967296]}"#).unwrap().1,
        None
    );
    assert_eq!(read(br#"{"prompt_token_ids":[1.0]}"#).unwrap().1, None);
    assert_eq!(read(br#"{"prompt_token_ids":[[1]]}"#).unwrap().1, None);
    assert_eq!(read(br#"{"prompt_token_ids":"[1]"}"#).unwrap().1, None);
    assert_eq!(read(br#"{"choices":[]}"#).unwrap().1, None);
    assert_eq!(
        read(br#"{"choices":{"prompt_token_ids":[1]}}"#).unwrap().1,
        None
    );
    assert!(read(br#"{"id":"x","prompt_token_ids":[1,2"#).is_none());
    assert!(read(br#"[1,2]"#).is_none_or(|(_, ids)| ids.is_none()));
    // Only the first choice is read: the others are walked, not built (an engine's
    // chunk of a million `{}` choices after it is no million maps).
    let many = format!(
        r#"{{"choices":[{{"prompt_token_ids":[6]}},{}]}}"#,
        vec!["{}"; 1_000_000].join(",")
    );
    assert_eq!(read(many.as_bytes()).unwrap().1, Some(vec![6]));
}

#[test]
fn ids_are_read_in_one_pass_and_a_bad_list_leaves_nothing_behind() {
    let mut ids = vec![7];
    assert_eq!(parse_ids_into(b"[ 1 ,2,  3 ]", &mut ids), Some(()));
    assert_eq!(ids, [7, 1, 2, 3]);
    for bad in [
        &b"[1,2,4294967296]"[..],
        b"[1,,2]",
        b"[1,]",
        b"[+1]",
        b"[1e3]",
        b"[1 2]",
        b"[1",
        b"1]",
        b"[\"1\"]",
        b"[99999999999999999999999]",
    ] {
        assert_eq!(parse_ids_into(bad, &mut ids), None, "{bad:?}");
        assert_eq!(ids, [7, 1, 2, 3], "{bad:?}");
    }
    assert_eq!(parse_ids_into(b"[4294967295, 0]", &mut ids), Some(()));
    assert_eq!(ids, [7, 1, 2, 3, u32::MAX, 0]);
}

fn request(api: Api, body: serde_json::Value) -> PdRequest {
    let bytes = Bytes::from(body.to_string());
    PdRequest::new(api, http::HeaderMap::new(), &bytes).unwrap()
}

#[test]
fn eligibility_is_decided_from_the_body() {
    let on = MigrationConfig {
        limit: 1,
        ..MigrationConfig::default()
    };
    let chat = |extra: serde_json::Value| {
        let mut body = serde_json::json!({"messages": [], "stream": true, "max_tokens": 64});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        request(Api::Chat, body)
    };
    let yes = |r: &PdRequest| plan(&on, r).is_some();
    assert!(yes(&chat(serde_json::json!({}))));
    assert!(plan(&MigrationConfig::default(), &chat(serde_json::json!({}))).is_none());
    assert!(!yes(&chat(serde_json::json!({"stream": false}))));
    for refused in [
        serde_json::json!({"response_format": {"type": "json_object"}}),
        serde_json::json!({"response_format": {"type": "json_schema", "json_schema": {"name": "text"}}}),
        serde_json::json!({"guided_json": {}}),
        serde_json::json!({"tools": [{"type": "function"}]}),
        serde_json::json!({"n": 2}),
        serde_json::json!({"best_of": 3}),
        serde_json::json!({"use_beam_search": true}),
        serde_json::json!({"logprobs": true}),
        serde_json::json!({"seed": 7}),
        serde_json::json!({"stream_options": {"continuous_usage_stats": true}}),
    ] {
        assert!(!yes(&chat(refused.clone())), "{refused}");
    }
    for allowed in [
        serde_json::json!({"response_format": {"type": "text"}}),
        serde_json::json!({"tools": null, "n": 1, "logprobs": false, "seed": null}),
    ] {
        assert!(yes(&chat(allowed.clone())), "{allowed}");
    }
    let seeded = MigrationConfig {
        allow_seed: true,
        ..on.clone()
    };
    assert!(plan(&seeded, &chat(serde_json::json!({"seed": 7}))).is_some());
    let completion = |prompt: serde_json::Value| {
        request(
            Api::Completions,
            serde_json::json!({"prompt": prompt, "stream": true}),
        )
    };
    assert!(yes(&completion(serde_json::json!("text"))));
    assert!(yes(&completion(serde_json::json!([1, 2, 3]))));
    assert!(!yes(&completion(serde_json::json!(["a", "b"]))));
    assert!(!yes(&completion(serde_json::json!([[1], [2]]))));
    let p = plan(
        &on,
        &chat(serde_json::json!({"max_completion_tokens": 9, "return_token_ids": true, "stream_options": {"include_usage": true}})),
    )
    .unwrap();
    assert_eq!(p.max_tokens, Some(9));
    assert!(p.client_ids && p.usage);
}

#[test]
fn a_continuation_carries_sampling_and_reduced_limits() {
    let req = request(
        Api::Chat,
        serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": true,
            "max_tokens": 10, "min_tokens": 4, "temperature": 0.5, "stop": ["."], "tools": null}),
    );
    let on = MigrationConfig {
        limit: 1,
        ..MigrationConfig::default()
    };
    let p = plan(&on, &req).unwrap();
    let body: serde_json::Value =
        serde_json::from_slice(&continuation_body(&p, Some(&[5, 6, 7]), 3, Some(7))).unwrap();
    assert_eq!(
        body,
        serde_json::json!({"model": "m", "temperature": 0.5, "stop": ["."], "prompt": [5, 6, 7],
            "max_tokens": 7, "min_tokens": 1, "stream": true, "return_token_ids": true})
    );
}

/// Every continuation keeps the client's prefix-cache isolation (`cache_salt`); one
/// whose prompt is ids does not carry the client's text-tokenizing settings, which
/// would truncate or re-read the ids (only a continuation from the client's own text
/// prompt does).
#[test]
fn a_token_continuation_carries_the_cache_salt_not_the_tokenizing_settings() {
    let req = request(
        Api::Completions,
        serde_json::json!({"model": "m", "prompt": "x", "stream": true, "max_tokens": 10,
            "cache_salt": "tenant-a", "add_special_tokens": false, "truncate_prompt_tokens": 2}),
    );
    let on = MigrationConfig {
        limit: 1,
        ..MigrationConfig::default()
    };
    let p = plan(&on, &req).unwrap();
    let body: serde_json::Value =
        serde_json::from_slice(&continuation_body(&p, Some(&[5, 6, 7]), 1, Some(9))).unwrap();
    assert_eq!(
        body,
        serde_json::json!({"model": "m", "cache_salt": "tenant-a", "prompt": [5, 6, 7],
            "max_tokens": 9, "stream": true, "return_token_ids": true})
    );
}

/// The limit a continuation carries is the one the engine generated to: chat prefers
/// `max_completion_tokens`, a completion without one stops at 16; integers are read as
/// the engine reads them. A request without a numeric limit (a chat without one, which
/// runs to the end of the context, or a completions `null`) is not eligible: the
/// continuation's completions API fails a `null` (vLLM asserts a number) and the
/// proxy does not know the model's context length to say the rest in numbers.
#[test]
fn the_limit_is_read_as_the_engine_reads_it() {
    let on = MigrationConfig {
        limit: 1,
        ..MigrationConfig::default()
    };
    let planned = |api: Api, extra: serde_json::Value| {
        let mut body = serde_json::json!({"messages": [], "prompt": "x", "stream": true});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        plan(&on, &request(api, body))
    };
    let limit =
        |api: Api, extra: serde_json::Value| planned(api, extra).expect("eligible").max_tokens;
    let both = serde_json::json!({"max_tokens": 1000, "max_completion_tokens": 20});
    assert_eq!(limit(Api::Chat, both), Some(20));
    let zero = serde_json::json!({"max_tokens": 30, "max_completion_tokens": 0});
    assert_eq!(limit(Api::Chat, zero), Some(30), "Python's `or`");
    assert!(planned(Api::Chat, serde_json::json!({})).is_none());
    for unbounded in [
        serde_json::json!({"max_tokens": null}),
        serde_json::json!({"max_completion_tokens": null}),
        serde_json::json!({"max_completion_tokens": 0}),
    ] {
        assert!(
            planned(Api::Chat, unbounded.clone()).is_none(),
            "{unbounded}"
        );
    }
    assert_eq!(limit(Api::Completions, serde_json::json!({})), Some(16));
    assert!(planned(Api::Completions, serde_json::json!({"max_tokens": null})).is_none());
    assert_eq!(
        limit(Api::Chat, serde_json::json!({"max_tokens": 50.0})),
        Some(50)
    );
    assert_eq!(
        limit(Api::Completions, serde_json::json!({"max_tokens": "50"})),
        Some(50)
    );
    assert_eq!(
        planned(
            Api::Chat,
            serde_json::json!({"min_tokens": 2.0, "max_tokens": 9})
        )
        .unwrap()
        .min_tokens,
        Some(2)
    );
    // Two sequences however `n` is spelled: not migrated.
    for n in [
        serde_json::json!(2.0),
        serde_json::json!("2"),
        serde_json::json!(true),
    ] {
        let two = n != serde_json::json!(true);
        let p = planned(
            Api::Chat,
            serde_json::json!({"n": n.clone(), "temperature": 1, "max_tokens": 9}),
        );
        assert_eq!(p.is_none(), two, "{n}");
    }
    // Booleans as the engine reads them.
    let p = planned(
        Api::Chat,
        serde_json::json!({"return_token_ids": 1, "stream_options": {"include_usage": "yes"}, "max_tokens": 9}),
    )
    .unwrap();
    assert!(p.client_ids && p.usage);
}

#[test]
fn a_generate_request_is_eligible_with_input_ids_and_a_limit() {
    let on = MigrationConfig {
        limit: 1,
        ..MigrationConfig::default()
    };
    let generate = |body: serde_json::Value| request(Api::Generate, body);
    let base = serde_json::json!({
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 8, "min_new_tokens": 2},
        "stream": true,
    });
    let p = plan(&on, &generate(base.clone())).expect("eligible");
    assert_eq!(p.generate.as_deref(), Some(&[1, 2, 3][..]));
    assert_eq!((p.max_tokens, p.min_tokens), (Some(8), Some(2)));
    for (key, value) in [
        ("input_ids", serde_json::json!([[1, 2], [3]])),
        ("input_ids", serde_json::json!(null)),
        ("text", serde_json::json!("words")),
        ("return_logprob", serde_json::json!(true)),
        ("stream", serde_json::json!(false)),
        (
            "sampling_params",
            serde_json::json!({"max_new_tokens": 8, "n": 2}),
        ),
        (
            "sampling_params",
            serde_json::json!({"max_new_tokens": 8, "json_schema": "{}"}),
        ),
        ("sampling_params", serde_json::json!({"temperature": 0})),
        (
            "sampling_params",
            serde_json::json!({"max_new_tokens": 8, "sampling_seed": 7}),
        ),
    ] {
        let mut body = base.clone();
        body[key] = value.clone();
        assert!(plan(&on, &generate(body)).is_none(), "{key}: {value}");
    }

    // The continuation: the ids, the limits less what was generated, no `rid`.
    let mut with_rid = base;
    with_rid["rid"] = serde_json::json!("client-id");
    let p = plan(&on, &generate(with_rid)).unwrap();
    let body = generate::continuation_body(&p, &[1, 2, 3, 9, 9], 2, Some(6));
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["input_ids"], serde_json::json!([1, 2, 3, 9, 9]));
    assert_eq!(v["sampling_params"]["max_new_tokens"], 6);
    assert_eq!(v["sampling_params"]["min_new_tokens"], 0);
    assert!(v.get("rid").is_none());
    assert_eq!(v["stream"], true);
}

/// The client's sampling parameters are read member by member (the last of a repeated
/// key counts) and copied into the continuation as written, the limits replaced.
#[test]
fn generate_parameters_are_read_and_copied_as_written() {
    let on = MigrationConfig {
        limit: 1,
        ..MigrationConfig::default()
    };
    let body = |params: &str| {
        let text = format!(r#"{{"input_ids":[1,2,3],"stream":true,"sampling_params":{params}}}"#);
        PdRequest::new(
            Api::Generate,
            http::HeaderMap::new(),
            &bytes::Bytes::from(text),
        )
        .unwrap()
    };
    // A repeated `n`: the last counts, as in a dict.
    assert!(plan(&on, &body(r#"{"max_new_tokens":8,"n":1,"n":2}"#)).is_none());
    assert!(plan(&on, &body(r#"{"max_new_tokens":8,"n":2,"n":1}"#)).is_some());
    assert!(
        plan(
            &on,
            &body(r#"{"max_new_tokens":8,"regex":null,"ebnf":false}"#)
        )
        .is_some()
    );
    assert!(plan(&on, &body("5")).is_none());
    let p = plan(
        &on,
        &body(r#"{"temperature":1e400,"max_new_tokens":8,"stop":[ "x" ]}"#),
    )
    .unwrap();
    let out = generate::continuation_body(&p, &[1, 2, 3, 9], 1, Some(7));
    let text = String::from_utf8(out.to_vec()).unwrap();
    assert!(
        text.contains(
            r#""sampling_params":{"temperature":1e400,"stop":[ "x" ],"max_new_tokens":7}"#
        ),
        "{text}"
    );
}

#[test]
fn a_generate_event_is_spliced_after_what_the_client_has() {
    let last = br#"{"text":" a b","output_ids":[5,6],"meta_info":{"id":"first","finish_reason":null,"prompt_tokens":3,"completion_tokens":2}}"#;
    let prefix = generate::prefix(last).unwrap();
    let cont = br#"{"text":" c","output_ids":[7],"meta_info":{"id":"second","finish_reason":{"type":"length","length":1},"prompt_tokens":5,"completion_tokens":1}}"#;
    let (json, finished) = generate::splice(&prefix, 3, cont).unwrap();
    assert!(finished);
    let v: serde_json::Value = serde_json::from_slice(&json).unwrap();
    assert_eq!(v["text"], " a b c");
    assert_eq!(v["output_ids"], serde_json::json!([5, 6, 7]));
    let meta = &v["meta_info"];
    assert_eq!(meta["id"], "first");
    assert_eq!(meta["prompt_tokens"], 3);
    assert_eq!(meta["completion_tokens"], 3);
    assert_eq!(meta["finish_reason"]["length"], 3);
    assert!(generate::prefix(b"{\"error\":{}}").is_none());
}

#[test]
fn a_continuations_u64_max_counts_saturate() {
    let last = br#"{"text":" a b","output_ids":[5,6],"meta_info":{"id":"first","finish_reason":null,"prompt_tokens":3,"completion_tokens":2}}"#;
    let prefix = generate::prefix(last).unwrap();
    let cont = br#"{"text":" c","output_ids":[7],"meta_info":{"id":"second","finish_reason":{"type":"length","length":18446744073709551615},"prompt_tokens":5,"completion_tokens":18446744073709551615}}"#;
    let (json, finished) = generate::splice(&prefix, 3, cont).unwrap();
    assert!(finished);
    let v: serde_json::Value = serde_json::from_slice(&json).unwrap();
    let meta = &v["meta_info"];
    assert_eq!(meta["completion_tokens"], u64::MAX);
    assert_eq!(meta["finish_reason"]["length"], u64::MAX);
}

/// A list of small objects of about `bytes` bytes: what a `Value` costs most for (each
/// `{"":0}` a map of its own, ninety-odd bytes per byte).
fn objects(bytes: usize) -> String {
    format!("[{}]", vec![r#"{"":0}"#; bytes / 7].join(","))
}

/// The JSON text at `path` in `json` (a key of an object, or the index of a list's
/// element), as written, read without building it (a `Value` refuses `1e400`).
fn at<'a>(json: &'a str, path: &[&str]) -> Option<&'a str> {
    let mut here = raw::trim(json);
    for step in path {
        here = match step.parse::<usize>() {
            Ok(i) => {
                let mut found = None;
                let mut n = 0;
                raw::elements(here, |v| {
                    if n == i {
                        found = Some(v.get());
                    }
                    n += 1;
                })
                .ok()?;
                found?
            }
            Err(_) => raw::member(here, step)?.get(),
        };
    }
    Some(here)
}

/// The keys of the JSON object `json`, in order.
fn keys(json: &str) -> Vec<String> {
    let mut keys = Vec::new();
    raw::members(json, |k, _| keys.push(k)).unwrap();
    keys
}

fn migrating_plan(api: Api, body: serde_json::Value) -> Plan {
    let on = MigrationConfig {
        limit: 1,
        ..MigrationConfig::default()
    };
    plan(&on, &request(api, body)).expect("eligible")
}

fn head_of(first: &str) -> Head {
    Head::of(&serde_json::from_str::<FirstChunk<'_>>(first).unwrap())
}

/// A continuation's chunk is walked, not built: what the client gets of it (the text,
/// the finish and stop reasons, the ids) is copied as the engine wrote it, a megabyte
/// of small objects and a number a `Value` refuses (`1e400`) included, and the members
/// it does not carry are skipped; the first leg's header goes out as written too.
#[test]
fn a_continuation_chunk_is_walked_and_what_it_carries_is_copied_as_written() {
    let plan = migrating_plan(
        Api::Chat,
        serde_json::json!({"messages": [], "stream": true, "return_token_ids": true,
            "stream_options": {"include_usage": true}, "max_tokens": 64}),
    );
    let head = head_of(
        r#"{"id":"c-1","object":"chat.completion.chunk","created":1e400,"model":"m\u00e9","choices":[]}"#,
    );
    let big = objects(1 << 20);
    let stop = format!(r#"{{"list":{big},"n":1e400,"f":1.0000}}"#);
    let data = format!(
        r#"{{"id":"cmpl-2","object":"text_completion","created":9,"model":"other","kv_transfer_params":{big},"choices":[{{"index":3,"text":"caf\u00e9 1.0000","logprobs":null,"finish_reason":"length","stop_reason":{stop},"token_ids":[ 7 , 8 ],"prompt_token_ids":[1e400]}}],"usage":{{"prompt_tokens":15,"completion_tokens":3,"total_tokens":18,"x":1e400}}}}"#
    );
    let s = splice_chunk(&head, &plan, 5, false, data.as_bytes()).expect("one JSON value");
    assert!(s.finished && s.usage);
    assert_eq!(s.ids, [7, 8]);
    let json = String::from_utf8(s.json.expect("a chunk")).unwrap();
    // The header is the first leg's, as written; nothing else of the top is carried.
    assert_eq!(
        keys(&json),
        ["id", "object", "created", "model", "choices", "usage"]
    );
    assert_eq!(at(&json, &["id"]), Some(r#""c-1""#));
    assert_eq!(at(&json, &["object"]), Some(r#""chat.completion.chunk""#));
    assert_eq!(at(&json, &["created"]), Some("1e400"));
    assert_eq!(at(&json, &["model"]), Some(r#""m\u00e9""#));
    // One choice, chat-shaped, at index 0, its values byte for byte.
    let choice = at(&json, &["choices", "0"]).unwrap();
    assert!(at(&json, &["choices", "1"]).is_none());
    assert_eq!(
        keys(choice),
        [
            "index",
            "delta",
            "logprobs",
            "finish_reason",
            "stop_reason",
            "token_ids"
        ]
    );
    assert_eq!(at(choice, &["index"]), Some("0"));
    assert_eq!(
        at(choice, &["delta"]),
        Some(r#"{"content":"caf\u00e9 1.0000"}"#)
    );
    assert_eq!(at(choice, &["logprobs"]), Some("null"));
    assert_eq!(at(choice, &["finish_reason"]), Some(r#""length""#));
    assert_eq!(at(choice, &["stop_reason"]), Some(&stop[..]));
    assert_eq!(at(choice, &["token_ids"]), Some("[ 7 , 8 ]"));
    // The usage counts the original prompt once and both legs' tokens.
    assert_eq!(
        at(&json, &["usage"]),
        Some(r#"{"prompt_tokens":10,"completion_tokens":8,"total_tokens":18}"#)
    );
    // The chunk is about what it carries: the skipped megabyte is not in it.
    assert!(json.len() < stop.len() + 512, "{}", json.len());
}

/// The chunk the proxy writes for a continuation's is the one a parse of it gave: the
/// same members and values for every shape an engine may send, malformed ones refused
/// as before.
#[test]
fn a_continuation_chunk_is_rewritten_as_a_parse_of_it_was() {
    let completions = migrating_plan(
        Api::Completions,
        serde_json::json!({"prompt": "x", "stream": true}),
    );
    let chat_ids = migrating_plan(
        Api::Chat,
        serde_json::json!({"messages": [], "stream": true, "return_token_ids": true, "max_tokens": 64}),
    );
    let head = head_of(r#"{"id":"x","object":"text_completion","created":7,"model":"m"}"#);
    let header =
        serde_json::json!({"id": "x", "object": "text_completion", "created": 7, "model": "m"});
    let chunk = |plan: &Plan, data: &str| {
        let s = splice_chunk(&head, plan, 2, false, data.as_bytes())?;
        let json = s.json.map(|j| serde_json::from_slice::<Value>(&j).unwrap());
        Some((json, s.ids, s.finished, s.usage))
    };
    let with = |choices: Value, usage: Option<Value>| {
        let mut v = header.clone();
        v["choices"] = choices;
        if let Some(u) = usage {
            v["usage"] = u;
        }
        Some(v)
    };
    // Completions: the text at `text`, no ids for a client that did not ask, the
    // last of a repeated key, a usage chunk the client did not ask for not sent (its
    // ids and finish still read).
    assert_eq!(
        chunk(
            &completions,
            r#"{"choices":[{"text":"a","text":"b","finish_reason":null,"token_ids":[4],"stop_reason":null}]}"#
        ),
        Some((
            with(
                serde_json::json!([{"index": 0, "text": "b", "logprobs": null, "finish_reason": null, "stop_reason": null}]),
                None
            ),
            vec![4],
            false,
            false
        ))
    );
    assert_eq!(
        chunk(
            &completions,
            r#"{"choices":[{"text":"","finish_reason":"stop","token_ids":[9]}],"usage":{"completion_tokens":1}}"#
        ),
        Some((None, vec![9], true, false))
    );
    // What is not an object: no choices, no usage; a choice that is not one: an empty
    // text, no finish.
    assert_eq!(
        chunk(&completions, "[1]"),
        Some((with(serde_json::json!([]), None), vec![], false, false))
    );
    assert_eq!(
        chunk(&chat_ids, r#"{"choices":[5],"usage":null}"#),
        Some((
            with(
                serde_json::json!([{"index": 0, "delta": {"content": ""}, "logprobs": null, "finish_reason": null, "token_ids": null}]),
                None
            ),
            vec![],
            false,
            false
        ))
    );
    assert_eq!(
        chunk(&chat_ids, r#"{"choices":{"text":"a"}}"#),
        Some((with(serde_json::json!([]), None), vec![], false, false))
    );
    // Ids an integer read refuses are no ids (null for the client), the others are.
    for bad in [
        "[1.0]",
        "[-0]",
        "[1e2]",
        r#"["1"]"#,
        "[4294967296]",
        "[[1]]",
        "{}",
        "1",
    ] {
        let data =
            format!(r#"{{"choices":[{{"text":"a","token_ids":{bad}}},{{"token_ids":[3]}}]}}"#);
        let (json, ids, _, _) = chunk(&chat_ids, &data).unwrap();
        let json = json.unwrap();
        assert_eq!(json["choices"][0]["token_ids"], Value::Null, "{bad}");
        assert_eq!(
            json["choices"][1]["token_ids"],
            serde_json::json!([3]),
            "{bad}"
        );
        assert_eq!(ids, [3], "{bad}");
    }
    // Malformed: a cut chunk, bytes that are not UTF-8, two values.
    assert_eq!(chunk(&completions, r#"{"choices":["#), None);
    assert!(
        splice_chunk(
            &head,
            &completions,
            0,
            false,
            b"{\"choices\":[{\"text\":\"\xff\"}]}"
        )
        .is_none()
    );
    assert_eq!(chunk(&completions, "{} {}"), None);
    assert_eq!(chunk(&completions, "[1"), None);
    assert_eq!(chunk(&completions, "[1] 2"), None);
}

/// The end of a stream the proxy writes carries the first leg's header as written.
#[test]
fn the_proxys_usage_chunk_carries_the_header_as_written() {
    let head = head_of(r#"{"id":"c","object":"o","created":1.0000,"model":"m"}"#);
    let json = usage_chunk(&head, 3, 4);
    assert_eq!(
        String::from_utf8(json).unwrap(),
        r#"{"id":"c","object":"o","created":1.0000,"model":"m","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#
    );
}

/// SGLang's events are walked, not built: the prefix keeps the answer's id as written,
/// and a continuation's event keeps what the splice does not touch (a megabyte of
/// small objects, numbers a `Value` refuses or rewrites) byte for byte, in the engine's
/// order, each key the splice writes once.
#[test]
fn a_generate_event_keeps_what_the_splice_does_not_touch_as_written() {
    let big = objects(1 << 20);
    let last = format!(
        r#"{{"text":"a\u00e9","output_ids":[5, 6],"meta_info":{{"id":{{"rid":1e400}},"finish_reason":null,"weights":{big}}}}}"#
    );
    let prefix = generate::prefix(last.as_bytes()).expect("an answer event");
    assert_eq!(prefix.ids, [5, 6]);
    let cont = format!(
        r#"{{"text":"ignored","x":{big},"text":" c","output_ids":[ 7 ,8],"meta_info":{{"e2e_latency":1.0000,"completion_tokens":1,"id":"second","weird":1e400,"finish_reason":{{"length":0,"type":"length","length":2,"more":1e400}},"completion_tokens":2,"prompt_tokens":11}},"index":0}}"#
    );
    let (json, finished) = generate::splice(&prefix, 3, cont.as_bytes()).unwrap();
    assert!(finished);
    let json = String::from_utf8(json).unwrap();
    assert_eq!(
        keys(&json),
        ["x", "text", "output_ids", "meta_info", "index"]
    );
    assert_eq!(at(&json, &["x"]), Some(&big[..]));
    assert_eq!(at(&json, &["text"]), Some(r#""aé c""#));
    assert_eq!(at(&json, &["output_ids"]), Some("[5,6,7,8]"));
    assert_eq!(at(&json, &["index"]), Some("0"));
    let meta = at(&json, &["meta_info"]).unwrap();
    assert_eq!(
        meta,
        r#"{"e2e_latency":1.0000,"id":{"rid":1e400},"weird":1e400,"finish_reason":{"type":"length","length":4,"more":1e400},"completion_tokens":4,"prompt_tokens":3}"#
    );
    // What the client's stream then holds is the prefix of a further continuation.
    let again = generate::prefix(json.as_bytes()).unwrap();
    assert_eq!(again.ids, [5, 6, 7, 8]);

    // Members the continuation lacks are added; a finish that is not a length is kept.
    let (json, finished) = generate::splice(
        &prefix,
        3,
        br#"{"text":"","output_ids":[],"meta_info":{"finish_reason":{"type":"stop","length":1}}}"#,
    )
    .unwrap();
    assert!(finished);
    assert_eq!(
        String::from_utf8(json).unwrap(),
        r#"{"text":"aé","output_ids":[5,6],"meta_info":{"finish_reason":{"type":"stop","length":1},"id":{"rid":1e400},"prompt_tokens":3,"completion_tokens":2}}"#
    );

    // "length" spelled with an escape is a length finish; a long string is not.
    let long = format!("{:?}", "x".repeat(100));
    for (kind, want) in [
        (r#""lengt\u0068""#, "4"),
        (r#""\u006c\u0065\u006e\u0067\u0074\u0068""#, "4"),
        (&long[..], "2"),
    ] {
        let cont = format!(
            r#"{{"text":"","output_ids":[],"meta_info":{{"finish_reason":{{"type":{kind},"length":2}}}}}}"#
        );
        let (json, _) = generate::splice(&prefix, 3, cont.as_bytes()).unwrap();
        let json = String::from_utf8(json).unwrap();
        let length = at(&json, &["meta_info", "finish_reason", "length"]);
        assert_eq!(length, Some(want), "{kind}");
    }

    // Not answer events, as before: no text string, ids that are not a list, no
    // meta_info object, a cut event; a prefix without ids or id.
    for bad in [
        r#"{"text":1,"output_ids":[],"meta_info":{}}"#,
        r#"{"text":"","output_ids":{},"meta_info":{}}"#,
        r#"{"text":"","output_ids":[],"meta_info":[]}"#,
        r#"{"text":"","output_ids":[]}"#,
        r#"{"text":"","output_ids":[],"meta_info":{}"#,
        r#"[{"text":"","output_ids":[],"meta_info":{}}]"#,
    ] {
        assert!(
            generate::splice(&prefix, 3, bad.as_bytes()).is_none(),
            "{bad}"
        );
    }
    for bad in [
        r#"{"text":"","output_ids":[1.0],"meta_info":{"id":1}}"#,
        r#"{"text":"","output_ids":[1],"meta_info":{}}"#,
        r#"{"text":"","output_ids":[1],"meta_info":[{"id":1}]}"#,
        r#"{"text":"\ud800","output_ids":[1],"meta_info":{"id":1}}"#,
    ] {
        assert!(generate::prefix(bad.as_bytes()).is_none(), "{bad}");
    }
}
