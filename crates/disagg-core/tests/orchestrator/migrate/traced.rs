//! A traced request's migration: every report it makes is in the request's trace, and
//! names leg spans of its own (never the migration's span, nor the attempt's legs'),
//! so that no two spans built from them share an id.

use disagg_core::outcome::{Summary, TraceIds};

use super::*;

/// Every report and the request's summary, kept.
#[derive(Clone, Default)]
pub(super) struct Told {
    reports: Arc<Mutex<Vec<Report>>>,
    summaries: Arc<Mutex<Vec<Summary>>>,
}

impl Listener for Told {
    fn on_report(&self, report: &Report) {
        self.reports.lock().unwrap().push(report.clone());
    }

    fn on_request(&self, summary: &Summary) {
        self.summaries.lock().unwrap().push(summary.clone());
    }
}

impl Told {
    pub(super) fn reports(&self) -> Vec<Report> {
        self.reports.lock().unwrap().clone()
    }

    /// The one request's summary.
    pub(super) fn summary(&self) -> Summary {
        let all = self.summaries.lock().unwrap();
        let [summary] = &all[..] else {
            panic!("one request: {} summaries", all.len())
        };
        summary.clone()
    }
}

/// NIXL over [`P1`] and [`D1`], [`D2`], every request traced, continuing once
/// (decode-only when `decode_only`), what it tells kept.
pub(super) fn traced(fake: &Fake, decode_only: bool, told: &Told) -> Orchestrator {
    let mut config = continuing(1, decode_only);
    config.trace_ratio = Some(1.0);
    listened(fake, config, told.clone())
}

/// The client's stream, read to its end (an error ends it too).
async fn drain(orch: &Orchestrator) {
    let mut body = serve(orch, chat(orch)).await.unwrap().into_body();
    while let Some(frame) = next(&mut body).await {
        if frame.is_err() {
            break;
        }
    }
}

/// The leg span ids a report names.
fn legs(t: &TraceIds) -> [[u8; 8]; 3] {
    [t.prefill, t.handoff, t.decode]
}

/// The report the dead decode is told failed with, when its stream breaks, is in the
/// request's trace (a listener that follows traces sees it), and names leg spans of its
/// own: the attempt's decode span is the attempt report's.
#[tokio::test(start_paused = true)]
async fn the_dead_decodes_report_is_in_the_requests_trace() {
    for decode_only in [true, false] {
        let fake = Fake::new();
        let told = Told::default();
        continued_once(&fake, prefill_answer(), to_the_end("B", 8));
        let orch = traced(&fake, decode_only, &told);
        drain(&orch).await;
        let summary = told.summary();
        let request = summary.trace.as_ref().expect("traced");
        let all = told.reports();
        let dead: Vec<&Report> = all
            .iter()
            .filter(|r| r.route.decode.id().as_str() == D1 && r.decode == LegOutcome::Failed)
            .collect();
        let [dead] = &dead[..] else {
            panic!("the dead decode told failed once: {all:?}")
        };
        assert_eq!(dead.outcome, Outcome::DecodeFailed);
        let trace = dead.trace.as_ref().unwrap_or_else(|| {
            panic!("the dead decode's report is traced (decode-only: {decode_only})")
        });
        assert_eq!(
            (trace.trace_id, trace.request, trace.sampled),
            (request.trace_id, request.request, request.sampled)
        );
        let attempt = all
            .iter()
            .find(|r| r.attempt == 0 && r.outcome == Outcome::Success)
            .and_then(|r| r.trace.as_ref())
            .expect("the attempt's report, traced");
        for own in legs(trace) {
            assert!(
                !legs(attempt).contains(&own),
                "the dead decode's report names the attempt's leg spans: {trace:?} {attempt:?}"
            );
        }
        assert_settled(&orch);
    }
}

