//! The engine: listeners, routing and the completion pipeline.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, HeaderValue};
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{Instant, timeout_at};

use crate::api::{Answer, ApiError, CompletionRequest, FirstTok, KvParamsField, truthy};
use crate::body::{Endpoint, SimBody, SseBody, SseSpec, push_json_str};
use crate::config::{Faults, KvMode, SimConfig, SimRole};
use crate::dp::{self, Balancer, RoundRobin, SglangRanks};
use crate::gen_apis::GenApi;
use crate::generate::{
    EOS_TOKEN_ID, GenParams, Generation, KvDigest, generate_choice, ids_hash, kv_digest,
};
use crate::handoff::{HeldKv, KvParamsOut};
use crate::kv::{self, KvStore, KvTransferError, lock};
use crate::kv_events::Publishers;
use crate::lmcache::{self, DisaggSpec, LossRng, Notifier, TakeError};
use crate::prefix_cache::PrefixCache;
use crate::rendezvous::WithdrawOnDrop;
use crate::request_body::{self, MAX_BODY};
use crate::stats::{ConnectionGuard, Counters, RequestGuard, Stats, bump};
use crate::{mooncake, sglang, surface};

/// The error type of bodies the engine reads or writes through [`SimService`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The response body of [`SimService`]: the engine's own body (one JSON document, or an
/// SSE stream generated frame by frame), boxed.
pub type SimServiceBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

const X_REQUEST_ID: &str = "x-request-id";

/// A completion request as the engine received it.
#[derive(Clone, Debug, PartialEq)]
pub struct RecordedRequest {
    /// The request path, e.g. `/v1/chat/completions`.
    pub path: String,
    /// The request headers, in order (values that are not UTF-8 are
    /// converted lossily).
    pub headers: Vec<(String, String)>,
    /// The JSON body; a body that is not JSON is kept as a JSON string.
    pub body: Value,
}

impl RecordedRequest {
    /// The value of the first header named `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// State shared by every task of an engine.
#[derive(Debug)]
struct Inner {
    config: SimConfig,
    /// The host a decode is told to reach the side channel at ([`SimConfig::advertised_host`]
    /// as resolved at start).
    advertised_host: String,
    /// The engine id of the configuration ([`SimConfig::engine_id`] or a drawn one).
    engine_id: String,
    /// One engine id per data-parallel rank: `engine_id` with one rank, else
    /// `{engine_id}_dp{rank}`, as vLLM names each rank's engine core.
    engine_ids: Vec<String>,
    model_json: String,
    /// When the engine started: the `created` of its model cards.
    created: u64,
    /// The words behind the token ids it tokenized (`/detokenize`).
    vocab: surface::Vocab,
    /// The LoRA adapters loaded (`/v1/load_lora_adapter`).
    loras: surface::Loras,
    /// The side-channel port of each data-parallel rank (vLLM NIXL: one per rank,
    /// consecutive; the other modes: one, rank 0's).
    side_channel_ports: Vec<u16>,
    faults: Mutex<Faults>,
    counters: Arc<Counters>,
    /// The KV blocks each data-parallel rank holds for remote engines.
    kv: Box<[KvStore]>,
    side_pool: kv::SidePool,
    /// SGLang prefill: KV registered under bootstrap rooms.
    rooms: sglang::Rooms,
    /// Mooncake prefill: KV held by (engine id, transfer id).
    transfers: Arc<kv::Transfers>,
    recorded: Mutex<RecordedRing>,
    /// The head of every request, on every route.
    received: crate::received::Ring,
    next_id: AtomicU64,
    id_salt: u64,
    /// Turns true when the engine stops (ends the tasks sending release notices).
    stop: watch::Receiver<bool>,
    /// LMCache decode: the KV received on the receiver ports.
    receiver: lmcache::Receiver,
    /// LMCache prefill: how notifications reach the proxy.
    notifications: Arc<Notifications>,
    /// vLLM: where requests that name no data-parallel rank go.
    balancer: Arc<Balancer>,
    /// SGLang decode: where elements that name no rank go.
    round_robin: RoundRobin,
    /// The prefix cache of each rank, when configured.
    prefix: Option<PrefixCache>,
    /// Where its KV events go, when configured.
    publishers: Option<Publishers>,
    /// With [`SimConfig::serial_prefill`]: one prefill at a time per rank.
    prefill_slots: Vec<tokio::sync::Mutex<()>>,
    /// With [`SimConfig::max_num_seqs`]: the places of the requests that run at once.
    running_slots: Option<Arc<tokio::sync::Semaphore>>,
    /// When the engine started: the epoch of its monotonic clock (a bidirectional
    /// decode's `remote_blocks_expiry_time`).
    started: std::time::Instant,
    /// E/P/D push consumer: per data-parallel rank, the items its encoders pushed to
    /// that rank's EC port, not yet taken.
    ec_pushed: Arc<[crate::ec_push::Pushed]>,
}

impl Inner {
    /// Empties the prefix cache of every rank (its KV events say so).
    fn reset_prefix_cache(&self) {
        if let Some(cache) = &self.prefix {
            for (rank, events) in cache.clear(&self.counters) {
                publish(self, rank, events);
            }
        }
    }
}

/// An LMCache prefill's ZMQ socket to the proxy and the generator deciding
/// which notifications [`Faults::notify_loss`] loses.
#[derive(Debug)]
struct Notifications {
    notifier: Option<Notifier>,
    rng: LossRng,
}

/// A simulated vLLM OpenAI server with a NIXL-like KV side channel (and, as
/// [`SimConfig::kv_mode`] says, an SGLang or Mooncake bootstrap server).
///
/// Every task it spawns (accept loops, connections, the lease sweeper, the
/// short-lived senders of [`SideChannelRelease`](crate::SideChannelRelease)
/// notices) ends with [`SimEngine::shutdown`] or when the engine is dropped.
pub struct SimEngine {
    inner: Arc<Inner>,
    addr: SocketAddr,
    side_channel_addr: SocketAddr,
    side_channel_addrs: Vec<SocketAddr>,
    bootstrap_addr: Option<SocketAddr>,
    lmcache_init_ports: Vec<u16>,
    lmcache_alloc_ports: Vec<u16>,
    ec_push_ports: Vec<u16>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl fmt::Debug for SimEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimEngine")
            .field("addr", &self.addr)
            .field("side_channel_addr", &self.side_channel_addr)
            .field("bootstrap_addr", &self.bootstrap_addr)
            .field("kv_mode", &self.inner.config.kv_mode)
            .field("engine_id", &self.inner.engine_id)
            .field("model", &self.inner.config.model)
            .finish_non_exhaustive()
    }
}

fn tcp_endpoint(addr: SocketAddr) -> String {
    format!("tcp://{addr}")
}

/// Publishes a rank's KV events, when the engine publishes any.
fn publish(inner: &Inner, rank: usize, events: Vec<crate::prefix_cache::Event>) {
    if let Some(p) = &inner.publishers {
        p.publish(rank, events);
    }
}

/// A request's place in its rank's load reports: waiting for the prefill slot, then
/// computing; it leaves the reports when dropped.
struct LoadReport<'a> {
    inner: &'a Inner,
    rank: usize,
    uncached: u64,
    running: bool,
}

impl<'a> LoadReport<'a> {
    /// Counts `request` as waiting on `rank`, with the uncached tokens the prefix
    /// cache leaves it now; `None` when the engine reports no load.
    fn waiting(
        inner: &'a Inner,
        rank: usize,
        request: &crate::api::CompletionRequest,
    ) -> Option<Self> {
        let publishers = inner.publishers.as_ref().filter(|p| p.reports_load())?;
        let cached: u64 = match &inner.prefix {
            Some(cache) => request
                .prompts
                .iter()
                .map(|p| cache.peek(rank, p) as u64)
                .sum(),
            None => 0,
        };
        let uncached = request.prompt_tokens.saturating_sub(cached);
        publishers.load(rank, |l| {
            l.waiting += 1;
            l.waiting_uncached_tokens += uncached;
        });
        Some(LoadReport {
            inner,
            rank,
            uncached,
            running: false,
        })
    }

    /// The request got its slot: from waiting to running. Its uncached tokens stay in
    /// the report's `num_waiting_uncached_tokens` until its prefill ends, as SGLang
    /// counts the uncomputed rest of the prefill in progress there.
    fn running(mut self) -> Self {
        if let Some(p) = &self.inner.publishers {
            let uncached = self.uncached;
            p.load(self.rank, |l| {
                l.waiting = l.waiting.saturating_sub(1);
                l.running += 1;
                l.prefill_uncached_tokens += uncached;
            });
        }
        self.running = true;
        self
    }
}

impl Drop for LoadReport<'_> {
    fn drop(&mut self) {
        if let Some(p) = &self.inner.publishers {
            let (uncached, running) = (self.uncached, self.running);
            p.load(self.rank, |l| {
                if running {
                    l.running = l.running.saturating_sub(1);
                } else {
                    l.waiting = l.waiting.saturating_sub(1);
                }
                l.waiting_uncached_tokens = l.waiting_uncached_tokens.saturating_sub(uncached);
            });
        }
    }
}

/// A data-parallel rank's side of the KV handoff: its engine id, side-channel port and
/// block store.
struct Side<'a> {
    engine_id: &'a str,
    port: u16,
    kv: &'a KvStore,
}

impl<'a> Side<'a> {
    /// Rank `rank`'s side (a rank the engine placed a request on, so one it has; the
    /// last one otherwise).
    fn of(inner: &'a Inner, rank: usize) -> Self {
        let rank = rank.min(inner.kv.len().saturating_sub(1));
        let ports = &inner.side_channel_ports;
        Side {
            engine_id: inner
                .engine_ids
                .get(rank)
                .map_or(inner.engine_id.as_str(), String::as_str),
            port: ports.get(rank).or(ports.first()).copied().unwrap_or(0),
            kv: &inner.kv[rank],
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl SimEngine {
    /// Starts an engine whose HTTP server and side channel (and bootstrap
    /// server, if its [`KvMode`] has one) listen on ephemeral ports of
    /// [`SimConfig::bind_host`] (127.0.0.1 by default). Must be called within a
    /// Tokio runtime.
    ///
    /// A vLLM NIXL engine ([`KvMode::Nixl`], [`KvMode::NixlPush`]) with several
    /// [`SimConfig::dp_size`] ranks gets one side channel per rank, on consecutive
    /// ports ([`SimEngine::side_channel_addrs`]).
    pub async fn start(config: SimConfig) -> std::io::Result<SimEngine> {
        let http = TcpListener::bind((config.bind_host, 0)).await?;
        let ranks = crate::listen::side_channel_ranks(&config);
        let side_channels = crate::ec_push::bind_consecutive(config.bind_host, ranks, None).await?;
        let bootstrap = if config.kv_mode.has_bootstrap_server() {
            Some(TcpListener::bind((config.bind_host, 0)).await?)
        } else {
            None
        };
        Self::start_inner(config, http, side_channels, bootstrap).await
    }

    /// Starts an engine on listeners the caller bound. The side channel's
    /// port is the `remote_port` advertised in `kv_transfer_params`. When
    /// the [`KvMode`] needs a bootstrap server, it listens on an ephemeral
    /// port of [`SimConfig::bind_host`] (see [`SimEngine::start_with_bootstrap`]
    /// to choose). A vLLM NIXL engine with several data-parallel ranks binds the
    /// side channels of ranks 1 and up on the ports after `side_channel`'s, on its
    /// address (vLLM's `VLLM_NIXL_SIDE_CHANNEL_PORT + data_parallel_index`), and
    /// fails to start if one is taken.
    pub async fn start_on(
        config: SimConfig,
        http: TcpListener,
        side_channel: TcpListener,
    ) -> std::io::Result<SimEngine> {
        let side_channels = crate::listen::rank_side_channels(&config, side_channel).await?;
        let bootstrap = if config.kv_mode.has_bootstrap_server() {
            Some(TcpListener::bind((config.bind_host, 0)).await?)
        } else {
            None
        };
        Self::start_inner(config, http, side_channels, bootstrap).await
    }

    /// Starts an engine on listeners the caller bound, the bootstrap server
    /// (SGLang's `--disaggregation-bootstrap-port`, Mooncake's bootstrap
    /// HTTP server) included. Fails with [`std::io::ErrorKind::InvalidInput`]
    /// if the [`KvMode`] has no bootstrap server.
    pub async fn start_with_bootstrap(
        config: SimConfig,
        http: TcpListener,
        side_channel: TcpListener,
        bootstrap: TcpListener,
    ) -> std::io::Result<SimEngine> {
        if !config.kv_mode.has_bootstrap_server() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("kv mode {:?} has no bootstrap server", config.kv_mode),
            ));
        }
        let side_channels = crate::listen::rank_side_channels(&config, side_channel).await?;
        Self::start_inner(config, http, side_channels, Some(bootstrap)).await
    }

