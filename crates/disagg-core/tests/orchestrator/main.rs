//! The [`Orchestrator`] driven through a scripted in-memory transport ([`fake`]) on
//! tokio's paused clock: every timing case (budgets, deadlines, backoff, grace, queue
//! waits) is exact and takes no wall-clock time, next to the socket tests of the root
//! package (`tests/faults`, `tests/reliability`, `tests/fault_matrix`) that run the same
//! cases against simulated engines.
//!
//! Each test pins one behaviour, on what the client gets (status, error code, headers,
//! frames and when each came) and on what the engines got (each leg's URI, body and
//! engine-side id, when it was sent, and whether the orchestrator read it to its end or
//! abandoned it, and when).

mod bidi;
mod error_body;
mod fake;
mod migrate;
mod observe;
mod queued;
mod tokens;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use disagg_connectors::common::Rooms;
use disagg_connectors::sglang::SglangBootstrap;
use disagg_connectors::vllm::VllmNixl;
use disagg_core::error::ConnectorError;
use disagg_core::error::{PdError, Side};
use disagg_core::orchestrator::OrchestratorBuilder;
use disagg_core::orchestrator::{KvRelease, OrchestratorConfig, PrefillFailure};
use disagg_core::router::Route;
use disagg_core::transport::Transport;
use disagg_core::{
    Endpoint, EndpointSource, KvConnector, Orchestrator, PdRequest, Role, connector::Handoff,
    connector::HandoffFound, connector::PrefillAnswer, orchestrator::PdBody, request::Api,
    source::StaticSource,
};
use disagg_resilience::{
    AdmissionConfig, Backoff, EndpointHealth, HealthConfig, HealthSource, Limits, RetryPolicy,
};
use fake::{Fake, Reply};
use futures::FutureExt;
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tokio::time::{Instant, sleep, timeout};

const P1: &str = "http://p1:8100";
const P2: &str = "http://p2:8100";
const D1: &str = "http://d1:8200";
const CHAT: &str = "/v1/chat/completions";

/// The client's request: a streamed chat completion.
const CLIENT: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":16}"#;

/// The handoff a vLLM prefill answers with, spaced and typed as no serializer would
/// write it (`[[1, 2, 3]]`, `1.0`), so a decode leg that got it re-encoded rather than
/// verbatim fails the comparison.
const KV: &str = r#"{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1, 2, 3]],"remote_engine_id":"engine-7","remote_request_id":"chatcmpl-p-0a1b2c3d","remote_host":"10.0.0.5","remote_port":5600,"tp_size":1.0}"#;

const DONE: &str = "data: [DONE]\n\n";

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A vLLM NIXL prefill's answer: one token, length-capped, with [`KV`].
fn prefill_answer() -> Reply {
    Reply::json(
        200,
        &format!(
            r#"{{"id":"chatcmpl-p","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"A"}},"finish_reason":"length"}}],"kv_transfer_params":{KV}}}"#
        ),
    )
}

/// The decode leg's body after a NIXL handoff: the client's, untouched, with the
/// prefill's [`KV`] appended byte for byte.
fn handed() -> String {
    let client = CLIENT.strip_suffix('}').unwrap();
    format!(r#"{client},"kv_transfer_params":{KV}}}"#)
}

/// An engine's OpenAI-format error answer.
fn engine_error(status: u16, message: &str) -> Reply {
    Reply::json(
        status,
        &json!({"error": {"message": message, "type": "Error", "code": status}}).to_string(),
    )
}

/// The `i`-th event of a streamed chat answer.
fn event(i: u32) -> String {
    format!(r#"data: {{"choices":[{{"index":0,"delta":{{"content":"t{i}"}}}}]}}"#) + "\n\n"
}

fn endpoints(prefill: &[&str], decode: &[&str]) -> Vec<Endpoint> {
    let p = prefill.iter().map(|u| Endpoint::new(u, Role::Prefill));
    let d = decode.iter().map(|u| Endpoint::new(u, Role::Decode));
    p.chain(d).map(Result::unwrap).collect()
}

/// What a test sets up: the orchestrator's settings (`c.prefill_timeout = ..` reaches
/// them through `Deref`), and the retry policy and admission limits, attached as
/// `disagg-resilience`'s `Backoff` and `Limits` when they ask for anything.
#[derive(Default)]
struct Setup {
    config: OrchestratorConfig,
    retry: RetryPolicy,
    admission: AdmissionConfig,
}

impl std::ops::Deref for Setup {
    type Target = OrchestratorConfig;
    fn deref(&self) -> &OrchestratorConfig {
        &self.config
    }
}

impl std::ops::DerefMut for Setup {
    fn deref_mut(&mut self) -> &mut OrchestratorConfig {
        &mut self.config
    }
}

impl Setup {
    fn apply(self, mut builder: OrchestratorBuilder) -> OrchestratorBuilder {
        if self.retry.max_retries > 0 {
            builder = builder.retry(Backoff::new(self.retry));
        }
        let a = &self.admission;
        if a.max_in_flight.is_some() {
            builder = builder.admission(Limits::new(self.admission));
        }
        builder.config(self.config)
    }
}

/// An orchestrator over `prefill` and [`D1`], sending through `fake`.
fn orchestrator(
    fake: &Fake,
    prefill: &[&str],
    connector: impl KvConnector,
    config: impl FnOnce(&mut Setup),
) -> Orchestrator {
    let mut c = Setup::default();
    config(&mut c);
    let source = StaticSource::new(endpoints(prefill, &[D1]));
    c.apply(Orchestrator::builder(source, fake.clone(), connector))
        .build()
}

/// vLLM NIXL over [`P1`] and [`D1`].
fn nixl(fake: &Fake, config: impl FnOnce(&mut Setup)) -> Orchestrator {
    orchestrator(fake, &[P1], VllmNixl::new(), config)
}

/// SGLang over [`P1`] and [`D1`], rooms drawn from a fixed seed.
fn sglang(fake: &Fake, config: impl FnOnce(&mut Setup)) -> Orchestrator {
    let connector = SglangBootstrap::with_rooms(Rooms::from_seed(7));
    orchestrator(fake, &[P1], connector, config)
}

/// The [`CLIENT`] request, with `headers`.
fn chat_with(orch: &Orchestrator, headers: &[(&'static str, &'static str)]) -> PdRequest {
    let mut h = HeaderMap::new();
    for (name, value) in headers {
        h.insert(*name, HeaderValue::from_static(value));
    }
    orch.request(Api::Chat, h, &Bytes::from_static(CLIENT.as_bytes()))
        .unwrap()
}

fn chat(orch: &Orchestrator) -> PdRequest {
    chat_with(orch, &[])
}

/// `f`, or a failure if it could never finish (the paused clock jumps to the limit
/// when nothing else is left to happen, so a stuck test fails at once).
async fn within<F: Future>(f: F) -> F::Output {
    timeout(Duration::from_secs(3600), f)
        .await
        .expect("stuck: nothing left to happen")
}

/// Let spawned tasks run until they wait (a few turns of the scheduler; no time
/// passes).
async fn turns() {
    for _ in 0..16 {
        tokio::task::yield_now().await;
    }
}

async fn serve(orch: &Orchestrator, req: PdRequest) -> Result<Response<PdBody>, PdError> {
    within(orch.serve(req)).await
}

fn header<'a>(resp: &'a Response<PdBody>, name: &str) -> Option<&'a str> {
    resp.headers().get(name).map(|v| v.to_str().unwrap())
}

/// The body's next frame: its data, or the error it ended with; `None` at its end.
async fn next(body: &mut PdBody) -> Option<Result<String, String>> {
    let frame = within(body.frame()).await?;
    Some(
        frame
            .map(|f| String::from_utf8(f.into_data().unwrap().to_vec()).unwrap())
            .map_err(|e| e.to_string()),
    )
}

