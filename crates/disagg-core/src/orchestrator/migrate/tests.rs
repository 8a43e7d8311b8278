use super::*;
use crate::request::Api;

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

#[test]
fn an_event_ends_at_its_blank_line_and_a_cut_one_waits() {
    assert_eq!(event_end(b"data: {}\n\ndata: x"), Some(10));
    assert_eq!(event_end(b"data: {}\ndata: x\n\n"), Some(18));
    assert_eq!(event_end(b"data: {}\n"), None);
    assert_eq!(event_end(b"data: {\"a\":\"\\n\\n\"}\n"), None);
    assert_eq!(event_end(b""), None);
    assert_eq!(event_end(b"\n\n"), Some(2));
}

#[test]
fn the_first_chunk_is_read_for_its_header_and_prompt_ids_only() {
    let read = |data: &[u8]| {
        let first: FirstChunk<'_> = serde_json::from_slice(data).ok()?;
        let head = Head::of(&first);
        Some((Value::Object(head.fields()), first.prompt()))
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
        let mut body = serde_json::json!({"messages": [], "stream": true});
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
        serde_json::from_slice(&continuation_body(&p, &[5, 6, 7], 3, Some(7))).unwrap();
    assert_eq!(
        body,
        serde_json::json!({"model": "m", "temperature": 0.5, "stop": ["."], "prompt": [5, 6, 7],
            "max_tokens": 7, "min_tokens": 1, "stream": true, "return_token_ids": true})
    );
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
