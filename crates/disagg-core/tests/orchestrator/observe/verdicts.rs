//! Verdicts that depend on how an answer went after its head: a decode's own refusal
//! (a 4xx, the client's fault) is told as one, never as a success; a concurrent prefill
//! that answered well while the decode streamed answered, whatever became of the decode
//! afterwards; and a lead stream's wait for the KV gate and the decode's head is not the
//! decode's idle time.

use super::*;

/// The one report told.
fn one(heard: &Heard, what: &str) -> Report {
    let reports = heard.reports();
    let [r] = &reports[..] else {
        panic!("{what}: one report: {reports:?}")
    };
    r.clone()
}

/// The decode refuses its leg with a 400 (the prompt too long for it), relayed to the
/// client whole: one leg after the other (vLLM NIXL), the decode served alone after a
/// prefill failure (decode-only fallback), and both legs at once (SGLang, the prefill
/// still running, dropped with the answer). The attempt is the decode's refusal, not a
/// success of the route (no answer was delivered) nor a failure (its engine worked:
/// its leg answered); the request stays a complete client error. (A relayed head is
/// the attempt's answer, never its failure: no retry is asked for, whatever the
/// policy, so none is set here.)
#[tokio::test(start_paused = true)]
async fn a_decodes_own_refusal_is_told_as_a_decode_refusal() {
    let cases = [
        ("sequential", LegOutcome::Answered),
        ("decode-only", LegOutcome::NotSent),
        ("concurrent", LegOutcome::Abandoned),
    ];
    for (what, prefill) in cases {
        let fake = Fake::new();
        match what {
            "decode-only" => fake.on(P1, CHAT, Reply::refuse()),
            "concurrent" => fake.on(P1, CHAT, Reply::json(200, "{}").after(ms(50))),
            _ => fake.on(P1, CHAT, prefill_answer()),
        };
        fake.on(D1, CHAT, engine_error(400, "prompt too long"));
        let config = |c: &mut Setup| {
            if what == "decode-only" {
                c.prefill_failure = PrefillFailure::DecodeOnly;
            }
        };
        let (orch, heard) = if what == "concurrent" {
            let connector = SglangBootstrap::with_rooms(Rooms::from_seed(7));
            self::heard(&fake, &[P1], connector, config)
        } else {
            self::heard(&fake, &[P1], VllmNixl::new(), config)
        };
        let resp = serve(&orch, chat(&orch)).await.unwrap();
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{what}: relayed");
        let all = within(resp.into_body().collect()).await.unwrap().to_bytes();
        let err: Value = serde_json::from_slice(&all).unwrap();
        assert_eq!(err["error"]["message"], "prompt too long", "{what}: whole");
        assert_settled(&orch);
        // The decode-only fallback is its request's second attempt (the first failed on
        // its prefill, reported as it failed).
        let reports = heard.reports();
        assert_eq!(
            reports.len(),
            1 + usize::from(what == "decode-only"),
            "{what}"
        );
        let r = reports.last().unwrap();
        assert_eq!(
            (r.outcome, r.prefill, r.decode),
            (Outcome::DecodeRefused, prefill, LegOutcome::Answered),
            "{what}"
        );
        let s = heard.summary();
        assert_eq!(
            (s.status, s.delivery, s.outcome, s.error),
            (
                StatusCode::BAD_REQUEST,
                Delivery::Complete,
                "client_error",
                None
            ),
            "{what}"
        );
    }
}

