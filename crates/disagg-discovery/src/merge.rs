//! [`MergedSource`]: several discovery sources (and endpoints given on the command line)
//! merged into the one [`EndpointSet`] the orchestrator reads, through the core's
//! [`EndpointSource`] seam.
//!
//! Hot changes drop nothing:
//!
//! - an endpoint whose spec did not change keeps its `Arc<Endpoint>` from one set to the
//!   next, so its in-flight counts, and the health and cache-affinity state kept for it,
//!   carry over; a router sees the same endpoint before and after;
//! - an endpoint that leaves is only left out of the next set: requests already routed
//!   to it hold their own `Arc` (through their in-flight guards) and finish there,
//!   streams included;
//! - an endpoint whose spec changed (a new bootstrap port, models or KV profile) is
//!   replaced by a new one with the same id; requests in flight on the old one finish
//!   there;
//! - a spec that makes no endpoint (a bad URL, a link-local or metadata address, more
//!   data-parallel ranks than [`Bounds::max_ranks`], an LMCache receiver contradicting
//!   the declared TP size) is left out, logged once and counted as rejected; the rest of
//!   the set is published;
//! - a source's list that would make more endpoints than [`Bounds::max_endpoints`]
//!   (ranks counted, before any is made) is refused whole: that source's last good list
//!   stays in the set, logged once per list and counted
//!   ([`SourceStats::over_limit`], an error too); a source with no good list yet has
//!   none in the set, and [`MergedSource::synced`] waits for it.
//!
//! When two sources name the same endpoint (role and id), the earlier one in the merge
//! order wins: the command line's endpoints first, then the sources in the order they
//! were added. Ids are compared as the engines they name, however their URLs are
//! spelled: the scheme and host in lowercase, an IPv6 address in its canonical text,
//! the port and the rank as numbers (`http://D:08200/@03` is `http://d:8200@3`); so are
//! a spec's endpoints looked up in the current set, so that a URL the core writes
//! otherwise in the endpoint's id keeps its endpoint from one merge to the next.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use disagg_core::error::BoxError;
use disagg_core::{Endpoint, EndpointSource, Role, endpoint::EndpointSet};
use futures::StreamExt;
use tokio::sync::watch;

use crate::source::{SourceStats, SpecSource, Specs};
use crate::spec::{Bounds, EndpointSpec, endpoint_count, identity_or_id};

/// Adds connector data of the embedder's own to the extensions a spec's endpoints get
/// (after the spec's own [`EndpointSpec::extensions`]). An `Err` leaves the spec out,
/// logged and counted as rejected.
pub type ExtendFn =
    dyn Fn(&EndpointSpec, &mut http::Extensions) -> Result<(), BoxError> + Send + Sync;

/// The name of the pseudo-source of the endpoints given to
/// [`MergedSourceBuilder::endpoints`].
pub const STATIC_SOURCE: &str = "static";

/// Several discovery sources and fixed endpoints merged into one [`EndpointSet`],
/// published through the core's [`EndpointSource`] seam.
///
/// A background task (ended when this drops, with the sources' own tasks) merges every
/// new list a source publishes. See the [module docs](self) for what a change keeps.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use disagg_core::{Endpoint, EndpointSource, Role};
/// use disagg_discovery::{EndpointSpec, MergedSource, SpecSource};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let (publisher, discovered) = SpecSource::channel("admin");
/// let merged = MergedSource::builder()
///     .endpoints([Endpoint::new("http://10.0.0.5:8100", Role::Prefill)?])
///     .source(discovered)
///     .build();
///
/// publisher.publish(vec![EndpointSpec::new("http://10.0.0.7:8200", Role::Decode)]);
/// merged.synced().await;
/// let first = merged.snapshot();
/// let counts = (first.by_role(Role::Prefill).len(), first.by_role(Role::Decode).len());
/// assert_eq!(counts, (1, 1));
///
/// // Another decode joins: the one that stays is the same endpoint.
/// let mut rx = merged.watch();
/// publisher.publish(vec![
///     EndpointSpec::new("http://10.0.0.7:8200", Role::Decode),
///     EndpointSpec::new("http://10.0.0.8:8200", Role::Decode),
/// ]);
/// rx.changed().await?;
/// let second = merged.snapshot();
/// let (before, after) = (first.by_role(Role::Decode), second.by_role(Role::Decode));
/// assert!(Arc::ptr_eq(&before[0], &after[0]));
/// assert_eq!(second.by_role(Role::Decode).len(), 2);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct MergedSource {
    tx: watch::Sender<Arc<EndpointSet>>,
    synced: watch::Receiver<bool>,
    stats: Vec<(Arc<str>, Arc<SourceStats>)>,
    // Dropped after the merge task: the sources' tasks end with their handles.
    _task: AbortOnDrop,
    _sources: Vec<SpecSource>,
}

