//! `serve`'s KV-event routing flags: the `kv_events` policy's subscriber, index and
//! scorer, the tokenizer that gives it a request's token ids, and their metrics.
//!
//! The subscriber runs on a thread of its own (one small tokio runtime), so its
//! sockets never share an event loop with requests. It follows the endpoint set: with
//! discovery, every change of the discovered set (before health filtering: an engine
//! ejected for a few seconds keeps its cache and its entries); without, the
//! `--prefill` / `--decode` engines. Where an engine publishes comes, in this order,
//! from its `--kv-events-endpoint`, a discovery source's KV-events endpoint (a pod
//! annotation, the endpoints file's `kv_events`), or `--kv-events-port` on the
//! engine's own host; an engine with none of them is not subscribed to (its entries
//! stay empty, and the policy sees it as holding nothing).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use clap::{Args, ValueEnum};
use disagg_core::error::BoxError as CoreBoxError;
use disagg_core::tokens::{Asked, TokenIds, Tokenizer};
use disagg_core::transport::Transport;
use disagg_core::{
    Endpoint, EndpointSource, Role, endpoint::EndpointSet, json::JsonBody, request::Api,
};
use disagg_http::metrics::ExtraMetrics;
use disagg_http::{HttpTransport, HttpTransportConfig};
use disagg_kvevents::{
    EngineEndpoint, IndexConfig, KvIndex, KvScorer, ScorerConfig, Subscriber, SubscriberConfig,
};
use disagg_tokenize::prompt::BlockingLimit;
use disagg_tokenize::{EngineTokenizer, HfTokenizer};

use crate::BoxError;

/// Flags of the `kv_events` policy (docs/routing.md).
#[derive(Debug, Clone, Default, Args)]
pub struct KvEventsArgs {
    /// Where an engine publishes its KV-cache events (its `--kv-events-config`
    /// `endpoint`, `*` replaced by its address), as
    /// URL=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,load=tcp://HOST:PORT][,dp-size=N]:
    /// `replay` its `replay_endpoint`, `load` where it publishes its load (SGLang's
    /// `--load-publish-endpoint`; in place of --kv-load-port). Data-parallel rank r
    /// publishes (and replays, and reports its load) on each PORT + r, for every rank of
    /// the engine (those given as URL@RANK or URL@FIRST-LAST, or N when more). Once per
    /// engine; repeatable for several.
    #[arg(long = "kv-events-endpoint", value_name = "URL=tcp://HOST:PORT", value_parser = parse_endpoint)]
    kv_events_endpoints: Vec<EngineEndpoint>,
    /// Every engine publishes its KV-cache events on its own host at this port (rank
    /// r at PORT + r), for engines without --kv-events-endpoint.
    #[arg(long, value_name = "PORT")]
    kv_events_port: Option<u16>,
    /// The engines' replay port (`replay_endpoint`, rank r at PORT + r), with
    /// --kv-events-port or a discovered endpoint: lost events are asked for again
    /// instead of dropping the engine's entries, and a proxy started late learns what
    /// the engines already hold.
    #[arg(long, value_name = "PORT")]
    kv_events_replay_port: Option<u16>,
    /// The engines' KV block size in tokens, for engines whose events have not told it
    /// yet (events carry it). At least 1.
    #[arg(long, value_name = "N", default_value_t = disagg_kvevents::index::DEFAULT_BLOCK_SIZE)]
    block_size: usize,
    /// Every engine publishes its load on its own host at this port (SGLang's
    /// `--load-publish-endpoint`; rank r at PORT + r), for engines without a `load=` in
    /// their --kv-events-endpoint: the policy then prices the work every router sent
    /// there, not only this proxy's.
    #[arg(long, value_name = "PORT")]
    kv_load_port: Option<u16>,
    /// The largest KV-event message an engine may send (its frames together, on the
    /// events and replay sockets), in bytes: a publisher sending a larger one is
    /// disconnected and counted (`disagg_kv_events_malformed_total{reason="oversized"}`).
    /// At least 1024. Raise it only for engines whose single steps store more than ~1M
    /// tokens.
    #[arg(long, value_name = "BYTES", default_value_t = disagg_kvevents::subscriber::DEFAULT_MAX_MESSAGE)]
    kv_events_max_message: usize,
    /// `kv_events`: what one uncached prompt token costs against one token of work
    /// queued on an engine. Above 1 a request stays longer with the engine that holds
    /// its prefix (a miss also costs the cache space its copy takes). Default: 2 when
    /// the engines' load reports are configured (--kv-load-port, `load=`), else 1.
    #[arg(long, value_name = "N")]
    kv_miss_weight: Option<u64>,
    /// The model's tokenizer, to tokenize prompts as the engine does: a directory with
    /// `tokenizer.json` (and `tokenizer_config.json` for the chat template, or
    /// `chat_template.jinja`, which takes priority), or a `tokenizer.json` file (its
    /// directory's `tokenizer_config.json`, `chat_template.jinja` and
    /// `additional_chat_templates/` are read too).
    #[arg(long, value_name = "PATH", conflicts_with = "tokenize")]
    tokenizer: Option<PathBuf>,
    /// The chat template file the engines were started with (vLLM's `--chat-template`),
    /// in place of the model's: --tokenizer renders chats with it, as the engines do.
    /// At most 16 MiB.
    #[arg(long, value_name = "PATH", requires = "tokenizer")]
    chat_template: Option<PathBuf>,
    /// How --tokenizer passes a message's content to the template, as the engines'
    /// `--chat-template-content-format`: `auto` (by the template: a list of parts when
    /// it loops over the content), `string` or `openai` (a list of parts).
    #[arg(long, value_enum, value_name = "FORMAT", requires = "tokenizer")]
    chat_template_content_format: Option<ContentFormatArg>,
    /// The engines' default chat template arguments (vLLM's
    /// `--default-chat-template-kwargs`), a JSON object; a request's own
    /// `chat_template_kwargs` override them.
    #[arg(long, value_name = "JSON", requires = "tokenizer")]
    default_chat_template_kwargs: Option<String>,
    /// Tokenize prompts through an engine's own `POST /tokenize` (one round trip per
    /// request; exact by construction).
    #[arg(long, value_enum)]
    tokenize: Option<TokenizeArg>,
    /// Seconds to wait for a request's token ids; past it the request is routed without
    /// them, and with --tokenize engine the engine asked counts as failed (passive
    /// health ejects an engine whose /tokenize keeps failing, as one whose legs do).
    #[arg(long, value_name = "SECS", default_value_t = 2.0)]
    tokenize_timeout: f64,
}

