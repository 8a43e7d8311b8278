//! What routers' and connectors' `observe` hear when a prefill refuses its leg (a 4xx,
//! the client's fault): [`Outcome::PrefillRefused`], never a success of the route (no
//! decode answered) nor a failure (no engine is to blame), whether the refusal was
//! passed through whole, ended a stream whose decode had begun, or broke on its way to
//! the client; and when the connector refuses the client's request itself, before any
//! leg is sent. A decode that refuses its leg is told [`Outcome::DecodeRefused`] alike.

use disagg_core::connector::Leg;
use disagg_core::endpoint::EndpointSet;
use disagg_core::error::RouteError;
use disagg_core::json::InvalidParam;
use disagg_core::policy::Decision;
use disagg_core::router::{RequestView, Router};

use super::*;

/// Routes to the first prefill and the first decode, recording each attempt's outcome
/// as its `observe` hears it (what a router that learns from outcomes learns).
#[derive(Default)]
struct Observing(Mutex<Vec<Outcome>>);

impl Router for Observing {
    fn select(&self, _: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        let decode = set
            .by_role(Role::Decode)
            .first()
            .cloned()
            .ok_or(RouteError::NoDecode)?;
        Ok(Route::new(
            set.by_role(Role::Prefill).first().cloned(),
            decode,
        ))
    }

    fn observe(&self, _route: &Route, outcome: Outcome) {
        self.0.lock().unwrap().push(outcome);
    }
}

/// The connector `C`, recording each attempt's outcome as its `observe` hears it (what
/// a connector that caches what it learned from an engine reacts to); one that
/// `refuses` cannot carry any request (its `prepare` fails `Unsupported`, as LMCache's
/// for n > 1 or Mooncake's for `/generate`).
struct Told<C> {
    inner: C,
    heard: Arc<Mutex<Vec<Outcome>>>,
    refuses: bool,
}

#[async_trait]
impl<C: KvConnector> KvConnector for Told<C> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn check(&self, req: &PdRequest) -> Result<Decision, InvalidParam> {
        self.inner.check(req)
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        if self.refuses {
            return Err(ConnectorError::Unsupported {
                connector: self.inner.name(),
                what: "this request".into(),
            });
        }
        self.inner.prepare(route, req)
    }

    async fn resolve(
        &self,
        handoff: &mut Handoff,
        transport: &dyn Transport,
    ) -> Result<(), ConnectorError> {
        self.inner.resolve(handoff, transport).await
    }

    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<HandoffFound, ConnectorError> {
        self.inner.complete(handoff, answer).await
    }

    fn observe(&self, route: &Route, outcome: Outcome) {
        self.heard.lock().unwrap().push(outcome);
        self.inner.observe(route, outcome);
    }

    fn release_leg(&self, api: Api, decode: &Leg) -> Option<Bytes> {
        self.inner.release_leg(api, decode)
    }
}

/// How the legs are sent.
#[derive(Debug, Clone, Copy)]
enum Dispatch {
    /// One after the other (vLLM NIXL).
    Sequential,
    /// Both at once (SGLang).
    Concurrent,
}

/// An orchestrator over [`P1`] and [`D1`] sending through `fake` with `dispatch`'s
/// connector, routed by an [`Observing`] router: what the router, the connector and
/// the listener heard.
struct Observed {
    orch: Orchestrator,
    router: Arc<Observing>,
    connector: Arc<Mutex<Vec<Outcome>>>,
    heard: Arc<Heard>,
}

impl Observed {
    fn new(fake: &Fake, dispatch: Dispatch) -> Self {
        Observed::with(fake, dispatch, false)
    }

    /// As [`new`](Self::new), its connector refusing every request in `prepare`.
    fn refusing(fake: &Fake, dispatch: Dispatch) -> Self {
        Observed::with(fake, dispatch, true)
    }