/// The body's next frame, which must be data.
async fn data(body: &mut PdBody) -> String {
    next(body).await.expect("a frame").expect("data")
}

/// The `error` object of an in-band SSE error event.
fn error_event(frame: &str) -> Value {
    let payload = frame
        .trim()
        .strip_prefix("data: ")
        .unwrap_or_else(|| panic!("not an SSE event: {frame:?}"));
    let v: Value = serde_json::from_str(payload).unwrap();
    v["error"].clone()
}

/// The in-flight count of the endpoint at `url`.
fn in_flight(orch: &Orchestrator, url: &str) -> usize {
    let set = orch.source().snapshot();
    let all = set
        .by_role(Role::Prefill)
        .iter()
        .chain(set.by_role(Role::Decode));
    all.filter(|e| e.id().as_str() == url)
        .map(|e| e.in_flight())
        .sum()
}

/// Nothing of any request is left: no endpoint in-flight count, no admitted or queued
/// request, no release running.
fn assert_settled(orch: &Orchestrator) {
    let set = orch.source().snapshot();
    for e in set
        .by_role(Role::Prefill)
        .iter()
        .chain(set.by_role(Role::Decode))
    {
        assert_eq!(e.in_flight(), 0, "{} still counts a request", e.id());
    }
    let st = orch.stats();
    assert_eq!(
        (
            st.in_flight,
            st.queued_now,
            st.kv_releases_in_flight,
            st.kv_releases_skipped
        ),
        (0, 0, 0, 0),
        "{st:?}"
    );
}

fn assert_error(e: &PdError, status: u16, code: &str) {
    assert_eq!(
        (e.http().status.as_u16(), e.http().code),
        (status, code),
        "{e:?}"
    );
}

// === 1. the sequential (NIXL) path ===

#[tokio::test(start_paused = true)]
async fn nixl_hands_the_prefills_kv_to_the_decode_and_streams_frame_by_frame() {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer().after(ms(30)));
    let (decode, feed) = Reply::sse().after(ms(5)).fed();
    fake.on(D1, CHAT, decode);
    let orch = nixl(&fake, |_| {});
    let t0 = Instant::now();
    let resp = serve(&orch, chat_with(&orch, &[("x-request-id", "client-7")]))
        .await
        .unwrap();
    // The decode leg went out when the prefill answered; the head is relayed at once.
    assert_eq!(t0.elapsed(), ms(35));
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(header(&resp, "x-disagg-handoff"), Some("kv"));
    assert_eq!(header(&resp, "x-request-id"), Some("client-7"));
    assert_eq!(header(&resp, "content-type"), Some("text/event-stream"));
    let timing = header(&resp, "server-timing").expect("server-timing");
    for phase in ["prefill;dur=", "handoff;dur=", "decode;dur="] {
        assert!(timing.contains(phase), "{timing}");
    }

    let calls = fake.calls();
    let [p, d] = &calls[..] else {
        panic!("{calls:?}")
    };
    assert_eq!(
        (p.method.as_str(), p.uri.to_string()),
        ("POST", format!("{P1}{CHAT}"))
    );
    assert_eq!(
        (d.method.as_str(), d.uri.to_string()),
        ("POST", format!("{D1}{CHAT}"))
    );
    assert_eq!((p.at, d.at), (t0, t0 + ms(30)));
    assert_eq!(p.header("content-type"), Some("application/json"));
    // The prefill leg: one token, not streamed, asking for a remote decode.
    let pj = p.json();
    assert_eq!(pj["stream"], false);
    assert_eq!(pj["max_tokens"], 1);
    assert_eq!(pj["max_completion_tokens"], 1);
    assert!(pj.get("stream_options").is_none(), "{pj}");
    assert_eq!(pj["messages"], json!([{"role": "user", "content": "hi"}]));
    assert_eq!(
        pj["kv_transfer_params"],
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
               "remote_block_ids": null, "remote_host": null, "remote_port": null})
    );
    // The decode leg: the client's body, untouched, plus the prefill's handoff verbatim.
    assert_eq!(d.text(), handed());
    // One engine-side id on both legs, the proxy's own, not the client's.
    assert_eq!(p.id(), d.id());
    assert_ne!(p.id(), "client-7");
    assert!(p.finished(), "the prefill's answer was read to its end");

    // Each frame reaches the client as soon as the engine sends it, alone: nothing
    // more is there before the engine sends the next.
    let mut body = resp.into_body();
    for i in 0..3 {
        feed.send(event(i));
        assert_eq!(data(&mut body).await, event(i));
        assert!(
            body.frame().now_or_never().is_none(),
            "frame {i} came alone"
        );
        assert!(d.is_open());
    }
    feed.send(DONE);
    feed.end();
    assert_eq!(data(&mut body).await, DONE);
    assert!(next(&mut body).await.is_none());
    assert_eq!(t0.elapsed(), ms(35), "no frame waited for a timer");
    assert!(d.finished());
    assert_settled(&orch);
}

// === 2. the concurrent (SGLang) path ===