    async fn start_inner(
        config: SimConfig,
        http: TcpListener,
        side_channels: Vec<TcpListener>,
        bootstrap: Option<TcpListener>,
    ) -> std::io::Result<SimEngine> {
        let addr = http.local_addr()?;
        let side_channel_addrs = side_channels
            .iter()
            .map(TcpListener::local_addr)
            .collect::<std::io::Result<Vec<SocketAddr>>>()?;
        let Some(&side_channel_addr) = side_channel_addrs.first() else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "no side channel listener",
            ));
        };
        let bootstrap_addr = bootstrap
            .as_ref()
            .map(TcpListener::local_addr)
            .transpose()?;
        let engine_id = config
            .engine_id
            .clone()
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        let engine_ids: Vec<String> = match config.dp_size {
            0 | 1 => vec![engine_id.clone()],
            n => (0..n).map(|r| format!("{engine_id}_dp{r}")).collect(),
        };
        let advertised_host = crate::listen::advertised_host(&config, side_channel_addr);
        let query_body = mooncake::query_body(
            &engine_ids,
            &format!("{advertised_host}:{}", side_channel_addr.port()),
        )
        .map_err(std::io::Error::other)?;
        let mut model_json = String::new();
        push_json_str(&mut model_json, &config.model);
        // LMCache decode: the receiver ports of every rank.
        let mut receivers = Vec::new();
        if config.kv_mode == KvMode::Lmcache(SimRole::Decode) {
            let ports = &config.lmcache_receiver;
            if ports.init_ports.is_empty() || ports.init_ports.len() != ports.alloc_ports.len() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!(
                        "lmcache_receiver: {} init ports and {} alloc ports (one of each per rank)",
                        ports.init_ports.len(),
                        ports.alloc_ports.len()
                    ),
                ));
            }
            for (rank, (&init, &alloc)) in
                ports.init_ports.iter().zip(&ports.alloc_ports).enumerate()
            {
                let init = TcpListener::bind((ports.host, init)).await?;
                let alloc = TcpListener::bind((ports.host, alloc)).await?;
                receivers.push((rank, init, alloc));
            }
        }
        let lmcache_init_ports = receivers
            .iter()
            .map(|(_, l, _)| l.local_addr().map(|a| a.port()))
            .collect::<std::io::Result<Vec<u16>>>()?;
        let lmcache_alloc_ports = receivers
            .iter()
            .map(|(_, _, l)| l.local_addr().map(|a| a.port()))
            .collect::<std::io::Result<Vec<u16>>>()?;
        let notifier = match (&config.kv_mode, &config.lmcache_proxy) {
            (KvMode::Lmcache(SimRole::Prefill), Some(proxy)) => Some(Notifier::new(proxy)?),
            _ => None,
        };
        let notifications = Arc::new(Notifications {
            notifier,
            rng: LossRng::new(config.notify_seed),
        });
        let salt = uuid::Uuid::new_v4().as_u64_pair().0;
        let dp_size = usize::try_from(config.dp_size.max(1)).unwrap_or(1);
        let faults = config.faults;
        let lease = config.kv_lease;
        let (stop, stop_rx) = watch::channel(false);
        let counters = Arc::new(Counters::with_dp_size(dp_size));
        let mut tasks = Vec::new();
        let prefix = (config.prefix_cache_blocks > 0).then(|| {
            PrefixCache::new(
                &config.model,
                config.block_size,
                config.prefix_cache_blocks,
                dp_size,
            )
        });
        let publishers = match (&config.kv_events, &prefix) {
            (Some(events), Some(_)) => Some(
                Publishers::start(
                    events,
                    dp_size,
                    counters.clone(),
                    stop_rx.clone(),
                    &mut tasks,
                )
                .await?,
            ),
            (Some(_), None) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "kv_events needs a prefix cache (prefix_cache_blocks > 0)",
                ));
            }
            (None, _) => None,
        };
        let running_slots = config
            .max_num_seqs
            .map(|n| Arc::new(tokio::sync::Semaphore::new(n.max(1))));
        let inner = Arc::new(Inner {
            config,
            advertised_host,
            engine_id,
            engine_ids,
            model_json,
            created: unix_now(),
            vocab: surface::Vocab::new(),
            loras: surface::Loras::default(),
            side_channel_ports: side_channel_addrs.iter().map(SocketAddr::port).collect(),
            faults: Mutex::new(faults),
            counters,
            kv: (0..dp_size).map(|_| KvStore::default()).collect(),
            side_pool: kv::SidePool::default(),
            rooms: sglang::Rooms::default(),
            transfers: Arc::default(),
            recorded: Mutex::default(),
            received: crate::received::Ring::default(),
            next_id: AtomicU64::new(0),
            id_salt: salt,
            stop: stop_rx.clone(),
            receiver: lmcache::Receiver::new(receivers.len()),
            notifications,
            balancer: Arc::new(Balancer::new(dp_size)),
            round_robin: RoundRobin::default(),
            prefix,
            publishers,
            prefill_slots: (0..dp_size).map(|_| tokio::sync::Mutex::new(())).collect(),
            running_slots,
            started: std::time::Instant::now(),
            ec_pushed: (0..dp_size)
                .map(|_| crate::ec_push::Pushed::default())
                .collect(),
        });
        let tls = match &inner.config.tls {
            None => None,
            Some(t) => Some(tls_acceptor(t)?),
        };
        tasks.push(tokio::spawn(accept_http(
            inner.clone(),
            http,
            tls,
            stop_rx.clone(),
        )));
        for (rank, listener) in side_channels.into_iter().enumerate() {
            tasks.push(tokio::spawn(accept_side_channel(
                inner.clone(),
                listener,
                rank,
                stop_rx.clone(),
            )));
        }
        match (inner.config.kv_mode, bootstrap) {
            (KvMode::Sglang(SimRole::Prefill), Some(listener)) => {
                let inner = inner.clone();
                tasks.push(tokio::spawn(accept_loop(
                    listener,
                    stop_rx.clone(),
                    move |stream, peer| {
                        let inner = inner.clone();
                        async move {
                            let _ = stream.set_nodelay(true);
                            let wait = inner.config.bootstrap_timeout;
                            let dp_size = inner.engine_ids.len();
                            if let Err(e) = sglang::serve_bootstrap(
                                &inner.rooms,
                                &inner.counters,
                                wait,
                                dp_size,
                                stream,
                            )
                            .await
                            {
                                tracing::debug!(%peer, error = %e, "bootstrap connection failed");
                            }
                        }
                    },
                )));
            }
            (KvMode::Mooncake(SimRole::Prefill), Some(listener)) => {
                let header_read_timeout = inner.config.header_read_timeout;
                tasks.push(tokio::spawn(accept_loop(
                    listener,
                    stop_rx.clone(),
                    move |stream, _| {
                        mooncake::serve_bootstrap(query_body.clone(), header_read_timeout, stream)
                    },
                )));
            }
            _ => {}
        }
        for (rank, init, alloc) in receivers {
            for (port, listener) in [(lmcache::Port::Init, init), (lmcache::Port::Alloc, alloc)] {
                let inner = inner.clone();
                tasks.push(tokio::spawn(accept_loop(
                    listener,
                    stop_rx.clone(),
                    move |stream, peer| {
                        let inner = inner.clone();
                        async move {
                            let _ = stream.set_nodelay(true);
                            let served = lmcache::serve(
                                &inner.receiver,
                                &inner.counters,
                                port,
                                rank,
                                lmcache::AllocLimits::new(&inner.config),
                                stream,
                            );
                            if let Err(e) = served.await {
                                tracing::debug!(%peer, error = %e, "LMCache receiver connection failed");
                            }
                        }
                    },
                )));
            }
        }
        // E/P/D push consumer: an EC port per data-parallel rank, where encoders push
        // that rank's items (vLLM: rank `d` at `ec_port + d·tp_size`; the simulator's
        // tensor-parallel size is 1, so consecutive ports).
        let mut ec_push_ports = Vec::new();
        if inner.config.ec_push
            && inner
                .config
                .ec
                .as_ref()
                .is_some_and(|ec| ec.role == crate::ec::EcRole::Consumer)
        {
            let listeners = crate::ec_push::bind_consecutive(
                inner.config.bind_host,
                inner.ec_pushed.len(),
                inner.config.ec_push_port,
            )
            .await?;
            for (rank, listener) in listeners.into_iter().enumerate() {
                ec_push_ports.push(listener.local_addr()?.port());
                let inner = Arc::clone(&inner);
                tasks.push(tokio::spawn(accept_loop(
                    listener,
                    stop_rx.clone(),
                    move |stream, peer| {
                        let inner = Arc::clone(&inner);
                        async move {
                            let Some(pushed) = inner.ec_pushed.get(rank) else {
                                return;
                            };
                            let lease = inner.config.kv_lease;
                            if let Err(e) = crate::ec_push::serve(pushed, lease, stream).await {
                                tracing::debug!(%peer, rank, error = %e, "EC push connection failed");
                            }
                        }
                    },
                )));
            }
        }
        tasks.push(tokio::spawn(sweep_leases(inner.clone(), lease, stop_rx)));
        tracing::debug!(%addr, %side_channel_addr, ?bootstrap_addr, engine_id = %inner.engine_id, "sim engine started");
        Ok(SimEngine {
            inner,
            addr,
            side_channel_addr,
            side_channel_addrs,
            bootstrap_addr,
            lmcache_init_ports,
            lmcache_alloc_ports,
            ec_push_ports,
            stop,
            tasks,
        })
    }

    /// E/P/D push consumer ([`SimConfig::ec_push`] with an
    /// [`EcRole::Consumer`](crate::EcRole::Consumer)): the port of
    /// [`SimConfig::bind_host`] its encoders push items to (vLLM's `ec_port`), rank 0's.
    pub fn ec_push_port(&self) -> Option<u16> {
        self.ec_push_ports.first().copied()
    }

    /// E/P/D push consumer: the EC port of each data-parallel rank, consecutive from
    /// [`ec_push_port`](Self::ec_push_port) (vLLM's `ec_port + rank·tp_size`, the
    /// simulator's tensor-parallel size being 1). An item pushed to one rank's port is
    /// found only by a request placed on that rank. Empty when not a push consumer.
    pub fn ec_push_ports(&self) -> &[u16] {
        &self.ec_push_ports
    }

    /// The HTTP address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The HTTP base URL, e.g. `http://127.0.0.1:41234` (`https://` with
    /// [`SimConfig::tls`]).
    pub fn url(&self) -> String {
        let scheme = if self.inner.config.tls.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}", self.addr)
    }

    /// The side channel address (its port is the advertised `remote_port`).
    pub fn side_channel_addr(&self) -> SocketAddr {
        self.side_channel_addr
    }

    /// The side channel of each data-parallel rank of a vLLM NIXL engine
    /// ([`KvMode::Nixl`], [`KvMode::NixlPush`]), on consecutive ports from
    /// [`side_channel_addr`](Self::side_channel_addr) (vLLM's
    /// `VLLM_NIXL_SIDE_CHANNEL_PORT + data_parallel_index`): rank `r`'s serves only
    /// the KV computed on rank `r`, under its engine id
    /// ([`engine_ids`](Self::engine_ids)`[r]`). One address in the other modes.
    pub fn side_channel_addrs(&self) -> Vec<SocketAddr> {
        self.side_channel_addrs.clone()
    }

    /// The host the engine advertises for its side channel (`remote_host`, a
    /// Mooncake prefill's `worker_addr`): [`SimConfig::advertised_host`], else the
    /// address the side channel listens on.
    pub fn advertised_host(&self) -> &str {
        &self.inner.advertised_host
    }

    /// The engine id of the configuration ([`SimConfig::engine_id`], or the one drawn
    /// at start): the one advertised as `remote_engine_id` by an engine of one
    /// data-parallel rank. With several, each rank advertises its own
    /// ([`engine_ids`](Self::engine_ids)).
    pub fn engine_id(&self) -> &str {
        &self.inner.engine_id
    }

    /// The engine ids of the [`SimConfig::dp_size`] data-parallel ranks, as vLLM
    /// names each rank's engine core (`vllm/v1/engine/core.py`): with one rank,
    /// [`SimEngine::engine_id`]; with several, rank `r`'s is `"{engine_id}_dp{r}"`
    /// (rank 0's too).
    pub fn engine_ids(&self) -> Vec<String> {
        self.inner.engine_ids.clone()
    }

    /// The bootstrap server's address: the SGLang bootstrap server (the
    /// decode's `bootstrap_host`/`bootstrap_port`) of an SGLang prefill, the
    /// bootstrap HTTP server (`remote_bootstrap_addr`) of a Mooncake
    /// prefill; `None` in the other modes.
    pub fn bootstrap_addr(&self) -> Option<SocketAddr> {
        self.bootstrap_addr
    }

    /// The bound init port of each receiver rank of an LMCache decode
    /// (`receiver_init_port` of a `disagg_spec`); empty in the other modes.
    pub fn lmcache_init_ports(&self) -> Vec<u16> {
        self.lmcache_init_ports.clone()
    }

    /// The bound alloc port of each receiver rank of an LMCache decode
    /// (`receiver_alloc_port` of a `disagg_spec`); empty in the other modes.
    pub fn lmcache_alloc_ports(&self) -> Vec<u16> {
        self.lmcache_alloc_ports.clone()
    }

    /// Where rank 0 publishes its KV-cache events (`tcp://HOST:PORT`; rank `r` on the
    /// port plus `r`), with [`SimConfig::kv_events`].
    pub fn kv_events_endpoint(&self) -> Option<String> {
        self.inner.publishers.as_ref().map(|p| tcp_endpoint(p.addr))
    }

    /// Where rank 0 answers KV-event replay requests (`tcp://HOST:PORT`), with a
    /// [`KvEventsConfig::replay_port`](crate::KvEventsConfig::replay_port).
    pub fn kv_events_replay_endpoint(&self) -> Option<String> {
        self.inner
            .publishers
            .as_ref()
            .and_then(|p| p.replay_addr)
            .map(tcp_endpoint)
    }

    /// Where rank 0 publishes its load reports (`tcp://HOST:PORT`), with a
    /// [`KvEventsConfig::load_port`](crate::KvEventsConfig::load_port).
    pub fn load_endpoint(&self) -> Option<String> {
        self.inner
            .publishers
            .as_ref()
            .and_then(|p| p.load_addr)
            .map(tcp_endpoint)
    }

    /// How many leading tokens of `tokens` rank `rank`'s prefix cache would serve
    /// now (what a local prefill of them would hit), without touching the cache: the
    /// simulator's ground truth, for tests and benchmarks. 0 without a prefix cache.
    pub fn cached_prefix_tokens(&self, rank: usize, tokens: &[u32]) -> usize {
        self.inner
            .prefix
            .as_ref()
            .map_or(0, |c| c.peek(rank, tokens))
    }

    /// Empties every rank's prefix cache, publishing `AllBlocksCleared`, as vLLM's
    /// `reset_prefix_cache` does.
    pub fn reset_prefix_cache(&self) {
        self.inner.reset_prefix_cache();
    }

    /// The LoRA adapters loaded now (`POST /v1/load_lora_adapter`), by name, in load
    /// order.
    pub fn lora_adapters(&self) -> Vec<String> {
        self.inner.loras.names()
    }

    /// Makes rank `rank`'s next `batches` KV-event batches be numbered and kept for
    /// replay but not sent, as a `PUB` socket drops messages for a subscriber past its
    /// high-water mark: a subscriber sees a gap in the sequence.
    pub fn lose_kv_events(&self, rank: usize, batches: u64) {
        if let Some(p) = &self.inner.publishers {
            p.lose(rank, batches);
        }
    }

    /// The configuration the engine runs with (faults as at start).
    pub fn config(&self) -> &SimConfig {
        &self.inner.config
    }

    /// A snapshot of the counters (also served as JSON on `GET /stats`).
    pub fn stats(&self) -> Stats {
        self.inner.counters.snapshot()
    }

    /// The engine as an in-process tower service: the same routes, counters, KV store
    /// and side channel client as its HTTP server, with no socket in between (a
    /// sidecar calls its local decode engine this way). Requests served here open no
    /// HTTP connection ([`Stats::http_connections`] does not move).
    pub fn service(&self) -> SimService {
        SimService {
            inner: self.inner.clone(),
        }
    }

    /// The last completion requests received, oldest first (at most
    /// [`SimConfig::record_requests`], and the newest ones within 64 MiB of paths,
    /// headers and bodies: the oldest are forgotten first).
    pub fn requests(&self) -> Vec<RecordedRequest> {
        lock(&self.inner.recorded)
            .requests
            .iter()
            .map(Recorded::to_public)
            .collect()
    }

    /// Forgets the recorded requests.
    pub fn clear_requests(&self) {
        lock(&self.inner.recorded).clear();
    }

    /// The heads of the last requests received on any route but `GET /stats`, oldest
    /// first (at most [`SimConfig::record_requests`]; see
    /// [`ReceivedRequest`](crate::ReceivedRequest)).
    pub fn received(&self) -> Vec<crate::ReceivedRequest> {
        self.inner.received.list()
    }

    /// Forgets the received heads.
    pub fn clear_received(&self) {
        self.inner.received.clear();
    }

    /// The faults currently injected.
    pub fn faults(&self) -> Faults {
        *lock(&self.inner.faults)
    }

    /// Changes the injected faults; requests that arrive afterwards see
    /// the new ones.
    pub fn set_faults(&self, faults: Faults) {
        *lock(&self.inner.faults) = faults;
    }

    /// Stops the engine and waits until every task is gone: listeners are
    /// closed, open connections (and the requests on them) are dropped.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        for task in std::mem::take(&mut self.tasks) {
            // A task ends by itself on the stop signal; it only fails if it
            // panicked, which has been reported already.
            let _ = task.await;
        }
    }
}

