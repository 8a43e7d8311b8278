//! The engine protocols the proxy speaks, wired from their flags: the connector
//! `--connector` names, and LMCache's notification listener with its thread.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use disagg_connectors::lmcache::{Lmcache, Notifications, NotifyConfig};
use disagg_connectors::sglang::SglangBootstrap;
use disagg_connectors::vllm::VllmMooncake;
use disagg_connectors::vllm::VllmNixl;
use disagg_connectors::vllm::bidi::BidiStore;
use disagg_connectors::vllm::rewrite::PrefillRewriter;
use disagg_connectors::vllm::rewrite::check::VllmLimits;
use disagg_connectors::vllm::{PromptTokenReuse, ReuseStats};
use disagg_core::KvConnector;

use crate::BoxError;

use super::flags::{ConnectorArg, LmcacheArgs, ReuseArg, ServeArgs, secs};

impl ConnectorArg {
    /// The protocol's name, as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ConnectorArg::Nixl => "nixl",
            ConnectorArg::Sglang => "sglang",
            ConnectorArg::Mooncake => "mooncake",
            ConnectorArg::Lmcache => "lmcache",
        }
    }

    /// The connector; LMCache's waits on `notifications`, which it needs. NIXL's
    /// prompt-token reuse is `reuse`, counted in `stats`; NIXL keeps the decodes' own
    /// handoffs in `bidi` when given one.
    ///
    /// # Errors
    ///
    /// LMCache without a notification listener.
    pub fn connector(
        self,
        notifications: Option<Notifications>,
        limits: VllmLimits,
        (reuse, stats): (ReuseArg, Arc<ReuseStats>),
        bidi: Option<Arc<BidiStore>>,
        context_probe: Duration,
    ) -> Result<Arc<dyn KvConnector>, BoxError> {
        let rewriter = PrefillRewriter::new().with_limits(limits);
        let reuse = match reuse {
            ReuseArg::Auto => PromptTokenReuse::Auto,
            ReuseArg::On => PromptTokenReuse::On,
            ReuseArg::Off => PromptTokenReuse::Off,
        };
        Ok(match self {
            ConnectorArg::Nixl => {
                let nixl = VllmNixl::with_rewriter(rewriter).with_prompt_token_reuse(reuse, stats);
                Arc::new(match bidi {
                    Some(store) => nixl.with_bidirectional(store),
                    None => nixl,
                })
            }
            ConnectorArg::Sglang => Arc::new(SglangBootstrap::new()),
            ConnectorArg::Mooncake => Arc::new(VllmMooncake::new().with_rewriter(rewriter)),
            ConnectorArg::Lmcache => Arc::new(
                Lmcache::new(
                    notifications.ok_or("the lmcache connector needs its notification listener")?,
                )
                .with_limits(limits)
                .with_context_probe_timeout(context_probe),
            ),
        })
    }
}

/// `--lmcache-notify`, or port 7500 on `--listen`'s host: the socket has no credential,
/// so it is not opened on every interface unless asked for.
pub(super) fn notify_address(args: &LmcacheArgs, listen: SocketAddr) -> String {
    args.lmcache_notify
        .clone()
        .unwrap_or_else(|| SocketAddr::new(listen.ip(), 7500).to_string())
}

/// What an unset `--lmcache-notify-ttl` adds to `--prefill-timeout` plus
/// `--handoff-timeout` ([`notify_ttl`]): room for the steps between them that have no
/// budget of their own and await nothing (the end of the plan's resolution, the fold
/// of the prefill's answer), so a registration is never evicted from a request still
/// within its budgets.
const NOTIFY_TTL_MARGIN: Duration = Duration::from_secs(10);

/// How long LMCache's notification registry keeps a request's registration
/// (`NotifyConfig::ttl`): `--lmcache-notify-ttl` as given, or else `--prefill-timeout`
/// plus `--handoff-timeout` plus [`NOTIFY_TTL_MARGIN`] (320 s with their defaults).
///
/// The connector registers a request as its plan's resolution ends, before the
/// prefill leg is sent, and the decode leg waits for the notifications once the prefill
/// answered, within the handoff budget: the registration is waited on for up to the
/// prefill's budget and one handoff budget after it was made. A TTL shorter than their
/// sum evicts it from a request still within its budgets, which then fails (`NotReady`,
/// no engine blamed) though nothing went wrong. A mid-stream migration's continuation
/// through a fresh prefill registers anew, under the same budgets (and is cut at one
/// decode head timeout from the break): no registration is waited on longer. A 0
/// budget is a step given no time (it fails at once), not "no limit": the sum is
/// bounded whatever the flags, at least the margin.
///
/// # Errors
///
/// A TTL or budget that is no duration ([`secs`]), or a TTL given shorter than the
/// sum of the budgets (refused at start whatever the connector, as the time flags are).
pub(super) fn notify_ttl(args: &ServeArgs) -> Result<Duration, BoxError> {
    let prefill = secs(args.prefill_timeout, "prefill-timeout")?;
    let handoff = secs(args.reliability.handoff_timeout, "handoff-timeout")?;
    // Each at most 10^9 s: the sum cannot overflow.
    let budgets = prefill + handoff;
    let Some(given) = args.lmcache.lmcache_notify_ttl else {
        return Ok(budgets + NOTIFY_TTL_MARGIN);
    };
    let ttl = secs(given, "lmcache-notify-ttl")?;
    if ttl < budgets {
        return Err(format!(
            "--lmcache-notify-ttl ({given} s) is shorter than --prefill-timeout ({} s) plus \
             --handoff-timeout ({} s): a request's LMCache registration would be forgotten \
             while it still waits within them, and the request fail; give at least {} s, or \
             leave it unset ({} s, their sum plus {} s)",
            prefill.as_secs_f64(),
            handoff.as_secs_f64(),
            budgets.as_secs_f64(),
            (budgets + NOTIFY_TTL_MARGIN).as_secs_f64(),
            NOTIFY_TTL_MARGIN.as_secs(),
        )
        .into());
    }
    Ok(ttl)
}

