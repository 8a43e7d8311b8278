//! A running discovery source: the [`SpecSource`] handle, the [`SpecPublisher`] its task
//! publishes through, and its counters ([`SourceStats`]).
//!
//! Every source (Kubernetes, DNS, the endpoints file, or one an embedder writes) runs as
//! a background task that publishes its whole current list of [`EndpointSpec`]s through
//! a [`tokio::sync::watch`] channel whenever it changes, and never a partial one: a
//! failed watch, lookup or reload publishes nothing, so the last good list stays in
//! force (the bounded exceptions: DNS waits for every name's first answer at most
//! `dns::DnsConfig::first_list_wait`, then publishes the names that answered, and keeps
//! a failing name's engines at most `dns::DnsConfig::max_stale`). The
//! task lives as long as the handle: dropping the [`SpecSource`] (or the
//! [`MergedSource`](crate::MergedSource) that owns it) stops it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::spec::EndpointSpec;

/// The specs one source publishes: `None` until its first complete discovery, then
/// the whole current list, sorted by role and URL.
pub type Specs = Option<Arc<[EndpointSpec]>>;

/// A running discovery source, to be handed to a
/// [`MergedSource`](crate::MergedSource) (or read directly through
/// [`watch`](Self::watch)).
///
/// # Examples
///
/// A source of one's own:
///
/// ```
/// use disagg_core::Role;
/// use disagg_discovery::{EndpointSpec, SpecSource};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let (publisher, source) = SpecSource::channel("admin");
/// publisher.publish(vec![EndpointSpec::new("http://10.0.0.7:8200", Role::Decode)]);
/// let specs = source.watch().borrow().clone().unwrap();
/// assert_eq!(specs[0].url, "http://10.0.0.7:8200");
/// assert_eq!(source.stats().updates(), 1);
/// # }
/// ```
#[derive(Debug)]
pub struct SpecSource {
    name: Arc<str>,
    rx: watch::Receiver<Specs>,
    stats: Arc<SourceStats>,
    task: Option<AbortOnDrop>,
}

impl SpecSource {
    /// A source named `name` (the `source` label of its metrics) fed by the returned
    /// publisher; it runs no task of its own.
    pub fn channel(name: impl Into<Arc<str>>) -> (SpecPublisher, SpecSource) {
        let (tx, rx) = watch::channel(None);
        let stats = Arc::new(SourceStats::default());
        let publisher = SpecPublisher {
            tx,
            stats: Arc::clone(&stats),
        };
        let source = SpecSource {
            name: name.into(),
            rx,
            stats,
            task: None,
        };
        (publisher, source)
    }

    /// A source that always publishes `specs` (endpoints given on a command line, say).
    pub fn fixed(name: impl Into<Arc<str>>, specs: impl IntoIterator<Item = EndpointSpec>) -> Self {
        let (publisher, source) = Self::channel(name);
        publisher.publish(specs.into_iter().collect());
        source
    }

    /// This source with `task` tied to it: the task is aborted when the source drops.
    pub fn with_task(mut self, task: JoinHandle<()>) -> Self {
        self.task = Some(AbortOnDrop(task));
        self
    }

    /// The source's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A receiver of the source's spec lists.
    pub fn watch(&self) -> watch::Receiver<Specs> {
        self.rx.clone()
    }

    /// The source's counters.
    pub fn stats(&self) -> &Arc<SourceStats> {
        &self.stats
    }

    /// Waits until the source has published its first complete list.
    pub async fn synced(&self) {
        let mut rx = self.rx.clone();
        // An error means the task ended without ever publishing: nothing to wait for.
        let _ = rx.wait_for(Option::is_some).await;
    }
}

/// Aborts a task when dropped, so that a source's task ends with its handle.
#[derive(Debug)]
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The sending half of a [`SpecSource`]: its task publishes complete lists and counts
/// its failures here.
#[derive(Debug)]
pub struct SpecPublisher {
    tx: watch::Sender<Specs>,
    stats: Arc<SourceStats>,
}

impl SpecPublisher {
    /// Publishes `specs` as the source's whole current list, sorted by role and URL so
    /// that the same endpoints found in another order are no change; a list equal to
    /// the current one is not published again. Returns whether it was published.
    pub fn publish(&self, mut specs: Vec<EndpointSpec>) -> bool {
        specs.sort_by(|a, b| (role_order(a.role), &a.url).cmp(&(role_order(b.role), &b.url)));
        let published = self.tx.send_if_modified(|current| {
            if current.as_deref() == Some(specs.as_slice()) {
                return false;
            }
            *current = Some(Arc::from(std::mem::take(&mut specs)));
            true
        });
        if published {
            self.stats.updates.fetch_add(1, Ordering::Relaxed);
        }
        published
    }