/// A continuation through a fresh prefill that fails (its prefill, or its decode) is
/// reported as an attempt of its own: its legs' spans have ids of their own, not the
/// migration's span (which its engines' `traceparent` names), nor each other's, nor the
/// first attempt's. The same for the fresh prefill's leg report when it answers.
#[tokio::test(start_paused = true)]
async fn a_continuations_reports_name_leg_spans_of_their_own() {
    for case in ["prefill fails", "decode fails", "prefill answers"] {
        let fake = Fake::new();
        let told = Told::default();
        let fresh = if case == "prefill fails" {
            engine_error(503, "KV cache full")
        } else {
            prefill_answer()
        };
        let rest = if case == "decode fails" {
            engine_error(503, "busy")
        } else {
            to_the_end("B", 8)
        };
        continued_once(&fake, fresh, rest);
        let orch = traced(&fake, false, &told);
        drain(&orch).await;
        let summary = told.summary();
        let request = summary.trace.as_ref().expect("traced");
        let [migration] = &summary.migrated[..] else {
            panic!("one migration: {:?}", summary.migrated)
        };
        let span = migration.span.expect("the migration's span");
        // The continuation's prefill leg names the migration's span.
        let leg = fake
            .calls_to(P1)
            .into_iter()
            .find(|c| c.uri.path() == COMPLETIONS)
            .expect("the fresh prefill's leg");
        let hex = |b: &[u8]| b.iter().map(|b| format!("{b:02x}")).collect::<String>();
        let want = format!("00-{}-{}-01", hex(&request.trace_id), hex(&span));
        assert_eq!(leg.header("traceparent"), Some(want.as_str()), "{case}");
        let all = told.reports();
        let continuation: Vec<&Report> = all
            .iter()
            .filter(|r| r.attempt == 1 && r.route.prefill.is_some())
            .collect();
        let [report] = &continuation[..] else {
            panic!("{case}: the continuation reported once: {all:?}")
        };
        match case {
            "prefill fails" => assert_eq!(report.outcome, Outcome::PrefillFailed),
            "decode fails" => assert_eq!(report.outcome, Outcome::DecodeFailed),
            _ => assert_eq!(
                (report.outcome, report.decode),
                (Outcome::Success, LegOutcome::NotSent)
            ),
        }
        let trace = report.trace.as_ref().expect("traced");
        assert_eq!(trace.trace_id, request.trace_id, "{case}");
        let ids = legs(trace);
        assert!(
            !ids.contains(&span),
            "{case}: a leg span with the migration's id: {trace:?}, migration {span:?}"
        );
        assert!(
            ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2],
            "{case}: leg spans sharing an id: {trace:?}"
        );
        for own in ids {
            assert!(
                !legs(request).contains(&own) && own != request.request,
                "{case}: {trace:?} names a span of the first attempt's {request:?}"
            );
        }
        assert_settled(&orch);
    }
}

/// The one report that tells the decode at `url` failed.
pub(super) fn dead<'a>(all: &'a [Report], url: &str) -> &'a Report {
    let dead: Vec<&Report> = all
        .iter()
        .filter(|r| r.route.decode.id().as_str() == url && r.decode == LegOutcome::Failed)
        .collect();
    let [dead] = &dead[..] else {
        panic!("{url} told failed once: {all:?}")
    };
    dead
}

/// The report of a decode whose stream broke at `broke` times its leg, as a trace draws
/// it: sent, its first byte, then the break (5 ms after its last frame), each phase
/// from its send.
fn timed_to_the_break(r: &Report, broke: std::time::Instant, what: &str) {
    let tl = &r.timeline;
    let (Some(sent), Some(first), Some(end)) = (tl.decode_sent, tl.decode_first_chunk, tl.end)
    else {
        panic!("{what}: the dead decode's leg, untimed: {tl:?}")
    };
    assert!(sent <= first && first <= end, "{what}: {tl:?}");
    assert_eq!(end, broke, "{what}: the leg ends at the break");
    assert!(end - sent >= ms(5), "{what}: {tl:?}");
    assert_eq!(
        r.phases.decode_first_chunk,
        Some(first - sent),
        "{what}: its phases"
    );
}

