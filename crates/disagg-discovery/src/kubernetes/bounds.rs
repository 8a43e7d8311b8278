//! Bounds on what the kube client takes from the API server, a tower layer over kube-rs's
//! own stack ([`kube::client::ClientBuilder::with_layer`]):
//!
//! - a list request (any request but a watch) has [`Bounds::request_timeout`] for its
//!   response, its whole body included; a watch has it for its response headers only
//!   (its events are bounded by the read timeout and the watch timeout);
//! - a list response's body may hold at most [`Bounds::max_bytes`] bytes, refused at once
//!   when its `Content-Length` says more; one watch event (a line of the stream) at most
//!   as many;
//! - a list response's body may hold at most [`Bounds::max_objects`] JSON objects (`{`
//!   outside strings) and [`Bounds::max_values`] JSON values (`[` and `,` outside
//!   strings), counted as the bytes come; one watch event at most as many. Pods are
//!   decoded into [`EnginePod`](super::EnginePod)s: what they hold besides the fields
//!   discovery reads is skipped unread (a `{"name":""}` volume, a free-form
//!   `managedFields[].fieldsV1`: nothing), and what it keeps (a pod, a container, a
//!   port, a condition) is read from a JSON object only, never from an array. Two things
//!   serde's derives make are buffered whole before that, each JSON object of them into
//!   up to 256 bytes of serde's `Content` and each value into up to 128 (a one-member
//!   object, a one-element array; `tests/pod_memory.rs`): a watch event whose `object`
//!   comes before its `type` (kube-rs's `WatchEvent` is adjacently tagged; the API
//!   server writes `type` first), and a list's members besides `metadata` and `items`
//!   (`ObjectList` flattens its `TypeMeta`; the API server sends only `kind` and
//!   `apiVersion`). Bytes alone still do not bound what a page decodes into: an empty
//!   object in its `items`, 2 bytes, decodes into a whole pod of 456 bytes (an empty
//!   `ObjectMeta` of 360, no spec, no status), and a member of a pod's labels or
//!   annotations, `"k":"",` in 7 bytes, into about 130 bytes, its share of the map's
//!   B-tree nodes and its key's allocation, rounded up by the allocator (a map's keys
//!   are distinct, a later duplicate replacing the one before, so that 64 MiB of
//!   members in one map are 6.8 million, most with keys of 4 bytes, `"abcd":"",`: about
//!   0.9 GB, 0.67 GB of it asked of the allocator). What these counts leave is in
//!   [`max_objects`] and [`max_values`].
//!
//! kube-rs collects a list's body whole and splits a watch's stream into lines with no
//! length limit; these bounds end such a request with an error (the watcher logs it,
//! counts it and retries with backoff) before more is read.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use http::{Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};
use tower::{BoxError, Layer, Service};

/// The bounds, as a [`Layer`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Bounds {
    /// The longest a list request may take, body included; a watch until its headers.
    pub(super) request_timeout: Duration,
    /// The most bytes of a list's body, and of one watch event.
    pub(super) max_bytes: usize,
    /// The most JSON objects in a list's body, and in one watch event ([`max_objects`]).
    pub(super) max_objects: usize,
    /// The most JSON values in a list's body, and in one watch event ([`max_values`]).
    pub(super) max_values: usize,
}

/// The JSON objects a pod of a list page may have on average, 4,096: a real pod has a
/// few hundred (its `managedFields` most of them, with an object at every leaf), one
/// with three containers of 60 environment variables each about 1,700, and service-mesh
/// sidecars add more.
pub(super) const OBJECTS_PER_POD: usize = 4096;

/// The JSON values a pod of a list page may have on average, 16,384: a real pod has
/// about as many as it has objects (the pod above: 1,711), under a ninth of this.
pub(super) const VALUES_PER_POD: usize = 16_384;

/// The least page size the counts are made for, so that one large pod (a watch event,
/// a page of one) has room: a smaller page lowers them no further.
const MIN_PAGE_FOR_COUNTS: u32 = 16;

/// `per_pod` for each pod of a page of `page_size`, counted as at least
/// [`MIN_PAGE_FOR_COUNTS`].
fn per_page(page_size: u32, per_pod: usize) -> usize {
    usize::try_from(page_size.max(MIN_PAGE_FOR_COUNTS))
        .unwrap_or(usize::MAX)
        .saturating_mul(per_pod)
}

