//! Encoder disaggregation with a push connector, as vLLM's Mooncake EC connector runs
//! it (`vllm/distributed/ec_transfer/ec_connector/mooncake/`): the consumer listens on
//! an EC port ([`SimConfig::ec_push`](crate::SimConfig::ec_push)); an encoder leg names
//! it (`ec_transfer_params.consumer_zmq`, `tcp://HOST:PORT`) and a `transfer_id` per item
//! (`ec_items`, matched to the leg's items by `mm_hash` or by position); the encoder
//! pushes each item's embeddings there before it answers; the consumer's request names
//! `ec_items: [{mm_hash, transfer_id}]` and waits, within
//! [`SimConfig::ec_push_wait`](crate::SimConfig::ec_push_wait) (vLLM's
//! `push_wait_timeout_s`), for every one of them, failing when one never comes or came
//! for another item. Every media item of a consumer's request must have arrived so.
//!
//! The wire is the simulator's own (vLLM's is a ZMQ control channel and a Mooncake
//! transfer engine): per item a frame of three length-prefixed fields (big-endian
//! `u32`), the transfer id, the item hash and the embeddings, each bounded; the consumer
//! answers each frame with one byte, `1` stored or `0` refused (a transfer id it holds
//! already, or 4096 items held). An item no request takes within the consumer's
//! [`SimConfig::kv_lease`](crate::SimConfig::kv_lease) is dropped.
//!
//! A consumer with data-parallel ranks listens on one EC port per rank, consecutive (vLLM:
//! rank `d` at `ec_port + d·tp_size`; the simulator's tensor-parallel size is 1), each
//! with its own items: a request takes its items from the port of the rank it is placed
//! on, so items pushed to another rank never arrive.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Duration;

use http::StatusCode;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use crate::api::ApiError;

/// Longest transfer id or item hash read from the wire or a request.
const MAX_ID: usize = 256;
/// Largest embeddings frame accepted.
const MAX_BYTES: usize = 1 << 20;
/// Most pushed items a consumer holds at once (more are refused until some are taken or
/// expire).
const MAX_HELD: usize = 4096;
/// How long an encoder tries to reach its consumer (vLLM's `control_timeout_s` is
/// 30 s; a test wants a wrong address to fail sooner).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// An item pushed to a consumer: its hash, its embeddings, and when it is dropped if no
/// request took it.
#[derive(Debug)]
struct Held {
    hash: String,
    bytes: Vec<u8>,
    expires: Instant,
}

/// The items pushed to a consumer and not yet taken by a request, by transfer id, each
/// held for the consumer's lease ([`SimConfig::kv_lease`](crate::SimConfig::kv_lease)).
#[derive(Debug, Default)]
pub(crate) struct Pushed {
    held: Mutex<HashMap<String, Held>>,
    arrived: tokio::sync::Notify,
}

impl Pushed {
    /// Stores an item for `lease`. Refused (`false`) when `transfer_id` is held already
    /// (a second push under it would silently replace the first) or when
    /// [`MAX_HELD`] items are held, expired ones dropped first.
    fn put(&self, transfer_id: String, hash: String, bytes: Vec<u8>, lease: Duration) -> bool {
        let Ok(mut held) = self.held.lock() else {
            return false;
        };
        let now = Instant::now();
        if held.len() >= MAX_HELD {
            drop_expired(&mut held, now);
        }
        if held.len() >= MAX_HELD {
            return false;
        }
        let item = Held {
            hash,
            bytes,
            expires: now + lease,
        };
        match held.entry(transfer_id) {
            Entry::Occupied(live) if live.get().expires > now => return false,
            Entry::Occupied(mut expired) => {
                expired.insert(item);
            }
            Entry::Vacant(free) => {
                free.insert(item);
            }
        }
        drop(held);
        self.arrived.notify_waiters();
        true
    }

    /// Takes the item pushed under `transfer_id`, unless its lease ran out.
    fn take(&self, transfer_id: &str) -> Option<(String, Vec<u8>)> {
        let item = self.held.lock().ok()?.remove(transfer_id)?;
        (item.expires > Instant::now()).then_some((item.hash, item.bytes))
    }

    /// Drops the items whose lease ran out.
    pub(crate) fn sweep(&self) {
        if let Ok(mut held) = self.held.lock() {
            drop_expired(&mut held, Instant::now());
        }
    }

