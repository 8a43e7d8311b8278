//! Engine configuration and fault injection knobs.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

/// Configuration of a [`SimEngine`](crate::SimEngine).
///
/// Every field has a sensible default (see [`SimConfig::default`]), so the
/// usual way to build one is struct-update syntax:
///
/// ```
/// use std::time::Duration;
/// use disagg_sim::SimConfig;
///
/// let config = SimConfig {
///     inter_token_delay: Duration::from_millis(5),
///     ..SimConfig::default()
/// };
/// assert_eq!(config.model, "sim-model");
/// ```
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Served model name (`"sim-model"` by default). Requests naming another
    /// model (nor a LoRA adapter loaded with `POST /v1/load_lora_adapter`) are
    /// answered with 404, like vLLM.
    pub model: String,
    /// The engine id put in `kv_transfer_params.remote_engine_id` (NIXL) and
    /// answered by a Mooncake prefill's bootstrap server. With several
    /// [`dp_size`](Self::dp_size) ranks, rank `r`'s is `"{engine_id}_dp{r}"`, as vLLM
    /// names each rank's engine core ([`SimEngine::engine_ids`](crate::SimEngine::engine_ids)).
    /// `None` (the default) draws a random UUID at start.
    pub engine_id: Option<String>,
    /// The `remote_host` advertised in `kv_transfer_params` (and the host of a
    /// Mooncake prefill's `worker_addr`). A decode engine connects to this host and
    /// the side channel port to pull the KV blocks. Empty (the default): the address
    /// the side channel listens on ([`SimConfig::bind_host`] with
    /// [`SimEngine::start`](crate::SimEngine::start)), or `127.0.0.1` when that
    /// address is unspecified (`0.0.0.0`, `::`), as vLLM advertises the
    /// `VLLM_NIXL_SIDE_CHANNEL_HOST` it listens on. Read the result with
    /// [`SimEngine::advertised_host`](crate::SimEngine::advertised_host).
    pub advertised_host: String,
    /// The address [`SimEngine::start`](crate::SimEngine::start) binds the HTTP
    /// server, the side channels, the bootstrap server and the EC push ports on
    /// (default `127.0.0.1`; [`SimEngine::start_on`](crate::SimEngine::start_on)
    /// binds the bootstrap server here). Give each engine of a test its own loopback
    /// address (Linux routes all of `127.0.0.0/8` to the loopback interface, e.g.
    /// `127.0.0.2` for a prefill and `127.0.0.3` for its decode) and a handoff that
    /// names the wrong engine's host fails, as it would between machines, instead of
    /// reaching the right socket by the port alone. The LMCache receiver ports
    /// ([`SimConfig::lmcache_receiver`]) and the KV-event sockets
    /// ([`SimConfig::kv_events`]) have hosts of their own.
    pub bind_host: IpAddr,
    /// Time to prefill one prompt token locally (default zero).
    pub prefill_delay_per_token: Duration,
    /// Time between two generated tokens (default zero).
    pub inter_token_delay: Duration,
    /// Number of tokens generated when the request names no maximum
    /// (default 16).
    pub default_max_tokens: u32,
    /// An end-of-sequence token is drawn at a position with probability
    /// `1/eos_period`, deterministically from the prompt; `0` (the default)
    /// means never.
    pub eos_period: u32,
    /// How long a prefill keeps KV blocks nobody pulled (default 30 s, like
    /// vLLM's `kv_lease_duration`); in [`KvMode::Lmcache`], how long a decode
    /// keeps received KV no request took; with [`SimConfig::ec_push`], how long a
    /// consumer keeps pushed encoder outputs no request took.
    pub kv_lease: Duration,
    /// Prompt tokens per KV block (default 16).
    pub block_size: usize,
    /// Context length of the model (default 8192): prompt plus requested
    /// completion tokens beyond it are rejected with 400.
    pub max_model_len: u32,
    /// How many of the last completion requests [`SimEngine::requests`]
    /// keeps (default 256; 0 records nothing, which the benchmarks use). They are
    /// also kept within 64 MiB (paths, headers and bodies; the newest request always):
    /// beyond it the oldest are forgotten first.
    ///
    /// [`SimEngine::requests`]: crate::SimEngine::requests
    pub record_requests: usize,
    /// Faults injected into the completion routes.
    pub faults: Faults,
    /// Which P/D KV protocol the engine speaks (default [`KvMode::Nixl`]).
    pub kv_mode: KvMode,
    /// How long a side waits for its peer (default 300 s, like SGLang's
    /// `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT` and `..._WAITING_TIMEOUT`):
    /// a decode for the prefill's room or transfer id, a bootstrap server or
    /// side channel for the room or transfer id a decode asks for, an SGLang
    /// prefill for a decode to take its KV. Unused in [`KvMode::Nixl`].
    pub bootstrap_timeout: Duration,
    /// Fixed time before the engine starts working on any completion request
    /// (scheduling, queueing), before the prefill, in every mode (default
    /// zero).
    pub request_delay: Duration,
    /// Data-parallel ranks (default 1). Values below 1 count as 1. Every
    /// completion request is placed on one rank, as the engine would
    /// (counted in [`Stats::requests_per_dp_rank`](crate::Stats::requests_per_dp_rank)):
    /// a vLLM engine takes the `X-data-parallel-rank` header, else its own
    /// load balancer picks; an SGLang engine reads the rank from the request
    /// or its own balancer (see the crate's "Data-parallel ranks" section).
    /// Each rank has its own engine id (see
    /// [`SimEngine::engine_ids`](crate::SimEngine::engine_ids)); a vLLM NIXL engine's
    /// ranks have a side channel each, on consecutive ports
    /// ([`SimEngine::side_channel_addrs`](crate::SimEngine::side_channel_addrs)), and
    /// an SGLang prefill registers each room under the rank that computed it.
    pub dp_size: u32,
    /// vLLM NIXL decode: whether a decode aborted before its KV pull tells the
    /// prefill to free the blocks (default `true`, as vLLM's decode does since
    /// it handles aborted remote-prefill requests). `false` models an engine
    /// that leaves them to the prefill's lease, which is what a proxy's early
    /// release ([`KvRelease`] in disagg-core) is for.
    ///
    /// [`KvRelease`]: https://docs.rs/disagg-core/latest/disagg_core/orchestrator/enum.KvRelease.html
    pub release_on_abort: bool,
    /// vLLM NIXL: answer every request that is not a prefill leg with a
    /// `kv_transfer_params` of the engine's own (`do_remote_decode: true`, its engine id,
    /// advertised host, side-channel port, block ids and request id), as a decode running
    /// vLLM 0.33's bidirectional NIXL (`bidirectional_kv_xfer`) does: in a non-streamed
    /// answer, on each choice's terminal stream chunk (the one with `finish_reason`),
    /// and in the `response` of a Responses answer (whole, and the stream's terminal
    /// event). Default `false`: `null`, as a plain decode answers.
    pub decode_handoff: bool,
    /// vLLM NIXL with [`decode_handoff`](Self::decode_handoff): how long a decode holds
    /// the blocks its own handoff names for a later prefill to pull (vLLM's
    /// `kv_connector_extra_config.decoder_kv_blocks_ttl`, default 480 s); a pull after
    /// it fails and the prefill computes the prompt itself.
    pub decoder_kv_blocks_ttl: Duration,
    /// vLLM NIXL prefill given a decode's own handoff (`do_remote_decode: true` with
    /// the decode's engine id, host, port and blocks): it pulls that prefix only when
    /// the handoff's `remote_num_tokens` is at least this many tokens (vLLM's
    /// `kv_recompute_threshold`, default 64), else computes it.
    pub kv_recompute_threshold: u64,
    /// LMCache prefill: where the proxy's ZMQ `PULL` socket listens for
    /// `ProxyNotif` messages, as `HOST:PORT` (LMCache's `pd_proxy_host` and
    /// `pd_proxy_port`). Default `None`: a prefill request with a
    /// `disagg_spec` is then answered 500. Unused in the other modes.
    pub lmcache_proxy: Option<String>,
    /// LMCache decode: the receiver ports it listens on, per TP rank
    /// (LMCache's `pd_peer_host`, `pd_peer_init_port`,
    /// `pd_peer_alloc_port`). Unused in the other modes.
    pub lmcache_receiver: LmcacheReceiver,
    /// Seed of the engine's own random generator behind
    /// [`Faults::notify_loss`] (default 0): the same seed and the same
    /// sequence of notifications lose the same ones.
    pub notify_seed: u64,
    /// vLLM's `--max-logprobs` (default 20, vLLM's default): a request
    /// asking for more logprobs per token (`top_logprobs` with chat's
    /// `logprobs: true`, completions' `logprobs`, `prompt_logprobs`; `-1`
    /// counts as the whole vocabulary) is answered 400. Unused by SGLang
    /// engines, which take `top_logprobs: 50`.
    pub max_logprobs: u32,
    /// LMCache prefill: its tensor-parallel size. Each TP rank of an LMCache
    /// prefill pushes its share of the KV to the receiver port its own rank
    /// indexes in the `disagg_spec` (`receiver_init_port[rank]`,
    /// `receiver_alloc_port[rank]`) and sends the proxy one notification.
    /// `None` (the default): as many ranks as the `disagg_spec` names ports,
    /// the only pairing that works. With fewer ranks, the ports beyond them
    /// get nothing: the proxy waits for notifications that never come and
    /// the decode misses that KV. With more, the ranks beyond the port list
    /// fail (LMCache indexes the list out of range): the request answers 500
    /// after the other ranks pushed and notified.
    pub lmcache_prefill_tp_size: Option<usize>,
    /// Blocks of [`SimConfig::block_size`] tokens each data-parallel rank keeps in its
    /// prefix cache, least recently used evicted first; 0 (the default) for none. With
    /// a cache, a local prefill computes (and waits
    /// [`SimConfig::prefill_delay_per_token`] for) only the tokens after its cached
    /// prefix, answers `usage.prompt_tokens_details.cached_tokens`, and counts its hits
    /// in [`Stats::prefix_cache_hit_tokens`](crate::Stats::prefix_cache_hit_tokens). See
    /// the crate's "Prefix cache and KV events" section.
    pub prefix_cache_blocks: usize,
    /// Publish KV-cache events about the prefix cache over ZMQ, as vLLM's
    /// `--kv-events-config` does (default `None`: no sockets). Needs
    /// [`SimConfig::prefix_cache_blocks`].
    pub kv_events: Option<crate::KvEventsConfig>,
    /// Run one local prefill at a time per data-parallel rank (default `false`: every
    /// request prefills at once). A GPU's compute is shared by the prompts it
    /// prefills, so a busy engine's time to first token includes the prefills queued
    /// ahead; with this, a prefill waits for the ones before it.
    pub serial_prefill: bool,
    /// vLLM's `--max-num-seqs` (SGLang's `--max-running-requests`; default `None`: no
    /// limit): at most this many requests run at once; the others wait in the
    /// scheduler's queue (counted waiting in `/metrics`) before any work, so a decode
    /// pulls a request's KV only once the request runs, and the prefill keeps holding it
    /// meanwhile (it expires past [`SimConfig::kv_lease`]).
    pub max_num_seqs: Option<usize>,
    /// vLLM's `--api-key` (default `None`): a request whose path starts with `/v1`
    /// must carry `Authorization: Bearer KEY` (scheme in any case, one space, the key
    /// exactly), else it is answered 401 `{"error": "Unauthorized"}`; other paths
    /// (`/health`, `/tokenize`, the bootstrap servers) stay open, as in vLLM
    /// (`vllm-project/vllm vllm/entrypoints/openai/server_utils.py`,
    /// `AuthenticationMiddleware`). Requests without the key are counted in
    /// [`Stats::requests_without_key`](crate::Stats::requests_without_key) whatever
    /// their path, so a test can tell whether a client sent it.
    pub api_key: Option<String>,
    /// Encoder disaggregation (vLLM's `--ec-transfer-config` with its shared-storage
    /// connector): an encoder-only engine or a consumer of the encoders' output, and
    /// the directory they share (see the crate's `ec` module). Default `None`: media
    /// parts are served as placeholder text, nothing is read or written.
    pub ec: Option<crate::ec::EcConfig>,
    /// Encoder disaggregation by push, as vLLM's Mooncake EC connector (the crate's
    /// `ec_push` module): a consumer listens on an EC port per data-parallel rank
    /// ([`SimEngine::ec_push_ports`](crate::SimEngine::ec_push_ports)) and takes its
    /// requests' items only from what was pushed to the port of the rank serving them,
    /// under the transfer ids they name; an encoder pushes the items of a leg naming a `consumer_zmq`. Default
    /// `false` (the shared store).
    pub ec_push: bool,
    /// The EC port of a push consumer's first data-parallel rank (vLLM's `ec_port`),
    /// the other ranks' following it; `None` (the default): a free run of ports, read
    /// back with [`SimEngine::ec_push_ports`](crate::SimEngine::ec_push_ports).
    pub ec_push_port: Option<u16>,
    /// How long a push consumer's request waits for each transfer it names (vLLM's
    /// `push_wait_timeout_s`, default 60 s).
    pub ec_push_wait: Duration,
    /// What `GET /version` answers as `{"version": ...}` (default `"0.33.0"`, the vLLM
    /// release the simulator follows): set it to model a prefill and a decode of
    /// different engine builds, which vLLM's NIXL handshake refuses to pair.
    pub version: String,
    /// Serve the OpenAI HTTP server over TLS, as vLLM's `--ssl-certfile`,
    /// `--ssl-keyfile` and `--ssl-ca-certs` with `--ssl-cert-reqs 2` do (default
    /// `None`: plain HTTP). Needs the crate's `tls` feature. The side channel and the
    /// bootstrap servers stay plain, as they are in the engines.
    pub tls: Option<SimTls>,
    /// How long a client of the OpenAI server (and of a Mooncake prefill's bootstrap
    /// server) may take to send a request head, counted from when the connection is
    /// ready for one: its opening, or the end of the previous answer on a kept-alive
    /// connection (default 30 s, hyper's own default). Past it the connection is closed
    /// without an answer, so it also closes a kept-alive connection idle that long
    /// (vLLM's uvicorn closes one idle for 5 s, its `timeout_keep_alive`, and has no
    /// limit on a head: set 5 s here to model its keep-alive).
    pub header_read_timeout: Duration,
    /// How long a client may take to send a request's whole body, counted from its
    /// head (default 30 s). Past it the request is answered 408 in OpenAI's error shape
    /// with `connection: close`, and it was never counted as running. vLLM's uvicorn
    /// has no such limit (it waits for the body as long as the client takes).
    pub body_read_timeout: Duration,
}