#[tokio::test(start_paused = true)]
async fn sglang_sends_both_legs_at_once_with_one_room_and_one_id() {
    let fake = Fake::new();
    fake.on(P1, CHAT, Reply::json(200, r#"{"id":"p"}"#).after(ms(40)));
    fake.on(
        D1,
        CHAT,
        Reply::sse()
            .after(ms(10))
            .frame(ms(5), event(0))
            .frame(ms(5), DONE),
    );
    let orch = sglang(&fake, |_| {});
    let t0 = Instant::now();
    let resp = serve(&orch, chat(&orch)).await.unwrap();
    // Relayed at the decode's head, before the prefill answered.
    assert_eq!(t0.elapsed(), ms(10));
    assert_eq!(header(&resp, "x-disagg-handoff"), Some("kv"));
    let calls = fake.calls();
    let [p, d] = &calls[..] else {
        panic!("{calls:?}")
    };
    assert_eq!((p.at, d.at), (t0, t0));
    assert_eq!(p.id(), d.id());
    assert_eq!(p.json(), d.json(), "both legs carry the same body");
    let pj = p.json();
    assert_eq!(pj["bootstrap_host"], "p1");
    assert!(pj["bootstrap_room"].is_u64(), "{pj}");
    assert_eq!(pj["stream"], true, "the prefill gets the client's body");

    let mut body = resp.into_body();
    assert_eq!(data(&mut body).await, event(0));
    assert_eq!(data(&mut body).await, DONE);
    assert_eq!(t0.elapsed(), ms(20));
    assert!(d.finished() && p.is_open());
    // The decode's stream is over; the client's ends when the prefill leg has too, so
    // no leg outlives the body.
    assert!(next(&mut body).await.is_none());
    assert_eq!(t0.elapsed(), ms(40));
    assert!(p.finished());
    assert_settled(&orch);
}

#[tokio::test(start_paused = true)]
async fn a_prefill_failing_after_the_decode_head_ends_the_stream_with_its_error() {
    let fake = Fake::new();
    fake.on(P1, CHAT, engine_error(503, "KV cache full").after(ms(50)));
    let (decode, feed) = Reply::sse().fed();
    fake.on(D1, CHAT, decode);
    // A 503 prefill is retryable, but not once the answer has begun.
    let orch = sglang(&fake, |c| c.retry = RetryPolicy::retries(3));
    let t0 = Instant::now();
    let resp = serve(&orch, chat(&orch)).await.unwrap();
    assert_eq!(
        (resp.status(), t0.elapsed()),
        (StatusCode::OK, Duration::ZERO)
    );
    let mut body = resp.into_body();
    feed.send(event(0));
    assert_eq!(data(&mut body).await, event(0));

    let err = error_event(&data(&mut body).await);
    assert_eq!(t0.elapsed(), ms(50), "ended when the prefill failed");
    assert_eq!(
        (err["code"].as_str(), err["type"].as_str()),
        (Some("prefill_failed"), Some("server_error"))
    );
    let message = err["message"].as_str().unwrap();
    assert!(
        message.contains("503") && message.contains("KV cache full"),
        "{message}"
    );
    assert!(next(&mut body).await.is_none());

    let d = &fake.calls_to(D1)[0];
    assert_eq!(
        d.abandoned_at(),
        Some(t0 + ms(50)),
        "the decode leg was dropped at once"
    );
    assert_eq!(fake.calls_to(P1).len(), 1, "not retried");
    assert_eq!(orch.stats().retries, 0);
    feed.send(event(1)); // the engine talks on; nobody listens
    assert_settled(&orch);
}

#[tokio::test(start_paused = true)]
async fn a_prefill_failing_before_the_decode_head_fails_the_attempt_and_drops_the_decode() {
    // The decode's head never comes, or comes after the prefill failed.
    for decode in [Reply::hang(), Reply::sse().after(ms(100))] {
        let fake = Fake::new();
        fake.on(P1, CHAT, engine_error(500, "boom").after(ms(20)));
        fake.on(D1, CHAT, decode);
        let orch = sglang(&fake, |_| {});
        let t0 = Instant::now();
        let e = serve(&orch, chat(&orch)).await.unwrap_err();
        assert_error(&e, 502, "prefill_failed");
        assert_eq!((e.side(), t0.elapsed()), (Side::Prefill, ms(20)));
        let d = &fake.calls_to(D1)[0];
        assert_eq!(d.head_at(), None);
        assert_eq!(d.abandoned_at(), Some(t0 + ms(20)));
        assert_settled(&orch);
    }
}

// === 3. early KV release (KvRelease::AbortDecode) ===

fn release_on(c: &mut Setup) {
    c.kv_release = KvRelease::AbortDecode {
        grace: ms(250),
        wait: ms(2000),
    };
}

/// The checks every release leg passes: the decode leg as a one-token, non-streaming
/// request carrying the prefill's handoff verbatim, under the prefill's engine id.
fn assert_release_leg(release: &fake::Call, prefill: &fake::Call) {
    assert_eq!(release.endpoint(), D1);
    let j = release.json();
    assert_eq!(j["max_tokens"], 1, "{j}");
    assert_eq!(j["stream"], false, "{j}");
    assert!(
        release
            .text()
            .contains(&format!(r#""kv_transfer_params":{KV}"#)),
        "{}",
        release.text()
    );
    assert_eq!(release.id(), prefill.id());
}

#[tokio::test(start_paused = true)]
async fn a_client_leaving_during_the_prefill_releases_the_kv_it_answers_within_grace() {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer().after(ms(100)));
    fake.on(D1, CHAT, Reply::hang());
    let orch = nixl(&fake, release_on);
    let t0 = Instant::now();
    // The client leaves 10 ms in, while the prefill runs.
    assert!(timeout(ms(10), orch.serve(chat(&orch))).await.is_err());
    turns().await;
    assert_eq!(
        orch.stats().kv_releases_in_flight,
        1,
        "a release runs in the background"
    );

    sleep(ms(3000)).await;
    let calls = fake.calls();
    let [p, release] = &calls[..] else {
        panic!("{calls:?}")
    };
    assert!(p.finished(), "the prefill's answer was caught");
    assert_eq!(release.at, t0 + ms(100), "sent as the prefill answered");
    assert_release_leg(release, p);
    assert_eq!(
        release.abandoned_at(),
        Some(t0 + ms(2100)),
        "dropped after `wait`"
    );
    assert_eq!(orch.stats().kv_releases, 1);
    assert_settled(&orch);
}

/// vLLM NIXL's plan, without a release leg of its own (`KvConnector::release_leg`'s
/// default).
#[derive(Debug)]
struct NixlWithoutRelease;

#[async_trait]
impl KvConnector for NixlWithoutRelease {
    fn name(&self) -> &'static str {
        "nixl-without-release"
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        VllmNixl::new().prepare(route, req)
    }

    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<HandoffFound, ConnectorError> {
        VllmNixl::new().complete(handoff, answer).await
    }
}

/// A gate that opens at `open` (never, when `None`), as LMCache's opens when the KV's
/// notifications came; it holds a clone of the connector's token while it lives.
#[derive(Debug)]
struct TimedGate {
    open: Option<Instant>,
    _token: Arc<()>,
}

#[async_trait]
impl disagg_core::connector::KvGate for TimedGate {
    async fn ready(&self) -> Result<(), ConnectorError> {
        match self.open {
            Some(at) => {
                tokio::time::sleep_until(at).await;
                Ok(())
            }
            None => std::future::pending().await,
        }
    }
}

/// vLLM NIXL's plan with a gate registered at `prepare`, as LMCache registers its
/// notification wait: it opens `open` after the request came (never, when `None`), and
/// holds `token` while it lives.
#[derive(Debug)]
struct NixlWithGate {
    open: Option<Duration>,
    token: Arc<()>,
}

#[async_trait]
impl KvConnector for NixlWithGate {
    fn name(&self) -> &'static str {
        "nixl-with-gate"
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        let mut handoff = VllmNixl::new().prepare(route, req)?;
        handoff.gate = Some(Arc::new(TimedGate {
            open: self.open.map(|d| Instant::now() + d),
            _token: Arc::clone(&self.token),
        }));
        Ok(handoff)
    }

    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<HandoffFound, ConnectorError> {
        VllmNixl::new().complete(handoff, answer).await
    }

    fn release_leg(&self, api: Api, leg: &disagg_core::connector::Leg) -> Option<Bytes> {
        VllmNixl::new().release_leg(api, leg)
    }
}

/// A plan with a gate (LMCache's: the KV is pushed, and only its notifications say it
/// reached the decode) is released once the gate opens, not at the prefill's answer
/// (the decode would compute the prompt and leave the pushed KV unused), and the gate
/// (a per-request registration counted against its ceiling) goes as it opens.
#[tokio::test(start_paused = true)]
async fn an_early_release_of_a_gated_plan_waits_for_the_gate_then_lets_it_go() {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer().after(ms(100)));
    fake.on(D1, CHAT, Reply::hang());
    let token = Arc::new(());
    let connector = NixlWithGate {
        open: Some(ms(400)),
        token: Arc::clone(&token),
    };
    let orch = orchestrator(&fake, &[P1], connector, release_on);
    // Held by the test and the connector; each request's gate adds one.
    let idle = Arc::strong_count(&token);
    let t0 = Instant::now();
    assert!(timeout(ms(10), orch.serve(chat(&orch))).await.is_err());
    sleep(ms(200)).await;
    // The prefill answered at 100 ms; the gate is still shut: nothing sent yet.
    assert_eq!(fake.calls().len(), 1, "{:?}", fake.calls());
    assert_eq!(Arc::strong_count(&token), idle + 1);
    sleep(ms(300)).await;
    let calls = fake.calls();
    let [p, release] = &calls[..] else {
        panic!("{calls:?}")
    };
    assert_eq!(release.at, t0 + ms(400), "sent as the gate opened");
    assert_release_leg(release, p);
    assert_eq!(
        Arc::strong_count(&token),
        idle,
        "the gate outlived its answer"
    );
    sleep(ms(3000)).await;
    assert_eq!(orch.stats().kv_releases, 1);
    assert_settled(&orch);
}

/// A gate that never opens (the KV never reached the decode): no release leg is sent,
/// and the gate goes after `wait`.
#[tokio::test(start_paused = true)]
async fn an_early_release_whose_gate_never_opens_sends_nothing() {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer().after(ms(100)));
    fake.on(D1, CHAT, Reply::hang());
    let token = Arc::new(());
    let connector = NixlWithGate {
        open: None,
        token: Arc::clone(&token),
    };
    let orch = orchestrator(&fake, &[P1], connector, release_on);
    let idle = Arc::strong_count(&token);
    assert!(timeout(ms(10), orch.serve(chat(&orch))).await.is_err());
    sleep(ms(5000)).await;
    let calls = fake.calls();
    let [p] = &calls[..] else { panic!("{calls:?}") };
    assert_eq!(p.endpoint(), P1);
    assert_eq!(orch.stats().kv_releases, 0);
    assert_eq!(Arc::strong_count(&token), idle);
    assert_settled(&orch);
}

