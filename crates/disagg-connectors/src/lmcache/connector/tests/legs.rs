//! The sampling fields of the two legs: each read as vLLM reads it (lax numbers), and
//! split between the prefill, whose token is the client's first, and the decode, which
//! makes the rest, so that the client gets what one engine would have answered.

use super::*;

/// `body` of `api` prepared and resolved (the prompt's ids known, as `resolve` leaves
/// them), then completed with a prefill's answer of one token ending `finish` (`None`:
/// an answer without a first token).
async fn completed(api: Api, body: &str, finish: Option<&str>) -> (Handoff, HandoffFound) {
    let c = connector();
    let mut h = c
        .prepare(&route(Some(receiver())), &request(api, body))
        .unwrap();
    h.ext.get_mut::<Plan>().unwrap().tokens = Some(vec![1, 2, 3].into());
    let answer = match finish {
        Some(finish) => format!(
            r#"{{"id":"cmpl-p","created":1,"model":"m","choices":[{{"index":0,"text":" a","finish_reason":"{finish}","stop_reason":null}}],"usage":null,"kv_transfer_params":{{"first_tok":7}}}}"#
        ),
        None => r#"{"id":"cmpl-p","choices":[{"index":0,"text":" a","finish_reason":"length"}],"usage":null}"#.to_owned(),
    };
    let found = c.complete(&mut h, &prefill_answer(answer)).await.unwrap();
    (h, found)
}

fn json_of(b: &JsonBody) -> Value {
    serde_json::from_slice(&b.to_bytes()).unwrap()
}

/// vLLM reads `n`, `best_of`, `max_tokens` and `min_tokens` as pydantic's lax `int`
/// (`"2"`, `5.0`): so does the connector. A string `n` above 1 is refused as a number
/// would be; the prefill leg asks for one choice; a string `max_tokens` is the budget
/// the decode continues within, and a `"1"` ends the answer at the prefill's token.
#[tokio::test]
async fn sampling_numbers_are_read_as_vllm_reads_them() {
    for several in [
        r#"{"prompt":"p","n":"2"}"#,
        r#"{"prompt":"p","n":2.0}"#,
        r#"{"prompt":"p","best_of":"3"}"#,
    ] {
        let err = connector()
            .prepare(
                &route(Some(receiver())),
                &request(Api::Completions, several),
            )
            .unwrap_err();
        assert!(
            matches!(err, ConnectorError::Unsupported { .. }),
            "{several}: {err:?}"
        );
    }
    let (h, found) = completed(
        Api::Completions,
        r#"{"prompt":[1,2,3],"max_tokens":"5","n":"1","best_of":1.0}"#,
        Some("length"),
    )
    .await;
    assert_eq!(found, HandoffFound::Handed);
    let p = json_of(&h.prefill.body);
    assert_eq!((&p["n"], &p["best_of"]), (&json!(1), &json!(1)), "{p}");
    assert_eq!(json_of(&h.decode.body)["max_tokens"], 4);
    let (_, found) = completed(
        Api::Completions,
        r#"{"prompt":[1,2,3],"max_tokens":"1"}"#,
        Some("length"),
    )
    .await;
    assert_eq!(found, HandoffFound::Finished);
    let (h, _) = completed(
        Api::Chat,
        r#"{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":"6.0"}"#,
        Some("length"),
    )
    .await;
    assert_eq!(json_of(&h.decode.body)["max_tokens"], 5);
}

