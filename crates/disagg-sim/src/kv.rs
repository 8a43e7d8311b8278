//! The KV side channel: blocks held by a prefill, the pull protocol, and
//! the decode's client for it.

use std::collections::HashMap;
use std::io;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use thiserror::Error;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::time::{Instant, timeout};

use crate::generate::KvDigest;
use crate::stats::{Counters, bump};

/// How long a decode waits for the prefill's side channel to accept.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long either side waits for the other's line.
pub(crate) const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest line either side accepts.
const MAX_LINE: u64 = 1 << 20;
/// How long a side-channel connection may sit idle before the prefill closes it.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Idle side-channel connections a decode keeps per prefill.
const MAX_IDLE_PER_PEER: usize = 64;

/// `host` without the brackets an IPv6 address may come in (`[fd00::1]`, as LMCache
/// receivers and URLs write it, and as ZeroMQ's `tcp://[fd00::1]:port` takes it): the
/// socket wants the address.
pub(crate) fn unbracketed(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

pub(crate) async fn connect(host: &str, port: u16) -> Result<TcpStream, KvTransferError> {
    let addr = format!("{host}:{port}");
    let stream = match timeout(
        CONNECT_TIMEOUT,
        TcpStream::connect((unbracketed(host), port)),
    )
    .await
    {
        Err(_) => return Err(KvTransferError::ConnectTimeout(addr)),
        Ok(Err(source)) => return Err(KvTransferError::Connect { addr, source }),
        Ok(Ok(s)) => s,
    };
    // Best effort: the exchange is one small line each way.
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// The line a decode sends to a prefill's side channel to pull KV blocks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SideChannelRequest {
    /// The engine id the decode expects to reach (`remote_engine_id`).
    pub engine_id: String,
    /// The prefill's request id (`remote_request_id`).
    pub request_id: String,
    /// The blocks to pull (`remote_block_ids`).
    pub block_ids: Vec<u64>,
}

/// The line a decode sends to a prefill's side channel to free KV blocks it
/// will never pull: its request was aborted before the pull completed.
///
/// The stand-in for the notification a vLLM decode worker sends for a
/// request that is aborted before its KV was loaded, so that the prefill
/// does not keep the blocks until the lease runs out. On the wire, the
/// blocks are named like in a pull, nested under `release`:
///
/// ```text
/// {"release":{"engine_id":"<remote_engine_id>","request_id":"<remote_request_id>","block_ids":[0,1,2]}}
/// ```
///
/// The prefill frees the blocks only when all three match blocks it holds
/// (counted in [`Stats::kv_released_on_abort`](crate::Stats::kv_released_on_abort))
/// and answers a [`SideChannelResponse`] without blocks: `{"ok":true}`, or
/// `{"ok":false,"error":".."}` when nothing was freed (wrong engine id,
/// unknown request id, e.g. because the blocks were already pulled, other
/// block ids).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SideChannelRelease {
    /// The blocks to free, named as in a pull.
    pub release: SideChannelRequest,
}

/// The line a vLLM NIXL push decode ([`KvMode::NixlPush`](crate::KvMode::NixlPush))
/// sends to the prefill's side channel to register its request, the
/// stand-in for the registration vLLM's `NixlPushConnector` sends as a NIXL
/// notification:
///
/// ```text
/// {"register":{"engine_id":"<remote_engine_id>","request_id":"<the decode's own request id>"}}
/// ```
///
/// The prefill pairs it with the KV of a request it finished: the one held
/// under exactly that id, else the oldest whose id has the same base (the id
/// minus vLLM's `-` and 8 hex digits suffix). It waits for such KV up to its
/// [`SimConfig::bootstrap_timeout`](crate::SimConfig::bootstrap_timeout) and
/// answers a [`BootstrapResponse`]: the KV (then freed on the prefill), a
/// timeout, or a refusal (another engine id, not a push prefill).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SideChannelRegister {
    /// The registration.
    pub register: PushRegistration,
}

/// The body of a [`SideChannelRegister`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushRegistration {
    /// The engine id the decode expects to reach (`remote_engine_id`).
    pub engine_id: String,
    /// The decode's own internal request id: its `X-Request-Id` (or a random
    /// id) followed by `-` and 8 hex digits, as vLLM makes it.
    pub request_id: String,
}

