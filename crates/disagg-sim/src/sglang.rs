//! SGLang's bootstrap protocol: the request fields, the prefill's bootstrap
//! server and the decode's client for it.

use std::collections::HashSet;
use std::io;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tokio::io::BufReader;
use tokio::net::TcpStream;
use tokio::time::timeout;

use crate::api::{ApiError, CompletionRequest};
use crate::body::Endpoint;
use crate::generate::{KvDigest, kv_digest};
use crate::kv::{self, BootstrapResponse, KvTransferError, peer_gone};
use crate::rendezvous::Rendezvous;
use crate::stats::Counters;

/// SGLang's default `--disaggregation-bootstrap-port`, used by a decode when
/// the request's `bootstrap_port` is null.
pub(crate) const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// KV registered by a prefill under its rooms.
pub(crate) type Rooms = Rendezvous<u64, KvDigest>;

/// The line a decode sends to a prefill's SGLang bootstrap server to take the
/// KV of a room; answered by a [`BootstrapResponse`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootstrapRequest {
    /// The request's `bootstrap_room`.
    pub room: u64,
}

/// One element of a (possibly batched) SGLang request.
#[derive(Debug)]
pub(crate) struct Element {
    pub(crate) host: Option<String>,
    pub(crate) port: u16,
    pub(crate) room: u64,
    /// The KV of the element's prompt.
    pub(crate) digest: KvDigest,
}

/// The batch size of a request as SGLang counts it: `None` for a single
/// request, whose bootstrap fields are scalars.
fn batch_size(body: &Map<String, Value>, request: &CompletionRequest) -> Option<usize> {
    match request.endpoint {
        Endpoint::Chat => (request.n > 1).then_some(request.n as usize),
        Endpoint::Completions => match body.get("prompt") {
            Some(Value::Array(items))
                if items.iter().all(Value::is_string) || items.iter().all(Value::is_array) =>
            {
                Some(items.len())
            }
            _ => None,
        },
    }
}

/// The per-element values of a bootstrap field (`None` where null).
fn field<'a>(
    body: &'a Map<String, Value>,
    key: &str,
    batch: Option<usize>,
) -> Result<Vec<Option<&'a Value>>, ApiError> {
    let value = body.get(key).filter(|v| !v.is_null());
    match (batch, value) {
        (None, None) => Ok(vec![None]),
        (None, Some(Value::Array(_))) => Err(ApiError::bad_request(format!(
            "{key}: a single request takes a single value, not a list"
        ))),
        (None, Some(v)) => Ok(vec![Some(v)]),
        (Some(n), None) => Ok(vec![None; n]),
        (Some(n), Some(Value::Array(items))) if items.len() == n => Ok(items
            .iter()
            .map(|v| Some(v).filter(|v| !v.is_null()))
            .collect()),
        (Some(n), Some(Value::Array(items))) => Err(ApiError::bad_request(format!(
            "{key}: a batch of {n} takes a list of {n} values, got {}",
            items.len()
        ))),
        (Some(n), Some(_)) => Err(ApiError::bad_request(format!(
            "{key}: a batch of {n} takes a list of {n} values, not a single value"
        ))),
    }
}