/// The report that tells a broken decode failed times its leg, so that a trace draws
/// the leg that broke (an error span from its send to the break) and not only the
/// continuation: the first leg from the attempt's decode send, a continuation's leg
/// from its own send, each past its first byte to the break its migration counts the
/// client's stream still from.
#[tokio::test(start_paused = true)]
async fn the_dead_decodes_report_times_its_leg_from_its_send_to_the_break() {
    for decode_only in [true, false] {
        let fake = Fake::new();
        let told = Told::default();
        continued_twice(&fake, then_breaks("B", 8));
        fake.on(P1, COMPLETIONS, prefill_answer());
        fake.on(P1, COMPLETIONS, prefill_answer());
        let mut config = continuing(2, decode_only);
        config.trace_ratio = Some(1.0);
        let orch = over(&fake, &[P1], &[D1, D2, D3], VllmNixl::new(), config)
            .listener(told.clone())
            .build();
        drain(&orch).await;
        let summary = told.summary();
        let [first, second] = &summary.migrated[..] else {
            panic!("two migrations: {:?}", summary.migrated)
        };
        let all = told.reports();
        // The attempt's own steps (its report times the decode that finished it).
        let attempt = summary.timeline.expect("the attempt's steps");
        let (d1, d2) = (dead(&all, D1), dead(&all, D2));
        let what = format!("decode-only: {decode_only}");
        timed_to_the_break(d1, first.broke, &format!("D1, {what}"));
        assert_eq!(
            d1.timeline.decode_sent, attempt.decode_sent,
            "{what}: the first leg was sent when the attempt's decode was"
        );
        timed_to_the_break(d2, second.broke, &format!("D2, {what}"));
        assert!(
            d2.timeline.decode_sent >= Some(first.broke),
            "{what}: the continuation's leg was sent after the break it continues"
        );
        assert_settled(&orch);
    }
}

/// A continuation whose decode answered 5xx (decode-only) is told failed with its leg
/// timed: sent after the break, its head, its end.
#[tokio::test(start_paused = true)]
async fn a_continuation_that_could_not_start_is_told_failed_with_its_leg_timed() {
    let fake = Fake::new();
    let told = Told::default();
    continued_once(&fake, prefill_answer(), engine_error(503, "busy"));
    let orch = traced(&fake, true, &told);
    drain(&orch).await;
    let summary = told.summary();
    let [migration] = &summary.migrated[..] else {
        panic!("one migration: {:?}", summary.migrated)
    };
    let all = told.reports();
    let d2 = dead(&all, D2);
    let tl = &d2.timeline;
    let (Some(sent), Some(head), Some(end)) = (tl.decode_sent, tl.decode_head, tl.end) else {
        panic!("the continuation's decode leg, untimed: {tl:?}")
    };
    assert!(
        migration.broke <= sent && sent <= head && head <= end,
        "{tl:?}"
    );
    assert_eq!(d2.phases.decode_head, Some(head - sent));
    assert_settled(&orch);
}

/// A continuation whose first bytes come in the frame that breaks it (a token, then an
/// error event) resumed the client's stream: its migration ends there (its time lost
/// is known), the next migration counts the stream still from its own break, and the
/// dead continuation's report has its first byte.
#[tokio::test(start_paused = true)]
async fn a_continuation_that_breaks_in_its_first_frame_resumed_the_stream() {
    let fake = Fake::new();
    let told = Told::default();
    let error = r#"data: {"error":{"message":"decode died","type":"Error","code":500}}"#;
    let frame = continued("B", 8, None) + error + "\n\n";
    continued_twice(&fake, Reply::sse().frame(ms(5), frame));
    let orch = over(
        &fake,
        &[P1],
        &[D1, D2, D3],
        VllmNixl::new(),
        continuing(2, true),
    )
    .listener(told.clone())
    .build();
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    let text = read_to_end(&mut body).await;
    assert!(
        text.contains("\"B\"") && text.contains("\"C\"") && !text.contains("decode died"),
        "{text}"
    );
    let summary = told.summary();
    let [first, second] = &summary.migrated[..] else {
        panic!("two migrations: {:?}", summary.migrated)
    };
    let Some(resumed) = first.resumed else {
        panic!("the first continuation's bytes went out: {first:?}")
    };
    assert_eq!(first.time_lost, Some(resumed - first.broke));
    assert!(
        second.broke > first.broke && second.broke >= resumed,
        "the second break is D2's, not D1's: {first:?} {second:?}"
    );
    assert!(second.resumed.is_some(), "{second:?}");
    let all = told.reports();
    assert_eq!(
        dead(&all, D2).timeline.decode_first_chunk,
        Some(resumed),
        "D2's leg, timed to its first byte"
    );
    assert_settled(&orch);
}