/// `--chat-template-content-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ContentFormatArg {
    /// By the template: a list of parts when it loops over a message's content.
    Auto,
    /// A string (text parts joined with newlines).
    String,
    /// A list of parts, as OpenAI's API writes them.
    Openai,
}

/// Where token ids come from, besides `--tokenizer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TokenizeArg {
    /// An engine's `POST /tokenize` (a prefill engine serving the model, in turn).
    Engine,
}

fn parse_endpoint(s: &str) -> Result<EngineEndpoint, String> {
    let mut e = EngineEndpoint::parse(s).map_err(|e| e.to_string())?;
    e.engine = e.engine.trim_end_matches('/').to_owned();
    Ok(e)
}

/// The `kv_events` policy's shared parts, built when a leg's policy is `kv_events`.
pub(crate) struct KvEvents {
    pub(crate) scorer: Arc<KvScorer>,
    pub(crate) subscriber: Arc<Subscriber>,
    args: KvEventsArgs,
}

impl KvEventsArgs {
    /// The flag that only the `kv_events` policy reads, if one was given: given
    /// without that policy it would be silently ignored, which hides a mistyped policy.
    pub(crate) fn needs_the_policy(&self) -> Option<&'static str> {
        if !self.kv_events_endpoints.is_empty() {
            Some("--kv-events-endpoint")
        } else if self.kv_events_port.is_some() {
            Some("--kv-events-port")
        } else if self.kv_events_replay_port.is_some() {
            Some("--kv-events-replay-port")
        } else if self.kv_load_port.is_some() {
            Some("--kv-load-port")
        } else if self.kv_miss_weight.is_some() {
            Some("--kv-miss-weight")
        } else if self.tokenizer.is_some() {
            // Token ids are asked for only by the policy's scorer.
            Some("--tokenizer")
        } else if self.tokenize.is_some() {
            Some("--tokenize")
        } else {
            None
        }
    }

    /// The scorer's miss weight: as given, or the default for whether the engines'
    /// load reports are configured.
    fn miss_weight(&self) -> u64 {
        let reports = self.kv_load_port.is_some()
            || self.kv_events_endpoints.iter().any(|e| e.load.is_some());
        self.kv_miss_weight.unwrap_or(if reports {
            disagg_kvevents::score::LOAD_REPORTS_MISS_WEIGHT
        } else {
            disagg_kvevents::score::DEFAULT_MISS_WEIGHT
        })
    }

    /// The time flags, by name, for the checks made before anything is built.
    pub(crate) fn time_flags(&self) -> [(&'static str, f64); 1] {
        [("tokenize-timeout", self.tokenize_timeout)]
    }

    /// The engine each `--kv-events-endpoint` names, as given (without a trailing `/`).
    pub(crate) fn endpoint_engines(&self) -> impl Iterator<Item = &str> {
        self.kv_events_endpoints.iter().map(|e| e.engine.as_str())
    }

    /// Every `tcp://HOST:PORT` the --kv-events-endpoint values name (publisher, replay
    /// and load sockets).
    pub(crate) fn addresses(&self) -> impl Iterator<Item = &str> {
        self.kv_events_endpoints.iter().flat_map(|e| {
            std::iter::once(e.publisher.as_str())
                .chain(e.replay.as_deref())
                .chain(e.load.as_deref())
        })
    }

    /// `--tokenize-timeout`.
    pub(crate) fn tokenize_timeout(&self) -> Result<std::time::Duration, BoxError> {
        crate::serve::secs(self.tokenize_timeout, "tokenize-timeout")
    }

    /// `hf` set to render chats as the engines were started to (`--chat-template`,
    /// `--chat-template-content-format`, `--default-chat-template-kwargs`).
    fn engine_render(&self, mut hf: HfTokenizer) -> Result<HfTokenizer, BoxError> {
        if let Some(path) = &self.chat_template {
            let bytes = disagg_files::read_regular_within(path, 16 * 1024 * 1024)
                .map_err(|e| format!("--chat-template {}: {e}", path.display()))?;
            let text = String::from_utf8(bytes)
                .map_err(|_| format!("--chat-template {}: not UTF-8", path.display()))?;
            hf = hf
                .with_chat_template(text)
                .map_err(|e| format!("--chat-template {}: {e}", path.display()))?;
        }
        if let Some(format) = self.chat_template_content_format {
            hf = hf.with_content_format(match format {
                ContentFormatArg::Auto => disagg_tokenize::hf::ContentFormat::Auto,
                ContentFormatArg::String => disagg_tokenize::hf::ContentFormat::String,
                ContentFormatArg::Openai => disagg_tokenize::hf::ContentFormat::OpenAi,
            });
        }
        if let Some(json) = &self.default_chat_template_kwargs {
            hf = hf
                .with_default_chat_template_kwargs(json)
                .map_err(|e| format!("--default-chat-template-kwargs: {e}"))?;
        }
        Ok(hf)
    }

    /// The tokenizer the flags ask for (`None`: neither flag).
    pub(crate) fn tokenizer(
        &self,
        source: Arc<dyn EndpointSource>,
        transport: HttpTransportConfig,
    ) -> Result<Option<Arc<dyn Tokenizer>>, BoxError> {
        if let Some(path) = &self.tokenizer {
            let hf = if path.is_dir() {
                HfTokenizer::from_dir(path)
            } else {
                // The file's directory is read as a model directory is: its config and
                // its standalone chat templates.
                HfTokenizer::from_tokenizer_file(path)
            }
            .map_err(|e| format!("--tokenizer {}: {e}", path.display()))?;
            let hf = self.engine_render(hf)?;
            return Ok(Some(Arc::new(hf)));
        }
        Ok(match self.tokenize {
            Some(TokenizeArg::Engine) => Some(Arc::new(SetTokenizer {
                source,
                transport: Arc::new(HttpTransport::new(transport)),
                next: AtomicUsize::new(0),
                blocking: BlockingLimit::default(),
            })),
            None => None,
        })
    }
}

