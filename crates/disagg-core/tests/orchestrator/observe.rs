//! What listeners hear: one report per attempt and one summary per request, with the
//! instants of every step on the paused clock, and the trace context each leg carries.

use std::sync::Mutex;

use disagg_core::connector::KvGate;
use disagg_core::endpoint::EndpointId;
use disagg_core::orchestrator::MissingKv;
use disagg_core::outcome::Outcome;
use disagg_core::outcome::{Delivery, LegOutcome, Listener, Report, Summary};

use super::*;

mod refusals;
mod verdicts;

/// Every report and summary an orchestrator told, and in which order.
#[derive(Default)]
struct Heard {
    reports: Mutex<Vec<Report>>,
    summaries: Mutex<Vec<Summary>>,
    order: Mutex<Vec<&'static str>>,
}

impl Listener for Heard {
    fn on_report(&self, report: &Report) {
        self.reports.lock().unwrap().push(report.clone());
        self.order.lock().unwrap().push("report");
    }

    fn on_request(&self, summary: &Summary) {
        self.summaries.lock().unwrap().push(summary.clone());
        self.order.lock().unwrap().push("summary");
    }
}

impl Heard {
    fn reports(&self) -> Vec<Report> {
        self.reports.lock().unwrap().clone()
    }

    fn summaries(&self) -> Vec<Summary> {
        self.summaries.lock().unwrap().clone()
    }

    fn order(&self) -> Vec<&'static str> {
        self.order.lock().unwrap().clone()
    }

    /// The one summary told; fails if there were none or several.
    fn summary(&self) -> Summary {
        let all = self.summaries();
        let [s] = &all[..] else {
            panic!("expected one summary, got {}: {all:?}", all.len())
        };
        s.clone()
    }
}

/// An orchestrator over `prefill` and [`D1`] whose listener is the returned [`Heard`].
fn heard(
    fake: &Fake,
    prefill: &[&str],
    connector: impl KvConnector,
    config: impl FnOnce(&mut Setup),
) -> (Orchestrator, Arc<Heard>) {
    let heard = Arc::new(Heard::default());
    let mut c = Setup::default();
    config(&mut c);
    let source = StaticSource::new(endpoints(prefill, &[D1]));
    let builder =
        Orchestrator::builder(source, fake.clone(), connector).listener(Arc::clone(&heard));
    (c.apply(builder).build(), heard)
}

fn std_ms(n: u64) -> std::time::Duration {
    std::time::Duration::from_millis(n)
}

#[tokio::test(start_paused = true)]
async fn a_request_is_summarized_once_with_its_phases_first_byte_and_bytes() {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer().after(ms(30)));
    fake.on(
        D1,
        CHAT,
        Reply::sse()
            .after(ms(5))
            .frame(ms(7), event(0))
            .frame(ms(11), event(1))
            .frame(ms(2), DONE),
    );
    let (orch, heard) = heard(&fake, &[P1], VllmNixl::new(), |_| {});
    let resp = serve(&orch, chat_with(&orch, &[("x-request-id", "client-7")]))
        .await
        .unwrap();
    assert!(heard.summaries().is_empty(), "nothing told before the end");
    let all = within(resp.into_body().collect()).await.unwrap().to_bytes();

    let reports = heard.reports();
    let [r] = &reports[..] else {
        panic!("{reports:?}")
    };
    assert_eq!(r.outcome, Outcome::Success);
    assert_eq!(
        (r.prefill, r.decode, r.attempt),
        (LegOutcome::Answered, LegOutcome::Answered, 0)
    );
    let tl = r.timeline;
    let phases = r.phases;
    assert_eq!(phases.prefill, Some(std_ms(30)));
    assert_eq!(phases.handoff, Some(std_ms(0)));
    assert_eq!(phases.decode_head, Some(std_ms(5)));
    assert_eq!(phases.decode_first_chunk, Some(std_ms(12)));
    assert_eq!(tl.end.unwrap() - tl.start, std_ms(55));

    let s = heard.summary();
    assert_eq!(
        (s.status, s.delivery, s.outcome),
        (StatusCode::OK, Delivery::Complete, "success")
    );
    assert_eq!(s.request_id.as_ref().unwrap(), "client-7");
    let calls = fake.calls();
    assert_eq!(s.engine_request_id.as_ref().unwrap(), calls[0].id());
    assert_eq!(
        (s.api, s.stream, s.model.as_deref()),
        (Api::Chat, true, Some("m"))
    );
    assert_eq!(
        (s.handoff, s.fallback, s.error, s.attempts),
        (Some("kv"), None, None, 1)
    );
    let route = s.route.as_ref().unwrap();
    assert_eq!(route.decode.id().as_str(), D1);
    assert_eq!(route.prefill.as_ref().unwrap().id().as_str(), P1);
    assert_eq!(s.bytes, all.len() as u64);
    // The first event went out 30 + 5 + 7 ms after arrival; the last 13 ms later.
    assert_eq!(s.time_to_first_byte, Some(std_ms(42)));
    assert_eq!(s.duration, std_ms(55));
    assert_eq!(s.timeline.unwrap().decode_head, tl.decode_head);
    assert_eq!(s.queued, None);
    assert_eq!(s.trace, None, "not traced unless configured");
}