impl Drop for SimEngine {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        // Aborting an accept loop drops its JoinSet, which aborts the
        // connection tasks in turn.
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// A [`SimEngine`] served in process, from [`SimEngine::service`].
///
/// Accepts requests with any body of [`Bytes`]; never fails (errors are HTTP answers,
/// as on the wire). Cheap to clone. It stays usable after the engine's listeners are
/// shut down, but the engine's side channel then no longer serves pulls.
#[derive(Clone)]
pub struct SimService {
    inner: Arc<Inner>,
}

impl fmt::Debug for SimService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimService")
            .field("engine_id", &self.inner.engine_id)
            .finish_non_exhaustive()
    }
}

impl<B> tower::Service<Request<B>> for SimService
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<SimServiceBody>;
    type Error = Infallible;
    type Future = std::pin::Pin<
        Box<dyn Future<Output = Result<Response<SimServiceBody>, Infallible>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let inner = self.inner.clone();
        Box::pin(async move {
            let resp = route(&inner, req).await;
            Ok(resp.map(|b| b.map_err(BoxError::from).boxed_unsync()))
        })
    }
}

/// The TLS acceptor of [`SimConfig::tls`].
#[cfg(feature = "tls")]
type TlsAcceptor = tokio_rustls::TlsAcceptor;
/// Without the `tls` feature no acceptor can exist.
#[cfg(not(feature = "tls"))]
type TlsAcceptor = std::convert::Infallible;

#[cfg(feature = "tls")]
fn tls_acceptor(tls: &crate::config::SimTls) -> std::io::Result<TlsAcceptor> {
    crate::tls::acceptor(tls)
}

#[cfg(not(feature = "tls"))]
fn tls_acceptor(_tls: &crate::config::SimTls) -> std::io::Result<TlsAcceptor> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "SimConfig::tls needs disagg-sim's `tls` feature",
    ))
}

async fn accept_http(
    inner: Arc<Inner>,
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    mut stop: watch::Receiver<bool>,
) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    // Without the `tls` feature the acceptor is an `Option<Infallible>`,
                    // which is `Copy`; with it, an `Arc` to clone.
                    #[allow(clippy::clone_on_copy)]
                    connections.spawn(serve_http(inner.clone(), stream, tls.clone()));
                }
                Err(e) => accept_error(&e).await,
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    connections.shutdown().await;
}

/// Serves the side channel of data-parallel rank `rank`: its KV, under its engine id
/// (and, on a Mooncake prefill, the transfers of every rank).
async fn accept_side_channel(
    inner: Arc<Inner>,
    listener: TcpListener,
    rank: usize,
    mut stop: watch::Receiver<bool>,
) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    bump(&inner.counters.side_channel_connections);
                    let inner = inner.clone();
                    connections.spawn(async move {
                        let _ = stream.set_nodelay(true);
                        let mooncake = (inner.config.kv_mode == KvMode::Mooncake(SimRole::Prefill))
                            .then(|| kv::MooncakeSide {
                                transfers: &inner.transfers,
                                engine_ids: &inner.engine_ids,
                                wait: inner.config.bootstrap_timeout,
                            });
                        let push_wait = (inner.config.kv_mode == KvMode::NixlPush)
                            .then_some(inner.config.bootstrap_timeout);
                        let (Some(store), Some(engine_id)) = (inner.kv.get(rank), inner.engine_ids.get(rank)) else {
                            return;
                        };
                        if let Err(e) = kv::serve_pull(store, &inner.counters, engine_id, mooncake, push_wait, stream).await {
                            tracing::debug!(%peer, error = %e, "side channel connection failed");
                        }
                    });
                }
                Err(e) => accept_error(&e).await,
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    connections.shutdown().await;
}

/// Accepts connections until the stop signal, each served by a task made by
/// `serve`; the tasks end with the loop.
async fn accept_loop<F, Fut>(listener: TcpListener, mut stop: watch::Receiver<bool>, mut serve: F)
where
    F: FnMut(TcpStream, SocketAddr) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    connections.spawn(serve(stream, peer));
                }
                Err(e) => accept_error(&e).await,
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    connections.shutdown().await;
}

/// Backs off after a failed accept (e.g. out of file descriptors).
async fn accept_error(e: &std::io::Error) {
    tracing::warn!(error = %e, "accept failed");
    tokio::time::sleep(Duration::from_millis(10)).await;
}

async fn sweep_leases(inner: Arc<Inner>, lease: Duration, mut stop: watch::Receiver<bool>) {
    let period = (lease / 4).clamp(Duration::from_millis(5), Duration::from_secs(1));
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            _ = tick.tick() => {
                for kv in inner.kv.iter() {
                    kv.sweep(&inner.counters);
                }
                inner.transfers.sweep(&inner.counters);
                inner.receiver.sweep(&inner.counters);
                for pushed in inner.ec_pushed.iter() {
                    pushed.sweep();
                }
            }
        }
    }
}

/// How long a client may take over its TLS handshake.
#[cfg(feature = "tls")]
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

async fn serve_http(inner: Arc<Inner>, stream: TcpStream, tls: Option<TlsAcceptor>) {
    let _connection = ConnectionGuard::new(inner.counters.clone());
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "cannot set TCP_NODELAY");
    }
    match tls {
        None => serve_io(inner, TokioIo::new(stream)).await,
        #[cfg(feature = "tls")]
        Some(acceptor) => {
            match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => serve_io(inner, TokioIo::new(tls)).await,
                Ok(Err(e)) => {
                    bump(&inner.counters.tls_handshake_failures);
                    tracing::debug!(error = %e, "TLS handshake failed");
                }
                Err(_) => {
                    bump(&inner.counters.tls_handshake_failures);
                    tracing::debug!("TLS handshake timed out");
                }
            }
        }
        #[cfg(not(feature = "tls"))]
        Some(never) => match never {},
    }
}

async fn serve_io<I>(inner: Arc<Inner>, io: I)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let header_read_timeout = inner.config.header_read_timeout;
    let service = service_fn(move |req| {
        let inner = inner.clone();
        async move { Ok::<_, Infallible>(route(&inner, req).await) }
    });
    // The timer makes the head's time limit hold (hyper has none without one).
    if let Err(e) = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout)
        .keep_alive(true)
        .serve_connection(io, service)
        .await
    {
        tracing::debug!(error = %e, "HTTP connection ended with an error");
    }
}

pub(crate) fn json_response(
    status: StatusCode,
    body: SimBody,
    request_id: Option<&str>,
) -> Response<SimBody> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(value) = request_id.and_then(|r| HeaderValue::from_str(r).ok()) {
        headers.insert(X_REQUEST_ID, value);
    }
    response
}

