//! A continuation's own legs: one end for its waits for room and its head, a router
//! place for its fresh prefill as for any prefill leg, that leg reported when it ends,
//! and a concurrent prefill that fails mid-stream blamed for it (not the decode).

use disagg_core::endpoint::EndpointId;
use disagg_core::error::Overload;
use disagg_resilience::{AdmissionConfig, Limits};

use super::*;

const GENERATE: &str = "/generate";

/// [`Placing`], whose every place waits `room` first (a router that finds no room at
/// once), within the wait's deadline.
struct Slow {
    placing: Placing,
    room: Duration,
}

impl Router for Slow {
    fn select(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        self.placing.select(req, set)
    }

    fn route<'a>(&'a self, ask: Ask<'a>) -> Routing<'a> {
        self.placing.route(ask)
    }

    fn place<'a>(
        &'a self,
        pick: &'a (dyn Fn() -> Result<Arc<Endpoint>, PdError> + Send + Sync),
        deadline: Option<Instant>,
    ) -> BoxFuture<'a, Result<Route, PdError>> {
        Box::pin(async move {
            let since = Instant::now();
            let room = since + self.room;
            if let Some(d) = deadline.filter(|d| *d < room) {
                tokio::time::sleep_until(d).await;
                let waited = since.elapsed();
                return Err(PdError::from(Overload::QueueTimeout { waited }));
            }
            tokio::time::sleep_until(room).await;
            self.placing.place(pick, deadline).await
        })
    }
}

/// A continuation waits for room (40 ms on each place), then its decode's head never
/// comes: the client's stream ends one head timeout (100 ms) after it broke, the waits
/// for room included, not a head timeout after the continuation was sent.
#[tokio::test(start_paused = true)]
async fn a_continuations_waits_for_room_and_its_head_share_one_end() {
    for decode_only in [true, false] {
        let fake = Fake::new();
        continued_once(&fake, prefill_answer(), Reply::hang());
        let mut config = continuing(1, decode_only);
        config.decode_head_timeout = ms(100);
        let router = Slow {
            placing: Placing::new(&Places::default()),
            room: ms(40),
        };
        let orch = over(&fake, &[P1], &[D1, D2], VllmNixl::new(), config)
            .router(router)
            .build();
        let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        until(&mut body, "\"A\"").await;
        // The stream breaks 5 ms after its last frame was taken.
        let broke = Instant::now() + ms(5);
        let ended = ended(&mut body).await;
        assert_eq!(fake.calls_to(D2).len(), 1, "decode-only: {decode_only}");
        assert_eq!(
            ended.map(|t| t - broke),
            Some(ms(100)),
            "decode-only: {decode_only}"
        );
        drop(body);
        assert_settled(&orch);
    }
}

/// Routes to the first prefill and the decode a request's `x-decode` header names (the
/// first decode when it names none).
struct Named;

impl Router for Named {
    fn select(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        let want = req.headers.get("x-decode").and_then(|v| v.to_str().ok());
        let decode = set
            .by_role(Role::Decode)
            .iter()
            .find(|d| want.is_none_or(|w| d.id().as_str() == w))
            .cloned()
            .ok_or(RouteError::NoDecode)?;
        Ok(Route::new(
            set.by_role(Role::Prefill).first().cloned(),
            decode,
        ))
    }
}

/// Under a per-endpoint limit of one, a continuation's fresh prefill waits for room on
/// its prefill as any prefill leg does: another request's prefill holds the one place
/// on P1 until it answers, and only then is the continuation's prefill sent.
#[tokio::test(start_paused = true)]
async fn a_continuations_fresh_prefill_waits_for_room_under_a_per_endpoint_limit() {
    let fake = Fake::new();
    continued_once(&fake, prefill_answer(), to_the_end("B", 8));
    // The other request's prefill: P1's one place, for 100 ms.
    fake.on(P1, CHAT, prefill_answer().after(ms(100)));
    fake.on(D3, CHAT, Reply::sse().frame(ms(0), DONE));
    let limits = Limits::new(AdmissionConfig::default());
    let config = continuing(1, false);
    let orch = over(&fake, &[P1], &[D1, D2, D3], VllmNixl::new(), config)
        .router(limits.per_endpoint(Named, 1))
        .build();
    let t0 = Instant::now();
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    let other = orch.clone();
    let other = tokio::spawn(async move {
        let req = chat_with(&other, &[("x-decode", D3)]);
        let body = other.serve(req).await.unwrap().into_body();
        body.collect().await.map(drop).unwrap();
    });
    turns().await;
    assert_eq!(
        fake.calls_to(P1).len(),
        2,
        "the other request's prefill runs"
    );
    let text = read_to_end(&mut body).await;
    assert!(text.contains("\"B\"") && text.ends_with(DONE), "{text}");
    let calls = fake.calls_to(P1);
    let continuation = calls
        .iter()
        .find(|c| c.uri.path() == COMPLETIONS)
        .expect("the continuation's prefill");
    assert_eq!(
        continuation.at - t0,
        ms(100),
        "sent once the other prefill gave its place back"
    );
    within(other).await.unwrap();
    drop(body);
    assert_settled(&orch);
}

/// A continuation's fresh prefill holds a router place on its prefill while its leg
/// runs, as a routed prefill leg does, and gives it back when the leg ends (not when the
/// continuation's stream does).
#[tokio::test(start_paused = true)]
async fn a_continuations_fresh_prefill_holds_a_place_until_its_leg_ends() {
    let fake = Fake::new();
    let places = Places::default();
    let (rest, feed) = Reply::sse().fed();
    continued_once(&fake, prefill_answer().after(ms(10)), rest);
    let orch = migrating(&fake, &places, false);
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    until(&mut body, "\"A\"").await;
    let polled = timeout(ms(8), body.frame()).await;
    assert!(polled.is_err(), "nothing comes while the prefill runs");
    assert_eq!((in_flight(&orch, P1), places.held(P1)), (1, 1));
    feed.send(continued("B", 8, None));
    until(&mut body, "\"B\"").await;
    assert_eq!((in_flight(&orch, P1), places.held(P1)), (0, 0));
    assert_eq!(places.held(D2), 1, "the decode's place, while it streams");
    finish(feed, &mut body).await;
    drop(body);
    assert_settled(&orch);
}

