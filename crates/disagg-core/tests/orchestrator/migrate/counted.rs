//! A request is counted queued once over all its continuations: a continuation whose
//! wait for room was counted tells the next continuation's place so.

use std::sync::Mutex as StdMutex;

use disagg_core::policy::Admission;

use super::*;

/// An admission that admits every request at once.
struct Open;

impl Admission for Open {
    fn try_admit(&self) -> Option<Permit> {
        Some(Permit::new(()))
    }

    fn admit(&self, _: Option<Instant>) -> BoxFuture<'static, Result<Permit, PdError>> {
        Box::pin(ready(Ok(Permit::new(()))))
    }
}

/// Round robin over the prefills and the decodes, whose every place says it made the
/// request wait (and was counted: [`Route::queued`]); records each place's `queued`.
#[derive(Clone, Default)]
struct Waiting {
    asked: Arc<StdMutex<Vec<bool>>>,
    placing: Arc<Turn>,
}

#[derive(Default)]
struct Turn {
    turn: std::sync::atomic::AtomicUsize,
}

impl Router for Waiting {
    fn select(&self, _: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        let n = self
            .placing
            .turn
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let decodes = set.by_role(Role::Decode);
        let decode = decodes
            .get(n % decodes.len().max(1))
            .cloned()
            .ok_or(RouteError::NoDecode)?;
        Ok(Route::new(
            set.by_role(Role::Prefill).first().cloned(),
            decode,
        ))
    }

    fn place_queued<'a>(
        &'a self,
        pick: &'a (dyn Fn() -> Result<Arc<Endpoint>, PdError> + Send + Sync),
        _deadline: Option<Instant>,
        queued: bool,
    ) -> BoxFuture<'a, Result<Route, PdError>> {
        self.asked.lock().unwrap().push(queued);
        Box::pin(async move {
            let mut route = Route::new(None, pick()?);
            route.queued = true;
            Ok(route)
        })
    }
}

/// The first continuation's place made the request wait (counted then); its decode
/// breaks too: the second continuation's place is told the request was counted, so
/// a router counting its waits does not count it again.
#[tokio::test(start_paused = true)]
async fn a_continuation_after_one_that_waited_is_placed_as_queued() {
    let fake = Fake::new();
    continued_twice(&fake, then_breaks("B", 8));
    let router = Waiting::default();
    let config = continuing(2, true);
    let orch = over(&fake, &[P1], &[D1, D2, D3], VllmNixl::new(), config)
        .router(router.clone())
        .admission(Open)
        .build();
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    let text = read_to_end(&mut body).await;
    assert!(text.contains("\"B\"") && text.contains("\"C\""), "{text}");
    assert_eq!(*router.asked.lock().unwrap(), [false, true]);
    drop(body);
    assert_settled(&orch);
}

/// Records each place's `queued`; the first place made the request wait (counted
/// then), then found no decode, and its error says it counted the request
/// ([`PdError::with_queued`]); the others place at once.
#[derive(Clone, Default)]
struct WaitedThenFailed {
    asked: Arc<StdMutex<Vec<bool>>>,
}

impl Router for WaitedThenFailed {
    fn select(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        Waiting::default().select(req, set)
    }

    fn place_queued<'a>(
        &'a self,
        pick: &'a (dyn Fn() -> Result<Arc<Endpoint>, PdError> + Send + Sync),
        _deadline: Option<Instant>,
        queued: bool,
    ) -> BoxFuture<'a, Result<Route, PdError>> {
        let first = {
            let mut asked = self.asked.lock().unwrap();
            asked.push(queued);
            asked.len() == 1
        };
        Box::pin(async move {
            if first {
                return Err(PdError::from(RouteError::NoDecode).with_queued(true));
            }
            Ok(Route::new(None, pick()?))
        })
    }
}

/// The first continuation's place made the request wait (counted then), then failed:
/// the continuation did not start, and the next one's place is told the request was
/// counted. Before, only a place that ran out of time (`queue_timeout`) was taken to
/// have counted it, and a router counting its waits counted it again.
#[tokio::test(start_paused = true)]
async fn a_continuation_after_a_place_that_waited_then_failed_is_placed_as_queued() {
    let fake = Fake::new();
    continued_once(&fake, prefill_answer(), to_the_end("B", 8));
    let router = WaitedThenFailed::default();
    let config = continuing(2, true);
    let orch = over(&fake, &[P1], &[D1, D2], VllmNixl::new(), config)
        .router(router.clone())
        .admission(Open)
        .build();
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    let text = read_to_end(&mut body).await;
    assert!(text.contains("\"B\""), "{text}");
    assert_eq!(*router.asked.lock().unwrap(), [false, true]);
    drop(body);
    assert_settled(&orch);
}
