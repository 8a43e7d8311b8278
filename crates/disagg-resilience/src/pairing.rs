//! P/D pair enforcement: refuse endpoint sets with a prefill/decode pair that cannot
//! hand KV over, or an encoder whose outputs its consumer cannot load (E/P/D).
//!
//! The facts are `disagg-pairing`'s ([`disagg_pairing`]): what an endpoint declares
//! in its [`KvProfile`] (its engine's KV connector, `kv_role` and tensor-parallel size)
//! and [`check_pair`], which names the [`Mismatch`] of
//! one pair; and the engine's version, read from its `GET /version` and compared for
//! the connectors whose handshake compares it (vLLM NIXL and Mooncake:
//! [`KvConnector::equal_versions`]). Encoders (E/P/D) are checked likewise against the
//! engines that consume their outputs (the prefill, or the decode when there is no
//! prefill) by their declared [`EcProfile`]s ([`check_ec_pair`]): the same EC
//! connector, an encoder that can produce and a consumer that can consume. This module applies them to whole sets: [`check_pairs`]
//! (and [`check_pairs_with`], with [`Versions`]) checks every prefill/decode pair of a
//! set against the orchestrator's connector and refuses, naming both endpoints and the
//! mismatch of each refused pair; [`ValidatedSource`] applies the check at start-up (a
//! set with a bad pair is an error, so a proxy refuses to start) and to every endpoint
//! set its inner source publishes later: an endpoint joining that cannot pair with
//! those in force is left out (logged, kept in [`ValidatedSource::last_error`], counted
//! in [`PairingStats`]), and the rest of the change goes through.
//!
//! Versions are read by a [`VersionProbe`] ([`ValidatedSource::with_versions`]): at
//! start-up for every engine of the set, later for each engine that joins, before the
//! set with it is published (once per engine, its ranks sharing it), each within the
//! probe's timeout. An engine that does not tell its version (unreachable, another
//! status, no usable body) is paired as one that declares no TP size is: unchecked,
//! with a warning logged once. No change of the set waits for it again: it is asked
//! again in the background, 10 s later, then at intervals doubling up to 5 minutes,
//! until it answers or leaves (what is kept for it leaves with it; one that comes back
//! is asked as a new engine, and an answer to an asking made before it left is not
//! taken for it). A version learned so is compared with the engines that join after
//! it; the endpoints in force stay, as at any change, and one in force it conflicts
//! with is only logged, as a warning naming both endpoints and versions.
//!
//! The inner source's sets are followed through a watch channel, which keeps only the
//! latest set: an engine that leaves and returns while the watcher is busy (asking
//! joining engines their version) looks like no change, and keeps what was kept for it
//! (its version, or its backoff). And as each return is asked as a new engine, before
//! the set with it is published, an engine that hangs on `GET /version` and goes in and
//! out of the set holds each of its returns (and the changes behind it) back by up to
//! one version timeout.
//!
//! # Examples
//!
//! An orchestrator whose source is checked now and on every change:
//!
//! ```
//! use std::sync::Arc;
//! use disagg_connectors::vllm::VllmNixl;
//! use disagg_core::connector::KvConnector;
//! use disagg_core::endpoint::{Endpoint, Role};
//! use disagg_core::source::StaticSource;
//! use disagg_core::transport::Transport;
//! use disagg_core::Orchestrator;
//! use disagg_resilience::pairing::ValidatedSource;
//!
//! # fn build(transport: impl Transport) -> Result<(), Box<dyn std::error::Error>> {
//! let connector: Arc<dyn KvConnector> = Arc::new(VllmNixl::new());
//! let source = StaticSource::new([
//!     Endpoint::new("http://10.0.0.5:8100", Role::Prefill)?,
//!     Endpoint::new("http://10.0.0.7:8200", Role::Decode)?,
//! ]);
//! // Refuses at once a set with a pair that cannot hand over (`PairingError`).
//! let source = ValidatedSource::new(source, Arc::clone(&connector))?;
//! let orchestrator = Orchestrator::builder(source, transport, connector)
//!     .build();
//! # let _ = orchestrator; Ok(()) }
//! ```

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use disagg_core::connector::KvConnector;
use disagg_core::endpoint::{Endpoint, EndpointId, EndpointSet, Role};
use disagg_core::outcome::Listener;
use disagg_core::source::EndpointSource;
use disagg_core::transport::Transport;
use disagg_pairing::{
    EcPairError, EcProfile, KvProfile, Mismatch, PairError, check_ec_pair, check_pair,
};
use futures::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::lock;