/// The most JSON objects in a list response or a watch event for pages of `page_size`
/// pods: [`OBJECTS_PER_POD`] for each pod of a page, the page counted as at least 16
/// pods (65,536 objects; 409,600 for the default page of 100).
///
/// Each pod, container, port and condition a page decodes into stands for a JSON object
/// (each is read from one only; objects in what a pod holds besides are skipped, not
/// decoded), and so does each map of labels or annotations: the largest a map, whose
/// B-tree takes a leaf of 544 bytes for a single member, and a pod, 456 bytes however
/// little it holds (`{}`, 3 bytes with its comma), in a vector that may have grown to
/// twice as many slots. The default page's objects take at worst about 290 MB (262,147
/// pods in a vector of 524,288 slots, 239 MB, and 98,300 maps of one member, 53 MB),
/// those of a page of 16 or fewer pods about 42 MB (see [`max_values`]).
pub(super) fn max_objects(page_size: u32) -> usize {
    per_page(page_size, OBJECTS_PER_POD)
}

/// The most JSON values in a list response or a watch event for pages of `page_size`
/// pods: [`VALUES_PER_POD`] for each pod of a page, the page counted as at least 16
/// pods (262,144 values; 1,638,400 for the default page of 100). Every value but the
/// outermost follows a `{`, a `[` or a `,`: with [`max_objects`], this bounds the
/// members of the pods' labels and annotations, the one thing a pod keeps that needs no
/// JSON object of its own, each about 160 bytes decoded (its share of the map's B-tree
/// nodes, and its key and value of up to 24 bytes each in allocations of 32): about
/// 210 MB for the 1.3 million values the objects leave of the default page, 35 MB for a
/// page of 16. A map of one member takes a whole B-tree leaf (544 bytes) for its one
/// JSON object, but needs a pod and the pod's metadata, a JSON object each (shared by
/// the pod's two maps): the worst page has one pod more than a power of two (its vector
/// of pods grown to twice as many slots), as many of them with two maps of one member
/// as its objects allow.
///
/// The worst page `tests/pod_memory.rs` builds (its `#[ignore]`d tests print these
/// figures) holds 0.47 GB once decoded for the default page (262,147 pods, 49,150 of
/// them with two maps of one member; 1,327,104 labels, 56 MB of them strings, whose
/// bytes decode into as many) and 0.13 GB for a page of 16 (65 MB of it the strings its
/// 64 MiB hold). Each peaks higher while it decodes when those strings are
/// one with an escape, which serde_json assembles in its scratch buffer and keeps until
/// the parse ends (up to 64 MiB more): at 0.52 GB and 0.19 GB. A watch event within the
/// default page's counts whose pod is buffered whole first (above) peaks at 0.49 GB.
/// These are bytes asked of the allocator, the text besides, and they are per page or
/// watch event, not for the process: kube-rs's reflector keeps a clone of each pod it
/// takes, during a relist those listed so far beside its store, for each of up to three
/// selectors. 100 of the heavy real pods above, 4.5 MB, decode into about 0.2 MB (about
/// 41 MB as k8s-openapi's `Pod`s).
pub(super) fn max_values(page_size: u32) -> usize {
    per_page(page_size, VALUES_PER_POD)
}

impl<S> Layer<S> for Bounds {
    type Service = Bounded<S>;

    fn layer(&self, inner: S) -> Bounded<S> {
        Bounded {
            inner,
            bounds: *self,
        }
    }
}

/// What a bounded request failed of.
#[derive(Debug, thiserror::Error)]
enum BoundError {
    /// The request took longer than the request timeout.
    #[error("the API server's response took longer than {0:?}")]
    TimedOut(Duration),
    /// A list response's body is larger than the ceiling.
    #[error("the API server's response is larger than {0} bytes")]
    TooLarge(usize),
    /// A watch event is longer than the ceiling.
    #[error("a watch event from the API server is longer than {0} bytes")]
    EventTooLong(usize),
    /// A list response's body holds more JSON objects than the ceiling.
    #[error("the API server's response holds more than {0} JSON objects")]
    TooManyObjects(usize),
    /// A watch event holds more JSON objects than the ceiling.
    #[error("a watch event from the API server holds more than {0} JSON objects")]
    EventTooManyObjects(usize),
    /// A list response's body holds more JSON values than the ceiling.
    #[error("the API server's response holds more than {0} JSON values")]
    TooManyValues(usize),
    /// A watch event holds more JSON values than the ceiling.
    #[error("a watch event from the API server holds more than {0} JSON values")]
    EventTooManyValues(usize),
}

