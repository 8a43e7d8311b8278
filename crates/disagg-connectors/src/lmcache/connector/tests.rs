//! Unit tests of `connector`.

use super::*;
use crate::common::sse::{EventMap, MapEvents};
use crate::lmcache::reshape::*;
use bytes::BytesMut;
use disagg_core::Role;
use disagg_core::endpoint::{Endpoint, Facts};
use disagg_core::error::BoxError;
use disagg_core::transport::BoxBody;
use disagg_json::JsonBody;
use disagg_pairing::KvRole;
use http::HeaderMap;
use http_body::Frame;
use http_body_util::BodyExt;

fn route(receiver: Option<LmcacheReceiver>) -> Route {
    route_with(receiver.map(|r| r.to_string()).as_deref())
}

/// A route whose decode's receiver fact is `receiver`, as written.
fn route_with(receiver: Option<&str>) -> Route {
    let p = Arc::new(Endpoint::new("http://p:7100", Role::Prefill).unwrap());
    let mut facts = Facts::default();
    if let Some(r) = receiver {
        facts.insert(Facts::KV_RECEIVER, r).unwrap();
    }
    let d = Arc::new(
        Endpoint::new("http://d:7200", Role::Decode)
            .unwrap()
            .with_facts(facts),
    );
    Route::new(Some(p), d)
}

#[test]
fn a_malformed_receiver_fact_fails_the_request_naming_endpoint_and_key() {
    let req = request(Api::Completions, r#"{"model":"m","prompt":"hi"}"#);
    for bad in ["h:1,2:3", "10.0.0.7:7300", "h:x:1"] {
        let err = connector()
            .prepare(&route_with(Some(bad)), &req)
            .unwrap_err();
        assert!(
            matches!(err, ConnectorError::NotConfigured { .. }),
            "{bad}: {err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("http://d:7200") && msg.contains("`kv_receiver`"),
            "{msg}"
        );
    }
    // The text form reads back as the receiver it was written from.
    let facts = Facts::default()
        .with(Facts::KV_RECEIVER, receiver().to_string())
        .unwrap();
    assert_eq!(LmcacheReceiver::from_facts(&facts), Ok(Some(receiver())));
    assert_eq!(LmcacheReceiver::from_facts(&Facts::default()), Ok(None));
}

fn request(api: Api, body: &str) -> PdRequest {
    PdRequest::new(api, HeaderMap::new(), &Bytes::from(body.to_owned())).unwrap()
}

fn connector() -> Lmcache {
    Lmcache::new(Notifications::detached(
        crate::lmcache::NotifyConfig::default(),
    ))
}

fn receiver() -> LmcacheReceiver {
    LmcacheReceiver::parse("10.0.0.7:7300,7301:7400,7401").unwrap()
}

#[test]
fn receivers_parse_and_refuse_what_cannot_be_one() {
    let r = receiver();
    assert_eq!(r.host(), "10.0.0.7");
    assert_eq!(r.init_ports(), [7300, 7301]);
    assert_eq!(r.alloc_ports(), [7400, 7401]);
    assert_eq!(r.ranks(), 2);
    assert_eq!(
        LmcacheReceiver::parse("h:1,2:3"),
        Err(ReceiverError::Mismatch { init: 2, alloc: 1 })
    );
    for bad in ["h:1", ":1:2", "h:x:2", "h:1:", "1:2"] {
        assert!(LmcacheReceiver::parse(bad).is_err(), "{bad}");
    }
    assert_eq!(
        LmcacheReceiver::new("h", vec![], vec![]),
        Err(ReceiverError::NoPorts)
    );
}

#[test]
fn the_prefill_leg_is_a_one_token_completion_carrying_the_receiver() {
    let req = request(
        Api::Chat,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":9,"stream":true,"stream_options":{"include_usage":true},"logprobs":true,"temperature":0.5}"#,
    );
    let h = connector().prepare(&route(Some(receiver())), &req).unwrap();
    assert_eq!(h.dispatch, Dispatch::AfterPrefill);
    assert_eq!(h.prefill.api, Some(Api::Completions));
    assert_eq!(h.decode.api, Some(Api::Completions));
    let p: Value = serde_json::from_slice(&h.prefill.body.to_bytes()).unwrap();
    assert_eq!(p["max_tokens"], 1);
    assert_eq!(p["stream"], false);
    assert_eq!(p["temperature"], 0.5);
    for gone in [
        "messages",
        "max_completion_tokens",
        "stream_options",
        "logprobs",
    ] {
        assert!(p.get(gone).is_none(), "{gone} in {p}");
    }
    let spec = &p["kv_transfer_params"];
    assert_eq!(spec["ret_first_tok"], true);
    assert_eq!(spec["disagg_spec"]["receiver_host"], "10.0.0.7");
    assert_eq!(
        spec["disagg_spec"]["receiver_init_port"],
        json!([7300, 7301])
    );
    assert_eq!(
        spec["disagg_spec"]["receiver_alloc_port"],
        json!([7400, 7401])
    );
    assert!(spec["disagg_spec"]["req_id"].is_string());
    let d: Value = serde_json::from_slice(&h.decode.body.to_bytes()).unwrap();
    assert_eq!(d["max_tokens"], 9);
    assert_eq!(d["stream"], true);
    assert_eq!(d["stream_options"]["include_usage"], true);
    assert!(d.get("kv_transfer_params").is_none());
    // Each attempt gets its own id.
    let again = connector().prepare(&route(Some(receiver())), &req).unwrap();
    let id = |h: &Handoff| {
        let v: Value = serde_json::from_slice(&h.prefill.body.to_bytes()).unwrap();
        v["kv_transfer_params"]["disagg_spec"]["req_id"].clone()
    };
    assert_ne!(id(&h), id(&again));
}

#[test]
fn what_the_protocol_cannot_carry_is_refused() {
    let c = connector();
    let chat = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"n":2}"#;
    assert!(matches!(
        c.prepare(&route(Some(receiver())), &request(Api::Chat, chat)),
        Err(ConnectorError::Unsupported { .. })
    ));
    let batch = r#"{"model":"m","prompt":["a","b"]}"#;
    assert!(matches!(
        c.prepare(&route(Some(receiver())), &request(Api::Completions, batch)),
        Err(ConnectorError::Unsupported { .. })
    ));
    let ok = r#"{"model":"m","prompt":"a"}"#;
    assert!(matches!(
        c.prepare(&route(None), &request(Api::Completions, ok)),
        Err(ConnectorError::NotConfigured { .. })
    ));
}

