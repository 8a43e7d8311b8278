//! An in-test Kubernetes API server for pods: list and watch over real HTTP on
//! 127.0.0.1, for kube-rs's real client.
//!
//! No kube-apiserver (nor etcd) can run on the test machines, so this server implements
//! the part of the API the pod watcher uses, following the documented semantics
//! (kubernetes.io/docs/reference/using-api/api-concepts/, sections "Efficient detection
//! of changes", "Watch bookmarks", "Resource versions" and "410 Gone responses"):
//!
//! - every change bumps one cluster-wide `resourceVersion` (etcd's revision), which the
//!   changed object carries in `metadata.resourceVersion`;
//! - `GET /api/v1/namespaces/NS/pods` lists the namespace's pods matching
//!   `labelSelector` (equality- and set-based requirements), with the list's
//!   `metadata.resourceVersion`, paginated by `limit`/`continue` as "Retrieving large
//!   results sets in chunks" says: every page is of the first page's snapshot and
//!   carries its `resourceVersion` (a pod changed or deleted since is served as it was,
//!   one created since is not), and a `continue` token whose version has been compacted
//!   away is answered `410 Gone` (reason `Expired`);
//! - `...?watch=true&resourceVersion=RV` streams, as newline-delimited JSON, every
//!   change after RV (`ADDED`, `MODIFIED`, `DELETED`; a pod that starts or stops
//!   matching the selector is `ADDED` or `DELETED`, as for any filtered watch), then
//!   live changes, until `timeoutSeconds` or until the test ends the watch;
//! - with `allowWatchBookmarks=true`, `BOOKMARK` events carry the current
//!   `resourceVersion` in an otherwise empty object of the watched kind;
//! - a watch from a version older than the retained history (after a compaction) is
//!   answered, as the API server's watch cache does, with HTTP 200 and one `ERROR`
//!   event holding a `Status` of code 410 (reason `Expired`); the client must relist;
//! - requests without the bearer token of the kubeconfig are refused with 401.
//!
//! A test can also make the transport under the API fail, as a network does rather than
//! as the API says (these are not API behaviour, and the documented API is followed for
//! everything else): [`FakeApiServer::fault_lists`] answers the next list requests with a
//! [`ListFault`]: the status line, the headers and half the list's JSON, then nothing
//! more on a connection left open (an API server killed without a reset, a load balancer
//! that failed over: a half-open connection); the list without its closing brace, then
//! one space every 100 ms for ever (a response that trickles); or the whole list followed
//! by a run of spaces (JSON whitespace: a valid list larger than the client accepts).
//! [`ListFault::Empties`] answers instead as a broken or hostile API server could, which
//! no real one does: a list whose items are empty objects (`{}`, a pod without even a
//! name), a few bytes each.
//!
//! The test drives it directly: [`FakeApiServer::apply`] and
//! [`FakeApiServer::delete`] change pods, [`FakeApiServer::compact`] drops history,
//! [`FakeApiServer::end_watches`] closes every open watch (as a server restart or a
//! load balancer would), [`FakeApiServer::close_watches_at_once`] ends every new one as
//! soon as it is opened (as a gateway could), [`FakeApiServer::hold_watches`] keeps new
//! watch requests waiting (a slow reconnect), [`FakeApiServer::bookmark`] sends a
//! bookmark now. A test waits for [`FakeApiServer::open_watches`] before it ends
//! watches or asks for bookmarks, so that every watch sees the request.

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

/// The bearer token the kubeconfig carries.
pub(crate) const TOKEN: &str = "test-token";

type Body = BoxBody<Bytes, Infallible>;

/// One change in the history.
#[derive(Clone)]
struct Change {
    rv: u64,
    /// The pod before (None: created).
    old: Option<Value>,
    /// The pod after (None: deleted; the last state is `old`).
    new: Option<Value>,
}

#[derive(Default)]
struct State {
    rv: u64,
    /// Current pods by (namespace, name).
    pods: BTreeMap<(String, String), Value>,
    history: Vec<Change>,
    /// Versions up to this one are no longer served to watches.
    compacted: u64,
    /// Requests seen: (is_watch, query string).
    requests: Vec<(bool, String)>,
    next_uid: u64,
    /// Bookmarks written to watch streams.
    bookmarks_sent: usize,
    /// While true, every request is answered 500.
    failing: bool,
    /// Watch streams open now.
    open_watches: usize,
    /// How the next list requests are answered, one each.
    list_faults: VecDeque<ListFault>,
    /// While true, every watch is answered with no event and ended at once.
    closing_watches: bool,
}

