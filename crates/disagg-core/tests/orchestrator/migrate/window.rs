//! A continuation's one window, from the break: what runs out of it blames no engine
//! (its time went on waits the engine had no part in), a continuation that could not
//! start leaves the next one no new window, and a wait for a fresh prefill's room
//! leaves its decode time to go on decode-only.

use disagg_core::error::Overload;

use super::*;

/// [`Placing`], whose places on endpoints of `role` (every one when `None`) wait
/// `room` first (a router that finds no room at once), within the wait's deadline.
struct Roomy {
    placing: Placing,
    room: Duration,
    role: Option<Role>,
}

impl Roomy {
    fn new(room: Duration, role: Option<Role>) -> Self {
        Roomy {
            placing: Placing::new(&Places::default()),
            room,
            role,
        }
    }
}

impl Router for Roomy {
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
            let picked = pick()?;
            if self.role.is_none_or(|r| picked.role() == r) {
                let since = Instant::now();
                let room = since + self.room;
                if let Some(d) = deadline.filter(|d| *d < room) {
                    tokio::time::sleep_until(d).await;
                    let waited = since.elapsed();
                    return Err(PdError::from(Overload::QueueTimeout { waited }));
                }
                tokio::time::sleep_until(room).await;
            }
            self.placing.place(pick, deadline).await
        })
    }
}

/// NIXL over [`P1`] and `decodes`, routed by `router`, decode head timeout 100 ms,
/// continuing up to `limit` times (decode-only when `decode_only`), its reports kept.
fn windowed(
    fake: &Fake,
    decodes: &[&str],
    router: Roomy,
    limit: u32,
    decode_only: bool,
    reports: &Reports,
) -> Orchestrator {
    let mut config = continuing(limit, decode_only);
    config.decode_head_timeout = ms(100);
    over(fake, &[P1], decodes, VllmNixl::new(), config)
        .router(router)
        .listener(reports.clone())
        .build()
}

/// A decode-only continuation waits 95 ms of its 100 for room, and its decode, sent
/// with 5 ms left, gives no head in them: the continuation's window ran out, not the
/// decode's own head timeout, and the decode is not reported failed (passive health
/// would count a healthy engine's failure).
#[tokio::test(start_paused = true)]
async fn a_decode_cut_by_the_continuations_window_is_not_blamed() {
    let fake = Fake::new();
    let reports = Reports::default();
    breaks(&fake).on(D2, COMPLETIONS, Reply::hang());
    let router = Roomy::new(ms(95), None);
    let orch = windowed(&fake, &[D1, D2], router, 1, true, &reports);
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    assert!(ended(&mut body).await.is_some(), "the stream ends in error");
    assert_eq!(fake.calls_to(D2).len(), 1, "the continuation was sent");
    drop(body);
    let all = reports.all();
    assert!(
        !all.iter().any(|r| blamed(r, D2)),
        "D2 is not to blame: {all:?}"
    );
    assert_settled(&orch);
}

/// A continuation through a fresh prefill waits 30 ms for its decode's place and 30 ms
/// for its prefill's, and is cut by its window: while its prefill (slow, not failed)
/// still runs, or while its decode's head is awaited. Neither engine is reported
/// failed.
#[tokio::test(start_paused = true)]
async fn a_fresh_prefill_or_decode_cut_by_the_continuations_window_is_not_blamed() {
    for prefill_takes in [ms(50), ms(0)] {
        let fake = Fake::new();
        let reports = Reports::default();
        continued_once(&fake, prefill_answer().after(prefill_takes), Reply::hang());
        let router = Roomy::new(ms(30), None);
        let orch = windowed(&fake, &[D1, D2], router, 1, false, &reports);
        let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        assert!(ended(&mut body).await.is_some(), "the stream ends in error");
        let fresh = fake.calls_to(P1);
        assert!(
            fresh.iter().any(|c| c.uri.path() == COMPLETIONS),
            "the fresh prefill was sent ({prefill_takes:?})"
        );
        drop(body);
        let all = reports.all();
        assert!(
            !all.iter().any(|r| blamed(r, P1) || blamed(r, D2)),
            "no engine is to blame ({prefill_takes:?}): {all:?}"
        );
        assert_settled(&orch);
    }
}

/// A KV gate that never opens.
#[derive(Debug)]
struct Stalled;

#[async_trait]
impl disagg_core::connector::KvGate for Stalled {
    async fn ready(&self) -> Result<(), ConnectorError> {
        std::future::pending().await
    }
}

