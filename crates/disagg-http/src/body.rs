//! Reading a client's request body, bounded in size, in time and, across every
//! connection of a server, in memory.
//!
//! One function reads every client body that [`PdService`](crate::PdService) and
//! [`PdLayer`](crate::PdLayer) orchestrate. It holds a body to three limits:
//!
//! | limit | setting | past it |
//! |---|---|---|
//! | size of one body | [`PdServiceConfig::max_body_bytes`](crate::PdServiceConfig::max_body_bytes) | 413 `request_too_large` |
//! | time for the whole body | [`PdServiceConfig::body_timeout`](crate::PdServiceConfig::body_timeout) | 408 `request_timeout` |
//! | bytes of all bodies being received at once | [`PdServiceConfig::body_budget`](crate::PdServiceConfig::body_budget) ([`BodyBudget`]) | 503 `server_busy`, with `retry-after` |
//!
//! Each of these answers closes the connection (`connection: close`): the rest of the
//! body is never read.
//!
//! A body takes its share of the budget as its bytes arrive, never for bytes it has only
//! declared: a client that declares a large body and sends none of it holds no room that
//! others need. A body that declares its length (`content-length`) is read into one
//! buffer of that size, from [`MAP_FROM`] on a memory mapping of its own, whose pages
//! cost memory only once written: its share is what has been written to it (and what
//! earlier bodies wrote to a kept mapping), checked before each copy, so a body whose
//! next bytes would take the budget past its limit is cut there. The mapping goes back
//! to the system when the body is freed (the allocator's heap would keep it), unless
//! the budget keeps it for the next large body (at most [`SPARE_BYTES`] of them, each up
//! to [`SPARE_MAX`]). A buffer on the heap (under [`MAP_FROM`], or a chunked body's
//! first ones) takes its whole capacity once allocated, so a declared body's starts at
//! no more than four times what has arrived, and grows (doubling, up to the declared
//! size) as more does: one whose second piece brings a quarter of it or more gets its
//! declared size at once. A body that arrives in one piece, as small ones do, is used
//! as it came, without a copy.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf, Bytes};
use disagg_core::error::{BoxError, Overload, PdError};
use disagg_core::json::BodyError;
use http_body::Body;

/// Default of [`PdServiceConfig::body_budget`](crate::PdServiceConfig::body_budget):
/// 1 GiB of request bodies being received at once, all connections together.
///
/// Room for 32 bodies of the default 32 MiB limit at once, or thousands of usual ones,
/// while a flood of large bodies that stall (which took the proxy past 2 GB before the
/// budget) stays within a size any host running an LLM proxy has to spare.
pub const DEFAULT_BODY_BUDGET: usize = 1024 * 1024 * 1024;

/// The `retry-after` of a 503 `server_busy`: bodies being received finish or hit the
/// body timeout, so room comes back within seconds; one is the least the header says.
pub const BUSY_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Bodies from this size on are parsed on Tokio's blocking pool
/// (`tokio::task::spawn_blocking`), not on the event loop that read them.
///
/// A parse of the body's top level runs at a few hundred MB/s: a 256 KiB body costs well
/// under a millisecond, about what handing it to another thread and back costs, while a
/// 32 MiB one (or a hostile one of many small keys) would hold the loop, and every
/// connection on it, for tens of milliseconds. `disagg-proxy` runs one single-threaded
/// event loop per core, where `block_in_place` is not available, so the work moves to
/// the runtime's blocking threads instead.
pub const PARSE_OFF_LOOP_FROM: usize = 256 * 1024;

/// `work` on Tokio's blocking pool (see [`PARSE_OFF_LOOP_FROM`]), or here when there
/// is no runtime: its panic is raised again here, and a runtime shutting down is 503
/// `server_busy` (no answer will reach the client anyway).
///
/// `share` is the share of the budget of the body `work` holds: it goes with the job
/// and is given back when the job ends. Dropped before the job has started (its client
/// left), the job never runs, and the body and its share go when a pool thread takes
/// the cancelled job off the queue (at once unless every pool thread is busy); dropped
/// while it runs, the job ends first (a thread is not stopped), holding the body and its
/// share until then.
pub(crate) async fn on_blocking_pool<T: Send + 'static>(
    share: Share<'_>,
    work: impl FnOnce() -> Result<T, PdError> + Send + 'static,
) -> Result<T, PdError> {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        let done = work();
        drop(share);
        return done;
    };
    let share = share.into_owned();
    let job = AbortOnDrop(runtime.spawn_blocking(move || {
        let _share = share;
        work()
    }));
    match job.await {
        Ok(done) => done,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Err(PdError::from(Overload::ServerBusy {
            retry_after: BUSY_RETRY_AFTER,
        })),
    }
}

/// A blocking job that is aborted when its handle is dropped: one the pool has not
/// started then never runs (one running finishes).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Future for AbortOnDrop<T> {
    type Output = Result<T, tokio::task::JoinError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx)
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        // A no-op once the job has ended.
        self.0.abort();
    }
}

/// The bytes that request bodies being received may hold at once, shared by every clone.
///
/// A body takes its share as its bytes arrive (see [the module](self)), and gives it
/// back once it has been read and parsed. A body whose next bytes would take the total
/// past the limit is cut there with 503 `server_busy`, the rest of it never read.
/// Clones share one count: give every service of a server (one per event loop) a clone
/// of the same budget, as cloning one
/// [`PdServiceConfig`](crate::PdServiceConfig) does.
///
/// # Examples
///
/// ```
/// use disagg_http::body::BodyBudget;
///
/// let budget = BodyBudget::new(64 * 1024 * 1024);
/// let shared = budget.clone();
/// assert_eq!(shared.limit(), 64 * 1024 * 1024);
/// assert_eq!(budget.in_use(), 0);
/// ```
#[derive(Debug, Clone)]
pub struct BodyBudget {
    inner: Arc<BudgetInner>,
}

#[derive(Debug)]
struct BudgetInner {
    limit: usize,
    in_use: AtomicUsize,
    /// Mappings of bodies that were freed, kept for the next large bodies.
    spare: Spare,
}

impl Default for BodyBudget {
    fn default() -> Self {
        BodyBudget::new(DEFAULT_BODY_BUDGET)
    }
}

impl BodyBudget {
    /// A budget of `limit` bytes, with nothing taken.
    pub fn new(limit: usize) -> Self {
        BodyBudget {
            inner: Arc::new(BudgetInner {
                limit,
                in_use: AtomicUsize::new(0),
                spare: Spare::default(),
            }),
        }
    }

    /// The most bytes bodies may hold at once.
    pub fn limit(&self) -> usize {
        self.inner.limit
    }