/// Builds a [`MergedSource`].
#[derive(Default)]
pub struct MergedSourceBuilder {
    endpoints: Vec<Endpoint>,
    sources: Vec<SpecSource>,
    extend: Option<Arc<ExtendFn>>,
    bounds: Bounds,
}

impl std::fmt::Debug for MergedSourceBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MergedSourceBuilder")
            .field("endpoints", &self.endpoints)
            .field("sources", &self.sources)
            .field("extend", &self.extend.is_some())
            .field("bounds", &self.bounds)
            .finish()
    }
}

impl MergedSourceBuilder {
    /// Endpoints that are always in the set (`--prefill`, `--decode`), first in the
    /// merge order, under the source name [`STATIC_SOURCE`].
    pub fn endpoints(mut self, endpoints: impl IntoIterator<Item = Endpoint>) -> Self {
        self.endpoints.extend(endpoints);
        self
    }

    /// A discovery source, after those added before it in the merge order.
    pub fn source(mut self, source: SpecSource) -> Self {
        self.sources.push(source);
        self
    }

    /// The ceilings and the address rule discovered engines are held to (default:
    /// [`Bounds::default`]). The fixed [`endpoints`](Self::endpoints) are taken as
    /// given.
    pub fn bounds(mut self, bounds: Bounds) -> Self {
        self.bounds = bounds;
        self
    }

    /// Connector data of the embedder's own for each discovered spec's endpoints.
    pub fn extend_with(
        mut self,
        f: impl Fn(&EndpointSpec, &mut http::Extensions) -> Result<(), BoxError> + Send + Sync + 'static,
    ) -> Self {
        self.extend = Some(Arc::new(f));
        self
    }

    /// Merges what the sources published so far and starts the task that merges what
    /// they publish next.
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime (the merge task is spawned on it).
    pub fn build(self) -> MergedSource {
        let mut stats = Vec::new();
        let static_stats = (!self.endpoints.is_empty()).then(|| {
            let s = Arc::new(SourceStats::default());
            stats.push((Arc::<str>::from(STATIC_SOURCE), Arc::clone(&s)));
            s
        });
        for source in &self.sources {
            stats.push((Arc::from(source.name()), Arc::clone(source.stats())));
        }
        let mut merger = Merger {
            fixed: self.endpoints.into_iter().map(Arc::new).collect(),
            static_stats,
            source_stats: self.sources.iter().map(|s| Arc::clone(s.stats())).collect(),
            names: self.sources.iter().map(|s| Arc::from(s.name())).collect(),
            extend: self.extend,
            bounds: self.bounds,
            accepted: vec![None; self.sources.len()],
            refused: vec![None; self.sources.len()],
            current: HashMap::new(),
            order: Vec::new(),
            rejected: HashSet::new(),
            initialized: false,
        };
        let receivers: Vec<_> = self.sources.iter().map(SpecSource::watch).collect();
        let lists = current_lists(&receivers);
        let initial = merger.merge(&lists).unwrap_or_default();
        let (tx, _) = watch::channel(Arc::new(initial));
        let (synced_tx, synced) = watch::channel(merger.synced());
        let task = tokio::spawn(run(merger, receivers, tx.clone(), synced_tx));
        MergedSource {
            tx,
            synced,
            stats,
            _task: AbortOnDrop(task),
            _sources: self.sources,
        }
    }
}

impl MergedSource {
    /// A builder.
    pub fn builder() -> MergedSourceBuilder {
        MergedSourceBuilder::default()
    }