fn error_response(error: &ApiError, request_id: Option<&str>) -> Response<SimBody> {
    json_response(error.status, SimBody::full(error.body()), request_id)
}

/// The answer to a request whose body could not be read: the connection closes after
/// it, as what is left of the body is never read.
fn unread_body_response(error: &ApiError, request_id: Option<&str>) -> Response<SimBody> {
    let mut response = error_response(error, request_id);
    response
        .headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    response
}

/// Whether `headers` carry `key` as vLLM's `AuthenticationMiddleware` reads it: the
/// value split at its first space, the scheme `bearer` in any case, the rest exactly
/// the key.
fn has_key(headers: &HeaderMap, key: &str) -> bool {
    let Some(value) = headers.get(http::header::AUTHORIZATION) else {
        return false;
    };
    let Some((scheme, token)) = value.as_bytes().split_at_checked(6) else {
        return false;
    };
    scheme.eq_ignore_ascii_case(b"bearer")
        && token.first() == Some(&b' ')
        && &token[1..] == key.as_bytes()
}

async fn route<B>(inner: &Arc<Inner>, req: Request<B>) -> Response<SimBody>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    inner.received.record(&req, inner.config.record_requests);
    // Routed by its decoded path, as uvicorn hands it to Starlette.
    let routed = crate::received::routed_path(req.uri().path()).into_owned();
    if let Some(key) = &inner.config.api_key
        && routed != "/stats"
        && !has_key(req.headers(), key)
    {
        bump(&inner.counters.requests_without_key);
        // vLLM guards the OpenAI routes only (`/v1...`), answering its own error shape.
        if routed.starts_with("/v1") {
            bump(&inner.counters.unauthorized);
            return json_response(
                StatusCode::UNAUTHORIZED,
                SimBody::full(Bytes::from_static(br#"{"error":"Unauthorized"}"#)),
                None,
            );
        }
    }
    let sglang = matches!(inner.config.kv_mode, KvMode::Sglang(_));
    let route = match (req.method(), routed.as_str()) {
        (&Method::GET, "/health") => {
            let mut response = Response::new(SimBody::empty());
            // vLLM answers 503 once its engine core died (`EngineDeadError`).
            if is_dead(inner) {
                *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            } else if let Some(status) = lock(&inner.faults).health_status
                && let Ok(status) = StatusCode::from_u16(status)
            {
                *response.status_mut() = status;
            }
            return response;
        }
        (&Method::GET, "/v1/models") => {
            let models = surface::models(&inner.config, &inner.loras, inner.created);
            let body = serde_json::to_vec(&models).unwrap_or_default();
            return json_response(StatusCode::OK, SimBody::full(body), None);
        }
        (&Method::GET, "/stats") => {
            let body = serde_json::to_vec(&inner.counters.snapshot()).unwrap_or_default();
            return json_response(StatusCode::OK, SimBody::full(body), None);
        }
        (&Method::GET, "/metrics") => {
            bump(&inner.counters.metrics_requests);
            let fault = lock(&inner.faults).metrics;
            let padding = match fault {
                Some(crate::MetricsFault::Hang) => {
                    std::future::pending::<()>().await;
                    0
                }
                Some(crate::MetricsFault::Garbage) => {
                    let mut response = Response::new(SimBody::full(Bytes::from_static(
                        b"{\"not\": \"prometheus\"} <html>\x01\x02 = = =\n",
                    )));
                    *response.status_mut() = StatusCode::OK;
                    return response;
                }
                Some(crate::MetricsFault::Huge(n)) => n,
                None => 0,
            };
            let text = crate::metrics::render(&inner.config, &inner.counters.snapshot(), padding);
            let mut response = Response::new(SimBody::full(text));
            response.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            return response;
        }
        (&Method::GET, "/version") => {
            let body =
                serde_json::to_vec(&json!({"version": inner.config.version})).unwrap_or_default();
            return json_response(StatusCode::OK, SimBody::full(body), None);
        }
        (&Method::POST, "/tokenize") => return tokenize_route(inner, req).await,
        (&Method::POST, path @ ("/detokenize" | "/v1/embeddings")) => {
            let path = path.to_owned();
            return surface_route(inner, &path, req).await;
        }
        (
            &Method::POST,
            path @ ("/v1/load_lora_adapter" | "/v1/unload_lora_adapter" | "/reset_prefix_cache"),
        ) => {
            let path = path.to_owned();
            return admin_route(inner, &path, req).await;
        }
        (&Method::POST, "/v1/chat/completions") => Route::Openai(Endpoint::Chat),
        (&Method::POST, "/v1/completions") => Route::Openai(Endpoint::Completions),
        (&Method::POST, path)
            if let Some(api) = GenApi::of_path(path).filter(|a| !sglang || a.on_sglang()) =>
        {
            Route::Gen(api)
        }
        // SGLang's own API; vLLM has no such route.
        (&Method::POST | &Method::PUT, "/generate") if sglang => Route::Native,
        _ => {
            return error_response(&ApiError::new(StatusCode::NOT_FOUND, "Not Found"), None);
        }
    };
    let response = completion(inner, route, req).await;
    match route {
        Route::Gen(api) => crate::gen_apis::reshape(api, response).await,
        _ => response,
    }
}

/// Which generation API a request came on.
#[derive(Debug, Clone, Copy)]
enum Route {
    /// `/v1/chat/completions` or `/v1/completions`.
    Openai(Endpoint),
    /// SGLang's `/generate`.
    Native,
    /// vLLM's other generation routes ([`crate::gen_apis`]).
    Gen(GenApi),
}

/// Why a body is no JSON value: it could not be read ([`unread_body_response`]), or
/// it is not one (or past the parse's budget).
enum BodyError {
    Unread(ApiError),
    Json(ApiError),
}

impl BodyError {
    fn response(&self) -> Response<SimBody> {
        match self {
            BodyError::Unread(e) => unread_body_response(e, None),
            BodyError::Json(e) => error_response(e, None),
        }
    }
}

/// Read a request body as JSON, within the engine's limits.
async fn read_json<B>(inner: &Inner, body: B) -> Result<Value, BodyError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let bytes = request_body::read(body, inner.config.body_read_timeout)
        .await
        .map_err(BodyError::Unread)?;
    request_body::json(&bytes).map_err(BodyError::Json)
}

/// `POST /detokenize` and `/v1/embeddings`, in every mode and whatever the
/// [`Faults`].
async fn surface_route<B>(inner: &Inner, path: &str, req: Request<B>) -> Response<SimBody>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let counters = &inner.counters;
    let json = match read_json(inner, req.into_body()).await {
        Ok(json) => json,
        Err(e) => return e.response(),
    };
    let request_id = format!(
        "{:016x}{:016x}",
        inner.id_salt,
        inner.next_id.fetch_add(1, Relaxed)
    );
    let config = &inner.config;
    let answer = match path {
        "/detokenize" => {
            bump(&counters.detokenize_requests);
            surface::detokenize(&json, config, &inner.loras, &inner.vocab)
        }
        "/v1/embeddings" => {
            bump(&counters.embeddings_requests);
            surface::embeddings(&json, config, &inner.loras, &request_id, unix_now())
        }
        _ => Err(ApiError::new(StatusCode::NOT_FOUND, "Not Found")),
    };
    match answer.and_then(|v| {
        serde_json::to_vec(&v)
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
    }) {
        Ok(body) => json_response(StatusCode::OK, SimBody::full(body), None),
        Err(e) => error_response(&e, None),
    }
}

/// The admin routes: LoRA adapters and the prefix cache, as vLLM answers them
/// (`Faults::admin_status` makes them fail, changing nothing).
async fn admin_route<B>(inner: &Inner, path: &str, req: Request<B>) -> Response<SimBody>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    bump(&inner.counters.admin_requests);
    let (parts, body) = req.into_parts();
    let json = match read_json(inner, body).await {
        Ok(json) => json,
        // vLLM's `/reset_prefix_cache` takes no body.
        Err(_) if path == "/reset_prefix_cache" => Value::Null,
        Err(e) => return e.response(),
    };
    record(
        inner,
        path,
        &parts.headers,
        &Bytes::from(serde_json::to_vec(&json).unwrap_or_default()),
    );
    if let Some(status) = lock(&inner.faults).admin_status {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let message = format!("Simulated fault: the engine answers {}", status.as_u16());
        return error_response(&ApiError::new(status, message), None);
    }
    let answer = match path {
        "/v1/load_lora_adapter" => surface::load_lora(&json, &inner.config, &inner.loras),
        "/v1/unload_lora_adapter" => surface::unload_lora(&json, &inner.loras),
        _ => {
            inner.reset_prefix_cache();
            Ok(String::new())
        }
    };
    match answer {
        // vLLM answers a bare `Response(content=...)`: no content type.
        Ok(text) => {
            let mut response = Response::new(SimBody::full(text));
            *response.status_mut() = StatusCode::OK;
            response
        }
        Err(e) => error_response(&e, None),
    }
}

/// `POST /tokenize`, in every mode and whatever the [`Faults`] but
/// [`Faults::hang_tokenize`].
async fn tokenize_route<B>(inner: &Inner, req: Request<B>) -> Response<SimBody>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    bump(&inner.counters.tokenize_requests);
    if lock(&inner.faults).hang_tokenize {
        // Held until the client leaves, as a hung engine holds it.
        std::future::pending::<()>().await;
    }
    let json = match read_json(inner, req.into_body()).await {
        Ok(json) => json,
        Err(e) => return e.response(),
    };
    // Remember the words, so that `/detokenize` can give them back.
    if let Some(Value::String(p)) = json.get("prompt") {
        inner.vocab.learn(p);
    } else if let Ok(text) = crate::api::chat_prompt(json.get("messages")) {
        inner.vocab.learn(&text);
    }
    let answer =
        crate::api::tokenize_request(&json, &inner.config, &inner.loras).and_then(|answer| {
            serde_json::to_vec(&answer)
                .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
        });
    match answer {
        Ok(body) => json_response(StatusCode::OK, SimBody::full(body), None),
        Err(e) => error_response(&e, None),
    }
}

/// A request as kept in the ring: cheap to store (the body and header
/// values are reference-counted), converted on [`SimEngine::requests`].
#[derive(Debug)]
struct Recorded {
    path: String,
    headers: HeaderMap,
    body: Bytes,
}

impl Recorded {
    fn to_public(&self) -> RecordedRequest {
        RecordedRequest {
            path: self.path.clone(),
            headers: self
                .headers
                .iter()
                .map(|(k, v)| {
                    (
                        k.as_str().to_owned(),
                        String::from_utf8_lossy(v.as_bytes()).into_owned(),
                    )
                })
                .collect(),
            body: serde_json::from_slice(&self.body).unwrap_or_else(|_| {
                Value::String(String::from_utf8_lossy(&self.body).into_owned())
            }),
        }
    }

    /// The bytes the record holds: its path, headers and body.
    fn size(&self) -> usize {
        let headers: usize = self
            .headers
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len())
            .sum();
        self.path.len() + headers + self.body.len()
    }
}

/// Most bytes of requests the ring keeps: beyond it, the oldest requests are
/// forgotten first (the newest is always kept: a body is at most [`MAX_BODY`]).
const RECORD_BUDGET: usize = MAX_BODY;

/// The recorded requests: the last ones, at most [`SimConfig::record_requests`] of
/// them and [`RECORD_BUDGET`] bytes.
#[derive(Debug, Default)]
struct RecordedRing {
    requests: VecDeque<Recorded>,
    /// The bytes the requests hold ([`Recorded::size`]).
    bytes: usize,
}

impl RecordedRing {
    fn pop_front(&mut self) -> Option<Recorded> {
        let oldest = self.requests.pop_front()?;
        self.bytes = self.bytes.saturating_sub(oldest.size());
        Some(oldest)
    }

    fn clear(&mut self) {
        self.requests.clear();
        self.bytes = 0;
    }
}

fn record(inner: &Inner, path: &str, headers: &HeaderMap, body: &Bytes) {
    let capacity = inner.config.record_requests;
    if capacity == 0 {
        return;
    }
    let recorded = Recorded {
        path: path.to_owned(),
        headers: headers.clone(),
        body: body.clone(),
    };
    let size = recorded.size();
    let mut ring = lock(&inner.recorded);
    while ring.requests.len() >= capacity
        || (!ring.requests.is_empty() && ring.bytes.saturating_add(size) > RECORD_BUDGET)
    {
        ring.pop_front();
    }
    ring.bytes = ring.bytes.saturating_add(size);
    ring.requests.push_back(recorded);
}