/// After a migration the attempt's report tells the decode that finished the answer
/// with that decode's own leg: sent after the break, its own head (2 ms after its send)
/// and first byte, and the handoff step before it (a fresh prefill's; none
/// decode-only). The first leg's decode times and the handoff before it are the dead
/// decode's report's; the attempt's start and prefill leg stay the attempt's, and the
/// request's summary keeps the attempt's own steps (its route is the attempt's).
#[tokio::test(start_paused = true)]
async fn the_attempts_report_times_the_decode_that_finished_the_answer() {
    for decode_only in [true, false] {
        let fake = Fake::new();
        let told = Told::default();
        continued_once(&fake, prefill_answer(), to_the_end("B", 8).after(ms(2)));
        let orch = traced(&fake, decode_only, &told);
        drain(&orch).await;
        let what = format!("decode-only: {decode_only}");
        let summary = told.summary();
        let [migration] = &summary.migrated[..] else {
            panic!("{what}: one migration: {:?}", summary.migrated)
        };
        let all = told.reports();
        let attempt = all
            .iter()
            .find(|r| r.attempt == 0 && r.outcome == Outcome::Success)
            .expect("the attempt's report");
        assert_eq!(attempt.route.decode.id().as_str(), D2, "{what}");
        let tl = &attempt.timeline;
        let (Some(sent), Some(head), Some(first)) =
            (tl.decode_sent, tl.decode_head, tl.decode_first_chunk)
        else {
            panic!("{what}: the final decode's leg, untimed: {tl:?}")
        };
        assert!(
            migration.broke <= sent && sent <= head && head <= first,
            "{what}: sent after the break {migration:?}: {tl:?}"
        );
        assert_eq!(attempt.phases.decode_head, Some(ms(2)), "{what}: D2's head");
        assert_eq!(Some(first), migration.resumed, "{what}: D2's first byte");
        let own = summary.timeline.expect("the attempt's own steps");
        let d1 = dead(&all, D1);
        assert_eq!(
            (d1.timeline.handoff_start, d1.timeline.decode_sent),
            (own.handoff_start, own.decode_sent),
            "{what}: the first leg's handoff and send are the dead decode's report's"
        );
        let (Some(handoff), Some(sent_first)) = (own.handoff_start, own.decode_sent) else {
            panic!("{what}: {own:?}")
        };
        let phases = summary.phases.expect("the attempt's phases");
        assert_eq!(d1.phases.handoff, Some(sent_first - handoff), "{what}");
        assert_eq!(phases.handoff, d1.phases.handoff, "{what}");
        assert_eq!(phases.decode_head, d1.phases.decode_head, "{what}");
        assert_eq!(
            (tl.start, tl.prefill_sent, tl.prefill_done),
            (own.start, own.prefill_sent, own.prefill_done),
            "{what}: the attempt's start and prefill leg"
        );
        if decode_only {
            assert_eq!(tl.handoff_start, None, "{what}");
        } else {
            let Some(handoff) = tl.handoff_start else {
                panic!("{what}: the fresh prefill's handoff: {tl:?}")
            };
            assert!(
                migration.broke <= handoff && handoff <= sent,
                "{what}: {tl:?}"
            );
        }
        assert_settled(&orch);
    }
}