/// The line a prefill's side channel answers a [`SideChannelRequest`] (or a
/// [`SideChannelRelease`]) with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SideChannelResponse {
    /// Whether the pull (or the release) succeeded: the blocks are then freed.
    pub ok: bool,
    /// On success: the "KV" of each block, in the requested order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks: Option<Vec<String>>,
    /// On success: the digest of the whole prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_digest: Option<String>,
    /// On failure: why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl SideChannelResponse {
    fn failure(error: impl Into<String>) -> Self {
        Self {
            ok: false,
            blocks: None,
            prompt_digest: None,
            error: Some(error.into()),
        }
    }
}

/// Why a decode could not load its KV from the prefill.
#[derive(Debug, Error)]
pub(crate) enum KvTransferError {
    #[error("invalid kv_transfer_params: {0}")]
    BadParams(&'static str),
    #[error("cannot connect to {addr}: {source}")]
    Connect { addr: String, source: io::Error },
    #[error("connecting to {0} timed out")]
    ConnectTimeout(String),
    #[error("side channel I/O error: {0}")]
    Io(#[from] io::Error),
    #[error("side channel timed out")]
    Timeout,
    #[error("malformed side channel answer: {0}")]
    Malformed(String),
    #[error("remote engine refused the pull: {0}")]
    Rejected(String),
    #[error("pulled KV blocks do not match the prompt ({0})")]
    Mismatch(&'static str),
    #[error("cannot reach bootstrap server {addr}: {reason}")]
    Unreachable { addr: String, reason: String },
    /// The peer did not show up in time (counted in `bootstrap_timeouts`).
    #[error("{0}")]
    PeerTimeout(String),
    #[error("engine id {engine_id} is not served by {addr}")]
    UnknownEngine { engine_id: String, addr: String },
    #[error("{0}")]
    Bootstrap(String),
}

impl KvTransferError {
    /// Whether the peer did not show up in time.
    pub(crate) fn is_timeout(&self) -> bool {
        matches!(self, KvTransferError::PeerTimeout(_))
    }
}

/// The line an SGLang bootstrap server or a Mooncake side channel answers a
/// KV request with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootstrapResponse {
    /// Whether the KV was handed over (it is then gone from the prefill).
    pub ok: bool,
    /// On success: the digest of the prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_digest: Option<String>,
    /// On success: the "KV" of each block of the prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks: Option<Vec<String>>,
    /// On failure: why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// On failure: whether it is because nothing was registered under the
    /// requested key within the prefill's bootstrap timeout.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub timed_out: bool,
}

impl BootstrapResponse {
    pub(crate) fn success(digest: KvDigest) -> Self {
        Self {
            ok: true,
            prompt_digest: Some(digest.prompt),
            blocks: Some(digest.blocks),
            error: None,
            timed_out: false,
        }
    }

    pub(crate) fn failure(error: impl Into<String>) -> Self {
        Self {
            ok: false,
            prompt_digest: None,
            blocks: None,
            error: Some(error.into()),
            timed_out: false,
        }
    }

    pub(crate) fn timeout(error: impl Into<String>) -> Self {
        Self {
            timed_out: true,
            ..Self::failure(error)
        }
    }

    /// The KV of a successful answer; `what` names the key in errors.
    pub(crate) fn into_digest(self, what: &str) -> Result<KvDigest, KvTransferError> {
        if !self.ok {
            let error = self.error.unwrap_or_else(|| "no reason given".to_owned());
            return Err(if self.timed_out {
                KvTransferError::PeerTimeout(format!("no prefill for {what}: {error}"))
            } else {
                KvTransferError::Rejected(error)
            });
        }
        match (self.blocks, self.prompt_digest) {
            (Some(blocks), Some(prompt)) => Ok(KvDigest { blocks, prompt }),
            _ => Err(KvTransferError::Malformed(
                "ok answer without blocks or prompt_digest".to_owned(),
            )),
        }
    }
}

/// The line a Mooncake decode sends to the prefill's side channel to pull
/// the KV of a transfer (told from a [`SideChannelRequest`] by its
/// `transfer_id`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MooncakePullRequest {
    /// The engine id of the data-parallel rank that holds the KV
    /// (`remote_engine_id`).
    pub engine_id: String,
    /// The proxy-chosen id shared by both legs (`transfer_id`).
    pub transfer_id: String,
}

/// Mooncake KV held by a prefill, by (engine id of the rank, transfer id).
pub(crate) type Transfers = crate::rendezvous::Rendezvous<(String, String), KvDigest>;

/// What a side channel needs to serve Mooncake pulls.
#[derive(Debug)]
pub(crate) struct MooncakeSide<'a> {
    pub(crate) transfers: &'a Transfers,
    /// The engine ids of the data-parallel ranks.
    pub(crate) engine_ids: &'a [String],
    /// How long a pull waits for its transfer id to be held.
    pub(crate) wait: Duration,
}