/// The service [`Bounds`] makes of kube-rs's.
#[derive(Debug)]
pub(super) struct Bounded<S> {
    inner: S,
    bounds: Bounds,
}

impl<S, B, RB> Service<Request<B>> for Bounded<S>
where
    S: Service<Request<B>, Response = Response<RB>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    RB: Body<Data = Bytes> + Unpin,
    RB::Error: Into<BoxError>,
{
    type Response = Response<BoundedBody<RB>>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Self::Response, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let Bounds {
            request_timeout,
            max_bytes,
            max_objects,
            max_values,
        } = self.bounds;
        let watch = is_watch(request.uri());
        // No deadline for a timeout too large to be one.
        let deadline = Instant::now().checked_add(request_timeout);
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, response)
                    .await
                    .map_err(|_| BoundError::TimedOut(request_timeout))?,
                None => response.await,
            }
            .map_err(Into::into)?;
            Ok(response.map(|inner| BoundedBody {
                inner,
                kind: if watch { Kind::Watch } else { Kind::List },
                seen: 0,
                max_bytes,
                objects: Objects::default(),
                max_objects,
                max_values,
                deadline: deadline
                    .filter(|_| !watch)
                    .map(|d| Box::pin(tokio::time::sleep_until(d))),
                request_timeout,
                done: false,
            }))
        })
    }
}

/// Whether `uri` asks for a watch (`watch=true`, or `1`, in its query).
pub(super) fn is_watch(uri: &Uri) -> bool {
    uri.query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"))
}

/// What a response's body is bounded as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Its whole length and time.
    List,
    /// Each line's length.
    Watch,
}

/// A response body within [`Bounds`].
#[derive(Debug)]
pub(super) struct BoundedBody<B> {
    inner: B,
    kind: Kind,
    /// A list's bytes so far; a watch's since its last newline.
    seen: usize,
    max_bytes: usize,
    /// A list's JSON objects and values so far; a watch's since its last newline.
    objects: Objects,
    max_objects: usize,
    max_values: usize,
    /// A list's deadline.
    deadline: Option<Pin<Box<Sleep>>>,
    request_timeout: Duration,
    /// Failed or ended: nothing more is read.
    done: bool,
}

impl<B> BoundedBody<B> {
    fn fail(&mut self, error: BoundError) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.done = true;
        Poll::Ready(Some(Err(error.into())))
    }
}

