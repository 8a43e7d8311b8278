//! A tracked stream the proxy begins before its decode leg is sent (a plan's lead that
//! carries the prompt's ids, as a third-party connector's may): a decode that fails
//! after the lead is a broken decode stream, continued on another decode; the proxy's
//! own failure before the decode's body (the KV gate), or a decode's refusal, is not,
//! and a continuation's own gate failure is its fresh prefill's, not the attempt's
//! first prefill's.

use disagg_core::connector::KvGate;

use super::*;

/// A KV gate that opens at once, or never.
#[derive(Debug)]
struct Gate {
    opens: bool,
}

#[async_trait]
impl KvGate for Gate {
    async fn ready(&self) -> Result<(), ConnectorError> {
        if self.opens {
            Ok(())
        } else {
            std::future::pending().await
        }
    }
}

/// The plan's request was a continuation's (`/v1/completions`), not the client's.
#[derive(Clone, Copy)]
struct Continues(bool);

/// vLLM NIXL's plan with a lead and a KV gate: the client's stream starts with the
/// first chunk of [`first_leg`] (carrying the prompt's ids: the stream is tracked), a
/// continuation's with its first token ("B", id 8). The gate opens or not as `first`
/// (the client's request) and `continuation` say.
struct TrackedLead {
    first: bool,
    continuation: bool,
}

#[async_trait]
impl KvConnector for TrackedLead {
    fn name(&self) -> &'static str {
        "nixl-tracked-lead"
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        let mut handoff = VllmNixl::new().prepare(route, req)?;
        handoff.ext.insert(Continues(req.api() == Api::Completions));
        Ok(handoff)
    }

    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<HandoffFound, ConnectorError> {
        let found = VllmNixl::new().complete(handoff, answer).await?;
        let continues = handoff.ext.get::<Continues>().is_some_and(|c| c.0);
        let (lead, opens) = if continues {
            (continued("B", 8, None), self.continuation)
        } else {
            let [first, _] = first_leg();
            (first, self.first)
        };
        handoff.lead = Some(Bytes::from(lead));
        handoff.gate = Some(Arc::new(Gate { opens }));
        Ok(found)
    }
}

/// [`TrackedLead`] over [`P1`] and [`D1`], [`D2`], [`D3`] with `config`, telling
/// `reports`.
fn leading(
    fake: &Fake,
    connector: TrackedLead,
    config: OrchestratorConfig,
    reports: &Reports,
) -> Orchestrator {
    over(fake, &[P1], &[D1, D2, D3], connector, config)
        .listener(reports.clone())
        .build()
}

/// One continuation allowed, decode-only or through a fresh prefill: the decode leg
/// sent after the tracked lead fails (it answers 503, its connection is refused, or its
/// head never comes within the 100 ms head budget). The decode's failure after the
/// lead is a broken decode stream: the stream goes on on D2 (after the continuation's
/// own lead, through a fresh prefill), D1 is told failed, and the attempt, finished
/// on D2, succeeded.
#[tokio::test(start_paused = true)]
async fn a_decode_failing_after_a_tracked_lead_is_continued_on_another_decode() {
    for decode_only in [true, false] {
        for (how, reply) in [
            ("503", engine_error(503, "overloaded")),
            ("refused", Reply::refuse()),
            ("no head", Reply::hang()),
        ] {
            let what = format!("{how}, decode-only: {decode_only}");
            let fake = Fake::new();
            let reports = Reports::default();
            fake.on(P1, CHAT, prefill_answer()).on(D1, CHAT, reply);
            if decode_only {
                fake.on(D2, COMPLETIONS, to_the_end("B", 8));
            } else {
                fake.on(P1, COMPLETIONS, prefill_answer());
                fake.on(D2, COMPLETIONS, to_the_end("C", 9));
            }
            let mut config = continuing(1, decode_only);
            config.decode_head_timeout = ms(100);
            let connector = TrackedLead {
                first: true,
                continuation: true,
            };
            let orch = leading(&fake, connector, config, &reports);
            let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
            let text = read_to_end(&mut body).await;
            assert!(
                text.contains("\"B\"") && text.ends_with(DONE),
                "{what}: {text}"
            );
            if !decode_only {
                assert!(text.contains("\"C\""), "{what}: {text}");
            }
            assert!(!text.contains("error"), "{what}: {text}");
            assert_eq!(fake.calls_to(D2).len(), 1, "{what}: continued on D2");
            let all = reports.all();
            assert!(
                all.iter().any(|r| blamed(r, D1)),
                "{what}: D1 is told failed: {all:?}"
            );
            assert!(
                !all.iter().any(|r| blamed(r, P1) || blamed(r, D2)),
                "{what}: {all:?}"
            );
            let attempt = all.last().expect("the attempt's report");
            assert_eq!(
                (
                    attempt.attempt,
                    attempt.route.decode.id().as_str(),
                    attempt.outcome
                ),
                (0, D2, Outcome::Success),
                "{what}: {all:?}"
            );
            if !decode_only {
                // The continuation's fresh prefill is told answered once its gate
                // opened.
                let fresh: Vec<&Report> = all.iter().filter(|r| fresh_leg(r, D2)).collect();
                let [fresh] = &fresh[..] else {
                    panic!("{what}: the fresh prefill told once: {all:?}")
                };
                assert_eq!(
                    (fresh.outcome, fresh.prefill),
                    (Outcome::Success, LegOutcome::Answered),
                    "{what}"
                );
            }
            drop(body);
            assert_settled(&orch);
        }
    }
}