mod versions;
pub use versions::{VERSION_PATH, VersionError, check_versions, read_version};

/// Every pair of an endpoint set that cannot hand KV over, and every encoder and
/// consumer that cannot hand encoder outputs over (E/P/D).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairingError {
    /// The refused prefill/decode pairs.
    pub pairs: Vec<PairError>,
    /// The refused encoder/consumer pairs (E/P/D, by their declared [`EcProfile`]s).
    pub encoders: Vec<EcPairError>,
}

impl fmt::Display for PairingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut sep = "";
        if !self.pairs.is_empty() || self.encoders.is_empty() {
            write!(f, "{} prefill/decode pair(s) refused", self.pairs.len())?;
            for p in &self.pairs {
                write!(f, "; {p}")?;
            }
            sep = "; ";
        }
        if !self.encoders.is_empty() {
            write!(f, "{sep}{} encoder pair(s) refused", self.encoders.len())?;
            for p in &self.encoders {
                write!(f, "; {p}")?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for PairingError {}

/// Check every prefill/decode pair of `set` against `connector`.
///
/// # Errors
///
/// [`PairingError`] listing every refused pair.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use disagg_connectors::vllm::VllmNixl;
/// use disagg_core::endpoint::{Endpoint, EndpointSet, Role};
/// use disagg_pairing::{KvProfile, KvRole};
/// use disagg_resilience::pairing::check_pairs;
///
/// let mut ext = http::Extensions::new();
/// ext.insert(KvProfile { role: Some(KvRole::Producer), ..Default::default() });
/// let decode_as_producer = Endpoint::with_extensions("http://d:1", Role::Decode, ext)?;
/// let set = EndpointSet::new([
///     Arc::new(Endpoint::new("http://p:1", Role::Prefill)?),
///     Arc::new(decode_as_producer),
/// ]);
/// let err = check_pairs(&set, &VllmNixl::new()).unwrap_err();
/// assert!(err.to_string().contains("http://p:1"));
/// assert!(err.to_string().contains("http://d:1"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn check_pairs(set: &EndpointSet, connector: &dyn KvConnector) -> Result<(), PairingError> {
    check_pairs_with(set, connector, &Versions::default())
}

/// Like [`check_pairs`], the engines' `versions` compared too (for a connector that
/// [`KvConnector::equal_versions`]; an engine without a known version is not compared).
///
/// # Errors
///
/// [`PairingError`] listing every refused pair.
pub fn check_pairs_with(
    set: &EndpointSet,
    connector: &dyn KvConnector,
    versions: &Versions,
) -> Result<(), PairingError> {
    let mut pairs = Vec::new();
    for p in set.by_role(Role::Prefill) {
        for d in set.by_role(Role::Decode) {
            if let Err(mismatch) = pair(p, d, connector, versions) {
                pairs.push(PairError {
                    prefill: p.id().clone(),
                    decode: d.id().clone(),
                    mismatch,
                });
            }
        }
    }
    let consumer = consumer_role(set);
    let mut encoders = Vec::new();
    for e in set.by_role(Role::Encode) {
        for c in set.by_role(consumer) {
            if let Err(refused) = ec_pair(e, c) {
                encoders.push(refused);
            }
        }
    }
    if pairs.is_empty() && encoders.is_empty() {
        Ok(())
    } else {
        Err(PairingError { pairs, encoders })
    }
}

/// The role that consumes the encoders' outputs in `set`: the prefill, or the decode
/// (a prefill-decode engine, E → PD) when there is no prefill.
fn consumer_role(set: &EndpointSet) -> Role {
    if set.by_role(Role::Prefill).is_empty() {
        Role::Decode
    } else {
        Role::Prefill
    }
}

/// Whether encoder `e` can hand its outputs to consumer `c`, by their declared
/// [`EcProfile`]s (what is not declared is not checked).
fn ec_pair(e: &Endpoint, c: &Endpoint) -> Result<(), EcPairError> {
    let none = EcProfile::default();
    let ep = e.ext().get::<EcProfile>().unwrap_or(&none);
    let cp = c.ext().get::<EcProfile>().unwrap_or(&none);
    check_ec_pair(ep, cp).map_err(|mismatch| EcPairError {
        encoder: e.id().clone(),
        consumer: c.id().clone(),
        consumer_role: c.role().as_str(),
        mismatch,
    })
}

/// Whether prefill `p` and decode `d` can hand over: their declared profiles, then
/// their versions.
fn pair(
    p: &Endpoint,
    d: &Endpoint,
    connector: &dyn KvConnector,
    versions: &Versions,
) -> Result<(), Mismatch> {
    let none = KvProfile::default();
    let pp = p.ext().get::<KvProfile>().unwrap_or(&none);
    let dp = d.ext().get::<KvProfile>().unwrap_or(&none);
    check_pair(pp, dp, connector)?;
    check_versions(versions.get(p), versions.get(d), connector)
}

// === versions ===

/// The key of an endpoint's engine: its `/version` URI (scheme and authority; a rank
/// endpoint shares its engine's).
fn engine_of(e: &Endpoint) -> Option<String> {
    e.uri(VERSION_PATH).ok().map(|u| u.to_string())
}

/// How long after an engine did not tell its version it is asked again (in the
/// background); doubled at each failure in a row, up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_secs(10);

/// The longest wait before a silent engine is asked again.
const RETRY_MAX: Duration = Duration::from_secs(300);

/// The wait before asking again an engine that did not tell its version `failures`
/// times in a row.
fn retry_after(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    RETRY_FIRST.saturating_mul(1 << doublings).min(RETRY_MAX)
}

/// An engine that did not tell its version.
#[derive(Debug, Clone)]
struct Silent {
    /// The askings in a row that got no version.
    failures: u32,
    /// When it is asked again.
    retry_at: Instant,
    /// The number of this silence, new each time an engine becomes silent: an answer
    /// to an asking made in another (before the engine left and came back, another
    /// instance at the same address) is not this one's.
    generation: u64,
}

/// Silent engines to ask again ([`Versions::due`]).
#[derive(Debug)]
struct Due {
    /// Each engine's key, with an endpoint of it to ask.
    wanted: HashMap<String, Arc<Endpoint>>,
    /// Each engine's key, with the number of its silence ([`Silent::generation`]).
    generations: HashMap<String, u64>,
}

/// What one asking of engines got: each engine's key, the endpoint asked and the answer.
type Answers = Vec<(String, Arc<Endpoint>, Result<String, VersionError>)>;

/// Engine versions read from `GET /version`, by engine (the ranks of one engine share
/// its version).
#[derive(Debug, Clone, Default)]
pub struct Versions {
    by_engine: HashMap<String, Arc<str>>,
    /// Engines that did not tell their version (warned about once), and when each is
    /// asked again.
    silent: HashMap<String, Silent>,
    /// The number given to the latest silence ([`Silent::generation`]).
    generations: u64,
}

impl Versions {
    /// No version known.
    pub fn new() -> Self {
        Self::default()
    }

    /// The version of `endpoint`'s engine, if known.
    pub fn get(&self, endpoint: &Endpoint) -> Option<&str> {
        self.by_engine.get(&engine_of(endpoint)?).map(|v| &**v)
    }

    /// `endpoint`'s engine runs `version`.
    pub fn insert(&mut self, endpoint: &Endpoint, version: impl Into<Arc<str>>) {
        if let Some(k) = engine_of(endpoint) {
            self.silent.remove(&k);
            self.by_engine.insert(k, version.into());
        }
    }

    /// Engines with a known version.
    pub fn len(&self) -> usize {
        self.by_engine.len()
    }

    /// Whether no version is known.
    pub fn is_empty(&self) -> bool {
        self.by_engine.is_empty()
    }

    /// Forgets the engines that are not in `set` (one that returns is asked again: it
    /// may have been upgraded).
    fn retain_engines_of(&mut self, set: &EndpointSet) {
        let engines: HashSet<String> = all(set).filter_map(|e| engine_of(e)).collect();
        self.by_engine.retain(|k, _| engines.contains(k));
        self.silent.retain(|k, _| engines.contains(k));
    }

    /// Takes `answers` in: a version is known, a failure makes the engine silent (with
    /// a warning the first time) or puts its next asking further off.
    fn record(&mut self, answers: Answers) {
        let now = Instant::now();
        for (k, e, answer) in answers {
            match answer {
                Ok(v) => {
                    tracing::debug!(endpoint = %e.id(), version = %v, "engine version read");
                    self.silent.remove(&k);
                    self.by_engine.insert(k, Arc::from(v));
                }
                Err(err) => match self.silent.entry(k) {
                    Entry::Occupied(mut o) => {
                        let s = o.get_mut();
                        s.failures = s.failures.saturating_add(1);
                        s.retry_at = now + retry_after(s.failures);
                        tracing::debug!(
                            endpoint = %e.id(),
                            error = %disagg_core::error::error_chain(&err),
                            "engine version still unknown"
                        );
                    }
                    Entry::Vacant(v) => {
                        tracing::warn!(
                            endpoint = %e.id(),
                            error = %disagg_core::error::error_chain(&err),
                            "engine version unknown: its pairs are not checked for version"
                        );
                        self.generations = self.generations.wrapping_add(1);
                        v.insert(Silent {
                            failures: 1,
                            retry_at: now + retry_after(1),
                            generation: self.generations,
                        });
                    }
                },
            }
        }
    }

    /// Takes in the `answers` of a background asking of engines silent with the
    /// numbers `generations`, for those still in the same silence: one that left
    /// meanwhile keeps nothing, and one that came back (another instance, maybe) was
    /// asked anew, so the old answer is not its. Returns the engines whose version is now
    /// known.
    fn record_retries(
        &mut self,
        generations: &HashMap<String, u64>,
        mut answers: Answers,
    ) -> Vec<String> {
        answers.retain(|(k, _, _)| {
            matches!(
                (self.silent.get(k), generations.get(k)),
                (Some(s), Some(g)) if s.generation == *g
            )
        });
        let learned = answers
            .iter()
            .filter(|(_, _, answer)| answer.is_ok())
            .map(|(k, _, _)| k.clone())
            .collect();
        self.record(answers);
        learned
    }

    /// When the next silent engine is due to be asked again.
    fn next_retry(&self) -> Option<Instant> {
        self.silent.values().map(|s| s.retry_at).min()
    }

    /// The silent engines due at `now`, each with an endpoint of `set` to ask and the
    /// number of its silence; their next asking is put off as if this one fails
    /// (whatever becomes of it).
    fn due(&mut self, set: &EndpointSet, now: Instant) -> Due {
        let mut generations = HashMap::new();
        for (k, s) in &mut self.silent {
            if s.retry_at <= now {
                s.retry_at = now + retry_after(s.failures.saturating_add(1));
                generations.insert(k.clone(), s.generation);
            }
        }
        let mut wanted = HashMap::new();
        for e in all(set).filter(|e| e.role() != Role::Encode) {
            if let Some(k) = engine_of(e)
                && generations.contains_key(&k)
            {
                wanted.entry(k).or_insert_with(|| Arc::clone(e));
            }
        }
        Due {
            wanted,
            generations,
        }
    }
}

/// Every endpoint of `set`, prefill first, encoders last.
fn all(set: &EndpointSet) -> impl Iterator<Item = &Arc<Endpoint>> {
    set.iter()
}

/// Engines probed at once.
const PROBES_AT_ONCE: usize = 32;

/// Reads engines' versions with `GET /version` ([`read_version`]) through a transport.
#[derive(Clone)]
pub struct VersionProbe {
    transport: Arc<dyn Transport>,
    timeout: Duration,
}

impl fmt::Debug for VersionProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VersionProbe")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl VersionProbe {
    /// Probes through `transport`, each engine within `timeout`.
    pub fn new(transport: impl Transport, timeout: Duration) -> Self {
        VersionProbe {
            transport: Arc::new(transport),
            timeout,
        }
    }

    /// Reads the version of every engine of `set` that `known` lacks (once per engine,
    /// up to 32 at once, each within the timeout) into `known`. An engine that does not
    /// answer stays unknown, with a warning the first time.
    pub async fn probe(&self, set: &EndpointSet, known: &mut Versions) {
        let wanted = Self::lacking(set, known, true);
        known.record(self.ask(wanted).await);
    }

    /// Like [`probe`](Self::probe), for the engines `known` has not asked yet: those
    /// known to be silent are asked again in the background, not here.
    async fn probe_new(&self, set: &EndpointSet, known: &mut Versions) {
        let wanted = Self::lacking(set, known, false);
        if !wanted.is_empty() {
            known.record(self.ask(wanted).await);
        }
    }

    /// The engines of `set` whose version `known` lacks, the silent ones too if `silent`,
    /// each with an endpoint to ask.
    fn lacking(
        set: &EndpointSet,
        known: &Versions,
        silent: bool,
    ) -> HashMap<String, Arc<Endpoint>> {
        let mut wanted: HashMap<String, Arc<Endpoint>> = HashMap::new();
        // Encoders hand no KV over: their version is never compared.
        for e in all(set).filter(|e| e.role() != Role::Encode) {
            if let Some(k) = engine_of(e)
                && !known.by_engine.contains_key(&k)
                && (silent || !known.silent.contains_key(&k))
            {
                wanted.entry(k).or_insert_with(|| Arc::clone(e));
            }
        }
        wanted
    }

    /// Asks each of `wanted`'s engines its version, up to 32 at once, each within the
    /// timeout.
    async fn ask(&self, wanted: HashMap<String, Arc<Endpoint>>) -> Answers {
        futures::stream::iter(wanted)
            .map(|(k, e)| {
                let transport = Arc::clone(&self.transport);
                let timeout = self.timeout;
                async move {
                    let v = read_version(&*transport, &e, timeout).await;
                    (k, e, v)
                }
            })
            .buffer_unordered(PROBES_AT_ONCE)
            .collect()
            .await
    }
}

