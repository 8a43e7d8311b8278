//! The ceiling on the pods one selector's watch holds, between kube-rs's watcher and
//! its reflector.
//!
//! The watcher emits every pod of a list (`InitApply`, page after page, until
//! `InitDone`) and every pod a watch adds; the reflector keeps them all (a list's in a
//! buffer until it is complete, then in its store). [`pod_events`] counts them first: a
//! list past [`max_pods`] is given up at the first pod past it, as is a watch event that
//! would add a pod to a store already holding as many; the watcher is then dropped (its
//! list or watch with it) and a new one relists after a backoff (0.8 s, doubling to 30 s,
//! as kube-rs's own), so that one selector holds at most `max_pods` pods in its store and
//! as many in a list under way. A pod without a `metadata.name` (which the reflector's
//! store would panic on; no API server sends one) is refused the same way.
//!
//! Each refusal is a [`watcher::Error`] holding a [`Refused`] (see [`refused`]): the
//! source logs it and counts it, the store keeping its last good pods meanwhile.

use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::reflector::{ObjectRef, Store, store::Writer};
use kube::runtime::watcher::Event;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::time::Sleep;

use super::KubernetesConfig;

/// The first wait before a refused selector lists again.
const FIRST_RETRY: Duration = Duration::from_millis(800);
/// The longest wait before a refused selector lists again.
const LAST_RETRY: Duration = Duration::from_secs(30);

/// The most pods one selector's watch holds: twice
/// [`KubernetesConfig::max_endpoints`], room for as many pods that make no endpoint
/// (not ready, pending, a rolling update's surge) as ones that do.
pub(super) fn max_pods(config: &KubernetesConfig) -> usize {
    config.max_endpoints.saturating_mul(2)
}

/// Why a selector's list or watch was given up.
#[derive(Debug, thiserror::Error)]
pub(super) enum Refused {
    /// More pods than the ceiling match the selector.
    #[error(
        "more than {0} pods match the selector (twice the endpoints allowed per source); keeping the last good pods"
    )]
    TooManyPods(usize),
    /// A pod without `metadata.name`.
    #[error("the API server sent a pod without metadata.name")]
    Nameless,
}

/// The refusal `error` is, if it is one.
pub(super) fn refused(error: &watcher::Error) -> Option<&Refused> {
    match error {
        watcher::Error::InitialListFailed(kube::Error::Service(e))
        | watcher::Error::WatchFailed(kube::Error::Service(e)) => e.downcast_ref(),
        _ => None,
    }
}

/// One selector's watch events through kube-rs's watcher (with its default backoff),
/// within `max_pods`, its pods kept in `writer`'s store (`store` reads it).
pub(super) fn pod_events(
    api: Api<Pod>,
    config: watcher::Config,
    max_pods: usize,
    store: Store<Pod>,
    writer: Writer<Pod>,
) -> impl Stream<Item = watcher::Result<Event<Pod>>> + Send + 'static {
    Held {
        watch: move || watcher(api.clone(), config.clone()).boxed(),
        watcher: None,
        store,
        max_pods,
        listed: 0,
        retry: None,
        refusals: 0,
    }
    .default_backoff()
    .reflect(writer)
}

/// A watcher's events, within the ceiling.
struct Held<F> {
    /// Makes a new watcher (one that lists first).
    watch: F,
    /// The watcher; `None` once refused, until the retry.
    watcher: Option<BoxStream<'static, watcher::Result<Event<Pod>>>>,
    /// The reflector's store, read to count the pods held.
    store: Store<Pod>,
    max_pods: usize,
    /// The pods of the list under way.
    listed: usize,
    /// When the refused watcher's successor starts.
    retry: Option<Pin<Box<Sleep>>>,
    /// Refusals since the last list taken whole.
    refusals: u32,
}

impl<F> Held<F> {
    /// Gives the watcher up and returns the error saying why, the retry set.
    fn refuse(&mut self, why: Refused, listing: bool) -> watcher::Error {
        self.watcher = None;
        self.listed = 0;
        let wait = FIRST_RETRY
            .saturating_mul(1 << self.refusals.min(6))
            .min(LAST_RETRY);
        self.refusals = self.refusals.saturating_add(1);
        self.retry = Some(Box::pin(tokio::time::sleep(wait)));
        let error = kube::Error::Service(Box::new(why));
        if listing {
            watcher::Error::InitialListFailed(error)
        } else {
            watcher::Error::WatchFailed(error)
        }
    }
}

impl<F> Stream for Held<F>
where
    F: FnMut() -> BoxStream<'static, watcher::Result<Event<Pod>>> + Unpin,
{
    type Item = watcher::Result<Event<Pod>>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if let Some(retry) = this.retry.as_mut() {
            ready!(retry.as_mut().poll(cx));
            this.retry = None;
        }
        let watcher = this.watcher.get_or_insert_with(&mut this.watch);
        let item = ready!(watcher.poll_next_unpin(cx));
        let pod = match &item {
            Some(Ok(Event::Init)) => {
                this.listed = 0;
                None
            }
            Some(Ok(Event::InitDone)) => {
                this.refusals = 0;
                None
            }
            Some(Ok(Event::InitApply(pod) | Event::Apply(pod) | Event::Delete(pod))) => Some(pod),
            _ => None,
        };
        if let Some(pod) = pod {
            let listing = matches!(item, Some(Ok(Event::InitApply(_))));
            if pod.metadata.name.is_none() {
                return Poll::Ready(Some(Err(this.refuse(Refused::Nameless, listing))));
            }
            let more = match item {
                Some(Ok(Event::InitApply(_))) => {
                    this.listed += 1;
                    this.listed > this.max_pods
                }
                // A pod the store does not hold yet, to a store already full.
                Some(Ok(Event::Apply(_))) => {
                    this.store.len() >= this.max_pods
                        && this.store.get(&ObjectRef::from_obj(pod)).is_none()
                }
                _ => false,
            };
            if more {
                let max = this.max_pods;
                return Poll::Ready(Some(Err(this.refuse(Refused::TooManyPods(max), listing))));
            }
        }
        Poll::Ready(item)
    }
}