    /// The bytes taken by bodies being received now.
    pub fn in_use(&self) -> usize {
        self.inner.in_use.load(Ordering::Relaxed)
    }

    /// Take `bytes` more, if the total stays within the limit. One atomic
    /// read-modify-write, the only cost the budget adds to a request: once for a body
    /// that arrives in one piece; for one in several, once more for its buffer, then
    /// once for each piece that takes it past what the buffer held before.
    fn take(&self, bytes: usize) -> bool {
        bytes == 0
            || self
                .inner
                .in_use
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                    used.checked_add(bytes).filter(|&t| t <= self.inner.limit)
                })
                .is_ok()
    }

    fn give_back(&self, bytes: usize) {
        if bytes > 0 {
            self.inner.in_use.fetch_sub(bytes, Ordering::Relaxed);
        }
    }

    /// The bytes of freed bodies' mappings kept for reuse now (at most [`SPARE_BYTES`]).
    pub fn spare_bytes(&self) -> usize {
        self.inner.spare.bytes()
    }
}

/// A body's share of a [`BodyBudget`], given back when dropped.
#[derive(Debug)]
pub(crate) struct Share<'a> {
    budget: &'a BodyBudget,
    bytes: usize,
}

impl<'a> Share<'a> {
    /// A share of nothing yet.
    pub(crate) fn new(budget: &'a BodyBudget) -> Self {
        Share { budget, bytes: 0 }
    }

    /// The same share, holding its budget rather than borrowing it: one that can go
    /// with the body to another thread.
    fn into_owned(mut self) -> OwnedShare {
        let bytes = std::mem::take(&mut self.bytes);
        OwnedShare {
            budget: self.budget.clone(),
            bytes,
        }
    }

    /// Hold `total` bytes in all; false (and nothing more held) past the budget.
    fn grow_to(&mut self, total: usize) -> bool {
        if total <= self.bytes {
            return true;
        }
        if !self.budget.take(total - self.bytes) {
            return false;
        }
        self.bytes = total;
        true
    }
}

impl Drop for Share<'_> {
    fn drop(&mut self) {
        self.budget.give_back(self.bytes);
    }
}

/// A [`Share`] that holds its budget: given back when dropped, wherever that is.
struct OwnedShare {
    budget: BodyBudget,
    bytes: usize,
}

impl Drop for OwnedShare {
    fn drop(&mut self) {
        self.budget.give_back(self.bytes);
    }
}

/// Whether `err`, a client body's failure, says that its client left: the connection
/// ended (closed, or reset) before the body did, or [`ClientLeft`] says so. No answer
/// reaches such a client: its request ends cancelled, with status 499, as one whose
/// client leaves at any other time before the answer's head.
///
/// A body cut by a limit of [`read`] (its size, its time, the budget) is the proxy's
/// answer to a client still there, and is not this.
///
/// The server speaks HTTP/1.1 only ([`server`](crate::server); its TLS offers ALPN
/// `http/1.1` alone), and hyper tells a body whose connection broke by the socket's own
/// error under its `Body` error: `UnexpectedEof` for a close (a declared length short,
/// or a chunk cut, or a chunk's size line missing), `ConnectionReset` for a reset.
/// hyper's `IncompleteMessage` reaches a body only when the server dropped its
/// connection itself, and the request's future with it. A server that spoke HTTP/2 would
/// have to add h2's stream resets and `GOAWAY` here.
pub(crate) fn client_left(err: &(dyn std::error::Error + 'static)) -> bool {
    use std::io::ErrorKind;
    let mut next = Some(err);
    while let Some(e) = next {
        if e.is::<ClientLeft>() {
            return true;
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                ErrorKind::UnexpectedEof
                    | ErrorKind::ConnectionReset
                    | ErrorKind::ConnectionAborted
                    | ErrorKind::BrokenPipe
            )
        {
            return true;
        }
        next = e.source();
    }
    false
}

/// A client that left in the middle of its body ([`client_left`]), told where the
/// body's own error cannot go (a forwarded body's, which the transport takes).
#[derive(Debug, thiserror::Error)]
#[error("the client closed its connection before its body ended")]
pub(crate) struct ClientLeft;

/// The limits a client body is read under.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits<'a> {
    /// The largest body, in bytes (413 past it).
    pub(crate) max_bytes: usize,
    /// Time for the whole body (408 past it).
    pub(crate) timeout: Duration,
    /// Bytes of all bodies being received at once (503 past it).
    pub(crate) budget: &'a BodyBudget,
}

/// Read the whole of a client's `body` under `limits`: its bytes, and the share of the
/// budget they hold (give it back by dropping it once the bytes are parsed).
///
/// The timeout runs from the first moment the body is waited for, which is when its
/// head has been read (a body that arrived with its head is never waited for, and pays
/// for no timer). It bounds the whole body, not the silence between two reads: a client
/// trickling a byte now and then must not hold its connection and its share of the
/// budget for ever.
///
/// # Errors
///
/// 413 `request_too_large` past `limits.max_bytes` (declared or received), 503
/// `server_busy` when the body would take the budget past its limit, 408
/// `request_timeout` when it did not arrive in time, 400 when the client broke off
/// (its connection ended: [`client_left`] says so of the error). After any of them the
/// rest of the body is unread, so the connection must close.
pub(crate) fn read<B>(
    body: B,
    limits: Limits<'_>,
) -> impl Future<Output = Result<(Bytes, Share<'_>), PdError>> + Send + '_
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let hint = body.size_hint();
    let start = if hint.lower() > limits.max_bytes as u64 {
        Err(PdError::body(BodyError::TooLarge {
            limit: limits.max_bytes,
        }))
    } else {
        // The declared length sizes the buffer; the budget is taken as bytes arrive.
        Ok(hint.exact().and_then(|n| usize::try_from(n).ok()))
    };
    ReadBody {
        body,
        start: Some(start.map(|declared| (declared, Share::new(limits.budget)))),
        state: State::Empty,
        received: 0,
        limits,
        timer: None,
    }
}

/// What has been received so far.
enum State {
    /// Nothing yet.
    Empty,
    /// One chunk, kept as it came: most bodies arrive whole, and then need no copy.
    One(Bytes),
    /// Several chunks, copied into one buffer.
    Many(Buffer),
}