#[derive(Debug)]
struct Held {
    block_ids: Vec<u64>,
    digest: KvDigest,
    expires: Instant,
    /// Order of holding (a NIXL push registration takes the oldest match).
    seq: u64,
}

/// KV blocks a prefill keeps for remote decodes, keyed by request id.
#[derive(Debug, Default)]
pub(crate) struct KvStore {
    held: Mutex<HashMap<String, Held>>,
    next_block: AtomicU64,
    next_request: AtomicU64,
    /// Woken on every hold, for NIXL push registrations waiting for theirs.
    held_new: Notify,
}

/// vLLM's internal request id: the request's id (`X-Request-Id`, or a random
/// one) followed by `-` and 8 hex digits (`input_processor.assign_request_id`),
/// so two requests with the same id stay apart inside the engine.
pub(crate) fn internal_request_id(request_id: &str, seq: u64) -> String {
    format!("{request_id}-{:08x}", seq & 0xffff_ffff)
}

/// An internal request id minus vLLM's random suffix (`get_base_request_id`
/// in vLLM's NIXL connector: a trailing `-` and 8 hex digits, any case).
pub(crate) fn base_request_id(id: &str) -> &str {
    match id
        .len()
        .checked_sub(9)
        .and_then(|i| id.get(i..).map(|tail| (i, tail)))
    {
        Some((i, tail))
            if tail.starts_with('-') && tail[1..].bytes().all(|b| b.is_ascii_hexdigit()) =>
        {
            &id[..i]
        }
        _ => id,
    }
}

impl KvStore {
    /// Allocates blocks for `digest`, keeps them until `lease` runs out and
    /// returns the new remote request id and the block ids.
    pub(crate) fn hold(
        &self,
        counters: &Counters,
        request_id: &str,
        digest: KvDigest,
        lease: Duration,
    ) -> (String, Vec<u64>) {
        let n = digest.blocks.len() as u64;
        let first = self.next_block.fetch_add(n, Relaxed);
        let block_ids: Vec<u64> = (first..first + n).collect();
        let seq = self.next_request.fetch_add(1, Relaxed);
        let remote_request_id = internal_request_id(request_id, seq);
        let held = Held {
            block_ids: block_ids.clone(),
            digest,
            expires: Instant::now() + lease,
            seq,
        };
        {
            let mut map = lock(&self.held);
            map.insert(remote_request_id.clone(), held);
            counters.blocks_held.fetch_add(n, Relaxed);
        }
        self.held_new.notify_waiters();
        (remote_request_id, block_ids)
    }

    /// NIXL push: takes the KV a registration pairs with, as vLLM's
    /// `NixlPushConnector` pairs them: the request held under exactly the
    /// registration's id, else the oldest one whose id has the same base
    /// (both ids minus their random suffix). Waits up to `wait` for it to be
    /// held; `None` when the wait ran out.
    pub(crate) async fn take_push(
        &self,
        counters: &Counters,
        registration_id: &str,
        wait: Duration,
    ) -> Option<KvDigest> {
        let deadline = Instant::now() + wait;
        loop {
            let held_new = self.held_new.notified();
            tokio::pin!(held_new);
            // Listen before looking, so that a hold in between is not missed.
            held_new.as_mut().enable();
            if let Some(digest) = self.try_take_push(counters, registration_id) {
                return Some(digest);
            }
            tokio::time::timeout_at(deadline, held_new).await.ok()?;
        }
    }