// === stats ===

/// The kinds of mismatch, as [`Mismatch::kind`] names them, in the metric's order.
const KINDS: [&str; 4] = ["connector", "role", "tp_size", "version"];

/// What a [`ValidatedSource`] left out, for `/metrics`.
#[derive(Debug, Default)]
pub struct PairingStats {
    /// Endpoints of the latest set left out now: prefill, decode, encode.
    left_out: [AtomicU64; 3],
    /// Endpoints left out, by the kind of their first mismatch, each counted when it
    /// is left out (again).
    refused: [AtomicU64; 4],
}

impl PairingStats {
    /// Endpoints of `role` in the inner source's latest set that are left out now.
    pub fn left_out(&self, role: Role) -> u64 {
        self.left_out[role_index(role)].load(Ordering::Relaxed)
    }

    /// Endpoints left out so far for a mismatch of `kind` ([`Mismatch::kind`]).
    pub fn refused(&self, kind: &str) -> u64 {
        KINDS
            .iter()
            .position(|k| *k == kind)
            .map_or(0, |i| self.refused[i].load(Ordering::Relaxed))
    }

    /// Registers the counts into a Prometheus `registry`, read at each scrape:
    ///
    /// | metric | type | meaning |
    /// |---|---|---|
    /// | `disagg_pairing_left_out{role}` | gauge | endpoints of the latest discovered set left out now because they cannot pair with those in force |
    /// | `disagg_pairing_refused_total{mismatch}` | counter | endpoints left out, by the kind of mismatch (`connector`, `role`, `tp_size`, `version`), each counted when it is left out |
    pub fn register_metrics(
        self: &Arc<Self>,
        registry: &mut prometheus_client::registry::Registry,
    ) {
        registry.register_collector(Box::new(PairingCollector(Arc::clone(self))));
    }
}

