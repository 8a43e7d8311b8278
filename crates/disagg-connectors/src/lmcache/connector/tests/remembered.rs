//! Each prefill engine's context length (`max_model_len`) for each model, remembered for
//! 10 s from any of its `/tokenize` answers (the prompt's, or the one-character
//! probe's), so that a request whose ids were known without a `/tokenize` (the
//! client's, or a token-reading router's) asks the prefill for it about once per engine
//! and model in that time, not once per request; and a probe that failed on the
//! engine's side, remembered as long, which leaves a limit unchecked. Time is tokio's,
//! paused here and moved on by hand.

use std::sync::Mutex;
use std::time::Duration;

use disagg_core::Orchestrator;
use disagg_core::error::{PdError, error_chain};
use disagg_core::source::StaticSource;

use super::*;

/// Engines behind one transport, every request's URI and body kept. A `/tokenize` is
/// answered with the ids `[5, 6]` and the context length of the moment (`context`,
/// changed as an engine restarted with another `--max-model-len` would). A
/// `/v1/completions` leg on a prefill (a host starting with `p`) is answered with its
/// first token, its KV declared on the decode at once (both ranks notified on
/// `notifications`); one on the decode is refused (400, vLLM's words) when its prompt
/// and limit pass the context, else answered.
struct Engines {
    context: Mutex<u64>,
    /// The context lengths of the models named here, when one address serves several
    /// (a load balancer in front of engines of different models); `context` for any
    /// other.
    models: Vec<(&'static str, u64)>,
    /// How each `/tokenize` fails, while it does.
    failing: Mutex<Option<Fault>>,
    /// How long each `/tokenize` takes to answer (its status and body), while set.
    delay: Mutex<Option<Duration>>,
    /// Whether a `/tokenize` may be answered: one asked while it is `false` waits
    /// until it is `true` ([`hold`](Self::hold), [`release`](Self::release)).
    open: tokio::sync::watch::Sender<bool>,
    notifications: Option<Notifications>,
    seen: Mutex<Vec<(String, Bytes)>>,
}

/// A failing `/tokenize`: a status answered, the transport's own timeout, or no answer
/// ever (an engine that took the connection and never answers).
#[derive(Debug, Clone, Copy)]
enum Fault {
    Status(http::StatusCode),
    Timeout,
    Silent,
}

impl Engines {
    fn new(context: u64) -> Arc<Self> {
        Self::notifying(context, None)
    }

    fn notifying(context: u64, notifications: Option<Notifications>) -> Arc<Self> {
        Arc::new(Engines {
            context: Mutex::new(context),
            models: Vec::new(),
            failing: Mutex::default(),
            delay: Mutex::default(),
            open: tokio::sync::watch::Sender::new(true),
            notifications,
            seen: Mutex::default(),
        })
    }