/// Reads and validates the bootstrap fields of a request, one element per
/// batch item, with the KV of each element's prompt. A prefill needs every
/// room, a decode every host and room.
pub(crate) fn elements(
    body: &Value,
    request: &CompletionRequest,
    model: &str,
    block_size: usize,
    decode: bool,
) -> Result<Vec<Element>, ApiError> {
    let empty = Map::new();
    let body = body.as_object().unwrap_or(&empty);
    let batch = batch_size(body, request);
    let hosts = field(body, "bootstrap_host", batch)?;
    let ports = field(body, "bootstrap_port", batch)?;
    let rooms = field(body, "bootstrap_room", batch)?;
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(rooms.len());
    for (i, ((host, port), room)) in hosts.into_iter().zip(ports).zip(rooms).enumerate() {
        let host = match host {
            None => None,
            Some(Value::String(h)) => Some(h.clone()),
            Some(_) => return Err(ApiError::bad_request("bootstrap_host: should be a string")),
        };
        let port = match port {
            None => DEFAULT_BOOTSTRAP_PORT,
            Some(p) => p
                .as_u64()
                .and_then(|p| u16::try_from(p).ok())
                .filter(|p| *p != 0)
                .ok_or_else(|| ApiError::bad_request("bootstrap_port: should be a port number"))?,
        };
        let room = match room {
            None => None,
            Some(r) => Some(
                r.as_u64()
                    .filter(|r| i64::try_from(*r).is_ok())
                    .ok_or_else(|| {
                        ApiError::bad_request("bootstrap_room: should be an integer in [0, 2^63)")
                    })?,
            ),
        };
        let Some(room) = room else {
            return Err(ApiError::bad_request(
                "bootstrap_room is required in disaggregation mode",
            ));
        };
        if decode && host.is_none() {
            return Err(ApiError::bad_request(
                "bootstrap_host is required in disaggregation mode",
            ));
        }
        if !seen.insert(room) {
            return Err(ApiError::bad_request(format!(
                "bootstrap_room: room {room} appears twice in the batch"
            )));
        }
        // Chat elements share the conversation; completion element i is prompt i.
        let prompt = match request.endpoint {
            Endpoint::Chat => request.prompts.first(),
            Endpoint::Completions => request.prompts.get(i),
        }
        .map_or(&[][..], Vec::as_slice);
        out.push(Element {
            host,
            port,
            room,
            digest: kv_digest(model, block_size, prompt.iter().copied()),
        });
    }
    Ok(out)
}

/// Serves one bootstrap connection: request lines, each answered by one
/// line once the room is registered (or the wait runs out). A decode that
/// leaves while waiting takes nothing.
pub(crate) async fn serve_bootstrap(
    rooms: &Rooms,
    counters: &Counters,
    wait: Duration,
    mut stream: TcpStream,
) -> io::Result<()> {
    let (read, mut write) = stream.split();
    let mut reader = BufReader::new(read);
    while let Some(line) = kv::next_line(&mut reader).await? {
        let answer = match serde_json::from_slice::<BootstrapRequest>(&line) {
            Err(e) => BootstrapResponse::failure(format!("malformed request: {e}")),
            Ok(BootstrapRequest { room }) => tokio::select! {
                taken = rooms.take(counters, &room, wait) => kv::taken_or_timed_out(
                    counters,
                    taken,
                    || format!("room {room} was not registered within {wait:?}"),
                ),
                () = peer_gone(&mut reader) => return Ok(()),
            },
        };
        kv::write_line(&mut write, &answer).await?;
    }
    Ok(())
}

/// Takes the KV of one room from the bootstrap server at `host:port`,
/// waiting for the prefill as long as the caller lets it.
async fn fetch_one(host: &str, port: u16, room: u64) -> Result<KvDigest, KvTransferError> {
    let mut stream = kv::connect(host, port)
        .await
        .map_err(|e| KvTransferError::Unreachable {
            addr: format!("{host}:{port}"),
            reason: match e {
                KvTransferError::Connect { source, .. } => source.to_string(),
                other => other.to_string(),
            },
        })?;
    let answer: BootstrapResponse = kv::request_line(&mut stream, &BootstrapRequest { room })
        .await
        .map_err(|e| match e {
            KvTransferError::Malformed(m) => KvTransferError::Bootstrap(format!(
                "{host}:{port} is not an SGLang bootstrap server: {m}"
            )),
            other => other,
        })?;
    answer.into_digest(&format!("room {room}"))
}

/// Takes the KV of every element from its prefill, all at once, within
/// `wait`, and checks each against the element's own KV.
pub(crate) async fn fetch(elements: &[Element], wait: Duration) -> Result<(), KvTransferError> {
    let fetches = elements.iter().map(|e| async move {
        let host = e.host.as_deref().unwrap_or_default();
        let room = e.room;
        let remote = timeout(wait, fetch_one(host, e.port, room))
            .await
            .map_err(|_| {
                KvTransferError::PeerTimeout(format!("no prefill for room {room} within {wait:?}"))
            })??;
        kv::check_kv(&remote, &e.digest)
    });
    futures::future::try_join_all(fetches).await.map(drop)
}