#[tokio::test(start_paused = true)]
async fn a_connector_without_a_release_leg_releases_nothing() {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer().after(ms(100)));
    fake.on(D1, CHAT, Reply::hang());
    let orch = orchestrator(&fake, &[P1], NixlWithoutRelease, release_on);
    // The client leaves 10 ms in, while the prefill runs: the prefill's answer is
    // caught, but the connector has no leg that takes the KV, so none is sent.
    assert!(timeout(ms(10), orch.serve(chat(&orch))).await.is_err());
    sleep(ms(3000)).await;
    let calls = fake.calls();
    let [p] = &calls[..] else { panic!("{calls:?}") };
    assert_eq!(p.endpoint(), P1);
    assert_eq!(orch.stats().kv_releases, 0);
    assert_settled(&orch);
}

#[tokio::test(start_paused = true)]
async fn a_client_leaving_while_the_decode_is_queued_releases_the_kv_at_once() {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer());
    fake.always(D1, CHAT, Reply::hang());
    let orch = nixl(&fake, release_on);
    let t0 = Instant::now();
    // The client leaves while the decode engine holds the leg without answering.
    assert!(timeout(ms(100), orch.serve(chat(&orch))).await.is_err());
    sleep(ms(3000)).await;
    let calls = fake.calls();
    let [p, d, release] = &calls[..] else {
        panic!("{calls:?}")
    };
    assert_eq!(d.abandoned_at(), Some(t0 + ms(100)));
    assert_eq!(release.at, t0 + ms(100));
    assert_release_leg(release, p);
    assert_eq!(release.abandoned_at(), Some(t0 + ms(2100)));
    assert_eq!(orch.stats().kv_releases, 1);
    assert_settled(&orch);
}

/// vLLM sends a streamed decode's head before it loads the KV: a client that leaves
/// after the head but before the first chunk left the load unfinished, and the KV is
/// released as when it leaves before the head. Once a chunk came, the KV was the
/// engine's: nothing is released.
#[tokio::test(start_paused = true)]
async fn a_client_leaving_between_the_decodes_head_and_first_chunk_releases_the_kv() {
    for (what, chunks, released) in [("before", 0, 1), ("after", 1, 0)] {
        let fake = Fake::new();
        fake.on(P1, CHAT, prefill_answer());
        fake.on(
            D1,
            CHAT,
            Reply::sse()
                .frame(ms(100), event(0))
                .frame(ms(400), event(1)),
        );
        let orch = nixl(&fake, release_on);
        let resp = serve(&orch, chat(&orch)).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "{what}");
        let mut body = resp.into_body();
        for i in 0..chunks {
            assert_eq!(data(&mut body).await, event(i), "{what}");
        }
        sleep(ms(50)).await;
        drop(body);
        sleep(ms(3000)).await;
        let calls = fake.calls();
        assert_eq!(
            (calls.len(), orch.stats().kv_releases),
            (2 + released, released as u64),
            "{what}: {calls:?}"
        );
        if released == 1 {
            assert_release_leg(&calls[2], &calls[0]);
        }
        assert_settled(&orch);
    }
}

#[tokio::test(start_paused = true)]
async fn a_prefill_answering_after_grace_is_aborted_and_nothing_is_sent() {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer().after(ms(500)));
    let orch = nixl(&fake, release_on);
    let t0 = Instant::now();
    assert!(timeout(ms(10), orch.serve(chat(&orch))).await.is_err());
    sleep(ms(3000)).await;
    let calls = fake.calls();
    let [p] = &calls[..] else { panic!("{calls:?}") };
    assert_eq!(
        p.abandoned_at(),
        Some(t0 + ms(260)),
        "aborted `grace` after the client left"
    );
    assert_eq!(orch.stats().kv_releases, 0);
    assert_settled(&orch);
}

#[tokio::test(start_paused = true)]
async fn a_decode_refusing_the_handed_kv_with_4xx_triggers_a_release() {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer());
    fake.on(D1, CHAT, engine_error(400, "bad kv_transfer_params"));
    fake.on(D1, CHAT, Reply::json(200, r#"{"choices":[]}"#));
    let orch = nixl(&fake, release_on);
    let resp = serve(&orch, chat(&orch)).await.unwrap();
    // The engine's own answer, passed through.
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    assert_eq!(header(&resp, "x-disagg-failed-leg"), Some("decode"));
    let mut body = resp.into_body();
    assert!(data(&mut body).await.contains("bad kv_transfer_params"));
    assert!(next(&mut body).await.is_none());
    sleep(ms(10)).await;
    let calls = fake.calls();
    let [p, d, release] = &calls[..] else {
        panic!("{calls:?}")
    };
    assert_eq!(d.text(), handed());
    assert_release_leg(release, p);
    assert_eq!(orch.stats().kv_releases, 1);
    assert_settled(&orch);

    // The control: a decode that took the leg needs no release.
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer());
    fake.on(D1, CHAT, Reply::sse().frame(ms(0), DONE));
    let orch = nixl(&fake, release_on);
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    assert_eq!(data(&mut body).await, DONE);
    assert!(next(&mut body).await.is_none());
    sleep(ms(3000)).await;
    assert_eq!((fake.calls().len(), orch.stats().kv_releases), (2, 0));
}

// === 4. retries ===

#[tokio::test(start_paused = true)]
async fn a_prefill_that_cannot_connect_or_answers_503_is_retried_on_another_endpoint() {
    for first in [Reply::refuse(), engine_error(503, "overloaded")] {
        let fake = Fake::new();
        fake.on(P1, CHAT, first);
        fake.on(P2, CHAT, prefill_answer());
        fake.on(D1, CHAT, Reply::sse().frame(ms(0), DONE));
        let orch = orchestrator(&fake, &[P1, P2], VllmNixl::new(), |c| {
            c.retry = RetryPolicy::retries(1)
        });
        let t0 = Instant::now();
        let resp = serve(&orch, chat(&orch)).await.unwrap();
        assert_eq!(header(&resp, "x-disagg-handoff"), Some("kv"));
        let calls = fake.calls();
        let [p1, p2, d] = &calls[..] else {
            panic!("{calls:?}")
        };
        assert_eq!(
            (p1.endpoint(), p2.endpoint()),
            (P1.to_owned(), P2.to_owned())
        );
        // The jittered backoff: at most the base before the first retry.
        assert_eq!(p1.at, t0);
        assert!(
            p2.at - p1.at <= RetryPolicy::default().backoff_base,
            "{:?}",
            p2.at - p1.at
        );
        // The first attempt's engine id is the request's own (drawn by the proxy); the
        // retry gets a new one, the same on both of its legs.
        assert_eq!(Some(p1.id()), header(&resp, "x-request-id"));
        assert_ne!(p2.id(), p1.id());
        assert_eq!(d.id(), p2.id());
        assert_eq!(orch.stats().retries, 1);
        drop(resp);
        assert_settled(&orch);
    }
}

#[tokio::test(start_paused = true)]
async fn failures_the_engine_saw_through_are_not_retried() {
    // A 500 (the engine failed on the request) and a prefill out of its budget.
    let cases = [
        (engine_error(500, "boom"), 502, "prefill_failed"),
        (Reply::hang(), 504, "prefill_timeout"),
    ];
    for (first, status, code) in cases {
        let fake = Fake::new();
        fake.on(P1, CHAT, first);
        fake.always(P2, CHAT, prefill_answer());
        let orch = orchestrator(&fake, &[P1, P2], VllmNixl::new(), |c| {
            c.retry = RetryPolicy::retries(3);
            c.prefill_timeout = ms(300);
        });
        let e = serve(&orch, chat(&orch)).await.unwrap_err();
        assert_error(&e, status, code);
        assert_eq!(fake.calls().len(), 1);
        assert_eq!(orch.stats().retries, 0);
        assert_settled(&orch);
    }
}