fn role_index(role: Role) -> usize {
    match role {
        Role::Prefill => 0,
        Role::Decode => 1,
        _ => 2,
    }
}

/// [`PairingStats::register_metrics`]' collector.
#[derive(Debug)]
struct PairingCollector(Arc<PairingStats>);

impl prometheus_client::collector::Collector for PairingCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::MetricType;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        let mut gauge = encoder.encode_descriptor(
            "disagg_pairing_left_out",
            "Endpoints of the latest discovered set left out now because they cannot hand KV over with those in force.",
            None,
            MetricType::Gauge,
        )?;
        for r in [Role::Prefill, Role::Decode, Role::Encode] {
            let role = r.as_str();
            let n = i64::try_from(self.0.left_out(r)).unwrap_or(i64::MAX);
            ConstGauge::new(n).encode(gauge.encode_family(&[("role", role)])?)?;
        }
        // Counters are named without `_total`: the encoders append it.
        let mut counter = encoder.encode_descriptor(
            "disagg_pairing_refused",
            "Endpoints left out of a discovered set, by the kind of mismatch.",
            None,
            MetricType::Counter,
        )?;
        for kind in KINDS {
            ConstCounter::new(self.0.refused(kind))
                .encode(counter.encode_family(&[("mismatch", kind)])?)?;
        }
        Ok(())
    }
}

