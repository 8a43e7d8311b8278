//! An engine's error answer whose body never ends: its message is read within the
//! step's budget, never for ever, and the client's answer ends with the leg's error.

use super::*;

/// What the test connector leads the client's stream with.
const LEAD: &str = "data: {\"lead\":true}\n\n";

/// vLLM NIXL's plan, leading the client's stream with [`LEAD`] as soon as the prefill
/// answered (as LMCache does with its first token): the decode's head is then awaited
/// inside the response body.
#[derive(Debug)]
struct Leading;

#[async_trait]
impl KvConnector for Leading {
    fn name(&self) -> &'static str {
        "leading"
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        let mut handoff = VllmNixl::new().prepare(route, req)?;
        handoff.lead = Some(Bytes::from_static(LEAD.as_bytes()));
        Ok(handoff)
    }

    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<HandoffFound, ConnectorError> {
        VllmNixl::new().complete(handoff, answer).await
    }
}

/// A lead stream's decode answering 500 with a body that never ends, no idle limit and
/// no deadline: the stream ends with `decode_failed` within the decode head timeout.
#[tokio::test(start_paused = true)]
async fn a_lead_streams_decode_error_whose_body_never_ends_fails_within_the_head_budget() {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer());
    fake.on(D1, CHAT, engine_error(500, "decode boom").stall());
    let orch = orchestrator(&fake, &[P1], Leading, |c| {
        c.decode_idle_timeout = None;
        c.decode_head_timeout = ms(300);
    });
    let t0 = Instant::now();
    let resp = serve(&orch, chat(&orch)).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK, "the lead went out first");
    let mut body = resp.into_body();
    assert_eq!(data(&mut body).await, LEAD);
    let err = error_event(&data(&mut body).await);
    assert_eq!(err["code"], "decode_failed", "{err}");
    assert!(next(&mut body).await.is_none());
    assert!(t0.elapsed() <= ms(300), "ended after {:?}", t0.elapsed());
    assert!(fake.calls_to(D1)[0].abandoned_at().is_some());
    drop(body);
    assert_settled(&orch);
}

/// A lead stream's decode refusing its leg (a 400: the client's request, such as a
/// prompt past its context) ends the stream with an error event typed as the request's
/// fault, as the engine's own answer would be, not as a server error; a 500 stays a
/// server error.
#[tokio::test(start_paused = true)]
async fn a_lead_streams_decode_refusal_ends_it_with_the_requests_error_type() {
    for (status, kind) in [
        (400, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "server_error"),
    ] {
        let fake = Fake::new();
        fake.on(P1, CHAT, prefill_answer());
        fake.on(D1, CHAT, engine_error(status, "no room"));
        let orch = orchestrator(&fake, &[P1], Leading, |_| {});
        let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        assert_eq!(data(&mut body).await, LEAD);
        let err = error_event(&data(&mut body).await);
        assert_eq!(
            (err["code"].as_str(), err["type"].as_str()),
            (Some("decode_failed"), Some(kind)),
            "{status}: {err}"
        );
        assert!(
            err["message"]
                .as_str()
                .is_some_and(|m| m.contains("no room")),
            "{err}"
        );
        assert!(next(&mut body).await.is_none());
        drop(body);
        assert_settled(&orch);
    }
}

/// vLLM NIXL over [`P1`] and `decodes`.
fn over_decodes(fake: &Fake, decodes: &[&str], config: impl FnOnce(&mut Setup)) -> Orchestrator {
    let mut c = Setup::default();
    config(&mut c);
    let source = StaticSource::new(endpoints(&[P1], decodes));
    c.apply(Orchestrator::builder(source, fake.clone(), VllmNixl::new()))
        .build()
}

/// The first chunk of a chat stream carrying token ids, then one token.
fn tracked_events() -> [String; 2] {
    [
        r#"data: {"id":"c-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"token_ids":[]}],"prompt_token_ids":[1,2,3]}"#.to_owned() + "\n\n",
        r#"data: {"id":"c-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"A"},"token_ids":[7]}]}"#.to_owned() + "\n\n",
    ]
}

/// A continuation (mid-stream migration, decode-only) answering 500 with a body that
/// never ends: the client's stream ends with the break within the decode head timeout
/// of the continuation being sent.
#[tokio::test(start_paused = true)]
async fn a_continuations_error_whose_body_never_ends_ends_the_stream_within_the_head_budget() {
    const D2: &str = "http://d2:8200";
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer());
    let [first, second] = tracked_events();
    fake.on(
        D1,
        CHAT,
        Reply::sse()
            .frame(ms(0), first)
            .frame(ms(0), second)
            .fail(ms(5), "reset"),
    );
    fake.on(
        D2,
        "/v1/completions",
        engine_error(500, "continuation boom").stall(),
    );
    let orch = over_decodes(&fake, &[D1, D2], |c| {
        c.decode_idle_timeout = None;
        c.decode_head_timeout = ms(300);
        c.migration.limit = 1;
        c.migration.decode_only = true;
    });
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    let mut frames = Vec::new();
    while let Some(frame) = next(&mut body).await {
        frames.push(frame);
    }
    let continuation = &fake.calls_to(D2)[0];
    assert!(
        continuation.at.elapsed() <= ms(300),
        "ended {:?} after the continuation was sent",
        continuation.at.elapsed()
    );
    assert!(
        frames
            .iter()
            .any(|f| f.as_ref().is_ok_and(|f| f.contains("\"error\""))),
        "the stream ends with its break: {frames:?}"
    );
    assert!(continuation.abandoned_at().is_some());
    drop(body);
    assert_settled(&orch);
}
