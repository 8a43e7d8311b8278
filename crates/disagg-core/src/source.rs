//! Where endpoints come from: the [`EndpointSource`] trait and [`StaticSource`] (a set
//! given by the embedding program, fixed unless the program changes it).
//!
//! A source publishes immutable [`EndpointSet`] snapshots through a
//! [`tokio::sync::watch`] channel. Discovery and health checking run in the background
//! and publish a new snapshot; the request path only ever clones an `Arc`.

use std::sync::Arc;

use tokio::sync::watch;

use crate::endpoint::{Endpoint, EndpointSet};

/// The endpoints requests may go to, published as immutable snapshots.
///
/// Implementations do their I/O (discovery, health checks) in the background and send
/// new snapshots on the channel. [`snapshot`](Self::snapshot) is called once per request:
/// it must be cheap and must not block.
pub trait EndpointSource: Send + Sync + 'static {
    /// A receiver that sees every new snapshot.
    fn watch(&self) -> watch::Receiver<Arc<EndpointSet>>;

    /// The current snapshot.
    fn snapshot(&self) -> Arc<EndpointSet> {
        self.watch().borrow().clone()
    }

    /// The current snapshot before any filtering by health: every endpoint the source
    /// knows, those it leaves out of [`snapshot`](Self::snapshot) because they failed
    /// (ejected by passive health, down by active checks) included. For what must
    /// reach every engine of the fleet whatever its health (`disagg-http`'s fanned-out
    /// admin requests: a LoRA adapter loaded while an engine was ejected must be on it
    /// when it returns), never for routing. A source that filters by health returns the
    /// set it filters; one that decorates another without filtering by health need not
    /// implement it. The default: [`snapshot`](Self::snapshot).
    fn unfiltered_snapshot(&self) -> Arc<EndpointSet> {
        self.snapshot()
    }

    /// What of this source must hear how each attempt ended, if anything: a source
    /// that keeps per-endpoint state from the requests' outcomes (passive health) says
    /// so here, and an orchestrator built over it adds it to its listeners, so the two
    /// cannot be wired apart. A source that decorates another passes the inner one's
    /// on. The default: nothing.
    fn listener(&self) -> Option<Arc<dyn crate::outcome::Listener>> {
        None
    }
}

impl<T: EndpointSource + ?Sized> EndpointSource for Arc<T> {
    fn watch(&self) -> watch::Receiver<Arc<EndpointSet>> {
        (**self).watch()
    }

    fn snapshot(&self) -> Arc<EndpointSet> {
        (**self).snapshot()
    }

    fn unfiltered_snapshot(&self) -> Arc<EndpointSet> {
        (**self).unfiltered_snapshot()
    }

    fn listener(&self) -> Option<Arc<dyn crate::outcome::Listener>> {
        (**self).listener()
    }
}

/// A set of endpoints given by the embedding program: fixed, as given on a command
/// line, unless the program changes it at run time ([`replace`](Self::replace),
/// [`insert`](Self::insert), [`remove`](Self::remove): an admin API, its own service
/// discovery, an operator draining an engine).
///
/// Every change publishes a new snapshot. Endpoints that stay keep their `Arc`, so their
/// in-flight counts carry over; requests already routed to a removed endpoint finish
/// there.
///
/// # Examples
///
/// ```
/// use disagg_core::endpoint::{Endpoint, Role};
/// use disagg_core::source::{EndpointSource, StaticSource};
///
/// let source = StaticSource::new([
///     Endpoint::new("http://127.0.0.1:8100", Role::Prefill)?,
///     Endpoint::new("http://10.0.0.1:8200", Role::Decode)?,
///     Endpoint::new("http://10.0.0.2:8200", Role::Decode)?,
/// ]);
/// assert_eq!(source.snapshot().by_role(Role::Prefill).len(), 1);
/// assert!(source.remove("http://10.0.0.1:8200"));
/// assert_eq!(source.snapshot().by_role(Role::Decode).len(), 1);
/// source.insert(Endpoint::new("http://10.0.0.3:8200", Role::Decode)?);
/// assert_eq!(source.snapshot().by_role(Role::Decode).len(), 2);
/// # Ok::<(), disagg_core::endpoint::EndpointError>(())
/// ```
#[derive(Debug)]
pub struct StaticSource {
    tx: watch::Sender<Arc<EndpointSet>>,
}

impl StaticSource {
    /// A source publishing `endpoints` until told otherwise.
    pub fn new(endpoints: impl IntoIterator<Item = Endpoint>) -> Self {
        let set = EndpointSet::new(endpoints.into_iter().map(Arc::new));
        let (tx, _rx) = watch::channel(Arc::new(set));
        StaticSource { tx }
    }

    /// Publish `endpoints` in place of the current set.
    pub fn replace(&self, endpoints: impl IntoIterator<Item = Arc<Endpoint>>) {
        self.tx.send_replace(Arc::new(EndpointSet::new(endpoints)));
    }

    /// Add `endpoint` to the set.
    pub fn insert(&self, endpoint: Endpoint) {
        let endpoint = Arc::new(endpoint);
        self.tx.send_modify(|set| {
            let all = all(set).chain(std::iter::once(endpoint));
            *set = Arc::new(EndpointSet::new(all));
        });
    }

    /// Remove the endpoint whose id is `id` (its URL, with `@RANK` for a rank); whether
    /// there was one.
    pub fn remove(&self, id: &str) -> bool {
        self.tx.send_if_modified(|set| {
            let before = set.len();
            let kept: Vec<_> = all(set).filter(|e| e.id().as_str() != id).collect();
            if kept.len() == before {
                return false;
            }
            *set = Arc::new(EndpointSet::new(kept));
            true
        })
    }
}

/// Every endpoint of `set`, prefill first.
fn all(set: &EndpointSet) -> impl Iterator<Item = Arc<Endpoint>> + '_ {
    set.iter().cloned()
}

impl EndpointSource for StaticSource {
    fn watch(&self) -> watch::Receiver<Arc<EndpointSet>> {
        self.tx.subscribe()
    }

    fn snapshot(&self) -> Arc<EndpointSet> {
        // No receiver needed: read the sender's current value directly.
        self.tx.borrow().clone()
    }
}