#[tokio::test(start_paused = true)]
async fn a_retried_request_reports_each_attempt_and_is_summarized_once() {
    let fake = Fake::new();
    fake.on(P1, CHAT, engine_error(503, "overloaded"));
    fake.on(P2, CHAT, prefill_answer());
    fake.on(D1, CHAT, Reply::sse().frame(ms(0), DONE));
    let (orch, heard) = heard(&fake, &[P1, P2], VllmNixl::new(), |c| {
        c.retry = RetryPolicy::retries(1)
    });
    let resp = serve(&orch, chat(&orch)).await.unwrap();
    within(resp.into_body().collect()).await.unwrap();
    let reports = heard.reports();
    let [first, second] = &reports[..] else {
        panic!("{reports:?}")
    };
    assert_eq!((first.attempt, first.outcome), (0, Outcome::PrefillFailed));
    assert_eq!(first.route.prefill.as_ref().unwrap().id().as_str(), P1);
    assert!(
        first.timeline.end.is_some(),
        "a failed attempt's end is timed"
    );
    assert_eq!((second.attempt, second.outcome), (1, Outcome::Success));
    let s = heard.summary();
    assert_eq!((s.attempts, s.status), (2, StatusCode::OK));
    assert_eq!(s.route.unwrap().prefill.unwrap().id().as_str(), P2);
    // The summary names the answering attempt's engine-side id.
    let p2 = &fake.calls_to(P2)[0];
    assert_eq!(s.engine_request_id.unwrap(), p2.id());
}

#[tokio::test(start_paused = true)]
async fn a_request_refused_before_any_attempt_has_a_summary_and_no_report() {
    let fake = Fake::new();
    let (orch, heard) = heard(&fake, &[P1], VllmNixl::new(), |_| {});
    // vLLM refuses `n: 0`; so does the proxy, before routing.
    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"n":0}"#;
    let req = orch
        .request(
            Api::Chat,
            HeaderMap::new(),
            &Bytes::from_static(body.as_bytes()),
        )
        .unwrap();
    let e = serve(&orch, req).await.unwrap_err();
    assert_eq!(e.http().status, StatusCode::BAD_REQUEST);
    assert!(heard.reports().is_empty());
    let s = heard.summary();
    assert_eq!(
        (s.status, s.error, s.attempts),
        (StatusCode::BAD_REQUEST, Some(e.http().code), 0)
    );
    assert_eq!(s.outcome, "client_error");
    assert!(s.route.is_none() && s.timeline.is_none());
    assert!(fake.calls().is_empty());

    // A body the server could not even parse: the server tells the orchestrator.
    let err = orch
        .request(
            Api::Chat,
            HeaderMap::new(),
            &Bytes::from_static(b"{not json"),
        )
        .map_err(PdError::body)
        .unwrap_err();
    let arrival = Instant::now().into_std();
    sleep(ms(3)).await;
    orch.refused(
        Api::Chat,
        Some(HeaderValue::from_static("c-1")),
        arrival,
        &err,
    );
    let all = heard.summaries();
    let s = all.last().unwrap();
    assert_eq!((s.status.as_u16(), s.error), (400, Some(err.http().code)));
    assert_eq!(s.request_id.as_ref().unwrap(), "c-1");
    assert_eq!(s.duration, std_ms(3));
}

#[tokio::test(start_paused = true)]
async fn a_request_that_fails_for_good_is_summarized_with_its_route_and_code() {
    let fake = Fake::new();
    fake.on(P1, CHAT, engine_error(500, "boom").after(ms(8)));
    let (orch, heard) = heard(&fake, &[P1], VllmNixl::new(), |_| {});
    let e = serve(&orch, chat(&orch)).await.unwrap_err();
    assert_error(&e, 502, "prefill_failed");
    let [r] = &heard.reports()[..] else { panic!() };
    assert_eq!(
        (r.outcome, r.prefill),
        (Outcome::PrefillFailed, LegOutcome::Failed)
    );
    let s = heard.summary();
    assert_eq!(
        (s.status.as_u16(), s.error, s.attempts),
        (502, Some("prefill_failed"), 1)
    );
    assert_eq!(s.outcome, "error");
    assert_eq!(
        s.route
            .as_ref()
            .unwrap()
            .prefill
            .as_ref()
            .unwrap()
            .id()
            .as_str(),
        P1
    );
    assert_eq!(s.duration, std_ms(8));
    assert_eq!(s.time_to_first_byte, None);
}

#[tokio::test(start_paused = true)]
async fn a_client_leaving_mid_stream_is_summarized_as_cancelled() {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer());
    let (decode, feed) = Reply::sse().fed();
    fake.on(D1, CHAT, decode);
    let (orch, heard) = heard(&fake, &[P1], VllmNixl::new(), |_| {});
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    feed.send(event(0));
    let first = data(&mut body).await;
    sleep(ms(100)).await;
    drop(body);
    let s = heard.summary();
    assert_eq!((s.delivery, s.outcome), (Delivery::Cancelled, "cancelled"));
    assert_eq!(s.bytes, first.len() as u64);
    assert_eq!(s.duration, std_ms(100));
    assert_eq!(heard.reports()[0].outcome, Outcome::Cancelled);
}