    /// One address serving the `models`, each with its own context length.
    fn serving(models: Vec<(&'static str, u64)>) -> Arc<Self> {
        Arc::new(Engines {
            context: Mutex::new(0),
            models,
            failing: Mutex::default(),
            delay: Mutex::default(),
            open: tokio::sync::watch::Sender::new(true),
            notifications: None,
            seen: Mutex::default(),
        })
    }

    fn context(&self) -> u64 {
        self.context.lock().map(|c| *c).unwrap_or_default()
    }

    /// The context length a `/tokenize` of `body` is answered with: its model's.
    fn context_of(&self, body: &Bytes) -> u64 {
        let asked: Value = serde_json::from_slice(body).unwrap_or_default();
        let model = asked["model"].as_str().unwrap_or_default();
        self.models
            .iter()
            .find(|(m, _)| *m == model)
            .map_or_else(|| self.context(), |(_, c)| *c)
    }

    /// Every `/tokenize` fails as `fault` says from now on (`None`: answers again).
    fn fail_tokenize(&self, fault: Option<Fault>) {
        if let Ok(mut f) = self.failing.lock() {
            *f = fault;
        }
    }

    /// Each `/tokenize` asked from now on answers `delay` after it was sent.
    fn delay_tokenize(&self, delay: Duration) {
        if let Ok(mut d) = self.delay.lock() {
            *d = Some(delay);
        }
    }

    /// Each `/tokenize` asked from now on waits for [`release`](Self::release).
    fn hold(&self) {
        self.open.send_replace(false);
    }

    /// The `/tokenize` calls held are answered, and those that follow at once.
    fn release(&self) {
        self.open.send_replace(true);
    }

    /// Every engine behind the transport restarted with a context of `context`.
    fn restart(&self, context: u64) {
        if let Ok(mut c) = self.context.lock() {
            *c = context;
        }
    }

    fn seen(&self) -> Vec<(String, Bytes)> {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// The context-length probes asked of the prefill at `base` (`http://host:port`).
    fn probes(&self, base: &str) -> usize {
        let uri = format!("{base}/tokenize");
        self.seen()
            .iter()
            .filter(|(u, body)| *u == uri && &body[..] == PROBE)
            .count()
    }

    /// Every URI asked, in order.
    fn uris(&self) -> Vec<String> {
        self.seen().into_iter().map(|(uri, _)| uri).collect()
    }

    /// The answer to a leg: the prefill's first token, or the decode's answer or
    /// refusal.
    fn leg(&self, host: &str, body: &Bytes) -> (http::StatusCode, String) {
        let leg: Value = serde_json::from_slice(body).unwrap_or_default();
        if host.starts_with('p') {
            let req_id = leg["kv_transfer_params"]["disagg_spec"]["req_id"]
                .as_str()
                .unwrap_or_default();
            if let Some(n) = &self.notifications {
                n.notify(req_id);
                n.notify(req_id);
            }
            let answer = r#"{"id":"cmpl-p","created":1,"model":"m","choices":[{"index":0,"text":" a","finish_reason":"length","stop_reason":null}],"usage":{"prompt_tokens":2,"completion_tokens":1,"total_tokens":3},"kv_transfer_params":{"first_tok":7}}"#;
            return (http::StatusCode::OK, answer.to_owned());
        }
        let prompt = leg["prompt"].as_array().map_or(0, Vec::len) as u64;
        let limit = leg["max_tokens"].as_u64().unwrap_or(16);
        let context = self.context();
        if prompt + limit > context {
            let message = too_large(limit, context, prompt);
            let error = json!({
                "object": "error",
                "message": message,
                "type": "BadRequestError",
                "param": null,
                "code": 400,
            });
            return (http::StatusCode::BAD_REQUEST, error.to_string());
        }
        let answer = json!({
            "id": "cmpl-d",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "text": " b", "finish_reason": "length", "stop_reason": null}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1},
        });
        (http::StatusCode::OK, answer.to_string())
    }
}

impl Transport for Engines {
    fn send(&self, req: http::Request<Bytes>) -> disagg_core::transport::ResponseFuture {
        let uri = req.uri().to_string();
        let host = req.uri().host().unwrap_or_default().to_owned();
        if let Ok(mut seen) = self.seen.lock() {
            seen.push((uri, req.body().clone()));
        }
        let failing = self.failing.lock().map(|f| *f).unwrap_or_default();
        let (status, answer) = match (req.uri().path(), failing) {
            ("/tokenize", Some(Fault::Timeout)) => {
                let timeout = disagg_core::error::TransportError::Timeout;
                return Box::pin(async move { Err(timeout) });
            }
            ("/tokenize", Some(Fault::Silent)) => return Box::pin(std::future::pending()),
            ("/tokenize", Some(Fault::Status(status))) => (status, "no".to_owned()),
            ("/tokenize", None) => (
                http::StatusCode::OK,
                format!(
                    r#"{{"count":2,"max_model_len":{},"tokens":[5,6]}}"#,
                    self.context_of(req.body())
                ),
            ),
            ("/v1/completions", _) => self.leg(&host, req.body()),
            _ => (http::StatusCode::NOT_FOUND, "{}".to_owned()),
        };
        let body = http_body_util::Full::new(Bytes::from(answer))
            .map_err(|never| match never {})
            .boxed();
        let mut resp = http::Response::new(body);
        *resp.status_mut() = status;
        let mut open = self.open.subscribe();
        let held = req.uri().path() == "/tokenize";
        let delay = self.delay.lock().map(|d| *d).unwrap_or_default();
        let answered = delay.map(|delay| tokio::time::Instant::now() + delay);
        Box::pin(async move {
            if let Some(at) = answered.filter(|_| held) {
                tokio::time::sleep_until(at).await;
            }
            if held {
                // The sender lives as long as the engines the transport borrows.
                let _ = open.wait_for(|open| *open).await;
            }
            Ok::<_, disagg_core::error::TransportError>(resp)
        })
    }
}

/// The context-length probe's `/tokenize` body (the client's `model`, one character).
const PROBE: &[u8] = br#"{"model":"m","prompt":"."}"#;

/// vLLM's words for a limit of `limit` the context of `context` tokens cannot hold
/// after a prompt of `prompt`.
fn too_large(limit: u64, context: u64, prompt: u64) -> String {
    format!(
        "'max_tokens' or 'max_completion_tokens' is too large: {limit}. This model's maximum context length is {context} tokens and your request has {prompt} input tokens ({limit} > {context} - {prompt}). (parameter=max_tokens, value={limit})"
    )
}

/// A route from the prefill at `prefill` (`http://host:port`, `@RANK` allowed) to the
/// decode `http://d:7200`.
fn route_from(prefill: &str) -> Route {
    let p = Arc::new(Endpoint::new(prefill, Role::Prefill).unwrap());
    Route::new(Some(p), Arc::new(decode()))
}

/// The decode `http://d:7200`, with its LMCache receiver.
fn decode() -> Endpoint {
    let facts = Facts::default()
        .with(Facts::KV_RECEIVER, receiver().to_string())
        .unwrap();
    Endpoint::new("http://d:7200", Role::Decode)
        .unwrap()
        .with_facts(facts)
}

/// A completions request of the client's own ids `[5, 6]` and a limit of `limit`.
fn client_ids(limit: u64) -> PdRequest {
    request(
        Api::Completions,
        &format!(r#"{{"model":"m","prompt":[5,6],"max_tokens":{limit}}}"#),
    )
}

/// A chat without a limit whose ids `[5, 6]` a token-reading router made.
fn routed_unlimited() -> PdRequest {
    let mut req = request(
        Api::Chat,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
    );
    req.set_tokens(Some(Arc::from(vec![5_u32, 6])));
    req
}

/// `req` prepared for the route from `prefill` and resolved through `engines`.
async fn resolved(
    c: &Lmcache,
    prefill: &str,
    engines: &Engines,
    req: &PdRequest,
) -> Result<Handoff, ConnectorError> {
    let mut h = c.prepare(&route_from(prefill), req)?;
    c.resolve(&mut h, engines).await?;
    Ok(h)
}

/// [`resolved`] on `prefill` [`P`], which must end (a request waiting for good fails the
/// test) and succeed.
async fn resolved_in_time(c: &Lmcache, engines: &Engines, req: &PdRequest) -> Handoff {
    tokio::time::timeout(NEVER, resolved(c, P, engines, req))
        .await
        .expect("the request waited for good")
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)))
}

