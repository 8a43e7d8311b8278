//! Engine telemetry: every engine's `GET /metrics`, read on an interval into one model
//! per engine ([`EngineSnapshot`]), and what the proxy judges from it: KV **receipts**
//! (did the KV the proxy handed a decode arrive?) and **stranded KV** (a prefill's KV
//! expired unclaimed, transfers that failed).
//!
//! # Scraping
//!
//! [`Telemetry::run`] asks every engine of a source's set `GET /metrics` every
//! [`TelemetryConfig::interval`] (prefill, decode and encoder engines: vLLM's encoder-only
//! instances serve the same metrics), once per engine (`host:port`, whatever its roles and
//! data-parallel ranks), all concurrently, through the transport the legs use (the
//! engine key, TLS). Each scrape is bounded: its whole answer within
//! [`TelemetryConfig::timeout`], at most [`TelemetryConfig::max_body`] bytes (a larger
//! body is refused as it streams, never held whole). A scrape that fails (refused, a
//! non-2xx, too slow, too large, not UTF-8, not the Prometheus text format) is counted
//! for its engine and changes nothing else. Engines that leave the set lose their state
//! at the next round.
//!
//! The text is parsed with the `prom_text_format_parser` crate and the engines' names
//! are mapped to the model in `names.rs` (vLLM 0.33 and SGLang 0.5.23). Only the lines
//! of the names read reach the parser, at most 16,384 of them and 2 MiB; the others are
//! checked a chunk at a time and dropped (`filter.rs`), and no sample line over 64 KiB
//! is parsed (a body past a ceiling fails the scrape): a scrape's memory is that of
//! the lines read, whatever else the body holds.
//!
//! # Receipts
//!
//! The orchestrator tells [`Telemetry`] (a [`Listener`]) each request whose KV it handed
//! to a decode (`x-disagg-handoff: kv`). Between two successful scrapes of a decode
//! engine (a *window*) in which it was handed KV, its receipt ratio is the share of the
//! prompt tokens it took in that window that arrived by KV transfer:
//!
//! ```text
//! external_kv_transfer / (local_compute + external_kv_transfer)     (deltas over the window)
//! ```
//!
//! Prefix-cache hits (`local_cache_hit`) are left out of both sides: a prompt found in
//! the decode's own cache needed no transfer and says nothing about one. A window with
//! no handoff, no prompt token, an engine that does not count transfers (SGLang), or
//! counts that make no share (a negative one, a sum too large for an `f64`) has no
//! ratio. A ratio below [`TelemetryConfig::receipt_threshold`] for
//! [`TelemetryConfig::suspect_windows`] judged windows in a row flags the decode as
//! suspect (a warning names the prefill it was last paired with); with
//! [`SuspectAction::Eject`] it is also ejected through [`Health::eject`], like an
//! endpoint whose legs fail, and judged again once it is back. A judged window at or
//! above the threshold clears the flag.
//!
//! Receipts are windowed, not per request: a window mixes every request the decode took
//! (from this proxy and others), and a request counted by the engine near a window's
//! edge may be counted by the proxy in the next one.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http::uri::Authority;
use http::{StatusCode, Uri};
use tokio::sync::watch;

use crate::health::Health;
use crate::lock;
use disagg_core::endpoint::{Endpoint, EndpointSet, Role};
use disagg_core::error::TransportError;
use disagg_core::outcome::{Listener, Summary};
use disagg_core::source::EndpointSource;
use disagg_core::transport::{Transport, read_limited};

mod filter;
mod metrics;
mod names;

/// What to do with a decode whose receipts stay low ([`TelemetryConfig::suspect_action`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SuspectAction {
    /// Flag it (`disagg_endpoint_kv_suspect` 1) and log a warning. The default.
    #[default]
    Warn,
    /// Flag it, and eject it from the decode pool like an unhealthy endpoint.
    Eject,
}

