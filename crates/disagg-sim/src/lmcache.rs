//! LMCache's P/D mode (`LMCacheConnectorV1` with `enable_pd`): the prefill's
//! `disagg_spec`, its KV push to the decode's receiver ports and its ZMQ
//! `ProxyNotif` notifications; the decode's receiver and the KV it holds.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use thiserror::Error;
use tokio::io::BufReader;
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout};
use zeromq::{Socket, SocketOptions, SocketSend, ZmqMessage};

use crate::api::ApiError;
use crate::generate::{KvDigest, mix};
use crate::kv::{self, KvTransferError, lock, next_line, write_line};
use crate::stats::{Counters, bump};

/// How long a session minted on an init port may wait for its alloc request.
const SESSION_TTL: Duration = Duration::from_secs(30);
/// How long sending one notification may take, connecting included.
pub(crate) const NOTIFY_TIMEOUT: Duration = Duration::from_secs(1);

/// The `disagg_spec` of a prefill request: where the decode's receiver
/// ranks listen, and the id the notifications carry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DisaggSpec {
    pub(crate) req_id: String,
    pub(crate) host: String,
    /// Init port of each decode rank.
    pub(crate) init_ports: Vec<u16>,
    /// Alloc port of each decode rank.
    pub(crate) alloc_ports: Vec<u16>,
}

fn ports(spec: &Map<String, Value>, key: &str) -> Result<Vec<u16>, ApiError> {
    let invalid = || ApiError::bad_request(format!("disagg_spec.{key}: should be a list of ports"));
    let list = spec
        .get(key)
        .and_then(Value::as_array)
        .ok_or_else(invalid)?;
    list.iter()
        .map(|p| {
            p.as_u64()
                .and_then(|p| u16::try_from(p).ok())
                .filter(|p| *p != 0)
        })
        .collect::<Option<Vec<u16>>>()
        .filter(|ports| !ports.is_empty())
        .ok_or_else(invalid)
}

/// Reads `kv_transfer_params.disagg_spec`; `None` when there is none.
/// Unknown keys (`receiver_query_port`, `is_last_prefill`, ..) are ignored.
pub(crate) fn disagg_spec(
    params: Option<&Map<String, Value>>,
) -> Result<Option<DisaggSpec>, ApiError> {
    let Some(spec) = params
        .and_then(|p| p.get("disagg_spec"))
        .filter(|s| !s.is_null())
    else {
        return Ok(None);
    };
    let Some(spec) = spec.as_object() else {
        return Err(ApiError::bad_request(
            "disagg_spec: Input should be a valid dictionary",
        ));
    };
    let string = |key: &str| {
        spec.get(key)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| ApiError::bad_request(format!("disagg_spec.{key}: should be a string")))
    };
    let req_id = string("req_id")?;
    let host = string("receiver_host")?;
    let init_ports = ports(spec, "receiver_init_port")?;
    let alloc_ports = ports(spec, "receiver_alloc_port")?;
    if init_ports.len() != alloc_ports.len() {
        return Err(ApiError::bad_request(format!(
            "disagg_spec: {} init ports but {} alloc ports",
            init_ports.len(),
            alloc_ports.len()
        )));
    }
    Ok(Some(DisaggSpec {
        req_id,
        host,
        init_ports,
        alloc_ports,
    }))
}

/// How many TP ranks of a prefill push the KV of a request: the prefill's
/// own TP size (`SimConfig::lmcache_prefill_tp_size`), or by default as many
/// as the `disagg_spec` names receiver ports. Rank `r` pushes to the ports at
/// index `r` and notifies the proxy once; a rank beyond the port lists fails
/// (see [`push`]).
pub(crate) fn sender_ranks(spec: &DisaggSpec, prefill_tp_size: Option<usize>) -> usize {
    prefill_tp_size.unwrap_or(spec.init_ports.len()).max(1)
}