    /// The item pushed under `transfer_id`, waited for up to `wait`.
    async fn wait_for(&self, transfer_id: &str, wait: Duration) -> Option<(String, Vec<u8>)> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let arrived = self.arrived.notified();
            if let Some(item) = self.take(transfer_id) {
                return Some(item);
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                return self.take(transfer_id);
            }
        }
    }
}

/// Drops from `held` the items whose lease ran out by `now`.
fn drop_expired(held: &mut HashMap<String, Held>, now: Instant) {
    held.retain(|_, item| item.expires > now);
}

async fn read_field(stream: &mut TcpStream, max: usize) -> std::io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    match stream.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = usize::try_from(u32::from_be_bytes(len)).unwrap_or(usize::MAX);
    if len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "an EC push field is too long",
        ));
    }
    let mut buf = vec![0u8; len];
    stream.read_exact(&mut buf).await?;
    Ok(Some(buf))
}

/// A consumer's EC port, one encoder's connection: frames stored (each held for
/// `lease`) until it closes.
pub(crate) async fn serve(
    pushed: &Pushed,
    lease: Duration,
    mut stream: TcpStream,
) -> std::io::Result<()> {
    loop {
        let Some(id) = read_field(&mut stream, MAX_ID).await? else {
            return Ok(());
        };
        let Some(hash) = read_field(&mut stream, MAX_ID).await? else {
            return Ok(());
        };
        let Some(bytes) = read_field(&mut stream, MAX_BYTES).await? else {
            return Ok(());
        };
        let (Ok(id), Ok(hash)) = (String::from_utf8(id), String::from_utf8(hash)) else {
            stream.write_all(&[0]).await?;
            continue;
        };
        let stored = pushed.put(id, hash, bytes, lease);
        stream.write_all(&[u8::from(stored)]).await?;
    }
}

/// `n` listeners on consecutive ports of `host` (a data-parallel consumer's EC
/// ports, a data-parallel NIXL engine's side channels: rank `d` at the first plus `d`): from `base` when given (failing when one of
/// them is taken); else one port drawn by the system when `n` is 1, and otherwise a run
/// drawn at random below Linux's default ephemeral range (32768-60999) as the
/// KV-event publishers' are, tried again where a port of it is taken. Not in the ephemeral range: there the ports next to
/// one the system gives a listener are the ones it gives outgoing connections (Linux
/// hands `bind` odd ports and `connect` even ones), so under a busy test run a port
/// drawn by the system rarely has a free neighbour.
pub(crate) async fn bind_consecutive(
    host: IpAddr,
    n: usize,
    base: Option<u16>,
) -> std::io::Result<Vec<TcpListener>> {
    if n <= 1 || base.is_some() {
        return bind_run(host, base.unwrap_or(0), n.max(1)).await;
    }
    let mut last = None;
    let mut draw =
        std::hash::BuildHasher::build_hasher(&std::collections::hash_map::RandomState::new());
    for attempt in 0..256 {
        match bind_run(host, crate::kv_events::draw_base(&mut draw, attempt), n).await {
            Ok(listeners) => return Ok(listeners),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            "no run of free consecutive ports for the data-parallel ranks",
        )
    }))
}

/// `n` listeners from port `first` on (0: one drawn by the system, then the next ones).
async fn bind_run(host: IpAddr, first: u16, n: usize) -> std::io::Result<Vec<TcpListener>> {
    let head = TcpListener::bind((host, first)).await?;
    let base = head.local_addr()?.port();
    let mut listeners = vec![head];
    for d in 1..n {
        let port = u16::try_from(d)
            .ok()
            .and_then(|d| base.checked_add(d))
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::AddrNotAvailable,
                    "the data-parallel ranks' ports pass 65535",
                )
            })?;
        listeners.push(TcpListener::bind((host, port)).await?);
    }
    Ok(listeners)
}

fn field(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&u32::try_from(bytes.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(bytes);
}

fn push_error(what: String) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, what)
}