    fn try_take_push(&self, counters: &Counters, registration_id: &str) -> Option<KvDigest> {
        let now = Instant::now();
        let base = base_request_id(registration_id);
        let mut map = lock(&self.held);
        let key = if map.get(registration_id).is_some_and(|h| h.expires > now) {
            registration_id.to_owned()
        } else {
            map.iter()
                .filter(|(id, held)| held.expires > now && base_request_id(id) == base)
                .min_by_key(|(_, held)| held.seq)
                .map(|(id, _)| id.clone())?
        };
        let held = map.remove(&key)?;
        counters
            .blocks_held
            .fetch_sub(held.block_ids.len() as u64, Relaxed);
        Some(held.digest)
    }

    /// Hands the blocks of a request over to a pull and frees them.
    fn take(&self, counters: &Counters, req: &SideChannelRequest) -> Result<KvDigest, String> {
        let mut map = lock(&self.held);
        let Some(held) = map.get(&req.request_id) else {
            return Err(format!("unknown request id {:?}", req.request_id));
        };
        if held.expires <= Instant::now() {
            let n = held.block_ids.len() as u64;
            map.remove(&req.request_id);
            counters.blocks_held.fetch_sub(n, Relaxed);
            counters.kv_expired_reqs.fetch_add(1, Relaxed);
            return Err(format!("KV of request {:?} expired", req.request_id));
        }
        if held.block_ids != req.block_ids {
            return Err(format!(
                "block ids {:?} do not match the blocks of request {:?}",
                req.block_ids, req.request_id
            ));
        }
        let held = map
            .remove(&req.request_id)
            .ok_or_else(|| "request vanished".to_owned())?;
        counters
            .blocks_held
            .fetch_sub(held.block_ids.len() as u64, Relaxed);
        Ok(held.digest)
    }

    /// Frees the blocks of a request whose decode was aborted before it
    /// pulled them. Returns how many blocks were freed.
    fn release(&self, counters: &Counters, req: &SideChannelRequest) -> Result<u64, String> {
        let mut map = lock(&self.held);
        let Some(held) = map.get(&req.request_id) else {
            return Err(format!("unknown request id {:?}", req.request_id));
        };
        if held.block_ids != req.block_ids {
            return Err(format!(
                "block ids {:?} do not match the blocks of request {:?}",
                req.block_ids, req.request_id
            ));
        }
        let expired = held.expires <= Instant::now();
        let n = held.block_ids.len() as u64;
        map.remove(&req.request_id);
        counters.blocks_held.fetch_sub(n, Relaxed);
        if expired {
            // Freed by the lease, not by the notice.
            return Err(format!("KV of request {:?} expired", req.request_id));
        }
        bump(&counters.kv_released_on_abort);
        Ok(n)
    }

    /// Frees the blocks whose lease ran out.
    pub(crate) fn sweep(&self, counters: &Counters) {
        let now = Instant::now();
        let mut map = lock(&self.held);
        let mut freed = 0u64;
        let mut expired = 0u64;
        map.retain(|_, held| {
            let keep = held.expires > now;
            if !keep {
                freed += held.block_ids.len() as u64;
                expired += 1;
            }
            keep
        });
        counters.blocks_held.fetch_sub(freed, Relaxed);
        counters.kv_expired_reqs.fetch_add(expired, Relaxed);
    }
}

/// Locks a mutex, recovering the data if a panicking thread poisoned it
/// (every critical section here leaves the data consistent).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn read_line<R: AsyncRead + Unpin>(r: R) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    BufReader::new(tokio::io::AsyncReadExt::take(r, MAX_LINE))
        .read_until(b'\n', &mut buf)
        .await?;
    Ok(buf)
}