// The in-test API server of the integration tests, for kube-rs's real client here.
#[cfg(test)]
#[allow(dead_code, unreachable_pub)]
#[path = "../../tests/discovery/apiserver.rs"]
mod apiserver;

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::stream::BoxStream;
    use kube::runtime::reflector;
    use kube::runtime::watcher::Event;

    use super::apiserver::{FakeApiServer, ListFault, PodDesc};
    use super::*;

    /// Generous: a refused list is retried after a backoff of a few seconds.
    const WAIT: Duration = Duration::from_secs(20);
    const NS: &str = "llm";
    const MAX: usize = 8;

    type Events = BoxStream<'static, watcher::Result<Event<Pod>>>;

    fn pod(name: &str) -> serde_json::Value {
        PodDesc {
            namespace: NS,
            name,
            labels: &[("app", "vllm")],
            annotations: &[],
            ip: "127.0.2.1",
            port: 8000,
            phase: "Running",
            ready: false,
        }
        .json()
    }

    /// `server`'s pods labelled `app=vllm`, watched through kube-rs's client within
    /// [`MAX`] pods; the store they are kept in.
    async fn watch(server: &FakeApiServer) -> (Store<Pod>, Events) {
        let kubeconfig = kube::config::Kubeconfig::from_yaml(&server.kubeconfig(NS)).unwrap();
        let options = kube::config::KubeConfigOptions::default();
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options)
            .await
            .unwrap();
        let api: Api<Pod> = Api::namespaced(kube::Client::try_from(config).unwrap(), NS);
        let (store, writer) = reflector::store();
        let wc = watcher::Config::default().labels("app=vllm").page_size(10);
        let events = pod_events(api, wc, MAX, store.clone(), writer).boxed();
        (store, events)
    }

    /// The next event of `events`, checking that neither the store nor the list in
    /// progress (`listed`: its pods so far) holds more than [`MAX`] pods.
    async fn next(
        events: &mut Events,
        store: &Store<Pod>,
        listed: &mut usize,
    ) -> watcher::Result<Event<Pod>> {
        let event = tokio::time::timeout(WAIT, events.next())
            .await
            .expect("an event in time")
            .expect("the watch goes on");
        assert!(store.len() <= MAX, "the store holds {} pods", store.len());
        match &event {
            Ok(Event::Init) => *listed = 0,
            Ok(Event::InitApply(_)) => {
                *listed += 1;
                assert!(*listed <= MAX, "{listed} pods of one list taken");
            }
            _ => {}
        }
        event
    }

    /// Polls `events` until an error; the error.
    async fn until_refused(events: &mut Events, store: &Store<Pod>) -> watcher::Error {
        let mut listed = 0;
        loop {
            match next(events, store, &mut listed).await {
                Ok(Event::InitDone) => panic!("a list past the ceiling was taken"),
                Ok(_) => {}
                Err(e) => return e,
            }
        }
    }

    /// Polls `events` until a list is complete.
    async fn until_listed(events: &mut Events, store: &Store<Pod>) {
        let mut listed = 0;
        while !matches!(next(events, store, &mut listed).await, Ok(Event::InitDone)) {}
    }

    /// A list of more pods than the ceiling is given up at the first pod past it, and
    /// so is a watch that adds one pod too many: the store never holds more; once the
    /// pods are within the ceiling, the relist is taken.
    #[tokio::test]
    async fn a_selector_never_holds_more_pods_than_its_ceiling() {
        let server = FakeApiServer::start().await;
        for i in 0..30 {
            server.apply(pod(&format!("d{i:02}")));
        }
        let (store, mut events) = watch(&server).await;
        let error = until_refused(&mut events, &store).await;
        assert!(
            matches!(refused(&error), Some(Refused::TooManyPods(MAX))),
            "{error}"
        );
        assert!(store.is_empty());

        // Within the ceiling: listed whole.
        for i in 5..30 {
            server.delete(NS, &format!("d{i:02}"));
        }
        until_listed(&mut events, &store).await;
        assert_eq!(store.len(), 5);

        // Ten more through the watch: the fourth is one too many.
        for i in 30..40 {
            server.apply(pod(&format!("d{i:02}")));
        }
        let error = until_refused(&mut events, &store).await;
        assert!(
            matches!(refused(&error), Some(Refused::TooManyPods(MAX))),
            "{error}"
        );
        assert_eq!(store.len(), MAX, "the pods held before the refusal stay");
    }

    /// A pod without a name (kube-rs's store would panic on it) ends the list as an
    /// error; the next list is taken.
    #[tokio::test]
    async fn a_pod_without_a_name_is_refused_not_a_panic() {
        let server = FakeApiServer::start().await;
        server.apply(pod("d1"));
        server.apply(pod("d2"));
        server.fault_lists(ListFault::Empties(3), 1);
        let (store, mut events) = watch(&server).await;
        let error = until_refused(&mut events, &store).await;
        assert!(
            matches!(refused(&error), Some(Refused::Nameless)),
            "{error}"
        );
        until_listed(&mut events, &store).await;
        assert_eq!(store.len(), 2);
    }
}