/// Whether the prefill answers `{"first_tok": id}`: LMCache's connector checks that
/// the key `ret_first_tok` is in the params, whatever its value (`false` included).
pub(crate) fn ret_first_tok(params: Option<&Map<String, Value>>) -> bool {
    params.is_some_and(|p| p.contains_key("ret_first_tok"))
}

/// One line a prefill sends to a receiver port.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum PushLine {
    /// To the init port of a rank: opens a session for one push.
    Init { rank: usize, sender: String },
    /// To the alloc port of the same rank: allocates the blocks of a prompt.
    Alloc {
        session: String,
        rank: usize,
        req_id: String,
        prompt_digest: String,
        num_blocks: usize,
    },
    /// On the same alloc connection: writes the KV into the allocated
    /// blocks; the answer is the acknowledgement.
    Write {
        block_ids: Vec<u64>,
        prompt_digest: String,
        blocks: Vec<String>,
    },
}

/// The answer line of a receiver port.
#[derive(Debug, Default, Serialize, Deserialize)]
struct PushAnswer {
    ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    session: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    block_ids: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

impl PushAnswer {
    fn failure(error: impl Into<String>) -> Self {
        Self {
            error: Some(error.into()),
            ..Self::default()
        }
    }

    fn success() -> Self {
        Self {
            ok: true,
            ..Self::default()
        }
    }

    /// The answer, or the receiver's refusal as an error.
    fn checked(self) -> Result<Self, KvTransferError> {
        if self.ok {
            Ok(self)
        } else {
            Err(KvTransferError::Rejected(
                self.error.unwrap_or_else(|| "no reason given".to_owned()),
            ))
        }
    }
}

/// Sends one line and reads the answer, within the side channel's I/O timeout.
async fn ask(stream: &mut TcpStream, line: &PushLine) -> Result<PushAnswer, KvTransferError> {
    let mut out =
        serde_json::to_vec(line).map_err(|e| KvTransferError::Malformed(e.to_string()))?;
    out.push(b'\n');
    let answer = kv::exchange(stream, &out).await?;
    serde_json::from_slice::<PushAnswer>(&answer)
        .map_err(|e| KvTransferError::Malformed(e.to_string()))?
        .checked()
}

/// Pushes the KV of a prompt to receiver rank `rank` of `spec`: a session
/// from its init port, then the allocation and the write on its alloc port.
/// `Ok` once the receiver acknowledged the write.
pub(crate) async fn push(
    spec: &DisaggSpec,
    rank: usize,
    sender: &str,
    digest: &KvDigest,
) -> Result<(), KvTransferError> {
    let (Some(&init_port), Some(&alloc_port)) =
        (spec.init_ports.get(rank), spec.alloc_ports.get(rank))
    else {
        // LMCache indexes the port lists by the sender's TP rank.
        return Err(KvTransferError::BadParams(
            "no receiver port for this TP rank (list index out of range)",
        ));
    };
    let session = {
        let mut init = kv::connect(&spec.host, init_port).await?;
        let line = PushLine::Init {
            rank,
            sender: sender.to_owned(),
        };
        ask(&mut init, &line)
            .await?
            .session
            .ok_or_else(|| KvTransferError::Malformed("init answer without a session".to_owned()))?
    };
    let mut alloc = kv::connect(&spec.host, alloc_port).await?;
    let line = PushLine::Alloc {
        session,
        rank,
        req_id: spec.req_id.clone(),
        prompt_digest: digest.prompt.clone(),
        num_blocks: digest.blocks.len(),
    };
    let block_ids = ask(&mut alloc, &line)
        .await?
        .block_ids
        .ok_or_else(|| KvTransferError::Malformed("alloc answer without block ids".to_owned()))?;
    if block_ids.len() != digest.blocks.len() {
        return Err(KvTransferError::Malformed(format!(
            "{} blocks allocated for {} blocks of KV",
            block_ids.len(),
            digest.blocks.len()
        )));
    }
    let line = PushLine::Write {
        block_ids,
        prompt_digest: digest.prompt.clone(),
        blocks: digest.blocks.clone(),
    };
    ask(&mut alloc, &line).await.map(drop)
}

#[derive(Debug)]
struct Received {
    digest: KvDigest,
    expires: Instant,
}

/// The receiver of an LMCache decode: the sessions its init ports minted and
/// the KV its alloc ports received, per rank, keyed by prompt digest.
#[derive(Debug, Default)]
pub(crate) struct Receiver {
    /// Per rank: session token → expiry.
    sessions: Vec<Mutex<HashMap<String, Instant>>>,
    /// Per rank: prompt digest → the KV received for it, oldest first (the
    /// same prompt may be pushed for several requests).
    held: Mutex<Vec<HashMap<String, VecDeque<Received>>>>,
    next_block: AtomicU64,
}

/// Why a decode cannot take the KV of its prompt.
#[derive(Debug, Error)]
pub(crate) enum TakeError {
    /// Received on no rank: the request is not a P/D decode leg (a cache miss).
    #[error("no KV was pushed for this prompt")]
    NotPushed,
    /// Received on some ranks and not (or not yet) on others.
    #[error("KV cache for this request has not arrived (missing on rank {missing:?} of {ranks})")]
    Missing { missing: Vec<usize>, ranks: usize },
    /// Received, but not the KV of this prompt.
    #[error(transparent)]
    Mismatch(KvTransferError),
}

impl Receiver {
    /// A receiver of `ranks` ranks.
    pub(crate) fn new(ranks: usize) -> Self {
        Self {
            sessions: (0..ranks).map(|_| Mutex::default()).collect(),
            held: Mutex::new((0..ranks).map(|_| HashMap::new()).collect()),
            next_block: AtomicU64::new(0),
        }
    }