#[tokio::test(start_paused = true)]
async fn retries_stop_at_max_retries_and_at_the_budget() {
    let fake = Fake::new();
    fake.always(P1, CHAT, Reply::refuse());
    fake.always(P2, CHAT, Reply::refuse());
    let orch = orchestrator(&fake, &[P1, P2], VllmNixl::new(), |c| {
        c.retry = RetryPolicy::retries(2)
    });
    let e = serve(&orch, chat(&orch)).await.unwrap_err();
    assert_error(&e, 502, "prefill_failed");
    let to: Vec<String> = fake.calls().iter().map(fake::Call::endpoint).collect();
    assert_eq!(to, [P1, P2, P1], "three attempts, each on the next prefill");
    assert_eq!(orch.stats().retries, 2);

    // A budget of one retry in all: the first request spends it, the second is denied.
    let fake = Fake::new();
    fake.always(P1, CHAT, Reply::refuse());
    fake.always(P2, CHAT, Reply::refuse());
    let orch = orchestrator(&fake, &[P1, P2], VllmNixl::new(), |c| {
        let mut retry = RetryPolicy::retries(1);
        retry.budget_ratio = 0.0;
        retry.budget_reserve = 1;
        c.retry = retry;
    });
    for _ in 0..2 {
        let e = serve(&orch, chat(&orch)).await.unwrap_err();
        assert_error(&e, 502, "prefill_failed");
    }
    let st = orch.stats();
    assert_eq!(
        (fake.calls().len(), st.retries, st.retries_denied),
        (3, 1, 1),
        "{st:?}"
    );
    assert_settled(&orch);
}

#[tokio::test(start_paused = true)]
async fn a_refused_decode_is_retried_as_a_whole_new_attempt() {
    let fake = Fake::new();
    fake.always(P1, CHAT, prefill_answer());
    fake.on(D1, CHAT, Reply::refuse());
    fake.on(D1, CHAT, Reply::sse().frame(ms(0), DONE));
    let orch = nixl(&fake, |c| c.retry = RetryPolicy::retries(1));
    let resp = serve(&orch, chat(&orch)).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let calls = fake.calls();
    let [p, d, p_again, d_again] = &calls[..] else {
        panic!("{calls:?}")
    };
    assert_eq!((p.endpoint(), d.endpoint()), (P1.to_owned(), D1.to_owned()));
    assert_eq!(
        (p_again.endpoint(), d_again.endpoint()),
        (P1.to_owned(), D1.to_owned())
    );
    assert_eq!(p.id(), d.id());
    assert_eq!(p_again.id(), d_again.id());
    assert_ne!(p.id(), p_again.id());
    assert_eq!(orch.stats().retries, 1);
    drop(resp);
    assert_settled(&orch);
}

#[tokio::test(start_paused = true)]
async fn a_decode_stream_breaking_after_its_first_bytes_is_not_retried() {
    let fake = Fake::new();
    fake.always(P1, CHAT, prefill_answer());
    fake.on(
        D1,
        CHAT,
        Reply::sse()
            .frame(ms(10), event(0))
            .fail(ms(10), "connection reset"),
    );
    fake.always(D1, CHAT, Reply::sse().frame(ms(0), DONE));
    let orch = nixl(&fake, |c| c.retry = RetryPolicy::retries(3));
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    assert_eq!(data(&mut body).await, event(0));
    let err = error_event(&data(&mut body).await);
    assert_eq!(err["code"], "decode_stream_failed");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("connection reset"),
        "{err}"
    );
    assert!(next(&mut body).await.is_none());
    assert_eq!(fake.calls().len(), 2);
    assert_eq!(orch.stats().retries, 0);
    assert_settled(&orch);

    // A non-streaming answer that breaks half way ends the client's body with the
    // error (which the server turns into an aborted response), not with an event.
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer());
    let (decode, feed) = Reply::json(200, "").fed();
    fake.on(D1, CHAT, decode);
    let orch = nixl(&fake, |c| c.retry = RetryPolicy::retries(3));
    let unary = Bytes::from_static(br#"{"model":"m","messages":[],"max_tokens":4}"#);
    let req = orch.request(Api::Chat, HeaderMap::new(), &unary).unwrap();
    let mut body = serve(&orch, req).await.unwrap().into_body();
    feed.send(r#"{"id":"chatcmpl-d","choi"#);
    assert_eq!(data(&mut body).await, r#"{"id":"chatcmpl-d","choi"#);
    feed.fail("connection reset");
    let e = next(&mut body).await.expect("an end").unwrap_err();
    assert!(e.contains("connection reset"), "{e}");
    assert!(next(&mut body).await.is_none());
    assert_eq!((fake.calls().len(), orch.stats().retries), (2, 0));
    assert_settled(&orch);
}

// === 5. budgets and deadlines ===

#[tokio::test(start_paused = true)]
async fn each_step_out_of_its_budget_fails_with_its_own_code_and_abandons_its_leg() {
    // prefill_timeout: the prefill never answers.
    let fake = Fake::new();
    fake.on(P1, CHAT, Reply::hang());
    let orch = nixl(&fake, |c| c.prefill_timeout = ms(300));
    let t0 = Instant::now();
    let e = serve(&orch, chat(&orch)).await.unwrap_err();
    assert_error(&e, 504, "prefill_timeout");
    assert_eq!(t0.elapsed(), ms(300));
    let calls = fake.calls();
    let [p] = &calls[..] else { panic!("{calls:?}") };
    assert_eq!(p.abandoned_at(), Some(t0 + ms(300)));
    assert_eq!(orch.stats().deadlines_exceeded, 0);
    assert_settled(&orch);

    // decode_head_timeout: the decode takes the leg and never answers.
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer().after(ms(50)));
    fake.on(D1, CHAT, Reply::hang());
    let orch = nixl(&fake, |c| c.decode_head_timeout = ms(300));
    let t0 = Instant::now();
    let e = serve(&orch, chat(&orch)).await.unwrap_err();
    assert_error(&e, 504, "decode_timeout");
    assert_eq!(e.side(), Side::Decode);
    assert_eq!(t0.elapsed(), ms(350));
    assert_eq!(fake.calls_to(D1)[0].abandoned_at(), Some(t0 + ms(350)));
    assert_settled(&orch);
}

/// vLLM NIXL, except that one step of its handoff never finishes.
struct Stuck(Step);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Step {
    Resolve,
    Complete,
}

#[async_trait]
impl KvConnector for Stuck {
    fn name(&self) -> &'static str {
        "stuck"
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        VllmNixl::new().prepare(route, req)
    }

    async fn resolve(
        &self,
        _handoff: &mut Handoff,
        _transport: &dyn Transport,
    ) -> Result<(), ConnectorError> {
        if self.0 == Step::Resolve {
            std::future::pending::<()>().await;
        }
        Ok(())
    }

    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<HandoffFound, ConnectorError> {
        if self.0 == Step::Complete {
            std::future::pending::<()>().await;
        }
        VllmNixl::new().complete(handoff, answer).await
    }
}