/// The reports naming the decode at `url`, whatever they tell of it.
pub(super) fn naming<'a>(all: &'a [Report], url: &str) -> Vec<&'a Report> {
    all.iter()
        .filter(|r| r.route.decode.id().as_str() == url)
        .collect()
}

/// A stream that breaks on D1 and whose only other decode, D2, refuses the continuation
/// (503) ends on D1: D1's leg is told failed once (by the attempt's report, which names
/// it: passive health counts one failure, the metrics see its phases once), D2's once
/// (its continuation's), and the request's summary once, as an error.
#[tokio::test(start_paused = true)]
async fn a_broken_decode_whose_stream_never_moved_on_is_told_failed_once() {
    for decode_only in [true, false] {
        let what = format!("decode-only: {decode_only}");
        let fake = Fake::new();
        let told = Told::default();
        continued_once(&fake, prefill_answer(), engine_error(503, "busy"));
        let orch = traced(&fake, decode_only, &told);
        drain(&orch).await;
        let summary = told.summary();
        assert_eq!(summary.outcome, "error", "{what}");
        assert_eq!(summary.migrated.len(), 1, "{what}: {:?}", summary.migrated);
        let all = told.reports();
        let on_d1 = naming(&all, D1);
        let [d1] = &on_d1[..] else {
            panic!("{what}: D1 in one report: {all:?}")
        };
        assert_eq!(
            (d1.outcome, d1.decode),
            (Outcome::DecodeFailed, LegOutcome::Failed),
            "{what}"
        );
        let d2 = dead(&all, D2);
        assert_eq!(d2.outcome, Outcome::DecodeFailed, "{what}");
        assert_settled(&orch);
    }
}

/// The client leaves while a broken stream's continuation is awaited (its decode gives
/// no head): the decode the stream broke on is in one report, which tells it failed
/// (not abandoned besides).
#[tokio::test(start_paused = true)]
async fn a_broken_decode_whose_client_left_before_the_stream_moved_on_is_told_failed_once() {
    for decode_only in [true, false] {
        let what = format!("decode-only: {decode_only}");
        let fake = Fake::new();
        let told = Told::default();
        continued_once(&fake, prefill_answer(), Reply::hang());
        let orch = traced(&fake, decode_only, &told);
        let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        until(&mut body, "\"A\"").await;
        let polled = timeout(ms(50), body.frame()).await;
        assert!(polled.is_err(), "{what}: the continuation is awaited");
        assert_eq!(fake.calls_to(D2).len(), 1, "{what}");
        drop(body);
        let summary = told.summary();
        assert_eq!(summary.outcome, "cancelled", "{what}");
        let all = told.reports();
        let on_d1 = naming(&all, D1);
        let [d1] = &on_d1[..] else {
            panic!("{what}: D1 in one report: {all:?}")
        };
        assert_eq!(d1.decode, LegOutcome::Failed, "{what}: {d1:?}");
        assert_settled(&orch);
    }
}

/// A request whose first attempt failed before its answer began (its prefill refused
/// the connection) and whose retry's stream then broke: the report that tells the
/// broken decode failed is the retry's, as the attempt's report is.
#[tokio::test(start_paused = true)]
async fn the_dead_decodes_report_is_the_attempts_whose_leg_broke() {
    let fake = Fake::new();
    let told = Told::default();
    fake.on(P1, CHAT, Reply::refuse());
    fake.on(P2, CHAT, prefill_answer());
    // The retry's decode streams and breaks, the other decode continues it.
    for decode in [D1, D2] {
        fake.on(decode, CHAT, dying());
        fake.on(decode, COMPLETIONS, to_the_end("B", 8));
    }
    let config = continuing(1, true);
    let orch = over(&fake, &[P1, P2], &[D1, D2], VllmNixl::new(), config)
        .retry(Backoff::new(RetryPolicy::retries(1)))
        .listener(told.clone())
        .build();
    drain(&orch).await;
    let summary = told.summary();
    assert_eq!((summary.attempts, summary.migrations), (2, 1));
    let all = told.reports();
    let answered = all
        .iter()
        .find(|r| r.outcome == Outcome::Success)
        .expect("the attempt's report");
    assert_eq!(answered.attempt, 1, "the retry's: {all:?}");
    let broke = if answered.route.decode.id().as_str() == D1 {
        D2
    } else {
        D1
    };
    assert_eq!(dead(&all, broke).attempt, answered.attempt, "{all:?}");
    assert_settled(&orch);
}