    /// Takes (removes) the KV of `own`'s prompt from every rank, if every
    /// rank has it; otherwise takes nothing.
    pub(crate) fn take(&self, counters: &Counters, own: &KvDigest) -> Result<(), TakeError> {
        let now = Instant::now();
        let mut held = lock(&self.held);
        let ranks = held.len();
        let missing: Vec<usize> = held
            .iter()
            .enumerate()
            .filter(|(_, rank)| {
                !rank
                    .get(&own.prompt)
                    .is_some_and(|q| q.iter().any(|r| r.expires > now))
            })
            .map(|(r, _)| r)
            .collect();
        if ranks > 0 && missing.len() == ranks {
            // Nothing pushed for this prompt: a plain request (served direct), which
            // LMCache's lookup misses and vLLM then prefills itself.
            return Err(TakeError::NotPushed);
        }
        if ranks == 0 || !missing.is_empty() {
            return Err(TakeError::Missing { missing, ranks });
        }
        let mut taken = Vec::with_capacity(ranks);
        for rank in held.iter_mut() {
            let Some(queue) = rank.get_mut(&own.prompt) else {
                continue;
            };
            // Expired entries in front are left to the sweeper.
            if let Some(i) = queue.iter().position(|r| r.expires > now)
                && let Some(received) = queue.remove(i)
            {
                counters
                    .blocks_held
                    .fetch_sub(received.digest.blocks.len() as u64, Relaxed);
                taken.push(received.digest);
            }
            if queue.is_empty() {
                rank.remove(&own.prompt);
            }
        }
        drop(held);
        for digest in &taken {
            kv::check_kv(digest, own).map_err(TakeError::Mismatch)?;
        }
        Ok(())
    }

    /// Drops the KV whose lease ran out (counted in `kv_expired`) and the
    /// sessions nobody used.
    pub(crate) fn sweep(&self, counters: &Counters) {
        let now = Instant::now();
        for sessions in &self.sessions {
            lock(sessions).retain(|_, expires| *expires > now);
        }
        let mut held = lock(&self.held);
        for rank in held.iter_mut() {
            rank.retain(|_, queue| {
                queue.retain(|r| {
                    let keep = r.expires > now;
                    if !keep {
                        counters
                            .blocks_held
                            .fetch_sub(r.digest.blocks.len() as u64, Relaxed);
                        bump(&counters.kv_expired);
                    }
                    keep
                });
                !queue.is_empty()
            });
        }
    }