/// Both legs at once (SGLang): the prefill, still running at the decode's head, answers
/// well (after 20 ms) while the decode streams; then the decode's stream breaks, or goes
/// silent past its idle limit, or the client leaves. The prefill's engine worked: its
/// leg is answered whatever became of the decode afterwards (passive health counts it a
/// success). Were it dropped before it answered, it would stay abandoned.
#[tokio::test(start_paused = true)]
async fn a_riding_prefill_that_answered_stays_answered_when_the_decode_then_ends_badly() {
    for (what, answered) in [
        ("breaks", true),
        ("goes silent", true),
        ("client leaves", true),
        ("breaks before the prefill answered", false),
    ] {
        let fake = Fake::new();
        fake.on(P1, CHAT, Reply::json(200, r#"{"id":"p"}"#).after(ms(20)));
        let decode = Reply::sse().frame(ms(5), event(0));
        let decode = match what {
            "breaks" => decode.fail(ms(40), "connection reset"),
            "breaks before the prefill answered" => decode.fail(ms(5), "connection reset"),
            _ => decode.frame(ms(40), event(1)).stall(),
        };
        fake.on(D1, CHAT, decode);
        let connector = SglangBootstrap::with_rooms(Rooms::from_seed(7));
        let (orch, heard) = heard(&fake, &[P1], connector, |c| {
            c.decode_idle_timeout = Some(ms(100))
        });
        let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        assert_eq!(data(&mut body).await, event(0), "{what}");
        if what == "client leaves" {
            assert_eq!(data(&mut body).await, event(1), "{what}");
            drop(body);
        } else {
            let all = within(body.collect()).await.unwrap().to_bytes();
            let text = std::str::from_utf8(&all).unwrap();
            let last = text.rsplit("\n\n").find(|e| !e.trim().is_empty()).unwrap();
            let code = if what == "goes silent" {
                "decode_idle_timeout"
            } else {
                "decode_stream_failed"
            };
            assert_eq!(error_event(last)["code"], code, "{what}");
        }
        assert_eq!(
            fake.calls_to(P1)[0].finished(),
            answered,
            "{what}: the prefill answered"
        );
        let r = one(&heard, what);
        let (outcome, decode) = match what {
            "client leaves" => (Outcome::Cancelled, LegOutcome::Abandoned),
            _ => (Outcome::DecodeFailed, LegOutcome::Failed),
        };
        let prefill = if answered {
            LegOutcome::Answered
        } else {
            LegOutcome::Abandoned
        };
        assert_eq!(
            (r.outcome, r.prefill, r.decode),
            (outcome, prefill, decode),
            "{what}"
        );
        assert_settled(&orch);
    }
}

/// A lead stream's plan: vLLM NIXL's, with a lead (the client's stream starts with it
/// as soon as the prefill answered) and a KV gate that opens after `opens`, or never.
struct LeadGate {
    opens: Option<Duration>,
}

/// A gate that opens after a while, or never.
#[derive(Debug)]
struct OpensAfter(Option<Duration>);

#[async_trait]
impl KvGate for OpensAfter {
    async fn ready(&self) -> Result<(), ConnectorError> {
        match self.0 {
            Some(after) => {
                sleep(after).await;
                Ok(())
            }
            None => std::future::pending().await,
        }
    }
}

#[async_trait]
impl KvConnector for LeadGate {
    fn name(&self) -> &'static str {
        "nixl-lead-gate"
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        VllmNixl::new().prepare(route, req)
    }

    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<HandoffFound, ConnectorError> {
        let found = VllmNixl::new().complete(handoff, answer).await?;
        handoff.lead = Some(Bytes::from(event(0)));
        handoff.gate = Some(Arc::new(OpensAfter(self.opens)));
        Ok(found)
    }
}

/// A lead stream whose decode idle limit (100 ms) is shorter than what the proxy waits
/// for before the decode has anything to say: a KV gate that opens after 300 ms (within
/// the handoff's 1 s), or a decode head that comes 300 ms after the leg was sent. That
/// wait is the proxy's, each step within a budget of its own, not a silence of the
/// decode's stream: the answer streams whole, the decode's idle time counted from its
/// head (a decode silent for longer once its head came still ends the stream).
#[tokio::test(start_paused = true)]
async fn a_lead_streams_wait_for_the_gate_and_the_head_is_not_the_decodes_idle_time() {
    for (what, gate, head) in [("gate", 300, 0), ("head", 0, 300)] {
        let fake = Fake::new();
        fake.on(P1, CHAT, prefill_answer());
        let decode = Reply::sse()
            .after(ms(head))
            .frame(ms(50), event(1))
            .frame(ms(0), DONE);
        fake.on(D1, CHAT, decode);
        let connector = LeadGate {
            opens: Some(ms(gate)),
        };
        let (orch, heard) = heard(&fake, &[P1], connector, |c| {
            c.decode_idle_timeout = Some(ms(100));
            c.handoff_timeout = ms(1000);
        });
        let t0 = Instant::now();
        let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        assert_eq!(data(&mut body).await, event(0), "{what}: the lead");
        let rest = within(body.collect()).await.unwrap().to_bytes();
        assert_eq!(
            std::str::from_utf8(&rest).unwrap(),
            event(1) + DONE,
            "{what}"
        );
        assert_eq!(t0.elapsed(), ms(350), "{what}");
        let r = one(&heard, what);
        assert_eq!(
            (r.outcome, r.prefill, r.decode),
            (Outcome::Success, LegOutcome::Answered, LegOutcome::Answered),
            "{what}"
        );
        assert_settled(&orch);
    }

    // The control: once its head came, the decode's silence past 100 ms is its own.
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer());
    fake.on(D1, CHAT, Reply::sse().frame(ms(10), event(1)).stall());
    let connector = LeadGate {
        opens: Some(ms(300)),
    };
    let (orch, heard) = heard(&fake, &[P1], connector, |c| {
        c.decode_idle_timeout = Some(ms(100));
        c.handoff_timeout = ms(1000);
    });
    let t0 = Instant::now();
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    assert_eq!(data(&mut body).await, event(0), "the lead");
    assert_eq!(data(&mut body).await, event(1));
    assert_eq!(t0.elapsed(), ms(310));
    let err = error_event(&data(&mut body).await);
    assert_eq!(err["code"], "decode_idle_timeout");
    assert_eq!(
        t0.elapsed(),
        ms(410),
        "counted from the decode's last frame"
    );
    drop(body);
    let r = one(&heard, "silent decode");
    assert_eq!(
        (r.outcome, r.prefill, r.decode),
        (
            Outcome::DecodeFailed,
            LegOutcome::Answered,
            LegOutcome::Failed
        )
    );
    assert_settled(&orch);
}