/// Binds LMCache's notification socket on a thread of its own, which runs the socket
/// until `stop` turns `true` or its sender is dropped. Not the proxy's shutdown signal:
/// requests draining after it still wait for their notifications here, so `run` stops
/// the listener only once the serving threads have returned.
pub(super) fn lmcache_listener(
    args: &LmcacheArgs,
    ttl: Duration,
    listen: SocketAddr,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(Notifications, std::thread::JoinHandle<()>), BoxError> {
    let notify = notify_address(args, listen);
    let config = NotifyConfig {
        ttl,
        ..NotifyConfig::default()
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let notifications = runtime
        .block_on(Notifications::bind(&notify, config))
        .map_err(|e| format!("--lmcache-notify {notify}: {e}"))?;
    if let Some(addr) = notifications.local_addr() {
        tracing::info!(%addr, "LMCache notifications listening");
    }
    let thread = std::thread::Builder::new()
        .name("disagg-lmcache".into())
        .spawn(move || {
            runtime.block_on(async move {
                while !*stop.borrow_and_update() {
                    if stop.changed().await.is_err() {
                        break;
                    }
                }
            })
        })?;
    Ok((notifications, thread))
}

/// NIXL's prompt-token reuse counters on `/metrics`.
pub(super) fn reuse_metrics(stats: Arc<ReuseStats>) -> disagg_http::metrics::ExtraMetrics {
    disagg_http::metrics::ExtraMetrics::new(move |registry| {
        registry.register_collector(Box::new(ReuseCollector(Arc::clone(&stats))));
    })
}

/// [`reuse_metrics`]' collector: the counters, read at each scrape.
#[derive(Debug)]
struct ReuseCollector(Arc<ReuseStats>);

impl prometheus_client::collector::Collector for ReuseCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> std::fmt::Result {
        crate::observe::encode_counters(
            &mut encoder,
            &[
                (
                    "disagg_prompt_token_reuse_sent",
                    "Decode legs sent with the prefill's prompt token ids (vLLM prompt-token reuse).",
                    self.0.sent(),
                ),
                (
                    "disagg_prompt_token_reuse_refused",
                    "Prefill answers whose prompt_token_ids were malformed or over the ceiling, dropped (the decode tokenized).",
                    self.0.refused(),
                ),
            ],
        )
    }
}

/// The encoder stage's counters on `GET /metrics` (E/P/D, `--encode`).
pub(super) fn encode_metrics(
    stage: Arc<disagg_core::encode::EncodeStage>,
) -> disagg_http::metrics::ExtraMetrics {
    disagg_http::metrics::ExtraMetrics::new(move |registry| {
        registry.register_collector(Box::new(EncodeCollector(Arc::clone(&stage))));
    })
}

/// [`encode_metrics`]' collector: the stage's counters, read at each scrape.
#[derive(Debug)]
struct EncodeCollector(Arc<disagg_core::encode::EncodeStage>);

impl prometheus_client::collector::Collector for EncodeCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> std::fmt::Result {
        let s = self.0.stats();
        {
            use prometheus_client::encoding::EncodeMetric;
            let gauge = prometheus_client::metrics::gauge::ConstGauge::new(
                i64::try_from(s.ejected).unwrap_or(i64::MAX),
            );
            let metric = encoder.encode_descriptor(
                "disagg_encode_ejected",
                "Encoders passed over now because their last leg failed (passive health).",
                None,
                gauge.metric_type(),
            )?;
            gauge.encode(metric)?;
        }
        crate::observe::encode_counters(
            &mut encoder,
            &[
                (
                    "disagg_encode_requests",
                    "Requests whose media items went through the encoder stage (E/P/D).",
                    s.requests,
                ),
                (
                    "disagg_encode_items",
                    "Media items sent to encoders.",
                    s.items,
                ),
                (
                    "disagg_encode_legs",
                    "Encoder legs sent, retries included.",
                    s.legs,
                ),
                (
                    "disagg_encode_retries",
                    "Encoder legs sent again on another encoder after one failed.",
                    s.retries,
                ),
                (
                    "disagg_encode_failures",
                    "Requests whose encoder stage failed.",
                    s.failures,
                ),
                (
                    "disagg_encode_skipped",
                    "Requests with media served on a decode alone that loads no encoder output: no encoder stage, the decode encoded them itself.",
                    s.skipped,
                ),
                (
                    "disagg_encode_microseconds",
                    "Time spent in the encoder stage, summed over requests.",
                    s.micros,
                ),
            ],
        )
    }
}