impl KvEvents {
    /// The index, scorer and (not yet started) subscriber the flags describe.
    pub(crate) fn new(args: &KvEventsArgs) -> Result<KvEvents, BoxError> {
        if args.block_size == 0 {
            return Err("--block-size must be at least 1".into());
        }
        let index = Arc::new(KvIndex::new(IndexConfig {
            block_size: args.block_size,
            ..IndexConfig::default()
        }));
        let scorer = Arc::new(KvScorer::new(
            Arc::clone(&index),
            ScorerConfig {
                miss_weight: args.miss_weight(),
                ..ScorerConfig::default()
            },
        ));
        if args.kv_events_max_message < 1024 {
            return Err("--kv-events-max-message must be at least 1024".into());
        }
        let subscriber = Arc::new(Subscriber::new(
            index,
            SubscriberConfig {
                max_message: args.kv_events_max_message,
                ..SubscriberConfig::default()
            },
        ));
        Ok(KvEvents {
            scorer,
            subscriber,
            args: args.clone(),
        })
    }

    /// Where each engine of `set` publishes, by the flags and the endpoints' own
    /// discovered KV-events endpoints; an engine whose publishers cannot be named (a
    /// rank's port past 65535) is logged and left out.
    pub(crate) fn engine_endpoints(&self, set: &EndpointSet) -> Vec<EngineEndpoint> {
        let engines = set
            .by_role(Role::Prefill)
            .iter()
            .chain(set.by_role(Role::Decode));
        let (found, refused) = self.engine_endpoints_checked(engines.map(|e| &**e));
        for (engine, e) in refused {
            tracing::warn!(%engine, error = %e, "no KV-events subscription");
        }
        found
    }