/// What a vLLM 0.33 NIXL pull decode does with `kv_transfer_params` whose
/// `do_remote_prefill` is truthy (`…/nixl/pull_scheduler.py`
/// `update_state_after_alloc`).
enum PullParams {
    /// Block ids and the four keys: the KV is pulled.
    Valid,
    /// No block ids (missing or empty): `assert num_external_tokens == 0` fails
    /// inside the scheduler and the engine core dies.
    Fatal,
    /// Block ids, but a key missing: "Got invalid KVTransferParams", and the
    /// request stays parked waiting for remote KV nobody sends.
    Stuck,
}

fn pull_params(params: &serde_json::Map<String, Value>) -> PullParams {
    if !truthy(params.get("remote_block_ids")) {
        return PullParams::Fatal;
    }
    let keys = [
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
    ];
    if keys.iter().all(|k| params.contains_key(*k)) {
        PullParams::Valid
    } else {
        PullParams::Stuck
    }
}

/// Whether a vLLM 0.33 NIXL push decode indexes a key `params` lacks
/// (`…/nixl/push_scheduler.py` `update_state_after_alloc`: a `KeyError` in the
/// scheduler, fatal to the engine core).
fn push_params_missing(params: &serde_json::Map<String, Value>) -> bool {
    ["remote_engine_id", "remote_host", "remote_port", "tp_size"]
        .iter()
        .any(|k| !params.contains_key(*k))
}

/// Whether the engine core died ([`Stats::engine_core_deaths`](crate::Stats::engine_core_deaths)).
fn is_dead(inner: &Inner) -> bool {
    inner.counters.engine_core_deaths.load(Relaxed) > 0
}

/// The engine core dies: this request and every later one answer 500.
fn die(inner: &Inner, request_id: &str, why: &str) -> ApiError {
    bump(&inner.counters.engine_core_deaths);
    tracing::warn!(request_id, why, "simulated engine core died");
    engine_dead()
}

/// vLLM's answer once its engine core is dead (`EngineDeadError.CLIENT_MESSAGE`,
/// 500 `InternalServerError`, `vllm/entrypoints/serve/exception_handling/`).
fn engine_dead() -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "The server had an error while processing your request.",
    )
}

async fn completion<B>(inner: &Arc<Inner>, route: Route, req: Request<B>) -> Response<SimBody>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let (parts, body) = req.into_parts();
    let header_id = parts
        .headers
        .get(X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let header_id = header_id.as_deref();
    let bytes = match request_body::read(body, inner.config.body_read_timeout).await {
        Ok(bytes) => bytes,
        Err(e) => return unread_body_response(&e, header_id),
    };
    // A request counts (and runs, for `/metrics`) once its body is in, as vLLM's
    // handler starts once the body was read: a client trickling it loads nothing.
    let mut guard = RequestGuard::new(inner.counters.clone());
    match route {
        Route::Native => bump(&inner.counters.generate_requests),
        Route::Gen(GenApi::Responses) => bump(&inner.counters.responses_requests),
        _ => {}
    }
    // The request, and its JSON for the fields of the concurrent protocols.
    let parsed = request_body::json(&bytes).and_then(|json| {
        let request = match route {
            Route::Openai(endpoint) => {
                CompletionRequest::parse(endpoint, &json, &inner.config, &inner.loras)?
            }
            Route::Native => crate::native::parse(&json, &inner.config)?,
            Route::Gen(api) => crate::gen_apis::parse(api, &json, &inner.config, &inner.loras)?,
        };
        Ok((request, json))
    });
    record(inner, parts.uri.path(), &parts.headers, &bytes);

    if is_dead(inner) {
        guard.complete();
        return error_response(&engine_dead(), header_id);
    }
    let faults = *lock(&inner.faults);
    if let Some(status) = faults.status {
        guard.complete();
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let message = format!("Simulated fault: the engine answers {}", status.as_u16());
        return error_response(&ApiError::new(status, message), header_id);
    }
    if faults.hang {
        // Held until the client leaves: hyper then drops this future, and
        // the guard counts the request as cancelled.
        std::future::pending::<()>().await;
    }

    let (request, json) = match parsed {
        Ok(parsed) => parsed,
        Err(e) => {
            guard.complete();
            let mut response = error_response(&e, header_id);
            response
                .extensions_mut()
                .insert(crate::gen_apis::RequestModel);
            return response;
        }
    };
    let request_id = match header_id {
        Some(id) => id.to_owned(),
        None => format!(
            "{:016x}{:016x}",
            inner.id_salt,
            inner.next_id.fetch_add(1, Relaxed)
        ),
    };
    // E/P/D: an encoder-only engine answers every chat request as an encoder leg; a
    // consumer reads each media item's encoder output before any work (chat, Responses
    // and Messages requests alike): from the shared store at once, or, pushed, from what
    // reached the EC port of the rank the request is placed on (below).
    let mut push_consumer = None;
    if let Some(ec) = &inner.config.ec {
        let api = match route {
            Route::Openai(Endpoint::Chat) => Some(crate::ec::EcApi::Chat),
            Route::Gen(GenApi::Responses) => Some(crate::ec::EcApi::Responses),
            Route::Gen(GenApi::Messages) => Some(crate::ec::EcApi::Messages),
            _ => None,
        };
        match (ec.role, api) {
            (crate::ec::EcRole::Producer, Some(crate::ec::EcApi::Chat)) => {
                let answer = encoder_answer(inner, &ec.store, &json, &request_id, header_id).await;
                guard.complete();
                return answer;
            }
            (crate::ec::EcRole::Consumer, Some(api)) if inner.config.ec_push => {
                push_consumer = Some(api);
            }
            (crate::ec::EcRole::Consumer, Some(api)) => {
                match crate::ec::load(&ec.store, api, &json) {
                    Ok(n) => {
                        inner.counters.ec_loaded(0, n);
                    }
                    Err(e) => {
                        guard.complete();
                        return error_response(&e, header_id);
                    }
                }
            }
            _ => {}
        }
    }
    let vllm = inner.config.kv_mode.is_vllm();
    // vLLM: the data-parallel rank, pinned by the header or chosen by the
    // engine's balancer; it stays loaded while the request lives.
    let placed = if vllm {
        match dp::vllm_pinned_rank(&parts.headers, inner.engine_ids.len()) {
            Ok(pinned) => Some(inner.balancer.place(pinned)),
            Err(e) => {
                guard.complete();
                return error_response(&e, header_id);
            }
        }
    } else {
        None
    };
    let rank = placed.as_ref().map_or(0, dp::RankLoad::rank);
    // Pushed items are taken from the rank's own EC port only: items pushed to another
    // rank's never arrive here.
    if let Some(api) = push_consumer {
        let received = match (crate::ec::items(api, &json), inner.ec_pushed.get(rank)) {
            (Ok(items), Some(pushed)) => {
                let hashes: Vec<String> = items.into_iter().map(|(h, _)| h).collect();
                crate::ec_push::receive(
                    pushed,
                    &json,
                    &hashes,
                    inner.config.ec_push_wait,
                    crate::ec::embeddings,
                )
                .await
            }
            (Err(e), _) => Err(e),
            (Ok(_), None) => Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("no EC port for data-parallel rank {rank}"),
            )),
        };
        match received {
            Ok(n) => inner.counters.ec_loaded(rank, n),
            Err(e) => {
                guard.complete();
                return error_response(&e, header_id);
            }
        }
    }
    let planned = plan(inner, &request, &json, &parts.headers, rank, &request_id);
    drop(json);
    let plan = match planned {
        Ok(plan) => plan,
        Err(e) => {
            guard.complete();
            return error_response(&e, header_id);
        }
    };
    let counters = &inner.counters;
    match &plan {
        Plan::SglangPrefill(elements) | Plan::SglangDecode(elements) => {
            for e in elements {
                counters.bump_rank(e.rank as usize);
            }
        }
        _ => counters.bump_rank(rank),
    }
    if let Some(placed) = placed {
        guard.keep(placed);
    }
    if vllm && request.beam_search {
        bump(&counters.beam_search_requests);
    }
    if vllm && request.grammar {
        bump(&counters.grammars_compiled);
    }
    if vllm && request.tokenized {
        bump(&counters.chat_prompts_tokenized);
    }
    if request.reused_ids {
        bump(&counters.prompt_ids_reused);
    }

    // The rank whose prefix cache serves the request (an SGLang batch's first element's).
    let cache_rank = match &plan {
        Plan::SglangPrefill(elements) | Plan::SglangDecode(elements) => {
            elements.first().map_or(0, |e| e.rank as usize)
        }
        _ => rank,
    };
    let ids = (request_id, header_id.map(str::to_owned));
    let served = serve_or_defer(inner, request, plan, ids, cache_rank, faults, guard);
    match served.await {
        Ok(response) => response,
        Err((e, mut guard)) => {
            guard.complete();
            error_response(&e, header_id)
        }
    }
}

/// An encoder-only engine's answer to a chat request: its media items encoded into the
/// shared store, the answer non-streamed with `ec_transfer_params` (vLLM writes them
/// into a whole answer only; a streamed encoder leg is refused here, as its handoff
/// would be lost).
async fn encoder_answer(
    inner: &Inner,
    store: &std::path::Path,
    json: &Value,
    request_id: &str,
    header_id: Option<&str>,
) -> Response<SimBody> {
    if json.get("stream").and_then(Value::as_bool) == Some(true) {
        return error_response(
            &ApiError::bad_request(
                "an encoder-only engine answers ec_transfer_params only unstreamed",
            ),
            header_id,
        );
    }
    // Push mode: a leg naming its consumer has each item pushed there, not written.
    let encoded =
        if inner.config.ec_push && json.pointer("/ec_transfer_params/consumer_zmq").is_some() {
            match crate::ec::items(crate::ec::EcApi::Chat, json) {
                Err(e) => Err(e),
                Ok(items) => {
                    let with_bytes: Vec<(String, Vec<u8>)> = items
                        .iter()
                        .map(|(h, _)| (h.clone(), crate::ec::embeddings(h)))
                        .collect();
                    crate::ec_push::push(json, &with_bytes)
                        .await
                        .map(|_| (crate::ec::answer_params(&items), items.len()))
                }
            }
        } else {
            crate::ec::encode(store, json)
        };
    match encoded {
        Err(e) => error_response(&e, header_id),
        Ok((params, n)) => {
            inner.counters.ec_items_encoded.fetch_add(n as u64, Relaxed);
            let withhold = lock(&inner.faults).ec_withhold_params;
            let body = json!({
                "id": format!("chatcmpl-{request_id}"),
                "object": "chat.completion",
                "created": inner.created,
                "model": inner.config.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n},
                "kv_transfer_params": null,
                "ec_transfer_params": if n == 0 || withhold { Value::Null } else { params },
            });
            let body = serde_json::to_vec(&body).unwrap_or_default();
            json_response(StatusCode::OK, SimBody::full(body), header_id)
        }
    }
}

/// What the engine's KV protocol asks of a request, read and validated
/// before any work.
#[derive(Debug)]
enum Plan {
    /// No KV work: a plain request, or a vLLM beam search (whose parameters
    /// carry no `kv_transfer_params`).
    Plain,
    /// vLLM NIXL: as the request's `kv_transfer_params` say.
    Nixl,
    /// vLLM NIXL push prefill: hold the KV under the request's internal id
    /// for a decode's registration.
    PushPrefill,
    /// vLLM NIXL push decode: register with the prefill, receive the KV.
    PushDecode {
        target: kv::PushTarget,
        /// The prefill's blocks, when the parameters name them (a
        /// sequential proxy passed the prefill's answer on): released if
        /// the request is aborted before its KV arrived.
        release: Option<kv::PullTarget>,
    },
    /// SGLang prefill: register the rooms, wait for decodes to take them.
    SglangPrefill(Vec<sglang::Element>),
    /// SGLang decode: take the rooms from their bootstrap servers.
    SglangDecode(Vec<sglang::Element>),
    /// Mooncake prefill: hold the KV under (engine id of the rank, transfer id).
    MooncakePrefill { key: (String, String) },
    /// Mooncake decode: pull the KV of a transfer.
    MooncakeDecode(mooncake::Remote),
    /// A decode whose `kv_transfer_params` ask for remote KV but name none it can
    /// pull (Mooncake's "Got invalid KVTransferParams"): it waits for KV nobody sends,
    /// until the client leaves.
    Stuck,
    /// LMCache prefill: push the KV to the decode's receiver ranks, if the
    /// request has a `disagg_spec`, and notify the proxy.
    LmcachePrefill(Option<DisaggSpec>),
    /// LMCache decode: take the KV of the prompt minus its last token from
    /// the receiver, and continue after that token.
    LmcacheDecode,
}