/// A client that leaves before the response head (the server drops the `serve`
/// future) ends its request once, as cancelled, and its attempt once, as cancelled, each
/// leg as far as it went; the report comes first.
#[tokio::test(start_paused = true)]
async fn a_client_leaving_before_the_head_is_summarized_and_its_attempt_reported_as_cancelled() {
    // While the prefill runs.
    let fake = Fake::new();
    fake.on(P1, CHAT, Reply::hang());
    let (orch, heard) = heard(&fake, &[P1], VllmNixl::new(), |_| {});
    let req = chat_with(&orch, &[("x-request-id", "client-9")]);
    assert!(timeout(ms(10), orch.serve(req)).await.is_err());
    let reports = heard.reports();
    let [r] = &reports[..] else {
        panic!("one report: {reports:?}")
    };
    assert_eq!(
        (r.outcome, r.prefill, r.decode, r.attempt),
        (
            Outcome::Cancelled,
            LegOutcome::Abandoned,
            LegOutcome::NotSent,
            0
        )
    );
    assert_eq!(r.route.prefill.as_ref().unwrap().id().as_str(), P1);
    assert_eq!(r.timeline.end.unwrap() - r.timeline.start, std_ms(10));
    let s = heard.summary();
    assert_eq!((s.delivery, s.outcome), (Delivery::Cancelled, "cancelled"));
    assert_eq!((s.attempts, s.error, s.bytes), (1, None, 0));
    assert_eq!(s.status.as_u16(), 499, "nginx's `client closed request`");
    assert_eq!(s.request_id.as_ref().unwrap(), "client-9");
    assert_eq!(s.engine_request_id.as_ref().unwrap(), fake.calls()[0].id());
    assert_eq!(s.duration, std_ms(10));
    assert_eq!(s.time_to_first_byte, None);
    assert_eq!(s.route.unwrap().prefill.unwrap().id().as_str(), P1);
    assert_eq!(
        s.phases.unwrap().prefill,
        None,
        "the prefill never answered"
    );
    assert_eq!(heard.order(), ["report", "summary"]);
    assert!(fake.calls()[0].abandoned_at().is_some());
    assert_settled(&orch);

    // While the decode's head is awaited: the prefill had answered.
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer().after(ms(4)));
    fake.on(D1, CHAT, Reply::hang());
    let (orch, heard) = self::heard(&fake, &[P1], VllmNixl::new(), |_| {});
    assert!(timeout(ms(10), orch.serve(chat(&orch))).await.is_err());
    let [r] = &heard.reports()[..] else { panic!() };
    assert_eq!(
        (r.outcome, r.prefill, r.decode),
        (
            Outcome::Cancelled,
            LegOutcome::Answered,
            LegOutcome::Abandoned
        )
    );
    let s = heard.summary();
    assert_eq!(s.delivery, Delivery::Cancelled);
    assert_eq!(s.phases.unwrap().prefill, Some(std_ms(4)));
    assert_settled(&orch);
}

/// A client that leaves while the decode-only fallback's decode is awaited: the failed
/// attempt was reported as it failed, the fallback is reported cancelled, then the
/// request is summarized once with both attempts.
#[tokio::test(start_paused = true)]
async fn a_client_leaving_during_the_decode_only_fallback_cancels_the_fallback_attempt() {
    let fake = Fake::new();
    fake.on(P1, CHAT, Reply::refuse());
    fake.on(D1, CHAT, Reply::hang());
    let (orch, heard) = heard(&fake, &[P1], VllmNixl::new(), |c| {
        c.prefill_failure = PrefillFailure::DecodeOnly
    });
    assert!(timeout(ms(10), orch.serve(chat(&orch))).await.is_err());
    let reports = heard.reports();
    let [failed, fallback] = &reports[..] else {
        panic!("{reports:?}")
    };
    assert_eq!(
        (failed.attempt, failed.outcome),
        (0, Outcome::PrefillFailed)
    );
    assert_eq!(
        (
            fallback.attempt,
            fallback.outcome,
            fallback.prefill,
            fallback.decode
        ),
        (
            1,
            Outcome::Cancelled,
            LegOutcome::NotSent,
            LegOutcome::Abandoned
        )
    );
    let s = heard.summary();
    assert_eq!((s.delivery, s.attempts), (Delivery::Cancelled, 2));
    assert_eq!(
        s.engine_request_id.as_ref().unwrap(),
        fake.calls_to(D1)[0].id()
    );
    assert_eq!(heard.order(), ["report", "report", "summary"]);
    assert_settled(&orch);
}