/// The decode leg's budget once the prefill answered a first token: the rest of the
/// context for a client without a limit (the context less the ids and that token).
async fn decode_budget(c: &Lmcache, mut h: Handoff) -> Value {
    let answer = r#"{"id":"cmpl-p","created":1,"model":"m","choices":[{"index":0,"text":" a","finish_reason":"length","stop_reason":null}],"usage":null,"kv_transfer_params":{"first_tok":7}}"#;
    c.complete(&mut h, &prefill_answer(answer.to_owned()))
        .await
        .unwrap();
    let d: Value = serde_json::from_slice(&h.decode.body.to_bytes()).unwrap();
    d["max_tokens"].clone()
}

const P: &str = "http://p:7100";

/// Two known-ids requests to one prefill within 10 s ask its context length once: the
/// second uses the length the first learned (a client without a limit gets the rest of
/// it). 10 s after the length was learned it is asked again.
#[tokio::test(start_paused = true)]
async fn known_ids_requests_ask_one_prefill_its_context_once_in_ten_seconds() {
    let c = connector();
    let engines = Engines::new(64);
    resolved(&c, P, &engines, &client_ids(4)).await.unwrap();
    assert_eq!(engines.probes(P), 1);

    tokio::time::advance(Duration::from_millis(9_999)).await;
    let h = resolved(&c, P, &engines, &routed_unlimited())
        .await
        .unwrap();
    assert_eq!(engines.probes(P), 1, "{:?}", engines.uris());
    // 64 less the ids and the prefill's token.
    assert_eq!(decode_budget(&c, h).await, json!(61));

    tokio::time::advance(Duration::from_millis(1)).await;
    resolved(&c, P, &engines, &client_ids(4)).await.unwrap();
    assert_eq!(engines.probes(P), 2, "{:?}", engines.uris());
    assert_eq!(engines.seen().len(), 2, "{:?}", engines.uris());
}

/// The `/tokenize` of a prompt whose ids were unknown tells the prefill's context
/// length too: a known-ids request that follows asks nothing, and each such answer
/// keeps the length for another 10 s.
#[tokio::test(start_paused = true)]
async fn a_prompts_tokenize_tells_the_context_a_known_ids_request_uses() {
    let c = connector();
    let engines = Engines::new(64);
    let text = request(
        Api::Chat,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
    );
    resolved(&c, P, &engines, &text).await.unwrap();
    assert_eq!(engines.uris(), [format!("{P}/tokenize")]);
    assert_eq!(engines.probes(P), 0, "the prompt's, not a probe");

    resolved(&c, P, &engines, &client_ids(4)).await.unwrap();
    let h = resolved(&c, P, &engines, &routed_unlimited())
        .await
        .unwrap();
    assert_eq!(engines.seen().len(), 1, "{:?}", engines.uris());
    assert_eq!(decode_budget(&c, h).await, json!(61));

    // 9 s on, the prompt's answer learns it anew: 9 s more, still known.
    tokio::time::advance(Duration::from_secs(9)).await;
    resolved(&c, P, &engines, &text).await.unwrap();
    tokio::time::advance(Duration::from_secs(9)).await;
    resolved(&c, P, &engines, &client_ids(4)).await.unwrap();
    assert_eq!(engines.seen().len(), 2, "{:?}", engines.uris());
    assert_eq!(engines.probes(P), 0);
}

/// Each prefill engine's length is its own: two prefills are asked once each, however
/// their requests interleave. A data-parallel rank of an engine (`URL@RANK`) asks the
/// same `/tokenize` as the engine, and shares its length.
#[tokio::test]
async fn each_prefill_engine_is_asked_its_context_once() {
    let c = connector();
    let (one, two) = ("http://p1:7100", "http://p2:7100");
    let (small, large) = (Engines::new(16), Engines::new(64));
    for _ in 0..3 {
        resolved(&c, one, &small, &client_ids(4)).await.unwrap();
        resolved(&c, two, &large, &client_ids(4)).await.unwrap();
    }
    resolved(&c, "http://p1:7100@1", &small, &client_ids(4))
        .await
        .unwrap();
    assert_eq!(small.uris(), [format!("{one}/tokenize")]);
    assert_eq!(large.uris(), [format!("{two}/tokenize")]);
    // Each request's length is its engine's.
    let h = resolved(&c, one, &small, &routed_unlimited())
        .await
        .unwrap();
    assert_eq!(decode_budget(&c, h).await, json!(13));
    let h = resolved(&c, two, &large, &routed_unlimited())
        .await
        .unwrap();
    assert_eq!(decode_budget(&c, h).await, json!(61));
    assert_eq!((small.seen().len(), large.seen().len()), (1, 1));
}

/// At most 1,024 engines' lengths are remembered: the 1,025th forgets the one learned
/// longest ago, which is asked again; the others are still known.
#[tokio::test(start_paused = true)]
async fn at_most_1024_engines_are_remembered_the_oldest_forgotten_first() {
    let c = connector();
    let engines = Engines::new(64);
    let base = |i: usize| format!("http://p{i}:7100");
    for i in 0..1025 {
        resolved(&c, &base(i), &engines, &client_ids(4))
            .await
            .unwrap();
        tokio::time::advance(Duration::from_millis(1)).await;
    }
    assert_eq!(engines.seen().len(), 1025);
    for i in 1..1025 {
        resolved(&c, &base(i), &engines, &client_ids(4))
            .await
            .unwrap();
        assert_eq!(engines.probes(&base(i)), 1, "{}", base(i));
    }
    resolved(&c, &base(0), &engines, &client_ids(4))
        .await
        .unwrap();
    assert_eq!(engines.probes(&base(0)), 2);
}