/// A lead stream whose KV gate never opens, its decode idle limit (100 ms) shorter than
/// the handoff's budget (300 ms): the stream ends when the handoff's budget ran out,
/// with the handoff's error, and the decode, never sent, is not blamed (not sent); the
/// prefill is told as a gate that never ended tells it, its handoff's own time run out.
/// The same with mid-stream migration on: the handoff's failure is no break of a decode
/// stream.
#[tokio::test(start_paused = true)]
async fn a_lead_streams_gate_that_never_opens_is_the_handoffs_failure_not_the_decodes() {
    for limit in [0, 1] {
        let what = format!("migration limit {limit}");
        let fake = Fake::new();
        fake.on(P1, CHAT, prefill_answer());
        let (orch, heard) = heard(&fake, &[P1], LeadGate { opens: None }, |c| {
            c.decode_idle_timeout = Some(ms(100));
            c.handoff_timeout = ms(300);
            c.migration.limit = limit;
        });
        let t0 = Instant::now();
        let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        assert_eq!(data(&mut body).await, event(0), "{what}: the lead");
        let err = error_event(&data(&mut body).await);
        assert_eq!(err["code"], "handoff_timeout", "{what}: {err}");
        assert_eq!(t0.elapsed(), ms(300), "{what}");
        assert!(next(&mut body).await.is_none());
        assert!(
            fake.calls_to(D1).is_empty(),
            "{what}: no decode leg was sent"
        );
        let r = one(&heard, &what);
        assert_eq!(r.timeline.decode_sent, None, "{what}");
        assert_eq!(
            (r.outcome, r.prefill, r.decode),
            (
                Outcome::PrefillFailed,
                LegOutcome::Failed,
                LegOutcome::NotSent
            ),
            "{what}"
        );
        let s = heard.summary();
        assert_eq!(
            (s.delivery, s.error),
            (Delivery::Broken, Some("handoff_timeout")),
            "{what}"
        );
        assert_settled(&orch);
    }
}