    /// The engines given on the command line (`--prefill`, `--decode`; discovery on or
    /// not) must each have their publishers named: an engine whose rank ports go past
    /// 65535 stops the proxy at start rather than never being subscribed to.
    pub(crate) fn check_fixed<'a>(
        &self,
        given: impl IntoIterator<Item = &'a Endpoint>,
    ) -> Result<(), BoxError> {
        let engines = given
            .into_iter()
            .filter(|e| matches!(e.role(), Role::Prefill | Role::Decode));
        match self.engine_endpoints_checked(engines).1.into_iter().next() {
            Some((engine, e)) => {
                Err(format!("the kv_events policy cannot subscribe to {engine}: {e}").into())
            }
            None => Ok(()),
        }
    }

    /// [`engine_endpoints`](Self::engine_endpoints), with the engines left out and why.
    fn engine_endpoints_checked<'a>(
        &self,
        engines: impl IntoIterator<Item = &'a Endpoint>,
    ) -> (
        Vec<EngineEndpoint>,
        Vec<(String, disagg_kvevents::EndpointError)>,
    ) {
        // Engines by base URL, with their ranks' count (rank r of an engine run as
        // `URL@r` publishes on the port plus r).
        let mut by_base: BTreeMap<String, (u32, &Endpoint)> = BTreeMap::new();
        for ep in engines {
            let id = ep.id().as_str();
            let base = match ep.rank() {
                Some(_) => id.rsplit_once('@').map_or(id, |(b, _)| b),
                None => id,
            };
            let ranks = ep.rank().map_or(1, |r| r.saturating_add(1));
            let entry = by_base.entry(base.to_owned()).or_insert((ranks, ep));
            entry.0 = entry.0.max(ranks);
        }
        let a = &self.args;
        let mut out = Vec::with_capacity(by_base.len());
        let mut refused = Vec::new();
        for (base, (ranks, ep)) in by_base {
            let found = if let Some(e) = a.kv_events_endpoints.iter().find(|e| e.engine == base) {
                // Rank r publishes at the flag's port plus r, as with the other sources:
                // the engine's ranks counted, or the flag's `dp-size` when larger.
                let dp_size = e.dp_size.max(ranks);
                e.clone().with_dp_size(dp_size).map(Some)
            } else if let Some(d) = ep.ext().get::<disagg_discovery::KvEventsEndpoint>() {
                discovered(&base, &d.0, a.kv_events_replay_port, ranks).map(Some)
            } else if let Some(port) = a.kv_events_port {
                EngineEndpoint::on_engine_host(&base, port, a.kv_events_replay_port)
                    .and_then(|e| e.with_dp_size(ranks))
                    .map(Some)
            } else {
                Ok(None)
            };
            // The load reports' port, for an endpoint that names none.
            let found = found.and_then(|e| match (e, a.kv_load_port) {
                (Some(e), Some(port)) if e.load.is_none() => load_on_engine_host(e, port),
                (e, _) => Ok(e),
            });
            match found {
                Ok(Some(e)) => out.push(e),
                Ok(None) => {}
                Err(e) => refused.push((base, e)),
            }
        }
        (out, refused)
    }

    /// Subscribe on a thread of its own and follow `follow`'s set until `shutdown`.
    pub(crate) fn start(
        &self,
        follow: Arc<dyn EndpointSource>,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> Result<std::thread::JoinHandle<()>, BoxError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let this = KvEvents {
            scorer: Arc::clone(&self.scorer),
            subscriber: Arc::clone(&self.subscriber),
            args: self.args.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("disagg-kv-events".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let mut sets = follow.watch();
                    loop {
                        let set = sets.borrow_and_update().clone();
                        // The scorer's history follows the set: an engine gone from
                        // it (not one ejected for a while: this is the set before
                        // health) leaves nothing behind.
                        this.scorer.retain(
                            set.by_role(Role::Prefill)
                                .iter()
                                .chain(set.by_role(Role::Decode))
                                .map(|e| disagg_kvevents::policy::candidate(e)),
                        );
                        let engines = this.engine_endpoints(&set);
                        tracing::info!(engines = engines.len(), "KV events: subscribing");
                        this.subscriber.set_endpoints(engines).await;
                        // Not held while waiting: the endpoints that leave at the next
                        // change are let go of with it.
                        drop(set);
                        tokio::select! {
                            changed = sets.changed() => if changed.is_err() { break },
                            _ = shutdown.wait_for(|stop| *stop) => break,
                        }
                    }
                    // Unsubscribe here, on the runtime the tasks run on.
                    this.subscriber.set_endpoints(Vec::new()).await;
                })
            })?;
        Ok(thread)
    }

    /// `GET /metrics`: the subscriptions' counters and the index's size, read at each
    /// scrape (the tokenizing counts are the orchestrator's, in its own collector).
    pub(crate) fn metrics(&self) -> ExtraMetrics {
        let subscriber = Arc::clone(&self.subscriber);
        let scorer = Arc::clone(&self.scorer);
        ExtraMetrics::new(move |registry| {
            registry.register_collector(Box::new(KvEventsCollector(
                Arc::clone(&subscriber),
                Arc::clone(&scorer),
            )));
        })
    }
}

/// `e` with its load reports on its engine's host at `port` (ranks at the ports after).
fn load_on_engine_host(
    e: EngineEndpoint,
    port: u16,
) -> Result<Option<EngineEndpoint>, disagg_kvevents::EndpointError> {
    let host = EngineEndpoint::on_engine_host(&e.engine, port, None)?.publisher;
    let dp_size = e.dp_size;
    e.with_load(host)?.with_dp_size(dp_size).map(Some)
}