/// A client that leaves while its request waits for admission ends it once, as
/// cancelled, with the time it waited; no attempt was routed, so none is reported.
#[tokio::test(start_paused = true)]
async fn a_client_leaving_while_queued_is_summarized_as_cancelled_without_a_report() {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer());
    let (decode, feed) = Reply::sse().fed();
    fake.on(D1, CHAT, decode);
    let (orch, heard) = heard(&fake, &[P1], VllmNixl::new(), |c| {
        c.admission.max_in_flight = Some(1)
    });
    // The first request holds the one place while its body streams.
    let first = serve(&orch, chat(&orch)).await.unwrap();
    assert!(timeout(ms(10), orch.serve(chat(&orch))).await.is_err());
    assert!(heard.reports().is_empty(), "no attempt was routed");
    let s = heard.summary();
    assert_eq!((s.delivery, s.outcome), (Delivery::Cancelled, "cancelled"));
    assert_eq!((s.attempts, s.engine_request_id.as_ref()), (0, None));
    assert_eq!(s.queued, Some(std_ms(10)));
    assert!(s.route.is_none() && s.timeline.is_none());
    assert_eq!(orch.stats().queued_now, 0);
    assert_eq!(fake.calls().len(), 2, "only the first request's legs");

    feed.send(DONE);
    drop(feed);
    within(first.into_body().collect()).await.unwrap();
    assert_eq!(heard.summaries().len(), 2);
    assert_settled(&orch);
}

#[tokio::test(start_paused = true)]
async fn a_stream_that_breaks_is_summarized_with_the_breaks_code() {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer());
    fake.on(D1, CHAT, Reply::sse().frame(ms(10), event(0)).stall());
    let (orch, heard) = heard(&fake, &[P1], VllmNixl::new(), |c| {
        c.decode_idle_timeout = Some(ms(300))
    });
    let body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    within(body.collect()).await.unwrap();
    let s = heard.summary();
    assert_eq!((s.delivery, s.outcome), (Delivery::Broken, "error"));
    assert_eq!(s.error, Some("decode_idle_timeout"));
    assert_eq!(s.status, StatusCode::OK, "the head had gone out");
}

