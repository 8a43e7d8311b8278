//! `disagg-proxy serve`: the proxy, from command-line flags.
//!
//! | file | holds |
//! |---|---|
//! | `flags.rs` | the flags (`ServeArgs` and its groups) and their parsing |
//! | `connectors.rs` | the engine protocol `--connector` names, and LMCache's notification listener |
//! | `serve.rs` | the shared parts (orchestrator, sources, routing, health, discovery, KV events) built from the flags, and the serving threads |

use std::net::SocketAddr;
use std::sync::Arc;

use disagg_affinity::{PerLeg, PromptThreshold};
use disagg_connectors::lmcache::{LmcacheReceiver, Notifications, ReceiverError};
use disagg_connectors::vllm::rewrite::check::VllmLimits;
use disagg_core::endpoint::{EndpointError, Facts};
use disagg_core::orchestrator::{MissingKv, PrefillFailure};
use disagg_core::policy::{Always, Disaggregate};

use disagg_core::{
    Endpoint, EndpointSource, Orchestrator, Role, Router, orchestrator::OrchestratorConfig,
    source::StaticSource,
};
use disagg_http::metrics::ExtraMetrics;
use disagg_http::{HttpTransport, HttpTransportConfig, PdService, PdServiceConfig};
use disagg_resilience::pairing::check_pairs_with;
use disagg_resilience::{Backoff, Health, HealthSource, Limits, Telemetry};

use crate::BoxError;
use crate::edge::spawn_until;

mod bidi;
mod checks;
mod connectors;
mod flags;

pub use bidi::BidiArgs;
pub use checks::Addressed;
pub(crate) use checks::repeated;
use connectors::*;
use flags::*;
pub use flags::{ClientBodyArgs, ConnectorArg, LmcacheArgs, ReliabilityArgs, ReuseArg, ServeArgs};
pub use flags::{millis, secs};

/// The proxy's parts that every serving thread shares: one orchestrator (endpoints,
/// router, connector, admission, retry budget, counters), of which each thread takes a
/// copy with a transport and connection pool of its own.
struct Shared {
    orchestrator: Orchestrator,
    transport: HttpTransportConfig,
    service: PdServiceConfig,
    /// Keys, limits and TLS at the edge.
    edge: crate::edge::Edge,
    /// Set when active health checks run.
    health: Option<Arc<Health>>,
    /// The discovery sources' thread, when discovery runs (it ends at shutdown).
    discovery: Option<std::thread::JoinHandle<()>>,
    /// The KV-event subscriber's thread, with the `kv_events` policy (it ends at
    /// shutdown).
    kv_events: Option<std::thread::JoinHandle<()>>,
    /// The access log and traces to flush at shutdown.
    finish: crate::observe::Finish,
    /// Engine telemetry (`--engine-metrics-interval`), with the set it scrapes: every
    /// engine found, before health takes any out.
    telemetry: Option<(Arc<Telemetry>, Arc<dyn EndpointSource>)>,
}

