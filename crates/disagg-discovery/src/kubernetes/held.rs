//! The ceiling on the pods one selector's watch holds, between kube-rs's watcher and
//! its reflector.
//!
//! The watcher emits every pod of a list (`InitApply`, page after page, until
//! `InitDone`) and every pod a watch adds; the reflector keeps them all (a list's in a
//! buffer until it is complete, then in its store). [`pod_events`] counts them first: a
//! list past [`max_pods`] is given up at the first pod past it, as is a watch event that
//! would add a pod to a store already holding as many (a pod counts as held only if the
//! store holds it in its own namespace); the watcher is then dropped (its list or watch
//! with it) and a new one relists after a backoff (0.8 s, doubling to 30 s, as kube-rs's
//! own), so that one selector holds at most `max_pods` pods in its store and as many in
//! a list under way. The backoff starts over only after [`QUIET`] without a refusal, not
//! at each list taken: a rolling update at the ceiling relists less and less often. A
//! pod without a `metadata.name` (which the reflector's store would panic on) or without
//! a `metadata.namespace` (pods always have one; kube-rs's `Store::get` finds a pod held
//! without one for its name in any namespace) is refused the same way; no API server
//! sends either.
//!
//! Each refusal is a [`watcher::Error`] holding a [`Refused`] (see [`refused`]): the
//! source logs it and counts it, the store keeping its last good pods meanwhile.

use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use kube::Api;
use kube::runtime::reflector::{ObjectRef, Store, store::Writer};
use kube::runtime::watcher::Event;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::time::{Instant, Sleep};

use super::{EnginePod, KubernetesConfig};

/// The first wait before a refused selector lists again.
const FIRST_RETRY: Duration = Duration::from_millis(800);
/// The longest wait before a refused selector lists again.
const LAST_RETRY: Duration = Duration::from_secs(30);
/// How long without a refusal before the wait starts over from [`FIRST_RETRY`] (as
/// kube-rs's own backoff does).
const QUIET: Duration = Duration::from_secs(120);

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
    /// A pod without `metadata.namespace`.
    #[error("the API server sent a pod without metadata.namespace")]
    Namespaceless,
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
    api: Api<EnginePod>,
    config: watcher::Config,
    max_pods: usize,
    store: Store<EnginePod>,
    writer: Writer<EnginePod>,
) -> impl Stream<Item = watcher::Result<Event<EnginePod>>> + Send + 'static {
    Held::new(
        move || watcher(api.clone(), config.clone()).boxed(),
        max_pods,
        store,
    )
    .default_backoff()
    .reflect(writer)
}

/// A watcher's events, within the ceiling.
struct Held<F> {
    /// Makes a new watcher (one that lists first).
    watch: F,
    /// The watcher; `None` once refused, until the retry.
    watcher: Option<BoxStream<'static, watcher::Result<Event<EnginePod>>>>,
    /// The reflector's store, read to count the pods held.
    store: Store<EnginePod>,
    max_pods: usize,
    /// The pods of the list under way.
    listed: usize,
    /// When the refused watcher's successor starts.
    retry: Option<Pin<Box<Sleep>>>,
    /// Refusals in a row, none more than [`QUIET`] after the one before.
    refusals: u32,
    /// When the last refusal was.
    refused_at: Option<Instant>,
}

impl<F> Held<F> {
    /// The events of the watchers `watch` makes, within `max_pods`, `store` being the
    /// store they are reflected into.
    fn new(watch: F, max_pods: usize, store: Store<EnginePod>) -> Self {
        Held {
            watch,
            watcher: None,
            store,
            max_pods,
            listed: 0,
            retry: None,
            refusals: 0,
            refused_at: None,
        }
    }