    /// Waits until every source has published its first complete list and the set
    /// holds it (a proxy may wait for this, bounded, before it serves). A list refused
    /// whole for the endpoint ceiling is not held: a source whose lists so far were all
    /// refused keeps this waiting, as one that has published nothing does.
    pub async fn synced(&self) {
        let mut rx = self.synced.clone();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// Each source's name and counters, in merge order ([`STATIC_SOURCE`] first when
    /// there are fixed endpoints).
    pub fn sources(&self) -> impl Iterator<Item = (&str, &SourceStats)> {
        self.stats.iter().map(|(n, s)| (&**n, &**s))
    }

    /// Registers the sources' counters into a Prometheus `registry` (read at each scrape;
    /// `disagg-http`'s `ExtraMetrics` takes this as it is):
    ///
    /// - `disagg_discovery_endpoints{source,role}` (gauge): endpoints each source
    ///   contributes to the set now;
    /// - `disagg_discovery_endpoint_changes_total{source,change}` (counter): endpoints
    ///   `added` to the set, `removed` from it, or `replaced` because their spec
    ///   changed;
    /// - `disagg_discovery_updates_total{source}` (counter): lists published;
    /// - `disagg_discovery_errors_total{source}` (counter): failed watches, lookups and
    ///   reloads (the last good list stayed);
    /// - `disagg_discovery_rejected_total{source}` (counter): engines left out because
    ///   their description makes no endpoint;
    /// - `disagg_discovery_over_limit_total{source}` (counter): lists and file edits
    ///   refused for going past a ceiling (too many endpoints or ranks); the last good
    ///   list stayed;
    /// - `disagg_discovery_expired_total{source}` (counter): last good lists dropped
    ///   for having gone without a good answer too long (a DNS name whose lookups have
    ///   failed past `dns::DnsConfig::max_stale`);
    /// - `disagg_discovery_duplicate_endpoints{source}` (gauge): endpoints a source finds
    ///   that an earlier source already contributes.
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_core::{Endpoint, Role};
    /// use disagg_discovery::MergedSource;
    /// use prometheus_client::registry::Registry;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let merged = MergedSource::builder()
    ///     .endpoints([Endpoint::new("http://10.0.0.5:8100", Role::Prefill)?])
    ///     .build();
    /// let mut registry = Registry::default();
    /// merged.register_metrics(&mut registry);
    /// let mut out = String::new();
    /// prometheus_client::encoding::text::encode(&mut out, &registry)?;
    /// assert!(out.contains("disagg_discovery_endpoints{source=\"static\",role=\"prefill\"} 1\n"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register_collector(Box::new(DiscoveryCollector(self.stats.clone())));
    }
}

/// [`MergedSource::register_metrics`]' collector: each source's counters, read at each
/// scrape.
#[derive(Debug)]
struct DiscoveryCollector(Vec<(Arc<str>, Arc<SourceStats>)>);

impl prometheus_client::collector::Collector for DiscoveryCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::MetricType;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        let gauge = |n: u64| ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX));
        let mut endpoints = encoder.encode_descriptor(
            "disagg_discovery_endpoints",
            "Endpoints each discovery source contributes to the endpoint set now, by role.",
            None,
            MetricType::Gauge,
        )?;
        for (name, s) in &self.0 {
            for (role, n) in [
                ("prefill", &s.prefill),
                ("decode", &s.decode),
                ("encode", &s.encode),
            ] {
                let labels = [("source", &**name), ("role", role)];
                gauge(n.load(Ordering::Relaxed)).encode(endpoints.encode_family(&labels)?)?;
            }
        }
        // Counters are named without `_total`: the encoders append it.
        let mut changes = encoder.encode_descriptor(
            "disagg_discovery_endpoint_changes",
            "Endpoints added to, removed from or replaced in the endpoint set, by source.",
            None,
            MetricType::Counter,
        )?;
        for (name, s) in &self.0 {
            for (change, n) in [
                ("added", &s.added),
                ("removed", &s.removed),
                ("replaced", &s.replaced),
            ] {
                let labels = [("source", &**name), ("change", change)];
                ConstCounter::new(n.load(Ordering::Relaxed))
                    .encode(changes.encode_family(&labels)?)?;
            }
        }
        let rows: [Row; 6] = [
            (
                "disagg_discovery_updates",
                "Endpoint lists published by each discovery source.",
                false,
                SourceStats::updates,
            ),
            (
                "disagg_discovery_errors",
                "Failed watches, lookups and reloads of each discovery source; the last good list stayed.",
                false,
                SourceStats::errors,
            ),
            (
                "disagg_discovery_rejected",
                "Engines a discovery source found but left out because their description makes no endpoint.",
                false,
                SourceStats::rejected,
            ),
            (
                "disagg_discovery_over_limit",
                "Lists and file edits a discovery source refused for going past a ceiling (endpoints, ranks); the last good list stayed.",
                false,
                SourceStats::over_limit,
            ),
            (
                "disagg_discovery_expired",
                "Last good lists a discovery source dropped for having gone without a good answer too long (DNS names whose lookups kept failing).",
                false,
                SourceStats::expired,
            ),
            (
                "disagg_discovery_duplicate_endpoints",
                "Endpoints a discovery source finds that an earlier source already contributes.",
                true,
                SourceStats::duplicates,
            ),
        ];
        for (metric, help, is_gauge, read) in rows {
            let kind = if is_gauge {
                MetricType::Gauge
            } else {
                MetricType::Counter
            };
            let mut family = encoder.encode_descriptor(metric, help, None, kind)?;
            for (name, s) in &self.0 {
                let labels = [("source", &**name)];
                let sample = family.encode_family(&labels)?;
                if is_gauge {
                    gauge(read(s)).encode(sample)?;
                } else {
                    ConstCounter::new(read(s)).encode(sample)?;
                }
            }
        }
        Ok(())
    }
}