#[tokio::test(start_paused = true)]
async fn a_handoff_step_that_never_finishes_is_a_handoff_timeout() {
    // Before any leg: nothing is sent.
    let fake = Fake::new();
    let orch = orchestrator(&fake, &[P1], Stuck(Step::Resolve), |c| {
        c.handoff_timeout = ms(200)
    });
    let t0 = Instant::now();
    let e = serve(&orch, chat(&orch)).await.unwrap_err();
    assert_error(&e, 504, "handoff_timeout");
    assert_eq!((e.side(), t0.elapsed()), (Side::Prefill, ms(200)));
    assert!(fake.calls().is_empty());
    assert_settled(&orch);

    // Between the legs: the prefill answered, no decode leg is sent.
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer().after(ms(50)));
    let orch = orchestrator(&fake, &[P1], Stuck(Step::Complete), |c| {
        c.handoff_timeout = ms(200)
    });
    let t0 = Instant::now();
    let e = serve(&orch, chat(&orch)).await.unwrap_err();
    assert_error(&e, 504, "handoff_timeout");
    assert_eq!(t0.elapsed(), ms(250));
    let calls = fake.calls();
    let [p] = &calls[..] else { panic!("{calls:?}") };
    assert!(p.finished());
    assert_settled(&orch);
}

#[tokio::test(start_paused = true)]
async fn a_stream_gone_silent_ends_with_a_decode_idle_timeout_event() {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer());
    fake.on(
        D1,
        CHAT,
        Reply::sse()
            .frame(ms(10), event(0))
            .frame(ms(10), event(1))
            .stall(),
    );
    let orch = nixl(&fake, |c| c.decode_idle_timeout = Some(ms(300)));
    let t0 = Instant::now();
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    assert_eq!(data(&mut body).await, event(0));
    assert_eq!(t0.elapsed(), ms(10));
    assert_eq!(data(&mut body).await, event(1));
    assert_eq!(t0.elapsed(), ms(20));
    let err = error_event(&data(&mut body).await);
    assert_eq!(err["code"], "decode_idle_timeout");
    assert_eq!(
        t0.elapsed(),
        ms(320),
        "the idle budget counts from the last frame"
    );
    assert!(next(&mut body).await.is_none());
    assert_eq!(fake.calls_to(D1)[0].abandoned_at(), Some(t0 + ms(320)));
    assert_settled(&orch);
}