    /// Gives the watcher up and returns the error saying why, the retry set.
    fn refuse(&mut self, why: Refused, listing: bool) -> watcher::Error {
        self.watcher = None;
        self.listed = 0;
        let now = Instant::now();
        if self
            .refused_at
            .is_some_and(|at| now.duration_since(at) > QUIET)
        {
            self.refusals = 0;
        }
        self.refused_at = Some(now);
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
    F: FnMut() -> BoxStream<'static, watcher::Result<Event<EnginePod>>> + Unpin,
{
    type Item = watcher::Result<Event<EnginePod>>;

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
            Some(Ok(Event::InitApply(pod) | Event::Apply(pod) | Event::Delete(pod))) => Some(pod),
            _ => None,
        };
        if let Some(pod) = pod {
            let listing = matches!(item, Some(Ok(Event::InitApply(_))));
            if pod.metadata.name.is_none() {
                return Poll::Ready(Some(Err(this.refuse(Refused::Nameless, listing))));
            }
            if pod.metadata.namespace.is_none() {
                return Poll::Ready(Some(Err(this.refuse(Refused::Namespaceless, listing))));
            }
            let more = match item {
                Some(Ok(Event::InitApply(_))) => {
                    this.listed += 1;
                    this.listed > this.max_pods
                }
                // A pod the store does not hold yet, to a store already full. `get`
                // falls back to the name without a namespace: the pod found must be
                // this one, in its namespace.
                Some(Ok(Event::Apply(_))) => {
                    this.store.len() >= this.max_pods
                        && this
                            .store
                            .get(&ObjectRef::from_obj(pod))
                            .is_none_or(|held| held.metadata.namespace != pod.metadata.namespace)
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
pub(super) mod apiserver;

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

    type Events = BoxStream<'static, watcher::Result<Event<EnginePod>>>;

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
    async fn watch(server: &FakeApiServer) -> (Store<EnginePod>, Events) {
        let kubeconfig = kube::config::Kubeconfig::from_yaml(&server.kubeconfig(NS)).unwrap();
        let options = kube::config::KubeConfigOptions::default();
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options)
            .await
            .unwrap();
        let api: Api<EnginePod> = Api::namespaced(kube::Client::try_from(config).unwrap(), NS);
        let (store, writer) = reflector::store();
        let wc = watcher::Config::default().labels("app=vllm").page_size(10);
        let events = pod_events(api, wc, MAX, store.clone(), writer).boxed();
        (store, events)
    }

    /// The next event of `events`, checking that neither the store nor the list in
    /// progress (`listed`: its pods so far) holds more than [`MAX`] pods.
    async fn next(
        events: &mut Events,
        store: &Store<EnginePod>,
        listed: &mut usize,
    ) -> watcher::Result<Event<EnginePod>> {
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
    async fn until_refused(events: &mut Events, store: &Store<EnginePod>) -> watcher::Error {
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
    async fn until_listed(events: &mut Events, store: &Store<EnginePod>) {
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

    /// A pod named `name` in `namespace` (`None`: without `metadata.namespace`).
    fn pod_in(name: &str, namespace: Option<&str>) -> EnginePod {
        let mut pod = EnginePod::default();
        pod.metadata.name = Some(name.to_owned());
        pod.metadata.namespace = namespace.map(str::to_owned);
        pod
    }

    /// One watcher's events, each sent after its delay.
    type Script = Vec<(Duration, Event<EnginePod>)>;

    /// `events`, each sent at once.
    fn at_once(events: Vec<Event<EnginePod>>) -> Script {
        events.into_iter().map(|e| (Duration::ZERO, e)).collect()
    }

    /// [`Held`] within [`MAX`] pods over one watcher per script, in turn (then watchers
    /// that send nothing), reflected into `writer`'s store, as [`pod_events`] does
    /// (without kube-rs's backoff, so that [`Held`]'s own waits are seen whole).
    fn scripted(
        scripts: Vec<Script>,
        store: &Store<EnginePod>,
        writer: Writer<EnginePod>,
    ) -> Events {
        let mut scripts = scripts.into_iter();
        let watch = move || -> Events {
            match scripts.next() {
                Some(script) => futures::stream::iter(script)
                    .then(|(delay, event)| async move {
                        tokio::time::sleep(delay).await;
                        Ok(event)
                    })
                    .boxed(),
                None => futures::stream::pending().boxed(),
            }
        };
        Held::new(watch, MAX, store.clone()).reflect(writer).boxed()
    }

    /// Every event of `events` with the (paused) time it came at, until none comes for
    /// an hour, checking after each that the store holds at most [`MAX`] pods.
    async fn drain(
        events: &mut Events,
        store: &Store<EnginePod>,
    ) -> Vec<(tokio::time::Instant, watcher::Result<Event<EnginePod>>)> {
        let mut seen = Vec::new();
        while let Ok(Some(event)) =
            tokio::time::timeout(Duration::from_secs(3600), events.next()).await
        {
            assert!(store.len() <= MAX, "the store holds {} pods", store.len());
            seen.push((tokio::time::Instant::now(), event));
        }
        seen
    }

    /// The refusals among `events`, in order.
    fn refusals(
        events: &[(tokio::time::Instant, watcher::Result<Event<EnginePod>>)],
    ) -> Vec<String> {
        events
            .iter()
            .filter_map(|(_, e)| e.as_ref().err())
            .map(|e| match refused(e) {
                Some(why) => format!("{why:?}"),
                None => format!("not a refusal: {e}"),
            })
            .collect()
    }

    /// A pod without a namespace is refused as a nameless one is: held, kube-rs's store
    /// would find it for a pod of its name in any namespace (`Store::get` looks a key up
    /// again without its namespace), so that a watch adding that name in namespace after
    /// namespace would pass the ceiling without end.
    #[tokio::test(start_paused = true)]
    async fn a_pod_without_a_namespace_is_refused() {
        let mut list = vec![Event::Init, Event::InitApply(pod_in("a", None))];
        list.extend((1..MAX).map(|i| Event::InitApply(pod_in(&format!("p{i}"), Some(NS)))));
        list.push(Event::InitDone);
        list.extend((0..3 * MAX).map(|i| Event::Apply(pod_in("a", Some(&format!("ns{i}"))))));
        let (store, writer) = reflector::store();
        let mut events = scripted(vec![at_once(list)], &store, writer);
        let seen = drain(&mut events, &store).await;
        assert_eq!(refusals(&seen), ["Namespaceless"]);
        assert!(store.is_empty(), "the list was not taken");
    }

    /// A watch event's pod counts as held only if the store holds it in its own
    /// namespace: a pod held without one (however it got there) is not a pod of its name
    /// in every namespace.
    #[tokio::test(start_paused = true)]
    async fn a_pod_is_held_only_in_its_own_namespace() {
        let (store, mut writer) = reflector::store();
        writer.apply_watcher_event(&Event::Apply(pod_in("a", None)));
        for i in 1..MAX {
            writer.apply_watcher_event(&Event::Apply(pod_in(&format!("p{i}"), Some(NS))));
        }
        // A pod held, changed at the ceiling: taken; then "a" in other namespaces.
        let mut script = vec![Event::Apply(pod_in("p1", Some(NS)))];
        script.extend((0..3 * MAX).map(|i| Event::Apply(pod_in("a", Some(&format!("ns{i}"))))));
        let mut events = scripted(vec![at_once(script)], &store, writer);
        let seen = drain(&mut events, &store).await;
        assert!(matches!(seen[0].1, Ok(Event::Apply(_))), "{:?}", seen[0].1);
        assert_eq!(refusals(&seen), [format!("TooManyPods({MAX})")]);
        assert_eq!(store.len(), MAX);
    }

    /// The wait before a refused selector lists again doubles across refusals even
    /// with good lists between them (a rolling update at the ceiling: each relist is
    /// taken, then the surge's next pod refused), and starts over after two minutes
    /// without a refusal.
    #[tokio::test(start_paused = true)]
    async fn the_retry_grows_across_good_lists_and_starts_over_after_a_quiet_time() {
        // A list of MAX pods, taken; after `quiet`, one pod more through the watch.
        let at_ceiling = |quiet: Duration| -> Script {
            let mut list = vec![Event::Init];
            list.extend((0..MAX).map(|i| Event::InitApply(pod_in(&format!("p{i}"), Some(NS)))));
            list.push(Event::InitDone);
            let mut script = at_once(list);
            script.push((quiet, Event::Apply(pod_in("surge", Some(NS)))));
            script
        };
        let (second, quiet) = (Duration::from_secs(1), Duration::from_secs(121));
        let scripts = [second, second, second, quiet, second, second];
        let (store, writer) = reflector::store();
        let mut events = scripted(scripts.map(at_ceiling).to_vec(), &store, writer);
        let seen = drain(&mut events, &store).await;
        assert_eq!(refusals(&seen).len(), 6);
        // From each refusal to the next list's start, in tens of milliseconds.
        let mut waits = Vec::new();
        let mut refused_at = None;
        for (at, event) in &seen {
            match event {
                Err(_) => refused_at = Some(*at),
                Ok(Event::Init) => {
                    if let Some(r) = refused_at.take() {
                        waits.push((at.duration_since(r).as_millis() + 5) / 10 * 10);
                    }
                }
                _ => {}
            }
        }
        assert_eq!(waits, [800, 1600, 3200, 800, 1600]);
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
