//! The client's token limit against the room its context leaves after the prompt. vLLM
//! refuses (400) a request whose prompt and limit pass the context before it generates
//! anything; the decode leg (the ids and the prefill's token, the limit less one) would
//! be refused the same way, but only after the prefill ran, pushed its KV and gave the
//! client its first token. So the connector refuses such a request before the prefill,
//! in vLLM's words, whether the prompt's ids came from the prefill's `/tokenize` (whose
//! answer tells the context's length) or were known without one (the length then asked
//! of the prefill's `/tokenize`).

use std::sync::Mutex;

use disagg_core::Orchestrator;
use disagg_core::error::{PdError, error_chain};
use disagg_core::source::StaticSource;

use super::*;

/// The route's engines behind one transport: `/tokenize` answered with `tokenize`, any
/// other request (a leg) with a 500. Every request's path and body is kept.
struct Engines {
    tokenize: &'static str,
    seen: Mutex<Vec<(String, Bytes)>>,
}

impl Engines {
    fn new(tokenize: &'static str) -> Arc<Self> {
        Arc::new(Engines {
            tokenize,
            seen: Mutex::default(),
        })
    }

    fn seen(&self) -> Vec<(String, Bytes)> {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }

    fn paths(&self) -> Vec<String> {
        self.seen().into_iter().map(|(path, _)| path).collect()
    }
}

impl Transport for Engines {
    fn send(&self, req: http::Request<Bytes>) -> disagg_core::transport::ResponseFuture {
        let path = req.uri().path().to_owned();
        if let Ok(mut seen) = self.seen.lock() {
            seen.push((path.clone(), req.body().clone()));
        }
        let (status, answer) = if path == "/tokenize" {
            (http::StatusCode::OK, self.tokenize)
        } else {
            (http::StatusCode::INTERNAL_SERVER_ERROR, "boom")
        };
        let body = http_body_util::Full::new(Bytes::from_static(answer.as_bytes()))
            .map_err(|never| match never {})
            .boxed();
        let mut resp = http::Response::new(body);
        *resp.status_mut() = status;
        Box::pin(async move { Ok::<_, disagg_core::error::TransportError>(resp) })
    }
}

/// An orchestrator over the LMCache connector and one prefill and one decode, both
/// reached through `engines`.
fn orchestrator(engines: &Arc<Engines>) -> Orchestrator {
    let prefill = Endpoint::new("http://p:7100", Role::Prefill).unwrap();
    let facts = Facts::default()
        .with(Facts::KV_RECEIVER, receiver().to_string())
        .unwrap();
    let decode = Endpoint::new("http://d:7200", Role::Decode)
        .unwrap()
        .with_facts(facts);
    Orchestrator::builder(
        StaticSource::new([prefill, decode]),
        Arc::clone(engines),
        connector(),
    )
    .build()
}

/// `body` for `api` served through `engines` (with `ids`, as a token-reading router
/// leaves them, when given): the client's status and the error's message.
async fn served(
    engines: &Arc<Engines>,
    api: Api,
    body: &str,
    ids: Option<Vec<u32>>,
) -> (u16, String) {
    match serve(engines, api, body, ids).await {
        Ok(resp) => (resp.status().as_u16(), String::new()),
        Err(e) => (e.http().status.as_u16(), error_chain(&e as &PdError)),
    }
}

/// `body` for `api` served through `engines` (with `ids`, as a token-reading router
/// leaves them, when given): the orchestrator's answer.
async fn serve(
    engines: &Arc<Engines>,
    api: Api,
    body: &str,
    ids: Option<Vec<u32>>,
) -> Result<http::Response<disagg_core::orchestrator::PdBody>, PdError> {
    let o = orchestrator(engines);
    let mut req = o
        .request(api, HeaderMap::new(), &Bytes::from(body.to_owned()))
        .unwrap();
    if let Some(ids) = ids {
        req.set_tokens(Some(Arc::from(ids)));
    }
    o.serve(req).await
}

/// vLLM's words for a limit of `limit` the context of `context` tokens cannot hold
/// after a prompt of `prompt`.
fn too_large(limit: u64, context: u64, prompt: u64) -> String {
    format!(
        "'max_tokens' or 'max_completion_tokens' is too large: {limit}. This model's maximum context length is {context} tokens and your request has {prompt} input tokens ({limit} > {context} - {prompt}). (parameter=max_tokens, value={limit})"
    )
}

