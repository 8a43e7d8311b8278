//! Mid-stream migration, what it holds and gives back: the decode a stream broke on is
//! free once its stream is abandoned, a continuation's legs count like any routed
//! leg's (in flight, and a router's place), a continuation serves the client the
//! original request came from, and a continuation through a fresh prefill is reported.

use std::collections::HashMap;
use std::sync::Mutex;

use disagg_connectors::vllm::bidi::{BidiConfig, BidiStore, ConversationKey};
use disagg_core::endpoint::EndpointSet;
use disagg_core::error::RouteError;
use disagg_core::outcome::{LegOutcome, Listener, Outcome, Report};
use disagg_core::policy::Permit;
use disagg_core::router::{Ask, RequestView, Router, Routing};
use futures::future::{BoxFuture, Either, ready};

use super::*;

mod continuation;
mod counted;
mod lead;
mod refused;
mod traced;
mod unfinished;
mod window;

const D2: &str = "http://d2:8200";
const D3: &str = "http://d3:8200";
const COMPLETIONS: &str = "/v1/completions";

/// The first chunk of a chat stream carrying token ids, then one token.
fn first_leg() -> [String; 2] {
    [
        r#"data: {"id":"c-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"token_ids":[]}],"prompt_token_ids":[1,2,3]}"#.to_owned() + "\n\n",
        r#"data: {"id":"c-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"A"},"token_ids":[7]}]}"#.to_owned() + "\n\n",
    ]
}

/// A decode that streams [`first_leg`], then breaks.
fn dying() -> Reply {
    let [first, second] = first_leg();
    Reply::sse()
        .frame(ms(0), first)
        .frame(ms(0), second)
        .fail(ms(5), "reset")
}

/// A continuation's chunk (`/v1/completions`) of one token.
fn continued(text: &str, id: u32, finish: Option<&str>) -> String {
    let finish = finish.map_or("null".to_owned(), |f| format!("\"{f}\""));
    format!(
        r#"data: {{"id":"cmpl-2","object":"text_completion","created":2,"model":"m","choices":[{{"index":0,"text":"{text}","token_ids":[{id}],"finish_reason":{finish}}}]}}"#
    ) + "\n\n"
}

/// A continuation's decode that streams `text` (token `id`), its last, and ends.
fn to_the_end(text: &str, id: u32) -> Reply {
    Reply::sse()
        .frame(ms(0), continued(text, id, Some("length")))
        .frame(ms(0), DONE)
}

/// A continuation's decode that streams `text` (token `id`), then breaks.
fn then_breaks(text: &str, id: u32) -> Reply {
    Reply::sse()
        .frame(ms(0), continued(text, id, None))
        .fail(ms(5), "reset")
}

/// The prompt's legs: P1 prefills it, D1 streams [`first_leg`] and breaks ([`dying`]).
fn breaks(fake: &Fake) -> &Fake {
    fake.on(P1, CHAT, prefill_answer()).on(D1, CHAT, dying())
}

/// [`breaks`], then one continuation: its fresh prefill on P1 answers `fresh`, its
/// decode on D2 answers `rest`.
fn continued_once(fake: &Fake, fresh: Reply, rest: Reply) -> &Fake {
    breaks(fake)
        .on(P1, COMPLETIONS, fresh)
        .on(D2, COMPLETIONS, rest)
}

/// [`breaks`], then two continuations: the first's decode (D2) answers `first`, the
/// second's (D3) streams "C" to the end. Their fresh prefills are the test's to script.
fn continued_twice(fake: &Fake, first: Reply) -> &Fake {
    breaks(fake)
        .on(D2, COMPLETIONS, first)
        .on(D3, COMPLETIONS, to_the_end("C", 9))
}

/// Settings that continue a broken stream up to `limit` times (decode-only when
/// `decode_only`), with no decode idle timeout (a stream may wait on what the test feeds).
fn continuing(limit: u32, decode_only: bool) -> OrchestratorConfig {
    let mut config = OrchestratorConfig::default();
    config.decode_idle_timeout = None;
    config.migration.limit = limit;
    config.migration.decode_only = decode_only;
    config
}