/// The transfer ids an encoder leg's `ec_transfer_params` gives its `items` (their
/// hashes, in order): by `mm_hash` when an entry names one, else by position; and the
/// consumer's address. `None` when the leg names no consumer (not a push leg).
fn push_targets(body: &Value, items: &[String]) -> Result<Option<(String, Vec<String>)>, ApiError> {
    let Some(params) = body.get("ec_transfer_params").filter(|p| !p.is_null()) else {
        return Ok(None);
    };
    let Some(zmq) = params.get("consumer_zmq").and_then(Value::as_str) else {
        return Ok(None);
    };
    let entries = params
        .get("ec_items")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::bad_request("ec_transfer_params.ec_items must be a list"))?;
    let mut ids = Vec::with_capacity(items.len());
    for (i, hash) in items.iter().enumerate() {
        let by_hash = entries
            .iter()
            .find(|e| e.get("mm_hash").and_then(Value::as_str) == Some(hash));
        let entry = by_hash.or_else(|| entries.get(i).filter(|e| e.get("mm_hash").is_none()));
        let id = entry
            .and_then(|e| e.get("transfer_id"))
            .and_then(Value::as_str)
            .filter(|id| id.len() <= MAX_ID)
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "ec_transfer_params names no transfer_id for item {i}"
                ))
            })?;
        ids.push(id.to_owned());
    }
    Ok(Some((zmq.to_owned(), ids)))
}

/// An encoder leg in push mode: each of `items` (their hashes, in the leg's order, with
/// their embeddings) pushed to the consumer the leg names. `false` when the leg names no
/// consumer (the encoder then writes its shared store).
pub(crate) async fn push(body: &Value, items: &[(String, Vec<u8>)]) -> Result<bool, ApiError> {
    let hashes: Vec<String> = items.iter().map(|(h, _)| h.clone()).collect();
    let Some((zmq, ids)) = push_targets(body, &hashes)? else {
        return Ok(false);
    };
    let addr = zmq.strip_prefix("tcp://").ok_or_else(|| {
        ApiError::bad_request(format!("consumer_zmq {zmq:?} is not tcp://HOST:PORT"))
    })?;
    let connect = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await;
    let mut stream = match connect {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            return Err(push_error(format!(
                "cannot reach the EC consumer {zmq}: {e}"
            )));
        }
        Err(_) => return Err(push_error(format!("the EC consumer {zmq} did not answer"))),
    };
    for ((hash, bytes), id) in items.iter().zip(&ids) {
        let mut frame = Vec::with_capacity(bytes.len() + id.len() + hash.len() + 12);
        field(&mut frame, id.as_bytes());
        field(&mut frame, hash.as_bytes());
        field(&mut frame, bytes);
        let mut ack = [0u8; 1];
        let sent = async {
            stream.write_all(&frame).await?;
            stream.read_exact(&mut ack).await
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, sent).await {
            Ok(Ok(_)) if ack[0] == 1 => {}
            _ => {
                return Err(push_error(format!(
                    "the EC consumer {zmq} refused item {hash}"
                )));
            }
        }
    }
    Ok(true)
}

/// A consumer's request in push mode: every transfer its `ec_transfer_params.ec_items`
/// names, waited for within `wait`, must hold the item it names (hash and embeddings);
/// and every media item of the request (`items`, their hashes) must be among them. How
/// many items were received.
pub(crate) async fn receive(
    pushed: &Pushed,
    body: &Value,
    items: &[String],
    wait: Duration,
    embeddings: impl Fn(&str) -> Vec<u8>,
) -> Result<usize, ApiError> {
    let entries = body
        .get("ec_transfer_params")
        .and_then(|p| p.get("ec_items"))
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let mut received = Vec::with_capacity(entries.len());
    for entry in entries.iter().take(MAX_HELD) {
        let (Some(hash), Some(id)) = (
            entry.get("mm_hash").and_then(Value::as_str),
            entry.get("transfer_id").and_then(Value::as_str),
        ) else {
            return Err(ApiError::bad_request(
                "each ec_transfer_params.ec_items entry needs mm_hash and transfer_id",
            ));
        };
        let Some((pushed_hash, bytes)) = pushed.wait_for(id, wait).await else {
            return Err(push_error(format!(
                "EC transfer {id} (item {hash}) never arrived within {wait:?}"
            )));
        };
        if pushed_hash != hash || bytes != embeddings(hash) {
            return Err(push_error(format!(
                "EC transfer {id} carried item {pushed_hash}, not {hash}"
            )));
        }
        received.push(hash.to_owned());
    }
    for hash in items {
        if !received.contains(hash) {
            return Err(push_error(format!(
                "no encoder output pushed for multimodal item {hash}: this engine has no encoder"
            )));
        }
    }
    Ok(received.len())
}