    fn answer_init(&self, rank: usize, line: &[u8]) -> PushAnswer {
        match serde_json::from_slice::<PushLine>(line) {
            Ok(PushLine::Init { rank: r, .. }) if r != rank => {
                PushAnswer::failure(format!("this is the init port of rank {rank}, not {r}"))
            }
            Ok(PushLine::Init { .. }) => {
                let session = uuid::Uuid::new_v4().simple().to_string();
                if let Some(sessions) = self.sessions.get(rank) {
                    lock(sessions).insert(session.clone(), Instant::now() + SESSION_TTL);
                }
                PushAnswer {
                    session: Some(session),
                    ..PushAnswer::success()
                }
            }
            Ok(_) => PushAnswer::failure(format!("this is the init port of rank {rank}")),
            Err(e) => PushAnswer::failure(format!("malformed request: {e}")),
        }
    }

    fn answer_alloc(
        &self,
        counters: &Counters,
        rank: usize,
        limits: &AllocLimits,
        pending: &mut Option<(String, Vec<u64>)>,
        line: &[u8],
    ) -> PushAnswer {
        match serde_json::from_slice::<PushLine>(line) {
            Ok(PushLine::Alloc {
                session,
                rank: r,
                prompt_digest,
                num_blocks,
                ..
            }) => {
                let known = self
                    .sessions
                    .get(rank)
                    .and_then(|s| lock(s).remove(&session))
                    .is_some_and(|expires| expires > Instant::now());
                if !known {
                    return PushAnswer::failure(format!(
                        "unknown session {session:?} on the alloc port of rank {rank}"
                    ));
                }
                if r != rank {
                    return PushAnswer::failure(format!(
                        "this is the alloc port of rank {rank}, not {r}"
                    ));
                }
                // The blocks of the longest prompt the model takes, at most: a count
                // from the wire is never allocated unchecked.
                if num_blocks == 0 || num_blocks > limits.max_blocks {
                    return PushAnswer::failure(format!(
                        "num_blocks {num_blocks} is not in [1, {}] (a prompt of at most {} tokens in blocks of {})",
                        limits.max_blocks, limits.max_model_len, limits.block_size
                    ));
                }
                let n = num_blocks as u64;
                let first = self.next_block.fetch_add(n, Relaxed);
                let Some(end) = first.checked_add(n) else {
                    return PushAnswer::failure("no block ids left to allocate");
                };
                let block_ids: Vec<u64> = (first..end).collect();
                *pending = Some((prompt_digest, block_ids.clone()));
                PushAnswer {
                    block_ids: Some(block_ids),
                    ..PushAnswer::success()
                }
            }
            Ok(PushLine::Write {
                block_ids,
                prompt_digest,
                blocks,
            }) => {
                let Some((allocated_for, allocated)) = pending.take() else {
                    return PushAnswer::failure("write without an allocation");
                };
                if allocated_for != prompt_digest
                    || allocated != block_ids
                    || blocks.len() != block_ids.len()
                {
                    return PushAnswer::failure("write does not match the allocation");
                }
                let n = blocks.len() as u64;
                let received = Received {
                    digest: KvDigest {
                        blocks,
                        prompt: prompt_digest.clone(),
                    },
                    expires: Instant::now() + limits.lease,
                };
                let mut held = lock(&self.held);
                let Some(held) = held.get_mut(rank) else {
                    return PushAnswer::failure(format!("no rank {rank} here"));
                };
                held.entry(prompt_digest).or_default().push_back(received);
                counters.blocks_held.fetch_add(n, Relaxed);
                bump(&counters.kv_received);
                PushAnswer::success()
            }
            Ok(PushLine::Init { .. }) => {
                PushAnswer::failure(format!("this is the alloc port of rank {rank}"))
            }
            Err(e) => PushAnswer::failure(format!("malformed request: {e}")),
        }
    }
}

/// What a receiver's alloc port allows.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AllocLimits {
    /// How long received KV is held ([`SimConfig::kv_lease`](crate::SimConfig::kv_lease)).
    pub(crate) lease: Duration,
    /// The most blocks one allocation may ask for: those of a prompt of
    /// `max_model_len` tokens.
    pub(crate) max_blocks: usize,
    max_model_len: u32,
    block_size: usize,
}