/// Serves one side-channel connection: request lines, each answered by one line.
///
/// Like vLLM's NIXL handshake, which a decode engine makes once per remote engine and
/// then reuses, a side-channel connection stays open for further pulls; it ends when the
/// decode closes it or leaves it idle for [`IDLE_TIMEOUT`]. A line with a `transfer_id`
/// is a Mooncake pull, served from `mooncake` (refused when this engine is not a Mooncake
/// prefill); a line with `register` is a NIXL push registration, served with a wait of
/// `push_wait` (refused when this engine is not a push prefill); a line with `release` is
/// a [`SideChannelRelease`].
pub(crate) async fn serve_pull(
    store: &KvStore,
    counters: &Counters,
    engine_id: &str,
    mooncake: Option<MooncakeSide<'_>>,
    push_wait: Option<Duration>,
    mut stream: TcpStream,
) -> io::Result<()> {
    let (read, mut write) = stream.split();
    let mut reader = BufReader::new(read);
    while let Some(line) = next_line(&mut reader).await? {
        if let Ok(SideChannelRegister { register }) = serde_json::from_slice(&line) {
            let answer = match push_wait {
                None => BootstrapResponse::failure("this engine is not a NIXL push prefill"),
                Some(_) if register.engine_id != engine_id => BootstrapResponse::failure(format!(
                    "engine id mismatch: this is {engine_id:?}, not {:?}",
                    register.engine_id
                )),
                Some(wait) => tokio::select! {
                    taken = store.take_push(counters, &register.request_id, wait) => {
                        taken_or_timed_out(counters, taken, || format!(
                            "no finished request paired with request id {:?} within {wait:?}",
                            register.request_id
                        ))
                    }
                    // The decode left (or gave up): stop waiting, take nothing.
                    () = peer_gone(&mut reader) => return Ok(()),
                },
            };
            write_line(&mut write, &answer).await?;
            continue;
        }
        let answer = match serde_json::from_slice::<MooncakePullRequest>(&line) {
            Ok(pull) => {
                let answer = match &mooncake {
                    None => BootstrapResponse::failure("this engine is not a Mooncake prefill"),
                    Some(side) => {
                        tokio::select! {
                            answer = serve_mooncake_pull(side, counters, &pull) => answer,
                            // The decode left (or gave up): stop waiting, take nothing.
                            () = peer_gone(&mut reader) => return Ok(()),
                        }
                    }
                };
                serde_json::to_value(&answer)
            }
            Err(_) => match serde_json::from_slice::<SideChannelRelease>(&line) {
                Ok(notice) => {
                    serde_json::to_value(release(store, counters, engine_id, &notice.release))
                }
                Err(_) => serde_json::to_value(answer(store, counters, engine_id, &line)),
            },
        }
        .map_err(io::Error::other)?;
        write_line(&mut write, &answer).await?;
    }
    Ok(())
}

/// The next request line of a request-answer connection (side channel, bootstrap
/// server); `None` when the peer closed it or left it idle for [`IDLE_TIMEOUT`].
pub(crate) async fn next_line<R: AsyncBufRead + Unpin>(
    reader: &mut R,
) -> io::Result<Option<Vec<u8>>> {
    let mut line = Vec::new();
    let read = timeout(
        IDLE_TIMEOUT,
        tokio::io::AsyncReadExt::take(reader, MAX_LINE).read_until(b'\n', &mut line),
    )
    .await;
    match read {
        Err(_) | Ok(Ok(0)) => Ok(None),
        Ok(Err(e)) => Err(e),
        Ok(Ok(_)) => Ok(Some(line)),
    }
}

/// Writes one answer line, giving up if the peer does not take it in time.
pub(crate) async fn write_line<W: tokio::io::AsyncWrite + Unpin>(
    write: &mut W,
    answer: &impl Serialize,
) -> io::Result<()> {
    let mut out = serde_json::to_vec(answer).map_err(io::Error::other)?;
    out.push(b'\n');
    timeout(IO_TIMEOUT, write.write_all(&out))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "answer not taken"))?
}

/// The answer to a wait for KV at a rendezvous: the KV taken, or a timeout (counted)
/// described by `what`.
pub(crate) fn taken_or_timed_out(
    counters: &Counters,
    taken: Option<KvDigest>,
    what: impl FnOnce() -> String,
) -> BootstrapResponse {
    match taken {
        Some(digest) => {
            bump(&counters.side_channel_served);
            BootstrapResponse::success(digest)
        }
        None => {
            bump(&counters.bootstrap_timeouts);
            BootstrapResponse::timeout(what())
        }
    }
}