#[tokio::test(start_paused = true)]
async fn a_concurrent_prefill_answering_after_the_decode_head_is_timed_when_it_answers() {
    let fake = Fake::new();
    fake.on(P1, CHAT, Reply::json(200, r#"{"id":"p"}"#).after(ms(40)));
    fake.on(D1, CHAT, Reply::sse().after(ms(10)).frame(ms(5), DONE));
    let connector = SglangBootstrap::with_rooms(Rooms::from_seed(7));
    let (orch, heard) = heard(&fake, &[P1], connector, |_| {});
    let body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    within(body.collect()).await.unwrap();
    let summary = heard.summary();
    let tl = summary.timeline.unwrap();
    let phases = summary.phases.unwrap();
    assert_eq!(phases.prefill, Some(std_ms(40)));
    assert_eq!(phases.decode_head, Some(std_ms(10)));
    assert_eq!(phases.decode_first_chunk, Some(std_ms(15)));
    assert_eq!(tl.prefill_sent, tl.decode_sent, "both legs at once");
}

/// Both legs at once (SGLang): the prefill refuses its leg (a 4xx, passed through)
/// before the decode's head, and the decode leg, already sent, is dropped. The report
/// tells the prefill answered and the decode abandoned (it was sent: its span and its
/// per-leg count are real), not "not sent".
#[tokio::test(start_paused = true)]
async fn a_concurrent_decode_dropped_for_a_prefill_refusal_is_reported_abandoned() {
    let fake = Fake::new();
    fake.on(P1, CHAT, engine_error(400, "prompt too long").after(ms(5)));
    fake.on(D1, CHAT, Reply::sse().after(ms(50)).frame(ms(0), DONE));
    let connector = SglangBootstrap::with_rooms(Rooms::from_seed(7));
    let (orch, heard) = heard(&fake, &[P1], connector, |_| {});
    let resp = serve(&orch, chat(&orch)).await.unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "passed through");
    within(resp.into_body().collect()).await.unwrap();
    assert_eq!(fake.calls_to(D1).len(), 1, "the decode leg was sent");
    let reports = heard.reports();
    let [r] = &reports[..] else {
        panic!("one report: {reports:?}")
    };
    assert!(r.timeline.decode_sent.is_some());
    assert_eq!(
        (r.prefill, r.decode),
        (LegOutcome::Answered, LegOutcome::Abandoned)
    );
    assert_settled(&orch);
}

/// Both legs at once (SGLang): the decode answers an error status (relayed) at once,
/// while the prefill still runs (it would answer after 50 ms). The prefill is dropped
/// with the decode's answer, so the report tells it abandoned once the client's body
/// ended, not answered (which passive health would count a success of an engine that
/// never answered): after the decode's 503, its engine's failure; after its 400, a
/// refusal that blames no engine.
#[tokio::test(start_paused = true)]
async fn a_concurrent_prefill_dropped_for_the_decodes_error_status_is_reported_abandoned() {
    let cases = [
        (503, Outcome::DecodeFailed, LegOutcome::Failed),
        (400, Outcome::DecodeRefused, LegOutcome::Answered),
    ];
    for (status, outcome, decode) in cases {
        let fake = Fake::new();
        fake.on(P1, CHAT, Reply::json(200, r#"{"id":"p"}"#).after(ms(50)));
        fake.on(D1, CHAT, engine_error(status, "no"));
        let connector = SglangBootstrap::with_rooms(Rooms::from_seed(7));
        let (orch, heard) = heard(&fake, &[P1], connector, |_| {});
        let resp = serve(&orch, chat(&orch)).await.unwrap();
        assert_eq!(resp.status().as_u16(), status, "relayed");
        within(resp.into_body().collect()).await.unwrap();
        let p1 = fake.calls_to(P1);
        assert!(
            p1[0].abandoned_at().is_some(),
            "{status}: the prefill was dropped"
        );
        let reports = heard.reports();
        let [r] = &reports[..] else {
            panic!("{status}: one report: {reports:?}")
        };
        assert_eq!(r.timeline.prefill_done, None, "{status}: it never answered");
        assert_eq!(
            (r.outcome, r.prefill, r.decode),
            (outcome, LegOutcome::Abandoned, decode),
            "{status}"
        );
        assert_settled(&orch);
    }
}

const CLIENT_TRACE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[tokio::test(start_paused = true)]
async fn each_leg_carries_its_own_span_in_the_clients_trace() {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer());
    fake.on(D1, CHAT, Reply::sse().frame(ms(1), DONE));
    // A ratio of 0 samples no new trace; the client's sampled flag decides for its own.
    let (orch, heard) = heard(&fake, &[P1], VllmNixl::new(), |c| c.trace_ratio = Some(0.0));
    let req = chat_with(
        &orch,
        &[("traceparent", CLIENT_TRACE), ("tracestate", "congo=t61")],
    );
    let body = serve(&orch, req).await.unwrap().into_body();
    within(body.collect()).await.unwrap();
    let s = heard.summary();
    let t = s.trace.expect("traced");
    assert_eq!(hex(&t.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(hex(&t.parent.unwrap()), "00f067aa0ba902b7");
    assert!(t.sampled);
    let calls = fake.calls();
    let [p, d] = &calls[..] else {
        panic!("{calls:?}")
    };
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    assert_eq!(
        p.header("traceparent").unwrap(),
        format!("00-{trace}-{}-01", hex(&t.prefill))
    );
    assert_eq!(
        d.header("traceparent").unwrap(),
        format!("00-{trace}-{}-01", hex(&t.decode))
    );
    assert_eq!(
        (p.header("tracestate"), d.header("tracestate")),
        (Some("congo=t61"), Some("congo=t61"))
    );
    let ids = [t.request, t.prefill, t.handoff, t.decode];
    assert!(
        ids.iter()
            .all(|id| *id != [0; 8] && ids.iter().filter(|x| *x == id).count() == 1)
    );
    assert_eq!(
        heard.reports()[0].trace.as_ref(),
        Some(&t),
        "the attempt's report names the same spans"
    );
}

#[tokio::test(start_paused = true)]
async fn a_retry_gets_new_leg_spans_in_the_same_trace_and_an_unsampled_trace_still_propagates() {
    let fake = Fake::new();
    fake.on(P1, CHAT, Reply::refuse());
    fake.on(P2, CHAT, prefill_answer());
    fake.on(D1, CHAT, Reply::sse().frame(ms(0), DONE));
    let (orch, heard) = heard(&fake, &[P1, P2], VllmNixl::new(), |c| {
        c.retry = RetryPolicy::retries(1);
        c.trace_ratio = Some(0.0);
    });
    let body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    within(body.collect()).await.unwrap();
    let reports = heard.reports();
    let (a, b) = (
        reports[0].trace.clone().unwrap(),
        reports[1].trace.clone().unwrap(),
    );
    assert_eq!((a.trace_id, a.request), (b.trace_id, b.request));
    assert_ne!(a.prefill, b.prefill);
    assert!(!a.sampled && a.parent.is_none());
    // Unsampled, the context still travels (flags 00), so the engines agree not to record.
    let p2 = &fake.calls_to(P2)[0];
    assert_eq!(
        p2.header("traceparent").unwrap(),
        format!("00-{}-{}-00", hex(&b.trace_id), hex(&b.prefill))
    );
}

#[tokio::test(start_paused = true)]
async fn without_tracing_the_clients_traceparent_goes_to_the_legs_as_it_came() {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer());
    fake.on(D1, CHAT, Reply::sse().frame(ms(0), DONE));
    let (orch, heard) = heard(&fake, &[P1], VllmNixl::new(), |_| {});
    let body = serve(&orch, chat_with(&orch, &[("traceparent", CLIENT_TRACE)]))
        .await
        .unwrap()
        .into_body();
    within(body.collect()).await.unwrap();
    for call in fake.calls() {
        assert_eq!(call.header("traceparent"), Some(CLIENT_TRACE));
    }
    assert_eq!(heard.summary().trace, None);
}

/// Where [`FailsAt`] fails its plan: in its own build (`prepare`), in its resolution
/// before any leg is sent (`resolve`), or at the KV gate after the prefill answered
/// (`Lead`: the gate is waited for in the client's stream, after the plan's lead).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Prepare,
    Resolve,
    Gate,
    Lead,
}

/// The connector error a plan over a prefill and a decode fails with.
type Fails = fn(prefill: &EndpointId, decode: &EndpointId) -> ConnectorError;

/// vLLM NIXL's plan, failing at `step` with what `fail` makes of the route's engines.
struct FailsAt {
    step: Step,
    fail: Fails,
}

/// A gate that never opens: it fails with `fail`'s error.
#[derive(Debug)]
struct ShutGate {
    fail: Fails,
    prefill: EndpointId,
    decode: EndpointId,
}

#[async_trait]
impl KvGate for ShutGate {
    async fn ready(&self) -> Result<(), ConnectorError> {
        Err((self.fail)(&self.prefill, &self.decode))
    }
}

#[async_trait]
impl KvConnector for FailsAt {
    fn name(&self) -> &'static str {
        "nixl-fails-at"
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        if let (Step::Prepare, Some(p)) = (self.step, &route.prefill) {
            return Err((self.fail)(p.id(), route.decode.id()));
        }
        VllmNixl::new().prepare(route, req)
    }

    async fn resolve(
        &self,
        handoff: &mut Handoff,
        _transport: &dyn Transport,
    ) -> Result<(), ConnectorError> {
        match self.step {
            Step::Resolve => Err((self.fail)(
                handoff.prefill.endpoint.id(),
                handoff.decode.endpoint.id(),
            )),
            _ => Ok(()),
        }
    }

    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<HandoffFound, ConnectorError> {
        let found = VllmNixl::new().complete(handoff, answer).await?;
        if self.step == Step::Lead {
            handoff.lead = Some(Bytes::from(event(0)));
        }
        if let Step::Gate | Step::Lead = self.step {
            handoff.gate = Some(Arc::new(ShutGate {
                fail: self.fail,
                prefill: handoff.prefill.endpoint.id().clone(),
                decode: handoff.decode.endpoint.id().clone(),
            }));
        }
        Ok(found)
    }
}

/// The one report an attempt over [`P1`] and [`D1`] with `connector` made, its request
/// having failed 502 `prefill_failed` before any answer.
async fn failed_report(connector: FailsAt) -> Report {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer());
    fake.on(D1, CHAT, Reply::sse().frame(ms(0), DONE));
    let (orch, heard) = heard(&fake, &[P1], connector, |_| {});
    let e = serve(&orch, chat(&orch)).await.unwrap_err();
    assert_error(&e, 502, "prefill_failed");
    assert!(fake.calls_to(D1).is_empty(), "no decode leg was sent");
    let reports = heard.reports();
    let [r] = &reports[..] else {
        panic!("one report: {reports:?}")
    };
    assert_settled(&orch);
    r.clone()
}