impl State {
    /// The pods as they were at `version` (not before the compacted history): the
    /// current ones, each change after `version` undone.
    fn pods_at(&self, version: u64) -> BTreeMap<(String, String), &Value> {
        let mut pods: BTreeMap<(String, String), &Value> =
            self.pods.iter().map(|(k, v)| (k.clone(), v)).collect();
        // The earliest change of each pod after `version` says how it was then.
        let mut undone = std::collections::HashSet::new();
        for change in self.history.iter().filter(|c| c.rv > version) {
            let Some(pod) = change.old.as_ref().or(change.new.as_ref()) else {
                continue;
            };
            let key = (
                pod["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                pod["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            );
            if undone.insert(key.clone()) {
                match &change.old {
                    Some(old) => pods.insert(key, old),
                    None => pods.remove(&key),
                };
            }
        }
        pods
    }
}

/// How a list request is answered instead of normally (see the module's documentation).
#[derive(Clone, Copy, Debug)]
pub(crate) enum ListFault {
    /// The headers and half the JSON, then nothing more, the connection left open.
    Stall,
    /// The JSON without its closing brace, then one space every 100 ms for ever.
    Drip,
    /// The whole JSON, then this many spaces.
    Pad(usize),
    /// The list with this many empty objects (`{}`) as its items.
    Empties(usize),
}

/// Counts one open watch stream while it lives.
struct OpenWatch(Arc<Mutex<State>>);

impl Drop for OpenWatch {
    fn drop(&mut self) {
        self.0.lock().unwrap().open_watches -= 1;
    }
}

/// The server; dropped at the end of the test with its task.
pub(crate) struct FakeApiServer {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    /// Bumped on every change and bookmark request, to wake the watches.
    changed: watch::Sender<u64>,
    /// Bumped to end every open watch.
    ends: watch::Sender<u64>,
    /// While true, new watch requests wait.
    hold: watch::Sender<bool>,
    /// Bumped to make every open watch send a bookmark.
    bookmarks: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Clone)]
struct Shared {
    state: Arc<Mutex<State>>,
    changed: watch::Receiver<u64>,
    ends: watch::Receiver<u64>,
    hold: watch::Receiver<bool>,
    bookmarks: watch::Receiver<u64>,
}