struct Shared {
    tx: watch::Sender<Arc<EndpointSet>>,
    last_error: Mutex<Option<PairingError>>,
    stats: Arc<PairingStats>,
}

/// An [`EndpointSource`] that publishes only endpoint sets whose every prefill/decode
/// pair can hand KV over ([`check_pairs`]).
///
/// Built over another source: the current set is checked at once (an invalid one is an
/// error, so a proxy refuses to start), and, when built inside a Tokio runtime, every
/// set the inner source publishes later is checked before it is passed on. In a later
/// set, the endpoints already in force stay (they pair with each other); each
/// endpoint that joins is admitted only if it pairs with every endpoint of the other
/// role admitted so far, and is otherwise left out of the published set, with an error
/// log and the refused pairs in [`last_error`](Self::last_error). So one engine
/// discovered with the wrong KV profile never takes the fleet's other changes with it,
/// and never crashes the proxy; it joins as soon as a set without the conflict comes.
/// The watching task ends when this source is dropped.
pub struct ValidatedSource {
    shared: Arc<Shared>,
    task: Option<tokio::task::JoinHandle<()>>,
    /// The inner source's listener, passed on.
    listener: Option<Arc<dyn Listener>>,
}

impl fmt::Debug for ValidatedSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ValidatedSource")
            .field("watching", &self.task.is_some())
            .finish_non_exhaustive()
    }
}