/// Telemetry settings.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct TelemetryConfig {
    /// Time between two scrapes of an engine. Default 5 s (at least 1 ms is used).
    pub interval: Duration,
    /// Time for one scrape's whole answer. Default 2 s.
    pub timeout: Duration,
    /// The largest `/metrics` body read. Default 4 MiB (a vLLM engine answers tens of
    /// kilobytes).
    pub max_body: usize,
    /// A judged window whose receipt ratio is below this counts against the decode.
    /// Default 0.5.
    pub receipt_threshold: f64,
    /// Judged windows in a row below the threshold that flag a decode. Default 3 (0
    /// acts as 1).
    pub suspect_windows: u32,
    /// What a flag does. Default [`SuspectAction::Warn`].
    pub suspect_action: SuspectAction,
    /// Whether each read sets the endpoints' engine load
    /// ([`Endpoint::set_engine_load`]: the engine's waiting plus running requests), which
    /// the load-aware policies then weigh instead of this proxy's own in-flight counts
    /// (`--load-source engine-metrics`). Default false: the policies see this proxy's
    /// counts only.
    pub engine_load: bool,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            interval: Duration::from_secs(5),
            timeout: Duration::from_secs(2),
            max_body: 4 << 20,
            receipt_threshold: 0.5,
            suspect_windows: 3,
            suspect_action: SuspectAction::Warn,
            engine_load: false,
        }
    }
}

/// The engine family whose names a snapshot was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EngineFamily {
    /// `vllm:` names.
    Vllm,
    /// `sglang:` names.
    Sglang,
}

/// An engine's prompt tokens by where their KV came from (counters since it started);
/// `None` when the engine does not count that source.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[non_exhaustive]
pub struct PromptTokens {
    /// Computed by the engine itself.
    pub local_compute: Option<f64>,
    /// Found in its prefix cache.
    pub local_cache_hit: Option<f64>,
    /// Arrived by KV transfer from a prefill.
    pub external_kv_transfer: Option<f64>,
}

/// One engine's `/metrics`, in one model whatever its family (see `names.rs` for the
/// mapping); a field is `None` when the engine does not expose it. Counters are the
/// engine's own, since it started.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct EngineSnapshot {
    /// Whose names were read; `None` when neither family's were found.
    pub family: Option<EngineFamily>,
    /// Prompt tokens by source.
    pub prompt_tokens: PromptTokens,
    /// KV transfers that failed.
    pub kv_transfer_failures: Option<f64>,
    /// Requests whose KV expired on this engine (a prefill) before a decode claimed it.
    pub kv_expired: Option<f64>,
    /// Requests waiting to be scheduled.
    pub requests_waiting: Option<f64>,
    /// Requests running.
    pub requests_running: Option<f64>,
    /// KV cache usage, 0 to 1.
    pub kv_cache_usage: Option<f64>,
}

impl EngineSnapshot {
    /// The engine's requests, waiting and running, when it counts either (a count that
    /// is negative or no number is taken as 0).
    pub fn requests(&self) -> Option<u64> {
        if self.requests_waiting.is_none() && self.requests_running.is_none() {
            return None;
        }
        let n = |v: Option<f64>| v.filter(|v| v.is_finite() && *v > 0.0).unwrap_or(0.0);
        // `as` saturates: a huge count is u64::MAX, which the endpoint bounds.
        Some((n(self.requests_waiting) + n(self.requests_running)).round() as u64)
    }
}