    fn with(fake: &Fake, dispatch: Dispatch, refuses: bool) -> Self {
        let router = Arc::new(Observing::default());
        let connector = Arc::new(Mutex::new(Vec::new()));
        let heard = Arc::new(Heard::default());
        let source = StaticSource::new(endpoints(&[P1], &[D1]));
        let builder = match dispatch {
            Dispatch::Sequential => Orchestrator::builder(
                source,
                fake.clone(),
                Told {
                    inner: VllmNixl::new(),
                    heard: Arc::clone(&connector),
                    refuses,
                },
            ),
            Dispatch::Concurrent => Orchestrator::builder(
                source,
                fake.clone(),
                Told {
                    inner: SglangBootstrap::with_rooms(Rooms::from_seed(7)),
                    heard: Arc::clone(&connector),
                    refuses,
                },
            ),
        };
        let orch = builder
            .router(Arc::clone(&router))
            .listener(Arc::clone(&heard))
            .build();
        Observed {
            orch,
            router,
            connector,
            heard,
        }
    }

    /// The one report told; that the router's and the connector's `observe` heard its
    /// outcome, once.
    fn report(&self, what: &str) -> Report {
        let reports = self.heard.reports();
        let [r] = &reports[..] else {
            panic!("{what}: one report: {reports:?}")
        };
        let router = self.router.0.lock().unwrap().clone();
        let connector = self.connector.lock().unwrap().clone();
        assert_eq!(router, [r.outcome], "{what}: the router heard");
        assert_eq!(connector, [r.outcome], "{what}: the connector heard");
        r.clone()
    }
}

/// A prefill that refuses its leg (a 4xx, the client's fault, passed through whole)
/// ends its attempt as a refusal: no decode answer was delivered, so the router's and
/// the connector's `observe` must not hear a success of the route (one that learns
/// from outcomes would credit a decode that never ran), nor a failure (a connector
/// that forgets what it cached of an engine whose leg failed would forget it for every
/// bad prompt). The prefill's leg answered (its engine worked), the decode's was not
/// sent (one leg after the other) or dropped (both at once); the request is a complete
/// client error.
#[tokio::test(start_paused = true)]
async fn a_prefill_refusal_passed_through_is_told_as_a_refusal() {
    let cases = [
        (Dispatch::Sequential, 0, LegOutcome::NotSent),
        (Dispatch::Concurrent, 1, LegOutcome::Abandoned),
    ];
    for (dispatch, sent, decode) in cases {
        let what = format!("{dispatch:?}");
        let fake = Fake::new();
        fake.on(P1, CHAT, engine_error(400, "prompt too long").after(ms(5)));
        fake.on(D1, CHAT, Reply::sse().after(ms(50)).frame(ms(0), DONE));
        let o = Observed::new(&fake, dispatch);
        let resp = serve(&o.orch, chat(&o.orch)).await.unwrap();
        assert_eq!(
            resp.status(),
            StatusCode::BAD_REQUEST,
            "{what}: passed through"
        );
        let all = within(resp.into_body().collect()).await.unwrap().to_bytes();
        let err: Value = serde_json::from_slice(&all).unwrap();
        assert_eq!(err["error"]["message"], "prompt too long", "{what}: whole");
        assert_settled(&o.orch);
        assert_eq!(fake.calls_to(D1).len(), sent, "{what}: decode legs sent");
        let r = o.report(&what);
        assert_eq!(
            (r.outcome, r.prefill, r.decode),
            (Outcome::PrefillRefused, LegOutcome::Answered, decode),
            "{what}"
        );
        let s = o.heard.summary();
        assert_eq!(
            (s.status, s.delivery, s.outcome, s.attempts),
            (
                StatusCode::BAD_REQUEST,
                Delivery::Complete,
                "client_error",
                1
            ),
            "{what}"
        );
        assert_eq!(o.heard.order(), ["report", "summary"], "{what}");
    }
}

/// Both legs at once (SGLang): the prefill refuses its leg (a 4xx) after the decode's
/// head went out, and the stream ends with the refusal's error event. The attempt is a
/// refusal as when it came before the head: the prefill refused (its leg answered), and
/// the decode, dropped for it, neither answered nor failed.
#[tokio::test(start_paused = true)]
async fn a_prefill_refusing_after_the_decodes_head_is_told_as_a_refusal() {
    let fake = Fake::new();
    fake.on(P1, CHAT, engine_error(400, "prompt too long").after(ms(20)));
    fake.on(D1, CHAT, Reply::sse().frame(ms(50), DONE));
    let o = Observed::new(&fake, Dispatch::Concurrent);
    let resp = serve(&o.orch, chat(&o.orch)).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK, "the decode's head");
    let all = within(resp.into_body().collect()).await.unwrap().to_bytes();
    let err = error_event(std::str::from_utf8(&all).unwrap());
    assert!(
        err["message"].as_str().unwrap().contains("prompt too long"),
        "{err}"
    );
    assert_settled(&o.orch);
    let r = o.report("after the head");
    assert_eq!(
        (r.outcome, r.prefill, r.decode),
        (
            Outcome::PrefillRefused,
            LegOutcome::Answered,
            LegOutcome::Abandoned
        )
    );
    let s = o.heard.summary();
    assert_eq!((s.delivery, s.outcome), (Delivery::Broken, "error"));
}