/// The one report of a streamed attempt over [`P1`] and [`D1`] whose plan has a lead
/// and whose gate, waited for in the client's stream after the lead, fails with what
/// `fail` makes of the route's engines: the stream ends with the handoff's error event
/// (`prefill_failed`), and no decode leg is sent.
async fn lead_report(fail: Fails) -> Report {
    let fake = Fake::new();
    fake.on(P1, CHAT, prefill_answer());
    let connector = FailsAt {
        step: Step::Lead,
        fail,
    };
    let (orch, heard) = heard(&fake, &[P1], connector, |_| {});
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    assert_eq!(data(&mut body).await, event(0), "the lead");
    let frame = data(&mut body).await;
    assert_eq!(error_event(&frame)["code"], "prefill_failed", "{frame}");
    drop(body);
    assert!(fake.calls_to(D1).is_empty(), "no decode leg was sent");
    let reports = heard.reports();
    let [r] = &reports[..] else {
        panic!("one report: {reports:?}")
    };
    assert_settled(&orch);
    r.clone()
}

/// A handoff that fails for what is not the prefill engine's fault (an endpoint that
/// lacks the connector's configuration, a value the connector could not encode, KV
/// that will not be ready for reasons of the proxy's own, a call on the other leg's
/// engine that failed) fails the attempt on the prefill side without blaming the
/// prefill, so passive health and a breaker do not count it against a healthy engine:
/// its leg is reported not sent when the plan failed before it (its build, its
/// resolution), and abandoned when the gate failed after its answer (its KV computed
/// and left behind: neither a failure of its engine nor a success).
#[tokio::test(start_paused = true)]
async fn a_handoff_failing_through_no_fault_of_the_prefill_does_not_blame_it() {
    let cases: [(&str, Step, Fails, bool); 6] = [
        (
            "decode not configured",
            Step::Prepare,
            |_, decode| ConnectorError::NotConfigured {
                endpoint: decode.clone(),
                what: "receiver ports",
            },
            false,
        ),
        (
            "unencodable value",
            Step::Prepare,
            |_, _| ConnectorError::Encode {
                field: "bootstrap_host",
                source: serde_json::from_str::<u8>("x").unwrap_err(),
            },
            false,
        ),
        (
            "declared TP sizes disagree",
            Step::Prepare,
            |_, decode| ConnectorError::NotReady {
                reason: format!("decode endpoint {decode}: declared tp_size 2, 1 rank"),
            },
            false,
        ),
        (
            "no room to register for the KV",
            Step::Resolve,
            |_, _| ConnectorError::NotReady {
                reason: "the notification registry is full".into(),
            },
            false,
        ),
        (
            "a call on the decode's engine",
            Step::Resolve,
            |_, decode| ConnectorError::Engine {
                endpoint: decode.clone(),
                what: "/tokenize",
                source: "connection refused".into(),
            },
            false,
        ),
        (
            "the notification listener closed",
            Step::Gate,
            |_, _| ConnectorError::NotReady {
                reason: "notification listener closed".into(),
            },
            true,
        ),
    ];
    for (what, step, fail, prefilled) in cases {
        let r = failed_report(FailsAt { step, fail }).await;
        let prefill = if prefilled {
            LegOutcome::Abandoned
        } else {
            LegOutcome::NotSent
        };
        assert_eq!(
            (r.outcome, r.prefill, r.decode),
            (Outcome::PrefillFailed, prefill, LegOutcome::NotSent),
            "{what}"
        );
        assert_eq!(r.timeline.prefill_sent.is_some(), prefilled, "{what}");
    }

    // The gate waited for in the client's stream, after the plan's lead: the stream
    // ends with the handoff's error, and the prefill, which answered, is not blamed
    // (whether the error names no engine or the decode's): its KV was left behind. The
    // decode leg, never sent, is not sent.
    let cases: [(&str, Fails); 2] = [
        ("the notification listener closed", |_, _| {
            ConnectorError::NotReady {
                reason: "notification listener closed".into(),
            }
        }),
        (
            "a handoff the decode's engine found malformed",
            |_, decode| ConnectorError::InvalidHandoff {
                endpoint: decode.clone(),
                field: "kv_transfer_params",
            },
        ),
    ];
    for (what, fail) in cases {
        let r = lead_report(fail).await;
        assert_eq!(
            (r.outcome, r.prefill, r.decode),
            (
                Outcome::PrefillFailed,
                LegOutcome::Abandoned,
                LegOutcome::NotSent
            ),
            "{what}"
        );
    }
}

