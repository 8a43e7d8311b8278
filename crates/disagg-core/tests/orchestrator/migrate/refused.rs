//! A decode's error event read by the same classifier with migration on as off: one
//! naming a 5xx is its engine's failure (the stream continues on another decode), one
//! naming a 4xx or no status its refusal of the request, which another decode would
//! refuse too: relayed as the engine wrote it, not continued, no engine blamed.

use disagg_core::outcome::Delivery;

use super::traced::{Told, dead, naming, traced};
use super::*;

/// A refusal's error event with the code `code` (`None`: none, its type vLLM's name for
/// a 400).
fn error_event(code: Option<u16>) -> String {
    let code = code.map_or(String::new(), |c| format!(", \"code\": {c}"));
    format!(
        "data: {{\"error\": {{\"message\": \"bad request\", \"type\": \"BadRequestError\"{code}}}}}\n\n"
    )
}

/// A refusal with no `type` either: nothing names a status.
const BARE: &str = "data: {\"error\": {\"message\": \"too long\"}}\n\n";

/// The first leg streams its first chunks, then the decode's own error event (cut in
/// two frames inside its payload), then `[DONE]`: with migration on, the event and
/// `[DONE]` reach the client as they came, no continuation is tried (no second decode,
/// no fresh prefill), and the attempt is the decode's refusal (its leg answered), the
/// request's stream broken with the error `decode_error_event`.
#[tokio::test(start_paused = true)]
async fn a_first_legs_refusal_event_is_relayed_not_continued() {
    for (what, refusal) in [
        ("400", error_event(Some(400))),
        ("type only", error_event(None)),
        ("no status", BARE.to_owned()),
    ] {
        for decode_only in [true, false] {
            let what = format!("{what}, decode-only: {decode_only}");
            let fake = Fake::new();
            let told = Told::default();
            let [first, second] = first_leg();
            let (a, b) = refusal.split_at(12);
            let reply = Reply::sse()
                .frame(ms(0), first.clone())
                .frame(ms(0), second.clone())
                .frame(ms(0), a.to_owned())
                .frame(ms(0), b.to_owned())
                .frame(ms(0), DONE);
            fake.on(P1, CHAT, prefill_answer()).on(D1, CHAT, reply);
            let orch = traced(&fake, decode_only, &told);
            let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
            let text = read_to_end(&mut body).await;
            assert!(text.ends_with(&(refusal.clone() + DONE)), "{what}: {text}");
            assert!(text.contains("\"A\""), "{what}: the answer so far: {text}");
            assert!(fake.calls_to(D2).is_empty(), "{what}: not continued");
            assert!(
                fake.calls_to(P1).iter().all(|c| c.uri.path() == CHAT),
                "{what}: no fresh prefill"
            );
            told_refused(&told, D1, 0, &what);
            assert_settled(&orch);
        }
    }
}

/// The same event naming a 5xx is the decode's failure: the stream goes on, on another
/// decode, and the dead decode is told failed (the classifier's other side, so that the
/// test above fails for the status and not for the stream's shape).
#[tokio::test(start_paused = true)]
async fn a_first_legs_failure_event_is_continued() {
    let fake = Fake::new();
    let told = Told::default();
    let [first, second] = first_leg();
    let reply = Reply::sse()
        .frame(ms(0), first)
        .frame(ms(0), second)
        .frame(ms(0), error_event(Some(500)))
        .frame(ms(0), DONE);
    fake.on(P1, CHAT, prefill_answer())
        .on(D1, CHAT, reply)
        .on(D2, COMPLETIONS, to_the_end("B", 8));
    let orch = traced(&fake, true, &told);
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    let text = read_to_end(&mut body).await;
    assert!(!text.contains("error"), "{text}");
    assert!(text.contains("\"B\"") && text.ends_with(DONE), "{text}");
    let all = told.reports();
    assert_eq!(dead(&all, D1).outcome, Outcome::DecodeFailed);
    let summary = told.summary();
    assert_eq!(
        (summary.delivery, summary.error, summary.migrations),
        (Delivery::Complete, None, 1)
    );
    assert_settled(&orch);
}

/// A continuation whose decode refuses in its stream (a 4xx event) after its first
/// chunk: the refusal goes out as the engine wrote it, the stream is not continued
/// again (a limit of one more would allow it), the decode that broke first is told
/// failed once and the continuation's decode its refusal, not its failure.
#[tokio::test(start_paused = true)]
async fn a_continuations_refusal_event_is_relayed_not_continued_again() {
    for decode_only in [true, false] {
        let what = format!("decode-only: {decode_only}");
        let fake = Fake::new();
        let told = Told::default();
        let refusal = error_event(Some(422));
        let rest = Reply::sse()
            .frame(ms(0), continued("B", 8, None))
            .frame(ms(0), refusal.clone())
            .frame(ms(0), DONE);
        continued_once(&fake, prefill_answer(), rest).on(D3, COMPLETIONS, to_the_end("C", 9));
        let mut config = continuing(2, decode_only);
        config.trace_ratio = Some(1.0);
        let orch = over(&fake, &[P1], &[D1, D2, D3], VllmNixl::new(), config)
            .listener(told.clone())
            .build();
        let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        let text = read_to_end(&mut body).await;
        assert!(text.ends_with(&(refusal.clone() + DONE)), "{what}: {text}");
        assert!(fake.calls_to(D3).is_empty(), "{what}: not continued again");
        dead(&told.reports(), D1);
        told_refused(&told, D2, 1, &what);
        assert_settled(&orch);
    }
}

/// What `told` heard of a request whose stream ended in the refusal of the decode
/// `decode` after `migrations` continuations: that decode in one report of its leg (a
/// fresh prefill's leg report names it unsent), its refusal (its leg answered: no
/// engine blamed), and the request's stream broken with `decode_error_event`.
fn told_refused(told: &Told, decode: &str, migrations: u32, what: &str) {
    let all = told.reports();
    let on_it: Vec<&Report> = naming(&all, decode)
        .into_iter()
        .filter(|r| r.decode != LegOutcome::NotSent)
        .collect();
    let [report] = &on_it[..] else {
        panic!("{what}: {decode} in one report: {all:?}")
    };
    assert_eq!(
        (report.outcome, report.decode),
        (Outcome::DecodeRefused, LegOutcome::Answered),
        "{what}: a refusal blames no engine"
    );
    let summary = told.summary();
    assert_eq!(
        (summary.delivery, summary.error, summary.migrations),
        (Delivery::Broken, Some("decode_error_event"), migrations),
        "{what}"
    );
}