/// Hands the KV of a Mooncake transfer over, waiting for the prefill to hold it.
async fn serve_mooncake_pull(
    side: &MooncakeSide<'_>,
    counters: &Counters,
    pull: &MooncakePullRequest,
) -> BootstrapResponse {
    if !side.engine_ids.contains(&pull.engine_id) {
        return BootstrapResponse::failure(format!(
            "engine id mismatch: this engine serves {:?}, not {:?}",
            side.engine_ids, pull.engine_id
        ));
    }
    let key = (pull.engine_id.clone(), pull.transfer_id.clone());
    let taken = side.transfers.take(counters, &key, side.wait).await;
    taken_or_timed_out(counters, taken, || {
        format!(
            "no KV held for transfer id {:?} within {:?}",
            pull.transfer_id, side.wait
        )
    })
}

/// Resolves when the peer of a request-answer connection closes it (or the
/// connection fails) while its request is being served; never if the peer
/// sends more data instead, which is kept for the next request.
pub(crate) async fn peer_gone<R: AsyncBufRead + Unpin>(reader: &mut R) {
    match reader.fill_buf().await {
        Ok(buf) if !buf.is_empty() => std::future::pending().await,
        _ => {}
    }
}

/// Sends one request line and reads the answer line, waiting for it as
/// long as the caller lets it (no timeout of its own).
pub(crate) async fn request_line<T: Serialize, A: for<'de> Deserialize<'de>>(
    stream: &mut TcpStream,
    request: &T,
) -> Result<A, KvTransferError> {
    let mut line =
        serde_json::to_vec(request).map_err(|e| KvTransferError::Malformed(e.to_string()))?;
    line.push(b'\n');
    stream.write_all(&line).await?;
    let answer = read_line(&mut *stream).await?;
    if answer.is_empty() {
        return Err(KvTransferError::Malformed(
            "connection closed without an answer".to_owned(),
        ));
    }
    serde_json::from_slice(&answer).map_err(|e| {
        KvTransferError::Malformed(format!(
            "{e} in {:?}",
            String::from_utf8_lossy(&answer[..answer.len().min(80)])
        ))
    })
}

fn answer(
    store: &KvStore,
    counters: &Counters,
    engine_id: &str,
    line: &[u8],
) -> SideChannelResponse {
    match serde_json::from_slice::<SideChannelRequest>(line) {
        Err(e) => SideChannelResponse::failure(format!("malformed request: {e}")),
        Ok(req) if req.engine_id != engine_id => SideChannelResponse::failure(format!(
            "engine id mismatch: this is {engine_id:?}, not {:?}",
            req.engine_id
        )),
        Ok(req) => match store.take(counters, &req) {
            Ok(digest) => {
                bump(&counters.side_channel_served);
                SideChannelResponse {
                    ok: true,
                    blocks: Some(digest.blocks),
                    prompt_digest: Some(digest.prompt),
                    error: None,
                }
            }
            Err(e) => SideChannelResponse::failure(e),
        },
    }
}

/// Serves a [`SideChannelRelease`]: frees the named blocks if they are held here.
fn release(
    store: &KvStore,
    counters: &Counters,
    engine_id: &str,
    req: &SideChannelRequest,
) -> SideChannelResponse {
    if req.engine_id != engine_id {
        return SideChannelResponse::failure(format!(
            "engine id mismatch: this is {engine_id:?}, not {:?}",
            req.engine_id
        ));
    }
    match store.release(counters, req) {
        Ok(freed) => {
            tracing::debug!(request_id = %req.request_id, freed, "KV released by an aborted decode");
            SideChannelResponse {
                ok: true,
                blocks: None,
                prompt_digest: None,
                error: None,
            }
        }
        Err(e) => SideChannelResponse::failure(e),
    }
}

/// Idle side-channel connections of a decode engine, by prefill address, for reuse.
#[derive(Debug, Default)]
pub(crate) struct SidePool {
    idle: Mutex<HashMap<(String, u16), Vec<TcpStream>>>,
}

impl SidePool {
    fn take(&self, key: &(String, u16)) -> Option<TcpStream> {
        lock(&self.idle).get_mut(key).and_then(Vec::pop)
    }

    fn give_back(&self, key: (String, u16), stream: TcpStream) {
        let mut idle = lock(&self.idle);
        let streams = idle.entry(key).or_default();
        if streams.len() < MAX_IDLE_PER_PEER {
            streams.push(stream);
        }
    }
}