/// Bodies from this size on are read into an anonymous memory mapping of their own
/// rather than onto the allocator's heap: 64 KiB.
///
/// glibc's allocator maps large blocks on its own too, from 128 KiB at first, but it
/// raises that threshold as mapped blocks are freed (up to 32 MiB): after a flood of
/// 31 MB bodies, the next flood of 20 MB ones landed on its heap, which keeps freed
/// memory, and the proxy's RSS stayed 170 MiB above idle. A mapping of our own is
/// unmapped when its body is freed, whatever the allocator decided before, or kept for
/// the next body within a bound of its own ([`SPARE_BYTES`]), and its pages cost only as
/// they are written. A fresh mapping costs two system calls and a page fault per 4 KiB
/// written; a kept one, nothing. Smaller bodies, the many usual requests, stay on the
/// heap.
pub const MAP_FROM: usize = 64 * 1024;

/// A declared body's buffer on the heap (under [`MAP_FROM`]) starts at most this many
/// times what has arrived, and grows as more does, up to the declared size.
///
/// A heap buffer costs its whole capacity at once (of memory, and of the budget), so a
/// buffer of the declared size let a client that declared a body just under
/// [`MAP_FROM`] and sent two bytes of it hold 64 KiB: about 16,400 of them filled the
/// default budget. Four times covers the bodies that arrive at once: the server reads
/// them 8, then 16, then 32 KiB at a time (hyper's reads), so the second piece brings a
/// quarter of the body or more, and its buffer is of its declared size at once, as
/// before. A body that comes slower grows by doubling: copies of at most about its own
/// size in all.
const HEAP_AHEAD: usize = 4;

/// Freed bodies' mappings up to this size are kept for the next bodies (the larger
/// ones are unmapped): 1 MiB.
pub const SPARE_MAX: usize = 1024 * 1024;

/// The most bytes of freed bodies' mappings a [`BodyBudget`] keeps for reuse, all its
/// clones together: 4 MiB.
///
/// A fresh mapping costs its two system calls, a page fault and a zeroed page per 4 KiB
/// written, and the unmapping's TLB flush: at 128 KiB prompts that was about a tenth of
/// the proxy's CPU (`docs/performance.md`). A body up to [`SPARE_MAX`] is read into a
/// kept mapping of its size class (powers of two from [`MAP_FROM`]) when there is one,
/// and its mapping is kept again when the body is freed, while the kept ones stay
/// within this bound: the memory the proxy holds after a flood of large bodies grows by
/// at most this much.
pub const SPARE_BYTES: usize = 4 * 1024 * 1024;

/// The kept mappings, by size class (`MAP_FROM << i`).
#[derive(Debug, Default)]
struct Spare {
    maps: std::sync::Mutex<SpareMaps>,
}

#[derive(Debug, Default)]
struct SpareMaps {
    by_class: Vec<Vec<Kept>>,
    bytes: usize,
}

/// A kept mapping, and how many of its first bytes bodies wrote (memory it holds).
#[derive(Debug)]
struct Kept {
    map: memmap2::MmapMut,
    written: usize,
}

/// The size class of a mapping of at least `capacity` bytes, if one is kept at all.
fn class_of(capacity: usize) -> Option<usize> {
    if capacity > SPARE_MAX {
        return None;
    }
    let size = capacity.max(MAP_FROM).next_power_of_two();
    Some((size / MAP_FROM).trailing_zeros() as usize)
}

impl Spare {
    fn lock(&self) -> std::sync::MutexGuard<'_, SpareMaps> {
        // The kept list is consistent between any two statements.
        self.maps
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// A mapping for a body of `capacity` bytes: a kept one of its class, or a new one.
    fn take(&self, capacity: usize) -> std::io::Result<Kept> {
        if let Some(class) = class_of(capacity) {
            let mut kept = self.lock();
            if let Some(map) = kept.by_class.get_mut(class).and_then(Vec::pop) {
                kept.bytes -= map.map.len();
                return Ok(map);
            }
        }
        fresh(capacity)
    }

    /// Keep `map`, whose first `written` bytes were written, for a later body if it is
    /// of a class and there is room; otherwise it is unmapped.
    fn put(&self, map: memmap2::MmapMut, written: usize) {
        let Some(class) = class_of(map.len()).filter(|&c| map.len() == MAP_FROM << c) else {
            return;
        };
        let mut kept = self.lock();
        if kept.bytes + map.len() > SPARE_BYTES {
            return;
        }
        if kept.by_class.len() <= class {
            kept.by_class.resize_with(class + 1, Vec::new);
        }
        kept.bytes += map.len();
        let written = written.min(map.len());
        kept.by_class[class].push(Kept { map, written });
    }
}

/// A new mapping for a body of `capacity` bytes, of its whole class when it has one (so
/// that it can be kept when freed); nothing written to it yet.
fn fresh(capacity: usize) -> std::io::Result<Kept> {
    let size = class_of(capacity).map_or(capacity, |class| MAP_FROM << class);
    let map = memmap2::MmapMut::map_anon(size)?;
    Ok(Kept { map, written: 0 })
}

/// A body's mapping, given back to the budget's [`Spare`] when the last slice of the
/// body is dropped.
struct Recycled {
    map: Option<memmap2::MmapMut>,
    /// Its first bytes written, by this body or earlier ones.
    written: usize,
    budget: BodyBudget,
}

impl AsRef<[u8]> for Recycled {
    fn as_ref(&self) -> &[u8] {
        self.map.as_deref().unwrap_or_default()
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        if let Some(map) = self.map.take() {
            self.budget.inner.spare.put(map, self.written);
        }
    }
}

/// A body's buffer of a fixed capacity: on the heap when small, a memory mapping from
/// [`MAP_FROM`] on (one the budget kept, if it has one).
///
/// What it holds of memory, and so of the budget ([`held`](Buffer::held)): a heap
/// buffer, its capacity (the allocator may hand out pages already in use); a mapping,
/// the pages written to it, by this body or by the earlier ones of a kept mapping.
enum Buffer {
    Heap(Vec<u8>),
    Mapped {
        map: memmap2::MmapMut,
        len: usize,
        /// What the body may fill: the mapping may be larger (its size class).
        capacity: usize,
        /// The bytes earlier bodies wrote to the mapping, when it was kept for reuse.
        written: usize,
        budget: BodyBudget,
    },
}