/// The certificate an engine serves HTTPS with ([`SimConfig::tls`]), as PEM.
#[derive(Clone, PartialEq, Eq)]
pub struct SimTls {
    /// The certificate chain, end-entity first.
    pub cert_pem: String,
    /// Its private key.
    pub key_pem: String,
    /// When set, a client must present a certificate signed by one of these CAs
    /// (mutual TLS), else the handshake fails.
    pub client_ca_pem: Option<String>,
}

impl fmt::Debug for SimTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the private key.
        f.debug_struct("SimTls")
            .field("client_ca", &self.client_ca_pem.is_some())
            .finish_non_exhaustive()
    }
}

/// The receiver ports of an LMCache decode ([`KvMode::Lmcache`] with
/// [`SimRole::Decode`]): one init port and one alloc port per tensor-parallel
/// rank, the lists indexed by rank. A port 0 is an ephemeral one; the bound
/// ports are
/// [`SimEngine::lmcache_init_ports`](crate::SimEngine::lmcache_init_ports)
/// and
/// [`SimEngine::lmcache_alloc_ports`](crate::SimEngine::lmcache_alloc_ports).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LmcacheReceiver {
    /// The address the ports are bound on (default 127.0.0.1).
    pub host: IpAddr,
    /// Init port of each rank (LMCache's `pd_peer_init_port`).
    pub init_ports: Vec<u16>,
    /// Alloc port of each rank (LMCache's `pd_peer_alloc_port`); as many as
    /// `init_ports`.
    pub alloc_ports: Vec<u16>,
}

