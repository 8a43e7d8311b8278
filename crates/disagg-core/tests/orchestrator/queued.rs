//! What a router is told of a request's wait for admission: every routing of a
//! request admitted after a wait ([`Admission::admit`] once `try_admit` gave nothing)
//! says it already waited in the queue ([`Ask::queued`], `place_queued`'s `queued`),
//! its retries and a mid-stream migration's continuation included; a request admitted
//! at once says it did not.

use std::sync::Mutex;

use disagg_core::endpoint::EndpointSet;
use disagg_core::error::RouteError;
use disagg_core::policy::{Admission, Permit};
use disagg_core::router::{Ask, RequestView, Router, Routing};
use futures::future::{BoxFuture, ready};

use super::*;

const D2: &str = "http://d2:8200";
const COMPLETIONS: &str = "/v1/completions";

/// An admission that admits every request, at once or, when `wait`, only after
/// [`admit`](Admission::admit) (which does not really wait).
struct Gate {
    wait: bool,
}

impl Admission for Gate {
    fn try_admit(&self) -> Option<Permit> {
        (!self.wait).then(|| Permit::new(()))
    }

    fn admit(&self, _: Option<Instant>) -> BoxFuture<'static, Result<Permit, PdError>> {
        Box::pin(ready(Ok(Permit::new(()))))
    }
}

/// How a router was asked for a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Asked {
    /// [`Router::route`], with [`Ask::queued`].
    Route(bool),
    /// [`Router::place_queued`], with its `queued`.
    Place(bool),
}

/// Round robin over the prefills and the decodes, recording how it was asked.
#[derive(Clone, Default)]
struct Recording {
    asked: Arc<Mutex<Vec<Asked>>>,
    turn: Arc<std::sync::atomic::AtomicUsize>,
}

impl Recording {
    fn asked(&self) -> Vec<Asked> {
        self.asked.lock().unwrap().clone()
    }
}

impl Router for Recording {
    fn select(&self, _: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        let n = self.turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let nth = |role| {
            let eps = set.by_role(role);
            eps.get(n % eps.len().max(1)).cloned()
        };
        let decode = nth(Role::Decode).ok_or(RouteError::NoDecode)?;
        Ok(Route::new(nth(Role::Prefill), decode))
    }

    fn route<'a>(&'a self, ask: Ask<'a>) -> Routing<'a> {
        self.asked.lock().unwrap().push(Asked::Route(ask.queued));
        futures::future::Either::Left(ready(ask.select(self)))
    }

    fn place_queued<'a>(
        &'a self,
        pick: &'a (dyn Fn() -> Result<Arc<Endpoint>, PdError> + Send + Sync),
        _deadline: Option<Instant>,
        queued: bool,
    ) -> BoxFuture<'a, Result<Route, PdError>> {
        self.asked.lock().unwrap().push(Asked::Place(queued));
        Box::pin(async move { Ok(Route::new(None, pick()?)) })
    }
}

/// vLLM NIXL over `prefill` and `decode`, admitted by a [`Gate`] that makes every
/// request wait when `wait`, routed by `router`, retrying once and migrating once
/// (decode-only).
fn gated(
    fake: &Fake,
    prefill: &[&str],
    decode: &[&str],
    wait: bool,
    router: &Recording,
) -> Orchestrator {
    let source = StaticSource::new(endpoints(prefill, decode));
    let mut config = OrchestratorConfig::default();
    config.decode_idle_timeout = None;
    config.migration.limit = 1;
    config.migration.decode_only = true;
    Orchestrator::builder(source, fake.clone(), VllmNixl::new())
        .router(router.clone())
        .admission(Gate { wait })
        .retry(Backoff::new(RetryPolicy::retries(1)))
        .config(config)
        .build()
}

/// The first attempt's prefill answers 503; the retry, on the other prefill, is
/// served. Both routings are told whether the request waited for admission.
#[tokio::test(start_paused = true)]
async fn every_attempt_of_a_request_admitted_after_a_wait_is_routed_as_queued() {
    for wait in [false, true] {
        let fake = Fake::new();
        fake.on(P1, CHAT, engine_error(503, "overloaded"));
        fake.on(P2, CHAT, prefill_answer());
        fake.on(D1, CHAT, Reply::sse().frame(ms(0), DONE));
        let router = Recording::default();
        let orch = gated(&fake, &[P1, P2], &[D1], wait, &router);
        let resp = serve(&orch, chat(&orch)).await.unwrap();
        assert_eq!(orch.stats().retries, 1);
        assert_eq!(
            router.asked(),
            [Asked::Route(wait), Asked::Route(wait)],
            "admitted after a wait: {wait}"
        );
        drop(resp);
        assert_settled(&orch);
    }
}

/// The decode breaks mid-stream: the continuation's place is asked for as the
/// request's routing was, queued when the request waited for admission.
#[tokio::test(start_paused = true)]
async fn a_continuation_of_a_request_admitted_after_a_wait_is_placed_as_queued() {
    let [first, second] = [
        r#"data: {"id":"c-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"token_ids":[]}],"prompt_token_ids":[1,2,3]}"#.to_owned() + "\n\n",
        r#"data: {"id":"c-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"A"},"token_ids":[7]}]}"#.to_owned() + "\n\n",
    ];
    let rest = r#"data: {"id":"cmpl-2","object":"text_completion","created":2,"model":"m","choices":[{"index":0,"text":"B","token_ids":[8],"finish_reason":"length"}]}"#.to_owned() + "\n\n";
    for wait in [false, true] {
        let fake = Fake::new();
        fake.on(P1, CHAT, prefill_answer());
        let dying = Reply::sse()
            .frame(ms(0), first.clone())
            .frame(ms(0), second.clone())
            .fail(ms(5), "reset");
        fake.on(D1, CHAT, dying);
        let continued = Reply::sse().frame(ms(0), rest.clone()).frame(ms(0), DONE);
        fake.on(D2, COMPLETIONS, continued);
        let router = Recording::default();
        let orch = gated(&fake, &[P1], &[D1, D2], wait, &router);
        let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        let mut text = String::new();
        while let Some(frame) = next(&mut body).await {
            text.push_str(&frame.unwrap());
        }
        assert!(text.contains("\"B\""), "continued on D2: {text}");
        assert_eq!(
            router.asked(),
            [Asked::Route(wait), Asked::Place(wait)],
            "admitted after a wait: {wait}"
        );
        drop(body);
        assert_settled(&orch);
    }
}