/// [`KvEvents::metrics`]' collector: the subscriber's counters summed over the engine
/// ranks, and the index's size.
///
/// | metric | type | meaning |
/// |---|---|---|
/// | `disagg_kv_events_ranks_connected` | gauge | engine ranks whose subscription is connected |
/// | `disagg_kv_events_batches_total` | counter | batches applied to the index (replayed ones included) |
/// | `disagg_kv_events_gaps_total` | counter | sequence gaps seen |
/// | `disagg_kv_events_replayed_total` | counter | batches recovered from the replay sockets |
/// | `disagg_kv_events_replay_failures_total` | counter | replays that failed or could not cover a gap |
/// | `disagg_kv_events_drops_total` | counter | times a rank's entries were dropped (a gap without replay, a failed replay, a restart, a bad message, a publisher gone past the grace) |
/// | `disagg_kv_events_expiries_total` | counter | times a rank's entries were dropped because it stayed without a subscription past `disconnected_grace` (counted in drops too) |
/// | `disagg_kv_events_skipped_blocks_total` | counter | stored blocks the index did not index (LoRA or salted hash, another KV-cache group or block size, an unknown parent) |
/// | `disagg_kv_events_resubscribes_total` | counter | subscriptions renewed after silence or an error |
/// | `disagg_kv_events_index_blocks` | gauge | blocks the index holds, over all engines |
/// | `disagg_kv_events_replays_skipped_total` | counter | gaps not replayed because the rank's replays were backing off after failures |
/// | `disagg_kv_events_panics_total` | counter | subscription tasks that panicked (each restarted after a pause) |
/// | `disagg_kv_events_malformed_total{engine,rank,socket,reason}` | counter | messages and connections refused: `socket` `events`, `replay` or `load`; `reason` `oversized` (over a ceiling: disconnected), `protocol` (not ZMTP: disconnected), `shape` (not `[topic, seq, payload]`), `undecodable`, `timeout` (a peer silent in its handshake) |
/// | `disagg_kv_scorer_candidates` | gauge | engines (or ranks) the scorer keeps a history of its picks for: at most the followed set's |
struct KvEventsCollector(Arc<Subscriber>, Arc<KvScorer>);

impl std::fmt::Debug for KvEventsCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvEventsCollector").finish_non_exhaustive()
    }
}

