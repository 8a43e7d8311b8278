//! A scripted, in-memory [`Transport`]: the orchestrator's legs without sockets, timed
//! by tokio's clock (paused in these tests, so every delay is exact and instant).
//!
//! Each endpoint and path has a queue of [`Reply`]s; a request takes the next one (or
//! the endpoint's [`always`](Fake::always) reply once the queue is empty). A reply is
//! a refused connection, a head that never comes, or a head after a delay with a body
//! of scripted frames (each after a delay of its own, counted from when the previous
//! one was taken) or of frames the test feeds through a channel.
//!
//! Every request is recorded as a [`Call`] with its method, URI, headers and body, when
//! its head went out, and how the exchange ended: read to its end, or abandoned (the
//! orchestrator dropped the future or the body before the end), which is how a real
//! engine sees a cancelled request.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use disagg_core::error::{BoxError, TransportError};
use disagg_core::transport::{BoxBody, ResponseFuture, Transport};
use http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use http_body::{Body, Frame};
use tokio::sync::mpsc;
use tokio::time::{Instant, Sleep};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The fake transport; clones share their scripts and their record of calls.
#[derive(Clone, Default)]
pub(crate) struct Fake {
    state: Arc<State>,
}

#[derive(Default)]
struct State {
    /// By `scheme://authority/path`.
    queued: Mutex<HashMap<String, VecDeque<Reply>>>,
    always: Mutex<HashMap<String, Reply>>,
    calls: Mutex<Vec<Call>>,
}

fn key(endpoint: &str, path: &str) -> String {
    format!("{endpoint}{path}")
}

impl Fake {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Answer the next request to `path` on `endpoint` (`http://host:port`) with `reply`.
    pub(crate) fn on(&self, endpoint: &str, path: &str, reply: Reply) -> &Self {
        lock(&self.state.queued)
            .entry(key(endpoint, path))
            .or_default()
            .push_back(reply);
        self
    }

    /// Answer every request to `path` on `endpoint` with `reply` once its queue is empty.
    pub(crate) fn always(&self, endpoint: &str, path: &str, reply: Reply) -> &Self {
        lock(&self.state.always).insert(key(endpoint, path), reply);
        self
    }

    /// Every request sent so far, in order.
    pub(crate) fn calls(&self) -> Vec<Call> {
        lock(&self.state.calls).clone()
    }

    /// The requests sent to `endpoint`, in order.
    pub(crate) fn calls_to(&self, endpoint: &str) -> Vec<Call> {
        self.calls()
            .into_iter()
            .filter(|c| c.endpoint() == endpoint)
            .collect()
    }

    fn next(&self, key: &str) -> Option<Reply> {
        let queued = lock(&self.state.queued)
            .get_mut(key)
            .and_then(VecDeque::pop_front);
        queued.or_else(|| lock(&self.state.always).get(key).cloned())
    }
}

impl Transport for Fake {
    fn send(&self, req: http::Request<Bytes>) -> ResponseFuture {
        let (parts, body) = req.into_parts();
        let endpoint = format!(
            "{}://{}",
            parts.uri.scheme_str().unwrap_or("?"),
            parts.uri.authority().map_or("?", |a| a.as_str())
        );
        let key = key(&endpoint, parts.uri.path());
        let track = Arc::new(Mutex::new(Track::default()));
        lock(&self.state.calls).push(Call {
            method: parts.method,
            uri: parts.uri,
            headers: parts.headers,
            body,
            at: Instant::now(),
            track: Arc::clone(&track),
        });
        let reply = self.next(&key);
        let mut guard = Guard { track, done: false };
        Box::pin(async move {
            let Some(reply) = reply else {
                guard.end(End::Finished);
                let msg = format!("fake transport: nothing scripted for {key}");
                return Err(TransportError::Io(msg.into()));
            };
            if !reply.delay.is_zero() {
                tokio::time::sleep(reply.delay).await;
            }
            let status = match reply.head {
                Head::Refuse => {
                    guard.end(End::Finished);
                    return Err(TransportError::Connect("connection refused (fake)".into()));
                }
                Head::Hang => std::future::pending().await,
                Head::Status(s) => s,
            };
            lock(&guard.track).head = Some(Instant::now());
            let source = match reply.body {
                Script::Steps(steps) => Source::Steps(steps.into()),
                // A fed reply answers once; a repeat of it has an empty body.
                Script::Fed(rx) => match lock(&rx).take() {
                    Some(rx) => Source::Fed(rx),
                    None => Source::Steps(VecDeque::new()),
                },
            };
            let body = ScriptBody {
                source,
                sleep: None,
                guard,
            };
            let mut resp = http::Response::new(BoxBody::new(body));
            *resp.status_mut() = status;
            *resp.headers_mut() = reply.headers;
            Ok(resp)
        })
    }
}