impl LmcacheReceiver {
    /// `tp_size` ranks (at least one) on ephemeral ports of 127.0.0.1.
    pub fn ephemeral(tp_size: usize) -> Self {
        let n = tp_size.max(1);
        Self {
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            init_ports: vec![0; n],
            alloc_ports: vec![0; n],
        }
    }
}

impl Default for LmcacheReceiver {
    /// One rank on ephemeral ports of 127.0.0.1.
    fn default() -> Self {
        Self::ephemeral(1)
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            model: "sim-model".to_owned(),
            engine_id: None,
            advertised_host: String::new(),
            bind_host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            prefill_delay_per_token: Duration::ZERO,
            inter_token_delay: Duration::ZERO,
            default_max_tokens: 16,
            eos_period: 0,
            kv_lease: Duration::from_secs(30),
            block_size: 16,
            max_model_len: 8192,
            record_requests: 256,
            faults: Faults::default(),
            kv_mode: KvMode::Nixl,
            bootstrap_timeout: Duration::from_secs(300),
            request_delay: Duration::ZERO,
            dp_size: 1,
            release_on_abort: true,
            decode_handoff: false,
            decoder_kv_blocks_ttl: Duration::from_secs(480),
            kv_recompute_threshold: 64,
            lmcache_proxy: None,
            lmcache_receiver: LmcacheReceiver::default(),
            notify_seed: 0,
            max_logprobs: 20,
            lmcache_prefill_tp_size: None,
            prefix_cache_blocks: 0,
            kv_events: None,
            serial_prefill: false,
            max_num_seqs: None,
            api_key: None,
            ec: None,
            ec_push: false,
            ec_push_port: None,
            ec_push_wait: Duration::from_secs(60),
            version: crate::surface::VERSION.to_owned(),
            tls: None,
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(30),
        }
    }
}