/// Both legs at once (SGLang's bootstrap; vLLM Mooncake alike): the decode's head comes
/// at once, as vLLM sends it before it loads the KV, and its first chunk only after the
/// prefill answered (500 ms, past the 300 ms idle limit). That wait is the prefill's,
/// bounded by its own budget: the stream is served, and the decode's idle time counts
/// from the prefill's answer (the stall after the first chunk, at 520 ms, ends it at
/// 820 ms).
#[tokio::test(start_paused = true)]
async fn a_decode_silent_while_its_concurrent_prefill_runs_is_not_idle() {
    let fake = Fake::new();
    fake.on(P1, CHAT, Reply::json(200, r#"{"id":"p"}"#).after(ms(500)));
    fake.on(D1, CHAT, Reply::sse().frame(ms(520), event(0)).stall());
    let connector = SglangBootstrap::with_rooms(Rooms::from_seed(7));
    let orch = orchestrator(&fake, &[P1], connector, |c| {
        c.decode_idle_timeout = Some(ms(300))
    });
    let t0 = Instant::now();
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    assert_eq!(t0.elapsed(), ms(0), "the decode's head came at once");
    assert_eq!(data(&mut body).await, event(0));
    assert_eq!(t0.elapsed(), ms(520));
    let err = error_event(&data(&mut body).await);
    assert_eq!(err["code"], "decode_idle_timeout");
    assert_eq!(t0.elapsed(), ms(820));
    assert!(next(&mut body).await.is_none());
    assert_settled(&orch);

    // A decode that stays silent after the prefill answered: its idle time counts from
    // that answer (500 ms), not from its head.
    let fake = Fake::new();
    fake.on(P1, CHAT, Reply::json(200, r#"{"id":"p"}"#).after(ms(500)));
    fake.on(D1, CHAT, Reply::sse().stall());
    let connector = SglangBootstrap::with_rooms(Rooms::from_seed(7));
    let orch = orchestrator(&fake, &[P1], connector, |c| {
        c.decode_idle_timeout = Some(ms(300))
    });
    let t0 = Instant::now();
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    let err = error_event(&data(&mut body).await);
    assert_eq!(err["code"], "decode_idle_timeout");
    assert_eq!(t0.elapsed(), ms(800));
    assert!(next(&mut body).await.is_none());
    assert_settled(&orch);
}

#[tokio::test(start_paused = true)]
async fn the_deadline_ends_a_running_stream_with_deadline_exceeded() {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer());
    let mut decode = Reply::sse();
    for i in 0..50 {
        decode = decode.frame(ms(150), event(i));
    }
    fake.on(D1, CHAT, decode);
    let orch = nixl(&fake, |c| c.deadline = Some(ms(1000)));
    let t0 = Instant::now();
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    for i in 0..6 {
        assert_eq!(data(&mut body).await, event(i));
        assert_eq!(t0.elapsed(), ms(150) * (i + 1));
    }
    let err = error_event(&data(&mut body).await);
    assert_eq!(
        (err["code"].as_str(), t0.elapsed()),
        (Some("deadline_exceeded"), ms(1000))
    );
    assert!(next(&mut body).await.is_none());
    assert_eq!(fake.calls_to(D1)[0].abandoned_at(), Some(t0 + ms(1000)));
    // Counted for failed heads only (as the socket test pins it).
    assert_eq!(orch.stats().deadlines_exceeded, 0);
    assert_settled(&orch);
}

#[tokio::test(start_paused = true)]
async fn the_nearer_of_deadline_and_step_budget_names_the_error() {
    let (hang, slow) = (Reply::hang, || prefill_answer().after(ms(50)));
    let deadline = "deadline_exceeded";
    // The prefill and decode budgets are 300 ms; the columns: the prefill's reply, the
    // decode's, the configured deadline, the client's `x-disagg-deadline-ms`, and the
    // error code with when it comes.
    let cases = [
        // The prefill hangs: the deadline comes first, then the step budget does.
        (hang(), None, 200, None, deadline, 200),
        (hang(), None, 500, None, "prefill_timeout", 300),
        // The decode hangs after a 50 ms prefill.
        (slow(), Some(hang()), 200, None, deadline, 200),
        (slow(), Some(hang()), 900, None, "decode_timeout", 350),
        // A client's shorter deadline, allowed by the configuration.
        (hang(), None, 900, Some("100"), deadline, 100),
    ];
    for (prefill, decode, total, client, code, at) in cases {
        let fake = Fake::new();
        fake.on(P1, CHAT, prefill);
        if let Some(d) = decode {
            fake.on(D1, CHAT, d);
        }
        let orch = nixl(&fake, |c| {
            c.deadline = Some(ms(total));
            c.client_deadline = true;
            c.prefill_timeout = ms(300);
            c.decode_head_timeout = ms(300);
        });
        let req = match client {
            Some(v) => chat_with(&orch, &[("x-disagg-deadline-ms", v)]),
            None => chat(&orch),
        };
        let t0 = Instant::now();
        let e = serve(&orch, req).await.unwrap_err();
        assert_error(&e, 504, code);
        assert_eq!(t0.elapsed(), ms(at), "{code}");
        assert_eq!(
            orch.stats().deadlines_exceeded,
            u64::from(e.http().code == "deadline_exceeded")
        );
        assert!(
            fake.calls()
                .iter()
                .all(|c| c.abandoned_at() == Some(t0 + ms(at)) || c.finished()),
            "the leg that ran out was dropped: {:?}",
            fake.calls()
        );
        assert_settled(&orch);
    }
}

#[tokio::test(start_paused = true)]
async fn a_deadline_past_what_the_clock_can_hold_is_no_deadline() {
    // The client's u64::MAX ms with no configured deadline, and a configured deadline
    // past what an instant can hold (`--deadline 1e19`, `Duration::MAX`): neither may
    // panic the request's task; both serve a normal answer without a deadline.
    let huge = ("x-disagg-deadline-ms", "18446744073709551615");
    let cases = [
        (None, Some(huge)),
        (Some(Duration::MAX), None),
        (Some(Duration::MAX), Some(huge)),
    ];
    for (configured, header) in cases {
        let headers = Vec::from_iter(header);
        let fake = Fake::new();
        fake.on(P1, CHAT, prefill_answer());
        fake.on(
            D1,
            CHAT,
            Reply::sse().frame(ms(10), event(0)).frame(ms(10), DONE),
        );
        let orch = nixl(&fake, |c| {
            c.deadline = configured;
            c.client_deadline = true;
        });
        let resp = serve(&orch, chat_with(&orch, &headers)).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "{configured:?}");
        let mut body = resp.into_body();
        assert_eq!(data(&mut body).await, event(0));
        assert_eq!(data(&mut body).await, DONE);
        assert!(next(&mut body).await.is_none());
        assert_eq!(orch.stats().deadlines_exceeded, 0);
        assert_settled(&orch);
    }
}

// === 6. admission ===

#[tokio::test(start_paused = true)]
async fn admission_queues_until_the_running_body_ends_and_refuses_past_the_queue() {
    let fake = Fake::new();
    fake.always(P1, CHAT, prefill_answer());
    let (first_decode, feed) = Reply::sse().fed();
    fake.on(D1, CHAT, first_decode);
    fake.always(D1, CHAT, Reply::sse().frame(ms(0), DONE));
    let orch = nixl(&fake, |c| {
        let mut a = AdmissionConfig::default();
        a.max_in_flight = Some(1);
        a.max_queue = 1;
        a.queue_timeout = ms(2000);
        c.admission = a;
    });
    let t0 = Instant::now();
    let mut first = serve(&orch, chat(&orch)).await.unwrap().into_body();
    feed.send(event(0));
    assert_eq!(data(&mut first).await, event(0));

    // The second waits in the queue, the third finds it full.
    let second = tokio::spawn(orch.serve(chat(&orch)));
    turns().await;
    assert_eq!(orch.stats().queued_now, 1);
    let third = serve(&orch, chat(&orch)).await.unwrap_err();
    assert_error(&third, 429, "queue_full");
    assert_eq!(third.http().retry_after, Some(Duration::from_secs(1)));
    // The second gives up after the queue timeout, having reached no engine.
    let second = within(second).await.unwrap().unwrap_err();
    assert_error(&second, 503, "queue_timeout");
    assert_eq!(t0.elapsed(), ms(2000));
    assert_eq!(fake.calls().len(), 2);

    // The fourth waits while the first's body runs, its head long delivered...
    let fourth = tokio::spawn(orch.serve(chat(&orch)));
    sleep(ms(1000)).await;
    assert!(!fourth.is_finished());
    assert_eq!((orch.stats().queued_now, fake.calls().len()), (1, 2));
    // ...and runs as soon as that body ends.
    feed.send(DONE);
    feed.end();
    assert_eq!(data(&mut first).await, DONE);
    assert!(next(&mut first).await.is_none());
    let ended = Instant::now();
    let fourth = within(fourth).await.unwrap().unwrap();
    assert_eq!(fourth.status(), StatusCode::OK);
    let calls = fake.calls();
    assert_eq!(calls.len(), 4);
    assert_eq!(calls[2].at, ended);
    let st = orch.stats();
    assert_eq!(
        (st.rejected_queue_full, st.queue_timeouts, st.queued),
        (1, 1, 2),
        "{st:?}"
    );
    drop(fourth);
    assert_settled(&orch);
}

// === 7. cancellation ===

#[tokio::test(start_paused = true)]
async fn dropping_the_body_mid_stream_drops_the_decode_leg_and_its_counts() {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer());
    let (decode, feed) = Reply::sse().fed();
    fake.on(D1, CHAT, decode);
    let orch = nixl(&fake, |_| {});
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    feed.send(event(0));
    assert_eq!(data(&mut body).await, event(0));
    let d = fake.calls_to(D1).remove(0);
    assert!(d.is_open());
    assert_eq!((in_flight(&orch, P1), in_flight(&orch, D1)), (0, 1));
    assert_eq!(orch.stats().in_flight, 1);
    sleep(ms(500)).await;
    drop(body);
    assert_eq!(d.abandoned_at(), Some(Instant::now()));
    assert_settled(&orch);
}

#[tokio::test(start_paused = true)]
async fn dropping_the_request_drops_whatever_leg_runs() {
    // Sequential, during the prefill: the prefill is abandoned, no decode leg is sent.
    let fake = Fake::new();
    fake.on(P1, CHAT, Reply::hang());
    let orch = nixl(&fake, |_| {});
    let t0 = Instant::now();
    assert!(timeout(ms(10), orch.serve(chat(&orch))).await.is_err());
    let calls = fake.calls();
    let [p] = &calls[..] else { panic!("{calls:?}") };
    assert_eq!(p.abandoned_at(), Some(t0 + ms(10)));
    assert_settled(&orch);

    // Concurrent, with the body dropped while the prefill still runs: both legs go.
    let fake = Fake::new();
    fake.on(P1, CHAT, Reply::json(200, "{}").after(ms(500)));
    let (decode, feed) = Reply::sse().fed();
    fake.on(D1, CHAT, decode);
    let orch = sglang(&fake, |_| {});
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    feed.send(event(0));
    assert_eq!(data(&mut body).await, event(0));
    assert_eq!((in_flight(&orch, P1), in_flight(&orch, D1)), (1, 1));
    sleep(ms(100)).await;
    drop(body);
    let now = Instant::now();
    for c in fake.calls() {
        assert_eq!(c.abandoned_at(), Some(now), "{c:?}");
    }
    assert_settled(&orch);
}

// === 8. health and the decode-only fallback ===

/// An orchestrator over `prefill` and [`D1`] whose source leaves out the endpoints its
/// passive health check ejects after two failures in a row (for 5 s at first); the
/// health, and the endpoints as the source first published them.
fn with_health(
    fake: &Fake,
    prefill: &[&str],
    connector: impl KvConnector,
    config: impl FnOnce(&mut Setup),
) -> (Orchestrator, HealthSource, Vec<Arc<Endpoint>>) {
    let mut hc = HealthConfig::default();
    hc.failure_threshold = 2;
    hc.base_ejection = Duration::from_secs(5);
    let source = HealthSource::new(StaticSource::new(endpoints(prefill, &[D1])), hc);
    let set = source.snapshot();
    let eps = set
        .by_role(Role::Prefill)
        .iter()
        .chain(set.by_role(Role::Decode))
        .cloned()
        .collect();
    let mut c = Setup::default();
    config(&mut c);
    // The source's health hears every attempt: nothing else to wire.
    let orch = c
        .apply(Orchestrator::builder(
            source.clone(),
            fake.clone(),
            connector,
        ))
        .build();
    (orch, source, eps)
}

#[tokio::test(start_paused = true)]
async fn an_endpoint_failing_n_times_in_a_row_is_ejected_then_tried_again() {
    let fake = Fake::new();
    fake.always(P1, CHAT, Reply::refuse());
    fake.always(P2, CHAT, prefill_answer());
    fake.always(D1, CHAT, Reply::sse().frame(ms(0), DONE));
    let (orch, source, eps) = with_health(&fake, &[P1, P2], VllmNixl::new(), |_| {});
    let health = source.health();
    let p1 = &eps[0];
    assert_eq!(p1.id().as_str(), P1);

    // Round robin: P1 fails, P2 serves, P1 fails again and is ejected; P2 serves all.
    let t0 = Instant::now();
    let mut failed = 0;
    for _ in 0..6 {
        match serve(&orch, chat(&orch)).await {
            Ok(resp) => drop(within(resp.into_body().collect()).await.unwrap()),
            Err(e) => {
                assert_error(&e, 502, "prefill_failed");
                failed += 1;
            }
        }
    }
    assert_eq!(
        (failed, fake.calls_to(P1).len(), fake.calls_to(P2).len()),
        (2, 2, 4)
    );
    assert_eq!(
        health.state(p1),
        Some(EndpointHealth::Ejected {
            until: t0 + Duration::from_secs(5)
        })
    );
    assert_eq!(source.snapshot().by_role(Role::Prefill).len(), 1);

    // After the ejection it is tried again (half open); failing, it is out for twice as
    // long.
    sleep(Duration::from_secs(5)).await;
    assert_eq!(health.state(p1), Some(EndpointHealth::HalfOpen));
    for _ in 0..2 {
        let _ = serve(&orch, chat(&orch)).await;
    }
    assert_eq!(fake.calls_to(P1).len(), 3);
    let until = t0 + Duration::from_secs(5 + 10);
    assert_eq!(health.state(p1), Some(EndpointHealth::Ejected { until }));
    assert_settled(&orch);
}

#[tokio::test(start_paused = true)]
async fn a_failed_prefill_is_served_decode_only_when_configured() {
    let decode_only = |c: &mut Setup| c.prefill_failure = PrefillFailure::DecodeOnly;

    // The prefill cannot be reached.
    let fake = Fake::new();
    fake.on(P1, CHAT, Reply::refuse());
    fake.on(D1, CHAT, Reply::sse().frame(ms(0), DONE));
    let orch = nixl(&fake, decode_only);
    let resp = serve(&orch, chat(&orch)).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(header(&resp, "x-disagg-handoff"), Some("decode-only"));
    assert_eq!(header(&resp, "x-disagg-fallback"), Some("prefill_failed"));
    let calls = fake.calls();
    let [p, d] = &calls[..] else {
        panic!("{calls:?}")
    };
    assert_eq!(d.text(), CLIENT, "the client's body, without a handoff");
    assert_ne!(d.id(), p.id(), "a new attempt, a new engine id");
    assert_eq!(orch.stats().prefill_fallbacks, 1);
    drop(resp);
    assert_settled(&orch);

    // No prefill endpoint at all.
    let fake = Fake::new();
    fake.on(D1, CHAT, Reply::sse().frame(ms(0), DONE));
    let orch = orchestrator(&fake, &[], VllmNixl::new(), decode_only);
    let resp = serve(&orch, chat(&orch)).await.unwrap();
    assert_eq!(
        header(&resp, "x-disagg-fallback"),
        Some("no_prefill_endpoint")
    );
    assert_eq!(fake.calls().len(), 1);

    // The default fails the request, and sends no decode leg.
    let fake = Fake::new();
    fake.on(P1, CHAT, Reply::refuse());
    let orch = nixl(&fake, |_| {});
    let e = serve(&orch, chat(&orch)).await.unwrap_err();
    assert_error(&e, 502, "prefill_failed");
    assert_eq!(fake.calls().len(), 1);
    assert_eq!(orch.stats().prefill_fallbacks, 0);
}

/// A connector that cannot carry any request: its `prepare` refuses it `Unsupported`
/// (as Mooncake's for `/generate`, LMCache's for n > 1).
#[derive(Debug)]
struct Refusing;

#[async_trait]
impl KvConnector for Refusing {
    fn name(&self) -> &'static str {
        "refusing"
    }

    fn prepare(&self, _: &Route, _: &PdRequest) -> Result<Handoff, ConnectorError> {
        Err(ConnectorError::Unsupported {
            connector: "refusing",
            what: "this request".into(),
        })
    }
}