/// The context-length probe's `/tokenize` (the client's `model`, one character).
fn probe() -> (String, Bytes) {
    (
        "/tokenize".to_owned(),
        Bytes::from_static(br#"{"model":"m","prompt":"."}"#),
    )
}

/// A context of 8 tokens, as the probe's answer tells it.
const EIGHT: &str = r#"{"count":1,"max_model_len":8,"tokens":[9]}"#;

/// Ids known without a `/tokenize` (the client's own, or a token-reading router's) and
/// a limit above the room the context leaves: the context's length is asked of the
/// prefill's `/tokenize`, and the request is refused (400, vLLM's words) before any
/// leg is sent: the prefill saw the probe and nothing else. A completions request
/// without `max_tokens` asks for vLLM's default of 16, checked alike.
#[tokio::test]
async fn a_limit_above_the_room_is_refused_before_the_prefill_when_the_ids_are_known() {
    let chat =
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":7}"#;
    let cases: [(Api, &str, Option<Vec<u32>>, u64); 4] = [
        (
            Api::Completions,
            r#"{"model":"m","prompt":[5,6],"max_tokens":7}"#,
            None,
            7,
        ),
        (
            Api::Completions,
            r#"{"model":"m","prompt":[5,6],"max_tokens":"7","stream":true}"#,
            None,
            7,
        ),
        (Api::Chat, chat, Some(vec![5, 6]), 7),
        (
            Api::Completions,
            r#"{"model":"m","prompt":[5,6]}"#,
            None,
            16,
        ),
    ];
    for (api, body, ids, limit) in cases {
        let engines = Engines::new(EIGHT);
        let (status, message) = served(&engines, api, body, ids).await;
        assert_eq!(status, 400, "{body}: {message}");
        assert!(
            message.contains(&too_large(limit, 8, 2)),
            "{body}: {message}"
        );
        assert_eq!(engines.seen(), [probe()], "{body}");
    }
}

/// Ids from the prefill's `/tokenize`, whose answer tells the context's length: a
/// limit above the room it leaves is refused (400, vLLM's words) before any leg is
/// sent, without asking the length a second time.
#[tokio::test]
async fn a_limit_above_the_room_is_refused_before_the_prefill_when_tokenize_tells_it() {
    let five = r#"{"count":5,"max_model_len":8,"tokens":[1,2,3,4,5]}"#;
    for (api, body) in [
        (
            Api::Chat,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4}"#,
        ),
        (
            Api::Completions,
            r#"{"model":"m","prompt":"hi","max_tokens":4}"#,
        ),
    ] {
        let engines = Engines::new(five);
        let (status, message) = served(&engines, api, body, None).await;
        assert_eq!(status, 400, "{body}: {message}");
        assert!(message.contains(&too_large(4, 8, 5)), "{body}: {message}");
        assert_eq!(engines.paths(), ["/tokenize"], "{body}");
        assert_ne!(
            engines.seen()[0],
            probe(),
            "{body}: the prompt's, not a probe"
        );
    }
}