fn plan(
    inner: &Inner,
    request: &CompletionRequest,
    json: &Value,
    headers: &HeaderMap,
    rank: usize,
    request_id: &str,
) -> Result<Plan, ApiError> {
    let config = &inner.config;
    // vLLM builds beam-search parameters without the request's
    // `kv_transfer_params`: neither role reads them.
    let params = request
        .kv_transfer_params
        .as_ref()
        .filter(|_| !(config.kv_mode.is_vllm() && request.beam_search));
    Ok(match config.kv_mode {
        KvMode::Nixl if params.is_none() => Plan::Plain,
        KvMode::Nixl => Plan::Nixl,
        KvMode::NixlPush => match params {
            Some(p) if truthy(p.get("do_remote_decode")) => Plan::PushPrefill,
            Some(p) if truthy(p.get("do_remote_prefill")) && push_params_missing(p) => {
                return Err(die(
                    inner,
                    request_id,
                    "KeyError in the push decode's scheduler",
                ));
            }
            Some(p) if truthy(p.get("do_remote_prefill")) => {
                let own_id =
                    kv::internal_request_id(request_id, inner.next_id.fetch_add(1, Relaxed));
                match kv::PushTarget::parse(p, own_id) {
                    Some(target) => Plan::PushDecode {
                        target,
                        release: kv::PullTarget::parse(p).ok(),
                    },
                    None => {
                        bump(&inner.counters.invalid_kv_params);
                        tracing::debug!(
                            request_id,
                            "invalid NIXL push kv_transfer_params, prefilling locally"
                        );
                        Plan::Plain
                    }
                }
            }
            _ => Plan::Plain,
        },
        KvMode::Sglang(role) => {
            let decode = role == SimRole::Decode;
            let empty = serde_json::Map::new();
            let body = json.as_object().unwrap_or(&empty);
            let placement = sglang::Placement {
                ranks: SglangRanks::read(headers, body, inner.engine_ids.len())?,
                dp_size: inner.engine_ids.len(),
                round_robin: &inner.round_robin,
            };
            let elements = sglang::elements(
                json,
                request,
                &config.model,
                config.block_size,
                decode,
                &placement,
            )?;
            if decode {
                Plan::SglangDecode(elements)
            } else {
                if let Err(conflict) = sglang::check_follow_room(&elements, &placement) {
                    bump(&inner.counters.dp_rank_conflicts);
                    tracing::debug!(request_id, %conflict, "SGLang prefill refused");
                    return Err(ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!("KV transfer failed: {conflict}"),
                    ));
                }
                Plan::SglangPrefill(elements)
            }
        }
        KvMode::Mooncake(_) if request.beam_search => Plan::Plain,
        KvMode::Mooncake(SimRole::Prefill) => match mooncake::prefill_transfer_id(params) {
            Some(transfer_id) => {
                let engine_id = inner.engine_ids.get(rank).cloned().unwrap_or_default();
                Plan::MooncakePrefill {
                    key: (engine_id, transfer_id),
                }
            }
            None => {
                tracing::debug!(request_id, "Mooncake: no transfer id, nothing held");
                Plan::Plain
            }
        },
        KvMode::Mooncake(SimRole::Decode) => match mooncake::decode_remote(params)? {
            mooncake::DecodeKv::Local => Plan::Plain,
            mooncake::DecodeKv::Stuck => Plan::Stuck,
            mooncake::DecodeKv::Remote(remote) => Plan::MooncakeDecode(remote),
        },
        KvMode::Lmcache(role) => {
            let spec = match role {
                SimRole::Decode => None,
                SimRole::Prefill => lmcache::disagg_spec(params)?,
            };
            // A decode, or a prefill that pushes, works on the KV of one prompt.
            if (role == SimRole::Decode || spec.is_some()) && request.prompts.len() != 1 {
                return Err(ApiError::bad_request(
                    "LMCache P/D: one prompt per request, not a batch",
                ));
            }
            match role {
                SimRole::Decode => Plan::LmcacheDecode,
                SimRole::Prefill => {
                    if spec.is_some() && inner.notifications.notifier.is_none() {
                        return Err(ApiError::new(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "LMCache: this prefill has no proxy to notify (lmcache_proxy is not set)",
                        ));
                    }
                    Plan::LmcachePrefill(spec)
                }
            }
        }
    })
}

/// The `kv_transfer_params` of a NIXL prefill's answer under
/// [`Faults::malformed_kv_params`]: a string where an object is expected.
const MALFORMED_KV_PARAMS: &str = "malformed by fault injection";

/// Makes a cancellation of a vLLM NIXL decode, until [`RequestGuard::disarm`],
/// send the prefill a [`SideChannelRelease`](crate::SideChannelRelease) for the
/// blocks of `target` (from a short task: the guard is dropped synchronously).
fn arm_release(inner: &Inner, guard: &mut RequestGuard, target: kv::PullTarget) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let counters = inner.counters.clone();
    let mut stop = inner.stop.clone();
    guard.on_cancel(move || {
        bump(&counters.kv_releases_sent);
        runtime.spawn(async move {
            tokio::select! {
                sent = kv::send_release(&target) => {
                    if let Err(e) = sent {
                        tracing::debug!(error = %e, "KV release notice failed");
                    }
                }
                // The engine stopped.
                _ = stop.wait_for(|stopped| *stopped) => {}
            }
        });
    });
}

/// The `id` of an OpenAI answer to the request.
fn answer_id(endpoint: Endpoint, request_id: &str) -> String {
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl-",
        Endpoint::Completions => "cmpl-",
    };
    format!("{prefix}{request_id}")
}

/// The model a streamed answer names (JSON): the LoRA adapter the request named, as
/// vLLM's does, or the base model.
fn model_json(inner: &Inner, request: &CompletionRequest) -> String {
    match &request.adapter {
        Some(adapter) => {
            let mut json = String::new();
            push_json_str(&mut json, adapter);
            json
        }
        None => inner.model_json.clone(),
    }
}

/// What a streamed answer to the request names itself by.
fn stream_ids<'a>(
    inner: &Inner,
    request: &CompletionRequest,
    request_id: &str,
    header_id: Option<&'a str>,
) -> crate::kv_load_failure::StreamIds<'a> {
    crate::kv_load_failure::StreamIds {
        id: answer_id(request.endpoint, request_id),
        request_id: request_id.to_owned(),
        created: unix_now(),
        model_json: model_json(inner, request),
        header_id,
    }
}

/// Counts a failed KV fetch of a decode and makes its answer.
fn kv_failure(counters: &Counters, e: &KvTransferError, request_id: &str) -> ApiError {
    bump(&counters.kv_pull_failures);
    if e.is_timeout() {
        bump(&counters.bootstrap_timeouts);
    }
    tracing::debug!(error = %e, request_id, "KV transfer failed");
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        format!("KV transfer failed: {e}"),
    )
}

/// The ids of an LMCache decode's prompt whose KV the prefill pushed: all but
/// the last (the first token of the answer).
fn lmcache_kv_ids(request: &CompletionRequest) -> &[u32] {
    let prompt = request.prompts.first().map_or(&[][..], Vec::as_slice);
    &prompt[..prompt.len().saturating_sub(1)]
}

/// LMCache prefill: pushes the prompt's KV to every receiver rank of `spec`
/// at once, then notifies the proxy once per acknowledged rank (at once, or
/// from a task after [`Faults::notify_delay`]). A failed push fails the
/// request, and its rank is not notified.
async fn push_and_notify(
    inner: &Inner,
    spec: &DisaggSpec,
    digest: &KvDigest,
    faults: Faults,
) -> Result<(), ApiError> {
    let counters = &inner.counters;
    let ranks = lmcache::sender_ranks(spec, inner.config.lmcache_prefill_tp_size);
    let pushes = (0..ranks).map(|rank| lmcache::push(spec, rank, &inner.engine_id, digest));
    let mut acked = 0u32;
    let mut failures = Vec::new();
    for (rank, pushed) in futures::future::join_all(pushes)
        .await
        .into_iter()
        .enumerate()
    {
        match pushed {
            Ok(()) => {
                bump(&counters.kv_pushes);
                acked += 1;
            }
            Err(e) => {
                bump(&counters.kv_push_failures);
                failures.push(format!(
                    "rank {rank} ({}:{}/{}): {e}",
                    spec.host,
                    spec.init_ports.get(rank).copied().unwrap_or_default(),
                    spec.alloc_ports.get(rank).copied().unwrap_or_default()
                ));
            }
        }
    }
    if acked > 0 {
        let batch = NotifyBatch {
            req_id: spec.req_id.clone(),
            originals: acked,
            duplicates: faults.notify_duplicates,
            loss: faults.notify_loss,
        };
        if faults.notify_delay.is_zero() {
            send_notifications(&inner.notifications, counters, &batch).await;
        } else if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let notifications = inner.notifications.clone();
            let counters = inner.counters.clone();
            let mut stop = inner.stop.clone();
            let delay = faults.notify_delay;
            runtime.spawn(async move {
                tokio::select! {
                    () = async {
                        tokio::time::sleep(delay).await;
                        send_notifications(&notifications, &counters, &batch).await;
                    } => {}
                    // The engine stopped.
                    _ = stop.wait_for(|stopped| *stopped) => {}
                }
            });
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        tracing::debug!(req_id = %spec.req_id, ?failures, "LMCache KV push failed");
        Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("KV transfer failed: {}", failures.join("; ")),
        ))
    }
}

/// The notifications of one LMCache prefill.
#[derive(Debug)]
struct NotifyBatch {
    req_id: String,
    /// One per acknowledged rank.
    originals: u32,
    /// Extra copies of each, sent after all the originals.
    duplicates: u32,
    /// Probability that each one is lost.
    loss: f64,
}

/// Sends the notifications of a batch, in order. After a failure (no proxy
/// within the timeout) the rest are not tried, so that a missing proxy costs
/// one timeout per request at most.
async fn send_notifications(
    notifications: &Notifications,
    counters: &Counters,
    batch: &NotifyBatch,
) {
    let Some(notifier) = &notifications.notifier else {
        return;
    };
    let payload = match lmcache::proxy_notif(&batch.req_id) {
        Ok(payload) => payload,
        Err(e) => {
            tracing::warn!(error = %e, "cannot encode a notification");
            return;
        }
    };
    let total = u64::from(batch.originals) * (1 + u64::from(batch.duplicates));
    let mut failed = false;
    for _ in 0..total {
        if notifications.rng.lose(batch.loss) {
            bump(&counters.notifications_lost);
            continue;
        }
        if failed {
            bump(&counters.notification_failures);
            continue;
        }
        match notifier.send(&payload).await {
            Ok(()) => bump(&counters.notifications_sent),
            Err(e) => {
                failed = true;
                bump(&counters.notification_failures);
                tracing::debug!(error = %e, req_id = %batch.req_id, "notification not sent");
            }
        }
    }
    // The socket's writer task writes what was handed to it as soon as it
    // runs: let it run before the caller answers.
    for _ in 0..4 {
        tokio::task::yield_now().await;
    }
}

/// SGLang prefill: registers the KV of every element under its room and
/// waits until decodes took them all, within the bootstrap timeout. The
/// rooms are withdrawn on every way out (timeout, cancellation). A transfer
/// that failed is answered as SGLang's prefill aborts it (`prepare_abort`,
/// 500, in `disaggregation/prefill.py`): its error body's shape.
async fn hand_over_rooms(inner: &Inner, elements: &[sglang::Element]) -> Result<(), ApiError> {
    let counters = &inner.counters;
    let wait = inner.config.bootstrap_timeout;
    let entries = elements
        .iter()
        .map(|e| ((e.rank, e.room), e.digest.clone()))
        .collect();
    let registration = inner
        .rooms
        .register(counters, entries, None)
        .map_err(|(_, room)| {
            ApiError::new(
                StatusCode::CONFLICT,
                format!("bootstrap_room {room} is already registered by another request"),
            )
        })?;
    let _withdraw = WithdrawOnDrop {
        rendezvous: &inner.rooms,
        counters,
        keys: elements.iter().map(|e| (e.rank, e.room)).collect(),
        owner: registration.owner,
    };
    let deadline = Instant::now() + wait;
    for ((_, room), taken) in registration.taken {
        match timeout_at(deadline, taken).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => {
                return Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("KV transfer failed: room {room} was withdrawn"),
                )
                .in_sglang_shape());
            }
            Err(_) => {
                bump(&counters.bootstrap_timeouts);
                return Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("KV transfer failed: no decode took room {room} within {wait:?}"),
                )
                .in_sglang_shape());
            }
        }
    }
    Ok(())
}