impl AllocLimits {
    pub(crate) fn new(config: &crate::SimConfig) -> Self {
        let block_size = config.block_size.max(1);
        let max_model_len = config.max_model_len;
        Self {
            lease: config.kv_lease,
            // A prompt of no token still occupies one block.
            max_blocks: (max_model_len as usize).div_ceil(block_size).max(1),
            max_model_len,
            block_size,
        }
    }
}

/// Which receiver port a connection came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Port {
    /// `pd_peer_init_port[rank]`.
    Init,
    /// `pd_peer_alloc_port[rank]`.
    Alloc,
}

/// Serves one connection of a receiver port: request lines, each answered
/// by one line, until the sender closes it or leaves it idle.
pub(crate) async fn serve(
    receiver: &Receiver,
    counters: &Counters,
    port: Port,
    rank: usize,
    limits: AllocLimits,
    mut stream: TcpStream,
) -> io::Result<()> {
    let (read, mut write) = stream.split();
    let mut reader = BufReader::new(read);
    let mut pending = None;
    while let Some(line) = next_line(&mut reader).await? {
        let answer = match port {
            Port::Init => receiver.answer_init(rank, &line),
            Port::Alloc => receiver.answer_alloc(counters, rank, &limits, &mut pending, &line),
        };
        write_line(&mut write, &answer).await?;
    }
    Ok(())
}

/// LMCache's `ProxyNotif` message, as msgspec encodes a tagged struct.
#[derive(Debug, Serialize)]
struct ProxyNotif<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    req_id: &'a str,
}

/// The wire bytes of `{"type": "ProxyNotif", "req_id": req_id}` (a msgpack map).
pub(crate) fn proxy_notif(req_id: &str) -> Result<Vec<u8>, NotifyError> {
    rmp_serde::to_vec_named(&ProxyNotif {
        kind: "ProxyNotif",
        req_id,
    })
    .map_err(|e| NotifyError::Encode(e.to_string()))
}

/// Why a notification was not sent.
#[derive(Debug, Error)]
pub(crate) enum NotifyError {
    #[error("cannot encode the notification: {0}")]
    Encode(String),
    #[error("ZMQ: {0}")]
    Zmq(#[from] zeromq::ZmqError),
    #[error("sending to the proxy took more than {0:?}")]
    Timeout(Duration),
}

/// The prefill's ZMQ `PUSH` socket to the proxy, connected on first use and
/// kept for the next notifications (reconnected after a failure).
pub(crate) struct Notifier {
    endpoint: String,
    socket: tokio::sync::Mutex<Option<zeromq::PushSocket>>,
}

impl std::fmt::Debug for Notifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notifier")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

impl Notifier {
    /// A notifier for the proxy at `HOST:PORT`; checks the address.
    pub(crate) fn new(proxy: &str) -> io::Result<Self> {
        let endpoint = format!("tcp://{proxy}");
        endpoint.parse::<zeromq::Endpoint>().map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("lmcache_proxy {proxy:?} is not HOST:PORT: {e}"),
            )
        })?;
        Ok(Self {
            endpoint,
            socket: tokio::sync::Mutex::new(None),
        })
    }

    /// Sends one message, within [`NOTIFY_TIMEOUT`]. A socket that fails is
    /// dropped and a fresh one tried once.
    pub(crate) async fn send(&self, payload: &[u8]) -> Result<(), NotifyError> {
        let send = async {
            let mut socket = self.socket.lock().await;
            let mut retried = false;
            loop {
                let push = match socket.as_mut() {
                    Some(push) => push,
                    None => {
                        let mut options = SocketOptions::default();
                        options.connect_timeout(NOTIFY_TIMEOUT);
                        let mut push = zeromq::PushSocket::with_options(options);
                        push.connect(&self.endpoint).await?;
                        socket.insert(push)
                    }
                };
                match push.send(ZmqMessage::from(payload.to_vec())).await {
                    Ok(()) => return Ok(()),
                    Err(e) => {
                        *socket = None;
                        if retried {
                            return Err(NotifyError::from(e));
                        }
                        retried = true;
                    }
                }
            }
        };
        timeout(NOTIFY_TIMEOUT, send)
            .await
            .map_err(|_| NotifyError::Timeout(NOTIFY_TIMEOUT))?
    }
}