/// A handoff that fails for the prefill engine's fault still blames it: its bootstrap
/// server gave no usable answer, a call on it failed, or its answer carried a handoff
/// the decode cannot use.
#[tokio::test(start_paused = true)]
async fn a_handoff_failing_through_the_prefills_fault_blames_it() {
    let cases: [(&str, Step, Fails); 3] = [
        ("its bootstrap server", Step::Resolve, |prefill, _| {
            ConnectorError::Bootstrap {
                endpoint: prefill.clone(),
                addr: "p1:8998".into(),
                source: "connection refused".into(),
            }
        }),
        ("a call on it", Step::Resolve, |prefill, _| {
            ConnectorError::Engine {
                endpoint: prefill.clone(),
                what: "/tokenize",
                source: "connection refused".into(),
            }
        }),
        (
            "a malformed handoff at the gate",
            Step::Gate,
            |prefill, _| ConnectorError::InvalidHandoff {
                endpoint: prefill.clone(),
                field: "kv_transfer_params",
            },
        ),
    ];
    for (what, step, fail) in cases {
        let r = failed_report(FailsAt { step, fail }).await;
        assert_eq!(
            (r.outcome, r.prefill, r.decode),
            (
                Outcome::PrefillFailed,
                LegOutcome::Failed,
                LegOutcome::NotSent
            ),
            "{what}"
        );
    }

    // The same malformed handoff at the gate waited for in the client's stream, after
    // the plan's lead (the decode leg never sent).
    let r = lead_report(|prefill, _| ConnectorError::InvalidHandoff {
        endpoint: prefill.clone(),
        field: "kv_transfer_params",
    })
    .await;
    assert_eq!(
        (r.outcome, r.prefill, r.decode),
        (
            Outcome::PrefillFailed,
            LegOutcome::Failed,
            LegOutcome::NotSent
        )
    );

    // An answer without the handoff, when a missing handoff fails the request.
    let fake = Fake::new();
    fake.on(
        P1,
        CHAT,
        Reply::json(
            200,
            r#"{"id":"chatcmpl-p","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"A"},"finish_reason":"length"}]}"#,
        ),
    );
    let (orch, heard) = heard(&fake, &[P1], VllmNixl::new(), |c| {
        c.missing_kv = MissingKv::Fail;
    });
    let e = serve(&orch, chat(&orch)).await.unwrap_err();
    assert_error(&e, 502, "prefill_failed");
    let [r] = &heard.reports()[..] else { panic!() };
    assert_eq!(
        (r.outcome, r.prefill, r.decode),
        (
            Outcome::PrefillFailed,
            LegOutcome::Failed,
            LegOutcome::NotSent
        )
    );
}

/// vLLM NIXL's plan, whose resolution picks the prefill's data-parallel rank 1 after
/// routing (as vLLM Mooncake does): the prefill leg goes to `URL@1`, a rank endpoint
/// made by [`proto::dp_rank`](disagg_core::proto::dp_rank), not the routed endpoint.
struct Ranked(VllmNixl);