impl ValidatedSource {
    /// Check `inner`'s current set and follow its changes, on the endpoints' declared
    /// profiles (no versions read).
    ///
    /// # Errors
    ///
    /// [`PairingError`] when the current set has a pair that cannot hand over.
    pub fn new(
        inner: impl EndpointSource,
        connector: Arc<dyn KvConnector>,
    ) -> Result<Self, PairingError> {
        let mut rx = inner.watch();
        let first = rx.borrow_and_update().clone();
        Self::start(inner, rx, first, connector, None, Versions::default())
    }

    /// Like [`new`](Self::new), the engines' versions read by `probe` and compared when
    /// the connector [`KvConnector::equal_versions`]: those of the current set now, those of
    /// each engine joining later before it is admitted.
    ///
    /// # Errors
    ///
    /// [`PairingError`] when the current set has a pair that cannot hand over (two
    /// engines of different versions included), naming both endpoints and versions.
    pub async fn with_versions(
        inner: impl EndpointSource,
        connector: Arc<dyn KvConnector>,
        probe: VersionProbe,
    ) -> Result<Self, PairingError> {
        // The set probed is the one checked and put in force: a change while the probe
        // is out stays pending on `rx`, for the watcher to take as any other.
        let mut rx = inner.watch();
        let first = rx.borrow_and_update().clone();
        let mut versions = Versions::default();
        if connector.equal_versions() {
            probe.probe(&first, &mut versions).await;
        }
        Self::start(inner, rx, first, connector, Some(probe), versions)
    }

    /// Checks `first`, the inner source's set last seen on `rx`, and follows `rx`.
    fn start(
        inner: impl EndpointSource,
        rx: watch::Receiver<Arc<EndpointSet>>,
        first: Arc<EndpointSet>,
        connector: Arc<dyn KvConnector>,
        probe: Option<VersionProbe>,
        versions: Versions,
    ) -> Result<Self, PairingError> {
        let listener = inner.listener();
        check_pairs_with(&first, &*connector, &versions)?;
        let (tx, _) = watch::channel(Arc::clone(&first));
        let shared = Arc::new(Shared {
            tx,
            last_error: Mutex::new(None),
            stats: Arc::new(PairingStats::default()),
        });
        let probe = probe.filter(|_| connector.equal_versions());
        let task = tokio::runtime::Handle::try_current().ok().map(|rt| {
            let shared = Arc::clone(&shared);
            rt.spawn(async move {
                // The inner source is kept alive while its sets are followed.
                let _inner = inner;
                follow(rx, first, &shared, &*connector, probe, versions).await;
            })
        });
        Ok(ValidatedSource {
            shared,
            task,
            listener,
        })
    }