/// A prefill's refusal (a 4xx) whose body cannot be kept from the client as it is: it
/// holds a handoff key whose value is no JSON, or one still open past the scrubber's
/// 1 MiB (what an engine writes of its own KV never reaches a client). The client's
/// body breaks after the refusal's head, but the decode, never sent (one leg after the
/// other) or dropped before its head (both at once), is not to blame: the attempt stays
/// the prefill's refusal, and the decode's leg is not sent or abandoned, never failed.
#[tokio::test(start_paused = true)]
async fn a_prefill_refusal_whose_body_cannot_be_scrubbed_does_not_blame_the_decode() {
    let open = format!(
        r#"{{"error":{{"message":"prompt too long"}},"kv_transfer_params":"{}"#,
        "x".repeat(1024 * 1024 + 1)
    );
    let unreadable = r#"{"error":{"message":"prompt too long"},"kv_transfer_params":nope}"#;
    let bodies = [("open past 1 MiB", open.as_str()), ("not JSON", unreadable)];
    let dispatches = [
        (Dispatch::Sequential, LegOutcome::NotSent),
        (Dispatch::Concurrent, LegOutcome::Abandoned),
    ];
    for (body, text) in bodies {
        for (dispatch, decode) in dispatches {
            let what = format!("{dispatch:?}, {body}");
            let fake = Fake::new();
            fake.on(P1, CHAT, Reply::json(400, text).after(ms(5)));
            fake.on(D1, CHAT, Reply::sse().after(ms(50)).frame(ms(0), DONE));
            let o = Observed::new(&fake, dispatch);
            let resp = serve(&o.orch, chat(&o.orch)).await.unwrap();
            assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{what}");
            let read = within(resp.into_body().collect()).await;
            assert!(read.is_err(), "{what}: the body broke");
            assert_settled(&o.orch);
            let r = o.report(&what);
            assert_eq!(
                (r.outcome, r.prefill, r.decode),
                (Outcome::PrefillRefused, LegOutcome::Answered, decode),
                "{what}"
            );
            let s = o.heard.summary();
            assert_eq!(
                (s.status, s.delivery),
                (StatusCode::BAD_REQUEST, Delivery::Broken),
                "{what}"
            );
            // The prefill's answer could not be relayed; no decode stream failed.
            assert_eq!(s.error, Some("prefill_failed"), "{what}");
        }
    }
}

/// A prefill's refusal (a 4xx) answered as an event stream whose one event holds a
/// handoff the scrubber cannot read: the client's stream, begun with the refusal's
/// head, ends with an in-band error event that names the prefill's answer, not a
/// decode stream (none ran): `prefill_failed`, as the request's summary says.
#[tokio::test(start_paused = true)]
async fn a_streamed_prefill_refusal_that_cannot_be_scrubbed_ends_with_prefill_failed() {
    let event =
        "data: {\"error\":{\"message\":\"prompt too long\"},\"kv_transfer_params\":nope}\n\n";
    let dispatches = [
        (Dispatch::Sequential, LegOutcome::NotSent),
        (Dispatch::Concurrent, LegOutcome::Abandoned),
    ];
    for (dispatch, decode) in dispatches {
        let what = format!("{dispatch:?}");
        let fake = Fake::new();
        let refusal = Reply::sse().status(400).after(ms(5)).frame(ms(0), event);
        fake.on(P1, CHAT, refusal);
        fake.on(D1, CHAT, Reply::sse().after(ms(50)).frame(ms(0), DONE));
        let o = Observed::new(&fake, dispatch);
        let resp = serve(&o.orch, chat(&o.orch)).await.unwrap();
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{what}");
        let all = within(resp.into_body().collect()).await.unwrap().to_bytes();
        let text = std::str::from_utf8(&all).unwrap();
        let last = text.rsplit("\n\n").find(|e| !e.trim().is_empty()).unwrap();
        let err = error_event(last);
        assert_eq!(err["code"], "prefill_failed", "{what}: {text}");
        assert!(
            err["message"]
                .as_str()
                .unwrap()
                .starts_with("prefill refusal broke: "),
            "{what}: {err}"
        );
        assert_settled(&o.orch);
        let r = o.report(&what);
        assert_eq!(
            (r.outcome, r.prefill, r.decode),
            (Outcome::PrefillRefused, LegOutcome::Answered, decode),
            "{what}"
        );
        let s = o.heard.summary();
        assert_eq!(
            (s.status, s.delivery, s.error),
            (
                StatusCode::BAD_REQUEST,
                Delivery::Broken,
                Some("prefill_failed")
            ),
            "{what}"
        );
    }
}