/// One continuation allowed: on a tracked lead's first leg, the proxy's own KV gate
/// that never opens (a 300 ms handoff budget) and the decode's refusal (a 400) each end
/// the client's stream with their own error: no decode stream broke, so none is
/// continued (D2 gets nothing) and no decode is blamed. The gate's failure is the
/// handoff's (the prefill's side, the decode never sent); the refusal the decode's.
#[tokio::test(start_paused = true)]
async fn a_tracked_leads_gate_failure_or_decode_refusal_is_not_continued() {
    for case in ["gate", "refusal"] {
        let fake = Fake::new();
        let reports = Reports::default();
        fake.on(P1, CHAT, prefill_answer());
        if case == "refusal" {
            fake.on(D1, CHAT, engine_error(400, "prompt too long"));
        }
        let mut config = continuing(1, false);
        config.handoff_timeout = ms(300);
        let connector = TrackedLead {
            first: case == "refusal",
            continuation: true,
        };
        let orch = leading(&fake, connector, config, &reports);
        let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        let first = data(&mut body).await;
        assert!(
            first.contains("\"id\":\"c-1\""),
            "{case}: the lead: {first}"
        );
        let err = error_event(&data(&mut body).await);
        assert!(next(&mut body).await.is_none(), "{case}");
        let all = reports.all();
        let [r] = &all[..] else {
            panic!("{case}: one report: {all:?}")
        };
        if case == "gate" {
            assert_eq!(err["code"], "handoff_timeout", "{case}: {err}");
            assert!(fake.calls_to(D1).is_empty(), "{case}: no decode leg");
            assert_eq!(
                (r.outcome, r.prefill, r.decode),
                (
                    Outcome::PrefillFailed,
                    LegOutcome::Failed,
                    LegOutcome::NotSent
                ),
                "{case}"
            );
        } else {
            let message = err["message"].as_str().unwrap();
            assert!(message.contains("prompt too long"), "{case}: {err}");
            assert_eq!(fake.calls_to(D1).len(), 1, "{case}");
            assert_eq!(
                (r.outcome, r.prefill, r.decode),
                (
                    Outcome::DecodeRefused,
                    LegOutcome::Answered,
                    LegOutcome::Answered
                ),
                "{case}"
            );
        }
        assert_eq!(r.route.decode.id().as_str(), D1, "{case}");
        assert!(fake.calls_to(D2).is_empty(), "{case}: not continued");
        drop(body);
        assert_settled(&orch);
    }
}