/// The decode-only fallback is for a prefill side whose engine failed, not for a
/// request the connector refuses itself (the client's fault, a 400): that refusal
/// reaches the client as it is, and no decode leg is sent.
#[tokio::test(start_paused = true)]
async fn a_request_the_connector_refuses_is_not_served_decode_only() {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer());
    fake.on(D1, CHAT, Reply::sse().frame(ms(0), DONE));
    let orch = orchestrator(&fake, &[P1], Refusing, |c| {
        c.prefill_failure = PrefillFailure::DecodeOnly;
    });
    let e = serve(&orch, chat(&orch)).await.unwrap_err();
    assert_error(&e, 400, "unsupported_by_connector");
    assert!(fake.calls().is_empty(), "no leg sent: {:?}", fake.calls());
    assert_eq!(orch.stats().prefill_fallbacks, 0);
    assert_settled(&orch);
}

// === possible bugs: each test asserts what the documentation says ===

#[tokio::test(start_paused = true)]
async fn a_stream_cut_by_the_requests_deadline_does_not_count_against_the_decode() {
    // `Health::record` counts an engine's failures, and the orchestrator leaves the
    // request's own deadline out (`record_failure`); the response body does not.
    let fake = Fake::new();
    fake.always(P1, CHAT, prefill_answer());
    let mut long = Reply::sse();
    for i in 0..50 {
        long = long.frame(ms(150), event(i));
    }
    fake.always(D1, CHAT, long);
    let (orch, source, eps) = with_health(&fake, &[P1], VllmNixl::new(), |c| {
        c.deadline = Some(ms(1000))
    });
    for _ in 0..2 {
        let body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        let all = within(body.collect()).await.unwrap().to_bytes();
        assert!(
            std::str::from_utf8(&all)
                .unwrap()
                .contains("deadline_exceeded")
        );
    }
    assert_eq!(
        source.health().state(&eps[1]),
        Some(EndpointHealth::Healthy)
    );
}

#[tokio::test(start_paused = true)]
async fn a_concurrent_prefill_succeeding_after_the_decode_head_counts_for_its_health() {
    let fake = Fake::new();
    // A fails at the prefill (before the decode's head), B succeeds with the prefill
    // answering after the decode's head, C fails like A.
    fake.on(P1, CHAT, engine_error(500, "a"));
    fake.on(P1, CHAT, Reply::json(200, "{}").after(ms(20)));
    fake.on(P1, CHAT, engine_error(500, "c"));
    fake.always(D1, CHAT, Reply::sse().frame(ms(30), DONE));
    let connector = SglangBootstrap::with_rooms(Rooms::from_seed(7));
    let (orch, source, eps) = with_health(&fake, &[P1], connector, |_| {});
    assert_error(
        &serve(&orch, chat(&orch)).await.unwrap_err(),
        502,
        "prefill_failed",
    );
    let body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    let all = within(body.collect()).await.unwrap().to_bytes();
    assert_eq!(&all[..], DONE.as_bytes());
    assert!(fake.calls_to(P1)[1].finished(), "B's prefill succeeded");
    assert_error(
        &serve(&orch, chat(&orch)).await.unwrap_err(),
        502,
        "prefill_failed",
    );
    // Two failures, but not in a row.
    assert_eq!(
        source.health().state(&eps[0]),
        Some(EndpointHealth::Healthy)
    );
}

#[tokio::test(start_paused = true)]
async fn a_concurrent_prefills_4xx_after_the_decode_head_does_not_count_against_it() {
    // `Health::record`: a 4xx the client caused is a usable answer, as the orchestrator
    // records it when the prefill answers before the decode's head.
    let fake = Fake::new();
    fake.always(P1, CHAT, engine_error(400, "prompt too long").after(ms(20)));
    fake.always(D1, CHAT, Reply::sse().frame(ms(50), DONE));
    let connector = SglangBootstrap::with_rooms(Rooms::from_seed(7));
    let (orch, source, eps) = with_health(&fake, &[P1], connector, |_| {});
    for _ in 0..2 {
        let body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        let all = within(body.collect()).await.unwrap().to_bytes();
        let err = error_event(std::str::from_utf8(&all).unwrap());
        assert!(
            err["message"].as_str().unwrap().contains("prompt too long"),
            "{err}"
        );
    }
    assert_eq!(
        source.health().state(&eps[0]),
        Some(EndpointHealth::Healthy)
    );
}
