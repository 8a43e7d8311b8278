//! Whose fault a failed `resolve` is: the client's own prompt is answered 4xx in
//! OpenAI's error format (no prefill engine is blamed, and none fails); a lost job of
//! the proxy's blocking pool blames no engine; only a call on the prefill that failed
//! on the prefill's side names it ([`ConnectorError::Engine`]).

use disagg_core::error::{PdError, Side, error_chain};

use super::*;

/// Answers every request with `status` and `body`, as a prefill's `/tokenize` would.
struct Answers(http::StatusCode, &'static str);

impl Transport for Answers {
    fn send(&self, _req: http::Request<Bytes>) -> disagg_core::transport::ResponseFuture {
        let body = http_body_util::Full::new(Bytes::from_static(self.1.as_bytes()))
            .map_err(|never| match never {})
            .boxed();
        let mut resp = http::Response::new(body);
        *resp.status_mut() = self.0;
        Box::pin(async move { Ok::<_, disagg_core::error::TransportError>(resp) })
    }
}

/// `req` through `prepare` then `resolve` against `engine`: the error it ends with.
async fn resolve_err(req: &PdRequest, engine: &dyn Transport) -> ConnectorError {
    let c = connector();
    let mut h = c.prepare(&route(Some(receiver())), req).unwrap();
    let err = c.resolve(&mut h, engine).await.unwrap_err();
    assert!(h.gate.is_none(), "registered before failing: {err}");
    err
}

/// The client's answer for `err`, a prefill-side connector error, as the HTTP layer
/// renders it: its status, and OpenAI's error body.
pub(super) fn answered(err: ConnectorError) -> (u16, Value) {
    rendered(&PdError::connector(Side::Prefill, err))
}

/// The client's answer for `pd` as the HTTP layer renders it: its status, and OpenAI's
/// error body.
pub(super) fn rendered(pd: &PdError) -> (u16, Value) {
    let facts = pd.http();
    let body =
        disagg_json::openai_error_body(&error_chain(pd), facts.error_type, facts.param, facts.code);
    (
        facts.status.as_u16(),
        serde_json::from_slice(&body).unwrap(),
    )
}

/// vLLM's answer to a `/tokenize` request it refuses for its content.
const REFUSED: &str = r#"{"object":"error","message":"Either prompt or messages must be provided","type":"BadRequestError","param":null,"code":400}"#;

/// A prompt the prefill's `/tokenize` refuses as the client's (400, or 422 for a
/// body that fails its schema), like a completions request without a prompt, is the
/// client's fault: it gets a 400 in OpenAI's format carrying the engine's words, and
/// the error names no engine. An engine's own failure (500) still names the prefill.
#[tokio::test]
async fn a_prompt_the_prefill_refuses_to_tokenize_is_the_clients_400() {
    let no_prompt = request(Api::Completions, r#"{"model":"m","max_tokens":5}"#);
    let bad_chat = request(
        Api::Chat,
        r#"{"model":"m","messages":[{"content":"no role"}]}"#,
    );
    for status in [
        http::StatusCode::BAD_REQUEST,
        http::StatusCode::UNPROCESSABLE_ENTITY,
    ] {
        for req in [&no_prompt, &bad_chat] {
            let err = resolve_err(req, &Answers(status, REFUSED)).await;
            assert!(matches!(err, ConnectorError::Unsupported { .. }), "{err:?}");
            let (code, body) = answered(err);
            assert_eq!(code, 400, "{body}");
            let e = &body["error"];
            assert_eq!(e["type"], "invalid_request_error", "{body}");
            assert_eq!(e["code"], "unsupported_by_connector", "{body}");
            let message = e["message"].as_str().unwrap();
            assert!(
                message.contains("Either prompt or messages must be provided"),
                "{message}"
            );
        }
    }
    let err = resolve_err(
        &no_prompt,
        &Answers(http::StatusCode::INTERNAL_SERVER_ERROR, "boom"),
    )
    .await;
    assert!(
        matches!(&err, ConnectorError::Engine { endpoint, what: "/tokenize", .. } if endpoint.as_str() == "http://p:7100"),
        "{err:?}"
    );
    assert_eq!(answered(err).0, 502);
}

/// An empty prompt, the client's `[]` or text that tokenizes to no ids, is the
/// client's fault (vLLM refuses an empty prompt itself): a 400 in OpenAI's format, no
/// engine named.
#[tokio::test]
async fn an_empty_prompt_is_the_clients_400() {
    let none = Answers(
        http::StatusCode::OK,
        r#"{"count":0,"max_model_len":8,"tokens":[]}"#,
    );
    for prompt in ["[]", "[ ]", r#""""#] {
        let req = request(
            Api::Completions,
            &format!(r#"{{"model":"m","prompt":{prompt},"max_tokens":5}}"#),
        );
        let err = resolve_err(&req, &none).await;
        assert!(
            matches!(err, ConnectorError::Unsupported { .. }),
            "{prompt}: {err:?}"
        );
        let (code, body) = answered(err);
        assert_eq!(code, 400, "{prompt}: {body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("an empty prompt"),
            "{body}"
        );
    }
}

/// `work` polled with the blocking pool of a runtime already shut down: every job
/// handed to that pool is lost, as in a proxy shutting down.
fn with_a_lost_pool<F: std::future::Future>(work: F) -> F::Output {
    let gone = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .build()
        .unwrap();
    let handle = gone.handle().clone();
    gone.shutdown_background();
    let _entered = handle.enter();
    futures::executor::block_on(work)
}

/// A job the proxy's blocking pool lost (the runtime shutting down) is the proxy's
/// failure, not the prefill's: whether it was telling a large prompt apart or reading
/// a large `/tokenize` answer, the error names no engine
/// ([`ConnectorError::NotReady`], which blames none).
#[test]
fn a_lost_blocking_job_blames_no_engine() {
    // A prompt whose shape its first element does not tell: walked on the pool.
    let large = request(
        Api::Completions,
        &format!(r#"{{"model":"m","prompt":[{}1]}}"#, "0,".repeat(140_000)),
    );
    // A small text prompt whose `/tokenize` answer is decoded on the pool.
    let ids = format!("[{}0]", "100000,".repeat(40_000));
    let answer: &'static str =
        Box::leak(format!(r#"{{"count":40001,"tokens":{ids}}}"#).into_boxed_str());
    assert!(answer.len() >= READ_OFF_LOOP_FROM);
    let text = request(Api::Completions, r#"{"model":"m","prompt":"hi"}"#);
    for (req, engine, step) in [
        (
            &large,
            Answers(http::StatusCode::OK, "unused"),
            "reading the prompt:",
        ),
        (
            &text,
            Answers(http::StatusCode::OK, answer),
            "reading the prefill's `/tokenize` answer:",
        ),
    ] {
        let c = connector();
        let mut h = c.prepare(&route(Some(receiver())), req).unwrap();
        let err = with_a_lost_pool(c.resolve(&mut h, &engine)).unwrap_err();
        assert!(matches!(err, ConnectorError::NotReady { .. }), "{err:?}");
        let message = err.to_string();
        assert!(message.contains(step), "{message}");
        assert!(message.contains("blocking pool was lost"), "{message}");
        assert!(h.gate.is_none());
    }
}

/// `prompt_ids`' own refusals, which `prepare` keeps it from meeting: no prompt at
/// all, or client ids that are not a list of token ids, are the client's (400), not
/// the prefill's.
#[tokio::test]
async fn ids_that_are_not_a_prompt_are_the_clients() {
    let ep = Arc::new(Endpoint::new("http://p:7100", Role::Prefill).unwrap());
    let engine = Answers(http::StatusCode::OK, "unused");
    let blocking = BlockingLimit::default();
    for prompt in [None, Some(Bytes::from_static(b"[1,-2]"))] {
        let err = ids::prompt_ids(&engine, &ep, None, prompt.clone(), 8, &blocking)
            .await
            .unwrap_err();
        assert!(
            matches!(err, ConnectorError::Unsupported { .. }),
            "{prompt:?}: {err:?}"
        );
        assert_eq!(answered(err).0, 400, "{prompt:?}");
    }
    let ok = ids::prompt_ids(
        &engine,
        &ep,
        None,
        Some(Bytes::from_static(b"[1,2]")),
        8,
        &blocking,
    )
    .await
    .unwrap();
    assert_eq!((&*ok.0, ok.1), (&[1, 2][..], None));
}

/// The `/tokenize` that asks a prefill its context length (a client without a limit
/// whose ids were known) fails as any `/tokenize` of the prefill's does: an engine's
/// failure names the prefill (502).
#[tokio::test]
async fn a_failed_context_length_call_names_the_prefill() {
    let mut routed = request(
        Api::Chat,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
    );
    routed.set_tokens(Some(Arc::from(vec![5_u32, 6])));
    let err = resolve_err(
        &routed,
        &Answers(http::StatusCode::INTERNAL_SERVER_ERROR, "boom"),
    )
    .await;
    assert!(
        matches!(&err, ConnectorError::Engine { endpoint, what: "/tokenize", .. } if endpoint.as_str() == "http://p:7100"),
        "{err:?}"
    );
    assert_eq!(answered(err).0, 502);
}

/// vLLM's answer for a model it does not serve (its `_check_model`).
const NO_MODEL: &str = r#"{"error":{"message":"The model `x` does not exist.","type":"NotFoundError","param":"model","code":404}}"#;

/// A chat of `extra` members whose ids a token-reading router already made: no
/// `/tokenize` is asked for its prompt.
fn routed_chat(extra: &str) -> PdRequest {
    let mut req = request(
        Api::Chat,
        &format!(r#"{{"model":"x","messages":[{{"role":"user","content":"hi"}}]{extra}}}"#),
    );
    req.set_tokens(Some(Arc::from(vec![5_u32, 6])));
    req
}

/// A 404 from the prefill's `/tokenize` (vLLM's answer for a model it does not serve)
/// is the client's fault, the model it named, as the prefill leg's own 404 would be:
/// whether `/tokenize` was asked for the prompt or for the context length, the client
/// gets an `invalid_request_error` in OpenAI's format carrying the engine's words, and
/// no engine is named (nor its passive health counted against).
#[tokio::test]
async fn a_model_the_prefill_does_not_serve_is_the_clients() {
    let text = request(
        Api::Chat,
        r#"{"model":"x","messages":[{"role":"user","content":"hi"}]}"#,
    );
    for req in [&text, &routed_chat(""), &routed_chat(r#","min_tokens":2"#)] {
        let err = resolve_err(req, &Answers(http::StatusCode::NOT_FOUND, NO_MODEL)).await;
        assert!(matches!(err, ConnectorError::Unsupported { .. }), "{err:?}");
        let (code, body) = answered(err);
        assert_eq!(code, 400, "{body}");
        let e = &body["error"];
        assert_eq!(e["type"], "invalid_request_error", "{body}");
        let message = e["message"].as_str().unwrap();
        assert!(
            message.contains("a model its prefill engine does not serve")
                && message.contains("The model `x` does not exist."),
            "{message}"
        );
    }
}

/// A refusal (400, 422) of the `/tokenize` that asks the context length is told as
/// such: the client sent ids, no prompt for the engine to refuse; only its `model` was
/// in that call. It is the client's (400), naming no engine.
#[tokio::test]
async fn a_refused_context_length_call_is_not_told_as_a_refused_prompt() {
    for status in [
        http::StatusCode::BAD_REQUEST,
        http::StatusCode::UNPROCESSABLE_ENTITY,
    ] {
        let err = resolve_err(&routed_chat(""), &Answers(status, REFUSED)).await;
        assert!(matches!(err, ConnectorError::Unsupported { .. }), "{err:?}");
        let (code, body) = answered(err);
        assert_eq!(code, 400, "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            !message.contains("refused to tokenize")
                && message.contains("context length")
                && message.contains("Either prompt or messages must be provided"),
            "{message}"
        );
    }
}

/// The `/tokenize` that asks the context length tokenizes one character: its answer is
/// read within a few ids, whatever the connector's prompt ceiling. A ceiling below
/// that answer's ids (a special token and the character) does not refuse the request
/// as a prompt too long; an answer of many ids to it is no answer to that call, the
/// engine's failure.
#[tokio::test]
async fn the_context_length_call_is_read_within_a_few_ids_not_the_prompt_ceiling() {
    let c = connector().with_max_prompt_tokens(1);
    let mut one = routed_chat("");
    one.set_tokens(Some(Arc::from(vec![5_u32])));
    let mut h = c.prepare(&route(Some(receiver())), &one).unwrap();
    let two = Answers(
        http::StatusCode::OK,
        r#"{"count":2,"max_model_len":8,"tokens":[1,13]}"#,
    );
    c.resolve(&mut h, &two).await.unwrap();
    assert_eq!(h.ext.get::<Plan>().unwrap().max_model_len, Some(8));

    let many: &'static str = Box::leak(
        format!(
            r#"{{"count":100,"max_model_len":8,"tokens":[{}1]}}"#,
            "1,".repeat(99)
        )
        .into_boxed_str(),
    );
    let err = resolve_err(&routed_chat(""), &Answers(http::StatusCode::OK, many)).await;
    assert!(
        matches!(
            &err,
            ConnectorError::Engine {
                what: "/tokenize",
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(answered(err).0, 502);
}