/// One continuation allowed: the tracked stream breaks on D1 after a token, and its
/// continuation's fresh prefill (P1) answers, but the continuation's KV gate never
/// opens (a 300 ms handoff budget). The gate's failure is the fresh prefill's: its own
/// leg's report tells it failed (its handoff out of its budget), the decode it was for
/// (D2) is never sent nor blamed, and the attempt's report (naming D2, the decode the
/// stream moved to) tells the request's stream broke without blaming the attempt's
/// first prefill leg, which answered. The client's stream ends with the gate's error.
#[tokio::test(start_paused = true)]
async fn a_continuations_gate_failure_is_its_fresh_prefills_not_the_attempts() {
    let fake = Fake::new();
    let reports = Reports::default();
    let [_, token] = first_leg();
    fake.on(P1, CHAT, prefill_answer())
        .on(
            D1,
            CHAT,
            Reply::sse().frame(ms(0), token).fail(ms(5), "reset"),
        )
        .on(P1, COMPLETIONS, prefill_answer());
    let mut config = continuing(1, false);
    config.handoff_timeout = ms(300);
    let connector = TrackedLead {
        first: true,
        continuation: false,
    };
    let orch = leading(&fake, connector, config, &reports);
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    until(&mut body, "\"A\"").await;
    let mut rest = String::new();
    while let Some(frame) = next(&mut body).await {
        rest.push_str(&frame.unwrap());
    }
    let last = rest.rsplit("\n\n").find(|e| !e.trim().is_empty()).unwrap();
    assert_eq!(error_event(last)["code"], "handoff_timeout", "{rest}");
    drop(body);
    assert_eq!(fake.calls_to(P1).len(), 2, "the fresh prefill");
    assert!(fake.calls_to(D2).is_empty(), "the gate never opened");
    let all = reports.all();
    assert!(
        !all.iter().any(|r| blamed(r, D2)),
        "D2 is not to blame: {all:?}"
    );
    let fresh: Vec<&Report> = all.iter().filter(|r| fresh_leg(r, D2)).collect();
    let [fresh] = &fresh[..] else {
        panic!("the fresh prefill told once: {all:?}")
    };
    assert_eq!(
        (
            fresh.route.prefill.as_ref().map(|p| p.id().as_str()),
            fresh.outcome,
            fresh.prefill
        ),
        (Some(P1), Outcome::PrefillFailed, LegOutcome::Failed),
        "its handoff ran out of its budget: {all:?}"
    );
    let attempt = all.last().expect("the attempt's report");
    assert_eq!(
        (
            attempt.attempt,
            attempt.route.decode.id().as_str(),
            attempt.outcome,
            attempt.prefill,
            attempt.decode
        ),
        (
            0,
            D2,
            Outcome::DecodeFailed,
            LegOutcome::Answered,
            LegOutcome::Abandoned
        ),
        "{all:?}"
    );
    assert_settled(&orch);
}

/// The tracked stream breaks on D1 after a token, and its continuation through a fresh
/// prefill (P1, whose gate opens) is refused by its decode (D2: a 400, after the
/// continuation's lead went out). The refusal is the request's, not D2's engine's: no
/// report blames D2. With a second continuation allowed, the next decode (D3) is
/// tried, as when a continuation's decode refuses it before its stream began, and
/// finishes the answer; with one, the client's stream ends with D2's message, and the
/// attempt's report (naming D2) is D2's refusal.
#[tokio::test(start_paused = true)]
async fn a_continuations_decode_refusing_it_after_its_lead_is_not_blamed() {
    for limit in [1, 2] {
        let what = format!("migration limit {limit}");
        let fake = Fake::new();
        let reports = Reports::default();
        let [_, token] = first_leg();
        fake.on(P1, CHAT, prefill_answer())
            .on(
                D1,
                CHAT,
                Reply::sse().frame(ms(0), token).fail(ms(5), "reset"),
            )
            .on(P1, COMPLETIONS, prefill_answer())
            .on(D2, COMPLETIONS, engine_error(400, "prompt too long"))
            .on(P1, COMPLETIONS, prefill_answer())
            .on(D3, COMPLETIONS, to_the_end("C", 9));
        let connector = TrackedLead {
            first: true,
            continuation: true,
        };
        let orch = leading(&fake, connector, continuing(limit, false), &reports);
        let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        let text = read_to_end(&mut body).await;
        drop(body);
        assert_eq!(fake.calls_to(D2).len(), 1, "{what}: the first continuation");
        let all = reports.all();
        assert!(
            !all.iter().any(|r| blamed(r, D2)),
            "{what}: D2 is not to blame: {all:?}"
        );
        let attempt = all.last().expect("the attempt's report");
        if limit == 2 {
            assert!(
                text.contains("\"C\"") && text.ends_with(DONE),
                "{what}: {text}"
            );
            assert_eq!(fake.calls_to(D3).len(), 1, "{what}: the next decode");
            assert_eq!(
                (attempt.route.decode.id().as_str(), attempt.outcome),
                (D3, Outcome::Success),
                "{what}: {all:?}"
            );
        } else {
            let last = text.rsplit("\n\n").find(|e| !e.trim().is_empty()).unwrap();
            let err = error_event(last);
            let message = err["message"].as_str().unwrap();
            assert!(message.contains("prompt too long"), "{what}: {err}");
            assert!(fake.calls_to(D3).is_empty(), "{what}");
            assert_eq!(
                (
                    attempt.route.decode.id().as_str(),
                    attempt.outcome,
                    attempt.prefill,
                    attempt.decode
                ),
                (
                    D2,
                    Outcome::DecodeRefused,
                    LegOutcome::Answered,
                    LegOutcome::Answered
                ),
                "{what}: {all:?}"
            );
        }
        assert_settled(&orch);
    }
}