/// One pull over `stream`: the request line out, the answer line in.
pub(crate) async fn exchange(
    stream: &mut TcpStream,
    line: &[u8],
) -> Result<Vec<u8>, KvTransferError> {
    let answer = timeout(IO_TIMEOUT, async {
        stream.write_all(line).await?;
        read_line(&mut *stream).await
    })
    .await
    .map_err(|_| KvTransferError::Timeout)??;
    if answer.is_empty() {
        return Err(KvTransferError::Malformed(
            "connection closed without an answer".to_owned(),
        ));
    }
    Ok(answer)
}

/// Where a vLLM NIXL decode pulls its KV from, and what it asks for, read
/// from valid decode-side `kv_transfer_params`.
#[derive(Clone, Debug)]
pub(crate) struct PullTarget {
    host: String,
    port: u16,
    request: SideChannelRequest,
}

impl PullTarget {
    /// Reads the prefill's side channel address and the blocks to pull.
    pub(crate) fn parse(params: &Map<String, Value>) -> Result<Self, KvTransferError> {
        let host = params
            .get("remote_host")
            .and_then(Value::as_str)
            .ok_or(KvTransferError::BadParams("remote_host is not a string"))?;
        let port = params
            .get("remote_port")
            .and_then(Value::as_u64)
            .and_then(|p| u16::try_from(p).ok())
            .ok_or(KvTransferError::BadParams(
                "remote_port is not a port number",
            ))?;
        let engine_id = params
            .get("remote_engine_id")
            .and_then(Value::as_str)
            .ok_or(KvTransferError::BadParams(
                "remote_engine_id is not a string",
            ))?;
        let request_id = params
            .get("remote_request_id")
            .and_then(Value::as_str)
            .ok_or(KvTransferError::BadParams(
                "remote_request_id is not a string",
            ))?;
        let block_ids = group_block_ids(params.get("remote_block_ids"))?;
        Ok(Self {
            host: host.to_owned(),
            port,
            request: SideChannelRequest {
                engine_id: engine_id.to_owned(),
                request_id: request_id.to_owned(),
                block_ids,
            },
        })
    }
}