impl EndpointSource for MergedSource {
    fn watch(&self) -> watch::Receiver<Arc<EndpointSet>> {
        self.tx.subscribe()
    }

    fn snapshot(&self) -> Arc<EndpointSet> {
        self.tx.borrow().clone()
    }
}

/// One per-source metric: name, help, whether a gauge, and how to read it.
type Row = (&'static str, &'static str, bool, fn(&SourceStats) -> u64);

/// Aborts the merge task when the source drops.
#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn current_lists(receivers: &[watch::Receiver<Specs>]) -> Vec<Specs> {
    receivers.iter().map(|rx| rx.borrow().clone()).collect()
}

/// The merge task: merges again whenever any source publishes, until every source has
/// ended (their senders dropped).
async fn run(
    mut merger: Merger,
    receivers: Vec<watch::Receiver<Specs>>,
    tx: watch::Sender<Arc<EndpointSet>>,
    synced: watch::Sender<bool>,
) {
    let changes = receivers.iter().cloned().map(|rx| {
        futures::stream::unfold(rx, |mut rx| async move {
            rx.changed().await.ok()?;
            Some(((), rx))
        })
        .boxed()
    });
    let mut changes = futures::stream::select_all(changes);
    // Level-triggered: every wake-up reads every source's current list, so a burst of
    // publications is merged once.
    while changes.next().await.is_some() {
        let lists = current_lists(&receivers);
        if let Some(set) = merger.merge(&lists) {
            tx.send_replace(Arc::new(set));
        }
        if merger.synced() {
            synced.send_if_modified(|s| !std::mem::replace(s, true));
        }
    }
}

/// (role, the engine and rank the endpoint's id names, [`identity_or_id`]): one
/// endpoint of the set.
type Key = (Role, Arc<str>);

/// One endpoint of the current set: the spec it was built from, and who contributed it.
struct Entry {
    /// One copy per spec, shared by the entries of all its ranks.
    spec: Arc<EndpointSpec>,
    endpoint: Arc<Endpoint>,
    source: usize,
}

/// The merge state: the current endpoints by key, to reuse them.
struct Merger {
    fixed: Vec<Arc<Endpoint>>,
    static_stats: Option<Arc<SourceStats>>,
    source_stats: Vec<Arc<SourceStats>>,
    names: Vec<Arc<str>>,
    extend: Option<Arc<ExtendFn>>,
    bounds: Bounds,
    /// Each source's last list within the ceilings (what the set holds of it).
    accepted: Vec<Specs>,
    /// Each source's last list refused for the endpoint ceiling, logged and counted.
    refused: Vec<Option<Arc<[EndpointSpec]>>>,
    current: HashMap<Key, Entry>,
    /// The current set's endpoints in order (fixed ones first), to tell a change.
    order: Vec<Arc<Endpoint>>,
    /// The specs refused last time, per source, so that each is logged and counted once.
    rejected: HashSet<(usize, Role, String)>,
    /// Whether a set was made already (the first one is always published).
    initialized: bool,
}

impl Merger {
    /// Whether every source has a list in the set: one published and within the
    /// endpoint ceiling. A source whose lists so far were all refused for the ceiling
    /// has none, as one that has published nothing.
    fn synced(&self) -> bool {
        self.accepted.iter().all(Option::is_some)
    }

