//! `EngineTokenizer` against the simulated engine's `POST /tokenize` over loopback: the
//! ids are the engine's, token-id prompts never reach it, and its failures are typed;
//! and, over a transport that answers at once, large bodies are read off the event loop.

mod ticks;

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use disagg_core::error::TransportError;
use disagg_core::transport::{ResponseFuture, Transport};
use disagg_core::{Endpoint, Role, json::JsonBody, request::Api};
use disagg_http::HttpTransport;
use disagg_sim::{SimConfig, SimEngine};
use disagg_tokenize::prompt::READ_OFF_LOOP_FROM;
use disagg_tokenize::{EngineError, EngineTokenizer, Tokenize, TokenizeError};
use http_body_util::BodyExt;
use ticks::ticks_while;

async fn engine() -> SimEngine {
    SimEngine::start(SimConfig {
        model: "sim-model".into(),
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

fn tokenizer(url: &str) -> EngineTokenizer {
    let transport: Arc<dyn Transport> = Arc::new(HttpTransport::default());
    EngineTokenizer::new(
        transport,
        Arc::new(Endpoint::new(url, Role::Prefill).unwrap()),
    )
}

async fn tokenize(t: &EngineTokenizer, api: Api, body: &str) -> Result<Vec<u32>, TokenizeError> {
    t.tokenize(api, &JsonBody::parse(body.as_bytes()).unwrap())
        .await
        .map(|ids| ids.to_vec())
}

#[tokio::test]
async fn text_and_chat_prompts_get_the_engines_ids() {
    let e = engine().await;
    let t = tokenizer(&e.url());
    let text = "the prefix cache of the engine";
    let ids = tokenize(
        &t,
        Api::Completions,
        &format!(r#"{{"model":"sim-model","prompt":"{text}"}}"#),
    )
    .await
    .unwrap();
    assert_eq!(ids, disagg_sim::tokenize(text));

    // The simulator's template is each message's content on a line of its own.
    let ids = tokenize(
        &t,
        Api::Chat,
        r#"{"model":"sim-model","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hello there"}],"stream":true}"#,
    )
    .await
    .unwrap();
    assert_eq!(ids, disagg_sim::tokenize("be brief\nhello there\n"));
    assert_eq!(e.stats().tokenize_requests, 2);

    // Token ids are not sent; truncation applies to them as vLLM applies it.
    let ids = tokenize(
        &t,
        Api::Completions,
        r#"{"prompt":[5,6,7,8],"truncate_prompt_tokens":3}"#,
    )
    .await
    .unwrap();
    assert_eq!(ids, [6, 7, 8]);
    // Chat ids come back whole from the engine and are truncated here.
    let ids = tokenize(
        &t,
        Api::Chat,
        r#"{"messages":[{"role":"user","content":"a b c d e"}],"truncate_prompt_tokens":2}"#,
    )
    .await
    .unwrap();
    assert_eq!(ids, disagg_sim::tokenize("d e"));
    assert_eq!(e.stats().tokenize_requests, 3);
    // Truncated inside the tokenizer with its special tokens kept: which ids those are
    // is not known from the answer, so the engine is not asked.
    let err = tokenize(
        &t,
        Api::Completions,
        r#"{"prompt":"a b c","truncate_prompt_tokens":2}"#,
    )
    .await
    .unwrap_err();
    assert!(err.is_not_supported(), "{err:?}");
    assert_eq!(e.stats().tokenize_requests, 3);
}

#[tokio::test]
async fn an_engine_error_is_typed_with_its_status_and_message() {
    let e = engine().await;
    let t = tokenizer(&e.url());
    // A model the engine does not serve: 404, as vLLM answers.
    let err = tokenize(&t, Api::Completions, r#"{"model":"other","prompt":"hi"}"#)
        .await
        .unwrap_err();
    match err {
        TokenizeError::Engine(EngineError::Status { status, message }) => {
            assert_eq!(status, 404);
            assert!(message.contains("other"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    // Shapes the engine would tokenize differently are refused before any request.
    let err = tokenize(
        &t,
        Api::Chat,
        r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}}]}]}"#,
    )
    .await
    .unwrap_err();
    assert!(err.is_not_supported());
    assert_eq!(e.stats().tokenize_requests, 1);
}

/// `documents` and `reasoning_effort` reach the template on vLLM's chat route, but its
/// `/tokenize` ignores them: its ids would be those of another render. Such a chat is
/// not supported (routed without ids), and the engine is not asked; set to `null`
/// they are absent.
#[tokio::test]
async fn fields_the_engines_tokenize_route_ignores_are_not_supported() {
    let e = engine().await;
    let t = tokenizer(&e.url());
    let messages = r#""messages":[{"role":"user","content":"hello there"}]"#;
    for extra in [
        r#""documents":[{"title":"a","text":"b"}]"#,
        r#""reasoning_effort":"high""#,
        r#""reasoning_effort":"none""#,
    ] {
        let err = tokenize(&t, Api::Chat, &format!("{{{messages},{extra}}}"))
            .await
            .unwrap_err();
        assert!(err.is_not_supported(), "{extra}: {err:?}");
    }
    assert_eq!(e.stats().tokenize_requests, 0);
    for extra in [r#""documents":null"#, r#""reasoning_effort":null"#] {
        let ids = tokenize(&t, Api::Chat, &format!("{{{messages},{extra}}}"))
            .await
            .unwrap();
        assert_eq!(ids, disagg_sim::tokenize("hello there\n"), "{extra}");
    }
    assert_eq!(e.stats().tokenize_requests, 2);
}

#[tokio::test]
async fn an_engine_that_is_gone_is_a_transport_error() {
    let e = engine().await;
    let url = e.url();
    e.shutdown().await;
    let t = tokenizer(&url);
    let err = tokenize(&t, Api::Completions, r#"{"prompt":"hi"}"#)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            TokenizeError::Engine(EngineError::Transport(TransportError::Connect(_)))
        ),
        "{err:?}"
    );
}

#[tokio::test]
async fn an_answer_that_is_not_a_tokenize_answer_is_a_decode_error() {
    let e = engine().await;
    // The engine's completions route answers 200 with a completion, not ids.
    let t = tokenizer(&e.url()).with_path("/v1/completions");
    let err = tokenize(&t, Api::Completions, r#"{"prompt":"hi"}"#)
        .await
        .unwrap_err();
    assert!(
        matches!(err, TokenizeError::Engine(EngineError::Decode(_))),
        "{err:?}"
    );
    // An answer over the limit is not read.
    let t = tokenizer(&e.url()).with_max_answer(8);
    let err = tokenize(&t, Api::Completions, r#"{"prompt":"a b c d e f g"}"#)
        .await
        .unwrap_err();
    assert!(
        matches!(err, TokenizeError::Engine(EngineError::Body(_))),
        "{err:?}"
    );
}

/// The engine asked is named on the `Asked`, and marked answered only when it answered
/// with ids or with the request's own 4xx: an unreachable engine, an unusable answer
/// or one over the limit leave it unanswered (the engine's fault).
#[tokio::test]
async fn the_engine_asked_is_named_and_blamed_only_for_its_own_faults() {
    use disagg_core::tokens::{Asked, Tokenizer};
    async fn ask(t: &EngineTokenizer, body: &str) -> Asked {
        let mut asked = Asked::default();
        let _ = t
            .token_ids_asking(
                Api::Completions,
                &JsonBody::parse(body.as_bytes()).unwrap(),
                &mut asked,
            )
            .await;
        asked
    }
    let e = engine().await;
    let t = tokenizer(&e.url());
    for (t, body, answered) in [
        (t.clone(), r#"{"prompt":"hi"}"#, true),
        (t.clone(), r#"{"model":"other","prompt":"hi"}"#, true),
        (
            t.clone().with_path("/v1/completions"),
            r#"{"prompt":"hi"}"#,
            false,
        ),
        (
            t.clone().with_max_answer(8),
            r#"{"prompt":"a b c d e f g"}"#,
            false,
        ),
    ] {
        let asked = ask(&t, body).await;
        assert_eq!(
            asked.engine.as_ref().map(|e| e.id().as_str().to_owned()),
            Some(e.url()),
            "{body}"
        );
        assert_eq!(asked.answered, answered, "{body}");
    }
    // Token ids ask nobody.
    let asked = ask(&t, r#"{"prompt":[1,2]}"#).await;
    assert!(asked.engine.is_none());
    // An engine that is gone.
    let url = e.url();
    e.shutdown().await;
    let asked = ask(&tokenizer(&url), r#"{"prompt":"hi"}"#).await;
    assert!(asked.engine.is_some() && !asked.answered);
}

/// A message that repeats `content` is read as the engine reads it (`json.loads`, then
/// pydantic): by its last value. An image first and text last is text; text first and
/// an image last is not supported, and the engine is not asked.
#[tokio::test]
async fn a_repeated_content_counts_by_its_last_value_as_in_the_engine() {
    let e = engine().await;
    let t = tokenizer(&e.url());
    let image = r#"{"type":"image_url","image_url":{"url":"u"}}"#;
    let ids = tokenize(
        &t,
        Api::Chat,
        &format!(
            r#"{{"messages":[{{"role":"user","content":[{image}],"content":"hello there"}}]}}"#
        ),
    )
    .await
    .unwrap();
    assert_eq!(ids, disagg_sim::tokenize("hello there\n"));
    let err = tokenize(
        &t,
        Api::Chat,
        &format!(
            r#"{{"messages":[{{"role":"user","content":"hello there","content":[{image}]}}]}}"#
        ),
    )
    .await
    .unwrap_err();
    assert!(err.is_not_supported(), "{err:?}");
    assert_eq!(e.stats().tokenize_requests, 1);
}

/// A prompt of a body read off the event loop gets the same ids from the engine.
#[tokio::test]
async fn a_large_prompt_read_off_the_loop_gets_the_engines_ids() {
    let e = engine().await;
    let t = tokenizer(&e.url());
    let word = "the \"quoted\" caf\u{e9} of the engine\n";
    let text = word.repeat(READ_OFF_LOOP_FROM / word.len() + 1);
    let body = serde_json::json!({"model": "sim-model", "prompt": text}).to_string();
    assert!(body.len() > READ_OFF_LOOP_FROM);
    let ids = tokenize(&t, Api::Completions, &body).await.unwrap();
    assert_eq!(ids, disagg_sim::tokenize(&text));
}

/// A transport that keeps each request body it is sent and fails the request at once,
/// waiting on nothing: a tokenizer over it never yields to the event loop unless it
/// hands work to another thread.
#[derive(Default)]
struct Keep(Mutex<Vec<Bytes>>);

impl Transport for Keep {
    fn send(&self, req: http::Request<Bytes>) -> ResponseFuture {
        self.0.lock().unwrap().push(req.into_body());
        Box::pin(std::future::ready(Err(TransportError::Timeout)))
    }
}

/// A transport whose every request is answered 200 with `.0` at once (no wait: a
/// tokenizer over it yields to the event loop only when it hands work to another
/// thread).
struct Answers(Bytes);

impl Transport for Answers {
    fn send(&self, _req: http::Request<Bytes>) -> ResponseFuture {
        let body = http_body_util::Full::new(self.0.clone())
            .map_err(|never| match never {})
            .boxed();
        Box::pin(std::future::ready(Ok(http::Response::new(body))))
    }
}

/// An engine's answer from `READ_OFF_LOOP_FROM` bytes on is decoded on the blocking
/// pool (8M ids would hold the event loop some 150 ms); a small one inline. The ids are
/// the same either way.
#[test]
fn large_answers_are_decoded_off_the_event_loop() {
    for (n, off_loop) in [(100, false), (80_000, true)] {
        let ids = ids(n);
        let answer = format!(
            r#"{{"count":{n},"tokens":{}}}"#,
            serde_json::to_string(&ids).unwrap()
        );
        assert_eq!(answer.len() >= READ_OFF_LOOP_FROM, off_loop, "{n} ids");
        let t = EngineTokenizer::new(
            Arc::new(Answers(Bytes::from(answer))),
            Arc::new(Endpoint::new("http://127.0.0.1:9", Role::Prefill).unwrap()),
        );
        let body = JsonBody::parse(br#"{"model":"m","prompt":"a few words"}"#).unwrap();
        let (got, ticks) = ticks_while(t.tokenize(Api::Completions, &body));
        assert_eq!(&*got.unwrap(), &ids[..]);
        assert_eq!(ticks > 0, off_loop, "{n} ids: {ticks} ticks");
    }
}

/// Token ids that are no run.
fn ids(n: u32) -> Vec<u32> {
    (0..n)
        .map(|i| i.wrapping_mul(2_654_435_761) % 128_000)
        .collect()
}

/// A body from `READ_OFF_LOOP_FROM` bytes on is read, its messages checked and its
/// `/tokenize` request written on the blocking pool: the event loop runs another task
/// meanwhile. A smaller one is read inline: the other task never runs. The answers are
/// the same either way.
#[test]
fn large_bodies_are_read_off_the_event_loop() {
    let transport = Arc::new(Keep::default());
    let t = EngineTokenizer::new(
        Arc::clone(&transport) as Arc<dyn Transport>,
        Arc::new(Endpoint::new("http://127.0.0.1:9", Role::Prefill).unwrap()),
    );

    // Token ids: answered without the engine.
    for (n, off_loop) in [(100, false), (80_000, true)] {
        let ids = ids(n);
        let body = format!(r#"{{"prompt":{}}}"#, serde_json::to_string(&ids).unwrap());
        assert_eq!(body.len() >= READ_OFF_LOOP_FROM, off_loop, "{n} ids");
        let body = JsonBody::parse(body.as_bytes()).unwrap();
        let (got, ticks) = ticks_while(t.tokenize(Api::Completions, &body));
        assert_eq!(&*got.unwrap(), &ids[..]);
        assert_eq!(ticks > 0, off_loop, "{n} ids: {ticks} ticks");
    }
    assert!(transport.0.lock().unwrap().is_empty());

    // Chat: the check walks the messages, the request copies them.
    let message = r#"{"role":"user","content":[{"type":"text","text":"some words"},"more"]}"#;
    for (n, off_loop) in [(10, false), (5_000, true)] {
        let messages = format!("[{}]", vec![message; n].join(","));
        let body = format!(r#"{{"model":"m","messages":{messages},"stream":true}}"#);
        assert_eq!(body.len() >= READ_OFF_LOOP_FROM, off_loop, "{n} messages");
        let body = JsonBody::parse(body.as_bytes()).unwrap();
        let (got, ticks) = ticks_while(t.tokenize(Api::Chat, &body));
        assert!(
            matches!(
                got,
                Err(TokenizeError::Engine(EngineError::Transport(
                    TransportError::Timeout
                )))
            ),
            "{got:?}"
        );
        assert_eq!(ticks > 0, off_loop, "{n} messages: {ticks} ticks");
        let sent = transport.0.lock().unwrap().pop().unwrap();
        assert_eq!(
            sent,
            format!(r#"{{"model":"m","messages":{messages}}}"#).as_bytes()
        );
    }

    // The check's refusal, found off the loop, is the same: the engine is not asked.
    let image = r#"{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}}]}"#;
    let messages = format!("[{},{image}]", vec![message; 5_000].join(","));
    let body = JsonBody::parse(format!(r#"{{"messages":{messages}}}"#).as_bytes()).unwrap();
    let (got, ticks) = ticks_while(t.tokenize(Api::Chat, &body));
    assert!(matches!(&got, Err(e) if e.is_not_supported()), "{got:?}");
    assert!(ticks > 0);
    assert!(transport.0.lock().unwrap().is_empty());
}