/// What a prefill's handoff lacks under [`Faults::partial_kv_params`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PartialKv {
    /// No `remote_block_ids` key.
    NoBlockIds,
    /// `"remote_block_ids": []`.
    EmptyBlockIds,
    /// No `remote_engine_id` key.
    NoEngineId,
    /// No `remote_request_id` key.
    NoRequestId,
    /// No `remote_host` key.
    NoHost,
    /// No `remote_port` key.
    NoPort,
}

impl PartialKv {
    /// Every shape, for tests that try them all.
    pub const ALL: [PartialKv; 6] = [
        PartialKv::NoBlockIds,
        PartialKv::EmptyBlockIds,
        PartialKv::NoEngineId,
        PartialKv::NoRequestId,
        PartialKv::NoHost,
        PartialKv::NoPort,
    ];

    /// The key this shape removes or empties.
    pub fn key(self) -> &'static str {
        match self {
            PartialKv::NoBlockIds | PartialKv::EmptyBlockIds => "remote_block_ids",
            PartialKv::NoEngineId => "remote_engine_id",
            PartialKv::NoRequestId => "remote_request_id",
            PartialKv::NoHost => "remote_host",
            PartialKv::NoPort => "remote_port",
        }
    }

    /// `params` (a prefill's handoff dict) as this shape has it.
    pub(crate) fn apply(self, params: &mut serde_json::Map<String, serde_json::Value>) {
        match self {
            PartialKv::EmptyBlockIds => {
                params.insert(self.key().to_owned(), serde_json::Value::Array(Vec::new()));
            }
            _ => {
                params.remove(self.key());
            }
        }
    }
}