/// An orchestrator's builder over `prefills` and `decodes`, sending through `fake`, with
/// `connector` and `config`.
fn over(
    fake: &Fake,
    prefills: &[&str],
    decodes: &[&str],
    connector: impl KvConnector,
    config: OrchestratorConfig,
) -> OrchestratorBuilder {
    let source = StaticSource::new(endpoints(prefills, decodes));
    Orchestrator::builder(source, fake.clone(), connector).config(config)
}

/// NIXL over [`P1`] and [`D1`], [`D2`] with `config`, telling `listener` how each
/// attempt ended.
fn listened(fake: &Fake, config: OrchestratorConfig, listener: impl Listener) -> Orchestrator {
    over(fake, &[P1], &[D1, D2], VllmNixl::new(), config)
        .listener(listener)
        .build()
}

/// The client's stream read to its end, every frame data: the frames, joined.
async fn read_to_end(body: &mut PdBody) -> String {
    let mut text = String::new();
    while let Some(frame) = next(body).await {
        text.push_str(&frame.unwrap());
    }
    text
}

/// The body read to its end: when the error (an error frame or event) came.
async fn ended(body: &mut PdBody) -> Option<Instant> {
    let mut ended = None;
    while let Some(frame) = next(body).await {
        if frame.as_ref().is_err() || frame.as_ref().is_ok_and(|f| f.contains("error")) {
            ended = Some(Instant::now());
        }
    }
    ended
}

/// The fed continuation's last token ("C") and its end, then the client's stream read
/// to its end.
async fn finish(feed: fake::Feed, body: &mut PdBody) {
    feed.send(continued("C", 9, Some("length")));
    feed.send(DONE);
    feed.end();
    read_to_end(body).await;
}

/// The places a router handed out and not yet got back, per endpoint.
#[derive(Clone, Default)]
struct Places(Arc<Mutex<HashMap<String, usize>>>);

struct Place {
    places: Places,
    endpoint: String,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut m = self.places.0.lock().unwrap();
        if let Some(n) = m.get_mut(&self.endpoint) {
            *n -= 1;
        }
    }
}

impl Places {
    fn take(&self, endpoint: &Endpoint) -> Permit {
        let key = endpoint.id().as_str().to_owned();
        *self.0.lock().unwrap().entry(key.clone()).or_default() += 1;
        Permit::new(Place {
            places: self.clone(),
            endpoint: key,
        })
    }

    fn held(&self, url: &str) -> usize {
        self.0.lock().unwrap().get(url).copied().unwrap_or(0)
    }
}

/// Round robin over the prefills and the decodes; each route holds a place on its
/// decode ([`Route::with_holds`]), as `disagg-resilience`'s limits do, and so does the
/// route of one engine ([`Router::place`]).
struct Placing {
    places: Places,
    turn: std::sync::atomic::AtomicUsize,
}

impl Placing {
    fn new(places: &Places) -> Self {
        Placing {
            places: places.clone(),
            turn: Default::default(),
        }
    }
}

impl Router for Placing {
    fn select(&self, _: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        let n = self.turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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

    fn route<'a>(&'a self, ask: Ask<'a>) -> Routing<'a> {
        let routed = ask.select(self).map(|route| {
            let place = self.places.take(&route.decode);
            route.with_holds(None, Some(place))
        });
        Either::Left(ready(routed))
    }

    fn place<'a>(
        &'a self,
        pick: &'a (dyn Fn() -> Result<Arc<Endpoint>, PdError> + Send + Sync),
        _deadline: Option<Instant>,
    ) -> BoxFuture<'a, Result<Route, PdError>> {
        Box::pin(async move {
            let decode = pick()?;
            let place = self.places.take(&decode);
            Ok(Route::new(None, decode).with_holds(None, Some(place)))
        })
    }
}

/// NIXL over [`P1`], [`D1`] and [`D2`], routed by [`Placing`], continuing once
/// (decode-only when `decode_only`).
fn migrating(fake: &Fake, places: &Places, decode_only: bool) -> Orchestrator {
    let config = continuing(1, decode_only);
    over(fake, &[P1], &[D1, D2], VllmNixl::new(), config)
        .router(Placing::new(places))
        .build()
}