    /// Merges `lists` (one per source, in order) into a new set, or `None` when the set
    /// would be the same endpoints in the same order as the current one.
    fn merge(&mut self, lists: &[Specs]) -> Option<EndpointSet> {
        let mut seen: HashSet<Key> = HashSet::new();
        let mut order: Vec<Arc<Endpoint>> = Vec::new();
        if let Some(stats) = &self.static_stats {
            let mut counts = [0u64; 3];
            for ep in &self.fixed {
                if seen.insert(key_of(ep)) {
                    counts[usize::from(crate::source::role_order(ep.role()))] += 1;
                    order.push(Arc::clone(ep));
                }
            }
            if !self.initialized {
                stats.added.store(counts.iter().sum(), Ordering::Relaxed);
            }
            stats.prefill.store(counts[0], Ordering::Relaxed);
            stats.decode.store(counts[1], Ordering::Relaxed);
            stats.encode.store(counts[2], Ordering::Relaxed);
        }
        let mut next: HashMap<Key, Entry> = HashMap::new();
        let mut rejected = HashSet::new();
        for (i, list) in lists.iter().enumerate() {
            let list = self.within_bounds(i, list);
            let stats = &self.source_stats[i];
            let (mut counts, mut duplicates) = ([0u64; 3], 0u64);
            for spec in list.iter().flat_map(|l| l.iter()) {
                let Some(endpoints) = self.endpoints_for(i, spec, &mut rejected) else {
                    continue;
                };
                // One copy of the spec for all its ranks, not one per rank.
                let shared = Arc::new(spec.clone());
                for endpoint in endpoints {
                    let key = key_of(&endpoint);
                    if !seen.insert(key.clone()) {
                        duplicates += 1;
                        continue;
                    }
                    counts[usize::from(crate::source::role_order(spec.role))] += 1;
                    order.push(Arc::clone(&endpoint));
                    next.insert(
                        key,
                        Entry {
                            spec: Arc::clone(&shared),
                            endpoint,
                            source: i,
                        },
                    );
                }
            }
            stats.prefill.store(counts[0], Ordering::Relaxed);
            stats.decode.store(counts[1], Ordering::Relaxed);
            stats.encode.store(counts[2], Ordering::Relaxed);
            stats.duplicates.store(duplicates, Ordering::Relaxed);
        }
        self.rejected = rejected;
        // The changes, each counted for the source that made it.
        for (key, entry) in &next {
            let stats = &self.source_stats[entry.source];
            match self.current.get(key) {
                None => stats.added.fetch_add(1, Ordering::Relaxed),
                Some(old) if !Arc::ptr_eq(&old.endpoint, &entry.endpoint) => {
                    stats.replaced.fetch_add(1, Ordering::Relaxed)
                }
                Some(_) => 0,
            };
        }
        for (key, old) in &self.current {
            if !next.contains_key(key) {
                self.source_stats[old.source]
                    .removed
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        self.current = next;
        let unchanged = order.len() == self.order.len()
            && order
                .iter()
                .zip(&self.order)
                .all(|(a, b)| Arc::ptr_eq(a, b));
        if unchanged && self.initialized {
            return None;
        }
        self.initialized = true;
        self.order.clone_from(&order);
        Some(EndpointSet::new(order))
    }

    /// Source `i`'s list to merge: `list` when it is within the endpoint ceiling (then
    /// kept as the source's last good one), else the last good one (the refusal logged
    /// and counted once per list).
    fn within_bounds(&mut self, i: usize, list: &Specs) -> Specs {
        let Some(specs) = list else {
            return None;
        };
        let n = endpoint_count(specs);
        let max = self.bounds.max_endpoints;
        if n <= max as u64 {
            self.accepted[i] = list.clone();
            return list.clone();
        }
        // A list is published once, then merged again on every other source's change:
        // the refusal is counted for the list, not for each merge.
        if self.refused_list(i).is_none_or(|r| !Arc::ptr_eq(r, specs)) {
            if self.accepted[i].is_some() {
                tracing::warn!(
                    source = %self.names[i],
                    endpoints = n,
                    max,
                    "discovered endpoints refused: more than the ceiling per source (--max-endpoints-per-source); keeping the last good endpoints"
                );
            } else {
                tracing::warn!(
                    source = %self.names[i],
                    endpoints = n,
                    max,
                    "discovered endpoints refused: more than the ceiling per source (--max-endpoints-per-source); the source has no endpoints in the set, and is not synced, until it lists within the ceiling"
                );
            }
            let stats = &self.source_stats[i];
            stats.over_limit.fetch_add(1, Ordering::Relaxed);
            stats.errors.fetch_add(1, Ordering::Relaxed);
            self.refused[i] = Some(Arc::clone(specs));
        }
        self.accepted[i].clone()
    }

    fn refused_list(&self, i: usize) -> Option<&Arc<[EndpointSpec]>> {
        self.refused.get(i).and_then(Option::as_ref)
    }

    /// The endpoints of `spec` from source `i`: the current ones when the spec is
    /// unchanged, new ones otherwise; `None` (logged once, counted) when it makes none.
    fn endpoints_for(
        &self,
        i: usize,
        spec: &EndpointSpec,
        rejected: &mut HashSet<(usize, Role, String)>,
    ) -> Option<Vec<Arc<Endpoint>>> {
        // Counted before anything is made per rank.
        if let Some(Err(e)) = spec.ranks.map(|r| r.within(self.bounds.max_ranks)) {
            self.reject(i, spec, &e, rejected);
            return None;
        }
        // So is the URL's length, before the URL is written out once per rank (its
        // address is checked once too, by `to_endpoints_bounded`, before an endpoint is
        // made per rank).
        if let Err(e) = spec.check_url_len() {
            self.reject(i, spec, &e, rejected);
            return None;
        }
        // The ids the core gives the spec's endpoints, looked up as the engines they
        // name, as `key_of` keys the set.
        let urls = spec.endpoint_urls();
        // The ranks of one spec share its copy: compared once, not once per rank.
        let mut same: Option<&Arc<EndpointSpec>> = None;
        let reused: Option<Vec<Arc<Endpoint>>> = urls
            .iter()
            .map(|url| {
                let key = (spec.role, Arc::from(identity_or_id(url)));
                let entry = self.current.get(&key)?;
                let equal =
                    same.is_some_and(|s| Arc::ptr_eq(s, &entry.spec)) || *entry.spec == *spec;
                if equal {
                    same = Some(&entry.spec);
                }
                equal.then(|| Arc::clone(&entry.endpoint))
            })
            .collect();
        if let Some(reused) = reused {
            return Some(reused);
        }
        match self.build(spec) {
            Ok(endpoints) => Some(endpoints.into_iter().map(Arc::new).collect()),
            Err(e) => {
                self.reject(i, spec, &*e, rejected);
                None
            }
        }
    }

    /// Leaves `spec` of source `i` out: logged and counted the first time in a row.
    fn reject(
        &self,
        i: usize,
        spec: &EndpointSpec,
        e: &dyn std::fmt::Display,
        rejected: &mut HashSet<(usize, Role, String)>,
    ) {
        let id = (i, spec.role, spec.url.clone());
        if !self.rejected.contains(&id) {
            tracing::warn!(
                source = %self.names[i],
                url = %shown(&spec.url),
                role = ?spec.role,
                error = %e,
                "discovered engine left out: its description makes no endpoint"
            );
            self.source_stats[i]
                .rejected
                .fetch_add(1, Ordering::Relaxed);
        }
        rejected.insert(id);
    }

    fn build(&self, spec: &EndpointSpec) -> Result<Vec<Endpoint>, BoxError> {
        let mut ext = spec.extensions()?;
        if let Some(extend) = &self.extend {
            extend(spec, &mut ext)?;
        }
        Ok(spec.to_endpoints_bounded(ext, &self.bounds)?)
    }
}

/// `url` as logged: whole up to [`MAX_URL_BYTES`](crate::spec::MAX_URL_BYTES), past it
/// cut there (at a character's start), its length given.
fn shown(url: &str) -> std::borrow::Cow<'_, str> {
    let max = crate::spec::MAX_URL_BYTES;
    if url.len() <= max {
        return url.into();
    }
    let mut end = max;
    while !url.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes)", &url[..end], url.len()).into()
}