impl<B> Body for BoundedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        if this.deadline.as_ref().is_some_and(|d| d.is_elapsed()) {
            return this.fail(BoundError::TimedOut(this.request_timeout));
        }
        // What the response says is still to come counts before it is read.
        let announced = usize::try_from(this.inner.size_hint().lower()).unwrap_or(usize::MAX);
        if this.kind == Kind::List && this.seen.saturating_add(announced) > this.max_bytes {
            return this.fail(BoundError::TooLarge(this.max_bytes));
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    let (longest, most_objects, most_values) = match this.kind {
                        Kind::List => {
                            this.seen = this.seen.saturating_add(data.len());
                            this.objects.scan(data);
                            (this.seen, this.objects.count, this.objects.values)
                        }
                        Kind::Watch => {
                            // Each line the frame ends, the one left open included,
                            // with what came of it before.
                            let (mut longest, mut most, mut values) = (0, 0, 0);
                            let mut lines = data.split(|&b| b == b'\n').peekable();
                            while let Some(line) = lines.next() {
                                this.seen = this.seen.saturating_add(line.len());
                                this.objects.scan(line);
                                longest = longest.max(this.seen);
                                most = most.max(this.objects.count);
                                values = values.max(this.objects.values);
                                if lines.peek().is_some() {
                                    this.seen = 0;
                                    this.objects = Objects::default();
                                }
                            }
                            (longest, most, values)
                        }
                    };
                    if longest > this.max_bytes {
                        return this.fail(match this.kind {
                            Kind::List => BoundError::TooLarge(this.max_bytes),
                            Kind::Watch => BoundError::EventTooLong(this.max_bytes),
                        });
                    }
                    if most_objects > this.max_objects {
                        return this.fail(match this.kind {
                            Kind::List => BoundError::TooManyObjects(this.max_objects),
                            Kind::Watch => BoundError::EventTooManyObjects(this.max_objects),
                        });
                    }
                    if most_values > this.max_values {
                        return this.fail(match this.kind {
                            Kind::List => BoundError::TooManyValues(this.max_values),
                            Kind::Watch => BoundError::EventTooManyValues(this.max_values),
                        });
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => {
                this.done = true;
                Poll::Ready(None)
            }
            Poll::Pending => {
                let elapsed = this
                    .deadline
                    .as_mut()
                    .is_some_and(|d| d.as_mut().poll(cx).is_ready());
                if elapsed {
                    this.fail(BoundError::TimedOut(this.request_timeout))
                } else {
                    Poll::Pending
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if self.done {
            SizeHint::with_exact(0)
        } else {
            self.inner.size_hint()
        }
    }
}

/// The JSON objects and values of a text read in pieces: each `{` outside a string an
/// object, each `[` and `,` outside one a value (an array's first element or a value
/// after another), a string's state (and an escape in it) carried from one piece to the
/// next.
#[derive(Debug, Default, Clone, Copy)]
struct Objects {
    count: usize,
    values: usize,
    in_string: bool,
    escaped: bool,
}

impl Objects {
    /// Counts the objects and values `bytes` open.
    fn scan(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
            } else if b == b'"' {
                self.in_string = true;
            } else if b == b'{' {
                self.count = self.count.saturating_add(1);
            } else if b == b'[' || b == b',' {
                self.values = self.values.saturating_add(1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full, StreamBody};

    type TestBody = Pin<Box<dyn Body<Data = Bytes, Error = BoxError> + Send>>;

    type Inner = tower::util::BoxService<Request<()>, Response<TestBody>, BoxError>;

    /// A service answering every request with the body `make` builds.
    fn bounded(
        bounds: Bounds,
        make: impl Fn() -> TestBody + Send + Clone + 'static,
    ) -> Bounded<Inner> {
        let inner = tower::service_fn(move |_: Request<()>| {
            let make = make.clone();
            async move { Ok::<_, BoxError>(Response::new(make())) }
        });
        bounds.layer(Inner::new(inner))
    }

    fn request(uri: &str) -> Request<()> {
        Request::builder().uri(uri).body(()).unwrap()
    }

    /// Frames after a delay each: `(delay, bytes)`.
    fn timed(frames: Vec<(Duration, &'static [u8])>) -> TestBody {
        let stream = futures::stream::unfold(frames.into_iter(), |mut rest| async move {
            let (delay, bytes) = rest.next()?;
            tokio::time::sleep(delay).await;
            Some((
                Ok::<_, BoxError>(Frame::data(Bytes::from_static(bytes))),
                rest,
            ))
        });
        Box::pin(StreamBody::new(stream))
    }

    async fn collect(service: &mut Bounded<Inner>, uri: &str) -> Result<Bytes, String> {
        let response = service
            .call(request(uri))
            .await
            .map_err(|e| e.to_string())?;
        let body = response.into_body().collect().await;
        body.map(|b| b.to_bytes()).map_err(|e| e.to_string())
    }

    const LIST: &str = "http://api/api/v1/namespaces/llm/pods?&labelSelector=a&limit=100";
    const WATCH: &str = "http://api/api/v1/namespaces/llm/pods?&watch=true&timeoutSeconds=290";

    #[test]
    fn watches_are_told_by_their_query() {
        assert!(is_watch(&WATCH.parse().unwrap()));
        assert!(is_watch(&"http://a/p?watch=1".parse().unwrap()));
        assert!(!is_watch(&LIST.parse().unwrap()));
        assert!(!is_watch(&"http://a/p?watch=false".parse().unwrap()));
        assert!(!is_watch(
            &"http://a/p?allowWatchBookmarks=true".parse().unwrap()
        ));
    }

    /// A list announced past the ceiling fails before its body is read; one within it,
    /// at the ceiling exactly, passes; one sent chunked past it fails once it passes.
    #[tokio::test]
    async fn a_list_past_the_ceiling_fails() {
        let bounds = Bounds {
            request_timeout: Duration::from_secs(60),
            max_bytes: 1000,
            max_objects: usize::MAX,
            max_values: usize::MAX,
        };
        let announced = |n: usize| -> TestBody {
            Box::pin(Full::new(Bytes::from(vec![b' '; n])).map_err(|e| match e {}))
        };
        let mut at = bounded(bounds, move || announced(1000));
        assert_eq!(collect(&mut at, LIST).await.unwrap().len(), 1000);
        let mut past = bounded(bounds, move || announced(1001));
        let err = collect(&mut past, LIST).await.unwrap_err();
        assert!(err.contains("larger than 1000 bytes"), "{err}");
        let chunked = || timed(vec![(Duration::ZERO, &[b' '; 600]); 2]);
        let mut chunked = bounded(bounds, chunked);
        let err = collect(&mut chunked, LIST).await.unwrap_err();
        assert!(err.contains("larger than 1000 bytes"), "{err}");
        // A watch is bounded by the line, not by its length in all.
        let lines = || timed(vec![(Duration::ZERO, b"{\"type\":\"ADDED\"}\n"); 100]);
        let mut lines = bounded(bounds, lines);
        assert_eq!(collect(&mut lines, WATCH).await.unwrap().len(), 1700);
    }

    /// A watch line past the ceiling fails, however it is split into frames.
    #[tokio::test]
    async fn a_watch_event_past_the_ceiling_fails() {
        let bounds = Bounds {
            request_timeout: Duration::from_secs(60),
            max_bytes: 10,
            max_objects: usize::MAX,
            max_values: usize::MAX,
        };
        let split = || {
            timed(vec![
                (Duration::ZERO, b"0123456789\n0123"),
                (Duration::ZERO, b"45678"),
                (Duration::ZERO, b"9A"),
            ])
        };
        let mut service = bounded(bounds, split);
        let err = collect(&mut service, WATCH).await.unwrap_err();
        assert!(err.contains("longer than 10 bytes"), "{err}");
        // The frame that ends the line too long, or holds it whole.
        for frames in [
            vec![
                (Duration::ZERO, &b"0123"[..]),
                (Duration::ZERO, b"456789A\n"),
            ],
            vec![(Duration::ZERO, &b"01\n0123456789A\n01"[..])],
        ] {
            let mut service = bounded(bounds, move || timed(frames.clone()));
            let err = collect(&mut service, WATCH).await.unwrap_err();
            assert!(err.contains("longer than 10 bytes"), "{err}");
        }
        let fits = || {
            timed(vec![
                (Duration::ZERO, b"0123456789\n0123"),
                (Duration::ZERO, b"456789\n01234"),
                (Duration::ZERO, b"56789\n"),
            ])
        };
        let mut service = bounded(bounds, fits);
        assert!(collect(&mut service, WATCH).await.is_ok());
    }

    /// A list has the request timeout for its whole body; a watch's events are not under
    /// it (paused time: the delays are virtual).
    #[tokio::test(start_paused = true)]
    async fn only_a_lists_body_is_under_the_request_timeout() {
        let bounds = Bounds {
            request_timeout: Duration::from_secs(2),
            max_bytes: 1 << 20,
            max_objects: usize::MAX,
            max_values: usize::MAX,
        };
        let slow = || {
            timed(vec![
                (Duration::from_secs(1), b"{\"a\":\n"),
                (Duration::from_secs(10), b"1}\n"),
            ])
        };
        let mut service = bounded(bounds, slow);
        let err = collect(&mut service, LIST).await.unwrap_err();
        assert!(err.contains("took longer than 2s"), "{err}");
        assert_eq!(
            collect(&mut service, WATCH).await.unwrap(),
            &b"{\"a\":\n1}\n"[..]
        );
    }

    /// Response headers later than the request timeout fail the request, a watch's too.
    #[tokio::test(start_paused = true)]
    async fn late_headers_fail_the_request() {
        let bounds = Bounds {
            request_timeout: Duration::from_secs(2),
            max_bytes: 1 << 20,
            max_objects: usize::MAX,
            max_values: usize::MAX,
        };
        let inner = tower::service_fn(|_: Request<()>| async {
            tokio::time::sleep(Duration::from_secs(5)).await;
            Ok::<_, BoxError>(Response::new(timed(Vec::new())))
        });
        let mut service = bounds.layer(Inner::new(inner));
        for uri in [LIST, WATCH] {
            let err = collect(&mut service, uri).await.unwrap_err();
            assert!(err.contains("took longer than 2s"), "{err}");
        }
    }
    /// Objects as `{"items":[{},{},...]}` holds them: `n` empty items and the list's own.
    fn items(n: usize) -> Vec<u8> {
        let mut body = b"{\"items\":[".to_vec();
        for i in 0..n {
            if i > 0 {
                body.push(b',');
            }
            body.extend_from_slice(b"{}");
        }
        body.extend_from_slice(b"]}");
        body
    }

    /// Frames of `body`, `size` bytes each.
    fn chunks(body: &[u8], size: usize) -> TestBody {
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = body
            .chunks(size)
            .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        Box::pin(StreamBody::new(futures::stream::iter(frames)))
    }

    /// A list's JSON objects are counted however its body is split, those in strings
    /// (escaped quotes included) not: past the ceiling, the list fails.
    #[tokio::test]
    async fn a_list_of_too_many_objects_fails() {
        let bounds = Bounds {
            request_timeout: Duration::from_secs(60),
            max_bytes: 1 << 20,
            max_objects: 10,
            max_values: usize::MAX,
        };
        for size in [1, 3, 1000] {
            let at = items(9);
            let mut service = bounded(bounds, move || chunks(&at, size));
            assert!(collect(&mut service, LIST).await.is_ok(), "{size}");
            let past = items(10);
            let mut service = bounded(bounds, move || chunks(&past, size));
            let err = collect(&mut service, LIST).await.unwrap_err();
            assert!(err.contains("more than 10 JSON objects"), "{size}: {err}");
            // Braces in strings, after escaped quotes and backslashes, are no objects.
            let strings =
                br#"{"a":"{{{{{{{{{{{{","b\"{{{{{{{{{{":"\\","c":{"d":"\\\"{{{{{{{{{{{"}}"#;
            let mut service = bounded(bounds, move || chunks(strings, size));
            assert!(collect(&mut service, LIST).await.is_ok(), "{size}");
        }
    }

    /// A watch's JSON objects are counted per line: many lines within the ceiling pass,
    /// one line past it fails, however it is split; a line left in a string does not
    /// hide the next line's objects.
    #[tokio::test]
    async fn a_watch_event_of_too_many_objects_fails() {
        let bounds = Bounds {
            request_timeout: Duration::from_secs(60),
            max_bytes: 1 << 20,
            max_objects: 10,
            max_values: usize::MAX,
        };
        for size in [1, 4, 1000] {
            let mut lines = Vec::new();
            for _ in 0..100 {
                lines.extend_from_slice(&items(9));
                lines.push(b'\n');
            }
            let fits = lines.clone();
            let mut service = bounded(bounds, move || chunks(&fits, size));
            assert!(collect(&mut service, WATCH).await.is_ok(), "{size}");
            lines.extend_from_slice(&items(10));
            let mut service = bounded(bounds, move || chunks(&lines, size));
            let err = collect(&mut service, WATCH).await.unwrap_err();
            assert!(err.contains("more than 10 JSON objects"), "{size}: {err}");
            let mut unclosed = b"{\"a\":\"{{\n".to_vec();
            unclosed.extend_from_slice(&items(10));
            let mut service = bounded(bounds, move || chunks(&unclosed, size));
            let err = collect(&mut service, WATCH).await.unwrap_err();
            assert!(err.contains("more than 10 JSON objects"), "{size}: {err}");
        }
    }

    /// A list's JSON values (`[` and `,` outside strings) are counted however its body
    /// is split, those in strings not: past the ceiling, the list fails; a watch's per
    /// line.
    #[tokio::test]
    async fn a_list_of_too_many_values_fails() {
        let bounds = Bounds {
            request_timeout: Duration::from_secs(60),
            max_bytes: 1 << 20,
            max_objects: usize::MAX,
            max_values: 10,
        };
        let zeros = |n: usize| format!("{{\"a\":[{}]}}", vec!["0"; n].join(",")).into_bytes();
        for size in [1, 3, 1000] {
            let at = zeros(10);
            let mut service = bounded(bounds, move || chunks(&at, size));
            assert!(collect(&mut service, LIST).await.is_ok(), "{size}");
            let past = zeros(11);
            let mut service = bounded(bounds, move || chunks(&past, size));
            let err = collect(&mut service, LIST).await.unwrap_err();
            assert!(err.contains("more than 10 JSON values"), "{size}: {err}");
            let strings =
                br#"{"a":"[,,,,,,,,,,,,","b\",[[[[[[[[[[":"\\","c":{"d":"\\\",,,,,,,,,,,,"}}"#;
            let mut service = bounded(bounds, move || chunks(strings, size));
            assert!(collect(&mut service, LIST).await.is_ok(), "{size}");
            let mut lines = Vec::new();
            for _ in 0..100 {
                lines.extend_from_slice(&zeros(10));
                lines.push(b'\n');
            }
            let fits = lines.clone();
            let mut service = bounded(bounds, move || chunks(&fits, size));
            assert!(collect(&mut service, WATCH).await.is_ok(), "{size}");
            lines.extend_from_slice(&zeros(11));
            let mut service = bounded(bounds, move || chunks(&lines, size));
            let err = collect(&mut service, WATCH).await.unwrap_err();
            assert!(err.contains("watch event"), "{size}: {err}");
            assert!(err.contains("more than 10 JSON values"), "{size}: {err}");
        }
    }

    /// The bounds of a client with the default page (100 pods) and byte ceiling.
    fn defaults() -> Bounds {
        Bounds {
            request_timeout: Duration::from_secs(60),
            max_bytes: 64 << 20,
            max_objects: max_objects(100),
            max_values: max_values(100),
        }
    }

    /// A pod as heavy as a real one with sidecars gets: three containers of 60
    /// environment variables each, and the `managedFields` covering them.
    fn heavy_pod(i: usize) -> serde_json::Value {
        let name = format!("d{i:03}");
        let pod = super::super::held::apiserver::PodDesc {
            namespace: "llm",
            name: &name,
            labels: &[("app", "vllm")],
            annotations: &[],
            ip: "10.0.0.1",
            port: 8000,
            phase: "Running",
            ready: true,
        };
        super::super::held::apiserver::heavy(pod.json(), 3, 60)
    }

    /// A heavy real pod is far within a pod's budgets: under half its objects (it was
    /// past the 1,024 once allowed), under an eighth of its values.
    #[test]
    fn a_heavy_real_pod_is_far_within_the_budgets() {
        let mut counts = Objects::default();
        counts.scan(heavy_pod(0).to_string().as_bytes());
        assert!(
            (1500..OBJECTS_PER_POD / 2).contains(&counts.count),
            "{counts:?}"
        );
        assert!(
            (1500..VALUES_PER_POD / 8).contains(&counts.values),
            "{counts:?}"
        );
    }

    /// Within the default bounds, a page of 100 heavy real pods passes, as a list and as
    /// watch events; a pod whose free-form `fieldsV1` is an array of 2,000,000 zeros
    /// (4 MB of a 64 MiB ceiling and a handful of objects, but 2,000,000 JSON values:
    /// skipped unread, but the count cannot tell them from as many labels, which would
    /// decode into about 300 MB) fails, as a list and as a watch event.
    #[tokio::test]
    async fn a_huge_free_form_array_is_refused_and_real_pods_pass() {
        let list = |items: Vec<serde_json::Value>| {
            serde_json::json!({
                "kind": "PodList", "apiVersion": "v1",
                "metadata": {"resourceVersion": "1"}, "items": items,
            })
            .to_string()
            .into_bytes()
        };
        let events = |items: &[serde_json::Value]| -> Vec<u8> {
            let mut lines = Vec::new();
            for pod in items {
                let event = serde_json::json!({"type": "ADDED", "object": pod});
                lines.extend_from_slice(event.to_string().as_bytes());
                lines.push(b'\n');
            }
            lines
        };
        let pods: Vec<_> = (0..100).map(heavy_pod).collect();
        let mut flood = heavy_pod(100);
        flood["metadata"]["managedFields"][0]["fieldsV1"] = serde_json::json!(vec![0; 2_000_000]);
        let limit = format!("more than {} JSON values", max_values(100));
        for (uri, real, flooded) in [
            (LIST, list(pods.clone()), list(vec![flood.clone()])),
            (WATCH, events(&pods), events(&[flood.clone()])),
        ] {
            let mut service = bounded(defaults(), move || chunks(&real, 1 << 16));
            assert!(collect(&mut service, uri).await.is_ok(), "{uri}");
            let mut service = bounded(defaults(), move || chunks(&flooded, 1 << 16));
            let err = collect(&mut service, uri).await.unwrap_err();
            assert!(err.contains(&limit), "{uri}: {err}");
        }
    }
}
