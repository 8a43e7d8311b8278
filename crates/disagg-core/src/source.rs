//! Where endpoints come from: the [`EndpointSource`] trait and [`StaticSource`].
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
}

impl<T: EndpointSource + ?Sized> EndpointSource for Arc<T> {
    fn watch(&self) -> watch::Receiver<Arc<EndpointSet>> {
        (**self).watch()
    }

    fn snapshot(&self) -> Arc<EndpointSet> {
        (**self).snapshot()
    }
}

/// A fixed set of endpoints, as given on a command line.
///
/// # Examples
///
/// ```
/// use disagg_core::endpoint::{Endpoint, Role};
/// use disagg_core::source::{EndpointSource, StaticSource};
///
/// let source = StaticSource::new([
///     Endpoint::new("http://127.0.0.1:8100", Role::Prefill)?,
///     Endpoint::new("http://127.0.0.1:8200", Role::Decode)?,
/// ]);
/// assert_eq!(source.snapshot().prefill().len(), 1);
/// # Ok::<(), disagg_core::endpoint::EndpointError>(())
/// ```
#[derive(Debug)]
pub struct StaticSource {
    tx: watch::Sender<Arc<EndpointSet>>,
}

impl StaticSource {
    /// A source that always publishes `endpoints`.
    pub fn new(endpoints: impl IntoIterator<Item = Endpoint>) -> Self {
        let set = EndpointSet::new(endpoints.into_iter().map(Arc::new));
        let (tx, _rx) = watch::channel(Arc::new(set));
        StaticSource { tx }
    }
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