    /// Counts one failed discovery attempt (a watch error, a failed lookup, an invalid
    /// file); the last published list stays.
    pub fn record_error(&self) {
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts `n` discovered engines left out because their description is unusable
    /// (a pod without the configured port, a malformed annotation).
    pub fn record_rejected(&self, n: u64) {
        self.stats.rejected.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts one list refused for going past a ceiling ([`Bounds`](crate::Bounds)): too
    /// many endpoints, or an engine with too many ranks; counted as an error too, the
    /// last good list staying.
    pub fn record_over_limit(&self) {
        self.stats.over_limit.fetch_add(1, Ordering::Relaxed);
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one list of engines dropped for having gone without a good answer for
    /// longer than the source keeps it (a DNS name whose lookups have failed since
    /// `dns::DnsConfig::max_stale` after its last good answer): [`SourceStats::expired`].
    pub fn record_expired(&self) {
        self.stats.expired.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one poll done, its outcome taken (a list published, a failure counted,
    /// or nothing changed): for a source that looks for changes at an interval, as the
    /// endpoints file's does ([`SourceStats::polls`]).
    pub fn record_poll(&self) {
        self.stats.polls.fetch_add(1, Ordering::Release);
    }

    /// The source's counters.
    pub fn stats(&self) -> &Arc<SourceStats> {
        &self.stats
    }

    /// Whether nobody reads this source any more (its handle dropped): the task can end.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Whether a first list has been published.
    #[cfg(feature = "dns")]
    pub(crate) fn has_published(&self) -> bool {
        self.tx.borrow().is_some()
    }
}

/// The order of roles in a published list: prefill first.
pub(crate) fn role_order(role: disagg_core::Role) -> u8 {
    match role {
        disagg_core::Role::Prefill => 0,
        disagg_core::Role::Decode => 1,
        _ => 2,
    }
}

/// One source's counters, for `/metrics`
/// ([`MergedSource::register_metrics`](crate::MergedSource::register_metrics)).
///
/// The source counts its publications, failures and rejected engines; the
/// [`MergedSource`](crate::MergedSource) counts the endpoints it takes from the source
/// and the changes each publication made to the set.
#[derive(Debug, Default)]
pub struct SourceStats {
    pub(crate) updates: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) rejected: AtomicU64,
    pub(crate) over_limit: AtomicU64,
    pub(crate) polls: AtomicU64,
    pub(crate) expired: AtomicU64,
    pub(crate) prefill: AtomicU64,
    pub(crate) decode: AtomicU64,
    pub(crate) encode: AtomicU64,
    pub(crate) added: AtomicU64,
    pub(crate) removed: AtomicU64,
    pub(crate) replaced: AtomicU64,
    pub(crate) duplicates: AtomicU64,
}

impl SourceStats {
    /// Lists published (each one differing from the one before).
    pub fn updates(&self) -> u64 {
        self.updates.load(Ordering::Relaxed)
    }

    /// Failed discovery attempts (watch errors, failed lookups, invalid files).
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    /// Engines left out because their description is unusable, by the source or by the
    /// merge (a URL or LMCache receiver that makes no endpoint).
    pub fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }

    /// Lists (or file edits) refused for going past a ceiling
    /// ([`Bounds`](crate::Bounds)); each is an error too.
    pub fn over_limit(&self) -> u64 {
        self.over_limit.load(Ordering::Relaxed)
    }

    /// Polls done since the source started, each counted once its outcome is taken (a
    /// list published, a failure logged and counted, or nothing changed): the endpoints
    /// file's reads at each `file::FileConfig::poll_interval` after the first; 0 for a source that does not poll (Kubernetes watches, DNS
    /// lookups as TTLs run out). Not exported as a metric: it tells that the polling
    /// goes on, and how many polls a claim such as "an invalid edit is counted once"
    /// has been held over.
    pub fn polls(&self) -> u64 {
        self.polls.load(Ordering::Acquire)
    }

    /// Last good lists of engines dropped for having gone without a good answer for
    /// longer than the source keeps them: a DNS name's engines, once its lookups have
    /// failed for `dns::DnsConfig::max_stale` (1 h by default) since its last good
    /// answer. Each drop is counted once, not each failed lookup after it.
    pub fn expired(&self) -> u64 {
        self.expired.load(Ordering::Relaxed)
    }

    /// Prefill endpoints this source contributes to the merged set now.
    pub fn prefill_endpoints(&self) -> u64 {
        self.prefill.load(Ordering::Relaxed)
    }

    /// Decode endpoints this source contributes to the merged set now.
    pub fn decode_endpoints(&self) -> u64 {
        self.decode.load(Ordering::Relaxed)
    }

    /// Encoder endpoints (E/P/D) this source contributes to the merged set now.
    pub fn encode_endpoints(&self) -> u64 {
        self.encode.load(Ordering::Relaxed)
    }

    /// Endpoints this source added to the merged set.
    pub fn added(&self) -> u64 {
        self.added.load(Ordering::Relaxed)
    }

    /// Endpoints of this source removed from the merged set.
    pub fn removed(&self) -> u64 {
        self.removed.load(Ordering::Relaxed)
    }

    /// Endpoints of this source replaced by a new one because their spec changed (a new
    /// bootstrap port, models or profile).
    pub fn replaced(&self) -> u64 {
        self.replaced.load(Ordering::Relaxed)
    }

    /// Endpoints this source also found but another source, earlier in the merge order,
    /// already contributed (the earlier one wins), counted per publication.
    pub fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::Relaxed)
    }
}