fn key_of(endpoint: &Endpoint) -> Key {
    (
        endpoint.role(),
        Arc::from(identity_or_id(endpoint.id().as_str())),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(url: &str) -> EndpointSpec {
        EndpointSpec::new(url, Role::Decode)
    }

    fn merger(sources: usize) -> Merger {
        Merger {
            fixed: Vec::new(),
            static_stats: None,
            source_stats: (0..sources).map(|_| Arc::default()).collect(),
            names: (0..sources).map(|i| Arc::from(format!("s{i}"))).collect(),
            extend: None,
            bounds: Bounds::default(),
            accepted: vec![None; sources],
            refused: vec![None; sources],
            current: HashMap::new(),
            order: Vec::new(),
            rejected: HashSet::new(),
            initialized: false,
        }
    }

    fn list(specs: Vec<EndpointSpec>) -> Specs {
        Some(Arc::from(specs))
    }

    #[test]
    fn an_unchanged_publication_is_no_new_set() {
        let mut m = merger(1);
        assert!(m.merge(&[list(vec![decode("http://d1:1")])]).is_some());
        assert!(m.merge(&[list(vec![decode("http://d1:1")])]).is_none());
    }

    #[test]
    fn a_refused_spec_is_counted_once_while_it_stays() {
        let mut m = merger(1);
        let bad = vec![decode("ftp://d1:1"), decode("http://d2:1")];
        let set = m.merge(&[list(bad.clone())]).unwrap();
        assert_eq!(set.by_role(Role::Decode).len(), 1);
        m.merge(&[list(bad.clone())]);
        assert_eq!(m.source_stats[0].rejected(), 1);
        // Gone, then back: counted again.
        m.merge(&[list(vec![decode("http://d2:1")])]);
        m.merge(&[list(bad)]);
        assert_eq!(m.source_stats[0].rejected(), 2);
    }

    #[test]
    fn a_list_past_the_endpoint_ceiling_keeps_the_last_good_one() {
        let mut m = merger(2);
        m.bounds.max_endpoints = 4;
        let good = list(vec![decode("http://d1:1"), decode("http://d2:1")]);
        let other = list(vec![decode("http://o1:1")]);
        assert_eq!(
            m.merge(&[good, other.clone()])
                .unwrap()
                .by_role(Role::Decode)
                .len(),
            3
        );
        // Five endpoints, three of them ranks: refused whole, never expanded.
        let mut ranked = decode("http://d3:1");
        ranked.ranks = Some(crate::Ranks::new(0, 2).unwrap());
        let big = list(vec![decode("http://d1:1"), decode("http://d2:1"), ranked]);
        assert!(
            m.merge(&[big.clone(), other.clone()]).is_none(),
            "the set stays"
        );
        assert_eq!(m.source_stats[0].over_limit(), 1);
        assert_eq!(m.source_stats[0].errors(), 1);
        // Merged again (another source changed): the same refusal, not counted again;
        // the other source's change goes through.
        let more = list(vec![decode("http://o1:1"), decode("http://o2:1")]);
        let set = m.merge(&[big, more]).unwrap();
        assert_eq!(set.by_role(Role::Decode).len(), 4);
        assert_eq!(m.source_stats[0].over_limit(), 1);
        assert_eq!(m.source_stats[0].decode_endpoints(), 2);
        // A list within the ceiling is taken again.
        let set = m
            .merge(&[list(vec![decode("http://d9:1")]), other])
            .unwrap();
        assert_eq!(set.by_role(Role::Decode).len(), 2);
    }

    /// A source whose only list so far was refused for the endpoint ceiling has no
    /// list in the set: the merge is not synced (a proxy waits for it, bounded, and
    /// warns that a source has not listed its endpoints, as for a source that has
    /// published nothing), until the source lists within the ceiling.
    #[tokio::test]
    async fn a_first_list_refused_for_the_ceiling_leaves_the_merge_unsynced() {
        use futures::FutureExt;
        let (publisher, source) = crate::SpecSource::channel("embedder");
        publisher.publish(vec![decode("http://d1:1"), decode("http://d2:1")]);
        let merged = MergedSource::builder()
            .source(source)
            .bounds(Bounds {
                max_endpoints: 1,
                ..Bounds::default()
            })
            .build();
        assert_eq!(merged.sources().next().unwrap().1.over_limit(), 1);
        assert!(
            merged.synced().now_or_never().is_none(),
            "synced without the source's engines"
        );
        publisher.publish(vec![decode("http://d1:1")]);
        tokio::time::timeout(std::time::Duration::from_secs(5), merged.synced())
            .await
            .expect("synced once the source lists within the ceiling");
        assert_eq!(merged.snapshot().by_role(Role::Decode).len(), 1);
    }

    #[test]
    fn an_engine_with_too_many_ranks_is_left_out_without_being_expanded() {
        let mut m = merger(1);
        let mut huge = decode("http://d1:1");
        huge.ranks = Some("0-4294967295".parse().unwrap());
        let set = m.merge(&[list(vec![huge, decode("http://d2:1")])]);
        // The endpoint ceiling refuses the list first (2^32 + 1 endpoints).
        assert!(set.unwrap().by_role(Role::Decode).is_empty());
        assert_eq!(m.source_stats[0].over_limit(), 1);
        // Within the endpoint ceiling, the rank ceiling leaves the engine out alone.
        let mut m = merger(1);
        m.bounds.max_ranks = 2;
        let mut three = decode("http://d1:1");
        three.ranks = Some(crate::Ranks::new(0, 2).unwrap());
        let set = m
            .merge(&[list(vec![three, decode("http://d2:1")])])
            .unwrap();
        assert_eq!(set.by_role(Role::Decode).len(), 1);
        assert_eq!(m.source_stats[0].rejected(), 1);
    }

    #[test]
    fn a_metadata_address_is_left_out_unless_allowed() {
        let mut m = merger(1);
        let specs = list(vec![
            decode("http://169.254.169.254:80"),
            decode("http://d2:1"),
        ]);
        let set = m.merge(std::slice::from_ref(&specs)).unwrap();
        assert_eq!(set.by_role(Role::Decode).len(), 1);
        assert_eq!(set.by_role(Role::Decode)[0].id().as_str(), "http://d2:1");
        assert_eq!(m.source_stats[0].rejected(), 1);
        let mut m = merger(1);
        m.bounds.addresses = disagg_core::endpoint::AddressPolicy::allow_link_local();
        assert_eq!(m.merge(&[specs]).unwrap().by_role(Role::Decode).len(), 2);
    }

    #[test]
    fn the_ranks_of_a_spec_share_one_copy_of_it_and_its_model_names() {
        let mut m = merger(1);
        let mut spec = decode("http://d1:1");
        spec.ranks = Some(crate::Ranks::new(0, 1023).unwrap());
        spec.models = (0..256).map(|i| format!("model-{i}")).collect();
        let set = m.merge(&[list(vec![spec.clone()])]).unwrap();
        let decode = set.by_role(Role::Decode);
        assert_eq!(decode.len(), 1024);
        let entries: Vec<&Entry> = m.current.values().collect();
        assert!(
            entries
                .iter()
                .all(|e| Arc::ptr_eq(&e.spec, &entries[0].spec))
        );
        let first = decode[0].models().unwrap();
        assert!(decode.iter().all(|e| {
            let models = e.models().unwrap();
            models.len() == 256 && models.iter().zip(first).all(|(a, b)| Arc::ptr_eq(a, b))
        }));
        // The same spec published again (a new copy): the same endpoints, no new set.
        assert!(m.merge(&[list(vec![spec])]).is_none());
    }

    /// A URL the core writes otherwise in the endpoint's id (a rank with a leading zero,
    /// a `/` before the `@`) is the same endpoint at the next merge, not a new one.
    #[test]
    fn a_url_the_core_rewrites_keeps_its_endpoint_across_merges() {
        for url in [
            "http://d1:1@03",
            "http://d1:1/@3",
            "http://d1:1/",
            "HTTP://D1:01",
        ] {
            let mut m = merger(1);
            let first = m.merge(&[list(vec![decode(url)])]).unwrap();
            assert_eq!(first.by_role(Role::Decode).len(), 1, "{url}");
            assert!(
                m.merge(&[list(vec![decode(url)])]).is_none(),
                "{url}: the same spec again is no new set"
            );
            let stats = &m.source_stats[0];
            assert_eq!((stats.added(), stats.replaced()), (1, 0), "{url}");
        }
    }

    /// One engine found under two spellings of its URL (host case, IPv6 text, leading
    /// zeros in the port) is one endpoint: the earlier source's.
    #[test]
    fn one_engine_under_two_spellings_is_one_endpoint() {
        for (a, b) in [
            ("http://[FD00::1]:8200", "http://[fd00::1]:8200"),
            ("http://d:8200", "http://d:08200"),
            ("http://D:8200", "http://d:8200"),
        ] {
            let mut m = merger(2);
            let set = m
                .merge(&[list(vec![decode(a)]), list(vec![decode(b)])])
                .unwrap();
            assert_eq!(set.by_role(Role::Decode).len(), 1, "{a} {b}");
            assert_eq!(set.by_role(Role::Decode)[0].id().as_str(), a);
            assert_eq!(m.source_stats[1].duplicates(), 1, "{a} {b}");
            // Within one source too.
            let mut m = merger(1);
            let set = m.merge(&[list(vec![decode(a), decode(b)])]).unwrap();
            assert_eq!(set.by_role(Role::Decode).len(), 1, "{a} {b}");
        }
    }

    #[test]
    fn the_earlier_source_wins_a_duplicate() {
        let mut m = merger(2);
        let mut with_models = decode("http://d1:1");
        with_models.models = vec!["m".into()];
        let set = m
            .merge(&[list(vec![with_models]), list(vec![decode("http://d1:1")])])
            .unwrap();
        assert_eq!(set.by_role(Role::Decode).len(), 1);
        assert!(set.by_role(Role::Decode)[0].models().is_some());
        assert_eq!(m.source_stats[1].duplicates(), 1);
        assert_eq!(m.source_stats[1].decode_endpoints(), 0);
        assert_eq!(m.source_stats[0].decode_endpoints(), 1);
    }
}