impl Buffer {
    /// A buffer of `wanted` bytes, `least` at worst when the budget has no room for
    /// more on the heap, for a body that will hold `needed` bytes once it is filled:
    /// `share` grows to what it holds then ([`held`](Buffer::held)); 503 `server_busy`
    /// when the budget has no room for that, or the system no memory.
    fn new(
        share: &mut Share<'_>,
        wanted: usize,
        least: usize,
        needed: usize,
    ) -> Result<Buffer, PdError> {
        if wanted < MAP_FROM {
            let capacity = grow(share, wanted, least).ok_or_else(busy)?;
            return Ok(Buffer::Heap(Vec::with_capacity(capacity)));
        }
        let spare = &share.budget.inner.spare;
        let mut kept = spare.take(wanted).map_err(|_| busy())?;
        if !share.grow_to(needed.max(kept.written)) {
            // A kept mapping's written pages may be what leaves no room: a new one has
            // none.
            let room = kept.written > needed && share.grow_to(needed);
            spare.put(kept.map, kept.written);
            if !room {
                return Err(busy());
            }
            kept = fresh(wanted).map_err(|_| busy())?;
        }
        Ok(Buffer::Mapped {
            map: kept.map,
            len: 0,
            capacity: wanted,
            written: kept.written,
            budget: share.budget.clone(),
        })
    }

    /// The memory this buffer holds once it holds `len` bytes, as the budget counts it.
    fn held(&self, len: usize) -> usize {
        match self {
            Buffer::Heap(v) => v.capacity(),
            Buffer::Mapped { written, .. } => len.max(*written),
        }
    }

    fn len(&self) -> usize {
        match self {
            Buffer::Heap(v) => v.len(),
            Buffer::Mapped { len, .. } => *len,
        }
    }

    fn capacity(&self) -> usize {
        match self {
            Buffer::Heap(v) => v.capacity(),
            Buffer::Mapped { capacity, .. } => *capacity,
        }
    }

    /// Append `data`, which the caller has checked fits in the capacity.
    fn push(&mut self, data: &[u8]) {
        match self {
            Buffer::Heap(v) => v.extend_from_slice(data),
            Buffer::Mapped { map, len, .. } => {
                map[*len..*len + data.len()].copy_from_slice(data);
                *len += data.len();
            }
        }
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            Buffer::Heap(v) => v,
            Buffer::Mapped { map, len, .. } => &map[..*len],
        }
    }

    fn into_bytes(self) -> Bytes {
        match self {
            Buffer::Heap(v) => Bytes::from(v),
            // The mapping lives until the last slice of the body (a JSON value of the
            // request) is dropped, then is kept for another body or unmapped.
            Buffer::Mapped {
                map,
                len,
                written,
                budget,
                ..
            } => Bytes::from_owner(Recycled {
                map: Some(map),
                written: written.max(len),
                budget,
            })
            .slice(..len),
        }
    }
}

pin_project_lite::pin_project! {
    /// The future of [`read`].
    struct ReadBody<'a, B> {
        #[pin]
        body: B,
        // The outcome of the checks made before reading: the declared length and the
        // share taken for it. Taken out when the body ends.
        start: Option<Result<(Option<usize>, Share<'a>), PdError>>,
        state: State,
        received: usize,
        limits: Limits<'a>,
        // Armed the first time the body is waited for.
        #[pin]
        timer: Option<tokio::time::Sleep>,
    }
}

impl<'a, B> Future for ReadBody<'a, B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Output = Result<(Bytes, Share<'a>), PdError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let Some(Ok((declared, share))) = this.start.as_mut() else {
            let refused = this.start.take().and_then(Result::err);
            return Poll::Ready(Err(refused.unwrap_or_else(|| {
                // Polled again after it finished: a caller's bug, not the client's.
                PdError::body("the body was already read")
            })));
        };
        loop {
            let frame = match this.body.as_mut().poll_frame(cx) {
                Poll::Ready(frame) => frame,
                Poll::Pending => {
                    if this.timer.is_none() {
                        this.timer
                            .set(Some(tokio::time::sleep(this.limits.timeout)));
                    }
                    if let Some(timer) = this.timer.as_mut().as_pin_mut() {
                        ready!(timer.poll(cx));
                    }
                    return Poll::Ready(Err(PdError::body(BodyError::TimedOut {
                        after: this.limits.timeout,
                    })));
                }
            };
            let data = match frame {
                None => break,
                Some(Err(e)) => return Poll::Ready(Err(PdError::body(e))),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(mut data) => data.copy_to_bytes(data.remaining()),
                    // Trailers carry nothing a completion request needs.
                    Err(_) => continue,
                },
            };
            if data.is_empty() {
                continue;
            }
            *this.received += data.len();
            if *this.received > this.limits.max_bytes {
                return Poll::Ready(Err(PdError::body(BodyError::TooLarge {
                    limit: this.limits.max_bytes,
                })));
            }
            if let Err(e) = append(this.state, data, *declared, share, this.limits.max_bytes) {
                return Poll::Ready(Err(e));
            }
        }
        let bytes = match std::mem::replace(this.state, State::Empty) {
            State::Empty => Bytes::new(),
            State::One(b) => b,
            State::Many(buf) => buf.into_bytes(),
        };
        match this.start.take() {
            Some(Ok((_, share))) => Poll::Ready(Ok((bytes, share))),
            _ => Poll::Ready(Err(PdError::body("the body was already read"))),
        }
    }
}

/// 503 `server_busy`: no room in the budget (or no memory) for a body.
fn busy() -> PdError {
    PdError::from(Overload::ServerBusy {
        retry_after: BUSY_RETRY_AFTER,
    })
}

/// Add `data` to what was received, taking from the budget what the body holds once it
/// is added ([`Buffer::held`]), before it is copied.
fn append(
    state: &mut State,
    data: Bytes,
    declared: Option<usize>,
    share: &mut Share<'_>,
    max_bytes: usize,
) -> Result<(), PdError> {
    match state {
        State::Empty => {
            // The first chunk is already in memory; it counts from now.
            if !share.grow_to(data.len()) {
                return Err(busy());
            }
            *state = State::One(data);
        }
        State::One(first) => {
            let needed = first.len() + data.len();
            // A declared body's buffer is of the declared size, so it never moves (a
            // mapping costs only the pages written), but on the heap, where it costs
            // its whole capacity, at most `HEAP_AHEAD` times what came; a chunked
            // body's starts at twice what came. Either doubles from there.
            let capacity = match declared {
                Some(size) if size < MAP_FROM => size.min(needed.saturating_mul(HEAP_AHEAD)),
                Some(size) => size,
                None => needed.saturating_mul(2),
            }
            .clamp(needed, max_bytes.max(needed));
            let mut buf = Buffer::new(share, capacity, needed, needed)?;
            buf.push(first);
            buf.push(&data);
            *state = State::Many(buf);
        }
        State::Many(buf) => {
            let needed = buf.len() + data.len();
            if needed > buf.capacity() {
                // A declared body's buffer grows to its declared size at most.
                let most = match declared {
                    Some(size) if needed <= size => size.min(max_bytes),
                    _ => max_bytes,
                }
                .max(needed);
                let capacity = needed.max(buf.capacity().saturating_mul(2)).min(most);
                // Short of room for twice the buffer, a quarter more at least: growth
                // by what one frame needs would copy all that is held for every frame
                // (one-byte frames with the budget nearly spent: the held size squared).
                let least = needed
                    .max(buf.capacity().saturating_add(buf.capacity() / 4))
                    .min(most);
                let mut bigger = Buffer::new(share, capacity, least, needed)?;
                bigger.push(buf.as_slice());
                // The smaller buffer's mapping, if any, is kept for another body.
                if let Buffer::Mapped {
                    map,
                    len,
                    written,
                    budget,
                    ..
                } = std::mem::replace(buf, bigger)
                {
                    budget.inner.spare.put(map, written.max(len));
                }
            } else if !share.grow_to(buf.held(needed)) {
                // A declared body's mapping is taken from the budget as it is written.
                return Err(busy());
            }
            buf.push(&data);
        }
    }
    Ok(())
}