    /// What this source left out, for `/metrics`
    /// ([`PairingStats::register_metrics`]).
    pub fn stats(&self) -> Arc<PairingStats> {
        Arc::clone(&self.shared.stats)
    }

    /// The pairs that kept endpoints of the latest set the inner source published out of
    /// the published set, if any.
    pub fn last_error(&self) -> Option<PairingError> {
        lock(&self.shared.last_error).clone()
    }
}

/// Follows the inner source's sets (`rx`, `first` the one in force) until it ends:
/// each is checked and published once the engines that joined in it have been asked
/// their version (by `probe`, if versions are compared). Engines known to be silent are
/// asked again in the background (one asking at a time, on a task of its own, ended
/// with this one): no set waits for them.
async fn follow(
    mut rx: watch::Receiver<Arc<EndpointSet>>,
    first: Arc<EndpointSet>,
    shared: &Shared,
    connector: &dyn KvConnector,
    probe: Option<VersionProbe>,
    mut versions: Versions,
) {
    let mut latest = first;
    let mut left_out: HashSet<(Role, EndpointId)> = HashSet::new();
    let mut retries: JoinSet<(HashMap<String, u64>, Answers)> = JoinSet::new();
    loop {
        let retry_at = match probe {
            Some(_) if retries.is_empty() => versions.next_retry(),
            _ => None,
        };
        let retry = async move {
            match retry_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            changed = rx.changed() => {
                if changed.is_err() {
                    return;
                }
                let set = rx.borrow_and_update().clone();
                if let Some(probe) = &probe {
                    versions.retain_engines_of(&set);
                    probe.probe_new(&set, &mut versions).await;
                }
                left_out = publish(shared, &set, connector, &versions, left_out);
                latest = set;
            }
            () = retry => {
                if let Some(probe) = &probe {
                    let due = versions.due(&latest, Instant::now());
                    let probe = probe.clone();
                    retries.spawn(async move { (due.generations, probe.ask(due.wanted).await) });
                }
            }
            Some(done) = retries.join_next() => {
                // A version learned now is compared with the engines that join after
                // it: those in force stay (see `admit`), so nothing is published again;
                // a conflict with one of them is only logged.
                if let Ok((generations, answers)) = done {
                    let learned = versions.record_retries(&generations, answers);
                    let current = shared.tx.borrow().clone();
                    for e in conflicts(&current, &learned, connector, &versions) {
                        tracing::warn!(
                            error = %e,
                            "a version learned late conflicts with an endpoint in force: \
                             both stay, the handoffs between them may fail"
                        );
                    }
                }
            }
        }
    }
}

/// The prefill/decode pairs of `set` with an engine of `learned` whose `versions`
/// differ (for a connector that [`KvConnector::equal_versions`]).
fn conflicts(
    set: &EndpointSet,
    learned: &[String],
    connector: &dyn KvConnector,
    versions: &Versions,
) -> Vec<PairError> {
    let mut found = Vec::new();
    if learned.is_empty() {
        return found;
    }
    let is_learned = |e: &Endpoint| engine_of(e).is_some_and(|k| learned.contains(&k));
    for p in set.by_role(Role::Prefill) {
        for d in set.by_role(Role::Decode) {
            if !(is_learned(p) || is_learned(d)) {
                continue;
            }
            if let Err(mismatch) = check_versions(versions.get(p), versions.get(d), connector) {
                found.push(PairError {
                    prefill: p.id().clone(),
                    decode: d.id().clone(),
                    mismatch,
                });
            }
        }
    }
    found
}

/// Checks `set`, the inner source's new set, against the set in force and publishes
/// what is admitted; `left_out` is what the previous change left out. Returns what is
/// left out now.
fn publish(
    shared: &Shared,
    set: &Arc<EndpointSet>,
    connector: &dyn KvConnector,
    versions: &Versions,
    left_out: HashSet<(Role, EndpointId)>,
) -> HashSet<(Role, EndpointId)> {
    let current = shared.tx.borrow().clone();
    let admitted = admit(&current, set, connector, versions);
    let left_out = count(&shared.stats, &admitted, left_out);
    match admitted.refused {
        None => *lock(&shared.last_error) = None,
        Some(e) => {
            tracing::error!(error = %e, "endpoints left out of the set: they cannot hand KV over");
            *lock(&shared.last_error) = Some(e);
        }
    }
    shared.tx.send_replace(admitted.set);
    left_out
}