/// A continuation through a fresh prefill that streams: its prefill leg is reported
/// once, as answered, when it answered (the decode leg is the original attempt's
/// report's, told when the client's stream ends).
#[tokio::test(start_paused = true)]
async fn a_continuations_fresh_prefill_leg_is_reported_when_it_answered() {
    let fake = Fake::new();
    let reports = Reports::default();
    let (rest, feed) = Reply::sse().fed();
    continued_once(&fake, prefill_answer().after(ms(10)), rest);
    let orch = listened(&fake, continuing(1, false), reports.clone());
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    until(&mut body, "\"A\"").await;
    feed.send(continued("B", 8, None));
    until(&mut body, "\"B\"").await;
    let sent = fake
        .calls_to(P1)
        .into_iter()
        .find(|c| c.uri.path() == COMPLETIONS)
        .expect("the continuation's prefill")
        .at;
    let fresh = |r: &Report| r.decode == LegOutcome::NotSent;
    let told: Vec<Report> = reports.over(D2).into_iter().filter(fresh).collect();
    let [leg] = &told[..] else {
        panic!("one report of the fresh prefill's leg: {:?}", reports.all())
    };
    assert_eq!(
        leg.route.prefill.as_ref().map(|p| p.id().as_str()),
        Some(P1)
    );
    assert_eq!(
        (leg.outcome, leg.prefill, leg.attempt),
        (Outcome::Success, LegOutcome::Answered, 1)
    );
    let tl = leg.timeline;
    assert_eq!(tl.prefill_sent, Some(sent.into_std()));
    assert_eq!(tl.prefill_done, Some((sent + ms(10)).into_std()));
    finish(feed, &mut body).await;
    drop(body);
    // Then the original attempt's report, against the decode that finished it; the
    // fresh prefill's leg told once.
    let over = reports.over(D2);
    assert_eq!(over.len(), 2, "{over:?}");
    assert_eq!(over.iter().filter(|r| fresh(r)).count(), 1);
    let last = &over[1];
    assert_eq!(
        (last.outcome, last.decode, last.attempt),
        (Outcome::Success, LegOutcome::Answered, 0)
    );
    assert_settled(&orch);
}

/// SGLang's `/generate` with token ids (a migratable request), streamed.
fn generate(orch: &Orchestrator) -> PdRequest {
    let body = r#"{"input_ids":[1,2,3],"sampling_params":{"max_new_tokens":4,"temperature":0},"stream":true}"#;
    orch.request(
        Api::Generate,
        HeaderMap::new(),
        &Bytes::from_static(body.as_bytes()),
    )
    .unwrap()
}

/// A `/generate` event: the text and ids so far (cumulative), unfinished.
fn generated(text: &str, ids: &[u32]) -> String {
    let v = json!({
        "text": text,
        "output_ids": ids,
        "meta_info": {"id": "g-1", "finish_reason": null, "prompt_tokens": 3, "completion_tokens": ids.len()},
    });
    format!("data: {v}\n\n")
}