/// Grow `share` to `wanted` bytes, or to the `least` ones when the budget has no room
/// for the slack.
fn grow(share: &mut Share<'_>, wanted: usize, least: usize) -> Option<usize> {
    [wanted, least].into_iter().find(|&n| share.grow_to(n))
}

/// The budget at each scrape of `GET /metrics`: the bytes of client bodies being
/// received now, the limit, and the freed bodies' mappings kept for reuse. Read from the
/// budget's own counters when scraped, so a request pays nothing for them.
#[cfg(feature = "metrics")]
#[derive(Debug)]
pub(crate) struct BudgetCollector(pub(crate) BodyBudget);

#[cfg(feature = "metrics")]
impl prometheus_client::collector::Collector for BudgetCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::MetricType;
        use prometheus_client::metrics::gauge::ConstGauge;
        let gauges = [
            (
                "disagg_request_body_buffered_bytes",
                "Bytes of client request bodies being received now, all connections together.",
                self.0.in_use(),
            ),
            (
                "disagg_request_body_budget_bytes",
                "The most bytes of client request bodies held at once (--max-buffered-bytes).",
                self.0.limit(),
            ),
            (
                "disagg_request_body_spare_bytes",
                "Bytes of freed request bodies' memory mappings kept for the next bodies.",
                self.0.spare_bytes(),
            ),
        ];
        for (name, help, bytes) in gauges {
            ConstGauge::new(i64::try_from(bytes).unwrap_or(i64::MAX))
                .encode(encoder.encode_descriptor(name, help, None, MetricType::Gauge)?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{Full, StreamBody};

    fn limits(budget: &BodyBudget) -> Limits<'_> {
        Limits {
            max_bytes: 1024,
            timeout: Duration::from_secs(5),
            budget,
        }
    }

    /// A chunked body (no declared length) of `chunks`.
    fn chunked(
        chunks: Vec<&'static [u8]>,
    ) -> impl Body<Data = Bytes, Error = BoxError> + Send + 'static {
        StreamBody::new(futures::stream::iter(chunks.into_iter().map(|c| {
            Ok::<_, BoxError>(http_body::Frame::data(Bytes::from_static(c)))
        })))
    }

    #[tokio::test]
    async fn a_whole_body_is_used_as_it_came() {
        let budget = BodyBudget::new(100);
        let input = Bytes::from_static(b"{\"a\":1}");
        let (bytes, share) = read(Full::new(input.clone()), limits(&budget))
            .await
            .unwrap();
        assert_eq!(bytes, input);
        assert_eq!(bytes.as_ptr(), input.as_ptr(), "no copy");
        assert_eq!(budget.in_use(), 7);
        drop(share);
        assert_eq!(budget.in_use(), 0);
    }

    #[tokio::test]
    async fn chunks_are_gathered_and_counted_as_the_buffer_grows() {
        let budget = BodyBudget::new(1000);
        let (bytes, share) = read(chunked(vec![b"ab", b"", b"cde", b"f"]), limits(&budget))
            .await
            .unwrap();
        assert_eq!(&bytes[..], b"abcdef");
        // The buffer's capacity is what the body holds: 2 * (2 + 3), then room for 1 more.
        assert_eq!(budget.in_use(), 10);
        drop(share);
        assert_eq!(budget.in_use(), 0);
    }

    /// A chunked body's buffer grows by a quarter at least: past twice its size in the
    /// budget, a growth by what one frame needs would copy all that is held for every
    /// frame, so the body is refused (503) instead, and its share given back.
    #[tokio::test]
    async fn a_chunked_buffer_grows_by_a_quarter_or_the_body_is_refused() {
        let budget = BodyBudget::new(10_000);
        let frames: Vec<&'static [u8]> = vec![b"x"; 9_000];
        let wide = |budget| Limits {
            max_bytes: 100_000,
            ..limits(budget)
        };
        // Doubling reaches 8,192; 16,384 and 10,240 exceed the budget at the 8,193rd byte.
        let err = read(chunked(frames), wide(&budget)).await.unwrap_err();
        assert_eq!(err.http().code, "server_busy");
        assert_eq!(budget.in_use(), 0);
        // With room for a quarter more it grows by that and is read.
        let budget = BodyBudget::new(10_240);
        let frames: Vec<&'static [u8]> = vec![b"x"; 9_000];
        let (bytes, share) = read(chunked(frames), wide(&budget)).await.unwrap();
        assert_eq!(bytes.len(), 9_000);
        assert_eq!(budget.in_use(), 10_240);
        drop(share);
    }

    /// `chunks`, declaring their total length as `content-length` does.
    struct Declared<B>(B, u64);

    impl<B: Body + Unpin> Body for Declared<B> {
        type Data = B::Data;
        type Error = B::Error;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
            Pin::new(&mut self.0).poll_frame(cx)
        }

        fn size_hint(&self) -> http_body::SizeHint {
            http_body::SizeHint::with_exact(self.1)
        }
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8).collect()
    }

    #[tokio::test]
    async fn large_bodies_are_read_whole_into_a_mapping() {
        let budget = BodyBudget::new(1 << 24);
        let limits = Limits {
            max_bytes: 1 << 22,
            ..limits(&budget)
        };
        let data = Bytes::from(pattern(3 * MAP_FROM + 17));
        let pieces = || {
            let mut at = 0;
            let mut out = Vec::new();
            for len in [1000, MAP_FROM, 5, MAP_FROM * 2] {
                let end = (at + len).min(data.len());
                out.push(Ok::<_, BoxError>(http_body::Frame::data(
                    data.slice(at..end),
                )));
                at = end;
            }
            out
        };
        // Declared: one buffer of the declared size, taken from the budget up front.
        let body = Declared(
            StreamBody::new(futures::stream::iter(pieces())),
            data.len() as u64,
        );
        let (bytes, share) = read(body, limits).await.unwrap();
        assert_eq!(bytes, data);
        assert_eq!(budget.in_use(), data.len());
        drop(share);
        // Chunked: the buffer moves from the heap to a mapping as it grows.
        let body = StreamBody::new(futures::stream::iter(pieces()));
        let (bytes, share) = read(body, limits).await.unwrap();
        assert_eq!(bytes, data);
        assert!(budget.in_use() >= data.len());
        drop(share);
        assert_eq!(budget.in_use(), 0);
    }

    /// A declared body of `len` bytes arriving in two pieces (so that it is copied into
    /// a buffer of its own).
    fn declared(len: usize) -> impl Body<Data = Bytes, Error = BoxError> + Send + Unpin {
        let data = Bytes::from(pattern(len));
        let (a, b) = (data.slice(..len / 2), data.slice(len / 2..));
        Declared(
            StreamBody::new(futures::stream::iter([
                Ok::<_, BoxError>(http_body::Frame::data(a)),
                Ok(http_body::Frame::data(b)),
            ])),
            len as u64,
        )
    }

    #[tokio::test]
    async fn a_freed_large_body_lends_its_mapping_to_the_next() {
        let budget = BodyBudget::new(1 << 26);
        let limits = Limits {
            max_bytes: 1 << 25,
            ..limits(&budget)
        };
        let len = 128 * 1024 + 3;
        let (first, share) = read(declared(len), limits).await.unwrap();
        assert_eq!(first, Bytes::from(pattern(len)));
        drop(share);
        assert_eq!(budget.spare_bytes(), 0, "kept only once freed");
        let at = first.as_ptr();
        // A slice of the body (a JSON value) keeps it alive.
        let value = first.slice(10..20);
        drop(first);
        assert_eq!(budget.spare_bytes(), 0);
        drop(value);
        // Kept whole: its size class, the next power of two.
        assert_eq!(budget.spare_bytes(), 256 * 1024);
        // A body of the same class reads into the same mapping, and gives it back.
        let (second, share) = read(declared(len + 1000), limits).await.unwrap();
        assert_eq!(second.as_ptr(), at, "the kept mapping is reused");
        assert_eq!(second, Bytes::from(pattern(len + 1000)));
        assert_eq!(budget.spare_bytes(), 0);
        drop((second, share));
        assert_eq!(budget.spare_bytes(), 256 * 1024);
        // Past SPARE_MAX nothing is kept.
        let (big, share) = read(declared(SPARE_MAX + 1), limits).await.unwrap();
        drop((big, share));
        assert_eq!(budget.spare_bytes(), 256 * 1024);
    }

    #[tokio::test]
    async fn kept_mappings_stay_within_their_bound() {
        let budget = BodyBudget::new(1 << 28);
        let limits = Limits {
            max_bytes: 1 << 25,
            ..limits(&budget)
        };
        // Many bodies alive at once, then all freed: only SPARE_BYTES of them are kept.
        let mut alive = Vec::new();
        for _ in 0..(2 * SPARE_BYTES / SPARE_MAX + 3) {
            alive.push(read(declared(SPARE_MAX - 5), limits).await.unwrap());
        }
        drop(alive);
        assert_eq!(budget.spare_bytes(), SPARE_BYTES);
        assert_eq!(budget.in_use(), 0);
    }

    /// A kept mapping whose written pages the budget has no room for is left kept, and
    /// the body reads into a new one, taking only what it sent.
    #[tokio::test]
    async fn a_kept_mapping_that_leaves_no_room_is_passed_over() {
        let budget = BodyBudget::new(200 * 1024);
        let limits = Limits {
            max_bytes: 1 << 22,
            ..limits(&budget)
        };
        let len = 128 * 1024 + 3;
        let (first, share) = read(declared(len), limits).await.unwrap();
        drop((first, share));
        assert_eq!(budget.spare_bytes(), 256 * 1024);
        let other = budget.clone();
        assert!(other.take(100 * 1024));
        let frames = vec![Bytes::from_static(b"{\"a\""), Bytes::from_static(b":1")];
        let (tx, body) = stalled(200 * 1024, frames);
        let mut held = Box::pin(read(body, limits));
        assert!(futures::poll!(held.as_mut()).is_pending());
        assert_eq!(budget.in_use(), 100 * 1024 + 6);
        assert_eq!(budget.spare_bytes(), 256 * 1024, "still kept");
        drop((held, tx));
        other.give_back(100 * 1024);
        assert_eq!(budget.in_use(), 0);
    }

    #[tokio::test]
    async fn a_body_past_the_budget_is_refused_at_its_first_bytes() {
        let budget = BodyBudget::new(100);
        let other = budget.clone();
        assert!(other.take(60));
        let err = read(Full::new(Bytes::from(vec![b' '; 50])), limits(&budget))
            .await
            .unwrap_err();
        assert_eq!(
            (err.http().status.as_u16(), err.http().code),
            (503, "server_busy")
        );
        assert_eq!(err.http().retry_after, Some(BUSY_RETRY_AFTER));
        assert_eq!(budget.in_use(), 60, "nothing more taken");
        other.give_back(60);
        let (_, share) = read(Full::new(Bytes::from(vec![b' '; 50])), limits(&budget))
            .await
            .unwrap();
        assert_eq!(budget.in_use(), 50);
        drop(share);
    }

    /// A client body that sends `frames` (each its own frame), declaring `declared`
    /// bytes, then stalls until `tx` is dropped or sends more.
    fn stalled(
        declared: usize,
        frames: Vec<Bytes>,
    ) -> (
        futures::channel::mpsc::UnboundedSender<Result<http_body::Frame<Bytes>, BoxError>>,
        impl Body<Data = Bytes, Error = BoxError> + Send + Unpin + 'static,
    ) {
        let (tx, rx) = futures::channel::mpsc::unbounded();
        for f in frames {
            tx.unbounded_send(Ok(http_body::Frame::data(f))).unwrap();
        }
        (tx, Declared(StreamBody::new(rx), declared as u64))
    }

    /// A declared length takes nothing from the budget before its bytes arrive: a
    /// client that declares a large body and sends none of it holds no room that
    /// others' bodies need.
    #[tokio::test]
    async fn a_declared_length_takes_nothing_before_its_bytes_arrive() {
        let budget = BodyBudget::new(100);
        let (tx, body) = stalled(100, Vec::new());
        let mut waiting = Box::pin(read(body, limits(&budget)));
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        assert_eq!(budget.in_use(), 0, "nothing arrived, nothing taken");
        let (bytes, share) = read(
            Full::new(Bytes::from_static(b"0123456789")),
            limits(&budget),
        )
        .await
        .unwrap();
        assert_eq!(&bytes[..], b"0123456789");
        assert_eq!(budget.in_use(), 10);
        drop((share, waiting, tx));
        assert_eq!(budget.in_use(), 0);
    }

    /// A declared body is read into one buffer of its declared size, but takes from
    /// the budget only what has arrived; one whose next bytes would pass the budget
    /// is cut there with 503 `server_busy`, and gives its share back.
    #[tokio::test]
    async fn a_declared_body_is_charged_as_it_arrives_and_cut_at_the_ceiling() {
        const KIB: usize = 1024;
        let budget = BodyBudget::new(1024 * KIB);
        let limits = Limits {
            max_bytes: 1 << 22,
            ..limits(&budget)
        };
        let piece = || Bytes::from(vec![b' '; 300 * KIB]);
        // 600 KiB of 900 arrived: 600 KiB taken.
        let (tx, body) = stalled(900 * KIB, vec![piece(), piece()]);
        let mut held = Box::pin(read(body, limits));
        assert!(futures::poll!(held.as_mut()).is_pending());
        assert_eq!(budget.in_use(), 600 * KIB);
        // Another of 500 KiB: its first 250 KiB fit, the next 250 would not.
        let half = Bytes::from(vec![b' '; 250 * KIB]);
        let (other_tx, other) = stalled(500 * KIB, vec![half.clone(), half]);
        let err = read(other, limits).await.unwrap_err();
        assert_eq!(
            (err.http().status.as_u16(), err.http().code),
            (503, "server_busy")
        );
        assert_eq!(err.http().retry_after, Some(BUSY_RETRY_AFTER));
        assert_eq!(budget.in_use(), 600 * KIB, "the cut body's share is back");
        // The first one's last 300 KiB arrive, within the budget: read whole.
        tx.unbounded_send(Ok(http_body::Frame::data(piece())))
            .unwrap();
        drop(tx);
        let (bytes, share) = held.await.unwrap();
        assert_eq!(bytes.len(), 900 * KIB);
        assert_eq!(budget.in_use(), 900 * KIB);
        drop((share, other_tx));
        assert_eq!(budget.in_use(), 0);
    }

    /// A kept mapping's pages that an earlier body wrote are memory held: a body that
    /// reads into it takes them from the budget at once, whatever it has sent.
    #[tokio::test]
    async fn a_kept_mapping_is_charged_what_earlier_bodies_wrote_to_it() {
        let budget = BodyBudget::new(1 << 24);
        let limits = Limits {
            max_bytes: 1 << 22,
            ..limits(&budget)
        };
        let len = 128 * 1024 + 3;
        let (first, share) = read(declared(len), limits).await.unwrap();
        drop((first, share));
        assert_eq!(budget.spare_bytes(), 256 * 1024);
        // Two small frames of a body of the same class: it reads into the kept mapping.
        let frames = vec![Bytes::from_static(b"{\"a\""), Bytes::from_static(b":1")];
        let (tx, body) = stalled(200 * 1024, frames);
        let mut held = Box::pin(read(body, limits));
        assert!(futures::poll!(held.as_mut()).is_pending());
        assert_eq!(budget.spare_bytes(), 0, "the kept mapping is in use");
        assert_eq!(budget.in_use(), len);
        drop((held, tx));
        assert_eq!(budget.in_use(), 0);
    }

    /// A declared body under [`MAP_FROM`] (on the heap, where a buffer costs its whole
    /// capacity at once) that trickles in holds a bounded multiple of what arrived, not
    /// its declared size: its buffer grows as its bytes come, never past that size.
    #[tokio::test]
    async fn a_trickling_declared_body_on_the_heap_holds_what_arrived() {
        let budget = BodyBudget::new(1 << 20);
        let limits = Limits {
            max_bytes: 1 << 20,
            ..limits(&budget)
        };
        let declared = MAP_FROM - 1;
        let whole = Bytes::from(pattern(declared));
        let (tx, body) = stalled(declared, vec![whole.slice(..1), whole.slice(1..2)]);
        let mut held = Box::pin(read(body, limits));
        assert!(futures::poll!(held.as_mut()).is_pending());
        assert!(
            budget.in_use() <= 2 * HEAP_AHEAD,
            "two bytes arrived, {} taken",
            budget.in_use()
        );
        // The rest in pieces of 1,000 bytes: its buffer grows with them.
        let mut at = 2;
        while at < declared {
            let end = (at + 1000).min(declared);
            tx.unbounded_send(Ok(http_body::Frame::data(whole.slice(at..end))))
                .unwrap();
            at = end;
            assert!(futures::poll!(held.as_mut()).is_pending() || at == declared);
            assert!(budget.in_use() <= (at * HEAP_AHEAD).min(declared));
        }
        drop(tx);
        let (bytes, share) = held.await.unwrap();
        assert_eq!(bytes, whole);
        assert!(budget.in_use() <= declared);
        drop(share);
        assert_eq!(budget.in_use(), 0);
    }

    /// Clients that declare bodies just under [`MAP_FROM`] and send a byte or two of
    /// them hold a few bytes each: many of them leave the budget to everyone else
    /// (each held its whole declared size before: 16 of these filled 1 MiB).
    #[tokio::test]
    async fn declared_but_silent_clients_do_not_fill_the_budget() {
        let budget = BodyBudget::new(1 << 20);
        let limits = Limits {
            max_bytes: 1 << 20,
            ..limits(&budget)
        };
        let mut held = Vec::new();
        for _ in 0..256 {
            let frames = vec![Bytes::from_static(b"{"), Bytes::from_static(b" ")];
            let (tx, body) = stalled(MAP_FROM - 1, frames);
            let mut reading = Box::pin(read(body, limits));
            assert!(
                futures::poll!(reading.as_mut()).is_pending(),
                "refused with {} of {} taken",
                budget.in_use(),
                budget.limit()
            );
            held.push((reading, tx));
        }
        assert!(budget.in_use() <= 256 * 2 * HEAP_AHEAD);
        drop(held);
        assert_eq!(budget.in_use(), 0);
    }

    /// A declared body on the heap whose second piece brings a quarter of it or more
    /// is copied into one buffer of its declared size, which never moves: one
    /// allocation, as when the whole size was taken at once.
    #[test]
    fn a_declared_body_in_big_pieces_gets_one_buffer_of_its_size() {
        let budget = BodyBudget::new(1 << 20);
        let mut share = Share::new(&budget);
        let declared = 50_000;
        let whole = Bytes::from(pattern(declared));
        let mut state = State::Empty;
        let mut add = |range: std::ops::Range<usize>, state: &mut State| {
            append(
                state,
                whole.slice(range),
                Some(declared),
                &mut share,
                1 << 20,
            )
            .unwrap();
        };
        add(0..5_000, &mut state);
        add(5_000..12_500, &mut state);
        let State::Many(buf) = &state else {
            panic!("not gathered")
        };
        assert_eq!(buf.capacity(), declared);
        let at = buf.as_slice().as_ptr();
        add(12_500..declared, &mut state);
        let State::Many(buf) = &state else {
            panic!("not gathered")
        };
        assert_eq!(buf.as_slice().as_ptr(), at, "the buffer moved");
        assert_eq!(buf.as_slice(), &whole[..]);
        drop(state);
        drop(share);
        assert_eq!(budget.in_use(), 0);
    }

    #[tokio::test]
    async fn a_chunked_body_past_the_budget_is_cut_as_it_grows() {
        let budget = BodyBudget::new(8);
        // Exactly the budget: the buffer grows to what is needed, not twice that.
        let (bytes, share) = read(chunked(vec![b"abcd", b"efgh"]), limits(&budget))
            .await
            .unwrap();
        assert_eq!(&bytes[..], b"abcdefgh");
        assert_eq!(budget.in_use(), 8);
        drop(share);
        let err = read(chunked(vec![b"abcd", b"efgh", b"ij"]), limits(&budget))
            .await
            .unwrap_err();
        assert_eq!(err.http().code, "server_busy");
        assert_eq!(budget.in_use(), 0, "the share is given back");
    }

    #[tokio::test]
    async fn size_limits_hold_declared_or_received() {
        let budget = BodyBudget::new(1 << 20);
        let err = read(Full::new(Bytes::from(vec![b' '; 2000])), limits(&budget))
            .await
            .unwrap_err();
        assert_eq!(err.http().code, "request_too_large");
        static BIG: [u8; 600] = [b' '; 600];
        let err = read(chunked(vec![&BIG, &BIG]), limits(&budget))
            .await
            .unwrap_err();
        assert_eq!(err.http().code, "request_too_large");
        assert_eq!(budget.in_use(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_body_times_out() {
        let budget = BodyBudget::new(1 << 20);
        let (mut tx, body) =
            futures::channel::mpsc::channel::<Result<http_body::Frame<Bytes>, BoxError>>(1);
        tx.try_send(Ok(http_body::Frame::data(Bytes::from_static(b"{\"a\""))))
            .unwrap();
        let body = StreamBody::new(body);
        let started = tokio::time::Instant::now();
        let err = read(body, limits(&budget)).await.unwrap_err();
        assert_eq!(
            (err.http().status.as_u16(), err.http().code),
            (408, "request_timeout")
        );
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        assert_eq!(budget.in_use(), 0);
        drop(tx);
    }

    #[tokio::test]
    async fn a_client_that_breaks_off_is_a_client_error() {
        let budget = BodyBudget::new(1 << 20);
        let body = StreamBody::new(futures::stream::iter([
            Ok(http_body::Frame::data(Bytes::from_static(b"{"))),
            Err::<http_body::Frame<Bytes>, BoxError>("reset".into()),
        ]));
        let err = read(body, limits(&budget)).await.unwrap_err();
        assert_eq!(err.http().status.as_u16(), 400);
    }

    /// A runtime whose blocking pool has one thread: jobs run one after the other, in
    /// the order they were spawned.
    fn one_blocking_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .max_blocking_threads(1)
            .build()
            .unwrap()
    }

    /// A body of `len` bytes read whole under `budget`: its bytes and its share.
    async fn whole(budget: &BodyBudget, len: usize) -> (Bytes, Share<'_>) {
        let limits = Limits {
            max_bytes: 1 << 22,
            ..limits(budget)
        };
        read(Full::new(Bytes::from(vec![b' '; len])), limits)
            .await
            .unwrap()
    }

    /// A large body's parse goes on with its bytes when its client leaves (a thread is
    /// not stopped): its share of the budget goes with it, held until it ends.
    #[test]
    fn a_parse_its_client_left_holds_its_share_until_it_ends() {
        let runtime = one_blocking_thread();
        let budget = BodyBudget::new(1 << 20);
        let gate = Arc::new(std::sync::Barrier::new(2));
        let (started_tx, started) = std::sync::mpsc::channel();
        let during = runtime.block_on(async {
            let (bytes, share) = whole(&budget, 300 * 1024).await;
            let job_gate = Arc::clone(&gate);
            let parse = on_blocking_pool(share, move || {
                let _ = started_tx.send(());
                job_gate.wait();
                Ok(bytes.len())
            });
            let mut parse = Box::pin(parse);
            assert!(futures::poll!(parse.as_mut()).is_pending());
            started.recv().unwrap();
            drop(parse);
            budget.in_use()
        });
        gate.wait();
        // The pool's one thread runs this once the parse has ended.
        runtime.block_on(runtime.spawn_blocking(|| ())).unwrap();
        assert_eq!(
            during,
            300 * 1024,
            "the running parse holds the body's share"
        );
        assert_eq!(budget.in_use(), 0);
    }

    /// A large body's parse that has not started when its client leaves never runs,
    /// and gives its share back.
    #[test]
    fn a_parse_its_client_left_before_it_started_never_runs() {
        let runtime = one_blocking_thread();
        let budget = BodyBudget::new(1 << 20);
        let gate = Arc::new(std::sync::Barrier::new(2));
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        runtime.block_on(async {
            // The pool's one thread is busy until the gate opens.
            let job_gate = Arc::clone(&gate);
            let busy = tokio::task::spawn_blocking(move || {
                job_gate.wait();
            });
            let (bytes, share) = whole(&budget, 300 * 1024).await;
            let job_ran = Arc::clone(&ran);
            let parse = on_blocking_pool(share, move || {
                job_ran.store(true, Ordering::Relaxed);
                Ok(bytes.len())
            });
            let mut parse = Box::pin(parse);
            assert!(futures::poll!(parse.as_mut()).is_pending());
            drop(parse);
            gate.wait();
            busy.await.unwrap();
            // Run after the parse's job, whether it ran or was dropped unstarted.
            tokio::task::spawn_blocking(|| ()).await.unwrap();
        });
        assert!(!ran.load(Ordering::Relaxed), "a dropped parse ran");
        assert_eq!(budget.in_use(), 0);
    }
}