/// A request whose first attempt (0) failed before its answer began and whose retry
/// (attempt 1) then broke and went on through a fresh prefill: the continuation, an
/// attempt of its own, is numbered after the attempt it continues (1 + its migration
/// index 1 = 2), never as one of the request's attempts, whether its prefill answered
/// (its leg's report) or failed (its attempt's report).
#[tokio::test(start_paused = true)]
async fn a_continuations_reports_are_numbered_after_the_attempt_it_continues() {
    for fresh in ["answers", "fails"] {
        let fake = Fake::new();
        let told = Told::default();
        fake.on(P1, CHAT, Reply::refuse());
        fake.on(P2, CHAT, prefill_answer());
        for decode in [D1, D2] {
            fake.on(decode, CHAT, dying());
            fake.on(decode, COMPLETIONS, to_the_end("B", 8));
        }
        for prefill in [P1, P2] {
            let reply = if fresh == "answers" {
                prefill_answer()
            } else {
                engine_error(503, "KV cache full")
            };
            fake.on(prefill, COMPLETIONS, reply);
        }
        let orch = over(
            &fake,
            &[P1, P2],
            &[D1, D2],
            VllmNixl::new(),
            continuing(1, false),
        )
        .retry(Backoff::new(RetryPolicy::retries(1)))
        .listener(told.clone())
        .build();
        drain(&orch).await;
        let summary = told.summary();
        assert_eq!((summary.attempts, summary.migrations), (2, 1), "{fresh}");
        let all = told.reports();
        let numbers: Vec<u32> = all.iter().map(|r| r.attempt).collect();
        // The first attempt's report is told first, as it failed.
        let (first, rest) = all.split_first().expect("reports");
        assert_eq!((first.attempt, first.outcome), (0, Outcome::PrefillFailed));
        // The continuation's own report: its fresh prefill's leg, its decode not sent.
        let own: Vec<&Report> = rest
            .iter()
            .filter(|r| r.prefill != LegOutcome::NotSent && r.decode == LegOutcome::NotSent)
            .collect();
        let [own] = &own[..] else {
            panic!("{fresh}: the continuation's report: {all:?}")
        };
        // The request's attempts are 0 and 1 (`summary.attempts`): the continuation's
        // report is none of theirs.
        assert_eq!(own.attempt, 2, "{fresh}: {numbers:?}");
        assert_settled(&orch);
    }
}

/// A span id as hex, as a `traceparent` has it.
fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

/// The first decode's `traceparent` names the attempt's decode span, so a tracing
/// engine draws its spans under it: the report that draws the span with that id is the
/// one that tells the first decode failed when its stream broke and moved on (its leg,
/// its times), not the attempt's report, which names the decode that finished the
/// answer under a span id of its own.
#[tokio::test(start_paused = true)]
async fn the_first_decodes_engine_spans_sit_under_its_dead_report() {
    for decode_only in [true, false] {
        let what = format!("decode-only: {decode_only}");
        let fake = Fake::new();
        let told = Told::default();
        continued_once(&fake, prefill_answer(), to_the_end("B", 8));
        let orch = traced(&fake, decode_only, &told);
        drain(&orch).await;
        let leg = fake
            .calls_to(D1)
            .into_iter()
            .find(|c| c.uri.path() == CHAT)
            .expect("the first decode leg");
        let parent = leg.header("traceparent").expect("traced").to_owned();
        let parent = &parent[36..52];
        let all = told.reports();
        let d1 = dead(&all, D1).trace.as_ref().expect("traced");
        assert_eq!(
            parent,
            hex(&d1.decode),
            "{what}: D1's span is its dead report's"
        );
        let attempt = all
            .iter()
            .find(|r| r.attempt == 0 && r.outcome == Outcome::Success)
            .and_then(|r| r.trace.as_ref())
            .expect("the attempt's report, traced");
        assert_ne!(
            parent,
            hex(&attempt.decode),
            "{what}: not the final decode's"
        );
        assert_ne!(d1.handoff, attempt.handoff, "{what}");
        assert_settled(&orch);
    }
}