impl Shared {
    fn from_args(
        args: &ServeArgs,
        notifications: Option<Notifications>,
        shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> Result<Self, BoxError> {
        // Every time flag and every per-engine flag, whether or not its feature is on.
        checks::check_flags(args)?;
        if args.decode.is_empty() && !args.discovery.may_find_decode() {
            return Err(
                "no decode engine: give --decode, or a discovery source that can find one \
                 (--k8s-decode-selector, --decode-dns, --endpoints-file)"
                    .into(),
            );
        }
        // E → PD: encoders in front of prefill-decode engines, no prefill pool (none
        // given, none any discovery source can find).
        let e_pd = args.prefill.is_empty()
            && !args.discovery.may_find_prefill()
            && (!args.encode.is_empty() || args.discovery.may_find_encode());
        // Under decode-only a request with no prefill endpoint is served by a decode
        // alone, none configured included.
        if args.prefill.is_empty() && !args.discovery.any() && !args.decode_only() && !e_pd {
            return Err(
                "no prefill engine: give --prefill, a discovery source, or --prefill-failure decode-only"
                    .into(),
            );
        }
        // The telemetry and EC flags are checked before any engine is asked anything.
        let telemetry_config = args.reliability.telemetry()?;
        check_ec_flags(args, e_pd)?;
        args.discovery.check_needs()?;
        if args.connector != ConnectorArg::Lmcache && args.lmcache.lmcache_notify.is_some() {
            return Err(format!(
                "--lmcache-notify is read only by --connector lmcache (the connector is {})",
                args.connector.name()
            )
            .into());
        }
        let bounds = args.discovery.bounds();
        // Engine-wide settings are given for the engine URL and apply to all its ranks.
        // Protocol data goes into the endpoint's facts, for the connector to read.
        let endpoint =
            |url: &str, role: Role, mut facts: Facts, receiver: Option<&LmcacheReceiver>| {
                let mut ext = http::Extensions::new();
                let base = base_url(url);
                // One rank's own weight first, then its engine's.
                let id = url.trim_end_matches('/');
                let weight = (args.weights.iter().find(|(u, _)| u == id))
                    .or_else(|| args.weights.iter().find(|(u, _)| u == base))
                    .map(|(_, w)| *w);
                let profile = args.kv_profiles.iter().find(|(u, _)| u == base);
                if let Some((_, p)) = profile {
                    ext.insert(p.clone());
                }
                if let Some((_, p)) = args.ec_profiles.iter().find(|(u, _)| u == base) {
                    ext.insert(p.clone());
                }
                // LMCache: a decode's receiver port count is its TP size, declared with it
                // for the pair check below.
                if let Some(r) = receiver {
                    r.insert_into(&mut facts, &mut ext).map_err(|e| match e {
                        ReceiverError::TpSize { .. } => {
                            format!("--kv-profile and --lmcache-receiver disagree on {base}: {e}")
                        }
                        e => format!("--lmcache-receiver {base}: {e}"),
                    })?;
                }
                let models = args.served_models.iter().find(|(u, _)| u == base);
                let mut ep = Endpoint::with_address_policy(url, role, ext, bounds.addresses)
                    .map_err(|e| -> BoxError {
                        match e {
                            EndpointError::RefusedAddress { .. } => {
                                format!("{e}; allow it with --allow-link-local-engines").into()
                            }
                            e => e.into(),
                        }
                    })?;
                if let Some(w) = weight {
                    ep = ep.with_weight(w)?;
                }
                let ep = ep.with_facts(facts);
                Ok::<_, BoxError>(match models {
                    Some((_, names)) => ep.with_models(names.iter().map(String::as_str)),
                    None => ep,
                })
            };
        let mut endpoints = Vec::new();
        for (url, port) in parse_prefills(&args.prefill)? {
            let mut facts = Facts::default();
            if let Some(port) = port {
                facts.insert(Facts::BOOTSTRAP_PORT, port.to_string())?;
            }
            for url in expand_ranks(url, bounds.max_ranks)? {
                endpoints.push(endpoint(&url, Role::Prefill, facts.clone(), None)?);
            }
        }
        let lmcache = args.connector == ConnectorArg::Lmcache;
        for url in &args.decode {
            let receivers = args.lmcache.lmcache_receivers.iter();
            let receiver = receivers
                .clone()
                .find(|(u, _)| u == base_url(url))
                .map(|(_, r)| r);
            match receiver {
                Some(_) => {}
                None if lmcache => {
                    return Err(format!(
                        "--connector lmcache: decode engine {url} needs --lmcache-receiver {}=HOST:INIT_PORTS:ALLOC_PORTS",
                        base_url(url)
                    )
                    .into());
                }
                None => {}
            }
            for url in expand_ranks(url, bounds.max_ranks)? {
                endpoints.push(endpoint(&url, Role::Decode, Facts::default(), receiver)?);
            }
        }
        // Encoder-only engines (E/P/D): endpoints of the source like the others, so
        // health checks, metrics and discovery treat them alike; the encoder stage
        // takes its pool from the set each request is served with.
        for url in &args.encode {
            for url in expand_ranks(url, bounds.max_ranks)? {
                endpoints.push(
                    endpoint(&url, Role::Encode, Facts::default(), None)
                        .map_err(|e| format!("--encode {url}: {e}"))?,
                );
            }
        }
        let named = args.kv_profiles.iter().map(|(u, _)| ("--kv-profile", u));
        let named = named.chain(args.ec_profiles.iter().map(|(u, _)| ("--ec-profile", u)));
        let named = named.chain(
            args.served_models
                .iter()
                .map(|(u, _)| ("--served-model", u)),
        );
        let named = named.chain(
            args.lmcache
                .lmcache_receivers
                .iter()
                .map(|(u, _)| ("--lmcache-receiver", u)),
        );
        let named = named.chain(
            args.ec_addresses
                .iter()
                .map(|(u, _, _)| ("--ec-address", u)),
        );
        for (flag, url) in named {
            if !args.engine_urls().any(|u| base_url(u) == url) {
                return Err(format!(
                    "{flag} names {url}, which is no --prefill, --decode or --encode engine"
                )
                .into());
            }
        }
        // LMCache's notification counters join GET /metrics.
        let lmcache_metrics = notifications
            .clone()
            .map(|n| ExtraMetrics::new(move |registry| n.register_metrics(registry)));
        let mut limits = VllmLimits::default();
        limits.max_logprobs = args.max_logprobs;
        limits.max_stop_strings = args.max_stop_strings;
        let bidi = args.bidi.store(args.connector)?;
        let reuse_stats = Arc::new(disagg_connectors::vllm::ReuseStats::default());
        let nixl = args.connector == ConnectorArg::Nixl;
        // LMCache's probe of a prefill's context length has its own bound (2 s, not
        // the routers' --tokenize-timeout, whose 0 would fail every probe at once),
        // at most half the handoff budget that bounds the plan's resolution (or the
        // budget's 504 wins over carrying the request with its limit unchecked); a 0
        // handoff budget (which fails every handoff anyway) reads as the 2 s default.
        let context_probe = disagg_connectors::lmcache::CONTEXT_PROBE_TIMEOUT
            .min(secs(args.reliability.handoff_timeout, "handoff-timeout")? / 2);
        let connector = args.connector.connector(
            notifications,
            limits,
            (args.prompt_token_reuse, Arc::clone(&reuse_stats)),
            bidi.clone(),
            context_probe,
        )?;
        let (health_config, active_checks) = args.reliability.health()?;
        if args.forward_authorization && args.edge.client_keys() {
            return Err("--forward-authorization cannot be used with client keys (--api-key, --api-key-file): the clients' keys are the proxy's and never go to engines; give the engines theirs with --engine-api-key".into());
        }
        let edge = args.edge.build(
            args.engine_urls().collect::<Vec<_>>().into_iter(),
            args.discovery.any(),
        )?;
        let mut transport = HttpTransportConfig::default();
        transport.connect_timeout = secs(args.connect_timeout, "connect-timeout")?;
        transport.addresses = bounds.addresses;
        edge.apply(&mut transport);
        let mut extra_metrics = Vec::new();
        if nixl && args.prompt_token_reuse != ReuseArg::Off {
            extra_metrics.push(reuse_metrics(reuse_stats));
        }
        // `--prompt-token-reuse auto` reads the decode engines' versions, once, here.
        let endpoints = if nixl && args.prompt_token_reuse == ReuseArg::Auto {
            crate::discover::with_decode_versions(endpoints, &transport)?
        } else {
            endpoints
        };
        let prefill_policy = args.prefill_policy.unwrap_or(args.policy);
        let decode_policy = args.decode_policy.unwrap_or(args.policy);
        let kv_events = [prefill_policy, decode_policy]
            .iter()
            .any(|p| matches!(p, Policy::KvEvents))
            .then(|| crate::kv_events::KvEvents::new(&args.kv_events))
            .transpose()?;
        if kv_events.is_none()
            && let Some(flag) = args.kv_events.needs_the_policy()
        {
            return Err(format!(
                "{flag} is read only by the kv_events policy: add --prefill-policy kv_events or --decode-policy kv_events"
            )
            .into());
        }
        // An engine given on the command line whose KV-event publishers cannot be named
        // never will be, discovery or not.
        if let Some(kv) = &kv_events {
            kv.check_fixed(&endpoints)?;
        }
        // The set the KV-event subscriber follows: every engine found, before health
        // takes any out (an ejected engine keeps its cache, and its entries).
        let (source, health, discovery, follow): (
            Arc<dyn EndpointSource>,
            _,
            _,
            Arc<dyn EndpointSource>,
        ) = if args.discovery.any() {
            let d = crate::discover::start(
                &args.discovery,
                endpoints,
                Arc::clone(&connector),
                health_config,
                transport.clone(),
                shutdown.clone(),
            )?;
            let merged = Arc::clone(&d.merged);
            let pairing = Arc::clone(&d.pairing);
            extra_metrics.push(ExtraMetrics::new(move |registry| {
                merged.register_metrics(registry);
                pairing.register_metrics(registry);
            }));
            (Arc::new(d.source), d.health, Some(d.thread), d.merged)
        } else {
            let source = HealthSource::new(StaticSource::new(endpoints), health_config);
            // The engines' versions too, for the connectors whose handshake compares
            // them (a pair of different builds fails every request).
            let versions =
                crate::discover::versions_now(&source.snapshot(), &*connector, &transport)?;
            check_pairs_with(&source.snapshot(), &*connector, &versions)?;
            let health = Arc::clone(source.health());
            let all = Arc::new(crate::kv_events::Fixed::new(source.snapshot()));
            (Arc::new(source), health, None, all)
        };
        // Engines' `/metrics`: read on a thread of its own (`run`); its receipts hear
        // every request's handoff, and a suspect decode is ejected through `health`.
        let telemetry = telemetry_config.map(|c| {
            (
                Telemetry::new(c, Some(Arc::clone(&health))),
                Arc::clone(&follow),
            )
        });
        if let Some((t, _)) = &telemetry {
            let t = Arc::clone(t);
            extra_metrics.push(ExtraMetrics::new(move |registry| {
                t.register_metrics(registry)
            }));
        }
        let mut config = OrchestratorConfig::default();
        config.prefill_timeout = secs(args.prefill_timeout, "prefill-timeout")?;
        config.decode_head_timeout = secs(args.decode_timeout, "decode-timeout")?;
        config.forward_authorization = args.forward_authorization;
        config.tokenize_timeout = args.kv_events.tokenize_timeout()?;
        let resilience = args.reliability.apply(&mut config, args.retries)?;
        let observe = args.observe.start(args.connector.name(), &mut config)?;
        if args.decode_only() || e_pd {
            config.prefill_failure = PrefillFailure::DecodeOnly;
        }
        config.missing_kv = match args.missing_kv {
            MissingKvArg::LocalPrefill => MissingKv::LocalPrefill,
            MissingKvArg::Fail => MissingKv::Fail,
        };
        let mut router: Arc<dyn Router> = Arc::new(PerLeg::new(
            prefill_policy.pick(&args.weights, kv_events.as_ref())?,
            decode_policy.pick(&args.weights, kv_events.as_ref())?,
        ));
        let disaggregate: Arc<dyn Disaggregate> = match (args.min_prefill_tokens, &kv_events) {
            // The decode leg is picked by what the decode engines hold: only the
            // prompt the best of them lacks is worth a prefill leg.
            (Some(n), Some(kv)) if matches!(decode_policy, Policy::KvEvents) => {
                Arc::new(disagg_kvevents::CachedPrefixThreshold::new(
                    Arc::clone(&kv.scorer),
                    Arc::clone(&source),
                    n,
                    Arc::new(PromptThreshold::new(n)),
                ))
            }
            (Some(n), _) => Arc::new(PromptThreshold::new(n)),
            (None, _) => Arc::new(Always),
        };
        let tokenizer = match &kv_events {
            None => None,
            Some(_) => Some(
                args.kv_events
                    .tokenizer(Arc::clone(&source), transport.clone())?
                    .ok_or("the kv_events policy needs token ids: give --tokenizer PATH or --tokenize engine")?,
            ),
        };
        let mut service = PdServiceConfig::default();
        service.max_body_bytes = args.max_body_bytes;
        service.routes = disagg_http::RouteTable::default().admin_routes(args.admin_routes);
        service.extra_metrics.extend(lmcache_metrics);
        service.extra_metrics.extend(bidi.map(|store| {
            ExtraMetrics::new(move |registry| bidi::register_metrics(Arc::clone(&store), registry))
        }));
        service.extra_metrics.extend(edge.metrics());
        service.extra_metrics.extend(extra_metrics);
        let health_metrics = Arc::clone(&health);
        service
            .extra_metrics
            .push(ExtraMetrics::new(move |registry| {
                health_metrics.register_metrics(registry)
            }));
        observe.serve_metrics(&mut service);
        args.client_body.apply(&mut service)?;
        // Each piece only when asked for: a proxy with no limit and no retry pays
        // nothing for them.
        let a = &resilience.admission;
        let limits = (a.max_in_flight.is_some()
            || resilience.per_endpoint.is_some()
            || resilience.decode_hold.is_some())
        .then(|| Limits::new(resilience.admission));
        // The per-endpoint limit decorates the router and waits in the admission's
        // queue (one queue, one set of counters for both limits).
        if let (Some(l), Some(limit)) = (&limits, resilience.per_endpoint) {
            router = Arc::new(l.per_endpoint(router, limit));
        }
        // The decode hold, outermost: a held request routes (and waits for a
        // per-endpoint place) only once a decode has room.
        if let (Some(l), Some((max_running, wait))) = (&limits, resilience.decode_hold) {
            router = Arc::new(l.decode_hold(router, max_running, wait));
        }
        // The source's health hears every attempt (it is the source's listener).
        let mut builder =
            Orchestrator::builder(source, HttpTransport::new(transport.clone()), connector)
                .router(router)
                .disaggregate(disaggregate)
                .config(config);
        if let Some(t) = tokenizer {
            builder = builder.tokenizer(t);
        }
        if let Some(stage) = encode_stage(args)? {
            service
                .extra_metrics
                .push(connectors::encode_metrics(Arc::clone(&stage)));
            builder = builder.encoder(stage);
        }
        if let Some((t, _)) = &telemetry {
            builder = builder.listener(Arc::clone(t));
        }
        if let Some(limits) = limits {
            builder = builder.admission(limits);
        }
        if resilience.retry.max_retries > 0 {
            builder = builder.retry(Backoff::new(resilience.retry));
        }
        let orchestrator = observe.attach(builder).build();
        let kv_thread = match &kv_events {
            None => None,
            Some(kv) => {
                service.extra_metrics.push(kv.metrics());
                Some(kv.start(follow, shutdown)?)
            }
        };
        Ok(Shared {
            orchestrator,
            transport,
            service,
            edge,
            health: active_checks.then_some(health),
            discovery,
            kv_events: kv_thread,
            finish: observe.into_finish(),
            telemetry,
        })
    }

    /// One thread's service: the shared orchestrator (so load, round-robin state,
    /// admission and counters are global), with a transport and pool of its own.
    fn service(&self) -> PdService {
        let orchestrator = self
            .orchestrator
            .with_transport(HttpTransport::new(self.transport.clone()));
        PdService::with_config(orchestrator, self.service.clone())
    }
}

/// Run the proxy described by `args` until `shutdown` turns `true`, then drain within
/// `--drain-timeout`; `on_bound` gets the listening address once every serving thread is
/// up. Blocks the calling thread.
///
/// # Errors
///
/// Invalid flags, or an address that cannot be bound.
pub fn run(
    args: &ServeArgs,
    shutdown: tokio::sync::watch::Receiver<bool>,
    on_bound: impl FnOnce(SocketAddr),
) -> Result<(), BoxError> {
    // LMCache's notification socket, on a small thread of its own until the serving
    // threads are done: the requests still draining after shutdown wait for their
    // notifications on it. Its own stop signal, sent once `serve_threads` returned (or
    // dropped, which stops it too, when `run` ends early).
    let (stop_listener, listener_stop) = tokio::sync::watch::channel(false);
    let (notifications, listener) = match args.connector {
        ConnectorArg::Lmcache => {
            let (n, thread) =
                lmcache_listener(&args.lmcache, notify_ttl(args)?, args.listen, listener_stop)?;
            (Some(n), Some(thread))
        }
        _ => (None, None),
    };
    let mut shared = Shared::from_args(args, notifications, shutdown.clone())?;
    let discovery = shared.discovery.take();
    let kv_events = shared.kv_events.take();
    let finish = std::mem::take(&mut shared.finish);
    // Active health checks on a small thread of their own, until shutdown.
    let checker = match &shared.health {
        None => None,
        Some(health) => {
            let (health, stop) = (Arc::clone(health), shutdown.clone());
            let transport = HttpTransport::new(shared.transport.clone());
            let work = async move { health.run_checks(transport, stop).await };
            Some(spawn_until("disagg-health", work, shutdown.clone())?)
        }
    };
    // Engine telemetry on a small thread of its own, until shutdown.
    let telemetry = match shared.telemetry.take() {
        None => None,
        Some((telemetry, source)) => {
            let stop = shutdown.clone();
            let transport = HttpTransport::new(shared.transport.clone());
            let work = async move { telemetry.run(source, transport, stop).await };
            Some(spawn_until("disagg-telemetry", work, shutdown.clone())?)
        }
    };
    // The endpoints' metric series follow the set on a small thread of their own, until
    // shutdown: an endpoint that left loses them whether or not anything scrapes.
    let series = match shared.service.metrics.clone() {
        None => None,
        Some(metrics) => {
            let follow = metrics.follow(shared.orchestrator.clone(), shutdown.clone());
            Some(spawn_until("disagg-series", follow, shutdown.clone())?)
        }
    };
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from));
    let server = disagg_http::server::Builder::new()
        .threads(threads)
        .drain_timeout(secs(args.drain_timeout, "drain-timeout")?)
        .send_timeout(secs(args.client_send_timeout, "client-send-timeout")?)
        .max_connections(args.max_connections)
        .tls(shared.edge.server_tls.clone());
    // The key file and certificates, re-read on a small thread of their own.
    let reloader = match shared.edge.reloads() {
        None => None,
        Some(reloads) => Some(spawn_until("disagg-reload", reloads, shutdown.clone())?),
    };
    // A refused request is counted and logged like every other.
    let layer = shared.edge.layer.clone().map(|l| {
        l.tell_refusals(
            shared.orchestrator.clone(),
            shared.service.route_listeners.clone(),
        )
    });
    let served = match layer {
        // Without keys the service is served bare: no layer, no cost.
        None => server.serve_threads(args.listen, move || shared.service(), shutdown, on_bound),
        Some(layer) => server.serve_threads(
            args.listen,
            move || tower::Layer::layer(&layer, shared.service()),
            shutdown,
            on_bound,
        ),
    };
    served.map_err(|e| format!("cannot serve on {}: {e}", args.listen))?;
    // Every request is over (drained or cut): LMCache's notifications may stop.
    let _ = stop_listener.send(true);
    if let Some(reloader) = reloader {
        let _ = reloader.join();
    }
    if let Some(checker) = checker {
        let _ = checker.join();
    }
    if let Some(telemetry) = telemetry {
        let _ = telemetry.join();
    }
    if let Some(series) = series {
        let _ = series.join();
    }
    if let Some(discovery) = discovery {
        let _ = discovery.join();
    }
    if let Some(kv_events) = kv_events {
        let _ = kv_events.join();
    }
    if let Some(listener) = listener {
        let _ = listener.join();
    }
    // The requests are over: their last log lines and spans go out.
    finish.close();
    Ok(())
}