impl prometheus_client::collector::Collector for KvEventsCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::MetricType;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        let ranks = self.0.status();
        let sum = |f: fn(&disagg_kvevents::RankStatus) -> u64| ranks.iter().map(f).sum::<u64>();
        // (name, help, gauge, value); counters are named without `_total`: the encoders
        // append it.
        let rows: [(&str, &str, bool, u64); 12] = [
            (
                "disagg_kv_events_ranks_connected",
                "Engine ranks whose KV-event subscription is connected.",
                true,
                ranks.iter().filter(|r| r.connected).count() as u64,
            ),
            (
                "disagg_kv_events_batches",
                "KV-event batches applied to the index (replayed ones included).",
                false,
                sum(|r| r.batches),
            ),
            (
                "disagg_kv_events_gaps",
                "Sequence gaps seen in the engines' KV events.",
                false,
                sum(|r| r.gaps),
            ),
            (
                "disagg_kv_events_replayed",
                "KV-event batches recovered from the engines' replay sockets.",
                false,
                sum(|r| r.replayed),
            ),
            (
                "disagg_kv_events_replay_failures",
                "Replays that failed or could not cover a gap.",
                false,
                sum(|r| r.replay_failures),
            ),
            (
                "disagg_kv_events_drops",
                "Times an engine rank's index entries were dropped (a gap without replay, a failed replay, a restart, a bad message, a publisher gone past the grace).",
                false,
                sum(|r| r.drops),
            ),
            (
                "disagg_kv_events_expiries",
                "Times an engine rank's index entries were dropped because it stayed without a KV-event subscription past the grace.",
                false,
                sum(|r| r.expiries),
            ),
            (
                "disagg_kv_events_skipped_blocks",
                "Stored blocks the KV-event index did not index (LoRA or salted hash, another KV-cache group or block size, an unknown parent).",
                false,
                sum(|r| r.skipped_blocks),
            ),
            (
                "disagg_kv_events_resubscribes",
                "KV-event subscriptions renewed after silence or a receive error.",
                false,
                sum(|r| r.resubscribes),
            ),
            (
                "disagg_kv_events_load_reports",
                "Load reports received from the engines (SGLang's load publisher).",
                false,
                sum(|r| r.load_reports),
            ),
            (
                "disagg_kv_events_load_decode_errors",
                "Load reports from the engines that could not be decoded.",
                false,
                sum(|r| r.load_decode_errors),
            ),
            (
                "disagg_kv_events_index_blocks",
                "Blocks the KV-event index holds, over all engines.",
                true,
                self.0.index().stats().blocks as u64,
            ),
        ];
        let extra: [(&str, &str, bool, u64); 3] = [
            (
                "disagg_kv_events_replays_skipped",
                "Sequence gaps not replayed because the rank's replays were backing off after failures.",
                false,
                sum(|r| r.replays_skipped),
            ),
            (
                "disagg_kv_events_panics",
                "KV-event subscription tasks that panicked (each restarted after a pause).",
                false,
                sum(|r| r.panics),
            ),
            (
                "disagg_kv_scorer_candidates",
                "Engines (or ranks) the kv_events scorer keeps a history of its picks for.",
                true,
                self.1.known() as u64,
            ),
        ];
        for (name, help, gauge, value) in rows.into_iter().chain(extra) {
            if gauge {
                let metric = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
                metric.encode(encoder.encode_descriptor(name, help, None, MetricType::Gauge)?)?;
            } else {
                let metric = ConstCounter::new(value);
                metric.encode(encoder.encode_descriptor(
                    name,
                    help,
                    None,
                    MetricType::Counter,
                )?)?;
            }
        }
        let mut malformed = encoder.encode_descriptor(
            "disagg_kv_events_malformed",
            "KV-event, replay and load messages or connections refused, by engine, rank, socket and reason.",
            None,
            MetricType::Counter,
        )?;
        for r in &ranks {
            let rank = r.dp_rank.to_string();
            for ((socket, reason), n) in &r.malformed {
                let labels = [
                    ("engine", r.engine.as_str()),
                    ("rank", rank.as_str()),
                    ("socket", socket.as_str()),
                    ("reason", reason.as_str()),
                ];
                ConstCounter::new(*n).encode(malformed.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

/// A set that never changes (the `--prefill` / `--decode` engines), as a source the
/// subscriber can follow like a discovered one.
pub(crate) struct Fixed(tokio::sync::watch::Sender<Arc<EndpointSet>>);

impl Fixed {
    pub(crate) fn new(set: Arc<EndpointSet>) -> Self {
        Fixed(tokio::sync::watch::Sender::new(set))
    }
}

impl EndpointSource for Fixed {
    fn watch(&self) -> tokio::sync::watch::Receiver<Arc<EndpointSet>> {
        self.0.subscribe()
    }
}

/// A discovered publisher `tcp://HOST:PORT`, with the replay port on the same host.
fn discovered(
    base: &str,
    publisher: &str,
    replay_port: Option<u16>,
    ranks: u32,
) -> Result<EngineEndpoint, disagg_kvevents::EndpointError> {
    let mut e = EngineEndpoint::new(base, publisher)?;
    if let (Some(port), Some((host, _))) = (replay_port, publisher.rsplit_once(':')) {
        e = e.with_replay(format!("{host}:{port}"))?;
    }
    e.with_dp_size(ranks)
}

/// `--tokenize engine`: the `/tokenize` of an engine serving the request's model,
/// prefill engines in turn (they compute prompts anyway), else decode engines.
struct SetTokenizer {
    source: Arc<dyn EndpointSource>,
    transport: Arc<dyn Transport>,
    next: AtomicUsize,
    /// The one limit on the blocking pool's work every engine tokenizer made here
    /// shares (a tokenizer is made per request: each would have a limit of its own).
    blocking: BlockingLimit,
}

#[async_trait]
impl Tokenizer for SetTokenizer {
    async fn token_ids(&self, api: Api, body: &JsonBody) -> Result<Option<TokenIds>, CoreBoxError> {
        self.token_ids_asking(api, body, &mut Asked::default())
            .await
    }

    /// The engine picked is named to the orchestrator, which counts a failed or
    /// unanswered `/tokenize` against it: passive health ejects a hung engine, and the
    /// set picked from (the health source's) leaves it out.
    async fn token_ids_asking(
        &self,
        api: Api,
        body: &JsonBody,
        asked: &mut Asked,
    ) -> Result<Option<TokenIds>, CoreBoxError> {
        let model = body
            .get("model")
            .and_then(|v| serde_json::from_slice::<String>(v).ok());
        let endpoint = {
            let set = self.source.snapshot();
            let set = set.for_model(model.as_deref())?;
            let pool = match set.by_role(Role::Prefill) {
                [] => set.by_role(Role::Decode),
                p => p,
            };
            match pool {
                [] => return Err("no engine to tokenize with".into()),
                p => Arc::clone(&p[self.next.fetch_add(1, Ordering::Relaxed) % p.len()]),
            }
        };
        EngineTokenizer::new(Arc::clone(&self.transport), endpoint)
            .with_blocking_limit(self.blocking.clone())
            .token_ids_asking(api, body, asked)
            .await
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        kv: KvEventsArgs,
    }

    fn kv(flags: &[&str]) -> KvEvents {
        let cli = Cli::try_parse_from(std::iter::once("x").chain(flags.iter().copied())).unwrap();
        KvEvents::new(&cli.kv).unwrap()
    }

    fn set() -> EndpointSet {
        let mut discovered = http::Extensions::new();
        discovered.insert(disagg_discovery::KvEventsEndpoint(
            "tcp://10.0.0.9:6000".into(),
        ));
        let eps = [
            Endpoint::new("http://10.0.0.1:8000", Role::Prefill).unwrap(),
            Endpoint::new("http://10.0.0.2:8000@0", Role::Decode).unwrap(),
            Endpoint::new("http://10.0.0.2:8000@1", Role::Decode).unwrap(),
            Endpoint::with_extensions("http://10.0.0.9:8000", Role::Decode, discovered).unwrap(),
        ];
        EndpointSet::new(eps.into_iter().map(Arc::new))
    }

    #[test]
    fn publishers_come_from_flags_then_discovery_then_the_engines_host() {
        let kv = kv(&[
            "--kv-events-port",
            "5557",
            "--kv-events-replay-port",
            "5600",
            "--kv-events-endpoint",
            "http://10.0.0.1:8000/=tcp://10.0.0.7:7000",
        ]);
        let got = kv.engine_endpoints(&set());
        let find = |engine: &str| got.iter().find(|e| e.engine == engine).unwrap();
        // The flag wins over --kv-events-port, and carries no replay of its own.
        let p = find("http://10.0.0.1:8000");
        assert_eq!(
            (p.publisher.as_str(), p.replay.as_deref()),
            ("tcp://10.0.0.7:7000", None)
        );
        // Two rank endpoints: one engine with two ranks on the engine's host.
        let d = find("http://10.0.0.2:8000");
        assert_eq!(d.dp_size, 2);
        assert_eq!(d.publisher_of(1), "tcp://10.0.0.2:5558");
        assert_eq!(d.replay_of(1).as_deref(), Some("tcp://10.0.0.2:5601"));
        // A discovered publisher, the replay port on its host.
        let x = find("http://10.0.0.9:8000");
        assert_eq!(x.publisher, "tcp://10.0.0.9:6000");
        assert_eq!(x.replay.as_deref(), Some("tcp://10.0.0.9:5600"));
        assert_eq!(got.len(), 3);
    }

    #[test]
    fn load_reports_come_from_the_endpoint_flag_then_the_engines_host() {
        let kv = kv(&[
            "--kv-events-port",
            "5557",
            "--kv-load-port",
            "5900",
            "--kv-events-endpoint",
            "http://10.0.0.1:8000=tcp://10.0.0.7:7000,load=tcp://10.0.0.7:7100",
        ]);
        let got = kv.engine_endpoints(&set());
        let find = |engine: &str| got.iter().find(|e| e.engine == engine).unwrap();
        assert_eq!(
            find("http://10.0.0.1:8000").load.as_deref(),
            Some("tcp://10.0.0.7:7100")
        );
        // Ranks report on the ports after the engine host's load port.
        let d = find("http://10.0.0.2:8000");
        assert_eq!(d.load_of(1).as_deref(), Some("tcp://10.0.0.2:5901"));
        assert_eq!(
            find("http://10.0.0.9:8000").load.as_deref(),
            Some("tcp://10.0.0.9:5900")
        );
        // With load reports the miss weight defaults to 2; without, to 1; given, as given.
        assert_eq!(kv.scorer.config().miss_weight, 2);
        assert_eq!(kv_default_weight(&["--kv-events-port", "5557"]), 1);
        assert_eq!(
            kv_default_weight(&["--kv-load-port", "5900", "--kv-miss-weight", "3"]),
            3
        );
    }

    fn kv_default_weight(flags: &[&str]) -> u64 {
        kv(flags).scorer.config().miss_weight
    }

    #[test]
    fn an_endpoint_flag_covers_every_rank_of_its_engine() {
        // `http://10.0.0.2:8000` runs ranks 0 and 1: rank 1 publishes at the port plus 1,
        // as with --kv-events-port and discovered endpoints.
        let flagged = kv(&[
            "--kv-events-endpoint",
            "http://10.0.0.2:8000=tcp://10.0.0.2:7000,replay=tcp://10.0.0.2:7100",
            "--kv-events-endpoint",
            "http://10.0.0.1:8000=tcp://10.0.0.1:7000,dp-size=4",
        ]);
        let got = flagged.engine_endpoints(&set());
        let find = |engine: &str| got.iter().find(|e| e.engine == engine).unwrap();
        let d = find("http://10.0.0.2:8000");
        assert_eq!(d.dp_size, 2);
        assert_eq!(d.publisher_of(1), "tcp://10.0.0.2:7001");
        assert_eq!(d.replay_of(1).as_deref(), Some("tcp://10.0.0.2:7101"));
        // A larger `dp-size` the flag gives is kept.
        assert_eq!(find("http://10.0.0.1:8000").dp_size, 4);
        // Ports past 65535 for the engine's ranks: left out, and refused for a fixed set.
        let past = kv(&[
            "--kv-events-endpoint",
            "http://10.0.0.2:8000=tcp://10.0.0.2:65535",
        ]);
        let engines: Vec<String> = past
            .engine_endpoints(&set())
            .into_iter()
            .map(|e| e.engine)
            .collect();
        assert_eq!(engines, ["http://10.0.0.9:8000"]);
        let given = set();
        let err = past
            .check_fixed(given.iter().map(|e| &**e))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("cannot subscribe to http://10.0.0.2:8000: port 65535 plus 2 ranks"),
            "{err}"
        );
    }

    /// `--tokenizer` naming a `tokenizer.json` file reads its directory as a model
    /// directory is read: `chat_template.jinja` beside it takes priority over the
    /// config's template (as in transformers 5), as it does with `--tokenizer DIR`.
    #[tokio::test]
    async fn a_tokenizer_file_brings_its_directorys_chat_template() {
        let dir =
            std::env::temp_dir().join(format!("disagg-proxy-kv-tokenizer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let tokenizer = r#"{
          "version": "1.0", "truncation": null, "padding": null, "normalizer": null,
          "added_tokens": [], "pre_tokenizer": {"type": "Whitespace"},
          "post_processor": null, "decoder": null,
          "model": {"type": "WordLevel", "unk_token": "<unk>",
                    "vocab": {"<unk>": 0, "config": 1, "file": 2, "hello": 3}}
        }"#;
        std::fs::write(dir.join("tokenizer.json"), tokenizer).unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"chat_template": "config {% for m in messages %}{{ m.content }}{% endfor %}"}"#,
        )
        .unwrap();
        std::fs::write(
            dir.join("chat_template.jinja"),
            "file {% for m in messages %}{{ m.content }}{% endfor %}",
        )
        .unwrap();
        let body = JsonBody::parse(br#"{"messages":[{"role":"user","content":"hello"}]}"#).unwrap();
        for path in [dir.clone(), dir.join("tokenizer.json")] {
            let cli = Cli::try_parse_from(["x", "--tokenizer", path.to_str().unwrap()]).unwrap();
            let source: Arc<dyn EndpointSource> =
                Arc::new(disagg_core::source::StaticSource::new([]));
            let tokenizer = cli
                .kv
                .tokenizer(source, HttpTransportConfig::default())
                .unwrap()
                .unwrap();
            let ids = tokenizer
                .token_ids(Api::Chat, &body)
                .await
                .unwrap()
                .unwrap();
            assert_eq!(&ids[..], [2, 3], "{}", path.display());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The engines' own render settings reach the proxy's tokenizer: a chat template
    /// file in place of the model's, the default template arguments, the content
    /// format; and none of them is taken without --tokenizer (nothing would read it).
    #[tokio::test]
    async fn the_engines_render_flags_set_the_tokenizers_render() {
        let dir = std::env::temp_dir().join(format!(
            "disagg-proxy-kv-render-flags-{}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let tokenizer = r#"{
          "version": "1.0", "truncation": null, "padding": null, "normalizer": null,
          "added_tokens": [], "pre_tokenizer": {"type": "Whitespace"},
          "post_processor": null, "decoder": null,
          "model": {"type": "WordLevel", "unk_token": "<unk>",
                    "vocab": {"<unk>": 0, "config": 1, "file": 2, "hello": 3, "on": 4,
                              "a": 5, "b": 6}}
        }"#;
        std::fs::write(dir.join("tokenizer.json"), tokenizer).unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"chat_template": "config {% for m in messages %}{{ m.content }}{% endfor %}"}"#,
        )
        .unwrap();
        let engines = dir.join("engines.jinja");
        std::fs::write(
            &engines,
            "file {% if flag %}on {% endif %}{% for m in messages %}             {% if m.content is string %}{{ m.content }}             {% else %}{% for p in m.content %}config {{ p.text }} {% endfor %}{% endif %}             {% endfor %}",
        )
        .unwrap();
        let ids = |args: &[&str], body: &'static [u8]| {
            let mut argv = vec!["x", "--tokenizer", dir.to_str().unwrap()];
            argv.extend_from_slice(args);
            let cli = Cli::try_parse_from(argv).unwrap();
            let source: Arc<dyn EndpointSource> =
                Arc::new(disagg_core::source::StaticSource::new([]));
            let tokenizer = cli
                .kv
                .tokenizer(source, HttpTransportConfig::default())
                .unwrap()
                .unwrap();
            async move {
                let body = JsonBody::parse(body).unwrap();
                tokenizer
                    .token_ids(Api::Chat, &body)
                    .await
                    .unwrap()
                    .unwrap()
                    .to_vec()
            }
        };
        let hello: &[u8] = br#"{"messages":[{"role":"user","content":"hello"}]}"#;
        assert_eq!(ids(&[], hello).await, [1, 3], "the model's own template");
        let template = engines.to_str().unwrap();
        // `auto`: this template loops over a message's content, so the content is a
        // list of parts to it, as vLLM decides.
        assert_eq!(ids(&["--chat-template", template], hello).await, [2, 1, 3]);
        let flag = [
            "--chat-template",
            template,
            "--default-chat-template-kwargs",
            r#"{"flag":true}"#,
        ];
        assert_eq!(ids(&flag, hello).await, [2, 4, 1, 3]);
        // Two text parts: a list to the template in `openai`, joined text in `string`.
        let parts: &[u8] = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#;
        let openai = [
            "--chat-template",
            template,
            "--chat-template-content-format",
            "openai",
        ];
        assert_eq!(ids(&openai, parts).await, [2, 1, 5, 1, 6]);
        let string = [
            "--chat-template",
            template,
            "--chat-template-content-format",
            "string",
        ];
        assert_eq!(ids(&string, parts).await, [2, 5, 6]);
        // Nothing reads them without --tokenizer.
        for flag in [
            vec!["x", "--chat-template", template],
            vec!["x", "--chat-template-content-format", "string"],
            vec!["x", "--default-chat-template-kwargs", "{}"],
        ] {
            assert!(Cli::try_parse_from(&flag).is_err(), "{flag:?}");
        }
        // A template file that is not there, or kwargs that are no object, stop the start.
        let missing = Cli::try_parse_from([
            "x",
            "--tokenizer",
            dir.to_str().unwrap(),
            "--chat-template",
            "/nonexistent/t.jinja",
        ])
        .unwrap();
        let source: Arc<dyn EndpointSource> = Arc::new(disagg_core::source::StaticSource::new([]));
        let err = missing
            .kv
            .tokenizer(Arc::clone(&source), HttpTransportConfig::default())
            .err()
            .unwrap();
        assert!(err.to_string().contains("--chat-template"), "{err}");
        let bad = Cli::try_parse_from([
            "x",
            "--tokenizer",
            dir.to_str().unwrap(),
            "--default-chat-template-kwargs",
            "[1]",
        ])
        .unwrap();
        let err = bad
            .kv
            .tokenizer(source, HttpTransportConfig::default())
            .err()
            .unwrap();
        assert!(
            err.to_string().contains("--default-chat-template-kwargs"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn engines_without_a_known_publisher_are_not_subscribed() {
        let got = kv(&[]).engine_endpoints(&set());
        let engines: Vec<&str> = got.iter().map(|e| e.engine.as_str()).collect();
        assert_eq!(engines, ["http://10.0.0.9:8000"]);
    }
}