/// A request the connector refuses itself (`Unsupported`: the client's fault, answered
/// 400) before any leg is sent ends its attempt as a refusal too: a connector that
/// forgets what it cached of the route's engines when their attempt failed must not
/// forget it for every request it cannot carry. No engine is to blame: the prefill's
/// leg was not sent, nor the decode's.
#[tokio::test(start_paused = true)]
async fn a_request_the_connector_refuses_is_told_as_a_refusal() {
    for dispatch in [Dispatch::Sequential, Dispatch::Concurrent] {
        let what = format!("{dispatch:?}");
        let fake = Fake::new();
        fake.on(P1, CHAT, Reply::json(200, "{}"));
        fake.on(D1, CHAT, Reply::sse().frame(ms(0), DONE));
        let o = Observed::refusing(&fake, dispatch);
        let err = serve(&o.orch, chat(&o.orch)).await.unwrap_err();
        assert_eq!(err.http().status, StatusCode::BAD_REQUEST, "{what}: {err}");
        assert_eq!(err.http().code, "unsupported_by_connector", "{what}");
        assert_settled(&o.orch);
        assert!(fake.calls_to(P1).is_empty(), "{what}: no prefill leg");
        assert!(fake.calls_to(D1).is_empty(), "{what}: no decode leg");
        let r = o.report(&what);
        assert_eq!(
            (r.outcome, r.prefill, r.decode),
            (
                Outcome::PrefillRefused,
                LegOutcome::NotSent,
                LegOutcome::NotSent
            ),
            "{what}"
        );
        let s = o.heard.summary();
        assert_eq!(
            (s.status, s.outcome, s.error),
            (
                StatusCode::BAD_REQUEST,
                "client_error",
                Some("unsupported_by_connector")
            ),
            "{what}"
        );
    }
}

/// A decode that refuses its leg (a 4xx, the client's fault, passed through whole) ends
/// its attempt as the decode's refusal: the router's and the connector's `observe` hear
/// neither a success of the route (no answer was delivered: a router that learns from
/// outcomes would credit a decode for every bad prompt) nor a failure (a connector that
/// forgets what it cached of an engine whose attempt failed would forget it for every
/// bad prompt). The decode's leg answered (its engine worked).
#[tokio::test(start_paused = true)]
async fn a_decode_refusal_passed_through_is_told_as_a_decode_refusal() {
    for dispatch in [Dispatch::Sequential, Dispatch::Concurrent] {
        let what = format!("{dispatch:?}");
        let fake = Fake::new();
        fake.on(P1, CHAT, prefill_answer().after(ms(5)));
        fake.on(D1, CHAT, engine_error(400, "prompt too long").after(ms(10)));
        let o = Observed::new(&fake, dispatch);
        let resp = serve(&o.orch, chat(&o.orch)).await.unwrap();
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{what}");
        within(resp.into_body().collect()).await.unwrap();
        assert_settled(&o.orch);
        let r = o.report(&what);
        assert_eq!(
            (r.outcome, r.prefill, r.decode),
            (
                Outcome::DecodeRefused,
                LegOutcome::Answered,
                LegOutcome::Answered
            ),
            "{what}"
        );
    }
}
