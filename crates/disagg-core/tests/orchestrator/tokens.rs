//! The tokens seam: a request is tokenized at most once, only when the router or the
//! disaggregation hook reads tokens, and a tokenizer that fails or hangs leaves the
//! request routed without ids, never failed.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use disagg_core::error::{BoxError, RouteError};
use disagg_core::policy::{Decision, Disaggregate};
use disagg_core::router::{RequestView, Router};
use disagg_core::tokens::{TokenIds, Tokenizer};
use disagg_core::{endpoint::EndpointSet, json::JsonBody};

use super::*;

/// What the test tokenizer does.
#[derive(Clone, Copy)]
enum Mode {
    /// Answers `[api as u32, body length]`.
    Ids,
    /// Fails.
    Fail,
    /// Never answers.
    Hang,
    /// The prompt is not one sequence.
    NotOne,
}

struct Counting {
    mode: Mode,
    calls: Arc<AtomicUsize>,
}

#[async_trait]
impl Tokenizer for Counting {
    async fn token_ids(&self, api: Api, body: &JsonBody) -> Result<Option<TokenIds>, BoxError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        match self.mode {
            Mode::Ids => {
                let len = body.get("messages").map_or(0, <[u8]>::len) as u32;
                Ok(Some(vec![api as u32, len].into()))
            }
            Mode::Fail => Err("no tokenizer here".into()),
            Mode::Hang => std::future::pending().await,
            Mode::NotOne => Ok(None),
        }
    }
}

/// Routes to the set's first endpoints, recording the ids each attempt saw.
struct Recording {
    wants: bool,
    seen: Arc<Mutex<Vec<Option<Vec<u32>>>>>,
}

impl Router for Recording {
    fn select(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        self.seen
            .lock()
            .unwrap()
            .push(req.tokens.map(<[u32]>::to_vec));
        let decode = set
            .by_role(Role::Decode)
            .first()
            .ok_or(RouteError::NoDecode)?;
        Ok(Route::new(
            set.by_role(Role::Prefill).first().cloned(),
            Arc::clone(decode),
        ))
    }

    fn wants_tokens(&self) -> bool {
        self.wants
    }
}

/// A hook that reads tokens and records them.
struct Hook(Arc<Mutex<Vec<Option<Vec<u32>>>>>);

impl Disaggregate for Hook {
    fn decide(&self, req: &RequestView<'_>) -> Decision {
        self.0.lock().unwrap().push(req.tokens.map(<[u32]>::to_vec));
        Decision::Disaggregate
    }

    fn wants_tokens(&self) -> bool {
        true
    }
}

type Seen = Arc<Mutex<Vec<Option<Vec<u32>>>>>;

struct Built {
    orch: Orchestrator,
    calls: Arc<AtomicUsize>,
    routed: Seen,
}

fn build(fake: &Fake, mode: Mode, wants: bool, config: impl FnOnce(&mut Setup)) -> Built {
    let calls = Arc::new(AtomicUsize::new(0));
    let routed: Seen = Arc::default();
    let mut c = Setup::default();
    config(&mut c);
    let source = StaticSource::new(endpoints(&[P1, P2], &[D1]));
    let builder = Orchestrator::builder(source, fake.clone(), VllmNixl::new())
        .router(Recording {
            wants,
            seen: Arc::clone(&routed),
        })
        .tokenizer(Counting {
            mode,
            calls: Arc::clone(&calls),
        });
    Built {
        orch: c.apply(builder).build(),
        calls,
        routed,
    }
}

fn answer_ok(fake: &Fake) {
    fake.always(P1, CHAT, prefill_answer());
    fake.always(P2, CHAT, prefill_answer());
    fake.always(D1, CHAT, Reply::sse().frame(ms(1), DONE));
}

async fn served(orch: &Orchestrator) {
    let resp = serve(orch, chat(orch)).await.unwrap();
    let mut body = resp.into_body();
    while next(&mut body).await.is_some() {}
}