impl FakeApiServer {
    pub(crate) async fn start() -> FakeApiServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State {
            rv: 100,
            compacted: 0,
            ..State::default()
        }));
        let (changed, changed_rx) = watch::channel(0);
        let (ends, ends_rx) = watch::channel(0);
        let (hold, hold_rx) = watch::channel(false);
        let (bookmarks, bookmarks_rx) = watch::channel(0);
        let shared = Shared {
            state: Arc::clone(&state),
            changed: changed_rx,
            ends: ends_rx,
            hold: hold_rx,
            bookmarks: bookmarks_rx,
        };
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let shared = shared.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let shared = shared.clone();
                        async move { Ok::<_, Infallible>(handle(shared, req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        FakeApiServer {
            addr,
            state,
            changed,
            ends,
            hold,
            bookmarks,
            task,
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kubeconfig for this server whose context's namespace is `namespace`.
    pub(crate) fn kubeconfig(&self, namespace: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: {namespace}\n\
             current-context: fake\nusers:\n- name: fake\n  user:\n    token: {TOKEN}\n",
            self.url()
        )
    }

    /// Creates or replaces a pod (a new resourceVersion).
    pub(crate) fn apply(&self, mut pod: Value) {
        let mut s = self.state.lock().unwrap();
        s.rv += 1;
        let rv = s.rv;
        let ns = pod["metadata"]["namespace"].as_str().unwrap().to_owned();
        let name = pod["metadata"]["name"].as_str().unwrap().to_owned();
        let old = s.pods.get(&(ns.clone(), name.clone())).cloned();
        let uid = match &old {
            Some(o) => o["metadata"]["uid"].clone(),
            None => {
                s.next_uid += 1;
                json!(format!("uid-{}", s.next_uid))
            }
        };
        pod["metadata"]["uid"] = uid;
        pod["metadata"]["resourceVersion"] = json!(rv.to_string());
        pod["apiVersion"] = json!("v1");
        pod["kind"] = json!("Pod");
        s.pods.insert((ns, name), pod.clone());
        s.history.push(Change {
            rv,
            old,
            new: Some(pod),
        });
        drop(s);
        self.changed.send_modify(|v| *v += 1);
    }

    /// Deletes a pod.
    pub(crate) fn delete(&self, namespace: &str, name: &str) {
        let mut s = self.state.lock().unwrap();
        let Some(old) = s.pods.remove(&(namespace.to_owned(), name.to_owned())) else {
            panic!("no pod {namespace}/{name}");
        };
        s.rv += 1;
        // Kept as it was (a list's snapshot from before may serve it); its deletion is
        // sent at the deletion's version (`event`).
        let rv = s.rv;
        s.history.push(Change {
            rv,
            old: Some(old),
            new: None,
        });
        drop(s);
        self.changed.send_modify(|v| *v += 1);
    }

    /// Forgets the history up to now: a watch from an older version gets 410.
    pub(crate) fn compact(&self) {
        let mut s = self.state.lock().unwrap();
        s.compacted = s.rv;
        s.history.clear();
    }

    /// The current resourceVersion.
    pub(crate) fn resource_version(&self) -> u64 {
        self.state.lock().unwrap().rv
    }

    /// Ends every open watch.
    pub(crate) fn end_watches(&self) {
        self.ends.send_modify(|v| *v += 1);
    }

    /// Keeps new watch requests waiting (`true`) or lets them through.
    pub(crate) fn hold_watches(&self, hold: bool) {
        self.hold.send_replace(hold);
    }

    /// Makes every open watch that asked for bookmarks send one now.
    pub(crate) fn bookmark(&self) {
        self.bookmarks.send_modify(|v| *v += 1);
    }

    /// Answers every request 500 (`true`), ending the open watches, or serves again.
    pub(crate) fn fail_requests(&self, failing: bool) {
        self.state.lock().unwrap().failing = failing;
        if failing {
            self.end_watches();
        }
    }

    /// Answers every watch request with no event, ending it at once (`true`), as a
    /// gateway in front of the API server could, or serves watches again; when `true`,
    /// the open watches end too.
    pub(crate) fn close_watches_at_once(&self, closing: bool) {
        self.state.lock().unwrap().closing_watches = closing;
        if closing {
            self.end_watches();
        }
    }

    /// Answers the next `n` list requests with `fault`.
    pub(crate) fn fault_lists(&self, fault: ListFault, n: usize) {
        let mut s = self.state.lock().unwrap();
        s.list_faults.extend(std::iter::repeat_n(fault, n));
    }

    /// Watch streams open now (each sees every later end, bookmark and change).
    pub(crate) fn open_watches(&self) -> usize {
        self.state.lock().unwrap().open_watches
    }

    /// Bookmarks written to watch streams so far.
    pub(crate) fn bookmarks_sent(&self) -> usize {
        self.state.lock().unwrap().bookmarks_sent
    }

    /// List requests served so far.
    pub(crate) fn lists(&self) -> usize {
        self.state
            .lock()
            .unwrap()
            .requests
            .iter()
            .filter(|(w, _)| !w)
            .count()
    }

    /// Watch requests received so far (held ones included).
    pub(crate) fn watches(&self) -> usize {
        self.state
            .lock()
            .unwrap()
            .requests
            .iter()
            .filter(|(w, _)| *w)
            .count()
    }

    /// The query strings of every request so far.
    pub(crate) fn requests(&self) -> Vec<(bool, String)> {
        self.state.lock().unwrap().requests.clone()
    }
}

fn full(status: StatusCode, body: Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed())
        .unwrap()
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code,
    })
}

async fn handle(shared: Shared, req: Request<Incoming>) -> Response<Body> {
    let authorized = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        == Some(&format!("Bearer {TOKEN}"));
    if !authorized {
        return full(
            StatusCode::UNAUTHORIZED,
            status(401, "Unauthorized", "Unauthorized"),
        );
    }
    if shared.state.lock().unwrap().failing {
        // 500, as the API server answers when its storage fails (kube-rs's client
        // retries 429, 503 and 504 itself, so those would not reach the watcher soon).
        return full(
            StatusCode::INTERNAL_SERVER_ERROR,
            status(
                500,
                "InternalError",
                "an error on the server has prevented the request from succeeding",
            ),
        );
    }
    let path = req.uri().path().to_owned();
    let query = req.uri().query().unwrap_or("").to_owned();
    let params = parse_query(&query);
    let Some(namespace) = path
        .strip_prefix("/api/v1/namespaces/")
        .and_then(|rest| rest.strip_suffix("/pods"))
        .map(str::to_owned)
    else {
        return full(
            StatusCode::NOT_FOUND,
            status(
                404,
                "NotFound",
                "the server could not find the requested resource",
            ),
        );
    };
    let selector = match Selector::parse(params.get("labelSelector").map_or("", String::as_str)) {
        Ok(s) => s,
        Err(e) => {
            return full(
                StatusCode::BAD_REQUEST,
                status(
                    400,
                    "BadRequest",
                    &format!("unable to parse requirement: {e}"),
                ),
            );
        }
    };
    let is_watch = params.get("watch").is_some_and(|v| v == "true" || v == "1");
    shared
        .state
        .lock()
        .unwrap()
        .requests
        .push((is_watch, query.clone()));
    if is_watch {
        watch_pods(shared, namespace, selector, params).await
    } else {
        list_pods(&shared, &namespace, &selector, &params)
    }
}