/// The body's frames until one holds `text`.
async fn until(body: &mut PdBody, text: &str) {
    loop {
        let frame = data(body).await;
        if frame.contains(text) {
            return;
        }
    }
}

/// Once a stream broke and went on on another decode, the decode it broke on holds
/// nothing of it: neither its in-flight count nor the router's place, which load-aware
/// routing and per-endpoint limits read, stay taken until the client's stream ends.
#[tokio::test(start_paused = true)]
async fn the_decode_a_stream_broke_on_is_free_once_the_stream_moved_on() {
    for decode_only in [true, false] {
        let fake = Fake::new();
        let places = Places::default();
        let (rest, feed) = Reply::sse().fed();
        continued_once(&fake, prefill_answer(), rest);
        let orch = migrating(&fake, &places, decode_only);
        let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        until(&mut body, "\"A\"").await;
        assert_eq!((in_flight(&orch, D1), places.held(D1)), (1, 1));
        feed.send(continued("B", 8, None));
        until(&mut body, "\"B\"").await;
        // The client's stream goes on, on D2: D1 is free.
        assert_eq!(
            (in_flight(&orch, D1), places.held(D1)),
            (0, 0),
            "decode-only: {decode_only}"
        );
        finish(feed, &mut body).await;
        drop(body);
        assert_settled(&orch);
    }
}

/// A continuation's legs count as any routed leg's while its stream runs: its decode's
/// in-flight count and a router's place on it (a per-endpoint limit sees it; a
/// continuation waits for room as a routed request does), given back when its stream
/// ends; its fresh prefill's in-flight count while that leg runs.
#[tokio::test(start_paused = true)]
async fn a_continuation_holds_its_decodes_count_and_place_while_it_streams() {
    for decode_only in [true, false] {
        let fake = Fake::new();
        let places = Places::default();
        let (rest, feed) = Reply::sse().fed();
        continued_once(&fake, prefill_answer().after(ms(10)), rest);
        let orch = migrating(&fake, &places, decode_only);
        let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        until(&mut body, "\"A\"").await;
        if !decode_only {
            // The continuation's prefill leg, running: counted on P1.
            let polled = timeout(ms(8), body.frame()).await;
            assert!(polled.is_err(), "nothing comes while the prefill runs");
            assert_eq!(in_flight(&orch, P1), 1);
        }
        feed.send(continued("B", 8, None));
        until(&mut body, "\"B\"").await;
        assert_eq!(
            (in_flight(&orch, P1), in_flight(&orch, D2), places.held(D2)),
            (0, 1, 1),
            "decode-only: {decode_only}"
        );
        finish(feed, &mut body).await;
        assert_eq!((in_flight(&orch, D2), places.held(D2)), (0, 0));
        drop(body);
        assert_settled(&orch);
    }
}