/// What [`admit`] decided.
struct Admitted {
    /// The set to publish.
    set: Arc<EndpointSet>,
    /// The pairs that left endpoints out, if any.
    refused: Option<PairingError>,
    /// The endpoints left out, with the kind of their first mismatch.
    left_out: Vec<(Role, EndpointId, &'static str)>,
}

/// Updates `stats` for what `admitted` left out; `before` is what the previous change
/// left out (an endpoint still left out is not counted again). Returns what is left
/// out now.
fn count(
    stats: &PairingStats,
    admitted: &Admitted,
    before: HashSet<(Role, EndpointId)>,
) -> HashSet<(Role, EndpointId)> {
    let mut now = HashSet::new();
    let mut per_role = [0u64; 3];
    for (role, id, kind) in &admitted.left_out {
        per_role[role_index(*role)] += 1;
        let key = (*role, id.clone());
        if !before.contains(&key)
            && let Some(i) = KINDS.iter().position(|k| k == kind)
        {
            stats.refused[i].fetch_add(1, Ordering::Relaxed);
        }
        now.insert(key);
    }
    for (i, n) in per_role.into_iter().enumerate() {
        stats.left_out[i].store(n, Ordering::Relaxed);
    }
    now
}

/// The set to publish for `next`, the inner source's new set, when `current` is in force:
/// the endpoints of `next` already in force (by id) first, then each other endpoint of
/// `next`, in its order, if it pairs with every endpoint of the other role admitted so
/// far. Returns the set, the pairs that left endpoints out and those endpoints.
fn admit(
    current: &EndpointSet,
    next: &Arc<EndpointSet>,
    connector: &dyn KvConnector,
    versions: &Versions,
) -> Admitted {
    if check_pairs_with(next, connector, versions).is_ok() {
        return Admitted {
            set: Arc::clone(next),
            refused: None,
            left_out: Vec::new(),
        };
    }
    let in_force = |e: &Arc<Endpoint>| current.by_role(e.role()).iter().any(|c| c.id() == e.id());
    let mut admitted: Vec<Arc<Endpoint>> = all(next).filter(|e| in_force(e)).cloned().collect();
    let mut pairs = Vec::new();
    let mut encoders = Vec::new();
    let mut left_out = Vec::new();
    let consumer = consumer_role(next);
    for e in all(next).filter(|e| !in_force(e)) {
        let mut bad = Vec::new();
        let mut bad_ec = Vec::new();
        for other in admitted.iter().filter(|o| o.role() != e.role()) {
            let (p, d) = match (e.role(), other.role()) {
                (Role::Prefill, Role::Decode) => (e, other),
                (Role::Decode, Role::Prefill) => (other, e),
                // An encoder hands its outputs to the consumers.
                (Role::Encode, r) if r == consumer => {
                    bad_ec.extend(ec_pair(e, other).err());
                    continue;
                }
                (r, Role::Encode) if r == consumer => {
                    bad_ec.extend(ec_pair(other, e).err());
                    continue;
                }
                _ => continue,
            };
            if let Err(mismatch) = pair(p, d, connector, versions) {
                bad.push(PairError {
                    prefill: p.id().clone(),
                    decode: d.id().clone(),
                    mismatch,
                });
            }
        }
        let first = (bad.first().map(|b| b.mismatch.kind()))
            .or_else(|| bad_ec.first().map(|b| b.mismatch.kind()));
        match first {
            None => admitted.push(Arc::clone(e)),
            Some(kind) => {
                left_out.push((e.role(), e.id().clone(), kind));
                pairs.extend(bad);
                encoders.extend(bad_ec);
            }
        }
    }
    let refused = !(pairs.is_empty() && encoders.is_empty());
    Admitted {
        set: Arc::new(EndpointSet::new(admitted)),
        refused: refused.then_some(PairingError { pairs, encoders }),
        left_out,
    }
}

impl Drop for ValidatedSource {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

impl EndpointSource for ValidatedSource {
    fn watch(&self) -> watch::Receiver<Arc<EndpointSet>> {
        self.shared.tx.subscribe()
    }

    fn snapshot(&self) -> Arc<EndpointSet> {
        self.shared.tx.borrow().clone()
    }

    fn listener(&self) -> Option<Arc<dyn Listener>> {
        self.listener.clone()
    }
}

#[cfg(test)]
mod tests;