// === Reply ===

/// How an endpoint answers one request.
#[derive(Clone)]
pub(crate) struct Reply {
    delay: Duration,
    head: Head,
    headers: HeaderMap,
    body: Script,
}

#[derive(Clone)]
enum Head {
    Refuse,
    Hang,
    Status(StatusCode),
}

type Fed = mpsc::UnboundedReceiver<Result<Bytes, String>>;

#[derive(Clone)]
enum Script {
    Steps(Vec<Step>),
    /// Taken by the first request it answers.
    Fed(Arc<Mutex<Option<Fed>>>),
}

#[derive(Clone)]
enum Step {
    Data(Duration, Bytes),
    Fail(Duration, String),
    /// Nothing more, ever; the connection stays open.
    Stall,
}

impl Reply {
    fn new(head: Head) -> Self {
        Reply {
            delay: Duration::ZERO,
            head,
            headers: HeaderMap::new(),
            body: Script::Steps(Vec::new()),
        }
    }

    /// The connection is refused (`TransportError::Connect`).
    pub(crate) fn refuse() -> Self {
        Self::new(Head::Refuse)
    }

    /// The request is taken and its response head never comes.
    pub(crate) fn hang() -> Self {
        Self::new(Head::Hang)
    }

    /// `status` with `body` as `application/json`, in one frame.
    pub(crate) fn json(status: u16, body: &str) -> Self {
        let mut r = Self::new(Head::Status(status_code(status)));
        r.headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        r.frame(Duration::ZERO, body.to_owned())
    }

    /// A 200 event stream with no frames yet (add them with [`frame`](Self::frame), or
    /// feed them with [`fed`](Self::fed)).
    pub(crate) fn sse() -> Self {
        let mut r = Self::new(Head::Status(StatusCode::OK));
        r.headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        r
    }

    /// The same reply answered with `status` instead.
    pub(crate) fn status(mut self, status: u16) -> Self {
        self.head = Head::Status(status_code(status));
        self
    }

    /// The head (or the refusal) comes `delay` after the request.
    pub(crate) fn after(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    fn step(mut self, step: Step) -> Self {
        match &mut self.body {
            Script::Steps(steps) => steps.push(step),
            Script::Fed(_) => panic!("a fed body has no scripted steps"),
        }
        self
    }

    /// Then a frame, `after` the previous one was taken.
    pub(crate) fn frame(self, after: Duration, data: impl Into<Bytes>) -> Self {
        self.step(Step::Data(after, data.into()))
    }

    /// Then the body breaks, `after` the previous frame was taken.
    pub(crate) fn fail(self, after: Duration, msg: &str) -> Self {
        self.step(Step::Fail(after, msg.to_owned()))
    }

    /// Then silence: no frame and no end.
    pub(crate) fn stall(self) -> Self {
        self.step(Step::Stall)
    }

    /// The same head with a body the test feeds through the returned [`Feed`].
    pub(crate) fn fed(mut self) -> (Self, Feed) {
        let (tx, rx) = mpsc::unbounded_channel();
        self.body = Script::Fed(Arc::new(Mutex::new(Some(rx))));
        (self, Feed(tx))
    }
}

fn status_code(status: u16) -> StatusCode {
    StatusCode::from_u16(status).expect("a valid status")
}

/// The sending end of a fed body.
pub(crate) struct Feed(mpsc::UnboundedSender<Result<Bytes, String>>);

impl Feed {
    /// One frame. (A body already dropped by the orchestrator takes nothing.)
    pub(crate) fn send(&self, data: impl Into<Bytes>) {
        let _ = self.0.send(Ok(data.into()));
    }

    /// The body breaks with `msg`.
    pub(crate) fn fail(self, msg: &str) {
        let _ = self.0.send(Err(msg.to_owned()));
    }