/// Which prefill/decode KV protocol an engine speaks.
///
/// See the [crate documentation](crate) for each protocol on the wire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum KvMode {
    /// vLLM's NIXL connector, pull mode: the prefill answers with
    /// `kv_transfer_params` naming its KV blocks and the decode, sent
    /// afterwards, pulls them over the side channel. One engine plays both
    /// roles, as the request's `kv_transfer_params` say.
    #[default]
    Nixl,
    /// SGLang started with `--disaggregation-mode prefill|decode`: the router
    /// sends the same request, with `bootstrap_host`, `bootstrap_port` and
    /// `bootstrap_room`, to both engines at once; the decode fetches the KV of
    /// each room from the prefill's bootstrap server.
    Sglang(SimRole),
    /// vLLM's (newer, concurrent) MooncakeConnector with `kv_role`
    /// `kv_producer` ([`SimRole::Prefill`]) or `kv_consumer`
    /// ([`SimRole::Decode`]): the proxy sends both legs at once, correlated by
    /// a proxy-chosen `transfer_id`; the decode looks the prefill's engine id
    /// up on its bootstrap server and pulls the KV over the side channel.
    Mooncake(SimRole),
    /// vLLM with `LMCacheConnectorV1` and LMCache's P/D mode (`enable_pd`),
    /// as `kv_producer` ([`SimRole::Prefill`], LMCache's `pd_role: sender`)
    /// or `kv_consumer` ([`SimRole::Decode`], `pd_role: receiver`): the
    /// proxy tokenizes the prompt, sends it as token ids to the prefill with
    /// a `disagg_spec` naming the decode's receiver ports, the prefill pushes
    /// the KV to every receiver rank and tells the proxy over ZMQ, and the
    /// proxy then sends the decode the ids followed by the first token.
    Lmcache(SimRole),
    /// vLLM's `NixlPushConnector`: the prefill writes the KV into the
    /// decode's blocks. The decode registers its request over the prefill's
    /// side channel under its own request id; the prefill pairs the
    /// registration with a finished request whose id has the same base (the
    /// id minus vLLM's `-` and 8 hex digits suffix), so both legs need the
    /// same `X-Request-Id`, unique among requests in flight. One engine
    /// plays both roles, as the request's `kv_transfer_params` say. See the
    /// crate's "vLLM NIXL push" section.
    NixlPush,
}