fn shape(chat: bool) -> Shape {
    Shape {
        chat,
        first: Some(First {
            id: "cmpl-7".into(),
            created: 5,
            model: "m".into(),
            text: " one".into(),
            finish: None,
            usage: None,
            stop_reason: Value::Null,
        }),
        prompt_tokens: 3,
    }
}

fn events(out: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(out)
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn a_completion_stream_becomes_a_chat_stream_event_by_event() {
    let decode = concat!(
        "data: {\"id\":\"cmpl-d\",\"object\":\"text_completion\",\"created\":9,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" two\",\"logprobs\":null,\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"cmpl-d\",\"object\":\"text_completion\",\"created\":9,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"\",\"logprobs\":null,\"finish_reason\":\"length\"}],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":2,\"total_tokens\":6}}\n\n",
        "data: [DONE]\n\n",
    );
    // Frames cut in the middle of events.
    let frames: Vec<Result<Frame<Bytes>, BoxError>> = decode
        .as_bytes()
        .chunks(37)
        .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
        .collect();
    let body = BoxBody::new(http_body_util::StreamBody::new(futures::stream::iter(
        frames,
    )));
    let mapped = MapEvents::new(body, Arc::new(shape(true)));
    let out = BodyExt::collect(mapped).await.unwrap().to_bytes();
    let evs = events(&out);
    assert_eq!(evs.len(), 3, "{evs:?}");
    let first: Value = serde_json::from_str(evs[0].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(first["id"], "chatcmpl-7");
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["content"], " two");
    assert!(first["choices"][0].get("text").is_none());
    let last: Value = serde_json::from_str(evs[1].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    // The prompt once (3, not the decode's 4), and the prefill's token counted.
    assert_eq!(
        last["usage"],
        json!({"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6})
    );
    assert_eq!(evs[2], "data: [DONE]");
}

/// The SSE specification ends an event at a blank line whatever the line ends:
/// `\r\n\r\n` and `\r\r` too, even cut between its `\r` and `\n`.
#[tokio::test]
async fn events_framed_with_cr_and_crlf_are_found_wherever_the_frames_are_cut() {
    let one = "data: {\"id\":\"cmpl-d\",\"object\":\"text_completion\",\"created\":9,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" two\",\"logprobs\":null,\"finish_reason\":null}]}";
    for sep in ["\r\n\r\n", "\r\r", "\n\r\n", "\n\n"] {
        let decode = format!("{one}{sep}{one}{sep}data: [DONE]{sep}");
        for cut in 1..=decode.len() {
            let frames: Vec<Result<Frame<Bytes>, BoxError>> = decode
                .as_bytes()
                .chunks(cut)
                .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
                .collect();
            let mapped = MapEvents::new(
                BoxBody::new(http_body_util::StreamBody::new(futures::stream::iter(
                    frames,
                ))),
                Arc::new(shape(true)),
            );
            let out = BodyExt::collect(mapped).await.unwrap().to_bytes();
            let evs = events(&out);
            assert_eq!(evs.len(), 3, "{sep:?} cut {cut}: {evs:?}");
            for ev in &evs[..2] {
                let v: Value = serde_json::from_str(ev.strip_prefix("data: ").unwrap()).unwrap();
                assert_eq!(v["object"], "chat.completion.chunk", "{sep:?} cut {cut}");
            }
            assert_eq!(evs[2], "data: [DONE]", "{sep:?} cut {cut}");
        }
    }
}

#[test]
fn error_events_and_done_pass_unchanged() {
    let s = shape(true);
    let mut out = BytesMut::new();
    s.event(br#"data: {"error":{"message":"x","code":"c"}}"#, &mut out);
    s.event(b"data: [DONE]", &mut out);
    assert_eq!(
        events(&out),
        [
            r#"data: {"error":{"message":"x","code":"c"}}"#,
            "data: [DONE]"
        ]
    );
}

#[test]
fn a_whole_answer_gets_the_first_token_in_front() {
    let decode = br#"{"id":"cmpl-d","object":"text_completion","created":9,"model":"m","choices":[{"index":0,"text":" two three","logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":4,"completion_tokens":2,"total_tokens":6}}"#;
    let chat: Value = serde_json::from_slice(&shape(true).whole(decode).unwrap()).unwrap();
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(chat["id"], "chatcmpl-7");
    assert_eq!(chat["choices"][0]["message"]["role"], "assistant");
    assert_eq!(chat["choices"][0]["message"]["content"], " one two three");
    assert_eq!(chat["choices"][0]["finish_reason"], "stop");
    assert_eq!(chat["usage"]["prompt_tokens"], 3);
    assert_eq!(chat["usage"]["completion_tokens"], 3);
    let text: Value = serde_json::from_slice(&shape(false).whole(decode).unwrap()).unwrap();
    assert_eq!(text["object"], "text_completion");
    assert_eq!(text["choices"][0]["text"], " one two three");
    assert!(shape(true).whole(b"[1]").is_err());
}

#[test]
fn a_whole_answer_of_more_choices_than_one_is_refused_naming_the_count() {
    let two = br#"{"id":"cmpl-d","choices":[{"index":0,"text":" two"},{"index":1,"text":" 2"}],"usage":null}"#;
    let e = shape(true).whole(two).unwrap_err().to_string();
    assert!(e.contains("2 choices"), "{e}");
    // Counted, not built: a hostile decode's many empty choices are refused alike.
    let many = format!(r#"{{"choices":[{}],"x":1}}"#, vec!["{}"; 100_000].join(","));
    let e = shape(false).whole(many.as_bytes()).unwrap_err().to_string();
    assert!(e.contains("100000 choices"), "{e}");
}

#[test]
fn the_first_token_begins_the_one_choice_even_without_an_index() {
    let decode = br#"{"choices":[{"text":" two","finish_reason":"stop"}]}"#;
    let chat: Value = serde_json::from_slice(&shape(true).whole(decode).unwrap()).unwrap();
    assert_eq!(chat["choices"][0]["message"]["content"], " one two");
    let text: Value = serde_json::from_slice(&shape(false).whole(decode).unwrap()).unwrap();
    assert_eq!(text["choices"][0]["text"], " one two");
    // Not a JSON object, or not JSON: refused as before.
    let e = shape(true).whole(b"\"x\"").unwrap_err().to_string();
    assert_eq!(e, "the decode's answer is not a JSON object");
    assert!(shape(true).whole(b"{\"choices\":[").is_err());
    // JSON no `Value` can hold (a number past f64, nesting past serde's limit) is
    // carried as the decode wrote it: the reshape never builds what it does not touch.
    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    let decode =
        format!(r#"{{"choices":[{{"index":0,"text":"a","x":1e400}}],"usage":null,"d":{deep}}}"#);
    let out = shape(true).whole(decode.as_bytes()).unwrap();
    let out = std::str::from_utf8(&out).unwrap();
    assert!(out.contains(r#""x":1e400"#), "{out}");
    assert!(out.contains(&format!(r#""d":{deep}"#)));
    assert!(
        out.contains(r#""message":{"content":" onea","role":"assistant"}"#),
        "{out}"
    );
}

/// A hostile decode's whole answer costs about its own size: what the change of form
/// does not touch is copied, not built (a `Value` per `0,` was 16 bytes per byte).
#[test]
fn a_whole_answers_untouched_members_are_copied_as_written() {
    let zeros = vec!["0"; 1_000_000].join(",");
    let decode = format!(
        r#"{{"x": [{zeros}], "choices":[{{"index":0,"text":" two","y":[{zeros}],"finish_reason":"stop"}}],"usage":{{"completion_tokens":2,"z":[{zeros}]}}}}"#
    );
    let out = shape(false).whole(decode.as_bytes()).unwrap();
    assert!(
        out.len() < decode.len() + 256,
        "{} from {}",
        out.len(),
        decode.len()
    );
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["x"].as_array().unwrap().len(), 1_000_000);
    assert_eq!(v["choices"][0]["y"].as_array().unwrap().len(), 1_000_000);
    assert_eq!(v["choices"][0]["text"], " one two");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["usage"]["z"].as_array().unwrap().len(), 1_000_000);
    // Untouched values keep the decode's spelling.
    assert!(
        std::str::from_utf8(&out)
            .unwrap()
            .starts_with("{\"x\":[0,0,")
    );
}

#[tokio::test]
async fn a_decodes_u64_max_completion_tokens_saturate_streamed_and_whole() {
    // The decode's count plus the prefill's token, and the prompt plus that: at
    // u64::MAX, not a panic (debug) or a wrap to a handful of tokens (release).
    let saturated =
        json!({"prompt_tokens": 3, "completion_tokens": u64::MAX, "total_tokens": u64::MAX});
    let usage = r#""usage":{"completion_tokens":18446744073709551615}"#;
    let streamed = format!(
        "data: {{\"id\":\"cmpl-d\",\"choices\":[{{\"index\":0,\"text\":\"\",\"finish_reason\":\"length\"}}],{usage}}}\n\ndata: [DONE]\n\n"
    );
    let body = BoxBody::new(http_body_util::StreamBody::new(futures::stream::iter([
        Ok::<_, BoxError>(Frame::data(Bytes::from(streamed))),
    ])));
    let mapped = MapEvents::new(body, Arc::new(shape(true)));
    let out = BodyExt::collect(mapped).await.unwrap().to_bytes();
    let evs = events(&out);
    assert_eq!(evs.len(), 2, "{evs:?}");
    let last: Value = serde_json::from_str(evs[0].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(last["usage"], saturated);

    let whole = format!(
        r#"{{"id":"cmpl-d","choices":[{{"index":0,"text":" two","finish_reason":"length"}}],{usage}}}"#
    );
    let chat: Value =
        serde_json::from_slice(&shape(true).whole(whole.as_bytes()).unwrap()).unwrap();
    assert_eq!(chat["usage"], saturated);
}

/// An endpoint declaring `profile`, with `receiver` installed as a proxy does it
/// (`insert_into`, declaring its size).
fn declared(
    url: &str,
    role: Role,
    profile: Option<KvProfile>,
    receiver: Option<LmcacheReceiver>,
) -> Endpoint {
    let mut ext = http::Extensions::new();
    if let Some(p) = profile {
        ext.insert(p);
    }
    let mut facts = Facts::default();
    if let Some(r) = receiver {
        r.insert_into(&mut facts, &mut ext).unwrap();
    }
    Endpoint::with_extensions(url, role, ext)
        .unwrap()
        .with_facts(facts)
}

fn tp(size: u32) -> Option<KvProfile> {
    Some(KvProfile {
        tp_size: Some(size),
        ..KvProfile::default()
    })
}

#[test]
fn pairs_of_unequal_tp_are_refused_the_decodes_size_being_its_receivers() {
    use disagg_core::endpoint::EndpointSet;
    use disagg_resilience::pairing::check_pairs;
    // The decode declares no profile: its receiver's two ports are its size.
    let set = EndpointSet::new(
        [
            declared("http://p1:7100", Role::Prefill, tp(1), None),
            declared("http://p2:7100", Role::Prefill, tp(2), None),
            declared("http://p4:7100", Role::Prefill, tp(4), None),
            declared("http://p0:7100", Role::Prefill, None, None),
            declared("http://d:7200", Role::Decode, None, Some(receiver())),
        ]
        .map(Arc::new),
    );
    let err = check_pairs(&set, &connector()).unwrap_err();
    let refused: Vec<_> = err
        .pairs
        .iter()
        .map(|p| (p.prefill.as_str(), p.decode.as_str(), p.mismatch.clone()))
        .collect();
    let mismatch = |prefill, decode| Mismatch::TpSize {
        connector: "lmcache",
        prefill,
        decode,
    };
    // Fewer prefill ranks would never complete the wait, more would fail the
    // prefill; equal and undeclared sizes pass.
    assert_eq!(
        refused,
        [
            ("http://p1:7100", "http://d:7200", mismatch(1, 2)),
            ("http://p4:7100", "http://d:7200", mismatch(4, 2)),
        ]
    );
    let text = err.to_string();
    assert!(
        text.contains("prefill endpoint http://p1:7100 and decode endpoint http://d:7200")
            && text.contains("from tensor-parallel size 1 to 2"),
        "{text}"
    );
    // A decode profile that declares other parts keeps them and gains the size.
    let role = KvProfile {
        role: Some(KvRole::Consumer),
        ..KvProfile::default()
    };
    let d = declared("http://d:7200", Role::Decode, Some(role), Some(receiver()));
    let p = d.ext().get::<KvProfile>().unwrap();
    assert_eq!((p.role, p.tp_size), (Some(KvRole::Consumer), Some(2)));
    assert!(connector().bridges_tp(2, 2));
    assert!(!connector().bridges_tp(1, 2) && !connector().bridges_tp(4, 2));
}

#[test]
fn a_decode_declaring_another_size_than_its_receiver_is_refused() {
    let mut ext = http::Extensions::new();
    let mut facts = Facts::default();
    ext.insert(tp(4).unwrap());
    assert_eq!(
        receiver().insert_into(&mut facts, &mut ext),
        Err(ReceiverError::TpSize {
            declared: 4,
            ranks: 2
        })
    );
    // Left as it was: no receiver, the declared size untouched.
    assert!(facts.get(Facts::KV_RECEIVER).is_none());
    assert_eq!(ext.get::<KvProfile>(), tp(4).as_ref());
    let mut ext = http::Extensions::new();
    ext.insert(tp(2).unwrap());
    receiver().insert_into(&mut facts, &mut ext).unwrap();
    assert_eq!(LmcacheReceiver::from_facts(&facts), Ok(Some(receiver())));
}

#[tokio::test]
async fn a_later_set_with_an_unequal_pair_is_refused_by_validated_source() {
    use disagg_core::{EndpointSource, source::StaticSource};
    use disagg_resilience::pairing::ValidatedSource;
    let decode = || declared("http://d:7200", Role::Decode, None, Some(receiver()));
    let inner = Arc::new(StaticSource::new([
        declared("http://p2:7100", Role::Prefill, tp(2), None),
        decode(),
    ]));
    let source = ValidatedSource::new(Arc::clone(&inner), Arc::new(connector())).unwrap();
    // Discovery publishes a prefill of TP 1 next to the decode of two ports.
    inner.insert(declared("http://p1:7100", Role::Prefill, tp(1), None));
    let refused = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        loop {
            if let Some(e) = source.last_error() {
                return e;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the set is refused");
    assert_eq!(refused.pairs.len(), 1);
    assert_eq!(refused.pairs[0].prefill.as_str(), "http://p1:7100");
    assert_eq!(
        refused.pairs[0].mismatch,
        Mismatch::TpSize {
            connector: "lmcache",
            prefill: 1,
            decode: 2
        }
    );
    // The last valid set stays in force.
    let set = source.snapshot();
    assert_eq!(set.by_role(Role::Prefill).len(), 1);
    assert_eq!(
        set.by_role(Role::Prefill)[0].id().as_str(),
        "http://p2:7100"
    );
    // And a new decode whose receiver has one port is refused against TP 2.
    inner.replace([
        Arc::new(declared("http://p2:7100", Role::Prefill, tp(2), None)),
        Arc::new(declared(
            "http://d1:7200",
            Role::Decode,
            None,
            Some(LmcacheReceiver::parse("10.0.0.8:7300:7400").unwrap()),
        )),
    ]);
    let refused = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        loop {
            if let Some(e) = source.last_error()
                && e.pairs[0].decode.as_str() == "http://d1:7200"
            {
                return e;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the set is refused");
    assert!(matches!(
        refused.pairs[0].mismatch,
        Mismatch::TpSize {
            prefill: 2,
            decode: 1,
            ..
        }
    ));
    // The refused decode is left out; the old one left the inner set, so no decode
    // is published (requests get 503 until a decode that pairs appears) while the
    // prefill in force stays.
    let set = source.snapshot();
    assert!(set.by_role(Role::Decode).is_empty());
    assert_eq!(
        set.by_role(Role::Prefill)[0].id().as_str(),
        "http://p2:7100"
    );
}

#[test]
fn prepare_refuses_an_unequal_pair_whose_receiver_declared_nothing() {
    let req = request(
        Api::Completions,
        r#"{"model":"m","prompt":"hi","max_tokens":4}"#,
    );
    // The receiver inserted plainly: pair validation cannot see the decode's size.
    let route = |prefill: Option<KvProfile>, decode: Option<KvProfile>| {
        let mut ext = http::Extensions::new();
        if let Some(p) = prefill {
            ext.insert(p);
        }
        let p = Endpoint::with_extensions("http://p:7100", Role::Prefill, ext).unwrap();
        let mut ext = http::Extensions::new();
        if let Some(d) = decode {
            ext.insert(d);
        }
        let facts = Facts::default()
            .with(Facts::KV_RECEIVER, receiver().to_string())
            .unwrap();
        let d = Endpoint::with_extensions("http://d:7200", Role::Decode, ext)
            .unwrap()
            .with_facts(facts);
        Route::new(Some(Arc::new(p)), Arc::new(d))
    };
    let refusal = |prefill, decode| {
        connector()
            .prepare(&route(prefill, decode), &req)
            .unwrap_err()
            .to_string()
    };
    let text = refusal(tp(1), None);
    assert!(
        text.contains("prefill endpoint http://p:7100 and decode endpoint http://d:7200")
            && text.contains("from tensor-parallel size 1 to 2"),
        "{text}"
    );
    let text = refusal(None, tp(4));
    assert!(
        text.contains("decode endpoint http://d:7200")
            && text.contains("tensor-parallel size 4")
            && text.contains("2 port(s)"),
        "{text}"
    );
    assert!(connector().prepare(&route(tp(2), tp(2)), &req).is_ok());
    assert!(connector().prepare(&route(None, None), &req).is_ok());
}

fn prefill_answer(body: String) -> PrefillAnswer {
    PrefillAnswer {
        status: http::StatusCode::OK,
        headers: HeaderMap::new(),
        body: Bytes::from(body),
    }
}

/// What the prefill answers is read with a ceiling: its first choice only (a list of
/// millions of `{}` is read, not built), and a usage or stop reason the client's
/// answer would hold is refused past 64 KiB, naming the field.
#[tokio::test]
async fn a_prefills_answer_is_read_within_ceilings() {
    let req = request(
        Api::Completions,
        r#"{"model":"m","prompt":[1,2,3],"max_tokens":5}"#,
    );
    let c = connector();
    let answer = |choices: &str, usage: &str| {
        prefill_answer(format!(
            r#"{{"id":"cmpl-p","created":1,"model":"m","choices":[{choices}],"usage":{usage},"kv_transfer_params":{{"first_tok":7}}}}"#
        ))
    };
    // Prepared and resolved (the prompt's ids known) as the orchestrator does.
    let prepared = || {
        let mut h = c.prepare(&route(Some(receiver())), &req).unwrap();
        h.ext.get_mut::<Plan>().unwrap().tokens = Some(vec![1, 2, 3].into());
        h
    };
    let one = r#"{"index":0,"text":" a","finish_reason":"length","stop_reason":null}"#;
    let many = format!("{one},{}", vec!["{}"; 1_000_000].join(","));
    let mut h = prepared();
    let found = c.complete(&mut h, &answer(&many, "null")).await.unwrap();
    assert_eq!(found, HandoffFound::Handed);
    let first = h.ext.get::<Plan>().unwrap().first.clone().unwrap();
    assert_eq!(first.text, " a");
    let big = format!(r#"{{"prompt_tokens":3,"x":"{}"}}"#, "a".repeat(70_000));
    let mut h = prepared();
    match c.complete(&mut h, &answer(one, &big)).await {
        Err(ConnectorError::InvalidHandoff { field, .. }) => assert_eq!(field, "usage"),
        other => panic!("{other:?}"),
    }
    let long_stop = one.replace(
        r#""stop_reason":null"#,
        &format!(r#""stop_reason":"{}""#, "s".repeat(70_000)),
    );
    let mut h = prepared();
    match c.complete(&mut h, &answer(&long_stop, "null")).await {
        Err(ConnectorError::InvalidHandoff { field, .. }) => assert_eq!(field, "choices"),
        other => panic!("{other:?}"),
    }
    // Within the ceilings, both are the client's.
    let mut h = prepared();
    let stop = one.replace(r#""stop_reason":null"#, r#""stop_reason":"\n""#);
    c.complete(
        &mut h,
        &answer(&stop, r#"{"prompt_tokens":3,"completion_tokens":1}"#),
    )
    .await
    .unwrap();
    let first = h.ext.get::<Plan>().unwrap().first.clone().unwrap();
    assert_eq!(first.stop_reason, json!("\n"));
    assert_eq!(first.usage.unwrap()["completion_tokens"], 1);
}

#[test]
fn a_completions_batch_is_a_list_holding_a_string_or_a_list() {
    for (prompt, batch) in [
        ("[1,2,3]", false),
        (r#"["a","b"]"#, true),
        ("[[1],[2]]", true),
        (r#"[1, "a"]"#, true),
        (r#""a""#, false),
        ("[]", false),
        ("[1,", false),
    ] {
        assert_eq!(
            prompt::kind(prompt.as_bytes()) == Kind::Batch,
            batch,
            "{prompt}"
        );
    }
}

/// The `/tokenize` body copies the client's values as written (never built: a message
/// list of `{}`s was ~95 bytes of `Value` per byte); a prompt of token ids needs none.
#[test]
fn the_tokenize_body_copies_the_clients_values() {
    let chat = JsonBody::parse(
        br#"{"model":"m","messages":[{"role":"user","content":"hi","x":1e400}],"chat_template_kwargs":{"a":[0, 0]},"add_generation_prompt":null}"#,
    )
    .unwrap();
    let out = tokenize_request(&chat, true);
    assert_eq!(
        std::str::from_utf8(&out).unwrap(),
        r#"{"model":"m","messages":[{"role":"user","content":"hi","x":1e400}],"add_generation_prompt":true,"chat_template_kwargs":{"a":[0, 0]}}"#
    );
    let text = JsonBody::parse(br#"{"model":"m","prompt":"hello"}"#).unwrap();
    let out = tokenize_request(&text, false);
    assert_eq!(&out[..], br#"{"model":"m","prompt":"hello"}"#);
    for (prompt, ids) in [
        ("[1,2,3]", true),
        ("[]", true),
        ("[1,-2]", false),
        ("[1,2.5]", false),
        (r#"[1,"a"]"#, false),
        ("[18446744073709551616]", false),
    ] {
        assert_eq!(
            prompt::kind(prompt.as_bytes()) == Kind::Ids,
            ids,
            "{prompt}"
        );
        let req = request(Api::Completions, &format!(r#"{{"prompt":{prompt}}}"#));
        match connector().prepare(&route(Some(receiver())), &req) {
            Ok(h) => {
                let plan = h.ext.get::<Plan>().unwrap();
                assert_eq!(plan.tokenize.is_none(), ids, "{prompt}");
            }
            // A batch, refused before any `/tokenize` body is made.
            Err(e) => assert!(!ids && e.to_string().contains("batch"), "{prompt}: {e}"),
        }
    }
}

/// `(counter, secret)` of an id of `c`'s (no secret: the scheme before).
fn id_parts(c: &Lmcache, id: &str) -> (u64, Option<String>) {
    let rest = id
        .strip_prefix(&format!("disagg-{:016x}-", c.prefix))
        .unwrap_or_else(|| panic!("{id}: not the connector's prefix"));
    match rest.split_once('-') {
        Some((n, secret)) => (n.parse().unwrap(), Some(secret.to_owned())),
        None => (rest.parse().unwrap(), None),
    }
}

/// The ids a peer that saw `id` would try next: the counter incremented, as the scheme
/// before wrote it (no secret), with `id`'s secret, and with its secret plus one.
fn predictions(c: &Lmcache, id: &str) -> Vec<String> {
    let (n, secret) = id_parts(c, id);
    let base = format!("disagg-{:016x}-{}", c.prefix, n + 1);
    let mut guesses = vec![base.clone()];
    if let Some(secret) = secret {
        let next = u64::from_str_radix(&secret, 16).unwrap().wrapping_add(1);
        guesses.push(format!("{base}-{secret}"));
        guesses.push(format!("{base}-{next:016x}"));
    }
    guesses
}

#[test]
fn request_ids_carry_64_bits_no_other_id_reveals() {
    let c = connector();
    let ids: Vec<String> = (0..1000).map(|_| c.next_req_id()).collect();
    let mut secrets = std::collections::HashSet::new();
    for (i, id) in ids.iter().enumerate() {
        // Short, and an opaque string LMCache carries as is.
        assert!(id.len() <= 64, "{id}");
        assert!(
            id.bytes()
                .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase() || b == b'-'),
            "{id}"
        );
        let (n, secret) = id_parts(&c, id);
        assert_eq!(n, i as u64);
        let secret = secret.unwrap_or_else(|| panic!("{id}: no secret"));
        assert_eq!(secret.len(), 16, "{id}");
        assert!(secret.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
        assert!(secrets.insert(secret), "{id}: a secret seen before");
    }
    // No id is another's with its counter, or its secret, moved on.
    let all: std::collections::HashSet<&String> = ids.iter().collect();
    for id in &ids {
        for guess in predictions(&c, id) {
            assert!(!all.contains(&guess), "{guess} guessed from {id}");
        }
    }
    // A second connector's ids are its own.
    let other = connector();
    assert_ne!(other.prefix, c.prefix);
}

#[tokio::test]
async fn a_notification_naming_a_predicted_id_completes_nothing() {
    use zeromq::{PushSocket, Socket, SocketSend, ZmqMessage};

    #[derive(serde::Serialize)]
    struct Notif<'a> {
        #[serde(rename = "type")]
        kind: &'a str,
        req_id: &'a str,
    }
    let patience = std::time::Duration::from_secs(20);
    let notifications = Notifications::bind("127.0.0.1:0", Default::default())
        .await
        .unwrap();
    let addr = notifications.local_addr().unwrap();
    let c = Lmcache::new(notifications);
    // A prefill saw one request's id; the next request waits for its KV.
    let seen = c.next_req_id();
    let waiting = c.next_req_id();
    let pending = c.notifications().register(&waiting, 1).unwrap();

    let mut push = PushSocket::new();
    tokio::time::timeout(patience, push.connect(&format!("tcp://{addr}")))
        .await
        .unwrap()
        .unwrap();
    let guesses = predictions(&c, &seen);
    for (i, id) in guesses.iter().chain([&waiting]).enumerate() {
        let wire = rmp_serde::to_vec_named(&Notif {
            kind: "ProxyNotif",
            req_id: id,
        })
        .unwrap();
        tokio::time::timeout(patience, push.send(ZmqMessage::from(wire)))
            .await
            .unwrap()
            .unwrap();
        if i + 1 == guesses.len() {
            // Every guess taken in, none counted for the request waiting.
            let deadline = tokio::time::Instant::now() + patience;
            loop {
                let stats = c.notifications().stats();
                if stats.unknown + stats.matched >= guesses.len() as u64 {
                    break;
                }
                assert!(tokio::time::Instant::now() < deadline, "guesses not read");
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            assert_eq!(c.notifications().stats().matched, 0, "{guesses:?}");
            assert_eq!(pending.received(), 0);
        }
    }
    // The real id completes it.
    tokio::time::timeout(patience, pending.ready())
        .await
        .unwrap()
        .unwrap();
    let stats = c.notifications().stats();
    assert_eq!((stats.matched, stats.unknown), (1, guesses.len() as u64));
}

/// Answers every request with `self.0`, as a prefill's `/tokenize` would.
struct Tokenizer(&'static str);

impl Transport for Tokenizer {
    fn send(&self, _req: http::Request<Bytes>) -> disagg_core::transport::ResponseFuture {
        let body = http_body_util::Full::new(Bytes::from_static(self.0.as_bytes()))
            .map_err(|never| match never {})
            .boxed();
        Box::pin(
            async move { Ok::<_, disagg_core::error::TransportError>(http::Response::new(body)) },
        )
    }
}

/// A prompt of more token ids than the connector carries, from the prefill's
/// `/tokenize` or from the client, fails the request (400) before any leg is sent or
/// any id is written into one; at the ceiling, it is carried.
#[tokio::test]
async fn a_prompt_past_the_token_ceiling_fails_before_any_leg() {
    assert_eq!(connector().max_prompt_tokens, MAX_PROMPT_TOKENS);
    let c = connector().with_max_prompt_tokens(4);
    let text = request(
        Api::Completions,
        r#"{"model":"m","prompt":"hi there","max_tokens":5}"#,
    );
    let five = Tokenizer(r#"{"count":5,"max_model_len":8,"tokens":[1,2,3,4,5]}"#);
    let ids = request(
        Api::Completions,
        r#"{"model":"m","prompt":[1,2,3,4,5],"max_tokens":5}"#,
    );
    for req in [&text, &ids] {
        let mut h = c.prepare(&route(Some(receiver())), req).unwrap();
        let before = h.decode.body.get("prompt").map(<[u8]>::to_vec);
        let err = c.resolve(&mut h, &five).await.unwrap_err();
        assert!(matches!(err, ConnectorError::Unsupported { .. }), "{err:?}");
        // Counted no further than the first id past the ceiling.
        assert!(
            err.to_string()
                .contains("a prompt of more than 4 token ids"),
            "{err}"
        );
        let pd = disagg_core::error::PdError::connector(disagg_core::error::Side::Prefill, err);
        assert_eq!(pd.http().status.as_u16(), 400);
        assert_eq!(h.decode.body.get("prompt").map(<[u8]>::to_vec), before);
        assert!(h.gate.is_none());
        assert!(h.ext.get::<Plan>().unwrap().tokens.is_none());
    }
    let four = Tokenizer(r#"{"count":4,"max_model_len":16,"tokens":[1,2,3,4]}"#);
    let mut h = c.prepare(&route(Some(receiver())), &text).unwrap();
    c.resolve(&mut h, &four).await.unwrap();
    assert_eq!(h.decode.body.get("prompt"), Some(&b"[1,2,3,4]"[..]));
}

/// Answers `/tokenize` with `{"tokens":[0,0,...]}` of `chunks` frames of 1 KiB of ids,
/// counting the bytes the reader pulled.
struct Streaming {
    chunks: usize,
    polled: Arc<AtomicU64>,
}

impl Transport for Streaming {
    fn send(&self, _req: http::Request<Bytes>) -> disagg_core::transport::ResponseFuture {
        use futures::StreamExt as _;
        let ids = Bytes::from("0,".repeat(512));
        let polled = Arc::clone(&self.polled);
        let parts = std::iter::once(Bytes::from_static(br#"{"count":1,"tokens":["#))
            .chain(std::iter::repeat_n(ids, self.chunks))
            .chain(std::iter::once(Bytes::from_static(b"0]}")));
        let frames = futures::stream::iter(parts).map(move |b| {
            polled.fetch_add(b.len() as u64, Ordering::Relaxed);
            Ok::<_, BoxError>(Frame::data(b))
        });
        let body = BoxBody::new(http_body_util::StreamBody::new(frames));
        Box::pin(
            async move { Ok::<_, disagg_core::error::TransportError>(http::Response::new(body)) },
        )
    }
}

/// A `/tokenize` answer of more ids than the connector carries is refused (400) after
/// reading a few KiB of it, not the whole answer: what may be read is derived from the
/// ceiling (`disagg_tokenize::engine::answer_limit`). An answer of as many ids as the
/// ceiling, each of a `u32`'s ten digits and written with `", "`, is carried.
#[tokio::test]
async fn a_tokenize_answer_past_the_ceiling_is_refused_after_a_few_kib() {
    let c = connector().with_max_prompt_tokens(4);
    let text = request(
        Api::Completions,
        r#"{"model":"m","prompt":"hi there","max_tokens":5}"#,
    );
    let polled = Arc::new(AtomicU64::new(0));
    // 8 MiB of ids: some four million.
    let engine = Streaming {
        chunks: 8 * 1024,
        polled: Arc::clone(&polled),
    };
    let mut h = c.prepare(&route(Some(receiver())), &text).unwrap();
    let err = c.resolve(&mut h, &engine).await.unwrap_err();
    let read = polled.load(Ordering::Relaxed);
    assert!(read <= 8 * 1024, "{read} bytes read");
    assert!(matches!(err, ConnectorError::Unsupported { .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains("a prompt of more than 4 token ids"),
        "{err}"
    );
    let pd = disagg_core::error::PdError::connector(disagg_core::error::Side::Prefill, err);
    assert_eq!(pd.http().status.as_u16(), 400);
    assert!(h.gate.is_none());

    let widest = Tokenizer(
        r#"{"count":4, "max_model_len":131072, "tokens":[4294967295, 4294967295, 4294967295, 4294967295], "token_strs":null}"#,
    );
    let mut h = c.prepare(&route(Some(receiver())), &text).unwrap();
    c.resolve(&mut h, &widest).await.unwrap();
    assert_eq!(
        h.decode.body.get("prompt"),
        Some(&b"[4294967295,4294967295,4294967295,4294967295]"[..])
    );
}

/// `work`'s output, and how many turns another task of the same (current-thread) event
/// loop took while it ran: none when the work never waits, some when it hands work to
/// the blocking pool and waits for it.
fn ticks_while<F: std::future::Future>(work: F) -> (F::Output, u64) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(async {
        let ticks = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&ticks);
        let ticker = tokio::spawn(async move {
            loop {
                counted.fetch_add(1, Ordering::Relaxed);
                tokio::task::yield_now().await;
            }
        });
        let out = work.await;
        let seen = ticks.load(Ordering::Relaxed);
        ticker.abort();
        (out, seen)
    })
}

/// Prompt token ids from 256 KiB of JSON on, the `/tokenize` answer's or the client's,
/// are decoded on the blocking pool, not on the event loop; fewer inline. The ids are
/// the same either way.
#[test]
fn large_id_lists_are_decoded_off_the_event_loop() {
    for (n, off_loop) in [(100_u64, false), (80_000, true)] {
        let ids: Vec<u64> = (0..n).map(|i| i * 7 % 128_000).collect();
        let list = serde_json::to_string(&ids).unwrap();
        assert_eq!(list.len() >= 256 * 1024, off_loop, "{n} ids");
        let answer: &'static str =
            Box::leak(format!(r#"{{"count":{n},"tokens":{list}}}"#).into_boxed_str());
        // A limit of 1: no context length asked (its probe is not this test's).
        let text = request(
            Api::Completions,
            r#"{"model":"m","prompt":"hi there","max_tokens":1}"#,
        );
        let client = request(
            Api::Completions,
            &format!(r#"{{"model":"m","prompt":{list},"max_tokens":1}}"#),
        );
        for req in [&text, &client] {
            let c = connector();
            let mut h = c.prepare(&route(Some(receiver())), req).unwrap();
            let (got, ticks) = ticks_while(c.resolve(&mut h, &Tokenizer(answer)));
            got.unwrap();
            assert_eq!(ticks > 0, off_loop, "{n} ids: {ticks} ticks");
            assert_eq!(h.decode.body.get("prompt"), Some(list.as_bytes()));
        }
    }
}

/// A chat with media parts is refused (400) before any leg: LMCache's legs are
/// token-id completions, so the image would reach neither engine and the answer would
/// be made without it. A text chat is prepared as before.
#[test]
fn a_chat_with_media_is_refused_before_any_leg() {
    let c = connector();
    let image = request(
        Api::Chat,
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"what is it?"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AA=="}}]}]}"#,
    );
    let err = c.prepare(&route(Some(receiver())), &image).unwrap_err();
    assert!(matches!(err, ConnectorError::Unsupported { .. }), "{err:?}");
    assert!(err.to_string().contains("image_url"), "{err}");
    let pd = disagg_core::error::PdError::connector(disagg_core::error::Side::Prefill, err);
    assert_eq!(pd.http().status.as_u16(), 400);
    let text = request(
        Api::Chat,
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"the word \"image_url\""}]}]}"#,
    );
    assert!(c.prepare(&route(Some(receiver())), &text).is_ok());
}

mod fault;
mod kinds;
mod legs;
mod remembered;
mod room;