/// A continuation through a fresh prefill is the request of the client the original
/// came from: with client keys, the decode's handoff it ends with is kept under that
/// client's conversation, where the conversation's next turn (the same client's)
/// finds it.
#[tokio::test(start_paused = true)]
async fn a_continuations_handoff_is_kept_for_the_clients_conversation() {
    const DECODE_KV: &str = r#"{"do_remote_prefill":false,"do_remote_decode":true,"remote_engine_id":"dec-2","remote_request_id":"r-2","remote_block_ids":[0,1],"remote_host":"localhost","remote_port":5601,"remote_num_tokens":80}"#;
    let fake = Fake::new();
    let mut bidi = BidiConfig::default();
    bidi.key = ConversationKey::Header(http::HeaderName::from_static("x-session-id"));
    let store = BidiStore::new(bidi);
    fake.always(P1, CHAT, prefill_answer());
    fake.on(P1, COMPLETIONS, prefill_answer());
    fake.on(D1, CHAT, dying());
    fake.on(
        D2,
        COMPLETIONS,
        Reply::sse()
            .frame(ms(0), continued("B", 8, Some("length")))
            .frame(
                ms(0),
                format!(
                    r#"data: {{"id":"cmpl-2","object":"text_completion","created":2,"model":"m","choices":[],"kv_transfer_params":{DECODE_KV}}}"#
                ) + "\n\n",
            )
            .frame(ms(0), DONE),
    );
    fake.always(D1, CHAT, Reply::json(200, "{}"));
    fake.always(D2, CHAT, Reply::json(200, "{}"));
    let source = StaticSource::new(endpoints(&[P1], &[D1, D2]));
    let mut config = OrchestratorConfig::default();
    config.migration.limit = 1;
    let orch = Orchestrator::builder(
        source,
        fake.clone(),
        VllmNixl::new().with_bidirectional(Arc::clone(&store)),
    )
    .config(config)
    .build();
    let turn = |orch: &Orchestrator| {
        let mut req = chat_with(orch, &[("x-session-id", "s1")]);
        req.set_received(std::time::Instant::now(), Some(Arc::from("client-a")));
        req
    };
    let mut body = serve(&orch, turn(&orch)).await.unwrap().into_body();
    read_to_end(&mut body).await;
    drop(body);
    assert_eq!(store.stats().captured, 1, "{:?}", store.stats());
    // The next turn of the same client's conversation sends it on its prefill leg.
    let resp = serve(&orch, turn(&orch)).await.unwrap();
    drop(resp);
    let prefills: Vec<_> = fake
        .calls_to(P1)
        .into_iter()
        .filter(|c| c.uri.path() == CHAT)
        .collect();
    let last = prefills.last().unwrap().json();
    assert_eq!(
        last["kv_transfer_params"]["remote_engine_id"], "dec-2",
        "{last}"
    );
    assert_eq!(last["kv_transfer_params"]["remote_host"], "d2");
    assert_eq!(store.stats().reused, 1);
}

/// Every report told, kept.
#[derive(Clone, Default)]
struct Reports(Arc<Mutex<Vec<Report>>>);

impl Listener for Reports {
    fn on_report(&self, report: &Report) {
        self.0.lock().unwrap().push(report.clone());
    }
}

impl Reports {
    /// Every report, in order.
    fn all(&self) -> Vec<Report> {
        self.0.lock().unwrap().clone()
    }

    /// The reports naming `prefill` and `decode`.
    fn over(&self, decode: &str) -> Vec<Report> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.route.decode.id().as_str() == decode)
            .cloned()
            .collect()
    }
}

/// Whether `r` blames the engine at `url`: reports it failed (on either leg).
fn blamed(r: &Report, url: &str) -> bool {
    let on = |ep: &Endpoint| ep.id().as_str() == url;
    (r.route.prefill.as_deref().is_some_and(on) && r.prefill == LegOutcome::Failed)
        || (on(&r.route.decode) && r.decode == LegOutcome::Failed)
}

/// Whether `r` reports a continuation's fresh prefill leg alone (its decode not sent),
/// for a continuation on the decode at `url`.
fn fresh_leg(r: &Report, url: &str) -> bool {
    r.decode == LegOutcome::NotSent && r.route.decode.id().as_str() == url
}

/// A continuation through a fresh prefill is an attempt of its own: cut off by the
/// client before its decode answered, it is reported cancelled, once, its prefill leg
/// as far as it went.
#[tokio::test(start_paused = true)]
async fn a_continuation_through_a_prefill_cut_off_by_the_client_is_reported_cancelled() {
    let fake = Fake::new();
    let reports = Reports::default();
    continued_once(&fake, prefill_answer(), Reply::hang());
    let orch = listened(&fake, continuing(1, false), reports.clone());
    let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
    until(&mut body, "\"A\"").await;
    // The continuation's decode leg goes out, and its head never comes: the client
    // leaves.
    let polled = timeout(ms(50), body.frame()).await;
    assert!(polled.is_err());
    assert_eq!(fake.calls_to(D2).len(), 1);
    drop(body);
    let on_d2 = reports.over(D2);
    let [report] = &on_d2[..] else {
        panic!("one report of the continuation: {on_d2:?}")
    };
    assert_eq!(report.outcome, Outcome::Cancelled);
    assert_eq!(
        report.route.prefill.as_ref().map(|p| p.id().as_str()),
        Some(P1)
    );
    assert_eq!(
        (report.prefill, report.decode),
        (LegOutcome::Answered, LegOutcome::Abandoned)
    );
    assert_settled(&orch);
}