/// The prefill's token is the client's first: a client's `min_tokens` of 1 or more
/// holds for it (an EOS or a stop there would end the answer after one token), and the
/// decode owes one token less, as its `max_tokens` is one less.
#[tokio::test]
async fn min_tokens_hold_for_the_prefills_token_and_the_decode_owes_the_rest() {
    for min in ["5", "\"5\"", "5.0"] {
        let body = format!(r#"{{"prompt":[1,2,3],"max_tokens":20,"min_tokens":{min}}}"#);
        let (h, found) = completed(Api::Completions, &body, Some("length")).await;
        assert_eq!(found, HandoffFound::Handed);
        assert_eq!(json_of(&h.prefill.body)["min_tokens"], 1, "{min}");
        let d = json_of(&h.decode.body);
        assert_eq!(
            (&d["min_tokens"], &d["max_tokens"]),
            (&json!(4), &json!(19))
        );
    }
    for none in [r#","min_tokens":0"#, ""] {
        let body = format!(r#"{{"prompt":[1,2,3],"max_tokens":20{none}}}"#);
        let (h, _) = completed(Api::Completions, &body, Some("length")).await;
        assert!(
            json_of(&h.prefill.body).get("min_tokens").is_none(),
            "{body}"
        );
    }
}

/// The decode's budget is the client's limit read as vLLM reads it: completions'
/// `max_tokens`, 16 when the key is absent and the rest of the context when it is
/// `null`; chat's `max_completion_tokens`, else `max_tokens`, none meaning the rest of
/// the context. Both legs are completions requests, which vLLM fails on a `null`: the
/// rest of the context is asked for in numbers once the context length is known
/// (`a_decode_without_a_client_limit_gets_the_rest_of_the_context`); here it is not
/// (`resolve`, which learns it, did not run), and the key is left out. A decode that
/// computes the whole answer (no first token) carries the client's budget,
/// undiminished.
#[tokio::test]
async fn the_decode_gets_the_token_limit_vllm_reads() {
    let chat =
        |limits: &str| format!(r#"{{"messages":[{{"role":"user","content":"hi"}}]{limits}}}"#);
    let cases: [(Api, String, Value, Value); 8] = [
        (
            Api::Completions,
            r#"{"prompt":[1,2,3]}"#.into(),
            json!(15),
            json!(16),
        ),
        (Api::Chat, chat(""), Value::Null, Value::Null),
        (
            Api::Completions,
            r#"{"prompt":[1,2,3],"max_tokens":null}"#.into(),
            Value::Null,
            Value::Null,
        ),
        (
            Api::Chat,
            chat(r#","max_tokens":null"#),
            Value::Null,
            Value::Null,
        ),
        (
            Api::Chat,
            chat(r#","max_completion_tokens":null"#),
            Value::Null,
            Value::Null,
        ),
        (
            Api::Chat,
            chat(r#","max_completion_tokens":null,"max_tokens":"7""#),
            json!(6),
            json!(7),
        ),
        (
            Api::Chat,
            chat(r#","max_completion_tokens":4,"max_tokens":9"#),
            json!(3),
            json!(4),
        ),
        (
            Api::Chat,
            chat(r#","max_completion_tokens":5.0,"max_tokens":null"#),
            json!(4),
            json!(5),
        ),
    ];
    // `Value::Null`: no key at all.
    let key = |v: Value| Some(v).filter(|v| !v.is_null());
    for (api, body, handed, whole) in cases {
        let (h, found) = completed(api, &body, Some("length")).await;
        assert_eq!(found, HandoffFound::Handed, "{body}");
        let d = json_of(&h.decode.body);
        assert_eq!(d.get("max_tokens").cloned(), key(handed), "{body}: {d}");
        let (h, found) = completed(api, &body, None).await;
        assert_eq!(found, HandoffFound::Missing, "{body}");
        let d = json_of(&h.decode.body);
        assert_eq!(d.get("max_tokens").cloned(), key(whole), "{body}: {d}");
    }
}

/// Completions `echo` puts the prompt in front of the answer: the prefill's answer,
/// relayed first, carries it, and a decode continuing after the prefill's token does
/// not repeat it. A decode that computes the whole answer (no first token) keeps it.
#[tokio::test]
async fn a_completions_echo_shows_the_prompt_once() {
    let body = r#"{"prompt":[1,2,3],"max_tokens":5,"echo":true}"#;
    let (h, found) = completed(Api::Completions, body, Some("length")).await;
    assert_eq!(found, HandoffFound::Handed);
    assert_eq!(json_of(&h.prefill.body)["echo"], true);
    assert!(json_of(&h.decode.body).get("echo").is_none());
    let (h, found) = completed(Api::Completions, body, None).await;
    assert_eq!(found, HandoffFound::Missing);
    assert_eq!(json_of(&h.decode.body)["echo"], true);
}

/// Chat's `echo` puts the last message in front of the answer when its role is the
/// answer's: the assistant's under `add_generation_prompt` (true by default), the last
/// message's own without it. The completions legs cannot say that (theirs would repeat
/// the whole templated prompt), so such a request is served by a decode alone. An
/// `echo` that would put nothing in front (a user's last message under the generation
/// prompt), or a false one, is dropped from both legs, which disaggregate.
#[tokio::test]
async fn a_chat_echo_is_served_by_a_decode_alone_when_it_echoes() {
    let chat = |last: &str, rest: &str| {
        request(
            Api::Chat,
            &format!(r#"{{"messages":[{{"role":"user","content":"Say"}},{last}]{rest}}}"#),
        )
    };
    let assistant = r#"{"role":"assistant","content":"Once"}"#;
    let user = r#"{"role":"user","content":"Once"}"#;
    let c = connector();
    let echoed = [
        (
            assistant,
            r#","add_generation_prompt":false,"continue_final_message":true,"echo":true"#,
        ),
        (assistant, r#","add_generation_prompt":false,"echo":"yes""#),
        (assistant, r#","echo":1"#),
        (assistant, r#","add_generation_prompt":true,"echo":true"#),
        (
            r#"{"role":"assist\u0061nt","content":"Once"}"#,
            r#","echo":true"#,
        ),
        (user, r#","add_generation_prompt":false,"echo":true"#),
        (user, r#","add_generation_prompt":"off","echo":true"#),
    ];
    for (last, rest) in echoed {
        assert_eq!(
            c.check(&chat(last, rest)).unwrap(),
            Decision::Direct { reason: "echo" },
            "{last}{rest}"
        );
    }
    // Messages past `READ_OFF_LOOP_FROM` are not walked on the event loop for their
    // last role: their `echo` is taken as one that echoes.
    let long = request(
        Api::Chat,
        &format!(
            r#"{{"messages":[{{"role":"user","content":"{}"}},{user}],"echo":true}}"#,
            "a".repeat(READ_OFF_LOOP_FROM)
        ),
    );
    assert_eq!(c.check(&long).unwrap(), Decision::Direct { reason: "echo" });
    let r = route(Some(receiver()));
    for (last, rest) in [
        (user, r#","echo":true"#),
        (user, r#","add_generation_prompt":"yes","echo":true"#),
        (assistant, r#","add_generation_prompt":false,"echo":false"#),
    ] {
        let req = chat(last, rest);
        assert_eq!(
            c.check(&req).unwrap(),
            Decision::Disaggregate,
            "{last}{rest}"
        );
        let h = c.prepare(&r, &req).unwrap();
        assert!(json_of(&h.prefill.body).get("echo").is_none());
        assert!(json_of(&h.decode.body).get("echo").is_none());
    }
}

/// `body` of `api` prepared, resolved against a prefill whose `/tokenize` answers
/// `tokenize`, then completed with a prefill's answer of one token (`first`) or of
/// none.
async fn through_tokenize(
    api: Api,
    body: &str,
    tokenize: &'static str,
    first: bool,
) -> (Handoff, HandoffFound) {
    let c = connector();
    let mut h = c
        .prepare(&route(Some(receiver())), &request(api, body))
        .unwrap();
    c.resolve(&mut h, &Tokenizer(tokenize)).await.unwrap();
    let answer = if first {
        r#"{"id":"cmpl-p","created":1,"model":"m","choices":[{"index":0,"text":" a","finish_reason":"length","stop_reason":null}],"usage":null,"kv_transfer_params":{"first_tok":7}}"#
    } else {
        r#"{"id":"cmpl-p","choices":[{"index":0,"text":" a","finish_reason":"length"}],"usage":null}"#
    };
    let found = c
        .complete(&mut h, &prefill_answer(answer.to_owned()))
        .await
        .unwrap();
    (h, found)
}

/// vLLM's completions route fails a `"max_tokens": null` (an assertion on every
/// output), so the decode leg, a completions request, never carries one. A client
/// without a limit (a chat without one, a completions `null`) gets the rest of the
/// context: `max_model_len` from the prefill's `/tokenize` answer less the decode's
/// prompt (the ids, and the prefill's token when it continues after it). When the
/// prefill's token filled the context, the answer ends there. When the prefill's
/// answer gives no `max_model_len` the key is left out (vLLM's 16); a client's limit
/// is unchanged.
#[tokio::test]
async fn a_decode_without_a_client_limit_gets_the_rest_of_the_context() {
    let chat =
        |limits: &str| format!(r#"{{"messages":[{{"role":"user","content":"hi"}}]{limits}}}"#);
    let eight = r#"{"count":5,"max_model_len":8,"tokens":[1,2,3,4,5]}"#;
    let unbounded = [
        (Api::Chat, chat("")),
        (Api::Chat, chat(r#","max_tokens":null"#)),
        (
            Api::Completions,
            r#"{"prompt":"hi","max_tokens":null}"#.to_owned(),
        ),
    ];
    for (api, body) in &unbounded {
        let (h, found) = through_tokenize(*api, body, eight, true).await;
        assert_eq!(found, HandoffFound::Handed, "{body}");
        let d = json_of(&h.decode.body);
        assert_eq!(d.get("max_tokens"), Some(&json!(2)), "{body}: {d}");
        let (h, found) = through_tokenize(*api, body, eight, false).await;
        assert_eq!(found, HandoffFound::Missing, "{body}");
        let d = json_of(&h.decode.body);
        assert_eq!(d.get("max_tokens"), Some(&json!(3)), "{body}: {d}");
    }
    // The prefill's token filled the context: no decode leg.
    let six = r#"{"count":5,"max_model_len":6,"tokens":[1,2,3,4,5]}"#;
    let (h, found) = through_tokenize(Api::Chat, &chat(""), six, true).await;
    assert_eq!(found, HandoffFound::Finished);
    assert!(h.gate.is_none());
    // No context length known: vLLM's completions default.
    for unknown in [
        r#"{"count":5,"tokens":[1,2,3,4,5]}"#,
        r#"{"count":5,"max_model_len":0,"tokens":[1,2,3,4,5]}"#,
    ] {
        for first in [true, false] {
            let (h, _) = through_tokenize(Api::Chat, &chat(""), unknown, first).await;
            let d = json_of(&h.decode.body);
            assert!(d.get("max_tokens").is_none(), "{unknown}: {d}");
        }
    }
    // A client's limit is the budget, whatever the context (one wide enough to hold
    // it: a limit above the room is refused, `room.rs`).
    let sixteen = r#"{"count":5,"max_model_len":16,"tokens":[1,2,3,4,5]}"#;
    let (h, _) = through_tokenize(Api::Chat, &chat(r#","max_tokens":4"#), sixteen, true).await;
    assert_eq!(json_of(&h.decode.body)["max_tokens"], 3);
}

/// Answers every request with `answer`, as a prefill's `/tokenize` would, keeping the
/// path and body of each.
struct Asked {
    answer: &'static str,
    asked: std::sync::Mutex<Vec<(String, Bytes)>>,
}

impl Asked {
    fn new(answer: &'static str) -> Self {
        Asked {
            answer,
            asked: std::sync::Mutex::default(),
        }
    }

    fn asked(&self) -> Vec<(String, Bytes)> {
        self.asked.lock().map(|a| a.clone()).unwrap_or_default()
    }
}

impl Transport for Asked {
    fn send(&self, req: http::Request<Bytes>) -> disagg_core::transport::ResponseFuture {
        if let Ok(mut asked) = self.asked.lock() {
            asked.push((req.uri().path().to_owned(), req.body().clone()));
        }
        let body = http_body_util::Full::new(Bytes::from_static(self.answer.as_bytes()))
            .map_err(|never| match never {})
            .boxed();
        Box::pin(
            async move { Ok::<_, disagg_core::error::TransportError>(http::Response::new(body)) },
        )
    }
}

/// A prefill's answer of one token that leaves room for more (`first`), or of none.
fn first_token(first: bool) -> PrefillAnswer {
    prefill_answer(if first {
        r#"{"id":"cmpl-p","created":1,"model":"m","choices":[{"index":0,"text":" a","finish_reason":"length","stop_reason":null}],"usage":null,"kv_transfer_params":{"first_tok":7}}"#.to_owned()
    } else {
        r#"{"id":"cmpl-p","choices":[{"index":0,"text":" a","finish_reason":"length"}],"usage":null}"#.to_owned()
    })
}

/// A client without a limit gets the rest of the context even when no `/tokenize` was
/// asked for its prompt (ids a token-reading router made, or the client's own): the
/// context length is asked of the prefill's `/tokenize` (any text; only its
/// `max_model_len` is read). A request with a limit asks it too (the limit's room is
/// checked, `room.rs`), its limit being the budget. Each request here has a connector
/// of its own: one remembers the length it learned for 10 s (`remembered.rs`).
#[tokio::test]
async fn a_decode_without_a_limit_gets_the_rest_of_the_context_when_the_ids_are_known() {
    let routed = |body: &str| {
        let mut req = request(Api::Chat, body);
        req.set_tokens(Some(Arc::from(vec![5_u32, 6])));
        req
    };
    let chat = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let unbounded = [
        routed(chat),
        request(
            Api::Completions,
            r#"{"model":"m","prompt":[5,6],"max_tokens":null}"#,
        ),
    ];
    // A context of 8: 8 - 3 after the ids and the prefill's token, 8 - 2 without it.
    let eight = r#"{"count":1,"max_model_len":8,"tokens":[9]}"#;
    for req in &unbounded {
        for (first, left) in [(true, 5), (false, 6)] {
            let (c, engine) = (connector(), Asked::new(eight));
            let mut h = c.prepare(&route(Some(receiver())), req).unwrap();
            c.resolve(&mut h, &engine).await.unwrap();
            assert_eq!(
                engine.asked(),
                [(
                    "/tokenize".to_owned(),
                    Bytes::from_static(br#"{"model":"m","prompt":"."}"#)
                )]
            );
            c.complete(&mut h, &first_token(first)).await.unwrap();
            let d = json_of(&h.decode.body);
            assert_eq!(
                d["prompt"].as_array().map(Vec::len),
                Some(2 + usize::from(first))
            );
            assert_eq!(d.get("max_tokens"), Some(&json!(left)), "{d}");
        }
    }
    // With a limit, the context is asked for its room; the limit is the budget.
    let (c, engine) = (connector(), Asked::new(eight));
    let limited =
        routed(r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4}"#);
    let mut h = c.prepare(&route(Some(receiver())), &limited).unwrap();
    c.resolve(&mut h, &engine).await.unwrap();
    assert_eq!(
        engine.asked(),
        [(
            "/tokenize".to_owned(),
            Bytes::from_static(br#"{"model":"m","prompt":"."}"#)
        )]
    );
    c.complete(&mut h, &first_token(true)).await.unwrap();
    assert_eq!(json_of(&h.decode.body)["max_tokens"], 3);
    // A text prompt's own `/tokenize` tells the context: asked once.
    let (c, engine) = (
        connector(),
        Asked::new(r#"{"count":2,"max_model_len":8,"tokens":[5,6]}"#),
    );
    let text = request(Api::Chat, chat);
    let mut h = c.prepare(&route(Some(receiver())), &text).unwrap();
    c.resolve(&mut h, &engine).await.unwrap();
    assert_eq!(engine.asked().len(), 1);
    c.complete(&mut h, &first_token(true)).await.unwrap();
    assert_eq!(json_of(&h.decode.body)["max_tokens"], 5);
}

/// vLLM refuses a `min_tokens` above the tokens a request may generate (its limit, or
/// the context less the prompt) before generating any: so does the connector, before
/// the prefill runs, with a 400 in OpenAI's format naming no engine. Without it the
/// decode leg (`min_tokens - 1` above its `max_tokens`) would be refused after the
/// client had its first token. A limit the context cannot hold is refused first, in
/// vLLM's words for the limit, as vLLM checks the limit against the context before it
/// reads the `min_tokens`. At the room left, the request is carried.
#[tokio::test]
async fn a_min_tokens_above_the_room_left_is_refused_before_the_prefill() {
    let c = connector();
    // A context of 8 and a prompt of 5: 3 tokens for the answer.
    let five = r#"{"count":5,"max_model_len":8,"tokens":[1,2,3,4,5]}"#;
    let chat = |extra: &str| {
        format!(r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}]{extra}}}"#)
    };
    // A limit of 10 and a `min_tokens` of 4, both above the room: the limit's refusal.
    let mut h = c
        .prepare(
            &route(Some(receiver())),
            &request(
                Api::Chat,
                &chat(r#","min_tokens":4,"max_completion_tokens":10"#),
            ),
        )
        .unwrap();
    let err = c.resolve(&mut h, &Tokenizer(five)).await.unwrap_err();
    let (code, body) = super::fault::answered(err);
    assert_eq!(code, 400, "{body}");
    assert_eq!(body["error"]["param"], "max_tokens", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("'max_tokens' or 'max_completion_tokens' is too large: 10."),
        "{message}"
    );
    // A limit of 3, which the room holds, and a `min_tokens` of 4 above both: refused
    // for the limit (vLLM's `min_tokens` at most the `max_tokens`), in its own words.
    let mut h = c
        .prepare(
            &route(Some(receiver())),
            &request(
                Api::Chat,
                &chat(r#","min_tokens":4,"max_completion_tokens":3"#),
            ),
        )
        .unwrap();
    let err = c.resolve(&mut h, &Tokenizer(five)).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("a `min_tokens` of 4 above its token limit (3)"),
        "{err}"
    );
    for extra in [
        r#","min_tokens":4"#,
        r#","min_tokens":"4","max_tokens":null"#,
    ] {
        let mut h = c
            .prepare(&route(Some(receiver())), &request(Api::Chat, &chat(extra)))
            .unwrap();
        let err = c.resolve(&mut h, &Tokenizer(five)).await.unwrap_err();
        assert!(
            matches!(err, ConnectorError::Unsupported { .. }),
            "{extra}: {err:?}"
        );
        assert!(h.gate.is_none(), "{extra}");
        let (code, body) = super::fault::answered(err);
        assert_eq!(code, 400, "{body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("`min_tokens` of 4") && message.contains("leaves 3"),
            "{message}"
        );
    }
    // Ids a router made, the context learned: the same.
    let mut routed = request(Api::Chat, &chat(r#","min_tokens":7"#));
    routed.set_tokens(Some(Arc::from(vec![5_u32, 6])));
    let mut h = c.prepare(&route(Some(receiver())), &routed).unwrap();
    let err = c
        .resolve(
            &mut h,
            &Asked::new(r#"{"count":1,"max_model_len":8,"tokens":[9]}"#),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("leaves 6"), "{err}");
    // At the room left: the decode owes one token less, within one less.
    for (first, min, max) in [(true, 2, 2), (false, 3, 3)] {
        let mut h = c
            .prepare(
                &route(Some(receiver())),
                &request(Api::Chat, &chat(r#","min_tokens":3"#)),
            )
            .unwrap();
        c.resolve(&mut h, &Tokenizer(five)).await.unwrap();
        c.complete(&mut h, &first_token(first)).await.unwrap();
        let d = json_of(&h.decode.body);
        assert_eq!(
            (&d["min_tokens"], &d["max_tokens"]),
            (&json!(min), &json!(max))
        );
    }
}

/// A client with a limit and a `min_tokens` within it, whose ids were known without a
/// `/tokenize`: the context length is asked of the prefill's `/tokenize` for the
/// limit's room (`room.rs`), and a limit above it is refused (400, vLLM's words for the
/// limit, as vLLM checks it first) before the prefill, whatever the `min_tokens`; one
/// the room holds holds the `min_tokens` too. At the room left the request is
/// carried. A `min_tokens` above a limit the room holds is refused in words of its
/// own, by the limit alone, nothing asked. Each request here has a connector of its
/// own: one remembers the length it learned for 10 s (`remembered.rs`).
#[tokio::test]
async fn a_min_tokens_with_a_limit_is_checked_against_the_room_when_the_ids_are_known() {
    let eight = r#"{"count":1,"max_model_len":8,"tokens":[9]}"#;
    let probe = [(
        "/tokenize".to_owned(),
        Bytes::from_static(br#"{"model":"m","prompt":"."}"#),
    )];
    let routed = |extra: &str| {
        let mut req = request(
            Api::Chat,
            &format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"max_tokens":10{extra}}}"#
            ),
        );
        req.set_tokens(Some(Arc::from(vec![5_u32, 6])));
        req
    };
    // Ids a router made, and the client's own: a context of 8 leaves 6 after 2 ids.
    let client_ids = request(
        Api::Completions,
        r#"{"model":"m","prompt":[5,6],"max_tokens":10,"min_tokens":7}"#,
    );
    for req in [routed(r#","min_tokens":7"#), client_ids] {
        let (c, engine) = (connector(), Asked::new(eight));
        let mut h = c.prepare(&route(Some(receiver())), &req).unwrap();
        let err = c.resolve(&mut h, &engine).await.unwrap_err();
        assert_eq!(engine.asked(), probe);
        assert!(h.gate.is_none());
        let (code, body) = super::fault::answered(err);
        assert_eq!(code, 400, "{body}");
        assert_eq!(body["error"]["param"], "max_tokens", "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.starts_with(
                "'max_tokens' or 'max_completion_tokens' is too large: 10. This model's maximum context length is 8 tokens and your request has 2 input tokens (10 > 8 - 2)."
            ),
            "{message}"
        );
    }
    // At the room left (a context of 12 leaves 10 after 2 ids, the limit's room too):
    // carried, the decode owing one token less.
    let twelve = r#"{"count":1,"max_model_len":12,"tokens":[9]}"#;
    let (c, engine) = (connector(), Asked::new(twelve));
    let mut h = c
        .prepare(&route(Some(receiver())), &routed(r#","min_tokens":10"#))
        .unwrap();
    c.resolve(&mut h, &engine).await.unwrap();
    assert_eq!(engine.asked(), probe);
    c.complete(&mut h, &first_token(true)).await.unwrap();
    let d = json_of(&h.decode.body);
    assert_eq!((&d["min_tokens"], &d["max_tokens"]), (&json!(9), &json!(9)));
    // Without a `min_tokens` the room could refuse, the limit's room is asked for
    // still; a `min_tokens` above the limit is refused by it alone, nothing asked.
    for (extra, asked, refused) in [
        ("", true, false),
        (r#","min_tokens":1"#, true, false),
        (r#","min_tokens":11"#, false, true),
    ] {
        let (c, engine) = (connector(), Asked::new(twelve));
        let mut h = c.prepare(&route(Some(receiver())), &routed(extra)).unwrap();
        let resolved = c.resolve(&mut h, &engine).await;
        let want = if asked { probe.to_vec() } else { Vec::new() };
        assert_eq!(engine.asked(), want, "{extra}");
        match resolved {
            Err(e) if refused => assert!(
                e.to_string().contains("above its token limit (10)"),
                "{extra}: {e}"
            ),
            r => assert_eq!(r.is_ok(), !refused, "{extra}: {r:?}"),
        }
    }
}