/// SGLang's prompt and first continuation: P1 answers the prompt's prefill, D1 streams
/// " a" and breaks; the continuation's fresh prefill on P1 answers `fresh`, and its
/// decode on D2 streams " b", then nothing.
fn generate_continued(fake: &Fake, fresh: Reply) -> &Fake {
    fake.on(P1, GENERATE, Reply::json(200, r#"{"id":"p"}"#))
        .on(P1, GENERATE, fresh)
        .on(
            D1,
            GENERATE,
            Reply::sse()
                .frame(ms(0), generated(" a", &[5]))
                .fail(ms(5), "reset"),
        )
        .on(
            D2,
            GENERATE,
            Reply::sse().frame(ms(0), generated(" b", &[6])).stall(),
        )
}

/// A `/generate` decode that streams " c d" to the end.
fn generated_to_the_end() -> Reply {
    Reply::sse()
        .frame(ms(0), generated(" c d", &[7, 8]))
        .frame(ms(0), DONE)
}

/// SGLang (both legs at once): the first continuation's decode streams while its fresh
/// prefill, still running, fails. The stream moves on again (a second continuation, on a
/// decode not tried yet, through another prefill), and the failure is the prefill's:
/// reported failed on its leg, the decode not blamed.
#[tokio::test(start_paused = true)]
async fn a_continuations_concurrent_prefill_that_fails_is_blamed_not_its_decode() {
    let fake = Fake::new();
    let reports = Reports::default();
    // The first continuation streams one token, then nothing until its prefill fails.
    generate_continued(&fake, engine_error(503, "KV transfer failed").after(ms(20)));
    // The second continuation's prefill: not P1, which failed.
    fake.on(P2, GENERATE, Reply::json(200, r#"{"id":"p"}"#));
    fake.on(D3, GENERATE, generated_to_the_end());
    let connector = SglangBootstrap::with_rooms(Rooms::from_seed(7));
    let config = continuing(2, false);
    let orch = over(&fake, &[P1, P2], &[D1, D2, D3], connector, config)
        .router(Named)
        .listener(reports.clone())
        .build();
    let mut body = serve(&orch, generate(&orch)).await.unwrap().into_body();
    let text = read_to_end(&mut body).await;
    assert!(text.contains(" a b c d") && text.ends_with(DONE), "{text}");
    assert_eq!(fake.calls_to(D3).len(), 1, "continued twice");
    let all = reports.all();
    assert!(
        !all.iter().any(|r| blamed(r, D2)),
        "the decode is not to blame: {all:?}"
    );
    let failed: Vec<&Report> = all.iter().filter(|r| blamed(r, P1)).collect();
    let [failed] = &failed[..] else {
        panic!("the fresh prefill reported failed once: {all:?}")
    };
    assert_eq!(
        (failed.outcome, failed.route.decode.id().as_str()),
        (Outcome::PrefillFailed, D2)
    );
    // The second continuation's prefill answered: its leg reported too.
    assert!(
        all.iter().any(|r| r.route.decode.id().as_str() == D3
            && r.prefill == LegOutcome::Answered
            && r.decode == LegOutcome::NotSent),
        "{all:?}"
    );
    drop(body);
    assert_settled(&orch);
}

/// SGLang: the first continuation's fresh prefill fails while its decode (D2) streams,
/// and the second continuation cannot start (its decode refuses it, the last the limit
/// allows): the request fails, the attempt's report naming D2, whose stream ended for
/// its prefill. D2 is not blamed (its leg abandoned), nor told failed by any report.
#[tokio::test(start_paused = true)]
async fn a_decode_whose_prefill_failed_is_not_blamed_when_the_next_continuation_fails() {
    let fake = Fake::new();
    let reports = Reports::default();
    generate_continued(&fake, engine_error(503, "KV transfer failed").after(ms(20)));
    fake.on(P2, GENERATE, Reply::json(200, r#"{"id":"p"}"#));
    fake.on(D3, GENERATE, engine_error(503, "busy"));
    let connector = SglangBootstrap::with_rooms(Rooms::from_seed(7));
    let orch = over(
        &fake,
        &[P1, P2],
        &[D1, D2, D3],
        connector,
        continuing(2, false),
    )
    .router(Named)
    .listener(reports.clone())
    .build();
    let mut body = serve(&orch, generate(&orch)).await.unwrap().into_body();
    while let Some(frame) = next(&mut body).await {
        if frame.is_err() {
            break;
        }
    }
    drop(body);
    assert_eq!(fake.calls_to(D3).len(), 1, "the second continuation tried");
    let all = reports.all();
    assert!(
        !all.iter().any(|r| blamed(r, D2)),
        "the decode is not to blame: {all:?}"
    );
    assert!(all.iter().any(|r| blamed(r, D3)), "{all:?}");
    let attempt: Vec<&Report> = all
        .iter()
        .filter(|r| r.attempt == 0 && r.route.decode.id().as_str() == D2)
        .collect();
    let [attempt] = &attempt[..] else {
        panic!("the attempt's report names D2: {all:?}")
    };
    assert_eq!(
        (attempt.outcome, attempt.decode),
        (Outcome::DecodeFailed, LegOutcome::Abandoned)
    );
    assert_settled(&orch);
}

/// SGLang, one continuation allowed: the continuation's fresh prefill, still running
/// while its decode (D2) streams, fails, and no continuation is left. Whether D2's
/// stream was still open or had already ended early (no `[DONE]`, no error event), the
/// client's stream ends with the prefill's error event and the request failed (outcome
/// `error`, `decode_stream_failed`, as any broken stream not continued), its attempt
/// failed on D2, whose leg was cut off (not blamed); the prefill is told failed.
#[tokio::test(start_paused = true)]
async fn a_stream_ended_by_its_riding_prefill_and_not_continued_fails_its_request() {
    for ended_early in [false, true] {
        ended_by_its_riding_prefill(ended_early, false).await;
    }
}

/// As [`a_stream_ended_by_its_riding_prefill_and_not_continued_fails_its_request`], once
/// the continuation's leg went raw: after " b", D2 sends an event longer than the 1 MiB
/// the proxy holds whole (an SSE comment, its end in a frame of its own), which ends
/// tracking (the leg's bytes are relayed as they come, the comment with them). The
/// riding prefill's error event, relayed as it came, still fails the request, the
/// decode not blamed.
#[tokio::test(start_paused = true)]
async fn a_raw_stream_ended_by_its_riding_prefill_and_not_continued_fails_its_request() {
    for ended_early in [false, true] {
        ended_by_its_riding_prefill(ended_early, true).await;
    }
}

/// The body of the two tests above: D2's stream ends early or stalls (`ended_early`),
/// after an event over 1 MiB when `raw`.
async fn ended_by_its_riding_prefill(ended_early: bool, raw: bool) {
    let what = format!("D2's stream ended early: {ended_early}, raw: {raw}");
    let fake = Fake::new();
    let told = super::traced::Told::default();
    let d2 = Reply::sse().frame(ms(0), generated(" b", &[6]));
    // A comment of more than 1 MiB, cut before its end (it then goes raw).
    let long = format!(": {}", "x".repeat(1 << 20));
    let d2 = if raw {
        d2.frame(ms(1), long).frame(ms(1), "\n\n")
    } else {
        d2
    };
    let d2 = if ended_early { d2 } else { d2.stall() };
    fake.on(P1, GENERATE, Reply::json(200, r#"{"id":"p"}"#))
        .on(
            P1,
            GENERATE,
            engine_error(503, "KV transfer failed").after(ms(20)),
        )
        .on(
            D1,
            GENERATE,
            Reply::sse()
                .frame(ms(0), generated(" a", &[5]))
                .fail(ms(5), "reset"),
        )
        .on(D2, GENERATE, d2);
    let connector = SglangBootstrap::with_rooms(Rooms::from_seed(7));
    let orch = over(&fake, &[P1], &[D1, D2], connector, continuing(1, false))
        .listener(told.clone())
        .build();
    let mut body = serve(&orch, generate(&orch)).await.unwrap().into_body();
    let mut text = String::new();
    while let Some(frame) = next(&mut body).await {
        match frame {
            Ok(frame) => text.push_str(&frame),
            Err(_) => break,
        }
    }
    drop(body);
    // A continuation's comment is dropped, unless its leg went raw.
    assert_eq!(text.len() > 1 << 20, raw, "{what}");
    let text = text.replace(&"x".repeat(1 << 20), "<1 MiB>");
    assert!(text.contains(" a b"), "{what}: {text}");
    assert!(
        text.contains("\"error\"") && !text.contains(DONE),
        "{what}: {text}"
    );
    assert_eq!(fake.calls_to(D2).len(), 1, "{what}");
    let summary = told.summary();
    assert_eq!(
        (summary.outcome, summary.error, summary.migrations),
        ("error", Some("decode_stream_failed"), 1),
        "{what}"
    );
    let all = told.reports();
    assert!(
        !all.iter().any(|r| blamed(r, D2)),
        "{what}: the decode is not to blame: {all:?}"
    );
    let attempt: Vec<&Report> = all
        .iter()
        .filter(|r| r.attempt == 0 && r.decode != LegOutcome::NotSent)
        .filter(|r| r.route.decode.id().as_str() == D2)
        .collect();
    let [attempt] = &attempt[..] else {
        panic!("{what}: the attempt's report names D2: {all:?}")
    };
    assert_eq!(
        (attempt.outcome, attempt.decode),
        (Outcome::DecodeFailed, LegOutcome::Abandoned),
        "{what}"
    );
    let fresh: Vec<&Report> = all.iter().filter(|r| fresh_leg(r, D2)).collect();
    let [fresh] = &fresh[..] else {
        panic!("{what}: the fresh prefill's leg told once: {all:?}")
    };
    assert_eq!(
        (fresh.outcome, fresh.prefill),
        (Outcome::PrefillFailed, LegOutcome::Failed),
        "{what}"
    );
    assert_settled(&orch);
}

/// SGLang: the client leaves while a continuation streams and its fresh prefill still
/// runs. The prefill's leg is reported once, abandoned (no engine to blame).
#[tokio::test(start_paused = true)]
async fn a_continuations_concurrent_prefill_cut_off_by_the_client_is_reported_abandoned() {
    let fake = Fake::new();
    let reports = Reports::default();
    generate_continued(&fake, Reply::hang());
    let connector = SglangBootstrap::with_rooms(Rooms::from_seed(7));
    let orch = over(&fake, &[P1], &[D1, D2], connector, continuing(1, false))
        .listener(reports.clone())
        .build();
    let mut body = serve(&orch, generate(&orch)).await.unwrap().into_body();
    until(&mut body, " a b").await;
    let fresh = |r: &Report| fresh_leg(r, D2);
    assert!(!reports.all().iter().any(fresh), "told before it ended");
    drop(body);
    let all = reports.all();
    let told: Vec<&Report> = all.iter().filter(|r| fresh(r)).collect();
    let [leg] = &told[..] else {
        panic!("the fresh prefill's leg told once: {all:?}")
    };
    assert_eq!(
        (leg.outcome, leg.prefill),
        (Outcome::Cancelled, LegOutcome::Abandoned)
    );
    assert_settled(&orch);
}

/// A continuation's fresh prefill that refuses its leg (a 4xx: the continuation's token
/// prompt, say, one token past the model's length) is reported as a refused prefill leg
/// is (answered, the attempt a refusal: no failure of the engine's), and the
/// continuation goes on decode-only.
#[tokio::test(start_paused = true)]
async fn a_continuations_fresh_prefill_that_refuses_is_reported_then_goes_decode_only() {
    let fake = Fake::new();
    let reports = Reports::default();
    let refusal = engine_error(400, "prompt too long");
    continued_once(&fake, refusal, to_the_end("B", 8));
    let orch = listened(&fake, continuing(1, false), reports.clone());
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    let text = read_to_end(&mut body).await;
    assert!(text.contains("\"B\"") && text.ends_with(DONE), "{text}");
    let leg = fake
        .calls_to(D2)
        .pop()
        .expect("the continuation's decode leg");
    assert!(
        leg.json().get("kv_transfer_params").is_none(),
        "decode-only: {}",
        leg.text()
    );
    drop(body);
    let all = reports.all();
    let fresh: Vec<&Report> = all.iter().filter(|r| fresh_leg(r, D2)).collect();
    let [refused] = &fresh[..] else {
        panic!("the fresh prefill's leg told once: {all:?}")
    };
    assert_eq!(
        (refused.outcome, refused.prefill, refused.attempt),
        (Outcome::PrefillRefused, LegOutcome::Answered, 1)
    );
    assert_settled(&orch);
}

/// SGLang: the first continuation's fresh prefill (on P1, the prompt's) fails while its
/// decode (D2) streams. The decode is not to blame, and stays a candidate; the prefill
/// that failed is not picked again. With D1 and D2 only, the second continuation goes
/// on D2 through P2, and the request is served.
#[tokio::test(start_paused = true)]
async fn after_a_concurrent_prefill_fails_its_decode_stays_and_another_prefill_is_picked() {
    let fake = Fake::new();
    generate_continued(&fake, engine_error(503, "KV transfer failed").after(ms(20)));
    fake.on(P2, GENERATE, Reply::json(200, r#"{"id":"p"}"#));
    fake.on(D2, GENERATE, generated_to_the_end());
    let connector = SglangBootstrap::with_rooms(Rooms::from_seed(7));
    let orch = over(&fake, &[P1, P2], &[D1, D2], connector, continuing(2, false))
        .router(Named)
        .build();
    let mut body = serve(&orch, generate(&orch)).await.unwrap().into_body();
    let text = read_to_end(&mut body).await;
    assert!(text.contains(" a b c d") && text.ends_with(DONE), "{text}");
    assert_eq!(fake.calls_to(D2).len(), 2, "both continuations on D2");
    assert_eq!(fake.calls_to(P1).len(), 2, "P1 not picked again");
    assert_eq!(
        fake.calls_to(P2).len(),
        1,
        "the second continuation's prefill"
    );
    drop(body);
    assert_settled(&orch);
}

/// SGLang: the first continuation's fresh prefill (on P1, the prompt's) refuses its leg
/// (a 4xx) while its decode (D2) streams: the stream ends for the prefill (the decode is
/// not blamed, and stays a candidate), but the refusal is the request's fault, not the
/// engine's (its leg is reported answered): P1 is not shut out, and the second
/// continuation goes on D2 through P1 again.
#[tokio::test(start_paused = true)]
async fn after_a_concurrent_prefill_refuses_mid_stream_it_may_be_picked_again() {
    let fake = Fake::new();
    let reports = Reports::default();
    generate_continued(&fake, engine_error(400, "prompt too long").after(ms(20)));
    fake.on(P1, GENERATE, Reply::json(200, r#"{"id":"p"}"#));
    // Were P1 shut out, P2 would answer: only the count tells.
    fake.on(P2, GENERATE, Reply::json(200, r#"{"id":"p"}"#));
    fake.on(D2, GENERATE, generated_to_the_end());
    let connector = SglangBootstrap::with_rooms(Rooms::from_seed(7));
    let orch = over(&fake, &[P1, P2], &[D1, D2], connector, continuing(2, false))
        .router(Named)
        .listener(reports.clone())
        .build();
    let mut body = serve(&orch, generate(&orch)).await.unwrap().into_body();
    let text = read_to_end(&mut body).await;
    assert!(text.contains(" a b c d") && text.ends_with(DONE), "{text}");
    assert_eq!(fake.calls_to(D2).len(), 2, "both continuations on D2");
    assert_eq!(fake.calls_to(P1).len(), 3, "P1 picked again");
    assert_eq!(fake.calls_to(P2).len(), 0, "P2 not needed");
    drop(body);
    let all = reports.all();
    assert!(!all.iter().any(|r| blamed(r, D2)), "{all:?}");
    let refused: Vec<&Report> = all
        .iter()
        .filter(|r| fresh_leg(r, D2) && r.outcome == Outcome::PrefillRefused)
        .collect();
    let [refused] = &refused[..] else {
        panic!("the refusing prefill's leg told once: {all:?}")
    };
    assert_eq!(refused.prefill, LegOutcome::Answered);
    assert_settled(&orch);
}

/// A traced request's continuation through a fresh prefill: the prefill's leg report
/// carries the request's trace (its OTel leg span is drawn from it), as the attempt's
/// report of a fresh prefill that failed does.
#[tokio::test(start_paused = true)]
async fn a_traced_continuations_fresh_prefill_leg_report_carries_the_trace() {
    let fake = Fake::new();
    let reports = Reports::default();
    continued_once(&fake, prefill_answer(), to_the_end("B", 8));
    let mut config = continuing(1, false);
    config.trace_ratio = Some(1.0);
    let orch = listened(&fake, config, reports.clone());
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    read_to_end(&mut body).await;
    drop(body);
    let all = reports.all();
    // The original attempt's report, told when the client's stream ended.
    let first = all.last().expect("the attempt's report");
    assert_eq!((first.attempt, first.outcome), (0, Outcome::Success));
    let trace_id = first.trace.as_ref().expect("traced").trace_id;
    let fresh: Vec<&Report> = all.iter().filter(|r| fresh_leg(r, D2)).collect();
    let [leg] = &fresh[..] else {
        panic!("the fresh prefill's leg told once: {all:?}")
    };
    let trace = leg
        .trace
        .as_ref()
        .expect("the fresh prefill's leg is traced");
    assert_eq!(trace.trace_id, trace_id);
    assert_settled(&orch);
}

/// The first continuation's fresh prefill (on P1, the prompt's) fails before its decode
/// starts: the continuation goes decode-only on D2 (which streams, then breaks, or
/// refuses it), and the prefill is not picked again for the request, as one that failed
/// riding in a continuation's stream is not: the second continuation goes on D3 through
/// P2.
#[tokio::test(start_paused = true)]
async fn a_fresh_prefill_that_failed_before_its_decode_started_is_not_picked_again() {
    for decode_refuses in [false, true] {
        let fake = Fake::new();
        let first = if decode_refuses {
            engine_error(503, "busy")
        } else {
            then_breaks("B", 8)
        };
        continued_twice(&fake, first);
        fake.on(P1, COMPLETIONS, engine_error(503, "KV cache full"));
        // Were P1 picked again, it would answer: only the count tells.
        fake.on(P1, COMPLETIONS, prefill_answer());
        fake.on(P2, COMPLETIONS, prefill_answer());
        let config = continuing(2, false);
        let orch = over(&fake, &[P1, P2], &[D1, D2, D3], VllmNixl::new(), config)
            .router(Named)
            .build();
        let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        let text = read_to_end(&mut body).await;
        assert!(
            text.contains("\"C\"") && text.ends_with(DONE),
            "decode refuses: {decode_refuses}: {text}"
        );
        let d2 = fake.calls_to(D2);
        assert_eq!(d2.len(), 1, "decode refuses: {decode_refuses}");
        assert!(
            d2[0].json().get("kv_transfer_params").is_none(),
            "the first continuation went decode-only: {}",
            d2[0].text()
        );
        assert_eq!(
            fake.calls_to(P1).len(),
            2,
            "P1 not picked again (decode refuses: {decode_refuses})"
        );
        assert_eq!(
            fake.calls_to(P2).len(),
            1,
            "the second continuation's prefill (decode refuses: {decode_refuses})"
        );
        assert_eq!(fake.calls_to(D3).len(), 1);
        drop(body);
        assert_settled(&orch);
    }
}

/// vLLM NIXL's plan, except that the connector's own build of a continuation's plan
/// (`prepare`, which contacts no engine) fails for the decode D2: it lacks what the
/// connector needs (as an LMCache decode without receiver ports does).
struct NoPlanForD2(VllmNixl);

#[async_trait]
impl KvConnector for NoPlanForD2 {
    fn name(&self) -> &'static str {
        "nixl-no-plan-for-d2"
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        if req.api() == Api::Completions && route.decode.id().as_str() == D2 {
            return Err(ConnectorError::NotConfigured {
                endpoint: route.decode.id().clone(),
                what: "receiver ports",
            });
        }
        self.0.prepare(route, req)
    }

    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<HandoffFound, ConnectorError> {
        self.0.complete(handoff, answer).await
    }
}

/// Two breaks over P1 (the only prefill) and D1, D2, D3, routed by [`Named`], with
/// `connector`: the first continuation's decode, D2, streams "B" and breaks, the
/// second's, D3, streams "C" to the end. The client gets both, the first continuation
/// went decode-only and the second carries a prefill's handoff; the continuations'
/// prefill legs on P1 are given back.
async fn continued_twice_over_one_prefill(
    fake: &Fake,
    connector: impl KvConnector,
) -> Vec<fake::Call> {
    continued_twice(fake, then_breaks("B", 8));
    let orch = over(fake, &[P1], &[D1, D2, D3], connector, continuing(2, false))
        .router(Named)
        .build();
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    let text = read_to_end(&mut body).await;
    assert!(
        text.contains("\"B\"") && text.contains("\"C\"") && text.ends_with(DONE),
        "{text}"
    );
    let d2 = fake.calls_to(D2);
    let [d2] = &d2[..] else {
        panic!("the first continuation on D2: {n}", n = d2.len())
    };
    assert!(
        d2.json().get("kv_transfer_params").is_none(),
        "the first continuation went decode-only: {}",
        d2.text()
    );
    let d3 = fake.calls_to(D3);
    let [d3] = &d3[..] else {
        panic!("the second continuation on D3: {n}", n = d3.len())
    };
    assert!(
        d3.json().get("kv_transfer_params").is_some(),
        "the second continuation carries P1's handoff: {}",
        d3.text()
    );
    drop(body);
    assert_settled(&orch);
    fake.calls_to(P1)
        .into_iter()
        .filter(|c| c.uri.path() == COMPLETIONS)
        .collect()
}

/// The first continuation's plan through P1 (the prompt's prefill, the only one) fails
/// in the connector's own build, for its decode D2: no leg is sent, and P1 is not at
/// fault. The continuation goes decode-only on D2, which streams a chunk and breaks;
/// the second continuation goes on D3 through P1 again, with the prefill's handoff.
#[tokio::test(start_paused = true)]
async fn a_fresh_prefill_whose_plan_the_connector_could_not_build_is_picked_again() {
    let fake = Fake::new();
    fake.on(P1, COMPLETIONS, prefill_answer());
    let p1 = continued_twice_over_one_prefill(&fake, NoPlanForD2(VllmNixl::new())).await;
    assert_eq!(p1.len(), 1, "the second continuation went through P1");
}

/// vLLM NIXL's plan, except that the first continuation's KV never becomes ready for
/// reasons of the proxy's own (its gate fails, after the fresh prefill answered).
struct FirstGateShut {
    nixl: VllmNixl,
    shut: std::sync::atomic::AtomicBool,
}

/// A gate that fails: the notification listener closed.
#[derive(Debug)]
struct Closed;

#[async_trait]
impl disagg_core::connector::KvGate for Closed {
    async fn ready(&self) -> Result<(), ConnectorError> {
        Err(ConnectorError::NotReady {
            reason: "notification listener closed".into(),
        })
    }
}

#[async_trait]
impl KvConnector for FirstGateShut {
    fn name(&self) -> &'static str {
        "nixl-first-gate-shut"
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
        let continuation = handoff.prefill.body.get("prompt").is_some();
        if continuation && !self.shut.swap(true, std::sync::atomic::Ordering::Relaxed) {
            handoff.gate = Some(Arc::new(Closed));
        }
        Ok(found)
    }
}

/// The first continuation's fresh prefill (P1, the only one) answers, and its KV never
/// becomes ready for reasons of the proxy's own (the gate fails: not the engine's
/// fault, and its leg's report does not blame it): the continuation goes decode-only
/// on D2 (which streams a chunk and breaks), and the second continuation goes on D3
/// through P1 again, with the prefill's handoff.
#[tokio::test(start_paused = true)]
async fn a_fresh_prefill_whose_kv_the_proxy_could_not_wait_for_is_picked_again() {
    let fake = Fake::new();
    fake.on(P1, COMPLETIONS, prefill_answer());
    fake.on(P1, COMPLETIONS, prefill_answer());
    let connector = FirstGateShut {
        nixl: VllmNixl::new(),
        shut: std::sync::atomic::AtomicBool::new(false),
    };
    let p1 = continued_twice_over_one_prefill(&fake, connector).await;
    assert_eq!(p1.len(), 2, "the second continuation went through P1 again");
}

/// The error a resolution fails with, made of the prefill's id; `None`: it never ends
/// (the handoff budget runs out, as when Mooncake's bootstrap server or LMCache's
/// `/tokenize` hangs).
type Failing = fn(EndpointId) -> Option<ConnectorError>;

/// vLLM NIXL's plan, except that resolving a continuation's plan (a token prompt) on
/// P1 fails with what `fail` makes of P1's id, or never ends; counts those resolutions.
struct UnresolvedOnP1 {
    nixl: VllmNixl,
    fail: Failing,
    tried: Arc<std::sync::atomic::AtomicUsize>,
}

#[async_trait]
impl KvConnector for UnresolvedOnP1 {
    fn name(&self) -> &'static str {
        "nixl-unresolved-on-p1"
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        self.nixl.prepare(route, req)
    }

    async fn resolve(
        &self,
        handoff: &mut Handoff,
        _transport: &dyn Transport,
    ) -> Result<(), ConnectorError> {
        let prefill = handoff.prefill.endpoint.id();
        if prefill.as_str() == P1 && handoff.prefill.body.get("prompt").is_some() {
            self.tried
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return match (self.fail)(prefill.clone()) {
                Some(e) => Err(e),
                None => std::future::pending().await,
            };
        }
        Ok(())
    }

    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<HandoffFound, ConnectorError> {
        self.nixl.complete(handoff, answer).await
    }
}

/// The first continuation's plan through P1 (the prompt's prefill) cannot be resolved
/// (before any leg is sent): when what failed is P1's engine (its bootstrap server gave
/// no usable answer, a call on it failed, or the resolution ran out of the handoff
/// budget: its leg is reported failed), P1 is not picked again for the request, as a
/// prefill whose leg failed is not, and the second continuation goes through P2; when
/// it is the connector's own (no engine named), or an engine's other than P1's (a call
/// on the continuation's decode, D2, failed), P1 may be picked again. Either way the
/// shut-out is what the prefill leg's report says (failed or not). The first
/// continuation goes decode-only on D2, which streams a chunk and breaks; the second
/// goes on D3.
#[tokio::test(start_paused = true)]
async fn a_fresh_prefill_whose_engine_failed_the_plans_resolution_is_not_picked_again() {
    let cases: [(&str, Failing, bool); 5] = [
        (
            "bootstrap",
            |endpoint| {
                Some(ConnectorError::Bootstrap {
                    endpoint,
                    addr: "p1:8998".into(),
                    source: "connection refused".into(),
                })
            },
            true,
        ),
        (
            "engine call",
            |endpoint| {
                Some(ConnectorError::Engine {
                    endpoint,
                    what: "/tokenize",
                    source: "connection refused".into(),
                })
            },
            true,
        ),
        ("out of the handoff budget", |_| None, true),
        (
            "connector's own",
            |_| {
                Some(ConnectorError::NotReady {
                    reason: "no room for the notification".into(),
                })
            },
            false,
        ),
        (
            "another engine's call",
            |_| {
                Some(ConnectorError::Engine {
                    endpoint: EndpointId::from(D2),
                    what: "/tokenize",
                    source: "connection refused".into(),
                })
            },
            false,
        ),
    ];
    for (what, fail, excluded) in cases {
        let fake = Fake::new();
        let reports = Reports::default();
        continued_twice(&fake, then_breaks("B", 8));
        fake.on(P1, COMPLETIONS, prefill_answer());
        fake.on(P2, COMPLETIONS, prefill_answer());
        let tried = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let connector = UnresolvedOnP1 {
            nixl: VllmNixl::new(),
            fail,
            tried: Arc::clone(&tried),
        };
        let mut config = continuing(2, false);
        config.handoff_timeout = ms(50);
        let orch = over(&fake, &[P1, P2], &[D1, D2, D3], connector, config)
            .router(Named)
            .listener(reports.clone())
            .build();
        let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        let text = read_to_end(&mut body).await;
        assert!(
            text.contains("\"C\"") && text.ends_with(DONE),
            "{what}: {text}"
        );
        // The first continuation's attempt through P1, reported when it failed.
        let all = reports.all();
        let unresolved: Vec<&Report> = all
            .iter()
            .filter(|r| r.attempt == 1 && r.outcome == Outcome::PrefillFailed)
            .collect();
        let [unresolved] = &unresolved[..] else {
            panic!("{what}: the unresolved continuation reported once: {all:?}")
        };
        assert_eq!(
            unresolved.prefill == LegOutcome::Failed,
            excluded,
            "{what}: its prefill leg blamed as it is shut out: {unresolved:?}"
        );
        let d2 = fake.calls_to(D2);
        let [d2] = &d2[..] else {
            panic!("{what}: the first continuation on D2")
        };
        assert!(
            d2.json().get("kv_transfer_params").is_none(),
            "{what}: the first continuation went decode-only: {}",
            d2.text()
        );
        let resolved = tried.load(std::sync::atomic::Ordering::Relaxed);
        let p2 = fake.calls_to(P2).len();
        let expected = if excluded { (1, 1) } else { (2, 0) };
        assert_eq!(
            (resolved, p2),
            expected,
            "{what}: P1's resolutions, P2's prefill legs"
        );
        let d3 = fake.calls_to(D3);
        let [d3] = &d3[..] else {
            panic!("{what}: the second continuation on D3")
        };
        assert_eq!(
            d3.json().get("kv_transfer_params").is_some(),
            excluded,
            "{what}: the second continuation through P2: {}",
            d3.text()
        );
        drop(body);
        assert_settled(&orch);
    }
}

/// The first continuation's fresh prefill (P1, the only one) refuses its leg for now
/// (429, busy): a refusal is the request's or the moment's, not the engine's fault, so
/// the continuation goes decode-only on D2 (which streams a chunk and breaks), and the
/// second continuation goes on D3 through P1 again, with the prefill's handoff.
#[tokio::test(start_paused = true)]
async fn a_fresh_prefill_that_refused_a_continuation_is_picked_again() {
    let fake = Fake::new();
    fake.on(P1, COMPLETIONS, engine_error(429, "busy"));
    fake.on(P1, COMPLETIONS, prefill_answer());
    let p1 = continued_twice_over_one_prefill(&fake, VllmNixl::new()).await;
    assert_eq!(p1.len(), 2, "the second continuation went through P1 again");
}

/// The client's stream read until it ends or fails: what came before.
async fn read_until_it_fails(body: &mut PdBody) -> String {
    let mut text = String::new();
    while let Some(frame) = next(body).await {
        match frame {
            Ok(frame) => text.push_str(&frame),
            Err(_) => break,
        }
    }
    text
}

/// SGLang (both legs at once), one continuation allowed: the continuation's decode (D2)
/// answers 503 before its fresh prefill (P1) answered, and the prefill, still running,
/// is dropped with the attempt. The continuation's report tells that prefill abandoned
/// (it never answered: nothing for passive health to count), not answered, and blames
/// the decode.
#[tokio::test(start_paused = true)]
async fn a_continuations_prefill_dropped_for_its_decodes_error_is_reported_abandoned() {
    let fake = Fake::new();
    let reports = Reports::default();
    fake.on(P1, GENERATE, Reply::json(200, r#"{"id":"p"}"#))
        .on(
            P1,
            GENERATE,
            Reply::json(200, r#"{"id":"p"}"#).after(ms(20)),
        )
        .on(
            D1,
            GENERATE,
            Reply::sse()
                .frame(ms(0), generated(" a", &[5]))
                .fail(ms(5), "reset"),
        )
        .on(D2, GENERATE, engine_error(503, "busy"));
    let connector = SglangBootstrap::with_rooms(Rooms::from_seed(7));
    let orch = over(&fake, &[P1], &[D1, D2], connector, continuing(1, false))
        .listener(reports.clone())
        .build();
    let mut body = serve(&orch, generate(&orch)).await.unwrap().into_body();
    let text = read_until_it_fails(&mut body).await;
    assert!(text.contains(" a") && !text.contains(DONE), "{text}");
    drop(body);
    assert_eq!(fake.calls_to(P1).len(), 2, "the fresh prefill was sent");
    assert_eq!(fake.calls_to(D2).len(), 1, "the continuation's decode");
    let all = reports.all();
    let continuation: Vec<&Report> = all.iter().filter(|r| r.attempt == 1).collect();
    let [c] = &continuation[..] else {
        panic!("the continuation reported once: {all:?}")
    };
    assert_eq!(c.route.decode.id().as_str(), D2);
    assert_eq!(c.timeline.prefill_done, None, "the prefill never answered");
    assert_eq!(
        (c.outcome, c.prefill, c.decode),
        (
            Outcome::DecodeFailed,
            LegOutcome::Abandoned,
            LegOutcome::Failed
        ),
        "{c:?}"
    );
    assert_settled(&orch);
}

/// One continuation allowed, whose decode (D2) refuses it with a 400 (its token prompt
/// past the model's length, say): the refusal is the request's, not the engine's, so
/// no report tells D2 failed, whether the continuation went through a fresh prefill
/// (its attempt's report tells the decode's refusal, its leg answered, as a decode's
/// 4xx is told on any attempt) or decode-only. The client's stream ends as when any
/// continuation fails.
#[tokio::test(start_paused = true)]
async fn a_continuations_decode_that_refuses_it_is_not_blamed() {
    for decode_only in [false, true] {
        let what = format!("decode-only: {decode_only}");
        let fake = Fake::new();
        let reports = Reports::default();
        breaks(&fake).on(D2, COMPLETIONS, engine_error(400, "prompt too long"));
        if !decode_only {
            fake.on(P1, COMPLETIONS, prefill_answer());
        }
        let orch = listened(&fake, continuing(1, decode_only), reports.clone());
        let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        let text = read_until_it_fails(&mut body).await;
        assert!(
            text.contains("\"A\"") && !text.contains(DONE),
            "{what}: {text}"
        );
        drop(body);
        assert_eq!(fake.calls_to(D2).len(), 1, "{what}: the continuation");
        let all = reports.all();
        assert!(
            !all.iter().any(|r| blamed(r, D2)),
            "{what}: the decode is not to blame: {all:?}"
        );
        if !decode_only {
            let continuation: Vec<&Report> = all.iter().filter(|r| r.attempt == 1).collect();
            let [c] = &continuation[..] else {
                panic!("{what}: the continuation reported once: {all:?}")
            };
            assert_eq!(
                (c.route.decode.id().as_str(), c.outcome, c.prefill, c.decode),
                (
                    D2,
                    Outcome::DecodeRefused,
                    LegOutcome::Answered,
                    LegOutcome::Answered
                ),
                "{what}: {c:?}"
            );
        }
        assert_settled(&orch);
    }
}

/// Two continuations allowed: the first's decode (D2) refuses it with a 400 (its token
/// prompt past the model's length, say). A refusal blames no decode, but the
/// continuation did not start: the second goes on to yet another decode (D3, never D2
/// again), through a fresh prefill or decode-only, and the client's stream ends whole.
#[tokio::test(start_paused = true)]
async fn after_a_continuations_decode_refuses_it_the_next_decode_is_tried() {
    for decode_only in [false, true] {
        let what = format!("decode-only: {decode_only}");
        let fake = Fake::new();
        let reports = Reports::default();
        continued_twice(&fake, engine_error(400, "prompt too long"));
        if !decode_only {
            fake.on(P1, COMPLETIONS, prefill_answer());
            fake.on(P1, COMPLETIONS, prefill_answer());
        }
        let config = continuing(2, decode_only);
        let orch = over(&fake, &[P1], &[D1, D2, D3], VllmNixl::new(), config)
            .router(Named)
            .listener(reports.clone())
            .build();
        let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        let text = read_to_end(&mut body).await;
        assert!(
            text.contains("\"A\"") && text.contains("\"C\"") && text.ends_with(DONE),
            "{what}: {text}"
        );
        drop(body);
        assert_eq!(fake.calls_to(D2).len(), 1, "{what}: the first continuation");
        let d3 = fake.calls_to(D3);
        assert_eq!(d3.len(), 1, "{what}: the second continuation");
        assert_eq!(
            d3[0].json().get("kv_transfer_params").is_some(),
            !decode_only,
            "{what}: {}",
            d3[0].text()
        );
        let all = reports.all();
        assert!(
            !all.iter().any(|r| blamed(r, D2)),
            "{what}: the decode that refused is not to blame: {all:?}"
        );
        // The attempt's report names the decode that finished the answer (the one the
        // stream broke on, D1, was told failed by a report of its own).
        let answered: Vec<&Report> = all
            .iter()
            .filter(|r| r.attempt == 0 && r.route.decode.id().as_str() != D1)
            .collect();
        let [answered] = &answered[..] else {
            panic!("{what}: the attempt reported once: {all:?}")
        };
        assert_eq!(
            (answered.outcome, answered.route.decode.id().as_str()),
            (Outcome::Success, D3),
            "{what}: the attempt ended on D3"
        );
        assert_settled(&orch);
    }
}

/// SGLang, two continuations allowed: the first's decode (D2) streams while its fresh
/// prefill, riding in its stream, fails (its leg told failed: the stream ended for it,
/// not for D2); the second's decode (D3) refuses it with a 400. The request's stream
/// broke, and the attempt's report, which names D2 (the decode the answer moved to),
/// tells the attempt failed with D2's leg cut off: neither the refusal of another
/// decode (D3's, told by the continuation's own report) nor an answer of D2's. No decode
/// is blamed.
#[tokio::test(start_paused = true)]
async fn a_decode_refusing_a_continuation_after_a_riding_prefill_failed_is_not_the_attempts() {
    let fake = Fake::new();
    let reports = Reports::default();
    generate_continued(&fake, engine_error(503, "KV transfer failed").after(ms(20)));
    fake.on(P2, GENERATE, Reply::json(200, r#"{"id":"p"}"#));
    fake.on(D3, GENERATE, engine_error(400, "prompt too long"));
    let connector = SglangBootstrap::with_rooms(Rooms::from_seed(7));
    let orch = over(
        &fake,
        &[P1, P2],
        &[D1, D2, D3],
        connector,
        continuing(2, false),
    )
    .router(Named)
    .listener(reports.clone())
    .build();
    let mut body = serve(&orch, generate(&orch)).await.unwrap().into_body();
    let text = read_until_it_fails(&mut body).await;
    assert!(text.contains(" a b") && !text.contains(DONE), "{text}");
    drop(body);
    assert_eq!(fake.calls_to(D3).len(), 1, "the second continuation");
    let all = reports.all();
    assert!(
        !all.iter().any(|r| blamed(r, D2) || blamed(r, D3)),
        "no decode is to blame: {all:?}"
    );
    let refused: Vec<&Report> = all
        .iter()
        .filter(|r| r.route.decode.id().as_str() == D3)
        .collect();
    let [refused] = &refused[..] else {
        panic!("the second continuation reported once: {all:?}")
    };
    assert_eq!(
        (refused.outcome, refused.prefill, refused.decode),
        (
            Outcome::DecodeRefused,
            LegOutcome::Answered,
            LegOutcome::Answered
        )
    );
    let attempt = all.last().expect("the attempt's report");
    assert_eq!(
        (
            attempt.attempt,
            attempt.route.decode.id().as_str(),
            attempt.outcome,
            attempt.decode
        ),
        (0, D2, Outcome::DecodeFailed, LegOutcome::Abandoned),
        "{all:?}"
    );
    assert_settled(&orch);
}