/// A request is never refused on a remembered length: one that says the limit does
/// not fit is asked afresh (an engine restarted with a longer context is read at
/// once), and the request refused only on the engine's answer.
#[tokio::test(start_paused = true)]
async fn a_limit_is_refused_on_the_engines_answer_never_on_a_remembered_one() {
    let c = connector();
    let engines = Engines::new(8);
    resolved(&c, P, &engines, &client_ids(4)).await.unwrap();
    assert_eq!(engines.probes(P), 1);

    // Restarted with a context of 64: a limit of 20 fits it, not the 8 remembered.
    engines.restart(64);
    resolved(&c, P, &engines, &client_ids(20)).await.unwrap();
    assert_eq!(engines.probes(P), 2);
    // The fresh answer is remembered.
    let h = resolved(&c, P, &engines, &routed_unlimited())
        .await
        .unwrap();
    assert_eq!(engines.probes(P), 2);
    assert_eq!(decode_budget(&c, h).await, json!(61));

    // A limit that fits neither: refused on the engine's answer, asked afresh.
    let err = resolved(&c, P, &engines, &client_ids(100))
        .await
        .unwrap_err();
    assert_eq!(engines.probes(P), 3);
    let (status, body) = super::fault::answered(err);
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(&too_large(100, 64, 2)), "{message}");
}

/// A completions `body` served by `o`: the client's status, and its answer's body or
/// error.
async fn served(o: &Orchestrator, body: &str) -> (u16, String) {
    let req = o
        .request(
            Api::Completions,
            HeaderMap::new(),
            &Bytes::from(body.to_owned()),
        )
        .unwrap();
    match o.serve(req).await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let body = resp.into_body().collect().await.map(|b| b.to_bytes());
            let text = match body {
                Ok(b) => String::from_utf8_lossy(&b).into_owned(),
                Err(e) => format!("body error: {}", error_chain(&*e)),
            };
            (status, text)
        }
        Err(e) => (e.http().status.as_u16(), error_chain(&e as &PdError)),
    }
}