#[cfg(test)]
mod tests;

/// The encoder stage (vLLM's encoder protocol), when encoders may be known (`--encode`,
/// or a discovery source that can find some) and the connector's engines need the
/// proxy to call them. SGLang's prefill calls its encoders itself
/// (`--language-only --encoder-urls`): with `--connector sglang` there is no stage, and
/// encoder endpoints are known for their health and metrics only, never sent a leg.
fn encode_stage(
    args: &ServeArgs,
) -> Result<Option<Arc<disagg_core::encode::EncodeStage>>, BoxError> {
    if args.connector == ConnectorArg::Lmcache && !args.encode.is_empty() {
        // Its legs are token-id completions: an encoder's output would reach no engine.
        return Err("--encode is not read with --connector lmcache: its legs are token-id completions, which carry no media (a chat with media parts is refused with 400)".into());
    }
    if !calls_encoders(args) {
        return Ok(None);
    }
    let mut config = disagg_core::encode::EncodeConfig::default();
    config.timeout = secs(args.encode_timeout, "encode-timeout")?;
    let connector = disagg_connectors::vllm::VllmEncoder::new()
        .with_image_batch(args.encode_image_batch)
        .with_embeds_placeholders(args.encode_placeholders);
    let connector = match args.ec_connector {
        flags::EcConnectorArg::Example => connector,
        flags::EcConnectorArg::Mooncake => connector.with_mooncake_push(mooncake_push(args)),
    };
    Ok(Some(Arc::new(disagg_core::encode::EncodeStage::new(
        connector, config,
    ))))
}