impl KvMode {
    /// Whether the engine is a vLLM one (every mode but [`KvMode::Sglang`]):
    /// it validates requests like vLLM and honours `use_beam_search`.
    pub fn is_vllm(self) -> bool {
        !matches!(self, KvMode::Sglang(_))
    }

    /// Whether this engine runs a bootstrap server
    /// ([`SimEngine::bootstrap_addr`](crate::SimEngine::bootstrap_addr)):
    /// SGLang and Mooncake prefills do.
    pub fn has_bootstrap_server(self) -> bool {
        matches!(
            self,
            KvMode::Sglang(SimRole::Prefill) | KvMode::Mooncake(SimRole::Prefill)
        )
    }
}

/// The role of an engine in a protocol where engines are started as either
/// prefill or decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimRole {
    /// Computes prompts' KV and hands it to decodes.
    Prefill,
    /// Takes KV from a prefill and generates.
    Decode,
}

/// Faults injected into the completion routes (`/v1/completions` and
/// `/v1/chat/completions`); `/health`, `/v1/models` and `/stats` keep
/// working. They can be changed at run time with
/// [`SimEngine::set_faults`](crate::SimEngine::set_faults): a request sees
/// the faults of the moment it arrived.
///
/// Precedence, when several are set: `status` wins over everything (the
/// request is answered at once, before any KV work); then `hang` (nothing is
/// answered); then `stall_after_chunks` wins over `drop_after_chunks` (the
/// connection is never dropped after a stall). `malformed_kv_params` only
/// changes the body of a vLLM NIXL prefill's answer and combines with the
/// two body faults.
///
/// What a proxy's fault matrix can inject with them, per connector:
///
/// | fault | how |
/// |---|---|
/// | connection refused | a port nobody listens on (no engine needed) |
/// | 500, 503, any status | `status` |
/// | hang before the response head | `hang` |
/// | hang mid-stream (or mid-body) | `stall_after_chunks` |
/// | connection dropped mid-stream (or mid-body) | `drop_after_chunks` |
/// | slow prefill, beyond a budget | [`SimConfig::prefill_delay_per_token`], [`SimConfig::request_delay`] |
/// | malformed `kv_transfer_params` (vLLM NIXL) | `malformed_kv_params` |
/// | a partial handoff (vLLM NIXL: no block ids, no engine id, host, port...) | `partial_kv_params` |
/// | no handoff at all, `null` (vLLM NIXL) | `withhold_kv_params` |
/// | an answer naming a sequence the request lacks (SGLang `/generate`) | `generate_index` |
/// | an event without its end, of any size (SGLang `/generate`) | `unterminated_event` |
/// | `/tokenize` hangs | `hang_tokenize` |
/// | `GET /health` fails | `health_status` |
/// | an encoder's answer without its `ec_transfer_params` (E/P/D) | `ec_withhold_params` |
/// | KV-ready notification late, lost or repeated (LMCache) | `notify_delay`, `notify_loss`, `notify_duplicates` |
/// | bootstrap never met (SGLang, Mooncake) | a decode whose prefill never gets the request: it fails after [`SimConfig::bootstrap_timeout`], counted in [`Stats::bootstrap_timeouts`](crate::Stats::bootstrap_timeouts): a 500 (a streamed vLLM decode: its 200 head at once, the failure in its stream then) |
/// | a decode's failed KV transfer, as SGLang answers it (wrong room, host or port, prefill gone, bootstrap timeout) | an SGLang decode ([`KvMode::Sglang`]) fails it as SGLang 0.5.23 does: not streamed, a 500 `{"object":"error","message":..,"type":"500","param":null,"code":500}`; a streamed `/generate`, its 200 head at once, then one event per element whose `meta_info.finish_reason` is `{"type":"abort","message":..,"status_code":500,"err_type":null}`, then `data: [DONE]`; a streamed chat or completions request, a 200 head with the failure, `data: {"error": {..., "type": "INTERNAL_SERVER_ERROR", ..., "code": 500}}`, the usage chunk if asked for, then `data: [DONE]` (the `kv_load_failure` module's facts in the source) |
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Faults {
    /// Answer every completion request with this HTTP status and a vLLM
    /// error body.
    pub status: Option<u16>,
    /// Accept completion requests and never answer, until the client leaves
    /// (counted in [`Stats::cancelled`](crate::Stats::cancelled)).
    pub hang: bool,
    /// Streaming: after this many SSE events, abort the connection (no
    /// `[DONE]`, no clean end of the chunked body), on the OpenAI routes, on SGLang's
    /// `/generate` and on vLLM's other generation routes (`/v1/messages`,
    /// `/v1/responses`, `/cohere/v2/chat`, `/inference/v1/generate`). Non-streaming:
    /// abort the connection before the body is complete.
    pub drop_after_chunks: Option<usize>,
    /// Streaming: after this many SSE events (`Some(0)`: right after the
    /// response head), send nothing more but keep the connection open until
    /// the client leaves. Non-streaming: send the head (with the full
    /// `content-length`) and half the body, then hang likewise. The request
    /// counts as cancelled ([`Stats::cancelled`](crate::Stats::cancelled))
    /// when the client leaves.
    pub stall_after_chunks: Option<usize>,
    /// vLLM NIXL prefills (requests with `kv_transfer_params.do_remote_decode`)
    /// answer 200 with `"kv_transfer_params": "malformed by fault injection"`,
    /// a JSON string where an object is expected, and hold no KV blocks: a
    /// proxy cannot hand anything to a decode, and nothing is stranded if it
    /// gives up. A streamed prefill holds no blocks either. No effect on
    /// other requests and in the other [`KvMode`]s, whose prefills answer no
    /// parameters.
    pub malformed_kv_params: bool,
    /// vLLM NIXL prefills answer `"kv_transfer_params": null` and hold no KV blocks,
    /// as an engine whose KV connector hands nothing back does (vLLM before 0.33 did
    /// so for a prefill that finished stopped; 0.33 keeps its blocks): a prefill that
    /// answers 2xx without a handoff. No effect on other requests and in the other
    /// [`KvMode`]s.
    pub withhold_kv_params: bool,
    /// vLLM NIXL prefills answer a partial handoff: the dict they would answer
    /// less the part [`PartialKv`] names (the blocks are held as usual). A
    /// vLLM 0.33 decode given it dies or hangs (see
    /// [`Stats::engine_core_deaths`](crate::Stats::engine_core_deaths) and
    /// [`Stats::stuck_kv_waits`](crate::Stats::stuck_kv_waits)), which is
    /// what a proxy must never let happen. No effect on other requests and in
    /// the other [`KvMode`]s.
    pub partial_kv_params: Option<PartialKv>,
    /// SGLang `/generate` streams write this `index` in every event, whatever
    /// sequence it answers: an engine naming a sequence the request does not
    /// have (a router that sizes a list by it allocates `index + 1` entries).
    pub generate_index: Option<u64>,
    /// SGLang `/generate` streams: after the first event, one event of this
    /// many bytes that never ends (no blank line after it), and then the
    /// stream ends, as an engine cut off mid-event would end it. A router
    /// that holds an event until its end holds all of it.
    pub unterminated_event: Option<usize>,
    /// `POST /tokenize` accepts requests and never answers them, until the
    /// client leaves (the completion-route faults leave `/tokenize` alone; a
    /// hung engine sets this and [`Faults::hang`]).
    pub hang_tokenize: bool,
    /// LMCache prefill: how long after the KV push the `ProxyNotif`
    /// notifications are sent. Zero (the default): they are sent before the
    /// HTTP answer is written. Otherwise they are sent by a task of their
    /// own once the delay ran out, and the answer goes out at once.
    pub notify_delay: Duration,
    /// LMCache prefill: the probability (0 to 1) that a notification is
    /// lost (not sent), drawn for each one, duplicates included, from the
    /// engine's own generator seeded by [`SimConfig::notify_seed`].
    pub notify_loss: f64,
    /// LMCache prefill: extra copies of each notification, sent after all
    /// the originals of the request.
    pub notify_duplicates: u32,
    /// Answer every admin request (`/v1/load_lora_adapter`,
    /// `/v1/unload_lora_adapter`, `/reset_prefix_cache`) with this HTTP status and a
    /// vLLM error body, changing nothing: an engine that fails its part of a fan-out.
    pub admin_status: Option<u16>,
    /// vLLM chat prefills asked for `return_token_ids` answer this JSON as their
    /// top-level `prompt_token_ids` instead of the prompt's ids (a malformed or
    /// oversized list, which a proxy must drop, never pass on).
    pub prompt_token_ids: Option<&'static str>,
    /// vLLM NIXL decode: lose every handoff silently. A request with remote-prefill
    /// `kv_transfer_params` is answered 200 as usual, but the KV is never pulled: the
    /// prompt is computed here (counted `local_compute` in `GET /metrics`) and the
    /// prefill's blocks stay held until its lease expires. The silent failure receipts
    /// are meant to catch.
    pub lose_handoff: bool,
    /// vLLM NIXL decode: every KV transfer fails (counted in
    /// `vllm:nixl_num_failed_transfers` and [`Stats::failed_transfers`](crate::Stats::failed_transfers));
    /// the prompt is then computed here and the request answered 200. The prefill's
    /// blocks stay held until its lease expires.
    pub fail_transfers: bool,
    /// Encoder-only engines (E/P/D): encode every item into the store as usual but
    /// answer `"ec_transfer_params": null`, as an EC connector that hands no entry back
    /// would: a proxy can still name the items to the prefill, which finds them, but
    /// has no entry to rewrite them to embeddings placeholders with.
    pub ec_withhold_params: bool,
    /// How `GET /metrics` misbehaves, if at all.
    pub metrics: Option<MetricsFault>,
    /// `GET /health` answers this status (an engine that reports itself unhealthy
    /// while it still serves, e.g. an SGLang encoder whose dummy encode failed);
    /// the other routes are unchanged.
    pub health_status: Option<u16>,
}

/// How `GET /metrics` misbehaves ([`Faults::metrics`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MetricsFault {
    /// Answer this many bytes of valid-looking comment lines before the metrics.
    Huge(usize),
    /// Answer 200 with a body that is no Prometheus text.
    Garbage,
    /// Never answer, until the client leaves.
    Hang,
}