/// A vLLM NIXL pull decode's pull, as its `kv_transfer_params` make it.
type NixlPull = Option<Result<kv::PullTarget, KvTransferError>>;

/// Serves a completion request ([`serve_completion`]), after what its plan decides before
/// any work: a NIXL pull decode's engine core dying, the release notices armed. A
/// streamed vLLM decode ([`crate::kv_load_failure::streamed`]) whose plan may fetch KV (a
/// NIXL pull or push, a Mooncake transfer, any LMCache decode) or waits for KV nobody
/// sends, and a streamed SGLang `/generate` decode
/// ([`crate::kv_load_failure::head_before_kv`]), gets its head at once and is served in
/// its body, as vLLM's and SGLang's are ([`crate::kv_load_failure::head_first`]).
async fn serve_or_defer(
    inner: &Arc<Inner>,
    request: CompletionRequest,
    plan: Plan,
    (request_id, header_id): (String, Option<String>),
    rank: usize,
    faults: Faults,
    mut guard: RequestGuard,
) -> Result<Response<SimBody>, (ApiError, RequestGuard)> {
    let config = &inner.config;
    // vLLM NIXL decode: where to pull the KV from. Until the pull is over, a
    // cancellation tells the prefill to free the blocks (vLLM's decode worker
    // does, not to strand them until the lease runs out).
    let mut stuck = matches!(plan, Plan::Stuck);
    let nixl_pull: NixlPull = match (&plan, request.kv_transfer_params.as_ref()) {
        (Plan::Nixl, Some(p)) if truthy(p.get("do_remote_prefill")) => match pull_params(p) {
            PullParams::Valid => Some(kv::PullTarget::parse(p)),
            PullParams::Fatal => {
                let e = die(inner, &request_id, "assert num_external_tokens == 0");
                return Err((e, guard));
            }
            PullParams::Stuck => {
                stuck = true;
                None
            }
        },
        _ => None,
    };
    if let Some(Ok(target)) = nixl_pull.as_ref().filter(|_| config.release_on_abort) {
        arm_release(inner, &mut guard, target.clone());
    }
    // NIXL push decode: likewise, until its KV arrived, if it knows the
    // prefill's blocks.
    if let Plan::PushDecode {
        release: Some(target),
        ..
    } = &plan
        && config.release_on_abort
    {
        arm_release(inner, &mut guard, target.clone());
    }
    let remote_kv = stuck
        || nixl_pull.is_some()
        || matches!(
            plan,
            Plan::PushDecode { .. }
                | Plan::MooncakeDecode(_)
                | Plan::LmcacheDecode
                | Plan::SglangDecode(_)
        );
    let mode = config.kv_mode;
    if !(remote_kv && crate::kv_load_failure::head_before_kv(mode, &request)) {
        let ids = (request_id.as_str(), header_id.as_deref());
        let pull = (nixl_pull, stuck);
        return serve_completion(inner, &request, plan, pull, ids, rank, faults, guard).await;
    }
    let head_id = header_id.clone();
    let model = request.adapter.as_deref().unwrap_or(&config.model);
    let opening = crate::gen_apis::opening_events(&request, model, &request_id);
    let inner = inner.clone();
    let work = async move {
        let ids = (request_id.as_str(), header_id.as_deref());
        let pull = (nixl_pull, stuck);
        match serve_completion(&inner, &request, plan, pull, ids, rank, faults, guard).await {
            Ok(response) => {
                // The head already went out as a 200 event stream: only such an answer's
                // body may follow it (its own status and headers are dropped here).
                debug_assert_eq!(response.status(), StatusCode::OK);
                debug_assert_eq!(
                    response.headers().get(CONTENT_TYPE),
                    Some(&HeaderValue::from_static(
                        "text/event-stream; charset=utf-8"
                    ))
                );
                debug_assert_eq!(
                    response.headers().get(X_REQUEST_ID),
                    ids.1.and_then(|r| HeaderValue::from_str(r).ok()).as_ref()
                );
                response.into_body()
            }
            // An error after the head is the stream's, as vLLM's generator raises it.
            Err((e, guard)) => {
                let ids = stream_ids(&inner, &request, ids.0, ids.1);
                crate::kv_load_failure::stream(mode, &request, &e, ids, guard).into_body()
            }
        }
    };
    Ok(crate::kv_load_failure::head_first(
        opening,
        &faults,
        work,
        head_id.as_deref(),
    ))
}

