//! Admission: how many requests run at once, and what happens to the rest.
//!
//! Two limits, both off by default:
//!
//! - a **global** in-flight limit: a request past it waits in a FIFO queue (a fair
//!   semaphore: permits go to waiters in arrival order) until one of the running
//!   requests ends — its response body finished or dropped;
//! - a **per-endpoint** in-flight limit: when the route chosen for a request has an
//!   endpoint at its limit, the request waits in the same queue until some request
//!   ends, then routes again (so it may go elsewhere). These waiters are woken
//!   together and race for the freed room, so their order is close to, but not
//!   strictly, FIFO; the limit is checked when a request is admitted, so requests
//!   admitted at the same instant on different threads may pass it by one each.
//!
//! The queue is bounded: a request that finds it full is refused at once with 429
//! `queue_full` and a `retry-after` header, and one that waits longer than the queue
//! timeout (or past its deadline) gets 503 `queue_timeout`. Both are OpenAI-format
//! errors. No request is dropped silently, and a waiting request that its client
//! abandons leaves the queue at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use disagg_core::admission::{Admission, AdmissionStats, Permit};
use disagg_core::error::PdError;
use disagg_core::router::Route;
use futures::future::BoxFuture;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// Admission settings.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AdmissionConfig {
    /// Requests served at once by the orchestrator, all endpoints together (default
    /// `None`: no limit).
    pub max_in_flight: Option<usize>,
    /// Requests in flight on one endpoint (default `None`: no limit). A prefill
    /// endpoint counts its prefill exchanges, a decode endpoint its streams.
    pub max_in_flight_per_endpoint: Option<usize>,
    /// Requests that may wait for admission; one more is refused with 429 (default
    /// 1024).
    pub max_queue: usize,
    /// Longest wait in the queue before 503 `queue_timeout` (default 10 s). A request's
    /// deadline, when shorter, bounds the wait too.
    pub queue_timeout: Duration,
    /// The `retry-after` a refused client is given (default 1 s).
    pub retry_after: Duration,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            max_in_flight: None,
            max_in_flight_per_endpoint: None,
            max_queue: 1024,
            queue_timeout: Duration::from_secs(10),
            retry_after: Duration::from_secs(1),
        }
    }
}

/// The admission of one orchestrator (and of the orchestrators made from it with
/// `with_transport`, which share it): [`AdmissionConfig`]'s limits and queue behind the
/// [`Admission`] seam.
#[derive(Debug, Clone)]
pub struct Limits {
    state: Arc<State>,
}

#[derive(Debug)]
struct State {
    config: AdmissionConfig,
    global: Option<Arc<Semaphore>>,
    /// Requests waiting, for either limit.
    waiting: AtomicUsize,
    /// Rung when a request (or a prefill exchange) ends, for waiters on a per-endpoint
    /// limit.
    ended: Notify,
    queue_full: AtomicU64,
    queue_timeouts: AtomicU64,
    queued: AtomicU64,
}

/// A request's place among the running ones, inside its [`Permit`].
struct Place {
    state: Arc<State>,
    _global: Option<OwnedSemaphorePermit>,
}

impl Drop for Place {
    fn drop(&mut self) {
        if self.state.config.max_in_flight_per_endpoint.is_some() {
            self.state.ended.notify_waiters();
        }
    }
}

/// Counts a request as waiting while it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Limits {
    /// The limits and queue of `config`.
    pub fn new(config: AdmissionConfig) -> Self {
        Limits {
            state: Arc::new(State {
                global: config.max_in_flight.map(|n| Arc::new(Semaphore::new(n))),
                config,
                waiting: AtomicUsize::new(0),
                ended: Notify::new(),
                queue_full: AtomicU64::new(0),
                queue_timeouts: AtomicU64::new(0),
                queued: AtomicU64::new(0),
            }),
        }
    }

    /// The settings.
    pub fn config(&self) -> &AdmissionConfig {
        &self.state.config
    }
}

impl State {
    /// A place in the queue, or 429 when it is full.
    fn enqueue(&self) -> Result<Waiting<'_>, PdError> {
        let before = self.waiting.fetch_add(1, Ordering::Relaxed);
        let guard = Waiting(&self.waiting);
        if before >= self.config.max_queue {
            self.queue_full.fetch_add(1, Ordering::Relaxed);
            return Err(PdError::queue_full(self.config.retry_after));
        }
        self.queued.fetch_add(1, Ordering::Relaxed);
        Ok(guard)
    }

    /// When a wait that started at `since` must end: the queue timeout or the request's
    /// deadline, whichever comes first.
    fn wait_until(&self, since: Instant, deadline: Option<Instant>) -> Instant {
        let by_queue = since + self.config.queue_timeout;
        deadline.map_or(by_queue, |d| d.min(by_queue))
    }

    fn timed_out(&self, since: Instant) -> PdError {
        self.queue_timeouts.fetch_add(1, Ordering::Relaxed);
        PdError::queue_timeout(since.elapsed())
    }

    fn permit(self: &Arc<Self>, global: Option<OwnedSemaphorePermit>) -> Permit {
        Permit::new(Place {
            state: Arc::clone(self),
            _global: global,
        })
    }
}

impl Admission for Limits {
    fn try_admit(&self) -> Option<Permit> {
        let global = match &self.state.global {
            None => None,
            Some(sem) => Some(Arc::clone(sem).try_acquire_owned().ok()?),
        };
        Some(self.state.permit(global))
    }