/// A lead stream whose decode refuses its leg with a 400 once the gate opened: the
/// client's stream, begun with the lead, ends with the decode's error; the attempt is
/// the decode's refusal (its leg answered: its engine worked), as when the refusal is
/// relayed whole, and the request's stream broke. The same with mid-stream migration
/// on: the refusal of the decode's head is no break of its stream.
#[tokio::test(start_paused = true)]
async fn a_lead_streams_decode_refusal_is_told_as_a_decode_refusal() {
    for limit in [0, 1] {
        let what = format!("migration limit {limit}");
        let fake = Fake::new();
        fake.on(P1, CHAT, prefill_answer());
        fake.on(D1, CHAT, engine_error(400, "prompt too long"));
        let connector = LeadGate {
            opens: Some(ms(10)),
        };
        let (orch, heard) = heard(&fake, &[P1], connector, |c| c.migration.limit = limit);
        let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        assert_eq!(data(&mut body).await, event(0), "{what}: the lead");
        let err = error_event(&data(&mut body).await);
        assert!(
            err["message"].as_str().unwrap().contains("prompt too long"),
            "{what}: {err}"
        );
        assert!(next(&mut body).await.is_none());
        let r = one(&heard, &what);
        assert_eq!(
            (r.outcome, r.prefill, r.decode),
            (
                Outcome::DecodeRefused,
                LegOutcome::Answered,
                LegOutcome::Answered
            ),
            "{what}"
        );
        let s = heard.summary();
        assert_eq!(
            (s.status, s.delivery),
            (StatusCode::OK, Delivery::Broken),
            "{what}"
        );
        assert_settled(&orch);
    }
}

/// A lead stream whose decode refuses its leg with a 400 whose error body comes 300 ms
/// after its head: longer than the decode idle limit (100 ms), within what is left of
/// the head's budget. The body is the refusal's message, read within that budget, not
/// a decode stream gone silent: the client's stream ends with the engine's message
/// once it came, and the attempt is the decode's refusal.
#[tokio::test(start_paused = true)]
async fn a_lead_streams_decode_refusal_with_a_slow_message_is_not_a_silent_decode() {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer());
    let message = json!({"error": {"message": "prompt too long", "type": "Error", "code": 400}});
    let refusal = Reply::sse().status(400).frame(ms(300), message.to_string());
    fake.on(D1, CHAT, refusal);
    let connector = LeadGate {
        opens: Some(ms(10)),
    };
    let (orch, heard) = heard(&fake, &[P1], connector, |c| {
        c.decode_idle_timeout = Some(ms(100));
        c.decode_head_timeout = ms(1000);
    });
    let t0 = Instant::now();
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    assert_eq!(data(&mut body).await, event(0), "the lead");
    let err = error_event(&data(&mut body).await);
    assert!(
        err["message"].as_str().unwrap().contains("prompt too long"),
        "the engine's message: {err}"
    );
    assert_eq!(t0.elapsed(), ms(310), "once the message came");
    assert!(next(&mut body).await.is_none());
    let r = one(&heard, "slow message");
    assert_eq!(
        (r.outcome, r.prefill, r.decode),
        (
            Outcome::DecodeRefused,
            LegOutcome::Answered,
            LegOutcome::Answered
        )
    );
    let s = heard.summary();
    assert_eq!(s.delivery, Delivery::Broken);
    assert_settled(&orch);
}