/// Prefills (locally or from remote KV), generates and renders the answer. `nixl_pull`:
/// the pull of a NIXL decode; `stuck`: the request waits for KV nobody sends.
#[allow(clippy::too_many_arguments)]
async fn serve_completion(
    inner: &Inner,
    request: &CompletionRequest,
    plan: Plan,
    (nixl_pull, stuck): (NixlPull, bool),
    (request_id, header_id): (&str, Option<&str>),
    rank: usize,
    faults: Faults,
    mut guard: RequestGuard,
) -> Result<Response<SimBody>, (ApiError, RequestGuard)> {
    let config = &inner.config;
    let counters = &inner.counters;
    let params = request.kv_transfer_params.as_ref();
    let is_prefill = matches!(plan, Plan::PushPrefill)
        || matches!(plan, Plan::Nixl) && params.is_some_and(|p| truthy(p.get("do_remote_decode")));
    // A bidirectional NIXL decode answers with a handoff of its own (below).
    let own_handoff = config.decode_handoff
        && config.kv_mode == KvMode::Nixl
        && matches!(plan, Plan::Nixl | Plan::Plain)
        && !request.beam_search
        && !is_prefill;

    if stuck {
        bump(&counters.stuck_kv_waits);
        tracing::debug!(
            request_id,
            "invalid kv_transfer_params: waiting for KV nobody sends"
        );
        // Held until the client leaves; the guard then counts the request as
        // cancelled.
        std::future::pending::<()>().await;
    }

    // vLLM's scheduler: past --max-num-seqs a request waits in the queue, before it
    // pulls any KV; its place is held until the answer ends (the guard keeps it).
    if let Some(slots) = &inner.running_slots {
        let waiting = crate::stats::Waiting::new(counters);
        let place = slots.clone().acquire_owned().await;
        drop(waiting);
        if let Ok(place) = place {
            guard.keep(place);
        }
    }

    if !config.request_delay.is_zero() {
        tokio::time::sleep(config.request_delay).await;
    }

    // KV: fetched from a remote prefill (checked against this prompt's own), or computed
    // here. `None`: this request takes no remote KV.
    let own = || kv_digest(&config.model, config.block_size, request.tokens());
    let handoff_faults = (faults.lose_handoff, faults.fail_transfers);
    let fetched = match &plan {
        Plan::Nixl => match nixl_pull {
            // A lost handoff: the KV is never pulled and the prompt is computed here; the
            // prefill keeps its blocks until their lease expires.
            Some(_) if handoff_faults != (false, false) => {
                guard.disarm();
                if handoff_faults.1 {
                    bump(&counters.failed_transfers);
                }
                tracing::debug!(request_id, "handoff lost by fault injection: recomputing");
                None
            }
            Some(target) => {
                let pulled = match target {
                    Ok(target) => kv::pull(&inner.side_pool, &target).await,
                    Err(e) => Err(e),
                };
                // Pulled (the prefill freed the blocks) or failed: nothing to release.
                guard.disarm();
                Some(pulled.and_then(|remote| kv::check_kv(&remote, &own())))
            }
            None => None,
        },
        // Each element's KV is checked against its own prompt as it arrives.
        Plan::SglangDecode(elements) => {
            Some(sglang::fetch(elements, config.bootstrap_timeout).await)
        }
        Plan::PushDecode { target, .. } => {
            let wait = config.bootstrap_timeout;
            let pushed = match tokio::time::timeout(wait, kv::register_push(target)).await {
                Ok(pushed) => pushed,
                Err(_) => Err(KvTransferError::PeerTimeout(format!(
                    "no prefill paired its KV with this request within {wait:?}"
                ))),
            };
            // Received or failed: nothing to release.
            guard.disarm();
            Some(pushed.and_then(|remote| kv::check_kv(&remote, &own())))
        }
        Plan::MooncakeDecode(remote) => Some(
            mooncake::fetch(remote, config.bootstrap_timeout)
                .await
                .and_then(|remote| kv::check_kv(&remote, &own())),
        ),
        Plan::LmcacheDecode => {
            // The prompt is the ids whose KV was pushed, then the first token.
            let own = kv_digest(
                &config.model,
                config.block_size,
                lmcache_kv_ids(request).iter().copied(),
            );
            match inner.receiver.take(counters, &own) {
                Ok(()) => Some(Ok(())),
                // LMCache finds nothing for this prompt: vLLM computes it itself.
                Err(TakeError::NotPushed) => None,
                Err(TakeError::Mismatch(e)) => Some(Err(e)),
                Err(e @ TakeError::Missing { .. }) => {
                    bump(&counters.kv_missing);
                    tracing::debug!(error = %e, request_id, "LMCache decode refused");
                    // A load error to vLLM's scheduler, as any connector's: a streamed
                    // request fails in its stream.
                    let e = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
                    let ids = stream_ids(inner, request, request_id, header_id);
                    return crate::kv_load_failure::answer(config.kv_mode, request, e, ids, guard);
                }
            }
        }
        // A stuck plan never gets here (it waited above until the client left).
        Plan::Plain
        | Plan::Stuck
        | Plan::PushPrefill
        | Plan::SglangPrefill(_)
        | Plan::MooncakePrefill { .. }
        | Plan::LmcachePrefill(_) => None,
    };
    // A prefill given a decode's own handoff (bidirectional NIXL) pulls that prefix.
    let bidi_pulled = match params.filter(|p| is_prefill && crate::handoff::is_decode_handoff(p)) {
        Some(p) => Some(
            crate::handoff::pull_prefix(
                &inner.side_pool,
                counters,
                config.kv_recompute_threshold,
                p,
                request.prompt_tokens,
                request_id,
            )
            .await,
        ),
        None => None,
    };
    let remote_kv = match fetched {
        Some(Err(e)) => {
            let error = kv_failure(counters, &e, request_id);
            // vLLM's stream sent its head first: the failure is a part of the stream.
            let ids = stream_ids(inner, request, request_id, header_id);
            return crate::kv_load_failure::answer(config.kv_mode, request, error, ids, guard);
        }
        Some(Ok(())) => {
            bump(&counters.remote_decodes);
            counters
                .prompt_tokens_external
                .fetch_add(request.prompt_tokens, std::sync::atomic::Ordering::Relaxed);
            true
        }
        None => false,
    };
    // `usage.prompt_tokens_details.cached_tokens`, with a prefix cache.
    let mut cached_tokens = None;
    if !remote_kv {
        bump(&counters.local_prefills);
        // One prefill at a time on a rank, when its compute is modelled as shared; its
        // queue shows in the rank's load reports.
        let load = LoadReport::waiting(inner, rank, request);
        let _slot = match inner.prefill_slots.get(rank) {
            Some(slot) if config.serial_prefill => {
                let _waiting = crate::stats::Waiting::new(counters);
                Some(slot.lock().await)
            }
            _ => None,
        };
        let _load = load.map(LoadReport::running);
        let mut computed = request
            .prompt_tokens
            .saturating_sub(bidi_pulled.unwrap_or(0));
        if let Some(cache) = &inner.prefix {
            let hit: u64 = request
                .prompts
                .iter()
                .map(|p| cache.lookup(rank, p, counters) as u64)
                .sum();
            cached_tokens = Some(hit);
            computed = computed.saturating_sub(hit);
        }
        if bidi_pulled.is_some() {
            counters.bidi_tokens_computed.fetch_add(computed, Relaxed);
        }
        counters
            .prompt_tokens_local
            .fetch_add(computed, std::sync::atomic::Ordering::Relaxed);
        counters.prompt_tokens_cached.fetch_add(
            request.prompt_tokens - computed,
            std::sync::atomic::Ordering::Relaxed,
        );
        let tokens = u32::try_from(computed).unwrap_or(u32::MAX);
        let delay = config.prefill_delay_per_token.saturating_mul(tokens);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        // The computed blocks are cached once computed.
        if let Some(cache) = &inner.prefix {
            for p in &request.prompts {
                publish(inner, rank, cache.store(rank, p, counters));
            }
        }
    } else if let Some(cache) = &inner.prefix {
        // KV received from a prefill is cached here too, and vLLM counts it as cached
        // (external) prompt tokens.
        for p in &request.prompts {
            publish(inner, rank, cache.store(rank, p, counters));
        }
        cached_tokens = Some(request.prompt_tokens);
    }
    let mut max_tokens = request.max_tokens;
    let lmcache_decode = matches!(plan, Plan::LmcacheDecode);
    let push_prefill = matches!(plan, Plan::PushPrefill);
    let first_tok = matches!(plan, Plan::LmcachePrefill(_)) && lmcache::ret_first_tok(params);
    match plan {
        Plan::Nixl | Plan::PushPrefill if is_prefill => bump(&counters.prefill_requests),
        Plan::SglangPrefill(elements) => {
            bump(&counters.prefill_requests);
            if let Err(e) = hand_over_rooms(inner, &elements).await {
                return Err((e, guard));
            }
            // The prefill answers with the first token only.
            max_tokens = 1;
        }
        Plan::MooncakePrefill { key } => {
            bump(&counters.prefill_requests);
            let digest = kv_digest(&config.model, config.block_size, request.tokens());
            let entry = vec![(key.clone(), digest)];
            match inner
                .transfers
                .register(counters, entry, Some(config.kv_lease))
            {
                Ok(registration) => {
                    // A client that leaves before the answer gets no KV held for it.
                    let transfers = inner.transfers.clone();
                    let counters = inner.counters.clone();
                    let owner = registration.owner;
                    guard.on_cancel(move || transfers.withdraw(&counters, [&key], owner));
                }
                Err((_, transfer_id)) => {
                    let e = ApiError::bad_request(format!(
                        "Mooncake: transfer_id {transfer_id:?} is already in use"
                    ));
                    return Err((e, guard));
                }
            }
        }
        Plan::LmcachePrefill(Some(spec)) => {
            bump(&counters.prefill_requests);
            let digest = kv_digest(&config.model, config.block_size, request.tokens());
            if let Err(e) = push_and_notify(inner, &spec, &digest, faults).await {
                return Err((e, guard));
            }
        }
        _ => {}
    }

    // Generation. An LMCache decode continues after the last prompt token,
    // the first token of the answer the prefill computed.
    let gen_params = GenParams {
        start: usize::from(lmcache_decode),
        max_tokens: max_tokens as usize,
        min_tokens: request.min_tokens.min(max_tokens) as usize,
        eos_period: config.eos_period,
        ignore_eos: request.ignore_eos,
        stop: &request.stop,
        include_stop_str_in_output: request.include_stop_str_in_output,
    };
    let mut choices: Vec<Generation> =
        Vec::with_capacity(request.prompts.len() * request.n as usize);
    for prompt in &request.prompts {
        let hash = if lmcache_decode {
            ids_hash(lmcache_kv_ids(request))
        } else {
            ids_hash(prompt)
        };
        for i in 0..request.n {
            choices.push(generate_choice(hash, i, &gen_params));
        }
    }

    // A prefill keeps its KV for the decode, however it finished (vLLM 0.33's pull
    // and push schedulers keep the blocks of a request that stopped as of one that hit
    // its length), unless a fault makes it answer unusable parameters, or none, instead.
    let malformed = is_prefill && faults.malformed_kv_params;
    let withheld = malformed || faults.withhold_kv_params;
    let kv_out = if is_prefill && !withheld {
        let digest = kv_digest(&config.model, config.block_size, request.tokens());
        let side = Side::of(inner, rank);
        let held = HeldKv {
            engine_id: side.engine_id,
            host: &inner.advertised_host,
            port: side.port,
            held: side.kv.hold(counters, request_id, digest, config.kv_lease),
            tokens: request.prompt_tokens,
        };
        Some(KvParamsOut::prefill(held, push_prefill))
    } else {
        None
    };

    // The decode holds its request's blocks for the next turn's prefill to pull.
    let own_handoff = own_handoff.then(|| {
        let generated: u64 = choices.iter().map(|c| c.steps.len() as u64).sum();
        let digest = kv_digest(&config.model, config.block_size, request.tokens());
        let ttl = config.decoder_kv_blocks_ttl;
        let side = Side::of(inner, rank);
        crate::handoff::own(crate::handoff::Own {
            kv: HeldKv {
                engine_id: side.engine_id,
                host: &inner.advertised_host,
                port: side.port,
                held: side.kv.hold(counters, request_id, digest, ttl),
                tokens: request.prompt_tokens + generated,
            },
            uptime: inner.started.elapsed(),
            ttl,
        })
    });

    if let Some(native) = request.native {
        let native = crate::native::NativeParts {
            native,
            choices,
            computed_prompt: !remote_kv,
            cached_tokens,
        };
        return crate::native::answer(&inner.config, request, native, request_id, faults, guard)
            .map(|mut response| {
                if let Some(value) = header_id.and_then(|r| HeaderValue::from_str(r).ok()) {
                    response.headers_mut().insert(X_REQUEST_ID, value);
                }
                response
            });
    }

    // The answer names the LoRA adapter the request named, as vLLM's does.
    let model = request.adapter.as_deref().unwrap_or(&config.model);
    if let (Some(api), true) = (request.gen_api, request.stream) {
        let answer = crate::gen_apis::Answer {
            api,
            request_id,
            choices: &choices,
            model,
            prompt_tokens: request.prompt_tokens,
            responses: request.responses.as_deref().map(|r| (r, max_tokens)),
            // A stream carries a handoff only on `/v1/responses` (its terminal event).
            kv_transfer_params: own_handoff
                .as_ref()
                .and_then(|h| serde_json::to_value(h).ok()),
        };
        // Echoing the `X-Request-Id`, as vLLM's middleware does on every answer (and as
        // the head a streamed decode sent first did: `serve_or_defer`).
        return answer
            .stream(config.inter_token_delay, faults, guard)
            .map(|mut response| {
                if let Some(value) = header_id.and_then(|r| HeaderValue::from_str(r).ok()) {
                    response.headers_mut().insert(X_REQUEST_ID, value);
                }
                response
            });
    }
    let id = answer_id(request.endpoint, request_id);
    let created = unix_now();

    // vLLM's completions route fails on its first output given `"max_tokens": null`.
    let null_limit = request.null_max_tokens && request.gen_api.is_none();
    if request.stream && null_limit {
        let delay = config.inter_token_delay;
        return Ok(crate::null_limit::stream(delay, header_id, guard));
    }
    if request.stream {
        let completion_tokens = choices.iter().map(|c| c.steps.len() as u64).sum();
        let spec = SseSpec {
            endpoint: request.endpoint,
            id,
            created,
            model_json: model_json(inner, request),
            choices,
            usage: request
                .include_usage
                .then_some((request.prompt_tokens, completion_tokens)),
            cached_tokens,
            delay: config.inter_token_delay,
            drop_after: faults.drop_after_chunks,
            stall_after: faults.stall_after_chunks,
            handoff: own_handoff
                .as_ref()
                .and_then(|h| serde_json::to_string(h).ok()),
            prompt_token_ids: (request.return_token_ids && request.endpoint == Endpoint::Chat)
                .then(|| match faults.prompt_token_ids {
                    Some(raw) => raw.to_owned(),
                    None => Value::from(request.prompts.first().cloned().unwrap_or_default())
                        .to_string(),
                }),
            return_token_ids: request.return_token_ids,
            choice_prompt_ids: if request.return_token_ids
                && request.endpoint == Endpoint::Completions
            {
                request
                    .prompts
                    .iter()
                    .flat_map(|p| {
                        let json = Value::from(p.clone()).to_string();
                        std::iter::repeat_n(json, request.n as usize)
                    })
                    .collect()
            } else {
                Vec::new()
            },
            // vLLM counts each choice's own prompt (completions: choices are laid
            // out prompt by prompt, `n` each).
            choice_prompt_tokens: if request.continuous_usage {
                request
                    .prompts
                    .iter()
                    .flat_map(|p| std::iter::repeat_n(p.len() as u64, request.n as usize))
                    .collect()
            } else {
                Vec::new()
            },
            error: None,
            usage_after_error: false,
        };
        let mut response = Response::new(SimBody::Sse(Box::new(SseBody::new(spec, guard))));
        let headers = response.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream; charset=utf-8"),
        );
        if let Some(value) = header_id.and_then(|r| HeaderValue::from_str(r).ok()) {
            headers.insert(X_REQUEST_ID, value);
        }
        return Ok(response);
    }

    let steps = choices.iter().map(|c| c.steps.len()).max().unwrap_or(0);
    if steps > 1 && !config.inter_token_delay.is_zero() {
        let steps = u32::try_from(steps - 1).unwrap_or(u32::MAX);
        tokio::time::sleep(config.inter_token_delay.saturating_mul(steps)).await;
    }
    // ... and on its finished answer.
    if null_limit {
        return Err((crate::null_limit::error(), guard));
    }
    if kv_out.is_some() {
        bump(&counters.kv_params_returned);
    }
    // A partial handoff, under the fault: the dict less what the fault names.
    let partial = match (&kv_out, faults.partial_kv_params) {
        (Some(params), Some(shape)) => match serde_json::to_value(params) {
            Ok(Value::Object(mut dict)) => {
                shape.apply(&mut dict);
                Some(Value::Object(dict))
            }
            _ => None,
        },
        _ => None,
    };
    let kv_field = match &kv_out {
        Some(_) if partial.is_some() => partial.as_ref().map(KvParamsField::Partial),
        Some(params) => Some(KvParamsField::Params(params)),
        None if malformed => Some(KvParamsField::Malformed(MALFORMED_KV_PARAMS)),
        None if first_tok => Some(KvParamsField::FirstTok(FirstTok {
            first_tok: choices
                .first()
                .and_then(|c| c.ids.first().copied())
                .unwrap_or(EOS_TOKEN_ID),
        })),
        None => own_handoff.as_ref().map(KvParamsField::Params),
    };
    // `return_token_ids` on chat: the prompt's ids, or what the fault answers.
    let prompt_token_ids =
        (request.return_token_ids && request.endpoint == Endpoint::Chat).then(|| {
            match faults.prompt_token_ids {
                Some(raw) => serde_json::from_str(raw).unwrap_or(Value::Null),
                None => Value::from(request.prompts.first().cloned().unwrap_or_default()),
            }
        });
    let answer = Answer {
        endpoint: request.endpoint,
        id: &id,
        created,
        model,
        choices: &choices,
        prompt_tokens: request.prompt_tokens,
        cached_tokens,
        kv_transfer_params: kv_field,
        prompt_token_ids: prompt_token_ids.as_ref(),
    };
    let rendered = match request.gen_api {
        Some(api) => crate::gen_apis::Answer {
            api,
            request_id,
            choices: &choices,
            model,
            prompt_tokens: request.prompt_tokens,
            responses: request.responses.as_deref().map(|r| (r, max_tokens)),
            kv_transfer_params: kv_field.and_then(|f| serde_json::to_value(f).ok()),
        }
        .whole(),
        None => answer.render(),
    };
    let body = match rendered {
        Ok(body) => Bytes::from(body),
        Err(e) => {
            return Err((
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
                guard,
            ));
        }
    };
    let response = if faults.stall_after_chunks.is_some() {
        let len = body.len();
        let mut response = json_response(
            StatusCode::OK,
            SimBody::Stalled {
                data: Some(body),
                _guard: guard,
            },
            header_id,
        );
        response
            .headers_mut()
            .insert(CONTENT_LENGTH, HeaderValue::from(len));
        response
    } else if faults.drop_after_chunks.is_some() {
        let len = body.len();
        let mut response = json_response(
            StatusCode::OK,
            SimBody::Truncated {
                data: Some(body),
                guard: Some(guard),
                flushed: false,
            },
            header_id,
        );
        response
            .headers_mut()
            .insert(CONTENT_LENGTH, HeaderValue::from(len));
        response
    } else {
        json_response(
            StatusCode::OK,
            SimBody::Full {
                data: Some(body),
                guard: Some(guard),
            },
            header_id,
        )
    };
    Ok(response)
}