/// An engine restarted with a shorter `--max-model-len` behind the same address: for
/// up to 10 s a known-ids request is checked against the length remembered, its
/// prefill runs, and its decode (the same context) refuses the leg, as a decode with a
/// shorter context than the prefill's does: a whole answer is the decode's 400 as
/// vLLM wrote it; a stream has had its first token and ends with an error event
/// carrying vLLM's words. Once the 10 s have passed the length is asked anew and the
/// request refused (400) before its prefill runs.
#[tokio::test(start_paused = true)]
async fn an_engine_restarted_with_a_shorter_context_is_read_anew_within_ten_seconds() {
    let c = connector();
    let engines = Engines::notifying(64, Some(c.notifications().clone()));
    let prefill = Endpoint::new(P, Role::Prefill).unwrap();
    let o = Orchestrator::builder(
        StaticSource::new([prefill, decode()]),
        Arc::clone(&engines),
        c,
    )
    .build();
    let body = r#"{"model":"m","prompt":[5,6],"max_tokens":7}"#;
    let (status, answer) = served(&o, body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(engines.probes(P), 1);

    engines.restart(8);
    tokio::time::advance(Duration::from_secs(1)).await;
    let asked = engines.seen().len();
    let (status, answer) = served(&o, body).await;
    assert_eq!(status, 400, "{answer}");
    // The decode's prompt: the ids and the prefill's token; its limit one less.
    assert!(answer.contains(&too_large(6, 8, 3)), "{answer}");
    let legs = [
        format!("{P}/v1/completions"),
        "http://d:7200/v1/completions".into(),
    ];
    assert_eq!(engines.uris()[asked..], legs);
    let asked = engines.seen().len();
    let stream = r#"{"model":"m","prompt":[5,6],"max_tokens":7,"stream":true}"#;
    let (status, answer) = served(&o, stream).await;
    assert_eq!(status, 200, "{answer}");
    let (first, error) = answer.split_once(r#""text":" a""#).unwrap_or_default();
    assert!(first.starts_with("data: "), "{answer}");
    assert!(
        error.contains(r#"data: {"error":"#) && error.contains(&too_large(6, 8, 3)),
        "{answer}"
    );
    assert_eq!(engines.uris()[asked..], legs);

    tokio::time::advance(Duration::from_secs(9)).await;
    let asked = engines.seen().len();
    let (status, answer) = served(&o, body).await;
    assert_eq!(status, 400, "{answer}");
    assert!(answer.contains(&too_large(7, 8, 2)), "{answer}");
    assert_eq!(engines.uris()[asked..], [format!("{P}/tokenize")]);
}

/// A prefill whose `/tokenize` fails (a gateway that does not route it: 405, 501; an
/// engine's 500 or 503; no answer in time): a request with a limit needed the context
/// length only to check the limit's room, so it is carried unchecked, as before that
/// check existed (a limit the context cannot hold is then the decode's to refuse), and
/// the failure is remembered for 10 s: the next such requests do not ask. A client
/// without a limit, whose decode's budget is the rest of the context, still fails (502,
/// the prefill named) and asks each time, a failure remembered or not.
#[tokio::test(start_paused = true)]
async fn a_failing_probe_leaves_a_limit_unchecked_and_is_remembered() {
    let faults = [
        Fault::Status(http::StatusCode::METHOD_NOT_ALLOWED),
        Fault::Status(http::StatusCode::NOT_IMPLEMENTED),
        Fault::Status(http::StatusCode::INTERNAL_SERVER_ERROR),
        Fault::Status(http::StatusCode::SERVICE_UNAVAILABLE),
        Fault::Timeout,
    ];
    for fault in faults {
        let c = connector();
        let engines = Engines::new(64);
        engines.fail_tokenize(Some(fault));
        let h = resolved(&c, P, &engines, &client_ids(7))
            .await
            .unwrap_or_else(|e| panic!("{fault:?}: {}", error_chain(&e)));
        assert_eq!(engines.probes(P), 1, "{fault:?}");
        // The decode owes the limit less the prefill's token.
        assert_eq!(decode_budget(&c, h).await, json!(6), "{fault:?}");

        // Within 10 s: not asked again, the limit not checked (100 > 64 - 2).
        tokio::time::advance(Duration::from_millis(9_000)).await;
        resolved(&c, P, &engines, &client_ids(100))
            .await
            .unwrap_or_else(|e| panic!("{fault:?}: {}", error_chain(&e)));
        assert_eq!(engines.probes(P), 1, "{fault:?}");

        // A client without a limit asks, and fails naming the prefill.
        let err = resolved(&c, P, &engines, &routed_unlimited())
            .await
            .err()
            .unwrap_or_else(|| panic!("{fault:?}: carried"));
        assert!(
            matches!(&err, ConnectorError::Engine { endpoint, what: "/tokenize", .. } if endpoint.as_str() == P),
            "{fault:?}: {err:?}"
        );
        assert_eq!(super::fault::answered(err).0, 502, "{fault:?}");
        assert_eq!(engines.probes(P), 2, "{fault:?}");

        // 10 s after the last failure, asked again.
        tokio::time::advance(Duration::from_secs(10)).await;
        resolved(&c, P, &engines, &client_ids(7)).await.unwrap();
        assert_eq!(engines.probes(P), 3, "{fault:?}");

        // Once it answers again (and the failure is 10 s old), the room is checked.
        engines.fail_tokenize(None);
        tokio::time::advance(Duration::from_secs(10)).await;
        let err = resolved(&c, P, &engines, &client_ids(100))
            .await
            .err()
            .unwrap_or_else(|| panic!("{fault:?}: carried"));
        let (status, body) = super::fault::answered(err);
        assert_eq!(status, 400, "{fault:?}: {body}");
        assert_eq!(engines.probes(P), 4, "{fault:?}");
    }
}

/// Through the orchestrator: a known-ids request with a limit whose prefill's
/// `/tokenize` fails is served (200), as it was before its limit's room was checked,
/// not failed as the prefill's (502).
#[tokio::test]
async fn a_failing_probe_does_not_fail_a_request_with_a_limit() {
    let c = connector();
    let engines = Engines::notifying(64, Some(c.notifications().clone()));
    engines.fail_tokenize(Some(Fault::Status(http::StatusCode::NOT_IMPLEMENTED)));
    let prefill = Endpoint::new(P, Role::Prefill).unwrap();
    let o = Orchestrator::builder(
        StaticSource::new([prefill, decode()]),
        Arc::clone(&engines),
        c,
    )
    .build();
    for body in [
        r#"{"model":"m","prompt":[5,6],"max_tokens":7}"#,
        r#"{"model":"m","prompt":[5,6],"max_tokens":7,"stream":true}"#,
    ] {
        let (status, answer) = served(&o, body).await;
        assert_eq!(status, 200, "{body}: {answer}");
    }
    assert_eq!(engines.probes(P), 1, "{:?}", engines.uris());
}

/// The context-length probes asked of `engines` for `model`.
fn probes_for(engines: &Engines, model: &str) -> usize {
    let probe = format!(r#"{{"model":"{model}","prompt":"."}}"#);
    engines
        .seen()
        .iter()
        .filter(|(_, body)| body[..] == *probe.as_bytes())
        .count()
}

/// One address may serve several models (a load balancer in front of engines of
/// different models, each with its own `--max-model-len`): a length is remembered for
/// the address and the model the request named, each model's asked once. The
/// data-parallel ranks of one engine (`URL@RANK`) still share it.
#[tokio::test]
async fn each_model_behind_one_address_has_its_own_context_length() {
    let c = connector();
    let engines = Engines::serving(vec![("a", 16), ("b", 64)]);
    let unlimited = |model: &str| {
        let mut req = request(
            Api::Chat,
            &format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]}}"#),
        );
        req.set_tokens(Some(Arc::from(vec![5_u32, 6])));
        req
    };
    for (model, budget) in [("a", 13), ("b", 61), ("a", 13), ("b", 61)] {
        let h = resolved(&c, P, &engines, &unlimited(model)).await.unwrap();
        assert_eq!(decode_budget(&c, h).await, json!(budget), "{model}");
    }
    let h = resolved(&c, "http://p:7100@1", &engines, &unlimited("b"))
        .await
        .unwrap();
    assert_eq!(decode_budget(&c, h).await, json!(61));
    assert_eq!(
        (probes_for(&engines, "a"), probes_for(&engines, "b")),
        (1, 1),
        "{:?}",
        engines.uris()
    );
}

/// Longer than any bound the probe has: a request still waiting then waits for good.
const NEVER: Duration = Duration::from_secs(600);

/// A prefill that took the connection and never answers its `/tokenize`: the probe
/// gives up after [`CONTEXT_PROBE_TIMEOUT`] and the request is carried as after any
/// failure of the engine's side: a limit unchecked, the failure remembered for 10 s
/// (the next request with a limit does not ask, nor wait), a client without a limit
/// failed (502, the prefill named) once its own probe gave up.
#[tokio::test(start_paused = true)]
async fn a_probe_never_answered_leaves_a_limit_unchecked_within_its_bound() {
    let c = connector();
    let engines = Engines::new(64);
    engines.fail_tokenize(Some(Fault::Silent));
    let start = tokio::time::Instant::now();
    let h = resolved_in_time(&c, &engines, &client_ids(7)).await;
    assert_eq!(start.elapsed(), CONTEXT_PROBE_TIMEOUT);
    assert_eq!(engines.probes(P), 1);
    assert_eq!(decode_budget(&c, h).await, json!(6));

    // Remembered: not asked, not waited for (100 > 64 - 2 unchecked).
    let start = tokio::time::Instant::now();
    resolved(&c, P, &engines, &client_ids(100)).await.unwrap();
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(engines.probes(P), 1);

    // A client without a limit asks, and fails as the prefill's once it gave up.
    let start = tokio::time::Instant::now();
    let err = tokio::time::timeout(NEVER, resolved(&c, P, &engines, &routed_unlimited()))
        .await
        .expect("the request waited for good")
        .err()
        .unwrap_or_else(|| panic!("carried without a context length"));
    assert_eq!(start.elapsed(), CONTEXT_PROBE_TIMEOUT);
    assert!(
        matches!(&err, ConnectorError::Engine { endpoint, what: "/tokenize", .. } if endpoint.as_str() == P),
        "{err:?}"
    );
    assert!(error_chain(&err).contains("no answer within 2s"), "{err:?}");
    assert_eq!(super::fault::answered(err).0, 502);
    assert_eq!(engines.probes(P), 2);
}

/// Through the orchestrator, with its default budgets: a known-ids request with a limit
/// whose prefill never answers its `/tokenize` is served (200) once the probe's bound
/// passed, not failed when the plan's resolution runs out of its handoff budget (504).
#[tokio::test(start_paused = true)]
async fn a_probe_never_answered_does_not_fail_a_request_with_a_limit() {
    let c = connector();
    let engines = Engines::notifying(64, Some(c.notifications().clone()));
    engines.fail_tokenize(Some(Fault::Silent));
    let prefill = Endpoint::new(P, Role::Prefill).unwrap();
    let o = Orchestrator::builder(
        StaticSource::new([prefill, decode()]),
        Arc::clone(&engines),
        c,
    )
    .build();
    let start = tokio::time::Instant::now();
    let body = r#"{"model":"m","prompt":[5,6],"max_tokens":7}"#;
    let (status, answer) = served(&o, body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(start.elapsed(), CONTEXT_PROBE_TIMEOUT);
    assert_eq!(engines.probes(P), 1, "{:?}", engines.uris());
}

/// Requests that miss together (nothing remembered for their prefill and model) share
/// one probe: the first asks, the others wait for its answer, each then checked
/// against it (a limit's room; the rest of the context for a client without one).
#[tokio::test(start_paused = true)]
async fn concurrent_misses_share_one_probe() {
    const K: usize = 8;
    let c = connector();
    let engines = Engines::new(64);
    engines.hold();
    let reqs: Vec<PdRequest> = (0..K)
        .map(|i| {
            if i % 2 == 0 {
                client_ids(4)
            } else {
                routed_unlimited()
            }
        })
        .collect();
    let mut pending: Vec<_> = reqs
        .iter()
        .map(|req| Box::pin(resolved(&c, P, &engines, req)))
        .collect();
    for p in &mut pending {
        assert!(futures::poll!(p.as_mut()).is_pending());
    }
    assert_eq!(engines.probes(P), 1, "{:?}", engines.uris());

    engines.release();
    let handoffs = futures::future::join_all(pending).await;
    assert_eq!(engines.probes(P), 1, "{:?}", engines.uris());
    for (i, h) in handoffs.into_iter().enumerate() {
        let h = h.unwrap_or_else(|e| panic!("{i}: {}", error_chain(&e)));
        let budget = if i % 2 == 0 { 3 } else { 61 };
        assert_eq!(decode_budget(&c, h).await, json!(budget), "{i}");
    }
    assert_eq!(c.contexts.flights_under_way(), 0);
}

/// Requests that miss together on a prefill that never answers wait for the one probe
/// no longer than its bound: all are carried with their limits unchecked at once, and
/// the engine was asked once.
#[tokio::test(start_paused = true)]
async fn concurrent_misses_of_a_probe_never_answered_wait_no_longer_than_its_bound() {
    let c = connector();
    let engines = Engines::new(64);
    engines.fail_tokenize(Some(Fault::Silent));
    let reqs: Vec<PdRequest> = (0..4).map(|_| client_ids(7)).collect();
    let start = tokio::time::Instant::now();
    let all = futures::future::join_all(reqs.iter().map(|req| resolved(&c, P, &engines, req)));
    let handoffs = tokio::time::timeout(NEVER, all)
        .await
        .expect("a request waited for good");
    assert_eq!(start.elapsed(), CONTEXT_PROBE_TIMEOUT);
    for h in handoffs {
        h.unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    }
    assert_eq!(engines.probes(P), 1, "{:?}", engines.uris());
    assert_eq!(c.contexts.flights_under_way(), 0);
}

/// A request that asked for the others and was dropped (its client gone) takes nothing
/// from them: the probe goes on without it, asked once, and a waiter is served on its
/// answer when the engine gives it, which is remembered (the next request asks
/// nothing). The waiter does not ask again with what is left of its own time (which
/// would have run out before the engine's answer and been remembered as the engine's
/// failure: 502 for a client without a limit).
#[tokio::test(start_paused = true)]
async fn a_probe_whose_asker_is_dropped_still_answers_its_waiters() {
    let c = connector();
    let engines = Engines::new(64);
    engines.delay_tokenize(Duration::from_millis(1_500));
    let reqs = [client_ids(4), routed_unlimited()];
    let start = tokio::time::Instant::now();
    let mut asker = Box::pin(resolved(&c, P, &engines, &reqs[0]));
    assert!(futures::poll!(asker.as_mut()).is_pending());
    tokio::time::advance(Duration::from_millis(100)).await;
    let mut waiter = Box::pin(resolved(&c, P, &engines, &reqs[1]));
    assert!(futures::poll!(waiter.as_mut()).is_pending());
    tokio::time::advance(Duration::from_millis(900)).await;
    drop(asker);

    let h = tokio::time::timeout(NEVER, waiter)
        .await
        .expect("the waiter waited for good")
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    assert_eq!(start.elapsed(), Duration::from_millis(1_500));
    assert_eq!(engines.probes(P), 1, "{:?}", engines.uris());
    assert_eq!(decode_budget(&c, h).await, json!(61));
    assert_eq!(c.contexts.flights_under_way(), 0);
    // Its answer is remembered: a client without a limit is served on it at once.
    let h = resolved(&c, P, &engines, &routed_unlimited())
        .await
        .unwrap();
    assert_eq!(decode_budget(&c, h).await, json!(61));
    assert_eq!(engines.probes(P), 1);
}

/// A waiter whose asker was dropped waits no longer than the probe's bound from when
/// the probe began (so less than its own): on a prefill that never answers it is
/// carried with its limit unchecked once the one probe gave up, and that failure, the
/// probe's own after its whole time, is remembered (the next request does not wait).
#[tokio::test(start_paused = true)]
async fn a_waiter_whose_asker_was_dropped_waits_no_longer_than_the_bound() {
    let c = connector();
    let engines = Engines::new(64);
    engines.fail_tokenize(Some(Fault::Silent));
    let reqs = [client_ids(7), client_ids(7)];
    let mut asker = Box::pin(resolved(&c, P, &engines, &reqs[0]));
    assert!(futures::poll!(asker.as_mut()).is_pending());
    tokio::time::advance(Duration::from_millis(100)).await;
    let start = tokio::time::Instant::now();
    let mut waiter = Box::pin(resolved(&c, P, &engines, &reqs[1]));
    assert!(futures::poll!(waiter.as_mut()).is_pending());
    tokio::time::advance(Duration::from_millis(900)).await;
    drop(asker);

    let h = tokio::time::timeout(NEVER, waiter)
        .await
        .expect("the waiter waited for good")
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    assert_eq!(
        start.elapsed(),
        CONTEXT_PROBE_TIMEOUT - Duration::from_millis(100)
    );
    assert_eq!(engines.probes(P), 1, "{:?}", engines.uris());
    assert_eq!(decode_budget(&c, h).await, json!(6));
    let start = tokio::time::Instant::now();
    resolved(&c, P, &engines, &client_ids(100)).await.unwrap();
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(engines.probes(P), 1);
}

/// When every request that missed together is dropped, the probe they shared is still
/// under way (its entry kept, nothing else left behind by the requests), finishes on
/// its own, and is remembered: the next request asks nothing, and no probe is left.
#[tokio::test(start_paused = true)]
async fn a_probe_whose_requests_are_all_dropped_finishes_and_is_remembered() {
    let c = connector();
    let engines = Engines::new(64);
    engines.hold();
    let reqs = [client_ids(4), client_ids(4)];
    let mut asker = Box::pin(resolved(&c, P, &engines, &reqs[0]));
    let mut waiter = Box::pin(resolved(&c, P, &engines, &reqs[1]));
    assert!(futures::poll!(asker.as_mut()).is_pending());
    assert!(futures::poll!(waiter.as_mut()).is_pending());
    drop(waiter);
    drop(asker);
    assert_eq!(c.contexts.flights_under_way(), 1);

    // The probe's task alone reads the answer: once it is done, nothing is under way.
    engines.release();
    for _ in 0..100 {
        if c.contexts.flights_under_way() == 0 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(c.contexts.flights_under_way(), 0);
    assert_eq!(engines.probes(P), 1, "{:?}", engines.uris());

    // Remembered: the next request waits on nothing and asks nothing.
    let start = tokio::time::Instant::now();
    let req = routed_unlimited();
    let mut next = Box::pin(resolved(&c, P, &engines, &req));
    let h = match futures::poll!(next.as_mut()) {
        std::task::Poll::Ready(h) => h.unwrap_or_else(|e| panic!("{}", error_chain(&e))),
        std::task::Poll::Pending => panic!("the next request waited: nothing was remembered"),
    };
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(decode_budget(&c, h).await, json!(61));
    assert_eq!(engines.probes(P), 1, "{:?}", engines.uris());
}

/// A request that asked and is never polled again (nor dropped) holds no probe: the
/// probe ends within its bound all the same, its failure remembered, and the requests
/// that follow neither wait on it nor ask.
#[tokio::test(start_paused = true)]
async fn a_probe_whose_asker_is_never_polled_again_ends_within_its_bound() {
    let c = connector();
    let engines = Engines::new(64);
    engines.fail_tokenize(Some(Fault::Silent));
    let reqs = [client_ids(7), client_ids(7)];
    let mut asker = Box::pin(resolved(&c, P, &engines, &reqs[0]));
    assert!(futures::poll!(asker.as_mut()).is_pending());
    let start = tokio::time::Instant::now();
    resolved_in_time(&c, &engines, &reqs[1]).await;
    assert_eq!(start.elapsed(), CONTEXT_PROBE_TIMEOUT);
    assert_eq!(c.contexts.flights_under_way(), 0);

    let start = tokio::time::Instant::now();
    resolved(&c, P, &engines, &client_ids(100)).await.unwrap();
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(engines.probes(P), 1, "{:?}", engines.uris());
    drop(asker);
}

/// A probe that learns nothing (a `model` the prefill does not serve: 404, the
/// client's) tells its waiters so: each is refused at once on that one answer (400,
/// the engine's words), with a limit or without, none asks again, and no one is
/// failed as the engine's (502) for having waited.
#[tokio::test(start_paused = true)]
async fn a_probe_that_learns_nothing_tells_its_waiters_the_clients_refusal() {
    let c = connector();
    let engines = Engines::new(64);
    engines.fail_tokenize(Some(Fault::Status(http::StatusCode::NOT_FOUND)));
    engines.delay_tokenize(Duration::from_millis(1_500));
    let reqs = [
        client_ids(4),
        routed_unlimited(),
        routed_unlimited(),
        client_ids(4),
    ];
    let start = tokio::time::Instant::now();
    let all = futures::future::join_all(reqs.iter().map(|req| resolved(&c, P, &engines, req)));
    let handoffs = tokio::time::timeout(NEVER, all)
        .await
        .expect("a request waited for good");
    assert_eq!(start.elapsed(), Duration::from_millis(1_500));
    for (i, h) in handoffs.into_iter().enumerate() {
        let err = h.err().unwrap_or_else(|| panic!("{i}: carried"));
        let (status, body) = super::fault::answered(err);
        assert_eq!(status, 400, "{i}: {body}");
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("does not serve (404 Not Found: no)"),
            "{i}: {message}"
        );
    }
    assert_eq!(engines.probes(P), 1, "{:?}", engines.uris());
    assert_eq!(c.contexts.flights_under_way(), 0);
}

/// A bound of zero is no bound of nothing: the connector reads it as the default
/// ([`CONTEXT_PROBE_TIMEOUT`]), so a prefill that answers in time serves a client
/// without a limit (not a 502 at once), and one that never answers holds a request
/// with a limit for the default bound.
#[tokio::test(start_paused = true)]
async fn a_zero_bound_is_the_default() {
    let c = connector().with_context_probe_timeout(Duration::ZERO);
    let engines = Engines::new(64);
    engines.delay_tokenize(Duration::from_millis(100));
    let h = resolved_in_time(&c, &engines, &routed_unlimited()).await;
    assert_eq!(decode_budget(&c, h).await, json!(61));

    let c = connector().with_context_probe_timeout(Duration::ZERO);
    engines.fail_tokenize(Some(Fault::Silent));
    let start = tokio::time::Instant::now();
    resolved_in_time(&c, &engines, &client_ids(7)).await;
    assert_eq!(start.elapsed(), CONTEXT_PROBE_TIMEOUT);
}

/// The probe's bound is the connector's to set: a prefill that never answers holds a
/// request with a limit that long, no longer.
#[tokio::test(start_paused = true)]
async fn the_probes_bound_is_the_connectors_to_set() {
    let bound = Duration::from_millis(300);
    let c = connector().with_context_probe_timeout(bound);
    let engines = Engines::new(64);
    engines.fail_tokenize(Some(Fault::Silent));
    let start = tokio::time::Instant::now();
    resolved_in_time(&c, &engines, &client_ids(7)).await;
    assert_eq!(start.elapsed(), bound);
}

/// Requests without a limit that wait on one probe of a prefill that never answers
/// fail together (502), but the engine is blamed once, by one of them: the others'
/// error names no engine, so one silent probe counts as one failure of the prefill
/// for its passive health, not as many as requests waited.
#[tokio::test(start_paused = true)]
async fn a_shared_probes_failure_blames_the_prefill_once() {
    const K: usize = 5;
    let c = connector();
    let engines = Engines::new(64);
    engines.fail_tokenize(Some(Fault::Silent));
    let reqs: Vec<PdRequest> = (0..K).map(|_| routed_unlimited()).collect();
    let start = tokio::time::Instant::now();
    let all = futures::future::join_all(reqs.iter().map(|req| resolved(&c, P, &engines, req)));
    let handoffs = tokio::time::timeout(NEVER, all)
        .await
        .expect("a request waited for good");
    assert_eq!(start.elapsed(), CONTEXT_PROBE_TIMEOUT);
    assert_eq!(engines.probes(P), 1, "{:?}", engines.uris());
    let mut blaming = 0;
    for (i, h) in handoffs.into_iter().enumerate() {
        let err = h
            .err()
            .unwrap_or_else(|| panic!("{i}: carried without a length"));
        match &err {
            ConnectorError::Engine { endpoint, .. } if endpoint.as_str() == P => blaming += 1,
            ConnectorError::NotReady { reason } => {
                assert!(reason.contains(P), "{i}: {reason}");
                assert!(reason.contains("no answer within 2s"), "{i}: {reason}");
            }
            _ => panic!("{i}: {err:?}"),
        }
        assert_eq!(super::fault::answered(err).0, 502, "{i}");
    }
    assert_eq!(blaming, 1);
    assert_eq!(c.contexts.flights_under_way(), 0);
}

/// A bound too long to add to the clock is held to the longest the connector gives a
/// probe ([`MAX_CONTEXT_PROBE_TIMEOUT`](super::super::context::MAX_CONTEXT_PROBE_TIMEOUT)):
/// a prefill that never answers holds a request that long, and the probe's task
/// ends then, not never.
#[tokio::test(start_paused = true)]
async fn a_bound_past_the_longest_is_held_to_it() {
    use super::super::context::MAX_CONTEXT_PROBE_TIMEOUT;
    let c = connector().with_context_probe_timeout(Duration::MAX);
    let engines = Engines::new(64);
    engines.fail_tokenize(Some(Fault::Silent));
    let start = tokio::time::Instant::now();
    resolved_in_time(&c, &engines, &client_ids(7)).await;
    assert_eq!(start.elapsed(), MAX_CONTEXT_PROBE_TIMEOUT);
    assert_eq!(c.contexts.flights_under_way(), 0);
    assert_eq!(engines.probes(P), 1, "{:?}", engines.uris());
}