    /// The body ends.
    pub(crate) fn end(self) {}
}

// === Call ===

/// One request the orchestrator sent.
#[derive(Clone)]
pub(crate) struct Call {
    pub(crate) method: Method,
    pub(crate) uri: Uri,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    /// When it was sent.
    pub(crate) at: Instant,
    track: Arc<Mutex<Track>>,
}

#[derive(Default)]
struct Track {
    head: Option<Instant>,
    end: Option<(Instant, End)>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum End {
    /// Answered in full (body read to its end, or a refusal or break delivered).
    Finished,
    /// Dropped by the orchestrator before its end.
    Abandoned,
}

impl Call {
    /// `scheme://authority` of the endpoint it went to.
    pub(crate) fn endpoint(&self) -> String {
        format!(
            "{}://{}",
            self.uri.scheme_str().unwrap_or("?"),
            self.uri.authority().map_or("?", |a| a.as_str())
        )
    }

    /// The body as text.
    pub(crate) fn text(&self) -> &str {
        std::str::from_utf8(&self.body).expect("a UTF-8 body")
    }

    /// The body as JSON.
    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("a JSON body")
    }

    /// A header's value.
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().expect("ASCII"))
    }

    /// The engine-side request id (`x-request-id`).
    pub(crate) fn id(&self) -> &str {
        self.header("x-request-id").expect("every leg has an id")
    }

    /// When the response head went out, if it did.
    pub(crate) fn head_at(&self) -> Option<Instant> {
        lock(&self.track).head
    }

    /// When the orchestrator dropped the exchange (its future before the head, or its
    /// body before the end); `None` while it runs or once it ended in full.
    pub(crate) fn abandoned_at(&self) -> Option<Instant> {
        match lock(&self.track).end {
            Some((at, End::Abandoned)) => Some(at),
            _ => None,
        }
    }

    /// Whether the exchange ended in full (the body was read to its end).
    pub(crate) fn finished(&self) -> bool {
        matches!(lock(&self.track).end, Some((_, End::Finished)))
    }

    /// Whether the exchange is still going: neither finished nor abandoned.
    pub(crate) fn is_open(&self) -> bool {
        lock(&self.track).end.is_none()
    }
}

impl std::fmt::Debug for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = lock(&self.track);
        f.debug_struct("Call")
            .field("method", &self.method)
            .field("uri", &self.uri)
            .field("at", &self.at)
            .field("head", &t.head)
            .field("end", &t.end)
            .field("body", &String::from_utf8_lossy(&self.body))
            .finish()
    }
}

/// Notes how an exchange ended; dropped before that, it was abandoned.
struct Guard {
    track: Arc<Mutex<Track>>,
    done: bool,
}

impl Guard {
    fn end(&mut self, how: End) {
        if !self.done {
            self.done = true;
            lock(&self.track).end = Some((Instant::now(), how));
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.end(End::Abandoned);
    }
}

// === ScriptBody ===

enum Source {
    Steps(VecDeque<Step>),
    Fed(Fed),
}

/// A response body playing its script; it holds the exchange's [`Guard`].
struct ScriptBody {
    source: Source,
    sleep: Option<Pin<Box<Sleep>>>,
    guard: Guard,
}

impl Body for ScriptBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let step = match &mut this.source {
            Source::Fed(rx) => match ready!(rx.poll_recv(cx)) {
                Some(Ok(data)) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                Some(Err(msg)) => Step::Fail(Duration::ZERO, msg),
                None => {
                    this.guard.end(End::Finished);
                    return Poll::Ready(None);
                }
            },
            Source::Steps(steps) => {
                let delay = match steps.front() {
                    None => {
                        this.guard.end(End::Finished);
                        return Poll::Ready(None);
                    }
                    // Never woken: only the reader's own timers end the wait.
                    Some(Step::Stall) => return Poll::Pending,
                    Some(Step::Data(d, _) | Step::Fail(d, _)) => *d,
                };
                if !delay.is_zero() {
                    let sleep = this
                        .sleep
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep(delay)));
                    ready!(sleep.as_mut().poll(cx));
                    this.sleep = None;
                }
                steps.pop_front().expect("a step")
            }
        };
        match step {
            Step::Data(_, data) => Poll::Ready(Some(Ok(Frame::data(data)))),
            Step::Fail(_, msg) => {
                this.guard.end(End::Finished);
                Poll::Ready(Some(Err(msg.into())))
            }
            Step::Stall => Poll::Pending,
        }
    }
}