/// Why a scrape failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ScrapeError {
    /// The engine could not be reached.
    #[error("engine unreachable")]
    Transport(#[source] TransportError),
    /// It answered another status than 2xx.
    #[error("engine answered {0}")]
    Status(StatusCode),
    /// Its whole answer did not come within the timeout.
    #[error("no whole answer within {0:?}")]
    Timeout(Duration),
    /// Its body broke, or was larger than the limit.
    #[error("body unreadable or larger than {limit} bytes")]
    Body {
        /// The limit.
        limit: usize,
        /// What the body reader said.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Its body is not UTF-8.
    #[error("body is not UTF-8")]
    Utf8,
    /// Its body is not the Prometheus text format.
    #[error("body is not the Prometheus text format: {0}")]
    Parse(String),
    /// Its body passes a ceiling on what the parser is given: more than 16,384 lines,
    /// or 2 MiB, of the metrics read (their samples, `HELP` and `TYPE` lines), or a
    /// sample line over 64 KiB (read or not). The scrape is refused rather than read in
    /// part.
    #[error("body has {0}")]
    Ceiling(&'static str),
}

/// An engine's state between scrapes.
struct EngineState {
    /// `scheme://host:port`, its `endpoint` label.
    label: Arc<str>,
    /// The engine's decode endpoints (every rank), to eject.
    decodes: Vec<Arc<Endpoint>>,
    scrapes: u64,
    scrape_errors: u64,
    snapshot: Option<EngineSnapshot>,
    /// Handoffs counted when the last window ended.
    handoffs_seen: u64,
    /// The last judged window's ratio, while it is the latest window's.
    ratio: Option<f64>,
    /// Judged windows in a row below the threshold.
    low: u32,
    suspect: bool,
}

impl EngineState {
    /// An engine not read yet: no snapshot, no window judged.
    fn new(label: Arc<str>, decodes: Vec<Arc<Endpoint>>) -> Self {
        EngineState {
            label,
            decodes,
            scrapes: 0,
            scrape_errors: 0,
            snapshot: None,
            handoffs_seen: 0,
            ratio: None,
            low: 0,
            suspect: false,
        }
    }
}

/// One engine to scrape, as [`Telemetry::retarget`] finds it.
struct Target {
    uri: Uri,
    label: Arc<str>,
    decodes: Vec<Arc<Endpoint>>,
}

/// Handoffs to one decode engine, counted on the request path.
#[derive(Default)]
struct Handoffs {
    count: AtomicU64,
    /// The prefill of the latest one, for the warning.
    last_prefill: Mutex<Option<Arc<str>>>,
}

/// Engine telemetry: the scrape loop ([`run`](Self::run)), the per-engine snapshots
/// ([`snapshot`](Self::snapshot)), receipts, and their metrics
/// ([`register_metrics`](Self::register_metrics)). See the [module](self) documentation.
pub struct Telemetry {
    config: TelemetryConfig,
    health: Option<Arc<Health>>,
    engines: Mutex<HashMap<Authority, EngineState>>,
    handoffs: RwLock<HashMap<Authority, Arc<Handoffs>>>,
}

impl fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Telemetry")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Engines scraped at once.
const SCRAPES_AT_ONCE: usize = 32;

/// The shortest interval used: `tokio::time::interval` refuses zero.
const MIN_INTERVAL: Duration = Duration::from_millis(1);

impl Telemetry {
    /// Telemetry with `config`; `health` is where [`SuspectAction::Eject`] ejects (without
    /// it a suspect decode is only flagged).
    pub fn new(config: TelemetryConfig, health: Option<Arc<Health>>) -> Arc<Self> {
        Arc::new(Telemetry {
            config,
            health,
            engines: Mutex::new(HashMap::new()),
            handoffs: RwLock::new(HashMap::new()),
        })
    }

    /// The settings.
    pub fn config(&self) -> &TelemetryConfig {
        &self.config
    }

    /// The latest snapshot of the engine at `authority`, if a scrape of it succeeded
    /// since it joined the set.
    pub fn snapshot(&self, authority: &Authority) -> Option<EngineSnapshot> {
        lock(&self.engines)
            .get(authority)
            .and_then(|e| e.snapshot.clone())
    }

    /// Whether the decode engine at `authority` is flagged as suspect now.
    pub fn is_suspect(&self, authority: &Authority) -> bool {
        lock(&self.engines)
            .get(authority)
            .is_some_and(|e| e.suspect)
    }

    /// Scrape the engines of `source` every interval (the first one interval after the
    /// call) until `stop` turns true (or its sender is dropped), or the future is
    /// dropped: a future for the embedder to spawn.
    pub async fn run(
        self: Arc<Self>,
        source: Arc<dyn EndpointSource>,
        transport: impl Transport,
        mut stop: watch::Receiver<bool>,
    ) {
        let transport: Arc<dyn Transport> = Arc::new(transport);
        // The first read one interval after the start, not at once: the engines were
        // just asked for their versions, and a proxy that lives less than an interval
        // (a test, a failed start) reads nothing.
        let period = self.config.interval.max(MIN_INTERVAL);
        let first = crate::after(tokio::time::Instant::now(), period);
        let mut tick = tokio::time::interval_at(first, period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let stopped = async move {
            let _ = stop.wait_for(|stop| *stop).await;
        };
        tokio::pin!(stopped);
        loop {
            tokio::select! {
                biased;
                () = &mut stopped => return,
                _ = tick.tick() => {
                    let set = source.snapshot();
                    tokio::select! {
                        biased;
                        () = &mut stopped => return,
                        () = self.round(&set, &transport) => {}
                    }
                }
            }
        }
    }

    /// Scrape every engine of `set` once and judge the windows that ended.
    pub async fn round(&self, set: &EndpointSet, transport: &Arc<dyn Transport>) {
        let targets = self.retarget(set);
        let results: Vec<_> = futures::stream::iter(targets)
            .map(|(authority, uri)| {
                let transport = Arc::clone(transport);
                let (timeout, limit) = (self.config.timeout, self.config.max_body);
                async move {
                    let r = scrape(&*transport, uri, timeout, limit).await;
                    (authority, r)
                }
            })
            .buffer_unordered(SCRAPES_AT_ONCE)
            .collect()
            .await;
        let mut eject = Vec::new();
        // Each engine's requests (waiting and running) by this round's read; `None` for
        // one whose read failed or that does not count them.
        let mut loads: HashMap<Authority, Option<u64>> = HashMap::new();
        {
            let mut engines = lock(&self.engines);
            for (authority, result) in results {
                let Some(state) = engines.get_mut(&authority) else {
                    continue;
                };
                state.scrapes += 1;
                if self.config.engine_load {
                    let load = result.as_ref().ok().and_then(EngineSnapshot::requests);
                    loads.insert(authority.clone(), load);
                }
                match result {
                    Ok(snapshot) => {
                        let handoffs = self.handoffs_to(&authority);
                        if self.judge(state, snapshot, handoffs) {
                            eject.extend(state.decodes.iter().cloned());
                        }
                    }
                    Err(e) => {
                        state.scrape_errors += 1;
                        tracing::debug!(
                            endpoint = %state.label,
                            error = %disagg_core::error::error_chain(&e),
                            "engine metrics scrape failed"
                        );
                        if state.scrape_errors == 1 {
                            tracing::warn!(
                                endpoint = %state.label,
                                error = %disagg_core::error::error_chain(&e),
                                "engine metrics scrape failed (further failures are counted in disagg_engine_scrape_errors_total)"
                            );
                        }
                    }
                }
            }
        }
        // The engines' counts go to the endpoints the policies read, every role and rank
        // of the engine (encoders too: the encoder stage picks the least loaded); an
        // engine not read falls back to this proxy's own counts.
        for e in set
            .by_role(Role::Prefill)
            .iter()
            .chain(set.by_role(Role::Decode))
            .chain(set.by_role(Role::Encode))
        {
            if let Some(reading) = loads.get(e.authority()) {
                e.set_engine_load(*reading);
            }
        }
        if let Some(health) = &self.health {
            for e in &eject {
                health.eject(e, "KV receipts below the threshold");
            }
        }
    }

    /// Follow `set`: one state per engine, the gone ones dropped; the engines to scrape.
    fn retarget(&self, set: &EndpointSet) -> Vec<(Authority, Uri)> {
        let mut seen: HashMap<Authority, Target> = HashMap::new();
        for e in set
            .by_role(Role::Prefill)
            .iter()
            .chain(set.by_role(Role::Decode))
            .chain(set.by_role(Role::Encode))
        {
            let entry = match seen.get_mut(e.authority()) {
                Some(entry) => entry,
                None => {
                    let Ok(uri) = e.uri("/metrics") else { continue };
                    let label: Arc<str> = uri
                        .to_string()
                        .trim_end_matches("/metrics")
                        .to_owned()
                        .into();
                    seen.entry(e.authority().clone()).or_insert(Target {
                        uri,
                        label,
                        decodes: Vec::new(),
                    })
                }
            };
            if e.role() == Role::Decode {
                entry.decodes.push(Arc::clone(e));
            }
        }
        let mut engines = lock(&self.engines);
        engines.retain(|a, _| seen.contains_key(a));
        let mut targets = Vec::with_capacity(seen.len());
        for (
            authority,
            Target {
                uri,
                label,
                decodes,
            },
        ) in seen
        {
            let state = engines
                .entry(authority.clone())
                .or_insert_with(|| EngineState::new(label, Vec::new()));
            state.decodes = decodes;
            targets.push((authority, uri));
        }
        drop(engines);
        let mut handoffs = self
            .handoffs
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        handoffs.retain(|a, _| targets.iter().any(|(t, _)| t == a));
        targets
    }

    fn handoffs_to(&self, authority: &Authority) -> Option<Arc<Handoffs>> {
        self.handoffs
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(authority)
            .cloned()
    }

    /// Close `state`'s window with its new `snapshot`; whether to eject it.
    fn judge(
        &self,
        state: &mut EngineState,
        snapshot: EngineSnapshot,
        handoffs: Option<Arc<Handoffs>>,
    ) -> bool {
        let count = handoffs
            .as_ref()
            .map_or(0, |h| h.count.load(Ordering::Relaxed));
        let handed = count.saturating_sub(state.handoffs_seen);
        state.handoffs_seen = count;
        let previous = state.snapshot.replace(snapshot);
        state.ratio = None;
        if state.decodes.is_empty() || handed == 0 {
            return false;
        }
        let (Some(before), Some(now)) = (previous, state.snapshot.as_ref()) else {
            return false;
        };
        let delta = |a: Option<f64>, b: Option<f64>| match (a, b) {
            // A counter that went down: the engine restarted; all of it is new.
            (Some(a), Some(b)) if b < a => Some(b),
            (Some(a), Some(b)) => Some(b - a),
            (None, Some(b)) => Some(b),
            _ => None,
        };
        let (p, q) = (&before.prompt_tokens, &now.prompt_tokens);
        let Some(external) = delta(p.external_kv_transfer, q.external_kv_transfer) else {
            return false;
        };
        let local = delta(p.local_compute, q.local_compute).unwrap_or(0.0);
        let total = local + external;
        // Only counts that make a share are judged: sums that overflowed to infinity
        // (and then a NaN, infinity less infinity), and negative counts, say nothing
        // of the KV; judged, a NaN would count as a low window and eject the decode.
        let counted = |n: f64| n.is_finite() && n >= 0.0;
        if !(counted(external) && counted(local) && total.is_finite() && total > 0.0) {
            return false;
        }
        let ratio = external / total;
        state.ratio = Some(ratio);
        if ratio >= self.config.receipt_threshold {
            state.low = 0;
            if state.suspect {
                state.suspect = false;
                tracing::info!(endpoint = %state.label, ratio, "decode's KV receipts are back above the threshold");
            }
            return false;
        }
        state.low = state.low.saturating_add(1);
        if state.low < self.config.suspect_windows.max(1) {
            return false;
        }
        if !state.suspect {
            state.suspect = true;
            let prefill = handoffs
                .as_ref()
                .and_then(|h| lock(&h.last_prefill).clone());
            tracing::warn!(
                decode = %state.label,
                prefill = prefill.as_deref().unwrap_or("unknown"),
                ratio,
                threshold = self.config.receipt_threshold,
                windows = state.low,
                handoffs = handed,
                "decode computes the prompts whose KV it was handed: the KV does not arrive"
            );
        }
        self.config.suspect_action == SuspectAction::Eject
    }
}

impl Listener for Telemetry {
    fn on_request(&self, summary: &Summary) {
        if summary.handoff != Some("kv") {
            return;
        }
        let Some(route) = &summary.route else { return };
        let authority = route.decode.authority();
        // The common case: one lookup under a read lock, one atomic add.
        {
            let map = self
                .handoffs
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(h) = map.get(authority) {
                h.count(route);
                return;
            }
        }
        // Only engines of the scraped set are counted (`retarget` keeps those).
        if !lock(&self.engines).contains_key(authority) {
            return;
        }
        let h = Arc::clone(
            self.handoffs
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .entry(authority.clone())
                .or_default(),
        );
        h.count(route);
    }
}

impl Handoffs {
    /// Count one handoff over `route`.
    fn count(&self, route: &disagg_core::router::Route) {
        self.count.fetch_add(1, Ordering::Relaxed);
        // For the warning only: never waits on the request path (a busy lock skips it).
        if let Some(p) = &route.prefill
            && let Ok(mut last) = self.last_prefill.try_lock()
            && last.as_deref() != Some(p.id().as_str())
        {
            *last = Some(Arc::from(p.id().as_str()));
        }
    }
}

/// One scrape: `GET uri`, a 2xx whose body is Prometheus text, within `timeout` and
/// `limit` bytes.
pub async fn scrape(
    transport: &dyn Transport,
    uri: Uri,
    timeout: Duration,
    limit: usize,
) -> Result<EngineSnapshot, ScrapeError> {
    let mut req = http::Request::new(Bytes::new());
    *req.uri_mut() = uri;
    let exchange = async {
        let response = transport.send(req).await.map_err(ScrapeError::Transport)?;
        let status = response.status();
        if !status.is_success() {
            return Err(ScrapeError::Status(status));
        }
        read_limited(response.into_body(), limit)
            .await
            .map_err(|source| ScrapeError::Body { limit, source })
    };
    let body = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| ScrapeError::Timeout(timeout))??;
    let text = std::str::from_utf8(&body).map_err(|_| ScrapeError::Utf8)?;
    parse(text)
}

/// Parse an engine's `/metrics` text into the model. Lines that are not the text
/// format fail it; a metric whose lines are well formed but out of the format's order
/// is skipped.
///
/// Only the lines of the metrics read reach the parser, the others being checked a
/// chunk at a time and dropped: the answer is the one the parser gives on the whole
/// text, its memory that of the lines read (see `filter.rs`). A text past a ceiling on
/// what the parser is given is refused ([`ScrapeError::Ceiling`]).
pub fn parse(text: &str) -> Result<EngineSnapshot, ScrapeError> {
    let kept = filter::filter(text)?;
    if !kept.samples {
        // No sample line, so no metric: the parser's error for an empty text or a HELP
        // or TYPE line (a metric without samples), else nothing.
        let (probe, index) = match kept.descriptor {
            Some((index, line)) => (line, index),
            None if text.is_empty() => ("", 0),
            None => return Ok(EngineSnapshot::default()),
        };
        let message = match prom_text_format_parser::parse_scrape(probe).1 {
            Some(prom_text_format_parser::ScrapeParseError::Collect(errors)) => errors
                .first()
                .map(|e| format!("line {}: {}", index + 1, e.error))
                .unwrap_or_default(),
            Some(prom_text_format_parser::ScrapeParseError::Parse(m)) => m,
            None => String::new(),
        };
        return Err(parse_error(message));
    }
    let mut snapshot = if kept.text.is_empty() {
        EngineSnapshot::default()
    } else {
        let (metrics, errors) = prom_text_format_parser::parse_scrape(&kept.text);
        // A metric left incomplete is no failure: the text has samples, so the parser
        // found a metric in it.
        if let Some(prom_text_format_parser::ScrapeParseError::Parse(m)) = errors {
            return Err(parse_error(m));
        }
        names::snapshot(&metrics)
    };
    snapshot.family = kept.family;
    Ok(snapshot)
}

/// [`ScrapeError::Parse`] with the parser's `message`, cut to a line's worth (it quotes
/// the input) for a log.
fn parse_error(mut message: String) -> ScrapeError {
    if let Some((i, _)) = message.char_indices().nth(200) {
        message.truncate(i);
    }
    ScrapeError::Parse(message)
}

#[cfg(test)]
mod tests;