    /// Wait in the queue for the global limit.
    fn admit(&self, deadline: Option<Instant>) -> BoxFuture<'static, Result<Permit, PdError>> {
        let state = Arc::clone(&self.state);
        Box::pin(async move {
            let global = match &state.global {
                None => None,
                Some(sem) => match Arc::clone(sem).try_acquire_owned() {
                    Ok(p) => Some(p),
                    Err(_) => {
                        let _waiting = state.enqueue()?;
                        let since = Instant::now();
                        let until = state.wait_until(since, deadline);
                        match tokio::time::timeout_at(until, Arc::clone(sem).acquire_owned()).await
                        {
                            Ok(Ok(p)) => Some(p),
                            // Closed never happens: the semaphore is never closed.
                            Ok(Err(_)) | Err(_) => return Err(state.timed_out(since)),
                        }
                    }
                },
            };
            Ok(state.permit(global))
        })
    }

    /// Whether both endpoints of `route` are below the per-endpoint limit.
    fn has_room(&self, route: &Route) -> bool {
        let Some(limit) = self.state.config.max_in_flight_per_endpoint else {
            return true;
        };
        route.decode.in_flight() < limit
            && route.prefill.as_ref().is_none_or(|p| p.in_flight() < limit)
    }

    /// Wait, as a queued request, until some request ends.
    fn wait_for_room(
        &self,
        since: Instant,
        deadline: Option<Instant>,
    ) -> BoxFuture<'static, Result<(), PdError>> {
        let state = Arc::clone(&self.state);
        Box::pin(async move {
            let _waiting = state.enqueue()?;
            let until = state.wait_until(since, deadline);
            match tokio::time::timeout_at(until, state.ended.notified()).await {
                Ok(()) => Ok(()),
                Err(_) => Err(state.timed_out(since)),
            }
        })
    }

    fn tracks_exchanges(&self) -> bool {
        self.state.config.max_in_flight_per_endpoint.is_some()
    }

    fn exchange_ended(&self) {
        self.state.ended.notify_waiters();
    }

    fn stats(&self) -> AdmissionStats {
        let s = &self.state;
        let mut stats = AdmissionStats::default();
        stats.waiting = s.waiting.load(Ordering::Relaxed) as u64;
        stats.queued = s.queued.load(Ordering::Relaxed);
        stats.queue_full = s.queue_full.load(Ordering::Relaxed);
        stats.queue_timeouts = s.queue_timeouts.load(Ordering::Relaxed);
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limited(n: usize, queue: usize, timeout_ms: u64) -> Arc<Limits> {
        Arc::new(Limits::new(AdmissionConfig {
            max_in_flight: Some(n),
            max_queue: queue,
            queue_timeout: Duration::from_millis(timeout_ms),
            ..AdmissionConfig::default()
        }))
    }

    /// Requests waiting in the queue.
    fn waiting(a: &Limits) -> u64 {
        a.stats().waiting
    }

    /// Requests holding a place under the global limit.
    fn running(a: &Limits) -> usize {
        let sem = a.state.global.as_ref().unwrap();
        a.state.config.max_in_flight.unwrap() - sem.available_permits()
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_is_refused_with_retry_after() {
        let a = limited(1, 1, 1000);
        let first = a.admit(None).await.unwrap();
        let a2 = Arc::clone(&a);
        let queued = tokio::spawn(async move { a2.admit(None).await.map(drop) });
        tokio::task::yield_now().await;
        assert_eq!(waiting(&a), 1);
        let e = a.admit(None).await.unwrap_err();
        assert_eq!(e.code(), "queue_full");
        assert_eq!(e.retry_after(), Some(Duration::from_secs(1)));
        drop(first);
        queued.await.unwrap().unwrap();
        assert_eq!((waiting(&a), running(&a)), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_long_wait_is_a_queue_timeout() {
        let a = limited(1, 8, 500);
        let _first = a.admit(None).await.unwrap();
        let start = Instant::now();
        let e = a.admit(None).await.unwrap_err();
        assert_eq!(e.code(), "queue_timeout");
        assert_eq!(start.elapsed(), Duration::from_millis(500));
        // A nearer deadline ends the wait sooner.
        let e = a
            .admit(Some(Instant::now() + Duration::from_millis(100)))
            .await
            .unwrap_err();
        assert_eq!(e.code(), "queue_timeout");
        assert_eq!(waiting(&a), 0);
        assert_eq!(a.stats().queue_timeouts, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_are_admitted_in_arrival_order() {
        let a = limited(1, 8, 10_000);
        let first = a.admit(None).await.unwrap();
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..4 {
            let (a, order) = (Arc::clone(&a), Arc::clone(&order));
            tasks.push(tokio::spawn(async move {
                let p = a.admit(None).await.unwrap();
                order.lock().unwrap().push(i);
                tokio::time::sleep(Duration::from_millis(10)).await;
                drop(p);
            }));
            // Each arrives after the previous one is queued.
            tokio::task::yield_now().await;
        }
        drop(first);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3]);
    }

    #[tokio::test(start_paused = true)]
    async fn an_abandoned_waiter_leaves_the_queue() {
        let a = limited(1, 8, 10_000);
        let _first = a.admit(None).await.unwrap();
        let wait = a.admit(None);
        let r = tokio::time::timeout(Duration::from_millis(10), wait).await;
        assert!(r.is_err());
        assert_eq!((waiting(&a), running(&a)), (0, 1));
    }
}