/// The engine's deterministic generator for [`Faults::notify_loss`]
/// (SplitMix64).
///
/// [`Faults::notify_loss`]: crate::Faults::notify_loss
#[derive(Debug)]
pub(crate) struct LossRng(Mutex<u64>);

impl LossRng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(Mutex::new(seed))
    }

    /// Whether the next notification is lost, with probability `p`.
    pub(crate) fn lose(&self, p: f64) -> bool {
        if p <= 0.0 {
            return false;
        }
        let draw = {
            let mut state = lock(&self.0);
            *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            mix(*state)
        };
        // 53 random bits, uniform in [0, 1).
        let unit = (draw >> 11) as f64 / (1u64 << 53) as f64;
        unit < p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notif_is_a_tagged_map() {
        let bytes = proxy_notif("42").unwrap();
        let value: HashMap<String, String> = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(value["type"], "ProxyNotif");
        assert_eq!(value["req_id"], "42");
        assert_eq!(value.len(), 2);
        // A map of two entries (fixmap 0x82), the tag first.
        assert_eq!(bytes[0], 0x82);
        assert_eq!(&bytes[1..6], b"\xa4type");
    }

    #[test]
    fn loss_is_deterministic() {
        let draws = |seed| {
            let rng = LossRng::new(seed);
            (0..64).map(|_| rng.lose(0.5)).collect::<Vec<_>>()
        };
        assert_eq!(draws(7), draws(7));
        assert_ne!(draws(7), draws(8));
        let rng = LossRng::new(1);
        assert!((0..100).all(|_| rng.lose(1.0)));
        assert!((0..100).all(|_| !rng.lose(0.0)));
    }

    #[test]
    fn spec_parsing() {
        let params = serde_json::json!({
            "ret_first_tok": true,
            "disagg_spec": {"req_id": "r1", "receiver_host": "10.0.0.7",
                            "receiver_init_port": [7300, 7301], "receiver_alloc_port": [7400, 7401],
                            "is_last_prefill": true}
        });
        let params = params.as_object().unwrap();
        let spec = disagg_spec(Some(params)).unwrap().unwrap();
        assert_eq!(spec.req_id, "r1");
        assert_eq!(spec.init_ports, [7300, 7301]);
        assert_eq!(spec.alloc_ports, [7400, 7401]);
        assert!(ret_first_tok(Some(params)));
        assert_eq!(disagg_spec(None).unwrap(), None);
        for bad in [
            serde_json::json!({"disagg_spec": {"req_id": 1, "receiver_host": "h", "receiver_init_port": [1], "receiver_alloc_port": [2]}}),
            serde_json::json!({"disagg_spec": {"req_id": "r", "receiver_host": "h", "receiver_init_port": [1, 2], "receiver_alloc_port": [2]}}),
            serde_json::json!({"disagg_spec": {"req_id": "r", "receiver_host": "h", "receiver_init_port": [], "receiver_alloc_port": []}}),
            serde_json::json!({"disagg_spec": "nope"}),
        ] {
            assert!(disagg_spec(bad.as_object()).is_err(), "{bad}");
        }
    }
}