fn list_pods(
    shared: &Shared,
    namespace: &str,
    selector: &Selector,
    params: &BTreeMap<String, String>,
) -> Response<Body> {
    let mut s = shared.state.lock().unwrap();
    let fault = s.list_faults.pop_front();
    // Pagination: the first page is of the current version; `continue` names that
    // version and the last name served, and every later page is of the same snapshot,
    // at the same version; `limit` bounds the page.
    let (version, after) = match params.get("continue") {
        None => (s.rv, String::new()),
        Some(token) => match token
            .split_once('/')
            .and_then(|(rv, name)| Some((rv.parse::<u64>().ok()?, name.to_owned())))
        {
            Some((rv, _)) if rv < s.compacted => {
                return full(
                    StatusCode::GONE,
                    status(
                        410,
                        "Expired",
                        "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
                    ),
                );
            }
            Some(at) => at,
            None => {
                return full(
                    StatusCode::BAD_REQUEST,
                    status(400, "BadRequest", "invalid continue token"),
                );
            }
        },
    };
    let limit = params
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0)
        .unwrap_or(usize::MAX);
    let matching: Vec<&Value> = s
        .pods_at(version)
        .into_iter()
        .filter(|((ns, name), pod)| ns == namespace && *name > after && selector.matches(pod))
        .map(|(_, pod)| pod)
        .collect();
    let page: Vec<Value> = matching.iter().take(limit).map(|p| (*p).clone()).collect();
    let mut metadata = json!({ "resourceVersion": version.to_string() });
    if matching.len() > limit
        && let Some(last) = page.last()
    {
        let name = last["metadata"]["name"].as_str().unwrap_or_default();
        metadata["continue"] = json!(format!("{version}/{name}"));
    }
    let list =
        json!({ "kind": "PodList", "apiVersion": "v1", "metadata": metadata, "items": page });
    match fault {
        None => full(StatusCode::OK, list),
        Some(ListFault::Empties(n)) => {
            let metadata = json!({ "resourceVersion": s.rv.to_string() });
            let items = vec![json!({}); n];
            full(
                StatusCode::OK,
                json!({ "kind": "PodList", "apiVersion": "v1", "metadata": metadata, "items": items }),
            )
        }
        Some(fault) => faulty(list.to_string(), fault),
    }
}

/// A list response that fails as `fault` says, sent chunked as the API server sends a
/// large list.
fn faulty(text: String, fault: ListFault) -> Response<Body> {
    type Frames = std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<Frame<Bytes>, Infallible>> + Send + Sync>,
    >;
    fn data(b: Bytes) -> Result<Frame<Bytes>, Infallible> {
        Ok(Frame::data(b))
    }
    let body: Frames = match fault {
        // Answered whole by `list_pods`.
        ListFault::Empties(_) => Box::pin(futures::stream::iter([data(Bytes::from(text))])),
        ListFault::Stall => {
            let half = text.len() / 2;
            let half = Bytes::from(text).slice(..half);
            Box::pin(futures::stream::iter([data(half)]).chain(futures::stream::pending()))
        }
        ListFault::Drip => {
            let open = Bytes::from(text.strip_suffix('}').unwrap_or(&text).to_owned());
            let drip = futures::stream::unfold((), |()| async {
                tokio::time::sleep(Duration::from_millis(100)).await;
                Some((data(Bytes::from_static(b" ")), ()))
            });
            Box::pin(futures::stream::iter([data(open)]).chain(drip))
        }
        ListFault::Pad(n) => {
            const CHUNK: usize = 64 * 1024;
            let spaces = Bytes::from(vec![b' '; CHUNK]);
            let pad =
                (0..n.div_ceil(CHUNK)).map(move |i| data(spaces.slice(..CHUNK.min(n - i * CHUNK))));
            Box::pin(futures::stream::iter(
                std::iter::once(data(Bytes::from(text))).chain(pad),
            ))
        }
    };
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .header("transfer-encoding", "chunked")
        .body(BodyExt::boxed(StreamBody::new(body)))
        .unwrap()
}