/// vLLM NIXL's plan, except that a continuation's KV is never said ready (its gate
/// stays shut, within a handoff budget far longer than the continuation's window).
struct ContinuationGateStalls(VllmNixl);

#[async_trait]
impl KvConnector for ContinuationGateStalls {
    fn name(&self) -> &'static str {
        "nixl-continuation-gate-stalls"
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        self.0.prepare(route, req)
    }

    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<HandoffFound, ConnectorError> {
        let found = self.0.complete(handoff, answer).await?;
        if handoff.prefill.body.get("prompt").is_some() {
            handoff.gate = Some(Arc::new(Stalled));
        }
        Ok(found)
    }
}

/// A continuation's fresh prefill answers, and its handoff (a KV gate that never opens)
/// is cut by the continuation's window before its decode is sent: the prefill's leg is
/// abandoned (its KV computed and left behind, never pulled by a decode), as when the
/// request's deadline cuts a handoff, not answered (passive health would count a
/// success of its engine's), and not failed (its engine is not to blame).
#[tokio::test(start_paused = true)]
async fn a_fresh_prefills_handoff_cut_by_the_continuations_window_leaves_it_abandoned() {
    let fake = Fake::new();
    let reports = Reports::default();
    continued_once(&fake, prefill_answer(), to_the_end("B", 8));
    let mut config = continuing(1, false);
    config.decode_head_timeout = ms(100);
    let connector = ContinuationGateStalls(VllmNixl::new());
    let orch = over(&fake, &[P1], &[D1, D2], connector, config)
        .listener(reports.clone())
        .build();
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    assert!(ended(&mut body).await.is_some(), "the stream ends in error");
    assert!(
        fake.calls_to(P1)
            .iter()
            .any(|c| c.uri.path() == COMPLETIONS),
        "the fresh prefill was sent"
    );
    assert!(
        !fake
            .calls_to(D2)
            .iter()
            .any(|c| c.uri.path() == COMPLETIONS),
        "the continuation's decode was not sent"
    );
    drop(body);
    let all = reports.all();
    let cut: Vec<&Report> = all
        .iter()
        .filter(|r| r.attempt == 1 && r.route.prefill.is_some())
        .collect();
    let [cut] = &cut[..] else {
        panic!("the continuation through P1 reported once: {all:?}")
    };
    assert!(cut.timeline.prefill_done.is_some(), "P1 answered: {cut:?}");
    assert_eq!(
        (cut.outcome, cut.prefill, cut.decode),
        (
            Outcome::PrefillFailed,
            LegOutcome::Abandoned,
            LegOutcome::NotSent
        ),
        "{cut:?}"
    );
    assert_settled(&orch);
}

/// A continuation finds no room for its decode within its window (100 ms): the next
/// continuation has no new window of its own. The client's stream ends one head
/// timeout after the break, not two.
#[tokio::test(start_paused = true)]
async fn a_continuation_that_could_not_start_leaves_the_next_no_new_window() {
    let fake = Fake::new();
    let reports = Reports::default();
    breaks(&fake);
    let router = Roomy::new(ms(1000), Some(Role::Decode));
    let orch = windowed(&fake, &[D1, D2, D3], router, 2, true, &reports);
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    until(&mut body, "\"A\"").await;
    // The stream breaks 5 ms after its last frame was taken.
    let broke = Instant::now() + ms(5);
    let end = ended(&mut body).await;
    assert_eq!(end.map(|t| t - broke), Some(ms(100)));
    drop(body);
    assert_settled(&orch);
}

/// A fresh prefill that finds no room (150 ms to wait, a 100 ms window) does not take
/// the whole window: the continuation goes on decode-only, in time.
#[tokio::test(start_paused = true)]
async fn a_fresh_prefill_without_room_leaves_the_decode_time_to_go_on_alone() {
    let fake = Fake::new();
    let reports = Reports::default();
    breaks(&fake).on(D2, COMPLETIONS, to_the_end("B", 8));
    let router = Roomy::new(ms(150), Some(Role::Prefill));
    let orch = windowed(&fake, &[D1, D2], router, 1, false, &reports);
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    let text = read_to_end(&mut body).await;
    assert!(text.contains("\"B\"") && text.ends_with(DONE), "{text}");
    assert!(
        !fake
            .calls_to(P1)
            .iter()
            .any(|c| c.uri.path() == COMPLETIONS),
        "no fresh prefill"
    );
    let leg = fake
        .calls_to(D2)
        .pop()
        .expect("the continuation's decode leg");
    assert!(
        leg.json().get("kv_transfer_params").is_none(),
        "decode-only"
    );
    drop(body);
    assert_settled(&orch);
}