/// A limit of exactly the room left is carried: the prefill leg is sent, and the
/// decode's prompt (the ids and the prefill's token) and budget (the limit less one)
/// fill the context exactly. A prompt that fills the context alone is left to the
/// prefill, which refuses it for its length, as before; a limit of 1, which the
/// prefill's token meets with no decode leg, needs no context length.
#[tokio::test]
async fn a_limit_of_exactly_the_room_is_carried() {
    // Through the orchestrator: the checks pass and the prefill leg is sent (this
    // engine fails it).
    let engines = Engines::new(EIGHT);
    let body = r#"{"model":"m","prompt":[5,6],"max_tokens":6}"#;
    let (status, message) = served(&engines, Api::Completions, body, None).await;
    assert_eq!(status, 502, "{message}");
    assert_eq!(engines.paths(), ["/tokenize", "/v1/completions"]);

    let c = connector();
    let five = r#"{"count":5,"max_model_len":8,"tokens":[1,2,3,4,5]}"#;
    let cases: [(&str, &'static str, usize, u64); 2] = [
        (
            r#"{"model":"m","prompt":[5,6],"max_tokens":6}"#,
            EIGHT,
            3,
            5,
        ),
        (r#"{"model":"m","prompt":"hi","max_tokens":3}"#, five, 6, 2),
    ];
    for (body, answer, prompt, budget) in cases {
        let engines = Engines::new(answer);
        let mut h = c
            .prepare(&route(Some(receiver())), &request(Api::Completions, body))
            .unwrap();
        c.resolve(&mut h, &engines).await.unwrap();
        assert_eq!(engines.paths(), ["/tokenize"], "{body}");
        let answer = r#"{"id":"cmpl-p","created":1,"model":"m","choices":[{"index":0,"text":" a","finish_reason":"length","stop_reason":null}],"usage":null,"kv_transfer_params":{"first_tok":7}}"#;
        let found = c
            .complete(&mut h, &prefill_answer(answer.to_owned()))
            .await
            .unwrap();
        assert_eq!(found, HandoffFound::Handed, "{body}");
        let d: Value = serde_json::from_slice(&h.decode.body.to_bytes()).unwrap();
        assert_eq!(d["prompt"].as_array().map(Vec::len), Some(prompt), "{d}");
        assert_eq!(d["max_tokens"], budget, "{d}");
    }

    // A prompt of 5 ids in a context of 5: the prefill's to refuse.
    let full = Engines::new(r#"{"count":5,"max_model_len":5,"tokens":[1,2,3,4,5]}"#);
    let mut h = c
        .prepare(
            &route(Some(receiver())),
            &request(
                Api::Completions,
                r#"{"model":"m","prompt":"hi","max_tokens":4}"#,
            ),
        )
        .unwrap();
    c.resolve(&mut h, &full).await.unwrap();

    // A limit of 1 with the ids known: nothing asked (a connector of its own, which
    // remembers no length it could use instead of asking).
    let (c, engines) = (connector(), Engines::new(EIGHT));
    let mut h = c
        .prepare(
            &route(Some(receiver())),
            &request(
                Api::Completions,
                r#"{"model":"m","prompt":[5,6],"max_tokens":1}"#,
            ),
        )
        .unwrap();
    c.resolve(&mut h, &engines).await.unwrap();
    assert!(engines.seen().is_empty(), "{:?}", engines.paths());
}

/// `body` for `api` served through `engines` with `ids` (as a token-reading router
/// leaves them) when given, expected refused: the client's status and error body, as
/// the HTTP layer renders them.
async fn refusal(
    engines: &Arc<Engines>,
    api: Api,
    body: &str,
    ids: Option<Vec<u32>>,
) -> (u16, Value) {
    match serve(engines, api, body, ids).await {
        Ok(resp) => panic!("{body}: served {}", resp.status()),
        Err(e) => super::fault::rendered(&e),
    }
}

/// One request [`the_refusal_is_vllms_error_for_the_request`] refuses: served with
/// `ids` when given, its prefill's `/tokenize` answering `answer` (a context of 8), its
/// `limit` past the room a prompt of `prompt` ids leaves.
struct Refused {
    api: Api,
    body: &'static str,
    ids: Option<Vec<u32>>,
    answer: &'static str,
    limit: u64,
    prompt: u64,
}

/// The refusal carries what a vLLM engine answers for the request (its
/// `_validate_input`; the simulator's vLLM path, `disagg-sim`'s `check_context`, writes
/// the same): a 400 whose message is vLLM's word for word, nothing in front of it, and
/// whose `param` is `max_tokens`. Its `type` and `code` are those the proxy gives every
/// parameter it refuses on an engine's behalf (`invalid_request_error`,
/// `invalid_parameter`: its check before routing answers a `min_tokens` below 0 so),
/// not vLLM's exception name and status number.
#[tokio::test]
async fn the_refusal_is_vllms_error_for_the_request() {
    let cases = [
        Refused {
            api: Api::Completions,
            body: r#"{"model":"m","prompt":[5,6],"max_tokens":7}"#,
            ids: None,
            answer: EIGHT,
            limit: 7,
            prompt: 2,
        },
        Refused {
            api: Api::Chat,
            body: r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":7,"min_tokens":7}"#,
            ids: Some(vec![5, 6]),
            answer: EIGHT,
            limit: 7,
            prompt: 2,
        },
        Refused {
            api: Api::Completions,
            body: r#"{"model":"m","prompt":"hi","max_tokens":4}"#,
            ids: None,
            answer: r#"{"count":5,"max_model_len":8,"tokens":[1,2,3,4,5]}"#,
            limit: 4,
            prompt: 5,
        },
    ];
    for Refused {
        api,
        body,
        ids,
        answer,
        limit,
        prompt,
    } in cases
    {
        // What vLLM (and the simulator) answers for the same request.
        let vllm = json!({"error": {
            "message": too_large(limit, 8, prompt),
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        }});
        let (status, got) = refusal(&Engines::new(answer), api, body, ids).await;
        assert_eq!(status, 400, "{body}: {got}");
        assert_eq!(got["error"]["message"], vllm["error"]["message"], "{body}");
        assert_eq!(got["error"]["param"], vllm["error"]["param"], "{body}");
        let want = json!({"error": {
            "message": too_large(limit, 8, prompt),
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": "invalid_parameter",
        }});
        assert_eq!(got, want, "{body}");
    }
    // The proxy's own refusal of a parameter, before routing: the same shape.
    let body = r#"{"model":"m","prompt":[5,6],"max_tokens":7,"min_tokens":-1}"#;
    let (status, got) = refusal(&Engines::new(EIGHT), Api::Completions, body, None).await;
    assert_eq!(status, 400, "{got}");
    let e = &got["error"];
    assert_eq!(
        (&e["type"], &e["param"], &e["code"]),
        (
            &json!("invalid_request_error"),
            &json!("min_tokens"),
            &json!("invalid_parameter")
        ),
        "{got}"
    );
}