/// The block ids of `remote_block_ids` as vLLM 0.33's decode reads them: one list per
/// KV-cache group (`BlockIds`; the simulated model has one group). Its worker reads the
/// list group by group, so a flat list of ids (the shape before hybrid KV-cache groups)
/// cannot be read: the transfer fails.
fn group_block_ids(value: Option<&Value>) -> Result<Vec<u64>, KvTransferError> {
    let groups = value
        .and_then(Value::as_array)
        .ok_or(KvTransferError::BadParams("remote_block_ids is not a list"))?;
    if !groups.iter().all(Value::is_array) {
        return Err(KvTransferError::BadParams(
            "remote_block_ids is not one list of block ids per KV-cache group",
        ));
    }
    match groups.as_slice() {
        [group] => group
            .as_array()
            .and_then(|ids| ids.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
            .ok_or(KvTransferError::BadParams(
                "remote_block_ids holds something other than block ids",
            )),
        _ => Err(KvTransferError::BadParams(
            "remote_block_ids names another number of KV-cache groups than the model's one",
        )),
    }
}

/// Pulls the KV named by `target` from the prefill's side channel.
pub(crate) async fn pull(
    pool: &SidePool,
    target: &PullTarget,
) -> Result<KvDigest, KvTransferError> {
    let mut line = serde_json::to_vec(&target.request)
        .map_err(|e| KvTransferError::Malformed(e.to_string()))?;
    line.push(b'\n');

    let (host, port) = (target.host.as_str(), target.port);
    let key = (host.to_owned(), port);
    // A pooled connection may have been closed by the prefill since (idle timeout,
    // restart): on failure, try once more on a fresh one.
    let mut reused = pool.take(&key);
    let (stream, answer) = loop {
        let (mut stream, was_reused) = match reused.take() {
            Some(s) => (s, true),
            None => (connect(host, port).await?, false),
        };
        match exchange(&mut stream, &line).await {
            Ok(answer) => break (stream, answer),
            Err(_) if was_reused => continue,
            Err(e) => return Err(e),
        }
    };
    pool.give_back(key, stream);
    let answer: SideChannelResponse =
        serde_json::from_slice(&answer).map_err(|e| KvTransferError::Malformed(e.to_string()))?;
    if !answer.ok {
        return Err(KvTransferError::Rejected(
            answer.error.unwrap_or_else(|| "no reason given".to_owned()),
        ));
    }
    match (answer.blocks, answer.prompt_digest) {
        (Some(blocks), Some(prompt)) => Ok(KvDigest { blocks, prompt }),
        _ => Err(KvTransferError::Malformed(
            "ok answer without blocks or prompt_digest".to_owned(),
        )),
    }
}

/// Where a vLLM NIXL push decode registers, read from its
/// `kv_transfer_params`.
#[derive(Clone, Debug)]
pub(crate) struct PushTarget {
    host: String,
    port: u16,
    registration: PushRegistration,
}

impl PushTarget {
    /// Reads the prefill's coordinates, which vLLM's push decode indexes
    /// (`remote_engine_id`, `remote_host`, `remote_port`, `tp_size`); `None`
    /// when one is missing or of the wrong type. `request_id` is the
    /// decode's own internal request id.
    pub(crate) fn parse(params: &Map<String, Value>, request_id: String) -> Option<Self> {
        let host = params.get("remote_host").and_then(Value::as_str)?;
        let port = params
            .get("remote_port")
            .and_then(Value::as_u64)
            .and_then(|p| u16::try_from(p).ok())?;
        let engine_id = params.get("remote_engine_id").and_then(Value::as_str)?;
        params.get("tp_size").and_then(Value::as_u64)?;
        Some(Self {
            host: host.to_owned(),
            port,
            registration: PushRegistration {
                engine_id: engine_id.to_owned(),
                request_id,
            },
        })
    }
}

/// Registers a NIXL push decode with its prefill and waits, as long as the
/// caller lets it, for the KV the prefill pairs with it.
pub(crate) async fn register_push(target: &PushTarget) -> Result<KvDigest, KvTransferError> {
    let mut stream = connect(&target.host, target.port).await?;
    let line = SideChannelRegister {
        register: target.registration.clone(),
    };
    let answer: BootstrapResponse = request_line(&mut stream, &line).await?;
    answer.into_digest(&format!("request id {:?}", target.registration.request_id))
}

/// Tells the prefill named by `target` to free the blocks a pull would have
/// taken (a [`SideChannelRelease`]), on a connection of its own.
pub(crate) async fn send_release(target: &PullTarget) -> Result<(), KvTransferError> {
    let notice = SideChannelRelease {
        release: target.request.clone(),
    };
    let mut line =
        serde_json::to_vec(&notice).map_err(|e| KvTransferError::Malformed(e.to_string()))?;
    line.push(b'\n');
    let mut stream = connect(&target.host, target.port).await?;
    let answer = exchange(&mut stream, &line).await?;
    let answer: SideChannelResponse =
        serde_json::from_slice(&answer).map_err(|e| KvTransferError::Malformed(e.to_string()))?;
    if answer.ok {
        Ok(())
    } else {
        Err(KvTransferError::Rejected(
            answer.error.unwrap_or_else(|| "no reason given".to_owned()),
        ))
    }
}

/// Whether KV fetched from a peer is the KV of this engine's own prompt.
pub(crate) fn check_kv(remote: &KvDigest, own: &KvDigest) -> Result<(), KvTransferError> {
    if remote.blocks.len() != own.blocks.len() {
        Err(KvTransferError::Mismatch("wrong number of blocks"))
    } else if remote != own {
        Err(KvTransferError::Mismatch("block contents differ"))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod connect_tests {
    /// A bracketed IPv6 host (an LMCache receiver's, a NIXL `remote_host`) reaches the
    /// address inside the brackets, as ZeroMQ's `tcp://[ADDR]:PORT` does.
    #[tokio::test]
    async fn a_bracketed_ipv6_host_is_connected_to() {
        let Ok(listener) = tokio::net::TcpListener::bind("[::1]:0").await else {
            eprintln!("no IPv6 loopback here: nothing to check");
            return;
        };
        let port = listener.local_addr().unwrap().port();
        let stream = super::connect("[::1]", port).await.unwrap();
        assert_eq!(stream.peer_addr().unwrap().port(), port);
        assert!(super::connect("::1", port).await.is_ok());
    }
}