/// An error event: the engine's failure, mid-stream.
const ERROR_EVENT: &str =
    "data: {\"error\":{\"message\":\"decode died\",\"type\":\"Error\",\"code\":500}}\n\n";

/// A continuation whose stream ends with an error event, with no migration left to
/// continue it: its decode is told failed once (by the attempt's report, which names
/// it), and the request's stream broke.
#[tokio::test(start_paused = true)]
async fn a_continuation_that_ends_in_an_error_event_is_told_failed() {
    for decode_only in [true, false] {
        let what = format!("decode-only: {decode_only}");
        let fake = Fake::new();
        let told = Told::default();
        let rest = Reply::sse()
            .frame(ms(0), continued("B", 8, None))
            .frame(ms(0), ERROR_EVENT);
        continued_once(&fake, prefill_answer(), rest);
        let orch = traced(&fake, decode_only, &told);
        drain(&orch).await;
        let all = told.reports();
        // Its decode leg's reports (a fresh prefill's leg report names it, unsent).
        let on_d2: Vec<&Report> = naming(&all, D2)
            .into_iter()
            .filter(|r| r.decode != LegOutcome::NotSent)
            .collect();
        let [d2] = &on_d2[..] else {
            panic!("{what}: D2 in one report: {all:?}")
        };
        assert_eq!(
            (d2.outcome, d2.decode),
            (Outcome::DecodeFailed, LegOutcome::Failed),
            "{what}"
        );
        // A continuation's decode was not handed the report's prefill's KV.
        assert!(!d2.kv_load_suspect, "{what}: {d2:?}");
        let summary = told.summary();
        assert_eq!(summary.outcome, "error", "{what}");
        assert_eq!(summary.error, Some("decode_stream_failed"), "{what}");
        dead(&all, D1);
        assert_settled(&orch);
    }
}

/// A first leg that cannot be migrated (its first chunk has no prompt ids) and ends
/// with an error event, migration on: its decode is told failed by the attempt's
/// report, the request's stream broke.
#[tokio::test(start_paused = true)]
async fn an_unmigratable_stream_that_ends_in_an_error_event_is_told_failed() {
    let fake = Fake::new();
    let told = Told::default();
    let chunk = r#"data: {"id":"c-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"A"}}]}"#.to_owned() + "\n\n";
    let reply = Reply::sse().frame(ms(0), chunk).frame(ms(0), ERROR_EVENT);
    fake.on(P1, CHAT, prefill_answer()).on(D1, CHAT, reply);
    let orch = traced(&fake, true, &told);
    drain(&orch).await;
    let all = told.reports();
    let on_d1 = naming(&all, D1);
    let [d1] = &on_d1[..] else {
        panic!("D1 in one report: {all:?}")
    };
    assert_eq!(
        (d1.outcome, d1.decode),
        (Outcome::DecodeFailed, LegOutcome::Failed)
    );
    // Handed the prefill's KV, it ended in a 5xx event, as a lost KV load ends a chat.
    assert!(d1.kv_load_suspect, "{d1:?}");
    let summary = told.summary();
    assert_eq!((summary.outcome, summary.migrations), ("error", 0));
    assert_eq!(summary.error, Some("decode_stream_failed"));
    assert!(fake.calls_to(D2).is_empty());
    assert_settled(&orch);
}