/// The decode answers 200 and then, in its stream, an error event of its own (vLLM's
/// failed KV load on a streamed chat: role chunk, error event, `[DONE]`), its payload's
/// start cut between two frames. The stream reaches the client byte for byte, and the
/// attempt is no success: the decode's failure for a 5xx code (passive health counts it
/// against the engine), its refusal for a 4xx one or none (its leg answered); the
/// request's delivery is broken, with the error `decode_error_event`. A chunk whose text
/// only spells such an event (escaped in its string) is an answer like any other.
#[tokio::test(start_paused = true)]
async fn an_error_event_in_the_decodes_stream_ends_the_attempt_as_its_code_says() {
    let error = |code: &str| {
        format!(
            "data: {{\"error\": {{\"object\": \"error\", \"message\": \"Internal server error\", \"type\": \"InternalServerError\", \"param\": null, \"code\": {code}}}}}\n\n"
        )
    };
    let spelled =
        r#"data: {"choices":[{"index":0,"delta":{"content":"{\"error\": {\"code\": 500}}"}}]}"#
            .to_owned()
            + "\n\n";
    let cases = [
        (
            "500",
            Some(error("500")),
            (Outcome::DecodeFailed, LegOutcome::Failed),
        ),
        (
            "400",
            Some(error("400")),
            (Outcome::DecodeRefused, LegOutcome::Answered),
        ),
        (
            "no code",
            Some("data: {\"error\": {\"message\": \"bad input\"}}\n\n".to_owned()),
            (Outcome::DecodeRefused, LegOutcome::Answered),
        ),
        ("text", None, (Outcome::Success, LegOutcome::Answered)),
    ];
    for (what, sent, (outcome, decode)) in cases {
        let fake = Fake::new();
        fake.on(P1, CHAT, prefill_answer());
        let middle = sent.clone().unwrap_or_else(|| spelled.clone());
        let (a, b) = middle.split_at(9);
        let stream = Reply::sse()
            .frame(ms(5), event(0))
            .frame(ms(5), a.to_owned())
            .frame(ms(5), b.to_owned())
            .frame(ms(5), "data: [DONE]\n\n");
        fake.on(D1, CHAT, stream);
        let (orch, heard) = heard(&fake, &[P1], VllmNixl::new(), |_| {});
        let resp = serve(&orch, chat(&orch)).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "{what}");
        let all = within(resp.into_body().collect()).await.unwrap().to_bytes();
        assert_eq!(
            std::str::from_utf8(&all).unwrap(),
            event(0) + &middle + "data: [DONE]\n\n",
            "{what}: relayed as it came"
        );
        assert_settled(&orch);
        let r = one(&heard, what);
        assert_eq!(
            (r.outcome, r.prefill, r.decode),
            (outcome, LegOutcome::Answered, decode),
            "{what}"
        );
        // A 5xx event from a decode handed KV may be its lost KV load.
        assert_eq!(r.kv_load_suspect, what == "500", "{what}");
        let s = heard.summary();
        let (delivery, error) = match sent {
            Some(_) => (Delivery::Broken, Some("decode_error_event")),
            None => (Delivery::Complete, None),
        };
        assert_eq!(
            (s.status, s.delivery, s.error),
            (StatusCode::OK, delivery, error),
            "{what}"
        );
    }
}