async fn watch_pods(
    shared: Shared,
    namespace: String,
    selector: Selector,
    params: BTreeMap<String, String>,
) -> Response<Body> {
    let mut hold = shared.hold.clone();
    let _ = hold.wait_for(|h| !h).await;
    if shared.state.lock().unwrap().closing_watches {
        return Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/json")
            .header("transfer-encoding", "chunked")
            .body(BodyExt::boxed(StreamBody::new(futures::stream::empty::<
                Result<Frame<Bytes>, Infallible>,
            >())))
            .unwrap();
    }
    let Some(mut cursor) = params
        .get("resourceVersion")
        .and_then(|rv| rv.parse::<u64>().ok())
    else {
        return full(
            StatusCode::BAD_REQUEST,
            status(
                400,
                "BadRequest",
                "this test server watches from a resourceVersion",
            ),
        );
    };
    let timeout = params
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map_or(Duration::from_secs(1800), Duration::from_secs);
    let bookmarks = params
        .get("allowWatchBookmarks")
        .is_some_and(|v| v == "true");
    let (tx, rx) = mpsc::channel::<Value>(64);
    let mut changed = shared.changed.clone();
    let mut ends = shared.ends.clone();
    let mut marks = shared.bookmarks.clone();
    changed.mark_changed();
    ends.borrow_and_update();
    marks.borrow_and_update();
    // Counted as open once it sees every later end and bookmark request.
    shared.state.lock().unwrap().open_watches += 1;
    let open = OpenWatch(Arc::clone(&shared.state));
    tokio::spawn(async move {
        let _open = open;
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                _ = &mut deadline => return,
                _ = ends.changed() => return,
                r = changed.changed() => {
                    if r.is_err() { return; }
                    let (events, expired) = {
                        let s = shared.state.lock().unwrap();
                        if cursor < s.compacted {
                            (Vec::new(), Some(s.compacted))
                        } else {
                            let events = s.history.iter().filter(|c| c.rv > cursor).filter_map(|c| event(c, &namespace, &selector)).collect::<Vec<_>>();
                            cursor = s.rv;
                            (events, None)
                        }
                    };
                    if let Some(compacted) = expired {
                        let message = format!("too old resource version: {cursor} ({compacted})");
                        let _ = tx.send(json!({"type": "ERROR", "object": status(410, "Expired", &message)})).await;
                        return;
                    }
                    for e in events {
                        if tx.send(e).await.is_err() { return; }
                    }
                }
                r = marks.changed() => {
                    if r.is_err() { return; }
                    if bookmarks {
                        let rv = {
                            let mut s = shared.state.lock().unwrap();
                            s.bookmarks_sent += 1;
                            s.rv
                        };
                        cursor = cursor.max(rv);
                        let mark = json!({"type": "BOOKMARK", "object": {
                            "kind": "Pod", "apiVersion": "v1",
                            "metadata": {"resourceVersion": rv.to_string()},
                        }});
                        if tx.send(mark).await.is_err() { return; }
                    }
                }
            }
        }
    });
    let body = futures::stream::unfold(rx, |mut rx| async move {
        let event = rx.recv().await?;
        let line = format!("{event}\n");
        Some((Ok::<_, Infallible>(Frame::data(Bytes::from(line))), rx))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .header("transfer-encoding", "chunked")
        .body(BodyExt::boxed(StreamBody::new(body)))
        .unwrap()
}

/// The watch event a change makes for a watch of `namespace` and `selector`, if any.
fn event(change: &Change, namespace: &str, selector: &Selector) -> Option<Value> {
    let in_scope = |pod: &Value| pod["metadata"]["namespace"] == namespace && selector.matches(pod);
    let was = change.old.as_ref().is_some_and(in_scope);
    match &change.new {
        Some(new) => {
            let is = in_scope(new);
            let kind = match (was, is) {
                (false, true) => "ADDED",
                (true, true) => "MODIFIED",
                (true, false) => "DELETED",
                (false, false) => return None,
            };
            Some(json!({"type": kind, "object": new}))
        }
        // A deleted object is sent in its last state, at the deletion's version.
        None if was => {
            let mut old = change.old.clone()?;
            old["metadata"]["resourceVersion"] = json!(change.rv.to_string());
            Some(json!({"type": "DELETED", "object": old}))
        }
        None => None,
    }
}

fn parse_query(query: &str) -> BTreeMap<String, String> {
    query
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// Percent-decoding (and `+` as a space), as for `application/x-www-form-urlencoded`.
fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                    }
                    Err(_) => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A label selector: requirements that must all hold.
#[derive(Debug)]
pub(crate) struct Selector(Vec<Requirement>);

#[derive(Debug)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

impl Selector {
    /// Parses the label selector syntax (kubernetes.io/docs/concepts/overview/
    /// working-with-objects/labels/#label-selectors): comma-separated requirements,
    /// `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`, `k`, `!k`.
    pub(crate) fn parse(s: &str) -> Result<Selector, String> {
        let mut parts = Vec::new();
        let (mut depth, mut start) = (0, 0);
        for (i, c) in s.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&s[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        parts.push(&s[start..]);
        let set = |rest: &str| -> Result<Vec<String>, String> {
            let inner = rest
                .trim()
                .strip_prefix('(')
                .and_then(|r| r.strip_suffix(')'))
                .ok_or_else(|| format!("`{rest}`: expected (values)"))?;
            Ok(inner.split(',').map(|v| v.trim().to_owned()).collect())
        };
        let mut reqs = Vec::new();
        for part in parts.into_iter().map(str::trim).filter(|p| !p.is_empty()) {
            let req = if let Some((k, v)) = part.split_once("!=") {
                Requirement::NotEquals(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = part.split_once("==") {
                Requirement::Equals(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = part.split_once('=') {
                Requirement::Equals(k.trim().into(), v.trim().into())
            } else if let Some((k, rest)) = part.split_once(" notin ") {
                Requirement::NotIn(k.trim().into(), set(rest)?)
            } else if let Some((k, rest)) = part.split_once(" in ") {
                Requirement::In(k.trim().into(), set(rest)?)
            } else if let Some(k) = part.strip_prefix('!') {
                Requirement::NotExists(k.trim().into())
            } else if part
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
            {
                Requirement::Exists(part.into())
            } else {
                return Err(format!("`{part}`"));
            };
            reqs.push(req);
        }
        Ok(Selector(reqs))
    }

    pub(crate) fn matches(&self, pod: &Value) -> bool {
        let labels = &pod["metadata"]["labels"];
        let get = |k: &str| labels.get(k).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            Requirement::Equals(k, v) => get(k) == Some(v.as_str()),
            Requirement::NotEquals(k, v) => get(k) != Some(v.as_str()),
            Requirement::In(k, vs) => get(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            Requirement::NotIn(k, vs) => get(k).is_none_or(|l| vs.iter().all(|v| v != l)),
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::NotExists(k) => get(k).is_none(),
        })
    }
}

/// A pod as the test describes it.
pub(crate) struct PodDesc<'a> {
    pub(crate) namespace: &'a str,
    pub(crate) name: &'a str,
    pub(crate) labels: &'a [(&'a str, &'a str)],
    pub(crate) annotations: &'a [(&'a str, &'a str)],
    pub(crate) ip: &'a str,
    pub(crate) port: u16,
    pub(crate) phase: &'a str,
    pub(crate) ready: bool,
}

impl PodDesc<'_> {
    /// The pod's JSON as the API server stores it.
    pub(crate) fn json(&self) -> Value {
        let labels: serde_json::Map<String, Value> = self
            .labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect();
        let annotations: serde_json::Map<String, Value> = self
            .annotations
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect();
        json!({
            "metadata": {
                "name": self.name, "namespace": self.namespace,
                "labels": labels, "annotations": annotations,
                "creationTimestamp": "2026-11-24T00:00:00Z",
            },
            "spec": {
                "containers": [{
                    "name": "engine", "image": "vllm/vllm-openai",
                    "ports": [{"name": "http", "containerPort": self.port, "protocol": "TCP"}],
                }],
            },
            "status": {
                "phase": self.phase,
                "podIP": self.ip,
                "podIPs": [{"ip": self.ip}],
                "conditions": [
                    {"type": "PodScheduled", "status": "True"},
                    {"type": "Ready", "status": if self.ready { "True" } else { "False" }},
                ],
            },
        })
    }
}

/// `pod` (a [`PodDesc::json`]) made as heavy as a real pod with sidecars gets: its
/// engine container and `containers - 1` more, each with `env` environment variables
/// (a quarter of them from the downward API), a dozen arguments, three ports, eight
/// volume mounts, three probes, resources and a security context; eight volumes; a
/// status for each container; and the `managedFields` a controller and the kubelet
/// write for all of it (an object for every field, `{}` at every leaf). Three
/// containers of 60 variables each make about 1,700 JSON objects and as many values.
pub(crate) fn heavy(mut pod: Value, containers: usize, env: usize) -> Value {
    let port = pod["spec"]["containers"][0]["ports"][0]["containerPort"].clone();
    let probe = json!({
        "httpGet": {"path": "/health", "port": port, "scheme": "HTTP"},
        "initialDelaySeconds": 10, "periodSeconds": 10, "timeoutSeconds": 1,
        "successThreshold": 1, "failureThreshold": 3,
    });
    let probe_fields = json!({
        ".": {}, "f:httpGet": {".": {}, "f:path": {}, "f:port": {}, "f:scheme": {}},
        "f:initialDelaySeconds": {}, "f:periodSeconds": {}, "f:timeoutSeconds": {},
        "f:successThreshold": {}, "f:failureThreshold": {},
    });
    let mut specs = Vec::new();
    let mut statuses = Vec::new();
    let mut container_fields = serde_json::Map::new();
    for c in 0..containers {
        let name = if c == 0 {
            "engine".to_owned()
        } else {
            format!("sidecar-{c}")
        };
        let mut vars = Vec::new();
        let mut var_fields = serde_json::Map::new();
        var_fields.insert(".".into(), json!({}));
        for i in 0..env {
            let var = format!("{}_SETTING_{i}", name.to_uppercase().replace('-', "_"));
            let (spec, fields) = if i % 4 == 0 {
                (
                    json!({"name": var, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}}),
                    json!({".": {}, "f:name": {}, "f:valueFrom": {".": {}, "f:fieldRef": {}}}),
                )
            } else {
                (
                    json!({"name": var, "value": format!("value-{i}-of-a-realistic-length")}),
                    json!({".": {}, "f:name": {}, "f:value": {}}),
                )
            };
            vars.push(spec);
            var_fields.insert(format!("k:{{\"name\":\"{var}\"}}"), fields);
        }
        let mut ports = Vec::new();
        let mut port_fields = serde_json::Map::new();
        port_fields.insert(".".into(), json!({}));
        for p in 0..3 {
            let (pname, number) = if c == 0 && p == 0 {
                ("http".to_owned(), port.clone())
            } else {
                (format!("p{p}"), json!(9000 + 10 * c + p))
            };
            port_fields.insert(
                format!("k:{{\"containerPort\":{number},\"protocol\":\"TCP\"}}"),
                json!({".": {}, "f:containerPort": {}, "f:name": {}, "f:protocol": {}}),
            );
            ports.push(json!({"name": pname, "containerPort": number, "protocol": "TCP"}));
        }
        let mut mounts = Vec::new();
        let mut mount_fields = serde_json::Map::new();
        mount_fields.insert(".".into(), json!({}));
        for v in 0..8 {
            mounts.push(json!({"name": format!("vol{v}"), "mountPath": format!("/mnt/{name}/v{v}"), "readOnly": true}));
            mount_fields.insert(
                format!("k:{{\"mountPath\":\"/mnt/{name}/v{v}\"}}"),
                json!({".": {}, "f:mountPath": {}, "f:name": {}, "f:readOnly": {}}),
            );
        }
        let image = format!("registry.example.com/{name}:v1.2.3");
        specs.push(json!({
            "name": name, "image": image, "imagePullPolicy": "IfNotPresent",
            "args": (0..12).map(|a| format!("--setting-{a}=value")).collect::<Vec<_>>(),
            "ports": ports, "env": vars,
            "resources": {
                "limits": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "1"},
                "requests": {"cpu": "4", "memory": "32Gi", "nvidia.com/gpu": "1"},
            },
            "volumeMounts": mounts,
            "readinessProbe": probe, "livenessProbe": probe, "startupProbe": probe,
            "securityContext": {
                "allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]},
                "runAsNonRoot": true, "runAsUser": 1337, "readOnlyRootFilesystem": true,
            },
            "terminationMessagePath": "/dev/termination-log",
            "terminationMessagePolicy": "File",
        }));
        let resources = json!({".": {}, "f:cpu": {}, "f:memory": {}, "f:nvidia.com/gpu": {}});
        container_fields.insert(
            format!("k:{{\"name\":\"{name}\"}}"),
            json!({
                ".": {}, "f:name": {}, "f:image": {}, "f:imagePullPolicy": {}, "f:args": {},
                "f:env": var_fields, "f:ports": port_fields, "f:volumeMounts": mount_fields,
                "f:resources": {".": {}, "f:limits": resources, "f:requests": resources},
                "f:readinessProbe": probe_fields, "f:livenessProbe": probe_fields,
                "f:startupProbe": probe_fields,
                "f:securityContext": {
                    ".": {}, "f:allowPrivilegeEscalation": {},
                    "f:capabilities": {".": {}, "f:drop": {}}, "f:runAsNonRoot": {},
                    "f:runAsUser": {}, "f:readOnlyRootFilesystem": {},
                },
                "f:terminationMessagePath": {}, "f:terminationMessagePolicy": {},
            }),
        );
        statuses.push(json!({
            "name": name, "image": image, "imageID": format!("sha256:{:064}", c),
            "containerID": format!("containerd://{:064}", c), "ready": true,
            "restartCount": 0, "started": true,
            "state": {"running": {"startedAt": "2026-11-24T00:00:10Z"}}, "lastState": {},
        }));
    }
    let mut volumes = Vec::new();
    let mut volume_fields = serde_json::Map::new();
    volume_fields.insert(".".into(), json!({}));
    for v in 0..8 {
        volumes.push(json!({"name": format!("vol{v}"), "configMap": {"name": format!("config-{v}"), "defaultMode": 420}}));
        volume_fields.insert(
            format!("k:{{\"name\":\"vol{v}\"}}"),
            json!({".": {}, "f:configMap": {".": {}, "f:defaultMode": {}, "f:name": {}}, "f:name": {}}),
        );
    }
    let mut condition_fields = serde_json::Map::new();
    for c in pod["status"]["conditions"].as_array().into_iter().flatten() {
        condition_fields.insert(
            format!("k:{{\"type\":\"{}\"}}", c["type"].as_str().unwrap_or_default()),
            json!({".": {}, "f:lastProbeTime": {}, "f:lastTransitionTime": {}, "f:status": {}, "f:type": {}}),
        );
    }
    pod["spec"]["containers"] = json!(specs);
    pod["spec"]["volumes"] = json!(volumes);
    pod["spec"]["tolerations"] = json!([
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
    ]);
    pod["status"]["containerStatuses"] = json!(statuses);
    pod["metadata"]["managedFields"] = json!([
        {
            "manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1",
            "time": "2026-11-24T00:00:00Z", "fieldsType": "FieldsV1",
            "fieldsV1": {
                "f:metadata": {"f:labels": {".": {}, "f:app": {}, "f:role": {}, "f:model": {}}},
                "f:spec": {
                    "f:containers": container_fields, "f:volumes": volume_fields,
                    "f:tolerations": {}, "f:restartPolicy": {}, "f:dnsPolicy": {},
                },
            },
        },
        {
            "manager": "kubelet", "operation": "Update", "apiVersion": "v1",
            "time": "2026-11-24T00:00:10Z", "fieldsType": "FieldsV1", "subresource": "status",
            "fieldsV1": {"f:status": {
                "f:conditions": condition_fields, "f:containerStatuses": {}, "f:phase": {},
                "f:podIP": {}, "f:podIPs": {".": {}, "k:{\"ip\":\"10.0.0.1\"}": {".": {}, "f:ip": {}}},
            }},
        },
    ]);
    pod
}

#[test]
fn selectors_parse_and_match() {
    let pod = json!({"metadata": {"labels": {"app": "vllm", "role": "prefill"}}});
    for (s, m) in [
        ("app=vllm,role=prefill", true),
        ("app==vllm,role!=decode", true),
        ("app in (vllm, sglang),role notin (decode)", true),
        ("app,!gpu", true),
        ("role=decode", false),
        ("app notin (vllm)", false),
        ("!app", false),
        ("", true),
    ] {
        assert_eq!(Selector::parse(s).unwrap().matches(&pod), m, "{s}");
    }
    assert!(Selector::parse("app in vllm").is_err());
    assert_eq!(
        decode("app%3Dvllm%2Crole%3Dprefill"),
        "app=vllm,role=prefill"
    );
}