#[tokio::test(start_paused = true)]
async fn a_router_reading_tokens_gets_them_once_per_request_on_every_attempt() {
    let fake = Fake::new();
    // The first prefill cannot connect: the retry is a second attempt, routed again.
    fake.on(P1, CHAT, Reply::refuse());
    answer_ok(&fake);
    let b = build(&fake, Mode::Ids, true, |c| {
        c.retry = RetryPolicy::retries(1)
    });
    served(&b.orch).await;
    let len = JsonBody::parse(CLIENT.as_bytes())
        .unwrap()
        .get("messages")
        .unwrap()
        .len() as u32;
    let ids = vec![Api::Chat as u32, len];
    assert_eq!(b.calls.load(Ordering::SeqCst), 1, "tokenized once");
    assert_eq!(*b.routed.lock().unwrap(), [Some(ids.clone()), Some(ids)]);
    let st = b.orch.stats();
    assert_eq!((st.tokenized, st.tokenize_failures, st.retries), (1, 0, 1));
}

#[tokio::test(start_paused = true)]
async fn nothing_reading_tokens_means_no_tokenizing() {
    let fake = Fake::new();
    answer_ok(&fake);
    let b = build(&fake, Mode::Ids, false, |_| {});
    served(&b.orch).await;
    assert_eq!(b.calls.load(Ordering::SeqCst), 0);
    assert_eq!(*b.routed.lock().unwrap(), [None]);
    assert_eq!(b.orch.stats().tokenized, 0);
}

#[tokio::test(start_paused = true)]
async fn a_hook_reading_tokens_is_enough_and_sees_them_before_routing() {
    let fake = Fake::new();
    answer_ok(&fake);
    let calls = Arc::new(AtomicUsize::new(0));
    let (hooked, routed): (Seen, Seen) = (Arc::default(), Arc::default());
    let source = StaticSource::new(endpoints(&[P1], &[D1]));
    let orch = Orchestrator::builder(source, fake.clone(), VllmNixl::new())
        .router(Recording {
            wants: false,
            seen: Arc::clone(&routed),
        })
        .disaggregate(Hook(Arc::clone(&hooked)))
        .tokenizer(Counting {
            mode: Mode::Ids,
            calls: Arc::clone(&calls),
        })
        .build();
    served(&orch).await;
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let hooked = hooked.lock().unwrap().clone();
    assert!(matches!(&hooked[..], [Some(ids)] if ids[0] == Api::Chat as u32));
    // The router reads the same request: the ids are there for it too.
    assert_eq!(*routed.lock().unwrap(), hooked);
}

#[tokio::test(start_paused = true)]
async fn a_failing_or_hanging_tokenizer_routes_without_ids_and_is_counted() {
    for (mode, failures) in [(Mode::Fail, 1), (Mode::Hang, 1), (Mode::NotOne, 0)] {
        let fake = Fake::new();
        answer_ok(&fake);
        let b = build(&fake, mode, true, |c| c.tokenize_timeout = ms(250));
        let t0 = Instant::now();
        served(&b.orch).await;
        let st = b.orch.stats();
        assert_eq!((st.tokenized, st.tokenize_failures), (0, failures));
        assert_eq!(*b.routed.lock().unwrap(), [None]);
        // A hanging tokenizer costs the request its budget, no more.
        let waited = t0.elapsed();
        match mode {
            Mode::Hang => assert!(waited >= ms(250) && waited < ms(300), "{waited:?}"),
            _ => assert!(waited < ms(50), "{waited:?}"),
        }
    }
}

#[tokio::test(start_paused = true)]
async fn ids_set_by_the_application_are_not_tokenized_again() {
    let fake = Fake::new();
    answer_ok(&fake);
    let b = build(&fake, Mode::Ids, true, |_| {});
    let mut req = chat(&b.orch);
    req.set_tokens(Some(vec![7, 8, 9].into()));
    let resp = serve(&b.orch, req).await.unwrap();
    drop(resp);
    assert_eq!(b.calls.load(Ordering::SeqCst), 0);
    assert_eq!(*b.routed.lock().unwrap(), [Some(vec![7, 8, 9])]);
}