#[async_trait]
impl KvConnector for Ranked {
    fn name(&self) -> &'static str {
        "nixl-ranked"
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        self.0.prepare(route, req)
    }

    async fn resolve(
        &self,
        handoff: &mut Handoff,
        _transport: &dyn Transport,
    ) -> Result<(), ConnectorError> {
        let rank = disagg_core::proto::dp_rank(&handoff.prefill.endpoint, 1);
        handoff.prefill.endpoint = Arc::new(rank);
        Ok(())
    }

    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<HandoffFound, ConnectorError> {
        self.0.complete(handoff, answer).await
    }
}

/// A prefill leg sent to a rank of the routed prefill's engine (its endpoint swapped by
/// the connector for `URL@1`) whose answer carries no handoff, when a missing handoff
/// fails the request: the error names the rank, and the routed prefill, the same
/// engine, is still blamed.
#[tokio::test(start_paused = true)]
async fn a_missing_handoff_from_a_rank_of_the_prefills_engine_blames_the_prefill() {
    let fake = Fake::new();
    fake.on(
        P1,
        CHAT,
        Reply::json(
            200,
            r#"{"id":"chatcmpl-p","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"A"},"finish_reason":"length"}]}"#,
        ),
    );
    let (orch, heard) = heard(&fake, &[P1], Ranked(VllmNixl::new()), |c| {
        c.missing_kv = MissingKv::Fail;
    });
    let e = serve(&orch, chat(&orch)).await.unwrap_err();
    assert_error(&e, 502, "prefill_failed");
    let chain = disagg_core::error::error_chain(&e);
    assert!(
        chain.contains(&format!("{P1}@1")),
        "the error names the rank: {chain}"
    );
    assert_eq!(fake.calls_to(P1).len(), 1, "the leg went to P1's engine");
    let [r] = &heard.reports()[..] else { panic!() };
    assert_eq!(r.route.prefill.as_ref().unwrap().id().as_str(), P1);
    assert_eq!(
        (r.outcome, r.prefill, r.decode),
        (
            Outcome::PrefillFailed,
            LegOutcome::Failed,
            LegOutcome::NotSent
        )
    );
    assert_settled(&orch);
}

/// vLLM NIXL's plan whose KV gate never opens (nor fails), with a lead (the gate then
/// waited for in the client's stream) or without one (waited for before the response
/// head).
struct GateStalls {
    nixl: VllmNixl,
    lead: bool,
}

/// A gate that never opens.
#[derive(Debug)]
struct Stalled;

#[async_trait]
impl KvGate for Stalled {
    async fn ready(&self) -> Result<(), ConnectorError> {
        std::future::pending().await
    }
}

#[async_trait]
impl KvConnector for GateStalls {
    fn name(&self) -> &'static str {
        "nixl-gate-stalls"
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        self.nixl.prepare(route, req)
    }

    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<HandoffFound, ConnectorError> {
        let found = self.nixl.complete(handoff, answer).await?;
        if self.lead {
            handoff.lead = Some(Bytes::from(event(0)));
        }
        handoff.gate = Some(Arc::new(Stalled));
        Ok(found)
    }
}

/// A client that leaves after the prefill's 200 answer, while the KV gate is still
/// shut, before the decode leg was sent: in a lead stream (the body dropped after the
/// lead) and before the response head (the `serve` future dropped). The attempt is
/// cancelled, its decode leg, never sent, not sent (not abandoned: no decode span, no
/// decode count), and its prefill abandoned, as when the deadline or a continuation's
/// window cuts the handoff: its KV was computed and left behind, never pulled, which is
/// no success of its engine's (an answered leg would be one for passive health).
#[tokio::test(start_paused = true)]
async fn a_client_leaving_before_the_decode_was_sent_leaves_the_answered_prefill_abandoned() {
    for lead in [true, false] {
        let fake = Fake::new();
        fake.on(P1, CHAT, prefill_answer());
        let connector = GateStalls {
            nixl: VllmNixl::new(),
            lead,
        };
        let (orch, heard) = heard(&fake, &[P1], connector, |_| {});
        if lead {
            let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
            assert_eq!(data(&mut body).await, event(0), "the lead");
            drop(body);
        } else {
            assert!(timeout(ms(10), orch.serve(chat(&orch))).await.is_err());
        }
        assert!(fake.calls_to(P1)[0].finished(), "lead {lead}: answered");
        assert!(fake.calls_to(D1).is_empty(), "lead {lead}: no decode leg");
        let reports = heard.reports();
        let [r] = &reports[..] else {
            panic!("lead {lead}: one report: {reports:?}")
        };
        assert!(r.timeline.prefill_done.is_some(), "lead {lead}");
        assert_eq!(r.timeline.decode_sent, None, "lead {lead}");
        assert_eq!(
            (r.outcome, r.prefill, r.decode),
            (
                Outcome::Cancelled,
                LegOutcome::Abandoned,
                LegOutcome::NotSent
            ),
            "lead {lead}"
        );
        assert_eq!(heard.summary().delivery, Delivery::Cancelled, "lead {lead}");
        assert_settled(&orch);
    }
}