/// Whether the proxy calls encoders itself: encoders may be known (`--encode`, or a
/// discovery source that can find some) and the connector is not SGLang's, whose
/// prefill calls them.
fn calls_encoders(args: &ServeArgs) -> bool {
    (!args.encode.is_empty() || args.discovery.may_find_encode())
        && !matches!(args.connector, ConnectorArg::Sglang | ConnectorArg::Lmcache)
}

/// `--ec-connector mooncake`'s consumer addresses and sizes, from its flags.
fn mooncake_push(args: &ServeArgs) -> disagg_connectors::vllm::MooncakeEcPush {
    let mut push = disagg_connectors::vllm::MooncakeEcPush::new()
        .with_tp_size(args.ec_tp_size.unwrap_or(1))
        .with_dp_size(args.ec_dp_size.unwrap_or(1));
    for (url, host, port) in &args.ec_addresses {
        push = push.with_address(url, host, *port);
    }
    push
}

/// The EC flags, before any engine is asked anything: a flag the chosen EC connector
/// does not read, or `--ec-connector mooncake` where the proxy calls no encoder, is
/// refused rather than ignored; with Mooncake, every consumer given on the command line
/// must have an EC port for each of its ranks (its `ec_port` plus `rank·--ec-tp-size`
/// at most 65535), or every request planned for a rank past it would fail. The
/// consumers are the prefill engines, and the decode engines when one may serve a
/// request alone (`e_pd`, `--min-prefill-tokens`, a decode-only fallback).
fn check_ec_flags(args: &ServeArgs, e_pd: bool) -> Result<(), BoxError> {
    let given = [
        (!args.ec_addresses.is_empty()).then_some("--ec-address"),
        args.ec_tp_size.map(|_| "--ec-tp-size"),
        args.ec_dp_size.map(|_| "--ec-dp-size"),
    ];
    let given = given.into_iter().flatten().next();
    match args.ec_connector {
        flags::EcConnectorArg::Example => match given {
            Some(flag) => Err(format!(
                "{flag} is read only by --ec-connector mooncake (the EC connector is `example`)"
            )
            .into()),
            None => Ok(()),
        },
        flags::EcConnectorArg::Mooncake if !calls_encoders(args) => Err(
            "--ec-connector mooncake needs encoders the proxy calls: --encode, or a discovery source that can find encoders, with a --connector other than sglang (whose prefill calls its encoders itself) or lmcache (whose legs carry no media)"
                .into(),
        ),
        flags::EcConnectorArg::Mooncake => {
            let push = mooncake_push(args);
            let decodes_alone = e_pd
                || args.min_prefill_tokens.is_some()
                || args.decode_only();
            let prefills = parse_prefills(&args.prefill)?.into_iter().map(|(u, _)| u);
            let decodes = args.decode.iter().filter(|_| decodes_alone);
            let max_ranks = args.discovery.bounds().max_ranks;
            for url in prefills.chain(decodes.map(String::as_str)) {
                // The last rank a request may be planned for: of the consumer's
                // --ec-dp-size ranks, or the highest its URL names.
                let named = expand_ranks(url, max_ranks)?
                    .iter()
                    .filter_map(|u| u.rsplit_once('@')?.1.parse::<u32>().ok())
                    .max();
                let last = args.ec_dp_size.unwrap_or(1).saturating_sub(1);
                let last = named.map_or(last, |n| n.max(last));
                let base = base_url(url);
                if push.port_of(base, last).is_none() {
                    return Err(format!(
                        "--ec-connector mooncake: consumer {base}'s data-parallel rank {last} would listen for its encoders past port 65535 (its --ec-address port plus {last}·--ec-tp-size {})",
                        args.ec_tp_size.unwrap_or(1)
                    )
                    .into());
                }
            }
            Ok(())
        }
    }
}