/// A streamed completions request whose decode answers 200 and then ends its stream
/// with no choice's finish reason (vLLM 0.33's completions stream whose KV load failed:
/// the usage chunk, `[DONE]`, no chunk of the answer): relayed byte for byte, and the
/// decode's failure (its non-streamed answer would be a 500), the request's delivery
/// broken with the error `decode_unfinished`. A stream whose last chunk sets a finish
/// reason is a success, and a chat stream is not held to it (its failure is an error
/// event).
#[tokio::test(start_paused = true)]
async fn a_completions_stream_ending_without_a_finish_reason_is_the_decodes_failure() {
    let chunk = |finish: &str| {
        format!(
            r#"data: {{"id":"cmpl-1","object":"text_completion","choices":[{{"index":0,"text":"a","finish_reason":{finish}}}]}}"#
        ) + "\n\n"
    };
    let usage = r#"data: {"id":"cmpl-1","object":"text_completion","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":0}}"#.to_owned() + "\n\n";
    let cases = [
        ("usage only", Api::Completions, vec![usage.clone()], false),
        ("null only", Api::Completions, vec![chunk("null")], false),
        (
            "served",
            Api::Completions,
            vec![chunk("null"), chunk("\"length\""), usage.clone()],
            true,
        ),
        ("chat", Api::Chat, vec![usage.clone()], true),
    ];
    for (what, api, frames, served) in cases {
        let fake = Fake::new();
        let path = api.path();
        fake.on(P1, path, prefill_answer());
        let mut stream = Reply::sse();
        for frame in &frames {
            // The key cut between two frames.
            let (a, b) = frame.split_at(frame.len().min(80));
            stream = stream.frame(ms(5), a.to_owned()).frame(ms(5), b.to_owned());
        }
        fake.on(D1, path, stream.frame(ms(5), DONE));
        let (orch, heard) = heard(&fake, &[P1], VllmNixl::new(), |_| {});
        let body = r#"{"model":"m","prompt":"hi","max_tokens":4,"stream":true}"#;
        let req = orch
            .request(api, HeaderMap::new(), &Bytes::from_static(body.as_bytes()))
            .unwrap();
        let resp = serve(&orch, req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "{what}");
        let all = within(resp.into_body().collect()).await.unwrap().to_bytes();
        assert_eq!(
            std::str::from_utf8(&all).unwrap(),
            frames.concat() + DONE,
            "{what}: relayed as it came"
        );
        assert_settled(&orch);
        let r = one(&heard, what);
        let (outcome, decode, delivery, error) = if served {
            (
                Outcome::Success,
                LegOutcome::Answered,
                Delivery::Complete,
                None,
            )
        } else {
            (
                Outcome::DecodeFailed,
                LegOutcome::Failed,
                Delivery::Broken,
                Some("decode_unfinished"),
            )
        };
        assert_eq!(
            (r.outcome, r.prefill, r.decode),
            (outcome, LegOutcome::Answered, decode),
            "{what}"
        );
        assert_eq!(r.kv_load_suspect, !served, "{what}");
        let s = heard.summary();
        assert_eq!((s.delivery, s.error), (delivery, error), "{what}");
    }
}

/// Whether a decode's failure may be a lost KV load ([`Report::kv_load_suspect`]): its
/// 5xx head after a handoff of the prefill's KV is (vLLM answers a load it could not
/// make so); the same 5xx with no KV handed (a decode-only fallback), a decode that
/// could not be reached, one out of its head's time, and a stream that broke off are
/// not.
#[tokio::test(start_paused = true)]
async fn only_a_decode_answering_as_a_lost_kv_load_is_suspect() {
    let cases = [
        ("500 head, KV handed", true),
        ("500 head, decode-only", false),
        ("unreachable", false),
        ("head timeout", false),
        ("broken stream", false),
    ];
    for (what, suspect) in cases {
        let fake = Fake::new();
        if what.ends_with("decode-only") {
            fake.on(P1, CHAT, engine_error(503, "busy"));
        } else {
            fake.on(P1, CHAT, prefill_answer());
        }
        let decode = match what {
            "unreachable" => Reply::refuse(),
            "head timeout" => Reply::hang(),
            "broken stream" => Reply::sse().frame(ms(5), event(0)).fail(ms(5), "reset"),
            _ => engine_error(500, "KV transfer failed"),
        };
        fake.on(D1, CHAT, decode);
        let config = |c: &mut Setup| {
            c.prefill_failure = PrefillFailure::DecodeOnly;
            c.decode_head_timeout = ms(300);
        };
        let (orch, heard) = heard(&fake, &[P1], VllmNixl::new(), config);
        if let Ok(resp) = serve(&orch, chat(&orch)).await {
            let _ = within(resp.into_body().collect()).await;
        }
        assert_settled(&orch);
        let reports = heard.reports();
        let failed: Vec<&Report> = reports
            .iter()
            .filter(|r| r.decode == LegOutcome::Failed)
            .collect();
        let [r] = &failed[..] else {
            panic!("{what}: one failed decode leg: {reports:?}")
        };
        assert_eq!(r.kv_load_suspect, suspect, "{what}: {r:?}");
    }
}