/// A decode head timeout past what the clock can hold is no limit for a continuation's
/// wait for room on its decode, as it is for the first decode's head: the stream moves
/// on (the sum `now + timeout` panicked the body's poll).
#[tokio::test(start_paused = true)]
async fn a_continuation_under_a_head_timeout_the_clock_cannot_hold_moves_on() {
    for decode_only in [true, false] {
        let fake = Fake::new();
        let places = Places::default();
        continued_once(&fake, prefill_answer(), to_the_end("B", 8));
        let mut config = continuing(1, decode_only);
        config.decode_head_timeout = Duration::MAX;
        let orch = over(&fake, &[P1], &[D1, D2], VllmNixl::new(), config)
            .router(Placing::new(&places))
            .build();
        let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        let all = read_to_end(&mut body).await;
        assert!(all.contains("\"A\"") && all.contains("\"B\""), "{all}");
        assert!(all.ends_with(DONE), "{all}");
        drop(body);
        assert_settled(&orch);
    }
}

/// A continuation slower to start than the decode idle time (300 ms): its fresh prefill
/// answers at 500 ms, and its decode its head at once, or 250 ms later with its first
/// chunk 250 ms after that. The client's stream is silent for the proxy's doing, within
/// the continuation's own window, not the decode's; the idle time counts from the
/// start's end, not from the last thing that happened during it (the prefill's answer,
/// or a look of the idle timer's). The stream moves on and ends well.
#[tokio::test(start_paused = true)]
async fn a_continuation_slower_to_start_than_the_idle_time_is_not_idle() {
    let late = Reply::sse()
        .after(ms(250))
        .frame(ms(250), continued("B", 8, Some("length")))
        .frame(ms(0), DONE);
    for (what, rest) in [("head at once", to_the_end("B", 8)), ("head late", late)] {
        let fake = Fake::new();
        continued_once(&fake, prefill_answer().after(ms(500)), rest);
        let mut config = continuing(1, false);
        config.decode_idle_timeout = Some(ms(300));
        let orch = over(&fake, &[P1], &[D1, D2], VllmNixl::new(), config).build();
        let mut body = serve(&orch, chat(&orch)).await.unwrap().into_body();
        let all = read_to_end(&mut body).await;
        assert!(
            all.contains("\"A\"") && all.contains("\"B\""),
            "{what}: {all}"
        );
        assert!(all.ends_with(DONE), "{what}: {all}");
        drop(body);
        assert_settled(&orch);
    }
}

/// A chat without a token limit is not migrated: its continuation would go to the
/// completions API, which vLLM fails on a `"max_tokens": null` (it asserts a number),
/// and the proxy does not know the model's context length to say the rest in numbers.
/// Its decode leg is not asked for token ids, and when its stream breaks the client's
/// stream ends with the error, no continuation sent.
#[tokio::test(start_paused = true)]
async fn a_chat_without_a_token_limit_is_not_migrated() {
    for limit in [
        "",
        r#","max_tokens":null"#,
        r#","max_completion_tokens":null"#,
    ] {
        let fake = Fake::new();
        breaks(&fake).on(D2, COMPLETIONS, to_the_end("B", 8));
        let orch = over(
            &fake,
            &[P1],
            &[D1, D2],
            VllmNixl::new(),
            continuing(1, true),
        )
        .build();
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"stream":true{limit}}}"#
        );
        let req = orch
            .request(Api::Chat, HeaderMap::new(), &Bytes::from(body))
            .unwrap();
        let mut body = serve(&orch, req).await.unwrap().into_body();
        assert!(
            within(ended(&mut body)).await.is_some(),
            "{limit}: no error"
        );
        let calls = fake.calls();
        assert!(
            calls.iter().all(|c| c.uri.path() != COMPLETIONS),
            "{limit}: a continuation was sent"
        );
        let decode = fake.calls_to(D1);
        assert_eq!(decode.len(), 1, "{limit}");
        let sent: serde_json::Value = serde_json::from_slice(&decode[0].body).unwrap();
        assert!(sent.get("return_token_ids").is_none(), "{limit}: {sent}");
        drop(body);
        assert_settled(&orch);
    }
}
